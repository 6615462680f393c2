"""Optimisation on the performance model: thresholds, tile budgets and throughput (FAN §4–5).

Everything here takes a :class:`~napkin_cat.hardware.Hardware` model and computes the paper's numbers from
its constants (rows 3–17 of papers/flash_attention_on_a_napkin/table.md). Transfers are counted in *values*; a
dtype turns bytes/s into values/s.

The central quantity is ``r``, the values a level can receive per FLOP at peak compute. An algorithm is
compute-bound at a level when its transfers per FLOP stay below ``r``.

>>> from napkin_cat.hardware import H100
>>> round(attention_threshold(H100), 1)           # g_q ≥ 295 (row 11 of papers/flash_attention_on_a_napkin/table.md)
295.2
>>> round(matmul_min_memory(H100) / KiB)          # ≈ 681 KB of L2 (row 12)
681
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import sympy

from napkin_cat._cost import ZERO, Cost
from napkin_cat.dtypes import Dtype, f16, f32, fp8_e4m3
from napkin_cat.errors import CostError
from napkin_cat.hardware import Hardware, KiB
from napkin_cat.levels import HBM, L2, REG, SMEM, Level


def values_per_flop(hw: Hardware, inner: Level = L2, dtype: Dtype = f16, outer: Level | None = None) -> float:
    """``r``: values of ``dtype`` moved into ``inner`` per FLOP at ``dtype``'s peak rate.

    >>> from napkin_cat.hardware import H100
    >>> round(values_per_flop(H100) * 1e3, 4)        # 3.35e12 B/s ÷ 2 B ÷ 989e12 FLOP/s
    1.6936
    """
    return hw.bandwidth(inner, outer) / dtype.bytes / hw.flops(dtype)


def matmul_threshold(
    hw: Hardware, inner: Level = L2, dtype: Dtype = f16, memory: int | None = None, outer: Level | None = None
) -> float:
    """Smallest contraction size ``b`` for which a tiled matmul is compute-bound at ``inner``.

    Square tiles transfer ``M^-1/2 + (2b)^-1`` values per FLOP (row 3 of
    papers/flash_attention_on_a_napkin/table.md), so the matmul is compute-bound when
    ``b ≥ 1 / (2 (r − M^-1/2))``. ``memory`` is the level's capacity in bytes (``None``: unlimited, the M → ∞
    bound).

    >>> from napkin_cat.hardware import H100
    >>> round(matmul_threshold(H100), 1)                                  # row 11: 295
    295.2
    >>> round(matmul_threshold(H100, SMEM), 1)                            # row 13: 82 (M → ∞)
    82.4
    >>> round(matmul_threshold(H100, SMEM, memory=H100.l1_smem_per_sm))   # row 13: 151 at 256 KiB
    151
    >>> matmul_threshold(H100, L2, memory=256 * KiB)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: matmul at L2 of H100 is never compute-bound with 262144 B: needs M > 1/r² = 348629 ...
    """
    r = values_per_flop(hw, inner, dtype, outer)
    tiles = 0.0 if memory is None else (memory / dtype.bytes) ** -0.5
    if tiles >= r:
        raise CostError(
            f"matmul at {inner.name} of {hw.name} is never compute-bound with {memory} B: "
            f"needs M > 1/r² = {math.ceil(r**-2)} {dtype.name} values"
        )
    return 1 / (2 * (r - tiles))


def matmul_min_memory(hw: Hardware, inner: Level = L2, dtype: Dtype = f16, outer: Level | None = None) -> float:
    """Bytes ``inner`` must hold for a matmul to be compute-bound at all: ``M > 1/r²`` values (row 12).

    >>> from napkin_cat.hardware import H100
    >>> round(matmul_min_memory(H100) / f16.bytes)                       # 348,629 values
    348629
    """
    return values_per_flop(hw, inner, dtype, outer) ** -2 * dtype.bytes


def attention_threshold(hw: Hardware, inner: Level = L2, dtype: Dtype = f16, outer: Level | None = None) -> float:
    """Smallest query group ``g_q`` for which tiled attention is compute-bound at ``inner``.

    Attention transfers ``2qd + 2xdq/g_q`` values for ``4qxd`` FLOPs (row 4); for long keys the ratio
    tends to ``1/(2 g_q)``, so ``g_q ≥ 1/(2r)`` (row 11).

    >>> from napkin_cat.hardware import A100, A100_40GB
    >>> round(attention_threshold(A100), 1), round(attention_threshold(A100_40GB), 1)
    (153.0, 200.6)
    """
    return 1 / (2 * values_per_flop(hw, inner, dtype, outer))


def quantization_gain(beta: float, factor: float = 2) -> float:
    """Transfer-time gain from storing values in ``1/factor`` the bytes (row 10 of
    papers/flash_attention_on_a_napkin/table.md).

    Bytes moved scale as ``q^(1+β)``: ``q`` per value, and ``M`` holds ``1/q`` times more values, which
    cuts the values moved by ``q^β``. Halving ``q``: attention (β = 1) ×4, matmul (β = 1/2) ×2.83.

    >>> quantization_gain(1), round(quantization_gain(0.5), 2)
    (4.0, 2.83)
    """
    return float(factor) ** (1 + beta)


@dataclass(frozen=True)
class WarpgroupBudget:
    """Per-SM memory one Hopper thread block needs, in bytes (FAN §5; row 14 of
    papers/flash_attention_on_a_napkin/table.md).

    ``block_smem`` is shared by the block (the streamed K, V chunks, all pipeline stages);
    ``warpgroup_smem`` and ``warpgroup_regs`` are needed again for every consumer warpgroup.

    >>> b = WarpgroupBudget(block_smem=48 * KiB, warpgroup_smem=48 * KiB, warpgroup_regs=64 * KiB)
    >>> b == fan_hopper_budget(warpgroup_regs=64 * KiB)
    True
    """

    block_smem: int
    warpgroup_smem: int
    warpgroup_regs: int


def fan_hopper_budget(
    w_q: int = 128,
    s_x: int = 64,
    d: int = 128,
    stages: int = 2,
    qk: Dtype = fp8_e4m3,
    pv: Dtype = f16,
    warpgroup_regs: int = round(74.75 * KiB),
) -> WarpgroupBudget:
    """FAN's Hopper configuration: w_q = 128 queries per warpgroup, s_x = 64 keys per chunk, d = 128.

    SMEM per block: ``stages`` buffers of the K chunk (``qk``) and the V chunk (``pv``):
    2 · 64 · 128 · (1 + 2) B = 48 KiB. SMEM per warpgroup: its Q tile (``qk``) and its output tile
    (``pv``): 128 · 128 · (1 + 2) B = 48 KiB. The register budget per warpgroup is the paper's
    74.75 KiB (row 14 of papers/flash_attention_on_a_napkin/table.md): the live register arrays we can
    account for (the f32 O accumulator, 64 KiB; P in FP8, 8 KiB; row max and sum in f32, 1 KiB) give 73 KiB.

    >>> b = fan_hopper_budget()
    >>> b.block_smem // KiB, b.warpgroup_smem // KiB, b.warpgroup_regs
    (48, 48, 76544)
    """
    return WarpgroupBudget(
        block_smem=stages * s_x * d * (qk.bytes + pv.bytes),
        warpgroup_smem=w_q * d * (qk.bytes + pv.bytes),
        warpgroup_regs=warpgroup_regs,
    )


def max_warpgroups(capacity: float, block: float, warpgroup: float) -> float:
    """``N_max = (M_max − M_TB) / M_WG``: warpgroups whose memory fits beside the block's.

    >>> max_warpgroups(227, 48, 48)
    3.7291666666666665
    """
    return (capacity - block) / warpgroup


@dataclass(frozen=True)
class HopperConfiguration:
    """Warpgroups per SM allowed by SMEM and by registers, the integer choice, and ``g_q``.

    >>> from napkin_cat.hardware import H100
    >>> c = hopper_configuration(H100)
    >>> c.warpgroups, c.g_q, c.warpgroups == math.floor(min(c.n_smem, c.n_regs))
    (3, 384, True)
    """

    n_smem: float
    n_regs: float
    warpgroups: int
    g_q: int


def hopper_configuration(hw: Hardware, budget: WarpgroupBudget | None = None, w_q: int = 128) -> HopperConfiguration:
    """FAN's warpgroup count for one thread block per SM (row 14 of papers/flash_attention_on_a_napkin/table.md).

    SMEM: ``(227 KiB − 48 KiB) / 48 KiB = 3.7``; registers: ``256 KiB / 74.75 KiB = 3.4``; so 3 consumer
    warpgroups of ``w_q = 128`` queries, ``g_q = 384``.

    >>> from napkin_cat.hardware import H100
    >>> c = hopper_configuration(H100)
    >>> round(c.n_smem, 2), round(c.n_regs, 2), c.warpgroups, c.g_q
    (3.73, 3.42, 3, 384)
    """
    budget = budget or fan_hopper_budget(w_q=w_q)
    n_smem = max_warpgroups(hw.smem_per_block, budget.block_smem, budget.warpgroup_smem)
    n_regs = max_warpgroups(hw.capacity(REG), 0, budget.warpgroup_regs)
    warpgroups = math.floor(min(n_smem, n_regs))
    if warpgroups < 1:
        raise CostError(
            f"no warpgroup fits on {hw.name}: SMEM allows {n_smem:.2f}, registers allow {n_regs:.2f} "
            f"(block SMEM {budget.block_smem} B, per warpgroup {budget.warpgroup_smem} B SMEM, "
            f"{budget.warpgroup_regs} B registers)"
        )
    return HopperConfiguration(n_smem, n_regs, warpgroups, warpgroups * w_q)


@dataclass(frozen=True)
class ChunkTiming:
    """Per-SM time to compute on one KV chunk, time to stream it in, and the resulting device FLOP/s.

    >>> t = ChunkTiming(compute=2e-6, transfer=1e-6, flops=1e15)
    >>> t.compute_bound
    True
    """

    compute: float
    transfer: float
    flops: float

    @property
    def compute_bound(self) -> bool:
        """Whether computing on a chunk takes at least as long as streaming it in.

        >>> ChunkTiming(compute=1e-6, transfer=2e-6, flops=5e14).compute_bound
        False
        """
        return self.compute >= self.transfer


def kv_chunk_timing(
    hw: Hardware, g_q: int = 384, s_x: int = 64, d: int = 128, qk: Dtype = fp8_e4m3, pv: Dtype = f16
) -> ChunkTiming:
    """Compute vs transfer per KV chunk, every SM working on its own ``g_q`` queries (row 16).

    Compute: ``2 g_q s_x d`` FLOPs of QKᵀ at ``qk``'s and as many of PV at ``pv``'s per-SM tensor rate,
    in clocks. Transfer: every SM streams its K (``qk``) and V (``pv``) chunk from HBM, all SMs sharing
    the HBM bandwidth. Throughput: all SMs' FLOPs over the slower of the two.

    >>> from napkin_cat.hardware import H100
    >>> t = kv_chunk_timing(H100)
    >>> round(t.compute * 1e6, 3), round(t.transfer * 1e6, 3), round(t.flops / 1e15, 3), t.compute_bound
    (1.259, 0.968, 1.319, True)
    """
    matmul = 2 * g_q * s_x * d
    clocks = matmul / hw.flops_per_clk(qk) + matmul / hw.flops_per_clk(pv)
    compute = clocks / hw.clock
    transfer = hw.sms * s_x * d * (qk.bytes + pv.bytes) / hw.bandwidth(SMEM, outer=HBM)
    return ChunkTiming(compute, transfer, hw.sms * 2 * matmul / max(compute, transfer))


def softmax_matmul_ratio(hw: Hardware, d: int = 128, dtype: Dtype = f16) -> float:
    """SFU clocks for the exponentials over tensor-core clocks for the two matmuls, per KV chunk.

    A chunk of ``g s`` scores needs ``g s`` exponentials and ``4 g s d`` matmul FLOPs, so the ratio is
    ``flop_per_clk / (4 d exp_per_clk)``: 0.5 at FP16 and 1 at FP8 on Hopper with d = 128.

    >>> from napkin_cat.hardware import H100
    >>> softmax_matmul_ratio(H100), softmax_matmul_ratio(H100, dtype=fp8_e4m3)
    (0.5, 1.0)
    """
    return hw.flops_per_clk(dtype) / (4 * d * hw.exp_per_clk)


def utilisation(hw: Hardware, overhead: float, d: int = 128, dtype: Dtype = f16) -> float:
    """Tensor-core utilisation when ``overhead`` of the softmax time is not hidden behind matmuls (row 17).

    ``u = 1 / (1 + overhead · softmax/matmul)``: FAN's 66% gives 75% at FP16 and 60% at FP8.

    >>> from napkin_cat.hardware import H100
    >>> round(utilisation(H100, 0.66), 3), round(utilisation(H100, 0.66, dtype=fp8_e4m3), 3)
    (0.752, 0.602)
    """
    return 1 / (1 + overhead * softmax_matmul_ratio(hw, d, dtype))


def fit_softmax_overhead(hw: Hardware, measured: float, d: int = 128, dtype: Dtype = f16) -> float:
    """The unhidden softmax fraction that explains a measured utilisation (inverse of :func:`utilisation`).

    >>> from napkin_cat.hardware import H100
    >>> round(fit_softmax_overhead(H100, 740e12 / H100.flops(f16)), 3)      # FA3 at FP16: 740 TFLOP/s
    0.673
    """
    return (1 / measured - 1) / softmax_matmul_ratio(hw, d, dtype)


@dataclass(frozen=True)
class WarpCount:
    """Ampere warps per SM: needed to be compute-bound vs what FlashAttention's tiles give (FAN v1).

    >>> from napkin_cat.hardware import A100_40GB
    >>> w = ampere_warps(A100_40GB)
    >>> w.needed > w.flash, w.flash_rows // 16 == w.flash
    (True, True)
    """

    g_q_min: float
    needed: int
    flash_rows: int
    flash: int
    register_limit: int


def ampere_warps(hw: Hardware, d: int = 128, dtype: Dtype = f16, rows_per_warp: int = 16) -> WarpCount:
    """Re-derive FAN v1's "13 warps per SM (FlashAttention fits 8)" for an Ampere model.

    Assumptions (FAN v1's derivation was not recovered; these reproduce both numbers):

    1. On Ampere each warp's ``mma.m16n8k16`` owns ``rows_per_warp = 16`` query rows, so a query group
       ``g_q`` takes ``g_q / 16`` warps, each SM running one group at a time.
    2. Needed: attention is compute-bound when ``g_q ≥ 1/(2r)`` (:func:`attention_threshold`, HBM → SMEM,
       FP16), i.e. ``⌈g_q_min / 16⌉`` warps. This gives 13 with the A100-40GB's 1,555 GB/s; the 80 GB
       part's 2,039 GB/s lowers it to 10.
    3. Fits: FlashAttention's query block ``B_r = min(⌈M / 4d⌉, d)`` (Dao et al. 2022, Alg. 1; ``M`` the
       SMEM of one SM in values) is 128 rows for ``d = 128``: 8 warps. Independently, at the 255
       registers per thread such kernels use, 64K registers hold ``⌊65536 / (255 · 32)⌋ = 8`` warps.

    >>> from napkin_cat.hardware import A100, A100_40GB
    >>> w = ampere_warps(A100_40GB)
    >>> w.needed, w.flash, w.register_limit
    (13, 8, 8)
    >>> ampere_warps(A100).needed
    10
    """
    g_q_min = attention_threshold(hw, SMEM, dtype, outer=HBM)
    smem_values = hw.capacity(SMEM) // dtype.bytes
    flash_rows = min(math.ceil(smem_values / (4 * d)), d)
    registers = hw.capacity(REG) // f32.bytes
    return WarpCount(
        g_q_min=g_q_min,
        needed=math.ceil(g_q_min / rows_per_warp),
        flash_rows=flash_rows,
        flash=flash_rows // rows_per_warp,
        register_limit=registers // (hw.max_regs_per_thread * hw.warp_size),
    )


def best_tiles(
    c: Cost, choices: Mapping[str, Iterable[int]], level: Level = SMEM, capacity: float | None = None, **sizes
) -> tuple[dict[str, int], Cost]:
    """FAN's tile choice: the labels that fit ``level``'s memory with the fewest transfers into it.

    ``c`` is a cost with symbolic partition sizes; ``choices`` lists candidate values per symbol name;
    ``capacity`` is in bytes (default: the hardware's, per block for SMEM); ``sizes`` bind the other
    sizes. Ties go to the larger memory (the largest group that fits). Returns the labels and the
    bound cost.

    >>> import sympy, napkin_cat as nc
    >>> from napkin_cat._cost import cost
    >>> from napkin_cat.hardware import H100
    >>> q, x, d = nc.axes("q x d", d=128)
    >>> g = sympy.Symbol("g", positive=True, integer=True)
    >>> kernel = nc.library.attention(q, x, d, dtype=nc.bf16).map_arrays(
    ...     lambda w: w.with_(axes=[a.tiled(g) if a.name == "q" else a.streamed(64) if a.name == "x" else a
    ...                             for a in w.axes]))
    >>> labels, bound = best_tiles(cost(kernel, H100), {"g": [64, 128, 256, 512]}, q=8192, x=8192)
    >>> labels, int(bound.memory_bytes[SMEM])
    ({'g': 256}, 147456)
    """
    bound = c.subs(**sizes)
    names = list(choices)
    symbols = [sympy.Symbol(n, positive=True, integer=True) for n in names]
    hw = bound.hardware
    if capacity is None:
        if hw is None:
            raise CostError("best_tiles needs a capacity in bytes or a cost with a hardware model")
        capacity = hw.smem_per_block if level == SMEM else hw.capacity(level)
    memory = bound.memory_bytes.get(level, ZERO)
    transfers = bound.transfers.get(level, ZERO)
    free = (memory.free_symbols | transfers.free_symbols) - set(symbols)
    if free:
        raise CostError(f"best_tiles at {level.name}: bind the sizes {', '.join(sorted(map(str, free)))}")
    mem, moved = sympy.lambdify(symbols, memory), sympy.lambdify(symbols, transfers)
    fits = [v for v in itertools.product(*choices.values()) if mem(*v) <= capacity]
    if not fits:
        smallest = min(mem(*v) for v in itertools.product(*choices.values()))
        raise CostError(
            f"no tiles fit {level.name}: the smallest candidate needs {smallest:.0f} B, capacity {capacity:.0f} B"
        )
    best = min(fits, key=lambda v: (moved(*v), -mem(*v)))
    labels = dict(zip(names, map(int, best), strict=True))
    return labels, bound.subs(**labels)
