"""Each lowered backward kernel of an attention variant, timed alone: where a variant's forward + backward
loses against plain causal attention.

A variant's backward (``lowering._backward.backward_of``) is the forward with residuals, then the kernel that
computes the row values once (Δ, and a sink's folded log-sum-exp), then dQ and dK·dV. This script builds the
library's diagram at B = 2, H = 16, N = 8192, D = 128 (bf16, causal, ``tile(q, 128), stream(x, 64)``), runs the
kernels on random inputs in order (``lowering._backward.run_pieces``), times each with
``papers.flash_attention.timing.time_calls`` and writes ``results/backward_pieces_<GPU>.json``. It is the
measurement behind the sinks' row-weight lemma (papers/flash_attention/README.md).

    python -m papers.flash_attention.backward_pieces --out $OUT                       # GPU
    python -m papers.flash_attention.backward_pieces --quick --variants causal,sinks  # CPU: tiny, interpret mode
    ncu --clock-control none -k regex:napkin_kernel --launch-skip 1 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats --section Occupancy \
        python -m papers.flash_attention.backward_pieces --profile learned_bias       # dK·dV alone, under ncu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax

import napkin_cat as nc
from lowering import lower
from lowering._backward import backward_of, run_pieces
from papers.flash_attention.timing import time_calls
from rewrites import derive, stream, tile

HERE = Path(__file__).parent
#: the variants, each a diagram builder on (b, h, q, x, d) and the library's keywords
VARIANTS = {
    "causal": lambda L, q, x, d, kw: L.attention(q, x, d, **kw),
    "sinks": lambda L, q, x, d, kw: L.sink_attention(q, x, d, **kw),
    "softcap": lambda L, q, x, d, kw: L.softcap_attention(q, x, d, cap=50.0, **kw),
    "learned_bias": lambda L, q, x, d, kw: L.dot_product_attention(
        q, x, d, bias_batch=(kw["batch"][1],), bias_dtype="bf16", **kw
    ),
}


def sizes(quick: bool) -> dict:
    """B, H, N (queries and keys), D by axis name: tiny for a CPU smoke test."""
    B, N, H, D = (1, 256, 2, 64) if quick else (2, 8192, 16, 128)  # noqa: N806 - the usual names
    return {"b": B, "h": H, "q": N, "x": N, "d": D}


def build(name: str, quick: bool):
    """The variant's diagram, its lowered kernels (the forward with residuals first) and its backward's pieces."""
    b, h, q, x, d = nc.axes("b h q x d", d=sizes(quick)["d"])
    att = VARIANTS[name](nc.library, q, x, d, dict(causal=True, batch=(b, h), dtype=nc.bf16))
    sched = derive(att, tile(q, 128), stream(x, 64), verify=False).diagram
    return att, lower(sched, interpret=quick).kernels, backward_of(sched)


def normal(key, wires, size: dict) -> list:
    """Random arrays for ``wires``, one key each from ``key``."""
    keys = jax.random.split(key, len(wires))
    return [
        jax.random.normal(k, tuple(size[a.name] for a in w.axes), w.dtype.jnp) for k, w in zip(keys, wires, strict=True)
    ]


def run(variants: list[str], out: Path, quick: bool) -> Path:
    """Time every kernel of each variant's forward with residuals and backward; write and return the JSON."""
    size = sizes(quick)
    timing = (lambda f, *a: 0.0) if quick else (lambda f, *a: time_calls(f, *a).seconds)
    rows = []
    for name in variants:
        att, (forward, *kernels), bw = build(name, quick)
        *xs, do = normal(jax.random.key(0), [*att.dom.inside, *att.cod.inside], size)
        outs = forward(*xs)
        values = [*xs, do, *(outs[p] for p in bw.residuals)]
        row = {"variant": name, "forward with residuals": timing(jax.jit(forward), *xs) * 1e3, "kernels": []}
        for piece, kernel in zip(bw.pieces, kernels, strict=True):  # the pieces feeding rows read only values
            if piece.feeds:
                ms = timing(jax.jit(kernel), *(values[i] for i in piece.inputs)) * 1e3
                row["kernels"].append({"rules": [str(r) for r in piece.rules], "outputs": "rows", "ms": ms})
        for piece, kernel, ins, _ in run_pieces(bw, kernels, values):
            ms = timing(jax.jit(kernel), *ins) * 1e3
            row["kernels"].append({"rules": [str(r) for r in piece.rules], "outputs": list(piece.outputs), "ms": ms})
        row["total ms"] = row["forward with residuals"] + sum(k["ms"] for k in row["kernels"])
        print(json.dumps(row), flush=True)
        rows.append(row)
    kind = jax.devices()[0].device_kind
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"backward_pieces_{'cpu_quick' if quick else kind.replace(' ', '_')}.json"
    path.write_text(json.dumps({"gpu": kind, "sizes": size, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return path


def profile(name: str, quick: bool) -> None:
    """Run only the variant's dK·dV kernel, twice, on random inputs (its time does not depend on their values):
    for ``ncu --launch-skip 1 --launch-count 1``."""
    _, (_, *kernels), bw = build(name, quick)
    piece, kernel = next((p, k) for p, k in zip(bw.pieces, kernels, strict=True) if 1 in p.outputs)
    ins = normal(jax.random.key(0), piece.diagram.dom.inside, sizes(quick))
    f = jax.jit(kernel)
    for _ in range(2):
        jax.block_until_ready(f(*ins))
    print(f"{name}: dK·dV ran twice on {[str(w) for w in piece.diagram.dom.inside]}")


def main(argv=None) -> Path | None:
    """Parse ``argv`` and run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU)")
    p.add_argument("--profile", metavar="VARIANT", help="only run VARIANT's dK·dV kernel twice, for ncu")
    args = p.parse_args(argv)
    if args.profile:
        return profile(args.profile, args.quick)
    return run(args.variants.split(","), args.out, args.quick)


if __name__ == "__main__":
    main()
