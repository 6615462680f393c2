"""The scheduled semantics: run the loops that a diagram's partition labels describe.

Tiled axes become loops over groups (each group sees its slice of every wire indexed by the axis,
and the global offset of its first element, which index-reading boxes use); a streamed axis becomes
a loop over chunks that folds each reducing box's accumulator, then finalizes it and evaluates what
comes after. Sizes the tile or stream does not divide are exact: the last group or chunk is ragged.
This is the semantics every rewrite is verified against: ``execute(rule(d)) == to_jax(d)``.

It is one interpreter, parameterised by the array namespace of its context (``ctx.xp``): ``execute``
runs it in JAX, the symbolic proofs (``rewrites._proofs``) in sympy, and a kernel runs :func:`walk`
on its blocks.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import tile, stream
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> flash = stream(x, 3)(tile(q, 2)(attn))
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (5, 4)) for i in range(3))
>>> bool(jnp.allclose(execute(flash)(Q, K, V), nc.to_jax(attn)(Q, K, V), atol=1e-5))
True
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np

from napkin_cat.diagram import Diagram
from napkin_cat.generators import Accumulator, Context, ContractionSum, Generator
from napkin_cat.semantics import bind, run
from rewrites._rule import RewriteError


def partitions(d: Diagram) -> tuple[dict, dict]:
    """The tiled axes ``{name: g}`` and streamed axes ``{name: s}`` of a diagram's input and output wires
    (``int``, or the size's symbol where a rule left it open).

        >>> import napkin_cat as nc
        >>> from rewrites import tile, stream
        >>> a, b, c = nc.axes("a b c")
        >>> partitions(stream(b, 8)(tile(a, 4)(nc.library.matmul(a, b, c))))
        ({'a': 4}, {'b': 8})
    """
    tiles, streams = {}, {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            if a.group is not None:
                tiles[a.name] = int(a.group) if a.group.is_number else a.group
            if a.stream is not None:
                streams[a.name] = int(a.stream) if a.stream.is_number else a.stream
    return tiles, streams


def summed_outputs(d: Diagram, a: str) -> tuple[tuple[int, ...], str | None]:
    """The outputs of ``d`` that are sums over ``a`` (a contraction removing ``a`` whose value goes straight to them,
    through copies and swaps only), and why ``a`` cannot be tiled with them (None where it can): a box removing ``a``
    that is no sum of products (its accumulator along ``a`` is not a plain sum), or whose sum another box reads
    (it would see one group's partial sum, not the whole). Tiled with them (:class:`rewrites.tile`'s ``summed``),
    each group's partial sums are added into those outputs: FlashAttention-3's dQ, accumulated across the programs
    of the kernel that tiles the keys.

    >>> import napkin_cat as nc
    >>> n, k, c = nc.axes("n k c")
    >>> summed_outputs(nc.library.matmul(n, k, c), "k")
    ((0,), None)
    >>> summed_outputs(nc.library.attention(n, k, c), "c")
    ((), "box 'n c, k c → n k': the sum over c is read by the box 'softmax k', not an output")
    """
    # the values (by id of a token) that are a partial sum over a, with the box making them; each token is kept
    # here, as an id is unique only while its object lives (a freed token's id, reused by a later one, had marked an
    # output of attention summed, in some test orders)
    partial: dict = {}
    why: list[str] = []

    def step(i, box, ins):
        if isinstance(box, Generator) and a in box.reduced:
            if not isinstance(box.accumulator(a), ContractionSum):
                why.append(f"box {box.name!r} removes {a} but is no sum of products")
            outs = [object() for _ in box.cod]
            partial.update((id(o), (o, box.name)) for o in outs)
            return outs
        for v in ins:
            if id(v) in partial:
                made = partial[id(v)][1]
                why.append(f"box {made!r}: the sum over {a} is read by the box {box.name!r}, not an output")
        if isinstance(box, Generator) and a in box.mixes:
            why.append(f"box {box.name!r} combines elements along {a}")
        return [object() for _ in box.cod]

    outs = d.dataflow([object() for _ in d.dom], step)
    return tuple(k for k, o in enumerate(outs) if id(o) in partial), (why[0] if why else None)


def _slice(value, wire, axis: str, start: int, stop: int):
    if not wire.has(axis):
        return value
    i = wire.names.index(axis)
    return value[(slice(None),) * i + (slice(start, stop),)]


def _extent(wires, values, axis: str) -> int:
    return next(np.shape(v)[w.names.index(axis)] for w, v in zip(wires, values, strict=True) if w.has(axis))


def _fold(acc: Accumulator, state, ins: list, ctx: Context):
    return acc.partial(ins, ctx) if state is None else acc.step(state, ins, ctx)


def _reduces(box: Generator, axis: str) -> bool:
    return any(w.has(axis) for w in box.dom.inside) and not any(w.has(axis) for w in box.cod.inside)


def walk(
    d: Diagram,
    values: list,
    ctx: Context,
    axis: str,
    phase: str,
    states: dict,
    *,
    fold: Callable = _fold,
    skip: Callable = lambda box: False,
) -> list:
    """One pass over the layers of a diagram streamed along ``axis``.

    ``phase`` "chunk" folds a chunk into the accumulators of the boxes removing ``axis`` (``states``
    maps their layer index to their state); "final" finalizes them and evaluates the boxes after the
    reductions. ``None`` marks a wire not computed in this pass. Boxes for which ``skip(box)`` holds
    pass their first inputs through, one per output (a kernel uses it to drop masks on blocks it knows
    are unmasked: a mask passes its score, whatever labels it also reads).

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> total, states = nc.reduce_sum(nc.Array(n), n), {}
    >>> for chunk in (jnp.array([1.0, 2.0]), jnp.array([3.0])):
    ...     _ = walk(total, [chunk], Context(), "n", "chunk", states)
    >>> walk(total, [None], Context(), "n", "final", states)
    [Array(6., dtype=float32)]
    """

    def step(i, box, ins):
        if _reduces(box, axis):
            acc = box.accumulator(axis)
            if phase == "chunk":
                states[i] = fold(acc, states.get(i), ins, ctx)
                return [None] * len(box.cod)
            return acc.finalize(states[i], ctx)
        if any(v is None for v in ins):  # downstream of a pending reduction, or a chunk in the final pass
            return [None] * len(box.cod)
        return ins[: len(box.cod)] if skip(box) else box.evaluate(ins, ctx)

    return d.dataflow(values, step)


def scheduled(d: Diagram, values: list, ctx: Context) -> list:
    """The outputs of ``d`` on ``values`` with its tiles and stream run as loops, in ``ctx.xp``.

    >>> import numpy as np, sympy
    >>> import napkin_cat as nc
    >>> from napkin_cat.generators import SYMPY
    >>> from rewrites import stream
    >>> (n,) = nc.axes("n")
    >>> w = np.array(sympy.symbols("a b c"), dtype=object)
    >>> scheduled(stream(n, 2)(nc.reduce_max(nc.Array(n), n)), [w], Context({n.size: 3}, xp=SYMPY))
    [array(Max(a, b, c), dtype=object)]
    """
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise RewriteError("execute", f"one streamed axis per kernel is supported, got {sorted(streams)}")
    # a tiled axis that no output keeps (split-KV, rewrites._split_kv) is looped innermost: its groups' states merge
    order = sorted(tiles.items(), key=lambda t: not any(w.has(t[0]) for w in d.cod.inside))
    return _tiled(d, list(values), ctx, order, streams)


def _tiled(d: Diagram, values: list, ctx: Context, tiles: list, streams: dict) -> list:
    if not tiles:
        return _streamed(d, values, ctx, streams)
    (a, g), rest = tiles[0], tiles[1:]
    if not any(w.has(a) for w in d.cod.inside):
        return _split(d, values, ctx, a, g, streams)
    n = _extent(d.dom.inside, values, a)
    pieces = []
    for start in range(0, n, g):
        sub = [_slice(v, w, a, start, min(start + g, n)) for v, w in zip(values, d.dom.inside, strict=True)]
        pieces.append(_tiled(d, sub, ctx.at(**{a: ctx.offsets.get(a, 0) + start}), rest, streams))
    summed = summed_outputs(d, a)[0]  # each group's partial sums, added (tile(a, g, summed=True))
    return [
        ctx.xp.concatenate([p[k] for p in pieces], axis=w.names.index(a))
        if w.has(a)
        else sum(p[k] for p in pieces)
        if k in summed
        else pieces[0][k]
        for k, w in enumerate(d.cod.inside)
    ]


def _split(d: Diagram, values: list, ctx: Context, a: str, g: int, streams: dict) -> list:
    """A reduced axis ``a`` group-partitioned across the grid (split-KV): each group of ``g`` folds its own
    accumulator states (in chunks where ``a`` is also streamed), the groups' states are merged by each
    accumulator's ``combine``, and the merged states are finalized."""
    if set(streams) - {a}:
        raise RewriteError(
            "execute", f"{a} is split across the grid, so only {a} may be streamed, got {sorted(streams)}"
        )
    n, s = _extent(d.dom.inside, values, a), streams.get(a, g)
    states: dict = {}
    for group in range(0, n, g):
        own: dict = {}
        for start in range(group, min(group + g, n), s):
            stop = min(start + s, group + g, n)
            chunk = [_slice(v, w, a, start, stop) for v, w in zip(values, d.dom.inside, strict=True)]
            walk(d, chunk, ctx.at(**{a: ctx.offsets.get(a, 0) + start}), a, "chunk", own)
        for i, state in own.items():
            states[i] = state if i not in states else d.boxes[i].accumulator(a).combine(states[i], state, ctx)
    final = [None if w.has(a) else v for v, w in zip(values, d.dom.inside, strict=True)]
    return walk(d, final, ctx, a, "final", states)


def _streamed(d: Diagram, values: list, ctx: Context, streams: dict) -> list:
    if not streams:
        return run(d, values, ctx)
    ((x, s),) = streams.items()
    n = _extent(d.dom.inside, values, x)
    states: dict = {}
    written = []  # each chunk's outputs: those carrying x are its slices of them (the others None)
    for start in range(0, n, s):
        chunk = [_slice(v, w, x, start, min(start + s, n)) for v, w in zip(values, d.dom.inside, strict=True)]
        written.append(walk(d, chunk, ctx.at(**{x: ctx.offsets.get(x, 0) + start}), x, "chunk", states))
    final = [None if w.has(x) else v for v, w in zip(values, d.dom.inside, strict=True)]
    outs = walk(d, final, ctx, x, "final", states)
    return [
        ctx.xp.concatenate([c[k] for c in written], axis=w.names.index(x)) if w.has(x) else o
        for k, (o, w) in enumerate(zip(outs, d.cod.inside, strict=True))
    ]


def execute(d: Diagram) -> Callable:
    """The scheduled algorithm of ``d`` (its tiles and streams run as loops) as a JAX function.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import stream
    >>> (n,) = nc.axes("n")
    >>> float(execute(stream(n, 2)(nc.reduce_sum(nc.Array(n), n)))(jnp.arange(5.0)))
    10.0
    """
    _, streams = partitions(d)
    if len(streams) > 1:
        raise RewriteError("execute", f"one streamed axis per kernel is supported, got {sorted(streams)}")

    def f(*arrays):
        arrays = [jnp.asarray(a) for a in arrays]
        out = scheduled(d, arrays, Context(sizes=bind(d.dom, arrays)))
        return out[0] if len(out) == 1 else tuple(out)

    return f
