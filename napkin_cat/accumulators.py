"""Accumulators: what makes a generator streamable (FAN §3, the stream partition).

A generator ``f`` is streamable along an axis when an accumulator ``B`` satisfies
``B(f(x), y) = f(x ⊕ y)``, ``⊕`` being concatenation along the axis. We write ``B`` as a monoid on
*states*: ``partial(x)`` is the state of one chunk, ``combine`` merges two states associatively,
``finalize`` turns a state into the generator's outputs, so that
``finalize(combine(partial(x), partial(y))) == f(x ⊕ y)``. A streamed loop starts from
``identity`` (or the first chunk) and folds ``step(state, chunk) = combine(state, partial(chunk))``;
an accumulator may override ``step`` with a fused update that does less work.

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array, reduce_max
>>> from napkin_cat.generators import Context
>>> (n,) = axes("n")
>>> acc = reduce_max(Array(n), n).accumulator("n")
>>> ctx = Context()
>>> x, y = jnp.array([1., 5.]), jnp.array([3., 2.])
>>> acc.finalize(acc.combine(acc.partial([x], ctx), acc.partial([y], ctx)), ctx)
[Array(5., dtype=float32)]
"""

from __future__ import annotations

import jax.numpy as jnp


class Accumulator:
    """The accumulator of ``box`` along ``axis``; inputs not indexed by the axis are loop-invariant."""

    def __init__(self, box, axis: str):
        self.box, self.axis = box, axis

    def streamed_inputs(self) -> tuple[bool, ...]:
        """Which of the box's inputs are indexed by the streamed axis (chunked in the loop)."""
        return tuple(w.has(self.axis) for w in self.box.dom.inside)

    #: per input, the value that padding along the streamed axis must hold to contribute nothing
    padding: tuple = ()

    def partial(self, ins, ctx):
        raise NotImplementedError

    def combine(self, a, b):
        raise NotImplementedError

    def finalize(self, state, ctx) -> list:
        raise NotImplementedError

    def identity(self, like):
        """The neutral state shaped like the state ``like`` (a state or its ``jax.ShapeDtypeStruct``s)."""
        raise NotImplementedError

    def step(self, state, ins, ctx):
        return self.combine(state, self.partial(ins, ctx))

    def __repr__(self):
        return f"{type(self).__name__}({self.box.name!r}, {self.axis!r})"


class Monoid(Accumulator):
    """A reduction by a monoid (sum, max, min): the state is the partial reduction."""

    def __init__(self, box, axis, fn, unit):
        super().__init__(box, axis)
        self.fn, self.unit = fn, unit
        self.padding = (unit,)

    def partial(self, ins, ctx):
        i = self.box.dom.inside[0].names.index(self.axis)
        return self.fn(ins[0].astype(jnp.float32), axis=i)

    def combine(self, a, b):
        return self.fn(jnp.stack([a, b]), axis=0)

    def finalize(self, state, ctx):
        return [state.astype(self.box.out.dtype.jnp)]

    def identity(self, like):
        return jnp.full(like.shape, self.unit, jnp.float32)


class ContractionSum(Accumulator):
    """A contraction over the streamed axis (split-K): the state is the partial sum, in f32."""

    @property
    def padding(self):
        return (0.0,) * len(self.box.dom)

    def partial(self, ins, ctx):
        from napkin_cat.generators import einsum_spec

        return ctx.einsum(einsum_spec(self.box.dom, self.box.out), *ins)

    def combine(self, a, b):
        return a + b

    def finalize(self, state, ctx):
        scale = self.box.params.get("scale")
        if scale is not None:
            state = state * ctx.number(scale)
        return [state.astype(self.box.out.dtype.jnp)]

    def identity(self, like):
        return jnp.zeros(like.shape, jnp.float32)


def _expand(stat, box, axis):
    """Insert the reduced axis back into a per-row statistic so it broadcasts against the scores."""
    return jnp.expand_dims(stat, box.dom.inside[0].names.index(axis))


def _to_out(stat, s_wire, out_wire):
    """Broadcast a row statistic (the scores' axes without the streamed one) to the output's axes."""
    from napkin_cat.generators import _align

    return _align(stat, s_wire, out_wire)


class OnlineSoftmax(Accumulator):
    """Softmax followed by a contraction (FAN §3; FlashAttention's online softmax).

    State ``(m, l, o)``: running max ``m``, running sum ``l = Σ exp(s − m)``, and the unnormalised
    output ``o = Σ exp(s − m) · v``. Combining rescales both sides by ``δ = exp(m_side − m')``.
    Fully masked rows (``m = −∞``) keep ``l = 0`` and finalize to 0, never NaN.
    """

    padding = (-jnp.inf, 0.0)

    def _exp(self, ctx):
        """``exp``, or ``exp2`` when the scores are in base 2 (a kernel folds log₂e into their scale)."""
        return jnp.exp2 if self.box.params.get("base") == 2 else ctx.exp

    def _rows(self):
        s = self.box.dom.inside[0]
        return s.with_(axes=[a for a in s.axes if a.name != self.axis])

    def partial(self, ins, ctx):
        from napkin_cat.diagram import Ty
        from napkin_cat.dtypes import f32
        from napkin_cat.generators import einsum_spec

        s, v = ins
        s = s.astype(jnp.float32)
        i = self.box.dom.inside[0].names.index(self.axis)
        m = jnp.max(s, axis=i)
        p = self._exp(ctx)(s - _expand(_safe(m), self.box, self.axis))
        dom = Ty(self.box.dom.inside[0].with_(dtype=f32), self.box.dom.inside[1])
        o = ctx.einsum(einsum_spec(dom, self.box.out), p.astype(v.dtype), v)
        return m, jnp.sum(p, axis=i), o

    def combine(self, a, b):
        (ma, la, oa), (mb, lb, ob) = a, b
        m = jnp.maximum(ma, mb)
        da, db = jnp.exp(ma - _safe(m)), jnp.exp(mb - _safe(m))
        rows, out = self._rows(), self.box.out
        return m, la * da + lb * db, oa * _to_out(da, rows, out) + ob * _to_out(db, rows, out)

    def step(self, state, ins, ctx):
        """FlashAttention-2's update: scores exponentiated once against the new running max."""
        from napkin_cat.diagram import Ty
        from napkin_cat.dtypes import f32
        from napkin_cat.generators import einsum_spec

        m, l, o = state
        s, v = ins
        s = s.astype(jnp.float32)
        i = self.box.dom.inside[0].names.index(self.axis)
        m_new = jnp.maximum(m, jnp.max(s, axis=i))
        exp = self._exp(ctx)
        delta = exp(m - _safe(m_new))
        p = exp(s - _expand(_safe(m_new), self.box, self.axis))
        dom = Ty(self.box.dom.inside[0].with_(dtype=f32), self.box.dom.inside[1])
        pv = ctx.einsum(einsum_spec(dom, self.box.out), p.astype(v.dtype), v)
        return m_new, l * delta + jnp.sum(p, axis=i), o * _to_out(delta, self._rows(), self.box.out) + pv

    def finalize(self, state, ctx):
        m, l, o = state
        safe = _to_out(jnp.where(l == 0, 1.0, l), self._rows(), self.box.out)
        out = [(o / safe).astype(self.box.out.dtype.jnp)]
        if len(self.box.cod) == 2:  # the log-sum-exp residual for the backward pass; +inf on empty rows
            base2 = self.box.params.get("base") == 2
            lse = (m + jnp.log2(l)) * jnp.log(2.0) if base2 else m + jnp.log(l)
            out.append(jnp.where(l == 0, jnp.inf, lse))
        return out

    def identity(self, like):
        m, l, o = like
        return (
            jnp.full(m.shape, -jnp.inf, jnp.float32),
            jnp.zeros(l.shape, jnp.float32),
            jnp.zeros(o.shape, jnp.float32),
        )


def _safe(m):
    return jnp.where(jnp.isneginf(m), 0.0, m)


class NormalisedContraction(Accumulator):
    """``N(s)ᵢ = a₁(sᵢ)/b(Σⱼ a₂(sⱼ))`` then contraction with ``v`` (the spherical-attention paper):
    the state is ``(Σ a₂(s), Σ a₁(s)·v)``, combined by addition."""

    def partial(self, ins, ctx):
        from napkin_cat.diagram import Ty
        from napkin_cat.dtypes import f32
        from napkin_cat.generators import einsum_spec

        p = self.box.params
        s, v = ins
        s = s.astype(jnp.float32)
        i = self.box.dom.inside[0].names.index(self.axis)
        dom = Ty(self.box.dom.inside[0].with_(dtype=f32), self.box.dom.inside[1])
        o = jnp.einsum(einsum_spec(dom, self.box.out), p["a1"](s), v.astype(jnp.float32))
        return jnp.sum(p["a2"](s), axis=i), o

    def combine(self, a, b):
        return a[0] + b[0], a[1] + b[1]

    def finalize(self, state, ctx):
        z, o = state
        z = _to_out(self.box.params["b"](z), self._rows(), self.box.out)
        return [(o / z).astype(self.box.out.dtype.jnp)]

    _rows = OnlineSoftmax._rows

    def identity(self, like):
        return jnp.zeros(like[0].shape, jnp.float32), jnp.zeros(like[1].shape, jnp.float32)
