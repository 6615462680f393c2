"""jax.grad through lowered kernels equals jax.grad of the independent reference (tests/references.py), of
jax.nn.dot_product_attention and of the naive diagram. GQA, MQA and masks: tests/test_kernels_vs_jax.py."""

import jax
import jax.numpy as jnp
import pytest
import references as R
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import lower
from rewrites import derive, stream, tile

# rel_err of dQ, dK, dV against tests/references.py, interpret mode on CPU, measured by
# tests/measure_tolerances.py (10 seeds; q, x ∈ {37/29, 20/70, 70/21, 64/64}; causal or not; GQA + ALiBi):
TOL = {
    nc.f32: 4e-6,  # measured ≤ 9.8e-7
    nc.bf16: 1.5e-2,  # measured ≤ 6.2e-3 (inputs, cotangent and gradients rounded to bf16)
    nc.f16: 2.5e-3,  # measured ≤ 7.8e-4
}
# A compiled GPU kernel, bf16, 1000 keys, d = 128, against jax.nn in f32.
GPU_TOL = 4e-2


def rand(key, shapes, dtype=nc.f32):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=True)]


def grads(f, args, ct):
    return jax.vjp(f, *args)[1](ct.astype(args[0].dtype))


def jitted_grads(f, args, ct):
    """:func:`grads` as one compiled program: run eagerly, a reference compiles op by op at each drawn size."""
    return jax.jit(lambda ct, *a: grads(f, a, ct))(ct, *args)


def dpa(causal):
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn wants [b, n, h, d]
    return lambda Q, K, V: t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal))


def reference_grads(attn, causal, args, ct):
    """dQ, dK, dV of tests/references.py and of jax.nn (in f32, from the inputs upcast) and of the naive diagram
    (``nc.to_jax``, in the inputs' dtype): one program for the three, where three jits would compile three."""
    f32 = [a.astype(jnp.float32) for a in (*args, ct)]
    independent = grads(lambda *a: R.attention(*a, causal=causal), f32[:3], f32[3])
    return independent, grads(dpa(causal), f32[:3], f32[3]), grads(nc.to_jax(attn), args, ct)


# 3 examples a run (each derives and compiles a kernel at its sizes): the strategies still span every size, mask and
# dtype, a different 3 each run
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nq=st.integers(1, 50),
    nx=st.integers(1, 50),
    causal=st.booleans(),
    dtype=st.sampled_from([nc.f32, nc.bf16, nc.f16]),
)
def test_mha_gradients(seed, key, nq, nx, causal, dtype):
    """Ragged sizes, more queries than keys or fewer, causal or not: dQ, dK, dV of the lowered backward."""
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype)
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False))
    assert kernel.differentiation == "lowered"
    key = jax.random.fold_in(key, nq * 100 + nx)
    Q, K, V = rand(key, [(1, 2, nq, 16), (1, 2, nx, 16), (1, 2, nx, 16)], dtype)
    (ct,) = rand(jax.random.fold_in(key, 1), [(1, 2, nq, 16)], dtype)  # the cotangent in the output's dtype
    ours = jitted_grads(kernel, (Q, K, V), ct)
    independent, jax_nn, naive = jax.jit(lambda ct, *a: reference_grads(attn, causal, a, ct))(ct, Q, K, V)
    why = f"q={nq}, x={nx}, causal={causal}, {dtype} (NAPKIN_SEED={seed})"
    one_key = nx == 1 or (causal and nq == 1)  # every row sees one key: softmax is constant, so dS, dQ, dK ≡ 0
    for name, a, r, s, n in zip("QKV", ours, independent, jax_nn, naive, strict=True):
        if name in "QK" and one_key:  # relative to 0 is undefined: rounding, measured against dV's scale
            assert float(jnp.max(jnp.abs(a.astype(jnp.float32)))) <= TOL[dtype] * float(
                jnp.max(jnp.abs(independent[2]))
            ), f"d{name} ≠ 0: {why}"
            continue
        assert R.rel_err(a, r) <= TOL[dtype], f"d{name} vs reference: {why}"
        assert R.rel_err(a, s) <= TOL[dtype], f"d{name} vs jax.nn: {why}"
        # the naive diagram's gradients round like ours, each within TOL of the reference: 2·TOL apart
        assert R.rel_err(a, n) <= 2 * TOL[dtype], f"d{name} vs nc.to_jax: {why}"


def test_score_mod_gradients(seed, key):
    """An ALiBi-like score modifier: the lowered backward and the reference one, both against the reference."""
    q, x, d = nc.axes("q x d")

    def bias(s, q, x):
        return s - 0.1 * jnp.abs(q - x)

    attn = nc.library.attention(q, x, d, score_mod=bias)
    flash = derive(attn, tile(q, 16), stream(x, 16), verify=False)
    Q, K, V = rand(key, [(20, 16), (37, 16), (37, 16)])
    (ct,) = rand(jax.random.fold_in(key, 1), [(20, 16)])
    want = grads(lambda *a: R.attention(*a, bias=lambda i, j: -0.1 * jnp.abs(i - j)), (Q, K, V), ct)
    for how in ("lowered", "reference"):
        kernel = lower(flash, backward=how)
        assert kernel.differentiation == how
        got = jax.jit(lambda ct, *a, k=kernel: grads(k, a, ct))(ct, Q, K, V)
        for name, a, r in zip("QKV", got, want, strict=True):
            assert R.rel_err(a, r) <= TOL[nc.f32], f"d{name}, {how} backward (NAPKIN_SEED={seed})"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_compiled_gradients_on_gpu(key, causal):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=nc.bf16)
    kernel = lower(derive(attn, tile(q, 128), stream(x, 64), verify=False))
    Q, K, V = rand(key, [(2, 4, 1000, 128)] * 3, nc.bf16)
    (ct,) = rand(jax.random.fold_in(key, 1), [(2, 4, 1000, 128)])
    ours = jax.jit(lambda ct, *a: grads(kernel, a, ct))(ct, Q, K, V)
    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    ref = grads(dpa(causal), f32, ct.astype(nc.bf16.jnp).astype(jnp.float32))
    for a, r in zip(ours, ref, strict=True):
        assert R.rel_err(a, r) <= GPU_TOL
