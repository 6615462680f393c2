"""The Mosaic GPU backend on Hopper: build, check and time it against napkin-cat's Triton kernel, cuDNN and
tokamax's Mosaic GPU attention, in one process (issue 13).

bf16 and fp16, B·N = 16k tokens, H = 16, D ∈ {64, 128}, N ∈ {2048, 8192}, causal and not; and the same lowering's
tiled matmul (``tile(m), tile(n), stream(k)``) against XLA's dot at 8192³. Every implementation
gets its inputs already in its own layout ([B, H, N, D] for napkin-cat, [B, N, H, D] for cuDNN and
tokamax); each time is the median over batches of back-to-back calls; every output is checked against
an f32 reference (batch 0, two heads) before it is timed (relative error ≤ 1e-2). Writes
``results/mosaic_<GPU>.json`` and ``.png``.

    python papers/flash_attention/mosaic_bench.py [--out DIR] [--only D,N,causal] [--dtypes bf16,f16]
    python papers/flash_attention/mosaic_bench.py --profile   # one D=128 N=8k forward, for ncu
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp

import lowering
import napkin_cat as nc
from lowering import MosaicConfig, MosaicLowered, lower, plan
from rewrites import derive, stream, tile

TOKENS, HEADS, TOLERANCE = 16384, 16, 1e-2
CONFIGS = [(D, N, causal) for D in (128, 64) for N in (8192, 2048) for causal in (False, True)]
DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
#: napkin-cat Mosaic variants: (tile g, stream s, consumer warpgroups, ring stages, ping-pong)
VARIANTS = [
    (256, 64, 2, 2, True),
    (256, 128, 2, 2, True),
]
#: napkin-cat Mosaic matmul variants: (tile m, tile n, stream k, ring stages, ping-pong)
MATMULS = [(256, 128, 64, 3, False), (128, 256, 64, 3, False), (256, 128, 64, 3, True)]
MATMUL_SIZE = 8192


def scheduled(D: int, causal: bool, g: int, s: int, dtype: str = "bf16"):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype, causal=causal)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def matmul(g_m: int, g_n: int, s: int, dtype: str):
    m, k, n = nc.axes("m k n")
    return derive(nc.library.matmul(m, k, n, dtype=dtype), tile(m, g_m), tile(n, g_n), stream(k, s), verify=False)


def median_time(f, args, batches: int = 7, budget: float = 0.05) -> float:
    """Seconds per call by :func:`lowering.median_time`, with batches of about ``budget`` s each."""
    jax.block_until_ready(f(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    reps = max(3, min(100, int(budget / max(time.perf_counter() - t0, 1e-6))))
    return lowering.median_time(f, *args, reps=reps, batches=batches, warmup=0)


def reference(q, k, v, causal: bool):
    """f32 attention of [N, H', D] slices: einsum, softmax, einsum (written here, independently)."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[0]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v)


def implementations(D: int, causal: bool, dtype: str = "bf16"):
    """name → (function, layout) for one configuration; a failure to build is recorded, not raised."""
    impls = {}
    for g, s, consumers, stages, pingpong in VARIANTS:
        name = f"napkin mosaic g{g} s{s} c{consumers} k{stages}{' pp' if pingpong else ''}"
        impls[name] = lambda g=g, s=s, c=consumers, k=stages, pp=pingpong: (
            MosaicLowered(
                plan(scheduled(D, causal, g, s, dtype).diagram),
                interpret=False,
                config=MosaicConfig(consumers=c, stages=k, pingpong=pp),
            ),
            "bhnd",
        )
    impls["napkin triton g128 s64"] = lambda: (lower(scheduled(D, causal, 128, 64, dtype), backend="triton"), "bhnd")
    impls["cudnn"] = lambda: (
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "bnhd",
    )

    def tokamax_attention():
        import tokamax

        return (
            lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation="mosaic"),
            "bnhd",
        )

    impls["tokamax mosaic"] = tokamax_attention
    return impls


def run(D: int, N: int, causal: bool, dtype: str = "bf16") -> list[dict]:
    B = TOKENS // N
    flops = 4 * B * HEADS * N * N * D / (2 if causal else 1)
    keys = jax.random.split(jax.random.key(D * N + causal), 3)
    bnhd = [jax.random.normal(k_, (B, N, HEADS, D), DTYPES[dtype]) for k_ in keys]
    bhnd = [jnp.swapaxes(a, 1, 2) for a in bnhd]
    ref = reference(*(a[0, :, :2] for a in bnhd), causal)
    rows = []
    for name, build in implementations(D, causal, dtype).items():
        row = {"impl": name, "D": D, "N": N, "B": B, "H": HEADS, "causal": causal, "dtype": dtype}
        try:
            f, layout = build()
            f = jax.jit(f)
            args = bhnd if layout == "bhnd" else bnhd
            out = f(*args)
            got = (jnp.swapaxes(out, 1, 2) if layout == "bhnd" else out)[0, :, :2].astype(jnp.float32)
            err = float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref))
            row["rel_err"] = err
            if not err <= TOLERANCE:
                row["error"] = f"relative error {err:.3g} over {TOLERANCE}"
            else:
                t = median_time(f, args)
                row["ms"], row["tflops"] = t * 1e3, flops / t / 1e12
        except Exception as e:  # recorded per implementation: one failure must not hide the others
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            traceback.print_exc(limit=3)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


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
    lines = [
        "| dtype, D, N, causal | best napkin mosaic | napkin triton | cuDNN | tokamax | ×cuDNN | ×tokamax |",
        "|---|---|---|---|---|---|---|",
    ]
    for dtype, (D, N, causal) in [(t, c) for t in DTYPES for c in CONFIGS]:
        here = [r for r in rows if (r.get("dtype"), r.get("D"), r.get("N"), r.get("causal")) == (dtype, D, N, causal)]
        if not here:
            continue
        tf = {r["impl"]: r.get("tflops") for r in here}
        mos = [r for r in here if r["impl"].startswith("napkin mosaic") and r.get("tflops")]
        best = max(mos, key=lambda r: r["tflops"], default=None)
        bt = best["tflops"] if best else None

        def cell(v):
            return f"{v:.0f}" if v else "—"

        def ratio(a, b):
            return f"{a / b:.2f}" if a and b else "—"

        name = best["impl"].removeprefix("napkin mosaic ") if best else ""
        lines.append(
            f"| {dtype}, {D}, {N}, {'yes' if causal else 'no'} | {cell(bt)} ({name}) | "
            f"{cell(tf.get('napkin triton g128 s64'))} | {cell(tf.get('cudnn'))} | "
            f"{cell(tf.get('tokamax mosaic'))} | {ratio(bt, tf.get('cudnn'))} | "
            f"{ratio(bt, tf.get('tokamax mosaic'))} |"
        )
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


def plot(rows: list[dict], gpu: str, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attn = [r for r in rows if not r.get("matmul")]
    names = list(dict.fromkeys(r["impl"] for r in attn))
    cases = [(t, *c) for t in DTYPES for c in CONFIGS]
    labels = [f"{t} D{D} N{N}{' c' if c else ''}" for t, D, N, c in cases]
    fig, ax = plt.subplots(figsize=(20, 5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        vals = []
        for t, D, N, c in cases:
            key = (name, t, D, N, c)
            r = next((r for r in attn if (r["impl"], r["dtype"], r["D"], r["N"], r["causal"]) == key), {})
            vals.append(r.get("tflops") or 0)
        ax.bar([j + i * width for j in range(len(cases))], vals, width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(cases))], labels, rotation=30, fontsize=7)
    ax.set_ylabel("forward TFLOP/s")
    ax.set_title(f"attention forward, bf16 and fp16, B·N = 16k, H = 16 — {gpu}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--only", default=None, help="one configuration 'D,N,causal', e.g. 128,8192,0")
    ap.add_argument("--dtypes", default="bf16,f16")
    ap.add_argument("--profile", action="store_true", help="run the D=128 N=8k g256 s64 forward twice (for ncu)")
    args = ap.parse_args()
    gpu = jax.devices()[0].device_kind
    print(f"device: {gpu}; jax {jax.__version__}", flush=True)
    if args.profile:
        f = jax.jit(MosaicLowered(plan(scheduled(128, False, 256, 64).diagram), interpret=False))
        q = [jax.random.normal(jax.random.key(i), (2, HEADS, 8192, 128), jnp.bfloat16) for i in range(3)]
        jax.block_until_ready(f(*q))
        jax.block_until_ready(f(*q))
        return
    configs = CONFIGS
    if args.only:
        D, N, c = (int(v) for v in args.only.split(","))
        configs = [(D, N, bool(c))]
    dtypes = args.dtypes.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "mosaic_" + gpu.replace(" ", "_")
    rows: list[dict] = []
    runs = [lambda t=t: run_matmul(t) for t in dtypes] + [lambda t=t, c=c: run(*c, t) for t in dtypes for c in configs]
    for one in runs:  # written after each, so a run cut short still leaves its rows
        rows += one()
        (out / f"{stem}.json").write_text(json.dumps({"gpu": gpu, "jax": jax.__version__, "rows": rows}, indent=1))
    plot(rows, gpu, out / f"{stem}.png")
    print(table(rows))


if __name__ == "__main__":
    main()
