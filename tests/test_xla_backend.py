"""``backend="xla"``: scheduled diagrams as plain JAX (tiles vmapped, the stream a ``lax.fori_loop``), against
``jax.nn.dot_product_attention`` forward and backward (the derived backward's pieces emitted by the same
backend), at sizes the blocks do not divide."""

import jax
import jax.numpy as jnp
import pytest

import napkin_cat as nc
from lowering import Config, NotLowerable, lower
from lowering._backward import backward_of
from lowering.xla import XlaConfig
from rewrites import derive, stream, tile
from tests.references import rel_err

#: f32: the online softmax against jax.nn's (measured on 2 seeds, forward and gradients: ≤ 5e-7 through lower,
#: ≤ 2e-6 through nc.attention)
TOL = 1e-5


def nn(Q, K, V, **kw):
    """jax.nn's attention on ``[..., n, d]`` arrays laid out as the library's (heads before positions)."""
    lead = Q.shape[:-2]
    flat = [a.reshape(-1, *a.shape[-2:]).transpose(1, 0, 2)[None] for a in (Q, K, V)]  # [1, n, heads, d]
    out = jax.nn.dot_product_attention(*flat, **kw)[0].transpose(1, 0, 2)
    return out.reshape(*lead, *out.shape[-2:])


def draw(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def check(kernel, ref, arrays):
    """Forward and every input's gradient of ``kernel`` against ``ref``, with a random cotangent."""
    ct = jax.random.normal(jax.random.key(7), jnp.shape(ref(*arrays)))
    assert rel_err(kernel(*arrays), ref(*arrays)) <= TOL
    got = jax.grad(lambda *a: jnp.sum(kernel(*a) * ct), argnums=(0, 1, 2))(*arrays)
    want = jax.grad(lambda *a: jnp.sum(ref(*a) * ct), argnums=(0, 1, 2))(*arrays)
    for g, w in zip(got, want, strict=True):
        assert rel_err(g, w) <= TOL


def test_causal_multi_head_attention_equals_jax_nn_at_ragged_sizes(key):
    """N = 40: a multiple of neither the 16-row tile nor the 16-key chunk."""
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False), backend="xla")
    assert (kernel.backend, kernel.differentiation, kernel.refused) == ("xla", "lowered", {})
    Q, K, V = draw(key, (2, 3, 40, 8), (2, 3, 40, 8), (2, 3, 40, 8))
    check(kernel, lambda Q, K, V: nn(Q, K, V, is_causal=True), (Q, K, V))
    assert set(kernel.backends.values()) == {"xla"}


def test_dense_grouped_query_attention_equals_jax_nn(key):
    hk, g_, q, x, d = nc.axes("hk g q x d")
    attn = nc.library.grouped_query_attention(hk, g_, q, x, d)
    kernel = lower(derive(attn, tile(q, 16), stream(x, 16), verify=False), backend="xla")
    Q, K, V = draw(key, (2, 3, 32, 8), (2, 32, 8), (2, 32, 8))

    def ref(Q, K, V):  # jax.nn: [batch, n, heads, d], query head h reads key head h // groups
        q_ = Q.reshape(6, 32, 8).transpose(1, 0, 2)[None]
        out = jax.nn.dot_product_attention(q_, K.transpose(1, 0, 2)[None], V.transpose(1, 0, 2)[None])
        return out[0].transpose(1, 0, 2).reshape(2, 3, 32, 8)

    check(kernel, ref, (Q, K, V))


def test_soft_capped_attention_equals_its_formula(key):
    q, x, d = nc.axes("q x d")
    kernel = lower(
        derive(nc.library.softcap_attention(q, x, d, cap=5.0), tile(q, 16), stream(x, 16), verify=False), backend="xla"
    )
    Q, K, V = draw(key, (33, 8), (20, 8), (20, 8))
    Q = 4 * Q  # scores beyond the cap, where tanh bends

    def ref(Q, K, V):
        s = 5.0 * jnp.tanh(Q @ K.T / jnp.sqrt(8.0) / 5.0)
        return jax.nn.softmax(s, axis=-1) @ V

    check(kernel, ref, (Q, K, V))


def test_open_sizes_are_chosen_at_the_call_and_a_config_tunes_the_loop(key):
    q, x = nc.axes("q x")
    flash = derive(nc.library.attention(q, x, nc.Axis("d", 16), causal=True), tile(q), stream(x), verify=False)
    kernel = lower(flash, backend="xla", config=XlaConfig(unroll=2))
    Q, K, V = draw(key, (50, 16), (50, 16), (50, 16))
    assert rel_err(kernel(Q, K, V), nn(Q, K, V, is_causal=True)) <= TOL
    assert kernel.backend == "xla" and kernel.forward.config == XlaConfig(unroll=2)


def test_a_triton_config_is_refused_by_name():
    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    with pytest.raises(
        NotLowerable, match="backend 'xla': a lowering.TritonConfig tunes Triton; pass a lowering.XlaConfig"
    ):
        lower(flash, backend="xla", config=Config())


def test_the_entry_passes_the_backend_through(key):
    Q, K, V = (4 * a for a in draw(key, (2, 40, 4, 8), (2, 40, 4, 8), (2, 40, 4, 8)))
    out = nc.attention(Q, K, V, is_causal=True, backend="xla")
    assert rel_err(out, jax.nn.dot_product_attention(Q, K, V, is_causal=True)) <= TOL
    got = jax.grad(lambda Q: nc.attention(Q, K, V, is_causal=True, backend="xla").sum())(Q)
    want = jax.grad(lambda Q: jax.nn.dot_product_attention(Q, K, V, is_causal=True).sum())(Q)
    assert rel_err(got, want) <= TOL


def test_one_pass_backward_writes_the_streamed_axis_per_chunk(key):
    """``XlaConfig(one_pass=True)``: dK and dV (which tile keys and stream queries by default) join dQ's kernel
    streaming keys, queries kept whole, their slices written per chunk of keys: one gradient kernel after Δ's,
    against jax.nn at sizes the chunks do not divide. Triton refuses such a plan, naming the output."""
    b, h, q, x, d = nc.axes("b h q x d")
    flash = derive(
        nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True), tile(q, 16), stream(x, 16), verify=False
    )
    kernel = lower(flash, backend="xla", config=XlaConfig(one_pass=True))
    Q, K, V = draw(key, (2, 3, 40, 8), (2, 3, 40, 8), (2, 3, 40, 8))
    check(kernel, lambda *a: nn(*a, is_causal=True), (Q, K, V))
    assert [k for k in kernel.backends if k.startswith("backward")] == [
        "backward kernel Δ (tile(q, 16))",
        "backward kernel d(input 0), d(input 1), d(input 2) (stream(x, 16))",
    ]
    one_pass = backward_of(flash.diagram, one_pass=True).pieces[-1].scheduled  # writes dK and dV per chunk
    with pytest.raises(NotLowerable, match="carries the streamed axis 'x': Triton writes each output once"):
        lower(one_pass, backend="triton", interpret=True)
