"""Block masks: which blocks of the scores a mask function hides, cuts or keeps whole, computed once ahead
(FlexAttention's ``create_block_mask`` and ``BlockMask``).

A kernel streaming the keys skips the chunks a mask hides and runs those it keeps whole without it. For a
mask of linear inequalities it knows them symbolically (:func:`napkin_cat.affine_masks.as_affine`); for any
other mask function the kernel's wrapper finds them when the kernel is traced, from the mask's block map
(:meth:`napkin_cat.generators.Mask.block_map`). :func:`block_mask` computes that map ahead, at blocks every
kernel's tiles are multiples of, so it can be built once, inspected (its repr gives its sparsity) and passed
to ``nc.attention(..., block_mask=...)``, whose kernels read it (coarsened to their tiles, transposed for the
backward's key tiles) instead of evaluating the mask. Block masks combine with ``&`` and ``|``.

import numpy as np
>>> dilated = block_mask(lambda q_idx, kv_idx: (abs(q_idx - kv_idx) < 64) & ((q_idx - kv_idx) % 2 == 0),
...                      None, None, 256, 256, tile=32, chunk=32)
>>> dilated
BlockMask(shape=(1, 1, 256, 256), block_size=(32, 32), empty=46.9%, full=0.0%, partial=53.1%, \
mask_mod=<lambda>)
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

from napkin_cat.affine_masks import and_masks, or_masks
from napkin_cat.errors import EvaluationError
from napkin_cat.generators import fname, index_names, positional
from napkin_cat.generators._index import block_map

#: the axes of a block mask, FlexAttention's index names: batch, (query) head, query, key
FLEX = ("b", "h", "q_idx", "kv_idx")

#: the default block: the smallest tile or chunk a kernel takes (every 16-bit dot has K ≥ 16), so that every
#: kernel's blocks are multiples of it
BLOCK = 16


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A mask function with its block map, computed ahead (:func:`block_map`): ``kept[b, h, i, j]`` holds where
    query block ``i`` and key block ``j`` keep something, ``whole`` where they keep everything; ``b`` and ``h``
    of size 1 where the mask reads no batch or head. Called with indices it is its mask function, so a kernel
    applies it as any ``mask_mod``; asked for blocks (``block_map``) it gives its own, coarsened. Compared by
    identity, as the entry compares index functions: build it once and pass it to every call.

    >>> m = block_mask(lambda q_idx, kv_idx: kv_idx <= q_idx, None, None, 64, 64, tile=16, chunk=16)
    >>> m.to_dense()[0, 0].tolist()
    [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    >>> round(m.sparsity(), 1), bool(m(q_idx=3, kv_idx=2))
    (37.5, True)
    """

    mask_mod: Callable
    shape: tuple[int, int, int, int]
    block_size: tuple[int, int]
    kept: np.ndarray
    whole: np.ndarray

    @property
    def keep(self) -> Callable:
        """The mask function read by name over :data:`FLEX` (FlexAttention's positional ``mask_mod`` converted)."""
        return positional(self.mask_mod, FLEX, score=False)

    def __call__(self, **indices):
        return self.keep(**indices)

    @property
    def __signature__(self):
        return inspect.signature(self.keep)

    @property
    def __name__(self):
        return f"block_mask({fname(self.mask_mod)})"

    def block_map(self, names: tuple[str, ...], extent: dict, blocks: dict) -> tuple:
        """The blocks of ``blocks`` (one entry per name of ``names``) this mask keeps something of and keeps
        whole, as :func:`napkin_cat.generators._index.block_map` gives them: its own map coarsened, where the
        sizes are those it was made for and the blocks multiples of its own; at other sizes (a derivation's trial
        run) its mask function evaluated.

        >>> m = block_mask(lambda q_idx, kv_idx: kv_idx <= q_idx, None, None, 64, 64, tile=16, chunk=16)
        >>> kept, whole = m.block_map(("kv_idx", "q_idx"), {"q_idx": 64, "kv_idx": 64}, {"q_idx": 32, "kv_idx": 64})
        >>> kept.tolist(), whole.tolist()
        ([[True, True]], [[False, False]])
        """
        own = dict(zip(FLEX, (*self.shape[:2], *self.shape[2:]), strict=True))
        step = dict(zip(FLEX, (1, 1, *self.block_size), strict=True))
        read = index_names(self.keep, score=False)

        def known(a):  # an axis its map says at these sizes and blocks; an axis it does not read, of size 1
            if a in FLEX[2:]:
                return own[a] == extent[a] and blocks[a] % step[a] == 0
            unread = read is not None and a not in read
            return unread or a in FLEX and own[a] in (1, extent[a])  # 1: made broadcast (B or H None)

        if not (set(FLEX[2:]) <= set(names) and all(known(a) for a in names)):
            return block_map(self.keep, names, extent, blocks)
        kept, whole = self.kept, self.whole
        for i, a in enumerate(FLEX[2:], start=2):
            if a in names:
                factor = blocks[a] // step[a]
                kept, whole = _coarsened(kept, i, factor, False), _coarsened(whole, i, factor, True)
        present = [a for a in FLEX if a in names]
        kept, whole = (_reduced(v, [FLEX.index(a) for a in FLEX if a not in names]) for v in (kept, whole))
        order = [present.index(a) for a in names if a in present]
        kept, whole = (np.transpose(v, order) for v in (kept, whole))
        at = [i for i, a in enumerate(names) if a not in present]  # axes it knows nothing of: size 1
        return tuple(np.expand_dims(v, at) if at else v for v in (kept, whole))

    def counts(self) -> tuple[int, int, int]:
        """Blocks (over batch, heads, query and key blocks, a broadcast axis counted once) the mask hides,
        keeps whole and cuts."""
        kept, whole = np.broadcast_arrays(self.kept, self.whole)
        full = int(np.sum(whole & kept))
        return int(np.sum(~kept)), full, int(np.sum(kept)) - full

    def sparsity(self) -> float:
        """The percentage of blocks the mask hides (FlexAttention's ``BlockMask.sparsity``)."""
        empty, full, partial = self.counts()
        return 100.0 * empty / max(empty + full + partial, 1)

    def to_dense(self):
        """The block map as integers ``[B, H, query blocks, key blocks]``: 0 hidden, 1 cut, 2 kept whole."""
        kept, whole = np.broadcast_arrays(self.kept, self.whole)
        return kept.astype(np.int32) + (kept & whole).astype(np.int32)

    def _joined(self, other: BlockMask, op: str) -> BlockMask:
        if not isinstance(other, BlockMask):
            return NotImplemented
        if self.shape[2:] != other.shape[2:] or self.block_size != other.block_size:
            raise EvaluationError(
                f"block masks of shapes {self.shape} and {other.shape}, blocks {self.block_size} and "
                f"{other.block_size}: {op} joins masks of one sequence length and one block size; build them alike"
            )
        shape = tuple(max(a, b) for a, b in zip(self.shape, other.shape, strict=True))
        if op == "&":  # hidden where either hides; whole where both keep whole (a cut block may be hidden: visited)
            kept, whole, fn = self.kept & other.kept, self.whole & other.whole, and_masks
        else:  # kept where either keeps; whole where one does (a cut pair may cover a block: run masked)
            kept, whole, fn = self.kept | other.kept, self.whole | other.whole, or_masks
        return BlockMask(fn(self.mask_mod, other.mask_mod), shape, self.block_size, kept, whole)

    def __and__(self, other: BlockMask) -> BlockMask:
        return self._joined(other, "&")

    def __or__(self, other: BlockMask) -> BlockMask:
        return self._joined(other, "|")

    def check(self, batch: int, heads: int, q_len: int, kv_len: int) -> None:
        """Refuse a call whose ``[B, H, Nq, Nk]`` is not the one this mask was made for (B and H of 1 broadcast).

        >>> block_mask(lambda q_idx, kv_idx: kv_idx <= q_idx, None, None, 64, 64).check(2, 4, 64, 32)
        Traceback (most recent call last):
        ...
        napkin_cat.errors.EvaluationError: block_mask <lambda> was made for [B, H, Nq, Nk] = [1, 1, 64, 64], \
called with [2, 4, 64, 32]; make it with nc.block_mask(mask_mod, B, H, 64, 32) (B, H None where the mask reads none)
        """
        given = (batch, heads, q_len, kv_len)
        if any(m not in (1, n) for m, n in zip(self.shape[:2], given[:2], strict=True)) or self.shape[2:] != given[2:]:
            raise EvaluationError(
                f"block_mask {fname(self.mask_mod)} was made for [B, H, Nq, Nk] = {list(self.shape)}, called with "
                f"{list(given)}; make it with nc.block_mask(mask_mod, B, H, {q_len}, {kv_len}) (B, H None where the "
                "mask reads none)"
            )

    def __repr__(self):
        empty, full, partial = self.counts()
        total = max(empty + full + partial, 1)
        return (
            f"BlockMask(shape={self.shape}, block_size={self.block_size}, empty={100 * empty / total:.1f}%, "
            f"full={100 * full / total:.1f}%, partial={100 * partial / total:.1f}%, mask_mod={fname(self.mask_mod)})"
        )


def _coarsened(v, axis: int, factor: int, fill: bool):
    """``v``'s blocks along ``axis`` merged ``factor`` at a time: any of them (``fill`` False), all (True)."""
    if factor == 1:
        return v
    n = v.shape[axis]
    widths = [(0, 0)] * v.ndim
    widths[axis] = (0, -n % factor)
    v = np.pad(v, widths, constant_values=fill)
    v = v.reshape(*v.shape[:axis], -1, factor, *v.shape[axis + 1 :])
    return v.all(axis + 1) if fill else v.any(axis + 1)


def _reduced(v, axes: list[int]):
    """``v`` without ``axes`` (batch or head axes of size 1 the caller does not name)."""
    return v.reshape([n for i, n in enumerate(v.shape) if i not in axes]) if axes else v


def block_mask(
    mask_mod: Callable,
    B: int | None,
    H: int | None,
    Nq: int,
    Nk: int,
    *,
    tile: int | None = None,
    chunk: int | None = None,
) -> BlockMask:
    """The :class:`BlockMask` of ``mask_mod`` (FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)``, or one naming the
    indices it reads) over ``[B, H, Nq, Nk]`` scores (FlexAttention's ``create_block_mask``): per block of
    ``tile`` queries and ``chunk`` keys (default :data:`BLOCK`, which every kernel's tiles are multiples of),
    whether the mask keeps something and whether it keeps all (numpy arrays), evaluated on every index now,
    once (under a caller's ``jit`` too: it depends on the sizes only). ``B`` or ``H`` None, as in FlexAttention:
    the map is made at index 0 and broadcast over every batch or head (say None only for a mask reading none).

    >>> def neighbours(q_idx, kv_idx):  # a 16 × 16 image, 2-D neighbourhood of radius 2
    ...     return (abs(q_idx // 16 - kv_idx // 16) <= 2) & (abs(q_idx % 16 - kv_idx % 16) <= 2)
    >>> m = block_mask(neighbours, None, None, 256, 256)
    >>> m.shape, m.kept.shape, round(m.sparsity(), 1)
    ((1, 1, 256, 256), (1, 1, 16, 16), 71.1)
    >>> block_mask(lambda h, q_idx, kv_idx: q_idx >= kv_idx + 16 * h, None, 4, 64, 64).to_dense()[0, :, 3, 0].tolist()
    [2, 2, 2, 1]
    >>> block_mask(lambda q_idx, kv_idx: kv_idx <= q_idx, None, None, 64, 64, tile=0)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: block_mask <lambda>: tile must be a positive int, got 0
    """
    tile, chunk = (BLOCK if n is None else n for n in (tile, chunk))
    keep = positional(mask_mod, FLEX, score=False)
    read = index_names(keep, score=False)
    for what, n in (("tile", tile), ("chunk", chunk), ("Nq", Nq), ("Nk", Nk)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise EvaluationError(f"block_mask {fname(mask_mod)}: {what} must be a positive int, got {n!r}")
    shape = (B or 1, H or 1, Nq, Nk)
    extent = dict(zip(FLEX, shape, strict=True))
    with jax.ensure_compile_time_eval():
        kept, whole = block_map(keep, FLEX, extent, dict(zip(FLEX, (1, 1, tile, chunk), strict=True)))
        grid = (*(n if a in (read or FLEX) else 1 for a, n in zip(FLEX[:2], shape[:2], strict=True)),
                -(-Nq // tile), -(-Nk // chunk))
        kept, whole = np.broadcast_to(np.asarray(kept), grid), np.broadcast_to(np.asarray(whole), grid)
    return BlockMask(mask_mod, shape, (tile, chunk), kept, whole)
