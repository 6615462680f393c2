"""Neural Circuit Diagrams reproduced: every architecture drawn, and its cost tabulated by the cost functor.

Writes one PNG per architecture into this folder and rebuilds ``README.md`` (each picture beside the
code that builds it, then the complexity table). From the repository root::

    python -m papers.neural_circuit_diagrams.figures            # pictures, table, README (~1 min)
    python -m papers.neural_circuit_diagrams.figures --table    # print the table only

The code shown beside each picture is the source of the function below that builds it.
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
from pathlib import Path

import sympy

import napkin_cat as nc
from napkin_cat import architectures as arch
from napkin_cat import cost
from napkin_cat.convolution import Rename
from napkin_cat.drawing import draw
from napkin_cat.generators import Cast, Reshape
from napkin_cat.hardware import H100

HERE = Path(__file__).parent
K3 = (nc.Axis("kx", 3), nc.Axis("ky", 3))


# --- the pictures: one function per architecture; its source is shown beside its picture ---------------


def mlp():
    n, i, h, o = nc.axes("n i h o")
    return nc.library.mlp(n, i, h, o)


def attention():
    q, x, d = nc.axes("q x d")
    return nc.library.attention(q, x, d)


def multi_head_attention():
    h, q, x, d = nc.axes("h q x d")
    return nc.library.multi_head_attention(h, q, x, d)


def self_attention():
    n, d, h, k = nc.axes("n d h k")
    return arch.self_attention(n, d, h, k)


def transformer_block():
    n, d, h, k, f = nc.axes("n d h k f")
    return arch.transformer_block(n, d, h, k, f)


def conv1d():
    i, o, x = nc.axes("i o x")
    return arch.conv1d(i, o, x, nc.Axis("k", 3), stride=2, padding=1)


def conv2d():
    i, o, x, y = nc.axes("i o x y")
    return arch.conv2d(i, o, (x, y), (nc.Axis("kx", 3), nc.Axis("ky", 3)), padding="same")


def resnet_block():
    c, x, y = nc.axes("c x y")
    return arch.resnet_block(c, (x, y), (nc.Axis("kx", 3), nc.Axis("ky", 3)))


def unet():
    i, w, o, x, y = nc.axes("i w o x y")
    return arch.unet(i, w, o, (x, y), depth=1)


def patch_embedding():
    c, x, y, d = nc.axes("c x y d")
    return arch.patch_embedding(c, (x, y), d, patch=16)


def vit_encoder_block():
    d, h, k, f = nc.axes("d h k f")
    return arch.vit_encoder_block(arch.tokens(nc.axes("x y"), 16), d, h, k, f)


FIGURES = (mlp, attention, multi_head_attention, self_attention, transformer_block, conv1d, conv2d,
           resnet_block, unet, patch_embedding, vit_encoder_block)


def source(fn) -> str:
    """The body of a figure function, as the code a reader would write."""
    body = inspect.getsource(fn).split("\n", 1)[1]
    return textwrap.dedent(body).replace("return ", "diagram = ", 1).strip()


# --- the table: the cost functor on each architecture, batched over b with shared weights ---------------

b, n, d, h, k, f, c, e, i, o, x, y, w, t = nc.axes("b n d h k f c e i o x y w t")
SIZES = dict(b=8, n=1024, d=768, h=12, k=64, f=3072, c=64, e=128, i=3, o=2, x=224, y=224, w=64, t=197)
"""Example sizes for the numeric columns: a GPT-2-small block, ImageNet-size images, 64-channel convolutions."""

TABLE = {
    "MLP": lambda: arch.weave(nc.library.mlp(n, d, f, d), b, shared=range(1, 5)),
    "multi-head self-attention": lambda: arch.self_attention(n, d, h, k, batch=(b,)),
    "transformer block (pre-norm)": lambda: arch.transformer_block(n, d, h, k, f, batch=(b,)),
    "1-D convolution, stride 2": lambda: arch.conv1d(c, e, x, nc.Axis("k", 3), stride=2, padding=1, batch=(b,)),
    "2-D convolution 3×3": lambda: arch.conv2d(c, e, (x, y), K3, padding="same", batch=(b,)),
    "ResNet basic block": lambda: arch.resnet_block(c, (x, y), K3, batch=(b,)),
    "U-Net, depth 2": lambda: arch.unet(i, w, o, (x, y), depth=2, batch=(b,)),
    "ViT patch embedding, 16×16": lambda: arch.patch_embedding(i, (x, y), d, patch=16, batch=(b,)),
    "ViT encoder block": lambda: arch.vit_encoder_block(t, d, h, k, f, batch=(b,)),
}


def dominant(expr: sympy.Expr) -> sympy.Expr:
    """Drop the arguments of a ``Max`` that another argument bounds coefficient by coefficient.

    Sizes are positive, so ``p ≥ q`` whenever ``p − q`` expands to non-negative coefficients.

    >>> p, q = sympy.symbols("p q", positive=True)
    >>> dominant(sympy.Max(2 * p + q, p, q))
    2*p + q
    """
    if not isinstance(expr, sympy.Max):
        return expr
    args = list(expr.args)

    def bounds(a, other):
        diff = sympy.Poly(sympy.expand(a - other))
        positive = all(isinstance(s, sympy.Symbol) and s.is_positive for s in diff.gens)
        return positive and all(coeff >= 0 for coeff in diff.coeffs())

    kept = [q for j, q in enumerate(args) if not any(bounds(p, q) and (p != q or i < j) for i, p in enumerate(args)
                                                     if i != j)]
    return sympy.Max(*kept)


def stored_activations(dg: nc.Diagram) -> sympy.Expr:
    """Values a naive backward pass keeps: every box's outputs (reshapes, renames and casts excepted)."""
    free = (Reshape, Cast, Rename)
    return sympy.Add(*(w.size for box in dg.boxes if isinstance(box, nc.Generator) and not isinstance(box, free)
                       for w in box.cod.inside))


def row(name: str, dg: nc.Diagram) -> dict:
    r = cost(dg, H100)
    contraction = sympy.Add(*r.tensor_flops.values())
    return {
        "architecture": name,
        "forward FLOPs": sympy.factor(r.flops),
        "transcendentals": sympy.factor(r.transcendentals),
        "backward FLOPs (contractions, 2×)": sympy.factor(2 * contraction),
        "H100 roofline, µs": r.number("time", **SIZES) * 1e6,
        "peak HBM values": dominant(r.memory[nc.HBM]),
        "stored activations": sympy.factor(stored_activations(dg)),
        "HBM bytes, unfused": sympy.factor(r.hbm_bytes),
        "peak HBM, MB": float(r.subs(**SIZES).memory_bytes[nc.HBM]) / 1e6,
    }


TIME = ("architecture", "forward FLOPs", "transcendentals", "backward FLOPs (contractions, 2×)", "H100 roofline, µs")
SPACE = ("architecture", "stored activations", "HBM bytes, unfused", "peak HBM, MB", "peak HBM values")


def table() -> list[dict]:
    return [row(name, build()) for name, build in TABLE.items()]


def markdown(rows: list[dict], cols=TIME) -> str:
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else f"`{v}`" if isinstance(v, sympy.Basic) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(fmt(r[c_]) for c_ in cols) + " |" for r in rows]
    return "\n".join(lines)


# --- the README -----------------------------------------------------------------------------------------

INTRO = """# Neural Circuit Diagrams, reproduced

*Neural Circuit Diagrams* (Abbott, TMLR 2024) draws deep-learning architectures as string diagrams whose
wires are axes, and claims the pictures correspond closely to code. napkin-cat makes the claim checkable:
each architecture below is a `napkin_cat` diagram, built by the code beside its picture, whose reference
semantics `nc.to_jax` is tested against an independent hand-written JAX / `jax.lax` implementation over
random sizes (`tests/test_architectures.py`); its cost comes from the cost functor `napkin_cat._cost`.

Regenerate everything (pictures, table, this file) with
`python -m papers.neural_circuit_diagrams.figures`.

Conventions. Arrays are channels-first (`X[i, x, y]`, weights `W[o, i, kx, ky]`, as `jax.lax` and torch).
The first input of each architecture is the data, the others are its weights; `batch=(b,)` weaves the
data over `b` and leaves the weights shared (`napkin_cat.architectures.weave`). A weight's two channel
axes need two names, so a convolution from `c` to `c` channels goes through `c_h` (`hidden`).
Self-attention names the key/value copy of the sequence axis `n_kv` (a free `rename` box).
"""

NOTES = """
How to read the table. All figures are symbolic in the axis sizes, batched over `b` with shared weights,
computed by `napkin_cat._cost.cost(diagram, H100)` on the unscheduled diagram (each box a kernel of its
own, reading its inputs from HBM and writing its outputs back):

* *forward FLOPs* and *transcendentals*: the sum of the generators' costs (a contraction or convolution
  costs 2 FLOPs per multiply-add, FAN's rule);
* *peak HBM values*: the largest column of the diagram (the values alive at once), arguments of the `Max`
  that another argument bounds coefficient-wise dropped;
* *HBM bytes, unfused*: what the naive one-kernel-per-box schedule reads and writes (f32);
* *backward FLOPs (contractions, 2×)*: **an estimate, not a derived backward diagram** — twice the forward
  FLOPs of the contractions and convolutions (each has two input gradients, each a contraction of the
  same size); the backward cost of elementwise maps, reductions and softmax is not included. Deriving
  the backward diagram from each generator's derivative is the training part of the lowering issue;
* *stored activations*: the values a naive backward pass keeps, every box's outputs (reshapes, renames
  and casts are free views);
* *H100 roofline* and *peak HBM, MB*: the cost functor's roofline lower bound (µs) and its peak HBM bytes at
  the example sizes `{sizes}` (`w` is the U-Net's base width, `t` the ViT's tokens, 14² + 1 for a 224²
  image in 16² patches).
"""


def readme(rows: list[dict]) -> str:
    parts = [INTRO, "## The architectures\n"]
    for fn in FIGURES:
        title = fn.__name__.replace("_", " ")
        parts.append(
            f"### {title}\n\n<table><tr><td>\n\n```python\n{source(fn)}\n```\n\n</td><td>\n\n"
            f"![{title}]({fn.__name__}.png)\n\n</td></tr></table>\n"
        )
    parts += ["## Time complexity\n", markdown(rows, TIME), "\n## Space complexity\n", markdown(rows, SPACE),
              NOTES.format(sizes=SIZES)]
    return "\n".join(parts)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", action="store_true", help="print the complexity table only")
    args = parser.parse_args(argv)
    rows = table()
    if args.table:
        print(markdown(rows, TIME), markdown(rows, SPACE), sep="\n\n")
        return
    for fn in FIGURES:
        draw(fn(), HERE / f"{fn.__name__}.png", title=fn.__name__.replace("_", " "))
    (HERE / "README.md").write_text(readme(rows))


if __name__ == "__main__":
    main()
