"""The GPU benchmark harness, run at tiny sizes on CPU (Pallas kernels in interpret mode).

It checks the JSON schema, that errors against the f32 reference are computed, that GPU-only
baselines are recorded as unavailable rather than crashing, and the README rendering.
"""

import doctest
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `papers` is a namespace package

from papers.flash_attention import attentions as at  # noqa: E402
from papers.flash_attention import benchmark, report, timing  # noqa: E402

TINY = ["--quick", "--candidate=mha", "--dtypes=bf16", "--seq-lens=32", "--long-start=32", "--long-max=64"]
RECORD_KEYS = {"impl", "status", "time_ms", "tflops", "max_rel_err", "temp_bytes", "peak_bytes"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    res = benchmark.main([*TINY, f"--out-dir={out}"])
    return res, out


def test_json_schema(run):
    res, out = run
    saved = json.loads((out / "cpu_quick.json").read_text())
    assert saved["schema"] == 1 and saved["quick"] and saved["device"]["platform"] == "cpu"
    assert saved["candidate"] == {"requested": "mha", "used": "mha", "note": None}
    assert [e["config"]["causal"] for e in saved["forward"]] == [False, True]
    assert len(saved["forward_backward"]) == 2 and saved["longest"]["max_tried"] == 64
    assert (out / "cpu_quick.png").stat().st_size > 0


def test_forward_records_error_and_speed(run):
    res, _ = run
    for entry in res["forward"]:
        for name in ("candidate", "naive", "mha"):
            r = entry["results"][name]
            assert set(r) == RECORD_KEYS and r["status"] == "ok", (name, r)
            assert math.isfinite(r["tflops"]) and r["tflops"] > 0
            assert 0 < r["max_rel_err"] < 2e-2, (name, r["max_rel_err"])  # bf16 inputs
        assert set(entry["speedup"]) == {"naive", "mha"}
        assert entry["flops"] == benchmark.Config(**entry["config"]).flops


def test_gpu_only_baselines_are_unavailable_on_cpu(run):
    res, _ = run
    if at.on_gpu():
        pytest.skip("on a GPU the baselines run")
    for entry in res["forward"]:
        for name in ("cudnn", "mgpu"):
            assert entry["results"][name]["status"] == "unavailable"
    assert res["longest"]["results"]["cudnn"]["max_n"] is None


def test_forward_backward_checks_gradients(run):
    res, _ = run
    for entry in res["forward_backward"]:
        assert set(entry["results"]) == {"candidate", "cudnn", "mha"}
        cand = entry["results"]["candidate"]
        assert cand["status"] == "ok" and 0 < cand["max_rel_err"] < 2e-2
        assert entry["flops"] == pytest.approx(3.5 * benchmark.Config(**entry["config"]).flops)


def test_longest_sequence(run):
    res, _ = run
    naive = res["longest"]["results"]["naive"]
    assert naive["max_n"] == 64 and [r["N"] for r in naive["runs"]] == [32, 64]
    assert all(r["max_rel_err"] < 2e-2 for r in naive["runs"])


def test_readme_section(run, tmp_path):
    _, out = run
    readme = tmp_path / "README.md"
    readme.write_text("# intro\n")
    report.write_readme(readme, out)
    report.write_readme(readme, out)  # idempotent: the section is replaced, not appended again
    text = readme.read_text()
    assert text.count("<!-- benchmark-results:begin -->") == 1
    assert "| bf16 | 16 | 32 | 4 | no |" in text and "cpu_quick.png" in text
    assert "None" not in text and "nan" not in text


def test_napkin_candidate_falls_back_with_a_warning(monkeypatch, capsys):
    monkeypatch.setitem(at.CANDIDATES, "napkin", lambda spec: at.Impl.missing("napkin", "not lowered yet"))
    impl = benchmark.candidate(at.jnp.float32, True, 16, choice="napkin", interpret=True)
    assert impl.name == "mha" and impl.unavailable is None
    assert "not lowered yet" in capsys.readouterr().err


def test_failure_classifies_out_of_memory():
    assert benchmark.failure(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating"))["status"] == "oom"
    assert benchmark.failure(ValueError("bad block"))["status"] == "error"


@pytest.mark.parametrize("module", [at, report, benchmark, timing])
def test_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


# --- papers/flash_attention/timing.py: the one timing helper every benchmark script uses ---------------------


def sleepy(seconds: float, calls: list):
    """A host function that takes ``seconds`` per call (so the wall clock has a known answer) and counts calls."""

    def f(x):
        calls.append(1)
        time.sleep(seconds)
        return x + 1

    return f


def test_time_calls_divides_each_batch_by_its_calls_and_takes_the_median():
    calls: list = []
    x = jax.random.normal(jax.random.key(0), (4,))
    t = timing.time_calls(sleepy(4e-3, calls), x, reps=4, batches=3, warmup=2)
    assert len(calls) == 2 + 4 * 3  # the warm-up calls, then reps × batches
    assert len(t.samples) == 3 and t.seconds == statistics.median(t.samples)
    assert 4e-3 <= t.seconds < 12e-3, t  # per call, not per batch of 4 (16 ms)
    if jax.devices()[0].platform != "gpu":
        assert t.method == "wall" and "cpu" in t.note
    assert t.host_bound  # a host function: dispatching the calls is the whole batch


@pytest.mark.parametrize("kw", [dict(reps=0), dict(batches=0), dict(warmup=-1), dict(method="cuda-events")])
def test_time_calls_refuses_bad_arguments(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        timing.time_calls(jnp.sin, jnp.ones(2), **kw)


def test_once_returns_the_result_and_the_wall_and_cpu_seconds():
    x = jax.random.normal(jax.random.key(1), (4,))
    out, wall, cpu = timing.once(sleepy(3e-3, []), x)
    assert jnp.array_equal(out, x + 1) and wall >= 3e-3 and 0 <= cpu < wall  # sleeping takes no CPU


@pytest.mark.gpu
def test_time_calls_uses_cupti_on_a_gpu():
    """Device time by CUPTI: not above (beyond noise) the wall clock of back-to-back calls, and not below what any
    GPU's peak allows for the product's flops (the wall clock has no lower bound: other tests may share the GPU)."""
    a = jax.random.normal(jax.random.key(2), (4096, 4096), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    device = timing.time_calls(f, a)
    wall = timing.time_calls(f, a, method="wall")
    assert device.method == "cupti" and device.note == "" and wall.method == "wall"
    assert 2 * 4096**3 / 5e15 < device.seconds < 1.1 * wall.seconds, (device, wall)  # 5 PFLOP/s: above any GPU's


def test_napkin_candidate_when_lowerable(tmp_path):
    if at.napkin(at.Spec(at.jnp.bfloat16, False, 16, interpret=True)).unavailable:
        pytest.skip("napkin-cat cannot lower attention yet")
    res = benchmark.main(["--quick", "--candidate=napkin", "--dtypes=bf16", "--seq-lens=128", "--sections=fwd",
                          "--no-plot", f"--out-dir={tmp_path}"])
    assert res["candidate"]["used"] == "napkin"
    for entry in res["forward"]:
        cand = entry["results"]["candidate"]
        assert cand["status"] == "ok" and cand["max_rel_err"] < 2e-2, cand


# --- papers/flash_attention/variants.py: the variant benchmark (issue 12), at tiny sizes -------------------------

from papers.flash_attention import variants  # noqa: E402


@pytest.fixture(scope="module")
def variants_run(tmp_path_factory):
    """One variant with an extra differentiated input and a jnp baseline (the sinks): ~10 s in interpret mode."""
    out = tmp_path_factory.mktemp("variants")
    return variants.main(["--quick", "--variants=sinks", f"--out={out}"]), out


def test_variants_quick_run_measures_checks_and_writes(variants_run):
    res, out = variants_run
    saved = json.loads((out / "variants_cpu_quick.json").read_text())
    assert saved["quick"] and saved["sizes"]["seq"] == 64 and (out / "variants_cpu_quick.png").stat().st_size > 0
    (entry,) = saved["variants"]
    assert entry["name"] == "sinks" and entry["baseline"]["impl"] == "jnp" and entry["napkin"]["impl"] == "napkin"
    for who in ("napkin", "baseline"):
        for section in ("fwd", "fwd_bwd"):
            r = entry[who][section]
            assert r["status"] == "ok" and r["tflops"] > 0 and r["temp_bytes"] >= 0, (who, section, r)
    assert 0 < entry["napkin"]["fwd"]["err_f32"] < 2e-2  # bf16
    assert all(0 < entry["napkin_vs_baseline"][s] < 2e-2 for s in ("fwd", "fwd_bwd"))  # outputs; q, k, v, sink grads
    assert entry["quadratic_buffer"] is None  # N = 64 < 16·D: the check cannot tell O(N) from O(N²) here
    assert set(entry["ratios"]["fwd_bwd"]) == {"vs_causal_tflops", "vs_baseline_speed", "vs_causal_speed"}
    assert len(saved["targets"]) == 4
    assert "| sinks | jnp |" in variants.render(res)


@pytest.mark.parametrize("name", list(variants.VARIANTS))
def test_variant_baselines_agree_with_the_index_form(name):
    """Each baseline (jax.nn's mask, bias or window, or jnp) in f32 against the variant's scores written by
    index (``semantics``); and the diagram builds. No kernel is lowered: fast."""
    variant = variants.VARIANTS[name]
    z = variants.Sizes(batch=2, heads=4, seq=32, head_dim=16, tile=16, stream=16, dtype="f32")
    q, k, v, extra = variants.inputs(variant, z, seed=3)
    impl = variants.baseline(variant, z, q, k, v, extra)
    got = impl.to_bhnd(impl.fn(*impl.args))
    want = variants.semantics(variant, z, q, k, v, extra)
    assert float(at.max_rel_err(got, want)) < 1e-5, name
    assert variant.pairs(z) == int(jnp_count_kept(variant, z, q, k, v, extra))
    diagram, _ = variant.diagram(z)
    assert len(diagram.dom) == 3 + len(extra)


def jnp_count_kept(variant, z, q, k, v, extra):
    """(query, key) pairs of head 0, batch 0 whose score stays finite: the mask the FLOP count reads."""
    i, j = at.jnp.arange(z.seq)[:, None], at.jnp.arange(z.seq)[None]
    s = at.jnp.zeros((z.batch, z.heads, z.seq, z.seq))
    kept = (variant.scores or variants._masked(variant.keep))(s, i, j, extra, z)
    return at.jnp.isfinite(kept[0, 0]).sum()


def test_variants_doctests():
    result = doctest.testmod(variants, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


FAKE_NCU = """#!/usr/bin/env bash
# ncu's stand-in: runs the profiled command (after ncu's own options), then prints two launches of each kernel as
# ncu's --csv does; the second launch's counters are the ones --counters must read
while [[ "$1" != *python* ]]; do shift; done
"$@"
echo '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
i=0
for bytes in 1000 2000; do
  for kernel in napkin_kernel napkin_merge; do
    echo "\\"$i\\",\\"$kernel\\",\\"dram__bytes_read.sum\\",\\"byte\\",\\"$bytes\\""
    echo "\\"$i\\",\\"$kernel\\",\\"gpu__time_duration.sum\\",\\"ns\\",\\"$bytes\\""
    i=$((i + 1))
  done
done
"""


def test_decode_counters_read_the_last_step_against_the_prediction(tmp_path, monkeypatch):
    """decode_bench --counters with ncu replaced by a script that prints its CSV: the last launch of each kernel is
    summed and set against the plan the profiled process printed (its prediction, its device)."""
    ncu = tmp_path / "bin" / "ncu"
    ncu.parent.mkdir()
    ncu.write_text(FAKE_NCU)
    ncu.chmod(0o755)
    monkeypatch.setenv("PATH", f"{ncu.parent}:{os.environ['PATH']}")
    from papers.flash_attention import decode_bench

    kind, steps = decode_bench.counters(["nq1-b1-s128"], quick=True, timeout=300)
    (step,) = steps
    assert kind == "cpu" and "error" not in step, step
    assert step["dram_read_bytes"] == 4000 and step["time_us"] == 4.0  # both kernels' second launch
    assert step["bytes_ratio"] == 4000 / step["predicted_read_bytes"] and step["plan"]["parts"] >= 1
