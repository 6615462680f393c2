"""Index functions that read arrays they are not given, through ``nc.attention``: the arrays become inputs.

FlexAttention's users write ``score_mod`` / ``mask_mod`` closing over tensors (PyTorch's
``test/inductor/test_flex_attention.py``: ``test_captured_buffers_all_dims``, ``test_seq_masking``; attention-gym's
``attn_gym/masks/document_mask.py``: ``generate_doc_mask_mod`` over ``offsets``). Here each read of such an array
(``doc[q_idx]``, ``rel[q_idx - kv_idx]``, ``slopes[h]``, a 0-d window) becomes an input of the kernel, computed
at call time (:class:`napkin_cat.generators.Captured`): integer arrays may change between calls without a new
kernel, float arrays get gradients. Every case is checked against a dense reference written here with jnp
(the bias or mask materialised from the table), forward and gradients (dq, dk, dv and the table's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable
from napkin_cat.generators import Captured

#: relative error (max |a − b| / max |b|) against the f32 reference, as measured (relative-bias case, N = 32, two
#: seeds, B = 1; again at B = 2, N = 17–32, four seeds, stop 54): f32 at most 5.3e-7, forward and every gradient, the
#: table's included; bf16 inputs at most 6.0e-3 (their rounding, 2^-8, through the softmax)
TOL = {"float32": 1e-5, "bfloat16": 1.5e-2}


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(a - b)) / np.maximum(np.max(np.abs(b)), 1e-6))


def dense(q, k, v, bias=None, keep=None):
    """softmax(q kᵀ/√d + bias, where keep) v in f32, on [B, N, H, D] arrays (k, v may have fewer heads); ``bias``
    and ``keep`` broadcast to [B, H, Nq, Nk]; a row with no key kept gives 0."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    k, v = (jnp.repeat(a, q.shape[2] // a.shape[2], axis=2) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = jnp.where(keep, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(jnp.isfinite(s), jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0)), 0)
    p = e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v)


def qkv(key, b, n, h, d, dtype, m=None, h_kv=None):
    ks = jax.random.split(key, 3)
    shapes = ((b, n, h, d), (b, m or n, h_kv or h, d), (b, m or n, h_kv or h, d))
    return [jax.random.normal(k, s).astype(dtype) for k, s in zip(ks, shapes, strict=True)]


def check(run, ref, arrays, tables, dtype, seed, key):
    """Forward and gradients (of every array and table) of ``run(*arrays, *tables)`` against ``ref``."""
    out, pull = jax.vjp(run, *arrays, *tables)  # one forward for the output and the gradients
    want = jax.jit(ref)(*arrays, *tables)  # the reference compiled once, not op by op
    assert rel(out, want) <= TOL[dtype], f"forward, NAPKIN_SEED={seed}"
    w = jax.random.normal(key, out.shape)
    argnums = tuple(range(len(arrays) + len(tables)))
    grads = pull(w.astype(out.dtype))  # the cotangent of Σ out·w, out in f32 as the reference's
    wants = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums))(*arrays, *tables)
    # a table read per query, head or batch has a zero gradient (the softmax ignores a row's constant): its
    # error is measured against the queries' gradient, the scale of the cotangents
    floor = float(jnp.max(jnp.abs(wants[0])))
    for i, (g, r) in enumerate(zip(grads, wants, strict=True)):
        err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)) / max(float(jnp.max(jnp.abs(r))), floor))
        assert err <= TOL[dtype], f"gradient of argument {i}, NAPKIN_SEED={seed}"


def offsets_to_doc_ids(offsets, n):
    """attention-gym's ``_offsets_to_doc_ids_tensor``: the document of each position, from the documents' starts."""
    return jnp.searchsorted(offsets, jnp.arange(n), side="right").astype(jnp.int32) - 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=1, deadline=None)  # each size of one schedule (17 to 32) shares a kernel
@given(n=st.integers(17, 32), docs=st.integers(1, 4))
def test_document_causal_mask_over_offsets(dtype, n, docs):
    """attention-gym's ``generate_doc_mask_mod(causal_mask, offsets)``: a query sees the earlier keys of its
    own document, the documents given by their start ``offsets`` (nested reads: ``offsets[document_id[q]]``)."""
    seed = int(np.random.default_rng().integers(2**31))
    key = jax.random.key(seed)
    cuts = jnp.sort(jax.random.choice(jax.random.fold_in(key, 1), jnp.arange(1, n), (docs - 1,), replace=False))
    offsets = jnp.concatenate([jnp.zeros(1, jnp.int32), cuts.astype(jnp.int32), jnp.full(1, n, jnp.int32)])

    def run(q, k, v):
        document_id = offsets_to_doc_ids(offsets, n)

        def doc_mask_mod(b, h, q_idx, kv_idx):
            same_doc = document_id[q_idx] == document_id[kv_idx]
            q_logical = q_idx - offsets[document_id[q_idx]]
            kv_logical = kv_idx - offsets[document_id[kv_idx]]
            return same_doc & (q_logical >= kv_logical)

        return nc.attention(q, k, v, mask_mod=doc_mask_mod)

    def ref(q, k, v):
        ids = offsets_to_doc_ids(offsets, n)
        i = jnp.arange(n)
        return dense(q, k, v, keep=(ids[:, None] == ids[None, :]) & (i[:, None] >= i[None, :]))

    check(run, ref, qkv(key, 2, n, 2, 16, dtype), (), dtype, seed, jax.random.fold_in(key, 2))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@settings(max_examples=1, deadline=None)
@given(n=st.integers(17, 32))
def test_learnable_relative_position_bias(dtype, n):
    """A learnable table of relative-position biases, ``s + rel_bias[q − kv]``: its gradient is the score's
    cotangent summed along each diagonal (the derived backward's, gathered back by autodiff)."""
    seed = int(np.random.default_rng().integers(2**31))
    key = jax.random.key(seed)
    table = jax.random.normal(jax.random.fold_in(key, 1), (2 * n - 1,))

    def run(q, k, v, rel_bias):
        return nc.attention(q, k, v, score_mod=lambda s, b, h, q_idx, kv_idx: s + rel_bias[q_idx - kv_idx + n - 1])

    def ref(q, k, v, rel_bias):
        i = jnp.arange(n)
        return dense(q, k, v, bias=rel_bias[i[:, None] - i[None, :] + n - 1])

    # two sequences and two heads: the table's gradient kernel sums the heads and leaves the batch summed after it
    check(run, ref, qkv(key, 2, n, 2, 16, dtype), (table,), dtype, seed, jax.random.fold_in(key, 2))


@settings(max_examples=1, deadline=None)
@given(n=st.integers(65, 128))
def test_learnable_table_under_a_causal_mask_skips_the_hidden_blocks(n):
    """Causal, over two query and two key blocks: the table's gradient kernel (heads streamed) runs no block the
    mask hides, found symbolically (its accumulator reads the masked dS through the modifier's derivative), and the
    table's gradient, summed along the diagonals the mask keeps, matches jnp's."""
    from lowering._sparsity import sparsity

    seed = int(np.random.default_rng().integers(2**31))
    key = jax.random.key(seed)
    table = jax.random.normal(jax.random.fold_in(key, 1), (2 * n - 1,))

    def reading(rel_bias):  # the score modifier reading a table
        return lambda s, b, h, q_idx, kv_idx: s + rel_bias[q_idx - kv_idx + n - 1]

    def run(q, k, v, rel_bias):
        return nc.attention(q, k, v, is_causal=True, score_mod=reading(rel_bias))

    def ref(q, k, v, rel_bias):
        i = jnp.arange(n)
        return dense(q, k, v, bias=rel_bias[i[:, None] - i[None, :] + n - 1], keep=i[:, None] >= i[None, :])

    arrays = qkv(key, 2, n, 2, 16, "float32")
    check(run, ref, arrays, (table,), "float32", seed, jax.random.fold_in(key, 2))
    plans = [t.plan for t in nc.attention.kernel_for(*arrays, is_causal=True, score_mod=reading(table)).kernel.kernels]
    (db,) = [p for p in plans if p.stream == ("h", 1)]
    sizes = {"b": 2, "h": 2, "q_idx": n, "kv_idx": n, "d": 16}
    tiles = [-(-n // g) for g in db.tiles.values()]
    found = sparsity(db, [], {a.name: sizes[a.name] for w in db.diagram.dom.inside for a in w.axes})
    assert found.found == ("symbolic",) and found.skipped > 0, (found, tiles)


def test_a_table_scaled_by_the_head_index(seed, key):
    """``s + rel[q − kv]·(h + 1)``: the table's gradient kernel streams the heads one at a time on blocks without
    them (``lowering.triton._kernel.summed_singly``), so the head the modifier's derivative reads is the loop's step,
    read as a grid index; a wrong head would scale each head's share of the gradient wrongly."""
    n = 80
    table = jax.random.normal(jax.random.fold_in(key, 1), (2 * n - 1,))

    def run(q, k, v, rel):
        return nc.attention(
            q, k, v, is_causal=True, score_mod=lambda s, b, h, q_idx, kv_idx: s + rel[q_idx - kv_idx + n - 1] * (h + 1)
        )

    def ref(q, k, v, rel):
        i = jnp.arange(n)
        bias = rel[i[:, None] - i[None, :] + n - 1] * jnp.arange(1, 4)[:, None, None]
        return dense(q, k, v, bias=bias, keep=i[:, None] >= i[None, :])

    check(run, ref, qkv(key, 2, n, 3, 16, "float32"), (table,), "float32", seed, jax.random.fold_in(key, 2))


def test_alibi_with_a_slope_table_under_grouped_queries(seed, key):
    """ALiBi with a learnable per-head slope table, ``s − slopes[h]·|q − kv|``, 4 query heads over 2 key/value
    heads (``h`` is the query head), causal."""
    n, h = 24, 4
    slopes = jax.random.uniform(jax.random.fold_in(key, 1), (h,), minval=0.1, maxval=1.0)

    def run(q, k, v, slopes):
        alibi = lambda s, b, h, q_idx, kv_idx: s - slopes[h] * jnp.abs(q_idx - kv_idx)  # noqa: E731
        return nc.attention(q, k, v, score_mod=alibi, is_causal=True)

    def ref(q, k, v, slopes):
        i = jnp.arange(n)
        dist = jnp.abs(i[:, None] - i[None, :])
        return dense(q, k, v, bias=-slopes[:, None, None] * dist, keep=i[:, None] >= i[None, :])

    arrays = qkv(key, 2, n, h, 16, "float32", h_kv=2)
    check(run, ref, arrays, (slopes,), "float32", seed, jax.random.fold_in(key, 2))


def test_captured_buffers_of_every_dimension(seed, key):
    """PyTorch's ``test_captured_buffers_all_dims``: a score_mod adding a per-key, a per-query (of size 1, read
    at 0), a per-head and a per-batch table; every table gets its gradient (zero but the keys')."""
    b, n, h = 2, 20, 2
    tables = [jax.random.normal(jax.random.fold_in(key, i), (m,)) for i, m in enumerate((n, 1, h, b))]

    def run(q, k, v, kv_scale, q_scale, head_scale, batch_scale):
        def all_bias(score, batch, head, token_q, token_kv):
            score = score + kv_scale[token_kv]
            score = score + q_scale[token_q * 0]
            score = score + head_scale[head]
            return score + batch_scale[batch]

        return nc.attention(q, k, v, score_mod=all_bias)

    def ref(q, k, v, kv_scale, q_scale, head_scale, batch_scale):
        bias = kv_scale + q_scale[0] + head_scale[None, :, None, None] + batch_scale[:, None, None, None]
        return dense(q, k, v, bias=bias)

    check(run, ref, qkv(key, b, n, h, 16, "float32"), tables, "float32", seed, jax.random.fold_in(key, 9))


def test_prefix_lengths_and_a_traced_window(seed, key):
    """Per-batch prefix lengths (prefix-LM: every query sees its batch's prefix) and a sliding window whose size
    is a 0-d array, traced under ``jax.jit``: both read at call time."""
    b, n = 2, 33

    @jax.jit
    def run(q, k, v, prefix, window):
        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx < prefix[b]) | ((kv_idx <= q_idx) & (q_idx - kv_idx < window))

        return nc.attention(q, k, v, mask_mod=mask_mod)

    def ref(q, k, v, prefix, window):
        i = jnp.arange(n)
        causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window)
        return dense(q, k, v, keep=(i[None, None, None, :] < prefix[:, None, None, None]) | causal)

    q, k, v = qkv(key, b, n, 2, 16, "bfloat16")
    for i in range(2):  # new lengths and window: the same kernel
        prefix = jax.random.randint(jax.random.fold_in(key, 3 + i), (b,), 1, n)
        window = jax.random.randint(jax.random.fold_in(key, 5 + i), (), 2, 9)
        assert rel(run(q, k, v, prefix, window), ref(q, k, v, prefix, window)) <= TOL["bfloat16"], f"NAPKIN_SEED={seed}"


def test_vision_cross_attention_mask(seed, key):
    """Cross-attention of text tokens to image patches (as in multimodal models): a token sees the patches of
    the image it belongs to, the token's and the patch's image given by two captured id arrays."""
    n_text, n_patch = 24, 40
    token_image = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (n_text,), 0, 3))
    patch_image = jnp.repeat(jnp.arange(4), n_patch // 4)

    def run(q, k, v):
        return nc.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: token_image[q_idx] == patch_image[kv_idx])

    def ref(q, k, v):
        return dense(q, k, v, keep=token_image[:, None] == patch_image[None, :])

    q, k, v = qkv(key, 1, n_text, 2, 16, "float32", m=n_patch)
    assert rel(run(q, k, v), ref(q, k, v)) <= TOL["float32"], f"NAPKIN_SEED={seed}"


def test_new_ids_reuse_the_kernel(seed, key):
    """Document ids are read when the kernel is called: new ids (under ``jax.jit``, or in a new closure of the
    same code) derive, trace and compile nothing new."""
    b, n = 2, 40
    q, k, v = qkv(key, b, n, 2, 16, "float32")
    traces = []

    @jax.jit
    def run(q, k, v, doc):
        traces.append(1)
        return nc.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: doc[b, q_idx] == doc[b, kv_idx])

    def ids(i):
        return jnp.sort(jax.random.randint(jax.random.fold_in(key, i), (b, n), 0, 2 + i), axis=1)

    before = nc.attention.derivations
    for i in range(3):
        doc = ids(i)
        keep = doc[:, None, :, None] == doc[:, None, None, :]
        assert rel(run(q, k, v, doc), dense(q, k, v, keep=keep)) <= TOL["float32"], f"NAPKIN_SEED={seed}"
    eager = nc.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: doc[b, q_idx] == doc[b, kv_idx])
    assert rel(eager, dense(q, k, v, keep=keep)) <= TOL["float32"], f"NAPKIN_SEED={seed}"
    assert (len(traces), nc.attention.derivations - before) == (1, 1)


def test_the_signature_keeps_no_values(key):
    """A kernel's signature holds the conversion without the arrays (which may be a trace's): equal for two
    closures of the same code over different ids, and free of the ids."""
    q = jax.random.normal(key, (1, 20, 1, 16))
    made = [
        nc.attention.kernel_for(q, q, q, mask_mod=lambda q_idx, kv_idx, ids=ids: ids[q_idx] == ids[kv_idx])
        for ids in (jnp.arange(20) // 5, jnp.arange(20) // 7)
    ]
    fn = made[0].signature.mask_mod
    assert made[0] is made[1] and isinstance(fn, Captured) and fn._closed is None


def test_what_stays_refused_names_the_array_and_the_fix(key):
    q = jax.random.normal(key, (1, 20, 1, 16))
    table = jnp.arange(20.0)
    with pytest.raises(NotLowerable, match=r"reads arrays \(table \(20,\)\).*returns float32\[20\] for one score"):
        nc.attention(q, q, q, score_mod=lambda s, q_idx: s + table)
    with pytest.raises(NotLowerable, match=r"table \(20,\).*the score meets a captured array whole.*table\[q_idx"):
        nc.attention(q, q, q, score_mod=lambda s, q_idx: jnp.sum(s * table) + q_idx)
    ids = np.arange(20) // 5
    with pytest.raises(NotLowerable, match=r"ids \(20,\).*a numpy array cannot be indexed.*jnp.asarray"):
        nc.attention(q, q, q, mask_mod=lambda q_idx, kv_idx: ids[q_idx] == ids[kv_idx])
