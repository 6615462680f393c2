"""Golden files pin the pseudocode of the derivations (regenerate with ``NAPKIN_REGEN_GOLDEN=1``)."""

import os
from pathlib import Path

import pytest

import napkin_cat as nc
from rewrites import level, pseudocode, stream, tile

GOLDEN = Path(__file__).parent / "golden" / "pseudocode"
REGEN = os.environ.get("NAPKIN_REGEN_GOLDEN") == "1"

q, x, d, b, h, hk, g, n, v = nc.axes("q x d b h hk g n v")


def schedule(diagram, *rules):
    for rule in rules:
        diagram = rule(diagram)
    return diagram


CASES = {
    "flash_attention": lambda: schedule(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), level(nc.SMEM)),
    "causal_attention": lambda: schedule(
        nc.library.attention(q, x, d, causal=True), tile(q, 128), stream(x, 64), level(nc.SMEM)),
    "multi_head_attention": lambda: schedule(
        nc.library.multi_head_attention(h, q, x, d, batch=(b,)), tile(q, 128), stream(x, 64), level(nc.SMEM)),
    "grouped_query_attention": lambda: schedule(
        nc.library.grouped_query_attention(hk, g, q, x, d), tile(q, 128), stream(x, 64), level(nc.SMEM)),
    "tiled_matmul": lambda: schedule(nc.library.matmul(*nc.axes("a b c")), tile("a", 128), tile("c", 128),
                                     stream("b", 32), level(nc.SMEM)),
    "cross_entropy": lambda: schedule(nc.library.cross_entropy(n, v), tile(n, 16), stream(v, 512), level(nc.SMEM)),
    "layer_norm": lambda: schedule(nc.library.layer_norm(n, d), tile(n, 16), level(nc.SMEM)),
    "layer_norm_statistics": lambda: schedule(
        nc.library.layer_norm_statistics(n, d), tile(n, 16), stream(d, 128), level(nc.SMEM)
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden(name):
    text = pseudocode(CASES[name]()) + "\n"
    path = GOLDEN / f"{name}.txt"
    if REGEN:
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; NAPKIN_REGEN_GOLDEN=1 writes it"
    assert text == path.read_text(), f"pseudocode of {name} changed; NAPKIN_REGEN_GOLDEN=1 regenerates it"


def test_deterministic():
    assert pseudocode(CASES["flash_attention"]()) == pseudocode(CASES["flash_attention"]())


def test_transfers_are_fans_formula():
    """FAN Table row 4: H = 2qd + 2xdq/g_q for one head."""
    last = pseudocode(CASES["flash_attention"]()).splitlines()[-1]
    assert last.endswith("total 2*d*q + 2*d*q*x/g_q")


def test_matmul_memory_is_fans_formula():
    """FAN Table row 1: M ≥ g_a·g_c + g_a·s_b + s_b·g_c."""
    assert "memory (largest column): SMEM g_a*g_c + g_a*s_b + g_c*s_b" in pseudocode(CASES["tiled_matmul"]())


def test_names_override():
    text = pseudocode(nc.library.attention(q, x, d), names=("A", "B", "C"))
    assert text.startswith("# A[q,d] ⊗ B[x,d] ⊗ C[x,d] → O[q,d]")
