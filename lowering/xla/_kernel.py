"""The XLA backend: a scheduled diagram becomes plain JAX (no Pallas), compiled by XLA on any device.

The plan (:mod:`lowering._plan`) reads the same as for the Pallas backends: each tiled axis is split into
blocks of ``g`` and every block runs at once (``jax.vmap`` over the blocks, and over the batch axes); the
streamed axis becomes a ``lax.fori_loop`` over chunks of ``s`` folding the accumulators (FAN §3), so a
block never holds more than one chunk of the streamed axis; an output that carries the streamed axis
(computed from chunks alone, as :func:`rewrites.streamability` allows) is a buffer the loop carries, each
chunk's slice written into it once (``lax.dynamic_update_slice``, which XLA does in place); each block's body
is the scheduled interpreter :func:`rewrites.walk`, as in the Pallas kernels. Sizes the blocks do not divide: a
tiled axis is padded with
zeros (no box combines elements along it, so its padding rows reach only themselves, and are sliced off);
the streamed axis ends on a shorter chunk (exact, as :func:`rewrites.execute`: no neutral value needed); an
axis kept whole is never padded.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> from lowering import plan
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False)
>>> kernel = XlaLowered(plan(flash.diagram))
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (40, 8)) for i in range(3))
>>> bool(jnp.allclose(kernel(Q, K, V), nc.to_jax(flash.diagram)(Q, K, V), atol=1e-5))
True
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from lowering._blocks import BlockContext
from lowering._plan import NotLowerable, Plan, unweave
from lowering._spmd import varying_like
from napkin_cat.diagram import Diagram, is_structural
from napkin_cat.generators import Jax
from napkin_cat.hardware import H100, Hardware
from napkin_cat.semantics import bind
from rewrites import walk


@dataclass(frozen=True)
class XlaConfig:
    """Tuning knobs of the XLA backend (blocks come from the diagram's labels): ``unroll`` chunks of the
    streamed loop per iteration of its ``lax.fori_loop`` (an integer ≥ 1), ``chunks``, the chunk each
    derived backward kernel streams an axis in, by the axis's name (``(("n", 1024), ("v", 8192))``; an axis
    not named keeps the block policy's, Triton's), and ``one_pass``: the derived backward computes every
    cotangent that holds the forward's streamed axis in the kernel streaming it, beside those it accumulates,
    its tiled axes kept whole (:func:`lowering._backward.backward_of`'s ``one_pass``: a classifier's ``dW``
    written chunk by chunk beside ``dh``, the logits recomputed once, not twice). XLA's blocks are arrays in HBM,
    not shared memory, so a caller that knows the sizes sizes them by memory
    (``lowering._cross_entropy.xla_blocks``); all checked when made.

    >>> XlaConfig(unroll=2)
    XlaConfig(unroll=2, chunks=(), one_pass=False)
    >>> XlaConfig(unroll=0)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: XlaConfig: unroll must be an integer ≥ 1, got 0
    >>> XlaConfig(chunks=(("v", 0),))
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: XlaConfig: chunks must be (axis name, size ≥ 1) pairs, got (('v', 0),)
    """

    unroll: int = 1
    chunks: tuple[tuple[str, int], ...] = ()
    one_pass: bool = False

    def __post_init__(self):
        if not isinstance(self.unroll, int) or isinstance(self.unroll, bool) or self.unroll < 1:
            raise NotLowerable(f"XlaConfig: unroll must be an integer ≥ 1, got {self.unroll!r}")
        pairs = isinstance(self.chunks, tuple) and all(
            isinstance(c, tuple) and len(c) == 2 and isinstance(c[0], str) and type(c[1]) is int and c[1] >= 1
            for c in self.chunks
        )
        if not pairs:
            raise NotLowerable(f"XlaConfig: chunks must be (axis name, size ≥ 1) pairs, got {self.chunks!r}")
        if not isinstance(self.one_pass, bool):
            raise NotLowerable(f"XlaConfig: one_pass must be a bool, got {self.one_pass!r}")

    @classmethod
    def get_default(cls, p: Plan) -> XlaConfig:
        """One chunk per iteration: XLA fuses each chunk's body; unrolling trades compile time for little.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> XlaConfig.get_default(plan(derive(nc.library.attention(q, x, d), tile(q, 16), verify=False).diagram))
        XlaConfig(unroll=1, chunks=(), one_pass=False)
        """
        return cls()


def narrowed(xs: tuple) -> tuple:
    """A contraction's operands in one dtype: where a 16-bit operand meets an f32 one, the f32 one rounded to the
    16-bit dtype, as the Triton and Mosaic kernels multiply them (FlashAttention-2 casts ``P`` to ``V``'s dtype).

    >>> a, b = jnp.ones(2, jnp.bfloat16), jnp.full(2, 1 + 2**-12, jnp.float32)
    >>> [str(v.dtype) for v in narrowed((a, b))], float(narrowed((a, b))[1][0])
    (['bfloat16', 'bfloat16'], 1.0)
    """
    narrow = [v.dtype for v in xs if jnp.dtype(v.dtype).itemsize == 2]
    if not narrow or len(set(narrow)) > 1:
        return xs
    return tuple(v.astype(narrow[0]) if v.dtype == jnp.float32 else v for v in xs)


class Narrow(Jax):
    """The XLA backend's array namespace on a GPU: the reference's (:class:`napkin_cat.generators.Jax`), but a
    contraction of a 16-bit and an f32 operand multiplies in the 16-bit dtype (:func:`narrowed`), accumulated in
    f32, as the Pallas kernels do. Promoted instead, a derived backward's ``dS·K`` (f32 ``dS``) would run as an
    f32 matmul, several times slower than the 16-bit one on a GPU's tensor cores.

    >>> a, p = jnp.ones((4, 4), jnp.bfloat16), jnp.full((4, 4), 1 + 2**-12, jnp.float32)
    >>> float(Narrow.einsum("ik,kj->ij", p, a)[0, 0]), float(Jax.einsum("ik,kj->ij", p, a)[0, 0])
    (4.0, 4.0009765625)
    """

    @staticmethod
    def einsum(spec: str, *xs):
        """A contraction accumulated in f32, its operands :func:`narrowed`."""
        return Jax.einsum(spec, *narrowed(xs))


class Upcast(Narrow):
    """The XLA backend's array namespace on a CPU: :class:`Narrow`'s, but a contraction of 16-bit operands
    multiplies them upcast to f32: the same products (exact in f32) summed in f32, which XLA's CPU backend runs as
    an f32 matmul where a 16-bit dot with an f32 result takes several times longer.

    >>> a = jnp.full((4, 4), 1 + 2**-7, jnp.bfloat16)
    >>> up, gpu = Upcast.einsum("ik,kj->ij", a, a), Narrow.einsum("ik,kj->ij", a, a)
    >>> up.dtype, bool(up[0, 0] == gpu[0, 0])
    (dtype('float32'), True)
    """

    @staticmethod
    def einsum(spec: str, *xs):
        """A contraction in f32, its operands :func:`narrowed`, then the 16-bit ones upcast."""
        xs = narrowed(xs)
        return jnp.einsum(spec, *(v.astype(jnp.float32) if jnp.dtype(v.dtype).itemsize == 2 else v for v in xs))


class XlaLowered:
    """A scheduled diagram as one jitted JAX function (see the module): call it with arrays in the diagram's
    axis order. ``hardware`` is the model the derived backward's blocks are fitted to
    (:func:`lowering._backward.backward_of`): H100's, with no bound on a block's shared memory, which XLA's
    blocks (arrays) do not live in (a classifier's head dim of 4096 fits no GPU block even at 16 rows).

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> a, b, c = nc.axes("a b c")
    >>> kernel = XlaLowered(plan(derive(nc.library.matmul(a, b, c), tile(a, 16), stream(b, 16), verify=False).diagram))
    >>> A, B = jax.random.normal(jax.random.key(0), (20, 24)), jax.random.normal(jax.random.key(1), (24, 8))
    >>> bool(jnp.allclose(kernel(A, B), A @ B, atol=1e-5)), kernel.backend
    (True, 'xla')
    """

    #: what ``lower``'s ``kernel.backends`` reports
    backend = "xla"

    def __init__(self, p: Plan, *, config: XlaConfig | None = None, hardware: Hardware | None = None):
        self.plan, self.config = p, config or XlaConfig.get_default(p)
        self.hardware = dataclasses.replace(H100 if hardware is None else hardware, smem_per_block=sys.maxsize)
        self.interpret = None  # no interpret mode: XLA compiles it for whatever device runs it
        self.__name__ = "napkin_xla_kernel"
        self._run = jax.jit(self._apply, static_argnames="pm")

    def __call__(self, *arrays, pages=None):
        """The function on ``arrays``; with ``pages`` = ``(page_map, table)`` (:class:`lowering._paged.PageMap`)
        the inputs it names are page pools, each streamed chunk gathered through ``table`` in the loop."""
        pm, table = pages if pages is not None else (None, None)
        outs = self._run(*arrays, pm=pm, table=table)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _apply(self, *arrays, pm=None, table=None) -> list:
        p, d = self.plan, self.plan.diagram
        arrays, wires = [jnp.asarray(a) for a in arrays], d.dom.inside
        pools = () if pm is None else pm.inputs
        sizes = bind(d.dom, arrays if pm is None else pm.contiguous(p, wires, arrays, table))
        extent = {a.name: int(a.size.subs(sizes)) for w in wires for a in w.axes}
        grid = (*p.tiles, *p.batch)
        count = {a: -(-extent[a] // g) for a, g in p.tiles.items()} | {b: extent[b] for b in p.batch}
        body = functools.partial(_block, p, unweave(d, p.batch), sizes, extent, self.config, pm)
        names = [pm.pool_axes(w) if i in pools else w.names for i, w in enumerate(wires)]
        names += [(*pm.batch, "pages")] if pm is not None else []  # the table, last
        fn = lambda ids, *blocks: body(ids, blocks)  # noqa: E731
        for k in reversed(range(len(grid))):  # the outermost vmap maps the first grid axis
            ids = tuple(0 if j == k else None for j in range(len(grid)))
            fn = jax.vmap(fn, in_axes=(ids, *(0 if grid[k] in n else None for n in names)))
        ids = tuple(jnp.arange(count[a]) for a in grid)
        blocks = [
            _lead(v, names[i], grid) if i in pools else _split(v, w, p, count, grid)
            for i, (v, w) in enumerate(zip(arrays, wires, strict=True))
        ]
        outs = fn(ids, *blocks, *([_lead(table, names[-1], grid)] if pm is not None else []))
        return [
            _join(o, w, p, extent, grid, p.summed.get(k, ()))
            for k, (o, w) in enumerate(zip(outs, d.cod.inside, strict=True))
        ]

    @property
    def source(self) -> str:
        """What the function runs: the blocks mapped over, the loop and its accumulators, the body.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> b, q, x, d = nc.axes("b q x d")
        >>> flash = derive(nc.library.attention(q, x, d, batch=(b,)), tile(q, 16), stream(x, 16), verify=False)
        >>> print(XlaLowered(plan(flash.diagram)).source)  # doctest: +ELLIPSIS
        jax.jit napkin_xla_kernel  (XLA backend)
          vmap over: q in blocks of 16, b
          loop: fori_loop over chunks of x (size 16, unroll 1), carrying:
            OnlineSoftmax of 'softmax·contract x'
          body (per block): rewrites.walk of q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d
        """
        p = self.plan
        body = unweave(p.diagram, p.batch)
        mapped = [f"{a} in blocks of {g}" for a, g in p.tiles.items()] + list(p.batch)
        lines = ["jax.jit napkin_xla_kernel  (XLA backend)", f"  vmap over: {', '.join(mapped) or 'nothing'}"]
        if p.stream:
            x, s = p.stream
            lines.append(f"  loop: fori_loop over chunks of {x} (size {s}, unroll {self.config.unroll}), carrying:")
            accs = [b for b in body.boxes if not is_structural(b) and b.accumulator(x)]
            lines += [f"    {type(b.accumulator(x)).__name__} of {b.name!r}" for b in accs]
            lines += [f"    output {k} ({body.cod.inside[k].describe()}), a slice written per chunk" for k in p.written]
        lines += [f"  output {k}: the blocks' partial sums added over {', '.join(a)}" for k, a in p.summed.items()]
        lines.append(f"  body (per block): rewrites.walk of {body.dom} → {body.cod}")
        return "\n".join(lines)


def _split(v, wire, p: Plan, count: dict, grid: tuple):
    """An input laid out for the vmaps: the grid axes it holds first (tiled ones padded to whole blocks and
    split into a block index and ``g``), in ``grid``'s order, then its block's axes in the wire's order."""
    shape, lead, block = [], [], []
    for i, a in enumerate(wire.axes):
        if a.name in p.tiles:
            g = p.tiles[a.name]
            v = jnp.pad(v, [(0, count[a.name] * g - v.shape[i]) if j == i else (0, 0) for j in range(v.ndim)])
            shape += [count[a.name], g]
            lead.append((grid.index(a.name), len(shape) - 2))
            block.append(len(shape) - 1)
        else:
            shape.append(v.shape[i])
            (lead.append((grid.index(a.name), len(shape) - 1)) if a.name in p.batch else block.append(len(shape) - 1))
    return jnp.transpose(v.reshape(shape), [j for _, j in sorted(lead)] + block)


def _lead(v, names, grid: tuple):
    """An untiled input (a page pool, a page table; its axes ``names``) laid out for the vmaps: the grid axes it
    holds first, in ``grid``'s order, then the others in their order."""
    lead = [names.index(a) for a in grid if a in names]
    return jnp.transpose(v, lead + [j for j in range(v.ndim) if j not in lead])


def _join(o, wire, p: Plan, extent: dict, grid: tuple, summed: tuple = ()):
    """An output from the vmaps' layout (every grid axis first, then its block) to the wire's, sliced to size; the
    blocks' partial sums added along the tiled axes it is ``summed`` over (:attr:`Plan.summed`: a zero-padded
    tile adds nothing, for a contraction with a padded input is zero there)."""
    if summed:
        o = jnp.sum(o, axis=tuple(grid.index(a) for a in summed))
        grid = tuple(a for a in grid if a not in summed)
    o = o[tuple(slice(None) if wire.has(a) else 0 for a in grid)]  # an output lacking a grid axis is one value
    kept = [a for a in grid if wire.has(a)]
    block = [a.name for a in wire.axes if a.name not in p.batch]
    order, shape = [], []
    for a in wire.axes:
        if a.name in p.batch:
            order.append(kept.index(a.name))
        elif a.name in p.tiles:  # block index, then position in the block: one axis once merged
            order += [kept.index(a.name), len(kept) + block.index(a.name)]
        else:
            order.append(len(kept) + block.index(a.name))
        shape.append(-1)
    o = jnp.transpose(o, order)
    merged, i = [], 0
    for a in wire.axes:
        n = 2 if a.name in p.tiles else 1
        merged.append(o.shape[i] * (o.shape[i + 1] if n == 2 else 1))
        i += n
    return o.reshape(merged)[tuple(slice(0, extent[a.name]) for a in wire.axes)].astype(wire.dtype.jnp)


def _window(pool, page, offset, size: int):
    """Keys ``offset … offset + size`` of page ``page`` of a pool block (a chunk within one page)."""
    return lax.dynamic_slice_in_dim(pool[page], offset, size, 0)


def _block(p: Plan, d: Diagram, sizes: dict, extent: dict, config: XlaConfig, pm, ids: tuple, blocks: tuple) -> list:
    """One block's outputs: ``d`` (the per-block diagram) run by :func:`rewrites.walk`, its streamed axis a loop
    over chunks (a last, shorter chunk where ``s`` does not divide it) folding each accumulator from its identity;
    with a page map ``pm``, a pool's chunk is its pages the table's row (the last block) names, gathered."""
    if pm is not None:
        *blocks, row = blocks
    offsets = {a: ids[i] * g for i, (a, g) in enumerate(p.tiles.items())}
    grid = dict(zip(p.batch, ids[len(p.tiles) :], strict=True))
    xp = Upcast() if jax.default_backend() == "cpu" else Narrow()  # elsewhere 16-bit dots with f32 results are native
    ctx = BlockContext(sizes=sizes, offsets=offsets, xp=xp, grid=grid)
    if p.stream is None:
        return walk(d, list(blocks), ctx, "", "final", {})
    x, s = p.stream
    wires = d.dom.inside

    def chunk(start, size):
        return [
            pm.load(
                v, lambda j, m=None: row[j] if m is None else lax.dynamic_slice_in_dim(row, j, m), _window, start, size
            )
            if pm is not None and i in pm.inputs
            else lax.dynamic_slice_in_dim(v, start, size, w.names.index(x))
            if w.has(x)
            else v
            for i, (v, w) in enumerate(zip(blocks, wires, strict=True))
        ]

    def fold(acc, state, ins, c):
        return acc.step(state, ins, c)

    written = p.written  # outputs along x: a slice per chunk

    def probe(*vals):  # the accumulators' states and the written outputs' slices, shaped by one abstract chunk
        shapes: dict = {}
        part = lambda acc, st, ins, c: acc.partial(ins, c)  # noqa: E731
        outs = walk(d, list(vals), ctx.at(**{x: 0}), x, "chunk", shapes, fold=part)
        return shapes, [outs[k] for k in written]

    n_full, rest = divmod(extent[x], s)
    like, slices = jax.eval_shape(probe, *chunk(0, s if n_full else rest))
    states = {i: d.inside[i][1].accumulator(x).identity(like[i], ctx) for i in like}
    at = [d.cod.inside[k].names.index(x) for k in written]  # where x lies in each written output
    buffers = [
        jnp.zeros(tuple(extent[x] if j == a else n for j, n in enumerate(o.shape)), o.dtype)
        for o, a in zip(slices, at, strict=True)
    ]
    carry = varying_like((states, buffers), blocks)

    def step(start, size, carry):
        states, buffers = dict(carry[0]), carry[1]
        outs = walk(d, chunk(start, size), ctx.at(**{x: start}), x, "chunk", states, fold=fold)
        put = lax.dynamic_update_slice_in_dim
        return states, [put(b, outs[k], start, a) for b, k, a in zip(buffers, written, at, strict=True)]

    if n_full:  # (a loop of none would still trace its body, on a chunk longer than the axis)
        carry = lax.fori_loop(0, n_full, lambda c, carry: step(c * s, s, carry), carry, unroll=config.unroll)
    if rest:  # the last chunk, shorter: exact, no padding
        carry = step(n_full * s, rest, carry)
    states, buffers = carry
    outs = walk(d, [None if w.has(x) else v for v, w in zip(blocks, wires, strict=True)], ctx, x, "final", states)
    for k, b in zip(written, buffers, strict=True):
        outs[k] = b
    return outs
