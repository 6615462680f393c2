"""A readable description of an emitted kernel: its launch (grid, blocks), loop, accumulators and body.

The text is deterministic and sizes stay symbolic, so golden files can pin it
(``tests/golden/kernels/*.txt``; ``NAPKIN_REGEN_GOLDEN=1`` rewrites them).

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> from lowering import lower
>>> q, x, d = nc.axes("q x d")
>>> print(lower(derive(nc.library.attention(q, x, d), tile(q, 64), stream(x, 32), verify=False)).forward.source)
... # doctest: +ELLIPSIS
pallas_call napkin_kernel  (Triton backend)
  grid: (cdiv(q, 64), 1)    # q tiles, then batch ()
...
"""

from __future__ import annotations

from lowering._plan import Plan, base2, unweave
from lowering._sparsity import described
from napkin_cat.diagram import is_copy, is_structural, is_swap


def _block(p: Plan, wire) -> str:
    dims = []
    for a in wire.axes:
        if a.name in p.batch:
            dims.append("None")
        elif a.name in p.tiles:
            dims.append(str(p.tiles[a.name]))
        elif p.stream and a.name == p.stream[0]:
            dims.append(f"{a.size} (streamed in chunks of {p.stream[1]})")
        else:
            dims.append(f"{a.size}")
    return f"{wire.name:<14} block ({', '.join(dims)})"


def describe(kernel) -> str:
    """The launch, loop and body of a :class:`lowering.TritonLowered` kernel, as text (see the module's
    docstring for an example)."""
    p: Plan = kernel.plan
    d = p.diagram
    tiles = ", ".join(f"cdiv({a}, {g})" for a, g in p.tiles.items())
    lines = [
        "pallas_call napkin_kernel  (Triton backend)",
        f"  grid: ({tiles}{', ' if tiles else ''}{' · '.join(p.batch) or 1})"
        f"    # {' '.join(p.tiles) or 'no'} tiles, then batch ({', '.join(p.batch)})",
        "  inputs:",
        *(f"    {i}: {_block(p, w)}" for i, w in enumerate(d.dom.inside)),
        "  outputs:",
        *(f"    {i}: {_block(p, w)}" for i, w in enumerate(d.cod.inside)),
    ]
    body = base2(unweave(d, p.batch))
    if p.stream:
        x, s = p.stream
        accs = [b for b in body.boxes if not is_structural(b) and b.accumulator(x)]
        lines.append(f"  loop: fori_loop over chunks of {x} (size {s}), carrying:")
        lines += [f"    {type(b.accumulator(x)).__name__} of {b.name!r}" for b in accs]
    lines.append("  body (per block, in order):")
    for _, box, _ in body.inside:
        if is_swap(box):
            continue
        name = "copy" if is_copy(box) else box.name
        extra = ", ".join(f"{k}={v}" for k, v in (box.data or ()) if k in ("scale", "base"))
        lines.append(f"    {name:<28} {box.dom} → {box.cod}" + (f"   [{extra}]" if extra else ""))
    lines += [f"  {line}" for line in described(p)]
    return "\n".join(lines)
