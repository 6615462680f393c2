"""Hardware models: GPUs as data (FAN §4–5; papers/flash_attention_on_a_napkin/table.md; the GPUs' datasheets).

A :class:`Hardware` is a frozen record of a GPU's memory hierarchy (:class:`Memory` per level, each with
its capacity and the bandwidth *into* it from the next outer level), its compute rates by dtype, and the
per-SM limits the performance model needs. Derived figures (clock, bandwidth along a path) are computed
from those constants, never typed in.

>>> H100.sms, H100.memory(SMEM).capacity, H100.smem_per_block
(132, 233472, 232448)
>>> round(H100.clock / 1e9, 3)                    # FAN's row 15: 1979e12 / (132 · 8192)
1.83
>>> H100.bandwidth(SMEM)                          # L2 → SMEM (FAN: 6.0e12 values/s at 2 B)
12000000000000.0
>>> H100.bandwidth(SMEM, outer=HBM)              # HBM → SMEM is limited by its slowest link
3350000000000.0
>>> H200.bandwidth(L2), H200.memory(HBM).capacity == 141 * 10**9
(4800000000000.0, True)

L2 is a level of every model: its capacity (what the cost functor's DRAM model fits working sets into)
and the bandwidth into it from HBM (DRAM traffic); the bandwidth out of it into the SMs is SMEM's:

>>> [(h.name, h.capacity(L2) // MiB, h.bandwidth(L2) / 1e12, round(h.bandwidth(SMEM) / 1e12, 2)) for h in HARDWARE]
[('A100', 40, 2.039, 7.22), ('A100-40GB', 40, 1.555, 7.22), ('H100', 50, 3.35, 12.0), ('H200', 60, 4.8, 12.0)]
>>> from napkin_cat.dtypes import bf16, f16, fp8_e4m3
>>> A100.flops(f16) / 1e12, H100.flops(fp8_e4m3) / 1e12
(312.0, 1979.0)

A user-defined model is the same record; :func:`dataclasses.replace` derives variants:

>>> from dataclasses import replace
>>> slow = replace(H100, name="H100-slow", memories=H100.with_bandwidth(L2, 2e12))
>>> slow.bandwidth(SMEM, outer=HBM), slow.clock == H100.clock
(2000000000000.0, True)
>>> A100_40GB.bandwidth(L2)
1555000000000.0

Past one chip the device is a level too (docs/multi_device.md): a :class:`System` is
``devices`` copies of a GPU joined by an :class:`Interconnect` (NVLink), with per-device memory the GPU's HBM:

>>> H200_X2.devices, H200_X2.memory_per_device == 141 * GB, H200_X2.link.bandwidth / 1e9
(2, True, 450.0)
>>> round(H200_X2.transfer_time(64 * MiB) * 1e6, 1)    # one 64 MiB chunk over one link: latency + bytes / bandwidth
154.1
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from napkin_cat.dtypes import Dtype
from napkin_cat.errors import CostError
from napkin_cat.levels import HBM, L2, REG, SMEM, Level

KiB = 1024
MiB = 1024 * KiB
GB = 10**9


@dataclass(frozen=True)
class Memory:
    """One memory level of a GPU.

    ``capacity`` is in bytes, per SM when ``per_sm`` (SMEM, registers) and device-wide otherwise (HBM, L2).
    ``bandwidth`` is bytes/s moved into this level from the next outer level of the hardware, summed over
    the whole device; ``None`` for the outermost level.

    >>> Memory(SMEM, 228 * KiB, per_sm=True, bandwidth=12e12).capacity
    233472
    """

    level: Level
    capacity: int
    per_sm: bool
    bandwidth: float | None


@dataclass(frozen=True)
class Hardware:
    """A GPU model: memory levels (outermost first), compute rates and per-SM limits.

    ``flop_rates`` are dense peak FLOP/s by dtype name (tensor cores for 16- and 8-bit types, CUDA cores
    for f32); ``flop_per_clk`` are per-SM FLOP per clock for the tensor-core dtypes, from which the clock
    is derived. ``exp_per_clk`` is the SFU rate (exponentials per SM per clock), ``alu16_per_clk`` the
    non-tensor FP16 rate (FLOP per SM per clock), ``smem_bytes_per_clk`` the SMEM → register bandwidth
    per SM. ``ceilings`` are rates measured on the GPU (:meth:`ceiling`), which the cost model's predicted
    time (``Cost.time_serial``) prefers to the datasheet's. ``l2_partitions`` is how many halves L2 is split
    into (:attr:`l2_shared_capacity`). Occupancy limits (CUDA C++ Programming Guide, compute capability 8.0
    and 9.0 tables and its note on shared memory; CUDA Occupancy Calculator): ``max_blocks_per_sm`` resident
    blocks (32), ``smem_reserved_per_block`` bytes of an SM's shared memory the system keeps per resident block
    (1 KB: why 227 KB of 228 KB are a block's maximum), ``reg_alloc_unit`` registers a warp's allocation is
    rounded up to (256).

    >>> [m.level for m in H100.memories]
    [HBM, L2, SMEM, REG]
    """

    name: str
    sms: int
    memories: tuple[Memory, ...]
    flop_rates: tuple[tuple[str, float], ...]
    flop_per_clk: tuple[tuple[str, int], ...]
    exp_per_clk: int
    alu16_per_clk: int
    smem_per_block: int
    l1_smem_per_sm: int
    max_warps_per_sm: int
    max_regs_per_thread: int
    warp_size: int = 32
    ceilings: tuple[tuple[str, float], ...] = ()
    l2_partitions: int = 1
    max_blocks_per_sm: int = 32
    smem_reserved_per_block: int = 1 * KiB
    reg_alloc_unit: int = 256

    @property
    def regs_per_sm(self) -> int:
        """32-bit registers per SM: the REG level's capacity in 4-byte words.

        >>> H100.regs_per_sm
        65536
        """
        return self.capacity(REG) // 4

    @property
    def l2_shared_capacity(self) -> int:
        """Bytes of L2 that data read by SMs all over the chip can occupy: one partition's share.

        A100 and GH100 split L2 into ``l2_partitions`` halves, each caching the accesses of the SMs
        wired to it, so a line read from both sides is held twice (see the models' sources).

        >>> H100.l2_shared_capacity // MiB, replace(H100, l2_partitions=1).l2_shared_capacity // MiB
        (25, 50)
        """
        return self.capacity(L2) // self.l2_partitions

    def ceiling(self, what: str) -> float | None:
        """A measured ceiling, where one was measured on this GPU: a dtype's name (dense tensor-core FLOP/s
        of a large matmul) or ``"dram"`` (device-copy bytes/s, read + write); None where there is none, and
        the cost model's serial time then uses the datasheet rate.

        >>> H100.ceiling("bf16") / 1e12, H100.ceiling("dram"), H200.ceiling("dram") / 1e12
        (733.0, None, 4.1)
        """
        return dict(self.ceilings).get(what)

    def memory(self, level: Level) -> Memory:
        """The :class:`Memory` at ``level``; a :class:`CostError` naming the level if there is none.

        >>> H100.memory(REG).capacity
        262144
        >>> from napkin_cat.levels import TC
        >>> H100.memory(TC)
        Traceback (most recent call last):
        ...
        napkin_cat.errors.CostError: hardware H100 has no memory level TC; its levels: HBM, L2, SMEM, REG
        """
        for m in self.memories:
            if m.level == level:
                return m
        levels = ", ".join(m.level.name for m in self.memories)
        raise CostError(f"hardware {self.name} has no memory level {level.name}; its levels: {levels}")

    def capacity(self, level: Level) -> int:
        """Bytes available at ``level`` to one SM (per-SM levels) or to the device (HBM, L2).

        >>> A100.capacity(SMEM) // KiB
        164
        """
        return self.memory(level).capacity

    def bandwidth(self, inner: Level, outer: Level | None = None) -> float:
        """Bytes/s between ``outer`` (default: the next outer level) and ``inner``, device-wide.

        A move that skips levels is limited by the slowest link it crosses.

        >>> H100.bandwidth(REG) > H100.bandwidth(SMEM) > H100.bandwidth(L2)
        True
        """
        self.memory(inner)
        if outer is not None:
            self.memory(outer)
        if outer is not None and outer >= inner:
            raise CostError(f"bandwidth from {outer.name} to {inner.name}: {outer.name} is not outside {inner.name}")
        links = [m for m in self.memories if (outer is None or m.level > outer) and m.level <= inner]
        if outer is None:
            links = links[-1:]
        if any(m.bandwidth is None for m in links):
            raise CostError(f"hardware {self.name} has no level outside {inner.name} to transfer from")
        return min(m.bandwidth for m in links)

    def flops(self, dtype: Dtype) -> float:
        """Dense peak FLOP/s for operands of ``dtype``.

        >>> from napkin_cat.dtypes import fp8_e4m3
        >>> A100.flops(fp8_e4m3)
        Traceback (most recent call last):
        ...
        napkin_cat.errors.CostError: hardware A100 has no compute rate for fp8_e4m3; rates for: f16, bf16, f32, tf32
        """
        rates = dict(self.flop_rates)
        if dtype.name not in rates:
            raise CostError(f"hardware {self.name} has no compute rate for {dtype.name}; rates for: {', '.join(rates)}")
        return rates[dtype.name]

    def flops_per_clk(self, dtype: Dtype) -> int:
        """Tensor-core FLOP per SM per clock for ``dtype`` (row 15 of papers/flash_attention_on_a_napkin/table.md).

        >>> from napkin_cat.dtypes import bf16, fp8_e4m3
        >>> H100.flops_per_clk(fp8_e4m3), H100.flops_per_clk(bf16)
        (8192, 4096)
        """
        per_clk = dict(self.flop_per_clk)
        if dtype.name not in per_clk:
            raise CostError(f"hardware {self.name} has no per-clock tensor rate for {dtype.name}")
        return per_clk[dtype.name]

    @property
    def clock(self) -> float:
        """Tensor-core clock in Hz: the fastest dense rate ÷ (SMs × FLOP per SM per clock).

        >>> round(A100.clock / 1e9, 2)
        1.41
        """
        name, per_clk = max(self.flop_per_clk, key=lambda item: dict(self.flop_rates)[item[0]])
        return dict(self.flop_rates)[name] / (self.sms * per_clk)

    def with_bandwidth(self, level: Level, bandwidth: float) -> tuple[Memory, ...]:
        """The memories with the bandwidth into ``level`` replaced (for :func:`dataclasses.replace`).

        >>> H100.with_bandwidth(L2, 4.8e12)[1].bandwidth
        4800000000000.0
        """
        self.memory(level)
        return tuple(replace(m, bandwidth=bandwidth) if m.level == level else m for m in self.memories)

    def with_capacity(self, level: Level, capacity: int) -> tuple[Memory, ...]:
        """The memories with the capacity of ``level`` replaced (for :func:`dataclasses.replace`).

        >>> H100.with_capacity(HBM, 141 * GB)[0].capacity
        141000000000
        """
        self.memory(level)
        return tuple(replace(m, capacity=capacity) if m.level == level else m for m in self.memories)


# --- NVIDIA A100 SXM4 80GB -------------------------------------------------------------------------
# Sources: NVIDIA A100 datasheet (80GB SXM) and "NVIDIA A100 Tensor Core GPU Architecture" whitepaper
# (2020); CUDA C++ Programming Guide, compute capability 8.0 table; NVIDIA's A100 datasheet.
_A100_FP16 = 312e12  # datasheet: FP16/BF16 tensor, dense
_A100_CLOCK = _A100_FP16 / (108 * 2048)  # whitepaper: 1024 dense FP16 FMA/clk/SM → 1.41 GHz boost
A100 = Hardware(
    name="A100",
    sms=108,  # whitepaper: 108 SMs enabled on A100
    memories=(
        Memory(HBM, 80 * GB, per_sm=False, bandwidth=None),  # datasheet: 80 GB HBM2e
        Memory(L2, 40 * MiB, per_sm=False, bandwidth=2.039e12),  # datasheet: 2,039 GB/s HBM; 40 MB L2
        # whitepaper: L2 read bandwidth 5120 B/clk
        Memory(SMEM, 164 * KiB, per_sm=True, bandwidth=5120 * _A100_CLOCK),  # CUDA guide cc 8.0: 164 KB/SM
        # CUDA guide: 64K 32-bit registers/SM; SMEM delivers 32 banks × 4 B per clock per SM
        Memory(REG, 256 * KiB, per_sm=True, bandwidth=128 * 108 * _A100_CLOCK),
    ),
    # datasheet (f32: CUDA cores; tf32: tensor cores, 312 TFLOP/s with sparsity, dense half)
    flop_rates=(("f16", _A100_FP16), ("bf16", _A100_FP16), ("f32", 19.5e12), ("tf32", 156e12)),
    flop_per_clk=(("f16", 2048), ("bf16", 2048)),  # whitepaper: 1024 dense FP16 FMA per SM per clock
    exp_per_clk=16,  # whitepaper: 4 SFUs per SM sub-partition × 4 sub-partitions
    alu16_per_clk=512,  # datasheet: 78 TFLOP/s non-tensor FP16 = 108 × 512 × 1.41 GHz
    smem_per_block=163 * KiB,  # CUDA guide cc 8.0: 163 KB max per block (opt-in)
    l1_smem_per_sm=192 * KiB,  # whitepaper: 192 KB combined L1/shared memory per SM
    max_warps_per_sm=64,  # CUDA guide cc 8.0: 2048 threads per SM
    max_regs_per_thread=255,  # CUDA guide: 255 registers per thread
    # whitepaper, "L2 Cache": "The L2 cache is divided into two partitions [...] Each L2 partition localizes
    # and caches data for memory accesses from SMs in the GPCs directly connected to the partition."
    l2_partitions=2,
)

# --- NVIDIA H100 SXM5 80GB -------------------------------------------------------------------------
# Sources: NVIDIA H100 datasheet (SXM5) and "NVIDIA H100 Tensor Core GPU Architecture" whitepaper (2022);
# CUDA C++ Programming Guide, compute capability 9.0 table; FAN §4–5 (rows 13–15 of
# papers/flash_attention_on_a_napkin/table.md).
_H100_FP8 = 1979e12  # datasheet: FP8 tensor, dense (3,958 with sparsity)
_H100_CLOCK = _H100_FP8 / (132 * 8192)  # row 15 of papers/flash_attention_on_a_napkin/table.md: 1.830 GHz
H100 = Hardware(
    name="H100",
    sms=132,  # whitepaper: 132 SMs on H100 SXM5
    memories=(
        Memory(HBM, 80 * GB, per_sm=False, bandwidth=None),  # datasheet: 80 GB HBM3
        Memory(L2, 50 * MiB, per_sm=False, bandwidth=3.35e12),  # datasheet: 3.35 TB/s HBM; 50 MB L2
        Memory(SMEM, 228 * KiB, per_sm=True, bandwidth=12.0e12),  # CUDA guide cc 9.0; FAN: 6.0e12 values/s × 2 B
        Memory(REG, 256 * KiB, per_sm=True, bandwidth=128 * 132 * _H100_CLOCK),  # 64K regs; 128 B/clk SMEM
    ),
    flop_rates=(
        ("f16", 989e12),  # datasheet: FP16/BF16 tensor 1,979 TFLOP/s with sparsity, dense half
        ("bf16", 989e12),
        ("fp8_e4m3", _H100_FP8),
        ("fp8_e5m2", _H100_FP8),
        ("f32", 67e12),  # datasheet: FP32 (CUDA cores)
        ("tf32", 494.5e12),  # datasheet: TF32 tensor 989 TFLOP/s with sparsity, dense half
    ),
    flop_per_clk=(("f16", 4096), ("bf16", 4096), ("fp8_e4m3", 8192), ("fp8_e5m2", 8192)),  # FAN row 15
    exp_per_clk=16,  # FAN (row 15 of papers/flash_attention_on_a_napkin/table.md): SFU exp 16/clk per SM
    alu16_per_clk=512,  # FAN (row 15 of papers/flash_attention_on_a_napkin/table.md): FP16 ALU 512/clk per SM
    smem_per_block=227 * KiB,  # CUDA guide cc 9.0: 227 KB max per block (232,448 B, the sm_90 opt-in limit)
    l1_smem_per_sm=256 * KiB,  # whitepaper: 256 KB combined L1/shared memory per SM
    max_warps_per_sm=64,  # CUDA guide cc 9.0: 2048 threads per SM
    max_regs_per_thread=255,  # CUDA guide: 255 registers per thread
    # measured: XLA's 8192³ matmul, bf16 733 and f16 689 TFLOP/s, same run
    # (papers/flash_attention/results/mosaic_NVIDIA_H100_80GB_HBM3.json). No device copy has been measured on the
    # H100, so DRAM keeps the datasheet bandwidth.
    ceilings=(("bf16", 733e12), ("f16", 689e12)),
    # whitepaper: GH100 keeps A100's L2 in two partitions joined by a crossbar, each caching for its own GPCs
    l2_partitions=2,
)

# --- NVIDIA H200 SXM 141GB -------------------------------------------------------------------------
# Same GH100 die as H100 SXM5 (compute, SMs, caches); datasheet: 141 GB HBM3e at 4.8 TB/s.
# L2: 60 MiB, measured (PyTorch's L2_cache_size on an H200, 2026-10-28),
# where the H100 reports 50 MiB; the cost functor's DRAM model reads it.
H200 = replace(
    H100,
    name="H200",
    memories=replace(H100, memories=H100.with_capacity(HBM, 141 * GB)).with_capacity(L2, 60 * MiB)[:1]
    + replace(H100, memories=H100.with_capacity(L2, 60 * MiB)).with_bandwidth(L2, 4.8e12)[1:],
    # measured (papers/flash_attention/results/NVIDIA_H200_benchmark.log): bf16 8192³ matmul 695–747 TFLOP/s,
    # device copy 4.0–4.1 TB/s read + write; a ceiling is the best run. No f16 matmul measured here: datasheet.
    ceilings=(("bf16", 747e12), ("dram", 4.1e12)),
)

# --- NVIDIA A100 SXM4 40GB: the 80GB model with its datasheet HBM2 (40 GB at 1,555 GB/s) ---------------
A100_40GB = replace(
    A100,
    name="A100-40GB",
    memories=A100.with_capacity(HBM, 40 * GB)[:1] + A100.with_bandwidth(L2, 1.555e12)[1:],
)

HARDWARE = (A100, A100_40GB, H100, H200)


@dataclass(frozen=True)
class Interconnect:
    """A device-to-device link: ``bandwidth`` in bytes/s each way per GPU to one peer, ``latency`` in seconds per
    transfer; ``fanout`` the bytes/s a GPU takes in when all its peers send at once (a collective: all-gather,
    all-to-all), which through a switch can exceed what one peer's transfer reaches. None: the same as ``bandwidth``.

    >>> NVLINK4.bandwidth * 2 / 1e9                   # datasheet figure: bidirectional per GPU
    900.0
    >>> measured = Interconnect("measured", 160e9, 2e-5, fanout=250e9)
    >>> measured.collective_bandwidth / 1e9, NVLINK4.collective_bandwidth / 1e9
    (250.0, 450.0)
    """

    name: str
    bandwidth: float
    latency: float
    fanout: float | None = None

    @property
    def collective_bandwidth(self) -> float:
        """Bytes/s into one GPU when every peer sends at once: ``fanout``, else ``bandwidth``."""
        return self.bandwidth if self.fanout is None else self.fanout


# NVLink 4 (H100/H200 SXM datasheets): 18 links × 50 GB/s = 900 GB/s bidirectional per GPU, so 450 GB/s each
# way; through NVSwitch (HGX boards) one peer can take all of it. Latency: NCCL's point-to-point latency on
# NVLink within a node is a few µs (nccl-tests sendrecv at small sizes); 5 µs is that lead, measured nowhere here.
NVLINK4 = Interconnect("NVLink 4", 450e9, 5e-6)


@dataclass(frozen=True)
class System:
    """The device level: ``devices`` copies of the GPU ``device`` joined pairwise by ``link``.

    >>> System(H100, 0, NVLINK4)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: system of H100: devices must be a positive integer, got 0
    """

    device: Hardware
    devices: int
    link: Interconnect

    def __post_init__(self):
        if isinstance(self.devices, bool) or not isinstance(self.devices, int) or self.devices < 1:
            raise CostError(f"system of {self.device.name}: devices must be a positive integer, got {self.devices!r}")

    @property
    def name(self) -> str:
        """``<devices>x<GPU>``.

        >>> H100_X8.name
        '8xH100'
        """
        return f"{self.devices}x{self.device.name}"

    @property
    def memory_per_device(self) -> int:
        """Bytes of HBM on each device."""
        return self.device.capacity(HBM)

    def transfer_time(self, nbytes):
        """Seconds to move ``nbytes`` one way over one link: latency + bytes/bandwidth."""
        return self.link.latency + nbytes / self.link.bandwidth

    def collective_time(self, nbytes, count: int = 1):
        """Seconds for ``count`` collectives bringing ``nbytes`` in all into each device from all its peers at once:
        ``count`` latencies + bytes / the link's :attr:`~Interconnect.collective_bandwidth`.

        >>> round(H200_X2.collective_time(450e6, count=2) * 1e6)     # 2 × 5 µs + 1 ms
        1010
        """
        return count * self.link.latency + nbytes / self.link.collective_bandwidth


# HGX H100 / H200 boards: 8 GPUs on NVSwitch (NVIDIA HGX datasheets); the lent machines hand out 2 of them.
H100_X8 = System(H100, 8, NVLINK4)
H200_X2 = System(H200, 2, NVLINK4)
H200_X8 = System(H200, 8, NVLINK4)
SYSTEMS = (H100_X8, H200_X2, H200_X8)


def lookup(hardware: Hardware | str) -> Hardware:
    """A hardware model, given itself or its name (case-insensitive); a :class:`CostError` lists the known names.

    >>> lookup("h100") is H100, lookup(A100) is A100
    (True, True)
    >>> lookup("B200")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: unknown hardware 'B200'; known: A100, A100-40GB, H100, H200 (or pass a Hardware)
    """
    if isinstance(hardware, Hardware):
        return hardware
    known = ", ".join(h.name for h in HARDWARE)
    if isinstance(hardware, str):
        for h in HARDWARE:
            if h.name.lower() == hardware.lower():
                return h
        raise CostError(f"unknown hardware {hardware!r}; known: {known} (or pass a Hardware)")
    raise CostError(f"hardware must be a Hardware or one of the names {known}, got {type(hardware).__name__}")


def for_device(kind: str) -> Hardware | None:
    """The model of a device from its kind string (``jax.devices()[0].device_kind``), or None if unknown.

    The most specific model whose name's parts all appear in the kind wins (``A100-40GB`` over ``A100``).

    >>> for_device("NVIDIA H100 80GB HBM3").name, for_device("NVIDIA A100-SXM4-40GB").name
    ('H100', 'A100-40GB')
    >>> for_device("cpu") is None
    True
    """
    kind = kind.upper()
    fits = [h for h in HARDWARE if all(part.upper() in kind for part in h.name.split("-"))]
    return max(fits, key=lambda h: len(h.name), default=None)


__all__ = [
    "A100",
    "A100_40GB",
    "GB",
    "H100",
    "H200",
    "H100_X8",
    "H200_X2",
    "H200_X8",
    "HARDWARE",
    "Hardware",
    "Interconnect",
    "KiB",
    "Memory",
    "MiB",
    "NVLINK4",
    "SYSTEMS",
    "System",
    "for_device",
    "lookup",
]
