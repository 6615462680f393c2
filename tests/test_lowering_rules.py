"""The rewrites a kernel's lowering makes, as rules (``rewrites._lowering_rules``): each verified per generator by
the commuting square ``to_jax ∘ rule = to_jax`` on random inputs, and the padding rule's side condition, which
evaluates each box on its padding (the NaN of the signed normalised contraction at a ragged stream)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from lowering import NotLowerable, lower, plan
from lowering._backward import backward_of
from napkin_cat.generators import Context
from napkin_cat.semantics import bind, run
from rewrites import (
    RewriteError,
    Trial,
    base2,
    derive,
    fuse_softmax,
    pad_neutral,
    relative_error,
    stream,
    tile,
    tiled_first,
    tolerance,
)

q, x, d = nc.axes("q x d")
S, V, OUT = nc.Array(q, x), nc.Array(x, d), nc.Array(q, d)


def plus_one(z):
    return z + 1.0


def identity(s):
    return s


#: the signed member of the spherical-attention family: a₁ = id, a₂ = |·|, b = z + 1 (−∞ padding gives −∞·0, |−∞|)
SIGNED = nc.normalised_contract(S, V, x, OUT, a1=identity, a2=jnp.abs, b=plus_one)
#: a₁ = id with a₂ = exp: no padding value v has a₂(v) = 0 with a₁(v) finite
UNPADDABLE = nc.normalised_contract(S, V, x, OUT, a1=identity, a2=jnp.exp, b=plus_one)


def signed_reference(s, v):
    """O = (S·V) / (Σₓ |S| + 1), written with jax.numpy."""
    return (s @ v) / (jnp.sum(jnp.abs(s), axis=1, keepdims=True) + 1.0)


def normals(seed, *shapes):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes]


def test_signed_normalised_contraction_at_a_ragged_stream_is_finite_and_right(seed):
    """The regression: at x = 100 with chunks of 16 the last chunk is padded; −∞ scores through a₁ = id and
    a₂ = |·| gave NaN. The side condition now pads the scores with 0 (a₁(0) = a₂(0) = 0)."""
    flash = derive(SIGNED, tile(q, 32), stream(x, 16), sizes={"q": 40, "x": 100, "d": 16}, seed=seed, verify="kernel")
    assert flash.kernel.passed
    s, v = normals(seed, (40, 100), (100, 16))
    got = lower(flash)(s, v)
    assert relative_error(got, signed_reference(s, v)) <= 1e-5  # f32: measured 3–4e-7


def test_signed_normalised_contraction_padded_where_kept_whole(seed):
    """The same box with x kept whole (x = 40 padded to 64): the padding rule on the kernel's diagram."""
    s, v = normals(seed, (40, 40), (40, 16))
    kernel = lower(derive(SIGNED, tile(q, 16), verify=False))
    assert relative_error(kernel(s, v), signed_reference(s, v)) <= 1e-5  # f32: measured 2–4e-7


def test_no_neutral_padding_is_refused_naming_box_function_value_and_fix(seed):
    kernel = lower(derive(UNPADDABLE, tile(q, 16), stream(x, 16), verify=False))
    s, v = normals(seed, (16, 40), (40, 16))
    with pytest.raises(NotLowerable) as caught:
        kernel(s, v)
    message = str(caught.value)
    for part in ("axis 'x' of size 40", "pad_neutral(x, 40)", "box 'normalised·contract x'", "a1 = identity gives",
                 "a1(-inf) = -inf", "a2 = exp", "choose sizes that x's blocks divide"):
        assert part in message, message
    s, v = normals(seed, (16, 48), (48, 16))  # x a multiple of the chunk: nothing padded, nothing refused
    want = (s @ v) / (jnp.sum(jnp.exp(s), axis=1, keepdims=True) + 1.0)
    assert relative_error(kernel(s, v), want) <= 1e-5


def padded_square(diagram, axis: str, n: int, pad_to: int, seed: int) -> float:
    """``to_jax(pad_neutral(axis, n)(diagram))`` on inputs padded to ``pad_to`` with random values, its outputs cut
    to ``n``, against ``to_jax(diagram)`` on the unpadded inputs: the relative error."""
    size = {"q": 5, "x": 7, "d": 3, "n": 6}
    shapes = [tuple(n if a.name == axis else size[a.name] for a in w.axes) for w in diagram.dom.inside]
    xs = normals(seed, *shapes)
    junk = normals(seed + 1, *[tuple(pad_to - n if a.name == axis else k for a, k in zip(w.axes, s, strict=True))
                               for w, s in zip(diagram.dom.inside, shapes, strict=True)])
    padded = [jnp.concatenate([v, j], axis=w.names.index(axis)) if w.has(axis) else v
              for v, j, w in zip(xs, junk, diagram.dom.inside, strict=True)]
    want = nc.to_jax(diagram)(*xs)
    # the sizes bound to the true extent, the arrays padded: as a kernel evaluates its blocks
    got = run(pad_neutral(axis, n)(diagram), padded, Context(sizes=bind(diagram.dom, xs)))
    want = want if isinstance(want, tuple) else (want,)
    cut = [g[tuple(slice(0, n) if a.name == axis else slice(None) for a in w.axes)]
           for g, w in zip(got, diagram.cod.inside, strict=True)]
    return max(relative_error(c, w) for c, w in zip(cut, want, strict=True))


PADDED = {
    "sum (rms_norm)": lambda: (nc.library.rms_norm(q, d), "d"),
    "max": lambda: (nc.reduce_max(S, x), "x"),
    "softmax": lambda: (nc.library.softmax(q, x), "x"),
    "contraction (attention)": lambda: (nc.library.attention(q, x, d), "x"),
    "online softmax (fused attention)": lambda: (fuse_softmax(x)(nc.library.attention(q, x, d)), "x"),
    "normalised contraction exp/exp/sqrt": lambda: (
        nc.normalised_contract(S, V, x, OUT, a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt), "x"),
    "normalised contraction signed": lambda: (SIGNED, "x"),
}


@pytest.mark.parametrize("name", list(PADDED))
def test_pad_neutral_commutes_with_the_reference(name, seed):
    diagram, axis = PADDED[name]()
    assert padded_square(diagram, axis, 7, 11, seed) <= tolerance(diagram)  # f32: measured ≤ 3e-7


def test_pad_neutral_refuses_a_box_with_no_neutral_value():
    with pytest.raises(RewriteError, match=r"pad_neutral\(x, 7\): box 'normalised·contract x', axis 'x': .*a2 = exp"):
        pad_neutral("x", 7)(UNPADDABLE)


SQUARES = {
    "fuse_softmax: attention": lambda: (nc.library.attention(q, x, d), fuse_softmax(x)),
    "fuse_softmax: scaled softmax": lambda: (
        (nc.softmax(S, x) >> nc.scale(S, 2)) @ V >> nc.contract("q x, x d -> q d", q, x, d), fuse_softmax(x)),
    "base2: attention f32": lambda: (nc.library.attention(q, x, d, causal=True), base2()),
    "base2: attention bf16": lambda: (nc.library.attention(q, x, d, causal=True, dtype="bf16"), base2()),
    "base2: soft-capped bf16": lambda: (nc.library.softcap_attention(q, x, d, cap=30, dtype="bf16"), base2()),
    "tiled_first: attention, x tiled, q streamed": lambda: (
        nc.library.attention(q, x, d), tiled_first("q", ("x",), inputs=True)),
}


@pytest.mark.parametrize("name", list(SQUARES))
def test_rule_commutes_with_the_reference(name, seed):
    diagram, rule = SQUARES[name]()
    before = fuse_softmax(x)(diagram) if isinstance(rule, base2) else diagram  # base2 rewrites the fused box
    after = rule(before)
    assert after != before  # the rule rewrote something
    Trial.draw(diagram, after, seed=seed, sizes={"q": 6, "x": 9, "d": 4}).check(after, repr(rule))


def test_tiled_first_commutes_on_the_dk_dv_kernel(seed):
    """The layout the dK, dV kernel takes (Sᵀ = K·Qᵀ): its diagram before and after, on the same inputs."""
    scheduled = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram
    piece = backward_of(scheduled).pieces[-1].scheduled
    p = plan(piece)
    after = tiled_first(p.stream[0], tuple(p.tiles), inputs=True)(piece)
    assert {str(w) for b in after.boxes for w in b.cod.inside if w.has("q") and w.has("x")} == {"x/16×q~16"}
    sizes = {"q": 20, "x": 24, "d": 4}
    xs = Trial.draw(piece, piece, seed=seed, sizes=sizes).inputs
    want, got = nc.to_jax(piece)(*xs), nc.to_jax(after)(*xs)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert relative_error(g, w) <= 1e-6  # f32: the same products in another order, measured 7e-8


def test_a_kernel_lists_the_rules_it_applies():
    kernel = lower(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False))
    assert kernel.forward.steps == (base2(), tiled_first("x", ("q",), inputs=True))


def test_stream_is_fuse_softmax_then_the_relabelling():
    attn = nc.library.attention(q, x, d)
    assert stream(x, 8)(attn) == stream(x, 8)(fuse_softmax(x)(attn))
    with pytest.raises(RewriteError, match=r"fuse_softmax\(n\): axis 'n': no wire has axis n"):
        fuse_softmax("n")(attn)
