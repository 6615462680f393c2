"""The split-KV merge as one kernel: the parts' ``(o, lse)`` merged by the log-sum-exp merge, written in the caller's
layout and dtype (FlashDecoding's second kernel, Dao et al. 2023).

:func:`rewrites.merge_parts` is the merge in JAX (the reference, and the XLA backend's); XLA runs it as a
reduction and the cast to the caller's dtype as a second launch. Here one Pallas program per (sequence, KV head,
new token) loads its parts' rows whole (``[parts, group, Dv]``, each dimension a power of two for Triton, the
part, row and dim past the arrays' ends masked), shifts by the largest ``lse``, and stores the ``group`` query
heads' rows of the output ``[B, Nq, H_kv, group, Dv]`` (the caller's ``[B, Nq, H, Dv]``, a reshape) and their
log-sum-exp.

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
    blocks = tuple(next_pow2(v) for v in (n, group, dv))
    kernel = functools.partial(_merged, sizes=(n, group, dv))
    return pl.pallas_call(
        kernel,
        grid=(batch, kv_heads, nq),
        in_specs=[
            pl.BlockSpec((None, blocks[0], None, None, *blocks[1:]), lambda b, h, i: (b, 0, h, i, 0, 0)),
            pl.BlockSpec((None, blocks[0], None, None, blocks[1]), lambda b, h, i: (b, 0, h, i, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, *blocks[1:]), lambda b, h, i: (b, i, h, 0, 0)),
            pl.BlockSpec((None, None, None, blocks[1]), lambda b, h, i: (b, i, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((batch, nq, kv_heads, group, dv), dtype),
            jax.ShapeDtypeStruct((batch, nq, kv_heads, group), jnp.float32),
        ],
        interpret=interpret,
        name="napkin_merge",
    )(o, lse)


def _merged(o_ref, l_ref, out_ref, lse_ref, *, sizes):
    """One program: its parts' rows ``[n, group, Dv]`` (blocks padded to powers of two, masked) merged."""

    def inside(shape, dims):  # where a block of ``shape`` (the dims ``dims`` of the parts' block) holds values
        ok = [lax.broadcasted_iota(jnp.int32, shape, k) < sizes[d] for k, d in enumerate(dims)]
        return functools.reduce(jnp.logical_and, ok)

    (n, group, dv), f32 = o_ref.shape, jnp.float32
    lse = pltriton.load(l_ref, mask=inside((n, group), (0, 1)), other=jnp.asarray(-jnp.inf, f32)).astype(f32)
    lse = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)  # an empty part's lse may be +∞ (its sum 0 inverted)
    top = jnp.max(lse, axis=0)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse - shift[None, :])
    total = jnp.sum(weights, axis=0)
    o = pltriton.load(o_ref, mask=inside((n, group, dv), (0, 1, 2)), other=jnp.zeros((), o_ref.dtype))
    acc = jnp.sum(weights[:, :, None] * o.astype(f32), axis=0)
    seen = total > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, total, 1.0)[:, None], 0.0)
    pltriton.store(out_ref, out.astype(out_ref.dtype), mask=inside((group, dv), (1, 2)))
    lse_out = jnp.where(seen, shift + jnp.log(jnp.where(seen, total, 1.0)), -jnp.inf)
    pltriton.store(lse_ref, lse_out, mask=inside((group,), (1,)))
