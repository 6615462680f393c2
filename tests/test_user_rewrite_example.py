"""A user's own generator and rewrite rule, proved in the user's own tests (docs/user_rewrites.md).

Nothing here touches the library: the generator is one class subclassing ``napkin_cat.Generator`` — its
semantics written once against the array namespace ``ctx.xp``, its cost, its accumulator, its
derivative, its drawing family and its pseudocode line — and from it alone the library derives the
cost, the picture, the pseudocode, the symbolic proof, the backward diagram and a lowered kernel.
The rule subclasses ``rewrites.AxisRule``, and ``rewrites.testing`` proves it.
"""

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy

import napkin_cat as nc
from lowering import lower
from napkin_cat.diagram import Diagram, Ty
from rewrites import AxisRule, RewriteError, derive, pseudocode, stream, tile
from rewrites.testing import assert_equivalent, prove_equivalent


# --- 1. a new generator: the sum of squares along an axis, its own monoid accumulator ----------
class SumOfSquares(nc.Generator):
    """``Σ_axis a²``: one class carrying semantics, cost, accumulator, derivative, picture and pseudocode."""

    family, symbol = "reduction", "Z"  # drawn as a reduction; its values are named Z in pseudocode
    padding = (0.0,)  # padding along the streamed axis that adds nothing

    def partial(self, ins, ctx):  # the state of one chunk, written once for JAX, kernels and sympy
        xp = ctx.xp
        return xp.sum(xp.square(xp.f32(ins[0])), self.dom.inside[0].names.index(self.params["axis"]))

    def combine(self, a, b, ctx):
        return a + b

    def finalize(self, state, ctx):
        return [ctx.xp.cast(state, self.out.dtype)]

    def identity(self, like, ctx):
        return ctx.xp.full(like.shape, 0)

    def evaluate(self, ins, ctx):
        return self.finalize(self.partial(ins, ctx), ctx)

    def flops(self):
        return 2 * self.dom.inside[0].size

    def backward(self, t, ins, outs, cts):  # ∂/∂v Σ v² = 2v, times the cotangent
        (v,), (ct,) = ins, cts
        return [t.ew("multiply", t.ew("multiply", v, ct, out=t.ty(v).with_(dtype=nc.f32)), const=2)]

    def lines(self, prog, ins, outs):
        return [(f"{prog.ix(outs[0])} = Σ_{self.params['axis']} {prog.ix(ins[0])}²", outs, ins)]


def sum_of_squares(a: nc.Array, axis: str) -> SumOfSquares:
    out = a.with_(axes=[x for x in a.axes if x.name != axis])
    return SumOfSquares(f"Σ² {axis}", Ty(a), Ty(out), data=(("axis", axis),))


# --- 2. a new rule: fuse a square followed by a sum into one sum of squares --------------------
@dataclass(frozen=True, repr=False)
class fuse_sum_of_squares(AxisRule):  # noqa: N801 - rules are named as verbs
    """rewrite: square ; sum over axis  →  Σ² axis (one pass, no squared array in memory)."""

    def apply(self, d: Diagram) -> Diagram:
        layers, fused = list(d.inside), 0
        for i in range(len(layers) - 1):
            (left, sq, _), (left2, red, right2) = layers[i], layers[i + 1]
            if (getattr(sq, "params", {}).get("fn") == "square" and getattr(red, "params", {}).get("op") == "sum"
                    and red.params["axis"] == self.name and len(left) == len(left2)):
                layers[i], layers[i + 1] = None, (left, sum_of_squares(sq.dom.inside[0], self.name), right2)
                fused += 1
        if not fused:
            raise self.fail(f"no square followed by a sum over {self.name}", axis=self.name)
        return d.with_layers(x for x in layers if x is not None)


# --- 3. the proofs, and what the library derives from the one class ------------------------------
n, d = nc.axes("n d")
X = nc.Array(n, d)
naive = nc.square(X) >> nc.reduce_sum(X, d)  # Σ_d X², two boxes
fused = fuse_sum_of_squares("d")(naive)


def test_the_rule_rewrites():
    assert [b.name for b in fused.boxes] == ["Σ² d"]


def test_the_rule_is_equivalent_on_random_inputs():
    assert_equivalent(naive, fused, examples=2, seed=0)
    assert_equivalent(naive, stream("d", 3)(tile("n", 2)(fused)), examples=2, seed=0)  # through the accumulator


def test_the_rule_is_proved_symbolically():
    assert prove_equivalent(naive, fused, sizes={"n": 2, "d": 3}).identities == 2
    assert prove_equivalent(naive, stream("d", 2)(fused), sizes={"n": 1, "d": 5})


def test_the_cost_is_the_generators():
    assert nc.cost(fused).flops == 2 * n.size * d.size != sympy.Integer(0)


def test_the_picture(tmp_path):
    nc.draw(fused, tmp_path / "sum_of_squares.png")
    assert (tmp_path / "sum_of_squares.png").stat().st_size > 0


def test_the_pseudocode():
    text = pseudocode(stream("d", 32)(tile("n", 64)(fused)))
    assert "acc_Y[n] = identity   # SumOfSquares's own" in text and "acc_Y[n] = step(acc_Y[n], X[n,d])" in text
    assert "Y = Σ_d X[d]²" in pseudocode(fused)


def test_the_derivative_matches_jax():
    x, ct = (jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)
             for seed, shape in ((0, (3, 5)), (1, (3,))))
    (want,) = jax.vjp(lambda v: jnp.sum(v * v, axis=1), x)[1](ct)  # an independent reference
    got = nc.to_jax(nc.reverse(fused))(x, ct)
    assert float(jnp.max(jnp.abs(got - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


def test_the_lowered_kernel():
    kernel = lower(derive(fused, tile(n, 16), stream(d, 16), verify=False), interpret=True)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((20, 40)), jnp.float32)
    want = jnp.sum(x * x, axis=1)  # an independent reference
    assert float(jnp.max(jnp.abs(kernel(x) - want))) <= 1e-5 * float(jnp.max(jnp.abs(want)))


def test_the_rule_refuses_what_it_cannot_fuse():
    with pytest.raises(RewriteError, match=r"^fuse_sum_of_squares\(n\): axis 'n': no square followed by a sum over n$"):
        fuse_sum_of_squares("n")(naive)


def test_the_docs_show_this_file_verbatim():
    doc = Path(__file__).parents[1] / "docs" / "user_rewrites.md"
    assert Path(__file__).read_text() in doc.read_text()
