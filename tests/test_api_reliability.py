"""Reliability of ``lower``'s kernels: an epilogue's lowered backward, the layout checked at the call, what
``interpret=False`` does without a GPU, and the search cache under concurrent writers.

Tolerance: rel_err of the f32 forward and every gradient in interpret mode, measured ≤ 4.8e-7 over 9 seeds.
"""

import json
import re
import threading

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
import references as R

import napkin_cat as nc
from lowering import NotLowerable, lower
from lowering import _search as search
from lowering._backward import backward_of
from napkin_cat.errors import EvaluationError
from rewrites import derive, stream, tile

TOL = 2e-6  # f32: measured ≤ 4.8e-7
CPU = jax.devices()[0].platform != "gpu"


def normal(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def linear_gelu(n, k, m):
    """``gelu(A·B + b)``: a matmul with a bias and GELU epilogue."""
    C = nc.Array(n, m)
    return (nc.library.matmul(n, k, m) @ nc.id(nc.Array(m))) >> nc.add(C, nc.Array(m)) >> nc.gelu(C)


def linear_gelu_reference(A, B, b):
    return jax.nn.gelu(jnp.einsum("nk,km->nm", A, B) + b, approximate=False)


# --- the epilogue's lowered backward --------------------------------------------------------------------


def test_an_epilogue_after_a_streamed_contraction_has_a_lowered_backward(seed, key):
    """dZ = dC ⊙ gelu′(A·B + b) sums k, which dA = dZ·Bᵀ holds: a kernel streamed over k as the forward computes
    dZ first (``lowering._backward.summed_values``), and dA, dB, db read it. Ragged sizes from the seed."""
    n_, k_, m_ = (int(v) for v in np.random.default_rng(seed).integers(17, 40, 3))
    n, k, m = nc.axes("n k m")
    kernel = lower(derive(linear_gelu(n, k, m), tile(n, 16), tile(m, 16), stream(k, 16), verify=False))
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)
    A, B, b, ct = normal(key, (n_, k_), (k_, m_), (m_,), (n_, m_))
    assert R.rel_err(kernel(A, B, b), linear_gelu_reference(A, B, b)) <= TOL

    def pullback(f):
        return jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=(0, 1, 2))(A, B, b)

    for i, (ours, want) in enumerate(zip(pullback(kernel), pullback(linear_gelu_reference), strict=True)):
        assert R.rel_err(ours, want) <= TOL, f"gradient of input {i}"
    assert "backward kernel Σ_k (tile(n, 16), tile(m, 16), stream(k, 16))" in kernel.backends


def test_the_epilogue_sum_is_computed_once_streamed_as_the_forward():
    """The first backward kernel makes dZ[n, m] streaming k; no later kernel reads A·B's k-sum again (none
    streams k), and the bias's cotangent loops over no axis it never reads."""
    n, k, m = nc.axes("n k m")
    b = backward_of(derive(linear_gelu(n, k, m), tile(n, 16), tile(m, 16), stream(k, 16), verify=False).diagram)
    first, *rest = b.pieces
    assert (first.feeds, first.what, [str(r) for r in first.rules]) == (
        True,
        "Σ_k",
        ["tile(n, 16)", "tile(m, 16)", "stream(k, 16)"],
    )
    assert [str(w) for w in first.diagram.cod] == ["n×m"]
    assert not any(str(r).startswith("stream(k") for p in rest for r in p.rules)
    assert [[str(r) for r in p.rules] for p in rest if p.outputs == (2,)] == [["tile(n, 16)", "tile(m, 16)"]]


# --- the layout, checked at the call ------------------------------------------------------------------


@pytest.fixture(scope="module")
def multi_head():
    b, h, q, x = nc.axes("b h q x")
    att = nc.library.multi_head_attention(h, q, x, nc.Axis("d", 16), batch=(b,))
    return lower(derive(att, tile(q, 16), stream(x, 16), verify=False))


def test_the_kernel_states_its_layout(multi_head):
    assert multi_head.layout == (("b", "h", "q", "d"), ("b", "h", "x", "d"), ("b", "h", "x", "d"))


def test_an_array_in_attentions_order_is_refused_naming_the_input_and_the_fix(multi_head, key):
    """Q in the diagram's [b, h, q, d] but K in nc.attention's [b, x, h, d]: the sizes of h disagree, and the
    call names input 1, its layout, the shape and the transpose, before anything runs (under jit too)."""
    Q, K, V = normal(key, (2, 3, 20, 16), (2, 24, 3, 16), (2, 3, 24, 16))
    message = (
        "kernel input 1 (b×h×x~16×d:f32@HBM): shape (2, 24, 3, 16) read as (b, h, x, d) gives h = 24, but h = 3 "
        "in input 0; the kernel takes each array in its diagram's axis order (kernel.layout), which may not be "
        "nc.attention's (b, q, h, d): transpose the array into (b, h, x, d)"
    )
    with pytest.raises(EvaluationError, match=re.escape(message)):
        multi_head(Q, K, V)
    with pytest.raises(EvaluationError, match=re.escape(message)):
        jax.jit(multi_head)(Q, K, V)
    out = multi_head(Q, jnp.swapaxes(K, 1, 2), V)  # the fix the message names
    assert out.shape == (2, 3, 20, 16)


def test_a_size_the_diagram_fixes_and_a_rank_are_checked(multi_head, key):
    Q, K = normal(key, (2, 3, 20, 8), (2, 3, 24, 16))
    with pytest.raises(
        EvaluationError, match=re.escape("(2, 3, 20, 8) read as (b, h, q, d) gives d = 8, but the diagram fixes d = 16")
    ):
        multi_head(Q, K, K)
    with pytest.raises(
        EvaluationError,
        match=re.escape(
            "kernel input 0 (b×h×q/16×d:f32@HBM): shape (3, 20, 16) read as (b, h, q, d) has 3 axes, expected 4"
        ),
    ):
        multi_head(K[0, :, :20], K, K)


def test_an_open_kernel_checks_the_layout_before_choosing(key):
    q, x = nc.axes("q x")
    kernel = lower(derive(nc.library.attention(q, x, nc.Axis("d", 16)), tile(q), stream(x), verify=False))
    assert kernel.layout == (("q", "d"), ("x", "d"), ("x", "d"))
    Q, K, V = normal(key, (20, 16), (24, 16), (16, 24))
    with pytest.raises(
        EvaluationError,
        match=re.escape(
            "kernel input 2 (x~s_x×d:f32@HBM): shape (16, 24) read as (x, d) gives x = 16, but x = 24 in input 1"
        ),
    ):
        kernel(Q, K, V)
    assert kernel.tiles is None  # refused before any kernel was chosen


# --- interpret=False without a GPU ----------------------------------------------------------------------


@pytest.mark.skipif(not CPU, reason="what a machine without a GPU says")
def test_interpret_false_without_a_gpu_is_refused_saying_so(key):
    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    refused = (
        "lower(interpret=False) compiles the kernels for a GPU, and this machine has no GPU (jax's device is 'cpu')"
    )
    for backend in ("auto", "triton"):
        with pytest.raises(NotLowerable, match=re.escape(f"{refused}; pass interpret=None")):
            lower(flash, backend=backend, interpret=False)
    # hardware= names the GPU a kernel is lowered for elsewhere (tests/test_cuda_lowering.py; Mosaic's kernels need
    # no model, tests/test_mosaic.py): it never makes this machine one, and calling such a kernel here says so
    kernel = lower(flash, interpret=False, hardware="H100")
    (Q,) = normal(key, (16, 16))
    with pytest.raises(
        NotLowerable, match=re.escape("kernel lowered with interpret=False, and this machine has no GPU")
    ):
        kernel(Q, Q, Q)
    assert (
        R.rel_err(
            lower(flash, interpret=None)(Q, Q, Q),
            jax.nn.dot_product_attention(Q[None, :, None], Q[None, :, None], Q[None, :, None])[0, :, 0],
        )
        <= TOL
    )


# --- the search cache ---------------------------------------------------------------------------------


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "search.json"
    monkeypatch.setattr(search, "CACHE", path)
    return path


def test_concurrent_writers_lose_no_entry(cache):
    """Two threads store 40 entries each at once (each store reads, merges and replaces the file): all 80 are
    there after, the file is whole JSON, and no temporary file is left behind."""

    def write(who):
        for i in range(40):
            search.store(f"{who} {i}", {"seconds": float(i)})

    threads = [threading.Thread(target=write, args=(who,)) for who in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    entries = json.loads(cache.read_text())
    assert len(entries) == 80
    assert all(search.cached(f"{who} {i}") == {"seconds": float(i)} for who in "ab" for i in range(40))
    assert sorted(p.name for p in cache.parent.iterdir()) == ["search.json", "search.json.lock"]


def test_an_entry_from_another_jax_or_device_is_not_read(cache):
    here = search.versioned("attention")
    versions = f"jax {jax.__version__} jaxlib {jaxlib.version.__version__}"
    assert here == f"attention | {jax.devices()[0].device_kind} | {versions}"
    cache.write_text(json.dumps({here.replace(f"jax {jax.__version__}", "jax 0.0.1"): {"seconds": 1.0}}))
    assert search.cached("attention") is None
    made = []

    def make(sizes, config):
        made.append(sizes)
        return jnp.sin

    args = (jnp.ones(8),)
    best = search.search(make, args, tiles=({"g_q": 16},), warps=(4,), stages=(2,), key="attention", log=lambda _: None)
    assert (
        search.search(make, args, tiles=({"g_q": 16},), warps=(4,), stages=(2,), key="attention", log=lambda _: None)
        == best
    )
    assert len(made) == 1  # the second search read the cache
    assert len(json.loads(cache.read_text())) == 2


def test_a_corrupt_cache_is_named(cache):
    cache.write_text("{")
    with pytest.raises(NotLowerable, match=re.escape(f"the search cache {cache} is not JSON")):
        search.cached("attention")
