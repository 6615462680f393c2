"""RoPE with attention, timed in one run: ``nc.attention(..., rope=nc.Rope(fused=True))`` (q and k rotated inside
the kernels as their blocks load, forward and derived backward), the same kernel without RoPE, XLA's RoPE (jax.numpy,
one more HBM read and write of q and k) followed by that kernel, and the default ``nc.Rope()`` (the rotary box's own
semantics run by XLA before the kernel), on Triton and on the backend ``auto`` picks. Causal, bf16, B = 2, H = 16,
N = 8192, D = 128, forward and forward + backward; each RoPE variant checked against an f32 jax.numpy reference
(RoPE as complex numbers, then softmax attention) at N = 1024. Writes ``rope_<GPU>.json`` and ``.png`` into
``--out-dir``::

    python papers/flash_attention/rope.py --out-dir papers/flash_attention/results     # GPU
    python papers/flash_attention/rope.py --smoke --out-dir /tmp                       # CPU, tiny sizes
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402

BASE = 10000.0


def rope_xla(x, base=BASE):
    """Rotate-half RoPE (Llama's) in jax.numpy at the sequence index, in f32, cast back: ``x [B, N, H, D]``."""
    n, d = x.shape[1], x.shape[-1]
    inv = base ** (-jnp.arange(d // 2, dtype=jnp.float32) * 2 / d)
    theta = jnp.arange(n, dtype=jnp.float32)[:, None] * inv
    cos, sin = (jnp.concatenate([f(theta)] * 2, -1)[None, :, None] for f in (jnp.cos, jnp.sin))
    xf = x.astype(jnp.float32)
    turned = jnp.concatenate([-xf[..., d // 2 :], xf[..., : d // 2]], -1)
    return (xf * cos + turned * sin).astype(x.dtype)


def rope_complex(x, base=BASE):
    """RoPE as complex numbers (pairs ``(i, i + D/2)`` times ``e^{i·n·θ_i}``), in f32: the check's reference."""
    n, d = x.shape[1], x.shape[-1]
    xf = x.astype(jnp.float32)
    z = xf[..., : d // 2] + 1j * xf[..., d // 2 :]
    w = z * jnp.exp(1j * np.arange(n)[:, None, None] * base ** (-np.arange(d // 2) * 2.0 / d))
    return jnp.concatenate([w.real, w.imag], -1)


def reference(q, k, v):
    """Causal attention after RoPE, all in f32 jax.numpy."""
    n, d = q.shape[1], q.shape[-1]
    s = jnp.einsum("bqhd,bxhd->bhqx", rope_complex(q), rope_complex(k)) / np.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqx,bxhd->bqhd", jax.nn.softmax(s, -1), v.astype(jnp.float32))


VARIANTS = {
    "fused": lambda q, k, v: nc.attention(q, k, v, is_causal=True, rope=nc.Rope(BASE, fused=True), backend="triton"),
    "no rope": lambda q, k, v: nc.attention(q, k, v, is_causal=True, backend="triton"),
    "xla rope + kernel": lambda q, k, v: nc.attention(rope_xla(q), rope_xla(k), v, is_causal=True, backend="triton"),
    "before the kernel": lambda q, k, v: nc.attention(q, k, v, is_causal=True, rope=nc.Rope(BASE), backend="triton"),
    "before the kernel, auto": lambda q, k, v: nc.attention(q, k, v, is_causal=True, rope=nc.Rope(BASE)),
    "no rope, auto": lambda q, k, v: nc.attention(q, k, v, is_causal=True),
}


def rel_err(got, want) -> float:
    return float(jnp.max(jnp.abs(got.astype(jnp.float32) - want)) / jnp.max(jnp.abs(want)))


def measure(name, attend, shape, small, smoke) -> dict:
    """Errors against the f32 reference at length ``small`` (RoPE variants), then times at ``shape``."""
    B, N, H, D = shape  # noqa: N806 - the usual names
    q, k, v, do = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))

    def loss(q, k, v, do):
        return jnp.sum(attend(q, k, v).astype(jnp.float32) * do.astype(jnp.float32))

    f, g = jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    row = {"variant": name}
    if not name.startswith("no rope"):
        sq, sk, sv, sdo = (a[:, :small] for a in (q, k, v, do))
        row["fwd_err"] = rel_err(f(sq, sk, sv), reference(sq, sk, sv))
        want = jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v) * sdo.astype(jnp.float32)), (0, 1, 2))(sq, sk, sv)
        row["grad_err"] = max(rel_err(a, b) for a, b in zip(g(sq, sk, sv, sdo), want, strict=True))
    flops = 4 * B * H * N * N * D * 0.5  # causal: half the scores
    reps = dict(reps=1, batches=1, warmup=1) if smoke else {}
    tf, tg = time_calls(f, q, k, v, **reps).seconds, time_calls(g, q, k, v, do, **reps).seconds
    row |= {"fwd_ms": tf * 1e3, "fwd_tflops": flops / tf / 1e12}
    row |= {"fwdbwd_ms": tg * 1e3, "fwdbwd_tflops": 3.5 * flops / tg / 1e12}
    return row


def ratios(rows: list) -> dict:
    """Each time over the fused kernel's: above 1 the fused kernel is faster."""
    by = {r["variant"]: r for r in rows}
    fused = by["fused"]
    return {
        f"{pass_} {other}/fused": by[other][f"{pass_}_ms"] / fused[f"{pass_}_ms"]
        for other in ("no rope", "xla rope + kernel", "before the kernel")
        for pass_ in ("fwd", "fwdbwd")
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    xs = np.arange(len(rows))
    for i, (key, label) in enumerate((("fwd_tflops", "forward"), ("fwdbwd_tflops", "forward + backward"))):
        ax.bar(xs + 0.4 * i, [r[key] for r in rows], 0.4, label=label)
    ax.set_xticks(xs + 0.2, [r["variant"] for r in rows])
    ax.set_ylabel("TFLOP/s (causal attention's flops)")
    ax.set_title(f"RoPE in attention, {result['gpu']}: bf16 {result['shape']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU, interpret mode)")
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    p.add_argument("--no-plot", action="store_true")
    opts = p.parse_args(argv)
    shape = (1, 64, 2, 32) if opts.smoke else (2, 8192, 16, 128)
    small = 64 if opts.smoke else 1024
    rows = []
    for name, attend in VARIANTS.items():
        rows.append(measure(name, attend, shape, small, opts.smoke))
        print(rows[-1], flush=True)
    gpu = jax.devices()[0].device_kind
    result = {"gpu": gpu, "shape": "B, N, H, D = " + ", ".join(map(str, shape)), "rows": rows, "ratios": ratios(rows)}
    print(json.dumps(result["ratios"], indent=1))
    out = Path(opts.out_dir) / f"rope_{gpu.replace(' ', '_')}.json"
    out.write_text(json.dumps(result, indent=1))
    if not opts.no_plot:
        plot(result, out.with_suffix(".png"))
    return result


if __name__ == "__main__":
    main()
