"""Symbolic proofs at small concrete sizes: verification strength (c) of DESIGN.md.

Both sides are evaluated in a sympy semantics — every array element a sympy expression in symbols
standing for the input elements — and each output element's difference is simplified to 0. The
scheduled semantics runs here too (tiles sliced and concatenated, streams folded through the
accumulators, ragged last pieces included), so a proof covers the relabelling and the accumulator.

Simplification: every ``exp(u)`` is split into a product of ``exp`` of the atoms of ``u`` (a running
max ``Max(…)`` is one atom), so the rescalings of the online softmax cancel as rational functions;
whatever ``Max`` is left is case-split (each replaced by each of its arguments in turn), which
covers every ordering of the scores.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> box = nc.library.attention(q, x, d).boxes[1]          # the softmax
>>> sc = nc.softmax_contract(box.dom.inside[0], nc.Array(x, d), x, nc.Array(q, d))
>>> proof = prove_accumulator(sc, "x", sizes={"q": 1, "x": 3, "d": 1})
>>> print(proof.claim)
finalize(combine(partial(a), partial(b))) = softmax·contract x(a ⊕ b) and the fused step
>>> proof.identities, proof.cases
(2, 1)

Users extend the sympy semantics of their own generators by giving them ``evaluate_symbolic(ins, ctx)``
(numpy object arrays in, a list of them out) and their accumulators ``partial_symbolic``,
``combine_symbolic`` and ``finalize_symbolic`` (see ``docs/user_rewrites.md``).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import sympy
from discopy import markov

from napkin_cat.accumulators import ContractionSum, Monoid, NormalisedContraction, OnlineSoftmax
from napkin_cat.diagram import Array, Diagram, Ty
from napkin_cat.generators import (
    Cast,
    Context,
    Contract,
    Elementwise,
    Generator,
    IndexMap,
    Mask,
    Move,
    NormalisedContract,
    Reduce,
    Reshape,
    Softmax,
    SoftmaxContract,
    einsum_spec,
)
from rewrites.rule import RewriteError
from rewrites.schedule import partitions

#: the largest axis size a default proof uses (larger tiles or streams need explicit ``sizes``)
MAX_SIZE = 8
#: the most cases a proof may split into
MAX_CASES = 4096


@dataclass(frozen=True)
class Proof:
    """The record of a symbolic proof: the claim, the sizes, how many scalar identities and cases."""

    claim: str
    sizes: dict
    identities: int
    cases: int
    seconds: float

    def __str__(self):
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        cases = f"{self.cases} case{'s' if self.cases != 1 else ''}"
        return f"proved: {self.claim}, at {sizes} ({self.identities} identities, {cases})"


# --- the sympy semantics of the generators ---------------------------------------------------

SYMPY_FN: dict[str, Callable] = {
    "exp": sympy.exp, "log": sympy.log, "tanh": sympy.tanh, "sqrt": sympy.sqrt,
    "sigmoid": lambda v: 1 / (1 + sympy.exp(-v)),
    "gelu": lambda v: v / 2 * (1 + sympy.erf(v / sympy.sqrt(2))),
    "silu": lambda v: v / (1 + sympy.exp(-v)),
    "relu": lambda v: sympy.Max(0, v), "neg": lambda v: -v, "square": lambda v: v**2,
    "rsqrt": lambda v: 1 / sympy.sqrt(v), "reciprocal": lambda v: 1 / v,
    "add": lambda a, b: a + b, "subtract": lambda a, b: a - b, "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b, "maximum": sympy.Max,
}
JAX_FN = {jnp.exp: sympy.exp, jnp.log: sympy.log, jnp.tanh: sympy.tanh, jnp.sqrt: sympy.sqrt,
          jnp.square: lambda v: v**2, jax.nn.sigmoid: SYMPY_FN["sigmoid"]}
REDUCE = {"sum": lambda a, b: a + b, "max": sympy.Max, "min": sympy.Min}
UNIT = {"sum": sympy.Integer(0), "max": -sympy.oo, "min": sympy.oo}


def _map(f: Callable, *arrays):
    arrays = [_as(a) for a in arrays]
    if any(a.ndim for a in arrays):
        return _as(np.frompyfunc(f, len(arrays), 1)(*arrays))
    return np.array(f(*(a[()] for a in arrays)), dtype=object)


def _as(value) -> np.ndarray:
    return np.asarray(value, dtype=object)


def _symbolic_fn(f, box) -> Callable:
    if isinstance(f, str):
        return SYMPY_FN[f]
    if f in JAX_FN:
        return JAX_FN[f]
    return f  # a user's callable: it must accept sympy expressions


def _align(value, wire: Array, target: Array):
    """Broadcast ``value`` (laid out as ``wire``) to ``target``'s axis order, by name (numpy)."""
    order = [wire.names.index(n) for n in target.names if n in wire.names]
    value = np.transpose(_as(value), order)
    return np.expand_dims(value, [i for i, n in enumerate(target.names) if n not in wire.names])


def _reduce(op: str, value, i: int):
    return _as(np.frompyfunc(REDUCE[op], 2, 1).reduce(_as(value), axis=i))


def _einsum(dom: Ty, out: Array, *ins):
    return _as(np.einsum(einsum_spec(dom, out), *map(_as, ins), optimize=False))


def _softmax(s, i: int):
    e = _map(sympy.exp, s)
    return e / np.expand_dims(_reduce("sum", e, i), i)


def _scaled(box, value, ctx: Context):
    scale = box.params.get("scale")
    return value if scale is None else value * sympy.sympify(scale).subs(ctx.sizes)


def _contract(box, ins, ctx):
    return [_scaled(box, _einsum(box.dom, box.out, *ins), ctx)]


def _elementwise(box, ins, ctx):
    p = box.params
    f = _symbolic_fn(p["fn"], box)
    args = [_align(v, w, box.out) for v, w in zip(ins, box.dom.inside, strict=True)]
    shape = np.broadcast_shapes(*(a.shape for a in args))
    args = [np.broadcast_to(a, shape) for a in args]
    if "const" in p:
        args.append(np.full(args[0].shape, sympy.sympify(p["const"]).subs(ctx.sizes), dtype=object))
    return [_map(f, *args)]


def _shape(wire: Array, ctx: Context) -> tuple:
    return tuple(int(ctx.number(a.size)) for a in wire.axes)


def _indices(wire: Array, shape: tuple, ctx: Context) -> dict:
    grids = np.indices(shape) if shape else []
    return {a.name: grids[i] + ctx.offsets.get(a.name, 0) for i, a in enumerate(wire.axes)}


def _mask(box, ins, ctx):
    (v,) = ins
    keep = np.asarray(box.params["mask"](**_indices(box.dom.inside[0], v.shape, ctx)))
    return [np.where(np.broadcast_to(keep, v.shape), v, -sympy.oo)]


def _index_map(box, ins, ctx):
    (v,) = ins
    idx = _indices(box.dom.inside[0], v.shape, ctx)
    fn = box.params["fn"]
    out = np.empty(v.shape, dtype=object)
    for pos in np.ndindex(*v.shape):
        out[pos] = sympy.sympify(fn(v[pos], **{k: int(g[pos]) for k, g in idx.items()}))
    return [out]


def _reduce_box(box, ins, ctx):
    return [_reduce(box.params["op"], ins[0], box.dom.inside[0].names.index(box.params["axis"]))]


def _softmax_box(box, ins, ctx):
    return [_softmax(ins[0], box.dom.inside[0].names.index(box.params["axis"]))]


def _softmax_contract(box, ins, ctx):
    s, v = ins
    p = _softmax(s, box.dom.inside[0].names.index(box.params["axis"]))
    return [_einsum(box.dom, box.out, p, v)]


def _normalised_contract(box, ins, ctx):
    acc = SymbolicNormalisedContraction(box, box.params["axis"])
    return acc.finalize(acc.partial(ins, ctx), ctx)


def _reshape(box, ins, ctx):
    (v,), wire = ins, box.dom.inside[0]
    shape = [v.shape[wire.names.index(a.name)] if wire.has(a.name) else int(ctx.number(a.size)) for a in box.out.axes]
    return [_as(v).reshape(shape)]


EVALUATE: dict[type, Callable] = {
    Contract: _contract, Elementwise: _elementwise, Mask: _mask, IndexMap: _index_map, Reduce: _reduce_box,
    Softmax: _softmax_box, SoftmaxContract: _softmax_contract, NormalisedContract: _normalised_contract,
    Reshape: _reshape, Cast: lambda box, ins, ctx: list(ins), Move: lambda box, ins, ctx: list(ins),
}


def evaluate(box, ins: list, ctx: Context) -> list:
    """One box's sympy semantics: its ``evaluate_symbolic`` if it has one, else the built-in rule."""
    if isinstance(box, markov.Swap):
        return ins[::-1]
    if isinstance(box, markov.Copy):
        return ins * len(box.cod)
    if hasattr(box, "evaluate_symbolic"):
        return [_as(v) for v in box.evaluate_symbolic(ins, ctx)]
    for cls in type(box).__mro__:
        if cls in EVALUATE:
            return EVALUATE[cls](box, ins, ctx)
    raise RewriteError("prove", "the generator has no sympy semantics (give it evaluate_symbolic)", box=box.name)


# --- the sympy accumulators ------------------------------------------------------------------


class SymbolicAccumulator:
    """The sympy twin of an accumulator: partial, combine, step, finalize on object arrays."""

    def __init__(self, box, axis: str):
        self.box, self.axis = box, axis
        self.i = box.dom.inside[0].names.index(axis) if box.dom.inside[0].has(axis) else None

    def step(self, state, ins, ctx):
        return self.combine(state, self.partial(ins, ctx))


class SymbolicMonoid(SymbolicAccumulator):
    def partial(self, ins, ctx):
        return _reduce(self.box.params["op"], ins[0], self.i)

    def combine(self, a, b):
        return _map(REDUCE[self.box.params["op"]], a, b)

    def finalize(self, state, ctx):
        return [state]

    def identity(self, like):
        return np.full(np.shape(like), UNIT[self.box.params["op"]], dtype=object)


class SymbolicContractionSum(SymbolicAccumulator):
    def partial(self, ins, ctx):
        return _einsum(self.box.dom, self.box.out, *ins)

    def combine(self, a, b):
        return a + b

    def finalize(self, state, ctx):
        return [_scaled(self.box, state, ctx)]

    def identity(self, like):
        return np.full(np.shape(like), sympy.Integer(0), dtype=object)


class SymbolicOnlineSoftmax(SymbolicAccumulator):
    """State ``(m, l, o)`` as in :class:`napkin_cat.accumulators.OnlineSoftmax`."""

    def _rows(self) -> Array:
        s = self.box.dom.inside[0]
        return s.with_(axes=[a for a in s.axes if a.name != self.axis])

    def _out(self, stat):
        return _align(stat, self._rows(), self.box.out)

    def partial(self, ins, ctx):
        s, v = ins
        m = _reduce("max", s, self.i)
        p = _map(sympy.exp, s - np.expand_dims(m, self.i))
        return m, _reduce("sum", p, self.i), _einsum(self.box.dom, self.box.out, p, v)

    def combine(self, a, b):
        (ma, la, oa), (mb, lb, ob) = a, b
        m = _map(sympy.Max, ma, mb)
        da, db = _map(sympy.exp, ma - m), _map(sympy.exp, mb - m)
        return m, la * da + lb * db, oa * self._out(da) + ob * self._out(db)

    def step(self, state, ins, ctx):
        """FlashAttention-2's fused update, as the scheduled semantics runs it."""
        m, l_, o = state
        s, v = ins
        m_new = _map(sympy.Max, m, _reduce("max", s, self.i))
        delta = _map(sympy.exp, m - m_new)
        p = _map(sympy.exp, s - np.expand_dims(m_new, self.i))
        return m_new, l_ * delta + _reduce("sum", p, self.i), o * self._out(delta) + _einsum(
            self.box.dom, self.box.out, p, v)

    def finalize(self, state, ctx):
        _, l_, o = state
        return [o / self._out(l_)]

    def identity(self, like):
        m, l_, o = like
        full = lambda x, v: np.full(np.shape(x), v, dtype=object)  # noqa: E731
        return full(m, -sympy.oo), full(l_, sympy.Integer(0)), full(o, sympy.Integer(0))


class SymbolicNormalisedContraction(SymbolicOnlineSoftmax):
    """State ``(Σ a₂(s), Σ a₁(s)·v)``, combined by addition."""

    def _fn(self, key):
        return _symbolic_fn(self.box.params[key], self.box)

    def partial(self, ins, ctx):
        s, v = ins
        return (_reduce("sum", _map(self._fn("a2"), s), self.i),
                _einsum(self.box.dom, self.box.out, _map(self._fn("a1"), s), v))

    def combine(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    step = SymbolicAccumulator.step

    def finalize(self, state, ctx):
        z, o = state
        return [o / self._out(_map(self._fn("b"), z))]

    def identity(self, like):
        return tuple(np.full(np.shape(x), sympy.Integer(0), dtype=object) for x in like)


ACCUMULATE: dict[type, type] = {
    Monoid: SymbolicMonoid, ContractionSum: SymbolicContractionSum, OnlineSoftmax: SymbolicOnlineSoftmax,
    NormalisedContraction: SymbolicNormalisedContraction,
}


class _UserAccumulator(SymbolicAccumulator):
    """A user's accumulator with ``partial_symbolic``, ``combine_symbolic``, ``finalize_symbolic``."""

    def __init__(self, acc):
        super().__init__(acc.box, acc.axis)
        self.acc = acc

    def partial(self, ins, ctx):
        return self.acc.partial_symbolic(ins, ctx)

    def combine(self, a, b):
        return self.acc.combine_symbolic(a, b)

    def finalize(self, state, ctx):
        return [_as(v) for v in self.acc.finalize_symbolic(state, ctx)]

    def identity(self, like):
        if not hasattr(self.acc, "identity_symbolic"):
            raise RewriteError("prove", "the accumulator has no identity_symbolic", box=self.box.name, axis=self.axis)
        return self.acc.identity_symbolic(like)


def symbolic_accumulator(box, axis: str) -> SymbolicAccumulator:
    """The sympy twin of ``box.accumulator(axis)``; :class:`RewriteError` if there is none."""
    acc = box.accumulator(axis) if isinstance(box, Generator) else None
    if acc is None:
        raise RewriteError("prove", f"the box has no accumulator along {axis}", box=box.name, axis=axis)
    if hasattr(acc, "partial_symbolic"):
        return _UserAccumulator(acc)
    for cls in type(acc).__mro__:
        if cls in ACCUMULATE:
            return ACCUMULATE[cls](box, axis)
    raise RewriteError("prove", f"accumulator {type(acc).__name__} has no sympy twin (give it partial_symbolic, "
                       "combine_symbolic, finalize_symbolic)", box=box.name, axis=axis)


# --- the scheduled semantics, symbolically -----------------------------------------------------


def _slice(value, wire: Array, axis: str, start: int, stop: int):
    if not wire.has(axis):
        return value
    i = wire.names.index(axis)
    return value[(slice(None),) * i + (slice(start, stop),)]


def _run(d: Diagram, values: list, ctx: Context) -> list:
    stack = list(values)
    for left, box, _ in d.inside:
        n, k = len(left), len(box.dom)
        stack[n : n + k] = evaluate(box, stack[n : n + k], ctx)
    return stack


def _walk(d: Diagram, values: list, ctx: Context, axis: str, phase: str, states: dict) -> list:
    stack = list(values)
    for i, (left, box, _) in enumerate(d.inside):
        n, k = len(left), len(box.dom)
        ins = stack[n : n + k]
        reducing = (isinstance(box, Generator) and any(w.has(axis) for w in box.dom.inside)
                    and not any(w.has(axis) for w in box.cod.inside))
        if reducing:
            acc = symbolic_accumulator(box, axis)
            if phase == "chunk":
                states[i] = acc.partial(ins, ctx) if i not in states else acc.step(states[i], ins, ctx)
                out = [None] * len(box.cod)
            else:
                out = acc.finalize(states[i], ctx)
        elif any(v is None for v in ins):
            out = [None] * len(box.cod)
        else:
            out = evaluate(box, ins, ctx)
        stack[n : n + k] = out
    return stack


def _extent(wires, values, axis: str) -> int:
    return next(v.shape[w.names.index(axis)] for w, v in zip(wires, values, strict=True) if w.has(axis))


def _scheduled(d: Diagram, values: list, ctx: Context, tiles: list, streams: dict) -> list:
    if tiles:
        (a, g), rest = tiles[0], tiles[1:]
        n, pieces = _extent(d.dom.inside, values, a), []
        for start in range(0, n, g):
            sub = [_slice(v, w, a, start, start + g) for v, w in zip(values, d.dom.inside, strict=True)]
            pieces.append(_scheduled(d, sub, ctx.at(**{a: ctx.offsets.get(a, 0) + start}), rest, streams))
        return [np.concatenate([p[k] for p in pieces], axis=w.names.index(a)) if w.has(a) else pieces[0][k]
                for k, w in enumerate(d.cod.inside)]
    if not streams:
        return _run(d, values, ctx)
    ((x, s),) = streams.items()
    n, states = _extent(d.dom.inside, values, x), {}
    for start in range(0, n, s):
        chunk = [_slice(v, w, x, start, start + s) for v, w in zip(values, d.dom.inside, strict=True)]
        _walk(d, chunk, ctx.at(**{x: ctx.offsets.get(x, 0) + start}), x, "chunk", states)
    return _walk(d, [None if w.has(x) else v for v, w in zip(values, d.dom.inside, strict=True)], ctx, x, "final",
                 states)


def symbolic(d: Diagram, sizes: dict) -> list:
    """The scheduled semantics of ``d`` over sympy symbols ``w{i}_{index}`` for its input elements.

    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> symbolic(nc.reduce_sum(nc.Array(n), n), {"n": 3})
    [array(w0_0 + w0_1 + w0_2, dtype=object)]
    """
    sizes = _bind(d, sizes)
    ctx = Context(sizes=sizes)
    values = [_inputs(i, w, ctx) for i, w in enumerate(d.dom.inside)]
    tiles, streams = partitions(d)
    if len(streams) > 1:
        raise RewriteError("prove", f"one streamed axis per kernel is supported, got {sorted(streams)}")
    return _scheduled(d, values, ctx, list(tiles.items()), streams)


def _inputs(i: int, wire: Array, ctx: Context) -> np.ndarray:
    shape = _shape(wire, ctx)
    out = np.empty(shape, dtype=object)
    for pos in np.ndindex(*shape):
        out[pos] = sympy.Symbol(f"w{i}_" + "_".join(map(str, pos)) if pos else f"w{i}", real=True)
    return out


def _bind(d: Diagram, sizes: dict) -> dict:
    """Sizes by symbol, from a dict keyed by axis name or symbol; every symbolic size must be bound."""
    by_name = {str(k): v for k, v in sizes.items()}
    out = {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            for sym in a.size.free_symbols:
                if str(sym) not in by_name:
                    raise RewriteError("prove", f"no size given for {sym} (pass sizes={{'{sym}': n}})", axis=a.name)
                out[sym] = int(by_name[str(sym)])
    return out


def small_sizes(*diagrams: Diagram) -> dict:
    """Default proof sizes: one more than the largest tile or stream on the axis (two pieces, the last
    ragged), 2 where unpartitioned.

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> small_sizes(stream(x, 2)(tile(q, 2)(nc.library.attention(q, x, d))))
    {'q': 3, 'd': 2, 'x': 3}
    """
    sizes: dict = {}
    for d in diagrams:
        tiles, streams = partitions(d)
        for w in (*d.dom.inside, *d.cod.inside):
            for a in w.axes:
                for sym in a.size.free_symbols:
                    unit = max(tiles.get(a.name, 1), streams.get(a.name, 1))
                    size = unit + 1 if unit > 1 else 2
                    if size > MAX_SIZE:
                        raise RewriteError("prove", f"a tile or stream of {unit} needs an axis of {size} > {MAX_SIZE} "
                                           "for a symbolic proof: pass sizes= or use smaller tiles", axis=a.name)
                    sizes[str(sym)] = max(sizes.get(str(sym), 0), size)
    return sizes


# --- deciding that a difference is zero --------------------------------------------------------


def _split_exp(u):
    """``exp(Σ cᵢ tᵢ)`` as ``Π E(tᵢ)^cᵢ``: atoms become positive symbols, so rescalings cancel."""
    if u == -sympy.oo:
        return sympy.Integer(0)
    terms = sympy.expand(u).as_coefficients_dict()
    return sympy.Mul(*(_exp_atom(t) ** c if t != 1 else sympy.exp(c) for t, c in terms.items()))


@functools.cache
def _exp_atom(t) -> sympy.Symbol:
    return sympy.Symbol(f"exp({t})", positive=True)


def _zero(expr) -> bool:
    expr = sympy.sympify(expr)
    if expr == 0:
        return True
    expr = sympy.expand(expr).replace(sympy.exp, _split_exp)
    return sympy.cancel(sympy.together(expr)) == 0


def _cases(exprs: list):
    """Substitutions replacing each ``Max``/``Min`` by one of its arguments, every combination."""
    atoms = sorted({a for e in exprs for a in sympy.sympify(e).atoms(sympy.Max, sympy.Min)}, key=str)
    choices = [a.args for a in atoms]
    if np.prod([len(c) for c in choices], dtype=float) > MAX_CASES:
        raise RewriteError("prove", f"too many cases ({' × '.join(str(len(c)) for c in choices)}): use smaller sizes")
    for pick in itertools.product(*choices):
        yield dict(zip(atoms, pick, strict=True))


def _prove(claim: str, lhs: list, rhs: list, sizes: dict, start: float) -> Proof:
    pairs = [(a, b) for x, y in zip(lhs, rhs, strict=True) for a, b in zip(_as(x).ravel(), _as(y).ravel(), strict=True)]
    diffs = [sympy.sympify(a) - sympy.sympify(b) for a, b in pairs]
    left = [e for e in diffs if not _zero(e)]
    cases = 1
    if left:
        subs = list(_cases(left))
        cases = len(subs)
        for case in subs:
            for e in left:
                if not _zero(e.subs(case)):
                    raise RewriteError("prove", f"{claim}: the difference {sympy.sstr(e)} does not simplify to 0 "
                                       f"at {sizes} (case {case})")
    return Proof(claim, dict(sizes), len(pairs), cases, time.perf_counter() - start)


# --- the claims ------------------------------------------------------------------------------


def prove_equivalent(d1: Diagram, d2: Diagram, *, sizes: dict | None = None, claim: str | None = None) -> Proof:
    """Prove that ``d1`` and ``d2`` (either may be scheduled) compute the same outputs, symbolically.

    ``sizes`` binds the axes (by name) to small integers; by default :func:`small_sizes`.

    >>> import napkin_cat as nc
    >>> from rewrites import tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> attn = nc.library.attention(q, x, d, causal=True)
    >>> print(prove_equivalent(attn, stream(x, 2)(tile(q, 2)(attn)), sizes={"q": 3, "x": 3, "d": 1}))
    proved: the two diagrams are equal, at q=3, x=3, d=1 (3 identities, 1 case)
    """
    start = time.perf_counter()
    if [w.names for w in d1.dom.inside] != [w.names for w in d2.dom.inside] or len(d1.cod) != len(d2.cod):
        raise RewriteError("prove", f"the diagrams have different types: {d1.dom} → {d1.cod} vs {d2.dom} → {d2.cod}")
    sizes = dict(sizes) if sizes is not None else small_sizes(d1, d2)
    return _prove(claim or "the two diagrams are equal", symbolic(d1, sizes), symbolic(d2, sizes), sizes, start)


def _chunks(box, axis: str, sizes: dict, pieces: int):
    """Inputs of ``box`` as symbols, and the same inputs split into ``pieces`` chunks along ``axis``."""
    d = Diagram.id(box.dom) >> box
    ctx = Context(sizes=_bind(d, sizes))
    values = [_inputs(i, w, ctx) for i, w in enumerate(box.dom.inside)]
    n = _extent(box.dom.inside, values, axis)
    if n < pieces:
        raise RewriteError("prove", f"axis {axis} has size {n} < {pieces} chunks: use a larger size", axis=axis)
    bounds = [round(k * n / pieces) for k in range(pieces + 1)]
    chunks = [[_slice(v, w, axis, a, b) for v, w in zip(values, box.dom.inside, strict=True)]
              for a, b in itertools.pairwise(bounds)]
    return ctx, values, chunks


def prove_accumulator(box, axis: str, *, sizes: dict | None = None) -> Proof:
    """Prove ``finalize(combine(partial(a), partial(b))) = f(a ⊕ b)`` for ``box``'s accumulator
    along ``axis`` (FAN's B(f(x), y) = f(x ⊕ y)), and the same for its fused ``step``.

    >>> import napkin_cat as nc
    >>> (a, k, c) = nc.axes("a k c")
    >>> print(prove_accumulator(nc.library.matmul(a, k, c), "k", sizes={"a": 1, "k": 3, "c": 2}).sizes)
    {'a': 1, 'k': 3, 'c': 2}
    """
    start = time.perf_counter()
    sizes = dict(sizes) if sizes is not None else {str(s): 3 for w in box.dom.inside for a in w.axes
                                                     for s in a.size.free_symbols}
    acc = symbolic_accumulator(box, axis)
    ctx, whole, (a, b) = _chunks(box, axis, sizes, 2)
    want = evaluate(box, whole, ctx)
    combined = acc.finalize(acc.combine(acc.partial(a, ctx), acc.partial(b, ctx)), ctx)
    stepped = acc.finalize(acc.step(acc.partial(a, ctx), b, ctx), ctx)
    claim = f"finalize(combine(partial(a), partial(b))) = {box.name}(a ⊕ b) and the fused step"
    return _prove(claim, [*combined, *stepped], [*want, *want], sizes, start)


def prove_monoid(box, axis: str, *, sizes: dict | None = None) -> Proof:
    """Prove that ``box``'s accumulator states form a monoid: ``combine`` is associative and
    ``identity`` is its unit, on the partial states of three chunks.

    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> print(prove_monoid(nc.reduce_max(nc.Array(n), n), "n", sizes={"n": 3}))
    proved: combine is associative with unit identity, at n=3 (3 identities, 1 case)
    """
    start = time.perf_counter()
    sizes = dict(sizes) if sizes is not None else {str(s): 3 for w in box.dom.inside for a in w.axes
                                                     for s in a.size.free_symbols}
    acc = symbolic_accumulator(box, axis)
    ctx, _, chunks = _chunks(box, axis, sizes, 3)
    pa, pb, pc = (acc.partial(c, ctx) for c in chunks)
    unit = acc.identity(pa)
    flat = lambda s: list(s) if isinstance(s, tuple) else [s]  # noqa: E731
    lhs = flat(acc.combine(acc.combine(pa, pb), pc)) + flat(acc.combine(unit, pa)) + flat(acc.combine(pa, unit))
    rhs = flat(acc.combine(pa, acc.combine(pb, pc))) + flat(pa) + flat(pa)
    return _prove("combine is associative with unit identity", lhs, rhs, sizes, start)
