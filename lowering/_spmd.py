"""A lowered kernel under JAX's SPMD: sharded inputs run the kernel per shard and keep their sharding.

A kernel's axes are named by its diagram, so an array's sharding (a ``PartitionSpec`` over its dimensions)
says which mesh axes split which of the diagram's axes. An axis may be split over devices when the relabelling
:class:`rewrites.shard` applies to it: no box mixes its elements (a batch axis of the plan, ``plan(d).batch``,
or a tiled one, ``plan(d).tiles``) and no mask or score modifier reads its global index (the causal mask
reads the query's). Each device then runs the kernel, forward and backward, on its block: data and tensor
(head) parallelism. An axis a box reduces over (the keys, the head dim) cannot be split so: its sharding is
refused, with the fix (reshard, or split the sequence with ``rewrites.ring`` and
:func:`lowering.lower_devices`, ring attention; docs/multi_device.md).

* **Explicit mesh axes** (``jax.typeof(x).sharding`` names them): the kernel runs in a ``jax.shard_map`` over the
  mesh axes used; the output's sharding names the same mesh axes on the same diagram axes.
* **Auto mesh axes** (the compiler propagates shardings): the kernel is a ``custom_partitioning`` op whose rule
  names each dimension by its diagram axis, so the partitioner keeps the shardings of the axes it may split and
  gathers the others. Its backward is a second such op, which runs the kernel's own backward per shard (that
  recomputes the forward's residuals: one more forward kernel than under Explicit axes).
* **Inside ``jax.shard_map``** (Manual mesh axes): the inputs are made varying over the union of the mesh axes
  any of them varies over, and the kernels' outputs declare it (:func:`varying`), so ``check_vma=True`` holds and
  a gradient summed over a sharded axis (a bias shared by the batch) is summed across devices too.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> b, q, x, d = nc.axes("b q x d")
>>> flash = derive(nc.library.multi_head_attention(b, q, x, d), tile(q, 16), stream(x, 16), verify=False)
>>> sorted(shardable(flash.diagram))
['b', 'q']
"""

from __future__ import annotations

import functools
import math
import string
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lax.parallel import all_gather_invariant  # its output is typed invariant (jax.lax.all_gather's is not)
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, ManualAxisType, NamedSharding
from jax.sharding import PartitionSpec as Spec

from lowering._plan import NotLowerable, plan
from napkin_cat.diagram import Diagram
from rewrites import RewriteError, shard, summed

#: per diagram axis, the mesh axes splitting it (a diagram axis absent is whole on every device)
Assignment = dict[str, tuple[str, ...]]


def varying(arrays: Sequence) -> ManualAxisType:
    """What a kernel's outputs vary over inside ``jax.shard_map``: every mesh axis any input varies over
    (the ``manual_axis_type`` of its ``out_shape``; empty outside ``shard_map``).

    >>> varying([jnp.ones(3)]).varying
    frozenset()
    """
    return ManualAxisType(varying=frozenset().union(*(jax.typeof(a).mat.varying for a in arrays)))


def varying_like(tree, arrays: Sequence):
    """``tree``'s arrays made varying (inside ``jax.shard_map``) over the mesh axes ``arrays`` vary over: a loop's
    initial state (an accumulator's identity, built from constants) typed as the states its body returns.

    >>> varying_like({"acc": jnp.zeros(2)}, [jnp.ones(3)])["acc"].shape
    (2,)
    """
    over = varying([a for a in arrays if a is not None]).varying

    def cast(a):
        missing = tuple(sorted(over - jax.typeof(a).mat.varying))
        return jax.lax.pcast(a, missing, to="varying") if missing else a

    return jax.tree.map(cast, tree)


def out_structs(wires, extent: dict, arrays: Sequence) -> list:
    """The output shapes of a kernel call: each wire's axes at ``extent`` (by name), in its dtype, varying inside
    ``jax.shard_map`` over the mesh axes the inputs do (:func:`varying`). Both GPU backends declare them so.

    >>> import napkin_cat as nc
    >>> [s.shape for s in out_structs([nc.Array(*nc.axes("q d"))], {"q": 4, "d": 2}, [jnp.ones(3)])]
    [(4, 2)]
    """
    mat = varying(arrays)
    return [
        jax.ShapeDtypeStruct(tuple(extent[a.name] for a in w.axes), w.dtype.jnp, manual_axis_type=mat) for w in wires
    ]


@functools.cache
def shardable(d: Diagram) -> frozenset[str]:
    """The axes of ``d`` a mesh may split, each device running the kernel on its block: the plan's batch and
    tiled axes (no box mixes them) whose global index no box reads (:class:`rewrites.shard`'s side conditions).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> sorted(shardable(derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16)).diagram))
    []
    """
    plan(d)  # the guards first
    return frozenset(a for a in dict.fromkeys(n for w in d.dom.inside for n in w.names) if _refusal(d, a) is None)


def summed_over(d: Diagram, sharded: Assignment) -> list[tuple[str, ...]]:
    """Per output of ``d``, the mesh axes its partial sums are added over: those splitting an axis the output
    is a sum over (:func:`rewrites.summed`; the all-reduce of data parallelism's weight gradient).

    >>> import napkin_cat as nc
    >>> n, k, m = nc.axes("n k m")
    >>> summed_over(nc.contract("n k, n m -> k m", n, k, m), {"n": ("data",)})
    [('data',)]
    """
    over = [set() for _ in d.cod.inside]
    for axis, mesh_axes in sharded.items():
        for i, is_sum in enumerate(summed(d, axis)):
            if is_sum:
                over[i].update(mesh_axes)
    return [tuple(sorted(o)) for o in over]


def _add_partials(ys, over: list[tuple[str, ...]]):
    """The kernel's outputs with each partial sum added across the devices holding its parts."""
    single = not isinstance(ys, (tuple, list))
    ys = [jax.lax.psum(y, axes) if axes else y for y, axes in zip((ys,) if single else ys, over, strict=True)]
    return ys[0] if single else tuple(ys)


def _refusal(d: Diagram, axis: str) -> str | None:
    """Why ``axis`` cannot be split over devices (the failed side condition of :class:`rewrites.shard`), or None."""
    size = {a.name: a.size for w in d.dom.inside for a in w.axes}
    if size[axis].is_number:
        return f"the diagram fixes its size to {size[axis]}; leave it symbolic (nc.axes) so a shard can be smaller"
    try:
        shard(axis, "mesh", 1)(d)
    except RewriteError as e:
        return e.condition if e.box is None else f"box {e.box!r}: {e.condition}"
    return None


def _mesh_axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def assign(d: Diagram, specs: Sequence[Spec], mesh_shape: dict, shapes: Sequence[tuple]) -> Assignment:
    """Which mesh axes split which diagram axes, read from the inputs' partition specs (in the diagram's order);
    refused, naming the axis, the mesh axis and the fix, where an axis may not be split (:func:`shardable`), two
    inputs split one axis differently, or a mesh axis does not divide it.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram
    >>> assign(flash, [Spec("sp"), Spec(), Spec()], {"sp": 2}, [(32, 8)] * 3)
    {'q': ('sp',)}
    >>> assign(flash, [Spec(), Spec("sp"), Spec("sp")], {"sp": 2}, [(32, 8)] * 3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: kernel q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d: input 1 splits axis 'x' over mesh \
axis sp, but box 'softmax·contract x': the box mixes elements along x, ...; reshard it to replicate 'x' ...
    """
    got: Assignment = {}
    for i, (w, spec, shape) in enumerate(zip(d.dom.inside, specs, shapes, strict=True)):
        for a, entry, n in zip(w.axes, (*spec, *(None,) * len(w.axes)), shape, strict=False):
            mesh_axes = _mesh_axes(entry)
            if not mesh_axes:
                continue
            where = f"kernel {d.dom} → {d.cod}: input {i} splits axis {a.name!r} over mesh axis {'×'.join(mesh_axes)}"
            if a.name not in shardable(d):
                why = _refusal(d, a.name) or f"the kernel reduces over {a.name!r}"
                raise NotLowerable(
                    f"{where}, but {why}; reshard it to replicate {a.name!r} (jax.sharding.reshard), or split a "
                    "sequence over devices with rewrites.ring and lowering.lower_devices (ring attention: see "
                    "docs/multi_device.md)"
                )
            if got.setdefault(a.name, mesh_axes) != mesh_axes:
                raise NotLowerable(
                    f"{where}, and another input splits it over {'×'.join(got[a.name])}; reshard them alike"
                )
            if n % (devices := math.prod(mesh_shape[m] for m in mesh_axes)):
                raise NotLowerable(f"{where}: its {n} elements do not split into {devices} equal blocks; pad it")
    return got


def specs_of(wires, sharded: Assignment) -> tuple[Spec, ...]:
    """The partition spec of each wire under an assignment (a mesh axis tuple of one is written as its name)."""
    return tuple(Spec(*(_entry(sharded.get(a.name, ())) for a in w.axes)) for w in wires)


def _entry(mesh_axes: tuple[str, ...]):
    return None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes


def call(fn: Callable, d: Diagram, arrays: Sequence, interpret: bool = False, local: Callable | None = None):
    """``fn`` (the kernel of ``d``, on arrays in its axis order) run per shard of the inputs' sharding: a
    ``shard_map`` under Explicit mesh axes, a ``custom_partitioning`` op under Auto ones, the kernel itself
    elsewhere (one device, or inside a ``shard_map``, its inputs made varying alike); ``interpret``: the kernel
    is interpreted (see :func:`_local`); ``local``: ``fn`` as run on one device or shard (default ``fn``; the
    kernel's jitted ``fn``, :class:`lowering.Kernel`). See the module's docstring.
    """
    local = fn if local is None else local
    types = [jax.typeof(a) for a in arrays]
    mesh = next((t.sharding.mesh for t in types if not t.sharding.mesh.empty), None)
    if mesh is None or mesh.size == 1:
        return _local(local, arrays, interpret)
    kinds = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    specs = [t.sharding.spec for t in types]
    sharded = assign(d, specs, dict(mesh.shape), [t.shape for t in types])
    if sharded:
        used = frozenset(m for ms in sharded.values() for m in ms)
        over = summed_over(d, sharded)
        body = jax.shard_map(
            lambda *xs: _add_partials(_local(local, xs, interpret), over),
            mesh=mesh,
            in_specs=specs_of(d.dom.inside, sharded),
            out_specs=_outs(d, specs_of(d.cod.inside, sharded)),
            axis_names=used,
        )
        return body(*arrays)
    if any(kinds[m] == AxisType.Auto and n > 1 for m, n in mesh.shape.items()):
        return _partitioned(fn, d)(*arrays)
    return _local(local, arrays, interpret)


def _on_mesh(outs, xs):
    """``outs`` typed on the mesh ``xs`` name, their sharding left to the compiler. A ``custom_partitioning`` op's
    results have its function's types, and a ``pallas_call`` names no mesh: the next kernel (or the cotangent's)
    would find none on its inputs and run whole on every device (its inputs gathered), not per shard."""
    mesh = next((m for x in xs if not (m := jax.typeof(x).sharding.mesh).empty), None)
    if mesh is None:
        return outs
    free = lambda x: NamedSharding(mesh, Spec(*[Spec.UNCONSTRAINED] * x.ndim))  # noqa: E731
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, free(x)), outs)


def _outs(d: Diagram, specs: tuple[Spec, ...]):
    return specs[0] if len(d.cod) == 1 else specs


def _local(fn: Callable, arrays: Sequence, interpret: bool):
    """``fn`` on arrays made varying over the same mesh axes (inside ``shard_map``): its outputs vary over them
    all, and the transpose of that cast sums the cotangent of an input shared across devices.

    Interpreted kernels (on CPU) run on every device's blocks, gathered, and each device keeps its own: JAX's
    Pallas interpreter cannot evaluate a kernel's loops on varying values (its loop bodies are traced invariant).
    """
    over = tuple(sorted(varying(arrays).varying))
    xs = [jax.lax.pcast(a, tuple(m for m in over if m not in jax.typeof(a).mat.varying), to="varying") for a in arrays]
    if not over or not interpret:
        return fn(*xs)
    outs = jax.vmap(fn)(*(all_gather_invariant(x, over) for x in xs))
    return jax.tree.map(lambda o: o[jax.lax.axis_index(over)], outs)


@functools.cache
def _partitioned(fn: Callable, d: Diagram) -> Callable:
    """``fn`` as ``custom_partitioning`` ops (forward, and the backward through ``fn``'s own), under Auto axes.

    A kernel with a lowered backward (:func:`lowering._backward.differentiable`) keeps its ``custom_vjp``: each of
    its kernels, the forward with residuals and every backward piece, is an op of its own, so the backward reads
    the forward's residuals. Any other ``fn`` is differentiated inside one op, recomputing its forward there."""
    dom, cod = list(d.dom.inside), list(d.cod.inside)
    if hasattr(fn, "lowered"):
        # imported here: lowering._backward imports the backends, which import this module
        from lowering._backward import differentiable

        primal, kernels, b, _ = fn.lowered

        @functools.cache
        def ops() -> tuple:  # the backward's pieces: their outputs are cotangents (summed over a split axis)
            forward, *pieces = kernels()
            return (_kernel_op(forward), *(_kernel_op(p, sums=True) for p in pieces))

        return differentiable(_op(_positional(primal), d, dom, cod), ops, b, d)
    inexact = [i for i, w in enumerate(dom) if jnp.issubdtype(w.dtype.jnp, jnp.inexact)]
    forward = _op(fn, d, dom, cod)

    def pullback(*xs_cts):
        xs, cts = xs_cts[: len(dom)], xs_cts[len(dom) :]

        def of_inexact(*ys):
            full = list(xs)
            for i, y in zip(inexact, ys, strict=True):
                full[i] = y
            return fn(*full)

        _, pull = jax.vjp(of_inexact, *(xs[i] for i in inexact))
        return pull(cts[0] if len(cod) == 1 else tuple(cts))

    backward = _op(pullback, d, dom + cod, [dom[i] for i in inexact], sums=True)

    @jax.custom_vjp
    def f(*xs):
        return forward(*xs)

    def f_fwd(*xs):
        return forward(*xs), xs

    def f_bwd(xs, cts):
        grads = iter(backward(*xs, *(cts if isinstance(cts, tuple) else (cts,))))
        return tuple(
            next(grads) if i in inexact else np.zeros(np.shape(x), jax.dtypes.float0) for i, x in enumerate(xs)
        )

    f.defvjp(f_fwd, f_bwd)
    return f


def _kernel_op(k, sums: bool = False) -> Callable:
    """A lowered kernel ``k`` as a ``custom_partitioning`` op, by its own diagram (:func:`_op`)."""
    d = k.plan.diagram
    return _op(_positional(k, tupled=sums), d, list(d.dom.inside), list(d.cod.inside), sums)


def _positional(k, tupled: bool = False) -> Callable:
    """``k`` as a function of positional arrays only (``custom_partitioning`` binds its signature); ``tupled``: its
    results always a tuple (as a ``sums`` op's shardings are)."""
    if not tupled:
        return lambda *xs: k(*xs)
    return lambda *xs: (out if isinstance(out := k(*xs), tuple) else (out,))


def _op(fn: Callable, d: Diagram, ins: list, outs: list, sums: bool = False) -> Callable:
    """``fn`` from wires ``ins`` to wires ``outs`` as a ``custom_partitioning`` op: its sharding rule names each
    dimension by its diagram axis, the axes no mesh may split (:func:`shardable`) kept replicated; ``sums``: an
    output lacking a split axis (a gradient summed over it) is summed across the devices splitting it."""
    names = list(dict.fromkeys(a.name for w in (*ins, *outs) for a in w.axes))
    factor = dict(zip(names, string.ascii_lowercase, strict=False))
    side = lambda wires: ", ".join(" ".join(factor[a.name] for a in w.axes) for w in wires)  # noqa: E731
    op = custom_partitioning(fn)

    def partition(mesh, arg_shapes, result_shape):
        specs = [s.sharding.spec for s in arg_shapes]
        sharded = assign(d, specs[: len(d.dom)], dict(mesh.shape), [s.shape for s in arg_shapes[: len(d.dom)]])
        in_specs, out_specs = specs_of(ins, sharded), specs_of(outs, sharded)
        used = {m for ms in sharded.values() for m in ms}
        cotangent_sums = [tuple(sorted(used - {m for a in w.axes for m in sharded.get(a.name, ())})) for w in outs]

        def lower(*xs):  # the backward's cotangents, or the forward's partial sums, added across devices
            return _add_partials(fn(*xs), cotangent_sums if sums else summed_over(d, sharded))

        out_shardings = tuple(NamedSharding(mesh, s) for s in out_specs)
        if len(outs) == 1 and not sums:
            out_shardings = out_shardings[0]
        return mesh, lower, out_shardings, tuple(NamedSharding(mesh, s) for s in in_specs)

    op.def_partition(
        partition,
        sharding_rule=f"{side(ins)} -> {side(outs)}",
        need_replication_factors=tuple(factor[a] for a in names if a not in shardable(d)),
    )
    return lambda *xs: _on_mesh(op(*xs), xs)
