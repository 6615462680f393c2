"""Blocks, warps and stages for short loops: attention whose kernels visit few chunks per block.

A sliding window (W = N/8) and short sequences (N = 1024, as the documents of ``document_skipping.py``) leave
each block of queries (keys, in dK·dV) a loop of 9–18 chunks, where a block of long causal attention loops
over 65 on average: the work each block does once (loading its tile, writing its output, filling the
pipeline) weighs more. This script times the causal and sliding-window kernels (``lowering.lower`` of
``nc.library``'s diagrams, bf16, B·N = 16k tokens, H = 16, D = 128), forward and forward + backward, over a
grid of (query tile, key chunk, warps, stages); each configuration's output is checked against the first's
(relative error) and the TFLOP/s count the pairs each mask keeps (4·D per pair forward, × 3.5 with the
backward), so the cases compare. Writes ``results/short_loops_<GPU>.json``::

    python -m papers.flash_attention.short_loops --out $OUT     # GPU
    python -m papers.flash_attention.short_loops --quick        # CPU: tiny sizes, interpret mode
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering import Config, lower
from papers.flash_attention.timing import time_calls
from rewrites import derive, stream, tile

HERE = Path(__file__).parent
GRID = [  # (query tile, key chunk, warps, stages); the first is the library's default
    (128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 4, 2), (128, 32, 4, 3),
    (64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (128, 128, 8, 2),
]  # fmt: skip
CASES = ("causal N=8192", "window N=8192", "causal N=1024")


def case(name: str, quick: bool):
    """The diagram of a case, its (B, N) and the number of (query, key) pairs its mask keeps per head."""
    n = (64 if "8192" in name else 32) if quick else int(name.split("=")[1])
    batch = (256 if quick else 16 * 1024) // n
    b, h, q, x, d = nc.axes("b h q x d", d=16 if quick else 128)
    if name.startswith("window"):
        w = n // 8
        pairs = sum(min(i + 1, w) for i in range(n))
        return nc.library.sliding_window_attention(q, x, d, window=w, batch=(b, h), dtype="bf16"), batch, n, pairs
    return nc.library.attention(q, x, d, causal=True, batch=(b, h), dtype="bf16"), batch, n, n * (n + 1) // 2


def run(out: Path, quick: bool) -> Path:
    heads, dim = (2, 16) if quick else (16, 128)
    rows, start = [], time.time()
    for name in CASES:
        diagram, batch, n, pairs = case(name, quick)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, do = (jax.random.normal(key, (batch, heads, n, dim), jnp.bfloat16) for key in keys)
        flops = 4 * batch * heads * dim * pairs
        first = None
        for gq, gx, warps, stages in GRID[:2] if quick else GRID:
            gq, gx = (16, 16) if quick else (gq, gx)
            row = {"case": name, "B": batch, "N": n, "tile": gq, "chunk": gx, "warps": warps, "stages": stages}
            try:
                kernel = lower(
                    derive(diagram, tile("q", gq), stream("x", gx), verify=False),
                    config=Config(num_warps=warps, num_stages=stages),
                    interpret=quick,
                )
                fwd = jax.jit(kernel)
                out_ = fwd(q, k, v).astype(jnp.float32)
                first = out_ if first is None else first
                row["rel_err"] = float(jnp.max(jnp.abs(out_ - first)) / jnp.max(jnp.abs(first)))

                def loss(q, k, v, kernel=kernel, do=do):
                    return jnp.sum(kernel(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

                both = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                reps = dict(reps=2, batches=1, warmup=1) if quick else {}
                tf, tb = time_calls(fwd, q, k, v, **reps).seconds, time_calls(both, q, k, v, **reps).seconds
                row |= {"fwd_ms": tf * 1e3, "fwd_tflops": flops / tf / 1e12}
                row |= {"fwd_bwd_ms": tb * 1e3, "fwd_bwd_tflops": 3.5 * flops / tb / 1e12}
            except Exception as e:  # noqa: BLE001 - a configuration that does not build is a result
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"[{time.time() - start:6.1f}s] {json.dumps(row)}", flush=True)
    result = {"gpu": jax.devices()[0].device_kind, "heads": heads, "dim": dim, "grid": GRID, "rows": rows}
    path = out / f"short_loops_{result['gpu'].replace(' ', '_')}.json"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"\n{'case':<16} {'tile':>4} {'chunk':>5} {'warps':>5} {'stages':>6} {'fwd TF/s':>9} {'fwd+bwd TF/s':>13}")
    for r in rows:
        cells = f"{r.get('fwd_tflops', float('nan')):9.1f} {r.get('fwd_bwd_tflops', float('nan')):13.1f}"
        print(f"{r['case']:<16} {r['tile']:>4} {r['chunk']:>5} {r['warps']:>5} {r['stages']:>6} {cells}")
    return path


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "results")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU smoke test)")
    args = ap.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    main()
