"""The whole story on the default example: ``python -m napkin_cat [--out DIR] [--n N] [--d D]``.

Naive attention → picture → reference semantics checked against ``jax.nn.dot_product_attention`` →
derivation (tile q, stream x, recolour to SMEM, the sizes left open), every step verified and costed →
pseudocode → a Pallas kernel whose tile sizes the cost model chooses for the GPU at hand (interpreted on
CPU, compiled on a GPU), checked against ``jax.nn`` → on a GPU, its speed against XLA and cuDNN.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp


def _say(msg: str):
    print(msg, flush=True)


def main(argv=None):
    import napkin_cat as nc
    from lowering import lower, median_time
    from rewrites import derive, level, relative_error, stream, tile

    ap = argparse.ArgumentParser(prog="python -m napkin_cat", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="napkin_out", help="folder for pictures (default: napkin_out)")
    ap.add_argument("--n", type=int, default=None, help="sequence length (default 300 on CPU, 8192 on GPU)")
    ap.add_argument("--d", type=int, default=64, help="head dimension")
    args = ap.parse_args(argv)
    gpu = jax.default_backend() == "gpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    b, h, q, x, d = nc.axes("b h q x d")
    dtype = nc.bf16 if gpu else nc.f32
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=dtype)
    _say(f"1. naive attention: {attn.dom} → {attn.cod}")
    for box in attn.boxes:
        _say(f"     {box.name:<32} {box.dom} → {box.cod}")
    nc.draw(attn, out / "attention.png")
    _say(f"   drawn: {out / 'attention.png'}")
    _say(f"   HBM bytes, one kernel per box (H100): {nc.cost(attn, nc.hardware.H100).hbm_bytes}")

    B, H, N, D = (1, 4, args.n or 300, args.d) if not gpu else (2, 16, args.n or 8192, args.d)
    ks = jax.random.split(jax.random.key(int(time.time())), 3)
    Q, K, V = (jax.random.normal(k, (B, H, N, D), jnp.float32).astype(dtype.jnp) for k in ks)
    t = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731 - jax.nn wants [b, n, h, d]
    want = t(jax.nn.dot_product_attention(*(t(a.astype(jnp.float32)) for a in (Q, K, V))))
    _say(
        f"2. reference semantics vs jax.nn.dot_product_attention at B={B} H={H} N={N} D={D} ({dtype}): "
        f"rel. error {relative_error(nc.to_jax(attn)(Q, K, V), want):.1e}"
    )

    _say("3. derivation: tile(q), stream(x), level(SMEM), sizes left open — each step verified on random ragged sizes")
    flash = derive(attn, tile(q), stream(x), level(nc.SMEM))
    for i, (step, c) in enumerate(zip(flash.steps, flash.cost(nc.hardware.H100), strict=True)):
        _say(f"   {i}. {step}")
        _say(f"      HBM transfers (values): {c.hbm_transfers}")
    flash.draw(out / "derivation.png")
    _say(f"   drawn: {out / 'derivation.png'}")
    _say("4. pseudocode of the scheduled diagram:")
    _say("\n".join("   " + line for line in flash.pseudocode().splitlines()))

    kernel = lower(flash).at(b=B, h=H, q=N, x=N, d=D)
    _say(f"5. tiles chosen by the cost model: {kernel.choice}")
    got = jax.jit(kernel)(Q, K, V)
    mode = "compiled" if gpu else "interpreted on CPU"
    err = relative_error(got, want)
    _say(f"   lowered Pallas kernel ({mode}) vs jax.nn.dot_product_attention: rel. error {err:.1e}")
    if gpu:
        flops = 4 * B * H * N * N * D
        naive = jax.jit(nc.to_jax(attn))
        cudnn = jax.jit(lambda a, k_, v: t(jax.nn.dot_product_attention(t(a), t(k_), t(v), implementation="cudnn")))
        times = {
            "napkin": median_time(jax.jit(kernel), Q, K, V),
            "naive XLA": median_time(naive, Q, K, V),
            "cuDNN": median_time(cudnn, Q, K, V),
        }
        _say("6. speed (TFLOP/s, same run):")
        for name, sec in times.items():
            ratio = "" if name == "napkin" else f"   speed-up of napkin over it: {sec / times['napkin']:.2f}×"
            _say(f"     {name:<10} {flops / sec / 1e12:7.1f}{ratio}")
    else:
        _say("6. speed: run on a GPU for timings (papers/flash_attention/benchmark.py has the full table)")


if __name__ == "__main__":
    main()
