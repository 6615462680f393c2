"""jax.grad through lowered kernels equals jax.grad of jax.nn.dot_product_attention and of the naive diagram."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, lower
from rewrites import derive, stream, tile

TOL = {nc.f32: 2e-3, nc.bf16: 4e-2}


def rand(key, shapes, dtype=nc.f32):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=True)]


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def grads(f, args, ct):
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct), argnums=(0, 1, 2))(*args)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(5, 40), causal=st.booleans(), dtype=st.sampled_from([nc.f32, nc.bf16]))
def test_mha_gradients(key, n, causal, dtype):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype)
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False))
    assert kernel.differentiation == "lowered"
    Q, K, V = rand(key, [(1, 2, n, 16)] * 3, dtype)
    (ct,) = rand(jax.random.fold_in(key, 1), [(1, 2, n, 16)])
    ours = grads(kernel, (Q, K, V), ct)
    naive = grads(nc.to_jax(attn), (Q, K, V), ct)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    dpa = grads(lambda Q, K, V: t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal)), (Q, K, V), ct)
    for a, r, s in zip(ours, naive, dpa, strict=True):
        assert rel_err(a, r) <= TOL[dtype]
        assert rel_err(a, s) <= TOL[dtype]


def test_gqa_gradients_sum_the_group(key):
    hk, g, q, x, d = nc.axes("hk g q x d")
    gqa = nc.library.grouped_query_attention(hk, g, q, x, d, causal=True)
    kernel = lower(derive(gqa, tile(q, 16), stream(x, 16), verify=False))
    Q, K, V = rand(key, [(2, 3, 21, 16), (2, 21, 16), (2, 21, 16)])
    (ct,) = rand(jax.random.fold_in(key, 1), [(2, 3, 21, 16)])
    for a, r in zip(grads(kernel, (Q, K, V), ct), grads(nc.to_jax(gqa), (Q, K, V), ct), strict=True):
        assert rel_err(a, r) <= TOL[nc.f32]


def test_score_mod_backward_is_refused_unless_reference(key):
    q, x, d = nc.axes("q x d")

    def bias(s, q, x):
        return s - 0.1 * jnp.abs(q - x)

    attn = nc.library.attention(q, x, d, score_mod=bias)
    flash = derive(attn, tile(q, 16), stream(x, 16), verify=False)
    Q, K, V = rand(key, [(20, 16)] * 3)
    kernel = lower(flash)
    assert kernel.differentiation == "none" and "score modifier" in kernel.why_not
    with pytest.raises(NotLowerable, match="no lowered backward through score modifier 'score_mod bias'"):
        jax.grad(lambda Q: kernel(Q, K, V).sum())(Q)
    ref = lower(flash, backward="reference")
    got = jax.grad(lambda Q: ref(Q, K, V).sum())(Q)
    assert rel_err(got, jax.grad(lambda Q: nc.to_jax(attn)(Q, K, V).sum())(Q)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_gradients_on_gpu(key, causal):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=nc.bf16)
    kernel = lower(derive(attn, tile(q, 128), stream(x, 64), verify=False))
    Q, K, V = rand(key, [(2, 4, 1000, 128)] * 3, nc.bf16)
    (ct,) = rand(jax.random.fold_in(key, 1), [(2, 4, 1000, 128)])
    ours = jax.jit(lambda *a: grads(kernel, a, ct))(Q, K, V)
    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    ref = grads(lambda Q, K, V: t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal)), f32, ct)
    for a, r in zip(ours, ref, strict=True):
        assert rel_err(a, r) <= TOL[nc.bf16]


def test_backward_schedules_verify():
    """The backward diagrams are equal to jax.vjp of the forward, and their schedules verify (derive checks)."""
    from lowering.backward import attention_parts, backward_diagrams

    b, h, q, x, d = nc.axes("b h q x d")
    for causal in (False, True):
        attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal)
        parts = attention_parts(derive(attn, tile(q, 16), stream(x, 16), verify=False).diagram)
        dq, dkv = backward_diagrams(parts)
        derive(dq, tile(q, 16), stream(x, 16))
        derive(dkv, tile(x, 16), stream(q, 16))
