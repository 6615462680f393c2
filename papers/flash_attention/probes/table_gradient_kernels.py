"""Where a learnable relative-position table's step spends its time (GPU): ``front_door.py --only relbias``'s two
steps (the table held constant, the table learned), each kernel CUPTI saw, in launch order, with its time.

    python papers/flash_attention/probes/table_gradient_kernels.py [N]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from lowering._timing import time_calls
from papers.flash_attention.front_door import with_table

STEPS = {"table held constant": (0, 1, 2), "learnable table": (0, 1, 2, 3)}


def print_step(name: str, q, k, v, table, ct) -> None:
    """Time one of :data:`STEPS` (the gradients it takes) on these arrays and print it with each of its kernels."""
    loss = lambda q, k, v, t: jnp.sum(with_table(q, k, v, t).astype(jnp.float32) * ct)  # noqa: E731
    t = time_calls(jax.jit(jax.grad(loss, STEPS[name])), q, k, v, table, reps=5, batches=5, warmup=1)
    print(f"{name}: {t.ms:.3f} ms", flush=True)
    for kname, s in t.kernels:
        print(f"    {s * 1e3:8.3f} ms  {kname[:90]}", flush=True)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    b, h, d = 2, 16, 128
    q, k, v, ct = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.bfloat16) for i in range(4))
    table = 0.1 * jax.random.normal(jax.random.key(11), (2 * n - 1,), jnp.float32)
    for name in STEPS:
        print_step(name, q, k, v, table, ct)
