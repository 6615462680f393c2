"""Where a kernel runs: interpreted or compiled, and the hardware model its guards assume. Shared by every
backend (below them all, as :mod:`lowering._blocks` is)."""

from __future__ import annotations

import jax

from lowering._plan import NotLowerable
from napkin_cat.hardware import H100, HARDWARE, Hardware, for_device


def interpreted(interpret: bool | None) -> bool:
    """Whether a kernel interprets: as asked, or by default where no GPU is the default backend.

    >>> interpreted(True), interpreted(None)  # on a CPU
    (True, True)
    """
    return (jax.default_backend() != "gpu") if interpret is None else interpret


def no_gpu() -> str | None:
    """Why nothing compiled can run here (jax's first device is no GPU), else None.

    >>> no_gpu()  # on a CPU
    "this machine has no GPU (jax's device is 'cpu')"
    """
    device = jax.devices()[0]
    return None if device.platform == "gpu" else f"this machine has no GPU (jax's device is {device.platform!r})"


def target_hardware(interpret: bool) -> Hardware:
    """The hardware a kernel's guards assume: the detected GPU's model when compiling, H100 when interpreting.
    Compiling where there is no GPU is refused, saying so: ``hardware=`` only names the GPU a kernel is lowered
    for elsewhere (``jax.jit(kernel).trace(...).lower(lowering_platforms=("cuda",))``), it never runs here.

    >>> target_hardware(interpret=True).name
    'H100'
    >>> target_hardware(interpret=False)  # on a CPU
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: lower(interpret=False) compiles the kernels for a GPU, and this machine has no GPU \
(jax's device is 'cpu'); pass interpret=None (interpret here, compile on a GPU) or interpret=True, or run on a GPU \
(hardware= only names the GPU model a kernel is lowered for, to lower it for CUDA without running it here)
    """
    if interpret:
        return H100
    if why := no_gpu():
        raise NotLowerable(
            f"lower(interpret=False) compiles the kernels for a GPU, and {why}; pass interpret=None (interpret here, "
            "compile on a GPU) or interpret=True, or run on a GPU (hardware= only names the GPU model a kernel is "
            "lowered for, to lower it for CUDA without running it here)"
        )
    kind = jax.devices()[0].device_kind
    found = for_device(kind)
    if found is None:
        known = ", ".join(h.name for h in HARDWARE)
        raise NotLowerable(
            f"no hardware model for the device {kind!r} (known: {known}); pass lower(..., hardware=) "
            "a napkin_cat.hardware.Hardware describing it"
        )
    return found
