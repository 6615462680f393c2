"""The cost functor at the device level: attention over a mesh of GPUs (docs/multi_device.md; ring attention,
Liu et al. 2023).

A sequence split over ``P`` devices runs ``P`` *pairs* of chunks on each device: its query chunk against
each key chunk. :func:`mesh_cost` reads one pair's FLOPs and bytes from :func:`~napkin_cat.cost` of the
diagram at chunk sizes, then counts, as sympy in the axis sizes:

* per-device FLOPs on the critical path: ``P`` full pairs (not causal); with a causal mask the busiest
  device of the contiguous order runs ``P − ½`` pairs (the last device sees every earlier chunk), the
  balanced (zig-zag) order ``P/2`` on every device;
* communication, per strategy (``exchange``):

  - the ring (``"ppermute"``): the key-indexed inputs of one chunk (K and V) cross one link per step, ``P − 1``
    steps, each overlapped with that step's compute; the backward sends K and V round again with the f32
    accumulators dK, dV, which take one more step home;
  - the all-gather (``"all_gather"``): one gather of every K/V chunk (the same ``P − 1`` chunks in, one latency),
    then local compute, nothing overlapped; the backward gathers again and reduce-scatters dK, dV;
  - Ulysses (``"all_to_all"``, ``heads=``): four all-to-alls (Q, K, V to head groups, O back), each device
    sending ``(P − 1)/P`` of its chunk; the backward four more (dO in; dQ, dK, dV back); none overlapped. The
    compute is the whole sequence on ``H/P`` heads (a causal mask halves it);

* whether it hides: a ring step's transfer (latency + bytes/bandwidth) against its compute bound
  (FLOPs ÷ the device's peak); the collectives of the other two never hide;
* the link's speed: the ring's steps send to one peer at a time, at ``link.bandwidth``; the all-gather's and
  Ulysses' collectives take from every peer at once, at ``link.collective_bandwidth`` (``fanout``: on a switch,
  measured 1.5–1.6× one peer's transfer on 4 H200s, ``papers/flash_attention/ring_attention.py``);
* per-device memory: the query-side chunks, plus two key-side chunks for the ring (the one in use and the
  one in flight), all ``P`` for the all-gather, the whole sequence of ``H/P`` heads for Ulysses.

The link's bandwidth and latency are the system's (``System.link``); :func:`fit_link` fits them to measured
transfer times, and :func:`choose_strategy` picks the cheapest strategy and says why.

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
from napkin_cat.hardware import Interconnect, System

EXCHANGES = ("ppermute", "all_gather")  # as rewrites.ring's ``exchange``
STRATEGIES = {"ring": "ppermute", "all_gather": "all_gather", "ulysses": "all_to_all"}  # strategy → exchange


@dataclass(frozen=True)
class MeshCost:
    """Attention over ``system``'s devices: per-device work and memory, per-link traffic and times (sympy).

    ``flops`` and ``gmem_bytes`` are per device on the critical path; ``link_bytes`` is what crosses one link
    one way in the whole pass; ``transfer_time`` the transfers alone (no compute to hide them); ``comm_time``
    the transfer time not hidden under compute (ring: per step, if it exceeds the step's compute; all-gather
    and Ulysses: all of it); ``time`` the bound ``compute_time + comm_time``.

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
    transfer_time: sympy.Expr = sympy.Integer(0)

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
    heads: str | None = None,
) -> MeshCost:
    """The cost of ``d`` (attention-like: ``keys`` reduced, ``queries`` kept) with both axes split over
    ``system``'s devices, K/V chunks exchanged by ``exchange`` (``"ppermute"`` round the ring or ``"all_gather"``,
    as :class:`rewrites.ring`'s; ``"all_to_all"``: Ulysses over ``heads``, as :class:`rewrites.ulysses`);
    ``balanced`` is the zig-zag order of a causal mask; ``backward`` counts forward and backward. See the module.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H200_X2
    >>> mesh_cost(nc.library.attention(*nc.axes("q x d")), H200_X2, queries="q", keys="y")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: mesh_cost: no input wire has the keys axis 'y'; axes: q, d, x
    """
    if exchange not in (*EXCHANGES, "all_to_all"):
        raise CostError(f"mesh_cost: exchange must be one of {', '.join(EXCHANGES)}, all_to_all, got {exchange!r}")
    sizes = {a.name: a.size for w in d.dom.inside for a in w.axes}
    for role, name in (("queries", queries), ("keys", keys)):
        if name not in sizes:
            raise CostError(f"mesh_cost: no input wire has the {role} axis {name!r}; axes: {', '.join(sizes)}")
    if exchange == "all_to_all":
        return _ulysses(d, system, sizes, queries, keys, heads, backward)
    p, hw = system.devices, system.device
    pair = _chunked(d, {a: sympy.ceiling(sizes[a] / p) for a in (queries, keys)})
    c = cost(pair, hw)
    causal = _causal(d, queries, keys)
    pairs = sympy.Rational(p, 2) if causal and balanced else (p - sympy.Rational(1, 2) if causal else sympy.Integer(p))
    work = _work(backward)
    flops = c.flops * pairs * work
    compute_time = flops / hw.flops(_narrowest(d))
    kv = [w for w in pair.dom.inside if w.has(keys) and not w.has(queries)]
    chunk = sympy.Add(*(w.size * w.dtype.bytes for w in kv))
    dkv = sympy.Add(*(w.size * f32.bytes for w in kv)) if backward else 0  # dK, dV travel with K, V
    own = sympy.Add(*(w.size * w.dtype.bytes for w in (*pair.dom.inside, *pair.cod.inside) if w not in kv))
    if exchange == "ppermute":
        sent = chunk + dkv
        link_bytes = (p - 1) * chunk * (2 if backward else 1) + p * dkv  # the backward's dK, dV take one more step
        step_time = system.transfer_time(sent) if p > 1 else sympy.Integer(0)
        transfer = (p - 1) * step_time + (system.transfer_time(dkv) if backward and p > 1 else 0)
        comm_time = (p - 1) * sympy.Max(0, step_time - compute_time / p)
        hidden, memory = sympy.Le(step_time, compute_time / p), own + 2 * chunk
    else:  # one gather (forward; again in the backward, with the reduce-scatter of dK, dV)
        link_bytes = (p - 1) * (chunk * (2 if backward else 1) + dkv)
        # every peer's chunk at once: the link's collective bandwidth (a switch lets the peers share a device's ports)
        gathers = system.collective_time(link_bytes, count=3 if backward else 1)  # + the backward's gather, scatter
        step_time = transfer = gathers if p > 1 else sympy.Integer(0)
        comm_time, hidden, memory = transfer, sympy.false, own + p * chunk
    return MeshCost(
        system, exchange, flops, c.gmem_bytes * pairs * work, memory, link_bytes, step_time, compute_time,
        comm_time, hidden, transfer,
    )


def _work(backward: bool) -> sympy.Expr:
    return sympy.Rational(7, 2) if backward else sympy.Integer(1)  # forward + backward = 1 + 5/2


def _narrowest(d: Diagram):
    return min((w.dtype for w in d.dom.inside), key=lambda t: t.bytes)


def _ulysses(d: Diagram, system: System, sizes: dict, queries: str, keys: str, heads, backward: bool) -> MeshCost:
    """Ulysses' cost: the whole sequence on ``H/P`` heads; four all-to-alls each way, exposed."""
    if heads not in sizes:
        raise CostError(f"mesh_cost: Ulysses (all_to_all) needs heads= an input axis; got {heads!r}, axes: "
                        f"{', '.join(sizes)}")
    p, hw = system.devices, system.device
    group = _chunked(d, {heads: sympy.ceiling(sizes[heads] / p)})
    c = cost(group, hw)
    half = sympy.Rational(1, 2) if _causal(d, queries, keys) else sympy.Integer(1)  # the mask's half, skipped
    work = _work(backward)
    flops = c.flops * half * work
    compute_time = flops / hw.flops(_narrowest(d))
    # each all-to-all: a device keeps 1/P of its chunk (all heads, N/P positions) and sends the rest
    mine = [w.size * w.dtype.bytes / p for w in (*d.dom.inside, *d.cod.inside)]  # one device's chunk of each
    one_way = sympy.Add(*mine) * sympy.Rational(p - 1, p)
    grads = sympy.Add(*mine) * sympy.Rational(p - 1, p) if backward else 0  # dO in; dQ, dK, dV out
    link_bytes = one_way + grads
    count = 8 if backward else 4
    transfer = system.collective_time(link_bytes, count) if p > 1 else sympy.Integer(0)
    memory = sympy.Add(*(w.size * w.dtype.bytes for w in (*group.dom.inside, *group.cod.inside)))
    return MeshCost(
        system, "all_to_all", flops, c.gmem_bytes * half * work, memory, link_bytes, transfer / count, compute_time,
        transfer, sympy.false, transfer,
    )


def fit_link(measurements, name: str = "fitted", *, fanout=None) -> Interconnect:
    """The link (latency, bandwidth) that best fits measured transfers ``[(bytes, seconds), ...]`` one way over one
    link: least squares of ``seconds = latency + bytes / bandwidth`` (latency ≥ 0). ``fanout``, measured collectives
    ``[(bytes into one device from all its peers, seconds), ...]`` (all-gathers), fits the link's
    ``collective_bandwidth`` the same way. Put it in a system with ``dataclasses.replace(system, link=fit_link(...))``
    so :func:`mesh_cost` predicts with it.

    >>> link = fit_link([(1e6, 12e-6), (1e8, 1.002e-3), (4e8, 4.002e-3)])
    >>> round(link.bandwidth / 1e9), round(link.latency * 1e6), link.fanout
    (100, 2, None)
    >>> round(fit_link([(1e8, 1e-3), (2e8, 2e-3)], fanout=[(3e8, 2e-3), (6e8, 4e-3)]).fanout / 1e9)
    150
    >>> fit_link([(1e6, 1e-5)])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: fit_link: need transfers of at least two sizes, got 1 (bytes, seconds) pairs
    """
    latency, slope = _line(measurements, "transfers")
    gathered = None if fanout is None else 1 / _line(fanout, "fanout collectives")[1]
    return Interconnect(name, 1 / slope, latency, fanout=gathered)


def _line(measurements, what: str) -> tuple[float, float]:
    """Least squares ``seconds = latency + slope · bytes`` over ``measurements`` (latency ≥ 0, slope > 0)."""
    pairs = [(float(b), float(t)) for b, t in measurements]
    if len({b for b, _ in pairs}) < 2:
        raise CostError(f"fit_link: need {what} of at least two sizes, got {len(pairs)} (bytes, seconds) pairs")
    if any(b <= 0 or t <= 0 for b, t in pairs):
        raise CostError(f"fit_link: bytes and seconds must be positive, got {pairs}")
    n = len(pairs)
    mb, mt = sum(b for b, _ in pairs) / n, sum(t for _, t in pairs) / n
    slope = sum((b - mb) * (t - mt) for b, t in pairs) / sum((b - mb) ** 2 for b, _ in pairs)
    latency = mt - slope * mb
    if latency < 0:  # no negative latency: the line through the origin
        latency, slope = 0.0, sum(b * t for b, t in pairs) / sum(b * b for b, _ in pairs)
    if slope <= 0:
        raise CostError(f"fit_link: {what}' time does not grow with bytes in {pairs}; measure larger transfers")
    return latency, slope


def fit_link_bandwidth(measurements) -> float:
    """Bytes/s each way: :func:`fit_link`'s bandwidth.

    >>> round(fit_link_bandwidth([(1e8, 1e-3), (2e8, 2e-3)]) / 1e9)
    100
    """
    return fit_link(measurements).bandwidth


@dataclass(frozen=True)
class StrategyChoice:
    """:func:`choose_strategy`'s answer: the ``strategy``, each one's :class:`MeshCost` at the sizes, and ``why``.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H200_X2
    >>> h, q, x, d = nc.axes("h q x d", h=8, d=128)
    >>> mha = nc.library.multi_head_attention(h, q, x, d, causal=True, dtype="bf16")
    >>> c = choose_strategy(mha, H200_X2, {"q": 4096, "x": 4096}, queries="q", keys="x", heads="h")
    >>> c.strategy in STRATEGIES, sorted(c.costs) == sorted(STRATEGIES)
    (True, True)
    """

    strategy: str
    costs: dict
    why: str

    def __str__(self):
        return f"{self.strategy}: {self.why}"


def choose_strategy(
    d: Diagram, system: System, sizes: dict, *, queries: str, keys: str, heads: str | None = None, **kw
) -> StrategyChoice:
    """The sequence-parallel strategy (``"ring"``, ``"all_gather"``, ``"ulysses"``) with the smallest time bound at
    ``sizes`` (by axis name), then the smaller per-device memory; Ulysses only with ``heads`` given and dividing
    over the devices. ``kw`` as :func:`mesh_cost`'s (``balanced``, ``backward``). ``.why`` states each bound.

    >>> import napkin_cat as nc
    >>> from napkin_cat.hardware import H200_X2
    >>> attn = nc.library.attention(*nc.axes("q x d", d=128), causal=True, dtype="bf16")
    >>> print(choose_strategy(attn, H200_X2, {"q": 131072, "x": 131072}, queries="q", keys="x"))
    ring: ring 3374 µs (compute 3374 µs, transfers 80 µs, hidden); all_gather 3454 µs (compute 3374 µs, \
transfers 80 µs); ulysses: no heads axis
    """
    costs, why_not = {}, {}
    for name, exchange in STRATEGIES.items():
        if exchange == "all_to_all":
            known = {a.name: a.size for w in d.dom.inside for a in w.axes if a.size.is_number}
            size = int(sizes.get(heads, known.get(heads, 0))) or None if heads else None
            if size is None:
                why_not[name] = "no heads axis" if heads is None else f"the size of {heads} is not given"
                continue
            if size % system.devices:
                why_not[name] = f"{size} heads do not divide over {system.devices} devices"
                continue
        c = mesh_cost(d, system, queries=queries, keys=keys, exchange=exchange, heads=heads, **kw)
        costs[name] = c.subs(**sizes)
    best = min(costs, key=lambda k: (float(costs[k].time), float(costs[k].memory_bytes)))

    def said(k, c):
        hides = ", hidden" if bool(c.hidden) else ""
        return (f"{k} {float(c.time) * 1e6:.0f} µs (compute {float(c.compute_time) * 1e6:.0f} µs, transfers "
                f"{float(c.transfer_time) * 1e6:.0f} µs{hides})")

    parts = [said(k, c) for k, c in costs.items()] + [f"{k}: {w}" for k, w in why_not.items()]
    return StrategyChoice(best, costs, "; ".join(parts))


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


__all__ = [
    "EXCHANGES", "STRATEGIES", "MeshCost", "StrategyChoice", "choose_exchange", "choose_strategy", "fit_link",
    "fit_link_bandwidth", "mesh_cost",
]
