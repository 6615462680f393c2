"""The stream partition (FAN relabelling 2) and the Fusion Theorem as a checkable predicate.

rewrite: a diagram streamable along ``x``  →  the same diagram with ``x`` relabelled to chunks of ``s``.

A diagram is streamable along ``x`` (FAN §3) when every box that reads ``x`` either keeps it and
is weaved over it (it runs per chunk: it combines no elements along ``x``) or removes it through an
accumulator ``B(f(a), b) = f(a ⊕ b)``, and no wire carrying ``x`` reaches a box after the reduction. A
wire carrying ``x`` may leave the diagram where it is computed from chunks alone (no completed reduction on
its way): each chunk's slice of it is then written once, as a tiled axis's blocks are (a backward's ``dW``
of a streamed vocabulary, beside the ``dh`` the stream accumulates). Composition and weaving preserve this
(the Fusion Theorem), so the check is local to boxes and wires; what it accepts is streamable by construction,
what it refuses is named.

``stream(x, s)`` is the composite ``fuse_softmax(x) ; relabel``: before checking, it applies the rule
:class:`fuse_softmax` (FAN's softmax-contraction lemma): a softmax over ``x`` whose output reaches a
contraction over ``x`` becomes one streamable box (online softmax). A softmax that stays unfused would be
normalised per chunk, so it is refused. Writing ``fuse_softmax(x)`` before ``stream(x, s)`` in a derivation
shows and verifies the fusion as its own step; the lemma is verified per generator in
``tests/test_lowering_rules.py``.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> flash = stream(x, 64)(nc.library.attention(q, x, d))
>>> [b.name for b in flash.boxes]
['q d, x d → q x', 'softmax·contract x']
>>> stream(x, 64)(nc.library.softmax(q, x))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
rewrites._rule.RewriteError: stream(x, 64): box 'softmax x', axis 'x': softmax over x is not followed by a ...
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from napkin_cat.diagram import Copy, Diagram, Swap, Ty
from napkin_cat.diagram import id as identity
from napkin_cat.diagram import swap as swap_wires
from napkin_cat.generators import (
    Contract,
    Dropout,
    Elementwise,
    Generator,
    Reshape,
    Softmax,
    SoftmaxContract,
    cast,
    elementwise,
)
from rewrites._rule import AxisRule, RewriteError, axis_names, is_open, partition_size, relabel_axis


def _linear_factor(box) -> sympy.Expr | None:
    """The constant ``c`` when ``box`` is the pointwise linear map ``v ↦ c·v`` on one wire of one type, else None."""
    if not isinstance(box, Elementwise) or len(box.dom) != 1 or box.dom != box.cod:
        return None
    p = box.params
    if p["fn"] == "neg":
        return sympy.Integer(-1)
    if p["fn"] == "multiply" and "const" in p:
        return p["const"]
    if p["fn"] == "divide" and "const" in p:
        return 1 / p["const"]
    return None


@dataclass(frozen=True)
class _Path:
    """Where the output of a box goes: through swaps and linear scales (layers ``scales``) to input
    ``port`` of layer ``layer`` (None: it leaves the diagram at output ``port``)."""

    layer: int | None
    port: int
    scales: tuple[int, ...]
    dropout: int | None = None  # the layer of a dropout the probabilities pass through (port 0)


def _follow(d: Diagram, i: int, pos: int) -> _Path:
    """Follow the wire at ``pos`` after layer ``i`` forward through swaps and constant scales."""
    scales, dropout = [], None
    for j in range(i + 1, len(d.inside)):
        left, box, _ = d.inside[j]
        n = len(left)
        if pos < n:
            continue
        if pos >= n + len(box.dom):
            pos += len(box.cod) - len(box.dom)
            continue
        port = pos - n
        if isinstance(box, Swap):
            k = len(box.left)
            pos = n + (len(box.right) + port if port < k else port - k)
        elif _linear_factor(box) is not None:
            scales.append(j)
        elif isinstance(box, Dropout) and port == 0 and dropout is None:
            dropout = j  # linear in the probabilities, one factor per element: it commutes with a row's rescaling
        else:
            return _Path(j, port, tuple(scales), dropout)
    return _Path(None, pos, tuple(scales), dropout)


def _fusable(d: Diagram, i: int, axis: str) -> _Path | None:
    """The path from the softmax at layer ``i`` to a contraction the lemma covers, or None."""
    left, _, _ = d.inside[i]
    path = _follow(d, i, len(left))
    if path.layer is None:
        return None
    left2, consumer, _ = d.inside[path.layer]
    if not (isinstance(consumer, Contract) and axis in consumer.reduced and len(consumer.dom) == 2):
        return None
    if path.dropout is not None:  # dropout right before the contraction, its seed beside the values: P ⊗ seed ⊗ V
        left_d, drop, right_d = d.inside[path.dropout]
        adjacent = path.layer == path.dropout + 1 and path.port == 0 and len(left_d) == len(left2)
        if not (adjacent and len(right_d) and right_d.inside[0] == consumer.dom.inside[1]):
            return None
    return path if consumer.dom.inside[1 - path.port].has(axis) else None


def _reached(d: Diagram, i: int) -> str:
    """What the output of the box at layer ``i`` reaches after swaps and constant scales, for messages."""
    left, _, _ = d.inside[i]
    path = _follow(d, i, len(left))
    if path.layer is None:
        return f"its output leaves the diagram as output wire {path.port}"
    box = d.inside[path.layer][1]
    if isinstance(box, Copy):
        return "its output is copied"
    return f"its output reaches {box.name!r}"


def _fuse_one(d: Diagram, i: int, path: _Path, axis: str) -> Diagram:
    """Replace the softmax at layer ``i`` and the contraction at ``path.layer`` by one softmax·contract box."""
    _, softmax, _ = d.inside[i]
    l2, contraction, r2 = d.inside[path.layer]
    s_in, p = softmax.dom.inside[0], softmax.cod.inside[0]
    v = contraction.dom.inside[1 - path.port]
    factor = sympy.Mul(*(_linear_factor(d.inside[j][1]) for j in path.scales))
    if contraction.params.get("scale") is not None:
        factor *= contraction.params["scale"]
    out = contraction.cod.inside[0]
    name = f"softmax·contract {axis}"
    # The scores keep the softmax's place; the constant factor moves past the contraction, which is linear.
    unscaled = out if factor == 1 else out.with_(dtype=p.dtype)
    replaced = {}
    if path.dropout is None:
        fused: Diagram = SoftmaxContract(name, p @ v, unscaled, data=(("axis", axis),))
    else:  # P ⊗ seed ⊗ V → O, one box where the dropout met the contraction; nothing left at the contraction
        drop, seed = d.inside[path.dropout][1], d.inside[path.dropout][1].dom.inside[1]
        data, name = (("axis", axis), ("dropout", drop.drop)), f"softmax·{drop.drop.__name__}·contract {axis}"
        fused = identity(p) @ swap_wires(seed, v) >> SoftmaxContract(name, p @ v @ seed, unscaled, data=data)
    if factor != 1:
        fused = fused >> elementwise("multiply", fused.cod.inside[0], const=factor, out=out)
    if path.port == 1:
        fused = swap_wires(v, p) >> fused
    if path.dropout is None:
        replaced[path.layer] = fused
    else:
        replaced |= {path.dropout: fused, path.layer: identity(fused.cod)}
    replaced[i] = cast(s_in, p.dtype) if s_in != p else identity(p)
    replaced |= {j: identity(d.inside[j][1].dom) for j in path.scales}
    parts = [
        identity(left) @ replaced.get(j, box) @ identity(right if j != path.dropout else Ty(*right.inside[1:]))
        for j, (left, box, right) in enumerate(d.inside)
    ]
    return identity(d.dom).then(*parts)


def fuse_softmax_contract(d: Diagram, axis: str) -> Diagram:
    """FAN's softmax-contraction lemma: ``softmax_x ; contract_x`` becomes one streamable box.

    rewrite: softmax over x, then swaps and constant scales, then a contraction removing x
    →  softmax·contract x, then the product of the constants.

    Side conditions: the softmax's output is read by nothing but swaps, pointwise maps ``v ↦ c·v``
    (``scale``, ``neg``, division by a constant) and finally a two-operand contraction removing
    ``axis`` whose other operand has ``axis``. The contraction is linear in the softmax, so the
    constants move past it (the contraction's own scale joins them). One :class:`~napkin_cat.generators.Dropout`
    may come right before the contraction, its seed between the probabilities and the values (``P ⊗ seed ⊗ V``):
    it multiplies each probability by a factor of its own, so it commutes with the online softmax's rescaling of a
    row by one factor, and moves into the fused box (``softmax·dropout·contract``), which drops the normalised
    probabilities, not the normaliser. Any other softmax over ``axis`` is left as it is (:func:`streamability` then
    refuses it by name).

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> S, V = nc.Array(q, x), nc.Array(x, d)
    >>> scaled = (nc.softmax(S, x) >> nc.scale(S, 2)) @ V >> nc.contract("q x, x d -> q d", q, x, d)
    >>> [b.name for b in fuse_softmax_contract(scaled, "x").boxes]
    ['softmax·contract x', 'multiply 2']
    """
    while True:
        for i, (_, box, _) in enumerate(d.inside):
            if isinstance(box, Softmax) and box.params["axis"] == axis:
                path = _fusable(d, i, axis)
                if path is not None:
                    d = _fuse_one(d, i, path, axis)
                    break
        else:
            return d


@dataclass(frozen=True, repr=False)
class fuse_softmax(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """FAN's softmax-contraction lemma along ``axis`` (:func:`rewrites.fuse_softmax_contract`).

    rewrite: softmax_x ; [swaps, c·] ; contract_x  →  softmax·contract_x ; c·

    Side conditions: ``axis`` is on some wire; each softmax over it is fused where its output reaches, through
    swaps and constant scales only, a two-operand contraction removing ``axis`` (others are left, and
    ``stream`` names them). ``stream(x, s)`` applies this rule before relabelling; writing it as its own step
    of a derivation verifies it alone (``stream`` then has nothing left to fuse).

    >>> import napkin_cat as nc
    >>> from rewrites import derive
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), fuse_softmax(x), stream(x, 8), seed=0)
    >>> [str(s.rule) for s in flash.steps], [b.name for b in flash.steps[1].diagram.boxes]
    (['original', 'fuse_softmax(x)', 'stream(x, 8)'], ['q d, x d → q x', 'softmax·contract x'])
    """

    def apply(self, d: Diagram) -> Diagram:
        x = self.name
        if x not in axis_names(d):
            raise self.fail(f"no wire has axis {x}; axes here: {', '.join(sorted(axis_names(d)))}", axis=x)
        return fuse_softmax_contract(d, x)


def streamability(d: Diagram, axis: str, rule: str = "stream") -> list:
    """Check the Fusion Theorem's conditions; return the accumulators of the boxes that remove ``axis``.

    Raises :class:`RewriteError` naming the box and the failed condition.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> [type(a).__name__ for a in streamability(nc.library.matmul(q, x, d), "x")]
    ['ContractionSum']
    >>> streamability(nc.library.layer_norm(q, x), "x")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: stream: box ..., axis 'x': it needs both a chunk of x and a completed reduction ...
    """
    carried = [w.has(axis) for w in d.dom.inside]  # wires carrying the axis (chunked)
    after = [False] * len(d.dom)  # wires computed from a completed reduction
    accumulators = []
    for i, (left, box, _) in enumerate(d.inside):
        n, k = len(left), len(box.dom)
        ins_c, ins_a = carried[n : n + k], after[n : n + k]
        if isinstance(box, Swap):
            out_c, out_a = ins_c[::-1], ins_a[::-1]
        elif isinstance(box, Copy):
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
            if any(ins_c) and keeps and isinstance(box, Generator) and axis in box.mixes:
                raise RewriteError(rule, _per_chunk(d, i, axis), box=box.name, axis=axis)
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
    for i, (c, a, w) in enumerate(zip(carried, after, d.cod.inside, strict=True)):
        if c and a:  # a chunk's slice of it needs the whole reduction: a second pass
            raise RewriteError(
                rule,
                f"output wire {i} ({w.describe()}) carries {axis} out of the stream and is computed from a "
                f"completed reduction over {axis}: two passes, not one stream",
                box=_producer(d, i),
                axis=axis,
            )
    if not accumulators:
        raise RewriteError(rule, f"no box removes {axis}: there is nothing to accumulate", axis=axis)
    return accumulators


def _per_chunk(d: Diagram, i: int, axis: str) -> str:
    """Why the box at layer ``i``, which combines elements along ``axis`` and keeps it, cannot run per chunk."""
    if isinstance(d.inside[i][1], Softmax):
        return (
            f"softmax over {axis} is not followed by a contraction over {axis} ({_reached(d, i)}; only swaps and "
            f"constant scales may come between), so its normaliser would be computed per chunk"
        )
    return f"the box combines elements along {axis} and keeps it, so per chunk it would see only part of {axis}"


def _producer(d: Diagram, pos: int) -> str:
    """The name of the box producing output wire ``pos``, looking through copies and swaps."""
    j = len(d.inside)
    while True:
        i, port = d.producer(j, pos)
        if i is None:
            return "input"
        left, box, _ = d.inside[i]
        if not isinstance(box, Copy | Swap):
            return box.name
        j, pos = i, len(left) + (len(box.dom) - 1 - port if isinstance(box, Swap) else 0)


@dataclass(frozen=True)
class stream(AxisRule):  # noqa: N801
    """Stream-partition axis ``axis`` into chunks of ``s`` through the accumulators of the boxes removing it.

    ``s`` is any integral number > 0 (``int``, ``numpy.int64``, ``sympy.Integer``), or None / ``"auto"`` to leave
    it open (the symbol ``s_<axis>``, chosen by ``lowering.lower`` from the cost model); anything else is
    refused when the rule is made.

    >>> import numpy as np
    >>> stream("x", np.int64(64)), stream("x"), stream("x", "auto") == stream("x")
    (stream(x, 64), stream(x), True)
    >>> stream("x", 0)
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: stream(x, 0): axis 'x': stream size must be a positive integer, got 0
    """

    s: int | str | None = None

    def __post_init__(self):
        object.__setattr__(self, "s", partition_size(repr(self), "stream size", self.s, self.name, f"s_{self.name}"))

    def __repr__(self):
        return f"stream({self.name})" if is_open(self.s) else f"stream({self.name}, {self.s})"

    def apply(self, d: Diagram) -> Diagram:
        x = self.name
        if x not in axis_names(d):
            raise self.fail(f"no wire has axis {x}; axes here: {', '.join(sorted(axis_names(d)))}", axis=x)
        for w in d.dom.inside:
            for a in w.axes:
                if a.name == x and a.size.is_number and isinstance(self.s, int) and self.s > a.size:
                    raise self.fail(f"stream size {self.s} exceeds the axis size {a.size}", axis=x)
                if a.name == x and a.stream is not None:
                    raise self.fail(f"{x} is already streamed by {a.stream}", axis=x)
        fused = fuse_softmax(x)(d)  # the lemma, as its own rule (a derivation may also write it as a step)
        streamability(fused, x, repr(self))
        return relabel_axis(fused, x, lambda a: a.streamed(self.s))
