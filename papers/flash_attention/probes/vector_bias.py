"""A bias per key (``[B, 1, 1, N]``, additive key padding) or per head and key (``[1, H, 1, N]``) in bf16, through
``nc.attention`` under ``auto`` (Mosaic GPU since stop 57: the vector held in f32, ``MosaicLowered.held``) against
the same call on Triton (``backend="triton"``, where ``auto`` ran it before) and cuDNN (``jax.nn``), in one process
(GPU). Each is first checked against an f32 ``jax.nn`` reference (forward and every gradient, the bias's included)
at N = 1024; then timed at B = 2, H = 16, N = 8192, D = 128, causal and not. One JSON line per case.

    python papers/flash_attention/probes/vector_bias.py [N]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering._timing import time_calls


def inputs(n, shape_of, seed):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v, ct = (jax.random.normal(kk, (2, n, 16, 128), jnp.bfloat16) for kk in keys[:4])
    bias = (jax.random.normal(keys[4], shape_of(n), jnp.float32) * 2).astype(jnp.bfloat16)
    return q, k, v, ct, bias


def implementations(causal):
    return {
        "auto": lambda q, k, v, b: nc.attention(q, k, v, bias=b, is_causal=causal),
        "triton": lambda q, k, v, b: nc.attention(q, k, v, bias=b, is_causal=causal, backend="triton"),
        "cudnn": lambda q, k, v, b: jax.nn.dot_product_attention(
            q, k, v, bias=b, is_causal=causal, implementation="cudnn"
        ),
    }


if __name__ == "__main__":
    n_time = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    shapes = {"[B,1,1,N]": lambda n: (2, 1, 1, n), "[1,H,1,N]": lambda n: (1, 16, 1, n)}
    print(json.dumps({"gpu": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    for name, shape_of in shapes.items():
        for causal in (False, True):
            seed = 57
            q, k, v, ct, bias = inputs(1024, shape_of, seed)
            f32 = [a.astype(jnp.float32) for a in (q, k, v, bias)]
            ref = lambda q, k, v, b, c=causal: jax.nn.dot_product_attention(q, k, v, bias=b, is_causal=c)  # noqa: E731
            want, pull = jax.vjp(ref, *f32)
            wants = pull(ct.astype(jnp.float32))
            res = {"bias": name, "causal": causal, "seed": seed}
            for impl, f in implementations(causal).items():
                try:
                    got, pull = jax.vjp(f, q, k, v, bias)
                    grads = pull(ct)
                    errs = [
                        float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))
                        for a, b in zip((got, *grads), (want, *wants), strict=True)
                    ]
                    res[f"{impl}_err"] = [round(e, 5) for e in errs]
                    if impl == "auto":
                        kern = nc.attention.kernel_for(q, k, v, bias=bias, is_causal=causal)
                        res["auto_backends"] = sorted(set(kern.kernel.backends.values()))
                except Exception as e:  # noqa: BLE001 - reported, then the next implementation
                    res[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            q, k, v, ct, bias = inputs(n_time, shape_of, seed)
            flops = 4 * 2 * 16 * n_time * n_time * 128 * (0.5 if causal else 1)
            for impl, f in implementations(causal).items():
                if f"{impl}_error" in res:
                    continue
                fwd = jax.jit(f)
                both = jax.jit(lambda q, k, v, b, f=f, ct=ct: jax.vjp(f, q, k, v, b)[1](ct))
                t1 = time_calls(fwd, q, k, v, bias, reps=10, batches=5, warmup=2)
                t2 = time_calls(both, q, k, v, bias, reps=10, batches=5, warmup=2)
                res[impl] = {
                    "fwd_ms": round(t1.ms, 4),
                    "fwd_tflops": round(flops / t1.ms / 1e9, 1),
                    "fwdbwd_ms": round(t2.ms, 4),
                    "fwdbwd_tflops": round(3.5 * flops / t2.ms / 1e9, 1),
                }
            for impl in ("triton", "cudnn"):
                if impl in res and "auto" in res:
                    res[f"auto_over_{impl}"] = [
                        round(res[impl]["fwd_ms"] / res["auto"]["fwd_ms"], 3),
                        round(res[impl]["fwdbwd_ms"] / res["auto"]["fwdbwd_ms"], 3),
                    ]
            print(json.dumps(res), flush=True)
