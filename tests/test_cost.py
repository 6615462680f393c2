"""The cost functor against FAN's formulas (rows 1, 4, 6, 7 of papers/flash_attention_on_a_napkin/table.md) and
XLA's own counts."""

import math

import jax
import jax.numpy as jnp
import pytest
import sympy

import napkin_cat as nc
from napkin_cat._cost import Cost, cost
from napkin_cat.diagram import Array, Ty, relabel
from napkin_cat.diagram import id as identity
from napkin_cat.generators import Contract, SoftmaxContract, move
from napkin_cat.hardware import A100, H100, KiB
from rewrites import level

g_q, s_x, g_a, g_c, s_b = sympy.symbols("g_q s_x g_a g_c s_b", positive=True, integer=True)


def flash(q, x, d, dtype=nc.bf16):
    """FAN's FlashAttention at the SMEM level: Q, K, V, O in SMEM, the score chunk in registers."""
    Q, K, V = Array(q, d, dtype=dtype), Array(x, d, dtype=dtype), Array(x, d, dtype=dtype)
    sm = lambda a: a.with_(level=nc.SMEM)
    S = Array(q, x, level=nc.REG)
    out = Array(q, d, dtype=dtype, level=nc.SMEM)
    qk = Contract("q d, x d → q x", Ty(sm(Q), sm(K)), Ty(S), data=(("scale", 1 / sympy.sqrt(d.size)),))
    pv = SoftmaxContract("softmax·contract x", Ty(S, sm(V)), Ty(out), data=(("axis", "x"),))
    loads = move(Q, nc.SMEM) @ move(K, nc.SMEM) @ move(V, nc.SMEM)
    return loads >> (qk @ identity(sm(V))) >> pv >> move(out, nc.HBM)


def test_naive_attention_row_7():
    q, x, d = nc.axes("q x d")
    c = cost(nc.library.attention(q, x, d, dtype=nc.bf16), H100)
    assert sympy.expand(c.transfers[nc.SMEM] - (2 * q.size * d.size + 2 * x.size * d.size + 4 * q.size * x.size)) == 0
    # S and P are f32 (4 B), Q, K, V, O bf16 (2 B)
    assert sympy.expand(c.hbm_bytes - (4 * q.size * d.size + 4 * x.size * d.size + 16 * q.size * x.size)) == 0
    assert sympy.expand(c.flops - (4 * q.size * x.size * d.size + 5 * q.size * x.size)) == 0
    assert c.transcendentals == q.size * x.size
    assert c.tensor_flops == {nc.bf16: 4 * q.size * x.size * d.size}  # P·V runs at V's dtype


def test_tiled_matmul_row_1():
    a, b, c_ = nc.axes("a b c")
    m = relabel(nc.library.matmul(a, b, c_), a=("group", g_a), b=("stream", s_b), c=("group", g_c))
    k = cost(m, H100)
    A, B, C = a.size, b.size, c_.size
    assert sympy.simplify(k.transfers[nc.SMEM] - (A * B * C * (1 / g_a + 1 / g_c) + A * C)) == 0
    assert sympy.expand(k.memory[nc.SMEM] - (g_a * g_c + g_a * s_b + s_b * g_c)) == 0
    # row 2: unlimited memory (one group each way) reads every input once
    assert sympy.expand(k.subs(g_a=A, g_c=C).transfers[nc.SMEM] - (A * B + B * C + A * C)) == 0


def test_flash_attention_row_4():
    q, x, d = nc.axes("q x d")
    c = cost(relabel(flash(q, x, d), q=("group", g_q), x=("stream", s_x)), H100)
    Q, X, D = q.size, x.size, d.size
    assert sympy.simplify(c.transfers[nc.SMEM] - (2 * Q * D + 2 * X * D * Q / g_q)) == 0
    assert sympy.expand(c.memory[nc.SMEM] - (2 * g_q * D + 2 * s_x * D)) == 0
    assert c.memory[nc.REG] == g_q * s_x
    # row 5: with g_q = M/2d (the stream chunk negligible), H = 2qd + 4xqd²/M
    M = sympy.Symbol("M", positive=True)
    assert sympy.simplify(c.transfers[nc.SMEM].subs(g_q, M / (2 * D)) - (2 * Q * D + 4 * X * Q * D**2 / M)) == 0


def test_flash_attention_diagram_means_attention(key):
    q, x, d = nc.axes("q x d")
    Q, K, V = (jax.random.normal(k, (8, 4)) for k in jax.random.split(key, 3))
    ours = nc.to_jax(flash(q, x, d, dtype=nc.f32))(Q, K, V)
    ref = nc.to_jax(nc.library.attention(q, x, d))(Q, K, V)
    assert jnp.allclose(ours, ref, atol=1e-5)


def test_multi_head_row_6():
    h, q, x, d = nc.axes("h q x d")
    one = relabel(flash(q, x, d), q=("group", g_q), x=("stream", s_x))
    c = cost(relabel(one.weave(h), h=("group", 1)), H100)  # heads are a grid axis: one head per group
    H, Q, X, D = h.size, q.size, x.size, d.size
    assert sympy.simplify(c.transfers[nc.SMEM] - (2 * H * Q * D + 2 * H * X * D * Q / g_q)) == 0
    assert sympy.expand(c.memory[nc.SMEM] - (2 * g_q * D + 2 * s_x * D)) == 0


def test_streaming_moves_nothing_more_and_tiling_rereads():
    q, x, d = nc.axes("q x d")
    plain = cost(flash(q, x, d), H100).transfers[nc.SMEM]
    assert cost(relabel(flash(q, x, d), x=("stream", s_x)), H100).transfers[nc.SMEM] == plain
    tiled = cost(relabel(flash(q, x, d), q=("group", g_q)), H100).transfers[nc.SMEM]
    assert sympy.simplify(tiled - plain - 2 * x.size * d.size * (q.size / g_q - 1)) == 0


def test_composition_is_functorial():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    scores, rest = attn[:1], attn[1:]
    whole, parts = cost(attn, H100), cost(scores, H100) >> cost(rest, H100)
    assert sympy.expand(whole.flops - parts.flops) == 0
    assert whole.moves == parts.moves
    assert sympy.simplify(whole.memory[nc.HBM] - parts.memory[nc.HBM]) == 0
    side = cost(attn @ attn, H100)
    assert side.moves == (cost(attn, H100) @ cost(attn, H100)).moves


def test_identity_costs_only_its_memory():
    (n,) = nc.axes("n")
    c = cost(identity(Array(n)), H100)
    assert (c.flops, c.moves, c.memory) == (0, {}, {nc.HBM: n.size})


def test_roofline_time():
    q, x, d = nc.axes("q x d", d=128)
    c = cost(relabel(flash(q, x, d), q=("group", 128), x=("stream", 64)), H100)
    t = c.subs(q=8192, x=8192)
    flops = 4 * 8192 * 8192 * 128
    assert float(t.times["tensor"]) == pytest.approx(flops / 989e12, rel=1e-9)
    # K and V (8192 x 128 each) fit the 50 MiB L2: DRAM moves Q, K, V and O once; their re-reads by the
    # 64 query tiles cross only the L2 -> SMEM link (the ncu counts in
    # papers/flash_attention/results/cost_vs_hardware_NVIDIA_H100_80GB_HBM3.md), so the kernel is tensor-bound
    size = q.size * d.size * flash(q, x, d).dom.inside[0].dtype.bytes
    assert t.dram_bytes == (4 * size).subs({q.size: 8192, d.size: 128})
    assert t.gmem_bytes == (size * (2 + 2 * x.size / 128)).subs({q.size: 8192, x.size: 8192, d.size: 128})
    assert t.times["→L2"] == t.dram_bytes / sympy.Float(H100.bandwidth(nc.L2))
    assert float(t.time) == pytest.approx(float(t.times["tensor"]), rel=1e-9)
    m = t.kernel_times  # the serial time runs at the measured tensor ceiling (733 TFLOP/s bf16 on the H100)
    assert float(m["tensor"]) == pytest.approx(flops / 733e12, rel=1e-9)
    assert (m["vector"], m["sfu"], m["→L2"]) == (t.times["vector"], t.times["sfu"], t.times["→L2"])
    assert float(t.time_serial) == pytest.approx(float(m["tensor"] + m["vector"] + m["sfu"]))
    big = cost(relabel(flash(q, x, d), q=("group", 384), x=("stream", 64)), H100).subs(q=8192, x=8192)
    assert float(big.time) == pytest.approx(float(big.times["tensor"]), rel=1e-9)


def test_unknown_sizes_for_a_number():
    q, x, d = nc.axes("q x d")
    c = cost(nc.library.attention(q, x, d), H100)
    with pytest.raises(nc.CostError, match=r"time on H100 needs sizes for d, x \(bound: q\)"):
        c.number("time", q=1024)
    assert c.number("flops", q=2, x=3, d=4) == 4 * 2 * 3 * 4 + 5 * 2 * 3


def test_missing_level_and_dtype_rate():
    (n,) = nc.axes("n")
    with pytest.raises(nc.CostError, match="hardware H100 has no memory level TC"):
        cost(move(Array(n), nc.TC), H100)
    a, b, c_ = nc.axes("a b c")
    fp8 = cost(nc.library.matmul(a, b, c_, dtype=nc.fp8_e4m3), A100)
    with pytest.raises(nc.CostError, match="hardware A100 has no compute rate for fp8_e4m3"):
        fp8.time  # noqa: B018


def test_memory_over_capacity():
    q, x, d = nc.axes("q x d", d=128)
    fits = relabel(flash(q, x, d), q=("group", 384), x=("stream", 64))
    assert cost(fits, H100).memory_bytes[nc.SMEM] == (2 * 384 * 128 + 2 * 64 * 128) * 2
    too_big = relabel(flash(q, x, d), q=("group", 1024), x=("stream", 128))
    with pytest.raises(nc.CostError, match=r"memory at SMEM: 589824 B needed .* exceeds H100's 232448 B"):
        cost(too_big, H100)
    symbolic = cost(relabel(flash(q, x, d), q=("group", g_q), x=("stream", 64)), H100)
    with pytest.raises(nc.CostError, match="memory at SMEM"):
        symbolic.check(g_q=1024)
    assert symbolic.check(g_q=128).memory_bytes[nc.SMEM] <= 227 * KiB


def test_without_hardware():
    q, x, d = nc.axes("q x d")
    c = cost(relabel(flash(q, x, d), q=("group", g_q)))
    # no stream loop, so Q's tile is freed before O's is made: the largest column is Q ⊗ K ⊗ V
    assert c.memory[nc.SMEM] == g_q * d.size + 2 * x.size * d.size
    with pytest.raises(nc.CostError, match="times need a hardware model"):
        c.time  # noqa: B018


def test_cost_records_form_a_category():
    one = Cost(H100, flops=sympy.Integer(1), memory={nc.HBM: sympy.Integer(5)})
    two = Cost(H100, flops=sympy.Integer(2), memory={nc.HBM: sympy.Integer(7)})
    assert ((one >> two) >> one).flops == (one >> (two >> one)).flops == 4
    assert (one >> two).memory == {nc.HBM: 7} and (one @ two).memory == {nc.HBM: 12}


# --- XLA's own counts (``jax.jit(f).lower(...).compile().cost_analysis()``) ----------------------------------


def xla(d, *shapes):
    args = [jnp.zeros(s, jnp.float32) for s in shapes]
    return jax.jit(nc.to_jax(d)).lower(*args).compile().cost_analysis()


def test_matmul_agrees_with_xla_exactly():
    a, b, c_ = nc.axes("a b c")
    ours = cost(nc.library.matmul(a, b, c_), H100).subs(a=256, b=512, c=128)
    theirs = xla(nc.library.matmul(a, b, c_), (256, 512), (512, 128))
    assert (int(ours.flops), int(ours.hbm_bytes)) == (theirs["flops"], theirs["bytes accessed"])


def test_attention_against_xla():
    """Where we differ from XLA, and why.

    FLOPs: the contractions agree (4qxd); the elementwise terms differ by O(qx): we count 5 per score
    (the scale, and max, subtract, sum, divide), XLA also counts the safe-softmax selects (−inf rows).
    Bytes: we cost the softmax as one kernel (read S, write P). XLA on CPU runs it as four passes over
    the scores (max; subtract-exp, written out; sum; normalise), and the scale as a pass of its own, so
    it moves whole extra multiples of the q×x f32 score matrix, plus row vectors.
    """
    q, x, d = nc.axes("q x d")
    sizes = dict(q=256, x=512, d=64)
    ours = cost(nc.library.attention(q, x, d), H100).subs(**sizes)
    theirs = xla(nc.library.attention(q, x, d), (256, 64), (512, 64), (512, 64))
    qx = sizes["q"] * sizes["x"]
    assert theirs["transcendentals"] == int(ours.transcendentals) == qx
    assert abs(theirs["flops"] - int(ours.flops)) <= 2 * qx + 4 * sizes["q"]
    assert theirs["flops"] == pytest.approx(float(ours.flops), rel=0.01)
    extra = theirs["bytes accessed"] - float(ours.hbm_bytes)
    passes, rows = divmod(extra, 4 * qx)
    assert 2 <= passes <= 8 and rows <= 16 * 4 * sizes["q"]


def test_softmax_against_xla():
    q, x = nc.axes("q x")
    ours = cost(nc.library.softmax(q, x), H100).subs(q=256, x=512)
    theirs = xla(nc.library.softmax(q, x), (256, 512))
    assert ours.hbm_bytes == 2 * 4 * 256 * 512  # one read of S, one write of P
    passes, rows = divmod(theirs["bytes accessed"], 4 * 256 * 512)  # XLA: 6 passes over the scores
    assert passes == 3 * 2 and rows <= 16 * 4 * 256


def _survival(ratio: float) -> float:
    """The random-replacement fixed point h = exp(-ratio (1 - h)) below 1, by bisection (independent of LambertW)."""
    lo, hi = 0.0, 1.0 - 1e-12
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if math.exp(-ratio * (1 - mid)) > mid else (lo, mid)
    return lo


def test_l2_survival_is_the_random_replacement_fixed_point():
    from napkin_cat._cost import l2_survival

    assert l2_survival(sympy.Rational(9, 10)) == 1 and l2_survival(1) == 1  # fits: every wave hits
    for r in (1.2, 1.5, 3.0, 8.0):
        assert float(l2_survival(sympy.Float(r))) == pytest.approx(_survival(r), abs=1e-9)


def test_dram_misses_l2_when_the_working_set_does_not_fit():
    """A matmul whose wave of blocks touches more operand panels than one L2 partition holds re-reads them."""
    a, b, c = nc.axes("a b c")
    m = relabel(nc.library.matmul(a, b, c, dtype="bf16"), a=("group", 128), b=("stream", 64), c=("group", 128))
    m = level(nc.SMEM)(m)
    small, mid, big = (cost(m, H100).subs(a=n, b=n, c=n) for n in (2048, 4096, 16384))
    assert small.dram_bytes == 3 * 2048 * 2048 * 2  # A, B read once, C written once
    for n, got in ((4096, mid), (16384, big)):
        panels, panel = n // 128, 128 * n * 2  # slabs per operand, bytes per slab
        # a wave of 132 blocks (a fastest) touches every A panel and ⌈132/panels⌉ B panels
        touched_b = -(-132 // panels)
        ratio = (panels + touched_b) * panel / (25 * 2**20)  # against one of the H100's two 25 MiB partitions
        miss = 1 - _survival(ratio)
        waves_a = panels / (132 / panels)  # 132/panels blocks of a wave share each A panel
        waves_b = panels / min(panels, 132 / touched_b)
        expected = n * n * 2 * (2 + (waves_a - 1 + waves_b - 1) * miss) + n * n * 2
        assert float(got.dram_bytes) == pytest.approx(expected, rel=1e-9)
    # at 4096³ a 50 MiB L2 would hold the 37 MiB wave; one 25 MiB partition keeps part of A between waves:
    # between once (2 operands) and a miss on every wave (A fetched by 32/(132/32) waves, B by 32/26.4)
    reads = float(mid.dram_bytes) - 4096**2 * 2
    assert 2 * 4096**2 * 2 < reads < 4096**2 * 2 * (32 / (132 / 32) + 32 / (132 / 5))


def test_serial_time_uses_measured_ceilings_where_the_model_has_them():
    """H200: bf16 matmul and device copy measured (papers/flash_attention/results/NVIDIA_H200_benchmark.log); f16
    and the exp unit keep the datasheet."""
    H200 = nc.hardware.H200
    work = Cost(
        H200,
        flops=sympy.Integer(2 * 10**12),
        transcendentals=sympy.Integer(10**9),
        tensor_flops={nc.bf16: sympy.Integer(10**12), nc.f16: sympy.Integer(10**12)},
    )
    m = work.kernel_times
    assert float(m["tensor"]) == pytest.approx(1e12 / 747e12 + 1e12 / 989e12)
    assert float(m["sfu"]) == pytest.approx(1e9 / (16 * 132 * H200.clock))
    assert float(work.time_serial) == pytest.approx(float(m["tensor"] + m["sfu"]))
    moved = cost(nc.library.matmul(*nc.axes("a b c", a=4096, b=4096, c=4096), dtype=nc.bf16), H200)
    assert float(moved.kernel_times["→L2"]) == pytest.approx(float(moved.dram_bytes) / 4.1e12)
    assert float(moved.times["→L2"]) == pytest.approx(float(moved.dram_bytes) / 4.8e12)
    assert Cost(A100).kernel_times == Cost(A100).times  # no measured ceilings: the datasheet


def test_open_sizes_stay_symbolic_in_the_cost():
    from rewrites import derive, stream, tile

    q, x, d = nc.axes("q x d", d=64)
    c = cost(derive(nc.library.attention(q, x, d), tile(q), stream(x), level(nc.SMEM), verify=False).diagram, H100)
    assert {g_q, s_x} <= c.memory_bytes[nc.SMEM].free_symbols
    assert g_q in c.gmem_bytes.free_symbols
    assert float(c.subs(q=4096, x=4096, g_q=128, s_x=64).time_serial) > 0


def test_online_softmax_rescales_its_state_at_every_chunk():
    """Streaming x in chunks of s_x adds, per chunk, one multiply per output value and 4 FLOPs + 1 exp per row."""
    from rewrites import derive, stream, tile

    q, x, d = nc.axes("q x d")
    naive = cost(nc.library.attention(q, x, d), H100)
    flash = cost(derive(nc.library.attention(q, x, d), tile(q, 64), stream(x), level(nc.SMEM), verify=False).diagram)
    Q, X, D = q.size, x.size, d.size
    chunks = X / s_x
    assert sympy.simplify(flash.flops - naive.flops - chunks * (Q * D + 4 * Q)) == 0
    assert sympy.simplify(flash.transcendentals - naive.transcendentals - chunks * Q) == 0
    assert sympy.simplify(flash.tensor_flops[nc.f32] - naive.tensor_flops[nc.f32]) == 0  # the matmuls are unchanged
    # a matmul's stream loop sums without rescaling: no extra work
    a, b, c_ = nc.axes("a b c")
    mm = relabel(nc.library.matmul(a, b, c_), a=("group", 64), b=("stream", s_b), c=("group", 64))
    assert cost(level(nc.SMEM)(mm)).flops == cost(nc.library.matmul(a, b, c_)).flops


def test_kernel_time_runs_in_waves_of_resident_blocks():
    """Attention D=128, tile 64, stream 64, 4 warps, 3 stages on an H100, every limit computed by hand."""
    from lowering import Config, plan, predicted_time
    from lowering._tiles import occupancy, predicted_occupancy
    from rewrites import derive, stream, tile

    b, h, q, x = nc.axes("b h q x")
    mha = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 128), batch=(b,), dtype="bf16")
    flash = derive(mha, tile(q, 64), stream(x, 64), verify=False)
    sizes = {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}
    o = predicted_occupancy(flash, H100, sizes)
    # shared memory: Q's 64×128 block once, K's and V's 64×128 chunks three times, bf16; 1 KiB reserved per block
    smem = 64 * 128 * 2 + 3 * 2 * 64 * 128 * 2
    expected = (4096 // 64 * 64, 228 * 1024 // (smem + 1024), "shared memory")
    assert (o.blocks, o.per_sm, o.limit) == expected == (4096, 2, "shared memory")
    assert o.prologue == 64 * 128 * 2 + 2 * 64 * 128 * 2  # Q and the first K, V chunk
    assert o.epilogue == 64 * 128 * 2  # the output block
    # 4096 blocks on 132 × 2 slots: 16 waves, the last partial
    t = cost(level(nc.SMEM)(flash.diagram), H100).subs(**sizes).kernel_times
    compute = float(t["tensor"] + t["vector"] + t["sfu"])
    wave = compute * 264 / 4096 + 264 * (o.prologue + o.epilogue) / 12e12
    assert predicted_time(flash, H100, sizes) == pytest.approx(16 * wave, rel=1e-12)
    assert 16 * wave > compute * (1 + 1 / 32)  # quantization (16 waves for 15.5) and the prologues cost time
    # registers bound the blocks once each thread holds more: 8 warps × 255 registers leave room for one block
    p = plan(flash.diagram)
    few = occupancy(p, sizes, Config(num_warps=8, num_stages=1), H100, live_values=10**6)
    assert (few.registers, few.per_sm, few.limit) == (256, 1, "registers")
    # a link-bound kernel takes its link's time: its bytes are shared by whichever blocks run
    assert o.time({"tensor": 0.0, "vector": 0.0, "sfu": 0.0, "→L2": 1.0}, H100) == 1.0
