"""Fused linear cross-entropy (Cut Cross-Entropy, Wijmans et al., ICLR 2025): ``nc.linear_cross_entropy`` against
XLA's unfused loss (``h @ w.T`` in f32, then ``optax.softmax_cross_entropy_with_integer_labels``), forward and
forward+backward (gradients in h and w), bf16.

Sizes: n = 16,384 tokens, d = 4,096, v = 128,256 (Llama 3's vocabulary), and a smaller row n = 4,096, d = 4,096,
v = 32,768. Each row records, for each implementation and pass: the median time (CUPTI on a GPU), TFLOP/s (the
forward counts the logits' 2·n·d·v, forward+backward 3× that, as if the logits were computed once; recomputing
them in the backward is the fused kernel's own cost), the ratio to XLA's time, the temporaries XLA's memory
analysis reports for the compiled program, the device's peak bytes in use after it ran (``memory_stats``), the
backend the entry chose (and why it passed Triton over), its blocks and why (on the XLA backend: the chunks
``lowering._cross_entropy.xla_blocks`` takes within ``--budget`` bytes per f32 logit block, or ``--blocks``), the
backward's kernels, and the relative error of the loss and gradients against an f32 reference on the same bf16
inputs. An implementation that fails (out of memory: the unfused [n, v] f32 logits of the big row alone are
8.4 GB, their gradient as much again) is recorded with its error. ``--no-ignore`` passes ``ignore_index=None``.
Each row prints the entry's kernels, forward and backward, with their schedules: on the XLA backend the
backward is one kernel streaming the vocabulary (``dh`` accumulated, ``dw``'s slice written per chunk).

    python papers/flash_attention/linear_cross_entropy.py [--out DIR] [--smoke] [--blocks TILE CHUNK]
        [--budget BYTES] [--no-ignore] [--backend auto|xla|triton|mosaic]

Writes ``linear_cross_entropy_<GPU>.json`` and ``.png`` (times per row) after every row. ``--smoke`` runs tiny
sizes on a CPU (interpret mode), to check the script.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import bar_plot, measure_passes, speedups, write_rows  # noqa: E402

HERE = Path(__file__).resolve().parent
ROWS = {"full": ((16384, 4096, 128256), (4096, 4096, 32768)), "smoke": ((64, 32, 300), (40, 16, 100))}


def unfused(h, w, labels):
    """XLA's loss: the whole [n, v] logits in f32, then optax's cross-entropy, averaged."""
    logits = jnp.dot(h, w.T, preferred_element_type=jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def reference(h, w, labels):
    """The f32 reference on the same (bf16) inputs, for the errors."""
    return unfused(h.astype(jnp.float32), w.astype(jnp.float32), labels)


def peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def passes(loss) -> dict:
    """The forward and forward+backward (gradients in h and w) of ``loss``, a function of (h, w, labels)."""
    return {"forward": loss, "forward+backward": jax.value_and_grad(loss, argnums=(0, 1))}


def run_row(n: int, d: int, v: int, options: dict) -> dict:
    kh, kw, ky = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (v, d), jnp.float32) / np.sqrt(d)).astype(jnp.bfloat16)
    labels = jax.random.randint(ky, (n,), 0, v)
    args = (h, w, labels)

    def fused(h, w, labels):
        return nc.linear_cross_entropy(h, w, labels, **options)

    made = nc.linear_cross_entropy.kernel_for(h, w, labels, **options)
    kernels = list(made.kernel.backends.items())
    print(f"n={n} d={d} v={v}: backend {made.kernel.backend}" +
          (f" ({made.passed_over[:160]})" if made.passed_over else ""), flush=True)
    print(f"  blocks: {made.blocks}", flush=True)
    for what, backend in kernels:
        print(f"  {backend:6s} {what}", flush=True)
    wide = (h.astype(jnp.float32), w.astype(jnp.float32), labels)  # f32 gradients, not rounded to bf16
    value, grads = jax.jit(jax.value_and_grad(reference, argnums=(0, 1)))(*wide)
    want = [value, *grads]
    flops = 2.0 * n * d * v
    row = {"n": n, "d": d, "v": v, "backend": made.kernel.backend, "passed_over": made.passed_over,
           "blocks": made.blocks, "xla_blocks": made.signature.xla, "budget": made.signature.budget,
           "kernels": kernels, "ignore_index": options.get("ignore_index", -100), "logits_f32_bytes": 4 * n * v}
    del value, grads, wide
    memory = {"peak_bytes_in_use": peak_bytes}
    row["napkin"] = measure_passes("napkin", passes(fused), args, flops, want, memory)
    row["xla"] = measure_passes("xla", passes(unfused), args, flops, want, memory)
    for what in speedups(row):
        ours, theirs = row["napkin"][what], row["xla"][what]
        print(f"  {what:17s} napkin {ours['ms']:9.3f} ms ({ours['tflops']:6.1f} TFLOP/s, temp "
              f"{ours['temp_bytes']}) vs xla {theirs['ms']:9.3f} ms (temp {theirs['temp_bytes']}): "
              f"{theirs['ms'] / ours['ms']:.2f}× xla's speed", flush=True)
    return row


def plot(rows: list, path: Path, title: str) -> None:
    ticks = [f"n={r['n']}\nv={r['v']}" for r in rows]
    bar_plot(rows, path, title, {"napkin": "napkin-cat (fused)", "xla": "xla"}, "ms", ticks, "ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on a CPU (interpret mode)")
    parser.add_argument("--blocks", type=int, nargs=2, metavar=("TILE", "CHUNK"), default=None)
    parser.add_argument("--budget", type=int, default=None, help="bytes per f32 logit block on the XLA backend")
    parser.add_argument("--backend", default="auto", help="the entry's backend: auto, xla, triton, mosaic")
    parser.add_argument("--no-ignore", action="store_true", help="ignore_index=None (no ignored tokens)")
    opts = parser.parse_args(argv)
    options = dict(interpret=True if opts.smoke else None, blocks=tuple(opts.blocks) if opts.blocks else None,
                   budget=opts.budget, backend=opts.backend)
    if opts.no_ignore:
        options["ignore_index"] = None
    dev = device_info()
    stem = "linear_cross_entropy_" + device_stem(dev["kind"]) + ("_smoke" if opts.smoke else "")
    given = (("budget", opts.budget), ("backend_", opts.backend))
    stem += "".join(f"_{k}{v}" for k, v in given if v not in (None, "auto"))
    stem += "_no_ignore" if opts.no_ignore else ""
    title = f"linear cross-entropy, bf16, {dev['kind']}"
    write_rows(ROWS["smoke" if opts.smoke else "full"], lambda n, d, v: run_row(n, d, v, options), dev, opts.out,
               stem, lambda rows, path: plot(rows, path, title))


if __name__ == "__main__":
    main()
