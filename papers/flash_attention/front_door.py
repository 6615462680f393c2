"""The front door as users write it: a sliding window given as a FlexAttention ``mask_mod`` lambda, timed against
cuDNN's ``local_window_size`` in one process (issue 29's first target); then masks the symbolic path cannot read.

``nc.attention(q, k, v, is_causal=True, mask_mod=lambda b, h, q_idx, kv_idx: q_idx - kv_idx < W)``: four positional
parameters, FlexAttention's convention. The entry reads the lambda on linear expressions
(:func:`napkin_cat.affine_masks.as_affine`), finds the window's two inequalities and lowers it as an
:class:`~napkin_cat.library.Affine` mask, so the kernel skips the blocks the window hides; the script checks that it
did (``affine``) before timing. cuDNN gets the same window as ``jax.nn.dot_product_attention(..., is_causal=True,
local_window_size=(W - 1, 0), implementation="cudnn")``. Every output and gradient is checked against an f32
reference on one batch element first. TFLOP/s count the visible (query, key) pairs: ``Σ_i min(i + 1, W)`` per head,
4·D FLOPs each forward, 3.5× that forward + backward. Inputs are laid out [B, N, H, D] for both.

Any mask is sparse: a dilated causal window (every other key of the last 2W) and a 2-D neighbourhood over an image
of 128-token rows (|Δrow| ≤ 8, |Δcol| ≤ 8) are no Boolean combination of linear inequalities, so the kernels find
their blocks from a block map evaluated at call time (:meth:`napkin_cat.generators.Mask.block_map`). Each is timed
beside the causal kernel, TFLOP/s counted on the blocks each kernel visits (``kernel.sparsity``: 4·D FLOPs per
(query, key) pair of a visited block), with the block maps' build time (every kernel's, forward and backward) as a
fraction of one forward + backward. A mask of the indices alone has its maps and chunk lists built once, when the
call is traced (constants of the compiled program, as FlexAttention's ``create_block_mask`` ahead of its calls):
nothing per call. Documents (8, ragged, one ``document_id`` array) run twice: as ``segment_ids`` and as a
``mask_mod`` over the captured array, whose block map is evaluated at each call, inside the timed call.

Masks with holes: a strided window (causal, runs of W keys every 4W) and interleaved documents (4 documents in runs
of N/128 tokens, two per tile of 128 queries, a captured ``document_id``) leave empty blocks between kept ones; the
kernels visit only the chunks their block map lists (``lowering._blocks.chunk_lists``), on Triton and on Mosaic GPU
alike (``backend="auto"`` takes Mosaic on sm_90 where it lowers; each row records its kernels' ``backends``). Each
row states the share of blocks visited, ``visited``, beside the share FlexAttention's block mask would visit at the
same blocks (``flex_visited``, counted here from the dense mask with jnp), which must agree; cuDNN's dense and
causal kernels are timed beside (GPU only), TFLOP/s on all and on the causal pairs.

Dropout inside the kernel: causal attention with ``dropout_rate=0.1`` timed beside the same kernel without
dropout, on Mosaic GPU and on Triton (issue 29's target: forward + backward ≥ 0.85× without), checked first
against a reference that uses the kernel's hash (:func:`napkin_cat.generators.keep_bits`, the only napkin-cat code
it calls) and jnp for the rest; on a GPU, cuDNN's causal kernel with and without its own dropout beside (what
dropout costs a hand-written kernel).

    python papers/flash_attention/front_door.py [--out DIR] [--window 1024] [--seq 8192] [--quick | --smoke]
        [--only window|sparse|partial|dropout|relbias]

``--quick`` (or ``--smoke``) runs tiny sizes in interpret mode on a CPU (a smoke test; cuDNN is skipped there).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from napkin_cat.library import Affine  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import time_calls  # noqa: E402

HERE = Path(__file__).resolve().parent
FWD_BWD_FACTOR = 3.5  # the backward does 2.5× the forward's matrix products (FlashAttention-2, Dao 2023, §4)
TOLERANCE = 2e-2  # bf16 relative error against the f32 reference (outputs and gradients), as mosaic_bench.py


def visible_pairs(n: int, w: int) -> int:
    """(query, key) pairs a causal window of ``w`` keys keeps over ``n`` tokens.

    >>> visible_pairs(4, 2)  # rows see 1, 2, 2, 2 keys
    7
    """
    return sum(min(i + 1, w) for i in range(n))


def reference(q, k, v, w: int):
    """f32 attention over the window, written here with jnp (no napkin-cat code)."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
    i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
    s = jnp.where((j <= i) & (i - j < w), s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def window_mask(w: int):
    """The window as a FlexAttention user writes it: four positional parameters.

    >>> window_mask(4)(0, 0, 9, 6), window_mask(4)(0, 0, 9, 5)
    (True, False)
    """
    return lambda b, h, q_idx, kv_idx: q_idx - kv_idx < w


def non_affine(n: int, w: int, width: int, r: int) -> dict:
    """Masks no linear inequalities describe: a dilated causal window (every other key of the last ``2w``), a 2-D
    neighbourhood over an image of ``width``-token rows (``|Δrow| ≤ r`` and ``|Δcol| ≤ r``), and a strided window
    (causal, runs of ``w`` keys every ``4w``), whose blocks have holes.

    >>> dilated, image, strided = non_affine(64, 4, 8, 1).values()
    >>> [bool(dilated(0, 0, 9, j)) for j in (3, 4)], [bool(image(0, 0, 9, j)) for j in (18, 26)]
    ([True, False], [True, False])
    >>> [bool(strided(0, 0, 20, j)) for j in (3, 4, 5)]
    [True, True, False]
    """
    return {
        "dilated window": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 2 * w)
        & ((q_idx - kv_idx) % 2 == 0),
        "2-D neighbourhood": lambda b, h, q_idx, kv_idx: (abs(q_idx // width - kv_idx // width) <= r)
        & (abs(q_idx % width - kv_idx % width) <= r),
        "strided window": lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & ((q_idx - kv_idx) % (4 * w) < w),
    }


def flex_visited(keep, n: int, g: int, s: int) -> float:
    """The share of (query tile of ``g``, key chunk of ``s``) blocks the mask ``keep`` keeps something of over ``n``
    tokens: those FlexAttention's block mask visits (its ``kv_num_blocks`` plus ``full_kv_num_blocks``), counted with
    jnp on the dense mask.

    >>> flex_visited(lambda b, h, i, j: i == j, 64, 16, 16)
    0.25
    """
    i = jnp.arange(n)
    tiles, chunks = -(-n // g), -(-n // s)
    dense = jnp.zeros((tiles * g, chunks * s), bool).at[:n, :n].set(keep(0, 0, i[:, None], i[None, :]))
    return float(dense.reshape(tiles, g, chunks, s).any((1, 3)).mean())


def dense_reference(keep):
    """f32 attention under the mask ``keep`` materialised with jnp (no napkin-cat code); a row with no key gives 0."""

    def ref(q, k, v):
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        s = jnp.where(keep(0, 0, i, j), s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.nan_to_num(jax.nn.softmax(s, axis=-1)), v)

    return ref


def build_ms(made, sizes: dict) -> float:
    """Milliseconds to build every block map the kernels read (forward, then the backward's), compiled once, as a
    trace of the caller's ``jit`` builds them: the mask evaluated once (the kept map forgotten before each build),
    then each kernel's bounds from it (the kept bounds forgotten too)."""
    from lowering._blocks import _MAPS, call_blocks, segments
    from napkin_cat.generators._index import _FINE_MAPS

    plans = [k.plan for k in (made.kernel.forward, *made.kernel.kernels)]
    plans = [(p, segments(p.diagram, p)) for p in plans if p.stream is not None]

    def build():
        _FINE_MAPS.clear()
        _MAPS.clear()
        return [call_blocks(p, masks, [], sizes) for p, masks in plans if masks]

    return time_calls(build, reps=5, batches=5, warmup=1).ms


def document_ids(n: int, docs: int):
    """Sorted ids of ``docs`` documents of ragged lengths over ``n`` tokens (fixed seed), int32.

    >>> ids = document_ids(10, 3).tolist()  # (jax.random.choice's draw differs across jax versions)
    >>> ids == sorted(ids), sorted(set(ids)), len(ids)
    (True, [0, 1, 2], 10)
    """
    cuts = jnp.sort(jax.random.choice(jax.random.key(1), jnp.arange(1, n), (docs - 1,), replace=False))
    return jnp.searchsorted(cuts, jnp.arange(n), side="right").astype(jnp.int32)


def sparse_rows(q, k, v, ct, w: int, width: int, r: int) -> list:
    """The causal kernel and the non-affine masks, TFLOP/s counted on the blocks each visits, with their sparsity
    and block-map build time (÷ one forward + backward); then documents given as segment ids and as a
    ``mask_mod`` over a captured ``document_id`` array (its block map evaluated at each call, inside the timed
    call)."""
    b, n, h, d = q.shape
    sizes = {"b": b, "h": h, "q_idx": n, "kv_idx": n, "d": d, "dv": d}
    causal = lambda b, h, q_idx, kv_idx: kv_idx <= q_idx  # noqa: E731
    doc = document_ids(n, 8)
    same = lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]  # noqa: E731
    runs = (jnp.arange(n) // max(n // 128, 1)) % 4  # 4 documents interleaved in runs of N/128: several per tile
    interleaved = lambda b, h, q_idx, kv_idx: runs[q_idx] == runs[kv_idx]  # noqa: E731
    cases = {
        "causal": ({"is_causal": True}, causal),
        **{m: ({"mask_mod": f}, f) for m, f in non_affine(n, w, width, r).items()},
        "documents (segment ids)": ({"segment_ids": jnp.broadcast_to(doc, (b, n))}, same),
        "documents (captured ids)": ({"mask_mod": same}, same),
        "interleaved documents (captured ids)": ({"mask_mod": interleaved}, interleaved),
    }
    rows = cudnn_rows(q, k, v, ct, causal) if jax.default_backend() == "gpu" else []
    for name, (kw, keep) in cases.items():
        row, made, sp = visited_row(name, kw, keep, q, k, v, ct)
        row["visited"] = 1 - sp.skipped
        row["flex_visited"] = flex_visited(keep, n, made.signature.tile, made.signature.stream)
        if sp.found == ("call time",):
            row["block_map_ms"] = build_ms(made, sizes)
            row["block_map_share"] = row["block_map_ms"] / row["fwdbwd"]["ms"]
        line = f"   {sp}; visited {100 * row['visited']:.1f}% (FlexAttention's: {100 * row['flex_visited']:.1f}%)"
        line += f"; on {'/'.join(sorted(set(row['backends'].values())))}"
        if "block_map_ms" in row and "captured" in name:  # read at each call: inside the timed call
            line += f"; block maps (per call, in the time above) {row['block_map_ms']:.3f} ms alone"
        elif "block_map_ms" in row:  # constants of the compiled program: built when traced, as create_block_mask
            line += f"; block maps built once when traced {row['block_map_ms']:.3f} ms"
            line += f" = {100 * row['block_map_share']:.2f}% of one fwd+bwd, none per call"
        print(line, flush=True)
        rows.append(row)
    seg, cap = (next(row for row in rows if row["impl"] == f"documents ({m} ids)") for m in ("segment", "captured"))
    ratio = {s: seg[s]["ms"] / cap[s]["ms"] for s in ("fwd", "fwdbwd")}
    print("documents, captured ids ÷ segment ids (speed): " + ", ".join(f"{s} {x:.2f}×" for s, x in ratio.items()))
    return rows


def visited_row(name: str, kw: dict, keep, q, k, v, ct) -> tuple:
    """``nc.attention(q, k, v, **kw)`` checked against the dense reference of the mask ``keep`` and timed, TFLOP/s
    counted on the blocks its forward kernel visits (4·D FLOPs per pair of a visited block), with its sparsity and
    backends; with the kernel it made and its sparsity."""
    d = q.shape[-1]
    made = nc.attention.kernel_for(q, k, v, **kw)
    sp = made.sparsity(q, k, v, **{a: f for a, f in kw.items() if a not in ("is_causal", "block_mask")})
    g, s = made.signature.tile, made.signature.stream
    f = lambda q, k, v: nc.attention(q, k, v, **kw)  # noqa: E731
    row = measure(name, f, q, k, v, ct, dense_reference(keep), 4 * d * (1 - sp.skipped) * sp.blocks * g * s)
    row["sparsity"] = {"skipped": sp.skipped, "full": sp.full, "partial": sp.partial, "found": sp.found}
    row["backends"] = made.kernel.backends  # per kernel: "auto" takes Mosaic on sm_90 where it lowers
    return row, made, sp


def partial_masks(n: int, w: int, width: int, r: int) -> dict:
    """Masks that cut every block they visit, each written two or three ways that keep the same pairs: the same
    blocks visited, a different count of operations per score on the masked blocks. ``causal, every block masked``
    is causal (``min(q_idx, n - 1) ≥ kv_idx``, which no linear reading takes) with its whole blocks demoted to cut
    ones in its :class:`~napkin_cat.block_masks.BlockMask`: the cost of one comparison and select on every visited
    block. ``parity on vectors`` says ``(q − kv) mod 2 = 0`` as ``q mod 2 = kv mod 2``, whose two sides the kernel
    computes once per row and once per column.

    >>> m = partial_masks(64, 4, 8, 1)
    >>> [bool(m["dilated, parity on vectors"](0, 0, 9, j)) == bool(m["dilated window"](0, 0, 9, j)) for j in range(12)]
    [True, True, True, True, True, True, True, True, True, True, True, True]
    >>> image, bounds = m["2-D neighbourhood"], m["2-D, bounds on vectors"]
    >>> all(bool(image(0, 0, i, j)) == bool(bounds(0, 0, i, j)) for i in range(64) for j in range(64))
    True
    """
    base = non_affine(n, w, width, r)
    band = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (q_idx - kv_idx < 2 * w)  # noqa: E731
    return {
        "causal band 2w (affine)": band,
        "causal, min form": lambda b, h, q_idx, kv_idx: jnp.minimum(q_idx, n - 1) >= kv_idx,
        "dilated window": base["dilated window"],
        "dilated, & 1": lambda b, h, q_idx, kv_idx: band(b, h, q_idx, kv_idx) & (((q_idx - kv_idx) & 1) == 0),
        "dilated, parity on vectors": lambda b, h, q_idx, kv_idx: band(b, h, q_idx, kv_idx)
        & ((q_idx & 1) == (kv_idx & 1)),
        "2-D neighbourhood": base["2-D neighbourhood"],
        "2-D, bounds on vectors": lambda b, h, q_idx, kv_idx: (kv_idx // width >= q_idx // width - r)
        & (kv_idx // width <= q_idx // width + r) & (kv_idx % width >= q_idx % width - r)
        & (kv_idx % width <= q_idx % width + r),
    }


def partial_rows(q, k, v, ct, w: int, width: int, r: int) -> list:
    """What a masked block costs: the causal kernel (its whole blocks unmasked); the causal band of the dilated
    window's extent, ``2w`` keys, read symbolically (its inner blocks whole: what rows of that length cost); then
    :func:`partial_masks`. TFLOP/s on the blocks each visits and its ratio to the causal kernel's."""
    import dataclasses

    import numpy as np

    n = q.shape[1]
    masks = partial_masks(n, w, width, r)
    demoted = nc.block_mask(masks["causal, min form"], None, None, n, n)
    demoted = dataclasses.replace(demoted, whole=np.zeros_like(demoted.whole))
    cases = {"causal": ({"is_causal": True}, lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)}
    cases["causal, every block masked"] = ({"block_mask": demoted}, masks["causal, min form"])
    cases |= {name: ({"mask_mod": f}, f) for name, f in masks.items()}
    rows = []
    for name, (kw, keep) in cases.items():
        row, _, sp = visited_row(name, kw, keep, q, k, v, ct)
        row["of_causal"] = {t: row[t]["tflops"] / rows[0][t]["tflops"] for t in ("fwd", "fwdbwd")} if rows else None
        print(f"   {sp}; on {'/'.join(sorted(set(row['backends'].values())))}"
              + (f"; ÷ causal fwd {row['of_causal']['fwd']:.2f}× fwd+bwd {row['of_causal']['fwdbwd']:.2f}×"
                 if rows else ""), flush=True)
        rows.append(row)
    return rows


def with_table(q, k, v, rel_bias):
    """Causal ``nc.attention`` with a learnable relative-position table read as FlexAttention users write it,
    ``s + rel_bias[q_idx − kv_idx + N − 1]`` (one entry per offset, ``2N − 1``)."""
    n = q.shape[1]
    return nc.attention(q, k, v, is_causal=True,
                        score_mod=lambda s, b, h, q_idx, kv_idx: s + rel_bias[q_idx - kv_idx + n - 1])


def relative_bias_rows(q, k, v, ct, timing=(10, 7, 2)) -> dict:
    """A learnable relative-position table, ``s + rel_bias[q_idx − kv_idx + N − 1]`` (one table of ``2N − 1``,
    causal), forward + backward with the table's gradient against the same kernel with the table held constant
    (issue 29's target: ≥ 0.7×), each checked first against jnp on one batch element (the table's gradient too),
    and the temporaries XLA's memory analysis gives each compiled step beside one ``N × N`` f32 buffer (the
    target: none so large)."""
    b, n, h, d = q.shape
    table = 0.1 * jax.random.normal(jax.random.key(11), (2 * n - 1,), jnp.float32)
    i = jnp.arange(n)

    def ref(q, k, v, rel_bias):  # jnp only: the bias materialised, causal, f32
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(d) + rel_bias[i[:, None] - i[None, :] + n - 1]
        s = jnp.where(i[:, None] >= i[None, :], s, -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)

    loss = lambda f: lambda q, k, v, t, ct: jnp.sum(f(q, k, v, t).astype(jnp.float32) * ct)  # noqa: E731
    steps = {
        "table held constant": jax.jit(jax.grad(loss(with_table), (0, 1, 2))),
        "learnable table": jax.jit(jax.grad(loss(with_table), (0, 1, 2, 3))),
    }
    one = (q[:1], k[:1], v[:1], table, ct[:1].astype(jnp.float32))
    want = jax.jit(jax.grad(loss(ref), (0, 1, 2, 3)))(*one)
    got = steps["learnable table"](*one)
    errors = {name: rel(g, w) for name, g, w in zip(("dq", "dk", "dv", "dtable"), got, want, strict=True)}
    flops = FWD_BWD_FACTOR * 4 * b * h * d * n * (n + 1) // 2
    square = 4 * n * n  # the bytes of one N × N f32 buffer
    res = {"errors": errors, "ok": max(errors.values()) <= TOLERANCE, "rows": [], "n_by_n_bytes": square}
    print("learnable table, max relative error: " + ", ".join(f"{a} {e:.1e}" for a, e in errors.items()), flush=True)
    for name, step in steps.items():
        t = time_calls(step, q, k, v, table, ct, reps=timing[0], batches=timing[1], warmup=timing[2])
        mem = step.lower(q, k, v, table, ct).compile().memory_analysis()
        temp = getattr(mem, "temp_size_in_bytes", None)
        row = {"impl": name, "ms": t.ms, "tflops": flops / t.seconds / 1e12, "temp_bytes": temp}
        res["rows"].append(row)
        mib = temp / 2**20 if temp is not None else float("nan")
        print(f"{name:20s} fwd+bwd {row['ms']:.3f} ms {row['tflops']:6.1f} TFLOP/s  temporaries {mib:.1f} MiB "
              f"(one N×N f32: {square / 2**20:.0f} MiB)", flush=True)
    res["ratio"] = res["rows"][0]["ms"] / res["rows"][1]["ms"]
    res["o_of_n"] = all(r["temp_bytes"] is not None and r["temp_bytes"] < square for r in res["rows"])
    print(f"learnable ÷ constant (speed): {res['ratio']:.2f}× (target 0.7×); no N×N temporary: {res['o_of_n']}")
    return res


def cudnn_rows(q, k, v, ct, causal) -> list:
    """cuDNN's dense and causal kernels (``jax.nn.dot_product_attention``), TFLOP/s on all pairs and on the causal
    pairs: the rates the sparse kernels' visited blocks compare with (GPU only)."""
    b, n, h, d = q.shape
    rows = []
    for name, is_causal, pairs in (("cudnn dense", False, n * n), ("cudnn causal", True, n * (n + 1) // 2)):
        f = lambda q, k, v, c=is_causal: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation="cudnn")  # noqa: E731
        keep = causal if is_causal else (lambda b, h, q_idx, kv_idx: q_idx >= 0 * kv_idx)
        rows.append(measure(name, f, q, k, v, ct, dense_reference(keep), 4 * b * h * d * pairs))
    return rows


#: the dropout rate the benchmark times, and the key its mask is hashed from
DROPOUT, DROPOUT_KEY = 0.1, 7


def dropout_reference(rate: float, seed: int):
    """f32 causal attention with the kernel's dropout mask (its hash imported, the rest jnp); batch row 0."""
    from napkin_cat.generators import keep_bits

    def ref(q, k, v):
        q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1])
        i, j = jnp.arange(q.shape[1])[:, None], jnp.arange(k.shape[1])[None, :]
        p = jax.nn.softmax(jnp.where(j <= i, s, -jnp.inf), axis=-1)
        h = jnp.arange(q.shape[2])[:, None, None]
        kept = keep_bits(seed, 0, h, i, j) >= jnp.uint32(round(rate * 2**32))
        return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(kept, p / (1 - rate), 0.0), v)

    return ref


#: the backends the dropout section times, each against itself without dropout
DROPOUT_BACKENDS = ("triton", "mosaic")


def dropout_rows(q, k, v, ct, quick: bool = False) -> dict:
    """Causal attention with and without dropout 0.1 on each backend (forward and backward kernels of that
    backend), TFLOP/s on the visible pairs, and the ratios with dropout ÷ without."""
    b, n, h, d = q.shape
    key = jax.random.key(DROPOUT_KEY)
    seed = int(jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32))
    flops = 4 * b * h * d * n * (n + 1) // 2
    timing = (1, 1, 0) if quick else (10, 7, 2)  # interpreted on a CPU, one call shows the path runs
    res = {"rows": [], "ratios": {}, "target_fwdbwd": 0.85}
    for backend in DROPOUT_BACKENDS:
        def f(q, k, v, rate=0.0, backend=backend):
            return nc.attention(q, k, v, is_causal=True, dropout_rate=rate, dropout_key=key, backend=backend)

        plain = measure(f"{backend} causal", f, q, k, v, ct, dropout_reference(0.0, seed), flops, timing)
        dropped = measure(f"{backend} dropout {DROPOUT:g}", lambda q, k, v, f=f: f(q, k, v, DROPOUT), q, k, v, ct,
                          dropout_reference(DROPOUT, seed), flops, timing)
        ratios = {s: dropped[s]["tflops"] / plain[s]["tflops"] for s in ("fwd", "fwdbwd")}
        print(f"{backend}: dropout {DROPOUT:g} ÷ without: " + ", ".join(f"{s} {r:.2f}×" for s, r in ratios.items()),
              flush=True)
        res["rows"] += [plain, dropped]
        res["ratios"][backend] = ratios
    if jax.default_backend() == "gpu":
        res["rows"] += cudnn_dropout_rows(q, k, v, ct, flops, timing)
        res["ratios"]["cudnn"] = {s: res["rows"][-1][s]["tflops"] / res["rows"][-2][s]["tflops"] for s in ("fwd",
                                                                                                       "fwdbwd")}
        print("cudnn: dropout ÷ without: " + ", ".join(f"{s} {r:.2f}×" for s, r in res["ratios"]["cudnn"].items()),
              flush=True)
    return res


def cudnn_dropout_rows(q, k, v, ct, flops: int, timing) -> list:
    """cuDNN's causal kernel without and with its own dropout (JAX's cuDNN fused attention, ``dropout_rate``): what
    dropout costs the hand-written kernel, beside what it costs napkin-cat's. Its mask is cuDNN's own Philox stream,
    so each row records only how far its output moves from the dense one: by bf16 rounding without dropout, by far
    more with it (a mask was applied)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attention

    scale = 1 / q.shape[-1] ** 0.5
    rows = []
    for rate in (0.0, DROPOUT):
        def f(q, k, v, rate=rate):
            return cudnn_attention(q, k, v, scale=scale, mask_type=MaskType.CAUSAL, dropout_rate=rate,
                                   seed=DROPOUT_KEY)

        fwd, grad = jitted(f)
        moved = rel(fwd(q, k, v)[:1], dropout_reference(0.0, 0)(q[:1], k[:1], v[:1]))
        row = {"impl": f"cudnn {'dropout ' + format(rate, 'g') if rate else 'causal'}", "moved_from_dense": moved}
        row |= timed(fwd, grad, q, k, v, ct, flops, timing)
        print(f"{row['impl']:14s} fwd {row['fwd']['tflops']:6.1f}  fwd+bwd {row['fwdbwd']['tflops']:6.1f} TFLOP/s  "
              f"moved from dense {moved:.1e}", flush=True)
        rows.append(row)
    return rows


def implementations(window, w: int, gpu: bool) -> dict:
    impls = {"napkin lambda": lambda q, k, v: nc.attention(q, k, v, is_causal=True, mask_mod=window)}
    if gpu:
        impls["cudnn window"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=(w - 1, 0), implementation="cudnn"
        )
    return impls


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def jitted(f) -> tuple:
    """``f(q, k, v)`` and its forward + backward ``(q, k, v, ct) → (dq, dk, dv)``, each compiled."""
    return jax.jit(f), jax.jit(lambda q, k, v, ct: jax.vjp(f, q, k, v)[1](ct))


def timed(fwd, grad, q, k, v, ct, flops, timing) -> dict:
    """Forward and forward + backward timed (``timing``: calls per batch, batches, warm-up calls): ms and TFLOP/s
    of ``flops`` (the forward's; the backward's counted as ``FWD_BWD_FACTOR`` times it)."""
    out = {}
    for section, fn, args, factor in (("fwd", fwd, (q, k, v), 1), ("fwdbwd", grad, (q, k, v, ct), FWD_BWD_FACTOR)):
        t = time_calls(fn, *args, reps=timing[0], batches=timing[1], warmup=timing[2])
        out[section] = {"ms": t.ms, "tflops": factor * flops / t.seconds / 1e12, "clock": t.method}
    return out


def measure(name, f, q, k, v, ct, ref, flops, timing=(10, 7, 2)) -> dict:
    """Check ``f`` and its gradients against ``ref`` (f32, on one batch element), then time forward and forward +
    backward (``timing``: calls per batch, batches, warm-up calls), TFLOP/s of ``flops`` (the forward's)."""
    fwd, grad = jitted(f)
    want, pull = jax.vjp(ref, *(a[:1] for a in (q, k, v)))
    errors = [rel(fwd(q, k, v)[:1], want)]
    errors += [rel(g[:1], r) for g, r in zip(grad(q, k, v, ct), pull(ct[:1].astype(jnp.float32)), strict=True)]
    row = {"impl": name, "max_rel_error": max(errors), "ok": max(errors) <= TOLERANCE}
    row |= timed(fwd, grad, q, k, v, ct, flops, timing)
    print(f"{name:14s} fwd {row['fwd']['tflops']:6.1f}  fwd+bwd {row['fwdbwd']['tflops']:6.1f} TFLOP/s  "
          f"err {row['max_rel_error']:.1e} ({row['fwd']['clock']})", flush=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--quick", "--smoke", action="store_true")
    p.add_argument("--only", choices=("window", "sparse", "partial", "dropout", "relbias"),
                   help="run one section (default: all)")
    o = p.parse_args(argv)
    b, h, n, d, w = (1, 2, 256, 64, 64) if o.quick else (2, 16, o.seq, 128, o.window)
    width, r = (16, 2) if o.quick else (128, 8)
    dev, gpu = device_info(), jax.default_backend() == "gpu"
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, ct = (jax.random.normal(kk, (b, n, h, d), jnp.bfloat16) for kk in keys)
    flops = 4 * b * h * d * visible_pairs(n, w)
    print(f"{dev['kind']}: B={b} H={h} N={n} D={d} W={w} bf16")
    res = {"device": dev, "sizes": dict(B=b, H=h, N=n, D=d, W=w), "rows": []}
    if o.only in (None, "window"):
        res |= window_rows(q, k, v, ct, w, gpu, flops)
    if o.only in (None, "sparse"):
        print("any mask is sparse: TFLOP/s on the blocks each kernel visits", flush=True)
        res["sparse"] = sparse_rows(q, k, v, ct, w, width, r)
    if o.only in (None, "partial"):
        print("what a masked block costs: TFLOP/s on the blocks each kernel visits", flush=True)
        res["partial"] = partial_rows(q, k, v, ct, w, width, r)
    if o.only in (None, "relbias"):
        print("a learnable relative-position table: its gradient's cost and memory", flush=True)
        res["relbias"] = relative_bias_rows(q, k, v, ct, (1, 1, 0) if o.quick else (10, 7, 2))
    if o.only in (None, "dropout"):
        print("dropout inside the kernel: causal, with and without", flush=True)
        res["dropout"] = dropout_rows(q, k, v, ct, o.quick)
    stem = f"front_door_{device_stem(dev['kind'])}{'_quick' if o.quick else ''}{'_' + o.only if o.only else ''}"
    o.out.mkdir(parents=True, exist_ok=True)
    (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    if res["rows"]:
        plot(res, o.out / f"{stem}.png")
    if res.get("partial"):
        plot_partial(res, o.out / f"{stem}_partial.png" if o.only != "partial" else o.out / f"{stem}.png")
    return res


def window_rows(q, k, v, ct, w: int, gpu: bool, flops: int) -> dict:
    """The lambda sliding window against cuDNN's ``local_window_size`` (cuDNN on a GPU only), and how it lowered."""
    window = window_mask(w)
    made = nc.attention.kernel_for(q, k, v, is_causal=True, mask_mod=window)
    masks = [type(box.params["mask"]).__name__ for box in made.derivation.diagram.boxes if "mask" in box.params]
    affine = any(m == Affine.__name__ for m in masks)
    print(f"the lambda lowered as {masks} (affine: {affine})", flush=True)
    res = {"affine": affine, "masks": masks, "rows": []}
    for name, f in implementations(window, w, gpu).items():
        res["rows"].append(measure(name, f, q, k, v, ct, lambda *a: reference(*a, w), flops))
    rows = {r["impl"]: r for r in res["rows"]}
    if "cudnn window" in rows:
        res["ratios"] = {
            s: rows["napkin lambda"][s]["tflops"] / rows["cudnn window"][s]["tflops"] for s in ("fwd", "fwdbwd")
        }
        print("napkin lambda ÷ cuDNN window: " + ", ".join(f"{s} {r:.2f}×" for s, r in res["ratios"].items()))
    return res


def pair_bars(rows: list, value, title: str, ylabel: str, path: Path, target: float | None = None) -> None:
    """Bars: ``value(row, section)`` forward and forward + backward per row (``impl`` under each pair), a dashed
    line at ``target`` where given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(rows)), 3.8))
    for i, s in enumerate(("fwd", "fwdbwd")):
        label = {"fwd": "forward", "fwdbwd": "forward + backward"}[s]
        ax.bar([x + 0.4 * i for x in range(len(rows))], [value(r, s) for r in rows], 0.4, label=label)
    if target is not None:
        ax.axhline(target, color="k", lw=0.8, ls="--", label=f"target {target:g}×")
    ax.set_xticks([x + 0.2 for x in range(len(rows))], [r["impl"] for r in rows], rotation=25, ha="right", fontsize=7)
    ax.set_title(title, fontsize=9)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(res: dict, path: Path) -> None:
    """Forward and forward + backward TFLOP/s (visible pairs) per implementation, with the GPU's name."""
    z = res["sizes"]
    title = f"{res['device']['kind']}: causal window W={z['W']}, N={z['N']}, D={z['D']}"
    pair_bars(res["rows"], lambda r, s: r[s]["tflops"], title, "TFLOP/s (visible pairs)", path)


def plot_partial(res: dict, path: Path) -> None:
    """Each mask's TFLOP/s on the blocks it visits over the causal kernel's, forward and forward + backward, with
    the target (0.9×) drawn, and the GPU's name."""
    z = res["sizes"]
    title = f"{res['device']['kind']}: TFLOP/s on visited blocks ÷ causal's, N={z['N']}, D={z['D']}"
    rows = [r for r in res["partial"] if r.get("of_causal")]
    pair_bars(rows, lambda r, s: r["of_causal"][s], title, "÷ the causal kernel", path, target=0.9)


if __name__ == "__main__":
    main()
