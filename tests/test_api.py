"""``lower``'s contract: typed fields on the kernel, backend choice, hardware, config everywhere,
shape guards at ``lower()`` or at the first call, and a backward that never stops the forward."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import Config, NotLowerable, choose_tiles, lower, predicted_time
from napkin_cat import generators as g
from napkin_cat.diagram import Array
from napkin_cat.diagram import id as identity
from napkin_cat.hardware import A100, H100
from rewrites import derive, stream, tile


def rand(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def scheduled(attn, q, x, g=16, s=16):
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def test_kernel_states_backend_and_differentiation_as_fields():
    q, x, d = nc.axes("q x d")
    flash = scheduled(nc.library.attention(q, x, d), q, x)
    k = lower(flash)
    assert (k.backend, k.differentiation, k.why_not) == ("triton", "lowered", None)
    k = lower(flash, backward="reference")
    assert (k.backend, k.differentiation, k.why_not, k.kernels) == ("triton", "reference", None, ())
    n, c, m = nc.axes("n c m")
    mm = lower(derive(nc.library.matmul(n, c, m), tile(n, 16), tile(m, 16), stream(c, 16), verify=False))
    assert (mm.differentiation, mm.why_not) == ("lowered", None)  # derived from nc.reverse, not matched
    norm = lower(derive(nc.library.rms_norm(n, c), tile(n, 16), verify=False))
    assert (norm.differentiation, norm.why_not) == ("lowered", None)  # a one-array sum over c is a block sum


def test_backend_auto_chooses_triton_and_others_are_refused():
    q, x, d = nc.axes("q x d")
    flash = scheduled(nc.library.attention(q, x, d), q, x)
    assert lower(flash, backend="auto").backend == "triton" == lower(flash, backend="triton").backend
    with pytest.raises(NotLowerable, match=re.escape("backend 'cuda': choose 'auto' (Mosaic on sm_90 where it lowers")):
        lower(flash, backend="cuda")
    with pytest.raises(
        NotLowerable, match="backend 'mosaic': a lowering.TritonConfig tunes Triton; pass a .*MosaicConfig"
    ):
        lower(flash, backend="mosaic", config=Config())


def test_hardware_sets_the_shared_memory_limit():
    """196,608 B (a 128×128 f32 query block, two stages of 64×128 key and value chunks) fits H100, not A100."""
    q, x = nc.axes("q x")
    d = nc.Axis("d", 128)
    flash = scheduled(nc.library.attention(q, x, d), q, x, g=128, s=64)
    config = Config(num_warps=8, num_stages=2)
    assert lower(flash, config=config).forward.hardware is H100  # interpreting on CPU: H100
    assert lower(flash, config=config, hardware="H100").forward.hardware is H100
    message = "the kernel would hold 196,608 B of shared memory (resident blocks plus 2 stages of each chunk), "
    message += f"over the {A100.smem_per_block:,} B a block may use on A100"
    with pytest.raises(NotLowerable, match=re.escape(message)):
        lower(flash, config=config, hardware=A100)
    with pytest.raises(NotLowerable, match=re.escape("lower: unknown hardware 'B200'; known: A100, A100-40GB")):
        lower(flash, hardware="B200")


def test_config_reaches_every_kernel(key):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)
    config = Config(num_warps=2, num_stages=1)
    kernel = lower(scheduled(attn, q, x), config=config)
    assert len(kernel.kernels) == 4  # the forward with residuals, Δ, dQ, dK·dV
    assert all(k.config == config for k in (kernel.forward, *kernel.kernels))
    with pytest.raises(NotLowerable, match="config must be a lowering.Config, got dict"):
        lower(scheduled(attn, q, x), config={"num_warps": 2})


@pytest.mark.parametrize("concrete", [True, False])
def test_an_axis_that_is_not_a_power_of_two_is_padded_with_the_neutral_value(key, concrete):
    n, xx = (nc.Axis("n"), nc.Axis("xx", 24 if concrete else None))
    kernel = lower(derive(nc.library.softmax(n, xx), tile(n, 16), verify=False))
    (v,) = rand(key, (16, 24))
    assert rel_err(kernel(v), jax.nn.softmax(v, axis=-1)) <= 1e-6  # f32: measured 1.2e-7


@pytest.mark.parametrize("concrete", [True, False])
def test_shared_memory_guard_at_lower_or_first_call(concrete):
    q, x = nc.axes("q x")
    d = nc.Axis("d", 512 if concrete else None)
    kernel = lambda: lower(scheduled(nc.library.attention(q, x, d), q, x, g=128, s=128))  # noqa: E731
    # Q: 128×512 f32 resident; K, V: 3 stages of 128×512 f32 chunks (the default for 128-row tiles)
    message = f"the kernel would hold {128 * 512 * 4 * 7:,} B of shared memory"
    with pytest.raises(NotLowerable, match=message):
        if concrete:
            kernel()
        else:
            Q = jnp.ones((128, 512))
            kernel()(Q, Q, Q)


def test_a_backward_that_cannot_be_built_never_stops_the_forward(key):
    """d = 512, tiles of 16 (f32): the forward holds 229,376 B, the backward kernels more than 232,448 B.
    The forward lowers and runs; ``why_not`` names the backward kernel's footprint, and differentiating raises it."""
    q, x = nc.axes("q x")
    d = nc.Axis("d", 512)
    kernel = lower(scheduled(nc.library.attention(q, x, d), q, x))
    assert kernel.differentiation == "none" and "B of shared memory" in kernel.why_not
    Q, K, V = rand(key, (32, 512), (32, 512), (32, 512))
    ref = jax.nn.dot_product_attention(Q[None, :, None], K[None, :, None], V[None, :, None])[0, :, 0]
    assert rel_err(kernel(Q, K, V), ref) <= 1e-5
    with pytest.raises(NotLowerable, match=r"the kernel .* would hold [\d,]+ B of shared memory .* on H100"):
        jax.grad(lambda Q: kernel(Q, K, V).sum())(Q)


def attention_dk_dv(q, x, e, d):
    """Attention whose query/key head dim ``e`` differs from the value head dim ``d`` (as in MLA)."""
    V, S = Array(x, d), Array(q, x)
    scores = g.contract("q e, x e -> q x", q, x, e, scale=1 / np.sqrt(int(e.size)))
    return (scores @ identity(V)) >> (g.softmax(S, x) @ identity(V)) >> g.contract("q x, x d -> q d", q, x, d)


def test_query_key_head_dim_other_than_value_head_dim_lowers_and_differentiates(key):
    q, x, e, d = nc.axes("q x e d", e=48, d=32)
    kernel = lower(scheduled(attention_dk_dv(q, x, e, d), q, x))
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)
    Q, K, V, ct = rand(key, (40, 48), (40, 48), (40, 32), (40, 32))

    def reference(Q, K, V):  # written here, independently of the generators
        return jax.nn.softmax(Q @ K.T / jnp.sqrt(48.0), axis=-1) @ V

    out, vjp = jax.vjp(kernel, Q, K, V)
    ref, ref_vjp = jax.vjp(reference, Q, K, V)
    assert rel_err(out, ref) <= 1e-5  # measured ≤ 4e-7 (f32, CPU)
    for a, r in zip(vjp(ct), ref_vjp(ct), strict=True):
        assert rel_err(a, r) <= 1e-5


def test_a_box_after_the_attention_is_differentiated_by_its_own_rule(key):
    q, x, d = nc.axes("q x d")
    doubled = nc.library.attention(q, x, d) >> nc.scale(Array(q, d), 2.0)
    kernel = lower(scheduled(doubled, q, x))
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)  # the scale's own derivative rule
    Q, K, V = rand(key, (24, 16), (24, 16), (24, 16))
    expected = jax.grad(lambda Q: 2 * (jax.nn.softmax(Q @ K.T / 4.0, -1) @ V).sum())(Q)
    for k in (kernel, lower(scheduled(doubled, q, x), backward="reference")):
        assert rel_err(jax.grad(lambda Q, k=k: k(Q, K, V).sum())(Q), expected) <= 1e-5


# --- sizes left open (tile(q), stream(x)): chosen by the cost model in lower ---------------------------------------
# f32 forward tolerance: tests/test_kernels_vs_jax.py (measured ≤ 6.2e-7 by tests/measure_tolerances.py)
FWD = 2e-6


def test_open_sizes_attention_chosen_at_the_call_and_checked_against_jax_nn(key, seed):
    import references as R

    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)
    flash = derive(attn, tile(q), stream(x), nc_level(), seed=seed)
    kernel = lower(flash, hardware="H100")
    assert kernel.tiles is None  # sizes symbolic: chosen at the first call, from the arrays' shapes
    Q, K, V = rand(key, (1, 2, 40, 16), (1, 2, 72, 16), (1, 2, 72, 16))
    out = jax.jit(kernel)(Q, K, V)
    err = R.rel_err(out, R.attention(Q, K, V, causal=True))
    assert err <= FWD, f"relative error {err:.2e} > {FWD:.0e} (NAPKIN_SEED={seed})"
    # the largest query tile that fits, capped at the padded 64 queries; the chunk as the cost model ranks it
    # (the rule itself: test_the_chosen_sizes_are_the_largest_tile_that_fits_then_the_fastest_predicted)
    at = {"b": 1, "h": 2, "q": 40, "d": 16, "x": 72}
    assert kernel.tiles["g_q"] == 64 and kernel.tiles == choose_tiles(flash, "H100", at).sizes, kernel.choice
    assert kernel.choice.how == "cost model" and kernel.choice.at == at
    # the kernel built for these shapes is the one a later call (or jax.grad) reuses, with its lowered backward
    built = kernel.at(b=1, h=2, q=40, d=16, x=72)
    assert built.tiles == kernel.tiles and built.differentiation == "lowered"


def nc_level():
    from rewrites import level

    return level(nc.SMEM)


def test_open_sizes_matmul_resolved_at_lower_when_sizes_are_known(key, seed):
    import references as R

    n, k, c = nc.axes("n k c")
    mm = derive(nc.library.matmul(n, k, c), tile(n), tile(c), stream(k, "auto"), seed=seed)
    A, B = rand(key, (48, 80), (80, 40))
    kernel = lower(mm, hardware="A100", sizes={"n": 48, "k": 80, "c": 40})
    # tiles as wide as the padded axes (64) fit; 128-wide f32 chunks in 3 stages (192 KiB) would not fit the
    # A100's 163 KiB, so 64
    assert kernel.tiles == {"g_n": 64, "s_k": 64, "g_c": 64}, kernel.choice
    assert kernel.choice.rules == ("tile(n, 64)", "stream(k, 64)", "tile(c, 64)")
    # concrete axes bound their partitions: no block wider than the axis
    sized = derive(nc.library.matmul(*nc.axes("n k c", n=48, k=80, c=40)), tile("n"), tile("c"), stream("k"), seed=seed)
    assert lower(sized, hardware="A100").tiles == {"g_n": 32, "s_k": 64, "g_c": 32}
    for kern in (kernel, lower(sized, hardware="A100")):
        err = R.rel_err(kern(A, B), R.matmul(A, B))
        assert err <= FWD, f"relative error {err:.2e} > {FWD:.0e} (NAPKIN_SEED={seed})"


def test_explicit_sizes_are_kept_and_stated():
    q, x, d = nc.axes("q x d", d=16)
    kernel = lower(scheduled(nc.library.attention(q, x, d), q, x, g=32, s=16))
    assert (kernel.tiles, kernel.choice) == ({"g_q": 32, "s_x": 16}, None)


def test_an_open_size_nothing_fits_is_refused_naming_it():
    q, x = nc.axes("q x")
    wide = derive(nc.library.attention(q, x, nc.Axis("d", 4096)), tile(q), stream(x), verify=False)
    with pytest.raises(NotLowerable) as e:
        lower(wide, hardware="H100", sizes={"q": 1024, "x": 1024})
    assert str(e.value) == (
        "tile(q), stream(x): no size in (16, 32, 64, 128, 256) fits H100's 232,448 B of shared memory per block "
        "at q=1024, d=4096, x=1024 with 3 stages"
    )


def test_an_open_size_whose_axes_are_unknown_is_refused_by_choose_tiles_naming_them():

    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d), tile(q), verify=False)
    with pytest.raises(NotLowerable) as e:
        choose_tiles(flash, "H100", {"q": 64})
    assert str(e.value) == (
        "tile(q) is open and the predicted time needs the size of d, x, which the diagram leaves symbolic: give each "
        "a size (nc.Axis('d', n)) or pass lower(..., sizes={'d': n, ...})"
    )


def test_a_plan_of_open_sizes_is_refused_naming_them():
    from lowering import plan

    q, x, d = nc.axes("q x d")
    with pytest.raises(NotLowerable) as e:
        plan(derive(nc.library.attention(q, x, d), tile(q), stream(x), verify=False).diagram)
    assert str(e.value) == "tile(q), stream(x): the size is open; lower() chooses it (or bind it with rewrites.resolve)"


def test_measured_search_is_refused_where_kernels_are_interpreted():
    q, x, d = nc.axes("q x d", d=16)
    flash = derive(nc.library.attention(q, x, d), tile(q), stream(x), verify=False)
    with pytest.raises(NotLowerable) as e:
        lower(flash, interpret=True, search=True)
    assert str(e.value) == (
        "lower(search=True) times kernels on a GPU, and here they are interpreted; the sizes of tile(q), stream(x) "
        "come from the cost model without it"
    )
    with pytest.raises(NotLowerable, match=re.escape("lower(search=True): the diagram leaves no partition size open")):
        lower(scheduled(nc.library.attention(q, x, d), q, x), search=True)
    with pytest.raises(NotLowerable, match=re.escape("lower(sizes=): no wire has axis n; axes here: d, q, x")):
        lower(flash, sizes={"n": 4})


@pytest.mark.gpu
def test_measured_search_refines_the_model_choice_on_a_gpu(key):
    b, h, q, x = nc.axes("b h q x")
    attn = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 64), batch=(b,), dtype=nc.bf16)
    kernel = lower(
        derive(attn, tile(q), stream(x), verify=False), search=True, sizes={"b": 2, "h": 8, "q": 2048, "x": 2048}
    )
    assert kernel.choice.how == "measured search" and kernel.choice.measured > 0
    assert kernel.choice.sizes in kernel.choice.ranked


@settings(max_examples=5, deadline=None)
@given(
    d=st.integers(8, 256),
    q=st.integers(1, 5000),
    x=st.integers(1, 5000),
    dtype=st.sampled_from([nc.f32, nc.bf16]),
    hw=st.sampled_from([A100, H100]),
)
def test_the_chosen_sizes_are_the_largest_tile_that_fits_then_the_fastest_predicted(d, q, x, dtype, hw):
    from lowering import plan
    from lowering.triton import launch
    from rewrites import resolve

    qa, xa = nc.axes("q x")
    open_flash = derive(nc.library.attention(qa, xa, nc.Axis("d", d), dtype=dtype), tile(qa), stream(xa), verify=False)
    choice = choose_tiles(open_flash, hw, {"q": q, "x": x})
    extent = {"q": q, "x": x, "d": d}
    launch(plan(resolve(open_flash.diagram, choice.sizes)), extent, Config(num_stages=3), hw)  # it fits
    assert choice.sizes == choice.ranked[0]
    assert all(c["g_q"] <= choice.sizes["g_q"] for c in choice.ranked)  # no larger tile fits
    same_tile = [c for c in choice.ranked if c["g_q"] == choice.sizes["g_q"]]
    predicted = {c["s_x"]: predicted_time(resolve(open_flash.diagram, c), hw, extent) for c in same_tile}
    assert float(f"{predicted[choice.sizes['s_x']]:.3g}") == min(float(f"{t:.3g}") for t in predicted.values())


def test_a_function_jitted_before_the_first_kernel_is_not_traced_again():
    """A kernel's first trace defines no new jax config (Pallas' fuser defines one that every trace's context
    carries; napkin_cat imports it first): a function jitted before it keeps its compiled trace. In a fresh
    interpreter, as a user's program meets the first kernel."""
    program = (
        "import jax, napkin_cat as nc\n"
        "traces = []\n"
        "f = jax.jit(lambda x: traces.append(1) or x + 1)\n"
        "f(1.0)\n"
        "q = jax.random.normal(jax.random.key(0), (1, 24, 2, 16))\n"
        "jax.block_until_ready(nc.attention(q, q, q, is_causal=True))\n"
        "f(1.0)\n"
        "print('traces', len(traces))\n"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["traces", "1"], done.stdout + done.stderr[-2000:]
