"""Relabellings at the device level: a mesh axis is one more level above HBM (docs/multi_device.md).

rewrite: a scheduled diagram  →  the same diagram run per device of a mesh axis (a :class:`Sharded` value).

* :class:`shard` — the group partition over a mesh axis: an axis no box mixes (batch, heads, or queries
  without a mask) is split into ``devices`` groups, one per device; the rest runs as scheduled.
* :class:`ring` — the sequence partition: queries group-partitioned and keys *stream*-partitioned over the
  same mesh axis, the per-device kernel's online-softmax accumulator merged across devices through each
  chunk pair's log-sum-exp (ring attention: K/V chunks travel the ring). ``exchange="all_gather"`` is the
  alternative (every device gathers all K/V chunks first), with the same semantics and another cost.
* :class:`zigzag` — causal load balancing: with ``2P`` chunks, device ``i`` holds chunks ``i`` and
  ``2P − 1 − i``, so every device runs the same work at every ring step (a permutation of the sequence).
* :class:`ulysses` — DeepSpeed-Ulysses (Jacobs et al. 2023): the sequence split over the mesh axis outside the
  kernel, the heads inside it; an all-to-all takes Q, K, V from sequence-sharded to head-sharded, each device
  runs the whole sequence on ``H/P`` heads, and an all-to-all takes the output back (``exchange="all_to_all"``).

A sequence of ``N`` is cut into ``u·P`` chunks of ``⌈N/(u·P)⌉`` (``u = 2`` when balanced), the last padded.
Every chunk pair is one of three kinds: *full* (the diagram without its causal mask), *diagonal* (the
diagram itself: equal chunks at equal offsets, so the local mask is the global one) or *skipped* (after the
diagonal). Padded keys are cut off the pair that holds them, so padding contributes nothing.

Under a causal mask the queries and keys may differ in length: the mask is ``q ≥ x`` on global indices
(top-left aligned, as ``jax.nn.dot_product_attention``'s ``is_causal`` and ``nc.attention``'s). Keys past the
last query are never seen, so they are dropped; with fewer keys than queries the keys are chunked like the
queries (equal chunks at equal offsets) and the chunks past the last key are cut off, as non-causal padding is.

Each rule is verified like any rule (:func:`derive_devices`): :func:`execute_devices` runs the partitioned
algorithm — per device, per ring step, per chunk pair the scheduled semantics (:func:`execute`) of the
pair's diagram with the log-sum-exp output, merged; for Ulysses the two all-to-alls as re-layouts around the
scheduled semantics per head group — on random inputs, against ``to_jax`` of the unpartitioned diagram.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
>>> balanced = derive_devices(flash, ring("q", "x", "sp", 4), zigzag(), seed=0)
>>> print(balanced.sharded)
ring(q, x over sp:4, ppermute), zigzag of q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d
>>> all(s.verification.passed for s in balanced.steps[1:])
True
"""

from __future__ import annotations

import inspect
import math
import os
import random
import time
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from napkin_cat import Tape
from napkin_cat import generators as g
from napkin_cat.diagram import Diagram, Ty
from napkin_cat.dtypes import f32
from rewrites._rule import RewriteError, Rule, axis_names, positive_size
from rewrites._schedule import execute, partitions
from rewrites._stream import streamability
from rewrites._verify import FAST_COMPILE, Trial, Verification, tolerance

EXCHANGES = ("ppermute", "all_gather")  # the ring's; Ulysses' is "all_to_all"


@dataclass(frozen=True)
class Sequence:
    """The sequence partition: ``queries`` grouped and ``keys`` streamed over ``mesh_axis`` of ``devices``.

    >>> print(Sequence("q", "x", "sp", 2))
    ring(q, x over sp:2, ppermute)
    """

    queries: str
    keys: str
    mesh_axis: str
    devices: int
    exchange: str = "ppermute"
    balanced: bool = False
    heads: str | None = None  # Ulysses: the axis split over the devices inside the kernel

    @property
    def units(self) -> int:
        """Chunks per device: 2 when zig-zag balanced, else 1."""
        return 2 if self.balanced else 1

    def owned(self, device: int) -> tuple[int, ...]:
        """The chunk indices device ``device`` holds, in order.

        >>> Sequence("q", "x", "sp", 4, balanced=True).owned(1)
        (1, 6)
        """
        return (device, 2 * self.devices - 1 - device) if self.balanced else (device,)

    def chunk_order(self) -> list[int]:
        """Every chunk index, in the order the devices hold them (device 0's first).

        >>> Sequence("q", "x", "sp", 2, balanced=True).chunk_order()
        [0, 3, 1, 2]
        """
        return [c for device in range(self.devices) for c in self.owned(device)]

    def __str__(self):
        if self.exchange == "all_to_all":
            return f"ulysses({self.queries}, {self.keys} over {self.mesh_axis}:{self.devices}, heads {self.heads})"
        return f"ring({self.queries}, {self.keys} over {self.mesh_axis}:{self.devices}, {self.exchange})" + (
            ", zigzag" if self.balanced else ""
        )


@dataclass(frozen=True)
class Sharded:
    """A scheduled per-device ``diagram`` with its device-level partitions: ``groups`` ``(axis, mesh axis,
    devices)`` and at most one :class:`Sequence`.

    >>> import napkin_cat as nc
    >>> print(Sharded(nc.library.attention(*nc.axes("q x d")), (("q", "dp", 2),)))
    shard(q over dp:2) of q×d ⊗ x×d ⊗ x×d → q×d
    """

    diagram: Diagram
    groups: tuple[tuple[str, str, int], ...] = ()
    sequence: Sequence | None = None

    @property
    def mesh(self) -> dict[str, int]:
        """The mesh axes used, with their sizes."""
        axes = {m: n for _, m, n in self.groups}
        return axes | ({self.sequence.mesh_axis: self.sequence.devices} if self.sequence else {})

    def __str__(self):
        parts = [f"shard({a} over {m}:{n})" for a, m, n in self.groups] + (
            [str(self.sequence)] if self.sequence else []
        )
        return f"{', '.join(parts)} of {self.diagram.dom} → {self.diagram.cod}"


def summed(d: Diagram, axis: str, fail=None) -> tuple[bool, ...]:
    """Which outputs of ``d`` are sums over ``axis`` (so a device holding one group of ``axis`` computes a
    partial sum of them); refused through ``fail(condition, box=, axis=)`` (a :class:`RewriteError`) where a box
    mixes ``axis`` other than by a sum (ContractionSum or a ``sum`` Monoid), or a box other than a cast reads
    such a sum (a function of the partial sums, summed, is not the function of their sum; a cast is, up to its
    dtype's rounding: a 16-bit output's parts are added in 16 bits, as XLA all-reduces 16-bit gradients).

    >>> import napkin_cat as nc
    >>> n, k, m = nc.axes("n k m")
    >>> summed(nc.contract("n k, n m -> k m", n, k, m), "n"), summed(nc.contract("n k, n m -> k m", n, k, m), "k")
    ((True,), (False,))
    >>> summed(nc.contract("n k, n m -> k m", n, k, m) >> nc.cast(nc.Array(k, m), "bf16"), "n")
    (True,)
    """
    fail = fail or (lambda condition, **where: RewriteError("summed", condition, **where))

    def step(i, box, ins):  # a value: the name of the box whose sum over axis it is, or None
        if isinstance(box, g.Cast):  # the sum of the parts' casts: the cast of the sum, to the dtype's rounding
            return list(ins)
        if src := next((v for v in ins if v), None):
            raise fail(
                f"the box reads box {src!r}'s sum over {axis}, of which each device would hold only a part",
                box=box.name,
                axis=axis,
            )
        if not isinstance(box, (g.Generator, g.Reshape)) or axis not in box.mixes:
            return [None] * len(box.cod)
        acc = box.accumulator(axis) if isinstance(box, g.Generator) else None
        if not (isinstance(acc, g.ContractionSum) or (isinstance(acc, g.Monoid) and acc.op == "sum")):
            raise fail(f"the box mixes elements along {axis}, so it is not weaved over it", box=box.name, axis=axis)
        return [box.name] * len(box.cod)

    return tuple(v is not None for v in d.dataflow([None] * len(d.dom), step))


def _sharded(d) -> Sharded:
    return d if isinstance(d, Sharded) else Sharded(getattr(d, "diagram", d))


def _reads(box) -> set[str]:
    """The axes whose global indices ``box`` reads (masks and score modifiers; a box saying it: ``index_reads()``)."""
    if callable(reads := getattr(box, "index_reads", None)):
        return set(reads())
    if not isinstance(box, (g.Mask, g.IndexMap)):
        return set()
    pair = box.diagonal() if isinstance(box, g.Mask) else None
    if pair:
        return set(pair)
    fn = box.params["mask"] if isinstance(box, g.Mask) else box.params["fn"]
    names = list(inspect.signature(fn).parameters)
    return set(names if isinstance(box, g.Mask) else names[1:])


class DeviceRule(Rule):
    """A device-level relabelling: from a diagram (or a :class:`Sharded`) to a :class:`Sharded`.

    >>> import napkin_cat as nc
    >>> isinstance(ring("q", "x", "sp", 2), DeviceRule), isinstance(ring("q", "x", "sp", 2), Rule)
    (True, True)
    """

    def _mesh_free(self, s: Sharded, mesh_axis: str, devices: int):
        if s.mesh.get(mesh_axis, devices) != devices:
            raise self.fail(f"mesh axis {mesh_axis} already has {s.mesh[mesh_axis]} devices, not {devices}")
        if any(m == mesh_axis for _, m, _ in s.groups) or (s.sequence and s.sequence.mesh_axis == mesh_axis):
            raise self.fail(f"mesh axis {mesh_axis} already partitions another axis")


@dataclass(frozen=True)
class shard(DeviceRule):  # noqa: N801 - rules are named as verbs, like functions
    """Group-partition ``axis`` over ``devices`` devices of ``mesh_axis`` (lowered to ``jax.shard_map``).

    Side conditions: ``axis`` is on a wire, no mask or score modifier reads its index, and no box mixes it
    except a sum over it whose result is an output (:func:`summed`): each device sums its group and the
    partial sums are added across devices (an all-reduce), since a sum over a partition of an axis is the sum
    of the sums over its groups. That is data parallelism's weight gradient, Σ over the batch of tokens.

    >>> import napkin_cat as nc
    >>> b, q, x, d = nc.axes("b q x d")
    >>> print(shard("b", "dp", 2)(nc.library.multi_head_attention(b, q, x, d)))
    shard(b over dp:2) of b×q×d ⊗ b×x×d ⊗ b×x×d → b×q×d
    >>> n, k, m = nc.axes("n k m")
    >>> print(shard("n", "dp", 2)(nc.contract("n k, n m -> k m", n, k, m)))
    shard(n over dp:2) of n×k ⊗ n×m → k×m
    >>> shard("q", "sp", 2)(nc.library.attention(q, x, d, causal=True))
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: shard(q, sp, 2): box 'mask causal(q ≥ x)', axis 'q': the box reads the global \
index of q, which one device's group does not know; split the sequence with ring(q, x, ...)
    """

    axis: str
    mesh_axis: str
    devices: int

    def __post_init__(self):
        object.__setattr__(self, "devices", positive_size(repr(self), "devices", self.devices, self.axis))

    def __repr__(self):
        return f"shard({self.axis}, {self.mesh_axis}, {self.devices})"

    def apply(self, d) -> Sharded:
        s, a = _sharded(d), self.axis
        if a not in axis_names(s.diagram):
            raise self.fail(f"no wire has axis {a}; axes here: {', '.join(sorted(axis_names(s.diagram)))}", axis=a)
        summed(s.diagram, a, self.fail)
        for box in s.diagram.boxes:
            if a in _reads(box):
                raise self.fail(
                    f"the box reads the global index of {a}, which one device's group does not know; "
                    "split the sequence with ring(q, x, ...)",
                    box=box.name,
                    axis=a,
                )
        taken = (s.sequence.queries, s.sequence.keys, s.sequence.heads) if s.sequence else ()
        if any(x == a for x, _, _ in s.groups) or a in taken:
            raise self.fail(f"{a} is already partitioned over devices", axis=a)
        self._mesh_free(s, self.mesh_axis, self.devices)
        return replace(s, groups=(*s.groups, (a, self.mesh_axis, self.devices)))


@dataclass(frozen=True)
class ring(DeviceRule):  # noqa: N801
    """Split the sequence over ``mesh_axis``: ``queries`` grouped, ``keys`` streamed (ring attention).

    Side conditions: the per-device schedule streams ``keys`` through a softmax·contract whose output is
    the diagram's only output; ``queries`` is kept by every box; no input is indexed by both; the only
    box reading indices is the causal mask between them.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> ring("q", "x", "sp", 2)(nc.library.attention(q, x, d))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: ring(q, x, sp, 2): axis 'x': the per-device schedule does not stream x; ...
    """

    queries: str
    keys: str
    mesh_axis: str
    devices: int
    exchange: str = "ppermute"

    def __post_init__(self):
        object.__setattr__(self, "devices", positive_size(repr(self), "devices", self.devices, self.keys))
        if self.exchange not in EXCHANGES:
            raise self.fail(f"exchange must be one of {', '.join(EXCHANGES)}, got {self.exchange!r}")

    def __repr__(self):
        extra = "" if self.exchange == "ppermute" else f", exchange={self.exchange!r}"
        return f"ring({self.queries}, {self.keys}, {self.mesh_axis}, {self.devices}{extra})"

    def apply(self, d) -> Sharded:
        s = _sharded(d)
        dg, qn, xn = s.diagram, self.queries, self.keys
        if s.sequence is not None:
            raise self.fail(f"the sequence is already split: {s.sequence}")
        if partitions(dg)[1].get(xn) is None:
            raise self.fail(
                f"the per-device schedule does not stream {xn}; derive it with stream({xn}, s) first", axis=xn
            )
        streamability(dg, xn, repr(self))
        last = dg.boxes[-1] if dg.boxes else None
        if len(dg.cod) != 1 or not (isinstance(last, g.SoftmaxContract) and last.params["axis"] == xn):
            raise self.fail(
                f"the diagram's one output must be the softmax·contract over {xn}: its accumulator is what merges "
                "the devices' partial results",
                axis=xn,
            )
        for box in dg.boxes:
            if isinstance(box, (g.Generator, g.Reshape)) and qn in box.mixes:
                raise self.fail(f"the box mixes elements along {qn}", box=box.name, axis=qn)
            reads = _reads(box)
            if reads & {qn, xn} and getattr(box, "diagonal", lambda: None)() != (qn, xn):
                raise self.fail(
                    f"the box reads global indices ({', '.join(sorted(reads))}); only the causal mask "
                    f"{qn} ≥ {xn} is split into chunk pairs",
                    box=box.name,
                )
        for w in dg.dom.inside:
            if w.has(qn) and w.has(xn):
                raise self.fail(f"the input {w.describe()} is indexed by both {qn} and {xn}", axis=xn)
        if any(a in (qn, xn) for a, _, _ in s.groups):
            raise self.fail(f"{qn} or {xn} is already sharded")
        self._mesh_free(s, self.mesh_axis, self.devices)
        return replace(s, sequence=Sequence(qn, xn, self.mesh_axis, self.devices, self.exchange))


@dataclass(frozen=True)
class zigzag(DeviceRule):  # noqa: N801
    """Balance a causal sequence partition: device ``i`` holds chunks ``i`` and ``2P − 1 − i`` of ``2P``.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> zigzag()(ring("q", "x", "sp", 2)(flash))
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: zigzag: the diagram has no causal mask between q and x: every device already \
runs the same work
    """

    def __repr__(self):
        return "zigzag"

    def apply(self, d) -> Sharded:
        s = _sharded(d)
        if s.sequence is None:
            raise self.fail("no sequence partition to balance; apply ring(q, x, ...) first")
        if s.sequence.exchange == "all_to_all":
            raise self.fail("Ulysses runs the whole sequence on every device: its work is already balanced")
        if s.sequence.balanced:
            raise self.fail("the sequence partition is already balanced")
        if not has_causal_mask(s):
            q, x = s.sequence.queries, s.sequence.keys
            raise self.fail(
                f"the diagram has no causal mask between {q} and {x}: every device already runs the same work"
            )
        return replace(s, sequence=replace(s.sequence, balanced=True))


@dataclass(frozen=True)
class ulysses(DeviceRule):  # noqa: N801
    """Split the sequence over ``mesh_axis`` between kernels and ``heads`` during them (DeepSpeed-Ulysses): Q, K, V
    arrive sequence-sharded, an all-to-all makes them head-sharded, each device runs the scheduled diagram on the
    whole sequence and ``H/P`` heads, an all-to-all takes the output back.

    Side conditions: ``queries``, ``keys`` and ``heads`` are on wires; every input and the output carry ``heads``
    (the all-to-all splits it) and the queries or keys; no box mixes ``heads`` or reads its index; ``heads``
    divides by ``devices`` where its size is known (else at the call).

    >>> import napkin_cat as nc
    >>> h, q, x, d = nc.axes("h q x d", h=6)
    >>> mha = nc.library.multi_head_attention(h, q, x, d, causal=True)
    >>> print(ulysses("q", "x", "h", "sp", 3)(mha))
    ulysses(q, x over sp:3, heads h) of h×q×d ⊗ h×x×d ⊗ h×x×d → h×q×d
    >>> ulysses("q", "x", "h", "sp", 4)(mha)
    Traceback (most recent call last):
    ...
    rewrites._rule.RewriteError: ulysses(q, x, h, sp, 4): axis 'h': 6 heads do not divide over 4 devices; use a \
device count that divides 6, or ring(q, x, sp, 4)
    """

    queries: str
    keys: str
    heads: str
    mesh_axis: str
    devices: int

    def __post_init__(self):
        object.__setattr__(self, "devices", positive_size(repr(self), "devices", self.devices, self.heads))

    def __repr__(self):
        return f"ulysses({self.queries}, {self.keys}, {self.heads}, {self.mesh_axis}, {self.devices})"

    def apply(self, d) -> Sharded:
        s = _sharded(d)
        dg, h = s.diagram, self.heads
        if s.sequence is not None:
            raise self.fail(f"the sequence is already split: {s.sequence}")
        names = axis_names(dg)
        for a in (self.queries, self.keys, h):
            if a not in names:
                raise self.fail(f"no wire has axis {a}; axes here: {', '.join(sorted(names))}", axis=a)
        for w in (*dg.dom.inside, *dg.cod.inside):
            if not w.has(h) or not (w.has(self.queries) or w.has(self.keys)):
                raise self.fail(
                    f"{w.describe()} lacks {h} or the sequence ({self.queries}/{self.keys}): the all-to-all trades "
                    f"one for the other",
                    axis=h,
                )
        for box in dg.boxes:
            if isinstance(box, (g.Generator, g.Reshape)) and h in box.mixes:
                raise self.fail(f"the box mixes elements along {h}", box=box.name, axis=h)
            if h in _reads(box):
                raise self.fail(f"the box reads the global index of {h}", box=box.name, axis=h)
        size = next(a.size for w in dg.dom.inside for a in w.axes if a.name == h)
        if getattr(size, "is_number", True) and int(size) % self.devices:
            raise self.fail(heads_refusal(h, int(size), self.devices, self.queries, self.keys, self.mesh_axis), axis=h)
        if any(a in (self.queries, self.keys, h) for a, _, _ in s.groups):
            raise self.fail(f"{self.queries}, {self.keys} or {h} is already sharded")
        self._mesh_free(s, self.mesh_axis, self.devices)
        split = Sequence(self.queries, self.keys, self.mesh_axis, self.devices, "all_to_all", heads=h)
        return replace(s, sequence=split)


def heads_refusal(heads: str, size: int, devices: int, queries: str, keys: str, mesh_axis: str) -> str:
    """Why Ulysses cannot split ``size`` heads over ``devices``, and the fix.

    >>> heads_refusal("h", 6, 4, "q", "x", "sp")
    '6 heads do not divide over 4 devices; use a device count that divides 6, or ring(q, x, sp, 4)'
    """
    return (
        f"{size} heads do not divide over {devices} devices; use a device count that divides {size}, "
        f"or ring({queries}, {keys}, {mesh_axis}, {devices})"
    )


def has_causal_mask(s: Sharded) -> bool:
    """Whether the sequence partition's diagram has the causal mask between its queries and keys.

    >>> import napkin_cat as nc
    >>> has_causal_mask(Sharded(nc.library.attention(*nc.axes("q x d"), causal=True), (), Sequence("q", "x", "sp", 2)))
    True
    """
    pair = (s.sequence.queries, s.sequence.keys) if s.sequence else None
    return pair is not None and any(getattr(b, "diagonal", lambda: None)() == pair for b in s.diagram.boxes)


def pair_diagrams(s: Sharded, lse: bool = True) -> dict[str, Diagram]:
    """The per-device diagrams of a sequence partition by pair kind: ``"full"`` (the causal mask removed) and,
    when causal, ``"diagonal"`` (the diagram itself); with ``lse``, the softmax·contract's log-sum-exp (f32) as a
    second output beside its output (in the diagram's dtype: :func:`merge_lse` merges the pairs in f32).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
    >>> pairs = pair_diagrams(ring("q", "x", "sp", 2)(flash))
    >>> [(k, len(v.boxes), str(v.cod)) for k, v in pairs.items()]
    [('full', 2, 'q/16×d ⊗ q/16'), ('diagonal', 3, 'q/16×d ⊗ q/16')]
    >>> print(pair_diagrams(ring("q", "x", "sp", 2)(flash), lse=False)["full"].cod)
    q/16×d
    """
    kinds = {"full": True} | ({"diagonal": False} if has_causal_mask(s) else {})
    return {k: _pair(s, unmask, lse) for k, unmask in kinds.items()}


def _pair(s: Sharded, unmask: bool, lse: bool) -> Diagram:
    """The per-device diagram without the causal mask if ``unmask``; with ``lse``, its softmax·contract also
    outputs its log-sum-exp (f32)."""
    seq, t = s.sequence, Tape()
    xs = [t.input(a, "x") for a in s.diagram.dom.inside]

    def step(i, box, ins):
        if unmask and getattr(box, "diagonal", lambda: None)() == (seq.queries, seq.keys):
            return list(ins)
        if lse and isinstance(box, g.SoftmaxContract) and box.params["axis"] == seq.keys and len(box.cod) == 1:
            scores = box.dom.inside[0]
            stat = scores.with_(axes=[a for a in scores.axes if a.name != seq.keys], dtype=f32)
            both = Ty(box.out, stat)  # O in its own dtype (16-bit: Mosaic writes it over Q's tile); merged in f32
            return list(t.apply(g.SoftmaxContract(box.name, box.dom, both, data=box.data), *ins))
        return list(t.apply(box, *ins))

    return t.diagram(s.diagram.dataflow(xs, step))


def merge_lse(a: tuple, b: tuple, names: tuple[str, ...], rows: tuple[str, ...]) -> tuple:
    """Two partial results ``(O, L)`` of the same rows over disjoint keys, merged through their log-sum-exps
    (FlashAttention's rescaling; rows that saw no key have ``L = −∞`` and ``O = 0``). ``names`` are the axes
    of ``O``, ``rows`` those of ``L``.

    >>> o, l = merge_lse((jnp.ones((1, 2)), jnp.zeros(1)), (3 * jnp.ones((1, 2)), jnp.zeros(1)), ("q", "d"), ("q",))
    >>> o.tolist(), round(float(l[0]), 4)
    ([[2.0, 2.0]], 0.6931)
    """
    (oa, la), (ob, lb) = a, b
    m = jnp.maximum(la, lb)
    m0 = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(la - m0), jnp.exp(lb - m0)
    total = wa + wb
    expand = tuple(i for i, n in enumerate(names) if n not in rows)
    ca = jnp.expand_dims(jnp.where(total > 0, wa / jnp.where(total > 0, total, 1.0), 0.0), expand)
    cb = jnp.expand_dims(jnp.where(total > 0, wb / jnp.where(total > 0, total, 1.0), 0.0), expand)
    return ca * oa + cb * ob, jnp.where(total > 0, m0 + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)


def kind(seq: Sequence, is_causal: bool, qc: int, kc: int) -> str | None:
    """The kind of the pair (query chunk ``qc``, key chunk ``kc``): ``"full"``, ``"diagonal"`` or None (skipped).

    >>> s = Sequence("q", "x", "sp", 2)
    >>> kind(s, True, 1, 0), kind(s, True, 1, 1), kind(s, True, 0, 1), kind(s, False, 0, 1)
    ('full', 'diagonal', None, 'full')
    """
    if not is_causal or kc < qc:
        return "full"
    return "diagonal" if kc == qc else None


def chunking(seq: Sequence, queries: int, keys: int) -> tuple[int, int]:
    """Chunk sizes ``(queries, keys)`` of ``u·P`` chunks each (the last chunk padded).

    >>> chunking(Sequence("q", "x", "sp", 4, balanced=True), 37, 37)
    (5, 5)
    """
    n = seq.units * seq.devices
    return math.ceil(queries / n), math.ceil(keys / n)


def _pad(v, axis: int, size: int):
    return jnp.pad(v, [(0, size - v.shape[axis]) if i == axis else (0, 0) for i in range(v.ndim)])


def _take(v, axis: int, start: int, stop: int):
    return jax.lax.slice_in_dim(v, start, stop, axis=axis)


def execute_devices(s: Sharded):
    """The partitioned semantics of ``s``: a function of the full inputs giving the full outputs, computed as
    the devices would (per group; per device, ring step and chunk pair through :func:`execute`, merged).

    >>> import napkin_cat as nc
    >>> b, q, x, d = nc.axes("b q x d")
    >>> mha = nc.library.multi_head_attention(b, q, x, d)
    >>> Q, K, V = (jax.random.normal(jax.random.key(i), (3, 5, 4)) for i in range(3))
    >>> out = execute_devices(shard("b", "dp", 2)(mha))(Q, K, V)
    >>> bool(jnp.allclose(out, nc.to_jax(mha)(Q, K, V), atol=1e-5))
    True
    """
    d = s.diagram
    if s.groups:
        (axis, _, devices), rest = s.groups[0], replace(s, groups=s.groups[1:])
        inner = execute_devices(rest)

        def grouped(*xs):
            size = next(x.shape[w.names.index(axis)] for w, x in zip(d.dom.inside, xs, strict=True) if w.has(axis))
            step = math.ceil(size / devices)
            parts = []
            for start in range(0, size, step):
                ins = [
                    _take(x, w.names.index(axis), start, min(start + step, size)) if w.has(axis) else x
                    for w, x in zip(d.dom.inside, xs, strict=True)
                ]
                out = inner(*ins)
                parts.append(out if isinstance(out, (tuple, list)) else (out,))
            # a kept axis is concatenated, a sum over it added up (shard's all-reduce, as lowering._spmd adds it);
            # an output of neither is whole on every device
            outs = [
                jnp.concatenate(ps, axis=w.names.index(axis))
                if w.has(axis)
                else sum(ps[1:], ps[0]) if is_sum else ps[0]
                for w, ps, is_sum in zip(d.cod.inside, zip(*parts, strict=True), summed(d, axis), strict=True)
            ]
            return outs[0] if len(outs) == 1 else tuple(outs)

        return grouped
    if s.sequence is None:
        return execute(d)
    return _ulysses_semantics(s) if s.sequence.exchange == "all_to_all" else _ring_semantics(s)


def _seq_at(seq: Sequence, w) -> int:
    """Where ``w``'s sequence axis (the queries, else the keys) is."""
    return w.names.index(seq.queries if w.has(seq.queries) else seq.keys)


def _ulysses_semantics(s: Sharded):
    """Sequence chunks (padded) re-laid out by the all-to-all into head groups over the whole sequence, the
    scheduled semantics per group, and the inverse all-to-all."""
    seq, d = s.sequence, s.diagram
    inner, out_w, p = execute(d), d.cod.inside[0], seq.devices

    def to_heads(w, chunks):
        """Device ``i``'s sequence chunks (all heads) → head group ``i`` over the whole sequence, per device."""
        at, hat = _seq_at(seq, w), w.names.index(seq.heads)
        pieces = [jnp.split(c, p, axis=hat) for c in chunks]  # pieces[src][group]
        return [jnp.concatenate([pieces[src][i] for src in range(p)], axis=at) for i in range(p)]

    def run(*xs):
        ins = list(zip(d.dom.inside, xs, strict=True))
        extent = {n: x.shape[i] for w, x in ins for i, n in enumerate(w.names)}
        if extent[seq.heads] % p:
            raise RewriteError(
                "ulysses", heads_refusal(seq.heads, extent[seq.heads], p, seq.queries, seq.keys, seq.mesh_axis),
                axis=seq.heads,
            )
        local = []
        for w, x in ins:  # the input layout: the sequence split in P chunks (the last padded)
            at = _seq_at(seq, w)
            c = math.ceil(x.shape[at] / p)
            local.append((w, x.shape[at], jnp.split(_pad(x, at, c * p), p, axis=at)))
        groups = [[_take(v, _seq_at(seq, w), 0, n) for v in to_heads(w, chunks)] for w, n, chunks in local]
        outs = [inner(*(gs[i] for gs in groups)) for i in range(p)]  # device i: head group i, whole sequence
        at, nq = out_w.names.index(seq.queries), extent[seq.queries]
        c = math.ceil(nq / p)
        hat = out_w.names.index(seq.heads)
        chunks = [jnp.split(_pad(o, at, c * p), p, axis=at) for o in outs]  # [head group][device]
        back = [jnp.concatenate([chunks[i][j] for i in range(p)], axis=hat) for j in range(p)]  # the inverse
        return _take(jnp.concatenate(back, axis=at), at, 0, nq)

    return run


def _ring_semantics(s: Sharded):
    seq, d = s.sequence, s.diagram
    pairs = {k: execute(v) for k, v in pair_diagrams(s).items()}
    is_causal = has_causal_mask(s)
    out_w = d.cod.inside[0]
    rows = tuple(n for n in out_w.names if n in d.boxes[-1].dom.inside[0].names)

    def run(*xs):
        ins = list(zip(d.dom.inside, xs, strict=True))
        nq = next(x.shape[w.names.index(seq.queries)] for w, x in ins if w.has(seq.queries))
        nk = next(x.shape[w.names.index(seq.keys)] for w, x in ins if w.has(seq.keys))
        if is_causal:  # keys past the last query are never seen; the rest chunked as the queries (equal offsets)
            nk = min(nk, nq)
            cq, ck = chunking(seq, nq, nq)
        else:
            cq, ck = chunking(seq, nq, nk)
        n = seq.units * seq.devices

        def chunk(w, x, c):
            if w.has(seq.queries):
                i = w.names.index(seq.queries)
                return _take(_pad(x, i, n * cq), i, c * cq, (c + 1) * cq)
            if w.has(seq.keys):
                i = w.names.index(seq.keys)
                return _take(x, i, c * ck, min((c + 1) * ck, nk))  # the padding of a ragged chunk cut off
            return x

        outs = {}
        for device in range(seq.devices):
            for qc in seq.owned(device):
                acc = None
                for step in range(seq.devices):  # the ring: keys of device − step arrive at step `step`
                    for kc in seq.owned((device - step) % seq.devices):
                        k = kind(seq, is_causal, qc, kc)
                        if k is None or kc * ck >= nk:  # skipped, or a chunk of padding only
                            continue
                        part = pairs[k](*(chunk(w, x, kc if not w.has(seq.queries) else qc) for w, x in ins))
                        acc = part if acc is None else merge_lse(acc, part, out_w.names, rows)
                outs[qc] = acc[0]
        i = out_w.names.index(seq.queries)
        full = jnp.concatenate([outs[c] for c in range(n)], axis=i)
        return _take(full, i, 0, nq).astype(out_w.dtype.jnp)

    return run


@dataclass(frozen=True)
class DeviceStep:
    """One device-level step: the rule, the :class:`Sharded` after it, its check.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> step = derive_devices(flash, ring("q", "x", "sp", 2), verify=False).steps[1]
    >>> str(step.rule), step.verification is None
    ('ring(q, x, sp, 2)', True)
    """

    rule: Rule | str
    sharded: Sharded
    verification: Verification | None = None

    def __str__(self):
        return f"{self.rule}: {self.verification or 'the scheduled per-device diagram'}"


@dataclass(frozen=True)
class DeviceDerivation:
    """Verified device-level relabellings of a scheduled diagram; ``.sharded`` is what :func:`lowering.lower_devices`
    consumes.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> len(derive_devices(flash, ring("q", "x", "sp", 2), verify=False).steps)
    2
    """

    steps: tuple[DeviceStep, ...] = field(default_factory=tuple)
    seed: int | None = None

    @property
    def sharded(self) -> Sharded:
        """The last step's :class:`Sharded`: the diagram with its device partitions.

            >>> import napkin_cat as nc
            >>> from rewrites import derive, tile, stream
            >>> q, x, d = nc.axes("q x d")
            >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
        >>> derive_devices(flash, ring("q", "x", "sp", 2), verify=False).sharded.mesh
        {'sp': 2}
        """
        return self.steps[-1].sharded

    def __str__(self):
        return "\n".join(f"{i}. {s}" for i, s in enumerate(self.steps))


def derive_devices(
    scheduled, *rules: DeviceRule, seed: int | None = None, sizes: dict | None = None, verify: bool = True
) -> DeviceDerivation:
    """Apply device-level ``rules`` to a scheduled diagram (or ``Derivation``), then verify every step on one
    random trial: :func:`execute_devices` against ``to_jax`` of the diagram (sizes drawn ragged: a sequence
    not a multiple of the chunks, query and key lengths apart; Ulysses' heads a multiple of the devices).
    ``seed`` replays it.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> print(derive_devices(flash, ring("q", "x", "sp", 3, exchange="all_gather"), seed=4).steps[-1].rule)
    ring(q, x, sp, 3, exchange='all_gather')
    """
    d = getattr(scheduled, "diagram", scheduled)
    steps, last = [DeviceStep("scheduled", Sharded(d))], Sharded(d)
    for rule in rules:  # every side condition first
        if not isinstance(rule, DeviceRule):
            raise RewriteError("derive_devices", f"{rule!r} is not a device-level rule (shard, ring, zigzag, ulysses)")
        last = rule(last)
        steps.append(DeviceStep(rule, last))
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    if not verify or not rules:
        return DeviceDerivation(tuple(steps), seed)
    sizes = dict(sizes or {})
    seq = last.sequence
    if seq is not None and seq.heads is not None:  # Ulysses splits the heads evenly
        open_heads = not next(a.size for w in d.dom.inside for a in w.axes if a.name == seq.heads).is_number
        if open_heads and seq.heads not in sizes:
            sizes[seq.heads] = seq.devices * random.Random(seed).choice((1, 2))
    trial = Trial.draw(d, d, seed=seed, sizes=sizes, rule="derive_devices")
    checked = [steps[0]]
    for st in steps[1:]:
        start = time.perf_counter()
        run = jax.jit(execute_devices(st.sharded), compiler_options=FAST_COMPILE)
        got = jax.block_until_ready(run(*trial.inputs))
        rec = trial.compare(got, tolerance(d), time.perf_counter() - start, repr(st.rule), "the partitioned diagram")
        checked.append(replace(st, verification=rec))
    return DeviceDerivation(tuple(checked), seed)


__all__ = [
    "EXCHANGES", "DeviceDerivation", "DeviceRule", "DeviceStep", "Sequence", "Sharded", "chunking", "derive_devices",
    "execute_devices", "has_causal_mask", "heads_refusal", "kind", "merge_lse", "pair_diagrams", "ring", "shard",
    "summed", "ulysses", "zigzag",
]
