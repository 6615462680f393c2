"""The stream partition (FAN relabelling 2) and the Fusion Theorem as a checkable predicate.

rewrite: a diagram streamable along ``x``  →  the same diagram with ``x`` relabelled to chunks of ``s``.

A diagram is streamable along ``x`` (FAN §3) when every box that reads ``x`` either keeps it (it is
weaved over ``x``: it runs per chunk) or removes it through an accumulator ``B(f(a), b) = f(a ⊕ b)``,
and no wire carrying ``x`` leaves the diagram or reaches a box after the reduction. Composition and
weaving preserve this (the Fusion Theorem), so the check is local to boxes and wires.
Before checking, :func:`fuse_softmax_contract` applies FAN's lemma: a softmax over ``x`` whose only
consumer contracts over ``x`` becomes one streamable box (online softmax).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> flash = stream(x, 64)(nc.library.attention(q, x, d))
>>> [b.name for b in flash.boxes]
['q d, x d → q x', 'softmax·contract x']
>>> stream(x, 64)(nc.library.softmax(q, x))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
rewrites.rule.RewriteError: stream(x, 64): box 'softmax x', axis 'x': output wire 0 (q×x:f32@HBM) carries x out of ...
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy
from discopy import markov
from discopy.monoidal import Layer

from napkin_cat.axes import Axis
from napkin_cat.diagram import Diagram
from napkin_cat.generators import Contract, Generator, Reshape, Softmax, SoftmaxContract
from rewrites.rule import RewriteError, Rule, axis_names, relabel_axis


def _consumer(d: Diagram, i: int, pos: int):
    """The layer index and input port of the box consuming the wire at ``pos`` after layer ``i``."""
    for j in range(i + 1, len(d.inside)):
        left, box, _ = d.inside[j]
        n = len(left)
        if pos < n:
            continue
        if pos < n + len(box.dom):
            return j, pos - n
        pos += len(box.cod) - len(box.dom)
    return None, pos


def fuse_softmax_contract(d: Diagram, axis: str) -> Diagram:
    """FAN's softmax-contraction lemma: ``softmax_x ; contract_x`` becomes one streamable box.

    rewrite: softmax over x, then a contraction that removes x  →  softmax·contract x.
    Applies wherever a softmax's output feeds exactly one box, a contraction removing ``axis``, as its
    first input; elsewhere the diagram is unchanged.
    """
    layers = list(d.inside)
    for i, (left, box, _) in enumerate(d.inside):
        if not (isinstance(box, Softmax) and box.params["axis"] == axis):
            continue
        j, port = _consumer(d, i, len(left))
        if j is None or port != 0:
            continue
        l2, consumer, r2 = d.inside[j]
        if isinstance(consumer, Contract) and axis in consumer.reduced and len(consumer.dom) == 2:
            if consumer.params.get("scale") is not None:
                continue
            fused = SoftmaxContract(f"softmax·contract {axis}", consumer.dom, consumer.cod, data=(("axis", axis),))
            layers[i] = None
            layers[j] = Layer(l2, fused, r2)
    layers = tuple(layer for layer in layers if layer is not None)
    return d if len(layers) == len(d.inside) else Diagram(layers, d.dom, d.cod, _scan=False)


def streamability(d: Diagram, axis: str, rule: str = "stream") -> list:
    """Check the Fusion Theorem's conditions; return the accumulators of the boxes that remove ``axis``.

    Raises :class:`RewriteError` naming the box and the failed condition.
    """
    carried = [w.has(axis) for w in d.dom.inside]  # wires carrying the axis (chunked)
    after = [False] * len(d.dom)  # wires computed from a completed reduction
    accumulators = []
    for left, box, _ in d.inside:
        n, k = len(left), len(box.dom)
        ins_c, ins_a = carried[n : n + k], after[n : n + k]
        if isinstance(box, markov.Swap):
            out_c, out_a = ins_c[::-1], ins_a[::-1]
        elif isinstance(box, markov.Copy):
            out_c, out_a = ins_c * len(box.cod), ins_a * len(box.cod)
        else:
            if any(ins_c) and any(ins_a):
                raise RewriteError(
                    rule,
                    f"it needs both a chunk of {axis} and a completed reduction over {axis}: "
                    "two passes, not one stream",
                    box=box.name,
                    axis=axis,
                )
            if isinstance(box, Reshape) and any(ins_c):
                raise RewriteError(rule, "a reshape of a streamed wire is not streamable", box=box.name, axis=axis)
            keeps = any(w.has(axis) for w in box.cod.inside)
            if any(ins_c) and not keeps:
                acc = box.accumulator(axis) if isinstance(box, Generator) else None
                if acc is None:
                    raise RewriteError(
                        rule, f"the box removes {axis} but has no accumulator along it", box=box.name, axis=axis
                    )
                accumulators.append(acc)
                out_c, out_a = [False] * len(box.cod), [True] * len(box.cod)
            else:
                out_c = [w.has(axis) for w in box.cod.inside]
                out_a = [any(ins_a)] * len(box.cod)
        carried[n : n + k], after[n : n + k] = out_c, out_a
    for i, (c, w) in enumerate(zip(carried, d.cod.inside, strict=True)):
        if c:
            producer = _producer(d, i)
            hint = (
                (f" (softmax alone is not streamable; follow it by a contraction over {axis})")
                if producer.startswith("softmax")
                else ""
            )
            raise RewriteError(
                rule,
                f"output wire {i} ({w.describe()}) carries {axis} out of the stream unreduced{hint}",
                box=producer,
                axis=axis,
            )
    if not accumulators:
        raise RewriteError(rule, f"no box removes {axis}: there is nothing to accumulate", axis=axis)
    return accumulators


def _producer(d: Diagram, pos: int) -> str:
    """The name of the box producing output wire ``pos``, looking through copies and swaps."""
    j = len(d.inside)
    while True:
        i, port = d.producer(j, pos)
        if i is None:
            return "input"
        left, box, _ = d.inside[i]
        if not isinstance(box, markov.Copy | markov.Swap):
            return box.name
        j, pos = i, len(left) + (len(box.dom) - 1 - port if isinstance(box, markov.Swap) else 0)


@dataclass(frozen=True)
class stream(Rule):  # noqa: N801
    """Stream-partition axis ``axis`` into chunks of ``s`` through the accumulators of the boxes removing it."""

    axis: Axis | str
    s: int

    @property
    def name(self) -> str:
        return getattr(self.axis, "name", self.axis)

    def __repr__(self):
        return f"stream({self.name}, {self.s})"

    def apply(self, d: Diagram) -> Diagram:
        x = self.name
        if x not in axis_names(d):
            raise self.fail(f"no wire has axis {x}; axes here: {', '.join(sorted(axis_names(d)))}", axis=x)
        if not isinstance(self.s, int | sympy.Integer) or self.s <= 0:
            raise self.fail(f"stream size must be a positive integer, got {self.s!r}", axis=x)
        for w in d.dom.inside:
            for a in w.axes:
                if a.name == x and a.size.is_number and self.s > a.size:
                    raise self.fail(f"stream size {self.s} exceeds the axis size {a.size}", axis=x)
                if a.name == x and a.stream is not None:
                    raise self.fail(f"{x} is already streamed by {a.stream}", axis=x)
        fused = fuse_softmax_contract(d, x)
        streamability(fused, x, repr(self))
        return relabel_axis(fused, x, lambda a: a.streamed(self.s))
