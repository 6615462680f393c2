"""The predicted time of a decode step: the bytes it moves over the DRAM bandwidth, plus the merge.

A decode step reads the cache once (each part its own keys) and computes little per byte, so its time is its
DRAM traffic over the bandwidth (FAN §4's memory-bound case), unless the rows per KV head (``Nq · H/H_kv``) make
the two products outweigh it (the roofline's other side). The kernel moves from DRAM:

* the keys and values each sequence's parts visit: its length rounded up to whole chunks, ``× H_kv × (D + Dv)``
  elements of the cache's dtype (chunks past a length are skipped, never read). Where a KV head's rows are cut
  into several row tiles (``⌈Nq · H/H_kv / rows per program⌉``), each tile's program streams the part's keys
  itself, but where every program runs at once (no more programs than SMs) the tiles of one part read the same
  chunks at about the same time and the L2 serves all but the first read (``l2_bytes``; ncu's DRAM counter
  agrees: `papers/flash_attention/results/decode_counters_NVIDIA_H200_stop48.json`); with more programs than SMs
  each tile's read is counted from DRAM. For MLA (``rope = R``: latent keys of ``D`` dims that are also the
  values, and ``R`` rotary dims) ``× (D + R)``: the latent chunk is read from DRAM once for both products (its
  second load is served by the L2);
* the queries, once per part, the page table (int32, paged caches), and each part's ``(o, lse)`` in f32;

and the merge (:func:`lowering._merge.merge`, one kernel) reads the parts' ``(o, lse)`` and writes the output. In
one part there is no merge: the kernel writes the output, in the cache's dtype, and its log-sum-exp.
The bandwidth is the GPU's measured device-copy rate where one was measured (``Hardware.ceiling("dram")``), else
its datasheet HBM rate. The compute rate is the measured dense matmul ceiling (else the datasheet's) times FAN's
tensor-core utilisation (:func:`napkin_cat.optimize.utilisation`) for the share of the softmax's exponentials not
hidden behind the products (``unhidden``): 1 where each warp runs the products and the softmax in turn, as the
Triton kernels do (two thirds of the ceiling at D = 128 in 16 bits), 0 where they overlap whole.

>>> c = decode_cost(batch=1, queries=1, heads=32, kv_heads=8, dim=128, lengths=[32768], parts=17)
>>> round(c.kernel_bytes / 1e6, 1), c.hardware
(134.6, 'H100')
>>> round(c.seconds * 1e6, 1)                      # 134 MB at 3.35 TB/s, plus the merge
40.3
>>> round(c.read_bytes / 1e6, 1)                   # the cache, the queries, the parts' (o, lse) read by the merge
134.6
>>> mla = decode_cost(batch=64, queries=1, heads=128, kv_heads=1, dim=512, rope=64, lengths=[4096] * 64, parts=2,
...                   chunk=64, table_width=64)       # DeepSeek-V3's absorbed MLA over pages of 64 keys
>>> round(mla.kernel_bytes / 1e6, 1), mla.bound          # 128 rows of 576 dims per key: past the ridge
(354.5, 'compute')
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from napkin_cat.dtypes import bf16, f16, f32
from napkin_cat.errors import CostError
from napkin_cat.hardware import HBM, L2, Hardware, lookup
from napkin_cat.optimize import utilisation

DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}


@dataclass(frozen=True)
class DecodeCost:
    """A decode step's traffic and work, and its predicted seconds on ``hardware``: ``max(kernel bytes /
    bandwidth, flops / compute rate) + merge bytes / bandwidth``.

    >>> c = DecodeCost(kernel_bytes=3_350_000, merge_bytes=0, flops=0, hardware="H100", bandwidth=3.35e12,
    ...                compute=1e15)
    >>> c.seconds, c.bound
    (1e-06, 'memory')
    """

    kernel_bytes: int
    merge_bytes: int
    flops: int
    hardware: str
    bandwidth: float
    compute: float
    #: of the bytes moved, those written (each part's ``(o, lse)``, the merged output): the rest are reads
    written_bytes: int = 0
    #: the row tiles' further reads of the cache that the L2 serves (not in ``kernel_bytes``)
    l2_bytes: int = 0

    @property
    def read_bytes(self) -> int:
        """The bytes the kernel and the merge read from DRAM (what ncu's ``dram__bytes_read.sum`` counts)."""
        return self.kernel_bytes + self.merge_bytes - self.written_bytes

    @property
    def kernel_seconds(self) -> float:
        """The kernel's time: its bytes over the bandwidth, or its flops over the compute rate where longer."""
        return max(self.kernel_bytes / self.bandwidth, self.flops / self.compute)

    @property
    def seconds(self) -> float:
        """The step's time: the kernel's and the merge's."""
        return self.kernel_seconds + self.merge_bytes / self.bandwidth

    @property
    def bound(self) -> str:
        """``"memory"`` or ``"compute"``: which side of the roofline the kernel sits on."""
        return "memory" if self.kernel_bytes / self.bandwidth >= self.flops / self.compute else "compute"


def decode_cost(
    *,
    batch: int,
    queries: int,
    heads: int,
    kv_heads: int,
    dim: int,
    lengths: Sequence[int],
    parts: int,
    chunk: int = 64,
    value_dim: int | None = None,
    dtype: str = "bfloat16",
    table_width: int = 0,
    rope: int = 0,
    row_tiles: int = 1,
    hardware: Hardware | str = "H100",
    unhidden: float = 1.0,
) -> DecodeCost:
    """The cost of one ``nc.decode_attention`` step (the module's docstring): ``batch`` sequences of ``lengths``
    valid keys, ``queries`` new tokens each, ``parts`` parts streamed in ``chunk``-key chunks; ``table_width``
    pages per sequence for a paged cache (0: contiguous); ``rope`` the rotary dims of an
    ``nc.mla_decode_attention`` step (``dim`` its latent dims, which are also the values'; 0: not MLA);
    ``row_tiles`` the programs a KV head's rows are cut into, each reading the cache (``lowering._decode.row_tiles``);
    ``unhidden`` the share of the softmax not hidden behind the products (1: Triton's kernels).

    >>> [(c.kernel_bytes // 2**20, c.l2_bytes // 2**20) for c in (decode_cost(batch=1, queries=64, heads=32,
    ...  kv_heads=8, dim=128, lengths=[32768], parts=n, row_tiles=t) for n, t in ((4, 1), (4, 2), (8, 2), (16, 2)))]
    [(134, 0), (134, 128), (140, 128), (280, 0)]
    >>> [round(decode_cost(batch=1, queries=64, heads=32, kv_heads=8, dim=128, lengths=[32768], parts=8,
    ...                    unhidden=u).kernel_seconds * 1e6) for u in (1.0, 0.0)]   # compute-bound: 256 rows per head
    [70, 47]
    >>> [decode_cost(batch=4, queries=nq, heads=64, kv_heads=8, dim=128, lengths=[4096] * 4, parts=4,
    ...              table_width=64).bound for nq in (1, 64)]   # 8 or 512 rows per KV head
    ['memory', 'compute']
    >>> decode_cost(batch=2, queries=1, heads=4, kv_heads=2, dim=16, lengths=[8], parts=1)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: decode_cost: 1 lengths for a batch of 2
    """
    if len(lengths) != batch:
        raise CostError(f"decode_cost: {len(lengths)} lengths for a batch of {batch}")
    if not isinstance(row_tiles, int) or row_tiles < 1:
        raise CostError(f"decode_cost: row_tiles must be a positive integer (programs per KV head), got {row_tiles!r}")
    if dtype not in DTYPES:
        raise CostError(f"decode_cost: dtype {dtype!r} is none of {', '.join(DTYPES)}")
    hw, dt, dv = lookup(hardware), DTYPES[dtype], dim if value_dim is None else value_dim
    keys = sum(-(-int(n) // chunk) * chunk for n in lengths)
    once = keys * kv_heads * ((dim + rope) if rope else (dim + dv)) * dt.bytes  # MLA: the values are the keys
    together = batch * kv_heads * parts * row_tiles <= hw.sms  # every program at once: the L2 serves later tiles
    cache, l2 = (once, once * (row_tiles - 1)) if together else (once * row_tiles, 0)
    output = batch * queries * heads * (dv * dt.bytes + 4)  # the step's output and its log-sum-exp
    # each part's (o, lse) in f32, which the merge reads; in one part the kernel writes the output itself
    partial = batch * parts * queries * heads * (dv + 1) * 4 if parts > 1 else output
    kernel = cache + batch * parts * queries * heads * (dim + rope) * dt.bytes + batch * table_width * 4 + partial
    merge = partial + output if parts > 1 else 0
    flops = 2 * queries * heads * (dim + rope + dv) * sum(int(n) for n in lengths)
    bandwidth = hw.ceiling("dram") or hw.bandwidth(L2, outer=HBM)
    tensor = dt.name in dict(hw.flop_per_clk)  # f32 has no tensor-core rate: its products are the bound alone
    compute = (hw.ceiling(dt.name) or hw.flops(dt)) * (utilisation(hw, unhidden, dim + rope, dt) if tensor else 1.0)
    return DecodeCost(kernel, merge, flops, hw.name, bandwidth, compute, partial + (merge and output), l2)
