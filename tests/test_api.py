"""``lower``'s contract: typed fields on the kernel, backend choice, hardware, config everywhere,
shape guards at ``lower()`` or at the first call, and a backward that never stops the forward."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from lowering import Config, NotLowerable, lower
from napkin_cat import generators as g
from napkin_cat.diagram import Array
from napkin_cat.diagram import id as identity
from napkin_cat.hardware import A100, H100
from rewrites import derive, stream, tile


def rand(key, *shapes):
    keys = jax.random.split(key, len(shapes))
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shapes, strict=True)]


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def scheduled(attn, q, x, g=16, s=16):
    return derive(attn, tile(q, g), stream(x, s), verify=False)


def test_kernel_states_backend_and_differentiation_as_fields():
    q, x, d = nc.axes("q x d")
    flash = scheduled(nc.library.attention(q, x, d), q, x)
    k = lower(flash)
    assert (k.backend, k.differentiation, k.why_not) == ("triton", "lowered", None)
    k = lower(flash, backward="reference")
    assert (k.backend, k.differentiation, k.why_not, k.kernels) == ("triton", "reference", None, ())
    n, c, m = nc.axes("n c m")
    mm = lower(derive(nc.library.matmul(n, c, m), tile(n, 16), tile(m, 16), stream(c, 16), verify=False))
    assert (mm.differentiation, mm.why_not) == ("lowered", None)  # derived from nc.reverse, not matched
    norm = lower(derive(nc.library.rms_norm(n, c), tile(n, 16), verify=False))
    assert (norm.differentiation, norm.why_not) == ("lowered", None)  # a one-array sum over c is a block sum


def test_backend_auto_chooses_triton_and_others_are_refused():
    q, x, d = nc.axes("q x d")
    flash = scheduled(nc.library.attention(q, x, d), q, x)
    assert lower(flash, backend="auto").backend == "triton" == lower(flash, backend="triton").backend
    with pytest.raises(NotLowerable, match=re.escape("backend 'cuda': choose 'auto' (Triton), 'triton' or 'mosaic'")):
        lower(flash, backend="cuda")
    with pytest.raises(NotLowerable, match="backend 'mosaic': a lowering.Config tunes Triton; pass a .*MosaicConfig"):
        lower(flash, backend="mosaic", config=Config())


def test_hardware_sets_the_shared_memory_limit():
    """196,608 B (a 128×128 f32 query block, two stages of 64×128 key and value chunks) fits H100, not A100."""
    q, x = nc.axes("q x")
    d = nc.Axis("d", 128)
    flash = scheduled(nc.library.attention(q, x, d), q, x, g=128, s=64)
    config = Config(num_warps=8, num_stages=2)
    assert lower(flash, config=config).forward.hardware is H100  # interpreting on CPU: H100
    assert lower(flash, config=config, hardware="H100").forward.hardware is H100
    message = "the kernel would hold 196,608 B of shared memory (resident blocks plus 2 stages of each chunk), "
    message += f"over the {A100.smem_per_block:,} B a block may use on A100"
    with pytest.raises(NotLowerable, match=re.escape(message)):
        lower(flash, config=config, hardware=A100)
    with pytest.raises(NotLowerable, match=re.escape("lower: unknown hardware 'B200'; known: A100, A100-40GB")):
        lower(flash, hardware="B200")


def test_config_reaches_every_kernel(key):
    b, h, q, x, d = nc.axes("b h q x d")
    attn = nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True)
    config = Config(num_warps=2, num_stages=1)
    kernel = lower(scheduled(attn, q, x), config=config)
    assert len(kernel.kernels) == 3
    assert all(k.config == config for k in (kernel.forward, *kernel.kernels))
    with pytest.raises(NotLowerable, match="config must be a lowering.Config, got dict"):
        lower(scheduled(attn, q, x), config={"num_warps": 2})


@pytest.mark.parametrize("concrete", [True, False])
def test_an_axis_that_is_not_a_power_of_two_is_padded_with_the_neutral_value(key, concrete):
    n, xx = (nc.Axis("n"), nc.Axis("xx", 24 if concrete else None))
    kernel = lower(derive(nc.library.softmax(n, xx), tile(n, 16), verify=False))
    (v,) = rand(key, (16, 24))
    assert rel_err(kernel(v), jax.nn.softmax(v, axis=-1)) <= 1e-6  # f32: measured 1.2e-7


@pytest.mark.parametrize("concrete", [True, False])
def test_shared_memory_guard_at_lower_or_first_call(concrete):
    q, x = nc.axes("q x")
    d = nc.Axis("d", 512 if concrete else None)
    kernel = lambda: lower(scheduled(nc.library.attention(q, x, d), q, x, g=128, s=128))  # noqa: E731
    # Q: 128×512 f32 resident; K, V: 3 stages of 128×512 f32 chunks (the default for 128-row tiles)
    message = f"the kernel would hold {128 * 512 * 4 * 7:,} B of shared memory"
    with pytest.raises(NotLowerable, match=message):
        if concrete:
            kernel()
        else:
            Q = jnp.ones((128, 512))
            kernel()(Q, Q, Q)


def test_a_backward_that_cannot_be_built_never_stops_the_forward(key):
    """d = 512, tiles of 16 (f32): the forward holds 229,376 B, the backward kernels more than 232,448 B.
    The forward lowers and runs; the refusal comes when it is first differentiated, naming the footprint."""
    q, x = nc.axes("q x")
    d = nc.Axis("d", 512)
    kernel = lower(scheduled(nc.library.attention(q, x, d), q, x))
    assert kernel.differentiation == "lowered"
    Q, K, V = rand(key, (32, 512), (32, 512), (32, 512))
    ref = jax.nn.dot_product_attention(Q[None, :, None], K[None, :, None], V[None, :, None])[0, :, 0]
    assert rel_err(kernel(Q, K, V), ref) <= 1e-5
    with pytest.raises(NotLowerable, match=r"the kernel would hold [\d,]+ B of shared memory .* on H100"):
        jax.grad(lambda Q: kernel(Q, K, V).sum())(Q)


def attention_dk_dv(q, x, e, d):
    """Attention whose query/key head dim ``e`` differs from the value head dim ``d`` (as in MLA)."""
    V, S = Array(x, d), Array(q, x)
    scores = g.contract("q e, x e -> q x", q, x, e, scale=1 / np.sqrt(int(e.size)))
    return (scores @ identity(V)) >> (g.softmax(S, x) @ identity(V)) >> g.contract("q x, x d -> q d", q, x, d)


def test_query_key_head_dim_other_than_value_head_dim_lowers_and_differentiates(key):
    q, x, e, d = nc.axes("q x e d", e=48, d=32)
    kernel = lower(scheduled(attention_dk_dv(q, x, e, d), q, x))
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)
    Q, K, V, ct = rand(key, (40, 48), (40, 48), (40, 32), (40, 32))

    def reference(Q, K, V):  # written here, independently of the generators
        return jax.nn.softmax(Q @ K.T / jnp.sqrt(48.0), axis=-1) @ V

    out, vjp = jax.vjp(kernel, Q, K, V)
    ref, ref_vjp = jax.vjp(reference, Q, K, V)
    assert rel_err(out, ref) <= 1e-5  # measured ≤ 4e-7 (f32, CPU)
    for a, r in zip(vjp(ct), ref_vjp(ct), strict=True):
        assert rel_err(a, r) <= 1e-5


def test_a_box_after_the_attention_is_differentiated_by_its_own_rule(key):
    q, x, d = nc.axes("q x d")
    doubled = nc.library.attention(q, x, d) >> nc.scale(Array(q, d), 2.0)
    kernel = lower(scheduled(doubled, q, x))
    assert (kernel.differentiation, kernel.why_not) == ("lowered", None)  # the scale's own derivative rule
    Q, K, V = rand(key, (24, 16), (24, 16), (24, 16))
    expected = jax.grad(lambda Q: 2 * (jax.nn.softmax(Q @ K.T / 4.0, -1) @ V).sum())(Q)
    for k in (kernel, lower(scheduled(doubled, q, x), backward="reference")):
        assert rel_err(jax.grad(lambda Q, k=k: k(Q, K, V).sum())(Q), expected) <= 1e-5
