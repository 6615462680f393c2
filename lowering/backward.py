"""The backward pass of attention as diagrams, scheduled by the same rewrites and lowered the same way.

FlashAttention-2's split (Dao 2023, §3.2): the forward kernel also emits the log-sum-exp ``L`` of
each score row; with ``Δ = rowsum(dO ⊙ O)``, the backward recomputes ``P = exp(S − L)`` block by
block and

* ``dQ = Σ_x dS·K·scale`` — tile queries, stream keys (the forward's schedule);
* ``dK = Σ_q dSᵀ·Q·scale``, ``dV = Σ_q Pᵀ·dO`` — tile keys, stream queries;

where ``dS = P ⊙ (dO·Vᵀ − Δ)``. Both are built here from the generators (contractions, elementwise
maps, the forward's masks) and derived with ``tile``/``stream``, so they are verified and lowered like
any other diagram. Grouped-query attention computes ``dK``, ``dV`` per query head and sums the group.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from discopy.monoidal import Layer

import napkin_cat as nc
from lowering.plan import NotLowerable
from napkin_cat.architectures import Circuit
from napkin_cat.diagram import Array, Diagram, Ty
from napkin_cat.generators import Contract, IndexMap, Mask, SoftmaxContract


@dataclass(frozen=True)
class AttentionParts:
    """What the backward needs to know of a forward attention diagram."""

    Q: Array
    K: Array
    V: Array
    q: str
    x: str
    scale: object
    masks: tuple
    layer: int  # the softmax·contract's layer


def _plain(a: Array) -> Array:
    return a.with_(axes=[x.unlabelled() for x in a.axes], level=nc.HBM)


def attention_parts(d: Diagram) -> AttentionParts:
    """Find ``Q·Kᵀ → masks → softmax·contract(·, V)`` in ``d``, whose inputs must be ``Q, K, V``."""
    found = [j for j, (_, b, _) in enumerate(d.inside) if isinstance(b, SoftmaxContract)]
    if len(found) != 1:
        raise NotLowerable(f"no lowered backward: expected one softmax·contract box, found {len(found)}")
    j = found[0]
    left, sc, _ = d.inside[j]
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
    return AttentionParts(Q, K, V, tiled[0], x, qk.params.get("scale"), tuple(reversed(masks)), j)


def with_residual(d: Diagram, parts: AttentionParts) -> tuple[Diagram, int]:
    """The forward diagram whose softmax·contract also outputs the log-sum-exp ``L``, and L's position."""
    left, box, right = d.inside[parts.layer]
    s, out = box.dom.inside[0], box.out
    lse = s.with_(axes=[a for a in s.axes if a.name != parts.x], dtype=nc.f32)
    fused = SoftmaxContract(box.name, box.dom, Ty(out, lse), data=box.data)
    layers = list(d.inside[: parts.layer]) + [Layer(left, fused, right)]
    pos = len(left) + 1  # where L is now
    for l2, b2, r2 in d.inside[parts.layer + 1 :]:
        n, k = len(l2), len(b2.dom)
        if n + k <= pos:  # the box lies left of L
            cut = pos - n - k
            layers.append(Layer(l2, b2, r2[:cut] @ Ty(lse) @ r2[cut:]))
            pos += len(b2.cod) - k
        elif n >= pos:  # right of L
            layers.append(Layer(l2[:pos] @ Ty(lse) @ l2[pos:], b2, r2))
        else:
            raise NotLowerable(f"the log-sum-exp residual cannot be routed past box {b2.name!r}")
    cod = d.cod[:pos] @ Ty(lse) @ d.cod[pos:]
    return Diagram(tuple(layers), d.dom, cod, _scan=False), pos


def _names(a: Array, *drop: str) -> str:
    return " ".join(n for n in a.names if n not in drop)


def backward_diagrams(p: AttentionParts) -> tuple[Diagram, Diagram]:
    """The naive diagrams of ``dQ`` and of ``(dK, dV)`` per query head, from the generators."""
    Q, K, V, q, x = p.Q, p.K, p.V, p.q, p.x
    dt = Q.dtype
    axes = {a.name: a for w in (Q, K, V) for a in w.axes}
    bq = [n for n in Q.names if n not in (q, V.names[-1])]
    d = V.names[-1]
    S = Array(*(axes[n] for n in (*bq, q, x)))
    rows = Array(*(axes[n] for n in (*bq, q)))
    spec = lambda a, b, c: f"{a}, {b} -> {c}"  # noqa: E731 - an einsum over named axes
    sq, sk = " ".join((*bq, q)), " ".join(K.names[:-2])
    qd, kd, qx = f"{sq} {d}", f"{sk} {x} {d}".strip(), f"{sq} {x}"
    ax = list(axes.values())

    def scores(c: Circuit):
        c.let("S", nc.contract(spec(qd, kd, qx), *ax, scale=p.scale, dtype=dt, out_dtype=nc.f32), "Q", "K")
        name = "S"
        for i, m in enumerate(p.masks):
            c.let(f"S{i}", nc.mask(S, m), name)
            name = f"S{i}"
        c.let("E", nc.subtract(S, rows), name, "L")
        c.let("P", nc.exp(S), "E")
        c.let("dP", nc.contract(spec(qd, kd, qx), *ax, dtype=dt, out_dtype=nc.f32), "dO", "V")
        c.let("T", nc.subtract(S, rows), "dP", "D")
        c.let("dS", nc.multiply(S, S), "P", "T")
        c.let("dSc", nc.cast(S, dt), "dS")

    inputs = dict(Q=Q, K=K, V=V, dO=Q, L=rows, D=rows)
    c = Circuit(**inputs)
    scores(c)
    c.let("dQ", nc.contract(spec(qx, kd, qd), *ax, scale=p.scale, dtype=dt, out_dtype=dt), "dSc", "K")
    dq = c.diagram("dQ")
    c = Circuit(**inputs)
    scores(c)
    c.let("Pc", nc.cast(S, dt), "P")
    xd = f"{' '.join(bq)} {x} {d}".strip()
    c.let("dV", nc.contract(spec(qx, qd, xd), *ax, dtype=dt, out_dtype=nc.f32), "Pc", "dO")
    c.let("dK", nc.contract(spec(qx, qd, xd), *ax, scale=p.scale, dtype=dt, out_dtype=nc.f32), "dSc", "Q")
    return dq, c.diagram("dK", "dV")


def attention_vjp(fwd_res, dq_kernel, dkv_kernel, p: AttentionParts):
    """``f(Q, K, V)`` with a ``jax.custom_vjp`` whose backward runs the two lowered kernels."""
    d = p.V.names[-1]
    bq = [n for n in p.Q.names if n not in (p.q, d)]
    group = tuple(i for i, n in enumerate(bq) if n not in p.K.names)  # query-head axes K lacks

    @jax.custom_vjp
    def f(Q, K, V):
        return fwd_res(Q, K, V)[0]

    def f_fwd(Q, K, V):
        out, L = fwd_res(Q, K, V)
        return out, (Q, K, V, out, L)

    def f_bwd(res, dO):
        Q, K, V, out, L = res
        dO = dO.astype(Q.dtype)
        delta = jnp.sum(dO.astype(jnp.float32) * out.astype(jnp.float32), axis=p.Q.names.index(d))
        dQ = dq_kernel(Q, K, V, dO, L, delta)
        dK, dV = dkv_kernel(Q, K, V, dO, L, delta)
        if group:
            dK, dV = (jnp.sum(a, axis=group) for a in (dK, dV))
        return dQ.astype(Q.dtype), dK.astype(K.dtype), dV.astype(V.dtype)

    f.defvjp(f_fwd, f_bwd)
    return f
