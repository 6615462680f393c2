"""The split-KV merge as one kernel: the parts' ``(o, lse)`` merged by the log-sum-exp merge, written in the caller's
layout and dtype (FlashDecoding's second kernel, Dao et al. 2023).

:func:`rewrites.merge_parts` is the merge in JAX (the reference, and the XLA backend's); XLA runs it as a
reduction and the cast to the caller's dtype as a second launch. Here one Pallas program per (sequence, KV head,
new token, tile of the ``group`` query heads' rows, block of the value dims: :func:`merge_block`) folds its parts,
several loaded at once (:func:`parts_per_load`; ``[rows, cols]`` each, powers of two for Triton, the rows and dims
past the arrays' ends masked), by the online log-sum-exp, and stores its block of the output ``[B, Nq, H_kv, group,
Dv]`` (the caller's ``[B, Nq, H, Dv]``, a reshape) and its rows' log-sum-exp.

>>> import jax, jax.numpy as jnp
>>> from rewrites import merge_parts
>>> o = jax.random.normal(jax.random.key(0), (1, 3, 2, 1, 4, 16))   # B, parts, H_kv, Nq, group, Dv
>>> lse = jax.random.normal(jax.random.key(1), (1, 3, 2, 1, 4))
>>> out, total = merge(o, lse, jnp.bfloat16, interpret=True)
>>> want, want_lse = merge_parts(o, lse, 1)
>>> out.shape, out.dtype, bool(jnp.allclose(out, want.transpose(0, 2, 1, 3, 4), atol=1e-2))
((1, 1, 2, 4, 16), dtype(bfloat16), True)
>>> bool(jnp.allclose(total, want_lse.transpose(0, 2, 1, 3), atol=1e-6))
True
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lowering._plan import next_pow2


def merge(o, lse, dtype, *, interpret: bool):
    """The parts ``o`` ``[B, n, H_kv, Nq, group, Dv]`` and their ``lse`` ``[B, n, H_kv, Nq, group]`` (f32; ``±∞``
    where a part saw no key) merged: ``[B, Nq, H_kv, group, Dv]`` in ``dtype`` and the total log-sum-exp ``[B, Nq,
    H_kv, group]`` (f32; ``−∞`` for a row no part saw, whose output is 0), as :func:`rewrites.merge_parts`
    merges them, in one launch (the module's docstring).

    >>> o, lse = jnp.ones((1, 2, 1, 1, 1, 4)), jnp.array([0.0, jnp.inf]).reshape(1, 2, 1, 1, 1)
    >>> [v.ravel().tolist() for v in merge(o, lse, jnp.float32, interpret=True)]   # part 1 saw no key
    [[1.0, 1.0, 1.0, 1.0], [0.0]]
    """
    batch, n, kv_heads, nq, group, dv = o.shape
    rows, cols = merge_block(batch * kv_heads * nq, group, dv)
    grid = (batch, kv_heads, nq, -(-group // rows), -(-dv // cols))
    kernel = functools.partial(_merged, n=n, k=parts_per_load(n, rows * cols), sizes=(group, dv))
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, n, None, None, rows, cols), lambda b, h, i, g, c: (b, 0, h, i, g, c)),
            pl.BlockSpec((None, n, None, None, rows), lambda b, h, i, g, c: (b, 0, h, i, g)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows, cols), lambda b, h, i, g, c: (b, i, h, g, c)),
            # every column block of a row tile writes the same log-sum-exp
            pl.BlockSpec((None, None, None, rows), lambda b, h, i, g, c: (b, i, h, g)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, nq, kv_heads, group, dv), dtype),
            jax.ShapeDtypeStruct((batch, nq, kv_heads, group), jnp.float32),
        ],
        interpret=interpret,
        name="napkin_merge",
    )(o, lse)


#: the most f32 numbers a program's accumulator holds (rows × Dv): 32 KB, 64 a thread of 4 warps; also the most a
#: program loads at once (parts × rows × Dv, :func:`parts_per_load`)
BLOCK = 8192


#: programs the merge's grid should have at least (about an H100's or H200's 132 SMs), splitting a (sequence, KV head,
#: new token)'s rows and columns into blocks of no fewer than MIN_BLOCK numbers
PROGRAMS, MIN_BLOCK = 128, 512


def merge_block(outer: int, group: int, dv: int) -> tuple[int, int]:
    """A merge program's rows and columns (powers of two) for ``outer`` (sequence, KV head, new token) triples of
    ``group`` rows and ``dv`` columns: the accumulator within :data:`BLOCK` numbers, then halved (columns to 32
    first, then rows) while the grid has fewer than :data:`PROGRAMS` programs and the block more than
    :data:`MIN_BLOCK` numbers. MLA at B = 1 (128 heads of 512 latent dims, 64 parts) merged in 8 programs of 16 ×
    512 took 52 µs of a 132 µs step on an H200; each column is merged on its own, so the columns split freely.

    >>> merge_block(8, 4, 128), merge_block(1, 128, 512), merge_block(64, 128, 512)   # GQA B = 1; MLA B = 1, 64
    ((4, 128), (16, 32), (16, 512))
    """
    cols = next_pow2(dv)
    rows = min(next_pow2(group), max(1, BLOCK // cols))
    while outer * -(-group // rows) * -(-dv // cols) < PROGRAMS and rows * cols > MIN_BLOCK:
        if cols > 32:
            cols //= 2
        else:
            rows //= 2
    return rows, cols


def parts_per_load(n: int, per_part: int) -> int:
    """How many of the ``n`` parts a merge program loads at once (each ``per_part`` f32 numbers): the largest power of
    two dividing ``n`` whose parts hold at most :data:`BLOCK` numbers. Loading them together lets their loads run at
    once; folded one at a time, each waited on the last, and at B = 1 (8 programs, 16 parts) the merge took 8.6 µs of
    a 43 µs step on an H200, against cuDNN's 2.7 µs.

    >>> parts_per_load(16, 4 * 128), parts_per_load(12, 4 * 128), parts_per_load(17, 4 * 128), parts_per_load(8, 8192)
    (16, 4, 1, 1)
    """
    k = 1
    while n % (2 * k) == 0 and 2 * k * per_part <= BLOCK:
        k *= 2
    return k


def _merged(o_ref, l_ref, out_ref, lse_ref, *, n: int, k: int, sizes: tuple[int, int]):
    """One program: its rows' parts folded ``k`` at a time by the online log-sum-exp (a running largest ``lse``, the
    sum and the output rescaled as it grows; within a load, its parts reduced together), its block's rows and dims
    past the arrays' ends masked."""
    rows, width = out_ref.shape
    first, column = pl.program_id(3) * rows, pl.program_id(4) * width
    row_in = lax.broadcasted_iota(jnp.int32, (rows,), 0) + first < sizes[0]
    dims_in = row_in[:, None] & (lax.broadcasted_iota(jnp.int32, (rows, width), 1) + column < sizes[1])
    rows_k, dims_k = (jnp.broadcast_to(m, (k, *m.shape)) for m in (row_in, dims_in))  # the same, for k parts
    f32 = jnp.float32

    def fold(step, carry):
        top, total, acc = carry
        at = pl.ds(pl.multiple_of(step * k, k), k)
        lse = pltriton.load(l_ref.at[at], mask=rows_k, other=jnp.asarray(-jnp.inf, f32)).astype(f32)
        lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)  # an empty part's lse may be +∞ (its sum 0 inverted)
        new = jnp.maximum(top, jnp.max(lse, axis=0))
        shift = jnp.where(jnp.isfinite(new), new, 0.0)
        scale, weight = jnp.exp(top - shift), jnp.exp(lse - shift[None, :])
        o = pltriton.load(o_ref.at[at], mask=dims_k, other=jnp.zeros((), o_ref.dtype)).astype(f32)
        summed = jnp.sum(weight[:, :, None] * o, axis=0)
        return new, total * scale + jnp.sum(weight, axis=0), acc * scale[:, None] + summed

    init = (jnp.full((rows,), -jnp.inf, f32), jnp.zeros((rows,), f32), jnp.zeros((rows, width), f32))
    top, total, acc = lax.fori_loop(0, n // k, fold, init)
    seen = total > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None], 0.0)
    pltriton.store(out_ref, out.astype(out_ref.dtype), mask=dims_in)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    pltriton.store(lse_ref, jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf), mask=row_in)
