"""The architecture library: common computations as diagrams.

Every entry is checked against an independent JAX implementation in ``tests/test_library.py``.

**One rule for the scores of every attention variant**: ``s = score_mod(scale · Q·Kᵀ + B)`` (``B``: an
additive bias, where there is one), and then every mask (causal, a ``mask_mod``, a sliding window or prefix, a
boolean mask array, segment ids) sends the scores it hides to −∞. Masks come *after* the score modifier,
as in FlexAttention (``score_mod``, then the ``mask_mod``) and ``jax.nn.dot_product_attention`` (the bias,
then the mask): a modifier sending −∞ to a finite number (a soft-cap, ``exp``, a constant) never gives a
masked key weight, and a kernel may skip a block that a mask hides whole.

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
from typing import ClassVar

import jax
import jax.numpy as jnp
import sympy

from napkin_cat import generators as g
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Diagram, Ty, discard, swap
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
                meet = _all(a <= hi, lo <= b, _not(empty), _not(other_empty))
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
    """``a`` where ``c`` else ``b``, for integer bounds; a Python value where ``c`` is a Python bool.

    Integers under a traced ``c`` are blended arithmetically (``c·a + (1 − c)·b``, exact for bounds within
    ±2³⁰): Pallas' Triton lowering gives a literal operand of a scalar select the predicate's type (i1).

    >>> _where(True, 1, 2), int(_where(jnp.asarray(False), 1, 2))
    (1, 2)
    """
    if isinstance(c, bool):
        return a if c else b
    if all(isinstance(v, int) or jnp.issubdtype(jnp.result_type(v), jnp.integer) for v in (a, b)):
        k = jnp.asarray(c).astype(jnp.int32)
        return k * a + (1 - k) * b
    return jnp.where(c, a, b)


# Bounds mix Python and traced values: a Python bool stays one (``~True`` is the integer −2, and ``bool & int``
# an integer array, which Triton's lowering then compares with mismatched types), a traced one stays boolean.
def _not(c):
    """Logical not of a Python or traced boolean.

    >>> _not(True), bool(_not(jnp.asarray(True)))
    (False, False)
    """
    return (not c) if isinstance(c, bool) else jnp.logical_not(c)


def _all(*cs):
    """Logical and of Python and traced booleans; a Python bool where every one is.

    >>> _all(True, 1 <= 2), bool(_all(True, jnp.asarray(False)))
    (True, False)
    """
    out = True
    for c in cs:
        if isinstance(c, bool):
            if not c:
                return False
            continue
        out = c if out is True else jnp.logical_and(out, c)
    return out


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
    value_dim: Axis | None = None,
    seq_at: int | None = None,
) -> Diagram:
    """Naive attention ``softmax(Q Kᵀ · scale) V``: ``Q[q,d] ⊗ K[x,d] ⊗ V[x,d] → O[q,d]``.

    ``scale`` defaults to ``1/√d`` (as ``jax.nn.dot_product_attention``); ``causal`` masks keys after
    the query; ``mask(q=, x=)`` (FlexAttention's ``mask_mod``) and ``score_mod(s, q=, x=)`` read indices,
    of any axis of the scores, ``batch`` axes included (ALiBi reads the head). ``batch`` axes index the
    queries; ``kv_batch`` (default: the same) the keys and values, so grouped-query attention has
    ``batch=(h_kv, g)``, ``kv_batch=(h_kv,)``. ``value_dim`` (default: ``d``) is the values' and the
    output's head dim, when it differs from the queries' and keys' (as in MLA: ``V[x,e] → O[q,e]``).
    Scores and the softmax are f32; the output has the inputs' ``dtype``. ``seq_at`` lays the sequence axis
    of Q, K, V and O at that position among their batch axes (default: after them, heads-major), so that
    ``seq_at=1`` takes ``jax.nn.dot_product_attention``'s ``[b, seq, h, d]`` as it is laid out in memory.

    >>> from napkin_cat import axes
    >>> b, h, q, x, d = axes("b h q x d")
    >>> print(attention(q, x, d, causal=True).boxes[1].name)
    mask causal(q ≥ x)
    >>> print(attention(q, x, d, batch=(b, h), seq_at=1).dom)
    b×q×h×d ⊗ b×x×h×d ⊗ b×x×h×d
    """
    a = _Attention(q, x, d, scale, dtype, batch, kv_batch, value_dim, seq_at)
    return a.scores(causal=causal, mask=mask, score_mod=score_mod) >> (g.softmax(a.S, x) @ identity(a.V)) >> a.out()


@dataclass(frozen=True)
class _Attention:
    """The wires and the two contractions of an attention diagram, for the variants to compose."""

    q: Axis
    x: Axis
    d: Axis
    scale: object
    dtype: Dtype | str
    batch: tuple
    kv_batch: tuple | None
    value_dim: Axis | None = None
    seq_at: int | None = None
    #: FP8 attention's labels (``lowering._fp8``): the output's dtype where it differs from the inputs', V laid
    #: out ``[*kv, e, x]`` (keys innermost: FP8 wgmma reads both operands K-major), the P·V contraction's scale
    out_dtype: Dtype | str | None = None
    values_keys_last: bool = False
    value_scale: float | None = None
    #: V's dtype, and so the P·V contraction's, where it differs from Q's and K's: FAN's mixed algorithm (Q·Kᵀ in
    #: FP8, P·V in 16 bits); None: ``dtype``
    value_dtype: Dtype | str | None = None

    def __post_init__(self):
        dims = (self.d,) if self.value_dim is None else (self.d, self.value_dim)
        names = [a.name for a in (*self.batch, self.q, self.x, *dims)]
        if len(set(names)) != len(names):
            raise AxisError(f"attention: axes must be distinct, got {names}")
        for a in self.kv:
            if a not in self.batch:
                raise AxisError(f"attention: key/value batch axis {a.name!r} must also index the queries")

    @property
    def kv(self) -> tuple:
        return self.batch if self.kv_batch is None else self.kv_batch

    @property
    def e(self) -> Axis:
        """The values' and the output's head dim."""
        return self.d if self.value_dim is None else self.value_dim

    def lay(self, lead: tuple, seq: Axis, last: Axis) -> tuple:
        """The axes of a Q, K, V or O wire: ``lead`` (batch) axes with the sequence axis ``seq`` at ``seq_at``
        among them (default: after them), then ``last``."""
        at = len(lead) if self.seq_at is None else min(self.seq_at, len(lead))
        return (*lead[:at], seq, *lead[at:], last)

    @property
    def vdtype(self) -> Dtype | str:
        """V's dtype: ``value_dtype``, else the inputs' ``dtype``."""
        return self.dtype if self.value_dtype is None else self.value_dtype

    @property
    def V(self) -> Array:
        if self.values_keys_last:
            return Array(*self.kv, self.e, self.x, dtype=self.vdtype)
        return Array(*self.lay(self.kv, self.x, self.e), dtype=self.vdtype)

    @property
    def S(self) -> Array:
        return Array(*self.batch, self.q, self.x)

    @property
    def O(self) -> Array:  # noqa: E743 - the output, as in the papers
        return Array(*self.lay(self.batch, self.q, self.e), dtype=self.out_dtype or self.vdtype)

    @property
    def rows(self) -> Array:
        return Array(*self.batch, self.q)

    def _spec(self, *axes) -> str:
        return " ".join(a.name for a in axes)

    def scores(
        self, *, causal=False, mask=None, score_mod=None, bias: Array | None = None, masks: tuple = (), modifier=None
    ) -> Diagram:
        """``Q ⊗ K ⊗ V ⊗ [B] ⊗ [modifier inputs] ⊗ [mask inputs] → S ⊗ V`` by the rule of the module's docstring:
        the scaled scores plus ``bias`` ``B`` (``S ⊗ B → S``), then ``score_mod`` (or ``modifier``, a pair
        ``(box, wires)`` of a box ``S ⊗ wires → S`` and the inputs it reads), then every mask: ``causal``,
        ``mask`` (a mask_mod) and ``masks``, pairs ``(box, wires)`` likewise."""
        b, q, x, d = self.batch, self.q, self.x, self.d
        spec = f"{self._spec(*self.lay(b, q, d))}, {self._spec(*self.lay(self.kv, x, d))} -> {self._spec(*b, q, x)}"
        s = g.contract(spec, *b, q, x, d, scale=_scale(d, self.scale), dtype=self.dtype, out_dtype=f32)
        read = [w for _, wires in masks for w in wires]
        own = [] if modifier is None else list(modifier[1])
        extra = ([] if bias is None else [bias]) + own + read
        out = s @ identity(self.V)
        if extra:  # the extra inputs beside the scores, V last: S ⊗ extra ⊗ V
            out = (out @ identity(Ty(*extra))) >> (identity(self.S) @ swap(Ty(self.V), Ty(*extra)))
        if bias is not None:
            out = out >> (g.add(self.S, bias) @ identity(Ty(*own, *read, self.V)))
        if modifier is not None:
            out = out >> (modifier[0] @ identity(Ty(*read, self.V)))
        mods = []
        if score_mod is not None:
            mods.append(g.score_mod(self.S, score_mod))
        if causal:
            mods.append(g.causal_mask(self.S, q, x))
        if mask is not None:
            mods.append(g.mask(self.S, mask))
        for m in mods:
            out = out >> (m @ identity(Ty(*read, self.V)))
        for i, (box, _) in enumerate(masks):
            later = [w for _, wires in masks[i + 1 :] for w in wires]
            out = out >> (box @ identity(Ty(*later, self.V)))
        return out

    def rotated(self, rope, positions: tuple[Axis, ...] | None, rest: Ty) -> Diagram:
        """``Q ⊗ K ⊗ rest ⊗ [P_q ⊗ P_x] → Q ⊗ K ⊗ rest``: the queries and keys rotated by ``rope`` (a
        :class:`~napkin_cat.generators.Rope`, its positions array unread) at the sequence index, or at positions
        ``P_q[*positions, q]`` and ``P_x[*positions, x]`` (i32 inputs, after ``rest``) where ``positions`` is given."""
        b, d = self.batch, self.d
        Q, K = (Array(*self.lay(batch, seq, d), dtype=self.dtype) for batch, seq in ((b, self.q), (self.kv, self.x)))
        kw = dict(base=rope.base, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved, offset=rope.offset)
        if positions is None:
            return g.rotary(Q, self.q, d, **kw) @ g.rotary(K, self.x, d, **kw) @ identity(rest)
        P, Px = (Array(*positions, seq, dtype="i32") for seq in (self.q, self.x))
        route = identity(Ty(Q, K)) @ swap(rest, Ty(P)) @ identity(Ty(Px))  # Q K P rest Px
        route = route >> (identity(Ty(Q)) @ swap(Ty(K), Ty(P)) @ identity(rest @ Ty(Px)))  # Q P K rest Px
        route = route >> (identity(Ty(Q, P, K)) @ swap(rest, Ty(Px)))  # Q P K Px rest
        turn = g.rotary(Q, self.q, d, positions=P, **kw) @ g.rotary(K, self.x, d, positions=Px, **kw)
        return route >> (turn @ identity(rest))

    def dropped(self, scores: Diagram, drop: g.Drop, seed_batch: tuple[Axis, ...]) -> Diagram:
        """``scores ⊗ seed → O``: the softmax, then the dropout ``drop`` reading the int32 ``seed[*seed_batch]`` (the
        last input), then the contraction with the values (``P ⊗ seed ⊗ V``: the order the softmax·contract lemma
        fuses, :func:`rewrites.fuse_softmax_contract`)."""
        seed = Array(*seed_batch, dtype="i32")
        P = self.S.with_(dtype=f32)
        soft = scores @ identity(seed) >> (g.softmax(self.S, self.x) @ swap(Ty(self.V), Ty(seed)))
        return soft >> (g.dropout(P, seed, drop) @ identity(self.V)) >> self.out()

    def out(self, weights: Array | None = None) -> Diagram:
        """``P ⊗ V → O``: the contraction of the weights with the values over the keys."""
        b, q, x, e = self.batch, self.q, self.x, self.e
        spec = f"{self._spec(*b, q, x)}, {self._spec(*self.V.axes)} -> {self._spec(*self.lay(b, q, e))}"
        w = weights or self.S
        out = self.out_dtype or self.vdtype
        return g.contract(spec, *b, q, x, e, dtype=(w.dtype, self.vdtype), out_dtype=out, scale=self.value_scale)


def multi_head_attention(h: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw) -> Diagram:
    """Attention weaved over heads ``h`` (and leading ``batch`` axes): ``Q[*batch,h,q,d] ⊗ K ⊗ V → O``.

    A ``score_mod`` or ``mask`` may read ``h`` or a ``batch`` axis (ALiBi's slope per head): the axes it reads
    (and those after them) are the attention's own batch axes, the others weaved around it.

    >>> from napkin_cat import axes
    >>> b, h, q, x, d = axes("b h q x d")
    >>> print(multi_head_attention(h, q, x, d, batch=(b,)).cod)
    b×h×q×d
    >>> alibi = lambda s, h, q, x: s - 2.0 ** -(h + 1) * abs(q - x)
    >>> print(multi_head_attention(h, q, x, d, batch=(b,), score_mod=alibi).boxes[1].name)
    score_mod <lambda>
    """
    outer = (*batch, h)
    at = _first_read(outer, kw)
    return attention(q, x, d, batch=outer[at:], **kw).weave(*outer[:at])


def _first_read(outer: tuple[Axis, ...], kw: dict) -> int:
    """Where, among ``outer`` (axes to weave around an attention), the first one its ``score_mod`` or
    ``mask`` reads is (every one, for a function taking ``**kwargs``); ``len(outer)`` where none is read.
    A weave's boxes cannot read the axes weaved around them, so that axis and the later ones stay inside."""
    read = set()
    for key, score in (("score_mod", True), ("mask", False)):
        if kw.get(key) is not None:
            names = g.index_names(kw[key], score=score)
            read |= {a.name for a in outer} if names is None else set(names)
    return next((i for i, a in enumerate(outer) if a.name in read), len(outer))


def grouped_query_attention(
    hk: Axis, g_: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw
) -> Diagram:
    """Grouped-query attention: ``hk`` key/value heads, each shared by ``g_`` query heads.

    ``Q[*batch,hk,g,q,d] ⊗ K[*batch,hk,x,d] ⊗ V[*batch,hk,x,d] → O[*batch,hk,g,q,d]``.

    >>> from napkin_cat import axes
    >>> gqa = grouped_query_attention(*axes("hk g q x d"), causal=True)
    >>> print(gqa.dom, "→", gqa.cod)
    hk×g×q×d ⊗ hk×x×d ⊗ hk×x×d → hk×g×q×d
    """
    return attention(q, x, d, batch=(hk, g_), kv_batch=(hk,), **kw).weave(*batch)


def multi_query_attention(h: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw) -> Diagram:
    """Multi-query attention: ``h`` query heads share one key/value head.

    ``Q[*batch,h,q,d] ⊗ K[*batch,x,d] ⊗ V[*batch,x,d] → O[*batch,h,q,d]``.

    >>> from napkin_cat import axes
    >>> b, h, q, x, d = axes("b h q x d")
    >>> print(multi_query_attention(h, q, x, d, batch=(b,)).dom)
    b×h×q×d ⊗ b×x×d ⊗ b×x×d
    """
    return attention(q, x, d, batch=(h,), kv_batch=(), **kw).weave(*batch)


def sliding_window_attention(q: Axis, x: Axis, d: Axis, *, window: int, **kw) -> Diagram:
    """Causal attention to the last ``window`` keys: query ``i`` sees key ``j`` when ``i − window < j ≤ i``.

    The band is an :class:`Affine` mask, so a kernel visits only the key blocks inside it.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> print(sliding_window_attention(q, x, d, window=4).boxes[1].name)
    mask window 4
    """
    if int(window) < 1:
        raise AxisError(f"sliding_window_attention: window must be ≥ 1, got {window}")
    band = Affine.causal(q.name, x.name) & Affine.at_least(int(window) - 1, **{x.name: 1, q.name: -1})
    return attention(q, x, d, mask=band.named(f"window {window}"), **kw)


def prefix_lm_attention(q: Axis, x: Axis, d: Axis, *, prefix: int, **kw) -> Diagram:
    """Prefix-LM attention: every query sees the first ``prefix`` keys, and the rest causally.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> print(prefix_lm_attention(q, x, d, prefix=8).boxes[1].name)
    mask prefix 8
    """
    seen = Affine.causal(q.name, x.name) | Affine.at_least(int(prefix) - 1, **{x.name: -1})
    return attention(q, x, d, mask=seen.named(f"prefix {prefix}"), **kw)


@dataclass(frozen=True)
class SameSegment:
    """The mask of a labelling: score ``s`` where the query's label ``a`` equals the key's label ``b``
    (``ids_q[q] = ids_x[x]``, the equivalence "same segment"), else −∞. Called as ``(s, a, b)``.

    Which blocks it hides or keeps whole depends on the labels, not (as for an :class:`Affine` mask) on
    the indices alone, so a kernel finds them at call time from the ids: a pair of blocks may meet only
    where their ranges of ids overlap, and is kept whole where both hold one and the same id (exact for
    sorted ids, packed documents; a superset and a subset otherwise). It says where it reads the labels
    (``segment_labels``), so a kernel finds its blocks, and those of the derivative in its score, which hides
    the same entries (``lowering._blocks.segment_blocks``).

    >>> same_document(jnp.ones(3), jnp.array([1, 1, 2]), jnp.array([1, 2, 2])).tolist()
    [1.0, -inf, 1.0]
    >>> same_document.__name__
    'same_document'
    """

    name: str = "same_document"
    #: a mask of the scores: it commutes with scaling them (``lowering``'s exp2 fold passes through it)
    passes_base: ClassVar[bool] = True
    #: the positions, among its arguments ``(s, a, b)``, of the two label arrays: which blocks it hides or keeps
    #: whole is found from them (``lowering._blocks.segment_mask``)
    segment_labels: ClassVar[tuple[int, int]] = (1, 2)

    def __call__(self, s, a, b):
        return jnp.where(a == b, s, -jnp.inf)

    @property
    def __name__(self):
        return self.name


#: the document mask: a query sees the keys of its own segment (``SameSegment``, recognised by the kernels)
same_document = SameSegment()


def document_attention(q: Axis, x: Axis, d: Axis, **kw) -> Diagram:
    """Attention within documents: ``Q ⊗ K ⊗ V ⊗ segments_q[q] ⊗ segments_x[x] → O``, query ``i`` seeing
    key ``j`` only when their segment ids (i32) agree. The ids are inputs, read per query and key index.
    The mask is a :class:`SameSegment`: a kernel finds, from the ids at call time, the blocks where no
    query and key share an id (skipped) and those holding one document only (run unmasked), forward and
    backward.

    >>> from napkin_cat import axes
    >>> print(document_attention(*axes("q x d")).dom.inside[3].describe())
    q:i32@HBM
    """
    a = _attention(q, x, d, kw)
    ids = (Array(*a.batch, q, dtype="i32"), Array(*a.kv, x, dtype="i32"))
    same = g.elementwise(same_document, a.S, *ids, out=a.S)
    return a.scores(masks=((same, ids),), **_mods(kw)) >> (g.softmax(a.S, x) @ identity(a.V)) >> a.out()


def biased_attention(q: Axis, x: Axis, d: Axis, *, bias_batch: tuple[Axis, ...] | None = None, **kw) -> Diagram:
    """Attention with an additive (relative or learned) bias: ``Q ⊗ K ⊗ V ⊗ B[*bias_batch, q, x] → O``,
    ``softmax(Q·Kᵀ·scale + B)·V``; ``bias_batch`` (default: every batch axis) is ``()`` for a bias
    shared by all heads. Differentiable in the bias.

    >>> from napkin_cat import axes
    >>> h, q, x, d = axes("h q x d")
    >>> print(biased_attention(q, x, d, batch=(h,), bias_batch=()).dom)
    h×q×d ⊗ h×x×d ⊗ h×x×d ⊗ q×x
    """
    a = _attention(q, x, d, kw)
    B = Array(*(a.batch if bias_batch is None else bias_batch), q, x)
    return a.scores(bias=B, **_mods(kw)) >> (g.softmax(a.S, x) @ identity(a.V)) >> a.out()


def keep_where(s, m):
    """The score ``s`` where the boolean mask ``m`` is true (kept, as in ``jax.nn``), else −∞.

    >>> keep_where(jnp.ones(2), jnp.array([True, False])).tolist()
    [1.0, -inf]
    """
    # m spread over the scores before it is read as a condition: a kernel holding a mask vector as numbers (Mosaic
    # GPU, lowering.mosaic.MosaicLowered.held) then compares whole blocks, whose layout it has
    return jnp.where(jnp.broadcast_to(m, jnp.shape(s)), s, -jnp.inf)


keep_where.passes_base = True  # a mask of the scores: it commutes with scaling them


def dot_product_attention(
    q: Axis,
    x: Axis,
    d: Axis,
    *,
    bias_batch: tuple[Axis, ...] | None = None,
    mask_batch: tuple[Axis, ...] | None = None,
    segment_batch: tuple[Axis, ...] | None = None,
    bias_dtype: Dtype | str = f32,
    bias_seq: str = "qx",
    mask_seq: str = "qx",
    window: tuple[int, int] | None = None,
    rope: g.Rope | None = None,
    rope_batch: tuple[Axis, ...] | None = None,
    captured: tuple = (),
    dropout: tuple | None = None,
    **kw,
) -> Diagram:
    """``jax.nn.dot_product_attention``'s array arguments as inputs: ``Q ⊗ K ⊗ V`` then, each present when
    its batch axes are given (``()``: shared by every batch), an additive bias ``B[*bias_batch, q, x]``
    (differentiable), a boolean mask ``M[*mask_batch, q, x]`` (true keeps the score) and segment ids
    ``ids_q[*segment_batch, q] ⊗ ids_x[*segment_batch, x]`` (i32; a query sees the keys of its own
    segment). ``bias_seq`` and ``mask_seq`` name the sequence axes the bias and the mask have (``"q"`` for
    queries, ``"x"`` for keys): an axis left out is broadcast, not read per query or key, and the bias's
    gradient is summed over it (``"x"``: a key-padding mask ``M[*mask_batch, x]``). ``captured`` holds
    ``(fn, wires)`` pairs: a score modifier or a mask whose captured arrays became the inputs ``wires``
    (:class:`~napkin_cat.generators.Captured`, called as ``fn(s, *wires)``), in the place of ``score_mod`` or
    ``mask``, its inputs after the bias. ``window = (left,
    right)`` keeps key ``x`` for query ``q`` where ``q − left ≤ x ≤ q + right`` (``jax.nn``'s
    ``local_window_size``), an :class:`Affine` mask, so kernels skip the blocks outside it. Scores are
    ``score_mod(scale·Q·Kᵀ + B)``, then masked by the keyword masks, the window, ``M`` and the ids (the rule
    of the module's docstring). ``rope`` (a :class:`~napkin_cat.generators.Rope`) rotates Q and K first, at the
    sequence index, or at positions ``P_q[*rope_batch, q] ⊗ P_x[*rope_batch, x]`` (i32, the last inputs) where
    ``rope_batch`` is given (packed sequences). ``dropout = (drop, seed_batch)`` (a
    :class:`~napkin_cat.generators.Drop` and the axes of an int32 seed input, after the ids and before the positions)
    drops the probabilities between the softmax and the contraction with ``V``.

    >>> from napkin_cat import axes
    >>> b, h, q, x, d = axes("b h q x d")
    >>> print(dot_product_attention(q, x, d, batch=(b, h), bias_batch=(h,), mask_batch=(), segment_batch=(b,)).dom)
    b×h×q×d ⊗ b×h×x×d ⊗ b×h×x×d ⊗ h×q×x ⊗ q×x ⊗ b×q ⊗ b×x
    >>> print(dot_product_attention(q, x, d, batch=(b, h), mask_batch=(b,), mask_seq="x", window=(2, 0)).dom)
    b×h×q×d ⊗ b×h×x×d ⊗ b×h×x×d ⊗ b×x
    >>> roped = dot_product_attention(q, x, d, batch=(b, h), rope=g.Rope(), rope_batch=(b,))
    >>> print(roped.dom, "|", *(box.name for box in roped.boxes if isinstance(box, g.Rotary)))
    b×h×q×d ⊗ b×h×x×d ⊗ b×h×x×d ⊗ b×q ⊗ b×x | rope q rope x
    """
    a = _attention(q, x, d, kw)
    seq = {"q": q, "x": x}
    B = None if bias_batch is None else Array(*bias_batch, *(seq[n] for n in bias_seq), dtype=bias_dtype)
    masks = []
    if window is not None:
        left, right = window
        seen = Affine.at_least(int(left), **{x.name: 1, q.name: -1})  # x ≥ q − left
        keep = seen & Affine.at_least(int(right), **{q.name: 1, x.name: -1})  # x ≤ q + right
        masks.append((g.mask(a.S, keep.named(f"window({left}, {right})")), ()))
    if mask_batch is not None:
        M = Array(*mask_batch, *(seq[n] for n in mask_seq), dtype="bool")
        masks.append((g.elementwise(keep_where, a.S, M, out=a.S), (M,)))
    if segment_batch is not None:
        ids = (Array(*segment_batch, q, dtype="i32"), Array(*segment_batch, x, dtype="i32"))
        masks.append((g.elementwise(same_document, a.S, *ids, out=a.S), ids))
    modifier = None
    for fn, wires in captured:  # a mask first among the masks (they commute); a score modifier in score_mod's place
        pair = (g.elementwise(fn, a.S, *wires, out=a.S), tuple(wires))
        modifier, masks = (pair, masks) if fn.score else (modifier, [pair, *masks])
    scores = a.scores(bias=B, masks=tuple(masks), modifier=modifier, **_mods(kw))
    out = scores >> (g.softmax(a.S, x) @ identity(a.V)) >> a.out() if dropout is None else a.dropped(scores, *dropout)
    return out if rope is None else a.rotated(rope, rope_batch, Ty(*out.dom.inside[2:])) >> out


@dataclass(frozen=True)
class SoftCap:
    """Soft-capping of the scores (Gemma 2): ``cap · tanh(s / cap)``.

    >>> round(float(SoftCap(30.0)(jnp.float32(300.0))), 3)
    30.0
    """

    cap: float

    def __call__(self, s):
        return self.cap * jnp.tanh(s / self.cap)

    @property
    def __name__(self):
        return f"softcap {self.cap:g}"


def softcap_attention(q: Axis, x: Axis, d: Axis, *, cap: float = 50.0, **kw) -> Diagram:
    """Attention with soft-capped scores ``cap·tanh(s/cap)`` (a score modifier reading no index).

    >>> from napkin_cat import axes
    >>> print(softcap_attention(*axes("q x d"), cap=30).boxes[1].name)
    score_mod softcap 30
    """
    return attention(q, x, d, score_mod=SoftCap(float(cap)), **kw)


@dataclass(frozen=True)
class ALiBi:
    """ALiBi's linear bias (Press et al.): ``s − m_h·|q − x|`` with head ``h``'s slope ``m_h = 2^(−8(h+1)/H)``.

    >>> ALiBi("h", "q", "x", 8)(0.0, h=0, q=3, x=1)
    -1.0
    """

    h: str
    q: str
    x: str
    heads: int

    def __call__(self, s, **idx):
        power = -8.0 * (idx[self.h] + 1) / self.heads
        # exp2 on traced values: Mosaic GPU lowers no `pow`; exact numbers (the cost's, the proofs') keep 2 ** y
        slope = jnp.exp2(power) if isinstance(power, jax.Array) else 2.0**power
        return s - slope * abs(idx[self.q] - idx[self.x])

    @property
    def __signature__(self):
        kw = inspect.Parameter.KEYWORD_ONLY
        score = inspect.Parameter("s", inspect.Parameter.POSITIONAL_ONLY)
        return inspect.Signature([score, *(inspect.Parameter(a, kw) for a in (self.h, self.q, self.x))])

    @property
    def __name__(self):
        return f"alibi({self.heads} heads)"


def alibi_attention(h: Axis, q: Axis, x: Axis, d: Axis, *, batch: tuple[Axis, ...] = (), **kw) -> Diagram:
    """Multi-head attention with ALiBi: the score modifier reads the head index ``h`` (a grid axis of
    the kernel); ``h`` needs a concrete size (the slopes depend on the number of heads).

    >>> from napkin_cat import Axis, axes
    >>> q, x, d = axes("q x d")
    >>> print(alibi_attention(Axis("h", 8), q, x, d, causal=True).boxes[1].name)
    score_mod alibi(8 heads)
    """
    if not sympy.sympify(h.size).is_number:
        raise AxisError(f"alibi_attention: the head axis {h.name!r} needs a concrete size for the slopes")
    alibi = ALiBi(h.name, q.name, x.name, int(h.size))
    return attention(q, x, d, batch=(h,), score_mod=alibi, **kw).weave(*batch)


def sink_attention(q: Axis, x: Axis, d: Axis, **kw) -> Diagram:
    """Attention with a sink (gpt-oss): one extra logit per head, ``sink[*batch]``, that enters only the
    normaliser, ``O = Σₓ exp(sₓ)·vₓ / (Σₓ exp(sₓ) + exp(sink))`` — which no score modifier can express.
    The sink rescales the softmax's output by ``σ(lse − sink)`` (lse: the log-sum-exp of the scores),
    so the keys still stream with the online softmax. ``Q ⊗ K ⊗ V ⊗ sink → O``.

    >>> from napkin_cat import axes
    >>> h, q, x, d = axes("h q x d")
    >>> print(sink_attention(q, x, d, batch=(h,)).dom)
    h×q×d ⊗ h×x×d ⊗ h×x×d ⊗ h
    """
    a = _attention(q, x, d, kw)
    sink, lse = Array(*a.batch), a.rows
    fused = g.SoftmaxContract(f"softmax·contract {x.name}", Ty(a.S, a.V), Ty(a.O, lse), data=(("axis", x.name),))
    # σ(lse − sink) from named maps: a positive row weight, which the backward folds into the probabilities
    weight = g.subtract(lse, sink) >> g.elementwise("sigmoid", lse)
    return (
        (a.scores(**_mods(kw)) @ identity(sink))
        >> (fused @ identity(sink))
        >> (identity(a.O) @ weight)
        >> g.multiply(a.O, lse)
    )


def sigmoid_attention(q: Axis, x: Axis, d: Axis, *, bias=None, **kw) -> Diagram:
    """Sigmoid attention (Ramapuram et al.): ``O = Σₓ σ(s + b)·V``, pointwise weights and no normaliser;
    ``bias`` ``b`` defaults to ``−log(x)`` (the number of keys). Streams as a plain contraction.

    >>> from napkin_cat import axes
    >>> print(sigmoid_attention(*axes("q x d")).boxes[1].name)
    add -log(x)
    """
    a = _attention(q, x, d, kw)
    b = -sympy.log(x.size) if bias is None else bias
    weights = g.elementwise("add", a.S, const=b) >> g.elementwise("sigmoid", a.S)
    return a.scores(**_mods(kw)) >> (weights @ identity(a.V)) >> a.out()


def normalised_attention(q: Axis, x: Axis, d: Axis, *, a1, a2, b, **kw) -> Diagram:
    """Attention normalised by ``N(s)ᵢ = a₁(sᵢ)/b(Σⱼ a₂(sⱼ))`` (the spherical-attention paper's normalised
    contraction; ``a1 = a2 = exp``, ``b = id`` is softmax without the max shift). ``a1``, ``a2``, ``b``
    are hashable JAX callables; a masked score is −∞, so ``a₁`` and ``a₂`` must send it to 0.

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes
    >>> print(normalised_attention(*axes("q x d"), a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt).boxes[1].name)
    normalised·contract x
    """
    a = _attention(q, x, d, kw)
    norm = g.normalised_contract(a.S, a.V, x, a.O, a1=a1, a2=a2, b=b)
    return a.scores(**_mods(kw)) >> norm


def _attention(q: Axis, x: Axis, d: Axis, kw: dict) -> _Attention:
    keys = ("scale", "dtype", "batch", "kv_batch", "value_dim", "seq_at", *FP8_LABELS)
    unknown = set(kw) - {*keys, "causal", "mask", "score_mod"}
    if unknown:
        raise AxisError(f"attention: unknown keywords {sorted(unknown)}")
    batch = tuple(kw.get("batch", ()))
    fp8 = {k: kw[k] for k in FP8_LABELS if k in kw}
    given = (kw.get("scale"), kw.get("dtype", f32), batch, kw.get("kv_batch"), kw.get("value_dim"), kw.get("seq_at"))
    return _Attention(q, x, d, *given, **fp8)


#: the keywords of FP8 attention's labels (``_Attention``'s fields of that name)
FP8_LABELS = ("out_dtype", "values_keys_last", "value_scale", "value_dtype")


def _mods(kw: dict) -> dict:
    return {k: kw[k] for k in ("causal", "mask", "score_mod") if k in kw}


def softmax(n: Axis, x: Axis, *, dtype: Dtype | str = f32) -> Diagram:
    """Softmax of ``S[n, x]`` over ``x``.

    >>> import jax, jax.numpy as jnp
    >>> from napkin_cat import axes, to_jax
    >>> S = jax.random.normal(jax.random.key(0), (3, 5))
    >>> bool(jnp.allclose(to_jax(softmax(*axes("n x")))(S), jax.nn.softmax(S, axis=1), atol=1e-6))
    True
    """
    return g.softmax(Array(n, x, dtype=dtype), x)


def matmul(a: Axis, b: Axis, c: Axis, *, dtype: Dtype | str = f32) -> Diagram:
    """``A[a,b] ⊗ B[b,c] → C[a,c]``.

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes, to_jax
    >>> A, B = jnp.arange(6.0).reshape(2, 3), jnp.ones((3, 4))
    >>> to_jax(matmul(*axes("a b c")))(A, B).tolist()
    [[3.0, 3.0, 3.0, 3.0], [12.0, 12.0, 12.0, 12.0]]
    """
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
    """Layer norm over ``d`` with scale ``γ[d]`` and bias ``β[d]``: ``X[n,d] ⊗ γ ⊗ β → Y[n,d]``.

    >>> import jax.numpy as jnp, numpy as np
    >>> from napkin_cat import axes, to_jax
    >>> X = jnp.array([[1.0, 2.0, 3.0], [0.0, 0.0, 6.0]])
    >>> Y = to_jax(layer_norm(*axes("n d")))(X, jnp.ones(3), jnp.zeros(3))
    >>> np.asarray(Y, np.float64).round(3).tolist()
    [[-1.225, 0.0, 1.225], [-0.707, -0.707, 1.414]]
    """
    Y = Array(n, d)
    norm = _normalise(n, d, eps, dtype, centre=True)
    return (
        (norm @ identity(Array(d)) @ identity(Array(d)))
        >> (g.multiply(Y, Array(d)) @ identity(Array(d)))
        >> g.add(Y, Array(d))
        >> _cast_back(Y, dtype)
    )


def rms_norm(n: Axis, d: Axis, *, eps: float = 1e-6, dtype: Dtype | str = f32) -> Diagram:
    """RMS norm over ``d`` with scale ``γ[d]``: ``X[n,d] ⊗ γ[d] → Y[n,d]``.

    >>> import jax.numpy as jnp, numpy as np
    >>> from napkin_cat import axes, to_jax
    >>> Y = to_jax(rms_norm(*axes("n d")))(jnp.array([[3.0, 4.0]]), jnp.array([1.0, 2.0]))
    >>> np.asarray(Y, np.float64).round(3).tolist()
    [[0.849, 2.263]]
    """
    Y = Array(n, d)
    norm = _normalise(n, d, eps, dtype, centre=False)
    return (norm @ identity(Array(d))) >> g.multiply(Y, Array(d)) >> _cast_back(Y, dtype)


def _cast_back(Y: Array, dtype) -> Diagram:
    from napkin_cat.dtypes import dtype as as_dtype

    return identity(Y) if as_dtype(dtype) == f32 else g.cast(Y, dtype)


def mlp(n: Axis, i: Axis, h: Axis, o: Axis, *, activation: str = "gelu", dtype: Dtype | str = f32) -> Diagram:
    """Two-layer perceptron ``act(X W₁ + b₁) W₂ + b₂``: ``X[n,i] ⊗ W₁[i,h] ⊗ b₁[h] ⊗ W₂[h,o] ⊗ b₂[o] → Y[n,o]``.

    >>> from napkin_cat import axes
    >>> m = mlp(*axes("n i h o"), activation="relu")
    >>> print(m.dom, "→", m.cod)
    n×i ⊗ i×h ⊗ h ⊗ h×o ⊗ o → n×o
    """
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
    """``log Σ_v exp(X) − Σ_v X·Y`` for logits ``X[n,v]`` and one-hot labels ``Y[n,v]``, numerically
    stable at any logit size: the log-sum-exp comes from the online softmax (a running max; the
    softmax's contraction with ``Y`` is discarded), so it streams over ``v`` (a large vocabulary) in one
    pass beside the label contraction.

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes, to_jax
    >>> ce = to_jax(cross_entropy(*axes("n v")))
    >>> float(ce(jnp.array([[1000.0, 0.0]]), jnp.array([[1.0, 0.0]]))[0])
    0.0
    """
    X, Y, row = Array(n, v), Array(n, v), Array(n)
    lse = g.SoftmaxContract(f"softmax·contract {v.name}", Ty(X, Y), Ty(row, row), data=(("axis", v.name),))
    picked = g.contract(f"{n.name} {v.name}, {n.name} {v.name} -> {n.name}", n, v)
    return (
        (Diagram.copy(Ty(X)) @ Diagram.copy(Ty(Y)))
        >> (identity(X) @ swap(X, Y) @ identity(Y))
        >> (lse @ picked)
        >> (discard(row) @ g.subtract(row, row))
    )


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


@dataclass(frozen=True)
class Targets:
    """The target distribution of a classifier's loss from integer labels: ``(1 − ε)·[label = index] + ε/V``
    (label smoothing ``ε``; one-hot at ``ε = 0``), called as ``(label, index)`` or, with ``ε``, as
    ``(label, index, ε/V)``. A label matching no index (an ignored token's ``-100``) gives ``ε/V`` only.

    >>> Targets()(jnp.array([2]), jnp.arange(3)).tolist()
    [0.0, 0.0, 1.0]
    >>> [round(t, 3) for t in Targets(0.3)(jnp.array([2]), jnp.arange(3), 0.1).tolist()]
    [0.1, 0.1, 0.8]
    """

    smoothing: float = 0.0

    def __call__(self, label, index, uniform=0.0):
        return (1.0 - self.smoothing) * (label == index).astype(jnp.float32) + uniform

    @property
    def __name__(self):
        return "one-hot" if self.smoothing == 0 else f"smoothed one-hot {self.smoothing:g}"


@dataclass(frozen=True)
class Ignored:
    """A per-token loss where the label is ``index`` (a padding token's), sent to 0.

    >>> Ignored(-100)(jnp.array([1.5, 2.5]), jnp.array([3, -100])).tolist()
    [1.5, 0.0]
    """

    index: int

    def __call__(self, loss, label):
        return jnp.where(label == self.index, 0.0, loss)

    def derivative(self, t, ct, ins, y, const):
        """The loss's cotangent, ``ct`` sent to 0 where the label is ``index``: it reads the label, not the loss,
        so a derived backward never recomputes the loss (the generic rule differentiates at the loss's value)."""
        return [t.ew(self, ct, ins[1], out=t.ty(ct)), None]

    @property
    def __name__(self):
        return f"ignore {self.index}"


def linear_cross_entropy(
    n: Axis,
    d: Axis,
    v: Axis,
    *,
    dtype: Dtype | str = f32,
    ignore_index: int | None = None,
    z_loss: float = 0.0,
    label_smoothing: float = 0.0,
    softcap: float | None = None,
) -> Diagram:
    """The loss of a classifier head (Cut Cross-Entropy, Wijmans et al. 2025): hidden states ``H[n,d]``,
    classifier ``W[v,d]``, integer labels ``y[n]`` and the vocabulary's index ``ids[v]`` (i32, ``0 … V−1``)
    give the per-token loss ``L[n] = log Σ_v exp(X) − Σ_v X·T`` of the logits ``X = H·Wᵀ`` (soft-capped
    ``cap·tanh(X/cap)`` with ``softcap``) against the targets ``T = (1 − ε)·[y = ids] + ε/V`` (:class:`Targets`,
    ``ε = label_smoothing``), plus ``z_loss · (log Σ_v exp X)²`` (PaLM's z-loss); ``ignore_index`` sends the
    loss of a token with that label to 0 (:class:`Ignored`).

    The log-sum-exp is the online softmax's (a softmax·contract whose contraction is discarded, as in
    :func:`cross_entropy`), so every box streams over ``v``: ``tile(n), stream(v)`` derives a kernel whose
    logits live one ``[tile, chunk]`` block at a time, never as an ``[n, v]`` array.

    >>> import jax, jax.numpy as jnp
    >>> from napkin_cat import axes, to_jax
    >>> n, d, v = axes("n d v")
    >>> lce = linear_cross_entropy(n, d, v)
    >>> print(lce.dom, "→", lce.cod)
    n×d ⊗ v×d ⊗ n ⊗ v → n
    >>> H, W = jax.random.normal(jax.random.key(0), (4, 8)), jax.random.normal(jax.random.key(1), (10, 8))
    >>> y = jnp.array([0, 3, 9, 3], jnp.int32)
    >>> loss = to_jax(lce)(H, W, y, jnp.arange(10, dtype=jnp.int32))
    >>> want = jax.nn.logsumexp(H @ W.T, -1) - jnp.take_along_axis(H @ W.T, y[:, None], 1)[:, 0]
    >>> bool(jnp.allclose(loss, want, atol=1e-5))
    True
    """
    from napkin_cat._reverse import Tape  # the tape builds a dataflow program into a diagram

    X, rows = Array(n, v), Array(n)
    t = Tape()
    h, w = t.input(Array(n, d, dtype=dtype), "H"), t.input(Array(v, d, dtype=dtype), "W")
    y, ids = t.input(Array(n, dtype="i32"), "y"), t.input(Array(v, dtype="i32"), "ids")
    spec = f"{n.name} {d.name}, {v.name} {d.name} -> {n.name} {v.name}"
    s = t(g.contract(spec, n, d, v, dtype=dtype, out_dtype=f32), h, w)
    if softcap is not None:
        s = t.ew(SoftCap(float(softcap)), s, out=X)
    smoothing = float(label_smoothing)
    uniform = {"const": smoothing / v.size} if smoothing else {}
    targets = t.ew(Targets(smoothing), y, ids, out=X, **uniform)
    lse_box = g.SoftmaxContract(f"softmax·contract {v.name}", Ty(X, X), Ty(rows, rows), data=(("axis", v.name),))
    _, lse = t.apply(lse_box, s, targets)
    loss = t.ew("subtract", lse, t.contract([s, targets], rows), out=rows)
    if z_loss:
        loss = t.ew("add", loss, t.ew("multiply", t.ew("square", lse, out=rows), const=z_loss), out=rows)
    if ignore_index is not None:
        loss = t.ew(Ignored(int(ignore_index)), loss, y, out=rows)
    return t.diagram([loss])


def rms_norm_linear(
    n: Axis, d: Axis, m: Axis, *, eps: float = 1e-6, dtype: Dtype | str = f32
) -> Diagram:
    """An RMS norm and the projection after it (a Llama block's norm, then its qkv or gate/up projection):
    ``X[n,d] ⊗ γ[d] ⊗ W[d,m] → Y[n,m]``, ``Y = (X / rms(X) ⊙ γ) · W`` with ``rms(X) = √(mean_d X² + ε)``; the
    product is accumulated in f32 and ``Y`` has the inputs' ``dtype``.

    As written, the norm needs the whole row of ``X`` before the product can read it; the row scaling
    ``1/rms(X)[n]`` commutes with the contraction over ``d``, which :func:`rewrites.factor_row_scale` proves, and
    then ``tile(n), tile(m), stream(d)`` accumulates ``Σ_d X²`` and ``Σ_d (X ⊙ γ)·W`` in one pass over ``d``.

    >>> import jax, jax.numpy as jnp
    >>> from napkin_cat import axes, to_jax
    >>> n, d, m = axes("n d m")
    >>> f = rms_norm_linear(n, d, m)
    >>> print(f.dom, "→", f.cod)
    n×d ⊗ d ⊗ d×m → n×m
    >>> X, G, W = (jax.random.normal(jax.random.key(i), s) for i, s in enumerate([(4, 8), (8,), (8, 3)]))
    >>> want = X * jax.lax.rsqrt(jnp.mean(X * X, -1, keepdims=True) + 1e-6) * G @ W
    >>> bool(jnp.allclose(to_jax(f)(X, G, W), want, atol=1e-5))
    True
    """
    from napkin_cat.dtypes import dtype as as_dtype

    spec = f"{n.name} {d.name}, {d.name} {m.name} -> {n.name} {m.name}"
    project = g.contract(spec, n, d, m, dtype=dtype, out_dtype=f32)
    return (rms_norm(n, d, eps=eps, dtype=dtype) @ identity(Array(d, m, dtype=dtype))) >> project >> _cast_back(
        Array(n, m), as_dtype(dtype)
    )


__all__ = [
    "alibi_attention",
    "attention",
    "biased_attention",
    "cross_entropy",
    "document_attention",
    "dot_product_attention",
    "grouped_query_attention",
    "Ignored",
    "keep_where",
    "layer_norm",
    "layer_norm_statistics",
    "linear_cross_entropy",
    "matmul",
    "mlp",
    "multi_head_attention",
    "multi_query_attention",
    "normalised_attention",
    "prefix_lm_attention",
    "rms_norm",
    "rms_norm_linear",
    "SameSegment",
    "same_document",
    "sigmoid_attention",
    "sink_attention",
    "sliding_window_attention",
    "Targets",
    "softcap_attention",
    "softmax",
]
