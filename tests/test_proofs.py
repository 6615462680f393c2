"""Verification strength (c): symbolic proofs at small concrete sizes."""

import jax.numpy as jnp
import pytest

import napkin_cat as nc
from rewrites import RewriteError, fuse_softmax_contract, stream, tile
from rewrites._proofs import prove_accumulator, prove_equivalent, prove_monoid

q, x, d, n, k, c = nc.axes("q x d n k c")
S, V, Out = nc.Array(q, x), nc.Array(x, d), nc.Array(q, d)


def test_online_softmax_accumulator_identity():
    box = nc.softmax_contract(S, V, x, Out)
    proof = prove_accumulator(box, "x", sizes={"q": 1, "x": 4, "d": 2})
    assert proof.identities == 4 and proof.cases == 1


@pytest.mark.parametrize("box, axis", [
    (nc.reduce_sum(nc.Array(n, k), k), "k"),
    (nc.reduce_max(nc.Array(n, k), k), "k"),
    (nc.reduce_min(nc.Array(n, k), k), "k"),
    (nc.library.matmul(n, k, c), "k"),
    (nc.softmax_contract(S, V, x, Out), "x"),
    (nc.normalised_contract(S, V, x, Out, a1=jnp.exp, a2=jnp.exp, b=jnp.sqrt), "x"),
])
def test_accumulators_are_monoids_and_satisfy_the_identity(box, axis):
    sizes = {a.name: 3 if a.name == axis else 1 for w in box.dom.inside for a in w.axes}
    assert prove_monoid(box, axis, sizes=sizes).identities > 0
    assert prove_accumulator(box, axis, sizes=sizes).identities > 0


def test_split_k_and_tiling_of_matmul():
    mm = nc.library.matmul(n, k, c)
    proof = prove_equivalent(mm, stream(k, 2)(tile(c, 2)(tile(n, 2)(mm))), sizes={"n": 3, "k": 3, "c": 3})
    assert proof.identities == 9


def test_flash_attention_derivation_steps():
    attn = nc.library.attention(q, x, d, causal=True)
    sizes = {"q": 3, "x": 3, "d": 1}
    # A failed proof raises RewriteError (test_a_wrong_rewrite_is_refused); one identity per output element q·d.
    assert prove_equivalent(attn, fuse_softmax_contract(attn, "x"), sizes=sizes).identities == 3
    assert prove_equivalent(attn, stream(x, 2)(tile(q, 2)(attn)), sizes=sizes).identities == 3


def test_layer_norm_one_pass_statistics_equal_two_pass():
    """E[(X − E X)²] = E[X²] − (E X)², symbolically: the rewrite that makes the statistics streamable."""
    X, row = nc.Array(n, k), nc.Array(n)
    from napkin_cat.diagram import Diagram, Ty
    from napkin_cat.diagram import id as identity

    mean = nc.reduce_sum(X, k) >> nc.scale(row, 1 / k.size)
    two_pass = Diagram.copy(Ty(X)) >> (identity(X) @ mean) >> nc.subtract(X, row) >> nc.square(X) >> (
        nc.reduce_sum(X, k) >> nc.scale(row, 1 / k.size))
    ex2 = nc.square(X) >> nc.reduce_sum(X, k) >> nc.scale(row, 1 / k.size)
    one_pass = Diagram.copy(Ty(X)) >> (ex2 @ (mean >> nc.square(row))) >> nc.subtract(row, row)
    assert prove_equivalent(two_pass, stream(k, 2)(one_pass), sizes={"n": 1, "k": 3}).identities == 1


def test_a_wrong_rewrite_is_refused():
    with pytest.raises(RewriteError, match="does not simplify to 0"):
        prove_equivalent(nc.library.attention(q, x, d), nc.library.attention(q, x, d, causal=True),
                         sizes={"q": 2, "x": 2, "d": 1})


def test_default_sizes_refuse_large_tiles():
    attn = nc.library.attention(q, x, d)
    with pytest.raises(RewriteError, match="pass sizes= or use smaller tiles"):
        prove_equivalent(attn, tile(q, 64)(attn))
