"""Figures: pictures side by side or in rows, titles, and the legend of level colours.

>>> from napkin_cat import axes, library
>>> from napkin_cat.drawing._layout import layout
>>> pic = layout(library.attention(*axes("q x d")))
>>> both = arrange([pic, pic], ["before", "after"], "→")
>>> both.bounds()[2] - both.bounds()[0] > 2 * (pic.bounds()[2] - pic.bounds()[0])
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from napkin_cat.drawing._model import (
    MAX_WIDTH,
    SYMBOL_FONT,
    TITLE_FONT,
    WIRE_FONT,
    Item,
    Label,
    Picture,
    Stroke,
    text_size,
)
from napkin_cat.levels import LEVELS


def arrange(pictures: Sequence[Picture], titles: Sequence[str] | None, symbol: str, lead: bool = False) -> Picture:
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


def rows(pictures: Sequence[Picture], titles: Sequence[str] | None, symbol: str, per_row: int | None) -> Picture:
    """Rows of at most ``per_row`` pictures (``None``: as many as fit in :data:`MAX_WIDTH`), one under
    the other; later rows open with ``symbol``."""
    groups: list[list[int]] = []
    width = 0.0
    for i, pic in enumerate(pictures):
        x0, _, x1, _ = pic.bounds()
        if not groups or (len(groups[-1]) == per_row if per_row else width + 0.8 + x1 - x0 > MAX_WIDTH):
            groups.append([])
            width = 0.8 * (len(groups) > 1) - 0.8
        groups[-1].append(i)
        width += 0.8 + x1 - x0
    parts, y = [], 0.0
    for r, group in enumerate(groups):
        row = arrange([pictures[i] for i in group], titles and [titles[i] for i in group], symbol, lead=r > 0)
        x0, y0, _, y1 = row.bounds()
        parts.append(row.shifted(-x0, y - y0))
        y += y1 - y0 + 0.4
    items = tuple(item for row in parts for item in row.items)
    return Picture(items, frozenset().union(*(p.levels for p in parts)), any(p.partitioned for p in parts))


def legend(pic: Picture, x: float, y: float) -> list[Item]:
    """A row of the level colours used, in depth order, and the partition notation if any is used."""
    items: list[Item] = []
    for lv in (lv for lv in LEVELS if lv in pic.levels):
        items += [Stroke(((x, y), (x + 0.3, y)), lv.colour), Label(x + 0.38, y, lv.name, WIRE_FONT, anchor="west")]
        x += 0.55 + text_size(lv.name, WIRE_FONT)[0]
    if pic.partitioned:
        items.append(
            Label(
                x + 0.1,
                y,
                "a/g: tiled in groups of g    a~s: streamed in chunks of s",
                WIRE_FONT,
                anchor="west",
                colour="#444444",
            )
        )
    return items


def framed(pic: Picture, title: str | None, with_legend: bool) -> Picture:
    """The picture with its title above and its legend below."""
    x0, y0, x1, y1 = pic.bounds()
    extra: list[Item] = []
    if title:
        extra.append(Label((x0 + x1) / 2, y0 - 0.3, title, TITLE_FONT + 1, bold=True))
    if with_legend and pic.levels:
        extra += legend(pic, x0, y1 + 0.35)
    return replace(pic, items=pic.items + tuple(extra))
