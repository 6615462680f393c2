"""Golden files pin the description of emitted kernels (``NAPKIN_REGEN_GOLDEN=1`` rewrites them)."""

import os
import re
from pathlib import Path

import pytest

import napkin_cat as nc
from lowering import lower
from rewrites import derive, stream, tile

GOLDEN = Path(__file__).parent / "golden" / "kernels"
NUMBER = re.compile(r"\d+\.\d+(?:e[-+]?\d+)?")


def _cases():
    b, h, q, x, d = nc.axes("b h q x d")
    n, k, c = nc.axes("n k c")
    hk, g = nc.axes("hk g")
    return {
        "flash_attention": lambda: lower(derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64),
                                                verify=False)),
        "causal_mha_with_backward": lambda: lower(derive(
            nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True, dtype=nc.bf16),
            tile(q, 128), stream(x, 64), verify=False)),
        "gqa": lambda: lower(derive(nc.library.grouped_query_attention(hk, g, q, x, d), tile(q, 64), stream(x, 64),
                                    verify=False)),
        "tiled_matmul": lambda: lower(derive(nc.library.matmul(n, k, c), tile(n, 64), tile(c, 64), stream(k, 32),
                                             verify=False)),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_source_matches_golden(name):
    text = _cases()[name]().source + "\n"
    path = GOLDEN / f"{name}.txt"
    if os.environ.get("NAPKIN_REGEN_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"no golden file {path}; run with NAPKIN_REGEN_GOLDEN=1"
    golden = path.read_text()
    # Printed floats (log₂e folded into the scale) are compared as numbers, the rest as text.
    assert NUMBER.sub("#", text) == NUMBER.sub("#", golden), f"kernel {name} changed; NAPKIN_REGEN_GOLDEN=1 rewrites it"
    for ours, theirs in zip(NUMBER.findall(text), NUMBER.findall(golden), strict=True):
        assert float(ours) == pytest.approx(float(theirs), rel=1e-12), f"kernel {name}: {ours} vs golden {theirs}"
