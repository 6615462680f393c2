"""Lowered kernels under JAX's SPMD (lowering._spmd): ``nc.attention`` on inputs sharded over a 2 × 2 mesh, batch
over "data" and heads over "model", under Explicit and Auto mesh axes and inside ``jax.shard_map(check_vma=True)``;
gradients; a summed axis split over devices (partial sums added: data parallelism's weight gradient); the refusal
of a sharded axis the kernel reduces over otherwise.

Kernels on 4 devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax starts, and conftest
starts jax with one device: ``test_spmd_on_four_cpu_devices`` reruns this file's ``test_four_*`` tests in a
subprocess with the flag (as tests/test_multi_device.py does).

Tolerances: f32, interpreted kernels, against ``jax.nn.dot_product_attention`` (no napkin_cat code): forward and
gradients measured ≤ 1e-6 absolute at these sizes; TOL = 1e-5.
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as Spec

import napkin_cat as nc
from lowering import NotLowerable
from tests.four_devices import run_own_file_unless_in_session

TOL = 1e-5
#: the fused norm then attention, loss (a sum of squares) and gradients in f32 (sums over 96 tokens split over
#: devices): measured up to 6.7e-5 of 1 + max |reference| over 40 seeds (3422678233, 3893602696, 1–20, 100–117),
#: its top decile 1.7e-5 to 6.7e-5: 3 times the worst. (The loss was a plain sum, which cancelled to ~1e-3 of its
#: terms for seed 3422678233, so its rounding, ~1e-3, was measured against a total of 3.9: the CI failure of stop 51.)
CHAIN_TOL = 2e-4
#: sums of 64 products of N(0, 1) entries, in chunks and partial sums against einsum's order: measured up to 4.9e-7
#: of max |reference| over 150 seeds (up to 1.1e-5 absolute, over TOL; stop 54's suite failed at 1.3e-5); 4 times that
SUM_TOL = 2e-6
ROOT = pathlib.Path(__file__).resolve().parents[1]
on_four = pytest.mark.skipif(jax.device_count() < 4, reason="runs in test_spmd_on_four_cpu_devices' subprocess")
BHD = Spec("data", None, "model", None)  # [batch, seq, heads, dim]: data parallel over batch, tensor over heads


def test_spmd_on_four_cpu_devices(request):
    run_own_file_unless_in_session(request, __file__)  # tests/test_four_devices.py runs them in a full run


def mesh(kind):
    return jax.make_mesh((2, 2), ("data", "model"), axis_types=(kind,) * 2)


def inputs(seed, m, spec=BHD, shape=(4, 24, 4, 16)):
    arrays = jax.random.normal(jax.random.key(seed), (3, *shape))
    return [jax.device_put(a, NamedSharding(m, spec)) for a in arrays]


def close(a, b):
    assert float(jnp.max(jnp.abs(a - b))) <= TOL


def out_and_grads(f, q, k, v):
    """The output and the gradients of a weighted sum of it (the weights random), in one compilation."""
    w = jax.random.normal(jax.random.key(7), q.shape[:3] + (v.shape[3],))
    out, pull = jax.vjp(f, q, k, v)
    return out, pull(w.astype(out.dtype))


def check(f, arrays):
    """``f``'s output and gradients against jax.nn's on the same (unsharded) values; ``f``'s results returned."""
    got = jax.jit(lambda *a: out_and_grads(f, *a))(*arrays)
    unsharded = (jnp.asarray(jax.device_get(a)) for a in arrays)
    want = jax.jit(lambda *a: out_and_grads(jax.nn.dot_product_attention, *a))(*unsharded)  # one program, not op by op
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        close(g, w)
    return got


@on_four
def test_four_explicit_axes_run_per_shard_and_keep_the_sharding(seed):
    q, k, v = inputs(seed, mesh(AxisType.Explicit))
    out, grads = check(nc.attention, (q, k, v))
    assert all(jax.typeof(a).sharding.spec == BHD for a in (out, *grads))


@on_four
def test_four_auto_axes_propagate_through_the_kernel(seed):
    q, k, v = inputs(seed, mesh(AxisType.Auto))
    out, grads = check(nc.attention, (q, k, v))
    for a in (out, *grads):
        assert a.sharding.is_equivalent_to(q.sharding, 4) and not a.sharding.is_fully_replicated


@on_four
def test_four_a_kernel_reading_another_kernel_s_output_runs_per_shard(seed):
    # a pallas kernel's output named no mesh: the attention after the fused norm then ran whole on every device,
    # its inputs gathered (data-parallel training ran every attention 4 times)
    m = mesh(AxisType.Auto)
    x, g, w = (jax.random.normal(jax.random.key(seed + i), s) for i, s in enumerate([(4, 24, 32), (32,), (32, 192)]))
    x, g, w = (jax.device_put(a, NamedSharding(m, s)) for a, s in ((x, Spec("data")), (g, Spec()), (w, Spec())))

    def layer(x, g, w, norm_linear):
        q, k, v = jnp.split(norm_linear(x, g, w).reshape(4, 24, 12, 16), 3, axis=2)
        attend = nc.attention if norm_linear is nc.rms_norm_linear else jax.nn.dot_product_attention
        return jnp.sum(attend(q, k, v, is_causal=True) ** 2)  # squares: a plain sum cancels to ~1e-3 of its terms

    def by_hand(x, g, w):
        return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g) @ w

    program = jax.jit(jax.value_and_grad(lambda *a: layer(*a, nc.rms_norm_linear), argnums=(0, 1, 2)))
    compiled = program.lower(x, g, w).compile()
    gathered = re.findall(r"= (f32\[\S*) all-gather\(", compiled.as_text())
    assert not gathered, f"activations gathered: {gathered}"
    got = compiled(x, g, w)  # the program just read, not traced and lowered again
    reference = jax.jit(jax.value_and_grad(lambda *a: layer(*a, by_hand), argnums=(0, 1, 2)))
    want = reference(jnp.asarray(jax.device_get(x)), g, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= CHAIN_TOL * (1 + float(jnp.max(jnp.abs(b))))


@on_four
def test_four_inside_shard_map_with_check_vma(seed):
    m = mesh(AxisType.Explicit)
    per_shard = jax.shard_map(nc.attention, mesh=m, in_specs=BHD, out_specs=BHD, check_vma=True)
    check(per_shard, inputs(seed, m))


@on_four
def test_four_a_sharded_key_axis_is_refused(seed):
    m = mesh(AxisType.Explicit)
    q, _, _ = inputs(seed, m)
    k, v = inputs(seed + 1, m, Spec("data", "model", None, None))[:2]
    with pytest.raises(NotLowerable) as e:
        jax.jit(nc.attention)(q, k, v)
    assert "input 1 splits axis 'kv_idx' over mesh axis model" in str(e.value)
    assert "the box mixes elements along kv_idx" in str(e.value)
    assert "reshard it to replicate 'kv_idx'" in str(e.value) and "docs/multi_device.md" in str(e.value)
    causal_q = inputs(seed, m, Spec(None, "data", None, None))[0]  # the causal mask reads the query's index
    with pytest.raises(NotLowerable, match=r"splits axis 'q_idx' over mesh axis data, but box 'mask causal"):
        jax.jit(lambda q: nc.attention(q, q, q, is_causal=True))(causal_q)


@on_four
def test_four_docs_example_runs(capsys):
    """docs/multi_device.md's sharded-attention and summed-axis examples (its Python blocks that make a
    NamedSharding)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "multi_device.md").read_text(), re.S)
    sharded, summed = (b for b in blocks if "NamedSharding(" in b and "distributed" not in b)
    scope = {"jax": jax, "jnp": jnp, "nc": nc}
    exec(sharded, scope)  # noqa: S102 - the documentation's own example
    assert jax.typeof(scope["out"]).sharding.spec == BHD
    exec(summed, scope)  # noqa: S102 - the summed axis's, on the same mesh
    assert capsys.readouterr().out.split() == ["True"]


def _weight_gradient(kind_or_mesh, seed, backend="xla"):
    """A lowered kernel summing over tokens (``n k, n m → k m``: a weight's gradient) on tokens split over
    "data": each device's partial sum, added across devices; against ``jnp.einsum`` on the gathered arrays."""
    from lowering import lower
    from rewrites import derive, stream, tile

    n, k, m = nc.axes("n k m")
    kernel = lower(derive(nc.contract("n k, n m -> k m", n, k, m), tile(k, 16), tile(m, 16), stream(n, 16),
                          verify=False), backend=backend)
    x, y = jax.random.normal(jax.random.key(seed), (2, 64, 16))
    sharding = NamedSharding(kind_or_mesh, Spec("data", None))
    got = jax.jit(kernel)(jax.device_put(x, sharding), jax.device_put(y, sharding))
    want = jnp.einsum("nk,nm->km", x, y)
    assert float(jnp.max(jnp.abs(got - want))) <= SUM_TOL * float(jnp.max(jnp.abs(want)))
    return got


@on_four
@pytest.mark.parametrize("kind", [AxisType.Explicit, AxisType.Auto])
def test_four_a_summed_axis_split_over_devices_adds_the_partial_sums(seed, kind):
    got = _weight_gradient(mesh(kind), seed)
    assert jax.typeof(got).sharding.spec in (Spec(), Spec(None, None)) or got.sharding.is_fully_replicated


@on_four
def test_four_rms_norm_linear_trains_data_parallel(seed):
    """The fused norm's backward (its weight gradients sum over the batch) under a batch-sharded jit."""
    m = mesh(AxisType.Auto)
    x, w = (jax.random.normal(jax.random.key(seed + i), s) for i, s in enumerate([(8, 4, 32), (32, 16)]))
    g = 1 + 0.1 * jax.random.normal(jax.random.key(seed + 2), (32,))

    def loss(x, g, w, f):
        return jnp.sum(jnp.sin(f(x, g, w)))

    def ref(x, g, w):
        return (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g) @ w

    xs = jax.device_put(x, NamedSharding(m, Spec("data", None, None)))
    got = jax.jit(jax.grad(lambda *a: loss(*a, nc.rms_norm_linear), argnums=(0, 1, 2)))(xs, g, w)
    want = jax.grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2))(x, g, w)
    for a, b in zip(got, want, strict=True):
        assert float(jnp.max(jnp.abs(a - b))) <= 1e-4 * float(jnp.max(jnp.abs(b)))
