"""How building and evaluating big diagrams scales: ``python -m papers.neural_circuit_diagrams.scale``.

Builds chains of n boxes (a residual MLP-like block repeated) with ``Diagram.then(*parts)``, then times
``to_jax`` tracing and evaluation (eager and under ``jax.jit``). Prints a table; discopy's ``>>`` in a
Python loop and its stock functor are quadratic (discopy 1.2.2), which this library avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import napkin_cat as nc
from papers.flash_attention.timing import once


def chain(n_boxes: int) -> nc.Diagram:
    b, d = nc.axes("b d", b=8, d=16)
    a = nc.Array(b, d)
    parts = [nc.elementwise(("tanh", "add", "square", "exp")[i % 4], a, *((a,) if i % 4 == 1 else ()))
             if i % 4 != 1 else nc.copy(a) >> nc.add(a, a) for i in range(n_boxes)]
    return nc.Diagram.then(*parts)


def main():
    print(f"{'boxes':>6} {'build s':>9} {'eval s':>9} {'jit trace+run s':>16} {'jit run ms':>11}")
    for n in (250, 500, 1000, 2000, 4000):
        d, build, _ = once(chain, n)
        f = nc.to_jax(d)
        x = jnp.full((8, 16), 0.1)
        _, ev, _ = once(f, x)
        g = jax.jit(f)
        _, first, _ = once(g, x)
        _, run, _ = once(g, x)
        print(f"{len(d.boxes):>6} {build:>9.3f} {ev:>9.3f} {first:>16.3f} {1e3 * run:>11.3f}")


if __name__ == "__main__":
    main()
