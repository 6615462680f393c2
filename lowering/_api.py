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
from lowering._mosaic import (
    BACKWARD_CHUNK,
    WGMMA_M,
    MosaicConfig,
    MosaicLowered,
    admits,
    choose,
    faster,
    unavailable,
)
from lowering._plan import NotLowerable, kept_whole, plan
from lowering._search import refine
from lowering._tiles import Choice, Chunks, choose_tiles, missing_sizes
from lowering._triton import Config, Lowered, interpreted, launch, target_hardware
from napkin_cat.diagram import Diagram
from napkin_cat.errors import CostError, EvaluationError, NapkinError
from napkin_cat.hardware import Hardware, lookup
from napkin_cat.semantics import to_jax
from rewrites import bind_sizes, open_sizes, resolve

Differentiation = Literal["lowered", "reference", "none"]

#: the backends ``lower`` can emit; ``backend="auto"`` chooses between them per kernel and says why
BACKENDS = ("triton", "mosaic")


class Kernel:
    """A lowered diagram: call it like ``nc.to_jax`` of the diagram; differentiable through ``jax.custom_vjp``.

    ``backend`` names the backend that emitted it; ``differentiation`` says how gradients are computed:
    ``"lowered"`` (derived backward kernels, built when first differentiated), ``"reference"``
    (``jax.vjp`` of the reference semantics, asked for explicitly) or ``"none"`` (differentiating
    raises :class:`NotLowerable`); ``why_not`` says why there is no lowered backward, else None;
    ``backends`` maps each of its kernels (forward, then the backward's, built if need be) to the backend
    that emitted it, and ``refused`` each kernel ``backend="auto"`` kept off Mosaic to why; ``tiles`` maps
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
        """Why ``backend="auto"`` kept each kernel (by role) that is not on Mosaic off it, for those built."""
        return {what: why for what, (_, why) in self._emitted.items() if why is not None}

    @property
    def kernels(self) -> tuple[Lowered, ...]:
        """The backward kernels (forward with its residual, then the gradients'), built on first use; else ()."""
        return self._backward() if self._backward is not None else ()

    def __call__(self, *arrays):
        dom = self.diagram.dom
        if len(arrays) != len(dom):
            raise EvaluationError(f"kernel {dom} → {self.diagram.cod}: expected {len(dom)} arrays, got {len(arrays)}")
        return spmd.call(self._fn, self.diagram, arrays, self.forward.interpret)  # per shard (lowering._spmd)

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

    def __call__(self, *arrays):
        dom = self.diagram.dom
        if len(arrays) != len(dom):
            raise EvaluationError(f"kernel {dom} → {self.diagram.cod}: expected {len(dom)} arrays, got {len(arrays)}")
        sizes: dict = {}
        for w, array in zip(dom.inside, arrays, strict=True):
            shape = jax.numpy.shape(array)
            if len(shape) != len(w.axes):
                raise EvaluationError(f"kernel input {w.describe()}: expected {len(w.axes)} dimensions, got {shape}")
            for a, n in zip(w.axes, shape, strict=True):
                if sizes.setdefault(a.name, n) != n:
                    raise EvaluationError(f"kernel: axis {a.name} has size {sizes[a.name]} and {n} in the inputs")
        return self.at(**sizes)(*arrays)


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


def _guard(k: Lowered) -> Lowered:
    """Run a kernel's call-time shape guards now when the sizes they read (the axes kept whole) are known.

    Tiled, streamed and batch axes enter the guards only through their block sizes, so one block of
    each stands in for their unknown extent.
    """
    p = k.plan
    size = {a.name: a.size for w in p.diagram.dom.inside for a in w.axes}
    if all(size[a].is_number for a in p.whole):
        extent = {a: int(n) if n.is_number else 1 for a, n in size.items()}
        launch(p, extent, k.config or Config.get_default(p), k.hardware)
    return k


def _backend(backend: str) -> str:
    if backend == "auto":
        return "auto"
    if backend not in BACKENDS:
        raise NotLowerable(
            f"backend {backend!r}: choose 'auto' (Mosaic on sm_90 where it lowers and was measured faster, else "
            "Triton; kernel.refused says why), 'triton' or 'mosaic' (Hopper)"
        )
    return backend


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
    what = "Δ" if piece.feeds else ", ".join(f"d(input {i})" for i in piece.outputs)
    return f"backward kernel {what} ({', '.join(map(str, piece.rules))})"


class _Emitter:
    """Lowers each kernel of a :class:`Kernel` (forward, forward with residuals, backward pieces) with one
    backend, or with ``"auto"``'s choice per kernel, recording which backend each got and why not Mosaic."""

    def __init__(self, backend: str, interpret, config, hw: Hardware | None):
        if backend == "mosaic" and isinstance(config, Config):
            raise NotLowerable("backend 'mosaic': a lowering.Config tunes Triton; pass a lowering.MosaicConfig")
        mosaic = backend == "auto" and isinstance(config, MosaicConfig)  # tunes the kernels auto puts on Mosaic
        if backend != "mosaic" and config is not None and not isinstance(config, Config) and not mosaic:
            raise NotLowerable(f"config must be a lowering.Config, got {type(config).__name__}")
        self.backend, self.interpret, self.config, self.hw = backend, interpret, config, hw
        #: per kernel (by role): the backend that emitted it and, under "auto", why not Mosaic (else None)
        self.chosen: dict[str, tuple[str, str | None]] = {}

    def __call__(self, d: Diagram, what: str):
        if self.backend == "mosaic":
            try:
                kernel = MosaicLowered(plan(d), interpret=self.interpret, config=self.config)
                kernel.guard()
                if not kernel.interpret and (why := kernel.lowering_error()):  # here, not at the first call
                    raise NotLowerable(why)
            except NotLowerable as e:
                raise NotLowerable(f"Mosaic, {what}: {e}") from e
            self.chosen[what] = ("mosaic", None)
            return kernel
        config = self.config if isinstance(self.config, Config) else None

        def triton() -> Lowered:
            return _guard(Lowered(plan(d), interpret=self.interpret, config=config, hardware=self.hw))

        why = None
        if self.backend == "auto":
            candidate, why = choose(d, interpret=self.interpret, config=self.config)
            why = why or faster(candidate, backward=what.startswith("backward kernel"))
            if why is None:
                self.chosen[what] = ("mosaic", None)
                sizes = {a.name: a.size for w in d.dom.inside for a in w.axes}
                if all(sizes[a].is_number for a in (*candidate.plan.tiles, *(candidate.plan.stream or ())[:1])):
                    return candidate  # whole blocks, checked by choose
                return _WholeBlocks(candidate, triton, lambda shape, why: self._ragged(what, shape, why))
        self.chosen[what] = ("triton", why)
        return triton()

    def _ragged(self, what: str, shape: tuple, why: str) -> None:
        self.chosen[f"{what} at {shape}"] = ("triton", why)


class _WholeBlocks:
    """``backend="auto"``'s Mosaic kernel of a diagram whose axis sizes are known only when called: arrays that
    split into whole blocks run on Mosaic; any others (Mosaic pads nothing) on the Triton kernel of the same
    diagram, which pads them, each such shape recorded in :attr:`Kernel.backends` and :attr:`Kernel.refused`."""

    def __init__(self, mosaic, triton: Callable[[], Lowered], note: Callable[[tuple, str], None]):
        self.mosaic, self._triton, self._note = mosaic, functools.cache(triton), note

    def __getattr__(self, name):
        return getattr(self.mosaic, name)

    def __call__(self, *arrays):
        why = self.mosaic.ragged(*arrays)
        if why is None:
            return self.mosaic(*arrays)
        self._note(tuple(tuple(jax.numpy.shape(a)) for a in arrays), why)
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
    forward and backward, for Hopper (:mod:`lowering._mosaic`, tuned by a ``MosaicConfig``); a kernel it
    cannot lower is named in the error (the forward) or in ``kernel.why_not`` (a backward kernel), never
    replaced by Triton's. ``backend="auto"`` chooses per kernel: Mosaic on an sm_90 GPU where the kernel
    lowers there and its configuration was measured faster than Triton's (:func:`lowering._mosaic.faster`),
    else Triton; ``kernel.backends`` says which, ``kernel.refused`` why not Mosaic. ``config`` reaches every
    kernel of its backend, backward included. ``hardware``
    (a :class:`~napkin_cat.hardware.Hardware` or its name) sets the per-block shared-memory limit; by
    default the detected GPU's model, H100 when interpreting.

    ``backward="lowered"`` differentiates with lowered backward kernels derived from ``nc.reverse`` of
    the diagram (:mod:`lowering._backward`: FlashAttention-2's log-sum-exp residual and Δ, one kernel per
    schedule), built when first differentiated, so lowering never fails because of them; where there
    are none, ``kernel.why_not`` names the box and the reason and differentiating raises
    :class:`NotLowerable`. ``backward="reference"`` differentiates the reference semantics instead.

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
    d = getattr(scheduled, "diagram", scheduled)
    if not isinstance(d, Diagram):
        raise NotLowerable(f"lower takes a Derivation or a Diagram, got {type(scheduled).__name__}")
    _backend(backend)
    if backward not in ("lowered", "reference"):
        raise NotLowerable(f"backward {backward!r}: choose 'lowered' or 'reference'")
    try:
        hw = None if hardware is None else lookup(hardware)
    except CostError as e:
        raise NotLowerable(f"lower: {e}") from e
    opens, late = open_sizes(d), _late_sizes(d, backend, interpret, config)
    if not opens:
        for what, given in (("search=True", search), ("sizes=", sizes)):
            if given:
                raise NotLowerable(f"lower({what}): the diagram leaves no partition size open to choose")
        if not late:
            return _lower(d, backend, interpret, config, backward, hw)

        def bound(at: dict) -> Kernel:
            return _lower(bind_sizes(d, {a: at[a] for a in late}), backend, interpret, config, backward, hw)

        return OpenKernel(d, bound, keys=late)
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
    stages = config.num_stages if isinstance(config, Config) else 3  # Config.get_default's pipeline depth

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
    """The axes kept whole whose sizes ``d`` leaves symbolic, where ``backend="auto"`` may take Mosaic (an sm_90
    GPU): its choice reads them (:func:`lowering._mosaic.faster`, Mosaic's registers), so :func:`lower` binds them
    at the call; else ().

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> _late_sizes(derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False).diagram,
    ...             "auto", None, None)  # on a CPU, auto takes Triton whatever the sizes
    ()
    """
    if backend != "auto" or unavailable(interpret, config) is not None:
        return ()
    size = {a.name: a.size for w in d.dom.inside for a in w.axes}
    return tuple(a for a in kept_whole(d) if not size[a].is_number)


def _blocks(d: Diagram, backend: str, interpret, config) -> dict:
    """``backward_of``'s chunks for ``backend``: Mosaic's own (:data:`lowering._mosaic.BACKWARD_CHUNK`, halved to
    64 while :func:`lowering._mosaic.admits` refuses, and under ``"auto"`` while the Triton kernel that stands in
    for shapes Mosaic cannot take would not fit) where Mosaic lowers the backward (``"mosaic"``, or ``"auto"`` on
    an sm_90 GPU) and the sizes its registers depend on (the axes kept whole) are known, else FlashAttention-2's
    (Triton's, and Mosaic's at sizes bound only when called)."""
    size = {a.name: a.size for w in d.dom.inside for a in w.axes}
    on_mosaic = backend == "mosaic" or (backend == "auto" and unavailable(interpret, config) is None)
    if not on_mosaic or not all(size[a].is_number for a in plan(d).whole):
        return {}
    tuned = config if isinstance(config, MosaicConfig) else None
    return {"own": Chunks(BACKWARD_CHUNK, WGMMA_M, functools.partial(admits, config=tuned), backend == "auto")}


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
    if backward == "reference":
        return made(_reference(primal, d), differentiation="reference")

    @functools.cache
    def build() -> tuple:
        # The backward's rules and schedules are verified in tests/test_lowered_backward.py; here only relabelled.
        return (emit(b.forward, "forward with residuals"), *(emit(p.scheduled, role(p)) for p in b.pieces))

    try:  # the backward's diagrams and schedules now (cheap, and they say whether it exists); kernels when needed
        triton = config if isinstance(config, Config) else None
        b = backward_of(d, primal.hardware, triton, **_blocks(d, name, interpret, config))
        for p in b.pieces:
            plan(p.scheduled)
        if name == "mosaic":  # every Mosaic kernel now: a piece it cannot lower is named before any call
            build()
    except NapkinError as e:
        why = f"no lowered backward: {e}"
        return made(_refuse(primal, why), differentiation="none", why_not=why)

    return made(differentiable(primal, build, b, d), differentiation="lowered", backward=build)
