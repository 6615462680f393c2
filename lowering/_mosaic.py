"""The Mosaic GPU backend (Hopper): a scheduled diagram becomes one warp-specialised ``plgpu.kernel``.

FAN's Hopper algorithm, read from the plan: the tiled axis is split over ``consumers`` warpgroups (a
group partition one level below the thread block, ``g/consumers`` rows each, a multiple of wgmma's 64:
the diagram's label ``q/g÷w`` from ``rewrites.split(q, w)``, else 2);
the streamed axis becomes a ring of ``stages`` shared-memory buffers per streamed input, filled by TMA
from one producer warpgroup and released through ``consumed`` barriers; contractions become ``wgmma``
(A from shared memory or registers, B from shared memory) whose accumulators, like the accumulators'
states, live in registers across the loop. The loop body is the diagram itself: the generators'
``evaluate`` and accumulators run on register arrays through the namespace :class:`MosaicArrays`
(``ctx.xp``), exactly as in the reference semantics. log₂e is folded into the score scale so the
online softmax uses ``exp2``; a causal mask splits the loop into unmasked and diagonal chunks and the
chunks above the diagonal are never loaded.

Anything this cannot express raises :class:`NotLowerable` naming the box or axis, before compiling.

>>> import napkin_cat as nc
>>> from rewrites import derive, split, tile, stream
>>> b, h, q, x, d = nc.axes("b h q x d", d=64)
>>> attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=True)
>>> k = MosaicLowered(plan(derive(attn, tile(q, 128), stream(x, 64), verify=False).diagram))
>>> k.rows, k.config.consumers, k.plan.stream
(64, 2, ('x', 64))
>>> k = MosaicLowered(plan(derive(attn, tile(q, 256), split(q, 1), stream(x, 64), verify=False).diagram))
>>> k.rows, k.config.consumers, k.pingpong
(256, 1, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowering._plan import NotLowerable, Plan, base2, plan, unweave
from lowering._triton import (
    BlockContext,
    _combine,
    _segment_bounds,
    _visited,
    affine_mask,
    heavy_last,
    interpreted,
    segments,
    tiled_first,
)
from napkin_cat.diagram import Diagram
from napkin_cat.generators import JAX
from napkin_cat.hardware import H100
from napkin_cat.levels import REG
from napkin_cat.semantics import bind

__all__ = ["MosaicArrays", "MosaicConfig", "MosaicLowered", "choose", "faster", "plan"]

#: wgmma's row count per warpgroup
WGMMA_M = 64
#: the Hopper budgets a configuration is refused against before compiling (the hardware model's H100)
SMEM_LIMIT, REGISTERS = H100.smem_per_block, H100.capacity(REG) // 4
#: where Mosaic GPU starts each shared-memory allocation (jax._src.pallas.mosaic_gpu.core.SMEM_ALIGNMENT)
SMEM_ALIGNMENT = 1024


@dataclass(frozen=True)
class MosaicConfig:
    """The Hopper knobs the diagram does not carry (yet): ring stages, ping-pong, registers.

    ``consumers`` (the warpgroups a tile is split over) comes from the diagram's ``split`` label; given here
    it must agree with the label, and without either it is 2.

    ``interpretable`` keeps to what Mosaic's interpret mode runs: a register A operand is staged through
    shared memory, and a product is added to its accumulator after the ``wgmma`` instead of the ``wgmma``
    accumulating in place. An interpreted kernel always takes both detours (the interpreter runs nothing else,
    and they compute the same values), whatever the field says; compiled kernels take them only where it is
    set. ``pingpong`` orders the two consumer
    warpgroups' matrix products around a shared barrier so that one's softmax runs under the other's
    ``wgmma`` (FA3's schedule); None (the default) turns it on where it was measured faster
    (:meth:`MosaicLowered._pingpong`): where a chunk issues two wgmmas, FA3's forward (S, then P·V; +12% at
    D = 128), and the backward's dQ (three) at D = 64, where the shorter products leave its exponentials more
    to hide; off elsewhere (JAX's Mosaic GPU attention backward has no such barrier).
    ``members`` sets how many batch elements a section of the launch holds (a divisor of the batch; None: the
    L2 rule of ``_Kernel.members``; ``papers/flash_attention/launch_order.py`` compares them).

    >>> MosaicConfig().registers()
    (232, 40)
    """

    consumers: int | None = None
    stages: int = 2
    pingpong: bool | None = None
    interpretable: bool = False
    members: int | None = None
    consumer_registers: int = 232
    producer_registers: int = 40

    def registers(self) -> tuple[int, int]:
        """Registers per thread of a consumer and of the producer warpgroup (``setmaxnreg``)."""
        return self.consumer_registers, self.producer_registers


class Smem:
    """An operand resident in shared memory: a ref, and the barrier to wait on before its first use."""

    def __init__(self, ref, barrier=None):
        self.ref, self.barrier = ref, barrier
        self.shape, self.dtype = tuple(ref.shape), ref.dtype
        #: the register layout a load gives: wgmma's for a block; a vector of the rows (the tiled axis) in the
        #: layout of a block's row statistics, a vector of the columns (the streamed axis) in that of its columns
        self.layout = plgpu.Layout.WGMMA

    def ready(self):
        """The ref, once its TMA copy has landed (the wait is issued once per chunk)."""
        if self.barrier is not None:
            plgpu.barrier_wait(self.barrier)
            self.barrier = None
        return self.ref

    def value(self):
        """The operand loaded into registers; integers (segment ids) as f32, the precision every generator computes
        in (``xp.f32``): cast after their broadcast, they sent Mosaic GPU's layout inference (jax 0.11.2) into a search
        of minutes that found no layout, the 'hang' of docs/mosaic.md v6."""
        v = plgpu.load(self.ready(), layout=self.layout)
        return v.astype(jnp.float32) if jnp.issubdtype(self.dtype, jnp.integer) else v

    def along(self, axis: int) -> Smem:
        """A vector as the rows (``axis`` 0) or the columns (1) of the blocks it is broadcast against."""
        if len(self.shape) == 1:
            self.layout = plgpu.Layout.WGMMA.reduce(1 - axis)
        return self


class Product:
    """A pending ``wgmma`` ``A·B``: adding it to an array accumulates into that array's registers (FA3's
    ``o = δ·o + P·V`` is one wgmma on ``δ·o``); any other use materialises it."""

    def __init__(self, xp: MosaicArrays, a, b, shape: tuple):
        self.xp, self.a, self.b, self.shape, self.dtype = xp, a, b, shape, jnp.float32

    def into(self, acc):
        a, b = self.xp.operand_a(self.a, self.b.dtype), self.b.ready()
        first = self.xp.issued == 0
        self.xp.issued += 1

        def mma(acc_ref):
            if not first:  # later products of a chunk wait for the other warpgroup's turn
                self.xp.schedule()
            plgpu.wgmma(acc_ref, a, b)
            if first:  # the first product of a chunk hands the tensor cores over once issued
                self.xp.schedule()

        if acc is None or self.xp.staging is not None:
            fresh = pl.run_scoped(lambda r: (mma(r), r[...])[1], plgpu.ACC(self.shape, jnp.float32))
            return fresh if acc is None else acc + fresh
        return pl.run_state(mma)(plgpu.ACC.init(acc))

    def value(self):
        return self.into(None)

    def __add__(self, other):
        return self.into(_value(other)) if not isinstance(other, int | float) else self.value() + other

    __radd__ = __add__

    def __mul__(self, other):
        return self.value() * _value(other)

    __rmul__ = __mul__

    def __sub__(self, other):
        return self.value() - _value(other)

    def __rsub__(self, other):
        return _value(other) - self.value()

    def __truediv__(self, other):
        return self.value() / _value(other)

    def __neg__(self):
        return -self.value()


def _value(v):
    return v.value() if isinstance(v, Smem | Product) else v


class MosaicArrays:
    """``ctx.xp`` inside a Mosaic GPU consumer warpgroup: :data:`~napkin_cat.generators.JAX` on register
    arrays, with contractions as ``wgmma`` and index grids in the wgmma register layout.

    ``staging`` (when given) is a shared-memory buffer a register A operand is written to first; ``turn``
    (when given) the ping-pong barrier passed around each chunk's matrix products, ``issued`` of which
    are counted per chunk: an mbarrier in interpret mode, compiled a function that passes a named one.
    """

    def __init__(self, staging=None, turn=None):
        self.staging, self.turn, self.issued = staging, turn, 0

    def schedule(self):
        """Pass the ping-pong barrier shared by the consumer warpgroups (when there is one)."""
        if callable(self.turn):
            self.turn()
        elif self.turn is not None:
            plgpu.barrier_arrive(self.turn)
            plgpu.barrier_wait(self.turn)

    def __getattr__(self, name):
        f = getattr(JAX, name)
        if not callable(f):
            return f
        return lambda *xs, **kw: f(*(_value(v) for v in xs), **kw)

    def einsum(self, spec: str, *xs):
        """``wgmma`` for a 2-operand, 2-D contraction over one axis whose B operand is in shared memory."""
        ins, out = spec.split("->")
        terms = ins.split(",")
        if len(terms) == 1 and all(a in terms[0] for a in out) and sorted(out, key=terms[0].index) == list(out):
            # a sum of one array over the axes it drops (a sink's Σ_d dO·O folded): on registers
            v, gone = self.f32(_value(xs[0])), tuple(i for i, a in enumerate(terms[0]) if a not in out)
            return self.sum(v, gone) if gone else v
        if len(terms) == 2 and terms[0] == terms[1] and len(terms[0]) == 2 and out in (terms[0][0], terms[0][1]):
            # a row-wise inner product (Δ = Σ_d dO ⊙ O): on registers, no tensor cores
            a, b = (self.f32(_value(v)) for v in xs)
            return self.sum(a * b, 1 - terms[0].index(out))
        if len(terms) != 2 or len(out) != 2 or any(len(t) != 2 for t in terms):
            raise NotLowerable(f"einsum {spec!r}: wgmma takes two 2-D operands and gives a 2-D product")
        (k,) = set(terms[0]) & set(terms[1]) - set(out) or (None,)
        if k is None or set(terms[0]) | set(terms[1]) != {*out, k}:
            raise NotLowerable(f"einsum {spec!r}: wgmma contracts exactly one shared axis")
        a, b = (0, 1) if out[0] in terms[0] else (1, 0)
        (ta, va), (tb, vb) = (terms[a], xs[a]), (terms[b], xs[b])
        if not isinstance(vb, Smem):
            raise NotLowerable(f"einsum {spec!r}: wgmma's B operand must be in shared memory, got a register array")
        if not isinstance(va, Smem) and ta != out[0] + k:
            raise NotLowerable(f"einsum {spec!r}: a register A operand must be laid out rows × contraction")
        if isinstance(va, Smem) and ta != out[0] + k:
            va = Smem(va.ready().transpose((1, 0)))
        if tb != k + out[1]:
            vb = Smem(vb.ready().transpose((1, 0)))
        m, n = va.shape[0] if isinstance(va, Smem) else jnp.shape(va)[0], vb.shape[1]
        return Product(self, va, vb, (m, n))

    def operand_a(self, a, dtype):
        """wgmma's A operand: a shared-memory ref, or a register array in ``dtype`` (directly, or through
        ``staging``)."""
        if isinstance(a, Smem):
            return a.ready()
        a = a.astype(dtype)  # the operands meet in B's 16-bit type (FA2 casts P to V's)
        if self.staging is None:
            return a
        if tuple(a.shape) != tuple(self.staging.shape):
            raise NotLowerable(
                f"interpret mode stages a register A operand through a {self.staging.shape} buffer, got {a.shape}"
            )
        self.staging[...] = a.astype(self.staging.dtype)
        plgpu.commit_smem()
        return self.staging

    @staticmethod
    def shape(v) -> tuple:
        """The shape of a register array or of a shared-memory operand."""
        return tuple(v.shape)

    @staticmethod
    def like(v, other):
        """``v`` in the dtype of ``other`` (read off a shared-memory operand without loading it)."""
        v = _value(v)
        return v.astype(other.dtype) if other.dtype != jnp.float32 else v

    @staticmethod
    def iota(shape: tuple, axis: int):
        """Index grids in the layout of wgmma's accumulator (rows, columns), or of its row statistics."""
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=layout)

    @staticmethod
    def full(shape: tuple, value):
        """A constant in the accumulator's layout (loop-carried states must keep one layout)."""
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), layout)


def _wgmma(spec: str) -> bool:
    """A contraction :meth:`MosaicArrays.einsum` issues as one ``wgmma`` (two 2-D operands, a 2-D product)."""
    ins, out = spec.split("->")
    terms = ins.split(",")
    return len(terms) == 2 and len(out) == 2 and all(len(t) == 2 for t in terms) and terms[0] != terms[1]


class _Counting(type(JAX)):
    """:data:`~napkin_cat.generators.JAX`, counting the contractions a chunk issues as ``wgmma``: the ping-pong
    turns a consumer takes for a chunk it only observes."""

    def __init__(self):
        self.wgmma = 0

    def einsum(self, spec: str, *xs):
        self.wgmma += _wgmma(spec)
        return super().einsum(spec, *xs)


def unavailable(interpret: bool | None, config=None) -> str | None:
    """Why ``backend="auto"`` takes no Mosaic kernel here whatever the diagram (the device, ``interpret``, a
    Triton ``config``), else None.

    >>> unavailable(None)  # on a CPU
    "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU"
    """
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability != "9.0":
        return f"device {device.device_kind!r} ({device.platform}) is not an sm_90 (Hopper) GPU"
    if interpret:
        return "interpret=True: 'auto' interprets with Triton"
    if config is not None and not isinstance(config, MosaicConfig):
        return f"config is a {type(config).__name__}, which tunes Triton"
    return None


def choose(d: Diagram, *, interpret: bool | None, config=None) -> tuple[MosaicLowered | None, str | None]:
    """``backend="auto"``'s Mosaic candidate: a compiled kernel when the device is sm_90 and the diagram lowers
    there (its shared memory checked when the whole axes are known), else None and why not.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=64)
    >>> flash = derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64), verify=False)
    >>> choose(flash.diagram, interpret=None)  # on a CPU  # doctest: +ELLIPSIS
    (None, "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU")
    """
    if why := unavailable(interpret, config):
        return None, why
    try:
        kernel = MosaicLowered(plan(d), interpret=False, config=config)
        kernel.guard()
    except NotLowerable as e:
        return None, f"Mosaic refused: {e}"
    if why := kernel._ragged({a.name: a.size for w in d.dom.inside for a in w.axes}) or kernel.lowering_error():
        return None, f"Mosaic refused: {why}"
    return kernel, None


#: where Mosaic's forward was measured faster than Triton's (H100, docs/mosaic.md v2, v3 and v5): consumer blocks of
#: 128 rows (a tile of 256 split over two warpgroups) at D ∈ {64, 128}, and since the launch order keeps K and V in
#: L2 (v5) 64-row blocks streaming chunks of 128 (the entry's g128 s128: 290–591 against Triton's 278–440 TFLOP/s
#: over D ∈ {64, 128}, N ∈ {2048, 8192}, causal and not); 64-row blocks streaming 64 are not measured since
#: (before: 253 against 344 at D = 64, N = 2048), so they stay on Triton
FASTER_ROWS, FASTER_CHUNK, FASTER_WHOLE = 128, 128, (64, 128)


#: the forward blocks (tile, chunk) Mosaic was measured fastest at, per head dim, where they differ from the
#: entry's rule (:func:`lowering._attention.schedule`, FlashAttention-2's, Triton's): at D = 64 a tile of 256
#: (128 rows per consumer) streaming 128 keys ran at 326–435 TFLOP/s against Triton's 128 × 64 at 282–355
#: (1.15–1.23×; Mosaic's own 128 × 64 at 259–324), H100, bf16, N ∈ {2048, 8192}, causal and not (docs/mosaic.md v7)
ENTRY_BLOCKS = {64: (256, 128)}


def faster(kernel: MosaicLowered, backward: bool = False) -> str | None:
    """None where ``backend="auto"`` expects ``kernel`` to beat Triton's (measured, :data:`FASTER_ROWS`,
    :data:`FASTER_CHUNK`, :data:`FASTER_WHOLE`), else why not. A ``backward`` kernel (Δ, dQ, dK·dV, at the
    chunks :func:`lowering._backward.backward_of` gives Mosaic) needs only whole axes of :data:`FASTER_WHOLE`:
    each was measured faster than Triton's (H100, N = 8192, docs/mosaic.md v6: dK·dV 1.15–1.28×, dQ 1.00–1.36×;
    forward + backward all on Mosaic 1.05–1.19× Mosaic's forward with Triton's backward, every configuration).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=128)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> sched = lambda g, s: derive(attn, tile(q, g), stream(x, s), verify=False).diagram
    >>> [faster(MosaicLowered(plan(sched(g, s)))) for g, s in ((256, 64), (128, 128), (128, 64))]
    [None, None, "64-row consumer blocks (tile q/128 over 2 warpgroups) streaming chunks of 64: Mosaic not \
measured faster than Triton there; 'auto' takes Mosaic at 128-row blocks, or 64-row blocks streaming chunks of \
128, with whole axes of 64 or 128"]
    """
    whole = kernel.whole()
    if other := kernel.unmeasured():
        return f"{other}: Mosaic compiled and measured only on attention's blocks; 'auto' keeps it on Triton"
    blocks = backward or kernel.rows == FASTER_ROWS or (kernel.rows == FASTER_ROWS // 2 and kernel.s == FASTER_CHUNK)
    if blocks and all(n.is_number and int(n) in FASTER_WHOLE for n in whole.values()):
        return None
    where = f"{kernel.rows}-row consumer blocks (tile {kernel.q}/{kernel.plan.tiles[kernel.q]} over "
    where += f"{kernel.config.consumers} warpgroups)" + (f" streaming chunks of {kernel.s}" if kernel.x else "")
    if blocks:
        where = ", ".join(f"whole axis {a} = {n}" for a, n in whole.items())
    return (
        f"{where}: Mosaic not measured faster than Triton there; 'auto' takes Mosaic at {FASTER_ROWS}-row blocks, "
        f"or {FASTER_ROWS // 2}-row blocks streaming chunks of {FASTER_CHUNK}, with whole axes of "
        f"{' or '.join(map(str, FASTER_WHOLE))}"
    )


#: the chunk the Mosaic backward's kernels stream where the consumers' registers admit it (:func:`admits`),
#: where Triton's keep FlashAttention-2's 64: measured on an H100 (bf16, N = 8192, docs/mosaic.md v6,
#: ``backward_configs.py --mosaic``) dQ runs 1.05–1.11× faster than at 64, dK·dV at D = 64 within 2% of it, and
#: at D = 128 dK·dV's accumulators leave no registers for it
BACKWARD_CHUNK = 128


def admits(d: Diagram, config: MosaicConfig | None = None) -> bool:
    """Whether the scheduled ``d`` passes the Mosaic lowering's checks before compiling (it plans; shared memory
    and the consumers' registers, :meth:`MosaicLowered.check`, where the axes kept whole are known).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=128)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> [admits(derive(attn, tile(q, 256), stream(x, s), verify=False).diagram) for s in (64, 128)]
    [True, False]
    """
    try:
        MosaicLowered(plan(d), interpret=False, config=config).guard()
    except NotLowerable:
        return False
    return True


def _swizzle(minor: int, itemsize: int) -> tuple:
    row = minor * itemsize
    swizzle = next((s for s in (128, 64, 32) if row % s == 0), None)
    if swizzle is None:
        return ()
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


class MosaicLowered:
    """A Mosaic GPU kernel for a scheduled diagram: call it with arrays in the diagram's axis order.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d", d=64)
    >>> attn = nc.library.attention(q, x, d, dtype="bf16")
    >>> k = MosaicLowered(plan(derive(attn, tile(q, 128), stream(x, 64), verify=False).diagram), interpret=False)
    >>> k.q, k.x, k.s, k.rows, k.pingpong
    ('q', 'x', 64, 64, True)
    """

    #: what ``lower``'s ``kernel.backends`` reports; the hardware model the budgets come from
    backend, hardware = "mosaic", H100

    def __init__(self, p: Plan, *, interpret: bool | None = None, config: MosaicConfig | None = None):
        self.plan = p
        self.interpret = interpreted(interpret)
        # interpret mode runs only the interpretable path: every config takes it there, not only the default
        config = config or MosaicConfig()
        self.config = replace(config, interpretable=config.interpretable or self.interpret)
        self.__name__ = "napkin_mosaic_kernel"
        if not p.tiles:
            raise NotLowerable(
                "Mosaic backend: tiled axes (the first output's first one split over consumer warpgroups) and at "
                f"most one streamed axis, got tiles {p.tiles} and stream {p.stream}"
            )
        #: the streamed axis and its chunk (None, None for a kernel without a loop: the backward's Δ)
        self.x, self.s = p.stream or (None, None)
        first = unweave(p.diagram, p.batch).cod.inside[0].names[0]
        self.q = first if first in p.tiles else next(iter(p.tiles))
        g = p.tiles[self.q]
        #: the other tiled axes: grid dimensions whose blocks every warpgroup shares
        self.others = {a: n for a, n in p.tiles.items() if a != self.q}
        self.config = replace(self.config, consumers=_consumers(p.diagram, self.q, self.config.consumers))
        c = self.config.consumers
        if g % (c * WGMMA_M):
            raise NotLowerable(
                f"axis {self.q!r}: the tile g = {g} splits over {c} consumer warpgroups into rows that must be "
                f"multiples of wgmma's {WGMMA_M}"
            )
        self.rows = g // c
        if p.stream is not None and self.s % WGMMA_M:
            raise NotLowerable(f"axis {self.x!r}: the stream size s = {self.s} must be a multiple of {WGMMA_M}")
        consumer_regs, producer_regs = self.config.registers()
        if 128 * (c * consumer_regs + producer_regs) > REGISTERS:
            raise NotLowerable(
                f"warpgroup level: {c} consumers × {self.config.consumer_registers} registers plus a producer "
                f"× {self.config.producer_registers} exceed the SM's {REGISTERS} registers"
            )
        # blocks holding both loop axes laid out tiled axis first: the kept block is wgmma's A operand (Sᵀ = K·Qᵀ)
        self.d = tiled_first(base2(unweave(p.diagram, p.batch)), p)
        #: the affine masks reading the streamed axis (causal, sliding window, prefix; a mask's backward ``Kept``),
        #: by box: the chunks they hide are never loaded, those they keep whole run without them (block sparsity)
        self.masks = {id(b): m for b in self.d.boxes if (m := affine_mask(b)) is not None and self.x in m.axes}
        #: the segment masks over the split axis and the streamed one (documents): the wrapper finds from the ids
        #: which chunks each tile visits and keeps whole (``lowering._triton.segment_blocks``), as Triton's does
        self.segments = tuple(m for m in segments(self.d, p) if m.axis == self.q)
        #: the boxes a chunk kept whole by every mask runs without
        self.hidden = set(self.masks) | {id(m.box) for m in self.segments}
        for w in self.d.dom.inside:
            role = self._role(w)
            if role is None:
                raise NotLowerable(
                    f"input {w.describe()}: a block must be 2-D (the tiled or streamed axis, and one whole axis), "
                    f"a vector along the tiled or streamed axis, or one number per program (a scalar)"
                )
            if len(w.axes) == 2 and w.dtype.bits != 16:
                raise NotLowerable(f"input {w.describe()}: wgmma takes 16-bit operands, got {w.dtype}")
        for what, wires in (("input", p.diagram.dom.inside), ("output", p.diagram.cod.inside)):
            for w in wires:
                if w.names[-1] in p.batch and not set(w.names) <= set(p.batch):  # e.g. a group sum kept innermost
                    raise NotLowerable(
                        f"{what} {w.describe()}: its innermost axis {w.names[-1]!r} is a grid (batch) axis; TMA copies "
                        "blocks whose innermost axis is contiguous"
                    )
        for w in self.d.cod.inside:
            if self._role(w) != "tile" or w.names[0] != self.q:
                raise NotLowerable(
                    f"output {w.describe()}: the Mosaic backend stores [{self.q}, whole or tiled] blocks"
                )
        #: per output, the resident input whose shared-memory tile it is written into (the tile is dead by
        #: then: FA3 stores O through Q's buffer), else None
        self.reuse: list[int | None] = []
        free = [i for i, w in enumerate(self.d.dom.inside) if self._role(w) == "tile"]
        for w in self.d.cod.inside:
            k = next((k for k, i in enumerate(free) if i is not None and _same_block(self.d.dom.inside[i], w)), None)
            self.reuse.append(None if k is None else free[k])
            if k is not None:
                free[k] = None
        #: the shared-memory buffers of the other outputs, one per block shape and dtype (outputs sharing one
        #: are stored one after another: dK and dV in f32 would not fit side by side at D = 128), and each
        #: output's buffer among them (None where it reuses an input's tile)
        self.own: list = []
        self.shared: list[int | None] = []
        for w, i in zip(self.d.cod.inside, self.reuse, strict=True):
            j = next((j for j, v in enumerate(self.own) if _same_block(v, w)), None) if i is None else None
            if i is None and j is None:
                self.own.append(w)
                j = len(self.own) - 1
            self.shared.append(j)
        #: the wgmmas one chunk issues, counted on abstract blocks
        self.products = self._products() if p.stream is not None else 0
        want = self.config.pingpong
        self.pingpong = c == 2 and p.stream is not None and (self._pingpong() if want is None else want)

    def unmeasured(self) -> str | None:
        """An input unlike those Mosaic was compiled, checked and timed on (attention's Q, K, V, dO and O: blocks
        holding an axis kept whole; the backward's L and Δ: f32 vectors along the tiled or streamed axis; segment
        ids: integer vectors along them; a sink's logit: an f32 scalar per program), named, else None: bias and mask
        arrays. ``backend="auto"`` keeps such a kernel on Triton. Measured in v7 (H100, bf16, B = 2, H = 16,
        N = 8192, D = 128): segment ids (8 packed documents, ``document_skipping.py``) forward 1.35× Triton's, 1.32×
        with causal, forward + backward 1.27× and 1.24×; sinks (causal, ``variants.py``) forward 1.31×, forward +
        backward 1.13×.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> b, q, x, d = nc.axes("b q x d", d=64)
        >>> kw = dict(dtype="bf16", batch=(b,), bias_batch=(b,), bias_dtype="bf16")
        >>> biased = nc.library.dot_product_attention(q, x, d, **kw)
        >>> MosaicLowered(plan(derive(biased, tile(q, 128), stream(x, 64), verify=False).diagram)).unmeasured()
        'input 3 (b×q/128×x~64:bf16@HBM)'
        """
        for i, w in enumerate(self.plan.diagram.dom.inside):
            names = set(w.names)
            numbers = w.dtype.jnp == jnp.float32 or jnp.issubdtype(w.dtype.jnp, jnp.integer)
            vector = numbers and len(names - set(self.plan.batch)) == 1
            scalar = w.dtype.jnp == jnp.float32 and names <= set(self.plan.batch)
            if not (names & set(self.plan.whole) or (vector and names & {self.q, self.x}) or scalar):
                return f"input {i} ({w.describe()})"
        return None

    def _pingpong(self) -> bool:
        """Ping-pong by default where it was measured faster (H100, bf16, N = 8192): a chunk of two wgmmas (FA3's
        forward: +12% at D = 128), or of three whose axes kept whole are 64 (the backward's dQ at D = 64: 1.10×,
        at D = 128 0.93–1.01×, ``backward_configs.py --mosaic``, docs/mosaic.md v6). Four (dK·dV) lose 2–12%."""
        whole = self.whole().values()
        narrow = bool(whole) and all(n.is_number and int(n) == 64 for n in whole)
        return self.products == 2 or (self.products == 3 and narrow)

    def whole(self) -> dict:
        """The sizes of the axes kept whole (symbols where the diagram leaves them open), by name."""
        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        return {a: size[a] for a in self.plan.whole}

    def _products(self) -> int:
        """The contractions a chunk issues as wgmma: the diagram walked once on abstract blocks (whole axes of
        unknown size stand at 64, which no count depends on)."""
        from rewrites import walk

        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        extent = {a: int(n) if n.is_number else 64 for a, n in size.items()}
        sizes = {n: 64 for n in size.values() if not n.is_number}
        counting = _Counting()

        def probe(*vals):
            fold = lambda acc, st, ins, cc: acc.partial(ins, cc)  # noqa: E731
            grid = {a: jnp.int32(0) for a in self.plan.batch}  # the batch indices an index function may read
            walk(self.d, list(vals), BlockContext(sizes, {}, counting, grid), self.x, "chunk", {}, fold=fold)

        blocks = (jax.ShapeDtypeStruct(self.block(w, extent), w.dtype.jnp) for w in self.d.dom.inside)
        jax.eval_shape(probe, *blocks)
        return counting.wgmma

    @property
    def source(self) -> str:
        """The kernel's launch, described: grid, warpgroups, ring and the diagram the consumers walk.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64),
        ...                                verify=False).diagram))
        >>> print(k.source.splitlines()[0])  # doctest: +ELLIPSIS
        plgpu.kernel grid (sections, q/128, members) × 3 warpgroups: 2 consumers of 64 q-rows each (wgmma), 1 TMA ...
        """
        c, p = self.config, self.plan
        outs = list(zip(self.d.cod.inside, self.shared, strict=True))
        return "\n".join(
            [
                f"plgpu.kernel grid (sections, {', '.join(f'{a}/{n}' for a, n in reversed(p.tiles.items()))}, "
                f"members) × {c.consumers + 1} warpgroups: {c.consumers} consumers of {self.rows} {self.q}-rows "
                "each (wgmma), 1 TMA producer",
                f"ring: {c.stages} stages of {self.x}~{self.s} chunks per streamed input; ping-pong: {self.pingpong}"
                if self.x
                else "no loop: every input a resident tile",
                f"consumers walk: {' ; '.join(b.name for b in self.d.boxes)}",
                *(
                    f"block sparsity: the chunks {', '.join(b.name for b in self.d.boxes if id(b) in self.masks)} "
                    f"hide are never loaded, those kept whole run without the mask{'s' * (len(self.masks) > 1)}"
                    for _ in range(bool(self.masks))
                ),
                *(
                    f"output {w.describe()} stored through the shared-memory tile of {self.d.dom.inside[i].describe()}"
                    for w, i in zip(self.d.cod.inside, self.reuse, strict=True)
                    if i is not None
                ),
                *(
                    f"outputs {', '.join(w.describe() for w, k in outs if k == j)} stored in turn through one "
                    "shared-memory buffer per consumer"
                    for j in range(len(self.own))
                    if self.shared.count(j) > 1
                ),
            ]
        )

    def guard(self) -> None:
        """:meth:`check` now where the sizes it reads (the axes kept whole) are known: the tiled and streamed
        axes enter it only through their blocks."""
        size = {a.name: a.size for w in self.plan.diagram.dom.inside for a in w.axes}
        if all(size[a].is_number for a in self.plan.whole):
            self.check({a: int(n) if n.is_number else 1 for a, n in size.items()})

    def _role(self, w) -> str | None:
        """``stream`` (a ring chunk, whole tile rows when it holds the split axis), ``tile`` (per-consumer rows):
        2-D blocks, or vectors along the split or the streamed axis (the backward's ``L`` and ``Δ``); ``scalar``: one
        number per program (an attention sink's logit), read from HBM by each consumer."""
        names = w.names
        if not names:
            return "scalar"
        if len(names) == 1 and names[0] in (self.q, self.x):
            return "stream" if names[0] == self.x else "tile"
        if len(names) != 2 or len(set(names)) != 2:
            return None
        if any(n not in (self.q, self.x, *self.others, *self.plan.whole) for n in names):
            return None
        if self.x in names:
            return "stream"
        return "tile" if self.q in names else None

    def lowering_error(self) -> str | None:
        """Why Mosaic GPU does not lower this kernel for CUDA (a primitive it has no rule for, as in a user's score
        modifier, or layouts its inference cannot find), found by lowering it on example arrays of whole blocks
        (a tile of each tiled axis, two chunks of the streamed one, one of each batch axis) without compiling;
        None where it lowers, or where an axis kept whole has no size yet.

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> powed = nc.library.attention(q, x, d, dtype="bf16", score_mod=lambda s, q, x: s * jnp.abs(s) ** 0.5)
        >>> k = MosaicLowered(plan(derive(powed, tile(q, 128), stream(x, 64), verify=False).diagram), interpret=False)
        >>> k.lowering_error()  # doctest: +ELLIPSIS
        'Mosaic GPU does not lower it for CUDA: NotImplementedError: Unimplemented primitive ...: pow ...'
        """
        full = self.plan.diagram
        blocks = {**self.plan.tiles, **({self.x: 2 * self.s} if self.x else {})}
        sizes = {a.name: a.size for w in full.dom.inside for a in w.axes}
        if any(not sizes[a].is_number for a in self.plan.whole):
            return None
        example = {
            sym: blocks.get(sym.name, 1) for n in sizes.values() for sym in n.free_symbols
        }  # a tiled or streamed axis's own symbol gives its blocks; any other (a batch axis) 1
        structs = [
            jax.ShapeDtypeStruct(tuple(int(a.size.subs(example)) for a in w.axes), w.dtype.jnp) for w in full.dom.inside
        ]
        try:
            jax.jit(self).trace(*structs).lower(lowering_platforms=("cuda",))
        except Exception as e:  # noqa: BLE001 - any failure of Mosaic GPU's lowering is the reason reported
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"Mosaic GPU does not lower it for CUDA: {type(e).__name__}: {first[:300]}"
        return None

    # -- the wrapper: bind sizes, check them, launch --------------------------------------------
    def ragged(self, *arrays) -> str | None:
        """Why these arrays do not split into whole blocks (Mosaic pads nothing), else None.

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64),
        ...                                verify=False).diagram))
        >>> k.ragged(*(jnp.zeros((200, 64), jnp.bfloat16),) * 3)
        "axis 'q' of size 200: the Mosaic backend needs whole blocks of 128"
        """
        full = self.plan.diagram
        sizes = bind(full.dom, [jnp.asarray(a) for a in arrays])
        return self._ragged({a.name: a.size.subs(sizes) for w in full.dom.inside for a in w.axes})

    def _ragged(self, size: dict) -> str | None:
        blocks = ((self.q, self.plan.tiles[self.q]), *([(self.x, self.s)] if self.x else []), *self.others.items())
        return next(
            (
                f"axis {a!r} of size {size[a]}: the Mosaic backend needs whole blocks of {n}"
                for a, n in blocks
                if size[a].is_number and int(size[a]) % n
            ),
            None,
        )

    def __call__(self, *arrays):
        full = self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        sizes = bind(full.dom, arrays)
        extent = {a.name: int(a.size.subs(sizes)) for w in full.dom.inside for a in w.axes}
        if why := self.ragged(*arrays):
            raise NotLowerable(why)
        self.check(extent)
        outs = self._call(arrays, sizes, extent)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def check(self, extent: dict) -> None:
        """Refuse, before compiling, a kernel whose shared memory exceeds the block limit.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=256)
        >>> attn = derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 256), stream(x, 128), verify=False)
        >>> MosaicLowered(plan(attn.diagram)).check({"d": 256})  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        lowering._plan.NotLowerable: thread-block level: the kernel would hold 459,776 B of shared memory ...
        """
        smem = self.smem_bytes(extent)
        if smem > SMEM_LIMIT:
            raise NotLowerable(
                f"thread-block level: the kernel would hold {smem:,} B of shared memory ({self.config.stages} stages "
                f"of each streamed chunk, resident tiles, output tiles), over the {SMEM_LIMIT:,} B a block may use"
            )
        live, budget = self.registers(extent), self.config.consumer_registers
        if live > budget:
            raise NotLowerable(
                f"warpgroup level: a consumer thread would keep {live} f32 registers live (its accumulators and "
                f"the largest chunk of {self.rows} {self.q}-rows × {self.s} {self.x}), over its {budget}"
            )

    def registers(self, extent: dict) -> int:
        """f32 registers per consumer thread that the loop keeps live: one accumulator per output block and the
        largest chunk-sized value (the scores), spread over a warpgroup's 128 threads. Over the budget the
        compiler spills (measured on H100: g256 s128 at D = 128, 256 registers, ran at 328 TFLOP/s against 542
        for g256 s64, 192 registers).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=128)
        >>> attn = nc.library.attention(q, x, d, dtype="bf16")
        >>> [MosaicLowered(plan(derive(attn, tile(q, 256), stream(x, s), verify=False).diagram)).registers({"d": 128})
        ...  for s in (64, 128)]
        [192, 256]
        """
        accumulators = sum(math.prod(self.block(w, extent)) for w in self.d.cod.inside)
        chunks = [w for b in self.d.boxes for w in b.cod.inside if self.x in w.names and self._role(w)]
        return (accumulators + max((math.prod(self.block(w, extent)) for w in chunks), default=0)) // 128

    def block(self, w, extent, *, ring: bool = False) -> tuple:
        """A wire's block as a consumer sees it: ``rows`` of the split axis (the whole tile ``g`` in a ``ring``
        buffer, which the producer fills for all consumers), ``s`` of the streamed one, other tiles, whole axes."""
        g = self.plan.tiles[self.q]
        size = {self.q: g if ring else self.rows, self.x: self.s, **self.others}
        return tuple(size.get(n, extent.get(n)) for n in w.names)

    def smem_bytes(self, extent: dict) -> int:
        """Shared memory held: per streamed input ``stages`` chunks, per resident input and output one
        tile per consumer (an output written into a resident input's tile takes none), the staging
        buffer of a register operand in interpret mode, and the barriers; each allocation starts on a 1,024 B
        boundary, as Mosaic GPU places them (``SMEM_ALIGNMENT``; a vector of 64 f32 rows per consumer takes 1,024 B,
        not 512: attention sinks' dQ at D = 128 needed 234,656 B where the unaligned count said 230,912).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> m, k, n = nc.axes("m k n")
        >>> mm = nc.library.matmul(m, k, n, dtype="bf16")
        >>> mm = derive(mm, tile(m, 256), tile(n, 128), stream(k, 64), verify=False)
        >>> compiled = MosaicLowered(plan(mm.diagram), interpret=False, config=MosaicConfig(stages=3))
        >>> compiled.smem_bytes({})  # 3·384·64·2 + 2·128²·2 + 1K
        214016
        """
        c, total, barriers = self.config, 0, int(self.pingpong and self.interpret)  # compiled: a named barrier
        for w in self.d.dom.inside:
            role = self._role(w)
            if role == "scalar":  # read from HBM into registers
                continue
            n = math.prod(self.block(w, extent, ring=role == "stream")) * w.dtype.bytes
            total += _aligned(n * (c.stages if role == "stream" else c.consumers))
            barriers += 2 * c.stages if role == "stream" else c.consumers  # loaded and consumed; arrived
        for w in self.own:
            total += _aligned(math.prod(self.block(w, extent)) * w.dtype.bytes * c.consumers)
        if c.interpretable and self.x:
            total += _aligned(self.rows * self.s * 2 * c.consumers)
        return total + _aligned(8 * barriers)

    def _call(self, arrays, sizes, extent):
        p, full, c = self.plan, self.plan.diagram, self.config
        wires = self.d.dom.inside
        streamed = [i for i, w in enumerate(wires) if self._role(w) == "stream"]
        resident = [i for i, w in enumerate(wires) if self._role(w) == "tile"]
        g = p.tiles[self.q]
        n_tiles, n_chunks = extent[self.q] // g, (extent[self.x] // self.s if self.x else 0)
        batch = [extent[a] for a in p.batch]

        def smem(shape, dtype):  # stages or consumers of a block, swizzled for wgmma; of a vector, as is
            swizzle = _swizzle(shape[-1], jnp.dtype(dtype).itemsize) if len(shape) == 3 else ()
            return plgpu.SMEM(shape, dtype, transforms=swizzle)

        scratch = [
            [smem((c.stages, *self.block(wires[i], extent, ring=True)), wires[i].dtype.jnp) for i in streamed],
            [smem((c.consumers, *self.block(wires[i], extent)), wires[i].dtype.jnp) for i in resident],
            [smem((c.consumers, *self.block(w, extent)), w.dtype.jnp) for w in self.own],
            [plgpu.Barrier(num_barriers=c.stages) for _ in streamed],
            [plgpu.Barrier(num_arrivals=c.consumers, num_barriers=c.stages) for _ in streamed],
            [plgpu.Barrier(num_barriers=c.consumers) for _ in resident],
        ]
        scratch.append([plgpu.Barrier(num_arrivals=c.consumers)] if self.pingpong and self.interpret else [])
        if c.interpretable and streamed:
            value_dtype = next(wires[i].dtype.jnp for i in streamed if len(wires[i].axes) == 2)
            scratch.append([smem((c.consumers, self.rows, self.s), value_dtype)])
        kernel = _Kernel(self, sizes, extent, streamed, resident, n_tiles, n_chunks, batch)
        others = [extent[a] // n for a, n in self.others.items()]
        out_type = [jax.ShapeDtypeStruct(tuple(extent[a.name] for a in w.axes), w.dtype.jnp) for w in full.cod.inside]
        call = plgpu.kernel(
            kernel,
            out_type=out_type,
            scratch_types=scratch,
            # the last grid axis is the fastest (CUDA's x): sections of the batch, then tiles, then the section's
            # members (_Kernel.members)
            grid=(math.prod(batch) // kernel.n_members, *reversed(others), n_tiles, kernel.n_members),
            grid_names=("section", *(f"tile_{a}" for a in reversed(self.others)), "tile", "member"),
            num_threads=c.consumers + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            kernel_name="napkin_mosaic",
            interpret=plgpu.InterpretGPUParams() if self.interpret else None,
        )
        return call(*arrays, *(_segment_bounds(p, m, arrays, extent) for m in self.segments))


class _Scratch(NamedTuple):
    """A kernel's shared memory and barriers (``MosaicLowered._call``'s ``scratch_types``, in order): the rings of the
    streamed inputs, the resident tiles, the outputs' own buffers, each ring's ``loaded`` and ``consumed`` barriers,
    each tile's ``arrived``, the interpret-mode ping-pong ``turn`` (compiled kernels pass a named barrier, which takes
    no shared memory) and the interpret-mode ``staging`` buffer (None without them)."""

    rings: Any
    tiles: Any
    outs: Any
    loaded: Any
    consumed: Any
    arrived: Any
    turn: Any
    staging: Any


class _Kernel:
    """The kernel body: a producer warpgroup filling the rings, consumer warpgroups walking the diagram."""

    def __init__(self, low: MosaicLowered, sizes, extent, streamed, resident, n_tiles, n_chunks, batch):
        self.low, self.sizes, self.extent = low, sizes, extent
        self.streamed, self.resident, self.n_tiles, self.n_chunks = streamed, resident, n_tiles, n_chunks
        self.batch = batch
        #: whether the tiles launch last-first: the last tile is the heaviest (causal queries)
        self.flip = low.q in heavy_last(low.plan, extent, extent)
        given = low.config.members
        if given is not None and math.prod(batch) % given:
            raise NotLowerable(
                f"MosaicConfig(members={given}): a launch section's batch elements must divide the batch "
                f"({math.prod(batch)} = {' × '.join(map(str, batch))})"
            )
        self.n_members = self.members() if given is None else given

    def _batch(self, bid) -> dict:
        """Each batch axis's index in the flattened grid position ``bid``."""
        out, acc = {}, 1
        for a, n in zip(reversed(self.low.plan.batch), reversed(self.batch), strict=True):
            out[a] = lax.rem(lax.div(bid, _i32(acc)), _i32(n))
            acc *= n
        return out

    def visited(self, bid, tile, lo, n, bounds=()) -> tuple:
        """The chunks rows ``[lo, lo + n)`` of the split axis visit, ``first ≤ full_lo ≤ full_hi ≤ last``: the masks
        hide every chunk outside ``[first, last)`` and keep ``[full_lo, full_hi)`` whole (``lowering._triton``'s
        rule, on the same :class:`~napkin_cat.library.Affine` intervals), intersected with the ranges the wrapper
        found for this ``tile`` from the segment ids (``bounds``: one HBM ref per segment mask; a tile's ranges
        hold for any of its rows, so producer and consumers agree on them)."""
        low = self.low
        ranges = {low.q: (lo, lo + n)} | {a: (0, self.extent[a]) for a in low.plan.whole}
        ranges |= {
            a: (lax.axis_index(f"tile_{a}") * g, lax.axis_index(f"tile_{a}") * g + g) for a, g in low.others.items()
        }
        ranges |= {a: (i, i + 1) for a, i in self._batch(bid).items()}
        visit = _visited(low.masks.values(), low.x, low.s, self.n_chunks, ranges, self.extent[low.x])
        batch = self._batch(bid)
        for ref in bounds:  # [batch axes the ids have (else 1), tiles, 4]
            at = [batch[a] if n > 1 else _i32(0) for a, n in zip(low.plan.batch, ref.shape, strict=False)]
            visit = _combine(visit, tuple(ref[(*at, tile, _i32(k))] for k in range(4)))
        return tuple(v.astype(jnp.int32) for v in visit)

    def _index(self, wire, bid, **blocks):
        """The view of an HBM ref for one block: batch axes fixed, the tiled/streamed axis sliced."""
        idx, batch = [], self._batch(bid)
        for a in wire.axes:
            if a.name in batch:
                idx.append(batch[a.name])
            elif a.name in blocks:
                idx.append(blocks[a.name])
            elif a.name in self.low.others:
                n = self.low.others[a.name]
                idx.append(pl.ds(lax.axis_index(f"tile_{a.name}") * n, n))
            else:
                idx.append(slice(None))
        return tuple(idx)

    def members(self) -> int:
        """The batch elements a section of the launch holds (the grid's fastest axis, after the tile): 1, so that
        the CTAs launched together share a batch element and stream the same K and V chunks from L2; where the
        last tile is the heaviest (causal queries) and the tiles launch last-first, the largest divisor of the
        batch whose streamed inputs fit together in the hardware model's L2 share. A section then launches every
        element's tile t before any element's tile t − 1: longest first across the section, which keeps the
        last wave short (FlashAttention-3's LPT scheduler, with its L2 sections), its K and V still in L2.

        On an H100 (a 25 MiB share), causal attention in bf16 at N = 8192, D = 128 streams 4 MiB of K and V per
        head, so 6 heads fit and B·H = 32 launch in 8 sections of 4; at N = 2048 1 MiB, and 128 in 8 of 16.
        """
        low, wires = self.low, self.low.plan.diagram.dom.inside
        if not self.flip:
            return 1
        each = sum(
            math.prod(self.extent[a.name] for a in wires[i].axes if a.name not in low.plan.batch)
            * wires[i].dtype.jnp.dtype.itemsize
            for i in self.streamed
        )
        return _divisor_at_most(math.prod(self.batch), low.hardware.l2_shared_capacity // max(each, 1))

    def __call__(self, *refs):
        low, c = self.low, self.low.config
        full = low.plan.diagram
        n_in, n_out = len(full.dom) + len(low.segments), len(full.cod)
        in_refs, out_refs, scratch = refs[:n_in], refs[n_in : n_in + n_out], refs[n_in + n_out :]
        in_refs, bounds = in_refs[: len(full.dom)], in_refs[len(full.dom) :]
        turn, staging = (scratch[6] or [None])[0], (scratch[7] if len(scratch) > 7 else [None])[0]
        scratch = _Scratch(*scratch[:6], turn, staging)
        wg, tile = lax.axis_index("wg"), lax.axis_index("tile")
        bid = lax.axis_index("section") * self.n_members + lax.axis_index("member")
        if self.flip:  # the heaviest tiles launch first
            tile = self.n_tiles - 1 - tile
        g = low.plan.tiles[low.q]
        # the chunks [first, chunks) this block streams: those some row of its tile sees
        first, chunks = _i32(0), _i32(self.n_chunks)
        if low.hidden:
            first, _, _, chunks = self.visited(bid, tile, tile * g, g, bounds)
        if not self.streamed:  # no loop (the backward's Δ): the producer has nothing to fill
            chunks = _i32(0)
        consumer_regs, producer_regs = c.registers()

        @pl.when(wg < c.consumers)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")
            self.consume(in_refs, out_refs, scratch, wg, bid, tile, (first, chunks), bounds)

        @pl.when(wg == c.consumers)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            if self.streamed:
                self.produce(in_refs, scratch.rings, scratch.loaded, scratch.consumed, bid, tile, first, chunks)

    def produce(self, in_refs, rings, loaded, consumed, bid, tile, first, chunks):
        low, hbm, stages, s = self.low, self.low.plan.diagram.dom.inside, self.low.config.stages, self.low.s
        g = low.plan.tiles[low.q]

        def load(chunk, slot):
            for k, i in enumerate(self.streamed):
                blocks = {low.x: pl.ds(chunk * s, s), low.q: pl.ds(tile * g, g)}
                view = in_refs[i].at[self._index(hbm[i], bid, **blocks)]
                plgpu.copy_gmem_to_smem(view, rings[k].at[slot], loaded[k].at[slot])

        for j in range(min(stages, self.n_chunks)):  # a slice past the axis would not even trace

            @pl.when(first + j < chunks)
            def _(j=j):
                load(first + j, lax.rem(first + j, _i32(stages)))

        @pl.loop(first + stages, jnp.maximum(chunks, first + stages))
        def _(chunk):
            slot = lax.rem(chunk, _i32(stages))
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[slot])
            load(chunk, slot)

        @pl.loop(jnp.maximum(chunks - stages, first), chunks)
        def _(chunk):  # the last releases: every phase of a barrier is observed before it is freed
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[lax.rem(chunk, _i32(stages))])

    def consume(self, in_refs, out_refs, scratch: _Scratch, wg, bid, tile, block, bounds):
        from rewrites import walk

        rings, tiles, outs, loaded, consumed, arrived, turn, staging = scratch

        low, d, stages = self.low, self.low.d, self.low.config.stages
        wires, x, s, rows = d.dom.inside, low.x or "", low.s, low.rows
        start = tile * low.plan.tiles[low.q] + wg * rows
        for k, i in enumerate(self.resident):
            view = in_refs[i].at[self._index(low.plan.diagram.dom.inside[i], bid, **{low.q: pl.ds(start, rows)})]
            plgpu.copy_gmem_to_smem(view, tiles[k].at[wg], arrived[k].at[wg])
        xp = MosaicArrays(staging.at[wg] if staging is not None else None)
        if low.pingpong and not low.interpret:
            turn = _named_turn(low.config.consumers)
        pingpong = MosaicArrays(xp.staging, turn)
        grid = self._batch(bid)  # this program's index along each batch axis (ALiBi reads the head)
        ctx = BlockContext(sizes=self.sizes, offsets={low.q: start}, xp=xp, grid=grid)
        resident = {i: Smem(tiles[k].at[wg], arrived[k].at[wg]).along(0) for k, i in enumerate(self.resident)}
        full = low.plan.diagram.dom.inside
        scalars = {i: in_refs[i][self._index(full[i], bid)] for i, w in enumerate(wires) if low._role(w) == "scalar"}
        for v in resident.values():
            v.ready()  # waited once, before the loop
        box_at = [None]

        def skipping(unmasked):
            def skip(box):
                box_at[0] = box
                return unmasked and id(box) in low.hidden

            return skip

        def rows_of(i, ref):  # a consumer's rows of a ring buffer that holds the whole tile
            names = wires[i].names
            if low.q not in names:
                return ref
            return ref.at[tuple(pl.ds(wg * rows, rows) if n == low.q else slice(None) for n in names)]

        def values(chunk):
            slot = lax.rem(chunk, _i32(stages))
            ring = {
                i: Smem(rows_of(i, rings[k].at[slot]), loaded[k].at[slot]).along(1) for k, i in enumerate(self.streamed)
            }
            return [ring.get(i, resident.get(i, scalars.get(i))) for i in range(len(wires))], ring, slot

        def traced(f, *args, **kw):
            try:
                return f(*args, **kw)
            except (NotLowerable, NotImplementedError, ValueError, TypeError) as e:
                box = box_at[0]
                raise NotLowerable(f"box {getattr(box, 'name', box)!r}: {e}") from e

        counting = _Counting()

        def probe(*vals):
            shapes: dict = {}
            walk(
                d,
                list(vals),
                BlockContext(self.sizes, {}, counting, {a: jnp.int32(0) for a in grid}),
                x,
                "chunk",
                shapes,
                fold=lambda acc, st, ins, cc: acc.partial(ins, cc),
            )
            return shapes

        blocks = (jax.ShapeDtypeStruct(low.block(w, self.extent), w.dtype.jnp) for w in wires)
        like = jax.eval_shape(probe, *blocks) if self.streamed else {}
        keys = sorted(like)
        init = tuple(d.inside[i][1].accumulator(x).identity(like[i], ctx) for i in keys)

        def body(unmasked):
            def run(chunk, carry):
                states = dict(zip(keys, carry, strict=True))
                vals, ring, slot = values(chunk)
                pingpong.issued = 0
                traced(
                    walk,
                    d,
                    vals,
                    BlockContext(self.sizes, {low.q: start, x: chunk * s}, pingpong, grid),
                    x,
                    "chunk",
                    states,
                    fold=lambda acc, st, ins, cc: acc.step(st, ins, cc),
                    skip=skipping(unmasked),
                )
                if pingpong.issued != counting.wgmma:  # the turns an observed chunk takes would not match
                    raise NotLowerable(
                        f"a chunk issued {pingpong.issued} wgmma, the shape probe counted {counting.wgmma}"
                    )
                for k, i in enumerate(self.streamed):
                    ring[i].ready()  # an input no box read still completes its phase
                    plgpu.barrier_arrive(consumed[k].at[slot])
                return tuple(_value(states[i]) for i in keys)

            return run

        if turn is not None:  # the second warpgroup starts one turn behind

            @pl.when(wg == 1)
            def _():
                pingpong.schedule()

        def observe(lo, hi):
            @pl.loop(lo, hi)
            def _(chunk):  # chunks only the other consumers read: observe their arrival, release them
                slot = lax.rem(chunk, _i32(stages))
                for k in range(len(self.streamed)):
                    plgpu.barrier_wait(loaded[k].at[slot])
                    plgpu.barrier_arrive(consumed[k].at[slot])
                for _ in range(counting.wgmma):  # the turns the other warpgroup takes meanwhile
                    pingpong.schedule()

        first, chunks = block
        if low.hidden:  # this consumer's rows: chunks hidden from them observed, whole ones unmasked, cut ones masked
            lo, full_lo, full_hi, hi = self.visited(bid, tile, start, rows, bounds)
            observe(first, lo)
            carry = lax.fori_loop(lo, full_lo, body(False), init)
            carry = lax.fori_loop(full_lo, full_hi, body(True), carry)
            carry = lax.fori_loop(full_hi, hi, body(False), carry)
            observe(hi, chunks)
        elif self.streamed:
            carry = lax.fori_loop(0, chunks, body(False), init)
        else:
            carry = init
        if turn is not None:  # and the first one ends one turn later

            @pl.when(wg == 0)
            def _():
                pingpong.schedule()

        states = dict(zip(keys, carry, strict=True))
        final = [None if w.has(x) else resident.get(i, scalars.get(i)) for i, w in enumerate(wires)]
        results = traced(walk, d, final, ctx, x, "final", states, skip=skipping(False))
        # every result in registers before any store: an output may overwrite a resident input's tile
        results = [_value(v) for v in results]
        stored = set()
        for i, j, v, w, out in zip(low.reuse, low.shared, results, low.plan.diagram.cod.inside, out_refs, strict=True):
            buf = outs[j] if i is None else tiles[self.resident.index(i)]
            if j is not None and j in stored:  # the buffer's previous output has left for HBM before it is overwritten
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            stored.add(j)
            buf.at[wg][...] = v.astype(buf.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(buf.at[wg], out.at[self._index(w, bid, **{low.q: pl.ds(start, rows)})])
        plgpu.wait_smem_to_gmem(0)


#: the hardware named barrier the consumer warpgroups pass their ping-pong turns through (Mosaic GPU uses the
#: lower ones; tokamax's kernels start at 4)
TURN_BARRIER = 8


def _named_turn(consumers: int):
    """A ping-pong turn of the compiled kernel: ``bar.sync`` on a named barrier of every consumer thread, as tokamax's
    Mosaic GPU attention passes its turns. Against an mbarrier in shared memory (arrive, then poll its phase) the
    causal forward at D = 128, N = 8192 ran 582 → 662 TFLOP/s at g128 s128 and 468 → 514 at g256 s64 (H200, bf16,
    docs/mosaic.md v8). Inline PTX does not interpret: interpret mode keeps the mbarrier."""
    from jax.experimental.mosaic import gpu as mgpu

    @plgpu.inline_mgpu()
    def turn(_):
        mgpu.utils.inline_ptx(f"bar.sync {TURN_BARRIER}, {128 * consumers};")

    return turn


def _consumers(d: Diagram, q: str, given: int | None) -> int:
    """The consumer warpgroups: the diagram's split of ``q`` (``rewrites.split``), else ``given``, else 2
    (FA3's); a ``given`` number other than the diagram's is refused."""
    parts = {a.split for w in (*d.dom.inside, *d.cod.inside) for a in w.axes if a.name == q and a.split is not None}
    label = int(next(iter(parts))) if parts else None
    if given is not None and label is not None and given != label:
        raise NotLowerable(
            f"axis {q!r}: the diagram splits each tile over {label} warpgroups (split({q}, {label})) but "
            f"MosaicConfig(consumers={given}) asks for {given}; drop one of them"
        )
    return label or given or 2


def _divisor_at_most(n: int, bound: int) -> int:
    """The largest divisor of ``n`` that is at most ``bound`` (1 at least).

    >>> _divisor_at_most(32, 25 // 4), _divisor_at_most(128, 25 // 1), _divisor_at_most(7, 0)
    (4, 16, 1)
    """
    return max(m for m in range(1, max(1, min(n, bound)) + 1) if n % m == 0)


def _aligned(n: int) -> int:
    """``n`` bytes rounded up to Mosaic GPU's shared-memory alignment (each allocation starts on it)."""
    return -(-n // SMEM_ALIGNMENT) * SMEM_ALIGNMENT


def _i32(n):
    return jnp.asarray(n, jnp.int32)


def _same_block(a, b) -> bool:
    """Two wires whose blocks have one shape and dtype (same axes in the same order)."""
    return a.names == b.names and a.dtype == b.dtype
