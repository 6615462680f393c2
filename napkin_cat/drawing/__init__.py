"""Drawing: neural-circuit-diagram pictures of diagrams (Abbott, *Neural Circuit Diagrams*).

An array is one wire, in its memory level's colour (FAN §1: HBM black, L2 grey, SMEM orange, REG
green, TC blue), labelled with its axes, partition labels included (``q/128`` tiled, ``x~64``
streamed), and its dtype where it is not f32. As in *Neural Circuit Diagrams*, rewiring is absorbed
into the layout (swaps vanish, a copy is a branching dot, a discard a ground), parameters enter their
box from above, and a contraction woven over some axes is drawn as a stack of boxes labelled with
them. Each generator family has its own shape: contractions are plain boxes, elementwise maps
rounded ones, reductions and softmaxes trapezoids, masks dashed boxes, casts and reshapes
parallelograms; a move between levels is a colour change marked by a triangle. Wide pictures wrap
into bands, so a transformer block stays readable at print size.

One module per concept: ``_model`` (the display list), ``_graph`` (the dataflow a picture shows),
``_layout`` (rows, columns, bands), ``_figure`` (pictures side by side, titles, legend) and
``_backend`` (matplotlib and TikZ).

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

import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

from matplotlib.figure import Figure

from napkin_cat.diagram import Diagram
from napkin_cat.drawing._backend import render, tex
from napkin_cat.drawing._figure import framed, rows
from napkin_cat.drawing._graph import Dataflow, dataflow, family, wire_label, woven
from napkin_cat.drawing._layout import STYLES, box_label, layout
from napkin_cat.drawing._model import DPI, MAX_WIDTH, Dot, Label, Picture, Shape, Stroke, text_size
from napkin_cat.errors import NapkinError

__all__ = [
    "DPI",
    "MAX_WIDTH",
    "STYLES",
    "Dataflow",
    "Dot",
    "Label",
    "Picture",
    "Shape",
    "Stroke",
    "box_label",
    "dataflow",
    "draw",
    "draw_equation",
    "draw_sequence",
    "family",
    "layout",
    "tex",
    "text_size",
    "wire_label",
    "woven",
]

SUFFIXES = (".png", ".svg", ".pdf", ".tex")


def _target(path, to_tikz: bool) -> Path | None:
    """The validated output path, or None; errors name the path and what is wrong with it."""
    if path is None:
        return None
    if not isinstance(path, str | Path):
        raise NapkinError(f"draw: path must be a str or pathlib.Path, got {type(path).__name__} {path!r}")
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix not in SUFFIXES:
        raise NapkinError(
            f"draw: cannot write {str(path)!r}: its suffix must be one of {', '.join(SUFFIXES)}, got {suffix or 'none'}"
        )
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
    """``diagram`` if it is one; else an error naming what it is (its repr cut short) and what to call instead.

    >>> from napkin_cat import axes, library
    >>> from rewrites import derive, tile
    >>> tiled = derive(library.attention(*axes("q x d")), tile("q", 4), verify=False)
    >>> _check(tiled)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.NapkinError: draw: got a Derivation, not a Diagram; draw its steps with derivation.draw(path), \
or its scheduled diagram with nc.draw(derivation.diagram, path)
    """
    if isinstance(diagram, Diagram):
        return diagram
    kind = type(diagram).__name__
    if hasattr(diagram, "steps") and callable(getattr(diagram, "draw", None)):  # a derivation (rewrites sits above)
        raise NapkinError(
            f"draw: got a {kind}, not a Diagram; draw its steps with derivation.draw(path), "
            "or its scheduled diagram with nc.draw(derivation.diagram, path)"
        )
    text = repr(diagram)
    text = text if len(text) <= 60 else text[:59] + "…"
    raise NapkinError(f"draw: expected a napkin_cat Diagram, got {kind} {text}")


def draw(
    diagram: Diagram,
    path: str | Path | None = None,
    *,
    title: str | None = None,
    to_tikz: bool = False,
    legend: bool = True,
    fallback: bool = True,
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
    return render(framed(pic, title, legend), target, to_tikz)


def _fallback(diagram, target: Path | None, to_tikz: bool, err: Exception):
    warnings.warn(
        f"napkin-cat could not lay out this diagram ({type(err).__name__}: {err}); drawing it with discopy instead",
        RuntimeWarning,
        stacklevel=3,
    )
    tikz = to_tikz or (target is not None and target.suffix.lower() == ".tex")
    if target is None and not tikz:
        raise NapkinError("draw: the discopy fallback needs a path or to_tikz=True") from err
    return Diagram.draw(diagram, path=None if target is None else str(target), to_tikz=tikz, show=False)


def draw_sequence(
    diagrams: Iterable[Diagram],
    path: str | Path | None = None,
    *,
    titles: Sequence[str] | None = None,
    symbol: str = "→",
    title: str | None = None,
    to_tikz: bool = False,
    legend: bool = True,
    per_row: int | None = None,
) -> Figure | str:
    """Diagrams side by side with ``symbol`` between them: the steps of a derivation.

    Long derivations wrap into rows of as many pictures as fit in :data:`MAX_WIDTH`, or of ``per_row``.

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
    pic = rows([layout(d) for d in diagrams], titles, symbol, per_row)
    return render(framed(pic, title, legend), target, to_tikz)


def draw_equation(
    lhs: Diagram,
    rhs: Diagram,
    path: str | Path | None = None,
    *,
    symbol: str = "→",
    titles: Sequence[str] | None = None,
    title: str | None = None,
    to_tikz: bool = False,
    legend: bool = True,
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
