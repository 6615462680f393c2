"""A bias per key (``[B, 1, 1, N]``, additive key padding) or per head and key (``[1, H, 1, N]``) in bf16, and a bool
key-padding mask ``[B, 1, 1, N]``, through ``nc.attention`` under ``auto`` (Mosaic GPU since stop 57: the vector
held in f32, ``MosaicLowered.held``) against the same call on Triton (``backend="triton"``, where ``auto`` ran them
before) and cuDNN (``jax.nn``), in one process (GPU). Each is first checked against an f32 ``jax.nn`` reference
(forward and every gradient, the bias's included) at N = 1024; then timed at B = 2, H = 16, N = 8192, D = 128,
causal and not. One JSON line per case.

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

#: name → (keyword, shape at N): the vector each case passes
CASES = {
    "bias [B,1,1,N]": ("bias", lambda n: (2, 1, 1, n)),
    "bias [1,H,1,N]": ("bias", lambda n: (1, 16, 1, n)),
    "mask [B,1,1,N]": ("mask", lambda n: (2, 1, 1, n)),
}


def inputs(n, kind, shape, seed):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v, ct = (jax.random.normal(kk, (2, n, 16, 128), jnp.bfloat16) for kk in keys[:4])
    if kind == "bias":
        return q, k, v, ct, (jax.random.normal(keys[4], shape, jnp.float32) * 2).astype(jnp.bfloat16)
    return q, k, v, ct, jax.random.bernoulli(keys[4], 0.8, shape).at[..., 0].set(True)  # key 0 kept: no empty row


def implementations(kind, causal):
    def call(**kw):
        return lambda q, k, v, a: nc.attention(q, k, v, **{kind: a}, is_causal=causal, **kw)

    return {
        "auto": call(),
        "triton": call(backend="triton"),
        "cudnn": lambda q, k, v, a: jax.nn.dot_product_attention(
            q, k, v, **{kind: a}, is_causal=causal, implementation="cudnn"
        ),
    }


def errors(f, args, ct, want, wants, kind):
    n = 4 if kind == "bias" else 3  # a mask has no gradient
    got, pull = jax.vjp(lambda *a: f(*a[:3], a[3] if kind == "bias" else args[3]), *args[:n])
    return [
        round(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b))), 5)
        for a, b in zip((got, *pull(ct)), (want, *wants), strict=True)
    ]


if __name__ == "__main__":
    n_time = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    print(json.dumps({"gpu": jax.devices()[0].device_kind, "jax": jax.__version__}), flush=True)
    for name, (kind, shape_of) in CASES.items():
        for causal in (False, True):
            seed = 57
            q, k, v, ct, a = inputs(1024, kind, shape_of(1024), seed)
            f32 = [x.astype(jnp.float32) for x in (q, k, v)] + [a.astype(jnp.float32) if kind == "bias" else a]
            n = 4 if kind == "bias" else 3

            def reference(*x, c=causal, kind=kind, a=a):
                return jax.nn.dot_product_attention(*x[:3], **{kind: x[3] if kind == "bias" else a}, is_causal=c)

            want, pull = jax.vjp(reference, *f32[:n])
            wants = pull(ct.astype(jnp.float32))
            res = {"case": name, "causal": causal, "seed": seed}
            for impl, f in implementations(kind, causal).items():
                try:
                    res[f"{impl}_err"] = errors(f, (q, k, v, a), ct, want, wants, kind)
                    if impl == "auto":
                        kern = nc.attention.kernel_for(q, k, v, **{kind: a}, is_causal=causal)
                        res["auto_backends"] = sorted(set(kern.kernel.backends.values()))
                except Exception as e:  # noqa: BLE001 - reported, then the next implementation
                    res[f"{impl}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            q, k, v, ct, a = inputs(n_time, kind, shape_of(n_time), seed)
            flops = 4 * 2 * 16 * n_time * n_time * 128 * (0.5 if causal else 1)
            for impl, f in implementations(kind, causal).items():
                if f"{impl}_error" in res:
                    continue
                fwd = jax.jit(f)
                both = jax.jit(lambda q, k, v, a, f=f, ct=ct: jax.vjp(lambda q, k, v: f(q, k, v, a), q, k, v)[1](ct))
                t1 = time_calls(fwd, q, k, v, a, reps=10, batches=5, warmup=2)
                t2 = time_calls(both, q, k, v, a, reps=10, batches=5, warmup=2)
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
