"""The backward kernels of a learned bias shared by the batch, each over its blocks, warps and pipeline stages.

A learnable ``[H, N, N]`` bias (``nc.library.dot_product_attention(..., bias_batch=(h,))``) adds a
``[q, x]`` block to every score block, and gets its gradient ``dB = Σ_b dS`` from one backward kernel that
tiles queries and keys and streams the batch one element at a time (``stream(b, 1)``,
:func:`lowering._backward.backward_of`). This script builds the causal variant's forward and backward kernels
at B = 2, H = 16, N = 8192, D = 128 (bf16), times each backward kernel as lowered, then each of dQ, dK·dV and
dB re-derived over its grid of (tile, stream or second tile, warps, stages), each checked against the kernel
as lowered (relative error), and writes ``results/bias_gradient_<GPU>.json``. It is the measurement behind
``Config.get_default``'s single stage for a stream of single elements, and behind the blocks the backward
of a kernel reading a ``[q, x]`` block gets (``lowering._backward``).

With ``--shared`` the bias is one ``[N, N]`` f32 array shared by the batch and the heads (what a learned
relative-position table read at ``q_idx - kv_idx`` becomes, ``docs/lowering.md``): dB then streams the heads
(``stream(h, 1)``, sixteen steps where the batch gave two), and its grid adds pipeline stages and warps.
``--kernels dB`` sweeps one kernel's grid (the others are still timed as lowered).

    python -m papers.flash_attention.bias_gradient --out $OUT          # GPU
    python -m papers.flash_attention.bias_gradient --shared --kernels dB --out $OUT
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
from lowering import Config, lower
from lowering._backward import backward_of, run_pieces
from papers.flash_attention.backward_configs import rederived
from papers.flash_attention.timing import time_calls
from rewrites import derive, stream, tile

HERE = Path(__file__).parent
#: per kernel (named by the inputs it differentiates): (tile, stream or key tile, warps, stages)
GRIDS = {
    "dQ": [(128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3)],
    "dKdV": [
        (128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 32, 4, 3),
        (64, 64, 4, 2), (128, 16, 8, 3),
    ],
    "dB": [
        (64, 64, 4, 1), (64, 64, 4, 2), (128, 64, 8, 1), (64, 128, 8, 1), (128, 64, 4, 1), (64, 128, 4, 1),
        (128, 128, 8, 1), (32, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1),
    ],
    # a bias shared by the batch and the heads: sixteen heads streamed, so a deeper pipeline has steps to fill
    "dB shared": [
        (64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 64, 8, 1), (128, 64, 8, 2),
        (128, 64, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (32, 64, 4, 2), (128, 128, 8, 1), (128, 64, 4, 1),
    ],
}  # fmt: skip
#: the kernel by the inputs it differentiates (the bias is input 3)
NAMES = {(0,): "dQ", (1, 2): "dKdV", (3,): "dB"}


def run(out: Path, quick: bool, shared: bool = False, kernels: tuple = ("dQ", "dKdV", "dB")) -> Path:
    """Time the backward kernels and the grids of ``kernels``; write and return the JSON."""
    B, N, H, D = (2, 64, 2, 32) if quick else (2, 8192, 16, 128)  # noqa: N806 - the usual names
    g, s = (16, 16) if quick else (128, 64)
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    att = nc.library.dot_product_attention(
        q,
        x,
        d,
        causal=True,
        batch=(b, h),
        bias_batch=() if shared else (h,),
        bias_dtype="f32" if shared else "bf16",
        dtype="bf16",
    )
    sched = derive(att, tile(q, g), stream(x, s), verify=False).diagram
    forward, *lowered = lower(sched, interpret=quick).kernels
    bw = backward_of(sched)
    size = {"b": B, "h": H, "q": N, "x": N, "d": D}
    keys = jax.random.split(jax.random.key(0), len(att.dom) + 1)
    xs = [
        jax.random.normal(k, tuple(size[a.name] for a in w.axes), w.dtype.jnp)
        for k, w in zip(keys[:-1], att.dom.inside, strict=True)
    ]
    do = jax.random.normal(keys[-1], (B, H, N, D), jnp.bfloat16)
    outs = forward(*xs)
    timing = (lambda f, *a: 0.0) if quick else (lambda f, *a: time_calls(f, *a).seconds)
    kernels_ms, rows = [], []
    for piece, kernel, ins, res in run_pieces(bw, lowered, [*xs, do, *(outs[p] for p in bw.residuals)]):
        name = NAMES[piece.outputs]
        kernels_ms.append(
            {"kernel": name, "rules": [str(r) for r in piece.rules], "ms": timing(jax.jit(kernel), *ins) * 1e3}
        )
        print(kernels_ms[-1], flush=True)
        want = [np.asarray(r, np.float32) for r in res]
        grid = [] if name not in kernels else GRIDS[f"{name} shared" if shared and name == "dB" else name]
        for first, second, warps, stages in grid[:1] if quick else grid:
            row = {"kernel": name, "tile": first, "second": second, "warps": warps, "stages": stages}
            if name == "dB":  # queries and keys tiled, the batch (or, shared, the heads) streamed
                rules = (tile(q, min(first, N)), tile(x, min(second, N)), stream(h if shared else b, 1))
            else:
                tiled, streamed = (q, x) if name == "dQ" else (x, q)
                rules = (tile(tiled, min(first, N)), stream(streamed, min(second, N)))
            try:
                f, row["rel_err"] = rederived(piece.diagram, rules, Config(warps, stages), ins, want, quick)
                row["ms"] = timing(f, *ins) * 1e3
            except Exception as e:  # a configuration over the shared-memory limit is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:150]}"
            print(row, flush=True)
            rows.append(row)
    kind = jax.devices()[0].device_kind
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bias_gradient_{'cpu_quick' if quick else kind.replace(' ', '_')}{'_shared' if shared else ''}.json"
    sizes = {"B": B, "N": N, "H": H, "D": D}
    path.write_text(json.dumps({"gpu": kind, "sizes": sizes, "kernels": kernels_ms, "grid": rows}, indent=1))
    print(f"wrote {path}")
    return path


def main(argv=None) -> Path:
    """Parse ``argv`` and run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU)")
    p.add_argument("--shared", action="store_true", help="one [N, N] f32 bias shared by the batch and the heads")
    p.add_argument("--kernels", default="dQ,dKdV,dB", help="the kernels whose grids to sweep (comma-separated)")
    args = p.parse_args(argv)
    return run(args.out, args.quick, args.shared, tuple(args.kernels.split(",")))


if __name__ == "__main__":
    main()
