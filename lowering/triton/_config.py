"""The Triton backend's tuning knobs (:class:`TritonConfig`) and its block policy (:class:`TritonBlocks`)."""

from __future__ import annotations

from dataclasses import dataclass

from lowering._plan import NotLowerable, Plan, next_pow2, smem_bytes
from napkin_cat.hardware import H100, Hardware


@dataclass(frozen=True)
class TritonConfig:
    """Tuning knobs of the Triton backend (tile sizes come from the diagram's labels), checked when made.

    ``num_warps`` is a power of two from 1 to 32 (Triton's range); ``num_stages`` ≥ 1 is how many
    buffers of each streamed chunk the pipeline keeps, so it multiplies the shared-memory footprint.

    >>> TritonConfig(num_warps=8, num_stages=3)
    TritonConfig(num_warps=8, num_stages=3)
    >>> TritonConfig(num_stages=-1)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: TritonConfig: num_stages must be an integer ≥ 1, got -1
    >>> TritonConfig(num_warps=6)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: TritonConfig: num_warps must be one of 1, 2, 4, 8, 16, 32, got 6
    """

    num_warps: int = 4
    #: the pipeline depth every default takes (:data:`STAGES`)
    num_stages: int = 3

    def __post_init__(self):
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not integer(self.num_warps) or self.num_warps not in WARPS:
            shown = ", ".join(map(str, WARPS))
            raise NotLowerable(f"TritonConfig: num_warps must be one of {shown}, got {self.num_warps!r}")
        if not integer(self.num_stages) or self.num_stages < 1:
            raise NotLowerable(f"TritonConfig: num_stages must be an integer ≥ 1, got {self.num_stages!r}")

    @classmethod
    def get_default(cls, p: Plan) -> TritonConfig:
        """The policy's config for a plan (:meth:`TritonBlocks.config`).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False)
        >>> TritonConfig.get_default(plan(flash.diagram))
        TritonConfig(num_warps=8, num_stages=3)
        """
        return TRITON_BLOCKS.config(p)


#: the warp counts Triton accepts
WARPS = (1, 2, 4, 8, 16, 32)
#: the pipeline depth of every Triton default (``TritonConfig()``, :meth:`TritonBlocks.config`, the tile choice's
#: shared-memory check): 3, measured on an H200 by ``lowering._search`` (warps × stages over 2 and 3)
STAGES = 3


@dataclass(frozen=True)
class TritonBlocks:
    """The Triton backend's block policy, one home for its measured values: the entry's forward blocks
    (:meth:`entry`, :func:`lowering._attention.schedule`), the backward's (``backward_tile``, ``backward_stream``,
    :func:`lowering._backward.backward_of`), the launch config (:meth:`config`) and the search space (:meth:`space`,
    :func:`lowering._search.search`). Each field names where it was measured.

    >>> TRITON_BLOCKS.entry(8192, 8192, 128), TRITON_BLOCKS.backward_tile, TRITON_BLOCKS.backward_stream
    ((128, 128), 128, 64)
    """

    #: the entry's tile and chunk: FlashAttention-2's blocks (Dao 2023 §3.3), benchmarked in ``papers/flash_attention``
    tile: int = 128
    chunk: int = 64
    #: a query row and an output row wider than this halve the tile (so it fits shared memory: a head dim above 128)
    wide: int = 256
    narrow_tile: int = 64
    #: exactly ``wide`` streams chunks of ``wide_chunk``: on an H100 (bf16, N = 8192) the forward runs 14% faster and
    #: forward + backward 4%; at head dim 64 such chunks are 4% slower
    #: (``papers/flash_attention/results/schedule_NVIDIA_H100_80GB_HBM3.json``)
    wide_chunk: int = 128
    #: the smallest block every 16-bit dot accepts (K ≥ 16)
    smallest: int = 16
    #: the backward's blocks (FlashAttention-2 §3.2, and its kernels at d = 128): each kernel tiles the axis it
    #: keeps in blocks of ``backward_tile`` and streams the other in chunks of ``backward_stream``, never larger than
    #: the forward's own blocks; halved (the stream first) until they fit shared memory
    #: (:func:`lowering._tiles.fit_blocks`)
    backward_tile: int = 128
    backward_stream: int = 64
    #: a summed batch axis streamed one element at a time holds a tile of every input per stage: tiles of at most
    #: this many rows (64 rows fit D = 128 in 3 stages)
    batch_tile: int = 64
    #: 8 warps for tiles of at least this many rows, else 4
    wide_warps_at: int = 128
    #: pipeline stages (:data:`STAGES`); 1 for a stream of single elements (a batch axis summed, a few steps each
    #: loading a tile of every input: the prologue costs more than it hides; a learned bias's gradient at B = 2,
    #: N = 8192, D = 128 on an H100 ran in 6.1 ms at 1 stage, 7.8 at 2, 10.9 at 3, and on an H200 5.70 at 1, 8.05
    #: at 2, ``papers/flash_attention/bias_gradient.py``). Sixteen heads streamed (a bias shared by the batch and
    #: the heads) fill 2 stages: at 128 × 64 blocks and 8 warps 3.45 ms against 3.77 at this policy's (H200); the
    #: stream's length is not known when the kernel is lowered
    stages: int = STAGES
    single_stages: int = 1
    #: what ``search=True`` times (``lowering._search``): warps × stages
    search_warps: tuple = (4, 8)
    search_stages: tuple = (2, 3)

    def entry(self, q_len: int, kv_len: int, dim: int, value_dim: int | None = None) -> tuple[int, int]:
        """``(tile, chunk)`` for attention of ``q_len`` queries, ``kv_len`` keys and head dims ``dim``, ``value_dim``:
        the measured blocks, never more than the sequence needs (the next power of two, at least ``smallest``).

        >>> TRITON_BLOCKS.entry(8192, 8192, 256), TRITON_BLOCKS.entry(20, 40, 64), TRITON_BLOCKS.entry(3, 3, 8)
        ((64, 64), (32, 64), (16, 16))
        """
        width = dim + (dim if value_dim is None else value_dim)
        tile = self.tile if width <= self.wide else self.narrow_tile
        chunk = self.wide_chunk if width == self.wide else self.chunk
        return self.fit(tile, q_len), self.fit(chunk, kv_len)

    def fit(self, block: int, n: int) -> int:
        """``block``, or fewer where ``n`` elements need fewer: the next power of two, at least ``smallest``.

        >>> TRITON_BLOCKS.fit(128, 20), TRITON_BLOCKS.fit(128, 3), TRITON_BLOCKS.fit(128, 8192)
        (32, 16, 128)
        """
        return min(block, max(self.smallest, next_pow2(n)))

    def config(self, p: Plan, *, fit: bool = True) -> TritonConfig:
        """8 warps for tiles of ``wide_warps_at`` rows or more, else 4; ``stages`` pipeline stages (with ``fit``,
        :meth:`deepest`: fewer where blocks already chosen hold no more), ``single_stages`` for a stream of single
        elements.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> TRITON_BLOCKS.config(plan(derive(nc.library.attention(q, x, d), tile(q, 64), stream(x, 64)).diagram))
        TritonConfig(num_warps=4, num_stages=3)
        """
        g = max(p.tiles.values(), default=64)
        single = p.stream and p.stream[1] == 1
        stages = self.single_stages if single else self.deepest(p) if fit else self.stages
        return TritonConfig(num_warps=8 if g >= self.wide_warps_at else 4, num_stages=stages)

    def deepest(self, p: Plan, hardware: Hardware = H100) -> int:
        """``stages``, or fewer (not below 2) where the blocks, their whole axes' sizes known, would not fit
        ``hardware``'s shared memory at that depth: at a head dim of 256, a forward's 64-row tiles fit 3 stages, and
        with a streamed bias (or the dQ kernel's dO tile) only 2.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=256)
        >>> wide = lambda f: plan(derive(f(q, x, d, dtype="bf16"), tile(q, 64), stream(x, 64), verify=False).diagram)
        >>> TRITON_BLOCKS.deepest(wide(nc.library.attention)), TRITON_BLOCKS.deepest(wide(nc.library.biased_attention))
        (3, 2)
        """
        sizes = {a.name: a.size for w in p.diagram.dom.inside for a in w.axes}
        if not all(sizes[a].is_number for a in p.whole):
            return self.stages
        padded = {a: max(next_pow2(int(sizes[a])), self.smallest) for a in p.whole}
        fits = [n for n in range(self.stages, 1, -1) if smem_bytes(p, padded, n) <= hardware.smem_per_block]
        return fits[0] if fits else self.stages  # fitting no depth: launch refuses, naming the policy's footprint

    def space(self) -> tuple[TritonConfig, ...]:
        """The configs ``search=True`` times: ``search_warps`` × ``search_stages``.

        >>> len(TRITON_BLOCKS.space())
        4
        """
        return tuple(TritonConfig(num_warps=w, num_stages=s) for w in self.search_warps for s in self.search_stages)


#: the Triton backend's block policy
TRITON_BLOCKS = TritonBlocks()
