"""Document masking on a GPU, one run: the blocks the segment ids hide are skipped, and that is measured.

``nc.attention(q, k, v, segment_ids=ids)`` with 8 documents packed into each sequence (N = 8192, D = 128,
bf16, 16 heads, B·N = 16k tokens), forward and forward + backward, next to full causal attention on the same
shapes, and next to the same documents given as a boolean ``mask`` array (which the kernel reads but cannot
skip by: it visits every block). Cases:

* ``causal``: ``is_causal=True``, the comparison point;
* ``documents 8``: 8 documents of N/8, non-causal;
* ``documents 8 + causal``: both masks (the kernel skips by both);
* ``8 sequences + causal``: the documents of ``documents 8 + causal`` unpacked, as a batch 8× larger with
  ``is_causal=True`` and no ids: the same work without reading ids, the bound packing is measured against;
* ``documents 8 ragged``: 8 documents of random lengths (boundaries off the blocks);
* ``documents 8 as a mask array``: the same mask as ``documents 8``, no skipping (the cost without it);
* ``documents 8 (mosaic)`` and ``documents 8 + causal (mosaic)``: those cases with ``backend="mosaic"`` (they
  measured Mosaic against Triton before ``"auto"`` took Mosaic for segment ids; GPU only);
* ``cudnn causal`` and ``cudnn 8 sequences + causal``: cuDNN (``jax.nn.dot_product_attention``) on the
  ``causal`` and ``8 sequences + causal`` shapes, in the same run: how much of the drop in TFLOP/s from
  N = 8192 to sequences of N/8 a hand-written kernel shows too (GPU only; ``--quick`` leaves them out).

Times are the median over batches of back-to-back calls (``papers.flash_attention.timing.time_calls``). TFLOP/s are
given two ways: ``tflops_kept`` counts the work on the entries the mask keeps (4·B·H·D·Σᵢ kept(i), × 3.5
for forward + backward, as ``benchmark.py`` counts causal at half), the figure to compare across masks;
``tflops_dense`` counts 4·B·H·N²·D whatever the mask. Before timing, each case is checked at N = 1024 (B = 1,
H = 2) against an f32 ``jax.numpy`` reference on the same device: output and Q, K, V gradients.

On CPU, ``--quick`` runs tiny sizes in interpret mode (a smoke test, no timings worth reading):

    python -m papers.flash_attention.document_skipping --out $OUT/document_skipping.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import napkin_cat as nc
from papers.flash_attention.timing import time_calls

# backward ≈ 2.5× the forward's matmul work (FlashAttention-2, Dao 2023, §4), as benchmark.py counts
FWD_BWD_FACTOR = 3.5


def documents(n: int, count: int, ragged: bool, seed: int = 0) -> np.ndarray:
    """Sorted ids of ``count`` documents over ``n`` positions: equal lengths, or random cuts."""
    if not ragged:
        return np.arange(n) * count // n
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, n), count - 1, replace=False))
    return np.searchsorted(cuts, np.arange(n), side="right")


def kept(ids: np.ndarray, causal: bool) -> np.ndarray:
    """The number of (query, key) pairs each batch's mask keeps."""
    out = []
    for row in ids:
        _, lengths = np.unique(row, return_counts=True)
        out.append(sum(n * (n + 1) // 2 if causal else n * n for n in lengths))
    return np.array(out)


def reference(q, k, v, ids, causal):
    """f32 attention in ``[B, N, H, D]`` with the document (and causal) mask; empty rows give 0."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    keep = ids[:, None, :, None] == ids[:, None, None, :]
    if causal:
        keep = keep & jnp.tril(jnp.ones(s.shape[-2:], bool))
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), -1)
    return jnp.einsum("bhqk,bkhd->bqhd", jnp.where(keep.any(-1, keepdims=True), p, 0.0), v)


def unpacked(attend, pieces: int):
    """``attend`` on each of ``pieces`` equal parts of every sequence, as a batch ``pieces``× larger."""

    def run(q, k, v):
        b, n, heads, dim = q.shape
        q, k, v = (a.reshape(pieces * b, n // pieces, heads, dim) for a in (q, k, v))
        return attend(q, k, v).reshape(b, n, heads, dim)

    return run


def case(name: str, n: int, batch: int, interpret: bool):
    """The function ``(q, k, v) → out`` of one case, its ids ([B, N]) and whether it is causal."""
    causal = "causal" in name
    if name.startswith("cudnn"):  # the baseline, on the same shapes as the case it names
        pieces = 8 if "8 sequences" in name else 1
        cudnn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")  # noqa: E731
        ids = np.stack([documents(n, pieces, False) for _ in range(batch)]).astype(np.int32)
        return unpacked(cudnn, pieces), ids, True
    if name == "causal":
        ids = np.zeros((batch, n), np.int32)
        return (lambda q, k, v: nc.attention(q, k, v, is_causal=True, interpret=interpret)), ids, True
    ids = np.stack([documents(n, 8, "ragged" in name, seed=b) for b in range(batch)]).astype(np.int32)
    if name.startswith("8 sequences"):  # the same documents unpacked: a batch 8× larger, no ids to read
        ours = lambda q, k, v: nc.attention(q, k, v, is_causal=causal, interpret=interpret)  # noqa: E731
        return unpacked(ours, 8), ids, causal
    if "mask array" in name:
        mask = jnp.asarray(ids[:, None, :, None] == ids[:, None, None, :])
        return (lambda q, k, v: nc.attention(q, k, v, mask=mask, interpret=interpret)), ids, causal
    segments, backend = jnp.asarray(ids), "mosaic" if "(mosaic)" in name else "auto"

    def fn(q, k, v):
        return nc.attention(q, k, v, is_causal=causal, segment_ids=segments, interpret=interpret, backend=backend)

    return fn, ids, causal


CASES = (
    "causal",
    "documents 8",
    "documents 8 + causal",
    "8 sequences + causal",
    "documents 8 ragged",
    "documents 8 as a mask array",
    "documents 8 (mosaic)",
    "documents 8 + causal (mosaic)",
    "cudnn causal",
    "cudnn 8 sequences + causal",
)


def inputs(B, N, H, D, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(key, (B, N, H, D), jnp.float32).astype(jnp.bfloat16) for key in keys]


def fwd_bwd(f):
    def run(q, k, v, dO):
        out, pull = jax.vjp(f, q, k, v)
        return (out, *pull(dO))

    return jax.jit(run)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def check(name: str, n: int, dim: int, interpret: bool) -> dict:
    """Output and gradients of one case at a small size against the f32 reference."""
    fn, ids, causal = case(name, n, 1, interpret)
    q, k, v, dO = inputs(1, n, 2, dim, seed=1)
    got = fwd_bwd(fn)(q, k, v, dO)
    f32 = [a.astype(jnp.float32) for a in (q, k, v, dO)]
    want = fwd_bwd(lambda q, k, v: reference(q, k, v, jnp.asarray(ids), causal))(*f32)
    errors = [rel_err(a.astype(jnp.float32), w) for a, w in zip(got, want, strict=True)]
    return dict(zip(("O", "dQ", "dK", "dV"), errors, strict=True))


def measure(name: str, B: int, N: int, H: int, D: int, interpret: bool) -> dict:
    fn, ids, causal = case(name, N, B, interpret)
    q, k, v, dO = inputs(B, N, H, D)
    work = 4 * H * D * int(kept(ids, causal).sum())  # the flops on the entries the mask keeps
    dense = 4 * B * H * N * N * D
    row = {"case": name, "B": B, "N": N, "H": H, "D": D, "kept_fraction": work / dense}
    for what, f, factor in (("fwd", jax.jit(fn), 1), ("fwd+bwd", fwd_bwd(fn), FWD_BWD_FACTOR)):
        args = (q, k, v) if what == "fwd" else (q, k, v, dO)
        try:
            t = time_calls(f, *args, reps=2 if interpret else 10, batches=1 if interpret else 5, warmup=1).seconds
            row[what] = {
                "ms": t * 1e3,
                "tflops_kept": factor * work / t / 1e12,
                "tflops_dense": factor * dense / t / 1e12,
            }
        except Exception as e:  # noqa: BLE001 - a failure is a result to record
            row[what] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU smoke test)")
    ap.add_argument("--cases", default=None, help="comma-separated, of: " + ", ".join(CASES) + " (default: all)")
    ap.add_argument("--head-dim", type=int, default=128, help="D (GPU runs; --quick takes 16)")
    args = ap.parse_args(argv)
    interpret = args.quick
    if args.cases is None:  # cuDNN and Mosaic run only on a GPU
        args.cases = ",".join(c for c in CASES if not (interpret and (c.startswith("cudnn") or "(mosaic)" in c)))
    B, N, H, D = (1, 256, 2, 16) if args.quick else (2, 8192, 16, args.head_dim)
    start = time.time()
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "argv": argv, "rows": [], "checks": {}}

    def save():
        result["elapsed_s"] = time.time() - start
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    for name in args.cases.split(","):
        result["checks"][name] = check(name, 128 if args.quick else 1024, D, interpret)
        print("check", name, result["checks"][name], flush=True)
        save()
    for name in args.cases.split(","):
        result["rows"].append(measure(name, B, N, H, D, interpret))
        print(json.dumps(result["rows"][-1]), flush=True)
        save()
    print(f"\n{'case':<30} {'kept':>6} {'fwd ms':>9} {'TFLOP/s':>8} {'fwd+bwd ms':>11} {'TFLOP/s':>8}   (kept work)")
    for r in result["rows"]:
        f, b = r["fwd"], r["fwd+bwd"]
        cells = [f"{f.get('ms', float('nan')):9.3f}", f"{f.get('tflops_kept', float('nan')):8.1f}"]
        cells += [f"{b.get('ms', float('nan')):11.3f}", f"{b.get('tflops_kept', float('nan')):8.1f}"]
        print(f"{r['case']:<30} {r['kept_fraction']:6.3f} " + " ".join(cells), flush=True)
    return result


if __name__ == "__main__":
    main()
