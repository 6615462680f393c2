"""Every lowered kernel, forward and gradients, against the independent references of tests/references.py
(plain jax.numpy / jax.nn, sharing no code with the generators that both ``nc.to_jax`` and the kernels run),
and against ``nc.to_jax``. Interpret mode on CPU; kernels are jitted so that a case compiles once.

Tolerances: ``python tests/measure_tolerances.py 10`` (10 seeds × the sizes below, interpret mode on CPU).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as R
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import lower
from rewrites import derive, stream, tile

# rel_err = max |error| / max |reference|, f32 (bf16 and f16: tests/test_lowering.py, tests/test_backward.py):
FWD = 2e-6  # measured ≤ 6.2e-7 (attention, GQA + ALiBi, matmul, softmax, norms, cross entropy)
GRAD = 4e-6  # measured ≤ 9.8e-7 for dQ, dK, dV


def normal(key, *shapes, dtype=nc.f32):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=True)]


def close(got, want, tol, seed, what):
    err = R.rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} (NAPKIN_SEED={seed})"


def value_and_pullback(f):
    """``(f(*args), vjp(f)(ct))`` as one jitted program (the eager reference would compile op by op)."""
    return jax.jit(lambda ct, *args: (lambda out, pullback: (out, pullback(ct)))(*jax.vjp(f, *args)))


def check_attention(kernel, diagram, reference, args, ct, seed, grads=True):
    """The output, against ``reference`` and ``nc.to_jax(diagram)``; then the output of the differentiable
    forward (the kernel that also emits the log-sum-exp) and the gradients w.r.t. every input. Returns the
    output."""
    want, theirs = value_and_pullback(reference)(ct, *args) if grads else (jax.jit(reference)(*args), None)
    out = jax.jit(kernel)(*args)
    close(out, want, FWD, seed, "output vs reference")
    close(out, jax.jit(nc.to_jax(diagram))(*args), FWD, seed, "output vs nc.to_jax")
    if not grads:
        return out
    out_with_residual, ours = value_and_pullback(kernel)(ct, *args)
    close(out_with_residual, want, FWD, seed, "output of the forward with residual vs reference")
    for name, g, w in zip("QKV", ours, theirs, strict=True):
        close(g, w, GRAD, seed, f"d{name} vs reference")
    return out


def mha_kernel(causal, **kw):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal)
    return attn, lower(derive(attn, tile(q, 16), stream(x, 16), verify=False), **kw)


@pytest.mark.parametrize(
    "causal, nq, nx",
    [(False, 37, 29), (True, 70, 21), (True, 20, 45)],  # ragged; causal with more queries than keys; fewer
)
def test_flash_attention(seed, key, causal, nq, nx):
    attn, kernel = mha_kernel(causal)
    args = normal(key, (1, 2, nq, 16), (1, 2, nx, 16), (1, 2, nx, 16))
    (ct,) = normal(jax.random.fold_in(key, 1), (1, 2, nq, 16))
    check_attention(kernel, attn, lambda *a: R.attention(*a, causal=causal), args, ct, seed)


def alibi(s, q, x):
    return s - 0.1 * jnp.abs(q - x).astype(jnp.float32)


def test_gqa_scale_alibi_causal(seed, key):
    """Grouped-query attention with an explicit scale, an ALiBi bias and the causal mask, all at once;
    queries outnumber keys. A score modifier has no lowered backward (test_backward.py checks the refusal
    and the reference backward)."""
    b, hk, g, q, x, d = nc.axes("b hk g q x d")
    gqa = nc.library.grouped_query_attention(hk, g, q, x, d, batch=(b,), scale=0.2, score_mod=alibi, causal=True)
    kernel = lower(derive(gqa, tile(q, 16), stream(x, 16), verify=False))
    args = normal(key, (2, 2, 3, 33, 16), (2, 2, 21, 16), (2, 2, 21, 16))

    def reference(Q, K, V):
        flat = Q.reshape(2, 6, 33, 16)  # query head hk·3 + g reads key/value head hk
        out = R.attention(flat, K, V, scale=0.2, causal=True, bias=lambda i, j: -0.1 * jnp.abs(i - j), groups=3)
        return out.reshape(Q.shape)

    check_attention(kernel, gqa, reference, args, None, seed, grads=False)


def test_gqa_and_mqa_lowered_gradients(seed, key):
    hk, g, h, q, x, d = nc.axes("hk g h q x d")
    gqa = nc.library.grouped_query_attention(hk, g, q, x, d, causal=True)
    kernel = lower(derive(gqa, tile(q, 16), stream(x, 16), verify=False))
    assert kernel.differentiation == "lowered"
    args = normal(key, (2, 3, 21, 16), (2, 40, 16), (2, 40, 16))
    (ct,) = normal(jax.random.fold_in(key, 1), (2, 3, 21, 16))

    def reference(Q, K, V):
        return R.attention(Q.reshape(6, 21, 16), K, V, causal=True, groups=3).reshape(Q.shape)

    check_attention(kernel, gqa, reference, args, ct, seed)
    mqa = nc.library.multi_query_attention(h, q, x, d)
    kernel = lower(derive(mqa, tile(q, 16), stream(x, 16), verify=False))
    args = normal(jax.random.fold_in(key, 2), (4, 20, 32), (50, 32), (50, 32))
    (ct,) = normal(jax.random.fold_in(key, 3), (4, 20, 32))
    check_attention(kernel, mqa, lambda Q, K, V: R.attention(Q, K[None], V[None], groups=4), args, ct, seed)


def test_mask_with_empty_rows(seed, key):
    """A mask that hides every key of rows 0–7: those rows are 0 (not NaN), the others as the reference."""
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d, mask=lambda q, x: (q >= 8) & (x <= q))
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False))
    args = normal(key, (32, 16), (40, 16), (40, 16))
    (ct,) = normal(jax.random.fold_in(key, 1), (32, 16))
    reference = lambda *a: R.attention(*a, mask=lambda i, j: (i >= 8) & (j <= i))  # noqa: E731
    out = check_attention(kernel, attn, reference, args, ct, seed)
    np.testing.assert_array_equal(np.asarray(out[:8]), 0)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 50), k=st.integers(1, 50), c=st.integers(1, 40), split_k=st.booleans())
def test_tiled_matmul(seed, key, n, k, c, split_k):
    a, b, cc = nc.axes("a b c")
    mm = nc.library.matmul(a, b, cc)
    rules = (tile(a, 16), stream(b, 16)) + (() if split_k else (tile(cc, 16),))
    A, B = normal(jax.random.fold_in(key, n * 10_000 + k * 100 + c), (n, k), (k, c))
    close(jax.jit(lower(derive(mm, *rules, verify=False)))(A, B), R.matmul(A, B), FWD, seed, "A·B")


def test_softmax_norms_cross_entropy(seed, key):
    n, xx, dd, v = nc.axes("n xx dd v")
    S, X, gamma, beta = normal(key, (37, 40), (20, 32), (32,), (32,))  # the softmax's 40 pads to 64
    kernel = lambda diagram, *rules: jax.jit(lower(derive(diagram, *rules, verify=False)))  # noqa: E731
    close(kernel(nc.library.softmax(n, xx), tile(n, 16))(S), R.softmax(S), FWD, seed, "softmax")
    layer_norm = kernel(nc.library.layer_norm(n, dd), tile(n, 16))
    close(layer_norm(X, gamma, beta), R.layer_norm(X, gamma, beta), FWD, seed, "layer norm")
    close(kernel(nc.library.rms_norm(n, dd), tile(n, 16))(X, gamma), R.rms_norm(X, gamma), FWD, seed, "RMS norm")
    stats = kernel(nc.library.layer_norm_statistics(n, dd), tile(n, 16), stream(dd, 16))(X)
    for got, want, what in zip(stats, R.layer_norm_statistics(X), ("mean", "1/std"), strict=True):
        close(got, want, FWD, seed, f"layer norm statistics: {what}")
    logits = S[:, :40]
    labels = jax.nn.one_hot(jax.random.randint(jax.random.fold_in(key, 1), (37,), 0, 40), 40)
    ce = kernel(nc.library.cross_entropy(n, v), tile(n, 16), stream(v, 16))(logits, labels)
    close(ce, R.cross_entropy(logits, labels), FWD, seed, "cross entropy")
