"""The base of the generators: :class:`Context`, :class:`Generator` and :class:`Accumulator`.

A generator carries everything about itself; every functor (reference semantics, kernel body,
symbolic proofs, cost, drawing, pseudocode, reverse mode, lowering) asks the generator and keeps no
table of generator classes.

>>> from napkin_cat import axes, Array, reduce_max
>>> (n,) = axes("n")
>>> acc = reduce_max(Array(n), n).accumulator("n")
>>> ctx = Context()
>>> x, y = JAX.asarray([1., 5.]), JAX.asarray([3., 2.])
>>> acc.finalize(acc.combine(acc.partial([x], ctx), acc.partial([y], ctx), ctx), ctx)
[Array(5., dtype=float32)]
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import Any

import sympy

from napkin_cat.diagram import Array, Box, Ty
from napkin_cat.errors import AxisError, NapkinError
from napkin_cat.generators._arrays import JAX


class NoDerivative(NapkinError, NotImplementedError):
    """A box of the diagram has no derivative rule (no ``backward`` method).

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> one, t = nc.Axis("one", 1), nc.Axis("t", n.size + 1)
    >>> nc.reverse(nc.concat(nc.Array(one, d), nc.Array(n, d), "one", n, into=t))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.generators._base.NoDerivative: reverse: no derivative rule for Concat box 'concat t' ...
    """


@dataclass
class Context:
    """What a generator's semantics may read besides its inputs.

    ``sizes`` binds the size symbols to integers; ``offsets`` gives, per axis name, the global index of
    the first element of the block being evaluated (0 in the reference semantics; a tile's or chunk's
    start inside a scheduled loop or a kernel); ``xp`` is the array namespace the semantics computes in.

    >>> Context(sizes={sympy.Symbol("n"): 4}).number(sympy.Symbol("n") / 2)
    2.0
    """

    sizes: dict = field(default_factory=dict)
    offsets: dict = field(default_factory=dict)
    xp: Any = JAX

    def at(self, **offsets) -> Context:
        """This context with some block offsets replaced.

        >>> Context().at(q=64).offsets
        {'q': 64}
        """
        return Context(self.sizes, {**self.offsets, **offsets}, self.xp)

    def number(self, expr):
        """A sympy expression in the sizes, as a scalar of the namespace.

        >>> Context().number(sympy.Symbol("n"))
        Traceback (most recent call last):
        ...
        napkin_cat.errors.NapkinError: cannot evaluate n: unbound sizes ['n']
        """
        value = sympy.sympify(expr).subs(self.sizes)
        if not value.is_number:
            raise NapkinError(f"cannot evaluate {expr}: unbound sizes {sorted(map(str, value.free_symbols))}")
        return self.xp.number(value)

    def indices(self, wire: Array, shape: tuple, names=None) -> dict:
        """Global index along each axis of ``wire`` (those in ``names``, where given) of a block of ``shape``: a
        vector along that axis, of size 1 on the others, so that what an index function computes from one index
        (``q // W``, ``ids[q]``) is computed once per index, and broadcasting to the block happens at the first
        operation that mixes two axes.

        >>> from napkin_cat import axes
        >>> idx = Context(offsets={"n": 2}).indices(Array(*axes("m n")), (2, 3))
        >>> idx["m"].tolist(), idx["n"].tolist()
        ([[0], [1]], [[2, 3, 4]])
        """
        along = lambda i: tuple(n if j == i else 1 for j, n in enumerate(shape))  # noqa: E731
        return {
            a.name: self.xp.iota(along(i), i) + self.offsets.get(a.name, 0)
            for i, a in enumerate(wire.axes)
            if names is None or a.name in names  # only those read: a kernel emits no index it never uses
        }


def _letters(*wires: Array) -> dict:
    names = dict.fromkeys(n for w in wires for n in w.names)
    if len(names) > len(string.ascii_letters):
        raise AxisError(f"too many distinct axes ({len(names)}) for one einsum")
    return dict(zip(names, string.ascii_letters, strict=False))


def einsum_spec(dom: Ty, cod: Array) -> str:
    """The ``einsum`` equation of a contraction from its wires' axis names.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> einsum_spec(Ty(Array(q, d), Array(x, d)), Array(q, x))
    'ab,cb->ac'
    """
    letters = _letters(*dom.inside, cod)
    term = lambda w: "".join(letters[n] for n in w.names)  # noqa: E731
    return ",".join(map(term, dom.inside)) + "->" + term(cod)


def align(xp, value, wire: Array, target: Array):
    """Broadcast ``value`` (laid out as ``wire``) to the axis order of ``target``, by axis name.

    >>> from napkin_cat import axes
    >>> q, d = axes("q d")
    >>> align(JAX, JAX.asarray([1.0, 2.0]), Array(d), Array(q, d)).shape
    (1, 2)
    """
    if wire.names == target.names:
        return value
    missing = [n for n in wire.names if n not in target.names]
    if missing:
        raise AxisError(f"cannot broadcast {wire.describe()} to {target.describe()}: extra axes {missing}")
    value = xp.transpose(value, [wire.names.index(n) for n in target.names if n in wire.names])
    return xp.expand_dims(value, [i for i, n in enumerate(target.names) if n not in wire.names])


def along(xp, value, at: int, matrix):
    """The product of axis ``at`` of ``value`` with a constant square ``matrix``: ``out[…, e, …] = Σ_d value[…, d,
    …]·matrix[d, e]``, in ``value``'s dtype, in any namespace (the axis moved last, the rest flattened into rows,
    one matrix product, moved back). The Hadamard box and RoPE's signed permutation are such products.

    >>> along(JAX, JAX.asarray([[1.0, 2.0], [3.0, 4.0]]), 0, JAX.asarray([[0.0, 1.0], [1.0, 0.0]])).tolist()
    [[3.0, 4.0], [1.0, 2.0]]
    """
    shape = tuple(xp.shape(value))
    last = len(shape) - 1
    order = [*(k for k in range(len(shape)) if k != at), at]
    moved = xp.transpose(value, order) if at != last else value
    rows = xp.einsum("ad,de->ae", xp.reshape(moved, (-1, shape[at])), xp.like(matrix, value))
    out = xp.reshape(rows, tuple(xp.shape(moved)))
    return xp.transpose(out, [order.index(k) for k in range(len(order))]) if at != last else out


def heads(x) -> tuple:
    """``x``, laid out ``[B, N, H, D]``, as an :class:`Array` of its dtype over axes ``b n h d`` of its sizes, and
    those axes: what a box run on every head of a batch is built over (RoPE's rotation before the kernel, the
    Hadamard rotation before FP8 quantisation); ``to_jax`` of the box then runs it on ``x``.

    >>> import jax.numpy as jnp
    >>> wire, (b, n, h, d) = heads(jnp.zeros((2, 5, 3, 8), jnp.bfloat16))
    >>> wire.names, d.size, wire.dtype.name
    (('b', 'n', 'h', 'd'), 8, 'bf16')
    """
    from napkin_cat.axes import axes

    named = axes("b n h d", **dict(zip("bnhd", x.shape, strict=True)))
    return Array(*named, dtype=x.dtype), named


def contraction_size(*wires: Array) -> sympy.Expr:
    """The product of the sizes of every distinct axis on ``wires``: the multiply-adds of a contraction.

    >>> from napkin_cat import axes
    >>> q, d = axes("q d")
    >>> contraction_size(Array(q, d), Array(d))
    d*q
    """
    return sympy.Mul(*{a.name: a.size for w in wires for a in w.axes}.values())


def fname(fn) -> str:
    """The name a box shows for a function: the string itself, or the callable's ``__name__``.

    >>> fname("exp"), fname(abs)
    ('exp', 'abs')
    """
    return fn if isinstance(fn, str) else getattr(fn, "__name__", repr(fn))


class Generator(Box):
    """Base class of the generators. ``data`` is a tuple of ``(key, value)`` parameters.

    A subclass overrides what applies to it: ``evaluate`` (semantics over ``ctx.xp``), ``flops``,
    ``transcendentals``, ``tensor_flops``, ``accumulator``, ``backward``, ``lines`` (pseudocode), and the
    class attributes below.

    >>> from napkin_cat import axes, exp
    >>> box = exp(Array(*axes("n")))
    >>> box.family, box.transcendentals()
    ('elementwise', n)
    """

    #: the drawing family (its shape and colour in a picture)
    family = "box"
    #: the pseudocode's base name for a value this box makes
    symbol = "Y"
    #: a box combining elements only by a sum of products: zero padding along its reduced axes is neutral
    contracts = False
    #: a box that normalises along an axis (softmax and its fused forms): its inputs read as Q, K, V
    normalises = False
    #: a change of memory level: a transfer (a load or a store)
    transfers = False

    @property
    def params(self) -> dict:
        """The parameters in ``data``, as a dict."""
        return dict(self.data or ())

    @property
    def out(self) -> Array:
        """The first output wire."""
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

    #: axes whose size must be a power of two (a Hadamard matrix's); verification draws such sizes there
    powers_of_two: tuple[str, ...] = ()

    def evaluate(self, ins: list, ctx: Context) -> list:
        """The outputs on the values ``ins`` of the input wires, computed with ``ctx.xp``."""
        raise NotImplementedError(type(self).__name__)

    def flops(self) -> sympy.Expr:
        """Floating-point operations, a sympy expression in the axis sizes."""
        return sympy.Integer(0)

    def transcendentals(self) -> sympy.Expr:
        """Transcendental evaluations (exp, log, …), a sympy expression."""
        return sympy.Integer(0)

    def tensor_flops(self) -> sympy.Expr:
        """The part of :meth:`flops` that runs on tensor cores (contractions)."""
        return sympy.Integer(0)

    def accumulator(self, axis: str) -> Accumulator | None:
        """The accumulator streaming this box along ``axis``, or None if it is not streamable there.

        A generator that defines ``partial``, ``combine``, ``finalize`` and ``identity`` itself (the
        :class:`Accumulator` methods, ``padding`` optional) is its own accumulator along the axes it removes.
        """
        if all(hasattr(self, m) for m in ("partial", "combine", "finalize", "identity")) and axis in self.reduced:
            return Own(self, axis)
        return None

    def backward(self, tape, ins: tuple, outs: tuple, cts: list) -> list:
        """The cotangent of each input (or None), built on the reverse-mode ``tape`` from the cotangents
        ``cts`` of the outputs (``napkin_cat._reverse``)."""
        raise NoDerivative(
            f"reverse: no derivative rule for {type(self).__name__} box {self.name!r} ({self.dom} → {self.cod}); "
            "register one with napkin_cat.derivative"
        )

    def lines(self, prog, ins: list, outs: list) -> list:
        """The pseudocode of this box: ``(text, defs, uses[, loop, inplace])`` entries for ``prog``."""
        args = ", ".join(prog.ix(v) for v in ins)
        return [(f"{', '.join(prog.ix(o) for o in outs)} = {self.name}({args})", outs, ins)]

    def diagonal(self) -> tuple[str, str] | None:
        """For a causal mask, ``(q, x)``: it keeps ``x ≤ q``, so blocks wholly below the diagonal need no
        mask and blocks wholly above it are skipped. None for every other box."""
        return None

    def with_residual(self) -> Generator | None:
        """The same box whose last output is also the row statistic its backward reads along the axis it
        normalises (a softmax·contract's log-sum-exp, a normalised contraction's sum), so a forward kernel
        keeps it and the backward streams without recomputing it (``lowering._backward``); else None."""
        return None

    def in_base2(self, scale=None) -> Generator | None:
        """The same box reading base-2 scores (``s·log₂e``), where it has such a form; else None. With a
        positive ``scale``, the box reads unscaled scores and scales them itself (by ``scale``, log₂e in it)."""
        return None

    def passes_base(self) -> bool:
        """Whether the box commutes with scaling the scores (a mask sends scores to −∞ in any base)."""
        return False

    def scaled(self, c) -> Generator | None:
        """The same box with its output multiplied by ``c``, where it carries a scale; else None."""
        return None

    def unscaled(self) -> tuple[Generator, object] | None:
        """The same box without its scale, and that scale, where it carries one; else None."""
        return None

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r}, {self.dom!r}, {self.cod!r}, data={self.data!r})"


class Accumulator:
    """The accumulator of ``box`` along ``axis`` (FAN §3, the stream partition).

    ``partial(x)`` is the state of one chunk, ``combine`` merges two states associatively, ``finalize``
    turns a state into the box's outputs, so that ``finalize(combine(partial(x), partial(y))) == f(x ⊕ y)``.
    A streamed loop starts from ``identity`` (or the first chunk) and folds ``step``. Everything is
    written against ``ctx.xp``, so the same accumulator runs in JAX, in a kernel and in sympy.
    Inputs not indexed by the axis are loop-invariant.

    >>> from napkin_cat import axes, Array, reduce_sum
    >>> reduce_sum(Array(*axes("n")), "n").accumulator("n")
    Monoid('sum n', 'n')
    """

    #: per input, the value that padding along the streamed axis must hold to contribute nothing
    padding: tuple = ()

    def __init__(self, box: Generator, axis: str):
        self.box, self.axis = box, axis

    def streamed_inputs(self) -> tuple[bool, ...]:
        """Which of the box's inputs are indexed by the streamed axis (chunked in the loop)."""
        return tuple(w.has(self.axis) for w in self.box.dom.inside)

    @property
    def at(self) -> int:
        """The position of the streamed axis on the first input."""
        return self.box.dom.inside[0].names.index(self.axis)

    @property
    def kind(self) -> str:
        """The accumulator's name in pseudocode."""
        return type(self).__name__

    def rows(self) -> Array:
        """The first input's wire without the streamed axis (where per-row statistics live)."""
        s = self.box.dom.inside[0]
        return s.with_(axes=[a for a in s.axes if a.name != self.axis])

    def partial(self, ins: list, ctx: Context):
        """The state of one chunk."""
        raise NotImplementedError

    def combine(self, a, b, ctx: Context):
        """Two states merged (associative, with unit :meth:`identity`)."""
        raise NotImplementedError

    def finalize(self, state, ctx: Context) -> list:
        """The box's outputs from a state."""
        raise NotImplementedError

    def identity(self, like, ctx: Context):
        """The neutral state shaped like the state ``like`` (a state or its ``jax.ShapeDtypeStruct``s)."""
        raise NotImplementedError

    def step(self, state, ins: list, ctx: Context):
        """Fold one chunk into a state (an accumulator may fuse this to do less work)."""
        return self.combine(state, self.partial(ins, ctx), ctx)

    def lines(self, prog, ins: list, outs: list) -> tuple[list, list, list]:
        """The pseudocode of the accumulation: entries before the stream loop, in it, and after it."""
        a = prog.state(f"acc_{outs[0].name}", outs[0].wire)
        ix = prog.ix
        init = [(f"{ix(a)} = identity   # {self.kind}", [a], [])]
        loop = [(f"{ix(a)} = step({ix(a)}, {', '.join(ix(v) for v in ins)})", [], [a, *ins])]
        final = [(f"{', '.join(ix(o) for o in outs)} = finalize({ix(a)})", outs, [a], False, True)]
        return init, loop, final

    def __repr__(self):
        return f"{type(self).__name__}({self.box.name!r}, {self.axis!r})"


class Own(Accumulator):
    """The accumulator of a generator that defines the accumulator's methods itself (one class: the box).

    >>> from napkin_cat import axes
    >>> class Total(Generator):
    ...     def partial(self, ins, ctx): return ctx.xp.sum(ins[0], 0)
    ...     def combine(self, a, b, ctx): return a + b
    ...     def finalize(self, state, ctx): return [state]
    ...     def identity(self, like, ctx): return ctx.xp.full(like.shape, 0)
    >>> (n,) = axes("n")
    >>> total = Total("total", Ty(Array(n)), Ty(Array()))
    >>> acc = total.accumulator("n")
    >>> float(acc.combine(acc.partial([JAX.asarray([1.0, 2.0])], Context()), 3.0, Context()))
    6.0
    """

    @property
    def padding(self):
        return getattr(self.box, "padding", ())

    @property
    def kind(self) -> str:
        return f"{type(self.box).__name__}'s own"

    def partial(self, ins, ctx):
        return self.box.partial(ins, ctx)

    def combine(self, a, b, ctx):
        return self.box.combine(a, b, ctx)

    def finalize(self, state, ctx):
        return self.box.finalize(state, ctx)

    def identity(self, like, ctx):
        return self.box.identity(like, ctx)
