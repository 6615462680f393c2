"""Decoding against a KV cache, as issue 32 measured it: ``nc.decode_attention`` (split-KV) against cuDNN and XLA
through ``jax.nn.dot_product_attention``, and a device copy of the cache for the bandwidth ceiling; the same cache
paged (pages of 64 keys, a random permutation of the pool, ``page_table=``: the same derived kernel, its chunks
loaded through the table) beside it; and each napkin-cat row's predicted time (``lowering.decode_cost``: its bytes
over the DRAM bandwidth, or its flops where longer, plus the merge) beside the measurement. Each (B, S) runs
``Nq`` = 1, 64 and 4 one after the other, and the run ends with two ratios per (B, S): paged over contiguous time
at ``Nq`` = 1 (target ≤ 1.1) and ``Nq`` = 64 over ``Nq`` = 1 time (target ≤ 1.5). Then MLA decoding
(``nc.mla_decode_attention``, DeepSeek-V3's absorbed shape: 128 heads, latent 512 + rotary 64, one shared KV
head, contiguous and paged by 64) in GB/s of cache read against the device copy's (target ≥ 70%).

bf16, ``Nq`` = 1 new token per sequence (and ``Nq`` = 4 and 64, speculative decoding / chunked prefill), 32 query
heads over 8 KV heads (grouped-query), D = 128, every key valid, (B, cache S) ∈ (1, 32k), (1, 128k), (16, 32k), (64,
4k), (64, 32k). Each implementation gets its inputs in its own layout before timing: ``q`` [B, Nq, 32, D], caches
[B, S, 8, D] for all three (jax.nn takes fewer KV heads when they divide the query heads), ``lengths`` = S for
napkin-cat. Its default part count (``parts=None``) is timed and printed. For ``Nq`` > 1 the new tokens are causal
among themselves, bottom-right aligned (query ``i`` sees keys ``< S − Nq + i + 1``); jax.nn aligns ``is_causal``
top-left and cuDNN takes no right window, so the baselines get that mask as a boolean array [1, 1, Nq, S]. Every
output is checked against an f32 reference (jnp, written here) on batch element 0 first. GB/s count the cache read
(the K and V bytes over the time); the copy's count what it reads and writes; ratios are to cuDNN's time.

    python papers/flash_attention/decode_bench.py [--out DIR] [--budget-s 300] [--smoke] [--mla-only]

Rows are written (``decode_<GPU>.json`` and ``.png``) after every configuration; configurations left when the
budget is spent are recorded as skipped. ``--smoke`` (or ``--quick``) runs tiny sizes in interpret mode on a CPU
(cuDNN skipped).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from lowering import decode_cost  # noqa: E402
from lowering._decode import _parts, chunk_keys, row_tiles  # noqa: E402  the entry's own parts and chunks
from lowering._paged import paged_split  # noqa: E402  the paged entry's split (parts, chunk), to predict it
from napkin_cat.hardware import for_device, lookup  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402
from rewrites import choose_parts  # noqa: E402

HERE = Path(__file__).resolve().parent
TOLERANCE = 2e-2  # bf16 relative error against the f32 reference, as front_door.py
CONFIGS = ((1, 32768), (1, 131072), (16, 32768), (64, 4096), (64, 32768))  # (B, cache S), issue 32's table
QUICK_CONFIGS = ((1, 256), (2, 128))
HEADS = {"full": (32, 8, 128), "quick": (8, 2, 32)}  # query heads, KV heads, D
NQS = (1, 64, 4)  # Nq = 64 right after Nq = 1, so their ratio comes from one stretch of the run
PAGE = 64  # keys per page of the paged cache
MLA = {"full": (128, 512, 64), "quick": (16, 32, 16)}  # query heads, latent dims, rotary dims (one KV head)
MLA_CONFIGS, QUICK_MLA = ((1, 32768), (16, 8192), (64, 4096)), ((2, 128),)


def tail_mask(nq: int, s: int):
    """The new tokens' bottom-right causal mask [1, 1, Nq, S]: query ``i`` sees keys ``< S − Nq + i + 1``.

    >>> tail_mask(2, 4)[0, 0].astype(int).tolist()
    [[1, 1, 1, 0], [1, 1, 1, 1]]
    """
    return (jnp.arange(s)[None, :] < s - nq + 1 + jnp.arange(nq)[:, None])[None, None]


def reference(q, k, v):
    """f32 decoding over the whole cache, written here with jnp (no napkin-cat code); KV head ``h // group``."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    k, v = (jnp.repeat(a, group, axis=2) for a in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    s = jnp.where(tail_mask(q.shape[1], k.shape[1]), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def pages(k, v, seed: int):
    """The caches ``[B, S, H_kv, D]`` as pools of ``PAGE``-key pages, shuffled, and the table that finds them:
    ``pool[table[b, i]]`` is keys ``i·PAGE … (i+1)·PAGE − 1`` of sequence ``b``.

    >>> import jax.numpy as jnp
    >>> k = jnp.arange(2 * 128).reshape(2, 128, 1, 1).astype(jnp.float32)
    >>> pk, _, table = pages(k, k, seed=0)
    >>> bool(jnp.all(pk[table].reshape(k.shape) == k))
    True
    """
    b, s = k.shape[:2]
    perm = jax.random.permutation(jax.random.key(seed), b * (s // PAGE)).astype(jnp.int32)
    pool = [c.reshape(b * (s // PAGE), PAGE, *c.shape[2:])[jnp.argsort(perm)] for c in (k, v)]
    return (*pool, perm.reshape(b, s // PAGE))


def predicted(impl: str, q, k, v, hw) -> float | None:
    """The napkin-cat rows' predicted milliseconds (``decode_cost`` with the entry's own parts and chunks)."""
    (b, nq, h, d), (_, s, h_kv, _) = q.shape, k.shape
    shape = dict(batch=b, queries=nq, heads=h, kv_heads=h_kv, dim=d, lengths=[s] * b, hardware=hw)
    if impl == "napkin":
        n = _parts(b, h_kv * row_tiles(nq * h // h_kv), s, hw)
        return 1e3 * decode_cost(**shape, parts=n, chunk=min(64, -(-s // n))).seconds
    if impl == "paged":
        n, _, chunk = paged_split(s // PAGE, PAGE, parts=None, chunk=chunk_keys((d, d)),
                                  n_default=choose_parts(b * h_kv * row_tiles(nq * h // h_kv), s, hw))  # fmt: skip
        return 1e3 * decode_cost(**shape, parts=n, chunk=chunk, table_width=s // PAGE).seconds
    return None


def implementations(q, k, v, gpu: bool, seed: int = 0) -> dict:
    """Each implementation: its jitted function and its arguments, laid out before timing."""
    b, nq, s = q.shape[0], q.shape[1], k.shape[1]
    lengths = jnp.full((b,), s, jnp.int32)
    mask = tail_mask(nq, s) if nq > 1 else None
    impls = {"napkin": (jax.jit(lambda q, k, v, n: nc.decode_attention(q, k, v, n)), (q, k, v, lengths))}
    paged = jax.jit(lambda q, k, v, t, n: nc.decode_attention(q, k, v, n, page_table=t))
    impls["paged"] = (paged, (q, *pages(k, v, seed), lengths))
    for name in ("cudnn", "xla") if gpu else ("xla",):
        fn = jax.jit(lambda q, k, v, m, name=name: jax.nn.dot_product_attention(q, k, v, mask=m, implementation=name))
        impls[name] = (fn, (q, k, v, mask))
    impls["copy"] = (jax.jit(lambda k, v: (jnp.copy(k), jnp.copy(v))), (k, v))
    return impls


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def measure(name, fn, args, want, cache_bytes: int) -> dict:
    """One implementation: checked on batch 0 (not the copy), then timed; GB/s of cache read (copy: read + write)."""
    row = {"impl": name}
    try:
        if name != "copy":
            row["max_rel_error"] = rel(fn(*args)[:1], want)
            row["ok"] = row["max_rel_error"] <= TOLERANCE
        t = time_calls(fn, *args, reps=20, batches=5, warmup=2)
    except Exception as e:  # a baseline that refuses a shape (cuDNN) is recorded and reported, the run goes on
        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        print(f"  {name:7s} failed: {row['error']}", flush=True)
        return row
    moved = 2 * cache_bytes if name == "copy" else cache_bytes
    row.update(ms=t.ms, gbs=moved / t.seconds / 1e9, clock=t.method)
    return row


def configuration(b: int, s: int, nq: int, heads: tuple, gpu: bool, seed: int) -> dict:
    """One (B, S, Nq): every implementation checked and timed, GB/s and ratios to cuDNN printed."""
    h, h_kv, d = heads
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, nq, h, d), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, s, h_kv, d), jnp.bfloat16) for kk in keys[1:])
    cache_bytes = 2 * k.size * k.dtype.itemsize
    want = reference(q[:1], k[:1], v[:1])
    parts = _parts(b, h_kv * row_tiles(nq * h // h_kv), s, lookup("H100"))
    hw = for_device(device_info()["kind"]) or lookup("H100")  # the GPU's model; H100 where there is none
    entry = {"B": b, "S": s, "Nq": nq, "cache_GB": cache_bytes / 1e9, "parts": parts, "rows": []}
    print(f"B={b} S={s} Nq={nq}: cache {cache_bytes / 1e9:.2f} GB, napkin-cat's default parts {parts}", flush=True)
    for name, (fn, args) in implementations(q, k, v, gpu, seed).items():
        row = measure(name, fn, args, want, cache_bytes)
        if (ms := predicted(name, q, k, v, hw)) is not None:
            row.update(predicted_ms=ms, predicted_on=hw.name)
        entry["rows"].append(row)
    base = next((r for r in entry["rows"] if r["impl"] == "cudnn" and "ms" in r), None)
    for r in entry["rows"]:
        if base is not None and "ms" in r and r["impl"] != "copy":
            r["vs_cudnn"] = base["ms"] / r["ms"]
        if "ms" in r:
            ratio = f"  {r['vs_cudnn']:.2f}× cuDNN" if "vs_cudnn" in r else ""
            err = f"  err {r['max_rel_error']:.1e}" if "max_rel_error" in r else "  (read + write)"
            pred = f"  predicted {r['predicted_ms']:.4g} ms on {r['predicted_on']}" if "predicted_ms" in r else ""
            print(
                f"  {r['impl']:7s} {r['ms']:8.3f} ms {r['gbs']:7.0f} GB/s{ratio}{pred}{err} ({r['clock']})", flush=True
            )
    return entry


def ratios(entries: list) -> list:
    """Per (B, S): paged over contiguous time at ``Nq`` = 1, and ``Nq`` = 64 over ``Nq`` = 1 (contiguous).

    >>> row = lambda ms: [{"impl": "napkin", "ms": ms}, {"impl": "paged", "ms": 1.05 * ms}]
    >>> ratios([{"B": 1, "S": 8, "Nq": 1, "rows": row(1.0)}, {"B": 1, "S": 8, "Nq": 64, "rows": row(1.4)}])
    [{'B': 1, 'S': 8, 'paged_over_contiguous': 1.05, 'nq64_over_nq1': 1.4}]
    """
    ms = {(e["B"], e["S"], e["Nq"], r["impl"]): r["ms"] for e in entries for r in e.get("rows", []) if "ms" in r}
    out = []
    for b, s in dict.fromkeys((e["B"], e["S"]) for e in entries):
        one = ms.get((b, s, 1, "napkin"))
        row = {"B": b, "S": s}
        if one and (paged := ms.get((b, s, 1, "paged"))):
            row["paged_over_contiguous"] = round(paged / one, 3)
        if one and (many := ms.get((b, s, 64, "napkin"))):
            row["nq64_over_nq1"] = round(many / one, 3)
        out.append(row)
    return out


def mla_reference(q, latent, rope):
    """f32 MLA decoding over the whole cache, written here with jnp: scores over latent + rotary dims, values
    the latent keys."""
    q, keys, latent = (a.astype(jnp.float32) for a in (q, jnp.concatenate([latent, rope], -1), latent))
    s = jnp.einsum("bqhd,bkd->bhqk", q, keys) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkc->bqhc", jax.nn.softmax(s, axis=-1), latent)


def mla_configuration(b: int, s: int, dims: tuple, seed: int) -> dict:
    """MLA decoding at (B, S), ``Nq`` = 1: contiguous and paged (pages of ``PAGE``), checked, timed, in GB/s of
    cache read (latent + rotary keys) beside the device copy's (read + write), with ``decode_cost``'s prediction."""
    h, c, r = dims
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, 1, h, c + r), jnp.bfloat16)
    latent, rope = (jax.random.normal(kk, (b, s, n), jnp.bfloat16) for kk, n in zip(keys[1:], (c, r), strict=True))
    cache_bytes = (latent.size + rope.size) * 2
    lengths = jnp.full((b,), s, jnp.int32)
    pool_c, pool_r, table = pages(latent[:, :, None], rope[:, :, None], seed)
    impls = {
        "mla": (jax.jit(lambda q, c, r, n: nc.mla_decode_attention(q, c, r, n)), (q, latent, rope, lengths)),
        "mla_paged": (
            jax.jit(lambda q, c, r, t, n: nc.mla_decode_attention(q, c, r, n, page_table=t)),
            (q, pool_c[:, :, 0], pool_r[:, :, 0], table, lengths),
        ),  # fmt: skip
        "copy": (jax.jit(lambda c, r: (jnp.copy(c), jnp.copy(r))), (latent, rope)),
    }
    want = mla_reference(q[:1], latent[:1], rope[:1])
    hw = for_device(device_info()["kind"]) or lookup("H100")
    entry = {"B": b, "S": s, "Nq": 1, "mla": dict(zip(("H", "C", "R"), dims, strict=True)), "rows": []}
    entry["cache_GB"] = cache_bytes / 1e9
    print(f"MLA B={b} S={s}: H={h}, latent {c} + rotary {r}, cache {cache_bytes / 1e9:.2f} GB", flush=True)
    n = _parts(b, row_tiles(h), s, lookup("H100"))
    for name, (fn, args) in impls.items():
        row = measure(name, fn, args, want, cache_bytes)
        if name != "copy":
            paged = dict(table_width=s // PAGE) if name == "mla_paged" else {}
            cost = decode_cost(batch=b, queries=1, heads=h, kv_heads=1, dim=c, rope=r, lengths=[s] * b, parts=n,
                               chunk=chunk_keys((c, c)), hardware=hw, **paged)  # fmt: skip
            row.update(predicted_ms=1e3 * cost.seconds, predicted_on=hw.name)
        entry["rows"].append(row)
    copy = next((r for r in entry["rows"] if r["impl"] == "copy" and "gbs" in r), None)
    for r in entry["rows"]:
        if copy is not None and "gbs" in r and r["impl"] != "copy":
            r["of_copy_bandwidth"] = r["gbs"] / copy["gbs"]
        if "ms" in r:
            share = f"  {100 * r['of_copy_bandwidth']:.0f}% of the copy's GB/s" if "of_copy_bandwidth" in r else ""
            err = f"  err {r['max_rel_error']:.1e}" if "max_rel_error" in r else "  (read + write)"
            print(f"  {r['impl']:9s} {r['ms']:8.3f} ms {r['gbs']:7.0f} GB/s{share}{err} ({r['clock']})", flush=True)
    return entry


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--smoke", "--quick", dest="quick", action="store_true", help="tiny sizes, interpret mode")
    p.add_argument("--mla-only", action="store_true", help="only the MLA configurations")
    o = p.parse_args(argv)
    start, seed = time.perf_counter(), int(time.time()) % 10_000
    dev, gpu = device_info(), jax.default_backend() == "gpu"
    heads = HEADS["quick" if o.quick else "full"]
    print(f"{dev['kind']}: bf16, heads {heads[0]} over {heads[1]} KV heads, D={heads[2]}; seed {seed}", flush=True)
    res = {"device": dev, "heads": dict(zip(("H", "H_kv", "D"), heads, strict=True)), "seed": seed, "entries": []}
    stem = f"decode_{device_stem(dev['kind'])}{'_quick' if o.quick else ''}"
    o.out.mkdir(parents=True, exist_ok=True)
    skipped = {"skipped": f"budget of {o.budget_s:.0f} s spent"}
    for b, s in () if o.mla_only else QUICK_CONFIGS if o.quick else CONFIGS:
        for nq in NQS:
            over = time.perf_counter() - start > o.budget_s
            res["entries"].append(
                {"B": b, "S": s, "Nq": nq, **skipped} if over else configuration(b, s, nq, heads, gpu, seed)
            )
            res["ratios"] = ratios(res["entries"])
            (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
            plot(res, o.out / f"{stem}.png")
    for b, s in QUICK_MLA if o.quick else MLA_CONFIGS:
        over = time.perf_counter() - start > o.budget_s
        mla = MLA["quick" if o.quick else "full"]
        res.setdefault("mla", []).append({"B": b, "S": s, **skipped} if over else mla_configuration(b, s, mla, seed))
        (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    for r in res.get("ratios", []):
        print(f"B={r['B']} S={r['S']}: paged / contiguous {r.get('paged_over_contiguous', '–')} (Nq = 1), "
              f"Nq = 64 / Nq = 1 {r.get('nq64_over_nq1', '–')}", flush=True)  # fmt: skip
    return res


def plot(res: dict, path: Path) -> None:
    """Bars: cache-read GB/s per implementation for each configuration timed, with the GPU's name."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [e for e in res["entries"] if "rows" in e]
    names = list(dict.fromkeys(r["impl"] for e in done for r in e["rows"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(done)), 3.8))
    width = 0.8 / max(1, len(names))
    for i, name in enumerate(names):
        ys = [next((r.get("gbs", 0.0) for r in e["rows"] if r["impl"] == name), 0.0) for e in done]
        label = "copy (read + write)" if name == "copy" else name
        ax.bar([x + width * i for x in range(len(done))], ys, width, label=label)
    ticks = [f"B={e['B']}\nS={e['S']}\nNq={e['Nq']}" for e in done]
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(done))], ticks, fontsize=7)
    z = res["heads"]
    ax.set_title(f"{res['device']['kind']}: decoding, bf16, H={z['H']}, H_kv={z['H_kv']}, D={z['D']}", fontsize=9)
    ax.set_ylabel("cache-read GB/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
