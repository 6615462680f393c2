"""The Triton backend's tuning knobs (:class:`TritonConfig`) and its block policy."""

from __future__ import annotations

from dataclasses import dataclass

from lowering._plan import NotLowerable, Plan


@dataclass(frozen=True)
class TritonConfig:
    """Tuning knobs of the Triton backend (tile sizes come from the diagram's labels), checked when made.

    ``num_warps`` is a power of two from 1 to 32 (Triton's range); ``num_stages`` ≥ 1 is how many
    buffers of each streamed chunk the pipeline keeps, so it multiplies the shared-memory footprint.

    >>> TritonConfig(num_warps=8, num_stages=3)
    TritonConfig(num_warps=8, num_stages=3)
    >>> TritonConfig(num_stages=-1)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: TritonConfig: num_stages must be an integer ≥ 1, got -1
    >>> TritonConfig(num_warps=6)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: TritonConfig: num_warps must be one of 1, 2, 4, 8, 16, 32, got 6
    """

    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not integer(self.num_warps) or self.num_warps not in WARPS:
            shown = ", ".join(map(str, WARPS))
            raise NotLowerable(f"TritonConfig: num_warps must be one of {shown}, got {self.num_warps!r}")
        if not integer(self.num_stages) or self.num_stages < 1:
            raise NotLowerable(f"TritonConfig: num_stages must be an integer ≥ 1, got {self.num_stages!r}")

    @classmethod
    def get_default(cls, p: Plan) -> TritonConfig:
        """8 warps for 128-row tiles, else 4; 3 pipeline stages (measured on H200 by ``lowering._search``),
        1 for a stream of single elements (a batch axis summed, a few steps each loading a tile of every
        input: the pipeline's prologue costs more than it hides; a learned bias's gradient kernel at B = 2,
        N = 8192, D = 128 on an H100 runs in 6.1 ms at 1 stage, 7.8 at 2, 10.9 at 3:
        ``papers/flash_attention/bias_gradient.py``).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False)
        >>> TritonConfig.get_default(plan(flash.diagram))
        TritonConfig(num_warps=8, num_stages=3)
        """
        g = max(p.tiles.values(), default=64)
        return cls(num_warps=8 if g >= 128 else 4, num_stages=1 if p.stream and p.stream[1] == 1 else 3)


#: the warp counts Triton accepts
WARPS = (1, 2, 4, 8, 16, 32)
