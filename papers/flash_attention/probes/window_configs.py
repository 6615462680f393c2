"""The lambda sliding window's forward at each Mosaic block and config (GPU): the diagram ``nc.attention`` derives
for ``front_door.py``'s window (a FlexAttention ``mask_mod`` found affine), re-derived at each (tile, chunk) and
lowered on Mosaic at each (stages, ping-pong, consumers), timed against cuDNN's ``local_window_size`` in the same
run; each kernel checked against the f32 jnp reference first.

    python papers/flash_attention/probes/window_configs.py [N] [W]
"""

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering import lower
from lowering._timing import time_calls
from lowering.mosaic import MosaicConfig
from papers.flash_attention.front_door import implementations, reference, rel, window_mask
from rewrites import derive, stream, tile

if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    w = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    b, h, d = (2, 16, 128) if n >= 1024 else (1, 2, 64)
    q, k, v = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.bfloat16) for i in range(3))
    gpu = jax.default_backend() == "gpu"
    want = reference(q[:1], k[:1], v[:1], w)
    made = nc.attention.kernel_for(q, k, v, is_causal=True, mask_mod=window_mask(w))
    naive = made.derivation.steps[0].diagram
    qa, xa = "q_idx", "kv_idx"
    for name, f in implementations(window_mask(w), w, gpu).items():
        t = time_calls(jax.jit(f), q, k, v, reps=10, batches=5, warmup=2)
        print(f"{name:28s} {t.ms:.4f} ms", flush=True)
    blocks = ((128, 128), (128, 64), (256, 64)) if gpu else ((64, 64),)
    configs = itertools.product((2, 3), (None, True, False))
    for (g, s), (stages, pp) in itertools.product(blocks, configs):
        label = f"tile {g} chunk {s} stages {stages} ping-pong {pp}"
        try:
            kernel = lower(
                derive(naive, tile(qa, g), stream(xa, s), verify=False),
                backend="mosaic",
                config=MosaicConfig(stages=stages, pingpong=pp),
                interpret=None if gpu else True,
            )
            fn = jax.jit(kernel)
            err = rel(fn(q, k, v)[:1], want)
            t = time_calls(fn, q, k, v, reps=10, batches=5, warmup=2)
            print(f"{label:48s} {t.ms:.4f} ms  err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a config Mosaic refuses is reported, not fatal
            print(f"{label:48s} refused: {str(e).splitlines()[0][:120]}", flush=True)
