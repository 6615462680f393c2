"""Masks with holes on Mosaic GPU: a block map whose four bounds per tile would visit empty chunks between kept ones
is read as per-tile chunk lists, which the producer's TMA loads and the consumers' loop walk alike
(``lowering/mosaic/_kernel.py``'s ``_Walk``), forward, dQ and the dK·dV kernel (the transposed map's lists).

Checked against code written here, in Mosaic's interpret mode (bf16 operands, the smallest blocks Mosaic takes:
tiles of 128 queries over two consumer warpgroups, chunks of 64 keys): outputs and gradients against dense attention
with the mask materialised in jax.numpy; the chunks the forward visits and runs unmasked (``sparsity``) against a
loop over the dense mask's blocks; and that skipped chunks are never read: keys and values poisoned with NaN in
chunks some tiles skip leave those tiles' rows finite and right while the tiles that read them give NaN. The
compiled path lowers for CUDA on the CPU with the lists read (``MosaicLowered.lowering_error``).

Tolerances: relative Frobenius error against the f32 reference, bf16 operands and outputs: measured 1.8e-3 to
2.1e-3 forward and 2.3e-3 to 2.7e-3 for gradients (strided window and image neighbourhood, seeds 0 and 1), so
tests/test_mosaic.py's 5e-3 and 6e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from lowering import MosaicLowered, lower
from lowering._blocks import call_blocks
from lowering.mosaic import _kernel
from rewrites import derive, stream, tile

FWD, GRAD = 5e-3, 6e-3
G, S, D = 128, 64, 64  # queries per tile (two warpgroups of 64 rows), keys per chunk, head dim
b, h, q, x, d = nc.axes("b h q x d", d=D)


def strided(q, x):  # causal, in strides of 64 keys on, 192 off: the last tile of 384 skips keys [128, 192)
    return (q >= x) & ((q - x) % 256 < 64)


def image(q, x):  # an image of 256-token rows, |Δrow| ≤ 1, |Δcol| ≤ 1: a half-row tile skips the far quarter-rows
    return (abs(q // 256 - x // 256) <= 1) & (abs(q % 256 - x % 256) <= 1)


def scheduled(mask):
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", mask=mask)
    return derive(attn, tile(q, G), stream(x, S), verify=False)


def reference(keep):
    """f32 attention [B, H, N, D] under the dense mask ``keep`` [N, N], written with jnp."""

    def attend(Q, K, V):
        Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
        s = jnp.where(keep, jnp.einsum("bhqd,bhkd->bhqk", Q, K) / np.sqrt(D), -jnp.inf)
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), V)

    return attend


def dense(mask, n: int):
    return np.asarray(mask(np.arange(n)[:, None], np.arange(n)[None, :]), bool)


def counted(keep, g: int, c: int) -> tuple[float, float]:
    """The skipped and unmasked shares of (tile, chunk) blocks of the dense mask ``keep`` by a loop: a block is
    visited where it keeps something, unmasked where it keeps all."""
    tiles, chunks = keep.shape[0] // g, keep.shape[1] // c
    blocks = [keep[i * g : (i + 1) * g, j * c : (j + 1) * c] for i in range(tiles) for j in range(chunks)]
    return 1 - sum(bool(v.any()) for v in blocks) / len(blocks), sum(bool(v.all()) for v in blocks) / len(blocks)


def error(got, want) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def poisoned(a, chunks):
    """``a`` [B, H, N, D] with NaN in the keys of ``chunks``."""
    hidden = jnp.isin(jnp.arange(a.shape[2]) // S, jnp.asarray(chunks))
    return jnp.where(hidden[:, None], jnp.nan, a)


def checked_rows(out, want, reads: list[bool]):
    """Each tile's rows: NaN where it reads a poisoned chunk, else finite and within the forward's tolerance."""
    for t, read in enumerate(reads):
        rows = slice(t * G, (t + 1) * G)
        if read:
            assert bool(jnp.isnan(out[:, :, rows]).all()), f"tile {t} reads the poison"
        else:
            assert bool(jnp.isfinite(out[:, :, rows]).all()) and error(out[:, :, rows], want[:, :, rows]) <= FWD, t


def test_strided_window_on_mosaic_forward_gradients_counts_and_skips(key):
    """N = 384: tile 2 visits chunks 0, 1 and 3–5, not 2 (a hole); tile 0 sees no key of chunk 2 (causal); tile 1
    reads it. With chunk 2's keys and values NaN, tiles 0 and 2 stay right and tile 1 gives NaN."""
    n = 384
    kernel = lower(scheduled(strided), backend="mosaic", interpret=True)
    Q, K, V, dO = (jax.random.normal(k, (1, 1, n, D), jnp.bfloat16) for k in jax.random.split(key, 4))
    keep = dense(strided, n)
    want = reference(keep)
    forward = kernel.forward
    extent = {"b": 1, "h": 1, "q": n, "x": n, "d": D}
    assert call_blocks(forward.plan, forward.segments, [Q, K, V], extent).listed
    sp = forward.sparsity(Q, K, V)
    assert (sp.skipped, sp.full) == pytest.approx(counted(keep, G, S))
    checked_rows(forward(Q, poisoned(K, [2]), poisoned(V, [2])), want(Q, K, V), [False, True, False])
    out, pull = jax.vjp(kernel, Q, K, V)
    ref, ref_pull = jax.vjp(jax.jit(want), *(a.astype(jnp.float32) for a in (Q, K, V)))  # compiled once
    assert error(out, ref) <= FWD
    for name, got, w in zip("QKV", pull(dO), ref_pull(dO.astype(jnp.float32)), strict=True):
        assert error(got, w) <= GRAD, f"d{name}"


def test_image_neighbourhood_on_mosaic_skips_the_far_quarter_rows(key):
    """N = 512, two image rows of 256: the tiles of a row's first half visit neither row's last quarter (chunks 3
    and 7), those of its second half read both; poisoned there, the first halves stay right, the second give NaN."""
    n = 512
    kernel = lower(scheduled(image), backend="mosaic", interpret=True).forward
    Q, K, V = (jax.random.normal(k, (1, 1, n, D), jnp.bfloat16) for k in jax.random.split(key, 3))
    keep = dense(image, n)
    extent = {"b": 1, "h": 1, "q": n, "x": n, "d": D}
    assert call_blocks(kernel.plan, kernel.segments, [Q, K, V], extent).listed
    sp = kernel.sparsity(Q, K, V)
    assert (sp.skipped, sp.full) == pytest.approx(counted(keep, G, S))
    out = kernel(Q, poisoned(K, [3, 7]), poisoned(V, [3, 7]))
    checked_rows(out, reference(keep)(Q, K, V), [False, True, False, True])


def test_holed_kernels_lower_for_cuda_reading_their_lists(monkeypatch):
    """Every kernel of the strided window, forward and backward, lowers to Mosaic GPU for CUDA on the CPU, its
    lists read: ``backend="mosaic"`` builds a kernel only where ``lowering_error`` finds none, and the check forces
    the lists (at its sizes, a tile and two chunks, the map has no holes)."""
    walks = []
    of = _kernel._Walk.of
    monkeypatch.setattr(_kernel._Walk, "of", lambda *a: walks.append(1) or of(*a))
    kernel = lower(scheduled(strided), backend="mosaic", interpret=False)
    streaming = [k for k in (kernel.forward, *kernel.kernels) if isinstance(k, MosaicLowered) and k.x]
    assert len(streaming) == 4 and all(k.segments for k in streaming)  # forward, with residuals, dQ, dK·dV
    assert len(walks) == 4 and set(kernel.backends.values()) == {"mosaic"}
    walks.clear()
    assert MosaicLowered(kernel.forward.plan, interpret=False).lowering_error() is None and walks
