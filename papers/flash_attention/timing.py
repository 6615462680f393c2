"""The one timing helper, :mod:`lowering._timing` (moved into the package so that ``lowering.median_time`` and the
tile search use it too), under the name every script under ``papers/`` imports; and what the fused-entry
benchmarks (``rms_norm_linear.py``, ``linear_cross_entropy.py``, ``fp8.py``, ``head_dims.py``) share: timing each
pass of an implementation (:func:`measure_passes`), the rows loop that records a failure as a result
(:func:`run_rows`), the results file rewritten after every row (:func:`write_rows`) and its bar chart
(:func:`bar_plot`, :func:`save_figure`); and ncu's counters per kernel launch (:func:`ncu_launches`).

>>> import jax.numpy as jnp
>>> time_calls(jnp.sin, jnp.ones(4), reps=2, batches=2, method="wall").method
'wall'
"""

from __future__ import annotations

import csv
import io
import json
import os
import signal
import subprocess
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path

import jax
import numpy as np

from lowering._timing import METHODS as METHODS
from lowering._timing import Timing as Timing
from lowering._timing import once as once
from lowering._timing import time_calls as time_calls

#: the two passes the fused-entry benchmarks time, and the flops of each as a multiple of the forward's
PASSES = {"forward": 1, "forward+backward": 3}


def rel_err(got, want) -> float:
    """max |got − want| / max |want|, in f64.

    >>> rel_err(np.array([1.0, 2.1]), np.array([1.0, 2.0]))  # doctest: +ELLIPSIS
    0.05...
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def temporaries(f, *args) -> int | None:
    """The temporaries XLA's memory analysis reports for ``f`` compiled on ``args``, in bytes (None if none).

    >>> import jax.numpy as jnp
    >>> isinstance(temporaries(jnp.sin, jnp.ones(4)), (int, type(None)))
    True
    """
    analysis = jax.jit(f).lower(*args).compile().memory_analysis()
    return None if analysis is None else int(analysis.temp_size_in_bytes)


def measure_passes(name: str, passes: dict, args, flops: float, want: list, extra: dict | None = None) -> dict:
    """Each pass ``{what: f}`` of one implementation on ``args``: its time, TFLOP/s (``flops`` times the pass's
    :data:`PASSES` factor), temporaries, ``extra`` fields (``{key: () → value}``, read after the run) and the
    relative error of each output leaf against ``want``'s first leaves. A pass that fails is recorded with its
    error, not raised (out of memory is a result).

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(1.0, 5.0)
    >>> row = measure_passes("sin", {"forward": jnp.sin}, (x,), 4.0, [jnp.sin(x)])  # doctest: +ELLIPSIS
      sin      forward ...
    >>> sorted(row["forward"]), row["forward"]["rel_err"]
    (['method', 'ms', 'rel_err', 'temp_bytes', 'tflops'], [0.0])
    """
    row = {}
    for what, f in passes.items():
        try:
            jitted = jax.jit(f)
            got = jax.tree.leaves(jax.block_until_ready(jitted(*args)))
            t = time_calls(jitted, *args, reps=5, batches=3)
            errs = [rel_err(a, b) for a, b in zip(got, want[: len(got)], strict=True)]
            row[what] = {"ms": t.ms, "method": t.method, "tflops": flops * PASSES[what] / t.seconds / 1e12,
                         "temp_bytes": temporaries(f, *args)}
            row[what] |= {key: read() for key, read in (extra or {}).items()} | {"rel_err": errs}
            print(f"  {name:8s} {what:17s} {t.ms:9.3f} ms  {row[what]['tflops']:7.1f} TFLOP/s  "
                  f"temp {row[what]['temp_bytes']}  err {max(errs):.1e}", flush=True)
        except Exception as e:  # recorded, not fatal: the unfused big row may not fit the device
            row[what] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(f"  {name:8s} {what:17s} failed: {row[what]['error'][:200]}", flush=True)
            traceback.print_exc(limit=2)
    return row


def speedups(row: dict, ours: str = "napkin", theirs: str = "xla") -> list[str]:
    """Set ``row["speedup_vs_xla"][what]``, ``theirs``' time ÷ ``ours``, for each pass both timed; those passes.

    >>> row = {"napkin": {"forward": {"ms": 2.0}}, "xla": {"forward": {"ms": 3.0}, "forward+backward": {}}}
    >>> speedups(row), row["speedup_vs_xla"]
    (['forward'], {'forward': 1.5})
    """
    timed = [w for w in PASSES if "ms" in row[ours].get(w, {}) and "ms" in row[theirs].get(w, {})]
    for what in timed:
        row.setdefault("speedup_vs_xla", {})[what] = row[theirs][what]["ms"] / row[ours][what]["ms"]
    return timed


def run_rows(impls: dict, head: dict, work: Callable, show: Callable, label: str, width: int) -> list[dict]:
    """One row per implementation ``{name: impl}``: ``head``, ``"impl": name``, then what ``work(name, impl, row)``
    adds to it (returning False leaves the row out), or the error it raised (a refusal or a failed build is a
    result of the sweep). Prints each row: ``label``, the name padded to ``width``, the error or ``show(row)``.

    >>> def work(name, impl, row):
    ...     row["value"] = 1 / impl
    >>> rows = run_rows({"one": 1, "zero": 0}, {"n": 4}, work, lambda r: f"{r['value']}", "n=4", 5)
    n=4 one   1.0
    n=4 zero  ZeroDivisionError: division by zero
    >>> rows[1]
    {'n': 4, 'impl': 'zero', 'error': 'ZeroDivisionError: division by zero'}
    """
    rows = []
    for name, impl in impls.items():
        row = head | {"impl": name}
        try:
            if work(name, impl, row) is False:
                continue
        except Exception as e:  # noqa: BLE001 - a refusal or a failed build is a result of the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        rows.append(row)
        print(f"{label} {name:{width}s} {row.get('error') or show(row)}", flush=True)
    return rows


def timed(f: Callable, *args) -> dict:
    """``f(*args)``'s fields and ``"seconds"``, the wall time it took.

    >>> sorted(timed(dict, {"a": 1}))
    ['a', 'seconds']
    """
    start = time.perf_counter()
    fields = f(*args)
    return fields | {"seconds": time.perf_counter() - start}


def write_rows(sizes: Iterable[tuple], run_row: Callable, device: dict, out: Path, stem: str, plot: Callable) -> list:
    """``run_row(*size)`` for each size, rewriting ``out/<stem>.json`` (``{"device", "rows"}``) and drawing
    ``plot(rows, out/<stem>.png)`` after every row, so a run cut short keeps what it measured.

    >>> import tempfile
    >>> out = Path(tempfile.mkdtemp())
    >>> draw = lambda rows, path: None
    >>> write_rows([(1,), (2,)], lambda n: {"n": n}, {"kind": "cpu"}, out, "demo", draw)  # doctest: +ELLIPSIS
    wrote ... and .png
    [{'n': 1}, {'n': 2}]
    >>> json.loads((out / "demo.json").read_text())["rows"][1]
    {'n': 2}
    """
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in sizes:
        rows.append(run_row(*size))
        (out / f"{stem}.json").write_text(json.dumps({"device": device, "rows": rows}, indent=1))
        plot(rows, out / f"{stem}.png")
    print(f"wrote {out / stem}.json and .png")
    return rows


def bar_plot(rows: list, path: Path, title: str, bars: dict, value: str, ticks: list[str], ylabel: str) -> None:
    """One panel per pass of :data:`PASSES`, a bar per row for each implementation ``{key: label}``: the rows'
    ``row[key][pass][value]`` (a gap where the pass failed), the x ticks ``ticks``.

    >>> import tempfile
    >>> rows = [{"a": {"forward": {"ms": 1.0}, "forward+backward": {"error": "OOM"}}}]
    >>> bar_plot(rows, Path(tempfile.mkdtemp()) / "p.png", "demo", {"a": "A"}, "ms", ["n=1"], "ms")
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, what in zip(axes, PASSES, strict=True):
        x = np.arange(len(rows))
        for k, (impl, label) in enumerate(bars.items()):
            heights = [r[impl].get(what, {}).get(value, np.nan) for r in rows]
            ax.bar(x + 0.4 * k, heights, 0.4, label=label, color=f"C{k}")
        ax.set_xticks(x + 0.2, ticks)
        ax.set_ylabel(ylabel)
        ax.set_title(what)
        ax.legend()
    fig.suptitle(title)
    save_figure(fig, path, dpi=120)


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay ``fig`` out tightly, write it to ``path`` and close it (a sweep draws one per row).

    >>> import tempfile, matplotlib
    >>> matplotlib.use("Agg")
    >>> import matplotlib.pyplot as plt
    >>> save_figure(plt.figure(), Path(tempfile.mkdtemp()) / "empty.png")
    """
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def ncu_rows(stdout: str) -> list[dict]:
    r"""ncu's ``--csv --print-units base`` output as one dict per profiled launch, in launch order: ``id``,
    ``kernel`` and each metric's value (bytes, ns).

    >>> out = '==PROF== Connected\n"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
    >>> out += '"0","napkin_kernel","dram__bytes_read.sum","byte","1,024"\n'
    >>> out += '"0","napkin_kernel","gpu__time_duration.sum","ns","35"'
    >>> ncu_rows(out)
    [{'id': 0, 'kernel': 'napkin_kernel', 'dram__bytes_read.sum': 1024.0, 'gpu__time_duration.sum': 35.0}]
    """
    lines = [line for line in stdout.splitlines() if line.startswith('"')]
    by_id: dict = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        try:
            at = by_id.setdefault(int(row["ID"]), {"id": int(row["ID"]), "kernel": row.get("Kernel Name", "")})
            at[row["Metric Name"]] = float(row["Metric Value"].replace(",", ""))
        except (KeyError, ValueError):
            continue
    return [by_id[i] for i in sorted(by_id)]


def ncu_launches(argv: list[str], metrics: Iterable[str], kernels: str, timeout: float) -> tuple[list[dict], str]:
    """Run ``argv`` (ncu's own options, if any, then a command) under ncu (clocks not locked), profiling every
    launch of the kernels whose names match the regex ``kernels``: :func:`ncu_rows` of them, and the whole output
    (stdout, then stderr). The command runs in its own session, so a timeout ends the profiled process too (left
    running, it would keep the GPU's memory)."""
    cmd = ["ncu", "--clock-control", "none", "--metrics", ",".join(metrics), "--print-units", "base", "--csv"]
    cmd += ["--target-processes", "application-only", "-k", f"regex:{kernels}", *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()  # what it had printed: where it stopped
        return [], f"{stdout}{stderr}\nncu did not finish within {timeout:.0f} s"
    return ncu_rows(stdout), stdout + stderr
