"""More than one machine: the sharded entry and the ring under ``jax.distributed``, one process per host.

``test_two_processes_on_one_machine`` starts two Python processes on this machine (this file run as a script),
each with 2 CPU devices and a localhost coordinator, so that jax sees one global mesh of 4 devices of which each
process addresses 2. Both run:

* ``nc.attention`` under ``jit`` on global arrays sharded batch over "data" and heads over "model" (Explicit mesh
  axes, then Auto ones; "data" splits the processes), forward and gradients (data and tensor parallelism,
  lowering/_spmd.py);
* the ring (``lower_devices`` of ``ring("q", "x", "sp", 4), zigzag()``, causal, a ragged sequence) over all 4
  devices, forward and gradients: K/V chunks cross between the processes by ``ppermute``.

Cross-process collectives on CPU are gloo's (jax's default ``jax_cpu_collectives_implementation``). Each process
checks the shards it addresses against an attention written here in jax.numpy (no napkin_cat code), on the same
seeded inputs, and prints its errors; the test reads both processes' reports.

Tolerances: f32, interpreted kernels: forward and gradients measured ≤ 1.2e-6 absolute at these sizes; TOL = 1e-5.
Each worker writes how long each part took to its stderr, shown when the test fails.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

TOL = 1e-5
ROOT = pathlib.Path(__file__).resolve().parents[1]
PROCESSES, LOCAL_DEVICES = 2, 2
LIMIT_S = 600  # a hung collective (a peer that died) fails the test, not the suite; ~40 s on 2 idle cores
BHD = ("data", None, "model", None)  # [batch, seq, heads, dim]: data parallel over batch, tensor over heads


# --- the launcher (pytest) --------------------------------------------------------------------------------------


def test_two_processes_on_one_machine(seed):
    reports = launch(seed)
    assert [r["process"] for r in reports] == list(range(PROCESSES))
    for r in reports:
        assert (r["devices"], r["local_devices"]) == (PROCESSES * LOCAL_DEVICES, LOCAL_DEVICES), r
        for part in ("Explicit", "Auto", "ring"):
            assert max(r[part]["errors"].values()) <= TOL, (part, r)
        for kind in ("Explicit", "Auto"):  # the output and the gradients keep the inputs' sharding
            assert all(spec == list(BHD) for spec in r[kind]["specs"]), (kind, r)
    # "data" splits the processes: each addresses its own half of the batch, every head
    assert [r["Explicit"]["batch_blocks"] for r in reports] == [[[0, 2]], [[2, 4]]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(seed: int) -> list[dict]:
    """Run this file as ``PROCESSES`` worker processes; their reports, or a failure showing every stderr."""
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        # conftest's XLA flags too (LLVM's optimisation passes off on CPU: they cost more than they save here)
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={LOCAL_DEVICES}",
    }
    with tempfile.TemporaryDirectory() as tmp:
        logs = [(pathlib.Path(tmp, f"{i}.out"), pathlib.Path(tmp, f"{i}.err")) for i in range(PROCESSES)]
        procs = []
        for i, (out, err) in enumerate(logs):
            cmd = [sys.executable, __file__, str(i), str(port), str(seed)]
            with out.open("w") as o, err.open("w") as e:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=o, stderr=e))
        deadline = time.monotonic() + LIMIT_S
        while any(p.poll() is None for p in procs):
            failed = any(p.returncode not in (None, 0) for p in procs)
            if failed or time.monotonic() > deadline:
                for p in procs:  # a peer blocks in its collectives once one process is gone
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                break
            time.sleep(0.2)
        texts = [(out.read_text(), err.read_text()) for out, err in logs]
    reports = [report_in(o) for o, _ in texts]
    if any(p.returncode != 0 for p in procs) or None in reports:
        shown = "\n".join(
            f"--- process {i}: exit {p.returncode} (killed after {LIMIT_S} s if -9)\n{o[-2000:]}\n{e[-6000:]}"
            for i, (p, (o, e)) in enumerate(zip(procs, texts, strict=True))
        )
        raise AssertionError(f"replay with NAPKIN_SEED={seed}\n{shown}")
    return reports


def report_in(stdout: str) -> dict | None:
    """The worker's report: its line ``REPORT <json>`` (gloo writes its own lines to stdout too)."""
    return next((json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("REPORT ")), None)


# --- the worker (one process per host) ---------------------------------------------------------------------------


def reference(q, k, v, causal: bool):
    """Softmax attention on ``[batch, seq, heads, dim]`` in jax.numpy (independent of napkin_cat)."""
    import jax.numpy as jnp

    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        s = jnp.where(jnp.tril(jnp.ones(s.shape[-2:], bool)), s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", p / p.sum(-1, keepdims=True), v)


def out_and_grads(f, q, k, v, w):
    """``f``'s output and the gradients of ``sum(w ⊙ f(q, k, v))``."""
    import jax

    out, pull = jax.vjp(f, q, k, v)
    return out, *pull(w)


def errors(got, want) -> dict:
    """Per output (out, dq, dk, dv): the largest error over the shards this process addresses."""
    names = ("out", "dq", "dk", "dv")
    return {
        n: max(float(np.max(np.abs(np.asarray(s.data) - np.asarray(w)[s.index]))) for s in g.addressable_shards)
        for n, g, w in zip(names, got, want, strict=True)
    }


def sharded_entry(rng, kind: str) -> dict:
    """``nc.attention`` under jit on global arrays sharded over a 2 × 2 mesh of ``kind`` axes (Explicit: a
    ``shard_map``; Auto: ``custom_partitioning``) that spans both processes."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    import napkin_cat as nc

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(getattr(AxisType, kind),) * 2)
    spec = NamedSharding(mesh, Spec(*BHD))
    host = rng.standard_normal((4, 4, 24, 4, 16), dtype=np.float32)  # q, k, v and the cotangent
    arrays = [jax.make_array_from_callback(h.shape, spec, lambda i, h=h: h[i]) for h in host]
    got = jax.jit(lambda *a: out_and_grads(nc.attention, *a))(*arrays)
    want = out_and_grads(lambda q, k, v: reference(q, k, v, causal=False), *host)
    return {
        "errors": errors(got, want),
        "specs": [list(g.sharding.spec) + [None] * (g.ndim - len(g.sharding.spec)) for g in got],
        "batch_blocks": sorted({(s.index[0].start, s.index[0].stop) for s in got[0].addressable_shards}),
    }


def ring_across(rng) -> dict:
    """The causal, zig-zag balanced ring over the 4 devices of both processes, on a ragged sequence."""
    import jax

    import napkin_cat as nc
    from lowering import lower_devices
    from rewrites import derive, derive_devices, ring, stream, tile, zigzag

    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
    kernel = lower_devices(derive_devices(flash, ring("q", "x", "sp", 4), zigzag(), verify=False))
    n = int(rng.integers(33, 64))  # not a multiple of the 8 chunks
    host = rng.standard_normal((4, n, 16), dtype=np.float32)
    got = jax.jit(lambda *a: out_and_grads(kernel, *a))(*host)
    as_bhd = lambda a: a[None, :, None]  # noqa: E731
    want = out_and_grads(lambda q, k, v: reference(*map(as_bhd, (q, k, v)), causal=True)[0, :, 0], *host)
    return {"errors": errors(got, want), "n": n}


def worker(process: int, port: int, seed: int) -> None:
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")  # the references in true f32
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}", num_processes=PROCESSES, process_id=process, initialization_timeout=60
    )
    rng = np.random.default_rng(seed)  # the same inputs in every process
    report = {"process": jax.process_index(), "devices": jax.device_count(), "local_devices": jax.local_device_count()}
    start = time.monotonic()
    for part, run in (("Explicit", sharded_entry), ("Auto", sharded_entry), ("ring", ring_across)):
        report[part] = run(rng, part) if run is sharded_entry else run(rng)
        print(f"process {process}: {part} done at {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    print("REPORT " + json.dumps(report), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    worker(*map(int, sys.argv[1:4]))
