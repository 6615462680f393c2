"""How much of its streamed loop a kernel skips: per program (a tile of each tiled axis, at each batch index), the
chunks its masks hide (never visited), keep whole (run unmasked) and cut (run masked), counted from the same bounds
the kernel computes (:func:`lowering._blocks.visited` for affine masks, found symbolically;
:func:`lowering._blocks.call_blocks` for segment ids and for any other mask function, found at call time from its
block map: four bounds per tile, or the chunk lists of a map with holes), and how they were found. A kernel whose
masks skip nothing says so, and names a mask it applies on every chunk because no rule finds its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowering._blocks import (
    CallBlocks,
    Limits,
    Mapped,
    Segments,
    affine_mask,
    call_blocks,
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


def sparsity(p: Plan, arrays: list, extent: dict, masks: tuple | None = None, *, lists: bool = True) -> Sparsity:
    """The :class:`Sparsity` of the kernel of plan ``p`` on ``arrays`` (sizes ``extent``), its call-time masks
    ``masks`` (default :func:`lowering._blocks.segments` of the plan's diagram; a backend reading fewer passes
    its own), read as the kernel reads them: with ``lists``, a block map with holes chunk by chunk
    (:func:`lowering._blocks.call_blocks`), else every one as four bounds per tile.

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
    zero = zeroing_mask(d, x, p.tiles)
    with jax.ensure_compile_time_eval():
        visits, unmasked = _program_chunks(p, arrays, extent, affine, later, zero, n_chunks, lists)
        programs = visits.size
        skipped = float(jnp.sum(n_chunks - visits)) / (programs * n_chunks)
        full = float(jnp.sum(unmasked)) / (programs * n_chunks)
    found = tuple(
        how
        for how, present in (
            ("symbolic", bool(affine) or zero is not None),
            ("segment ids", any(isinstance(m, Segments) for m in later)),
            ("key limits", any(isinstance(m, Limits) for m in later)),
            ("call time", any(isinstance(m, Mapped) and not m.inputs for m in later)),
            ("call time (captured arrays)", any(isinstance(m, Mapped) and m.inputs for m in later)),
        )
        if present
    )
    return Sparsity(skipped, full, 1.0 - skipped - full, programs * n_chunks, found, _note(p, later, found, skipped))


def _program_chunks(p: Plan, arrays, extent, affine, later, zero, n_chunks, lists: bool) -> tuple:
    """How many chunks each program visits and runs unmasked, arrays over the grid (batch axes, then tiles): its
    ``(first, full_lo, full_hi, last)`` combined as the kernel combines them, then, where it reads chunk lists,
    those of the lists in them."""
    x, s = p.stream
    counts = [extent[a] for a in p.batch] + [-(-extent[t] // g) for t, g in p.tiles.items()]
    at = dict(zip((*p.batch, *p.tiles), jnp.meshgrid(*(jnp.arange(n) for n in counts), indexing="ij"), strict=True))
    offsets = {t: at[t] * g for t, g in p.tiles.items()}
    ranges = {a: (at[a], at[a] + 1) for a in p.batch} | {a: (0, extent[a]) for a in p.whole}
    ranges |= {t: (offsets[t], jnp.minimum(offsets[t] + g, extent[t])) for t, g in p.tiles.items()}
    bounds = visited(affine, x, s, n_chunks, ranges, extent[x])

    def on_grid(b, axis):  # [batch axes (1 where unread), tiles of axis, ...] with the other tiled axes inserted
        others = [len(p.batch) + i for i, t in enumerate(p.tiles) if t != axis]
        return jnp.expand_dims(b, others) if others else b

    given = (
        call_blocks(p, later, arrays, extent)
        if lists
        else CallBlocks(tuple((m, call_bounds(p, m, arrays, extent)) for m in later))
    )
    for m, b in given.bounds:
        b = on_grid(b, m.axis)
        bounds = combine(bounds, tuple(b[..., k] for k in range(4)))
    if zero is not None:
        kept = tile_kept(zero, p, offsets, extent)
        bounds = tuple(v * kept for v in bounds)
    first, full_lo, full_hi, last = (jnp.broadcast_to(v, counts) for v in bounds)
    if not given.listed:
        return last - first, full_hi - full_lo
    cut, whole = (on_grid(given.lists[..., k, :], given.axis) for k in range(2))
    within = lambda v, lo, hi: jnp.sum((v >= lo[..., None]) & (v < hi[..., None]), -1)  # noqa: E731
    unmasked = within(whole, full_lo, full_hi)
    return within(cut, first, last) + within(whole, first, last), unmasked


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
