"""The one way this project times a JAX callable (``lowering.median_time``, the tile search, every benchmark under
``papers/``): device time where JAX offers it.

:func:`time_calls` gives seconds per call of ``f(*args)`` and says how it got them (``Timing.method``):

* ``"cupti"``: on a GPU, the device's own kernel durations, read by CUPTI through
  ``jax.experimental.mosaic.gpu.profiler.measure`` (what jax's Pallas GPU benchmarks use): a sample
  is the kernels' summed duration over ``reps`` back-to-back calls ÷ ``reps``. It excludes the host's
  dispatch and the gaps between kernels, and it adds up every device's kernels, so a function sharded
  over several GPUs must ask for ``method="wall"``.
* ``"wall"``: everywhere else (CPU, a function that is not jitted, or CUPTI unavailable: ``Timing.note``
  says why), the wall clock of ``reps`` calls dispatched back to back with one ``block_until_ready`` at
  the end, ÷ ``reps``. jax dispatches asynchronously, so the device runs the calls back to back and the
  host round trip (~0.7 ms on a cloud VM) is paid once per batch instead of once per call.

Either way, ``warmup`` waited-on calls come first (compilation), then ``batches`` samples, and
``Timing.seconds`` is their median. :func:`once` times one-off costs (tracing, compiling, a training
run): one call, waited on, wall and CPU seconds.

>>> import jax.numpy as jnp
>>> t = time_calls(jnp.sin, jnp.ones(4), reps=3, batches=3, method="wall")
>>> t.method, len(t.samples), t.seconds > 0
('wall', 3, True)
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

import jax

METHODS = ("auto", "wall")


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per call, median over batches; the per-batch samples; which clock measured them and why.

    ``host_bound`` (wall clock only): in most batches the host took ≥ 90% of the batch to dispatch the
    calls, so the time bounds the host, not the device.

    >>> Timing(2e-3, (1e-3, 2e-3, 3e-3), "wall").ms
    2.0
    """

    seconds: float
    samples: tuple[float, ...]
    method: Literal["cupti", "wall"]
    note: str = ""
    host_bound: bool = False
    #: CUPTI only: each kernel a call launches, in launch order, with its median seconds per call
    kernels: tuple[tuple[str, float], ...] = ()

    @property
    def ms(self) -> float:
        return self.seconds * 1e3


def time_calls(
    f: Callable, *args, reps: int = 20, batches: int = 5, warmup: int = 2, method: str = "auto"
) -> Timing:
    """Time ``f(*args)``: device time by CUPTI on a GPU (``method="auto"``), else the wall clock.

    ``method="wall"`` forces the wall clock (a function sharded over several devices, whose kernels
    CUPTI would add up).

    >>> import jax.numpy as jnp
    >>> t = time_calls(jnp.cos, jnp.ones(8), reps=2, batches=3, warmup=1)
    >>> t.method == ("cupti" if jax.devices()[0].platform == "gpu" else "wall"), len(t.samples)
    (True, 3)
    """
    if method not in METHODS:
        raise ValueError(f"time_calls: method={method!r} is not one of {METHODS}; use 'auto' or 'wall'")
    if min(reps, batches) < 1 or warmup < 0:
        raise ValueError(f"time_calls: reps={reps} and batches={batches} must be ≥ 1 and warmup={warmup} ≥ 0")
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    note = ""
    if method == "auto":
        samples, note, kernels = _cupti(f, args, reps, batches)
        if samples is not None:
            return Timing(statistics.median(samples), tuple(samples), "cupti", kernels=kernels)
    samples, host_bound = _wall(f, args, reps, batches)
    return Timing(statistics.median(samples), tuple(samples), "wall", note, host_bound)


def _cupti(f: Callable, args, reps: int, batches: int) -> tuple[list[float] | None, str, tuple]:
    """Per-batch kernel seconds per call by CUPTI, or None and why it cannot be used here; and each kernel a call
    launches with its median seconds (:attr:`Timing.kernels`)."""
    if jax.devices()[0].platform != "gpu":
        return None, f"no CUPTI on {jax.devices()[0].platform}", ()
    if not isinstance(f, jax.stages.Wrapped | jax.stages.Compiled):  # measure would jit it: another function
        return None, f"{getattr(f, '__name__', f)!r} is not jitted, and CUPTI times jitted functions", ()
    try:
        from jax.experimental.mosaic.gpu import profiler

        timed = profiler.measure(f, iterations=reps, aggregate=False)
        samples, calls = [], []
        for _ in range(batches):
            _, per_call = timed(*args)  # per call, its kernels as (name, ms)
            if not per_call:
                return None, "CUPTI saw no kernel launched", ()
            per_call = per_call if reps > 1 else [per_call]
            samples.append(sum(ms for call in per_call for _, ms in call) / reps / 1e3)
            calls += per_call
    except (ImportError, RuntimeError) as e:  # another CUPTI subscriber (ncu, nsys), or no Mosaic GPU extension
        return None, f"CUPTI unavailable: {type(e).__name__}: {str(e)[:200]}", ()
    kernels = tuple((name, statistics.median(c[i][1] for c in calls) / 1e3) for i, (name, _) in enumerate(calls[0]))
    return samples, "", kernels


def _wall(f: Callable, args, reps: int, batches: int) -> tuple[list[float], bool]:
    """Per-batch wall seconds per call of ``reps`` back-to-back calls, and whether the host bounded most."""
    samples, host_bound = [], 0
    for _ in range(batches):
        out = None
        t0 = time.perf_counter()
        for _ in range(reps):
            out = f(*args)  # the previous output is dropped, not waited on
        dispatched = time.perf_counter()
        jax.block_until_ready(out)
        t1 = time.perf_counter()
        samples.append((t1 - t0) / reps)
        host_bound += reps > 1 and (dispatched - t0) > 0.9 * (t1 - t0)
    return samples, host_bound > batches // 2


def once(f: Callable, *args) -> tuple[Any, float, float]:
    """``f(*args)`` once, waited on: its result, the wall seconds and this process's CPU seconds.

    For costs paid once (tracing, compiling, a first call, a training run), which :func:`time_calls`'s
    warm-up would hide.

    >>> import jax.numpy as jnp
    >>> out, wall, cpu = once(jnp.add, jnp.ones(2), 1.0)
    >>> out.tolist(), wall > 0, cpu >= 0
    ([2.0, 2.0], True, True)
    """
    wall, cpu = time.perf_counter(), time.process_time()
    out = jax.block_until_ready(f(*args))
    return out, time.perf_counter() - wall, time.process_time() - cpu
