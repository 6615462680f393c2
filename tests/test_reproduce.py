"""The FAN reproduction (papers/flash_attention_on_a_napkin) and FlashAttention's IO complexity."""

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import sympy

PAPERS = Path(__file__).resolve().parent.parent / "papers"


def load(path: Path, name: str):
    """Import a paper's script by path (the papers folders are scripts, not packages)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fan():
    return load(PAPERS / "flash_attention_on_a_napkin" / "reproduce.py", "fan_reproduce")


@pytest.fixture(scope="module")
def reproduced(fan, tmp_path_factory):
    out = tmp_path_factory.mktemp("fan")
    return out, fan.main(out)


def test_every_paper_number_agrees_within_its_tolerance(reproduced):
    _, rows = reproduced
    misses = [f"row {r.key}: {r.quantity}: paper {r.paper}, ours {r.computed}" for r in rows if r.agrees is False]
    assert not misses, misses
    assert sum(r.agrees is True for r in rows) >= 40


def test_rows_without_a_paper_number_say_why(reproduced):
    _, rows = reproduced
    unmatched = [r for r in rows if r.agrees is None]
    assert {r.key for r in unmatched} == {"9", "17", "18", "19", "v1"}
    assert all(r.note for r in unmatched)


def test_every_row_of_reference_1_3_is_covered(reproduced):
    _, rows = reproduced
    assert {str(k) for k in range(1, 20)} <= {r.key for r in rows}


@pytest.mark.parametrize(
    "quantity, value, tol",
    [
        ("H100: attention compute-bound for g_q ≥", 295.2, 0.05),
        ("N_max by SMEM = (227 KiB − M_TB)/M_WG", 3.729, 0.001),
        ("compute per KV chunk (QKᵀ fp8, PV fp16)", 1.259, 0.001),
        ("attainable throughput", 1.319, 0.001),
        ("A100-40GB (1.555 TB/s): warps per SM to be compute-bound", 13, 0),
    ],
)
def test_selected_values(reproduced, quantity, value, tol):
    _, rows = reproduced
    (row,) = [r for r in rows if r.quantity == quantity]
    assert float(row.computed) == pytest.approx(value, abs=tol)


NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def last_digit(printed: str) -> float:
    """One unit of the last printed digit of a number: ``"3.729"`` → 0.001, ``"-0.06"`` → 0.01, ``"6e12"`` → 1e12."""
    mantissa, _, exponent = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    return 10.0 ** (int(exponent or 0) - decimals)


def cells_agree(ours: str, readme: str) -> bool:
    """A cell of the table as computed here agrees with the README's: formulas (in backticks) are equal
    symbolically; elsewhere the text around the numbers is the same, and each number is within one unit
    of the README's last printed digit (so a 1-ulp difference printing -0.00% for +0.00% agrees)."""
    if ours.startswith("`") and readme.startswith("`"):
        return sympy.simplify(sympy.sympify(ours.strip("`")) - sympy.sympify(readme.strip("`"))) == 0
    if NUMBER.sub("#", ours) != NUMBER.sub("#", readme):
        return False
    pairs = zip(NUMBER.findall(ours), NUMBER.findall(readme), strict=True)
    return all(abs(float(a) - float(b)) <= 1.001 * last_digit(b) for a, b in pairs)


def table_cells(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.strip()]


def test_cells_agree_within_the_last_printed_digit():
    assert cells_agree("| +0.00% |", "| -0.00% |") and cells_agree("3.730", "3.729")
    assert not cells_agree("3.731", "3.729") and not cells_agree("yes (±0.5)", "**no** (±0.5)")
    assert cells_agree("`a*c + 2*a*b*c/sqrt(M)`", "`2*a*b*c/M**0.5 + a*c`")
    assert not cells_agree("`2*d*q + 4*d*q*x/g_q`", "`2*d*q + 2*d*q*x/g_q`")


def test_outputs_are_written_and_the_readme_is_current(fan, reproduced):
    out, rows = reproduced
    for name in ("table.md", "transfers_vs_memory.png", "attention_roofline.png"):
        assert (out / name).stat().st_size > 1000
    readme = (PAPERS / "flash_attention_on_a_napkin" / "README.md").read_text()
    published = table_cells(readme.split("<!-- table -->", 1)[1].split("<!-- /table -->", 1)[0])
    computed = table_cells(fan.table(rows))
    assert len(published) == len(computed), "README table is stale: rerun reproduce.py"
    for ours, theirs in zip(computed, published, strict=True):
        assert len(ours) == len(theirs) and all(map(cells_agree, ours, theirs)), (
            f"README table is stale: rerun reproduce.py\nREADME:   {theirs}\ncomputed: {ours}"
        )
    for figure in ("transfers_vs_memory.png", "attention_roofline.png"):
        assert f"]({figure})" in readme


def test_a_wrong_paper_number_is_caught(fan):
    assert fan.Row("x", "q", 295, 300.0, 0.5).agrees is False
    assert fan.Row("x", "q", 66, 65.9, 1, truncated=True).agrees is False
    assert "**no**" in fan.table([fan.Row("x", "q", 295, 300.0, 0.5)])


@pytest.fixture(scope="module")
def io():
    return load(PAPERS / "flash_attention" / "io_complexity.py", "fa_io_complexity")


def test_io_complexity_formulas(io):
    standard, flash = io.formulas()
    N, d, M = io.N, io.d.size, io.M
    assert standard == 4 * N * d + 4 * N**2  # Θ(Nd + N²)
    assert flash == 2 * N * d + 8 * N**2 * d**2 / M  # Θ(N²d²/M)


def test_io_complexity_exponents(io, tmp_path):
    fits = io.main(tmp_path)
    assert fits["standard_N_d64"] == pytest.approx(2, abs=0.05)  # the N² term dominates at large N
    assert fits["flash_N_d64"] == pytest.approx(2, abs=0.01) and fits["flash_N_d128"] == pytest.approx(2, abs=0.01)
    assert fits["flash_M"] == pytest.approx(-1, abs=0.05)  # 1/M
    assert (tmp_path / "io_complexity.png").stat().st_size > 1000
    standard, flash, _ = io.hbm_accesses(4096, 64, 100 * 1024)
    assert flash < standard / 5
