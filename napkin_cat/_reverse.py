"""Reverse mode: the backward of a diagram is a diagram, built from each generator's derivative.

``reverse(d)`` is the pullback of ``d``: its inputs are ``d``'s inputs followed by one cotangent per
output, its outputs the cotangents of ``d``'s inputs (in their dtypes; cotangents inside are f32).
Each generator declares its derivative in its ``backward(tape, ins, outs, cts)`` method, as boxes on the
:class:`Tape` (contractions transpose to contractions, softmax's backward is elementwise maps and a row
sum, masks and score modifiers differentiate through their index functions); copies become sums, swaps
swap, discards give zero cotangents. Forward values the backward needs are recomputed from the primal
inputs. A box without a rule (today ``Conv`` and ``Concat``: their backward needs slicing or flipped
kernels, which no generator expresses) raises :class:`NoDerivative` naming it.

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

from collections import defaultdict
from collections.abc import Callable

import jax.numpy as jnp

from napkin_cat import generators as g
from napkin_cat.diagram import Array, Diagram, Swap, Ty, copy, discard
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import f32
from napkin_cat.errors import NapkinError
from napkin_cat.generators import NoDerivative, broadcast

__all__ = ["NoDerivative", "Tape", "derivative", "pullback", "reverse", "zeros"]


def _cot(a: Array) -> Array:
    """The type of a wire's cotangent: the same axes and level, in f32."""
    return a.with_(dtype=f32)


def zeros(like):
    """Zeros shaped as ``like``: the cotangent of an input no output depends on.

    >>> zeros(jnp.full((2,), jnp.inf)).tolist()
    [0.0, 0.0]
    """
    return jnp.zeros(jnp.shape(like), jnp.float32)


# --- the tape: the backward as a dataflow program on named wires ----------------------------------


class Tape:
    """The backward under construction: named wires and the boxes applied to them.

    Derivative rules call the tape to add boxes; :meth:`diagram` keeps the steps the outputs need and
    wires them into a string diagram (copies, swaps, discards).

    >>> import napkin_cat as nc
    >>> t = Tape()
    >>> x = t.input(nc.Array(*nc.axes("q d")))
    >>> y = t.ew("exp", x)
    >>> print(t.ty(y), "|", t.diagram([y]))
    q×d | exp[q×d → q×d]
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

    def diagram(self, outs: list[str], inputs: list[str] | None = None) -> Diagram:
        """The diagram from the inputs (all the tape's, or ``inputs``) to ``outs``, without the steps
        ``outs`` do not need.

        >>> import napkin_cat as nc
        >>> t = Tape()
        >>> a = t.input(nc.Array(*nc.axes("n")))
        >>> print(t.diagram([t.ew("exp", a), a]))
        Copy(n)[n → n ⊗ n] >> exp[n → n] >> Swap(n, n)[n ⊗ n → n ⊗ n]
        """
        return _wire(self.types, list(self.inputs) if inputs is None else inputs, self.needed(outs), list(outs))

    def needed(self, outs) -> list:
        """The steps the wires ``outs`` depend on, in tape order (the steps must be in dataflow order).

        >>> import napkin_cat as nc
        >>> t = Tape()
        >>> a = t.input(nc.Array(*nc.axes("n")))
        >>> y, _ = t.ew("exp", a), t.ew("log", a)
        >>> [box.name for box, _, _ in t.needed([y])]
        ['exp']
        """
        live, kept = set(outs), []
        for step in reversed(self.steps):
            if live & set(step[2]):
                kept.append(step)
                live |= set(step[1])
        return kept[::-1]


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


# --- a user's rule for a generator class they do not own ---------------------------------------------

Rule = Callable[[Tape, g.Generator, tuple[str, ...], tuple[str, ...], list], list]


def derivative(cls: type) -> Callable[[Rule], Rule]:
    """Give the generator class ``cls`` the derivative ``rule(tape, box, ins, outs, cts)`` as its ``backward``
    (for a class one cannot edit; a class one writes defines ``backward`` itself).

    >>> import napkin_cat as nc
    >>> class Double(g.Generator):
    ...     def evaluate(self, ins, ctx): return [2 * ins[0]]
    >>> @derivative(Double)
    ... def _(t, box, ins, outs, cts): return [t.ew("multiply", cts[0], const=2)]
    >>> A = nc.Array(*nc.axes("n"))
    >>> print(reverse(Double("double", Ty(A), Ty(A))))
    Copy(n, 0)[n → Ty()] >> multiply 2[n → n]
    """

    def register(rule: Rule) -> Rule:
        cls.backward = lambda box, t, ins, outs, cts: rule(t, box, ins, outs, cts)
        return rule

    return register


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
    >>> reverse(nc.architectures.conv1d(i, o, x, nc.Axis("k", 3)))
    Traceback (most recent call last):
    ...
    napkin_cat.generators._base.NoDerivative: reverse: no derivative rule for Conv box 'conv k' \
(i×x ⊗ o×i×k → o×x_out); register one with napkin_cat.derivative
    """
    t, grads = pullback(d)
    grads = [dx or t.ew(zeros, x) for dx, x in zip(grads, list(t.inputs)[: len(grads)], strict=True)]
    return t.diagram([t.cast(dx, a.dtype) for dx, a in zip(grads, d.dom.inside, strict=True)])


def pullback(d: Diagram) -> tuple[Tape, list[str | None]]:
    """:func:`reverse` before it is wired: the tape, whose inputs are ``d``'s inputs then one cotangent
    per output, and the name of each input's f32 cotangent on it (None where no output depends on it).
    Rewrites of the backward (``rewrites._io_aware``) work on this dataflow program.

    >>> import napkin_cat as nc
    >>> t, grads = pullback(nc.exp(nc.Array(*nc.axes("n"))))
    >>> list(t.inputs), [t.ty(g).describe() for g in grads]
    (['x0', 'dy1'], ['n:f32@HBM'])
    """
    t = Tape()
    xs = [t.input(a, "x") for a in d.dom.inside]
    dys = [t.input(a, "dy") for a in d.cod.inside]
    nodes = []

    def record(i, box, ins):
        outs = t.apply(box, *ins)
        nodes.append((box, tuple(ins), outs))
        return list(outs)

    stack = d.dataflow(xs, record)
    cts: dict[str, list[str]] = defaultdict(list)
    for y, dy in zip(stack, dys, strict=True):
        cts[y].append(t.cast(dy, f32))
    for box, ins, outs in reversed(nodes):
        outs_cts = [t.total(cts.pop(y, [])) for y in outs]
        if all(c is None for c in outs_cts):
            continue  # no output reaches the diagram's outputs
        for x, dx in zip(ins, box.backward(t, ins, outs, outs_cts), strict=True):
            if dx is None:
                continue
            if t.ty(dx) != _cot(t.ty(x)):
                raise NapkinError(
                    f"reverse: the derivative of {box.name!r} gives {t.ty(dx).describe()} for an input "
                    f"{t.ty(x).describe()}"
                )
            cts[x].append(dx)
    return t, [t.total(cts[x]) for x in xs]
