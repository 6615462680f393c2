"""A small measured search over tile sizes, warps and stages, cached on disk (GPU only).

The cost model ranks the sizes a derivation left open (:func:`lowering.choose_tiles`: the largest that fit,
then the fastest predicted); ``lower(..., search=True)`` times the model's first few choices with a few
warps and stages, as Triton's autotuner would, and takes the fastest. Results are cached in
``~/.cache/napkin_cat/search.json`` (the folder ``$NAPKIN_CACHE`` where set) keyed by the diagram, the sizes,
the device kind and the jax and jaxlib versions (a timing taken under another compiler says nothing of this
one); each result is merged in under a lock and written whole to a temporary file moved into place, so
processes tuning at once lose no entry and a reader never sees half a file.

Run: ``python -m lowering._search`` on a GPU prints the table for attention and the best choice.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from lowering._timing import time_calls

#: the search's results, one JSON object keyed by :func:`versioned` keys
CACHE = Path(os.environ.get("NAPKIN_CACHE", Path.home() / ".cache" / "napkin_cat")) / "search.json"


def versioned(key: str) -> str:
    """``key`` as the cache stores it: with the device kind and the jax and jaxlib versions.

    >>> versioned("attention").startswith("attention | cpu | jax ")
    True
    """
    import jaxlib

    return f"{key} | {jax.devices()[0].device_kind} | jax {jax.__version__} jaxlib {jaxlib.version.__version__}"


def cached(key: str, path: Path | None = None) -> dict | None:
    """The result cached for ``key`` (:func:`versioned` here) in ``path`` (default :data:`CACHE`), None if none;
    the file is only ever replaced whole, so it is read without the lock.

    >>> cached("a key nothing was stored under") is None
    True
    """
    return _read(CACHE if path is None else path).get(versioned(key))


def store(key: str, value: dict, path: Path | None = None) -> None:
    """Merge ``value`` under ``key`` (:func:`versioned` here) into the cache ``path`` (default :data:`CACHE`):
    under an exclusive ``flock`` on ``search.json.lock`` beside it, the file is read again, the entry added, and
    the whole written to a temporary file in the same folder that ``os.replace`` moves over it (atomic), so
    concurrent writers lose nothing.

    >>> with tempfile.TemporaryDirectory() as tmp:
    ...     store("k", {"seconds": 1.0}, Path(tmp) / "search.json")
    ...     cached("k", Path(tmp) / "search.json")
    {'seconds': 1.0}
    """
    path = CACHE if path is None else path
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        entries = {**_read(path), versioned(key): value}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entries, f, indent=1)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise


def _read(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        from lowering._plan import NotLowerable

        raise NotLowerable(f"the search cache {path} is not JSON ({e}); delete it to search afresh") from e


def median_time(fn, *args, reps: int = 20, batches: int = 5, warmup: int = 2) -> float:
    """Median device time per call of ``fn(*args)`` in seconds, by the one timing helper
    (:func:`lowering._timing.time_calls`: CUPTI's kernel durations for a jitted function on a GPU, else the wall
    clock of ``reps`` calls dispatched back to back, waited on once; the median over ``batches``).

    >>> median_time(jnp.sin, jnp.ones(4), reps=3, batches=3) > 0
    True
    """
    return time_calls(fn, *args, reps=reps, batches=batches, warmup=warmup).seconds


def search(
    make,
    args,
    *,
    tiles=({"g_q": 64, "s_x": 64}, {"g_q": 128, "s_x": 64}, {"g_q": 128, "s_x": 128}),
    warps=None,
    stages=None,
    key: str | None = None,
    log=print,
) -> dict | None:
    """Time ``make(sizes, config)`` over the grid and return the fastest choice (cached by ``key``, with the device
    and the jax version: :func:`store`), or None if none ran.

    ``tiles`` are the partition sizes to try, each a dict by symbol name; ``warps`` and ``stages`` (None: the Triton
    block policy's search space, :meth:`lowering.triton.TritonBlocks.space`); ``make`` returns a function of
    ``args`` (a lowered kernel, on a GPU); a choice that fails to build or run is logged and skipped.

    >>> import jax.numpy as jnp
    >>> best = search(lambda sizes, config: jnp.sin, (jnp.ones(8),), tiles=({"g_q": 16},), warps=(4,), stages=(1, 2),
    ...               log=lambda line: None)
    >>> sorted(best), best["sizes"]
    (['num_stages', 'num_warps', 'seconds', 'sizes'], {'g_q': 16})
    """
    from lowering.triton import TRITON_BLOCKS, Config

    if key and (hit := cached(key)) is not None:
        return hit
    warps = TRITON_BLOCKS.search_warps if warps is None else warps
    stages = TRITON_BLOCKS.search_stages if stages is None else stages
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
        store(key, best)
    return best


def refine(diagram, choice, make, *, first: int = 4, cache: bool = True, log=None) -> tuple:
    """The fastest measured of the cost model's ``first`` choices (``choice.ranked``), with 4 or 8 warps and 2 or
    3 stages: ``(choice, config)``, the choice restated as measured. Inputs are random normal at
    ``choice.at``; ``make(sizes, config)`` builds the kernel. Cached by diagram, sizes, device and versions (``cache``).

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
    from lowering.triton import Config

    ks = jax.random.split(jax.random.key(0), len(diagram.dom))
    args = [
        jax.random.normal(k, tuple(choice.at[a.name] for a in w.axes), jnp.float32).astype(w.dtype.jnp)
        for k, w in zip(ks, diagram.dom.inside, strict=True)
    ]
    key = f"{diagram!r} at {sorted(choice.at.items())}" if cache else None  # with the device and versions: store
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
