"""Any mask is sparse, through the entry: FlexAttention ``mask_mod``s as users write them (four positional
indices), over indices only or over captured arrays (document ids, per-head windows, an image's coordinates), run
by ``nc.attention`` with their blocks found at call time: the block map of a mask of indices is evaluated once per
sizes over the indices it reads (``napkin_cat.generators._index.block_map``); a mask over captured arrays has its
map evaluated on the arrays' values at each call (``lowering._blocks.captured_bounds``), so new values reuse the
kernel.

Checked against code written here: outputs and gradients against dense attention with the mask materialised in
jax.numpy; ``kernel.sparsity`` (skipped, full) against the blocks the dense mask keeps nothing of and all of,
counted with numpy; the block map against a count at two block sizes (one evaluation, coarsened).

Tolerances: f32 (interpret mode), max |error| / max |reference|, measured for captured documents over 8 seeds at
N = 160: ≤ 3.5e-7 forward and ≤ 4.8e-7 for gradients; 1e-6 and 4e-6 (the other masks were not measured apart).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.generators._index import block_map, depends_on

FWD, GRAD = 1e-6, 4e-6
B, D = 1, 16


def dense_reference(keep):
    """softmax(Q·Kᵀ/√D, −∞ where ``keep`` [B or 1, H or 1, Nq, Nk] hides)·V on [B, N, H, D] arrays; a row with no
    key gives 0."""

    def ref(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
        s = jnp.where(keep, s, -jnp.inf)
        m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
        e = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        total = e.sum(-1, keepdims=True)
        return jnp.einsum("bhqk,bkhd->bqhd", e / jnp.where(total > 0, total, 1.0), v)

    return ref


def counted(keep, g: int, c: int, heads: int) -> tuple[float, float]:
    """The shares of (program, chunk) blocks a kernel of tiles ``g`` and chunks ``c`` skips and runs unmasked over the
    dense mask ``keep`` [B, H, Nq, Nk], counted with numpy: a block kept nothing of is skipped, one kept whole runs
    unmasked, but a ragged last chunk, which always runs masked."""
    *_, nq, nk = keep.shape
    tiles, chunks = -(-nq // g), -(-nk // c)
    padded = np.zeros((B, heads, tiles * g, chunks * c), bool)
    padded[..., :nq, :nk] = np.broadcast_to(keep, (B, heads, nq, nk))
    blocks = padded.reshape(B, heads, tiles, g, chunks, c)
    valid = np.zeros((tiles * g, chunks * c), bool)
    valid[:nq, :nk] = True
    valid = valid.reshape(tiles, g, chunks, c)
    kept = blocks.any((3, 5))
    whole = (blocks | ~valid).all((3, 5)) & kept
    whole[..., nk // c :] = False
    total = kept.size
    return 1 - kept.sum() / total, whole.sum() / total


def check(mask_mod, keep, n: int, seed: int, heads: int = 1):
    """The entry's output, gradients and sparsity for ``mask_mod`` against the dense mask ``keep``."""
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, ct = (jax.random.normal(kk, (B, n, heads, D)) for kk in keys)
    ref = dense_reference(keep)
    got, pull = jax.vjp(lambda *a: nc.attention(*a, mask_mod=mask_mod), q, k, v)
    want, ref_pull = jax.vjp(jax.jit(ref), q, k, v)  # compiled once, not op by op
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) <= FWD * scale, f"seed {seed}"
    for a, b in zip(pull(ct), ref_pull(ct), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= GRAD * float(jnp.max(jnp.abs(b))), f"seed {seed}"
    made = nc.attention.kernel_for(q, k, v, mask_mod=mask_mod)
    s = made.sparsity(q, k, v, mask_mod=mask_mod)
    skipped, full = counted(np.asarray(keep), made.signature.tile, made.signature.stream, heads)
    assert s.skipped == pytest.approx(skipped) and s.full == pytest.approx(full), (s, skipped, full)
    return s


def grid(n: int):
    return np.arange(n)[:, None], np.arange(n)[None, :]


@settings(max_examples=1, deadline=None, phases=[Phase.explicit, Phase.generate])  # interpret mode: one size a run
@given(n=st.integers(129, 200), docs=st.integers(2, 6), seed=st.integers(0, 2**16))
def test_documents_through_captured_ids(n, docs, seed):
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(np.sort(rng.integers(0, docs, n)).astype(np.int32))  # ragged documents, sorted
    s = check(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx], ids[:, None] == ids[None, :], n, seed)
    assert s.found == ("call time (captured arrays)",)


def test_new_ids_reuse_the_kernel(seed):
    n = 160
    q = k = v = jax.random.normal(jax.random.key(seed), (B, n, 1, D))

    @jax.jit
    def run(ids, q, k, v):
        return nc.attention(q, k, v, mask_mod=lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx])

    first = jnp.repeat(jnp.arange(4, dtype=jnp.int32), 40)
    run(first, q, k, v)
    derived = nc.attention.derivations
    second = jnp.asarray(np.sort(np.random.default_rng(seed).integers(0, 3, n)).astype(np.int32))
    got = run(second, q, k, v)
    assert nc.attention.derivations == derived and run._cache_size() == 1
    want = dense_reference(second[:, None] == second[None, :])(q, k, v)
    assert float(jnp.max(jnp.abs(got - want))) <= FWD * float(jnp.max(jnp.abs(want)))


def test_a_window_per_head_and_image_coordinates(seed):
    n = 160
    windows = jnp.array([24, 80])  # head h sees its last windows[h] keys
    q_, k_ = grid(n)
    keep = (k_ <= q_) & (q_ - k_ < np.asarray(windows)[:, None, None])
    s = check(lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < windows[h]), keep[None], n, seed, 2)
    assert s.skipped > 0
    row, col = jnp.arange(n) // 16, jnp.arange(n) % 16  # an image of 16-token rows, its coordinates captured
    keep = (abs(q_ // 16 - k_ // 16) <= 1) & (abs(q_ % 16 - k_ % 16) <= 2)
    mask_mod = lambda b, h, q_idx, kv_idx: (abs(row[q_idx] - row[kv_idx]) <= 1) & (abs(col[q_idx] - col[kv_idx]) <= 2)  # noqa: E731
    assert check(mask_mod, keep, n, seed).skipped > 0


@settings(max_examples=1, deadline=None, phases=[Phase.explicit, Phase.generate])  # one size a run
@given(n=st.integers(129, 200), seed=st.integers(0, 2**16))
def test_masks_of_indices_with_holes(n, seed):
    """A dilated window and attention-gym's 2-D neighbourhood (no linear inequalities), as users write them."""
    q_, k_ = grid(n)
    dilated = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 96) & ((q_idx - kv_idx) % 2 == 0)  # noqa: E731
    s = check(dilated, (k_ <= q_) & (q_ - k_ < 96) & ((q_ - k_) % 2 == 0), n, seed)
    assert s.found == ("call time",)
    image = lambda b, h, q_idx, kv_idx: (abs(q_idx // 16 - kv_idx // 16) <= 2) & (abs(q_idx % 16 - kv_idx % 16) <= 2)  # noqa: E731
    check(image, (abs(q_ // 16 - k_ // 16) <= 2) & (abs(q_ % 16 - k_ % 16) <= 2), n, seed)


@settings(max_examples=8, deadline=None)
@given(nq=st.integers(1, 100), nk=st.integers(1, 100), g=st.sampled_from([16, 32, 64]), c=st.sampled_from([16, 48]))
def test_one_evaluation_coarsened_matches_a_count(nq, nk, g, c):
    def keep(b, h, q_idx, kv_idx):  # reads the head, not the batch
        return (q_idx - kv_idx) % (3 + h) == 0

    names, extent = ("b", "h", "q_idx", "kv_idx"), {"b": 2, "h": 2, "q_idx": nq, "kv_idx": nk}
    assert depends_on(keep, tuple(sorted(names))) == {"h", "q_idx", "kv_idx"}
    for blocks in ({"q_idx": g, "kv_idx": c}, {"q_idx": c, "kv_idx": g}):
        kept, whole = block_map(keep, names, extent, {"b": 1, "h": 1, **blocks})
        assert kept.shape == (1, 2, -(-nq // blocks["q_idx"]), -(-nk // blocks["kv_idx"]))
        for h in range(2):
            mask = (np.arange(nq)[:, None] - np.arange(nk)[None, :]) % (3 + h) == 0
            for i in range(kept.shape[2]):
                for j in range(kept.shape[3]):
                    blk = mask[i * blocks["q_idx"] : (i + 1) * blocks["q_idx"],
                               j * blocks["kv_idx"] : (j + 1) * blocks["kv_idx"]]
                    assert bool(kept[0, h, i, j]) == blk.any() and bool(whole[0, h, i, j]) == blk.all()
