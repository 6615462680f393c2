"""The one exception hierarchy of napkin-cat.

Every error a user can provoke is a :class:`NapkinError`; its message names the rule, box, wire or
axis involved and the condition that failed.

>>> issubclass(CompositionError, NapkinError) and issubclass(AxisError, NapkinError)
True
"""


class NapkinError(Exception):
    """Root of every error napkin-cat raises on bad input."""


class CompositionError(NapkinError, TypeError):
    """Two diagrams do not compose: axes, sizes, dtypes or levels of the wires differ."""


class AxisError(NapkinError, ValueError):
    """An axis is unknown, repeated, missing from an array, or has an invalid size."""


class EvaluationError(NapkinError, ValueError):
    """Arrays given to a semantics do not match the diagram's input types."""


class CostError(NapkinError, ValueError):
    """A cost cannot be computed: unknown sizes, a missing memory level, or memory over capacity."""
