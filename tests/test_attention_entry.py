"""The drop-in entry ``nc.attention`` against ``jax.nn.dot_product_attention``: outputs and gradients on
ragged shapes (causal and not, grouped-query, an ALiBi bias by score_mod, a window by mask_mod), the kernel
cache (a second call derives nothing), ``jit``/``vmap``/``grad``, and the refusals; the array arguments
(``bias`` with its gradient, ``mask``, ``segment_ids``) against ``jax.nn`` and the independent reference of
tests/references.py, in f32 and bf16; a value head dim other than the query/key head dim (MLA) against an
einsum reference written here (jax.nn requires equal dims).

Tolerance: the largest relative error (max |kernel − jax.nn| / max |jax.nn|) measured in f32 on CPU, outputs
and the gradients of q, k and v, was 6e-7 over the cases below; 1e-5 leaves room for other draws. bf16 uses
the tolerances measured for every kernel (tests/test_lowering.py, tests/test_backward.py): 1e-2 forward,
1.5e-2 gradients.
"""

import doctest
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as R
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, attention
from napkin_cat.errors import EvaluationError

TOL = 1e-5
#: (forward, gradients) per dtype: f32 as above; bf16 as measured for every kernel
ARRAY_TOL = {"float32": (TOL, TOL), "bfloat16": (1e-2, 1.5e-2)}


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def value_and_pullback(f):
    """``(f(*args), vjp(f)(ct))`` as one jitted program: a reference run eagerly compiles op by op, at each size."""
    return jax.jit(lambda ct, *args: (lambda out, pullback: (out, pullback(ct)))(*jax.vjp(f, *args)))


def arrays(seed: int, b: int, t: int, s: int, heads: int, kv_heads: int, d: int):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, heads, d))
    k, v = (jax.random.normal(key, (b, s, kv_heads, d)) for key in (kk, kv))
    return q, k, v, jax.random.normal(kc, (b, t, heads, d))  # the last: a cotangent for the outputs


def check_against_jax_nn(seed, q, k, v, ct, entry: dict, reference: dict):
    """Outputs and all three gradients (one vjp with the cotangent ``ct``) within TOL of jax.nn's."""
    out, grads = value_and_pullback(lambda *a: attention(*a, **entry))(ct, q, k, v)
    want, grads_ref = value_and_pullback(lambda *a: jax.nn.dot_product_attention(*a, **reference))(ct, q, k, v)
    errors = [rel(out, want)] + [rel(g, w) for g, w in zip(grads, grads_ref, strict=True)]
    assert max(errors) <= TOL, f"seed {seed}: relative errors (out, dq, dk, dv) {errors}"


@settings(max_examples=2, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(17, 32),
    s=st.integers(17, 32),
    heads=st.integers(1, 2),
    d=st.sampled_from([8, 16]),
    causal=st.booleans(),
)
def test_outputs_and_gradients_match_jax_nn(seed, t, s, heads, d, causal):
    """Ragged sizes (not multiples of the 32-wide tile and chunk), q ≠ x, multi-head."""
    q, k, v, ct = arrays(seed, 2, t, s, heads, heads, d)
    check_against_jax_nn(seed, q, k, v, ct, {"is_causal": causal}, {"is_causal": causal})


def alibi(score, h, q_idx, kv_idx):
    """ALiBi (Press et al. 2022) with slopes 2^-(h+1): reads the query head."""
    return score - 0.5 ** (h + 1) * jnp.abs(q_idx - kv_idx)


def test_grouped_query_alibi_causal_matches_jax_nn_with_a_bias():
    """Four query heads on two key/value heads; the score_mod's head index is the query head, as in jax.nn."""
    seed, t, s, heads = 11, 23, 29, 4
    q, k, v, ct = arrays(seed, 1, t, s, heads, 2, 16)
    distance = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(s)[None])
    bias = -(0.5 ** (jnp.arange(heads)[:, None, None] + 1)) * distance
    made = attention.kernel_for(q, k, v, is_causal=True, score_mod=alibi)
    assert (made.signature.group, made.differentiation) == (2, "lowered")
    check_against_jax_nn(seed, q, k, v, ct, {"is_causal": True, "score_mod": alibi}, {"is_causal": True, "bias": bias})


def window(q_idx, kv_idx):
    return abs(q_idx - kv_idx) <= 5


def test_mask_mod_matches_jax_nn_with_a_mask():
    seed, t, s = 3, 20, 27
    q, k, v, _ = arrays(seed, 1, t, s, 2, 2, 16)
    keep = jnp.abs(jnp.arange(t)[:, None] - jnp.arange(s)[None]) <= 5
    out = attention(q, k, v, mask_mod=window)
    assert rel(out, jax.nn.dot_product_attention(q, k, v, mask=keep)) <= TOL, f"seed {seed}"


def test_second_call_derives_nothing_under_jit_vmap_and_grad():
    q, k, v, _ = arrays(5, 2, 20, 20, 2, 2, 16)
    attention(q, k, v)  # derived here, or by an earlier test
    before = attention.derivations
    want = jax.nn.dot_product_attention(q, k, v)
    # other values and another length with the same schedule (tile and chunk 32): the same kernel
    assert rel(jax.jit(attention)(q, k * 2, v), jax.nn.dot_product_attention(q, k * 2, v)) <= TOL
    assert rel(jax.vmap(attention)(q[:, None], k[:, None], v[:, None])[:, 0], want) <= TOL
    assert attention(q[:, :19], k, v).shape == (2, 19, 2, 16)
    dq = jax.grad(lambda q: attention(q, k, v).sum())(q)
    assert rel(dq, jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v).sum())(q)) <= TOL
    assert attention.derivations == before
    assert nc.attention is attention and attention.kernel_for(q, k, v).kernel is attention.kernel_for(q, k, v).kernel


def test_layers_calling_one_kernel_trace_it_once(monkeypatch):
    """A model's layers calling the entry on equal shapes share the kernel's trace and lowering (its jit), under
    grad too: once one layer was traced, three more trace no pallas_call and derive nothing (each layer traced its
    kernels anew before, and each copy was lowered and compiled on its own: a 16-layer model's first step on a GPU
    took 100 s against the XLA reference's 14 s)."""
    from lowering.triton import TritonLowered

    q, k, v, _ = arrays(7, 1, 40, 40, 2, 1, 8)  # a signature of this test's own
    traced = []
    call = TritonLowered._call
    monkeypatch.setattr(TritonLowered, "_call", lambda self, *a: traced.append(self) or call(self, *a))

    def loss(layers, q):
        for _ in range(layers):
            q = attention(q, k, v, is_causal=True, backend="triton")
        return q.sum()

    jax.jit(jax.grad(functools.partial(loss, 1))).trace(q).lower()
    assert traced, "the first layer traced no kernel: the test no longer counts the kernels' traces"
    derived, traced[:] = attention.derivations, []
    jax.jit(jax.grad(functools.partial(loss, 3))).trace(q).lower()
    assert traced == [] and attention.derivations == derived


def test_score_mods_are_keyed_by_identity():
    q, k, v, _ = arrays(1, 1, 20, 20, 2, 2, 16)
    first = attention.kernel_for(q, k, v, score_mod=alibi)
    assert attention.kernel_for(q, k, v, score_mod=alibi) is first
    assert attention.kernel_for(q, k, v, score_mod=alibi, is_causal=True) is not first


@pytest.mark.parametrize(
    ("options", "shapes", "error", "match"),
    [
        ({"bias": jnp.zeros((20, 19))}, None, EvaluationError, r"bias has shape \(1, 1, 20, 19\), which does not"),
        ({"bias": jnp.zeros((3, 1, 20, 20))}, None, EvaluationError, r"= \[1, 2, 20, 20\]; give each axis its size"),
        ({"bias": jnp.zeros((20, 20), int)}, None, EvaluationError, "bias has dtype int32; expected one of float32"),
        ({"mask": jnp.ones((20, 20))}, None, EvaluationError, "mask has dtype float32; expected one of bool"),
        ({"segment_ids": jnp.zeros((1, 20))}, None, EvaluationError, "segment_ids for the query side are float32"),
        (
            {"segment_ids": (jnp.zeros((1, 20), int), jnp.zeros((1, 9), int))},
            None,
            EvaluationError,
            r"segment_ids for the key/value side are int32 \(1, 9\); expected integers of shape \[B, Nk\] = \[1, 20\]",
        ),
        ({"backend": "cuda"}, None, NotLowerable, "backend 'cuda'"),
        ({}, ((1, 20, 3, 16), (1, 20, 2, 16)), EvaluationError, "3 heads are not a multiple of k's and v's 2"),
        ({}, ((1, 20, 2, 16), (1, 20, 2, 8)), EvaluationError, "q and k must agree on batch and head dim"),
        ({}, ((20, 2, 16), (1, 20, 2, 16)), EvaluationError, r"\[batch, seq, heads, dim\] or \[seq, heads, dim\]"),
    ],
)
def test_refusals_name_the_condition(options, shapes, error, match):
    qs, ks = shapes or ((1, 20, 2, 16), (1, 20, 2, 16))
    before = attention.derivations
    with pytest.raises(error, match=match):
        attention(jnp.zeros(qs), jnp.zeros(ks), jnp.zeros(ks), **options)
    assert attention.derivations == before


def mla_reference(q, k, v, *, causal: bool, scale=None):
    """Attention with q's and k's head dim ≠ v's, in f32 by einsum (jax.nn requires equal dims): repeat the
    key/value heads for grouped-query attention, scale by 1/√(q's dim) unless told, mask, softmax, weigh v."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if causal:
        s = jnp.where(jnp.arange(q.shape[1])[:, None] >= jnp.arange(k.shape[1]), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(s, axis=-1), v)


def check_value_dim(seed, dtype, t, s, heads, kv_heads, d, dv, causal):
    """Output and the gradients of q, k, v (one vjp, a random cotangent) against :func:`mla_reference` in f32
    on the same (rounded) inputs, within the dtype's tolerance; the kernel has v's head dim of its own."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k = jax.random.normal(kq, (2, t, heads, d), dtype), jax.random.normal(kk, (2, s, kv_heads, d), dtype)
    v, ct = jax.random.normal(kv, (2, s, kv_heads, dv), dtype), jax.random.normal(kc, (2, t, heads, dv), dtype)
    made = attention.kernel_for(q, k, v, is_causal=causal)
    assert (made.signature.value_dim, made.differentiation) == (True, "lowered")
    out, grads = value_and_pullback(lambda *a: attention(*a, is_causal=causal))(ct, q, k, v)
    f32 = (a.astype(jnp.float32) for a in (ct, q, k, v))
    want, grads_ref = value_and_pullback(lambda *a: mla_reference(*a, causal=causal))(*f32)
    fwd, grad = ARRAY_TOL[jnp.dtype(dtype).name]
    assert out.shape == (2, t, heads, dv) and out.dtype == dtype
    assert rel(out.astype(jnp.float32), want) <= fwd, f"NAPKIN_SEED={seed}: output"
    for name, g, w in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        assert g.dtype == dtype and rel(g.astype(jnp.float32), w) <= grad, f"NAPKIN_SEED={seed}: {name}"


# Measured (check_value_dim in a loop over seeds 0-3 at (23, 29, 48, 32, GQA, causal),
# (37, 20, 16, 8), (20, 70, 32, 16, GQA, causal)): f32 ≤ 3.9e-7 forward, 5.6e-7 gradients; bf16 ≤ 3.7e-3
# forward, 5.9e-3 gradients — within ARRAY_TOL's (1e-5, 1e-5) and (1e-2, 1.5e-2).
@settings(max_examples=1, deadline=None)  # each example derives, verifies and lowers a kernel and its backward
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(9, 24),
    s=st.integers(9, 24),
    kv_heads=st.sampled_from([1, 2]),
    dims=st.sampled_from([(48, 32), (16, 8), (8, 24)]),
    causal=st.booleans(),
)
def test_value_head_dim_other_than_query_key_head_dim(seed, t, s, kv_heads, dims, causal):
    """MLA's shape (q, k: 48, v: 32; and v wider than q), ragged q ≠ x, GQA and not, f32."""
    check_value_dim(seed, jnp.float32, t, s, 2, kv_heads, *dims, causal)


def test_value_head_dim_in_bf16(seed):
    check_value_dim(seed, jnp.bfloat16, 21, 27, 4, 2, 48, 32, True)


def test_value_head_dim_shares_a_kernel_and_is_checked():
    """Another length with the same schedule reuses the kernel; k and v disagreeing on keys is refused."""
    q, v = jnp.ones((1, 20, 2, 24)), jnp.ones((1, 20, 2, 8))
    attention(q, q, v)
    before = attention.derivations
    assert attention(q[:, :19], q, v).shape == (1, 19, 2, 8) and attention.derivations == before
    with pytest.raises(EvaluationError, match="k and v must agree on batch, keys and heads"):
        attention(q, q, v[:, :19])


def random_arrays(seed: int, dtype, b, t, s, heads, kv_heads, bias_shape, mask_shape):
    """q, k, v, a cotangent, a bias and a mask (each key kept with probability 0.8; key 0 always, so no row
    is empty and jax.nn's masking agrees with ours), all random."""
    kq, kk, kv, kc, kb, km = jax.random.split(jax.random.key(seed), 6)
    q, ct = (jax.random.normal(key, (b, t, heads, 16), dtype) for key in (kq, kc))
    k, v = (jax.random.normal(key, (b, s, kv_heads, 16), dtype) for key in (kk, kv))
    bias = jax.random.normal(kb, bias_shape, dtype)
    mask = jax.random.bernoulli(km, 0.8, mask_shape).at[..., 0].set(True)
    return q, k, v, ct, bias, mask


def heads_major(*arrays):
    return [jnp.swapaxes(a, 1, 2) for a in arrays]


@settings(max_examples=1, deadline=None)  # each example derives, verifies and lowers a kernel and its backward
@given(
    seed=st.integers(0, 2**31 - 1),
    t=st.integers(9, 24),
    s=st.integers(9, 24),
    kv_heads=st.sampled_from([1, 2]),
    bias_shape=st.sampled_from([(2, 2), (1, 2), (1, 1), (2, 1)]),
    mask_shape=st.sampled_from([(2, 2), (1, 1)]),
    causal=st.booleans(),
)
def test_bias_and_mask_match_jax_nn_and_the_reference(seed, t, s, kv_heads, bias_shape, mask_shape, causal):
    """Outputs and the gradients of q, k, v and the bias, every broadcast of the bias and the mask, GQA and
    not, ragged q ≠ x: against jax.nn.dot_product_attention(bias=, mask=) and tests/references.py."""
    heads = 2
    q, k, v, ct, bias, mask = random_arrays(
        seed, jnp.float32, 2, t, s, heads, kv_heads, (*bias_shape, t, s), (*mask_shape, t, s)
    )
    if causal:
        mask = mask.at[..., :, 0].set(True)
    entry = lambda q, k, v, bias: attention(q, k, v, bias, mask, is_causal=causal)  # noqa: E731
    nn = lambda q, k, v, bias: jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=causal)  # noqa: E731

    def reference(q, k, v, bias):
        Q, K, V = heads_major(q, k, v)
        out = R.attention(
            Q, K, V, causal=causal, bias=lambda i, j: bias, mask=lambda i, j: mask, groups=heads // kv_heads
        )
        return jnp.swapaxes(out, 1, 2)

    out, grads = value_and_pullback(entry)(ct, q, k, v, bias)
    for name, other in (("jax.nn", nn), ("reference", reference)):
        want, grads_other = value_and_pullback(other)(ct, q, k, v, bias)
        errors = [rel(out, want)] + [rel(g, w) for g, w in zip(grads, grads_other, strict=True)]
        assert max(errors) <= TOL, f"seed {seed}: vs {name}, relative errors (out, dq, dk, dv, dbias) {errors}"
    assert attention.kernel_for(q, k, v, bias, mask, is_causal=causal).differentiation == "lowered"


def test_bf16_bias_mask_and_segments(seed):
    """bf16 inputs, a learnable per-head bias, a shared mask and segment ids, grouped-query: the output and
    every gradient against the reference in f32 on the same (rounded) inputs, within bf16's tolerance."""
    t = s = 24
    q, k, v, ct, bias, mask = random_arrays(seed, jnp.bfloat16, 2, t, s, 4, 2, (1, 4, t, s), (t, s))
    ids = jnp.array([[0] * 10 + [1] * 14, [0] * 24])
    mask = mask | (jnp.arange(t)[:, None] == jnp.arange(s))  # the diagonal: every row sees its own segment
    fwd, grad = ARRAY_TOL["bfloat16"]

    def reference(q, k, v, bias):
        Q, K, V = heads_major(q, k, v)
        same = (ids[:, None, :, None] == ids[:, None, None, :]) & mask
        return jnp.swapaxes(R.attention(Q, K, V, bias=lambda i, j: bias, mask=lambda i, j: same, groups=2), 1, 2)

    entry = lambda q, k, v, bias: attention(q, k, v, bias, mask, segment_ids=ids)  # noqa: E731
    out, grads = value_and_pullback(entry)(ct, q, k, v, bias)
    want, grads_ref = value_and_pullback(reference)(ct.astype(jnp.float32), q, k, v, bias)
    assert out.dtype == jnp.bfloat16 and rel(out.astype(jnp.float32), want) <= fwd, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref, strict=True):
        assert g.dtype == jnp.bfloat16 and rel(g.astype(jnp.float32), w) <= grad, f"{name}: NAPKIN_SEED={seed}"


def test_a_bias_and_a_mask_at_head_dim_128_fit_the_h100s_shared_memory(seed):
    """At head dim 128 the rule streams 128-key chunks; an f32 bias and a mask streamed beside K and V would
    take the kernel over an H100 block's 232,448 B (a NotLowerable at the first call, before this was fitted),
    so the chunk halves, to 32 for both (``lowering._tiles.fit_blocks``: 128 × 64 blocks would hold 248 KiB).
    Output and every gradient against the reference, bf16 inputs and an f32 bias."""
    t = s = 128
    kq, kk, kv, kc, kb, km = jax.random.split(jax.random.key(seed), 6)
    q, k, v, ct = (jax.random.normal(key, (1, t, 2, 128), jnp.bfloat16) for key in (kq, kk, kv, kc))
    bias = jax.random.normal(kb, (1, 2, t, s), jnp.float32)
    mask = jax.random.bernoulli(km, 0.8, (1, 1, t, s)).at[..., 0].set(True)
    entry = lambda q, k, v, bias: attention(q, k, v, bias, mask, hardware="H100")  # noqa: E731
    sig = attention.kernel_for(q, k, v, bias, mask, hardware="H100").signature
    assert (sig.tile, sig.stream) == (128, 32)
    assert attention.kernel_for(q, k, v, hardware="H100").signature.stream == 128
    fwd, grad = ARRAY_TOL["bfloat16"]

    def reference(q, k, v, bias):
        Q, K, V = heads_major(q, k, v)
        return jnp.swapaxes(R.attention(Q, K, V, bias=lambda i, j: bias, mask=lambda i, j: mask), 1, 2)

    out, grads = value_and_pullback(entry)(ct, q, k, v, bias)
    f32 = [a.astype(jnp.float32) for a in (ct, q, k, v)]
    want, grads_ref = value_and_pullback(reference)(*f32, bias)
    assert rel(out.astype(jnp.float32), want) <= fwd, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), grads, grads_ref, strict=True):
        assert rel(g.astype(jnp.float32), w) <= grad, f"{name}: NAPKIN_SEED={seed}"


def test_segment_ids_are_read_at_call_time(seed):
    """One kernel for any ids (no derivation on new ids, under jit and vmap); a (q_ids, kv_ids) pair for
    cross attention with q ≠ x; against the reference with the equivalent mask."""
    q, k, v, _ = arrays(seed, 2, 20, 28, 2, 2, 16)
    qi, ki = (jax.random.randint(jax.random.key(seed + i), (2, n), 0, 3) for i, n in ((1, 20), (2, 28)))
    qi, ki = qi.sort(-1), ki.at[:, :3].set(jnp.arange(3)).sort(-1)  # every query id among the keys': no empty row
    keep = qi[:, None, :, None] == ki[:, None, None, :]
    want = R_attention_masked(q, k, v, keep)
    assert rel(attention(q, k, v, segment_ids=(qi, ki)), want) <= TOL, f"NAPKIN_SEED={seed}"
    before = attention.derivations
    assert rel(jax.jit(attention)(q, k, v, segment_ids=(qi + 5, ki + 5)), want) <= TOL, f"NAPKIN_SEED={seed}"
    batched = jax.vmap(lambda q, k, v, a, b: attention(q, k, v, segment_ids=(a, b)))(q, k, v, qi, ki)
    assert rel(batched, want) <= TOL, f"NAPKIN_SEED={seed}"
    assert attention.derivations == before


def R_attention_masked(q, k, v, keep):
    """tests/references.py's attention on jax.nn's layout with a [B, H or 1, Nq, Nk] mask."""
    Q, K, V = heads_major(q, k, v)
    return jnp.swapaxes(R.attention(Q, K, V, mask=lambda i, j: keep), 1, 2)


def test_fully_masked_rows_give_zero_where_jax_nn_gives_the_mean_of_v():
    """The project's convention (lowering/_api.py): an empty row gives 0 and finite gradients; jax.nn masks
    with a large finite negative number, so its empty row is the mean of V over the keys."""
    q, k, v, _ = arrays(8, 1, 20, 20, 2, 2, 16)
    mask = jnp.ones((20, 20), bool).at[3].set(False)
    out = attention(q, k, v, mask=mask)
    assert bool((out[:, 3] == 0).all()) and bool(jnp.isfinite(out).all())
    nn = jax.nn.dot_product_attention(q, k, v, mask=mask)
    np.testing.assert_allclose(nn[:, 3], v.mean(1), atol=1e-5)
    assert rel(jnp.delete(out, 3, 1), jnp.delete(nn, 3, 1)) <= TOL
    bias = jnp.zeros((1, 2, 20, 20))
    grads = jax.grad(lambda q, b: attention(q, k, v, b, mask).sum(), argnums=(0, 1))(q, bias)
    assert all(bool(jnp.isfinite(g).all()) for g in grads) and bool((grads[1][..., 3, :] == 0).all())


def test_the_entry_example_in_docs_lowering_md_runs():
    path = Path(__file__).parent.parent / "docs" / "lowering.md"
    failed, tried = doctest.testfile(str(path), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert tried > 0 and failed == 0


@pytest.mark.gpu
def test_compiled_bias_mask_and_segments_on_gpu(seed):
    """Compiled (not interpreted): bf16, 1000 tokens, d = 128, a per-head learnable bias, a bool mask and
    segment ids, outputs and gradients against the reference in f32, within tests/test_backward.py's
    GPU tolerance (bf16 on a GPU, 1000 keys: 4e-2)."""
    n = 1000
    q, k, v, ct, bias, mask = random_arrays(seed, jnp.bfloat16, 2, n, n, 4, 2, (1, 4, n, n), (n, n))
    mask = mask | jnp.eye(n, dtype=bool)
    ids = jnp.stack([jnp.arange(n) // 300, jnp.arange(n) // 700])

    def reference(q, k, v, bias):
        Q, K, V = heads_major(q, k, v)
        same = (ids[:, None, :, None] == ids[:, None, None, :]) & mask
        out = R.attention(Q, K, V, causal=True, bias=lambda i, j: bias, mask=lambda i, j: same, groups=2)
        return jnp.swapaxes(out, 1, 2)

    entry = jax.jit(lambda q, k, v, bias: attention(q, k, v, bias, mask, is_causal=True, segment_ids=ids))
    out, pull = jax.vjp(entry, q, k, v, bias)
    want, pull_ref = jax.vjp(reference, *(a.astype(jnp.float32) for a in (q, k, v, bias)))
    assert rel(out.astype(jnp.float32), want) <= 4e-2, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv", "dbias"), pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True):
        assert rel(g.astype(jnp.float32), w) <= 4e-2, f"{name}: NAPKIN_SEED={seed}"


@pytest.mark.gpu
def test_compiled_ragged_shape_runs_the_triton_stand_in_at_mosaics_chunks(seed):
    """Compiled, bf16, causal, 1000 tokens (not whole blocks of 128: Mosaic refuses the shape), D = 128: the
    Triton kernel of the same diagram stands in for every kernel, dQ at Mosaic's 128-key chunks in the two stages
    that fit (under auto dQ used to halve to 64 on Mosaic too, for this stand-in's three stages); output and
    gradients against the einsum reference in f32, tests/test_backward.py's GPU tolerance (bf16: 4e-2)."""
    n = 1000
    q, k, v, ct = (jax.random.normal(jax.random.key(seed + i), (2, n, 4, 128), jnp.bfloat16) for i in range(4))
    made = attention.kernel_for(q, k, v, is_causal=True)
    out, pull = jax.vjp(jax.jit(lambda *a: attention(*a, is_causal=True)), q, k, v)
    grads = pull(ct)  # the backward's kernels at these shapes are built here
    backends = made.kernel.backends
    dq = [r for r in backends if "d(input 0)" in r]
    assert any("stream(kv_idx, 128)" in r for r in dq) and "triton" in {backends[r] for r in dq}, backends
    want, pull_ref = jax.vjp(lambda *a: mla_reference(*a, causal=True), *(a.astype(jnp.float32) for a in (q, k, v)))
    assert rel(out.astype(jnp.float32), want) <= 4e-2, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv"), grads, pull_ref(ct.astype(jnp.float32)), strict=True):
        assert rel(g.astype(jnp.float32), w) <= 4e-2, f"{name}: NAPKIN_SEED={seed}"


def test_a_value_head_dim_of_its_own_stays_in_the_block_not_on_the_grid():
    """MLA's value head dim (``dv``: q and k 192, v 128) is an axis no box combines elements along, but the product
    QKᵀ lacks it: on the grid, each of its 128 programs would recompute QKᵀ for one output column (measured on an
    H200 before this rule: 1.6 TFLOP/s forward). Every kernel keeps it whole, as it keeps ``d``."""
    q, v = jnp.zeros((1, 128, 2, 192), jnp.bfloat16), jnp.zeros((1, 128, 2, 128), jnp.bfloat16)
    kernel = attention.kernel_for(q, q, v, is_causal=True).kernel
    grids = [line for line in kernel.source.splitlines() if "grid:" in line]
    assert len(grids) == 5 and not any("dv" in line for line in grids), grids


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [80, 96])
def test_compiled_head_dims_that_are_not_a_power_of_two_give_every_gradient_on_gpu(seed, dim):
    """Compiled, bf16, causal, 1024 tokens, head dims 80 and 96: the entry pads them (``padded_heads``) and every
    gradient matches the einsum reference in f32 (before, the kernels' own padding gave dK 13–28% wrong on an
    H200 while the output, dQ and dV were right); tests/test_backward.py's GPU tolerance (bf16: 4e-2)."""
    n = 1024
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k, v, ct = (jax.random.normal(key, (2, n, 4, dim), jnp.bfloat16) for key in (kq, kk, kv, kc))
    out, pull = jax.vjp(jax.jit(lambda *a: attention(*a, is_causal=True)), q, k, v)
    want, pull_ref = jax.vjp(lambda *a: mla_reference(*a, causal=True), *(a.astype(jnp.float32) for a in (q, k, v)))
    assert rel(out.astype(jnp.float32), want) <= 4e-2, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv"), pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True):
        assert rel(g.astype(jnp.float32), w) <= 4e-2, f"{name}: NAPKIN_SEED={seed}"


@pytest.mark.gpu
def test_compiled_value_head_dim_on_gpu(seed):
    """Compiled: bf16, 1000 tokens, MLA's head dims (q, k: 192; v: 128), grouped-query, causal. The schedule
    sizes the tile by both dims: on Hopper, Mosaic's own wide blocks (128 queries, measured faster there since stop
    40: ``MOSAIC_BLOCKS.faster_wide``), else Triton's 64; the forward and backward kernels fit shared memory; against
    the einsum reference in f32 within tests/test_backward.py's GPU tolerance (bf16, 1000 keys: 4e-2)."""
    from lowering.mosaic._policy import MOSAIC_BLOCKS

    n = 1000
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k = jax.random.normal(kq, (2, n, 4, 192), jnp.bfloat16), jax.random.normal(kk, (2, n, 2, 192), jnp.bfloat16)
    v, ct = jax.random.normal(kv, (2, n, 2, 128), jnp.bfloat16), jax.random.normal(kc, (2, n, 4, 128), jnp.bfloat16)
    made = attention.kernel_for(q, k, v, is_causal=True)
    mosaic = set(made.kernel.backends.values()) == {"mosaic"}
    assert made.signature.tile == (MOSAIC_BLOCKS.entry(192, 128)[0] if mosaic else 64), made.kernel.backends
    out, pull = jax.vjp(jax.jit(lambda *a: attention(*a, is_causal=True)), q, k, v)
    want, pull_ref = jax.vjp(lambda *a: mla_reference(*a, causal=True), *(a.astype(jnp.float32) for a in (q, k, v)))
    assert rel(out.astype(jnp.float32), want) <= 4e-2, f"NAPKIN_SEED={seed}"
    for name, g, w in zip(("dq", "dk", "dv"), pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True):
        assert rel(g.astype(jnp.float32), w) <= 4e-2, f"{name}: NAPKIN_SEED={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [50.0, 5.0])
def test_compiled_soft_cap_on_gpu(seed, cap):
    """Compiled bf16 soft-capping, whose tanh is the GPU's ``tanh.approx.f32`` (tests/test_cuda_lowering.py
    checks the instruction): causal, 1000 tokens, scores of standard deviation 4 so that cap 5 saturates,
    output and gradients against soft-capped attention written here in f32, within tests/test_backward.py's
    GPU tolerance (bf16, 1000 keys: 4e-2)."""
    n = 1000
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k, v, ct = (jax.random.normal(key, (2, n, 4, 128), jnp.bfloat16) for key in (kq, kk, kv, kc))
    q = (4 * q.astype(jnp.float32)).astype(jnp.bfloat16)

    def reference(q, k, v):
        s = jnp.einsum("bqhd,bxhd->bhqx", q, k, precision="highest") / np.sqrt(q.shape[-1])
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), cap * jnp.tanh(s / cap), -jnp.inf)
        return jnp.einsum("bhqx,bxhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")

    entry = jax.jit(lambda *a: attention(*a, is_causal=True, score_mod=nc.library.SoftCap(cap)))
    out, pull = jax.vjp(entry, q, k, v)
    want, pull_ref = jax.vjp(reference, *(a.astype(jnp.float32) for a in (q, k, v)))
    errors = [rel(out.astype(jnp.float32), want)]
    errors += [rel(g.astype(jnp.float32), w) for g, w in zip(pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True)]
    print(f"soft cap {cap}: relative errors (out, dq, dk, dv) {errors}")
    assert max(errors) <= 4e-2, f"relative errors (out, dq, dk, dv) {errors}: NAPKIN_SEED={seed}"


def test_the_entrys_blocks_at_head_dim_64_are_mosaics_on_hopper(hopper):
    """At D = 64 the entry's rule gives FlashAttention-2's 128 × 64, which Mosaic runs slower than Triton; on an
    sm_90 GPU (compiled, no bias or mask array, which keep the kernels on Triton) it takes Mosaic's measured
    256 × 128 (``lowering.mosaic.MOSAIC_BLOCKS.entry``), and auto runs every kernel on Mosaic."""
    from lowering import lower
    from lowering._attention import Signature

    x = jnp.zeros((1, 1024, 2, 64), jnp.bfloat16)
    assert (Signature.of(x, x, x).tile, Signature.of(x, x, x).stream) == (128, 64)  # on the CPU
    hopper()
    sig = Signature.of(x, x, x, interpret=False, is_causal=True)
    assert (sig.tile, sig.stream) == (256, 128)
    assert (Signature.of(x, x, x, interpret=True).tile, Signature.of(x, x, x, backend="triton").tile) == (128, 128)
    bias = jnp.zeros((1, 2, 1024, 1024), jnp.bfloat16)
    assert (Signature.of(x, x, x, bias, interpret=False).tile, Signature.of(x[:, :100], x, x).tile) == (128, 128)
    kernel = lower(sig.derivation(), backend="auto", interpret=False)
    assert set(kernel.backends.values()) == {"mosaic"}, kernel.refused


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_the_entry_runs_on_mosaic_on_hopper(seed, d):
    """On an sm_90 GPU ``backend="auto"`` gives ``nc.attention`` Mosaic kernels where they were measured faster
    (every kernel, at D = 64 with Mosaic's own 256 × 128 forward blocks), each named
    in ``backends``; output and gradients against ``jax.nn.dot_product_attention`` in f32, causal, 1024 tokens,
    within the compiled bf16 tolerance of tests/test_backward.py (4e-2)."""
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q, k, v, ct = (jax.random.normal(key, (2, 1024, 4, d), jnp.bfloat16) for key in (kq, kk, kv, kc))
    backends = attention.kernel_for(q, k, v, is_causal=True).kernel.backends
    backward = [b for r, b in backends.items() if r.startswith("backward kernel")]
    fused = d == 64  # dQ accumulated in the dK·dV kernel (tests/test_fused_dq.py): Δ and one kernel, else three
    assert backward == ["mosaic"] * (2 if fused else 3) and backends["forward"] == "mosaic", backends
    out, pull = jax.vjp(jax.jit(lambda *a: attention(*a, is_causal=True)), q, k, v)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want, pull_ref = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, is_causal=True), *f32)
    errors = [rel(out.astype(jnp.float32), want)]
    errors += [rel(g.astype(jnp.float32), w) for g, w in zip(pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True)]
    assert max(errors) <= 4e-2, f"relative errors (out, dq, dk, dv) {errors}: NAPKIN_SEED={seed}"


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_packed_documents_run_on_mosaic_on_hopper(seed, causal):
    """Segment ids on Mosaic, compiled (``backend="mosaic"``: every kernel, the chunks the ids hide skipped): five
    documents of random lengths packed into 1024 tokens, D = 128, output and gradients against
    ``jax.nn.dot_product_attention`` with the documents' mask in f32, within the compiled bf16 tolerance."""
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    kq, kk, kv, kc, kd = jax.random.split(jax.random.key(seed), 5)
    q, k, v, ct = (jax.random.normal(key, (2, 1024, 4, 128), jnp.bfloat16) for key in (kq, kk, kv, kc))
    cuts = jnp.sort(jax.random.choice(kd, jnp.arange(1, 1024), (2, 4), replace=False), axis=-1)
    ids = jax.vmap(lambda c: jnp.searchsorted(c, jnp.arange(1024), side="right"))(cuts).astype(jnp.int32)
    run = lambda *a: attention(*a, is_causal=causal, segment_ids=ids, backend="mosaic")  # noqa: E731
    backends = attention.kernel_for(q, k, v, is_causal=causal, segment_ids=ids, backend="mosaic").kernel.backends
    assert set(backends.values()) == {"mosaic"}, backends
    out, pull = jax.vjp(jax.jit(run), q, k, v)
    keep = (ids[:, None, :, None] == ids[:, None, None, :]) & (jnp.tri(1024, dtype=bool) if causal else True)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want, pull_ref = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, mask=keep), *f32)
    errors = [rel(out.astype(jnp.float32), want)]
    errors += [rel(g.astype(jnp.float32), w) for g, w in zip(pull(ct), pull_ref(ct.astype(jnp.float32)), strict=True)]
    assert max(errors) <= 4e-2, f"relative errors (out, dq, dk, dv) {errors}: NAPKIN_SEED={seed}"
