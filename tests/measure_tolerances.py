"""Measure the error of the lowered kernels against tests/references.py, per dtype: the numbers behind the
tolerances in tests/test_kernels_vs_jax.py, tests/test_lowering.py and tests/test_backward.py.

Run ``python tests/measure_tolerances.py [seeds]`` (interpret mode on CPU; a few minutes). It prints, per
kernel, dtype and pass, the largest ``references.rel_err`` (max |error| / max |reference|) over the seeds
and sizes. Inputs are standard normal; bf16/f16 references get the same rounded inputs, upcast to f32.
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict

import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering import lower
from rewrites import derive, stream, tile

sys.path.insert(0, os.path.dirname(__file__))
import references as R  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

DTYPES = (nc.f32, nc.bf16, nc.f16)
ATTENTION_SIZES = ((37, 29), (20, 70), (70, 21), (64, 64))  # (queries, keys): ragged, q < x, q > x, whole


def normal(key, shapes, dtype, f32_from=None):
    """Standard normal arrays in ``dtype``; those from position ``f32_from`` on (a norm's γ, β) in f32."""
    keys = jax.random.split(key, len(shapes))
    dtypes = [dtype.jnp if f32_from is None or i < f32_from else jnp.float32 for i in range(len(shapes))]
    return [jax.random.normal(k, s, jnp.float32).astype(t) for k, s, t in zip(keys, shapes, dtypes, strict=True)]


def alibi(s, q, x):
    return s - 0.1 * jnp.abs(q - x).astype(jnp.float32)


def attention_cases(dtype):
    """(name, kernel, shapes, reference) for MHA plain and causal, and GQA with scale, ALiBi and causal."""
    b, h, q, x, d, hk, g = nc.axes("b h q x d hk g")
    for causal in (False, True):
        mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype=dtype)
        kernel = lower(derive(mha, tile(q, 16), stream(x, 16), verify=False))
        for nq, nx in ATTENTION_SIZES:
            shapes = [(1, 2, nq, 16), (1, 2, nx, 16), (1, 2, nx, 16)]
            yield f"mha causal={causal}", kernel, shapes, lambda Q, K, V, c=causal: R.attention(Q, K, V, causal=c)
    gqa = nc.library.grouped_query_attention(hk, g, q, x, d, scale=0.2, score_mod=alibi, causal=True, dtype=dtype)
    kernel = lower(derive(gqa, tile(q, 16), stream(x, 16), verify=False), backward="reference")

    def reference(Q, K, V):
        flat = Q.reshape(-1, *Q.shape[2:])
        bias = lambda i, j: -0.1 * jnp.abs(i - j)  # noqa: E731
        out = R.attention(flat, K, V, scale=0.2, causal=True, bias=bias, groups=Q.shape[1])
        return out.reshape(Q.shape)

    for nq, nx in ATTENTION_SIZES[:3]:
        yield "gqa+scale+alibi+causal", kernel, [(2, 3, nq, 16), (2, nx, 16), (2, nx, 16)], reference


def other_cases(dtype):
    n, k, c, dd = nc.axes("n k c dd")
    mm = nc.library.matmul(n, k, c, dtype=dtype)
    tiled = lower(derive(mm, tile(n, 16), tile(c, 16), stream(k, 16), verify=False))
    yield "matmul", tiled, [(40, 37), (37, 24)], R.matmul
    sm = nc.library.softmax(n, k, dtype=dtype)
    yield "softmax", lower(derive(sm, tile(n, 16), verify=False)), [(37, 64)], R.softmax
    ln = nc.library.layer_norm(n, dd, dtype=dtype)
    yield "layer_norm", lower(derive(ln, tile(n, 16), verify=False)), [(20, 32), (32,), (32,)], R.layer_norm
    rms = nc.library.rms_norm(n, dd, dtype=dtype)
    yield "rms_norm", lower(derive(rms, tile(n, 16), verify=False)), [(20, 32), (32,)], R.rms_norm
    if dtype == nc.f32:
        ce = nc.library.cross_entropy(n, k)
        yield "cross_entropy", lower(derive(ce, tile(n, 16), stream(k, 16), verify=False)), [(20, 40)], None
        st = nc.library.layer_norm_statistics(n, dd)
        yield "layer_norm_statistics", lower(derive(st, tile(n, 16), stream(dd, 16), verify=False)), [(20, 40)], None


def measure(seeds: int) -> dict:
    """The largest relative error per (kernel, dtype, pass), printed as each kernel is done."""
    worst: dict = defaultdict(float)
    for dtype in DTYPES:
        for name, kernel, shapes, ref in attention_cases(dtype):
            fwd = jax.jit(kernel)
            vjp = jax.jit(lambda ct, *a, f=kernel: jax.vjp(f, *a)[1](ct.astype(a[0].dtype)))
            vjp_ref = jax.jit(lambda ct, *a, f=ref: jax.vjp(f, *a)[1](ct))
            for seed in range(seeds):
                key = jax.random.key(seed)
                args = normal(key, shapes, dtype)
                (ct,) = normal(jax.random.fold_in(key, 1), [shapes[0]], nc.f32)
                err = R.rel_err(fwd(*args), ref(*args))
                worst[name, dtype.name, "forward"] = max(worst[name, dtype.name, "forward"], err)
                ours = vjp(ct, *args)
                ct = ct.astype(dtype.jnp).astype(jnp.float32)  # the kernel sees the cotangent in its dtype
                want = vjp_ref(ct, *(a.astype(jnp.float32) for a in args))
                for i, (a, b) in enumerate(zip(ours, want, strict=True)):
                    k = (name, dtype.name, f"grad {'QKV'[i]}")
                    worst[k] = max(worst[k], R.rel_err(a, b))
            report(worst, name, dtype)
        for name, kernel, shapes, ref in other_cases(dtype):
            fwd = jax.jit(kernel)
            for seed in range(seeds):
                args = normal(jax.random.key(seed), shapes, dtype, f32_from=1 if "norm" in name else None)
                if name == "cross_entropy":
                    labels = jax.random.randint(jax.random.key(seed + 1), (shapes[0][0],), 0, shapes[0][1])
                    args = [args[0], jax.nn.one_hot(labels, shapes[0][1])]
                    errs = [R.rel_err(fwd(*args), R.cross_entropy(*args))]
                elif name == "layer_norm_statistics":
                    errs = [R.rel_err(a, b) for a, b in zip(fwd(*args), R.layer_norm_statistics(*args), strict=True)]
                else:
                    errs = [R.rel_err(fwd(*args), ref(*args))]
                worst[name, dtype.name, "forward"] = max(worst[name, dtype.name, "forward"], *errs)
            report(worst, name, dtype)
    return worst


def report(worst: dict, name: str, dtype):
    for (n, t, what), err in sorted(worst.items()):
        if (n, t) == (name, dtype.name):
            print(f"{n:28s} {t:5s} {what:8s} {err:.2e}", flush=True)


if __name__ == "__main__":
    measure(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
