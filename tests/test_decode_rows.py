"""Decoding's rows per program and parts: a KV head's ``Nq · H/H_kv`` rows cut into as few row tiles as the backend
holds (each tile's program reads the cache), any tile giving the same values as a reference written here with
jax.numpy (gather the pages, mask by length and the new tokens' causal tail, attend); the parts filling whole waves
of SMs; ``decode_cost`` counting each row tile's read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from references import rel_err

import napkin_cat as nc
from lowering import decode_cost
from lowering._decode import _parts, decode_plan, row_tiles
from lowering._paged import paged_split
from napkin_cat.errors import CostError, EvaluationError
from napkin_cat.hardware import H100
from rewrites import choose_parts

#: max |out − ref| / max |ref|, bf16: two of its ulps relative to the largest output, as test_paged_decode's (an
#: absolute 1e-2 there failed on one bf16 ulp at 2.0; measured here at most 3.9e-3 absolute, the output's rounding)
RTOL = 2**-7


def reference(q, k, v, lengths):
    """f32; query head h reads KV head h // group; query i sees keys j < lengths − Nq + i + 1."""
    (_, nq, heads, dim), kv_heads = q.shape, k.shape[2]
    k, v = (jnp.repeat(a.astype(jnp.float32), heads // kv_heads, axis=2) for a in (k, v))
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), k) / np.sqrt(dim)
    last = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    keep = (jnp.arange(k.shape[1])[None, None, :] <= last[:, :, None])[:, None]
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), v)


def paged_and_contiguous(r, b, nq, h, h_kv, d, page, width, pool):
    """bf16 queries ``[b, nq, h, d]``, a pool of ``pool`` pages of K and V, a random page table of ``width`` pages per
    sequence, and the same keys laid out contiguous: ``(q, k_pages, v_pages, table, k, v)``."""
    q = jnp.asarray(r.standard_normal((b, nq, h, d), np.float32)).astype(jnp.bfloat16)
    k, v = (jnp.asarray(r.standard_normal((pool, page, h_kv, d), np.float32)).astype(jnp.bfloat16) for _ in "kv")
    table = jnp.asarray(np.stack([r.permutation(pool)[:width] for _ in range(b)]).astype(np.int32))
    kc, vc = (p[table].reshape(b, page * width, h_kv, d) for p in (k, v))  # the same keys, contiguous
    return q, k, v, table, kc, vc


def test_nq64_rows_in_any_tile_match_the_reference_contiguous_and_paged():
    """Nq = 64 at GQA 4: 256 rows per KV head, by default 2 tiles of 128, and 1 of 256; through a random page table
    of 16-key pages in 4 tiles of 64; lengths Nq and S_max."""
    seed = int(np.random.default_rng().integers(2**31))
    r = np.random.default_rng(seed)
    b, nq, h, h_kv, d, page, width = 2, 64, 4, 1, 16, 16, 6
    s = page * width
    q, k, v, table, kc, vc = paged_and_contiguous(r, b, nq, h, h_kv, d, page, width, pool=2 * width + 1)
    lengths = jnp.array([nq, s])
    want = reference(q, kc, vc, lengths)
    assert decode_plan(q, kc, vc, lengths, parts=2).summary()["row_tiles"] == 2
    for tile, tiles in ((None, 2), (256, 1)):
        got = nc.decode_attention(q, kc, vc, lengths, tile=tile, parts=2)
        err = rel_err(got, want)
        assert err <= RTOL and row_tiles(nq * h // h_kv, (d, d), tile) == tiles, (seed, tile, err)
    paged = nc.decode_attention(q, k, v, lengths, page_table=table, chunk=32, parts=2, tile=64)  # 4 row tiles
    assert rel_err(paged, want) <= RTOL, seed


def test_a_last_row_tile_past_the_rows_is_read_and_written_masked(seed):
    """Nq = 5 at GQA 4: 20 rows per KV head in tiles of 16, the second holding 4 (the kernel reads and writes its
    rows masked past them: no padding of the queries), contiguous and through a random page table; lengths drawn,
    the shortest Nq."""
    r = np.random.default_rng(seed)
    b, nq, h, h_kv, d, page, width = 3, 5, 8, 2, 16, 16, 5
    s = page * width
    q, k, v, table, kc, vc = paged_and_contiguous(r, b, nq, h, h_kv, d, page, width, pool=3 * width + 2)
    lengths = jnp.asarray([nq, *r.integers(nq, s + 1, b - 1)])
    want = reference(q, kc, vc, lengths)
    assert decode_plan(q, kc, vc, lengths, tile=16, parts=2).summary()["row_tiles"] == 2
    for got in (nc.decode_attention(q, kc, vc, lengths, tile=16, parts=2),
                nc.decode_attention(q, k, v, lengths, page_table=table, chunk=16, parts=2, tile=16)):  # fmt: skip
        err = rel_err(got, want)
        assert got.shape == q.shape and err <= RTOL, (seed, lengths, err)


def test_a_tile_of_no_power_of_two_is_refused_before_anything_is_built():
    q, kv = jnp.zeros((1, 4, 8, 16)), jnp.zeros((1, 32, 2, 16))
    with pytest.raises(EvaluationError, match=r"tile=48 rows per program must be a power of two from 16 to 256"):
        nc.decode_attention(q, kv, kv, jnp.array([8]), tile=48)


@pytest.mark.parametrize("programs", [1, 3, 8, 24, 64, 128, 133, 512])
def test_parts_fill_whole_waves(programs):
    """No count up to ``choose_parts``'s fills its last wave of SMs better; 8 KV heads take 16 parts (one wave on
    132 SMs, not 17: two), contiguous and paged alike."""
    top = choose_parts(programs, 1 << 20, H100)
    fill = lambda n: programs * n / (H100.sms * -(-programs * n // H100.sms))  # noqa: E731
    n = _parts(1, programs, 1 << 20, H100, exact=False)
    assert 1 <= n <= top and all(fill(n) >= fill(m) for m in range(1, top + 1))
    exact = _parts(1, programs, 1 << 20, H100)  # a divisor of the keys: the contiguous cache is read by a reshape
    assert (1 << 20) % exact == 0 and 2 * exact >= top
    assert (
        _parts(1, 8, 32768, H100) == 16
        and paged_split(512, 64, parts=None, chunk=64, n_default=_parts(1, 8, 32768, H100, exact=False))[0] == 16
    )


def test_decode_cost_reads_the_cache_once_per_row_tile():
    # 8 KV heads × 8 parts × 2 tiles = 128 programs, all at once on 132 SMs: the L2 serves the second tile's read
    # (ncu's DRAM counter, results/decode_counters_NVIDIA_H200_stop48.json); at 16 parts, two waves: DRAM serves it
    shape = dict(batch=1, queries=64, heads=32, kv_heads=8, dim=128, lengths=[4096])
    cache = 4096 * 8 * 256 * 2
    for parts, dram, l2 in ((8, 0, cache), (16, cache, 0)):
        one, two = (decode_cost(**shape, parts=parts, row_tiles=t) for t in (1, 2))
        assert (two.kernel_bytes - one.kernel_bytes, two.l2_bytes, one.l2_bytes) == (dram, l2, 0)
        assert two.flops == one.flops
    with pytest.raises(CostError, match="row_tiles must be a positive integer"):
        decode_cost(**shape, parts=8, row_tiles=0)
