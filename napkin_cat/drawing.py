"""Drawing: neural-circuit-diagram pictures of diagrams (DESIGN, Semantics 3).

Wires run left to right in their memory level's colour (FAN §1: HBM black, L2 grey, SMEM orange,
REG green, TC blue) and are labelled with their axes, partition labels included (``q/128`` tiled,
``x~64`` streamed), and their dtype where it is not f32. Each generator family has its own shape:
contractions are plain boxes, elementwise maps rounded ones, reductions and softmaxes trapezoids,
masks and score modifiers dashed boxes, casts and reshapes parallelograms; a move between levels is
a colour change marked by a triangle, a copy a dot, a discard a ground, a swap a crossing.

The layout is computed here in one walk over the diagram's layers (linear in boxes) into a small
display list, which two backends render: matplotlib (PNG, SVG, PDF; headless, deterministic bytes)
and TikZ. Pictures side by side make rewrites' before/after figures and derivations' sequences.

>>> import pathlib, tempfile
>>> from napkin_cat import axes, library
>>> q, x, d = axes("q x d")
>>> attn = library.attention(q, x, d)
>>> tmp = pathlib.Path(tempfile.mkdtemp())
>>> _ = draw(attn, tmp / "attention.svg", title="attention")
>>> svg = (tmp / "attention.svg").read_text()
>>> all(label in svg for label in (wire_label(attn.cod.inside[0]), "softmax x", "HBM"))
True
>>> print(draw(attn, to_tikz=True).splitlines()[1])
\\begin{tikzpicture}[x=1in, y=-1in]
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import matplotlib
from discopy import markov
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.font_manager import FontProperties
from matplotlib.patches import Circle, FancyBboxPatch, PathPatch, Polygon
from matplotlib.path import Path as MplPath
from matplotlib.textpath import TextToPath

from napkin_cat.convolution import Concat, Conv, Rename
from napkin_cat.diagram import Array, Diagram
from napkin_cat.dtypes import f32
from napkin_cat.errors import NapkinError
from napkin_cat.generators import (
    Cast,
    Contract,
    Elementwise,
    IndexMap,
    Mask,
    Move,
    NormalisedContract,
    Reduce,
    Reshape,
    Softmax,
    SoftmaxContract,
)
from napkin_cat.levels import LEVELS, Level

__all__ = ["draw", "draw_equation", "draw_sequence"]

# Geometry in inches, type in points.
GAP = 0.6  # between neighbouring wires
PAD = 0.17  # a box reaches this far beyond its outermost ports
WIRE_WIDTH, EDGE_WIDTH = 1.8, 1.0
WIRE_FONT, BOX_FONT, SMALL_FONT, TITLE_FONT, SYMBOL_FONT = 8.0, 8.5, 6.5, 10.0, 18.0
FONT = "DejaVu Sans"  # ships with matplotlib, so every machine measures and renders the same
DPI = 150
SUFFIXES = (".png", ".svg", ".pdf", ".tex")


# --- the display list ---------------------------------------------------------------------------


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
        boxes = [_extent(item) for item in self.items] or [(0.0, 0.0, 0.0, 0.0)]
        return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))

    def shifted(self, dx: float, dy: float) -> Picture:
        return replace(self, items=tuple(_shift(item, dx, dy) for item in self.items))


def _move_point(p, dx, dy):
    return (p[0] + dx, p[1] + dy)


def _shift(item: Item, dx: float, dy: float) -> Item:
    if isinstance(item, Stroke | Shape):
        return replace(item, points=tuple(_move_point(p, dx, dy) for p in item.points))
    if isinstance(item, Dot):
        return replace(item, centre=_move_point(item.centre, dx, dy))
    return replace(item, x=item.x + dx, y=item.y + dy)


def _extent(item: Item) -> tuple[float, float, float, float]:
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


# --- generator families -------------------------------------------------------------------------

FAMILIES: dict[type, str] = {
    Contract: "contraction",
    Conv: "contraction",
    Elementwise: "elementwise",
    Reduce: "reduction",
    Softmax: "reduction",
    SoftmaxContract: "reduction",
    NormalisedContract: "reduction",
    Mask: "mask",
    IndexMap: "mask",
    Cast: "relabel",
    Reshape: "relabel",
    Concat: "relabel",
    Rename: "relabel",
    Move: "move",
    markov.Swap: "swap",
    markov.Merge: "merge",
    markov.Copy: "copy",
}


@dataclass(frozen=True)
class Style:
    shape: str  # rect, round, trapezoid or parallelogram
    face: str
    dashed: bool = False


STYLES = {
    "contraction": Style("rect", "#e4ddf7"),
    "elementwise": Style("round", "#fff1bf"),
    "reduction": Style("trapezoid", "#d5efec"),
    "mask": Style("rect", "#fbdcd8", dashed=True),
    "relabel": Style("parallelogram", "#ececec"),
    "box": Style("rect", "white"),
}


def family(box) -> str:
    """The drawing family of a box: its nearest class in :data:`FAMILIES`; a copy to no wires discards.

    >>> from napkin_cat import axes, Array, softmax
    >>> from napkin_cat.diagram import Discard, Ty
    >>> q, x = axes("q x")
    >>> family(softmax(Array(q, x), x)), family(Discard(Ty(Array(q))))
    ('reduction', 'discard')
    """
    name = next((FAMILIES[c] for c in type(box).__mro__ if c in FAMILIES), "box")
    return "discard" if name == "copy" and not len(box.cod) else name


# --- layout: wire heights slice by slice, then columns left to right -----------------------------


def _next_heights(prev: list[float], n: int, box) -> list[float]:
    """Heights of the wires after a layer: outputs centred on the inputs, neighbours pushed apart."""
    k, m = len(box.dom), len(box.cod)
    ins = prev[n : n + k]
    if family(box) == "swap":
        outs = list(ins)
    else:
        if ins:
            centre = sum(ins) / k
        elif n:
            centre = prev[n - 1] + GAP * (m + 1) / 2
        else:
            centre = prev[0] - GAP * (m + 1) / 2 if prev else 0.0
        outs = [centre + (j - (m - 1) / 2) * GAP for j in range(m)]
    ys = prev[:n] + outs + prev[n + k :]
    for i in range(min(n, len(ys) - 1) - 1, -1, -1):
        ys[i] = min(ys[i], ys[i + 1] - GAP)
    for i in range(max(n, 1), len(ys)):
        ys[i] = max(ys[i], ys[i - 1] + GAP)
    return ys


def wire_label(a: Array) -> str:
    """Axes with their partition labels, and the dtype where it is not f32.

    Axes are joined by ``·``, not ``×``, which is hard to tell from an axis named ``x``.

    >>> from napkin_cat import axes, Array, bf16
    >>> q, x, d = axes("q x d")
    >>> wire_label(Array(q.tiled(128), x.streamed(64), d, dtype=bf16))
    'q/128·x~64·d [bf16]'
    """
    axes_ = "·".join(map(str, a.axes)) or "scalar"
    return axes_ if a.dtype == f32 else f"{axes_} [{a.dtype}]"


def _is_new(out: Array, box) -> bool:
    """Whether a box output deserves a label: its axes or dtype differ from each input's."""
    if family(box) in ("move", "copy", "merge", "swap"):
        return False
    return all((out.axes, out.dtype) != (a.axes, a.dtype) for a in box.dom.inside)


def _box_label(box) -> str:
    scale = box.params.get("scale") if isinstance(box, Contract) else None
    name = str(box.name)
    return name if scale is None else f"{name}\n× {_pretty(scale)}"


def _pretty(expr) -> str:
    if expr.is_number:
        return f"{float(expr):.6g}" if not expr.is_Rational or expr.q > 1000 else str(expr)
    return re.sub(r"sqrt\((\w+)\)", r"√\1", str(expr)).replace("sqrt", "√").replace("**", "^")


def _box_width(box) -> float:
    kind = family(box)
    if kind == "move":
        return max(0.4, text_size(str(box.name), SMALL_FONT)[0] + 0.1)
    if kind in ("copy", "merge", "discard", "swap"):
        return 0.45
    return max(0.5, text_size(_box_label(box), BOX_FONT)[0] + 0.24)


@dataclass
class Walk:
    """The flat walk over a diagram's layers: each wire gets an id; per slice, the ids top to bottom
    and their heights; per layer, the ids its box consumes and produces."""

    ids: list[list[int]]
    heights: list[dict[int, float]]
    wires: dict[int, Array]
    ins: list[list[int]]
    outs: list[list[int]]


def walk(d: Diagram) -> Walk:
    """Heights of every wire slice by slice: outputs centred on their inputs, neighbours pushed apart."""
    ids = [list(range(len(d.dom)))]
    heights = [{i: i * GAP for i in ids[0]}]
    w = Walk(ids, heights, dict(enumerate(d.dom.inside)), [], [])
    for left, box, _ in d.inside:
        n, k, prev = len(left), len(box.dom), ids[-1]
        if family(box) == "swap":  # the same wires, crossed
            a = len(box.left)
            outs = prev[n + a : n + k] + prev[n : n + a]
        else:
            outs = list(range(len(w.wires), len(w.wires) + len(box.cod)))
            w.wires.update(zip(outs, box.cod.inside, strict=True))
        w.ins.append(prev[n : n + k])
        w.outs.append(outs)
        ids.append(prev[:n] + outs + prev[n + k :])
        ys = _next_heights([heights[-1][i] for i in prev], n, box)
        heights.append(dict(zip(ids[-1], ys, strict=True)))
    return w


def _columns(w: Walk, boxes: Sequence) -> list[list[int]]:
    """Layers grouped into columns: a layer joins the column before it when it is independent of it
    and fits beside its boxes without moving any wire (tensored loads share one column)."""
    groups: list[list[int]] = []
    for k in range(len(boxes)):
        if not (groups and _fits(w, boxes, groups[-1], k)):
            groups.append([])
        groups[-1].append(k)
    return groups


def _span(w: Walk, box, ins: list[int], outs: list[int], start: int, end: int) -> tuple[float, float]:
    ys = [w.heights[start][i] for i in ins] + [w.heights[end][o] for o in outs]
    return min(ys) - PAD - 0.1, max(ys) + PAD + 0.1


def _fits(w: Walk, boxes: Sequence, group: list[int], k: int) -> bool:
    swaps = [family(boxes[j]) == "swap" for j in (*group, k)]
    if any(swaps):
        return all(swaps)  # a run of swaps is one permutation
    start, before, after = group[0], w.heights[k], w.heights[k + 1]
    made = {o for j in group for o in w.outs[j]}
    if not w.ins[k] or made & set(w.ins[k]):
        return False
    if any(after[i] != y for i, y in before.items() if i in after) or any(
        before[i] != w.heights[start][i] for i in w.ins[k]
    ):
        return False
    lo, hi = _span(w, boxes[k], w.ins[k], w.outs[k], start, k + 1)
    for j in group:
        a, b = _span(w, boxes[j], w.ins[j], w.outs[j], start, k + 1)
        if a < hi and lo < b:
            return False
    passing = [i for i in after if i in w.heights[start] and i not in w.outs[k]]
    return all(not lo < y < hi for i in passing for y in (w.heights[start][i], after[i]))


@dataclass(frozen=True)
class Spot:
    """Where a box is drawn: its column ``x0..x1``, and its input and output wires with their heights."""

    box: object
    x0: float
    x1: float
    ins: tuple[tuple[float, Array], ...]
    outs: tuple[tuple[float, Array], ...]

    @property
    def centre(self) -> float:
        return (self.x0 + self.x1) / 2


def layout(d: Diagram) -> Picture:
    """The picture of a diagram: a flat walk over its layers, linear in the number of boxes.

    >>> from napkin_cat import axes, library
    >>> pic = layout(library.attention(*axes("q x d")))
    >>> sorted(lv.name for lv in pic.levels), sum(isinstance(i, Shape) for i in pic.items)
    (['HBM'], 3)
    """
    boxes = [box for _, box, _ in d.inside]
    w = walk(d)
    born = {i: None for i in w.ids[0]} | {o: box for box, outs in zip(boxes, w.outs, strict=True) for o in outs}
    items: list[Item] = []
    x = _slice(items, 0.0, w, 0, born, final=not boxes)
    groups = _columns(w, boxes)
    for g, group in enumerate(groups):
        start, end = group[0], group[-1] + 1
        x = _column(items, x, w, [(boxes[k], w.ins[k], w.outs[k]) for k in group], start, end)
        fresh = {o for k in group if family(boxes[k]) != "swap" for o in w.outs[k]}
        x = _slice(items, x, w, end, born, final=g == len(groups) - 1, fresh=fresh)
    arrays = list(w.wires.values())
    partitioned = any(ax.group is not None or ax.stream is not None for a in arrays for ax in a.axes)
    return Picture(tuple(items), frozenset(a.level for a in arrays), partitioned)


def _slice(items: list, x: float, w: Walk, s: int, born: dict, *, final: bool, fresh: set | None = None) -> float:
    """Straight wires between two columns, new ones labelled; returns the slice's right end."""
    def labelled(i):
        return final or fresh is None or (i in fresh and _is_new(w.wires[i], born[i]))

    labels = {i: wire_label(w.wires[i]) for i in w.ids[s] if labelled(i)}
    width = max([0.4, *(text_size(t, WIRE_FONT)[0] + 0.2 for t in labels.values())])
    for i in w.ids[s]:
        y = w.heights[s][i]
        items.append(Stroke(((x, y), (x + width, y)), w.wires[i].level.colour))
        if i in labels:
            items.append(Label(x + 0.07, y - 0.11, labels[i], WIRE_FONT, anchor="west"))
    return x + width


def _column(items: list, x: float, w: Walk, members: list, start: int, end: int) -> float:
    """Boxes side by side in one column and the wires passing them; returns the column's right end."""
    y0, y1 = w.heights[start], w.heights[end]
    steepest = max([abs(y1[i] - y0[i]) for i in w.ids[end] if i in y0] or [0.0])
    x1 = x + max(max(_box_width(box) for box, _, _ in members) + 0.24, 0.5 * steepest)
    items.extend(_curve((x, y0[i]), (x1, y1[i]), w.wires[i].level.colour) for i in w.ids[end] if i in y0)
    for box, ins, outs in members:
        spot = Spot(box, x, x1, tuple((y0[i], w.wires[i]) for i in ins), tuple((y1[o], w.wires[o]) for o in outs))
        items.extend(DRAWERS.get(family(box), _shape)(spot))
    return x1


def _curve(p: tuple[float, float], q: tuple[float, float], colour: str) -> Stroke:
    """A wire from ``p`` to ``q``: straight when level, else an S-shaped Bézier."""
    if abs(p[1] - q[1]) < 1e-9:
        return Stroke((p, q), colour)
    mid = (p[0] + q[0]) / 2
    return Stroke((p, (mid, p[1]), (mid, q[1]), q), colour, curved=True)


# --- box drawers: one per family ------------------------------------------------------------------


def _shape(spot: Spot) -> list[Item]:
    kind = family(spot.box)
    style = STYLES.get(kind, STYLES["box"])
    ys = [y for y, _ in (*spot.ins, *spot.outs)] or [0.0]
    top, bottom = min(ys) - PAD, max(ys) + PAD
    if bottom - top < 0.42:
        top, bottom = (top + bottom) / 2 - 0.21, (top + bottom) / 2 + 0.21
    half = (_box_width(spot.box)) / 2
    a, b = spot.centre - half, spot.centre + half
    items: list[Item] = [Stroke(((spot.x0, y), (a, y)), w.level.colour) for y, w in spot.ins]
    items += [Stroke(((b, y), (spot.x1, y)), w.level.colour) for y, w in spot.outs]
    items.append(Shape(_outline(style.shape, a, b, top, bottom), style.face, dashed=style.dashed,
                       rounded=0.1 if style.shape == "round" else 0.0))
    items.append(Label(spot.centre, (top + bottom) / 2, _box_label(spot.box), BOX_FONT))
    return items


def _outline(shape: str, a: float, b: float, top: float, bottom: float) -> tuple:
    inset = min(0.12, (bottom - top) / 4)
    if shape == "trapezoid":  # narrowing: a reduction leaves fewer axes
        return ((a, top), (b, top + inset), (b, bottom - inset), (a, bottom))
    if shape == "parallelogram":
        return ((a + inset, top), (b, top), (b - inset, bottom), (a, bottom))
    return ((a, top), (b, top), (b, bottom), (a, bottom))


def _move(spot: Spot) -> list[Item]:
    (y0, src), (y1, dst) = spot.ins[0], spot.outs[0]
    c, r = spot.centre, 0.085
    items: list[Item] = [Stroke(((spot.x0, y0), (c, y0)), src.level.colour)]
    items.append(_curve((c, y0), (spot.x1, y1), dst.level.colour))
    tip = r if dst.level > src.level else -r  # loads point towards compute, stores back
    items.append(Shape(((c - tip, y0 - r), (c + tip, y0), (c - tip, y0 + r)), dst.level.colour, src.level.colour))
    items.append(Label(c, y0 - 0.2, str(spot.box.name), SMALL_FONT, colour="#444444"))
    return items


def _copy(spot: Spot) -> list[Item]:
    c, items = spot.centre, []
    for y, w in spot.ins:
        items += [Stroke(((spot.x0, y), (c, y)), w.level.colour), Dot((c, y), 0.05, w.level.colour)]
    for j, (y, w) in enumerate(spot.outs):
        items.insert(0, _curve((c, spot.ins[j % len(spot.ins)][0]), (spot.x1, y), w.level.colour))
    return items


def _merge(spot: Spot) -> list[Item]:
    c, items = spot.centre, []
    for j, (y, w) in enumerate(spot.ins):
        items.append(_curve((spot.x0, y), (c, spot.outs[j % len(spot.outs)][0]), w.level.colour))
    for y, w in spot.outs:
        items += [Stroke(((c, y), (spot.x1, y)), w.level.colour), Dot((c, y), 0.05, w.level.colour)]
    return items


def _discard(spot: Spot) -> list[Item]:
    c, items = spot.centre, []
    for y, w in spot.ins:
        items.append(Stroke(((spot.x0, y), (c, y)), w.level.colour))
        items += [Stroke(((c + 0.05 * i, y - h), (c + 0.05 * i, y + h)), w.level.colour, width=1.4)
                  for i, h in enumerate((0.12, 0.08, 0.04))]
    return items


def _swap(spot: Spot) -> list[Item]:
    return []  # a swap keeps its wires, so they cross as wires passing its column (see walk)


DRAWERS: dict[str, Callable[[Spot], list[Item]]] = {
    "move": _move, "copy": _copy, "merge": _merge, "discard": _discard, "swap": _swap,
}


# --- figures: pictures side by side, titles, the legend of level colours --------------------------


def _arrange(pictures: Sequence[Picture], titles: Sequence[str] | None, symbol: str, lead: bool = False) -> Picture:
    """Pictures in a row, centred on one horizontal line, ``symbol`` between them (and first, if ``lead``),
    titles on top."""
    bounds = [p.bounds() for p in pictures]
    top = -max(b[3] - b[1] for b in bounds) / 2 - 0.3
    items: list[Item] = []
    x = 0.8 if lead else 0.0
    if lead:
        items.append(Label(0.4, 0.0, symbol, SYMBOL_FONT))
    for i, (pic, (x0, y0, x1, y1)) in enumerate(zip(pictures, bounds, strict=True)):
        items += pic.shifted(x - x0, -(y0 + y1) / 2).items
        if titles:
            items.append(Label(x + (x1 - x0) / 2, top, titles[i], TITLE_FONT, bold=True))
        x += x1 - x0
        if i < len(pictures) - 1:
            items.append(Label(x + 0.4, 0.0, symbol, SYMBOL_FONT))
            x += 0.8
    levels = frozenset().union(*(p.levels for p in pictures))
    return Picture(tuple(items), levels, any(p.partitioned for p in pictures))


def _rows(pictures: Sequence[Picture], titles: Sequence[str] | None, symbol: str, per_row: int) -> Picture:
    """Rows of at most ``per_row`` pictures, one under the other; later rows open with ``symbol``."""
    rows, y = [], 0.0
    for r in range(0, len(pictures), per_row):
        row = _arrange(pictures[r : r + per_row], titles and titles[r : r + per_row], symbol, lead=r > 0)
        x0, y0, _, y1 = row.bounds()
        rows.append(row.shifted(-x0, y - y0))
        y += y1 - y0 + 0.4
    items = tuple(item for row in rows for item in row.items)
    return Picture(items, frozenset().union(*(p.levels for p in rows)), any(p.partitioned for p in rows))


def _legend(pic: Picture, x: float, y: float) -> list[Item]:
    """A row of the level colours used, in depth order, and the partition notation if any is used."""
    items: list[Item] = []
    for lv in (lv for lv in LEVELS if lv in pic.levels):
        items += [Stroke(((x, y), (x + 0.3, y)), lv.colour), Label(x + 0.38, y, lv.name, WIRE_FONT, anchor="west")]
        x += 0.55 + text_size(lv.name, WIRE_FONT)[0]
    if pic.partitioned:
        items.append(Label(x + 0.1, y, "a/g: tiled in groups of g    a~s: streamed in chunks of s", WIRE_FONT,
                           anchor="west", colour="#444444"))
    return items


def _framed(pic: Picture, title: str | None, legend: bool) -> Picture:
    x0, y0, x1, y1 = pic.bounds()
    extra: list[Item] = []
    if title:
        extra.append(Label((x0 + x1) / 2, y0 - 0.3, title, TITLE_FONT + 1, bold=True))
    if legend and pic.levels:
        extra += _legend(pic, x0, y1 + 0.35)
    return replace(pic, items=pic.items + tuple(extra))


# --- backends: matplotlib and TikZ -------------------------------------------------------------------

_RC = {"svg.hashsalt": "napkin-cat", "svg.fonttype": "none", "font.family": FONT, "path.simplify": False}
_ZORDER = {Stroke: 1, Shape: 2, Dot: 3, Label: 4}


def _mpl_stroke(ax, s: Stroke):
    codes = [MplPath.MOVETO] + [MplPath.CURVE4 if s.curved else MplPath.LINETO] * (len(s.points) - 1)
    ax.add_patch(PathPatch(MplPath(s.points, codes), fill=False, edgecolor=s.colour, lw=s.width, capstyle="butt",
                           zorder=_ZORDER[Stroke]))


def _mpl_shape(ax, s: Shape):
    style = dict(facecolor=s.face, edgecolor=s.edge, lw=s.width, linestyle="--" if s.dashed else "-",
                 joinstyle="miter", zorder=_ZORDER[Shape])
    if s.rounded:
        (a, top), (b, bottom) = s.points[0], s.points[2]
        ax.add_patch(FancyBboxPatch((a, top), b - a, bottom - top, boxstyle=f"round,pad=0,rounding_size={s.rounded}",
                                    **style))
    else:
        ax.add_patch(Polygon(s.points, closed=True, **style))


def _mpl_dot(ax, d: Dot):
    ax.add_patch(Circle(d.centre, d.radius, facecolor=d.colour, edgecolor="none", zorder=_ZORDER[Dot]))


def _mpl_label(ax, t: Label):
    ha = {"west": "left", "center": "center", "east": "right"}[t.anchor]
    ax.text(t.x, t.y, t.text, fontsize=t.size, ha=ha, va="center", ma="center", color=t.colour, family=FONT,
            fontweight="bold" if t.bold else "normal", parse_math=False, zorder=_ZORDER[Label])


_MPL = {Stroke: _mpl_stroke, Shape: _mpl_shape, Dot: _mpl_dot, Label: _mpl_label}


def _figure(pic: Picture, margin: float = 0.12) -> Figure:
    x0, y0, x1, y1 = pic.bounds()
    fig = Figure(figsize=(x1 - x0 + 2 * margin, y1 - y0 + 2 * margin))
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(x0 - margin, x1 + margin)
    ax.set_ylim(y1 + margin, y0 - margin)  # y grows downwards, as in the layout
    ax.set_axis_off()
    for item in pic.items:
        _MPL[type(item)](ax, item)
    return fig


_TEX = {
    "×": r"$\times$", "→": r"$\to$", "≥": r"$\geq$", "≤": r"$\leq$", "√": r"$\surd$", "·": r"$\cdot$",
    "~": r"$\sim$", "⊗": r"$\otimes$", "Σ": r"$\Sigma$", "⟹": r"$\Longrightarrow$", "⇒": r"$\Rightarrow$",
    "_": r"\_", "&": r"\&", "%": r"\%", "#": r"\#", "$": r"\$", "{": r"\{", "}": r"\}", "^": r"\^{}",
    "\\": r"\textbackslash{}",
}


def tex(text: str) -> str:
    r"""Text escaped for LaTeX, the symbols of labels as math.

    >>> tex("q/128×d_k")
    'q/128$\\times$d\\_k'
    """
    return "".join(_TEX.get(c, c) for c in text)


def _pt(p: tuple[float, float]) -> str:
    return f"({p[0]:.4f},{p[1]:.4f})"


class _TikzColours(dict):
    def __call__(self, colour: str) -> str:
        return self.setdefault(to_hex(colour), f"nc{len(self)}")


def _tikz_stroke(s: Stroke, c: _TikzColours) -> str:
    if s.curved:
        p = s.points
        path = _pt(p[0]) + "".join(f" .. controls {_pt(p[i])} and {_pt(p[i + 1])} .. {_pt(p[i + 2])}"
                                   for i in range(1, len(p), 3))
    else:
        path = " -- ".join(map(_pt, s.points))
    return f"\\draw[line width={s.width}pt, draw={c(s.colour)}] {path};"


def _tikz_shape(s: Shape, c: _TikzColours) -> str:
    opts = [f"fill={c(s.face)}", f"draw={c(s.edge)}", f"line width={s.width}pt"]
    opts += ["dashed"] * s.dashed + [f"rounded corners={s.rounded}in"] * bool(s.rounded)
    return f"\\filldraw[{', '.join(opts)}] {' -- '.join(map(_pt, s.points))} -- cycle;"


def _tikz_dot(d: Dot, c: _TikzColours) -> str:
    return f"\\fill[{c(d.colour)}] {_pt(d.centre)} circle[radius={d.radius}in];"


def _tikz_label(t: Label, c: _TikzColours) -> str:
    font = f"\\fontsize{{{t.size}}}{{{t.size * 1.2:.1f}}}\\selectfont" + ("\\bfseries" if t.bold else "")
    text = "\\\\".join(map(tex, t.text.split("\n")))
    opts = f"anchor={t.anchor}, inner sep=0pt, align=center, text={c(t.colour)}, font={font}"
    return f"\\node[{opts}] at {_pt((t.x, t.y))} {{{text}}};"


_TIKZ = {Stroke: _tikz_stroke, Shape: _tikz_shape, Dot: _tikz_dot, Label: _tikz_label}


def _tikz(pic: Picture) -> str:
    colours = _TikzColours()
    body = [_TIKZ[type(item)](item, colours) for item in sorted(pic.items, key=lambda i: _ZORDER[type(i)])]
    defs = [f"\\definecolor{{{name}}}{{HTML}}{{{hexa[1:].upper()}}}" for hexa, name in colours.items()]
    return "\n".join(
        ["% napkin-cat drawing; needs \\usepackage{tikz}", "\\begin{tikzpicture}[x=1in, y=-1in]", *defs, *body,
         "\\end{tikzpicture}", ""]
    )


# --- the public functions --------------------------------------------------------------------------


def _target(path, to_tikz: bool) -> Path | None:
    """The validated output path, or None; errors name the path and what is wrong with it."""
    if path is None:
        return None
    if not isinstance(path, str | Path):
        raise NapkinError(f"draw: path must be a str or pathlib.Path, got {type(path).__name__} {path!r}")
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in SUFFIXES:
        raise NapkinError(f"draw: cannot write {str(path)!r}: its suffix must be one of {', '.join(SUFFIXES)}, "
                          f"got {suffix or 'none'}")
    if to_tikz and suffix != ".tex":
        raise NapkinError(f"draw: to_tikz=True writes TikZ, so the path must end in .tex, got {str(path)!r}")
    if target.is_dir():
        raise NapkinError(f"draw: cannot write {str(path)!r}: it is a directory")
    if not target.parent.is_dir():
        raise NapkinError(f"draw: cannot write {str(path)!r}: directory {str(target.parent)!r} does not exist")
    existed = target.exists()
    try:  # open it for writing before any drawing work; a new empty file is removed again
        with open(target, "ab"):
            pass
    except OSError as e:
        raise NapkinError(f"draw: cannot write {str(path)!r}: {e.strerror}") from e
    if not existed:
        target.unlink()
    return target


def _check(diagram) -> Diagram:
    if not isinstance(diagram, Diagram):
        raise NapkinError(f"draw: expected a napkin_cat Diagram, got {type(diagram).__name__} {diagram!r}")
    return diagram


def _output(pic: Picture, target: Path | None, to_tikz: bool) -> Figure | str:
    """Write (or return) the picture: TikZ source for ``.tex`` or ``to_tikz``, else a matplotlib Figure."""
    if to_tikz or (target is not None and target.suffix.lower() == ".tex"):
        text = _tikz(pic)
        if target is not None:
            target.write_text(text, encoding="utf-8")
        return text
    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # the house style, whatever the user's matplotlibrc says
        matplotlib.rcParams.update(_RC)
        fig = _figure(pic)
        if target is not None:
            fmt = target.suffix.lower()[1:]
            metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}}.get(fmt, {})
            fig.savefig(target, format=fmt, dpi=DPI, metadata=metadata)
    return fig


def draw(
    diagram: Diagram, path: str | Path | None = None, *, title: str | None = None, to_tikz: bool = False,
    legend: bool = True, fallback: bool = True,
) -> Figure | str | None:
    """Draw a diagram as a neural circuit diagram: PNG, SVG or PDF by ``path``'s suffix, TikZ for ``.tex``.

    Returns the matplotlib ``Figure``, or the TikZ source (a ``tikzpicture``) for ``.tex`` paths and
    ``to_tikz=True``. Same diagram, same bytes: SVG and PDF carry no dates and fixed ids.
    Should the layout fail on an unusual diagram, discopy draws it instead, with a ``RuntimeWarning``
    (``fallback=False`` raises instead).

    >>> import pathlib, tempfile
    >>> from napkin_cat import axes, library, SMEM
    >>> h, q, x, d = axes("h q x d")
    >>> mha = library.multi_head_attention(h, q, x, d)
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = draw(mha, tmp / "mha.png", title="multi-head attention")
    >>> (tmp / "mha.png").read_bytes()[:4]
    b'\\x89PNG'
    >>> tiled = mha.map_arrays(lambda a: a.with_(axes=[ax.tiled(128) if ax.name == "q" else ax for ax in a.axes]))
    >>> tikz = draw(tiled, tmp / "tiled.tex")
    >>> "q/128" in tikz and tikz == (tmp / "tiled.tex").read_text()
    True
    >>> draw(mha, tmp / "mha.jpg")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.NapkinError: draw: cannot write '.../mha.jpg': its suffix must be one of .png, ..., got .jpg
    """
    target = _target(path, to_tikz)
    try:
        pic = layout(_check(diagram))
    except NapkinError:
        raise
    except Exception as err:
        if not fallback:
            raise
        return _fallback(diagram, target, to_tikz, err)
    return _output(_framed(pic, title, legend), target, to_tikz)


def _fallback(diagram, target: Path | None, to_tikz: bool, err: Exception):
    warnings.warn(
        f"napkin-cat could not lay out this diagram ({type(err).__name__}: {err}); drawing it with discopy instead",
        RuntimeWarning,
        stacklevel=3,
    )
    tikz = to_tikz or (target is not None and target.suffix.lower() == ".tex")
    if target is None and not tikz:
        raise NapkinError("draw: the discopy fallback needs a path or to_tikz=True") from err
    return markov.Diagram.draw(diagram, path=None if target is None else str(target), to_tikz=tikz, show=False)


def draw_sequence(
    diagrams: Iterable[Diagram], path: str | Path | None = None, *, titles: Sequence[str] | None = None,
    symbol: str = "→", title: str | None = None, to_tikz: bool = False, legend: bool = True,
    per_row: int | None = None,
) -> Figure | str:
    """Diagrams side by side with ``symbol`` between them: the steps of a derivation.

    ``per_row`` wraps long derivations into rows of that many pictures.

    >>> import pathlib, tempfile
    >>> from napkin_cat import axes, library
    >>> q, x, d = axes("q x d")
    >>> attn = library.attention(q, x, d)
    >>> tiled = attn.map_arrays(lambda a: a.with_(axes=[ax.tiled(128) if ax.name == "q" else ax for ax in a.axes]))
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = draw_sequence([attn, tiled], tmp / "steps.svg", titles=["naive", "tile(q, 128)"])
    >>> "tile(q, 128)" in (tmp / "steps.svg").read_text()
    True
    """
    diagrams = [_check(d) for d in diagrams]
    target = _target(path, to_tikz)
    if not diagrams:
        raise NapkinError("draw_sequence: no diagrams to draw")
    if titles is not None and len(titles) != len(diagrams):
        raise NapkinError(f"draw_sequence: {len(titles)} titles for {len(diagrams)} diagrams")
    if per_row is not None and (not isinstance(per_row, int) or per_row < 1):
        raise NapkinError(f"draw_sequence: per_row must be a positive integer, got {per_row!r}")
    pic = _rows([layout(d) for d in diagrams], titles, symbol, per_row or len(diagrams))
    return _output(_framed(pic, title, legend), target, to_tikz)


def draw_equation(
    lhs: Diagram, rhs: Diagram, path: str | Path | None = None, *, symbol: str = "→",
    titles: Sequence[str] | None = None, title: str | None = None, to_tikz: bool = False, legend: bool = True,
) -> Figure | str:
    """Before and after pictures of a rewrite, side by side: ``lhs symbol rhs``.

    >>> from napkin_cat import axes, library, SMEM
    >>> q, x, d = axes("q x d")
    >>> attn = library.attention(q, x, d)
    >>> smem = attn.map_arrays(lambda a: a.with_(level=SMEM))
    >>> tikz = draw_equation(attn, smem, to_tikz=True, titles=("HBM", "SMEM"))
    >>> tikz.count("\\\\begin{tikzpicture}"), "FFA500" in tikz
    (1, True)
    """
    return draw_sequence([lhs, rhs], path, titles=titles, symbol=symbol, title=title, to_tikz=to_tikz, legend=legend)
