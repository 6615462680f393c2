"""Index functions on index vectors where arrays carry no unit axes (Mosaic GPU's register layouts).

An index function is given each index as a vector along its axis, of size 1 on the others
(:meth:`~napkin_cat.generators.Context.indices`), so what it computes from one index (``q // W``, ``q % d``) is
computed once per index and numpy broadcasting spreads it over the block at the first operation that mixes two axes.
A namespace whose arrays cannot have unit axes (Mosaic GPU lays a block out in wgmma's registers, its rows and
columns as vectors of their own layouts, and has no ``[tq, 1]`` array) holds such an index as a :class:`Vector`: the
array over the axes it spans alone, and the shape it stands for. :func:`on_vectors` traces the function at the
shapes its arguments stand for and runs the trace on the vectors, spreading an operand over another axis only where
an operation mixes two axes, which is where numpy broadcasting would. Only what the result depends on is emitted,
and an index the function does not read is never made (its value a :class:`Later`): Mosaic GPU's layout inference
finds no layout for an array nothing reads (an index vector a score modifier's derivative drops, ALiBi's
``∂(s − m·|q − x|)/∂s = 1``) and runs out of search.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters.partial_eval import dce_jaxpr  # no public API prunes a jaxpr (jax 0.11.2)
from jax.extend.core import ClosedJaxpr, Literal

from napkin_cat.errors import NapkinError

#: the primitives computed element by element (with numpy broadcasting of unit axes and scalars): an operation on
#: vectors along one axis stays a vector
PRIMITIVES = frozenset(
    """abs acos acosh add add_any and asin asinh atan atan2 atanh cbrt ceil clamp convert_element_type cos cosh div eq
    erf erf_inv erfc exp exp2 expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg
    nextafter not or population_count pow reduce_precision rem round rsqrt select_n shift_left shift_right_arithmetic
    shift_right_logical sign sin sinh sqrt square sub tan tanh xor""".split()
)

#: the primitives that run a jaxpr of their own, which is run in turn
CALLS = frozenset({"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"})


@dataclass(frozen=True)
class Vector:
    """An array standing for one of ``shape``: ``value`` spans the dimensions ``dims`` of ``shape`` (sizes more than
    1) and is constant along the others, which it has no axes for.

    >>> v = Vector(jnp.arange(3), (1,), (1, 3)) + 2
    >>> v.value.tolist(), v.dims, v.shape
    ([2, 3, 4], (1,), (1, 3))
    """

    value: Any
    dims: tuple
    shape: tuple

    def __add__(self, other):
        return Vector(self.value + other, self.dims, self.shape)

    __radd__ = __add__

    def over(self, dims: tuple, shape: tuple, spread: Callable):
        """The value spanning the dimensions ``dims`` (which include :attr:`dims`) of ``shape``, spread along the
        others by ``spread(value, sizes, positions)`` (``broadcast_in_dim``).

        >>> Vector(jnp.arange(2), (0,), (2, 1)).over((0, 1), (2, 3), jax.lax.broadcast_in_dim).tolist()
        [[0, 0, 0], [1, 1, 1]]
        """
        if dims == self.dims:
            return self.value
        return spread(self.value, tuple(shape[d] for d in dims), tuple(dims.index(d) for d in self.dims))


class Later:
    """An array made on its first read (an index vector, :meth:`Later.get`), and made once: what a function does not
    read is never emitted. Adding an offset stays later.

    >>> made = []
    >>> i = Later(lambda: made.append(1) or jnp.arange(3), jnp.int32) + 2
    >>> len(made)
    0
    >>> i.get().tolist(), i.get().tolist(), len(made)
    ([2, 3, 4], [2, 3, 4], 1)
    """

    def __init__(self, make: Callable, dtype):
        self.make, self.dtype, self.made = make, jnp.dtype(dtype), None

    def get(self):
        if self.made is None:
            self.made = self.make()
        return self.made

    def __add__(self, other):
        return Later(lambda: self.get() + other, jnp.result_type(self.dtype, other))

    __radd__ = __add__


def made(value):
    """``value``, made if it is a :class:`Later`.

    >>> made(Later(lambda: 3, jnp.int32)), made(4)
    (3, 4)
    """
    return value.get() if isinstance(value, Later) else value


def scalar(value) -> Vector:
    """A scalar as a :class:`Vector` of no dimensions.

    >>> scalar(3).dims
    ()
    """
    return Vector(value, (), jnp.shape(value))


class Unvectorised(NapkinError):
    """The trace has an operation :func:`on_vectors` does not run on vectors (a gather, a reduction, a reshape that
    moves axes); the caller evaluates the function on whole blocks instead."""


def on_vectors(fn: Callable, args: list, spread: Callable, shape: tuple | None = None):
    """``fn(*args)`` over the block of ``shape`` (by default, the arguments' shapes broadcast), each argument a
    :class:`Vector` or a scalar: every operation on vectors along one axis runs on those vectors; an operand is spread
    (``spread(value, sizes, positions)``) only where an operation mixes axes, and the result over the whole block
    (its dimensions of more than one index: the block without its unit axes). Raises :class:`Unvectorised`, before
    computing anything, where the trace has an operation it does not know to keep on vectors.

    >>> q, x = Vector(jnp.arange(4), (0,), (4, 1)), Vector(jnp.arange(3), (1,), (1, 3))
    >>> on_vectors(lambda q, x: q % 2 == x % 2, [q, x], jax.lax.broadcast_in_dim).astype(int).tolist()
    [[1, 0, 1], [0, 1, 0], [1, 0, 1], [0, 1, 0]]
    """
    args = [a if isinstance(a, Vector) else scalar(a) for a in args]
    closed, read = pruned_trace(fn, [jax.ShapeDtypeStruct(a.shape, _dtype(a.value)) for a in args])
    _check(closed)  # before any operation is emitted: a kernel falling back keeps no half of this one
    used = [Vector(made(a.value), a.dims, a.shape) for a, r in zip(args, read, strict=True) if r]
    (out,) = _run(closed.jaxpr, [scalar(c) for c in closed.consts], used, spread)
    block = tuple(shape) if shape is not None else jnp.broadcast_shapes(*(a.shape for a in args))
    whole = tuple(d for d, n in enumerate(block) if n > 1)
    lead = len(block) - len(out.shape)  # a result of lower rank (a constant) stands for the block's trailing axes
    out = Vector(out.value, tuple(d + lead for d in out.dims), block)
    return out.over(whole, block, spread)


def on_blocks(fn: Callable, args: list, spread: Callable, shape: tuple):
    """``fn(*args)`` on whole index grids of the block of ``shape`` (what :func:`on_vectors` does not keep: a gather,
    a scan): each :class:`Vector` it reads spread over the block (its dimensions of more than one index), those it
    does not read never made, and only the operations its result depends on emitted.

    >>> q, x = Vector(jnp.arange(2), (0,), (2, 1)), Vector(Later(lambda: 1 / 0, jnp.int32), (1,), (1, 3))
    >>> on_blocks(lambda q, x: jnp.cumsum(q, axis=1), [q, x], jax.lax.broadcast_in_dim, (2, 3)).tolist()
    [[0, 0, 0], [1, 2, 3]]
    """
    whole = tuple(d for d, n in enumerate(shape) if n > 1)
    sizes = tuple(shape[d] for d in whole)
    avals = [
        jax.ShapeDtypeStruct(sizes if isinstance(a, Vector) else jnp.shape(a), _dtype(getattr(a, "value", a)))
        for a in args
    ]
    closed, read = pruned_trace(fn, avals)
    grids = [
        Vector(made(a.value), a.dims, a.shape).over(whole, shape, spread) if isinstance(a, Vector) else a
        for a, r in zip(args, read, strict=True)
        if r
    ]
    return evaluated(closed.jaxpr, closed.consts, grids)[0]


def pruned_trace(fn: Callable, avals: list) -> tuple[ClosedJaxpr, list]:
    """``fn`` traced at ``avals``, pruned to the operations its result depends on, and which arguments it reads."""
    closed = jax.make_jaxpr(fn)(*avals)
    jaxpr, read = dce_jaxpr(closed.jaxpr, True)
    return ClosedJaxpr(jaxpr, closed.consts), read


def _dtype(value):
    return value.dtype if isinstance(value, Later) else jnp.result_type(value)


def _check(closed) -> None:
    """Raise :class:`Unvectorised` where a trace (or a call inside it) has an operation kept off vectors, or a
    constant array (a scalar is a vector of no dimensions; an array has no vector form here)."""
    if any(jnp.shape(c) != () for c in closed.consts):
        raise Unvectorised("a constant array")
    for e in closed.jaxpr.eqns:
        name, inner = e.primitive.name, e.params.get("jaxpr", e.params.get("call_jaxpr"))
        if name in CALLS and hasattr(inner, "consts"):
            _check(inner)
        elif name in MOVES and name != "broadcast_in_dim":
            (a,), (b,) = ([v.aval.shape for v in vs] for vs in (e.invars[:1], e.outvars))
            if [n for n in a if n > 1] != [n for n in b if n > 1]:
                raise Unvectorised(f"{name} from {a} to {b}")
        elif name not in PRIMITIVES and name not in MOVES:
            raise Unvectorised(name)


#: the equations that only add, drop or broadcast unit axes
MOVES = frozenset({"broadcast_in_dim", "reshape", "squeeze", "copy"})


def _run(jaxpr, consts: list, args: list, spread: Callable) -> list:
    env = {}

    def read(v):
        return scalar(v.val) if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for e in jaxpr.eqns:
        ins, name = [read(v) for v in e.invars], e.primitive.name
        if name in PRIMITIVES:
            outs = _elementwise(e, ins, spread)
        elif name in MOVES:
            outs = [_moved(ins[0], tuple(e.outvars[0].aval.shape), e.params.get("broadcast_dimensions"))]
        else:  # a call (checked)
            inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
            outs = _run(inner.jaxpr, [scalar(c) for c in inner.consts], ins, spread)
        env.update(zip(e.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _elementwise(e, ins: list, spread: Callable) -> list:
    """An elementwise equation on the union of its operands' dimensions (numpy broadcasting, unit axes left out):
    an operand of fewer dimensions is spread, a scalar stays a scalar (but a ``select_n`` case, whose cases must
    agree)."""
    shape = tuple(e.outvars[0].aval.shape)
    dims = tuple(sorted({d for v in ins for d in v.dims}))
    cases = e.primitive.name == "select_n"
    values = [
        v.value if v.dims == dims or (not v.dims and not (cases and i)) else v.over(dims, shape, spread)
        for i, v in enumerate(ins)
    ]
    return [Vector(o, dims, shape) for o in _bound(e, values)]


def _moved(v: Vector, shape: tuple, broadcast: tuple | None) -> Vector:
    """A reshape that adds, removes or broadcasts unit axes only: the same value, its dimensions renumbered."""
    if broadcast is not None:  # broadcast_in_dim: operand dimension i is dimension broadcast[i]
        return Vector(v.value, tuple(broadcast[d] for d in v.dims), shape)
    before = [d for d, n in enumerate(v.shape) if n > 1]
    after = [d for d, n in enumerate(shape) if n > 1]  # the same sizes in the same order (checked)
    return Vector(v.value, tuple(after[before.index(d)] for d in v.dims), shape)


def _bound(e, values: list, swaps: dict | None = None) -> list:
    """Equation ``e`` on ``values``; a primitive named in ``swaps`` computed by its function there, and autodiff's
    ``add_any`` (the sum of two cotangents or tangents, as the derivative of a function reading its argument twice
    makes) as ``add``, which every kernel backend lowers (Pallas's Mosaic GPU lowering has no rule for ``add_any``,
    jax 0.11.2)."""
    swap = (swaps or {}).get(e.primitive.name, jax.lax.add if e.primitive.name == "add_any" else None)
    if swap is not None:
        return [swap(*values)]
    outs = e.primitive.bind(*values, **e.primitive.get_bind_params(e.params))  # as eval_jaxpr (custom_jvp_call)
    return outs if e.primitive.multiple_results else [outs]


def evaluated(jaxpr, consts: list, args: list, swaps: dict | None = None) -> list:
    """A jaxpr's outputs on ``args``, each equation bound as it is but those :func:`_bound` computes otherwise
    (``add_any`` as ``add``; the primitives named in ``swaps``); calls run inside (as
    :func:`jax.extend.core.jaxpr_as_fun` would, less those).

    >>> f = jax.make_jaxpr(lambda x: jax.grad(lambda v: v * v)(x))(3.0)
    >>> "add_any" in str(f), float(evaluated(f.jaxpr, f.consts, [3.0])[0])
    (True, 6.0)
    """
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for e in jaxpr.eqns:
        ins, inner = [read(v) for v in e.invars], e.params.get("jaxpr")
        if e.primitive.name in ("jit", "pjit", "closed_call") and hasattr(inner, "consts"):
            outs = evaluated(inner.jaxpr, inner.consts, ins, swaps)
        else:
            outs = _bound(e, ins, swaps)
        env.update(zip(e.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def plain(fn: Callable, swaps: dict | None = None) -> Callable:
    """``fn`` traced at each call and run by :func:`evaluated`: inside a kernel, a derivative with ``add_any`` bound
    as ``add``; the primitives named in ``swaps`` (``{"tanh": native_tanh}``, inside ``jit`` calls too) computed by
    their functions there.

    >>> float(plain(jax.grad(lambda v: v * v))(jnp.float32(3.0)))
    6.0
    >>> float(plain(lambda s: 2 * jnp.tanh(s), {"tanh": jnp.sin})(jnp.float32(0.5))) == float(2 * jnp.sin(0.5))
    True
    >>> plain(lambda s: jax.nn.relu(s) * 2)(jnp.array([-1.0, 2.0])).tolist()  # a custom_jvp function inside
    [0.0, 4.0]
    """

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        outs = evaluated(closed.jaxpr, closed.consts, list(args), swaps)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run
