"""Symbolic proofs at small concrete sizes: verification strength (c) of docs/user_rewrites.md.

Both sides are evaluated in a sympy semantics — every array element a sympy expression in symbols
standing for the input elements — and each output element's difference is simplified to 0. The
scheduled semantics runs here too (tiles sliced and concatenated, streams folded through the
accumulators, ragged last pieces included), so a proof covers the relabelling and the accumulator.

Simplification: every ``exp(u)`` is split into a product of ``exp`` of the atoms of ``u`` (a running
max ``Max(…)`` is one atom), so the rescalings of the online softmax cancel as rational functions;
whatever ``Max`` is left is case-split (each replaced by each of its arguments in turn), which
covers every ordering of the scores. Where a difference still does not simplify to 0, both sides are
evaluated at random points, and the error says which: a counterexample (the claim is false), or agreement
everywhere tried (the claim likely holds, and only its proof is beyond this simplifier).

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> box = nc.library.attention(q, x, d).boxes[1]          # the softmax
>>> sc = nc.softmax_contract(box.dom.inside[0], nc.Array(x, d), x, nc.Array(q, d))
>>> proof = prove_accumulator(sc, "x", sizes={"q": 1, "x": 3, "d": 1})
>>> print(proof.claim)
finalize(combine(partial(a), partial(b))) = softmax·contract x(a ⊕ b) and the fused step
>>> proof.identities, proof.cases
(2, 1)

The sympy semantics is the generators' own: each generator's ``evaluate`` and accumulator run in the
sympy array namespace (``napkin_cat.generators.SYMPY``), through the one scheduled interpreter
(:func:`rewrites._schedule.scheduled`), so a user's generator needs nothing more to be proved
(see ``docs/user_rewrites.md``).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
import sympy

from napkin_cat.diagram import Array, Diagram
from napkin_cat.generators import SYMPY, Accumulator, Context, Generator
from rewrites._rule import RewriteError
from rewrites._schedule import _extent, _slice, partitions, scheduled

#: the largest axis size a default proof uses (larger tiles or streams need explicit ``sizes``)
MAX_SIZE = 8
#: the most cases a proof may split into
MAX_CASES = 4096


@dataclass(frozen=True)
class Proof:
    """The record of a symbolic proof: the claim, the sizes, how many scalar identities and cases.

    >>> import napkin_cat as nc
    >>> a, k, c = nc.axes("a k c")
    >>> p = prove_accumulator(nc.library.matmul(a, k, c), "k", sizes={"a": 1, "k": 3, "c": 2})
    >>> p.sizes, p.identities, p.cases
    ({'a': 1, 'k': 3, 'c': 2}, 4, 1)
    """

    claim: str
    sizes: dict
    identities: int
    cases: int
    seconds: float

    def __str__(self):
        sizes = ", ".join(f"{k}={v}" for k, v in self.sizes.items())
        cases = f"{self.cases} case{'s' if self.cases != 1 else ''}"
        return f"proved: {self.claim}, at {sizes} ({self.identities} identities, {cases})"


def symbolic(d: Diagram, sizes: dict) -> list:
    """The scheduled semantics of ``d`` over sympy symbols ``w{i}_{index}`` for its input elements.

    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> symbolic(nc.reduce_sum(nc.Array(n), n), {"n": 3})
    [array(w0_0 + w0_1 + w0_2, dtype=object)]
    """
    ctx = Context(sizes=_bind(d, sizes), xp=SYMPY)
    if len(partitions(d)[1]) > 1:
        raise RewriteError("prove", f"one streamed axis per kernel is supported, got {sorted(partitions(d)[1])}")
    return scheduled(d, [_inputs(i, w, ctx) for i, w in enumerate(d.dom.inside)], ctx)


def _as(value) -> np.ndarray:
    return np.asarray(value, dtype=object)


def _inputs(i: int, wire: Array, ctx: Context) -> np.ndarray:
    shape = tuple(int(ctx.number(a.size)) for a in wire.axes)
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
                        raise RewriteError(
                            "prove",
                            f"a tile or stream of {unit} needs an axis of {size} > {MAX_SIZE} "
                            "for a symbolic proof: pass sizes= or use smaller tiles",
                            axis=a.name,
                        )
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
    pairs = [(sympy.sympify(a), sympy.sympify(b)) for a, b in pairs]
    left = [(a, b) for a, b in pairs if not _zero(a - b)]
    cases = 1
    if left:
        subs = list(_cases([a - b for a, b in left]))
        cases = len(subs)
        for case in subs:
            for a, b in left:
                if not _zero((a - b).subs(case)):
                    raise RewriteError("prove", f"{claim}: {_diagnose(a, b, sizes, case)}")
    return Proof(claim, dict(sizes), len(pairs), cases, time.perf_counter() - start)


#: random points at which an identity sympy could not prove is evaluated, and the agreement asked there
POINTS, AGREEMENT = 64, 1e-9


def _diagnose(lhs, rhs, sizes: dict, case: dict) -> str:
    """Why ``lhs = rhs`` was not proved: a numeric counterexample (the claim is false), or sympy could not
    simplify the difference though both sides agree at :data:`POINTS` random points (float64, inputs
    standard normal, relative agreement :data:`AGREEMENT`).

    >>> a, b = sympy.symbols("w0_0 w0_1", real=True)
    >>> print(_diagnose(a + b, a * b, {"n": 2}, {}))
    the difference -w0_0*w0_1 + w0_0 + w0_1 does not simplify to 0 at {'n': 2}, and the claim is false: at \
w0_0=0.1257, w0_1=-0.1321 the left side is -0.006374642198 and the right side -0.01660957367
    >>> lse = sympy.log(sympy.exp(a) + sympy.exp(b))
    >>> print(_diagnose(lse, a + sympy.log(1 + sympy.exp(b - a)), {"n": 2}, {}))  # doctest: +ELLIPSIS
    the difference ... does not simplify to 0 at {'n': 2} (case {}), but both sides agree at 64 random points ...
    """
    difference = sympy.sstr(lhs - rhs)
    difference = difference if len(difference) <= 300 else difference[:299] + "…"
    symbols = sorted((lhs - rhs).free_symbols | lhs.free_symbols | rhs.free_symbols, key=str)
    rng = np.random.default_rng(0)
    points = rng.standard_normal((POINTS, len(symbols)))
    with np.errstate(all="ignore"):
        left, right = (_evaluate(e, symbols, points) for e in (lhs, rhs))
        scale = np.maximum(1.0, np.maximum(np.abs(left), np.abs(right)))
        undefined = np.isnan(left) & np.isnan(right)  # both sides undefined there: no evidence either way
        bad = ~((left == right) | undefined | (np.abs(left - right) <= AGREEMENT * scale))
    if bad.any():
        k = int(np.argmax(bad))
        at = ", ".join(f"{s}={v:.4g}" for s, v in zip(symbols, points[k], strict=True))
        return (
            f"the difference {difference} does not simplify to 0 at {sizes}, and the claim is false: at {at} the "
            f"left side is {left[k]:.10g} and the right side {right[k]:.10g}"
        )
    return (
        f"the difference {difference} does not simplify to 0 at {sizes} (case {case}), but both sides agree at "
        f"{POINTS} random points (relative {AGREEMENT:.0e}): the claim likely holds and only its proof is beyond "
        "this simplifier; test it on random inputs instead (rewrites.testing.assert_equivalent(d1, d2))"
    )


def _evaluate(e, symbols: list, points: np.ndarray) -> np.ndarray:
    """``e`` at each row of ``points`` (one column per symbol), in float64; NaN where it is undefined or not real."""
    value = np.asarray(sympy.lambdify(symbols, e, modules="numpy")(*points.T), dtype=np.complex128)
    real = np.where(np.abs(value.imag) <= 1e-12 * np.maximum(1.0, np.abs(value.real)), value.real, np.nan)
    return np.broadcast_to(real, (len(points),))


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


def _accumulator(box: Generator, axis: str) -> Accumulator:
    acc = box.accumulator(axis) if isinstance(box, Generator) else None
    if acc is None:
        raise RewriteError("prove", f"the box has no accumulator along {axis}", box=box.name, axis=axis)
    return acc


def _chunks(box, axis: str, sizes: dict, pieces: int):
    """Inputs of ``box`` as symbols, and the same inputs split into ``pieces`` chunks along ``axis``."""
    d = Diagram.id(box.dom) >> box
    ctx = Context(sizes=_bind(d, sizes), xp=SYMPY)
    values = [_inputs(i, w, ctx) for i, w in enumerate(box.dom.inside)]
    n = _extent(box.dom.inside, values, axis)
    if n < pieces:
        raise RewriteError("prove", f"axis {axis} has size {n} < {pieces} chunks: use a larger size", axis=axis)
    bounds = [round(k * n / pieces) for k in range(pieces + 1)]
    chunks = [
        [_slice(v, w, axis, a, b) for v, w in zip(values, box.dom.inside, strict=True)]
        for a, b in itertools.pairwise(bounds)
    ]
    return ctx, values, chunks


def _sizes_or_threes(box, sizes: dict | None) -> dict:
    """``sizes``, or 3 for every symbol in ``box``'s input sizes (each chunk then holds values to compare)."""
    if sizes is not None:
        return dict(sizes)
    return {str(s): 3 for w in box.dom.inside for a in w.axes for s in a.size.free_symbols}


def prove_accumulator(box, axis: str, *, sizes: dict | None = None) -> Proof:
    """Prove ``finalize(combine(partial(a), partial(b))) = f(a ⊕ b)`` for ``box``'s accumulator
    along ``axis`` (FAN's B(f(x), y) = f(x ⊕ y)), and the same for its fused ``step``.

    >>> import napkin_cat as nc
    >>> (a, k, c) = nc.axes("a k c")
    >>> print(prove_accumulator(nc.library.matmul(a, k, c), "k", sizes={"a": 1, "k": 3, "c": 2}).sizes)
    {'a': 1, 'k': 3, 'c': 2}
    """
    start = time.perf_counter()
    sizes = _sizes_or_threes(box, sizes)
    acc = _accumulator(box, axis)
    ctx, whole, (a, b) = _chunks(box, axis, sizes, 2)
    want = box.evaluate(whole, ctx)
    combined = acc.finalize(acc.combine(acc.partial(a, ctx), acc.partial(b, ctx), ctx), ctx)
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
    sizes = _sizes_or_threes(box, sizes)
    acc = _accumulator(box, axis)
    ctx, _, chunks = _chunks(box, axis, sizes, 3)
    pa, pb, pc = (acc.partial(c, ctx) for c in chunks)
    unit = acc.identity(pa, ctx)
    flat = lambda s: list(s) if isinstance(s, tuple) else [s]  # noqa: E731
    op = lambda a, b: acc.combine(a, b, ctx)  # noqa: E731
    lhs = flat(op(op(pa, pb), pc)) + flat(op(unit, pa)) + flat(op(pa, unit))
    rhs = flat(op(pa, op(pb, pc))) + flat(pa) + flat(pa)
    return _prove("combine is associative with unit identity", lhs, rhs, sizes, start)
