"""whether a crowded decode grid (B = 64, Nq = 1, 32 heads over 8, D = 128, bf16: 512 programs of 16 rows, the cache
in one part) wants longer chunks or more stages (GPU): the Triton kernel's chunk and ``num_stages`` forced, for a
contiguous cache and a paged one (pages of 64 keys, shuffled), each timed by CUPTI and checked against f32."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import lowering._decode as dec
import napkin_cat as nc
from lowering._timing import time_calls
from lowering.triton import TritonConfig
from papers.flash_attention.decode_bench import pages, reference

b, s = (int(v) for v in sys.argv[1].split(",")) if len(sys.argv) > 1 else (64, 4096)
q = jax.random.normal(jax.random.key(0), (b, 1, 32, 128), jnp.bfloat16)
k, v = (jax.random.normal(jax.random.key(i), (b, s, 8, 128), jnp.bfloat16) for i in (1, 2))
lengths = jnp.full((b,), s, jnp.int32)
pk, pv, table = pages(k, v, 0)
want = reference(q, k, v)
lower = dec.lower
for paged in (False, True):
    for chunk, stages in ((64, 3), (64, 6), (128, 3)):
        dec._kernel.cache_clear()
        dec._step.clear_cache()  # its compiled steps hold the kernel they traced: a new config needs a new trace
        dec.lower = lambda *a, stages=stages, **kw: lower(*a[:3], TritonConfig(4, stages), *a[4:], **kw)
        args = (q, pk, pv, lengths) if paged else (q, k, v, lengths)
        f = jax.jit(lambda q, k, v, n, chunk=chunk, paged=paged: nc.decode_attention(
            q, k, v, n, chunk=chunk, page_table=table if paged else None, backend="triton"))
        try:
            err = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))
            t = time_calls(f, *args)
            print(f"{'paged' if paged else 'contiguous':10s} chunk {chunk:3d} stages {stages}: "
                  f"{t.seconds * 1e6:8.1f} us  err {err:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - a refused config is a row
            print(f"{'paged' if paged else 'contiguous':10s} chunk {chunk:3d} stages {stages}: {type(e).__name__}: "
                  f"{str(e)[:120]}", flush=True)
dec.lower = lower
