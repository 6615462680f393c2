"""Recolouring (FAN §1: colours are memory levels): ``level(to)``.

rewrite: a kernel on HBM wires  →  loads of its inputs to ``to``, the kernel on ``to`` wires, stores
of its outputs back to HBM.

The loads and stores are :func:`napkin_cat.move` boxes, the colour changes that the cost functor
counts as transfers (multiplied by the trip counts of the enclosing tiles and streams).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> k = level(nc.SMEM)(nc.library.attention(q, x, d))
>>> [b.name for b in k.boxes][:3], [b.name for b in k.boxes][-1]
(['HBM→SMEM', 'HBM→SMEM', 'HBM→SMEM'], 'SMEM→HBM')
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat.diagram import Diagram, Ty
from napkin_cat.diagram import id as identity
from napkin_cat.generators import Move, move
from napkin_cat.levels import HBM, Level
from napkin_cat.levels import level as as_level
from rewrites._rule import Rule


def _moves(ty: Ty, to: Level) -> Diagram:
    out = identity(Ty())
    for w in ty.inside:
        out = out @ (move(w, to) if w.level != to else identity(w))
    return out


@dataclass(frozen=True)
class level(Rule):  # noqa: N801
    """Recolour the kernel's interior to memory level ``to``, with loads and stores at its boundary.

    >>> import napkin_cat as nc
    >>> level("SMEM")
    level(SMEM)
    >>> level(nc.HBM)(nc.library.attention(*nc.axes("q x d")))
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: level(HBM): the kernel's interior must move off HBM (choose SMEM or REG)
    """

    to: Level | str

    def __repr__(self):
        return f"level({as_level(self.to)})"

    def apply(self, d: Diagram) -> Diagram:
        """Moves onto ``to`` at the inputs, the whole diagram recoloured, moves back to HBM at the outputs.

        >>> import napkin_cat as nc
        >>> a, b, c = nc.axes("a b c")
        >>> smem = level("SMEM").apply(nc.library.matmul(a, b, c))
        >>> [w.level for w in smem.dom.inside + smem.cod.inside]
        [HBM, HBM, HBM]
        >>> sorted({box.cod.inside[0].level.name for box in smem.boxes})
        ['HBM', 'SMEM']
        """
        to = as_level(self.to)
        if to == HBM:
            raise self.fail("the kernel's interior must move off HBM (choose SMEM or REG)")
        if any(isinstance(b, Move) for b in d.boxes):
            raise self.fail("the diagram already has level changes; recolour the naive diagram")
        inner = d.map_arrays(lambda a: a.with_(level=to))
        return _moves(d.dom, to) >> inner >> _moves(inner.cod, HBM)
