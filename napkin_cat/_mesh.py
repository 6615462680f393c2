"""The cost functor at the device level: attention over a mesh of GPUs (docs/multi_device.md; ring attention,
Liu et al. 2023).

A sequence split over ``P`` devices runs ``P`` *pairs* of chunks on each device: its query chunk against
each key chunk. :func:`mesh_cost` reads one pair's FLOPs and bytes from :func:`~napkin_cat.cost` of the
diagram at chunk sizes, then counts, as sympy in the axis sizes:

* per-device FLOPs on the critical path: ``P`` full pairs (not causal); with a causal mask the busiest
  device of the contiguous order runs ``P − ½`` pairs (the last device sees every earlier chunk), the
  balanced (zig-zag) order ``P/2`` on every device;
* communication: the key-indexed inputs of one chunk (K and V) cross one link per step, ``P − 1`` steps
  (``ppermute`` around the ring, or a ring ``all_gather`` moving the same bytes before any compute); the
  backward sends K and V round again with the f32 accumulators dK, dV, which take one more step home;
* whether it hides: a ring step's transfer (latency + bytes/bandwidth) against its compute bound
  (FLOPs ÷ the device's peak); the all-gather's transfer never hides (it precedes the kernel);
* per-device memory: the query-side chunks, plus two key-side chunks for the ring (the one in use and the
  one in flight) or all ``P`` for the all-gather.

The backward's FLOPs are 5/2 of the forward's (FlashAttention-2 §3.2: five matmuls to the forward's two).

>>> import napkin_cat as nc
>>> from napkin_cat.hardware import H200_X2
>>> q, x, d = nc.axes("q x d", d=128)
>>> attn = nc.library.attention(q, x, d, causal=True, dtype="bf16")
>>> ring = mesh_cost(attn, H200_X2, queries="q", keys="x")
>>> ring.link_bytes                                   # K and V of one chunk, once: (P − 1) · 2 · x/2 · d · 2 B
512*ceiling(x/2)
>>> n = ring.subs(q=131072, x=131072)
>>> int(n.link_bytes), bool(n.hidden), round(float(n.step_time * 1e6))
(33554432, True, 80)
>>> gather = mesh_cost(attn, H200_X2, queries="q", keys="x", exchange="all_gather").subs(q=131072, x=131072)
>>> bool(gather.hidden), float(gather.time) > float(n.time)
(False, True)
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import sympy

from napkin_cat._cost import cost
from napkin_cat.diagram import Diagram
from napkin_cat.dtypes import f32
from napkin_cat.errors import CostError
from napkin_cat.hardware import System

EXCHANGES = ("ppermute", "all_gather")  # as rewrites.ring's ``exchange``


@dataclass(frozen=True)
class MeshCost:
    """Attention over ``system``'s devices: per-device work and memory, per-link traffic and times (sympy).

    ``flops`` and ``gmem_bytes`` are per device on the critical path; ``link_bytes`` is what crosses one link
    one way in the whole pass; ``comm_time`` the transfer time not hidden under compute (ring: per step, if it
    exceeds the step's compute; all-gather: all of it); ``time`` the bound ``compute_time + comm_time``.

    >>> from napkin_cat.hardware import H200_X2
    >>> MeshCost(H200_X2, "ppermute", *(sympy.Integer(1),) * 7, sympy.true).exchange
    'ppermute'
    """

    system: System
    exchange: str
    flops: sympy.Expr
    gmem_bytes: sympy.Expr
    memory_bytes: sympy.Expr
    link_bytes: sympy.Expr
    step_time: sympy.Expr
    compute_time: sympy.Expr
    comm_time: sympy.Expr
    hidden: sympy.Basic

    @property
    def time(self) -> sympy.Expr:
        """Seconds: the compute bound plus the communication left exposed."""
        return self.compute_time + self.comm_time

    def subs(self, **sizes) -> MeshCost:
        """Every figure with the axis sizes given by name substituted.

        >>> from napkin_cat.hardware import H200_X2
        >>> import napkin_cat as nc
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> mesh_cost(nc.library.attention(q, x, d), H200_X2, queries="q", keys="x").subs(q=8, x=8).link_bytes
        2048
        """
        values = {sympy.Symbol(k, positive=True, integer=True): v for k, v in sizes.items()}
        return replace(
            self,
            **{f.name: getattr(self, f.name).subs(values) for f in fields(self) if f.name not in ("system", "exchange")},  # noqa: E501
        )


def _chunked(d: Diagram, sizes: dict) -> Diagram:
    """``d`` with the axes named in ``sizes`` resized to one device's chunk (partition labels dropped)."""
    return d.map_arrays(lambda w: w.with_(axes=[a.unlabelled().resized(sizes.get(a.name, a.size)) for a in w.axes]))


def _causal(d: Diagram, queries: str, keys: str) -> bool:
    return any(getattr(b, "diagonal", lambda: None)() == (queries, keys) for b in d.boxes)


def mesh_cost(
    d: Diagram,
    system: System,
    *,
    queries: str,
    keys: str,
    exchange: str = "ppermute",
    balanced: bool = False,
    backward: bool = False,
) -> MeshCost:
    """The cost of ``d`` (attention-like: ``keys`` reduced, ``queries`` kept) with both axes split over
    ``system``'s devices, K/V chunks exchanged by ``exchange`` (``"ppermute"`` round the ring or ``"all_gather"``,
    as :class:`rewrites.ring`'s); ``balanced`` is the zig-zag order of a causal mask; ``backward`` counts forward
    and backward. See the module.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H200_X2
    >>> mesh_cost(nc.library.attention(*nc.axes("q x d")), H200_X2, queries="q", keys="y")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: mesh_cost: no input wire has the keys axis 'y'; axes: q, d, x
    """
    if exchange not in EXCHANGES:
        raise CostError(f"mesh_cost: exchange must be one of {', '.join(EXCHANGES)}, got {exchange!r}")
    sizes = {a.name: a.size for w in d.dom.inside for a in w.axes}
    for role, name in (("queries", queries), ("keys", keys)):
        if name not in sizes:
            raise CostError(f"mesh_cost: no input wire has the {role} axis {name!r}; axes: {', '.join(sizes)}")
    p, hw = system.devices, system.device
    pair = _chunked(d, {a: sympy.ceiling(sizes[a] / p) for a in (queries, keys)})
    c = cost(pair, hw)
    causal = _causal(d, queries, keys)
    pairs = sympy.Rational(p, 2) if causal and balanced else (p - sympy.Rational(1, 2) if causal else sympy.Integer(p))
    work = sympy.Rational(7, 2) if backward else sympy.Integer(1)  # forward + backward = 1 + 5/2
    flops = c.flops * pairs * work
    dtype = min((w.dtype for w in d.dom.inside), key=lambda t: t.bytes)
    compute_time = flops / hw.flops(dtype)
    kv = [w for w in pair.dom.inside if w.has(keys) and not w.has(queries)]
    chunk = sympy.Add(*(w.size * w.dtype.bytes for w in kv))
    dkv = sympy.Add(*(w.size * f32.bytes for w in kv)) if backward else 0  # dK, dV travel with K, V
    sent = chunk + dkv
    link_bytes = (p - 1) * chunk * (2 if backward else 1) + p * dkv  # the backward's dK, dV take one more step
    step_time = system.transfer_time(sent) if p > 1 else sympy.Integer(0)
    step_compute = compute_time / p
    own = sympy.Add(*(w.size * w.dtype.bytes for w in (*pair.dom.inside, *pair.cod.inside) if w not in kv))
    if exchange == "ppermute":
        comm_time = (p - 1) * sympy.Max(0, step_time - step_compute)
        hidden, memory = sympy.Le(step_time, step_compute), own + 2 * chunk
    else:
        comm_time, hidden, memory = (p - 1) * step_time, sympy.false, own + p * chunk
    return MeshCost(
        system,
        exchange,
        flops,
        c.gmem_bytes * pairs * work,
        memory,
        link_bytes,
        step_time,
        compute_time,
        comm_time,
        hidden,
    )


def choose_exchange(d: Diagram, system: System, sizes: dict, **kw) -> str:
    """The exchange (``"ppermute"`` or ``"all_gather"``) with the smaller time bound at ``sizes`` (by axis name),
    then the smaller per-device memory; ``kw`` as :func:`mesh_cost`'s. In this model the ring's bound never
    exceeds the all-gather's (the same bytes, hidden or not), so the all-gather is chosen only on a tie in time
    and a smaller memory, which does not happen: it is the alternative a measurement can still pick.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H200_X2
    >>> attn = nc.library.attention(*nc.axes("q x d", d=128), causal=True, dtype="bf16")
    >>> choose_exchange(attn, H200_X2, {"q": 4096, "x": 4096}, queries="q", keys="x")
    'ppermute'
    """
    costs = {e: mesh_cost(d, system, exchange=e, **kw).subs(**sizes) for e in EXCHANGES}
    return min(EXCHANGES, key=lambda e: (float(costs[e].time), float(costs[e].memory_bytes)))


__all__ = ["EXCHANGES", "MeshCost", "choose_exchange", "mesh_cost"]
