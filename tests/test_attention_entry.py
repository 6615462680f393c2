"""The drop-in entry ``nc.attention`` against ``jax.nn.dot_product_attention``: outputs and gradients on
ragged shapes (causal and not, grouped-query, an ALiBi bias by score_mod, a window by mask_mod), the kernel
cache (a second call derives nothing), ``jit``/``vmap``/``grad``, and the refusals.

Tolerance: the largest relative error (max |kernel − jax.nn| / max |jax.nn|) measured in f32 on CPU, outputs
and the gradients of q, k and v, was 6e-7 over the cases below; 1e-5 leaves room for other draws.
"""

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, attention
from napkin_cat.errors import EvaluationError

TOL = 1e-5


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))


def arrays(seed: int, b: int, t: int, s: int, heads: int, kv_heads: int, d: int):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (b, t, heads, d))
    k, v = (jax.random.normal(key, (b, s, kv_heads, d)) for key in (kk, kv))
    return q, k, v, jax.random.normal(kc, (b, t, heads, d))  # the last: a cotangent for the outputs


def check_against_jax_nn(seed, q, k, v, ct, entry: dict, reference: dict):
    """Outputs and all three gradients (one vjp with the cotangent ``ct``) within TOL of jax.nn's."""
    out, pull = jax.vjp(lambda *a: attention(*a, **entry), q, k, v)
    want, pull_ref = jax.vjp(lambda *a: jax.nn.dot_product_attention(*a, **reference), q, k, v)
    errors = [rel(out, want)] + [rel(g, w) for g, w in zip(pull(ct), pull_ref(ct), strict=True)]
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


def test_score_mods_are_keyed_by_identity():
    q, k, v, _ = arrays(1, 1, 20, 20, 2, 2, 16)
    first = attention.kernel_for(q, k, v, score_mod=alibi)
    assert attention.kernel_for(q, k, v, score_mod=alibi) is first
    assert attention.kernel_for(q, k, v, score_mod=alibi, is_causal=True) is not first


@pytest.mark.parametrize(
    ("options", "shapes", "error", "match"),
    [
        ({"bias": jnp.zeros((20, 20))}, None, NotLowerable, "bias= is not supported yet"),
        ({"mask": jnp.ones((20, 20), bool)}, None, NotLowerable, "mask= is not supported yet"),
        ({"segment_ids": jnp.zeros((1, 20), int)}, None, NotLowerable, "segment_ids= is not supported yet"),
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


def test_value_head_dim_other_than_key_head_dim_is_refused():
    q = jnp.zeros((1, 20, 2, 16))
    with pytest.raises(NotLowerable, match="value head dim"):
        attention(q, q, jnp.zeros((1, 20, 2, 8)))
