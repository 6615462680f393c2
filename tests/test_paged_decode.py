"""Paged decoding (``nc.decode_attention(page_table=)``), the KV cache and greedy generation, against references
written here with jax.numpy: gather each sequence's pages, mask by length and the new tokens' causal tail, attend."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import rel_err
from test_decode import kernels_and_ops

import napkin_cat as nc
from lowering import KVCache, NotLowerable, decode_cost
from lowering._decode import _step, decode_plan
from napkin_cat.errors import CostError, EvaluationError
from papers.flash_attention.generate import TinyLM, generate, greedy_reference

#: max |out − ref| / max |ref| by dtype: measured on these cases (12 draws each) at most 4.0e-7 (f32) and 3.8e-3
#: (bf16: its output's rounding; an absolute 1e-2 failed on an output of 2.0055 written as bf16 2.0156, where the
#: bf16 ulp is 0.0156). The bound for bf16 is two of its ulps relative to the largest output, 2⁻⁷.
RTOL = {"float32": 2e-6, "bfloat16": 2**-7}

#: (dtype, B, Nq, H, H_kv, page_size, pages per sequence, pool, chunk): GQA 4, 2, 2, 3; 2 pages, half a page and 1
#: page per streamed chunk; Nq = 1, 4, 64 (128 rows: one row tile; more in test_decode_rows.py) and 5 (15 rows: a
#: row tile the kernel reads and writes masked past them)
CASES = [
    ("float32", 2, 1, 8, 2, 8, 5, 12, 16),
    ("float32", 2, 4, 4, 2, 32, 2, 6, 16),
    ("bfloat16", 1, 64, 2, 1, 16, 5, 7, 16),
    ("bfloat16", 3, 5, 6, 2, 16, 7, 23, 16),
]


def reference(q, k_pages, v_pages, table, lengths, score_mod=None, mask_mod=None):
    """Each sequence's pages gathered in table order; query i sees keys j < lengths − Nq + i + 1; f32. The index
    functions, where given, see ``b``, ``h`` and ``kv_idx`` (the key's position in its sequence) by name."""
    (batch, nq, heads, dim), kv_heads = q.shape, k_pages.shape[2]
    k, v = (p[table].reshape(batch, -1, kv_heads, p.shape[-1]).astype(jnp.float32) for p in (k_pages, v_pages))
    k, v = (jnp.repeat(a, heads // kv_heads, axis=2) for a in (k, v))
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), k) / np.sqrt(dim)
    b, h, j = jnp.arange(batch)[:, None, None, None], jnp.arange(heads)[:, None, None], jnp.arange(k.shape[1])
    at = {"b": b, "h": h, "kv_idx": j}
    if score_mod is not None:
        s = score_mod(s, **{n: at[n] for n in list(inspect.signature(score_mod).parameters)[1:]})
    last = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    keep = (jnp.arange(k.shape[1])[None, None, :] <= last[:, :, None])[:, None]
    if mask_mod is not None:
        keep = keep & mask_mod(**{n: at[n] for n in inspect.signature(mask_mod).parameters})
    return jnp.einsum("bhij,bjhd->bihd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), v)


def draw(case, seed: int):
    """q, the pools and a table of distinct pages (a permutation of the pool, cut), drawn from ``seed``."""
    dtype, batch, nq, heads, kv_heads, page_size, width, pool, _ = case
    r = np.random.default_rng(seed)
    q = r.standard_normal((batch, nq, heads, 16), np.float32)
    k, v = (r.standard_normal((pool, page_size, kv_heads, 16), np.float32) for _ in range(2))
    table = np.stack([r.permutation(pool)[:width] for _ in range(batch)]).astype(np.int32)
    return (*(jnp.asarray(a).astype(dtype) for a in (q, k, v)), jnp.asarray(table))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_paged_decode_matches_reference(case, seed, data):
    q, k, v, table = draw(case, seed)
    nq, keys = case[2], case[5] * case[6]
    length = st.sampled_from([nq, keys]) | st.integers(nq, keys)
    lengths = jnp.array(data.draw(st.lists(length, min_size=case[1], max_size=case[1])))
    out, lse = nc.decode_attention(q, k, v, lengths, page_table=table, chunk=case[8], return_residual=True)
    err = rel_err(out, reference(q, k, v, table, lengths))
    assert out.dtype == q.dtype and err <= RTOL[case[0]], (case, seed, lengths, err)
    assert lse.shape == q.shape[:3] and bool(jnp.all(jnp.isfinite(lse)))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES[:2]), seed=st.integers(0, 2**31 - 1), backend=st.sampled_from(["triton", "xla"]))
def test_index_functions_read_each_key_at_its_position_through_the_page_table(case, seed, backend):
    """FlexDecoding's convention over a paged cache: ``kv_idx`` is the key's position in its sequence (page
    ``kv_idx // page_size`` of its table row), ``b`` the sequence, whatever pool page holds it."""
    q, k, v, table = draw(case, seed)
    lengths = jnp.asarray(np.random.default_rng(seed).integers(case[2], case[5] * case[6] + 1, case[1]), jnp.int32)
    score_mod = lambda s, h, kv_idx: s - 0.25 * h * (kv_idx % 3)  # noqa: E731
    mask_mod = lambda b, kv_idx: kv_idx != 2 + b  # noqa: E731
    out = nc.decode_attention(q, k, v, lengths, page_table=table, chunk=case[8], score_mod=score_mod,
                              mask_mod=mask_mod, backend=backend)  # fmt: skip
    want = reference(q, k, v, table, lengths, score_mod, mask_mod)
    assert rel_err(out, want) <= RTOL[case[0]], (case, seed, backend, lengths)


def test_a_crowded_grid_reads_two_pages_per_chunk(seed):
    """A grid of more than two programs per SM with each cache in one part (B = 64 at 4k keys on an H200; here 3
    sequences × 2 KV heads on a GPU of 2 SMs) streams 128 keys at D = 128 in 16 bits: two pages of 64, each key's
    page gathered (``PageMap.load``), against the reference written here, on Triton (interpreted) and XLA."""
    from dataclasses import replace

    from napkin_cat.hardware import H100

    r = np.random.default_rng(seed)
    q = jnp.asarray(r.standard_normal((3, 1, 4, 128), np.float32)).astype(jnp.bfloat16)
    k, v = (jnp.asarray(r.standard_normal((9, 64, 2, 128), np.float32)).astype(jnp.bfloat16) for _ in range(2))
    table = jnp.asarray(r.permutation(9)[:6].reshape(3, 2), jnp.int32)  # 2 pages each, shuffled
    lengths = jnp.array([128, 1 + seed % 128, 65])
    small = replace(H100, sms=2)
    plan = decode_plan(q, k, v, lengths, page_table=table, hardware=small)
    assert (plan.summary()["parts"], plan.summary()["chunk"]) == (1, 128), plan.summary()
    want = reference(q, k, v, table, lengths)
    for backend in ("triton", "xla"):
        out = nc.decode_attention(q, k, v, lengths, page_table=table, hardware=small, backend=backend)
        assert rel_err(out, want) <= RTOL["bfloat16"], (backend, seed, lengths)


@pytest.mark.parametrize(("page", "chunk"), [(64, 128), (128, 64)])
def test_mosaic_copies_each_chunk_from_its_pages(seed, page, chunk):
    """``backend="mosaic"`` (interpreted): ``Nq`` = 64 over a GQA group of 2 (128 rows, one tile over two consumer
    warpgroups) through a random page table, in two parts; a chunk of 128 keys two TMA copies of pages of 64 into one
    ring slot, or 64 keys a window of a page of 128; lengths drawn, against the reference written here."""
    r = np.random.default_rng(seed)
    width = 256 // page
    q = jnp.asarray(r.standard_normal((2, 64, 2, 16), np.float32)).astype(jnp.bfloat16)
    k, v = (jnp.asarray(r.standard_normal((2 * width + 1, page, 1, 16), np.float32)).astype(jnp.bfloat16)
            for _ in range(2))  # fmt: skip
    table = jnp.asarray(np.stack([r.permutation(2 * width + 1)[:width] for _ in range(2)]).astype(np.int32))
    lengths = jnp.array([64 + seed % 193, 256])
    plan = decode_plan(q, k, v, lengths, page_table=table, parts=2, chunk=chunk, backend="mosaic")
    assert (plan.summary()["backend"], plan.summary()["chunk"]) == ("mosaic", chunk), plan.summary()
    out = nc.decode_attention(q, k, v, lengths, page_table=table, parts=2, chunk=chunk, backend="mosaic")
    assert rel_err(out, reference(q, k, v, table, lengths)) <= RTOL["bfloat16"], (seed, lengths)


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_one_part_writes_the_output_and_its_lse_with_no_merge(seed, backend):
    """In one part the paged kernel's output (in q's dtype) and log-sum-exp are the step's: against references written
    here (the lse the log Σ exp of each row's scores over its keys), and the trace launches the one kernel (or, on
    XLA, no merge's reduction), reading the table as given."""
    # bf16, Nq = 5 of GQA 3 over 2 KV heads; 8 pages a sequence (Triton pads a table row to a power of two)
    case = ("bfloat16", 3, 5, 6, 2, 16, 8, 27, 16)
    q, k, v, table = draw(case, seed)
    keys = case[5] * case[6]
    lengths = jnp.asarray(np.random.default_rng(seed).integers(case[2], keys + 1, case[1]), jnp.int32)
    step = lambda q, k, v, n, t: nc.decode_attention(q, k, v, n, page_table=t, parts=1, chunk=case[8],  # noqa: E731
                                                     backend=backend, return_residual=True)  # fmt: skip
    out, lse = step(q, k, v, lengths, table)
    err = rel_err(out, reference(q, k, v, table, lengths))
    assert out.dtype == q.dtype and err <= RTOL["bfloat16"], (seed, lengths, err)
    kk = jnp.repeat(k[table].reshape(case[1], keys, 2, 16).astype(jnp.float32), 3, axis=2)
    s = jnp.einsum("bihd,bjhd->bihj", q.astype(jnp.float32), kk) / 4.0
    keep = jnp.arange(keys) <= (lengths[:, None] - case[2] + jnp.arange(case[2]))[:, :, None, None]
    want = jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf), axis=-1)
    assert float(jnp.max(jnp.abs(lse - want))) <= 1e-5, (seed, lengths)  # as tests/test_decode.py's LSE_ATOL
    kernels, ops = kernels_and_ops(step, q, k, v, lengths, table)
    assert kernels == ([] if backend == "xla" else ["napkin_kernel"]) and "reduce" not in ops, (kernels, ops)
    if backend == "triton":  # the rows packed and unpacked (transposes: Nq = 5 over 2 KV heads); no pad, cast or merge
        assert set(ops) == {"reshape", "transpose"} and ops.count("transpose") == 3, ops


def test_shortest_and_longest_lengths_in_one_part_and_on_the_xla_backend():
    """Lengths Nq and S_max; Triton in one part, chunks of two pages; XLA, chunks of half a page (its window)."""
    for case, backend, parts, lengths in ((CASES[0], "triton", 1, [1, 40]), (CASES[1], "xla", None, [4, 64])):
        q, k, v, table = draw(case, 5)
        out = nc.decode_attention(q, k, v, jnp.array(lengths), page_table=table, parts=parts, chunk=16, backend=backend)
        assert rel_err(out, reference(q, k, v, table, jnp.array(lengths))) <= RTOL["float32"], backend


def test_one_kernel_serves_every_table_and_length():
    case = CASES[1]
    q, k, v, table = draw(case, 11)
    step = jax.jit(lambda q, k, v, t, n: nc.decode_attention(q, k, v, n, page_table=t, chunk=16))
    for lengths in ([64, 4], [3, 2]):  # a worker's first decode may trace twice (seen under xdist only): then count
        step(q, k, v, table, jnp.array(lengths))
    before = (_step._cache_size(), step._cache_size())
    r = np.random.default_rng(12)
    for lengths in ([4, 5], [64, 64], [9, 33]):
        table = jnp.asarray(np.stack([r.permutation(case[7])[: case[6]] for _ in range(2)]).astype(np.int32))
        got = step(q, k, v, table, jnp.array(lengths))
        assert rel_err(got, reference(q, k, v, table, jnp.array(lengths))) <= RTOL["float32"]
    assert (_step._cache_size(), step._cache_size()) == before


def test_mla_through_a_page_table():
    """MLA's latent and rotary caches paged by one table: the same kernel as contiguous, read through it."""
    seed = int(np.random.default_rng().integers(2**16))
    r = np.random.default_rng(seed)
    (b, h, c, rot, page, width, pool), lengths = (2, 8, 32, 16, 16, 3, 7), jnp.array([48, 17])
    q = jnp.asarray(r.standard_normal((b, 1, h, c + rot), np.float32))
    pools = [jnp.asarray(r.standard_normal((pool, page, n), np.float32)) for n in (c, rot)]
    table = jnp.asarray(np.stack([r.permutation(pool)[:width] for _ in range(b)]).astype(np.int32))
    latent, rope = (p[table].reshape(b, width * page, -1) for p in pools)
    s = jnp.einsum("bqhd,bkd->bhqk", q, jnp.concatenate([latent, rope], -1)) / np.sqrt(c + rot)
    keep = jnp.arange(width * page)[None, None, None, :] < lengths[:, None, None, None]
    want = jnp.einsum("bhqk,bkc->bqhc", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), latent)
    for values in (None, 16):  # the latent output dims in one program, or in two of 16
        out = nc.mla_decode_attention(q, *pools, lengths, page_table=table, chunk=16, values=values)
        assert out.shape == (b, 1, h, c) and rel_err(out, want) <= RTOL["float32"], (seed, values)


def test_paged_refusals_are_typed():
    q, k, v, table = draw(CASES[0], 1)
    lengths = jnp.array([3, 4])
    with pytest.raises(EvaluationError, match="page_table must be int32 .B, pages_per_seq. = .2, …., got float32"):
        nc.decode_attention(q, k, v, lengths, page_table=table.astype(jnp.float32))
    with pytest.raises(EvaluationError, match=r"got int32 \(1, 5\)"):
        nc.decode_attention(q, k, v, lengths, page_table=table[:1])
    with pytest.raises(EvaluationError, match="chunk=12 keys must be whole pages or a divisor of one"):
        nc.decode_attention(q, k, v, lengths, page_table=table, chunk=12)
    with pytest.raises(EvaluationError, match="chunk=8 keys with pages of 8: the streamed chunk must be a power"):
        nc.decode_attention(q, k, v, lengths, page_table=table, chunk=8)
    with pytest.raises(EvaluationError, match=r"lengths \[41\] outside \[Nq, S\] = \[1, 40\]"):
        nc.decode_attention(q, k, v, jnp.array([41, 3]), page_table=table)
    with pytest.raises(EvaluationError, match=r"page_table\[1, 0\] = 12 is no page of the pool \[0, 12\)"):
        nc.decode_attention(q, k, v, lengths, page_table=table.at[1, 0].set(12))
    with pytest.raises(EvaluationError, match="page pools .P, page_size, H_kv, D. of one P"):
        nc.decode_attention(q, k, v[:3], lengths, page_table=table)
    with pytest.raises(EvaluationError, match=r"parts must be an integer in \[1, 3\]"):
        nc.decode_attention(q, k, v, lengths, page_table=table, parts=4, chunk=16)
    with pytest.raises(NotLowerable, match="g = 16 splits over 1 consumer warpgroups into rows that must be multiples"):
        nc.decode_attention(q, k, v, lengths, page_table=table, backend="mosaic")  # Nq = 1: 8 rows per KV head
    mla = jnp.zeros((2, 1, 8, 48)), jnp.zeros((7, 16, 32)), jnp.zeros((7, 16, 16))
    with pytest.raises(NotLowerable, match="backend='mosaic' has no MLA kernel"):
        nc.mla_decode_attention(*mla, jnp.array([3, 4]), page_table=table[:, :3], backend="mosaic")
    with pytest.raises(NotLowerable, match="score_mod .* reads q_idx"):
        nc.decode_attention(q, k, v, lengths, page_table=table, score_mod=lambda s, q_idx, kv_idx: s * q_idx)
    with pytest.raises(EvaluationError, match="chunk=24 keys per streamed chunk must be a power of two"):
        nc.decode_attention(q, k[:2], v[:2], lengths, chunk=24)  # a contiguous cache's chunk
    with pytest.raises(CostError, match="1 lengths for a batch of 2"):
        decode_cost(batch=2, queries=1, heads=4, kv_heads=2, dim=16, lengths=[8], parts=1)


def test_cache_appends_in_pages_and_attends_like_a_contiguous_cache():
    r = np.random.default_rng(3)
    k, v, q = (jnp.asarray(r.standard_normal(s, np.float32)) for s in ((2, 7, 2, 16), (2, 7, 2, 16), (2, 3, 4, 16)))
    got = {}
    for page_size in (None, 4):
        cache = KVCache.empty(batch=2, max_len=12, kv_heads=2, dim=16, page_size=page_size)
        cache = cache.append(k[:, :4], v[:, :4]).append(k[:, 4:], v[:, 4:])
        got[page_size] = cache.attend(q)
    want = jax.nn.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((3, 7), bool), 4)[None, None])
    for out in got.values():
        assert rel_err(out, want) <= RTOL["float32"]


def test_generation_through_a_paged_cache_gives_jax_nns_greedy_tokens():
    seed = int(np.random.default_rng().integers(2**16))
    sizes = dict(vocab=32, features=32, heads=4, kv_heads=2, layers=1, max_len=12)
    prompt = jax.random.randint(jax.random.key(seed), (2, 6), 0, 32)
    model = TinyLM(**sizes, rngs=nnx.Rngs(seed))
    same = TinyLM(**sizes, attention_fn=jax.nn.dot_product_attention, rngs=nnx.Rngs(seed))
    got, want = generate(model, prompt, 4, page_size=4), greedy_reference(same, prompt, 4)
    assert got.tolist() == want.tolist(), seed
