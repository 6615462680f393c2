"""Running ``test_four_*`` tests on 4 CPU devices, in a subprocess.

Kernels on 4 devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax starts, and conftest
starts jax with one device. tests/test_four_devices.py runs the ``test_four_*`` tests of all of :data:`FILES` in
one fresh interpreter (one start of Python, JAX and napkin_cat and one collection instead of one each); each file's
own runner (``test_on_four_cpu_devices``) runs its file alone where that test is not in the session (``pytest
tests/test_spmd.py``), and skips where it is.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: the files whose ``test_four_*`` tests run on 4 devices
FILES = ("tests/test_multi_device.py", "tests/test_sequence_parallel.py", "tests/test_spmd.py")
#: the one test that runs them all
ALL = "tests/test_four_devices.py::test_four_device_tests_of_every_file"


def run_on_four(*files: str) -> subprocess.CompletedProcess:
    """``files``' ``test_four_*`` tests in one fresh interpreter on 4 CPU devices (``-rA``: a line per outcome)."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:randomly", "-k", "four_", *files]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)


def failures(run: subprocess.CompletedProcess, file: str) -> str | None:
    """Why ``file``'s ``test_four_*`` tests did not all pass in ``run`` (none ran, one failed, the run broke), or
    None where they did."""
    out = run.stdout
    name = re.escape(file)
    if run.returncode not in (0, 1) or "Interrupted" in out:  # 1: some test failed; anything else: the run broke
        return f"the run broke (exit {run.returncode})"
    if not re.search(rf"^PASSED {name}::test_four_", out, re.M):
        return f"no test_four_* test of {file} passed"
    bad = re.findall(rf"^(?:FAILED|ERROR) {name}\b.*$", out, re.M)
    return "\n".join(bad) or None


def run_own_file_unless_in_session(request: pytest.FixtureRequest, file: str) -> None:
    """A file's runner: skip where jax already sees 4 devices (the file's ``test_four_*`` tests run in-process, as in
    the subprocess this starts) or where tests/test_four_devices.py runs its tests in this session, else run them."""
    if jax.device_count() >= 4:
        pytest.skip("already on 4 devices: the test_four_* tests run here")
    file = pathlib.Path(file).resolve().relative_to(ROOT).as_posix()
    assert file in FILES, f"{file} is not in tests/four_devices.py's FILES"
    if ALL in {item.nodeid for item in request.session.items}:
        pytest.skip(f"{ALL} runs them in this session")
    run = run_on_four(file)
    why = failures(run, file)
    assert why is None, f"{why}\n{run.stdout[-6000:]}{run.stderr[-3000:]}"
