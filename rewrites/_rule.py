"""Rules: relabellings as functions from diagrams to diagrams, with their side conditions.

A :class:`Rule` is a frozen value (printable, hashable); applying it to a diagram checks its side
conditions and returns the relabelled diagram or raises :class:`RewriteError` naming the rule, the
box, the axis and the condition that failed.
"""

from __future__ import annotations

import operator

from napkin_cat.diagram import Diagram
from napkin_cat.errors import NapkinError


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
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def __call__(self, d: Diagram) -> Diagram:
        return self.apply(d)

    def fail(self, condition: str, **where) -> RewriteError:
        """The :class:`RewriteError` of this rule for a failed ``condition`` at ``box=``/``axis=``."""
        return RewriteError(repr(self), condition, **where)


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
