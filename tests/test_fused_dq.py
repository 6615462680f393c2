"""The fused backward (``backward="fused"``): dQ computed in the dK·dV kernel, each program's partial sum over its key
tile added into an f32 output (FlashAttention-3's five products), against ``jax.grad`` of attention written here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from lowering import MosaicLowered, NotLowerable, lower, plan
from lowering._backward import backward_of
from rewrites import RewriteError, derive, execute, stream, summed_outputs, tile

#: relative error of each gradient (its largest absolute error over its largest magnitude), measured against f32
#: jax.grad of the reference on inputs of the inputs' dtype: f32 ≤ 5.0e-7, bf16 ≤ 6.3e-3 (the unfused backward's
#: too: the bf16 gradients' rounding), over 3 seeds, N ∈ {40, 47, 54}, causal and not, B = 2, H = 2, D = 16
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 1.5e-2}


def reference(q, k, v, causal: bool):
    """Attention on ``[N, D]`` in f32, written out: softmax(q kᵀ / √D) v, future keys hidden where causal."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = q @ k.T / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[0]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None], s, -jnp.inf)
    return jax.nn.softmax(s, axis=-1) @ v


def gradients(f, q, k, v, do):
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * do.astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)


def worst(got, want) -> float:
    pairs = zip(got, want, strict=True)
    return max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b))) for a, b in pairs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fused_gradients_xla(dtype, causal):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    n = 33 + seed % 31  # ragged: no multiple of the 16-row blocks, whatever the seed
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v, do = (jax.random.normal(k_, (n, 16)).astype(dtype) for k_ in keys)
    qa, xa, da = nc.axes("q x d")
    att = nc.library.attention(qa, xa, da, causal=causal, dtype="bf16" if dtype == jnp.bfloat16 else "f32")
    flash = derive(att, tile(qa, 16), stream(xa, 16), verify=False)
    kernel = lower(flash, backend="xla", backward="fused")
    assert [r for r in kernel.backends if "summed=True" in r]  # dQ in the dK·dV kernel
    want = gradients(lambda *a: reference(*a, causal), q, k, v, do)
    assert worst(gradients(kernel, q, k, v, do), want) <= TOLERANCE[dtype]


def test_fused_kernel_is_one_kernel_with_dq_summed():
    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d, causal=True), tile(q, 16), stream(x, 16), verify=False).diagram
    delta, fused = backward_of(flash, fused_dq=True).pieces
    assert delta.feeds and fused.outputs == (1, 2, 0) and fused.sums == ((), (), ())
    p = plan(fused.scheduled)
    assert p.tiles == {"x": 16} and p.stream == ("q", 16) and p.summed == {2: ("x",)}
    assert p.written == (2,) and str(p.diagram.cod.inside[2].dtype) == "f32"


def test_summed_tile_verified_and_refused():
    n, k, c = nc.axes("n k c")
    split = derive(nc.library.matmul(n, k, c), tile(k, 4, summed=True), seed=0)
    assert split.steps[-1].verification.passed
    a, b = jax.random.normal(jax.random.key(1), (6, 10)), jax.random.normal(jax.random.key(2), (10, 3))
    assert jnp.allclose(execute(split.diagram)(a, b), a @ b, atol=1e-5)
    with pytest.raises(RewriteError) as e:
        tile(k, 4)(nc.library.matmul(n, k, c))
    assert "the box removes k" in str(e.value)
    q, x, d = nc.axes("q x d")
    with pytest.raises(
        RewriteError,
        match=r"tile\(d, 16, summed=True\): axis 'd': box 'q d, x d → q x': the sum over d "
        r"is read by the box 'softmax x', not an output",
    ):
        tile(d, 16, summed=True)(nc.library.attention(q, x, d))
    assert summed_outputs(nc.library.matmul(n, k, c), "n") == ((), None)


def test_fused_needs_one_tiled_and_one_streamed_axis():
    n, k, c = nc.axes("n k c")
    mm = derive(nc.library.matmul(n, k, c), tile(n, 16), tile(c, 16), verify=False).diagram
    with pytest.raises(NotLowerable, match="fused_dq: the forward tiles \\['c', 'n'\\] and streams \\[\\]"):
        backward_of(mm, fused_dq=True)


def bf16_flash(causal=True):
    b, h, q, x, d = nc.axes("b h q x d", d=64)
    att = nc.library.multi_head_attention(h, q, x, d, batch=(b,), dtype="bf16", causal=causal)
    return derive(att, tile(q, 128), stream(x, 64), verify=False).diagram


@pytest.mark.parametrize("backend", ["mosaic", "triton"])
def test_pallas_backends_refuse_the_fused_kernel_by_name(backend):
    kernel = lower(bf16_flash(), backend=backend, interpret=True, backward="fused")
    why = "is summed over the tiled axis 'x', each program's partial sums added into it (backward='fused'"
    if kernel.why_not is not None:
        assert why in kernel.why_not
    else:  # the backward's kernels built when first asked for
        with pytest.raises(NotLowerable, match=r"is summed over the tiled axis 'x'"):
            kernel.backends  # noqa: B018
    fused = backward_of(bf16_flash(), fused_dq=True).pieces[-1]
    with pytest.raises(NotLowerable, match="Mosaic backend: output 2 .* is summed over the tiled axis 'x'"):
        MosaicLowered(plan(fused.scheduled), interpret=False)


def test_lower_names_the_backward_modes():
    with pytest.raises(NotLowerable, match="backward 'fast': choose 'lowered', 'fused' or 'reference'"):
        lower(bf16_flash(), backward="fast")
