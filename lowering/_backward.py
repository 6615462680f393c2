"""The lowered backward of any lowered diagram: ``nc.reverse`` of it, made IO-aware, split, scheduled, lowered.

:func:`backward_of` builds, from a scheduled forward diagram ``d``:

1. the forward with residuals: each softmax·contract also outputs its log-sum-exp ``L``, and its
   output ``O`` is kept (FlashAttention-2, Dao 2023 §3.2);
2. the pullback of ``d`` (``napkin_cat._reverse``: each box differentiated by its own rule, forward
   values recomputed), rewritten by :mod:`rewrites._io_aware`: ``P = exp(S − L)``, ``Σ_x P ⊙ dP =
   Σ_d dO ⊙ O``, a positive row weight on the output folded into ``L`` (attention sinks; dropout's constant
   ``1/(1 − rate)`` alike), contractions
   reading ``dO`` in its own 16-bit dtype, group sums kept until after the kernel;
3. one kernel per schedule: every input's cotangent is computed by the kernel that tiles the forward's
   tiled and streamed axes it has and streams the one it lacks (``dQ``: tile queries, stream keys;
   ``dK, dV``: tile keys, stream queries; a bias over both: tile both, and stream a batch axis it is
   shared by one element at a time, summing it in the kernel), derived with ``tile``/``stream``
   and lowered by the same lowering; before them, a kernel tiling queries computes each ``Δ`` the Δ
   lemma made (FlashAttention-2's preprocessing step), which the others read as an input, and a kernel
   streamed as the forward computes each value that sums the streamed axis and is read where that axis is
   held (:func:`summed_values`: an epilogue's ``dZ = dC ⊙ gelu′(A·B + b)``, read by ``dA = dZ·Bᵀ``).

Score modifiers, masks and any pointwise box between the scores and the softmax·contract are
recomputed in the kernels and differentiated by their own rules; a parameter array entering that chain
(a learnable bias) gets its cotangent like any other input. Where any of this fails, the
:class:`~napkin_cat.errors.NapkinError` raised names the box and the reason.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> b = backward_of(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
>>> print(b.forward.cod)
q/16×d ⊗ q/16
>>> [(p.outputs, p.feeds, str(p.diagram.dom), [str(r) for r in p.rules]) for p in b.pieces]
[((6,), True, 'q×d ⊗ q×d', ['tile(q, 16)']), \
((0,), False, 'q×d ⊗ x×d ⊗ x×d ⊗ q×d ⊗ q ⊗ q', ['tile(q, 16)', 'stream(x, 16)']), \
((1, 2), False, 'q×d ⊗ x×d ⊗ x×d ⊗ q×d ⊗ q ⊗ q', ['tile(x, 16)', 'stream(q, 16)'])]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowering._plan import NotLowerable
from lowering._tiles import Chunks, fit_blocks
from lowering.triton import TRITON_BLOCKS, Config
from napkin_cat import Tape, pullback
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram
from napkin_cat.hardware import H100, Hardware
from napkin_cat.levels import HBM
from rewrites import (
    constant_weight_lemma,
    delta_lemma,
    lse_residual,
    narrow_operands,
    partitions,
    reduced,
    row_weight_lemma,
    widened,
)


@dataclass(frozen=True)
class Piece:
    """One backward kernel: its naive ``diagram``, the backward inputs it reads (``inputs``: positions
    among the primal inputs, the output cotangents, the residuals and the values ``feeds`` pieces make),
    the primal inputs whose cotangents it gives (``outputs``; where ``feeds``, the positions among the
    backward's inputs of the values it makes for later pieces), the axes of each to sum after the kernel
    (``sums``: positions), the schedule ``rules`` and the ``scheduled`` diagram they give."""

    diagram: Diagram
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    sums: tuple[tuple[int, ...], ...]
    rules: tuple
    scheduled: Diagram
    feeds: bool = False
    what: str = ""  # what a piece that ``feeds`` makes, in messages: "Δ", or the sum it hoists ("Σ_k")


@dataclass(frozen=True)
class Backward:
    """The forward with residuals (scheduled like ``d``), where its residuals lie among its outputs, and the
    backward's kernels in the order they run. The backward's inputs are ``d``'s inputs, one cotangent per
    output, the residuals, then the values the pieces that ``feed`` make (each Δ)."""

    forward: Diagram
    residuals: tuple[int, ...]
    pieces: tuple[Piece, ...]


def plain(d: Diagram) -> Diagram:
    """``d`` without partition labels, in HBM: the naive diagram a schedule was derived from.

    >>> import napkin_cat as nc
    >>> from rewrites import tile
    >>> q, x, d = nc.axes("q x d")
    >>> print(plain(tile(q, 16)(nc.library.attention(q, x, d))).cod)
    q×d
    """
    return d.map_arrays(lambda w: w.with_(axes=[a.unlabelled() for a in w.axes], level=HBM))


def with_residuals(d: Diagram) -> tuple[Diagram, tuple[int, ...]]:
    """``d`` whose softmax·contracts also output their log-sum-exp (normalised contractions their sum: each
    box's ``with_residual``), and the positions, among its outputs, of each one's ``L`` and ``O`` in turn
    (each is added where it is not an output already)."""
    t = Tape()
    xs = [t.input(a, "x") for a in d.dom.inside]
    kept = []

    def step(i, box, ins):
        made = box.with_residual() if isinstance(box, g.Generator) else None
        if made is not None:  # a row statistic the backward reads: kept (an output already, or added)
            out, L = t.apply(made, *ins)
            kept.append((L, out))
            return [out, L] if len(box.cod) == 2 else [out]
        return list(t.apply(box, *ins))

    outs = d.dataflow(xs, step)
    for pair in kept:
        outs += [w for w in pair if w not in outs]
    return t.diagram(outs), tuple(outs.index(w) for pair in kept for w in pair)


def _live(t: Tape, outs: list[str]) -> list[str]:
    """The tape inputs that ``outs`` depend on, in tape order."""
    live = set(outs).union(*(ins for _, ins, _ in t.needed(outs)))
    return [n for n in t.inputs if n in live]


def _crosswise(naive: Diagram, kept: tuple, left: tuple) -> bool:
    """Whether an input the kernel reads elementwise holds the streamed axis before a tiled one: a learned
    bias's ``[q, x]`` block, added to the scores in the kernel that tiles keys and streams queries (dK·dV). Each
    chunk of it is transposed into the kernel's tiled-first layout as it loads
    (:func:`lowering._blocks.tiled_first`) and then meets the scores' accumulator layout, and the registers that
    takes make the kernel spill (an operand of a contraction is transposed for free by the tensor cores); such a
    kernel gets half the tile and half the chunk. Measured on an H100
    (B = 2, H = 16, N = 8192, D = 128, bf16, causal; ``papers/flash_attention/bias_gradient.py``): the learned
    bias's dK·dV runs in 3.87 ms at 128 keys × 64 queries (8 warps), 3.19 at 128 × 32 and 2.99 at 64 × 32 (4
    warps).

    >>> import napkin_cat as nc
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> att = nc.library.dot_product_attention(q, x, d, batch=(b, h), bias_batch=(h,))
    >>> _crosswise(att, ("x",), ("q",)), _crosswise(att, ("q",), ("x",))
    (True, False)
    """
    added = set()  # the inputs some box other than a contraction reads (through casts)

    def step(i, box, ins):
        if isinstance(box, g.Cast):
            return ins
        if not isinstance(box, g.Contract):
            added.update(v for v in ins if v is not None)
        return [None] * len(box.cod)

    naive.dataflow(list(range(len(naive.dom))), step)
    return any(
        w.has(s) and w.has(a) and w.names.index(s) < w.names.index(a)
        for i, w in enumerate(naive.dom.inside)
        if i in added
        for s in left
        for a in kept
    )


def _summed_alone(t, name: str) -> bool:
    """Whether the cotangent ``name`` is a sum of one array (through casts): its summed axes are then batch
    axes of every product before it, which a kernel may stream one element at a time."""
    step = next((s for s in t.steps if s[2] == (name,)), None)
    while step is not None and isinstance(step[0], g.Cast):
        step = next((s for s in t.steps if s[2] == (step[1][0],)), None)
    return step is not None and isinstance(step[0], g.Contract) and len(step[1]) == 1


def row_values(t, keyed: list[str], grads) -> list[list[str]]:
    """The values of the tape ``t`` that a backward computes once, before the kernels that read them, by a
    kernel of their own tiling the one keyed axis they hold (FlashAttention-2's preprocessing of Δ,
    generalised): each holds exactly one keyed axis (``keyed``: the forward's tiled and streamed axes), is
    computed from inputs holding no other keyed axis, sums some axis or runs a transcendental on the way (a
    row sum: Δ = Σ_d dO ⊙ O, or the sink's Σ_d dO ⊙ O through σ′; the sink's folded log-sum-exp
    L − log σ(L − sink)), and is read by a step holding another keyed axis, inside a loop that would
    otherwise recompute it for every chunk (in the kernel streaming queries, where the rows lie across the
    scores' tiled-first layout: on the H100 the sink's L′ per chunk cost 0.84 ms of dK·dV's 3.03). A
    transcendental alone hoists only a row, never a block with a summed axis (a q×d cotangent). Grouped by
    their axis, one kernel per group; cotangents of the inputs (``grads``) are left to their own kernels.

    >>> import napkin_cat as nc
    >>> from rewrites import delta_lemma, lse_residual, fuse_softmax_contract
    >>> q, x, d = nc.axes("q x d")
    >>> t, grads = nc.pullback(fuse_softmax_contract(nc.library.sink_attention(q, x, d), "x"))
    >>> _ = delta_lemma(t, lse_residual(t))
    >>> [[str(t.ty(v)) for v in rows] for rows in row_values(t, ["q", "x"], grads)]  # Δ and the sink's dL
    [['q', 'q']]
    """
    keys, ends = set(keyed), set(grads)
    reach = {n: keys & set(a.names) for n, a in t.inputs.items()}  # the keyed axes each value is computed from
    sums = dict.fromkeys(t.inputs, False)  # whether some step on the way summed an axis
    costly = dict.fromkeys(t.inputs, False)  # ... or ran a transcendental
    contracted = set()  # the axes some step sums
    for box, ins, outs in t.steps:
        seen = set().union(*(set(t.ty(i).names) for i in ins)) if ins else set()
        gone = seen - set().union(*(t.ty(o).names for o in outs))
        contracted |= gone
        summed = any(sums.get(i, False) for i in ins) or bool(gone)
        dear = any(costly.get(i, False) for i in ins) or (isinstance(box, g.Elementwise) and box.transcendentals() != 0)
        for o in outs:
            reach[o] = set().union(keys & set(t.ty(o).names), *(reach.get(i, set()) for i in ins))
            sums[o], costly[o] = summed, dear

    def row(n):
        if n in t.inputs or n in ends or len(reach[n]) != 1 or not reach[n] <= set(t.ty(n).names):
            return False
        # a transcendental alone hoists only a row (no summed axis beside its own: never a q×d block)
        return sums[n] or (costly[n] and not (set(t.ty(n).names) - reach[n]) & contracted)

    found: dict[str, list[str]] = {}
    for _, ins, outs in t.steps:
        inner = set().union(*(keys & set(t.ty(o).names) for o in outs))
        for n in ins:
            if row(n) and inner - reach[n] and n not in found.get(next(iter(reach[n])), []):
                found.setdefault(next(iter(reach[n])), []).append(n)
    return [found[a] for a in keyed if a in found]


def summed_values(t, streamed: str, grads) -> list[list[str]]:
    """The values of the tape ``t`` that sum the forward's ``streamed`` axis and are read by a step holding it:
    a kernel tiling that axis cannot recompute them (its blocks hold one tile of the axis, not its whole sum), so
    a kernel of their own, streamed as the forward is, computes them first. An epilogue after a streamed
    contraction is one: ``gelu(A·B + b)``'s ``dZ = dC ⊙ gelu′(A·B + b)`` sums ``k`` and is read by ``dA = dZ·Bᵀ``,
    which holds ``k`` (``A·B`` itself is read only on the way to ``dZ``, so ``dZ`` alone is taken). They are
    grouped by the axes they hold (one kernel per group); cotangents of the inputs (``grads``) are left to their
    own kernels.

    >>> import napkin_cat as nc
    >>> n, k, m = nc.axes("n k m")
    >>> C = nc.Array(n, m)
    >>> linear = (nc.library.matmul(n, k, m) @ nc.id(nc.Array(m))) >> nc.add(C, nc.Array(m)) >> nc.gelu(C)
    >>> t, grads = nc.pullback(linear)
    >>> [[str(t.ty(v)) for v in group] for group in summed_values(t, "k", grads)]  # dZ
    [['n×m']]
    """
    ends = set(grads)
    sums = {n: False for n in t.inputs}  # whether the value is computed through a sum over ``streamed``
    for _, ins, outs in t.steps:
        gone = any(streamed in t.ty(i).names for i in ins) and not any(streamed in t.ty(o).names for o in outs)
        for o in outs:
            sums[o] = gone or any(sums.get(i, False) for i in ins)
    found: dict[tuple, list[str]] = {}
    for _, ins, outs in t.steps:
        if not any(streamed in t.ty(o).names for o in outs):
            continue
        for n in ins:
            if n not in t.inputs and n not in ends and sums[n] and streamed not in t.ty(n).names:
                group = found.setdefault(tuple(t.ty(n).names), [])
                group += [n] if n not in group else []
    return list(found.values())


def _hoist(t, values: list[str], tiled: list, streamed: list, blocks: tuple, hardware, config, what: str) -> Piece:
    """The piece computing ``values`` of the tape ``t`` first (``tiled`` and ``streamed`` as given), each value
    then an input of the tape, read by the kernels after it."""
    inputs = _live(t, values)
    naive = t.diagram(values, inputs=inputs)
    rules, scheduled = fit_blocks(naive, tiled, streamed, *blocks, hardware, config)
    made = set(values)
    t.steps = [s for s in t.steps if not made & set(s[2])]
    t.inputs.update((v, t.ty(v)) for v in values)
    order = list(t.inputs)
    at = tuple(order.index(v) for v in values)
    return Piece(naive, tuple(order.index(n) for n in inputs), at, ((),) * len(values), rules, scheduled, True, what)


def backward_of(
    d: Diagram,
    hardware: Hardware = H100,
    config: Config | None = None,
    *,
    narrow: bool = True,
    own: Chunks | None = None,
    chunks: Mapping[str, int] | None = None,
    one_pass: bool = False,
    fused_dq: bool = False,
) -> Backward:
    """The lowered backward's diagrams and schedules for the scheduled forward ``d`` (see the module),
    its blocks fitted to ``hardware``'s shared memory with ``config``'s pipeline stages.

    Each kernel's chunk is the block policy's ``backward_stream`` (:class:`lowering.triton.TritonBlocks`), never
    more than the forward's smallest block (FlashAttention-2's
    blocks, Triton's). A backend with chunks of its own passes ``own`` (:class:`lowering._tiles.Chunks`) for the
    kernels that stream the axis the forward streams (dQ: the keys): its largest chunk, never more than the
    forward's largest block, halved while the backend does not admit the kernel
    (:func:`lowering._tiles.fit_blocks`). The kernels that stream the forward's tiled axis (dK·dV: the queries)
    hold more accumulators and keep ``backward_stream``; where the backend refuses those blocks (the wide head
    dims), they are fitted by its checks instead (at least its smallest chunk, the tile halved), under ``auto``
    only where it then admits them. A backend whose blocks are arrays, not shared memory (XLA:
    :attr:`lowering.xla.XlaConfig.chunks`), passes ``chunks``: the chunk of each axis a kernel streams, by name,
    taken as given by every kernel streaming that axis.

    With ``one_pass`` (a backend whose tiles all run at once, XLA's: :attr:`lowering.xla.XlaConfig.one_pass`), the
    cotangents that hold the forward's streamed axis and would stream a tiled one (a classifier's ``dW``: tile
    the vocabulary, stream tokens) are computed by the kernel streaming the forward's streamed axis (``dh``'s),
    its tiled axes kept whole (:func:`one_pass`): each chunk's block recomputed once for both, ``dh`` accumulated
    and ``dW``'s slice written per chunk.

    With ``fused_dq`` (FlashAttention-3's backward, five products per tile pair where the two kernels run seven), the
    cotangents the kernel streaming the forward's streamed axis would compute (attention's dQ: tile queries, stream
    keys, S and dP recomputed) are computed by the kernel that tiles it (dK·dV: tile keys, stream queries) from the
    dS it holds anyway: each chunk's partial dQ = dS·K over the program's key tile, added into an f32 output
    (:func:`fused_groups`; the kernel's ``tile(x, g, summed=True)``), cast to the input's dtype after.

    With ``narrow`` each kernel stores a cotangent in its input's dtype; without, in f32: partial gradients a
    caller sums further (a ring's steps, ``lowering._ring``) keep their precision until summed.

    Δ = Σ_d dO ⊙ O (the Δ lemma's right side), and any other row sum the kernels read (:func:`row_values`), is
    computed once per query row, by a kernel of its own (a piece that ``feeds`` the others, run first), and
    read by the kernels that need it, rather than recomputed for every chunk of the loop that streams queries.

    Raises a :class:`~napkin_cat.errors.NapkinError` naming the box and the reason where a cotangent
    cannot be computed by one streamed kernel (``NoDerivative``, ``RewriteError``, ``NotLowerable``).
    """
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise NotLowerable(f"the forward streams {sorted(streams)}, expected one axis")
    policy = TRITON_BLOCKS
    blocks = [*tiles.values(), *streams.values()] or [policy.backward_tile]
    sizes = (min(max(blocks), policy.backward_tile), min(min(blocks), policy.backward_stream))
    keyed = [*tiles, *streams]  # the axes a kernel may tile or stream
    forward, positions = with_residuals(d)
    t, grads = pullback(plain(d))
    residuals = lse_residual(t)
    delta_lemma(t, residuals)
    constant_weight_lemma(t, residuals, grads)  # dropout's 1/(1 − rate) folded into L: none per score
    row_weight_lemma(t, residuals, grads)  # a sink's weight folded into L: plain attention's kernels
    narrow_operands(t)  # dO read in its own dtype by the contractions: 16-bit tensor-core products
    pieces = []
    for rows in row_values(t, keyed, grads):
        tiled = [a for a in keyed if a in t.ty(rows[0]).names]
        pieces.append(_hoist(t, rows, tiled, [], sizes, hardware, config, "Δ"))
    chunks = dict(chunks or {})
    for along in streams:  # an epilogue's cotangent, summing the streamed axis: streamed as the forward
        for values in summed_values(t, along, grads):
            tiled = [a for a in tiles if a in t.ty(values[0]).names]
            at = (sizes[0], chunks.get(along, sizes[1]))
            pieces.append(_hoist(t, values, tiled, [along], at, hardware, config, f"Σ_{along}"))
    order = list(t.inputs)
    mine = None if own is None else (own, min(max(blocks), own.largest))  # dQ's keys: chunks as the forward's
    groups = _schedules(t, grads, keyed, streams, d if narrow else None)
    groups = one_pass_groups(t, groups, tiles, streams) if one_pass else groups
    groups, fused = fused_groups(t, groups, tiles, streams) if fused_dq else (groups, None)
    for (kept, left), group in groups.items():
        at = (sizes[0], chunks.get(left[0], sizes[1])) if left else sizes
        given = mine if not left or left[0] not in chunks else None
        summed = (kept, left) == fused
        made = [_gradients(t, order, (kept, left), group, (keyed, streams), at, given, hardware, config, summed)]
        if len(group) > 1 and not summed and own is not None and not own.triton and not own.admits(made[0].scheduled):
            # the backend holds no kernel with every accumulator of the group (dK and dV at D = 256): one kernel
            # per cotangent where it holds each
            one = [
                _gradients(t, order, (kept, left), [c], (keyed, streams), at, given, hardware, config) for c in group
            ]
            made = one if all(own.admits(p.scheduled) for p in one) else made
        pieces += made
    return Backward(forward, positions, tuple(pieces))


def _schedules(t, grads, keyed: list, streams: dict, narrow: Diagram | None) -> dict[tuple, list]:
    """The cotangents of the tape ``t`` (``grads``) grouped by the kernel computing them: ``{(kept, left): [(input,
    cotangent widened to the kept axes, its axes summed after the kernel), ...]}``, a kernel keeping (tiling) the
    ``kept`` axes and streaming the one it lacks (``left``). Each cotangent is stored in the input's dtype of the
    forward ``narrow`` where none of its axes is summed after (else in f32)."""
    schedules: dict[tuple, list] = {}
    for i, ct in enumerate(grads):
        if ct is None:
            continue
        names = t.ty(ct).names
        missing = [a for a in keyed if a not in names]
        along = next((a for a in streams if a in missing), missing[0] if missing else None)
        extra = tuple(a for a in reduced(t, ct) if a.name != along)
        if along is None and extra and _summed_alone(t, ct):
            # every keyed axis kept, batch axes summed (a bias shared by the batch): the kernel streams one of
            # them an element at a time and sums it in registers, rather than writing it out to sum after. The
            # innermost: the entry's batch axes are (b, h), and where a table is learned at a length that makes an
            # [·, N, N] buffer matter, heads outnumber sequences (B = 2, H = 16 leaves [2, N, N] to sum, not
            # [16, N, N]; sizes are symbolic here)
            along, extra = extra[-1].name, extra[:-1]
        wide = widened(t, ct, extra, frozenset(keyed))
        if wide is None:
            wide, extra = ct, ()
        left = [a for a in dict.fromkeys((*keyed, along)) if a is not None and a not in t.ty(wide).names]
        if len(left) > 1:
            raise NotLowerable(
                f"the cotangent of input {i} ({t.ty(ct).describe()}) sums {left}; one kernel streams one axis"
            )
        kept = tuple(a for a in keyed if a not in left)
        summed = tuple(t.ty(wide).names.index(a.name) for a in extra)
        if narrow is not None and not summed:  # stored in the input's dtype by the kernel: no f32 copy written
            wide = t.cast(wide, narrow.dom.inside[i].dtype)
        schedules.setdefault((kept, tuple(left)), []).append((i, wide, summed))
    return schedules


def one_pass_groups(t, groups: dict, tiles: dict, streams: dict) -> dict:
    """:func:`_schedules`' ``groups`` with those whose kernel streams a tiled axis and whose cotangents all hold the
    forward's streamed axis ``x`` merged into the kernel streaming ``x``, which then tiles nothing (its tiled
    axes kept whole: a cotangent summing one is complete in each chunk's block) and writes each merged cotangent
    chunk by chunk along ``x`` (:func:`rewrites.streamability`: computed from chunks alone). The merged kernel
    runs first; groups that nothing merges with are returned as they were.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, d, v = nc.axes("n d v")
    >>> lce = derive(nc.library.linear_cross_entropy(n, d, v), tile(n, 16), stream(v, 16), verify=False).diagram
    >>> [(p.outputs, [str(r) for r in p.rules]) for p in backward_of(lce, one_pass=True).pieces]
    [((0, 1), ['stream(v, 16)'])]
    """
    if not streams:
        return groups
    (x,) = streams
    merged, rest = {}, {}
    for (kept, left), group in groups.items():
        along = left == (x,) or (left and left[0] in tiles and all(x in t.ty(wide).names for _, wide, _ in group))
        (merged if along else rest)[(kept, left)] = group
    if len(merged) < 2:
        return groups
    return {((), (x,)): [c for group in merged.values() for c in group], **rest}


def fused_groups(t, groups: dict, tiles: dict, streams: dict) -> tuple[dict, tuple]:
    """:func:`_schedules`' ``groups`` with the cotangents of the kernel streaming the forward's streamed axis ``x``
    (dQ: tile ``q``, stream ``x``) moved into the kernel tiling ``x`` and streaming ``q`` (dK·dV), each in f32 (its
    cast to the input's dtype dropped: the kernel adds its programs' partial sums over their ``x`` tiles into it,
    :func:`rewrites.summed_outputs`), and that kernel's key. FlashAttention-3's backward (Shah et al. 2024, §3.3:
    dQ accumulated in f32 across the programs by atomic adds): the dS each chunk computes for dK gives dQ with one
    more product, where a kernel of its own recomputes S and dP (two more). Raises :class:`NotLowerable` where the
    forward is not one tiled and one streamed axis with a kernel of each.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram
    >>> [(p.outputs, [str(r) for r in p.rules]) for p in backward_of(flash, fused_dq=True).pieces]
    [((6,), ['tile(q, 16)']), ((1, 2, 0), ['tile(x, 16, summed=True)', 'stream(q, 16)'])]
    """
    streamed, tiled = tuple(streams), tuple(tiles)
    into, away = (streamed, tiled), (tiled, streamed)
    if len(tiles) != 1 or len(streams) != 1 or into not in groups or away not in groups:
        raise NotLowerable(
            f"fused_dq: the forward tiles {sorted(tiles)} and streams {sorted(streams)}; fusing dQ into the dK·dV "
            "kernel needs one tiled and one streamed axis, with a cotangent kernel of each (attention's)"
        )
    moved = []
    for i, wide, summed in groups[away]:
        step = next(s for s in t.steps if s[2] == (wide,))
        if isinstance(step[0], g.Cast):  # stored in f32: the programs' partial sums are added into it
            wide = step[1][0]
        if summed or t.ty(wide).dtype.bits != 32:
            raise NotLowerable(
                f"fused_dq: the cotangent of input {i} ({t.ty(wide).describe()}) is not one f32 sum over "
                f"{streamed[0]!r} the kernel tiling it can add into its output"
            )
        moved.append((i, wide, ()))
    rest = {k: v for k, v in groups.items() if k not in (into, away)}
    return {into: [*groups[into], *moved], **rest}, into


def _gradients(
    t, order: list, key: tuple, group: list, loops: tuple, sizes: tuple, own, hardware, config, summed: bool = False
) -> Piece:
    """The piece computing one group of :func:`_schedules`, its kernel keeping (tiling) and streaming the axes
    of its ``key`` (``(kept, left)``), ``loops`` the forward's ``(keyed, streams)``, in blocks of ``sizes`` (tile,
    chunk) or, where it streams the forward's streamed axis, a backend's own chunks (``own``: its
    :class:`~lowering._tiles.Chunks` and the largest chunk it may take; None without); with ``summed``, its tiled
    axes admit sums into outputs (:func:`fused_groups`)."""
    outs = [wide for _, wide, _ in group]
    inputs = _live(t, outs)
    naive = t.diagram(outs, inputs=inputs)
    # a kernel loops over no axis it never reads (an epilogue's bias cotangent, read from dZ, has no k)
    present = {n for w in naive.dom.inside for n in w.names}
    kept, left = (tuple(a for a in axes if a in present) for axes in key)
    keyed, streams = loops
    if not left or left[0] in keyed:
        g_, s_ = sizes
        if _crosswise(naive, kept, left):  # halved: see _crosswise
            g_, s_ = max(16, sizes[0] // 2), max(16, sizes[1] // 2)
        chunks = None
        if own is not None and left and left[0] in streams:  # dQ's keys, as the forward
            chunks, s_ = own
        rules, scheduled = fit_blocks(
            naive, list(kept), list(left), g_, s_, hardware, config, own=chunks, summed=summed
        )
        if own is not None and chunks is None and left and not own[0].admits(scheduled):
            # dK·dV at blocks the backend refuses (wide head dims): its own checks fit them, its chunk at least; under
            # auto only where it then takes them (else the Triton kernel standing in keeps Triton's blocks)
            smallest = max(s_, own[0].smallest)
            fitted = fit_blocks(naive, list(kept), list(left), g_, smallest, hardware, config, own[0], summed=summed)
            if not own[0].triton or own[0].admits(fitted[1]):
                rules, scheduled = fitted
    else:  # a summed batch axis, one element at a time: each step loads a tile of every input (Q, K, V, dO
        # at the same b), so the pipeline's stages hold four tiles each (the policy's batch_tile)
        g_ = min(sizes[0], TRITON_BLOCKS.batch_tile)
        rules, scheduled = fit_blocks(naive, list(kept), list(left), g_, 1, hardware, config)
    return Piece(
        naive,
        tuple(order.index(n) for n in inputs),
        tuple(i for i, *_ in group),
        tuple(s for *_, s in group),
        rules,
        scheduled,
    )


def run_pieces(b: Backward, kernels, values: list):
    """Run the backward kernels of ``b`` in order on ``values`` (the primal inputs, the output cotangents,
    the residuals), feeding each Δ to the pieces after it; yield ``(piece, kernel, its inputs, its outputs)``
    for each kernel that gives cotangents.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import lower
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram
    >>> forward, *kernels = lower(flash, interpret=True).kernels
    >>> Q = jnp.ones((16, 16))
    >>> b = backward_of(flash)
    >>> outs = forward(Q, Q, Q)
    >>> [p.outputs for p, *_ in run_pieces(b, kernels, [Q, Q, Q, Q, *(outs[i] for i in b.residuals)])]
    [(0,), (1, 2)]
    """
    values = list(values)
    for piece, kernel in zip(b.pieces, kernels, strict=True):
        ins = [values[i] for i in piece.inputs]
        outs = kernel(*ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if piece.feeds:  # Δ, read by the pieces after it
            values += outs
            continue
        yield piece, kernel, ins, outs


def differentiable(primal: Callable, kernels: Callable[[], tuple], b: Backward, d: Diagram) -> Callable:
    """``primal`` (the kernel of ``d``) with a ``jax.custom_vjp`` whose backward runs lowered kernels.

    ``kernels()`` gives the forward with residuals, then one kernel per piece of ``b``; it is first
    called when the function is differentiated, so the forward never waits for (or fails because of) it.
    """
    n_out = len(d.cod)
    cot_dtypes = [w.dtype.jnp for w in d.cod.inside]

    def tupled(v):
        return v if isinstance(v, tuple) else (v,)

    @jax.custom_vjp
    def f(*xs):
        return primal(*xs)

    def f_fwd(*xs):
        outs = tupled(kernels()[0](*xs))
        res = tuple(outs[p] for p in b.residuals)
        return (outs[0] if n_out == 1 else tuple(outs[:n_out])), (xs, res)

    def f_bwd(saved, cts):
        xs, res = saved
        cts = [c.astype(t) for c, t in zip(tupled(cts), cot_dtypes, strict=True)]
        grads: list = [None] * len(xs)
        for piece, _, _, outs in run_pieces(b, kernels()[1:], [*xs, *cts, *res]):
            for i, out, summed in zip(piece.outputs, outs, piece.sums, strict=True):
                grads[i] = (jnp.sum(out.astype(jnp.float32), axis=summed) if summed else out).astype(xs[i].dtype)
        return tuple(grads)

    f.defvjp(f_fwd, f_bwd)
    f.lowered = (primal, kernels, b, d)  # lowering._spmd partitions each kernel of the derivative on its own
    return f
