"""Masks with holes skip every empty block, as FlexAttention's block mask does: a block map whose four bounds per tile
would visit empty chunks between kept ones (a strided window, an image's 2-D neighbourhood, interleaved documents
through captured ids) is read as per-tile chunk lists (``lowering._blocks.chunk_lists``: the chunks it cuts, run
masked, and those it keeps whole, run unmasked), forward, dQ and the dK·dV kernel (its lists are the transposed
map's: per key tile, the query chunks).

Checked against code written here: outputs and gradients against dense attention with the mask materialised in
jax.numpy; the chunks each kernel visits and runs unmasked (``sparsity``) against a numpy count of the dense mask's
blocks (a ragged last chunk always runs masked); and that skipped chunks are never read: values poisoned with NaN
where no query of a tile sees them leave every output finite.

Tolerances: f32 (interpret mode), max |error| / max |reference|, measured for the strided window and the image
neighbourhood over 3 seeds each at N = 65–87: ≤ 1.9e-7 forward and ≤ 4.4e-7 for gradients, so 1e-6 and 3e-6 (as
tests/test_block_map.py takes for the same kernels).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import lowering._attention as entry
import napkin_cat as nc
from lowering import lower
from lowering._blocks import call_blocks, segments
from lowering._sparsity import sparsity
from rewrites import derive, stream, tile

FWD, GRAD = 1e-6, 3e-6
G = S = 16  # queries per tile, keys per chunk
q, x, d = nc.axes("q x d", d=16)


def strided(q, x):  # a window of 80 keys back, read in strides: 16 on, 32 off
    return (q >= x) & (q - x < 80) & ((q - x) % 48 < 16)


def wide(q, x):  # causal, in strides of 64 keys on, 192 off: holes between the chunks of a 128-query tile
    return (q >= x) & ((q - x) % 256 < 64)


def image(q, x):  # an image of 48-token rows: |Δrow| ≤ 1, |Δcol| ≤ 1
    return (abs(q // 48 - x // 48) <= 1) & (abs(q % 48 - x % 48) <= 1)


def dense(keep, nq, nk):
    return np.asarray(keep(np.arange(nq)[:, None], np.arange(nk)[None, :]), bool)


def reference(Q, K, V, keep):
    """softmax(Q·Kᵀ/√d, −∞ where ``keep`` hides)·V over the last two axes; a row with no key gives 0."""
    s = jnp.where(keep, Q @ jnp.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1]), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    return (e / jnp.where(total > 0, total, 1.0)) @ V


def counted(keep, g: int, c: int) -> tuple[int, int, int]:
    """(visited, unmasked, total) (tile, chunk) blocks of the dense mask ``keep`` [..., Nq, Nk] by a loop: a block
    is visited where it keeps something, unmasked where it keeps all (never a ragged last chunk)."""
    *_, nq, nk = keep.shape
    tiles, chunks = -(-nq // g), -(-nk // c)
    visited = unmasked = 0
    for row in keep.reshape(-1, nq, nk):
        for i in range(tiles):
            for j in range(chunks):
                block = row[i * g : (i + 1) * g, j * c : (j + 1) * c]
                visited += bool(block.any())
                unmasked += bool(block.all()) and (j + 1) * c <= nk
    return visited, unmasked, keep.size // (nq * nk) * tiles * chunks


def rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(got - want)) / np.maximum(np.max(np.abs(want)), 1e-30))


def checked(kernel, keep, Q, K, V):
    """The kernel's output and gradients against the dense reference, on random inputs."""
    out, pull = jax.vjp(kernel, Q, K, V)  # one forward for the output and the gradients
    want, ref_pull = jax.vjp(jax.jit(lambda *a: reference(*a, keep)), Q, K, V)  # compiled once, not op by op
    assert rel(out, want) <= FWD
    ct = jax.random.normal(jax.random.key(1), (Q.shape[0], V.shape[1]))
    got, want = pull(ct), ref_pull(ct)
    assert max(rel(a, b) for a, b in zip(got, want, strict=True)) <= GRAD


def kernel_counts(k, extent: dict, arrays=()) -> tuple[float, float]:
    """A kernel's skipped and unmasked shares (``sparsity``)."""
    s = sparsity(k.plan, list(arrays), extent)
    return s.skipped, s.full


KERNELS = {
    name: lower(derive(nc.library.attention(q, x, d, mask=m), tile(q, G), stream(x, S), verify=False), interpret=True)
    for name, m in (("strided", strided), ("image", image))
}


@settings(max_examples=1, deadline=None, phases=[Phase.explicit, Phase.generate])  # interpret mode: one size a run
@given(name=st.sampled_from(sorted(KERNELS)), n=st.integers(65, 100), seed=st.integers(0, 2**16))
def test_holed_maps_forward_gradients_and_counts(name, n, seed):
    keep_fn = {"strided": strided, "image": image}[name]
    kernel = KERNELS[name]
    Q, K, V = (jax.random.normal(k, (n, 16)) for k in jax.random.split(jax.random.key(seed), 3))
    keep = dense(keep_fn, n, n)
    checked(kernel, keep, Q, K, V)
    extent = {"q": n, "x": n, "d": 16}
    forward = kernel.forward
    assert call_blocks(forward.plan, segments(forward.plan.diagram, forward.plan), [Q, K, V], extent).listed
    visited, unmasked, total = counted(keep, G, S)
    assert kernel_counts(forward, extent) == (pytest.approx(1 - visited / total), pytest.approx(unmasked / total))
    dkv = next(k for k in kernel.kernels if "x" in k.plan.tiles)  # keys tiled, queries streamed: the transposed map
    visited, unmasked, total = counted(keep.T, G, S)
    assert kernel_counts(dkv, extent) == (pytest.approx(1 - visited / total), pytest.approx(unmasked / total))


def test_skipped_chunks_are_never_read(seed):
    """Values no query of a tile may see (NaN) would poison its output if it read them: rows and columns of a
    checkerboard hidden whole, holes between the chunks every tile visits."""
    n = 64
    board = lambda q, x: ((q // 16) % 2 == 0) & ((x // 16) % 2 == 0)  # noqa: E731
    kernel = lower(
        derive(nc.library.attention(q, x, d, mask=board), tile(q, G), stream(x, S), verify=False), interpret=True
    )
    Q, K, V, ct = (jax.random.normal(k, (n, 16)) for k in jax.random.split(jax.random.key(seed), 4))
    hidden = (jnp.arange(n) // 16) % 2 == 1
    poison = lambda a: jnp.where(hidden[:, None], jnp.nan, a)  # noqa: E731
    out, pull = jax.vjp(kernel, poison(Q), poison(K), poison(V))
    keep = dense(board, n, n)
    clean = [jnp.where(hidden[:, None], 0.0, a) for a in (Q, K, V)]
    want, ref_pull = jax.vjp(jax.jit(lambda *a: reference(*a, keep)), *clean)  # compiled once, not op by op
    assert bool(jnp.isfinite(out).all()) and rel(out, want) <= FWD
    for a, b in zip(pull(poison(ct)), ref_pull(jnp.where(hidden[:, None], 0.0, ct)), strict=True):
        assert bool(jnp.isfinite(a).all()) and rel(jnp.where(hidden[:, None], 0.0, a), b) <= GRAD


def test_documents_interleaved_through_captured_ids(monkeypatch, seed):
    """Several documents per tile, their tokens interleaved in runs (packed streams), as a captured ``document_id``:
    a tile of two documents skips the chunks of neither between those of its own."""
    monkeypatch.setattr(entry, "schedule", lambda *a, **k: (G, S))  # blocks small enough to have holes
    n, heads = 80, 1
    rng = np.random.default_rng(seed)
    runs = rng.integers(4, 24, n)
    ids = jnp.asarray(np.repeat(np.arange(n) % 3, runs)[:n].astype(np.int32))  # three documents, runs of 4–23
    doc = lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx]  # noqa: E731
    keys = jax.random.split(jax.random.key(seed), 4)
    Q, K, V, ct = (jax.random.normal(k, (1, n, heads, 16)) for k in keys)
    keep = np.asarray(ids[:, None] == ids[None, :])
    ref = lambda *a: jnp.swapaxes(reference(*(jnp.swapaxes(v, 1, 2) for v in a), keep), 1, 2)  # noqa: E731
    got, pull = jax.vjp(lambda *a: nc.attention(*a, mask_mod=doc, interpret=True), Q, K, V)
    want, ref_pull = jax.vjp(jax.jit(ref), Q, K, V)  # compiled once, not op by op
    assert rel(got, want) <= FWD
    assert max(rel(a, b) for a, b in zip(pull(ct), ref_pull(ct), strict=True)) <= GRAD
    made = nc.attention.kernel_for(Q, K, V, mask_mod=doc, interpret=True)
    s = made.sparsity(Q, K, V, mask_mod=doc)
    visited, unmasked, total = counted(keep, G, S)
    assert s.found == ("call time (captured arrays)",)
    assert (s.skipped, s.full) == (pytest.approx(1 - visited / total), pytest.approx(unmasked / total))


def test_a_band_keeps_four_bounds():
    """A mask function whose map has no holes (a window, as a lambda) is read as ranges: no chunk lists."""
    window = lower(
        derive(
            nc.library.attention(q, x, d, mask=lambda q, x: abs(q - x) < 24), tile(q, G), stream(x, S), verify=False
        ),
        interpret=True,
    ).forward
    extent = {"q": 96, "x": 96, "d": 16}
    assert not call_blocks(window.plan, segments(window.plan.diagram, window.plan), [], extent).listed


def test_a_mask_of_the_indices_alone_costs_nothing_per_call():
    """A block map that depends on the sizes alone, and the chunk lists made from it, are constants of the compiled
    program (evaluated once, when traced, as FlexAttention's ``create_block_mask`` ahead of the calls): the jitted
    call holds the kernel and nothing else; before, every call sorted the lists again. (The kernel's own ``jit``,
    which lets a model's layers share one trace, is looked through.)"""

    def primitives(jaxpr, seen):
        for e in jaxpr.eqns:
            if e.primitive.name != "jit":
                seen.add(e.primitive.name)
            inner = e.params.get("call_jaxpr") or e.params.get("jaxpr")
            if inner is not None and e.primitive.name != "pallas_call":
                primitives(getattr(inner, "jaxpr", inner), seen)
        return seen

    def holes(b, h, q_idx, kv_idx):
        return wide(q_idx, kv_idx)

    a = jax.ShapeDtypeStruct((1, 512, 2, 16), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda q, k, v: nc.attention(q, k, v, mask_mod=holes))(a, a, a).jaxpr
    assert primitives(jaxpr, set()) == {"custom_vjp_call", "pallas_call"}
