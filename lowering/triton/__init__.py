"""The Triton backend: a scheduled diagram becomes one ``pl.pallas_call`` (:class:`TritonLowered`), tuned by a
:class:`TritonConfig`. ``Config`` and ``Lowered`` are the names :mod:`lowering` has always exported for them.

Modules: ``_config`` (the knobs and the block policy, :class:`TritonBlocks`), ``_namespace`` (the kernel body's
arrays: ``jnp.dot``, ``exp2``, native ``tanh``), ``_kernel`` (the body: the block diagram walked on one program's
blocks, the streamed loop), ``_lowered`` (the wrapper: guards, padding, launch).
"""

from lowering.triton._config import STAGES as STAGES
from lowering.triton._config import TRITON_BLOCKS as TRITON_BLOCKS
from lowering.triton._config import TritonBlocks as TritonBlocks
from lowering.triton._config import TritonConfig as TritonConfig
from lowering.triton._lowered import TritonLowered as TritonLowered
from lowering.triton._lowered import kernel_rules as kernel_rules
from lowering.triton._lowered import launch as launch
from lowering.triton._lowered import paddable as paddable
from lowering.triton._namespace import Blocks as Blocks
from lowering.triton._namespace import block_einsum as block_einsum
from lowering.triton._namespace import native_tanh as native_tanh
from lowering.triton._namespace import operand_dtype as operand_dtype

#: the names :mod:`lowering` exports for the Triton backend's config and kernel
Config, Lowered = TritonConfig, TritonLowered
