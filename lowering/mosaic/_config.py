"""The Mosaic GPU backend's knobs (:class:`MosaicConfig`), the Hopper budgets it is checked against, and where it
runs at all (:func:`unavailable`)."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from napkin_cat.hardware import H100
from napkin_cat.levels import REG

#: wgmma's row count per warpgroup
WGMMA_M = 64

#: the Hopper budgets a configuration is refused against before compiling (the hardware model's H100)
SMEM_LIMIT, REGISTERS = H100.smem_per_block, H100.capacity(REG) // 4
#: where Mosaic GPU starts each shared-memory allocation (jax._src.pallas.mosaic_gpu.core.SMEM_ALIGNMENT)
SMEM_ALIGNMENT = 1024


def wgmma_takes(dtype) -> bool:
    """Whether ``wgmma`` multiplies operands of ``dtype`` (a jnp or napkin-cat dtype): 16-bit floats or FP8 (e4m3,
    e5m2); an f32 kernel runs on Triton.

    >>> wgmma_takes(jnp.bfloat16), wgmma_takes(jnp.float8_e4m3fn), wgmma_takes(jnp.float32)
    (True, True, False)
    """
    d = jnp.dtype(getattr(dtype, "jnp", dtype))
    return d.itemsize == 2 or d in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


@dataclass(frozen=True)
class MosaicConfig:
    """The Hopper knobs the diagram does not carry (yet): ring stages, ping-pong, registers.

    ``consumers`` (the warpgroups a tile is split over) comes from the diagram's ``split`` label; given here
    it must agree with the label, and without either it is 2 (1 for a tile of wgmma's 64 rows).

    ``interpretable`` keeps to what Mosaic's interpret mode runs: a register A operand is staged through
    shared memory, and a product is added to its accumulator after the ``wgmma`` instead of the ``wgmma``
    accumulating in place. An interpreted kernel always takes both detours (the interpreter runs nothing else,
    and they compute the same values), whatever the field says; compiled kernels take them only where it is
    set. ``pingpong`` orders the two consumer
    warpgroups' matrix products around a shared barrier so that one's softmax runs under the other's
    ``wgmma`` (FA3's schedule); None (the default) turns it on where it was measured faster
    (:meth:`MosaicLowered._pingpong`): where a chunk issues two wgmmas, FA3's forward (S, then P·V; +12% at
    D = 128), and the backward's dQ (three) at D = 64, where the shorter products leave its exponentials more
    to hide; off elsewhere (JAX's Mosaic GPU attention backward has no such barrier).
    ``members`` sets how many batch elements a section of the launch holds (a divisor of the batch; None: the
    L2 rule of ``MosaicKernel.members``; ``papers/flash_attention/launch_order.py`` compares them).

    >>> MosaicConfig().registers()
    (232, 40)
    """

    consumers: int | None = None
    stages: int = 2
    pingpong: bool | None = None
    interpretable: bool = False
    members: int | None = None
    consumer_registers: int = 232
    producer_registers: int = 40

    def registers(self) -> tuple[int, int]:
        """Registers per thread of a consumer and of the producer warpgroup (``setmaxnreg``)."""
        return self.consumer_registers, self.producer_registers


def unavailable(interpret: bool | None, config=None) -> str | None:
    """Why ``backend="auto"`` takes no Mosaic kernel here whatever the diagram (the device, ``interpret``, a
    Triton ``config``), else None.

    >>> unavailable(None)  # on a CPU
    "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU"
    """
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability != "9.0":
        return f"device {device.device_kind!r} ({device.platform}) is not an sm_90 (Hopper) GPU"
    if interpret:
        return "interpret=True: 'auto' interprets with Triton"
    if config is not None and not isinstance(config, MosaicConfig):
        return f"config is a {type(config).__name__}, which tunes Triton"
    return None
