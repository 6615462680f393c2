"""The warpgroup split (FAN's group partition one level below the thread block): ``split(a, w)``.

rewrite: a diagram tiled over ``a`` (``a/g``)  →  the same diagram with each group of ``a`` split over ``w``
warpgroups, ``a → (a/g) × w × (g/w)``, drawn ``a/g÷w``.

A group runs on one thread block; its ``g`` rows are divided among ``w`` consumer warpgroups, each holding
``g/w`` rows in its own registers (FAN §1.3 row 14: registers per warpgroup set how many fit an SM). The
values computed are the same: like ``tile``, only the labels change. Side conditions: ``a`` is tiled, not
already split, and ``w`` divides ``g`` where ``g`` is concrete. The cost functor prices it (register memory
per warpgroup, :attr:`napkin_cat.Cost.warpgroups`) and the Mosaic GPU lowering reads it as its number of
consumer warpgroups.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 256), split(q, 2), stream(x, 64), verify=False)
>>> print(flash.diagram.cod)
q/256÷2×d
>>> split(q, 2)(nc.library.attention(q, x, d))
Traceback (most recent call last):
...
rewrites._rule.RewriteError: split(q, 2): axis 'q': q is not tiled; split divides a tile, so tile q first
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat.diagram import Diagram
from rewrites._rule import AxisRule, axis_names, positive_size, relabel_axis


@dataclass(frozen=True, repr=False)
class split(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """Split each tile of ``axis`` over ``w`` warpgroups (``w`` a positive integer).

    >>> split("q", 2)
    split(q, 2)
    >>> split("q", 0)
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: split(q, 0): axis 'q': number of warpgroups must be a positive integer, got 0
    """

    w: int = 2

    def __post_init__(self):
        object.__setattr__(self, "w", positive_size(repr(self), "number of warpgroups", self.w, self.name))

    def apply(self, d: Diagram) -> Diagram:
        """Relabel every wire holding ``axis``; refused unless it is tiled by a group that ``w`` divides.

        >>> import napkin_cat as nc
        >>> from rewrites import tile
        >>> q, x, d = nc.axes("q x d")
        >>> split(q, 3)(tile(q, 128)(nc.library.attention(q, x, d)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rewrites._rule.RewriteError: split(q, 3): axis 'q': a tile of 128 does not split into 3 equal parts ...
        """
        a = self.name
        if a not in axis_names(d):
            raise self.fail(f"no wire has axis {a}; axes here: {', '.join(sorted(axis_names(d)))}", axis=a)
        labelled = [x for w in (*d.dom.inside, *d.cod.inside) for x in w.axes if x.name == a]
        if not labelled or labelled[0].group is None:
            raise self.fail(f"{a} is not tiled; split divides a tile, so tile {a} first", axis=a)
        if labelled[0].split is not None:
            raise self.fail(f"{a} is already split over {labelled[0].split} warpgroups", axis=a)
        g = labelled[0].group
        if g.is_number and int(g) % self.w:
            raise self.fail(f"a tile of {g} does not split into {self.w} equal parts (one per warpgroup)", axis=a)
        return relabel_axis(d, a, lambda x: x.divided(self.w))
