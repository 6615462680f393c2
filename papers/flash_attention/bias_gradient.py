"""The gradient kernel of a learned bias shared by the batch, over its blocks, warps and pipeline stages.

A learnable ``[H, N, N]`` bias (``nc.library.dot_product_attention(..., bias_batch=(h,))``) gets its
gradient ``dB = Σ_b dS`` from one backward kernel that tiles queries and keys and streams the batch one
element at a time (``stream(b, 1)``, :func:`lowering._backward.backward_of`). This script builds the causal
variant's forward and backward kernels at B = 2, H = 16, N = 8192, D = 128 (bf16), times each backward
kernel as lowered, then the dB kernel over a grid of (query tile, key tile, warps, stages), each checked
against the lowered one (relative error), and writes ``results/bias_gradient_<GPU>.json``. It is the
measurement behind ``Config.get_default``'s single stage for a stream of single elements.

    python -m papers.flash_attention.bias_gradient --out $OUT          # GPU
    python -m papers.flash_attention.bias_gradient --quick             # CPU: tiny sizes, interpret mode
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import napkin_cat as nc
from lowering import lower, median_time, plan
from lowering._backward import backward_of, run_pieces
from lowering._triton import Config, Lowered
from rewrites import derive, stream, tile

HERE = Path(__file__).parent
GRID = [  # (query tile, key tile, warps, stages)
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 1), (64, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 2),
    (64, 128, 8, 2), (64, 128, 4, 2), (128, 128, 8, 1), (32, 64, 4, 3), (64, 32, 4, 3),
]  # fmt: skip


def run(out: Path, quick: bool) -> Path:
    """Time the backward kernels and the dB grid; write and return the JSON."""
    B, N, H, D = (2, 64, 2, 32) if quick else (2, 8192, 16, 128)  # noqa: N806 - the usual names
    g, s = (16, 16) if quick else (128, 64)
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    att = nc.library.dot_product_attention(
        q, x, d, causal=True, batch=(b, h), bias_batch=(h,), bias_dtype="bf16", dtype="bf16"
    )
    sched = derive(att, tile(q, g), stream(x, s), verify=False).diagram
    forward, *kernels = lower(sched, interpret=quick).kernels
    bw = backward_of(sched)
    size = {"b": B, "h": H, "q": N, "x": N, "d": D}
    keys = jax.random.split(jax.random.key(0), len(att.dom) + 1)
    xs = [
        jax.random.normal(k, tuple(size[a.name] for a in w.axes), w.dtype.jnp)
        for k, w in zip(keys[:-1], att.dom.inside, strict=True)
    ]
    do = jax.random.normal(keys[-1], (B, H, N, D), jnp.bfloat16)
    outs = forward(*xs)
    timing = (lambda f, *a: 0.0) if quick else median_time
    kernels_ms, rows = [], []
    for piece, kernel, ins, res in run_pieces(bw, kernels, [*xs, do, *(outs[p] for p in bw.residuals)]):
        kernels_ms.append({"rules": [str(r) for r in piece.rules], "ms": timing(jax.jit(kernel), *ins) * 1e3})
        print(kernels_ms[-1], flush=True)
        if piece.outputs != (3,):  # the bias is input 3
            continue
        want = np.asarray(res[0], np.float32)
        for gq, gx, warps, stages in GRID:
            row = {"gq": gq, "gx": gx, "warps": warps, "stages": stages}
            try:
                sc = derive(piece.diagram, tile(q, min(gq, N)), tile(x, min(gx, N)), stream(b, 1), verify=False)
                f = jax.jit(Lowered(plan(sc.diagram), interpret=quick, config=Config(warps, stages)))
                got = np.asarray(f(*ins), np.float32)
                row["rel_err"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
                row["ms"] = timing(f, *ins) * 1e3
            except Exception as e:  # a configuration over the shared-memory limit is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:150]}"
            print(row, flush=True)
            rows.append(row)
    kind = jax.devices()[0].device_kind
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bias_gradient_{'cpu_quick' if quick else kind.replace(' ', '_')}.json"
    sizes = {"B": B, "N": N, "H": H, "D": D}
    path.write_text(json.dumps({"gpu": kind, "sizes": sizes, "kernels": kernels_ms, "db_grid": rows}, indent=1))
    print(f"wrote {path}")
    return path


def main(argv=None) -> Path:
    """Parse ``argv`` and run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU)")
    args = p.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    main()
