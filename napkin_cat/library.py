"""The architecture library: common computations as diagrams.

Every entry is checked against an independent JAX implementation in ``tests/test_library.py``.

>>> from napkin_cat import axes
>>> q, x, d = axes("q x d")
>>> print(attention(q, x, d))  # doctest: +NORMALIZE_WHITESPACE
q d, x d → q x[q×d ⊗ x×d → q×x] >> softmax x[q×x → q×x] >> q x, x d → q d[q×x ⊗ x×d → q×d]
"""

from __future__ import annotations

import functools
import inspect
import operator
from dataclasses import dataclass

import jax.numpy as jnp
import sympy

from napkin_cat import generators as g
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Diagram, Ty, swap
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.errors import AxisError

#: beyond every index: the unbounded end of an interval
_FAR = 1 << 30


def _floor_div(a, c: int):
    return a if c == 1 else a // c


@dataclass(frozen=True)
class Affine:
    """A mask made of affine inequalities in the indices: kept where, in some region, every inequality
    ``Σ cₐ·a + c₀ ≥ 0`` of the region holds (a union of convex polygons). Knowing its inequalities, it
    knows which blocks it hides, cuts or keeps whole, so a kernel skips the first and runs the last
    unmasked (:meth:`interval`). ``&`` intersects two such masks, ``|`` joins them.

    >>> window = Affine.causal("q", "x") & Affine.at_least(3, x=1, q=-1)  # x > q − 4
    >>> window(q=5, x=2), window(q=5, x=1), window(q=5, x=6)
    (True, False, False)
    >>> [int(i) for i in window.interval("x", {"q": (8, 12)}) + window.interval("x", {"q": (8, 12)}, every=True)]
    [5, 12, 8, 9]
    """

    regions: tuple  # of regions, each a tuple of inequalities ((("q", 1), ("x", -1)), c₀)
    name: str = "affine"

    @classmethod
    def at_least(cls, c0: int = 0, /, **coefficients: int) -> Affine:
        """The half-plane ``Σ cₐ·a + c₀ ≥ 0``, coefficients given by axis name.

        >>> Affine.at_least(-2, x=1)(x=2), Affine.at_least(-2, x=1)(x=1)
        (True, False)
        """
        terms = tuple((a, int(c)) for a, c in coefficients.items() if c)
        return cls((((terms, int(c0)),),), f"{' + '.join(f'{c}·{a}' for a, c in terms)} + {c0} ≥ 0")

    @classmethod
    def causal(cls, q: str, x: str) -> Affine:
        """Query ``q`` sees key ``x`` when ``x ≤ q`` (as :func:`napkin_cat.causal_mask`).

        >>> Affine.causal("q", "x")(q=3, x=4)
        False
        """
        return cls(cls.at_least(**{q: 1, x: -1}).regions, f"causal({q} ≥ {x})")

    def named(self, name: str) -> Affine:
        """The same mask, shown as ``name``."""
        return Affine(self.regions, name)

    def __and__(self, other: Affine) -> Affine:
        regions = tuple(a + b for a in self.regions for b in other.regions)
        return Affine(regions, f"{self.name} ∧ {other.name}")

    def __or__(self, other: Affine) -> Affine:
        return Affine(self.regions + other.regions, f"{self.name} ∨ {other.name}")

    @property
    def axes(self) -> tuple[str, ...]:
        """The axes whose indices the mask reads."""
        return tuple(dict.fromkeys(a for r in self.regions for terms, _ in r for a, _ in terms))

    def __call__(self, **idx):
        def holds(terms, c0):
            return sum((c * idx[a] for a, c in terms), c0) >= 0

        return functools.reduce(
            operator.or_, (functools.reduce(operator.and_, (holds(*ineq) for ineq in r)) for r in self.regions)
        )

    @property
    def __signature__(self):
        kw = inspect.Parameter.KEYWORD_ONLY
        return inspect.Signature([inspect.Parameter(a, kw) for a in self.axes])

    @property
    def __name__(self):
        return self.name

    def interval(self, axis: str, ranges: dict, *, every: bool = False) -> tuple:
        """The indices ``[lo, hi)`` along ``axis`` kept at *some* point of the block ``ranges`` (a superset:
        outside it the block is hidden), or with ``every=True`` at *every* point (a subset: inside it the
        block is kept whole). ``ranges`` gives ``(lo, hi)`` for each other axis read; values may be traced.

        >>> prefix = Affine.causal("q", "x") | Affine.at_least(3, x=-1)  # x ≤ q or x < 4
        >>> [int(i) for i in prefix.interval("x", {"q": (0, 2)}) + prefix.interval("x", {"q": (0, 2)}, every=True)]
        [-1073741824, 4, -1073741824, 4]
        """
        spans = [self._region(r, axis, ranges, every) for r in self.regions]
        lo, hi = spans[0]
        for a, b in spans[1:]:
            empty, other_empty = hi <= lo, b <= a
            if every:  # a union of two intervals is one interval where they meet; else keep one (a subset)
                meet = (a <= hi) & (lo <= b) & ~empty & ~other_empty
                lo, hi = (
                    _where(empty, a, _where(meet, jnp.minimum(lo, a), lo)),
                    _where(empty, b, _where(meet, jnp.maximum(hi, b), hi)),
                )
            else:  # the hull of the non-empty ones
                lo = _where(empty, a, _where(other_empty, lo, jnp.minimum(lo, a)))
                hi = _where(empty, b, _where(other_empty, hi, jnp.maximum(hi, b)))
        return lo, hi

    @staticmethod
    def _region(region, axis: str, ranges: dict, every: bool) -> tuple:
        lo, hi = -_FAR, _FAR
        for terms, c0 in region:
            c = dict(terms).get(axis, 0)
            # the rest of the inequality at its largest (some point) or its smallest (every point) in the block
            t = c0
            for a, k in terms:
                if a != axis:
                    low, high = ranges[a]
                    t = t + k * (low if (k > 0) == every else high - 1)
            if c > 0:
                lo = jnp.maximum(lo, -_floor_div(t, c))
            elif c < 0:
                hi = jnp.minimum(hi, _floor_div(t, -c) + 1)
            else:
                hi = _where(t >= 0, hi, -_FAR)
        return lo, hi


def _where(c, a, b):
    return a if c is True else b if c is False else jnp.where(c, a, b)


def _scale(d: Axis, scale):
    return 1 / sympy.sqrt(d.size) if scale is None else scale


def attention(
    q: Axis,
    x: Axis,
    d: Axis,
    *,
    scale=None,
    causal: bool = False,
    mask=None,
    score_mod=None,
    dtype: Dtype | str = f32,
    batch: tuple[Axis, ...] = (),
    kv_batch: tuple[Axis, ...] | None = None,
) -> Diagram:
    """Naive attention ``softmax(Q Kᵀ · scale) V``: ``Q[q,d] ⊗ K[x,d] ⊗ V[x,d] → O[q,d]``.

    ``scale`` defaults to ``1/√d`` (as ``jax.nn.dot_product_attention``); ``causal`` masks keys after
    the query; ``mask(q=, x=)`` (FlexAttention's ``mask_mod``) and ``score_mod(s, q=, x=)`` read indices.
    ``batch`` axes index the queries; ``kv_batch`` (default: the same) the keys and values, so
    grouped-query attention has ``batch=(h_kv, g)``, ``kv_batch=(h_kv,)``. Scores and the softmax are
    f32; the output has the inputs' ``dtype``.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> print(attention(q, x, d, causal=True).boxes[1].name)
    mask causal(q ≥ x)
    """
    kv_batch = batch if kv_batch is None else kv_batch
    names = [a.name for a in (*batch, q, x, d)]
    if len(set(names)) != len(names):
        raise AxisError(f"attention: axes must be distinct, got {names}")
    for a in kv_batch:
        if a not in batch:
            raise AxisError(f"attention: key/value batch axis {a.name!r} must also index the queries")
    _Q, _K, V = (
        Array(*batch, q, d, dtype=dtype),
        Array(*kv_batch, x, d, dtype=dtype),
        Array(*kv_batch, x, d, dtype=dtype),
    )
    S = Array(*batch, q, x)
    scores = g.contract(
        f"{' '.join(a.name for a in (*batch, q, d))}, {' '.join(a.name for a in (*kv_batch, x, d))} -> "
        f"{' '.join(a.name for a in (*batch, q, x))}",
        *batch,
        q,
        x,
        d,
        scale=_scale(d, scale),
        dtype=dtype,
        out_dtype=f32,
    )
    d_ = scores @ identity(V)
    mods = []
    if score_mod is not None:
        mods.append(g.score_mod(S, score_mod))
    if causal:
        mods.append(g.causal_mask(S, q, x))
    if mask is not None:
        mods.append(g.mask(S, mask))
    for m in mods:
        d_ = d_ >> (m @ identity(V))
    out = g.contract(
        f"{' '.join(a.name for a in (*batch, q, x))}, {' '.join(a.name for a in (*kv_batch, x, d))} -> "
        f"{' '.join(a.name for a in (*batch, q, d))}",
        *batch,
        q,
        x,
        d,
        dtype=(f32, dtype),
        out_dtype=dtype,
    )
    return d_ >> (g.softmax(S, x) @ identity(V)) >> out


def multi_head_attention(h: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw) -> Diagram:
    """Attention weaved over heads ``h`` (and leading ``batch`` axes): ``Q[*batch,h,q,d] ⊗ K ⊗ V → O``.

    >>> from napkin_cat import axes
    >>> b, h, q, x, d = axes("b h q x d")
    >>> print(multi_head_attention(h, q, x, d, batch=(b,)).cod)
    b×h×q×d
    """
    return attention(q, x, d, **kw).weave(*batch, h)


def grouped_query_attention(hk: Axis, g_: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw):
    """Grouped-query attention: ``hk`` key/value heads, each shared by ``g_`` query heads.

    ``Q[*batch,hk,g,q,d] ⊗ K[*batch,hk,x,d] ⊗ V[*batch,hk,x,d] → O[*batch,hk,g,q,d]``.
    """
    return attention(q, x, d, batch=(hk, g_), kv_batch=(hk,), **kw).weave(*batch)


def multi_query_attention(h: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw):
    """Multi-query attention: ``h`` query heads share one key/value head.

    ``Q[*batch,h,q,d] ⊗ K[*batch,x,d] ⊗ V[*batch,x,d] → O[*batch,h,q,d]``.
    """
    return attention(q, x, d, batch=(h,), kv_batch=(), **kw).weave(*batch)


def softmax(n: Axis, x: Axis, *, dtype: Dtype | str = f32) -> Diagram:
    """Softmax of ``S[n, x]`` over ``x``."""
    return g.softmax(Array(n, x, dtype=dtype), x)


def matmul(a: Axis, b: Axis, c: Axis, *, dtype: Dtype | str = f32) -> Diagram:
    """``A[a,b] ⊗ B[b,c] → C[a,c]``."""
    return g.contract(f"{a.name} {b.name}, {b.name} {c.name} -> {a.name} {c.name}", a, b, c, dtype=dtype)


def _normalise(n: Axis, d: Axis, eps: float, dtype, centre: bool) -> Diagram:
    X = Array(n, d, dtype=dtype)
    Xf, row = Array(n, d), Array(n)
    up = g.cast(X, f32) if dtype != f32 else identity(Xf)
    if centre:
        mean = g.reduce_sum(Xf, d) >> g.scale(row, 1 / d.size)
        centred = Diagram.copy(Ty(Xf)) >> (identity(Xf) @ mean) >> g.subtract(Xf, row)
        up = up >> centred
    var = g.square(Xf) >> g.reduce_sum(Xf, d) >> g.scale(row, 1 / d.size) >> g.elementwise("add", row, const=eps)
    inv = var >> g.rsqrt(row)
    return up >> Diagram.copy(Ty(Xf)) >> (identity(Xf) @ inv) >> g.multiply(Xf, row)


def layer_norm(n: Axis, d: Axis, *, eps: float = 1e-5, dtype: Dtype | str = f32) -> Diagram:
    """Layer norm over ``d`` with scale ``γ[d]`` and bias ``β[d]``: ``X[n,d] ⊗ γ ⊗ β → Y[n,d]``."""
    Y = Array(n, d)
    norm = _normalise(n, d, eps, dtype, centre=True)
    return (
        (norm @ identity(Array(d)) @ identity(Array(d)))
        >> (g.multiply(Y, Array(d)) @ identity(Array(d)))
        >> g.add(Y, Array(d))
        >> _cast_back(Y, dtype)
    )


def rms_norm(n: Axis, d: Axis, *, eps: float = 1e-6, dtype: Dtype | str = f32) -> Diagram:
    """RMS norm over ``d`` with scale ``γ[d]``: ``X[n,d] ⊗ γ[d] → Y[n,d]``."""
    Y = Array(n, d)
    norm = _normalise(n, d, eps, dtype, centre=False)
    return (norm @ identity(Array(d))) >> g.multiply(Y, Array(d)) >> _cast_back(Y, dtype)


def _cast_back(Y: Array, dtype) -> Diagram:
    from napkin_cat.dtypes import dtype as as_dtype

    return identity(Y) if as_dtype(dtype) == f32 else g.cast(Y, dtype)


def mlp(n: Axis, i: Axis, h: Axis, o: Axis, *, activation: str = "gelu", dtype: Dtype | str = f32) -> Diagram:
    """Two-layer perceptron ``act(X W₁ + b₁) W₂ + b₂``: ``X[n,i] ⊗ W₁[i,h] ⊗ b₁[h] ⊗ W₂[h,o] ⊗ b₂[o] → Y[n,o]``."""
    hidden, out = Array(n, h, dtype=dtype), Array(n, o, dtype=dtype)
    first = g.contract(f"{n.name} {i.name}, {i.name} {h.name} -> {n.name} {h.name}", n, i, h, dtype=dtype)
    second = g.contract(f"{n.name} {h.name}, {h.name} {o.name} -> {n.name} {o.name}", n, h, o, dtype=dtype)
    act = g.elementwise(activation, hidden)
    rest = identity(Array(h, o, dtype=dtype)) @ identity(Array(o, dtype=dtype))
    return (
        (first @ identity(Array(h, dtype=dtype)) @ rest)
        >> (g.add(hidden, Array(h, dtype=dtype)) @ rest)
        >> (act @ rest)
        >> (second @ identity(Array(o, dtype=dtype)))
        >> g.add(out, Array(o, dtype=dtype))
    )


def cross_entropy(n: Axis, v: Axis) -> Diagram:
    """``log Σ_v exp(X) − Σ_v X·Y`` for logits ``X[n,v]`` and one-hot labels ``Y[n,v]``: streamable over ``v``
    (a large vocabulary), since log-sum-exp's sum and the label contraction both accumulate.

    >>> from napkin_cat import axes
    >>> print(cross_entropy(*axes("n v")).cod)
    n
    """
    X, Y, row = Array(n, v), Array(n, v), Array(n)
    lse = g.exp(X) >> g.reduce_sum(X, v) >> g.log(row)
    picked = g.contract(f"{n.name} {v.name}, {n.name} {v.name} -> {n.name}", n, v)
    return (Diagram.copy(Ty(X)) @ identity(Y)) >> (lse @ picked) >> g.subtract(row, row)


def layer_norm_statistics(n: Axis, d: Axis, *, eps: float = 1e-5) -> Diagram:
    """Mean and ``1/√(E[X²] − E[X]² + ε)`` of ``X[n,d]`` in one pass over ``d`` (streamable, unlike the
    two-pass :func:`layer_norm`, whose centring needs the completed mean).

    >>> from napkin_cat import axes
    >>> print(layer_norm_statistics(*axes("n d")).cod)
    n ⊗ n
    """
    X, row = Array(n, d), Array(n)
    sums = Diagram.copy(Ty(X)) >> (g.reduce_sum(X, d) @ (g.square(X) >> g.reduce_sum(X, d)))
    means = g.scale(row, 1 / d.size) @ g.scale(row, 1 / d.size)
    var = (
        (Diagram.copy(Ty(row)) @ identity(row))
        >> (identity(row) @ g.square(row) @ identity(row))
        >> (identity(row) @ swap(row, row))
        >> (identity(row) @ g.subtract(row, row))
    )
    rstd = g.elementwise("add", row, const=eps) >> g.rsqrt(row)
    return sums >> means >> var >> (identity(row) @ rstd)


# The Neural Circuit Diagrams architectures live in their own module; the library re-exports them.
from napkin_cat.architectures import (  # noqa: E402
    conv1d,
    conv2d,
    patch_embedding,
    resnet_block,
    self_attention,
    transformer_block,
    unet,
    vision_transformer,
    vit_encoder_block,
)

__all__ = [
    "attention",
    "conv1d",
    "conv2d",
    "grouped_query_attention",
    "layer_norm",
    "matmul",
    "mlp",
    "multi_head_attention",
    "multi_query_attention",
    "patch_embedding",
    "resnet_block",
    "rms_norm",
    "self_attention",
    "softmax",
    "transformer_block",
    "unet",
    "vision_transformer",
    "vit_encoder_block",
]
