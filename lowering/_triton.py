"""The Triton backend: a scheduled diagram becomes one ``pl.pallas_call``.

The functor on objects is :mod:`lowering._plan` (grid, blocks, loop); on boxes it is the reference
semantics itself, run on blocks inside the kernel: the same generators evaluate tile-sized values,
with ``Context`` supplying the block offsets (for masks and score modifiers), 2-D ``jnp.dot`` for
contractions (f32 accumulation) and ``exp2`` for exponentials; index functions read the program's
position along the grid's batch axes like any other index. The streamed axis becomes a ``fori_loop``
folding the accumulators (FAN §3); affine masks (causal, sliding window, prefix) say which chunks of a
block they hide (never visited), keep whole (run unmasked) or cut (run masked), symbolically; a
:class:`~napkin_cat.library.SameSegment` mask (document masking) says it from its ids, at call time: the
wrapper computes each block's chunk ranges (:func:`segment_blocks`) and passes them to the kernel.

Ragged sizes are padded to whole blocks in the wrapper and masked: padded chunk elements take the
accumulator's neutral value (``-inf`` scores, zero values), so fully masked rows give 0, not NaN; an
axis kept whole pads to a power of two, its padding set to the neutral value of each box reducing it.
Both are the rule :class:`rewrites.pad_neutral`, whose side condition evaluates each box on its padding
and refuses (naming the box, its functions' values and the fix) where no value is neutral. The rewrites
of the block diagram are rules too, applied in order (:func:`kernel_rules`, ``Lowered.steps``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.extend.core import Literal

import rewrites
from lowering._plan import (
    LOG2E,
    NotLowerable,
    Plan,
    neutral_padding,
    next_pow2,
    smem_bytes,
    unweave,
)
from lowering._source import describe
from lowering._spmd import varying
from napkin_cat.diagram import Diagram
from napkin_cat.generators import Causal, Context, Contract, Elementwise, IndexMap, Jax, Kept, Mask, Partial
from napkin_cat.hardware import H100, HARDWARE, Hardware, for_device
from napkin_cat.semantics import bind
from rewrites import RewriteError, Rule, walk


@dataclass(frozen=True)
class Config:
    """Tuning knobs of the Triton backend (tile sizes come from the diagram's labels), checked when made.

    ``num_warps`` is a power of two from 1 to 32 (Triton's range); ``num_stages`` ≥ 1 is how many
    buffers of each streamed chunk the pipeline keeps, so it multiplies the shared-memory footprint.

    >>> Config(num_warps=8, num_stages=3)
    Config(num_warps=8, num_stages=3)
    >>> Config(num_stages=-1)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: Config: num_stages must be an integer ≥ 1, got -1
    >>> Config(num_warps=6)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: Config: num_warps must be one of 1, 2, 4, 8, 16, 32, got 6
    """

    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not integer(self.num_warps) or self.num_warps not in WARPS:
            raise NotLowerable(f"Config: num_warps must be one of {', '.join(map(str, WARPS))}, got {self.num_warps!r}")
        if not integer(self.num_stages) or self.num_stages < 1:
            raise NotLowerable(f"Config: num_stages must be an integer ≥ 1, got {self.num_stages!r}")

    @classmethod
    def get_default(cls, p: Plan) -> Config:
        """8 warps for 128-row tiles, else 4; 3 pipeline stages (measured on H200 by ``lowering._search``),
        1 for a stream of single elements (a batch axis summed, a few steps each loading a tile of every
        input: the pipeline's prologue costs more than it hides; a learned bias's gradient kernel at B = 2,
        N = 8192, D = 128 on an H100 runs in 6.1 ms at 1 stage, 7.8 at 2, 10.9 at 3:
        ``papers/flash_attention/bias_gradient.py``).

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64), verify=False)
        >>> Config.get_default(plan(flash.diagram))
        Config(num_warps=8, num_stages=3)
        """
        g = max(p.tiles.values(), default=64)
        return cls(num_warps=8 if g >= 128 else 4, num_stages=1 if p.stream and p.stream[1] == 1 else 3)


#: the warp counts Triton accepts
WARPS = (1, 2, 4, 8, 16, 32)


def interpreted(interpret: bool | None) -> bool:
    """Whether a kernel interprets: as asked, or by default where no GPU is the default backend.

    >>> interpreted(True), interpreted(None)  # on a CPU
    (True, True)
    """
    return (jax.default_backend() != "gpu") if interpret is None else interpret


def no_gpu() -> str | None:
    """Why nothing compiled can run here (jax's first device is no GPU), else None.

    >>> no_gpu()  # on a CPU
    "this machine has no GPU (jax's device is 'cpu')"
    """
    device = jax.devices()[0]
    return None if device.platform == "gpu" else f"this machine has no GPU (jax's device is {device.platform!r})"


def target_hardware(interpret: bool) -> Hardware:
    """The hardware a kernel's guards assume: the detected GPU's model when compiling, H100 when interpreting.
    Compiling where there is no GPU is refused, saying so: ``hardware=`` only names the GPU a kernel is lowered
    for elsewhere (``jax.jit(kernel).trace(...).lower(lowering_platforms=("cuda",))``), it never runs here.

    >>> target_hardware(interpret=True).name
    'H100'
    >>> target_hardware(interpret=False)  # on a CPU
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: lower(interpret=False) compiles the kernels for a GPU, and this machine has no GPU \
(jax's device is 'cpu'); pass interpret=None (interpret here, compile on a GPU) or interpret=True, or run on a GPU \
(hardware= only names the GPU model a kernel is lowered for, to lower it for CUDA without running it here)
    """
    if interpret:
        return H100
    if why := no_gpu():
        raise NotLowerable(
            f"lower(interpret=False) compiles the kernels for a GPU, and {why}; pass interpret=None (interpret here, "
            "compile on a GPU) or interpret=True, or run on a GPU (hardware= only names the GPU model a kernel is "
            "lowered for, to lower it for CUDA without running it here)"
        )
    kind = jax.devices()[0].device_kind
    found = for_device(kind)
    if found is None:
        known = ", ".join(h.name for h in HARDWARE)
        raise NotLowerable(
            f"no hardware model for the device {kind!r} (known: {known}); pass lower(..., hardware=) "
            "a napkin_cat.hardware.Hardware describing it"
        )
    return found


def launch(p: Plan, extent: dict, config: Config, hardware: Hardware) -> dict:
    """The padded extent of every axis of a launch, after the shape guards that need concrete sizes.

    Tiled and streamed axes pad to whole blocks; an axis kept whole pads to a power of two ≥ 16 (so
    every 16-bit dot has K ≥ 16), which needs a neutral value for every box combining elements along
    it (the kernel writes that value into the padding, :func:`lowering._plan.pad_neutral`). The
    blocks' shared-memory footprint must fit ``hardware.smem_per_block``. Nothing is allocated here,
    so ``lower()`` runs it when sizes are concrete and every call runs it before padding.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 128), verify=False).diagram)
    >>> launch(p, {"q": 40, "x": 40, "d": 64}, Config(), H100)
    {'q': 128, 'x': 128, 'd': 64}
    >>> launch(p, {"q": 40, "x": 40, "d": 512}, Config(), H100)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: the kernel would hold 1,310,720 B of shared memory ... over the 232,448 B ...
    """
    d = p.diagram
    padded = dict(extent)
    for a, g in p.tiles.items():
        padded[a] = -(-extent[a] // g) * g
    if p.stream:
        x, s = p.stream
        padded[x] = -(-extent[x] // s) * s
    for a in p.whole:
        want = max(next_pow2(extent[a]), 16)
        if want != extent[a]:
            paddable(d, a, extent[a], f"is not a power of two ≥ 16, so it is padded to {want}")
            padded[a] = want
    smem = smem_bytes(p, padded, config.num_stages)
    if smem > hardware.smem_per_block:
        raise NotLowerable(
            f"the kernel would hold {smem:,} B of shared memory (resident blocks plus {config.num_stages} stages "
            f"of each chunk), over the {hardware.smem_per_block:,} B a block may use on {hardware.name}; "
            "choose smaller tiles or stream sizes"
        )
    return padded


def paddable(d: Diagram, a: str, extent: int, why: str) -> None:
    """Refuse, naming the box, its functions' values and the fix, to pad axis ``a`` of size ``extent`` (``why``
    it is padded) where the padding rule's side condition finds no neutral value for some box.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> n, d = nc.axes("n d")
    >>> S, V, O = nc.Array(n, d), nc.Array(d), nc.Array(n)
    >>> signed = nc.normalised_contract(S, V, d, O, a1=jnp.negative, a2=jnp.exp, b=jnp.sqrt)
    >>> paddable(signed, "d", 40, "is padded to 64")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: axis 'd' of size 40 is padded to 64: pad_neutral(d, 40): box ... a2(-inf) = 0.0; ...
    """
    try:
        rewrites.pad_neutral(a, extent).check(d)
    except RewriteError as e:
        raise NotLowerable(f"axis {a!r} of size {extent} {why}: {e}") from e


def block_einsum(spec: str, *xs, operands=None):
    """A contraction of blocks: one ``jnp.dot`` (f32 accumulation) for a 2-D matrix product, else a
    broadcast product summed over the contracted axes (matrix-vector and other small cases).

    ``operands`` (a 16-bit dtype, or None) is the dtype the tensor cores multiply in: two f32 blocks a
    kernel computed (a cotangent rescaled by a row weight, as attention sinks make it) are rounded to it,
    as FlashAttention-2 rounds ``P`` and ``dS``, rather than multiplied as f32 at a fraction of the rate.

    >>> a = jnp.full((16, 16), 1 + 2**-12, jnp.float32)
    >>> [float(block_einsum("ik,kj->ij", a, a, operands=t)[0, 0]) for t in (None, jnp.bfloat16)]
    [16.0078125, 16.0]

    Axes of size 1 in every operand and the output (a chunk of a batch axis streamed one at a time) are
    dropped for the product, so it is still one 2-D ``jnp.dot``:

    >>> block_einsum("bik,bkj->bij", a[None], a[None]).shape
    (1, 16, 16)
    """
    ins, out = spec.split("->")
    terms = ins.split(",")
    unit = [c for c in out if all(c in t and v.shape[t.index(c)] == 1 for t, v in zip(terms, xs, strict=True))]
    if unit and len(terms) == 2:  # a chunk of 1 (a streamed batch axis): the 2-D product, the unit axes put back
        xs = [jnp.squeeze(v, [t.index(c) for c in unit]) for t, v in zip(terms, xs, strict=True)]
        inner = (
            ",".join("".join(c for c in t if c not in unit) for t in terms)
            + "->"
            + "".join(c for c in out if c not in unit)
        )
        return jnp.expand_dims(block_einsum(inner, *xs, operands=operands), [out.index(c) for c in unit])
    shared = set(terms[0]) & set(terms[1]) - set(out) if len(terms) == 2 else set()
    if len(terms) == 2 and all(len(t) == 2 for t in terms) and len(out) == 2 and len(shared) == 1:
        (k,) = shared
        # the operand holding the output's rows goes left, so only operands are transposed (free for the
        # tensor cores), never the f32 product (a layout change through shared memory in Triton)
        first = 0 if out[0] in terms[0] else 1
        (lt, x), (rt, y) = (terms[first], xs[first]), (terms[1 - first], xs[1 - first])
        x = x if lt == out[0] + k else x.T
        y = y if rt == k + out[1] else y.T
        if operands is not None and x.dtype == y.dtype == jnp.float32:
            x, y = x.astype(operands), y.astype(operands)
        if x.dtype != y.dtype:  # Triton's dot needs one operand type: the narrower one (FA2 casts P to V's dtype)
            narrow = min(x.dtype, y.dtype, key=lambda t: jnp.dtype(t).itemsize)
            x, y = x.astype(narrow), y.astype(narrow)
        return jnp.dot(x, y, preferred_element_type=jnp.float32)
    letters = "".join(dict.fromkeys(out + "".join(terms)))
    acc = None
    for t, v in zip(terms, xs, strict=True):
        v = jnp.transpose(v.astype(jnp.float32), [t.index(c) for c in letters if c in t])
        v = jnp.expand_dims(v, [i for i, c in enumerate(letters) if c not in t])
        acc = v if acc is None else acc * v
    summed = [i for i, c in enumerate(letters) if c not in out]
    return jnp.sum(acc, axis=tuple(summed)) if summed else acc


class Blocks(Jax):
    """The array namespace of a kernel body: 2-D ``jnp.dot`` for contractions in ``operands`` (the
    kernel's 16-bit input dtype, or None: as given), ``exp2`` for exponentials, and ``tanh`` for tanh,
    named or inside a user's callable (a soft-cap ``score_mod``): by default ``jnp.tanh`` (libdevice's,
    about twenty instructions), in a compiled kernel with 16-bit operands the GPU's one-instruction
    ``tanh.approx.f32`` (:func:`native_tanh`), as ``exp2`` is already its ``ex2.approx``.

    >>> Blocks(jnp.bfloat16).operands
    <class 'jax.numpy.bfloat16'>
    >>> float(Blocks(tanh=lambda v: v).lift(lambda s: 30 * jnp.tanh(s / 30))(jnp.float32(3.0)))  # tanh swapped
    3.0
    """

    def __init__(self, operands=None, tanh=None):
        self.operands = operands
        if tanh is not None:
            self.tanh = tanh

    def lift(self, fn):
        """A user's callable with each ``tanh`` it computes done by this namespace's (:func:`swap_tanh`)."""
        return fn if self.tanh is jnp.tanh else swap_tanh(fn, self.tanh)

    def index_map(self, fn, v, indices: dict):
        """``fn(v, **indices)``, lifted as :meth:`lift` lifts a callable."""
        names = list(indices)
        return self.lift(lambda v, *ix: fn(v, **dict(zip(names, ix, strict=True))))(v, *indices.values())

    def einsum(self, spec: str, *xs):
        """:func:`block_einsum` in this kernel's operand dtype."""
        return block_einsum(spec, *xs, operands=self.operands)

    @staticmethod
    def exp(v):
        """``exp(v) = 2^(v·log₂e)``: the GPU's native ``exp2``."""
        return jnp.exp2(v * LOG2E)


def native_tanh(v):
    """tanh on the GPU's special-function unit, ``tanh.approx.f32`` (one instruction; relative error at
    most 2^−10.99, below a bf16 score's rounding), where libdevice's ``tanh`` takes about twenty. FlashAttention-3
    soft-caps with the same instruction. Compiled kernels only: it is PTX, which interpret mode cannot run."""
    return pltriton.approx_tanh(v.astype(jnp.float32)).astype(v.dtype)


def swap_tanh(fn, tanh):
    """``fn`` with every ``tanh`` primitive it computes (inside ``jit`` calls too) replaced by ``tanh``: traced
    to a jaxpr at each call, then evaluated equation by equation.

    >>> f = swap_tanh(lambda s: 2 * jnp.tanh(s), jnp.sin)
    >>> bool(jnp.allclose(f(jnp.float32(0.5)), 2 * jnp.sin(0.5)))
    True
    """

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        outs = _eval_swapped(closed.jaxpr, closed.consts, args, tanh)
        return outs[0] if len(outs) == 1 else tuple(outs)

    return run


def _eval_swapped(jaxpr, consts, args, tanh):
    env = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    env.update(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    for e in jaxpr.eqns:
        ins = [read(v) for v in e.invars]
        inner = e.params.get("jaxpr")
        if e.primitive is lax.tanh_p:
            outs = [tanh(*ins)]
        elif e.primitive.name in ("jit", "pjit", "closed_call") and hasattr(inner, "consts"):
            outs = _eval_swapped(inner.jaxpr, inner.consts, ins, tanh)
        else:
            outs = e.primitive.bind(*ins, **e.params)
            outs = outs if e.primitive.multiple_results else [outs]
        env.update(zip(e.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def operand_dtype(d: Diagram):
    """The 16-bit float dtype of a kernel's inputs, which its products multiply in; None where it has none.

    >>> import napkin_cat as nc
    >>> operand_dtype(nc.library.attention(*nc.axes("q x d"), dtype="bf16"))
    <class 'jax.numpy.bfloat16'>
    """
    narrow = {w.dtype.name for w in d.dom.inside} & {"bf16", "f16"}
    return {"bf16": jnp.bfloat16, "f16": jnp.float16}[min(narrow)] if narrow else None


def _block_axes(p: Plan, wire) -> list:
    return [a for a in wire.axes if a.name not in p.batch]


class Lowered:
    """A kernel for a scheduled diagram: call it with arrays in the diagram's axis order.

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> a, b, c = nc.axes("a b c")
    >>> mm = nc.library.matmul(a, b, c)
    >>> kernel = Lowered(plan(derive(mm, tile(a, 16), stream(b, 16), verify=False).diagram), interpret=True)
    >>> A, B = jax.random.normal(jax.random.key(0), (20, 24)), jax.random.normal(jax.random.key(1), (24, 8))
    >>> bool(jnp.allclose(kernel(A, B), A @ B, atol=1e-4))
    True
    """

    def __init__(
        self, p: Plan, *, interpret: bool | None = None, config: Config | None = None, hardware: Hardware | None = None
    ):
        self.plan, self.config = p, config
        self.interpret = interpreted(interpret)
        self.hardware = target_hardware(self.interpret) if hardware is None else hardware
        self.__name__ = "napkin_kernel"

    # -- the wrapper: bind sizes, pad to whole blocks, launch, slice -----------------------------
    def __call__(self, *arrays):
        p, d = self.plan, self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        sizes = bind(d.dom, arrays)
        extent = {a.name: int(a.size.subs(sizes)) for w in d.dom.inside for a in w.axes}
        config = self.config or Config.get_default(p)
        padded = launch(p, extent, config, self.hardware)  # the guards, before padding allocates anything
        if p.stream and padded[p.stream[0]] != extent[p.stream[0]]:
            x, s = p.stream
            paddable(d, x, extent[x], f"is not a multiple of the stream size {s}, so its last chunk is padded")
        bounds = [(m, _segment_bounds(p, m, arrays, extent)) for m in segments(d, p)]  # from the ids, unpadded
        arrays = [_pad(v, w, padded) for v, w in zip(arrays, d.dom.inside, strict=True)]
        outs = self._call(arrays, sizes, extent, padded, config, bounds)
        outs = [o[tuple(slice(0, extent[a.name]) for a in w.axes)] for o, w in zip(outs, d.cod.inside, strict=True)]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _grid(self, padded):
        p = self.plan
        tiles = [padded[a] // g for a, g in p.tiles.items()]
        batch = math.prod(padded[a] for a in p.batch)
        return (*tiles, batch)

    def _index_map(self, wire, padded, flip=()):
        p = self.plan
        tile_pos = {a: i for i, a in enumerate(p.tiles)}
        nb = len(p.tiles)
        strides = _strides(p, padded)

        def index_map(*ids):
            idx = []
            for a in wire.axes:
                if a.name in p.batch:
                    idx.append(_batch_index(ids[nb], a.name, strides, padded))
                elif a.name in tile_pos:
                    idx.append(_tile_id(ids[tile_pos[a.name]], a.name, p, padded, flip))
                else:
                    idx.append(0)
            return tuple(idx)

        return index_map

    def _spec(self, wire, padded, flip=()):
        p = self.plan
        shape = []
        for a in wire.axes:
            if a.name in p.batch:
                shape.append(None)
            elif a.name in p.tiles:
                shape.append(p.tiles[a.name])
            else:
                shape.append(padded[a.name])
        return pl.BlockSpec(tuple(shape), self._index_map(wire, padded, flip))

    def _bound_specs(self, bounds, padded, flip=()) -> list:
        """Four scalar blocks of each segment mask's bounds (``(mask, segment_blocks)`` pairs): this program's tile,
        at its index along each batch axis the ids have (0 along the others, where the bounds broadcast)."""
        p = self.plan
        nb, strides = len(p.tiles), _strides(p, padded)
        tile_pos = {a: i for i, a in enumerate(p.tiles)}
        specs = []
        for m, b in bounds:

            def index_map(*ids, k, m=m, b=b):
                at = [
                    _batch_index(ids[nb], a, strides, padded) if n > 1 else 0
                    for a, n in zip(p.batch, b.shape, strict=False)
                ]
                return (*at, _tile_id(ids[tile_pos[m.axis]], m.axis, p, padded, flip), k)

            specs += [pl.BlockSpec((None,) * b.ndim, functools.partial(index_map, k=k)) for k in range(4)]
        return specs

    def _call(self, arrays, sizes, extent, padded, config, bounds=()):
        p, d = self.plan, self.plan.diagram
        xp = Blocks(operand_dtype(d), tanh=None if self.interpret or operand_dtype(d) is None else native_tanh)
        flip = heavy_last(p, extent, padded)
        kernel = functools.partial(_kernel, p, sizes, extent, padded, xp, 4 * len(bounds), flip)
        mat = varying(arrays)  # inside shard_map the outputs vary over the mesh axes the inputs do (lowering._spmd)
        out_shape = [
            jax.ShapeDtypeStruct(tuple(padded[a.name] for a in w.axes), w.dtype.jnp, manual_axis_type=mat)
            for w in d.cod.inside
        ]
        call = pl.pallas_call(
            kernel,
            grid=self._grid(padded),
            in_specs=[self._spec(w, padded, flip) for w in d.dom.inside] + self._bound_specs(bounds, padded, flip),
            out_specs=[self._spec(w, padded, flip) for w in d.cod.inside],
            out_shape=out_shape,
            compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=self.interpret,
            name="napkin_kernel",
        )
        return call(*arrays, *(b for _, b in bounds for _ in range(4)))

    @property
    def source(self) -> str:
        """The kernel's launch description: grid axes, block shapes, loop and accumulators."""
        return describe(self)

    @property
    def steps(self) -> tuple[Rule, ...]:
        """The rules the kernel applies to its block diagram, in order (:func:`kernel_rules`); at a call whose
        sizes pad an axis, ``pad_neutral`` of that axis follows them.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> Lowered(plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)).steps
        (base2(), tiled_first(x, ('q',), inputs=True))
        """
        return kernel_rules(self.plan)


def _pad(v, wire, padded):
    widths = [(0, padded[a.name] - v.shape[i]) for i, a in enumerate(wire.axes)]
    return jnp.pad(v, widths) if any(w for _, w in widths) else v


@dataclass
class BlockContext(Context):
    """The context of a kernel body: block offsets, and the index of this program along each grid
    (batch) axis, which index functions may read like any other axis (ALiBi reads the head).

    >>> from napkin_cat import Array, axes
    >>> BlockContext(grid={"h": 3}).at(q=16).indices(Array(*axes("q")), (2,))["h"]
    3
    """

    grid: dict = field(default_factory=dict)

    def at(self, **offsets) -> BlockContext:
        return replace(self, offsets={**self.offsets, **offsets})

    def indices(self, wire, shape: tuple) -> dict:
        return {**self.grid, **super().indices(wire, shape)}


def _strides(p: Plan, padded: dict) -> dict:
    strides, acc = {}, 1
    for a in reversed(p.batch):
        strides[a] = acc
        acc *= padded[a]
    return strides


def _batch_index(program, a: str, strides: dict, padded: dict):
    """The index along batch axis ``a`` of the flattened batch grid position ``program`` (int32, as Pallas' grid
    ids are: Python ints would become int64 under ``jax_enable_x64`` and ``lax.div`` does not promote)."""
    return lax.rem(lax.div(program, jnp.int32(strides[a])), jnp.int32(padded[a]))


def affine_mask(box):
    """The affine form (an :class:`napkin_cat.library.Affine`) of a mask box, or of a mask's backward
    (``Kept``: the cotangent where the mask keeps the score, else 0), which hides the same blocks and is
    the identity on those the mask keeps whole; None for any other box.

    >>> import napkin_cat as nc
    >>> q, x = nc.axes("q x")
    >>> affine_mask(nc.causal_mask(nc.Array(q, x), "q", "x")).name
    'causal(q ≥ x)'
    """
    from napkin_cat.library import Affine

    if isinstance(box, Mask):
        keep = box.params["mask"]
    elif isinstance(box, IndexMap) and isinstance(box.params["fn"], Kept):
        keep = box.params["fn"].keep
    else:
        return None
    if isinstance(keep, Affine):
        return keep
    return Affine.causal(keep.q, keep.x) if isinstance(keep, Causal) else None


def _visited(masks, x: str, s: int, n_chunks: int, ranges: dict, extent: int) -> tuple:
    """The chunks of ``x`` a block visits, ``first ≤ full_lo ≤ full_hi ≤ last``: the affine masks keep
    nothing outside ``[first, last)`` (skipped) and everything in ``[full_lo, full_hi)`` (run unmasked)."""
    lo, hi, flo, fhi = 0, extent, 0, extent
    for m in masks:
        a, b = m.interval(x, ranges)
        fa, fb = m.interval(x, ranges, every=True)
        lo, hi, flo, fhi = jnp.maximum(lo, a), jnp.minimum(hi, b), jnp.maximum(flo, fa), jnp.minimum(fhi, fb)
    first = jnp.clip(lo // s, 0, n_chunks)
    last = jnp.clip(-(-hi // s), first, n_chunks)
    full_lo = jnp.clip(-(-flo // s), first, last)
    full_hi = jnp.clip(fhi // s, full_lo, last)
    return first, full_lo, full_hi, last


def heavy_last(p: Plan, extent: dict, padded: dict) -> tuple[str, ...]:
    """The tiled axes whose last tile visits more chunks of the stream than its first (causal attention's
    queries: the last query tile reads every key block). Their tiles are launched last-first, so the heaviest
    programs start in the first wave and the light ones fill the tail, rather than the heaviest arriving last
    and running alone (longest first, as FlashAttention-3's scheduler orders causal tiles).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> heavy_last(p, {"q": 64, "x": 64, "d": 8}, {"q": 64, "x": 64, "d": 8})
    ('q',)
    """
    if p.stream is None:
        return ()
    x, s = p.stream
    masks = [m for b in p.diagram.boxes if (m := affine_mask(b)) is not None and x in m.axes]
    if not masks:
        return ()
    n_chunks = padded[x] // s
    ranges = {a: (0, extent[a]) for a in (*p.tiles, *p.batch, *p.whole)}
    flipped = []
    with jax.ensure_compile_time_eval():  # concrete sizes: evaluated now, also while a caller's jit traces
        for a, g in p.tiles.items():
            n = padded[a] // g
            if n < 2:
                continue
            work = []
            for t in (0, n - 1):
                first, *_, last = _visited(
                    masks, x, s, n_chunks, ranges | {a: (t * g, min(t * g + g, extent[a]))}, extent[x]
                )
                if isinstance(first, jax.core.Tracer) or isinstance(last, jax.core.Tracer):
                    break  # a mask whose offset is known only in the kernel (a ring step's): the order is kept
                work.append(int(last) - int(first))
            if len(work) == 2 and work[1] > work[0]:
                flipped.append(a)
    return tuple(flipped)


def zeroing_mask(d: Diagram, x: str):
    """The affine mask that zeroes every accumulator's input in a kernel streaming ``x``: one ``Kept`` box
    (a score's cotangent where the mask keeps the score, else 0) on axes other than ``x``, read directly by
    every box that reduces ``x``, each a contraction (multilinear: a zero operand gives its identity, 0). A
    tile it hides then adds nothing in any chunk, so the kernel runs none: a bias's gradient streamed over
    the batch skips the causal mask's empty tiles. None where there is no such mask.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering._backward import backward_of
    >>> b, h, q, x, d = nc.axes("b h q x d")
    >>> att = nc.library.biased_attention(q, x, d, batch=(b, h), bias_batch=(h,), causal=True)
    >>> db = backward_of(derive(att, tile(q, 16), stream(x, 16), verify=False).diagram).pieces[-1].scheduled
    >>> zeroing_mask(db, "b").axes
    ('q', 'x')
    """
    masks: dict = {}  # layer → the affine form of a Kept mask there; its outputs carry the layer as a token
    readers = []

    def step(i, box, ins):
        m = affine_mask(box)
        if isinstance(box, IndexMap) and m is not None and x not in m.axes:
            masks[i] = m
            return [("mask", i)] * len(box.cod)
        if x in getattr(box, "reduced", ()):
            readers.append((box, {v[1] for v in ins if isinstance(v, tuple) and v[0] == "mask"}))
        return [None] * len(box.cod)

    d.dataflow([None] * len(d.dom), step)
    common = set(masks)
    for box, fed in readers:
        common &= fed if isinstance(box, Contract) else set()
    return masks[min(common)] if readers and common else None


def _tile_kept(m, p: Plan, offsets: dict, extent: dict):
    """1 (int32) where the affine mask ``m`` (on tiled axes only) keeps something of this program's tile, else
    0: a factor of the loop's bounds (arithmetic, as Pallas' Triton lowering types a select of literals i1)."""
    a = m.axes[0]
    ranges = {t: (offsets[t], jnp.minimum(offsets[t] + g, extent[t])) for t, g in p.tiles.items() if t != a}
    lo, hi = m.interval(a, ranges)
    return ((hi > offsets[a]) & (lo < jnp.minimum(offsets[a] + p.tiles[a], extent[a]))).astype(jnp.int32)


def _combine(a: tuple, b: tuple) -> tuple:
    """The chunk ranges of two masks together: a chunk is visited where both may keep something, and run
    unmasked where both keep it whole (intervals intersect)."""
    first = jnp.maximum(a[0], b[0])
    last = jnp.maximum(first, jnp.minimum(a[3], b[3]))
    full_lo = jnp.clip(jnp.maximum(a[1], b[1]), first, last)
    full_hi = jnp.clip(jnp.minimum(a[2], b[2]), full_lo, last)
    return first, full_lo, full_hi, last


def segment_mask(box) -> tuple[int, int] | None:
    """Where a :class:`~napkin_cat.library.SameSegment` box reads its two label arrays (positions among its
    inputs), or the derivative of one in its score (``Partial(same, 0)``: the cotangent where the labels
    agree, else 0), which hides the same entries and is the identity where the mask keeps all; None for
    any other box.

    >>> import napkin_cat as nc
    >>> q, x, d = nc.axes("q x d")
    >>> [segment_mask(b) for b in nc.library.document_attention(q, x, d).boxes if segment_mask(b)]
    [(1, 2)]
    """
    from napkin_cat.library import SameSegment

    fn = box.params["fn"] if isinstance(box, Elementwise) else None
    if isinstance(fn, SameSegment):
        return (1, 2)
    if isinstance(fn, Partial) and fn.arg == 0 and isinstance(fn.fn, SameSegment):
        return (2, 3)
    return None


@dataclass(frozen=True)
class Segments:
    """A segment mask of a kernel that tiles ``axis`` and streams the other axis it reads: its ``box``, and
    the kernel inputs holding the labels along the tiled axis (``tiled``) and the streamed one (``streamed``)."""

    box: object
    tiled: int
    streamed: int
    axis: str


def segments(d: Diagram, p: Plan) -> tuple[Segments, ...]:
    """The segment masks of ``d`` (the plan's diagram or a kernel body) whose blocks the ids can say: each
    reads labels along a tiled axis and along the streamed one, both inputs of the kernel (through copies
    and swaps). Others run masked on every chunk, as any elementwise box.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.document_attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> [(m.tiled, m.streamed, m.axis) for m in segments(p.diagram, p)]
    [(3, 4, 'q')]
    """
    if p.stream is None:
        return ()
    x, found = p.stream[0], []

    def axis(j):  # the one axis of input j's labels that is not a grid (batch) axis
        names = [n for n in d.dom.inside[j].names if n not in p.batch]
        return names[0] if len(names) == 1 else None

    def step(i, box, ins):
        pos = segment_mask(box)
        labels = [ins[k] for k in pos or ()]
        if labels and None not in labels:
            along = {axis(j): j for j in labels}
            t = next((a for a in along if a != x), None)
            if x in along and t in p.tiles:
                found.append(Segments(box, along[t], along[x], t))
        return [None] * len(box.cod)

    d.dataflow(list(range(len(d.dom))), step)
    return tuple(found)


def segment_blocks(tiled, streamed, tile: int, chunk: int):
    """For each block of ``tile`` labels of ``tiled`` (``[..., n]``), the chunks of ``chunk`` labels of
    ``streamed`` (``[..., m]``, leading axes broadcast) it visits, ``[first, last)``, and keeps whole,
    ``[full_lo, full_hi)``: an int32 array ``[..., cdiv(n, tile), 4]`` of ``(first, full_lo, full_hi, last)``.

    A block and a chunk may meet where their ranges of labels overlap, and are kept whole where both hold
    one and the same label. Each block's range is looked up among the prefix maxima and suffix minima of the
    chunks' ranges (both nondecreasing) by counting those below it: one fused comparison of every block with
    every chunk (n/tile × m/chunk, 8k pairs at 8192 tokens), which on an H100 takes microseconds where a
    binary search's sequential steps took 0.66 ms (``papers/flash_attention/document_skipping.py``).
    For sorted labels this is exact (the chunks whose range overlaps the block's, which for the same labels
    on both sides are those it meets); otherwise the visited chunks are a superset and the whole ones a
    subset, so a kernel stays correct. Positions beyond the arrays' ends (padding) take part in no range.

    >>> ids = jnp.array([0] * 5 + [1] * 7 + [2] * 4)  # three documents over 16 positions, blocks of 4
    >>> segment_blocks(ids, ids, 4, 4).tolist()
    [[0, 0, 1, 2], [0, 0, 0, 3], [1, 2, 3, 3], [3, 3, 4, 4]]
    """
    big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min

    def spans(ids, size):
        n = ids.shape[-1]
        m = -(-n // size)
        widths = [(0, 0)] * (ids.ndim - 1) + [(0, m * size - n)]
        blocks = (*ids.shape[:-1], m, size)
        lo = jnp.pad(ids, widths, constant_values=big).reshape(blocks).min(-1)
        hi = jnp.pad(ids, widths, constant_values=small).reshape(blocks).max(-1)
        return lo, hi

    tiled, streamed = jnp.asarray(tiled, jnp.int32), jnp.asarray(streamed, jnp.int32)
    lo, hi = spans(tiled, tile)
    clo, chi = spans(streamed, chunk)
    reach = lax.cummax(chi, axis=chi.ndim - 1)  # the largest label up to each chunk: nondecreasing
    floor = lax.cummin(clo, axis=clo.ndim - 1, reverse=True)  # the smallest from each chunk on: nondecreasing

    def search(side):  # searchsorted by counting: one fused comparison, where a binary search takes sequential steps
        def count(ascending, values):
            below = ascending[..., None, :] < values[..., :, None]
            return jnp.sum(below | (ascending[..., None, :] == values[..., :, None]) if side == "right" else below, -1)

        return count

    first = search("left")(reach, lo)  # chunks before it end below the block's smallest label
    last = search("right")(floor, hi)  # chunks from it on start above the block's largest
    full_lo = jnp.clip(search("left")(floor, lo), first, last)  # from it on, nothing below the label
    full_hi = jnp.clip(search("right")(reach, hi), full_lo, last)  # up to it, nothing above
    full_hi = jnp.where(lo == hi, full_hi, full_lo)  # a block of several labels is never kept whole
    return jnp.stack(jnp.broadcast_arrays(first, full_lo, full_hi, last), axis=-1).astype(jnp.int32)


def _segment_bounds(p: Plan, m: Segments, arrays: list, extent: dict):
    """:func:`segment_blocks` of a kernel's segment mask, on its unpadded label inputs laid out as the grid's
    batch axes (size 1 where the labels lack one) then the tiled or streamed axis."""
    d, x = p.diagram, p.stream[0]

    def laid_out(j, a):
        w, v = d.dom.inside[j], arrays[j]
        order = [w.names.index(b) for b in p.batch if w.has(b)] + [w.names.index(a)]
        v = jnp.transpose(v, order)[..., : extent[a]]
        return jnp.expand_dims(v, [i for i, b in enumerate(p.batch) if not w.has(b)])

    return segment_blocks(laid_out(m.tiled, m.axis), laid_out(m.streamed, x), p.tiles[m.axis], p.stream[1])


def tiled_first(d: Diagram, p: Plan, *, inputs: bool = False) -> Diagram:
    """``d`` after the rule :class:`rewrites.tiled_first` for ``p``'s streamed and tiled axes (``d`` where nothing
    streams): each wire holding the streamed axis and a tiled one laid out tiled axes first.

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> from lowering._backward import backward_of
    >>> q, x, d = nc.axes("q x d")
    >>> dkv = backward_of(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> p = plan(dkv.pieces[-1].scheduled)
    >>> sorted({str(w) for b in tiled_first(p.diagram, p).boxes for w in b.cod.inside if w.has("q") and w.has("x")})
    ['x/16×q~16']
    """
    return d if p.stream is None else rewrites.tiled_first(p.stream[0], tuple(p.tiles), inputs)(d)


def kernel_rules(p: Plan, extent: dict | None = None, padded: dict | None = None) -> tuple[Rule, ...]:
    """The rules a Triton kernel applies to its block diagram (``unweave(p.diagram, p.batch)``), in order: the
    base-2 exponent, the tiled-first layout where it streams, and, at sizes (``extent``, ``padded``) where an axis
    kept whole is padded to a power of two, the neutral padding of that axis. A ragged streamed axis is padded
    chunk by chunk with the values the same rule's side condition checks (:func:`rewrites.neutral_padding`).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> q, x, d = nc.axes("q x d")
    >>> p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    >>> kernel_rules(p, {"q": 40, "x": 40, "d": 40}, {"q": 48, "x": 48, "d": 64})
    (base2(), tiled_first(x, ('q',), inputs=True), pad_neutral(d, 40))
    """
    rules: list[Rule] = [rewrites.base2()]
    if p.stream is not None:
        rules.append(rewrites.tiled_first(p.stream[0], tuple(p.tiles), inputs=True))
    if extent is not None:
        rules += [rewrites.pad_neutral(a, extent[a]) for a in p.whole if padded[a] != extent[a]]
    return tuple(rules)


def _tile_id(pid, a: str, p: Plan, padded: dict, flip):
    """The tile of axis ``a`` that grid position ``pid`` runs: last-first along the axes in ``flip``."""
    return padded[a] // p.tiles[a] - 1 - pid if a in flip else pid


def _kernel(p: Plan, sizes, extent, padded, xp: Blocks, n_bounds, flip, *refs):
    block = unweave(p.diagram, p.batch)
    laid = block.dom.inside  # the inputs' blocks as the caller lays them out
    d = functools.reduce(lambda d, rule: rule(d), kernel_rules(p, extent, padded), block)
    n_in = len(d.dom)
    in_refs, bound_refs, out_refs = refs[:n_in], refs[n_in : n_in + n_bounds], refs[n_in + n_bounds :]
    offsets = {a: _tile_id(pl.program_id(i), a, p, padded, flip) * g for i, (a, g) in enumerate(p.tiles.items())}
    program = pl.program_id(len(p.tiles))
    strides = _strides(p, padded)
    grid = {a: _batch_index(program, a, strides, padded) for a in p.batch}
    ctx = BlockContext(sizes=sizes, offsets=offsets, xp=xp, grid=grid)
    if p.stream is None:
        outs = walk(d, [r[...] for r in in_refs], ctx, "", "final", {})
        for r, v in zip(out_refs, outs, strict=True):
            r[...] = v.astype(r.dtype)
        return
    x, s = p.stream
    carried = [w.has(x) for w in d.dom.inside]
    # an input laid out otherwise than the kernel's wire (tiled_first): its block transposed as it loads
    perms = [
        None if a.names == w.names else [a.names.index(n) for n in w.names]
        for a, w in zip(laid, d.dom.inside, strict=True)
    ]
    resident = [None if c else r[...] for r, c in zip(in_refs, carried, strict=True)]

    def chunk_values(c):
        vals = []
        for r, w, v, perm in zip(in_refs, laid, resident, perms, strict=True):
            if v is None:
                pos = w.names.index(x)
                v = r[tuple(pl.ds(c * s, s) if i == pos else slice(None) for i in range(len(w.axes)))]
                v = v if perm is None else jnp.transpose(v, perm)
            vals.append(v)
        return vals

    # the ragged last chunk's padding: each accumulator's inputs set to values its side condition checked neutral
    pads = {id(d.inside[i][1]): v for i, v in neutral_padding(d, x).items()} if extent[x] != padded[x] else {}

    def fold(acc, state, ins, cctx):
        if id(acc.box) in pads:
            ins = [
                _mask_padding(v, w, x, cctx.offsets[x], extent[x], pad) if w.has(x) else v
                for v, w, pad in zip(ins, acc.box.dom.inside, pads[id(acc.box)], strict=True)
            ]
        return acc.step(state, ins, cctx)

    # affine masks reading the streamed axis, and segment masks (their bounds come from the wrapper): the
    # chunks they hide are skipped, those they all keep whole run without them
    masks = {id(b): m for b in d.boxes if (m := affine_mask(b)) is not None and x in m.axes}
    segs = segments(d, p)
    assert 4 * len(segs) == n_bounds, "the wrapper and the kernel see different segment masks"
    hidden = set(masks) | {id(m.box) for m in segs}
    zero = zeroing_mask(d, x)  # a mask on the tiles that zeroes every accumulator's input: hidden tiles run no chunk
    zero = zero if zero is not None and set(zero.axes) <= set(p.tiles) else None

    # The accumulators' states start at their identity, shaped by one abstract chunk.
    def probe(*vals):
        shapes: dict = {}
        walk(d, list(vals), ctx.at(**{x: 0}), x, "chunk", shapes, fold=lambda acc, st, ins, c: acc.partial(ins, c))
        return shapes

    def block_shape(w):
        return tuple(s if a.name == x else p.tiles.get(a.name, padded[a.name]) for a in w.axes)

    like = jax.eval_shape(probe, *(jax.ShapeDtypeStruct(block_shape(w), w.dtype.jnp) for w in d.dom.inside))
    keys = sorted(like)
    init = tuple(d.inside[i][1].accumulator(x).identity(like[i], ctx) for i in keys)

    def body(unmasked):
        def run(c, carry):
            states = dict(zip(keys, carry, strict=True))
            walk(
                d,
                chunk_values(c),
                ctx.at(**{x: c * s}),
                x,
                "chunk",
                states,
                fold=fold,
                skip=lambda box: unmasked and id(box) in hidden,
            )
            return tuple(states[i] for i in keys)

        return run

    n_chunks = padded[x] // s
    if hidden:
        ranges = {a: (offsets[a], jnp.minimum(offsets[a] + g, extent[a])) for a, g in p.tiles.items()}
        ranges |= {a: (grid[a], grid[a] + 1) for a in p.batch} | {a: (0, extent[a]) for a in p.whole}
        bounds = _visited(masks.values(), x, s, n_chunks, ranges, extent[x])
        for i in range(0, n_bounds, 4):
            bounds = _combine(bounds, tuple(r[()] for r in bound_refs[i : i + 4]))
        if zero is not None:
            kept = _tile_kept(zero, p, offsets, extent)
            bounds = tuple(v * kept for v in bounds)
        first, full_lo, full_hi, last = bounds
        carry = lax.fori_loop(first, full_lo, body(False), init)
        carry = lax.fori_loop(full_lo, full_hi, body(True), carry)
        carry = lax.fori_loop(full_hi, last, body(False), carry)
    else:
        if zero is None:
            carry = lax.fori_loop(0, n_chunks, body(False), init)
        else:
            carry = lax.fori_loop(0, n_chunks * _tile_kept(zero, p, offsets, extent), body(False), init)
    states = dict(zip(keys, carry, strict=True))
    final = [None if c else v for v, c in zip(resident, carried, strict=True)]
    outs = walk(d, final, ctx, x, "final", states)
    for r, v in zip(out_refs, outs, strict=True):
        r[...] = v.astype(r.dtype)


def _mask_padding(v, wire, x, start, length, pad):
    idx = lax.broadcasted_iota(jnp.int32, v.shape, wire.names.index(x)) + start
    return jnp.where(idx < length, v, jnp.asarray(pad, v.dtype))
