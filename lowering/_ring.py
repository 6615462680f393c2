"""Lowering past one GPU: device-level partitions (``rewrites.shard``/``ring``/``zigzag``) on ``jax.shard_map``.

* A group partition (``shard``) is a ``shard_map`` over its mesh axis around the per-device kernel
  (``lower`` of the scheduled diagram, with its own lowered backward); ragged sizes are padded, which is
  neutral for an axis no box mixes.
* A sequence partition (``ring``) runs, on each device, the lowered *pair kernels* (``lower`` of
  ``rewrites.pair_diagrams``: the per-device kernel that also returns its f32 output and log-sum-exp) over
  its query chunk and each key chunk, merged through the log-sum-exps (``rewrites.merge_lse``). With
  ``exchange="ppermute"`` the K/V chunks travel the ring by ``lax.ppermute``, the next chunk's transfer issued
  before this chunk's kernel so that XLA can overlap them; with ``"all_gather"`` each device gathers every
  chunk first. Chunk pairs past the causal diagonal are skipped (``lax.cond`` on the device index); under
  ``zigzag`` every branch runs the same work.
* The backward is an exact ``jax.custom_vjp`` of the per-device function, through the *lowered backward
  kernels* of the pair diagrams (``lowering._backward``: ``P = exp(S − L)``, ``Δ = rowsum(dO ⊙ O)``), fed the
  global ``L`` and ``O``: each pair's dQ, dK, dV are then exact partial sums. Δ reads neither K nor V, so it
  is computed once per device, before the ring, and each pair reads its rows. dQ accumulates in place; dK and dV
  (f32) travel the ring with K and V and take one more step home (``all_gather``: summed by ``psum_scatter``).

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream, derive_devices, ring
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
>>> kernel = lower_devices(derive_devices(flash, ring("q", "x", "sp", 1), verify=False))
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (40, 16)) for i in range(3))
>>> bool(jnp.allclose(kernel(Q, K, V), nc.to_jax(flash.diagram)(Q, K, V), atol=1e-4))
True
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as Spec

from lowering._api import _chunks, _Emitter, _late_sizes, lower, role
from lowering._backward import backward_of
from lowering._plan import NotLowerable
from lowering._ulysses import check_heads, ulysses_body
from lowering.triton import Config
from napkin_cat.hardware import H100, lookup
from rewrites import Sharded, bind_sizes, chunking, has_causal_mask, merge_lse, pair_diagrams


def _mesh(s: Sharded, mesh: Mesh | None) -> Mesh:
    """``mesh``, checked against the partitions' mesh axes; by default the first devices, one mesh axis each."""
    want = s.mesh
    if mesh is None:
        n = math.prod(want.values())
        if n > jax.device_count():
            raise NotLowerable(
                f"lower_devices: the partitions {s} need {n} devices; jax sees {jax.device_count()} "
                "(on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before jax starts)"
            )
        return Mesh(np.array(jax.devices()[:n]).reshape(tuple(want.values()) or (1,)), tuple(want) or ("devices",))
    for name, size in want.items():
        if name not in mesh.shape:
            raise NotLowerable(f"lower_devices: the mesh has no axis {name!r} (its axes: {', '.join(mesh.axis_names)})")
        if mesh.shape[name] != size:
            raise NotLowerable(
                f"lower_devices: mesh axis {name!r} has {mesh.shape[name]} devices; the partition {s} wants {size}"
            )
    return mesh


class DeviceKernel:
    """A lowered :class:`~rewrites.Sharded`: call it on the full (global) arrays, in the diagram's axis order.

    ``mesh`` is the device mesh; ``exchange`` how K/V chunks move (None without a sequence partition);
    ``differentiation`` is ``"lowered"`` (the pair kernels' lowered backward, ring-reduced) or the per-device
    kernel's own for a group partition alone. ``backends`` says which backend runs each per-device kernel.

    >>> import napkin_cat as nc
    >>> from rewrites import shard
    >>> b, q, x, d = nc.axes("b q x d")
    >>> from rewrites import derive, tile, stream
    >>> flash = derive(nc.library.multi_head_attention(b, q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> k = lower_devices(shard("b", "dp", 1)(flash))
    >>> k.exchange, k.mesh.shape["dp"], k.differentiation, k.backends["forward"]
    (None, 1, 'lowered', 'triton')
    """

    def __init__(self, s: Sharded, mesh: Mesh, fn, *, exchange: str | None, differentiation: str, backends, refused,
                 ordered=None):  # fmt: skip
        self.sharded, self.mesh, self._fn, self._ordered = s, mesh, fn, ordered or fn
        self.exchange, self.differentiation = exchange, differentiation
        self._backends, self._refused = backends, refused
        self.__name__ = "napkin_device_kernel"

    @property
    def backends(self) -> dict[str, str]:
        """The backend of each per-device kernel by role: the per-device kernel's own roles (a group partition
        alone, Ulysses), or ``"<pair kind> forward"`` and ``"<pair kind> <backward kernel>"`` for the ring's pair
        kernels (the backward's built if need be; under ``"auto"`` on an sm_90 GPU with a head dim the diagram leaves
        open, those of the last call, {} before it)."""
        return self._backends()

    @property
    def refused(self) -> dict[str, str]:
        """Why ``backend="auto"`` kept each per-device kernel (by the roles of :attr:`backends`) off the backends
        before its own (:attr:`lowering.Kernel.refused`); a kernel on the first backend is not here."""
        return self._refused()

    def __call__(self, *arrays):
        return self._fn(*arrays)

    def _order(self, axis_length: int) -> list[int] | None:
        seq = self.sharded.sequence
        if seq is None or seq.exchange == "all_to_all":
            return None  # no chunk order: a group partition, or Ulysses (whole sequences per head group)
        n = seq.units * seq.devices
        if axis_length % n:
            raise NotLowerable(
                f"device order: a sequence of {axis_length} does not split into {n} equal chunks ({seq}); pad it "
                f"to a multiple of {n} first"
            )
        return seq.chunk_order()

    def device_order(self, x, axis: int):
        """``x``'s sequence ``axis`` with its chunks in the order the devices hold them (zig-zag: device ``i``
        chunks ``i`` and ``2P − 1 − i``), for :meth:`in_device_order`: a model permutes its tokens once, not every
        call. The identity without zig-zag. Undone by :meth:`sequence_order`.

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream, ring, zigzag, derive_devices
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
        >>> k = lower_devices(derive_devices(flash, ring("q", "x", "sp", 1), zigzag(), verify=False))
        >>> k.device_order(jnp.arange(4), 0), k.sequence_order(k.device_order(jnp.arange(4), 0), 0)
        (Array([0, 1, 2, 3], dtype=int32), Array([0, 1, 2, 3], dtype=int32))
        """
        order = self._order(x.shape[axis])
        return x if order is None else _reorder(x, axis, order)

    def sequence_order(self, x, axis: int):
        """:meth:`device_order` undone: ``x``'s chunks along ``axis`` back in sequence order."""
        order = self._order(x.shape[axis])
        return x if order is None else _reorder(x, axis, [int(c) for c in np.argsort(order)])

    def in_device_order(self, *arrays):
        """The kernel on arrays whose sequence axes are already in :meth:`device_order` (and split into whole
        chunks): no reorder of the inputs or the output, which stays in device order. This is how a model calls
        the ring under zig-zag, permuting its tokens once at the input (the loss of a token does not depend on
        where it sits): every call of ``kernel(...)`` moves half of Q, K, V and O between devices.

        >>> import jax, jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream, ring, zigzag, derive_devices
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
        >>> k = lower_devices(derive_devices(flash, ring("q", "x", "sp", 1), zigzag(), verify=False))
        >>> Q, K, V = (jax.random.normal(jax.random.key(i), (32, 16)) for i in range(3))
        >>> out = k.in_device_order(*(k.device_order(a, 0) for a in (Q, K, V)))
        >>> bool(jnp.allclose(k.sequence_order(out, 0), k(Q, K, V), atol=1e-6))
        True
        """
        return self._ordered(*arrays)


def lower_devices(
    sharded,
    mesh: Mesh | None = None,
    *,
    backend: str = "auto",
    interpret: bool | None = None,
    config=None,
    hardware=None,
) -> DeviceKernel:
    """A JAX callable for a :class:`~rewrites.Sharded` (or a ``DeviceDerivation``): ``shard_map`` over ``mesh``
    (by default the first devices, one mesh axis per partition) around lowered per-device kernels; see the
    module. ``backend``, ``interpret``, ``config`` and ``hardware`` reach every per-device kernel, forward and
    backward, as in :func:`lower`: ``"auto"`` takes the backend registry's choice per kernel (Mosaic on Hopper
    where it lowers and was measured faster), a named backend lowers every per-device kernel with it or says
    which it cannot lower.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream, ring
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    >>> lower_devices(ring("q", "x", "sp", 64)(flash))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: lower_devices: the partitions ring(q, x over sp:64, ppermute) of ... need 64 ...
    """
    s = getattr(sharded, "sharded", sharded)
    if not isinstance(s, Sharded):
        raise NotLowerable(f"lower_devices takes a Sharded or a DeviceDerivation, got {type(sharded).__name__}")
    m = _mesh(s, mesh)
    options = {"backend": backend, "interpret": interpret, "config": config, "hardware": hardware}
    d, seq = s.diagram, s.sequence
    if seq is None or seq.exchange == "all_to_all":  # one per-device kernel
        kernel = lower(d, **options)
        bodies = (lambda lengths: kernel) if seq is None else (lambda lengths: ulysses_body(s, kernel, lengths))
        differentiation = kernel.differentiation
        backends, refused, late = (lambda: kernel.backends), (lambda: kernel.refused), ()
    else:
        for w in d.dom.inside:
            if not (w.has(seq.queries) or w.has(seq.keys)):
                raise NotLowerable(
                    f"lower_devices: input {w.describe()} is indexed by neither {seq.queries} nor {seq.keys}; "
                    "the ring lowers attention's query-side and key-side inputs only"
                )
        pairs = _Pairs(s, options)
        bodies, differentiation = (lambda lengths: _ring_body(s, pairs(lengths), lengths[:2])), "lowered"
        backends, refused, late = pairs.backends, pairs.refused, pairs.late
    placed = {a: mm for a, mm, _ in s.groups}  # Ulysses: the sequence placed outside its kernel
    if seq is not None:
        placed |= {seq.queries: seq.mesh_axis, seq.keys: seq.mesh_axis}

    def spec(w):
        return Spec(*(placed.get(n) for n in w.names))

    @functools.cache
    def mapped(lengths: tuple | None):
        return jax.shard_map(
            bodies(lengths),
            mesh=m,
            in_specs=tuple(spec(w) for w in d.dom.inside),
            out_specs=spec(d.cod.inside[0]),
            check_vma=False,  # Pallas calls carry no varying-manual-axes types
        )

    fn = jax.jit(functools.partial(_call, s, mapped, late))  # called eagerly, shard_map would dispatch op by op
    ordered = jax.jit(functools.partial(_call, s, mapped, late, ordered=True))
    exchange = seq.exchange if seq else None
    return DeviceKernel(
        s, m, fn, exchange=exchange, differentiation=differentiation, backends=backends, refused=refused,
        ordered=ordered,
    )


def _call(s: Sharded, mapped, late: tuple[str, ...], *xs, ordered: bool = False):
    """Pad every partitioned axis to whole chunks (zig-zag: reorder the chunks to their devices), run, undo.
    Under a causal mask keys past the last query are dropped first (no query sees them) and the rest chunked as
    the queries; ``mapped`` is keyed by the query and key lengths the devices see, then the sizes of the axes
    kept whole that the ring's pair kernels bind (``late``). ``ordered``: the sequence axes arrive in device order
    and whole chunks (:meth:`DeviceKernel.in_device_order`), and the output leaves so."""
    d, seq = s.diagram, s.sequence
    if len(xs) != len(d.dom):
        raise NotLowerable(f"device kernel {d.dom} → {d.cod}: expected {len(d.dom)} arrays, got {len(xs)}")
    out_w = d.cod.inside[0]
    extent = {n: x.shape[i] for w, x in zip(d.dom.inside, xs, strict=True) for i, n in enumerate(w.names)}
    whole = {a: math.ceil(extent[a] / n) * n for a, _, n in s.groups}
    order, lengths, cut = None, None, {}
    if seq is not None and seq.exchange == "all_to_all":
        check_heads(s, extent)
        lengths = (extent[seq.queries], extent[seq.keys])
        whole |= {a: math.ceil(extent[a] / seq.devices) * seq.devices for a in (seq.queries, seq.keys)}
    elif seq is not None:
        nq, nk = extent[seq.queries], extent[seq.keys]
        if has_causal_mask(s):
            if seq.balanced and nk < nq:
                raise NotLowerable(
                    f"lower_devices: zigzag under a causal mask with fewer keys ({seq.keys}: {nk}) than queries "
                    f"({seq.queries}: {nq}) is not lowered; drop zigzag() or use ulysses"
                )
            cut, nk = ({seq.keys: nq} if nk > nq else {}), min(nk, nq)  # no query sees the keys past the last
            cq, ck = chunking(seq, nq, nq)
        else:
            cq, ck = chunking(seq, nq, nk)
        n = seq.units * seq.devices
        whole |= {seq.queries: n * cq, seq.keys: n * ck}
        order, lengths = seq.chunk_order(), (nq, nk)
        lengths += tuple((a, extent[a]) for a in late)
        if ordered:
            for a in (seq.queries, seq.keys):
                if cut.get(a, whole[a]) != extent[a] or whole[a] != extent[a]:
                    raise NotLowerable(
                        f"in_device_order: {a} has {extent[a]} positions; arrays in device order must split into "
                        f"{n} whole chunks, with as many keys as queries under a causal mask ({seq.queries}: "
                        f"{extent[seq.queries]}, {seq.keys}: {extent[seq.keys]}); pad them, or call the kernel itself"
                    )
            order = None

    def prepare(w, x):
        for i, name in enumerate(w.names):
            if name in cut:
                x = jax.lax.slice_in_dim(x, 0, cut[name], axis=i)
            if name in whole:
                x = jnp.pad(x, [(0, whole[name] - x.shape[i]) if j == i else (0, 0) for j in range(x.ndim)])
                if order is not None and name in (seq.queries, seq.keys):
                    x = _reorder(x, i, order)
        return x

    out = mapped(lengths)(*(prepare(w, x) for w, x in zip(d.dom.inside, xs, strict=True)))
    for i, name in enumerate(out_w.names):
        if order is not None and name == seq.queries:
            out = _reorder(out, i, [int(c) for c in np.argsort(order)])
        if name in whole:
            out = jax.lax.slice_in_dim(out, 0, extent[name], axis=i)
    return out


def _reorder(x, axis: int, order: list[int]):
    """The chunks of ``x`` along ``axis`` (``len(order)`` equal chunks) in the given order."""
    if order == sorted(order):
        return x
    parts = jnp.split(x, len(order), axis=axis)
    return jnp.concatenate([parts[c] for c in order], axis=axis)


class _PairKernels:
    """The lowered pair kernels by kind, through the backend registry (``options``: :func:`lower`'s): forward
    with (O, its f32 L); the backward pieces, chunked for the backend that lowers them, built when first used.

    Each backward piece is emitted as :func:`lower` emits its own backward kernels (one emitter, the piece's
    :func:`role`), so ``"auto"`` weighs it as a backward kernel (:func:`lowering.mosaic.faster` with
    ``backward=True``: Mosaic's dQ and dK·dV were measured faster at chunks the forward's rule refuses)."""

    def __init__(self, s: Sharded, options: dict):
        # the forward pair kernels' own backward is never run (the ring differentiates through the pieces)
        self._forward = {k: lower(v, backward="reference", **options) for k, v in pair_diagrams(s).items()}
        self.forward = {k: v.forward for k, v in self._forward.items()}
        plain = pair_diagrams(s, lse=False)
        self._hw = lookup(options["hardware"]) if options["hardware"] is not None else None
        triton = options["config"] if isinstance(options["config"], Config) else None
        chunks = functools.partial(_chunks, backend=options["backend"], interpret=options["interpret"])
        # each step's gradients in f32: they are partial sums, added over the ring's steps before the cast
        self.backward = {
            k: backward_of(v, self._hw or H100, triton, narrow=False, **chunks(v, config=options["config"]))
            for k, v in plain.items()
        }
        self._options = options

    @functools.cache  # noqa: B019 - one per lowered device kernel, kept as long as it is
    def emitted(self, kind: str) -> tuple[tuple, dict]:
        """The kernels of ``kind``'s backward pieces, and by role the backend each got and why ``"auto"`` passed
        over the ones before it (shapes that split into no whole blocks added as they are called)."""
        o = self._options
        emit = _Emitter(o["backend"], o["interpret"], o["config"], self._hw)
        return tuple(emit(p.scheduled, role(p)) for p in self.backward[kind].pieces), emit.chosen

    def pieces(self, kind: str) -> tuple:
        return self.emitted(kind)[0]

    def _by_role(self) -> dict[str, tuple[str, str | None]]:
        out = {f"{k} {r}": (b, v.refused.get(r)) for k, v in self._forward.items() for r, b in v.backends.items()}
        for kind in self.backward:
            out |= {f"{kind} {r}": chosen for r, chosen in self.emitted(kind)[1].items()}
        return out

    def backends(self) -> dict[str, str]:
        """``"<kind> forward"`` and ``"<kind> <piece>"`` → the backend that runs it (the pieces built if need be)."""
        return {r: b for r, (b, _) in self._by_role().items()}

    def refused(self) -> dict[str, str]:
        """The same roles → why ``backend="auto"`` kept the kernel off the backends before its own (if it did)."""
        return {r: why for r, (_, why) in self._by_role().items() if why}


class _Pairs:
    """A sequence partition's :class:`_PairKernels`, built at once, or under ``backend="auto"`` where Mosaic is
    available and the diagram leaves the size of an axis kept whole open (a head dim: Mosaic's registers, hence the
    backend, depend on it; :func:`lowering._api._late_sizes`) once per size, bound at the call (``late``: those
    axes). ``backends`` and ``refused`` are those of the last built ({} before the first call)."""

    def __init__(self, s: Sharded, options: dict):
        self.late = _late_sizes(s.diagram, options["backend"], options["interpret"], options["config"])
        self._s, self._options, self._last = s, options, None
        self._built = functools.cache(self._build)
        if not self.late:
            self._last = self._built(())

    def _build(self, at: tuple) -> _PairKernels:
        s = self._s if not at else replace(self._s, diagram=bind_sizes(self._s.diagram, dict(at)))
        return _PairKernels(s, self._options)

    def __call__(self, key: tuple) -> _PairKernels:
        """The pair kernels for ``mapped``'s key: the lengths, then ``(axis, size)`` of each axis in ``late``."""
        self._last = self._built(tuple(key[2:]))
        return self._last

    def backends(self) -> dict[str, str]:
        return {} if self._last is None else self._last.backends()

    def refused(self) -> dict[str, str]:
        return {} if self._last is None else self._last.refused()


def _ring_body(s: Sharded, kernels: _PairKernels, lengths: tuple[int, int]):
    """The per-device function of a sequence partition over ``lengths`` (queries, keys) positions in all, with
    its exact custom_vjp (:class:`_Ring`)."""
    return _Ring(s, kernels, *lengths).function()


class _Ring:
    """A sequence partition's per-device computation over ``queries`` and ``keys`` positions in all (under a
    causal mask ``keys ≤ queries``, chunked as the queries): the forward merges the pair kernels' outputs through
    their log-sum-exps, the backward sums the pair kernels' lowered backward.

    A *pair* is ``(kind, query chunks, key chunks, cut)``: the pair kernel of ``kind`` on the local query
    chunks and key chunks listed (of the ``u`` local ones), the keys cut to ``cut`` (padding) if not None.
    """

    def __init__(self, s: Sharded, kernels: _PairKernels, queries: int, keys: int):
        seq, d = s.sequence, s.diagram
        self.seq, self.kernels, self.queries, self.keys = seq, kernels, queries, keys
        self.ins, self.out_w = d.dom.inside, d.cod.inside[0]
        self.is_q = [w.has(seq.queries) for w in self.ins]
        self.at = [w.names.index(seq.queries if q else seq.keys) for w, q in zip(self.ins, self.is_q, strict=True)]
        self.rows = tuple(n for n in self.out_w.names if n in d.boxes[-1].dom.inside[0].names)
        self.o_at, self.l_at = self.out_w.names.index(seq.queries), self.rows.index(seq.queries)
        self.P, self.u, self.is_causal = seq.devices, seq.units, has_causal_mask(s)  # the papers' P
        self.ring = [(j, (j + 1) % self.P) for j in range(self.P)]

    def plan(self, i, t) -> list:
        """The pairs of ring step ``t`` on device ``i`` as alternatives ``[(predicate or None, pairs), ...]``."""
        seq, P = self.seq, self.P  # noqa: N806 - the papers' P
        first = isinstance(t, int) and t == 0  # step 0 has its own plan (the diagonal)
        if self.is_causal and not seq.balanced and self.keys < self.queries:  # cut the chunks past the last key
            whole, rest = divmod(self.keys, math.ceil(self.queries / P))
            j, ok, pair = (i, True, "diagonal") if first else (i - t, i >= t, "full")
            ragged = [(jnp.logical_and(ok, j == whole), [(pair, [0], [0], rest)])] if rest else []
            return [(jnp.logical_and(ok, j < whole), [(pair, [0], [0], None)]), *ragged, (None, [])]
        if self.is_causal and not seq.balanced:
            if first:
                return [(None, [("diagonal", [0], [0], None)])]
            return [(i >= t, [("full", [0], [0], None)]), (None, [])]
        if self.is_causal:  # zig-zag: device i holds chunks i and 2P−1−i; each branch is the same work
            if first:
                return [(None, [("diagonal", [0], [0], None), ("diagonal", [1], [1], None), ("full", [1], [0], None)])]
            return [(i >= t, [("full", [0, 1], [0], None)]), (None, [("full", [1], [0, 1], None)])]
        whole, rest = divmod(self.keys, math.ceil(self.keys / P))  # chunks of real keys only, the ragged one's length
        if whole == P:
            return [(None, [("full", [0], [0], None)])]
        j = (i - t) % P
        ragged = [(j == whole, [("full", [0], [0], rest)])] if rest else []
        return [(j < whole, [("full", [0], [0], None)]), *ragged, (None, [])]  # the rest: padding only

    def part(self, v, axis, chunks, cut=None):
        u = self.u
        pieces = jnp.split(v, u, axis=axis) if u > 1 else [v]
        v = pieces[chunks[0]] if len(chunks) == 1 else jnp.concatenate([pieces[c] for c in chunks], axis=axis)
        return v if cut is None else jax.lax.slice_in_dim(v, 0, cut, axis=axis)

    def spread(self, v, axis, chunks, cut, like, fill=0.0):
        """``v`` (the rows of ``chunks``, cut to ``cut``) placed among all local rows, ``fill`` elsewhere."""
        if cut is None and len(chunks) == self.u:
            return v
        full, step = jnp.full(like, fill, v.dtype), like[axis] // self.u
        for n, c in enumerate(chunks):
            piece = jax.lax.slice_in_dim(v, n * step, min((n + 1) * step, v.shape[axis]), axis=axis)
            full = jax.lax.dynamic_update_slice_in_dim(full, piece, c * step, axis=axis)
        return full

    def pair_inputs(self, local, qc, kc, cut):
        return [
            self.part(x, a, qc if q else kc, None if q else cut)
            for x, q, a in zip(local, self.is_q, self.at, strict=True)
        ]

    def forward_branch(self, pairs, local, shapes):
        out_w, rows = self.out_w, self.rows

        def branch():
            acc = (jnp.zeros(shapes[0], jnp.float32), jnp.full(shapes[1], -jnp.inf, jnp.float32))
            for kind, qc, kc, cut in pairs:
                o, lse = self.kernels.forward[kind](*self.pair_inputs(local, qc, kc, cut))
                if len(qc) < self.u:  # rows not in this pair saw no key: O = 0, L = −∞
                    o = self.spread(o, self.o_at, qc, None, shapes[0])
                    lse = self.spread(lse, self.l_at, qc, None, shapes[1], -jnp.inf)
                acc = merge_lse(acc, (o, lse), out_w.names, rows)
            return acc

        return branch

    def exchange(self, xs):
        """``fetch(t, previous)``: the key-side arrays of device ``i − t``."""
        seq, P = self.seq, self.P  # noqa: N806 - the papers' P
        keyed = [(x, a) for x, q, a in zip(xs, self.is_q, self.at, strict=True) if not q]
        if seq.exchange == "all_gather":
            full = [jax.lax.all_gather(x, seq.mesh_axis, axis=a, tiled=True) for x, a in keyed]
            i = jax.lax.axis_index(seq.mesh_axis)
            return lambda t, _: [
                jax.lax.dynamic_slice_in_dim(f, ((i - t) % P) * x.shape[a], x.shape[a], axis=a)
                for f, (x, a) in zip(full, keyed, strict=True)
            ]
        return lambda t, previous: (
            [x for x, _ in keyed]
            if previous is None
            else [jax.lax.ppermute(k, seq.mesh_axis, self.ring) for k in previous]
        )

    def with_keys(self, xs, kv):
        it = iter(kv)
        return [x if q else next(it) for x, q in zip(xs, self.is_q, strict=True)]

    def shapes_of(self, xs):
        extent = {n: x.shape[j] for w, x in zip(self.ins, xs, strict=True) for j, n in enumerate(w.names)}
        extent[self.seq.queries] = next(x.shape[a] for x, q, a in zip(xs, self.is_q, self.at, strict=True) if q)
        o = tuple(extent[n] for n in self.out_w.names)
        return o, tuple(extent[n] for n in self.rows)

    def forward(self, *xs):
        """The merged ``(O, L)`` of every pair this device runs, in f32."""
        names, rows, P = self.out_w.names, self.rows, self.P  # noqa: N806 - the papers' P
        i, shapes = jax.lax.axis_index(self.seq.mesh_axis), self.shapes_of(xs)
        fetch = self.exchange(xs)

        def step(t, kv):
            local = self.with_keys(xs, kv)
            return _branches(self.plan(i, t), lambda pairs: self.forward_branch(pairs, local, shapes))

        def body(t, carry):
            kv, acc = carry
            return fetch(t + 1, kv), merge_lse(acc, step(t, kv), names, rows)

        return _ring_loop(
            P, fetch, body, lambda kv: step(0, kv), lambda kv, acc: merge_lse(acc, step(P - 1, kv), names, rows)
        )

    def row_values(self, do, o, lse):
        """Each kind's fed values (Δ = rowsum(dO ⊙ O)) on all local query rows, once before the ring: they read
        neither K nor V. ``{kind: [(value, its query axis)]}``; a kind whose Δ reads a key-side input is left
        to its pairs."""
        out = {}
        for kind, b in self.kernels.backward.items():
            fed = [(p, k) for p, k in zip(b.pieces, self.kernels.pieces(kind), strict=True) if p.feeds]
            if any(j < len(self.ins) for p, _ in fed for j in p.inputs):
                continue
            values = [None] * len(self.ins) + [do] + [(o, lse)[p] for p in b.residuals]
            out[kind] = []
            for p, kernel in fed:
                res = kernel(*(values[j] for j in p.inputs))
                res = res if isinstance(res, tuple) else (res,)
                values += res
                out[kind] += [
                    (r, w.names.index(self.seq.queries)) for r, w in zip(res, p.diagram.cod.inside, strict=True)
                ]
        return out

    def grad_branch(self, pairs, local, do, o, lse, rowed):
        def branch():
            grads = [jnp.zeros(x.shape, jnp.float32) for x in local]
            for kind, qc, kc, cut in pairs:
                b, hoisted = self.kernels.backward[kind], iter(rowed.get(kind, ()))
                values = [*self.pair_inputs(local, qc, kc, cut), self.part(do, self.o_at, qc)]
                residual = (self.part(o, self.o_at, qc), self.part(lse, self.l_at, qc))  # the forward's (O, L)
                values += [residual[p] for p in b.residuals]
                for piece, kernel in zip(b.pieces, self.kernels.pieces(kind), strict=True):
                    if piece.feeds and kind in rowed:  # computed once, before the ring: this pair's rows of it
                        values += [self.part(r, a, qc) for r, a in itertools.islice(hoisted, len(piece.outputs))]
                        continue
                    res = kernel(*(values[j] for j in piece.inputs))
                    res = res if isinstance(res, tuple) else (res,)
                    if piece.feeds:  # Δ = rowsum(dO ⊙ O), read by the pieces after it
                        values += res
                        continue
                    for j, r, summed in zip(piece.outputs, res, piece.sums, strict=True):
                        r = jnp.sum(r.astype(jnp.float32), axis=summed) if summed else r.astype(jnp.float32)
                        chunks, c = (qc, None) if self.is_q[j] else (kc, cut)
                        grads[j] = grads[j] + self.spread(r, self.at[j], chunks, c, local[j].shape)
            return grads

        return branch

    def accumulate(self, i, t, grads, dq, dk):
        """Ring step ``t``'s gradients on device ``i`` (``grads``, by input) added in: dQ in place; dK, dV to those
        of the keys they came with (gathered: to the slice of the whole from device ``i − t``)."""
        seq, P, is_q = self.seq, self.P, self.is_q  # noqa: N806 - the papers' P
        keyed_at = [a for a, q in zip(self.at, is_q, strict=True) if not q]
        dq = [a + g for a, g in zip(dq, (g for g, q in zip(grads, is_q, strict=True) if q), strict=True)]
        kg = [g for g, q in zip(grads, is_q, strict=True) if not q]
        if seq.exchange != "all_gather":
            return dq, [a + g for a, g in zip(dk, kg, strict=True)]
        src = ((i - t) % P) * kg[0].shape[keyed_at[0]]
        return dq, [
            jax.lax.dynamic_update_slice_in_dim(
                a, jax.lax.dynamic_slice_in_dim(a, src, g.shape[x], axis=x) + g, src, axis=x
            )
            for a, g, x in zip(dk, kg, keyed_at, strict=True)
        ]

    def backward(self, saved, do):
        """The cotangents of the device's inputs: every ring step's pairs' lowered backward, summed (dK, dV
        travelling the ring with their K, V and taking one more step home, or summed by ``psum_scatter``)."""
        seq, P, is_q, out_w = self.seq, self.P, self.is_q, self.out_w  # noqa: N806 - the papers' P
        xs, o, lse = saved
        do, i = do.astype(out_w.dtype.jnp), jax.lax.axis_index(seq.mesh_axis)
        fetch, rowed = self.exchange(xs), self.row_values(do, o, lse)
        keyed_at = [a for a, q in zip(self.at, is_q, strict=True) if not q]
        gathered = seq.exchange == "all_gather"
        dq = [jnp.zeros(x.shape, jnp.float32) for x, q in zip(xs, is_q, strict=True) if q]
        dk = [
            jnp.zeros(tuple(n * (P if gathered and j == a else 1) for j, n in enumerate(x.shape)), jnp.float32)
            for x, a in zip((x for x, q in zip(xs, is_q, strict=True) if not q), keyed_at, strict=True)
        ]

        def step(t, kv, dq, dk):
            local = self.with_keys(xs, kv)
            grads = _branches(self.plan(i, t), lambda pairs: self.grad_branch(pairs, local, do, o, lse, rowed))
            return self.accumulate(i, t, grads, dq, dk)

        def send(dk):  # dK, dV travel with their K, V (the all-gather sums them once, at the end)
            return dk if gathered else [jax.lax.ppermute(g, seq.mesh_axis, self.ring) for g in dk]

        def body(t, carry):
            kv, (dq, dk) = carry
            dq, dk = step(t, kv, dq, dk)
            return fetch(t + 1, kv), (dq, send(dk))

        def first(kv):
            got = step(0, kv, dq, dk)
            return got if P == 1 else (got[0], send(got[1]))

        dq, dk = _ring_loop(P, fetch, body, first, lambda kv, carry: step(P - 1, kv, *carry))
        if gathered:
            dk = [
                jax.lax.psum_scatter(g, seq.mesh_axis, scatter_dimension=a, tiled=True)
                for g, a in zip(dk, keyed_at, strict=True)
            ]
        else:  # one more step: each chunk's dK, dV home
            dk = send(dk)
        qs, ks = iter(dq), iter(dk)
        return tuple((next(qs) if q else next(ks)).astype(x.dtype) for x, q in zip(xs, is_q, strict=True))

    def function(self):
        """The device function ``f(*xs) → O``, its custom_vjp saving ``(xs, O, L)`` for :meth:`backward`."""
        out_w = self.out_w

        @jax.custom_vjp
        def f(*xs):
            return self.forward(*xs)[0].astype(out_w.dtype.jnp)

        def f_fwd(*xs):
            o, lse = self.forward(*xs)
            o = o.astype(out_w.dtype.jnp)
            return o, (xs, o, lse)

        def f_bwd(saved, do):
            return self.backward(saved, do)

        f.defvjp(f_fwd, f_bwd)
        return f


def _ring_loop(P, fetch, body, first, last):  # noqa: N803 - the papers' P
    """Steps ``0 … P−1`` of a ring: ``first(kv)`` at step 0 (its own plan), ``body(t, (kv, carry))`` for steps
    1 … P−2 in one ``fori_loop`` (one compilation of each kernel), ``last(kv, carry)`` at step P−1. Every step
    fetches the next chunk (``fetch(t + 1, kv)``) from the chunk it computes on, never from its result, so the
    transfer overlaps the kernels; the last step sends nothing."""
    kv = fetch(0, None)
    if P == 1:
        return first(kv)
    nxt, carry = fetch(1, kv), first(kv)
    if P > 2:
        nxt, carry = jax.lax.fori_loop(1, P - 1, body, (nxt, carry))
    return last(nxt, carry)


def _branches(plan, run):
    """Evaluate ``plan`` (``[(predicate or None, pairs), ...]``, the last unconditional) as nested ``lax.cond``."""
    (pred, pairs), rest = plan[0], plan[1:]
    if pred is None:
        return run(pairs)()
    return jax.lax.cond(pred, run(pairs), lambda: _branches(rest, run))


__all__ = ["DeviceKernel", "lower_devices"]
