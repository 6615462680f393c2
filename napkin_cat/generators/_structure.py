"""Structure: reshapes (split and merge of axes) and moves between memory levels.

>>> from napkin_cat import axes, Array, SMEM
>>> n, d = axes("n d")
>>> print(move(Array(n, d), SMEM).cod)
n×d
"""

from __future__ import annotations

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.errors import AxisError
from napkin_cat.generators._base import Generator


class Reshape(Generator):
    """Split one axis into two (row-major) or merge two adjacent axes into one.

    >>> from napkin_cat import axes
    >>> n, a, b = axes("n a b")
    >>> split(Array(n), n, a, Axis("b", n.size / a.size)).mixes
    ('n', 'a', 'b')
    """

    family = "relabel"

    @property
    def mixes(self):
        """The axes split or merged, and the ones they become."""
        dom, cod = self.dom.inside[0].names, self.out.names
        return tuple(n for n in (*dom, *cod) if (n in dom) != (n in cod))

    def evaluate(self, ins, ctx):
        (v,), p, xp, wire = ins, self.params, ctx.xp, self.dom.inside[0]
        shape = xp.shape(v)
        if "axis" in p:  # split: the axis becomes (outer, inner)
            i = wire.names.index(p["axis"])
            inner = int(ctx.number(self.out.axes[i + 1].size))
            return [xp.reshape(v, (*shape[:i], shape[i] // inner, inner, *shape[i + 1 :]))]
        i = wire.names.index(p["merge"])
        return [xp.reshape(v, (*shape[:i], shape[i] * shape[i + 1], *shape[i + 2 :]))]

    def lines(self, prog, ins, outs):
        return [(f"{prog.ix(outs[0])} = reshape {prog.ix(ins[0])}", outs, ins)]

    def backward(self, t, ins, outs, cts):
        x, y, ct = self.dom.inside[0], self.out, t.ty(cts[0])
        if "axis" in self.params:  # a split: merge back
            i = x.names.index(self.params["axis"])
            return [t(merge(ct, y.axes[i], y.axes[i + 1], into=x.axes[i]), cts[0])]
        i = x.names.index(self.params["merge"])
        return [t(split(ct, y.axes[i], x.axes[i], x.axes[i + 1]), cts[0])]


def split(a: Array, axis: Axis | str, outer: Axis, inner: Axis) -> Reshape:
    """Split ``axis`` into ``outer × inner`` (row-major); sizes must multiply to the axis size.

    >>> from napkin_cat import axes, Array
    >>> (n,) = axes("n")
    >>> print(split(Array(n), n, Axis("a", 2), Axis("b", n.size / 2)).cod)
    a×b
    """
    name = getattr(axis, "name", axis)
    old = a.axis(name)
    if sympy.simplify(outer.size * inner.size - old.size) != 0:
        raise AxisError(f"split {name}: {outer.name}·{inner.name} = {outer.size * inner.size} ≠ {old.size}")
    axes_ = [ax for x in a.axes for ax in ((outer, inner) if x.name == name else (x,))]
    return Reshape(f"split {name}", Ty(a), Ty(a.with_(axes=axes_)), data=(("axis", name),))


def merge(a: Array, first: Axis | str, second: Axis | str, into: Axis) -> Reshape:
    """Merge adjacent axes ``first``, ``second`` into ``into`` (row-major).

    >>> from napkin_cat import axes, Array
    >>> a, b = axes("a b")
    >>> print(merge(Array(a, b), a, b, Axis("n", a.size * b.size)).cod)
    n
    """
    f, s = (getattr(v, "name", v) for v in (first, second))
    i = a.names.index(a.axis(f).name)
    if i + 1 >= len(a.names) or a.names[i + 1] != s:
        raise AxisError(f"merge {f},{s}: the axes are not adjacent in {a.describe()}")
    if sympy.simplify(a.axes[i].size * a.axes[i + 1].size - into.size) != 0:
        raise AxisError(f"merge {f},{s}: sizes multiply to {a.axes[i].size * a.axes[i + 1].size}, not {into.size}")
    axes_ = [*a.axes[:i], into, *a.axes[i + 2 :]]
    return Reshape(f"merge {f}·{s}", Ty(a), Ty(a.with_(axes=axes_)), data=(("merge", f),))


class Move(Generator):
    """A change of colour: the array moves to another memory level (a transfer, FAN §1).

    >>> from napkin_cat import axes, SMEM
    >>> move(Array(*axes("n")), SMEM).transfers
    True
    """

    family, transfers = "move", True

    def evaluate(self, ins, ctx):
        return list(ins)

    def retyped(self, dom, cod):
        return Move(f"{dom.inside[0].level}→{cod.inside[0].level}", dom, cod, data=self.data)

    def lines(self, prog, ins, outs):
        (v,), out = ins, outs[0]
        src, dst = v.wire.level, out.wire.level
        verb = "load" if dst > src else "store"
        return [(f"{verb} {prog.block(v)} : {src} → {dst}", [out], [v])]

    def backward(self, t, ins, outs, cts):
        return [t(move(t.ty(cts[0]), self.dom.inside[0].level), cts[0])]


def move(a: Array, to) -> Move:
    """Move an array to memory level ``to`` (load towards compute, or store back).

    >>> from napkin_cat import axes, Array, SMEM
    >>> move(Array(*axes("n")), SMEM).name
    'HBM→SMEM'
    """
    b = a.with_(level=to)
    return Move(f"{a.level}→{b.level}", Ty(a), Ty(b))
