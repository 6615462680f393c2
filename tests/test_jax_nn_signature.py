"""``nc.attention`` takes ``jax.nn.dot_product_attention``'s signature: each argument against
``jax.nn.dot_product_attention(..., implementation="xla")`` as the independent reference, forward and gradients
(dq, dk, dv, dbias), random inputs; and JAX's own tests of ``dot_product_attention`` (JAX's
``tests/nn_test.py``: ``testDotProductAttention``, ``testDotProductAttentionMask``,
``testDotProductAttentionBiasGradient``) with their parameter sets and assertions, on smaller sizes (interpret mode).

Every case shares its kernel with others where the signature repeats: the sizes are one of two shapes.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from lowering import NotLowerable, attention
from napkin_cat.errors import EvaluationError

B, N, H, D = 2, 24, 2, 16
TOL = 2e-5  # f32: measured max abs error of outputs and gradients ~5e-6
EPS = float(jnp.finfo(jnp.float32).eps)
nn = functools.partial(jax.nn.dot_product_attention, implementation="xla")


def normal(key, *shapes, dtype=jnp.float32):
    return [jax.random.normal(k, s, dtype) for k, s in zip(jax.random.split(key, len(shapes)), shapes, strict=True)]


def errors(f, g, q, k, v, bias, dout, **kw):
    """Max abs differences of the output and of dq, dk, dv, dbias between ``f`` and the reference ``g``."""

    @jax.jit  # both sides as one compiled program: run eagerly, jax.nn's reference compiles op by op
    def run_both(q, k, v, bias, dout):
        def run(fn):
            out, pull = jax.vjp(lambda q, k, v, b: fn(q, k, v, b, **kw), q, k, v, bias)
            return (out, *pull(dout))

        return run(f), run(g)

    ours, theirs = run_both(q, k, v, bias, dout)
    return [float(jnp.abs(a - b).max()) for a, b in zip(ours, theirs, strict=True)]


SHAPES = [(B, 1, 1, N), (1, H, 1, N), (B, H, N, 1), (1, 1, N, N), (H, 1, N), (B, 1, 1, 1), (N,)]


@settings(max_examples=2, deadline=None, phases=[Phase.generate])  # each example derives a kernel
@given(st.sampled_from(SHAPES), st.sampled_from(SHAPES), st.integers(0, 2**31 - 1))
def test_bias_and_mask_broadcast_without_materialising(bias_shape, mask_shape, seed):
    """Any bias and mask shape that broadcasts to [B, H, Nq, Nk]: output and gradients (the bias's summed over
    the axes it broadcasts) as jax.nn's; the kernel's inputs keep the arrays' own sizes."""
    q, k, v, dout, bias = normal(jax.random.key(seed), *[(B, N, H, D)] * 4, bias_shape)
    mask = jax.random.bernoulli(jax.random.key(seed + 1), 0.7, mask_shape)
    mask = mask.at[..., 0].set(True)  # every row keeps a key (jax.nn gives a fully masked row the mean of V)
    errs = errors(attention, nn, q, k, v, bias, dout, mask=mask)
    assert max(errs) <= TOL, f"(out, dq, dk, dv, dbias) {errs}; bias {bias_shape}, mask {mask_shape}, seed {seed}"
    made = attention.kernel_for(q, k, v, bias, mask)
    sizes = [w.axes for w in made.kernel.diagram.dom.inside[3:]]
    assert [len(a) for a in sizes] == [sum(n > 1 for n in s) for s in (bias_shape, mask_shape)]


def test_lengths_window_residual_and_traced_scale(key):
    """query_seq_lengths, key_value_seq_lengths, local_window_size, return_residual and a traced scale in one
    kernel: new lengths reuse it; the residual is jax.nn's log-sum-exp; gradients reach the scale."""
    q, k, v, dout, bias = normal(key, *[(B, N, H, D)] * 4, (1, H, N, N))
    kw = dict(local_window_size=(5, 2), return_residual=True)

    def loss(f, scale, q, k, v, bias, ql, kl):
        lengths = dict(query_seq_lengths=ql, key_value_seq_lengths=kl)
        return (f(q, k, v, bias, scale=scale, local_window_size=(5, 2), **lengths) * dout).sum()

    # the lengths are arguments, not constants: each gradient (ours, jax.nn's, jax.nn's by the whole bias)
    # compiles once for both sets of lengths (jax.nn's as one program, not op by op)
    ours_grad = jax.jit(jax.grad(functools.partial(loss, attention), argnums=(0, 1, 2, 3, 4)))
    nn_grad = jax.jit(jax.grad(functools.partial(loss, nn), argnums=(0, 1, 2, 3, 4)))
    nn_dlogits = jax.jit(jax.grad(functools.partial(loss, nn), argnums=4))
    # every row before its query length keeps a key in the window (jax.nn gives a fully masked row V's mean)
    for i, (ql, kl) in enumerate((([N, 13], [N, 10]), ([9, N], [6, 20]))):
        ql, kl = jnp.array(ql, jnp.int32), jnp.array(kl, jnp.int32)
        lengths = dict(query_seq_lengths=ql, key_value_seq_lengths=kl)
        before = attention.derivations
        out, lse = attention(q, k, v, bias, scale=0.3, **lengths, **kw)
        ref, ref_lse = nn(q, k, v, bias, scale=0.3, **lengths, **kw)
        assert i == 0 or attention.derivations == before  # new lengths reuse the kernel
        seen = (jnp.arange(N) < ql[:, None])[..., None]  # rows past a length: 0 in both, their lse jax.nn's own
        assert float(jnp.abs(out - ref).max()) <= TOL and lse.shape == ref_lse.shape == (B, N, H)
        assert float(jnp.abs(jnp.where(seen, lse - ref_lse, 0)).max()) <= TOL
        assert bool(jnp.where(seen, True, lse == ref_lse).all())

        grads = ours_grad(0.3, q, k, v, bias, ql, kl)
        want = nn_grad(0.3, q, k, v, bias, ql, kl)
        errs = [float(jnp.abs(a - b).max()) for a, b in zip(grads, want, strict=True)]
        assert max(errs[1:]) <= 5 * TOL, f"(dq, dk, dv, dbias) {errs[1:]}"
        # dscale sums dlogits·(q·k) over every score, with cancellation: its rounding error scales with the sum
        # of the terms' magnitudes, not with dscale (measured <= 3.0 eps of it over 120 seeds, mostly <= 1)
        dlogits = nn_dlogits(0.3, q, k, v, jnp.broadcast_to(bias, (B, H, N, N)), ql, kl)
        terms = float(jnp.abs(dlogits * jnp.einsum("bqhd,bkhd->bhqk", q, k)).sum())
        assert errs[0] <= 16 * EPS * terms, f"dscale {float(grads[0])} vs {float(want[0])}: {errs[0]} > 16 eps·{terms}"


def test_leading_batch_axes_and_implementation(key):
    """[..., N, H, D] arrays: leading axes flattened and restored (the reference maps jax.nn over them);
    implementation None / "xla" / "cudnn"."""
    q, k, v = normal(key, *[(3, B, N, H, D)] * 3)
    keep = jax.random.bernoulli(key, 0.8, (B, 1, 1, N)) | (jnp.arange(N) == 0)
    out = attention(q, k, v, mask=keep, is_causal=True)
    ref = jax.vmap(lambda q, k, v: nn(q, k, v, mask=keep, is_causal=True))(q, k, v)
    assert out.shape == ref.shape and float(jnp.abs(out - ref).max()) <= TOL
    made = attention.kernel_for(q[0], k[0], v[0], mask=keep, is_causal=True, implementation="xla")
    assert made.backend == "xla"
    assert float(jnp.abs(made(q[0], k[0], v[0], mask=keep) - ref[0]).max()) <= TOL
    with pytest.raises(NotLowerable, match="napkin-cat is not"):
        attention(q, k, v, implementation="cudnn")
    with pytest.raises(NotLowerable, match="backend='triton'"):
        attention(q, k, v, implementation="xla", backend="triton")


@pytest.mark.parametrize(
    "call, match",
    [
        (dict(bias=jnp.zeros((B, H, N, 3))), "does not broadcast to"),
        (dict(mask=jnp.ones((2, 2, 1, H, 1, N), bool)), "at most 4"),
        (dict(query_seq_lengths=jnp.array([1.0, 2.0])), "query_seq_lengths is float32"),
        (dict(key_value_seq_lengths=jnp.array([1, 2, 3])), r"expected integers of shape \[2\]"),
        (dict(local_window_size=(1, 2, 3)), "local_window_size must be"),
        (dict(implementation="flash"), "choose None, 'xla' or 'cudnn'"),
    ],
)
def test_refusals_name_the_argument(call, match):
    x = jnp.ones((B, N, H, D))
    with pytest.raises((EvaluationError, NotLowerable), match=match):
        attention(x, x, x, **call)


# JAX's tests/nn_test.py, their parameter sets and assertions; sizes B, S, T, N, H = 2, 32, 32, 4, 16 (theirs
# 128-query sequences, H = 32 or 64) so that interpret mode stays fast. Their reference is implementation=None.


@pytest.mark.slow  # one derivation per parameter set (~10 s each in interpret mode)
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_dot_product_attention(group_num, use_vmap):
    """JAX's testDotProductAttention (dtype bfloat16, impl 'xla' against nc.attention)."""
    dtype = jnp.bfloat16
    b, s, t, n, h, g = 2, 32, 32, 4, 16, group_num
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    Q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    K = jax.random.normal(keys[1], (b, s, n // g, h), dtype)
    V = jax.random.normal(keys[2], (b, s, n // g, h), dtype)
    grad = jax.random.normal(keys[3], (b, t, n, h), dtype)
    bias, mask = None, None
    sdpa_ref = functools.partial(jax.nn.dot_product_attention, implementation=None)
    sdpa_ans = attention
    if use_vmap:
        sdpa_ans = jax.vmap(sdpa_ans, in_axes=(0, 0, 0, None, None), out_axes=0)
    K_ref, V_ref = jnp.repeat(K, g, axis=2), jnp.repeat(V, g, axis=2)
    out_ref, sdpa_vjp_ref = jax.vjp(jax.jit(sdpa_ref), Q, K_ref, V_ref, bias, mask)
    out_ans, sdpa_vjp_ans = jax.vjp(sdpa_ans, Q, K, V, bias, mask)
    dQ_ref, dK_ref, dV_ref = sdpa_vjp_ref(grad)[:3]
    dQ_ans, dK_ans, dV_ans = sdpa_vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(b, s, n // g, g, h).sum(axis=3)
    dV_ref = dV_ref.reshape(b, s, n // g, g, h).sum(axis=3)
    close = functools.partial(jnp.allclose, atol=0.01, rtol=0.01)
    assert close(out_ref, out_ans) and close(dQ_ref, dQ_ans) and close(dK_ref, dK_ans) and close(dV_ref, dV_ans)


@pytest.mark.slow  # one derivation per parameter set (~10 s each in interpret mode)
@pytest.mark.parametrize(
    "mask_mode",
    ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"), ("bias", "causal"),
     ("causal", "sliding_window")],
)
def test_jax_dot_product_attention_mask(mask_mode):
    """JAX's testDotProductAttentionMask (cuDNN there, nc.attention here)."""
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.bfloat16
    b, s, t, n, h = 2, 32, 32, 4, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    Q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    K = jax.random.normal(keys[1], (b, s, n, h), dtype)
    V = jax.random.normal(keys[2], (b, s, n, h), dtype)
    grad = jax.random.normal(keys[3], (b, t, n, h), dtype)
    bias = mask = q_seqlen = kv_seqlen = window_size = None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([t // 2, t // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([s // 4, s // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((t, s), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
        bias = jax.random.normal(keys[4], (1, n, t, s), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    def fn(sdpa):
        return lambda q, k, v, b, m, qs, kvs: sdpa(
            q, k, v, b, m, is_causal=is_causal, query_seq_lengths=qs, key_value_seq_lengths=kvs,
            local_window_size=window_size,
        )

    args = (Q, K, V, bias, mask)
    out_ref, sdpa_vjp_ref = jax.vjp(jax.jit(fn(functools.partial(jax.nn.dot_product_attention, implementation=None))),
                                    *args, q_seqlen, kv_seqlen)
    out_ans, sdpa_vjp_ans = jax.vjp(fn(attention), *args, q_seqlen, kv_seqlen)
    ref, ans = sdpa_vjp_ref(grad)[:4], sdpa_vjp_ans(grad)[:4]
    assert jnp.allclose(out_ref, out_ans, atol=0.01, rtol=0.01)
    for r, a, tol in zip(ref, ans, (0.02, 0.02, 0.01, 0.02), strict=True):
        assert (r is None) == (a is None) and (r is None or jnp.allclose(r, a, atol=tol, rtol=tol))


@pytest.mark.slow  # one derivation per parameter set (~10 s each in interpret mode)
@pytest.mark.parametrize("batch_size", [1, 2])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_jax_dot_product_attention_bias_gradient(batch_size, use_vmap):
    """JAX's testDotProductAttentionBiasGradient: a [1, 1, S] mask (broadcast over batch, heads and queries) and a
    full bias. cuDNN refuses the bias gradient for batch sizes above 1; nc.attention computes it, so it is
    compared at every batch size."""
    dtype = jnp.bfloat16
    b, s, n, h = batch_size, 32, 4, 16
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(keys[0], (b, s, n, h), dtype)
    bias = jax.random.normal(keys[1], (b, n, s, s), dtype=dtype)
    mask = jnp.ones((1, 1, s), dtype=jnp.bool_)

    def attn(impl, x, bias, mask):
        return impl(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    attn_ref = functools.partial(attn, functools.partial(jax.nn.dot_product_attention, implementation="xla"))
    attn_ans = functools.partial(attn, attention)
    batched_ref, batched_ans = (jax.vmap(f, in_axes=(0, 0, None)) if use_vmap else f for f in (attn_ref, attn_ans))
    assert jnp.allclose(jax.jit(batched_ref)(x, bias, mask), jax.jit(batched_ans)(x, bias, mask), atol=0.01,
                        rtol=0.01)
    dbias_ref = jax.jit(lambda x, bias, mask: jax.vjp(attn_ref, x, bias, mask)[1](x)[1])(x, bias, mask)
    dbias_ans = jax.jit(lambda x, bias, mask: jax.vjp(attn_ans, x, bias, mask)[1](x)[1])(x, bias, mask)
    assert jnp.allclose(dbias_ans, dbias_ref, rtol=0.1, atol=0.1)
