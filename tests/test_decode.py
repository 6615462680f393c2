"""Split-KV decoding: the rule ``split_kv`` (verified, its merge proved) and ``nc.decode_attention`` against a
reference written here with jax.numpy (softmax over each sequence's valid keys, bottom-right causal alignment)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from references import rel_err

import napkin_cat as nc
from lowering import NotLowerable, decode_cost
from lowering._blocks import Limits
from lowering._decode import _kernel, _step, decode_plan
from lowering._merge import merge, merge_block, parts_per_load
from napkin_cat.errors import EvaluationError
from napkin_cat.generators._softmax import OnlineSoftmax
from rewrites import RewriteError, derive, merge_parts, prove_merge, prove_monoid, split_kv, stream, tile

#: max abs error by dtype: measured on these cases at most 4.8e-7 (f32) and 4.4e-3 (bf16, its output rounding)
ATOL = {"float32": 5e-6, "bfloat16": 1e-2}
#: the same relative to the largest output, for the drawn cases: bf16's two ulps (an absolute 1e-2 failed in
#: test_paged_decode on one bf16 ulp at 2.0), f32's as test_paged_decode measured
RTOL = {"float32": 2e-6, "bfloat16": 2**-7}

#: (dtype, B, Nq, H, H_kv, S, parts): GQA groups 4, 2, 4, 2, 3; Nq = 1, 4, 4, 64 (128 rows: one row tile; more in
#: test_decode_rows.py), 5 (15 rows: a row tile the kernel reads and writes masked past them); parts 2, 3 (S = 38:
#: ragged), 4, 2 and 3 (S = 77); parts 1 below
CASES = [
    ("float32", 2, 1, 8, 2, 40, 2),
    ("float32", 2, 4, 4, 2, 38, 3),
    ("bfloat16", 2, 4, 4, 1, 38, 4),
    ("bfloat16", 1, 64, 2, 1, 80, 2),
    ("bfloat16", 3, 5, 6, 2, 77, 3),
]


def reference(q, k, v, lengths, score_mod=None, mask_mod=None):
    """softmax over the keys j < lengths − Nq + i + 1 of query i, in f32; query head h reads KV head h // group."""
    (_, nq, heads, dim), keys, kv_heads = q.shape, k.shape[1], k.shape[2]
    kk, vv = (jnp.repeat(a.astype(jnp.float32), heads // kv_heads, axis=2) for a in (k, v))
    s = jnp.einsum("bihd,bjhd->bhij", q.astype(jnp.float32), kk) / np.sqrt(dim)
    b, h, j = jnp.arange(q.shape[0])[:, None, None, None], jnp.arange(heads)[None, :, None, None], jnp.arange(keys)
    indices = {"b": b, "h": h, "kv_idx": j}
    if score_mod is not None:
        s = score_mod(s, **{n: indices[n] for n in list(inspect.signature(score_mod).parameters)[1:]})
    last = lengths[:, None] - nq + jnp.arange(nq)[None, :]  # each new token's position
    keep = (j[None, None, :] <= last[:, :, None])[:, None]
    if mask_mod is not None:
        keep = keep & mask_mod(**{n: indices[n] for n in inspect.signature(mask_mod).parameters})
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhij,bjhd->bihd", p, vv)


def draw(case, seed: int):
    dtype, batch, nq, heads, kv_heads, keys, _ = case
    r = np.random.default_rng(seed)
    q, k, v = (r.standard_normal(s, np.float32) for s in ((batch, nq, heads, 16), *[(batch, keys, kv_heads, 16)] * 2))
    return tuple(jnp.asarray(a).astype(dtype) for a in (q, k, v))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(CASES), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_decode_matches_reference(case, seed, data):
    q, k, v = draw(case, seed)
    nq, keys, parts = case[2], case[5], case[6]
    lengths = jnp.array(data.draw(st.lists(st.sampled_from([nq, keys]) | st.integers(nq, keys), min_size=case[1],
                                           max_size=case[1])))  # fmt: skip
    out, lse = nc.decode_attention(q, k, v, lengths, parts=parts, return_residual=True)
    want = reference(q, k, v, lengths)
    err = rel_err(out, want)
    assert out.dtype == q.dtype and err <= RTOL[case[0]], (case, seed, lengths, err)
    assert lse.shape == q.shape[:3] and bool(jnp.all(jnp.isfinite(lse)))


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_decode_on_mosaic_matches_reference(seed, data):
    """``backend="mosaic"`` (interpreted here): 64 new tokens over a GQA group of 2 (128 rows, one tile over two
    consumer warpgroups), ragged lengths, keys split in 2 or 3 parts, against the reference written here."""
    case = ("bfloat16", 2, 64, 2, 1, 80, data.draw(st.sampled_from([2, 3])))
    q, k, v = draw(case, seed)
    lengths = jnp.array(data.draw(st.lists(st.integers(64, 80), min_size=2, max_size=2)))
    out, lse = nc.decode_attention(q, k, v, lengths, parts=case[6], backend="mosaic", return_residual=True)
    err = rel_err(out, reference(q, k, v, lengths))
    assert out.dtype == q.dtype and err <= RTOL[case[0]], (case, seed, lengths, err)
    assert lse.shape == q.shape[:3] and bool(jnp.all(jnp.isfinite(lse)))


def test_lengths_one_and_full_in_one_part():
    case = CASES[0]
    q, k, v = draw(case, 7)
    lengths = jnp.array([1, 40])
    out = nc.decode_attention(q, k, v, lengths, parts=1)
    assert float(jnp.max(jnp.abs(out - reference(q, k, v, lengths)))) <= ATOL["float32"]


def reference_lse(q, k, lengths):
    """log Σ exp of query i's scores over its keys j < lengths − Nq + i + 1, ``[B, Nq, H]`` in f32."""
    (_, nq, heads, dim), keys = q.shape, k.shape[1]
    kk = jnp.repeat(k.astype(jnp.float32), heads // k.shape[2], axis=2)
    s = jnp.einsum("bihd,bjhd->bihj", q.astype(jnp.float32), kk) / np.sqrt(dim)
    last = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    keep = jnp.arange(keys)[None, None, None, :] <= last[:, :, None, None]
    return jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf), axis=-1)


def kernels_and_ops(fn, *args) -> tuple[list[str], list[str]]:
    """The kernels a trace of ``fn(*args)`` launches (Pallas calls by name; Mosaic's ``mpmd_map``) and the primitives
    it runs outside them (looking through ``jit`` and ``custom_vjp``, which launch nothing)."""
    kernels, ops = [], []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            if e.primitive.name in ("pallas_call", "mpmd_map"):
                kernels.append(str(e.params.get("name", e.primitive.name)))
                continue
            if e.primitive.name not in ("jit", "custom_vjp_call"):
                ops.append(e.primitive.name)
            for p in e.params.values():
                for sub in p if isinstance(p, tuple | list) else (p,):
                    if hasattr(sub, "eqns") or hasattr(sub, "jaxpr"):
                        walk(getattr(sub, "jaxpr", sub))

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return kernels, ops


#: max |lse − ref| in one part: measured over 4 draws of each ONE_PART case at most 9.5e-7 (bf16 inputs as f32: the
#: scores are f32), about 8 f32 ulps of an lse near 4
LSE_ATOL = 1e-5

#: (dtype, B, Nq, H, H_kv, S, backend) in one part: Nq = 1 at GQA 4 (the queries' rows a reshape); Nq = 5 of GQA 3
#: over 2 KV heads (rows strided in the caller's layout: transposed); Nq = 64 over one KV head (a reshape); Triton,
#: XLA and Mosaic. Triton's caches are whole chunks of 64 keys (else its forward pads the last: a copy, either path)
ONE_PART = [
    ("float32", 2, 1, 8, 2, 128, "triton"),
    ("bfloat16", 3, 5, 6, 2, 192, "triton"),
    ("float32", 2, 5, 6, 2, 77, "xla"),
    ("bfloat16", 2, 64, 2, 1, 80, "mosaic"),
]


@pytest.mark.parametrize("case", ONE_PART, ids=lambda c: f"{c[0]}-nq{c[2]}-kv{c[4]}-{c[6]}")
def test_one_part_is_the_kernel_alone(seed, case):
    """In one part the kernel writes the step's output in q's dtype and its log-sum-exp, against the references written
    here; no merge runs (``Plan.split`` is false; the trace launches the one kernel, and XLA's has no merge's
    reduction), and outside a Triton kernel only reshapes run, or where a KV head's rows are strided in the
    caller's layout (``Nq`` > 1, grouped heads over several KV heads) the queries', output's and lse's transposes."""
    dtype, batch, nq, heads, kv_heads, keys, backend = case
    q, k, v = draw((*case[:6], 1), seed)
    lengths = jnp.asarray(np.random.default_rng(seed).integers(nq, keys + 1, batch)).at[0].set(keys)
    step = lambda q, k, v, n: nc.decode_attention(q, k, v, n, parts=1, backend=backend, return_residual=True)  # noqa: E731
    out, lse = step(q, k, v, lengths)
    err = rel_err(out, reference(q, k, v, lengths))
    assert out.dtype == q.dtype and err <= RTOL[dtype], (case, seed, lengths, err)
    assert lse.shape == q.shape[:3] and float(jnp.max(jnp.abs(lse - reference_lse(q, k, lengths)))) <= LSE_ATOL
    assert not decode_plan(q, k, v, lengths, parts=1, backend=backend).split
    kernels, ops = kernels_and_ops(step, q, k, v, lengths)
    assert kernels == ([] if backend == "xla" else ["napkin_mosaic"] if backend == "mosaic" else ["napkin_kernel"])
    assert "reduce" not in ops, ops  # XLA's merge
    if backend == "triton":
        strided = nq > 1 and kv_heads > 1
        assert sorted(set(ops)) == ["reshape", "transpose"] if strided else set(ops) == {"reshape"}, ops
        assert ops.count("transpose") == 3 * strided, ops


@pytest.mark.parametrize("backend", ["triton", "xla"])
def test_one_part_gives_a_row_that_sees_no_key_the_merges_lse(backend):
    """A row all of whose keys a mask hides (query head 0 here) has output 0 and log-sum-exp −∞ in one part, as the
    merge of several parts gives it (the kernel's own residual is +∞ there); the other rows match the references."""
    q, k, v = draw(("float32", 2, 1, 4, 2, 40, 1), 4)
    lengths = jnp.array([40, 9])
    got = {n: nc.decode_attention(q, k, v, lengths, parts=n, backend=backend, mask_mod=lambda h: h != 0,
                                  return_residual=True) for n in (1, 2)}  # fmt: skip
    (out, lse), (split_out, split_lse) = got[1], got[2]
    assert bool(jnp.all(out[:, :, 0] == 0)) and bool(jnp.all(lse[:, :, 0] == -jnp.inf))
    assert bool(jnp.all(split_lse[:, :, 0] == -jnp.inf)) and bool(jnp.all(split_out[:, :, 0] == 0))
    assert float(jnp.max(jnp.abs(out[:, :, 1:] - reference(q, k, v, lengths)[:, :, 1:]))) <= ATOL["float32"]
    assert float(jnp.max(jnp.abs(lse[:, :, 1:] - reference_lse(q, k, lengths)[:, :, 1:]))) <= LSE_ATOL


@pytest.mark.parametrize("chunk", [16, 128])
def test_a_contiguous_cache_streams_the_chunk_asked(seed, chunk):
    """``chunk=`` on a contiguous cache: the kernel streams that many keys at a time (a part of 150 keys: ragged
    chunks of 128, whole ones of 16), with the same result as the reference written here."""
    case = ("float32", 2, 4, 4, 2, 300, 2)
    q, k, v = draw(case, seed)
    lengths = jnp.array([4 + seed % 296, 300])
    plan = decode_plan(q, k, v, lengths, parts=2, chunk=chunk)
    assert plan.summary()["chunk"] == chunk and plan.summary()["keys_per_part"] == 150
    out = nc.decode_attention(q, k, v, lengths, parts=2, chunk=chunk)
    assert rel_err(out, reference(q, k, v, lengths)) <= RTOL["float32"], (seed, lengths)
    with pytest.raises(EvaluationError, match="chunk=96 keys per streamed chunk must be a power of two"):
        nc.decode_attention(q, k, v, lengths, chunk=96)


def test_a_crowded_grid_streams_128_keys(seed):
    """A grid of more than two programs per SM with the cache in one part (B = 64 at 4k keys on an H200; here 3
    sequences × 2 KV heads on a GPU of 2 SMs) streams chunks of 128 keys at D = 128 (``lowering._decode.crowded``:
    measured faster there), with the result of the reference written here; a split cache, or f32, keeps 64."""
    from dataclasses import replace

    from napkin_cat.hardware import H100

    r = np.random.default_rng(seed)
    shapes = ((3, 1, 4, 128), *[(3, 128, 2, 128)] * 2)
    q, k, v = (jnp.asarray(r.standard_normal(s, np.float32)).astype(jnp.bfloat16) for s in shapes)
    lengths = jnp.array([128, 1 + seed % 128, 70])
    small = replace(H100, sms=2)
    plan = decode_plan(q, k, v, lengths, hardware=small)
    assert (plan.summary()["parts"], plan.summary()["chunk"]) == (1, 128), plan.summary()
    assert decode_plan(q, k, v, lengths, hardware=small, parts=2).summary()["chunk"] == 64
    out = nc.decode_attention(q, k, v, lengths, hardware=small)
    assert rel_err(out, reference(q, k, v, lengths)) <= RTOL["bfloat16"], (seed, lengths)
    f32 = decode_plan(*(a.astype(jnp.float32) for a in (q, k, v)), lengths, hardware=small)
    assert f32.summary()["chunk"] == 64  # 128 keys of f32 in three stages: over shared memory


def test_index_functions_read_the_cache_position_and_query_head():
    case = ("float32", 2, 1, 4, 2, 24, 3)
    q, k, v = draw(case, 3)

    def score_mod(s, h, kv_idx):
        return s - 0.1 * h - 0.01 * kv_idx

    def mask_mod(b, kv_idx):
        return (kv_idx + b) % 3 != 0

    lengths = jnp.array([24, 5])  # sequence 1's last two parts see no key
    out = nc.decode_attention(q, k, v, lengths, parts=3, score_mod=score_mod, mask_mod=mask_mod)
    want = reference(q, k, v, lengths, score_mod, mask_mod)
    assert float(jnp.max(jnp.abs(out - want))) <= ATOL["float32"]


# PyTorch's FlexAttention test score mods (test/inductor/test_flex_attention.py), five positional parameters whatever
# their names: those that leave the query index unused run verbatim in a decode step
def _identity(score, batch, head, token_q, token_kv):
    return score


def _times_two(score, b, h, m, n):
    return score * 2


def _squared(score, b, h, m, n):
    return score * score


def _trig(score, b, h, m, n):
    return jnp.sin(jnp.cos(score)) + jnp.tan(b)


def _trig2(score, b, h, m, n):
    return jnp.cos(score) * jnp.sin(score) + jnp.tan(b)


def _causal(score, b, h, token_q, token_kv):
    return jnp.where(token_q >= token_kv, score, -jnp.inf)


def _rel_bias(score, b, h, m, n):
    return score + (m - n)


@pytest.mark.parametrize("mod", [_identity, _times_two, _squared, _trig, _trig2])
def test_flexattentions_score_mods_run_verbatim_where_they_leave_q_idx_unused(seed, mod):
    """FlexAttention's convention (``score_mod(score, b, h, q_idx, kv_idx)`` read by position) in a decode step: a
    function whose value does not depend on the query index (``lowering._decode.reads_query``: its trace) runs, against
    the reference written here with the same function on the sequence, query head and key position; one that reads
    it is refused by name (a new token's position is known only when the kernel runs)."""
    case = ("float32", 2, 1, 4, 2, 40, 3)
    q, k, v = draw(case, seed)
    lengths = jnp.array([40, 1 + seed % 40])
    out = nc.decode_attention(q, k, v, lengths, score_mod=mod)
    want = reference(q, k, v, lengths, score_mod=lambda s, b, h, kv_idx: mod(s, b, h, 0, kv_idx))
    assert float(jnp.max(jnp.abs(out - want))) <= ATOL["float32"], (mod.__name__, seed, lengths)
    for reader in (_causal, _rel_bias):
        with pytest.raises(NotLowerable, match=f"score_mod {reader.__name__} reads q_idx"):
            nc.decode_attention(q, k, v, lengths, score_mod=reader)


def test_a_positional_mask_mod_leaving_q_idx_unused_runs(seed):
    """FlexAttention's ``mask_mod(b, h, q_idx, kv_idx)`` under other names, its value free of the query index: a
    decode step runs it, against the reference written here with the same mask on the sequence and key position."""

    def every_third_dropped(batch, head, token_q, token_kv):
        return (token_kv + batch) % 3 != 0

    q, k, v = draw(("float32", 2, 1, 4, 2, 40, 3), seed)
    lengths = jnp.array([40, 2 + seed % 39])
    out = nc.decode_attention(q, k, v, lengths, mask_mod=every_third_dropped)
    want = reference(q, k, v, lengths, mask_mod=lambda b, kv_idx: every_third_dropped(b, 0, 0, kv_idx))
    assert float(jnp.max(jnp.abs(out - want))) <= ATOL["float32"], (seed, lengths)


def test_one_kernel_serves_every_length_under_jit():
    q, k, v = draw(CASES[0], 11)
    step = jax.jit(lambda q, k, v, n: nc.decode_attention(q, k, v, n, parts=2))
    step(q, k, v, jnp.array([40, 3]))
    before = _step._cache_size()
    for lengths in ([5, 6], [40, 40], [1, 17]):
        got = step(q, k, v, jnp.array(lengths))
        assert float(jnp.max(jnp.abs(got - reference(q, k, v, jnp.array(lengths))))) <= ATOL["float32"]
    assert _step._cache_size() == before


def test_refusals_are_typed():
    q, k, v = draw(CASES[0], 1)
    with pytest.raises(EvaluationError, match=r"lengths \[41\] outside \[Nq, S\] = \[1, 40\]"):
        nc.decode_attention(q, k, v, jnp.array([41, 3]))
    with pytest.raises(EvaluationError, match="65 new tokens per sequence; a decode step takes 1 to 64"):
        nc.decode_attention(jnp.zeros((2, 65, 8, 16)), jnp.zeros((2, 80, 2, 16)), jnp.zeros((2, 80, 2, 16)),
                            jnp.array([70, 70]))  # fmt: skip
    with pytest.raises(EvaluationError, match="lengths must be integers of shape"):
        nc.decode_attention(q, k, v, jnp.array([3.0, 4.0]))
    with pytest.raises(NotLowerable, match="reads q_idx"):
        nc.decode_attention(q, k, v, jnp.array([3, 4]), score_mod=lambda s, b, h, q_idx, kv_idx: s + q_idx)
    with pytest.raises(NotLowerable, match="no gradient"):
        jax.grad(lambda q: nc.decode_attention(q, k, v, jnp.array([3, 4]), parts=2).sum())(q)


def test_split_kv_is_verified_including_ragged_parts_and_causal_masks():
    q, d = nc.axes("q d")
    x = nc.Axis("x", 10)
    for n, causal in ((3, True), (4, False)):
        attn = nc.library.attention(nc.Axis("q", 10) if causal else q, x, d, causal=causal)
        made = derive(attn, split_kv(x, n), tile("q", 4), stream(x, 2))
        assert all(s.verification.passed for s in made.steps[1:]), made


def test_split_kv_verification_catches_a_wrong_merge(monkeypatch):
    monkeypatch.setattr(OnlineSoftmax, "combine", lambda self, a, b, ctx: b)  # keeps the last part only
    x = nc.Axis("x", 12)
    with pytest.raises(RewriteError, match="split_kv"):
        derive(nc.library.attention(nc.Axis("q"), x, nc.Axis("d")), split_kv(x, 3), seed=0)


def test_split_kv_refusals():
    q, x, d = nc.axes("q x d")
    with pytest.raises(RewriteError, match="the size of x is symbolic"):
        split_kv(x, 2)(nc.library.attention(q, x, d))
    sized = nc.Axis("x", 8)
    with pytest.raises(RewriteError, match="9 parts exceed the axis size 8"):
        split_kv(sized, 9)(nc.library.attention(q, sized, d))
    with pytest.raises(RewriteError, match="already tiled or streamed"):
        split_kv(sized, 2)(stream(sized, 4)(nc.library.attention(q, sized, d)))
    with pytest.raises(RewriteError, match="an output keeps it"):
        split_kv("q", 2)(nc.library.attention(nc.Axis("q", 8), sized, d))


def test_the_merge_is_proved_and_matches_a_logsumexp():
    assert prove_merge().identities == 6
    box = nc.library.attention(*nc.axes("q x d")).boxes[1]
    sc = nc.softmax_contract(box.dom.inside[0], nc.Array(nc.Axis("x"), nc.Axis("d")), "x", box.cod.inside[0])
    assert prove_monoid(sc, "x", sizes={"q": 1, "x": 3, "d": 1}).cases >= 1
    r = np.random.default_rng(5)
    o, lse = jnp.asarray(r.standard_normal((3, 5, 4), np.float32)), jnp.asarray(r.standard_normal((3, 5), np.float32))
    lse = lse.at[1, 2].set(jnp.inf)  # a part that saw no key of row 2
    o = o.at[1, 2].set(0.0)
    got, total = merge_parts(o, lse, 0)
    seen = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)
    w = jax.nn.softmax(seen, axis=0)
    assert jnp.allclose(got, jnp.einsum("pr,prd->rd", w, o), atol=1e-6)
    assert jnp.allclose(total, jax.nn.logsumexp(seen, axis=0), atol=1e-6)


def mla_reference(q, latent, rope, lengths, scale):
    """MLA written here: scores over the latent and rotary dims, the new tokens' causal tail, values the latent."""
    nq = q.shape[1]
    s = jnp.einsum("bqhd,bkd->bhqk", q, jnp.concatenate([latent, rope], -1)) * scale
    last = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    keep = (jnp.arange(latent.shape[1])[None, None, :] <= last[:, :, None])[:, None]
    return jnp.einsum("bhqk,bkc->bqhc", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), latent)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), nq=st.sampled_from([1, 4]), data=st.data())
def test_mla_matches_reference(seed, nq, data):
    """Absorbed MLA: 8 heads over one latent KV head of 32 dims (also the values) and 16 rotary dims."""
    r = np.random.default_rng(seed)
    b, s, h, c, rot = 2, 40, 8, 32, 16
    q = jnp.asarray(r.standard_normal((b, nq, h, c + rot), np.float32))
    latent, rope = (jnp.asarray(r.standard_normal((b, s, n), np.float32)) for n in (c, rot))
    lengths = jnp.array(data.draw(st.lists(st.sampled_from([nq, s]) | st.integers(nq, s), min_size=b, max_size=b)))
    tile = data.draw(st.sampled_from([None, 16]))  # 16 rows a program: two row tiles at Nq = 4
    values = data.draw(st.sampled_from([None, 16]))  # the 32 latent output dims in two programs of 16
    chunk = data.draw(st.sampled_from([None, 16]))  # a part's 20 keys in one chunk, or two (the last ragged)
    parts = data.draw(st.sampled_from([1, 2]))  # in one part: the kernel alone, no merge
    step = lambda *a: nc.mla_decode_attention(*a, scale=0.1, parts=parts, return_residual=True, tile=tile,  # noqa: E731
                                              values=values, chunk=chunk)  # fmt: skip
    out, lse = step(q, latent, rope, lengths)
    err = float(jnp.max(jnp.abs(out - mla_reference(q, latent, rope, lengths, 0.1))))
    assert out.shape == (b, nq, h, c) and lse.shape == (b, nq, h), (seed, lengths, tile, values)
    assert err <= ATOL["float32"], (seed, lengths, tile, values, parts, err)
    s = jnp.einsum("bqhd,bkd->bqhk", q, jnp.concatenate([latent, rope], -1)) * 0.1
    keep = jnp.arange(s.shape[-1]) <= (lengths[:, None] - nq + jnp.arange(nq))[:, :, None, None]
    assert float(jnp.max(jnp.abs(lse - jax.nn.logsumexp(jnp.where(keep, s, -jnp.inf), axis=-1)))) <= LSE_ATOL
    kernels, ops = kernels_and_ops(step, q, latent, rope, lengths)
    assert len(kernels) == (1 if parts == 1 else 2) and "reduce" not in ops, (kernels, ops)


def test_mla_refusals():
    q, latent, rope = jnp.zeros((2, 1, 8, 48)), jnp.zeros((2, 40, 32)), jnp.zeros((2, 40, 16))
    with pytest.raises(EvaluationError, match=r"q must be \[B, Nq, H, C \+ R\]"):
        nc.mla_decode_attention(q[..., :40], latent, rope, jnp.array([4, 4]))
    with pytest.raises(EvaluationError, match="the caches' dtypes differ"):
        nc.mla_decode_attention(q, latent, rope.astype(jnp.bfloat16), jnp.array([4, 4]))
    with pytest.raises(EvaluationError, match=r"tile=24 rows per program must be a power of two from 16 to 256"):
        nc.mla_decode_attention(q, latent, rope, jnp.array([4, 4]), tile=24)
    with pytest.raises(EvaluationError, match=r"values=24 latent dims per program must be a power of two ≥ 16"):
        nc.mla_decode_attention(q, latent, rope, jnp.array([4, 4]), values=24)
    with pytest.raises(EvaluationError, match=r"chunk=24 keys per streamed chunk must be a power of two from 16"):
        nc.mla_decode_attention(q, latent, rope, jnp.array([4, 4]), chunk=24)


def test_mla_reads_its_latent_once_in_chunks_of_64():
    """The latent keys are one input of MLA's kernel (copied into both products), so DeepSeek-V3's 512 latent dims
    stream 64 keys a chunk by default, contiguous and paged; split across programs (``values``) they are two
    inputs and keep 32."""
    from lowering._decode import _mla_plan

    q, latent, rope = jnp.zeros((1, 1, 128, 576)), jnp.zeros((1, 4096, 512)), jnp.zeros((1, 4096, 64))
    table = jnp.arange(64, dtype=jnp.int32)[None]
    pools = latent.reshape(64, 64, 512), rope.reshape(64, 64, 64)
    for caches, page_table, values, want in ((
            (latent, rope), None, None, 64), ((latent, rope), None, 256, 32), (pools, table, None, 64)):  # fmt: skip
        plan = _mla_plan(q, *caches, jnp.array([4096]), None, page_table, None, None, "xla", None, "H200",
                         values=values)[0]  # fmt: skip
        assert plan.blocks()[1] == want and len(plan.kernel().diagram.dom) == (5 if values else 4) + 3, values


def test_decode_cost_counts_pages_and_mla():
    """Bytes written out here: the cache the chunks visit, the queries per part, the table, each part's (o, lse)."""
    b, nq, h, h_kv, d, n, chunk, lengths = 2, 1, 8, 2, 64, 3, 64, [100, 64]
    keys = 128 + 64  # 100 keys round up to two chunks, 64 to one
    for rope, table, per_key in ((0, 0, h_kv * 2 * d), (0, 4, h_kv * 2 * d), (32, 4, h_kv * (d + 32))):
        c = decode_cost(batch=b, queries=nq, heads=h, kv_heads=h_kv, dim=d, lengths=lengths, parts=n, chunk=chunk,
                        table_width=table, rope=rope, dtype="float32")  # fmt: skip
        partial = b * n * nq * h * (d + 1) * 4
        want = keys * per_key * 4 + b * n * nq * h * (d + rope) * 4 + b * table * 4 + partial
        assert c.kernel_bytes == want and c.merge_bytes == partial + b * nq * h * (d * 4 + 4), (rope, table)
        reads = keys * per_key * 4 + b * n * nq * h * (d + rope) * 4 + b * table * 4  # the kernel's
        assert c.read_bytes == reads + partial, (rope, table)  # and the merge's: each part's (o, lse)
        assert c.flops == 2 * nq * h * (2 * d + rope) * sum(lengths)


def test_chunks_past_a_length_are_not_read():
    """Values past each part's valid keys (rounded up to the kernel's chunks of 64) are NaN: a chunk the kernel read
    and masked would make the output NaN (0 · NaN), so a finite output says those chunks were skipped."""
    r = np.random.default_rng(2)
    q = jnp.asarray(r.standard_normal((2, 1, 4, 16), np.float32))
    k, v = (jnp.asarray(r.standard_normal((2, 256, 2, 16), np.float32)) for _ in range(2))
    lengths = jnp.array([70, 20])  # part 0 (keys 0–127) visits chunks 0–1 and 0; part 1 none
    past = jnp.arange(256)[None, :, None, None] >= jnp.array([128, 64])[:, None, None, None]
    out = nc.decode_attention(q, k, jnp.where(past, jnp.nan, v), lengths, parts=2)
    assert bool(jnp.all(jnp.isfinite(out)))
    assert float(jnp.max(jnp.abs(out - reference(q, k, v, lengths)))) <= ATOL["float32"]


#: the merge's max |out − ref| / max |ref| bound by output dtype. Measured over 60 draws of each case below: f32 at
#: most 4.6e-7 (9.5e-7 absolute; an absolute 1e-6 failed once, at 1.4e-6), bf16 3.3e-3 (its rounding); the bounds
#: are about 16 f32 ulps and two bf16 ulps of the largest output
MERGE_RTOL = {jnp.float32: 2e-6, jnp.bfloat16: 2**-7}


@pytest.mark.parametrize(("parts", "per_load"), [(5, 1), (12, 4), (16, 16)])
def test_the_merge_kernel_matches_a_logsumexp_written_here(seed, parts, per_load):
    """The merge kernel (:func:`lowering._merge.merge`) on sizes no power of two (3 rows, 24 dims: its blocks
    masked), its parts loaded one, four or sixteen at a time, with parts that saw no key (``lse`` ±∞, ``o`` 0) and a
    row no part saw, in bf16 and f32 out."""
    assert parts_per_load(parts, 4 * 32) == per_load  # the rows and dims padded to powers of two
    r = np.random.default_rng(seed)
    o = jnp.asarray(r.standard_normal((2, parts, 2, 2, 3, 24), np.float32))
    lse = jnp.asarray(r.standard_normal((2, parts, 2, 2, 3), np.float32) * 4)
    lse = lse.at[0, 1, 1, 0, 2].set(jnp.inf).at[1, :, 0, 1, 1].set(-jnp.inf)
    o = o.at[0, 1, 1, 0, 2].set(0.0).at[1, :, 0, 1, 1].set(0.0)
    seen = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)
    weights = jnp.nan_to_num(jax.nn.softmax(seen, axis=1))
    want = jnp.einsum("bphir,bphird->bihrd", weights, o)
    want_lse = jax.nn.logsumexp(seen, axis=1).transpose(0, 2, 1, 3)
    for dtype, tol in MERGE_RTOL.items():
        out, total = merge(o, lse, dtype, interpret=True)
        err = rel_err(out, want)
        assert out.dtype == dtype and err <= tol, (seed, err)
        assert bool(jnp.all((total == want_lse) | (jnp.abs(total - want_lse) <= 1e-5))), seed  # −∞ where none saw
    assert float(total[1, 1, 0, 1]) == -jnp.inf and bool(jnp.all(out[1, 1, 0, 1] == 0))


def test_the_merge_splits_few_wide_rows_into_column_blocks(seed):
    """One sequence's 8 rows of 200 dims (MLA's shape, smaller): too few programs, so the merge splits the columns
    into blocks of 64, the last ragged (200 = 3·64 + 8); each block folds its 6 parts two at a time."""
    assert merge_block(1, 8, 200) == (8, 64) and parts_per_load(6, 8 * 64) == 2
    r = np.random.default_rng(seed)
    o = jnp.asarray(r.standard_normal((1, 6, 1, 1, 8, 200), np.float32))
    lse = jnp.asarray(r.standard_normal((1, 6, 1, 1, 8), np.float32) * 4).at[0, 2, 0, 0, 5].set(-jnp.inf)
    weights = jax.nn.softmax(lse, axis=1)
    out, total = merge(o, lse, jnp.float32, interpret=True)
    want = jnp.einsum("bphir,bphird->bihrd", weights, o)
    assert rel_err(out, want) <= MERGE_RTOL[jnp.float32], seed
    assert float(jnp.max(jnp.abs(total - jax.nn.logsumexp(lse, axis=1).transpose(0, 2, 1, 3)))) <= 1e-5, seed


def test_the_merge_along_the_decode_s_parts_axis_matches_a_logsumexp():
    """``merge_parts`` as the decode step calls it (parts on axis 1), against softmax and logsumexp written here."""
    r = np.random.default_rng(4)
    o, lse = jnp.asarray(r.standard_normal((2, 5, 3, 4), np.float32)), jnp.asarray(r.standard_normal((2, 5, 3)))
    lse = lse.at[0, 1, 2].set(jnp.inf).at[1, :, 0].set(-jnp.inf)  # a part that saw no key; a row none saw
    o = o.at[0, 1, 2].set(0.0).at[1, :, 0].set(0.0)
    got, total = merge_parts(o, lse, 1)
    seen = jnp.where(jnp.isfinite(lse), lse, -jnp.inf)
    want = jnp.einsum("bpr,bprd->brd", jnp.nan_to_num(jax.nn.softmax(seen, axis=1)), o)
    assert jnp.allclose(got, want, atol=1e-6)
    assert jnp.allclose(total[0], jax.nn.logsumexp(seen[0], axis=0), atol=1e-6)
    assert jnp.allclose(total[1, 1:], jax.nn.logsumexp(seen[1, :, 1:], axis=0), atol=1e-6)
    assert float(total[1, 0]) == -jnp.inf and bool(jnp.all(got[1, 0] == 0))


#: compiled on a GPU, bf16, max |out − ref| / max |ref|: two bf16 ulps relative to the largest output
GPU_RTOL = 2**-7


@pytest.mark.gpu
def test_compiled_decode_and_mla_match_the_reference_on_a_gpu(seed):
    """The split kernel and the merge compiled, at the shapes the benchmark times (smaller caches): grouped-query
    heads (32 over 8, D = 128, 16 parts' merge; 64 new tokens on Mosaic) and absorbed MLA (128 heads of 512
    latent + 64 rotary dims, one KV head: the merge in column blocks), bf16, against the references written here
    in f32."""
    r = np.random.default_rng(seed)
    lengths = jnp.array([4096, 1500])
    q, k, v = (jnp.asarray(r.standard_normal(s, np.float32)).astype(jnp.bfloat16)
               for s in ((2, 1, 32, 128), (2, 4096, 8, 128), (2, 4096, 8, 128)))  # fmt: skip
    want = reference(q, k, v, lengths)
    err = rel_err(nc.decode_attention(q, k, v, lengths), want)
    assert err <= GPU_RTOL, (seed, err)
    q = jnp.asarray(r.standard_normal((2, 64, 32, 128), np.float32)).astype(jnp.bfloat16)  # Nq = 64 on Mosaic
    want = reference(q, k, v, lengths)
    err = rel_err(nc.decode_attention(q, k, v, lengths, backend="mosaic"), want)
    assert err <= GPU_RTOL, (seed, err)
    err = rel_err(nc.decode_attention(q, k, v, lengths, chunk=128), want)  # Triton, chunks of 128 keys
    assert err <= GPU_RTOL, (seed, err)
    err = rel_err(nc.decode_attention(q, k, v, lengths, backend="mosaic", chunk=128), want)  # positions made in-kernel
    assert err <= GPU_RTOL, (seed, err)
    assert decode_plan(q, k, v, lengths).summary()["backend"] == "mosaic"  # auto's route at 256 rows, D = 128
    err = rel_err(nc.decode_attention(q, k, v, lengths), want)
    assert err <= GPU_RTOL, (seed, err)
    # the same keys through a shuffled page table (pages of 64, two TMA copies per 128-key chunk), auto on Mosaic
    perm = r.permutation(128)
    pools = [c.reshape(128, 64, 8, 128)[perm] for c in (k, v)]
    table = jnp.asarray(np.argsort(perm).reshape(2, 64).astype(np.int32))
    assert decode_plan(q, *pools, lengths, page_table=table).summary()["backend"] == "mosaic"
    err = rel_err(nc.decode_attention(q, *pools, lengths, page_table=table), want)
    assert err <= GPU_RTOL, (seed, err)
    q = jnp.asarray(r.standard_normal((2, 1, 128, 576), np.float32)).astype(jnp.bfloat16)
    latent, rope = (jnp.asarray(r.standard_normal((2, 2048, n), np.float32)).astype(jnp.bfloat16) for n in (512, 64))
    lengths = jnp.array([2048, 700])
    want = mla_reference(*(a.astype(jnp.float32) for a in (q, latent, rope)), lengths, 576**-0.5)
    out = nc.mla_decode_attention(q, latent, rope, lengths)
    err = rel_err(out, want)
    assert err <= GPU_RTOL, (seed, err)


def test_auto_takes_mosaic_where_it_was_measured_faster(monkeypatch):
    """On a Hopper GPU (stood in for here) ``backend="auto"`` runs a contiguous step whose KV head holds 128 rows or
    more (``Nq`` = 64 at GQA 4) at D = 128 in 16 bits on Mosaic, in 128-key chunks; fewer rows, other head dims,
    f32, index functions, parts that are not whole chunks (Mosaic would pad the cache) or a named backend keep what
    they had."""
    import lowering._decode as decode
    from lowering._decode import routed

    # the rows per program: 128 where a KV head holds 128 or more (Triton's tile), 16 for Nq = 1 at GQA 4
    assert routed("auto", None, "bfloat16", 128, (128, 128), (None, None)) == "auto"  # a CPU: no Hopper GPU
    monkeypatch.setattr(decode, "unavailable", lambda interpret: None)
    none = (None, None)
    assert routed("auto", None, "bfloat16", 128, (128, 128), none) == "mosaic"
    assert routed("auto", None, "float16", 128, (128, 128), none) == "mosaic"
    kept = [routed("auto", None, "bfloat16", 16, (128, 128), none),  # Nq = 1: a tile of 16 rows
            routed("auto", None, "bfloat16", 64, (128, 128), none),  # one consumer's 64 rows asked for
            routed("auto", None, "bfloat16", 256, (128, 128), none),  # 256 rows: over Mosaic's shared memory
            routed("auto", None, "bfloat16", 128, (64, 64), none),
            routed("auto", None, "float32", 128, (128, 128), none),
            routed("auto", None, "bfloat16", 128, (128, 128), (lambda s, kv_idx: s, None)),
            routed("auto", None, "bfloat16", 128, (128, 128), none, (8, 4000, 32000)),  # parts of ragged chunks
            routed("triton", None, "bfloat16", 128, (128, 128), none)]  # fmt: skip
    assert kept == ["auto"] * 7 + ["triton"]
    assert routed("auto", None, "bfloat16", 128, (128, 128), none, (8, 4096, 32768)) == "mosaic"
    z, kv = jnp.zeros((1, 64, 32, 128), jnp.bfloat16), jnp.zeros((1, 4096, 8, 128), jnp.bfloat16)
    summary = decode_plan(z, kv, kv, jnp.array([4096]), interpret=False, hardware="H200").summary()
    assert (summary["backend"], summary["chunk"], summary["tile"]) == ("mosaic", 128, 128), summary


def test_mosaic_refuses_caches_past_its_f32_limits():
    """Mosaic reads each row's key limit in f32 (so the partial log-sum-exp writes through their tile): exact below
    2²⁴ keys; a longer cache is refused before anything is built, naming the backend that takes it."""
    from lowering._decode import _contiguous

    cache = jax.ShapeDtypeStruct((1, 2**24 + 128, 8, 128), jnp.bfloat16)  # never allocated
    with pytest.raises(NotLowerable, match=r"exact below 2\*\*24 keys; the cache holds 16777344: pass backend"):
        _contiguous(jnp.zeros((1, 64, 32, 128), jnp.bfloat16), cache, cache, None, (None, None), None, "mosaic", None,
                    "H200")  # fmt: skip


def test_mosaic_visits_only_the_chunks_below_each_tiles_limits(seed):
    """``backend="mosaic"`` finds from the rows' key limits which chunks each tile visits and which it runs unmasked
    (``lowering._blocks.Limits``), as Triton does from the lengths: a short sequence in a long cache reads only its
    own chunks, a part past every length none, and the output matches the reference written here."""
    case = ("bfloat16", 2, 64, 2, 1, 512, 2)  # 128 rows of a KV head: one tile over two consumers, 128-key chunks
    q, k, v = draw(case, seed)
    lengths = jnp.array([64 + seed % 100, 512])  # sequence 0 ends inside part 0's first chunk or its second
    plan = decode_plan(q, k, v, lengths, parts=2, backend="mosaic")
    assert plan.summary()["chunk"] == 128
    kernel = _kernel(plan).forward
    (limits,) = (m for m in kernel.segments if isinstance(m, Limits))
    assert id(limits.box) in kernel.hidden  # chunks every row of a tile sees run without the mask
    out = nc.decode_attention(q, k, v, lengths, parts=2, backend="mosaic")
    assert rel_err(out, reference(q, k, v, lengths)) <= RTOL["bfloat16"], (seed, lengths)


@pytest.mark.parametrize("paged", [False, True])
def test_a_concrete_cache_state_closed_over_in_a_jitted_step_is_checked_not_traced(key, paged):
    """lengths (and a page table) closed over by a jitted function are concrete: their checks read them as numpy
    (jnp on them would stage traced ops and raise ConcretizationTypeError), and bad ones are still refused."""
    keys = jax.random.split(key, 3)
    q, k, v = (jax.random.normal(kk, (1, n, 2, 16)) for kk, n in zip(keys, (1, 64, 64), strict=True))
    extra = {}
    if paged:
        k, v = k.reshape(4, 16, 2, 16), v.reshape(4, 16, 2, 16)
        extra["page_table"] = jnp.arange(4, dtype=jnp.int32)[None]
    lengths, bad = jnp.array([40]), jnp.array([70])
    got = jax.jit(lambda q: nc.decode_attention(q, k, v, lengths, backend="xla", **extra))(q)
    want = nc.decode_attention(q, k, v, lengths, backend="xla", **extra)
    assert bool(jnp.all(got == want))
    with pytest.raises(EvaluationError, match=r"lengths \[70\] outside"):
        jax.jit(lambda q: nc.decode_attention(q, k, v, bad, backend="xla", **extra))(q)
