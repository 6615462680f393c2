"""The streamed loop every GPU backend's kernel body runs (FAN §3): the accumulators start at their identity, fold the
chunks of the streamed axis a block visits, and the diagram's final walk gives the outputs.

:class:`ChunkLoop` is that skeleton, written once: the block shapes probed on one abstract chunk, the accumulators'
identities, the chunk ranges the masks leave (``first ≤ full_lo ≤ full_hi ≤ last``: chunks outside ``[first, last)``
skipped, those in ``[full_lo, full_hi)`` run without the masks, the others with them), one loop over each range, or,
where a block map has holes, over the chunks it lists in each range (:class:`ChunkList`: FlexAttention's ``kv_indices``
and ``full_kv_indices``), the final walk. A backend subclasses it with what differs: how a chunk's values are loaded and
released (Triton: slices of its block refs; Mosaic: ring slots behind barriers), where the ranges come from
(:func:`lowering._blocks.visited` over its own offsets, and the segment masks' bounds as the wrapper passes them), what
a skipped range costs (Mosaic's consumers still observe the chunks their warpgroup's producer loads), and its loop
primitive (``lax.fori_loop`` by default).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import jax
import jax.numpy as jnp
from jax import lax

from lowering._blocks import BlockContext
from napkin_cat.diagram import Diagram
from rewrites import walk


class ChunkList(ABC):
    """A block's chunks of one kind (cut, or kept whole, by a block map), sorted, as
    :func:`lowering._blocks.chunk_lists` lays them out: the chunk at a position, and how many lie below a chunk.

    >>> import jax.numpy as jnp
    >>> class Listed(ChunkList):
    ...     def __init__(self, row):
    ...         self.row = row
    ...     def at(self, i):
    ...         return self.row[i]
    >>> Listed(jnp.array([1, 4, 6, 6])).below(5)  # chunks 1 and 4 of 6, padded with 6
    Array(2, dtype=int32)
    """

    row: object  # the whole list, padded with the chunk count

    @abstractmethod
    def at(self, i):
        """The chunk at position ``i``."""

    def below(self, c):
        """How many chunks of the list lie below chunk ``c``: a list ∩ ``[lo, hi)`` is positions ``[below(lo),
        below(hi))``."""
        return jnp.sum((self.row < c).astype(jnp.int32))


class ChunkLoop(ABC):
    """One block's fold over the chunks of the streamed axis ``x`` (chunks of ``s``) of the block diagram ``d``, in
    ``ctx`` (the block's offsets and grid indices; the identities and the final walk read it), skipping in the chunks
    every mask keeps whole the boxes in ``hidden`` (their ids). ``run()`` gives the outputs; a backend supplies
    :meth:`blocks`, :meth:`chunk`, :meth:`count` and, where masks hide chunks, :meth:`bounds`, and may replace the
    other hooks.

    >>> import jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> (n,) = nc.axes("n")
    >>> class Rows(ChunkLoop):  # a sum over n, in chunks of 2 of one array held whole
    ...     def __init__(self, v):
    ...         super().__init__(nc.reduce_sum(nc.Array(n), n), "n", 2, BlockContext(), kept=[None])
    ...         self.v = v
    ...     def blocks(self):
    ...         return [jax.ShapeDtypeStruct((2,), jnp.float32)]
    ...     def chunk(self, c, walk_chunk):
    ...         walk_chunk([lax.dynamic_slice(self.v, (c * 2,), (2,))])
    ...     def count(self):
    ...         return 3
    >>> Rows(jnp.arange(6.0)).run()
    [Array(15., dtype=float32)]
    """

    #: the chunks ``[lo, hi)`` of the whole block around those this one visits (None: none but its own)
    span: tuple | None = None

    def __init__(self, d: Diagram, x: str, s: int, ctx: BlockContext, *, kept: list, hidden=frozenset()):
        #: ``kept``: the values of the inputs that do not hold ``x`` (None for those streamed), for the final walk
        self.d, self.x, self.s, self.ctx, self.kept, self.hidden = d, x, s, ctx, kept, hidden
        #: the context the chunks' walks start from (at each chunk's offset along ``x``)
        self.chunk_ctx = ctx

    # -- what a backend supplies -------------------------------------------------------------------------------
    @abstractmethod
    def blocks(self) -> list | None:
        """The abstract blocks (``jax.ShapeDtypeStruct``) of one chunk's inputs; None where nothing streams."""

    @abstractmethod
    def chunk(self, c, walk_chunk) -> None:
        """Load chunk ``c``'s values, ``walk_chunk(values)`` (which returns the chunk walk's outputs), and release what
        the load holds."""

    @abstractmethod
    def count(self):
        """The chunks to fold, ``[0, count)``, where no mask hides any (None: no loop)."""

    def bounds(self) -> tuple | None:
        """``(first, full_lo, full_hi, last)`` where masks hide chunks of this block, else None."""
        return None

    def lists(self) -> tuple | None:
        """The chunks a block map cuts and keeps whole (two :class:`ChunkList`), where the kernel reads them, else
        None: only those in :meth:`bounds`' ranges run."""
        return None

    # -- what a backend may replace ------------------------------------------------------------------------------
    def probe_ctx(self) -> BlockContext:
        """The context of the abstract chunk the accumulators' shapes are probed on."""
        return self.ctx.at(**{self.x: 0})

    def walk(self, *args, **kw) -> list:
        """One walk of the diagram (:func:`rewrites.walk`)."""
        return walk(*args, **kw)

    def fold(self, acc, state, ins, ctx):
        """An accumulator's step on one chunk's inputs."""
        return acc.step(state, ins, ctx)

    def carried(self, v):
        """An accumulator's state as the loop carries it."""
        return v

    def loop(self, lo, hi, body, carry):
        """The loop primitive: ``body(c, carry)`` for each chunk ``c`` in ``[lo, hi)``."""
        return lax.fori_loop(lo, hi, body, carry)

    def skipped(self, lo, hi) -> None:  # noqa: B027 - a hook, empty unless replaced
        """Chunks ``[lo, hi)`` of :attr:`span` that this block does not visit."""

    def begin(self) -> None:  # noqa: B027 - a hook, empty unless replaced
        """Before the first chunk (after the identities)."""

    def end(self) -> None:  # noqa: B027 - a hook, empty unless replaced
        """After the last chunk (before the final walk)."""

    # -- the skeleton --------------------------------------------------------------------------------------------
    def run(self) -> list:
        """The outputs: the accumulators from their identities, folded over the visited chunks, finalised."""
        keys, init = self.identities()
        self.begin()
        carry = self.fold_chunks(keys, init)
        self.end()
        states = dict(zip(keys, carry, strict=True))
        return self.walk(self.d, self.kept, self.ctx, self.x, "final", states, skip=self.skip(False))

    def identities(self) -> tuple[list, tuple]:
        """The accumulators (their layers, sorted) and their states' identities, shaped by one abstract chunk."""
        d, x = self.d, self.x

        def probe(*vals):
            shapes: dict = {}
            walk(d, list(vals), self.probe_ctx(), x, "chunk", shapes, fold=lambda acc, st, ins, c: acc.partial(ins, c))
            return shapes

        blocks = self.blocks()
        like = jax.eval_shape(probe, *blocks) if blocks is not None else {}
        keys = sorted(like)
        return keys, tuple(d.inside[i][1].accumulator(x).identity(like[i], self.ctx) for i in keys)

    def fold_chunks(self, keys: list, init: tuple) -> tuple:
        """The states after the visited chunks: where masks hide chunks, those in ``[first, full_lo)`` and
        ``[full_hi, last)`` masked and those in ``[full_lo, full_hi)`` unmasked, the rest of :attr:`span` skipped;
        else every chunk of :meth:`count`, masked."""
        bounds = self.bounds()
        if bounds is None:
            n = self.count()
            return init if n is None else self.loop(0, n, self.body(keys, False), init)
        first, full_lo, full_hi, last = bounds
        if (lists := self.lists()) is not None:  # a cut chunk runs masked; a whole one unmasked in [full_lo, full_hi)
            cut, whole = lists
            carry = self.listed(cut, first, last, self.body(keys, False), init)
            for lo, hi, unmasked in ((first, full_lo, False), (full_lo, full_hi, True), (full_hi, last, False)):
                carry = self.listed(whole, lo, hi, self.body(keys, unmasked), carry)
            return carry
        if self.span is not None:
            self.skipped(self.span[0], first)
        carry = self.loop(first, full_lo, self.body(keys, False), init)
        carry = self.loop(full_lo, full_hi, self.body(keys, True), carry)
        carry = self.loop(full_hi, last, self.body(keys, False), carry)
        if self.span is not None:
            self.skipped(last, self.span[1])
        return carry

    def listed(self, chunks: ChunkList, lo, hi, body, carry):
        """``body`` on the chunks of ``chunks`` in ``[lo, hi)``: the positions of a sorted list holding them."""
        return self.loop(chunks.below(lo), chunks.below(hi), lambda i, c: body(chunks.at(i), c), carry)

    def skip(self, unmasked: bool):
        """Which boxes a walk skips: the masks, in a chunk every mask keeps whole."""
        return lambda box: unmasked and id(box) in self.hidden

    def body(self, keys: list, unmasked: bool):
        """The loop's body: one chunk walked, its accumulators folded (the masks skipped where ``unmasked``)."""
        d, x, s, skip = self.d, self.x, self.s, self.skip(unmasked)

        def run(c, carry):
            states = dict(zip(keys, carry, strict=True))

            def walk_chunk(values):
                ctx = self.chunk_ctx.at(**{x: c * s})
                return self.walk(d, values, ctx, x, "chunk", states, fold=self.fold, skip=skip)

            self.chunk(c, walk_chunk)
            return tuple(self.carried(states[i]) for i in keys)

        return run
