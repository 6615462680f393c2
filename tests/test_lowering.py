"""Lowered attention against the independent reference (tests/references.py), the reference semantics and
jax.nn.dot_product_attention; the other kernels are in tests/test_kernels_vs_jax.py.

Interpret mode on CPU (CI); the same tests run compiled on a GPU (``-m gpu`` on the device machine).
"""

import jax
import jax.numpy as jnp
import pytest
import references as R
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, lower, plan
from lowering._plan import LOG2E, base2
from rewrites import derive, stream, tile

# rel_err = max |error| / max |reference| against tests/references.py, interpret mode on CPU, measured by
# tests/measure_tolerances.py (10 seeds; q, x ∈ {37/29, 20/70, 70/21, 64/64}; causal or not; GQA + ALiBi):
TOL = {
    nc.f32: 2e-6,  # measured ≤ 6.2e-7
    nc.bf16: 1e-2,  # measured ≤ 3.9e-3 (the output and P are rounded to bf16)
    nc.f16: 1.5e-3,  # measured ≤ 5.0e-4
}
# A compiled GPU kernel is checked in bf16/f16 only (f32 dots may run as TF32 there); 1000 keys, d = 128.
GPU_TOL = {nc.bf16: 2e-2, nc.f16: 5e-3}


def rand(key, shapes, dtype):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32).astype(dtype.jnp) for k, s in zip(keys, shapes, strict=True)]


def mha(dtype, causal=False, g=16, s=16, **kw):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype, **kw)
    return attn, lower(derive(attn, tile(q, g), stream(x, s), verify=False))


def dpa(Q, K, V, causal):
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn wants [b, n, h, d]
    return t(jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    nq=st.integers(1, 70),
    nx=st.integers(1, 70),
    dim=st.sampled_from([8, 16, 24, 64]),
    dtype=st.sampled_from([nc.f32, nc.bf16, nc.f16]),
    causal=st.booleans(),
    tiles=st.sampled_from([(16, 16), (32, 16), (16, 32)]),
)
def test_attention_matches_reference_and_jax(seed, key, nq, nx, dim, dtype, causal, tiles):
    """Any sizes, ragged or not, more queries than keys or fewer, causal or not (top-left aligned, as jax.nn:
    every query row sees key 0)."""
    attn, kernel = mha(dtype, causal, *tiles)
    Q, K, V = rand(jax.random.fold_in(key, nq * 100 + nx), [(2, 2, nq, dim), (2, 2, nx, dim), (2, 2, nx, dim)], dtype)
    out = jax.jit(kernel)(Q, K, V)
    assert out.shape == Q.shape and out.dtype == dtype.jnp
    why = f"q={nq}, x={nx}, d={dim}, {dtype}, causal={causal}, tiles={tiles} (NAPKIN_SEED={seed})"
    # the three references compiled as one program (run eagerly, they compile op by op at each drawn size;
    # jitted apart, three compiles): each still computed from the inputs by its own code
    reference, nn, naive = jax.jit(lambda *a: references(attn, causal, *a))(Q, K, V)
    assert R.rel_err(out, reference) <= TOL[dtype], why
    assert R.rel_err(out, nn) <= TOL[dtype], why
    # nc.to_jax rounds like the kernel, each within TOL of the reference: within 2·TOL of each other
    assert R.rel_err(out, naive) <= 2 * TOL[dtype], why


def references(attn, causal, Q, K, V):
    """tests/references.py, jax.nn in f32, and the diagram's own semantics (``nc.to_jax``), on the same inputs."""
    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    return R.attention(Q, K, V, causal=causal), dpa(*f32, causal), nc.to_jax(attn)(Q, K, V)


def test_jit_and_vmap(seed, key):
    """vmap over three different batch elements: each output is its own element's attention (no mixing)."""
    _, kernel = mha(nc.f32, causal=True)
    Q, K, V = rand(key, [(3, 1, 2, 20, 16), (3, 1, 2, 24, 16), (3, 1, 2, 24, 16)], nc.f32)
    out = jax.jit(jax.vmap(kernel))(Q, K, V)
    for i in range(3):
        assert R.rel_err(out[i], R.attention(Q[i], K[i], V[i], causal=True)) <= TOL[nc.f32], (
            f"batch element {i} (NAPKIN_SEED={seed})"
        )


def test_guards_raise_not_lowerable():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    with pytest.raises(NotLowerable, match=r"axis 'q': Triton blocks need a power-of-two tile ≥ 16, got g = 24"):
        lower(derive(attn, tile(q, 24), stream(x, 16), verify=False), backend="triton")
    with pytest.raises(NotLowerable, match=r"axis 'x': Triton blocks need a power-of-two stream size ≥ 16 \(or 1 "):
        lower(derive(attn, tile(q, 16), stream(x, 8), verify=False), backend="triton")
    odd = lower(derive(attn, tile(q, 24), stream(x, 16), verify=False))  # Triton's guard, not the plan's: auto goes on
    assert odd.backend == "xla" and "Triton blocks need a power-of-two tile" in odd.refused["forward"], odd.refused
    with pytest.raises(NotLowerable, match=r"box 'softmax·contract .*' contracts 'x' over 2 operands: a stream of 1"):
        lower(derive(attn, tile(q, 16), stream(x, 1), verify=False))
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
    assert R.rel_err(out, dpa(*f32, causal)) <= GPU_TOL[dtype]


def test_shared_memory_guard(key):
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    kernel = lower(derive(attn, tile(q, 128), stream(x, 128), verify=False))
    Q = jnp.ones((128, 512))
    with pytest.raises(NotLowerable, match=r"the kernel would hold 1,835,008 B of shared memory"):
        kernel(Q, Q, Q)


@pytest.mark.parametrize("dtype, scale", [(nc.bf16, 0.7), (nc.bf16, -0.7), (nc.f32, 0.7)])
def test_the_score_scale_moves_into_the_softmax_only_when_positive(seed, key, dtype, scale):
    """Where P meets a 16-bit V, a positive scale moves from Q·Kᵀ into the online softmax (``exp₂(s·c − m·c)``,
    its max of unscaled scores); a negative one cannot (the max would be the min), so it stays on the product and
    the softmax takes log₂e alone. In f32 nothing moves: log₂e joins the product's scale, so ``s − m`` stays
    exact. Each kernel against the independent reference, causal so that masked scores meet the scale."""
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True, scale=scale, dtype=dtype)
    sched = derive(attn, tile(q, 16), stream(x, 16), verify=False)
    boxes = base2(plan(sched.diagram).diagram).boxes
    on_product = [b.params.get("scale") for b in boxes if b.name.startswith("q d")]
    on_softmax = [b.params.get("scale") for b in boxes if b.name.startswith("softmax")]
    want = {
        (nc.bf16, True): [[None], [pytest.approx(scale * LOG2E)]],
        (nc.bf16, False): [[pytest.approx(scale)], [pytest.approx(LOG2E)]],
        (nc.f32, True): [[pytest.approx(scale * LOG2E)], [None]],
    }[dtype, scale > 0]
    assert [on_product, on_softmax] == want
    Q, K, V = rand(key, [(1, 2, 40, 16), (1, 2, 40, 16), (1, 2, 40, 16)], dtype)
    out = lower(sched)(Q, K, V)
    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    assert R.rel_err(out, R.attention(*f32, scale=scale, causal=True)) <= TOL[dtype], f"NAPKIN_SEED={seed}"
