"""The Mosaic GPU backend on Hopper, forward and forward + backward: build, check and time it against
napkin-cat's Triton kernels, cuDNN and tokamax's Mosaic GPU attention, in one process (issue 13).

bf16 and fp16, B·N = 16k tokens, H = 16, D ∈ {64, 128}, N ∈ {2048, 8192}, causal and not. Forward: the napkin Mosaic
kernel at the tiles measured best (g256 s64 and the entry's g128 s128 at D = 128, g256 s128 at D = 64, two consumer
warpgroups, ping-pong; the tables keep the fastest), napkin Triton (g128 s64), cuDNN, tokamax. Forward + backward
(``jax.vjp`` with a random cotangent): napkin ``backend="mosaic"`` (every kernel on Mosaic: the forward with its
log-sum-exp, Δ, dQ, dK·dV), with ``--auto`` ``backend="auto"`` too (each kernel where it was measured fastest,
``kernel.backends``), with ``--fused`` ``backward="fused"`` too (dQ in the dK·dV kernel, FlashAttention-3's five
products; a refusal is recorded as the row's error), napkin Triton, cuDNN, tokamax. Every implementation gets its
inputs in its own layout ([B, H, N, D] for napkin-cat, [B, N, H, D] for cuDNN and tokamax); each time is the median
over batches of back-to-back calls; every output and gradient is checked against an f32 reference (batch 0, two heads)
before it is timed. TFLOP/s: 4·B·H·N²·D forward (halved when causal), 3.5× that forward + backward. Writes
``mosaic_<GPU>.json`` and ``.png`` under ``--out`` after every configuration (a run cut short keeps its rows) and
prints the tables with ratios, and for each napkin forward + backward row the backend each kernel ran on (the
fused rows' ``tile(x, 128, summed=True)`` kernel among them). Configurations left when ``--budget-s`` runs out are
recorded as skipped. ``--smoke`` checks the napkin rows on a CPU (interpreted, D = 64, N = 256, H = 2, causal, bf16;
built and checked, not timed; cuDNN and tokamax left out).

    python papers/flash_attention/mosaic_bench.py [--out DIR] [--only D,N,causal] [--dtypes bf16,f16]
        [--sections fwd,fwdbwd] [--budget-s 540] [--matmul] [--auto] [--pingpong] [--fused] [--tiles 128x128,...]
        [--smoke]
    python papers/flash_attention/mosaic_bench.py --profile [--only 128,8192,1] [--softcap 50]   # one forward, for ncu
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import napkin_cat as nc  # noqa: E402
from lowering import MosaicConfig, MosaicLowered, lower, plan  # noqa: E402
from papers.flash_attention.timing import once, time_calls  # noqa: E402
from rewrites import derive, stream, tile  # noqa: E402

TOKENS, HEADS = 16384, 16
#: relative error against the f32 reference: outputs (measured ≤ 2.2e-3 in bf16) and gradients
TOLERANCE, GRAD_TOLERANCE = 1e-2, 2e-2
FWD_BWD_FACTOR = 3.5  # the backward does 2.5× the forward's matrix products (FlashAttention-2, Dao 2023, §4)
CONFIGS = [(D, N, causal) for D in (128, 64) for N in (8192, 2048) for causal in (False, True)]
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
SECTIONS = ("fwd", "fwdbwd")
#: napkin-cat Mosaic forward tiles per head dim (g, s): the fastest of docs/mosaic.md v2–v3
#: and at D = 128 also the entry's schedule (g128 s128, ``lowering._attention.schedule``), which the causal forward
#: runs fastest at N = 8192 (529 against 440 TFLOP/s on an H100) and g256 s64 at N = 2048 (364 against 312)
TILES = {128: [(256, 64), (128, 128)], 64: [(256, 128)]}
#: napkin-cat Mosaic matmul variants: (tile m, tile n, stream k, ring stages, ping-pong)
MATMULS = [(256, 128, 64, 3, False), (128, 256, 64, 3, False), (256, 128, 64, 3, True)]
MATMUL_SIZE = 8192
#: seconds one implementation may take (build, compile, check, time) before the run is saved and ended: a
#: deadlocked kernel never returns, and the rows measured so far must survive it
HANG_S = 150
#: whether forward + backward also times ``backend="auto"`` (``--auto``; off by default to fit a 10-minute run:
#: on sm_90 it is Mosaic's forward with Triton's backward kernels, both timed here)
AUTO = False
#: whether forward + backward also times Mosaic with ping-pong turns in the backward's kernels (``--pingpong``)
PINGPONG = False
#: also ``backward="fused"`` (``--fused``): dQ in the dK·dV kernel
FUSED = False
#: further napkin Mosaic tiles (g, s) to time beside :data:`TILES`' (``--tiles 128x64,256x128``)
EXTRA_TILES: list[tuple[int, int]] = []
#: ``--smoke``: the napkin rows at a CPU's sizes, interpreted, checked and not timed
SMOKE = False
#: where ``main`` saves the rows measured so far (with a row it adds), for the watchdog
SAVE = {"rows": [], "save": lambda rows: None}


def scheduled(D: int, causal: bool, g: int, s: int, dtype: str = "bf16", **kw):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype, causal=causal, **kw)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def matmul(g_m: int, g_n: int, s: int, dtype: str):
    m, k, n = nc.axes("m k n")
    return derive(nc.library.matmul(m, k, n, dtype=dtype), tile(m, g_m), tile(n, g_n), stream(k, s), verify=False)


def median_time(f, args, batches: int = 5, budget: float = 0.03) -> float:
    """Seconds per call by :func:`papers.flash_attention.timing.time_calls`, with batches of about ``budget`` s."""
    jax.block_until_ready(f(*args))
    _, first, _ = once(f, *args)
    reps = max(3, min(100, int(budget / max(first, 1e-6))))
    return time_calls(f, *args, reps=reps, batches=batches, warmup=0).seconds


def reference(q, k, v, causal: bool):
    """f32 attention of [N, H', D] slices: einsum, softmax, einsum (written here, independently)."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[0]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)


def with_gradients(f):
    """``(q, k, v, dO) ↦ (O, dQ, dK, dV)``: the forward and its pullback of the cotangent ``dO``."""

    def g(q, k, v, do):
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(do))

    return g


def implementations(D: int, causal: bool, dtype: str, section: str):
    """name → builder of (function of q, k, v, layout, note) for one configuration and section; a failure to
    build is recorded by the caller, not raised."""
    impls = baselines(D, causal, dtype)  # first: a Mosaic kernel that hung would end the run (see ``hung``)
    for g, s in dict.fromkeys([*TILES[D], *EXTRA_TILES]):  # the table keeps the fastest napkin Mosaic row
        napkin = scheduled(D, causal, g, s, dtype)
        if section == "fwd":
            impls[f"napkin mosaic g{g} s{s}"] = lambda napkin=napkin: (
                MosaicLowered(plan(napkin.diagram), interpret=None if SMOKE else False),
                "bhnd",
                "",
            )
            continue

        def made(backend, config=None, napkin=napkin, backward="lowered"):
            kernel = lower(napkin, backend=backend, config=config, backward=backward)
            if kernel.why_not:
                raise RuntimeError(kernel.why_not)
            return kernel, "bhnd", ", ".join(f"{r}: {b}" for r, b in kernel.backends.items())

        if AUTO:
            impls[f"napkin auto g{g} s{s}"] = lambda made=made: made("auto")
        if PINGPONG:
            impls[f"napkin mosaic g{g} s{s} pp"] = lambda made=made: made("mosaic", MosaicConfig(pingpong=True))
        if FUSED:
            impls[f"napkin mosaic g{g} s{s} fused"] = lambda made=made: made("mosaic", backward="fused")
        impls[f"napkin mosaic g{g} s{s}"] = lambda made=made: made("mosaic")
    return impls


def baselines(D: int, causal: bool, dtype: str) -> dict:
    """napkin Triton, cuDNN and tokamax: name → builder of (function of q, k, v, layout, note)."""
    impls = {}
    impls["napkin triton g128 s64"] = lambda: (
        lower(scheduled(D, causal, 128, 64, dtype), backend="triton"),
        "bhnd",
        "",
    )
    if SMOKE:  # neither runs on a CPU
        return impls
    impls["cudnn"] = lambda: (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "bnhd",
        "",
    )

    def tokamax_attention():
        import tokamax

        return (
            lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic"),
            "bnhd",
            "",
        )

    impls["tokamax mosaic"] = tokamax_attention
    return impls


def relative_error(got, want) -> float:
    return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))


def run(D: int, N: int, causal: bool, dtype: str, section: str) -> list[dict]:
    B = TOKENS // N
    flops = 4 * B * HEADS * N * N * D / (2 if causal else 1) * (FWD_BWD_FACTOR if section == "fwdbwd" else 1)
    keys = jax.random.split(jax.random.key(D * N + causal), 4)
    bnhd = [jax.random.normal(k_, (B, N, HEADS, D), DTYPES[dtype]) for k_ in keys]
    bhnd = [jnp.swapaxes(a, 1, 2) for a in bnhd]
    sliced = [a[0, :, :2] for a in bnhd]  # batch 0, two heads: [N, 2, D]
    if section == "fwd":
        want = [reference(*sliced[:3], causal)]
    else:
        out, pull = jax.vjp(lambda q, k, v: reference(q, k, v, causal), *sliced[:3])
        want = [out, *pull(sliced[3].astype(jnp.float32))]
    rows = []
    for name, build in implementations(D, causal, dtype, section).items():
        row = {"impl": name, "section": section, "D": D, "N": N, "B": B, "H": HEADS, "causal": causal, "dtype": dtype}
        watchdog = threading.Timer(HANG_S, hung, args=(rows, row))
        watchdog.start()
        try:
            t0 = time.perf_counter()
            f, layout, note = build()
            if note:
                row["backends"] = note
            f = jax.jit(f if section == "fwd" else with_gradients(f))
            args = (bhnd if layout == "bhnd" else bnhd)[: 3 if section == "fwd" else 4]
            outs = f(*args)
            outs = [outs] if section == "fwd" else list(outs)
            jax.block_until_ready(outs)
            row["compile_s"] = round(time.perf_counter() - t0, 1)
            errs = []
            for o, w in zip(outs, want, strict=True):
                o = jnp.swapaxes(o, 1, 2) if layout == "bhnd" else o
                errs.append(relative_error(o[0, :, :2], w))
            row["rel_err"] = errs
            tolerances = [TOLERANCE, GRAD_TOLERANCE, GRAD_TOLERANCE, GRAD_TOLERANCE][: len(errs)]
            worst = [e for e, tol in zip(errs, tolerances, strict=True) if not e <= tol]
            if worst:
                row["error"] = f"relative errors {[f'{e:.3g}' for e in errs]} over {TOLERANCE} (O) / {GRAD_TOLERANCE}"
            elif not SMOKE:
                t = median_time(f, args)
                row["ms"], row["tflops"] = t * 1e3, flops / t / 1e12
        except Exception as e:  # recorded per implementation: one failure must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=3)
        watchdog.cancel()
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def hung(rows: list[dict], row: dict):
    """The watchdog's end: save every row so far and this one as hung, then leave (a kernel that never returns
    cannot be interrupted from Python)."""
    row["error"] = f"no result after {HANG_S} s: hung (a deadlocked kernel?); the run ended here"
    print(json.dumps(row), flush=True)
    SAVE["save"](SAVE["rows"] + rows + [row])
    os._exit(3)


def run_matmul(dtype: str) -> list[dict]:
    """The same lowering's tiled matmul against XLA's dot at 8192³ (checked against an f32 product first)."""
    n = MATMUL_SIZE
    a, b = (jax.random.normal(k_, (n, n), DTYPES[dtype]) for k_ in jax.random.split(jax.random.key(n), 2))
    ref = jnp.dot(a[:256].astype(jnp.float32), b.astype(jnp.float32), precision="highest")
    impls = {"xla dot": lambda: jnp.dot}
    for g_m, g_n, s, stages, pp in MATMULS:
        name = f"napkin mosaic m{g_m} n{g_n} k{s} x{stages}{' pp' if pp else ''}"
        config = MosaicConfig(stages=stages, pingpong=pp)
        impls[name] = lambda c=(g_m, g_n, s), k=config: MosaicLowered(
            plan(matmul(*c, dtype).diagram), interpret=False, config=k
        )
    rows = []
    for name, build in impls.items():
        row = {"impl": name, "matmul": n, "dtype": dtype}
        try:
            f = jax.jit(build())
            out = f(a, b)
            err = float(jnp.linalg.norm(out[:256].astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
            row["rel_err"] = err
            if not err <= TOLERANCE:
                row["error"] = f"relative error {err:.3g} over {TOLERANCE}"
            else:
                t = median_time(f, (a, b))
                row["ms"], row["tflops"] = t * 1e3, 2 * n**3 / t / 1e12
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    """Per section and configuration: the napkin kernels, cuDNN and tokamax (TFLOP/s), napkin Mosaic's ratios."""
    lines = []
    heads = {
        "fwd": ["napkin mosaic", "napkin triton g128 s64", "cudnn", "tokamax mosaic"],  # TFLOP/s, the best of each
        "fwdbwd": [
            "napkin mosaic",
            "napkin mosaic fused",
            "napkin auto",
            "napkin triton g128 s64",
            "cudnn",
            "tokamax mosaic",
        ],
    }
    for section, names in heads.items():
        lines += [
            f"{'forward' if section == 'fwd' else 'forward + backward'} TFLOP/s",
            f"| dtype, D, N, causal | {' | '.join(names)} | mosaic ×cuDNN | mosaic ×tokamax | mosaic ×triton |",
            "|---" * (len(names) + 4) + "|",
        ]
        for dtype, (D, N, causal) in [(t, c) for t in DTYPES for c in CONFIGS]:
            key = (section, dtype, D, N, causal)
            here = [
                r for r in rows if (r.get("section"), r.get("dtype"), r.get("D"), r.get("N"), r.get("causal")) == key
            ]
            if not here:
                continue
            # the best row of each (napkin mosaic with and without --pingpong's variant)
            tf = {n: max((r.get("tflops") or 0 for r in here if _of(r["impl"], n)), default=0) for n in names}

            def cell(v):
                return f"{v:.0f}" if v else "—"

            def ratio(a, b):
                return f"{a / b:.2f}" if a and b else "—"

            mosaic = tf["napkin mosaic"]
            lines.append(
                f"| {dtype}, {D}, {N}, {'yes' if causal else 'no'} | {' | '.join(cell(tf[n]) for n in names)} | "
                f"{ratio(mosaic, tf['cudnn'])} | {ratio(mosaic, tf['tokamax mosaic'])} | "
                f"{ratio(mosaic, tf['napkin triton g128 s64'])} |"
            )
    lines += ["backend of each kernel (napkin forward + backward rows):"]
    lines += [
        f"  {r['impl']} ({r['dtype']}, D {r['D']}, N {r['N']}, causal {r['causal']}): {r['backends']}"
        for r in rows
        if r.get("section") == "fwdbwd" and r.get("backends")
    ]
    for dtype in DTYPES:
        mm = [r for r in rows if r.get("matmul") and r["dtype"] == dtype and r.get("tflops")]
        xla = next((r["tflops"] for r in mm if r["impl"] == "xla dot"), None)
        best = max((r for r in mm if r["impl"] != "xla dot"), key=lambda r: r["tflops"], default=None)
        if best:
            lines.append(
                f"matmul {MATMUL_SIZE}³ {dtype}: {best['impl']} {best['tflops']:.0f} TFLOP/s, XLA dot "
                f"{xla or 0:.0f}: ×XLA {best['tflops'] / xla if xla else float('nan'):.2f}"
            )
    return "\n".join(lines)


def _of(impl: str, name: str) -> bool:
    """Whether row ``impl`` belongs to column ``name``: its prefix, fused (``backward="fused"``) or not alike."""
    return impl.startswith(name.removesuffix(" fused")) and impl.endswith(" fused") == name.endswith(" fused")


def plot(rows: list[dict], gpu: str, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [(t, *c) for t in DTYPES for c in CONFIGS]
    labels = [f"{t} D{D} N{N}{' c' if c else ''}" for t, D, N, c in cases]
    fig, axes = plt.subplots(2, 1, figsize=(20, 9))
    for ax, section in zip(axes, SECTIONS, strict=True):
        attn = [r for r in rows if r.get("section") == section]
        names = list(dict.fromkeys(r["impl"] for r in attn))
        width = 0.8 / max(len(names), 1)
        for i, name in enumerate(names):
            vals = []
            for t, D, N, c in cases:
                key = (name, t, D, N, c)
                r = next((r for r in attn if (r["impl"], r["dtype"], r["D"], r["N"], r["causal"]) == key), {})
                vals.append(r.get("tflops") or 0)
            ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], labels, rotation=30, fontsize=7)
        ax.set_ylabel(f"{'forward' if section == 'fwd' else 'forward + backward'} TFLOP/s")
        ax.legend(fontsize=7, ncol=3)
    axes[0].set_title(f"attention, bf16 and fp16, B·N = 16k, H = 16 — {gpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--only", default=None, help="one configuration 'D,N,causal', e.g. 128,8192,0")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--sections", default="fwd,fwdbwd")
    ap.add_argument("--budget-s", type=float, default=540, help="configurations left after this are skipped")
    ap.add_argument("--matmul", action="store_true", help="also the tiled matmul against XLA's dot at 8192³")
    ap.add_argument("--auto", action="store_true", help="also backend='auto' forward + backward")
    ap.add_argument("--pingpong", action="store_true", help="also Mosaic with ping-pong in the backward's kernels")
    ap.add_argument("--fused", action="store_true", help="also Mosaic with backward='fused' (dQ in the dK·dV kernel)")
    ap.add_argument("--smoke", action="store_true", help="the napkin rows on a CPU: interpreted, tiny, not timed")
    ap.add_argument("--tiles", default="", help="further Mosaic forward tiles GxS to time, e.g. 128x128,256x128")
    ap.add_argument("--profile", action="store_true", help="run one forward twice, for ncu (--only: which; D=128 N=8k)")
    ap.add_argument("--softcap", type=float, default=None, help="with --profile: soft-capped scores (Gemma 2's cap)")
    args = ap.parse_args()
    start = time.perf_counter()
    global AUTO, PINGPONG, FUSED, SMOKE, TOKENS, HEADS
    AUTO, PINGPONG, FUSED, SMOKE = args.auto, args.pingpong, args.fused, args.smoke
    EXTRA_TILES[:] = [tuple(int(n) for n in t.split("x")) for t in args.tiles.split(",") if t]
    gpu = jax.devices()[0].device_kind
    print(f"device: {gpu}; jax {jax.__version__}", flush=True)
    if args.profile:  # --only picks the configuration (default 128,8192,0)
        D, N, c = (int(v) for v in (args.only or "128,8192,0").split(","))
        mod = {} if args.softcap is None else {"score_mod": nc.library.SoftCap(args.softcap)}
        f = jax.jit(MosaicLowered(plan(scheduled(D, bool(c), *TILES[D][0], **mod).diagram), interpret=False))
        q = [jax.random.normal(jax.random.key(i), (16384 // N, HEADS, N, D), jnp.bfloat16) for i in range(3)]
        jax.block_until_ready(f(*q))
        jax.block_until_ready(f(*q))
        return
    if SMOKE:
        TOKENS, HEADS, CONFIGS[:], TILES[64] = 256, 2, [(64, 256, True)], [(128, 64)]
        args.dtypes = "bf16"
    configs = CONFIGS
    if args.only:
        D, N, c = (int(v) for v in args.only.split(","))
        configs = [(D, N, bool(c))]
    dtypes, sections = args.dtypes.split(","), args.sections.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "mosaic_" + gpu.replace(" ", "_")
    rows: list[dict] = []

    def save(rows):
        (out / f"{stem}.json").write_text(json.dumps({"gpu": gpu, "jax": jax.__version__, "rows": rows}, indent=1))

    SAVE.update(rows=rows, save=save)
    runs = [(lambda t=t: run_matmul(t)) for t in dtypes if args.matmul]
    # every dtype's configurations, forward then forward + backward: the first dtype's complete first
    runs += [lambda t=t, c=c, s=s: run(*c, t, s) for t in dtypes for c in configs for s in sections]
    for one in runs:  # written after each, so a run cut short still leaves its rows
        if time.perf_counter() - start > args.budget_s:
            kw = one.__defaults__
            rows.append({"skipped": f"budget of {args.budget_s:.0f} s spent", "case": repr(kw)})
            continue
        rows += one()
        save(rows)
    save(rows)
    plot(rows, gpu, out / f"{stem}.png")
    print(table(rows))
    print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
