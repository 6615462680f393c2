"""Where ``backend="auto"`` takes Mosaic: the blocks it was measured faster than Triton at (:func:`faster`), the
entry's and the backward's blocks, and whether a kernel passes the checks before compiling (:func:`admits`)."""

from __future__ import annotations

from dataclasses import dataclass

from lowering._plan import NotLowerable, plan
from lowering.mosaic._config import MosaicConfig
from lowering.mosaic._lowered import MosaicLowered
from napkin_cat.diagram import Diagram


@dataclass(frozen=True)
class MosaicBlocks:
    """The Mosaic backend's block policy, one home for its measured values (H100 unless named; docs/mosaic.md's
    versions): where ``"auto"`` takes it (:func:`faster`), the entry's blocks (:meth:`entry`,
    :func:`lowering._attention.schedule`), the backward's chunk (``backward_chunk``, the registry's ``chunks``) and
    the search space (:meth:`space`). The pipeline depth is :class:`MosaicConfig`'s ``stages`` (2: the ring of
    shared-memory buffers, measured with it in every version).

    >>> MOSAIC_BLOCKS.entry(64), MOSAIC_BLOCKS.entry(128), MOSAIC_BLOCKS.backward_chunk
    ((256, 128), None, 128)
    """

    #: where Mosaic's forward was measured faster than Triton's (docs/mosaic.md v2, v3 and v5): consumer blocks of
    #: 128 rows (a tile of 256 split over two warpgroups) at D ∈ {64, 128}, and since the launch order keeps K and V
    #: in L2 (v5) 64-row blocks streaming chunks of 128 (the entry's g128 s128: 290–591 against Triton's 278–440
    #: TFLOP/s over D ∈ {64, 128}, N ∈ {2048, 8192}, causal and not); 64-row blocks streaming 64 are not measured
    #: since (before: 253 against 344 at D = 64, N = 2048), so they stay on Triton
    faster_rows: int = 128
    faster_chunk: int = 128
    faster_whole: tuple = (64, 128)
    #: the consumer warpgroups of every kernel measured so (one consumer, a tile of 64, is not measured)
    faster_consumers: int = 2
    #: the head dims (q and k's, v's) whose every kernel, on Mosaic's own wide blocks (``wide_blocks``; dQ at 64
    #: queries on one consumer, dK and dV in a kernel each), was measured faster than Triton's (H200,
    #: ``head_dims.py``, bf16, B = 2, H = 16, N = 8192): D = 256 forward 636 / 664 TFLOP/s (non-causal / causal)
    #: against Triton's 448 / 430, forward + backward 388 / 377 against 130 / 133 (cuDNN 743 / 680 and 410 / 440);
    #: MLA's 192 / 128 non-causal, forward 498 against 319, forward + backward 240 against 195
    faster_wide: tuple = ((256,), (192, 128))
    #: the forward blocks (tile, chunk) Mosaic was measured fastest at, per head dim, where they differ from the
    #: entry's rule (Triton's, FlashAttention-2's): at D = 64 a tile of 256 (128 rows per consumer) streaming 128
    #: keys ran at 326–435 TFLOP/s against Triton's 128 × 64 at 282–355 (1.15–1.23×; Mosaic's own 128 × 64 at
    #: 259–324), bf16, N ∈ {2048, 8192}, causal and not (docs/mosaic.md v7)
    entry_blocks: tuple = ((64, (256, 128)),)
    #: where a query row and an output row together are wider than ``wide`` (D = 256; MLA's 192 and 128): a tile of
    #: 128, 64 rows per consumer (their f32 output accumulators leave registers for no more), streaming 64 keys
    #: (the shared memory of two stages holds no more)
    wide: int = 256
    wide_blocks: tuple = (128, 64)
    #: the chunk the backward's kernels stream where the consumers' registers admit it (:func:`admits`), where
    #: Triton's keep FlashAttention-2's 64: (bf16, N = 8192, docs/mosaic.md v6, ``backward_configs.py --mosaic``)
    #: dQ runs 1.05–1.11× faster than at 64, dK·dV at D = 64 within 2% of it, and at D = 128 dK·dV's accumulators
    #: leave no registers for it
    backward_chunk: int = 128
    #: the head dims (q, k and v alike) whose backward ``"auto"`` derives with dQ fused into the dK·dV kernel
    #: (``backward="fused"``, FlashAttention-3's five products per tile pair): at D = 64 forward + backward ran
    #: 1.05–1.08× the two-kernel backward (H200, stop 40, ``mosaic_bench.py --fused``, bf16, N ∈ {2048, 8192}, causal
    #: and not); at D = 128 0.77–0.83× (the fused kernel streams 64 queries), so two kernels there
    fused_dq_dims: tuple = (64,)
    #: what a search times: ring stages × ping-pong as measured or off
    search_stages: tuple = (2, 3)
    search_pingpong: tuple = (None, False)

    def entry(self, dim: int, value_dim: int | None = None) -> tuple[int, int] | None:
        """The entry's ``(tile, chunk)`` of Mosaic's own at head dims ``dim`` (q, k) and ``value_dim`` (v; None:
        ``dim``), or None: the entry's rule.

        >>> MOSAIC_BLOCKS.entry(256), MOSAIC_BLOCKS.entry(192, 128), MOSAIC_BLOCKS.entry(96)
        ((128, 64), (128, 64), None)
        """
        if dim + (dim if value_dim is None else value_dim) > self.wide:
            return self.wide_blocks
        return dict(self.entry_blocks).get(dim) if value_dim in (None, dim) else None

    def measured(self, dim: int, value_dim: int | None = None) -> bool:
        """Whether ``"auto"`` may take Mosaic at head dims ``dim`` (q, k) and ``value_dim`` (v): both among
        ``faster_whole``, where it was measured faster than Triton.

        >>> MOSAIC_BLOCKS.measured(128), MOSAIC_BLOCKS.measured(256), MOSAIC_BLOCKS.measured(160, 128)
        (True, True, False)
        """
        dims = {dim, dim if value_dim is None else value_dim}
        return dims <= set(self.faster_whole) or self.all_wide(dims)

    def fuses_dq(self, dim: int, value_dim: int | None = None) -> bool:
        """Whether the entry's backward on Mosaic fuses dQ into the dK·dV kernel at head dims ``dim`` (q, k) and
        ``value_dim`` (v): both in ``fused_dq_dims``, where it was measured faster than two kernels.

        >>> MOSAIC_BLOCKS.fuses_dq(64), MOSAIC_BLOCKS.fuses_dq(128), MOSAIC_BLOCKS.fuses_dq(64, 128)
        (True, False, False)
        """
        return {dim, dim if value_dim is None else value_dim} <= set(self.fused_dq_dims)

    def all_wide(self, dims) -> bool:
        """Whether head dims ``dims`` (a kernel's whole axes, or a call's q and v head dims) are one of
        ``faster_wide``'s: every kernel goes to Mosaic's own blocks, none to Triton (so the backward's chunks need not
        fit Triton too).

        >>> MOSAIC_BLOCKS.all_wide({256}), MOSAIC_BLOCKS.all_wide({192, 128}), MOSAIC_BLOCKS.all_wide({128})
        (True, True, False)
        """
        return any(set(dims) == set(wide) for wide in self.faster_wide)

    def stands_in(self, dims, auto: bool) -> bool:
        """Whether, under ``auto``, a Triton kernel may stand in for one of a call's kernels at head dims ``dims``
        (a shape Mosaic cannot take, known only when called), so Mosaic's blocks must fit Triton too: everywhere
        but the :meth:`all_wide` head dims, whose every kernel runs on Mosaic.

        >>> MOSAIC_BLOCKS.stands_in({128}, auto=True), MOSAIC_BLOCKS.stands_in({256}, auto=True)
        (True, False)
        """
        return auto and not self.all_wide(dims)

    def space(self) -> tuple[MosaicConfig, ...]:
        """The configs a search times: ``search_stages`` × ``search_pingpong``.

        >>> len(MOSAIC_BLOCKS.space())
        4
        """
        return tuple(MosaicConfig(stages=s, pingpong=pp) for s in self.search_stages for pp in self.search_pingpong)


#: the Mosaic backend's block policy
MOSAIC_BLOCKS = MosaicBlocks()


def faster(kernel: MosaicLowered, backward: bool = False) -> str | None:
    """None where ``backend="auto"`` expects ``kernel`` to beat Triton's (measured: :class:`MosaicBlocks`'
    ``faster_rows``, ``faster_chunk``, ``faster_whole``, ``faster_consumers``), else why not; an unmeasured head dim
    is named first. A ``backward`` kernel (Δ, dQ, dK·dV, at the chunks :func:`lowering._backward.backward_of` gives
    Mosaic) needs only two consumers and whole axes of ``faster_whole``:
    each was measured faster than Triton's (H100, N = 8192, docs/mosaic.md v6: dK·dV 1.15–1.28×, dQ 1.00–1.36×;
    forward + backward all on Mosaic 1.05–1.19× Mosaic's forward with Triton's backward, every configuration).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=128)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> sched = lambda g, s: derive(attn, tile(q, g), stream(x, s), verify=False).diagram
    >>> [faster(MosaicLowered(plan(sched(g, s)))) for g, s in ((256, 64), (128, 128), (128, 64))]
    [None, None, "64-row consumer blocks (tile q/128 over 2 warpgroups) streaming chunks of 64: Mosaic not \
measured faster than Triton there; 'auto' takes Mosaic at 128-row blocks, or 64-row blocks streaming chunks of \
128, with whole axes of 64 or 128"]
    """
    policy, whole = MOSAIC_BLOCKS, kernel.whole()
    rows, chunk, widths = policy.faster_rows, policy.faster_chunk, policy.faster_whole
    if other := kernel.unmeasured():
        return f"{other}: Mosaic compiled and measured only on attention's blocks; 'auto' keeps it on Triton"
    if all(n.is_number for n in whole.values()) and policy.all_wide({int(n) for n in whole.values()}):
        return None  # Mosaic's own wide blocks, every kernel measured faster
    narrow = all(n.is_number and int(n) in widths for n in whole.values())
    blocks = backward or kernel.rows == rows or (kernel.rows == rows // 2 and kernel.s == chunk)
    paired = kernel.config.consumers == policy.faster_consumers
    if blocks and narrow and paired:
        return None
    tiled = f"tile {kernel.q}/{kernel.plan.tiles[kernel.q]}"
    if narrow and not paired:  # an unmeasured head dim is named first, below
        return (
            f"{kernel.config.consumers} consumer warpgroup ({tiled}): Mosaic measured faster than Triton only with "
            f"{policy.faster_consumers}; 'auto' keeps it on Triton"
        )
    where = f"{kernel.rows}-row consumer blocks ({tiled} over "
    where += f"{kernel.config.consumers} warpgroups)" + (f" streaming chunks of {kernel.s}" if kernel.x else "")
    if not narrow:
        where = ", ".join(f"whole axis {a} = {n}" for a, n in whole.items())
    return (
        f"{where}: Mosaic not measured faster than Triton there; 'auto' takes Mosaic at {rows}-row blocks, "
        f"or {rows // 2}-row blocks streaming chunks of {chunk}, with whole axes of {' or '.join(map(str, widths))}"
    )


def admits(d: Diagram, config: MosaicConfig | None = None) -> bool:
    """Whether the scheduled ``d`` passes the Mosaic lowering's checks before compiling (it plans; shared memory
    and the consumers' registers, :meth:`MosaicLowered.check`, where the axes kept whole are known).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=128)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> [admits(derive(attn, tile(q, 256), stream(x, s), verify=False).diagram) for s in (64, 128)]
    [True, False]
    """
    try:
        MosaicLowered(plan(d), interpret=False, config=config).guard()
    except NotLowerable:
        return False
    return True
