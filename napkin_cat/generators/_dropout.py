"""Attention dropout: a keep mask hashed from (seed, batch, head, query, key), never stored.

The mask is a counter-based hash: every element's bit is a pure function of its global indices and a 32-bit
seed, written with ``jax.numpy`` integer ops, so the reference semantics, a Triton or Mosaic kernel body and the
XLA backend compute the same bits for any tiling, and a backward kernel regenerates the forward's mask from the
seed instead of reading it. The hash is split so that almost all of it runs on vectors, not on the block
(:func:`keep_bits`): a strong hash of each row (seed, batch, head, query), a lighter one of each key, and per
element one xor and one multiply. A probability is kept, and divided by ``1 − rate``, where its bits are at least
``rate · 2³²``. The division is a constant factor: inside attention's kernels it is carried once per row (the
forward's normaliser, the backward's recomputed probabilities and Δ), never per weight.

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array
>>> q, x = axes("q x")
>>> drop = Drop(0.5, "q", "x")
>>> box = dropout(Array(q, x), Array(dtype="i32"), drop)
>>> box.name, box.flops()
('dropout 0.5', 5*q*x)
>>> kept = keep_bits(7, 0, 0, jnp.arange(256)[:, None], jnp.arange(256)) >= jnp.uint32(threshold(0.5))
>>> 0.45 < float(kept.mean()) < 0.55
True
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax

from napkin_cat.diagram import Array, Ty
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators._base import Generator, align

#: operations per element of the mask: the hash's xor and multiply, the compare with the threshold and the select
#: (the rows' and keys' hashes run on vectors, :func:`keep_bits`); the scale by ``1 / (1 − rate)`` is one more where a
#: box applies it per element (:class:`Dropout` alone), none in the fused attention's forward and backward (once per
#: row: :class:`~napkin_cat.generators.SoftmaxContract`)
FLOPS = 4

_GOLDEN = 0x9E3779B9  # 2³²/φ, odd: multiplying by it is a bijection that spreads consecutive indices apart
_KEYS = 0x85EBCA6B  # offsets the head's key before it keys the keys' hash, so rows and keys hash apart
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def _u32(v):
    return lax.convert_element_type(jnp.asarray(v), jnp.uint32)


def _shr(v, n: int):
    return lax.shift_right_logical(v, jnp.uint32(n))


def mix(v):
    """Wellons' ``lowbias32`` integer hash: a bijection on uint32 whose every output bit depends on every input bit
    (8 operations: three shifts, three xors, two multiplies).

    >>> int(mix(jnp.uint32(0))), int(mix(jnp.uint32(1)))
    (0, 1753845952)
    """
    v = _u32(v)
    v = v ^ _shr(v, 16)
    v = v * jnp.uint32(_M1)
    v = v ^ _shr(v, 15)
    v = v * jnp.uint32(_M2)
    return v ^ _shr(v, 16)


def head_key(seed, b, h):
    """The 32-bit key of one (batch row, head) under ``seed``: both hashed with it (two :func:`mix`).

    >>> int(head_key(1, 0, 0)) != int(head_key(1, 0, 1))
    True
    """
    return mix(_u32(seed) ^ mix(_u32(b) * jnp.uint32(_GOLDEN) + _u32(h)))


def row_bits(key, q):
    """The hash ``R`` of the query ``q`` under a head's ``key``: one :func:`mix` (a bijection of ``q``); ``R | 1``
    is the row's odd multiplier. 10 operations per row.

    >>> int(row_bits(jnp.uint32(5), 3)) != int(row_bits(jnp.uint32(5), 4))
    True
    """
    return mix(_u32(key) ^ _u32(q))


def key_bits(key, x):
    """The hash ``C`` of the key index ``x`` under a head's ``key``: ``x`` xored with the head's key for keys,
    one multiply and one xorshift (a bijection of ``x``; 4 operations per key once the head's key is known).

    >>> [int(c) % 7 for c in key_bits(jnp.uint32(5), jnp.arange(3))] != [0, 0, 0]
    True
    """
    c = (_u32(x) ^ mix(_u32(key) + jnp.uint32(_KEYS))) * jnp.uint32(_M1)
    return c ^ _shr(c, 16)


def combine(row, key):
    """The element's bits from its row's hash and its key's: ``(R ⊕ C) · (R | 1)``, 2 operations per element (the
    row's multiplier ``R | 1`` is computed once per row). For a fixed row a bijection of ``C``, for a fixed key one
    of ``R``; the row's own odd multiplier carries the xor's nonlinearity into the high bits the threshold reads,
    so two keys whose hashes differ in few bits are not linked the same way in every row.

    >>> int(combine(jnp.uint32(3), jnp.uint32(5)))
    18
    """
    return (row ^ key) * (row | jnp.uint32(1))


def keep_bits(seed, b, h, q, x):
    """The 32 hashed bits of the element ``(b, h, q, x)`` under ``seed`` (integers, broadcast together): the head's
    key (:func:`head_key`), the row's hash (:func:`row_bits`) and the key's (:func:`key_bits`), combined
    (:func:`combine`). A kernel computes the same composition with the rows' and keys' hashes on vectors: per
    element of a block 3 integer operations (xor, multiply, the compare with the threshold), where hashing each
    element whole with two ``lowbias32`` rounds took 22 (index grids included).

    >>> bits = keep_bits(1, 0, 0, jnp.arange(2)[:, None], jnp.arange(2))
    >>> bits.dtype, len(set(bits.ravel().tolist()))
    (dtype('uint32'), 4)
    """
    key = head_key(seed, b, h)
    return combine(row_bits(key, q), key_bits(key, x))


def threshold(rate: float) -> int:
    """The least bits a kept element has: ``rate · 2³²``, rounded (so an element is kept with probability
    ``1 − rate`` to within 2⁻³²).

    >>> threshold(0.0), threshold(0.5)
    (0, 2147483648)
    """
    return min(round(rate * 2**32), 2**32 - 1)


def check_rate(rate, where: str = "attention") -> float:
    """``rate`` as a float in ``[0, 1)``, or an :class:`~napkin_cat.errors.EvaluationError` naming it.

    >>> check_rate(1.0)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: dropout_rate must be a Python number in [0, 1), got 1.0; \
pass the probability of dropping a weight (0.1 drops one in ten; 0 turns dropout off)
    """
    fix = "pass the probability of dropping a weight (0.1 drops one in ten; 0 turns dropout off)"
    if not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not 0.0 <= float(rate) < 1.0:
        raise EvaluationError(f"{where}: dropout_rate must be a Python number in [0, 1), got {rate!r}; {fix}")
    return float(rate)


@dataclass(frozen=True)
class Drop:
    """Dropout at ``rate`` on scores or probabilities indexed by query ``q`` and key ``x``, hashed with the batch
    axis ``batch`` and the heads ``heads`` (empty: the same mask for every batch row or head, Flax's
    ``broadcast_dropout``); two head axes ``(h_kv, g)`` are grouped-query attention's, read as the query head
    ``h_kv · group + g``.

    >>> Drop(0.1, "q", "x", "b", ("h_kv", "g"), 4).head({"h_kv": 2, "g": 1})
    9
    """

    rate: float
    q: str
    x: str
    batch: str | None = None
    heads: tuple[str, ...] = ()
    group: int = 1

    def head(self, idx: dict):
        """The query head of the indices ``idx`` (0 where no head is hashed)."""
        if not self.heads:
            return 0
        if len(self.heads) == 1:
            return idx[self.heads[0]]
        kv, g = self.heads
        return idx[kv] * self.group + idx[g]

    def keep(self, seed, idx: dict):
        """Whether each element of the global indices ``idx`` (by axis name, broadcast together) is kept under
        ``seed``: :func:`keep_bits` against the rate's :func:`threshold`.

        >>> float(Drop(0.25, "q", "x").keep(7, {"q": jnp.arange(64)[:, None], "x": jnp.arange(64)}).mean())
        0.76171875
        """
        b = idx[self.batch] if self.batch is not None else 0
        bits = keep_bits(seed, b, self.head(idx), idx[self.q], idx[self.x])
        return bits >= jnp.uint32(threshold(self.rate))

    def apply(self, xp, p, seed, ctx, wire: Array, seed_wire: Array, scaled: bool = True):
        """``p ⊙ M / (1 − rate)`` on a block ``p`` laid out as ``wire``, at the block offsets of ``ctx``, the seed's
        block laid out as ``seed_wire``; ``p ⊙ M`` where not ``scaled`` (a caller dividing by ``1 − rate`` once per
        row instead: the online softmax's output). The rows' hashes are computed over the block's dimensions other
        than the key's (a vector of the queries in a kernel's 2-D block), the keys' over those other than the
        query's, and both spread over the block for the per-element :func:`combine`."""
        shape, names = tuple(xp.shape(p)), wire.names
        rows = tuple(i for i, n in enumerate(names) if n != self.x)
        keys = tuple(i for i, n in enumerate(names) if n != self.q)
        row = row_bits(self._key(xp, seed, ctx, wire, seed_wire, shape, rows), self._index(xp, ctx, wire, shape,
                                                                                           rows, self.q))
        col = key_bits(self._key(xp, seed, ctx, wire, seed_wire, shape, keys), self._index(xp, ctx, wire, shape,
                                                                                           keys, self.x))
        row, mul, col = (xp.broadcast_in_dim(v, shape, dims) for v, dims in
                         ((row, rows), (row | jnp.uint32(1), rows), (col, keys)))
        kept = (row ^ col) * mul >= jnp.uint32(threshold(self.rate))  # combine(), its row multiplier spread
        return xp.where(kept, p * self.scale if scaled else p, 0.0)

    @property
    def scale(self) -> float:
        """``1 / (1 − rate)``: what each kept weight is multiplied by (the one place it is computed).

        >>> Drop(0.5, "q", "x").scale
        2.0
        """
        return 1.0 / (1.0 - self.rate)

    def _index(self, xp, ctx, wire: Array, shape: tuple, dims: tuple, name: str):
        """The global index along the axis ``name`` over the block's dimensions ``dims``: a vector or grid where
        the axis is on the block, else the program's index along a grid axis (a kernel's batch or head), else 0 (a
        box probed alone, outside any kernel, for the padding its inputs take, reads index 0)."""
        if name in wire.names:
            return xp.iota_over(shape, dims, wire.names.index(name)) + ctx.offsets.get(name, 0)
        return ctx.indices(Array(), ()).get(name, 0)  # an empty wire's indices: the grid's, in a kernel

    def _key(self, xp, seed, ctx, wire: Array, seed_wire: Array, shape: tuple, dims: tuple):
        """The :func:`head_key` over the block's dimensions ``dims`` (a scalar in a kernel, whose seed, batch
        row and head are the program's)."""
        sub = Array(*(wire.axes[i] for i in dims))
        seed = align(xp, seed, seed_wire, sub) if seed_wire.axes else seed  # a kernel's seed: one scalar
        idx = {n: self._index(xp, ctx, wire, shape, dims, n) for n in self.names if n not in (self.q, self.x)}
        b = idx[self.batch] if self.batch is not None else 0
        return head_key(seed, b, self.head(idx))

    @property
    def names(self) -> tuple[str, ...]:
        """The axes the mask reads."""
        return (*([self.batch] if self.batch else []), *self.heads, self.q, self.x)

    @property
    def __name__(self):
        return f"dropout {self.rate:g}"


class Dropout(Generator):
    """Dropout of probabilities ``P`` (laid out with the axes of :class:`Drop`) under a seed input: ``P ⊗ seed →
    P ⊙ M / (1 − rate)``, ``M`` the hashed keep mask. Linear in ``P``: its derivative is itself (the same mask on
    the cotangent), and it commutes with scaling ``P`` by any row factor, which is why it passes through the online
    softmax's rescaling into :class:`~napkin_cat.generators.SoftmaxContract` (``("dropout", drop)`` in its data).
    With ``("scaled", False)`` in its data it is the mask alone, ``P ⊙ M`` (a backward that carries the constant
    ``1 / (1 − rate)`` once per row instead: :meth:`SoftmaxContract.backward
    <napkin_cat.generators.SoftmaxContract.backward>`).

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes, Array, to_jax
    >>> q, x = axes("q x")
    >>> box = dropout(Array(q, x), Array(dtype="i32"), Drop(0.5, "q", "x"))
    >>> out = to_jax(box)(jnp.ones((4, 4)), jnp.int32(3))
    >>> sorted(set(out.ravel().tolist()))
    [0.0, 2.0]
    >>> mask = dropout(Array(q, x), Array(dtype="i32"), Drop(0.5, "q", "x"), scaled=False)
    >>> bool(jnp.all(to_jax(mask)(jnp.ones((4, 4)), jnp.int32(3)) * 2 == out)), mask.name, mask.flops()
    (True, 'dropout 0.5 mask', 4*q*x)
    """

    family, symbol = "mask", "P"

    @property
    def drop(self) -> Drop:
        """The dropout's rate and the axes it hashes."""
        return self.params["drop"]

    @property
    def scaled(self) -> bool:
        """Whether each kept weight is divided by ``1 − rate`` here (dropout's definition), not only masked."""
        return self.params.get("scaled", True)

    def evaluate(self, ins, ctx):
        (p, seed), xp = ins, ctx.xp
        dropped = self.drop.apply(xp, xp.f32(p), seed, ctx, *self.dom.inside, scaled=self.scaled)
        return [xp.cast(dropped, self.out.dtype)]

    def flops(self):
        return (FLOPS + self.scaled) * self.out.size

    def lines(self, prog, ins, outs):
        (p, seed), rate = ins, self.drop.rate
        text = f"{prog.ix(outs[0])} = {prog.ix(p)} ⊙ (hash({prog.ix(seed)}, indices) ≥ {rate:g}·2³²)"
        return [(text + (f" / {1 - rate:g}" if self.scaled else ""), outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        return [t(self, cts[0], ins[1]), None]


def dropout(p: Array, seed: Array, drop: Drop, *, scaled: bool = True) -> Dropout:
    """The dropout box on ``p``, reading the int32 ``seed`` (an array over some of ``p``'s batch axes); without
    ``scaled``, its mask alone (``p ⊙ M``: the kept weights not divided by ``1 − rate``).

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> dropout(Array(q), Array(dtype="i32"), Drop(0.1, "q", "x"))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: dropout 0.1: hashes axes ['x'] that q:f32@HBM lacks
    """
    missing = [n for n in drop.names if n not in p.names]
    if missing:
        raise AxisError(f"{drop.__name__}: hashes axes {missing} that {p.describe()} lacks")
    if seed.dtype.name != "i32" or any(n not in p.names for n in seed.names):
        raise AxisError(
            f"{drop.__name__}: the seed must be i32 over batch axes of {p.describe()}, got {seed.describe()}"
        )
    check_rate(drop.rate, drop.__name__)
    if scaled:
        return Dropout(drop.__name__, Ty(p, seed), Ty(p), data=(("drop", drop),))
    return Dropout(f"{drop.__name__} mask", Ty(p, seed), Ty(p), data=(("drop", drop), ("scaled", False)))
