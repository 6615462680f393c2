"""Past one GPU: device-level relabellings (rewrites.shard/ring/zigzag), their lowering (lowering.lower_devices)
and the mesh cost (nc.mesh_cost), on CPU.

Kernels on 4 devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax starts, and
conftest starts jax with one device: ``test_on_four_cpu_devices`` reruns this file's ``test_four_*`` tests in a
subprocess with the flag (where they run and that test skips). Everything else runs in-process.

Tolerances: rel_err against tests/references.py (jax.numpy, no napkin_cat code), f32 interpret mode,
forward and every gradient measured ≤ 2e-6 over these cases; TOL = 1e-5.
"""

from __future__ import annotations

import functools
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh

import napkin_cat as nc
import tests.references as R
from lowering import NotLowerable, lower_devices
from napkin_cat.errors import CostError
from napkin_cat.hardware import H200_X2, NVLINK4, System
from rewrites import RewriteError, derive, derive_devices, ring, shard, stream, tile, zigzag
from rewrites._verify import FAST_COMPILE
from tests.four_devices import run_own_file_unless_in_session

TOL = 1e-5
FOUR = jax.device_count() >= 4
ROOT = pathlib.Path(__file__).resolve().parents[1]
on_four = pytest.mark.skipif(not FOUR, reason="runs in test_on_four_cpu_devices' subprocess")


def flash(causal=False, batch=(), dtype="f32"):
    q, x, d = nc.axes("q x d")
    attn = (
        nc.library.multi_head_attention(batch[0], q, x, d, causal=causal, dtype=dtype)
        if batch
        else nc.library.attention(q, x, d, causal=causal, dtype=dtype)
    )
    return derive(attn, tile(q, 16), stream(x, 16), verify=False)


# --- in-process: rules, verification, cost, bad meshes --------------------------------------------------


@pytest.mark.parametrize(
    "causal, rules",
    [
        (False, lambda: [ring("q", "x", "sp", 4)]),
        (True, lambda: [ring("q", "x", "sp", 4), zigzag()]),
        (True, lambda: [ring("q", "x", "sp", 3, exchange="all_gather")]),
    ],
)
def test_device_rules_verified_against_independent_reference(seed, causal, rules):
    """Each step passes derive_devices' check; the partitioned semantics also matches tests/references.py."""
    from rewrites import execute_devices

    done = derive_devices(flash(causal), *rules(), seed=seed)
    assert all(s.verification.passed for s in done.steps[1:])
    n = 37 + seed % 20  # ragged: not a multiple of devices × chunks
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, n, 8))
    got = jax.jit(execute_devices(done.sharded), compiler_options=FAST_COMPILE)(Q, K, V)
    assert R.rel_err(got, R.attention(Q, K, V, causal=causal)) <= TOL


@settings(max_examples=5, deadline=None)
@given(
    n=st.integers(1, 40),
    devices=st.integers(1, 4),
    causal=st.booleans(),
    balanced=st.booleans(),
    gather=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_partitioned_semantics_at_any_size(n, devices, causal, balanced, gather, seed):
    """Any length, even shorter than the chunks (empty and padding-only chunks), any device count."""
    from rewrites import execute_devices

    rules = [ring("q", "x", "sp", devices, exchange="all_gather" if gather else "ppermute")]
    rules += [zigzag()] if causal and balanced else []
    done = derive_devices(flash(causal), *rules, verify=False)
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, n, 4))
    # each side compiled whole (op by op, each of its ~200 small ops compiled again at each drawn size)
    got = jax.jit(execute_devices(done.sharded), compiler_options=FAST_COMPILE)(Q, K, V)
    want = jax.jit(functools.partial(R.attention, causal=causal))(Q, K, V)
    assert R.rel_err(got, want) <= TOL, f"seed {seed}"


def test_verification_catches_a_wrong_pair_kind(seed, monkeypatch):
    """A partition that visits a pair past the causal diagonal is refused by the check, naming the rule."""
    import rewrites._device as device

    monkeypatch.setattr(device, "kind", lambda seq, is_causal, qc, kc: "full")
    with pytest.raises(RewriteError, match=r"^ring\(q, x, sp, 2\): the partitioned diagram differs from the original"):
        derive_devices(flash(causal=True), ring("q", "x", "sp", 2), seed=seed)


def test_shard_batch_verified(seed):
    b = nc.Axis("b")
    done = derive_devices(flash(batch=(b,)), shard("b", "dp", 2), seed=seed)
    assert done.steps[-1].verification.passed and done.sharded.mesh == {"dp": 2}


def test_side_conditions_name_rule_box_and_axis():
    with pytest.raises(RewriteError) as e:
        shard("q", "sp", 2)(flash(causal=True))
    assert str(e.value) == (
        "shard(q, sp, 2): box 'mask causal(q ≥ x)', axis 'q': the box reads the global index of q, which one "
        "device's group does not know; split the sequence with ring(q, x, ...)"
    )
    with pytest.raises(RewriteError, match=r"^shard\(d, sp, 2\): box 'softmax·contract x', axis 'd': the box reads "
                       r"box 'q d, x d → q x'\'s sum over d, of which each device would hold only a part"):
        shard("d", "sp", 2)(flash())
    q, x, d = nc.axes("q x d")
    with pytest.raises(RewriteError, match=r"^ring\(q, x, sp, 2\): axis 'x': the per-device schedule does not stream"):
        ring("q", "x", "sp", 2)(nc.library.attention(q, x, d))
    with pytest.raises(RewriteError, match=r"^ring\(q, x, sp, 2\): the sequence is already split"):
        ring("q", "x", "sp", 2)(ring("q", "x", "sp", 2)(flash()))
    with pytest.raises(RewriteError, match=r"^zigzag: the diagram has no causal mask between q and x"):
        zigzag()(ring("q", "x", "sp", 2)(flash()))
    with pytest.raises(RewriteError, match=r"^zigzag: no sequence partition to balance"):
        zigzag()(flash(causal=True))
    with pytest.raises(RewriteError, match=r"^shard\(b, sp, 2\): mesh axis sp already partitions another axis"):
        shard("b", "sp", 2)(ring("q", "x", "sp", 2)(flash(batch=(nc.Axis("b"),))))
    with pytest.raises(RewriteError, match=r"^ring\(q, x, sp, 0\): axis 'x': devices must be a positive integer"):
        ring("q", "x", "sp", 0)
    with pytest.raises(RewriteError, match=r"exchange must be one of ppermute, all_gather, got 'nccl'"):
        ring("q", "x", "sp", 2, exchange="nccl")


def test_bad_meshes_exact_errors():
    s = ring("q", "x", "sp", 4)(flash())
    one = Mesh(np.array(jax.devices()[:1]), ("sp",))
    with pytest.raises(NotLowerable) as e:
        lower_devices(s, Mesh(np.array(jax.devices()[:1]), ("tp",)))
    assert str(e.value) == "lower_devices: the mesh has no axis 'sp' (its axes: tp)"
    with pytest.raises(NotLowerable) as e:
        lower_devices(s, one)
    assert str(e.value) == (
        "lower_devices: mesh axis 'sp' has 1 devices; the partition ring(q, x over sp:4, ppermute) of "
        "q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d wants 4"
    )
    if not FOUR:
        with pytest.raises(NotLowerable, match=r"need 4 devices; jax sees 1 \(on CPU set XLA_FLAGS="):
            lower_devices(s)


def test_one_device_ring_matches_reference(seed):
    """The ring on a one-device mesh (in-process): forward and gradients, causal, ragged."""
    kernel = lower_devices(derive_devices(flash(causal=True), ring("q", "x", "sp", 1), verify=False))
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, 21, 8))
    assert R.rel_err(kernel(Q, K, V), R.attention(Q, K, V, causal=True)) <= TOL


def test_mesh_cost_ring_against_all_gather():
    q, x, d = nc.axes("q x d", d=128)
    attn = nc.library.attention(q, x, d, causal=True, dtype="bf16")
    kw = {"queries": "q", "keys": "x"}
    ring_ = nc.mesh_cost(attn, H200_X2, **kw).subs(q=131072, x=131072)
    gather = nc.mesh_cost(attn, H200_X2, exchange="all_gather", **kw).subs(q=131072, x=131072)
    chunk = 2 * 65536 * 128 * 2  # K and V of one device's half, bf16
    assert ring_.link_bytes == gather.link_bytes == chunk
    assert ring_.step_time == NVLINK4.latency + sympy.Float(chunk) / NVLINK4.bandwidth
    assert bool(ring_.hidden) and ring_.comm_time == 0 and gather.comm_time == gather.step_time
    assert gather.memory_bytes - ring_.memory_bytes == 0  # two devices: all chunks = the two in flight
    balanced = nc.mesh_cost(attn, H200_X2, balanced=True, **kw).subs(q=131072, x=131072)
    assert ring_.flops / balanced.flops == sympy.Rational(3, 2)  # (P − ½) / (P/2) at P = 2
    both = nc.mesh_cost(attn, H200_X2, backward=True, **kw).subs(q=131072, x=131072)
    assert both.flops / ring_.flops == sympy.Rational(7, 2)
    assert both.link_bytes == 2 * chunk + 2 * (2 * 65536 * 128 * 4)  # K, V twice; dK, dV (f32) P = 2 steps


def test_docs_cost_example_runs(capsys):
    """docs/multi_device.md's cost example (its kernel example is test_four_ring_forward_and_gradients)."""
    import re

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "multi_device.md").read_text(), re.S)
    exec(next(b for b in blocks if "choose_exchange" in b), {"nc": nc})  # noqa: S102 - the documentation's own example
    assert capsys.readouterr().out.splitlines()[-1] == "ppermute"


def test_device_order_refuses_a_sequence_of_unequal_chunks():
    kernel = lower_devices(derive_devices(flash(True), ring("q", "x", "sp", 1), zigzag(), verify=False))
    with pytest.raises(NotLowerable, match="a sequence of 33 does not split into 2 equal chunks"):
        kernel.device_order(jnp.ones((33, 16)), 0)


def test_mesh_cost_bad_inputs():
    q, x, d = nc.axes("q x d")
    with pytest.raises(CostError, match=r"^mesh_cost: exchange must be one of ppermute, all_gather, all_to_all, got"):
        nc.mesh_cost(nc.library.attention(q, x, d), H200_X2, queries="q", keys="x", exchange="tree")
    with pytest.raises(CostError, match=r"devices must be a positive integer, got 2.0"):
        System(H200_X2.device, 2.0, NVLINK4)


# --- 4 CPU devices (in a subprocess) ---------------------------------------------------------------------


def test_on_four_cpu_devices(request):
    run_own_file_unless_in_session(request, __file__)  # tests/test_four_devices.py runs them in a full run


def outputs_and_grads_close(kernel, reference, args, seed):
    """Forward and every gradient against the reference, each side in one compilation (the reference op by op
    compiled each of its ops and their transposes apart)."""
    dO = jax.random.normal(jax.random.key(seed + 1), jax.eval_shape(reference, *args).shape)

    def both(f, *a):
        out, pullback = jax.vjp(f, *a)
        return out, pullback(dO.astype(out.dtype))

    out, got = jax.jit(functools.partial(both, kernel), compiler_options=FAST_COMPILE)(*args)
    want_out, want = jax.jit(functools.partial(both, reference))(*args)
    assert R.rel_err(out, want_out) <= TOL, "output"
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert R.rel_err(a, w) <= TOL, f"gradient of input {i}"


@on_four
@pytest.mark.parametrize(
    "causal, rules, n",
    [
        (False, lambda: [ring("q", "x", "sp", 4)], 70),  # ragged: the last chunk 16 of 18
        (True, lambda: [ring("q", "x", "sp", 4), zigzag()], 75),  # 8 chunks of 10, the last 5 padding
        (True, lambda: [ring("q", "x", "sp", 4, exchange="all_gather")], 61),
        (False, lambda: [ring("q", "x", "sp", 4, exchange="all_gather")], 9),  # 3 chunks of 3, the 4th padding
    ],
)
def test_four_ring_forward_and_gradients(seed, causal, rules, n):
    kernel = lower_devices(derive_devices(flash(causal), *rules(), verify=False))
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, n, 16))
    reference = lambda Q, K, V: R.attention(Q, K, V, causal=causal)  # noqa: E731
    outputs_and_grads_close(kernel, reference, (Q, K, V), seed)


@on_four
def test_four_zigzag_ring_in_device_order(seed):
    """Arrays already in the devices' zig-zag order (a model permutes its tokens once): forward and gradients
    equal the reference's, and the compiled call moves no more data than the ring's own steps (the plain call
    also reorders Q, K, V and O between devices)."""
    kernel = lower_devices(derive_devices(flash(True), ring("q", "x", "sp", 4), zigzag(), verify=False))
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, 80, 16))  # 8 chunks of 10

    def ordered(Q, K, V):
        return kernel.sequence_order(kernel.in_device_order(*(kernel.device_order(a, 0) for a in (Q, K, V))), 0)

    reference = lambda Q, K, V: R.attention(Q, K, V, causal=True)  # noqa: E731
    outputs_and_grads_close(ordered, reference, (Q, K, V), seed)
    placed = jax.NamedSharding(kernel.mesh, jax.P("sp"))
    sharded = [jax.device_put(kernel.device_order(a, 0), placed) for a in (Q, K, V)]

    def moves(f):  # cross-device transfers in the compiled forward
        text = jax.jit(f).lower(*sharded).compile().as_text()
        return len(re.findall(r" (collective-permute|all-to-all|all-gather)(-start)?\(", text))

    # at most the ring's own P − 1 = 3 steps of K and V (XLA may combine the two); the plain call's reorders
    # of Q, K, V and O partition into 136 more on CPU
    assert moves(kernel.in_device_order) <= 6 < moves(kernel)
    with pytest.raises(NotLowerable, match="must split into 8 whole chunks"):
        kernel.in_device_order(Q[:75], K[:75], V[:75])


@on_four
def test_four_batch_shard_with_ring(seed):
    """A 2 × 2 mesh: batch over dp (3 rows: ragged), the sequence over sp."""
    b = nc.Axis("b")
    done = derive_devices(flash(True, batch=(b,)), shard("b", "dp", 2), ring("q", "x", "sp", 2), seed=seed)
    kernel = lower_devices(done)
    assert dict(kernel.mesh.shape) == {"dp": 2, "sp": 2}
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, 3, 37, 16))
    reference = lambda Q, K, V: R.attention(Q, K, V, causal=True)  # noqa: E731
    outputs_and_grads_close(kernel, reference, (Q, K, V), seed)


@on_four
def test_four_batch_shard_alone(seed):
    """The group partition alone: batch 5 over 4 devices (padded), the per-device kernel's own backward."""
    kernel = lower_devices(shard("b", "dp", 4)(flash(batch=(nc.Axis("b"),))))
    Q, K, V = jax.random.normal(jax.random.key(seed), (3, 5, 24, 16))
    outputs_and_grads_close(kernel, R.attention, (Q, K, V), seed)


@pytest.mark.gpu
def test_gpu_ring_over_two_gpus_matches_one(seed):
    """On 2 GPUs (compiled Triton): causal bf16 ring + zig-zag, forward and gradients, against one GPU's kernel."""
    if jax.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    b, h = nc.Axis("b"), nc.Axis("h")
    q, x, d = nc.axes("q x d", d=128)
    mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True, dtype="bf16")
    scheduled = derive(mha, tile(q, 128), stream(x, 64), verify=False)
    kernel = lower_devices(derive_devices(scheduled, ring("q", "x", "sp", 2), zigzag(), seed=seed, sizes={"b": 1}))
    Q, K, V = (jax.random.normal(k, (1, 4, 4000, 128), jnp.bfloat16) for k in jax.random.split(jax.random.key(seed), 3))
    reference = lambda Q, K, V: R.attention(Q, K, V, causal=True)  # noqa: E731
    dO = jax.random.normal(jax.random.key(seed + 1), Q.shape, jnp.bfloat16)
    out, pullback = jax.vjp(jax.jit(kernel), Q, K, V)
    want, pull_want = jax.vjp(reference, Q, K, V)
    assert R.rel_err(out, want) <= 3e-2  # bf16: rewrites.tolerance
    for i, (a, w) in enumerate(zip(pullback(dO), pull_want(dO.astype(jnp.float32)), strict=True)):
        assert R.rel_err(a, w) <= 3e-2, f"gradient of input {i}"


@on_four
def test_four_benchmark_quick(tmp_path):
    """papers/flash_attention/ring_attention.py --smoke runs end to end (tiny sizes, 4 host devices; one strategy
    here, the cheapest to interpret)."""
    sys.path.insert(0, str(ROOT / "papers" / "flash_attention"))
    import ring_attention

    path = ring_attention.main(["--smoke", "--strategy", "ulysses", "--out", str(tmp_path)])
    assert path.exists() and path.with_suffix(".png").exists()
