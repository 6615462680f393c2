"""Where the lambda sliding window's time goes (GPU): ``front_door.py --only window``'s kernel (a FlexAttention
``mask_mod`` over four positional indices, found affine) and cuDNN's ``local_window_size``, forward and forward +
backward, each kernel CUPTI saw, in launch order, with its time; and the backend and blocks of each of ours.

    python papers/flash_attention/probes/window_kernels.py [N] [W]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering._timing import time_calls
from papers.flash_attention.front_door import implementations, window_mask


def print_calls(name: str, fn, *args) -> None:
    """Time ``fn(*args)`` and print it with each of its kernels."""
    t = time_calls(fn, *args, reps=10, batches=5, warmup=2)
    print(f"{name}: {t.ms:.4f} ms", flush=True)
    for kname, s in t.kernels:
        print(f"    {s * 1e3:8.4f} ms  {kname[:90]}", flush=True)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    w = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    b, h, d = 2, 16, 128
    q, k, v, ct = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.bfloat16) for i in range(4))
    made = nc.attention.kernel_for(q, k, v, is_causal=True, mask_mod=window_mask(w))
    print(f"B={b} H={h} N={n} D={d} W={w}: tiles {made.kernel.tiles}; backends {made.kernel.backends}", flush=True)
    print(f"refused: {made.kernel.refused}", flush=True)
    for name, f in implementations(window_mask(w), w, jax.default_backend() == "gpu").items():
        print_calls(f"{name} forward", jax.jit(f), q, k, v)
        print_calls(f"{name} forward + backward", jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](ct)), q, k, v)
