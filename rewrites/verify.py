"""Verification of rewrites on random inputs: the commuting square ``execute ∘ rule = to_jax``.

Symbolic sizes are bound to random integers chosen so that tiles and streams are ragged (sizes that
the group and stream sizes do not divide) and several groups and chunks run; inputs are fresh
random normals in each wire's dtype; tolerances depend on the dtype.

>>> import napkin_cat as nc
>>> from rewrites import tile, stream
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> record = check(attn, stream(x, 8)(tile(q, 4)(attn)))
>>> record.passed
True
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin_cat.diagram import Diagram
from napkin_cat.dtypes import bf16, f16, f32, fp8_e4m3, fp8_e5m2
from napkin_cat.semantics import to_jax
from rewrites.rule import RewriteError
from rewrites.schedule import execute, partitions

#: relative tolerance by the lowest-precision dtype on the diagram's wires
TOLERANCE = {f32: 1e-4, f16: 5e-3, bf16: 3e-2, fp8_e4m3: 1.5e-1, fp8_e5m2: 2.5e-1}


@dataclass(frozen=True)
class Verification:
    """The record of one check: sizes used, error found, tolerance, outcome, time."""

    sizes: dict
    max_error: float
    tolerance: float
    passed: bool
    seconds: float
    seed: int

    def __str__(self):
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        verdict = "verified" if self.passed else "FAILED"
        return f"{verdict}: max rel. error {self.max_error:.1e} ≤ {self.tolerance:.0e} at {sizes} (seed {self.seed})"


def tolerance(d: Diagram) -> float:
    """The tolerance for a diagram: that of its lowest-precision wire."""
    wires = [*d.dom.inside, *d.cod.inside, *(w for b in d.boxes for w in b.cod.inside)]
    return max(TOLERANCE.get(w.dtype, TOLERANCE[f32]) for w in wires)


def sample_sizes(d: Diagram, rng: random.Random, *, small: int = 16) -> dict:
    """Concrete sizes for ``d``'s symbolic axes: tiled and streamed axes get 2–3 ragged groups/chunks."""
    tiles, streams = partitions(d)
    sizes = {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            if not isinstance(a.size, sympy.Symbol) or a.size in sizes:
                continue
            unit = max(tiles.get(a.name, 1), streams.get(a.name, 1))
            sizes[a.size] = rng.randint(2 * unit + 1, 3 * unit - 1) if unit > 2 else rng.randint(2, small)
    return sizes


def random_inputs(d: Diagram, sizes: dict, key) -> list:
    """Fresh random normal inputs for ``d`` at ``sizes``, one per input wire, in the wires' dtypes."""
    keys = jax.random.split(key, max(len(d.dom), 1))
    out = []
    for k, w in zip(keys, d.dom.inside, strict=False):
        shape = tuple(int(a.size.subs(sizes)) for a in w.axes)
        out.append(jax.random.normal(k, shape, jnp.float32).astype(w.dtype.jnp))
    return out


def relative_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if not a.size:
        return 0.0
    same = a == b  # equal infinities (masked scores) agree exactly
    diff = np.where(same, 0.0, np.abs(a - b))
    scale = np.max(np.abs(np.where(np.isfinite(b), b, 0.0)), initial=1e-30)
    return float(np.max(diff) / max(scale, 1e-30))


def check(
    reference: Diagram, candidate: Diagram, *, seed: int | None = None, sizes: dict | None = None, rule: str = "verify"
) -> Verification:
    """Compare the scheduled semantics of ``candidate`` with the reference semantics of ``reference``.

    Raises :class:`RewriteError` if they differ beyond the dtype's tolerance.
    """
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    rng = random.Random(seed)
    sizes = sizes or sample_sizes(candidate, rng)
    start = time.perf_counter()
    xs = random_inputs(reference, sizes, jax.random.key(seed))
    want, got = to_jax(reference)(*xs), execute(candidate)(*xs)
    want, got = (want,) if not isinstance(want, tuple) else want, (got,) if not isinstance(got, tuple) else got
    err = max(relative_error(g, w) for g, w in zip(got, want, strict=True))
    tol = tolerance(candidate)
    rec = Verification({str(k): v for k, v in sizes.items()}, err, tol, err <= tol, time.perf_counter() - start, seed)
    if not rec.passed:
        raise RewriteError(rule, f"the rewritten diagram differs from the original: {rec}")
    return rec
