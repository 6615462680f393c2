"""The public testing API: prove your own rewrites in your own tests.

* hypothesis strategies for axes, sizes, dtypes, arrays and random well-typed diagrams built from the
  generators (in the spirit of catgrad's ``tests/strategies.py``), and for rules that may or may not
  apply to them;
* :func:`assert_equivalent` — property-based: the scheduled semantics of one diagram equals the
  reference semantics of the other at random ragged sizes, within the dtype's tolerance;
* :func:`prove_equivalent` — the symbolic proof at small concrete sizes (from :mod:`rewrites._proofs`).

>>> import napkin_cat as nc
>>> from rewrites import tile, stream
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> [r.passed for r in assert_equivalent(attn, stream(x, 2)(tile(q, 2)(attn)), examples=2, seed=0)]
[True, True]
>>> print(prove_equivalent(attn, stream(x, 2)(attn), sizes={"q": 1, "x": 3, "d": 1}))
proved: the two diagrams are equal, at q=1, x=3, d=1 (1 identities, 1 case)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import sympy
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Diagram
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import bf16, f16, f32
from rewrites._proofs import Proof, prove_accumulator, prove_equivalent, prove_monoid
from rewrites._rule import RewriteError, Rule, axis_names
from rewrites._schedule import partitions
from rewrites._stream import stream
from rewrites._tile import tile
from rewrites._verify import Verification, check, sample_sizes

__all__ = [
    "Proof",
    "SoftmaxPath",
    "arrays",
    "assert_equivalent",
    "axes",
    "diagrams",
    "dtypes",
    "prove_accumulator",
    "prove_equivalent",
    "prove_monoid",
    "rules",
    "sizes",
    "softmax_paths",
]

NAMES = ("r", "c", "k")


def axes(names: tuple[str, ...] = NAMES, *, max_size: int = 9, symbolic: bool = True) -> st.SearchStrategy:
    """Distinct axes named from ``names``, symbolic (sizes bound later) or with concrete sizes.

    >>> from hypothesis import given
    >>> @given(axes(symbolic=False))
    ... def test(a): assert 1 <= a.size <= 9
    >>> test()
    """
    if symbolic:
        return st.sampled_from(names).map(Axis)
    return st.builds(Axis, st.sampled_from(names), st.integers(1, max_size))


def dtypes(*choices) -> st.SearchStrategy:
    """Input dtypes (default: f32, bf16, f16).

    >>> from hypothesis import given
    >>> @given(dtypes(f32, bf16))
    ... def test(dt): assert dt in (f32, bf16)
    >>> test()
    """
    return st.sampled_from(choices or (f32, bf16, f16))


def sizes(d: Diagram, *, max_size: int = 7) -> st.SearchStrategy:
    """Concrete sizes for ``d``'s symbolic axes: at least one more than the axis's tile or stream
    (so at least two pieces, often ragged), else 1 to ``max_size``.

    >>> from hypothesis import given
    >>> q, d = (Axis(n) for n in "qd")
    >>> @given(sizes(tile(q, 4)(nc.reduce_sum(Array(q, d), d))))
    ... def test(at): assert 5 <= at[q.size] <= 13 and 1 <= at[d.size] <= 7
    >>> test()
    """
    tiles, streams = partitions(d)
    out = {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            for s in a.size.free_symbols:
                unit = max(tiles.get(a.name, 1), streams.get(a.name, 1))
                out[s] = st.integers(unit + 1, 3 * unit + 1) if unit > 1 else st.integers(1, max_size)
    return st.fixed_dictionaries(out)


def arrays(wire: Array, bound: dict) -> st.SearchStrategy:
    """Random arrays of type ``wire`` at sizes ``bound`` (normals from a drawn seed, in the wire's dtype).

    >>> from hypothesis import given, settings
    >>> q, d = Axis("q"), Axis("d")
    >>> @settings(max_examples=3, deadline=None)
    ... @given(arrays(Array(q, d, dtype=bf16), {q.size: 3, d.size: 2}))
    ... def test(a): assert a.shape == (3, 2) and a.dtype == jnp.bfloat16
    >>> test()
    """
    shape = tuple(int(a.size.subs(bound)) for a in wire.axes)
    return st.integers(0, 2**31 - 1).map(
        lambda seed: jax.random.normal(jax.random.key(seed), shape).astype(wire.dtype.jnp)
    )


# --- random diagrams -------------------------------------------------------------------------

_UNARY = ("tanh", "relu", "neg", "square", "sigmoid")


@st.composite
def diagrams(draw, *, max_boxes: int = 4, dtype=None) -> Diagram:
    """Random well-typed diagrams ``X[r,c] ⊗ side inputs → Y``: pointwise maps, broadcasts of side
    inputs, masks, softmaxes, reductions and contractions over ``c``, in random order.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(diagrams())
    ... def test(d): assert d.cod.inside[0].has("r")
    >>> test()
    """
    r, c, k = (Axis(n) for n in NAMES)
    dt = draw(dtypes()) if dtype is None else nc.dtypes.dtype(dtype)
    X = Array(r, c, dtype=dt)
    d = nc.cast(X, f32) if dt != f32 else identity(X)
    for _ in range(draw(st.integers(1, max_boxes))):
        d = _grow(draw, d, r, c, k)
        if not d.cod.inside[0].has("c"):
            break
    return d


def _grow(draw, d: Diagram, r: Axis, c: Axis, k: Axis) -> Diagram:
    """One more box on the main (first) output wire, feeding side inputs from new input wires."""
    main = d.cod.inside[0]
    options = ["unary", "scale", "side"]
    if main.has("c"):
        options += ["sum", "max", "softmax", "contract", "softmax_contract", "mask"]
    kind = draw(st.sampled_from(options))
    if kind == "unary":
        return d >> nc.elementwise(draw(st.sampled_from(_UNARY)), main)
    if kind == "scale":
        return d >> nc.scale(main, draw(st.sampled_from([sympy.Rational(1, 2), 2, -1])))
    if kind == "side":
        side = Array(main.axes[-1])
        return (d @ identity(side)) >> nc.elementwise(draw(st.sampled_from(["add", "multiply"])), main, side)
    if kind in ("sum", "max"):
        return d >> (nc.reduce_sum if kind == "sum" else nc.reduce_max)(main, c)
    if kind == "softmax":
        return d >> nc.softmax(main, c)
    if kind == "mask":  # followed by a softmax, so that no −∞ reaches an output
        return d >> nc.causal_mask(main, r, c) >> nc.softmax(main, c)
    names = " ".join(main.names)
    out = " ".join(n for n in main.names if n != "c") + " k"
    W = Array(c, k)
    contraction = nc.contract(f"{names}, c k -> {out}", r, c, k)
    if kind == "softmax_contract":
        return (d @ identity(W)) >> (nc.softmax(main, c) @ identity(W)) >> contraction
    return (d @ identity(W)) >> contraction


class SoftmaxPath(NamedTuple):
    """A diagram ``S[r,c] ⊗ W[c,k] → O[r,k]`` from :func:`softmax_paths`, with what a test needs to judge it.

    ``reference(S, W)`` computes it with ``jax.numpy``/``jax.nn`` alone (no generator's semantics);
    ``between`` names the boxes drawn between the softmax and the contraction; ``licensed`` says whether
    FAN's softmax-contraction lemma covers them (only swaps and constant scales), i.e. whether ``stream``
    along ``c`` must accept the diagram.

    >>> r, c, k = (Axis(n) for n in NAMES)
    >>> d = nc.softmax(Array(r, c), c) @ identity(Array(c, k)) >> nc.contract("r c, c k -> r k", r, c, k)
    >>> path = SoftmaxPath(d, lambda s, w: jax.nn.softmax(s, axis=1) @ w, (), True)
    >>> print(path.diagram.cod, path.licensed)
    r×k True
    """

    diagram: Diagram
    reference: Callable
    between: tuple[str, ...]
    licensed: bool


#: what may come between the softmax and the contraction: name, licensed by the lemma, reference map
_BETWEEN = {
    "scale 2": (True, lambda p: p * 2),
    "scale -1/2": (True, lambda p: p * -0.5),
    "neg": (True, jnp.negative),
    "divide 4": (True, lambda p: p / 4),
    "swap": (True, None),
    "tanh": (False, jnp.tanh),
    "square": (False, jnp.square),
    "copy, add": (False, lambda p: p + p),
}


@st.composite
def softmax_paths(draw, *, max_between: int = 3) -> SoftmaxPath:
    """Random softmaxes over ``c`` whose output reaches a contraction over ``c`` through up to ``max_between``
    boxes: constant scales, negation, division by a constant, swaps of the two wires (as a ``Circuit``
    inserts), nonlinear maps and a copy; an optional causal mask before the softmax, bf16 or f32 scores,
    the softmax as either operand of the contraction, which may carry its own scale.

    >>> from hypothesis import given, settings
    >>> @settings(max_examples=5, deadline=None)
    ... @given(softmax_paths())
    ... def test(path): assert path.licensed == all(_BETWEEN[b][0] for b in path.between)
    >>> test()
    """
    r, c, k = (Axis(n) for n in NAMES)
    dt = draw(st.sampled_from([f32, bf16]))
    S, P, W = Array(r, c, dtype=dt), Array(r, c), Array(c, k)
    causal = draw(st.booleans())
    d = (nc.causal_mask(S, r, c) >> nc.softmax(S, c)) if causal else nc.softmax(S, c)
    d, first = d @ identity(W), True  # ``first``: the softmax's wire is left of W
    between = tuple(draw(st.lists(st.sampled_from(sorted(_BETWEEN)), max_size=max_between)))
    make = {
        "scale 2": lambda: nc.scale(P, 2),
        "scale -1/2": lambda: nc.scale(P, sympy.Rational(-1, 2)),
        "neg": lambda: nc.elementwise("neg", P),
        "divide 4": lambda: nc.elementwise("divide", P, const=4),
        "tanh": lambda: nc.tanh(P),
        "square": lambda: nc.square(P),
        "copy, add": lambda: nc.copy(P) >> nc.add(P, P),
    }
    for b in between:
        if b == "swap":
            d, first = d >> (nc.swap(P, W) if first else nc.swap(W, P)), not first
        else:
            d = d >> ((make[b]() @ identity(W)) if first else (identity(W) @ make[b]()))
    factor = draw(st.sampled_from([None, sympy.Rational(1, 3)]))
    spec = "r c, c k -> r k" if first else "c k, r c -> r k"
    d = d >> nc.contract(spec, r, c, k, scale=factor)

    def reference(s, w):
        s = s.astype(jnp.float32)
        if causal:
            rows, cols = jnp.arange(s.shape[0])[:, None], jnp.arange(s.shape[1])[None, :]
            s = jnp.where(cols <= rows, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=1)
        for b in between:
            p = p if b == "swap" else _BETWEEN[b][1](p)
        return jnp.einsum("rc,ck->rk", p, w) * (1.0 if factor is None else float(factor))

    return SoftmaxPath(d, reference, between, all(_BETWEEN[b][0] for b in between))


@st.composite
def rules(draw, d: Diagram, *, max_size: int = 4) -> Rule:
    """A random ``tile`` or ``stream`` of an axis of ``d`` (it may be refused: that is part of the test).

    >>> from hypothesis import given, settings
    >>> attn = nc.library.attention(*nc.axes("q x d"))
    >>> @settings(max_examples=5, deadline=None)
    ... @given(rules(attn, max_size=4))
    ... def test(rule): assert isinstance(rule, tile | stream) and repr(rule)[-2] in "1234"
    >>> test()
    """
    name = draw(st.sampled_from(sorted(axis_names(d))))
    size = draw(st.integers(1, max_size))
    return draw(st.sampled_from([tile(name, size), stream(name, size)]))


# --- assertions ------------------------------------------------------------------------------


def assert_equivalent(
    d1: Diagram, d2: Diagram, *, examples: int = 3, seed: int | None = None, sizes: dict | None = None
) -> list[Verification]:
    """Assert that ``d2``'s scheduled semantics equals ``d1``'s reference semantics on ``examples``
    random inputs at random ragged sizes (or at ``sizes``), within the dtype-aware tolerance of
    :data:`rewrites._verify.TOLERANCE`. Returns the verification records; raises ``AssertionError``
    naming the sizes and the seed that failed.

    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> assert_equivalent(nc.reduce_sum(nc.Array(n), n), nc.reduce_max(nc.Array(n), n), seed=1)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AssertionError: assert_equivalent: the rewritten diagram differs from the original: FAILED: ...
    """
    seed = random.SystemRandom().randrange(2**31) if seed is None else seed
    records = []
    for i in range(examples):
        rng = random.Random(seed + i)
        at = sizes if sizes is not None else sample_sizes(d2, rng, small=6)
        try:
            records.append(check(d1, d2, seed=seed + i, sizes=at, rule="assert_equivalent"))
        except RewriteError as err:
            raise AssertionError(str(err)) from err
    return records
