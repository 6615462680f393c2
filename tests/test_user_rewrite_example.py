"""A user's own generator and rewrite rule, proved in the user's own tests (docs/user_rewrites.md).

Nothing here touches the library: the generator subclasses ``napkin_cat.Generator`` (semantics, cost,
accumulator, sympy semantics), the rule subclasses ``rewrites.Rule``, and ``rewrites.testing`` proves it.
"""

from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from discopy.monoidal import Layer

import napkin_cat as nc
from napkin_cat.accumulators import Accumulator
from napkin_cat.diagram import Diagram, Ty
from rewrites import RewriteError, Rule, stream, tile
from rewrites.testing import assert_equivalent, prove_equivalent


# --- 1. a new generator: the sum of squares along an axis, with its monoid accumulator ---------
class SumOfSquaresAccumulator(Accumulator):
    """State: the partial sum of squares; combine by addition (a monoid with unit 0)."""

    def partial(self, ins, ctx):
        i = self.box.dom.inside[0].names.index(self.axis)
        return jnp.sum(jnp.square(ins[0].astype(jnp.float32)), axis=i)

    def combine(self, a, b):
        return a + b

    def finalize(self, state, ctx):
        return [state.astype(self.box.out.dtype.jnp)]

    def identity(self, like):
        return jnp.zeros(like.shape, jnp.float32)

    # the same, over sympy object arrays, for prove_equivalent
    def partial_symbolic(self, ins, ctx):
        i = self.box.dom.inside[0].names.index(self.axis)
        return np.sum(np.asarray(ins[0], dtype=object) ** 2, axis=i)

    def combine_symbolic(self, a, b):
        return a + b

    def finalize_symbolic(self, state, ctx):
        return [state]


class SumOfSquares(nc.Generator):
    """``Σ_axis a²``: semantics, cost, accumulator, and sympy semantics."""

    def evaluate(self, ins, ctx):
        i = self.dom.inside[0].names.index(self.params["axis"])
        return [jnp.sum(jnp.square(ins[0].astype(jnp.float32)), axis=i).astype(self.out.dtype.jnp)]

    def evaluate_symbolic(self, ins, ctx):
        i = self.dom.inside[0].names.index(self.params["axis"])
        return [np.sum(np.asarray(ins[0], dtype=object) ** 2, axis=i)]

    def flops(self):
        return 2 * self.dom.inside[0].size

    def accumulator(self, axis):
        return SumOfSquaresAccumulator(self, axis) if axis == self.params["axis"] else None


def sum_of_squares(a: nc.Array, axis: str) -> SumOfSquares:
    out = a.with_(axes=[x for x in a.axes if x.name != axis])
    return SumOfSquares(f"Σ² {axis}", Ty(a), Ty(out), data=(("axis", axis),))


# --- 2. a new rule: fuse a square followed by a sum into one sum of squares --------------------
@dataclass(frozen=True)
class fuse_sum_of_squares(Rule):  # noqa: N801 - rules are named as verbs
    """rewrite: square ; sum over axis  →  Σ² axis (one pass, no squared array in memory)."""

    axis: str

    def __repr__(self):
        return f"fuse_sum_of_squares({self.axis})"

    def apply(self, d: Diagram) -> Diagram:
        layers, fused = list(d.inside), 0
        for i in range(len(layers) - 1):
            (left, sq, _), (left2, red, right2) = layers[i], layers[i + 1]
            if (getattr(sq, "params", {}).get("fn") == "square" and getattr(red, "params", {}).get("op") == "sum"
                    and red.params["axis"] == self.axis and len(left) == len(left2)):
                layers[i], layers[i + 1] = None, Layer(left, sum_of_squares(sq.dom.inside[0], self.axis), right2)
                fused += 1
        if not fused:
            raise self.fail(f"no square followed by a sum over {self.axis}", axis=self.axis)
        return Diagram(tuple(x for x in layers if x is not None), d.dom, d.cod, _scan=False)


# --- 3. the proofs -----------------------------------------------------------------------------
n, d = nc.axes("n d")
X = nc.Array(n, d)
naive = nc.square(X) >> nc.reduce_sum(X, d)  # Σ_d X², two boxes


def test_the_rule_rewrites():
    assert [b.name for b in fuse_sum_of_squares("d")(naive).boxes] == ["Σ² d"]


def test_the_rule_is_equivalent_on_random_inputs():
    fused = fuse_sum_of_squares("d")(naive)
    assert_equivalent(naive, fused, examples=2, seed=0)
    assert_equivalent(naive, stream("d", 3)(tile("n", 2)(fused)), examples=2, seed=0)  # through the accumulator


def test_the_rule_is_proved_symbolically():
    fused = fuse_sum_of_squares("d")(naive)
    assert prove_equivalent(naive, fused, sizes={"n": 2, "d": 3}).identities == 2
    assert prove_equivalent(naive, stream("d", 2)(fused), sizes={"n": 1, "d": 5})


def test_the_cost_is_the_generators():
    assert fuse_sum_of_squares("d")(naive).boxes[0].flops() == 2 * n.size * d.size != sympy.Integer(0)


def test_the_rule_refuses_what_it_cannot_fuse():
    with pytest.raises(RewriteError, match=r"^fuse_sum_of_squares\(n\): axis 'n': no square followed by a sum over n$"):
        fuse_sum_of_squares("n")(naive)


def test_the_docs_show_this_file_verbatim():
    doc = Path(__file__).parents[1] / "docs" / "user_rewrites.md"
    assert Path(__file__).read_text() in doc.read_text()
