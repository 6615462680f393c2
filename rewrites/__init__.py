"""Relabellings as verified functors: tile, split, stream, recolour; derivations and their verification.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64))
>>> print(flash.diagram.cod)
q/128×d
"""

from rewrites._derive import Derivation, Step, derive
from rewrites._device import (
    DeviceDerivation,
    DeviceRule,
    DeviceStep,
    Sequence,
    Sharded,
    chunking,
    derive_devices,
    execute_devices,
    has_causal_mask,
    heads_refusal,
    merge_lse,
    pair_diagrams,
    ring,
    shard,
    summed,
    ulysses,
    zigzag,
)
from rewrites._factor import factor_row_scale
from rewrites._incoherent import incoherent
from rewrites._io_aware import (
    Residual,
    constant_weight_lemma,
    delta_lemma,
    lse_residual,
    narrow_operands,
    prove_lemmas,
    reduced,
    row_weight_lemma,
    widened,
)
from rewrites._level import level
from rewrites._lowering_rules import LOG2E, Neutral, base2, neutral_padding, pad_neutral, tiled_first
from rewrites._proofs import Proof, prove_accumulator, prove_equivalent, prove_monoid
from rewrites._pseudocode import pseudocode
from rewrites._rule import AUTO, AxisRule, OpenSize, RewriteError, Rule, bind_sizes, open_sizes, resolve
from rewrites._schedule import execute, partitions, summed_outputs, walk
from rewrites._split import split
from rewrites._split_kv import choose_parts, merge_parts, prove_merge, split_kv, with_lse
from rewrites._stream import fuse_softmax, fuse_softmax_contract, stream, streamability
from rewrites._tile import tile
from rewrites._verify import Trial, Verification, random_inputs, relative_error, tolerance

__all__ = [
    "DeviceDerivation", "DeviceRule", "DeviceStep", "Sequence", "Sharded", "chunking", "derive_devices",  # devices
    "execute_devices", "has_causal_mask", "heads_refusal", "merge_lse", "pair_diagrams", "ring",  # (rewrites._device)
    "shard", "summed", "ulysses", "zigzag",
    "LOG2E", "Neutral", "base2", "fuse_softmax", "neutral_padding", "pad_neutral", "tiled_first",  # (lowering rules)
    "AUTO", "AxisRule", "Derivation", "OpenSize", "Proof", "Residual", "RewriteError", "Rule", "Step", "Trial",
    "Verification",
    "bind_sizes", "constant_weight_lemma", "delta_lemma", "derive", "execute", "fuse_softmax_contract", "level",
    "lse_residual", "narrow_operands", "open_sizes", "partitions", "prove_accumulator", "prove_equivalent",
    "prove_lemmas", "prove_monoid", "pseudocode", "random_inputs", "reduced", "relative_error", "resolve",
    "row_weight_lemma", "split", "stream", "streamability", "summed_outputs", "tile", "tolerance", "walk", "widened",
    "choose_parts", "merge_parts", "prove_merge", "split_kv", "with_lse",  # split-KV (rewrites._split_kv)
    "factor_row_scale",  # a row scaling moved after a contraction (rewrites._factor)
    "incoherent",  # the Hadamard rotation of a contraction's operands (rewrites._incoherent)
]
