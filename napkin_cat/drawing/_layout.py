"""Layout: a row for each net, a place for each box, x positions for the columns, bands for wide pictures.

Rows are chosen greedily, column by column: a box sits on the row of an input that ends there, so the
main stream runs straight, and every net keeps its row from its source to its last use; a net bends
only in the gap just before a box it enters (a dot where it branches). A box that takes parameters
keeps the row above free for them. A picture wider than :data:`MAX_WIDTH` is cut between columns
into bands stacked top to bottom; the wires crossing a cut end in an arrowhead and start the next
band labelled with their axes.

>>> from napkin_cat import axes, library
>>> pic = layout(library.attention(*axes("q x d")))
>>> sorted(lv.name for lv in pic.levels), sum(isinstance(i, Shape) for i in pic.items)
(['HBM'], 3)
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from dataclasses import dataclass

from napkin_cat.diagram import Array, Diagram
from napkin_cat.drawing._graph import Dataflow, Node, dataflow, wire_label, woven
from napkin_cat.drawing._model import (
    BOX_FONT,
    MAX_WIDTH,
    PAD,
    ROW,
    SMALL_FONT,
    WIRE_FONT,
    Dot,
    Item,
    Label,
    Picture,
    Shape,
    Stroke,
    text_size,
)

BEND = 0.38  # the room a wire takes to change rows
STUB = 0.2  # how far above its box a parameter's wire starts
STACK = 0.06  # the offset of each box behind a woven one
RISE = 0.11  # a wire's label sits this far above it
GREY = "#444444"


@dataclass(frozen=True)
class Style:
    """How a family looks: ``rect``, ``round``, ``trapezoid`` or ``parallelogram``, its fill, its edge."""

    shape: str
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


def box_label(box) -> str:
    """A box's name, and its scale on a second line where a contraction has one.

    >>> import sympy
    >>> from napkin_cat import axes, contract
    >>> q, x, d = axes("q x d")
    >>> print(box_label(contract("q d, x d -> q x", q, x, d, scale=1 / sympy.sqrt(d.size))))
    q d, x d → q x
    × 1/√d
    """
    scale = getattr(box, "params", {}).get("scale")
    name = str(box.name)
    return name if scale is None else f"{name}\n× {_pretty(scale)}"


def _pretty(expr) -> str:
    if expr.is_number:
        return f"{float(expr):.6g}" if not expr.is_Rational or expr.q > 1000 else str(expr)
    return re.sub(r"sqrt\((\w+)\)", r"√\1", str(expr)).replace("sqrt", "√").replace("**", "^")


def _is_new(out: Array, node: Node) -> bool:
    """Whether a box output deserves a label: its axes or dtype differ from each input's."""
    return node.kind != "move" and all((out.axes, out.dtype) != (a.axes, a.dtype) for a in node.box.dom.inside)


# --- rows ---------------------------------------------------------------------------------------------


def _height(flow: Dataflow, node: Node) -> int:
    return max(1, len(_data(flow, node)), len(node.outs))


def _data(flow: Dataflow, node: Node) -> list[int]:
    return [i for i in node.ins if i not in flow.parameters]


def rows(flow: Dataflow) -> tuple[dict[int, int], dict[int, int]]:
    """The row of each net (parameters excepted) and the top row of each node.

    >>> from napkin_cat import axes, library
    >>> net_rows, node_rows = rows(dataflow(library.attention(*axes("q x d"))))
    >>> sorted(set(node_rows.values()))
    [0]
    """
    taken: set[tuple[int, int]] = set()
    net_row: dict[int, int] = {}
    node_row: dict[int, int] = {}
    row = 0
    for i, net in enumerate(flow.nets):
        if net.source is None and i not in flow.parameters:
            while not taken.isdisjoint(cells := [(-1, row), *_track(flow, i, -1, row)]):
                row += 1
            taken.update(cells)
            net_row[i], row = row, row + 1
    by_column = defaultdict(list)
    for k, node in enumerate(flow.nodes):
        by_column[node.column].append(k)
    for c in sorted(by_column):
        wishes = {k: [net_row[i] - j for j, i in enumerate(_data(flow, flow.nodes[k]))] or [0] for k in by_column[c]}
        for k in sorted(by_column[c], key=lambda k: wishes[k][0]):
            tries = [*wishes[k], *(wishes[k][0] + s * t for t in range(1, 200) for s in (1, -1))]
            r = next(r for r in tries if taken.isdisjoint(_cells(flow, flow.nodes[k], r)))
            taken.update(_cells(flow, flow.nodes[k], r))
            node_row[k] = r
            net_row.update({o: r + j for j, o in enumerate(flow.nodes[k].outs)})
    return net_row, node_row


def _track(flow: Dataflow, i: int, start: int, row: int) -> list[tuple[int, int]]:
    """The cells a net's row holds between its source's column ``start`` and its last use."""
    return [(c, row) for c in range(start + 1, flow.end(i))]


def _cells(flow: Dataflow, node: Node, row: int) -> list[tuple[int, int]]:
    """The cells a box at ``row`` holds: its rows (and the one above for parameters), its outputs' rows."""
    c, top = node.column, -1 if set(node.ins) & flow.parameters else 0
    box = [(c, row + t) for t in range(top, _height(flow, node))]
    return box + [cell for j, o in enumerate(node.outs) for cell in _track(flow, o, c, row + j)]


# --- x positions ----------------------------------------------------------------------------------


def _box_width(flow: Dataflow, node: Node) -> float:
    if node.kind == "move":
        return max(0.45, text_size(str(node.box.name), SMALL_FONT)[0] + 0.12)
    if node.kind == "merge":
        return 0.3
    params = [wire_label(flow.nets[i].array) for i in node.ins if i in flow.parameters]
    width = max(0.5, text_size(box_label(node.box), BOX_FONT)[0] + 0.24)
    width = max([width, *(len(params) * (text_size(p, WIRE_FONT)[0] + 0.14) for p in params)])
    return width + 2 * STACK * bool(woven(node.box, node.kind))


@dataclass(frozen=True)
class Geometry:
    """Where things are: each column's left end and width, where the outputs leave (``exit``) and the
    picture ends, the rows, and the output ports' rows."""

    starts: list[float]
    widths: list[float]
    exit: float
    end: float
    net_row: dict[int, int]
    node_row: dict[int, int]
    cod_row: list[int]


def geometry(flow: Dataflow) -> Geometry:
    """Column positions: a column is as wide as its widest box, a gap as its longest label plus a bend."""
    net_row, node_row = rows(flow)
    labelled = {i: _labelled(flow, i) for i in range(len(flow.nets))}
    lefts = [labelled[i] for i, net in enumerate(flow.nets) if net.source is None and i in net_row]
    cod_row = sorted(net_row[i] for i in flow.outputs)
    for j in range(1, len(cod_row)):
        cod_row[j] = max(cod_row[j], cod_row[j - 1] + 1)
    bent = _bent(flow, net_row, node_row, cod_row)
    room = [BEND if c in bent else 0.12 for c in range(flow.width + 1)]  # before each column, and the exit
    x = max([0.3, *(text_size(t, WIRE_FONT)[0] + 0.15 for t in lefts if t)]) + room[0]
    widths = [0.0] * flow.width
    gaps = [0.25] * flow.width
    for node in flow.nodes:
        widths[node.column] = max(widths[node.column], _box_width(flow, node) + 0.2)
        for o in node.outs:
            text = labelled[o]
            grounded = flow.nets[o].discarded and len(flow.nets[o].uses) == 0
            gaps[node.column] = max(
                gaps[node.column], text_size(text, WIRE_FONT)[0] + 0.2 if text else 0.0, 0.4 * grounded
            )
    starts = []
    for c in range(flow.width):
        starts.append(x)
        x += widths[c] + gaps[c] + room[c + 1] * (c + 1 < flow.width)
    x += room[-1]
    outs = [wire_label(flow.nets[i].array) for i in flow.outputs]
    end = x + max([0.3, *(text_size(t, WIRE_FONT)[0] + 0.2 for t in outs)])
    return Geometry(starts, widths, x, end, net_row, node_row, cod_row)


def _bent(flow: Dataflow, net_row: dict[int, int], node_row: dict[int, int], cod_row: list[int]) -> set[int]:
    """The columns (``width`` for the exit) some wire must change rows to enter."""
    found = {flow.width for j, i in enumerate(flow.outputs) if net_row[i] != cod_row[j]}
    for k, node in enumerate(flow.nodes):
        if any(net_row[i] != node_row[k] + j for j, i in enumerate(_data(flow, node))):
            found.add(node.column)
    return found


def _labelled(flow: Dataflow, i: int) -> str:
    """The label a net carries where it starts, or ``""`` (an output is labelled where it ends)."""
    net = flow.nets[i]
    if net.source is None:
        return wire_label(net.array)
    if all(node is None for node, _ in net.uses):
        return ""
    node = flow.nodes[net.source]
    return wire_label(net.array) if _is_new(net.array, node) else ""


# --- bands: cutting a wide picture between columns ----------------------------------------------------


class Canvas:
    """Items by band: horizontal wires are split where the picture is cut."""

    def __init__(self, cuts: list[float]):
        self.cuts = cuts
        self.items: list[tuple[int, Item]] = []
        self.crossing: dict[int, dict[float, Array]] = defaultdict(dict)

    def band(self, x: float) -> int:
        return bisect.bisect_right(self.cuts, x)

    def put(self, item: Item, x: float):
        self.items.append((self.band(x), item))

    def line(self, x0: float, x1: float, y: float, array: Array):
        for cut in [c for c in self.cuts if x0 < c < x1]:
            self.put(Stroke(((x0, y), (cut, y)), array.level.colour), x0)
            self.crossing[self.band(cut)][y] = array
            x0 = cut
        if x1 > x0:
            self.put(Stroke(((x0, y), (x1, y)), array.level.colour), x0)


def cuts(geo: Geometry, spans: list[tuple[float, float, Array]]) -> list[float]:
    """Column starts where the picture is cut into bands of about equal width, each at most
    :data:`MAX_WIDTH`, preferring among the cuts near the ideal one the cut that fewest wires cross."""
    found, start, lead = [], 0.0, 0.0
    bands = -(-geo.end // (MAX_WIDTH - 1.0))
    while geo.end - start + lead > MAX_WIDTH:
        target = start + (geo.end - start) / (bands - len(found)) if bands > len(found) else start + MAX_WIDTH
        options = [x for x in geo.starts if start < x and x - start + lead <= MAX_WIDTH]
        if not options:
            options = [x for x in geo.starts if x > start][:1]
            if not options:
                break
        near = [x for x in options if abs(x - target) <= 0.15 * (target - start)] or [
            min(options, key=lambda x: abs(x - target))
        ]
        across = {x: [a for x0, x1, a in spans if x0 < x < x1] for x in near}
        cut = min(near, key=lambda x: (len(across[x]), abs(x - target)))
        found.append(cut)
        start = cut
        lead = max([0.3, *(text_size(wire_label(a), WIRE_FONT)[0] + 0.25 for a in across[cut])])
    return found


# --- the display list ---------------------------------------------------------------------------------


def layout(d: Diagram) -> Picture:
    """The picture of a diagram: its dataflow laid out in rows and columns, cut into bands if wide.

    >>> from napkin_cat import axes, architectures
    >>> pic = layout(architectures.transformer_block(*axes("n d h k f")))
    >>> x0, y0, x1, y1 = pic.bounds()
    >>> x1 - x0 <= 16
    True
    """
    flow = dataflow(d)
    geo = geometry(flow)
    ports = _ports(flow, geo)
    spans = [(x0, x1, flow.nets[i].array) for i, (x0, x1) in _tracks(flow, geo, ports).items()]
    canvas = Canvas(cuts(geo, spans))
    for k, node in enumerate(flow.nodes):
        _node(canvas, flow, ports, k, node)
    for i in range(len(flow.nets)):
        if i not in flow.parameters:
            _net(canvas, flow, geo, ports, i)
    arrays = [net.array for net in flow.nets]
    partitioned = any(ax.group is not None or ax.stream is not None for a in arrays for ax in a.axes)
    return Picture(_bands(canvas), frozenset(a.level for a in arrays), partitioned)


@dataclass(frozen=True)
class Ports:
    """Where wires meet boxes: each node's in and out x, its box's edges, and each port's y."""

    box: dict[int, tuple[float, float, float, float]]  # node -> (left, right, top, bottom)
    ins: dict[tuple[int, int], tuple[float, float]]  # (node, port) -> point
    outs: dict[int, tuple[float, float]]  # net -> point where it starts
    cod: dict[int, float]  # output position -> y


def _ports(flow: Dataflow, geo: Geometry) -> Ports:
    boxes, ins, outs = {}, {}, {}
    for k, node in enumerate(flow.nodes):
        r = geo.node_row[k]
        centre = geo.starts[node.column] + geo.widths[node.column] / 2
        half = _box_width(flow, node) / 2 - STACK * bool(woven(node.box, node.kind))
        top, bottom = r * ROW - PAD, (r + _height(flow, node) - 1) * ROW + PAD
        a, b = (centre, centre) if node.kind in ("move", "merge") else (centre - half, centre + half)
        boxes[k] = (a, b, top, bottom)
        for j, i in enumerate(_data(flow, node)):
            ins[(k, node.ins.index(i))] = (a, (r + j) * ROW)
        behind = 2 * STACK * bool(woven(node.box, node.kind))  # wires leave the stack, not the front box
        for j, o in enumerate(node.outs):
            outs[o] = (b + behind, (r + j) * ROW)
    for i, net in enumerate(flow.nets):
        if net.source is None and i in geo.net_row:
            outs[i] = (0.0, geo.net_row[i] * ROW)
    return Ports(boxes, ins, outs, {j: y * ROW for j, y in enumerate(geo.cod_row)})


def _use_point(flow: Dataflow, geo: Geometry, ports: Ports, use: tuple[int | None, int]) -> tuple[float, float]:
    """Where a net enters a use, and the x where its bend there ends."""
    node, port = use
    if node is None:
        return geo.exit, ports.cod[port]
    return ports.ins[(node, port)]


def _bend_end(geo: Geometry, flow: Dataflow, use: tuple[int | None, int]) -> float:
    node, _ = use
    return geo.exit if node is None else geo.starts[flow.nodes[node].column] - 0.05


def _tracks(flow: Dataflow, geo: Geometry, ports: Ports) -> dict[int, tuple[float, float]]:
    """Each net's straight run along its row: from its source to where it last bends or ends."""
    spans = {}
    for i, net in enumerate(flow.nets):
        if i in flow.parameters or i not in ports.outs:
            continue
        x0, y = ports.outs[i]
        ends = [x0 + 0.2 * net.discarded]
        for use in net.uses:
            px, py = _use_point(flow, geo, ports, use)
            ends.append(px if abs(py - y) < 1e-9 else _bend_end(geo, flow, use) - BEND)
        spans[i] = (x0, max(ends))
    return spans


def _net(canvas: Canvas, flow: Dataflow, geo: Geometry, ports: Ports, i: int):
    net = flow.nets[i]
    x0, y = ports.outs[i]
    colour = net.array.level.colour
    text = _labelled(flow, i)
    if text:
        canvas.put(Label(x0 + 0.06, y - RISE, text, WIRE_FONT, anchor="west"), x0)
    x_end = x0
    bends = []
    for use in net.uses:
        px, py = _use_point(flow, geo, ports, use)
        if abs(py - y) < 1e-9:
            x_end = max(x_end, px)
        else:
            b = _bend_end(geo, flow, use)
            bends.append(b - BEND)
            x_end = max(x_end, b - BEND)
            canvas.put(_curve((b - BEND, y), (b, py), colour), b - BEND)
            canvas.line(b, px, py, net.array)
        if use[0] is None:
            x_out = geo.exit
            canvas.line(x_out, geo.end, py, net.array)
            canvas.put(Label(x_out + 0.06, py - RISE, wire_label(net.array), WIRE_FONT, anchor="west"), x_out)
    if net.discarded and not net.uses:
        x_end = x0 + 0.2
        canvas.put(Stroke(((x_end, y - 0.12), (x_end, y + 0.12)), colour, width=1.4), x_end)
        canvas.put(Stroke(((x_end + 0.05, y - 0.08), (x_end + 0.05, y + 0.08)), colour, width=1.4), x_end)
        canvas.put(Stroke(((x_end + 0.1, y - 0.04), (x_end + 0.1, y + 0.04)), colour, width=1.4), x_end)
    canvas.line(x0, x_end, y, net.array)
    for x in bends:
        if len(net.uses) > 1 and (x < x_end - 1e-9 or bends.count(x) > 1 or len(net.uses) > len(bends)):
            canvas.put(Dot((x, y), 0.05, colour), x)


def _curve(p: tuple[float, float], q: tuple[float, float], colour: str) -> Stroke:
    """An S-shaped Bézier from ``p`` to ``q``."""
    mid = (p[0] + q[0]) / 2
    return Stroke((p, (mid, p[1]), (mid, q[1]), q), colour, curved=True)


def _node(canvas: Canvas, flow: Dataflow, ports: Ports, k: int, node: Node):
    a, b, top, bottom = ports.box[k]
    centre = (a + b) / 2
    if node.kind == "move":
        src, dst = flow.nets[node.ins[0]].array.level, flow.nets[node.outs[0]].array.level
        y, r = top + PAD, 0.085
        tip = r if dst > src else -r  # loads point towards compute, stores back
        canvas.put(
            Shape(((centre - tip, y - r), (centre + tip, y), (centre - tip, y + r)), dst.colour, src.colour), centre
        )
        canvas.put(Label(centre, y - 0.2, str(node.box.name), SMALL_FONT, colour=GREY), centre)
        return
    if node.kind == "merge":
        canvas.put(Dot((centre, top + PAD), 0.05, flow.nets[node.outs[0]].array.level.colour), centre)
        return
    if bottom - top < 0.42:
        top, bottom = (top + bottom) / 2 - 0.21, (top + bottom) / 2 + 0.21
    style = STYLES.get(node.kind, STYLES["box"])
    axes = woven(node.box, node.kind)
    for s in (2, 1) if axes else ():
        d = s * STACK
        canvas.put(
            Shape(
                _outline(style.shape, a + d, b + d, top + d, bottom + d),
                style.face,
                dashed=style.dashed,
                rounded=0.1 * (style.shape == "round"),
            ),
            centre,
        )
    canvas.put(
        Shape(
            _outline(style.shape, a, b, top, bottom),
            style.face,
            dashed=style.dashed,
            rounded=0.1 * (style.shape == "round"),
        ),
        centre,
    )
    canvas.put(Label(centre, (top + bottom) / 2, box_label(node.box), BOX_FONT), centre)
    if axes:
        canvas.put(
            Label(b + 2 * STACK + 0.04, bottom + 2 * STACK, "·".join(axes), SMALL_FONT, anchor="west", colour=GREY),
            centre,
        )
    params = [i for i in node.ins if i in flow.parameters]
    for j, i in enumerate(params):
        x = a + (b - a) * (j + 0.5) / len(params)
        array = flow.nets[i].array
        canvas.put(Stroke(((x, top - STUB), (x, top)), array.level.colour), centre)
        canvas.put(Label(x, top - STUB - 0.08, wire_label(array), WIRE_FONT), centre)


def _outline(shape: str, a: float, b: float, top: float, bottom: float) -> tuple:
    inset = min(0.12, (bottom - top) / 4)
    if shape == "trapezoid":  # narrowing: a reduction leaves fewer axes
        return ((a, top), (b, top + inset), (b, bottom - inset), (a, bottom))
    if shape == "parallelogram":
        return ((a + inset, top), (b, top), (b - inset, bottom), (a, bottom))
    return ((a, top), (b, top), (b, bottom), (a, bottom))


def _bands(canvas: Canvas) -> tuple[Item, ...]:
    """Each band moved under the one before; the wires crossing a cut get an arrowhead and a label."""
    bands: dict[int, list[Item]] = defaultdict(list)
    for b, item in canvas.items:
        bands[b].append(item)
    for b, crossing in canvas.crossing.items():
        cut = canvas.cuts[b - 1]
        lead = max([0.3, *(text_size(wire_label(a), WIRE_FONT)[0] + 0.25 for a in crossing.values())])
        for y, a in crossing.items():
            colour = a.level.colour
            bands[b - 1].append(Shape(((cut - 0.12, y - 0.08), (cut, y), (cut - 0.12, y + 0.08)), colour, colour))
            bands[b] += [
                Stroke(((cut - lead, y), (cut, y)), colour),
                Label(cut - lead + 0.06, y - RISE, wire_label(a), WIRE_FONT, anchor="west"),
            ]
    items: list[Item] = []
    y = 0.0
    for b in sorted(bands):
        pic = Picture(tuple(bands[b]), frozenset())
        x0, y0, _, y1 = pic.bounds()
        items += pic.shifted(-x0, y - y0).items
        y += y1 - y0 + 0.45
    return tuple(items)
