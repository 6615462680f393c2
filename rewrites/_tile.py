"""The group partition (FAN relabelling 1): ``tile(a, g)``.

rewrite: a diagram weaved over ``a``  →  the same diagram with ``a`` relabelled ``(a/g) × g``.

One group of ``g`` runs per core; inputs not indexed by ``a`` are re-read by every group, which the
cost functor sees as their transfers multiplied by ``a/g``. Side conditions: ``a`` is on some wire,
no box removes ``a`` (the diagram is weaved over it), no reshape splits or merges it, and ``0 < g ≤ a`` where
``a`` is concrete. Sizes that ``g`` does not divide are handled exactly: the last group is ragged.

``tile(a, g, summed=True)`` also admits contractions that remove ``a`` where their sums go straight to outputs
(:func:`rewrites._schedule.summed_outputs`): each group's partial sum is added into the output (split-K across
the grid; FlashAttention-3's dQ, summed over the key tiles of the kernel that tiles keys).

``tile(a)`` (or ``tile(a, "auto")``) leaves ``g`` open: the diagram is relabelled by the symbol ``g_a``, its
cost and pseudocode stay sympy in it, ``derive`` verifies it at small random sizes, and
``lowering.lower`` chooses it for the hardware from the cost model (``kernel.tiles``).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> tiled = tile(q, 128)(nc.library.attention(q, x, d))
>>> print(tiled.cod)
q/128×d
>>> print(tile(q)(nc.library.attention(q, x, d)).cod)
q/g_q×d
>>> tile(d, 16)(nc.library.attention(q, x, d))  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
rewrites._rule.RewriteError: tile(d, 16): box 'q d, x d → q x', axis 'd': the box removes d, so the diagram is not ...
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat.diagram import Diagram
from napkin_cat.generators import Generator, Reshape
from rewrites._rule import AxisRule, axis_names, is_open, partition_size, relabel_axis
from rewrites._schedule import summed_outputs


@dataclass(frozen=True)
class tile(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """Group-partition axis ``axis`` into tiles of ``g``.

    ``g`` is any integral number > 0 (``int``, ``numpy.int64``, ``sympy.Integer``), or None / ``"auto"`` to leave
    it open (the symbol ``g_<axis>``); anything else is refused when the rule is made.

    >>> import numpy as np
    >>> tile("q", np.int64(16)), tile("q"), tile("q", "auto") == tile("q")
    (tile(q, 16), tile(q), True)
    >>> tile("q", 2.5)
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: tile(q, 2.5): axis 'q': group size must be a positive integer, got 2.5
    """

    g: int | str | None = None
    summed: bool = False

    def __post_init__(self):
        g = partition_size(repr(self), "group size", self.g, self.name, f"g_{self.name}")
        object.__setattr__(self, "g", g)

    def __repr__(self):
        size = "" if is_open(self.g) else f", {self.g}"
        return f"tile({self.name}{size}{', summed=True' if self.summed else ''})"

    def apply(self, d: Diagram) -> Diagram:
        """``d`` relabelled; with ``summed``, its contractions over the axis summing straight into outputs.

        >>> import napkin_cat as nc
        >>> from rewrites import derive
        >>> n, k, c = nc.axes("n k c")
        >>> split_k = derive(nc.library.matmul(n, k, c), tile(k, 4, summed=True), seed=0)
        >>> str(split_k.diagram.dom), split_k.steps[-1].verification.passed
        ('n×k/4 ⊗ k/4×c', True)
        """
        a = self.name
        if a not in axis_names(d):
            raise self.fail(f"no wire has axis {a}; axes here: {', '.join(sorted(axis_names(d)))}", axis=a)
        summing, why = summed_outputs(d, a) if self.summed else ((), None)
        if why:
            raise self.fail(why, axis=a)
        for box in d.boxes:
            if isinstance(box, Reshape) and a in box.mixes:
                raise self.fail(f"a reshape splits or merges {a}", box=box.name, axis=a)
            if summing and isinstance(box, Generator) and a in box.reduced:
                continue  # a sum straight into an output: each group's partial added (summed_outputs)
            if isinstance(box, Generator) and a in box.mixes:
                how = "removes" if a in box.reduced else "combines elements along"
                raise self.fail(f"the box {how} {a}, so the diagram is not weaved over it", box=box.name, axis=a)
        size = next(x.size for w in (*d.dom.inside, *d.cod.inside) for x in w.axes if x.name == a)
        if size.is_number and isinstance(self.g, int) and self.g > size:
            raise self.fail(f"group size {self.g} exceeds the axis size {size}", axis=a)
        for w in (*d.dom.inside, *d.cod.inside):
            for x in w.axes:
                if x.name == a and x.group is not None:
                    raise self.fail(f"{a} is already tiled by {x.group}", axis=a)
        return relabel_axis(d, a, lambda x: x.tiled(self.g))
