"""The Mosaic forward's launch order on Hopper: L2 sections, one batch element at a time, or the whole batch.

Causal tiles launch heaviest first (``lowering._blocks.heavy_last``). Across how many batch elements is a
choice between the last wave's length and L2: ``MosaicConfig(members=m)`` launches the batch in sections of
``m`` elements, every element's tile t before any element's tile t − 1 within a section. ``m = 1`` streams each
element's K and V from L2 for all its tiles but runs its light tiles next to the next element's heavy ones;
``m = B·H`` is longest first across the whole batch, with every head's K and V streamed at once; the default is
the largest divisor of B·H whose K and V fit the hardware model's L2 share
(``lowering.mosaic._kernel.MosaicKernel.members``).

For D ∈ {64, 128}, N ∈ {8192, 2048} (B·N = 16k tokens, H = 16, bf16), causal under the three orders and not
causal under the default, at two tiles each, this script times each forward (checked first against
mosaic_bench.py's f32 reference, within its tolerance), reads ptxas's register and spill report for it
(``MOSAIC_GPU_DUMP_PTXAS``), prints a table and writes ``results/launch_order_<GPU>.json``.

    python -m papers.flash_attention.launch_order --out $OUT     # an sm_90 GPU
    python -m papers.flash_attention.launch_order --quick        # CPU: tiny sizes, Mosaic interpret mode
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

from lowering import MosaicConfig, MosaicLowered, plan
from papers.flash_attention.mosaic_bench import TOLERANCE, reference, relative_error, scheduled
from papers.flash_attention.timing import time_calls

HERE = Path(__file__).parent
#: per head dim, the Mosaic tiles (g, s) compared: mosaic_bench.py's and the entry's
TILES = {64: [(256, 128), (128, 128)], 128: [(128, 128), (256, 64)]}


def ptxas_report(directory: str) -> list[str]:
    """ptxas's lines on registers and spills, from the reports Mosaic GPU dumped into ``directory``."""
    text = "\n".join(Path(p).read_text() for p in glob.glob(os.path.join(directory, "*.ptxas")))
    return [line.strip() for line in text.splitlines() if "spill" in line or "Used" in line]


def one(D: int, N: int, causal: bool, g: int, s: int, members: str, quick: bool) -> dict:  # noqa: N803
    """Time one forward; ``members`` is "L2", "1" or "all"."""
    B, H = (1, 4) if quick else (16384 // N, 16)  # noqa: N806 - the usual names
    q = [jax.random.normal(k, (B, H, N, D), jnp.bfloat16) for k in jax.random.split(jax.random.key(N + D), 3)]
    m = {"L2": None, "1": 1, "all": B * H}[members]
    config = MosaicConfig(members=m, interpretable=quick)
    row = {"D": D, "N": N, "causal": causal, "g": g, "s": s, "members": members}
    with tempfile.TemporaryDirectory() as dump:
        os.environ.update(MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=dump)
        try:
            f = jax.jit(MosaicLowered(plan(scheduled(D, causal, g, s).diagram), interpret=quick, config=config))
            out = f(*q)
        finally:
            for name in ("MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_TO"):
                del os.environ[name]
        row["ptxas"] = ptxas_report(dump)
    want = reference(*(jnp.moveaxis(a[0, :2], 0, 1) for a in q), causal)  # batch 0, two heads, [N, 2, D]
    row["rel_err"] = relative_error(jnp.moveaxis(out[0, :2], 0, 1), want)
    if not row["rel_err"] <= TOLERANCE:  # a wrong kernel is not timed (mosaic_bench.py's rule)
        row["error"] = f"relative error {row['rel_err']:.3g} over {TOLERANCE}"
    elif not quick:
        t = time_calls(f, *q).seconds
        row |= {"ms": t * 1e3, "tflops": 4 * B * H * N * N * D / (2 if causal else 1) / t / 1e12}
    return row


def run(out: Path, quick: bool) -> Path:
    """Every configuration in turn; write and return the JSON."""
    rows = []
    for D in (64,) if quick else (64, 128):  # noqa: N806
        for N in (256,) if quick else (8192, 2048):  # noqa: N806
            for causal in (True, False):
                for g, s in TILES[D][:1] if quick else TILES[D]:
                    for members in ("L2", "1", "all") if causal else ("L2",):
                        rows.append(one(D, N, causal, g, s, members, quick))
                        print({k: v for k, v in rows[-1].items() if k != "ptxas"}, rows[-1]["ptxas"][-2:], flush=True)
    kind = jax.devices()[0].device_kind
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"launch_order_{'cpu_quick' if quick else kind.replace(' ', '_')}.json"
    path.write_text(json.dumps({"gpu": kind, "jax": jax.__version__, "rows": rows}, indent=1))
    print(table(rows))
    print(f"wrote {path}")
    return path


def table(rows: list[dict]) -> str:
    """TFLOP/s per configuration and order, and the spill bytes ptxas reported."""
    lines = [
        "| D, N, causal, tiles | L2 sections | one element | whole batch | spills (L2 sections) |",
        "|---" * 5 + "|",
    ]
    keys = dict.fromkeys((r["D"], r["N"], r["causal"], r["g"], r["s"]) for r in rows)
    for D, N, causal, g, s in keys:  # noqa: N806
        here = {r["members"]: r for r in rows if (r["D"], r["N"], r["causal"], r["g"], r["s"]) == (D, N, causal, g, s)}
        cell = [f"{here[m]['tflops']:.0f}" if m in here and "tflops" in here[m] else "—" for m in ("L2", "1", "all")]
        spills = next((ln for ln in here["L2"]["ptxas"] if "spill stores" in ln and "frame" in ln), "—")
        lines.append(f"| {D}, {N}, {'yes' if causal else 'no'}, g{g} s{s} | {' | '.join(cell)} | {spills} |")
    return "\n".join(lines)


def main(argv=None) -> Path:
    """Parse ``argv`` and run."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--quick", action="store_true", help="tiny sizes, Mosaic interpret mode (CPU)")
    args = p.parse_args(argv)
    return run(args.out, args.quick)


if __name__ == "__main__":
    main()
