"""Every head dim from 32 to 256, and MLA's 192/128, through ``nc.attention`` against cuDNN in one process (the
FP8/parity issue's head-dim target: no head dim below 0.8× the dense D = 128 kernel without the kernel saying why).

bf16, B·N = 16k tokens (N = 8192, B = 2), H = 16, causal and not. For each head dim: ``nc.attention`` as a user
calls it (``backend="auto"``: which backend each kernel runs on, and why the others refused, are recorded from the
kernel; each row prints its kernels' backends), ``backend="mosaic"`` forced where auto did not take Mosaic (to
measure what the refusal costs), and cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``; it refuses a
value head dim differing from the query's).
Each output and gradient is checked against an f32 reference written here (batch 0, two heads) before timing.
TFLOP/s: 2·B·H·N²·(D_qk + D_v) forward (halved when causal), 3.5× that forward + backward. Writes
``head_dims_<GPU>.json`` and ``.png`` under ``--out`` and prints each row with its ratio to cuDNN and to
napkin-cat's own D = 128 kernel.

    python papers/flash_attention/head_dims.py [--out DIR] [--dims 32,64,...,192/128] [--causal 0,1] [--quick]

``--quick`` runs tiny sizes on a CPU (interpret mode; cuDNN skipped): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import run_rows, save_figure, time_calls, timed  # noqa: E402

HERE = Path(__file__).resolve().parent
FWD_BWD_FACTOR = 3.5  # the backward does 2.5× the forward's matrix products (FlashAttention-2, Dao 2023, §4)
TOLERANCE = 2e-2  # bf16 relative error against the f32 reference, outputs and gradients (as mosaic_bench.py)
DIMS = "32,64,96,128,160,192,256,192/128"


def reference(q, k, v, causal: bool):
    """f32 attention of [B, N, H, D] arrays with jnp alone."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[1]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def implementations(causal: bool, gpu: bool) -> dict:
    impls = {
        "napkin auto": lambda q, k, v: nc.attention(q, k, v, is_causal=causal),
        "napkin mosaic": lambda q, k, v: nc.attention(q, k, v, is_causal=causal, backend="mosaic"),
    }
    if gpu:
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    return impls


def kernel_story(q, k, v, causal: bool, backend: str = "auto") -> dict:
    """Which backend each of the kernels runs on, and why the others were refused, as the kernel says (a backward
    that cannot be built leaves the forward's, and says why)."""
    made = nc.attention.kernel_for(q, k, v, is_causal=causal, backend=backend)
    inner = made.kernel
    try:
        backends = dict(inner.backends or {})
    except Exception:  # noqa: BLE001 - the forward still runs; why_not says why the backward does not
        backends = {"forward": inner.backend}
    return {"backends": backends, "refused": dict(inner.refused or {}), "why_not": made.why_not}


def backend_summary(story: dict) -> str:
    """The backends of a row's kernels, short: ``fwd mosaic, bwd mosaic×3`` (``bwd none`` without a backward).

    >>> backend_summary({"backends": {"forward": "mosaic", "forward with residuals": "mosaic", "Δ": "triton"}})
    'fwd mosaic, bwd triton×1'
    """
    bwd = [b for k, b in story["backends"].items() if not k.startswith("forward")]
    counts = {b: bwd.count(b) for b in dict.fromkeys(bwd)}
    shown = "+".join(f"{b}×{n}" for b, n in counts.items()) or "none"
    return f"fwd {story['backends'].get('forward')}, bwd {shown}"


def measure(f, q, k, v, ct, causal: bool, flops: float) -> dict:
    fwd = jax.jit(f)
    grad = jax.jit(lambda q, k, v, ct: jax.vjp(f, q, k, v)[1](ct))
    one = lambda a: a[:1, :, :2]  # noqa: E731
    want, pull = jax.vjp(lambda *a: reference(*a, causal), one(q), one(k), one(v))
    errors = [rel(one(fwd(q, k, v)), want)]
    row = {"max_rel_error": errors[0], "ok": errors[0] <= TOLERANCE}
    t = time_calls(fwd, q, k, v, reps=10, batches=5, warmup=2)
    row["fwd"] = {"ms": t.ms, "tflops": flops / t.seconds / 1e12}
    try:  # a forward that runs with a backward that cannot be built is still a row of the sweep
        got = grad(q, k, v, ct)
    except Exception as e:  # noqa: BLE001
        row["fwdbwd_error"] = f"{type(e).__name__}: {str(e)[:400]}"
        return row
    errors += [rel(one(g), r) for g, r in zip(got, pull(one(ct).astype(jnp.float32)), strict=True)]
    row |= {"max_rel_error": max(errors), "ok": max(errors) <= TOLERANCE}
    t = time_calls(grad, q, k, v, ct, reps=10, batches=5, warmup=2)
    row["fwdbwd"] = {"ms": t.ms, "tflops": FWD_BWD_FACTOR * flops / t.seconds / 1e12}
    return row


def run(dim: str, causal: bool, sizes: tuple, gpu: bool) -> list[dict]:
    b, h, n = sizes
    dqk, dv = (int(x) for x in dim.split("/")) if "/" in dim else (int(dim), int(dim))
    keys = jax.random.split(jax.random.key(hash((dim, causal)) % 2**31), 4)
    q, k = (jax.random.normal(kk, (b, n, h, dqk), jnp.bfloat16) for kk in keys[:2])
    v, ct = (jax.random.normal(kk, (b, n, h, dv), jnp.bfloat16) for kk in keys[2:])
    flops = 2 * b * h * n * n * (dqk + dv) / (2 if causal else 1)
    auto = None

    def work(name, f, row):
        nonlocal auto
        if name.startswith("napkin"):
            row["kernel"] = kernel_story(q, k, v, causal, name.split()[1])
            if name == "napkin mosaic" and auto is not None and set(auto["backends"].values()) == {"mosaic"}:
                return False  # auto already runs every kernel on Mosaic
            auto = row["kernel"] if name == "napkin auto" else auto
        row |= timed(measure, f, q, k, v, ct, causal, flops)

    def show(row):
        both = row.get("fwdbwd", {}).get("tflops", float("nan"))
        shown = f"fwd {row['fwd']['tflops']:6.1f}  fwd+bwd {both:6.1f} TFLOP/s  err {row['max_rel_error']:.1e}"
        shown += f"  [{backend_summary(row['kernel'])}]" if "kernel" in row else ""
        return shown + (f"  (backward: {row['fwdbwd_error']})" if "fwdbwd_error" in row else "")

    head = {"dim": dim, "causal": causal}
    return run_rows(implementations(causal, gpu), head, work, show, f"D={dim:>7s} causal={int(causal)}", 14)


def ratios(rows: list[dict]) -> None:
    """Each napkin row's ratio to cuDNN's at the same (dim, causal), and to napkin auto's at D = 128."""
    ok = {(r["dim"], r["causal"], r["impl"]): r for r in rows if "fwd" in r}  # timed, forward at least
    for r in rows:
        if "fwd" not in r or not r["impl"].startswith("napkin"):
            continue
        bases = (("cudnn", (r["dim"], r["causal"], "cudnn")), ("dense128", ("128", r["causal"], "napkin auto")))
        for base, key in bases:
            if key in ok:
                both = [s for s in ("fwd", "fwdbwd") if s in r and s in ok[key]]
                r[f"vs_{base}"] = {s: r[s]["tflops"] / ok[key][s]["tflops"] for s in both}


def plot(res: dict, path: Path) -> None:
    """Forward and forward + backward TFLOP/s per head dim, one line per implementation and causality."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    dims = list(dict.fromkeys(r["dim"] for r in res["rows"]))
    for ax, s in zip(axes, ("fwd", "fwdbwd"), strict=True):
        for impl in dict.fromkeys(r["impl"] for r in res["rows"]):
            for causal in (False, True):
                pts = [
                    (dims.index(r["dim"]), r[s]["tflops"])
                    for r in res["rows"]
                    if r["impl"] == impl and r["causal"] == causal and s in r
                ]
                if pts:
                    ax.plot(
                        *zip(*pts, strict=True),
                        marker="o",
                        ls="-" if causal else "--",
                        label=f"{impl}{' causal' if causal else ''}",
                    )
        ax.set_xticks(range(len(dims)), dims)
        ax.set_xlabel("head dim (q·k / v)")
        ax.set_title({"fwd": "forward", "fwdbwd": "forward + backward"}[s], fontsize=9)
    axes[0].set_ylabel("TFLOP/s")
    axes[1].legend(fontsize=7)
    z = res["sizes"]
    fig.suptitle(f"{res['device']['kind']}: bf16, B={z['B']} H={z['H']} N={z['N']}", fontsize=9)
    save_figure(fig, path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--dims", default=DIMS)
    p.add_argument("--causal", default="0,1")
    p.add_argument("--quick", action="store_true")
    o = p.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    sizes = (1, 2, 64) if o.quick else (2, 16, 8192)
    dev = device_info()
    res = {"device": dev, "sizes": dict(zip("BHN", sizes, strict=True)), "rows": []}
    print(f"{dev['kind']}: bf16, B={sizes[0]} H={sizes[1]} N={sizes[2]}", flush=True)
    for dim in o.dims.split(","):
        for causal in (bool(int(c)) for c in o.causal.split(",")):
            res["rows"] += run(dim, causal, sizes, gpu)
    ratios(res["rows"])
    for r in res["rows"]:
        if "vs_cudnn" in r or "vs_dense128" in r:
            shown = "  ".join(
                f"{b} {v['fwd']:.2f}×/{v.get('fwdbwd', float('nan')):.2f}×"
                for b, v in (("cuDNN", r.get("vs_cudnn")), ("D=128", r.get("vs_dense128")))
                if v
            )
            print(f"D={r['dim']:>7s} causal={int(r['causal'])} {r['impl']:14s} fwd/fwd+bwd vs {shown}")
    stem = f"head_dims_{device_stem(dev['kind'])}{'_quick' if o.quick else ''}"
    o.out.mkdir(parents=True, exist_ok=True)
    (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    plot(res, o.out / f"{stem}.png")
    return res


if __name__ == "__main__":
    main()
