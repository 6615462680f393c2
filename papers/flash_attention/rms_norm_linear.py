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
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import bar_plot, measure_passes, speedups, write_rows  # noqa: E402

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


def passes(f) -> dict:
    """The forward and forward+backward of ``f`` (a function of x, g, w), each a function of (x, g, w, dy)."""
    return {"forward": lambda x, g, w, dy: f(x, g, w), "forward+backward": with_gradients(f)}


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
    row["napkin"] = measure_passes("napkin", passes(fused), args, 2.0 * n * d * m, want)
    row["backends"], row["differentiation"] = made.backends, made.differentiation
    print(f"  backends {row['backends']}", flush=True)
    row["xla"] = measure_passes("xla", passes(unfused), args, 2.0 * n * d * m, want)
    speedups(row)
    return row


def plot(rows: list, path: Path, title: str) -> None:
    ticks = [f"n={r['n']}\nd={r['d']}, m={r['m']}" for r in rows]
    bars = {"napkin": "napkin-cat (fused)", "xla": "XLA (norm, then matmul)"}
    bar_plot(rows, path, title, bars, "tflops", ticks, "TFLOP/s")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU (interpret mode)")
    parser.add_argument("--blocks", type=int, nargs=2, metavar=("TILE", "CHUNK"), default=None)
    opts = parser.parse_args(argv)
    dev = device_info()
    stem = "rms_norm_linear_" + device_stem(dev["kind"]) + ("_smoke" if opts.smoke else "")
    blocks, interpret = tuple(opts.blocks) if opts.blocks else None, True if opts.smoke else None
    title = f"RMS norm → projection, bf16, {dev['kind']}"
    write_rows(ROWS["smoke" if opts.smoke else "full"], lambda n, d, m: run_row(n, d, m, blocks, interpret), dev,
               opts.out, stem, lambda rows, path: plot(rows, path, title))


if __name__ == "__main__":
    main()
