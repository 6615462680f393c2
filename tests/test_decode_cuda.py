"""Decoding lowered for a named GPU on this machine (``hardware=``, ``interpret=False``): the step's Triton kernel for
an abstract sm_90 device, every module through the MLIR verifier (the pattern of tests/test_cuda_lowering.py), with
no GPU here; and a KV head's 256 rows (``Nq`` = 64 at GQA 4) in one program of 16 warps."""

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
    assert len(abstract_hopper) == 1 and f"num_warps = {warps} : i32" in text


def test_the_named_hardware_plans_and_lowers_the_kernel():
    q, kv = jnp.zeros((1, 1, 8, 16)), jnp.zeros((1, 256, 2, 16))
    plan = decode_plan(q, kv, kv, jnp.array([256]), hardware="A100")
    assert plan.hardware.name == "A100" and _kernel(plan).forward.hardware.name == "A100"
    with pytest.raises(NotLowerable, match="hardware='B300': unknown hardware 'B300'"):
        decode_plan(q, kv, kv, jnp.array([256]), hardware="B300")
