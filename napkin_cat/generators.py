"""Generators: the boxes diagrams are built from, each with its semantics, cost and accumulator.

Every generator is polymorphic in its axes: its semantics is written over *named* axes, so weaving
(prepending axes to every wire) and the partition labels need nothing from the generator itself.
A generator declares

* ``evaluate(inputs, ctx)`` — its JAX semantics on arrays laid out as its wires' axes;
* ``flops()``, ``transcendentals()`` — its cost, sympy expressions in the axis sizes;
* ``accumulator(axis)`` — where it is streamable along ``axis`` (FAN §3), its accumulator.

>>> from napkin_cat import axes, Array
>>> q, x, d = axes("q x d")
>>> s = contract("q d, x d -> q x", q, x, d)
>>> print(s.dom, "→", s.cod)
q×d ⊗ x×d → q×x
>>> s.flops()
2*d*q*x
>>> softmax(Array(q, x), x).accumulator("x") is None  # softmax alone leaves x unreduced
True
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import sympy

from napkin_cat.accumulators import Accumulator, ContractionSum, Monoid, NormalisedContraction, OnlineSoftmax
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Box, Template, Ty, as_ty
from napkin_cat.dtypes import Dtype, f32
from napkin_cat.dtypes import dtype as as_dtype
from napkin_cat.errors import AxisError, NapkinError
from napkin_cat.levels import HBM


@dataclass
class Context:
    """What a generator's semantics may read besides its inputs.

    ``sizes`` binds the size symbols to integers; ``offsets`` gives, per axis name, the global index of
    the first element of the block being evaluated (0 in the reference semantics; a tile's or chunk's
    start inside a scheduled loop or a kernel).
    """

    sizes: dict = field(default_factory=dict)
    offsets: dict = field(default_factory=dict)
    einsum: Callable = field(default=None)
    exp: Callable = field(default=jnp.exp)

    def __post_init__(self):
        if self.einsum is None:
            self.einsum = lambda spec, *xs: jnp.einsum(spec, *xs, preferred_element_type=jnp.float32)

    def at(self, **offsets) -> Context:
        """This context with some block offsets replaced."""
        return Context(self.sizes, {**self.offsets, **offsets}, self.einsum, self.exp)

    def number(self, expr) -> float:
        value = sympy.sympify(expr).subs(self.sizes)
        if not value.is_number:
            raise NapkinError(f"cannot evaluate {expr}: unbound sizes {sorted(map(str, value.free_symbols))}")
        return float(value)

    def indices(self, wire: Array, shape: tuple) -> dict:
        """Global index of every element along each axis of ``wire``, broadcastable to ``shape``."""
        return {
            a.name: jax.lax.broadcasted_iota(jnp.int32, shape, i) + self.offsets.get(a.name, 0)
            for i, a in enumerate(wire.axes)
        }


def _letters(*wires: Array) -> dict:
    names = dict.fromkeys(n for w in wires for n in w.names)
    if len(names) > len(string.ascii_letters):
        raise AxisError(f"too many distinct axes ({len(names)}) for one einsum")
    return dict(zip(names, string.ascii_letters, strict=False))


def einsum_spec(dom: Ty, cod: Array) -> str:
    """The ``jnp.einsum`` equation of a contraction from its wires' axis names."""
    letters = _letters(*dom.inside, cod)
    term = lambda w: "".join(letters[n] for n in w.names)  # noqa: E731
    return ",".join(map(term, dom.inside)) + "->" + term(cod)


def _align(value, wire: Array, target: Array):
    """Broadcast ``value`` (laid out as ``wire``) to the axis order of ``target``, by axis name."""
    if wire.names == target.names:
        return value
    missing = [n for n in wire.names if n not in target.names]
    if missing:
        raise AxisError(f"cannot broadcast {wire.describe()} to {target.describe()}: extra axes {missing}")
    order = [wire.names.index(n) for n in target.names if n in wire.names]
    value = jnp.transpose(value, order)
    return jnp.expand_dims(value, [i for i, n in enumerate(target.names) if n not in wire.names])


def contraction_size(*wires: Array) -> sympy.Expr:
    """The product of the sizes of every distinct axis on ``wires``: the multiply-adds of a contraction."""
    return sympy.Mul(*{a.name: a.size for w in wires for a in w.axes}.values())


class Generator(Box):
    """Base class of the generators. ``data`` is a tuple of ``(key, value)`` parameters."""

    @property
    def params(self) -> dict:
        return dict(self.data or ())

    @property
    def out(self) -> Array:
        return self.cod.inside[0]

    @property
    def reduced(self) -> tuple[str, ...]:
        """Axes of the inputs that the output lacks (the axes this box removes)."""
        kept = {n for w in self.cod.inside for n in w.names}
        return tuple(dict.fromkeys(n for w in self.dom.inside for n in w.names if n not in kept))

    @property
    def mixes(self) -> tuple[str, ...]:
        """Axes along which this box combines elements (it needs them whole unless it streams them)."""
        return self.reduced

    def evaluate(self, ins: list, ctx: Context) -> list:
        raise NotImplementedError(type(self).__name__)

    def flops(self) -> sympy.Expr:
        return sympy.Integer(0)

    def transcendentals(self) -> sympy.Expr:
        return sympy.Integer(0)

    def accumulator(self, axis: str) -> Accumulator | None:
        """The accumulator streaming this box along ``axis``, or None if it is not streamable there."""
        return None

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, {self.dom!r}, {self.cod!r}, data={self.data!r})"


# --- linear contraction -----------------------------------------------------------------------


class Contract(Generator):
    """Einsum over named axes with an optional scale; accumulates in f32 (FAN: 2·k flops per output)."""

    def evaluate(self, ins, ctx):
        scale = self.params.get("scale")
        acc = ctx.einsum(einsum_spec(self.dom, self.out), *ins)
        if scale is not None:
            acc = acc * ctx.number(scale)
        return [acc.astype(self.out.dtype.jnp)]

    def flops(self):
        total = contraction_size(*self.dom.inside, self.out)
        extra = self.out.size if self.params.get("scale") is not None else 0
        return 2 * total * max(len(self.dom) - 1, 1) + extra

    def accumulator(self, axis):
        return ContractionSum(self, axis) if axis in self.reduced else None


def contract(spec: str, *axes: Axis, scale=None, dtype: Dtype | str = f32, out_dtype=None, level=HBM) -> Contract:
    """A linear contraction (einsum) named by axis names: ``"q d, x d -> q x"``.

    ``axes`` resolve the names; ``dtype`` is the inputs' dtype (or a tuple, one per input),
    ``out_dtype`` the output's (default: the first input's). ``scale`` may be a sympy expression.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> contract("q x, x d -> q d", q, x, d).name
    'q x, x d → q d'
    >>> contract("q e -> q", q)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: contract 'q e -> q': axis 'e' is not among the axes given (q)
    """
    by_name = {a.name: a for a in axes}
    if "->" not in spec:
        raise AxisError(f"contract {spec!r}: the spec needs '->' and an output, e.g. 'q d, x d -> q x'")
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


# --- elementwise maps -------------------------------------------------------------------------

# name: (jnp function, flops per element, transcendentals per element)
ELEMENTWISE: dict[str, tuple[Callable, int, int]] = {
    "exp": (jnp.exp, 0, 1),
    "log": (jnp.log, 0, 1),
    "tanh": (jnp.tanh, 0, 1),
    "sigmoid": (jax.nn.sigmoid, 2, 1),
    "gelu": (lambda v: jax.nn.gelu(v, approximate=False), 8, 1),
    "silu": (jax.nn.silu, 3, 1),
    "relu": (jax.nn.relu, 1, 0),
    "neg": (jnp.negative, 1, 0),
    "square": (jnp.square, 1, 0),
    "sqrt": (jnp.sqrt, 0, 1),
    "rsqrt": (jax.lax.rsqrt, 0, 1),
    "reciprocal": (jnp.reciprocal, 1, 0),
    "add": (jnp.add, 1, 0),
    "subtract": (jnp.subtract, 1, 0),
    "multiply": (jnp.multiply, 1, 0),
    "divide": (jnp.divide, 1, 0),
    "maximum": (jnp.maximum, 1, 0),
}


class Elementwise(Generator):
    """A pointwise map of one or more arrays, broadcast by axis name to the output's axes."""

    def evaluate(self, ins, ctx):
        p = self.params
        fn = p["fn"] if callable(p["fn"]) else ELEMENTWISE[p["fn"]][0]
        args = [_align(v, w, self.out) for v, w in zip(ins, self.dom.inside, strict=True)]
        if "const" in p:
            args.append(jnp.asarray(ctx.number(p["const"]), jnp.float32))
        out = fn(*(a.astype(jnp.float32) if a.dtype != jnp.float32 else a for a in args))
        return [out.astype(self.out.dtype.jnp)]

    def flops(self):
        fn = self.params["fn"]
        return self.out.size * (ELEMENTWISE[fn][1] if isinstance(fn, str) else 1)

    def transcendentals(self):
        fn = self.params["fn"]
        return self.out.size * (ELEMENTWISE[fn][2] if isinstance(fn, str) else 0)


def elementwise(fn: str | Callable, *arrays: Array, const=None, out: Array | None = None) -> Elementwise:
    """A pointwise map: ``fn`` names one of :data:`ELEMENTWISE` or is a JAX-traceable callable.

    Inputs broadcast by axis name to ``out`` (default: the input with the most axes).
    ``const`` is an extra scalar argument (a number or a sympy expression in the sizes).

    >>> from napkin_cat import axes, Array
    >>> q, d = axes("q d")
    >>> print(elementwise("add", Array(q, d), Array(d)).cod)
    q×d
    """
    if isinstance(fn, str) and fn not in ELEMENTWISE:
        raise NapkinError(f"unknown elementwise function {fn!r}; known: {', '.join(ELEMENTWISE)}")
    out = out or max(arrays, key=lambda a: len(a.axes))
    for a in arrays:
        for ax in a.axes:
            if ax not in out.axes:
                raise AxisError(
                    f"{_fname(fn)}: input {a.describe()} has axis {ax!r} that the output {out.describe()} lacks"
                )
    data = (("fn", fn),) + ((("const", sympy.sympify(const)),) if const is not None else ())
    name = _fname(fn) + (f" {const}" if const is not None else "")
    return Elementwise(name, Ty(*arrays), Ty(out), data=data)


def _fname(fn) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))


def _unary(fn: str, doc: str):
    def make(a: Array | Ty | None = None):
        if a is None:
            return Template(make)
        return elementwise(fn, *as_ty(a).inside)

    make.__name__, make.__doc__ = fn, doc
    return make


exp = _unary("exp", "Elementwise exponential ``exp(a)`` (a template without an argument).")
log = _unary("log", "Elementwise natural logarithm.")
relu = _unary("relu", "Elementwise ReLU.")
gelu = _unary("gelu", "Elementwise GELU (exact).")
silu = _unary("silu", "Elementwise SiLU.")
tanh = _unary("tanh", "Elementwise tanh.")
sqrt = _unary("sqrt", "Elementwise square root.")
rsqrt = _unary("rsqrt", "Elementwise reciprocal square root.")
square = _unary("square", "Elementwise square.")


def scale(a: Array, c) -> Elementwise:
    """Multiply by a constant ``c`` (a number or a sympy expression in the axis sizes)."""
    return elementwise("multiply", a, const=c)


def add(a: Array, b: Array) -> Elementwise:
    """Elementwise sum, broadcast by axis name."""
    return elementwise("add", a, b)


def subtract(a: Array, b: Array) -> Elementwise:
    """Elementwise difference, broadcast by axis name."""
    return elementwise("subtract", a, b)


def multiply(a: Array, b: Array) -> Elementwise:
    """Elementwise product, broadcast by axis name."""
    return elementwise("multiply", a, b)


def divide(a: Array, b: Array) -> Elementwise:
    """Elementwise quotient, broadcast by axis name."""
    return elementwise("divide", a, b)


class Cast(Generator):
    """Change of dtype."""

    def evaluate(self, ins, ctx):
        return [ins[0].astype(self.out.dtype.jnp)]


def cast(a: Array, to: Dtype | str) -> Cast:
    """Cast an array to another dtype.

    >>> from napkin_cat import axes, Array
    >>> cast(Array(*axes("n")), "bf16").cod
    Ty(Array(Axis('n'), dtype=bf16))
    """
    to = as_dtype(to)
    return Cast(f"cast {to}", Ty(a), Ty(a.with_(dtype=to)))


# --- index-dependent maps: masks and score modifiers ------------------------------------------


class IndexMap(Generator):
    """A pointwise map that reads the global indices of the elements (FlexAttention's ``score_mod``).

    ``fn(value, **indices)`` gets the value and, per axis name, the index along that axis.
    """

    def evaluate(self, ins, ctx):
        (v,) = ins
        fn = self.params["fn"]
        idx = _wanted(fn, ctx.indices(self.dom.inside[0], v.shape))
        return [fn(v.astype(jnp.float32), **idx).astype(self.out.dtype.jnp)]

    def flops(self):
        return self.out.size


class Mask(Generator):
    """Keep a score where ``mask(**indices)`` holds, else ``-inf`` (FlexAttention's ``mask_mod``)."""

    def evaluate(self, ins, ctx):
        (v,) = ins
        keep = self.params["mask"](**_wanted(self.params["mask"], ctx.indices(self.dom.inside[0], v.shape)))
        return [jnp.where(keep, v, -jnp.inf).astype(self.out.dtype.jnp)]

    def flops(self):
        return self.out.size


def _index_names(fn) -> tuple[str, ...] | None:
    """The parameter names of an index function, or None when it takes ``**kwargs`` (or hides them)."""
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return None
    return tuple(params)


def _wanted(fn, indices: dict) -> dict:
    """The indices ``fn`` asks for by name (all of them if it takes ``**kwargs``), so weaving adds none."""
    names = _index_names(fn)
    return indices if names is None else {k: v for k, v in indices.items() if k in names}


@dataclass(frozen=True)
class Causal:
    """The causal mask: query ``q`` sees key ``x`` when ``x ≤ q`` (top-left aligned, as ``jax.nn``)."""

    q: str
    x: str

    def __call__(self, **idx):
        return idx[self.x] <= idx[self.q]

    @property
    def __signature__(self):
        import inspect

        return inspect.Signature([inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY) for n in (self.q, self.x)])

    @property
    def __name__(self):
        return f"causal({self.q} ≥ {self.x})"


def score_mod(a: Array, fn: Callable) -> IndexMap:
    """An index-dependent score modifier ``fn(score, **indices)``.

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> def alibi(s, q, x): return s - 0.5 * abs(q - x)
    >>> score_mod(Array(q, x), alibi).name
    'score_mod alibi'
    """
    _check_index_names(fn, a, "score_mod")
    return IndexMap(f"score_mod {_fname(fn)}", Ty(a), Ty(a), data=(("fn", fn),))


def mask(a: Array, keep: Callable) -> Mask:
    """Mask scores where ``keep(**indices)`` is false (they become ``-inf``)."""
    _check_index_names(keep, a, "mask")
    return Mask(f"mask {_fname(keep)}", Ty(a), Ty(a), data=(("mask", keep),))


def causal_mask(a: Array, q: Axis | str, x: Axis | str) -> Mask:
    """The causal mask on scores ``a`` indexed by queries ``q`` and keys ``x``."""
    qn, xn = (getattr(v, "name", v) for v in (q, x))
    for n in (qn, xn):
        a.axis(n)
    return mask(a, Causal(qn, xn))


def _check_index_names(fn, a: Array, rule: str):
    names = _index_names(fn)
    if names is None:
        return
    wanted = names[1:] if rule == "score_mod" else names  # a score modifier's first argument is the score
    unknown = [n for n in wanted if n not in a.names]
    if unknown:
        raise AxisError(f"{rule} {_fname(fn)}: indices {unknown} are not axes of {a.describe()}")


# --- reductions and softmax -------------------------------------------------------------------

_REDUCE = {"sum": (jnp.sum, 0.0), "max": (jnp.max, -jnp.inf), "min": (jnp.min, jnp.inf)}


class Reduce(Generator):
    """Sum, max or min over one axis; a monoid, so streamable along it."""

    def evaluate(self, ins, ctx):
        op, axis = self.params["op"], self.params["axis"]
        (v,) = ins
        i = self.dom.inside[0].names.index(axis)
        fn, _ = _REDUCE[op]
        return [fn(v.astype(jnp.float32), axis=i).astype(self.out.dtype.jnp)]

    def flops(self):
        return self.dom.inside[0].size

    def accumulator(self, axis):
        if axis != self.params["axis"]:
            return None
        return Monoid(self, axis, *_REDUCE[self.params["op"]])


def _reduce(op: str):
    def make(a: Array | Axis, axis: Axis | str | None = None):
        if isinstance(a, Axis | str):
            return Template(make, a)
        name = getattr(axis, "name", axis)
        if not a.has(name):
            raise AxisError(f"{op} over {name!r}: array {a.describe()} has no such axis")
        out = a.with_(axes=[ax for ax in a.axes if ax.name != name])
        return Reduce(f"{op} {name}", Ty(a), Ty(out), data=(("op", op), ("axis", name)))

    make.__name__ = f"reduce_{op}"
    make.__doc__ = f"The {op} of an array over one axis: ``{op}(array, axis)``, or ``{op}(axis)`` as a template."
    return make


reduce_sum = _reduce("sum")
reduce_max = _reduce("max")
reduce_min = _reduce("min")


def _safe_softmax(v, i):
    m = jnp.max(v, axis=i, keepdims=True)
    m = jnp.where(jnp.isneginf(m), 0.0, m)
    e = jnp.exp(v - m)
    z = jnp.sum(e, axis=i, keepdims=True)
    return e / jnp.where(z == 0, 1.0, z)  # fully masked rows give 0, never NaN


class Softmax(Generator):
    """Softmax over one axis, in f32. Not streamable alone: its output keeps the axis."""

    @property
    def mixes(self):
        return (self.params["axis"],)

    def evaluate(self, ins, ctx):
        (v,) = ins
        i = self.dom.inside[0].names.index(self.params["axis"])
        return [_safe_softmax(v.astype(jnp.float32), i).astype(self.out.dtype.jnp)]

    def flops(self):
        return 4 * self.out.size  # max, subtract, sum, divide

    def transcendentals(self):
        return self.out.size


def softmax(a: Array | Axis, axis: Axis | str | None = None) -> Softmax:
    """Softmax of an array over ``axis``; ``softmax(axis)`` alone is a template for ``>>``.

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> softmax(Array(q), x)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: softmax over 'x': array q:f32@HBM has no such axis
    """
    if isinstance(a, Axis | str):
        return Template(softmax, a)
    name = getattr(axis, "name", axis)
    if not a.has(name):
        raise AxisError(f"softmax over {name!r}: array {a.describe()} has no such axis")
    return Softmax(f"softmax {name}", Ty(a), Ty(a.with_(dtype=f32)), data=(("axis", name),))


class SoftmaxContract(Generator):
    """Softmax over ``axis`` followed by a contraction over it (FAN's softmax-contraction lemma).

    Inputs: scores ``s`` and values ``v``, both indexed by ``axis``; output ``softmax(s) · v``.
    Streamable along ``axis`` with the online-softmax accumulator (running max, sum and rescaling).
    """

    def evaluate(self, ins, ctx):
        s, v = ins
        axis = self.params["axis"]
        s = s.astype(jnp.float32) * (jnp.log(2.0) if self.params.get("base") == 2 else 1.0)
        i = self.dom.inside[0].names.index(axis)
        p = _safe_softmax(s, i)
        p = p.astype(v.dtype) if v.dtype != jnp.float32 else p
        dom = Ty(self.dom.inside[0].with_(dtype=f32), self.dom.inside[1])
        out = [ctx.einsum(einsum_spec(dom, self.out), p, v).astype(self.out.dtype.jnp)]
        if len(self.cod) == 2:  # with the log-sum-exp residual; +inf on fully masked rows
            lse = jax.nn.logsumexp(s, axis=i)
            out.append(jnp.where(jnp.isneginf(lse), jnp.inf, lse))
        return out

    def flops(self):
        s, v = self.dom.inside
        return 4 * s.size + 2 * contraction_size(s, v, self.out)

    def transcendentals(self):
        return self.dom.inside[0].size

    def accumulator(self, axis):
        return OnlineSoftmax(self, axis) if axis == self.params["axis"] else None


def softmax_contract(s: Array, v: Array, axis: Axis | str, out: Array) -> SoftmaxContract:
    """The fused ``softmax(s, axis)`` then contraction with ``v`` over ``axis``, giving ``out``."""
    name = getattr(axis, "name", axis)
    for w in (s, v):
        if not w.has(name):
            raise AxisError(f"softmax_contract over {name!r}: {w.describe()} lacks the axis")
    return SoftmaxContract(f"softmax·contract {name}", Ty(s, v), Ty(out), data=(("axis", name),))


class NormalisedContract(Generator):
    """A normalised contraction (spherical-attention paper): ``N(s)ᵢ = a₁(sᵢ) / b(Σⱼ a₂(sⱼ))``, then
    contraction with ``v`` over the axis. Streamable: accumulate ``Σ a₂`` and ``Σ a₁(s)·v``.
    ``a1``, ``a2``, ``b`` are JAX-traceable callables (hashable, e.g. module-level functions).
    """

    def evaluate(self, ins, ctx):
        acc = NormalisedContraction(self, self.params["axis"])
        return acc.finalize(acc.partial(ins, ctx), ctx)

    def flops(self):
        s, v = self.dom.inside
        return 3 * s.size + 2 * contraction_size(s, v, self.out)

    def transcendentals(self):
        return self.dom.inside[0].size

    def accumulator(self, axis):
        return NormalisedContraction(self, axis) if axis == self.params["axis"] else None


def normalised_contract(s: Array, v: Array, axis: Axis | str, out: Array, *, a1, a2, b) -> NormalisedContract:
    """A normalised contraction along ``axis`` (softmax without the max shift is ``a1=a2=exp, b=id``)."""
    name = getattr(axis, "name", axis)
    for w in (s, v):
        if not w.has(name):
            raise AxisError(f"normalised_contract over {name!r}: {w.describe()} lacks the axis")
    data = (("axis", name), ("a1", a1), ("a2", a2), ("b", b))
    return NormalisedContract(f"normalised·contract {name}", Ty(s, v), Ty(out), data=data)


# --- structure: reshapes and moves between memory levels --------------------------------------


class Reshape(Generator):
    """Split one axis into two (row-major) or merge two adjacent axes into one."""

    @property
    def mixes(self):
        """The axes split or merged, and the ones they become."""
        dom, cod = self.dom.inside[0].names, self.out.names
        return tuple(n for n in (*dom, *cod) if (n in dom) != (n in cod))

    def evaluate(self, ins, ctx):
        (v,) = ins
        p = self.params
        if "axis" in p:  # split: the axis becomes (-1, inner)
            i = self.dom.inside[0].names.index(p["axis"])
            inner = int(ctx.number(self.out.axes[i + 1].size))
            return [v.reshape(*v.shape[:i], -1, inner, *v.shape[i + 1 :])]
        i = self.dom.inside[0].names.index(p["merge"])
        return [v.reshape(*v.shape[:i], v.shape[i] * v.shape[i + 1], *v.shape[i + 2 :])]


def split(a: Array, axis: Axis | str, outer: Axis, inner: Axis) -> Reshape:
    """Split ``axis`` into ``outer × inner`` (row-major); sizes must multiply to the axis size."""
    name = getattr(axis, "name", axis)
    old = a.axis(name)
    if sympy.simplify(outer.size * inner.size - old.size) != 0:
        raise AxisError(f"split {name}: {outer.name}·{inner.name} = {outer.size * inner.size} ≠ {old.size}")
    axes_ = [ax for x in a.axes for ax in ((outer, inner) if x.name == name else (x,))]
    return Reshape(f"split {name}", Ty(a), Ty(a.with_(axes=axes_)), data=(("axis", name),))


def merge(a: Array, first: Axis | str, second: Axis | str, into: Axis) -> Reshape:
    """Merge adjacent axes ``first``, ``second`` into ``into`` (row-major)."""
    f, s = (getattr(v, "name", v) for v in (first, second))
    i = a.names.index(a.axis(f).name)
    if i + 1 >= len(a.names) or a.names[i + 1] != s:
        raise AxisError(f"merge {f},{s}: the axes are not adjacent in {a.describe()}")
    if sympy.simplify(a.axes[i].size * a.axes[i + 1].size - into.size) != 0:
        raise AxisError(f"merge {f},{s}: sizes multiply to {a.axes[i].size * a.axes[i + 1].size}, not {into.size}")
    axes_ = [*a.axes[:i], into, *a.axes[i + 2 :]]
    return Reshape(f"merge {f}·{s}", Ty(a), Ty(a.with_(axes=axes_)), data=(("merge", f),))


class Move(Generator):
    """A change of colour: the array moves to another memory level (a transfer, FAN §1)."""

    def evaluate(self, ins, ctx):
        return list(ins)

    def retyped(self, dom, cod):
        return Move(f"{dom.inside[0].level}→{cod.inside[0].level}", dom, cod, data=self.data)


def move(a: Array, to) -> Move:
    """Move an array to memory level ``to`` (load towards compute, or store back)."""
    b = a.with_(level=to)
    return Move(f"{a.level}→{b.level}", Ty(a), Ty(b))
