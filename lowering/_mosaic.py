"""The Mosaic GPU backend (Hopper): a scheduled diagram becomes one warp-specialised ``plgpu.kernel``.

FAN's Hopper algorithm, read from the plan: the tiled axis is split over ``consumers`` warpgroups (a
group partition one level below the thread block, ``g/consumers`` rows each, a multiple of wgmma's 64);
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
>>> from rewrites import derive, tile, stream
>>> b, h, q, x, d = nc.axes("b h q x d", d=64)
>>> attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=True)
>>> k = MosaicLowered(plan(derive(attn, tile(q, 128), stream(x, 64), verify=False).diagram))
>>> k.rows, k.config.consumers, k.plan.stream
(64, 2, ('x', 64))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowering._plan import NotLowerable, Plan, plan
from napkin_cat.diagram import Diagram
from napkin_cat.generators import JAX, Context, Generator
from napkin_cat.hardware import H100
from napkin_cat.levels import REG
from napkin_cat.semantics import bind

__all__ = ["MosaicArrays", "MosaicConfig", "MosaicLowered", "base2", "choose", "plan"]

LOG2E = math.log2(math.e)
#: wgmma's row count per warpgroup
WGMMA_M = 64
#: the Hopper budgets a configuration is refused against before compiling (the hardware model's H100)
SMEM_LIMIT, REGISTERS = H100.smem_per_block, H100.capacity(REG) // 4


@dataclass(frozen=True)
class MosaicConfig:
    """The Hopper knobs the diagram does not carry (yet): consumer warpgroups, ring stages, registers.

    ``interpretable`` keeps to what Mosaic's interpret mode runs: a register A operand is staged through
    shared memory, and a product is added to its accumulator after the ``wgmma`` instead of the ``wgmma``
    accumulating in place. Compiled kernels use neither detour. ``pingpong`` orders the two consumer
    warpgroups' matrix products around a shared barrier so that one's softmax runs under the other's
    ``wgmma`` (FA3's schedule).

    >>> MosaicConfig().registers()
    (232, 40)
    """

    consumers: int = 2
    stages: int = 2
    pingpong: bool = True
    interpretable: bool = False
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

    def ready(self):
        """The ref, once its TMA copy has landed (the wait is issued once per chunk)."""
        if self.barrier is not None:
            plgpu.barrier_wait(self.barrier)
            self.barrier = None
        return self.ref

    def value(self):
        """The operand loaded into registers."""
        return self.ready()[...]


class Product:
    """A pending ``wgmma`` ``A·B``: adding it to an array accumulates into that array's registers (FA3's
    ``o = δ·o + P·V`` is one wgmma on ``δ·o``); any other use materialises it."""

    def __init__(self, xp: MosaicArrays, a, b, shape: tuple):
        self.xp, self.a, self.b, self.shape, self.dtype = xp, a, b, shape, jnp.float32

    def into(self, acc):
        a, b = self.xp.operand_a(self.a), self.b.ready()
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
    are counted per chunk.
    """

    def __init__(self, staging=None, turn=None):
        self.staging, self.turn, self.issued = staging, turn, 0

    def schedule(self):
        """Pass the ping-pong barrier shared by the consumer warpgroups (when there is one)."""
        if self.turn is not None:
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

    def operand_a(self, a):
        """wgmma's A operand: a shared-memory ref, or a register array (directly, or through ``staging``)."""
        if isinstance(a, Smem):
            return a.ready()
        if self.staging is None:
            return a
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
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability != "9.0":
        return None, f"device {device.device_kind!r} ({device.platform}) is not an sm_90 (Hopper) GPU"
    if interpret:
        return None, "interpret=True: 'auto' interprets with Triton"
    if config is not None and not isinstance(config, MosaicConfig):
        return None, f"config is a {type(config).__name__}, which tunes Triton"
    try:
        kernel = MosaicLowered(plan(d), interpret=False, config=config)
        size = {a.name: a.size for w in d.dom.inside for a in w.axes}
        if all(size[a].is_number for a in kernel.plan.whole):
            kernel.check({a: int(n) if n.is_number else 1 for a, n in size.items()})
    except NotLowerable as e:
        return None, f"Mosaic refused: {e}"
    return kernel, None


def base2(d: Diagram) -> Diagram:
    """Fold log₂e into the scale of the contraction feeding each box that has a base-2 form.

    rewrite: S = A·B·c ; [boxes passing the base] ; f  →  S = A·B·(c·log₂e) ; [same] ; f₂, sound because
    the base-2 form reads ``s·log₂e`` and the boxes between commute with scaling (masks send −∞ to −∞).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, stream
    >>> q, x, d = nc.axes("q x d")
    >>> flash = derive(nc.library.attention(q, x, d), stream(x, 16), verify=False).diagram
    >>> [b.params.get("base") for b in base2(flash).boxes if b.normalises]
    [2]
    """
    layers = list(d.inside)
    for j, (left, box, right) in enumerate(d.inside):
        if not isinstance(box, Generator) or box.in_base2() is None:
            continue
        i, _ = d.producer(j, len(left))
        while i is not None and isinstance(d.inside[i][1], Generator) and d.inside[i][1].passes_base():
            i, _ = d.producer(i, len(d.inside[i][0]))
        scaled = None if i is None or not isinstance(d.inside[i][1], Generator) else d.inside[i][1].scaled(LOG2E)
        if scaled is None:
            continue
        layers[i] = (layers[i][0], scaled, layers[i][2])
        layers[j] = (left, box.in_base2(), right)
    return d.with_layers(layers)


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

    def __init__(self, p: Plan, *, interpret: bool | None = None, config: MosaicConfig | None = None):
        self.plan = p
        self.interpret = (jax.default_backend() != "gpu") if interpret is None else interpret
        self.config = config or MosaicConfig(interpretable=self.interpret)
        self.__name__ = "napkin_mosaic_kernel"
        if not p.tiles or p.stream is None:
            raise NotLowerable(
                f"Mosaic backend: tiled axes (the first output's first one split over consumer warpgroups) and one "
                f"streamed axis, got tiles {p.tiles} and stream {p.stream}"
            )
        self.x, self.s = p.stream
        first = _unweave(p.diagram, p.batch).cod.inside[0].names[0]
        self.q = first if first in p.tiles else next(iter(p.tiles))
        g = p.tiles[self.q]
        #: the other tiled axes: grid dimensions whose blocks every warpgroup shares
        self.others = {a: n for a, n in p.tiles.items() if a != self.q}
        c = self.config.consumers
        if g % (c * WGMMA_M):
            raise NotLowerable(
                f"axis {self.q!r}: the tile g = {g} splits over {c} consumer warpgroups into rows that must be "
                f"multiples of wgmma's {WGMMA_M}"
            )
        self.rows = g // c
        self.pingpong = self.config.pingpong and c == 2
        if self.s % WGMMA_M:
            raise NotLowerable(f"axis {self.x!r}: the stream size s = {self.s} must be a multiple of {WGMMA_M}")
        consumer_regs, producer_regs = self.config.registers()
        if 128 * (c * consumer_regs + producer_regs) > REGISTERS:
            raise NotLowerable(
                f"warpgroup level: {c} consumers × {self.config.consumer_registers} registers plus a producer "
                f"× {self.config.producer_registers} exceed the SM's {REGISTERS} registers"
            )
        self.d = base2(_unweave(p.diagram, p.batch))
        for w in self.d.dom.inside:
            role = self._role(w)
            if role is None:
                raise NotLowerable(
                    f"input {w.describe()}: a block must be 2-D (the tiled or streamed axis, and one whole axis)"
                )
            if w.dtype.bits != 16:
                raise NotLowerable(f"input {w.describe()}: wgmma takes 16-bit operands, got {w.dtype}")
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

    @property
    def source(self) -> str:
        """The kernel's launch, described: grid, warpgroups, ring and the diagram the consumers walk.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d", d=64)
        >>> k = MosaicLowered(plan(derive(nc.library.attention(q, x, d, dtype="bf16"), tile(q, 128), stream(x, 64),
        ...                                verify=False).diagram))
        >>> print(k.source.splitlines()[0])
        plgpu.kernel grid (q/128, batch) × 3 warpgroups: 2 consumers of 64 q-rows each (wgmma), 1 TMA producer
        """
        c, p = self.config, self.plan
        return "\n".join(
            [
                f"plgpu.kernel grid ({', '.join(f'{a}/{n}' for a, n in p.tiles.items())}, batch) × {c.consumers + 1} "
                f"warpgroups: {c.consumers} "
                f"consumers of {self.rows} {self.q}-rows each (wgmma), 1 TMA producer",
                f"ring: {c.stages} stages of {self.x}~{self.s} chunks per streamed input; ping-pong: {self.pingpong}",
                f"consumers walk: {' ; '.join(b.name for b in self.d.boxes)}",
                *(
                    f"output {w.describe()} stored through the shared-memory tile of {self.d.dom.inside[i].describe()}"
                    for w, i in zip(self.d.cod.inside, self.reuse, strict=True)
                    if i is not None
                ),
            ]
        )

    def _role(self, w) -> str | None:
        """``stream`` (a ring chunk, whole tile rows when it holds the split axis), ``tile`` (per-consumer rows)."""
        names = w.names
        if len(names) != 2 or len(set(names)) != 2:
            return None
        if any(n not in (self.q, self.x, *self.others, *self.plan.whole) for n in names):
            return None
        if self.x in names:
            return "stream"
        return "tile" if self.q in names else None

    # -- the wrapper: bind sizes, check them, launch --------------------------------------------
    def __call__(self, *arrays):
        p, full = self.plan, self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        sizes = bind(full.dom, arrays)
        extent = {a.name: int(a.size.subs(sizes)) for w in full.dom.inside for a in w.axes}
        g = p.tiles[self.q]
        for a, block in ((self.q, g), (self.x, self.s), *self.others.items()):
            if extent[a] % block:
                raise NotLowerable(f"axis {a!r} of size {extent[a]}: the Mosaic backend needs whole blocks of {block}")
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
        lowering._plan.NotLowerable: thread-block level: the kernel would hold 458,752 B of shared memory ...
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
        tile per consumer (an output written into a resident input's tile takes none), and the staging
        buffer of a register operand in interpret mode.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> m, k, n = nc.axes("m k n")
        >>> mm = nc.library.matmul(m, k, n, dtype="bf16")
        >>> mm = derive(mm, tile(m, 256), tile(n, 128), stream(k, 64), verify=False)
        >>> MosaicLowered(plan(mm.diagram), config=MosaicConfig(stages=3)).smem_bytes({})  # 3·(256+128)·64·2 + 2·128²·2
        212992
        """
        c, total = self.config, 0
        for w in self.d.dom.inside:
            ring = self._role(w) == "stream"
            n = math.prod(self.block(w, extent, ring=ring)) * w.dtype.bytes
            total += n * (c.stages if ring else c.consumers)
        for w, reused in zip(self.d.cod.inside, self.reuse, strict=True):
            total += 0 if reused is not None else math.prod(self.block(w, extent)) * w.dtype.bytes * c.consumers
        if c.interpretable:
            total += self.rows * self.s * 2 * c.consumers
        return total

    def _call(self, arrays, sizes, extent):
        p, full, c = self.plan, self.plan.diagram, self.config
        wires = self.d.dom.inside
        streamed = [i for i, w in enumerate(wires) if self._role(w) == "stream"]
        resident = [i for i, w in enumerate(wires) if self._role(w) == "tile"]
        g = p.tiles[self.q]
        n_tiles, n_chunks = extent[self.q] // g, extent[self.x] // self.s
        batch = [extent[a] for a in p.batch]

        def smem(shape, dtype):
            return plgpu.SMEM(shape, dtype, transforms=_swizzle(shape[-1], jnp.dtype(dtype).itemsize))

        own = [w for w, reused in zip(self.d.cod.inside, self.reuse, strict=True) if reused is None]
        scratch = [
            [smem((c.stages, *self.block(wires[i], extent, ring=True)), wires[i].dtype.jnp) for i in streamed],
            [smem((c.consumers, *self.block(wires[i], extent)), wires[i].dtype.jnp) for i in resident],
            [smem((c.consumers, *self.block(w, extent)), w.dtype.jnp) for w in own],
            [plgpu.Barrier(num_barriers=c.stages) for _ in streamed],
            [plgpu.Barrier(num_arrivals=c.consumers, num_barriers=c.stages) for _ in streamed],
            [plgpu.Barrier(num_barriers=c.consumers) for _ in resident],
        ]
        scratch.append([plgpu.Barrier(num_arrivals=c.consumers)] if self.pingpong else [])
        if c.interpretable:
            value_dtype = next(wires[i].dtype.jnp for i in streamed)
            scratch.append([smem((c.consumers, self.rows, self.s), value_dtype)])
        causal = [b.diagonal() for b in self.d.boxes if isinstance(b, Generator) and b.diagonal()]
        causal = [dq for dq in causal if dq == (self.q, self.x)]
        kernel = _Kernel(self, sizes, extent, streamed, resident, n_tiles, n_chunks, batch, bool(causal))
        others = [extent[a] // n for a, n in self.others.items()]
        out_type = [jax.ShapeDtypeStruct(tuple(extent[a.name] for a in w.axes), w.dtype.jnp) for w in full.cod.inside]
        call = plgpu.kernel(
            kernel,
            out_type=out_type,
            scratch_types=scratch,
            grid=(n_tiles, *others, math.prod(batch)),
            grid_names=("tile", *(f"tile_{a}" for a in self.others), "batch"),
            num_threads=c.consumers + 1,
            thread_name="wg",
            compiler_params=plgpu.CompilerParams(approx_math=True),
            kernel_name="napkin_mosaic",
            interpret=plgpu.InterpretGPUParams() if self.interpret else None,
        )
        return call(*arrays)


class _Kernel:
    """The kernel body: a producer warpgroup filling the rings, consumer warpgroups walking the diagram."""

    def __init__(self, low: MosaicLowered, sizes, extent, streamed, resident, n_tiles, n_chunks, batch, causal):
        self.low, self.sizes, self.extent = low, sizes, extent
        self.streamed, self.resident, self.n_tiles, self.n_chunks = streamed, resident, n_tiles, n_chunks
        self.batch, self.causal = batch, causal

    def _index(self, wire, bid, **blocks):
        """The view of an HBM ref for one block: batch axes fixed, the tiled/streamed axis sliced."""
        p, idx, stride = self.low.plan, [], {}
        acc = 1
        for a, n in zip(reversed(p.batch), reversed(self.batch), strict=True):
            stride[a] = (acc, n)
            acc *= n
        for a in wire.axes:
            if a.name in stride:
                k, n = stride[a.name]
                idx.append(lax.rem(lax.div(bid, _i32(k)), _i32(n)))
            elif a.name in blocks:
                idx.append(blocks[a.name])
            elif a.name in self.low.others:
                n = self.low.others[a.name]
                idx.append(pl.ds(lax.axis_index(f"tile_{a.name}") * n, n))
            else:
                idx.append(slice(None))
        return tuple(idx)

    def __call__(self, *refs):
        low, c = self.low, self.low.config
        full = low.plan.diagram
        n_in, n_out = len(full.dom), len(full.cod)
        in_refs, out_refs, scratch = refs[:n_in], refs[n_in : n_in + n_out], refs[n_in + n_out :]
        rings, tiles, outs, loaded, consumed, arrived = scratch[:6]
        turn = scratch[6][0] if scratch[6] else None
        staging = scratch[7][0] if len(scratch) > 7 else None
        wg, bid = lax.axis_index("wg"), lax.axis_index("batch")
        tile = lax.axis_index("tile")
        if self.causal:  # the longest rows first: the last tiles see the most keys
            tile = self.n_tiles - 1 - tile
        g, s = low.plan.tiles[low.q], low.s
        # chunks this block streams: up to the diagonal of its last row when causal
        chunks = lax.div(tile * g + g + s - 1, _i32(s)) if self.causal else _i32(self.n_chunks)
        consumer_regs, producer_regs = c.registers()

        @pl.when(wg < c.consumers)
        def _consumer():
            plgpu.set_max_registers(consumer_regs, action="increase")
            self.consume(
                in_refs, out_refs, rings, tiles, outs, loaded, consumed, arrived, staging, turn, wg, bid, tile, chunks
            )

        @pl.when(wg == c.consumers)
        def _producer():
            plgpu.set_max_registers(producer_regs, action="decrease")
            self.produce(in_refs, rings, loaded, consumed, bid, tile, chunks)

    def produce(self, in_refs, rings, loaded, consumed, bid, tile, chunks):
        low, hbm, stages, s = self.low, self.low.plan.diagram.dom.inside, self.low.config.stages, self.low.s
        g = low.plan.tiles[low.q]

        def load(chunk, slot):
            for k, i in enumerate(self.streamed):
                blocks = {low.x: pl.ds(chunk * s, s), low.q: pl.ds(tile * g, g)}
                view = in_refs[i].at[self._index(hbm[i], bid, **blocks)]
                plgpu.copy_gmem_to_smem(view, rings[k].at[slot], loaded[k].at[slot])

        for j in range(min(stages, self.n_chunks)):  # a slice past the axis would not even trace
            pl.when(j < chunks)(lambda j=j: load(j, j))

        @pl.loop(stages, jnp.maximum(chunks, stages))
        def _(chunk):
            slot = lax.rem(chunk, _i32(stages))
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[slot])
            load(chunk, slot)

        @pl.loop(jnp.maximum(chunks - stages, 0), chunks)
        def _(chunk):  # the last releases: every phase of a barrier is observed before it is freed
            for k in range(len(self.streamed)):
                plgpu.barrier_wait(consumed[k].at[lax.rem(chunk, _i32(stages))])

    def consume(
        self, in_refs, out_refs, rings, tiles, outs, loaded, consumed, arrived, staging, turn, wg, bid, tile, chunks
    ):
        from rewrites import walk

        low, d, stages = self.low, self.low.d, self.low.config.stages
        wires, x, s, rows = d.dom.inside, low.x, low.s, low.rows
        start = tile * low.plan.tiles[low.q] + wg * rows
        for k, i in enumerate(self.resident):
            view = in_refs[i].at[self._index(low.plan.diagram.dom.inside[i], bid, **{low.q: pl.ds(start, rows)})]
            plgpu.copy_gmem_to_smem(view, tiles[k].at[wg], arrived[k].at[wg])
        xp = MosaicArrays(staging.at[wg] if staging is not None else None)
        pingpong = MosaicArrays(xp.staging, turn)
        ctx = Context(sizes=self.sizes, offsets={low.q: start}, xp=xp)
        resident = {i: Smem(tiles[k].at[wg], arrived[k].at[wg]) for k, i in enumerate(self.resident)}
        for v in resident.values():
            v.ready()  # waited once, before the loop
        box_at = [None]

        def skipping(unmasked):
            def skip(box):
                box_at[0] = box
                return unmasked and isinstance(box, Generator) and box.diagonal() == (low.q, x)

            return skip

        def rows_of(i, ref):  # a consumer's rows of a ring buffer that holds the whole tile
            names = wires[i].names
            if low.q not in names:
                return ref
            return ref.at[tuple(pl.ds(wg * rows, rows) if n == low.q else slice(None) for n in names)]

        def values(chunk):
            slot = lax.rem(chunk, _i32(stages))
            ring = {i: Smem(rows_of(i, rings[k].at[slot]), loaded[k].at[slot]) for k, i in enumerate(self.streamed)}
            return [ring.get(i, resident.get(i)) for i in range(len(wires))], ring, slot

        def traced(f, *args, **kw):
            try:
                return f(*args, **kw)
            except (NotLowerable, NotImplementedError, ValueError, TypeError) as e:
                box = box_at[0]
                raise NotLowerable(f"box {getattr(box, 'name', box)!r}: {e}") from e

        def probe(*vals):
            shapes: dict = {}
            walk(
                d,
                list(vals),
                Context(self.sizes, {}, JAX),
                x,
                "chunk",
                shapes,
                fold=lambda acc, st, ins, cc: acc.partial(ins, cc),
            )
            return shapes

        like = jax.eval_shape(probe, *(jax.ShapeDtypeStruct(low.block(w, self.extent), w.dtype.jnp) for w in wires))
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
                    Context(self.sizes, {low.q: start, x: chunk * s}, pingpong),
                    x,
                    "chunk",
                    states,
                    fold=lambda acc, st, ins, cc: acc.step(st, ins, cc),
                    skip=skipping(unmasked),
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

        if self.causal:
            needed = lax.div(start + rows + s - 1, _i32(s))
            visible = jnp.minimum(lax.div(start + 1, _i32(s)), needed)
            carry = lax.fori_loop(0, visible, body(True), init)
            carry = lax.fori_loop(visible, needed, body(False), carry)

            @pl.loop(needed, chunks)
            def _(chunk):  # chunks only the other consumers read: observe their arrival, release them
                slot = lax.rem(chunk, _i32(stages))
                for k in range(len(self.streamed)):
                    plgpu.barrier_wait(loaded[k].at[slot])
                    plgpu.barrier_arrive(consumed[k].at[slot])
                for _ in range(pingpong.issued):  # the turns the other warpgroup still takes
                    pingpong.schedule()
        else:
            carry = lax.fori_loop(0, chunks, body(False), init)
        if turn is not None:  # and the first one ends one turn later

            @pl.when(wg == 0)
            def _():
                pingpong.schedule()

        states = dict(zip(keys, carry, strict=True))
        final = [None if w.has(x) else resident[i] for i, w in enumerate(wires)]
        results = traced(walk, d, final, ctx, x, "final", states, skip=skipping(False))
        # every result in registers before any store: an output may overwrite a resident input's tile
        results = [_value(v) for v in results]
        own = iter(outs)
        buffers = [next(own) if i is None else tiles[self.resident.index(i)] for i in low.reuse]
        for buf, v in zip(buffers, results, strict=True):
            buf.at[wg][...] = v.astype(buf.dtype)
        plgpu.commit_smem()
        for buf, w, out in zip(buffers, low.plan.diagram.cod.inside, out_refs, strict=True):
            view = out.at[self._index(w, bid, **{low.q: pl.ds(start, rows)})]
            plgpu.copy_smem_to_gmem(buf.at[wg], view)
        plgpu.wait_smem_to_gmem(0)


def _i32(n):
    return jnp.asarray(n, jnp.int32)


def _same_block(a, b) -> bool:
    """Two wires whose blocks have one shape and dtype (same axes in the same order)."""
    return a.names == b.names and a.dtype == b.dtype


def _unweave(d: Diagram, axes: tuple) -> Diagram:
    return d.map_arrays(lambda w: w.with_(axes=[a for a in w.axes if a.name not in axes]))
