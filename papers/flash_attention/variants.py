"""Attention variants (FlexAttention's gallery, issue 12): napkin-cat's lowered kernels against XLA, one run.

Each variant is a diagram of :mod:`napkin_cat.library`, derived with the plain kernel's schedule
(``tile(q, 128), stream(x, 64)``, verified by the tests, not here) and lowered with its derived backward;
its baseline is ``jax.nn.dot_product_attention(..., implementation="xla")`` with the bias, mask or window
that expresses it, or, where ``jax.nn`` cannot (soft-capping, sinks, sigmoid), the same formula in plain
``jax.numpy`` (einsum, f32 scores, einsum). All are causal, so the plain causal kernel is the reference
for ratios; B·N tokens, H heads, head dim D, bf16:

=============  =============================================================================================
causal         the plain kernel (the reference)
window         sliding window, W = N/8 keys (``local_window_size`` in jax.nn)
document       causal within 8 equal documents, segment ids as inputs (a [B, 1, N, N] mask in jax.nn)
prefix_lm      the first N/4 keys seen by every query, the rest causal (an [N, N] mask in jax.nn)
softcap        Gemma 2's ``50·tanh(s/50)`` (jnp)
alibi          ALiBi's head-dependent slopes, read from the head index (an [H, N, N] bias in jax.nn)
learned_bias   a learnable [H, N, N] bias, differentiated too (jax.nn's bias, differentiated)
sinks          gpt-oss's attention sinks, one logit per head in the normaliser, differentiated too (jnp)
sigmoid        sigmoid attention, ``σ(s − log N)`` (jnp)
gqa            grouped-query attention, 4 query heads per key/value head (jax.nn's GQA)
=============  =============================================================================================

For each variant and implementation it measures the forward and forward + backward (the gradient of the
outputs' sum w.r.t. every float input) as :mod:`papers.flash_attention.benchmark` does (compiled ahead of
time, warm, median of batches of back-to-back calls; every implementation gets its inputs in its own
layout before timing: [B, H, N, D] for napkin-cat and jnp, [B, N, H, D] for jax.nn, GQA's queries
[B, H_kv, G, N, D] for napkin-cat). TFLOP/s count 4·D per visible (query, key) pair per head (so a
window's count is ~N²/8 pairs, causal's N²/2), 3.5× that forward + backward. It checks the forward's last
64 query rows against an f32 reference, compares the gradients with the baseline's, and reads XLA's memory
analysis of the compiled forward + backward: ``temp_bytes`` above B·H·N² (a byte per score of every head,
less than any materialised score matrix; plus an f32 copy of the extra inputs, as a learned [H, N, N] bias
is itself quadratic) flags a quadratic buffer; the O(N) residuals (~8·B·H·N·D bytes) are 1/8 of that at
D = 128, N = 8192. It prints ratios to the plain causal kernel and to XLA, the issue's targets
(fwd+bwd ≥ 0.9× causal's TFLOP/s; window ≥ 4× faster than causal; every variant ≥ 3× XLA; no quadratic
buffer), and writes ``variants_<GPU>.json`` and ``.png`` under ``results/`` (or ``--out``).

On a GPU (``--budget-s`` skips what is left after that many seconds; the JSON is saved after each
variant)::

    python -m papers.flash_attention.variants --out $OUT --budget-s 240

On CPU ``--quick`` runs tiny sizes (N = 64, D = 16, tiles of 32, chunks of 16) with the kernels in
interpret mode, as tests/test_benchmark_harness.py does (``--variants=sinks``); the quadratic-buffer check
needs N ≥ 16·D, so it reads "not measured" there::

    python -m papers.flash_attention.variants --quick --variants=causal,window

>>> z = Sizes(batch=1, heads=4, seq=64, head_dim=16, tile=32, stream=16)  # N = 64: W = 8, 8 documents, P = 16
>>> # N(N+1)/2, W(W+1)/2 + (N−W)·W, 8·(N/8)(N/8+1)/2, P² + (N(N+1) − P(P+1))/2
>>> {name: VARIANTS[name].pairs(z) for name in ("causal", "window", "document", "prefix_lm")}
{'causal': 2080, 'window': 484, 'document': 288, 'prefix_lm': 2200}
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from papers.flash_attention import attentions as at
from papers.flash_attention import benchmark as bench
from papers.flash_attention import report

HERE = Path(__file__).resolve().parent
CHECK_ROWS = 64  # query rows checked against the f32 reference (the last: they see the most keys)
CAP = 50.0  # Gemma 2's attention soft-cap
DOCUMENTS = 8
GROUP = 4  # query heads per key/value head under GQA
FULL = dict(tokens=16384, heads=16, seq=8192, head_dim=128, tile=128, stream=64, warmup=2, reps=10, batches=3)
QUICK = dict(tokens=128, heads=4, seq=64, head_dim=16, tile=32, stream=16, warmup=1, reps=2, batches=2)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """One problem: batch, heads, sequence, head dim, and the napkin kernel's schedule."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    tile: int
    stream: int
    dtype: str = "bf16"

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def window(self) -> int:
        return self.seq // 8

    @property
    def prefix(self) -> int:
        return self.seq // 4

    @property
    def kv_heads(self) -> int:
        return max(1, self.heads // GROUP)

    @property
    def jnp_dtype(self):
        return bench.DTYPES[self.dtype]


# --- the variants: what each keeps and adds to the scores, in index form ----------------------------------------


def causal_keep(i, j, z):
    return j <= i


def window_keep(i, j, z):
    return (j <= i) & (j > i - z.window)


def prefix_keep(i, j, z):
    return (j <= i) | (j < z.prefix)


def document_ids(z: Sizes):
    """[B, N] i32: 8 equal documents in every sequence."""
    return jnp.broadcast_to(jnp.arange(z.seq, dtype=jnp.int32) * DOCUMENTS // z.seq, (z.batch, z.seq))


def alibi_slopes(z: Sizes):
    """The library's ALiBi slopes ``2^(−8(h+1)/H)`` (:class:`napkin_cat.library.ALiBi`), per head."""
    return 2.0 ** (-8.0 * (jnp.arange(z.heads) + 1) / z.heads)


@dataclasses.dataclass(frozen=True)
class Variant:
    """A variant: its napkin-cat diagram, its extra inputs (beyond q, k, v), its f32 semantics in jnp and
    its XLA baseline; ``keep(i, j, sizes)`` is its mask (for the FLOP count), ``extra(key, sizes)`` the
    diagram's extra inputs, ``scores(s, i, j, extra, sizes)`` its masked, modified f32 scores on
    [B, H, n, N] (−∞ where masked), ``weights`` softmax or another normaliser."""

    name: str
    diagram: Callable
    keep: Callable = causal_keep
    extra: Callable = lambda key, z: ()  # noqa: E731
    scores: Callable | None = None
    weights: str = "softmax"
    nn: Callable | None = None  # (sizes, extra) → (jax.nn keyword arguments, arrays they need), else jnp
    grad_extra: tuple[int, ...] = ()  # the extra inputs differentiated (positions in ``extra``)
    most_stream: int | None = None  # the largest chunk its blocks fit shared memory at (``--stream`` is capped)

    def pairs(self, z: Sizes) -> int:
        """Visible (query, key) pairs of one head, counted on the mask."""
        i = np.arange(z.seq)[:, None]
        return int(
            sum(np.count_nonzero(self.keep(i[r : r + 1024], np.arange(z.seq)[None], z)) for r in range(0, z.seq, 1024))
        )


def _masked(keep):
    def scores(s, i, j, extra, z):
        return jnp.where(keep(i, j, z), s, -jnp.inf)

    return scores


def _document_scores(s, i, j, extra, z):
    q_ids, kv_ids = extra[0][:, i[:, 0]], extra[1][:, j[0]]  # [B, n], [B, N]
    same = q_ids[:, None, :, None] == kv_ids[:, None, None, :]
    return jnp.where(same & (j <= i), s, -jnp.inf)


def _softcap_scores(s, i, j, extra, z):
    return jnp.where(j <= i, CAP * jnp.tanh(s / CAP), -jnp.inf)


def _alibi_scores(s, i, j, extra, z):
    return jnp.where(j <= i, s - alibi_slopes(z)[:, None, None] * jnp.abs(i - j), -jnp.inf)


def _bias_scores(s, i, j, extra, z):
    bias = extra[0].astype(jnp.float32)[:, i[:, 0]]
    return jnp.where(j <= i, s + bias, -jnp.inf)


def _sigmoid_scores(s, i, j, extra, z):
    return jnp.where(j <= i, s - np.log(z.seq), -jnp.inf)


def _napkin_axes(head_dim: int):
    """The axes with the head dim bound (``lower`` would bind it at the first call; bound here, the kernel and
    what it says of itself, ``differentiation`` and ``backends``, are there before it)."""
    import napkin_cat as nc

    return nc, nc.library, nc.axes("b h q x d", d=head_dim)


def _diagram(build: Callable) -> Callable:
    """A diagram builder on the batch and head axes: ``build(L, z, b, h, q, x, d, kw)``."""

    def make(z: Sizes):
        nc, L, (b, h, q, x, d) = _napkin_axes(z.head_dim)
        kw = dict(scale=z.scale, dtype={"bf16": nc.bf16, "fp16": nc.f16, "f32": nc.f32}[z.dtype])
        return build(nc, L, z, b, h, q, x, d, kw), (q, x)

    return make


VARIANTS = {
    v.name: v
    for v in (
        Variant(
            "causal",
            _diagram(lambda nc, L, z, b, h, q, x, d, kw: L.attention(q, x, d, causal=True, batch=(b, h), **kw)),
            nn=lambda z, e: ({"is_causal": True}, ()),
        ),
        Variant(
            "window",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.sliding_window_attention(
                    q, x, d, window=z.window, batch=(b, h), **kw
                )
            ),
            keep=window_keep,
            scores=_masked(window_keep),
            nn=lambda z, e: ({"is_causal": True, "local_window_size": (z.window - 1, 0)}, ()),
        ),
        Variant(
            "document",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.dot_product_attention(
                    q, x, d, causal=True, batch=(b, h), segment_batch=(b,), **kw
                )
            ),
            keep=lambda i, j, z: (j <= i) & (i * DOCUMENTS // z.seq == j * DOCUMENTS // z.seq),
            extra=lambda key, z: (document_ids(z), document_ids(z)),
            scores=_document_scores,
            nn=lambda z, e: ({"is_causal": True}, {"mask": (e[0][:, None, :, None] == e[1][:, None, None, :])}),
        ),
        Variant(
            "prefix_lm",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.prefix_lm_attention(q, x, d, prefix=z.prefix, batch=(b, h), **kw)
            ),
            keep=prefix_keep,
            scores=_masked(prefix_keep),
            nn=lambda z, e: ({}, {"mask": prefix_keep(jnp.arange(z.seq)[:, None], jnp.arange(z.seq)[None], z)}),
        ),
        Variant(
            "softcap",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.softcap_attention(
                    q, x, d, cap=CAP, causal=True, batch=(b, h), **kw
                )
            ),
            scores=_softcap_scores,
        ),
        Variant(
            "alibi",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.alibi_attention(
                    nc.Axis("h", z.heads), q, x, d, batch=(b,), causal=True, **kw
                )
            ),
            scores=_alibi_scores,
            nn=lambda z, e: (
                {"is_causal": True},
                {
                    "bias": (
                        -alibi_slopes(z)[:, None, None] * jnp.abs(jnp.arange(z.seq)[:, None] - jnp.arange(z.seq)[None])
                    )[None].astype(z.jnp_dtype)
                },
            ),
        ),
        Variant(
            "learned_bias",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.dot_product_attention(
                    q, x, d, causal=True, batch=(b, h), bias_batch=(h,), bias_dtype=kw["dtype"], **kw
                )
            ),
            extra=lambda key, z: (jax.random.normal(key, (z.heads, z.seq, z.seq), z.jnp_dtype),),
            scores=_bias_scores,
            grad_extra=(0,),
            nn=lambda z, e: ({"is_causal": True}, {"bias": e[0][None]}),
            most_stream=64,  # a [q, x] bias chunk beside K and V: at 128 the Triton kernel needs 327,680 B
        ),
        Variant(
            "sinks",
            _diagram(lambda nc, L, z, b, h, q, x, d, kw: L.sink_attention(q, x, d, causal=True, batch=(b, h), **kw)),
            weights="sink",
            grad_extra=(0,),
            extra=lambda key, z: (jax.random.normal(key, (z.batch, z.heads), jnp.float32),),
        ),
        Variant(
            "sigmoid",
            _diagram(lambda nc, L, z, b, h, q, x, d, kw: L.sigmoid_attention(q, x, d, causal=True, batch=(b, h), **kw)),
            weights="sigmoid",
            scores=_sigmoid_scores,
        ),
        Variant(
            "gqa",
            _diagram(
                lambda nc, L, z, b, h, q, x, d, kw: L.grouped_query_attention(
                    nc.axes("hk")[0], nc.axes("g")[0], q, x, d, batch=(b,), causal=True, **kw
                )
            ),
            nn=lambda z, e: ({"is_causal": True}, ()),
        ),
    )
}


# --- the computations -----------------------------------------------------------------------------------------


def semantics(variant: Variant, z: Sizes, q, k, v, extra, *, first_row: int = 0, f32: bool = True):
    """The variant in plain jnp on [B, H, n, D] queries (rows ``first_row`` on) and [B, H_kv, N, D] keys and
    values: f32 throughout (the reference), or the inputs' dtype with f32 scores (the jnp baseline)."""
    dt = jnp.float32 if f32 else q.dtype
    q, k, v = (a.astype(dt) for a in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * z.scale
    i, j = first_row + jnp.arange(q.shape[2])[:, None], jnp.arange(k.shape[2])[None]
    s = (variant.scores or _masked(variant.keep))(s, i, j, extra, z)
    if variant.weights == "softmax":
        p = jax.nn.softmax(s, axis=-1)
    elif variant.weights == "sigmoid":
        p = jax.nn.sigmoid(s)
    else:  # the sink: one more logit in the normaliser, with no value
        sink = jnp.broadcast_to(extra[0][:, :, None, None], (*s.shape[:3], 1))
        p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bhqk,bhkd->bhqd", p.astype(dt), v, preferred_element_type=jnp.float32).astype(dt)


def inputs(variant: Variant, z: Sizes, seed: int = 0):
    """q [B, H, N, D], k and v [B, H_kv, N, D] (H_kv = H / 4 for GQA, else H), and the extra inputs."""
    kq, kk, kv, ke = jax.random.split(jax.random.key(seed), 4)
    kv_heads = z.kv_heads if variant.name == "gqa" else z.heads
    normal = lambda key, h: jax.random.normal(key, (z.batch, h, z.seq, z.head_dim), z.jnp_dtype)  # noqa: E731
    return normal(kq, z.heads), normal(kk, kv_heads), normal(kv, kv_heads), tuple(variant.extra(ke, z))


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One implementation of a variant: ``fn`` on ``args`` (already in its layout), ``grad_args`` the positions
    differentiated, ``to_bhnd`` its output (and q's, k's and v's gradients) back to [B, H, N, D]."""

    impl: str
    fn: Callable | None
    args: tuple = ()
    grad_args: tuple[int, ...] = (0, 1, 2)
    to_bhnd: Callable = lambda a: a  # noqa: E731
    unavailable: str | None = None
    no_backward: str | None = None  # why its forward + backward cannot be measured (the forward still is)


def napkin(variant: Variant, z: Sizes, q, k, v, extra, backend: str = "auto") -> Implementation:
    """The lowered kernel on the diagram's layout ([B, H, N, D]; GQA's queries [B, H_kv, G, N, D])."""
    try:
        from lowering import lower
        from rewrites import derive, stream, tile

        diagram, (qa, xa) = variant.diagram(z)
        chunk = min(z.stream, variant.most_stream or z.stream)
        kernel = lower(derive(diagram, tile(qa, z.tile), stream(xa, chunk), verify=False), backend=backend)
    except Exception as e:  # noqa: BLE001 - a failure to lower is a result
        return Implementation("napkin", None, unavailable=f"{type(e).__name__}: {e}")
    to_bhnd = lambda a: a  # noqa: E731
    if variant.name == "gqa":
        q = q.reshape(z.batch, z.kv_heads, z.heads // z.kv_heads, z.seq, z.head_dim)
        to_bhnd = lambda a: a.reshape(a.shape[0], -1, *a.shape[-2:]) if a.ndim == 5 else a  # noqa: E731
    grads = (0, 1, 2, *(3 + i for i in variant.grad_extra))
    no_backward = None if kernel.differentiation == "lowered" else f"no lowered backward: {kernel.why_not}"
    return Implementation("napkin", kernel, (q, k, v, *extra), grads, to_bhnd, no_backward=no_backward)


def baseline(variant: Variant, z: Sizes, q, k, v, extra) -> Implementation:
    """``jax.nn.dot_product_attention(implementation="xla")`` on [B, N, H, D] with its bias/mask/window, or
    the plain jnp formula on [B, H, N, D] (bf16 inputs, f32 scores) where jax.nn cannot express the variant."""
    grads = (0, 1, 2, *(3 + i for i in variant.grad_extra))
    if variant.nn is None:

        def attend(q, k, v, *extra):
            return semantics(variant, z, q, k, v, extra, f32=False)

        return Implementation("jnp", attend, (q, k, v, *extra), grads)
    options, arrays = variant.nn(z, extra)
    names = sorted(arrays)
    bnhd = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731

    def attend(q, k, v, *given):
        return jax.nn.dot_product_attention(
            q, k, v, **dict(zip(names, given, strict=True)), **options, scale=z.scale, implementation="xla"
        )

    grads = (0, 1, 2, *(3 + names.index("bias") for _ in variant.grad_extra))
    return Implementation("jax.nn xla", attend, (bnhd(q), bnhd(k), bnhd(v), *(arrays[n] for n in names)), grads, bnhd)


# --- measuring ------------------------------------------------------------------------------------------------


def measure(impl: Implementation, flops: float, opts, clock: bench.Clock, backward: bool, keep: dict) -> dict:
    """Time and check one implementation's forward or forward + backward; ``keep["out"]`` receives its result
    (in [B, H, N, D]) for the comparison of the two implementations."""
    if impl.unavailable or (backward and impl.no_backward):
        return {"status": "unavailable", "error": impl.unavailable or impl.no_backward}
    if clock.spent():
        return {"status": "skipped", "error": f"time budget of {clock.budget_s:.0f} s spent"}
    fn = impl.fn
    if backward:
        fn = jax.grad(lambda *a: impl.fn(*a).astype(jnp.float32).sum(), argnums=impl.grad_args)

    def check(out):  # q's, k's and v's gradients (the first three) and the output in [B, H, N, D]
        if backward:
            keep["out"] = tuple(impl.to_bhnd(a) if i < 3 else a for i, a in enumerate(out))
        else:
            keep["out"] = impl.to_bhnd(out)
        return 0.0

    record = bench.measure(fn, impl.args, check, flops, warmup=opts.warmup, reps=opts.reps, batches=opts.batches)
    record.pop("max_rel_err", None)
    return {"impl": impl.impl, **record}


def compare(ours, theirs) -> float | None:
    """The largest relative difference over outputs (or gradients) of two implementations."""
    if ours is None or theirs is None:
        return None
    pairs = zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True)
    return max(float(at.max_rel_err(a, b)) for a, b in pairs)


def run_variant(variant: Variant, z: Sizes, opts, clock: bench.Clock) -> dict:
    """Both implementations of one variant, forward and forward + backward, and their checks."""
    pairs = variant.pairs(z)
    flops = 4 * z.batch * z.heads * z.head_dim * pairs
    q, k, v, extra = inputs(variant, z)
    entry = {
        "name": variant.name,
        "pairs": pairs,
        "flops_fwd": flops,
        "flops_fwd_bwd": flops * bench.FWD_BWD_FACTOR,
        # a byte per score of every head, beyond an f32 copy of the extra inputs (a learned bias is itself N²)
        "quadratic_bytes": z.batch * z.heads * z.seq**2 + sum(4 * a.size for a in extra),
    }
    outs = {}
    ours = napkin(variant, z, q, k, v, extra, opts.backend)
    impls = {"napkin": ours, "baseline": baseline(variant, z, q, k, v, extra)}
    for who, impl in impls.items():
        entry[who] = {"impl": impl.impl}
        for section, backward in (("fwd", False), ("fwd_bwd", True)):
            keep = {}
            r = measure(impl, flops * (bench.FWD_BWD_FACTOR if backward else 1), opts, clock, backward, keep)
            entry[who][section] = r
            outs[who, section] = keep.get("out")
            _log(clock, variant.name, who, impl.impl, section, r)
    kernel = impls["napkin"].fn
    if hasattr(kernel, "backends"):  # which backend ran each kernel (auto: Mosaic or Triton, per kernel)
        entry["napkin"]["backends"] = dict(kernel.backends)
        clock.log(f"{variant.name:12} backends {sorted(set(kernel.backends.values()))}: {kernel.backends}")
    rows = min(CHECK_ROWS, z.seq)
    ours = outs["napkin", "fwd"]
    if ours is not None:
        ref = jax.jit(lambda q, k, v, *e: semantics(variant, z, q[:, :, -rows:], k, v, e, first_row=z.seq - rows))(
            q, k, v, *extra
        )
        entry["napkin"]["fwd"]["err_f32"] = float(at.max_rel_err(ours[:, :, -rows:], ref))
    entry["napkin_vs_baseline"] = {s: compare(outs["napkin", s], outs["baseline", s]) for s in ("fwd", "fwd_bwd")}
    temp = entry["napkin"]["fwd_bwd"].get("temp_bytes")
    # the O(N) residuals, ~8·B·H·N·D bytes, are 8·D/N of the threshold: it tells them apart from N² from N ≥ 16·D
    telling = temp is not None and z.seq >= 16 * z.head_dim
    entry["quadratic_buffer"] = temp >= entry["quadratic_bytes"] if telling else None
    del q, k, v, extra, outs
    gc.collect()
    return entry


def _log(clock, name, who, impl, section, r):
    what = f"{name:12} {section:7} {who:8} ({impl})"
    if r.get("status") == "ok":
        clock.log(f"{what:40} {r['tflops']:7.1f} TFLOP/s {r['time_ms']:9.3f} ms  temp {r['temp_bytes'] or 0:,} B")
    else:
        clock.log(f"{what:40} {r.get('status')}: {str(r.get('error', ''))[:120]}")


# --- ratios, targets, output ----------------------------------------------------------------------------------


def _tflops(entry: dict, who: str, section: str) -> float | None:
    r = entry.get(who, {}).get(section, {})
    return r.get("tflops") if r.get("status") == "ok" else None


def _time(entry: dict, who: str, section: str) -> float | None:
    r = entry.get(who, {}).get(section, {})
    return r.get("time_ms") if r.get("status") == "ok" else None


def ratios(res: dict) -> None:
    """Each variant's TFLOP/s over the plain causal kernel's and time over XLA's, and the issue's targets.

    >>> e = lambda n, t, x: {"name": n, "napkin": {s: {"status": "ok", "tflops": t, "time_ms": 10 / t}
    ...     for s in ("fwd", "fwd_bwd")}, "baseline": {s: {"status": "ok", "time_ms": 10 / x} for s in
    ...     ("fwd", "fwd_bwd")}, "quadratic_buffer": False}
    >>> res = {"variants": [e("causal", 100, 10), e("window", 95, 30)]}
    >>> ratios(res)
    >>> {k: round(r, 2) for k, r in res["variants"][1]["ratios"]["fwd_bwd"].items()}
    {'vs_causal_tflops': 0.95, 'vs_baseline_speed': 3.17, 'vs_causal_speed': 0.95}
    >>> list(res["targets"].values())  # 0.9× causal, window 4× faster, 3× XLA, no N² buffer
    [True, False, True, True]
    """
    causal = next((e for e in res["variants"] if e["name"] == "causal"), None)
    for e in res["variants"]:
        e["ratios"] = {}
        for s in ("fwd", "fwd_bwd"):
            t, base_t, ours_t = _tflops(e, "napkin", s), _time(e, "baseline", s), _time(e, "napkin", s)
            c_t = causal and _tflops(causal, "napkin", s)
            c_time = causal and _time(causal, "napkin", s)
            e["ratios"][s] = {
                "vs_causal_tflops": t / c_t if t and c_t else None,
                "vs_baseline_speed": base_t / ours_t if base_t and ours_t else None,
                "vs_causal_speed": c_time / ours_t if c_time and ours_t else None,
            }

    def every(values):
        values = list(values)
        return None if not values or None in values else all(values)

    def get(name):
        return next((e for e in res["variants"] if e["name"] == name), None)

    window = get("window")
    speed = window and window["ratios"]["fwd_bwd"]["vs_causal_speed"]
    res["targets"] = {
        "every variant's fwd+bwd ≥ 0.9× causal TFLOP/s": every(
            None if (r := e["ratios"]["fwd_bwd"]["vs_causal_tflops"]) is None else r >= 0.9 for e in res["variants"]
        ),
        "window W=N/8 ≥ 4× faster than causal (fwd+bwd)": None if speed is None else speed >= 4,
        "every variant ≥ 3× XLA (fwd+bwd)": every(
            None if (r := e["ratios"]["fwd_bwd"]["vs_baseline_speed"]) is None else r >= 3 for e in res["variants"]
        ),
        "no quadratic buffer (fwd+bwd temp < B·H·N² B)": every(
            None if e["quadratic_buffer"] is None else not e["quadratic_buffer"] for e in res["variants"]
        ),
    }


def render(res: dict) -> str:
    """A markdown table of the run, and the targets."""
    z = res["sizes"]
    lines = [
        f"### {res['device']['kind']}: attention variants, {z['dtype']}, B={z['batch']} H={z['heads']} "
        f"N={z['seq']} D={z['head_dim']} (jax {res['jax']}, {res['date']})",
        "",
        "| variant | baseline | fwd TFLOP/s | ÷ causal | × baseline | fwd+bwd TFLOP/s | ÷ causal | × baseline "
        "| fwd+bwd ms | err f32 | Δ baseline (fwd/grads) | temp MB (fwd+bwd) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def f(x, fmt):
        return "–" if x is None else format(x, fmt)

    for e in res["variants"]:
        r = e.get("ratios", {"fwd": {}, "fwd_bwd": {}})
        n = e["napkin"]
        temp = n["fwd_bwd"].get("temp_bytes")
        cells = [
            e["name"],
            e["baseline"]["impl"],
            f(_tflops(e, "napkin", "fwd"), ".0f"),
            f(r["fwd"].get("vs_causal_tflops"), ".2f"),
            f(r["fwd"].get("vs_baseline_speed"), ".1f"),
            f(_tflops(e, "napkin", "fwd_bwd"), ".0f"),
            f(r["fwd_bwd"].get("vs_causal_tflops"), ".2f"),
            f(r["fwd_bwd"].get("vs_baseline_speed"), ".1f"),
            f(_time(e, "napkin", "fwd_bwd"), ".2f"),
            f(n["fwd"].get("err_f32"), ".1e"),
            "/".join(f(e["napkin_vs_baseline"][s], ".1e") for s in ("fwd", "fwd_bwd")),
            f(None if temp is None else temp / 2**20, ".0f") + (" (N²!)" if e["quadratic_buffer"] else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [
        (e["name"], w, e[w][s].get("error", "")[:160])
        for e in res["variants"]
        for w in ("napkin", "baseline")
        for s in ("fwd", "fwd_bwd")
        if e[w][s].get("status") not in ("ok", None)
    ]
    lines += ["", *(f"- not measured: {n} {w}: {why}" for n, w, why in failed)]
    lines += [
        "",
        "Targets (fwd+bwd):",
        *(
            f"- {k}: {'met' if v else 'MISSED' if v is False else 'not measured'}"
            for k, v in res.get("targets", {}).items()
        ),
    ]
    return "\n".join(lines)


def plot(res: dict, path: Path) -> None:
    """Bars: forward and forward + backward TFLOP/s per variant, napkin-cat and its baseline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [e["name"] for e in res["variants"]]
    fig, axes = plt.subplots(2, 1, figsize=(12, 7), squeeze=False)
    for ax, (s, title) in zip(axes[:, 0], (("fwd", "forward"), ("fwd_bwd", "forward + backward")), strict=True):
        for i, who in enumerate(("napkin", "baseline")):
            ys = [_tflops(e, who, s) or 0 for e in res["variants"]]
            ax.bar([x + 0.4 * i for x in range(len(names))], ys, 0.4, label=who)
        ax.set_xticks([x + 0.2 for x in range(len(names))], names, fontsize=8)
        ax.set_ylabel("TFLOP/s (visible pairs)")
        ax.set_title(f"{res['device']['kind']}: {title}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, interpret mode (CPU smoke test)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from " + ", ".join(VARIANTS))
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    p.add_argument("--backend", choices=("auto", "triton", "mosaic"), default="auto", help="lower()'s backend")
    p.add_argument("--budget-s", type=float, default=240.0, help="skip what is left after this many seconds")
    p.add_argument("--out", "--out-dir", dest="out", type=Path, default=HERE / "results")
    p.add_argument("--no-plot", action="store_true")
    opts = p.parse_args(argv)
    for name, value in (QUICK if opts.quick else FULL).items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    unknown = set(opts.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    return opts


def main(argv=None) -> dict:
    """Run the selected variants; write the JSON (after each variant) and the plot; print the table."""
    opts = parse_args(argv)
    clock = bench.Clock(opts.budget_s)
    z = Sizes(max(1, opts.tokens // opts.seq), opts.heads, opts.seq, opts.head_dim, opts.tile, opts.stream, opts.dtype)
    dev = bench.device_info()
    path = opts.out / f"variants_{bench.device_stem(dev['kind'])}{'_quick' if opts.quick else ''}.json"
    res = {
        "schema": 1,
        "device": dev,
        "jax": jax.__version__,
        "quick": opts.quick,
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes": dataclasses.asdict(z),
        "timing": {"warmup": opts.warmup, "reps": opts.reps, "batches": opts.batches},
        "variants": [],
    }
    clock.log(f"device {dev['kind']} ({dev['platform']}), {z}, results → {path}")
    for name in opts.variants.split(","):
        res["variants"].append(run_variant(VARIANTS[name], z, opts, clock))
        ratios(res)
        report.save_json(res, path)
    res["elapsed_s"] = clock.elapsed()
    report.save_json(res, path)
    print(render(res), flush=True)
    if not opts.no_plot:
        plot(res, path.with_suffix(".png"))
    clock.log(f"done: {path}")
    return res


if __name__ == "__main__":
    main()
