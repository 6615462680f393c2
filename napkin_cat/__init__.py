"""napkin-cat: string diagrams for deep learning, verified relabellings, sympy costs, Pallas kernels.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> print(attn.dom, "→", attn.cod)
q×d ⊗ x×d ⊗ x×d → q×d

Five names are application entries rather than the language: ``nc.attention(q, k, v, ...)``, the drop-in
for ``jax.nn.dot_product_attention`` (:mod:`lowering._attention`), ``nc.decode_attention(q, k_cache,
v_cache, lengths)`` and ``nc.mla_decode_attention`` (:mod:`lowering._decode`),
``nc.linear_cross_entropy(h, w, labels)``, a classifier head's loss without its logits
(:mod:`lowering._cross_entropy`), and ``nc.rms_norm_linear(x, g, w)``, an RMS norm fused into the projection
after it (:mod:`lowering._rms_norm_linear`), loaded on first use so that importing napkin_cat never imports the
lowering.
"""

# Pallas' fuser defines a jax config that is part of every trace's context, and Pallas imports it lazily, inside a
# kernel's first trace: a function the user jitted before would then trace once more on its next call (a whole
# model's generate loop: 2.6 s of 14 s, tiny config on CPU). Imported with napkin_cat (0.3 s), it is defined first.
import jax.experimental.pallas.fuser  # noqa: F401

from napkin_cat import architectures, hardware, library, optimize
from napkin_cat._cost import Cost, cost
from napkin_cat._mesh import MeshCost, StrategyChoice, choose_exchange, choose_strategy, fit_link, mesh_cost
from napkin_cat._reverse import NoDerivative, Tape, derivative, pullback, reverse
from napkin_cat.affine_masks import and_masks, as_affine, or_masks
from napkin_cat.axes import Axis, axes
from napkin_cat.block_masks import BlockMask, block_mask
from napkin_cat.convolution import concat, conv, rename
from napkin_cat.diagram import Array, Box, Diagram, Template, Ty, copy, discard, id, swap  # noqa: A004
from napkin_cat.drawing import draw, draw_equation, draw_sequence
from napkin_cat.dtypes import Dtype, bf16, f16, f32, fp8_e4m3, fp8_e5m2
from napkin_cat.errors import AxisError, CompositionError, CostError, EvaluationError, NapkinError
from napkin_cat.generators import (
    Context,
    Generator,
    Rope,
    add,
    cast,
    causal_mask,
    contract,
    divide,
    elementwise,
    exp,
    gelu,
    hadamard,
    log,
    mask,
    merge,
    move,
    multiply,
    normalised_contract,
    reduce_max,
    reduce_min,
    reduce_sum,
    relu,
    rotary,
    rsqrt,
    scale,
    score_mod,
    silu,
    softmax,
    softmax_contract,
    split,
    sqrt,
    square,
    subtract,
    tanh,
)
from napkin_cat.levels import HBM, L2, REG, SMEM, TC, Level
from napkin_cat.semantics import to_jax

__all__ = [
    "MeshCost", "StrategyChoice", "choose_exchange", "choose_strategy", "fit_link", "mesh_cost",  # (napkin_cat._mesh)
    "and_masks", "as_affine", "or_masks",  # masks of linear inequalities (napkin_cat.affine_masks)
    "BlockMask", "block_mask",  # a mask's blocks, computed ahead (napkin_cat.block_masks)
    "Array", "Axis", "AxisError", "Box", "CompositionError", "Context", "Cost", "CostError", "Diagram", "Dtype",
    "EvaluationError", "Generator", "HBM", "L2", "Level", "NapkinError", "NoDerivative", "REG", "Rope", "SMEM",
    "TC", "Tape", "Template", "Ty", "add", "architectures", "axes", "bf16", "cast", "causal_mask", "concat", "contract",
    "conv", "copy", "cost", "derivative", "discard", "divide", "draw", "draw_equation", "draw_sequence",
    "elementwise", "exp", "f16", "f32", "fp8_e4m3", "fp8_e5m2", "gelu", "hadamard", "hardware", "id", "library", "log",
    "mask", "merge", "move", "multiply", "normalised_contract", "optimize", "pullback", "reduce_max", "reduce_min",
    "reduce_sum", "relu", "rename", "reverse", "rotary", "rsqrt", "scale", "score_mod", "silu", "softmax",
    "softmax_contract", "split", "sqrt", "square", "subtract", "swap", "tanh", "to_jax",
]


def __getattr__(name: str):
    """``attention``, the drop-in entry, ``decode_attention`` and ``mla_decode_attention`` (split-KV decoding),
    ``linear_cross_entropy`` (a classifier head's loss), ``rms_norm_linear`` (a norm fused into its projection) and
    ``fp8_quantize`` (q, k, v to e4m3 with their scales), imported from :mod:`lowering` when first asked for.

    >>> import napkin_cat as nc
    >>> from lowering import attention
    >>> nc.attention is attention
    True
    """
    names = ("attention", "decode_attention", "mla_decode_attention", "linear_cross_entropy", "rms_norm_linear",
             "fp8_quantize")
    if name in names:
        import lowering

        return getattr(lowering, name)
    raise AttributeError(f"module 'napkin_cat' has no attribute {name!r}")
