"""The cost functor against the hardware counters: predicted vs ncu-measured bytes and time, per lowered kernel.

Every lowered kernel (attention forward, causal and not, the three backward kernels, grouped-query
attention, a score modifier, tiled matmuls that fit and miss L2, layer norm) runs under Nsight Compute
(``--clock-control none``, caches flushed before each profiled launch), seven to a worker process that
launches each kernel twice (the profile keeps the second launch; a kernel its batch misses gets a process of
its own while the budget lasts); ``nc.cost`` of the same scheduled diagram (recoloured to SMEM) predicts
GMEM→SMEM read bytes (``l1tex__m_xbar2l1tex_read_bytes``), DRAM bytes (``dram__bytes_read +
dram__bytes_write``) and time (``gpu__time_duration``). ncu also records, where it has them, register
spills (local-memory bytes), registers per thread and its occupancy limits, beside the model's blocks per
SM. A grid of (tile, stream) sizes for attention at D ∈ {64, 128} is timed without ncu and ranked against
the model's predicted time (:func:`lowering.predicted_time`: :attr:`napkin_cat.Cost.time_serial`'s terms
at the measured ceilings of :meth:`napkin_cat.hardware.Hardware.ceiling`, the compute run in waves of the
blocks the SMs hold at once with each wave's prologue and epilogue); the model's pick is what ``lower``
does with ``tile(q), stream(x)`` (:func:`lowering.choose_tiles`), restricted to the grid that was measured.
The report also names, per kernel, the term that bounds the prediction, so a missed target says which term
is wrong. ``--budget-s`` (default 270) bounds the whole measurement: ncu first, the grid in what is left.

On the GPU (discopy carried as a wheel), from the repository root::

    python3 -m papers.flash_attention.cost_vs_hardware --measure --out-dir $OUT

then, on any machine (no GPU: it reads the recorded measurements), from the repository root::

    python -m papers.flash_attention.cost_vs_hardware \
        --report papers/flash_attention/results/cost_vs_hardware_<GPU>.json

adds the predictions and writes the ``.md`` and ``.png`` beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

METRICS = (
    "l1tex__m_xbar2l1tex_read_bytes.sum",
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "gpu__time_duration.sum",
)
#: recorded where this ncu has them (a run without them keeps the four above): register spills (local-memory
#: bytes through L1, which ``l1tex__m_xbar2l1tex_read_bytes`` also counts when they miss), registers per thread,
#: the occupancy limits ncu computes (against ``lowering._tiles.occupancy``) and L1's share of global loads
EXTRA_METRICS = (
    "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum",
    "l1tex__t_bytes_pipe_lsu_mem_local_op_st.sum",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_allocated",
    "launch__occupancy_limit_blocks",
    "launch__occupancy_limit_registers",
    "launch__occupancy_limit_shared_mem",
    "launch__occupancy_limit_warps",
    "launch__waves_per_multiprocessor",
    "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum",
    "l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct",
)
LAUNCHED = "napkin-launched "
SIZES = {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128, "hk": 4, "g": 4}
GRID_TILES, GRID_STREAMS, GRID_D = (64, 128, 256), (32, 64, 128), (64, 128)


def _alibi(s, q, x):
    return s - 0.5 * abs(q - x)


def kernels() -> dict:
    """Each kernel's name → (the Lowered to run, its sizes by axis name), built lazily."""
    import napkin_cat as nc
    from lowering import Config, lower
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
    norm = derive(nc.library.layer_norm(n, k, dtype="bf16"), tile(n, 16), verify=False)
    norm_sizes = {"n": 65536, "k": 1024}
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
        "layer norm": lambda: (lower(norm).forward, norm_sizes),
        # 8 warps hold 64 f32 values of the 16×1024 block per thread where 4 hold 128: spills or not, and
        # whether γ, β's re-reads beyond one per SM are L1 misses, side by side
        "layer norm (8 warps)": lambda: (lower(norm, config=Config(num_warps=8, num_stages=3)).forward, norm_sizes),
    }


def _inputs(lowered, sizes, seed=0):
    import jax

    keys = jax.random.split(jax.random.key(seed), len(lowered.plan.diagram.dom))
    return [
        jax.random.normal(kk, tuple(sizes[a.name] for a in w.axes), w.dtype.jnp)
        for kk, w in zip(keys, lowered.plan.diagram.dom.inside, strict=True)
    ]


def worker(names: str):
    """Build each kernel named (comma-separated), launch it twice (the profile keeps the second), and print
    ``napkin-launched <name>`` after every launch, so a profile of many launches maps back to its kernels."""
    import jax

    for name in names.split(","):
        try:
            lowered, sizes = kernels()[name]()
            f, args = jax.jit(lowered), _inputs(lowered, sizes)
            for _ in range(2):
                jax.block_until_ready(f(*args))
                print(LAUNCHED + name, flush=True)
            del f, args
        except Exception as e:  # one kernel that fails to build is a result, not the end of the batch
            print(f"napkin-failed {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def _profile(names: list[str], metrics: tuple, timeout: float) -> tuple[dict, str]:
    """One ncu process profiling every launch of ``names`` (in one worker): the second launch's metrics per
    kernel, and ncu's output tail where something went wrong."""
    from papers.flash_attention.timing import ncu_launches

    argv = [sys.executable, "-m", "papers.flash_attention.cost_vs_hardware", "--worker", ",".join(names)]
    if len(names) == 1:  # one kernel: profile its second launch only (replaying every launch is slower)
        argv = ["--launch-skip", "1", "--launch-count", "1", *argv]
    rows, out = ncu_launches(argv, metrics, "napkin_kernel", timeout)
    launches = [line[len(LAUNCHED) :] for line in out.splitlines() if line.startswith(LAUNCHED)]
    tail = out[-3000:]
    if len(names) == 1 and len(rows) == 1:
        launches = names
    elif len(rows) != len(launches):  # a launch without its profile (or one more): the order cannot be trusted
        return {}, f"{len(rows)} profiles for {len(launches)} launches\n{tail}"
    results: dict = {}
    for name, row in zip(launches, rows, strict=True):
        results[name] = {k: v for k, v in row.items() if k not in ("id", "kernel")}  # the second launch overwrites
    missing = {n: sorted(set(METRICS) - set(v)) for n, v in results.items() if not set(METRICS) <= set(v)}
    return {n: v for n, v in results.items() if n not in missing}, tail if missing or not results else ""


def _ncu(names: list[str], timeout: float) -> dict:
    """Every kernel in ``names`` under ncu, in one process; the extra metrics dropped if this ncu lacks one."""
    results, why = _profile(names, METRICS + EXTRA_METRICS, timeout)
    if not results and "metric" in why.lower():
        results, why = _profile(names, METRICS, timeout)
    return {n: results.get(n, {"error": why or "not profiled"}) for n in names}


def tile_grid(budget_s: float) -> list:
    """Median time of attention forward for each (tile, stream) at D ∈ {64, 128}; errors recorded."""
    import jax

    import napkin_cat as nc
    from lowering import lower
    from papers.flash_attention.timing import time_calls
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
                    rec["seconds"] = time_calls(jax.jit(kernel.forward), *args, reps=20, batches=5, warmup=1).seconds
                except Exception as e:  # a configuration over the shared-memory limit is a result, not a crash
                    rec["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                out.append(rec)
                print(rec, flush=True)
    return out


def measure(out_dir: Path, budget_s: float, only: list[str] | None = None, grid: bool = True):
    """Each kernel (or those named in ``only``) under ncu, then the (tile, stream) grid timed (``grid``), within
    ``budget_s`` seconds in all: one ncu process per kernel, the grid in what remains."""
    import jax

    start = time.time()
    left = lambda: budget_s - (time.time() - start)  # noqa: E731
    kind = jax.devices()[0].device_kind
    path = out_dir / f"cost_vs_hardware_{kind.replace(' ', '_')}.json"
    metrics = METRICS + EXTRA_METRICS
    result = {"device": kind, "sizes": SIZES, "metrics": metrics, "kernels": {}, "grid": []}
    unknown = set(only or ()) - set(kernels())
    if unknown:
        raise SystemExit(f"--only: no kernel named {sorted(unknown)}; known: {sorted(kernels())}")
    names = list(only or kernels())
    # one ncu process per kernel, its second launch only: on an H100 seven kernels in one process, every launch
    # replayed for the extra metrics, did not finish in 103 s; one kernel a process takes 20–55 s (start,
    # compile, replay)
    for i, name in enumerate(names):
        if left() < 30:
            result["kernels"][name] = {"error": "not measured: the budget ran out"}
            continue
        share = (left() - 20) / (len(names) - i) * 2  # twice an even share: a slow kernel may use a fast one's time
        result["kernels"][name] = _ncu([name], timeout=max(30.0, min(150.0, share)))[name]
        print(f"ncu {name}: {time.time() - start:.0f} s", flush=True)
        path.write_text(json.dumps(result, indent=1))
    path.write_text(json.dumps(result, indent=1))
    if grid:
        result["grid"] = tile_grid(max(0.0, left() - 10))
    path.write_text(json.dumps(result, indent=1))
    print(f"total {time.time() - start:.0f} s", flush=True)


# --- the report (CPU): predictions, ratios, table, plot ---------------------------------------------------


def predict(name: str, hardware) -> dict:
    """GMEM→SMEM read bytes, DRAM bytes and time (overlapped and serial) of one kernel, from ``nc.cost``."""
    from lowering import predicted_time
    from lowering._tiles import predicted_occupancy
    from napkin_cat import Cost, cost
    from rewrites import level

    lowered, sizes = kernels()[name]()
    config = getattr(lowered, "config", None)
    stages = config.num_stages if config else 3  # Config.get_default's, which a Lowered without one runs
    warps = config.num_warps if config else None
    c = cost(level("SMEM")(lowered.plan.diagram), hardware).subs(**sizes)
    occ = predicted_occupancy(lowered.plan.diagram, hardware, sizes, stages=stages, warps=warps)
    terms = {k: float(v) for k, v in c.kernel_times.items()}
    compute = terms["tensor"] + terms["vector"] + terms["sfu"]
    links = {k: v for k, v in terms.items() if k.startswith("→")}
    link = max(links, key=links.get)
    return {
        "gmem_read": float(c.gmem_bytes - c.gmem_write_bytes),
        "dram": float(c.dram_bytes),
        "time": float(c.time),
        "time_serial": predicted_time(lowered.plan.diagram, hardware, sizes, stages=stages, warps=warps),
        "occupancy": None if occ is None else {**asdict(occ), "waves": occ.waves(hardware)},
        "time_unwaved": float(c.time_serial),
        "flops": float(sum(c.tensor_flops.values())),
        "terms": terms,
        "tensor_by_dtype": {
            t.name: {"flops": float(f), "seconds": float(Cost(hardware, tensor_flops={t: f}).kernel_times["tensor"])}
            for t, f in c.tensor_flops.items()
        },
        "bound": "compute (tensor + CUDA cores + exp unit)" if compute >= links[link] else f"link {link}",
    }


def _spearman(a: list, b: list) -> float:
    """Spearman's rank correlation, tied values sharing their average rank (NaN when one side is constant)."""

    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in order[i : j + 1]:
                r[k] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    var = sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(var) if var else float("nan")


def _read_note(name: str, p: dict, m: dict) -> str:
    """Why a kernel's GMEM→SMEM prediction misses: ``l1tex__m_xbar2l1tex_read_bytes`` counts what reaches L1
    from L2, global loads and the spilled (local-memory) loads that miss L1 alike; the model counts global loads.

    >>> m = {"l1tex__m_xbar2l1tex_read_bytes.sum": 2.5e9, "l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum": 2.4e9,
    ...      "l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum": 1.2e9}
    >>> print(_read_note("dK dV", {"gmem_read": 2.4e9}, m))
    dK dV (0.960×: global loads 1.000× the prediction; the 0.100 GB beyond them are spilled registers missing L1, \
1.200 GB of local loads in all)
    """
    read = m["l1tex__m_xbar2l1tex_read_bytes.sum"]
    glob, spill = (
        m.get("l1tex__t_bytes_pipe_lsu_mem_global_op_ld.sum"),
        m.get("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum"),
    )
    head = f"{name} ({p['gmem_read'] / read:.3f}×"
    if glob is None or not spill:
        return head + ")"
    return (
        f"{head}: global loads {p['gmem_read'] / glob:.3f}× the prediction; the {(read - glob) / 1e9:.3f} GB beyond "
        f"them are spilled registers missing L1, {spill / 1e9:.3f} GB of local loads in all)"
    )


def report(path: Path):
    """Add predictions to a measured JSON; write the markdown table and the plot beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    import napkin_cat as nc
    from lowering import choose_tiles, predicted_time
    from napkin_cat.hardware import for_device
    from rewrites import derive, stream, tile

    data = json.loads(path.read_text())
    hw = for_device(data["device"])
    rows = [
        "| kernel | GMEM→SMEM read pred / ncu | DRAM pred / ncu | time roofline (predicted) / ncu | predicted time "
        "bound by | blocks/SM pred / ncu (limit) | registers/thread pred / ncu | spills ld + st (ncu) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    plot, missed, read_missed = [], [], []
    for name, m in data["kernels"].items():
        if "error" in m:
            rows.append(f"| {name} | ncu failed | | | | | | |")
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
            f"(**{t[0]:.2f}**, predicted **{t[1]:.2f}**) | {p['bound']} | {_launch(p, m)} |"
        )
        if abs(r[0] - 1) > 0.05:
            read_missed.append(_read_note(name, p, m))
        if abs(t[1] - 1) > 0.3:
            parts = ", ".join(
                f"{k} {v['flops'] / 1e9:.0f} GFLOP → {_ms(v['seconds'])}" for k, v in p["tensor_by_dtype"].items()
            )
            terms = ", ".join(f"{k} {_ms(v)}" for k, v in p["terms"].items())
            missed.append(
                f"{name} ({t[1]:.2f}×, bound by {p['bound']}; terms {terms}; contractions by operand dtype "
                f"{parts}; GMEM→SMEM {r[0]:.2f}×, DRAM {r[1]:.2f}×)"
            )
    lines = [f"### Cost model vs ncu on {data['device']} (model: {hw.name})", "", *rows, ""]
    lines += [
        "Predicted time: `lowering.predicted_time`: `Cost.time_serial`'s terms at the model's measured ceilings "
        f"({', '.join(f'{k} {v / 1e12:.3g} T/s' for k, v in hw.ceilings) or 'none: datasheet rates'}) and f32 "
        "contractions as TF32 (`Cost.kernel_times`), the compute in waves of the blocks resident per SM with "
        "each wave's prologue and epilogue (`Occupancy.time`); the roofline column is `Cost.time`. "
        f"Time target (within 30%) missed by {len(missed)} of {len(plot)} kernels"
        + (": " + "; ".join(missed) + "." if missed else "."),
        "",
        f"GMEM→SMEM target (within 5%) missed by {len(read_missed)} of {len(plot)} kernels"
        + (": " + "; ".join(read_missed) + "." if read_missed else "."),
        "",
    ]
    pairs = [(n, f"{n} causal") for n in data["kernels"] if f"{n} causal" in data["kernels"]]
    for full, causal in pairs:  # the causal mask's visited fraction, measured against predicted
        ms, ps = (data["kernels"][k] for k in (full, causal)), (data["predicted"].get(k) for k in (full, causal))
        ms, ps = list(ms), list(ps)
        if all("error" not in m for m in ms) and all(ps):
            measured_ratio = ms[1]["gpu__time_duration.sum"] / ms[0]["gpu__time_duration.sum"]
            lines.append(
                f"{causal} / {full}: measured time ratio {measured_ratio:.2f}, predicted "
                f"{ps[1]['time_serial'] / ps[0]['time_serial']:.2f} (the causal mask's visited fraction of the loop)."
            )
    lines += [_layer_norm_note(name, m, hw) for name, m in data["kernels"].items() if name.startswith("layer norm")]
    lines.append("")
    b, h, q, x = nc.axes("b h q x")
    summary = {}
    for dd in GRID_D:
        cells = [g for g in data["grid"] if g["d"] == dd and "seconds" in g]
        if len(cells) < 3:
            continue
        sizes = {k: v for k, v in SIZES.items() if k in "bhqx"}
        mha = nc.library.multi_head_attention(h, q, x, nc.Axis("d", dd), batch=(b,), dtype="bf16")
        pred = [predicted_time(derive(mha, tile(q, g["g"]), stream(x, g["s"]), verify=False), hw, sizes) for g in cells]
        meas = [g["seconds"] for g in cells]
        choice = choose_tiles(derive(mha, tile(q), stream(x), verify=False), hw, sizes)
        measured = {(g["g"], g["s"]): g for g in cells}
        pick = next(c for c in ((r["g_q"], r["s_x"]) for r in choice.ranked) if c in measured)
        best = min(cells, key=lambda g: g["seconds"])
        gap = measured[pick]["seconds"] / best["seconds"] - 1
        rounded = [float(f"{p:.3g}") for p in pred]  # predictions equal to 3 digits tie
        tied = len(set(rounded)) == 1
        rho = float("nan") if tied else _spearman(rounded, meas)
        summary[dd] = {
            "spearman": rho,
            "pick": pick,
            "unrestricted pick": (choice.sizes["g_q"], choice.sizes["s_x"]),
            "best": (best["g"], best["s"]),
            "gap": gap,
        }
        corr = "undefined (every prediction ties: compute-bound)" if tied else f"**{rho:.2f}**"
        lines.append(
            f"D = {dd}: {len(cells)} configurations, Spearman rank correlation predicted vs measured time "
            f"{corr}; `lower`'s pick for `tile(q), stream(x)` is {summary[dd]['unrestricted pick']}, within the "
            f"measured grid {pick}; measured best {summary[dd]['best']}; the pick is **{100 * gap:.1f}%** slower "
            f"than the best, predicted {_ms(choice.predicted)} vs measured best {_ms(best['seconds'])} "
            f"(**{choice.predicted / best['seconds']:.2f}×**)."
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
    for i, label in enumerate(("GMEM→SMEM read", "DRAM", "time (roofline)", "time (predicted)")):
        ax.bar([j + 0.2 * i for j in range(len(plot))], [p[i + 1] for p in plot], width=0.2, label=label)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.3 for j in range(len(plot))], names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("predicted / measured")
    ax.set_title(f"nc.cost vs ncu, {data['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print("\n".join(lines))


def _layer_norm_note(name: str, m: dict, hw) -> str:
    """Layer norm's GMEM→SMEM read bytes taken apart: X once, then γ and β (f32) once per block (the model's
    count: every block loads them with ``ld.global``), against once per SM (what L1 would leave if it kept
    them between an SM's blocks), and what ncu saw beyond X, beside its spilled bytes and L1's hit rate."""
    if "error" in m:
        return ""
    n, k, rows = 65536, 1024, 16  # kernels()'s layer norm
    x, params = n * k * 2, 2 * k * 4
    beyond = m["l1tex__m_xbar2l1tex_read_bytes.sum"] - x
    spill = m.get("l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum")
    hit = m.get("l1tex__t_sector_pipe_lsu_mem_global_op_ld_hit_rate.pct")
    return (
        f"{name}: GMEM→SMEM reads beyond X ({x / 1e6:.1f} MB) {beyond / 1e6:.1f} MB measured; γ, β once per block "
        f"{n // rows * params / 1e6:.1f} MB (the model), once per SM {hw.sms * params / 1e6:.1f} MB"
        + ("" if spill is None else f"; spill loads {spill / 1e6:.1f} MB")
        + ("" if hit is None else f"; L1 hit rate of global loads {hit:.1f}%")
        + "."
    )


def _launch(p: dict, m: dict) -> str:
    """Blocks per SM, registers per thread and spilled bytes, predicted (``lowering._tiles.occupancy``)
    against ncu's launch statistics and local-memory traffic, where the run recorded them."""
    o = p.get("occupancy") or {}
    limits = {k: m.get(f"launch__occupancy_limit_{k}") for k in ("blocks", "registers", "shared_mem", "warps")}
    known = {k: v for k, v in limits.items() if v is not None}
    ncu_blocks = f"{min(known.values()):.0f} ({min(known, key=known.get)})" if known else "–"
    regs = m.get("launch__registers_per_thread")
    spill = [m.get(f"l1tex__t_bytes_pipe_lsu_mem_local_op_{op}.sum") for op in ("ld", "st")]
    return (
        f"{o.get('per_sm', '–')} ({o.get('limit', '–')}) / {ncu_blocks} | ≥{o.get('registers', '–')} / "
        f"{'–' if regs is None else f'{regs:.0f}'} | "
        + ("–" if None in spill else f"{spill[0] / 1e6:.1f} + {spill[1] / 1e6:.1f} MB")
    )


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--measure", action="store_true")
    ap.add_argument("--report", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--budget-s", type=float, default=270.0, help="seconds for the whole measurement (ncu + grid)")
    ap.add_argument("--only", help="comma-separated kernel names to measure (default: all)")
    ap.add_argument("--no-grid", action="store_true", help="skip timing the (tile, stream) grid")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
    elif args.measure:
        measure(args.out_dir, args.budget_s, args.only.split(",") if args.only else None, not args.no_grid)
    elif args.report:
        report(args.report)
    else:
        ap.error("choose --measure, --report PATH or --worker NAME")


if __name__ == "__main__":
    main()
