"""Nq = 64 decode step (B = 1, 32k keys, 32 heads over 8, D = 128, bf16) on Mosaic streaming 128-key chunks (its
positions made in-kernel, so they fit shared memory) against Triton's default, one process, CUPTI times (GPU)."""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import napkin_cat as nc  # noqa: E402
from lowering._timing import time_calls  # noqa: E402

b, s, nq, h, hk, d = 1, 32768, int(sys.argv[1]) if len(sys.argv) > 1 else 64, 32, 8, 128
q = jax.random.normal(jax.random.key(0), (b, nq, h, d), jnp.bfloat16)
k, v = (jax.random.normal(jax.random.key(i), (b, s, hk, d), jnp.bfloat16) for i in (1, 2))
lengths = jnp.array([s])
for name, kw in (("triton (default, chunk 128)", {}), ("mosaic chunk 128", {"backend": "mosaic", "chunk": 128}),
                 ("mosaic chunk 64", {"backend": "mosaic"})):
    t0 = time.perf_counter()
    step = jax.jit(lambda q, k, v, n, kw=kw: nc.decode_attention(q, k, v, n, **kw))
    jax.block_until_ready(step(q, k, v, lengths))
    t = time_calls(step, q, k, v, lengths, reps=20, batches=5, warmup=2)
    print(f"{name:28s} {t.seconds * 1e3:.4f} ms  kernels {[(n, round(x * 1e6, 1)) for n, x in t.kernels]}"
          f"  (compile {time.perf_counter() - t0:.0f} s)", flush=True)
