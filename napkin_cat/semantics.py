"""The reference semantics: a functor from diagrams to JAX functions, evaluated by a flat interpreter.

``to_jax(d)`` walks the diagram's layers once, keeping the values on the wires in a list, so it has
no recursion limit and costs time linear in the number of boxes. Symbolic sizes bind from the
arrays' shapes; dtypes and ranks are checked. Partition labels do not change the meaning of a
diagram, so the reference semantics ignores them (the scheduled semantics in ``rewrites`` runs the
loops they describe).

>>> import jax, jax.numpy as jnp
>>> from napkin_cat import axes, library
>>> q, x, d = axes("q x d")
>>> f = to_jax(library.attention(q, x, d))
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (4, 8)) for i in range(3))
>>> ref = jax.nn.dot_product_attention(Q[None, :, None], K[None, :, None], V[None, :, None])[0, :, 0]
>>> bool(jnp.allclose(f(Q, K, V), ref, atol=1e-5))
True
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import sympy

from napkin_cat.diagram import Diagram, Ty
from napkin_cat.dtypes import dtype as as_dtype
from napkin_cat.errors import EvaluationError
from napkin_cat.generators import Context


def bind(dom: Ty, arrays, *, check_dtype: bool = True) -> dict:
    """Bind the size symbols of ``dom``'s axes to the shapes of ``arrays``; check ranks, sizes, dtypes.

    >>> from napkin_cat import axes, Array
    >>> n, d = axes("n d", d=4)
    >>> bind(Ty(Array(n, d)), [jnp.zeros((3, 4))])
    {n: 3}
    >>> bind(Ty(Array(n, d)), [jnp.zeros((3, 5))])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: input 0 (n×d:f32@HBM): axis 'd' has size 5, expected 4
    >>> bind(Ty(Array(n, d)), [jnp.zeros((0, 4))])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: input 0 (n×d:f32@HBM): axis 'n' is empty (size 0); axis sizes must be positive
    """
    if len(arrays) != len(dom):
        raise EvaluationError(f"expected {len(dom)} arrays ({dom}), got {len(arrays)}")
    sizes: dict = {}
    for i, (wire, value) in enumerate(zip(dom.inside, arrays, strict=True)):
        where = f"input {i} ({wire.describe()})"
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) != len(wire.axes):
            raise EvaluationError(f"{where}: expected rank {len(wire.axes)} {wire.names}, got shape {shape}")
        if check_dtype and as_dtype(value.dtype) != wire.dtype:
            raise EvaluationError(f"{where}: dtype {as_dtype(value.dtype)}, expected {wire.dtype}")
        for axis, n in zip(wire.axes, shape, strict=True):
            if n == 0:  # axes are positive: an empty array has nothing to compute
                raise EvaluationError(f"{where}: axis {axis.name!r} is empty (size 0); axis sizes must be positive")
            size = axis.size
            if isinstance(size, sympy.Symbol):
                if sizes.setdefault(size, n) != n:
                    raise EvaluationError(
                        f"{where}: axis {axis.name!r} has size {n}, but {size} = {sizes[size]} elsewhere"
                    )
    for i, (wire, value) in enumerate(zip(dom.inside, arrays, strict=True)):
        for axis, n in zip(wire.axes, value.shape, strict=True):
            expected = axis.size.subs(sizes)
            if expected.is_number and expected <= 0:  # a size like n - 5, positive only for some n
                at = ", ".join(f"{k}={v}" for k, v in sizes.items() if k in axis.size.free_symbols)
                raise EvaluationError(
                    f"input {i} ({wire.describe()}): axis {axis.name!r} has size {axis.size} = {expected} at {at}; "
                    "axis sizes must be positive: pass arrays at which it is"
                )
            if expected.is_number and int(expected) != n:
                raise EvaluationError(
                    f"input {i} ({wire.describe()}): axis {axis.name!r} has size {n}, expected {expected}"
                )
    return sizes


def as_arrays(dom: Ty, values) -> list:
    """``values`` as JAX arrays, one per wire of ``dom``; anything that is not a numeric array (None, a string)
    is refused naming the input, its wire and what to pass.

    >>> from napkin_cat import axes, Array
    >>> (n,) = axes("n")
    >>> as_arrays(Ty(Array(n)), [None])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: input 0 (n:f32@HBM): expected an array of shape (n,), got NoneType None; \
pass a jax.Array or numpy array
    """
    if len(values) != len(dom):
        raise EvaluationError(
            f"expected {len(dom)} arrays ({dom}), got {len(values)}: pass one array per input wire, in order"
        )
    out = []
    for i, (wire, value) in enumerate(zip(dom.inside, values, strict=True)):
        shape = ", ".join(wire.names) + ("," if len(wire.names) == 1 else "")
        where = f"input {i} ({wire.describe()}): expected an array of shape ({shape})"
        if value is None or isinstance(value, str | bytes):
            raise EvaluationError(f"{where}, got {type(value).__name__} {value!r}; pass a jax.Array or numpy array")
        try:
            array = jnp.asarray(value)
        except (TypeError, ValueError) as e:
            raise EvaluationError(f"{where}, got {type(value).__name__}: {e}") from e
        if not (jnp.issubdtype(array.dtype, jnp.number) or array.dtype == jnp.bool_):
            raise EvaluationError(f"{where} of numbers, got dtype {array.dtype}; pass a jax.Array or numpy array")
        out.append(array)
    return out


def run(d: Diagram, values: list, ctx: Context) -> list:
    """Evaluate ``d`` layer by layer on a list of wire values (the flat interpreter), in ``ctx.xp``.

    >>> import numpy as np
    >>> from napkin_cat import axes, Array, reduce_sum
    >>> from napkin_cat.generators import SYMPY
    >>> (n,) = axes("n")
    >>> run(reduce_sum(Array(n), n), [np.array(sympy.symbols("a b"), dtype=object)], Context(xp=SYMPY))
    [array(a + b, dtype=object)]
    """
    return d.dataflow(values, lambda i, box, ins: box.evaluate(ins, ctx))


def to_jax(d: Diagram) -> Callable:
    """The naive algorithm of ``d`` as a JAX function of its input arrays (one array per input wire).

    Returns one array when the diagram has one output, else a tuple. It traces to one jaxpr under
    ``jax.jit`` and works under ``jax.vmap`` and ``jax.grad``.

    >>> from napkin_cat import axes, Array, exp
    >>> to_jax(exp(Array(*axes("n"))))(jnp.zeros(2)).tolist()
    [1.0, 1.0]
    """

    def f(*arrays):
        arrays = as_arrays(d.dom, arrays)
        out = run(d, arrays, Context(sizes=bind(d.dom, arrays)))
        return out[0] if len(out) == 1 else tuple(out)

    f.__name__ = f.__qualname__ = "to_jax"
    f.__doc__ = f"The reference semantics of a diagram {d.dom} → {d.cod}."
    return f
