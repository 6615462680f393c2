"""The Mosaic GPU backend: kernels run in Mosaic's interpret mode on CPU (register operands staged through
shared memory there), lower to Mosaic GPU for an abstract CUDA device (the compiled path, register A
operand included), and run compiled on a GPU (``gpu``-marked); refusals name the box, axis or level."""

import contextlib
import functools
import os
import re
import signal
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import MosaicConfig, MosaicLowered, NotLowerable, OpenKernel, TritonLowered, lower, mosaic, plan
from lowering._registry import MOSAIC
from lowering._target import _warn_pool, cpu_pool_threads, interpreter_threads_needed
from lowering.mosaic._config import SMEM_LIMIT
from lowering.mosaic._kernel import TURN_BARRIER, MosaicKernel
from napkin_cat.drawing import draw
from napkin_cat.hardware import H100
from rewrites import RewriteError, derive, level, split, stream, tile


def attention(D, g, s, dtype="bf16", **kw):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype, **kw)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def matmul(g_m, g_n, s, dtype="bf16"):
    m, k, n = nc.axes("m k n")
    return derive(nc.library.matmul(m, k, n, dtype=dtype), tile(m, g_m), tile(n, g_n), stream(k, s), verify=False)


@functools.partial(jax.jit, static_argnames=("causal", "score_mod"))  # compiled once per shape, not op by op
def reference(Q, K, V, causal=False, score_mod=None):
    """Attention in f32, written here: einsum, mask, softmax, einsum."""
    Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
    s = jnp.einsum("bhqd,bhkd->bhqk", Q, K) / Q.shape[-1] ** 0.5
    if score_mod is not None:
        s = score_mod(s)
    if causal:
        n = Q.shape[2]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), V)


def inputs(key, shape):
    return [jax.random.normal(k, shape, jnp.bfloat16) for k in jax.random.split(key, 3)]


def relative_error(out, ref):
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


def soft_cap(s):
    return 20 * jnp.tanh(s / 20)


# bf16 operands and output: measured 1.9e-3 .. 2.2e-3 on these sizes (interpret and H100 alike)
BF16 = 5e-3


@pytest.mark.parametrize(
    ("causal", "s", "mod"),
    [(False, 64, None), (True, 128, soft_cap)],
    ids=["plain-s64", "causal-softcap-s128"],
)
def test_interpret_matches_reference(key, causal, s, mod):
    """One head: two query tiles, each streaming 4 (s64) or 2 (s128) chunks; heads on the grid are interpreted in
    the tests below (4 in the L2 sections' test, 2 in the entry's [b, seq, h, d] forward)."""
    Q, K, V = inputs(key, (1, 1, 256, 64))
    kernel = lower(attention(64, 128, s, causal=causal, score_mod=mod), backend="mosaic", interpret=True)
    assert kernel.backend == "mosaic" and kernel.forward.config.interpretable
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal, mod)) <= BF16


def test_causal_tiles_launch_in_sections_that_fit_l2(key, monkeypatch):
    """Causal tiles launch longest first within sections of the batch whose K and V fit the L2 share: with an
    L2 that holds two of four heads' K and V (two sections of two), every (head, tile) is computed once and right."""
    Q, K, V = inputs(key, (1, 4, 256, 64))
    kv = 2 * 256 * 64 * 2  # one head's K and V, bf16
    monkeypatch.setattr(type(MosaicLowered.hardware), "l2_shared_capacity", property(lambda hw: 2 * kv + 1))
    kernel = lower(attention(64, 128, 64, causal=True), backend="mosaic", interpret=True)
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal=True)) <= BF16
    extent = {"b": 1, "h": 4, "q": 256, "x": 256, "d": 64}
    assert MosaicKernel(kernel.forward, {}, extent, [1, 2], [0], 2, 4, [1, 4]).n_members == 2


def test_a_launch_section_that_does_not_divide_the_batch_is_refused(key):
    Q, K, V = inputs(key, (1, 4, 256, 64))
    config = MosaicConfig(members=3, interpretable=True)
    kernel = MosaicLowered(plan(attention(64, 128, 64, causal=True).diagram), interpret=True, config=config)
    with pytest.raises(NotLowerable, match=r"members=3.*must divide the batch \(4 = 1 × 4\)"):
        kernel(Q, K, V)


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_path_lowers_for_cuda(causal):
    """The GPU path (register A operand, in-place accumulation, ping-pong) lowers to Mosaic GPU on CPU; its turns pass
    a named barrier of both consumer warpgroups (``bar.sync``), not an mbarrier, which interpret mode keeps."""
    k = MosaicLowered(plan(attention(128, 256, 64, causal=causal, score_mod=soft_cap).diagram), interpret=False)
    assert not k.config.interpretable and k.pingpong and k.rows == 128
    args = [jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)] * 3
    text = jax.jit(k).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and f"bar.sync {TURN_BARRIER}, 256;" in text


@pytest.mark.parametrize("causal", [False, True])
def test_the_entrys_hopper_forward_reads_b_seq_h_d(key, causal):
    """The schedule ``backend="auto"`` gives the entry on sm_90 at D = 128 (tile 128, stream 128 over jax.nn's
    [b, seq, h, d], read in place), here at d = 64 to interpret quickly: against
    ``jax.nn.dot_product_attention`` in f32, and lowered for CUDA."""
    b, h, q, x, d = nc.axes("b h q x d", d=64)
    att = nc.library.attention(q, x, d, batch=(b, h), seq_at=1, causal=causal, dtype=nc.bf16)
    sched = derive(att, tile(q, 128), stream(x, 128), verify=False)
    assert mosaic.faster(MosaicLowered(plan(sched.diagram))) is None
    Q, K, V = inputs(key, (1, 256, 2, 64))
    kernel = lower(sched, backend="mosaic", interpret=True, config=MosaicConfig(interpretable=True))
    want = jax.nn.dot_product_attention(*(a.astype(jnp.float32) for a in (Q, K, V)), is_causal=causal)
    assert relative_error(kernel(Q, K, V), want) <= BF16
    compiled = MosaicLowered(plan(sched.diagram), interpret=False)
    args = [jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)] * 3
    assert "mosaic_gpu" in jax.jit(compiled).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_refusals_name_the_cause():
    with pytest.raises(NotLowerable, match=r"input .*wgmma takes 16-bit operands"):
        MosaicLowered(plan(attention(64, 128, 64, dtype="f32").diagram))
    with pytest.raises(NotLowerable, match=r"axis 'q': the tile g = 64 splits over 2 consumer warpgroups"):
        MosaicLowered(plan(attention(64, 64, 64).diagram), config=MosaicConfig(consumers=2))
    with pytest.raises(NotLowerable, match=r"warpgroup level: 4 consumers × 232 registers"):
        MosaicLowered(plan(attention(64, 256, 64).diagram), config=MosaicConfig(consumers=4))
    big = MosaicLowered(plan(attention(256, 256, 128).diagram), interpret=False)
    Q = jnp.ones((1, 1, 256, 256), jnp.bfloat16)
    with pytest.raises(NotLowerable, match=r"thread-block level: the kernel would hold 394,240 B of shared memory"):
        big(Q, Q, Q)


def test_output_reuses_the_query_tile():
    """FA3's epilogue: O is stored through Q's shared-memory tile, so g256 s128 at D = 128 fits (192 KiB)."""
    k = MosaicLowered(plan(attention(128, 256, 128).diagram), interpret=False)
    assert k.reuse == [0] and "stored through the shared-memory tile of q/256" in k.source
    assert k.smem_bytes({"d": 128}) == 2 * 2 * 128 * 128 * 2 + 2 * 128 * 128 * 2 + 1024  # and the barriers


def test_auto_takes_triton_off_hopper_and_says_why(key):
    kernel = lower(attention(64, 128, 64), backend="auto")
    assert kernel.backend == "triton" and isinstance(kernel.forward, TritonLowered)
    assert "is not an sm_90 (Hopper) GPU" in kernel.refused["forward"]
    Q, K, V = inputs(key, (1, 2, 128, 64))
    assert relative_error(kernel(Q, K, V), reference(Q, K, V)) <= BF16


def test_mosaic_is_a_candidate_on_hopper_where_it_lowers(hopper):
    hopper()
    assert MOSAIC.available(None, None) is None
    fits = plan(attention(64, 128, 64).diagram)
    assert MOSAIC.admit(fits, interpret=False, config=None) is None
    assert isinstance(MOSAIC.emit(fits, interpret=False, config=None, hardware=None), MosaicLowered)
    why = MOSAIC.admit(plan(attention(64, 128, 64, dtype="f32").diagram), interpret=False, config=None)
    assert why.startswith("input") and "16-bit" in why
    why = MOSAIC.admit(plan(attention(256, 256, 128).diagram), interpret=False, config=None)
    assert "394,240 B of shared memory" in why


def test_auto_takes_mosaic_per_kernel_where_measured_faster(hopper):
    """On sm_90: the forward at 128-row consumer blocks on Mosaic; the backward's kernels on Mosaic too, at its
    own chunks where Triton could stand in (D = 64: dQ streams 128, with ping-pong); 64-row forward blocks on
    Mosaic streaming 128 (the entry's g128 s128), on Triton streaming 64, saying why."""
    hopper()
    auto = lower(attention(128, 256, 64, causal=True), backend="auto", interpret=False)
    assert auto.backend == "mosaic" and isinstance(auto.forward.mosaic, MosaicLowered)
    backends = auto.backends
    assert backends["forward"] == backends["forward with residuals"] == "mosaic"
    pieces = [r for r in backends if r.startswith("backward kernel")]
    assert len(pieces) == 3 and all(backends[r] == "mosaic" for r in pieces) and not auto.refused
    # D = 128: dQ streams Mosaic's 128 keys; a shape Mosaic cannot take runs on the Triton kernel of the same
    # diagram, whose 128-key chunks fit two stages (its policy's depth there); no ping-pong in the backward at
    # D = 128 (measured)
    assert "backward kernel d(input 0) (tile(q, 128), stream(x, 128))" in pieces
    assert all(k.pingpong is False for k in auto.kernels[2:])
    narrow = lower(attention(64, 256, 128, causal=True), backend="auto", interpret=False)
    dq = narrow.kernels[2]
    assert (narrow.backends[next(r for r in narrow.backends if "d(input 0)" in r)], dq.s, dq.pingpong) == (
        "mosaic",
        128,
        True,
    )
    slow = lower(attention(64, 128, 64), backend="auto", interpret=False)
    assert slow.backend == "triton" and "Mosaic not measured faster than Triton" in slow.refused["forward"]
    assert lower(attention(128, 128, 128), backend="auto", interpret=False).backends["forward"] == "mosaic"
    b, h, q, x, d = nc.axes("b h q x d", q=1000, x=1000, d=128)
    ragged = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16")
    fixed = lower(derive(ragged, tile(q, 256), stream(x, 64), verify=False), backend="auto", interpret=False)
    assert (
        fixed.backend == "triton"
        and "axis 'q' of size 1000: the Mosaic backend needs whole blocks of 256" in (fixed.refused["forward"])
    )


def test_auto_keeps_a_kernel_mosaic_gpu_cannot_lower_on_triton_saying_why(hopper, key):
    """A score modifier using a primitive Mosaic GPU has no rule for (``pow``): 'auto' on sm_90 finds it when it
    builds the kernel, by lowering it for CUDA, and takes Triton, naming the primitive (before, the first compiled
    call failed inside Mosaic GPU's lowering). ``backend="mosaic"`` refuses it by name. The Triton kernel's forward
    stays right, against ``jax.nn.softmax`` of the modified scores."""
    hopper()

    def powed(s, q, x):
        return s * jnp.abs(s) ** 0.5

    b, h, q, x, d = nc.axes("b h q x d", d=64)
    att = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", score_mod=powed)
    kernel = lower(derive(att, tile(q, 256), stream(x, 128), verify=False), backend="auto", interpret=True)
    assert kernel.backend == "triton"
    plain = lower(attention(64, 256, 128), backend="auto", interpret=False)  # the same blocks, no pow: Mosaic
    assert plain.backends["forward"] == "mosaic", plain.refused
    hopper_again = lower(derive(att, tile(q, 256), stream(x, 128), verify=False), backend="auto", interpret=False)
    assert hopper_again.backend == "triton"
    assert re.search(r"Mosaic refused: Mosaic GPU does not lower it for CUDA: .*: pow", hopper_again.refused["forward"])
    with pytest.raises(NotLowerable, match=r"Mosaic, forward: Mosaic GPU does not lower it for CUDA: .*: pow"):
        lower(derive(att, tile(q, 256), stream(x, 128), verify=False), backend="mosaic", interpret=False)
    Q, K, V = inputs(key, (1, 2, 256, 64))

    def want(Q, K, V):
        s = jnp.einsum("bhqd,bhkd->bhqk", Q, K) / 8.0
        return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(powed(s, None, None), axis=-1), V)

    f32 = [a.astype(jnp.float32) for a in (Q, K, V)]
    assert relative_error(kernel(Q, K, V), want(*f32)) <= BF16


def test_auto_binds_a_symbolic_head_dim_at_the_call(hopper):
    """A diagram whose head dim is symbolic (every ``nc.library`` variant, drawn with ``nc.axes("q x d")``) under
    'auto' on sm_90: Mosaic's registers depend on the head dim, so ``lower`` binds it at the call
    (:func:`rewrites.bind_sizes`), one kernel per head dim whatever the sequence lengths. At D = 128 every
    kernel runs on Mosaic; at D = 96, which Mosaic was never measured at, on Triton, saying so."""
    hopper()
    b, h, q, x, d = nc.axes("b h q x d")
    soft = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", score_mod=soft_cap, causal=True)
    kernel = lower(derive(soft, tile(q, 128), stream(x, 128), verify=False), backend="auto", interpret=False)
    assert isinstance(kernel, OpenKernel) and kernel.backend is None
    at128 = kernel.at(b=1, h=2, q=256, x=256, d=128)
    assert kernel.at(b=2, h=4, q=1024, x=512, d=128) is at128 and kernel.backend == "mosaic"
    assert set(at128.backends.values()) == {"mosaic"}, at128.backends
    assert at128.forward.whole() == {"d": 128} and at128.diagram.dom.inside[0].axis("d").size == 128
    at96 = kernel.at(b=1, h=2, q=256, x=256, d=96)
    assert at96.backend == "triton" and "whole axis d = 96" in at96.refused["forward"]
    assert lower(derive(soft, tile(q, 128), stream(x, 128), verify=False), backend="triton").backend == "triton"


def test_a_grid_axis_innermost_is_refused_before_compiling():
    """TMA copies blocks whose innermost axis is contiguous: a wire whose last axis is a grid (batch) axis is
    refused by name, before anything compiles."""
    m, k, n, h = nc.axes("m k n h", h=4)
    c = nc.contract("m k h, k n h -> m n h", m, k, n, h, dtype="bf16", out_dtype="bf16")
    with pytest.raises(NotLowerable, match=r"input m/128×k~64×h:bf16@HBM: its innermost axis 'h' is a grid \(batch\)"):
        lower(derive(c, tile(m, 128), tile(n, 64), stream(k, 64), verify=False), backend="mosaic")


def test_auto_keeps_inputs_mosaic_was_not_measured_on_on_triton(hopper):
    """Bias and mask arrays were never timed on Mosaic: on sm_90 'auto' keeps each kernel that reads them on
    Triton, naming the input; Δ, which reads only O and dO, still runs on Mosaic. Segment ids and sink logits were
    measured faster (docs/mosaic.md v7): every kernel of the documents' and the sinks' attention runs on Mosaic."""
    hopper()
    b, q, x, d = nc.axes("b q x d", d=128)
    kw = dict(dtype="bf16", batch=(b,), bias_batch=(b,), bias_dtype="bf16")
    biased = nc.library.dot_product_attention(q, x, d, **kw)
    auto = lower(derive(biased, tile(q, 128), stream(x, 64), verify=False), backend="auto", interpret=False)
    on_mosaic = [role for role, backend in auto.backends.items() if backend == "mosaic"]
    assert on_mosaic == ["backward kernel Δ (tile(q, 128))"], auto.backends
    assert auto.refused["forward"].startswith("input 3 (b×q/128×x~64:bf16@HBM): Mosaic compiled and measured only")
    docs = nc.library.dot_product_attention(q, x, d, dtype="bf16", batch=(b,), segment_batch=(b,))
    auto = lower(derive(docs, tile(q, 128), stream(x, 128), verify=False), backend="auto", interpret=False)
    assert set(auto.backends.values()) == {"mosaic"}, auto.refused
    sinks = nc.library.sink_attention(q, x, d, dtype="bf16", batch=(b,), causal=True)
    auto = lower(derive(sinks, tile(q, 128), stream(x, 128), verify=False), backend="auto", interpret=False)
    assert set(auto.backends.values()) == {"mosaic"}, auto.refused


def _vector_input(key, kind: str, shape, dim=128):
    """Inputs ``[B, N, H, D]`` in bf16, a cotangent, and a vector of ``shape`` passed as ``kind``: a bf16 ``bias`` well
    away from zero (per batch row or per head, along the keys), so that a dropped or misplaced bias shows, or a bool
    padding ``mask`` of the keys or the queries (about a fifth padded; the first key or query always kept, so that no
    causal row is empty: ``jax.nn`` gives an empty row V's mean, napkin-cat 0)."""
    ks = jax.random.split(key, 5)
    q, k, v, ct = (jax.random.normal(kk, (2, 256, 2, dim), jnp.bfloat16) for kk in ks[:4])
    if kind == "bias":
        return q, k, v, ct, (2 * jax.random.normal(ks[4], shape)).astype(jnp.bfloat16)
    mask = jax.random.bernoulli(ks[4], 0.8, shape)
    return q, k, v, ct, mask.at[..., 0].set(True) if shape[-1] > 1 else mask.at[..., 0, :].set(True)


def _vector_input_errors(q, k, v, ct, a, kind: str, **kw):
    """Relative errors of ``nc.attention``'s output and its gradients (q, k, v, and a bias's, summed over the
    queries) against ``jax.nn``'s in f32 on the same rounded inputs, whose rows a query mask empties are 0
    (napkin-cat's convention; ``jax.nn`` gives V's mean there)."""
    n = 4 if kind == "bias" else 3  # a mask has no gradient
    seen = True if kind == "bias" else jnp.any(a, axis=-1)[:, 0, :, None, None]  # [B, Nq, 1, 1]: rows some key sees

    def ref(*x):
        out = jax.nn.dot_product_attention(*x[:3], **{kind: x[3] if n == 4 else a}, is_causal=True)
        return jnp.where(seen, out, 0.0)

    want, pull = jax.vjp(ref, *(x.astype(jnp.float32) for x in (q, k, v, a)[:n]))
    def attention(*x):
        return nc.attention(*x[:3], **{kind: x[3] if n == 4 else a}, is_causal=True, **kw)

    got, mine = jax.vjp(attention, *(q, k, v, a)[:n])
    return [relative_error(g, w) for g, w in zip((got, *mine(ct)), (want, *pull(ct.astype(jnp.float32))), strict=True)]


#: the vectors along one sequence axis Mosaic holds in f32 (``MosaicLowered.held``): (keyword, shape)
VECTOR_INPUTS = [("bias", (2, 1, 1, 256)), ("bias", (1, 2, 1, 256)), ("mask", (2, 1, 1, 256)), ("mask", (2, 1, 256, 1))]
VECTOR_IDS = ["bias-per-batch-key", "bias-per-head-key", "mask-keys", "mask-queries"]


@pytest.mark.parametrize(("kind", "shape"), VECTOR_INPUTS, ids=VECTOR_IDS)
def test_a_bias_or_padding_mask_per_key_runs_on_mosaic(hopper, key, kind, shape):
    """A bf16 bias per key (``[B, 1, 1, N]``, additive key padding; ``[1, H, 1, N]``) or a bool padding mask of the
    keys (``[B, 1, 1, N]``, the commonest mask ``jax.nn`` users pass) or of the queries is a vector along one sequence
    axis. Mosaic GPU lays out no bf16 vector against a block and copies no ``i1`` array, so the kernel holds it in f32
    (``MosaicLowered.held``), and ``library.keep_where`` spreads a mask over the scores before reading it as a
    condition (compared as a vector, the ``i1`` result met no layout). 'auto' on sm_90 takes Mosaic for every kernel,
    each lowering for CUDA (before: Triton for all but Δ, the vector 'not measured'); interpreted on Mosaic, output
    and every gradient match ``jax.nn`` in f32."""
    q, k, v, ct, a = _vector_input(key, kind, shape)
    hopper()
    kernel = nc.attention.kernel_for(q, k, v, **{kind: a}, is_causal=True, interpret=False).kernel
    assert set(kernel.backends.values()) == {"mosaic"}, kernel.refused
    assert all(m.lowering_error() is None for m in [kernel.forward.mosaic, *kernel.kernels[1:]]), kernel.backends
    # interpreted at D = 64: at 128 the interpreter's staged P (32 KiB) leaves dQ's 128-key chunks no room
    errors = _vector_input_errors(*_vector_input(key, kind, shape, 64), kind, backend="mosaic", interpret=True)
    # measured over seeds 0-2 (bf16 rounding of the output and gradients): bias 1.7e-3 … 3.3e-3, mask 1.9e-3 … 2.6e-3;
    # a bias or mask dropped or read at the wrong key gives errors of order 0.1-1
    assert max(errors) <= BF16, errors


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "shape"), VECTOR_INPUTS, ids=VECTOR_IDS)
def test_compiled_bias_or_padding_mask_per_key_on_mosaic(key, kind, shape):
    """The bf16 bias per key and the bool padding mask compiled on the GPU under 'auto' (every kernel on Mosaic on
    sm_90), output and every gradient against ``jax.nn`` in f32."""
    q, k, v, ct, a = _vector_input(key, kind, shape)
    kernel = nc.attention.kernel_for(q, k, v, **{kind: a}, is_causal=True).kernel
    errors = _vector_input_errors(q, k, v, ct, a, kind)
    assert max(errors) <= COMPILED_GRAD, (errors, kernel.backends)


def _flex_inputs(key, kind: str, n: int, heads: int):
    """q, k, v and a cotangent ``[2, n, heads, 128]`` in bf16, and the captured ``[2, n]`` array of ``kind``: a
    normal table (the score read twice) or a bool padding mask, about a fifth padded, the first key always kept."""
    ks = jax.random.split(key, 5)
    q, k, v, ct = (jax.random.normal(kk, (2, n, heads, 128), jnp.bfloat16) for kk in ks[:4])
    if kind == "score read twice":
        return q, k, v, ct, jax.random.normal(ks[4], (2, n))
    return q, k, v, ct, jax.random.bernoulli(ks[4], 0.8, (2, n)).at[:, 0].set(True)


def _flex_function(kind: str, a):
    """A FlexAttention user's function over a captured ``[B, N]`` array ``a`` (a bool padding mask, or a float
    table), and the ``jax.nn`` bias ``[B, 1, 1, N]`` it means."""
    if kind == "padding mask_mod":
        return dict(mask_mod=lambda b, h, q_idx, kv_idx: a[b, kv_idx]), jnp.where(a, 0.0, -jnp.inf)[:, None, None]
    if kind == "where over a read mask":
        fn = lambda s, b, h, q_idx, kv_idx: jnp.where(a[b, kv_idx], s, -jnp.inf)  # noqa: E731
        return dict(score_mod=fn), jnp.where(a, 0.0, -jnp.inf)[:, None, None]
    # the score read twice: its derivative sums two cotangents (autodiff's add_any, which Mosaic GPU does not lower)
    fn = lambda s, b, h, q_idx, kv_idx: jnp.where(a[b, kv_idx] > 0, s, s - 1.0)  # noqa: E731
    return dict(score_mod=fn), jnp.where(a > 0, 0.0, -1.0)[:, None, None]


@pytest.mark.parametrize("kind", ["padding mask_mod", "where over a read mask", "score read twice"])
def test_flexattention_functions_over_captured_vectors_run_on_mosaic(hopper, key, kind):
    """FlexAttention-style functions reading a captured ``[B, N]`` array along the keys: a padding mask as a
    ``mask_mod`` (``keep[b, kv_idx]``), ``jnp.where`` over such a read, a score modifier reading the score twice. The
    read arrives in the kernel held in f32 and is cast back to bool as ``x != 0`` (``generators._index._cast``:
    Mosaic GPU converts no block to ``i1``), and a derivative taken inside the kernel binds ``add_any`` as ``add``
    (``generators._vectors.plain``). 'auto' on sm_90 takes Mosaic for every kernel, each lowering for CUDA (before:
    Triton, 'Register bitwidth … got 2' or 'Unimplemented primitive … add_any'); the padding mask, interpreted on
    Mosaic, matches ``jax.nn`` in f32, output and gradients."""
    q, k, v, ct, a = _flex_inputs(key, kind, n=256, heads=2)
    kw, _ = _flex_function(kind, a)
    hopper()
    kernel = nc.attention.kernel_for(q, k, v, **kw, is_causal=True, interpret=False).kernel
    assert set(kernel.backends.values()) == {"mosaic"}, kernel.refused
    assert all(m.lowering_error() is None for m in [kernel.forward.mosaic, *kernel.kernels[1:]]), kernel.backends
    if kind != "padding mask_mod":
        return
    q, k, v, ct = (x[..., :64] for x in (q, k, v, ct))  # D = 64 interpreted (the staged P at 128: see above)
    kw, bias = _flex_function(kind, a)
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    want, pull = jax.vjp(lambda *x: jax.nn.dot_product_attention(*x, bias=bias, is_causal=True), *f32)
    got, mine = jax.vjp(lambda *x: nc.attention(*x, **kw, is_causal=True, backend="mosaic", interpret=True), q, k, v)
    pairs = zip((got, *mine(ct)), (want, *pull(ct.astype(jnp.float32))), strict=True)
    errors = [relative_error(g, w) for g, w in pairs]
    # measured over seeds 0-1: 1.9e-3 … 2.6e-3 (bf16 rounding); the mask dropped gives 0.38-0.42
    assert max(errors) <= BF16, errors


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["padding mask_mod", "where over a read mask", "score read twice"])
def test_compiled_flexattention_functions_over_captured_vectors_on_mosaic(key, kind):
    """The three functions above compiled on the GPU under 'auto' (Mosaic for every kernel on sm_90), output and
    gradients against ``jax.nn`` in f32 with the bias each means."""
    q, k, v, ct, a = _flex_inputs(key, kind, n=1024, heads=4)
    kw, bias = _flex_function(kind, a)
    kernel = nc.attention.kernel_for(q, k, v, **kw, is_causal=True).kernel
    f32 = (x.astype(jnp.float32) for x in (q, k, v))
    want, pull = jax.vjp(lambda *x: jax.nn.dot_product_attention(*x, bias=bias, is_causal=True), *f32)
    got, mine = jax.vjp(lambda *x: nc.attention(*x, **kw, is_causal=True), q, k, v)
    pairs = zip((got, *mine(ct)), (want, *pull(ct.astype(jnp.float32))), strict=True)
    errors = [relative_error(g, w) for g, w in pairs]
    assert max(errors) <= COMPILED_GRAD, (errors, kernel.backends)


@contextlib.contextmanager
def within(seconds: int):
    """Fail (rather than hang the suite) where the block runs longer than ``seconds``."""

    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    before = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def test_segment_ids_run_on_mosaic_and_lower_for_cuda(key):
    """Documents (segment ids, i32) on Mosaic: interpreted against ``jax.nn`` with the documents' mask, output and
    gradients; lowered for CUDA, forward and backward. The ids enter registers as f32 (``Smem.value``): loaded as
    i32 and cast after their broadcast, they sent Mosaic GPU's layout inference into a search that ran past 75 s on
    the H100 and failed after 66 s on the CPU (the 'hang' of docs/mosaic.md v6)."""
    b, q, x, d = nc.axes("b q x d", d=64)
    docs = nc.library.dot_product_attention(q, x, d, dtype="bf16", batch=(b,), segment_batch=(b,))
    sched = derive(docs, tile(q, 128), stream(x, 128), verify=False)
    Q, K, V, dO = (jax.random.normal(k, (1, 256, 64), jnp.bfloat16) for k in jax.random.split(key, 4))
    ids = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (1, 256), 0, 3))  # three packed documents

    def want(Q, K, V):
        keep = ids[:, :, None] == ids[:, None, :]
        s = jnp.einsum("bqd,bkd->bqk", Q, K) / 8.0
        return jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), V)

    kernel = lower(sched, backend="mosaic", interpret=True)
    got = gradients(lambda Q, K, V: kernel(Q, K, V, ids, ids), Q, K, V, dO)
    ref = gradients(want, *(a.astype(jnp.float32) for a in (Q, K, V, dO)))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, ref, strict=True):
        assert relative_error(g, w) <= (BF16 if name == "O" else BF16_GRAD), name
    compiled = lower(sched, backend="mosaic", interpret=False)
    sd, si = jax.ShapeDtypeStruct((1, 256, 64), jnp.bfloat16), jax.ShapeDtypeStruct((1, 256), jnp.int32)
    backward = lambda Q, K, V, dO, a, c: gradients(lambda *qkv: compiled(*qkv, a, c), Q, K, V, dO)  # noqa: E731
    with within(120):
        for f, args in ((compiled, (sd, sd, sd, si, si)), (backward, (sd, sd, sd, sd, si, si))):
            assert "mosaic_gpu" in jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_mosaic_skips_the_chunks_segment_ids_hide(key):
    """Block sparsity from the ids (``segment_blocks``, as on Triton): with documents [0, 128), [128, 192) and
    [192, 256), the first query tile never loads the second key chunk, whose values are NaN: its rows stay finite
    and right, while the second tile, which reads them, gives NaN. Every kernel of the backward finds the mask."""
    b, q, x, d = nc.axes("b q x d", d=64)
    docs = nc.library.dot_product_attention(q, x, d, dtype="bf16", batch=(b,), segment_batch=(b,))
    kernel = lower(derive(docs, tile(q, 128), stream(x, 128), verify=False), backend="mosaic", interpret=True)
    # the backward recomputes the mask and differentiates it: two boxes each hide; Δ has no loop
    assert [len(k.segments) for k in (kernel.forward, *kernel.kernels)] == [1, 1, 0, 2, 2]
    Q, K, V = inputs(key, (1, 256, 64))
    ids = jnp.repeat(jnp.array([[0, 1, 2]]), jnp.array([128, 64, 64]), axis=1, total_repeat_length=256)
    keep = ids[:, :, None] == ids[:, None, :]
    s = jnp.einsum("bqd,bkd->bqk", *(a.astype(jnp.float32) for a in (Q, K))) / 8.0
    want = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), V.astype(jnp.float32))
    out = kernel(Q, K, V.at[:, 128:].set(jnp.nan), ids, ids)
    assert relative_error(out[:, :128], want[:, :128]) <= BF16
    assert bool(jnp.isnan(out[:, 128:]).all())


def test_auto_runs_shapes_of_ragged_blocks_on_triton_and_says_so(hopper, key):
    """Axis sizes known only when called: Mosaic pads nothing, so a shape that is not whole blocks runs on the
    Triton kernel of the same diagram (which pads), recorded per shape."""
    hopper()
    made = attention(64, 256, 128)
    auto = lower(made, backend="auto", interpret=False)
    assert auto.backends["forward"] == "mosaic"
    auto.forward._triton = lambda: TritonLowered(plan(made.diagram), interpret=True)  # CPU: interpreted
    Q, K, V = inputs(key, (1, 2, 200, 64))
    assert relative_error(auto(Q, K, V), reference(Q, K, V)) <= BF16
    shape = ((1, 2, 200, 64),) * 3
    assert auto.backends[f"forward at {shape}"] == "triton"
    assert auto.refused[f"forward at {shape}"] == "axis 'q' of size 200: the Mosaic backend needs whole blocks of 256"


@settings(max_examples=2, deadline=None)
@given(m=st.sampled_from([128, 256]), n=st.sampled_from([64, 128]), k=st.sampled_from([64, 192]))
def test_matmul_interpret_matches_reference(m, n, k):
    """Not an attention template: a tiled, streamed matmul on the same lowering (two tiled axes on the grid)."""
    a, b = (jax.random.normal(jax.random.key(m + n + k + i), sh, jnp.bfloat16) for i, sh in enumerate([(m, k), (k, n)]))
    kernel = lower(matmul(128, 64, 64), backend="mosaic", interpret=True, config=MosaicConfig(interpretable=True))
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
    assert relative_error(kernel(a, b), want) <= BF16, f"seed {m + n + k}"


def test_a_small_cpu_pool_warns_that_the_interpreter_can_deadlock(monkeypatch):
    """Mosaic GPU's interpreter waits for its warpgroup threads inside XLA's CPU pool: at PJRT_NPROC=1 the segment-ids
    test hung every time, and at two CPUs the suite now and then. A kernel interpreted where the pool is smaller than
    it may need warns once, naming the fix; the suite's own pool (tests/conftest.py) is large enough."""
    assert cpu_pool_threads() >= interpreter_threads_needed(4)  # row 16's three consumers and the producer
    _warn_pool.cache_clear()
    monkeypatch.setenv("PJRT_NPROC", "2")
    kernel = lower(matmul(128, 64, 64), backend="mosaic", interpret=True, config=MosaicConfig(interpretable=True))
    arg = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match=r"pool has 2 threads .* an interpreted kernel of 3 warpgroups may hold "
                      r"8 of them .* set PJRT_NPROC=16"):
        jax.jit(kernel).trace(arg, arg)
    _warn_pool.cache_clear()


def test_matmul_lowers_for_cuda():
    k = MosaicLowered(plan(matmul(256, 128, 64).diagram), interpret=False, config=MosaicConfig(stages=3))
    assert k.rows == 128 and k.others == {"n": 128}
    assert k.source.startswith("plgpu.kernel grid (sections, n/128, m/256, members)")
    args = [jax.ShapeDtypeStruct((512, 256), jnp.bfloat16), jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)]
    assert "mosaic_gpu" in jax.jit(k).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@settings(max_examples=5, deadline=None)
@given(g=st.sampled_from([64, 128, 256, 512]), s=st.sampled_from([16, 32, 64, 128]))
@example(g=64, s=64).via("one consumer")
def test_block_guards(g, s):
    """A tile must split into whole 64-row warpgroup blocks (a tile of 64: one consumer), a chunk must be a
    multiple of 64."""
    if g % 128 == 0 and s % 64 == 0:
        assert MosaicLowered(plan(attention(64, g, s).diagram)).rows == g // 2
    elif g == 64 and s % 64 == 0:
        k = MosaicLowered(plan(attention(64, g, s).diagram))
        assert (k.rows, k.config.consumers) == (64, 1)
    else:
        with pytest.raises(NotLowerable, match=r"axis '[qx]'"):
            MosaicLowered(plan(attention(64, g, s).diagram))


@pytest.mark.gpu
@pytest.mark.parametrize(("D", "causal", "s"), [(128, False, 64), (128, True, 64), (64, False, 128), (64, True, 128)])
def test_compiled_matches_reference(key, D, causal, s):
    Q, K, V = inputs(key, (2, 4, 1024, D))
    kernel = lower(attention(D, 256, s, causal=causal, score_mod=soft_cap), backend="mosaic")
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, causal, soft_cap)) <= BF16


def test_registers_refuse_a_spilling_tile():
    """g256 s128 at D = 128 fits shared memory once O reuses Q's tile, but not a consumer's registers."""
    k = MosaicLowered(plan(attention(128, 256, 128).diagram), interpret=False)
    assert k.smem_bytes({"d": 128}) <= SMEM_LIMIT
    with pytest.raises(NotLowerable, match=r"warpgroup level: a consumer thread would keep 256 f32 registers"):
        k.check({"d": 128})
    assert MosaicLowered(plan(matmul(256, 128, 64).diagram)).registers({}) == 128


@pytest.mark.gpu
def test_auto_takes_mosaic_on_the_gpu(key):
    kernel = lower(attention(128, 256, 64, causal=True), backend="auto")
    assert kernel.backend == "mosaic", kernel.refused
    Q, K, V = inputs(key, (1, 2, 512, 128))
    assert relative_error(kernel(Q, K, V), reference(Q, K, V, True)) <= BF16
    dQ = jax.grad(lambda Q: kernel(Q, K, V).astype(jnp.float32).sum())(Q)
    want = jax.grad(lambda Q: reference(Q, K, V, True).sum())(Q)
    assert relative_error(dQ, want) <= BF16_GRAD


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_compiled_matmul_matches_reference(key, dtype):
    jdt = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    a, b = (jax.random.normal(k, (1024, 1024), jdt) for k in jax.random.split(key))
    kernel = lower(matmul(256, 128, 64, dtype), backend="mosaic", config=MosaicConfig(stages=3, pingpong=False))
    want = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    assert relative_error(kernel(a, b), want) <= BF16


# -- the backward on Mosaic: Δ, dQ (tile q, stream x) and dK·dV (tile x, stream q), each a Mosaic kernel


def gradients(f, Q, K, V, dO):
    out, pull = jax.vjp(f, Q, K, V)
    return (out, *pull(dO))


# bf16 operands and cotangents against an f32 jax.grad: measured 2.5e-3 .. 2.9e-3 (interpret, N = 256, D = 64)
BF16_GRAD = 6e-3
COMPILED_GRAD = 1e-2


def test_backward_interpret_matches_jax_grad(key, causal=True):
    """Causal: dQ skips the chunks above the diagonal, dK·dV (tile x, stream q) masks every chunk. Two tiles
    each way; the plain loop is checked compiled (gpu-marked) and lowered for CUDA below."""
    Q, K, V, dO = (jax.random.normal(k, (1, 1, 256, 64), jnp.bfloat16) for k in jax.random.split(key, 4))
    kernel = lower(attention(64, 128, 64, causal=causal), backend="mosaic", interpret=True)
    assert kernel.differentiation == "lowered" and set(kernel.backends.values()) == {"mosaic"}
    # FA3's ping-pong turns where a chunk issues S and P·V (the forwards), and dQ's three at D = 64 (measured);
    # none for Δ or dK·dV (4 wgmmas); dQ streams Mosaic's 128 keys
    turns = [(k.products, k.pingpong, k.s) for k in (kernel.forward, *kernel.kernels)]
    assert turns == [(2, True, 64), (2, True, 64), (0, False, None), (3, True, 128), (4, False, 64)]
    got = gradients(kernel, Q, K, V, dO)
    want = gradients(jax.jit(lambda *a: reference(*a, causal)), Q, K, V, dO.astype(jnp.float32))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert relative_error(g, w) <= (BF16 if name == "O" else BF16_GRAD), name


@pytest.mark.parametrize("mask", ["none", "causal", "window"])
def test_backward_lowers_for_cuda(mask):
    """Every backward kernel (register A operands, in-place accumulation, ping-pong, Δ without a loop, the chunks a
    mask hides skipped) lowers to Mosaic GPU on CPU; dK and dV, stored in the inputs' bf16, go out through K's
    and V's shared-memory tiles (dead by then), as O goes out through Q's."""
    if mask == "window":
        q, x, d = nc.axes("q x d", d=128)
        attn = nc.library.sliding_window_attention(q, x, d, window=300, dtype="bf16")
        kernel = lower(derive(attn, tile(q, 256), stream(x, 64), verify=False), backend="mosaic", interpret=False)
        sd = jax.ShapeDtypeStruct((1024, 128), jnp.bfloat16)
    else:
        made = attention(128, 256, 64, causal=mask == "causal", score_mod=soft_cap)
        kernel = lower(made, backend="mosaic", interpret=False)
        sd = jax.ShapeDtypeStruct((1, 2, 512, 128), jnp.bfloat16)
    *_, dkv = kernel.kernels
    assert (
        dkv.q == "x"
        and dkv.x == "q"
        and len(dkv.masks) == (0 if mask == "none" else 2)  # the mask and its backward (Kept), both affine
        and dkv.reuse == [1, 2]
        and dkv.shared == [None, None]
        and dkv.smem_bytes({"d": 128}) <= SMEM_LIMIT
    )
    text = jax.jit(lambda *a: gradients(kernel, *a)).trace(sd, sd, sd, sd).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize(("D", "chunks"), [(64, (128, 64)), (128, (128, 64)), (None, (64, 64))])
def test_the_backward_streams_mosaics_own_chunks_where_its_registers_admit_them(D, chunks):
    """dQ streams 128 keys on Mosaic (measured 1.05–1.11× faster than 64, docs/mosaic.md v6), halved where Mosaic
    refuses it (D = 256: tests/test_head_dims_mosaic.py); dK·dV keeps 64 queries (at D = 64 128 was no faster; at
    D = 128 its registers refuse it); with D unknown until called, FlashAttention-2's 64 (a larger chunk could be
    refused only at the call). Triton's backward keeps FlashAttention-2's blocks."""
    b, h, q, x = nc.axes("b h q x")
    d = nc.Axis("d") if D is None else nc.Axis("d", D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=True)
    kernel = lower(derive(attn, tile(q, 128), stream(x, 64), verify=False), backend="mosaic", interpret=True)
    dq, dkv = kernel.kernels[2:]
    assert (dq.s, dkv.s) == chunks and all(k.rows == 64 for k in (dq, dkv))
    triton = lower(derive(attn, tile(q, 128), stream(x, 64), verify=False), backend="triton", interpret=True)
    assert [str(k) for k in triton.backends][3:] == [
        "backward kernel d(input 0) (tile(q, 128), stream(x, 64))",
        "backward kernel d(input 1), d(input 2) (tile(x, 128), stream(q, 64))",
    ]


@pytest.mark.gpu
@pytest.mark.parametrize(("D", "causal"), [(64, False), (64, True), (128, False), (128, True)])
@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_compiled_backward_matches_jax_grad(key, D, causal, dtype):
    jdt = {"bf16": jnp.bfloat16, "f16": jnp.float16}[dtype]
    Q, K, V, dO = (jax.random.normal(k, (2, 4, 1024, D), jdt) for k in jax.random.split(key, 4))
    kernel = lower(attention(D, 256, 64, dtype=dtype, causal=causal), backend="mosaic")
    assert set(kernel.backends.values()) == {"mosaic"}
    got = gradients(kernel, Q, K, V, dO)
    want = gradients(lambda *a: reference(*a, causal), Q, K, V, dO.astype(jnp.float32))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):  # N = 1024: not measured yet, so the
        assert relative_error(g, w) <= COMPILED_GRAD, name  # issue's 1e-2 until the first GPU run


# -- the warpgroup split: a relabelling the diagram shows, the cost functor prices and the lowering reads


def test_split_is_a_verified_relabelling_drawn_priced_and_lowered():
    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d), tile(q, 32), split(q, 2), stream(x, 16))  # verified
    assert str(flash.diagram.cod) == "q/32÷2×d" and str(flash.steps[2]).startswith("split(q, 2): verified")
    assert "q/32$\\div$2" in draw(flash.diagram, to_tikz=True)
    q, x, d = nc.axes("q x d", d=128)
    attn = nc.library.attention(q, x, d, dtype="bf16")
    whole, halves = (
        nc.cost(derive(attn, tile(q, 256), *w, stream(x, 64), level("REG"), verify=False).diagram, H100)
        for w in ((), (split(q, 2),))
    )
    assert halves.memory[nc.REG] < whole.memory[nc.REG] and (whole.warpgroups, halves.warpgroups) == (1, 2)
    quarters = plan(derive(attn, tile(q, 256), split(q, 4), stream(x, 64), verify=False).diagram)
    four = MosaicLowered(quarters, config=MosaicConfig(consumer_registers=112))  # 4 × 112 + 40 fit 512 per thread
    assert four.config.consumers == 4 and four.rows == 64 and "4 consumers of 64 q-rows" in four.source


def test_split_refusals_name_the_condition():
    q, x, d = nc.axes("q x d", d=64)
    attn = nc.library.attention(q, x, d, dtype="bf16")
    with pytest.raises(RewriteError, match=r"split\(x, 2\): axis 'x': x is not tiled"):
        derive(attn, tile(q, 128), split(x, 2), verify=False)
    with pytest.raises(RewriteError, match=r"split\(q, 3\): axis 'q': a tile of 128 does not split into 3"):
        derive(attn, tile(q, 128), split(q, 3), verify=False)
    halves = plan(derive(attn, tile(q, 256), split(q, 2), stream(x, 64), verify=False).diagram)
    with pytest.raises(NotLowerable, match=r"splits each tile over 2 warpgroups .* MosaicConfig\(consumers=4\)"):
        MosaicLowered(halves, config=MosaicConfig(consumers=4))


def test_sliding_window_backward_interpret_visits_only_the_band(key):
    """Any affine mask, not only causal: a 100-key band over 64-row consumers and 64-key chunks, so each consumer
    observes chunks before and after its band, runs some unmasked and some masked (forward, dQ and dK·dV), the
    observed chunks taking their ping-pong turns."""
    q, x, d = nc.axes("q x d", d=64)
    band = derive(nc.library.sliding_window_attention(q, x, d, window=100, dtype="bf16"), tile(q, 128), stream(x, 64))
    forced = MosaicConfig(pingpong=True, interpretable=True)  # the backward's turns too (off by default)
    kernel = lower(band, backend="mosaic", interpret=True, config=forced)
    assert all(k.masks and k.pingpong for k in (kernel.forward, *kernel.kernels[:1], *kernel.kernels[2:]))
    Q, K, V, dO = (jax.random.normal(k, (256, 64), jnp.bfloat16) for k in jax.random.split(key, 4))
    i, j = jnp.arange(256)[:, None], jnp.arange(256)[None, :]

    def reference(Q, K, V):
        s = jnp.einsum("qd,kd->qk", Q, K) / 8
        return jax.nn.softmax(jnp.where((j <= i) & (j > i - 100), s, -jnp.inf), axis=-1) @ V

    got = gradients(kernel, Q, K, V, dO)
    want = gradients(jax.jit(reference), *(a.astype(jnp.float32) for a in (Q, K, V, dO)))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert relative_error(g, w) <= (BF16 if name == "O" else BF16_GRAD), name


@pytest.mark.gpu
def test_compiled_sliding_window_backward_matches_jax_grad(key):
    q, x, d = nc.axes("q x d", d=128)
    band = derive(nc.library.sliding_window_attention(q, x, d, window=300, dtype="bf16"), tile(q, 256), stream(x, 64))
    kernel = lower(band, backend="mosaic")
    Q, K, V, dO = (jax.random.normal(k, (2048, 128), jnp.bfloat16) for k in jax.random.split(key, 4))
    i, j = jnp.arange(2048)[:, None], jnp.arange(2048)[None, :]

    def reference(Q, K, V):
        s = jnp.einsum("qd,kd->qk", Q, K) / 128**0.5
        return jax.nn.softmax(jnp.where((j <= i) & (j > i - 300), s, -jnp.inf), axis=-1) @ V

    got = gradients(kernel, Q, K, V, dO)
    want = gradients(reference, *(a.astype(jnp.float32) for a in (Q, K, V, dO)))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert relative_error(g, w) <= COMPILED_GRAD, name


def test_mosaic_source_matches_golden():
    """The emitted kernels, described (forward, forward with residuals, Δ, dQ, dK·dV): NAPKIN_REGEN_GOLDEN=1
    rewrites the golden file."""
    text = lower(attention(128, 256, 64, causal=True), backend="mosaic", interpret=False).source + "\n"
    path = Path(__file__).parent / "golden" / "kernels" / "mosaic_causal_mha_with_backward.txt"
    if os.environ.get("NAPKIN_REGEN_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), "the Mosaic kernels changed; NAPKIN_REGEN_GOLDEN=1 rewrites the golden file"


def causal_scores(Q, K, *, spec="bhqd,bhkd->bhqk"):
    """Scaled scores with the causal mask, written here (f32)."""
    s = jnp.einsum(spec, Q, K) / Q.shape[-1] ** 0.5
    n = Q.shape[-2]
    return jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)


def alibi_reference(Q, K, V):
    heads, n = Q.shape[1], Q.shape[2]
    slope = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)[:, None, None]
    s = causal_scores(Q, K) - slope * jnp.abs(jnp.arange(n)[:, None] - jnp.arange(n)[None, :])
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), V)


def sinks_reference(Q, K, V, sink):
    """The sink an extra logit column of every row: :func:`sink_rows_reference` with one logit per (batch, head)."""
    return sink_rows_reference(Q, K, V, jnp.broadcast_to(sink[..., None], Q.shape[:-1]))


def sink_rows_reference(Q, K, V, sink_rows):
    """A sink logit per row ``[b, h, q]``, an extra logit column of its row: its gradient is each row's term of a
    shared logit's."""
    s = causal_scores(Q, K)
    p = jax.nn.softmax(jnp.concatenate([s, sink_rows[..., None]], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bhkd->bhqd", p, V)


def gqa_reference(Q, K, V):
    s = causal_scores(Q, K, spec="hgqd,hxd->hgqx")
    return jnp.einsum("hgqx,hxd->hgqd", jax.nn.softmax(s, axis=-1), V)


def variant_case(name: str, n: int, dim: int, key, heads: int = 4):
    """A variant Mosaic lowers since v7, scheduled 128 × 128: its derivation, random inputs (bf16 blocks; a sink's
    logit f32) and the reference written here. ``heads``: ALiBi's (a slope each)."""
    if name == "alibi":
        b, q, x, d = nc.axes("b q x d", d=dim)
        made = nc.library.alibi_attention(nc.Axis("h", heads), q, x, d, causal=True, batch=(b,), dtype="bf16")
        shapes, ref = [(1, heads, n, dim)] * 3, alibi_reference
    elif name == "sinks":
        b, h, q, x, d = nc.axes("b h q x d", d=dim)
        made = nc.library.sink_attention(q, x, d, batch=(b, h), causal=True, dtype="bf16")
        shapes, ref = [(1, 2, n, dim)] * 3 + [(1, 2)], sinks_reference
    else:
        hk, g, q, x, d = nc.axes("hk g q x d", g=2, d=dim)
        made = nc.library.grouped_query_attention(hk, g, q, x, d, dtype="bf16", causal=True)
        shapes, ref = [(2, 2, n, dim), (2, n, dim), (2, n, dim)], gqa_reference
    keys = jax.random.split(key, len(shapes) + 1)
    blocks = zip(keys[:-1], shapes, strict=True)
    args = [jax.random.normal(k, sh, jnp.bfloat16 if len(sh) > 2 else jnp.float32) for k, sh in blocks]
    dO = jax.random.normal(keys[-1], shapes[0], jnp.bfloat16)
    return derive(made, tile(q, 128), stream(x, 128), verify=False), args, dO, ref


def check_variant(kernel, args, dO, ref, tol_out, tol_grad):
    """Output and gradients against ``ref``; ``tol_grad`` one tolerance, or one per input (a sink's logit's
    gradient: its own bound, below)."""
    out, pull = jax.vjp(kernel, *args)
    want, pull_ref = jax.vjp(jax.jit(ref), *(a.astype(jnp.float32) for a in args))  # compiled, not op by op
    assert relative_error(out, want) <= tol_out, "O"
    tols = tol_grad if isinstance(tol_grad, tuple) else (tol_grad,) * len(args)
    grads, wants = pull(dO), pull_ref(dO.astype(jnp.float32))
    for i, (g, w, tol) in enumerate(zip(grads, wants, tols, strict=True)):
        if ref is sinks_reference and i == 3:
            # a sink's logit's gradient sums one term per row (bf16 products), with cancellation: relative to itself
            # its error is heavy-tailed (1.2e-2 at seed 1259107066, interpreted), so it is bounded by the terms'
            # summed magnitudes, from the reference with one logit per row: measured ≤ 1.6e-3 of them over 20
            # seeds (interpreted, N = 256); a bf16 rounding is 2^-8, so 2^-7
            f32 = [a.astype(jnp.float32) for a in args]
            rows = jnp.broadcast_to(f32[3][..., None], f32[0].shape[:3])
            per_row = jax.vjp(jax.jit(sink_rows_reference), *f32[:3], rows)[1](dO.astype(jnp.float32))[3]
            assert float(jnp.max(jnp.abs(g - w) / jnp.abs(per_row).sum(-1))) <= 2**-7, "d(sink)"
        else:
            assert relative_error(g, w) <= tol, f"d(input {i})"


@pytest.mark.parametrize("name", ["alibi", "sinks", "gqa"])
def test_variants_run_on_mosaic(key, name):
    """Variants Mosaic lowers since v7, interpreted against references written here (output and every gradient, a
    sink's logit's included), and lowered for CUDA, forward and backward:

    - ALiBi's score modifier reads the head, a grid axis: the consumers get the program's batch indices
      (``BlockContext``, as Triton's kernels do);
    - a sink's logit is one number per (batch, head), a scalar each consumer reads from HBM; the backward's folded
      row values sum a block over d on registers;
    - GQA's dK·dV keeps the group axis its cotangent sums over outermost, a grid axis, so every block's innermost
      axis is the head dim, as TMA needs (kept innermost, the compiled kernel failed on the H100: 'TMA requires the
      stride of the last dimension ... to be 1, but it is 4').

    ALiBi interpreted over 2 heads (two slopes, 2^-4 and 2^-8: the head index still picks each program's slope;
    the compiled test below keeps 4): the interpreter's cost grows with the grid's programs."""
    sched, args, dO, ref = variant_case(name, 256, 64, key, heads=2)
    kernel = lower(sched, backend="mosaic", interpret=True)
    assert set(kernel.backends.values()) == {"mosaic"}
    if name == "gqa":
        assert [str(w) for w in kernel.kernels[-1].plan.diagram.cod.inside] == ["g×hk×x/128×d"] * 2
    check_variant(kernel, args, dO, ref, BF16, BF16_GRAD)
    compiled = lower(sched, backend="mosaic", interpret=False)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*args, dO)]
    backward = lambda *a: jax.vjp(compiled, *a[:-1])[1](a[-1])  # noqa: E731
    assert "mosaic_gpu" in jax.jit(backward).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["alibi", "sinks", "gqa"])
def test_variants_compiled_on_mosaic(key, name):
    """The same variants compiled on an H100 at D = 128, 1024 tokens, within the compiled bf16 tolerances."""
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    sched, args, dO, ref = variant_case(name, 1024, 128, key)
    check_variant(lower(sched, backend="mosaic"), args, dO, ref, BF16, COMPILED_GRAD)
