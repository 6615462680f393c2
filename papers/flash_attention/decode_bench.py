"""Decoding against a KV cache, as issue 32 measured it: ``nc.decode_attention`` (split-KV) against cuDNN and XLA
through ``jax.nn.dot_product_attention``, and a device copy of the cache for the bandwidth ceiling; the same cache
paged (pages of 64 keys, a random permutation of the pool, ``page_table=``: the same derived kernel, its chunks
loaded through the table) beside it; and each napkin-cat row's predicted time (``lowering.decode_cost``: its bytes
over the DRAM bandwidth, or its flops where longer, plus the merge) beside the measurement. Each napkin-cat row
prints the plan it ran (``lowering._decode.decode_plan``): parts and keys per part, row tiles of a KV head and
rows per tile, keys per streamed chunk, backend. The run ends with two ratios per (B, S): paged over contiguous
time at ``Nq`` = 1 (target ≤ 1.1) and ``Nq`` = 64 over ``Nq`` = 1 time (target ≤ 1.5). MLA decoding
(``nc.mla_decode_attention``, DeepSeek-V3's absorbed shape: 128 heads, latent 512 + rotary 64, one shared KV
head, contiguous and paged by 64) in GB/s of cache read against the device copy's (target ≥ 70%). The first row
also times ``nc.attention(q, k, v, key_value_seq_lengths=n)``, the call a jax.nn user decodes with: ``entry`` (the
entry runs it as a decode step) and ``entry_dense`` (``split_keys=False``: the attention kernels, as before).

bf16, 32 query heads over 8 KV heads (grouped-query), D = 128, every key valid. The rows (:data:`ROWS`, named
``<what>-b<B>-s<S>``) run in order of importance, so a budget that runs out leaves the least important: issue 32's
table first (B = 1 at 32k and 128k with ``Nq`` = 64 beside ``Nq`` = 1, then B = 16 and 64), the steps run in one
part (``one-part-…``: B = 64 at 4k, ``Nq`` = 1 and 64, where the batch fills the GPU: the kernel alone, no merge,
each kernel's time beside the step's; stops 50 and 51 timed them with the merge: 0.249 and 0.533 ms), MLA, the
variants that explain a row (``sweep-…``: twice the parts, chunks of 128 keys with and without them, paged chunks of
two pages, at B = 1, 16 and 64 (4k and 32k) for ``Nq`` = 1; rows per program 64 and 256 and chunks of
64 keys at ``Nq`` = 64 on Triton and Mosaic beside ``auto`` (Mosaic there on a Hopper GPU) and Triton, with
FlashAttention-3's forward blocks on Mosaic (256 rows, 128 keys),
MLA at 16 and 32 rows per program),
then the rest of B ∈ {1, 16, 64} × cache ∈ {4k, 32k, 128k} and ``Nq`` = 4. ``--rows`` selects rows by name
patterns (``--rows 'nq1-*,mla-*'``; ``--list`` prints them). Caches over 12 GB (B = 64 at 128k) run without the
paged copy and the device copy (they would not fit beside it). Each implementation gets its inputs in its own
layout before timing: ``q`` [B, Nq, 32, D], caches [B, S, 8, D] for all three (jax.nn takes fewer KV heads when
they divide the query heads), ``lengths`` = S for napkin-cat. For ``Nq`` > 1 the new tokens are causal among
themselves, bottom-right aligned (query ``i`` sees keys ``< S − Nq + i + 1``); jax.nn aligns ``is_causal``
top-left and cuDNN takes no right window, so the baselines get that mask as a boolean array [1, 1, Nq, S]; XLA
also gets ``key_value_seq_lengths`` = ``lengths`` (issue 32's target: ≥ 2× XLA with a length mask). Every
output is checked against an f32 reference (jnp, written here) on batch element 0 first. GB/s count the cache read
(the K and V bytes over the time); the copy's count what it reads and writes; ratios are to cuDNN's and XLA's
time.

    python papers/flash_attention/decode_bench.py [--out DIR] [--budget-s 300] [--rows PATTERNS] [--list] [--smoke]
    python papers/flash_attention/decode_bench.py --counters nq1-b1-s32k[:IMPL][,ROW[:IMPL]...]
    python papers/flash_attention/decode_bench.py --launches nq1-b1-s32k[:IMPL]

``--counters`` (IMPL: napkin by default, or paged, a variant) runs ncu on each step, in a process of its own
(``--ncu ROW[:IMPL]``: three steps, the first compiling), and sums the last step's kernels' DRAM bytes read and
time against ``decode_cost``'s prediction (issue 32: DRAM bytes within 10%, time within 30%); it writes
``decode_counters_<GPU>.json``. ``--launches ROW[:IMPL]``
prints the kernels the compiled step launches (its entry computation's fusions and custom calls: on a CPU the
interpreted kernel is a loop).

Rows are written (``decode_<GPU>.json`` and ``.png``) after every row; rows left when the budget is spent are
recorded as skipped. ``--smoke`` (or ``--quick``) runs tiny sizes in interpret mode on a CPU (cuDNN skipped).
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from lowering import decode_cost  # noqa: E402
from lowering._decode import _mla_plan, decode_plan  # noqa: E402  the entries' own plans: parts, tiles, chunk, backend
from napkin_cat.hardware import for_device, lookup  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402

HERE = Path(__file__).resolve().parent
TOLERANCE = 2e-2  # bf16 relative error against the f32 reference, as front_door.py
HEADS = {"full": (32, 8, 128), "quick": (8, 2, 32)}  # query heads, KV heads, D
PAGE = 64  # keys per page of the paged cache
MLA = {"full": (128, 512, 64), "quick": (16, 32, 16)}  # query heads, latent dims, rotary dims (one KV head)
BIG = 12e9  # cache bytes past which the paged pool and the device copy are left out (they would not fit beside it)
BASE = ("napkin", "paged", "cudnn", "xla", "copy")
#: MLA's variants (``sweep-mla-…``): keyword arguments to mla_decode_attention, and whether paged: rows per program
#: beside the default 64 (a chunk of 64 keys beside the default 32 is refused: 353,028 B of shared memory at 64 rows,
#: over an H200's 232,448)
MLA_VARIANTS = {
    "mla_tile16": ({"tile": 16}, False),
    "mla_tile32": ({"tile": 32}, False),
    "mla_chunk64": ({"chunk": 64}, False),  # 64 keys a chunk: fits shared memory since the latent is loaded once
    "mla_paged_chunk64": ({"chunk": 64}, True),
    "mla_values256": ({"values": 256}, False),  # the 512 latent output dims split over two programs
    "mla_values128": ({"values": 128}, False),
    "mla_values128_tile128": ({"values": 128, "tile": 128}, False),  # 128 heads in one row tile, 4 programs
}
#: variants of a napkin-cat row: (keyword arguments to decode_attention, paged): what explains a row's time
VARIANTS = {
    "napkin_parts2x": ({"parts": "2x"}, False),
    "paged_chunk128": ({"chunk": 2 * PAGE}, True),
    "napkin_tile64": ({"tile": 64}, False),
    "napkin_tile256": ({"tile": 256}, False),
    "napkin_mosaic": ({"backend": "mosaic"}, False),
    "napkin_mosaic_tile64": ({"backend": "mosaic", "tile": 64}, False),
    "napkin_chunk128": ({"chunk": 128}, False),
    "napkin_chunk128_parts2x": ({"chunk": 128, "parts": "2x"}, False),
    "napkin_triton": ({"backend": "triton"}, False),  # beside auto where auto runs Mosaic (Nq = 64 on a Hopper GPU)
    "paged_triton": ({"backend": "triton"}, True),  # beside auto's paged step where auto runs Mosaic
    "napkin_mosaic_tile256": ({"backend": "mosaic", "tile": 256}, False),
    "napkin_mosaic_chunk64": ({"backend": "mosaic", "chunk": 64}, False),
    "napkin_triton_chunk64": ({"backend": "triton", "chunk": 64}, False),
    # FlashAttention-3's forward blocks: two consumer warpgroups of 128 rows, chunks of 128 keys
    "napkin_mosaic_fa3": ({"backend": "mosaic", "tile": 256, "chunk": 128}, False),
}


def rows(quick: bool) -> list[dict]:
    """The rows in the order they run: ``{name, B, S, Nq, impls}`` (``mla``: an MLA row). ``quick``: tiny caches.

    >>> [r["name"] for r in rows(quick=False)][:4]
    ['nq1-b1-s32k', 'nq64-b1-s32k', 'nq1-b1-s128k', 'nq64-b1-s128k']
    >>> len(rows(quick=False)), len(rows(quick=True))
    (28, 28)
    """
    k = 1 if quick else 1024
    s4, s32, s128 = (64, 128, 256) if quick else (4 * k, 32 * k, 128 * k)
    b16, b64 = (2, 3) if quick else (16, 64)

    def row(what, b, s, nq=1, impls=BASE):
        size = f"{s // k}k" if not quick else str(s)
        return {"name": f"{what}-b{b}-s{size}", "B": b, "S": s, "Nq": nq, "impls": impls}

    sweep = ("napkin", "napkin_parts2x", "napkin_chunk128", "napkin_chunk128_parts2x", "paged", "paged_chunk128")
    tiles = ("napkin", "napkin_triton", "napkin_mosaic_chunk64", "napkin_triton_chunk64", "napkin_tile64",
             "napkin_tile256", "napkin_mosaic_tile64", "napkin_mosaic_tile256", "napkin_mosaic_fa3")
    return [
        row("nq1", 1, s32, impls=(*BASE, "entry", "entry_dense")),
        row("nq64", 1, s32, 64, ("napkin", "napkin_triton", "paged", "paged_triton", "cudnn")),
        row("nq1", 1, s128), row("nq64", 1, s128, 64, ("napkin", "paged")),
        row("nq1", b16, s32), row("nq1", b64, s4), row("nq1", b64, s32),
        # in one part (the batch fills the GPU): the kernel alone, no merge (H200, stops 50/51: 0.249, 0.533 ms with it)
        row("one-part-nq1", b64, s4, 1, ("napkin", "paged", "cudnn")),
        row("one-part-nq64", b64, s4, 64, ("napkin", "napkin_triton", "paged", "paged_triton", "cudnn")),
        {**row("mla", 1, s32, impls=("mla", "mla_chunk64", "mla_paged", "mla_paged_chunk64", "copy")), "mla": True},
        {**row("mla", b64, s4, impls=("mla", "mla_chunk64", "mla_paged", "mla_paged_chunk64", "copy")), "mla": True},
        {**row("sweep-mla", 1, s32, impls=("mla", *MLA_VARIANTS, "copy")), "mla": True},
        {**row("sweep-mla", b64, s4, impls=("mla", *MLA_VARIANTS, "copy")), "mla": True},
        row("sweep-nq1", 1, s32, 1, sweep), row("sweep-nq64", 1, s32, 64, tiles),
        row("sweep-nq1", b16, s32, 1, sweep), row("sweep-nq1", b64, s4, 1, sweep),
        row("sweep-nq1", b64, s32, 1, sweep), row("sweep-nq1", b16, s4, 1, sweep),
        row("nq1", 1, s4), row("nq1", b16, s4), row("nq1", b16, s128), row("nq1", b64, s128, impls=BASE[:4]),
        row("nq4", 1, s32, 4), row("nq64", b16, s32, 64, ("napkin", "napkin_triton", "paged", "paged_triton", "xla")),
        row("nq64", b64, s4, 64, ("napkin", "napkin_triton", "paged", "paged_triton", "xla")), row("nq4", b64, s32, 4),
        {**row("mla", b16, max(s32 // 4, s4), impls=("mla", "mla_paged", "copy")), "mla": True},  # whole pages
    ]  # fmt: skip


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


def options(impl: str, parts: int) -> tuple[dict, bool]:
    """A napkin-cat implementation's keyword arguments to ``decode_attention`` and whether it reads pages
    (``parts``: the default's, which ``napkin_parts2x`` doubles).

    >>> options("napkin_parts2x", 16), options("paged", 16)
    (({'parts': 32}, False), ({}, True))
    """
    kw, paged = VARIANTS.get(impl, ({}, impl == "paged"))
    return ({**kw, "parts": 2 * parts} if kw.get("parts") == "2x" else kw), paged


def plans(q, k, v, lengths, table, impls, hw) -> dict:
    """Each napkin-cat implementation's plan (``decode_plan``: built as the call builds it) and its prediction."""
    (b, nq, h, d), (_, s, h_kv, _) = q.shape, k.shape
    default = decode_plan(q, k, v, lengths).parts
    out = {}
    for impl in impls:
        if not impl.startswith(("napkin", "paged")):
            continue
        kw, paged = options(impl, default)
        pools = table is not None and paged
        try:  # a variant the backend refuses (NotLowerable) is its row's error; the run goes on
            plan = decode_plan(q, *(table[:2] if pools else (k, v)), lengths, page_table=table[2] if pools else None,
                               **kw)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - recorded and reported as measure() records a baseline's
            out[impl] = (kw, paged, {"refused": f"{type(e).__name__}: {str(e)[:300]}"})
            continue
        summary = plan.summary()
        cost = decode_cost(batch=b, queries=nq, heads=h, kv_heads=h_kv, dim=d, lengths=[s] * b, parts=plan.parts,
                           chunk=summary["chunk"], row_tiles=summary["row_tiles"], hardware=hw,
                           table_width=s // PAGE if paged else 0)  # fmt: skip
        out[impl] = (kw, paged, {**summary, "predicted_ms": 1e3 * cost.seconds, "predicted_on": hw.name,
                                 "predicted_read_bytes": cost.read_bytes})  # fmt: skip
    return out


def modelled():
    """The cost model's hardware for this machine's GPU: its own where the model has it, else the H100's (and on a
    CPU, where the rows are tiny and interpreted).

    >>> modelled().name in ("H100", "H200", "A100", "A100-40GB")
    True
    """
    return for_device(device_info()["kind"]) or lookup("H100")


def implementations(q, k, v, impls, gpu: bool, seed: int = 0) -> tuple[dict, dict]:
    """Each implementation of ``impls``: its jitted function and its arguments, laid out before timing, and the
    napkin-cat rows' plans (:func:`plans`)."""
    b, nq, s = q.shape[0], q.shape[1], k.shape[1]
    lengths = jnp.full((b,), s, jnp.int32)
    mask = tail_mask(nq, s) if nq > 1 else None
    table = pages(k, v, seed) if any(VARIANTS.get(i, (0, i == "paged"))[1] for i in impls) else None
    hw = modelled()
    planned = plans(q, k, v, lengths, table, impls, hw)
    out = {}
    for impl, (kw, paged, summary) in planned.items():
        if "refused" in summary:
            out[impl] = (functools.partial(_refused, summary["refused"]), ())
        elif paged:
            fn = jax.jit(lambda q, k, v, t, n, kw=kw: nc.decode_attention(q, k, v, n, page_table=t, **kw))
            out[impl] = (fn, (q, *table, lengths))
        else:
            out[impl] = (jax.jit(lambda q, k, v, n, kw=kw: nc.decode_attention(q, k, v, n, **kw)), (q, k, v, lengths))
    if "cudnn" in impls and gpu:
        fn = jax.jit(lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation="cudnn"))
        out["cudnn"] = (fn, (q, k, v, mask))
    if "xla" in impls:  # with a length mask, as issue 32's target states it
        fn = jax.jit(lambda q, k, v, m, n: jax.nn.dot_product_attention(q, k, v, mask=m, key_value_seq_lengths=n,
                                                                         implementation="xla"))  # fmt: skip
        out["xla"] = (fn, (q, k, v, mask, lengths))
    for name, split in (("entry", None), ("entry_dense", False)):  # nc.attention as jax.nn users call it to decode
        if name in impls and nq == 1:
            fn = jax.jit(lambda q, k, v, n, split=split: nc.attention(q, k, v, key_value_seq_lengths=n,
                                                                       split_keys=split))  # fmt: skip
            out[name] = (fn, (q, k, v, lengths))
    if "copy" in impls:
        out["copy"] = (jax.jit(lambda k, v: (jnp.copy(k), jnp.copy(v))), (k, v))
    return out, {impl: summary for impl, (_, _, summary) in planned.items()}


def _refused(why: str):
    """A variant whose plan was refused: measured, it records the refusal as its row's error."""
    raise RuntimeError(why)


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
    if t.kernels and name != "copy":  # what each kernel of a step takes (CUPTI): the split kernel against the merge
        row["kernels_ms"] = [[kernel, 1e3 * seconds] for kernel, seconds in t.kernels]
    return row


def inputs(row: dict, heads: tuple, seed: int) -> tuple:
    """A row's ``q`` [B, Nq, H, D] and caches [B, S, H_kv, D], bf16, random."""
    (h, h_kv, d), b, s, nq = heads, row["B"], row["S"], row["Nq"]
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, nq, h, d), jnp.bfloat16)
    return (q, *(jax.random.normal(kk, (b, s, h_kv, d), jnp.bfloat16) for kk in keys[1:]))


def configuration(row: dict, heads: tuple, gpu: bool, seed: int) -> dict:
    """One row: every implementation checked and timed, GB/s, ratios to cuDNN and XLA, the napkin-cat plans."""
    b, s, nq = row["B"], row["S"], row["Nq"]
    q, k, v = inputs(row, heads, seed)
    cache_bytes = 2 * k.size * k.dtype.itemsize
    impls = [i for i in row["impls"] if cache_bytes <= BIG or i not in ("paged", "copy")]
    want = reference(q[:1], k[:1], v[:1])
    entry = {"name": row["name"], "B": b, "S": s, "Nq": nq, "cache_GB": cache_bytes / 1e9, "rows": []}
    print(f"{row['name']}: B={b} S={s} Nq={nq}, cache {cache_bytes / 1e9:.2f} GB", flush=True)
    fns, planned = implementations(q, k, v, impls, gpu, seed)
    for name, (fn, args) in fns.items():
        entry["rows"].append({**measure(name, fn, args, want, cache_bytes), **planned.get(name, {})})
        if "ms" in entry["rows"][-1]:  # as each is timed: a run cut short still says what it measured
            print(f"    timed {name}: {entry['rows'][-1]['ms']:.4f} ms", flush=True)
    for name in ("cudnn", "xla"):
        base = next((r for r in entry["rows"] if r["impl"] == name and "ms" in r), None)
        for r in entry["rows"]:
            if base is not None and "ms" in r and r["impl"] not in ("copy", name):
                r[f"vs_{name}"] = base["ms"] / r["ms"]
    for r in entry["rows"]:
        if "ms" in r:
            print(f"  {r['impl']:15s} {r['ms']:8.3f} ms {r['gbs']:7.0f} GB/s{described(r)}", flush=True)
    return entry


def described(r: dict) -> str:
    """A row's ratios to cuDNN and XLA, prediction, plan (parts × keys, row tiles × rows, chunk, backend), error
    and clock.

    >>> described({"impl": "napkin", "vs_cudnn": 0.9, "vs_xla": 1.25, "parts": 16, "keys_per_part": 2048,
    ...            "row_tiles": 1, "tile": 16, "chunk": 64, "backend": "triton", "max_rel_error": 0.003,
    ...            "clock": "cupti"})
    '  0.90× cuDNN  1.25× XLA  [16 parts × 2048 keys, 1 × 16 rows, chunk 64, triton]  err 3.0e-03 (cupti)'
    >>> described({"impl": "cudnn", "max_rel_error": 0.003, "clock": "cupti", "kernels_ms": [["a", 0.03], ["b", 4e-3]]})
    '  err 3.0e-03 (cupti)  kernels: a 30.0 us, b 4.0 us'
    """
    out = f"  {r['vs_cudnn']:.2f}× cuDNN" if "vs_cudnn" in r else ""
    out += f"  {r['vs_xla']:.2f}× XLA" if "vs_xla" in r else ""
    out += f"  {100 * r['of_copy_bandwidth']:.0f}% of the copy's GB/s" if "of_copy_bandwidth" in r else ""
    out += f"  predicted {r['predicted_ms']:.4g} ms on {r['predicted_on']}" if "predicted_ms" in r else ""
    if "parts" in r:
        out += f"  [{r['parts']} parts × {r['keys_per_part']} keys, {r['row_tiles']} × {r['tile']} rows, "
        out += f"chunk {r['chunk']}, {r['backend']}]"
    out += f"  err {r['max_rel_error']:.1e}" if "max_rel_error" in r else "  (read + write)"
    out += f" ({r['clock']})"
    if len(r.get("kernels_ms", ())) > 1:
        out += "  kernels: " + ", ".join(f"{name[:24]} {ms * 1e3:.1f} us" for name, ms in r["kernels_ms"])
    return out


def ratios(entries: list) -> list:
    """Per (B, S): paged over contiguous time at ``Nq`` = 1, and ``Nq`` = 64 over ``Nq`` = 1 (contiguous).

    >>> row = lambda ms: [{"impl": "napkin", "ms": ms}, {"impl": "paged", "ms": 1.05 * ms}]
    >>> ratios([{"B": 1, "S": 8, "Nq": 1, "rows": row(1.0)}, {"B": 1, "S": 8, "Nq": 64, "rows": row(1.4)}])
    [{'B': 1, 'S': 8, 'paged_over_contiguous': 1.05, 'nq64_over_nq1': 1.4}]
    """
    ms = {
        (e["B"], e["S"], e["Nq"], r["impl"]): r["ms"]
        for e in entries
        if not e.get("name", "").startswith("sweep")  # a sweep's rows repeat the default beside its variants
        for r in e.get("rows", [])
        if "ms" in r
    }
    out = []
    for b, s in dict.fromkeys((e["B"], e["S"]) for e in entries if "mla" not in e):
        one = ms.get((b, s, 1, "napkin"))
        row = {"B": b, "S": s}
        if one and (paged := ms.get((b, s, 1, "paged"))):
            row["paged_over_contiguous"] = round(paged / one, 3)
        if one and (many := ms.get((b, s, 64, "napkin"))):
            row["nq64_over_nq1"] = round(many / one, 3)
        out.append(row)
    return out


def nq64_floor(b: int, s: int, hw, heads: tuple = HEADS["full"]) -> dict:
    """The cost model's least ``Nq`` = 64 over ``Nq`` = 1 time at batch ``b``, cache ``s`` (the roofline, kernel alone:
    the cache once from DRAM, the products at the ceiling's rate times FAN's utilisation), for a kernel whose warps
    run the softmax and the products in turn (``in_turn``: Triton's) and one that overlaps them whole
    (``overlapped``), with ``heads`` (query heads, KV heads, D) as the run's. Issue 32's target, 1.5×, lies
    between the two on an H200.

    >>> nq64_floor(1, 32768, "H200")
    {'in_turn': 2.11, 'overlapped': 1.4}
    """
    h, h_kv, d = heads
    out = {}
    for name, unhidden in (("in_turn", 1.0), ("overlapped", 0.0)):
        one, many = (decode_cost(batch=b, queries=nq, heads=h, kv_heads=h_kv, dim=d, lengths=[s] * b, parts=1,
                                 hardware=hw, unhidden=unhidden).kernel_seconds for nq in (1, 64))  # fmt: skip
        out[name] = round(many / one, 2)
    return out


def mla_reference(q, latent, rope):
    """f32 MLA decoding over the whole cache, written here with jnp: scores over latent + rotary dims, values
    the latent keys."""
    q, keys, latent = (a.astype(jnp.float32) for a in (q, jnp.concatenate([latent, rope], -1), latent))
    s = jnp.einsum("bqhd,bkd->bhqk", q, keys) / jnp.sqrt(q.shape[-1])
    return jnp.einsum("bhqk,bkc->bqhc", jax.nn.softmax(s, axis=-1), latent)


def mla_configuration(row: dict, dims: tuple, seed: int) -> dict:
    """An MLA row, ``Nq`` = 1: contiguous and paged (pages of ``PAGE``), checked, timed, in GB/s of cache read
    (latent + rotary keys) beside the device copy's (read + write), with its plan and ``decode_cost``'s prediction."""
    (h, c, r), b, s = dims, row["B"], row["S"]
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, 1, h, c + r), jnp.bfloat16)
    latent, rope = (jax.random.normal(kk, (b, s, n), jnp.bfloat16) for kk, n in zip(keys[1:], (c, r), strict=True))
    cache_bytes = (latent.size + rope.size) * 2
    lengths = jnp.full((b,), s, jnp.int32)
    pool_c, pool_r, table = pages(latent[:, :, None], rope[:, :, None], seed)
    pools = (pool_c[:, :, 0], pool_r[:, :, 0])
    impls = {
        "mla": (jax.jit(lambda q, c, r, n: nc.mla_decode_attention(q, c, r, n)), (q, latent, rope, lengths)),
        **{
            name: (jax.jit(functools.partial(nc.mla_decode_attention, **kw)), (q, latent, rope, lengths))
            if not paged
            else (jax.jit(lambda q, c, r, t, n, kw=kw: nc.mla_decode_attention(q, c, r, n, page_table=t, **kw)),
                  (q, *pools, table, lengths))  # fmt: skip
            for name, (kw, paged) in MLA_VARIANTS.items()
        },
        "mla_paged": (
            jax.jit(lambda q, c, r, t, n: nc.mla_decode_attention(q, c, r, n, page_table=t)),
            (q, *pools, table, lengths),
        ),  # fmt: skip
        "copy": (jax.jit(lambda c, r: (jnp.copy(c), jnp.copy(r))), (latent, rope)),
    }
    impls = {name: impls[name] for name in row["impls"]}
    want = mla_reference(q[:1], latent[:1], rope[:1])
    hw = modelled()
    entry = {"name": row["name"], "B": b, "S": s, "Nq": 1, "mla": dict(zip(("H", "C", "R"), dims, strict=True))}
    entry |= {"cache_GB": cache_bytes / 1e9, "rows": []}
    print(f"{row['name']}: B={b} S={s}: H={h}, latent {c} + rotary {r}, cache {cache_bytes / 1e9:.2f} GB", flush=True)
    for name, (fn, args) in impls.items():
        got = measure(name, fn, args, want, cache_bytes)
        if name != "copy" and "error" not in got:  # a refused variant's plan is its error, already recorded
            kw, paged = MLA_VARIANTS.get(name, ({}, name == "mla_paged"))
            caches = (*pools, table) if paged else (latent, rope, None)
            summary = _mla_plan(q, *caches[:2], lengths, None, caches[2], None, kw.get("chunk"), "auto", None, None,
                                kw.get("tile"), kw.get("values"))[0].summary()  # fmt: skip
            cost = decode_cost(batch=b, queries=1, heads=h, kv_heads=1, dim=c, rope=r, lengths=[s] * b,
                               parts=summary["parts"], chunk=summary["chunk"], row_tiles=summary["row_tiles"],
                               hardware=hw, table_width=s // PAGE if paged else 0)  # fmt: skip
            got |= {**summary, "predicted_ms": 1e3 * cost.seconds, "predicted_on": hw.name}
        entry["rows"].append(got)
    copy = next((r for r in entry["rows"] if r["impl"] == "copy" and "gbs" in r), None)
    for r in entry["rows"]:
        if copy is not None and "gbs" in r and r["impl"] != "copy":
            r["of_copy_bandwidth"] = r["gbs"] / copy["gbs"]
        if "ms" in r:
            print(f"  {r['impl']:15s} {r['ms']:8.3f} ms {r['gbs']:7.0f} GB/s{described(r)}", flush=True)
    return entry


def one_step(spec: str, quick: bool, seed: int) -> tuple:
    """The step ``spec`` names (``ROW[:IMPL]``, IMPL napkin by default): its row, implementation, jitted function,
    arguments and plan (napkin-cat implementations: :func:`plans`'s summary, with its predicted bytes read)."""
    name, _, impl = spec.partition(":")
    impl = impl or "napkin"
    row = next((r for r in rows(quick) if r["name"] == name and not r.get("mla")), None)
    if row is None:
        raise SystemExit(f"no decode row {name!r} (MLA rows aside); --list prints them")
    q, k, v = inputs(row, HEADS["quick" if quick else "full"], seed)
    fns, planned = implementations(q, k, v, [impl], jax.default_backend() == "gpu", seed)
    if impl not in fns:
        raise SystemExit(f"{impl!r} does not run here: napkin, paged, {', '.join(VARIANTS)}, cudnn (on a GPU), xla")
    return row, impl, *fns[impl], planned.get(impl, {})


#: what ``--counters`` asks ncu for, per launch of the step's kernels
COUNTERS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")
PLANNED = "decode-plan "  # the line ``--ncu`` prints its step's plan on, for ``--counters`` to read


def ncu_step(spec: str, quick: bool, seed: int, calls: int = 3) -> dict:
    """``calls`` steps of ``spec`` (the first compiles), for ncu to profile (``--counters`` reads the last); its
    plan, with the prediction and the device, printed on one line."""
    began = time.perf_counter()
    row, impl, fn, args, plan = one_step(spec, quick, seed)
    print(f"{spec}: inputs and plan ready ({time.perf_counter() - began:.1f} s)", flush=True)
    for i in range(calls):
        jax.block_until_ready(fn(*args))
        print(f"{spec}: step {i + 1} of {calls} done ({time.perf_counter() - began:.1f} s)", flush=True)
    out = {"row": row["name"], "impl": impl, "device": device_info()["kind"], **plan}
    print(PLANNED + json.dumps(out), flush=True)
    return out


def counters(specs: list[str], quick: bool, timeout: float) -> tuple[str, list[dict]]:
    """Each step of ``specs`` (``ROW[:IMPL]``) under ncu, in a process of its own (:func:`ncu_step`): the last
    step's kernels (those named ``napkin*``: the split kernel and the merge), their DRAM bytes read and time summed,
    against :func:`lowering.decode_cost`'s predicted bytes read and seconds (issue 32: bytes within 10%, time
    within 30%). ncu replays each launch with clocks not locked, so its times are a kernel's alone. This process
    never starts the GPU (one that did would hold most of its memory from the profiled one): the device's name
    comes from the profiled process."""
    from papers.flash_attention.timing import ncu_launches

    if shutil.which("ncu") is None:
        raise SystemExit("--counters: ncu (NVIDIA Nsight Compute) is not on the PATH; run it where the GPU has it")
    out, kind = [], "unknown"
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # the profiled process takes what it uses, no more
    for spec in specs:
        if out and "error" in out[-1]:
            out.append({"step": spec, "error": "skipped: ncu gave the step before no counters"})
            continue
        argv = [sys.executable, str(Path(__file__).resolve()), "--ncu", spec, *(["--smoke"] if quick else [])]
        rows, text = ncu_launches(argv, COUNTERS, "napkin", timeout)
        plan = next((json.loads(line[len(PLANNED) :]) for line in text.splitlines() if line.startswith(PLANNED)), {})
        kind = plan.get("device", kind)
        last = {r["kernel"]: r for r in rows}  # launch order: the last step's launch of each kernel
        rec = {"step": spec, "kernels": {k: {m: last[k].get(m) for m in COUNTERS} for k in sorted(last)}}
        if not rows:
            rec["error"] = text[-1500:]
            print(f"{spec}: ncu gave no counters\n{text[-1500:]}", flush=True)
            out.append(rec)
            continue
        read = sum(r.get("dram__bytes_read.sum", 0.0) for r in last.values())
        ns = sum(r.get("gpu__time_duration.sum", 0.0) for r in last.values())
        rec |= {"dram_read_bytes": read, "time_us": ns / 1e3}
        if "predicted_read_bytes" in plan:
            rec |= {"predicted_read_bytes": plan["predicted_read_bytes"], "predicted_us": 1e3 * plan["predicted_ms"],
                    "predicted_on": plan["predicted_on"], "plan": plan}  # fmt: skip
            rec["bytes_ratio"] = read / plan["predicted_read_bytes"]
            rec["time_ratio"] = rec["time_us"] / rec["predicted_us"]
        shown = ", ".join(f"{k} {v['gpu__time_duration.sum'] / 1e3:.1f} us" for k, v in rec["kernels"].items())
        said = f"{spec}: DRAM read {read / 1e6:.1f} MB, {rec['time_us']:.1f} us ({shown})"
        if "bytes_ratio" in rec:
            said += (f"; predicted {rec['predicted_read_bytes'] / 1e6:.1f} MB, {rec['predicted_us']:.1f} us on "
                     f"{rec['predicted_on']}: bytes {rec['bytes_ratio']:.3f}×, time {rec['time_ratio']:.2f}× the "
                     "prediction (targets: within 10% and 30%)")  # fmt: skip
        print(said, flush=True)
        out.append(rec)
    return kind, out


def launches(hlo: str) -> list[str]:
    """What a compiled program's entry computation runs: each instruction but parameters, constants, tuples and
    bitcasts (a fusion, a custom call, a copy; on a CPU the interpreted kernel's loop), as ``name = op``.

    >>> launches("HloModule m\\nENTRY %main {\\n  %p = f32[4] parameter(0)\\n  %f = f32[4] fusion(%p), kind=kLoop\\n}")
    ['%f = fusion']
    """
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    ops = re.findall(r"^\s*(?:ROOT )?(%\S+) = .*? ([a-z-]+)\(", entry, re.M)
    quiet = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
    return [f"{name} = {op}" for name, op in ops if op not in quiet]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--smoke", "--quick", dest="quick", action="store_true", help="tiny sizes, interpret mode")
    p.add_argument("--rows", default="*", help="comma-separated name patterns of the rows to run, e.g. 'nq1-*,mla-*'")
    p.add_argument("--list", action="store_true", help="print the rows (in the order they run) and exit")
    p.add_argument("--counters", metavar="ROW[:IMPL],...", help="ncu's DRAM bytes and time of each step, predicted")
    p.add_argument("--ncu", metavar="ROW[:IMPL]", help="run three steps of ROW: what --counters profiles")
    p.add_argument("--launches", metavar="ROW[:IMPL]", help="print the kernels one compiled step of ROW launches")
    o = p.parse_args(argv)
    if o.ncu:
        return ncu_step(o.ncu, o.quick, seed=0)
    if o.counters:
        kind, got = counters(o.counters.split(","), o.quick, timeout=max(60.0, o.budget_s))
        o.out.mkdir(parents=True, exist_ok=True)
        path = o.out / f"decode_counters_{device_stem(kind)}{'_quick' if o.quick else ''}.json"
        path.write_text(json.dumps({"device": kind, "steps": got}, indent=1))
        return {"steps": got}
    if o.launches:
        row, impl, fn, args, _ = one_step(o.launches, o.quick, seed=0)
        ran = launches(fn.lower(*args).compile().as_text())
        print(f"{row['name']}:{impl} on {jax.devices()[0].device_kind}: {len(ran)} launches", *ran, sep="\n  ")
        return {"row": row["name"], "impl": impl, "launches": ran}
    patterns = o.rows.split(",")
    chosen = [r for r in rows(o.quick) if any(fnmatch.fnmatch(r["name"], pat) for pat in patterns)]
    if o.list:
        print("\n".join(f"{r['name']}: Nq={r['Nq']} {', '.join(r['impls'])}" for r in chosen))
        return {"rows": chosen}
    start, seed = time.perf_counter(), int(time.time()) % 10_000
    dev, gpu, hw = device_info(), jax.default_backend() == "gpu", modelled()
    heads = HEADS["quick" if o.quick else "full"]
    print(f"{dev['kind']}: bf16, heads {heads[0]} over {heads[1]} KV heads, D={heads[2]}; seed {seed}", flush=True)
    res = {"device": dev, "heads": dict(zip(("H", "H_kv", "D"), heads, strict=True)), "seed": seed, "entries": []}
    stem = f"decode_{device_stem(dev['kind'])}{'_quick' if o.quick else ''}"
    o.out.mkdir(parents=True, exist_ok=True)
    for row in chosen:
        began = time.perf_counter()
        if began - start > o.budget_s:
            entry = {"name": row["name"], "B": row["B"], "S": row["S"], "Nq": row["Nq"]}
            entry["skipped"] = f"budget of {o.budget_s:.0f} s spent"
        elif row.get("mla"):
            entry = mla_configuration(row, MLA["quick" if o.quick else "full"], seed)
        else:
            entry = configuration(row, heads, gpu, seed)
        entry["seconds"] = round(time.perf_counter() - began, 1)
        print(f"  ({row['name']}: {entry['seconds']} s, {time.perf_counter() - start:.0f} s in all)", flush=True)
        res["entries"].append(entry)
        floors = lambda r: {"nq64_floor": nq64_floor(r["B"], r["S"], hw, heads)} if "nq64_over_nq1" in r else {}  # noqa: E731
        res["ratios"] = [r | floors(r) for r in ratios(res["entries"])]
        (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
        plot(res, o.out / f"{stem}.png")
    for r in res.get("ratios", []):
        print(f"B={r['B']} S={r['S']}: paged / contiguous {r.get('paged_over_contiguous', '–')} (Nq = 1), "
              f"Nq = 64 / Nq = 1 {r.get('nq64_over_nq1', '–')}"
              + (f" (the model's floor on {hw.name}: {r['nq64_floor']['in_turn']}× for a kernel running the softmax "
                 f"and the products in turn, {r['nq64_floor']['overlapped']}× overlapping them)"
                 if "nq64_floor" in r else ""), flush=True)  # fmt: skip
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
    ticks = [e.get("name", f"B={e['B']} S={e['S']} Nq={e['Nq']}").replace("-", "\n") for e in done]
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
