"""The Triton kernel body: the block diagram walked on one program's blocks, the streamed axis a ``fori_loop``
folding the accumulators (FAN §3), the chunks the masks hide skipped and those they keep whole run unmasked."""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import rewrites
from lowering._blocks import (
    BlockContext,
    affine_mask,
    combine,
    length_bounds,
    length_masks,
    mask_padding,
    segments,
    tile_kept,
    visited,
    zeroing_mask,
)
from lowering._loop import ChunkList, ChunkLoop
from lowering._plan import Plan, neutral_padding, unweave
from lowering.triton._namespace import Blocks
from napkin_cat.diagram import Array
from napkin_cat.generators import Contract
from rewrites import Rule, walk


def kernel_rules(
    p: Plan, extent: dict | None = None, padded: dict | None = None, *, flat: bool = False
) -> tuple[Rule, ...]:
    """The rules a Triton kernel applies to its block diagram (``unweave(p.diagram, p.batch)``), in order: the
    base-2 exponent, the tiled-first layout where it streams (not ``flat``: a loop over single elements walks
    blocks without the streamed axis, :func:`_single_steps`), and, at sizes (``extent``, ``padded``) where an axis
    kept whole is padded to a power of two, the neutral padding of that axis. A ragged streamed axis is padded
    chunk by chunk with the values the same rule's side condition checks (:func:`rewrites.neutral_padding`).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> kernel_rules(p, {"q": 40, "x": 40, "d": 40}, {"q": 48, "x": 48, "d": 64})
    (base2(), tiled_first(x, ('q',), inputs=True), pad_neutral(d, 40))
    """
    rules: list[Rule] = [rewrites.base2()]
    if p.stream is not None and not flat:
        rules.append(rewrites.tiled_first(p.stream[0], tuple(p.tiles), inputs=True))
    if extent is not None:
        rules += [rewrites.pad_neutral(a, extent[a]) for a in p.whole if padded[a] != extent[a]]
    return tuple(rules)


def short_tiles(p: Plan, wire: Array, extent: dict, padded: dict) -> tuple[str, ...]:
    """The tiled axes along which ``wire``'s array is read (an input) or written (an output) masked in the program,
    at its own extent, rather than padded to whole tiles by the wrapper (a copy) and sliced: every axis it falls
    short along is tiled and it holds no streamed axis (a streamed block, loaded per chunk, is padded). ``()``
    where it is padded, or whole.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> sizes = ({"q": 4, "x": 40, "d": 16}, {"q": 16, "x": 48, "d": 16})
    >>> [short_tiles(p, w, *sizes) for w in (*p.diagram.dom.inside, *p.diagram.cod.inside)]
    [('q',), (), (), ('q',)]
    """
    short = tuple(a for a in wire.names if padded[a] != extent[a])
    streamed = p.stream is not None and wire.has(p.stream[0])
    return short if short and not streamed and all(a in p.tiles for a in short) else ()


def _in_bounds(shape: tuple, names: tuple, short: tuple, offsets: dict, extent: dict):
    """Where a block (axes ``names``, ``shape``) lies inside its array along the axes ``short``: a bool mask."""
    ok = None
    for a in short:
        inside = lax.broadcasted_iota(jnp.int32, shape, names.index(a)) + offsets[a] < extent[a]
        ok = inside if ok is None else ok & inside
    return ok


def _tile_id(pid, a: str, p: Plan, padded: dict, flip):
    """The tile of axis ``a`` that grid position ``pid`` runs: last-first along the axes in ``flip``."""
    return padded[a] // p.tiles[a] - 1 - pid if a in flip else pid


def _kernel(p: Plan, sizes, extent, padded, xp: Blocks, n_bounds, flip, pages, reads, *refs):
    """The kernel body of one program: the block diagram after :func:`kernel_rules`, walked once on its blocks, or
    (where it streams) folded over the visited chunks (:class:`_Chunks`), then walked to its outputs. ``n_bounds``:
    the refs of the call-time masks' bounds (four scalars a mask read as ranges, then one ``[2, width]`` block of
    chunk lists where a block map has holes: :class:`lowering._blocks.CallBlocks`). With a page map (``pages``,
    :class:`lowering._paged.PageMap`) the table's row follows them. ``reads``: the inputs the program makes itself
    (a length mask's positions: no ref) and, per input and per output, the tiled axes read or written masked
    (:func:`short_tiles`)."""
    block = unweave(p.diagram, p.batch)
    laid = block.dom.inside  # the inputs' blocks as the caller lays them out
    d = functools.reduce(lambda d, rule: rule(d), kernel_rules(p, extent, padded), block)
    made, short_in, short_out = reads
    n_in, n_table = len(d.dom) - len(made), int(pages is not None)
    given = iter(refs[:n_in])
    in_refs = [None if i in made else next(given) for i in range(len(d.dom))]
    bound_refs = refs[n_in : n_in + n_bounds]
    table_ref, out_refs = refs[n_in + n_bounds] if pages else None, refs[n_in + n_bounds + n_table :]
    offsets = {a: _tile_id(pl.program_id(i), a, p, padded, flip) * g for i, (a, g) in enumerate(p.tiles.items())}
    program = pl.program_id(len(p.tiles))
    strides = _strides(p, padded)
    grid = {a: _batch_index(program, a, strides, padded) for a in p.batch}
    ctx = BlockContext(sizes=sizes, offsets=offsets, xp=xp, grid=grid)

    def read(i):  # input i's block; rows past its array's end (short_in) are not read, but zeros
        r, short = in_refs[i], short_in[i]
        if not short:
            return r[...]
        ok = _in_bounds(r.shape, laid[i].names, short, offsets, extent)
        return pltriton.load(r, mask=ok, other=jnp.zeros((), r.dtype))

    if p.stream is None:
        outs = walk(d, [read(i) for i in range(len(d.dom))], ctx, "", "final", {})
    elif summed_singly(p, block) and not (n_bounds or pages or made):
        outs = _single_steps(p, block, ctx, extent, padded, in_refs, read, [r.shape for r in out_refs])
    else:
        inputs = (in_refs, read, made, short_in)
        outs = _Chunks(p, d, laid, ctx, extent, padded, inputs, bound_refs, (pages, table_ref)).run()
    for r, v, w, short in zip(out_refs, outs, block.cod.inside, short_out, strict=True):
        if short:  # only the rows the output array has
            pltriton.store(r, v.astype(r.dtype), mask=_in_bounds(r.shape, w.names, short, offsets, extent))
        else:
            r[...] = v.astype(r.dtype)


def summed_singly(p: Plan, d) -> bool:
    """Whether the kernel of plan ``p`` (block diagram ``d``) streams an axis one element at a time and only sums it:
    each box reducing it a contraction whose f32 result is an output itself. Such a kernel (the gradient of a bias
    shared by the batch or the heads: ``lowering._backward``) is one walk per element, its outputs added up, and
    runs on 2-D blocks, the axis indexed, as a grid axis is, rather than kept at size 1 (:func:`_single_steps`).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> from lowering._backward import backward_of
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> att = nc.library.biased_attention(q, x, d, batch=(b, h), bias_batch=(h,), causal=True)
    >>> db = backward_of(derive(att, tile(q, 16), stream(x, 16), verify=False).diagram).pieces[-1].scheduled
    >>> summed_singly(plan(db), db), summed_singly(plan(att), att)
    (True, False)
    """
    if p.stream is None or p.stream[1] != 1:
        return False
    x = p.stream[0]
    sums = {i for i, (_, box, _) in enumerate(d.inside) if x in getattr(box, "reduced", ())}
    if not sums or not all(isinstance(d.inside[i][1], Contract) for i in sums):
        return False
    made = d.dataflow([None] * len(d.dom), lambda i, box, ins: [i] * len(box.cod))
    return all(m in sums and w.dtype.bits == 32 for m, w in zip(made, d.cod.inside, strict=True))


def _single_steps(p: Plan, block, ctx: BlockContext, extent: dict, padded: dict, in_refs, read, shapes) -> list:
    """The outputs of a kernel that :func:`summed_singly` admits: the block diagram without its streamed axis
    walked once per element of it (each input holding the axis read at that element, which index functions read as
    a grid index), the walks' outputs added in f32; elements a mask zeroing every sum hides run none. Triton lays
    out a block ``[q, x, 1]`` anew after each 2-D product, where ``[q, x]`` stays in the product's registers: the
    learned table's gradient kernel (B = 2, H = 16, N = 8192, D = 128, causal, H200) ran 5.90 ms on ``[q, x, 1]``
    blocks and runs 3.85 on 2-D ones (``papers/flash_attention/front_door.py --only relbias``, ``docs/lowering.md``)."""
    x = p.stream[0]
    flat = functools.reduce(lambda d, rule: rule(d), kernel_rules(p, extent, padded, flat=True), unweave(block, (x,)))
    laid = block.dom.inside
    resident = [None if w.has(x) else read(i) for i, w in enumerate(laid)]

    def step(c, sums):
        ins = [
            v if v is not None else in_refs[i][tuple(c if a == x else slice(None) for a in laid[i].names)]
            for i, v in enumerate(resident)
        ]
        outs = walk(flat, ins, replace(ctx, grid={**ctx.grid, x: c}), "", "final", {})
        return tuple(t + o.astype(jnp.float32) for t, o in zip(sums, outs, strict=True))

    n = jnp.int32(padded[x])
    if (zero := zeroing_mask(block, x, p.tiles)) is not None:
        n = n * tile_kept(zero, p, ctx.offsets, extent)
    return list(lax.fori_loop(jnp.int32(0), n, step, tuple(jnp.zeros(s, jnp.float32) for s in shapes)))


class _Chunks(ChunkLoop):
    """A Triton program's streamed loop (FAN §3): each chunk a slice of its block refs, or for a paged input the
    pages its table row names, gathered (:class:`lowering._paged.PageMap`), transposed into the kernel's
    tiled-first layout where the caller lays it out otherwise; the ragged last chunk's padding set neutral, the
    chunks the affine and segment masks hide skipped (their bounds: :func:`_bounds`). ``inputs``: the input refs,
    how the program reads their blocks, the inputs it makes itself (a length mask's positions, an iota per chunk)
    and the tiled axes each is short along."""

    def __init__(self, p: Plan, d, laid, ctx: BlockContext, extent, padded, inputs, bound_refs, pages=(None, None)):
        x, s = p.stream
        self.in_refs, read, self.made, self.short = inputs
        carried = [w.has(x) for w in d.dom.inside]
        # an input laid out otherwise than the kernel's wire (tiled_first): its block transposed as it loads
        self.perms = [
            None if a.names == w.names else [a.names.index(n) for n in w.names]
            for a, w in zip(laid, d.dom.inside, strict=True)
        ]
        resident = [None if c else read(i) for i, c in enumerate(carried)]
        # the ragged last chunk's padding set, in each input of an accumulator, to the value its side condition
        # checked neutral (rewrites.neutral_padding)
        self.pads = {id(d.inside[i][1]): v for i, v in neutral_padding(d, x).items()} if extent[x] != padded[x] else {}
        # affine masks reading the streamed axis, and segment masks (their bounds come from the wrapper): the
        # chunks they hide are skipped, those they all keep whole run without them
        self.masks = {id(b): m for b in d.boxes if (m := affine_mask(b)) is not None and x in m.axes}
        segs = segments(d, p)
        assert len(bound_refs) // 4 <= len(segs), "the wrapper and the kernel see different segment masks"
        self.lengths = length_masks(d, p)  # length masks: their chunks found here, from their resident n and t
        # the wrapper's four bounds per mask read as ranges, then, where a block map has holes, its chunk lists
        self.list_ref = bound_refs[-1] if len(bound_refs) % 4 else None
        bound_refs = bound_refs[: len(bound_refs) // 4 * 4]
        hidden = set(self.masks) | {id(m.box) for m in (*segs, *self.lengths)}
        super().__init__(d, x, s, ctx, kept=resident, hidden=hidden)
        # a mask on the tiles that zeroes every accumulator's input: hidden tiles run none
        self.zero = zeroing_mask(d, x, p.tiles)
        self.p, self.laid, self.extent, self.padded = p, laid, extent, padded
        self.bound_refs = bound_refs
        self.pages, self.table_ref = pages
        # the table's row loaded once, before the loop: a chunk's page is then arithmetic on registers, not a load
        # inside the loop that the chunk's own load waits on (Triton's pipeliner prefetches no load whose address
        # comes from another load of the same iteration: paged decode ran 0.68× contiguous at B = 1 on an H200)
        self.row = None if self.table_ref is None else self.table_ref[...]

    def blocks(self) -> list:
        p, x, s = self.p, self.x, self.s

        def block_shape(w):
            return tuple(s if a.name == x else p.tiles.get(a.name, self.padded[a.name]) for a in w.axes)

        return [jax.ShapeDtypeStruct(block_shape(w), w.dtype.jnp) for w in self.d.dom.inside]

    def chunk(self, c, walk_chunk) -> None:
        x, s, vals, pm = self.x, self.s, [], self.pages
        for i, (w, v, perm) in enumerate(zip(self.laid, self.kept, self.perms, strict=True)):
            r = self.in_refs[i]
            if i in self.made:  # a length mask's positions: the chunk's key indices
                v = c * s + lax.broadcasted_iota(jnp.int32, (s,), 0)
            elif pm is not None and i in pm.inputs:  # the chunk's pages, named by the table: x first in the block
                v = pm.load(r, self.entries, lambda pool, j, off, n: pool[j, pl.ds(off, n)], c * s, s)
                v = v if perm is None else jnp.transpose(v, perm)
            elif v is None:
                pos = w.names.index(x)
                v = r[tuple(pl.ds(c * s, s) if j == pos else slice(None) for j in range(len(w.axes)))]
                v = v if perm is None else jnp.transpose(v, perm)
            vals.append(v)
        walk_chunk(vals)

    def entries(self, j, m=None):
        """The table row's entry ``j`` (a scalar), or its entries ``j … j + m`` (a vector), picked from the row held
        in registers."""
        width = self.row.shape[-1]
        at = j if m is None else j + lax.broadcasted_iota(jnp.int32, (m, 1), 0)
        hit = lax.broadcasted_iota(jnp.int32, (width,) if m is None else (1, width), 0 if m is None else 1) == at
        return jnp.sum(jnp.where(hit, self.row, 0), axis=-1)

    def fold(self, acc, state, ins, ctx):
        if id(acc.box) in self.pads:
            x, n = self.x, self.extent[self.x]
            ins = [
                mask_padding(v, w, x, ctx.offsets[x], n, pad) if w.has(x) else v
                for v, w, pad in zip(ins, acc.box.dom.inside, self.pads[id(acc.box)], strict=True)
            ]
        return acc.step(state, ins, ctx)

    def count(self):
        n_chunks = self.padded[self.x] // self.s
        return n_chunks if self.zero is None else n_chunks * tile_kept(self.zero, self.p, self.ctx.offsets, self.extent)

    def bounds(self) -> tuple | None:
        if not self.hidden:
            return None
        n_chunks = self.padded[self.x] // self.s
        bounds = _bounds(self.p, self.masks.values(), self.zero, self.ctx, self.extent, n_chunks, self.bound_refs)
        for m in self.lengths:
            t, short = self.kept[m.t], self.short[m.t]  # rows past the array's end (short) widen no range
            valid = _in_bounds(t.shape, self.laid[m.t].names, short, self.ctx.offsets, self.extent) if short else None
            bounds = combine(bounds, length_bounds(self.kept[m.n], t, self.s, n_chunks, valid))
        return bounds

    def lists(self) -> tuple | None:
        return None if self.list_ref is None else (_Listed(self.list_ref, 0), _Listed(self.list_ref, 1))


class _Listed(ChunkList):
    """One of a program's chunk lists (:func:`lowering._blocks.chunk_lists`; 0: those its block map cuts, 1: those
    it keeps whole), read from its ``[2, width]`` block: loaded whole once (for :meth:`below`'s counts), and a
    scalar per chunk visited."""

    def __init__(self, ref, k: int):
        self.ref, self.k = ref, k
        self.row = ref[k, :]

    def at(self, i):
        return self.ref[self.k, i]


def _bounds(p: Plan, masks, zero, ctx: BlockContext, extent: dict, n_chunks: int, bound_refs) -> tuple:
    """The chunks this program visits, ``first ≤ full_lo ≤ full_hi ≤ last``: the affine masks' intervals over its
    block (:func:`lowering._blocks.visited`), with each segment mask's ranges the wrapper found (four scalar refs
    each), none where a mask zeroing every accumulator's input hides the whole tile."""
    x, s = p.stream
    offsets, grid = ctx.offsets, ctx.grid
    ranges = {a: (offsets[a], jnp.minimum(offsets[a] + g, extent[a])) for a, g in p.tiles.items()}
    ranges |= {a: (grid[a], grid[a] + 1) for a in p.batch} | {a: (0, extent[a]) for a in p.whole}
    bounds = visited(masks, x, s, n_chunks, ranges, extent[x])
    for i in range(0, len(bound_refs), 4):
        bounds = combine(bounds, tuple(r[()] for r in bound_refs[i : i + 4]))
    if zero is not None:
        kept = tile_kept(zero, p, offsets, extent)
        bounds = tuple(v * kept for v in bounds)
    return bounds


def _strides(p: Plan, padded: dict) -> dict:
    strides, acc = {}, 1
    for a in reversed(p.batch):
        strides[a] = acc
        acc *= padded[a]
    return strides


def _batch_index(program, a: str, strides: dict, padded: dict):
    """The index along batch axis ``a`` of the flattened batch grid position ``program`` (int32, as Pallas' grid
    ids are: Python ints would become int64 under ``jax_enable_x64`` and ``lax.div`` does not promote)."""
    return lax.rem(lax.div(program, jnp.int32(strides[a])), jnp.int32(padded[a]))
