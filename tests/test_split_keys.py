"""``nc.attention`` on a decode step (one query token per sequence against a long cache, as jax.nn users write it)
runs ``nc.decode_attention``'s split-KV kernel and merge, and its gradient the attention kernels': both against a
reference written here with jax.numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import rel_err

import lowering._decode
import napkin_cat as nc
from lowering._attention import SPLIT_KEYS
from napkin_cat.errors import EvaluationError

#: max |got − ref| / max |ref| in f32 (gradients: over max(|ref|, 1)): measured over 8 draws at most 5.0e-7 (outputs)
#: and 3.0e-7 (gradients); the bound is about 16 f32 ulps
RTOL = 2e-6


def reference(q, k, v, lengths, scale=None):
    """softmax over the first ``lengths[b]`` keys, query head h reading KV head h // group; f32."""
    heads, kv_heads, dim = q.shape[2], k.shape[2], q.shape[3]
    kk, vv = (jnp.repeat(a.astype(jnp.float32), heads // kv_heads, axis=2) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kk) * (1 / np.sqrt(dim) if scale is None else scale)
    keep = jnp.arange(k.shape[1])[None, None, None, :] < lengths[:, None, None, None]
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), vv)


@functools.partial(jax.jit, static_argnums=5)
def reference_and_gradients(q, k, v, lengths, ct, scale=None):
    """:func:`reference` and its gradients of ``sum(reference · ct)`` for q, k, v, compiled as one program (op by op,
    each drawn size compiled every op of the reference and its gradient apart)."""
    out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, lengths, scale), q, k, v)
    return out, pull(ct)


def draw(seed: int, b: int, heads: int, kv_heads: int, keys: int, dim: int = 16):
    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((b, 1, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(r.standard_normal((b, keys, kv_heads, dim)), jnp.float32) for _ in range(2))
    return q, k, v, r


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), b=st.integers(1, 3), group=st.sampled_from([1, 4]),
       keys=st.sampled_from([SPLIT_KEYS, 700]), scale=st.sampled_from([None, 0.3]))  # fmt: skip
def test_a_decode_step_and_its_gradient_match_the_reference(seed, b, group, keys, scale):
    q, k, v, r = draw(seed, b, 2 * group, 2, keys)
    lengths = jnp.asarray(r.integers(1, keys + 1, b), jnp.int32).at[0].set(keys if b > 1 else 1)
    steps, decode = [], lowering._decode.decode_attention
    assert nc.attention.splits_keys(q, k, v, key_value_seq_lengths=lengths, scale=scale)
    # one forward for the output and the gradients: the step's VJP runs the same decode kernel as the plain call
    # (lowering._attention._split_kv; plain calls: the tests below)
    with pytest.MonkeyPatch.context() as mp:  # the step runs the decode kernel: seen where the entry calls it
        mp.setattr(lowering._decode, "decode_attention", lambda *a, **kw: steps.append(1) or decode(*a, **kw))
        out, pull = jax.vjp(lambda q, k, v: nc.attention(q, k, v, key_value_seq_lengths=lengths, scale=scale), q, k, v)
    ct = jnp.asarray(r.standard_normal(out.shape), jnp.float32)
    want_out, want = reference_and_gradients(q, k, v, lengths, ct, scale)
    assert steps and rel_err(out, want_out) <= RTOL, (seed, lengths)
    got = pull(ct)  # the gradients of sum(out · ct)
    for name, g, w in zip("qkv", got, want, strict=True):  # one key: dq is 0, and its error relative to 1
        err = float(jnp.max(jnp.abs(g - w))) / max(float(jnp.max(jnp.abs(w))), 1.0)
        assert err <= RTOL, (name, seed, lengths, err)


def test_a_step_in_one_part_and_its_gradient_match_the_reference(seed, monkeypatch):
    """Where the batch alone fills the GPU (3 sequences × 2 KV heads on one of 2 SMs here; B = 64 at 4k keys on an
    H200) the step runs in one part: the kernel alone, no merge; its output, and its gradients (the attention
    kernels' backward), against the reference written here."""
    from dataclasses import replace

    from napkin_cat.hardware import H100

    monkeypatch.setattr(lowering._decode, "target_hardware", lambda *_: replace(H100, sms=2))
    q, k, v, r = draw(seed, 3, 8, 2, SPLIT_KEYS)
    lengths = jnp.asarray(r.integers(1, SPLIT_KEYS + 1, 3), jnp.int32).at[0].set(SPLIT_KEYS)
    assert lowering._decode.decode_plan(q, k, v, lengths).summary()["parts"] == 1
    out, pull = jax.vjp(lambda q, k, v: nc.attention(q, k, v, key_value_seq_lengths=lengths), q, k, v)
    ct = jnp.asarray(r.standard_normal(out.shape), jnp.float32)
    want_out, want = reference_and_gradients(q, k, v, lengths, ct)
    assert rel_err(out, want_out) <= RTOL, (seed, lengths)
    for name, g, w in zip("qkv", pull(ct), want, strict=True):
        err = float(jnp.max(jnp.abs(g - w))) / max(float(jnp.max(jnp.abs(w))), 1.0)
        assert err <= RTOL, (name, seed, lengths, err)


def test_the_step_serves_every_length_under_jit_and_split_keys_chooses():
    q, k, v, _ = draw(3, 2, 4, 2, SPLIT_KEYS)
    step = jax.jit(lambda q, k, v, n: nc.attention(q, k, v, key_value_seq_lengths=n))
    for lengths in ([SPLIT_KEYS, 1], [3, 200]):
        n = jnp.array(lengths)
        assert rel_err(step(q, k, v, n), reference(q, k, v, n)) <= RTOL, lengths
    whole = jnp.full((2,), SPLIT_KEYS)
    dense = nc.attention(q, k, v, split_keys=False)
    assert rel_err(dense, reference(q, k, v, whole)) <= RTOL
    assert not nc.attention.splits_keys(q, k, v, split_keys=False)


def test_leading_batch_axes_are_one_batch_of_decode_steps():
    """jax.nn's ``[..., N, H, D]``: two leading axes, their lengths ``[2, 3]``, flattened for the step and restored."""
    q, k, v, r = draw(7, 6, 4, 2, SPLIT_KEYS)
    lengths = jnp.asarray(r.integers(1, SPLIT_KEYS + 1, 6), jnp.int32)
    split = lambda a: a.reshape(2, 3, *a.shape[1:])  # noqa: E731
    assert nc.attention.splits_keys(split(q), split(k), split(v), key_value_seq_lengths=split(lengths))
    out = nc.attention(split(q), split(k), split(v), key_value_seq_lengths=split(lengths))
    assert out.shape == (2, 3, 1, 4, 16) and rel_err(out.reshape(q.shape), reference(q, k, v, lengths)) <= RTOL


@pytest.mark.parametrize(
    "why, shapes, options",
    [
        ("two query tokens", ((1, 2, 4, 16), (1, 600, 2, 16)), {}),
        ("too few keys", ((1, 1, 4, 16), (1, SPLIT_KEYS - 1, 2, 16)), {}),
        ("causal: jax.nn aligns it top-left", ((1, 1, 4, 16), (1, 600, 2, 16)), {"is_causal": True}),
        ("a traced scale", ((1, 1, 4, 16), (1, 600, 2, 16)), {"scale": jnp.float32(0.2)}),
        ("a residual asked for", ((1, 1, 4, 16), (1, 600, 2, 16)), {"return_residual": True}),
        ("a mask", ((1, 1, 4, 16), (1, 600, 2, 16)), {"mask": jnp.ones((1, 1, 1, 600), bool)}),
        ("another backend", ((1, 1, 4, 16), (1, 600, 2, 16)), {"backend": "xla"}),
    ],
)
def test_other_calls_keep_the_attention_kernels(why, shapes, options):
    q, kv = jnp.zeros(shapes[0]), jnp.zeros(shapes[1])
    assert not nc.attention.splits_keys(q, kv, kv, **options), why
    with pytest.raises(EvaluationError, match="split_keys=True asks for a decode step"):
        nc.attention(q, kv, kv, split_keys=True, **options)


@pytest.mark.gpu
def test_a_compiled_decode_step_matches_the_reference_on_a_gpu():
    """bf16 at Llama's decode shape (32 heads over 8, D = 128, 32k keys), compiled: the bound is two bf16 ulps of
    the largest output (tests/test_paged_decode.py measured the decode kernel's error at most 3.8e-3 so)."""
    r = np.random.default_rng(5)
    q = jnp.asarray(r.standard_normal((2, 1, 32, 128)), jnp.bfloat16)
    k, v = (jnp.asarray(r.standard_normal((2, 32768, 8, 128)), jnp.bfloat16) for _ in range(2))
    lengths = jnp.array([32768, 1000])
    assert nc.attention.splits_keys(q, k, v, key_value_seq_lengths=lengths)
    out = jax.jit(lambda q, k, v, n: nc.attention(q, k, v, key_value_seq_lengths=n))(q, k, v, lengths)
    assert rel_err(out, reference(q, k, v, lengths)) <= 2**-7
