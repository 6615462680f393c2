"""Draws docs/images/architecture.png: the layers and the path diagram → derive → lower → kernel.

Run from the repository root: ``python docs/images/architecture.py``.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

LAYERS = [  # (name, what lives there, colour)
    (
        "napkin_cat",
        "axes · Array/Ty/Diagram (the only discopy adapter) · generators/ (one class each:\n"
        "semantics over ctx.xp, cost, accumulator, derivative, picture, pseudocode, lowering hints)\n"
        "to_jax · cost · hardware · reverse · drawing/ · library",
        "#e8e4f8",
    ),
    (
        "rewrites",
        "tile · stream (Fusion Theorem as a predicate) · level · derive · verify\n"
        "schedule (the one scheduled interpreter) · proofs · pseudocode · testing",
        "#dff3ee",
    ),
    (
        "lowering",
        "plan (grid, blocks, loop, guards) · triton · mosaic · backward\n"
        "api (lower, Kernel) · attention (drop-in entry) · search",
        "#fdf0c8",
    ),
]
OUT = Path(__file__).with_name("architecture.png")
PATH = ["diagram", "derive(rules)", "scheduled\ndiagram", "lower(...)", "Kernel\n(jit · vmap · grad)"]


def main(out: Path = OUT) -> Path:
    fig, ax = plt.subplots(figsize=(11, 6.2), dpi=150)
    ax.set_xlim(0, 11)
    ax.set_ylim(0, 6.2)
    ax.axis("off")
    for i, (name, body, colour) in enumerate(LAYERS):
        y = 3.9 - i * 1.3
        ax.add_patch(FancyBboxPatch((0.3, y), 10.4, 1.05, boxstyle="round,pad=0.02", fc=colour, ec="black"))
        ax.text(0.5, y + 0.52, name, fontsize=13, weight="bold", va="center")
        ax.text(2.3, y + 0.52, body, fontsize=9, va="center")
        if i:  # imports point one way: lower layers import the ones above
            ax.add_patch(FancyArrowPatch((10.2, y + 1.05), (10.2, y + 1.3), arrowstyle="-|>", mutation_scale=12))
    ax.text(10.1, 5.05, "↑ imports point up", fontsize=8, ha="right", va="center")
    for i, label in enumerate(PATH):
        x = 0.5 + i * 2.15
        ax.add_patch(FancyBboxPatch((x, 5.35), 1.7, 0.6, boxstyle="round,pad=0.02", fc="white", ec="black"))
        ax.text(x + 0.85, 5.65, label, fontsize=9, ha="center", va="center")
        if i:
            ax.add_patch(FancyArrowPatch((x - 0.45, 5.65), (x, 5.65), arrowstyle="-|>", mutation_scale=12))
    ax.text(
        0.3,
        0.35,
        "application: python -m napkin_cat · papers/ (benchmarks, reproductions) · tests/",
        fontsize=9,
        style="italic",
    )
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(main())
