"""Any mask is sparse: masks the symbolic path cannot read (a dilated window, a 2-D neighbourhood of an image's
tokens, a prefix-LM mask or'ed with a dilated window, a mask hiding whole rows) get their blocks from a block map
evaluated at call time (``Mask.block_map``, ``lowering._blocks.map_bounds``) or computed ahead (``nc.block_mask``).

Checked here against counts and references written in the test: the block map against a loop over every block;
the kernels' outputs and gradients (Triton, interpret mode, ragged sizes; Mosaic's forward) against dense
attention with the mask materialised in jax.numpy; ``kernel.sparsity`` against the blocks the mask keeps something
of and all of, counted in a loop (a map with holes is read chunk by chunk: tests/test_block_holes.py);
``nc.block_mask``'s map, its coarsening, ``&`` / ``|`` and its use by the kernels (its mask function never
evaluated again).

Tolerances: f32, max |error| / max |reference|, measured over 6 seeds at these sizes: ≤ 3.1e-7 forward and
≤ 9.5e-7 for gradients, so 1e-6 and 3e-6; Mosaic bf16 as tests/test_mosaic.py (5e-3 relative norm).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
import napkin_cat.block_masks as block_masks
from lowering import lower
from lowering._blocks import OnGrid, map_bounds
from lowering.mosaic import _kernel
from napkin_cat.errors import EvaluationError
from rewrites import derive, stream, tile

FWD, GRAD, BF16 = 1e-6, 3e-6, 5e-3
G = S = 16  # queries per tile, keys per chunk


def dilated(q, x):
    return (abs(q - x) <= 24) & ((q - x) % 3 == 0)


def neighbours(q, x):  # an image of 8-token rows: |Δrow| ≤ 1 and |Δcol| ≤ 1
    return (abs(q // 8 - x // 8) <= 1) & (abs(q % 8 - x % 8) <= 1)


prefix_or_dilated = nc.or_masks(lambda x: x < 5, dilated)


def hidden_rows(q):  # every third tile of queries sees nothing
    return (q // G) % 3 != 1


MASKS = {"dilated": dilated, "neighbours": neighbours, "prefix_or_dilated": prefix_or_dilated, "rows": hidden_rows}


def dense(keep, nq, nk):
    """The mask materialised: keep(q, x) on every index pair (a function of q alone broadcast over x)."""
    q, x = np.arange(nq)[:, None], np.arange(nk)[None, :]
    names = nc.generators.index_names(keep, score=False)
    got = keep(**{n: v for n, v in (("q", q), ("x", x)) if n in names})
    return np.broadcast_to(np.asarray(got, bool), (nq, nk))


def reference(Q, K, V, keep):
    """softmax(Q·Kᵀ/√d, −∞ where the mask hides)·V; a row with no key gives 0."""
    s = jnp.where(keep, Q @ K.T / np.sqrt(Q.shape[-1]), -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
    total = e.sum(-1, keepdims=True)
    return (e / jnp.where(total > 0, total, 1.0)) @ V


def brute(keep, nq, nk, g, c):
    """Per (tile, chunk): kept something, kept all (padding counts for neither), by a loop."""
    k = dense(keep, nq, nk)
    tiles, chunks = -(-nq // g), -(-nk // c)
    kept, whole = np.zeros((tiles, chunks), bool), np.zeros((tiles, chunks), bool)
    for i, j in itertools.product(range(tiles), range(chunks)):
        block = k[i * g : (i + 1) * g, j * c : (j + 1) * c]
        kept[i, j], whole[i, j] = block.any(), block.all()
    return kept, whole


def runs(kept, whole):
    """The chunks a kernel runs per tile with four bounds, by a loop: [first, last) visited, the longest run of
    whole chunks in it unmasked; returns (visited, unmasked) counts summed over tiles."""
    visited = unmasked = 0
    for k, w in zip(kept, whole, strict=True):
        at = np.flatnonzero(k)
        if len(at) == 0:
            continue
        visited += at[-1] + 1 - at[0]
        longest = run = 0
        for v in w & k:
            run = run + 1 if v else 0
            longest = max(longest, run)
        unmasked += longest
    return visited, unmasked


def rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)  # numpy: eager jnp compiles each op
    return float(np.max(np.abs(got - want)) / np.maximum(np.max(np.abs(want)), 1e-30))


q, x, d = nc.axes("q x d", d=16)
KERNELS = {
    name: lower(derive(nc.library.attention(q, x, d, mask=m), tile(q, G), stream(x, S), verify=False), interpret=True)
    for name, m in MASKS.items()
}


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(sorted(MASKS)),
    nq=st.integers(1, 90),
    nk=st.integers(1, 90),
    g=st.sampled_from([8, 16, 32]),
    c=st.sampled_from([8, 16]),
)
def test_block_map_matches_a_count(name, nq, nk, g, c):
    box = next(b for b in nc.library.attention(q, x, d, mask=MASKS[name]).boxes if isinstance(b, nc.generators.Mask))
    kept, whole = box.block_map(("q", "x"), {"q": nq, "x": nk}, {"q": g, "x": c})
    want = brute(MASKS[name], nq, nk, g, c)
    shape = want[0].shape
    assert (np.broadcast_to(kept, shape) == want[0]).all() and (np.broadcast_to(whole, shape) == want[1]).all()
    bounds = np.asarray(map_bounds(jnp.asarray(want[0]), jnp.asarray(want[1])))
    assert (bounds[:, 3] - bounds[:, 0]).sum() == runs(*want)[0]
    assert (bounds[:, 2] - bounds[:, 1]).sum() == runs(*want)[1]


@settings(max_examples=6, deadline=None)
@given(
    name=st.sampled_from(sorted(MASKS)),
    nq=st.integers(1, 90),
    nk=st.integers(1, 90),
    g=st.sampled_from([16, 32]),
    c=st.sampled_from([16, 32]),
)
def test_what_a_kernel_reads_of_its_map_comes_with_it(name, nq, nk, g, c):
    """The map's broadcast, bounds, holes and chunk lists, computed in the program that coarsens it
    (``OnGrid`` passed as ``then``), against the map counted by a loop and lists and holes read off it here."""
    box = next(b for b in nc.library.attention(q, x, d, mask=MASKS[name]).boxes if isinstance(b, nc.generators.Mask))
    grid = (-(-nq // g), -(-nk // c))
    got = box.block_map(("q", "x"), {"q": nq, "x": nk}, {"q": g, "x": c}, OnGrid(grid))
    kept, whole = brute(MASKS[name], nq, nk, g, c)
    assert (np.asarray(got.kept) == kept).all() and (np.asarray(got.whole) == whole).all()
    bounds = np.asarray(got.bounds)
    visited, unmasked = runs(kept, whole)
    assert (bounds[:, 3] - bounds[:, 0]).sum() == visited and (bounds[:, 2] - bounds[:, 1]).sum() == unmasked
    # holes: the four bounds visit a chunk that keeps nothing, or run masked a chunk kept whole
    assert bool(got.holes) == (visited > kept.sum() or unmasked < (kept & whole).sum())
    lists = np.asarray(got.lists)
    for t in range(grid[0]):
        cut, full = (sorted(lists[t, i][lists[t, i] < grid[1]].tolist()) for i in (0, 1))
        assert cut == np.flatnonzero(kept[t] & ~whole[t]).tolist() and full == np.flatnonzero(whole[t]).tolist()


@settings(max_examples=2, deadline=None, phases=[Phase.explicit, Phase.generate])  # kernels compiled per example
@given(
    name=st.sampled_from(sorted(MASKS)),
    nq=st.integers(17, 70),
    nk=st.integers(17, 70),
    seed=st.integers(0, 2**16),
)
def test_forward_gradients_and_sparsity(name, nq, nk, seed):
    kernel = KERNELS[name]
    keys = jax.random.split(jax.random.key(seed), 3)
    Q, K, V = (jax.random.normal(k, (n, 16)) for k, n in zip(keys, (nq, nk, nk), strict=True))
    keep = dense(MASKS[name], nq, nk)
    ref = jax.jit(lambda *a: reference(*a, keep))  # compiled once, not op by op
    out, pull = jax.vjp(kernel, Q, K, V)  # one forward for the output and the gradients
    want, ref_pull = jax.vjp(ref, Q, K, V)
    assert rel(out, want) <= FWD
    ct = jnp.broadcast_to(jnp.cos(jnp.arange(16.0)), out.shape)  # the cotangent of Σ out·cos(d)
    got, want = pull(ct), ref_pull(ct)
    assert max(rel(a, b) for a, b in zip(got, want, strict=True)) <= GRAD
    kept, whole = brute(MASKS[name], nq, nk, G, S)
    whole[:, nk // S :] = False  # a ragged last chunk always runs masked (lowering._blocks.visited)
    visited, unmasked = kept.sum(), (kept & whole).sum()  # every kept chunk, holes skipped (chunk lists)
    total = kept.size
    s = kernel.forward.sparsity(Q, K, V)
    assert s.found == ("call time",) and s.blocks == total
    assert s.skipped == pytest.approx(1 - visited / total) and s.full == pytest.approx(unmasked / total)


def test_a_mask_that_skips_nothing_says_so():
    stripes = lower(derive(nc.library.attention(q, x, d, mask=lambda q, x: (q + x) % 2 == 0), tile(q, G), stream(x, S),
                           verify=False), interpret=True)
    Q = jnp.ones((64, 16))
    assert stripes.forward.sparsity(Q, Q, Q).note == "the masks hide no chunk at these sizes"
    plain = lower(derive(nc.library.attention(q, x, d), tile(q, G), stream(x, S), verify=False), interpret=True)
    assert plain.forward.sparsity(Q, Q, Q).note == "no mask reads the streamed axis 'x': every chunk runs"


def test_block_mask_coarsens_combines_and_feeds_the_kernels(monkeypatch):
    flex = lambda b, h, q_idx, kv_idx: dilated(q_idx, kv_idx)  # noqa: E731 - FlexAttention's mask_mod, by position
    bm = nc.block_mask(flex, None, None, 70, 70)
    for g, c in ((16, 16), (32, 16), (64, 32)):
        kept, whole = bm.block_map(("q_idx", "kv_idx"), {"q_idx": 70, "kv_idx": 70}, {"q_idx": g, "kv_idx": c})
        want = brute(dilated, 70, 70, g, c)
        assert (kept == want[0]).all() and (whole == want[1]).all()
    rows = nc.block_mask(lambda q_idx: hidden_rows(q_idx), None, None, 70, 70)
    for joined, op in ((bm & rows, np.logical_and), (bm | rows, np.logical_or)):
        keep = op(dense(dilated, 70, 70), dense(hidden_rows, 70, 70))
        kept, whole = brute(lambda q, x: keep[q, x], 70, 70, 16, 16)  # noqa: B023
        said = joined.to_dense()[0, 0]
        assert not (kept & (said == 0)).any() and not (~whole & (said == 2)).any()  # visits all kept, runs none cut
    with pytest.raises(EvaluationError, match="one sequence length"):
        _ = bm & nc.block_mask(flex, None, None, 64, 64)
    # the kernels read the map: evaluating a mask again would fail
    named = nc.block_mask(lambda q_idx, kv_idx: dilated(q_idx, kv_idx), None, None, 70, 70)
    monkeypatch.setattr(block_masks, "block_map", lambda *a: pytest.fail("the block mask was evaluated again"))
    qi, xi = nc.axes("q_idx kv_idx")
    made = lower(derive(nc.library.attention(qi, xi, d, mask=named), tile(qi, 32), stream(xi, 16), verify=False),
                 interpret=True)
    Q, K, V = (jax.random.normal(k, (70, 16)) for k in jax.random.split(jax.random.key(7), 3))
    keep = dense(dilated, 70, 70)
    assert rel(made(Q, K, V), reference(Q, K, V, keep)) <= FWD
    got = jax.grad(lambda k: made(Q, k, V).sum())(K)
    assert rel(got, jax.grad(lambda k: reference(Q, k, V, keep).sum())(K)) <= GRAD


def test_block_mask_entry_errors():
    x4 = jnp.ones((1, 64, 2, 16))
    bm = nc.block_mask(lambda q_idx, kv_idx: dilated(q_idx, kv_idx), None, None, 32, 32)
    with pytest.raises(EvaluationError, match=r"made for \[B, H, Nq, Nk\] = \[1, 1, 32, 32\], called with"):
        nc.attention(x4, x4, x4, block_mask=bm)
    with pytest.raises(EvaluationError, match="not both"):
        nc.attention(x4, x4, x4, block_mask=bm, mask_mod=dilated)


def test_mosaic_forward_reads_the_block_map():
    b, h, qm, xm, dm = nc.axes("b h q x d", d=64)
    keep = lambda q, x: neighbours(q, x) | (q // 128 == 1) & (x < 8)  # noqa: E731
    attn = nc.library.multi_head_attention(h, qm, xm, dm, batch=(b,), dtype="bf16", mask=keep)
    kernel = lower(derive(attn, tile(qm, 128), stream(xm, 64), verify=False), backend="mosaic", interpret=True)
    Q, K, V = (jax.random.normal(k, (1, 1, 256, 64), jnp.bfloat16) for k in jax.random.split(jax.random.key(3), 3))
    out = kernel(Q, K, V).astype(jnp.float32)
    want = reference(*(a[0, 0].astype(jnp.float32) for a in (Q, K, V)), dense(keep, 256, 256))
    assert kernel.backend == "mosaic" and float(jnp.linalg.norm(out[0, 0] - want) / jnp.linalg.norm(want)) <= BF16
    assert kernel.forward.sparsity(Q, K, V).found == ("call time",)


def test_mosaic_launches_a_known_block_map_heaviest_first(key, seed):
    """A causal mask no linear reading takes (``min(q, n − 1) ≥ x``): Mosaic's forward learns from its block map,
    a constant of the trace, that the last query tile is the heaviest, launches last-first, and stays correct."""
    b, h, qm, xm, dm = nc.axes("b h q x d", d=64)
    n = 384
    keep = lambda q, x: jnp.minimum(q, n - 1) >= x  # noqa: E731
    attn = nc.library.multi_head_attention(h, qm, xm, dm, batch=(b,), dtype="bf16", mask=keep)
    kernel = lower(derive(attn, tile(qm, 128), stream(xm, 64), verify=False), backend="mosaic", interpret=True)
    made = []
    original = _kernel.MosaicKernel.__init__

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self.flip)

    Q, K, V = (jax.random.normal(k, (1, 1, n, 64), jnp.bfloat16) for k in jax.random.split(key, 3))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_kernel.MosaicKernel, "__init__", spy)
        out = kernel(Q, K, V).astype(jnp.float32)
    want = reference(*(a[0, 0].astype(jnp.float32) for a in (Q, K, V)), dense(keep, n, n))
    assert made == [True], made
    assert float(jnp.linalg.norm(out[0, 0] - want) / jnp.linalg.norm(want)) <= BF16, f"NAPKIN_SEED={seed}"
