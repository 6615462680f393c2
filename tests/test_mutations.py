"""Planted bugs are caught: each mutation of tests/mutations.py makes the independent-reference tests fail.

Each run is a fresh interpreter (``python -m pytest -p tests.mutations``) with ``NAPKIN_MUTATION`` set, on
the tests that should catch that bug; the run must end in a failed assertion (exit status 1), not an error
or a missing target. The same tests pass unmutated: in this session when it runs them too (the plugin is inert
without ``NAPKIN_MUTATION``, so that is the same check, and a fresh interpreter running them again would only
repeat it), else in a run of their own. Each test starts its own run (no shared fixture): under ``pytest -n 2``
a module-scoped fixture would start every run once per worker.
"""

import os
import subprocess
import sys
from pathlib import Path

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


def run(mutation: str | None, tests: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NAPKIN_MUTATION"}
    if mutation:
        env["NAPKIN_MUTATION"] = mutation
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rf", "-p", "tests.mutations", "-p", "no:cacheprovider"]
    return subprocess.run([*cmd, *tests], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


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
