"""How long ``derive`` takes to verify multi-head causal attention, eager (before) and jitted (after).

The derivation is ``tile(q, 128)`` then ``stream(x, 64)`` of ``multi_head_attention(h, q, x, d, batch=(b,),
causal=True)``. Each seed draws new sizes, so every jitted run compiles afresh (no cache helps it).

* after: ``derive(...)`` end to end (rules, sizes, inputs, the jitted reference and both jitted checks);
* jitted, default XLA options: the same checks compiled for speed of execution instead of compilation;
* before (eager): the same checks run op by op, as ``derive`` did, at the same sizes and inputs;
* before (eager, the old sizes): op by op at the sizes the old sampler drew (b, h up to 16, 3 chunks).

Wall and CPU seconds, median over seeds; the load average shows what else the machine was doing.

    python papers/flash_attention_on_a_napkin/verify_speed.py > papers/flash_attention_on_a_napkin/verify_speed.txt
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`

import napkin_cat as nc  # noqa: E402
from papers.flash_attention.timing import once  # noqa: E402
from rewrites import Trial, derive, execute, random_inputs, stream, tile  # noqa: E402
from rewrites import _verify as verification  # noqa: E402 - its FAST_COMPILE cache, off to time the unjitted path

SEEDS = range(5)
RULES = (tile("q", 128), stream("x", 64))


def attention() -> nc.Diagram:
    """A fresh diagram object each time, so that no jitted function is reused across variants."""
    b, h, q, x, d = nc.axes("b h q x d")
    return nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)


def timed(f: Callable) -> tuple[float, float]:
    _, wall, cpu = once(f)
    return wall, cpu


def eager_checks(attn: nc.Diagram, sizes: dict, seed: int) -> Callable:
    """The old verification: the reference and each step's scheduled semantics, op by op."""
    steps = [RULES[0](attn)]
    steps.append(RULES[1](steps[0]))
    xs = random_inputs(attn, sizes, seed)
    return lambda: [nc.to_jax(attn)(*xs), *(execute(s)(*xs) for s in steps)]


def old_sizes(attn: nc.Diagram, rng: random.Random) -> dict:
    """The sizes the sampler drew before this change: 2-16 for free axes, 2-3 full units plus a ragged rest."""
    units = {"q": 128, "x": 64}
    return {
        a.size: rng.randint(2 * units[a.name] + 1, 3 * units[a.name] - 1) if a.name in units else rng.randint(2, 16)
        for w in attn.dom.inside
        for a in w.axes
    }


def row(label: str, times: list[tuple[float, float]]) -> str:
    wall, cpu = (statistics.median(t[i] for t in times) for i in (0, 1))
    return f"| {label} | {wall:.2f} | {cpu:.2f} | {len(times)} |"


def main():
    derive(nc.library.attention(*nc.axes("q x d")), tile("q", 4), seed=0)  # JAX's own start-up, not measured
    after, slow_compile, eager, eager_old = [], [], [], []
    sizes_seen = []
    for seed in SEEDS:
        attn = attention()
        after.append(timed(lambda: derive(attn, *RULES, seed=seed).diagram.dom))  # noqa: B023
        trial = Trial.draw(attn, RULES[1](RULES[0](attn)), seed=seed)
        sizes_seen.append(trial.sizes)
        symbols = {a.name: a.size for w in attn.dom.inside for a in w.axes}
        eager.append(timed(eager_checks(attn, {symbols[k]: v for k, v in trial.sizes.items()}, seed)))
        fast, verification.FAST_COMPILE = verification.FAST_COMPILE, {}
        try:
            attn = attention()
            slow_compile.append(timed(lambda: derive(attn, *RULES, seed=seed).diagram.dom))  # noqa: B023
        finally:
            verification.FAST_COMPILE = fast
    attn = attention()
    eager_old.append(timed(eager_checks(attn, old_sizes(attn, random.Random(0)), 0)))
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (1 min) at the end")
    print("sizes (after): " + "; ".join(", ".join(f"{k}={v}" for k, v in s.items()) for s in sizes_seen))
    print()
    print("| verification of tile(q, 128), stream(x, 64) | wall s | CPU s | runs |")
    print("|---|---|---|---|")
    print(row("after: derive, jitted per block shape, fast compilation", after))
    print(row("jitted, default XLA options", slow_compile))
    print(row("before: eager, at the same sizes", eager))
    print(row("before: eager, at the old sampler's sizes", eager_old))


if __name__ == "__main__":
    main()
