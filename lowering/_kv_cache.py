"""``KVCache``: the keys and values a generating model keeps, contiguous or paged, read by ``decode_attention``.

A pytree (it passes through ``jax.jit``, ``lax.while_loop`` and ``lax.scan`` as a carry): ``k`` and ``v``, the
valid ``lengths`` ``[B]`` (int32) and, for a paged cache, the ``page_table`` ``[B, pages_per_seq]`` (int32). A
contiguous cache is ``[B, S_max, H_kv, D]``; a paged one a pool ``[P, page_size, H_kv, D]`` whose pages the table
hands to the sequences (:mod:`lowering._paged`). :meth:`KVCache.append` writes new tokens' keys and values at
positions ``lengths … lengths + N − 1`` and advances the lengths; :meth:`KVCache.attend` runs
``nc.decode_attention`` of those tokens' queries over the cache.

>>> import jax, jax.numpy as jnp
>>> cache = KVCache.empty(batch=2, max_len=32, kv_heads=2, dim=16, page_size=8)
>>> k, v = (jax.random.normal(jax.random.key(i), (2, 5, 2, 16)) for i in (0, 1))
>>> cache = cache.append(k, v)                                   # a prompt of 5 tokens
>>> out = cache.attend(jax.random.normal(jax.random.key(2), (2, 5, 4, 16)))   # its 5 queries, causal
>>> ref = jax.nn.dot_product_attention(jax.random.normal(jax.random.key(2), (2, 5, 4, 16)), k, v, is_causal=True)
>>> cache.lengths.tolist(), bool(jnp.allclose(out, ref, atol=1e-5))
([5, 5], True)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import jax
import jax.numpy as jnp

from lowering._decode import decode_attention
from napkin_cat.errors import EvaluationError


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class KVCache:
    """Keys ``k`` and values ``v`` (contiguous ``[B, S_max, H_kv, D]`` or a page pool ``[P, page_size, H_kv, D]``),
    the ``lengths`` written ``[B]`` and, when paged, the ``page_table`` ``[B, pages_per_seq]``: a decoder's cache,
    appended to by :meth:`append` and read by :meth:`attend` (:func:`lowering.decode_attention`).

    >>> import jax, jax.numpy as jnp
    >>> k = jax.random.normal(jax.random.key(0), (1, 5, 1, 16))
    >>> cache = KVCache.empty(batch=1, max_len=8, kv_heads=1, dim=16).append(k, k)
    >>> q = jax.random.normal(jax.random.key(1), (1, 1, 2, 16))
    >>> out = cache.attend(q)  # the newest token (position 4) against the five written
    >>> ref = jax.nn.dot_product_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(k, 2, axis=2))
    >>> cache.lengths.tolist(), bool(jnp.allclose(out, ref, atol=1e-5))
    ([5], True)
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    page_table: jax.Array | None = None

    @classmethod
    def empty(
        cls,
        *,
        batch: int,
        max_len: int,
        kv_heads: int,
        dim: int,
        value_dim: int | None = None,
        dtype=jnp.float32,
        page_size: int | None = None,
    ) -> KVCache:
        """A cache holding no token, for ``batch`` sequences of up to ``max_len`` tokens; with ``page_size``, a
        pool of ``batch · ⌈max_len / page_size⌉`` pages, sequence ``b`` owning pages ``b, b + batch, …``
        (interleaved, so the table is no identity; any permutation serves).

        >>> KVCache.empty(batch=2, max_len=20, kv_heads=1, dim=8, page_size=8).page_table.tolist()
        [[0, 2, 4], [1, 3, 5]]
        """
        if batch < 1 or max_len < 1 or (page_size is not None and page_size < 1):
            raise EvaluationError(
                f"KVCache.empty: batch {batch}, max_len {max_len} and page_size {page_size} must be positive"
            )
        dv, lengths = dim if value_dim is None else value_dim, jnp.zeros((batch,), jnp.int32)
        if page_size is None:
            k = jnp.zeros((batch, max_len, kv_heads, dim), dtype)
            return cls(k, jnp.zeros((batch, max_len, kv_heads, dv), dtype), lengths)
        pages = -(-max_len // page_size)
        table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(pages, batch).T
        k = jnp.zeros((batch * pages, page_size, kv_heads, dim), dtype)
        return cls(k, jnp.zeros((batch * pages, page_size, kv_heads, dv), dtype), lengths, table)

    @property
    def max_len(self) -> int:
        """The tokens a sequence may hold."""
        return self.k.shape[1] if self.page_table is None else self.page_table.shape[1] * self.k.shape[1]

    def append(self, k, v) -> KVCache:
        """The cache with ``k``, ``v`` ``[B, N, H_kv, D]`` written at each sequence's positions ``lengths …
        lengths + N − 1`` and the lengths advanced by ``N``. Writes past ``max_len`` are dropped (the caller
        sizes the cache; ``decode_attention`` refuses concrete lengths past it).

        >>> new = jnp.ones((1, 3, 1, 2))
        >>> c = KVCache.empty(batch=1, max_len=4, kv_heads=1, dim=2).append(new, new)
        >>> c.lengths.tolist(), c.k[0, :, 0, 0].tolist()
        ([3], [1.0, 1.0, 1.0, 0.0])
        """
        batch, n = k.shape[:2]
        if k.shape[0] != self.lengths.shape[0] or k.shape[2:] != self.k.shape[2:] or v.shape[2:] != self.v.shape[2:]:
            raise EvaluationError(
                f"KVCache.append: new keys {tuple(k.shape)} and values {tuple(v.shape)} must be [B, N, H_kv, D] "
                f"for the cache's B = {self.lengths.shape[0]}, H_kv, D {tuple(self.k.shape[2:])}"
            )
        pos = self.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]  # [B, N]
        if self.page_table is None:
            at = (jnp.arange(batch)[:, None], pos)
        else:
            page_size = self.k.shape[1]
            page = jnp.take_along_axis(self.page_table, pos // page_size, axis=1, mode="fill", fill_value=-1)
            at = (jnp.where(pos < self.max_len, page, self.k.shape[0]), pos % page_size)
        new_k = self.k.at[at].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[at].set(v.astype(self.v.dtype), mode="drop")
        return replace(self, k=new_k, v=new_v, lengths=self.lengths + n)

    def attend(self, q, **options):
        """``decode_attention`` of ``q`` ``[B, Nq, H, D]`` (the newest ``Nq`` tokens, already appended) over the
        cache; ``options`` reach it (``scale``, ``parts``, ``return_residual``, …)."""
        return decode_attention(q, self.k, self.v, self.lengths, page_table=self.page_table, **options)
