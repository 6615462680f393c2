"""Paged KV caches: the streamed key axis read through a page table, an index map on the streamed axis.

A paged cache (vLLM's PagedAttention) keeps keys and values in a pool of pages ``[P, page_size, H_kv, D]``; a
sequence ``b`` owns the pages ``page_table[b, 0], page_table[b, 1], …`` in order. Its key at position ``j`` lives at
``(page_table[b, j // page_size], j mod page_size)``: the cache's key axis relabelled ``x = (x / page_size) ×
page_size``, the outer factor read through the table. That is all paging changes: the diagram, its derivation
(split-KV, tiles, the stream) and its kernel are the contiguous decode's; only where a streamed chunk is loaded
from differs. :class:`PageMap` states it for a backend's streamed loop: a chunk of ``s`` keys (whole pages, or a
part of one) of kernel batch element ``b`` loads the pages ``table[b, c·s/page_size …]`` of the pool as it streams (the
pool is never copied), so the table and the lengths are runtime values and one compiled kernel serves every
table and length. The Triton and XLA backends read it (``kernel.forward(*arrays, pages=(page_map, table))``).

>>> import jax, jax.numpy as jnp
>>> pm = PageMap("kv_idx", page_size=16, batch=("b",), inputs=(1, 2))
>>> pool = jax.ShapeDtypeStruct((6, 16, 2, 8), jnp.float32)
>>> import napkin_cat as nc
>>> b, x, h, d = nc.axes("b kv_idx h d")
>>> pm.virtual(nc.Array(b, x, h, d), pool, jnp.zeros((3, 4), jnp.int32)).shape   # 3 sequences of 4 pages
(3, 64, 2, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from lowering._plan import NotLowerable
from napkin_cat.errors import EvaluationError


@dataclass(frozen=True)
class PageMap:
    """The streamed axis ``axis`` of the kernel inputs ``inputs`` (their positions) read through a page table
    ``[*batch sizes, pages]`` (int32) whose rows follow the batch axes ``batch`` (a decode step's sequence and part):
    such an input is a pool whose axes are its wire's with ``batch`` dropped and ``axis`` split into ``(P,
    page_size)``; the chunk of ``s`` keys from key ``j`` of batch element ``i`` is the pool's pages ``table[i,
    j/page_size … (j+s)/page_size)`` (``s`` whole pages), or the keys ``j mod page_size …`` of page ``table[i,
    j/page_size]`` (``s`` dividing the page size); page ids are clamped into ``[0, P)`` (entries past a sequence's
    pages are read by no visible key).

    >>> import napkin_cat as nc
    >>> PageMap("x", 16, ("b", "p"), (1, 2)).pool_axes(nc.Array(*nc.axes("b p x h d")))   # [b, p, x, h, d] as a pool
    ['pool', 'page', 'h', 'd']
    """

    axis: str
    page_size: int
    batch: tuple[str, ...]
    inputs: tuple[int, ...]

    def pool_axes(self, wire) -> list[str]:
        """The pool's axes for an input's wire: ``batch`` dropped, ``axis`` split into ``pool`` and ``page``."""
        out = []
        for a in wire.names:
            out += ["pool", "page"] if a == self.axis else [] if a in self.batch else [a]
        return out

    def virtual(self, wire, pool, table) -> jax.ShapeDtypeStruct:
        """The contiguous array a pool stands for (its shape and dtype), for binding the diagram's sizes."""
        given = dict(zip(self.pool_axes(wire), pool.shape, strict=True))
        given |= dict(zip(self.batch, table.shape, strict=False)) | {self.axis: table.shape[-1] * self.page_size}
        return jax.ShapeDtypeStruct(tuple(given[a] for a in wire.names), pool.dtype)

    def contiguous(self, p, wires, arrays, table) -> list:
        """``arrays`` as the kernel binds its sizes: each pool input the contiguous array it stands for
        (:meth:`virtual`), after :meth:`check`; the other inputs as they are."""
        self.check(p, wires, arrays, table)
        pairs = enumerate(zip(arrays, wires, strict=True))
        return [self.virtual(w, v, table) if i in self.inputs else v for i, (v, w) in pairs]

    def check(self, p, wires, arrays, table) -> None:
        """Refuse a plan or arrays the map cannot read, naming the condition and the fix: the streamed axis must be
        ``axis`` in chunks of whole pages or a divisor of one, each pool input must hold ``axis`` and ``batch``
        with ``axis`` the first of its block's axes (the batch axes aside), and have ``page_size`` keys per page.

        >>> import napkin_cat as nc
        >>> from lowering import plan
        >>> from rewrites import derive, tile, stream
        >>> q, x, d = nc.axes("q x d")
        >>> pl_ = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
        >>> PageMap("x", 24, ("b",), (1,)).check(pl_, [], [], None)
        Traceback (most recent call last):
        ...
        lowering._plan.NotLowerable: PageMap: chunks of 16 keys along 'x' are neither whole pages of 24 nor a \
divisor of one: stream x in chunks of a multiple or a divisor of the page size
        """
        if p.stream is None or p.stream[0] != self.axis:
            raise NotLowerable(f"PageMap: the kernel streams {p.stream}, not the paged axis {self.axis!r}")
        if p.stream[1] % self.page_size and self.page_size % p.stream[1]:
            raise NotLowerable(
                f"PageMap: chunks of {p.stream[1]} keys along {self.axis!r} are neither whole pages of "
                f"{self.page_size} nor a divisor of one: stream {self.axis} in chunks of a multiple or a divisor of "
                "the page size"
            )
        if not set(self.batch) <= set(p.batch):
            raise NotLowerable(f"PageMap: the table's rows follow {self.batch!r}, not all batch axes of the plan")
        if jnp.dtype(table.dtype) != jnp.int32 or table.ndim != len(self.batch) + 1:
            raise EvaluationError(
                f"PageMap: the page table must be int32 [{', '.join(self.batch)}, pages], got {table.dtype} "
                f"{table.shape}"
            )
        for i in self.inputs:
            block = [a for a in wires[i].names if a not in p.batch]
            if not {self.axis, *self.batch} <= set(wires[i].names) or block[0] != self.axis:
                raise NotLowerable(
                    f"PageMap: input {i} ({wires[i].describe()}) must hold {self.batch!r} and {self.axis!r}, the "
                    "latter first among its block's axes, to be read as pages"
                )
            if arrays[i].ndim != len(self.pool_axes(wires[i])) or arrays[i].shape[1] != self.page_size:
                raise EvaluationError(
                    f"PageMap: input {i} must be a pool with axes {self.pool_axes(wires[i])} and {self.page_size} "
                    f"keys per page, got shape {tuple(arrays[i].shape)}"
                )

    def load(self, pool, entries, window, start, size: int):
        """The chunk of ``size`` keys from key ``start`` of one pool block (axes ``pool``, ``page``, …), its keys on
        one axis: several whole pages gathered (``entries(i, m)``: the table row's entries ``i … i + m``), or a
        window of one page (``entries(i)``: entry ``i``, a scalar; ``window(pool, page, offset, size)``: the
        backend's dynamic slice of a block), as a contiguous chunk is loaded.

        >>> pool = jnp.arange(12).reshape(3, 2, 2)
        >>> row = jnp.array([2, 0])
        >>> entries = lambda i, m=None: row[i] if m is None else row[i : i + m]
        >>> PageMap("x", 2, ("b",), (0,)).load(pool, entries, None, 0, 4).tolist()
        [[8, 9], [10, 11], [0, 1], [2, 3]]
        """
        p, last = self.page_size, pool.shape[0] - 1
        if size > p:  # each key's page and offset (a gather of rows): no reshape of a [pages, page_size, …] block
            m = size // p
            mine = lax.broadcasted_iota(jnp.int32, (size, m), 0) // p == lax.broadcasted_iota(jnp.int32, (size, m), 1)
            page = jnp.sum(jnp.where(mine, jnp.clip(entries(start // p, m), 0, last)[None, :], 0), axis=1)
            return pool[page, lax.broadcasted_iota(jnp.int32, (size,), 0) % p]
        # start ≥ 0: lax's truncating division (jnp's floor division lowers to a select Triton's lowering mistypes)
        page, offset = jax.lax.div(start, jnp.int32(p)), jax.lax.rem(start, jnp.int32(p))
        return window(pool, jnp.clip(entries(page), 0, last), offset, size)


def check_paged(q, k_pages, v_pages, page_table, chunk: int | None, max_queries: int) -> None:
    """Refuse a paged cache the kernel cannot read, naming the argument, the condition and the fix; nothing is
    allocated before. ``q``'s own checks (dtype, ``Nq``, heads) and the lengths' are ``decode_attention``'s.

    >>> import jax.numpy as jnp
    >>> pool = jnp.zeros((4, 16, 2, 8))
    >>> check_paged(jnp.zeros((2, 1, 4, 8)), pool, pool, jnp.zeros((2, 3)), None, 64)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: decode_attention: page_table must be int32 [B, pages_per_seq] = [2, …], \
got float32 (2, 3); pass page_table.astype(jnp.int32)
    """
    shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_pages.shape)}, v_cache {tuple(v_pages.shape)}"
    if not q.ndim == k_pages.ndim == v_pages.ndim == 4 or k_pages.shape[:3] != v_pages.shape[:3]:
        raise EvaluationError(
            f"decode_attention: with a page_table the caches are page pools [P, page_size, H_kv, D] of one P, "
            f"page_size and H_kv; {shapes}"
        )
    batch, nq, dim = q.shape[0], q.shape[1], q.shape[3]
    if k_pages.shape[3] != dim:
        raise EvaluationError(f"decode_attention: k_cache's head dim must be q's {dim}; {shapes}")
    if page_table.ndim != 2 or page_table.shape[0] != batch or jnp.dtype(page_table.dtype) != jnp.int32:
        raise EvaluationError(
            f"decode_attention: page_table must be int32 [B, pages_per_seq] = [{batch}, …], got "
            f"{jnp.dtype(page_table.dtype).name} {tuple(page_table.shape)}; pass page_table.astype(jnp.int32)"
        )
    page_size, keys = k_pages.shape[1], page_table.shape[1] * k_pages.shape[1]
    if chunk is not None and (not isinstance(chunk, int) or chunk < 1 or (chunk % page_size and page_size % chunk)):
        raise EvaluationError(
            f"decode_attention: chunk={chunk!r} keys must be whole pages or a divisor of one: a positive multiple or "
            f"divisor of page_size {page_size}"
        )
    if not 1 <= nq <= min(max_queries, keys):
        raise EvaluationError(
            f"decode_attention: q holds {nq} new tokens per sequence; a decode step over {page_table.shape[1]} pages "
            f"of {page_size} keys takes 1 to {min(max_queries, keys)}"
        )


def check_pages_used(page_table, lengths, pool: int, page_size: int) -> None:
    """Where the table and the lengths are concrete: every page a sequence reads (its first ``⌈length /
    page_size⌉``) is a page of the pool. Under ``jax.jit`` they are values and this is not checked.

    >>> import jax.numpy as jnp
    >>> check_pages_used(jnp.array([[0, 7]], jnp.int32), jnp.array([20]), pool=4, page_size=16)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: decode_attention: page_table[0, 1] = 7 is no page of the pool [0, 4) \
(sequence 0 reads its first 2 pages)
    """
    if isinstance(page_table, jax.core.Tracer) or isinstance(lengths, jax.core.Tracer):
        return
    # numpy: a concrete table or lengths closed over in a trace stays concrete (jnp would stage a traced op)
    table, counts = np.asarray(page_table), -(-np.asarray(lengths) // page_size)
    for b, (row, used) in enumerate(zip(table, counts, strict=True)):
        bad = next((i for i in range(int(used)) if not 0 <= int(row[i]) < pool), None)
        if bad is not None:
            raise EvaluationError(
                f"decode_attention: page_table[{b}, {bad}] = {int(row[bad])} is no page of the pool [0, {pool}) "
                f"(sequence {b} reads its first {int(used)} pages)"
            )


def paged_split(width: int, page_size: int, *, parts, chunk: int, n_default: int) -> tuple[int, int, int]:
    """How a paged call splits its ``width`` pages per sequence: ``(parts, pages per part, keys per streamed
    chunk)``. A chunk of ``chunk`` keys is whole pages or a divisor of one, a power of two ≥ 16 (the kernel's
    stream size); a part whole chunks and whole pages; ``parts`` (default ``n_default``) capped by the parts
    there can be.

    >>> paged_split(8, 16, parts=None, chunk=64, n_default=5)   # 4 pages per chunk: 2 chunks, 2 parts
    (2, 4, 64)
    >>> paged_split(5, 8, parts=None, chunk=16, n_default=5)    # 2 pages per chunk: 3 chunks (the last one ragged)
    (3, 2, 16)
    >>> paged_split(4, 64, parts=None, chunk=32, n_default=8)   # half a page per chunk: parts of whole pages
    (4, 1, 32)
    >>> paged_split(8, 16, parts=3, chunk=64, n_default=5)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: decode_attention: parts must be an integer in [1, 2] (a part is whole chunks \
of 64 keys and whole pages; 8 pages of 16 keys hold 2), got 3: pass fewer parts, or a smaller chunk= for more
    """
    if chunk < 16 or chunk & (chunk - 1) or (chunk % page_size and page_size % chunk):
        raise EvaluationError(
            f"decode_attention: chunk={chunk!r} keys with pages of {page_size}: the streamed chunk must be a power of "
            "two ≥ 16 keys (the kernel's stream size), whole pages or a divisor of one; pass another chunk= or a "
            "power-of-two page size"
        )
    unit = max(chunk, page_size) // page_size  # pages per unit a part is made of: a chunk, or a page
    units = -(-width // unit)
    n = min(n_default, units) if parts is None else parts
    if not isinstance(n, int) or not 1 <= n <= units:
        raise EvaluationError(
            f"decode_attention: parts must be an integer in [1, {units}] (a part is whole chunks of {chunk} keys and "
            f"whole pages; {width} pages of {page_size} keys hold {units}), got {n!r}: pass fewer parts, or a smaller "
            "chunk= for more"
        )
    per_part = -(-units // n)
    return -(-units // per_part), per_part * unit, chunk
