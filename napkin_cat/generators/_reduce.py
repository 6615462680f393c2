"""Reductions over one axis (sum, max, min): monoids, so streamable with the monoid as accumulator.

>>> from napkin_cat import axes, Array
>>> n, k = axes("n k")
>>> print(reduce_sum(Array(n, k), k).cod)
n
"""

from __future__ import annotations

import jax.numpy as jnp

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Template, Ty
from napkin_cat.dtypes import f32
from napkin_cat.errors import AxisError
from napkin_cat.generators._base import Accumulator, Generator

#: op: (the namespace's reduction, its binary form, its unit, pseudocode symbol, unit text)
OPS = {
    "sum": ("sum", "add", 0.0, "Σ", "0"),
    "max": ("max", "maximum", -jnp.inf, "max", "−∞"),
    "min": ("min", "minimum", jnp.inf, "min", "+∞"),
}
SYMBOLS = {"sum": "Z", "max": "M", "min": "N"}


def broadcast(v, like):
    """``v`` broadcast to the shape of ``like`` (the backward of a sum; ``like`` is read for its shape).

    >>> broadcast(jnp.ones((2, 1)), jnp.zeros((2, 3))).shape
    (2, 3)
    """
    return jnp.broadcast_to(v, jnp.broadcast_shapes(jnp.shape(v), jnp.shape(like)))


def attains(v, extremum):
    """1 where ``v`` attains the row's ``extremum`` (a max or min), else 0.

    >>> attains(jnp.array([1.0, 3.0, 3.0]), jnp.float32(3.0)).tolist()
    [0.0, 1.0, 1.0]
    """
    return (v == extremum).astype(jnp.float32)


def _unit(xp, op: str):
    return {"sum": 0, "max": -xp.inf, "min": xp.inf}[op]


class Reduce(Generator):
    """Sum, max or min over one axis; a monoid, so streamable along it.

    >>> from napkin_cat import axes
    >>> reduce_max(Array(*axes("n")), "n").symbol
    'M'
    """

    family = "reduction"

    @property
    def symbol(self) -> str:
        return SYMBOLS[self.params["op"]]

    def evaluate(self, ins, ctx):
        xp, (v,) = ctx.xp, ins
        i = self.dom.inside[0].names.index(self.params["axis"])
        return [xp.cast(getattr(xp, self.params["op"])(xp.f32(v), i), self.out.dtype)]

    def flops(self):
        return self.dom.inside[0].size

    def accumulator(self, axis):
        return Monoid(self, axis) if axis == self.params["axis"] else None

    def lines(self, prog, ins, outs):
        text = f"{prog.ix(outs[0])} = {OPS[self.params['op']][3]}_{self.params['axis']} {prog.ix(ins[0])}"
        return [(text, outs, ins)]

    def backward(self, t, ins, outs, cts):
        (x,), (y,), (ct,) = ins, outs, cts
        X = t.ty(x).with_(dtype=f32)
        if self.params["op"] == "sum":
            return [t.ew(broadcast, ct, x, out=X)]
        # max, min: the cotangent goes to the positions attaining the extremum, shared among ties (as JAX)
        at = t.ew(attains, x, y, out=X)
        count = t(reduce_sum(X, self.params["axis"]), at)
        return [t.ew("multiply", at, t.ew("divide", ct, count), out=X)]


class Monoid(Accumulator):
    """A reduction by a monoid (sum, max, min): the state is the partial reduction.

    >>> from napkin_cat import axes
    >>> reduce_min(Array(*axes("n")), "n").accumulator("n").padding
    (inf,)
    """

    @property
    def op(self) -> str:
        """``sum``, ``max`` or ``min``."""
        return self.box.params["op"]

    @property
    def padding(self):
        return (OPS[self.op][2],)

    def partial(self, ins, ctx):
        xp = ctx.xp
        return getattr(xp, OPS[self.op][0])(xp.f32(ins[0]), self.at)

    def combine(self, a, b, ctx):
        return getattr(ctx.xp, OPS[self.op][1])(a, b)

    def finalize(self, state, ctx):
        return [ctx.xp.cast(state, self.box.out.dtype)]

    def identity(self, like, ctx):
        return ctx.xp.full(like.shape, _unit(ctx.xp, self.op))

    def lines(self, prog, ins, outs):
        op, x, ix, out = self.op, self.axis, prog.ix, outs[0]
        a = prog.state(f"acc_{out.name}", out.wire)
        step = f"{ix(a)} + Σ_{x} {ix(ins[0])}" if op == "sum" else f"{op}({ix(a)}, {op}_{x} {ix(ins[0])})"
        return (
            [(f"{ix(a)} = {OPS[op][4]}", [a], [])],
            [(f"{ix(a)} = {step}", [], [a, *ins])],
            [(f"{ix(out)} = {ix(a)}", [out], [a], False, True)],
        )


def _reduce(op: str):
    def make(a: Array | Axis | str, axis: Axis | str | None = None) -> Reduce | Template:
        if isinstance(a, Axis | str):
            return Template(make, a)
        name = getattr(axis, "name", axis)
        if not a.has(name):
            raise AxisError(f"{op} over {name!r}: array {a.describe()} has no such axis")
        out = a.with_(axes=[ax for ax in a.axes if ax.name != name])
        return Reduce(f"{op} {name}", Ty(a), Ty(out), data=(("op", op), ("axis", name)))

    make.__name__ = f"reduce_{op}"
    make.__doc__ = f"""The {op} of an array over one axis: ``reduce_{op}(array, axis)``, or ``reduce_{op}(axis)``
    as a template for ``>>``.

    >>> from napkin_cat import axes, Array
    >>> n, k = axes("n k")
    >>> print(reduce_{op}(Array(n, k), k).cod)
    n
    """
    return make


reduce_sum = _reduce("sum")
reduce_max = _reduce("max")
reduce_min = _reduce("min")
