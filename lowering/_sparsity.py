"""How much of its streamed loop a kernel skips: per program (a tile of each tiled axis, at each batch index),
the chunks its masks hide (never visited), keep whole (run unmasked) and cut (run masked), counted from the
same bounds the kernel computes (:func:`lowering._blocks.visited` for affine masks, found symbolically;
:func:`lowering._blocks.call_bounds` for segment ids and for any other mask function, found at call time
from its block map), and how they were found. A kernel whose masks skip nothing says so, and names a mask
it applies on every chunk because no rule finds its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowering._blocks import (
    Mapped,
    Segments,
    affine_mask,
    call_bounds,
    combine,
    mapped_mask,
    segments,
    tile_kept,
    visited,
    zeroing_mask,
)
from lowering._plan import Plan


@dataclass(frozen=True)
class Sparsity:
    """The fractions of a kernel's (program, chunk) blocks its masks hide (``skipped``), keep whole (``full``)
    and cut (``partial``), of ``blocks`` in all; ``found`` says how (``"symbolic"``: affine masks, from their
    inequalities; ``"segment ids"``: from the ids, at call time; ``"call time"``: any other mask function, from
    its block map, built once per sizes; ``"call time (captured arrays)"``: a mask over captured arrays, from its
    block map on their values at each call), ``note`` what skips nothing and why.

    >>> Sparsity(0.5, 0.25, 0.25, 16, ("symbolic",))
    Sparsity(skipped=50.0%, full=25.0%, partial=25.0% of 16 blocks; found: symbolic)
    """

    skipped: float
    full: float
    partial: float
    blocks: int
    found: tuple[str, ...]
    note: str | None = None

    def __repr__(self):
        found = ", ".join(self.found) or "no mask skips blocks"
        note = f"; {self.note}" if self.note else ""
        shares = f"skipped={100 * self.skipped:.1f}%, full={100 * self.full:.1f}%, partial={100 * self.partial:.1f}%"
        return f"Sparsity({shares} of {self.blocks} blocks; found: {found}{note})"


def sparsity(p: Plan, arrays: list, extent: dict, masks: tuple | None = None) -> Sparsity:
    """The :class:`Sparsity` of the kernel of plan ``p`` on ``arrays`` (sizes ``extent``), its call-time masks
    ``masks`` (default :func:`lowering._blocks.segments` of the plan's diagram; a backend reading fewer passes
    its own).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> causal = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
    >>> sparsity(plan(causal.diagram), [], {"q": 64, "x": 64, "d": 8})
    Sparsity(skipped=37.5%, full=37.5%, partial=25.0% of 16 blocks; found: symbolic)
    """
    d = p.diagram
    if p.stream is None:
        return Sparsity(0.0, 0.0, 1.0, 1, (), "no streamed axis: nothing to skip")
    x, s = p.stream
    n_chunks = -(-extent[x] // s)
    affine = [m for b in d.boxes if (m := affine_mask(b)) is not None and x in m.axes]
    later = segments(d, p) if masks is None else tuple(masks)
    zero = zeroing_mask(d, x)
    zero = zero if zero is not None and set(zero.axes) <= set(p.tiles) else None
    with jax.ensure_compile_time_eval():
        first, full_lo, full_hi, last = _program_bounds(p, arrays, extent, affine, later, zero, n_chunks)
        programs = first.size
        skipped = float(jnp.sum(n_chunks - (last - first))) / (programs * n_chunks)
        full = float(jnp.sum(full_hi - full_lo)) / (programs * n_chunks)
    found = tuple(
        how
        for how, present in (
            ("symbolic", bool(affine) or zero is not None),
            ("segment ids", any(isinstance(m, Segments) for m in later)),
            ("call time", any(isinstance(m, Mapped) and not m.inputs for m in later)),
            ("call time (captured arrays)", any(isinstance(m, Mapped) and m.inputs for m in later)),
        )
        if present
    )
    return Sparsity(skipped, full, 1.0 - skipped - full, programs * n_chunks, found, _note(p, later, found, skipped))


def _program_bounds(p: Plan, arrays, extent, affine, later, zero, n_chunks) -> tuple:
    """Every program's ``(first, full_lo, full_hi, last)``, each an array over the grid (batch axes, then tiles),
    combined as the kernel combines them."""
    x, s = p.stream
    counts = [extent[a] for a in p.batch] + [-(-extent[t] // g) for t, g in p.tiles.items()]
    at = dict(zip((*p.batch, *p.tiles), jnp.meshgrid(*(jnp.arange(n) for n in counts), indexing="ij"), strict=True))
    offsets = {t: at[t] * g for t, g in p.tiles.items()}
    ranges = {a: (at[a], at[a] + 1) for a in p.batch} | {a: (0, extent[a]) for a in p.whole}
    ranges |= {t: (offsets[t], jnp.minimum(offsets[t] + g, extent[t])) for t, g in p.tiles.items()}
    bounds = visited(affine, x, s, n_chunks, ranges, extent[x])
    for m in later:
        b = call_bounds(p, m, arrays, extent)  # [batch axes (1 where unread), tiles of m.axis, 4]
        others = [len(p.batch) + i for i, t in enumerate(p.tiles) if t != m.axis]
        b = jnp.expand_dims(b, others) if others else b
        bounds = combine(bounds, tuple(b[..., k] for k in range(4)))
    if zero is not None:
        kept = tile_kept(zero, p, offsets, extent)
        bounds = tuple(v * kept for v in bounds)
    return jnp.broadcast_arrays(*(jnp.broadcast_to(v, counts) for v in bounds))


def unread(p: Plan, later=None) -> list[str]:
    """The mask boxes of ``p``'s kernel that run on every chunk because no rule finds their blocks (no affine
    form, no segment ids, no block map a kernel can read: :func:`lowering._blocks.mapped_mask`), by name."""
    later = segments(p.diagram, p) if later is None else later
    known = {id(m.box) for m in later}
    return [
        b.name
        for b in p.diagram.boxes
        if callable(getattr(b, "mask_function", None))
        and b.mask_function() is not None
        and affine_mask(b) is None
        and id(b) not in known
        and mapped_mask(b, p, b.dom.inside[0].names) is None
    ]


def described(p: Plan) -> list[str]:
    """Lines for a kernel's description: the masks whose blocks are found at call time from their block maps,
    and those run on every chunk (:func:`unread`); none for a kernel with neither.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> odd = nc.library.attention(q, x, d, mask=lambda q, x: q % 2 == x % 2)
    >>> odd = derive(odd, tile(q, 16), stream(x, 16), verify=False)
    >>> described(plan(odd.diagram))
    ["block sparsity: 'mask <lambda>' skips the blocks its block map hides, found at call time"]
    """
    if p.stream is None:
        return []
    mapped = [m.box.name for m in segments(p.diagram, p) if isinstance(m, Mapped)]
    return [f"block sparsity: {n!r} skips the blocks its block map hides, found at call time" for n in mapped] + [
        f"no block sparsity: {n!r} runs on every chunk (no rule finds its blocks)" for n in unread(p)
    ]


def _note(p: Plan, later, found, skipped: float) -> str | None:
    """What skips nothing, and why: a mask applied on every chunk (no rule finds its blocks), no mask at all,
    or masks that hide no chunk at these sizes."""
    x = p.stream[0]
    blind = unread(p, later)
    if blind:
        return (
            f"{', '.join(blind)} applied on every chunk: no rule finds its blocks (a block map needs a mask on the "
            f"streamed axis {x!r}, one tiled axis and batch axes)"
        )
    if not found:
        return f"no mask reads the streamed axis {x!r}: every chunk runs"
    return "the masks hide no chunk at these sizes" if skipped == 0 else None
