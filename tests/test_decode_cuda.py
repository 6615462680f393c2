"""Decoding lowered for a named GPU on this machine (``hardware=``, ``interpret=False``): the step's Triton kernels for
an abstract sm_90 device, every module through the MLIR verifier (the pattern of tests/test_cuda_lowering.py), with
no GPU here; a KV head's 256 rows (``Nq`` = 64 at GQA 4) in one program of 16 warps; and what a step launches, read
from the program lowered for CUDA: the split kernel and the merge, nothing else."""

import re
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.triton import pallas_call_registration as registration

import napkin_cat as nc
from lowering import NotLowerable
from lowering._decode import _kernel, decode_plan


@pytest.fixture
def abstract_hopper(monkeypatch):
    """An sm_90 device for Pallas' Triton lowering, and the MLIR verifier on every module it builds."""
    monkeypatch.setattr(
        registration.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability="9.0")
    )
    build, modules = registration.lowering.lower_jaxpr_to_triton_module, []

    def verified(*args, **kwargs):
        made = build(*args, **kwargs)
        made.module.operation.verify()  # raises MLIRError naming the op, as the GPU compiler would
        modules.append(str(made.module))
        return made

    monkeypatch.setattr(registration.lowering, "lower_jaxpr_to_triton_module", verified)
    return modules


@pytest.mark.parametrize(("nq", "tile", "warps"), [(1, None, 4), (64, 256, 16)])
def test_decode_lowers_for_a_named_gpu_here(abstract_hopper, nq, tile, warps):
    """``hardware="H100"`` reaches the kernel's lowering (no detected GPU is asked for); 256 rows per program lower
    with 16 warps (four warpgroups: 64 rows of the f32 accumulator each)."""
    q = jax.ShapeDtypeStruct((1, nq, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def step(q, k, v, n):
        return nc.decode_attention(q, k, v, n, interpret=False, hardware="H100", tile=tile)

    text = jax.jit(step).trace(q, kv, kv, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert len(abstract_hopper) == 2 and f"num_warps = {warps} : i32" in text  # the split kernel, the merge


def test_decode_lowers_on_mosaic_for_a_named_gpu_here(abstract_hopper):
    """``backend="mosaic"`` at ``Nq`` = 64 (256 rows of a KV head, tiles of 128 over two consumer warpgroups) lowers
    for CUDA: its valid keys read as one limit per row (``KeyLimit``), which Mosaic GPU's layout inference takes,
    where ``KeyLength``'s per-program length and row offsets it refused (docs/decode.md)."""
    q = jax.ShapeDtypeStruct((1, 64, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def step(q, k, v, n):
        return nc.decode_attention(q, k, v, n, interpret=False, hardware="H100", backend="mosaic")

    text = jax.jit(step).trace(q, kv, kv, lengths).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and len(abstract_hopper) == 1  # the split kernel on Mosaic, the merge on Triton


def launches(text: str) -> list[str]:
    """The ops of a program lowered for CUDA (StableHLO) that launch a kernel or move data: the Pallas kernels (custom
    calls) and any other op on arrays but a reshape, a constant, a pad of nothing or a transpose moving only axes of
    size 1 (views XLA folds). An over-count of XLA's launches (it fuses several ops into one), never an under-count.

    >>> launches("%1 = stablehlo.transpose %0, dims = [0, 2, 1] : (tensor<4x1x8xf32>) -> tensor<4x8x1xf32>")
    []
    >>> launches("%1 = stablehlo.transpose %0, dims = [1, 0] : (tensor<4x8xf32>) -> tensor<8x4xf32>")
    ['transpose']
    """
    out = []
    for line in text.splitlines():
        m = re.search(r"= (?:stablehlo|chlo)\.(\w+)", line)
        if m is None:
            continue
        op, result = m.group(1), line.rsplit("->", 1)[-1] if "->" in line else line.rsplit(":", 1)[-1]
        if op in ("constant", "reshape") or not re.search(r"tensor<\d", result):
            continue  # a view, a constant or a scalar (folded)
        if op == "pad" and not re.search(r"(low|high|interior) = \[[^\]]*[1-9]", line):
            continue
        if op == "transpose":
            perm = [int(v) for v in re.search(r"dims = \[([^\]]*)\]", line).group(1).split(",")]
            shape = [int(v) for v in re.search(r"tensor<([\dx]+)x[a-z]", line).group(1).split("x")]
            moved = [a for a in perm if shape[a] > 1]
            if moved == sorted(moved):
                continue
        out.append(op)
    return out


@pytest.mark.parametrize(("nq", "paged", "want"), [(1, False, []), (1, True, []), (5, False, ["transpose"])])
def test_a_step_launches_the_kernel_and_the_merge_only(abstract_hopper, nq, paged, want):
    """No padding of the queries (the kernel reads its last row tile masked), no positions (the kernel makes them),
    no cast (the merge writes the caller's dtype), no per-part copy of the queries or lengths for a paged cache; for
    ``Nq > 1`` new tokens of grouped heads the queries' rows are a transpose. With the residual, nothing more. (A
    cache whose parts are not whole chunks of 64 keys is padded: a copy, left out here.)"""
    kv_heads, keys, page = 2, 4096, 64
    q = jax.ShapeDtypeStruct((2, nq, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2 * keys // page, page, kv_heads, 128) if paged else (2, keys, kv_heads, 128), q.dtype)
    table = jax.ShapeDtypeStruct((2, keys // page), jnp.int32) if paged else None
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

    def step(q, k, v, n, t):
        return nc.decode_attention(q, k, v, n, page_table=t, interpret=False, hardware="H100", return_residual=True)

    text = jax.jit(step).trace(q, kv, kv, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    ops = launches(text)
    assert ops.count("custom_call") == 2 and [o for o in ops if o != "custom_call"] == want, ops


@pytest.mark.parametrize(
    ("nq", "kv_heads", "paged", "want"),
    [(1, 2, False, []), (1, 2, True, []), (5, 1, False, []), (5, 2, False, ["transpose"] * 3)],
)
def test_a_step_in_one_part_launches_the_kernel_only(abstract_hopper, nq, kv_heads, paged, want):
    """In one part the kernel writes the step's output in the caller's dtype and its log-sum-exp: no merge, no cast, no
    pad. Only where a KV head's rows are strided in the caller's layout (``Nq > 1`` tokens of grouped heads over more
    than one KV head) are the queries' rows, the output and its log-sum-exp transposed (``pack_rows``)."""
    keys, page = 4096, 64
    q = jax.ShapeDtypeStruct((2, nq, 4 * kv_heads, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2 * keys // page, page, kv_heads, 128) if paged else (2, keys, kv_heads, 128), q.dtype)
    table = jax.ShapeDtypeStruct((2, keys // page), jnp.int32) if paged else None
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)

    def step(q, k, v, n, t):
        return nc.decode_attention(q, k, v, n, page_table=t, parts=1, interpret=False, hardware="H100",
                                   return_residual=True)  # fmt: skip

    text = jax.jit(step).trace(q, kv, kv, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    ops = launches(text)
    assert ops.count("custom_call") == 1 and [o for o in ops if o != "custom_call"] == want, ops
    assert len(abstract_hopper) == 1  # the kernel's module; no merge's


@pytest.mark.parametrize("paged", [False, True])
def test_mosaic_in_one_part_lowers_and_launches_the_kernel_only(abstract_hopper, paged):
    """On Mosaic in one part (``Nq`` = 64 at GQA 2 over one KV head: its rows a reshape) the kernel writes the bf16
    output and its log-sum-exp and lowers for CUDA; beside it run only the rows' limits and the chunks each tile
    visits (found from them), no merge."""
    q = jax.ShapeDtypeStruct((1, 64, 2, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((64, 64, 1, 128) if paged else (1, 4096, 1, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 64), jnp.int32) if paged else None
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def step(q, k, v, n, t):
        return nc.decode_attention(q, k, v, n, page_table=t, parts=1, interpret=False, hardware="H100",
                                   backend="mosaic", return_residual=True)  # fmt: skip

    text = jax.jit(step).trace(q, kv, kv, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and not abstract_hopper  # the kernel on Mosaic; no Triton merge
    assert "transpose" not in launches(text) and launches(text).count("custom_call") == 1, launches(text)


@pytest.mark.parametrize("paged", [False, True])
def test_a_crowded_step_lowers_in_128_key_chunks(abstract_hopper, paged):
    """A crowded grid (3 sequences × 2 KV heads on a GPU of 2 SMs, each cache in one part) streams 128 keys at
    D = 128 in 16 bits: for a paged cache two pages of 64, each key's page gathered (``PageMap.load``); the Triton
    module passes the MLIR verifier, and the step, in one part, launches the kernel only."""
    from dataclasses import replace

    from napkin_cat.hardware import H100

    small = replace(H100, sms=2)
    q = jax.ShapeDtypeStruct((3, 1, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((9, 64, 2, 128) if paged else (3, 256, 2, 128), q.dtype)
    table = jax.ShapeDtypeStruct((3, 4), jnp.int32) if paged else None
    lengths = jax.ShapeDtypeStruct((3,), jnp.int32)

    def step(q, k, v, n, t):
        return nc.decode_attention(q, k, v, n, page_table=t, interpret=False, hardware=small)

    text = jax.jit(step).trace(q, kv, kv, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    ops = launches(text)
    assert ops == ["custom_call"] and len(abstract_hopper) == 1, ops
    z, pool = jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype)
    pages = jnp.arange(12, dtype=jnp.int32).reshape(3, 4) % 9 if paged else None
    plan = decode_plan(z, pool, pool, jnp.full((3,), 256), page_table=pages, interpret=False, hardware=small)
    assert (plan.summary()["parts"], plan.summary()["chunk"]) == (1, 128), plan.summary()


def test_the_named_hardware_plans_and_lowers_the_kernel():
    q, kv = jnp.zeros((1, 1, 8, 16)), jnp.zeros((1, 256, 2, 16))
    plan = decode_plan(q, kv, kv, jnp.array([256]), hardware="A100")
    assert plan.hardware.name == "A100" and _kernel(plan).forward.hardware.name == "A100"
    with pytest.raises(NotLowerable, match="hardware='B300': unknown hardware 'B300'"):
        decode_plan(q, kv, kv, jnp.array([256]), hardware="B300")


def test_mosaic_makes_its_positions_and_streams_128_keys(abstract_hopper):
    """On Mosaic at ``Nq`` = 64 (256 rows of a KV head) a step streams 128-key chunks (its shared memory holds them: the
    keys' positions are made in the kernel, never copied in, and Mosaic GPU's reduction scratch takes what is left)
    and passes no positions array: the Mosaic call takes q, k, v, the rows' limits and the chunks each tile visits
    (found from the limits)."""
    q = jax.ShapeDtypeStruct((1, 64, 32, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    args = (jnp.zeros(q.shape, q.dtype), jnp.zeros(kv.shape, kv.dtype), jnp.zeros(kv.shape, kv.dtype), jnp.array([99]))
    plan = decode_plan(*args, interpret=False, hardware="H200", backend="mosaic")
    forward = _kernel(plan).forward
    assert plan.summary()["chunk"] == 128 and forward.made == {3}  # the positions: made, never copied in
    assert forward.reduction_scratch({"d": 128}) < 2048  # what the 128-key chunks leave of the 232,448 B

    def step(q, k, v, n):
        return nc.decode_attention(q, k, v, n, interpret=False, hardware="H200", backend="mosaic")

    text = jax.jit(step).trace(q, kv, kv, lengths).lower(lowering_platforms=("cuda",)).as_text()
    (operands,) = re.findall(r"custom_call @mosaic_gpu\w*\(([^)]*)\)", text)
    assert len(operands.split(",")) == 5, operands  # q, k, v, the rows' limits and each tile's chunks: no positions


@pytest.mark.parametrize("page", [64, 128])
def test_paged_decode_lowers_on_mosaic_for_a_named_gpu_here(abstract_hopper, page):
    """A paged cache on Mosaic (``Nq`` = 64, 128-key chunks) lowers for CUDA: each chunk one TMA copy per page of 64
    (two, arriving on one barrier) or a page of 128 whole, the page ids read from the table in the producer."""
    q = jax.ShapeDtypeStruct((1, 64, 32, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((100, page, 8, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((1, 4096 // page), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)

    def step(q, k, v, n, t):
        return nc.decode_attention(q, k, v, n, page_table=t, interpret=False, hardware="H100", backend="mosaic")

    text = jax.jit(step).trace(q, pool, pool, lengths, table).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and len(abstract_hopper) == 1  # the split kernel on Mosaic, the merge on Triton
