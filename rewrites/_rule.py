"""Rules: relabellings as functions from diagrams to diagrams, with their side conditions.

A :class:`Rule` is a frozen value (printable, hashable); applying it to a diagram checks its side
conditions and returns the relabelled diagram or raises :class:`RewriteError` naming the rule, the
box, the axis and the condition that failed.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, fields
from typing import NamedTuple

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Diagram
from napkin_cat.errors import NapkinError
from napkin_cat.generators import Generator

#: what ``tile(a, AUTO)`` / ``stream(x, AUTO)`` (or no size at all) write: the size is left open
AUTO = "auto"


class RewriteError(NapkinError, ValueError):
    """A rewrite's side condition or verification failed.

    >>> str(RewriteError("stream(x, 64)", "x is reduced nowhere", box="softmax x", axis="x"))
    "stream(x, 64): box 'softmax x', axis 'x': x is reduced nowhere"
    """

    def __init__(self, rule: str, condition: str, *, box: str | None = None, axis: str | None = None):
        self.rule, self.condition, self.box, self.axis = rule, condition, box, axis
        where = "".join(f"{k} {v!r}, " for k, v in (("box", box), ("axis", axis)) if v is not None)
        super().__init__(f"{rule}: {where.rstrip(', ')}{': ' if where else ''}{condition}")


class Rule:
    """A relabelling. Subclasses implement :meth:`apply` (side conditions, then the new diagram).

    >>> class identity(Rule):
    ...     def __repr__(self): return "identity"
    ...     def apply(self, d): return d
    >>> import napkin_cat as nc
    >>> attn = nc.library.attention(*nc.axes("q x d"))
    >>> identity()(attn) is attn
    True
    >>> str(identity().fail("always", axis="q"))
    "identity: axis 'q': always"
    """

    def apply(self, d: Diagram) -> Diagram:
        """Check the rule's side conditions on ``d`` and return the relabelled diagram, or raise
        :class:`RewriteError` naming the box, the axis and the failed condition (see :class:`Rule`)."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def __call__(self, d: Diagram) -> Diagram:
        return self.apply(d)

    def fail(self, condition: str, **where) -> RewriteError:
        """The :class:`RewriteError` of this rule for a failed ``condition`` at ``box=``/``axis=``."""
        return RewriteError(repr(self), condition, **where)


@dataclass(frozen=True, repr=False)
class AxisRule(Rule):
    """A relabelling of one axis, given as an :class:`~napkin_cat.Axis` or its name; printed as its name
    applied to the axis's name and its other fields in order.

    >>> @dataclass(frozen=True, repr=False)
    ... class halve(AxisRule):
    ...     by: int = 2
    ...     def apply(self, d): return d
    >>> import napkin_cat as nc
    >>> halve(nc.Axis("q")), halve("q", 4).name
    (halve(q, 2), 'q')
    """

    axis: Axis | str

    @property
    def name(self) -> str:
        """The axis's name."""
        return getattr(self.axis, "name", self.axis)

    def __repr__(self):
        rest = (str(getattr(self, f.name)) for f in fields(self)[1:])
        return f"{type(self).__name__}({', '.join([self.name, *rest])})"


def positive_size(rule: str, what: str, value, axis: str) -> int:
    """``value`` as an ``int`` if it is an integral number > 0 (Python, NumPy or sympy), else a :class:`RewriteError`.

    >>> import numpy as np
    >>> positive_size("tile(q, 16)", "group size", np.int64(16), "q")
    16
    >>> positive_size("tile(q, 2.5)", "group size", 2.5, "q")
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: tile(q, 2.5): axis 'q': group size must be a positive integer, got 2.5
    """
    try:
        n = operator.index(value)
    except TypeError:
        n = None
    if n is None or isinstance(value, bool):
        raise RewriteError(rule, f"{what} must be a positive integer, got {value!r}", axis=axis)
    if n <= 0:
        raise RewriteError(rule, f"{what} must be a positive integer, got {n}", axis=axis)
    return n


def is_open(value) -> bool:
    """Whether a partition size given to a rule leaves it open: None, ``"auto"`` or its symbol.

    >>> is_open(None), is_open("auto"), is_open(64)
    (True, True, False)
    """
    return value is None or isinstance(value, sympy.Symbol) or (isinstance(value, str) and value == AUTO)


def partition_size(rule: str, what: str, value, axis: str, symbol: str) -> int | sympy.Symbol:
    """``value`` as an ``int`` (see :func:`positive_size`), or, when it is None or ``"auto"``, the open size:
    the positive integer symbol ``symbol`` that the cost stays sympy in until ``lower`` resolves it.

    >>> partition_size("tile(q)", "group size", None, "q", "g_q")
    g_q
    >>> partition_size("tile(q, 8)", "group size", 8, "q", "g_q")
    8
    """
    if is_open(value):
        return sympy.Symbol(symbol, positive=True, integer=True)
    return positive_size(rule, what, value, axis)


class OpenSize(NamedTuple):
    """A partition size a derivation left open: its symbol, the rule that left it (``tile`` or ``stream``)
    and the axis.

    >>> import sympy
    >>> print(OpenSize(sympy.Symbol("g_q"), "tile", "q"))
    tile(q)
    """

    symbol: sympy.Symbol
    rule: str
    axis: str

    def __str__(self):
        return f"{self.rule}({self.axis})"


def open_sizes(d: Diagram) -> tuple[OpenSize, ...]:
    """The partition sizes of ``d`` left open (``tile(q)``, ``stream(x, "auto")``), in wire order.

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> [str(o) for o in open_sizes(stream(x)(tile(q)(nc.library.attention(q, x, d))))]
    ['tile(q)', 'stream(x)']
    >>> open_sizes(tile(q, 16)(nc.library.attention(q, x, d)))
    ()
    """
    found: dict = {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            for rule, size in (("tile", a.group), ("stream", a.stream)):
                if size is not None and not size.is_number:
                    found.setdefault(size, OpenSize(size, rule, a.name))
    return tuple(found.values())


def resolve(d: Diagram, sizes: dict) -> Diagram:
    """``d`` with open partition sizes bound: ``sizes`` maps their symbols' names (``"g_q"``, ``"s_x"``) to sizes.

    >>> import napkin_cat as nc
    >>> from rewrites import tile
    >>> q, x, d = nc.axes("q x d")
    >>> print(resolve(tile(q)(nc.library.attention(q, x, d)), {"g_q": 64}).cod)
    q/64×d
    """
    bind = {o.symbol: sympy.Integer(sizes[o.symbol.name]) for o in open_sizes(d) if o.symbol.name in sizes}
    if not bind:
        return d

    def label(v):
        return v if v is None else v.xreplace(bind)

    def axis(a):
        return a if a.group is None and a.stream is None else a.tiled(label(a.group)).streamed(label(a.stream))

    return d.map_arrays(lambda w: w.with_(axes=[axis(a) for a in w.axes]))


def bind_sizes(d: Diagram, sizes: dict) -> Diagram:
    """``d`` with the sizes of the axes named in ``sizes`` bound to those integers, on every wire and in every
    box's parameters (attention's scale 1/√d): what a call's arrays say, fixed in the diagram, so that what
    depends on them (a backend's registers and shared memory) is known when it is lowered.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> bound = bind_sizes(nc.library.attention(q, x, d), {"d": 64})
    >>> bound.dom.inside[0].axis("d").size, [str(b.params["scale"]) for b in bound.boxes if "scale" in b.params]
    (64, ['1/8'])
    """
    symbols = {s for w in (*d.dom.inside, *d.cod.inside) for a in w.axes for s in a.size.free_symbols}
    bind = {s: sympy.Integer(sizes[str(s)]) for s in symbols if str(s) in sizes}
    if not bind:
        return d

    def axis(a):
        size = a.size.xreplace(bind)
        return a if size == a.size else Axis(a.name, size, group=a.group, stream=a.stream, split=a.split)

    def box(b):
        if not isinstance(b, Generator) or not b.data:
            return b
        data = tuple((k, v.xreplace(bind) if isinstance(v, sympy.Basic) else v) for k, v in b.data)
        return type(b)(b.name, b.dom, b.cod, data=data)

    sized = d.map_arrays(lambda w: w.with_(axes=[axis(a) for a in w.axes]))
    return sized.with_layers((left, box(b), right) for left, b, right in sized.inside)


def axis_names(d: Diagram) -> set[str]:
    """Every axis name on some wire of ``d``.

    >>> import napkin_cat as nc
    >>> sorted(axis_names(nc.library.attention(*nc.axes("q x d"))))
    ['d', 'q', 'x']
    """
    wires = [*d.dom.inside, *d.cod.inside, *(w for b in d.boxes for w in (*b.dom.inside, *b.cod.inside))]
    return {n for w in wires for n in w.names}


def relabel_axis(d: Diagram, name: str, f) -> Diagram:
    """Apply ``f`` to the axis called ``name`` on every wire (a functor on objects).

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> print(relabel_axis(nc.library.attention(q, x, d), "q", lambda a: a.tiled(8)).cod)
    q/8×d
    """
    return d.map_arrays(lambda a: a.with_(axes=[f(x) if x.name == name else x for x in a.axes]) if a.has(name) else a)
