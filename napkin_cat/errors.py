"""The one exception hierarchy of napkin-cat.

Every error a user can provoke is a :class:`NapkinError`; its message names the rule, box, wire or
axis involved and the condition that failed.

>>> issubclass(CompositionError, NapkinError) and issubclass(AxisError, NapkinError)
True
"""


class NapkinError(Exception):
    """Root of every error napkin-cat raises on bad input.

    >>> import napkin_cat as nc
    >>> try:
    ...     nc.Array(*nc.axes("q q"))
    ... except nc.NapkinError as e:
    ...     print(type(e).__name__, "-", e)
    AxisError - repeated axis name in 'q q'
    """


class CompositionError(NapkinError, TypeError):
    """Two diagrams do not compose: axes, sizes, dtypes or levels of the wires differ.

    >>> import napkin_cat as nc
    >>> q, d = nc.axes("q d")
    >>> nc.id(nc.Array(q, d)) >> nc.id(nc.Array(d, q))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CompositionError: ...
    """


class AxisError(NapkinError, ValueError):
    """An axis is unknown, repeated, missing from an array, or has an invalid size.

    >>> import napkin_cat as nc
    >>> nc.Array(*nc.axes("q d")).axis("x")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: array q×d:f32@HBM has no axis 'x'
    """


class EvaluationError(NapkinError, ValueError):
    """Arrays given to a semantics do not match the diagram's input types.

    >>> import jax.numpy as jnp, napkin_cat as nc
    >>> n = nc.Axis("n", 4)
    >>> nc.to_jax(nc.exp(nc.Array(n)))(jnp.ones(5))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: ...
    """


class CostError(NapkinError, ValueError):
    """A cost cannot be computed: unknown sizes, a missing memory level, or memory over capacity.

    >>> import napkin_cat as nc
    >>> nc.cost(nc.library.matmul(*nc.axes("a b c"))).time(nc.hardware.H100)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    napkin_cat.errors.CostError: ...
    """
