"""Elementwise maps (named or a user's callable, broadcast by axis name) and casts.

A named map is the namespace's function of that name (``ctx.xp.exp``), so the reference semantics,
the kernel body and the symbolic proofs evaluate the same name; a user's callable is applied to whole
arrays by JAX and element by element by sympy.

>>> from napkin_cat import axes, Array
>>> q, d = axes("q d")
>>> print(elementwise("add", Array(q, d), Array(d)).cod)
q×d
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import sympy

from napkin_cat.diagram import Array, Template, Ty, as_ty
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.dtypes import dtype as as_dtype
from napkin_cat.errors import AxisError, NapkinError
from napkin_cat.generators._arrays import JAX
from napkin_cat.generators._base import Generator, align, fname
from napkin_cat.generators._vectors import plain

#: name: (flops per element, transcendentals per element); the function is ``ctx.xp.<name>``
ELEMENTWISE: dict[str, tuple[int, int]] = {
    "exp": (0, 1),
    "log": (0, 1),
    "tanh": (0, 1),
    "sigmoid": (2, 1),
    "gelu": (8, 1),
    "silu": (3, 1),
    "relu": (1, 0),
    "neg": (1, 0),
    "square": (1, 0),
    "sqrt": (0, 1),
    "rsqrt": (0, 1),
    "reciprocal": (1, 0),
    "add": (1, 0),
    "subtract": (1, 0),
    "multiply": (1, 0),
    "divide": (1, 0),
    "maximum": (1, 0),
}
INFIX = {"add": "+", "subtract": "−", "multiply": "·", "divide": "/"}
SYMBOLS = {"exp": "E", "log": "L", "square": "X2", "rsqrt": "R"}


def _number(c) -> str:
    return f"{float(c):g}" if c.is_Float else sympy.sstr(c)


@dataclass(frozen=True)
class Partial:
    """``g · ∂fn/∂argᵢ``, elementwise: called as ``(g, *args)`` with ``fn``'s arguments (and const).

    >>> p = Partial("tanh", 0)
    >>> p.__name__, float(p(jnp.float32(2.0), jnp.float32(0.0)))
    ('∂0 tanh', 2.0)
    """

    fn: str | Callable
    arg: int

    def __call__(self, ct, *args):
        f = getattr(JAX, self.fn) if isinstance(self.fn, str) else self.fn
        shape = jnp.broadcast_shapes(jnp.shape(ct), *map(jnp.shape, args))
        i, ct = self.arg, jnp.broadcast_to(ct, shape)
        _, pull = jax.vjp(lambda a: f(*args[:i], a, *args[i + 1 :]), jnp.broadcast_to(args[i], shape))
        return plain(lambda c: pull(c)[0])(ct)  # add_any as add: a kernel lowers it

    @property
    def __name__(self):
        return f"∂{self.arg} {fname(self.fn)}"


def _add(t, ct, ins, y, const):
    return [ct] * len(ins)


def _subtract(t, ct, ins, y, const):
    return [ct, t.ew("neg", ct)][: len(ins)]


def _multiply(t, ct, ins, y, const):
    if const is not None:
        return [t.ew("multiply", ct, const=const)]
    a, b = ins
    return [t.ew("multiply", ct, b, out=t.ty(ct)), t.ew("multiply", ct, a, out=t.ty(ct))]


def _divide(t, ct, ins, y, const):
    if const is not None:
        return [t.ew("divide", ct, const=const)]
    da = t.ew("divide", ct, ins[1], out=t.ty(ct))
    return [da, t.ew("neg", t.ew("multiply", da, y))]  # ∂(a/b)/∂b = −(a/b)/b


def _exp(t, ct, ins, y, const):
    return [t.ew("multiply", y, ct, out=t.ty(ct))]


def _neg(t, ct, ins, y, const):
    return [t.ew("neg", ct)]


#: named maps whose derivative is written as a diagram; the others differentiate through :class:`Partial`
DERIVATIVES = {"add": _add, "subtract": _subtract, "multiply": _multiply, "divide": _divide, "exp": _exp, "neg": _neg}


class Elementwise(Generator):
    """A pointwise map of one or more arrays, broadcast by axis name to the output's axes.

    >>> from napkin_cat import axes, gelu
    >>> gelu(Array(*axes("n"))).flops()
    8*n
    """

    family = "elementwise"

    @property
    def symbol(self) -> str:
        fn = self.params["fn"]
        return SYMBOLS.get(fn, "U") if isinstance(fn, str) else "U"

    def evaluate(self, ins, ctx):
        p, xp = self.params, ctx.xp
        fn = getattr(xp, p["fn"]) if isinstance(p["fn"], str) else xp.lift(p["fn"])
        args = [xp.f32(align(xp, v, w, self.out)) for v, w in zip(ins, self.dom.inside, strict=True)]
        if "const" in p:
            args.append(xp.asarray(ctx.number(p["const"])))
        return [xp.cast(fn(*args), self.out.dtype)]

    def flops(self):
        fn = self.params["fn"]
        return self.out.size * (ELEMENTWISE[fn][0] if isinstance(fn, str) else 1)

    def transcendentals(self):
        fn = self.params["fn"]
        return self.out.size * (ELEMENTWISE[fn][1] if isinstance(fn, str) else 0)

    def lines(self, prog, ins, outs):
        p = self.params
        fn = p["fn"]
        args = [prog.ix(v) for v in ins] + ([_number(p["const"])] if "const" in p else [])
        if fn == "maximum" and len(args) == 2:
            text = f"max({args[0]}, {args[1]})"
        elif isinstance(fn, str) and fn in INFIX and len(args) == 2:
            text = f"{args[0]} {INFIX[fn]} {args[1]}"
        else:
            text = f"{fn if isinstance(fn, str) else getattr(fn, '__name__', 'f')}({', '.join(args)})"
        return [(f"{prog.ix(outs[0])} = {text}", outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        (ct,), (y,), p = cts, outs, self.params
        fn, const = p["fn"], p.get("const")
        # a named map's rule, or the function's own (``fn.derivative``, same signature: one that reads fewer
        # values saves the backward their recomputation)
        rule = DERIVATIVES.get(fn) if isinstance(fn, str) else getattr(fn, "derivative", None)
        if rule is not None:
            parts = rule(t, ct, ins, y, const)
        else:  # integer and boolean inputs (ids, masks) have no cotangent: nothing is computed for them
            parts = [
                t.ew(Partial(fn, i), ct, *ins, const=const, out=t.ty(ct)) if _real(t.ty(x)) else None
                for i, x in enumerate(ins)
            ]
        return [
            None if v is None else t.unbroadcast(v, t.ty(x).with_(dtype=f32)) for v, x in zip(parts, ins, strict=True)
        ]

    def passes_base(self):
        """True where ``fn`` declares it (``fn.passes_base``): a mask of its first argument, such as
        ``where(keep, s, −∞)``, commutes with scaling the scores."""
        return bool(getattr(self.params["fn"], "passes_base", False))


def _real(a: Array) -> bool:
    """Whether a wire holds real numbers (so has a cotangent): not integers, not booleans."""
    return a.dtype.name not in ("i32", "bool")


def elementwise(fn: str | Callable, *arrays: Array, const=None, out: Array | None = None) -> Elementwise:
    """A pointwise map: ``fn`` names one of :data:`ELEMENTWISE` or is a JAX-traceable callable.

    Inputs broadcast by axis name to ``out`` (default: the input with the most axes).
    ``const`` is an extra scalar argument (a number or a sympy expression in the sizes).

    >>> from napkin_cat import axes, Array
    >>> q, d = axes("q d")
    >>> print(elementwise("add", Array(q, d), Array(d)).cod)
    q×d
    >>> elementwise("cube", Array(q))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.NapkinError: unknown elementwise function 'cube'; known: exp, log, tanh, sigmoid, gelu, \
silu, relu, neg, square, sqrt, rsqrt, reciprocal, add, subtract, multiply, divide, maximum
    """
    if isinstance(fn, str) and fn not in ELEMENTWISE:
        raise NapkinError(f"unknown elementwise function {fn!r}; known: {', '.join(ELEMENTWISE)}")
    out = out or max(arrays, key=lambda a: len(a.axes))
    for a in arrays:
        for ax in a.axes:
            if ax not in out.axes:
                raise AxisError(
                    f"{fname(fn)}: input {a.describe()} has axis {ax!r} that the output {out.describe()} lacks"
                )
    data = (("fn", fn),) + ((("const", sympy.sympify(const)),) if const is not None else ())
    name = fname(fn) + (f" {const}" if const is not None else "")
    return Elementwise(name, Ty(*arrays), Ty(out), data=data)


def _unary(fn: str, doc: str):
    def make(a: Array | Ty | None = None) -> Elementwise | Template:
        if a is None:
            return Template(make)
        return elementwise(fn, *as_ty(a).inside)

    make.__name__ = fn
    make.__doc__ = f"""{doc}

    Without an argument, a template for ``>>``:

    >>> from napkin_cat import axes, Array, id
    >>> print((id(Array(*axes("n"))) >> {fn}()).boxes[0].name)
    {fn}
    """
    return make


exp = _unary("exp", "Elementwise exponential ``exp(a)``.")
log = _unary("log", "Elementwise natural logarithm.")
relu = _unary("relu", "Elementwise ReLU.")
gelu = _unary("gelu", "Elementwise GELU (exact).")
silu = _unary("silu", "Elementwise SiLU.")
tanh = _unary("tanh", "Elementwise tanh.")
sqrt = _unary("sqrt", "Elementwise square root.")
rsqrt = _unary("rsqrt", "Elementwise reciprocal square root.")
square = _unary("square", "Elementwise square.")


def scale(a: Array, c) -> Elementwise:
    """Multiply by a constant ``c`` (a number or a sympy expression in the axis sizes).

    >>> from napkin_cat import axes, Array
    >>> (n,) = axes("n")
    >>> scale(Array(n), 1 / n.size).name
    'multiply 1/n'
    """
    return elementwise("multiply", a, const=c)


def _binary(fn: str, doc: str):
    def make(a: Array, b: Array) -> Elementwise:
        return elementwise(fn, a, b)

    make.__name__ = fn
    make.__doc__ = f"""{doc}

    >>> from napkin_cat import axes, Array
    >>> q, d = axes("q d")
    >>> print({fn}(Array(q, d), Array(d)).dom)
    q×d ⊗ d
    """
    return make


add = _binary("add", "Elementwise sum, broadcast by axis name.")
subtract = _binary("subtract", "Elementwise difference, broadcast by axis name.")
multiply = _binary("multiply", "Elementwise product, broadcast by axis name.")
divide = _binary("divide", "Elementwise quotient, broadcast by axis name.")


class Cast(Generator):
    """Change of dtype.

    >>> from napkin_cat import axes
    >>> cast(Array(*axes("n")), "bf16").family
    'relabel'
    """

    family = "relabel"

    def evaluate(self, ins, ctx):
        return [ctx.xp.cast(ins[0], self.out.dtype)]

    def lines(self, prog, ins, outs):
        return [(f"{prog.ix(outs[0])} = {outs[0].wire.dtype}({prog.ix(ins[0])})", outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        return list(cts)  # cotangents are f32 on both sides


def cast(a: Array, to: Dtype | str) -> Cast:
    """Cast an array to another dtype.

    >>> from napkin_cat import axes, Array
    >>> cast(Array(*axes("n")), "bf16").cod
    Ty(Array(Axis('n'), dtype=bf16))
    """
    to = as_dtype(to)
    return Cast(f"cast {to}", Ty(a), Ty(a.with_(dtype=to)))
