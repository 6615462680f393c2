"""The IO-aware form of a backward: rewrites of ``nc.reverse``'s tape (FlashAttention-2, Dao 2023 §3.2).

``reverse(d)`` recomputes ``P = softmax_x(S)`` from the scores and sums ``Σ_x P ⊙ dP``, both over the
whole key axis ``x``: a kernel that streams keys can do neither. Three rules turn it into a program
whose every cotangent streams one axis:

* **log-sum-exp residual** (:func:`lse_residual`): ``softmax_x(S) = exp(S − L)`` with
  ``L = logsumexp_x S``, the second output of the forward's softmax·contract, kept by the forward
  kernel. The probabilities are recomputed block by block from Q, K and ``L`` (fully masked rows have
  ``L = +∞``, so ``P = 0`` there, as the forward gives).
* **Δ lemma** (:func:`delta_lemma`): where ``dP = dO·Vᵀ`` is the transpose of ``O = softmax_x(S)·V``,
  ``Σ_x P ⊙ dP = Σ_d dO ⊙ O``: the row sum over keys becomes one over the value dim, of the forward's
  output ``O``.
* **group sums** (:func:`widened`): a cotangent whose last contraction sums axes besides the one its
  kernel streams (the query heads sharing a key/value head in GQA/MQA, the queries of a per-head
  bias) keeps them; they are summed after the kernel, in O(N) memory.

Each lemma is an equation between diagrams, proved symbolically by :func:`prove_lemmas` at small sizes
(``rewrites._proofs``, every ordering of the scores).

>>> import napkin_cat as nc
>>> from napkin_cat import pullback
>>> from rewrites import fuse_softmax_contract
>>> q, x, d = nc.axes("q x d")
>>> t, grads = pullback(fuse_softmax_contract(nc.library.attention(q, x, d), "x"))
>>> residuals = lse_residual(t)
>>> len(delta_lemma(t, residuals))
1
>>> print(t.diagram(grads[:1], inputs=["x0", "x1", "x2", "dy3", residuals[0].lse, residuals[0].out]).cod)
q×d
>>> sorted({b.name for b in t.diagram(grads).boxes} & {"softmax x", "sum x"})
[]
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Diagram, Ty, copy, discard, swap
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import f32
from rewrites._proofs import Proof, prove_equivalent


@dataclass(frozen=True)
class Residual:
    """What a softmax·contract of the forward leaves the backward: the tape inputs of its log-sum-exp
    ``lse`` (a normalised contraction's sum) and of its output ``out``, the wires ``scores`` and ``values``
    it reads, its ``axis``.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> t, _ = nc.pullback(fuse_softmax_contract(nc.library.attention(*nc.axes("q x d")), "x"))
    >>> (r,) = lse_residual(t)
    >>> r.axis, str(t.ty(r.lse)), str(t.ty(r.out))
    ('x', 'q', 'q×d')
    """

    lse: str
    out: str
    scores: str
    values: str
    axis: str


def _rows(s: Array, axis: str) -> Array:
    return s.with_(axes=[a for a in s.axes if a.name != axis], dtype=f32)


def lse_residual(t: Tape) -> list[Residual]:
    """Rewrite every ``P = softmax_x(S)`` that recomputes a forward softmax·contract's probabilities into
    ``P = exp(S − L)``, ``L`` a new tape input (the forward's log-sum-exp); the residuals, in forward order.

    rewrite: S ─softmax_x→ P   →   S, L ─subtract→ ─exp→ P.   Sound because softmax_x(S) = exp(S − logsumexp_x S).

    The recomputed softmax·contract itself is dropped: what reads its output ``O`` (and its log-sum-exp,
    where the forward uses it: attention sinks, cross-entropy) reads the residuals instead, which are
    those values. So is every box with a residual (``Generator.with_residual``: a normalised
    contraction's sum ``Z``, read by its backward).

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> t, grads = nc.pullback(fuse_softmax_contract(nc.library.attention(*nc.axes("q x d")), "x"))
    >>> [r.scores in t.types for r in lse_residual(t)]
    [True]
    >>> "softmax x" in {b.name for b in t.diagram(grads).boxes}
    False
    """
    residuals, by_scores, steps = [], {}, list(t.steps)
    made, kept = {}, {}  # the residual of each (scores, values, axis); the recomputed wires it replaces
    t.steps = []
    for box, ins, outs in steps:
        ins = tuple(kept.get(i, i) for i in ins)
        if isinstance(box, g.Generator) and box.with_residual() is not None:
            (s, v), axis = ins, box.params["axis"]
            r = made.get((s, v, axis))
            if r is None:  # the forward's box (the first on the tape); its backward's recomputation reads it too
                r = Residual(t.input(_rows(t.ty(s), axis), "lse"), t.input(t.ty(outs[0]), "o"), s, v, axis)
                made[s, v, axis] = r
                residuals.append(r)
            if isinstance(box, g.SoftmaxContract):
                by_scores[s, r.axis] = r
            kept.update(zip(outs, (r.out, r.lse), strict=False))
            continue
        r = by_scores.get((ins[0], box.params.get("axis"))) if isinstance(box, g.Softmax) else None
        if r is None:
            t.steps.append((box, ins, outs))
            continue
        e = t.ew("subtract", ins[0], r.lse, out=t.ty(outs[0]))
        t.steps.append((g.elementwise("exp", t.ty(e), out=t.ty(outs[0])), (e,), outs))
    return residuals


def delta_lemma(t: Tape, residuals: list[Residual]) -> list[str]:
    """Rewrite every ``Σ_x P ⊙ dP``, where ``P = exp(S − L)`` is a residual's recomputed probabilities and
    ``dP = c·Vᵀ`` the transpose of its contraction, into ``Δ = Σ_d c ⊙ O`` (``O`` its residual output).
    Returns the wires ``Δ`` it made, one per rewritten sum: they no longer read the key axis ``x``, so a
    backward can compute each once per query row (``lowering._backward``) instead of per key block.

    rewrite: Σ_x (P ⊙ c·Vᵀ)  →  Σ_d (c ⊙ O).   Sound because Σ_x P_x (Σ_d c_d V_xd) = Σ_d c_d (Σ_x P_x V_xd)
    and O = P·V.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> t, grads = nc.pullback(fuse_softmax_contract(nc.library.attention(*nc.axes("q x d")), "x"))
    >>> len(delta_lemma(t, lse_residual(t))), "sum x" in {b.name for b in t.diagram(grads).boxes}
    (1, False)
    """
    made = {outs[0]: (box, ins) for box, ins, outs in t.steps if len(outs) == 1}
    probabilities = {}
    for box, ins, outs in t.steps:
        if isinstance(box, g.Elementwise) and box.params["fn"] == "exp" and ins[0] in made:
            sub, (s, lse) = made[ins[0]][0], (*made[ins[0]][1], None)[:2]
            r = next((r for r in residuals if (s, lse) == (r.scores, r.lse)), None)
            if r is not None and sub.params["fn"] == "subtract":
                probabilities[outs[0]] = r
    rewritten = []
    for j, (box, ins, outs) in enumerate(t.steps):
        if not (isinstance(box, g.Reduce) and box.params["op"] == "sum") or ins[0] not in made:
            continue
        product, (P, dP) = made[ins[0]][0], (*made[ins[0]][1], None, None)[:2]
        r = probabilities.get(P)
        transpose = made.get(dP, (None, ()))
        if (
            r is None
            or box.params["axis"] != r.axis
            or not (isinstance(product, g.Elementwise) and product.params["fn"] == "multiply")
            or not isinstance(transpose[0], g.Contract)
            or transpose[0].params.get("scale") is not None
            or len(transpose[1]) != 2
            or transpose[1][1] != r.values
            or t.ty(transpose[1][0]).names != t.ty(r.out).names
        ):
            continue
        c = transpose[1][0]
        t.steps[j] = (_contract(t, [c, r.out], t.ty(outs[0])), (c, r.out), outs)
        rewritten.append(outs[0])
    return rewritten


def narrow_operands(t: Tape) -> int:
    """Let every contraction read the narrow wire an exact widening cast (bf16 or f16 → f32) was made from;
    the number of operands rewritten. The casts no contraction reads any more drop out of the diagrams.

    rewrite: c ─cast f32→ ─contract→   →   c ─contract→.   Sound because widening a 16-bit float is exact
    and a contraction accumulates in f32 whatever its operands' dtype. The reverse of a forward cast to
    bf16 widens the output cotangent ``dO``; read narrow, ``dV = Pᵀ·dO`` and ``dP = dO·Vᵀ`` run as 16-bit
    tensor-core products (the kernel casts ``P`` to ``dO``'s dtype, as FlashAttention-2 does), not f32 ones.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> q, x, d = nc.axes("q x d")
    >>> t, grads = nc.pullback(fuse_softmax_contract(nc.library.attention(q, x, d, dtype="bf16"), "x"))
    >>> narrow_operands(t)
    2
    >>> dv = [b for b in t.diagram(grads[2:]).boxes if b.name.startswith("q x, q d")]
    >>> sorted({w.dtype.name for b in dv for w in b.dom.inside})
    ['bf16', 'f32']
    """
    widened = {
        outs[0]: ins[0]
        for box, ins, outs in t.steps
        if isinstance(box, g.Cast) and t.ty(outs[0]).dtype == f32 and t.ty(ins[0]).dtype.name in ("bf16", "f16")
    }
    rewritten = 0
    for j, (box, ins, outs) in enumerate(t.steps):
        if not isinstance(box, g.Contract) or not widened.keys() & set(ins):
            continue
        narrow = tuple(widened.get(i, i) for i in ins)
        rewritten += sum(a != b for a, b in zip(ins, narrow, strict=True))
        made = _contract(t, list(narrow), t.ty(outs[0]))
        if box.params.get("scale") is not None:
            made = made.scaled(box.params["scale"])
        t.steps[j] = (made, narrow, outs)
    return rewritten


def _contract(t: Tape, ins: list[str], out: Array) -> g.Contract:
    arrays = [t.ty(n) for n in ins]
    name = ", ".join(" ".join(a.names) for a in arrays) + " → " + " ".join(out.names)
    return g.Contract(name, Ty(*arrays), Ty(out))


def reduced(t: Tape, name: str) -> tuple[Axis, ...]:
    """The axes the contraction making ``name`` sums (through casts and sums of cotangents); () if none does.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> t, (dq, dk, dv) = nc.pullback(fuse_softmax_contract(nc.library.attention(*nc.axes("q x d")), "x"))
    >>> [a.name for a in reduced(t, dq)], [a.name for a in reduced(t, dk)]
    (['x'], ['q'])
    """
    made = {outs[0]: (box, ins) for box, ins, outs in t.steps if len(outs) == 1}
    while name in made:
        box, ins = made[name]
        if isinstance(box, g.Contract):
            kept = set(t.ty(name).names)
            return tuple({a.name: a for i in ins for a in t.ty(i).axes if a.name not in kept}.values())
        if not (isinstance(box, g.Cast) or (isinstance(box, g.Elementwise) and box.params["fn"] == "add")):
            return ()
        name = ins[0]
    return ()


def widened(t: Tape, name: str, extra: tuple[Axis, ...]) -> str | None:
    """The cotangent ``name`` with the axes ``extra`` kept (appended last) instead of summed by the
    contraction making it, or None where that contraction does not sum them all (or a box between
    is not a cast or a sum of equally typed cotangents). Summing ``extra`` afterwards gives ``name``.

    rewrite: Σ_{x,g} A·B → [x]   →   Σ_x A·B → [x, g], then Σ_g.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> hk, g, q, x, d = nc.axes("hk g q x d")
    >>> gqa = nc.library.grouped_query_attention(hk, g, q, x, d)
    >>> t, (dq, dk, dv) = nc.pullback(fuse_softmax_contract(gqa, "x"))
    >>> print(t.ty(dk), "→", t.ty(widened(t, dk, (g,))))
    hk×x×d → hk×x×d×g
    """
    if not extra:
        return name
    step = next((s for s in t.steps if s[2] == (name,)), None)
    if step is None:
        return None
    box, ins, _ = step
    ty = t.ty(name)
    wide = ty.with_(axes=[*ty.axes, *extra])
    if isinstance(box, g.Contract):
        have = {n for i in ins for n in t.ty(i).names}
        if any(a.name in ty.names or a.name not in have for a in extra):
            return None
        return t.contract(list(ins), wide, box.params.get("scale"))
    if isinstance(box, g.Cast):
        inner = widened(t, ins[0], extra)
        return None if inner is None else t(g.cast(t.ty(inner), ty.dtype), inner)
    if isinstance(box, g.Elementwise) and box.params["fn"] == "add" and all(t.ty(i) == ty for i in ins):
        parts = [widened(t, i, extra) for i in ins]
        return None if None in parts else t.ew("add", *parts, out=wide)
    return None


# --- the lemmas, as equations between diagrams -----------------------------------------------------


def lemmas(q: Axis, x: Axis, d: Axis) -> dict[str, tuple[Diagram, Diagram]]:
    """Both sides of each lemma as diagrams, on scores ``S[q,x]``, values ``V[x,d]`` and a cotangent
    ``C[q,d]``: ``lse``: softmax_x(S) = exp(S − logsumexp_x S); ``delta``: Σ_x softmax_x(S) ⊙ (C·Vᵀ) =
    Σ_d C ⊙ (softmax_x(S)·V).

    >>> import napkin_cat as nc
    >>> print(lemmas(*nc.axes("q x d"))["delta"][1].cod)
    q
    """
    S, V, C, Y, rows = Array(q, x), Array(x, d), Array(q, d), Array(q, d), Array(q)
    P = g.softmax(S, x)
    both = g.SoftmaxContract(f"softmax·contract {x.name}", Ty(S, V), Ty(Y, rows), data=(("axis", x.name),))
    lse = (
        copy(S) @ identity(V)
        >> identity(S) @ both
        >> identity(S) @ discard(Y) @ identity(rows)
        >> g.subtract(S, rows)
        >> g.exp(S)
    )
    dP = g.contract(f"{q.name} {d.name}, {x.name} {d.name} -> {q.name} {x.name}", q, x, d)
    delta_lhs = (
        P @ identity(V) @ identity(C)
        >> identity(S) @ swap(V, C)
        >> identity(S) @ dP
        >> g.multiply(S, S)
        >> g.reduce_sum(S, x)
    )
    out = g.softmax_contract(S, V, x, Y)
    delta_rhs = out @ identity(C) >> g.contract(f"{q.name} {d.name}, {q.name} {d.name} -> {q.name}", q, d)
    return {"lse": (P @ discard(V), lse), "delta": (delta_lhs, delta_rhs)}


def prove_lemmas(sizes: dict | None = None) -> dict[str, Proof]:
    """Prove both lemmas symbolically (at ``q=1, x=3, d=2`` by default), each over every ordering of the scores.

    >>> {name: proof.identities for name, proof in prove_lemmas().items()}
    {'lse': 3, 'delta': 1}
    """
    sizes = sizes or {"q": 1, "x": 3, "d": 2}
    q, x, d = (Axis(n) for n in ("q", "x", "d"))
    claims = {"lse": "softmax_x(S) = exp(S − logsumexp_x S)", "delta": "Σ_x P ⊙ (C·Vᵀ) = Σ_d C ⊙ (P·V)"}
    return {k: prove_equivalent(a, b, sizes=sizes, claim=claims[k]) for k, (a, b) in lemmas(q, x, d).items()}
