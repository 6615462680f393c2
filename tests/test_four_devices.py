"""The ``test_four_*`` tests of tests/test_multi_device.py, tests/test_sequence_parallel.py and tests/test_spmd.py,
on 4 CPU devices in one subprocess (tests/four_devices.py): one start of Python and JAX and one collection for the
three files, where each file's own runner would start one each."""

import jax
import pytest

from tests.four_devices import FILES, failures, run_on_four


def test_four_device_tests_of_every_file():
    if jax.device_count() >= 4:
        pytest.skip("already on 4 devices: the test_four_* tests run in their files here")
    run = run_on_four(*FILES)
    broken = {file: why for file in FILES if (why := failures(run, file))}
    assert not broken, f"{broken}\n{run.stdout[-8000:]}{run.stderr[-3000:]}"
