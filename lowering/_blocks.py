"""The block machinery every streaming backend shares: a kernel body's context (block offsets, grid indices),
which chunks of the streamed axis a block visits (the masks' affine intervals, a segment mask's ranges found from
its ids, any other mask's from its block map), the launch order (heaviest tiles first), the masks that zero every
accumulator's input, the ragged chunk's neutral padding and the tiled-first layout. Which blocks a mask hides,
cuts or keeps whole is the mask's own knowledge, asked through the generator
(:meth:`~napkin_cat.generators.Mask.affine`, a mask function's ``segment_labels``,
:meth:`~napkin_cat.generators.Mask.block_map`); the backends (:mod:`lowering.triton`, :mod:`lowering.mosaic`,
:mod:`lowering.xla`) import this module and never one another.
"""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rewrites
from lowering._plan import NotLowerable, Plan
from napkin_cat.diagram import Diagram
from napkin_cat.generators import Captured, Context, Contract, Elementwise, IndexMap, Partial


@dataclass
class BlockContext(Context):
    """The context of a kernel body: block offsets, and the index of this program along each grid
    (batch) axis, which index functions may read like any other axis (ALiBi reads the head).

    >>> from napkin_cat import Array, axes
    >>> BlockContext(grid={"h": 3}).at(q=16).indices(Array(*axes("q")), (2,))["h"]
    3
    """

    grid: dict = field(default_factory=dict)

    def at(self, **offsets) -> BlockContext:
        return replace(self, offsets={**self.offsets, **offsets})

    def indices(self, wire, shape: tuple, names=None) -> dict:
        return {**self.grid, **super().indices(wire, shape, names)}


def affine_mask(box):
    """The affine form (an :class:`napkin_cat.library.Affine`) of a mask box, or of a mask's backward
    (``Kept``: the cotangent where the mask keeps the score, else 0), which hides the same blocks and is
    the identity on those the mask keeps whole; None for any other box. The generator says it
    (:meth:`~napkin_cat.generators.Mask.affine`), asking its mask function.

    >>> import napkin_cat as nc
    >>> q, x = nc.axes("q x")
    >>> affine_mask(nc.causal_mask(nc.Array(q, x), "q", "x")).name
    'causal(q ≥ x)'
    """
    form = getattr(box, "affine", None)
    return form() if callable(form) else None


def visited(masks, x: str, s: int, n_chunks: int, ranges: dict, extent: int) -> tuple:
    """The chunks of ``x`` a block visits, ``first ≤ full_lo ≤ full_hi ≤ last``: the affine masks keep
    nothing outside ``[first, last)`` (skipped) and everything in ``[full_lo, full_hi)`` (run unmasked)."""
    lo, hi, flo, fhi = 0, extent, 0, extent
    for m in masks:
        a, b = m.interval(x, ranges)
        fa, fb = m.interval(x, ranges, every=True)
        lo, hi, flo, fhi = jnp.maximum(lo, a), jnp.minimum(hi, b), jnp.maximum(flo, fa), jnp.minimum(fhi, fb)
    first = jnp.clip(lo // s, 0, n_chunks)
    last = jnp.clip(-(-hi // s), first, n_chunks)
    full_lo = jnp.clip(-(-flo // s), first, last)
    full_hi = jnp.clip(fhi // s, full_lo, last)
    return first, full_lo, full_hi, last


def heavy_last(p: Plan, extent: dict, padded: dict, blocks: CallBlocks | None = None) -> tuple[str, ...]:
    """The tiled axes whose last tile visits more chunks of the stream than its first (causal attention's
    queries: the last query tile reads every key block). Their tiles are launched last-first, so the heaviest
    programs start in the first wave and the light ones fill the tail, rather than the heaviest arriving last
    and running alone (longest first, as FlashAttention-3's scheduler orders causal tiles). The chunks counted are
    those the affine masks leave, within the call-time masks' ranges (``blocks``' bounds) where those are known
    when traced (a block map of the indices alone: causal written as no linear reading takes it; not ids or
    captured arrays, whose values only the call says); over a batch or head a map reads, the heaviest.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> heavy_last(p, {"q": 64, "x": 64, "d": 8}, {"q": 64, "x": 64, "d": 8})
    ('q',)
    """
    if p.stream is None:
        return ()
    x, s = p.stream
    masks = [m for b in p.diagram.boxes if (m := affine_mask(b)) is not None and x in m.axes]
    known = _known_bounds(blocks) if len(p.tiles) == 1 else []  # bounds lie along a kernel's one tiled axis
    if not masks and not known:
        return ()
    n_chunks = padded[x] // s
    ranges = {a: (0, extent[a]) for a in (*p.tiles, *p.batch, *p.whole)}
    flipped = []
    with jax.ensure_compile_time_eval():  # concrete sizes: evaluated now, also while a caller's jit traces
        for a, g in p.tiles.items():
            n = padded[a] // g
            if n < 2:
                continue
            work = []
            for t in (0, n - 1):
                span = visited(masks, x, s, n_chunks, ranges | {a: (t * g, min(t * g + g, extent[a]))}, extent[x])
                if any(isinstance(v, jax.core.Tracer) for v in span):
                    break  # a mask whose offset is known only in the kernel (a ring step's): the order is kept
                if known and t < known[0].shape[-2]:  # each batch element's range, its heaviest counted
                    span = np.broadcast_arrays(*(np.asarray(v) for v in span))
                    for b in known:
                        span = combine(span, tuple(b[..., t, k] for k in range(4)))
                work.append(int(np.max(np.asarray(span[3]) - np.asarray(span[0]))))
            if len(work) == 2 and work[1] > work[0]:
                flipped.append(a)
    return tuple(flipped)


def _known_bounds(blocks: CallBlocks | None) -> list:
    """The bounds (``[..., tiles, 4]``) of the call-time masks that are block maps of the indices alone, known when
    traced, as numpy arrays; none where a map has holes (its chunk lists, not its range, say the work). Ids' bounds
    are left out: their values are the call's, and an order taken from them would differ from call to call."""
    if blocks is None or blocks.listed:
        return []
    known = [b for m, b in blocks.bounds if isinstance(m, Mapped) and not m.inputs]
    return [] if any(isinstance(b, jax.core.Tracer) for b in known) else [np.asarray(b) for b in known]


def zeroing_mask(d: Diagram, x: str, tiles=None):
    """The affine mask that zeroes every accumulator's input in a kernel streaming ``x``: one ``Kept`` box
    (a score's cotangent where the mask keeps the score, else 0) on axes other than ``x``, read by every box
    that reduces ``x``, each a contraction (multilinear: a zero operand gives its identity, 0), directly or
    through derivatives of index functions (``∂ᵢ f``, the cotangent times a partial derivative: linear in the
    cotangent, so 0 stays 0). A tile it hides then adds nothing in any chunk, so the kernel runs none: a bias's
    gradient streamed over the batch skips the causal mask's empty tiles, and so does a learned table's (read by
    a score modifier, its gradient the modifier's derivative). None where there is no such mask, or, given the
    kernel's ``tiles`` (axis names), where the mask reads an axis that is not one of them.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering._backward import backward_of
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> att = nc.library.biased_attention(q, x, d, batch=(b, h), bias_batch=(h,), causal=True)
    >>> db = backward_of(derive(att, tile(q, 16), stream(x, 16), verify=False).diagram).pieces[-1].scheduled
    >>> zeroing_mask(db, "b").axes
    ('q', 'x')
    >>> from napkin_cat.generators import Captured
    >>> rel = jnp.arange(7.0)  # a table read at q - x: its reads an input [q, x], their gradient ∂1 f of dS
    >>> f = Captured.of(lambda s, q, x: s + rel[q - x], ("q", "x"), score=True)
    >>> modded = nc.library.dot_product_attention(q, x, d, batch=(b, h), causal=True, captured=((f, [nc.Array(q, x)]),))
    >>> db = backward_of(derive(modded, tile(q, 16), stream(x, 16), verify=False).diagram).pieces[-1].scheduled
    >>> zeroing_mask(db, "h").axes
    ('q', 'x')
    """
    masks: dict = {}  # layer → the affine form of a Kept mask there; its outputs carry the layer as a token
    readers = []

    def step(i, box, ins):
        m = affine_mask(box)
        if isinstance(box, IndexMap) and m is not None and x not in m.axes:
            masks[i] = m
            return [("mask", i)] * len(box.cod)
        if isinstance(box, Elementwise) and isinstance(box.params["fn"], Partial) and ins and isinstance(ins[0], tuple):
            return [ins[0]] * len(box.cod)  # g · ∂f: zero where the cotangent g is
        if x in getattr(box, "reduced", ()):
            readers.append((box, {v[1] for v in ins if isinstance(v, tuple) and v[0] == "mask"}))
        return [None] * len(box.cod)

    d.dataflow([None] * len(d.dom), step)
    common = set(masks)
    for box, fed in readers:
        common &= fed if isinstance(box, Contract) else set()
    m = masks[min(common)] if readers and common else None
    return m if m is not None and (tiles is None or set(m.axes) <= set(tiles)) else None


def tile_kept(m, p: Plan, offsets: dict, extent: dict):
    """1 (int32) where the affine mask ``m`` (on tiled axes only) keeps something of this program's tile, else
    0: a factor of the loop's bounds (arithmetic, as Pallas' Triton lowering types a select of literals i1)."""
    a = m.axes[0]
    ranges = {t: (offsets[t], jnp.minimum(offsets[t] + g, extent[t])) for t, g in p.tiles.items() if t != a}
    lo, hi = m.interval(a, ranges)
    return ((hi > offsets[a]) & (lo < jnp.minimum(offsets[a] + p.tiles[a], extent[a]))).astype(jnp.int32)


def combine(a: tuple, b: tuple) -> tuple:
    """The chunk ranges of two masks together: a chunk is visited where both may keep something, and run
    unmasked where both keep it whole (intervals intersect)."""
    first = jnp.maximum(a[0], b[0])
    last = jnp.maximum(first, jnp.minimum(a[3], b[3]))
    full_lo = jnp.clip(jnp.maximum(a[1], b[1]), first, last)
    full_hi = jnp.clip(jnp.minimum(a[2], b[2]), full_lo, last)
    return first, full_lo, full_hi, last


def segment_mask(box) -> tuple[int, int] | None:
    """Where a segment mask box reads its two label arrays (positions among its inputs), as its function says
    (``segment_labels``, a :class:`~napkin_cat.library.SameSegment`'s), or the derivative of one in its score
    (``Partial(same, 0)``: the cotangent where the labels agree, else 0), which hides the same entries and is the
    identity where the mask keeps all; None for any other box.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> [segment_mask(b) for b in nc.library.document_attention(q, x, d).boxes if segment_mask(b)]
    [(1, 2)]
    """
    fn = box.params["fn"] if isinstance(box, Elementwise) else None
    if isinstance(fn, Partial) and fn.arg == 0:  # the derivative in the score: its cotangent comes first
        labels = getattr(fn.fn, "segment_labels", None)
        return None if labels is None else tuple(i + 1 for i in labels)
    return getattr(fn, "segment_labels", None)


@dataclass(frozen=True)
class Segments:
    """A segment mask of a kernel that tiles ``axis`` and streams the other axis it reads: its ``box``, and
    the kernel inputs holding the labels along the tiled axis (``tiled``) and the streamed one (``streamed``)."""

    box: object
    tiled: int
    streamed: int
    axis: str


@dataclass(frozen=True)
class Limits:
    """A valid-keys mask read as one key limit per row (:class:`lowering._decode.KeyLimit`: key ``pos`` kept where
    ``pos < limit``; it says where it reads them, ``limit_labels``), its limits the kernel input ``limit`` over grid
    axes and the tiled ``axis``: a tile visits the chunks below its rows' largest limit and runs unmasked those
    below their smallest (:func:`limit_bounds`), found at call time from the limits, as segment ids' ranges are."""

    box: object
    limit: int
    axis: str


@dataclass(frozen=True)
class Lengths:
    """A length mask of a kernel streaming ``x``: its ``box``, whose function keeps key ``pos[x]`` where ``pos[x] <
    n + t`` and says where it reads ``(pos, n, t)`` (``length_labels``), and the kernel inputs holding ``n`` (over
    grid axes: a sequence's length) and ``t`` (over grid and tiled axes: a row's offset from it). ``pos`` is the
    streamed index itself (an ``arange``, which the kernel makes: :func:`made_positions`), so the kernel finds its
    chunks from ``n`` and ``t`` alone (:func:`length_bounds`), in the program: no call-time pass over ids."""

    box: object
    n: int
    t: int


def made_positions(d: Diagram, p: Plan) -> frozenset[int]:
    """The inputs of ``d`` (a kernel body) a kernel makes itself instead of reading: the key positions a valid-keys
    mask reads (its function's ``position_label``: :class:`lowering._decode.KeyLength`, ``KeyLimit``), an input
    along the streamed axis alone holding the streamed index (an ``arange``). Triton makes them per chunk as an
    iota; Mosaic too, so they take no ring of shared memory and no TMA copy.

    >>> from napkin_cat import axes, f32
    >>> from lowering._decode import decode_diagram
    >>> from lowering import plan
    >>> from rewrites import derive, stream as streamed, tile as tiled
    >>> b, p, h, q, x, d = axes("b p h q x d")
    >>> step = decode_diagram(b, p, h, q, x, d, d, None, f32, limits=True)   # Mosaic's form: (s, pos, limit)
    >>> kernel = plan(derive(step, tiled(q, 64), streamed(x, 64), verify=False).diagram)
    >>> made_positions(kernel.diagram, kernel), kernel.diagram.dom.inside[3].describe()
    (frozenset({3}), 'x~64:i32@HBM')
    """
    if p.stream is None:
        return frozenset()
    x, found = p.stream[0], set()

    def step(i, box, ins):
        fn = box.params["fn"] if isinstance(box, Elementwise) else None
        at = getattr(fn, "position_label", None)
        if at is not None and ins[at] is not None and tuple(d.dom.inside[ins[at]].names) == (x,):
            found.add(ins[at])
        return [None] * len(box.cod)

    d.dataflow(list(range(len(d.dom))), step)
    return frozenset(found)


def length_masks(d: Diagram, p: Plan) -> tuple[Lengths, ...]:
    """The length masks of ``d`` (a kernel body) whose ``n`` and ``t`` are inputs of the kernel and whose positions
    are an input along the streamed axis alone, in the order of their boxes.

    >>> import napkin_cat as nc
    >>> from lowering._decode import KEY_LENGTH, length_wires
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> b, q, x, d = nc.axes("b q x d")
    >>> att = nc.library.dot_product_attention(q, x, d, batch=(b,), captured=((KEY_LENGTH, length_wires(b, q, x)),))
    >>> p = plan(derive(att, tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> [(m.n, m.t) for m in length_masks(p.diagram, p)]
    [(4, 5)]
    """
    if p.stream is None:
        return ()
    x, found = p.stream[0], []

    def step(i, box, ins):
        fn = box.params["fn"] if isinstance(box, Elementwise) else None
        at = getattr(fn, "length_labels", None)
        if at is not None:
            pos, n, t = (ins[k] for k in at)
            if None not in (pos, n, t) and tuple(d.dom.inside[pos].names) == (x,):
                found.append(Lengths(box, n, t))
        return [None] * len(box.cod)

    d.dataflow(list(range(len(d.dom))), step)
    return tuple(found)


def length_bounds(n, t, s: int, n_chunks: int, valid=None) -> tuple:
    """The chunks of ``s`` keys a block of a length mask visits, ``(first, full_lo, full_hi, last)``: those below
    ``n + max(t)`` (the longest row's keys), and, kept whole, those below ``n + min(t)`` (the shortest row's);
    ``valid`` (bool, ``t``'s shape): the rows of ``t`` that exist (a tile past the array's end holds others).

    >>> [int(v) for v in length_bounds(jnp.int32(40), jnp.array([-3, 0]), 16, 4)]
    [0, 0, 2, 3]
    >>> [int(v) for v in length_bounds(jnp.int32(40), jnp.array([-20, 0]), 16, 4, jnp.array([True, False]))]
    [0, 0, 1, 2]
    """
    if valid is not None:  # rows past the array's end widen no range
        big = jnp.iinfo(jnp.int32)
        t_hi, t_lo = jnp.where(valid, t, big.min), jnp.where(valid, t, big.max)
    else:
        t_hi = t_lo = t
    hi, lo = n + jnp.max(t_hi), n + jnp.min(t_lo)
    last = jnp.clip(-(-hi // s), 0, n_chunks).astype(jnp.int32)
    return 0, 0, jnp.clip(lo // s, 0, last).astype(jnp.int32), last


@dataclass(frozen=True)
class Mapped:
    """A mask of a kernel that tiles ``axis`` and streams the other axis it reads, whose function has no affine
    form: its ``box`` (a :class:`~napkin_cat.generators.Mask`, or a mask's backward), whose blocks the wrapper
    finds at call time from its block map (:meth:`~napkin_cat.generators.Mask.block_map`, :func:`map_bounds`).
    A mask over captured arrays (a :class:`~napkin_cat.generators.Captured` function, or its derivative in the
    score) reads them from the kernel's inputs ``inputs``: its map is evaluated on them at each call
    (:func:`captured_bounds`), so new values reuse the kernel."""

    box: object
    axis: str
    inputs: tuple[int, ...] = ()


def mapped_mask(box, p: Plan, names: tuple[str, ...]) -> Mapped | None:
    """A :class:`Mapped` for a mask ``box`` on axes ``names`` (its scores' axes in the kernel) that the
    symbolic path does not know (no affine form) and whose blocks a block map can say: it holds the streamed
    axis and one tiled axis, besides grid (batch) axes. None for any other box."""
    function = getattr(box, "mask_function", None)
    if not callable(function) or function() is None or affine_mask(box) is not None:
        return None
    x, rest = p.stream[0], [a for a in names if a not in p.batch]
    tiled = [a for a in rest if a in p.tiles]
    if x not in rest or len(tiled) != 1 or len(rest) != 2:
        return None
    return Mapped(box, tiled[0])


def captured_mask(box) -> tuple:
    """A mask over captured arrays: its function (a :class:`~napkin_cat.generators.Captured` mask) and where the
    box reads the function's inputs (positions among its inputs: after the score, or after the cotangent and the
    score for the mask's derivative in its score, ``Partial(fn, 0)``); ``(None, ())`` for any other box.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from napkin_cat.generators import Captured
    >>> ids = jnp.array([0, 0, 1])
    >>> c = Captured.of(lambda q, x: ids[q] == ids[x], ("q", "x"), score=False)
    >>> q, x = nc.axes("q x")
    >>> box = nc.generators.elementwise(c, nc.Array(q, x), nc.Array(q, dtype="i32"), nc.Array(x, dtype="i32"),
    ...                                 out=nc.Array(q, x))
    >>> captured_mask(box)[1]
    (1, 2)
    """
    fn = box.params["fn"] if isinstance(box, Elementwise) else None
    first = 1
    if isinstance(fn, Partial) and fn.arg == 0:  # the derivative in the score: its cotangent comes first
        fn, first = fn.fn, 2
    if not isinstance(fn, Captured) or fn.score:
        return None, ()
    return fn, tuple(range(first, len(box.dom)))


def segments(d: Diagram, p: Plan) -> tuple[Segments | Limits | Mapped, ...]:
    """The masks of ``d`` (the plan's diagram or a kernel body) whose blocks are found at call time, in the
    order the kernel reads their bounds: segment masks, whose blocks the ids say (each reads labels along a
    tiled axis and along the streamed one, both inputs of the kernel, through copies and swaps), and key limits
    (:class:`Limits`, whose blocks the rows' limits say), then masks of
    any other function the symbolic path cannot read (:func:`mapped_mask`), whose blocks their block map says,
    the maps of masks over captured arrays (:func:`captured_mask`, read from inputs of the kernel) among them.
    Others run masked on every chunk, as any elementwise box.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.document_attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> [(m.tiled, m.streamed, m.axis) for m in segments(p.diagram, p)]
    [(3, 4, 'q')]
    """
    if p.stream is None:
        return ()
    x, found = p.stream[0], []

    def axis(j):  # the one axis of input j's labels that is not a grid (batch) axis
        names = [n for n in d.dom.inside[j].names if n not in p.batch]
        return names[0] if len(names) == 1 else None

    def step(i, box, ins):
        pos = segment_mask(box)
        labels = [ins[k] for k in pos or ()]
        if labels and None not in labels:
            along = {axis(j): j for j in labels}
            t = next((a for a in along if a != x), None)
            if x in along and t in p.tiles:
                found.append(Segments(box, along[t], along[x], t))
        fn, at = captured_mask(box)
        if fn is not None and (m := _captured_map(box, [ins[k] for k in at], d, p)) is not None:
            captured.append(m)
        limit = getattr(box.params["fn"] if isinstance(box, Elementwise) else None, "limit_labels", None)
        if limit is not None and None not in (ins[limit[0]], ins[limit[1]]):
            pos, t = d.dom.inside[ins[limit[0]]], axis(ins[limit[1]])
            if tuple(pos.names) == (x,) and t in p.tiles:
                found.append(Limits(box, ins[limit[1]], t))
        return [None] * len(box.cod)

    captured: list = []
    d.dataflow(list(range(len(d.dom))), step)
    mapped = (mapped_mask(b, p, b.dom.inside[0].names) for b in d.boxes if len(b.dom) == 1)
    return (*found, *(m for m in mapped if m is not None), *captured)


def _captured_map(box, inputs: list, d: Diagram, p: Plan) -> Mapped | None:
    """A :class:`Mapped` for a mask over captured arrays whose inputs are the kernel's ``inputs`` (None where one is
    computed in the kernel), on scores of the streamed axis, one tiled axis and batch axes, each input on some of
    them; None otherwise."""
    x, rest = p.stream[0], [a for a in box.dom.inside[0].names if a not in p.batch]
    tiled = [a for a in rest if a in p.tiles]
    if None in inputs or x not in rest or len(tiled) != 1 or len(rest) != 2:
        return None
    names = {*p.batch, x, tiled[0]}
    if any(not set(d.dom.inside[j].names) <= names for j in inputs):
        return None
    return Mapped(box, tiled[0], tuple(inputs))


@jax.jit
def map_bounds(kept, whole):
    """The four bounds of each row of a block map (``kept``: a block holds something the mask keeps; ``whole``:
    it keeps all of it; ``[..., tiles, chunks]``): ``first`` and ``last``, the first and one past the last chunk
    kept something of, and ``[full_lo, full_hi)``, the longest run of chunks kept whole between them (the first
    such run where several are longest), as an int32 array ``[..., tiles, 4]``. A row keeping nothing gives
    ``(0, 0, 0, 0)``: the kernel visits none of its chunks.

    >>> kept = jnp.array([[0, 1, 1, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], bool)
    >>> whole = jnp.array([[0, 1, 0, 1, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0]], bool)
    >>> map_bounds(kept, whole).tolist()
    [[1, 5, 7, 7], [0, 0, 0, 0]]
    """
    n = kept.shape[-1]
    at = lax.broadcasted_iota(jnp.int32, kept.shape, kept.ndim - 1)
    any_kept = kept.any(-1)
    first = jnp.where(any_kept, jnp.argmax(kept, -1), 0)
    last = jnp.where(any_kept, n - jnp.argmax(kept[..., ::-1], -1), 0)
    whole = whole & kept
    broken = lax.cummax(jnp.where(whole, -1, at), axis=kept.ndim - 1)  # the last chunk not kept whole, so far
    run = jnp.where(whole, at - broken, 0)  # the run of whole chunks ending at each chunk
    end = jnp.argmax(run, -1)
    longest = jnp.max(run, -1)
    full_hi = jnp.where(longest > 0, end + 1, first)
    full_lo = full_hi - longest
    return jnp.stack([first, full_lo, full_hi, last], axis=-1).astype(jnp.int32)


@jax.jit
def chunk_lists(kept, whole):
    """FlexAttention's block mask of a block map (``[..., tiles, chunks]``, as :func:`map_bounds` takes it), per
    tile: the chunks it cuts (kept something of, not all: run masked) and those it keeps whole (run unmasked), each
    sorted and padded to a power of two ≥ 16 with ``chunks`` (no chunk), as an int32 array ``[..., tiles, 2,
    width]``. The padding stands for the counts (``kv_num_blocks``, ``full_kv_num_blocks``): the chunks of a list
    below ``c`` number ``sum(list < c)``, one comparison a kernel also intersects the list with a range by.

    >>> kept = jnp.array([[1, 0, 1, 1, 0, 1]], bool)
    >>> whole = jnp.array([[0, 0, 1, 0, 0, 1]], bool)
    >>> chunk_lists(kept, whole)[0, :, :6].tolist()
    [[0, 3, 6, 6, 6, 6], [2, 5, 6, 6, 6, 6]]
    """
    n = kept.shape[-1]
    width = max(16, 1 << (n - 1).bit_length())
    at = lax.broadcasted_iota(jnp.int32, kept.shape, kept.ndim - 1)

    def listed(flag):
        chunks = jnp.sort(jnp.where(flag, at, n), axis=-1)
        return jnp.pad(chunks, [(0, 0)] * (kept.ndim - 1) + [(0, width - n)], constant_values=n)

    return jnp.stack([listed(kept & ~whole), listed(kept & whole)], axis=-2).astype(jnp.int32)


@jax.jit
def holed(kept, whole, bounds=None):
    """Whether the four bounds of a block map (:func:`map_bounds`, given or computed) lose some of its sparsity: a
    chunk between a tile's ``first`` and ``last`` kept nothing of (a dilated window's hole), or a chunk kept whole
    outside the one run the bounds run unmasked. A band (a sliding window, documents in order) has none.

    >>> kept = jnp.array([[1, 0, 1]], bool)
    >>> bool(holed(kept, jnp.zeros_like(kept))), bool(holed(kept.at[0, 1].set(True), jnp.zeros_like(kept)))
    (True, False)
    """
    b = map_bounds(kept, whole) if bounds is None else bounds
    return (jnp.sum(b[..., 3] - b[..., 0]) > jnp.sum(kept)) | (jnp.sum(b[..., 2] - b[..., 1]) < jnp.sum(kept & whole))


class MapBlocks(NamedTuple):
    """A kernel's block map on its grid and all it reads of it: the map (``kept``, ``whole``), whether its four
    bounds lose sparsity (``holes``, :func:`holed`), the bounds (:func:`map_bounds`) and the chunk lists
    (:func:`chunk_lists`)."""

    kept: object
    whole: object
    holes: object
    bounds: object
    lists: object


@dataclass(frozen=True)
class OnGrid:
    """What a kernel reads of its block map, as a function of the map: the map broadcast to the kernel's ``grid``
    (tiles, chunks; where the mask reads neither axis) and its :class:`MapBlocks`. Hashable, so the mask's
    :meth:`~napkin_cat.generators.Mask.block_map` runs it in the program that coarsens the map: a traced map's
    build is bound by dispatches, not by its arithmetic, and this makes the coarsening, the broadcast, the bounds,
    the holes and the lists one where they were one each.

    >>> m = jax.jit(OnGrid((2, 3)))(jnp.array([[True, False, True]]), jnp.array([[True, False, False]]))
    >>> bool(m.holes), m.bounds.tolist(), m.lists.shape
    (True, [[0, 0, 1, 3], [0, 0, 1, 3]], (2, 2, 16))
    """

    grid: tuple

    def __call__(self, kept, whole) -> MapBlocks:
        kept, whole = (jnp.broadcast_to(v, (*v.shape[:-2], *self.grid)) for v in (kept, whole))
        bounds = map_bounds(kept, whole)
        return MapBlocks(kept, whole, holed(kept, whole, bounds), bounds, chunk_lists(kept, whole))


def mapped_blocks(p: Plan, m: Mapped, extent: dict) -> MapBlocks:
    """The block map of a kernel's mask at sizes ``extent`` and what the kernel reads of it (:class:`OnGrid`):
    bool arrays laid out as :func:`segment_bounds`'s, the grid's batch axes (size 1 where the mask does not read
    one), then the tiles of its tiled axis, then the chunks. It depends on sizes only, so it is evaluated when
    traced (a constant of a ``jit``-compiled program) unless the mask function reads a traced value; the map itself
    is evaluated once per mask function and sizes for every kernel (:func:`napkin_cat.generators._index.block_map`),
    and each kernel's blocks from it by one compiled program."""
    x, s = p.stream
    names = (*p.batch, m.axis, x)
    blocks = {**dict.fromkeys(p.batch, 1), m.axis: p.tiles[m.axis], x: s}
    grid = (-(-extent[m.axis] // blocks[m.axis]), -(-extent[x] // s))  # an axis the mask does not read: size 1
    sizes = {a: extent[a] for a in names}
    key = (m.box.mask_function(), names, tuple(sizes.items()), tuple(blocks.items()))
    try:
        hash(key)
    except TypeError:  # an unhashable mask function: block_map says why
        key = None
    if key in _MAPS:  # a kernel of the same tiles (the forward's, the dQ kernel's), or a second trace
        _MAPS.move_to_end(key)
        return _MAPS[key]
    with jax.ensure_compile_time_eval():
        out = MapBlocks(*m.box.block_map(names, sizes, blocks, OnGrid(grid)))
    if key is not None and not any(isinstance(v, jax.core.Tracer) for v in out):
        out = out._replace(holes=bool(out.holes))  # read once: a kernel of the same map asks without a transfer
        _MAPS[key] = out
        while len(_MAPS) > 16:
            _MAPS.popitem(last=False)
    return out


#: the last maps :func:`mapped_blocks` gave, per (mask function, axes, sizes, blocks)
_MAPS: collections.OrderedDict = collections.OrderedDict()


def mapped_bounds(p: Plan, m: Mapped, extent: dict):
    """:func:`map_bounds` of a kernel's mask from its block map (:func:`mapped_blocks`), at sizes ``extent``: an
    int32 array laid out as :func:`segment_bounds`'s."""
    return mapped_blocks(p, m, extent).bounds


def captured_map(p: Plan, m: Mapped, arrays: list, extent: dict) -> tuple:
    """The block map ``(kept, whole)`` of a mask over captured arrays, evaluated on the kernel's inputs ``arrays``
    (unpadded) at this call, laid out as :func:`mapped_blocks`'s. Plain JAX, part of the caller's program, so new
    values of the arrays (document ids, lengths) reuse the compiled kernel."""
    d, (x, s) = p.diagram, p.stream
    names = (*p.batch, m.axis, x)
    ins = []
    for j in m.inputs:
        w = d.dom.inside[j]
        present = [a for a in names if w.has(a)]
        v = jnp.transpose(arrays[j], [w.names.index(a) for a in present])
        v = v[tuple(slice(0, extent[a]) for a in present)]
        ins.append(jnp.expand_dims(v, [i for i, a in enumerate(names) if not w.has(a)]))
    fn = captured_mask(m.box)[0]
    return _evaluated_map(fn, tuple(ins), p.tiles[m.axis], s, extent[m.axis], extent[x])


def captured_bounds(p: Plan, m: Mapped, arrays: list, extent: dict):
    """:func:`map_bounds` of a mask over captured arrays (:func:`captured_map`): laid out as
    :func:`segment_bounds`'s."""
    return map_bounds(*captured_map(p, m, arrays, extent))


@functools.partial(jax.jit, static_argnums=(0, 2, 3, 4, 5))
def _evaluated_map(fn, ins: tuple, g: int, s: int, nt: int, nx: int):
    """The block map of the Captured mask ``fn`` on inputs ``ins`` (``[*batch, nt, nx]``, size 1 where unread), per
    tile of ``g`` and chunk of ``s``: every score's mask evaluated, reduced per block (a reshape), one program. The
    mask's Boolean is counted per block, one reduction for both answers (some kept: a count above 0; all: the
    block's valid scores): on an H200, at N = 8192 and blocks of 128, 22 µs against 43 µs for ``any`` and ``all``
    of ``isfinite(where(keep, 0, −∞))``, the map of a captured ``document_id`` evaluated at every call."""
    tiles, chunks = -(-nt // g), -(-nx // s)

    def blocked(v):  # [..., t, x] as [..., tiles, g, chunks, s] (1, 1 along an axis it lacks); padding repeats
        *batch, a, b = v.shape
        widths = [(0, tiles * g - a if a > 1 else 0), (0, chunks * s - b if b > 1 else 0)]
        v = jnp.pad(v, [(0, 0)] * len(batch) + widths, mode="edge")
        return v.reshape(*batch, *((tiles, g) if a > 1 else (1, 1)), *((chunks, s) if b > 1 else (1, 1)))

    keep = fn.holds(*map(blocked, ins))
    keep = jnp.broadcast_to(keep, (*keep.shape[:-4], tiles, g, chunks, s))  # an unread axis counts its size
    if tiles * g != nt or chunks * s != nx:  # padded rows and columns count nothing
        real_rows = (jnp.arange(tiles)[:, None] * g + jnp.arange(g))[:, :, None, None] < nt
        keep = keep & real_rows & ((jnp.arange(chunks)[:, None] * s + jnp.arange(s)) < nx)
    total = jnp.sum(keep.astype(jnp.int32), axis=(-3, -1))
    valid = jnp.minimum(nt - jnp.arange(tiles) * g, g)[:, None] * jnp.minimum(nx - jnp.arange(chunks) * s, s)
    return total > 0, total == valid  # valid: each block's scores inside the sizes


def call_bounds(p: Plan, m: Segments | Mapped, arrays: list, extent: dict):
    """The four bounds per tile of one mask of :func:`segments`: from its ids (:func:`segment_bounds`), its block
    map (:func:`mapped_bounds`) or, for a mask over captured arrays, its block map on this call's arrays
    (:func:`captured_bounds`)."""
    if isinstance(m, Segments):
        return segment_bounds(p, m, arrays, extent)
    if isinstance(m, Limits):
        return limit_bounds(p, m, arrays, extent)
    return captured_bounds(p, m, arrays, extent) if m.inputs else mapped_bounds(p, m, extent)


@dataclass(frozen=True)
class CallBlocks:
    """What a kernel's wrapper passes it of its call-time masks (:func:`segments`): ``bounds``, ``(mask, int32
    [..., tiles, 4])`` for each mask read as one range per tile (segment ids, a block map without holes), and
    ``lists``, :func:`chunk_lists` of the block maps read chunk by chunk (a map with holes, or over captured
    arrays, whose holes only its values say), and'ed into one (``[..., tiles, 2, width]``, on ``axis``), or
    None. The kernel intersects both with its affine masks' ranges."""

    bounds: tuple
    lists: object = None
    axis: str | None = None

    @property
    def listed(self) -> bool:
        """Whether the kernel reads the chunk lists."""
        return self.lists is not None


def call_blocks(p: Plan, masks: tuple, arrays: list, extent: dict, *, every: bool = False) -> CallBlocks:
    """The :class:`CallBlocks` of a kernel's call-time ``masks`` on this call's ``arrays`` (sizes ``extent``): a
    block map becomes chunk lists where its mask reads captured arrays or, at these sizes, its four bounds lose some
    of its sparsity (:func:`holed`: decided when traced, the map being a constant of the sizes), or with ``every``
    (a check that the kernel's listed path lowers, at sizes too small for holes), else four bounds, as segment ids
    are always (sorted ids leave no holes; unsorted ones, a superset, still correct)."""
    bounds, maps = [], []
    for m in masks:
        if isinstance(m, Segments | Limits):
            bounds.append((m, call_bounds(p, m, arrays, extent)))
            continue
        if m.inputs:
            maps.append((m, captured_map(p, m, arrays, extent)))
            continue
        read = mapped_blocks(p, m, extent)
        if every or isinstance(read.holes, jax.core.Tracer) or bool(read.holes):  # a traced map's holes unknown
            maps.append((m, read))
        else:
            bounds.append((m, read.bounds))
    if not maps:
        return CallBlocks(tuple(bounds))
    if len(maps) == 1 and isinstance(maps[0][1], MapBlocks):  # its lists read with it
        return CallBlocks(tuple(bounds), maps[0][1].lists, maps[0][0].axis)
    axes = {m.axis for m, _ in maps}
    if len(axes) > 1:
        raise NotLowerable(
            f"masks {', '.join(repr(m.box.name) for m, _ in maps)} have block maps with holes over different tiled "
            f"axes {sorted(axes)}; a kernel reads chunk lists along one: give them one tiled axis"
        )
    with jax.ensure_compile_time_eval():  # maps of the sizes alone: their lists are constants too, not work per call
        kept, whole = maps[0][1][:2]
        for _, (k, w, *_) in maps[1:]:
            kept, whole = kept & k, whole & w
        lists = chunk_lists(kept, whole)
    return CallBlocks(tuple(bounds), lists, axes.pop())


def segment_blocks(tiled, streamed, tile: int, chunk: int):
    """For each block of ``tile`` labels of ``tiled`` (``[..., n]``), the chunks of ``chunk`` labels of
    ``streamed`` (``[..., m]``, leading axes broadcast) it visits, ``[first, last)``, and keeps whole,
    ``[full_lo, full_hi)``: an int32 array ``[..., cdiv(n, tile), 4]`` of ``(first, full_lo, full_hi, last)``.

    A block and a chunk may meet where their ranges of labels overlap, and are kept whole where both hold
    one and the same label. Each block's range is looked up among the prefix maxima and suffix minima of the
    chunks' ranges (both nondecreasing) by counting those below it: one fused comparison of every block with
    every chunk (n/tile × m/chunk, 8k pairs at 8192 tokens), which on an H100 takes microseconds where a
    binary search's sequential steps took 0.66 ms (``papers/flash_attention/document_skipping.py``).
    For sorted labels this is exact (the chunks whose range overlaps the block's, which for the same labels
    on both sides are those it meets); otherwise the visited chunks are a superset and the whole ones a
    subset, so a kernel stays correct. Positions beyond the arrays' ends (padding) take part in no range.

    >>> ids = jnp.array([0] * 5 + [1] * 7 + [2] * 4)  # three documents over 16 positions, blocks of 4
    >>> segment_blocks(ids, ids, 4, 4).tolist()
    [[0, 0, 1, 2], [0, 0, 0, 3], [1, 2, 3, 3], [3, 3, 4, 4]]
    """
    big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min

    def spans(ids, size):
        n = ids.shape[-1]
        m = -(-n // size)
        widths = [(0, 0)] * (ids.ndim - 1) + [(0, m * size - n)]
        blocks = (*ids.shape[:-1], m, size)
        lo = jnp.pad(ids, widths, constant_values=big).reshape(blocks).min(-1)
        hi = jnp.pad(ids, widths, constant_values=small).reshape(blocks).max(-1)
        return lo, hi

    tiled, streamed = jnp.asarray(tiled, jnp.int32), jnp.asarray(streamed, jnp.int32)
    lo, hi = spans(tiled, tile)
    clo, chi = spans(streamed, chunk)
    reach = lax.cummax(chi, axis=chi.ndim - 1)  # the largest label up to each chunk: nondecreasing
    floor = lax.cummin(clo, axis=clo.ndim - 1, reverse=True)  # the smallest from each chunk on: nondecreasing

    def search(side):  # searchsorted by counting: one fused comparison, where a binary search takes sequential steps
        def count(ascending, values):
            below = ascending[..., None, :] < values[..., :, None]
            return jnp.sum(below | (ascending[..., None, :] == values[..., :, None]) if side == "right" else below, -1)

        return count

    first = search("left")(reach, lo)  # chunks before it end below the block's smallest label
    last = search("right")(floor, hi)  # chunks from it on start above the block's largest
    full_lo = jnp.clip(search("left")(floor, lo), first, last)  # from it on, nothing below the label
    full_hi = jnp.clip(search("right")(reach, hi), full_lo, last)  # up to it, nothing above
    full_hi = jnp.where(lo == hi, full_hi, full_lo)  # a block of several labels is never kept whole
    return jnp.stack(jnp.broadcast_arrays(first, full_lo, full_hi, last), axis=-1).astype(jnp.int32)


def segment_bounds(p: Plan, m: Segments, arrays: list, extent: dict):
    """:func:`segment_blocks` of a kernel's segment mask, on its unpadded label inputs laid out as the grid's
    batch axes (size 1 where the labels lack one) then the tiled or streamed axis."""
    x = p.stream[0]
    tiled, streamed = (grid_laid_out(p, arrays, j, a, extent) for j, a in ((m.tiled, m.axis), (m.streamed, x)))
    return segment_blocks(tiled, streamed, p.tiles[m.axis], p.stream[1])


def grid_laid_out(p: Plan, arrays: list, j: int, a: str, extent: dict):
    """Kernel input ``j`` (unpadded: ``a`` cut to its extent) laid out as the grid's batch axes, size 1 where it
    lacks one, then its axis ``a``: what a call-time mask's bounds are computed over, tile by tile."""
    w, v = p.diagram.dom.inside[j], arrays[j]
    v = jnp.transpose(v, [w.names.index(b) for b in p.batch if w.has(b)] + [w.names.index(a)])[..., : extent[a]]
    return jnp.expand_dims(v, [i for i, b in enumerate(p.batch) if not w.has(b)])


def limit_bounds(p: Plan, m: Limits, arrays: list, extent: dict):
    """Each tile's chunks under a :class:`Limits` mask, ``(first, full_lo, full_hi, last)`` as int32 ``[grid axes
    (1 where the limits lack one)..., tiles, 4]``: from chunk 0 to the first chunk no row of the tile sees (its
    largest limit over the chunk size, rounded up), whole below the first chunk a row does not see whole (its
    smallest limit, rounded down). A tile whose rows see no key visits no chunk.

    >>> import napkin_cat as nc
    >>> from napkin_cat.dtypes import f32
    >>> from lowering._decode import decode_diagram
    >>> from lowering import plan
    >>> from rewrites import derive, stream as streamed, tile as tiled
    >>> b, parts, h, q, x, d = nc.axes("b p h q x d")
    >>> step = plan(derive(decode_diagram(b, parts, h, q, x, d, d, None, f32, limits=True), tiled(q, 2),
    ...                    streamed(x, 4), verify=False).diagram)
    >>> (limits,) = segments(step.diagram, step)
    >>> rows = jnp.array([[[9.0, 10.0, 0.0, -3.0]]])                      # [b, p, q]: 2 tiles of 2 rows
    >>> arrays = [None] * limits.limit + [rows]
    >>> step.batch, limit_bounds(step, limits, arrays, {"b": 1, "p": 1, "h": 1, "q": 4, "x": 16, "d": 8}).tolist()
    (('b', 'h', 'p'), [[[[[0, 0, 2, 3], [0, 0, 0, 0]]]]])
    """
    (x, s), g = p.stream, p.tiles[m.axis]
    v = grid_laid_out(p, arrays, m.limit, m.axis, extent)
    rows, chunks = v.shape[-1], -(-extent[x] // s)
    tiles = -(-rows // g)
    pad = [(0, 0)] * (v.ndim - 1) + [(0, tiles * g - rows)]

    def per_tile(reduce, fill):  # padding rows, past the array's end, count for neither
        return reduce(jnp.pad(v, pad, constant_values=fill).reshape(*v.shape[:-1], tiles, g), axis=-1)

    hi, lo = per_tile(jnp.max, -jnp.inf), per_tile(jnp.min, jnp.inf)
    last = jnp.clip(jnp.ceil(hi / s), 0, chunks).astype(jnp.int32)
    whole = jnp.clip(jnp.floor(lo / s), 0, extent[x] // s).astype(jnp.int32)
    zero = jnp.zeros_like(last)
    return jnp.stack([zero, zero, jnp.minimum(whole, last), last], axis=-1)


def tiled_first(d: Diagram, p: Plan, *, inputs: bool = False) -> Diagram:
    """``d`` after the rule :class:`rewrites.tiled_first` for ``p``'s streamed and tiled axes (``d`` where nothing
    streams): each wire holding the streamed axis and a tiled one laid out tiled axes first.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> from lowering._backward import backward_of
    >>> q, x, d = nc.axes("q x d")
    >>> dkv = backward_of(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> p = plan(dkv.pieces[-1].scheduled)
    >>> sorted({str(w) for b in tiled_first(p.diagram, p).boxes for w in b.cod.inside if w.has("q") and w.has("x")})
    ['x/16×q~16']
    """
    return d if p.stream is None else rewrites.tiled_first(p.stream[0], tuple(p.tiles), inputs)(d)


def mask_padding(v, wire, x, start, length, pad):
    idx = lax.broadcasted_iota(jnp.int32, v.shape, wire.names.index(x)) + start
    return jnp.where(idx < length, v, jnp.asarray(pad, v.dtype))
