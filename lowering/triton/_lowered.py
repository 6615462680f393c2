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
An array short only along tiled axes and not streamed (a decode step's few query rows) is not padded: its
last tile is loaded masked (zeros past its end, as the padding held) and an output is stored masked, so no
copy runs before or after the kernel. A length mask's positions (an ``arange`` along the stream) are made in
the program, not read.
Both are the rule :class:`rewrites.pad_neutral`, whose side condition evaluates each box on its padding
and refuses (naming the box, its functions' values and the fix) where no value is neutral. The rewrites
of the block diagram are rules too, applied in order (:func:`kernel_rules`, ``TritonLowered.steps``).
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

import rewrites
from lowering._blocks import CallBlocks, call_blocks, heavy_last, made_positions, segments
from lowering._fp8 import no_fp8_dot
from lowering._plan import NotLowerable, Plan, next_pow2, smem_bytes
from lowering._source import describe
from lowering._sparsity import Sparsity, sparsity
from lowering._spmd import out_structs
from lowering._target import interpreted, target_hardware
from lowering.triton._config import TritonConfig
from lowering.triton._kernel import _batch_index, _kernel, _strides, _tile_id, short_tiles
from lowering.triton._kernel import kernel_rules as kernel_rules
from lowering.triton._namespace import Blocks, native_tanh, native_trig, operand_dtype
from napkin_cat.diagram import Diagram
from napkin_cat.hardware import Hardware
from napkin_cat.semantics import bind
from rewrites import RewriteError, Rule


def launch(p: Plan, extent: dict, config: TritonConfig, hardware: Hardware) -> dict:
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
    >>> from napkin_cat.hardware import H100
    >>> launch(p, {"q": 40, "x": 40, "d": 64}, TritonConfig(), H100)
    {'q': 128, 'x': 128, 'd': 64}
    >>> launch(p, {"q": 40, "x": 40, "d": 512}, TritonConfig(), H100)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: the kernel would hold 1,835,008 B of shared memory ... over the 232,448 B ...
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


class TritonLowered:
    """A kernel for a scheduled diagram: call it with arrays in the diagram's axis order.

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> from lowering import plan
    >>> a, b, c = nc.axes("a b c")
    >>> mm = nc.library.matmul(a, b, c)
    >>> kernel = TritonLowered(plan(derive(mm, tile(a, 16), stream(b, 16), verify=False).diagram), interpret=True)
    >>> A, B = jax.random.normal(jax.random.key(0), (20, 24)), jax.random.normal(jax.random.key(1), (24, 8))
    >>> bool(jnp.allclose(kernel(A, B), A @ B, atol=1e-4))
    True
    """

    def __init__(
        self,
        p: Plan,
        *,
        interpret: bool | None = None,
        config: TritonConfig | None = None,
        hardware: Hardware | None = None,
    ):
        self.plan, self.config = p, config
        self.interpret = interpreted(interpret)
        self.hardware = target_hardware(self.interpret) if hardware is None else hardware
        self.__name__ = "napkin_kernel"
        if why := no_fp8_dot(p.diagram, self.interpret):
            raise NotLowerable(why)

    # -- the wrapper: bind sizes, pad to whole blocks, launch, slice -----------------------------
    def __call__(self, *arrays, pages=None):
        """The kernel on ``arrays``; with ``pages`` = ``(page_map, table)`` (:class:`lowering._paged.PageMap`) the
        inputs it names are page pools, their streamed chunks gathered through ``table`` as the loop loads them."""
        p, d = self.plan, self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        pm, table = pages if pages is not None else (None, None)
        wires = d.dom.inside
        sizes = bind(d.dom, arrays if pm is None else pm.contiguous(p, wires, arrays, table))
        extent = {a.name: int(a.size.subs(sizes)) for w in d.dom.inside for a in w.axes}
        config = self.config or TritonConfig.get_default(p)
        padded = launch(p, extent, config, self.hardware)  # the guards, before padding allocates anything
        if p.stream and padded[p.stream[0]] != extent[p.stream[0]]:
            x, s = p.stream
            paddable(d, x, extent[x], f"is not a multiple of the stream size {s}, so its last chunk is padded")
        bounds = call_blocks(p, segments(d, p), arrays, extent)  # from ids or block maps, unpadded
        made = made_positions(d, p)  # positions the program makes: not passed
        short = tuple(short_tiles(p, w, extent, padded) for w in (*wires, *d.cod.inside))
        arrays = [
            v if (pm and i in pm.inputs) or short[i] or i in made else _pad(v, w, padded)
            for i, (v, w) in enumerate(zip(arrays, wires, strict=True))
        ]
        if pm is not None:  # the table padded to the streamed axis' padded pages (entries past them never visible),
            # then to a power of two: the program loads its row whole, and Triton's blocks are powers of two
            need = next_pow2(padded[pm.axis] // pm.page_size) - table.shape[-1]
            table = jnp.pad(table, [(0, 0)] * (table.ndim - 1) + [(0, need)]) if need else table
        reads = (made, short[: len(wires)], short[len(wires) :])
        outs = self._call(arrays, sizes, extent, padded, config, bounds, (pm, table), reads)
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
        """The blocks of the call-time masks' bounds (:class:`lowering._blocks.CallBlocks`), at this program's tile
        and its index along each batch axis they have (0 along the others, where they broadcast): four scalars of
        each mask read as ranges, then the ``[2, width]`` chunk lists where a block map has holes."""
        p = self.plan
        nb, strides = len(p.tiles), _strides(p, padded)
        tile_pos = {a: i for i, a in enumerate(p.tiles)}

        def index_map(*ids, axis, b, k=()):
            at = [
                _batch_index(ids[nb], a, strides, padded) if n > 1 else 0
                for a, n in zip(p.batch, b.shape, strict=False)
            ]
            return (*at, _tile_id(ids[tile_pos[axis]], axis, p, padded, flip), *k)

        specs = []
        for m, b in bounds.bounds:
            at = functools.partial(index_map, axis=m.axis, b=b)
            specs += [pl.BlockSpec((None,) * b.ndim, functools.partial(at, k=(k,))) for k in range(4)]
        if bounds.listed:
            b = bounds.lists
            shape = (None,) * (b.ndim - 2) + b.shape[-2:]
            specs.append(pl.BlockSpec(shape, functools.partial(index_map, axis=bounds.axis, b=b, k=(0, 0))))
        return specs

    def _page_specs(self, pm, arrays, table, padded, flip=()) -> tuple[dict, list]:
        """With a page map: each pool input's block (its pages whole, ``pm.batch`` dropped: the table picks the
        pages) and the table's block (this program's row along ``pm.batch``'s axes)."""
        if pm is None:
            return {}, []
        nb, strides = len(self.plan.tiles), _strides(self.plan, padded)
        pools = {}
        for i in pm.inputs:
            wire = self.plan.diagram.dom.inside[i]
            spec = self._spec(wire, padded, flip)
            keep = [j for j, a in enumerate(wire.names) if a not in pm.batch]
            at = wire.names.index(pm.axis)
            shape = [s if j != at else None for j, s in enumerate(spec.block_shape) if j in keep]
            pool_at = keep.index(at)
            shape[pool_at : pool_at + 1] = [arrays[i].shape[0], pm.page_size]

            def index_map(*ids, spec=spec, keep=keep, pool_at=pool_at):
                idx = [v for j, v in enumerate(spec.index_map(*ids)) if j in keep]
                idx[pool_at : pool_at + 1] = [0, 0]
                return tuple(idx)

            pools[i] = pl.BlockSpec(tuple(shape), index_map)
        row = lambda *ids: (*(_batch_index(ids[nb], a, strides, padded) for a in pm.batch), 0)  # noqa: E731
        return pools, [pl.BlockSpec((None,) * len(pm.batch) + (table.shape[-1],), row)]

    def _call(self, arrays, sizes, extent, padded, config, bounds: CallBlocks, pages, reads):
        p, d = self.plan, self.plan.diagram
        pm, table = pages
        made, _, short_out = reads
        native = not self.interpret and operand_dtype(d) is not None  # the GPU's approximate instructions
        xp = Blocks(operand_dtype(d), tanh=native_tanh if native else None, trig=native_trig if native else None)
        flip = heavy_last(p, extent, padded, bounds)
        pools, table_spec = self._page_specs(pm, arrays, table, padded, flip)
        n_bounds = 4 * len(bounds.bounds) + bounds.listed
        kernel = functools.partial(_kernel, p, sizes, extent, padded, xp, n_bounds, flip, pm, reads)
        out_shape = [
            out_structs([w], extent if short else padded, arrays)[0]
            for w, short in zip(d.cod.inside, short_out, strict=True)
        ]
        specs = [pools.get(i) or self._spec(w, padded, flip) for i, w in enumerate(d.dom.inside) if i not in made]
        call = pl.pallas_call(
            kernel,
            grid=self._grid(padded),
            in_specs=specs + self._bound_specs(bounds, padded, flip) + table_spec,
            out_specs=[self._spec(w, padded, flip) for w in d.cod.inside],
            out_shape=out_shape,
            compiler_params=pltriton.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
            interpret=self.interpret,
            name="napkin_kernel",
        )
        values = [b for _, b in bounds.bounds for _ in range(4)] + ([bounds.lists] if bounds.listed else [])
        given = [v for i, v in enumerate(arrays) if i not in made]
        return call(*given, *values, *([table] if pm is not None else []))

    @property
    def source(self) -> str:
        """The kernel's launch description: grid axes, block shapes, loop and accumulators."""
        return describe(self)

    def sparsity(self, *arrays) -> Sparsity:
        """The blocks this kernel skips, runs unmasked and runs masked on ``arrays`` (their sizes; segment ids' values),
        and how they were found (:func:`lowering._sparsity.sparsity`).

        >>> import jax.numpy as jnp, napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> odd = nc.library.attention(q, x, d, mask=lambda q, x: (q - x) % 16 < 8)
        >>> k = TritonLowered(plan(derive(odd, tile(q, 16), stream(x, 16), verify=False).diagram))
        >>> k.sparsity(*(jnp.zeros((64, 8)),) * 3)
        Sparsity(skipped=0.0%, full=0.0%, partial=100.0% of 16 blocks; found: call time; the masks hide no chunk at \
these sizes)
        """
        d = self.plan.diagram
        arrays = [jnp.asarray(a) for a in arrays]
        sizes = bind(d.dom, arrays)
        return sparsity(self.plan, arrays, {a.name: int(a.size.subs(sizes)) for w in d.dom.inside for a in w.axes})

    @property
    def steps(self) -> tuple[Rule, ...]:
        """The rules the kernel applies to its block diagram, in order (:func:`kernel_rules`); at a call whose
        sizes pad an axis, ``pad_neutral`` of that axis follows them.

        >>> import napkin_cat as nc
        >>> from rewrites import derive, tile, stream
        >>> from lowering import plan
        >>> q, x, d = nc.axes("q x d")
        >>> flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
        >>> TritonLowered(plan(flash.diagram)).steps
        (base2(), tiled_first(x, ('q',), inputs=True))
        """
        return kernel_rules(self.plan)


def _pad(v, wire, padded):
    widths = [(0, padded[a.name] - v.shape[i]) for i, a in enumerate(wire.axes)]
    return jnp.pad(v, widths) if any(w for _, w in widths) else v
