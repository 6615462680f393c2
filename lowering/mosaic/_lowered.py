"""The Mosaic GPU backend (Hopper): a scheduled diagram becomes one warp-specialised ``plgpu.kernel``.

FAN's Hopper algorithm, read from the plan: the tiled axis is split over ``consumers`` warpgroups (a
group partition one level below the thread block, ``g/consumers`` rows each, a multiple of wgmma's 64:
the diagram's label ``q/g÷w`` from ``rewrites.split(q, w)``, else 2, or 1 for a tile of 64 rows);
the streamed axis becomes a ring of ``stages`` shared-memory buffers per streamed input, filled by TMA
from one producer warpgroup and released through ``consumed`` barriers; contractions become ``wgmma``
(A from shared memory or registers, B from shared memory) whose accumulators, like the accumulators'
states, live in registers across the loop. The loop body is the diagram itself: the generators'
``evaluate`` and accumulators run on register arrays through the namespace :class:`MosaicArrays`
(``ctx.xp``), exactly as in the reference semantics. log₂e is folded into the score scale so the
online softmax uses ``exp2``; a causal mask splits the loop into unmasked and diagonal chunks and the
chunks above the diagonal are never loaded. An output summed over the tiled axis (``backward="fused"``'s dQ,
FlashAttention-3's five products) is each chunk's product, dQ = dSᵀ·K with dS written to shared memory and read back
transposed, added into a zeroed f32 output by a TMA reduce-add.

Anything this cannot express raises :class:`NotLowerable` naming the box or axis, before compiling.

>>> import napkin_cat as nc
>>> from rewrites import derive, split, tile, stream
>>> from lowering import plan
>>> b, h, q, x, d = nc.axes("b h q x d", d=64)
>>> attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=True)
>>> k = MosaicLowered(plan(derive(attn, tile(q, 128), stream(x, 64), verify=False).diagram))
>>> k.rows, k.config.consumers, k.plan.stream
(64, 2, ('x', 64))
>>> k = MosaicLowered(plan(derive(attn, tile(q, 256), split(q, 1), stream(x, 64), verify=False).diagram))
>>> k.rows, k.config.consumers, k.pingpong
(256, 1, False)
"""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowering._blocks import BlockContext, Mapped, affine_mask, call_blocks, made_positions, segments, tiled_first
from lowering._plan import NotLowerable, Plan, base2, unweave
from lowering._sparsity import Sparsity, described, sparsity
from lowering._spmd import out_structs, varying_like
from lowering._target import check_interpreter_pool, interpreted
from lowering.mosaic._arrays import Counting, interleave_keys
from lowering.mosaic._config import REGISTERS, SMEM_ALIGNMENT, SMEM_LIMIT, WGMMA_M, MosaicConfig, wgmma_takes
from lowering.mosaic._kernel import MosaicKernel
from napkin_cat.diagram import Diagram, is_structural
from napkin_cat.dtypes import FP8
from napkin_cat.hardware import H100
from napkin_cat.semantics import bind


def _swizzle(minor: int, itemsize: int) -> tuple:
    row = minor * itemsize
    swizzle = next((s for s in (128, 64, 32) if row % s == 0), None)
    if swizzle is None:
        return ()
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


class MosaicLowered:
    """A Mosaic GPU kernel for a scheduled diagram: call it with arrays in the diagram's axis order.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d", d=64)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> k = MosaicLowered(plan(derive(attn, tile(q, 128), stream(x, 64), verify=False).diagram), interpret=False)
    >>> k.q, k.x, k.s, k.rows, k.pingpong
    ('q', 'x', 64, 64, True)
    """

    #: what ``lower``'s ``kernel.backends`` reports; the hardware model the budgets come from
    backend, hardware = "mosaic", H100

    def __init__(self, p: Plan, *, interpret: bool | None = None, config: MosaicConfig | None = None):
        self.plan = p
        self.interpret = interpreted(interpret)
        # interpret mode runs only the interpretable path: every config takes it there, not only the default
        config = config or MosaicConfig()
        self.config = replace(config, interpretable=config.interpretable or self.interpret)
        self.__name__ = "napkin_mosaic_kernel"
        if not p.tiles:
            raise NotLowerable(
                "Mosaic backend: tiled axes (the first output's first one split over consumer warpgroups) and at "
                f"most one streamed axis, got tiles {p.tiles} and stream {p.stream}"
            )
        #: the streamed axis and its chunk (None, None for a kernel without a loop: the backward's Δ)
        self.x, self.s = p.stream or (None, None)
        first = unweave(p.diagram, p.batch).cod.inside[0].names[0]
        self.q = first if first in p.tiles else next(iter(p.tiles))
        g = p.tiles[self.q]
        #: the other tiled axes: grid dimensions whose blocks every warpgroup shares
        self.others = {a: n for a, n in p.tiles.items() if a != self.q}
        self.config = replace(self.config, consumers=_consumers(p.diagram, self.q, self.config.consumers, g))
        c = self.config.consumers
        if g % (c * WGMMA_M):
            raise NotLowerable(
                f"axis {self.q!r}: the tile g = {g} splits over {c} consumer warpgroups into rows that must be "
                f"multiples of wgmma's {WGMMA_M}"
            )
        self.rows = g // c
        if p.stream is not None and self.s % WGMMA_M:
            raise NotLowerable(f"axis {self.x!r}: the stream size s = {self.s} must be a multiple of {WGMMA_M}")
        consumer_regs, producer_regs = self.config.registers()
        if 128 * (c * consumer_regs + producer_regs) > REGISTERS:
            raise NotLowerable(
                f"warpgroup level: {c} consumers × {self.config.consumer_registers} registers plus a producer "
                f"× {self.config.producer_registers} exceed the SM's {REGISTERS} registers"
            )
        # blocks holding both loop axes laid out tiled axis first: the kept block is wgmma's A operand (Sᵀ = K·Qᵀ)
        self.d = tiled_first(base2(unweave(p.diagram, p.batch)), p)
        #: the key positions a valid-keys mask reads (an ``arange`` along the stream): made by each consumer per
        #: chunk, never copied in (no ring, no TMA; a decode step's 128-key chunks fit shared memory for it)
        self.made = made_positions(self.d, p)
        #: the affine masks reading the streamed axis (causal, sliding window, prefix; a mask's backward ``Kept``),
        #: by box: the chunks they hide are never loaded, those they keep whole run without them (block sparsity)
        self.masks = {id(b): m for b in self.d.boxes if (m := affine_mask(b)) is not None and self.x in m.axes}
        #: the segment masks over the split axis and the streamed one (documents): the wrapper finds from the ids
        #: which chunks each tile visits and keeps whole (``lowering._blocks.segment_blocks``), as Triton's does
        self.segments = tuple(m for m in segments(self.d, p) if m.axis == self.q)
        #: the boxes a chunk kept whole by every mask runs without
        self.hidden = set(self.masks) | {id(m.box) for m in self.segments}
        #: the outputs summed over the tiled axis (FlashAttention-3's dQ), by position: each chunk's partial, a
        #: [streamed axis, whole] block in f32, added into the zeroed output by a TMA reduce-add
        self.summed = tuple(sorted(p.summed))
        self._check_wires()
        #: whether a register A operand (P) goes through shared memory: in interpret mode (which runs no wgmma
        #: from registers)
        self.staged = self.config.interpretable
        #: the streamed FP8 inputs P meets in registers, by position: laid out with the streamed axis innermost
        #: (FP8's V, ``[e, x]``, contracted over it), their keys interleaved by the wrapper as P's are in registers
        #: (``_arrays.interleave_keys``); compiled only. An FP8 K (``[x, d]``) with a 16-bit V (FAN's mixed
        #: algorithm) meets P in 16 bits
        self.interleaved = () if self.staged else self._fp8_values()
        #: whether the kernel holds a staging buffer: where P is staged, and where a summed output's product reads a
        #: register operand transposed (dQ = dSᵀ·K, dS held as [keys, queries]: written to shared memory, read back
        #: transposed, FlashAttention-3's dS in shared memory)
        self.staging = self.staged or bool(self.summed)
        self._buffers()
        #: the wgmmas one chunk issues, counted on abstract blocks
        self.products = self._products() if p.stream is not None else 0
        want = self.config.pingpong
        self.pingpong = c == 2 and p.stream is not None and (self._pingpong() if want is None else want)

    def _check_wires(self) -> None:
        """Refuse wires the kernel cannot hold: an input that is no 2-D block of the tiled or streamed axis and a
        whole one, vector or scalar, or a 2-D block neither in 16 bits nor FP8; an innermost grid axis (TMA copies
        contiguous rows); an output that is no [split axis, whole or tiled] block."""
        for w in self.d.dom.inside:
            role = self._role(w)
            if role is None:
                raise NotLowerable(
                    f"input {w.describe()}: a block must be 2-D (the tiled or streamed axis, and one whole axis), "
                    f"a vector along the tiled or streamed axis, or one number per program (a scalar)"
                )
            if len(w.axes) == 2 and not wgmma_takes(w.dtype):
                raise NotLowerable(
                    f"input {w.describe()}: wgmma takes 16-bit operands (or FP8: e4m3, e5m2), got {w.dtype}"
                )
        batch, full = set(self.plan.batch), self.plan.diagram
        for what, wires in (("input", full.dom.inside), ("output", full.cod.inside)):
            for w in wires:
                if w.names[-1] in batch and not set(w.names) <= batch:  # e.g. a group sum kept innermost
                    raise NotLowerable(
                        f"{what} {w.describe()}: its innermost axis {w.names[-1]!r} is a grid (batch) axis; TMA copies "
                        "blocks whose innermost axis is contiguous"
                    )
        for k, w in enumerate(self.d.cod.inside):
            if k in self.summed:
                self._check_summed(k, w)
            elif self._role(w) != "tile" or w.names[0] != self.q:
                raise NotLowerable(
                    f"output {w.describe()}: the Mosaic backend stores [{self.q}, whole or tiled] blocks"
                )

    def _check_summed(self, k: int, w) -> None:
        """Refuse a summed output the kernel cannot add into: one summed over another axis than the split one, or no
        f32 [streamed axis, whole] block written per chunk."""
        axes = self.plan.summed[k]
        if tuple(axes) != (self.q,) or k not in self.plan.written:
            raise NotLowerable(
                f"output {k} ({w.describe()}): summed over {list(axes)}, written per chunk: {k in self.plan.written}; "
                f"the Mosaic backend adds the partial sums of the split axis {self.q!r} only, into an output written "
                "per chunk of the streamed one"
            )
        if len(w.names) != 2 or w.names[0] != self.x or w.names[1] not in self.plan.whole or w.dtype.bits != 32:
            raise NotLowerable(
                f"output {k} ({w.describe()}): a summed output is added by TMA as an f32 [{self.x}, whole] block"
            )

    def _buffers(self) -> None:
        """Where each output is stored from: a dead resident input tile of its block (``reuse``), else a buffer of
        its own, shared by outputs of one block shape (``own``, ``shared``)."""
        #: per output, the resident input whose shared-memory tile it is written into (the tile is dead by
        #: then: FA3 stores O through Q's buffer), else None
        self.reuse: list[int | None] = []
        free = [i for i, w in enumerate(self.d.dom.inside) if self._role(w) == "tile"]
        for w in self.d.cod.inside:
            k = next((k for k, i in enumerate(free) if i is not None and _same_block(self.d.dom.inside[i], w)), None)
            self.reuse.append(None if k is None else free[k])
            if k is not None:
                free[k] = None
        #: the shared-memory buffers of the other outputs, one per block shape and dtype (outputs sharing one
        #: are stored one after another: dK and dV in f32 would not fit side by side at D = 128), and each
        #: output's buffer among them (None where it reuses an input's tile)
        self.own: list = []
        self.shared: list[int | None] = []
        for w, i in zip(self.d.cod.inside, self.reuse, strict=True):
            j = next((j for j, v in enumerate(self.own) if _same_block(v, w)), None) if i is None else None
            if i is None and j is None:
                self.own.append(w)
                j = len(self.own) - 1
            self.shared.append(j)

    def unmeasured(self) -> str | None:
        """An input unlike those Mosaic was compiled, checked and timed on (attention's Q, K, V, dO and O: blocks
        holding an axis kept whole; the backward's L and Δ: f32 vectors along the tiled or streamed axis; segment
        ids: integer vectors along them; a sink's logit: an f32 scalar per program; since stop 57 any vector of
        any kind, a bf16 bias or a bool padding mask among them), named, else None: 2-D bias and mask arrays.
        ``backend="auto"`` keeps such a kernel on Triton. Measured in v7 (H100, bf16, B = 2, H = 16, N = 8192, D = 128):
        segment ids (8 packed documents, ``document_skipping.py``) forward 1.35× Triton's, 1.32× with causal, forward +
        backward 1.27× and 1.24×; sinks (causal, ``variants.py``) forward 1.31×, forward + backward 1.13×. A bf16 bias
        ``[B, 1, 1, N]`` or ``[1, H, 1, N]`` and a bool mask ``[B, 1, 1, N]`` (H200, stop 57,
        ``probes/vector_bias.py``): forward 1.29–1.44×, forward + backward 1.20–1.52×.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> b, q, x, d = nc.axes("b q x d", d=64)
        >>> kw = dict(dtype="bf16", batch=(b,), bias_batch=(b,), bias_dtype="bf16")
        >>> biased = nc.library.dot_product_attention(q, x, d, **kw)
        >>> MosaicLowered(plan(derive(biased, tile(q, 128), stream(x, 64), verify=False).diagram)).unmeasured()
        'input 3 (b×q/128×x~64:bf16@HBM)'
        """
        for i, w in enumerate(self.plan.diagram.dom.inside):
            names = set(w.names)
            # a vector of any dtype (16-bit floats and bools held in f32: :meth:`held`)
            vector = len(names - set(self.plan.batch)) == 1
            scalar = w.dtype.jnp == jnp.float32 and names <= set(self.plan.batch)
            if not (names & set(self.plan.whole) or (vector and names & {self.q, self.x}) or scalar):
                return f"input {i} ({w.describe()})"
        return None

    def _pingpong(self) -> bool:
        """Ping-pong by default where it was measured faster (H100, bf16, N = 8192): a chunk of two wgmmas (FA3's
        forward: +12% at D = 128), or of three whose axes kept whole are 64 (the backward's dQ at D = 64: 1.10×,
        at D = 128 0.93–1.01×, ``backward_configs.py --mosaic``, docs/mosaic.md v6). Four (dK·dV) lose 2–12%."""
        whole = self.whole().values()
        narrow = bool(whole) and all(n.is_number and int(n) == 64 for n in whole)
        return self.products == 2 or (self.products == 3 and narrow)

    def whole(self) -> dict:
        """The sizes of the axes kept whole (symbols where the diagram leaves them open), by name."""
        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        return {a: size[a] for a in self.plan.whole}

    def _products(self) -> int:
        """The contractions a chunk issues as wgmma: the diagram walked once on abstract blocks (whole axes of
        unknown size stand at 64, which no count depends on)."""
        from rewrites import walk

        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        extent = {a: int(n) if n.is_number else 64 for a, n in size.items()}
        sizes = {n: 64 for n in size.values() if not n.is_number}
        counting = Counting()

        def probe(*vals):
            fold = lambda acc, st, ins, cc: acc.partial(ins, cc)  # noqa: E731
            grid = {a: jnp.int32(0) for a in self.plan.batch}  # the batch indices an index function may read
            walk(self.d, list(vals), BlockContext(sizes, {}, counting, grid), self.x, "chunk", {}, fold=fold)

        blocks = (jax.ShapeDtypeStruct(self.block(w, extent), w.dtype.jnp) for w in self.d.dom.inside)
        jax.eval_shape(probe, *blocks)
        return counting.wgmma

    @property
    def source(self) -> str:
        """The kernel's launch, described: grid, warpgroups, ring and the diagram the consumers walk.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64),
        ...                                verify=False).diagram))
        >>> print(k.source.splitlines()[0])  # doctest: +ELLIPSIS
        plgpu.kernel grid (sections, q/128, members) × 3 warpgroups: 2 consumers of 64 q-rows each (wgmma), 1 TMA ...
        """
        c, p = self.config, self.plan
        outs = list(zip(self.d.cod.inside, self.shared, strict=True))
        return "\n".join(
            [
                f"plgpu.kernel grid (sections, {', '.join(f'{a}/{n}' for a, n in reversed(p.tiles.items()))}, "
                f"members) × {c.consumers + 1} warpgroups: {c.consumers} consumers of {self.rows} {self.q}-rows "
                "each (wgmma), 1 TMA producer",
                f"ring: {c.stages} stages of {self.x}~{self.s} chunks per streamed input; ping-pong: {self.pingpong}"
                if self.x
                else "no loop: every input a resident tile",
                f"consumers walk: {' ; '.join(b.name for b in self.d.boxes)}",
                *(
                    f"P meets {self.d.dom.inside[i].describe()} in FP8 from registers, read as wgmma's 8-bit operand "
                    "as it lies; that input's keys interleaved to match by the wrapper (KEY_ORDER)"
                    for i in self.interleaved
                ),
                *(
                    f"output {self.d.cod.inside[k].describe()} summed over {self.q}: each chunk's partial stored "
                    "through a shared-memory buffer per consumer and added into the zeroed output by a TMA reduce-add"
                    for k in self.summed
                ),
                *(
                    f"block sparsity: the chunks {', '.join(b.name for b in self.d.boxes if id(b) in self.masks)} "
                    f"hide are never loaded, those kept whole run without the mask{'s' * (len(self.masks) > 1)}"
                    for _ in range(bool(self.masks))
                ),
                *described(p),
                *(
                    f"output {w.describe()} stored through the shared-memory tile of {self.d.dom.inside[i].describe()}"
                    for w, i in zip(self.d.cod.inside, self.reuse, strict=True)
                    if i is not None
                ),
                *(
                    f"outputs {', '.join(w.describe() for w, k in outs if k == j)} stored in turn through one "
                    "shared-memory buffer per consumer"
                    for j in range(len(self.own))
                    if self.shared.count(j) > 1
                ),
            ]
        )

    def sparsity(self, *arrays) -> Sparsity:
        """The blocks this kernel skips, runs unmasked and runs masked on ``arrays``, and how they were found
        (:func:`lowering._sparsity.sparsity`, with the call-time masks this kernel reads: those over its split axis)."""
        full = self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        sizes = bind(full.dom, arrays)
        extent = {a.name: int(a.size.subs(sizes)) for w in full.dom.inside for a in w.axes}
        return sparsity(self.plan, arrays, extent, self.segments)

    def guard(self) -> None:
        """:meth:`check` now where the sizes it reads (the axes kept whole) are known: the tiled and streamed
        axes enter it only through their blocks."""
        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        if all(size[a].is_number for a in self.plan.whole):
            self.check({a: int(n) if n.is_number else 1 for a, n in size.items()})

    def _role(self, w) -> str | None:
        """``stream`` (a ring chunk, whole tile rows when it holds the split axis), ``tile`` (per-consumer rows):
        2-D blocks, or vectors along the split or the streamed axis (the backward's ``L`` and ``Δ``); ``scalar``: one
        number per program (an attention sink's logit), read from HBM by each consumer."""
        names = w.names
        if not names:
            return "scalar"
        if len(names) == 1 and names[0] in (self.q, self.x):
            return "stream" if names[0] == self.x else "tile"
        if len(names) != 2 or len(set(names)) != 2:
            return None
        if any(n not in (self.q, self.x, *self.others, *self.plan.whole) for n in names):
            return None
        if self.x in names:
            return "stream"
        return "tile" if self.q in names else None

    def lowering_error(self) -> str | None:
        """Why Mosaic GPU does not lower this kernel for CUDA (a primitive it has no rule for, as in a user's score
        modifier, or layouts its inference cannot find), found by lowering it on example arrays of whole blocks
        (a tile of each tiled axis, two chunks of the streamed one, one of each batch axis) without compiling;
        None where it lowers, or where an axis kept whole has no size yet.

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> powed = nc.library.attention(q, x, d, dtype="bf16", score_mod=lambda s, q, x: s * jnp.abs(s) ** 0.5)
        >>> k = MosaicLowered(plan(derive(powed, tile(q, 128), stream(x, 64), verify=False).diagram), interpret=False)
        >>> k.lowering_error()  # doctest: +ELLIPSIS
        'Mosaic GPU does not lower it for CUDA: NotImplementedError: Unimplemented primitive ...: pow ...'
        """
        full = self.plan.diagram
        blocks = {**self.plan.tiles, **({self.x: 2 * self.s} if self.x else {})}
        sizes = {a.name: a.size for w in full.dom.inside for a in w.axes}
        if any(not sizes[a].is_number for a in self.plan.whole):
            return None
        example = {
            sym: blocks.get(sym.name, 1) for n in sizes.values() for sym in n.free_symbols
        }  # a tiled or streamed axis's own symbol gives its blocks; any other (a batch axis) 1
        structs = [
            jax.ShapeDtypeStruct(tuple(int(a.size.subs(example)) for a in w.axes), w.dtype.jnp) for w in full.dom.inside
        ]
        # a block map's chunk lists lowered too (at these sizes its map may have no holes)
        run = functools.partial(self._run, every=any(isinstance(m, Mapped) for m in self.segments))
        try:
            jax.jit(run).trace(*structs).lower(lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001 - any failure of Mosaic GPU's lowering is the reason reported
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"Mosaic GPU does not lower it for CUDA: {type(e).__name__}: {first[:300]}"
        return None

    # -- the wrapper: bind sizes, check them, launch --------------------------------------------
    def ragged(self, *arrays) -> str | None:
        """Why these arrays do not split into whole blocks (Mosaic pads nothing), else None.

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64),
        ...                                verify=False).diagram))
        >>> k.ragged(*(jnp.zeros((200, 64), jnp.bfloat16),) * 3)
        "axis 'q' of size 200: the Mosaic backend needs whole blocks of 128"
        """
        full = self.plan.diagram
        sizes = bind(full.dom, [a if isinstance(a, jax.ShapeDtypeStruct) else jnp.asarray(a) for a in arrays])
        return self._ragged({a.name: a.size.subs(sizes) for w in full.dom.inside for a in w.axes})

    def _ragged(self, size: dict) -> str | None:
        blocks = ((self.q, self.plan.tiles[self.q]), *([(self.x, self.s)] if self.x else []), *self.others.items())
        return next(
            (
                f"axis {a!r} of size {size[a]}: the Mosaic backend needs whole blocks of {n}"
                for a, n in blocks
                if size[a].is_number and int(size[a]) % n
            ),
            None,
        )

    def __call__(self, *arrays, pages=None):
        """The kernel on ``arrays``; with ``pages`` = ``(page_map, table)`` (:class:`lowering._paged.PageMap`) the
        inputs it names are page pools, each streamed chunk copied in by TMA from the pages ``table`` names (one copy
        per page, or a window of one page), as Triton's loop gathers them."""
        return self._run(*arrays, pages=pages)

    def _run(self, *arrays, every: bool = False, pages=None):
        """The kernel on ``arrays``; with ``every``, each block map read as chunk lists (:meth:`lowering_error`)."""
        full = self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        pm, table = pages if pages is not None else (None, None)
        virtual = arrays if pm is None else pm.contiguous(self.plan, full.dom.inside, arrays, table)
        sizes = bind(full.dom, virtual)
        extent = {a.name: int(a.size.subs(sizes)) for w in full.dom.inside for a in w.axes}
        if why := self.ragged(*virtual):
            raise NotLowerable(why)
        self.check(extent)
        outs = self._call(arrays, sizes, extent, every, (pm, table))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def check(self, extent: dict) -> None:
        """Refuse, before compiling, a kernel whose shared memory exceeds the block limit.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=256)
        >>> attn = derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 256), stream(x, 128), verify=False)
        >>> MosaicLowered(plan(attn.diagram)).check({"d": 256})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lowering._plan.NotLowerable: thread-block level: the kernel would hold 459,776 B of shared memory ...
        """
        smem = self.smem_bytes(extent)
        if smem > SMEM_LIMIT:
            raise NotLowerable(
                f"thread-block level: the kernel would hold {smem:,} B of shared memory ({self.config.stages} stages "
                f"of each streamed chunk, resident tiles, output tiles), over the {SMEM_LIMIT:,} B a block may use"
            )
        live, budget = self.registers(extent), self.config.consumer_registers
        if live > budget:
            raise NotLowerable(
                f"warpgroup level: a consumer thread would keep {live} f32 registers live (its accumulators and "
                f"the largest chunk of {self.rows} {self.q}-rows × {self.s} {self.x}), over its {budget}"
            )

    def registers(self, extent: dict) -> int:
        """f32 registers per consumer thread that the loop keeps live: one accumulator per output block and the
        largest chunk-sized value a box computes (the scores; a summed output's block, dQ's, which lives one chunk),
        spread over a warpgroup's 128 threads. Over the budget
        the compiler spills (measured on H100: g256 s128 at D = 128, 256 registers, ran at 328 TFLOP/s against 542
        for g256 s64, 192 registers).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=128)
        >>> attn = nc.library.attention(q, x, d, dtype="bf16")
        >>> [MosaicLowered(plan(derive(attn, tile(q, 256), stream(x, s), verify=False).diagram)).registers({"d": 128})
        ...  for s in (64, 128)]
        [192, 256]
        """
        wires = self.d.cod.inside
        accumulators = sum(math.prod(self.block(w, extent)) for k, w in enumerate(wires) if k not in self.summed)
        # a copy or swap of a chunk (K's, V's in shared memory; P's) holds no registers of its own; a summed output
        # (dQ) is a chunk's product, stored and released each chunk, not an accumulator of the loop
        boxes = [b for b in self.d.boxes if not is_structural(b)]
        chunks = [w for b in boxes for w in b.cod.inside if self.x in w.names and self._role(w)]
        chunks += [wires[k] for k in self.summed]
        return (accumulators + max((math.prod(self.block(w, extent)) for w in chunks), default=0)) // 128

    def block(self, w, extent, *, ring: bool = False) -> tuple:
        """A wire's block as a consumer sees it: ``rows`` of the split axis (the whole tile ``g`` in a ``ring``
        buffer, which the producer fills for all consumers), ``s`` of the streamed one, other tiles, whole axes."""
        g = self.plan.tiles[self.q]
        size = {self.q: g if ring else self.rows, self.x: self.s, **self.others}
        return tuple(size.get(n, extent.get(n)) for n in w.names)

    def smem_bytes(self, extent: dict) -> int:
        """Shared memory held: per streamed input ``stages`` chunks, per resident input and output one tile per
        consumer (an output written into a resident input's tile takes none), the staging buffer of a register operand
        (interpret mode; the fused backward's dS, read transposed), and the barriers; each allocation starts on a
        1,024 B boundary, as Mosaic GPU places them (``SMEM_ALIGNMENT``; a vector of 64 f32 rows per consumer takes
        1,024 B, not 512: attention sinks' dQ at D = 128 needed 234,656 B where the unaligned count said 230,912).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> m, k, n = nc.axes("m k n")
        >>> mm = nc.library.matmul(m, k, n, dtype="bf16")
        >>> mm = derive(mm, tile(m, 256), tile(n, 128), stream(k, 64), verify=False)
        >>> compiled = MosaicLowered(plan(mm.diagram), interpret=False, config=MosaicConfig(stages=3))
        >>> compiled.smem_bytes({})  # 3·384·64·2 + 2·128²·2 + 1K
        214016
        """
        c, total, barriers = self.config, 0, int(self.pingpong and self.interpret)  # compiled: a named barrier
        for i, w in enumerate(self.d.dom.inside):
            role = self._role(w)
            if role == "scalar" or i in self.made:  # read from HBM into registers; made in registers
                continue
            n = math.prod(self.block(w, extent, ring=role == "stream")) * self.held(w).itemsize
            total += _aligned(n * (c.stages if role == "stream" else c.consumers))
            barriers += 2 * c.stages if role == "stream" else c.consumers  # loaded and consumed; arrived
        for w in self.own:
            total += _aligned(math.prod(self.block(w, extent)) * w.dtype.bytes * c.consumers)
        if self.staging and self.x:
            total += _aligned(self.rows * self.s * self._staged_dtype().bytes * c.consumers)
        return total + _aligned(8 * barriers)

    def reduction_scratch(self, extent: dict) -> int:
        """The shared memory Mosaic GPU keeps for reductions across a warpgroup's warps: its default (2,048 B), or
        what the kernel's own buffers leave of a block's shared memory where that is less. The row statistics of
        wgmma's layout (softmax's max and sum over the keys) reduce within each warp and need none; a reduction
        that needs more than is left is refused when the kernel lowers, not run. A decode step's 128-key chunks at
        D = 128 fit so: their buffers leave 1,024 B.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=128)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 128),
        ...                                verify=False).diagram), interpret=False)
        >>> k.reduction_scratch({"q": 4096, "x": 4096, "d": 128})
        2048
        """
        default = plgpu.CompilerParams().reduction_scratch_bytes
        return max(0, min(default, SMEM_LIMIT - self.smem_bytes(extent)))

    def _streamed_blocks(self) -> list:
        """The streamed 2-D input blocks (K and V, one chunk of each)."""
        return [w for w in self.d.dom.inside if self._role(w) == "stream" and len(w.axes) == 2]

    def _fp8_values(self) -> tuple:
        """The inputs P meets in FP8, by position: streamed FP8 blocks laid out with the streamed axis innermost
        (``[e, x]``, contracted over it); an FP8 K (``[x, d]``) with a 16-bit V is FAN's mixed algorithm."""
        blocks = {id(w) for w in self._streamed_blocks()}
        wires = self.d.dom.inside
        return tuple(i for i, w in enumerate(wires) if id(w) in blocks and w.dtype in FP8 and w.names[-1] == self.x)

    def _staged_dtype(self):
        """The dtype a staged A operand takes: V's, which it meets in a wgmma: the streamed blocks' (one dtype), or with
        an FP8 K and a 16-bit V (FAN's mixed algorithm) the 16-bit one."""
        streamed = self._streamed_blocks()
        if any(w.dtype in FP8 for w in streamed) and not self._fp8_values():
            return next(w.dtype for w in streamed if w.dtype not in FP8)
        return streamed[0].dtype if streamed else self.d.dom.inside[0].dtype

    def held(self, w):
        """The dtype an input is held in on the GPU: f32 for a vector of 16-bit floats or bools (a bias per key,
        ``[B, 1, 1, N]`` or ``[1, H, 1, N]`` in bf16; a padding mask ``[B, 1, 1, N]``), which jax 0.11.2's Mosaic GPU
        lays out as no block's rows or columns (bf16: its layout inference finds no solution) or does not copy at all
        (``i1``); the wrapper casts such an input, O(N) values, before the call, exactly (the generators compute in
        f32; a mask is read as ``m != 0`` once spread over the scores, ``library.keep_where``); else its own dtype.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> b, q, x, d = nc.axes("b q x d", d=64)
        >>> kw = dict(dtype="bf16", batch=(b,), bias_batch=(b,), bias_seq="x", bias_dtype="bf16")
        >>> k = MosaicLowered(plan(derive(nc.library.dot_product_attention(q, x, d, **kw), tile(q, 128), stream(x, 128),
        ...                               verify=False).diagram))
        >>> [str(k.held(w)) for w in k.d.dom.inside]
        ['bfloat16', 'bfloat16', 'bfloat16', 'float32']
        """
        dtype = jnp.dtype(w.dtype.jnp)
        vector = len(set(w.names) - set(self.plan.batch)) == 1
        half = jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2
        return jnp.dtype(jnp.float32) if vector and (half or dtype == jnp.bool_) else dtype

    def _call(self, arrays, sizes, extent, every: bool = False, pages=(None, None)):
        p, full, c = self.plan, self.plan.diagram, self.config
        pm, table = pages
        # the call-time masks' blocks: four bounds per tile, or chunk lists where a block map has holes
        blocks = call_blocks(p, self.segments, arrays, extent, every=every)
        wires = self.d.dom.inside
        streamed = [i for i, w in enumerate(wires) if self._role(w) == "stream" and i not in self.made]
        resident = [i for i, w in enumerate(wires) if self._role(w) == "tile"]
        g = p.tiles[self.q]
        n_tiles, n_chunks = extent[self.q] // g, (extent[self.x] // self.s if self.x else 0)
        batch = [extent[a] for a in p.batch]

        def smem(shape, dtype):  # stages or consumers of a block, swizzled for wgmma; of a vector, as is
            swizzle = _swizzle(shape[-1], jnp.dtype(dtype).itemsize) if len(shape) == 3 else ()
            return plgpu.SMEM(shape, dtype, transforms=swizzle)

        scratch = [
            [smem((c.stages, *self.block(wires[i], extent, ring=True)), self.held(wires[i])) for i in streamed],
            [smem((c.consumers, *self.block(wires[i], extent)), self.held(wires[i])) for i in resident],
            [smem((c.consumers, *self.block(w, extent)), w.dtype.jnp) for w in self.own],
            # a paged chunk of several pages arrives by one TMA copy per page, each arriving on the slot's barrier
            [plgpu.Barrier(num_arrivals=self._copies(pm, i), num_barriers=c.stages) for i in streamed],
            [plgpu.Barrier(num_arrivals=c.consumers, num_barriers=c.stages) for _ in streamed],
            [plgpu.Barrier(num_barriers=c.consumers) for _ in resident],
        ]
        scratch.append([plgpu.Barrier(num_arrivals=c.consumers)] if self.pingpong and self.interpret else [])
        if self.staging and streamed:
            scratch.append([smem((c.consumers, self.rows, self.s), self._staged_dtype().jnp)])
        kernel = MosaicKernel(self, sizes, extent, streamed, resident, n_tiles, n_chunks, batch, blocks, pm)
        others = [extent[a] // n for a, n in self.others.items()]
        out_type = out_structs(full.cod.inside, extent, arrays)
        summed = [jax.new_ref(varying_like(self._zeros(out_type[k]), arrays)) for k in self.summed]
        stored = [t for k, t in enumerate(out_type) if k not in self.summed]
        if self.interpret:  # the interpreter's warpgroup threads wait inside XLA's CPU pool: too small a pool hangs
            check_interpreter_pool(c.consumers + 1)
        call = plgpu.kernel(
            kernel,
            out_type=stored,
            scratch_types=scratch,
            # the last grid axis is the fastest (CUDA's x): sections of the batch, then tiles, then the section's
            # members (MosaicKernel.members)
            grid=(math.prod(batch) // kernel.n_members, *reversed(others), n_tiles, kernel.n_members),
            grid_names=("section", *(f"tile_{a}" for a in reversed(self.others)), "tile", "member"),
            num_threads=c.consumers + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(
                approx_math=True, reduction_scratch_bytes=self.reduction_scratch(extent)
            ),
            kernel_name="napkin_mosaic",
            interpret=plgpu.InterpretGPUParams() if self.interpret else None,
        )
        lists = [blocks.lists] if blocks.listed else []
        # made in the kernel: never passed; vectors of 16-bit floats or bools as f32 (:meth:`held`); an FP8 V's
        # keys in the order P's are in registers
        passed = [
            interleave_keys(a) if i in self.interleaved else a.astype(self.held(wires[i]))
            for i, a in enumerate(arrays)
            if i not in self.made
        ]
        tables = [] if pm is None else [table]
        outs = iter(call(*passed, *(b for _, b in blocks.bounds), *lists, *tables, *summed))
        added = iter(r[...].sum(0) if self.interpret else r[...] for r in summed)
        return [next(added) if k in self.summed else next(outs) for k in range(len(out_type))]

    def _copies(self, pm, i: int) -> int:
        """The TMA copies that fill a ring slot of streamed input ``i``: one per page of a paged chunk of whole
        pages (:class:`lowering._paged.PageMap`), else one."""
        return max(1, self.s // pm.page_size) if pm is not None and i in pm.inputs else 1

    def _zeros(self, struct):
        """A summed output's start: zeros, as the kernel adds into them; interpreted, one copy per consumer (the
        interpreter runs a program's warpgroups as threads, between which a read-modify-write would race, and its
        programs one after another), summed after."""
        shape = ((self.config.consumers,) if self.interpret else ()) + struct.shape
        return jnp.zeros(shape, struct.dtype)


def _consumers(d: Diagram, q: str, given: int | None, g: int) -> int:
    """The consumer warpgroups: the diagram's split of ``q`` (``rewrites.split``), else ``given``, else 2 (FA3's)
    where the tile ``g`` holds two wgmma row blocks, 1 where it holds one (a tile of 64: the wide head dims'
    backward, whose blocks fit shared memory only there); a ``given`` number other than the diagram's is refused."""
    parts = {a.split for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.name == q and a.split is not None}
    label = int(next(iter(parts))) if parts else None
    if given is not None and label is not None and given != label:
        raise NotLowerable(
            f"axis {q!r}: the diagram splits each tile over {label} warpgroups (split({q}, {label})) but "
            f"MosaicConfig(consumers={given}) asks for {given}; drop one of them"
        )
    return label or given or (2 if g >= 2 * WGMMA_M else 1)


def _aligned(n: int) -> int:
    """``n`` bytes rounded up to Mosaic GPU's shared-memory alignment (each allocation starts on it)."""
    return -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def _same_block(a, b) -> bool:
    """Two wires whose blocks have one shape and dtype (same axes in the same order)."""
    return a.names == b.names and a.dtype == b.dtype
