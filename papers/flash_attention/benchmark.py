"""Attention benchmark: the napkin-cat kernel against XLA, cuDNN and jax's Pallas kernels, one run.

For every configuration (dtype, head dim D, sequence length N with B·N tokens fixed, causal or not)
it times the candidate and each baseline (compiled ahead of time, inputs laid out beforehand, then
:func:`papers.flash_attention.timing.time_calls`: ``--warmup`` calls, then the median over ``--batches``
batches of ``--reps`` back-to-back calls, by CUPTI's kernel times on a GPU, else the wall clock), converts to
TFLOP/s (4·B·H·N²·D forward, halved when causal; 3.5× that forward + backward; FlashAttention-2, Dao 2023, §4),
and checks each output against an f32 reference computed on the same device. It then doubles N at B = 1
until each implementation fails (out of memory, or any error), and writes
``results/<GPU name>.json`` and ``.png``; ``--write-readme`` renders them into ``README.md``.

On a GPU, one call runs the default grid within the time budget (``--budget-s``); on CPU
``--quick`` runs tiny sizes with the Pallas kernels in interpret mode, skipping GPU-only baselines:

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as tmp:
...     res = main(["--quick", "--candidate=mha", "--dtypes=f32", "--seq-lens=32", "--causal=no",
...                 "--sections=fwd", "--no-plot", f"--out-dir={tmp}"])  # doctest: +ELLIPSIS
[...
>>> entry = res["forward"][0]
>>> entry["results"]["candidate"]["status"], entry["results"]["naive"]["max_rel_err"] < 1e-4
('ok', True)
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")  # room for the longest-N sweep

import jax  # noqa: E402 - after the allocator setting above
import jax.numpy as jnp  # noqa: E402

from papers.flash_attention import attentions as at  # noqa: E402
from papers.flash_attention import report  # noqa: E402
from papers.flash_attention.timing import Timing, time_calls  # noqa: E402

HERE = Path(__file__).resolve().parent
DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "f32": jnp.float32}
BASELINE_NAMES = ("naive", "cudnn", "mha", "mgpu")
GRAD_NAMES = ("candidate", "cudnn", "mha")
FWD_BWD_FACTOR = 3.5  # backward ≈ 2.5× forward matmul work (FlashAttention-2, Dao 2023, §4)
CHECK_ROWS = 64  # queries checked against the f32 reference in the longest-N sweep
LONG_REPS = 3  # back-to-back calls timed (one batch) per N in the longest-N sweep: 0.1-200 ms each

# Default repetitions fit the whole GPU run in ~5 minutes: compiling (~1-2 s per kernel, ~150 kernels)
# dominates; at B·N = 16k one call takes 0.3-30 ms, so 5 batches of 20 timed calls cost < 3 s per kernel.
# Forward + backward compiles three kernels per implementation, so by default it runs at D = 128 only.
FULL = dict(dtypes="bf16,fp16", tokens=16384, heads=16, head_dims="64,128", seq_lens="2048,8192",
            fwdbwd_head_dims="128", warmup=3, reps=20, batches=5, long_heads=8, long_dim=128, long_start=4096,
            long_max=131072)
QUICK = dict(dtypes="bf16,fp16", tokens=128, heads=2, head_dims="16", seq_lens="32,64", fwdbwd_head_dims="16",
             warmup=1, reps=2, batches=2, long_heads=2, long_dim=16, long_start=32, long_max=128)


@dataclasses.dataclass(frozen=True)
class Config:
    """One benchmarked problem; ``flops`` is the forward count (4·B·H·N²·D, halved when causal).

    >>> Config("bf16", batch=2, heads=16, seq=8192, head_dim=128, causal=True).flops / 1e12
    0.549755813888
    """

    dtype: str
    batch: int
    heads: int
    seq: int
    head_dim: int
    causal: bool

    @property
    def flops(self) -> float:
        return 4 * self.batch * self.heads * self.seq**2 * self.head_dim / (2 if self.causal else 1)

    def spec(self) -> at.Spec:
        return at.Spec(DTYPES[self.dtype], self.causal, self.head_dim, interpret=not at.on_gpu())

    def label(self) -> str:
        return f"{self.dtype} D={self.head_dim} N={self.seq}{' causal' if self.causal else ''}"


class Clock:
    """Elapsed time since start, and whether the time budget is spent."""

    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.budget_s

    def log(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", flush=True)


# --- the implementations under test -----------------------------------------------------------


def candidate(dtype, causal: bool, D: int, choice: str = "napkin", interpret: bool = False) -> at.Impl:
    """The implementation under test: napkin-cat's lowered kernel, else a baseline with a warning.

    ``choice`` is ``napkin`` (falls back to Pallas ``mha`` when napkin-cat cannot lower yet),
    ``mha`` or ``cudnn``. The returned :class:`Impl` is named after what actually runs.

    >>> candidate(jnp.float32, True, 16, choice="mha", interpret=True).name
    'mha'
    """
    spec = at.Spec(dtype, causal, D, interpret)
    impl = at.CANDIDATES[choice](spec)
    if choice == "napkin" and impl.unavailable:
        if impl.unavailable not in _WARNED:
            _WARNED.add(impl.unavailable)
            print(f"WARNING: {impl.unavailable}\nWARNING: the candidate falls back to Pallas 'mha': "
                  "these numbers are NOT napkin-cat's", file=sys.stderr, flush=True)
        impl = at.pallas_mha(spec)
    return impl


_WARNED: set[str] = set()


def implementations(cfg: Config, choice: str, names=BASELINE_NAMES) -> dict[str, at.Impl]:
    """The candidate and the named baselines for one configuration."""
    spec = cfg.spec()
    impls = {"candidate": candidate(spec.dtype, cfg.causal, cfg.head_dim, choice, spec.interpret)}
    impls.update({name: at.BASELINES[name](spec) for name in names if name in at.BASELINES})
    return impls


# --- measuring one implementation -------------------------------------------------------------


def inputs(cfg: Config, seed: int = 0):
    """q, k, v ~ N(0, 1) in [B, H, N, D] and the config's dtype."""
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (cfg.batch, cfg.heads, cfg.seq, cfg.head_dim)
    return tuple(jax.random.normal(key, shape, jnp.float32).astype(DTYPES[cfg.dtype]) for key in keys)


def grad_of_sum(fn: Callable) -> Callable:
    """``(q, k, v) ↦ ∇ sum(fn(q, k, v))``: the forward + backward workload."""
    return jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2))


def _say_timing(timing: Timing) -> None:
    """Print which clock timed the first measurement (and any change), and warn when the host bounded it."""
    said = (timing.method, timing.note)
    if said != _SAID.get("timing"):
        _SAID["timing"] = said
        print(f"timing: {timing.method}{f' ({timing.note})' if timing.note else ''}", file=sys.stderr, flush=True)
    if timing.host_bound and at.on_gpu():
        print(f"WARNING: dispatch took ≥ 90% of the batch time in most of {len(timing.samples)} batches: "
              "the time is host-bound", file=sys.stderr, flush=True)


_SAID: dict[str, tuple] = {}


def device_memory() -> dict:
    """``bytes_in_use`` and ``peak_bytes_in_use`` (process-wide) from the allocator; {} on CPU."""
    stats = jax.devices()[0].memory_stats() or {}
    return {k: stats[k] for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit") if k in stats}


def failure(e: BaseException) -> dict:
    """A failed measurement: ``oom`` when the device ran out of memory, else ``error``."""
    text = report.describe_error(e)
    oom = any(s in str(e) for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory"))
    return {"status": "oom" if oom else "error", "error": text}


def measure(fn: Callable, args, check: Callable, flops: float, *, warmup: int, reps: int, batches: int = 1) -> dict:
    """Compile ``fn`` ahead of time, time it (:func:`~papers.flash_attention.timing.time_calls`), check its output.

    ``args`` are already in the implementation's layout (``Impl.prepare``), so the timed calls are
    the compiled function alone; failures become records.

    ``check(out) -> float`` is the error against the reference. ``temp_bytes`` is XLA's
    compiled scratch beyond inputs and outputs; ``peak_bytes`` the process-wide allocator peak.
    """
    try:
        compiled = jax.jit(fn).lower(*args).compile()
        timing = time_calls(compiled, *args, reps=reps, batches=batches, warmup=warmup)
        _say_timing(timing)
        seconds = timing.seconds
        err = float(check(compiled(*args)))
    except Exception as e:  # noqa: BLE001 - a failing implementation is a result, not a crash
        return failure(e)
    memory = compiled.memory_analysis()
    return {
        "status": "ok",
        "time_ms": seconds * 1e3,
        "tflops": flops / seconds / 1e12,
        "max_rel_err": err,
        "temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "peak_bytes": device_memory().get("peak_bytes_in_use"),
    }


def unrunnable(impl: at.Impl, clock: Clock) -> dict | None:
    """The record for an implementation that will not be run, or None."""
    if impl.unavailable:
        return {"status": "unavailable", "error": impl.unavailable}
    if clock.spent():
        return {"status": "skipped", "error": f"time budget of {clock.budget_s:.0f} s spent"}
    return None


def speedups(results: dict) -> dict:
    """Baseline time / candidate time for each baseline that ran (> 1: the candidate is faster)."""
    cand = results.get("candidate", {})
    if cand.get("status") != "ok":
        return {}
    return {name: r["time_ms"] / cand["time_ms"] for name, r in results.items()
            if name != "candidate" and r.get("status") == "ok"}


# --- the three sections -----------------------------------------------------------------------


def forward_entry(cfg: Config, impls: dict, opts, clock: Clock, backward: bool = False) -> dict:
    """Time and check every implementation on one config: forward, or forward + backward."""
    flops = cfg.flops * (FWD_BWD_FACTOR if backward else 1)
    qkv = ref = None
    results = {}
    for name, impl in impls.items():
        if (record := unrunnable(impl, clock)) is None:
            if ref is None:  # inputs and reference only once something will run
                qkv = inputs(cfg)
                ref = (at.reference_grads if backward else at.reference)(*qkv, causal=cfg.causal)
            record = _measure_impl(impl, qkv, ref, flops, opts, backward)
        results[name] = {"impl": impl.name, **record}
        _log_result(clock, f"{'fwd+bwd' if backward else 'fwd'} {cfg.label()}", name, impl, record)
    del qkv, ref
    gc.collect()
    return {"config": dataclasses.asdict(cfg), "flops": flops, "results": results, "speedup": speedups(results)}


def _measure_impl(impl: at.Impl, qkv, ref, flops: float, opts, backward: bool) -> dict:
    if backward:
        fn = grad_of_sum(impl.fn)
        def check(g):
            return max(at.max_rel_err(a, b) for a, b in zip(impl.grads_to_bhnd(g), ref, strict=True))
    else:
        fn = impl.fn
        def check(out):
            return at.max_rel_err(impl.to_bhnd(out), ref)
    return measure(fn, impl.prepare(*qkv), check, flops, warmup=opts.warmup, reps=opts.reps,
                   batches=opts.batches)


def _log_result(clock: Clock, what: str, name: str, impl: at.Impl, r: dict) -> None:
    who = name if name == impl.name else f"{name} ({impl.name})"
    if r["status"] == "ok":
        clock.log(f"{what:32} {who:18} {r['tflops']:7.1f} TFLOP/s {r['time_ms']:9.3f} ms  "
                  f"err {r['max_rel_err']:.1e}")
    else:
        clock.log(f"{what:32} {who:18} {r['status']}: {r.get('error', '')[:100]}")


def longest_sequence(opts, clock: Clock) -> dict:
    """Double N at B = 1 until each implementation fails; check the last rows against f32."""
    base = Config(opts.dtype_list[0], 1, opts.long_heads, opts.long_start, opts.long_dim, opts.long_causal)
    impls = implementations(base, opts.candidate)
    runs = {name: [] for name in impls}
    alive = {name: impl for name, impl in impls.items() if not unrunnable(impl, clock)}
    n = opts.long_start
    while n <= opts.long_max and alive and not clock.spent():
        cfg = dataclasses.replace(base, seq=n)
        q, k, v = inputs(cfg)
        rows = min(CHECK_ROWS, n)
        ref = at.reference_rows(q, k, v, rows=rows, causal=cfg.causal)
        for name, impl in list(alive.items()):
            check = _rows_check(impl, ref, rows)
            r = measure(impl.fn, impl.prepare(q, k, v), check, cfg.flops, warmup=1, reps=LONG_REPS)
            runs[name].append({"N": n, "impl": impl.name, **r})
            _log_result(clock, f"longest {cfg.label()}", name, impl, r)
            if r["status"] != "ok":
                del alive[name]
        del q, k, v, ref
        gc.collect()
        n *= 2
    results = {name: _longest_summary(impl, runs[name], clock) for name, impl in impls.items()}
    return {"config": dataclasses.asdict(base), "max_tried": opts.long_max, "results": results}


def _rows_check(impl: at.Impl, ref, rows: int) -> Callable:
    return lambda out: at.max_rel_err(impl.to_bhnd(out)[:, :, -rows:], ref)


def _longest_summary(impl: at.Impl, runs: list, clock: Clock) -> dict:
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] != "ok"]
    out = {"max_n": ok[-1]["N"] if ok else None, "runs": runs}
    if not runs:
        out.update(unrunnable(impl, clock) or {"status": "skipped", "error": "time budget spent"})
    elif failed:
        out.update(failed_at=failed[0]["N"], error=failed[0].get("error"))
    return out


# --- the run ----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--candidate", choices=sorted(at.CANDIDATES), default="napkin")
    p.add_argument("--quick", action="store_true", help="tiny sizes, few reps (CPU smoke test)")
    for name in FULL:
        p.add_argument("--" + name.replace("_", "-"), default=None, type=type(FULL[name]))
    p.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    p.add_argument("--long-causal", action="store_true", help="causal mask in the longest-N sweep")
    p.add_argument("--sections", default="fwd,longest,fwdbwd", help="any of fwd, longest, fwdbwd, run in this order")
    p.add_argument("--budget-s", type=float, default=330.0, help="skip what is left after this")
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--write-readme", action="store_true", help="render results/*.json into README.md")
    p.add_argument("--readme-only", action="store_true", help="run nothing; only --write-readme")
    p.add_argument("--readme", type=Path, default=HERE / "README.md")
    opts = p.parse_args(argv)
    profile = QUICK if opts.quick else FULL
    for name, value in profile.items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    opts.dtype_list = opts.dtypes.split(",")
    opts.section_list = opts.sections.split(",")
    return opts


def grid(opts, head_dims: str | None = None) -> list[Config]:
    """Every (dtype, D, N, causal) with B = tokens // N.

    >>> opts = parse_args([])
    >>> len(grid(opts)), len(grid(opts, opts.fwdbwd_head_dims))
    (16, 8)
    """
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[opts.causal]
    return [Config(dt, max(1, opts.tokens // n), opts.heads, n, d, c)
            for dt in opts.dtype_list
            for d in map(int, (head_dims or opts.head_dims).split(","))
            for n in map(int, opts.seq_lens.split(","))
            for c in causals]


def device_info() -> dict:
    dev = jax.devices()[0]
    return {"platform": dev.platform, "kind": dev.device_kind, "count": jax.device_count(),
            **device_memory()}


def device_stem(kind: str) -> str:
    """A file name for a device kind.

    >>> device_stem("NVIDIA H100 80GB HBM3")
    'NVIDIA_H100_80GB_HBM3'
    """
    return re.sub(r"[^A-Za-z0-9]+", "_", kind).strip("_")


def run(opts) -> dict:
    """Run the selected sections, saving the JSON after each configuration."""
    clock = Clock(opts.budget_s)
    dev = device_info()
    stem = device_stem(dev["kind"]) + ("_quick" if opts.quick else "")
    path = opts.out_dir / f"{stem}.json"
    spec = at.Spec(DTYPES[opts.dtype_list[0]], False, 64, not at.on_gpu())
    wanted = at.CANDIDATES[opts.candidate](spec)
    probe = candidate(spec.dtype, False, 64, opts.candidate, spec.interpret)
    res = {"schema": 1, "device": dev, "jax": jax.__version__, "quick": opts.quick,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:],
           "timing": {"method": "batched", "warmup": opts.warmup, "reps": opts.reps, "batches": opts.batches},
           "candidate": {"requested": opts.candidate, "used": probe.name, "note": wanted.unavailable},
           "forward": [], "forward_backward": [], "longest": None}
    clock.log(f"device {dev['kind']} ({dev['platform']}), candidate = {probe.name}, results → {path}")
    for section in opts.section_list:  # in the order asked, so the budget goes to the first ones named
        if section == "fwd":
            for cfg in grid(opts):
                res["forward"].append(forward_entry(cfg, implementations(cfg, opts.candidate), opts, clock))
                report.save_json(res, path)
        elif section == "longest":
            res["longest"] = longest_sequence(opts, clock)
            report.save_json(res, path)
        elif section == "fwdbwd":
            for cfg in grid(opts, opts.fwdbwd_head_dims):
                impls = implementations(cfg, opts.candidate, names=GRAD_NAMES[1:])
                res["forward_backward"].append(forward_entry(cfg, impls, opts, clock, backward=True))
                report.save_json(res, path)
    res["elapsed_s"] = clock.elapsed()
    report.save_json(res, path)
    print(report.render(res), flush=True)
    if not opts.no_plot:
        report.plot(res, path.with_suffix(".png"))
    clock.log(f"done: {path}")
    return res


def main(argv=None) -> dict | None:
    """Run the benchmark (and/or rewrite the README's results section); returns the results."""
    opts = parse_args(argv)
    res = None if opts.readme_only else run(opts)
    if opts.write_readme or opts.readme_only:
        report.write_readme(opts.readme, opts.out_dir)
    return res


if __name__ == "__main__":
    main()
