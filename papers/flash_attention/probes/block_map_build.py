"""where a traced block map's build time goes, stage by stage (GPU)."""
import collections
import sys
import time

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import lowering._blocks as B
import napkin_cat as nc
import napkin_cat.generators._index as I
from papers.flash_attention.front_door import non_affine

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
b, h, d = 2, 16, 128
q, k, v = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.bfloat16) for i in range(3))
spent = collections.defaultdict(float)
calls = collections.Counter()

def timed(mod, name):
    f = getattr(mod, name)
    def g(*a, **kw):
        t0 = time.perf_counter()
        out = f(*a, **kw)
        jax.block_until_ready(out)
        spent[f"{mod.__name__.split('.')[-1]}.{name}"] += time.perf_counter() - t0
        calls[f"{mod.__name__.split('.')[-1]}.{name}"] += 1
        return out
    setattr(mod, name, g)

STAGES = ((I, "_evaluated"), (I, "_coarse"), (B, "mapped_blocks"),
          (B, "call_blocks"))
for mod, name in STAGES:
    timed(mod, name)
sizes = {"b": b, "h": h, "q_idx": n, "kv_idx": n, "d": d, "dv": d}
for mname in ("dilated window", "2-D neighbourhood", "strided window"):
    f = non_affine(n, 1024, 128, 8)[mname]
    made = nc.attention.kernel_for(q, k, v, mask_mod=f)
    plans = [kk.plan for kk in (made.kernel.forward, *made.kernel.kernels)]
    plans = [(p, B.segments(p.diagram, p)) for p in plans if p.stream is not None]
    def build(plans=plans):
        I._FINE_MAPS.clear()
        B._MAPS.clear()
        return [B.call_blocks(p, m, [], sizes) for p, m in plans if m]
    build()
    spent.clear()
    calls.clear()
    t0 = time.perf_counter()
    for _ in range(5):
        build()
    total = (time.perf_counter() - t0) / 5
    print(f"{mname}: {1e3 * total:.2f} ms per build", flush=True)
    for key, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"   {key:22s} {1e3 * s / 5:7.3f} ms  ({calls[key] // 5} calls)", flush=True)
