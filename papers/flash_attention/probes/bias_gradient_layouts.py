"""Why the gradient kernel of a bias shared by the heads (dB) runs at a third of dQ's rate (GPU): the lowered kernel
streams the heads one at a time as chunks of one, so its blocks are ``[q, x, 1]`` (the head a unit axis) and each
product is widened back to three axes after its 2-D ``jnp.dot``. This probe times, at the same blocks, warps and
stages, hand-written Pallas Triton versions of the same kernel: scores on 2-D blocks, and the same with every score
block widened to ``[q, x, 1]`` (or ``[1, q, x]``) and summed over the unit axis as the lowered kernel does, beside
the lowered kernel itself (the learnable table's step, ``front_door.with_table``, its dB kernel read from CUPTI).
Each hand-written kernel is checked against jnp first.

    python papers/flash_attention/probes/bias_gradient_layouts.py [N]
"""

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lowering._timing import time_calls
from papers.flash_attention.probes.table_gradient_kernels import print_step

LOG2E = 1.4426950408889634


def db_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, bias_ref, out_ref, *, t, heads, scale, unit):
    """One (batch, query tile, key tile): Σ_h P_h ⊙ (dO_h·V_hᵀ − Δ_h), causal, heads looped; hidden tiles run none."""
    i, j = pl.program_id(1), pl.program_id(2)
    rows = i * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), 0)
    cols = j * t + jax.lax.broadcasted_iota(jnp.int32, (t, t), 1)
    keep = rows >= cols
    bias = bias_ref[...]

    def head(h, acc):
        qh, kh, vh, doh = (r[:, h, :] for r in (q_ref, k_ref, v_ref, do_ref))
        lse, delta = lse_ref[h, :], delta_ref[h, :]
        s = jnp.dot(qh, kh.T, preferred_element_type=jnp.float32)
        dp = jnp.dot(doh, vh.T, preferred_element_type=jnp.float32)
        if unit == "last":  # the lowered kernel's blocks: [q, x, 1], summed over the unit axis into the accumulator
            s3 = s[:, :, None] * scale + bias[:, :, None]
            s3 = jnp.where(keep[:, :, None], s3, -jnp.inf)
            p3 = jnp.exp2((s3 - lse[:, None, None]) * LOG2E)
            ds3 = p3 * (dp[:, :, None] - delta[:, None, None])
            return acc + jnp.sum(jnp.where(keep[:, :, None], ds3, 0.0), axis=2)
        if unit == "first":  # the unit axis in front: [1, q, x]
            s3 = s[None] * scale + bias[None]
            s3 = jnp.where(keep[None], s3, -jnp.inf)
            p3 = jnp.exp2((s3 - lse[None, :, None]) * LOG2E)
            ds3 = p3 * (dp[None] - delta[None, :, None])
            return acc + jnp.sum(jnp.where(keep[None], ds3, 0.0), axis=0)
        s = jnp.where(keep, s * scale + bias, -jnp.inf)
        p = jnp.exp2((s - lse[:, None]) * LOG2E)
        return acc + jnp.where(keep, p * (dp - delta[:, None]), 0.0)

    steps = (j <= i).astype(jnp.int32) * heads  # arithmetic, as Triton types a select of literals i1
    out_ref[...] = jax.lax.fori_loop(jnp.int32(0), steps, head, jnp.zeros((t, t), jnp.float32))


def hand_db(q, k, v, do, lse, delta, bias, *, t=64, warps=4, stages=1, unit=None):
    b, n, h, d = q.shape
    seq = pl.BlockSpec((None, t, h, d), lambda bi, i, j: (bi, i, 0, 0))
    key = pl.BlockSpec((None, t, h, d), lambda bi, i, j: (bi, j, 0, 0))
    row = pl.BlockSpec((None, h, t), lambda bi, i, j: (bi, 0, i))
    return pl.pallas_call(
        partial(db_kernel, t=t, heads=h, scale=d**-0.5, unit=unit),
        grid=(b, n // t, n // t),
        in_specs=[seq, key, key, seq, row, row, pl.BlockSpec((t, t), lambda bi, i, j: (i, j))],
        out_specs=pl.BlockSpec((None, t, t), lambda bi, i, j: (bi, i, j)),
        out_shape=jax.ShapeDtypeStruct((b, n, n), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=jax.default_backend() == "cpu",
    )(q, k, v, do, lse, delta, bias)


def reference(q, k, v, do, bias):
    """dB in jnp, f32: the softmax's backward summed over the heads, and the lse and Δ it reads."""
    q, k, v, do = (a.astype(jnp.float32) for a in (q, k, v, do))
    n, d = q.shape[1], q.shape[-1]
    i = jnp.arange(n)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * d**-0.5 + bias
    s = jnp.where(i[:, None] >= i[None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v)
    return jnp.sum(p * (dp - delta[..., None]), axis=1), lse, delta


def main(n: int) -> None:
    b, h, d = 2, 16, 128
    q, k, v, do = (jax.random.normal(jax.random.key(i), (b, n, h, d), jnp.bfloat16) for i in range(4))
    bias = 0.1 * jax.random.normal(jax.random.key(5), (n, n), jnp.float32)
    m = min(n, 1024)  # checked on one sequence's first m positions
    one = (q[:1, :m], k[:1, :m], v[:1, :m], do[:1, :m], bias[:m, :m])
    want, lse1, delta1 = jax.jit(reference)(*one)
    _, lse, delta = jax.jit(reference)(q, k, v, do, bias)
    print(f"{jax.devices()[0].device_kind}: B={b} H={h} N={n} D={d}, bf16, causal; dB kernels", flush=True)
    for name, kw in (
        ("hand, 2-D blocks, 4 warps, 1 stage", {}),
        ("hand, 2-D blocks, 4 warps, 2 stages", {"stages": 2}),
        ("hand, 2-D blocks, 8 warps, 128 rows, 1 stage", {"t": 128, "warps": 8}),
        ("hand, [q, x, 1] blocks (the lowered kernel's), 4 warps, 1 stage", {"unit": "last"}),
        ("hand, [1, q, x] blocks, 4 warps, 1 stage", {"unit": "first"}),
    ):
        f = jax.jit(partial(hand_db, **kw))
        try:
            got = f(*one[:4], lse1, delta1, one[4])
            err = float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want)))
            ms = time_calls(f, q, k, v, do, lse, delta, bias).ms
            print(f"  {ms:8.3f} ms  rel err {err:.1e}  {name}", flush=True)
        except Exception as e:  # a configuration Triton refuses is a result
            print(f"  failed: {type(e).__name__}: {str(e)[:200]}  {name}", flush=True)
    ct = jax.random.normal(jax.random.key(9), q.shape, jnp.bfloat16)
    table = 0.1 * jax.random.normal(jax.random.key(11), (2 * n - 1,), jnp.float32)
    print_step("learnable table", q, k, v, table, ct)  # the lowered kernels, dB among them


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8192)
