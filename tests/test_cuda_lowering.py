"""Every attention variant's kernels, forward and backward, lower to Triton for CUDA and verify, on CPU.

Interpret mode runs the kernel body through XLA, which accepts what Triton's MLIR verifier refuses (a select
whose operands' types differ, a comparison of i1 with i32); such a kernel passes every CPU test and fails to
compile on the GPU (prefix-LM did, on an H100). So each variant is lowered here for an abstract sm_90 device —
Pallas' Triton lowering asks the device only for its compute capability — and every Triton module it builds is
run through the MLIR verifier, as the GPU compiler does first.
"""

import types

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration

import napkin_cat as nc
from lowering import attention, lower
from napkin_cat.axes import Axis
from napkin_cat.hardware import H100
from rewrites import derive, stream, tile

B, H, N, D = 1, 2, 512, 64
b, h, q, x, d = nc.axes("b h q x d")
lib = nc.library
VARIANTS = {
    "causal": lambda: lib.attention(q, x, d, causal=True, batch=(b, h), dtype="bf16"),
    "window": lambda: lib.sliding_window_attention(q, x, d, window=N // 8, batch=(b, h), dtype="bf16"),
    "prefix_lm": lambda: lib.prefix_lm_attention(q, x, d, prefix=N // 4, batch=(b, h), dtype="bf16"),
    "document": lambda: lib.dot_product_attention(q, x, d, segment_batch=(b,), causal=True, batch=(b, h), dtype="bf16"),
    "softcap": lambda: lib.softcap_attention(q, x, d, cap=50.0, causal=True, batch=(b, h), dtype="bf16"),
    "alibi": lambda: lib.alibi_attention(Axis("h", H), q, x, d, causal=True, batch=(b,), dtype="bf16"),
    "learned_bias": lambda: lib.dot_product_attention(
        q, x, d, bias_batch=(h,), causal=True, batch=(b, h), dtype="bf16"
    ),
    "sinks": lambda: lib.sink_attention(q, x, d, causal=True, batch=(b, h), dtype="bf16"),
    "sigmoid": lambda: lib.sigmoid_attention(q, x, d, causal=True, batch=(b, h), dtype="bf16"),
    # a block map with holes (strides of 64 keys on, 192 off): the kernels read per-tile chunk lists
    "strided_lambda": lambda: lib.attention(
        q, x, d, mask=lambda q, x: (q >= x) & ((q - x) % 256 < 64), batch=(b, h), dtype="bf16"
    ),
    "rope": lambda: lib.dot_product_attention(q, x, d, causal=True, batch=(b, h), dtype="bf16", rope=nc.Rope()),
    "rope_pairs_partial": lambda: lib.dot_product_attention(
        q, x, d, causal=True, batch=(b, h), dtype="bf16", rope=nc.Rope(rotary_dim=D // 2, interleaved=True)
    ),
}


@pytest.fixture
def abstract_hopper(monkeypatch):
    """An sm_90 device for Pallas' Triton lowering, and the MLIR verifier on every module it builds."""
    monkeypatch.setattr(
        registration.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability="9.0")
    )
    build = registration.lowering.lower_jaxpr_to_triton_module

    def verified(*args, **kwargs):
        made = build(*args, **kwargs)
        made.module.operation.verify()  # raises MLIRError naming the op, as the GPU compiler would
        return made

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verified)


def abstract(w, sizes):
    return jax.ShapeDtypeStruct(tuple(sizes.get(a.name, D) for a in w.axes), w.dtype.jnp)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_forward_and_backward_lower_for_cuda(abstract_hopper, name):
    diagram = VARIANTS[name]()
    kernel = lower(derive(diagram, tile(q, 128), stream(x, 64), verify=False), interpret=False, hardware=H100)
    args = [abstract(w, {"b": B, "h": H, "q": N, "x": N}) for w in diagram.dom.inside]
    floats = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def loss(*a):
        return kernel(*a).astype(jnp.float32).sum()

    jax.jit(kernel).trace(*args).lower(lowering_platforms=("cuda",))
    jax.jit(jax.grad(loss, argnums=floats)).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(("dtype", "native"), [("bf16", True), ("f32", False)])
def test_soft_cap_tanh_is_the_hardware_instruction_in_16_bit_kernels(abstract_hopper, monkeypatch, dtype, native):
    """A compiled bf16 kernel computes the soft-cap's ``jnp.tanh`` (forward, and its derivative in the backward)
    with ``tanh.approx.f32``, libdevice's ``__nv_tanhf`` nowhere; an f32 kernel keeps libdevice's."""
    modules = []
    build = registration.lowering.lower_jaxpr_to_triton_module

    def kept(*args, **kwargs):
        made = build(*args, **kwargs)
        modules.append(str(made.module))
        return made

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", kept)
    diagram = lib.softcap_attention(q, x, d, cap=50.0, causal=True, batch=(b, h), dtype=dtype)
    kernel = lower(derive(diagram, tile(q, 64), stream(x, 32), verify=False), interpret=False, hardware=H100)
    args = [abstract(w, {"b": B, "h": H, "q": N, "x": N}) for w in diagram.dom.inside]
    jax.jit(jax.grad(lambda *a: kernel(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))).trace(*args).lower(
        lowering_platforms=("cuda",)
    )
    hardware = [m for m in modules if "tanh.approx.f32" in m]
    libdevice = [m for m in modules if "__nv_tanhf" in m]
    assert (len(hardware), len(libdevice)) == ((3, 0) if native else (0, 3))  # the forward, dQ and dK·dV kernels


@pytest.mark.parametrize(("nq", "chunk"), [(1, None), (64, None), (1, 128)])  # one page a chunk, or two gathered
def test_paged_decode_lowers_for_cuda(abstract_hopper, monkeypatch, nq, chunk):
    """The paged decode kernel (pages gathered as it streams, the length mask read per program) lowers for sm_90:
    jnp's floor division and remainder of the chunk's start once lowered to a select Triton's lowering mistyped
    (i1 against i32), which interpret mode accepts."""
    import lowering.triton._lowered as triton_lowered

    monkeypatch.setattr(triton_lowered, "target_hardware", lambda interpret: H100)
    pages, page, kv_heads = 16, 64, 2
    args = (
        jax.ShapeDtypeStruct((1, nq, 8, 128), jnp.bfloat16),
        *(jax.ShapeDtypeStruct((pages, page, kv_heads, 128), jnp.bfloat16),) * 2,
        jax.ShapeDtypeStruct((1,), jnp.int32),
        jax.ShapeDtypeStruct((1, pages), jnp.int32),
    )

    def paged(q, k, v, lengths, table):
        return nc.decode_attention(q, k, v, lengths, page_table=table, interpret=False, hardware=H100, chunk=chunk)

    jax.jit(paged).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.fixture
def entry_on_an_h200(abstract_hopper, monkeypatch):
    """``nc.attention``'s entry as on an H200: an sm_90 GPU available to ``auto`` and the lowering's target; its cache
    of kernels cleared before and after (they were built for this stand-in)."""
    import lowering._attention as entry
    import lowering._registry as registry
    from napkin_cat.hardware import H200

    for module in (entry, registry):
        monkeypatch.setattr(module, "unavailable", lambda interpret=None, config=None: None)  # an sm_90 GPU here
    for module in ("lowering._attention", "lowering._api", "lowering.triton._lowered"):
        monkeypatch.setattr(f"{module}.target_hardware", lambda interpret=False: H200)
    entry.attention.cache_clear()
    yield
    entry.attention.cache_clear()


@pytest.mark.parametrize("d", [64, 128])
def test_the_entry_on_a_hopper_takes_mosaic_for_every_kernel(entry_on_an_h200, d):
    """What tests/test_attention_entry.py's GPU test asserts of the entry's backends, checked here on a stand-in
    H200: every kernel on Mosaic; the backward is Δ and one kernel at D = 64 (dQ fused into dK·dV), else Δ, dQ and
    dK·dV. The GPU test had kept the three kernels after D = 64's fusion landed, and only a GPU run showed it."""
    q = jax.ShapeDtypeStruct((2, 1024, 4, d), jnp.bfloat16)
    backends = attention.kernel_for(q, q, q, is_causal=True).kernel.backends
    backward = [r for r in backends if r.startswith("backward kernel")]
    assert set(backends.values()) == {"mosaic"} and len(backward) == (2 if d == 64 else 3), backends


def test_f32_attention_at_a_padded_head_dim_lowers_under_auto_on_a_hopper(entry_on_an_h200):
    """f32 at head dim 192 (padded to 256 for Triton) on an sm_90 GPU under ``auto``: Mosaic's wide blocks (64 × 64)
    were fitted for a kernel wgmma cannot multiply, and Triton, which runs f32, was handed them: 458,752 B of
    shared memory, refused on an H200. Now f32 takes Triton's rule, forward and backward."""
    q = jax.ShapeDtypeStruct((2, 100, 2, 192), jnp.float32)
    k = jax.ShapeDtypeStruct((2, 131, 2, 192), jnp.float32)

    def loss(q, k, v):
        return nc.attention(
            q,
            k,
            v,
            score_mod=lambda score, q_idx, kv_idx: score - 0.25 * abs(q_idx - kv_idx),
            scale=0.1,
            interpret=False,
        ).sum()

    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize(("heads", "dim", "fused"), [((4, 4), 64, True), ((4, 2), 64, True), ((4, 4), 128, False)])
def test_the_entry_fuses_dq_where_measured_faster(entry_on_an_h200, heads, dim, fused):
    """On an sm_90 GPU ``nc.attention``'s backward at D = 64 fuses dQ into the dK·dV kernel (measured faster there:
    ``MOSAIC_BLOCKS.fused_dq_dims``), grouped-query heads too; at D = 128 it keeps two kernels; a score_mod keeps
    two kernels (the variants are not measured fused). Its jitted gradient lowers for CUDA."""
    from lowering._attention import Signature

    q = jax.ShapeDtypeStruct((2, 512, heads[0], dim), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 512, heads[1], dim), jnp.bfloat16)
    assert Signature.of(q, k, k, is_causal=True).backward == ("fused" if fused else "lowered")
    assert Signature.of(q, k, k, score_mod=lambda s, q_idx, kv_idx: s - 0.1 * (q_idx - kv_idx)).backward == "lowered"

    def loss(q, k, v):
        return nc.attention(q, k, v, is_causal=True, interpret=False).astype(jnp.float32).sum()

    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=("cuda",)).as_text()
    assert ("output_operand_alias" in text) == fused  # dQ's zeroed f32 buffer, added into by TMA reduce-add
