"""Convolution, concatenation and renaming: the generators the neural-circuit-diagram architectures add.

A convolution is a contraction over the input channels ``i`` and the kernel offsets ``k`` in which each
output position reads a window of the input (NCD §3.3):
``X[*batch, i, *xs] ⊗ W[o, i, *ks] → Y[*batch, o, *ys]``, with ``y = ⌊(x + lo + hi − k)/stride⌋ + 1``.
Like every generator, it is written over *named* axes, so weaving needs nothing from it: axes that the
weight shares with the input are woven (``jax.vmap``), the input's other extra axes are its batch.

>>> from napkin_cat import axes, Array
>>> b, i, o, x, k = axes("b i o x k", k=3)
>>> c = conv(Array(b, i, x), Array(o, i, k), padding="same")
>>> print(c.dom, "→", c.cod)
b×i×x ⊗ o×i×k → b×o×x
>>> c.flops()
6*b*i*o*x
>>> print(conv(Array(i, x), Array(o, i, k), stride=2).cod)
o×x_out
>>> conv(Array(i, x), Array(o, i, k), stride=2).out.axes[-1].size
floor(x/2 - 3/2) + 1
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.errors import AxisError
from napkin_cat.generators import Context, Generator


def _layout(value, names: tuple[str, ...], target: tuple[str, ...]):
    """Transpose ``value`` (axes ``names``) to ``target`` order; names missing from ``value`` get size-1 axes."""
    present = [n for n in target if n in names]
    value = jnp.transpose(value, [names.index(n) for n in present])
    return jnp.expand_dims(value, [j for j, n in enumerate(target) if n not in names])


def _sizes(ctx: Context, axes) -> tuple[int, ...]:
    return tuple(int(ctx.number(a.size)) for a in axes)


class Conv(Generator):
    """Cross-correlation over named spatial axes (``jax.lax.conv_general_dilated``), accumulated in f32.

    ``data``: the input- and output-channel axis names, per spatial axis ``(x, k, y)`` names, the
    strides and the ``(lo, hi)`` paddings (sympy expressions in the sizes).
    """

    family = "contraction"

    def _window_check(self, ctx: Context):
        X, W = self.dom.inside
        p = self.params
        for (x, k, _), (lo, hi) in zip(p["spatial"], p["padding"], strict=True):
            if ctx.number(X.axis(x).size + lo + hi - W.axis(k).size) < 0:
                raise AxisError(_too_large(X, W, x, k, lo, hi, ctx))

    def evaluate(self, ins, ctx):
        self._window_check(ctx)
        (X, W), (xw, ww), p = ins, self.dom.inside, self.params
        xs, ks, ys = zip(*p["spatial"], strict=True)
        i, o = p["channels"]
        woven = [n for n in ww.names if n not in (o, i, *ks)]
        batch = [n for n in xw.names if n not in (*woven, i, *xs)]
        X = _layout(X, xw.names, (*woven, *batch, i, *xs))
        W = _layout(W, ww.names, (*woven, o, i, *ks))
        nw, batch_shape = len(woven), X.shape[len(woven) : len(woven) + len(batch)]
        X = X.reshape(*X.shape[:nw], -1, *X.shape[nw + len(batch) :])  # batch axes → one N axis
        f = partial(
            jax.lax.conv_general_dilated,
            window_strides=tuple(p["stride"]),
            padding=[(int(ctx.number(lo)), int(ctx.number(hi))) for lo, hi in p["padding"]],
            preferred_element_type=jnp.float32,
        )
        for _ in woven:
            f = jax.vmap(f)
        Y = f(X, W)
        Y = Y.reshape(*Y.shape[:nw], *batch_shape, *Y.shape[nw + 1 :])
        return [_layout(Y, (*woven, *batch, o, *ys), self.out.names).astype(self.out.dtype.jnp)]

    def flops(self):
        """Two flops (multiply, add) per output element per input channel per kernel offset."""
        sizes = {a.name: a.size for w in (self.dom.inside[1], self.out) for a in w.axes}
        return 2 * sympy.Mul(*sizes.values())

    def tensor_flops(self):
        """All of a convolution's flops run on tensor cores."""
        return self.flops()


def _too_large(X: Array, W: Array, x: str, k: str, lo, hi, ctx: Context | None = None) -> str:
    size = lambda e: e if ctx is None else int(ctx.number(e))  # noqa: E731
    return (
        f"conv: kernel axis {k!r} (size {size(W.axis(k).size)}) of W {W.describe()} is larger than input axis "
        f"{x!r} (size {size(X.axis(x).size)}) of X {X.describe()} padded by {lo}+{hi}"
    )


def _padding(padding, ks: tuple[Axis, ...], strides: tuple[int, ...]) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    if padding == "valid":
        padding = 0
    if padding == "same":
        if any(s != 1 for s in strides):
            raise AxisError(f"conv: padding 'same' needs stride 1, got strides {strides}")
        return tuple((sympy.floor((k.size - 1) / 2), k.size - 1 - sympy.floor((k.size - 1) / 2)) for k in ks)
    if not isinstance(padding, tuple | list):
        padding = (padding,) * len(ks)
    if len(padding) != len(ks):
        raise AxisError(f"conv: {len(padding)} paddings for {len(ks)} spatial axes")
    pairs = [p if isinstance(p, tuple | list) else (p, p) for p in padding]
    return tuple((sympy.sympify(lo), sympy.sympify(hi)) for lo, hi in pairs)


def _output_axis(x: Axis, k: Axis, stride: int, lo, hi, out: Axis | None) -> Axis:
    span = x.size + lo + hi - k.size
    size = (span if stride == 1 else sympy.floor(span / stride)) + 1  # no floor: x/2 is not known to be an integer
    if out is None:
        return x if sympy.simplify(size - x.size) == 0 else Axis(f"{x.name}_out", size)
    if sympy.simplify(out.size - size) != 0:
        raise AxisError(
            f"conv: output axis {out.name!r} has size {out.size}, "
            f"but the window over {x.name!r} gives {size}"
        )
    return out


def conv(X: Array, W: Array, *, stride=1, padding=0, out: tuple[Axis, ...] | None = None) -> Conv:
    """The convolution (cross-correlation) of ``X[*batch, i, *xs]`` with ``W[o, i, *ks]``.

    ``stride`` is an int or one per spatial axis; ``padding`` an int, ``(lo, hi)`` pairs per axis,
    ``"valid"`` or ``"same"`` (stride 1). Output axes ``out`` default to the input axis when the size is
    unchanged, else ``{x}_out``. A kernel larger than the padded input raises an :class:`AxisError`
    naming the wires (here if the sizes are numbers, at evaluation otherwise).

    >>> from napkin_cat import axes, Array
    >>> i, j, o, x, k = axes("i j o x k", x=3, k=5)
    >>> conv(Array(i, x), Array(o, i, k))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: conv: kernel axis 'k' (size 5) of W o×i×k:f32@HBM is larger than input axis 'x' ...
    >>> conv(Array(j, x), Array(o, i, k))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: conv: input channels of X j×x:f32@HBM are 'j', but W o×i×k:f32@HBM expects 'i'
    """
    if len(W.axes) < 3:
        raise AxisError(f"conv: W {W.describe()} needs axes (out channels, in channels, kernel axes...)")
    o, i, *ks = W.axes
    n = len(ks)
    if len(X.axes) < n + 1:
        raise AxisError(f"conv: X {X.describe()} needs axes (..., channels, {n} spatial axes)")
    batch, (ix, *xs) = X.axes[: -n - 1], X.axes[-n - 1 :]
    if ix != i:
        raise AxisError(
            f"conv: input channels of X {X.describe()} are {ix.name!r}, but W {W.describe()} expects {i.name!r}"
        )
    if X.dtype != W.dtype:
        raise AxisError(f"conv: X {X.describe()} and W {W.describe()} have different dtypes")
    strides = tuple(stride) if isinstance(stride, tuple | list) else (stride,) * n
    if len(strides) != n or any(not isinstance(s, int) or s < 1 for s in strides):
        raise AxisError(f"conv: strides must be {n} positive ints, got {stride!r}")
    pads = _padding(padding, tuple(ks), strides)
    for x, k, (lo, hi) in zip(xs, ks, pads, strict=True):
        gap = x.size + lo + hi - k.size
        if gap.is_number and gap < 0:
            raise AxisError(_too_large(X, W, x.name, k.name, lo, hi))
    outs = out or (None,) * n
    ys = [_output_axis(*args) for args in zip(xs, ks, strides, *zip(*pads, strict=True), outs, strict=True)]
    Y = X.with_(axes=(*batch, o, *ys))
    spatial = tuple((x.name, k.name, y.name) for x, k, y in zip(xs, ks, ys, strict=True))
    name = "conv " + "×".join(k.name for k in ks) + ("" if set(strides) == {1} else f" /{','.join(map(str, strides))}")
    data = (("channels", (i.name, o.name)), ("spatial", spatial), ("stride", strides), ("padding", pads))
    return Conv(name, Ty(X, W), Ty(Y), data=data)


class Concat(Generator):
    """Concatenation along one axis: ``A[..., a, ...] ⊗ B[..., b, ...] → C[..., c, ...]`` with ``c = a + b``.

    The inputs broadcast by name to the output's other axes (a class token joins a batch of patches).
    """

    family = "relabel"

    def evaluate(self, ins, ctx):
        into, out = self.params["into"], self.out
        at = out.names.index(into)
        parts = []
        for v, wire, name in zip(ins, self.dom.inside, self.params["along"], strict=True):
            target = tuple(name if n == into else n for n in out.names)
            shape = [int(ctx.number(wire.axis(name).size)) if n == into else s
                     for n, s in zip(out.names, _sizes(ctx, out.axes), strict=True)]
            parts.append(jnp.broadcast_to(_layout(v, wire.names, target), shape).astype(out.dtype.jnp))
        return [jnp.concatenate(parts, axis=at)]


def concat(A: Array, B: Array, a: Axis | str, b: Axis | str, into: Axis) -> Concat:
    """Concatenate ``A`` along ``a`` and ``B`` along ``b`` into the axis ``into`` (``into.size = a + b``).

    The output has ``A``'s axes with ``a`` replaced by ``into``; ``B``'s other axes must be among them.

    >>> from napkin_cat import axes, Array
    >>> n, d, one = axes("n d one", one=1)
    >>> m = Axis("m", n.size + 1)
    >>> print(concat(Array(one, d), Array(n, d), one, n, into=m).cod)
    m×d
    >>> concat(Array(one, d), Array(n, d), one, n, into=n)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: concat: 'one' + 'n' of one×d:f32@HBM ⊗ n×d:f32@HBM has size n + 1, but 'n' has size n
    """
    an, bn = (getattr(v, "name", v) for v in (a, b))
    total = A.axis(an).size + B.axis(bn).size
    if sympy.simplify(into.size - total) != 0:
        raise AxisError(
            f"concat: {an!r} + {bn!r} of {A.describe()} ⊗ {B.describe()} has size {total}, "
            f"but {into.name!r} has size {into.size}"
        )
    C = A.with_(axes=[into if x.name == an else x for x in A.axes])
    extra = [x.name for x in B.axes if x.name != bn and x not in C.axes]
    if extra:
        raise AxisError(f"concat: axes {extra} of B {B.describe()} are not in the output {C.describe()}")
    return Concat(f"concat {into.name}", Ty(A, B), Ty(C), data=(("along", (an, bn)), ("into", into.name)))


class Rename(Generator):
    """The same array under another axis name (self-attention's queries and keys index one sequence)."""

    family = "relabel"

    def evaluate(self, ins, ctx):
        return list(ins)

    def backward(self, t, ins, outs, cts):
        """The cotangent renamed back."""
        p = self.params
        return [t(rename(t.ty(cts[0]), p["new"], self.dom.inside[0].axis(p["old"])), cts[0])]


def rename(A: Array, old: Axis | str, new: Axis) -> Rename:
    """Rename axis ``old`` of ``A`` to ``new`` (same size); free, and a no-op on the data.

    >>> from napkin_cat import axes, Array
    >>> n, d = axes("n d")
    >>> print(rename(Array(n, d), n, Axis("m", n.size)).cod)
    m×d
    >>> rename(Array(n, d), n, Axis("m"))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: rename n → m: sizes differ (n ≠ m) in n×d:f32@HBM
    """
    name = getattr(old, "name", old)
    size = A.axis(name).size
    if sympy.simplify(size - new.size) != 0:
        raise AxisError(f"rename {name} → {new.name}: sizes differ ({size} ≠ {new.size}) in {A.describe()}")
    B = A.with_(axes=[new if x.name == name else x for x in A.axes])
    return Rename(f"{name} → {new.name}", Ty(A), Ty(B), data=(("old", name), ("new", new.name)))
