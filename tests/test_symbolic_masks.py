"""Masks written as FlexAttention users write them: linear-inequality masks found symbolically
(``nc.as_affine``) and checked against masks built here with NumPy on every point of a grid; non-affine masks
left as written; FlexAttention's positional ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)`` under any names; ``and_masks``/``or_masks``; and through ``nc.attention``,
a sliding window written as a lambda against a reference written here in jax.numpy, its forward skipping the
key blocks outside the window (a NaN there never reaches the outputs, as in tests/test_block_sparsity.py).

Tolerance (f32, relative: max |error| / max |reference|): measured over 4 seeds at these sizes ≤ 7.2e-7
forward (the window's 200 queries) and ≤ 4.7e-7 for gradients, so 2e-6 for both.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering._blocks import affine_mask
from napkin_cat.affine_masks import Combined
from napkin_cat.errors import AxisError
from napkin_cat.generators import Positional, positional
from napkin_cat.library import Affine

FWD = GRAD = 2e-6
FLEX = ("b", "h", "q_idx", "kv_idx")
N = 48  # the grid of (query, key) indices the conversions are checked on, every point
QS, XS = np.arange(N)[:, None], np.arange(N)[None, :]


def same_mask(affine, want, q="q", x="x"):
    """``affine`` keeps exactly ``want`` (a bool [N, N] array built here) on the grid."""
    assert isinstance(affine, Affine), affine
    got = np.broadcast_to(np.asarray(affine(**{a: {q: QS, x: XS}[a] for a in affine.axes})), (N, N))
    assert np.array_equal(got, want), np.argwhere(got != want)[:5]


sizes = st.integers(1, 40)


@settings(max_examples=25, deadline=None)
@given(w=sizes, p=sizes, c=st.integers(-20, 20), k=st.integers(2, 5))
def test_affine_masks_found(w, p, c, k):
    """Sliding window, causal with an offset, prefix-LM, a band by ``abs``, equality and its negation, a
    rational slope: each becomes an Affine keeping exactly the grid points NumPy keeps."""
    cases = [
        (lambda b, h, q_idx, kv_idx: q_idx - kv_idx < w, QS - XS < w, 1),
        (lambda q, x: (x <= q) & (q - x < w), (XS <= QS) & (QS - XS < w), 1),
        (lambda q, x: x <= q + c, XS <= QS + c, 1),
        (lambda q, x: (x < p) | (x <= q), (XS < p) | (XS <= QS), 2),
        (lambda q, x: abs(q - x) <= w, np.abs(QS - XS) <= w, 1),
        (lambda q, x: q == x + c, QS == XS + c, 1),
        (lambda q, x: ~((q - x) != c), QS - XS == c, 1),
        (lambda q, x: ~(x > q) ^ (q < p), (XS <= QS) ^ (QS < p), 2),
        (lambda q, x: q / k < x - c / 2, QS / k < XS - c / 2, 1),
    ]
    for fn, want, regions in cases:
        names = ("q_idx", "kv_idx") if "q_idx" in fn.__code__.co_varnames else ("q", "x")
        found = nc.as_affine(fn)
        same_mask(found, want, *names)
        assert found.name == "<lambda>" and len(found.regions) == regions


@settings(max_examples=10, deadline=None)
@given(c=st.integers(2, 8), w=sizes)
def test_masks_that_are_not_affine_stay_as_written(c, w):
    """Striped/dilated and chunked masks (infinite unions of polygons), products, ``jnp`` functions, ``and``
    and ``if`` on a condition, masks keeping every point or none: None, and ``nc.mask`` keeps the function."""
    chunked = lambda q, x: (q // c == x // c) & (x <= q)  # noqa: E731
    for fn in (
        lambda q, x: (q - x) % c == 0,
        chunked,
        lambda q, x: q * x < w,
        lambda q, x: jnp.logical_and(x <= q, q - x < w),
        lambda q, x: jnp.where(x <= q, True, False),
        lambda q, x: x <= q and q - x < w,
        lambda q, x: (x <= q) if q > w else True,
        lambda q, x: (x <= q) & (x > q),
    ):
        assert nc.as_affine(fn) is None
    q, x = nc.axes("q x")
    box = nc.mask(nc.Array(q, x), chunked)
    assert box.params["mask"] is chunked and box.name == "mask <lambda>"


def test_a_conversion_the_grid_contradicts_is_refused():
    """A function that reads ``x <= q`` on symbols but ``x < q`` on arrays: the check finds the diagonal
    differs, and the mask stays as written (never a silently different mask)."""

    def two_faced(q, x):
        return x <= q - isinstance(q, np.ndarray)

    assert nc.as_affine(two_faced) is None


def test_mask_boxes_hold_the_affine_named_after_the_function():
    q, x = nc.axes("q x")

    def sliding(q, x):
        return (x <= q) & (q - x < 8)

    box = nc.mask(nc.Array(q, x), sliding)
    assert box.name == "mask sliding" and isinstance(box.params["mask"], Affine)
    assert affine_mask(box).name == "sliding"
    same_mask(box.params["mask"], (XS <= QS) & (QS - XS < 8))


def test_positional_reads_flex_attention_s_order():
    """Five (score) and four (mask) positional parameters are read by position whatever their names; fewer
    are read by name; an index name at another index's place is refused, naming the fix."""

    def times_two(score, b, h, m, n):
        return score * 2 + m - n

    adapted = positional(times_two, FLEX, score=True)
    assert isinstance(adapted, Positional) and adapted.__name__ == "times_two"
    assert adapted(1.0, b=0, h=0, q_idx=5, kv_idx=3) == 4.0
    mask = positional(lambda batch, head, token_q, token_kv: token_kv <= token_q + head, FLEX, score=False)
    assert (mask(b=0, h=2, q_idx=3, kv_idx=5), mask(b=0, h=1, q_idx=3, kv_idx=5)) == (True, False)
    near = lambda q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    assert positional(near, FLEX, score=False) is near
    with pytest.raises(AxisError, match=r"q_idx, b, h name other indices; put them in that order"):
        positional(lambda q_idx, b, h, kv_idx: True, FLEX, score=False)


def test_and_masks_or_masks():
    """Affine parts give an Affine; FlexAttention's positional parts a positional combination (read through
    ``nc.as_affine`` as one Affine); by-name parts a combination taking the union of their names."""
    both = nc.and_masks(Affine.causal("q", "x"), Affine.at_least(5, q=-1, x=1))
    assert isinstance(both, Affine)
    same_mask(both, (XS <= QS) & (QS - XS <= 5))
    window = nc.and_masks(lambda b, h, q, kv: kv <= q, lambda b, h, m, n: m - n < 6)
    assert isinstance(window, Combined) and window.positional
    same_mask(nc.as_affine(positional(window, FLEX, score=False)), (XS <= QS) & (QS - XS < 6), "q_idx", "kv_idx")
    prefix = nc.or_masks(lambda q, x: x <= q, lambda x: x < 4)
    assert not prefix.positional and bool(prefix(q=1, x=3)) and not bool(prefix(q=1, x=4))
    same_mask(nc.as_affine(prefix), (XS <= QS) | (XS < 4))
    with pytest.raises(TypeError, match="at least one"):
        nc.or_masks()


# --- through nc.attention ------------------------------------------------------------------------------


def reference(Q, K, V, keep, bias=0.0):
    """``softmax(Q·Kᵀ/√d + bias, where keep)·V`` on ``[b, n, h, d]`` arrays, ``keep``/``bias`` ``[h, q, x]``;
    a row with no key gives 0."""
    s = jnp.einsum("bqhd,bxhd->bhqx", Q, K, precision="highest") / np.sqrt(Q.shape[-1]) + bias
    s = jnp.where(keep, s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, -1, keepdims=True))
    e = jnp.where(keep, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    return jnp.einsum("bhqx,bxhd->bqhd", e / jnp.where(total > 0, total, 1.0), V, precision="highest")


def rel(got, want) -> float:
    return float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))


def compare(seed, entry, ref, shapes, *, gradients=True):
    """Outputs and (``gradients``) the q, k, v gradients (one vjp) of ``entry`` against ``ref``, on random
    inputs; returns them."""
    keys = jax.random.split(jax.random.key(seed), 4)
    Q, K, V, dO = (jax.random.normal(k, s) for k, s in zip(keys, shapes, strict=True))
    if not gradients:
        out, want = entry(Q, K, V), ref(Q, K, V)
        assert rel(out, want) <= FWD, f"forward: {rel(out, want):.2e} (NAPKIN_SEED={seed})"
        return Q, K, V
    (out, pull), (want, pull_ref) = (jax.vjp(f, Q, K, V) for f in (entry, ref))
    assert rel(out, want) <= FWD, f"forward: {rel(out, want):.2e} (NAPKIN_SEED={seed})"
    for name, a, b in zip("QKV", pull(dO), pull_ref(dO), strict=True):
        assert rel(a, b) <= GRAD, f"d{name}: {rel(a, b):.2e} (NAPKIN_SEED={seed})"


def test_entry_sliding_window_lambda_skips_blocks(seed):
    """``mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < W`` (W random, below one key chunk): outputs
    against the reference, the kernel's mask an Affine, and its forward skipping: with a NaN in the
    first value row, the query tile whose window starts past the first chunk (queries 128…199 with chunks of
    64 keys) stays finite, while queries of the first tile that mask that row but visit its chunk see it."""
    n, w = 200, int(np.random.default_rng(seed).integers(1, 60))
    window = lambda b, h, q_idx, kv_idx: q_idx - kv_idx < w  # noqa: E731
    i = jnp.arange(n)
    keep = (i[:, None] - i[None, :] < w)[None]
    entry = jax.jit(lambda Q, K, V: nc.attention(Q, K, V, mask_mod=window, interpret=True))
    Q, K, V = compare(seed, entry, lambda Q, K, V: reference(Q, K, V, keep), [(1, n, 2, 16)] * 4, gradients=False)
    made = nc.attention.kernel_for(Q, K, V, mask_mod=window, interpret=True)
    assert (made.signature.tile, made.signature.stream) == (128, 64)
    masks = [m for b in made.derivation.diagram.boxes if (m := affine_mask(b)) is not None]
    assert [m.name for m in masks] == ["<lambda>"]
    out = entry(Q, K, V.at[:, 0].set(jnp.nan))
    assert bool(jnp.isfinite(out[:, 128:]).all()), f"a skipped chunk was read (NAPKIN_SEED={seed})"
    assert bool(jnp.isnan(out[:, w:128]).any()), "the first tile visits the first chunk"


def test_entry_reads_flex_attention_s_positional_functions(seed):
    """``score_mod(score, b, h, m, n)`` (PyTorch's tests' names) and a ``mask_mod`` made by ``and_masks`` of
    ``(batch, head, token_q, token_kv)`` and ``(b, h, q, kv)`` functions, under grouped-query attention: four
    query heads on two key/value heads, the mask reading the query head; found affine."""
    n = 40

    def relative(score, b, h, m, n):
        return score - 0.25 * (m - n)

    def causal(batch, head, token_q, token_kv):
        return token_kv <= token_q

    def widening(b, h, q, kv):
        return q - kv <= 4 * h + 3

    mask_mod = nc.and_masks(causal, widening)
    i, h = jnp.arange(n), jnp.arange(4)[:, None, None]
    keep = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] <= 4 * h + 3)
    bias = -0.25 * (i[:, None] - i[None, :])

    def entry(Q, K, V):
        return nc.attention(Q, K, V, score_mod=relative, mask_mod=mask_mod, interpret=True)

    def ref(Q, K, V):
        return reference(Q, jnp.repeat(K, 2, 2), jnp.repeat(V, 2, 2), keep, bias)

    compare(seed, jax.jit(entry), ref, [(2, n, 4, 16), (2, n, 2, 16), (2, n, 2, 16), (2, n, 4, 16)])
    made = nc.attention.kernel_for(*[jnp.zeros((2, n, k, 16)) for k in (4, 2, 2)], mask_mod=mask_mod, interpret=True)
    masks = [m for b in made.derivation.diagram.boxes if (m := affine_mask(b)) is not None]
    assert masks and {"g", "h_kv"} <= set(masks[0].axes), masks
