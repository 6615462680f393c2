"""Sequence parallelism: the ring, the all-gather and Ulysses (rewrites.ring/ulysses, lowering.lower_devices), causal
and not, ragged, unequal query and key lengths, 2 and 4 devices and a 2×2 mesh; the per-device kernels through the
backend registry; the communication model (nc.mesh_cost, nc.fit_link, nc.choose_strategy).

Kernels on several devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax starts:
``test_on_four_cpu_devices`` reruns this file's ``test_four_*`` tests in a subprocess with the flag.

Every result is compared with :func:`reference`, attention written here in jax.numpy. Tolerances: f32 interpret
mode, forward and gradients measured ≤ 6e-7 relative error on these cases (TOL = 1e-5); bf16 Mosaic (interpret)
forward and gradients measured ≤ 3.3e-3 (BF16 = 1e-2).
"""

from __future__ import annotations

import functools
import pathlib
import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest
import sympy

import napkin_cat as nc
from lowering import MosaicConfig, NotLowerable, lower_devices
from napkin_cat.errors import CostError
from napkin_cat.hardware import H200, NVLINK4, Interconnect, System
from rewrites import RewriteError, derive, derive_devices, execute_devices, ring, shard, stream, tile, ulysses, zigzag
from rewrites._verify import FAST_COMPILE
from tests.four_devices import run_own_file_unless_in_session

TOL, BF16 = 1e-5, 1e-2
FOUR = jax.device_count() >= 4
ROOT = pathlib.Path(__file__).resolve().parents[1]
on_four = pytest.mark.skipif(not FOUR, reason="runs in test_on_four_cpu_devices' subprocess")


def reference(Q, K, V, causal=False):
    """softmax(Q Kᵀ/√d) V over the last two axes, f32; causal: query i sees key j ≤ i (top-left, as jax.nn)."""
    Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
    s = jnp.einsum("...qd,...kd->...qk", Q, K) / Q.shape[-1] ** 0.5
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), V)


def rel_err(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def heads_flash(causal=False, batch=False, dtype="f32", g=16, s=16, d=None):
    b, h, q, x = nc.axes("b h q x")
    dd = nc.Axis("d", d) if d else nc.Axis("d")
    mha = nc.library.multi_head_attention(h, q, x, dd, batch=(b,) if batch else (), causal=causal, dtype=dtype)
    return derive(mha, tile(q, g), stream(x, s), verify=False)


STRATEGIES = {
    "ring": lambda p, causal: [ring("q", "x", "sp", p), *([zigzag()] if causal else [])],
    "ring_contiguous": lambda p, causal: [ring("q", "x", "sp", p)],
    "all_gather": lambda p, causal: [ring("q", "x", "sp", p, exchange="all_gather")],
    "ulysses": lambda p, causal: [ulysses("q", "x", "h", "sp", p)],
}


def qkv(seed, heads, nq, nk, d=8, lead=(), dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(kq, (*lead, heads, nq, d), dtype),
        jax.random.normal(kk, (*lead, heads, nk, d), dtype),
        jax.random.normal(kv, (*lead, heads, nk, d), dtype),
    )


# --- in-process: the partitioned semantics, refusals, the cost model --------------------------------------


@pytest.mark.parametrize(
    "causal, strategy",
    # not the full ring: without a mask its rules are the contiguous ring's (zig-zag balances causal work only)
    [(c, s) for c in (False, True) for s in sorted(STRATEGIES) if c or s != "ring"],
    ids=lambda v: v if isinstance(v, str) else ("causal" if v else "full"),
)
def test_partitioned_semantics_unequal_lengths(seed, strategy, causal):
    """Each strategy, verified by derive_devices, then its partitioned semantics against the reference at equal,
    fewer-query and fewer-key lengths (ragged: none a multiple of the chunks)."""
    rules = STRATEGIES[strategy](3, causal)
    done = derive_devices(heads_flash(causal), *rules, seed=seed)
    assert all(s.verification.passed for s in done.steps[1:])
    # both sides compiled whole, one program per size (op by op, each of ~200 small ops compiled at each size)
    run = jax.jit(execute_devices(done.sharded), compiler_options=FAST_COMPILE)
    want = jax.jit(functools.partial(reference, causal=causal))
    for nq, nk in ((37, 37), (20, 45), (45, 20)):
        Q, K, V = qkv(seed + nq, 6, nq, nk)
        assert rel_err(run(Q, K, V), want(Q, K, V)) <= TOL, f"seed {seed}, {nq} × {nk}"


def test_ulysses_side_conditions_exact_errors():
    h, q, x, d = nc.axes("h q x d", h=6)
    mha = nc.library.multi_head_attention(h, q, x, d, causal=True)
    with pytest.raises(RewriteError) as e:
        ulysses("q", "x", "h", "sp", 4)(mha)
    assert str(e.value) == (
        "ulysses(q, x, h, sp, 4): axis 'h': 6 heads do not divide over 4 devices; use a device count that divides 6, "
        "or ring(q, x, sp, 4)"
    )
    with pytest.raises(RewriteError, match=r"^ulysses\(q, x, h, sp, 2\): axis 'h': no wire has axis h"):
        ulysses("q", "x", "h", "sp", 2)(nc.library.attention(q, x, d))
    with pytest.raises(RewriteError, match=r"^zigzag: Ulysses runs the whole sequence on every device"):
        zigzag()(ulysses("q", "x", "h", "sp", 2)(mha))
    with pytest.raises(RewriteError, match=r"^ring\(q, x, sp, 2\): the sequence is already split: ulysses\(q, x"):
        ring("q", "x", "sp", 2)(ulysses("q", "x", "h", "sp", 2)(heads_flash(True)))
    with pytest.raises(RewriteError, match=r"^shard\(h, tp, 2\): axis 'h': h is already partitioned over devices"):
        shard("h", "tp", 2)(ulysses("q", "x", "h", "sp", 2)(mha))


def test_refusals_at_the_call_name_axis_and_fix():
    """Heads that do not divide (known only at the call), and zig-zag with fewer keys than queries, refused before
    anything runs (one device: nothing is traced)."""
    one = lower_devices(derive_devices(heads_flash(), ulysses("q", "x", "h", "sp", 1), verify=False))
    from lowering._ulysses import check_heads

    with pytest.raises(NotLowerable) as e:
        check_heads(ulysses("q", "x", "h", "sp", 4)(heads_flash()), {"h": 6})
    assert str(e.value) == (
        "lower_devices, ulysses over sp, axis 'h': 6 heads do not divide over 4 devices; use a device count that "
        "divides 6, or ring(q, x, sp, 4)"
    )
    assert one.exchange == "all_to_all"
    balanced = lower_devices(derive_devices(heads_flash(True), ring("q", "x", "sp", 1), zigzag(), verify=False))
    Q, K, V = qkv(0, 2, 24, 16)
    with pytest.raises(NotLowerable) as e:
        balanced(Q, K, V)
    assert str(e.value) == (
        "lower_devices: zigzag under a causal mask with fewer keys (x: 16) than queries (q: 24) is not lowered; "
        "drop zigzag() or use ulysses"
    )


def test_backend_named_reaches_every_pair_kernel():
    """backend="triton" and "xla": every per-device kernel, forward and backward, says so."""
    s = derive_devices(heads_flash(True), ring("q", "x", "sp", 1), verify=False)
    for name in ("triton", "xla"):
        backends = lower_devices(s, backend=name).backends
        assert set(backends.values()) == {name} and len(backends) == 8, backends
    one = lower_devices(ulysses("q", "x", "h", "sp", 1)(heads_flash()), backend="xla")
    assert set(one.backends.values()) == {"xla"}


def mha_cost(causal=True):
    h, q, x, d = nc.axes("h q x d", h=8, d=128)
    return nc.library.multi_head_attention(h, q, x, d, causal=causal, dtype="bf16")


def test_mesh_cost_ulysses_counts_four_all_to_alls():
    system = System(H200, 4, NVLINK4)
    c = nc.mesh_cost(mha_cost(), system, queries="q", keys="x", exchange="all_to_all", heads="h").subs(q=4096, x=4096)
    chunk = 8 * 1024 * 128 * 2  # one device's chunk of Q (or K, V, O): 8 heads × N/4 × 128, bf16
    assert c.link_bytes == 4 * chunk * sympy.Rational(3, 4)
    assert c.transfer_time == c.comm_time == 4 * NVLINK4.latency + sympy.Float(3 * chunk) / NVLINK4.bandwidth
    ring_ = nc.mesh_cost(mha_cost(), system, queries="q", keys="x", balanced=True).subs(q=4096, x=4096)
    assert float(c.flops) == pytest.approx(float(ring_.flops))  # the same causal half, split two ways
    with pytest.raises(CostError, match=r"Ulysses \(all_to_all\) needs heads= an input axis; got None"):
        nc.mesh_cost(mha_cost(), system, queries="q", keys="x", exchange="all_to_all")


def test_fit_link_recovers_bandwidth_and_latency(seed):
    import random

    rng = random.Random(seed)
    bandwidth, latency = rng.uniform(50e9, 400e9), rng.uniform(1e-6, 2e-5)
    sizes = [2**k for k in range(20, 29, 2)]
    measured = [(b, (latency + b / bandwidth) * (1 + rng.uniform(-0.01, 0.01))) for b in sizes]
    link = nc.fit_link(measured)
    assert link.bandwidth == pytest.approx(bandwidth, rel=0.05), f"seed {seed}"
    with pytest.raises(CostError, match="need transfers of at least two sizes"):
        nc.fit_link(measured[:1])


def test_fanout_speeds_the_collectives_and_not_the_ring(seed):
    """A link whose collectives take from every peer at once (``fanout``, fitted to all-gathers) moves the
    all-gather's and Ulysses' bytes at that rate; the ring's one-peer steps keep the link's own bandwidth."""
    import random

    rng = random.Random(seed)
    one, fan, latency = rng.uniform(100e9, 200e9), rng.uniform(250e9, 400e9), rng.uniform(1e-6, 4e-5)
    sizes = [2**k for k in range(24, 29)]
    link = nc.fit_link([(b, latency + b / one) for b in sizes], fanout=[(3 * b, latency + 3 * b / fan) for b in sizes])
    assert (link.bandwidth, link.fanout) == (pytest.approx(one, rel=1e-6), pytest.approx(fan, rel=1e-6)), f"seed {seed}"
    plain, fanned = System(H200, 4, replace(link, fanout=None)), System(H200, 4, link)
    kw = {"queries": "q", "keys": "x", "heads": "h", "balanced": True, "backward": True}
    at = {"q": 131072, "x": 131072}
    for exchange in ("all_gather", "all_to_all"):
        slow, fast = (nc.mesh_cost(mha_cost(), s, exchange=exchange, **kw).subs(**at) for s in (plain, fanned))
        count = 3 if exchange == "all_gather" else 8  # gather, gather again, reduce-scatter; 8 all-to-alls
        assert float(fast.transfer_time) == pytest.approx(count * latency + float(fast.link_bytes) / fan, rel=1e-9)
        assert float(slow.transfer_time) == pytest.approx(count * latency + float(slow.link_bytes) / one, rel=1e-9)
    ring_plain, ring_fanned = (nc.mesh_cost(mha_cost(), s, **kw).subs(**at) for s in (plain, fanned))
    assert ring_plain.transfer_time == ring_fanned.transfer_time


def test_choose_strategy_follows_the_link():
    """A fast link hides the ring's transfers (the ring wins, on memory); a slow one exposes them, and Ulysses,
    moving 3/4 of a chunk of four arrays to the ring's three K/V chunks, wins. Heads not dividing: no Ulysses."""
    kw = {"queries": "q", "keys": "x", "heads": "h", "balanced": True}
    fast = nc.choose_strategy(mha_cost(), System(H200, 4, NVLINK4), {"q": 131072, "x": 131072}, **kw)
    assert fast.strategy == "ring" and "hidden" in fast.why
    sizes, slow_link = {"q": 8192, "x": 8192}, System(H200, 4, Interconnect("slow", 5e9, 1e-5))
    slow = nc.choose_strategy(mha_cost(), slow_link, sizes, backward=True, **kw)
    times = {k: float(c.time) for k, c in slow.costs.items()}
    assert slow.strategy == min(times, key=times.get) == "ulysses", slow.why
    three = nc.choose_strategy(mha_cost(), System(H200, 3, NVLINK4), sizes, **kw)
    assert "ulysses" not in three.costs and "ulysses: 8 heads do not divide over 3 devices" in three.why


def docs_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "multi_device.md").read_text(), re.S)


def test_docs_strategy_cost_example_runs(capsys):
    """docs/multi_device.md's fitted-link example (after the cost example it builds on)."""
    blocks, scope = docs_blocks(), {"nc": nc}
    exec(next(b for b in blocks if "choose_exchange" in b), scope)  # noqa: S102 - the documentation's own example
    exec(next(b for b in blocks if "fit_link" in b), scope)  # noqa: S102
    assert capsys.readouterr().out.splitlines()[-1].startswith("ulysses: ring ")


# --- several CPU devices (in a subprocess) ------------------------------------------------------------------


def test_on_four_cpu_devices(request):
    run_own_file_unless_in_session(request, __file__)  # tests/test_four_devices.py runs them in a full run


def forward_and_gradients_close(kernel, causal, args, seed, tol=TOL):
    """Forward and every gradient against :func:`reference`, each side in one compilation (the reference op by op
    compiled each of its ops and their transposes apart)."""
    want_fn = functools.partial(reference, causal=causal)
    dO = jax.random.normal(jax.random.key(seed + 1), jax.eval_shape(want_fn, *args).shape)

    def both(f, *a):
        out, pullback = jax.vjp(f, *a)
        return out, pullback(dO.astype(out.dtype))

    out, got = jax.jit(functools.partial(both, kernel), compiler_options=FAST_COMPILE)(*args)
    want_out, want = jax.jit(functools.partial(both, want_fn))(*args)
    assert rel_err(out, want_out) <= tol, "output"
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, w) <= tol, f"gradient of input {i}"


@on_four
@pytest.mark.parametrize(
    "strategy, devices, causal, nq, nk",
    [
        ("ulysses", 4, True, 45, 29),  # more queries than keys, ragged over 4
        ("ulysses", 2, False, 21, 37),
        ("ring_contiguous", 4, True, 45, 20),  # causal, fewer keys: the chunks past the last key cut
        ("all_gather", 2, True, 20, 45),  # causal, fewer queries: the keys no query sees dropped
    ],
)
def test_four_strategy_forward_and_gradients(seed, strategy, devices, causal, nq, nk):
    rules = STRATEGIES[strategy](devices, causal)
    kernel = lower_devices(derive_devices(heads_flash(causal), *rules, verify=False))
    assert kernel.mesh.shape["sp"] == devices
    forward_and_gradients_close(kernel, causal, qkv(seed, 4, nq, nk), seed)


@on_four
def test_four_ulysses_on_a_two_by_two_mesh(seed):
    """Batch over dp (3: ragged), Ulysses over sp (4 heads, 2 per device), causal."""
    rules = shard("b", "dp", 2), ulysses("q", "x", "h", "sp", 2)
    done = derive_devices(heads_flash(True, batch=True), *rules, seed=seed)
    kernel = lower_devices(done)
    assert dict(kernel.mesh.shape) == {"dp": 2, "sp": 2}
    forward_and_gradients_close(kernel, True, qkv(seed, 4, 33, 33, lead=(3,)), seed)


def test_mosaic_pair_kernels_interpreted(seed):
    """backend="mosaic" (interpret mode): the ring's per-device pair kernels, forward and backward, are Mosaic's
    (the backward's with f32 partial gradients); bf16, causal. On one device, without zig-zag (the diagonal pair
    alone): JAX's Mosaic GPU interpreter keeps one simulated shared memory per process, so interpreted Mosaic kernels
    that may run at once (two host devices, or zig-zag's three independent pairs in one step) hang or trip its
    barrier check (compiled, on GPUs, each device has its own)."""
    s = derive_devices(heads_flash(True, dtype="bf16", g=128, s=64, d=64), ring("q", "x", "sp", 1), verify=False)
    kernel = lower_devices(s, backend="mosaic", interpret=True, config=MosaicConfig(interpretable=True))
    forward_and_gradients_close(kernel, True, qkv(seed, 1, 256, 256, d=64, dtype=jnp.bfloat16), seed, BF16)
    assert set(kernel.backends.values()) == {"mosaic"} and len(kernel.backends) == 8, kernel.backends


def test_ring_pair_kernels_take_mosaic_on_hopper_at_the_benchmarks_blocks(hopper):
    """papers/flash_attention/ring_attention.py's ring (causal, bf16, D = 128, zig-zag chunks of N/8 at N = 128k
    over 4 devices, at nc.attention's blocks on Hopper): on a stand-in sm_90 every pair kernel, forward and
    backward, takes Mosaic under auto (each lowered for CUDA here, not run); the backward pieces are weighed as
    backward kernels, whose chunks the forward's rule refuses. Interpreted, auto says why each is on Triton."""
    from lowering._attention import schedule

    g, s = schedule(131072 // 8, 131072 // 8, 128, mosaic=True)
    flash = heads_flash(True, True, "bf16", g, s, 128)
    sharded = derive_devices(flash, ring("q", "x", "sp", 1), zigzag(), verify=False)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    hopper()
    kernel = lower_devices(sharded, mesh, interpret=False)
    assert set(kernel.backends.values()) == {"mosaic"} and len(kernel.backends) == 8, kernel.refused
    assert kernel.refused == {}
    interpreted = lower_devices(sharded, mesh, interpret=True)
    assert set(interpreted.backends.values()) == {"triton"}
    assert set(interpreted.refused.values()) == {"interpret=True: 'auto' interprets with Triton"}
    assert interpreted.refused.keys() == interpreted.backends.keys()


def test_ring_binds_an_open_head_dim_at_the_call_on_hopper(hopper, seed):
    """A head dim the diagram leaves open: on a stand-in sm_90 under auto, the ring's pair kernels are built at the
    call for the arrays' head dim (Mosaic's registers, hence the backend, depend on it), all on Mosaic at D = 128,
    and the whole ring, forward and backward, lowers for CUDA (here, not run)."""
    sharded = derive_devices(heads_flash(True, dtype="bf16", g=128, s=128), ring("q", "x", "sp", 1), verify=False)
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("sp",))
    hopper()
    kernel = lower_devices(sharded, mesh, interpret=False)
    assert kernel.backends == {}  # none built before the call
    Q, K, V = qkv(seed, 2, 256, 256, d=128, dtype=jnp.bfloat16)
    jax.jit(jax.grad(lambda *a: kernel(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))).trace(Q, K, V).lower(
        lowering_platforms=("cuda",)
    )
    assert set(kernel.backends.values()) == {"mosaic"} and len(kernel.backends) == 8, kernel.refused


@on_four
def test_four_docs_strategy_examples(capsys):
    """docs/multi_device.md's ring, all-gather and Ulysses examples, each against jax.nn, and the ring called on
    arrays in device order against its plain call."""
    blocks, scope = docs_blocks(), {}
    for name in ("ringed = ", "in_device_order(", "gathered = ", "u = "):
        exec(next(b for b in blocks if name in b), scope)  # noqa: S102
    assert capsys.readouterr().out.split() == ["True"] * 4
