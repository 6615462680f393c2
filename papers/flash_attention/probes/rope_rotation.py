"""where RoPE's rotation before the kernel goes (GPU): q and k [B, N, H, D] rotated by ``nc.Rope().rotate`` against
the same rotation written in jax.numpy (``rope.py``'s ``rope_xla``), forward and its transpose (the backward's dq, dk
turned back), each kernel CUPTI saw, and the HBM floor (a read and a write of q and k at a device copy's rate)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering._timing import time_calls
from papers.flash_attention.rope import rope_xla

shape = tuple(int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (2, 8192, 16, 128)
q, k, dq, dk = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))
nbytes = 4 * q.size * q.dtype.itemsize  # q and k read and written


def both(rot):
    fwd = jax.jit(lambda q, k: (rot(q), rot(k)))
    back = jax.jit(lambda q, k, dq, dk: jax.vjp(lambda q, k: (rot(q), rot(k)), q, k)[1]((dq, dk)))
    return fwd, back


copy = jax.jit(lambda q, k: (q + 1, k + 1))
t = time_calls(copy, q, k)
print(f"copy (+1) of q and k: {t.seconds * 1e6:.1f} us, {nbytes / t.seconds / 1e9:.0f} GB/s", flush=True)
want = rope_xla(q.astype(jnp.float32))
for name, rot in (("napkin Rope().rotate", nc.Rope().rotate), ("jax.numpy rope_xla", rope_xla)):
    fwd, back = both(rot)
    err = float(jnp.max(jnp.abs(fwd(q, k)[0].astype(jnp.float32) - want)))
    for what, f, args in (("forward", fwd, (q, k)), ("transpose", back, (q, k, dq, dk))):
        t = time_calls(f, *args)
        kern = ", ".join(f"{n[:28]} {s * 1e6:.1f} us" for n, s in t.kernels)
        print(f"{name:22s} {what:9s} {t.seconds * 1e6:7.1f} us  {nbytes / t.seconds / 1e9:6.0f} GB/s  "
              f"err {err:.1e}  [{kern}]", flush=True)

# the same rotations in front of the causal kernel: what each call launches
v = jax.random.normal(jax.random.key(9), shape, jnp.bfloat16)
calls = {
    "no rope": lambda q, k, v: nc.attention(q, k, v, is_causal=True),
    "xla rope + kernel": lambda q, k, v: nc.attention(rope_xla(q), rope_xla(k), v, is_causal=True),
    "before the kernel": lambda q, k, v: nc.attention(q, k, v, is_causal=True, rope=nc.Rope()),
}
for name, f in calls.items():
    t = time_calls(jax.jit(f), q, k, v)
    kern = ", ".join(f"{n[:28]} {s * 1e6:.1f} us" for n, s in t.kernels)
    print(f"{name:20s} forward {t.seconds * 1e6:8.1f} us  [{kern}]", flush=True)
