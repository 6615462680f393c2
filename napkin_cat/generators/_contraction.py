"""Linear contraction: an einsum over named axes with an optional scale, and its split-K accumulator.

>>> from napkin_cat import axes
>>> q, x, d = axes("q x d")
>>> s = contract("q d, x d -> q x", q, x, d)
>>> print(s.dom, "→", s.cod)
q×d ⊗ x×d → q×x
>>> s.flops()
2*d*q*x
"""

from __future__ import annotations

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.errors import AxisError, NapkinError
from napkin_cat.generators._base import Accumulator, Generator, contraction_size, einsum_spec
from napkin_cat.levels import HBM


def scale_text(box: Generator) -> str:
    """`` · c`` for a box carrying a scale ``c``, else empty (pseudocode).

    >>> from napkin_cat import axes
    >>> (n,) = axes("n")
    >>> scale_text(contract("n -> n", n, scale=2))
    ' · 2'
    """
    scale = box.params.get("scale")
    return "" if scale is None else f" · {sympy.sstr(scale)}"


def sum_of_products(prog, ins: list, over: tuple) -> str:
    """``Σ_over A[..]·B[..]`` (pseudocode of a contraction)."""
    product = "·".join(prog.ix(v) for v in ins)
    return f"Σ_{''.join(over)} {product}" if over else product


class Contract(Generator):
    """Einsum over named axes with an optional scale; accumulates in f32 (FAN: 2·k flops per output).

    >>> from napkin_cat import axes
    >>> a, b, c = axes("a b c")
    >>> contract("a b, b c -> a c", a, b, c).tensor_flops()
    2*a*b*c
    """

    family, contracts = "contraction", True

    @property
    def symbol(self) -> str:
        """``S`` for scores (an f32 product of two operands), ``T`` for any other contraction."""
        return "S" if self.out.dtype.bits == 32 and len(self.dom) == 2 else "T"

    def evaluate(self, ins, ctx):
        acc = ctx.xp.einsum(einsum_spec(self.dom, self.out), *ins)
        scale = self.params.get("scale")
        if scale is not None:
            acc = acc * ctx.number(scale)
        return [ctx.xp.cast(acc, self.out.dtype)]

    def flops(self):
        extra = self.out.size if self.params.get("scale") is not None else 0
        return self.tensor_flops() + extra

    def tensor_flops(self):
        return 2 * contraction_size(*self.dom.inside, self.out) * max(len(self.dom) - 1, 1)

    def accumulator(self, axis):
        return ContractionSum(self, axis) if axis in self.reduced else None

    def scaled(self, c):
        return type(self)(self.name, self.dom, self.cod, data=(("scale", self.params.get("scale", 1) * c),))

    def unscaled(self):
        scale = self.params.get("scale")
        kept = tuple(kv for kv in self.data if kv[0] != "scale")
        return None if scale is None else (type(self)(self.name, self.dom, self.cod, data=kept), scale)

    def lines(self, prog, ins, outs):
        text = f"{prog.ix(outs[0])} = {sum_of_products(prog, ins, self.reduced)}{scale_text(self)}"
        return [(text, outs, ins)]

    def backward(self, t, ins, outs, cts):
        return [t.transpose(list(ins), i, cts[0], self.params.get("scale")) for i in range(len(ins))]


class ContractionSum(Accumulator):
    """A contraction over the streamed axis (split-K): the state is the partial sum, in f32.

    >>> from napkin_cat import axes
    >>> a, b = axes("a b")
    >>> contract("a b -> a", a, b).accumulator("b").padding
    (0.0,)
    """

    @property
    def padding(self):
        return (0.0,) * len(self.box.dom)

    def partial(self, ins, ctx):
        return ctx.xp.einsum(einsum_spec(self.box.dom, self.box.out), *ins)

    def combine(self, a, b, ctx):
        return a + b

    def finalize(self, state, ctx):
        scale = self.box.params.get("scale")
        if scale is not None:
            state = state * ctx.number(scale)
        return [ctx.xp.cast(state, self.box.out.dtype)]

    def identity(self, like, ctx):
        return ctx.xp.full(like.shape, 0)

    def lines(self, prog, ins, outs):
        out, ix = outs[0], prog.ix
        a = prog.state(f"acc_{out.name}", out.wire)
        return (
            [(f"{ix(a)} = 0", [a], [])],
            [(f"{ix(a)} += {sum_of_products(prog, ins, self.box.reduced)}", [], [a, *ins])],
            [(f"{ix(out)} = {ix(a)}{scale_text(self.box)}", [out], [a], False, True)],
        )


def contract(spec: str, *axes: Axis, scale=None, dtype: Dtype | str = f32, out_dtype=None, level=HBM) -> Contract:
    """A linear contraction (einsum) named by axis names: ``"q d, x d -> q x"``.

    ``axes`` resolve the names (two axes of one name must be the same axis); ``dtype`` is the inputs'
    dtype (or a tuple, one per input), ``out_dtype`` the output's (default: the first input's).
    ``scale`` may be a sympy expression.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> contract("q x, x d -> q d", q, x, d).name
    'q x, x d → q d'
    >>> contract("q e -> q", q)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: contract 'q e -> q': axis 'e' is not among the axes given (q)
    >>> contract("q d, d -> q", q, Axis("d", 4), Axis("d", 8))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: contract 'q d, d -> q': two axes are named 'd' with different sizes (4 and 8)
    >>> contract("q d -> x -> q", q, d)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: contract 'q d -> x -> q': the spec needs exactly one '->', e.g. 'q d, x d -> q x'
    """
    by_name: dict[str, Axis] = {}
    for a in axes:
        if by_name.setdefault(a.name, a) != a:
            raise AxisError(
                f"contract {spec!r}: two axes are named {a.name!r} with different sizes ({by_name[a.name].size} and "
                f"{a.size})"
            )
    if spec.count("->") != 1:
        raise AxisError(f"contract {spec!r}: the spec needs exactly one '->', e.g. 'q d, x d -> q x'")
    lhs, rhs = spec.split("->")
    operands = [part.split() for part in lhs.split(",")]
    result = rhs.split()
    for names in (*operands, result):
        for n in names:
            if n not in by_name:
                raise AxisError(
                    f"contract {spec!r}: axis {n!r} is not among the axes given ({', '.join(by_name) or 'none'})"
                )
        if len(set(names)) != len(names):
            raise AxisError(f"contract {spec!r}: axis repeated in operand {' '.join(names)!r}")
    for n in result:
        if not any(n in names for names in operands):
            raise AxisError(f"contract {spec!r}: output axis {n!r} appears in no input")
    dtypes = dtype if isinstance(dtype, tuple | list) else (dtype,) * len(operands)
    if len(dtypes) != len(operands):
        raise NapkinError(f"contract {spec!r}: {len(dtypes)} dtypes for {len(operands)} inputs")
    dom = Ty(
        *(Array(*(by_name[n] for n in names), dtype=t, level=level) for names, t in zip(operands, dtypes, strict=True))
    )
    cod = Ty(Array(*(by_name[n] for n in result), dtype=out_dtype or dtypes[0], level=level))
    name = ", ".join(" ".join(o) for o in operands) + " → " + " ".join(result)
    data = (("scale", sympy.sympify(scale)),) if scale is not None else ()
    return Contract(name, dom, cod, data=data)
