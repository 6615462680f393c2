"""RoPE as a prologue of attention: the rotary generator against the complex-number formulation written here, its
commuting square with ``tile``/``stream``, and ``nc.attention(..., rope=...)`` forward and gradients against jnp RoPE
followed by ``jax.nn.dot_product_attention``, on the backends that run on CPU (Triton interpret, XLA)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from lowering import NotLowerable, lower
from napkin_cat.diagram import id as identity
from napkin_cat.errors import AxisError, EvaluationError
from rewrites import derive, stream, tile

# f32, measured on CPU: the generator 2.4e-7 against the complex form (positions < 1000: 1.3e-5); attention's output
# 7e-7 .. 1.14e-5 (rotated in the kernel or before it alike: positions up to 1000 turn by angles whose f32 rounding
# is ~6e-5; 1.14e-5 at seed 1860841658 of the packed-positions case, on the session's start commit too, against
# 1.1e-6 .. 2.3e-6 over 16 other seeds), its gradients 2e-6 .. 1.8e-5 (dq 5.2e-5 at that seed)
F32 = 2e-5
GRAD = 1e-4


def rope_reference(x, pos, base=10000.0, rotary_dim=None, interleaved=False):
    """RoPE as complex numbers: pairs ``a + ib`` multiplied by ``e^{i·pos·base^(−2k/rd)}``; ``x [..., N, H, D]``,
    ``pos [..., N]``."""
    D = x.shape[-1]
    rd = rotary_dim or D
    xr, rest = x[..., :rd].astype(jnp.float32), x[..., rd:]
    if interleaved:
        z = xr[..., 0::2] + 1j * xr[..., 1::2]
    else:
        z = xr[..., : rd // 2] + 1j * xr[..., rd // 2 :]
    theta = pos[..., None].astype(jnp.float32) * base ** (-np.arange(rd // 2) * 2.0 / rd)
    w = z * jnp.exp(1j * theta)[..., None, :]
    if interleaved:
        turned = jnp.stack([w.real, w.imag], -1).reshape(*x.shape[:-1], rd)
    else:
        turned = jnp.concatenate([w.real, w.imag], -1)
    return jnp.concatenate([turned.astype(x.dtype), rest], -1)


@settings(max_examples=4, deadline=None)
@given(
    n=st.sampled_from([1, 7, 24]),
    half=st.sampled_from([1, 4, 8]),
    cut=st.sampled_from([0, 2]),
    interleaved=st.booleans(),
    offset=st.integers(0, 50),
    base=st.sampled_from([100.0, 10000.0, 500000.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_the_generator_is_the_complex_rotation(n, half, cut, interleaved, offset, base, seed):
    D = 2 * half + 2 * cut  # partial rotary dims pass ``2·cut`` entries through
    s, d = nc.axes("s d", d=D)
    box = nc.rotary(nc.Array(s, d), s, d, base=base, rotary_dim=2 * half, interleaved=interleaved, offset=offset)
    x = jax.random.normal(jax.random.key(seed), (n, 1, D))
    want = rope_reference(x, jnp.arange(n) + offset, base, 2 * half, interleaved)[:, 0]
    assert float(jnp.abs(nc.to_jax(box)(x[:, 0]) - want).max()) <= F32 * (1 + offset + n) ** 0.5


def test_positions_input_and_backward_is_the_inverse(key):
    b, s, d = nc.axes("b s d", d=8)
    pos = jax.random.randint(key, (2, 5), 0, 100)
    box = nc.rotary(nc.Array(b, s, d), s, d, positions=nc.Array(b, s, dtype="i32"))
    x = jax.random.normal(jax.random.fold_in(key, 1), (2, 5, 8))
    y = nc.to_jax(box)(x, pos)
    assert float(jnp.abs(y - rope_reference(x[:, :, None], pos)[:, :, 0]).max()) <= F32
    # a rotation is orthogonal: its derivative rule is the rotation by −θ, which undoes it
    back = nc.reverse(box)
    assert [b.name for b in back.boxes if isinstance(b, nc.generators.Rotary)] == ["rope⁻¹ s"]
    dx = nc.to_jax(back)(x, pos, y)
    assert float(jnp.abs((dx[0] if isinstance(dx, (tuple, list)) else dx) - x).max()) <= 1e-5


def test_rotary_commutes_with_tile_and_stream(key):
    """The rewrites verify every step on random inputs: the rotations of Q (tiled) and K (streamed) included."""
    q, x, d = nc.axes("q x d", d=16)
    attn = nc.library.attention(q, x, d, causal=True)
    Q, K, V = attn.dom.inside
    roped = (nc.rotary(Q, q, d) @ nc.rotary(K, x, d, interleaved=True, rotary_dim=8) @ identity(V)) >> attn
    flash = derive(roped, tile(q, 16), stream(x, 16), verify=True)
    checked = [step.verification for step in flash.steps[1:] if step.verification is not None]
    assert checked and all(v.passed for v in checked)
    args = [jax.random.normal(k, (40, 16)) for k in jax.random.split(key, 3)]
    assert float(jnp.abs(lower(flash, "xla")(*args) - nc.to_jax(roped)(*args)).max()) <= F32


def attention_reference(q, k, v, pos_q, pos_k, rope, causal):
    kw = dict(base=rope.base, rotary_dim=rope.rotary_dim, interleaved=rope.interleaved)
    return jax.nn.dot_product_attention(
        rope_reference(q, pos_q, **kw), rope_reference(k, pos_k, **kw), v, is_causal=causal
    )


CASES = {  # fused: q and k rotated inside the kernels; else by XLA before them
    "triton-causal": ("triton", True, 1, nc.Rope(fused=True), False),
    "triton-gqa-partial-positions": (
        "triton",
        False,
        2,
        nc.Rope(base=500.0, rotary_dim=8, interleaved=True, fused=True),
        True,
    ),
    "xla-causal-gqa-offset": ("xla", True, 2, nc.Rope(rotary_dim=12, offset=7, fused=True), False),
    "before-the-kernel-gqa-positions": ("triton", True, 2, nc.Rope(rotary_dim=8, interleaved=True), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_with_rope_matches_jax_nn(key, case):
    backend, causal, group, rope, packed = CASES[case]
    B, N, H, D = 1, 24, 2 * group, 16
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, N, H, D))
    k, v = (jax.random.normal(kk, (B, N, H // group, D)) for kk in ks[1:3])
    pos = jnp.broadcast_to(jnp.arange(N) + rope.offset, (B, N))
    pos = jax.random.randint(ks[3], (B, N), 0, 1000) if packed else pos
    if packed:
        rope = nc.Rope(rope.base, rope.rotary_dim, rope.interleaved, positions=pos, fused=rope.fused)

    def ours(q, k, v):
        return nc.attention(q, k, v, is_causal=causal, rope=rope, backend=backend)

    def theirs(q, k, v):
        return attention_reference(q, k, v, pos, pos, rope, causal)

    loss = lambda f: lambda *a: (f(*a) ** 2).sum()  # noqa: E731
    # the reference and its gradients as one program (run eagerly, it compiles op by op)
    out, want = jax.jit(lambda *a: (theirs(*a), jax.grad(loss(theirs), (0, 1, 2))(*a)))(q, k, v)
    assert float(jnp.abs(ours(q, k, v) - out).max()) <= F32
    made = nc.attention.kernel_for(q, k, v, is_causal=causal, rope=rope, backend=backend)
    assert (made.backend, made.differentiation) == (backend, "lowered")
    assert (made.signature.rope is not None) == rope.fused  # unfused: the kernel sees q and k rotated
    got = jax.grad(loss(ours), (0, 1, 2))(q, k, v)
    for name, a, b in zip(("dq", "dk", "dv"), got, want, strict=True):
        assert float(jnp.abs(a - b).max()) <= GRAD, name


def test_bf16_and_a_pair_of_positions(key):
    """bf16 inputs, a pair of positions arrays (queries after a prefix of keys): within bf16's rounding."""
    ks = jax.random.split(key, 3)
    q, k, v = (jax.random.normal(kk, (1, 32, 2, 16), jnp.bfloat16) for kk in ks)
    pos_q, pos_k = jnp.arange(32)[None] + 32, jnp.arange(32)[None]
    rope = nc.Rope(positions=(pos_q, pos_k))
    out = nc.attention(q, k, v, rope=rope)
    want = jax.jit(lambda q, k, v: attention_reference(q, k, v, pos_q, pos_k, rope, False))(q, k, v)
    # measured 3.9e-3 (one bf16 rounding of the rotated q and k, and of the output)
    assert float(jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)).max()) <= 1.6e-2


def test_bad_rope_arguments_name_the_fix():
    x = jnp.zeros((1, 16, 2, 8))
    with pytest.raises(EvaluationError, match="rotary_dim = 16 must be at most q's and k's head dim 8"):
        nc.attention(x, x, x, rope=nc.Rope(rotary_dim=16))
    with pytest.raises(EvaluationError, match=r"positions for the query side are int32 \(1, 15\)"):
        nc.attention(x, x, x, rope=nc.Rope(positions=jnp.zeros((1, 15), jnp.int32)))
    with pytest.raises(NotLowerable, match="wgmma reads K from shared memory"):
        nc.attention(x, x, x, rope=nc.Rope(fused=True), backend="mosaic")
    with pytest.raises(EvaluationError, match="rotary_dim must be a positive even int"):
        nc.Rope(rotary_dim=3)
    s, d = nc.axes("s d", d=8)
    with pytest.raises(AxisError, match="positions .* must be integers"):
        nc.rotary(nc.Array(s, d), s, d, positions=nc.Array(s))
