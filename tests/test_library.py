"""Each library diagram against an independent JAX implementation, on random inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat import library

TOL = {nc.f32: 2e-5, nc.bf16: 2e-2, nc.f16: 4e-3}


def rand(key, *shapes, dtype=nc.f32):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=False)]


def close(a, b, dtype=nc.f32):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [nc.f32, nc.bf16, nc.f16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_jax(key, dtype, causal):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype)
    Q, K, V = rand(key, (2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8), dtype=dtype)
    ours = nc.to_jax(attn)(Q, K, V)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn uses [b, n, h, d]
    ref = t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal))
    assert ours.dtype == dtype.jnp
    close(ours, ref, dtype)


def test_attention_scale_and_score_mod(key):
    q, x, d = nc.axes("q x d")

    def bias(s, q, x):
        return s - 0.25 * jnp.abs(q - x)

    attn = library.attention(q, x, d, scale=0.3, score_mod=bias)
    Q, K, V = rand(key, (6, 4), (9, 4), (9, 4))
    s = 0.3 * Q @ K.T - 0.25 * jnp.abs(jnp.arange(6)[:, None] - jnp.arange(9)[None, :])
    close(nc.to_jax(attn)(Q, K, V), jax.nn.softmax(s, axis=-1) @ V)


def test_attention_mask_fully_masked_rows_are_zero(key):
    q, x, d = nc.axes("q x d")
    attn = library.attention(q, x, d, mask=lambda q, x: (q > 0) & (x <= q))
    Q, K, V = rand(key, (4, 8), (4, 8), (4, 8))
    out = nc.to_jax(attn)(Q, K, V)
    assert not jnp.isnan(out).any()
    close(out[0], jnp.zeros(8))
    ref = jax.nn.dot_product_attention(
        Q[None, 1:, None],
        K[None, :, None],
        V[None, :, None],
        is_causal=False,
        mask=(jnp.arange(4)[None, :] <= jnp.arange(1, 4)[:, None])[None, None],
    )
    close(out[1:], ref[0, :, 0])


@pytest.mark.parametrize("dtype", [nc.f32, nc.bf16])
def test_grouped_and_multi_query_attention(key, dtype):
    hk, g, q, x, d = nc.axes("hk g q x d")
    gqa = library.grouped_query_attention(hk, g, q, x, d, causal=True, dtype=dtype)
    Q, K, V = rand(key, (2, 3, 5, 16), (2, 6, 16), (2, 6, 16), dtype=dtype)
    ours = nc.to_jax(gqa)(Q, K, V)
    # jax.nn layout [b, n, heads, d]: query heads are hk·g, kv heads hk
    Qj = jnp.transpose(Q.reshape(6, 5, 16), (1, 0, 2))[None]
    ref = jax.nn.dot_product_attention(
        Qj, jnp.transpose(K, (1, 0, 2))[None], jnp.transpose(V, (1, 0, 2))[None], is_causal=True
    )
    close(ours, jnp.transpose(ref[0], (1, 0, 2)).reshape(2, 3, 5, 16), dtype)

    h = nc.Axis("h")
    mqa = library.multi_query_attention(h, q, x, d, dtype=dtype)
    Q1 = Q.reshape(6, 5, 16)
    ref = jax.nn.dot_product_attention(jnp.transpose(Q1, (1, 0, 2))[None], K[0][:, None][None], V[0][:, None][None])
    close(nc.to_jax(mqa)(Q1, K[0], V[0]), jnp.transpose(ref[0], (1, 0, 2)), dtype)


def test_softmax_and_matmul(key):
    n, x, c = nc.axes("n x c")
    (S,) = rand(key, (3, 7))
    close(nc.to_jax(library.softmax(n, x))(S), jax.nn.softmax(S, axis=-1))
    A, B = rand(key, (3, 7), (7, 2))
    close(nc.to_jax(library.matmul(n, x, c))(A, B), A @ B)


def test_norms_and_mlp(key):
    n, d, h, o = nc.axes("n d h o")
    X, gm, bt = rand(key, (4, 16), (16,), (16,))
    mu, var = X.mean(-1, keepdims=True), X.var(-1, keepdims=True)
    close(nc.to_jax(library.layer_norm(n, d))(X, gm, bt), (X - mu) / jnp.sqrt(var + 1e-5) * gm + bt, nc.f32)
    rms = X / jnp.sqrt(jnp.mean(X**2, -1, keepdims=True) + 1e-6) * gm
    close(nc.to_jax(library.rms_norm(n, d))(X, gm), rms)
    W1, b1, W2, b2 = rand(key, (16, 8), (8,), (8, 3), (3,))
    ref = jax.nn.gelu(X @ W1 + b1, approximate=False) @ W2 + b2
    close(nc.to_jax(library.mlp(n, d, h, o))(X, W1, b1, W2, b2), ref, nc.f32)


def test_jit_is_one_jaxpr_and_vmap_grad(key):
    q, x, d = nc.axes("q x d")
    f = nc.to_jax(library.attention(q, x, d))
    Q, K, V = rand(key, (4, 8), (5, 8), (5, 8))
    jaxpr = jax.make_jaxpr(f)(Q, K, V)
    assert not any(e.primitive.name in ("pjit", "closed_call") for e in jaxpr.eqns)
    close(jax.jit(f)(Q, K, V), f(Q, K, V))
    Qs, Ks, Vs = rand(jax.random.fold_in(key, 1), (3, 4, 8), (3, 5, 8), (3, 5, 8))  # three different elements
    batched = jax.vmap(f)(Qs, Ks, Vs)
    for i in range(3):  # each is its own element's attention: nothing mixes across the batch
        ref = jax.nn.dot_product_attention(Qs[i][None, :, None], Ks[i][None, :, None], Vs[i][None, :, None])
        close(batched[i], ref[0, :, 0])
    g = jax.grad(lambda Q: f(Q, K, V).sum())(Q)
    gr = jax.grad(lambda Q: jax.nn.dot_product_attention(Q[None, :, None], K[None, :, None], V[None, :, None]).sum())(Q)
    close(g, gr)
