"""The Mosaic GPU backend: kernels run in Mosaic's interpret mode on CPU (register operands staged through
shared memory there), lower to Mosaic GPU for an abstract CUDA device (the compiled path, register A
operand included), and run compiled on a GPU (``gpu``-marked); refusals name the box, axis or level."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import MosaicConfig, MosaicLowered, NotLowerable, lower, plan
from lowering import _mosaic as mosaic
from lowering import _triton as lowering_triton
from lowering._api import AUTO_KEEPS_TRITON
from rewrites import derive, stream, tile


def attention(D, g, s, dtype="bf16", **kw):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype, **kw)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def matmul(g_m, g_n, s, dtype="bf16"):
    m, k, n = nc.axes("m k n")
    return derive(nc.library.matmul(m, k, n, dtype=dtype), tile(m, g_m), tile(n, g_n), stream(k, s), verify=False)


def reference(Q, K, V, causal=False, score_mod=None):
    """Attention in f32, written here: einsum, mask, softmax, einsum."""
    Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
    s = jnp.einsum("bhqd,bhkd->bhqk", Q, K) / Q.shape[-1] ** 0.5
    if score_mod is not None:
        s = score_mod(s)
    if causal:
        n = Q.shape[2]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), V)


def inputs(key, shape):
    return [jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key, 3)]


def relative_error(out, ref):
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def soft_cap(s):
    return 20 * jnp.tanh(s / 20)


# bf16 operands and output: measured 1.9e-3 .. 2.2e-3 on these sizes (interpret and H100 alike)
BF16 = 5e-3


@pytest.mark.parametrize(
    ("causal", "s", "mod"),
    [(False, 64, None), (True, 128, soft_cap)],
    ids=["plain-s64", "causal-softcap-s128"],
)
def test_interpret_matches_reference(key, causal, s, mod):
    Q, K, V = inputs(key, (1, 2, 256, 64))
    kernel = lower(attention(64, 128, s, causal=causal, score_mod=mod), backend="mosaic", interpret=True)
    assert kernel.backend == "mosaic" and kernel.forward.config.interpretable
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal, mod)) <= BF16


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_path_lowers_for_cuda(causal):
    """The GPU path (register A operand, in-place accumulation, ping-pong) lowers to Mosaic GPU on CPU."""
    k = MosaicLowered(plan(attention(128, 256, 64, causal=causal, score_mod=soft_cap).diagram), interpret=False)
    assert not k.config.interpretable and k.pingpong and k.rows == 128
    args = [jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)] * 3
    text = jax.jit(k).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_refusals_name_the_cause():
    with pytest.raises(NotLowerable, match=r"input .*wgmma takes 16-bit operands"):
        MosaicLowered(plan(attention(64, 128, 64, dtype="f32").diagram))
    with pytest.raises(NotLowerable, match=r"axis 'q': the tile g = 64 splits over 2 consumer warpgroups"):
        MosaicLowered(plan(attention(64, 64, 64).diagram))
    with pytest.raises(NotLowerable, match=r"warpgroup level: 4 consumers × 232 registers"):
        MosaicLowered(plan(attention(64, 256, 64).diagram), config=MosaicConfig(consumers=4))
    big = MosaicLowered(plan(attention(256, 256, 128).diagram), interpret=False)
    Q = jnp.ones((1, 1, 256, 256), jnp.bfloat16)
    with pytest.raises(NotLowerable, match=r"thread-block level: the kernel would hold 393,216 B of shared memory"):
        big(Q, Q, Q)


def test_output_reuses_the_query_tile():
    """FA3's epilogue: O is stored through Q's shared-memory tile, so g256 s128 at D = 128 fits (192 KiB)."""
    k = MosaicLowered(plan(attention(128, 256, 128).diagram), interpret=False)
    assert k.reuse == [0] and "stored through the shared-memory tile of q/256" in k.source
    assert k.smem_bytes({"d": 128}) == 2 * 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2


def test_auto_takes_triton_off_hopper_and_says_why(key):
    kernel = lower(attention(64, 128, 64), backend="auto")
    assert kernel.backend == "triton" and isinstance(kernel.forward, lowering_triton.Lowered)
    assert "is not an sm_90 (Hopper) GPU" in kernel.refused["mosaic"]
    Q, K, V = inputs(key, (1, 2, 128, 64))
    assert relative_error(kernel(Q, K, V), reference(Q, K, V)) <= BF16


class Hopper:
    """A stand-in for an H100 in ``jax.devices()``: what ``choose`` reads."""

    platform, device_kind, compute_capability = "gpu", "NVIDIA H100 80GB HBM3", "9.0"


def test_mosaic_is_a_candidate_on_hopper_where_it_lowers(monkeypatch):
    monkeypatch.setattr(mosaic.jax, "devices", lambda: [Hopper()])
    kernel, why = mosaic.choose(attention(64, 128, 64).diagram, interpret=None)
    assert isinstance(kernel, MosaicLowered) and why is None
    kernel, why = mosaic.choose(attention(64, 128, 64, dtype="f32").diagram, interpret=None)
    assert kernel is None and "Mosaic refused: input" in why and "16-bit" in why
    kernel, why = mosaic.choose(attention(256, 256, 128).diagram, interpret=None)
    assert kernel is None and "393,216 B of shared memory" in why
    auto = lower(attention(64, 128, 64), backend="auto", interpret=False)  # keeps to Triton, saying so
    assert auto.backend == "triton" and auto.refused == {"mosaic": AUTO_KEEPS_TRITON}


@settings(max_examples=2, deadline=None)
@given(m=st.sampled_from([128, 256]), n=st.sampled_from([64, 128]), k=st.sampled_from([64, 192]))
def test_matmul_interpret_matches_reference(m, n, k):
    """Not an attention template: a tiled, streamed matmul on the same lowering (two tiled axes on the grid)."""
    a, b = (jax.random.normal(jax.random.key(m + n + k + i), sh, jnp.bfloat16) for i, sh in enumerate([(m, k), (k, n)]))
    kernel = lower(matmul(128, 64, 64), backend="mosaic", interpret=True, config=MosaicConfig(interpretable=True))
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    assert relative_error(kernel(a, b), want) <= BF16, f"seed {m + n + k}"


def test_matmul_lowers_for_cuda():
    k = MosaicLowered(plan(matmul(256, 128, 64).diagram), interpret=False, config=MosaicConfig(stages=3))
    assert k.rows == 128 and k.others == {"n": 128} and k.source.startswith("plgpu.kernel grid (m/256, n/128, batch)")
    args = [jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)]
    assert "mosaic_gpu" in jax.jit(k).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@settings(max_examples=5, deadline=None)
@given(g=st.sampled_from([64, 128, 256, 512]), s=st.sampled_from([16, 32, 64, 128]))
def test_block_guards(g, s):
    """A tile must split into whole 64-row warpgroup blocks, a chunk must be a multiple of 64."""
    if g % 128 == 0 and s % 64 == 0:
        assert MosaicLowered(plan(attention(64, g, s).diagram)).rows == g // 2
    else:
        with pytest.raises(NotLowerable, match=r"axis '[qx]'"):
            MosaicLowered(plan(attention(64, g, s).diagram))


@pytest.mark.gpu
@pytest.mark.parametrize(("D", "causal", "s"), [(128, False, 64), (128, True, 64), (64, False, 128), (64, True, 128)])
def test_compiled_matches_reference(key, D, causal, s):
    Q, K, V = inputs(key, (2, 4, 1024, D))
    kernel = lower(attention(D, 256, s, causal=causal, score_mod=soft_cap), backend="mosaic")
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal, soft_cap)) <= BF16


def test_registers_refuse_a_spilling_tile():
    """g256 s128 at D = 128 fits shared memory once O reuses Q's tile, but not a consumer's registers."""
    k = MosaicLowered(plan(attention(128, 256, 128).diagram), interpret=False)
    assert k.smem_bytes({"d": 128}) <= mosaic.SMEM_LIMIT
    with pytest.raises(NotLowerable, match=r"warpgroup level: a consumer thread would keep 256 f32 registers"):
        k.check({"d": 128})
    assert MosaicLowered(plan(matmul(256, 128, 64).diagram)).registers({}) == 128


@pytest.mark.gpu
def test_auto_keeps_to_triton_on_the_gpu(key):
    kernel = lower(attention(128, 256, 64, causal=True), backend="auto")
    assert kernel.backend == "triton" and kernel.refused == {"mosaic": AUTO_KEEPS_TRITON}
    Q, K, V = inputs(key, (1, 2, 512, 128))
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, True)) <= BF16


@pytest.mark.gpu
def test_auto_differentiates_with_tritons_backward(key):
    kernel = lower(attention(128, 256, 64, causal=True), backend="auto")
    Q, K, V = inputs(key, (1, 2, 512, 128))
    dQ = jax.grad(lambda Q: kernel(Q, K, V).astype(jnp.float32).sum())(Q)
    want = jax.grad(lambda Q: reference(Q, K, V, True).sum())(Q)
    assert relative_error(dQ, want) <= 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_compiled_matmul_matches_reference(key, dtype):
    jdt = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    a, b = (jax.random.normal(k, (1024, 1024), jdt) for k in jax.random.split(key))
    kernel = lower(matmul(256, 128, 64, dtype), backend="mosaic", config=MosaicConfig(stages=3, pingpong=False))
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    assert relative_error(kernel(a, b), want) <= BF16
