"""The Mosaic GPU backend: kernels run in Mosaic's interpret mode on CPU (register operands staged through
shared memory there), lower to Mosaic GPU for an abstract CUDA device (the compiled path, register A
operand included), and run compiled on a GPU (``gpu``-marked); refusals name the box, axis or level."""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, lower, plan
from lowering.mosaic import MosaicConfig, MosaicLowered
from rewrites import derive, stream, tile


def attention(D, g, s, dtype="bf16", **kw):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype, **kw)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


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
    big = MosaicLowered(plan(attention(128, 256, 128).diagram), interpret=False)
    Q = jnp.ones((1, 1, 256, 128), jnp.bfloat16)
    with pytest.raises(NotLowerable, match=r"thread-block level: the kernel would hold 262,144 B of shared memory"):
        big(Q, Q, Q)


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
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_matches_reference(key, causal):
    Q, K, V = inputs(key, (2, 4, 1024, 128))
    kernel = lower(attention(128, 256, 64, causal=causal, score_mod=soft_cap), backend="mosaic")
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal, soft_cap)) <= BF16
