"""Reverse mode: the backward of a diagram is a diagram, built from each generator's derivative.

``reverse(d)`` is the pullback of ``d``: its inputs are ``d``'s inputs followed by one cotangent per
output, its outputs the cotangents of ``d``'s inputs (in their dtypes; cotangents inside are f32).
Each generator class declares its derivative as a small diagram in :data:`DERIVATIVES` (contractions
transpose to contractions, softmax's backward is elementwise maps and a row sum, masks and score
modifiers differentiate through their index functions); copies become sums, swaps swap, discards give
zero cotangents. Forward values the backward needs are recomputed from the primal inputs. A box
without a rule (today ``Conv`` and ``Concat``: their backward needs slicing or flipped kernels, which
no generator expresses) raises :class:`NoDerivative` naming it.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> back = reverse(attn)
>>> print(back.dom, "→", back.cod)
q×d ⊗ x×d ⊗ x×d ⊗ q×d → q×d ⊗ x×d ⊗ x×d
>>> Q, K, V, dO = (jax.random.normal(jax.random.key(i), (4, 8)) for i in range(4))
>>> want = jax.vjp(nc.to_jax(attn), Q, K, V)[1](dO)
>>> all(bool(jnp.allclose(a, b, atol=1e-5)) for a, b in zip(nc.to_jax(back)(Q, K, V, dO), want))
True

The backward of ``exp`` multiplies the cotangent by the (recomputed) output:

>>> (n,) = nc.axes("n")
>>> print(reverse(nc.exp(nc.Array(n))))
exp[n → n] >> multiply[n ⊗ n → n]
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import sympy

from napkin_cat import generators as g
from napkin_cat.convolution import Rename, rename
from napkin_cat.diagram import Array, Copy, Diagram, Swap, Ty, copy, discard
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import f32
from napkin_cat.errors import NapkinError

__all__ = ["DERIVATIVES", "NoDerivative", "Partial", "Tape", "derivative", "reverse"]


class NoDerivative(NapkinError, NotImplementedError):
    """A box of the diagram has no derivative rule in :data:`DERIVATIVES`."""


def _cot(a: Array) -> Array:
    """The type of a wire's cotangent: the same axes and level, in f32."""
    return a.with_(dtype=f32)


# --- elementwise helpers: hashable callables, so the boxes they make are values ------------------


def broadcast(v, like):
    """``v`` broadcast to the shape of ``like`` (the backward of a sum; ``like`` is read for its shape).

    >>> broadcast(jnp.ones((2, 1)), jnp.zeros((2, 3))).shape
    (2, 3)
    """
    return jnp.broadcast_to(v, jnp.broadcast_shapes(jnp.shape(v), jnp.shape(like)))


def zeros(like):
    """Zeros shaped as ``like``: the cotangent of an input no output depends on.

    >>> zeros(jnp.full((2,), jnp.inf)).tolist()
    [0.0, 0.0]
    """
    return jnp.zeros(jnp.shape(like), jnp.float32)


def attains(v, extremum):
    """1 where ``v`` attains the row's ``extremum`` (a max or min), else 0.

    >>> attains(jnp.array([1.0, 3.0, 3.0]), jnp.float32(3.0)).tolist()
    [0.0, 1.0, 1.0]
    """
    return (v == extremum).astype(jnp.float32)


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
        f = g.ELEMENTWISE[self.fn][0] if isinstance(self.fn, str) else self.fn
        shape = jnp.broadcast_shapes(jnp.shape(ct), *map(jnp.shape, args))
        i, ct = self.arg, jnp.broadcast_to(ct, shape)
        _, pull = jax.vjp(lambda a: f(*args[:i], a, *args[i + 1 :]), jnp.broadcast_to(args[i], shape))
        return pull(ct)[0]

    @property
    def __name__(self):
        return f"∂{self.arg} {g._fname(self.fn)}"


@dataclass(frozen=True)
class ScoreDerivative:
    """``∂fn(s, **indices)/∂s``, elementwise: the index map of a score modifier's derivative."""

    fn: Callable

    def __call__(self, s, **indices):
        return jax.jvp(lambda v: self.fn(v, **indices), (s,), (jnp.ones_like(s),))[1]

    @property
    def __signature__(self):
        return inspect.signature(self.fn)

    @property
    def __name__(self):
        return f"{g._fname(self.fn)}'"


@dataclass(frozen=True)
class Kept:
    """The cotangent where ``keep(**indices)`` holds, else 0: a mask's backward."""

    keep: Callable

    def __call__(self, ct, **indices):
        return jnp.where(self.keep(**indices), ct, 0.0)

    @property
    def __signature__(self):
        ct = inspect.Parameter("cotangent", inspect.Parameter.POSITIONAL_ONLY)
        return inspect.Signature([ct, *inspect.signature(self.keep).parameters.values()])

    @property
    def __name__(self):
        return f"kept {g._fname(self.keep)}"


# --- the tape: the backward as a dataflow program on named wires ----------------------------------


class Tape:
    """The backward under construction: named wires and the boxes applied to them.

    Derivative rules call the tape to add boxes; :meth:`diagram` keeps the steps the outputs need and
    wires them into a string diagram (copies, swaps, discards).
    """

    def __init__(self):
        self.types: dict[str, Array] = {}
        self.inputs: dict[str, Array] = {}
        self.steps: list[tuple[Diagram, tuple[str, ...], tuple[str, ...]]] = []

    def _fresh(self, a: Array, prefix: str) -> str:
        name = f"{prefix}{len(self.types)}"
        self.types[name] = a
        return name

    def input(self, a: Array, prefix: str = "x") -> str:
        """Declare one more input wire of type ``a``; its name."""
        name = self._fresh(a, prefix)
        self.inputs[name] = a
        return name

    def ty(self, name: str) -> Array:
        """The array type of the wire ``name``."""
        return self.types[name]

    def apply(self, box: Diagram, *ins: str) -> tuple[str, ...]:
        """Apply ``box`` to the wires ``ins``; the names of its outputs."""
        outs = tuple(self._fresh(a, "v") for a in box.cod.inside)
        self.steps.append((box, ins, outs))
        return outs

    def __call__(self, box: Diagram, *ins: str) -> str:
        """Apply a box with one output; its name."""
        (out,) = self.apply(box, *ins)
        return out

    def ew(self, fn, *ins: str, out: Array | None = None, const=None) -> str:
        """An elementwise map of the wires ``ins`` (broadcast by name to ``out``, default the widest, f32)."""
        arrays = [self.ty(n) for n in ins]
        out = out or _cot(max(arrays, key=lambda a: len(a.axes)))
        return self(g.elementwise(fn, *arrays, const=const, out=out), *ins)

    def contract(self, ins: list[str], out: Array, scale=None) -> str:
        """The contraction (einsum by axis name) of the wires ``ins`` to ``out``."""
        arrays = [self.ty(n) for n in ins]
        name = ", ".join(" ".join(a.names) for a in arrays) + " → " + " ".join(out.names)
        data = (("scale", scale),) if scale is not None else ()
        return self(g.Contract(name, Ty(*arrays), Ty(out), data=data), *ins)

    def transpose(self, operands: list[str], i: int, ct: str, scale=None) -> str:
        """The cotangent of operand ``i`` of a contraction: the others contracted with ``ct``; axes only
        operand ``i`` has (summed by the forward) are broadcast back."""
        target = _cot(self.ty(operands[i]))
        others = [*operands[:i], ct, *operands[i + 1 :]]
        have = {n for o in others for n in self.ty(o).names}
        part = target.with_(axes=[a for a in target.axes if a.name in have])
        v = self.contract(others, part, scale)
        return v if part == target else self.ew(broadcast, v, operands[i], out=target)

    def unbroadcast(self, name: str, target: Array) -> str:
        """Sum a cotangent over the axes ``target`` lacks (and reorder to ``target``'s axes)."""
        return name if self.ty(name) == target else self.contract([name], target)

    def total(self, names: list[str]) -> str | None:
        """The sum of the cotangents ``names`` (a copy's backward), or None if there are none."""
        if not names:
            return None
        acc = names[0]
        for n in names[1:]:
            acc = self.ew("add", acc, n, out=self.ty(acc))
        return acc

    def cast(self, name: str, to) -> str:
        """The wire ``name`` cast to dtype ``to`` (itself if it has that dtype)."""
        a = self.ty(name)
        return name if a.dtype == to else self(g.cast(a, to), name)

    def diagram(self, outs: list[str]) -> Diagram:
        """The diagram from the inputs to ``outs``, without the steps ``outs`` do not need.

        >>> import napkin_cat as nc
        >>> t = Tape()
        >>> a = t.input(nc.Array(*nc.axes("n")))
        >>> print(t.diagram([t.ew("exp", a), a]))
        Copy(n)[n → n ⊗ n] >> exp[n → n] >> Swap(n, n)[n ⊗ n → n ⊗ n]
        """
        live, kept = set(outs), []
        for step in reversed(self.steps):
            if live & set(step[2]):
                kept.append(step)
                live |= set(step[1])
        return _wire(self.types, list(self.inputs), kept[::-1], list(outs))


def _wire(types: dict, inputs: list[str], steps: list, outs: list[str]) -> Diagram:
    """A string diagram of the dataflow program ``steps`` (box, input names, output names).

    Each box is applied where its first argument lies, the other arguments swapped next to it; a wire
    is copied when read again later and discarded after its last read.
    """
    steps = [*steps, (None, tuple(outs), ())]
    last = {n: t for t, (_, ins, _) in enumerate(steps) for n in ins}
    wires, parts = list(inputs), []

    def ty(names) -> Ty:
        return Ty(*(types[n] for n in names))

    def put(start: int, stop: int, box: Diagram):  # ``box`` in place of ``wires[start:stop]``
        parts.append(identity(ty(wires[:start])) @ box @ identity(ty(wires[stop:])))

    for t, (box, ins, made) in enumerate(steps):
        for p in reversed(range(len(wires))):
            if last.get(wires[p], -1) < t:
                put(p, p + 1, discard(types[wires[p]]))
                del wires[p]
        start = len(wires)
        for j, name in enumerate(ins):
            p = next(i for i, w in enumerate(wires) if w == name and not (j and start <= i < start + j))
            if last[name] > t or name in ins[j + 1 :]:
                put(p, p + 1, copy(types[name]))
                wires.insert(p, name)
                start, p = start + (j > 0 and p < start), p + 1
            if j == 0:
                start = p
            elif p < start:  # move it right, past the wires between, to the end of the gathered arguments
                for q in range(p, start + j - 1):
                    put(q, q + 2, Swap(Ty(types[name]), Ty(types[wires[q + 1]])))
                    wires[q], wires[q + 1] = wires[q + 1], wires[q]
                start -= 1
            else:  # move it left, to the end of the gathered arguments
                for q in range(p, start + j, -1):
                    put(q - 1, q + 1, Swap(Ty(types[wires[q - 1]]), Ty(types[name])))
                    wires[q - 1], wires[q] = wires[q], wires[q - 1]
        if box is not None:
            put(start, start + len(ins), box)
            wires[start : start + len(ins)] = made
    return identity(ty(inputs)).then(*parts)


# --- derivative rules, keyed by generator class ------------------------------------------------------

Rule = Callable[[Tape, g.Generator, tuple[str, ...], tuple[str, ...], list], list]
#: ``rule(tape, box, ins, outs, cts) -> [cotangent of each input or None]``; ``cts`` has one cotangent
#: name (or None) per output; a cotangent's type is its wire's with dtype f32.
DERIVATIVES: dict[type, Rule] = {}


def derivative(cls: type) -> Callable[[Rule], Rule]:
    """Register the derivative rule of a generator class (subclasses inherit it).

    >>> import napkin_cat as nc
    >>> class Double(g.Generator):
    ...     def evaluate(self, ins, ctx): return [2 * ins[0]]
    >>> @derivative(Double)
    ... def _(t, box, ins, outs, cts): return [t.ew("multiply", cts[0], const=2)]
    >>> A = nc.Array(*nc.axes("n"))
    >>> print(reverse(Double("double", Ty(A), Ty(A))))
    Copy(n, 0)[n → Ty()] >> multiply 2[n → n]
    >>> del DERIVATIVES[Double]
    """

    def register(rule: Rule) -> Rule:
        DERIVATIVES[cls] = rule
        return rule

    return register


def _rule(box) -> Rule:
    for cls in type(box).__mro__:
        if cls in DERIVATIVES:
            return DERIVATIVES[cls]
    raise NoDerivative(
        f"reverse: no derivative rule for {type(box).__name__} box {box.name!r} ({box.dom} → {box.cod}); "
        "register one with napkin_cat.reverse.derivative"
    )


@derivative(g.Contract)
def _contract(t: Tape, box, ins, outs, cts):
    return [t.transpose(list(ins), i, cts[0], box.params.get("scale")) for i in range(len(ins))]


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


#: named elementwise maps with a derivative written as a diagram; the others use :class:`Partial`
ELEMENTWISE_RULES = {
    "add": _add, "subtract": _subtract, "multiply": _multiply, "divide": _divide, "exp": _exp, "neg": _neg,
}


@derivative(g.Elementwise)
def _elementwise(t: Tape, box, ins, outs, cts):
    (ct,), (y,), p = cts, outs, box.params
    fn, const = p["fn"], p.get("const")
    rule = ELEMENTWISE_RULES.get(fn) if isinstance(fn, str) else None
    if rule is not None:
        parts = rule(t, ct, ins, y, const)
    else:
        parts = [t.ew(Partial(fn, i), ct, *ins, const=const, out=t.ty(ct)) for i in range(len(ins))]
    return [t.unbroadcast(v, _cot(t.ty(x))) for v, x in zip(parts, ins, strict=True)]


@derivative(g.Cast)
def _cast(t, box, ins, outs, cts):
    return list(cts)  # cotangents are f32 on both sides


@derivative(g.Move)
def _move(t, box, ins, outs, cts):
    return [t(g.move(t.ty(cts[0]), box.dom.inside[0].level), cts[0])]


@derivative(Rename)
def _rename(t, box, ins, outs, cts):
    p = box.params
    return [t(rename(t.ty(cts[0]), p["new"], box.dom.inside[0].axis(p["old"])), cts[0])]


@derivative(g.Reshape)
def _reshape(t, box, ins, outs, cts):
    x, y, ct = box.dom.inside[0], box.out, t.ty(cts[0])
    if "axis" in box.params:  # a split: merge back
        i = x.names.index(box.params["axis"])
        return [t(g.merge(ct, y.axes[i], y.axes[i + 1], into=x.axes[i]), cts[0])]
    i = x.names.index(box.params["merge"])
    return [t(g.split(ct, y.axes[i], x.axes[i], x.axes[i + 1]), cts[0])]


@derivative(g.Reduce)
def _reduce(t: Tape, box, ins, outs, cts):
    (x,), (y,), (ct,) = ins, outs, cts
    X = _cot(t.ty(x))
    if box.params["op"] == "sum":
        return [t.ew(broadcast, ct, x, out=X)]
    # max, min: the cotangent goes to the positions attaining the extremum, shared among ties (as JAX)
    at = t.ew(attains, x, y, out=X)
    count = t(g.reduce_sum(X, box.params["axis"]), at)
    return [t.ew("multiply", at, t.ew("divide", ct, count), out=X)]


def _softmax_backward(t: Tape, P: str, dP: str | None, axis: str, dlse: str | None = None) -> str:
    """``dS = P ⊙ (dP − Σ_axis P ⊙ dP)`` (plus ``P ⊙ dlse`` for a log-sum-exp output)."""
    S = t.ty(P)
    u = None
    if dP is not None:
        u = t.ew("subtract", dP, t(g.reduce_sum(S, axis), t.ew("multiply", P, dP)), out=S)
    if dlse is not None:
        u = dlse if u is None else t.ew("add", u, dlse, out=S)
    return t.ew("multiply", P, u, out=S)


@derivative(g.Softmax)
def _softmax(t, box, ins, outs, cts):
    return [_softmax_backward(t, outs[0], cts[0], box.params["axis"])]


@derivative(g.SoftmaxContract)
def _softmax_contract(t: Tape, box, ins, outs, cts):
    (s, v), axis = ins, box.params["axis"]
    ct, dlse = (*cts, None)[:2]
    base2 = box.params.get("base") == 2
    if base2:
        s = t.ew("multiply", s, const=sympy.log(2))
    P = t(g.softmax(t.ty(s), axis), s)
    dP = dv = None
    if ct is not None:
        dP, dv = t.transpose([P, v], 0, ct), t.transpose([P, v], 1, ct)
    ds = _softmax_backward(t, P, dP, axis, dlse)
    return [t.ew("multiply", ds, const=sympy.log(2)) if base2 else ds, dv]


@derivative(g.NormalisedContract)
def _normalised_contract(t: Tape, box, ins, outs, cts):
    """``O = (a₁(s)·v) / b(Z)`` with ``Z = Σ_axis a₂(s)``."""
    (s, v), (y,), (ct,), p = ins, outs, cts, box.params
    S = _cot(t.ty(s))
    rows = S.with_(axes=[a for a in S.axes if a.name != p["axis"]])
    A = t.ew(p["a1"], s, out=S)
    Z = t(g.reduce_sum(S, p["axis"]), t.ew(p["a2"], s, out=S))
    B = t.ew(p["b"], Z, out=rows)
    dAv = t.ew("divide", ct, B, out=t.ty(ct))
    dB = t.ew("neg", t.ew("divide", t.contract([ct, y], rows), B, out=rows))
    dZ = t.ew(Partial(p["b"], 0), dB, Z, out=rows)
    ds = t.ew("add", t.ew(Partial(p["a1"], 0), t.transpose([A, v], 0, dAv), s, out=S),
              t.ew(Partial(p["a2"], 0), dZ, s, out=S), out=S)
    return [ds, t.transpose([A, v], 1, dAv)]


@derivative(g.IndexMap)
def _index_map(t: Tape, box, ins, outs, cts):
    (s,), fn = ins, box.params["fn"]
    S = t.ty(s)
    slope = t(g.IndexMap(f"score_mod {g._fname(ScoreDerivative(fn))}", Ty(S), Ty(_cot(S)),
                         data=(("fn", ScoreDerivative(fn)),)), s)
    return [t.ew("multiply", cts[0], slope)]


@derivative(g.Mask)
def _mask(t: Tape, box, ins, outs, cts):
    keep, C = box.params["mask"], t.ty(cts[0])
    return [t(g.IndexMap(f"kept {g._fname(keep)}", Ty(C), Ty(C), data=(("fn", Kept(keep)),)), cts[0])]


# --- the functor -------------------------------------------------------------------------------------


def reverse(d: Diagram) -> Diagram:
    """The backward diagram of ``d``: ``d.dom ⊗ d.cod → d.dom``, taking the primal inputs and one
    cotangent per output to the cotangents of the inputs (``jax.vjp`` of ``to_jax(d)``, as a diagram).

    A flat walk over the layers names every wire and records the forward boxes; a reverse walk applies
    each box's derivative rule and sums the cotangents of wires used more than once.

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> print(reverse(nc.copy(nc.Array(n, d))))  # the primal input is not needed: discarded
    Copy(n×d, 0)[n×d → Ty()] >> add[n×d ⊗ n×d → n×d]
    >>> i, o, x = nc.axes("i o x")
    >>> reverse(nc.library.conv1d(i, o, x, nc.Axis("k", 3)))
    Traceback (most recent call last):
    ...
    napkin_cat.reverse.NoDerivative: reverse: no derivative rule for Conv box 'conv k' (i×x ⊗ o×i×k → o×x_out); \
register one with napkin_cat.reverse.derivative
    """
    t = Tape()
    xs = [t.input(a, "x") for a in d.dom.inside]
    dys = [t.input(a, "dy") for a in d.cod.inside]
    stack, nodes = list(xs), []
    for left, box, _ in d.inside:
        n, k = len(left), len(box.dom)
        ins = tuple(stack[n : n + k])
        if isinstance(box, Swap):
            outs = ins[::-1]
        elif isinstance(box, Copy):  # a Discard is a Copy into no wires
            outs = ins * len(box.cod)
        else:
            outs = t.apply(box, *ins)
            nodes.append((box, ins, outs))
        stack[n : n + k] = outs
    cts: dict[str, list[str]] = defaultdict(list)
    for y, dy in zip(stack, dys, strict=True):
        cts[y].append(t.cast(dy, f32))
    for box, ins, outs in reversed(nodes):
        outs_cts = [t.total(cts.pop(y, [])) for y in outs]
        if all(c is None for c in outs_cts):
            continue  # no output reaches the diagram's outputs
        rule = _rule(box)
        for x, dx in zip(ins, rule(t, box, ins, outs, outs_cts), strict=True):
            if dx is None:
                continue
            if t.ty(dx) != _cot(t.ty(x)):
                raise NapkinError(
                    f"reverse: the derivative of {box.name!r} gives {t.ty(dx).describe()} for an input "
                    f"{t.ty(x).describe()}"
                )
            cts[x].append(dx)
    grads = [t.total(cts[x]) or t.ew(zeros, x) for x in xs]
    return t.diagram([t.cast(dx, a.dtype) for dx, a in zip(grads, d.dom.inside, strict=True)])
