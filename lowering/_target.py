"""Where a kernel runs: interpreted or compiled, and the hardware model its guards assume. Shared by every
backend (below them all, as :mod:`lowering._blocks` is)."""

from __future__ import annotations

import functools
import os
import warnings

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


def cpu_pool_threads(environ=os.environ) -> int:
    """The threads of XLA's CPU thread pool, as its client sizes it when JAX starts: ``PJRT_NPROC``, else ``NPROC``,
    else the CPUs this process may run on.

    >>> cpu_pool_threads({"PJRT_NPROC": "16"}), cpu_pool_threads({"NPROC": "3"})
    (16, 3)
    """
    for name in ("PJRT_NPROC", "NPROC"):
        if environ.get(name, "").strip().isdigit():
            return int(environ[name])
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def interpreter_threads_needed(threads: int) -> int:
    """The CPU pool's threads an interpreted Mosaic GPU kernel of ``threads`` warpgroups may hold at once, plus one
    to make progress. Mosaic GPU's interpreter runs the warpgroups as Python threads and waits for them inside a
    host callback, and each warpgroup's barrier waits are host callbacks too: the callback that waits and every
    warpgroup's waiting callback can each occupy a pool thread, twice where a program holds two independent kernels
    (the backward's), so a smaller pool can deadlock (seen on two CPUs: ``PJRT_NPROC=1`` hangs every time).

    >>> interpreter_threads_needed(3)  # two consumers and the producer
    9
    """
    return 2 * (threads + 1) + 1


def check_interpreter_pool(threads: int, environ=os.environ) -> None:
    """Warn once per process where XLA's CPU pool (:func:`cpu_pool_threads`) is smaller than an interpreted Mosaic
    GPU kernel of ``threads`` warpgroups may need (:func:`interpreter_threads_needed`): it can hang, not fail.

    >>> check_interpreter_pool(3, {"PJRT_NPROC": "16"})  # large enough: silent
    """
    have, need = cpu_pool_threads(environ), interpreter_threads_needed(threads)
    if have < need:
        _warn_pool(have, need, threads)


@functools.cache
def _warn_pool(have: int, need: int, threads: int) -> None:
    warnings.warn(
        f"Mosaic interpret mode: XLA's CPU thread pool has {have} threads (PJRT_NPROC, else this machine's CPUs) and "
        f"an interpreted kernel of {threads} warpgroups may hold {need - 1} of them waiting at once, so it can "
        f"deadlock; set PJRT_NPROC={max(need, 16)} in the environment before JAX starts (docs/mosaic.md, "
        "'Interpret mode')",
        RuntimeWarning,
        stacklevel=2,
    )
