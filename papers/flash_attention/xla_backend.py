"""The README's example (multi-head causal attention, bf16, b = 2, h = 4, N = 256, d = 64) on a CPU: the XLA
backend (``lower(..., backend="xla")``) against the Triton kernel in interpret mode: the forward jitted, the
gradients as the README takes them (``jax.grad`` of the kernel, not jitted) and jitted; each after one warm-up
call (first-call times, which include compiling, printed apart). Prints; asserts nothing.

    PYTHONPATH=$PWD python papers/flash_attention/xla_backend.py
"""

import time

import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering import lower
from rewrites import derive, level, stream, tile


def timed(fn, *args, reps: int = 5) -> tuple[float, float]:
    """(first call, median of ``reps`` later calls), seconds."""
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return first, sorted(times)[len(times) // 2]


def main():
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True, dtype=nc.bf16)
    flash = derive(attn, tile(q), stream(x), level(nc.SMEM), verify=False)
    Q, K, V = (jax.random.normal(jax.random.key(i), (2, 4, 256, 64), jnp.bfloat16) for i in range(3))
    ref = nc.to_jax(attn)(Q, K, V).astype(jnp.float32)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; b=2 h=4 N=256 d=64 bf16 causal")
    rows = {}
    for backend in ("xla", "triton"):  # triton: interpret mode on a CPU
        kernel = lower(flash, backend=backend)
        fwd = jax.jit(kernel)
        grad = jax.grad(lambda Q, K, V, kernel=kernel: kernel(Q, K, V).astype(jnp.float32).sum(), argnums=(0, 1, 2))
        err = float(jnp.max(jnp.abs(fwd(Q, K, V).astype(jnp.float32) - ref)))
        rows[backend] = [timed(fwd, Q, K, V), timed(grad, Q, K, V, reps=1), timed(jax.jit(grad), Q, K, V, reps=3)]
        print(f"{backend:7s} tiles {kernel.tiles}, max |out − to_jax| {err:.3g}")
        for what, (first, t) in zip(("jit(kernel)", "grad (README)", "jit(grad)"), rows[backend], strict=True):
            print(f"  {what:14s} {t * 1e3:10.2f} ms   (first call {first:6.2f} s)")
    ratios = [t / x for (_, t), (_, x) in zip(rows["triton"], rows["xla"], strict=True)]
    print("interpret ÷ XLA: jit(kernel) {:.1f}×, grad (README) {:.1f}×, jit(grad) {:.1f}×".format(*ratios))


if __name__ == "__main__":
    main()
