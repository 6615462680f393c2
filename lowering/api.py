"""``lower``: the functor from scheduled diagrams to Pallas kernels (the entry point)."""

from __future__ import annotations

from lowering.plan import NotLowerable, plan
from lowering.triton import Config, Lowered
from napkin_cat.diagram import Diagram


def lower(scheduled, backend: str = "triton", interpret: bool | None = None, config: Config | None = None) -> Lowered:
    """A JAX-callable Pallas kernel for a scheduled diagram (a ``Derivation`` or its ``.diagram``).

    ``interpret=None`` interprets on CPU and compiles on GPU. Works under ``jax.jit`` and ``jax.vmap``;
    arrays are passed in the diagram's axis order. Raises :class:`NotLowerable` naming the box or axis
    that the backend cannot handle; nothing falls back to another algorithm.
    """
    d = getattr(scheduled, "diagram", scheduled)
    if not isinstance(d, Diagram):
        raise NotLowerable(f"lower takes a Derivation or a Diagram, got {type(scheduled).__name__}")
    if backend not in ("triton", "auto"):
        raise NotLowerable(f"backend {backend!r}: only the Triton backend is implemented ('triton' or 'auto')")
    return Lowered(plan(d), interpret=interpret, config=config)
