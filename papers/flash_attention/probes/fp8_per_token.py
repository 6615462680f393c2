"""FP8 attention's forward with one scale per token and head for q and k (``nc.fp8_quantize(..., per="token")``:
descales ``[B, N, H]``, inputs of the kernel) beside one scale per tensor, on Triton, Mosaic and ``auto``, and
bf16 ``auto``: what the per-token scales cost, and which kernel (blocks, backend) each call ran. B = 2, H = 16,
D = 128, N ∈ {2048, 8192} (argv), not causal; every output first checked against an f32 ``jax.numpy`` reference
on the unrounded inputs (RMSE printed). TFLOP/s count 4·B·H·N²·D (GPU)::

    python papers/flash_attention/probes/fp8_per_token.py [N ...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402


def reference(q, k, v):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def main(ns):
    rows = []
    for n in ns:
        q, k, v = (jax.random.normal(jax.random.key(i), (2, n, 16, 128), jnp.float32) for i in range(3))
        want = reference(q[:1], k[:1], v[:1])
        flops = 4 * 2 * 16 * n * n * 128
        tensor = nc.fp8_quantize(q, k, v, per="tensor")
        token = nc.fp8_quantize(q, k, v, per="token")
        b16 = [a.astype(jnp.bfloat16) for a in (q, k, v)]
        cases = {  # each call's arrays and nc.attention's options: kernel_for picks the same kernel the call runs
            "bf16 auto": (b16, {}),
            "fp8 per tensor auto": (tensor[:3], {"fp8_scales": tensor[3]}),
            "fp8 per tensor triton": (tensor[:3], {"fp8_scales": tensor[3], "backend": "triton"}),
        }
        for b in ("auto", "triton", "mosaic"):
            cases[f"fp8 per token {b}"] = (token[:3], {"fp8_scales": token[3], "backend": b})
        base = {}
        for name, (args, options) in cases.items():
            g = jax.jit(lambda q, k, v, o=options: nc.attention(q, k, v, **o))
            try:
                out = g(*args)
                rmse = float(jnp.sqrt(jnp.mean((out[:1].astype(jnp.float32) - want) ** 2)))
                ms = time_calls(g, *args).ms
                made = nc.attention.kernel_for(*args, **options)
                blocks = f"{made.signature.tile}x{made.signature.stream} on {made.backend}"
            except Exception as e:  # a refusal is a result
                print(f"N={n} {name:26s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append({"n": n, "impl": name, "error": f"{type(e).__name__}: {e}"[:500]})
                continue
            base[name] = ms
            row = {"n": n, "impl": name, "ms": ms, "tflops": flops / ms / 1e9, "rmse": rmse, "kernel": blocks}
            rows.append(row)
            ratio = f"{base.get('fp8 per tensor triton', ms) / ms:.2f}× fp8 per tensor triton"
            line = f"N={n} {name:26s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s rmse {rmse:.2e}  {ratio}"
            print(f"{line}  [{blocks}]", flush=True)
    return rows


if __name__ == "__main__":
    ns = [int(a) for a in sys.argv[1:]] or [2048, 8192]
    rows = main(ns)
    name = jax.devices()[0].device_kind.replace(" ", "_")
    out = Path(__file__).resolve().parents[1] / "results" / f"probes_fp8_per_token_{name}.json"
    out.write_text(json.dumps({"device": jax.devices()[0].device_kind, "rows": rows}, indent=1))
    print("wrote", out)
