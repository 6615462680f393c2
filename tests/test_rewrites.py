"""Verification strengths (a) and (b): commuting squares per generator, and property tests.

(a) For every generator kind, ``execute(rule(d)) == to_jax(d)`` on random inputs (functoriality then
gives it for every diagram built from them). (b) hypothesis over random diagrams, rules, sizes
(including tiles and streams that do not divide the axis) and dtypes: a rule either applies and the
square commutes, or it is refused with a :class:`RewriteError`. Fixed small sizes keep XLA's cache warm.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.diagram import Diagram, Ty
from rewrites import RewriteError, level, stream, tile
from rewrites._verify import check
from rewrites.testing import assert_equivalent, diagrams, rules, sizes

q, x, d, n, k = nc.axes("q x d n k")
S, V, Out, X = nc.Array(q, x), nc.Array(x, d), nc.Array(q, d), nc.Array(n, k)


def identity_fn(z):
    return z


SQUARES = {  # generator kind: (diagram, rules, sizes)
    "Contract": (nc.library.matmul(q, x, d), [tile(q, 2), stream(x, 3)], {"q": 5, "x": 7, "d": 3}),
    "Contract (scaled)": (nc.contract("q x, x d -> q d", q, x, d, scale=0.5), [stream(x, 3)], {"q": 2, "x": 7, "d": 3}),
    "Elementwise": (nc.elementwise("add", X, nc.Array(k)), [tile(n, 2)], {"n": 5, "k": 3}),
    "Reduce sum": (nc.reduce_sum(X, k), [tile(n, 2), stream(k, 3)], {"n": 5, "k": 7}),
    "Reduce max": (nc.reduce_max(X, k), [stream(k, 3)], {"n": 5, "k": 7}),
    "Reduce min": (nc.reduce_min(X, k), [stream(k, 3)], {"n": 5, "k": 7}),
    "Softmax": (nc.softmax(S, x), [tile(q, 2)], {"q": 5, "x": 7}),
    "SoftmaxContract": (nc.softmax_contract(S, V, x, Out), [tile(q, 2), stream(x, 3)], {"q": 5, "x": 7, "d": 3}),
    "NormalisedContract": (nc.normalised_contract(S, V, x, Out, a1=jnp.exp, a2=jnp.exp, b=identity_fn),
                           [stream(x, 3)], {"q": 5, "x": 7, "d": 3}),
    "Mask": (nc.library.attention(q, x, d, causal=True), [tile(q, 2), stream(x, 3)], {"q": 5, "x": 7, "d": 3}),
    "IndexMap": (nc.library.attention(q, x, d, score_mod=lambda s, q, x: s - 0.1 * abs(q - x)),
                 [tile(q, 2), stream(x, 3)], {"q": 5, "x": 7, "d": 3}),
    "Cast": (nc.cast(nc.Array(n, k, dtype=nc.bf16), nc.f32), [tile(n, 2)], {"n": 5, "k": 3}),
    "Move": (nc.library.attention(q, x, d), [tile(q, 2), stream(x, 3), level(nc.SMEM)], {"q": 5, "x": 7, "d": 3}),
}


@pytest.mark.parametrize("kind", sorted(SQUARES))
def test_commuting_square(kind):
    diagram, steps, at = SQUARES[kind]
    scheduled = diagram
    for rule in steps:
        scheduled = rule(scheduled)
    sym = {a.size: at[a.name] for w in diagram.dom.inside for a in w.axes if a.name in at and a.is_symbolic}
    assert check(diagram, scheduled, sizes=sym, seed=0).passed


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_diagrams_either_commute_or_are_refused(data):
    diagram = data.draw(diagrams(max_boxes=3))
    rule = data.draw(rules(diagram, max_size=3))
    try:
        scheduled = rule(diagram)
    except RewriteError as err:
        assert str(err).startswith(repr(rule))
        return
    assert check(diagram, scheduled, sizes=data.draw(sizes(scheduled, max_size=4)), seed=0).passed


@settings(max_examples=4, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.sampled_from([nc.f32, nc.bf16, nc.f16]))
def test_ragged_flash_attention_in_every_dtype(g, s, dtype):
    attn = nc.library.attention(q, x, d, dtype=dtype)
    flash = stream(x, s)(tile(q, g)(attn))
    assert check(attn, flash, sizes={q.size: 7, x.size: 7, d.size: 2}, seed=g * 7 + s).passed


def test_assert_equivalent_is_property_based():
    attn = nc.library.attention(q, x, d, causal=True)
    records = assert_equivalent(attn, stream(x, 2)(tile(q, 2)(attn)), examples=2, seed=3)
    assert len({tuple(r.sizes.items()) for r in records}) >= 1 and all(r.passed for r in records)


# --- bad input: each RewriteError names the rule, box, axis and condition ---------------------

ATTN = nc.library.attention(q, x, d)
SMALL = nc.library.softmax(*nc.axes("n x", n=4, x=4))
BAD = [
    (lambda: tile(d, 16)(ATTN),
     "tile(d, 16): box 'q d, x d → q x', axis 'd': the box removes d, so the diagram is not weaved over it"),
    (lambda: tile(x, 4)(ATTN),
     "tile(x, 4): box 'softmax x', axis 'x': the box combines elements along x, so the diagram is not weaved over it"),
    (lambda: tile(q, 0)(ATTN), "tile(q, 0): axis 'q': group size must be a positive integer, got 0"),
    (lambda: tile(q, -3)(ATTN), "tile(q, -3): axis 'q': group size must be a positive integer, got -3"),
    (lambda: stream(x, 0)(ATTN), "stream(x, 0): axis 'x': stream size must be a positive integer, got 0"),
    (lambda: tile("n", 8)(SMALL), "tile(n, 8): axis 'n': group size 8 exceeds the axis size 4"),
    (lambda: stream("x", 8)(SMALL), "stream(x, 8): axis 'x': stream size 8 exceeds the axis size 4"),
    (lambda: stream(x, 4)(nc.library.softmax(q, x)),
     "stream(x, 4): box 'softmax x', axis 'x': softmax over x is not followed by a contraction over x (its output "
     "leaves the diagram as output wire 0; only swaps and constant scales may come between), so its normaliser "
     "would be computed per chunk"),
    (lambda: tile(q, 2.5), "tile(q, 2.5): axis 'q': group size must be a positive integer, got 2.5"),
    (lambda: tile(q, "16"), "tile(q, 16): axis 'q': group size must be a positive integer, got '16'"),
    (lambda: tile(q, True), "tile(q, True): axis 'q': group size must be a positive integer, got True"),
    (lambda: tile(q, np.int64(-3)), "tile(q, -3): axis 'q': group size must be a positive integer, got -3"),
    (lambda: stream(x, 64.0), "stream(x, 64.0): axis 'x': stream size must be a positive integer, got 64.0"),
    (lambda: stream(x, -1), "stream(x, -1): axis 'x': stream size must be a positive integer, got -1"),
    (lambda: tile("k", 2)(nc.split(nc.Array(n, nc.Axis("k", 6)), "k", *nc.axes("k1 k2", k1=2, k2=3))),
     "tile(k, 2): box 'split k', axis 'k': a reshape splits or merges k"),
    (lambda: tile("z", 4)(ATTN), "tile(z, 4): axis 'z': no wire has axis z; axes here: d, q, x"),
    (lambda: stream("z", 4)(ATTN), "stream(z, 4): axis 'z': no wire has axis z; axes here: d, q, x"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=[m.split(":")[0] + m.split(":")[-1][:30] for _, m in BAD])
def test_bad_input_message(bad, message):
    with pytest.raises(RewriteError, match=f"^{re.escape(message)}$"):
        bad()


def test_integral_sizes_of_any_type_are_accepted():
    for g in (np.int64(16), np.int32(16), sympy.Integer(16)):
        assert tile(q, g) == tile(q, 16) and repr(tile(q, g)) == "tile(q, 16)"
        assert stream(x, g) == stream(x, 16)
    assert check(ATTN, stream(x, np.int64(3))(tile(q, np.int64(2))(ATTN)), seed=0).passed


def test_two_pass_layer_norm_is_not_streamable_but_its_statistics_are():
    with pytest.raises(RewriteError, match="two passes, not one stream"):
        stream(k, 2)(nc.library.layer_norm(n, k))
    stats = Diagram.copy(Ty(X)) >> (nc.reduce_sum(X, k) @ (nc.square(X) >> nc.reduce_sum(X, k)))
    assert check(stats, stream(k, 3)(tile(n, 2)(stats)), sizes={n.size: 5, k.size: 7}, seed=0).passed
