"""the captured block map's evaluation, reduction variants (GPU)."""
import sys

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from lowering._blocks import _evaluated_map
from napkin_cat.generators._index import Captured, _run
from papers.flash_attention.front_door import document_ids
from papers.flash_attention.timing import time_calls

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
doc = document_ids(n, 8)
c = Captured.of(lambda q_idx, kv_idx: doc[q_idx] == doc[kv_idx], ("q_idx", "kv_idx"), score=False)
ins = c.inputs({"q_idx": n, "kv_idx": n})
qs, ks = ins[0].reshape(n, 1).astype(jnp.float32), ins[1].reshape(1, n).astype(jnp.float32)
g = s = 128
T, C = n // g, n // s

def keep_of(a, b):
    return jnp.isfinite(c(jnp.zeros((), jnp.float32), a, b))

def A(a, b):
    return _evaluated_map(c, (a, b), g, s, n, n)

def B(a, b):  # two stages: the chunk's keys, then the tile's queries
    k = keep_of(a, b)  # [n, n]
    k3 = k.reshape(n, C, s)
    anyk, allk = jnp.any(k3, -1), jnp.all(k3, -1)  # [n, C]
    return jnp.any(anyk.reshape(T, g, C), 1), jnp.all(allk.reshape(T, g, C), 1)

def Cv(a, b):  # int8 max/min
    k = keep_of(a, b).astype(jnp.int8).reshape(n, C, s)
    mx, mn = jnp.max(k, -1), jnp.min(k, -1)
    return jnp.max(mx.reshape(T, g, C), 1) > 0, jnp.min(mn.reshape(T, g, C), 1) > 0

def D(a, b):  # the tile's queries first (column reduction), then the keys
    k = keep_of(a, b).reshape(T, g, n)
    anyk, allk = jnp.any(k, 1), jnp.all(k, 1)  # [T, n]
    return jnp.any(anyk.reshape(T, C, s), -1), jnp.all(allk.reshape(T, C, s), -1)


def kept_bool(a, b):  # the mask's Boolean itself, on the broadcast reads (no where / isfinite)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    vals = [jnp.broadcast_to(x, shape).astype(v.aval.dtype) for x, v in zip((a, b), c._seeds, strict=True)]
    one = lambda *xs: _run(c._split.kernel, dict(zip(c._seeds, xs, strict=True)), c.jaxpr.outvars)[0]
    for _ in shape:
        one = jax.vmap(one)
    return one(*vals)

def E(a, b):  # the Boolean, blocked, no validity mask (aligned sizes)
    k = kept_bool(a.reshape(T, g, 1, 1), b.reshape(1, 1, C, s))
    return jnp.any(k, axis=(-3, -1)), jnp.all(k, axis=(-3, -1))

def F(a, b):  # as E on int32 reads
    return E(a.astype(jnp.int32), b.astype(jnp.int32))

def G(a, b):  # one reduction: the kept count per block
    k = kept_bool(a.reshape(T, g, 1, 1), b.reshape(1, 1, C, s))
    total = jnp.sum(k.astype(jnp.int32), axis=(-3, -1))
    return total > 0, total == g * s

def H(a, b):  # the count, keys first then queries
    k = kept_bool(a.reshape(n, 1), b.reshape(1, n)).astype(jnp.int32).reshape(n, C, s)
    total = jnp.sum(jnp.sum(k, -1).reshape(T, g, C), 1)
    return total > 0, total == g * s

want = [jax.device_get(x) for x in jax.jit(A)(qs, ks)]
VARIANTS = (("A current", A), ("B keys then queries", B), ("C int8", Cv), ("D queries then keys", D),
            ("E the Boolean", E), ("F int32 reads", F), ("G one count", G), ("H count, keys first", H))
for name, f in VARIANTS:
    f = jax.jit(f)
    got = f(qs, ks)
    ok = all(bool((jax.device_get(x) == w).all()) for x, w in zip(got, want, strict=True))
    t = time_calls(f, qs, ks, reps=20, batches=5, warmup=2)
    print(f"{name:22s} {t.ms * 1e3:8.1f} us  same: {ok}", flush=True)
