"""Planted bugs are caught: each mutation of tests/mutations.py makes the independent-reference tests fail.

Each run is a fresh interpreter (``python -m pytest -p tests.mutations``) with ``NAPKIN_MUTATION`` set, on
the tests that should catch that bug; the run must end in a failed assertion (exit status 1), not an error
or a missing target. The same tests pass unmutated: in this session when it runs them too (the plugin is inert
without ``NAPKIN_MUTATION``, so that is the same check, and a fresh interpreter running them again would only
repeat it), else in a run of their own. Each test starts its own run (no shared run): under ``pytest -n 2``
a module-scoped fixture running them all would start every run once per worker.

Each run is forked from a server that imported JAX, pytest and the library once (``multiprocessing``'s forkserver,
one per worker, started on first use): a run pays for its own pytest session and its test, not for ~2.5 s of
imports. The server starts no JAX backend (importing the library starts none), so each run still starts its own
CPU client, reads conftest's XLA flags and plants its mutation in a process of its own; a planted mutation rebinds
its target in every loaded module, and no module in the server holds a compiled kernel.
"""

import multiprocessing
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLASH = "tests/test_kernels_vs_jax.py::test_flash_attention[False-37-29]"  # ragged keys: two chunks, padding
GQA = "tests/test_kernels_vs_jax.py::test_gqa_scale_alibi_causal"  # scale, ALiBi, causal, groups, q > x
MOSAIC = "tests/test_mosaic.py::test_interpret_matches_reference[plain-s64]"  # Mosaic interpret mode, 4 chunks
SOFTCAP = "tests/test_variants.py::test_softcap"  # f32 gradients through the lowered backward against jax.grad
# the masking order: a soft-cap after a mask array, against a reference that masks last
ORDER = "tests/test_entry_reliability.py::test_masks_apply_after_the_score_modifier_in_the_diagram[softcap-array]"

#: mutation -> the tests that catch it
CATCHERS = {
    "temperature": [GQA],
    "no_rescale": [FLASH],
    "causal_off_by_one": [GQA],
    "gqa_group": [GQA],
    "scale_ignored": [GQA],
    "no_delta": [FLASH],
    "no_padding_mask": [FLASH],
    "mosaic_overwrites_accumulator": [MOSAIC],
    "score_mod_grad_at_output": [SOFTCAP],
    "masks_before_score_mod": [ORDER],
}


#: what the server imports once for every run it forks (none of it starts a JAX backend; no pytest plugin, which
#: pytest would find imported before it could rewrite its asserts)
PRELOAD = ["jax", "jax.numpy", "pytest", "napkin_cat", "lowering", "rewrites"]
FORKS = multiprocessing.get_context("forkserver")
FORKS.set_forkserver_preload(PRELOAD)


def pytest_run(mutation: str | None, tests: list[str], log: str) -> None:
    """In the forked run: ``python -m pytest -x -q -rf -p tests.mutations ... tests``, output to ``log``."""
    os.environ.pop("NAPKIN_MUTATION", None)
    if mutation:
        os.environ["NAPKIN_MUTATION"] = mutation
    os.chdir(ROOT)
    with open(log, "w") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    sys.stdout = sys.__stdout__ = open(1, "w", closefd=False)  # the run's own stdout, to its exit
    sys.stderr = sys.__stderr__ = open(2, "w", closefd=False)
    import pytest

    code = pytest.main(["-x", "-q", "-rf", "-p", "tests.mutations", "-p", "no:cacheprovider", *tests])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def run(mutation: str | None, tests: list[str]) -> SimpleNamespace:
    """The run's exit status and its output (stdout and stderr together, as both)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log")
        process = FORKS.Process(target=pytest_run, args=(mutation, tests, log))
        process.start()
        process.join(600)
        if process.is_alive():
            process.kill()
            process.join()
        text = Path(log).read_text() if os.path.exists(log) else ""
    return SimpleNamespace(returncode=process.exitcode, stdout=text, stderr="")


def test_unmutated_tests_pass(request):
    catchers = sorted({t for ts in CATCHERS.values() for t in ts})
    if set(catchers) <= {item.nodeid for item in request.session.items}:
        pytest.skip("the catchers run unmutated in this session: their own results are this check")
    clean = run(None, catchers)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]


@pytest.mark.parametrize("mutation", sorted(CATCHERS))
def test_planted_bug_is_caught(mutation):
    result = run(mutation, CATCHERS[mutation])
    log = result.stdout[-3000:] + result.stderr[-3000:]
    assert "MissingTarget" not in log, f"mutation {mutation!r} planted nothing:\n{log}"
    assert result.returncode == 1, f"mutation {mutation!r} survived (exit {result.returncode}):\n{log}"
    assert "AssertionError" in result.stdout, f"mutation {mutation!r} broke the run instead of failing a check:\n{log}"
