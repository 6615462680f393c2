"""Rotary position embedding (RoPE, Su et al. 2021, "RoFormer"): a rotation of pairs of a head dim by angles
that grow with the position, read from the sequence index (as masks read theirs) or from an array of positions.

Pair ``i`` of the first ``rotary_dim`` entries of the head dim ``d`` turns by ``pos · base^(−2i/rotary_dim)``;
the rest pass through. Two conventions pair the entries: GPT-NeoX's "rotate half" (Llama's: entry ``i`` with
``i + rotary_dim/2``) and GPT-J's interleaved pairs (``2i`` with ``2i + 1``). Inside a block the rotation is
``(a·cos θ − b·sin θ, b·cos θ + a·sin θ)`` for each pair ``(a, b)``, on the halves a block splits into (rotated
parts of a power-of-two share of the head dim; any other, ``x·cos θ + (x·R)·sin θ`` with ``R`` the constant signed
permutation ``[d, d]`` that sends ``(a, b)`` to ``(−b, a)``).

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array, to_jax
>>> n, d = axes("n d", d=4)
>>> rope = rotary(Array(n, d), n, d, base=100.0)
>>> [round(float(v), 3) for v in to_jax(rope)(jnp.ones((2, 4)))[1]]  # position 1: pair (0, 2) by 1 rad, (1, 3) by 0.1
[-0.301, 0.895, 1.382, 1.095]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators._base import Generator, align, along, heads


@dataclass(frozen=True)
class Rope:
    """How to rotate queries and keys (:func:`rotary`; ``nc.attention(..., rope=Rope())``): ``base`` (θ),
    ``rotary_dim`` (None: the whole head dim; an even number ≤ it, the rest passed through), ``interleaved``
    (GPT-J's pairs ``(2i, 2i+1)``; default GPT-NeoX's and Llama's "rotate half"), ``offset`` (added to the
    sequence index), ``positions`` (None: the sequence index; for ``nc.attention`` integers ``[B, N]``, or a
    pair ``(q_positions [B, Nq], kv_positions [B, Nk])``, read when the kernel is called: packed sequences) and
    ``fused``: False (the default) rotates q and k once, by XLA, before the kernel (:meth:`rotate`: one more read
    and write of each); True rotates them inside the kernels as their blocks load, forward and backward, which
    rotates each key block once per query tile (Triton and XLA backends only; papers/flash_attention/rope.py
    times both).

    >>> Rope(rotary_dim=64).static()
    Rope(base=10000.0, rotary_dim=64, interleaved=False, offset=0, positions=None, fused=False)
    >>> Rope(base=0.0)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: Rope: base must be a number > 0 (θ, 10000.0 in RoFormer and Llama), got 0.0
    """

    base: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    offset: int = 0
    positions: object = None
    fused: bool = False

    def __post_init__(self):
        if isinstance(self.base, bool) or not isinstance(self.base, int | float) or not self.base > 0:
            raise EvaluationError(
                f"Rope: base must be a number > 0 (θ, 10000.0 in RoFormer and Llama), got {self.base!r}"
            )
        rd = self.rotary_dim
        if rd is not None and (isinstance(rd, bool) or not isinstance(rd, int) or rd <= 0 or rd % 2):
            raise EvaluationError(f"Rope: rotary_dim must be a positive even int (it rotates pairs), got {rd!r}")
        if isinstance(self.offset, bool) or not isinstance(self.offset, int):
            raise EvaluationError(f"Rope: offset must be an int (added to the sequence index), got {self.offset!r}")
        if not isinstance(self.fused, bool):
            raise EvaluationError(
                f"Rope: fused must be a bool (rotate inside the kernels or before), got {self.fused!r}"
            )
        object.__setattr__(self, "base", float(self.base))

    def static(self) -> Rope:
        """The same rotation without its positions array: what a kernel depends on (hashable)."""
        return Rope(self.base, self.rotary_dim, bool(self.interleaved), self.offset, fused=self.fused)

    def rotate(self, x, positions=None):
        """``x [B, N, H, D]`` rotated at the sequence index (plus ``offset``), or at ``positions [B, N]`` (integers):
        the :func:`rotary` box's own semantics, run by XLA, in ``x``'s dtype (computed in f32).

        >>> import jax.numpy as jnp
        >>> x = jnp.ones((1, 2, 1, 4))
        >>> [round(float(v), 3) for v in Rope(base=100.0).rotate(x)[0, 1, 0]]  # position 1, as :func:`rotary`'s
        [-0.301, 0.895, 1.382, 1.095]
        """
        from napkin_cat.semantics import to_jax

        wire, (b, n, _, d) = heads(x)
        pos = None if positions is None else Array(b, n, dtype="i32")
        box = rotary(
            wire,
            n,
            d,
            base=self.base,
            rotary_dim=self.rotary_dim,
            interleaved=self.interleaved,
            offset=self.offset,
            positions=pos,
        )
        return to_jax(box)(x, *(() if positions is None else (positions,)))


class Rotary(Generator):
    """The rotation of the pairs of axis ``dim`` by ``sign · pos · base^(−2i/rotary_dim)``, ``pos`` the index along
    ``seq`` plus ``offset``, or the second input (positions, integers over some of the first input's axes). Its
    backward is the rotation by the opposite angles (``sign`` flipped): a rotation's transpose is its inverse.

    >>> from napkin_cat import axes
    >>> q, d = axes("q d", d=8)
    >>> box = rotary(Array(q, d), q, d)
    >>> box.mixes, box.flops(), box.tensor_flops(), box.transcendentals()
    (('d',), 160*q, 128*q, 16*q)
    """

    family, symbol = "mask", "R"

    @property
    def mixes(self):
        return (self.params["dim"],)

    def index_reads(self) -> tuple[str, ...]:
        """The axes whose global index the box reads: the sequence axis, unless positions are an input."""
        return () if len(self.dom.inside) > 1 else (self.params["seq"],)

    def linear_on(self, wire: Array) -> Rotary:
        """The same rotation of a first input ``wire`` with more axes (none it rotates along): it is linear in
        that input and acts on each element of the others alone, so it commutes with a sum over them (the
        backward's cotangent of grouped keys, summed over the group after the kernel).

        >>> from napkin_cat import axes
        >>> g, x, d = axes("g x d", d=8)
        >>> print(rotary(Array(x, d), x, d).linear_on(Array(g, x, d)).dom)
        g×x×d
        """
        return Rotary(self.name, Ty(wire, *self.dom.inside[1:]), Ty(wire), data=self.data)

    def evaluate(self, ins, ctx):
        xp, p, X = ctx.xp, self.params, self.dom.inside[0]
        v = ins[0]
        shape, at = tuple(xp.shape(v)), X.names.index(p["dim"])
        D = shape[at]
        rd = _rotary_dim(p["rotary_dim"], D, self.name)
        if len(ins) > 1:
            pos = xp.f32(align(xp, ins[1], self.dom.inside[1], X))
        else:
            rows = tuple(1 if i == at else n for i, n in enumerate(shape))  # every axis but the head dim
            pos = xp.f32(ctx.indices(X, rows)[p["seq"]] + p["offset"])
        if D % rd or (D // rd) & (D // rd - 1):  # the rotated part is no power-of-two share: the product with R
            return [xp.cast(_turned(xp, v, pos, at, rd, p), self.out.dtype)]
        if rd == D:
            return [xp.cast(_pairs(xp, xp.f32(v), pos, at, p), self.out.dtype)]
        first, *rest = xp.split(xp.f32(v), D // rd, at)
        return [xp.cast(xp.join([_pairs(xp, first, pos, at, p), *rest], at), self.out.dtype)]

    def flops(self):
        # the angle, x·cos + (x·R)·sin, and the product with R
        return 4 * self.out.size + self.tensor_flops()

    def tensor_flops(self):
        return 2 * self.out.size * self.out.axis(self.params["dim"]).size

    def transcendentals(self):
        return 2 * self.out.size  # cos and sin

    def lines(self, prog, ins, outs):
        p = self.params
        pos = prog.ix(ins[1]) if len(ins) > 1 else f"{p['seq']}{f' + {p["offset"]}' if p['offset'] else ''}"
        how = "pairs (2i, 2i+1)" if p["interleaved"] else "rotate half"
        theta = f"{'−' if p['sign'] < 0 else ''}{pos}·{p['base']:g}^(−2i/{p['rotary_dim'] or p['dim']})"
        text = f"{prog.ix(outs[0])} = rotate {prog.ix(ins[0])} by {theta} along {p['dim']}   # {how}"
        return [(text, outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        C, sign = t.ty(cts[0]), -self.params["sign"]
        flipped = tuple((k, sign if k == "sign" else v) for k, v in self.data)
        name = f"rope{'⁻¹' if sign < 0 else ''} {self.params['seq']}"
        back = Rotary(name, Ty(C, *(t.ty(n) for n in ins[1:])), Ty(C), data=flipped)
        return [t(back, cts[0], *ins[1:]), *([None] * (len(ins) - 1))]


def _rotary_dim(rotary_dim: int | None, D: int, where: str) -> int:
    rd = D if rotary_dim is None else rotary_dim
    if rd % 2 or not 0 < rd <= D:
        raise EvaluationError(
            f"{where}: rotary_dim = {rd} must be even and at most the head dim {D} (pairs of it are rotated); "
            "pass rotary_dim=None to rotate it whole"
        )
    return rd


def _angles(xp, pos, like: tuple, at: int, rd: int, p: dict):
    """``sign · pos · base^(−2i/rd)`` for pair ``i`` along axis ``at`` of a block of shape ``like``."""
    pair = xp.iota(tuple(n if i == at else 1 for i, n in enumerate(like)), at)
    return pos * (xp.exp(xp.f32(pair) * (-2.0 * math.log(p["base"]) / rd)) * p["sign"])


def _pairs(xp, x, pos, at: int, p: dict):
    """The rotated block ``x`` (f32, its ``rd`` entries along ``at`` all rotated): each pair ``(a, b)`` to
    ``(a·cos θ − b·sin θ, b·cos θ + a·sin θ)``, the pairs' halves split apart and joined back, so the work is
    elementwise on ``rd/2`` angles (Pallas' Triton lowers neither a gather nor a slice of the head axis, but
    splits into equal halves and joins)."""
    shape = tuple(xp.shape(x))
    rd = shape[at]
    if p["interleaved"]:  # pairs (2i, 2i+1): a new axis of size 2 after ``at`` holds each pair
        x = xp.reshape(x, shape[:at] + (rd // 2, 2) + shape[at + 1 :])
        pos, cut = xp.expand_dims(pos, at + 1), at + 1
    else:  # rotate half: pairs (i, i + rd/2)
        cut = at
    a, b = xp.split(x, 2, cut)
    theta = _angles(xp, pos, tuple(xp.shape(a)), at, rd, p)
    cos, sin = xp.cos(theta), xp.sin(theta)
    out = xp.join([a * cos - b * sin, b * cos + a * sin], cut)
    return xp.reshape(out, shape) if p["interleaved"] else out


def _turned(xp, v, pos, at: int, rd: int, p: dict):
    """``v·cos θ + (v·R)·sin θ`` with ``R`` the constant ``[D, D]`` signed permutation sending each pair ``(a, b)``
    of the first ``rd`` entries to ``(−b, a)`` and the rest to 0: a rotated part that no equal split reaches."""
    shape = tuple(xp.shape(v))
    D = shape[at]
    j = xp.iota(tuple(n if i == at else 1 for i, n in enumerate(shape)), at)
    inv = xp.exp(xp.f32(j // 2 if p["interleaved"] else j % (rd // 2)) * (-2.0 * math.log(p["base"]) / rd))
    angle = pos * xp.where(j < rd, inv * p["sign"], 0.0)
    i, j = xp.iota((D, D), 0), xp.iota((D, D), 1)
    if p["interleaved"]:
        partner, first = j + 1 - 2 * (j % 2), j % 2 == 0
    else:
        h = rd // 2
        partner, first = xp.where(j < h, j + h, j - h), j < h
    R = xp.where((i == partner) & (j < rd), xp.where(first, -1.0, 1.0), 0.0)
    return xp.f32(v) * xp.cos(angle) + along(xp, v, at, R) * xp.sin(angle)


def rotary(
    a: Array,
    seq: Axis | str,
    dim: Axis | str,
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    interleaved: bool = False,
    offset: int = 0,
    positions: Array | None = None,
) -> Rotary:
    """RoPE on ``a``: the pairs of axis ``dim`` rotated by ``pos · base^(−2i/rotary_dim)``, ``pos`` the index along
    ``seq`` plus ``offset``, or the input ``positions`` (an integer array over ``seq`` and some of ``a``'s other
    axes, a second input of the box). The output has ``a``'s type. See the module's docstring (and :class:`Rope`)
    for the conventions.

    >>> from napkin_cat import axes, Array
    >>> b, n, d = axes("b n d", d=64)
    >>> rotary(Array(b, n, d), n, d, positions=Array(b, n, dtype="i32")).dom.inside[1].describe()
    'b×n:i32@HBM'
    >>> rotary(Array(b, n, d), n, d, rotary_dim=96)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: rope n: rotary_dim = 96 must be even and at most the head dim 64 (pairs of \
it are rotated); pass rotary_dim=None to rotate it whole
    """
    seq, dim = (getattr(v, "name", v) for v in (seq, dim))
    Rope(base, rotary_dim, interleaved, offset)  # the parameters' checks
    for n in (seq, dim):
        if n not in a.names:
            raise AxisError(f"rotary: axis {n!r} is not an axis of {a.describe()}")
    if seq == dim:
        raise AxisError(f"rotary: the sequence axis and the head dim must differ, both are {seq!r}")
    size = sympy.sympify(a.axis(dim).size)
    name = f"rope {seq}"
    if size.is_number:
        _rotary_dim(rotary_dim, int(size), name)
    dom = Ty(a)
    if positions is not None:
        if seq not in positions.names or not set(positions.names) <= set(a.names) - {dim}:
            raise AxisError(
                f"rotary: positions {positions.describe()} must be indexed by {seq!r} and by axes of {a.describe()} "
                f"other than the head dim {dim!r}"
            )
        if positions.dtype.name != "i32":
            raise AxisError(f"rotary: positions {positions.describe()} must be integers (i32)")
        dom = Ty(a, positions)
    data = (
        ("seq", seq),
        ("dim", dim),
        ("base", float(base)),
        ("rotary_dim", rotary_dim),
        ("interleaved", bool(interleaved)),
        ("offset", int(offset)),
        ("sign", 1),
    )
    return Rotary(name, dom, Ty(a), data=data)
