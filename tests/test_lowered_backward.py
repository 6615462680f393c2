"""The backward that ``lower()`` derives from ``nc.reverse`` (lowering/_backward.py, rewrites/_io_aware.py).

Gradients of attention variants (GQA, soft-capping, ALiBi-like index biases, a sliding-window mask,
learnable bias and slope arrays, query/key head dim ≠ value head dim, q ≠ x, ragged sizes) against
``jax.grad`` of references written here in jax.numpy; the derived diagrams against the hand-written
FlashAttention-2 ones (tests/flash_oracle.py); the lemmas proved; no N×N buffer in the gradient.
Tolerances: rel_err of every gradient, f32 interpret mode on CPU, measured ≤ 8e-7 over these cases.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as R
from flash_oracle import attention_parts, backward_diagrams

import napkin_cat as nc
from lowering import Config, NotLowerable, lower
from lowering._backward import backward_of, plain
from lowering._blocks import affine_mask
from lowering._blocks import visited as _visited
from napkin_cat.architectures import Circuit
from napkin_cat.diagram import Array
from rewrites import derive, stream, tile
from rewrites._io_aware import prove_lemmas

TOL = 1e-5  # f32: measured ≤ 8e-7
EPS = float(np.finfo(np.float32).eps)


def sizes(seed, n=2, lo=17, hi=48):
    """Ragged sizes drawn from the test's seed (replayed with NAPKIN_SEED)."""
    return [int(v) for v in np.random.default_rng(seed).integers(lo, hi, n)]


def normal(key, *shapes):
    return [
        jax.random.normal(k, s, jnp.float32) for k, s in zip(jax.random.split(key, len(shapes)), shapes, strict=True)
    ]


def check_gradients(kernel, reference, args, key, summed=None):
    """Output and every gradient against ``reference``'s. ``summed``: ``(i, spread)`` for an input whose
    cotangent sums a term per score (one slope per head: Σ_q,x dS·|q − x|, each row's dS summing to 0), whose
    error relative to itself is heavy-tailed (cancellation); it is bounded by the terms' summed magnitudes, each
    term the gradient of ``spread(args[i])``, the input given per score to the same reference: measured ≤ 1.7 eps
    of them over 25 seeds, so 16 eps."""
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)
    out = kernel(*args)
    (ct,) = normal(jax.random.fold_in(key, 7), out.shape)
    ours = pullback(kernel, *args, ct=ct)
    # the reference compiled once (run eagerly, it compiles op by op at each drawn size)
    want = jax.jit(lambda *a: pullback(reference, *a, ct=ct))(*args)
    assert R.rel_err(out, jax.jit(reference)(*args)) <= TOL
    for i, (a, w) in enumerate(zip(ours, want, strict=True)):
        if summed is not None and i == summed[0]:
            spread = [summed[1](x) if j == i else x for j, x in enumerate(args)]
            per_score = jax.jit(lambda *a: pullback(reference, *a, ct=ct))(*spread)[i]
            terms = jnp.abs(per_score).reshape(*a.shape, -1).sum(-1)
            assert float(jnp.max(jnp.abs(a - w) / terms)) <= 16 * EPS, f"gradient of input {i}"
        else:
            assert R.rel_err(a, w) <= TOL, f"gradient of input {i}"


def pullback(f, *args, ct):
    """The gradient of ``Σ f(args) ⊙ ct`` (in f32) with respect to every argument."""
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * ct), argnums=tuple(range(len(args))))(*args)


def softmax_rows(s, keep):
    """Softmax over the last axis where ``keep``; a row with no key kept gives 0."""
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    return jnp.where(keep.any(-1, keepdims=True), p, 0.0)


def test_lemmas_are_proved():
    proofs = prove_lemmas()
    assert {k: p.identities for k, p in proofs.items()} == {"lse": 3, "delta": 1, "row weight": 9, "dropout": 9}


def test_gqa_sums_the_group_after_the_kernel(seed, key):
    hk, g, q, x, d = nc.axes("hk g q x d", g=2, d=16)
    nq, nx = sizes(seed)
    kernel = lower(derive(nc.library.grouped_query_attention(hk, g, q, x, d, causal=True), tile(q, 16), stream(x, 16)))
    (dkv,) = [p for p in backward_of(kernel.diagram).pieces if p.outputs == (1, 2)]
    assert [str(w) for w in dkv.diagram.cod] == ["g×hk×x×d", "g×hk×x×d"] and dkv.sums == ((0,), (0,))

    def reference(Q, K, V):
        s = jnp.einsum("kgqd,kxd->kgqx", Q, K) / 4.0
        keep = jnp.arange(nx)[None, :] <= jnp.arange(nq)[:, None]
        return jnp.einsum("kgqx,kxd->kgqd", softmax_rows(s, keep), V)

    check_gradients(kernel, reference, normal(key, (2, 2, nq, 16), (2, nx, 16), (2, nx, 16)), key)


def test_soft_cap_window_and_learnable_bias_with_qk_dim_other_than_v_dim(seed, key):
    """Every pointwise box between the scores and the softmax·contract is recomputed and differentiated by
    its own rule; the bias B[q, x] gets its cotangent from a kernel tiling both axes."""
    q, x, e, d = nc.axes("q x e d", e=48, d=32)
    nq, nx = sizes(seed)
    S = Array(q, x)
    c = Circuit(Q=Array(q, e), K=Array(x, e), V=Array(x, d), B=S)
    c.let("S", nc.contract("q e, x e -> q x", q, x, e, scale=0.125), "Q", "K")
    c.let("T", nc.score_mod(S, lambda s: 5.0 * jnp.tanh(s / 5.0)), "S")
    c.let("U", nc.add(S, S), "T", "B")
    c.let("M", nc.mask(S, lambda q, x: (x <= q + 3) & (x > q - 9)), "U")
    c.let("P", nc.softmax(S, x), "M")
    c.let("O", nc.contract("q x, x d -> q d", q, x, d), "P", "V")
    kernel = lower(derive(c.diagram("O"), tile(q, 16), stream(x, 16)))
    assert [str(r) for r in backward_of(kernel.diagram).pieces[-1].rules] == ["tile(q, 16)", "tile(x, 16)"]

    def reference(Q, K, V, B):
        s = 5.0 * jnp.tanh(Q @ K.T * 0.125 / 5.0) + B
        i, j = jnp.arange(nq)[:, None], jnp.arange(nx)[None, :]
        return softmax_rows(s, (j <= i + 3) & (j > i - 9)) @ V

    check_gradients(kernel, reference, normal(key, (nq, 48), (nx, 48), (nx, 32), (nq, nx)), key)


def test_index_bias_with_learnable_slopes_and_key_bias(seed, key):
    """ALiBi-like: S − slope[h]·|q − x| + b[x]; slope's cotangent keeps the queries (summed after the
    dQ kernel), b's keeps the heads (summed after the dK, dV kernel); the kept axis goes innermost where the
    kernel's blocks hold it (q), outermost where the grid does (h)."""
    h, q, x, d = nc.axes("h q x d", h=2, d=16)
    nq, nx = sizes(seed)
    S = Array(h, q, x)
    c = Circuit(Q=Array(h, q, d), K=Array(h, x, d), V=Array(h, x, d), slope=Array(h), b=Array(x))
    c.let("S", nc.contract("h q d, h x d -> h q x", h, q, x, d, scale=0.25), "Q", "K")
    c.let("D", nc.score_mod(S, lambda s, q, x: 0.0 * s - jnp.abs(q - x)), "S")
    c.let("A", nc.multiply(S, Array(h)), "D", "slope")
    c.let("T", nc.add(S, S), "S", "A")
    c.let("U", nc.add(S, Array(x)), "T", "b")
    c.let("P", nc.softmax(S, x), "U")
    c.let("O", nc.contract("h q x, h x d -> h q d", h, q, x, d), "P", "V")
    kernel = lower(derive(c.diagram("O"), tile(q, 16), stream(x, 16)))
    pieces = {p.outputs: p.sums for p in backward_of(kernel.diagram).pieces if not p.feeds}
    assert pieces == {(0, 3): ((), (1,)), (1, 2, 4): ((), (), (0,))}  # slope's [h, q] and b's [h, x]: block axes inner

    def reference(Q, K, V, slope, b):  # slope [h], or [h, q, x]: one per score
        dist = jnp.abs(jnp.arange(nq)[:, None] - jnp.arange(nx)[None, :])
        slope = slope[:, None, None] if slope.ndim == 1 else slope
        s = jnp.einsum("hqd,hxd->hqx", Q, K) * 0.25 - slope * dist + b
        return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, axis=-1), V)

    args = normal(key, (2, nq, 16), (2, nx, 16), (2, nx, 16), (2,), (nx,))
    check_gradients(kernel, reference, args, key, summed=(3, lambda s: jnp.broadcast_to(s[:, None, None], (2, nq, nx))))


@pytest.mark.parametrize("causal", [False, True])
def test_derived_backward_equals_the_hand_written_oracle(key, causal):
    """The derived dQ and dK, dV diagrams compute what FlashAttention-2's hand-written ones do, on the same
    residuals, and their schedules verify (derive checks each step on random inputs)."""
    h, q, x, d = nc.axes("h q x d", h=2, q=24, x=40, d=16)
    flash = derive(nc.library.multi_head_attention(h, q, x, d, causal=causal), tile(q, 16), stream(x, 16))
    dq, dkv = backward_diagrams(attention_parts(flash.diagram))
    Q, K, V, dO = normal(key, (2, 24, 16), (2, 40, 16), (2, 40, 16), (2, 24, 16))
    s = jnp.einsum("hqd,hxd->hqx", Q, K) / 4.0
    if causal:
        s = jnp.where(jnp.arange(40)[None, :] <= jnp.arange(24)[:, None], s, -jnp.inf)
    out = jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, -1), V)
    L = jax.nn.logsumexp(s, axis=-1)
    delta = jnp.sum(dO * out, axis=-1)
    want = [nc.to_jax(dq)(Q, K, V, dO, L, delta), *nc.to_jax(dkv)(Q, K, V, dO, L, delta)]
    pieces = backward_of(flash.diagram).pieces
    values = [Q, K, V, dO, L, out]
    got = []
    for p in pieces:
        derive(p.diagram, *p.rules)
        out = nc.to_jax(p.diagram)(*(values[i] for i in p.inputs))
        outs = list(out) if isinstance(out, tuple) else [out]
        if p.feeds:  # Δ, computed once per query row
            assert R.rel_err(outs[0], delta) <= TOL
            values += outs
        else:
            got += outs
    for a, w in zip(got, want, strict=True):
        assert R.rel_err(a, w) <= TOL


def test_delta_is_computed_once_per_query_row_and_blocks_follow_flash_attention_2():
    """Δ = Σ_d dO ⊙ O has a kernel of its own (tiling queries, no loop), which dQ and dK, dV read instead of
    the output O; at the forward's 128 × 64 blocks the backward tiles 128 and streams 64, with 8 warps."""
    h, q, x, d = nc.axes("h q x d", d=128)
    kernel = lower(
        derive(
            nc.library.multi_head_attention(h, q, x, d, causal=True, dtype=nc.bf16),
            tile(q, 128),
            stream(x, 64),
            verify=False,
        )
    )
    _, delta, dq, dkv = kernel.kernels
    assert (delta.plan.tiles, delta.plan.stream) == ({"q": 128}, None)
    assert [str(w) for w in delta.plan.diagram.cod] == ["h×q/128"]
    assert (dq.plan.tiles, dq.plan.stream, dkv.plan.tiles, dkv.plan.stream) == (
        {"q": 128},
        ("x", 64),
        {"x": 128},
        ("q", 64),
    )
    for k in (dq, dkv):
        assert "q/128×d" not in str(k.plan.diagram.dom.inside[-1])  # reads Δ (h×q), not O (h×q×d)
        assert Config.get_default(k.plan) == Config(num_warps=8, num_stages=3)


def test_the_sinks_weight_folds_into_the_log_sum_exp():
    """Attention sinks scale the softmax's output by the row weight w = σ(L − sink). The row-weight lemma folds
    it into the recomputed probabilities, exp(S − L′) with L′ = L − log w, and into one row value R/w; both
    rows are computed once by the kernel that tiles queries (``lowering._backward.row_values``: R/w sums, L′
    runs transcendentals), so the dK·dV kernel reads what plain attention's reads (Q, K, V, dO and two rows)
    and does per score what it does (no dO rescaled per chunk, no extra add per score). The gradients
    themselves are checked against jax.grad in tests/test_variants.py."""
    h, q, x, d = nc.axes("h q x d", d=64)
    sinks = nc.library.sink_attention(q, x, d, causal=True, batch=(h,), dtype=nc.bf16)
    _, rows, dq, dkv = lower(derive(sinks, tile(q, 128), stream(x, 64), verify=False)).kernels
    assert [str(w) for w in rows.plan.diagram.cod] == ["h×q/128", "h×q/128"]
    assert rows.plan.stream is None
    plain = nc.library.attention(q, x, d, causal=True, batch=(h,), dtype=nc.bf16)
    *_, causal = lower(derive(plain, tile(q, 128), stream(x, 64), verify=False)).kernels
    assert [str(w) for w in dkv.plan.diagram.dom] == [str(w) for w in causal.plan.diagram.dom]

    def per_score(k):  # the work on each [q, x] block, by name (an add of a row value is a subtraction's cost)
        blocks = [b for b in k.plan.diagram.boxes if not b.name.startswith(("Copy", "Swap"))]
        return sorted(b.name.replace("subtract", "add") for b in blocks if {"q", "x"} <= set(b.cod.inside[0].names))

    assert per_score(dkv) == per_score(causal)
    assert per_score(dq) == per_score([k for k in lower(derive(plain, tile(q, 128), stream(x, 64))).kernels][2])


def test_blocks_shrink_to_fit_shared_memory_and_what_cannot_fit_is_refused(key):
    """At d = 256 the 128 × 64 blocks of dK, dV would hold 320 KiB: the stream halves until they fit the
    H100's 227 KiB. Where even 16 × 16 blocks exceed the budget (dQ holds more than the forward), the
    forward still lowers and differentiating names the kernel and the bytes."""
    q, x, d = nc.axes("q x d", d=256)
    flash = derive(nc.library.attention(q, x, d, dtype=nc.bf16), tile(q, 128), stream(x, 64), verify=False)
    sizes = {p.outputs: [str(r) for r in p.rules] for p in backward_of(flash.diagram).pieces if not p.feeds}
    assert sizes == {(0,): ["tile(q, 128)", "stream(x, 32)"], (1, 2): ["tile(x, 128)", "stream(q, 32)"]}
    q, x, d = nc.axes("q x d", d=128)
    small = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    tiny = dataclasses.replace(nc.hardware.H100, name="tiny", smem_per_block=60 * 1024)  # forward: 56 KiB
    kernel = lower(small, hardware=tiny)
    assert kernel.differentiation == "none"
    assert "over the 61,440 B a block may use on tiny, even at 16-element blocks" in kernel.why_not
    Q, K, V = normal(key, (20, 128), (24, 128), (24, 128))
    assert R.rel_err(kernel(Q, K, V), R.attention(Q, K, V)) <= TOL
    with pytest.raises(NotLowerable, match="q×d \\(tile\\(q, 16\\), stream\\(x, 16\\)\\) would hold 65,664 B"):
        jax.grad(lambda Q: kernel(Q, K, V).sum())(Q)


def test_causal_backward_skips_hidden_blocks_and_runs_whole_ones_unmasked():
    """dQ (a 128-query tile, keys streamed by 64) visits no key chunk past its last query and runs those before
    its first query unmasked; dK, dV (a 128-key tile, queries streamed by 64) skips the query chunks before
    its first key and runs those past its last key unmasked."""
    h, q, x, d = nc.axes("h q x d", d=16)
    kernel = lower(
        derive(nc.library.multi_head_attention(h, q, x, d, causal=True), tile(q, 128), stream(x, 64), verify=False)
    )
    _, _, dq, dkv = kernel.kernels

    def chunks(k, tiled, streamed):
        masks = [m for b in k.plan.diagram.boxes if (m := affine_mask(b)) is not None and streamed in m.axes]
        assert len(masks) == 2  # the forward's mask, recomputed, and its derivative on dS
        return [int(c) for c in _visited(masks, streamed, 64, 8, {tiled: (128, 256)}, 512)]

    # (first, first whole, after the last whole, after the last visited) chunk
    assert chunks(dq, "q", "x") == [0, 0, 2, 4]  # keys [0, 128) whole, [128, 256) masked, the rest skipped
    assert chunks(dkv, "x", "q") == [2, 4, 8, 8]  # queries [0, 128) skipped, [128, 256) masked, the rest whole


def test_no_query_by_key_buffer_in_the_gradient():
    """The jaxpr of the lowered gradient has no array with both a query-sized and a key-sized dimension
    (padded or not) outside the kernels; the reference gradient has (so the scan can fail)."""
    q, x, d = nc.axes("q x d", d=16)
    attn = nc.library.attention(q, x, d, causal=True, score_mod=lambda s: 5.0 * jnp.tanh(s / 5.0))
    flash = derive(attn, tile(q, 16), stream(x, 16), verify=False)
    Q, K, V = jnp.ones((33, 16)), jnp.ones((50, 16)), jnp.ones((50, 16))

    def square(kernel) -> list:
        jaxpr = jax.make_jaxpr(jax.grad(lambda *a: kernel(*a).sum(), argnums=(0, 1, 2)))(Q, K, V)
        return [
            v.aval.shape
            for v in outside_kernels(jaxpr.jaxpr)
            if {33, 48} & set(v.aval.shape[-2:]) and {50, 64} & set(v.aval.shape[-2:])
        ]

    assert square(lower(flash)) == []
    assert square(lower(flash, backward="reference"))


def outside_kernels(jaxpr):
    """Every variable a jaxpr (and the jaxprs nested in it, but not a kernel's body) defines."""
    for eqn in jaxpr.eqns:
        yield from (v for v in eqn.outvars if hasattr(v.aval, "shape"))
        if eqn.primitive.name == "pallas_call":
            continue
        for p in eqn.params.values():
            for sub in p if isinstance(p, tuple | list) else (p,):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    yield from outside_kernels(getattr(inner, "jaxpr", inner))


class Twice(nc.generators.Generator):
    """A user's pointwise generator with semantics and no derivative rule."""

    def evaluate(self, ins, ctx):
        return [ins[0] * 2]


def test_a_backward_that_cannot_be_lowered_names_the_box_and_the_forward_runs(key):
    n, d = nc.axes("n d", d=32)
    X = nc.Array(n, d)
    kernel = lower(derive(Twice("twice", nc.Ty(X), nc.Ty(X)), tile(n, 16), verify=False))
    why = "reverse: no derivative rule for Twice box 'twice' (n×d → n×d); register one with napkin_cat.derivative"
    assert kernel.differentiation == "none"
    assert kernel.why_not == f"no lowered backward: {why}"
    (x,) = normal(key, (20, 32))
    assert R.rel_err(kernel(x), 2 * x) <= TOL
    with pytest.raises(NotLowerable, match=re.escape(why)):
        jax.grad(lambda x: kernel(x).sum())(x)


def test_plain_forgets_the_schedule():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    assert [str(w) for w in plain(tile(q, 16)(attn)).dom] == [str(w) for w in attn.dom]
