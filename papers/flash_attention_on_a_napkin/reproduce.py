"""Reproduce the performance model of *FlashAttention on a Napkin* (FAN §4–5; the rows of table.md) from napkin-cat.

Every number is computed: the transfer and memory formulas by the cost functor (``napkin_cat._cost``) on
FAN's diagrams, the thresholds and the Hopper budget from those formulas and the hardware models
(``napkin_cat.hardware``), never typed in. ``python papers/flash_attention_on_a_napkin/reproduce.py``
writes ``table.md``, ``transfers_vs_memory.png`` and ``attention_roofline.png`` beside this file and the
table into ``README.md``.

>>> rows = symbolic_rows()
>>> [r.key for r in rows][:3], all(r.agrees for r in rows)
(['1', '1', '2'], True)
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib
import numpy as np
import sympy

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import napkin_cat as nc  # noqa: E402
from napkin_cat import cost  # noqa: E402
from napkin_cat import optimize as opt  # noqa: E402
from napkin_cat.diagram import Array, Diagram, Ty, relabel  # noqa: E402
from napkin_cat.diagram import id as identity  # noqa: E402
from napkin_cat.generators import Contract, SoftmaxContract, move  # noqa: E402
from napkin_cat.hardware import A100, A100_40GB, H100, KiB  # noqa: E402

HERE = Path(__file__).parent
POSITIVE = dict(positive=True, integer=True)
g_a, g_c, s_b, g_q, s_x = sympy.symbols("g_a g_c s_b g_q s_x", **POSITIVE)
M = sympy.Symbol("M", positive=True)
a, b, c = nc.axes("a b c")
h, q, x, d = nc.axes("h q x d")
A_, B_, C_ = a.size, b.size, c.size
H_, Q_, X_, D_ = h.size, q.size, x.size, d.size


# --- FAN's diagrams -------------------------------------------------------------------------------


def matmul(dtype=nc.bf16, tiles=(g_a, s_b, g_c)) -> Diagram:
    """``A[a,b] ⊗ B[b,c] → C[a,c]`` as one kernel with FAN's labels: tiles ``g_a``, ``g_c``, stream ``s_b``."""
    ga, sb, gc = tiles
    return relabel(nc.library.matmul(a, b, c, dtype=dtype), a=("group", ga), b=("stream", sb), c=("group", gc))


def flash(qk=nc.bf16, v=nc.bf16, labels=(g_q, s_x)) -> Diagram:
    """FAN's FlashAttention: Q, K, V, O in SMEM, the score chunk in registers; q tiled, x streamed.

    ``qk`` is the dtype of Q and K (the QKᵀ operands), ``v`` that of V and O (the PV operands).
    """
    Q, K, V = Array(q, d, dtype=qk), Array(x, d, dtype=qk), Array(x, d, dtype=v)
    sm = lambda w: w.with_(level=nc.SMEM)  # noqa: E731
    S, out = Array(q, x, level=nc.REG), Array(q, d, dtype=v, level=nc.SMEM)
    scores = Contract("q d, x d → q x", Ty(sm(Q), sm(K)), Ty(S), data=(("scale", 1 / sympy.sqrt(D_)),))
    mix = SoftmaxContract("softmax·contract x", Ty(S, sm(V)), Ty(out), data=(("axis", "x"),))
    kernel = (move(Q, nc.SMEM) @ move(K, nc.SMEM) @ move(V, nc.SMEM)) >> (scores @ identity(sm(V))) >> mix
    return relabel(kernel >> move(out, nc.HBM), q=("group", labels[0]), x=("stream", labels[1]))


# --- the table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One reproduced figure: FAN's value, ours, and the tolerance they must agree within.

    Formulas (sympy) agree when their difference simplifies to 0; numbers when ``|ours − paper| ≤ tol``
    (half a unit of the paper's last printed digit), or ``0 ≤ ours − paper ≤ tol`` for a number the
    paper truncates. ``paper=None`` marks a row with no number to compare (its ``note`` says why).
    """

    key: str
    quantity: str
    paper: object
    computed: object
    tol: float = 0.0
    unit: str = ""
    note: str = ""
    truncated: bool = False

    @property
    def symbolic(self) -> bool:
        return isinstance(self.computed, sympy.Basic) and not self.computed.is_number

    @property
    def agrees(self) -> bool | None:
        if self.paper is None:
            return None
        if self.symbolic:
            return sympy.simplify(self.computed - self.paper) == 0
        diff = float(self.computed) - float(self.paper)
        return -1e-12 <= diff <= self.tol + 1e-12 if self.truncated else abs(diff) <= self.tol + 1e-12

    @property
    def rel_diff(self) -> float | None:
        if self.paper is None or self.symbolic:
            return None
        return (float(self.computed) - float(self.paper)) / float(self.paper)


def symbolic_rows() -> list[Row]:
    """Rows 1–8 and 10: the formulas, from the cost functor on FAN's diagrams."""
    mm = cost(matmul(), H100)
    H1, M1, F1 = mm.transfers[nc.SMEM], mm.memory[nc.SMEM], sum(mm.tensor_flops.values())
    # Row 2: with g_a·g_c = M fixed (the stream chunk s_b ≪ g), the transfers are least at g_a = g_c = √M.
    per_memory = sympy.expand(H1.subs(g_c, M / g_a))
    best = [r for r in sympy.solve(sympy.diff(per_memory, g_a), g_a) if r.is_positive]
    H2 = sympy.expand(per_memory.subs(g_a, best[0]))
    unlimited = sympy.expand(H1.subs({g_a: A_, g_c: C_}))
    fa = cost(flash(), H100)
    H4, M4 = fa.transfers[nc.SMEM], fa.memory[nc.SMEM]
    # Row 5: H4 falls as g_q grows; the largest g_q that fits M = 2 g_q d + 2 s_x d (s_x ≪ g_q) is M/2d.
    H5 = sympy.expand(H4.subs(g_q, M / (2 * D_)))
    heads = cost(relabel(flash().weave(h), h=("group", 1)), H100).transfers[nc.SMEM]  # one head per group
    H6 = sympy.expand(heads.subs(g_q, M / (2 * D_)))
    naive = cost(nc.library.attention(q, x, d), H100).transfers[nc.SMEM]
    beta = {name: sympy.simplify(-M * sympy.diff(e, M) / e) for name, e in (("matmul", H2 - A_ * C_), ("attn", H5))}
    beta["attn"] = sympy.simplify(-M * sympy.diff(H5 - 2 * Q_ * D_, M) / (H5 - 2 * Q_ * D_))
    return [
        Row("1", "matmul transfers H (tiles g_a, g_c, stream s_b)", A_ * B_ * C_ * (1 / g_a + 1 / g_c) + A_ * C_, H1),
        Row("1", "matmul memory M", g_a * g_c + g_a * s_b + s_b * g_c, M1),
        Row("2", "matmul optimum: square tiles g_a = g_c", sympy.sqrt(M), best[0]),
        Row("2", "matmul optimum H", 2 * A_ * B_ * C_ * M**-0.5 + A_ * C_, H2),
        Row("2", "matmul, unlimited M", A_ * B_ + B_ * C_ + A_ * C_, unlimited),
        Row("3", "matmul transfers per FLOP", M**-0.5 + 1 / (2 * B_), sympy.expand(H2 / F1)),
        Row("4", "attention transfers H (one head)", 2 * Q_ * D_ + 2 * X_ * D_ * Q_ / g_q, H4),
        Row("4", "attention memory M", 2 * g_q * D_ + 2 * s_x * D_, M4),
        Row("5", "attention optimum H (g_q = M/2d)", 2 * Q_ * D_ + 4 * X_ * Q_ * D_**2 / M, H5),
        Row("6", "multi-head optimum H", 2 * H_ * Q_ * D_ + 4 * H_ * X_ * Q_ * D_**2 / M, H6),
        Row("7", "naive unfused attention H", 2 * Q_ * D_ + 2 * X_ * D_ + 4 * Q_ * X_, naive),
        Row("8", "β, matmul (H* − ac ∝ M^−β)", sympy.Rational(1, 2), beta["matmul"], note="symbolic"),
        Row("8", "β, attention (H* − 2qd ∝ M^−β)", sympy.Integer(1), beta["attn"], note="symbolic"),
    ]


def quantization_rows() -> list[Row]:
    """Row 10: halving the bytes per value, at a fixed memory in bytes, from the functor's byte counts."""
    rows = []
    Mb = sympy.Symbol("M_bytes", positive=True)
    for name, beta, paper in (("attention", 1, 4), ("matmul", sympy.Rational(1, 2), 2.83)):
        moved = {}
        for dtype in (nc.bf16, nc.fp8_e4m3):
            values = Mb / dtype.bytes  # the same bytes hold 1/q times more values
            if name == "matmul":
                k = cost(matmul(dtype=dtype), H100)
                optimum = k.hbm_bytes.subs({g_a: sympy.sqrt(values), g_c: sympy.sqrt(values)})
                moved[dtype] = sympy.expand(optimum - A_ * C_ * dtype.bytes)
            else:
                k = cost(flash(qk=dtype, v=dtype), H100)
                moved[dtype] = sympy.expand(k.hbm_bytes.subs(g_q, values / (2 * D_)) - 2 * Q_ * D_ * dtype.bytes)
        gain = sympy.simplify(moved[nc.bf16] / moved[nc.fp8_e4m3])
        rows.append(Row("10", f"quantization bf16 → fp8, {name} (×)", paper, float(gain), 0.005))
        rows.append(Row("10", f"… the same from q^(1+β), β = {beta}", paper, opt.quantization_gain(float(beta)), 0.005))
    return rows


def threshold_rows() -> list[Row]:
    """Rows 11–13: where the functor's transfers per tensor FLOP meet the hardware's values per FLOP."""
    mm = cost(matmul(), H100)
    F = sum(mm.tensor_flops.values())
    per_flop = sympy.expand(mm.transfers[nc.SMEM].subs({g_a: sympy.sqrt(M), g_c: sympy.sqrt(M)}) / F)
    infinite = sympy.limit(sympy.limit(per_flop, A_, sympy.oo), M, sympy.oo)  # 1/(2b)
    fa = cost(flash(), H100)
    attn = sympy.limit(fa.transfers[nc.SMEM] / sum(fa.tensor_flops.values()), X_, sympy.oo)  # 1/(2 g_q)
    r_hbm = opt.values_per_flop(H100, nc.L2)
    r_smem = opt.values_per_flop(H100, nc.SMEM)
    bb, gg = sympy.symbols("b g", positive=True)  # solve over the reals, not the integer sizes
    b_min = float(sympy.solve(infinite.subs(B_, bb) - r_hbm, bb)[0])
    gq_min = float(sympy.solve(attn.subs(g_q, gg) - r_hbm, gg)[0])
    m_min = float(sympy.solve(sympy.limit(per_flop, B_, sympy.oo) - r_hbm, M)[0])
    smem_values = H100.l1_smem_per_sm / nc.bf16.bytes
    b_smem = float(sympy.solve(infinite.subs(B_, bb) - r_smem, bb)[0])
    b_smem_m = float(sympy.solve(per_flop.subs({B_: bb, M: smem_values}) - r_smem, bb)[0])
    return [
        Row("11", "H100: matmul compute-bound for b ≥ (M → ∞)", 295, b_min, 0.5),
        Row("11", "H100: attention compute-bound for g_q ≥", 295, gq_min, 0.5),
        Row("12", "H100: least GMEM↔L2 memory for a compute-bound matmul", 681, m_min * 2 / KiB, 0.5, "KiB"),
        Row("13", "H100 SMEM level (6.0e12 values/s): b ≥ (M → ∞)", 82, b_smem, 0.5),
        Row("13", "H100 SMEM level: b ≥ with M = 256 KiB (L1+SMEM per SM)", 151, b_smem_m, 0.5),
    ]


def hopper_rows() -> list[Row]:
    """Rows 14–17: FAN's Hopper configuration, per-chunk timing and the FA3 fit."""
    cfg = opt.hopper_configuration(H100)
    budget = opt.fan_hopper_budget()
    # Row 16 from the functor: one group of g_q queries; what one more chunk of s_x keys costs.
    g, s = cfg.g_q, 64
    k = cost(flash(qk=nc.fp8_e4m3, v=nc.f16, labels=(g, s)), H100).subs(q=g, d=128)
    clocks = sum(sympy.diff(f, X_) * s / H100.flops_per_clk(t) for t, f in k.tensor_flops.items())
    compute = float(clocks) / H100.clock
    transfer = float(sympy.diff(k.hbm_bytes, X_) * s) * H100.sms / H100.bandwidth(nc.SMEM, outer=nc.HBM)
    flops = H100.sms * float(sum(sympy.diff(f, X_) * s for f in k.tensor_flops.values())) / max(compute, transfer)
    fit75, fit740 = (opt.fit_softmax_overhead(H100, u) for u in (0.75, 740e12 / H100.flops(nc.f16)))
    return [
        Row("14", "SMEM per thread block M_TB (2 stages of K fp8 + V fp16)", 48, budget.block_smem / KiB, 0.5, "KiB"),
        Row("14", "SMEM per warpgroup M_WG (Q fp8 + O fp16)", 48, budget.warpgroup_smem / KiB, 0.5, "KiB"),
        Row("14", "N_max by SMEM = (227 KiB − M_TB)/M_WG", 3.7, cfg.n_smem, 0.05),
        Row("14", "N_max by registers = 256 KiB / 74.75 KiB", 3.4, cfg.n_regs, 0.05),
        Row("14", "warpgroups per SM", 3, cfg.warpgroups),
        Row("14", "g_q = warpgroups × w_q", 384, cfg.g_q),
        Row("15", "clock = 1979e12 / (132 · 8192)", 1.83, H100.clock / 1e9, 0.005, "GHz"),
        Row("16", "compute per KV chunk (QKᵀ fp8, PV fp16)", 1.26, compute * 1e6, 0.005, "µs"),
        Row("16", "transfer per KV chunk (132 SMs, HBM)", 0.97, transfer * 1e6, 0.005, "µs"),
        Row("16", "attainable throughput", 1.32, flops / 1e15, 0.005, "PFLOP/s"),
        Row(
            "17", "FA3 fit: utilisation FP16 with 66% softmax overhead", 75,
            100 * opt.utilisation(H100, 0.66), 0.5, "%",
        ),
        Row(
            "17", "FA3 fit: utilisation FP8 with 66% softmax overhead", 60,
            100 * opt.utilisation(H100, 0.66, dtype=nc.fp8_e4m3), 0.5, "%",
        ),
        Row(
            "17", "softmax overhead fitted to FA3's 75% FP16 utilisation", 66, 100 * fit75, 1, "%",
            "FAN truncates 2/3 to 66%", truncated=True,
        ),
        Row(
            "17", "… fitted instead to FA3's 740 of 989 TFLOP/s", None, 100 * fit740, unit="%",
            note=f"predicts {100 * opt.utilisation(H100, fit740, dtype=nc.fp8_e4m3):.1f}% at FP8 (FA3: 1.2 of 1.98 PF,"
            f" {100 * 1.2 / 1.98:.1f}%)",
        ),
    ]


def ampere_rows() -> list[Row]:
    """FAN v1's Ampere claim, re-derived (assumptions in ``napkin_cat.optimize.ampere_warps``)."""
    w40, w80 = opt.ampere_warps(A100_40GB), opt.ampere_warps(A100)
    return [
        Row("v1", "A100-40GB (1.555 TB/s): warps per SM to be compute-bound", 13, w40.needed),
        Row("v1", "FlashAttention's query block (B_r = min(⌈M/4d⌉, d), d = 128) in 16-row warps", 8, w40.flash),
        Row("v1", "… and warps that fit at 255 registers per thread", 8, w40.register_limit),
        Row(
            "v1", "A100 80GB (2.039 TB/s): warps per SM to be compute-bound", None, w80.needed,
            note="the 80 GB part's faster HBM needs 10: FAN's 13 matches the 40 GB A100",
        ),
    ]


def data_rows() -> list[Row]:
    """Rows 9, 18, 19: a formula evaluated, and figures that are measurements, not model outputs."""
    # Row 9: H* = Σ_ℓ Ḣ_ℓ⁻¹ H*(a, M_ℓ), each level's H* from the functor at square tiles √M_ℓ.
    mm = cost(matmul(), H100).subs(a=8192, b=8192, c=8192)
    seconds = 0.0
    for level in (nc.L2, nc.SMEM):
        values = H100.capacity(level) / nc.bf16.bytes
        per_level = mm.hbm_bytes.subs({g_a: math.isqrt(int(values)), g_c: math.isqrt(int(values))})
        seconds += float(per_level) / H100.bandwidth(level)
    return [
        Row(
            "9", "multi-level H* for an 8192³ bf16 matmul on H100 (L2 + SMEM)", None, seconds * 1e6, unit="µs",
            note="a formula in FAN; evaluated here from the functor, square tiles per level",
        ),
        Row("18", "H800 cluster DSMEM / GMEM↔SMEM bandwidths", None, "—", note="measurements FAN cites; no model"),
        Row("19", "FlashAttention ×6 over PyTorch; transfers ≈ 46% of energy", None, "—", note="empirical; no model"),
    ]


def rows() -> list[Row]:
    """Every row of the reproduction, in table.md's order, formula by formula (FAN v1's Ampere claim last)."""
    return symbolic_rows() + quantization_rows() + threshold_rows() + hopper_rows() + data_rows() + ampere_rows()


def _show(value, unit="") -> str:
    if isinstance(value, sympy.Basic) and not value.is_number:
        return f"`{sympy.sstr(value)}`"
    if isinstance(value, str):
        return value
    v = float(value)
    text = f"{v:.0f}" if v == int(v) and abs(v) < 1e6 else f"{v:.4g}"
    return f"{text} {unit}".strip()


def table(rs: list[Row]) -> str:
    """The rows as a markdown table: paper value, computed value, relative difference, agreement."""
    lines = ["| # | quantity | paper | computed | rel. diff | agrees (tolerance) |", "|---|---|---|---|---|---|"]
    for r in rs:
        diff = "0 (symbolic)" if r.symbolic and r.agrees else "—" if r.rel_diff is None else f"{r.rel_diff:+.2%}"
        if r.agrees is None:
            verdict = r.note or "—"
        elif r.symbolic:
            verdict = "yes (identical)" if r.agrees else "**no**"
        else:
            bound = f" (+{r.tol:g}, truncated)" if r.truncated else f" (±{r.tol:g})" if r.tol else " (exact)"
            verdict = ("yes" if r.agrees else "**no**") + bound
            verdict += f"; {r.note}" if r.note else ""
        paper = "—" if r.paper is None else _show(r.paper, r.unit)
        lines.append(f"| {r.key} | {r.quantity} | {paper} | {_show(r.computed, r.unit)} | {diff} | {verdict} |")
    return "\n".join(lines) + "\n"


# --- figures --------------------------------------------------------------------------------------

POWERS = [2**k for k in range(2, 13)] + [3 * 2**k for k in range(1, 12)]


def sweep(kind: str, memories) -> list[tuple[float, float]]:
    """``(M, H* − H*(∞))`` in values: the functor's transfers at the best tiles fitting M values.

    Matmul: a = b = c = 4096; attention: q = x = 4096, d = 128 (1-byte values, so bytes = values).
    The sweeps stop before the best tile reaches the whole axis (g ≤ 4096), where H* meets its floor.
    """
    if kind == "matmul":
        c_ = cost(matmul(dtype=nc.fp8_e4m3), H100).subs(a=4096, b=4096, c=4096)
        choices, floor = {"g_a": POWERS, "g_c": POWERS, "s_b": [16, 32, 64]}, 4096 * 4096
    else:
        c_ = cost(flash(qk=nc.fp8_e4m3, v=nc.fp8_e4m3), H100).subs(q=4096, x=4096, d=128)
        choices, floor = {"g_q": POWERS, "s_x": [16]}, 2 * 4096 * 128
    out = []
    for m in memories:
        _, bound = opt.best_tiles(c_, choices, nc.SMEM, capacity=m)
        out.append((m, float(bound.transfers[nc.SMEM]) - floor))
    return out


def slope(points) -> float:
    """The least-squares slope of log H against log M."""
    m, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
    return float(np.polyfit(m, y, 1)[0])


def figure_transfers(path: Path) -> dict[str, float]:
    """Log-log transfers against memory (FAN row 8): slopes −0.5 (matmul) and −1 (attention)."""
    ranges = {"matmul": [2**k for k in range(12, 24)], "attention": [2**k for k in range(15, 21)]}
    fig, ax = plt.subplots(figsize=(6, 4.2))
    slopes = {}
    for kind, colour, beta in (("matmul", "tab:blue", 0.5), ("attention", "tab:orange", 1.0)):
        pts = sweep(kind, ranges[kind])
        slopes[kind] = slope(pts)
        ms, hs = zip(*pts, strict=True)
        ax.loglog(ms, hs, "o", color=colour, label=f"{kind}: functor at best tiles (fit β = {-slopes[kind]:.2f})")
        ref = [hs[-1] * (m / ms[-1]) ** -beta for m in ms]
        ax.loglog(ms, ref, "--", color=colour, alpha=0.6, label=f"M^-{beta:g}")
    ax.set_xlabel("on-chip memory M (values)")
    ax.set_ylabel("transfers above the M → ∞ floor (values)")
    ax.set_title("H* = α·M^-β: matmul β = 0.5, attention β = 1", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return slopes


def figure_roofline(path: Path):
    """Attention's roofline times on H100 and A100 against g_q: bandwidth-bound below 1/(2r) (row 11)."""
    gs = np.geomspace(16, 1024, 60)
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for hw, style in ((H100, "-"), (A100, ":")):
        k = cost(flash(labels=(g_q, 64)), hw).subs(q=8192, x=8192, d=128)
        link = sympy.lambdify(g_q, k.times["→L2"])
        tensor = float(k.times["tensor"])
        ax.loglog(gs, [link(g) * 1e6 for g in gs], style, color="tab:red", label=f"{hw.name}: HBM transfer")
        ax.axhline(tensor * 1e6, linestyle=style, color="tab:green", label=f"{hw.name}: tensor cores")
        ax.axvline(opt.attention_threshold(hw), linestyle=style, color="grey")
    ax.set_xlabel("query group g_q")
    ax.set_ylabel("time (µs), q = x = 8192, d = 128, bf16")
    ax.set_title("compute-bound for g_q ≥ 1/(2r): 295 on H100, 153 on A100", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fit_rows(slopes: dict[str, float]) -> list[Row]:
    """Row 8 measured on the figure: the fitted log-log slopes of the functor's best-tile transfers."""
    return [
        Row("8", "β, matmul, fitted on the figure's sweep", 0.5, -slopes["matmul"], 0.05, note="discrete tiles"),
        Row("8", "β, attention, fitted on the figure's sweep", 1.0, -slopes["attention"], 0.05, note="discrete tiles"),
    ]


def main(out: Path = HERE) -> list[Row]:
    """Compute every row, write ``table.md`` and the figures into ``out``, and the table into the README."""
    slopes = figure_transfers(out / "transfers_vs_memory.png")
    figure_roofline(out / "attention_roofline.png")
    rs = rows() + fit_rows(slopes)
    text = table(rs)
    (out / "table.md").write_text(text)
    readme = out / "README.md"
    if readme.exists():
        start, end = "<!-- table -->", "<!-- /table -->"
        body = readme.read_text()
        if start in body and end in body:
            head, rest = body.split(start, 1)
            readme.write_text(f"{head}{start}\n{text}{end}{rest.split(end, 1)[1]}")
    return rs


if __name__ == "__main__":
    results = main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
    print(table(results))
    misses = [r for r in results if r.agrees is False]
    print(f"{sum(r.agrees is True for r in results)} agree, {len(misses)} disagree, "
          f"{sum(r.agrees is None for r in results)} without a paper number")
    sys.exit(1 if misses else 0)
