"""Generators: the boxes diagrams are built from. Each is one class carrying everything about it.

Every generator is polymorphic in its axes: its semantics is written over *named* axes, so weaving
(prepending axes to every wire) and the partition labels need nothing from the generator itself.
A generator declares

* ``evaluate(inputs, ctx)`` — its semantics, written once against the array namespace ``ctx.xp``
  (JAX for ``to_jax``, blocks in a kernel, sympy object arrays in the proofs);
* ``flops()``, ``transcendentals()``, ``tensor_flops()`` — its cost, sympy expressions in the sizes;
* ``accumulator(axis)`` — where it is streamable along ``axis`` (FAN §3), its accumulator;
* ``backward(tape, ins, outs, cts)`` — its derivative, as boxes on the reverse-mode tape;
* ``family``, ``symbol``, ``lines(prog, ins, outs)`` — its picture and its pseudocode;
* ``contracts``, ``transfers``, ``diagonal()``, ``in_base2(scale)``, ``passes_base()``, ``scaled(c)``,
  ``unscaled()`` — what a backend needs to lower it.

One module per concept: contraction, elementwise maps and casts, index maps and masks, reductions,
the softmax family, attention dropout, rotary position embeddings, structure (reshapes, moves).

>>> from napkin_cat import axes, Array
>>> q, x, d = axes("q x d")
>>> s = contract("q d, x d -> q x", q, x, d)
>>> print(s.dom, "→", s.cod)
q×d ⊗ x×d → q×x
>>> s.flops(), s.family
(2*d*q*x, 'contraction')
"""

from napkin_cat.generators._arrays import JAX, SYMPY, Jax, Sympy
from napkin_cat.generators._base import (
    Accumulator,
    Context,
    Generator,
    NoDerivative,
    Own,
    align,
    contraction_size,
    einsum_spec,
    fname,
    heads,
)
from napkin_cat.generators._contraction import Contract, ContractionSum, contract
from napkin_cat.generators._dropout import Drop, Dropout, check_rate, dropout, keep_bits
from napkin_cat.generators._elementwise import (
    ELEMENTWISE,
    Cast,
    Elementwise,
    Partial,
    add,
    cast,
    divide,
    elementwise,
    exp,
    gelu,
    log,
    multiply,
    relu,
    rsqrt,
    scale,
    silu,
    sqrt,
    square,
    subtract,
    tanh,
)
from napkin_cat.generators._hadamard import Hadamard, hadamard
from napkin_cat.generators._index import (
    FLEX_INDICES,
    Captured,
    Causal,
    IndexMap,
    Kept,
    Mask,
    Positional,
    ScoreDerivative,
    causal_mask,
    depends_on,
    index_names,
    mask,
    positional,
    score_mod,
)
from napkin_cat.generators._reduce import Monoid, Reduce, attains, broadcast, reduce_max, reduce_min, reduce_sum
from napkin_cat.generators._rotary import Rope, Rotary, rotary
from napkin_cat.generators._softmax import (
    NormalisedContract,
    NormalisedContraction,
    OnlineSoftmax,
    Softmax,
    SoftmaxContract,
    normalised_contract,
    softmax,
    softmax_contract,
)
from napkin_cat.generators._structure import Move, Reshape, merge, move, split
from napkin_cat.generators._vectors import Later, Unvectorised, Vector, evaluated, on_blocks, on_vectors, plain

__all__ = [
    "FLEX_INDICES",
    "Captured",
    "ELEMENTWISE",
    "JAX",
    "SYMPY",
    "Accumulator",
    "Cast",
    "Causal",
    "Context",
    "Contract",
    "Drop",
    "Dropout",
    "ContractionSum",
    "Elementwise",
    "Generator",
    "Hadamard",
    "IndexMap",
    "Jax",
    "Kept",
    "Later",
    "Mask",
    "Monoid",
    "Move",
    "NoDerivative",
    "NormalisedContract",
    "NormalisedContraction",
    "OnlineSoftmax",
    "Own",
    "Partial",
    "Positional",
    "Reduce",
    "Reshape",
    "Rope",
    "Rotary",
    "ScoreDerivative",
    "Softmax",
    "SoftmaxContract",
    "Sympy",
    "Unvectorised",
    "Vector",
    "add",
    "align",
    "attains",
    "broadcast",
    "cast",
    "causal_mask",
    "check_rate",
    "index_names",
    "keep_bits",
    "contract",
    "contraction_size",
    "depends_on",
    "divide",
    "dropout",
    "einsum_spec",
    "elementwise",
    "evaluated",
    "exp",
    "fname",
    "gelu",
    "hadamard",
    "heads",
    "log",
    "mask",
    "merge",
    "move",
    "multiply",
    "normalised_contract",
    "on_blocks",
    "on_vectors",
    "plain",
    "positional",
    "reduce_max",
    "reduce_min",
    "reduce_sum",
    "relu",
    "rotary",
    "rsqrt",
    "scale",
    "score_mod",
    "silu",
    "softmax",
    "softmax_contract",
    "split",
    "sqrt",
    "square",
    "subtract",
    "tanh",
]
