"""The wide head dims on Mosaic: D = 256 and MLA prefill's 192 (q, k) with 128 (v) get blocks of their own that
pass the checks and lower to Mosaic GPU for sm_90 on CPU (forward and every backward kernel), compute attention and
its gradients in interpret mode, and ``backend="auto"`` says why wherever it keeps a kernel of a head dim from 32
to 256 off Mosaic."""

import functools

import jax
import jax.numpy as jnp
import pytest

import napkin_cat as nc
from lowering import MosaicConfig, MosaicLowered, NotLowerable, lower, plan
from lowering._api import _chunks
from lowering._backward import backward_of
from rewrites import derive, stream, tile

WIDE = [(256, 256), (192, 128)]


def scheduled(dim, value_dim, causal, g=128, s=64):
    """Multi-head attention [b, h, q, d] at head dims ``dim`` (q, k) and ``value_dim`` (v), tiled as the entry's
    Mosaic blocks on an sm_90 GPU (``lowering.mosaic.MOSAIC_BLOCKS.entry``)."""
    b, h, q, x, d = nc.axes("b h q x d", d=dim)
    wide = {} if value_dim == dim else {"value_dim": nc.Axis("dv", value_dim)}
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=causal, **wide)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def backward_kernels(made, interpret):
    """The Mosaic kernels of the backward ``lower(backend="mosaic")`` builds for ``made``: Δ, dQ, then dK·dV's."""
    d = made.diagram
    pieces = backward_of(d, **_chunks(d, "mosaic", interpret, None)).pieces
    return [MosaicLowered(plan(p.scheduled), interpret=interpret) for p in pieces]


@functools.partial(jax.jit, static_argnames="causal")
def reference(Q, K, V, causal):
    """Attention in f32 with jax.numpy alone: [b, h, n, d] arrays, scale d^-1/2 of q's head dim."""
    Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
    s = jnp.einsum("bhqd,bhkd->bhqk", Q, K) / Q.shape[-1] ** 0.5
    if causal:
        n = Q.shape[2]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), V)


def relative_error(out, ref):
    return float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))


#: bf16 operands and outputs against the f32 reference, measured at these sizes (interpret mode, 2 seeds per case):
#: O 1.9e-3 .. 2.2e-3, gradients 2.4e-3 .. 2.8e-3; about twice that (test_mosaic.py's bounds)
TOLERANCE = {"O": 5e-3, "dQ": 6e-3, "dK": 6e-3, "dV": 6e-3}


@pytest.mark.parametrize(("dim", "value_dim"), WIDE, ids=["256", "192-128"])
def test_wide_head_dims_take_blocks_that_fit(dim, value_dim):
    """The forward: 128 queries over two consumers streaming 64 keys (two stages hold no more at D = 256). The
    backward: dQ at 64 queries on one consumer where 128 would overflow shared memory (D = 256); at D = 256 dK and
    dV in a kernel each, since no consumer holds both 64 × 256 f32 accumulators; MLA's dK·dV in one."""
    made = scheduled(dim, value_dim, causal=False)
    forward = MosaicLowered(plan(made.diagram), interpret=False)
    assert (forward.rows, forward.config.consumers, forward.s) == (64, 2, 64)
    blocks = [(k.q, k.plan.tiles[k.q], k.s, k.config.consumers) for k in backward_kernels(made, interpret=False)]
    if dim == 256:
        assert blocks == [("q", 128, None, 2), ("q", 64, 64, 1), ("x", 64, 64, 1), ("x", 128, 64, 2)]
    else:
        assert blocks == [("q", 128, None, 2), ("q", 128, 64, 2), ("x", 128, 64, 2)]


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize(("dim", "value_dim"), WIDE, ids=["256", "192-128"])
def test_every_kernel_lowers_for_sm90(dim, value_dim, causal):
    """Compiled path (register A operands, in-place accumulation): Mosaic GPU lowers the forward and each
    backward kernel for CUDA, and every kernel passes the shared-memory and register checks."""
    made = scheduled(dim, value_dim, causal)
    for k in (MosaicLowered(plan(made.diagram), interpret=False), *backward_kernels(made, interpret=False)):
        k.guard()
        assert k.lowering_error() is None, k.source


def check_against_reference(key, dim, value_dim, causal, shape, tolerance, interpret):
    """Output and gradients of ``lower(backend="mosaic")`` at [b, h, n] = ``shape`` against the f32 reference,
    every kernel on Mosaic."""
    kq, kk, kv, ko = jax.random.split(key, 4)
    Q, K = (jax.random.normal(k, (*shape, dim), jnp.bfloat16) for k in (kq, kk))
    V, dO = (jax.random.normal(k, (*shape, value_dim), jnp.bfloat16) for k in (kv, ko))
    kernel = lower(scheduled(dim, value_dim, causal), backend="mosaic", interpret=interpret)
    assert kernel.differentiation == "lowered"
    out, pull = jax.vjp(kernel, Q, K, V)
    got = (out, *pull(dO))
    assert set(kernel.backends.values()) == {"mosaic"}, kernel.backends
    want_out, want_pull = jax.vjp(lambda *a: reference(*a, causal), Q, K, V)
    want = (want_out, *want_pull(dO.astype(jnp.float32)))
    for name, g, w in zip(("O", "dQ", "dK", "dV"), got, want, strict=True):
        assert relative_error(g, w) <= tolerance[name], name


@pytest.mark.parametrize(("dim", "value_dim"), WIDE, ids=["256", "192-128"])
def test_interpret_matches_reference(key, dim, value_dim):
    """Interpreted, causal: the mask needs two tiles each way (a diagonal and one below it), so each kernel runs
    chunks unmasked and masked at the wide blocks. The kernels without a mask (plain) run compiled below
    (``gpu``), and interpreted at D = 64 (tests/test_mosaic.py)."""
    check_against_reference(key, dim, value_dim, True, (1, 1, 256), TOLERANCE, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize(("dim", "value_dim"), WIDE, ids=["256", "192-128"])
def test_compiled_matches_reference(key, dim, value_dim, causal):
    """Compiled on an sm_90 GPU, plain and causal, 1024 tokens over 2 × 2 (batch, heads), within
    tests/test_mosaic.py's compiled bounds (bf16, 1e-2 for the gradients until measured on a GPU)."""
    if getattr(jax.devices()[0], "compute_capability", None) != "9.0":
        pytest.skip("needs an sm_90 (Hopper) GPU")
    compiled = {"O": 5e-3, "dQ": 1e-2, "dK": 1e-2, "dV": 1e-2}
    check_against_reference(key, dim, value_dim, causal, (2, 2, 1024), compiled, interpret=False)


@pytest.mark.parametrize("registers", [120, 160])
def test_dk_and_dv_part_where_no_consumer_holds_both_else_the_refusal_is_named(registers):
    """MLA with fewer registers per consumer thread: at 160 dK·dV (192 live) parts into a dK kernel and a dV kernel
    (128 and 96); at 120 dQ (128 live, at any tile) is refused, by kernel and numbers, while the forward (96) fits."""
    config = MosaicConfig(consumer_registers=registers)
    kernel = lower(scheduled(192, 128, False), backend="mosaic", interpret=False, config=config)
    if registers == 160:
        assert kernel.differentiation == "lowered" and [k for k in kernel.backends if "d(input" in k] == [
            "backward kernel d(input 0) (tile(q, 128), stream(x, 64))",
            "backward kernel d(input 1) (tile(x, 128), stream(q, 64))",
            "backward kernel d(input 2) (tile(x, 128), stream(q, 64))",
        ]
        return
    assert kernel.differentiation == "none"
    assert kernel.why_not == (
        "no lowered backward: Mosaic, backward kernel d(input 0) (tile(q, 128), stream(x, 64)): warpgroup level: a "
        "consumer thread would keep 128 f32 registers live (its accumulators and the largest chunk of 64 q-rows × 64 "
        "x), over its 120"
    )
    Q = jax.ShapeDtypeStruct((1, 1, 256, 192), jnp.bfloat16)
    V = jax.ShapeDtypeStruct((1, 1, 256, 128), jnp.bfloat16)
    with pytest.raises(NotLowerable, match=r"no lowered backward: Mosaic, backward kernel d\(input 0\)"):
        jax.jit(jax.grad(lambda Q, V: kernel(Q, Q, V).astype(jnp.float32).sum())).trace(Q, V)


@pytest.mark.parametrize(("dims", "kernels"), [((256, 256), 6), ((192, 128), 5)], ids=["256", "192-128"])
def test_auto_takes_mosaic_at_the_measured_wide_head_dims(hopper, dims, kernels):
    """D = 256 and MLA's 192/128 were measured faster on Mosaic's own wide blocks, every kernel
    (lowering.mosaic.MosaicBlocks' ``faster_wide``): ``auto`` takes Mosaic for all of them (at D = 256 dK and dV
    in a kernel each), refusing none."""
    q, v = jnp.zeros((1, 256, 2, dims[0]), jnp.bfloat16), jnp.zeros((1, 256, 2, dims[1]), jnp.bfloat16)
    hopper()
    kernel = nc.attention.kernel_for(q, q, v, is_causal=True, interpret=False).kernel
    assert set(kernel.backends.values()) == {"mosaic"} and len(kernel.backends) == kernels, kernel.backends
    assert kernel.refused == {}


@pytest.mark.parametrize("dims", [(32, 32), (160, 128)], ids=["32", "160-128"])
def test_auto_says_why_a_kernel_is_off_mosaic(hopper, dims):
    """On sm_90, each of ``nc.attention``'s kernels runs on Mosaic or ``kernel.refused`` says why not (no head dim
    from 32 to 256 off Mosaic silently)."""
    dim, value_dim = dims
    q, v = jnp.zeros((1, 256, 2, dim), jnp.bfloat16), jnp.zeros((1, 256, 2, value_dim), jnp.bfloat16)
    hopper()
    kernel = nc.attention.kernel_for(q, q, v, is_causal=True, interpret=False).kernel
    backends, refused = kernel.backends, kernel.refused
    assert len(backends) == 5  # the forward, with residuals, Δ, dQ, dK·dV
    off = [k for k, b in backends.items() if b != "mosaic"]
    assert off and all(refused.get(k) for k in off), (backends, refused)
    if dim != 32:
        assert f"whole axis d = {dim}" in refused["forward"]
