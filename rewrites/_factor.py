"""Factor a row scaling out of a contraction: ``factor_row_scale(k)``.

rewrite: ``(A ⊙ r) ⋯ ; Σ_k``  →  ``A ⋯ ; Σ_k ; ⊙ r``, where ``r`` lacks ``k``.

A product with an array ``r`` that lacks the contracted axis ``k`` (a row statistic: RMS norm's
``1/rms(x)[n]``) commutes with the contraction over ``k``: ``Σ_k (x[n,k]·r[n]) W[k,m] = r[n]·Σ_k x[n,k] W[k,m]``,
and with the products and casts between them (``(x ⊙ r) ⊙ γ = (x ⊙ γ) ⊙ r``). Moved after the contraction, ``r``
is needed only once the contraction is done, so the whole row of ``x`` that ``r`` is computed from no longer has
to be read before the contraction starts: ``stream(k)`` then accumulates ``Σ_k x²`` and ``Σ_k (x ⊙ γ)·W`` side by
side and scales at the end (a norm fused into the matmul after it). Side conditions: some product with an array
lacking ``k`` (and holding only axes of the other factor) reaches, through products and casts only, a contraction
over ``k`` whose output holds the array's axes. A cast between them rounds ``x ⊙ γ`` rather than ``x ⊙ γ ⊙ r``:
equal up to the cast's rounding, which :func:`rewrites.derive`'s verification measures.

>>> import napkin_cat as nc
>>> n, d, m = nc.axes("n d m")
>>> fused = factor_row_scale(d)(nc.library.rms_norm_linear(n, d, m))
>>> [b.name for b in fused.boxes if not b.name.startswith(("Copy", "Swap"))][-2:]
['n d, d m → n m', 'multiply']
>>> factor_row_scale("m")(nc.library.rms_norm_linear(n, d, m))
Traceback (most recent call last):
...
rewrites._rule.RewriteError: factor_row_scale(m): axis 'm': no product with an array lacking m reaches a \
contraction over m through products and casts only
"""

from __future__ import annotations

from dataclasses import dataclass

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram
from rewrites._rule import AxisRule


@dataclass(frozen=True, repr=False)
class factor_row_scale(AxisRule):  # noqa: N801 - rules are named as verbs, like functions
    """Move every product with an array lacking ``axis`` that reaches a contraction over ``axis`` after it
    (see the module).

    >>> factor_row_scale("d")
    factor_row_scale(d)
    """

    def apply(self, d: Diagram) -> Diagram:
        t, k, moved = Tape(), self.name, []
        # a value is (wire, row): the wire times the row array still to multiply it by (None: nothing pending)
        values = [(t.input(a, "x"), None) for a in d.dom.inside]

        def settle(v):
            wire, row = v
            return wire if row is None else t.ew("multiply", wire, row, out=t.ty(wire))

        def step(i, box, ins):
            pending = [v for v in ins if v[1] is not None]
            if _product(box) and not pending and (split := self._row(t, box, ins)) is not None:
                return [(t.cast(split[0], box.cod.inside[0].dtype), split[1])]
            if len(pending) == 1 and _product(box) and box.cod.inside[0].axes == t.ty(pending[0][0]).axes:
                wires = [v[0] for v in ins]  # (x ⊙ r) ⊙ γ = (x ⊙ γ) ⊙ r
                base = t(g.elementwise("multiply", *(t.ty(w) for w in wires), out=box.cod.inside[0]), *wires)
                return [(base, pending[0][1])]
            if len(pending) == 1 and isinstance(box, g.Cast):
                return [(t.cast(pending[0][0], box.cod.inside[0].dtype), pending[0][1])]
            row = pending[0][1] if len(pending) == 1 else None
            if row is not None and isinstance(box, g.Contract) and k in box.reduced and self._fits(t, row, box):
                out = t(box, *(v[0] for v in ins))
                moved.append(box.name)
                return [(t.ew("multiply", out, row, out=box.cod.inside[0]), None)]
            return [(w, None) for w in t.apply(box, *(settle(v) for v in ins))]

        outs = d.dataflow(values, step)
        if not moved:
            raise self.fail(
                f"no product with an array lacking {k} reaches a contraction over {k} through products and casts only",
                axis=k,
            )
        return t.diagram([settle(v) for v in outs])

    def _row(self, t: Tape, box, ins) -> tuple[str, str] | None:
        """``(x, r)`` where the product ``box`` multiplies ``x``, holding ``axis`` and every axis of its output, by
        ``r``, lacking ``axis`` (a row array); else None."""
        (a, _), (b, _) = ins
        for x, r in ((a, b), (b, a)):
            tx, tr = t.ty(x), t.ty(r)
            if self.name in tx.names and self.name not in tr.names and tx.axes == box.cod.inside[0].axes:
                if set(tr.names) <= set(tx.names):
                    return x, r
        return None

    def _fits(self, t: Tape, row: str, box) -> bool:
        """Whether the contraction ``box``'s output holds every axis of the row array ``row``."""
        return set(t.ty(row).names) <= set(box.cod.inside[0].names)


def _product(box) -> bool:
    """Whether ``box`` is a plain product of two arrays (no constant)."""
    return (
        isinstance(box, g.Elementwise)
        and box.params["fn"] == "multiply"
        and "const" not in box.params
        and len(box.dom) == 2
    )
