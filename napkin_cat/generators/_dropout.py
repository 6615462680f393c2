"""Attention dropout: a keep mask hashed from (seed, batch, head, query, key), never stored.

The mask is a counter-based hash: every element's bit is a pure function of its global indices and a 32-bit
seed (three rounds of a 32-bit integer mixer, Wellons' ``lowbias32``, a bijection on uint32), written with
``jax.numpy`` integer ops, so the reference semantics, a Triton or Mosaic kernel body and the XLA backend compute
the same bits, and a backward kernel regenerates the forward's mask from the seed instead of reading it.
A probability is kept, and divided by ``1 − rate``, where its bits are at least ``rate · 2³²``.

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array
>>> q, x = axes("q x")
>>> drop = Drop(0.5, "q", "x")
>>> box = dropout(Array(q, x), Array(dtype="i32"), drop)
>>> box.name, box.flops()
('dropout 0.5', 22*q*x)
>>> kept = drop.keep(jnp.int32(7), {"q": jnp.arange(256)[:, None], "x": jnp.arange(256)})
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

#: integer operations per element of the mask: one ``lowbias32`` round (three shifts, three xors, two multiplies)
#: for the row and one for the key, the key's multiply-add, the compare, the select and the scale
FLOPS = 22

_GOLDEN = 0x9E3779B9  # 2³²/φ, odd: multiplying by it is a bijection that spreads consecutive indices apart


def _u32(v):
    return lax.convert_element_type(jnp.asarray(v), jnp.uint32)


def mix(v):
    """Wellons' ``lowbias32`` integer hash: a bijection on uint32 whose every output bit depends on every input bit.

    >>> int(mix(jnp.uint32(0))), int(mix(jnp.uint32(1)))
    (0, 1753845952)
    """
    v = _u32(v)
    v = v ^ lax.shift_right_logical(v, jnp.uint32(16))
    v = v * jnp.uint32(0x7FEB352D)
    v = v ^ lax.shift_right_logical(v, jnp.uint32(15))
    v = v * jnp.uint32(0x846CA68B)
    return v ^ lax.shift_right_logical(v, jnp.uint32(16))


def keep_bits(seed, b, h, q, x):
    """The 32 hashed bits of the element ``(b, h, q, x)`` under ``seed`` (integers, broadcast together): the
    seed mixed with the batch and head, then with the query (once per row), then with the key.

    >>> bits = keep_bits(1, 0, 0, jnp.arange(2)[:, None], jnp.arange(2))
    >>> bits.dtype, len(set(bits.ravel().tolist()))
    (dtype('uint32'), 4)
    """
    head = mix(_u32(seed) ^ mix(_u32(b) * jnp.uint32(_GOLDEN) + _u32(h)))
    row = mix(head ^ _u32(q))
    return mix(row + _u32(x) * jnp.uint32(_GOLDEN))


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
        """Whether each element of the global indices ``idx`` (by axis name) is kept under ``seed``."""
        b = idx[self.batch] if self.batch is not None else 0
        return keep_bits(seed, b, self.head(idx), idx[self.q], idx[self.x]) >= jnp.uint32(threshold(self.rate))

    def apply(self, xp, p, seed, ctx, wire: Array, seed_wire: Array):
        """``p ⊙ M / (1 − rate)`` on a block ``p`` laid out as ``wire``, at the block offsets of ``ctx``, the seed's
        block laid out as ``seed_wire``."""
        idx = ctx.indices(wire, xp.shape(p))
        seed = align(xp, seed, seed_wire, wire) if seed_wire.axes else seed  # a kernel's seed: one scalar
        # a batch axis neither on the block nor in the context's grid (a box probed alone, outside any kernel, for
        # the padding its inputs take) reads index 0; a kernel's context has every grid axis
        kept = self.keep(seed, {n: idx.get(n, 0) for n in self.names})
        return xp.where(kept, p * (1.0 / (1.0 - self.rate)), 0.0)

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

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes, Array, to_jax
    >>> q, x = axes("q x")
    >>> out = to_jax(dropout(Array(q, x), Array(dtype="i32"), Drop(0.5, "q", "x")))(jnp.ones((4, 4)), jnp.int32(3))
    >>> sorted(set(out.ravel().tolist()))
    [0.0, 2.0]
    """

    family, symbol = "mask", "P"

    @property
    def drop(self) -> Drop:
        """The dropout's rate and the axes it hashes."""
        return self.params["drop"]

    def evaluate(self, ins, ctx):
        (p, seed), xp = ins, ctx.xp
        dropped = self.drop.apply(xp, xp.f32(p), seed, ctx, *self.dom.inside)
        return [xp.cast(dropped, self.out.dtype)]

    def flops(self):
        return FLOPS * self.out.size

    def lines(self, prog, ins, outs):
        (p, seed), rate = ins, self.drop.rate
        text = f"{prog.ix(outs[0])} = {prog.ix(p)} ⊙ (hash({prog.ix(seed)}, indices) ≥ {rate:g}·2³²) / {1 - rate:g}"
        return [(text, outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        return [t(self, cts[0], ins[1]), None]


def dropout(p: Array, seed: Array, drop: Drop) -> Dropout:
    """The dropout box on ``p``, reading the int32 ``seed`` (an array over some of ``p``'s batch axes).

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
    return Dropout(drop.__name__, Ty(p, seed), Ty(p), data=(("drop", drop),))
