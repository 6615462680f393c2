"""Memory levels, the colours of wires (FAN §1: black HBM, orange SMEM, green registers, blue tensor cores).

Levels are ordered from the largest, slowest memory to the smallest, fastest one.
A transfer is a change of colour along a wire.

>>> HBM < SMEM < REG
True
>>> SMEM.colour
'orange'
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, order=True)
class Level:
    """A memory level: ``depth`` 0 is the outermost (HBM); larger is closer to compute.

    >>> HBM.depth < SMEM.depth < REG.depth, SMEM.colour
    (True, 'orange')
    """

    depth: int
    name: str = field(compare=False)
    colour: str = field(compare=False)

    def __repr__(self) -> str:
        return self.name


HBM = Level(0, "HBM", "black")
L2 = Level(1, "L2", "grey")
SMEM = Level(2, "SMEM", "orange")
REG = Level(3, "REG", "green")
TC = Level(4, "TC", "blue")

LEVELS = (HBM, L2, SMEM, REG, TC)


def level(name: str | Level) -> Level:
    """Look a level up by name.

    >>> level("smem")
    SMEM
    """
    if isinstance(name, Level):
        return name
    for lv in LEVELS:
        if lv.name.lower() == str(name).lower():
            return lv
    from napkin_cat.errors import NapkinError

    raise NapkinError(f"unknown memory level {name!r}; known: {', '.join(lv.name for lv in LEVELS)}")
