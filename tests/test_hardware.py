"""Hardware models and the paper's model arithmetic (rows 10–17 of papers/flash_attention_on_a_napkin/table.md;
the GPUs' datasheets)."""

from dataclasses import replace

import pytest

from napkin_cat import optimize as opt
from napkin_cat.dtypes import bf16, f16, fp8_e4m3
from napkin_cat.errors import CostError, NapkinError
from napkin_cat.hardware import A100, A100_40GB, GB, H100, H200, HARDWARE, KiB, MiB
from napkin_cat.levels import HBM, L2, REG, SMEM, TC


@pytest.mark.parametrize(
    "hw, sms, hbm_bw, fp16, smem, l2",
    [  # the GPUs' datasheets (NVIDIA's A100, H100 and H200 product pages)
        (A100, 108, 2.039e12, 312e12, 164 * KiB, 40 * MiB),
        (H100, 132, 3.35e12, 989e12, 228 * KiB, 50 * MiB),
        (H200, 132, 4.8e12, 989e12, 228 * KiB, 60 * MiB),
    ],
)
def test_datasheet_constants(hw, sms, hbm_bw, fp16, smem, l2):
    assert hw.sms == sms
    assert hw.bandwidth(L2) == hw.bandwidth(SMEM, outer=HBM) == hbm_bw
    assert hw.flops(f16) == hw.flops(bf16) == fp16
    assert hw.capacity(SMEM) == smem and hw.capacity(L2) == l2
    assert hw.capacity(REG) == 256 * KiB
    assert hw.smem_per_block == hw.capacity(SMEM) - KiB


def test_models_are_hashable_values():
    assert len(set(HARDWARE)) == 4
    assert replace(H100, name="H100") == H100
    assert H200.memory(HBM).capacity == 141 * GB and A100_40GB.bandwidth(L2) == 1.555e12


def test_clock_is_derived_from_rates():
    # FAN, row 15 of papers/flash_attention_on_a_napkin/table.md: clock = 1979e12 / (132 · 8192) = 1.830 GHz
    assert H100.clock == pytest.approx(1.830e9, rel=1e-3)
    assert A100.clock == pytest.approx(1.41e9, rel=1e-3)
    assert H100.sms * H100.flops_per_clk(f16) * H100.clock == pytest.approx(H100.flops(f16), rel=1e-3)


def test_bandwidth_path_takes_the_slowest_link():
    assert H100.bandwidth(REG, outer=HBM) == H100.bandwidth(L2)
    assert H100.bandwidth(REG, outer=L2) == H100.bandwidth(SMEM)


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: H100.memory(TC), "hardware H100 has no memory level TC"),
        (lambda: H100.bandwidth(HBM), "no level outside HBM"),
        (lambda: H100.bandwidth(L2, outer=SMEM), "SMEM is not outside L2"),
        (lambda: A100.flops(fp8_e4m3), "A100 has no compute rate for fp8_e4m3"),
        (lambda: A100.flops_per_clk(fp8_e4m3), "A100 has no per-clock tensor rate for fp8_e4m3"),
    ],
)
def test_bad_requests_name_the_level_or_dtype(call, message):
    with pytest.raises(CostError, match=message):
        call()
    assert issubclass(CostError, NapkinError)


def test_bandwidth_thresholds():  # rows 11–13
    assert opt.matmul_threshold(H100) == pytest.approx(295.2, abs=0.1)
    assert opt.attention_threshold(H100) == pytest.approx(295.2, abs=0.1)
    assert opt.matmul_min_memory(H100) / KiB == pytest.approx(681, abs=0.5)
    assert opt.matmul_threshold(H100, SMEM) == pytest.approx(82, abs=0.5)
    assert opt.matmul_threshold(H100, SMEM, memory=H100.l1_smem_per_sm) == pytest.approx(151, abs=0.5)


def test_matmul_threshold_refuses_too_little_memory():
    message = "matmul at L2 of H100 is never compute-bound with 614400 B: needs M > 1/r² = 348629 f16 values"
    with pytest.raises(CostError, match=message):
        opt.matmul_threshold(H100, L2, memory=600 * KiB)
    assert opt.matmul_threshold(H100, L2, memory=700 * KiB) > 295


def test_hopper_configuration():  # row 14
    c = opt.hopper_configuration(H100)
    assert (round(c.n_smem, 1), round(c.n_regs, 1), c.warpgroups, c.g_q) == (3.7, 3.4, 3, 384)


def test_hopper_configuration_refuses_a_budget_that_does_not_fit():
    budget = opt.fan_hopper_budget(s_x=512)  # 2 stages × 512 × 128 × 3 B = 384 KiB of K, V
    with pytest.raises(CostError, match="no warpgroup fits on H100: SMEM allows -"):
        opt.hopper_configuration(H100, budget)


def test_kv_chunk_timing():  # row 16
    t = opt.kv_chunk_timing(H100)
    assert t.compute == pytest.approx(1.26e-6, rel=5e-3)
    assert t.transfer == pytest.approx(0.97e-6, rel=5e-3)
    assert t.flops == pytest.approx(1.32e15, rel=5e-3)
    assert t.compute_bound and not opt.kv_chunk_timing(H100, g_q=128).compute_bound


def test_fa3_fit():  # row 17
    assert opt.utilisation(H100, 0.66) == pytest.approx(0.75, abs=0.005)
    assert opt.utilisation(H100, 0.66, dtype=fp8_e4m3) == pytest.approx(0.60, abs=0.005)
    overhead = opt.fit_softmax_overhead(H100, 740e12 / H100.flops(f16))
    assert overhead == pytest.approx(0.66, abs=0.02)
    fp8 = opt.utilisation(H100, overhead, dtype=fp8_e4m3)
    assert fp8 == pytest.approx(1.2e15 / 1.98e15, abs=0.01)


def test_quantization():  # row 10
    assert opt.quantization_gain(1) == 4
    assert opt.quantization_gain(0.5) == pytest.approx(2.83, abs=0.005)


def test_ampere_warps():  # FAN v1: "13 warps per SM (FlashAttention fits 8)"
    w = opt.ampere_warps(A100_40GB)
    assert (w.needed, w.flash, w.register_limit, w.flash_rows) == (13, 8, 8, 128)
    assert opt.ampere_warps(A100).needed == 10  # the 80 GB part's faster HBM


def test_occupancy_constants_and_l2_partitions():
    """CUDA guide cc 8.0/9.0: 32 resident blocks, 1 KB reserved per block (228 − 227 KB), 64K registers per SM;
    A100/GH100 whitepapers: L2 in two partitions, each caching for its own GPCs."""
    for hw in (A100, H100, H200):
        assert hw.max_blocks_per_sm == 32 and hw.regs_per_sm == 65536
        assert hw.capacity(SMEM) - hw.smem_per_block == hw.smem_reserved_per_block == 1024
        assert hw.l2_partitions == 2 and hw.l2_shared_capacity * 2 == hw.capacity(L2)
    assert replace(H100, l2_partitions=1).l2_shared_capacity == 50 * MiB
