"""The backward kernels' blocks, warps and stages (dQ, and dK·dV), each timed and checked against the default.

Causal and not, D ∈ {128, 64}, B = 2, H = 16, N = 8192, bf16: the lowered backward of attention scheduled
``tile(q, 128), stream(x, 64)``; each of its dQ and dK·dV kernels re-derived over a grid of (tile, stream,
warps, stages), checked against the kernel as lowered (relative error) and timed (median of batches).
``--mosaic`` does the same for the Mosaic GPU kernels (``backend="mosaic"``) over :data:`MOSAIC_GRID`'s (tile,
stream, ring stages, ping-pong). ``--ncu`` runs D = 128, non-causal, each configuration once and untimed, for
Nsight Compute's register and local-memory (spill) counts::

    python -m papers.flash_attention.backward_configs results/backward_configs_<GPU>.json         # GPU
    python -m papers.flash_attention.backward_configs results/backward_configs_mosaic_<GPU>.json --mosaic
    ncu --clock-control none --kernel-name regex:napkin --csv --metrics \
        launch__registers_per_thread,l1tex__t_bytes_pipe_lsu_mem_local_op_ld.sum,gpu__time_duration.sum \
        python -m papers.flash_attention.backward_configs /tmp/x.json --ncu

On CPU it runs tiny sizes in interpret mode (a smoke test).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import napkin_cat as nc
from lowering import Config, Lowered, MosaicConfig, MosaicLowered, lower, plan
from lowering._backward import backward_of, run_pieces
from papers.flash_attention.timing import time_calls
from rewrites import derive, stream, tile

#: (tile, stream, warps, stages); the first is the default schedule
GRID = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3)]
GRID += [(128, 128, 8, 2), (128, 32, 4, 4)]
#: (tile, stream, stages, ping-pong) for ``--mosaic``; the first is the default (a tile splits over two consumer
#: warpgroups, so 128 is 64 rows each, 256 is 128; Mosaic streams multiples of 64)
MOSAIC_GRID = [(128, 64, 2, False), (128, 64, 3, False), (128, 128, 2, False), (128, 64, 2, True)]
MOSAIC_GRID += [(128, 128, 2, True), (256, 64, 2, False)]


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def rederived(diagram, rules, config: Config | MosaicConfig, ins: list, want: list, interpret: bool):
    """A backward piece's ``diagram`` derived by ``rules`` and lowered with ``config`` (a Triton ``Config`` or a
    ``MosaicConfig``), run on ``ins``: the jitted kernel (to time) and the largest relative error
    (max |Δ| ÷ max |want|) of its outputs against ``want``."""
    lowered = MosaicLowered if isinstance(config, MosaicConfig) else Lowered
    f = jax.jit(lowered(plan(derive(diagram, *rules, verify=False).diagram), interpret=interpret, config=config))
    got = f(*ins)
    got = got if isinstance(got, tuple) else (got,)
    pairs = zip(got, want, strict=True)
    return f, max(float(np.max(np.abs(np.asarray(a, np.float32) - w)) / np.max(np.abs(w))) for a, w in pairs)


def run(out: str, ncu: bool, mosaic: bool = False) -> list:
    """Sweep every backward kernel of each case over :data:`GRID` (``mosaic``: :data:`MOSAIC_GRID`, on the Mosaic
    GPU backend); write ``{"gpu", "backend", sizes, "rows"}`` to ``out``."""
    cpu = jax.devices()[0].platform == "cpu"
    B, N, H = (1, 128 if mosaic else 64, 2) if cpu else (2, 8192, 16)  # noqa: N806 - the usual names
    small = cpu and not mosaic  # Mosaic's blocks are 64 rows per consumer at least
    timing = not (cpu or ncu)
    cases = [(128, False)] if ncu else [(128, True), (128, False), (64, False), (64, True)]
    rows = []
    for D, causal in cases:  # noqa: N806
        b, h, q, x, d = nc.axes("b h q x d", d=D)
        attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=causal, dtype="bf16")
        sched = derive(attn, tile(q, 16 if small else 128), stream(x, 16 if small else 64), verify=False).diagram
        backend, config = ("mosaic", MosaicConfig(interpretable=cpu)) if mosaic else ("triton", None)
        forward, *kernels = lower(sched, backend, interpret=cpu, config=config).kernels
        bw = backward_of(sched)
        keys = jax.random.split(jax.random.key(0), 4)
        xs = [jax.random.normal(k, (B, H, N, D), jnp.bfloat16) for k in keys[:3]]
        do = jax.random.normal(keys[3], (B, H, N, D), jnp.bfloat16)
        outs = forward(*xs)
        for piece, kernel, ins, res in run_pieces(bw, kernels, [*xs, do, *(outs[p] for p in bw.residuals)]):
            name = "dQ" if piece.outputs == (0,) else "dKdV"
            want = [np.asarray(r, np.float32) for r in res]
            tiled, streamed = (q, x) if name == "dQ" else (x, q)
            flops = 4 * B * H * N * N * D * (0.5 if causal else 1) * (1.0 if name == "dQ" else 1.5)
            base = time_calls(jax.jit(kernel), *ins).seconds if timing else 1.0
            log(f"D={D} causal={causal} {name} as lowered {[str(r) for r in piece.rules]} {base * 1e3:.3f} ms")
            for g, s, *knobs in configurations(mosaic, cpu):
                row = dict(D=D, causal=causal, kernel=name, tile=g, stream=s)
                if mosaic:
                    row |= dict(stages=knobs[0], pingpong=knobs[1])
                    config = MosaicConfig(stages=knobs[0], pingpong=knobs[1], interpretable=cpu)
                else:
                    row |= dict(warps=knobs[0], stages=knobs[1])
                    config = Config(*knobs)
                try:
                    rules = (tile(tiled, g), stream(streamed, s))
                    f, err = rederived(piece.diagram, rules, config, ins, want, cpu)
                    t = time_calls(f, *ins).seconds if timing else 1.0
                    row |= dict(ms=t * 1e3, tflops=flops / t / 1e12, vs_default=base / t, err=err)
                except Exception as e:  # a configuration over a limit is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                log(row)
                rows.append(row)
    with open(out, "w") as fh:
        gpu = jax.devices()[0].device_kind
        json.dump({"gpu": gpu, "backend": backend, "B": B, "N": N, "H": H, "rows": rows}, fh, indent=1)
    return rows


def configurations(mosaic: bool, cpu: bool) -> list:
    """The grid to sweep: tiny blocks interpreted on CPU, else :data:`GRID` or :data:`MOSAIC_GRID`."""
    if mosaic:
        return [(128, 64, 2, False)] if cpu else MOSAIC_GRID
    return [(16, 16, 4, 3)] if cpu else GRID


if __name__ == "__main__":
    paths = [a for a in sys.argv[1:] if not a.startswith("--")]
    run(paths[0] if paths else "backward_configs.json", "--ncu" in sys.argv, "--mosaic" in sys.argv)
