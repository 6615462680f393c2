"""Array namespaces: what a generator's semantics computes with (``ctx.xp``).

A generator writes its semantics once, against a namespace offering the few array operations the
generators need (elementwise maps by name, reductions, ``where``, ``einsum``, casts, index grids). The
same code then runs on JAX arrays (the reference semantics, :data:`JAX`), on blocks inside a kernel
(a subclass in ``lowering``), and on numpy object arrays of sympy expressions (the symbolic proofs,
:data:`SYMPY`).

>>> import numpy as np, sympy
>>> a, b = sympy.symbols("a b")
>>> SYMPY.sum(SYMPY.exp(np.array([a, b], dtype=object)), 0)
array(exp(a) + exp(b), dtype=object)
>>> float(JAX.sum(JAX.exp(JAX.asarray([0.0, 0.0])), 0))
2.0
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import sympy

from napkin_cat.dtypes import Dtype


class Jax:
    """The JAX namespace: ``jax.numpy`` with f32 accumulation in contractions.

    >>> float(JAX.einsum("i,i->", JAX.asarray([1.0, 2.0]), JAX.asarray([3.0, 4.0])))
    11.0
    """

    inf = jnp.inf
    exp, exp2, log, log2 = map(staticmethod, (jnp.exp, jnp.exp2, jnp.log, jnp.log2))
    tanh, sqrt, rsqrt, square = map(staticmethod, (jnp.tanh, jnp.sqrt, jax.lax.rsqrt, jnp.square))
    cos, sin = staticmethod(jnp.cos), staticmethod(jnp.sin)
    neg, reciprocal = staticmethod(jnp.negative), staticmethod(jnp.reciprocal)
    sigmoid, silu, relu = map(staticmethod, (jax.nn.sigmoid, jax.nn.silu, jax.nn.relu))
    add, subtract, multiply, divide = map(staticmethod, (jnp.add, jnp.subtract, jnp.multiply, jnp.divide))
    maximum, minimum = staticmethod(jnp.maximum), staticmethod(jnp.minimum)
    where, isneginf, concatenate = staticmethod(jnp.where), staticmethod(jnp.isneginf), staticmethod(jnp.concatenate)
    expand_dims, transpose = staticmethod(jnp.expand_dims), staticmethod(jnp.transpose)

    @staticmethod
    def gelu(v):
        """The exact GELU, ``v/2·(1 + erf(v/√2))``."""
        return jax.nn.gelu(v, approximate=False)

    @staticmethod
    def asarray(v):
        """``v`` as an array of this namespace."""
        return jnp.asarray(v)

    @staticmethod
    def number(value) -> float:
        """A number (a sympy expression without symbols) as this namespace's scalar."""
        return float(value)

    @staticmethod
    def shape(v) -> tuple:
        """The shape of ``v``."""
        return jnp.shape(v)

    @staticmethod
    def f32(v):
        """``v`` in f32, the precision semantics computes in."""
        return v if v.dtype == jnp.float32 else v.astype(jnp.float32)

    @staticmethod
    def cast(v, dtype: Dtype):
        """``v`` in ``dtype`` (a napkin-cat :class:`~napkin_cat.dtypes.Dtype`)."""
        return v.astype(dtype.jnp)

    @staticmethod
    def like(v, other):
        """``v`` in the dtype of ``other`` (a contraction's operands meet in the narrower dtype)."""
        return v.astype(other.dtype) if other.dtype != jnp.float32 else v

    @staticmethod
    def sum(v, axis: int):
        """The sum over one axis."""
        return jnp.sum(v, axis=axis)

    @staticmethod
    def max(v, axis: int):
        """The maximum over one axis."""
        return jnp.max(v, axis=axis)

    @staticmethod
    def min(v, axis: int):
        """The minimum over one axis."""
        return jnp.min(v, axis=axis)

    @staticmethod
    def einsum(spec: str, *xs):
        """A contraction accumulated in f32."""
        return jnp.einsum(spec, *xs, preferred_element_type=jnp.float32)

    @staticmethod
    def full(shape: tuple, value):
        """An f32 array of ``shape`` filled with ``value``."""
        return jnp.full(shape, value, jnp.float32)

    @staticmethod
    def iota(shape: tuple, axis: int):
        """The index along ``axis`` of every element of an array of ``shape``."""
        return jax.lax.broadcasted_iota(jnp.int32, shape, axis)

    @staticmethod
    def iota_over(shape: tuple, dims: tuple, axis: int):
        """The index along ``axis`` (one of ``dims``) of every element of the part of a ``shape`` array kept at
        ``dims``, a block's rows or columns alone, to be spread back over the block by :meth:`broadcast_in_dim`
        (attention dropout hashes each row and each key once this way).

        >>> JAX.iota_over((2, 3), (1,), 1).tolist()
        [0, 1, 2]
        """
        return jax.lax.broadcasted_iota(jnp.int32, tuple(shape[d] for d in dims), dims.index(axis))

    @staticmethod
    def broadcast_in_dim(v, shape: tuple, dims: tuple):
        """``v`` spread over an array of ``shape``, its dimensions at ``dims``.

        >>> JAX.broadcast_in_dim(JAX.iota_over((2, 3), (0,), 0), (2, 3), (0,)).tolist()
        [[0, 0, 0], [1, 1, 1]]
        """
        return jax.lax.broadcast_in_dim(v, shape, dims)

    @staticmethod
    def reshape(v, shape: tuple):
        """``v`` reshaped row-major."""
        return v.reshape(shape)

    @staticmethod
    def split(v, parts: int, axis: int) -> list:
        """``v`` cut into ``parts`` equal pieces along ``axis``."""
        return jnp.split(v, parts, axis=axis)

    @staticmethod
    def join(vs, axis: int):
        """The pieces ``vs`` put back together along ``axis`` (the inverse of :meth:`split`)."""
        return jnp.concatenate(vs, axis=axis)

    @staticmethod
    def lift(fn: Callable) -> Callable:
        """A user's elementwise callable, applied to whole arrays (it is JAX-traceable)."""
        return fn

    @staticmethod
    def index_map(fn: Callable, v, indices: dict):
        """``fn(v, **indices)`` elementwise, ``indices`` the global indices by axis name (vectors along their axes)."""
        return fn(v, **indices)

    @staticmethod
    def index_mask(keep: Callable, indices: dict, shape: tuple):
        """``keep(**indices)`` over a block of ``shape``, ``indices`` the global indices by axis name (vectors along
        their axes, broadcast by the operations that mix them; a result reading fewer is broadcast here).

        >>> JAX.index_mask(lambda q: q > 0, {"q": JAX.iota((2, 1), 0)}, (2, 3)).tolist()
        [[False, False, False], [True, True, True]]
        """
        return jnp.broadcast_to(keep(**indices), shape)


def _as(value) -> np.ndarray:
    return np.asarray(value, dtype=object)


def _pointwise(f: Callable) -> Callable:
    def apply(*arrays):
        arrays = [_as(a) for a in arrays]
        if any(a.ndim for a in arrays):
            return _as(np.frompyfunc(f, len(arrays), 1)(*arrays))
        return _as(f(*(a[()] for a in arrays)))

    return staticmethod(apply)


def _reducer(f: Callable) -> Callable:
    return staticmethod(lambda v, axis: _as(np.frompyfunc(f, 2, 1).reduce(_as(v), axis=axis)))


class Sympy:
    """The sympy namespace: numpy object arrays whose elements are sympy expressions.

    >>> x = sympy.Symbol("x")
    >>> SYMPY.gelu(np.array(x, dtype=object))
    array(x*(erf(sqrt(2)*x/2) + 1)/2, dtype=object)
    """

    inf = sympy.oo
    exp, log, tanh, sqrt = _pointwise(sympy.exp), _pointwise(sympy.log), _pointwise(sympy.tanh), _pointwise(sympy.sqrt)
    exp2, log2 = _pointwise(lambda v: 2**v), _pointwise(lambda v: sympy.log(v, 2))
    cos, sin = _pointwise(sympy.cos), _pointwise(sympy.sin)
    sigmoid = _pointwise(lambda v: 1 / (1 + sympy.exp(-v)))
    gelu = _pointwise(lambda v: v / 2 * (1 + sympy.erf(v / sympy.sqrt(2))))
    silu = _pointwise(lambda v: v / (1 + sympy.exp(-v)))
    relu, neg, square = _pointwise(lambda v: sympy.Max(0, v)), _pointwise(lambda v: -v), _pointwise(lambda v: v**2)
    rsqrt, reciprocal = _pointwise(lambda v: 1 / sympy.sqrt(v)), _pointwise(lambda v: 1 / v)
    add, subtract = _pointwise(lambda a, b: a + b), _pointwise(lambda a, b: a - b)
    multiply, divide = _pointwise(lambda a, b: a * b), _pointwise(lambda a, b: a / b)
    maximum, minimum = _pointwise(sympy.Max), _pointwise(sympy.Min)
    isneginf = _pointwise(lambda v: v == -sympy.oo)
    sum, max, min = _reducer(lambda a, b: a + b), _reducer(sympy.Max), _reducer(sympy.Min)
    asarray = staticmethod(_as)

    @staticmethod
    def number(value) -> sympy.Expr:
        """A number, kept exact."""
        return sympy.sympify(value)

    @staticmethod
    def shape(v) -> tuple:
        """The shape of ``v``."""
        return np.shape(v)

    @staticmethod
    def f32(v):
        """Precision does not exist here: ``v`` itself."""
        return _as(v)

    @staticmethod
    def cast(v, dtype: Dtype):
        """Precision does not exist here: ``v`` itself."""
        return _as(v)

    @staticmethod
    def like(v, other):
        """Precision does not exist here: ``v`` itself."""
        return _as(v)

    @staticmethod
    def where(condition, a, b):
        """``a`` where ``condition`` holds, else ``b``."""
        return _as(np.where(np.asarray(condition, dtype=bool), _as(a), _as(b)))

    @staticmethod
    def concatenate(vs, axis: int):
        """The arrays ``vs`` joined along ``axis``."""
        return np.concatenate([_as(v) for v in vs], axis=axis)

    @staticmethod
    def expand_dims(v, axes):
        """``v`` with new axes of size 1."""
        return np.expand_dims(_as(v), axes)

    @staticmethod
    def transpose(v, order):
        """``v`` with its axes permuted."""
        return np.transpose(_as(v), order)

    @staticmethod
    def reshape(v, shape: tuple):
        """``v`` reshaped row-major."""
        return _as(v).reshape(shape)

    @staticmethod
    def split(v, parts: int, axis: int) -> list:
        """``v`` cut into ``parts`` equal pieces along ``axis``."""
        return np.split(_as(v), parts, axis=axis)

    @staticmethod
    def join(vs, axis: int):
        """The pieces ``vs`` put back together along ``axis``."""
        return np.concatenate([_as(v) for v in vs], axis=axis)

    @staticmethod
    def einsum(spec: str, *xs):
        """The contraction, exactly."""
        return _as(np.einsum(spec, *map(_as, xs), optimize=False))

    @staticmethod
    def full(shape: tuple, value):
        """An array of ``shape`` filled with ``value``."""
        return np.full(shape, sympy.sympify(value), dtype=object)

    @staticmethod
    def iota(shape: tuple, axis: int):
        """The index along ``axis`` of every element of an array of ``shape``."""
        return np.indices(shape)[axis]

    @staticmethod
    def lift(fn: Callable) -> Callable:
        """A user's elementwise callable: a ``jax.numpy`` function by its sympy twin, any other elementwise."""
        return getattr(SYMPY, _JAX_NAMES.get(fn, ""), None) or _pointwise(fn).__func__

    @staticmethod
    def index_mask(keep: Callable, indices: dict, shape: tuple):
        """``keep(**indices)`` on the index arrays, a bool array of ``shape``."""
        return np.broadcast_to(np.asarray(keep(**indices), dtype=bool), shape)

    @staticmethod
    def index_map(fn: Callable, v, indices: dict):
        """``fn(value, **indices)`` element by element, with the indices as Python ints."""
        v = _as(v)
        grids = {k: np.broadcast_to(g, v.shape) for k, g in indices.items()}
        out = np.empty(v.shape, dtype=object)
        for pos in np.ndindex(*v.shape):
            out[pos] = sympy.sympify(fn(v[pos], **{k: int(g[pos]) for k, g in grids.items()}))
        return out


_JAX_NAMES = {
    jnp.exp: "exp",
    jnp.log: "log",
    jnp.tanh: "tanh",
    jnp.sqrt: "sqrt",
    jnp.square: "square",
    jax.nn.sigmoid: "sigmoid",
}

#: the namespaces of the reference semantics and of the symbolic proofs
JAX, SYMPY = Jax(), Sympy()
