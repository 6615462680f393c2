"""whether MLA's decode kernel (DeepSeek-V3's absorbed shape: 128 heads over one latent KV head of 512 + 64 rotary
dims, bf16, ``Nq`` = 1; its latent read once, 64-key chunks) wants more warps, more stages or another chunk (GPU):
the Triton kernel's ``num_warps``, ``num_stages`` and chunk forced, each step timed by CUPTI and checked against
f32. Argument: ``B,S`` (default 64,4096)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import lowering._decode as dec
import napkin_cat as nc
from lowering._timing import time_calls
from lowering.triton import TritonConfig
from papers.flash_attention.decode_bench import mla_reference

b, s = (int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (64, 4096)
h, c, r = 128, 512, 64
keys = jax.random.split(jax.random.key(0), 3)
q = jax.random.normal(keys[0], (b, 1, h, c + r), jnp.bfloat16)
latent, rope = (jax.random.normal(kk, (b, s, n), jnp.bfloat16) for kk, n in zip(keys[1:], (c, r), strict=True))
lengths = jnp.full((b,), s, jnp.int32)
want = mla_reference(q[:1], latent[:1], rope[:1])
lower = dec.lower
flops = 2 * b * h * s * (c + r + c)
for warps, stages, chunk in ((8, 2, 64), (8, 2, 32), (16, 2, 64), (4, 2, 64), (8, 3, 32), (16, 2, 32)):
    dec._kernel.cache_clear()
    dec._step.clear_cache()  # its compiled steps hold the kernel they traced: a new config needs a new trace
    dec.lower = lambda *a, w=warps, st=stages, **kw: lower(*a[:3], TritonConfig(w, st), *a[4:], **kw)
    f = jax.jit(lambda q, c, r, n, chunk=chunk: nc.mla_decode_attention(q, c, r, n, chunk=chunk, backend="triton"))
    try:
        got = f(q, latent, rope, lengths)[:1].astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
        t = time_calls(f, q, latent, rope, lengths)
        print(f"warps {warps:2d} stages {stages} chunk {chunk:3d}: {t.seconds * 1e6:8.1f} us "
              f"({flops / t.seconds / 1e12:5.0f} TFLOP/s of the step)  err {err:.1e}", flush=True)
    except Exception as e:  # noqa: BLE001 - a refused config is a row
        print(f"warps {warps:2d} stages {stages} chunk {chunk:3d}: {type(e).__name__}: {str(e)[:160]}", flush=True)
dec.lower = lower
