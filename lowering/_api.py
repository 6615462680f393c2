"""``lower``: the functor from scheduled diagrams to Pallas kernels (the entry point).

What a kernel computes where the reference and ``jax.nn`` disagree (decided, and tested in
``tests/test_bad_inputs.py``):

* A row whose scores are all ``-inf`` (every key masked) gives 0, in the kernel and in ``nc.to_jax``,
  where ``jax.nn.softmax`` gives NaN: FlashAttention's convention, so padding and masks never make NaN.
* A NaN in a *key* (a row of ``K``) reaches only the rows that see that key: the mask replaces the
  score before the softmax, in the kernel, ``nc.to_jax`` and ``jax.nn`` alike.
* A NaN in a *value* (a row of ``V``) at key ``j`` that the mask hides: the reference (and
  ``jax.nn``) give NaN in every row, as ``0 · NaN = NaN`` in the contraction. The kernel gives NaN in
  the rows of every query tile that visits key ``j``'s chunk and finite values elsewhere: with the
  causal mask, the tiles whose last query is at or after the start of ``j``'s chunk. Values must be
  finite; making the kernel agree would mean visiting the blocks the mask lets it skip.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Literal

import jax

from lowering import _spmd as spmd
from lowering._backward import Piece, backward_of, differentiable
from lowering._fp8 import NO_BACKWARD
from lowering._plan import NotLowerable, kept_whole, plan
from lowering._registry import BACKENDS as BACKENDS  # the registered names, in "auto"'s order
from lowering._registry import REGISTRY, Backend, check_config, walk_auto
from lowering._registry import backend as registered
from lowering._search import refine
from lowering._target import interpreted, no_gpu, target_hardware
from lowering._tiles import Choice, choose_tiles, missing_sizes
from lowering.triton import STAGES, Config, Lowered
from napkin_cat.diagram import Diagram
from napkin_cat.dtypes import FP8
from napkin_cat.errors import CostError, EvaluationError, NapkinError
from napkin_cat.hardware import Hardware, lookup
from napkin_cat.semantics import to_jax
from rewrites import bind_sizes, open_sizes, resolve

Differentiation = Literal["lowered", "reference", "none"]


class Kernel:
    """A lowered diagram: call it like ``nc.to_jax`` of the diagram; differentiable through ``jax.custom_vjp``.

    ``backend`` names the backend that emitted it; ``differentiation`` says how gradients are computed:
    ``"lowered"`` (derived backward kernels, built when first differentiated), ``"reference"``
    (``jax.vjp`` of the reference semantics, asked for explicitly) or ``"none"`` (differentiating
    raises :class:`NotLowerable`); ``why_not`` says why there is no lowered backward, else None;
    ``backends`` maps each of its kernels (forward, then the backward's, built if need be) to the backend
    that emitted it, and ``refused`` each kernel ``backend="auto"`` kept off the backends before its own (Mosaic,
    then Triton: :data:`lowering._registry.REGISTRY`) to why; ``tiles`` maps
    every partition size of the kernel to its value (``{"g_q": 16, "s_x": 16}``) and ``choice`` says how
    sizes the derivation left open were chosen (None when it left none).

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> kernel = lower(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False))
    >>> kernel.backend, kernel.differentiation, kernel.why_not, kernel.tiles
    ('triton', 'lowered', None, {'g_q': 16, 's_x': 16})
    >>> kernel.refused["forward"]
    "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU"
    >>> Q, K, V = (jax.random.normal(jax.random.key(i), (24, 16)) for i in range(3))
    >>> dQ = jax.grad(lambda Q: kernel(Q, K, V).sum())(Q)
    >>> bool(jnp.allclose(dQ, jax.grad(lambda Q: nc.to_jax(kernel.diagram)(Q, K, V).sum())(Q), atol=1e-4))
    True
    >>> kernel(Q, K)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: kernel q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d: expected 3 arrays, got 2
    """

    def __init__(
        self,
        diagram: Diagram,
        forward: Lowered,
        fn: Callable,
        *,
        backend: str,
        differentiation: Differentiation,
        why_not: str | None = None,
        backward: Callable[[], tuple[Lowered, ...]] | None = None,
        emitted: dict[str, tuple[str, str | None]] | None = None,
        choice: Choice | None = None,
    ):
        self.diagram, self.forward, self._fn, self.backend = diagram, forward, fn, backend
        self._emitted, self.choice = emitted if emitted is not None else {"forward": (backend, None)}, choice
        self.differentiation, self.why_not, self._backward = differentiation, why_not, backward
        # jitted once per kernel: calls on arrays of equal shapes and dtypes (a model's layers) share one trace and
        # one lowering (jit's caches, and its derivatives' under grad), where each call traced the pallas_calls anew
        # and every layer's copy was lowered, and compiled on a GPU, on its own
        self._jitted = jax.jit(fn)
        self.__name__ = "napkin_kernel"

    @property
    def tiles(self) -> dict[str, int]:
        """Every partition size of the kernel by its symbol's name: ``g_a`` for a tiled axis, ``s_x`` for the
        streamed one, as the cost functor names them."""
        return _tiles(self.diagram)

    @property
    def backends(self) -> dict[str, str]:
        """The backend of each kernel by its role (``"forward"``, ``"forward with residuals"``, each backward
        kernel's :func:`role`), the backward's built if need be."""
        _ = self.kernels  # the backward's kernels choose their backends when built
        return {what: backend for what, (backend, _) in self._emitted.items()}

    @property
    def refused(self) -> dict[str, str]:
        """Why ``backend="auto"`` kept each kernel (by role) off the backends before its own (``"; "``-joined, in
        :data:`lowering._registry.REGISTRY`'s order), for those built; a kernel on the first backend is not here."""
        return {what: why for what, (_, why) in self._emitted.items() if why is not None}

    @property
    def kernels(self) -> tuple[Lowered, ...]:
        """The backward kernels (forward with its residual, then the gradients'), built on first use; else ()."""
        return self._backward() if self._backward is not None else ()

    @property
    def layout(self) -> tuple[tuple[str, ...], ...]:
        """The axis names of each input, in the order the kernel takes them: the diagram's (:func:`layout`)."""
        return layout(self.diagram)

    def __call__(self, *arrays):
        check_layout(self.diagram, arrays)
        compiled = getattr(self.forward, "interpret", None) is False  # a GPU kernel, compiled (XLA says None)
        if compiled and (why := no_gpu()) and not any(isinstance(a, jax.core.Tracer) for a in arrays):
            raise NotLowerable(  # lowered for a GPU elsewhere (hardware=, interpret=False): traced, never run here
                f"kernel lowered with interpret=False, and {why}: it can be lowered for CUDA "
                "(jax.jit(kernel).trace(...).lower(lowering_platforms=('cuda',))) but not run here; lower it with "
                "interpret=None or interpret=True to run it here"
            )
        interpret = bool(self.forward.interpret)
        return spmd.call(self._fn, self.diagram, arrays, interpret, local=self._jitted)  # per shard (lowering._spmd)

    @property
    def source(self) -> str:
        """The emitted kernels, described: the forward, then any backward kernels (built if need be)."""
        return "\n\n".join(k.source for k in (self.forward, *self.kernels))


def _tiles(d: Diagram) -> dict[str, int]:
    out = {}
    for w in (*d.dom.inside, *d.cod.inside):
        for a in w.axes:
            for prefix, n in (("g", a.group), ("s", a.stream)):
                if n is not None and n.is_number:
                    out.setdefault(f"{prefix}_{a.name}", int(n))
    return out


class OpenKernel:
    """A lowered diagram whose kernels depend on sizes known only when it is called: open partition sizes
    (chosen from the cost model, :func:`lowering.choose_tiles`), or under ``backend="auto"`` on an sm_90 GPU the
    sizes of axes kept whole (a head dim), which Mosaic's registers and shared memory, hence the choice of
    backend, depend on (bound with :func:`rewrites.bind_sizes`). Each call reads the axis sizes from the arrays'
    shapes, and the :class:`Kernel` for them is built once per sizes it depends on (``keys``: those axes' names;
    None: every axis) and called. ``at(**sizes)`` builds it without calling. ``tiles``, ``choice`` and what a
    :class:`Kernel` says of itself (``backend``, ``backends``, ``refused``, ``differentiation``, ``why_not``,
    ``kernels``, ``forward``, ``source``) are those of the last kernel built (None before the first).

    >>> import jax
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x = nc.axes("q x")
    >>> kernel = lower(derive(nc.library.attention(q, x, nc.Axis("d", 16)), tile(q), stream(x), verify=False))
    >>> kernel.tiles is None, kernel.at(q=100, x=70).tiles
    (True, {'g_q': 128, 's_x': 128})
    >>> Q, K, V = (jax.random.normal(jax.random.key(i), (40, 16)) for i in range(3))
    >>> kernel(Q, K, V).shape, kernel.tiles
    ((40, 16), {'g_q': 64, 's_x': 64})
    """

    #: what the last kernel built says of itself (:class:`Kernel`), None before the first
    LAST = ("backend", "backends", "refused", "differentiation", "why_not", "kernels", "forward", "source")

    def __init__(self, diagram: Diagram, build: Callable[[dict], Kernel], keys: tuple[str, ...] | None = None):
        self.diagram, self._build, self._built, self._last, self._keys = diagram, build, {}, None, keys
        self.__name__ = "napkin_kernel"

    def __getattr__(self, name):
        if name in OpenKernel.LAST:
            last = self.__dict__.get("_last")
            return None if last is None else getattr(last, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def at(self, **sizes: int) -> Kernel:
        """The kernel for these axis sizes (by name), chosen and built on first use."""
        key = tuple(sorted((a, n) for a, n in sizes.items() if self._keys is None or a in self._keys))
        if key not in self._built:
            self._built[key] = self._build(dict(sizes))
        self._last = self._built[key]
        return self._last

    @property
    def tiles(self) -> dict[str, int] | None:
        """The partition sizes of the last kernel built (:attr:`Kernel.tiles`), None before the first."""
        return None if self._last is None else self._last.tiles

    @property
    def choice(self) -> Choice | None:
        """How the last kernel built chose its open sizes (:class:`lowering.Choice`), None before the first."""
        return None if self._last is None else self._last.choice

    @property
    def layout(self) -> tuple[tuple[str, ...], ...]:
        """The axis names of each input, in the order the kernel takes them: the diagram's (:func:`layout`)."""
        return layout(self.diagram)

    def __call__(self, *arrays):
        return self.at(**check_layout(self.diagram, arrays))(*arrays)


def layout(d: Diagram) -> tuple[tuple[str, ...], ...]:
    """The axis names of each input of ``d``'s kernel, in the order it takes them: the diagram's own, which is
    not always a library entry's (the multi-head diagram's ``[b, h, q, d]``, where ``nc.attention`` takes
    ``[b, q, h, d]``).

    >>> import napkin_cat as nc
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> layout(nc.library.multi_head_attention(h, q, x, d, batch=(b,)))
    (('b', 'h', 'q', 'd'), ('b', 'h', 'x', 'd'), ('b', 'h', 'x', 'd'))
    """
    return tuple(tuple(w.names) for w in d.dom.inside)


def check_layout(d: Diagram, arrays) -> dict[str, int]:
    """The size of every axis of ``d``'s inputs, read from ``arrays`` laid out as :func:`layout` says; an
    :class:`EvaluationError` naming the input, its layout, the shape received and the fix where their number,
    a rank, a size the diagram fixes, or the sizes one axis name gets in two inputs disagree (an array passed in
    another axis order, where the sizes differ). Arrays whose sizes all fit cannot be told from a transpose.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> b, h, q, x = nc.axes("b h q x")
    >>> mha = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 8), batch=(b,))
    >>> check_layout(mha, [jnp.zeros((2, 4, 16, 8)), jnp.zeros((2, 4, 32, 8)), jnp.zeros((2, 4, 32, 8))])
    {'b': 2, 'h': 4, 'q': 16, 'd': 8, 'x': 32}
    >>> check_layout(mha, [jnp.zeros((2, 4, 16, 8)), jnp.zeros((2, 32, 4, 8)), jnp.zeros((2, 4, 32, 8))])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: kernel input 1 (b×h×x×d:f32@HBM): shape (2, 32, 4, 8) read as (b, h, x, d) \
gives h = 32, but h = 4 in input 0; the kernel takes each array in its diagram's axis order (kernel.layout), which \
may not be nc.attention's (b, q, h, d): transpose the array into (b, h, x, d)
    """
    dom = d.dom
    if len(arrays) != len(dom):
        raise EvaluationError(f"kernel {dom} → {d.cod}: expected {len(dom)} arrays, got {len(arrays)}")
    sizes: dict[str, int] = {}
    seen: dict[str, int] = {}  # the input each size was first read from
    for i, (w, array) in enumerate(zip(dom.inside, arrays, strict=True)):
        shape, order = tuple(jax.numpy.shape(array)), f"({', '.join(w.names)})"
        why = _misread(w, shape, sizes, seen, i)
        if why is not None:
            # the usual slip: a multi-head array in nc.attention's (b, q, h, d) order
            note = ", which may not be nc.attention's (b, q, h, d)" if len(w.axes) >= 3 else ""
            raise EvaluationError(
                f"kernel input {i} ({w.describe()}): shape {shape} read as {order} {why}; the kernel takes each "
                f"array in its diagram's axis order (kernel.layout){note}: transpose the array into {order}"
            )
    return sizes


def _misread(w, shape: tuple, sizes: dict, seen: dict, i: int) -> str | None:
    """What is wrong with ``shape`` read as input ``i`` of type ``w`` (its rank, a size the diagram fixes, a size
    another input gave the same axis), else None; records each axis's size in ``sizes`` (first from input ``seen``)."""
    if len(shape) != len(w.axes):
        return f"has {len(shape)} axes, expected {len(w.axes)}"
    for a, n in zip(w.axes, shape, strict=True):
        if a.size.is_number and int(a.size) != n:
            return f"gives {a.name} = {n}, but the diagram fixes {a.name} = {int(a.size)}"
        if sizes.setdefault(a.name, n) != n:
            return f"gives {a.name} = {n}, but {a.name} = {sizes[a.name]} in input {seen[a.name]}"
        seen.setdefault(a.name, i)
    return None


#: what a refused backward's error suggests by default
REFERENCE_FIX = "pass backward='reference' to lower() to differentiate with the reference semantics"


def _refuse(f, why: str, fix: str = REFERENCE_FIX):
    @jax.custom_vjp
    def g(*xs):
        return f(*xs)

    def fwd(*xs):
        return f(*xs), None

    def bwd(_, __):
        raise NotLowerable(f"{why}; {fix}")

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


def _backend(backend: str) -> str:
    """``backend`` if it is ``"auto"`` or a registered backend's name; else :class:`NotLowerable` listing them."""
    return backend if backend == "auto" else registered(backend).name


def role(piece: Piece) -> str:
    """A backward kernel's name in messages: what it computes and its schedule.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> b = backward_of(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> [role(p) for p in b.pieces]
    ['backward kernel Δ (tile(q, 16))', 'backward kernel d(input 0) (tile(q, 16), stream(x, 16))', \
'backward kernel d(input 1), d(input 2) (tile(x, 16), stream(q, 16))']
    """
    what = piece.what if piece.feeds else ", ".join(f"d(input {i})" for i in piece.outputs)
    return f"backward kernel {what} ({', '.join(map(str, piece.rules))})"


class _Emitter:
    """Lowers each kernel of a :class:`Kernel` (forward, forward with residuals, backward pieces) with one
    backend, or with ``"auto"``'s choice per kernel (:func:`lowering._registry.walk_auto`), recording which
    backend each got and why the backends before it did not."""

    def __init__(self, backend: str, interpret, config, hw: Hardware | None):
        check_config(backend, config)
        self.backend = None if backend == "auto" else registered(backend)
        self.interpret, self.config, self.hw = interpret, config, hw
        #: per kernel (by role): the backend that emitted it and, under "auto", why not the ones before (else None)
        self.chosen: dict[str, tuple[str, str | None]] = {}

    def __call__(self, d: Diagram, what: str):
        p = plan(d)
        b = self.backend
        if b is not None:
            own = self.config if isinstance(self.config, b.config) else None
            if why := b.admit(p, interpret=self.interpret, config=own):
                raise NotLowerable(f"{b.title}, {what}: {why}")
            self.chosen[what] = (b.name, None)
            return b.emit(p, interpret=self.interpret, config=own, hardware=self.hw)
        asked = dict(interpret=self.interpret, config=self.config, hardware=self.hw)
        b, kernel, why = walk_auto(p, **asked, backward=what.startswith("backward kernel"))
        self.chosen[what] = (b.name, why)
        sizes = {a.name: a.size for w in d.dom.inside for a in w.axes}
        if b.pads or all(sizes[a].is_number for a in (*p.tiles, *(p.stream or ())[:1])):
            return kernel  # whole blocks, checked by its admit

        def rest() -> tuple[Backend, object]:
            after, other, _ = walk_auto(p, **asked, backward=what.startswith("backward kernel"), after=b)
            return after, other

        return _WholeBlocks(kernel, rest, lambda shape, name, why: self._ragged(what, shape, name, why))

    def _ragged(self, what: str, shape: tuple, name: str, why: str) -> None:
        self.chosen[f"{what} at {shape}"] = (name, why)


class _WholeBlocks:
    """``backend="auto"``'s kernel on a backend that pads nothing (Mosaic) for a diagram whose axis sizes are known
    only when called: arrays that split into whole blocks run on it; any others on the kernel of the next backend
    ``"auto"`` takes for the same diagram (Triton's, which pads them), each such shape recorded in
    :attr:`Kernel.backends` and :attr:`Kernel.refused`."""

    def __init__(self, mosaic, rest: Callable[[], tuple], note: Callable[[tuple, str, str], None]):
        rest = functools.cache(rest)
        #: the next backend's kernel (Triton's), built on first use, and that backend's name
        self._triton, self._after = (lambda: rest()[1]), (lambda: rest()[0].name)
        self.mosaic, self._note = mosaic, note

    def __getattr__(self, name):
        return getattr(self.mosaic, name)

    def __call__(self, *arrays):
        why = self.mosaic.ragged(*arrays)
        if why is None:
            return self.mosaic(*arrays)
        self._note(tuple(tuple(jax.numpy.shape(a)) for a in arrays), self._after(), why)
        return self._triton()(*arrays)


def lower(
    scheduled,
    backend: str = "auto",
    interpret: bool | None = None,
    config: Config | None = None,
    backward: str = "lowered",
    *,
    hardware: Hardware | str | None = None,
    sizes: Mapping[str, int] | None = None,
    search: bool = False,
) -> Kernel | OpenKernel:
    """A JAX-callable Pallas kernel for a scheduled diagram (a ``Derivation`` or its ``.diagram``).

    ``interpret=None`` interprets on CPU and compiles on GPU. Works under ``jax.jit``, ``jax.vmap`` and
    ``jax.grad``; arrays are passed in the diagram's axis order. ``backend="mosaic"`` lowers every kernel,
    forward and backward, for Hopper (:mod:`lowering.mosaic`, tuned by a ``MosaicConfig``); a kernel it
    cannot lower is named in the error (the forward) or in ``kernel.why_not`` (a backward kernel), never
    replaced by Triton's. ``backend="xla"`` lowers to plain JAX compiled by XLA on any device, no Pallas
    (:mod:`lowering.xla`: tiles vmapped, the stream a ``lax.fori_loop``). ``backend="auto"`` walks the backends in
    order (:data:`lowering._registry.REGISTRY`), per kernel: Mosaic on an sm_90 GPU where the kernel lowers there
    and its configuration was measured faster than Triton's (:func:`lowering.mosaic.faster`), else Triton, else
    XLA where neither admits the plan; ``kernel.backends`` says which, ``kernel.refused`` why not the ones
    before. A backend's refusal of the sizes of a plan it admits (Triton's shared memory) is raised, with the
    schedule's fix, not passed on to a slower backend. ``config`` (the class of one backend) reaches every
    kernel of its backend, backward included. ``hardware``
    (a :class:`~napkin_cat.hardware.Hardware` or its name) sets the per-block shared-memory limit; by
    default the detected GPU's model, H100 when interpreting.

    ``backward="lowered"`` differentiates with lowered backward kernels derived from ``nc.reverse`` of
    the diagram (:mod:`lowering._backward`: FlashAttention-2's log-sum-exp residual and Δ, one kernel per
    schedule), built when first differentiated, so lowering never fails because of them; where there
    are none, ``kernel.why_not`` names the box and the reason and differentiating raises
    :class:`NotLowerable`. ``backward="fused"`` is ``"lowered"`` with dQ computed in the dK·dV kernel, its
    programs' partial sums added into an f32 output (FlashAttention-3's five products:
    :func:`lowering._backward.fused_groups`; the Mosaic and XLA backends add them, Triton refuses the kernel).
    ``backward="reference"`` differentiates the reference semantics instead.

    Partition sizes the derivation left open (``tile(q)``, ``stream(x)``) are chosen here for ``hardware``
    from the diagram's own cost (:func:`lowering.choose_tiles`: the largest tiles whose blocks fit shared
    memory, ties broken by the predicted time), at the axis sizes of the diagram or ``sizes`` (by name); where
    some stay unknown, the result is an :class:`OpenKernel` that chooses at each call from the arrays' shapes.
    ``search=True`` (GPU only) times the model's first choices with a few warps and stages and keeps the
    fastest (:func:`lowering._search.refine`, cached). ``kernel.tiles`` states the sizes, ``kernel.choice`` why.

    The shape guards (power-of-two blocks ≥ 16, so every 16-bit dot has K ≥ 16; axes kept whole
    padded only where that is neutral; the shared-memory footprint) raise :class:`NotLowerable` here
    when the sizes they read are concrete, else at the first call, before anything is padded. Nothing
    falls back to another algorithm silently. Where results differ from ``jax.nn`` on non-finite
    inputs, see this module's docstring (and docs/lowering.md).

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x = nc.axes("q x")
    >>> flash = lambda d: derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False)
    >>> kernel = lower(flash(nc.Axis("d", 64)), config=Config(num_warps=8, num_stages=2), hardware="A100")
    >>> kernel.backend, kernel.forward.hardware.name
    ('triton', 'A100')
    >>> open_flash = derive(nc.library.attention(q, x, nc.Axis("d", 64)), tile(q), stream(x), verify=False)
    >>> kernel = lower(open_flash, hardware="H100", sizes={"q": 4096, "x": 4096})
    >>> kernel.tiles, kernel.choice.how
    ({'g_q': 256, 's_x': 64}, 'cost model')
    >>> lower(flash(nc.Axis("d", 512)))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: the kernel would hold 1,048,576 B of shared memory ... over the 232,448 B ...
    """
    d, hw = _arguments(scheduled, backend, backward, hardware)
    opens, late = open_sizes(d), _late_sizes(d, backend, interpret, config)
    options = (backend, interpret, config, backward)
    if opens:
        return _chosen(d, opens, late, options, hw, sizes, search)
    for what, given in (("search=True", search), ("sizes=", sizes)):
        if given:
            raise NotLowerable(f"lower({what}): the diagram leaves no partition size open to choose")
    if not late:
        return _lower(d, *options, hw)

    def bound(at: dict) -> Kernel:
        return _lower(bind_sizes(d, {a: at[a] for a in late}), *options, hw)

    return OpenKernel(d, bound, keys=late)


def _arguments(scheduled, backend: str, backward: str, hardware) -> tuple[Diagram, Hardware | None]:
    """:func:`lower`'s diagram and hardware model, after its arguments are checked (a :class:`NotLowerable` naming
    the one that is wrong)."""
    d = getattr(scheduled, "diagram", scheduled)
    if not isinstance(d, Diagram):
        raise NotLowerable(f"lower takes a Derivation or a Diagram, got {type(scheduled).__name__}")
    _backend(backend)
    if backward not in ("lowered", "fused", "reference"):
        raise NotLowerable(f"backward {backward!r}: choose 'lowered', 'fused' or 'reference'")
    try:
        return d, None if hardware is None else lookup(hardware)
    except CostError as e:
        raise NotLowerable(f"lower: {e}") from e


def _chosen(d: Diagram, opens, late: tuple, options: tuple, hw, sizes, search: bool) -> Kernel | OpenKernel:
    """:func:`lower` of a diagram leaving partition sizes (``opens``) open: chosen from the cost model (and timed,
    with ``search``) at the sizes ``sizes`` gives, or at each call's where some are missing. ``options``:
    ``(backend, interpret, config, backward)``."""
    backend, interpret, config, backward = options
    axes = {a.name for w in (*d.dom.inside, *d.cod.inside) for a in w.axes}
    if unknown := sorted(set(sizes or {}) - axes):
        here = ", ".join(sorted(axes))
        raise NotLowerable(f"lower(sizes=): no wire has axis {', '.join(unknown)}; axes here: {here}")
    on_cpu = interpreted(interpret)
    if search and on_cpu:
        raise NotLowerable(
            f"lower(search=True) times kernels on a GPU, and here they are interpreted; the sizes of "
            f"{', '.join(map(str, opens))} come from the cost model without it"
        )
    target = hw if hw is not None else target_hardware(on_cpu)
    stages = config.num_stages if isinstance(config, Config) else STAGES  # the documented default depth

    def build(at: dict) -> Kernel:
        d_at = bind_sizes(d, {a: at[a] for a in late})
        choice = choose_tiles(d_at, target, at, stages=stages)
        chosen = config
        if search:

            def make(sizes, cfg):
                return _lower(resolve(d_at, sizes), "triton", False, cfg, "reference", target)

            choice, chosen = refine(d_at, choice, make)
        return _lower(resolve(d_at, choice.sizes), backend, interpret, chosen, backward, target, choice)

    given = dict(sizes or {})
    if not missing_sizes(d, given):
        return build(given)
    return OpenKernel(d, lambda at: build({**given, **at}))


def _late_sizes(d: Diagram, backend: str, interpret, config) -> tuple[str, ...]:
    """The axes kept whole whose sizes ``d`` leaves symbolic, where ``backend="auto"`` may take a backend whose choice
    reads them (``reads_whole``: Mosaic on an sm_90 GPU, :func:`lowering.mosaic.faster`, its registers), so
    :func:`lower` binds them at the call; else ().

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> _late_sizes(derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False).diagram,
    ...             "auto", None, None)  # on a CPU, auto takes Triton whatever the sizes
    ()
    """
    if backend != "auto" or not any(b.reads_whole and b.available(interpret, config) is None for b in REGISTRY):
        return ()
    size = {a.name: a.size for w in d.dom.inside for a in w.axes}
    return tuple(a for a in kept_whole(d) if not size[a].is_number)


def _chunks(d: Diagram, backend: str, interpret, config) -> dict:
    """``backward_of``'s chunks for the backend lowering the backward: ``backend``, or under ``"auto"`` the first
    available here (Mosaic on an sm_90 GPU, else Triton): :meth:`lowering._registry.Backend.chunks`."""
    if backend != "auto":
        return registered(backend).chunks(d, config, auto=False)
    first = next(b for b in REGISTRY if b.available(interpret, config) is None)
    return first.chunks(d, config, auto=True)


def _lower(
    d: Diagram,
    backend: str,
    interpret: bool | None,
    config,
    backward: str,
    hw: Hardware | None,
    choice: Choice | None = None,
) -> Kernel:
    """:func:`lower` of a diagram whose partition sizes are all concrete (``choice``: how open ones were chosen)."""
    name = _backend(backend)
    emit = _Emitter(name, interpret, config, hw)
    primal = emit(d, "forward")
    made = functools.partial(Kernel, d, primal, backend=emit.chosen["forward"][0], emitted=emit.chosen, choice=choice)
    if any(w.dtype in FP8 for w in d.dom.inside):  # FP8 attention is forward only (lowering._fp8)
        return made(_refuse(primal, NO_BACKWARD, "no backward exists"), differentiation="none", why_not=NO_BACKWARD)
    if backward == "reference":
        return made(_reference(primal, d), differentiation="reference")

    @functools.cache
    def build() -> tuple:
        # The backward's rules and schedules are verified in tests/test_lowered_backward.py; here only relabelled.
        return (emit(b.forward, "forward with residuals"), *(emit(p.scheduled, role(p)) for p in b.pieces))

    try:  # the backward's diagrams and schedules now (cheap, and they say whether it exists); kernels when needed
        triton = config if isinstance(config, Config) else None
        fused = backward == "fused"
        b = backward_of(d, primal.hardware, triton, fused_dq=fused, **_chunks(d, name, interpret, config))
        for p in b.pieces:
            plan(p.scheduled)
        if name != "auto" and registered(name).eager:  # every kernel now: a piece it cannot lower is named early
            build()
    except NapkinError as e:
        why = f"no lowered backward: {e}"
        return made(_refuse(primal, why), differentiation="none", why_not=why)

    return made(differentiable(primal, build, b, d), differentiation="lowered", backward=build)
