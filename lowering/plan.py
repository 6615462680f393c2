"""The plan of a kernel: how a scheduled diagram's axes map onto a Pallas grid, blocks and loops.

Reading the partition labels (the lowering functor on objects): tiled axes become grid dimensions
with blocks of ``g``; axes no box combines elements along (batch, heads) become grid dimensions
with squeezed blocks; the streamed axis becomes the in-kernel loop, in chunks of ``s``; every other
axis stays whole inside the block. The guards of the Triton backend are checked here, before any
compilation, and raise :class:`NotLowerable`.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> b, h, q, x, d = nc.axes("b h q x d", d=64)
>>> flash = derive(nc.library.multi_head_attention(h, q, x, d, batch=(b,)), tile(q, 128), stream(x, 64), verify=False)
>>> p = plan(flash.diagram)
>>> p.tiles, p.stream, p.batch, p.whole
({'q': 128}, ('x', 64), ('b', 'h'), ('d',))
"""

from __future__ import annotations

from dataclasses import dataclass

from discopy import markov

from napkin_cat.diagram import Diagram
from napkin_cat.errors import NapkinError
from napkin_cat.generators import Contract, Generator, Move, SoftmaxContract


class NotLowerable(NapkinError, ValueError):
    """The lowering cannot produce a kernel for this diagram; the message says which box or axis and why."""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class Plan:
    tiles: dict  # tiled axis -> g
    stream: tuple | None  # (axis, s)
    batch: tuple  # axes mapped to a flattened grid dimension, block 1
    whole: tuple  # axes kept whole in every block
    diagram: Diagram


def plan(d: Diagram) -> Plan:
    """Classify the axes of a scheduled diagram and check the backend's guards."""
    from rewrites.schedule import partitions

    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise NotLowerable(f"one streamed axis per kernel, got {sorted(streams)}")
    if len(tiles) > 2:
        raise NotLowerable(f"at most two tiled axes fit the Triton grid (≤ 3 dims), got {sorted(tiles)}")
    stream = next(iter(streams.items()), None)
    mixed, names = set(), []
    for box in d.boxes:
        if isinstance(box, markov.Copy | markov.Swap | Move):
            continue
        if not isinstance(box, Generator):
            raise NotLowerable(f"box {box.name!r} is not a generator the lowering knows")
        mixed |= set(box.mixes)
    for w in (*d.dom.inside, *d.cod.inside):
        names += [n for n in w.names if n not in names]
    for a, g in tiles.items():
        if a in mixed:
            raise NotLowerable(f"axis {a!r} is tiled but a box combines elements along it")
        if not _pow2(g) or g < 16:
            raise NotLowerable(f"axis {a!r}: Triton blocks need a power-of-two tile ≥ 16, got g = {g}")
    if stream is not None and (not _pow2(stream[1]) or stream[1] < 16):
        raise NotLowerable(
            f"axis {stream[0]!r}: Triton blocks need a power-of-two stream size ≥ 16, got s = {stream[1]}"
        )
    streamed = {stream[0]} if stream else set()
    batch = tuple(n for n in names if n not in mixed and n not in tiles and n not in streamed)
    whole = tuple(n for n in names if n in mixed and n not in streamed and n not in tiles)
    _check_contractions(d, streamed)
    return Plan(dict(tiles), stream, batch, whole, d)


def _check_contractions(d: Diagram, streamed: set):
    for box in d.boxes:
        if isinstance(box, Contract | SoftmaxContract):
            for a in box.reduced:
                if a not in streamed and len([w for w in box.dom.inside if w.has(a)]) < 2:
                    raise NotLowerable(f"box {box.name!r}: a contraction over {a!r} must involve two operands")


def padding_neutral(d: Diagram, axis: str) -> bool:
    """Zero padding along ``axis`` changes nothing: only contractions combine elements along it."""
    return all(
        isinstance(box, Contract | SoftmaxContract) or axis not in box.mixes
        for box in d.boxes
        if isinstance(box, Generator)
    )


def smem_bytes(p: Plan, padded: dict, stages: int) -> int:
    """Shared memory a kernel holds: its resident input blocks, plus ``stages`` buffers of each chunk.

    ``padded`` gives each axis's padded extent by name (blocks of whole axes span it).
    """
    total = 0
    for w in p.diagram.dom.inside:
        n = 1
        for a in w.axes:
            if a.name in p.batch:
                continue
            if p.stream and a.name == p.stream[0]:
                n *= p.stream[1]
            elif a.name in p.tiles:
                n *= p.tiles[a.name]
            else:
                n *= padded[a.name]
        streamed = p.stream is not None and w.has(p.stream[0])
        total += n * w.dtype.bytes * (stages if streamed else 1)
    return total
