"""``lower``: the functor from scheduled diagrams to Pallas kernels (the entry point)."""

from __future__ import annotations

import jax

from lowering.plan import NotLowerable, plan
from lowering.triton import Config, Lowered
from napkin_cat.diagram import Diagram
from napkin_cat.semantics import to_jax


class Kernel:
    """A lowered diagram: call it like ``nc.to_jax`` of the diagram; differentiable through ``jax.custom_vjp``.

    ``forward`` is the forward :class:`Lowered` kernel; ``backward`` says how gradients are computed:
    ``"lowered"`` (derived backward kernels), ``"reference"`` (``jax.vjp`` of the reference semantics,
    asked for explicitly), or the reason there is none.
    """

    def __init__(self, forward: Lowered, fn, backward: str, kernels: tuple = ()):
        self.forward, self.fn, self.backward, self.kernels = forward, fn, backward, kernels
        self.__name__ = "napkin_kernel"

    def __call__(self, *arrays):
        return self.fn(*arrays)

    @property
    def source(self) -> str:
        """The emitted kernels, described: the forward, then any backward kernels."""
        return "\n\n".join(k.source for k in (self.forward, *self.kernels))


def _refuse(f, why: str):
    @jax.custom_vjp
    def g(*xs):
        return f(*xs)

    def fwd(*xs):
        return f(*xs), None

    def bwd(_, __):
        raise NotLowerable(f"{why}; pass backward='reference' to lower() to differentiate with the reference semantics")

    g.defvjp(fwd, bwd)
    return g


def _reference(f, d: Diagram):
    ref = to_jax(d)

    @jax.custom_vjp
    def g(*xs):
        return f(*xs)

    def fwd(*xs):
        return f(*xs), xs

    def bwd(xs, ct):
        return jax.vjp(ref, *xs)[1](ct)

    g.defvjp(fwd, bwd)
    return g


def lower(scheduled, backend: str = "triton", interpret: bool | None = None, config: Config | None = None,
          backward: str = "lowered") -> Kernel:
    """A JAX-callable Pallas kernel for a scheduled diagram (a ``Derivation`` or its ``.diagram``).

    ``interpret=None`` interprets on CPU and compiles on GPU. Works under ``jax.jit``, ``jax.vmap`` and
    ``jax.grad``; arrays are passed in the diagram's axis order. ``backward="lowered"`` differentiates
    with lowered backward kernels where the diagram is attention (FlashAttention-2's split); where it is
    not, differentiating raises :class:`NotLowerable` saying why, unless ``backward="reference"``.
    Raises :class:`NotLowerable` naming the box or axis that the backend cannot handle; nothing falls back
    to another algorithm silently.
    """
    d = getattr(scheduled, "diagram", scheduled)
    if not isinstance(d, Diagram):
        raise NotLowerable(f"lower takes a Derivation or a Diagram, got {type(scheduled).__name__}")
    if backend not in ("triton", "auto"):
        raise NotLowerable(f"backend {backend!r}: only the Triton backend is implemented ('triton' or 'auto')")
    if backward not in ("lowered", "reference"):
        raise NotLowerable(f"backward {backward!r}: choose 'lowered' or 'reference'")
    forward = Lowered(plan(d), interpret=interpret, config=config)
    if backward == "reference":
        return Kernel(forward, _reference(forward, d), "reference")
    from lowering.backward import attention_parts, attention_vjp, backward_diagrams, with_residual
    from rewrites import derive, stream, tile

    try:
        parts = attention_parts(d)
    except NotLowerable as e:
        return Kernel(forward, _refuse(forward, str(e)), str(e))
    res, _ = with_residual(d, parts)
    fwd_res = Lowered(plan(res), interpret=interpret, config=config)
    g = min(forward.plan.tiles[parts.q], 64)
    s = min(forward.plan.stream[1], 64) if forward.plan.stream else 64
    # The backward schedules are verified in tests/test_backward.py; here they are only relabelled.
    dq, dkv = backward_diagrams(parts)
    dq_k = Lowered(plan(derive(dq, tile(parts.q, g), stream(parts.x, s), verify=False).diagram), interpret=interpret)
    dkv_k = Lowered(plan(derive(dkv, tile(parts.x, g), stream(parts.q, s), verify=False).diagram), interpret=interpret)
    return Kernel(forward, attention_vjp(fwd_res, dq_k, dkv_k, parts), "lowered", (fwd_res, dq_k, dkv_k))
