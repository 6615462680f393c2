"""The scheduled semantics: run the loops that a diagram's partition labels describe.

Tiled axes become loops over groups (each group sees its slice of every wire indexed by the axis,
and the global offset of its first element, which index-reading boxes use); a streamed axis becomes
a loop over chunks that folds each reducing box's accumulator, then finalizes it and evaluates what
comes after. Sizes the tile or stream does not divide are exact: the last group or chunk is ragged.
This is the semantics every rewrite is verified against: ``execute(rule(d)) == to_jax(d)``.

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
from discopy import markov

from napkin_cat.diagram import Diagram
from napkin_cat.generators import Context, Generator
from napkin_cat.semantics import apply, bind, run


def partitions(d: Diagram) -> tuple[dict, dict]:
    """The tiled axes ``{name: g}`` and streamed axes ``{name: s}`` of a diagram's input wires."""
    tiles, streams = {}, {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            if a.group is not None:
                tiles[a.name] = int(a.group)
            if a.stream is not None:
                streams[a.name] = int(a.stream)
    return tiles, streams


def _slice(value, wire, axis: str, start: int, stop: int):
    if not wire.has(axis):
        return value
    i = wire.names.index(axis)
    return value[(slice(None),) * i + (slice(start, stop),)]


def _extent(wires, values, axis: str) -> int:
    for w, v in zip(wires, values, strict=True):
        if w.has(axis):
            return v.shape[w.names.index(axis)]
    raise ValueError(axis)


def _run_tiled(d: Diagram, values: list, ctx: Context, tiles: list, streams: dict) -> list:
    if not tiles:
        return _run_streamed(d, values, ctx, streams)
    (a, g), rest = tiles[0], tiles[1:]
    n = _extent(d.dom.inside, values, a)
    pieces = []
    for start in range(0, n, g):
        stop = min(start + g, n)
        sub = [_slice(v, w, a, start, stop) for v, w in zip(values, d.dom.inside, strict=True)]
        pieces.append(_run_tiled(d, sub, ctx.at(**{a: ctx.offsets.get(a, 0) + start}), rest, streams))
    return [
        jnp.concatenate([p[k] for p in pieces], axis=w.names.index(a)) if w.has(a) else pieces[0][k]
        for k, w in enumerate(d.cod.inside)
    ]


def _fold(acc, state, ins, ctx):
    return acc.partial(ins, ctx) if state is None else acc.step(state, ins, ctx)


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
    pass their inputs through (a kernel uses it to drop masks on blocks it knows are unmasked).
    """
    stack = list(values)
    for i, (left, box, _) in enumerate(d.inside):
        n, k = len(left), len(box.dom)
        ins = stack[n : n + k]
        reducing = (
            isinstance(box, Generator)
            and any(w.has(axis) for w in box.dom.inside)
            and not any(w.has(axis) for w in box.cod.inside)
        )
        if reducing:
            acc = box.accumulator(axis)
            if phase == "chunk":
                states[i] = fold(acc, states.get(i), ins, ctx)
                out = [None] * len(box.cod)
            else:
                out = acc.finalize(states[i], ctx)
        elif isinstance(box, markov.Swap | markov.Copy):  # structure moves pending (None) wires as it is
            out = apply(box, ins, ctx)
        elif any(v is None for v in ins):  # downstream of a pending reduction, or a chunk in the final pass
            out = [None] * len(box.cod)
        else:
            out = ins if skip(box) else apply(box, ins, ctx)
        stack[n : n + k] = out
    return stack


def _run_streamed(d: Diagram, values: list, ctx: Context, streams: dict) -> list:
    if not streams:
        return run(d, values, ctx)
    ((x, s),) = streams.items()
    n = _extent(d.dom.inside, values, x)
    states: dict = {}
    for start in range(0, n, s):
        chunk = [_slice(v, w, x, start, min(start + s, n)) for v, w in zip(values, d.dom.inside, strict=True)]
        walk(d, chunk, ctx.at(**{x: ctx.offsets.get(x, 0) + start}), x, "chunk", states)
    final = [None if w.has(x) else v for v, w in zip(values, d.dom.inside, strict=True)]
    return walk(d, final, ctx, x, "final", states)


def execute(d: Diagram) -> Callable:
    """The scheduled algorithm of ``d`` (its tiles and streams run as loops) as a JAX function."""
    tiles, streams = partitions(d)
    if len(streams) > 1:
        from rewrites.rule import RewriteError

        raise RewriteError("execute", f"one streamed axis per kernel is supported, got {sorted(streams)}")

    def f(*arrays):
        arrays = [jnp.asarray(a) for a in arrays]
        ctx = Context(sizes=bind(d.dom, arrays))
        out = _run_tiled(d, arrays, ctx, list(tiles.items()), streams)
        return out[0] if len(out) == 1 else tuple(out)

    return f
