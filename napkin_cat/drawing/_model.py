"""The display list: strokes, shapes, dots and labels in inches (y grows downwards), and text metrics.

A picture is a flat tuple of these items; the layout makes it, the figure module arranges several
side by side, and the backends render it. Nothing here knows about diagrams.

>>> pic = Picture((Stroke(((0.0, 0.0), (1.0, 0.0)), "black"), Label(0.5, -0.1, "q·d", 8.0)), frozenset())
>>> x0, y0, x1, y1 = pic.shifted(1.0, 0.0).bounds()
>>> (x0, x1), y0 < -0.1 and y1 == 0.0
((1.0, 2.0), True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

from napkin_cat.levels import Level

# Geometry in inches, type in points.
ROW = 0.6  # between neighbouring wires
PAD = 0.2  # a box reaches this far beyond its outermost ports
WIRE_WIDTH, EDGE_WIDTH = 1.8, 1.0
WIRE_FONT, BOX_FONT, SMALL_FONT, TITLE_FONT, SYMBOL_FONT = 8.0, 8.5, 7.0, 10.0, 18.0
FONT = "DejaVu Sans"  # ships with matplotlib, so every machine measures and renders the same
DPI = 150
MAX_WIDTH = 15.5  # a picture wider than this wraps into bands: 2,325 px at DPI


@dataclass(frozen=True)
class Stroke:
    """A wire: a polyline, or (``curved``) a chain of cubic Béziers ``p0 c1 c2 p1 c1 c2 p2 …``."""

    points: tuple[tuple[float, float], ...]
    colour: str
    width: float = WIRE_WIDTH
    curved: bool = False


@dataclass(frozen=True)
class Shape:
    """A closed polygon; ``rounded`` > 0 rounds its corners (used for rectangles only)."""

    points: tuple[tuple[float, float], ...]
    face: str
    edge: str = "black"
    width: float = EDGE_WIDTH
    dashed: bool = False
    rounded: float = 0.0


@dataclass(frozen=True)
class Dot:
    """A filled disc: where a wire is copied."""

    centre: tuple[float, float]
    radius: float
    colour: str


@dataclass(frozen=True)
class Label:
    """Text centred vertically at ``y``; ``anchor`` is where ``x`` is: ``west``, ``center`` or ``east``."""

    x: float
    y: float
    text: str
    size: float
    anchor: str = "center"
    bold: bool = False
    colour: str = "black"


Item = Stroke | Shape | Dot | Label


@dataclass(frozen=True)
class Picture:
    """Display items in inches (y grows downwards) and the memory levels their wires use."""

    items: tuple[Item, ...]
    levels: frozenset[Level]
    partitioned: bool = False

    def bounds(self) -> tuple[float, float, float, float]:
        """The smallest rectangle ``(x0, y0, x1, y1)`` holding every item, text included."""
        boxes = [extent(item) for item in self.items] or [(0.0, 0.0, 0.0, 0.0)]
        return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))

    def shifted(self, dx: float, dy: float) -> Picture:
        """The same picture moved by ``(dx, dy)`` inches."""
        return replace(self, items=tuple(shift(item, dx, dy) for item in self.items))


def shift(item: Item, dx: float, dy: float) -> Item:
    """``item`` moved by ``(dx, dy)``.

    >>> shift(Dot((0.0, 0.0), 0.1, "black"), 1.0, 2.0).centre
    (1.0, 2.0)
    """
    if isinstance(item, Stroke | Shape):
        return replace(item, points=tuple((x + dx, y + dy) for x, y in item.points))
    if isinstance(item, Dot):
        return replace(item, centre=(item.centre[0] + dx, item.centre[1] + dy))
    return replace(item, x=item.x + dx, y=item.y + dy)


def extent(item: Item) -> tuple[float, float, float, float]:
    """The rectangle ``(x0, y0, x1, y1)`` an item covers, text measured in the house font.

    >>> extent(Stroke(((0.0, 1.0), (2.0, 0.5)), "black"))
    (0.0, 0.5, 2.0, 1.0)
    """
    if isinstance(item, Stroke | Shape):
        xs, ys = [p[0] for p in item.points], [p[1] for p in item.points]
        return min(xs), min(ys), max(xs), max(ys)
    if isinstance(item, Dot):
        (x, y), r = item.centre, item.radius
        return x - r, y - r, x + r, y + r
    w, h = text_size(item.text, item.size)
    left = {"west": item.x, "center": item.x - w / 2, "east": item.x - w}[item.anchor]
    return left, item.y - h / 2, left + w, item.y + h / 2


@lru_cache(maxsize=4096)
def text_size(text: str, size: float) -> tuple[float, float]:
    """Width and height of ``text`` in inches at ``size`` points, one line per ``\\n``.

    >>> w, h = text_size("q×d", 8); 0.1 < w < 0.4 and 0.1 < h < 0.2
    True
    """
    font = FontProperties(family=FONT, size=size)
    lines = text.split("\n")
    widths = [TextToPath().get_text_width_height_descent(line, font, ismath=False)[0] for line in lines]
    return max(widths) / 72, len(lines) * size * 1.25 / 72
