"""NCD's diagram ↔ code correspondence, checked: each architecture's ``to_jax`` against hand-written JAX/lax."""

from functools import cache, partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat import architectures as arch
from napkin_cat.convolution import concat, conv, rename

TOL = {nc.f32: 2e-5, nc.bf16: 2e-2}
FEW = settings(max_examples=5, deadline=None)


def rand(key, d: nc.Diagram, sizes: dict, dtype=nc.f32) -> list:
    """Random inputs for every input wire of ``d``, with the axis sizes bound by ``sizes``.

    numpy draws them (seeded by ``key``): ``jax.random`` would compile anew for every shape.
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    shapes = [tuple(int(a.size.subs(sizes)) for a in w.axes) for w in d.dom.inside]
    return [jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype.jnp) for s in shapes]


def hand_written(f, n_ins: int, batched=False, **static):
    """A hand-written implementation; ``batched`` maps it over the data's leading axis only."""
    g = partial(f, **static)
    return jax.vmap(g, (0, *(None,) * (n_ins - 1))) if batched else g


def ref(f, *ins, batched=False, **static):
    """A hand-written implementation, jitted."""
    return jax.jit(hand_written(f, len(ins), batched, **static))(*ins)


def run_and_ref(d: nc.Diagram, f, *ins, batched=False, **static):
    """The diagram's reference semantics and a hand-written implementation, as one jitted program: one
    compilation per shape beats op-by-op dispatch, and one beats two."""
    g = hand_written(f, len(ins), batched, **static)
    return jax.jit(lambda *a: (nc.to_jax(d)(*a), g(*a)))(*ins)


def close(a, b, dtype=nc.f32, scale=1.0):
    tol = TOL[dtype] * scale
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), atol=tol, rtol=tol)


def bind(axes, *values) -> dict:
    return {a.size: v for a, v in zip(axes, values, strict=True)}


# --- hand-written references (channels first, as torch / lax defaults) --------------------------------


def conv_ref(X, W, b, stride=1, padding="SAME"):
    """``X[c, *xs]`` (no batch) with ``W[o, c, *ks]`` and bias ``b[o]``."""
    n = W.ndim - 2
    pad = padding if isinstance(padding, str) else [(padding, padding)] * n
    Y = jax.lax.conv_general_dilated(X[None], W, (stride,) * n, pad)[0]
    return Y + b.reshape(-1, *(1,) * n)


def layer_norm_ref(X, g, b):
    mu, var = X.mean(-1, keepdims=True), X.var(-1, keepdims=True)
    return (X - mu) / jnp.sqrt(var + 1e-5) * g + b


def self_attention_ref(X, Wq, Wk, Wv, Wo, causal=False):
    Q, K, V = (jnp.einsum("nd,dhk->nhk", X, W)[None] for W in (Wq, Wk, Wv))  # jax.nn: [batch, n, heads, k]
    A = jax.nn.dot_product_attention(Q, K, V, is_causal=causal)[0]
    return jnp.einsum("nhk,hkd->nd", A, Wo)


def transformer_ref(X, g1, b1, Wq, Wk, Wv, Wo, g2, b2, W1, c1, W2, c2, causal=False):
    Y = X + self_attention_ref(layer_norm_ref(X, g1, b1), Wq, Wk, Wv, Wo, causal)
    return Y + jax.nn.gelu(layer_norm_ref(Y, g2, b2) @ W1 + c1, approximate=False) @ W2 + c2


def resnet_ref(X, W1, b1, W2, b2):
    return jax.nn.relu(X + conv_ref(jax.nn.relu(conv_ref(X, W1, b1)), W2, b2))


def unet_ref(X, *weights, depth):
    """The U-Net of Ronneberger et al. with 'same' convolutions, written recursively."""
    it = iter(weights)

    def double(Z):
        for _ in range(2):
            Z = jax.nn.relu(conv_ref(Z, next(it), next(it)))
        return Z

    skips = []
    for level in range(depth + 1):
        X = double(X)
        if level < depth:
            skips.append(X)
            X = jax.lax.reduce_window(X, -jnp.inf, jax.lax.max, (1, 2, 2), (1, 2, 2), "VALID")
    for skip in reversed(skips):
        U, c = next(it), next(it)
        up = jax.lax.conv_transpose(X[None], U, (2, 2), "VALID", dimension_numbers=("NCHW", "OIHW", "NCHW"),
                                    transpose_kernel=True)[0] + c[:, None, None]
        X = double(jnp.concatenate([skip, up], axis=0))
    H, h = next(it), next(it)
    return jnp.einsum("wxy,wo->oxy", X, H) + h[:, None, None]


def patch_embedding_ref(X, W, b, cls, pos, patch):
    """ViT's patch embedding as a convolution with kernel = stride = patch (Dosovitskiy et al.)."""
    P = jax.lax.conv_general_dilated(X[None], jnp.transpose(W, (3, 0, 1, 2)), (patch, patch), "VALID")[0]
    E = P.reshape(P.shape[0], -1).T + b
    return jnp.concatenate([cls, E]) + pos


# --- the correspondence, over random sizes ---------------------------------------------------------------


@cache
def build(name: str, *args, **kw) -> nc.Diagram:
    """Diagrams are symbolic in their sizes: build each once, evaluate at many sizes."""
    return getattr(arch, name)(*args, **kw)


@FEW
@given(n=st.integers(1, 5), d=st.sampled_from([4, 8]), h=st.integers(1, 3), k=st.integers(1, 4),
       f=st.integers(1, 6), causal=st.booleans(), batch=st.integers(0, 2))
def test_transformer_block(n, d, h, k, f, causal, batch):
    b, *axes = nc.axes("b n d h k f")
    block = build("transformer_block", *axes, causal=causal, batch=(b,) if batch else ())
    ins = rand(jax.random.key(n * 97 + d), block, bind((b, *axes), batch or 1, n, d, h, k, f))
    close(*run_and_ref(block, transformer_ref, *ins, batched=bool(batch), causal=causal), scale=10)


def test_self_attention_jits_to_one_jaxpr(key):
    n, d, h, k = nc.axes("n d h k")
    sa = arch.self_attention(n, d, h, k, causal=True)
    ins = rand(key, sa, bind((n, d, h, k), 5, 8, 2, 4))
    f = nc.to_jax(sa)
    assert not any(e.primitive.name in ("pjit", "closed_call") for e in jax.make_jaxpr(f)(*ins).eqns)
    close(jax.jit(f)(*ins), ref(self_attention_ref, *ins, causal=True), scale=10)


@FEW
@given(x=st.integers(3, 12), k=st.integers(1, 3), stride=st.integers(1, 3), pad=st.integers(0, 2),
       batch=st.integers(0, 2))
def test_conv1d(x, k, stride, pad, batch):
    b, i, o, xa = nc.axes("b i o x")
    layer = build("conv1d", i, o, xa, nc.Axis("k", k), stride=stride, padding=pad, batch=(b,) if batch else ())
    X, W, bias = rand(jax.random.key(x * 31 + k), layer, bind((b, i, o, xa), batch or 1, 3, 2, x))
    close(*run_and_ref(layer, conv_ref, X, W, bias, batched=bool(batch), stride=stride, padding=pad), scale=10)


@FEW
@given(x=st.integers(3, 8), y=st.integers(3, 8), k=st.sampled_from([1, 3]), stride=st.integers(1, 2),
       pad=st.integers(0, 1))
def test_conv2d(x, y, k, stride, pad):
    i, o, xa, ya = nc.axes("i o x y")
    layer = arch.conv2d(i, o, (xa, ya), (nc.Axis("kx", k), nc.Axis("ky", k)), stride=stride, padding=pad)
    ins = rand(jax.random.key(x * 7 + y), layer, bind((i, o, xa, ya), 2, 3, x, y))
    close(*run_and_ref(layer, conv_ref, *ins, stride=stride, padding=pad), scale=10)


def test_conv_generator_weaves_and_casts(key):
    """Axes the weight shares with the input are woven (vmap); bf16 inputs accumulate in f32."""
    g, i, o, x, kx = nc.axes("g i o x kx", kx=3)
    c = conv(nc.Array(i, x, dtype=nc.bf16), nc.Array(o, i, kx, dtype=nc.bf16), padding=((1, 2),)).weave(g)
    X, W = rand(key, c, bind((g, i, o, x), 2, 3, 4, 6), nc.bf16)
    ref = jax.vmap(lambda X, W: jax.lax.conv_general_dilated(X[None], W, (1,), [(1, 2)],
                                                            preferred_element_type=jnp.float32)[0])(X, W)
    out = nc.to_jax(c)(X, W)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 4, 7)
    close(out, ref, nc.bf16)
    assert c.boxes[0].flops() == 2 * g.size * o.size * i.size * 3 * (x.size + 1)


@FEW
@given(c=st.integers(1, 3), x=st.integers(2, 6), y=st.integers(2, 6), batch=st.booleans())
def test_resnet_block(c, x, y, batch):
    b, ca, xa, ya = nc.axes("b c x y")
    block = build("resnet_block", ca, (xa, ya), (nc.Axis("kx", 3), nc.Axis("ky", 3)), batch=(b,) if batch else ())
    ins = rand(jax.random.key(c * 13 + x), block, bind((b, ca, xa, ya), 2, c, x, y))
    close(*run_and_ref(block, resnet_ref, *ins, batched=batch), scale=10)


@settings(max_examples=3, deadline=None)
@given(depth=st.integers(1, 2), w=st.integers(1, 3), x=st.integers(1, 2), y=st.integers(1, 2))
def test_unet(depth, w, x, y):
    i, wa, o, xa, ya = nc.axes("i w o x y")
    net = build("unet", i, wa, o, (xa, ya), depth=depth)
    ins = rand(jax.random.key(depth * 5 + w), net, bind((i, wa, o, xa, ya), 2, w, 3, x * 2**depth, y * 2**depth))
    close(*run_and_ref(net, unet_ref, *ins, depth=depth), scale=50)


def test_unet_batched(key):
    b, i, w, o, x, y = nc.axes("b i w o x y")
    net = arch.unet(i, w, o, (x, y), batch=(b,))
    ins = rand(key, net, bind((b, i, w, o, x, y), 2, 1, 2, 2, 4, 6))
    close(*run_and_ref(net, unet_ref, *ins, batched=True, depth=1), scale=50)


@FEW
@given(patch=st.sampled_from([1, 2, 3]), px=st.integers(1, 3), py=st.integers(1, 3), batch=st.booleans())
def test_patch_embedding(patch, px, py, batch):
    b, c, x, y, d = nc.axes("b c x y d")
    pe = build("patch_embedding", c, (x, y), d, patch=patch, batch=(b,) if batch else ())
    ins = rand(jax.random.key(patch * 11 + px), pe, bind((b, c, x, y, d), 2, 3, px * patch, py * patch, 4))
    close(*run_and_ref(pe, patch_embedding_ref, *ins, batched=batch, patch=patch), scale=10)


def test_vision_transformer(key):
    b, c, x, y, d, h, k, f = nc.axes("b c x y d h k f")
    vit = arch.vision_transformer(c, (x, y), d, h, k, f, patch=2, layers=2, batch=(b,))
    ins = rand(key, vit, bind((b, c, x, y, d, h, k, f), 2, 3, 4, 6, 8, 2, 4, 16))

    def vit_ref(X, W, bias, cls, pos, *blocks):
        Z = patch_embedding_ref(X, W, bias, cls, pos, 2)
        return transformer_ref(transformer_ref(Z, *blocks[:12]), *blocks[12:])

    close(*run_and_ref(vit, vit_ref, *ins, batched=True), scale=20)


def test_weave_shares_weights_and_shifts_merges(key):
    """``weave`` keeps the weights unwoven; a merge (indexed by position) still merges the right axes."""
    b, x1, u, n = nc.axes("b x1 u n")
    x = nc.Axis("x", x1.size * u.size)
    m = nc.merge(nc.Array(x1, u), x1, u, into=x)
    d = arch.weave((m @ nc.id(nc.Array(x))) >> nc.add(nc.Array(x), nc.Array(x)), b, shared=[1])
    assert [str(w) for w in d.dom.inside] == ["b×x1×u", "x"]
    A, B = rand(key, d, bind((b, x1, u), 2, 3, 4))
    close(nc.to_jax(d)(A, B), A.reshape(2, 12) + B)


def test_concat_and_rename(key):
    n, d, b = nc.axes("n d b")
    one, m = nc.Axis("one", 1), nc.Axis("m", n.size + 1)
    cat = arch.weave(concat(nc.Array(one, d), nc.Array(n, d), one, n, into=m), b, shared=[0])
    C, X = rand(key, cat, bind((n, d, b), 3, 4, 2))
    close(nc.to_jax(cat)(C, X), jnp.concatenate([jnp.broadcast_to(C, (2, 1, 4)), X], axis=1))
    (X,) = rand(key, rename(nc.Array(n, d), n, nc.Axis("t", n.size)), {n.size: 3, d.size: 4})
    close(nc.to_jax(rename(nc.Array(n, d), n, nc.Axis("t", n.size)))(X), X)


# --- bad input: typed errors that name the wires -------------------------------------------------------


def test_kernel_larger_than_input_at_build():
    i, o, x = nc.axes("i o x", x=4)
    with pytest.raises(nc.AxisError, match=r"kernel axis 'k' \(size 5\) of W o×i×k.*input axis 'x' \(size 4\) of X"):
        arch.conv1d(i, o, x, nc.Axis("k", 5), padding=0)
    arch.conv1d(i, o, x, nc.Axis("k", 5), padding=1)  # fits once padded


def test_kernel_larger_than_input_at_evaluation(key):
    i, o, x = nc.axes("i o x")
    layer = arch.conv2d(i, o, (x, nc.Axis("y", 8)), (nc.Axis("kx", 5), nc.Axis("ky", 3)))
    ins = rand(key, layer, {i.size: 2, o.size: 2, x.size: 3})
    with pytest.raises(nc.AxisError, match=r"kernel axis 'kx' \(size 5\) of W o×i×kx×ky.*axis 'x' \(size 3\)"):
        nc.to_jax(layer)(*ins)


def test_mismatched_channels():
    i, j, o, x = nc.axes("i j o x")
    with pytest.raises(nc.AxisError, match="input channels of X j×x:f32@HBM are 'j', but W o×i×k"):
        conv(nc.Array(j, x), nc.Array(o, i, nc.Axis("k", 3)))


def test_mismatched_widths_between_blocks():
    n, d, e, h, k, f, c, x, y = nc.axes("n d e h k f c x y")
    with pytest.raises(nc.CompositionError, match="block 1 reads n×e:f32@HBM, but block 0 gives n×d:f32@HBM"):
        arch.chain(arch.transformer_block(n, d, h, k, f), arch.transformer_block(n, e, h, k, f))
    ks = (nc.Axis("kx", 3), nc.Axis("ky", 3))
    with pytest.raises(nc.CompositionError, match="reads c×x×y:f32@HBM, but block 0 gives f×x×y:f32@HBM"):
        arch.chain(arch.conv2d(e, f, (x, y), ks, padding=1), arch.resnet_block(c, (x, y), ks))
    with pytest.raises(nc.CompositionError, match=r"cannot compose: wire 0: f×x×y:f32@HBM → c×x×y:f32@HBM"):
        arch.conv2d(e, f, (x, y), ks, padding=1) >> nc.relu(nc.Array(c, x, y))


def test_circuit_names_the_wire():
    n, d, e = nc.axes("n d e")
    c = arch.Circuit(X=nc.Array(n, d))
    with pytest.raises(nc.CompositionError, match="expects n×e:f32@HBM, but wire 'X' is n×d:f32@HBM"):
        c.let("Y", nc.relu(nc.Array(n, e)), "X")
    with pytest.raises(nc.CompositionError, match="wire 'Z', which is not bound"):
        c.let("Y", nc.relu(nc.Array(n, d)), "Z")


def test_bad_sizes():
    i, w, o, y, n, d = nc.axes("i w o y n d")
    with pytest.raises(nc.AxisError, match="axis 'x' of size 6 is not divisible by 2\\^depth = 4"):
        arch.unet(i, w, o, (nc.Axis("x", 6), y), depth=2)
    with pytest.raises(nc.AxisError, match="padding 'same' needs stride 1"):
        arch.conv1d(i, o, y, nc.Axis("k", 3), padding="same", stride=2)
    with pytest.raises(nc.AxisError, match="'one' \\+ 'n' of one×d.*has size n \\+ 1, but 'n' has size n"):
        concat(nc.Array(nc.Axis("one", 1), d), nc.Array(n, d), "one", n, into=n)
