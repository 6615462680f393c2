"""Ring attention past one GPU (issue 15): napkin-cat's sequence partition over devices against one GPU.

Causal bf16 attention, D = 128, B = 1, H = 8, N from 128k doubling: forward and forward+backward on
``--devices`` GPUs (``rewrites.ring`` + ``zigzag``, lowered by ``lowering.lower_devices``: the per-device
Triton kernels, K/V chunks passed by ``lax.ppermute``), and on one GPU (``lowering.lower`` of the same
schedule) up to the longest N it holds. Before timing, the ring's output is checked against the one-GPU
kernel at a small N (relative error ≤ 1e-2). Each time is the median over batches of back-to-back calls.
The cost functor's communication time (``nc.mesh_cost``: latency + bytes/bandwidth per ring
step) is recorded beside the measured time of the same ``ppermute`` steps alone. Writes
``results/ring_attention_<GPU>.json`` and ``.png``.

    python papers/flash_attention/ring_attention.py [--devices 2] [--max-n 1048576] [--heads 8] [--out DIR]
    python papers/flash_attention/ring_attention.py --quick   # CPU: tiny sizes on 4 forced host devices
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`
if "--quick" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # before jax starts: the quick path runs on 4 host devices (CPU)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import argparse  # noqa: E402 - after the device flag
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as Spec  # noqa: E402

import napkin_cat as nc  # noqa: E402
from lowering import lower, lower_devices  # noqa: E402
from napkin_cat.hardware import NVLINK4, System, for_device  # noqa: E402
from papers.flash_attention.timing import once, time_calls  # noqa: E402
from rewrites import derive, derive_devices, ring, stream, tile, zigzag  # noqa: E402
from rewrites._verify import FAST_COMPILE  # noqa: E402

HERE = Path(__file__).parent
HEADS, D, CHECK_N, TOLERANCE = 8, 128, 4096, 1e-2
QUICK = {"heads": 2, "d": 16, "ns": [64], "check_n": 64, "tile": (16, 16), "dtype": "f32", "devices": 4}


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def scheduled(d: int, dtype: str, g: int, s: int):
    b, h, q, x, dd = nc.axes("b h q x d", d=d)
    attn = nc.library.multi_head_attention(h, q, x, dd, batch=(b,), causal=True, dtype=dtype)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def flops(n: int, heads: int, d: int, backward: bool) -> float:
    """Causal attention FLOPs: half of 4·N²·D per head; forward+backward 7/2 of the forward."""
    return 2 * n * n * d * heads * (3.5 if backward else 1.0)


def inputs(n: int, heads: int, d: int, dtype, seed: int):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (1, heads, n, d), dtype) for k in keys]


def compiled(fn) -> dict:
    """``fn`` jitted forward, and its gradient against a given output cotangent, each jitted once."""

    def loss(q, k, v, do):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    # on CPU (interpreted kernels, --quick) compiling fast beats running fast, as in derive's checks
    options = FAST_COMPILE if jax.devices()[0].platform == "cpu" else None
    jit = functools.partial(jax.jit, compiler_options=options)
    return {False: jit(fn), True: jit(jax.grad(loss, argnums=(0, 1, 2)))}


def timed(fns: dict, args, backward: bool) -> float:
    """Seconds per call: after a compiling call, three single calls when one takes over 0.5 s (long sequences),
    else the median over batches of back-to-back calls of about 0.2 s each. Wall clock: the ring runs on
    several devices, whose kernel times CUPTI would add up."""
    f, args = fns[backward], args if backward else args[:3]
    jax.block_until_ready(f(*args))
    _, first, _ = once(f, *args)
    if first > 0.5:
        return float(np.median([first, *time_calls(f, *args, reps=1, batches=2, warmup=0, method="wall").samples]))
    return time_calls(f, *args, reps=max(1, int(0.2 / first)), batches=3, warmup=0, method="wall").seconds


def measured_comm(mesh: Mesh, n: int, heads: int, d: int, dtype, devices: int) -> float:
    """Seconds for the ring's P − 1 ``ppermute`` steps of one K and one V chunk (``n/P`` rows each), alone."""
    pairs = [(j, (j + 1) % devices) for j in range(devices)]

    def steps(k, v):
        for _ in range(devices - 1):
            k, v = jax.lax.ppermute(k, "sp", pairs), jax.lax.ppermute(v, "sp", pairs)
        return k, v

    f = jax.jit(jax.shard_map(steps, mesh=mesh, in_specs=Spec(None, None, "sp"), out_specs=Spec(None, None, "sp")))
    k = jnp.ones((1, heads, n, d), dtype)
    return time_calls(f, k, k, reps=5, batches=3, warmup=1, method="wall").seconds


def run(args) -> Path:
    quick = args.quick
    cfg = QUICK if quick else {}
    heads, d = cfg.get("heads", args.heads), cfg.get("d", D)
    dtype_name = cfg.get("dtype", "bf16")
    dtype = jnp.float32 if dtype_name == "f32" else jnp.bfloat16
    devices = cfg.get("devices", args.devices)
    g, s = cfg.get("tile", (128, 64))
    ns = cfg.get("ns") or [131072 * 2**i for i in range(8) if 131072 * 2**i <= args.max_n]
    kind = jax.devices()[0].device_kind
    gpu = "cpu" if jax.devices()[0].platform == "cpu" else kind.replace(" ", "_")
    log(f"{kind}: {jax.device_count()} devices, ring over {devices}; N = {ns}; H = {heads}, D = {d}, {dtype_name}")
    if jax.device_count() < devices:
        raise SystemExit(f"needs {devices} devices, jax sees {jax.device_count()}")
    flash = scheduled(d, dtype_name, g, s)
    single = lower(flash)
    derivation = derive_devices(flash, ring("q", "x", "sp", devices), zigzag(), seed=0, sizes={"b": 1, "h": 2})
    log("device-level steps verified:", *(str(st) for st in derivation.steps[1:]))
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    ringed = lower_devices(derivation, mesh)
    check_n = cfg.get("check_n", CHECK_N)
    q, k, v, _ = inputs(check_n, heads, d, dtype, 1)
    fns = {"1": compiled(single), str(devices): compiled(ringed)}
    want = np.asarray(fns["1"][False](q, k, v), np.float32)
    got = np.asarray(fns[str(devices)][False](q, k, v), np.float32)
    err = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    log(f"check at N = {check_n}: ring vs one GPU, relative error {err:.1e}")
    if err > TOLERANCE:
        raise SystemExit(f"ring attention differs from the one-GPU kernel: {err:.1e} > {TOLERANCE}")
    hw = for_device(kind)
    system = System(hw, devices, NVLINK4) if hw is not None else None
    rows, alive = [], {"1": True, str(devices): True}
    for n in ns:
        args_n = inputs(n, heads, d, dtype, n)
        for label in fns:
            for backward in (False, True):
                if not alive[label]:
                    continue
                row = {"n": n, "devices": int(label), "backward": backward}
                try:
                    t = timed(fns[label], args_n, backward)
                    row |= {"seconds": t, "tflops": flops(n, heads, d, backward) / t / 1e12}
                    log(
                        f"N={n:>8} {label} device(s) {'fwd+bwd' if backward else 'fwd':7} {t * 1e3:9.2f} ms "
                        f"{row['tflops']:7.1f} TFLOP/s"
                    )
                except Exception as e:  # out of memory ends that configuration's sweep
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    log(f"N={n:>8} {label} device(s): {row['error']}")
                    if "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower():
                        alive[label] = False
                    else:
                        raise
                rows.append(row)
        if system is not None:
            b, h, qq, x, dd = nc.axes("b h q x d", d=d)
            attn = nc.library.multi_head_attention(h, qq, x, dd, batch=(b,), causal=True, dtype=dtype_name)
            cost = nc.mesh_cost(attn, system, queries="q", keys="x", balanced=True).subs(b=1, h=heads, q=n, x=n)
            predicted = float(cost.step_time) * (devices - 1)
        else:
            predicted = None
        comm = measured_comm(mesh, n, heads, d, dtype, devices)
        rows.append({"n": n, "comm_measured": comm, "comm_predicted": predicted})
        log(
            f"N={n:>8} ring transfers alone {comm * 1e3:.3f} ms; predicted "
            f"{'n/a (no hardware model)' if predicted is None else f'{predicted * 1e3:.3f} ms'}"
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ring_attention_{gpu}{'_quick' if quick else ''}.json"
    meta = {
        "gpu": kind,
        "devices": devices,
        "heads": heads,
        "d": d,
        "dtype": dtype_name,
        "causal": True,
        "tile": [g, s],
        "jax": jax.__version__,
        "check_error": err,
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return path


def plot(rows, meta, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for devices in sorted({r["devices"] for r in rows if "devices" in r}):
        for backward, style in ((False, "-"), (True, "--")):
            pts = [
                (r["n"], r["tflops"])
                for r in rows
                if r.get("devices") == devices and r.get("backward") == backward and "tflops" in r
            ]
            if pts:
                ax.plot(
                    *zip(*pts, strict=True),
                    style,
                    marker="o",
                    label=f"{devices} device{'s' if devices > 1 else ''}, {'fwd+bwd' if backward else 'fwd'}",
                )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("TFLOP/s (all devices)")
    ax.set_title(f"napkin-cat ring attention, causal {meta['dtype']}, D={meta['d']}, H={meta['heads']} — {meta['gpu']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> Path:
    """Parse ``argv`` and run; returns the JSON path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--max-n", type=int, default=2**20)
    p.add_argument("--heads", type=int, default=HEADS, help="more heads reach one GPU's memory at a shorter N")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--quick", action="store_true", help="tiny sizes on 4 host devices (CPU)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
