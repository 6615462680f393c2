"""Regenerate the README pictures: ``python docs/images/regenerate.py`` from the repository root."""

from pathlib import Path

import napkin_cat as nc
from napkin_cat.drawing import draw, draw_equation
from rewrites import derive, level, stream, tile

HERE = Path(__file__).parent
b, h, q, x, d = nc.axes("b h q x d")
attn = nc.library.attention(q, x, d)
draw(attn, HERE / "attention.png", title="attention: softmax(Q Kᵀ/√d) V")
mha = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype=nc.bf16)
draw(mha, HERE / "multi_head_attention.png", title="multi-head attention in bf16, weaved over batch b and heads h")
flash = derive(attn, tile(q, 128), stream(x, 64), level("SMEM"))
after = "tile(q, 128), stream(x, 64), level(SMEM)"
draw_equation(attn, flash.diagram, HERE / "attention_to_flash.png", titles=("naive attention", after))
flash.draw(HERE / "flash_attention_derivation.png", per_row=2)
