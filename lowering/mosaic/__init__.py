"""The Mosaic GPU backend (Hopper): a scheduled diagram becomes one warp-specialised ``plgpu.kernel``
(:class:`MosaicLowered`), tuned by a :class:`MosaicConfig`.

Modules: ``_config`` (the knobs, the Hopper budgets, where it runs), ``_arrays`` (a consumer's arrays: registers,
shared-memory operands, ``wgmma``), ``_kernel`` (the body: producer and consumer warpgroups), ``_lowered`` (the
wrapper: checks, shared memory, launch), ``_policy`` (the blocks it was measured at, where ``"auto"`` takes it).
"""

from lowering.mosaic._arrays import MosaicArrays as MosaicArrays
from lowering.mosaic._config import WGMMA_M as WGMMA_M
from lowering.mosaic._config import MosaicConfig as MosaicConfig
from lowering.mosaic._config import unavailable as unavailable
from lowering.mosaic._config import wgmma_takes as wgmma_takes
from lowering.mosaic._lowered import MosaicLowered as MosaicLowered
from lowering.mosaic._policy import MOSAIC_BLOCKS as MOSAIC_BLOCKS
from lowering.mosaic._policy import MosaicBlocks as MosaicBlocks
from lowering.mosaic._policy import admits as admits
from lowering.mosaic._policy import faster as faster
