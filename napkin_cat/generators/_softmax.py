"""Softmax and the normalised contractions it fuses into (FAN's softmax-contraction lemma; the
spherical-attention paper's normalised contraction), with their online accumulators.

>>> from napkin_cat import axes, Array
>>> q, x = axes("q x")
>>> softmax(Array(q, x), x).accumulator("x") is None  # softmax alone leaves x unreduced
True
"""

from __future__ import annotations

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Template, Ty
from napkin_cat.dtypes import f32
from napkin_cat.errors import AxisError
from napkin_cat.generators._base import Accumulator, Generator, align, contraction_size, einsum_spec
from napkin_cat.generators._dropout import FLOPS as DROPOUT_FLOPS
from napkin_cat.generators._dropout import dropout as dropout_box
from napkin_cat.generators._elementwise import Partial
from napkin_cat.generators._reduce import reduce_sum


def _safe(xp, m):
    return xp.where(xp.isneginf(m), 0, m)


def safe_softmax(xp, v, i: int):
    """Softmax of ``v`` along axis ``i`` in namespace ``xp``; fully masked rows give 0, never NaN.

    >>> from napkin_cat.generators import JAX
    >>> safe_softmax(JAX, JAX.asarray([[0.0, 0.0], [-JAX.inf, -JAX.inf]]), 1).tolist()
    [[0.5, 0.5], [0.0, 0.0]]
    """
    m = xp.expand_dims(_safe(xp, xp.max(v, i)), i)
    e = xp.exp(v - m)
    z = xp.expand_dims(xp.sum(e, i), i)
    return e / xp.where(z == 0, 1, z)


def _name(f) -> str:
    return getattr(f, "__name__", "f")


def softmax_backward(t, P: str, dP: str | None, axis: str, dlse: str | None = None, share=1) -> str:
    """``dS = P ⊙ (dP − Σ_axis P ⊙ dP)`` (plus ``P ⊙ dlse`` for a log-sum-exp output), on the tape ``t``. With a
    ``share`` other than 1, ``P`` is the probabilities divided by it and ``dP`` the cotangent of ``P`` multiplied
    by it (dropout's ``P/(1 − rate)`` and its mask alone, ``share = 1 − rate``): ``dS = P ⊙ (dP − share·Σ_axis P ⊙ dP
    + share·dlse)``, the share on row values only, none per score."""
    S = t.ty(P)

    def shared(rows):
        return rows if share == 1 else t.ew("multiply", rows, const=share)

    u = None
    if dP is not None:
        u = t.ew("subtract", dP, shared(t(reduce_sum(S, axis), t.ew("multiply", P, dP))), out=S)
    if dlse is not None:
        u = shared(dlse) if u is None else t.ew("add", u, shared(dlse), out=S)
    return t.ew("multiply", P, u, out=S)


class Softmax(Generator):
    """Softmax over one axis, in f32. Not streamable alone: its output keeps the axis.

    >>> from napkin_cat import axes
    >>> softmax(Array(*axes("n")), "n").flops()
    4*n
    """

    family, symbol, normalises = "reduction", "P", True

    @property
    def mixes(self):
        return (self.params["axis"],)

    def evaluate(self, ins, ctx):
        (v,), xp = ins, ctx.xp
        i = self.dom.inside[0].names.index(self.params["axis"])
        return [xp.cast(safe_softmax(xp, xp.f32(v), i), self.out.dtype)]

    def flops(self):
        return 4 * self.out.size  # max, subtract, sum, divide

    def transcendentals(self):
        return self.out.size

    def lines(self, prog, ins, outs):
        return [(f"{prog.ix(outs[0])} = softmax_{self.params['axis']} {prog.ix(ins[0])}", outs, ins)]

    def backward(self, t, ins, outs, cts):
        return [softmax_backward(t, outs[0], cts[0], self.params["axis"])]


def softmax(a: Array | Axis | str, axis: Axis | str | None = None) -> Softmax | Template:
    """Softmax of an array over ``axis``; ``softmax(axis)`` alone is a template for ``>>``.

    >>> from napkin_cat import axes, Array
    >>> q, x = axes("q x")
    >>> softmax(Array(q), x)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: softmax over 'x': array q:f32@HBM has no such axis
    """
    if isinstance(a, Axis | str):
        return Template(softmax, a)
    name = getattr(axis, "name", axis)
    if not a.has(name):
        raise AxisError(f"softmax over {name!r}: array {a.describe()} has no such axis")
    return Softmax(f"softmax {name}", Ty(a), Ty(a.with_(dtype=f32)), data=(("axis", name),))


class SoftmaxContract(Generator):
    """Softmax over ``axis`` followed by a contraction over it (FAN's softmax-contraction lemma).

    Inputs: scores ``s`` and values ``v``, both indexed by ``axis``; output ``softmax(s) · v``, and with a
    second output the log-sum-exp of the scores (the backward's residual). With ``("base", 2)`` in its
    data the scores are in base 2 (``s·log₂e``; the kernel uses ``exp2``); with ``("scale", c)`` too, a
    positive ``c``, it reads unscaled scores and takes ``softmax₂(c·s)``: the running max is of ``s``, and
    each score costs one fused multiply-add ``s·c − m·c`` (FlashAttention-3's form) where scaling it first
    costs a multiply of its own. Streamable along ``axis`` with the online-softmax accumulator (running
    max, sum and rescaling). With ``("dropout", drop)`` (a :class:`~napkin_cat.generators.Drop`) it reads a
    third input, the seed, and drops the normalised probabilities before they meet ``v``:
    ``O = (softmax(s) ⊙ M / (1 − rate)) · v`` (:mod:`napkin_cat.generators._dropout`).

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> box = softmax_contract(Array(q, x), Array(x, d), x, Array(q, d))
    >>> box.tensor_flops(), box.in_base2().params["base"], box.in_base2(scale=3).params["scale"]
    (2*d*q*x, 2, 3)
    """

    family, normalises, contracts = "reduction", True, True

    @property
    def base2(self) -> bool:
        """Whether the scores are in base 2."""
        return self.params.get("base") == 2

    def dropped(self, xp, p, ins: list, ctx, scaled: bool = True):
        """The probabilities ``p`` (a block of the scores' wire) after the box's dropout, where it has one (the
        seed is its third input), divided by ``1 − rate`` unless not ``scaled``; ``p`` itself otherwise."""
        drop = self.params.get("dropout")
        wires = self.dom.inside
        return p if drop is None else drop.apply(xp, p, ins[2], ctx, wires[0], wires[2], scaled=scaled)

    @property
    def kept_share(self) -> float:
        """``1 − rate`` of the box's dropout (1 without one): what the online form divides its output by once per
        row, where the dropout's definition divides every kept weight."""
        drop = self.params.get("dropout")
        return 1.0 if drop is None else 1.0 - drop.rate

    def evaluate(self, ins, ctx):
        if self.params.get("probs") is not None:  # P quantised as the kernels round it: the online form, one chunk
            acc = OnlineSoftmax(self, self.params["axis"])
            return acc.finalize(acc.partial(ins, ctx), ctx)
        (s, v, *_), xp = ins, ctx.xp
        s = xp.f32(s)
        if self.base2:
            s = s * ctx.number(self.params.get("scale", 1) * sympy.log(2))
        i = self.dom.inside[0].names.index(self.params["axis"])
        p = xp.like(self.dropped(xp, safe_softmax(xp, s, i), ins, ctx), v)
        dom = Ty(self.dom.inside[0].with_(dtype=f32), self.dom.inside[1])
        out = [xp.cast(xp.einsum(einsum_spec(dom, self.out), p, v), self.out.dtype)]
        if len(self.cod) == 2:  # with the log-sum-exp residual; +inf on fully masked rows
            m = _safe(xp, xp.max(s, i))
            lse = m + xp.log(xp.sum(xp.exp(s - xp.expand_dims(m, i)), i))
            out.append(xp.where(xp.isneginf(lse), xp.inf, lse))
        return out

    def flops(self):
        s, v = self.dom.inside[:2]
        # dropout: its mask per score, its 1/(1 − rate) once per row (with the normaliser, OnlineSoftmax.finalize)
        dropout = DROPOUT_FLOPS * s.size + _row_stat(self).size if "dropout" in self.params else 0
        return 4 * s.size + 2 * contraction_size(s, v, self.out) + dropout

    def transcendentals(self):
        return self.dom.inside[0].size

    def tensor_flops(self):
        return 2 * contraction_size(*self.dom.inside[:2], *self.cod.inside)

    def accumulator(self, axis):
        return OnlineSoftmax(self, axis) if axis == self.params["axis"] else None

    def with_probability_scale(self, scale):
        """This box with its probabilities multiplied by ``scale`` before they meet the values, and their sum alike
        (FP8 attention's scale of the probabilities, cuDNN's ``scale_s``): the output is unchanged in exact
        arithmetic; only the rounding of ``P`` to the values' dtype (e4m3) sees it, which a ``scale`` > 1 keeps out
        of e4m3's subnormals. The kernels add ``log(scale)`` to each row's exponent offset: no work per score.

        >>> from napkin_cat import axes
        >>> q, x, d = axes("q x d")
        >>> softmax_contract(Array(q, x), Array(x, d), x, Array(q, d)).with_probability_scale(256).params["probs"]
        256
        """
        kept = tuple(kv for kv in self.data if kv[0] != "probs")
        return type(self)(self.name, self.dom, self.cod, data=(*kept, ("probs", scale)))

    def in_base2(self, scale=None):
        if self.params.get("base"):
            return None
        extra = (("base", 2),) if scale is None else (("base", 2), ("scale", scale))
        return type(self)(self.name, self.dom, self.cod, data=(*self.data, *extra))

    def with_residual(self):
        """With the log-sum-exp ``L`` as a second output (itself, where it has one; None in base 2).

        >>> from napkin_cat import axes
        >>> q, x, d = axes("q x d")
        >>> print(softmax_contract(Array(q, x), Array(x, d), x, Array(q, d)).with_residual().cod)
        q×d ⊗ q
        """
        if self.base2 or len(self.cod) == 2:
            return None if self.base2 else self
        return type(self)(self.name, self.dom, Ty(self.out, _row_stat(self)), data=self.data)

    def lines(self, prog, ins, outs):
        (s, v, *seed), a = ins, self.params["axis"]
        p = f"softmax_{a}({prog.ix(s)})"
        if seed:
            p = f"dropout({p}, {prog.ix(seed[0])})"
        return [(f"{prog.ix(outs[0])} = Σ_{a} {p}·{prog.ix(v)}", outs, ins)]

    def backward(self, t, ins, outs, cts):
        (s, v, *seed), axis = ins, self.params["axis"]
        ct, dlse = (*cts, None)[:2]
        c = self.params.get("scale", 1) * sympy.log(2)
        if self.base2:
            s = t.ew("multiply", s, const=c)
        P = t(softmax(t.ty(s), axis), s)
        drop = self.params.get("dropout")

        def masked(w):  # the forward's mask on a [scores]-shaped wire, not scaled (the dropout is linear)
            return t(dropout_box(t.ty(w), t.ty(seed[0]), drop, scaled=False), w, seed[0])

        if drop is not None:
            # O = (P ⊙ M)·V / (1 − rate). The constant goes on the probabilities, P′ = P / (1 − rate), which the
            # backward recomputes once a row (exp(S − L′), L′ = L + log(1 − rate): rewrites.constant_weight_lemma):
            # dV = (P′ ⊙ M)ᵀ·dO, and with dP′ = (dO·Vᵀ) ⊙ M the mask alone (dP = dP′ / (1 − rate)),
            # dS = P ⊙ (dP − Σ_x P ⊙ dP) = P′ ⊙ (dP′ − (1 − rate)·Σ_x P′ ⊙ dP′), where Σ_x P′ ⊙ dP′ = Σ_d dO ⊙ O (O
            # the dropped output: rewrites.delta_lemma). Per score the mask's select on P′ and on dP′, no scale.
            P = t.ew("multiply", P, const=drop.scale)
        dP = dv = None
        if ct is not None:
            Pd = P if drop is None else masked(P)
            dP, dv = t.transpose([Pd, v], 0, ct), t.transpose([Pd, v], 1, ct)
            dP = dP if drop is None else masked(dP)
        ds = softmax_backward(t, P, dP, axis, dlse, share=1 if drop is None else 1 - drop.rate)
        return [t.ew("multiply", ds, const=c) if self.base2 else ds, dv, *([None] * len(seed))]


class OnlineSoftmax(Accumulator):
    """Softmax followed by a contraction (FAN §3; FlashAttention's online softmax).

    State ``(m, l, o)``: running max ``m``, running sum ``l = Σ exp(s − m)``, and the unnormalised
    output ``o = Σ exp(s − m) · v``. Combining rescales both sides by ``δ = exp(m_side − m')``.
    Fully masked rows (``m = −∞``) keep ``l = 0`` and finalize to 0, never NaN.

    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> softmax_contract(Array(q, x), Array(x, d), x, Array(q, d)).accumulator("x").padding
    (-inf, 0.0)
    """

    @property
    def padding(self):
        return (-float("inf"), 0.0, *([0] * (len(self.box.dom) - 2)))  # the seed (dropout's) is not streamed

    def _exp(self, ctx):
        """``exp``, or ``exp2`` when the scores are in base 2 (a kernel folds log₂e into their scale)."""
        return ctx.xp.exp2 if self.box.base2 else ctx.xp.exp

    def _c(self, v, ctx):
        """``v`` times the box's score scale, where it has one (the max ``m`` is of unscaled scores, so
        ``exp(s·c − m·c)`` is one fused multiply-add a score)."""
        scale = self.box.params.get("scale")
        return v if scale is None else v * ctx.number(scale)

    def _shift(self, m, ctx):
        """The row offset ``c·m`` of the exponents, less ``log(σ)`` for a box with a probability scale ``σ``
        (:meth:`SoftmaxContract.with_probability_scale`): ``P = σ·exp(c·s − c·m)`` at one subtraction per row."""
        sigma = self.box.params.get("probs")
        if sigma is None:
            return self._c(m, ctx)
        log = sympy.log(sigma, 2) if self.box.base2 else sympy.log(sigma)
        return self._c(m, ctx) - ctx.number(log)

    def _out(self, xp, stat):
        """A row statistic broadcast to the output's axes."""
        return align(xp, stat, self.rows(), self.box.out)

    def _pv(self, xp, p, v):
        dom = Ty(self.box.dom.inside[0].with_(dtype=f32), self.box.dom.inside[1])
        return xp.einsum(einsum_spec(dom, self.box.out), xp.like(p, v), v)

    def partial(self, ins, ctx):
        (s, v, *_), xp, i = ins, ctx.xp, self.at
        s = xp.f32(s)
        m = xp.max(s, i)
        p = self._exp(ctx)(self._c(s, ctx) - xp.expand_dims(self._shift(_safe(xp, m), ctx), i))
        # ℓ sums the undropped weights; the dropout acts on the product with v only (it commutes with the rows'
        # rescaling by δ, a factor per row, so dropping each chunk's weights drops the normalised probabilities), and
        # its 1/(1 − rate), a constant, is left to finalize: one division per row, not a multiply per weight
        return m, xp.sum(p, i), self._pv(xp, self.box.dropped(xp, p, ins, ctx, scaled=False), v)

    def combine(self, a, b, ctx):
        (ma, la, oa), (mb, lb, ob), xp, exp = a, b, ctx.xp, self._exp(ctx)
        m = xp.maximum(ma, mb)
        da, db = exp(self._c(ma - _safe(xp, m), ctx)), exp(self._c(mb - _safe(xp, m), ctx))
        return m, la * da + lb * db, oa * self._out(xp, da) + ob * self._out(xp, db)

    def step(self, state, ins, ctx):
        """FlashAttention-2's update: scores exponentiated once against the new running max."""
        (m, total, o), (s, v, *_), xp, i, exp = state, ins, ctx.xp, self.at, self._exp(ctx)
        s = xp.f32(s)
        m_new = xp.maximum(m, xp.max(s, i))
        delta = exp(self._c(m - _safe(xp, m_new), ctx))
        p = exp(self._c(s, ctx) - xp.expand_dims(self._shift(_safe(xp, m_new), ctx), i))
        pv = self._pv(xp, self.box.dropped(xp, p, ins, ctx, scaled=False), v)
        return m_new, total * delta + xp.sum(p, i), o * self._out(xp, delta) + pv

    def finalize(self, state, ctx):
        (m, total, o), xp = state, ctx.xp
        empty = total == 0
        norm, share = xp.where(empty, 1, total), self.box.kept_share  # the dropout's 1 − rate: once per row
        norm = norm if share == 1.0 else norm * share
        out = [xp.cast(o / self._out(xp, norm), self.box.out.dtype)]
        if len(self.box.cod) == 2:  # the log-sum-exp residual for the backward pass; +inf on empty rows
            # the sum carries the probability scale σ where there is one: the offset's −log σ takes it back out
            lse = (self._shift(m, ctx) + xp.log2(total)) * ctx.number(sympy.log(2)) if self.box.base2 else None
            lse = self._shift(m, ctx) + xp.log(total) if lse is None else lse
            out.append(xp.where(empty, xp.inf, lse))
        return out

    def identity(self, like, ctx):
        return tuple(ctx.xp.full(s.shape, unit) for s, unit in zip(like, (-ctx.xp.inf, 0, 0), strict=True))

    def lines(self, prog, ins, outs):
        (s, v, *_), out, x, ix = ins, outs[0], self.axis, prog.ix
        rows = s.wire.with_(axes=[a for a in s.wire.axes if a.name != x])
        m, sm, o = prog.state("m", rows), prog.state("l", rows), prog.state("o", out.wire)
        mn, dl, p = prog.value("m_new", rows), prog.value("δ", rows), prog.value("P", s.wire)
        scale = self.box.params.get("scale")
        dropped = ix(p) if len(ins) == 2 else f"keep({ix(p)}, {ix(ins[2])})"  # ℓ sums the undropped weights

        def exp(a, b):  # exp(c·(a − b)) under the box's score scale c
            return f"exp({a} − {b})" if scale is None else f"exp({sympy.sstr(scale)}·({a} − {b}))"

        init = [
            (f"{ix(m)} = −∞; {ix(sm)} = 0; {ix(o)} = 0   # online softmax (running max, sum, output)", [m, sm, o], [])
        ]
        loop = [
            (f"{ix(mn)} = max({ix(m)}, max_{x} {ix(s)})", [], [m, s]),
            (f"{ix(dl)} = {exp(ix(m), ix(mn))}   # rescaling", [], [m]),
            (f"{ix(p)} = {exp(ix(s), ix(mn))}", [], [s]),
            (f"{ix(sm)} = {ix(dl)}·{ix(sm)} + Σ_{x} {ix(p)}", [], [sm]),
            (f"{ix(o)} = {ix(dl)}·{ix(o)} + Σ_{x} {dropped}·{ix(v)}", [], [o, v]),
            (f"{ix(m)} = {ix(mn)}", [], [m]),
        ]
        norm = ix(sm) if len(ins) == 2 else f"({ix(sm)}·{self.box.kept_share:g})"  # the dropout's 1 − rate, once a row
        return init, loop, [(f"{ix(out)} = {ix(o)} / {norm}", [out], [o, sm], False, True)]


def softmax_contract(s: Array, v: Array, axis: Axis | str, out: Array, *, dropout=None, seed: Array | None = None
                     ) -> SoftmaxContract:
    """The fused ``softmax(s, axis)`` then contraction with ``v`` over ``axis``, giving ``out``; with ``dropout``
    (a :class:`~napkin_cat.generators.Drop`) and its int32 ``seed`` wire, the probabilities are dropped first.

    >>> from napkin_cat import axes, Array
    >>> from napkin_cat.generators import Drop
    >>> q, x, d = axes("q x d")
    >>> softmax_contract(Array(q, x), Array(x, d), x, Array(q, d)).name
    'softmax·contract x'
    >>> dropped = softmax_contract(Array(q, x), Array(x, d), x, Array(q, d), dropout=Drop(0.1, "q", "x"),
    ...                            seed=Array(dtype="i32"))
    >>> print(dropped.dom)
    q×x ⊗ x×d ⊗ scalar
    >>> dropped.flops() - softmax_contract(Array(q, x), Array(x, d), x, Array(q, d)).flops()  # mask; scale a row
    4*q*x + q
    """
    name = getattr(axis, "name", axis)
    for w in (s, v):
        if not w.has(name):
            raise AxisError(f"softmax_contract over {name!r}: {w.describe()} lacks the axis")
    if dropout is None:
        return SoftmaxContract(f"softmax·contract {name}", Ty(s, v), Ty(out), data=(("axis", name),))
    dropout_box(s, seed, dropout)  # checks the axes it hashes and the seed
    data = (("axis", name), ("dropout", dropout))
    return SoftmaxContract(f"softmax·{dropout.__name__}·contract {name}", Ty(s, v, seed), Ty(out), data=data)


def _row_stat(box) -> Array:
    """A row statistic of ``box``'s scores along the axis it normalises (f32)."""
    s = box.dom.inside[0]
    return s.with_(axes=[a for a in s.axes if a.name != box.params["axis"]], dtype=f32)


class NormalisedContract(Generator):
    """A normalised contraction (spherical-attention paper): ``N(s)ᵢ = a₁(sᵢ) / b(Σⱼ a₂(sⱼ))``, then
    contraction with ``v`` over the axis. Streamable: accumulate ``Σ a₂`` and ``Σ a₁(s)·v``.
    ``a1``, ``a2``, ``b`` are JAX-traceable callables (hashable, e.g. module-level functions).
    With a second output, the sum ``Z = Σⱼ a₂(sⱼ)`` (the backward's residual, :meth:`with_residual`).

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> normalised_contract(Array(q, x), Array(x, d), x, Array(q, d), a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt).flops()
    2*d*q*x + 3*q*x
    """

    family, normalises = "reduction", True

    def evaluate(self, ins, ctx):
        acc = NormalisedContraction(self, self.params["axis"])
        return acc.finalize(acc.partial(ins, ctx), ctx)

    def flops(self):
        s, v = self.dom.inside
        return 3 * s.size + 2 * contraction_size(s, v, self.out)

    def transcendentals(self):
        return self.dom.inside[0].size

    def tensor_flops(self):
        return 2 * contraction_size(*self.dom.inside, *self.cod.inside)

    def accumulator(self, axis):
        return NormalisedContraction(self, axis) if axis == self.params["axis"] else None

    def with_residual(self):
        """With the sum ``Z`` as a second output (itself, where it has one).

        >>> import jax.numpy as jnp
        >>> from napkin_cat import axes
        >>> q, x, d = axes("q x d")
        >>> box = normalised_contract(Array(q, x), Array(x, d), x, Array(q, d), a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt)
        >>> print(box.with_residual().cod)
        q×d ⊗ q
        """
        return (
            self
            if len(self.cod) == 2
            else type(self)(self.name, self.dom, Ty(self.out, _row_stat(self)), data=self.data)
        )

    def lines(self, prog, ins, outs):
        (s, v), a, p = ins, self.params["axis"], self.params
        text = (
            f"{prog.ix(outs[0])} = Σ_{a} {_name(p['a1'])}({prog.ix(s)})·{prog.ix(v)} / "
            f"{_name(p['b'])}(Σ_{a} {_name(p['a2'])}(…))"
        )
        return [(text, outs, ins)]

    def backward(self, t, ins, outs, cts):
        """``O = (a₁(s)·v) / b(Z)`` with ``Z = Σ_axis a₂(s)``: ``Z`` is read from the box with its residual
        (the forward's, where a kernel kept it), never summed again here, so the backward streams."""
        (s, v), p = ins, self.params
        y, Z = outs if len(outs) == 2 else t.apply(self.with_residual(), s, v)
        ct, dz = (*cts, None)[:2]
        S = t.ty(s).with_(dtype=f32)
        rows = S.with_(axes=[a for a in S.axes if a.name != p["axis"]])
        A = t.ew(p["a1"], s, out=S)
        B = t.ew(p["b"], Z, out=rows)
        dAv = t.ew("divide", ct, B, out=t.ty(ct))
        dB = t.ew("neg", t.ew("divide", t.contract([ct, y], rows), B, out=rows))
        dZ = t.ew(Partial(p["b"], 0), dB, Z, out=rows)
        if dz is not None:
            dZ = t.ew("add", dZ, dz, out=rows)
        ds = t.ew(
            "add",
            t.ew(Partial(p["a1"], 0), t.transpose([A, v], 0, dAv), s, out=S),
            t.ew(Partial(p["a2"], 0), dZ, s, out=S),
            out=S,
        )
        return [ds, t.transpose([A, v], 1, dAv)]


class NormalisedContraction(Accumulator):
    """``N(s)ᵢ = a₁(sᵢ)/b(Σⱼ a₂(sⱼ))`` then contraction with ``v`` (the spherical-attention paper):
    the state is ``(Σ a₂(s), Σ a₁(s)·v)``, combined by addition.

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes
    >>> q, x, d = axes("q x d")
    >>> normalised_contract(Array(q, x), Array(x, d), x, Array(q, d), a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt
    ...                     ).accumulator("x")
    NormalisedContraction('normalised·contract x', 'x')
    """

    # padding: scores −∞ (a₁ and a₂ must send them to 0, as a mask's −∞ needs), values 0
    padding = (-float("inf"), 0.0)

    def partial(self, ins, ctx):
        (s, v), xp, p = ins, ctx.xp, self.box.params
        s = xp.f32(s)
        dom = Ty(self.box.dom.inside[0].with_(dtype=f32), self.box.dom.inside[1])
        o = xp.einsum(einsum_spec(dom, self.box.out), xp.lift(p["a1"])(s), xp.f32(v))
        return xp.sum(xp.lift(p["a2"])(s), self.at), o

    def combine(self, a, b, ctx):
        return a[0] + b[0], a[1] + b[1]

    def finalize(self, state, ctx):
        (z, o), xp = state, ctx.xp
        b = align(xp, xp.lift(self.box.params["b"])(z), self.rows(), self.box.out)
        return [xp.cast(o / b, self.box.out.dtype)] + ([z] if len(self.box.cod) == 2 else [])

    def identity(self, like, ctx):
        return ctx.xp.full(like[0].shape, 0), ctx.xp.full(like[1].shape, 0)

    def lines(self, prog, ins, outs):
        (s, v), out, x, ix = ins, outs[0], self.axis, prog.ix
        z = prog.state("z", s.wire.with_(axes=[a for a in s.wire.axes if a.name != x]))
        o = prog.state("o", out.wire)
        a1, a2, b = (_name(self.box.params[k]) for k in ("a1", "a2", "b"))
        return (
            [(f"{ix(z)} = 0; {ix(o)} = 0   # normalised contraction (sum, output)", [z, o], [])],
            [(f"{ix(z)} += Σ_{x} {a2}({ix(s)})", [], [z, s]), (f"{ix(o)} += Σ_{x} {a1}({ix(s)})·{ix(v)}", [], [o, v])],
            [(f"{ix(out)} = {ix(o)} / {b}({ix(z)})", [out], [o, z], False, True)],
        )


def normalised_contract(s: Array, v: Array, axis: Axis | str, out: Array, *, a1, a2, b) -> NormalisedContract:
    """A normalised contraction along ``axis`` (softmax without the max shift is ``a1=a2=exp, b=id``).

    >>> import jax.numpy as jnp
    >>> from napkin_cat import axes, Array
    >>> q, x, d = axes("q x d")
    >>> normalised_contract(Array(q, x), Array(x, d), x, Array(q, d), a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt).name
    'normalised·contract x'
    """
    name = getattr(axis, "name", axis)
    for w in (s, v):
        if not w.has(name):
            raise AxisError(f"normalised_contract over {name!r}: {w.describe()} lacks the axis")
    data = (("axis", name), ("a1", a1), ("a2", a2), ("b", b))
    return NormalisedContract(f"normalised·contract {name}", Ty(s, v), Ty(out), data=data)
