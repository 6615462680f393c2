"""FlashAttention's IO complexity (Dao et al. 2022, Thm. 2) from napkin-cat's cost functor.

Standard attention moves Θ(Nd + N²) values between HBM and SRAM; FlashAttention moves Θ(N²d²/M) for an
SRAM of M values. Both come out of ``napkin_cat._cost``: the standard one from the naive diagram (one
kernel per box), FlashAttention's from the same diagram recoloured to SMEM (``rewrites._level``) with q
tiled by g and x streamed by s, at the largest tiles that fit M. ``python
papers/flash_attention/io_complexity.py`` writes ``io_complexity.png`` and ``io_complexity.md`` here.

>>> standard, flash = formulas()
>>> standard
4*N**2 + 4*N*d
>>> flash
2*N*d + 8*N**2*d**2/M
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import numpy as np
import sympy

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import cost  # noqa: E402
from napkin_cat.optimize import best_tiles  # noqa: E402
from rewrites import level  # noqa: E402

HERE = Path(__file__).parent
g, s = sympy.symbols("g s", positive=True, integer=True)
M = sympy.Symbol("M", positive=True)
N = sympy.Symbol("N", positive=True, integer=True)
q, x, d = nc.axes("q x d")


def naive() -> nc.Diagram:
    """Standard attention: ``softmax(QKᵀ/√d) V`` with S and P written to HBM (fp8 values: bytes = values)."""
    return nc.library.attention(q, x, d, dtype=nc.fp8_e4m3)


def flash(group=g, chunk=s) -> nc.Diagram:
    """FlashAttention: the naive diagram recoloured to SMEM, q tiled by ``group``, x streamed by ``chunk``."""
    kernel = level(nc.SMEM)(naive())
    label = {"q": lambda a: a.tiled(group), "x": lambda a: a.streamed(chunk)}
    return kernel.map_arrays(lambda w: w.with_(axes=[label.get(a.name, lambda a: a)(a) for a in w.axes]))


def formulas() -> tuple[sympy.Expr, sympy.Expr]:
    """HBM accesses (values) for N queries and keys: standard, and FlashAttention with FA's blocks M/4d."""
    square = {q.size: N, x.size: N}
    standard = sympy.expand(cost(naive()).hbm_transfers.xreplace(square))
    tiled = cost(flash()).hbm_transfers.xreplace(square)
    return standard, sympy.expand(tiled.subs(g, M / (4 * d.size)))  # Alg. 1: B_r ≤ ⌈M/4d⌉


def hbm_accesses(n: int, head: int, memory: int) -> tuple[float, float, dict]:
    """Standard and FlashAttention HBM accesses (values) at N = ``n``, d = ``head``, SRAM of ``memory`` values."""
    sizes = dict(q=n, x=n, d=head)
    standard = float(cost(naive()).subs(**sizes).hbm_transfers)
    powers = [2**k for k in range(3, 14)]
    labels, bound = best_tiles(cost(flash()), {"g": powers, "s": [16, 32, 64]}, nc.SMEM, capacity=memory, **sizes)
    return standard, float(bound.hbm_transfers), labels


def slope(xs, ys) -> float:
    """The least-squares slope of log y against log x."""
    return float(np.polyfit(np.log(xs), np.log(ys), 1)[0])


def main(out: Path = HERE) -> dict[str, float]:
    """Write the figure and the table; return the fitted exponents."""
    ns = [2**k for k in range(9, 15)]
    memories = [2**k for k in range(14, 20)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    fits: dict[str, float] = {}
    lines = ["| N | d | M (values) | standard | FlashAttention | ratio | tiles |", "|---|---|---|---|---|---|---|"]
    for head, style in ((64, "-"), (128, "--")):
        rows = [hbm_accesses(n, head, 100 * 1024) for n in ns]
        standard, fa = [r[0] for r in rows], [r[1] for r in rows]
        left.loglog(ns, standard, style, color="tab:red", label=f"standard, d = {head}")
        left.loglog(ns, fa, style, color="tab:blue", label=f"FlashAttention, d = {head}")
        fits[f"standard_N_d{head}"] = slope(ns[-3:], standard[-3:])
        fits[f"flash_N_d{head}"] = slope(ns, [f - 2 * n * head for f, n in zip(fa, ns, strict=True)])
        for n, (st, f, labels) in zip(ns, rows, strict=True):
            lines.append(f"| {n} | {head} | {100 * 1024} | {st:.3g} | {f:.3g} | {st / f:.1f}× | g={labels['g']}, "
                         f"s={labels['s']} |")
    left.set_xlabel("sequence length N")
    left.set_ylabel("HBM accesses (values), M = 100 Ki values")
    left.set_title("standard Θ(Nd + N²) vs FlashAttention Θ(N²d²/M)", fontsize=10)
    left.legend(fontsize=8)
    n, head = 8192, 64
    by_memory = [hbm_accesses(n, head, m)[1] - 2 * n * head for m in memories]
    fits["flash_M"] = slope(memories, by_memory)
    label = f"FlashAttention − 2Nd (fit slope {fits['flash_M']:.2f})"
    right.loglog(memories, by_memory, "o-", color="tab:blue", label=label)
    right.loglog(memories, [by_memory[0] * memories[0] / m for m in memories], ":", color="grey", label="∝ 1/M")
    right.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    right.set_xlabel("SRAM size M (values)")
    right.set_ylabel(f"HBM accesses above 2Nd (N = {n}, d = {head})")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "io_complexity.png", dpi=120)
    plt.close(fig)
    standard, fa = formulas()
    text = (f"Standard attention: `{standard}`; FlashAttention (blocks M/4d): `{fa}` HBM accesses.\n\n"
            f"Fitted exponents: {', '.join(f'{k} {v:.2f}' for k, v in fits.items())}.\n\n" + "\n".join(lines) + "\n")
    (out / "io_complexity.md").write_text(text)
    return fits


if __name__ == "__main__":
    print(main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE))
