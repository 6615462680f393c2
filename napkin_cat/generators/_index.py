"""Index-dependent maps: score modifiers and masks (FlexAttention's ``score_mod`` and ``mask_mod``).

**How an index function meets the axes.** A score modifier ``fn(score, **indices)`` takes the score as
its *first* parameter, whatever that parameter is called; its other parameters are indices, each named
after an axis of the scores. A mask ``keep(**indices)`` has only index parameters. A function taking
``**kwargs`` receives every axis. So ``lambda x: 30 * tanh(x / 30)`` is a score-only modifier even on
scores with an axis named ``x``:

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array, to_jax
>>> q, x = axes("q x")
>>> cap = score_mod(Array(q, x), lambda x: 30 * jnp.tanh(x / 30))
>>> float(to_jax(cap)(jnp.full((2, 3), 60.0))[1, 2]) == float(30 * jnp.tanh(2.0))
True
>>> def alibi(s, q, x): return s - 0.5 * abs(q - x)
>>> float(to_jax(score_mod(Array(q, x), alibi))(jnp.zeros((2, 3)))[0, 2])
-1.0

**Functions that read arrays.** :class:`Captured` converts an index function reading arrays it is not given
(document ids, a bias table) into one whose reads of them are inputs, as ``nc.attention`` passes them.
"""

from __future__ import annotations

import collections
import copy
import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.extend.core import Literal

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.dtypes import f32
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators._base import Generator, fname
from napkin_cat.generators._vectors import pruned_trace


def index_names(fn: Callable, *, score: bool) -> tuple[str, ...] | None:
    """The axis names an index function reads: its parameters after the score (``score=True``) or all of
    them (a mask); None when it takes ``**kwargs`` (every axis) or hides its signature.

    >>> index_names(lambda s, q, x: s, score=True), index_names(lambda x: x, score=True)
    (('q', 'x'), ())
    >>> index_names(lambda q, x: q >= x, score=False)
    ('q', 'x')
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return tuple(p.name for p in params[1 if score else 0 :])


def _wanted(fn: Callable, indices: dict, *, score: bool) -> dict:
    """The indices ``fn`` reads, by name (all of them with ``**kwargs``), so weaving adds none."""
    names = index_names(fn, score=score)
    return indices if names is None else {k: v for k, v in indices.items() if k in names}


def _check(fn: Callable, a: Array, rule: str, *, score: bool):
    names = index_names(fn, score=score)
    unknown = [n for n in names or () if n not in a.names]
    if unknown:
        raise AxisError(f"{rule} {fname(fn)}: indices {unknown} are not axes of {a.describe()}")


def _filled(xp, value, shape: tuple):
    """An index function's result over the whole block of ``shape``: given its indices as vectors, a function
    reading one index (or none) returns a vector (or a scalar), broadcast here.

    >>> from napkin_cat.generators import JAX
    >>> _filled(JAX, jnp.arange(2)[:, None], (2, 3)).tolist()
    [[0, 0, 0], [1, 1, 1]]
    """
    have = tuple(xp.shape(value))
    if have == tuple(shape):
        return value
    return xp.broadcast_in_dim(value, tuple(shape), tuple(range(len(shape) - len(have), len(shape))))


@dataclass(frozen=True)
class ScoreDerivative:
    """``∂fn(s, **indices)/∂s``, elementwise: the index map of a score modifier's derivative.

    >>> float(ScoreDerivative(lambda s: s * s)(jnp.float32(3.0)))
    6.0
    """

    fn: Callable

    def __call__(self, s, **indices):
        return jax.jvp(lambda v: self.fn(v, **indices), (s,), (jnp.ones_like(s),))[1]

    @property
    def __signature__(self):
        return inspect.signature(self.fn)

    @property
    def __name__(self):
        return f"{fname(self.fn)}'"


@dataclass(frozen=True)
class Kept:
    """The cotangent where ``keep(**indices)`` holds, else 0: a mask's backward.

    >>> Kept(lambda q, x: x <= q)(jnp.ones(2), q=jnp.array([0, 0]), x=jnp.array([0, 1])).tolist()
    [1.0, 0.0]
    """

    keep: Callable

    def __call__(self, ct, **indices):
        return jnp.where(self.keep(**indices), ct, 0.0)

    @property
    def __signature__(self):
        ct = inspect.Parameter("cotangent", inspect.Parameter.POSITIONAL_ONLY)
        return inspect.Signature([ct, *inspect.signature(self.keep).parameters.values()])

    @property
    def __name__(self):
        return f"kept {fname(self.keep)}"


class IndexMap(Generator):
    """A pointwise map that reads the global indices of the elements (FlexAttention's ``score_mod``).

    ``fn(value, **indices)`` gets the value first and, per axis it names, the index along that axis.

    >>> from napkin_cat import axes
    >>> score_mod(Array(*axes("q x")), lambda s, q: s + q).flops()
    q*x
    """

    family, symbol = "mask", "S"

    def evaluate(self, ins, ctx):
        (v,), xp = ins, ctx.xp
        fn = self.params["fn"]
        idx = _wanted(fn, ctx.indices(self.dom.inside[0], xp.shape(v), index_names(fn, score=True)), score=True)
        return [xp.cast(_filled(xp, xp.index_map(fn, xp.f32(v), idx), xp.shape(v)), self.out.dtype)]

    def flops(self):
        return self.out.size

    def lines(self, prog, ins, outs):
        return [(f"{prog.ix(outs[0])} = {self.name}({prog.ix(ins[0])}, indices)", outs, ins, False, True)]

    def affine(self):
        """A mask's backward (``Kept``: the cotangent where the mask keeps the score, else 0) hides the blocks the
        mask hides and is the identity on those it keeps whole: its mask's affine form (:meth:`Mask.affine`); None
        for any other index map.

        >>> from napkin_cat import axes
        >>> m = causal_mask(Array(*axes("q x")), "q", "x")
        >>> score_mod(Array(*axes("q x")), Kept(m.params["mask"])).affine().name
        'causal(q ≥ x)'
        """
        fn = self.params["fn"]
        return affine_form(fn.keep) if isinstance(fn, Kept) else None

    def mask_function(self) -> Callable | None:
        """The mask function of a mask's backward (``Kept``), which hides what the mask hides; None for any other
        index map (a score modifier hides nothing)."""
        fn = self.params["fn"]
        return fn.keep if isinstance(fn, Kept) else None

    def block_map(self, names: tuple[str, ...], extent: dict, blocks: dict, then=None) -> tuple:
        """:meth:`Mask.block_map` of a mask's backward: the blocks its mask hides, cuts or keeps whole."""
        return block_map(self.mask_function(), names, extent, blocks, then)

    def backward(self, t, ins, outs, cts):
        (s,), fn = ins, self.params["fn"]
        S = t.ty(s)
        slope = ScoreDerivative(fn)
        box = IndexMap(f"score_mod {fname(slope)}", Ty(S), Ty(S.with_(dtype=f32)), data=(("fn", slope),))
        return [t.ew("multiply", cts[0], t(box, s))]


class Mask(Generator):
    """Keep a score where ``mask(**indices)`` holds, else ``-inf`` (FlexAttention's ``mask_mod``).

    >>> from napkin_cat import axes
    >>> causal_mask(Array(*axes("q x")), "q", "x").diagonal()
    ('q', 'x')
    """

    family, symbol = "mask", "S"

    def evaluate(self, ins, ctx):
        (v,), xp = ins, ctx.xp
        keep = self.params["mask"]
        shape = xp.shape(v)
        idx = ctx.indices(self.dom.inside[0], shape, index_names(keep, score=False))
        keep = xp.index_mask(keep, _wanted(keep, idx, score=False), shape)
        return [xp.cast(xp.where(keep, v, -xp.inf), self.out.dtype)]

    def flops(self):
        return self.out.size

    def passes_base(self):
        return True

    def diagonal(self):
        keep = self.params["mask"]
        return (keep.q, keep.x) if isinstance(keep, Causal) else None

    def affine(self):
        """Which blocks this mask hides, cuts or keeps whole, as its mask function says: its affine form (a
        :class:`~napkin_cat.library.Affine`, whose ``interval`` gives, for a block of the other axes, the indices
        kept somewhere and those kept everywhere), or None where the mask function knows no such form (a
        kernel then runs it on every block).

        >>> from napkin_cat import axes
        >>> causal_mask(Array(*axes("q x")), "q", "x").affine().name
        'causal(q ≥ x)'
        """
        return affine_form(self.params["mask"])

    def mask_function(self) -> Callable:
        """The mask function, ``keep(**indices)``."""
        return self.params["mask"]

    def block_map(self, names: tuple[str, ...], extent: dict, blocks: dict, then=None) -> tuple:
        """Which blocks this mask hides, cuts or keeps whole, found by evaluating its mask function on every
        index of each block (:func:`block_map`): for any mask function, where :meth:`affine` knows only affine ones.
        ``then``: what a kernel reads of the map, run with it (:func:`block_map`).

        >>> from napkin_cat import axes
        >>> dilated = mask(Array(*axes("q x")), lambda q, x: (q - x) % 4 == 0)
        >>> kept, whole = dilated.block_map(("q", "x"), {"q": 8, "x": 8}, {"q": 4, "x": 2})
        >>> kept.astype(int).tolist(), whole.astype(int).tolist()
        ([[1, 1, 1, 1], [1, 1, 1, 1]], [[0, 0, 0, 0], [0, 0, 0, 0]])
        """
        return block_map(self.mask_function(), names, extent, blocks, then)

    def lines(self, prog, ins, outs):
        name = getattr(self.params["mask"], "__name__", repr(self.params["mask"]))
        text = f"{prog.ix(outs[0])} = {prog.ix(ins[0])} where {name} else −∞   # global indices"
        return [(text, outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        keep, C = self.params["mask"], t.ty(cts[0])
        return [t(IndexMap(f"kept {fname(keep)}", Ty(C), Ty(C), data=(("fn", Kept(keep)),)), cts[0])]


#: the most elements of a mask :func:`block_map` evaluates at once: larger maps run in slices (``lax.map``)
BLOCK_MAP_ELEMENTS = 1 << 25

#: the block a map is evaluated at and kept (cached) when every block asked is a multiple of it, so that kernels
#: of other tiles (the forward's query tiles, the backward's key tiles) coarsen one evaluation
FINE_BLOCK = 16

#: the most blocks a cached fine map holds (two bools each); a larger map is evaluated at the blocks asked
FINE_BLOCKS = 1 << 24


def block_map(keep: Callable, names: tuple[str, ...], extent: dict, blocks: dict, then=None) -> tuple:
    """Which blocks the mask ``keep(**indices)`` keeps something of, and which it keeps whole: two bool arrays
    with one axis per name in ``names``, ``cdiv(extent[a], blocks[a])`` blocks of ``blocks[a]`` indices along
    ``a`` (size 1 along an axis ``keep``'s value does not depend on, :func:`depends_on`, though it may name it).
    ``keep`` runs vectorised on every index of every block, as a kernel would run it (jax.numpy, on the default
    device, one compiled program per mask function and sizes); indices past ``extent`` (a ragged block's padding)
    count for neither. The map is evaluated at blocks of :data:`FINE_BLOCK` where every block asked is a multiple
    of it, kept (the last few, per mask function and sizes) and coarsened for each kernel, so the forward's and the
    backward's kernels and a second call share one evaluation. A mask function that knows its blocks
    (``keep.block_map``, as a precomputed :class:`~napkin_cat.block_masks.BlockMask`) says them instead.
    ``then``, a hashable function of the map (``kept``, ``whole``), is applied to it in the program that coarsens
    it: what a kernel reads of its map (:class:`lowering._blocks.OnGrid`) costs no dispatch of its own.

    >>> kept, whole = block_map(lambda q, x: abs(q - x) <= 2, ("q", "x"), {"q": 12, "x": 12}, {"q": 4, "x": 4})
    >>> kept.astype(int).tolist(), whole.astype(int).tolist()
    ([[1, 1, 0], [1, 1, 1], [0, 1, 1]], [[0, 0, 0], [0, 0, 0], [0, 0, 0]])
    """
    form = getattr(keep, "block_map", None)
    if callable(form):
        out = form(names, extent, blocks)
        return out if then is None else _applied(*out, then)
    try:
        hash(keep)  # the compiled evaluation is cached per mask function
    except TypeError:
        raise EvaluationError(
            f"mask {fname(keep)}: its block map is compiled once per mask function, which must be hashable; "
            "make it a function or a frozen dataclass"
        ) from None
    read = tuple(sorted(depends_on(keep, tuple(sorted(names)))))  # one order: every kernel's map shares one
    fine = {a: FINE_BLOCK if blocks[a] % FINE_BLOCK == 0 else blocks[a] for a in read}
    if math.prod(-(-extent[a] // fine[a]) for a in read) > FINE_BLOCKS:
        fine = {a: blocks[a] for a in read}
    sizes = tuple((a, -(-extent[a] // fine[a]), fine[a], extent[a]) for a in read)
    taken = index_names(keep, score=False)
    unread = tuple(a for a in names if a not in read and (taken is None or a in taken))  # passed as 0
    kept, whole = _fine_map(keep, sizes, unread)
    factors = tuple(blocks[a] // fine[a] for a in read)
    order = tuple(sorted(range(len(read)), key=lambda i: names.index(read[i])))
    shape = tuple(-(-extent[a] // blocks[a]) if a in read else 1 for a in names)
    return _coarse(kept, whole, factors, order, shape, then)


@functools.partial(jax.jit, static_argnums=(2, 3, 4, 5))
def _coarse(kept, whole, factors: tuple, order: tuple, shape: tuple, then=None) -> tuple:
    """A fine map coarsened by ``factors`` (padded blocks keep nothing and keep it whole), its axes put in the
    caller's ``order`` and unit axes inserted (``shape``), then ``then`` applied to it where given: one dispatch."""
    for i, factor in enumerate(factors):
        if factor > 1:
            kept, whole = _coarsened(kept, i, factor, False), _coarsened(whole, i, factor, True)
    out = tuple(jnp.transpose(v, order).reshape(shape) for v in (kept, whole))
    return out if then is None else then(*out)


@functools.partial(jax.jit, static_argnums=2)
def _applied(kept, whole, then):
    """``then`` of a map a mask function said itself: one dispatch."""
    return then(kept, whole)


def depends_on(keep: Callable, names: tuple[str, ...], *, score: bool = False) -> frozenset:
    """The indices among ``names`` the value of the mask ``keep`` (with ``score``, of the score modifier ``keep(score,
    **indices)``) depends on: those it takes (all of ``names`` where it takes ``**kwargs``), less those its trace
    never reads (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` names the batch and the head, and most masks read
    neither), so a block map is evaluated over those only. A function the trace cannot follow (Python control flow
    on an index) depends on every index it takes.

    >>> sorted(depends_on(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, ("b", "h", "kv_idx", "q_idx")))
    ['kv_idx', 'q_idx']
    >>> sorted(depends_on(lambda s, b, h, q_idx, kv_idx: 2 * s + b, ("b", "h", "q_idx", "kv_idx"), score=True))
    ['b']
    """
    return _depends_on(keep, names, score)


@functools.lru_cache(maxsize=256)
def _depends_on(keep: Callable, names: tuple[str, ...], score: bool = False) -> frozenset:
    taken = index_names(keep, score=score)
    taken = tuple(a for a in names if taken is None or a in taken)
    i32, value = jax.ShapeDtypeStruct((), jnp.int32), [jax.ShapeDtypeStruct((), jnp.float32)] if score else []

    def traced(*args):
        return keep(*args[: len(value)], **dict(zip(taken, args[len(value) :], strict=True)))

    try:
        _, read = pruned_trace(traced, [*value, *[i32] * len(taken)])
    except Exception:  # noqa: BLE001 - a function the trace cannot follow (Python control flow): every index taken
        return frozenset(taken)
    return frozenset(a for a, r in zip(taken, read[len(value) :], strict=True) if r)


#: the last fine maps evaluated, per (mask function, sizes, indices passed as 0): a few, each at most FINE_BLOCKS
_FINE_MAPS: collections.OrderedDict = collections.OrderedDict()


def _fine_map(keep: Callable, sizes: tuple, unread: tuple) -> tuple:
    """The map at blocks ``sizes`` (each read axis's name, blocks, block size and extent; ``unread``: indices
    the mask takes and ignores, passed as 0), kept for the next kernel or call at the same sizes (unless traced:
    a caller's trace keeps its own), evaluated by one compiled program."""
    key = (keep, sizes, unread)
    if key in _FINE_MAPS:
        _FINE_MAPS.move_to_end(key)
        return _FINE_MAPS[key]
    out = _evaluated(keep, sizes, unread)
    if not any(isinstance(v, jax.core.Tracer) for v in out):
        _FINE_MAPS[key] = out
        while len(_FINE_MAPS) > 8:
            _FINE_MAPS.popitem(last=False)
    return out


def _evaluated(keep: Callable, sizes: tuple, unread: tuple) -> tuple:
    """:func:`_fine_map`'s evaluation by :func:`_block_map`, in slices of at most :data:`BLOCK_MAP_ELEMENTS`."""
    if not sizes:
        k = jnp.asarray(keep(**dict.fromkeys(unread, jnp.int32(0))), bool)
        return k, k
    total = math.prod(count * size for _, count, size, _ in sizes)
    along = max(range(len(sizes)), key=lambda i: sizes[i][1])  # sliced along the axis of the most blocks
    count = sizes[along][1]
    per = min(count, max(1, BLOCK_MAP_ELEMENTS * count // max(total, 1)))
    n_slices = -(-count // per)
    return _block_map(keep, sizes, unread, along, per, n_slices)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4, 5))
def _block_map(keep: Callable, sizes: tuple, unread: tuple, along: int, per: int, n_slices: int) -> tuple:
    """:func:`block_map`'s evaluation, one compiled program per mask function and sizes: ``n_slices`` slices of
    ``per`` blocks along the ``along``-th axis, stacked first. Each axis is laid out as (blocks, block), so a
    block's any and all are reductions over the second of each."""
    k = len(sizes)

    def evaluate(start):  # blocks [start, start + per) along ``along``; every block of the other axes
        idx, valid = dict.fromkeys(unread, jnp.int32(0)), jnp.ones((1,) * (2 * k), bool)
        for at, (a, count, size, extent) in enumerate(sizes):
            shape = [1] * (2 * k)
            shape[2 * at], shape[2 * at + 1] = (per if at == along else count), size
            first = start if at == along else 0
            v = (first + jnp.arange(shape[2 * at]))[:, None] * size + jnp.arange(size)
            idx[a] = v.reshape(shape).astype(jnp.int32)
            valid = valid & (idx[a] < extent)
        keeps = jnp.asarray(keep(**idx), bool)
        inside = tuple(range(1, 2 * k, 2))
        return jnp.any(keeps & valid, axis=inside), jnp.all(keeps | ~valid, axis=inside)

    if n_slices == 1:
        return evaluate(0)
    kept, whole = jax.lax.map(lambda j: evaluate(j * per), jnp.arange(n_slices))
    # slices stacked first: put them back along ``along`` and drop the last slice's overhang
    kept, whole = (jnp.moveaxis(v, 0, along) for v in (kept, whole))
    merged = [*kept.shape[:along], n_slices * per, *kept.shape[along + 2 :]]
    count = sizes[along][1]
    return tuple(v.reshape(merged)[(slice(None),) * along + (slice(0, count),)] for v in (kept, whole))


def _coarsened(v, axis: int, factor: int, fill: bool):
    """``v``'s blocks along ``axis`` merged ``factor`` at a time: any of them (``fill`` False), all (True)."""
    n = v.shape[axis]
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, -n % factor)
    v = jnp.pad(v, widths, constant_values=fill)
    v = v.reshape(*v.shape[:axis], -1, factor, *v.shape[axis + 1 :])
    return v.all(axis + 1) if fill else v.any(axis + 1)


def affine_form(keep):
    """The affine form of a mask function, asked of the function itself (duck-typed): one that knows its blocks
    (``interval``, as :class:`~napkin_cat.library.Affine`) is its own form; one that can say it (``affine()``, as
    :class:`Causal`) says it; any other has none (None).

    >>> affine_form(Causal("q", "x")).name, affine_form(lambda q, x: x <= q)
    ('causal(q ≥ x)', None)
    """
    if callable(getattr(keep, "interval", None)):
        return keep
    form = getattr(keep, "affine", None)
    return form() if callable(form) else None


@dataclass(frozen=True)
class Causal:
    """The causal mask: query ``q`` sees key ``x`` when ``x ≤ q`` (top-left aligned, as ``jax.nn``).

    >>> Causal("q", "x")(q=1, x=2)
    False
    """

    q: str
    x: str

    def __call__(self, **idx):
        return idx[self.x] <= idx[self.q]

    @property
    def __signature__(self):
        return inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in (self.q, self.x)])

    @property
    def __name__(self):
        return f"causal({self.q} ≥ {self.x})"

    def affine(self):
        """The same mask as one affine inequality, ``q − x ≥ 0`` (:meth:`napkin_cat.library.Affine.causal`)."""
        from napkin_cat.library import Affine  # the library's Affine is built on the generators

        return Affine.causal(self.q, self.x)


@dataclass(frozen=True)
class Positional:
    """An index function read by position (FlexAttention's convention): after the score (``score=True``) its
    parameters, whatever their names, are the indices ``names`` in order; it is called by name, as every
    index function here.

    >>> def sliding(batch, head, token_q, token_kv): return token_q - token_kv < 4
    >>> m = Positional(sliding, ("b", "h", "q_idx", "kv_idx"))
    >>> list(inspect.signature(m).parameters), m(b=0, h=0, q_idx=9, kv_idx=5), m.__name__
    (['b', 'h', 'q_idx', 'kv_idx'], False, 'sliding')
    """

    fn: Callable
    names: tuple[str, ...]
    score: bool = False

    def __call__(self, *value, **indices):
        return self.fn(*value, *(indices[n] for n in self.names))

    @property
    def __signature__(self):
        kw, first = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_ONLY
        value = [inspect.Parameter("score", first)] if self.score else []
        return inspect.Signature([*value, *(inspect.Parameter(n, kw) for n in self.names)])

    @property
    def __name__(self):
        return fname(self.fn)


def positional(fn: Callable, names: tuple[str, ...], *, score: bool) -> Callable:
    """``fn`` read by position (a :class:`Positional`) when, after the score (``score=True``), it takes exactly
    ``len(names)`` parameters, all passable by position, not already named ``names``: FlexAttention's
    ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)`` under any names. Any other
    ``fn`` is returned as it is, read by name (:func:`index_names`).

    >>> flex = ("b", "h", "q_idx", "kv_idx")
    >>> positional(lambda s, b, h, m, n: s, flex, score=True).__signature__
    <Signature (score, /, *, b, h, q_idx, kv_idx)>
    >>> near = lambda s, q_idx, kv_idx: s
    >>> positional(near, flex, score=True) is near
    True
    >>> positional(lambda b, h, kv_idx, q_idx: kv_idx <= q_idx, flex, score=False)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: mask_mod <lambda>: parameters (b, h, kv_idx, q_idx) are read by position as \
(b, h, q_idx, kv_idx) (FlexAttention's order), but kv_idx, q_idx name other indices; put them in that order, \
or name fewer to be read by name
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if len(params) != len(names) + score or any(p.kind not in kinds for p in params):
        return fn
    given = tuple(p.name for p in params[score:])
    if given == names:
        return fn
    moved = [n for i, n in enumerate(given) if n in names and names[i] != n]
    if moved:
        rule = "score_mod" if score else "mask_mod"
        raise AxisError(
            f"{rule} {fname(fn)}: parameters ({', '.join(given)}) are read by position as ({', '.join(names)}) "
            f"(FlexAttention's order), but {', '.join(moved)} name other indices; put them in that order, or name "
            "fewer to be read by name"
        )
    return Positional(fn, names, score)


def score_mod(a: Array, fn: Callable) -> IndexMap:
    """An index-dependent score modifier ``fn(score, **indices)`` (the score is the first parameter; the
    others name axes of ``a``; see the module's docstring).

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> def alibi(s, q, x): return s - 0.5 * abs(q - x)
    >>> score_mod(Array(q, x), alibi).name
    'score_mod alibi'
    >>> score_mod(Array(q, x), lambda s, k: s)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: score_mod <lambda>: indices ['k'] are not axes of q×x:f32@HBM
    """
    _check(fn, a, "score_mod", score=True)
    return IndexMap(f"score_mod {fname(fn)}", Ty(a), Ty(a), data=(("fn", fn),))


def mask(a: Array, keep: Callable) -> Mask:
    """Mask scores where ``keep(**indices)`` is false (they become ``-inf``); every parameter names an axis.

    A ``keep`` made of linear inequalities in the indices becomes the equal
    :class:`~napkin_cat.library.Affine` (:func:`napkin_cat.affine_masks.as_affine`), named after it, so that
    kernels skip the blocks it hides; any other ``keep`` is applied element by element, as written.

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> band = mask(Array(q, x), lambda q, x: x <= q + 4)
    >>> band.name, type(band.params["mask"]).__name__
    ('mask <lambda>', 'Affine')
    >>> type(mask(Array(q, x), lambda q, x: q % 2 == x % 2).params["mask"]).__name__
    'function'
    """
    _check(keep, a, "mask", score=False)
    if not isinstance(keep, Causal):
        from napkin_cat.affine_masks import as_affine  # the library's Affine is built on the generators

        keep = as_affine(keep, a.names) or keep
    return Mask(f"mask {fname(keep)}", Ty(a), Ty(a), data=(("mask", keep),))


def causal_mask(a: Array, q: Axis | str, x: Axis | str) -> Mask:
    """The causal mask on scores ``a`` indexed by queries ``q`` and keys ``x``.

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> causal_mask(Array(q, x), q, x).name
    'mask causal(q ≥ x)'
    """
    qn, xn = (getattr(v, "name", v) for v in (q, x))
    for n in (qn, xn):
        a.axis(n)
    return mask(a, Causal(qn, xn))


#: the index names of FlexAttention's functions, in the order their arrays' axes take them
FLEX_INDICES = ("b", "h", "q_idx", "kv_idx")


class Captured:
    """An index function's closure conversion: the arrays it reads (captured, at any depth) become inputs.

    A function of the indices (and the score) that reads arrays it is not given, as FlexAttention's users
    write them (``lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]``), is traced once at scalar
    arguments (FlexAttention's semantics: one score, one index each), as ``jax.closure_convert`` traces it. Each
    value the trace computes from a captured array down to one scalar (a *read*: ``doc[q_idx]``,
    ``rel_bias[q_idx - kv_idx]``, ``slopes[h]``, a 0-d ``window``) depends on some of the indices, and becomes an
    input over those axes, computed when the function is called (:meth:`inputs`: plain JAX, so the reads
    are differentiable gathers and the arrays may change between calls). The rest of the trace, the
    arithmetic of the reads, the indices and the score, is this object's call: ``(score, *reads, *indices)``,
    element by element (the indices it still reads, ``indices``, come as inputs too). A mask keeps the score
    where the function holds, else −∞.

    Two functions whose traces compute the same from their reads (whatever the arrays' values and sizes) give
    equal objects: a kernel built for one serves the other.

    >>> import jax.numpy as jnp
    >>> doc = jnp.array([0, 0, 1, 1, 1])
    >>> c = Captured.of(lambda q_idx, kv_idx: doc[q_idx] == doc[kv_idx], ("q_idx", "kv_idx"), score=False)
    >>> c.reads, c.indices
    (((('q_idx',), 'int32'), (('kv_idx',), 'int32')), ())
    >>> [a.tolist() for a in c.inputs({"q_idx": 5, "kv_idx": 5})]
    [[0, 0, 1, 1, 1], [0, 0, 1, 1, 1]]
    >>> c(jnp.zeros((2, 2)), jnp.array([[0], [1]]), jnp.array([[0, 1]])).tolist()
    [[0.0, -inf], [-inf, 0.0]]
    """

    def __init__(self, fn: Callable, names: tuple[str, ...], *, score: bool, closed):
        self.fn, self.names, self.score = fn, tuple(names), score
        self._closed = closed  # this call's trace, with the arrays' values: used by inputs(), not kept in kernels
        jaxpr = closed.jaxpr
        self.jaxpr, self._split = jaxpr, _split(jaxpr, self.names, score, fname(fn))
        self.reads = tuple((axes, jnp.dtype(v.aval.dtype).name) for v, axes in self._split.reads)
        self.indices = self._split.indices
        index = [jaxpr.invars[score + self.names.index(a)] for a in self.indices]
        self._seeds = [v for v, _ in self._split.reads] + index + jaxpr.invars[:score]
        self.key = _key(self._seeds, self._split.kernel, jaxpr.outvars)

    @classmethod
    def of(cls, fn: Callable, names: tuple[str, ...], *, score: bool) -> Captured:
        """``fn`` (called by name with ``names``, after the score where ``score``) traced at scalars."""
        i32, f = jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32)

        def call(*args):
            indices = dict(zip(names, args[score:], strict=True))
            return fn(*args[:score], **indices)

        closed = jax.make_jaxpr(call)(*([f] if score else []), *[i32] * len(names))
        out = closed.jaxpr.outvars[0].aval
        if out.shape != ():
            what = "score_mod" if score else "mask_mod"
            raise AxisError(f"{what} {fname(fn)}: returns {out.str_short()} for one score; expected a scalar")
        return cls(fn, names, score=score, closed=closed)

    def _identity(self) -> tuple:
        return (self.key, self.score, self.names, self.reads, self.indices)

    def __eq__(self, other):
        return isinstance(other, Captured) and self._identity() == other._identity()

    def __hash__(self):
        return hash(self._identity())

    def __repr__(self):
        return f"Captured({fname(self.fn)}, reads={self.reads}, indices={self.indices})"

    @property
    def __name__(self):
        return f"{fname(self.fn)} (captured)"

    def abstract(self) -> Captured:
        """This conversion without the arrays' values (which may be a trace's), as a kernel's signature keeps it."""
        out = copy.copy(self)
        out._closed = None
        return out

    @property
    def passes_base(self) -> bool:
        """A mask commutes with scaling the scores (where(keep, s, −∞)); a score modifier need not."""
        return not self.score

    def inputs(self, sizes: dict) -> list:
        """The inputs of this call, each over its axes (in the order of ``names``, sized by ``sizes``): every
        read, computed from the arrays' values now, then the indices the function still reads (``arange``)."""
        if self._closed is None:
            raise AxisError(f"{self.__name__}: no arrays traced; call Captured.of(fn, ...) for this call's inputs")
        jaxpr, consts = self._closed.jaxpr, self._closed.consts
        out = []
        for v, axes in self._split.reads:
            needed = _slice(jaxpr, v)

            def read(*idx, v=v, axes=axes, needed=needed):
                env = dict(zip(jaxpr.constvars, consts, strict=True))
                env.update((jaxpr.invars[self.score + self.names.index(a)], i) for a, i in zip(axes, idx, strict=True))
                return _run(needed, env, [v])[0]

            out.append(_grid(read, [sizes[a] for a in axes]))
        return out + [jnp.arange(sizes[a], dtype=jnp.int32) for a in self.indices]

    def __call__(self, *args):
        """``score, *reads, *indices`` (broadcastable blocks; every input arrives as f32, as an elementwise box
        gives them) → the modified score, or the score where the mask keeps it, else −∞."""
        s, rest = args[0], args[1:]
        shape = jnp.broadcast_shapes(*(jnp.shape(a) for a in args))
        y = self._traced(shape, [*rest, s] if self.score else list(rest))
        return y.astype(jnp.float32) if self.score else jnp.where(y, s, -jnp.inf)

    def holds(self, *args):
        """A mask's Boolean on ``*reads, *indices`` (broadcastable blocks), with no score: what its block map
        counts (:func:`lowering._blocks._evaluated_map`).

        >>> ids = jnp.array([0, 0, 1])
        >>> same = Captured.of(lambda q, x: ids[q] == ids[x], ("q", "x"), score=False)
        >>> at_q, at_x = same.inputs({"q": 3, "x": 3})  # ids[q] and ids[x], read once per index
        >>> same.holds(at_q[:, None], at_x[None, :]).tolist()
        [[True, True, False], [True, True, False], [False, False, True]]
        """
        if self.score:
            raise AxisError(f"{self.__name__}: a score modifier holds no Boolean; holds() is a mask's")
        return self._traced(jnp.broadcast_shapes(*(jnp.shape(a) for a in args)), list(args))

    def _traced(self, shape: tuple, values: list):
        """The function's trace run on ``values`` broadcast to ``shape`` (each cast to its seed's dtype)."""
        jaxpr, split, seeds = self.jaxpr, self._split, self._seeds
        values = [_cast(jnp.broadcast_to(x, shape), v.aval.dtype) for x, v in zip(values, seeds, strict=True)]

        def one(*xs):
            return _run(split.kernel, dict(zip(seeds, xs, strict=True)), jaxpr.outvars)[0]

        for _ in shape:
            one = jax.vmap(one)
        return one(*values)


def _cast(x, dtype):
    """``x`` in ``dtype``; a Boolean as ``x != 0`` (what a cast to bool computes), a comparison every backend lowers:
    Mosaic GPU (jax 0.11.2) converts no block to ``i1`` (a read held in f32, ``MosaicLowered.held``, arrives so).

    >>> _cast(jnp.array([0.0, 2.0, jnp.nan]), jnp.bool_).tolist()
    [False, True, True]
    """
    if jnp.dtype(dtype) == jnp.bool_ and jnp.result_type(x) != jnp.bool_:
        return x != 0
    return x.astype(dtype)


@dataclass(frozen=True)
class _Split:
    reads: tuple  # (var, index names it depends on): the scalars read from captured arrays
    indices: tuple  # the index names the rest of the trace reads
    kernel: tuple  # the equations the kernel runs, on the reads, the indices and the score


def _split(jaxpr, names: tuple, score: bool, name: str) -> _Split:
    """Cut a scalar trace where each captured array (a constant of the trace) is read down to one scalar."""
    what = "score_mod" if score else "mask_mod"
    deps = {v: frozenset({n}) for v, n in zip(jaxpr.invars[score:], names, strict=True)}
    scored = {jaxpr.invars[0]} if score else set()
    whole = {v for v in jaxpr.constvars if v.aval.shape != ()}  # arrays, and values computed from them
    reads = {v: frozenset() for v in jaxpr.constvars if v.aval.shape == ()}  # a 0-d array is read as it is
    kernel = []
    for e in jaxpr.eqns:
        ins = [v for v in e.invars if not isinstance(v, Literal)]
        dep = frozenset().union(*(deps.get(v, frozenset()) for v in ins), *(reads.get(v, ()) for v in ins))
        deps.update((o, dep) for o in e.outvars)
        if any(v in whole for v in ins):
            if any(v in scored for v in ins):
                raise AxisError(
                    f"{what} {name}: the score meets a captured array whole ({e.primitive.name}); read the array "
                    "at the indices (table[q_idx - kv_idx]), one scalar per score"
                )
            for o in e.outvars:
                (whole.add(o) if o.aval.shape != () else reads.__setitem__(o, dep))
            continue
        if any(v in scored for v in ins):
            scored.update(e.outvars)
        kernel.append(e)
    outs = [v for v in jaxpr.outvars if not isinstance(v, Literal)]
    if any(v in whole for v in outs):
        raise AxisError(f"{what} {name}: returns a captured array whole; read it at the indices")
    want, run = set(outs), []
    for e in reversed(kernel):  # what the kernel runs: the equations the result needs, from the reads on
        if want & set(e.outvars):
            run.append(e)
            want |= {v for v in e.invars if not isinstance(v, Literal)}
    order = {n: i for i, n in enumerate(names)}
    return _Split(
        tuple((v, tuple(sorted(a, key=order.get))) for v, a in reads.items() if v in want),
        tuple(n for v, n in zip(jaxpr.invars[score:], names, strict=True) if v in want),
        tuple(reversed(run)),
    )


def _key(seeds, eqns, outs) -> str:
    """The kernel's part of a trace, on its inputs ``seeds`` (reads, indices, score), written out with variables
    numbered in order: what a kernel computes, so the key two conversions share a kernel by."""
    ids = {v: i for i, v in enumerate(seeds)}

    def name(v):
        return repr(v.val) if isinstance(v, Literal) else f"v{ids[v]}"

    lines = [" ".join(f"v{i}:{v.aval.str_short()}" for v, i in ids.items())]
    for e in eqns:
        ids.update((o, len(ids)) for o in e.outvars)
        outs_ = " ".join(f"{name(o)}:{o.aval.str_short()}" for o in e.outvars)
        lines.append(f"{outs_} = {e.primitive.name}[{e.params}] {' '.join(map(name, e.invars))}")
    return "\n".join([*lines, " ".join(map(name, outs))])


def _slice(jaxpr, v) -> tuple:
    """The equations of ``jaxpr`` that ``v`` depends on, in order."""
    want, kept = {v}, []
    for e in reversed(jaxpr.eqns):
        if want & set(e.outvars):
            kept.append(e)
            want |= {x for x in e.invars if not isinstance(x, Literal)}
    return tuple(reversed(kept))


def _run(eqns, env: dict, outs) -> list:
    """Evaluate equations on ``env`` (variables → values), as ``jax.core.eval_jaxpr`` does."""
    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for e in eqns:
        ys = e.primitive.bind(*map(read, e.invars), **e.primitive.get_bind_params(e.params))
        env.update(zip(e.outvars, ys if e.primitive.multiple_results else [ys], strict=True))
    return [read(v) for v in outs]


def _grid(fn: Callable, sizes: list):
    """``fn`` of scalar indices at every point of the grid ``sizes`` (an array of that shape)."""
    if not sizes:
        return fn()
    grids = jnp.meshgrid(*(jnp.arange(n, dtype=jnp.int32) for n in sizes), indexing="ij")
    return jax.vmap(fn)(*(g.reshape(-1) for g in grids)).reshape(sizes)
