"""Lowered kernels against the reference semantics and jax.nn.dot_product_attention.

Interpret mode on CPU (CI); the same tests run compiled on a GPU (``-m gpu`` on the device machine).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, lower
from rewrites import derive, stream, tile

TOL = {nc.f32: 2e-3, nc.bf16: 2e-2, nc.f16: 5e-3}  # f32 dots may run as TF32 on a GPU


def rand(key, shapes, dtype):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=False)]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def mha(dtype, causal=False, g=16, s=16, **kw):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype, **kw)
    return attn, lower(derive(attn, tile(q, g), stream(x, s), verify=False))


def dpa(Q, K, V, causal):
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn wants [b, n, h, d]
    return t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nq=st.integers(1, 70),
    nx=st.integers(1, 70),
    dim=st.sampled_from([8, 16, 24, 64]),
    dtype=st.sampled_from([nc.f32, nc.bf16, nc.f16]),
    causal=st.booleans(),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
)
def test_attention_matches_reference_and_jax(key, nq, nx, dim, dtype, causal, tiles):
    if causal:
        nx = max(nx, nq)  # jax.nn's causal mask is top-left aligned: keep every query row non-empty
    attn, kernel = mha(dtype, causal, *tiles)
    Q, K, V = rand(key, [(2, 2, nq, dim), (2, 2, nx, dim), (2, 2, nx, dim)], dtype)
    out = kernel(Q, K, V)
    assert out.shape == Q.shape and out.dtype == dtype.jnp
    assert rel_err(out, nc.to_jax(attn)(Q, K, V)) <= TOL[dtype]
    assert rel_err(out, dpa(Q, K, V, causal)) <= TOL[dtype]


def test_fully_masked_rows_are_zero_not_nan(key):
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d, mask=lambda q, x: (q >= 8) & (x <= q))
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False))
    Q, K, V = rand(key, [(32, 16), (40, 16), (40, 16)], nc.f32)
    out = kernel(Q, K, V)
    assert not jnp.isnan(out).any()
    np.testing.assert_array_equal(np.asarray(out[:8]), 0)
    assert rel_err(out[8:], nc.to_jax(attn)(Q, K, V)[8:]) <= TOL[nc.f32]


def test_score_mod_scale_gqa_mqa(key):
    hk, g, h, q, x, d = nc.axes("hk g h q x d")

    def alibi(s, q, x):
        return s - 0.1 * jnp.abs(q - x).astype(jnp.float32)

    gqa = nc.library.grouped_query_attention(hk, g, q, x, d, scale=0.2, score_mod=alibi, causal=True)
    kernel = lower(derive(gqa, tile(q, 16), stream(x, 16), verify=False))
    Q, K, V = rand(key, [(2, 3, 33, 16), (2, 33, 16), (2, 33, 16)], nc.f32)
    assert rel_err(kernel(Q, K, V), nc.to_jax(gqa)(Q, K, V)) <= TOL[nc.f32]
    mqa = nc.library.multi_query_attention(h, q, x, d)
    kernel = lower(derive(mqa, tile(q, 16), stream(x, 16), verify=False))
    Q, K, V = rand(key, [(4, 20, 32), (50, 32), (50, 32)], nc.f32)
    assert rel_err(kernel(Q, K, V), nc.to_jax(mqa)(Q, K, V)) <= TOL[nc.f32]


def test_matmul_softmax_norms(key):
    n, k, c = nc.axes("n k c", k=48, c=32)
    mm = nc.library.matmul(n, k, c)
    A, B = rand(key, [(40, 48), (48, 32)], nc.f32)
    for rules in [(tile(n, 16), tile(c, 16), stream(k, 16)), (tile(n, 16), stream(k, 16))]:
        assert rel_err(lower(derive(mm, *rules, verify=False))(A, B), A @ B) <= TOL[nc.f32]
    n, x = nc.axes("n x", x=64)
    sm = nc.library.softmax(n, x)
    S = rand(key, [(37, 64)], nc.f32)[0]
    assert rel_err(lower(derive(sm, tile(n, 16), verify=False))(S), jax.nn.softmax(S, -1)) <= 1e-5
    n, dd = nc.axes("n dd", dd=32)
    ln = nc.library.layer_norm(n, dd)
    X, gm, bt = rand(key, [(20, 32), (32,), (32,)], nc.f32)
    assert rel_err(lower(derive(ln, tile(n, 16), verify=False))(X, gm, bt), nc.to_jax(ln)(X, gm, bt)) <= 1e-5
    rms = nc.library.rms_norm(n, dd)
    assert rel_err(lower(derive(rms, tile(n, 16), verify=False))(X, gm), nc.to_jax(rms)(X, gm)) <= 1e-5


def test_jit_and_vmap(key):
    attn, kernel = mha(nc.f32)
    Q, K, V = rand(key, [(1, 2, 16, 16), (1, 2, 16, 16), (1, 2, 16, 16)], nc.f32)
    ref = nc.to_jax(attn)(Q, K, V)
    assert rel_err(jax.jit(kernel)(Q, K, V), ref) <= TOL[nc.f32]
    stacked = [jnp.stack([a, 2 * a]) for a in (Q, K, V)]
    assert rel_err(jax.vmap(kernel)(*stacked)[0], ref) <= TOL[nc.f32]


def test_guards_raise_not_lowerable():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    with pytest.raises(NotLowerable, match=r"axis 'q': Triton blocks need a power-of-two tile ≥ 16, got g = 24"):
        lower(derive(attn, tile(q, 24), stream(x, 16), verify=False))
    with pytest.raises(NotLowerable, match=r"axis 'x': Triton blocks need a power-of-two stream size ≥ 16, got s = 8"):
        lower(derive(attn, tile(q, 16), stream(x, 8), verify=False))
    n, xx = nc.axes("n xx", xx=24)
    with pytest.raises(NotLowerable, match=r"axis 'xx' of size 24 is not a power of two"):  # concrete: at lower()
        lower(derive(nc.library.softmax(n, xx), tile(n, 16), verify=False))
    with pytest.raises(NotLowerable, match="backend 'cuda': choose 'auto'"):
        lower(derive(attn, tile(q, 16), stream(x, 16), verify=False), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [nc.bf16, nc.f16])
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_attention_on_gpu(key, dtype, causal):
    attn, kernel = mha(dtype, causal, g=128, s=64)
    Q, K, V = rand(key, [(2, 4, 1000, 128), (2, 4, 1000, 128), (2, 4, 1000, 128)], dtype)
    out = jax.jit(kernel)(Q, K, V)
    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    assert rel_err(out, dpa(*f32, causal)) <= TOL[dtype]


def test_shared_memory_guard(key):
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    kernel = lower(derive(attn, tile(q, 128), stream(x, 128), verify=False))
    Q = jnp.ones((128, 512))
    with pytest.raises(NotLowerable, match=r"the kernel would hold 1,835,008 B of shared memory"):
        kernel(Q, Q, Q)
