"""The hand-written FlashAttention-2 backward (Dao 2023, §3.2), kept only as a test oracle.

``lowering._backward`` derives the backward from ``nc.reverse``; these diagrams were written by hand
from the paper (``dS = P ⊙ (dP − Δ)``, ``P = exp(S − L)``) and found in a forward diagram by matching
``Q·Kᵀ → masks → softmax·contract(·, V)``. Tests compare the derived backward's semantics against them.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> parts = attention_parts(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
>>> dq, dkv = backward_diagrams(parts)
>>> print(dq.dom, "→", dq.cod, "|", dkv.cod)
q×d ⊗ x×d ⊗ x×d ⊗ q×d ⊗ q ⊗ q → q×d | x×d ⊗ x×d
"""

from __future__ import annotations

from dataclasses import dataclass

import napkin_cat as nc
from lowering._plan import NotLowerable
from napkin_cat.architectures import Circuit
from napkin_cat.diagram import Array, Diagram
from napkin_cat.generators import Contract, IndexMap, Mask, SoftmaxContract


@dataclass(frozen=True)
class AttentionParts:
    """What the backward needs to know of a forward attention diagram: its wires, axes, scale and masks."""

    Q: Array
    K: Array
    V: Array
    O: Array  # noqa: E741 - the output, named as in the FlashAttention papers
    q: str
    x: str
    scale: object
    masks: tuple
    layer: int  # the softmax·contract's layer, the diagram's last


def _plain(a: Array) -> Array:
    return a.with_(axes=[x.unlabelled() for x in a.axes], level=nc.HBM)


def attention_parts(d: Diagram) -> AttentionParts:
    """Find ``Q·Kᵀ → masks → softmax·contract(·, V)`` in ``d``: inputs ``Q, K, V``, the one output its result.

    Raises :class:`NotLowerable` naming what does not match (the lowered backward covers only this form).
    """
    found = [j for j, (_, b, _) in enumerate(d.inside) if isinstance(b, SoftmaxContract)]
    if len(found) != 1:
        raise NotLowerable(f"no lowered backward: expected one softmax·contract box, found {len(found)}")
    j = found[0]
    left, sc, _ = d.inside[j]
    if j != len(d.inside) - 1 or len(d.cod) != 1:  # a box after it would need its own derivative
        after = ", ".join(repr(b.name) for _, b, _ in d.inside[j + 1 :]) or f"outputs {d.cod}"
        raise NotLowerable(f"no lowered backward: the kernel's one output must be the softmax·contract's, got {after}")
    masks, (i, _) = [], d.producer(j, len(left))
    while i is not None and isinstance(d.inside[i][1], Mask | IndexMap):
        box = d.inside[i][1]
        if isinstance(box, IndexMap):
            raise NotLowerable(f"no lowered backward through score modifier {box.name!r}; pass backward='reference'")
        masks.append(box.params["mask"])
        i, _ = d.producer(i, len(d.inside[i][0]))
    if i is None or not isinstance(d.inside[i][1], Contract):
        raise NotLowerable("no lowered backward: the scores of the softmax·contract are not a contraction Q·Kᵀ")
    qk = d.inside[i][1]
    Q, K = map(_plain, qk.dom.inside)
    V = _plain(sc.dom.inside[1])
    if [_plain(w) for w in d.dom.inside] != [Q, K, V]:
        raise NotLowerable(f"no lowered backward: the kernel's inputs must be Q, K, V of its attention, got {d.dom}")
    x = sc.params["axis"]
    tiled = [a.name for a in sc.dom.inside[0].axes if a.group is not None]
    if len(tiled) != 1:
        raise NotLowerable(f"no lowered backward: expected one tiled query axis in the scores, got {tiled}")
    return AttentionParts(
        Q, K, V, _plain(d.cod.inside[0]), tiled[0], x, qk.params.get("scale"), tuple(reversed(masks)), j
    )


def backward_diagrams(p: AttentionParts) -> tuple[Diagram, Diagram]:
    """The naive diagrams of ``dQ`` and of ``(dK, dV)`` per query head, from the generators.

    Inputs of both: ``Q, K, V, dO, L, Δ``; ``e`` is the query/key head dim, ``d`` the value head dim.
    """
    Q, K, V, q, x = p.Q, p.K, p.V, p.q, p.x
    dt = Q.dtype
    axes = {a.name: a for w in (Q, K, V, p.O) for a in w.axes}
    e, d = Q.names[-1], V.names[-1]
    bq = [n for n in Q.names if n not in (q, e)]
    S = Array(*(axes[n] for n in (*bq, q, x)))
    rows = Array(*(axes[n] for n in (*bq, q)))
    spec = lambda a, b, c: f"{a}, {b} -> {c}"  # noqa: E731 - an einsum over named axes
    sq, sk = " ".join((*bq, q)), " ".join(K.names[:-2])
    qe, ke, qx = f"{sq} {e}", f"{sk} {x} {e}".strip(), f"{sq} {x}"
    od, vd = f"{sq} {d}", f"{sk} {x} {d}".strip()
    ax = list(axes.values())

    def scores(c: Circuit):
        c.let("S", nc.contract(spec(qe, ke, qx), *ax, scale=p.scale, dtype=dt, out_dtype=nc.f32), "Q", "K")
        name = "S"
        for i, m in enumerate(p.masks):
            c.let(f"S{i}", nc.mask(S, m), name)
            name = f"S{i}"
        c.let("E", nc.subtract(S, rows), name, "L")
        c.let("P", nc.exp(S), "E")
        c.let("dP", nc.contract(spec(od, vd, qx), *ax, dtype=dt, out_dtype=nc.f32), "dO", "V")
        c.let("T", nc.subtract(S, rows), "dP", "D")
        c.let("dS", nc.multiply(S, S), "P", "T")
        c.let("dSc", nc.cast(S, dt), "dS")

    inputs = dict(Q=Q, K=K, V=V, dO=p.O.with_(dtype=dt), L=rows, D=rows)
    c = Circuit(**inputs)
    scores(c)
    c.let("dQ", nc.contract(spec(qx, ke, qe), *ax, scale=p.scale, dtype=dt, out_dtype=dt), "dSc", "K")
    dq = c.diagram("dQ")
    c = Circuit(**inputs)
    scores(c)
    c.let("Pc", nc.cast(S, dt), "P")
    xd, xe = (f"{' '.join(bq)} {x} {n}".strip() for n in (d, e))
    c.let("dV", nc.contract(spec(qx, od, xd), *ax, dtype=dt, out_dtype=nc.f32), "Pc", "dO")
    c.let("dK", nc.contract(spec(qx, qe, xe), *ax, scale=p.scale, dtype=dt, out_dtype=nc.f32), "dSc", "Q")
    return dq, c.diagram("dK", "dV")
