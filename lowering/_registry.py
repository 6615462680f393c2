"""The backends :func:`lowering.lower` emits with, behind one seam, in the order ``backend="auto"`` tries them.

Each backend (a :class:`Backend`) states its name, its config class, whether ``"auto"`` may use it here
(``available``: the device, ``interpret``, a config tuning another backend), whether it admits a plan
(``admit``: its own guards, the reason where not), its heuristic config and the configs worth timing
(``heuristic``, ``space``), the chunks it wants the derived backward streamed in (``chunks``), and emits a
kernel for a plan (``emit``); ``prefer`` says why ``"auto"`` would rather not take a kernel it admits (Mosaic where
not measured faster), else None. ``"auto"`` walks :data:`REGISTRY` in order, per kernel, and takes the first that
is available, admits the plan and (Mosaic) was measured faster; every backend it passed over is recorded with
its reason (``kernel.refused``). Adding a backend is a module that defines one and a line here (the XLA
backend: :mod:`lowering.xla`).

A backend that *admits* a plan may still refuse its sizes when it emits (Triton's shared-memory footprint):
that refusal names the schedule's fix (smaller tiles) and is raised, never a reason to fall back to a slower
backend.

>>> [b.name for b in REGISTRY]
['mosaic', 'triton', 'xla']
>>> backend("nope")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
lowering._plan.NotLowerable: backend 'nope': choose 'auto' (Mosaic on sm_90 where it lowers and was measured faster, \
else Triton, ...), 'mosaic', 'triton' or 'xla'
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax.numpy as jnp

from lowering._plan import NotLowerable, Plan, neutral_padding, next_pow2, plan, pow2_blocks
from lowering._tiles import Chunks
from lowering.mosaic import (
    MOSAIC_BLOCKS,
    WGMMA_M,
    MosaicConfig,
    MosaicLowered,
    admits,
    faster,
    unavailable,
    wgmma_takes,
)
from lowering.triton import TRITON_BLOCKS, Config, Lowered, launch
from lowering.xla import XLA
from napkin_cat.diagram import Diagram
from napkin_cat.hardware import Hardware
from rewrites import RewriteError


class Backend(Protocol):
    """What :func:`lowering.lower` asks of a backend (see the module). ``when`` says, in ``"auto"``'s message,
    when it is chosen; ``eager`` has :func:`lowering.lower` build every backward kernel at once (where building
    is how the backend finds what it cannot lower); ``reads_whole`` says its choice under ``"auto"`` reads the
    sizes of axes kept whole (so an open one is bound at the call); ``pads`` whether it runs arrays that do
    not split into whole blocks.

    >>> [(b.title, b.config.__name__, b.pads) for b in REGISTRY]
    [('Mosaic', 'MosaicConfig', False), ('Triton', 'TritonConfig', True), ('XLA', 'XlaConfig', True)]
    """

    name: str
    title: str
    when: str
    config: type
    eager: bool
    reads_whole: bool
    pads: bool

    def available(self, interpret: bool | None, config) -> str | None: ...
    def admit(self, p: Plan, *, interpret: bool | None, config) -> str | None: ...
    def heuristic(self, p: Plan): ...
    def space(self, p: Plan) -> tuple: ...
    def chunks(self, d: Diagram, config, *, auto: bool) -> dict: ...
    def emit(self, p: Plan, *, interpret: bool | None, config, hardware: Hardware | None): ...
    def prefer(self, kernel, *, backward: bool) -> str | None: ...


def summed_across_programs(p: Plan, title: str) -> str | None:
    """Why a Pallas backend (``title``) that writes each output once per program refuses ``p``: an output summed over
    a tiled axis (:attr:`Plan.summed`), each program's partial sums added into it; else None.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, stream, tile
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram
    >>> summed_across_programs(plan(flash), "Triton") is None
    True
    """
    if not p.summed:
        return None
    k, axes = next(iter(p.summed.items()))
    return (
        f"output {k} ({p.diagram.cod.inside[k].describe()}) is summed over the tiled axis {axes[0]!r}, each "
        f"program's partial sums added into it (backward='fused': dQ in the dK·dV kernel): {title} does not add "
        "outputs across the programs of its grid (the XLA backend does: backend='xla'; else backward='lowered')"
    )


def written_per_chunk(p: Plan, title: str, *, added: tuple = ()) -> str | None:
    """Why a Pallas backend (``title``) refuses ``p``: an output carrying the streamed axis (:attr:`Plan.written`),
    which its kernels, writing each output once per program of the grid, cannot write chunk by chunk; the outputs
    ``added`` excepted (Mosaic adds a summed output chunk by chunk by TMA reduce-add); else None.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, stream
    >>> from lowering import plan
    >>> n, v = nc.axes("n v")
    >>> x = nc.Array(n, v)
    >>> exp_and_sum = nc.copy(x) >> (nc.exp(x) @ nc.reduce_sum(x, v))  # exp(x) written per chunk of v
    >>> print(written_per_chunk(plan(derive(exp_and_sum, stream(v, 16), verify=False).diagram), "Triton"))
    output 0 (n×v~16:f32@HBM) carries the streamed axis 'v': Triton writes each output once per program of its \
grid, not chunk by chunk (the XLA backend does: backend='xla')
    """
    written = [k for k in p.written if k not in added]
    if not written:
        return None
    wire = p.diagram.cod.inside[written[0]]
    return (
        f"output {written[0]} ({wire.describe()}) carries the streamed axis {p.stream[0]!r}: {title} writes each "
        "output once per program of its grid, not chunk by chunk (the XLA backend does: backend='xla')"
    )


def offer(b: Backend, p: Plan, *, interpret, config, hardware, backward: bool) -> tuple:
    """``"auto"``'s question to a backend: its kernel for ``p`` and None, or None and why not (not available
    here, or its guards refuse the plan: ``"<Title> refused: …"``). ``config`` is passed to the backend only
    where it is its own.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> kernel, why = offer(XLA, p, interpret=None, config=None, hardware=None, backward=False)
    >>> kernel.backend, why
    ('xla', None)
    """
    own = config if isinstance(config, b.config) else None
    why = b.available(interpret, config)
    if why is None and (refused := b.admit(p, interpret=interpret, config=own)):
        why = f"{b.title} refused: {refused}"
    if why is not None:
        return None, why
    kernel = b.emit(p, interpret=interpret, config=own, hardware=hardware)
    why = b.prefer(kernel, backward=backward)
    return (kernel, None) if why is None else (None, why)


class Triton:
    """The Triton backend (:mod:`lowering.triton`): compiled on a GPU, interpreted elsewhere."""

    name, title, when, config = "triton", "Triton", "Triton", Config
    eager, reads_whole, pads = False, False, True

    def available(self, interpret, config) -> str | None:
        """Always: Triton compiles on a GPU and interprets elsewhere."""
        return None

    def admit(self, p: Plan, *, interpret, config) -> str | None:
        """Refused where an axis kept whole, its size known, is not a power of two ≥ 16 (Triton's blocks) and a box
        combining elements along it has no neutral value to pad it with; else None. (Its shared-memory footprint is
        checked when it emits: a schedule's fix, not a refusal of the plan.)

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile
        >>> from lowering import plan
        >>> n, c = nc.axes("n c", c=24)
        >>> TRITON.admit(plan(derive(nc.library.rms_norm(n, c), tile(n, 16), verify=False).diagram),
        ...              interpret=None, config=None) is None  # a sum pads with zeros
        True
        """
        # a summed output is written chunk by chunk too: its own refusal first
        if why := pow2_blocks(p) or summed_across_programs(p, self.title) or written_per_chunk(p, self.title):
            return why
        d = p.diagram
        size = {a.name: a.size for w in d.dom.inside for a in w.axes}
        for a in p.whole:
            n = size[a]
            if n.is_number and max(next_pow2(int(n)), 16) != int(n):
                try:
                    neutral_padding(d, a)
                except RewriteError as e:  # the padding rule's side condition, with the box and its values
                    return (
                        f"axis {a!r} of size {int(n)} is not a power of two ≥ 16, and a box combining elements along "
                        f"it has no neutral value (sum, max, min, softmax, contraction), so it cannot be padded ({e})"
                    )
        return None

    def heuristic(self, p: Plan) -> Config:
        """The Triton block policy's config (:meth:`lowering.triton.TritonBlocks.config`): 8 warps for 128-row tiles,
        else 4; 3 pipeline stages."""
        return TRITON_BLOCKS.config(p)

    def space(self, p: Plan) -> tuple[Config, ...]:
        """The warps and stages :func:`lowering._search.search` times (:meth:`lowering.triton.TritonBlocks.space`).

        >>> len(TRITON.space(None))
        4
        """
        return TRITON_BLOCKS.space()

    def chunks(self, d: Diagram, config, *, auto: bool) -> dict:
        """FlashAttention-2's chunks for the backward (:func:`lowering._backward.backward_of`'s own): none here."""
        return {}

    def emit(self, p: Plan, *, interpret, config, hardware) -> Lowered:
        """A :class:`lowering.Lowered`, its shape guards run now where the sizes they read are known."""
        return _guard(Lowered(p, interpret=interpret, config=config, hardware=hardware))

    def prefer(self, kernel, *, backward: bool) -> str | None:
        """None: ``"auto"`` takes every Triton kernel it admits."""
        return None


def _guard(k: Lowered) -> Lowered:
    """Run a Triton kernel's call-time shape guards now when the sizes they read (the axes kept whole) are known.

    Tiled, streamed and batch axes enter the guards only through their block sizes, so one block of
    each stands in for their unknown extent.
    """
    p = k.plan
    size = {a.name: a.size for w in p.diagram.dom.inside for a in w.axes}
    if all(size[a].is_number for a in p.whole):
        extent = {a: int(n) if n.is_number else 1 for a, n in size.items()}
        launch(p, extent, k.config or Config.get_default(p), k.hardware)
    return k


class Mosaic:
    """The Mosaic GPU backend (:mod:`lowering.mosaic`): Hopper; ``"auto"`` takes it on an sm_90 GPU where the
    kernel lowers and was measured faster than Triton's (:func:`lowering.mosaic.faster`)."""

    name, title, config = "mosaic", "Mosaic", MosaicConfig
    when = "Mosaic on sm_90 where it lowers and was measured faster"
    eager, reads_whole, pads = True, True, False

    def __init__(self):
        self._last: tuple | None = None  # (plan, interpret, config, kernel, why): admit's kernel, reused by emit

    def available(self, interpret, config) -> str | None:
        """:func:`lowering.mosaic.unavailable`: the device, ``interpret``, a config that tunes Triton."""
        return unavailable(interpret, config)

    def _built(self, p: Plan, interpret, config) -> tuple:
        last = self._last
        if last is None or last[0] is not p or last[1:3] != (interpret, config):
            kernel, why = None, None
            try:
                kernel = MosaicLowered(p, interpret=interpret, config=config)
                kernel.guard()
                why = _ragged(p)
                if why is None and not kernel.interpret:  # found here, by lowering for CUDA, not at the first call
                    why = kernel.lowering_error()
            except NotLowerable as e:
                why = str(e)
            self._last = last = (p, interpret, config, kernel, why)
        return last[3], last[4]

    def admit(self, p: Plan, *, interpret, config) -> str | None:
        """The Mosaic lowering's checks (:meth:`lowering.MosaicLowered.guard`; whole blocks, where the sizes are known:
        Mosaic pads nothing; compiled, whether Mosaic GPU lowers it for CUDA), or None.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> MOSAIC.admit(plan(derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False).diagram),
        ...              interpret=True, config=None)  # f32 inputs
        'input q/128×d:f32@HBM: wgmma takes 16-bit operands (or FP8: e4m3, e5m2), got f32'
        """
        return written_per_chunk(p, self.title, added=tuple(p.summed)) or self._built(p, interpret, config)[1]

    def heuristic(self, p: Plan) -> MosaicConfig:
        """MosaicConfig's defaults: two consumer warpgroups (or the diagram's ``split``), two stages, ping-pong
        where measured faster."""
        return MosaicConfig()

    def space(self, p: Plan) -> tuple[MosaicConfig, ...]:
        """Two or three pipeline stages, ping-pong as measured or off (:meth:`lowering.mosaic.MosaicBlocks.space`)."""
        return MOSAIC_BLOCKS.space()

    def chunks(self, d: Diagram, config, *, auto: bool) -> dict:
        """Mosaic's own backward chunks (``lowering.mosaic.MOSAIC_BLOCKS.backward_chunk``, halved to 64 while
        :func:`lowering.mosaic.admits` refuses, and under ``auto`` while the Triton kernel that stands in for
        shapes Mosaic cannot take would not fit) where the sizes its registers depend on (the axes kept whole)
        are known; else FlashAttention-2's, Triton's (none here)."""
        size = {a.name: a.size for w in d.dom.inside for a in w.axes}
        whole = plan(d).whole
        if not all(size[a].is_number for a in whole):
            return {}
        if any(
            jnp.issubdtype(w.dtype.jnp, jnp.floating) and not wgmma_takes(w.dtype) and set(w.names) & set(whole)
            for w in d.dom.inside
        ):
            return {}  # operands wgmma does not multiply (f32): every kernel runs on Triton
        tuned = config if isinstance(config, MosaicConfig) else None
        standin = MOSAIC_BLOCKS.stands_in({int(size[a]) for a in whole}, auto)
        return {"own": Chunks(MOSAIC_BLOCKS.backward_chunk, WGMMA_M, functools.partial(admits, config=tuned), standin)}

    def emit(self, p: Plan, *, interpret, config, hardware) -> MosaicLowered:
        """The :class:`lowering.MosaicLowered` :meth:`admit` built (its hardware model is its own, H100)."""
        kernel, why = self._built(p, interpret, config)
        if why is not None:
            raise NotLowerable(why)
        return kernel

    def prefer(self, kernel: MosaicLowered, *, backward: bool) -> str | None:
        """:func:`lowering.mosaic.faster`: ``"auto"`` takes Mosaic where it was measured faster than Triton."""
        return faster(kernel, backward=backward)


def _ragged(p: Plan) -> str | None:
    """Why a plan whose sizes are known leaves a ragged block along a tiled or the streamed axis, else None."""
    size = {a.name: a.size for w in p.diagram.dom.inside for a in w.axes}
    for a, n in (*p.tiles.items(), *([p.stream] if p.stream else [])):
        if size[a].is_number and int(size[a]) % n:
            return f"axis {a!r} of size {size[a]}: the Mosaic backend needs whole blocks of {n}"
    return None


TRITON, MOSAIC = Triton(), Mosaic()

#: the backends, in the order ``backend="auto"`` tries them
REGISTRY: tuple[Backend, ...] = (MOSAIC, TRITON, XLA)

#: the backends' names, as ``lower(backend=)`` takes them
BACKENDS = tuple(b.name for b in REGISTRY)


def backend(name: str) -> Backend:
    """The registered backend called ``name``; for any other name, :class:`NotLowerable` listing them.

    >>> backend("xla").title
    'XLA'
    """
    for b in REGISTRY:
        if b.name == name:
            return b
    names = [repr(b.name) for b in REGISTRY]
    raise NotLowerable(
        f"backend {name!r}: choose 'auto' ({', else '.join(b.when for b in REGISTRY)}; kernel.refused says why), "
        f"{', '.join(names[:-1])} or {names[-1]}"
    )


def check_config(name: str, config) -> None:
    """Refuse a ``config`` that tunes no backend ``name`` emits with (``"auto"``: any registered one), naming
    the class to pass.

    >>> check_config("mosaic", Config())
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: backend 'mosaic': a lowering.TritonConfig tunes Triton; pass a lowering.MosaicConfig
    """
    if config is None:
        return
    if name == "auto":
        if not any(isinstance(config, b.config) for b in REGISTRY):
            others = " or ".join(f"lowering.{b.config.__name__}" for b in REGISTRY if b is not TRITON)
            raise NotLowerable(
                f"config must be a lowering.Config, got {type(config).__name__}; 'auto' also takes a {others}, "
                "each tuning its backend's kernels"
            )
        return
    b = backend(name)
    if isinstance(config, b.config):
        return
    owner = next((o for o in REGISTRY if isinstance(config, o.config)), None)
    if owner is not None:
        raise NotLowerable(
            f"backend {name!r}: a lowering.{type(config).__name__} tunes {owner.title}; "
            f"pass a lowering.{b.config.__name__}"
        )
    raise NotLowerable(f"config must be a lowering.{b.config.__name__}, got {type(config).__name__}")


def walk_auto(p: Plan, *, interpret, config, hardware, backward: bool, after: Backend | None = None) -> tuple:
    """``"auto"``'s choice for one kernel: the first backend of :data:`REGISTRY` (after ``after``, where given) that
    gives one (:func:`offer`), its kernel, and why each before it did not (``"; "``-joined, None where
    none was passed over).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> b, kernel, why = walk_auto(p, interpret=None, config=None, hardware=None, backward=False)
    >>> b.name, why
    ('triton', "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU")
    """
    order = REGISTRY if after is None else REGISTRY[REGISTRY.index(after) + 1 :]
    passed = []
    for b in order:
        kernel, why = offer(b, p, interpret=interpret, config=config, hardware=hardware, backward=backward)
        if why is None:
            return b, kernel, "; ".join(passed) or None
        passed.append(why)
    raise NotLowerable(f"no backend admits the kernel of {p.diagram.dom} → {p.diagram.cod}: {'; '.join(passed)}")
