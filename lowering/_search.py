"""A small measured search over tile sizes, warps and stages, cached on disk (GPU only).

The cost model ranks the sizes a derivation left open (:func:`lowering.choose_tiles`: the largest that fit,
then the fastest predicted); ``lower(..., search=True)`` times the model's first few choices with a few
warps and stages, as Triton's autotuner would, and takes the fastest. Results are cached in
``~/.cache/napkin_cat/search.json`` keyed by the diagram, the sizes and the device.

Run: ``python -m lowering._search`` on a GPU prints the table for attention and the best choice.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

CACHE = Path(os.environ.get("NAPKIN_CACHE", Path.home() / ".cache" / "napkin_cat")) / "search.json"


def median_time(fn, *args, reps: int = 20, batches: int = 5, warmup: int = 2) -> float:
    """Median device time per call of ``fn(*args)`` in seconds, measured the standard way.

    After ``warmup`` waited-on calls, each of ``batches`` batches dispatches ``reps`` calls back to
    back (jax dispatches asynchronously) and waits once at the end; the batch time ÷ ``reps`` is one
    sample, and the median over batches is returned. Waiting on every call instead would add the host
    round trip (~0.7 ms on a cloud VM) to each. Same method as ``papers/flash_attention/benchmark.py``.

    >>> median_time(jnp.sin, jnp.ones(4), reps=3, batches=3) > 0
    True
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        out = None
        t = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t) / reps)
    return statistics.median(times)


def search(
    make,
    args,
    *,
    tiles=({"g_q": 64, "s_x": 64}, {"g_q": 128, "s_x": 64}, {"g_q": 128, "s_x": 128}),
    warps=(4, 8),
    stages=(2, 3),
    key: str | None = None,
    log=print,
) -> dict | None:
    """Time ``make(sizes, config)`` over the grid and return the fastest choice (cached by ``key``), or None
    if none ran.

    ``tiles`` are the partition sizes to try, each a dict by symbol name; ``make`` returns a function of
    ``args`` (a lowered kernel, on a GPU); a choice that fails to build or run is logged and skipped.

    >>> import jax.numpy as jnp
    >>> best = search(lambda sizes, config: jnp.sin, (jnp.ones(8),), tiles=({"g_q": 16},), warps=(4,), stages=(1, 2),
    ...               log=lambda line: None)
    >>> sorted(best), best["sizes"]
    (['num_stages', 'num_warps', 'seconds', 'sizes'], {'g_q': 16})
    """
    from lowering._triton import Config

    cache = json.loads(CACHE.read_text()) if CACHE.exists() else {}
    if key and key in cache:
        return cache[key]
    best = None
    for sizes, w, st in itertools.product(tiles, warps, stages):
        shown = " ".join(f"{k}={v:4d}" for k, v in sizes.items())
        try:
            fn = jax.jit(make(sizes, Config(num_warps=w, num_stages=st)))
            t = median_time(fn, *args)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is skipped, and said so
            log(f"  {shown} warps={w} stages={st}: failed ({type(e).__name__})")
            continue
        log(f"  {shown} warps={w} stages={st}: {t * 1e3:8.3f} ms")
        if best is None or t < best["seconds"]:
            best = {"sizes": dict(sizes), "num_warps": w, "num_stages": st, "seconds": t}
    if key and best:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        CACHE.write_text(json.dumps({**cache, key: best}, indent=1))
    return best


def refine(diagram, choice, make, *, first: int = 4, cache: bool = True, log=None) -> tuple:
    """The fastest measured of the cost model's ``first`` choices (``choice.ranked``), with 4 or 8 warps and 2 or
    3 stages: ``(choice, config)``, the choice restated as measured. Inputs are random normal at
    ``choice.at``; ``make(sizes, config)`` builds the kernel. Cached by diagram, sizes and device (``cache``).

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile
    >>> from lowering import choose_tiles
    >>> (n,) = nc.axes("n")
    >>> d = derive(nc.library.softmax(n, nc.Axis("v", 32)), tile(n), verify=False).diagram
    >>> c = choose_tiles(d, "H100", {"n": 64})
    >>> better, config = refine(d, c, lambda sizes, config: jnp.exp, first=1, cache=False)
    >>> better.how, better.sizes == c.sizes, config.num_warps in (4, 8)
    ('measured search', True, True)
    """
    from dataclasses import replace

    from lowering._plan import NotLowerable
    from lowering._triton import Config

    ks = jax.random.split(jax.random.key(0), len(diagram.dom))
    args = [
        jax.random.normal(k, tuple(choice.at[a.name] for a in w.axes), jnp.float32).astype(w.dtype.jnp)
        for k, w in zip(ks, diagram.dom.inside, strict=True)
    ]
    key = f"{diagram!r} at {sorted(choice.at.items())} on {jax.devices()[0].device_kind}" if cache else None
    best = search(make, args, tiles=choice.ranked[:first], key=key, log=log or (lambda line: None))
    if best is None:
        raise NotLowerable(f"lower(search=True): none of {', '.join(map(str, choice.ranked[:first]))} ran")
    measured = replace(choice, sizes=best["sizes"], how="measured search", measured=best["seconds"])
    return measured, Config(num_warps=best["num_warps"], num_stages=best["num_stages"])


def main():
    import napkin_cat as nc
    from lowering import lower
    from rewrites import derive, stream, tile

    for D in (64, 128):
        for causal in (False, True):
            B, H, N = 4, 16, 4096
            b, h, q, x, d = nc.axes("b h q x d")
            attn = nc.library.attention(q, x, d, batch=(b, h), causal=causal, dtype=nc.bf16)
            ks = jax.random.split(jax.random.key(0), 3)
            args = [jax.random.normal(k, (B, H, N, D), jnp.bfloat16) for k in ks]
            print(f"attention bf16 B={B} H={H} N={N} D={D} causal={causal} on {jax.devices()[0].device_kind}")

            def make(sizes, config, attn=attn, q=q, x=x):
                return lower(derive(attn, tile(q, sizes["g_q"]), stream(x, sizes["s_x"]), verify=False), config=config)

            best = search(make, args)
            flops = 4 * B * H * N * N * D / (2 if causal else 1)
            print(f"best: {best} → {flops / best['seconds'] / 1e12:.0f} TFLOP/s")


if __name__ == "__main__":
    main()
