"""The library's attention variants, cross-entropy and norms, lowered (Triton, interpret mode on CPU), against
references written here from their formulas in plain jax.numpy / jax.nn (sharing no code with the generators),
forward and gradients through the lowered backward (``kernel.differentiation`` must be "lowered": nothing
falls back to the reference's gradients);
the block sparsity of affine masks; and the refusals of index functions that a kernel cannot run.

Tolerances: f32, relative error max |error| / max |reference|; measured over 10 seeds at the sizes below
≤ 4e-7 forward and ≤ 1.2e-6 for gradients (the sink's ≤ 2e-6), so 2e-6 and 6e-6. Cross-entropy's gradient
at logits near ±1000 is bounded by the f32 rounding of ``s − L`` (eps·|s| ≈ 1.2e-4); measured ≤ 2.5e-5 over
8 seeds, so 6e-5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as R
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import Config, NotLowerable, lower
from lowering._blocks import visited as _visited
from napkin_cat import library as L
from rewrites import derive, stream, tile

FWD, GRAD = 2e-6, 6e-6
GRAD_LARGE_LOGITS = 6e-5
H, B = 2, 2  # heads, batch
q, x, d, h, b = nc.axes("q x d h b", d=16, h=H)


def normal(key, *shapes):
    return [
        jax.random.normal(k, s, jnp.float32) for k, s in zip(jax.random.split(key, len(shapes)), shapes, strict=True)
    ]


def close(got, want, tol, seed, what):
    err = R.rel_err(got, want)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} (NAPKIN_SEED={seed})"


def scores(Q, K):
    return jnp.einsum("...qd,...xd->...qx", Q, K) / np.sqrt(Q.shape[-1])


def softmax_rows(s, V):
    p = jax.nn.softmax(s, -1)
    p = jnp.where(jnp.isfinite(s).any(-1, keepdims=True), p, 0.0)  # an empty row gives 0 (the library's rule)
    return jnp.einsum("...qx,...xd->...qd", p, V)


def grid(nq, nx):
    return jnp.arange(nq)[:, None], jnp.arange(nx)[None, :]


def check(
    diagram, schedule, reference, args, seed, *, wrt=None, backward="lowered", fwd_tol=FWD, grad_tol=GRAD, config=None
):
    """The kernel's output against ``reference``; the gradients of a random projection w.r.t. ``wrt``
    (default: every float input) against jax.grad of the reference."""
    kernel = lower(derive(diagram, *schedule, verify=False), backward=backward, config=config)
    want = jax.jit(reference)(*args)  # the reference compiled once, not op by op
    close(jax.jit(kernel)(*args), want, fwd_tol, seed, "forward")
    # after the first call: on a GPU under auto a kernel whose head dim decides its backend is built when called
    # (an OpenKernel, which says nothing of itself before)
    assert kernel.differentiation == backward, kernel.why_not
    wrt = tuple(i for i, a in enumerate(args) if a.dtype == jnp.float32) if wrt is None else wrt
    (ct,) = normal(jax.random.key(seed + 1), want.shape)

    def loss(f):
        return lambda *a: jnp.sum(f(*a) * ct)

    ours = jax.jit(jax.grad(loss(kernel), argnums=wrt))(*args)
    theirs = jax.jit(jax.grad(loss(reference), argnums=wrt))(*args)
    for i, g, w in zip(wrt, ours, theirs, strict=True):
        close(g, w, grad_tol, seed, f"gradient of input {i} ({kernel.differentiation} backward)")
    return kernel


def test_sliding_window(key, seed):
    W, n = 20, 72
    Q, K, V = normal(key, (n, 16), (n, 16), (n, 16))
    i, j = grid(n, n)
    ref = lambda Q, K, V: softmax_rows(jnp.where((j <= i) & (j > i - W), scores(Q, K), -jnp.inf), V)  # noqa: E731
    kernel = check(L.sliding_window_attention(q, x, d, window=W), (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)
    # blocks outside the band are never visited: a NaN value there reaches no query tile that cannot see it
    poisoned = V.at[:16].set(jnp.nan)
    out = jax.jit(kernel)(Q, K, poisoned)
    assert bool(jnp.isfinite(out[48:]).all()) and bool(jnp.isnan(out[:16]).all())


def test_affine_blocks():
    """The chunks a query tile visits: hidden ones skipped, whole ones unmasked, only cut ones masked."""
    band = L.Affine.causal("q", "x") & L.Affine.at_least(19, x=1, q=-1)  # q − 20 < x ≤ q
    visited = lambda lo, hi: [int(c) for c in _visited([band], "x", 16, 8, {"q": (lo, hi)}, 128)]  # noqa: E731
    assert visited(64, 80) == [2, 4, 4, 5]  # keys 45..79: chunks 2..4 cut, none whole, 0, 1, 5.. hidden
    wide = L.Affine.causal("q", "x") & L.Affine.at_least(63, x=1, q=-1)  # q − 64 < x ≤ q
    assert [int(c) for c in _visited([wide], "x", 16, 8, {"q": (64, 80)}, 128)] == [0, 1, 4, 5]  # 1..3 whole
    prefix = L.Affine.causal("q", "x") | L.Affine.at_least(39, x=-1)  # x ≤ q or x < 40
    assert [int(c) for c in _visited([prefix], "x", 16, 8, {"q": (96, 112)}, 128)] == [0, 0, 6, 7]
    causal = L.Affine.causal("q", "x")
    assert [int(c) for c in _visited([causal], "x", 16, 8, {"q": (16, 32)}, 128)] == [0, 0, 1, 2]


def test_prefix_lm_ragged(key, seed):
    P, n = 21, 45
    Q, K, V = normal(key, (n, 16), (n, 16), (n, 16))
    i, j = grid(n, n)
    ref = lambda Q, K, V: softmax_rows(jnp.where((j <= i) | (j < P), scores(Q, K), -jnp.inf), V)  # noqa: E731
    check(L.prefix_lm_attention(q, x, d, prefix=P), (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)


def test_document_masking(key, seed):
    nq, nx = 40, 40
    Q, K, V = normal(key, (nq, 16), (nx, 16), (nx, 16))
    cuts = jnp.sort(jax.random.randint(jax.random.fold_in(key, 7), (3,), 1, nx))
    seg = jnp.searchsorted(cuts, jnp.arange(nx), side="right").astype(jnp.int32)
    i, j = grid(nq, nx)

    def ref(Q, K, V, sq, sx):
        return softmax_rows(jnp.where((sq[:, None] == sx[None, :]) & (j <= i), scores(Q, K), -jnp.inf), V)

    diagram = L.document_attention(q, x, d, causal=True)
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, seg, seg], seed, wrt=(0, 1, 2))


def test_softcap(key, seed):
    nq, nx = 24, 40
    Q, K, V = (4 * a for a in normal(key, (nq, 16), (nx, 16), (nx, 16)))
    ref = lambda Q, K, V: softmax_rows(30.0 * jnp.tanh(scores(Q, K) / 30.0), V)  # noqa: E731
    # inputs ×4 put the scores near the cap, so the f32 error is larger: over 40 seeds ≤ 2.3e-6 forward, ≤ 4.8e-6
    # for gradients (2.06e-6 failed the shared 2e-6 bound at seed 2003329263)
    schedule = (tile(q, 16), stream(x, 16))
    check(L.softcap_attention(q, x, d, cap=30.0), schedule, ref, [Q, K, V], seed, fwd_tol=5e-6, grad_tol=1.2e-5)


def test_alibi_reads_the_head(key, seed):
    n = 40
    Q, K, V = normal(key, (B, H, n, 16), (B, H, n, 16), (B, H, n, 16))
    i, j = grid(n, n)
    slopes = 2.0 ** (-8.0 * jnp.arange(1, H + 1) / H)

    def ref(Q, K, V):
        s = scores(Q, K) - slopes[:, None, None] * jnp.abs(i - j)
        return softmax_rows(jnp.where(j <= i, s, -jnp.inf), V)

    check(L.alibi_attention(h, q, x, d, batch=(b,), causal=True), (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)


def test_learned_bias(key, seed):
    nq, nx = 24, 40
    Q, K, V, Bias = normal(key, (H, nq, 16), (H, nx, 16), (H, nx, 16), (H, nq, nx))
    ref = lambda Q, K, V, Bias: softmax_rows(scores(Q, K) + Bias, V)  # noqa: E731
    check(L.biased_attention(q, x, d, batch=(h,)), (tile(q, 16), stream(x, 16)), ref, [Q, K, V, Bias], seed)


def test_shared_relative_bias(key, seed):
    n = 40
    Q, K, V, Bias = normal(key, (H, n, 16), (H, n, 16), (H, n, 16), (n, n))
    ref = lambda Q, K, V, Bias: softmax_rows(scores(Q, K) + Bias, V)  # noqa: E731
    diagram = L.biased_attention(q, x, d, batch=(h,), bias_batch=())
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, Bias], seed, wrt=(3,))  # the bias's gradient


def test_bias_shared_by_the_batch(key, seed):
    """A learned [h, q, x] bias shared by an odd batch (3): its gradient sums the batch inside one kernel."""
    nb, nq, nx = 3, 24, 40
    Q, K, V, Bias = normal(key, (nb, H, nq, 16), (nb, H, nx, 16), (nb, H, nx, 16), (H, nq, nx))
    i, j = grid(nq, nx)
    ref = lambda Q, K, V, Bias: softmax_rows(jnp.where(j <= i, scores(Q, K) + Bias, -jnp.inf), V)  # noqa: E731
    b3 = nc.Axis("b", nb)
    diagram = L.biased_attention(q, x, d, batch=(b3, h), bias_batch=(h,), causal=True)
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, Bias], seed)


def test_bias_gradient_streams_the_batch():
    """No widened [h, q, x, b] temporary: the bias's cotangent kernel streams b one element at a time and
    writes [h, q, x] once, nothing summed after it."""
    from lowering._backward import backward_of

    diagram = L.biased_attention(q, x, d, batch=(b, h), bias_batch=(h,), causal=True)
    (piece,) = [
        p
        for p in backward_of(derive(diagram, tile(q, 16), stream(x, 16), verify=False).diagram).pieces
        if p.outputs == (3,)
    ]
    assert piece.sums == ((),)
    assert [str(r) for r in piece.rules] == ["tile(q, 16)", "tile(x, 16)", "stream(b, 1)"]
    assert piece.scheduled.cod.inside[0].names == ("h", "q", "x")


def test_bias_shared_by_batch_and_heads_streams_the_heads():
    """A bias shared by the batch and the heads (a relative-position table read at q − x): the cotangent kernel
    streams the heads, the innermost batch axis, and leaves only [b, q, x] to sum after it, not [h, q, x]."""
    from lowering._backward import backward_of

    diagram = L.biased_attention(q, x, d, batch=(b, h), bias_batch=(), causal=True)
    (piece,) = [
        p
        for p in backward_of(derive(diagram, tile(q, 16), stream(x, 16), verify=False).diagram).pieces
        if p.outputs == (3,)
    ]
    assert [str(r) for r in piece.rules] == ["tile(q, 16)", "tile(x, 16)", "stream(h, 1)"]
    assert piece.scheduled.cod.inside[0].names == ("b", "q", "x") and piece.sums == ((0,),)


def test_a_shared_bias_under_a_modifier_reading_the_head(key, seed):
    """A bias shared by the batch and the heads under ``score_mod(s, h) = s·(1 + h/4)``, causal, over three tiles a
    side: dB streams the heads one at a time on blocks without them (``lowering.triton._kernel.summed_singly``), and
    the modifier's derivative reads the head from the loop's step as from a grid index."""
    n = 40
    Q, K, V = normal(key, (B, H, n, 16), (B, H, n, 16), (B, H, n, 16))
    (bias,) = normal(jax.random.fold_in(key, 1), (n, n))
    i, j = grid(n, n)
    scale = 1 + jnp.arange(H)[:, None, None] / 4

    def ref(Q, K, V, bias):
        return softmax_rows(jnp.where(j <= i, (scores(Q, K) + bias) * scale, -jnp.inf), V)

    diagram = L.dot_product_attention(
        q, x, d, batch=(b, h), bias_batch=(), causal=True, score_mod=lambda s, h: s * (1 + h / 4)
    )
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, bias], seed)


def test_attention_sinks(key, seed):
    nq, nx = 24, 40
    Q, K, V, sink = normal(key, (H, nq, 16), (H, nx, 16), (H, nx, 16), (H,))
    i, j = grid(nq, nx)

    def ref(Q, K, V, sink):  # the sink as one more logit column, its value row 0
        s = jnp.where(j <= i, scores(Q, K), -jnp.inf)
        s = jnp.concatenate([s, jnp.broadcast_to(sink[:, None, None], (H, nq, 1))], -1)
        return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, -1)[..., :-1], V)

    diagram = L.sink_attention(q, x, d, batch=(h,), causal=True)
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, sink], seed)


def test_a_sink_holding_nearly_all_of_the_normaliser(key, seed):
    """Sinks of 60 and 200 against scores of order 1: the keys' weight σ(L − sink) is about e⁻⁵⁵ in head 0 and
    underflows to 0 in head 1, where the backward's folded log-sum-exp L − log w is +∞ and R/w divides by
    the floor instead of 0. Outputs and gradients are tiny or zero, finite, and match the reference.

    Tolerances: the exponent s − 60 carries f32 rounding of eps·60 ≈ 7e-6 (relative, in the reference too):
    forward measured ≤ 3.8e-6 over 9 seeds, so 1e-5; Q, K, V's gradients ≤ 3e-7, so GRAD. The sink's
    gradient −Σ_q p_sink·Δ_q sums terms of both signs of order e⁻⁵⁵: its error is bounded against Σ_q |Δ_q|
    (measured ≤ 7.4e-7 of it over 10 seeds, so 3e-6), not against the near-cancelled sum."""
    nq, nx = 24, 40
    Q, K, V, ct = normal(key, (H, nq, 16), (H, nx, 16), (H, nx, 16), (H, nq, 16))
    sink = jnp.array([60.0, 200.0])
    i, j = grid(nq, nx)

    def ref(Q, K, V, sink):
        s = jnp.where(j <= i, scores(Q, K), -jnp.inf)
        s = jnp.concatenate([s, jnp.broadcast_to(sink[:, None, None], (H, nq, 1))], -1)
        return jnp.einsum("hqx,hxd->hqd", jax.nn.softmax(s, -1)[..., :-1], V)

    diagram = L.sink_attention(q, x, d, batch=(h,), causal=True)
    kernel = check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V, sink], seed, wrt=(0, 1, 2), fwd_tol=1e-5)
    assert float(jnp.abs(kernel(Q, K, V, sink)[1]).max()) == 0.0

    def loss(f):
        return lambda s: jnp.sum(f(Q, K, V, s) * ct)

    ours, theirs = jax.grad(loss(kernel))(sink), jax.grad(loss(ref))(sink)
    scale = jnp.abs(jnp.sum(ct * ref(Q, K, V, sink), -1)).sum(-1)  # Σ_q |Δ_q| per head (p_sink ≈ 1)
    assert bool(jnp.isfinite(ours).all()) and float(ours[1]) == 0.0
    err = float(jnp.abs(ours - theirs)[0] / scale[0])
    assert err <= 3e-6, f"sink gradient: error {err:.2e} of Σ_q |Δ_q| (NAPKIN_SEED={seed})"


def test_sigmoid_attention(key, seed):
    nq, nx = 24, 40
    Q, K, V = normal(key, (nq, 16), (nx, 16), (nx, 16))
    i, j = grid(nq, nx)
    ref = lambda Q, K, V: jnp.where(j <= i, jax.nn.sigmoid(scores(Q, K) - np.log(nx)), 0.0) @ V  # noqa: E731
    check(L.sigmoid_attention(q, x, d, causal=True), (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)


def test_normalised_attention_ragged(key, seed):
    nq, nx = 24, 40
    Q, K, V = normal(key, (nq, 16), (nx, 16), (nx, 16))
    e = jnp.exp(scores(Q, K))
    ref = lambda Q, K, V: (jnp.exp(scores(Q, K)) @ V) / jnp.sqrt(jnp.exp(scores(Q, K)).sum(-1, keepdims=True))  # noqa: E731
    assert bool(jnp.isfinite(e).all())
    diagram = L.normalised_attention(q, x, d, a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt)
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)


@settings(max_examples=2, deadline=None)
@given(nq=st.integers(1, 40), nx=st.integers(2, 40), groups=st.sampled_from([1, 2]), seed=st.integers(0, 2**31 - 1))
def test_cross_attention_gqa_ragged(nq, nx, groups, seed):
    """From two keys: with one, dQ is identically 0 and a relative error is undefined. The seed is drawn with the
    sizes, so hypothesis's falsifying example replays a failure."""
    g = nc.Axis("g", groups)
    Q, K, V = normal(jax.random.key(seed), (H, groups, nq, 16), (H, nx, 16), (H, nx, 16))
    ref = lambda Q, K, V: softmax_rows(scores(Q, K[:, None]), V[:, None])  # noqa: E731
    diagram = L.grouped_query_attention(h, g, q, x, d)
    check(diagram, (tile(q, 16), stream(x, 16)), ref, [Q, K, V], seed)


def test_cross_entropy_large_logits_wide_vocabulary(key, seed):
    n_, v_ = nc.axes("n v")
    rows, vocab = 20, 4096 * 3
    (X,) = normal(key, (rows, vocab))
    X = 200.0 * X  # logits far above 88, where exp overflows f32
    labels = jax.random.randint(jax.random.fold_in(key, 1), (rows,), 0, vocab)
    Y = jax.nn.one_hot(labels, vocab)
    ref = lambda X, Y: jax.nn.logsumexp(X, -1) - jnp.sum(X * Y, -1)  # noqa: E731
    schedule = (tile(n_, 16), stream(v_, 256))
    check(L.cross_entropy(n_, v_), schedule, ref, [X, Y], seed, wrt=(0,), grad_tol=GRAD_LARGE_LOGITS)


@pytest.mark.parametrize("width", [96, 768])
def test_norms_at_any_width(key, seed, width):
    n_, d_ = nc.axes("n d")
    X, gamma, beta = normal(key, (20, width), (width,), (width,))
    X = 3.0 * X + 1.0

    def layer_norm(X, gamma, beta):
        mean = X.mean(-1, keepdims=True)
        return (X - mean) / jnp.sqrt(((X - mean) ** 2).mean(-1, keepdims=True) + 1e-5) * gamma + beta

    def rms_norm(X, gamma):
        return X / jnp.sqrt((X**2).mean(-1, keepdims=True) + 1e-6) * gamma

    # at 768 (padded to 1024) in f32 the dγ, dβ kernel streams rows of 16 × 1024 of X and dY: one pipeline
    # stage fits an H100's shared memory (the default three would not, and lowering refuses them by name)
    config = Config(num_warps=4, num_stages=1) if width > 512 else None
    check(L.layer_norm(n_, d_), (tile(n_, 16),), layer_norm, [X, gamma, beta], seed, config=config)
    check(L.rms_norm(n_, d_), (tile(n_, 16),), rms_norm, [X, gamma], seed, config=config)


def test_closure_over_an_array_is_refused():
    seg = jnp.array([0, 0, 1, 1])
    diagram = L.attention(q, x, d, mask=lambda q, x: seg[q] == seg[x])
    with pytest.raises(NotLowerable, match=r"box 'mask <lambda>': <lambda> closes over arrays \(seg \(4,\)\)"):
        lower(derive(diagram, tile(q, 16), stream(x, 16), verify=False))


def test_alibi_needs_a_concrete_head_count():
    with pytest.raises(nc.AxisError, match="the head axis 'h' needs a concrete size"):
        L.alibi_attention(nc.Axis("h"), q, x, d)
