"""The cost functor against the hardware counters: predicted vs ncu-measured bytes and time, per lowered kernel.

Every lowered kernel (attention forward, causal and not, the three backward kernels, grouped-query
attention, a score modifier, tiled matmuls that fit and miss L2, layer norm) runs once per worker process
under Nsight Compute (``--clock-control none``, caches flushed before the profiled launch, the warm-up
launch skipped); ``nc.cost`` of the same scheduled diagram (recoloured to SMEM) predicts GMEM→SMEM read
bytes (``l1tex__m_xbar2l1tex_read_bytes``), DRAM bytes (``dram__bytes_read + dram__bytes_write``) and
time (``gpu__time_duration``). A grid of (tile, stream) sizes for attention at D ∈ {64, 128} is timed
without ncu and ranked against the model's predicted time; the model's pick is
:func:`lowering.choose_tiles`.

On the GPU (discopy carried as a wheel), from the repository root::

    python3 -m papers.flash_attention.cost_vs_hardware --measure --out-dir $OUT

then, on any machine, ``python -m papers.flash_attention.cost_vs_hardware --report results/cost_vs_hardware_<GPU>.json``
adds the predictions and writes the ``.md`` and ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

METRICS = (
    "l1tex__m_xbar2l1tex_read_bytes.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__time_duration.sum",
)
SIZES = {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128, "hk": 4, "g": 4}
GRID_TILES, GRID_STREAMS, GRID_D = (64, 128, 256), (32, 64, 128), (64, 128)


def _alibi(s, q, x):
    return s - 0.5 * abs(q - x)


def kernels() -> dict:
    """Each kernel's name → (the Lowered to run, its sizes by axis name), built lazily."""
    import napkin_cat as nc
    from lowering import lower
    from rewrites import derive, stream, tile

    b, h, q, x, d, hk, g = nc.axes("b h q x d hk g")
    n, k, c = nc.axes("n k c")

    def flash(diagram, gq=128, sx=64):
        return lower(derive(diagram, tile(q, gq), stream(x, sx), verify=False))

    def mha(**kw):
        return nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", **kw)

    def matmul(size):
        m = derive(nc.library.matmul(n, k, c, dtype="bf16"), tile(n, 128), tile(c, 128), stream(k, 64), verify=False)
        return lambda: (lower(m).forward, {"n": size, "k": size, "c": size})

    attn = dict(SIZES)
    return {
        "attention": lambda: (flash(mha()).forward, attn),
        "attention causal": lambda: (flash(mha(causal=True)).forward, attn),
        "backward residual": lambda: (flash(mha()).kernels[0], attn),
        "backward Δ": lambda: (flash(mha()).kernels[1], attn),
        "backward dQ": lambda: (flash(mha()).kernels[2], attn),
        "backward dK dV": lambda: (flash(mha()).kernels[3], attn),
        "backward dK dV causal": lambda: (flash(mha(causal=True)).kernels[3], attn),
        "GQA (4 kv heads × 4)": lambda: (
            flash(nc.library.grouped_query_attention(hk, g, q, x, d, batch=(b,), dtype="bf16")).forward,
            attn,
        ),
        "score_mod (ALiBi)": lambda: (flash(mha(score_mod=_alibi)).forward, attn),
        "matmul 4096³": matmul(4096),
        "matmul 8192³": matmul(8192),
        "layer norm": lambda: (
            lower(derive(nc.library.layer_norm(n, k, dtype="bf16"), tile(n, 16), verify=False)).forward,
            {"n": 65536, "k": 1024},
        ),
    }


def _inputs(lowered, sizes, seed=0):
    import jax

    keys = jax.random.split(jax.random.key(seed), len(lowered.plan.diagram.dom))
    return [
        jax.random.normal(kk, tuple(sizes[a.name] for a in w.axes), w.dtype.jnp)
        for kk, w in zip(keys, lowered.plan.diagram.dom.inside, strict=True)
    ]


def worker(name: str):
    """Build one kernel, launch it twice (ncu skips the first)."""
    import jax

    lowered, sizes = kernels()[name]()
    args = _inputs(lowered, sizes)
    f = jax.jit(lowered)
    for _ in range(2):
        jax.block_until_ready(f(*args))


def _ncu(name: str) -> dict:
    cmd = ["ncu", "--clock-control", "none", "--metrics", ",".join(METRICS), "--print-units", "base", "--csv"]
    cmd += ["-k", "regex:napkin_kernel", "--launch-skip", "1", "--launch-count", "1"]
    cmd += [sys.executable, "-m", "papers.flash_attention.cost_vs_hardware", "--worker", name]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    rows = [line for line in out.stdout.splitlines() if line.startswith('"')]
    values = {}
    for row in csv.DictReader(io.StringIO("\n".join(rows))):
        values[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))  # base units: bytes, ns
    if set(values) != set(METRICS):
        return {"error": (out.stdout[-1500:] + out.stderr[-1500:])}
    return values


def _time(f, args, reps=20) -> float:
    import jax

    jax.block_until_ready(f(*args))
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / reps)
    return sorted(runs)[len(runs) // 2]


def tile_grid(budget_s: float) -> list:
    """Median time of attention forward for each (tile, stream) at D ∈ {64, 128}; errors recorded."""
    import jax

    import napkin_cat as nc
    from lowering import lower
    from rewrites import derive, stream, tile

    b, h, q, x = nc.axes("b h q x")
    start, out = time.time(), []
    for dd in GRID_D:
        d = nc.Axis("d", dd)
        diagram = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16")
        for gq in GRID_TILES:
            for sx in GRID_STREAMS:
                rec = {"d": dd, "g": gq, "s": sx}
                if time.time() - start > budget_s:
                    out.append({**rec, "error": "skipped: time budget"})
                    continue
                try:
                    kernel = lower(derive(diagram, tile(q, gq), stream(x, sx), verify=False))
                    args = _inputs(kernel.forward, {**SIZES, "d": dd})
                    rec["seconds"] = _time(jax.jit(kernel.forward), args)
                except Exception as e:  # a configuration over the shared-memory limit is a result, not a crash
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(rec)
                print(rec, flush=True)
    return out


def measure(out_dir: Path, budget_s: float):
    import jax

    kind = jax.devices()[0].device_kind
    path = out_dir / f"cost_vs_hardware_{kind.replace(' ', '_')}.json"
    result = {"device": kind, "sizes": SIZES, "metrics": METRICS, "kernels": {}, "grid": []}
    result["grid"] = tile_grid(budget_s)
    path.write_text(json.dumps(result, indent=1))
    for name in kernels():
        result["kernels"][name] = _ncu(name)
        print(name, result["kernels"][name], flush=True)
        path.write_text(json.dumps(result, indent=1))


# --- the report (CPU): predictions, ratios, table, plot ---------------------------------------------------


def predict(name: str, hardware) -> dict:
    """GMEM→SMEM read bytes, DRAM bytes and time (overlapped and serial) of one kernel, from ``nc.cost``."""
    from napkin_cat import cost
    from rewrites import level

    lowered, sizes = kernels()[name]()
    c = cost(level("SMEM")(lowered.plan.diagram), hardware).subs(**sizes)
    return {
        "gmem_read": float(c.gmem_bytes - c.gmem_write_bytes),
        "dram": float(c.dram_bytes),
        "time": float(c.time),
        "time_serial": float(c.time_serial),
        "flops": float(sum(c.tensor_flops.values())),
    }


def _spearman(a: list, b: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for i, j in enumerate(order):
            r[j] = float(i)
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def report(path: Path):
    """Add predictions to a measured JSON; write the markdown table and the plot beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lowering import choose_tiles, predicted_time
    from napkin_cat.hardware import for_device

    data = json.loads(path.read_text())
    hw = for_device(data["device"])
    rows = ["| kernel | GMEM→SMEM read pred / ncu | DRAM pred / ncu | time pred (serial) / ncu |", "|---|---|---|---|"]
    plot = []
    for name, m in data["kernels"].items():
        if "error" in m:
            rows.append(f"| {name} | ncu failed | | |")
            continue
        p = data.setdefault("predicted", {})[name] = predict(name, hw)
        m = {**m, "gpu__time_duration.sum": m["gpu__time_duration.sum"] * 1e-9}  # ncu's base unit: ns
        dram = m["dram__bytes_read.sum"] + m["dram__bytes_write.sum"]
        r = (p["gmem_read"] / m["l1tex__m_xbar2l1tex_read_bytes.sum"], p["dram"] / dram)
        t = (p["time"] / m["gpu__time_duration.sum"], p["time_serial"] / m["gpu__time_duration.sum"])
        plot.append((name, *r, *t))
        rows.append(
            f"| {name} | {p['gmem_read'] / 1e9:.3f} / {m['l1tex__m_xbar2l1tex_read_bytes.sum'] / 1e9:.3f} GB "
            f"(**{r[0]:.3f}**) | {p['dram'] / 1e9:.3f} / {dram / 1e9:.3f} GB (**{r[1]:.2f}**) | "
            f"{p['time'] * 1e3:.3f} ({p['time_serial'] * 1e3:.3f}) / {m['gpu__time_duration.sum'] * 1e3:.3f} ms "
            f"(**{t[0]:.2f}**, serial **{t[1]:.2f}**) |"
        )
    lines = [f"### Cost model vs ncu on {data['device']} (model: {hw.name})", "", *rows, ""]
    summary = {}
    for dd in GRID_D:
        cells = [g for g in data["grid"] if g["d"] == dd and "seconds" in g]
        if len(cells) < 3:
            continue
        sizes = {**SIZES, "d": dd}
        pred = [predicted_time("attention", hw, sizes, g["g"], g["s"]) for g in cells]
        meas = [g["seconds"] for g in cells]
        pick = choose_tiles("attention", hw, sizes, tiles=GRID_TILES, streams=GRID_STREAMS)
        best = min(cells, key=lambda g: g["seconds"])
        chosen = next((g for g in cells if (g["g"], g["s"]) == pick), None)
        gap = chosen["seconds"] / best["seconds"] - 1 if chosen else float("nan")
        tied = len({round(p, 12) for p in pred}) == 1  # every configuration compute-bound: no ranking at all
        rho = float("nan") if tied else _spearman(pred, meas)
        summary[dd] = {"spearman": rho, "pick": pick, "best": (best["g"], best["s"]), "gap": gap}
        corr = "undefined (every prediction ties: compute-bound)" if tied else f"**{rho:.2f}**"
        lines.append(
            f"D = {dd}: {len(cells)} configurations, Spearman rank correlation predicted vs measured time "
            f"{corr}; model's pick (g, s) = {pick}, measured best {summary[dd]['best']}, "
            f"pick is **{100 * gap:.1f}%** slower than the best."
        )
        lines.append("")
        lines.append("| g | s | measured ms | predicted ms |")
        lines.append("|---|---|---|---|")
        lines += [
            f"| {g['g']} | {g['s']} | {g['seconds'] * 1e3:.3f} | {p * 1e3:.3f} |"
            for g, p in zip(cells, pred, strict=True)
        ]
        lines.append("")
    data["grid_summary"] = summary
    path.write_text(json.dumps(data, indent=1))
    path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [p[0] for p in plot]
    for i, label in enumerate(("GMEM→SMEM read", "DRAM", "time (overlapped)", "time (serial)")):
        ax.bar([j + 0.2 * i for j in range(len(plot))], [p[i + 1] for p in plot], width=0.2, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.3 for j in range(len(plot))], names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("predicted / measured")
    ax.set_title(f"nc.cost vs ncu, {data['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--report", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--budget-s", type=float, default=110.0)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
    elif args.measure:
        measure(args.out_dir, args.budget_s)
    elif args.report:
        report(args.report)
    else:
        ap.error("choose --measure, --report PATH or --worker NAME")


if __name__ == "__main__":
    main()
