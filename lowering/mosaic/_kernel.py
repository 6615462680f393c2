"""The Mosaic GPU kernel body (:class:`MosaicKernel`): one producer warpgroup filling the rings by TMA, consumer
warpgroups walking the block diagram on their rows (FlashAttention-3's warp specialisation). Where a block map has
holes, producer and consumers walk the chunks its lists name (:class:`_Walk`), in one order, the ring's."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowering._blocks import BlockContext, CallBlocks, combine, heavy_last, visited
from lowering._loop import ChunkList, ChunkLoop
from lowering._plan import NotLowerable
from lowering.mosaic._arrays import Counting, MosaicArrays, Smem, value_of
from rewrites import walk

if TYPE_CHECKING:
    from lowering.mosaic._lowered import MosaicLowered


class _Scratch(NamedTuple):
    """A kernel's shared memory and barriers (``MosaicLowered._call``'s ``scratch_types``, in order): the rings of the
    streamed inputs, the resident tiles, the outputs' own buffers, each ring's ``loaded`` and ``consumed`` barriers,
    each tile's ``arrived``, the interpret-mode ping-pong ``turn`` (compiled kernels pass a named barrier, which takes
    no shared memory) and the ``staging`` buffer of a register A operand (interpret mode; the fused backward's dS;
    None without them)."""

    rings: Any
    tiles: Any
    outs: Any
    loaded: Any
    consumed: Any
    arrived: Any
    turn: Any
    staging: Any


#: no call-time masks: no bounds, no chunk lists
NO_BLOCKS = CallBlocks(())


class MosaicKernel:
    """The kernel body: a producer warpgroup filling the rings, consumer warpgroups walking the diagram."""

    def __init__(
        self, low: MosaicLowered, sizes, extent, streamed, resident, n_tiles, n_chunks, batch, blocks=NO_BLOCKS,
        pages=None,
    ):  # fmt: skip
        self.low, self.sizes, self.extent = low, sizes, extent
        #: the page map of paged inputs (:class:`lowering._paged.PageMap`; its table the ref after the lists), or None
        self.pages = pages
        self.streamed, self.resident, self.n_tiles, self.n_chunks = streamed, resident, n_tiles, n_chunks
        #: the refs the wrapper passes after the inputs (``blocks``, :class:`lowering._blocks.CallBlocks`): four
        #: bounds per call-time mask read as ranges, then (1) or not (0) the chunk lists of the block maps with holes
        self.n_bounds, self.listed = len(blocks.bounds), int(blocks.listed)
        self.batch = batch
        #: whether the tiles launch last-first: the last tile is the heaviest (causal queries; a block map known
        #: when traced may say so where the affine masks do not)
        self.flip = low.q in heavy_last(low.plan, extent, extent, blocks)
        given = low.config.members
        if given is not None and math.prod(batch) % given:
            raise NotLowerable(
                f"MosaicConfig(members={given}): a launch section's batch elements must divide the batch "
                f"({math.prod(batch)} = {' × '.join(map(str, batch))})"
            )
        self.n_members = self.members() if given is None else given

    def _batch(self, bid) -> dict:
        """Each batch axis's index in the flattened grid position ``bid``."""
        out, acc = {}, 1
        for a, n in zip(reversed(self.low.plan.batch), reversed(self.batch), strict=True):
            out[a] = lax.rem(lax.div(bid, _i32(acc)), _i32(n))
            acc *= n
        return out

    def visited(self, bid, tile, lo, n, bounds=()) -> tuple:
        """The chunks rows ``[lo, lo + n)`` of the split axis visit, ``first ≤ full_lo ≤ full_hi ≤ last``: the masks
        hide every chunk outside ``[first, last)`` and keep ``[full_lo, full_hi)`` whole (``lowering._blocks``'s
        rule, on the same :class:`~napkin_cat.library.Affine` intervals), intersected with the ranges the wrapper
        found for this ``tile`` from the segment ids (``bounds``: one HBM ref per segment mask; a tile's ranges
        hold for any of its rows, so producer and consumers agree on them)."""
        low = self.low
        ranges = {low.q: (lo, lo + n)} | {a: (0, self.extent[a]) for a in low.plan.whole}
        ranges |= {
            a: (lax.axis_index(f"tile_{a}") * g, lax.axis_index(f"tile_{a}") * g + g) for a, g in low.others.items()
        }
        ranges |= {a: (i, i + 1) for a, i in self._batch(bid).items()}
        visit = visited(low.masks.values(), low.x, low.s, self.n_chunks, ranges, self.extent[low.x])
        batch = self._batch(bid)
        for ref in bounds:  # [batch axes the ids have (else 1), tiles, 4]
            at = [batch[a] if n > 1 else _i32(0) for a, n in zip(low.plan.batch, ref.shape, strict=False)]
            visit = combine(visit, tuple(ref[(*at, tile, _i32(k))] for k in range(4)))
        return tuple(v.astype(jnp.int32) for v in visit)

    def _index(self, wire, bid, **blocks):
        """The view of an HBM ref for one block: batch axes fixed, the tiled/streamed axis sliced."""
        idx, batch = [], self._batch(bid)
        for a in wire.axes:
            if a.name in batch:
                idx.append(batch[a.name])
            elif a.name in blocks:
                idx.append(blocks[a.name])
            elif a.name in self.low.others:
                n = self.low.others[a.name]
                idx.append(pl.ds(lax.axis_index(f"tile_{a.name}") * n, n))
            else:
                idx.append(slice(None))
        return tuple(idx)

    def _paged(self, pool, table, wire, bid, chunk) -> list:
        """The TMA copies of chunk ``chunk`` of a paged input (:class:`lowering._paged.PageMap`): ``(view of the
        pool, rows of the ring slot)`` per page the chunk spans (whole pages), or the one page holding it (a window
        of it), the page ids read from this program's row of the table and clamped into the pool (an entry past a
        sequence's pages is read by no visible key)."""
        pm, s, batch = self.pages, self.low.s, self._batch(bid)
        row = tuple(batch[a] for a in pm.batch)
        last = _i32(pool.shape[0] - 1)

        def view(entry, offset, n):
            page = jnp.clip(table[(*row, entry)], _i32(0), last)
            idx = []
            for a in pm.pool_axes(wire):
                idx.append(page if a == "pool" else pl.ds(offset, n) if a == "page" else batch.get(a, slice(None)))
            return pool.at[tuple(idx)]

        p = pm.page_size
        if s > p:  # whole pages: one copy each, into its rows of the slot
            return [(view(chunk * (s // p) + j, 0, p), pl.ds(j * p, p)) for j in range(s // p)]
        start = chunk * s
        return [(view(lax.div(start, _i32(p)), lax.rem(start, _i32(p)), s), None)]

    def members(self) -> int:
        """The batch elements a section of the launch holds (the grid's fastest axis, after the tile): 1, so that
        the CTAs launched together share a batch element and stream the same K and V chunks from L2; where the
        last tile is the heaviest (causal queries) and the tiles launch last-first, the largest divisor of the
        batch whose streamed inputs fit together in the hardware model's L2 share. A section then launches every
        element's tile t before any element's tile t − 1: longest first across the section, which keeps the
        last wave short (FlashAttention-3's LPT scheduler, with its L2 sections), its K and V still in L2.

        On an H100 (a 25 MiB share), causal attention in bf16 at N = 8192, D = 128 streams 4 MiB of K and V per
        head, so 6 heads fit and B·H = 32 launch in 8 sections of 4; at N = 2048 1 MiB, and 128 in 8 of 16.
        """
        low, wires = self.low, self.low.plan.diagram.dom.inside
        if not self.flip:
            return 1
        each = sum(
            math.prod(self.extent[a.name] for a in wires[i].axes if a.name not in low.plan.batch)
            * wires[i].dtype.jnp.dtype.itemsize
            for i in self.streamed
        )
        return _divisor_at_most(math.prod(self.batch), low.hardware.l2_shared_capacity // max(each, 1))

    def __call__(self, *refs):
        low, c = self.low, self.low.config
        full = low.plan.diagram
        n_dom = len(full.dom) - len(low.made)  # the inputs passed: the made ones are not
        n_table = int(self.pages is not None)
        n_in = n_dom + self.n_bounds + self.listed + n_table + len(low.summed)
        n_out = len(full.cod) - len(low.summed)
        in_refs, out_refs, scratch = refs[:n_in], refs[n_in : n_in + n_out], refs[n_in + n_out :]
        # the summed outputs (dQ) come in as zeroed refs after the inputs: in the outputs' order again
        in_refs, summed = in_refs[: n_in - len(low.summed)], iter(in_refs[n_in - len(low.summed) :])
        table = in_refs[-1] if n_table else None  # the page table, after the bounds and lists
        in_refs = in_refs[: len(in_refs) - n_table]
        stored = iter(out_refs)
        out_refs = [next(summed) if k in low.summed else next(stored) for k in range(len(full.cod))]
        lists = in_refs[-1] if self.listed else None
        in_refs, bounds = in_refs[:n_dom], in_refs[n_dom : n_dom + self.n_bounds]
        passed = iter(in_refs)
        in_refs = [None if i in low.made else next(passed) for i in range(len(full.dom))]  # by the diagram's inputs
        turn, staging = (scratch[6] or [None])[0], (scratch[7] if len(scratch) > 7 else [None])[0]
        scratch = _Scratch(*scratch[:6], turn, staging)
        wg, tile = lax.axis_index("wg"), lax.axis_index("tile")
        bid = lax.axis_index("section") * self.n_members + lax.axis_index("member")
        if self.flip:  # the heaviest tiles launch first
            tile = self.n_tiles - 1 - tile
        g = low.plan.tiles[low.q]
        # the chunks [first, chunks) this block streams: those some row of its tile sees
        first, chunks = _i32(0), _i32(self.n_chunks)
        span = (first, first, chunks, chunks)
        if low.hidden:
            first, _, _, chunks = span = self.visited(bid, tile, tile * g, g, bounds)
        if not self.streamed:  # no loop (the backward's Δ): the producer has nothing to fill
            chunks = _i32(0)
        # a block map with holes: the chunks its lists name in the tile's range, one walk for every warpgroup
        walk = _Walk.of(lists, self._batch(bid), low.plan.batch, tile, span) if self.listed else None
        consumer_regs, producer_regs = c.registers()

        @pl.when(wg < c.consumers)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")
            self.consume(in_refs, out_refs, scratch, wg, bid, tile, (first, chunks), bounds, walk)

        @pl.when(wg == c.consumers)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            if not self.streamed:
                return
            ring = (scratch.rings, scratch.loaded, scratch.consumed)
            if walk is None:
                self.produce(in_refs, *ring, bid, tile, first, chunks, table=table)
            else:  # the ring takes the listed chunks in turn: step t in slot t mod stages
                self.produce(in_refs, *ring, bid, tile, _i32(0), walk.steps, walk.chunk, table)

    def produce(self, in_refs, rings, loaded, consumed, bid, tile, first, chunks, chunk_of=None, table=None):
        """The producer: steps ``[first, chunks)`` loaded by TMA into ring slot ``step mod stages``, each slot's
        previous load released by every consumer first; step ``t`` loads chunk ``chunk_of(t)`` (default ``t``); a
        paged input's chunk from the pages ``table`` names (:meth:`_paged`)."""
        low, hbm, stages, s = self.low, self.low.plan.diagram.dom.inside, self.low.config.stages, self.low.s
        chunk_of = chunk_of or (lambda t: t)
        g = low.plan.tiles[low.q]

        def load(step, slot):
            chunk = chunk_of(step)
            for k, i in enumerate(self.streamed):
                if self.pages is not None and i in self.pages.inputs:
                    for view, at in self._paged(in_refs[i], table, hbm[i], bid, chunk):
                        dst = rings[k].at[slot] if at is None else rings[k].at[slot].at[at]
                        plgpu.copy_gmem_to_smem(view, dst, loaded[k].at[slot])
                    continue
                blocks = {low.x: pl.ds(chunk * s, s), low.q: pl.ds(tile * g, g)}
                view = in_refs[i].at[self._index(hbm[i], bid, **blocks)]
                plgpu.copy_gmem_to_smem(view, rings[k].at[slot], loaded[k].at[slot])

        for j in range(min(stages, self.n_chunks)):  # a slice past the axis would not even trace

            @pl.when(first + j < chunks)
            def _(j=j):
                load(first + j, lax.rem(first + j, _i32(stages)))

        @pl.loop(first + stages, jnp.maximum(chunks, first + stages))
        def _(chunk):
            slot = lax.rem(chunk, _i32(stages))
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[slot])
            load(chunk, slot)

        @pl.loop(jnp.maximum(chunks - stages, first), chunks)
        def _(chunk):  # the last releases: every phase of a barrier is observed before it is freed
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[lax.rem(chunk, _i32(stages))])

    def consume(self, in_refs, out_refs, scratch: _Scratch, wg, bid, tile, block, bounds, walk=None):
        """A consumer warpgroup: its rows of the resident inputs loaded (:meth:`_prologue`), the streamed loop over
        the chunks the producer fills (:class:`_Consumer`; the tile's :class:`_Walk` where a block map has holes),
        its results stored (:meth:`store`)."""
        low = self.low
        start = tile * low.plan.tiles[low.q] + wg * low.rows
        started = self._prologue(in_refs, scratch.tiles, scratch.arrived, scratch.turn, scratch.staging, wg, bid, start)
        visit = (lambda: walk.span) if walk is not None else (lambda: self.visited(bid, tile, start, low.rows, bounds))
        loop = _Consumer(self, scratch, started, wg, start, block, visit, walk, (out_refs, bid))
        self.store(loop.run(), out_refs, scratch.outs, scratch.tiles, wg, bid, start)

    def _prologue(self, in_refs, tiles, arrived, turn, staging, wg, bid, start) -> tuple:
        """A consumer's start: its rows of the resident inputs copied in by TMA, its namespaces (the ping-pong turn
        a named barrier when compiled), its grid indices and context, the scalars read, the copies waited on."""
        low, rows = self.low, self.low.rows
        for k, i in enumerate(self.resident):
            view = in_refs[i].at[self._index(low.plan.diagram.dom.inside[i], bid, **{low.q: pl.ds(start, rows)})]
            plgpu.copy_gmem_to_smem(view, tiles[k].at[wg], arrived[k].at[wg])
        in_place, every = not low.config.interpretable, low.staged
        xp = MosaicArrays(staging.at[wg] if staging is not None else None, in_place=in_place, every=every)
        if low.pingpong and not low.interpret:
            turn = _named_turn(low.config.consumers)
        pingpong = MosaicArrays(xp.staging, turn, in_place, every)
        grid = self._batch(bid)  # this program's index along each batch axis (ALiBi reads the head)
        ctx = BlockContext(sizes=self.sizes, offsets={low.q: start}, xp=xp, grid=grid)
        resident = {i: Smem(tiles[k].at[wg], arrived[k].at[wg]).along(0) for k, i in enumerate(self.resident)}
        full, wires = low.plan.diagram.dom.inside, low.d.dom.inside
        scalars = {i: in_refs[i][self._index(full[i], bid)] for i, w in enumerate(wires) if low._role(w) == "scalar"}
        for v in resident.values():
            v.ready()  # waited once, before the loop
        return turn, pingpong, grid, ctx, resident, scalars

    def store(self, results, out_refs, outs, tiles, wg, bid, start):
        """Each result through shared memory to HBM: its own buffer, or the dead tile of a resident input."""
        low, rows = self.low, self.low.rows
        # every result in registers before any store: an output may overwrite a resident input's tile
        results = [value_of(v) for v in results]
        stored = set(low.shared[k] for k in low.summed)  # a summed output's buffer was last stored from in the loop
        for k, (i, j, v, w, out) in enumerate(
            zip(low.reuse, low.shared, results, low.plan.diagram.cod.inside, out_refs, strict=True)
        ):
            if k in low.summed:  # added into chunk by chunk (:meth:`add`)
                continue
            buf = outs[j] if i is None else tiles[self.resident.index(i)]
            if j is not None and j in stored:  # the buffer's previous output has left for HBM before it is overwritten
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            stored.add(j)
            buf.at[wg][...] = v.astype(buf.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf.at[wg], out.at[self._index(w, bid, **{low.q: pl.ds(start, rows)})])
        plgpu.wait_smem_to_gmem(0)

    def add(self, k: int, v, out, buf, wg, bid, chunk) -> None:
        """A chunk's partial sum of a summed output (dQ's over this consumer's keys) added into its slice of ``out``:
        through ``buf`` (this consumer's, its previous chunk's store waited on) by a TMA reduce-add. Interpreted (whose
        TMA has no reduction) read, added and written into this consumer's own copy (``MosaicLowered._zeros``)."""
        low = self.low
        at = self._index(low.plan.diagram.cod.inside[k], bid, **{low.x: pl.ds(chunk * low.s, low.s)})
        v = value_of(v).astype(jnp.float32)
        if low.interpret:
            dst = out.at[wg].at[at]
            dst[...] = dst[...] + v
            return
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        buf[...] = v
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(buf, out.at[at], reduction_op="add")


class _Consumer(ChunkLoop):
    """A consumer warpgroup's streamed loop (:class:`lowering._loop.ChunkLoop`): each chunk its rows of the ring
    slots, waited on (``loaded``) as they are read and released (``consumed``) after; the chunks of the block
    (``block``: the producer's ``[first, chunks)``) its own rows do not visit observed and released all the same;
    the ping-pong turns of two consumers offset by one; an error while walking names the box."""

    def __init__(
        self, kernel: MosaicKernel, scratch: _Scratch, started: tuple, wg, start, block, visited, walk=None, outs=None
    ):
        #: the output refs and the program's batch position, where summed outputs are added into chunk by chunk
        self.outs = outs
        self.turn, self.pingpong, grid, ctx, self.resident, self.scalars = started
        low, self.kernel, self.scratch, self.wg, self.visit = kernel.low, kernel, scratch, wg, visited
        #: the tile's walk of its lists (a block map with holes), and the ring slot of the listed chunk being walked
        self.tour, self.slot = walk, None
        x = low.x or ""
        final = [
            None if w.has(x) else self.resident.get(i, self.scalars.get(i)) for i, w in enumerate(low.d.dom.inside)
        ]
        super().__init__(low.d, x, low.s, ctx, kept=final, hidden=low.hidden)
        self.chunk_ctx = BlockContext(kernel.sizes, {low.q: start}, self.pingpong, grid)
        self.span, self.grid, self.counting, self.box = block, grid, Counting(), None

    def blocks(self) -> list | None:
        """One chunk's blocks as a consumer sees them (the probe also counts the wgmma a chunk issues)."""
        if not self.kernel.streamed:  # no loop (the backward's Δ)
            return None
        return [
            jax.ShapeDtypeStruct(self.kernel.low.block(w, self.kernel.extent), w.dtype.jnp) for w in self.d.dom.inside
        ]

    def probe_ctx(self) -> BlockContext:
        return BlockContext(self.kernel.sizes, {}, self.counting, {a: jnp.int32(0) for a in self.grid})

    def count(self):
        return self.span[1] if self.kernel.streamed else None

    def bounds(self) -> tuple | None:
        return self.visit() if self.kernel.low.hidden else None

    def lists(self) -> tuple | None:
        return None if self.tour is None else (self.tour.cut, self.tour.whole)

    def listed(self, chunks: ChunkList, lo, hi, body, carry):
        """The listed chunks in ``[lo, hi)``, each in the ring slot of its step in the tile's walk (:class:`_Walk`:
        the cut chunks, then the whole ones), where the producer loaded it."""
        stages, origin = self.kernel.low.config.stages, self.tour.origin(chunks)

        def step(i, carry):
            self.slot = lax.rem(origin + i, _i32(stages))
            return body(chunks.at(i), carry)

        return self.loop(chunks.below(lo), chunks.below(hi), step, carry)

    def chunk(self, c, walk_chunk) -> None:
        low, wires, rows, wg = self.kernel.low, self.d.dom.inside, self.kernel.low.rows, self.wg
        rings, loaded, consumed = self.scratch.rings, self.scratch.loaded, self.scratch.consumed

        def rows_of(i, ref):  # a consumer's rows of a ring buffer that holds the whole tile
            names = wires[i].names
            if low.q not in names:
                return ref
            return ref.at[tuple(pl.ds(wg * rows, rows) if n == low.q else slice(None) for n in names)]

        slot = lax.rem(c, _i32(low.config.stages)) if self.tour is None else self.slot
        streamed = self.kernel.streamed
        ring = {i: Smem(rows_of(i, rings[k].at[slot]), loaded[k].at[slot]).along(1) for k, i in enumerate(streamed)}
        ring |= {i: _positions(c, low.s) for i in low.made}
        self.pingpong.issued = 0
        walked = walk_chunk([ring.get(i, self.resident.get(i, self.scalars.get(i))) for i in range(len(wires))])
        for k in low.summed:  # its product issued here: counted among the chunk's wgmma; the chunk's partial added
            out_refs, bid = self.outs
            buf = self.scratch.outs[low.shared[k]].at[wg]
            self.kernel.add(k, walked[k], out_refs[k], buf, wg, bid, c)
        if self.pingpong.issued != self.counting.wgmma:  # the turns an observed chunk takes would not match
            raise NotLowerable(
                f"a chunk issued {self.pingpong.issued} wgmma, the shape probe counted {self.counting.wgmma}"
            )
        for k, i in enumerate(streamed):
            ring[i].ready()  # an input no box read still completes its phase
            plgpu.barrier_arrive(consumed[k].at[slot])

    def carried(self, v):
        return value_of(v)

    def walk(self, *args, skip, **kw) -> list:
        def watched(box):
            self.box = box
            return skip(box)

        try:
            return walk(*args, skip=watched, **kw)
        except (NotLowerable, NotImplementedError, ValueError, TypeError) as e:
            raise NotLowerable(f"box {getattr(self.box, 'name', self.box)!r}: {e}") from e

    def skipped(self, lo, hi) -> None:
        """Chunks ``[lo, hi)`` only the other consumers read: observe their arrival and release them, taking the
        turns the other warpgroup's ping-pong passes meanwhile."""
        stages, consumed, loaded = self.kernel.low.config.stages, self.scratch.consumed, self.scratch.loaded

        @pl.loop(lo, hi)
        def _(chunk):
            slot = lax.rem(chunk, _i32(stages))
            for k in range(len(self.kernel.streamed)):
                plgpu.barrier_wait(loaded[k].at[slot])
                plgpu.barrier_arrive(consumed[k].at[slot])
            for _ in range(self.counting.wgmma):  # the turns the other warpgroup takes meanwhile
                self.pingpong.schedule()

    def begin(self) -> None:
        if self.turn is not None:  # the second warpgroup starts one turn behind

            @pl.when(self.wg == 1)
            def _():
                self.pingpong.schedule()

    def end(self) -> None:
        if self.turn is not None:  # and the first one ends one turn later

            @pl.when(self.wg == 0)
            def _():
                self.pingpong.schedule()


class _Listed(ChunkList):
    """One of a tile's chunk lists (:func:`lowering._blocks.chunk_lists`; ``k`` 0: the chunks its block map cuts,
    1: those it keeps whole) in HBM, read a scalar at a time: the chunk at a position, and how many lie below a chunk
    by a binary search of the sorted, padded list (log₂ width + 1 loads)."""

    def __init__(self, ref, index: tuple, k: int):
        self.ref, self.index, self.width = ref, (*index, _i32(k)), ref.shape[-1]

    def at(self, i):
        return self.ref[(*self.index, i)]

    def below(self, c):
        pos, step = _i32(0), self.width // 2
        while step:  # the sorted list's first `pos` entries are below c
            pos = jnp.where(self.at(pos + step - 1) < c, pos + step, pos)
            step //= 2
        return pos + (self.at(pos) < c).astype(jnp.int32)


class _Walk(NamedTuple):
    """The chunks a tile visits where a block map has holes, in the order its ring takes them: those of its cut list
    in ``span`` (``first ≤ full_lo ≤ full_hi ≤ last``, the tile's range from its other masks), then those of its
    whole list there. Producer and every consumer walk it alike, so step ``t`` is in ring slot ``t mod stages``
    for all; a consumer runs a cut chunk masked and a whole one unmasked in ``[full_lo, full_hi)``."""

    cut: _Listed
    whole: _Listed
    span: tuple
    #: the listed chunks in the span: cut, and all; the steps of the lists' positions 0
    n_cut: Any
    steps: Any
    origins: tuple

    @classmethod
    def of(cls, ref, batch: dict, axes: tuple, tile, span: tuple) -> _Walk:
        """The walk of ``tile`` (at ``batch``, its index along each grid axis ``axes``) of the lists ``ref``
        (``[batch axes the map reads (else 1), tiles, 2, width]``)."""
        at = [batch[a] if n > 1 else _i32(0) for a, n in zip(axes, ref.shape, strict=False)]
        cut, whole = (_Listed(ref, (*at, tile), k) for k in (0, 1))
        first, last = span[0], span[3]
        cut_first, whole_first = cut.below(first), whole.below(first)
        n_cut = cut.below(last) - cut_first
        steps = n_cut + whole.below(last) - whole_first
        return cls(cut, whole, span, n_cut, steps, (-cut_first, n_cut - whole_first))

    def origin(self, chunks: _Listed):
        """The step of position 0 of ``chunks`` (its positions in the span are consecutive steps)."""
        return self.origins[chunks is self.whole]

    def chunk(self, t):
        """The chunk of step ``t`` (in ``[0, steps)``)."""
        last = self.cut.width - 1
        in_cut = self.cut.at(jnp.minimum(t - self.origin(self.cut), last))
        in_whole = self.whole.at(jnp.clip(t - self.origin(self.whole), 0, last))
        return jnp.where(t < self.n_cut, in_cut, in_whole)


def _positions(c, s: int):
    """Chunk ``c``'s key positions ``c·s … c·s + s − 1`` along the stream, made in registers in the layout of a
    block's columns, in f32 (as :class:`~lowering.mosaic._arrays.Smem` reads integers: Mosaic GPU lays out f32
    arithmetic on a vector where its int32 arithmetic found no layout, docs/decode.md)."""
    iota = plgpu.broadcasted_iota(jnp.int32, (s,), 0, layout=plgpu.Layout.WGMMA.reduce(0))
    return iota.astype(jnp.float32) + (c * s).astype(jnp.float32)


#: the hardware named barrier the consumer warpgroups pass their ping-pong turns through (Mosaic GPU uses the
#: lower ones; tokamax's kernels start at 4)
TURN_BARRIER = 8


def _named_turn(consumers: int):
    """A ping-pong turn of the compiled kernel: ``bar.sync`` on a named barrier of every consumer thread, as tokamax's
    Mosaic GPU attention passes its turns. Against an mbarrier in shared memory (arrive, then poll its phase) the
    causal forward at D = 128, N = 8192 ran 582 → 662 TFLOP/s at g128 s128 and 468 → 514 at g256 s64 (H200, bf16,
    docs/mosaic.md v8). Inline PTX does not interpret: interpret mode keeps the mbarrier."""
    from jax.experimental.mosaic import gpu as mgpu

    @plgpu.inline_mgpu()
    def turn(_):
        mgpu.utils.inline_ptx(f"bar.sync {TURN_BARRIER}, {128 * consumers};")

    return turn


def _divisor_at_most(n: int, bound: int) -> int:
    """The largest divisor of ``n`` that is at most ``bound`` (1 at least).

    >>> _divisor_at_most(32, 25 // 4), _divisor_at_most(128, 25 // 1), _divisor_at_most(7, 0)
    (4, 16, 1)
    """
    return max(m for m in range(1, max(1, min(n, bound)) + 1) if n % m == 0)


def _i32(n):
    return jnp.asarray(n, jnp.int32)
