"""``derive``: seeds that replay, sizes the user fixes, kernels checked too, and sizes too large refused early."""

import math
import random
import re
import subprocess
import sys
import time

import jax
import pytest

import napkin_cat as nc
from napkin_cat.diagram import Diagram
from rewrites import RewriteError, Rule, derive, stream, tile
from rewrites._verify import MAX_ELEMENTS, SAMPLE_ELEMENTS, sample_sizes

q, x, d = nc.axes("q x d")
ATTN = nc.library.attention(q, x, d, causal=True)
N = nc.Array(nc.Axis("n"))


class sum_to_max(Rule):  # noqa: N801 - a wrong rule, as a user might write one
    def __repr__(self):
        return "sum_to_max"

    def apply(self, diagram: Diagram) -> Diagram:
        return nc.reduce_max(N, "n")


def test_the_seed_is_recorded_and_replays_the_checks():
    first = derive(ATTN, tile(q, 4), stream(x, 4), seed=7)
    again = derive(ATTN, tile(q, 4), stream(x, 4), seed=7)
    assert first.seed == 7 and all(s.verification.seed == 7 for s in first.steps[1:])
    assert [s.verification.sizes for s in first.steps[1:]] == [s.verification.sizes for s in again.steps[1:]]
    assert [s.verification.max_error for s in first.steps[1:]] == [s.verification.max_error for s in again.steps[1:]]
    assert isinstance(derive(ATTN, tile(q, 4)).seed, int)


def test_sizes_fix_the_concrete_sizes_of_every_step():
    flash = derive(ATTN, tile(q, 4), stream(x, 4), sizes={"q": 9, "x": 10, d.size: 3}, seed=0)
    assert all(s.verification.sizes == {"q": 9, "x": 10, "d": 3} for s in flash.steps[1:])


def test_a_failed_check_says_error_greater_than_tolerance_and_the_seed():
    pattern = (
        r"^sum_to_max: the rewritten diagram differs from the original: FAILED: max rel\. error \d\.\de[+-]\d\d "
        r"> tolerance 1e-04 \(f32\) at n=5 \(seed 11\)$"
    )
    with pytest.raises(RewriteError, match=pattern):
        derive(nc.reduce_sum(N, "n"), sum_to_max(), seed=11, sizes={"n": 5})


def test_verify_kernel_checks_the_lowered_kernel_on_the_same_inputs():
    flash = derive(ATTN, tile(q, 16), stream(x, 16), sizes={"q": 40, "x": 37, "d": 8}, seed=1, verify="kernel")
    assert flash.kernel.passed and flash.kernel.sizes == flash.steps[-1].verification.sizes
    assert str(flash).endswith(f"kernel: {flash.kernel}")


def test_verify_kernel_catches_a_kernel_that_differs(monkeypatch):
    import lowering

    def off_by_a_thousandth(scheduled):
        f = jax.jit(nc.to_jax(scheduled))
        return lambda *arrays: 1.001 * f(*arrays)

    monkeypatch.setattr(lowering, "lower", off_by_a_thousandth)
    pattern = (
        r"^derive\(verify='kernel'\): the lowered kernel differs from the original: FAILED: max rel\. error "
        r"1\.0e-03 > tolerance 1e-04 \(f32\) at q=40, d=8, x=37 \(seed 1\)$"
    )
    with pytest.raises(RewriteError, match=pattern):
        derive(ATTN, tile(q, 16), stream(x, 16), sizes={"q": 40, "x": 37, "d": 8}, seed=1, verify="kernel")


def test_concrete_sizes_too_large_are_refused_before_allocation():
    big = nc.axes("q x d", q=65536, x=65536, d=64)
    attn = nc.library.attention(*big)
    message = (
        "derive: box 'q d, x d → q x', axis 'q': verifying at q=65536, x=65536 would hold 4,294,967,296 elements "
        "on the wire q/128×x~64:f32@HBM, over the 4,194,304 a verification may use; pass smaller sizes, e.g. "
        "sizes={'q': 256} (concrete axes are resized for the check), or verify=False"
    )
    start = time.perf_counter()
    with pytest.raises(RewriteError, match=f"^{re.escape(message)}$"):
        derive(attn, tile("q", 128), stream("x", 64))
    assert time.perf_counter() - start < 30, "the refusal must come before any evaluation"
    small = derive(attn, tile("q", 128), stream("x", 64), sizes={"q": 300, "x": 200, "d": 16}, seed=0)
    assert small.steps[-1].verification.sizes == {"q": 300, "x": 200, "d": 16}


def test_a_stream_of_a_million_is_refused_naming_the_axis_then_verified_at_given_sizes():
    rules = (tile(q, 128), stream(x, 2**20))
    with pytest.raises(RewriteError, match=r"^derive: axis 'x': verifying at x=\d+, d=\d+ would hold [\d,]+ elements"):
        derive(ATTN, *rules, seed=0)
    assert derive(ATTN, *rules, sizes={"x": 300}, seed=0).steps[-1].verification.passed


def test_drawn_sizes_stay_within_the_budget():
    b, h = nc.axes("b h")
    flash = stream(x, 64)(tile(q, 128)(nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)))
    for seed in range(5):
        sizes = sample_sizes(flash, random.Random(seed))
        wires = [w for box in flash.boxes for w in box.cod.inside]
        assert max(math.prod(int(a.size.subs(sizes)) for a in w.axes) for w in wires) <= SAMPLE_ELEMENTS < MAX_ELEMENTS


BAD = [
    (lambda: derive(ATTN, tile(q, 4), verify="yes"), "derive: verify must be True, False or 'kernel', got 'yes'"),
    (lambda: derive(ATTN, tile(q, 4), sizes={"z": 3}), "derive: sizes name axis z, which no wire has; axes: q, d, x"),
    (
        lambda: derive(ATTN, tile(q, 4), sizes={"q": 0}),
        "derive: axis 'q': a verification size must be a positive integer, got 0",
    ),
    (
        lambda: derive(ATTN, tile(q, 4), sizes={"q": 2.5}),
        "derive: axis 'q': a verification size must be a positive integer, got 2.5",
    ),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m for _, m in BAD])
def test_bad_arguments_are_refused(bad, message):
    with pytest.raises(RewriteError, match=f"^{re.escape(message)}$"):
        bad()


def test_rewrites_does_not_import_the_lowering():
    code = "import sys, rewrites; assert 'lowering' not in sys.modules, sorted(m for m in sys.modules if 'lower' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_open_sizes_stay_symbolic_and_are_verified_at_small_sizes_from_the_seed():
    open_flash = derive(ATTN, tile(q), stream(x, "auto"), seed=11)
    assert [str(s.rule) for s in open_flash.steps[1:]] == ["tile(q)", "stream(x)"]
    assert str(open_flash.diagram.cod) == "q/g_q×d"
    assert "with g_q open, s_x open" in open_flash.pseudocode()
    sizes = open_flash.steps[-1].verification.sizes
    assert sizes["g_q"] in (4, 8, 16) and sizes["s_x"] in (4, 8, 16)
    assert sizes["q"] > sizes["g_q"] and sizes["x"] > sizes["s_x"]  # several groups and chunks run
    replayed = derive(ATTN, tile(q), stream(x), seed=11)
    assert replayed.steps[-1].verification.sizes == sizes
    fixed = derive(ATTN, tile(q), stream(x), seed=11, sizes={"g_q": 32, "d": 4}, verify="kernel")
    assert (fixed.kernel.sizes["g_q"], fixed.kernel.sizes["s_x"], fixed.kernel.sizes["d"]) == (32, 16, 4)


def test_an_open_size_is_not_a_size():
    with pytest.raises(RewriteError, match=re.escape("tile(q, big): axis 'q': group size must be a positive integer")):
        tile(q, "big")
