"""An RMS norm fused into the projection after it: ``nc.rms_norm_linear`` against XLA's unfused norm then matmul
(``x * rsqrt(mean(x²) + eps) * g`` in f32, cast to bf16, then ``@ w`` accumulated in f32), forward and
forward+backward (gradients in x, g and w), bf16.

Sizes: n = 16,384 tokens, d = 4,096, and m = 4,096 (a square projection, Llama 3 8B's q) and m = 14,336 (its MLP's
gate or up). Each row records, for each implementation and pass: the median time (CUPTI on a GPU), TFLOP/s (the
forward counts the product's 2·n·d·m, forward+backward 3× that; the norm's flops are left out), the ratio to XLA's
time, the temporaries XLA's memory analysis reports for the compiled program, the backend of each of the entry's
kernels, and the relative error of the output and gradients against an f32 reference on the same bf16 inputs.
An implementation that fails is recorded with its error.

    python papers/flash_attention/rms_norm_linear.py [--out DIR] [--smoke] [--blocks TILE CHUNK]

Writes ``rms_norm_linear_<GPU>.json`` and ``.png`` (times per row) after every row. ``--smoke`` runs tiny sizes on
a CPU (interpret mode), to check the script.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402

HERE = Path(__file__).resolve().parent
ROWS = {"full": ((16384, 4096, 4096), (16384, 4096, 14336)), "smoke": ((64, 32, 48), (40, 64, 100))}
EPS = 1e-6


def unfused(x, g, w):
    """XLA's norm then matmul: the norm in f32, the normalised x written in bf16, the product accumulated in f32."""
    xf = x.astype(jnp.float32)
    a = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + EPS) * g).astype(x.dtype)
    return jnp.dot(a, w, preferred_element_type=jnp.float32).astype(x.dtype)


def reference(x, g, w):
    """The f32 reference on the same (bf16) inputs, for the errors."""
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS) * g) @ w


def with_gradients(f):
    """``(x, g, w, dy) → (y, dx, dg, dw)``: the forward and the pullback of ``dy``."""

    def both(x, g, w, dy):
        y, pull = jax.vjp(f, x, g, w)
        return (y, *pull(dy.astype(y.dtype)))

    return both


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def temporaries(f, *args) -> int | None:
    analysis = jax.jit(f).lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure(name: str, f, args, flops: float, want) -> dict:
    """Forward and forward+backward of ``f`` (a function of x, g, w): time, TFLOP/s, temporaries, error."""
    row = {}
    passes = {"forward": (lambda x, g, w, dy: f(x, g, w)), "forward+backward": with_gradients(f)}
    for what, run in passes.items():
        try:
            jitted = jax.jit(run)
            out = jax.block_until_ready(jitted(*args))
            t = time_calls(jitted, *args, reps=5, batches=3)
            got = [out] if what == "forward" else list(out)
            errs = [rel_err(a, b) for a, b in zip(got, want[: len(got)], strict=True)]
            row[what] = {
                "ms": t.ms,
                "method": t.method,
                "tflops": flops * (1 if what == "forward" else 3) / t.seconds / 1e12,
                "temp_bytes": temporaries(run, *args),
                "rel_err": errs,
            }
            print(
                f"  {name:8s} {what:17s} {t.ms:9.3f} ms  {row[what]['tflops']:7.1f} TFLOP/s  "
                f"temp {row[what]['temp_bytes']}  err {max(errs):.1e}",
                flush=True,
            )
        except Exception as e:  # recorded, not fatal
            row[what] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"  {name:8s} {what:17s} failed: {row[what]['error'][:200]}", flush=True)
            traceback.print_exc(limit=2)
    return row


def run_row(n: int, d: int, m: int, blocks, interpret) -> dict:
    kx, kg, kw, ky = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(kx, (n, d), jnp.float32).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(kg, (d,), jnp.float32)
    w = (jax.random.normal(kw, (d, m), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    dy = jax.random.normal(ky, (n, m), jnp.float32).astype(jnp.bfloat16)
    args = (x, g, w, dy)
    options = dict(eps=EPS, interpret=interpret, blocks=blocks)

    def fused(x, g, w):
        return nc.rms_norm_linear(x, g, w, **options)

    made = nc.rms_norm_linear.kernel_for(x, g, w, **options)
    wide = (x.astype(jnp.float32), g, w.astype(jnp.float32), dy.astype(jnp.float32))
    want = list(jax.jit(with_gradients(reference))(*wide))  # f32 gradients, not rounded to bf16
    print(f"n={n} d={d} m={m}: blocks {made.signature.tile}×{made.signature.stream}", flush=True)
    row = {"n": n, "d": d, "m": m, "blocks": [made.signature.tile, made.signature.stream]}
    row["napkin"] = measure("napkin", fused, args, 2.0 * n * d * m, want)
    row["backends"], row["differentiation"] = made.backends, made.differentiation
    print(f"  backends {row['backends']}", flush=True)
    row["xla"] = measure("xla", unfused, args, 2.0 * n * d * m, want)
    for what in ("forward", "forward+backward"):
        ours, theirs = row["napkin"].get(what, {}), row["xla"].get(what, {})
        if "ms" in ours and "ms" in theirs:
            row.setdefault("speedup_vs_xla", {})[what] = theirs["ms"] / ours["ms"]
    return row


def plot(rows: list, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, ("forward", "forward+backward"), strict=True):
        x = np.arange(len(rows))
        for k, (impl, label) in enumerate((("napkin", "napkin-cat (fused)"), ("xla", "XLA (norm, then matmul)"))):
            tflops = [r[impl].get(what, {}).get("tflops", np.nan) for r in rows]
            ax.bar(x + 0.4 * k, tflops, 0.4, label=label, color=f"C{k}")
        ax.set_xticks(x + 0.2, [f"n={r['n']}\nd={r['d']}, m={r['m']}" for r in rows])
        ax.set_ylabel("TFLOP/s")
        ax.set_title(what)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU (interpret mode)")
    parser.add_argument("--blocks", type=int, nargs=2, metavar=("TILE", "CHUNK"), default=None)
    opts = parser.parse_args(argv)
    dev = device_info()
    stem = "rms_norm_linear_" + device_stem(dev["kind"]) + ("_smoke" if opts.smoke else "")
    opts.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n, d, m in ROWS["smoke" if opts.smoke else "full"]:
        rows.append(run_row(n, d, m, tuple(opts.blocks) if opts.blocks else None, True if opts.smoke else None))
        (opts.out / f"{stem}.json").write_text(json.dumps({"device": dev, "rows": rows}, indent=1))
        plot(rows, opts.out / f"{stem}.png", f"RMS norm → projection, bf16, {dev['kind']}")
    print(f"wrote {opts.out / stem}.json and .png")


if __name__ == "__main__":
    main()
