"""Backends: a picture rendered by matplotlib (PNG, SVG, PDF; headless, deterministic bytes) or as TikZ.

>>> from napkin_cat import axes, library
>>> from napkin_cat.drawing._layout import layout
>>> pic = layout(library.attention(*axes("q x d")))
>>> print(tikz(pic).splitlines()[1])
\\begin{tikzpicture}[x=1in, y=-1in]
>>> figure(pic).get_dpi() > 0
True
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Circle, FancyBboxPatch, PathPatch, Polygon
from matplotlib.path import Path as MplPath

from napkin_cat.drawing._model import DPI, FONT, Dot, Label, Picture, Shape, Stroke

_RC = {"svg.hashsalt": "napkin-cat", "svg.fonttype": "none", "font.family": FONT, "path.simplify": False}
_ZORDER = {Stroke: 1, Shape: 2, Dot: 3, Label: 4}


def _mpl_stroke(ax, s: Stroke):
    codes = [MplPath.MOVETO] + [MplPath.CURVE4 if s.curved else MplPath.LINETO] * (len(s.points) - 1)
    ax.add_patch(
        PathPatch(
            MplPath(s.points, codes),
            fill=False,
            edgecolor=s.colour,
            lw=s.width,
            capstyle="butt",
            zorder=_ZORDER[Stroke],
        )
    )


def _mpl_shape(ax, s: Shape):
    style = dict(
        facecolor=s.face,
        edgecolor=s.edge,
        lw=s.width,
        linestyle="--" if s.dashed else "-",
        joinstyle="miter",
        zorder=_ZORDER[Shape],
    )
    if s.rounded:
        (a, top), (b, bottom) = s.points[0], s.points[2]
        ax.add_patch(
            FancyBboxPatch((a, top), b - a, bottom - top, boxstyle=f"round,pad=0,rounding_size={s.rounded}", **style)
        )
    else:
        ax.add_patch(Polygon(s.points, closed=True, **style))


def _mpl_dot(ax, d: Dot):
    ax.add_patch(Circle(d.centre, d.radius, facecolor=d.colour, edgecolor="none", zorder=_ZORDER[Dot]))


def _mpl_label(ax, t: Label):
    ha = {"west": "left", "center": "center", "east": "right"}[t.anchor]
    ax.text(
        t.x,
        t.y,
        t.text,
        fontsize=t.size,
        ha=ha,
        va="center",
        ma="center",
        color=t.colour,
        family=FONT,
        fontweight="bold" if t.bold else "normal",
        parse_math=False,
        zorder=_ZORDER[Label],
    )


_MPL = {Stroke: _mpl_stroke, Shape: _mpl_shape, Dot: _mpl_dot, Label: _mpl_label}


def figure(pic: Picture, margin: float = 0.12) -> Figure:
    """A matplotlib figure of the picture, one inch of picture to one inch of figure."""
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
    "×": r"$\times$",
    "→": r"$\to$",
    "≥": r"$\geq$",
    "≤": r"$\leq$",
    "√": r"$\surd$",
    "·": r"$\cdot$",
    "÷": r"$\div$",
    "~": r"$\sim$",
    "⊗": r"$\otimes$",
    "Σ": r"$\Sigma$",
    "⟹": r"$\Longrightarrow$",
    "⇒": r"$\Rightarrow$",
    "_": r"\_",
    "&": r"\&",
    "%": r"\%",
    "#": r"\#",
    "$": r"\$",
    "{": r"\{",
    "}": r"\}",
    "^": r"\^{}",
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
        path = _pt(p[0]) + "".join(
            f" .. controls {_pt(p[i])} and {_pt(p[i + 1])} .. {_pt(p[i + 2])}" for i in range(1, len(p), 3)
        )
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


def tikz(pic: Picture) -> str:
    """The picture as a standalone ``tikzpicture`` (needs ``\\usepackage{tikz}``)."""
    colours = _TikzColours()
    body = [_TIKZ[type(item)](item, colours) for item in sorted(pic.items, key=lambda i: _ZORDER[type(i)])]
    defs = [f"\\definecolor{{{name}}}{{HTML}}{{{hexa[1:].upper()}}}" for hexa, name in colours.items()]
    return "\n".join(
        [
            "% napkin-cat drawing; needs \\usepackage{tikz}",
            "\\begin{tikzpicture}[x=1in, y=-1in]",
            *defs,
            *body,
            "\\end{tikzpicture}",
            "",
        ]
    )


def render(pic: Picture, target: Path | None, to_tikz: bool) -> Figure | str:
    """Write (or return) the picture: TikZ source for ``.tex`` or ``to_tikz``, else a matplotlib Figure."""
    if to_tikz or (target is not None and target.suffix.lower() == ".tex"):
        text = tikz(pic)
        if target is not None:
            target.write_text(text, encoding="utf-8")
        return text
    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # the house style, whatever the user's matplotlibrc says
        matplotlib.rcParams.update(_RC)
        fig = figure(pic)
        if target is not None:
            fmt = target.suffix.lower()[1:]
            metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None, "ModDate": None}}.get(fmt, {})
            fig.savefig(target, format=fmt, dpi=DPI, metadata=metadata)
    return fig
