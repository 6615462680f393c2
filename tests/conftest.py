import atexit
import importlib.util
import os
import shutil
import tempfile

# On CPU the suite compiles hundreds of small programs (interpret-mode kernels, references at each drawn size)
# and runs each once or twice at tiny sizes: LLVM's optimisation passes cost more than they save (a third of the
# CPU time of tests/test_kernels_vs_jax.py::test_flash_attention). Semantics are unchanged (fast math stays off).
# Only where JAX has no accelerator plugin (``jax_plugins``), so a GPU's kernels keep XLA's default. Set before
# JAX starts its CPU client, which reads XLA_FLAGS once; inherited by test_mutations' runs.
cpu_only = importlib.util.find_spec("jax_plugins") is None
if cpu_only and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# Mosaic GPU's interpreter waits for its warpgroup threads inside XLA's CPU thread pool, which JAX sizes to the CPUs
# (two on CI): a pool that small deadlocked the suite now and then (every time at PJRT_NPROC=1). Sixteen threads
# cost nothing measurable; lowering._target.check_interpreter_pool warns a user whose pool is too small.
os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402 - after XLA_FLAGS and PJRT_NPROC
import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")  # CPU reference comparisons in true f32
# The partitionable threefry compiles in 7-15 s on CPU for each rank-4/5 shape a test draws (1-2 s flat);
# the tests draw unsharded inputs, so the classic bit stream costs nothing in coverage. Set at collection,
# before any test or doctest of the run draws a key.
jax.config.update("jax_threefry_partitionable", False)
# Compilation dominates the suite (interpret-mode kernels, references at each drawn size): a compilation
# cache, fresh for each run and shared with the runs test_mutations starts, compiles a program seen before
# (the same kernel or reference built again by another test or process) once. Keys are the compiled
# program itself, so a mutated kernel never meets a clean one's entry.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="napkin-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
# Every program, however small: the eager ops of the references compile in ~40 ms each, and each xdist worker and
# each fresh interpreter (test_mutations' runs, the 4-device run, test_distributed's workers) compiled the same ones
# again; a read is a few ms (tests/test_mutations.py -n 2: 47 s at a 0.2 s threshold, 35 s at 0). Through the
# environment, so the processes the tests start, which read it when JAX starts, keep every program too.
min_compile_s = float(os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_s)

GPU = any(d.platform == "gpu" for d in jax.devices())

if os.environ.get("NAPKIN_MUTATION"):  # tests/test_mutations.py: a planted bug must fail fast, unshrunk
    settings.register_profile("mutation", phases=[Phase.explicit, Phase.generate], database=None)
    settings.load_profile("mutation")


def pytest_configure(config):
    # test_mutations' runs share the cache two at a time, and JAX writes entries without a lock: a read that
    # meets a half-written entry fails, warns, and compiles afresh. That warning is not the test's concern.
    config.addinivalue_line("filterwarnings", "ignore:Error reading persistent compilation cache entry")


#: tests that each run a subprocess of minutes (tests of three files on 4 devices, two JAX processes): run first, so
#: that xdist's other worker takes the rest meanwhile instead of one worker finishing them alone at the end
FIRST = ("tests/test_four_devices.py", "tests/test_distributed.py")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a GPU (runs on the device machine)")
    for item in items:
        if "gpu" in item.keywords and not GPU:
            item.add_marker(skip)
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep their order


def draw_seed() -> int:
    """A fresh seed from the OS, or ``NAPKIN_SEED`` to replay a failure."""
    return int(os.environ.get("NAPKIN_SEED") or int.from_bytes(os.urandom(4), "little"))


@pytest.fixture
def seed() -> int:
    """This test's random seed; a failing test's report says it (replay with ``NAPKIN_SEED=<seed>``)."""
    return draw_seed()


@pytest.fixture
def key(seed):
    """A fresh random key per test, from :func:`seed`: never zeros, never the same two runs."""
    return jax.random.key(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    seed = getattr(item, "funcargs", {}).get("seed")
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"replay with NAPKIN_SEED={seed} python -m pytest {item.nodeid}"))


class Hopper:
    """A stand-in for an H100 in ``jax.devices()``: what ``lowering.mosaic.unavailable`` reads."""

    platform, device_kind, compute_capability = "gpu", "NVIDIA H100 80GB HBM3", "9.0"


@pytest.fixture
def hopper(monkeypatch):
    """Call it to have ``jax.devices()`` report an H100 for the rest of the test: ``backend="auto"`` then weighs Mosaic
    (the kernels are only lowered, or interpreted, never compiled here)."""
    return lambda: monkeypatch.setattr(jax, "devices", lambda: [Hopper()])
