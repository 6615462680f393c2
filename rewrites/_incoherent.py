"""Rotate both operands of a contraction by the normalised Hadamard transform of the contracted axis:
``incoherent(d)``.

rewrite: ``Σ_d x[…, d]·y[…, d]``  →  ``Σ_d (x·H/√n)[…, d]·(y·H/√n)[…, d]``.

``H/√n`` is orthogonal, so ``(x·H/√n)·(y·H/√n)ᵀ = x·(H·Hᵀ/n)·yᵀ = x·yᵀ``: the contraction's value is unchanged, exactly
in real arithmetic (:func:`rewrites.prove_equivalent` proves it over symbols). What changes is the operands: an
outlier entry of ``d`` is spread over all ``n`` of them, and so is the error rounding them to a narrow format
(FP8's three mantissa bits) puts into the contraction, where it landed whole on the few values the outlier entered.
This is FlashAttention-3's incoherent processing (Shah et al. 2024, §3.3), applied to ``Q·Kᵀ`` before q and k are
quantised (:func:`lowering.fp8_quantize` runs the boxes this rule inserts). Side
conditions: some contraction of two operands reduces ``d``, and ``d``'s size, where a number, is a power of two.

>>> import napkin_cat as nc
>>> q, x, d = nc.axes("q x d")
>>> rotated = incoherent(d)(nc.library.attention(q, x, d))
>>> [b.name for b in rotated.boxes if isinstance(b, nc.generators.Hadamard)]
['hadamard d', 'hadamard d']
>>> incoherent(q)(nc.library.attention(q, x, d))
Traceback (most recent call last):
...
rewrites._rule.RewriteError: incoherent(q): axis 'q': no contraction of two operands that both hold q reduces it \
(the rotation must meet itself: H·Hᵀ = n·I)
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram
from napkin_cat.errors import EvaluationError
from rewrites._rule import AxisRule


@dataclass(frozen=True, repr=False)
class incoherent(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """Put the normalised Hadamard transform of ``axis`` on both operands of every contraction reducing it
    (see the module).

    >>> incoherent("d")
    incoherent(d)
    """

    def apply(self, d: Diagram) -> Diagram:
        t, k, rotated = Tape(), self.name, []

        def step(i, box, ins):
            if isinstance(box, g.Contract) and k in box.reduced and len(ins) == 2:
                if all(k in t.ty(w).names for w in ins):
                    try:
                        ins = [t(g.hadamard(t.ty(w), k), w) for w in ins]
                    except EvaluationError as e:
                        raise self.fail(str(e), box=box.name, axis=k) from None
                    rotated.append(box.name)
            return t.apply(box, *ins)

        outs = d.dataflow([t.input(a, "x") for a in d.dom.inside], step)
        if not rotated:
            raise self.fail(
                f"no contraction of two operands that both hold {k} reduces it (the rotation must meet itself: "
                "H·Hᵀ = n·I)",
                axis=k,
            )
        return t.diagram(list(outs))
