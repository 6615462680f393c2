"""The IO-aware form of a backward: rewrites of ``nc.reverse``'s tape (FlashAttention-2, Dao 2023 §3.2).

``reverse(d)`` recomputes ``P = softmax_x(S)`` from the scores and sums ``Σ_x P ⊙ dP``, both over the
whole key axis ``x``: a kernel that streams keys can do neither. These rules turn it into a program
whose every cotangent streams one axis:

* **log-sum-exp residual** (:func:`lse_residual`): ``softmax_x(S) = exp(S − L)`` with
  ``L = logsumexp_x S``, the second output of the forward's softmax·contract, kept by the forward
  kernel. The probabilities are recomputed block by block from Q, K and ``L`` (fully masked rows have
  ``L = +∞``, so ``P = 0`` there, as the forward gives).
* **Δ lemma** (:func:`delta_lemma`): where ``dP = dO·Vᵀ`` is the transpose of ``O = softmax_x(S)·V``,
  ``Σ_x P ⊙ dP = Σ_d dO ⊙ O``: the row sum over keys becomes one over the value dim, of the forward's
  output ``O``.
* **row weight** (:func:`row_weight_lemma`): where a positive row weight ``w`` scales the output
  (``O = w ⊙ softmax_x(S)·V``, an attention sink's ``σ(L − sink)``), ``w·exp(S − L) = exp(S − (L − log w))``:
  the kernels recompute ``exp(S − L′)`` with ``L′ = L − log w`` and read one row value ``R/w``, as plain
  attention's kernels read Δ, instead of rescaling ``dO`` per chunk and adding per score.
* **constant weight** (:func:`constant_weight_lemma`): the same identity for a positive constant ``k``,
  ``k·exp(S − L) = exp(S − (L − log k))``: attention dropout's ``1/(1 − rate)``, which its backward puts on the
  probabilities (the ``dropout`` lemma below proves the whole backward so written), costs a row, not a score.
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

import sympy

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Diagram, Ty, copy, discard, swap
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import f32
from rewrites._proofs import Proof, prove_equivalent
from rewrites._rule import RewriteError


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
            (s, v, *_), axis = ins, box.params["axis"]  # a dropout's seed, where the box has one, comes third
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
    and O = P·V. Under dropout (``O = (P ⊙ M)·V / (1 − rate)``, ``M`` the mask) the sum is ``Σ_x (P ⊙ Z) ⊙ (c·Vᵀ)``
    with ``Z = M / (1 − rate)`` (a scaled :class:`~napkin_cat.generators.Dropout` on ``c·Vᵀ``), or, as
    :meth:`SoftmaxContract.backward <napkin_cat.generators.SoftmaxContract.backward>` writes it, ``Σ_x P′ ⊙ ((c·Vᵀ) ⊙
    M)`` with ``P′ = P / (1 − rate)`` (the mask alone): either is ``Σ_d c ⊙ O``, so the rewrite looks through the
    dropout, and through the constant on ``P`` exactly where it is the dropout's.

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
        weight = made.get(P, (None,))[0]  # P′ = P / (1 − rate), where the backward put the dropout's constant
        weight = weight.params["const"] if _constant(weight) else None
        r = probabilities.get(P if weight is None else made[P][1][0])
        transpose = made.get(dP, (None, ()))
        if isinstance(transpose[0], g.Dropout):
            # dP = (c·Vᵀ) ⊙ Z, the forward's dropout: Σ_x P ⊙ Z ⊙ (c·Vᵀ) = Σ_d c ⊙ ((P ⊙ Z)·V) = Σ_d c ⊙ O, O
            # being the dropped output, so Δ is the same row sum of dO ⊙ O; as well Σ_x P′ ⊙ M ⊙ (c·Vᵀ), the
            # mask alone and P′ = P / (1 − rate): the constant is the dropout's once, on either side
            drop = transpose[0]
            if (weight is None) != drop.scaled or (weight is not None and weight != sympy.sympify(drop.drop.scale)):
                continue
            transpose = made.get(transpose[1][0], (None, ()))
        elif weight is not None:
            continue
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


def _constant(box) -> bool:
    """Whether ``box`` multiplies one wire by a positive constant."""
    return (
        isinstance(box, g.Elementwise)
        and box.params["fn"] == "multiply"
        and len(box.dom) == 1
        and "const" in box.params
        and bool(sympy.sympify(box.params["const"]).is_positive)
    )


def constant_weight_lemma(t: Tape, residuals: list[Residual], grads: list) -> int:
    """Fold a positive constant ``k`` multiplying a residual's recomputed probabilities into its log-sum-exp; the
    number of folds. The backward of attention dropout carries its ``1/(1 − rate)`` so
    (:meth:`SoftmaxContract.backward <napkin_cat.generators.SoftmaxContract.backward>`): on the probabilities,
    not on the mask, whose every kept weight it would otherwise multiply.

    rewrite: k·exp(S − L)  →  exp(S − L′), L′ = L − log k.   Sound because k = exp(log k) for k > 0 (the row
    weight lemma's identity, :func:`row_weight_lemma`, for a constant): the kernels recompute ``exp(S − L′)`` as
    plain attention's recompute ``exp(S − L)``, ``L′`` one subtraction a row; a fully masked row keeps ``L′ = +∞``
    and ``P′ = 0``. Run after :func:`delta_lemma`, which reads ``k·P`` as it is written.

    >>> import napkin_cat as nc
    >>> from napkin_cat.generators import Drop
    >>> from rewrites import fuse_softmax_contract
    >>> b, q, x, d = nc.axes("b q x d")
    >>> att = nc.library.dot_product_attention(q, x, d, batch=(b,), dropout=(Drop(0.5, "q", "x", "b"), (b,)))
    >>> t, grads = nc.pullback(fuse_softmax_contract(att, "x"))
    >>> residuals = lse_residual(t)
    >>> _ = delta_lemma(t, residuals)
    >>> constant_weight_lemma(t, residuals, grads)
    1
    >>> per_score = [b.name for b in t.diagram(grads[:3]).boxes if b.name[:4] not in ("Copy", "Swap")
    ...              and {"q", "x"} <= set(b.cod.inside[0].names)]  # plain attention's and two masks, no scale
    >>> sorted(per_score)
    ['b q d, b x d → b q x', 'b q d, b x d → b q x', 'dropout 0.5 mask', 'dropout 0.5 mask', 'exp', 'multiply', \
'subtract', 'subtract']
    """
    made = {outs[0]: (box, ins) for box, ins, outs in t.steps if len(outs) == 1}
    lses = {(r.scores, r.lse) for r in residuals}
    folds = 0

    def fn(name):  # the named map making ``name`` (no constant), else None
        box = made.get(name, (None,))[0]
        return box.params["fn"] if isinstance(box, g.Elementwise) and "const" not in box.params else None

    for j, (box, ins, outs) in enumerate(list(t.steps)):
        if not _constant(box) or fn(ins[0]) != "exp" or fn(e := made[ins[0]][1][0]) != "subtract":
            continue
        if tuple(made[e][1]) not in lses:  # P = exp(S − L), L a residual's log-sum-exp of the scores S
            continue
        S, L = made[e][1]
        shifted = t.ew("subtract", L, const=sympy.log(box.params["const"]), out=t.ty(L))
        lower = t.ew("subtract", S, shifted, out=t.ty(e))
        t.steps[j] = (g.elementwise("exp", t.ty(lower), out=t.ty(outs[0])), (lower,), outs)
        folds += 1
    if folds:
        _tidy(t, grads)
    return folds


#: named maps whose values are positive: a row weight they make has a logarithm
POSITIVE = ("exp", "sigmoid")
#: the least row weight divided by: below it the folded probabilities are below TINY·P, and R/w stays finite
TINY = 1e-30


def row_weight_lemma(t: Tape, residuals: list[Residual], grads: list) -> int:
    """Fold a positive row weight ``w`` scaling a softmax·contract's output (``O = w ⊙ softmax_x(S)·V``: an
    attention sink's ``σ(lse − sink)``) into its recomputed probabilities; the number of folds.

    rewrite: P = exp(S − L), c = a ⊙ w, dV = Pᵀc, dS = P ⊙ (c·Vᵀ + R)
        →    P′ = exp(S − L′), L′ = L − log w, dV = P′ᵀa, dS = P′ ⊙ (a·Vᵀ + R/w).
    Sound because w·exp(S − L) = exp(S − (L − log w)) for w > 0, and w factors out of both contractions
    (``R``: the row values added to ``c·Vᵀ`` on the way, such as −Δ). ``w`` must be made by a named map
    with positive values (:data:`POSITIVE`); R/w divides by ``max(w, TINY)``, so a weight that underflows
    to 0 gives ``P′ = 0`` and a finite ``R/w``. The kernels streaming keys or queries then compute what
    plain attention's do, with ``L′`` for ``L``: no rescaled cotangent per chunk, no extra add per score.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> q, x, d = nc.axes("q x d")
    >>> t, grads = nc.pullback(fuse_softmax_contract(nc.library.sink_attention(q, x, d), "x"))
    >>> residuals = lse_residual(t)
    >>> _ = delta_lemma(t, residuals)
    >>> row_weight_lemma(t, residuals, grads)
    1
    >>> per_score = [b.name for b in t.diagram(grads[:1]).boxes if b.name[:4] not in ("Copy", "Swap")
    ...              and "x" in b.cod.inside[0].names]  # dQ's work per score: plain attention's
    >>> sorted(per_score)
    ['add', 'exp', 'multiply', 'q d, x d → q x', 'q d, x d → q x', 'subtract']
    """
    _tidy(t, grads)
    made = {outs[0]: (box, ins) for box, ins, outs in t.steps if len(outs) == 1}
    users: dict[str, list[int]] = {}
    for j, (_, ins, _) in enumerate(t.steps):
        for n in set(ins):
            users.setdefault(n, []).append(j)

    def fn(name):
        box = made.get(name, (None,))[0]
        return box.params["fn"] if isinstance(box, g.Elementwise) and "const" not in box.params else None

    folds = 0
    for r in residuals:
        rows = t.ty(r.lse).names
        for P, (_, (sub,)) in [(n, m) for n, m in made.items() if fn(n) == "exp"]:
            if fn(sub) != "subtract" or made[sub][1] != (r.scores, r.lse):
                continue
            fold = _fold(t, P, users, made, fn, rows, r)
            if fold is None:
                continue
            (a, w, dv, ds), (dp, terms, (_, (c, v))) = fold
            # the new row values: L′ = L − log w, R/w; then the kernels' values, as plain attention's
            lse = t.ew("subtract", r.lse, t.ew("log", w), out=t.ty(r.lse))
            p = t.ew("exp", t.ew("subtract", r.scores, lse, out=t.ty(sub)), out=t.ty(P))
            rest = None
            for sign, term in terms:
                rest = (
                    (term if sign > 0 else t.ew("neg", term))
                    if rest is None
                    else t.ew("add" if sign > 0 else "subtract", rest, term, out=t.ty(term))
                )
            scores = t.contract([a, v], t.ty(dp), made[dp][0].params.get("scale"))
            if rest is not None:
                floor = t.ew("maximum", w, const=TINY)
                scores = t.ew("add", scores, t.ew("divide", rest, floor, out=t.ty(rest)), out=t.ty(dp))
            for j, (box, ins, outs) in enumerate(t.steps):
                if outs[0] == ds:
                    t.steps[j] = (g.elementwise("multiply", t.ty(p), t.ty(scores), out=t.ty(ds)), (p, scores), outs)
                elif outs[0] in dv:
                    new = [p if i == P else a if i == c else i for i in ins]
                    product = _contract(t, new, t.ty(outs[0]))
                    if box.params.get("scale") is not None:
                        product = product.scaled(box.params["scale"])
                    t.steps[j] = (product, tuple(new), outs)
            folds += 1
    if folds:
        _tidy(t, grads)
    return folds


def _fold(t, P, users, made, fn, rows, r):
    """The parts of the pattern :func:`row_weight_lemma` folds around the probabilities ``P``, or None."""
    dv, ds, c = [], None, None
    for j in users.get(P, []):
        box, ins, outs = t.steps[j]
        if isinstance(box, g.Contract) and len(ins) == 2 and P in ins and ins[1 - ins.index(P)] in made:
            c = c or ins[1 - ins.index(P)]
            if ins[1 - ins.index(P)] != c:
                return None
            dv.append(outs[0])
        elif isinstance(box, g.Elementwise) and fn(outs[0]) == "multiply" and len(ins) == 2 and ds is None:
            ds, E = outs[0], ins[1 - ins.index(P)]
        else:
            return None
    if c is None or ds is None or fn(c) != "multiply":
        return None
    a, w = made[c][1]
    if t.ty(a).names == rows:
        a, w = w, a
    if t.ty(w).names != rows or fn(w) not in POSITIVE or t.ty(a).names != t.ty(c).names:
        return None
    terms = []  # the row values added to dP on the way to dS: (sign, value)
    while fn(E) in ("add", "subtract") and len(users.get(E, [])) == 1:
        x, y = made[E][1]
        if t.ty(y).names == rows and t.ty(x).names != rows:
            terms.append((1 if fn(E) == "add" else -1, y))
            E = x
        elif fn(E) == "add" and t.ty(x).names == rows and t.ty(y).names != rows:
            terms.append((1, x))
            E = y
        else:
            return None
    step = made.get(E)
    if step is None or not isinstance(step[0], g.Contract) or len(step[1]) != 2 or step[1][0] != c:
        return None
    if step[1][1] != r.values or len(users.get(E, [])) != 1:
        return None
    # c may be read elsewhere only by row values (Δ = Σ_d c ⊙ O): what holds the residual's axis reads a
    for j in users.get(c, []):
        box, ins, outs = t.steps[j]
        if outs[0] not in (E, *dv) and r.axis in {n for o in outs for n in t.ty(o).names}:
            return None
    return (a, w, dv, ds), (E, terms[::-1], step)


def _tidy(t: Tape, grads: list) -> None:
    """Order the tape's steps so each comes after the steps making its inputs (stable otherwise), and drop
    the steps no cotangent in ``grads`` needs (the unfolded probabilities and Δ's old readers, which would
    otherwise look like readers of row values)."""
    ready, left, ordered = set(t.inputs), list(t.steps), []
    while left:
        k = next((k for k, (_, ins, _) in enumerate(left) if set(ins) <= ready), None)
        if k is None:
            raise RewriteError("row_weight_lemma", f"no order of the tape's steps: {left[0][0].name} waits")
        ordered.append(left.pop(k))
        ready |= set(ordered[-1][2])
    t.steps = ordered
    t.steps = t.needed([n for n in grads if n is not None])


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
    """The axes the contraction making ``name`` sums (through casts, sums of cotangents and boxes linear in their first
    input, :func:`widened`); () if none does.

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
        linear = callable(getattr(box, "linear_on", None))
        if not (linear or isinstance(box, g.Cast) or (isinstance(box, g.Elementwise) and box.params["fn"] == "add")):
            return ()
        name = ins[0]
    return ()


def widened(t: Tape, name: str, extra: tuple[Axis, ...], inner: frozenset = frozenset()) -> str | None:
    """The cotangent ``name`` with the axes ``extra`` kept instead of summed by the contraction making it (those
    named in ``inner``, a kernel's block axes, after its own, the others, grid axes, before them: its innermost
    axis stays one a block holds contiguously, which TMA needs), or None where that contraction does not sum them
    all (or a box between is not a cast, a sum of equally typed cotangents or a box linear in its first input that
    says so, ``linear_on``: a rotation). Summing ``extra`` afterwards gives ``name``.

    rewrite: Σ_{x,g} A·B → [x]   →   Σ_x A·B → [g, x] (or [x, g] with g inner), then Σ_g.

    >>> import napkin_cat as nc
    >>> from rewrites import fuse_softmax_contract
    >>> hk, g, q, x, d = nc.axes("hk g q x d")
    >>> gqa = nc.library.grouped_query_attention(hk, g, q, x, d)
    >>> t, (dq, dk, dv) = nc.pullback(fuse_softmax_contract(gqa, "x"))
    >>> print(t.ty(dk), "→", t.ty(widened(t, dk, (g,))))
    hk×x×d → g×hk×x×d
    """
    if not extra:
        return name
    step = next((s for s in t.steps if s[2] == (name,)), None)
    if step is None:
        return None
    box, ins, _ = step
    ty = t.ty(name)
    wide = ty.with_(axes=[*(a for a in extra if a.name not in inner), *ty.axes, *(a for a in extra if a.name in inner)])
    if isinstance(box, g.Contract):
        have = {n for i in ins for n in t.ty(i).names}
        if any(a.name in ty.names or a.name not in have for a in extra):
            return None
        return t.contract(list(ins), wide, box.params.get("scale"))
    if isinstance(box, g.Cast):
        wider = widened(t, ins[0], extra, inner)
        return None if wider is None else t(g.cast(t.ty(wider), ty.dtype), wider)
    if isinstance(box, g.Elementwise) and box.params["fn"] == "add" and all(t.ty(i) == ty for i in ins):
        parts = [widened(t, i, extra, inner) for i in ins]
        return None if None in parts else t.ew("add", *parts, out=wide)
    if callable(on := getattr(box, "linear_on", None)):  # linear in its first input, elementwise along extra
        wider = widened(t, ins[0], extra, inner)
        return None if wider is None else t(on(t.ty(wider)), wider, *ins[1:])
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
    return {
        "lse": (P @ discard(V), lse),
        "delta": (delta_lhs, delta_rhs),
        "row weight": _row_weight_sides(q, x, d),
        "dropout": _dropout_sides(q, x, d),
    }


def _row_weight_sides(q: Axis, x: Axis, d: Axis) -> tuple[Diagram, Diagram]:
    """Both sides of :func:`row_weight_lemma` on ``S[q,x]``, ``L[q]``, ``A[q,d]``, ``V[x,d]``, ``u[q]``,
    ``R[q]``, with the positive weight ``w = exp(u)``: ``(dS, dV)`` = ``(P ⊙ ((A⊙w)·Vᵀ + R), Pᵀ(A⊙w))``,
    ``P = exp(S − L)``, against ``(P′ ⊙ (A·Vᵀ + R/w), P′ᵀA)``, ``P′ = exp(S − (L − log w))``."""
    sides = []
    for folded in (False, True):
        t = Tape()
        S, L, A, V, u, R = (t.input(a) for a in (Array(q, x), Array(q), Array(q, d), Array(x, d), Array(q), Array(q)))
        w = t.ew("exp", u)
        lse = t.ew("subtract", L, t.ew("log", w)) if folded else L
        P = t.ew("exp", t.ew("subtract", S, lse))
        c = A if folded else t.ew("multiply", A, w)
        dP = t.contract([c, V], Array(q, x))
        ds = t.ew("multiply", P, t.ew("add", dP, t.ew("divide", R, w) if folded else R))
        sides.append(t.diagram([ds, t.contract([P, c], Array(x, d))]))
    return sides[0], sides[1]


def _dropout_sides(q: Axis, x: Axis, d: Axis, rate=None) -> tuple[Diagram, Diagram]:
    """Both sides of dropout's backward as :meth:`SoftmaxContract.backward
    <napkin_cat.generators.SoftmaxContract.backward>` writes it and :func:`delta_lemma` and
    :func:`constant_weight_lemma` rewrite it, on ``S[q,x]``, ``L[q]``, ``C[q,d]``, ``V[x,d]`` and a mask ``M[q,x]`` (any
    values: the identity is linear in it), ``Z = M / (1 − rate)``: ``(dS, dV)`` = ``(P ⊙ (dP − Σ_x P ⊙ dP), (P ⊙
    Z)ᵀC)`` with ``dP = (C·Vᵀ) ⊙ Z``, ``P = exp(S − L)``, against ``(P′ ⊙ (dP′ − (1 − rate)·Σ_d C ⊙ O), (P′ ⊙ M)ᵀC)``
    with ``dP′ = (C·Vᵀ) ⊙ M``, ``P′ = exp(S − (L − log(1/(1 − rate))))`` and ``O = (P ⊙ Z)·V`` (``rate`` ½ unless
    given)."""
    rate = sympy.Rational(1, 2) if rate is None else rate  # 1/(1 − rate) = 2
    k, sides = 1 / (1 - rate), []
    for rewritten in (False, True):
        t = Tape()
        S, L, C, V, M = (t.input(a) for a in (Array(q, x), Array(q), Array(q, d), Array(x, d), Array(q, x)))
        P = t.ew("exp", t.ew("subtract", S, L))
        dropped = t.ew("multiply", t.ew("multiply", P, M), const=k)
        CV = t.contract([C, V], Array(q, x))
        if rewritten:
            P1 = t.ew("exp", t.ew("subtract", S, t.ew("subtract", L, const=sympy.log(k))))
            delta = t.contract([C, t.contract([dropped, V], Array(q, d))], Array(q))
            rows = t.ew("multiply", delta, const=1 - rate)
            ds = t.ew("multiply", P1, t.ew("subtract", t.ew("multiply", CV, M), rows))
            dv = t.contract([t.ew("multiply", P1, M), C], Array(x, d))
        else:
            dP = t.ew("multiply", t.ew("multiply", CV, M), const=k)
            ds = t.ew("multiply", P, t.ew("subtract", dP, t.contract([t.ew("multiply", P, dP)], Array(q))))
            dv = t.contract([dropped, C], Array(x, d))
        sides.append(t.diagram([ds, dv]))
    return sides[0], sides[1]


def prove_lemmas(sizes: dict | None = None) -> dict[str, Proof]:
    """Prove the lemmas symbolically (at ``q=1, x=3, d=2`` by default), each over every ordering of the scores.

    >>> {name: proof.identities for name, proof in prove_lemmas().items()}
    {'lse': 3, 'delta': 1, 'row weight': 9, 'dropout': 9}
    """
    sizes = sizes or {"q": 1, "x": 3, "d": 2}
    q, x, d = (Axis(n) for n in ("q", "x", "d"))
    claims = {
        "lse": "softmax_x(S) = exp(S − logsumexp_x S)",
        "delta": "Σ_x P ⊙ (C·Vᵀ) = Σ_d C ⊙ (P·V)",
        "row weight": "P ⊙ ((A⊙w)·Vᵀ + R), Pᵀ(A⊙w) = P′ ⊙ (A·Vᵀ + R/w), P′ᵀA with P′ = exp(S − (L − log w))",
        "dropout": "P ⊙ (dP − Σ_x P ⊙ dP), (P ⊙ Z)ᵀC with dP = (C·Vᵀ) ⊙ Z, Z = M/(1 − p) = P′ ⊙ (dP′ − (1 − p)·Σ_d C ⊙ "
        "((P ⊙ Z)·V)), (P′ ⊙ M)ᵀC with dP′ = (C·Vᵀ) ⊙ M, P′ = exp(S − (L − log(1/(1 − p))))",
    }
    return {k: prove_equivalent(a, b, sizes=sizes, claim=claims[k]) for k, (a, b) in lemmas(q, x, d).items()}
