"""Sequence parallelism past one GPU (issues 15, 30): ring, all-gather and Ulysses against the best one-GPU kernel.

Causal bf16 attention, D = 128, B = 1, H = 8, N from 128k doubling, on ``--devices`` GPUs, for each
``--strategy``: the ring (``rewrites.ring`` + ``zigzag``, K/V chunks by ``lax.ppermute``), the all-gather (the same
with ``exchange="all_gather"``) and Ulysses (``rewrites.ulysses``: all-to-alls over the heads), each lowered by
``lowering.lower_devices`` with the per-device kernels the backend registry picks (Mosaic on Hopper); the one-GPU
baseline is ``nc.attention`` (``[b, seq, h, d]``) on one of the same GPUs, up to the longest N it holds. Each is
checked against the baseline at a small N (relative error ≤ 1e-2) before timing; each time is the median over
batches of back-to-back calls, forward and forward+backward. Every strategy gets its inputs in its own layout
before timing: sharded over the mesh (not scattered from one GPU inside each call) and, under zig-zag, in the
devices' chunk order (``DeviceKernel.in_device_order``: a model permutes its tokens once; the plain call would
also move half of Q, K, V and O between devices every call). The transfers alone (each strategy's collectives
with no compute) are timed beside ``nc.mesh_cost``'s prediction, with NVLink's datasheet link and with the link
fitted (``nc.fit_link``) to single ``ppermute`` transfers and all-gathers (its ``fanout``) of other sizes;
``nc.choose_strategy`` (fitted) names the strategy it picks at each N, next to the fastest measured. XLA's
latency-hiding scheduler is on (:data:`HIDING`), so the ring's transfers can overlap its kernels. Each strategy's
per-device kernels, forward and backward (the ring's pair kernels by kind), are logged with their backend and why
``backend="auto"`` kept any off Mosaic (``DeviceKernel.refused``), and recorded in the JSON. Writes
``results/ring_attention_<GPU>.json`` and ``.png``.

    python papers/flash_attention/ring_attention.py [--devices 4] [--strategy all] [--max-n 1048576] [--out DIR]
    python papers/flash_attention/ring_attention.py --ns 131072,524288   # these lengths only
    python papers/flash_attention/ring_attention.py --smoke   # CPU: tiny sizes on 4 forced host devices
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`
SMOKE = "--smoke" in sys.argv or "--quick" in sys.argv
if SMOKE and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # before jax starts: the smoke run uses 4 host devices (CPU)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
#: XLA's latency-hiding scheduler, which moves a collective's start before the kernels that do not read it: without
#: it XLA:GPU issues each ppermute next to its use and the ring's transfers do not overlap its kernels (JAX's GPU
#: performance tips and NVIDIA's JAX images set it); ``--no-latency-hiding`` measures without it
HIDING = "--xla_gpu_enable_latency_hiding_scheduler=true"
HIDDEN = "--no-latency-hiding" not in sys.argv and "latency_hiding_scheduler" not in os.environ.get("XLA_FLAGS", "")
if not SMOKE and HIDDEN:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {HIDING}".strip()

import argparse  # noqa: E402 - after the device flag
import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as Spec  # noqa: E402

import napkin_cat as nc  # noqa: E402
from lowering import lower_devices  # noqa: E402
from lowering._attention import schedule  # noqa: E402
from napkin_cat.errors import CostError  # noqa: E402
from napkin_cat.hardware import NVLINK4, System, for_device  # noqa: E402
from papers.flash_attention.timing import once, time_calls  # noqa: E402
from rewrites import derive, derive_devices, ring, stream, tile, ulysses, zigzag  # noqa: E402
from rewrites._verify import FAST_COMPILE  # noqa: E402

HERE = Path(__file__).parent
HEADS, D, CHECK_N, TOLERANCE = 8, 128, 4096, 1e-2
SETS = 4  # independent sets of arrays per call in per_exchange
SMOKE_SIZES = {"heads": 4, "d": 16, "ns": [64], "check_n": 64, "tile": (16, 16), "dtype": "f32", "devices": 4}
STRATEGIES = ("ring", "all_gather", "ulysses")


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def scheduled(d: int, dtype: str, g: int, s: int):
    b, h, q, x, dd = nc.axes("b h q x d", d=d)
    attn = nc.library.multi_head_attention(h, q, x, dd, batch=(b,), causal=True, dtype=dtype)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def rules(strategy: str, devices: int) -> list:
    """The device-level rules of ``strategy`` over mesh axis ``sp``."""
    if strategy == "ulysses":
        return [ulysses("q", "x", "h", "sp", devices)]
    return [ring("q", "x", "sp", devices, exchange="ppermute" if strategy == "ring" else "all_gather"), zigzag()]


def report(name: str, kernel, logged: frozenset = frozenset()) -> frozenset:
    """Log the backend of each per-device kernel of ``kernel`` (a ``DeviceKernel``) not in ``logged``, forward and
    backward (the ring's pair kernels by kind, Ulysses' kernel by role), and why ``backend="auto"`` kept any off
    the backends before its own (Mosaic); returns every role logged."""
    backends, refused = kernel.backends, kernel.refused
    for role, backend in backends.items():
        if role not in logged:
            why = f" (kept off the backends before it: {refused[role]})" if role in refused else ""
            log(f"{name}: {role}: {backend}{why}")
    return frozenset(backends)


def flops(n: int, heads: int, d: int, backward: bool) -> float:
    """Causal attention FLOPs: half of 4·N²·D per head; forward+backward 7/2 of the forward."""
    return 2 * n * n * d * heads * (3.5 if backward else 1.0)


def inputs(n: int, heads: int, d: int, dtype, seed: int):
    """Q, K, V and a cotangent, ``[b, h, n, d]`` (the partitioned kernels' layout)."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (1, heads, n, d), dtype) for k in keys]


def placed(kernel, mesh: Mesh, *xs) -> list:
    """``[b, h, n, d]`` arrays in ``kernel``'s own layout: the sequence in its devices' chunk order
    (``device_order``; the identity but under zig-zag) and sharded over ``sp``, ready before any timing."""
    return [sharded(mesh, kernel.device_order(x, 2)) for x in xs]


def seq_major(*xs):
    """``[b, h, n, d]`` → ``[b, n, h, d]``: ``nc.attention``'s layout (done before timing)."""
    return [jnp.swapaxes(x, 1, 2) for x in xs]


def compiled(fn) -> dict:
    """``fn`` jitted forward, and its gradient against a given output cotangent, each jitted once."""

    def loss(q, k, v, do):
        return jnp.sum(fn(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    # on CPU (interpreted kernels, --smoke) compiling fast beats running fast, as in derive's checks
    options = FAST_COMPILE if jax.devices()[0].platform == "cpu" else None
    jit = functools.partial(jax.jit, compiler_options=options)
    return {False: jit(fn), True: jit(jax.grad(loss, argnums=(0, 1, 2)))}


def back_to_back(reps: int) -> int:
    """Calls per timed batch: ``reps``, but one on CPU host devices, where several sharded calls in flight at
    once can deadlock in a collective (XLA's CPU devices share one thread pool: --smoke on two cores)."""
    return 1 if jax.devices()[0].platform == "cpu" else reps


def timed(fns: dict, args, backward: bool) -> float:
    """Seconds per call: after a compiling call, three single calls when one takes over 0.5 s (long sequences),
    else the median over batches of back-to-back calls of about 0.2 s each. Wall clock: a strategy runs on
    several devices, whose kernel times CUPTI would add up."""
    f, args = fns[backward], args if backward else args[:3]
    jax.block_until_ready(f(*args))
    _, first, _ = once(f, *args)
    if first > 0.5:
        return float(np.median([first, *time_calls(f, *args, reps=1, batches=2, warmup=0, method="wall").samples]))
    return time_calls(f, *args, reps=back_to_back(max(1, int(0.2 / first))), batches=3, warmup=0,
                      method="wall").seconds


def transfers(strategy: str, mesh: Mesh, devices: int, sets: int = 1):
    """The forward's collectives of ``strategy`` alone, on ``[b, h, n, d]`` arrays sharded over ``n``: the ring's
    P − 1 ``ppermute`` steps of K and V, the all-gather of K and V, Ulysses' four all-to-alls (Q, K, V in, O out);
    ``sets`` times, on independent sets of three arrays (:func:`per_exchange`)."""
    pairs = [(j, (j + 1) % devices) for j in range(devices)]

    def ring_steps(q, k, v):
        for _ in range(devices - 1):
            k, v = jax.lax.ppermute(k, "sp", pairs), jax.lax.ppermute(v, "sp", pairs)
        return k, v

    def gather(q, k, v):
        return tuple(jax.lax.all_gather(a, "sp", axis=2, tiled=True) for a in (k, v))

    def all_to_all(q, k, v):
        heads = [jax.lax.all_to_all(a, "sp", 1, 2, tiled=True) for a in (q, k, v)]
        return jax.lax.all_to_all(heads[0] + heads[1], "sp", 2, 1, tiled=True), heads[2]

    body = {"ring": ring_steps, "all_gather": gather, "ulysses": all_to_all}[strategy]
    spec = Spec(None, None, "sp")
    out = (spec, Spec()) if strategy == "all_gather" else (spec, spec if strategy == "ring" else Spec(None, "sp"))

    def each(*arrays):
        return tuple(body(*arrays[i : i + 3]) for i in range(0, len(arrays), 3))

    return jax.jit(jax.shard_map(each, mesh=mesh, in_specs=(spec,) * 3 * sets, out_specs=(out,) * sets,
                                 check_vma=False))


def per_exchange(make, *arrays) -> tuple[float, float]:
    """Seconds one exchange takes, and the fixed cost of a call: ``make(sets)`` (the exchange on ``sets``
    independent sets of ``arrays``, one call) timed at 1 and ``SETS`` sets (wall clock, back-to-back calls); the
    difference over ``SETS − 1`` is one set's transfer time without the call's dispatch and synchronisation."""
    one = time_calls(make(1), *arrays, reps=back_to_back(5), batches=3, warmup=1, method="wall").seconds
    extra = [a + i for i in range(1, SETS) for a in arrays]
    many = time_calls(make(SETS), *arrays, *extra, reps=back_to_back(5), batches=3, warmup=1, method="wall").seconds
    each = max((many - one) / (SETS - 1), 0.0)
    return each, one - each


def sharded(mesh: Mesh, x):
    """``x`` (``[b, h, n, d]``) sharded over ``sp`` before timing: an array on one GPU would be scattered to the
    mesh inside every timed call, its transfers counted as the exchange's."""
    return jax.block_until_ready(jax.device_put(x, NamedSharding(mesh, Spec(None, None, "sp"))))


def fitted_link(mesh: Mesh, heads: int, d: int, dtype, devices: int, n: int):
    """The link fitted (``nc.fit_link``) to one ``ppermute`` of a K chunk at N/2, N and 2N (not the messages the
    predictions are checked at: the ring sends K and V, the all-gather gathers both), and its ``fanout`` to one
    all-gather of the same chunks (the bytes each device takes in from all its peers at once), each timed as
    :func:`per_exchange` (the call's fixed cost taken out)."""
    pairs = [(j, (j + 1) % devices) for j in range(devices)]
    spec = Spec(None, None, "sp")
    steps = {
        "ppermute": (lambda k: jax.lax.ppermute(k, "sp", pairs), spec),
        "all_gather": (lambda k: jax.lax.all_gather(k, "sp", axis=2, tiled=True), Spec()),
    }

    def make(exchange, sets):
        step, out = steps[exchange]
        body = lambda *ks: tuple(step(k) for k in ks)  # noqa: E731
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * sets, out_specs=(out,) * sets,
                                     check_vma=False))  # the gathered chunks are alike on every device

    measured = {"ppermute": [], "all_gather": []}
    for m in (max(devices, n // 2), max(devices, n), max(devices, 2 * n)):
        k = sharded(mesh, jnp.ones((1, heads, m, d), dtype))
        chunk = k.size // devices * k.dtype.itemsize
        for exchange, into in (("ppermute", chunk), ("all_gather", (devices - 1) * chunk)):
            measured[exchange].append((into, per_exchange(functools.partial(make, exchange), k)[0]))
    link = nc.fit_link(measured["ppermute"], "fitted ppermute + all-gather", fanout=measured["all_gather"])
    return link, measured


def check(fns: dict, kernels: dict, mesh: Mesh, baseline: dict, n: int, heads: int, d: int, dtype) -> dict:
    """Each strategy's output (in its own layout, put back in sequence order) against the one-GPU kernel's at
    ``n``: the max relative error."""
    q, k, v, _ = inputs(n, heads, d, dtype, 1)
    want = np.asarray(jnp.swapaxes(baseline[False](*seq_major(q, k, v)), 1, 2), np.float32)
    errors = {}
    for name, f in fns.items():
        kernel = kernels[name]
        got = np.asarray(kernel.sequence_order(f[False](*placed(kernel, mesh, q, k, v)), 2), np.float32)
        errors[name] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        log(f"check at N = {n}: {name} vs one GPU, relative error {errors[name]:.1e}")
        if errors[name] > TOLERANCE:
            raise SystemExit(f"{name} differs from the one-GPU kernel: {errors[name]:.1e} > {TOLERANCE}")
    return errors


def sweep(n: int, fns: dict, layouts: dict, alive: dict, heads: int, d: int, dtype) -> list:
    """Forward and forward+backward times of every configuration at ``n``, each given its inputs by
    ``layouts[label]`` before timing; out of memory ends a sweep."""
    args_n = inputs(n, heads, d, dtype, n)
    rows = []
    for label, f in fns.items():
        for backward in (False, True):
            if not alive[label]:
                continue
            row = {"n": n, "strategy": label, "backward": backward}
            try:
                t = timed(f, layouts[label](*args_n), backward)
                row |= {"seconds": t, "tflops": flops(n, heads, d, backward) / t / 1e12}
                log(f"N={n:>8} {label:11} {'fwd+bwd' if backward else 'fwd':7} {t * 1e3:9.2f} ms "
                    f"{row['tflops']:7.1f} TFLOP/s")
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                log(f"N={n:>8} {label}: {row['error']}")
                if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                    raise
                alive[label] = False
            rows.append(row)
    return rows


def communication(n, strategies, mesh, systems, heads, d, dtype_name, dtype, devices) -> list:
    """Each strategy's transfers alone, measured on arrays sharded over the mesh, beside ``mesh_cost``'s forward
    transfer time per system."""
    b, h, qq, x, dd = nc.axes("b h q x d", d=d)
    attn = nc.library.multi_head_attention(h, qq, x, dd, batch=(b,), causal=True, dtype=dtype_name)
    exchange = {"ring": "ppermute", "all_gather": "all_gather", "ulysses": "all_to_all"}
    q = sharded(mesh, jnp.ones((1, heads, n, d), dtype))
    rows = []
    for name in strategies:
        seconds, fixed = per_exchange(functools.partial(transfers, name, mesh, devices), q, q, q)
        row = {"n": n, "strategy": name, "comm_measured": seconds, "call_fixed_cost": fixed}
        for label, system in systems.items():
            c = nc.mesh_cost(attn, system, queries="q", keys="x", exchange=exchange[name], heads="h", balanced=True)
            row[f"comm_predicted_{label}"] = float(c.subs(b=1, h=heads, q=n, x=n).transfer_time)
        rows.append(row)
        said = ", ".join(f"{k[len('comm_predicted_'):]} {v * 1e3:.3f}" for k, v in row.items() if "predicted" in k)
        log(f"N={n:>8} {name:10} transfers alone {seconds * 1e3:.3f} ms (+ {fixed * 1e3:.3f} ms a call); predicted ms: "
            f"{said or 'n/a'}")
    return rows


def run(args) -> Path:
    smoke = args.smoke
    cfg = SMOKE_SIZES if smoke else {}
    heads, d = cfg.get("heads", args.heads), cfg.get("d", D)
    dtype_name = cfg.get("dtype", "bf16")
    dtype = jnp.float32 if dtype_name == "f32" else jnp.bfloat16
    devices = cfg.get("devices", args.devices)
    ns = cfg.get("ns") or args.ns or [131072 * 2**i for i in range(8) if 131072 * 2**i <= args.max_n]
    # the blocks nc.attention takes on one GPU (on Hopper Mosaic's own), at the shortest chunk a device holds:
    # 'auto' lowers the per-device kernels on Mosaic only at blocks it was measured faster at
    chunk = ns[0] // (2 * devices)
    g, s = cfg.get("tile") or schedule(chunk, chunk, d, mosaic=jax.devices()[0].platform == "gpu")
    strategies = STRATEGIES if args.strategy == "all" else (args.strategy,)
    kind = jax.devices()[0].device_kind
    gpu = "cpu" if jax.devices()[0].platform == "cpu" else kind.replace(" ", "_")
    log(f"{kind}: {jax.device_count()} devices, {', '.join(strategies)} over {devices}; N = {ns}; H = {heads}, "
        f"D = {d}, {dtype_name}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if jax.device_count() < devices:
        raise SystemExit(f"needs {devices} devices, jax sees {jax.device_count()}")
    flash = scheduled(d, dtype_name, g, s)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("sp",))
    fns, kernels, logged = {}, {}, {}
    for name in strategies:
        derivation = derive_devices(flash, *rules(name, devices), seed=0, sizes={"b": 1, "h": devices})
        log(f"{name}: device-level steps verified:", *(str(st) for st in derivation.steps[1:]))
        kernels[name] = lower_devices(derivation, mesh)
        fns[name] = compiled(kernels[name].in_device_order)
        logged[name] = report(name, kernels[name])
    baseline = compiled(functools.partial(nc.attention, is_causal=True))
    errors = check(fns, kernels, mesh, baseline, cfg.get("check_n", CHECK_N), heads, d, dtype)
    layouts = {"one GPU": seq_major} | {name: functools.partial(placed, kernels[name], mesh) for name in strategies}
    hw = for_device(kind)
    datasheet = {"nvlink_datasheet": System(hw, devices, NVLINK4)} if hw is not None else {}
    links = {}  # per N: the link fitted to transfers of other sizes near that N (NCCL's rate grows with the message)
    rows, alive = [], {"one GPU": True} | dict.fromkeys(strategies, True)
    for n in ns:
        timed_n = sweep(n, {"one GPU": baseline} | fns, layouts, alive, heads, d, dtype)
        one = {r["backward"]: r["seconds"] for r in timed_n if r["strategy"] == "one GPU" and "seconds" in r}
        for r in timed_n:
            if r["strategy"] != "one GPU" and "seconds" in r and r["backward"] in one:
                r["speedup"] = one[r["backward"]] / r["seconds"]
                what = "fwd+bwd" if r["backward"] else "fwd"
                log(f"N={n:>8} {r['strategy']:11} {what:7} {r['speedup']:.2f}× one GPU")
        rows += timed_n
        try:
            link, calibration = fitted_link(mesh, heads, d, dtype, devices, n)
            log(f"N={n:>8} fitted link: {link.bandwidth / 1e9:.1f} GB/s to one peer, "
                f"{link.collective_bandwidth / 1e9:.1f} GB/s from all peers at once, {link.latency * 1e6:.1f} µs, "
                f"from {calibration}")
        except CostError as e:  # timings too noisy to fit (tiny transfers on CPU): predictions with the datasheet only
            link, calibration = None, str(e)
            log(f"N={n:>8} no fitted link: {e}")
        links[n] = {"bandwidth": link and link.bandwidth, "fanout": link and link.fanout,
                    "latency": link and link.latency, "from": calibration}
        systems = dict(datasheet)
        if datasheet and link is not None:
            systems["fitted"] = replace(datasheet["nvlink_datasheet"], link=link)
        rows += communication(n, strategies, mesh, systems, heads, d, dtype_name, dtype, devices)
        if "fitted" in systems:
            b, h, qq, x, dd = nc.axes("b h q x d", d=d)
            attn = nc.library.multi_head_attention(h, qq, x, dd, batch=(b,), causal=True, dtype=dtype_name)
            choice = nc.choose_strategy(attn, systems["fitted"], {"b": 1, "h": heads, "q": n, "x": n}, queries="q",
                                        keys="x", heads="h", balanced=True, backward=True)
            timed_ = [r for r in rows if r.get("n") == n and r.get("backward") and "seconds" in r
                      and r["strategy"] in strategies]
            fastest = min(timed_, key=lambda r: r["seconds"])["strategy"] if timed_ else None
            rows.append({"n": n, "model_picks": choice.strategy, "why": choice.why, "fastest_measured": fastest})
            log(f"N={n:>8} the model picks {choice}; fastest measured: {fastest}")
    for name, kernel in kernels.items():  # after the runs: any shape a kernel left to another backend
        report(name, kernel, logged[name])
    backends = {name: k.backends for name, k in kernels.items()}
    refused = {name: k.refused for name, k in kernels.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ring_attention_{gpu}{'_smoke' if smoke else ''}.json"
    meta = {
        "gpu": kind, "devices": devices, "heads": heads, "d": d, "dtype": dtype_name, "causal": True, "tile": [g, s],
        "jax": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""), "check_errors": errors,
        "backends": backends, "refused": refused,
        "baseline": "nc.attention, one GPU", "inputs": "each strategy's own layout, sharded (in_device_order)",
        "fitted_link": links,
    }
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, meta, path.with_suffix(".png"))
    log(f"wrote {path} and {path.with_suffix('.png').name}")
    return path


def plot(rows, meta, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for name in dict.fromkeys(r["strategy"] for r in rows if "tflops" in r):
        for backward, style in ((False, "-"), (True, "--")):
            pts = [(r["n"], r["tflops"]) for r in rows
                   if r.get("strategy") == name and r.get("backward") == backward and "tflops" in r]
            if pts:
                ax.plot(*zip(*pts, strict=True), style, marker="o", label=f"{name}, {'fwd+bwd' if backward else 'fwd'}")
    for name in dict.fromkeys(r["strategy"] for r in rows if "comm_measured" in r):
        mine = [r for r in rows if r.get("strategy") == name and "comm_measured" in r]
        bx.plot([r["n"] for r in mine], [r["comm_measured"] * 1e3 for r in mine], "-o", label=f"{name} measured")
        if mine and "comm_predicted_fitted" in mine[0]:
            bx.plot([r["n"] for r in mine], [r["comm_predicted_fitted"] * 1e3 for r in mine], ":x",
                    label=f"{name} predicted (fitted link)")
    for a, label in ((ax, "TFLOP/s (all devices)"), (bx, "transfers alone, ms")):
        a.set_xscale("log", base=2)
        a.set_xlabel("sequence length N")
        a.set_ylabel(label)
        a.legend(fontsize=7)
    fig.suptitle(f"napkin-cat sequence parallelism over {meta['devices']}, causal {meta['dtype']}, D={meta['d']}, "
                 f"H={meta['heads']} — {meta['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> Path:
    """Parse ``argv`` and run; returns the JSON path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--strategy", choices=[*STRATEGIES, "all"], default="all")
    p.add_argument("--max-n", type=int, default=2**20)
    p.add_argument("--ns", type=lambda v: [int(n) for n in v.split(",")], default=None,
                   help="the sequence lengths, comma-separated (instead of 128k doubling up to --max-n)")
    p.add_argument("--heads", type=int, default=HEADS, help="more heads reach one GPU's memory at a shorter N")
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--smoke", "--quick", action="store_true", help="tiny sizes on 4 host devices (CPU)")
    p.add_argument("--no-latency-hiding", action="store_true",
                   help=f"leave out {HIDING} (read before jax starts; see HIDING)")
    return run(p.parse_args(argv))


if __name__ == "__main__":
    main()
