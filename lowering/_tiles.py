"""Tile sizes from the cost model: the time the cost functor predicts for a schedule, and the schedule it picks
(FAN §4: the largest tile that fits, refined by predicted time).

Here rather than in :mod:`napkin_cat.optimize` because a prediction needs a *scheduled* diagram, which only
:mod:`rewrites` derives, and ``napkin_cat`` imports neither ``rewrites`` nor ``lowering``.

>>> from napkin_cat.hardware import H100
>>> choose_tiles("attention", H100, {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}, tiles=(64, 128), streams=(64,))
(128, 64)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import napkin_cat as nc
from napkin_cat import Cost, cost
from napkin_cat.errors import CostError
from napkin_cat.hardware import Hardware
from napkin_cat.levels import SMEM
from rewrites import derive, level, stream, tile

__all__ = ["choose_tiles", "predicted_time"]


def _attention_cost(hw: Hardware, sizes: Mapping[str, int], g: int, s: int) -> Cost:
    b, h, q, x = nc.axes("b h q x")
    d = nc.Axis("d", sizes["d"])
    mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16")
    scheduled = derive(mha, tile(q, g), stream(x, s), level(SMEM), verify=False).diagram
    return cost(scheduled, hw).subs(**{k: v for k, v in sizes.items() if k != "d"})


def predicted_time(kernel: str, hw: Hardware, sizes: Mapping[str, int], g: int, s: int) -> float:
    """Seconds the cost model predicts for ``kernel`` ("attention": bf16 multi-head, ``b h q x d``) with query
    tiles ``g`` and key chunks ``s``: :attr:`Cost.time_serial` (the lowered kernel does not overlap its
    softmax with its matmuls; papers/flash_attention/results/cost_vs_hardware_*.md).

    >>> from napkin_cat.hardware import H100
    >>> round(predicted_time("attention", H100, {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}, 128, 64) * 1e3, 3)
    0.914
    """
    if kernel != "attention":
        raise CostError(f"predicted_time: no schedule family for kernel {kernel!r}; known: attention")
    return float(_attention_cost(hw, sizes, g, s).time_serial)


def choose_tiles(
    kernel: str,
    hw: Hardware,
    sizes: Mapping[str, int],
    tiles: Iterable[int] = (16, 32, 64, 128, 256),
    streams: Iterable[int] = (16, 32, 64, 128, 256),
    stages: int = 3,
) -> tuple[int, int]:
    """The (tile, stream) sizes the cost model picks: the fastest predicted among those whose blocks fit
    one block's shared memory (Q's tile plus ``stages`` buffers of K's and V's chunks, Triton's pipeline;
    3 stages are the measured default), ties to the largest tile (FAN's rule), then the largest chunk.

    >>> from napkin_cat.hardware import H100
    >>> sizes = {"b": 4, "h": 16, "q": 4096, "x": 4096, "d": 128}
    >>> choose_tiles("attention", H100, sizes, tiles=(64, 128, 256), streams=(32, 64, 128))
    (256, 64)
    """
    d, bytes_ = sizes["d"], 2

    def fits(g: int, s: int) -> bool:
        return g * d * bytes_ + stages * 2 * s * d * bytes_ <= hw.smem_per_block and g <= sizes["q"]

    candidates = [(g, s) for g in tiles for s in streams if fits(g, s)]
    if not candidates:
        raise CostError(f"choose_tiles: no tile and stream of {tuple(tiles)} × {tuple(streams)} fits {hw.name}")
    return min(candidates, key=lambda gs: (round(predicted_time(kernel, hw, sizes, *gs), 12), -gs[0], -gs[1]))
