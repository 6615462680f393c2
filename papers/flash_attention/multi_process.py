"""``nc.attention`` on a mesh that spans processes: one process per host under ``jax.distributed``.

Every process runs this same program (SPMD across hosts). ``jax.distributed.initialize`` joins them; the mesh is
then global (``jax.devices()`` lists every host's devices, ``jax.local_devices()`` this one's); each process builds
the global arrays from the rows it holds (``jax.make_array_from_process_local_data``), and the same jitted
``nc.attention`` call runs per shard on every device: batch over "data" (across hosts), heads over "model" (within
a host, where the links are fast). Each process checks the output rows it holds, and their gradients, against
``jax.nn.dot_product_attention`` on its own rows.

On one machine, with no arguments, it starts two such processes itself, each with two CPU devices and a
coordinator on localhost::

    PYTHONPATH=. python papers/flash_attention/multi_process.py

On N hosts, run on every host, host 0's address as the coordinator (in a program of your own under SLURM or
Kubernetes, ``jax.distributed.initialize()`` with no arguments reads all three from the environment)::

    python papers/flash_attention/multi_process.py --coordinator host0:1234 --processes N --process-id i \\
        --seq 4096 --heads 16 --dim 128 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", help="host:port of process 0; without it, launch --processes locally on CPU")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--process-id", type=int)
    p.add_argument("--local-cpu-devices", type=int, default=2, help="CPU devices per process when launched locally")
    p.add_argument("--model", type=int, default=2, help="devices splitting the heads (within a host)")
    p.add_argument("--rows", type=int, default=2, help="batch rows each process holds")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> None:
    """One process's part: join the others, build the global mesh and arrays, call ``nc.attention``, check."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as Spec

    import napkin_cat as nc

    jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id)
    me = jax.process_index()
    mesh = jax.make_mesh((jax.device_count() // args.model, args.model), ("data", "model"), (AxisType.Explicit,) * 2)
    sharding = NamedSharding(mesh, Spec("data", None, "model", None))  # [batch, seq, heads, dim]

    # this process's rows (a data loader would read them); seeded by the process so the hosts' rows differ
    shape = (args.rows, args.seq, args.heads, args.dim)
    local = jax.random.normal(jax.random.key(me), (4, *shape), args.dtype)
    q, k, v, w = (jax.make_array_from_process_local_data(sharding, x) for x in local)

    def out_and_grads(q, k, v, w, attention):
        out, pull = jax.vjp(lambda q, k, v: attention(q, k, v, is_causal=True), q, k, v)
        return out, *pull(w)

    got = jax.jit(out_and_grads, static_argnums=4)(q, k, v, w, nc.attention)
    want = out_and_grads(*local, jax.nn.dot_product_attention)  # on this process's rows alone
    first = min(s.index[0].start for s in got[0].addressable_shards)  # this process's first row, globally

    def error(shard, local):  # a shard against the same block of this process's rows
        rows = slice(shard.index[0].start - first, shard.index[0].stop - first)
        return float(jnp.max(jnp.abs(shard.data.astype(jnp.float32) - local[rows, *shard.index[1:]])))

    err = max(error(s, r.astype(jnp.float32)) for g, r in zip(got, want, strict=True) for s in g.addressable_shards)
    print(
        f"process {me}/{jax.process_count()}: {jax.local_device_count()} of {jax.device_count()} devices, mesh "
        f"{dict(mesh.shape)}, output {jax.typeof(got[0]).sharding.spec} of {got[0].shape}; its rows from "
        f"{first}: output and gradients within {err:.1e} of jax.nn.dot_product_attention",
        flush=True,
    )
    jax.distributed.shutdown()


def launch(args: argparse.Namespace) -> int:
    """Start ``args.processes`` copies of this script on this machine, on CPU devices, and wait for them."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.local_cpu_devices}",
    }
    common = [a for a in sys.argv[1:] if not a.startswith("--process")]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                *common,
                f"--coordinator=localhost:{port}",
                f"--processes={args.processes}",
                f"--process-id={i}",
            ],
            env=env,
        )
        for i in range(args.processes)
    ]
    try:
        return max(p.wait(timeout=600) for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.coordinator is None:
        sys.exit(launch(arguments))
    run(arguments)
