"""Paged KV caches: split-KV decoding whose streamed key axis is read through a page table.

A paged cache (vLLM's PagedAttention) keeps keys and values in a pool of pages ``[P, page_size, H_kv, D]``; a
sequence ``b`` owns the pages ``page_table[b, 0], page_table[b, 1], …`` in order. Its key at position ``j`` lives at
``(page_table[b, j // page_size], j mod page_size)``: the cache's key axis relabelled ``x = (x / page_size) ×
page_size``, the outer factor read through the table. That is an index map on the streamed axis, nothing more:
the split into parts (:func:`rewrites.split_kv`), the online softmax over each part's chunks and the log-sum-exp
merge (:func:`rewrites.merge_parts`, proved by :func:`rewrites.prove_merge`) are the contiguous decode's; only
where a chunk is loaded from changes. A chunk is ``pages_per_chunk`` whole pages; its start is computed from the
table inside the loop (the page ids read from the table's row, then the pages gathered), so the pool is never
copied and the table and the lengths are runtime values: one compiled kernel serves every table and length.

The kernel is one ``pl.pallas_call`` over the grid (sequence, KV head, row tile, part), the grouped-query heads of
one KV head packed into its rows (``Nq · H/H_kv`` rows, FlashInfer's trick) and each part's chunks past the
sequence's length skipped. Each program writes its part's ``(o, lse)`` (f32); the parts merge in JAX.

>>> import jax, jax.numpy as jnp
>>> q = jax.random.normal(jax.random.key(0), (2, 1, 4, 16))
>>> pages = [jax.random.normal(jax.random.key(i), (6, 16, 2, 16)) for i in (1, 2)]   # 6 pages of 16 keys
>>> table = jnp.array([[4, 0, 2], [1, 5, 3]], jnp.int32)                           # each sequence's pages
>>> plan = PagedPlan("float32", queries=1, group=2, dims=(16, 16), page_size=16, pages_per_chunk=1,
...                  chunks_per_part=2, parts=2, interpret=True)
>>> out, lse = paged_step(plan, q, *pages, table, jnp.array([40, 9]))
>>> out.shape, lse.shape
((2, 1, 4, 16), (2, 1, 4))
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lowering._plan import NotLowerable
from napkin_cat.errors import EvaluationError
from rewrites import merge_parts


@dataclass(frozen=True)
class PagedPlan:
    """What a paged decode kernel depends on (its cache key): dtype, new tokens ``queries``, query heads per KV
    head ``group``, head dims, keys per page, whole pages per streamed chunk, chunks per part, parts, the scale
    and whether it interprets. The batch, the pool's size, the table and the lengths are not in it."""

    dtype: str
    queries: int
    group: int
    dims: tuple[int, int]
    page_size: int
    pages_per_chunk: int
    chunks_per_part: int
    parts: int
    scale: float | None = None
    interpret: bool = True

    @property
    def chunk(self) -> int:
        """Keys per streamed chunk: whole pages."""
        return self.page_size * self.pages_per_chunk

    @property
    def rows(self) -> int:
        """The kernel's rows per KV head: the new tokens times the query heads sharing it."""
        return self.queries * self.group

    @property
    def row_block(self) -> int:
        """Rows per program: a power of two ≥ 16 (every 16-bit dot's M), at most 64."""
        return min(64, max(16, 1 << (self.rows - 1).bit_length()))

    @property
    def table_width(self) -> int:
        """Table entries the kernel reads per sequence: every part's whole chunks."""
        return self.parts * self.chunks_per_part * self.pages_per_chunk


def _kernel(plan: PagedPlan, table_ref, length_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
    """One program: the rows of its tile against its part's chunks, each chunk's pages looked up in the table;
    the online softmax (FAN §3) folds them, with ``−∞`` for keys past the length or the rows' causal tail."""
    tile, part = pl.program_id(2), pl.program_id(3)
    length, m, c = length_ref[()], plan.pages_per_chunk, plan.chunk
    pool = k_ref.shape[0]
    q = q_ref[...]
    row = tile * plan.row_block + lax.broadcasted_iota(jnp.int32, (plan.row_block, c), 0)
    # row r is token r // group, at position length − Nq + r // group: it sees keys up to its own
    sees = jnp.minimum(length, length - plan.queries + 1 + row // plan.group)
    scale = plan.scale if plan.scale is not None else 1.0 / math.sqrt(plan.dims[0])

    def body(i, carry):
        acc, top, total = carry
        # the chunk's pages, from the table; entries past the sequence's pages are clamped into the pool
        pages = jnp.clip(table_ref[pl.ds(i * m, m)], 0, pool - 1)
        k = k_ref[pages].reshape(c, plan.dims[0])
        v = v_ref[pages].reshape(c, plan.dims[1])
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32) * scale
        key = i * c + lax.broadcasted_iota(jnp.int32, (plan.row_block, c), 1)
        s = jnp.where(key < sees, s, -jnp.inf)
        new = jnp.maximum(top, jnp.max(s, axis=1))
        shift = jnp.where(new == -jnp.inf, 0.0, new)  # a row that has seen no key yet keeps 0, not NaN
        p = jnp.exp(s - shift[:, None])
        alpha = jnp.exp(top - shift)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return acc, new, alpha * total + jnp.sum(p, axis=1)

    first = part * plan.chunks_per_part
    last = jnp.minimum(first + plan.chunks_per_part, pl.cdiv(length, c))  # chunks past the length: skipped
    init = (
        jnp.zeros((plan.row_block, plan.dims[1]), jnp.float32),
        jnp.full((plan.row_block,), -jnp.inf, jnp.float32),
        jnp.zeros((plan.row_block,), jnp.float32),
    )
    acc, top, total = lax.fori_loop(first, jnp.maximum(first, last), body, init)
    seen = total > 0
    o_ref[...] = acc / jnp.where(seen, total, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, top + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)


def _call(plan: PagedPlan, rows, k_pages, v_pages, table, lengths):
    """The ``pallas_call``: grid (sequence, KV head, row tile, part); the pool's pages of this KV head, the
    sequence's table row and length as blocks; ``(o, lse)`` per part."""
    batch, kv_heads, padded_rows, _ = rows.shape
    pool, page_size = k_pages.shape[:2]
    tiles, rb = padded_rows // plan.row_block, plan.row_block
    dim, dv = plan.dims
    grid = (batch, kv_heads, tiles, plan.parts)
    in_specs = [
        pl.BlockSpec((None, plan.table_width), lambda b, h, t, p: (b, 0)),
        pl.BlockSpec((None,), lambda b, h, t, p: (b,)),
        pl.BlockSpec((None, None, rb, dim), lambda b, h, t, p: (b, h, t, 0)),
        pl.BlockSpec((pool, page_size, None, dim), lambda b, h, t, p: (0, 0, h, 0)),
        pl.BlockSpec((pool, page_size, None, dv), lambda b, h, t, p: (0, 0, h, 0)),
    ]
    out_specs = [
        pl.BlockSpec((None, None, None, rb, dv), lambda b, h, t, p: (b, h, p, t, 0)),
        pl.BlockSpec((None, None, None, rb), lambda b, h, t, p: (b, h, p, t)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, kv_heads, plan.parts, padded_rows, dv), jnp.float32),
        jax.ShapeDtypeStruct((batch, kv_heads, plan.parts, padded_rows), jnp.float32),
    ]
    return pl.pallas_call(
        functools.partial(_kernel, plan),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),
        interpret=plan.interpret,
        name="napkin_paged_decode",
    )(table, lengths, rows, k_pages, v_pages)


@functools.partial(jax.jit, static_argnums=0)
def paged_step(plan: PagedPlan, q, k_pages, v_pages, page_table, lengths):
    """One paged decode step for ``plan``, compiled once per plan and shapes (the table and the lengths are
    values): the queries packed into rows per KV head, the kernel, the parts merged. Returns ``[B, Nq, H, Dv]``
    in q's dtype and the log-sum-exp ``[B, Nq, H]`` (f32). The arguments are checked by ``decode_attention``.

    >>> import jax.numpy as jnp
    >>> plan = PagedPlan("float32", 1, 1, (16, 16), page_size=16, pages_per_chunk=1, chunks_per_part=1, parts=1)
    >>> ones = jnp.ones((1, 16, 1, 16))
    >>> out, _ = paged_step(plan, ones[:, :1], ones, 2 * ones, jnp.zeros((1, 1), jnp.int32), jnp.array([5]))
    >>> float(out[0, 0, 0, 0])
    2.0
    """
    batch, nq, heads, dim = q.shape
    kv_heads, dv, rb = k_pages.shape[2], v_pages.shape[3], plan.row_block
    rows = q.reshape(batch, nq, kv_heads, plan.group, dim).transpose(0, 2, 1, 3, 4)
    rows = rows.reshape(batch, kv_heads, plan.rows, dim)
    rows = jnp.pad(rows, [(0, 0), (0, 0), (0, -plan.rows % rb), (0, 0)])
    width = page_table.shape[1]
    table = jnp.pad(page_table, [(0, 0), (0, plan.table_width - width)])
    o, lse = _call(plan, rows, k_pages, v_pages, table, lengths.astype(jnp.int32))
    out, lse = merge_parts(o, lse, 2)
    out = out[:, :, : plan.rows].reshape(batch, kv_heads, nq, plan.group, dv).transpose(0, 2, 1, 3, 4)
    lse = lse[:, :, : plan.rows].reshape(batch, kv_heads, nq, plan.group).transpose(0, 2, 1, 3)
    return out.reshape(batch, nq, heads, dv).astype(q.dtype), lse.reshape(batch, nq, heads)


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
    if chunk is not None and (not isinstance(chunk, int) or chunk < page_size or chunk % page_size):
        raise EvaluationError(
            f"decode_attention: chunk={chunk!r} keys must be whole pages: a positive multiple of page_size "
            f"{page_size} (the kernel loads whole pages)"
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
    table, counts = jax.device_get(page_table), jax.device_get(-(-lengths // page_size))
    for b, (row, used) in enumerate(zip(table, counts, strict=True)):
        bad = next((i for i in range(int(used)) if not 0 <= int(row[i]) < pool), None)
        if bad is not None:
            raise EvaluationError(
                f"decode_attention: page_table[{b}, {bad}] = {int(row[bad])} is no page of the pool [0, {pool}) "
                f"(sequence {b} reads its first {int(used)} pages)"
            )


def paged_plan(dtype: str, q_shape, pool_shape, dv: int, width: int, *, parts, chunk, n_default, scale, interpret):
    """The plan for a paged call: ``chunk`` keys (default: whole pages up to 64 keys) per streamed chunk, the
    chunks split into ``parts`` (default ``n_default``) parts of whole chunks, capped by the chunks there are.

    >>> paged_plan("float32", (2, 1, 8, 64), (9, 16, 2, 64), 64, 8, parts=None, chunk=None, n_default=5,
    ...            scale=None, interpret=True)  # doctest: +ELLIPSIS
    PagedPlan(..., page_size=16, pages_per_chunk=4, chunks_per_part=1, parts=2, ...)
    """
    _, nq, heads, dim = q_shape
    page_size, kv_heads = pool_shape[1], pool_shape[2]
    per_chunk = min(width, chunk // page_size if chunk is not None else max(1, 64 // page_size))
    chunks = -(-width // per_chunk)
    n = min(n_default, chunks) if parts is None else parts
    if not isinstance(n, int) or not 1 <= n <= chunks:
        raise EvaluationError(
            f"decode_attention: parts must be an integer in [1, {chunks}] (the chunks of {per_chunk} pages the "
            f"table holds), got {n!r}"
        )
    per_part = -(-chunks // min(n, chunks))
    plan = PagedPlan(dtype, nq, heads // kv_heads, (dim, dv), page_size, per_chunk, per_part, -(-chunks // per_part),
                     scale, interpret)  # fmt: skip
    pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
    if not interpret and not (pow2(plan.chunk) and pow2(dim) and pow2(dv)):
        raise NotLowerable(
            f"decode_attention: the compiled paged kernel loads chunks of {plan.chunk} keys × head dims {dim}, {dv}: "
            "each must be a power of two ≥ 16; choose chunk= (whole pages) and head dims accordingly"
        )
    return plan
