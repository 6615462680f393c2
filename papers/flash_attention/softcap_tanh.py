"""Soft-capping's tanh three ways, timed in one run: the GPU's ``tanh.approx.f32`` (what a compiled bf16 kernel
computes for ``jnp.tanh``, :func:`lowering.triton.native_tanh`), libdevice's ``tanh`` (the kernel before it), and
tanh from one exp2, ``sign(s)·(1 − e)/(1 + e)`` with ``e = 2^(−2|s|·log₂e/cap)``. Causal ``nc.attention`` with
``score_mod``, forward and forward + backward, B = 2, N = 8192, H = 16, D = 128, bf16, next to no score_mod; each
checked against an f32 jax.numpy reference at N = 1024. Writes the JSON named on the command line::

    python papers/flash_attention/softcap_tanh.py results/softcap_tanh_<GPU>.json    # GPU (CPU: tiny sizes)
"""

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import lowering.triton._lowered  # noqa: E402
import napkin_cat as nc  # noqa: E402
from napkin_cat.library import SoftCap  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402

CAP = 50.0
LOG2E = 1.4426950408889634


def exp2_cap(s):
    """cap·tanh(s/cap) as sign·(1 − e)/(1 + e), e = 2^(−2|s|·log₂e/cap) ∈ (0, 1]: one exp2, no overflow."""
    pos = s >= 0
    a = jnp.where(pos, s, -s)
    e = jnp.exp2(a * (-2 * LOG2E / CAP))
    t = CAP * (1 - e) / (1 + e)
    return jnp.where(pos, t, -t)


exp2_cap.__name__ = "softcap exp2"


def reference(q, k, v):
    """Causal soft-capped attention in f32 jax.numpy, [B, N, H, D]."""
    n, d = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhd,bxhd->bhqx", q.astype(jnp.float32), k.astype(jnp.float32)) / np.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), CAP * jnp.tanh(s / CAP), -jnp.inf)
    return jnp.einsum("bhqx,bxhd->bqhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))


def reference_loss(q, k, v, do):
    return jnp.sum(reference(q, k, v) * do.astype(jnp.float32))


def rel_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def run(out: str) -> list:
    """Time each score modifier (none, the two tanh, exp2) and check it; write ``{"gpu", "rows"}`` to ``out``."""
    cpu = jax.devices()[0].platform == "cpu"
    B, N, H, D = (1, 64, 2, 32) if cpu else (2, 8192, 16, 128)  # noqa: N806 - the usual names
    small = 64 if cpu else 1024  # the f32 reference's length
    q, k, v, do = (jax.random.normal(jax.random.key(i), (B, N, H, D), jnp.bfloat16) for i in range(4))
    flops = 4 * B * H * N * N * D * 0.5
    rows = []
    for name, mod in (
        ("none", None),
        ("tanh.approx", SoftCap(CAP)),
        ("libdevice tanh", SoftCap(CAP)),
        ("exp2", exp2_cap),
    ):

        def attend(q, k, v, mod=mod):
            return nc.attention(q, k, v, is_causal=True, score_mod=mod)

        def loss(q, k, v, do, attend=attend):
            return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

        f, g = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        row = {"mod": name}
        with tanh_from(jnp.tanh if name == "libdevice tanh" else lowering.triton._lowered.native_tanh):
            row |= measure(f, g, mod, q, k, v, do, small, flops, cpu)
        print(row, flush=True)
        rows.append(row)
    with open(out, "w") as fh:
        json.dump({"gpu": jax.devices()[0].device_kind, "rows": rows}, fh, indent=1)
    return rows


@contextlib.contextmanager
def tanh_from(tanh):
    """Compiled kernels traced inside compute tanh by ``tanh`` (the library's is the hardware's)."""
    keep = lowering.triton._lowered.native_tanh
    lowering.triton._lowered.native_tanh = tanh
    try:
        yield
    finally:
        lowering.triton._lowered.native_tanh = keep


def measure(f, g, mod, q, k, v, do, small, flops, cpu) -> dict:
    """Errors against the f32 reference at length ``small``, then times at full size (GPU only)."""
    row = {}
    if mod is not None:
        sq, sk, sv, sdo = (a[:, :small] for a in (q, k, v, do))
        row["fwd_err"] = rel_err(f(sq, sk, sv), reference(sq, sk, sv))
        want = jax.grad(reference_loss, (0, 1, 2))(sq, sk, sv, sdo)
        row["grad_err"] = max(rel_err(a, b) for a, b in zip(g(sq, sk, sv, sdo), want, strict=True))
    if not cpu:
        tf, tg = time_calls(f, q, k, v).seconds, time_calls(g, q, k, v, do).seconds
        row |= {"fwd_ms": tf * 1e3, "fwd_tflops": flops / tf / 1e12}
        row |= {"fwdbwd_ms": tg * 1e3, "fwdbwd_tflops": 3.5 * flops / tg / 1e12}
    return row


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "softcap_tanh.json")
