"""The arrays of a Mosaic GPU consumer warpgroup (:class:`MosaicArrays`, ``ctx.xp``): register arrays, operands
resident in shared memory (:class:`Smem`), and contractions issued as ``wgmma`` (:class:`Product`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lowering._plan import NotLowerable
from napkin_cat.generators import JAX, Later, Unvectorised, Vector, on_blocks, on_vectors


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

        if acc is None or not self.xp.in_place:
            fresh = pl.run_scoped(lambda r: (mma(r), r[...])[1], plgpu.ACC(self.shape, jnp.float32))
            return fresh if acc is None else acc + fresh
        return pl.run_state(mma)(plgpu.ACC.init(acc))

    def value(self):
        return self.into(None)

    def __add__(self, other):
        return self.into(value_of(other)) if not isinstance(other, int | float) else self.value() + other

    __radd__ = __add__

    def __mul__(self, other):
        return self.value() * value_of(other)

    __rmul__ = __mul__

    def __sub__(self, other):
        return self.value() - value_of(other)

    def __rsub__(self, other):
        return value_of(other) - self.value()

    def __truediv__(self, other):
        return self.value() / value_of(other)

    def __neg__(self):
        return -self.value()


class Transposed:
    """A register A operand laid out contraction × rows: wgmma reads it transposed from the staging buffer it is
    written to (16-bit operands in shared memory may be read either way)."""

    def __init__(self, value):
        self.value = value
        self.shape = tuple(reversed(jnp.shape(value_of(value))))


def value_of(v):
    return v.value() if isinstance(v, Smem | Product) else v


def _indexed(fn, v, indices: dict, spread, shape: tuple):
    """``fn(v, **indices)`` (``v`` None: ``fn(**indices)``) over a block of ``shape``, the indices :class:`Vector` s
    of its rows or columns: run on them (:func:`on_vectors`), or, where the function does what vectors do not keep (a
    scan, a gather), on whole index grids (:func:`on_blocks`); an index it does not read is never made."""
    names, args = list(indices), ([] if v is None else [v]) + list(indices.values())

    def call(*xs):
        return fn(*xs[: len(xs) - len(names)], **dict(zip(names, xs[len(xs) - len(names) :], strict=True)))

    if not any(isinstance(i, Vector) for i in indices.values()):  # no index of the block (a soft-cap): as written
        return call(*(a.value if isinstance(a, Vector) else a for a in args))
    try:
        return on_vectors(call, args, spread, shape)
    except Unvectorised:
        return on_blocks(call, args, spread, shape)


class MosaicArrays:
    """``ctx.xp`` inside a Mosaic GPU consumer warpgroup: :data:`~napkin_cat.generators.JAX` on register
    arrays, with contractions as ``wgmma`` and index grids in the wgmma register layout.

    ``staging`` (when given) is a shared-memory buffer a register A operand is written to first: every one where
    ``every`` (interpret mode; compiled, an FP8 one: :attr:`MosaicLowered.staged`), else only one laid out
    contraction × rows, read back transposed (the fused backward's dQ = dSᵀ·K, dS held as [keys, queries]);
    ``in_place`` whether a product accumulates in the wgmma (compiled) or is added after it (interpret mode); ``turn``
    (when given) the ping-pong barrier passed around each chunk's matrix products, ``issued`` of which are counted per
    chunk: an mbarrier in interpret mode, compiled a function that passes a named one.
    """

    def __init__(self, staging=None, turn=None, in_place=False, every=True):
        self.staging, self.turn, self.issued, self.in_place, self.every = staging, turn, 0, in_place, every

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
        return lambda *xs, **kw: f(*(value_of(v) for v in xs), **kw)

    def einsum(self, spec: str, *xs):
        """``wgmma`` for a 2-operand, 2-D contraction over one axis whose B operand is in shared memory."""
        ins, out = spec.split("->")
        terms = ins.split(",")
        if len(terms) == 1 and all(a in terms[0] for a in out) and sorted(out, key=terms[0].index) == list(out):
            # a sum of one array over the axes it drops (a sink's Σ_d dO·O folded): on registers
            v, gone = self.f32(value_of(xs[0])), tuple(i for i, a in enumerate(terms[0]) if a not in out)
            return self.sum(v, gone) if gone else v
        if len(terms) == 2 and terms[0] == terms[1] and len(terms[0]) == 2 and out in (terms[0][0], terms[0][1]):
            # a row-wise inner product (Δ = Σ_d dO ⊙ O): on registers, no tensor cores
            a, b = (self.f32(value_of(v)) for v in xs)
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
            if self.staging is None:
                raise NotLowerable(
                    f"einsum {spec!r}: a register A operand must be laid out rows × contraction (a transposed one "
                    "is staged through shared memory only where the kernel holds a staging buffer)"
                )
            va = Transposed(va)
        if _fp8(vb) and (tb != out[1] + k or (isinstance(va, Smem) and ta != out[0] + k)):
            raise NotLowerable(
                f"einsum {spec!r}: FP8 wgmma reads both operands K-major (the contracted axis {k!r} innermost); "
                f"lay B out [{out[1]}, {k}] and A [{out[0]}, {k}] (FP8 attention's V as [..., d, x]: the entry "
                "transposes it)"
            )
        if isinstance(va, Smem) and ta != out[0] + k:
            va = Smem(va.ready().transpose((1, 0)))
        if tb != k + out[1]:
            vb = Smem(vb.ready().transpose((1, 0)))
        m, n = va.shape[0] if isinstance(va, Smem | Transposed) else jnp.shape(va)[0], vb.shape[1]
        return Product(self, va, vb, (m, n))

    def operand_a(self, a, dtype):
        """wgmma's A operand: a shared-memory ref, or a register array in ``dtype`` (directly, or through
        ``staging``)."""
        if isinstance(a, Smem):
            return a.ready()
        transposed = isinstance(a, Transposed)
        a = value_of(a.value if transposed else a)
        if jnp.dtype(dtype).itemsize == 1 and not (self.staging is not None and (self.every or transposed)):
            return fp8_operand(a, dtype)  # the keys interleaved: the wrapper lays V's out alike (interleave_keys)
        a = a.astype(dtype)  # the operands meet in B's type (FA2 casts P to V's; FP8 rounds P to e4m3 here)
        if self.staging is None or not (self.every or transposed):
            return a
        if tuple(a.shape) != tuple(self.staging.shape):
            raise NotLowerable(
                f"a register A operand is staged through a {self.staging.shape} buffer, got {a.shape}"
            )
        self.staging[...] = a.astype(self.staging.dtype)
        plgpu.commit_smem()  # the register writes made visible to the wgmma reading them
        return self.staging.transpose((1, 0)) if transposed else self.staging

    @staticmethod
    def shape(v) -> tuple:
        """The shape of a register array or of a shared-memory operand."""
        return tuple(v.shape)

    @staticmethod
    def like(v, other):
        """``v`` in the dtype of ``other`` (read off a shared-memory operand without loading it)."""
        v = value_of(v)
        return v.astype(other.dtype) if other.dtype != jnp.float32 else v

    def index_map(self, fn, v, indices: dict):
        """``fn(v, **indices)`` on a block ``v`` (in wgmma's accumulator layout) and index vectors (:meth:`iota`)."""
        v = value_of(v)
        return _indexed(fn, Vector(v, (0, 1), tuple(v.shape)), indices, self.broadcast_in_dim, tuple(v.shape))

    def index_mask(self, keep, indices: dict, shape: tuple):
        """``keep(**indices)`` over a block of ``shape``, on index vectors (:meth:`iota`), spread over the block
        where it mixes its axes."""
        return _indexed(keep, None, indices, self.broadcast_in_dim, tuple(shape))

    @staticmethod
    def iota(shape: tuple, axis: int):
        """Index grids in the layout of wgmma's accumulator (rows, columns), or of its row statistics; an index
        vector (a block's ``shape`` of size 1 but along ``axis``, which a register array cannot have) as a
        :class:`~napkin_cat.generators.Vector` of the block's rows or columns (:meth:`iota_over`)."""
        if len(shape) == 2 and shape[1 - axis] == 1 < shape[axis]:  # made where read: Mosaic GPU finds no layout
            # for an iota nothing reads
            later = Later(lambda: MosaicArrays.iota_over(shape, (axis,), axis), jnp.int32)
            return Vector(later, (axis,), tuple(shape))
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.broadcasted_iota(jnp.int32, shape, axis, layout=layout)

    @staticmethod
    def iota_over(shape: tuple, dims: tuple, axis: int):
        """A block's rows (or columns) alone: index vectors in the layout of its row (column) statistics, which
        ``broadcast_in_dim`` spreads back into wgmma's accumulator layout."""
        if len(shape) == 2 and len(dims) == 1:
            return plgpu.broadcasted_iota(jnp.int32, (shape[axis],), 0, layout=plgpu.Layout.WGMMA.reduce(1 - axis))
        return MosaicArrays.iota(tuple(shape[d] for d in dims), dims.index(axis))

    @staticmethod
    def full(shape: tuple, value):
        """A constant in the accumulator's layout (loop-carried states must keep one layout)."""
        layout = plgpu.Layout.WGMMA if len(shape) == 2 else plgpu.Layout.WGMMA.reduce(1)
        return plgpu.layout_cast(jnp.full(shape, value, jnp.float32), layout)


#: FP8 P·V with P in registers (FlashAttention-3's trick). In wgmma's f32 accumulator layout a thread holds, of
#: each 16 columns of a row, columns 2t, 2t+1, 8+2t, 9+2t (t = lane mod 4); in its 8-bit A operand layout, columns
#: 4t … 4t+3. Read as an A operand as they lie, P's columns come in this order: position 4t + j of each 16 holds
#: key ``KEY_ORDER[4t + j]``. A contraction is unchanged by one permutation of its axis on both sides, so the
#: wrapper lays the FP8 V's keys out in the same order (``interleave_keys``) and no byte moves between threads.
KEY_ORDER = np.array([k for t in range(4) for k in (2 * t, 2 * t + 1, 8 + 2 * t, 9 + 2 * t)])


def interleave_keys(v, axis: int = -1):
    """``v`` with each 16 consecutive keys along ``axis`` in :data:`KEY_ORDER`: an FP8 V whose keys meet P in
    registers (its extent a multiple of 16; the kernel's chunks are of 64).

    >>> import jax.numpy as jnp
    >>> interleave_keys(jnp.arange(16)).tolist()
    [0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15]
    """
    # key 8a + 2t + j of each 16 goes to position 4t + 2a + j: a swap of two axes, a transpose XLA fuses with the
    # entry's own of V (a gather there read V strided: 0.15 ms at 32 MiB on an H200)
    axis, shape = axis % v.ndim, v.shape
    split = v.reshape(*shape[:axis], shape[axis] // 16, 2, 4, 2, *shape[axis + 1 :])
    return jnp.swapaxes(split, axis + 1, axis + 2).reshape(shape)


def pairs_of(i: tuple) -> tuple:
    """The two registers of wgmma's accumulator layout (8-column tiles, two values each) that make register ``i`` of
    its 8-bit layout (16-column tiles, four each), in order: the same rows, column tiles ``2c`` and ``2c + 1``.

    >>> pairs_of((0, 3, 0, 0, 1, 0, 0, 0, 0))
    ((0, 6, 0, 0, 1, 0, 0, 0, 0), (0, 7, 0, 0, 1, 0, 0, 0, 0))
    """
    return (i[0], 2 * i[1], *i[2:]), (i[0], 2 * i[1] + 1, *i[2:])


def fp8_operand(p, dtype):
    """``p`` (f32, wgmma's accumulator layout) rounded to ``dtype`` (8-bit) and read, without moving, as wgmma's 8-bit
    A operand: each thread's two pairs of each 16 columns become its four (:data:`KEY_ORDER`). jax 0.11.2's Mosaic
    GPU has no relayout between the two layouts; written at the level of its registers (``plgpu.inline_mgpu``), which
    interpret mode does not run (it stages P through shared memory instead)."""
    import jax.experimental.mosaic.gpu as mgpu
    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jax.experimental.mosaic.gpu import utils

    shape = tuple(p.shape)

    @plgpu.inline_mgpu(
        arg_types=(plgpu.Layout.WGMMA,),
        return_type=plgpu.ShapeDtypeStruct(shape, dtype, layout=plgpu.Layout.WGMMA_8BIT),
    )
    def reread(_, acc):
        pairs = acc.astype(utils.dtype_to_ir_type(jnp.dtype(dtype))).registers  # [row tiles, 8-column tiles, …]
        quads = np.empty(fa.WGMMA_LAYOUT_8BIT.registers_shape(shape), dtype=object)  # [row tiles, 16-col tiles, …]
        for i in np.ndindex(quads.shape):
            quads[i] = utils.vector_concat([pairs[j] for j in pairs_of(i)])
        return mgpu.FragmentedArray(_registers=quads, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None)

    return reread(p)


def _fp8(v) -> bool:
    """Whether a shared-memory operand is 8-bit (FP8 e4m3 or e5m2)."""
    return jnp.dtype(v.dtype).itemsize == 1


def _wgmma(spec: str) -> bool:
    """A contraction :meth:`MosaicArrays.einsum` issues as one ``wgmma`` (two 2-D operands, a 2-D product)."""
    ins, out = spec.split("->")
    terms = ins.split(",")
    return len(terms) == 2 and len(out) == 2 and all(len(t) == 2 for t in terms) and terms[0] != terms[1]


class Counting(type(JAX)):
    """:data:`~napkin_cat.generators.JAX`, counting the contractions a chunk issues as ``wgmma``: the ping-pong
    turns a consumer takes for a chunk it only observes."""

    def __init__(self):
        self.wgmma = 0

    def einsum(self, spec: str, *xs):
        self.wgmma += _wgmma(spec)
        return super().einsum(spec, *xs)
