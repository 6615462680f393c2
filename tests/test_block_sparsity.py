"""Block sparsity from segment ids: the document mask's blocks, found at call time from the ids.

``lowering._blocks.segment_blocks`` gives, per block of queries (or keys), the chunks of the other axis it
visits and those it keeps whole; the kernels skip the rest and run whole chunks unmasked, forward and in
both gradient kernels. Checked here: the ranges themselves against a brute-force count (exact for sorted
ids, a superset and a subset for unsorted ones); that skipped chunks are not read (a NaN in a hidden
value reaches only the blocks that visit its chunk); and the outputs and gradients, through
``lowering.lower`` and ``nc.attention``, against a reference written here in jax.numpy.

Tolerances: f32, relative error max |error| / max |reference|; measured over 10 seeds at these sizes
(4 for the entry) ≤ 2.2e-7 forward and ≤ 5.9e-7 for gradients, so 1e-6 and 3e-6.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import lower
from lowering._blocks import heavy_last, segment_blocks
from rewrites import derive, stream, tile

FWD, GRAD = 1e-6, 3e-6
q, x, d = nc.axes("q x d", d=16)


def rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(got - want)) / np.maximum(np.max(np.abs(want)), 1e-30))


def reference(Q, K, V, ids_q, ids_x, causal=False):
    """softmax(Q·Kᵀ/√d, masked where the ids differ)·V over the last two axes; a row with no key gives 0."""
    s = jnp.einsum("...qd,...xd->...qx", Q, K) / np.sqrt(Q.shape[-1])
    keep = ids_q[..., :, None] == ids_x[..., None, :]
    if causal:
        keep = keep & (jnp.arange(Q.shape[-2])[:, None] >= jnp.arange(K.shape[-2])[None, :])
    s = jnp.where(keep, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.exp(jnp.where(keep, s - jnp.where(jnp.isfinite(m), m, 0.0), -jnp.inf))
    total = e.sum(-1, keepdims=True)
    return jnp.einsum("...qx,...xd->...qd", e / jnp.where(total > 0, total, 1.0), V)


def documents(key, n: int, count: int):
    """Sorted ids of ``count`` documents of random (ragged) lengths over ``n`` positions."""
    cuts = jnp.sort(jax.random.choice(key, jnp.arange(1, n), (count - 1,), replace=False))
    return jnp.searchsorted(cuts, jnp.arange(n), side="right").astype(jnp.int32)


def normal(key, *shapes):
    return [jax.random.normal(k, s) for k, s in zip(jax.random.split(key, len(shapes)), shapes, strict=True)]


def brute(ids_t, ids_s, g, c):
    """Per (block, chunk): does it keep something (the id sets meet), do the id ranges overlap, does it
    keep everything."""
    blocks = [set(ids_t[i : i + g].tolist()) for i in range(0, len(ids_t), g)]
    chunks = [set(ids_s[j : j + c].tolist()) for j in range(0, len(ids_s), c)]
    meets = np.array([[bool(a & b) for b in chunks] for a in blocks])
    overlap = np.array([[min(a) <= max(b) and min(b) <= max(a) for b in chunks] for a in blocks])
    whole = np.array([[len(a) == 1 and a == b for b in chunks] for a in blocks])
    return meets, overlap, whole


# --- the ranges ----------------------------------------------------------------------------------------


def test_sorted_documents_visit_only_their_diagonal_blocks():
    """Four documents of 32 over 128 positions, blocks of 32 queries and chunks of 16 keys: each block
    visits its own document's two chunks, both kept whole, and skips the other six."""
    ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 32)
    assert segment_blocks(ids, ids, 32, 16).tolist() == [[0, 0, 2, 2], [2, 2, 4, 4], [4, 4, 6, 6], [6, 6, 8, 8]]


def test_unaligned_documents():
    """Boundaries inside blocks: a block across two documents visits both and keeps nothing whole; the
    last block, ragged (20 positions, blocks of 8), counts only its real positions."""
    ids = jnp.array([0] * 6 + [1] * 9 + [2] * 5, jnp.int32)
    assert segment_blocks(ids, ids, 8, 4).tolist() == [[0, 0, 0, 4], [1, 2, 2, 5], [3, 4, 5, 5]]


def spans(hits):
    """The smallest interval of chunks holding each block's ``hits`` (None where a block has none)."""
    return [(int(h[0]), int(h[-1]) + 1) if h.size else None for h in map(np.flatnonzero, hits)]


@settings(max_examples=25, deadline=None)
@given(
    st.lists(st.integers(0, 5), min_size=1, max_size=70),
    st.lists(st.integers(0, 5), min_size=1, max_size=70),
    st.sampled_from([1, 4, 8, 16]),
    st.sampled_from([1, 4, 8, 16]),
    st.booleans(),
)
def test_ranges_against_brute_force(ids_t, ids_s, g, c, sort):
    """Every chunk a block meets lies in [first, last), every chunk in [full_lo, full_hi) is kept whole.
    For sorted ids both are exact: [first, last) spans the chunks whose id range overlaps the block's, and
    for self-attention (the same ids on both sides) exactly the chunks it meets."""
    ids_t, ids_s = (np.sort(a) if sort else np.array(a) for a in (ids_t, ids_s))
    for other in (ids_s, ids_t):
        got = np.asarray(segment_blocks(jnp.asarray(ids_t), jnp.asarray(other), g, c))
        meets, overlap, whole = brute(ids_t, other, g, c)
        for (first, full_lo, full_hi, last), m, w in zip(got, meets, whole, strict=True):
            assert first <= full_lo <= full_hi <= last
            assert not m[:first].any() and not m[last:].any()
            assert w[full_lo:full_hi].all()
        if sort:
            exact = meets if other is ids_t else overlap
            assert [(f, t) if f < t else None for f, _, _, t in got.tolist()] == spans(exact)
            assert [(f, t) for _, f, t, _ in got.tolist() if f < t] == [s for s in spans(whole) if s]


def test_ranges_per_batch():
    """Ids with a batch axis: each batch index gets its own ranges (broadcast against shared ids)."""
    ids = jnp.stack([jnp.repeat(jnp.arange(2, dtype=jnp.int32), 8), jnp.zeros(16, jnp.int32)])
    got = segment_blocks(ids, ids[:1], 8, 8)
    assert got.shape == (2, 2, 4)
    assert got.tolist() == [[[0, 0, 1, 1], [1, 1, 2, 2]], [[0, 0, 1, 1], [0, 0, 1, 1]]]


# --- the kernels -----------------------------------------------------------------------------------------


N = 75  # positions: ragged for blocks of 16 (five tiles of queries, five chunks of keys)


@functools.cache
def kernel(causal: bool = False):
    """The lowered document attention (tiles and chunks of 16) and its vjp, jitted once for the tests' sizes."""
    diagram = nc.library.document_attention(q, x, d, causal=causal)
    made = lower(derive(diagram, tile(q, 16), stream(x, 16), verify=False), interpret=True)
    assert made.differentiation == "lowered"

    def run(Q, K, V, ids_q, ids_x, dO):
        out, pull = jax.vjp(lambda *a: made(*a, ids_q, ids_x), Q, K, V)
        return out, pull(dO)

    return jax.jit(run)


@functools.cache
def expected(causal: bool = False):
    """The reference's output and vjp, jitted."""

    def run(Q, K, V, ids_q, ids_x, dO):
        out, pull = jax.vjp(lambda *a: reference(*a, ids_q, ids_x, causal), Q, K, V)
        return out, pull(dO)

    return jax.jit(run)


def check(key, ids_q, ids_x, seed, causal=False):
    """The kernel's output and Q, K, V gradients against the reference's, on random inputs."""
    Q, K, V, dO = normal(key, *[(N, 16)] * 4)
    got, grads = kernel(causal)(Q, K, V, ids_q, ids_x, dO)
    want, wants = expected(causal)(Q, K, V, ids_q, ids_x, dO)
    assert rel(got, want) <= FWD, f"forward: {rel(got, want):.2e} (NAPKIN_SEED={seed})"
    for name, a, b in zip("QKV", grads, wants, strict=True):
        assert rel(a, b) <= GRAD, f"d{name}: {rel(a, b):.2e} (NAPKIN_SEED={seed})"
    return got, grads


@pytest.mark.parametrize("causal", [False, True])
def test_sorted_documents(key, seed, causal):
    """Five documents of ragged lengths over 75 positions (boundaries not on the 16-blocks), with and
    without the causal mask: output and the gradients of Q, K, V."""
    k1, k2 = jax.random.split(key)
    ids = documents(k1, N, 5)
    check(k2, ids, ids, seed, causal)


def test_unsorted_ids_and_empty_rows(key, seed):
    """Unsorted ids, different for queries and keys, some query ids absent among the keys: their rows give
    0 and zero gradients, also where a whole tile of queries (the last) visits no chunk at all."""
    k1, k2, k3 = jax.random.split(key, 3)
    ids_q = jax.random.randint(k1, (N,), 0, 6, jnp.int32).at[64:].set(9)
    ids_x = jax.random.randint(k2, (N,), 0, 4, jnp.int32)
    out, (dQ, _, _) = check(k3, ids_q, ids_x, seed)
    empty = ids_q >= 4
    assert bool(empty.any()) and not bool(jnp.any(out[empty])) and not bool(jnp.any(dQ[empty]))


def test_skipped_chunks_are_not_read(key, seed):
    """A NaN in the values, the queries and the output cotangent at the last position: with sorted ids only
    the blocks that visit its chunk see it. The forward and dQ rows of the first document, and the dK, dV
    rows of its keys, stay finite (a kernel visiting every chunk would give NaN: 0 · NaN)."""
    ids = jnp.minimum(jnp.arange(N, dtype=jnp.int32) // 16, 3)  # documents of 16, 16, 16 and 27
    Q, K, V, dO = (a.at[-1].set(jnp.nan) for a in normal(key, *[(N, 16)] * 4))
    out, (dQ, dK, dV) = kernel()(Q, K, V, ids, ids, dO)
    first = ids == 0
    for name, a in (("O", out), ("dQ", dQ), ("dK", dK), ("dV", dV)):
        assert bool(jnp.isfinite(a[first]).all()), f"{name}: a skipped chunk was read (NAPKIN_SEED={seed})"
    assert bool(jnp.isnan(out[-1]).any())  # the NaN's own document does see it


def test_ids_per_batch_and_head(key, seed):
    """Ids over two grid axes (``document_attention(batch=(b, h))``: ids ``[b, h, n]``), each (b, h) with its
    own documents: each program reads its own ranges."""
    b, h = nc.axes("b h")
    made = lower(
        derive(nc.library.document_attention(q, x, d, batch=(b, h)), tile(q, 16), stream(x, 16), verify=False),
        interpret=True,
    )
    keys = jax.random.split(key, 7)
    ids = jnp.stack([jnp.stack([documents(keys[3 * i + j], 50, 2 + i + j) for j in range(3)]) for i in range(2)])
    Q, K, V, dO = normal(keys[6], *[(2, 3, 50, 16)] * 4)

    @jax.jit
    def both(Q, K, V):
        (out, pull), (want, pull_ref) = (jax.vjp(lambda *a, f=f: f(*a, ids, ids), Q, K, V) for f in (made, reference))
        return out, want, pull(dO), pull_ref(dO)

    out, want, grads, wants = both(Q, K, V)
    assert rel(out, want) <= FWD, f"forward: {rel(out, want):.2e} (NAPKIN_SEED={seed})"
    for name, got, exp in zip("QKV", grads, wants, strict=True):
        assert rel(got, exp) <= GRAD, f"d{name}: {rel(got, exp):.2e} (NAPKIN_SEED={seed})"


def test_entry_with_causal_and_grouped_heads(key, seed):
    """``nc.attention(..., is_causal=True, segment_ids=)``: batch 2 with different documents per batch, four
    query heads sharing two key/value heads, 200 positions (2 tiles of 128, 4 chunks of 64)."""
    k1, k2, k3 = jax.random.split(key, 3)
    ids = jnp.stack([documents(k1, 200, 8), documents(k2, 200, 3)])
    Q, K, V, dO = normal(k3, (2, 200, 4, 16), (2, 200, 2, 16), (2, 200, 2, 16), (2, 200, 4, 16))

    def ref(Q, K, V):  # [b, n, h, d] → per head, key/value heads repeated over their group
        t = lambda a: jnp.swapaxes(jnp.repeat(a, 4 // a.shape[2], 2), 1, 2)  # noqa: E731
        return jnp.swapaxes(reference(t(Q), t(K), t(V), ids[:, None], ids[:, None], causal=True), 1, 2)

    def entry(Q, K, V):
        return nc.attention(Q, K, V, is_causal=True, segment_ids=ids, interpret=True)

    def pulled(f):
        def run(Q, K, V):
            out, pull = jax.vjp(f, Q, K, V)
            return out, pull(dO)

        return jax.jit(run)(Q, K, V)

    (got, grads), (want, wants) = pulled(entry), pulled(ref)
    assert rel(got, want) <= FWD, f"NAPKIN_SEED={seed}"
    for name, a, b in zip("QKV", grads, wants, strict=True):
        assert rel(a, b) <= GRAD, f"d{name}: {rel(a, b):.2e} (NAPKIN_SEED={seed})"


@pytest.mark.gpu
def test_compiled_documents_skip_on_gpu(seed):
    """Compiled (not interpreted): bf16, 2048 tokens in 8 ragged documents, d = 128, through
    ``nc.attention``: outputs and gradients against the f32 reference within tests/test_backward.py's GPU
    tolerance (4e-2), and a NaN in the last value row kept out of the first document's outputs."""
    key = jax.random.key(seed)
    cuts = jnp.array([200, 450, 777, 1000, 1300, 1555, 1800])  # off the blocks of 128 and 64
    ids = jnp.searchsorted(cuts, jnp.arange(2048), side="right").astype(jnp.int32)[None]
    Q, K, V, dO = (a.astype(jnp.bfloat16) for a in normal(key, *[(1, 2048, 2, 128)] * 4))
    entry = jax.jit(lambda Q, K, V: nc.attention(Q, K, V, segment_ids=ids))

    def ref(Q, K, V):
        t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
        return jnp.swapaxes(reference(t(Q), t(K), t(V), ids[:, None], ids[:, None]), 1, 2)

    (out, pull), (want, pull_ref) = jax.vjp(entry, Q, K, V), jax.vjp(ref, *(a.astype(jnp.float32) for a in (Q, K, V)))
    assert rel(out.astype(jnp.float32), want) <= 4e-2, f"NAPKIN_SEED={seed}"
    for name, a, b in zip("QKV", pull(dO), pull_ref(dO.astype(jnp.float32)), strict=True):
        assert rel(a.astype(jnp.float32), b) <= 4e-2, f"d{name}: NAPKIN_SEED={seed}"
    poisoned = entry(Q, K, V.at[:, -1].set(jnp.nan))
    assert bool(jnp.isfinite(poisoned[:, ids[0] == 0]).all()), f"a skipped chunk was read (NAPKIN_SEED={seed})"


def test_the_heaviest_tiles_launch_first():
    """Causal attention's last query tile reads every key block and its first one block: the forward and dQ
    launch query tiles last-first, and so does a sliding window (its first tiles see fewer keys). dK·dV's first
    key tile is its heaviest already, and unmasked tiles are equal: neither is reordered. (Every causal kernel
    test checks the outputs in this order.)"""
    b, h, q, x, d = nc.axes("b h q x d", d=16)
    sizes = {"b": 1, "h": 2, "q": 256, "x": 256, "d": 16}
    L = nc.library

    def order(diagram):
        kernels = lower(derive(diagram, tile(q, 32), stream(x, 32), verify=False), interpret=True).kernels
        return [heavy_last(k.plan, sizes, sizes) for k in kernels]

    causal = order(L.attention(q, x, d, causal=True, batch=(b, h)))
    assert causal == [("q",), (), ("q",), ()]  # forward, Δ, dQ, dK·dV
    assert order(L.sliding_window_attention(q, x, d, window=64, batch=(b, h)))[0] == ("q",)
    assert set(order(L.attention(q, x, d, batch=(b, h)))) == {()}


def test_a_block_map_known_when_traced_orders_the_tiles_too(key, seed):
    """Causal written as no linear reading takes it (``min(q, n − 1) ≥ x``) reaches the kernels as a block map of
    the indices alone, whose bounds are constants of the trace: its forward and dQ launch last-first as the affine
    causal mask's do, and the entry's output and gradients still match a dense reference."""
    from lowering._blocks import call_blocks, segments

    n = 128
    causal = lambda q, x: jnp.minimum(q, n - 1) >= x  # noqa: E731
    sizes = {"q": n, "x": n, "d": 16}
    diagram = nc.library.attention(q, x, d, mask=causal)
    kernels = lower(derive(diagram, tile(q, 32), stream(x, 32), verify=False), interpret=True).kernels
    orders = [heavy_last(k.plan, sizes, sizes, call_blocks(k.plan, segments(k.plan.diagram, k.plan), [], sizes))
              for k in kernels]
    assert orders == [("q",), (), ("q",), ()], orders  # forward, Δ, dQ, dK·dV
    assert [heavy_last(k.plan, sizes, sizes) for k in kernels] == [()] * 4  # the affine masks alone say nothing
    ids = jnp.zeros((n,), jnp.int32).at[n // 2 :].set(1)  # ids' bounds are the call's: they keep the order
    docs = lower(derive(nc.library.document_attention(q, x, d), tile(q, 32), stream(x, 32), verify=False),
                 interpret=True).kernels[0]
    arrays = [jnp.zeros((n, 16)), jnp.zeros((n, 16)), jnp.zeros((n, 16)), ids, ids]
    blocks = call_blocks(docs.plan, segments(docs.plan.diagram, docs.plan), arrays, sizes)
    assert blocks.bounds and heavy_last(docs.plan, sizes, sizes, blocks) == ()

    Q, K, V, dO = normal(key, *[(1, n, 2, 16)] * 4)
    f = lambda Q, K, V: nc.attention(Q, K, V, mask_mod=lambda b, h, q_idx, kv_idx: causal(q_idx, kv_idx))  # noqa: E731
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731
    ids = jnp.zeros((n,), jnp.int32)
    ref = lambda Q, K, V: t(reference(t(Q), t(K), t(V), ids, ids, causal=True))  # noqa: E731
    (out, pull), (want, pull_ref) = jax.vjp(f, Q, K, V), jax.vjp(ref, Q, K, V)
    assert rel(out, want) <= FWD, f"NAPKIN_SEED={seed}"
    for name, a, b in zip("QKV", pull(dO), pull_ref(dO), strict=True):
        assert rel(a, b) <= GRAD, f"d{name}: NAPKIN_SEED={seed}"

