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

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

import rewrites
from napkin_cat.diagram import Diagram, is_structural
from napkin_cat.errors import NapkinError
from napkin_cat.generators import Generator, IndexMap, Mask, fname
from rewrites import LOG2E as LOG2E  # the rules live in rewrites; these names stay importable here
from rewrites import Neutral as Neutral
from rewrites import neutral_padding as neutral_padding
from rewrites import open_sizes, partitions


class NotLowerable(NapkinError, ValueError):
    """The lowering cannot produce a kernel for this diagram; the message says which box or axis and why.

    >>> from lowering import Config
    >>> Config(num_warps=3)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: Config: num_warps must be one of 1, 2, 4, 8, 16, 32, got 3
    """


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@dataclass(frozen=True)
class Plan:
    """Where each axis of a scheduled diagram goes in a kernel: the grid (tiled axes, in blocks of ``g``;
    batch axes, squeezed), the in-kernel loop (the streamed axis, in chunks of ``s``) or whole in every block.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> p = plan(derive(nc.library.matmul(n, k, c), tile(n, 64), tile(c, 64), stream(k, 32), verify=False).diagram)
    >>> p.tiles, p.stream, p.batch, p.whole
    ({'n': 64, 'c': 64}, ('k', 32), (), ())
    """

    tiles: dict  # tiled axis -> g
    stream: tuple | None  # (axis, s)
    batch: tuple  # axes mapped to a flattened grid dimension, block 1
    whole: tuple  # axes kept whole in every block
    diagram: Diagram


def plan(d: Diagram) -> Plan:
    """Classify the axes of a scheduled diagram and check the guards that need no sizes.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> plan(derive(nc.library.attention(q, x, d), tile(q, 24), stream(x, 16), verify=False).diagram)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: axis 'q': Triton blocks need a power-of-two tile ≥ 16, got g = 24
    """
    if opens := open_sizes(d):
        raise NotLowerable(
            f"{', '.join(map(str, opens))}: the size is open; lower() chooses it (or bind it with rewrites.resolve)"
        )
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise NotLowerable(f"one streamed axis per kernel, got {sorted(streams)}")
    if len(tiles) > 2:
        raise NotLowerable(f"at most two tiled axes fit the Triton grid (≤ 3 dims), got {sorted(tiles)}")
    stream = next(iter(streams.items()), None)
    mixed, names = set(), []
    for box in d.boxes:
        if is_structural(box) or getattr(box, "transfers", False):
            continue
        if not isinstance(box, Generator):
            raise NotLowerable(f"box {box.name!r} is not a generator the lowering knows")
        _check_closure(box)
        mixed |= set(box.mixes)
    for w in (*d.dom.inside, *d.cod.inside):
        names += [n for n in w.names if n not in names]
    for a, g in tiles.items():
        if a in mixed:
            raise NotLowerable(f"axis {a!r} is tiled but a box combines elements along it")
        if not _pow2(g) or g < 16:
            raise NotLowerable(f"axis {a!r}: Triton blocks need a power-of-two tile ≥ 16, got g = {g}")
    if stream is not None and stream[1] == 1:
        _check_unit_stream(d, stream[0])
    elif stream is not None and (not _pow2(stream[1]) or stream[1] < 16):
        raise NotLowerable(
            f"axis {stream[0]!r}: Triton blocks need a power-of-two stream size ≥ 16 (or 1 along an axis only "
            f"summed), got s = {stream[1]}"
        )
    streamed = {stream[0]} if stream else set()
    batch = tuple(n for n in names if n not in mixed and n not in tiles and n not in streamed)
    whole = kept_whole(d)
    _check_contractions(d, streamed)
    return Plan(dict(tiles), stream, batch, whole, d)


def kept_whole(d: Diagram) -> tuple[str, ...]:
    """The axes every block of a kernel of ``d`` holds whole: some box combines elements along them, and they are
    neither tiled nor streamed (:attr:`Plan.whole`; read without planning, so with partition sizes still open).

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> b, q, x, d = nc.axes("b q x d")
    >>> kept_whole(stream(x)(tile(q)(nc.library.attention(q, x, d, batch=(b,)))))
    ('d',)
    """
    tiles, streams = partitions(d)
    mixed = {n for box in d.boxes if isinstance(box, Generator) and not box.transfers for n in box.mixes}
    names = dict.fromkeys(n for w in (*d.dom.inside, *d.cod.inside) for n in w.names)
    return tuple(n for n in names if n in mixed and n not in tiles and n not in streams)


def _check_unit_stream(d: Diagram, x: str):
    """A stream of one element at a time: each chunk's blocks keep a unit ``x`` (dropped by the dots, which
    see 2-D blocks), so no product may contract ``x``; only a sum of one array (a batch axis summed, as a
    bias shared by the batch sums its cotangent) may reduce it.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> n, k, c = nc.axes("n k c")
    >>> plan(derive(nc.library.matmul(n, k, c), tile(n, 64), tile(c, 64), stream(k, 1), verify=False).diagram)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: box 'n k, k c → n c' contracts 'k' over 2 operands: a stream of 1 along 'k' \
would make each chunk's product a sum of one term; stream it in chunks that are a power of two ≥ 16
    """
    for box in d.boxes:
        if not is_structural(box) and box.contracts and x in box.reduced and len(box.dom) > 1:
            raise NotLowerable(
                f"box {box.name!r} contracts {x!r} over {len(box.dom)} operands: a stream of 1 along {x!r} would "
                "make each chunk's product a sum of one term; stream it in chunks that are a power of two ≥ 16"
            )


def _check_contractions(d: Diagram, streamed: set):
    for box in d.boxes:
        if not is_structural(box) and box.contracts:
            for a in box.reduced:
                # a sum of one array (a cotangent unbroadcast) is a block sum; a product summing an axis
                # only one of its operands has is refused
                if a not in streamed and len(box.dom) > 1 and len([w for w in box.dom.inside if w.has(a)]) < 2:
                    raise NotLowerable(f"box {box.name!r}: a contraction over {a!r} must involve two operands")


def pad_neutral(d: Diagram, axis: str, extent: int) -> Diagram:
    """``d`` after the rule :class:`rewrites.pad_neutral` (its side condition checks each padding neutral).

    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> [b.name for b in pad_neutral(nc.library.rms_norm(n, d), "d", 3).boxes][2:4]
    ['pad d ≥ 3 with 0.0', 'sum d']
    """
    return rewrites.pad_neutral(axis, extent)(d)


def _captured(fn: Callable) -> dict:
    """The arrays a function closes over (free variables and globals it reads), by name."""
    inner = getattr(fn, "fn", None) or getattr(fn, "keep", None)
    if inner is not None and not inspect.isfunction(fn):
        return _captured(inner)
    if not inspect.isfunction(fn):
        return {}
    seen = inspect.getclosurevars(fn)
    names = {**seen.globals, **seen.nonlocals}
    return {k: v for k, v in names.items() if isinstance(v, jax.Array | np.ndarray)}


def _check_closure(box: Generator):
    if not isinstance(box, IndexMap | Mask):
        return
    fn = box.params.get("fn", box.params.get("mask"))
    arrays = _captured(fn)
    if arrays:
        shown = ", ".join(f"{k} {tuple(np.shape(v))}" for k, v in arrays.items())
        raise NotLowerable(
            f"box {box.name!r}: {fname(fn)} closes over arrays ({shown}); a kernel cannot capture arrays: "
            "make them inputs of the diagram (as nc.library.document_attention does with segment ids)"
        )


def block_values(p: Plan, wire, padded: dict) -> int:
    """Values of one block of ``wire``: a tile of each tiled axis, a chunk of the streamed one, whole otherwise
    (``padded`` gives each axis's padded extent by name); batch axes are the grid's, one per program."""
    n = 1
    for a in wire.axes:
        if a.name in p.batch:
            continue
        if p.stream and a.name == p.stream[0]:
            n *= p.stream[1]
        elif a.name in p.tiles:
            n *= p.tiles[a.name]
        else:  # kept whole: ``padded`` needs only these axes
            n *= padded[a.name]
    return n


def smem_bytes(p: Plan, padded: dict, stages: int) -> int:
    """Shared memory a kernel holds: its resident input blocks, plus ``stages`` buffers of each chunk.

    ``padded`` gives each axis's padded extent by name (blocks of whole axes span it).
    """
    total = 0
    for w in p.diagram.dom.inside:
        streamed = p.stream is not None and w.has(p.stream[0])
        total += block_values(p, w, padded) * w.dtype.bytes * (stages if streamed else 1)
    return total


def base2(d: Diagram) -> Diagram:
    """``d`` after the rule :class:`rewrites.base2` (the lowering's base-2 exponent, the positive score scale
    moved into the online softmax where its probabilities meet a 16-bit value).

    >>> import sympy
    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> q, x, d = nc.axes("q x d")
    >>> fused = base2(fuse_softmax_contract(nc.library.attention(q, x, d, dtype="bf16"), "x"))
    >>> [(b.params.get("scale") == LOG2E / sympy.sqrt(d.size), b.params.get("base")) for b in fused.boxes]
    [(False, None), (True, 2)]
    """
    return rewrites.base2()(d)


def unweave(d: Diagram, axes: tuple) -> Diagram:
    """The per-block diagram: ``d`` with the grid's squeezed axes removed from every wire.

    >>> import napkin_cat as nc
    >>> h, q, x, d = nc.axes("h q x d")
    >>> print(unweave(nc.library.attention(q, x, d).weave(h), ("h",)).cod)
    q×d
    """
    return d.map_arrays(lambda w: w.with_(axes=[a for a in w.axes if a.name not in axes]))
