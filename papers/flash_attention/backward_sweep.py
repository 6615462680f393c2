"""The derived backward's kernels on a GPU, one run: gradients checked, each kernel timed, blocks and warps swept.

1. Gradients of the lowered kernel (bf16) against ``jax.vjp`` of ``jax.nn.dot_product_attention`` in f32 on the
   same device, at N = 1024, D = 64 and 128, causal or not (``max_rel_err`` ≤ 4e-2, tests/test_backward.py's
   GPU tolerance).
2. Forward + backward of the lowered kernel and of cuDNN (``jax.grad`` of ``Σ out ⊙ dO``), B·N = 16k tokens,
   16 heads, TFLOP/s at 3.5× the forward's 4·B·H·N²·D (halved when causal), as ``benchmark.py`` counts.
3. Each backward kernel (Δ, dQ, dK·dV) at its default blocks and ``Config``, then dQ and dK·dV over a grid of
   (tile, stream) blocks × warps × stages, N = 8192, non-causal; TFLOP/s at dQ: 3, dK·dV: 4 matmuls of 2·N²·D.

Every configuration that fails (a compile error, shared memory) is recorded with its error; ``--budget-s`` stops
the sweep early. On CPU, ``--quick`` runs tiny sizes in interpret mode (a smoke test, no timings worth reading).

    python -m papers.flash_attention.backward_sweep --out papers/flash_attention/results/backward_sweep.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import napkin_cat as nc
from lowering import Config, lower, plan
from lowering import TritonLowered as Lowered
from lowering._backward import backward_of
from papers.flash_attention.timing import time_calls
from rewrites import derive, stream, tile


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def flash(D: int, causal: bool, dtype=nc.bf16):
    b, h, q, x, d = nc.axes("b h q x d", d=D)
    attn = nc.library.attention(q, x, d, causal=causal, batch=(b, h), dtype=dtype)
    return derive(attn, tile(q, 128), stream(x, 64), verify=False)


def inputs(B, H, N, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, (B, H, N, D), jnp.float32).astype(jnp.bfloat16) for k in keys]


def dpa(causal, implementation=None):
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn takes [B, N, H, D]
    return lambda Q, K, V: t(
        jax.nn.dot_product_attention(t(Q), t(K), t(V), is_causal=causal, implementation=implementation)
    )


def fwd_bwd(f):
    def run(Q, K, V, dO):
        out, vjp = jax.vjp(f, Q, K, V)
        return (out, *vjp(dO))

    return jax.jit(run)


def check(N, quick):
    rows = []
    for D in (16,) if quick else (64, 128):
        for causal in (False, True):
            Q, K, V, dO = inputs(1, 2 if quick else 4, N, D)
            got = fwd_bwd(lower(flash(D, causal)))(Q, K, V, dO)
            f32 = [a.astype(jnp.float32) for a in (Q, K, V, dO)]
            want = fwd_bwd(dpa(causal))(*f32)
            errs = [rel_err(a.astype(jnp.float32), w) for a, w in zip(got, want, strict=True)]
            rows.append(
                {"D": D, "N": N, "causal": causal, "max_rel_err": dict(zip(["O", "dQ", "dK", "dV"], errs, strict=True))}
            )
            print("check", rows[-1], flush=True)
    return rows


def end_to_end(tokens, heads, quick, deadline):
    rows = []
    for D in (16,) if quick else (64, 128):
        for N in (64,) if quick else (2048, 8192):
            for causal in (False, True):
                B = max(tokens // N, 1)
                args = inputs(B, heads, N, D)
                flops = 3.5 * 4 * B * heads * N * N * D / (2 if causal else 1)
                row = {"D": D, "N": N, "B": B, "H": heads, "causal": causal}
                for name, f in (
                    ("napkin", lower(flash(D, causal))),
                    ("cudnn", None if quick else dpa(causal, "cudnn")),
                ):
                    if f is None or time.time() > deadline:
                        continue
                    try:
                        t = time_calls(fwd_bwd(f), *args).seconds
                        row[name] = {"ms": t * 1e3, "tflops": flops / t / 1e12}
                    except Exception as e:  # noqa: BLE001 - a failure is a result to record
                        row[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                if "tflops" in row.get("napkin", {}) and "tflops" in row.get("cudnn", {}):
                    row["vs_cudnn"] = row["napkin"]["tflops"] / row["cudnn"]["tflops"]
                rows.append(row)
                print("fwd+bwd", row, flush=True)
    return rows


def pieces(D, N, B, H, causal=False):
    """The backward's pieces and the values they read, from one forward of the lowered kernel."""
    kernel = lower(flash(D, causal))
    b = backward_of(kernel.diagram, kernel.forward.hardware)
    Q, K, V, dO = inputs(B, H, N, D)
    out, lse = kernel.kernels[0](Q, K, V)
    values = [Q, K, V, dO, lse, out]
    for p, k in zip(b.pieces, kernel.kernels[1:], strict=True):
        if p.feeds:
            values.append(k(*(values[i] for i in p.inputs)))
    return kernel, b, values


def sweep(tokens, heads, quick, deadline, grid=True, only=None):
    rows = []
    N = 64 if quick else 8192
    for D in (16,) if quick else (128, 64):
        B = max(tokens // N, 1)
        kernel, b, values = pieces(D, N, B, heads)
        matmul = 2 * B * heads * N * N * D
        for p, k in zip(b.pieces, kernel.kernels[1:], strict=True):
            args = [values[i] for i in p.inputs]
            name = "delta" if p.feeds else {(0,): "dQ", (1, 2): "dKV"}[p.outputs]
            t = time_calls(jax.jit(k), *args, reps=10, batches=3, warmup=1).seconds
            config = Config.get_default(k.plan)
            row = {
                "D": D,
                "N": N,
                "kernel": name,
                "rules": [str(r) for r in p.rules],
                "default": True,
                "warps": config.num_warps,
                "stages": config.num_stages,
                "ms": t * 1e3,
            }
            if not p.feeds:
                row["tflops"] = (3 if name == "dQ" else 4) * matmul / t / 1e12
            rows.append(row)
            print("kernel", row, flush=True)
            if p.feeds or not grid or (only and name not in only):
                continue
            tiled = [str(r).startswith("tile") for r in p.rules]
            for g, s in ((16, 16),) if quick else ((128, 64), (64, 64), (128, 32), (64, 32), (128, 128), (64, 128)):
                for warps in (4,) if quick else (4, 8):
                    for stages in (2,) if quick else (2, 3):
                        if time.time() > deadline:
                            return rows
                        rules = [
                            tile(r.name, g) if t else stream(r.name, s) for r, t in zip(p.rules, tiled, strict=True)
                        ]
                        row = {
                            "D": D,
                            "N": N,
                            "kernel": name,
                            "rules": [str(r) for r in rules],
                            "warps": warps,
                            "stages": stages,
                        }
                        try:
                            scheduled = derive(p.diagram, *rules, verify=False).diagram
                            lk = Lowered(plan(scheduled), config=Config(num_warps=warps, num_stages=stages))
                            t = time_calls(jax.jit(lk), *args, reps=10, batches=3, warmup=1).seconds
                            row |= {"ms": t * 1e3, "tflops": (3 if name == "dQ" else 4) * matmul / t / 1e12}
                        except Exception as e:  # noqa: BLE001 - a failure is a result to record
                            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                        rows.append(row)
                        print("sweep", row, flush=True)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--sections", default="check,fwdbwd,kernels,grid", help="any of check, fwdbwd, kernels, grid")
    ap.add_argument("--grid-kernels", default="", help="sweep only these kernels (dQ, dKV; default: both)")
    args = ap.parse_args(argv)
    start = time.time()
    deadline = start + args.budget_s
    device = jax.devices()[0].device_kind
    result = {"device": device, "jax": jax.__version__, "argv": argv}

    def save():
        result["elapsed_s"] = time.time() - start
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    sections = args.sections.split(",")
    tokens, heads = (128, 2) if args.quick else (args.tokens, args.heads)
    if "check" in sections:
        result["check"] = check(64 if args.quick else 1024, args.quick)
        save()
    if "fwdbwd" in sections:
        result["fwd_bwd"] = end_to_end(tokens, heads, args.quick, deadline)
        save()
    if "kernels" in sections:
        only = set(filter(None, args.grid_kernels.split(",")))
        result["kernels"] = sweep(tokens, heads, args.quick, deadline, grid="grid" in sections, only=only)
        save()
    return result


if __name__ == "__main__":
    main()
