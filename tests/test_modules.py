"""The Flax NNX module ``lowering.modules.SelfAttention`` on napkin-cat's entry against the same module (the
same parameters) on ``jax.nn.dot_product_attention``: outputs and gradients (of the input, the bias and
every parameter) with ``mask=``, ``bias=`` and ``segment_ids=`` passed through (``jax.nn`` gets the ids as a
mask), grouped-query and causal or not; and ``v_head_dim=`` against an attention written here by einsum
(``jax.nn`` requires equal head dims).

Tolerance: f32 relative error (max |error| / max |reference|): measured ≤ 7e-7 over outputs and every gradient
(3 seeds, 21 tokens, grouped and not, all three arguments given); 1e-5, as tests/test_attention_entry.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402

from lowering import NotLowerable  # noqa: E402
from lowering.modules import SelfAttention, flax_attention, takes_segment_ids  # noqa: E402
from napkin_cat.errors import EvaluationError  # noqa: E402

TOL = 1e-5


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def pair(seed: int, **options):
    """The module on the entry and on ``options["attention_fn"]`` (default jax.nn's), with the same parameters."""
    reference_fn = options.pop("attention_fn", jax.nn.dot_product_attention)
    ours = SelfAttention(32, rngs=nnx.Rngs(seed), **options)
    theirs = SelfAttention(32, attention_fn=reference_fn, rngs=nnx.Rngs(seed), **options)
    return ours, theirs


def check(seed, ours, theirs, x, ct, **arguments):
    """Output, the input's and the bias's gradients and every parameter's (one cotangent ``ct``) within TOL."""
    bias = arguments.pop("bias", None)

    def loss(layer, x, bias):
        return jnp.sum(layer(x, bias=bias, **arguments) * ct)

    # jax.nn's side compiled once (run eagerly, it compiles op by op)
    out, want = ours(x, bias=bias, **arguments), nnx.jit(lambda m, x, b: m(x, bias=b, **arguments))(theirs, x, bias)
    assert rel(out, want) <= TOL, f"NAPKIN_SEED={seed}: output"
    grads = nnx.grad(loss, argnums=(0, 1, 2) if bias is not None else (0, 1))
    got, expected = grads(ours, x, bias), nnx.jit(grads)(theirs, x, bias)
    for (path, g), (_, w) in zip(*(jax.tree_util.tree_leaves_with_path(a) for a in (got, expected)), strict=True):
        assert rel(g, w) <= TOL, f"NAPKIN_SEED={seed}: gradient {jax.tree_util.keystr(path)}"


@settings(max_examples=1, deadline=None)  # each example derives, verifies and lowers a kernel and its backward
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(9, 24),
    kv_heads=st.sampled_from([2, 4]),
    causal=st.booleans(),
    given_=st.sets(st.sampled_from(["mask", "bias", "segment_ids"]), min_size=1),
)
def test_mask_bias_and_segment_ids_pass_through_as_in_jax_nn(seed, n, kv_heads, causal, given_):
    """Four query heads (grouped or not), ragged lengths, any of the three arguments."""
    ours, theirs = pair(seed, heads=4, kv_heads=kv_heads, causal=causal)
    kx, kc, kb, km, ki = jax.random.split(jax.random.key(seed), 5)
    x, ct = jax.random.normal(kx, (2, n, 32)), jax.random.normal(kc, (2, n, 32))
    arguments = {
        "bias": jax.random.normal(kb, (1, 4, n, n)),  # per head, shared by the batch
        "mask": jax.random.bernoulli(km, 0.8, (2, 1, n, n)) | jnp.eye(n, dtype=bool),  # no empty row
        "segment_ids": jnp.sort(jax.random.randint(ki, (2, n), 0, 3), axis=-1),
    }
    check(seed, ours, theirs, x, ct, **{k: a for k, a in arguments.items() if k in given_})


def test_segment_ids_become_a_mask_for_jax_nn(seed):
    """jax.nn's module gets ``ids[i] == ids[j]``: the same as jax.nn given that mask by hand."""
    _, theirs = pair(seed, heads=2)
    x = jax.random.normal(jax.random.key(seed), (2, 12, 32))
    ids = jnp.array([[0] * 5 + [1] * 7, [0] * 12])
    same = ids[:, None, :, None] == ids[:, None, None, :]
    np.testing.assert_array_equal(theirs(x, segment_ids=ids), theirs(x, mask=same))
    assert not bool(jnp.allclose(theirs(x, segment_ids=ids), theirs(x)))  # the ids are not ignored
    assert takes_segment_ids(SelfAttention(32, heads=2, rngs=nnx.Rngs(0)).attention_fn)


def einsum_attention(q, k, v, bias=None, mask=None, *, is_causal=False):
    """Attention by einsum for any q/k and v head dims, grouped-query, jax.nn's arguments and layout."""
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    s = s if bias is None else s + bias
    keep = jnp.ones(s.shape[-2:], bool) if mask is None else mask
    keep = keep & (jnp.tril(jnp.ones(s.shape[-2:], bool)) if is_causal else True)
    return jnp.einsum("bhqk,bkhe->bqhe", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), v)


def test_value_head_dim_of_its_own(seed):
    """``v_head_dim=8`` beside ``head_dim=16`` (MLA's shape), causal, grouped-query, a bias."""
    ours, theirs = pair(
        seed, heads=4, kv_heads=2, head_dim=16, v_head_dim=8, causal=True, attention_fn=einsum_attention
    )
    assert (ours.value.kernel[...].shape, ours.out.kernel[...].shape) == ((32, 16), (32, 32))
    kx, kc, kb = jax.random.split(jax.random.key(seed), 3)
    x, ct = jax.random.normal(kx, (2, 19, 32)), jax.random.normal(kc, (2, 19, 32))
    check(seed, ours, theirs, x, ct, bias=jax.random.normal(kb, (1, 4, 19, 19)))


@settings(max_examples=2, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(3, 24))
def test_flax_multi_head_attention_runs_on_the_entry(seed, n):
    """Flax's own layer with ``attention_fn=flax_attention`` equals the same layer on ``jax.nn`` (outputs and every
    parameter's gradient), with the float causal mask ``nnx.make_causal_mask`` makes."""
    x = jax.random.normal(jax.random.key(seed), (2, n, 32))
    mask = nnx.make_causal_mask(jnp.ones((2, n)))
    ours, theirs = (
        nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(seed), **kw)
        for kw in ({"attention_fn": flax_attention}, {})
    )

    def loss(layer):
        return jnp.sum(jnp.sin(layer(x, mask=mask, deterministic=True)))

    want = nnx.jit(lambda m: m(x, mask=mask, deterministic=True))(theirs)  # compiled once, not op by op
    assert rel(ours(x, mask=mask, deterministic=True), want) <= TOL, seed
    g_ours, g_theirs = jax.tree.leaves(nnx.grad(loss)(ours)), jax.tree.leaves(nnx.jit(nnx.grad(loss))(theirs))
    # against the largest gradient: the key projection's bias has gradient 0 exactly (a shift of every score in
    # a row), so both sides are rounding there and a per-leaf relative error would compare noise with noise
    scale = max(float(jnp.max(jnp.abs(b))) for b in g_theirs)
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) / scale <= TOL, seed


def test_flax_attention_refuses_what_the_kernel_does_not_do():
    q = jax.random.normal(jax.random.key(0), (1, 4, 2, 16))
    with pytest.raises(EvaluationError, match="dropout_rate=0.5 while deterministic=False needs dropout_rng"):
        flax_attention(q, q, q, dropout_rate=0.5)
    with pytest.raises(NotLowerable, match="sow the attention weights"):
        flax_attention(q, q, q, module=object())


def test_the_module_graphdef_hashes_so_jit_can_take_it_static():
    layer = SelfAttention(32, heads=4, causal=True, score_mod=lambda s, q_idx, kv_idx: s, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(layer)
    assert hash(graphdef) == hash(nnx.split(layer)[0])
