"""Attention dropout inside the kernel (``nc.attention(..., dropout_rate=p, dropout_key=key)``).

The reference here imports only the hash (:func:`napkin_cat.generators.keep_bits`): the softmax, the dropout and
the product with V are written with jax.numpy, so the kernels' forward and derived backward (Triton, Mosaic GPU
and the XLA backend, each at its own tiling) must give the same numbers on the same mask. The mask's statistics
are tested on the hash itself: the keep rate, independence across seeds and along each axis, and no correlation
between neighbours, between rows or keys a block apart, or around 2×2 rectangles (the kernels hash rows and keys
separately and combine them per element, which a weak combination would show as rectangle structure).
"""

import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration

from lowering import attention
from napkin_cat.errors import NapkinError
from napkin_cat.generators import keep_bits
from napkin_cat.hardware import H100

# f32 inputs, D = 16: the kernels' forward differs from this reference by ≤ 6e-7 and the gradients by ≤ 1e-5
# (measured, Triton and XLA interpreted)
FWD, GRAD = 1e-5, 1e-4
#: the entry's blocks at D = 16 are 128 queries by 64 keys: 136 makes two query tiles and three key chunks (the
#: last ragged), so the mask is hashed at global offsets; 80 makes one tile and two chunks
LONG, SHORT = 136, 80


def seed_of(key) -> jnp.ndarray:
    """The 32 bits the entry seeds the mask with, from the key (the entry's rule, restated)."""
    return jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)


def reference(q, k, v, key, rate, *, causal=False, broadcast=False, times=1):
    """jax.nn's layout [B, N, H, D]; grouped-query heads as jax.nn groups them (head h reads kv head h // G). Each
    kept weight is divided by ``1 − rate`` ``times`` times (dropout's definition: once)."""
    b, n, h, d = q.shape
    group = h // k.shape[2]
    k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if causal:
        s = jnp.where(jnp.tril(jnp.ones((n, k.shape[1]), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    bi, hi, qi, ki = jnp.meshgrid(*(jnp.arange(m) for m in p.shape), indexing="ij")
    if broadcast:
        bi, hi = 0 * bi, 0 * hi
    kept = keep_bits(seed_of(key), bi, hi, qi, ki) >= jnp.uint32(round(rate * 2**32))
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(kept, p / (1 - rate) ** times, 0.0), v)


def arrays(key, n=LONG, kv_heads=2, heads=4):
    kq, kk, kv = jax.random.split(key, 3)
    q = jax.random.normal(kq, (2, n, heads, 16))
    return q, jax.random.normal(kk, (2, n, kv_heads, 16)), jax.random.normal(kv, (2, n, kv_heads, 16))


#: the options of the Triton case, whose kernel the later tests reuse
TRITON = dict(backend="triton", interpret=True, is_causal=True)


@pytest.mark.parametrize(
    ("backend", "n", "causal", "kv_heads", "broadcast"),
    [("triton", LONG, True, 2, False), ("xla", SHORT, False, 4, True)],
    ids=["triton-causal-gqa", "xla-mha-broadcast"],
)
def test_forward_and_gradients_match_a_reference_on_the_same_hash(key, backend, n, causal, kv_heads, broadcast):
    data, drop = jax.random.split(key)
    q, k, v = arrays(data, n, kv_heads)
    opts = dict(is_causal=causal, dropout_rate=0.25, dropout_key=drop, broadcast_dropout=broadcast)
    out = attention(q, k, v, backend=backend, interpret=True, **opts)
    want = reference(q, k, v, drop, 0.25, causal=causal, broadcast=broadcast)
    assert float(jnp.max(jnp.abs(out - want))) <= FWD

    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v)))

    ours = jax.grad(loss(lambda *a: attention(*a, backend=backend, interpret=True, **opts)), (0, 1, 2))(q, k, v)
    theirs = jax.grad(loss(lambda *a: reference(*a, drop, 0.25, causal=causal, broadcast=broadcast)), (0, 1, 2))(
        q, k, v
    )
    for a, b in zip(ours, theirs, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= GRAD


def test_the_scale_is_applied_once_forward_and_in_every_gradient(key):
    """At rate 0.5 the factor 1/(1 − rate) is 2: the kernels carry it once a row (the forward's normaliser, the
    backward's log-sum-exp and Δ), never per weight, and the output and the gradients of q, k and v match the
    reference that divides each kept weight once, within the bounds above, while those dividing it never or twice
    lie far outside them (the check tells the three apart)."""
    data, drop = jax.random.split(key)
    q, k, v = arrays(data)
    opts = dict(dropout_rate=0.5, dropout_key=drop, **TRITON)

    def grads(f):
        return jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), (0, 1, 2))(q, k, v)

    out, ours = attention(q, k, v, **opts), grads(lambda *a: attention(*a, **opts))
    for times in (0, 1, 2):
        want = reference(q, k, v, drop, 0.5, causal=True, times=times)
        theirs = grads(lambda *a, times=times: reference(*a, drop, 0.5, causal=True, times=times))
        errors = [float(jnp.max(jnp.abs(a - b))) for a, b in zip((out, *ours), (want, *theirs), strict=True)]
        bounds = [FWD, GRAD, GRAD, GRAD]
        if times == 1:
            assert all(e <= b for e, b in zip(errors, bounds, strict=True)), errors
        else:
            assert all(e > 100 * b for e, b in zip(errors, bounds, strict=True)), (times, errors)


def test_the_backward_scales_no_score():
    """The backward's kernels mask the recomputed probabilities and dP, and multiply no score by a constant:
    dropout's 1/(1 − rate) is in L′ = L − log(1/(1 − rate)) (a row) and in Δ's (1 − rate) (a row, computed before)."""
    from lowering._attention import Signature
    from lowering._backward import backward_of
    from napkin_cat.generators import Dropout, Elementwise

    q, k = jnp.zeros((2, SHORT, 4, 16)), jnp.zeros((2, SHORT, 2, 16))
    sig = Signature.of(q, k, k, is_causal=True, dropout_rate=0.1, backend="triton", interpret=True)
    pieces = backward_of(sig.derivation().diagram).pieces
    per_score = [
        box for p in pieces for box in p.diagram.boxes
        if isinstance(box, Dropout | Elementwise) and {"q_idx", "kv_idx"} <= set(box.cod.inside[0].names)
    ]
    masks = [box for box in per_score if isinstance(box, Dropout)]
    assert len(masks) == 3 and not any(box.scaled for box in masks)  # dK·dV: P′ and dP′; dQ: dP′
    assert not any("const" in box.params for box in per_score if isinstance(box, Elementwise))
    rows = [box.params["const"] for p in pieces for box in p.diagram.boxes
            if isinstance(box, Elementwise) and "const" in box.params]
    assert sorted(float(c) for c in rows) == pytest.approx(sorted([0.9, math.log(1 / 0.9), math.log(1 / 0.9)]))


# bf16 operands (Mosaic's wgmma takes 16-bit ones) against the f32 reference: measured ≤ 4.5e-3 (output) and
# ≤ 5.7e-3 (gradients) relative to each array's largest entry over 6 seeds
BF16_FWD, BF16_GRAD = 1e-2, 1.2e-2


def test_mosaic_forward_and_gradients_match_the_reference_on_the_same_hash(key):
    """Mosaic GPU (interpreted) hashes rows and keys as vectors in its wgmma layouts, forward and in the backward's
    kernels, at its own tiles (128 queries): the same mask as the reference. Two batches and two query heads on one
    kv head (grouped, each index hashed past 0): the interpreter's time grows with the grid, the kernels do not."""
    data, drop = jax.random.split(key)
    q, k, v = (a.astype(jnp.bfloat16) for a in arrays(data, 256, kv_heads=1, heads=2))
    opts = dict(is_causal=True, dropout_rate=0.25, dropout_key=drop, backend="mosaic", interpret=True)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))  # noqa: E731
    out, pull = jax.vjp(lambda *a: attention(*a, **opts), q, k, v)  # one forward (interpreted) for both checks
    out = out.astype(jnp.float32)
    ours = pull(jnp.cos(out).astype(jnp.bfloat16))  # the cotangent of Σ sin(out)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    want = reference(*f32, drop, 0.25, causal=True)
    assert float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want))) <= BF16_FWD
    theirs = jax.grad(loss(lambda *a: reference(*a, drop, 0.25, causal=True)), (0, 1, 2))(*f32)
    for a, b in zip(ours, theirs, strict=True):
        assert float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b))) <= BF16_GRAD


def test_mosaic_applies_the_scale_once_forward_and_in_every_gradient(key):
    """Mosaic (interpreted) at rate 0.5, as the Triton case above: within the bf16 bounds of the reference that
    divides each kept weight by 1 − rate once, far outside them from those dividing it never or twice."""
    data, drop = jax.random.split(key)
    q, k, v = (a.astype(jnp.bfloat16) for a in arrays(data, 256, kv_heads=1, heads=2))
    opts = dict(is_causal=True, dropout_rate=0.5, dropout_key=drop, backend="mosaic", interpret=True)
    out, pull = jax.vjp(lambda *a: attention(*a, **opts), q, k, v)
    out = out.astype(jnp.float32)
    ours = [a.astype(jnp.float32) for a in pull(jnp.cos(out).astype(jnp.bfloat16))]  # the cotangent of Σ sin(out)
    f32 = [a.astype(jnp.float32) for a in (q, k, v)]
    for times in (0, 1, 2):
        ref = lambda *a, times=times: reference(*a, drop, 0.5, causal=True, times=times)  # noqa: E731
        want = (ref(*f32), *jax.grad(lambda *a, ref=ref: jnp.sum(jnp.sin(ref(*a))), (0, 1, 2))(*f32))
        errors = [float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip((out, *ours), want,
                                                                                      strict=True)]
        bounds = [BF16_FWD, BF16_GRAD, BF16_GRAD, BF16_GRAD]
        if times == 1:
            assert all(e <= b for e, b in zip(errors, bounds, strict=True)), errors
        else:
            assert all(e > 10 * b for e, b in zip(errors, bounds, strict=True)), (times, errors)


@pytest.fixture
def abstract_hopper(monkeypatch):
    """An sm_90 device for Pallas' Triton lowering, and the MLIR verifier on every Triton module it builds (as
    tests/test_cuda_lowering.py); the modules' text is kept."""
    monkeypatch.setattr(
        registration.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability="9.0")
    )
    build, modules = registration.lowering.lower_jaxpr_to_triton_module, []

    def verified(*args, **kwargs):
        made = build(*args, **kwargs)
        made.module.operation.verify()
        modules.append(str(made.module))
        return made

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verified)
    return modules


def block_ops(module: str, op: str) -> int:
    """How many ``op``s of a Triton module act on 2-D tensors (once per score, not per row or key)."""
    return len(re.findall(rf"= {op} [^\n]*: tensor<\d+x\d+x", module))


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_dropout_kernels_lower_for_cuda(abstract_hopper, backend):
    """Forward and backward with dropout lower for an abstract sm_90 device; Triton's verify, and per score they
    add one xor and one integer multiply to the kernel without dropout (the hash's other work is on vectors), and
    no float multiply: 1/(1 − rate) is carried by rows (the forward's normaliser, the backward's L′ and Δ)."""
    args = [jax.ShapeDtypeStruct((1, 512, 2, 128), jnp.bfloat16)] * 3
    counts = {}
    # the counts compare with the kernel without dropout (rate 0: the same kernel, test_rate_zero_is_...) on Triton
    # only; the entry's Mosaic kernels without dropout lower for CUDA in tests/test_cuda_lowering.py
    # (test_the_entry_fuses_dq_where_measured_faster) and tests/test_mosaic.py (test_backward_lowers_for_cuda)
    for rate in (0.0, 0.1) if backend == "triton" else (0.1,):
        abstract_hopper.clear()
        f = lambda q, k, v, rate=rate: attention(  # noqa: E731
            q, k, v, is_causal=True, dropout_rate=rate, dropout_key=jax.random.key(0), backend=backend,
            interpret=False, hardware=H100)
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        grad = jax.grad(lambda *a, f=f: f(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        text += jax.jit(grad).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        if backend == "mosaic":
            assert "mosaic_gpu" in text
        counts[rate] = [tuple(block_ops(m, op) for op in ("arith.xori", "arith.shrui", "arith.mulf"))
                        for m in abstract_hopper]
    if backend == "triton":
        # the forward and both backward kernels gain xors on blocks (one per chunk loop: unmasked and masked
        # copies), never a 2-D shift: no lowbias32 round runs per score; nor a 2-D float multiply (before the scale
        # left the backward's scores, dQ's kernel had one more per score and dK·dV's two)
        gained = [tuple(b - a for a, b in zip(c0, c1, strict=True)) for c0, c1 in zip(counts[0.0], counts[0.1],
                                                                                   strict=True)]
        assert sum(x > 0 for x, _, _ in gained) >= 3 and all(s == 0 == f for _, s, f in gained), gained


def test_a_new_key_reuses_the_kernel_and_changes_the_mask(key):
    q, k, v = arrays(key)
    first = attention(q, k, v, dropout_rate=0.25, dropout_key=jax.random.key(1), **TRITON)
    before = attention.derivations
    again = jax.jit(lambda key: attention(q, k, v, dropout_rate=0.25, dropout_key=key, **TRITON))
    second = again(jax.random.key(2))
    assert attention.derivations == before
    assert float(jnp.max(jnp.abs(first - second))) > 0.1


def test_rate_zero_is_the_kernel_without_dropout(key):
    q, k, v = arrays(key, SHORT)
    plain = attention(q, k, v, **TRITON)
    before = attention.derivations
    zero = attention(q, k, v, dropout_rate=0.0, dropout_key=jax.random.key(3), **TRITON)
    assert attention.derivations == before
    assert bool(jnp.all(zero == plain))


def test_the_keep_rate_is_binomial(seed):
    """Over 2·4·256·256 = 524288 weights the kept fraction is within 5 standard deviations of 1 − p, for each p."""
    seed %= 2**31  # an int32, as the entry passes the key's bits
    b, h, q, x = np.meshgrid(*(np.arange(m) for m in (2, 4, 256, 256)), indexing="ij")
    n = b.size
    for rate in (0.1, 0.5, 0.9):
        kept = keep_bits(seed, b, h, q, x) >= jnp.uint32(round(rate * 2**32))
        sigma = math.sqrt(n * rate * (1 - rate))
        assert abs(int(kept.sum()) - n * (1 - rate)) <= 5 * sigma, (rate, int(kept.sum()))


def test_masks_are_independent_across_seeds_and_axes(seed):
    """Different seeds give different masks, agreeing on about half the weights at p = 0.5; along each axis (batch,
    head, query, key) the mask changes, and two neighbours along it agree on about half the weights."""
    seed, shape = seed % (2**31 - 1), (4, 4, 64, 64)
    b, h, q, x = np.meshgrid(*(np.arange(m) for m in shape), indexing="ij")
    mask = np.asarray(keep_bits(seed, b, h, q, x) >= jnp.uint32(2**31))
    other = np.asarray(keep_bits(seed + 1, b, h, q, x) >= jnp.uint32(2**31))
    n = mask.size
    assert abs(int((mask == other).sum()) - n / 2) <= 5 * math.sqrt(n / 4)
    for axis in range(4):
        first, rest = np.split(mask, [1], axis=axis)
        agree = int((first == np.take(rest, [0], axis=axis)).sum())
        m = first.size
        assert abs(agree - m / 2) <= 5 * math.sqrt(m / 4), (axis, agree, m)


def bit_correlation(a, b, rate: float) -> float:
    """The z-score of the agreement between two equal-shaped boolean masks, each Bernoulli(1 − rate)."""
    same = rate**2 + (1 - rate) ** 2
    m = a.size
    return (int((a == b).sum()) - m * same) / math.sqrt(m * same * (1 - same))


@pytest.mark.parametrize("rate", [0.5, 0.1])
def test_neighbours_block_strides_and_rectangles_are_uncorrelated(seed, rate):
    """Over 4 heads of 512 × 512: the mask agrees with itself shifted by 1, 2, 64 or 128 queries or keys (a block
    boundary of every tiling the kernels use) as independent bits would, within 5σ; and the xor of a 2×2
    rectangle's corners (adjacent, a block apart, and at random corners) is odd as often as for independent bits:
    ``(1 − (1 − 2p)⁴) / 2``."""
    seed %= 2**31
    n = 512
    mask = np.asarray(keep_bits(seed, 0, jnp.arange(4)[:, None, None], jnp.arange(n)[:, None], jnp.arange(n))
                      >= jnp.uint32(round(rate * 2**32)))
    for axis in (1, 2):
        for d in (1, 2, 64, 128):
            a, b = np.take(mask, range(n - d), axis=axis), np.take(mask, range(d, n), axis=axis)
            assert abs(bit_correlation(a, b, rate)) <= 5, (axis, d)
    odd = (1 - (1 - 2 * rate) ** 4) / 2
    corners = []
    for d, e in ((1, 1), (1, 64), (64, 1), (128, 128)):
        corners.append(mask[:, :-d, :-e] ^ mask[:, d:, :-e] ^ mask[:, :-d, e:] ^ mask[:, d:, e:])
    rng = np.random.default_rng(seed)
    h, q1, q2, x1, x2 = (rng.integers(0, m, 2**20) for m in (4, n, n, n, n))
    far = mask[h, q1, x1] ^ mask[h, q2, x1] ^ mask[h, q1, x2] ^ mask[h, q2, x2]
    corners.append(far[(q1 != q2) & (x1 != x2)])
    for parity in corners:
        m = parity.size
        assert abs(int(parity.sum()) - m * odd) <= 5 * math.sqrt(m * odd * (1 - odd))


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, "0.1", None])
def test_a_rate_outside_0_1_is_refused_by_name(rate):
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(NapkinError, match=r"dropout_rate must be a Python number in \[0, 1\).*0 turns dropout off"):
        attention(q, q, q, dropout_rate=rate, dropout_key=jax.random.key(0))


def test_a_missing_or_wrong_key_is_refused_by_name():
    q = jnp.ones((1, 8, 2, 16))
    with pytest.raises(NapkinError, match=r"dropout_rate=0.1 needs dropout_key.*pass one, or dropout_rate=0"):
        attention(q, q, q, dropout_rate=0.1)
    with pytest.raises(NapkinError, match=r"dropout_key must be a JAX PRNG key .*one key, not a batch"):
        attention(q, q, q, dropout_rate=0.1, dropout_key=jax.random.split(jax.random.key(0), 2))
