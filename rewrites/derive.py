"""Derivations: a diagram and the sequence of verified relabellings applied to it.

``derive(d, *rules)`` applies each rule in turn and verifies every step against the original
diagram's reference semantics (``rewrites.verify.check``). The final diagram is the *scheduled
diagram* the lowering consumes.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 8))
>>> [str(s.rule) for s in flash.steps]
['original', 'tile(q, 16)', 'stream(x, 8)']
>>> all(s.verification.passed for s in flash.steps[1:])
True
"""

from __future__ import annotations

from dataclasses import dataclass, field

from napkin_cat.diagram import Diagram
from rewrites.rule import Rule
from rewrites.verify import Verification, check


@dataclass(frozen=True)
class Step:
    """One step: the rule applied (or the starting diagram's name), the diagram after it, its check."""

    rule: Rule | str
    diagram: Diagram
    verification: Verification | None = None

    def __str__(self):
        return f"{self.rule}: {self.verification or 'the starting diagram'}"


@dataclass(frozen=True)
class Derivation:
    """A verified derivation; ``.diagram`` is its scheduled diagram."""

    steps: tuple[Step, ...] = field(default_factory=tuple)

    @property
    def diagram(self) -> Diagram:
        return self.steps[-1].diagram

    @property
    def original(self) -> Diagram:
        return self.steps[0].diagram

    def then(self, *rules: Rule, verify: bool = True) -> Derivation:
        """This derivation extended by more rules."""
        steps = list(self.steps)
        for rule in rules:
            new = rule(steps[-1].diagram)
            steps.append(Step(rule, new, check(self.original, new, rule=repr(rule)) if verify else None))
        return Derivation(tuple(steps))

    def cost(self, hardware=None):
        """The cost of each step's diagram (``napkin_cat.cost``), as a list."""
        from napkin_cat.cost import cost

        return [cost(s.diagram, hardware) if hardware is not None else cost(s.diagram) for s in self.steps]

    def pseudocode(self) -> str:
        """The expanded loop program of the scheduled diagram (FAN §5)."""
        from rewrites.pseudocode import pseudocode

        return pseudocode(self.diagram)

    def draw(self, path: str, **kwargs):
        """The derivation as a sequence of pictures, one per step, titled by its rule."""
        from napkin_cat.drawing import draw_sequence

        return draw_sequence([s.diagram for s in self.steps], path, titles=[str(s.rule) for s in self.steps], **kwargs)

    def __str__(self):
        return "\n".join(f"{i}. {s}" for i, s in enumerate(self.steps))


def derive(d: Diagram, *rules: Rule, name: str | None = None, verify: bool = True) -> Derivation:
    """Apply ``rules`` to ``d`` in order, verifying each step (see :mod:`rewrites.verify`)."""
    return Derivation((Step(name or "original", d),)).then(*rules, verify=verify)
