"""The language: typed composition, bad input with typed errors naming the wires, random diagrams vs jnp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc


def test_composition_names_the_mismatch():
    q, x, d = nc.axes("q x d")
    a = nc.exp(nc.Array(q, d))
    with pytest.raises(nc.CompositionError, match=r"wire 0: q×d:f32@HBM → q×x:f32@HBM \(axes q×d ≠ q×x\)"):
        a >> nc.exp(nc.Array(q, x))
    with pytest.raises(nc.CompositionError, match=r"dtype f32 ≠ bf16"):
        a >> nc.cast(nc.Array(q, d, dtype=nc.bf16), nc.f32)
    with pytest.raises(nc.CompositionError, match=r"level HBM ≠ SMEM"):
        a >> nc.exp(nc.Array(q, d, level=nc.SMEM))
    with pytest.raises(nc.CompositionError, match=r"axis d: Axis\('d'\) ≠ Axis\('d', 64\)"):
        a >> nc.exp(nc.Array(q, nc.Axis("d", 64)))
    with pytest.raises(nc.CompositionError, match=r"1 wires \(q×d\) cannot feed 2 wires"):
        a >> nc.add(nc.Array(q, d), nc.Array(q, d))


def test_bad_specs_and_axes():
    q, x, d = nc.axes("q x d")
    with pytest.raises(nc.AxisError, match=r"axis 'e' is not among the axes given \(q, x, d\)"):
        nc.contract("q e, x d -> q x", q, x, d)
    with pytest.raises(nc.AxisError, match=r"axis repeated in operand 'q q'"):
        nc.contract("q q, x d -> q x", q, x, d)
    with pytest.raises(nc.AxisError, match=r"output axis 'x' appears in no input"):
        nc.contract("q d -> q x", q, x, d)
    with pytest.raises(nc.AxisError, match=r"softmax over 'x': array q×d:f32@HBM has no such axis"):
        nc.softmax(nc.Array(q, d), x)
    with pytest.raises(nc.AxisError, match="repeated axis"):
        nc.Array(q, q)
    with pytest.raises(nc.AxisError, match="size must be a positive integer"):
        nc.Axis("n", 0)
    with pytest.raises(nc.AxisError, match=r"cannot weave over \['q'\]"):
        nc.library.attention(q, x, d).weave(q)


def test_evaluation_errors_name_the_input():
    q, x, d = nc.axes("q x d", d=8)
    f = nc.to_jax(nc.library.attention(q, x, d))
    good = [jnp.ones((3, 8)), jnp.ones((5, 8)), jnp.ones((5, 8))]
    with pytest.raises(nc.EvaluationError, match=r"expected 3 arrays"):
        f(*good[:2])
    with pytest.raises(nc.EvaluationError, match=r"input 1 \(x×d:f32@HBM\): expected rank 2"):
        f(good[0], jnp.ones((5,)), good[2])
    with pytest.raises(nc.EvaluationError, match=r"input 0 \(q×d:f32@HBM\): axis 'd' has size 4, expected 8"):
        f(jnp.ones((3, 4)), *good[1:])
    with pytest.raises(nc.EvaluationError, match=r"input 2 \(x×d:f32@HBM\): axis 'x' has size 6, but x = 5 elsewhere"):
        f(*good[:2], jnp.ones((6, 8)))
    with pytest.raises(nc.EvaluationError, match=r"input 0 \(q×d:f32@HBM\): dtype bf16, expected f32"):
        f(good[0].astype(jnp.bfloat16), *good[1:])


def test_equality_up_to_interchange_and_printing():
    n, m = nc.axes("n m")
    f, g = nc.exp(nc.Array(n)), nc.relu(nc.Array(m))
    assert (f @ nc.id(nc.Array(m))) >> (nc.id(nc.Array(n)) @ g) == (nc.id(nc.Array(n)) @ g) >> (
        f @ nc.id(nc.Array(m)))
    assert f != nc.log(nc.Array(n))
    assert hash(f >> nc.exp(nc.Array(n))) == hash(f >> nc.exp(nc.Array(n)))
    assert "exp" in str(f)
    assert eval(repr(nc.Array(n, m, dtype=nc.bf16)), {"Array": nc.Array, "Axis": nc.Axis, "bf16": nc.bf16}) == nc.Array(
        n, m, dtype=nc.bf16)


UNARY = {"exp": jnp.exp, "relu": jax.nn.relu, "tanh": jnp.tanh, "square": jnp.square}


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.sampled_from(["exp", "relu", "tanh", "square", "sum", "max", "softmax", "scale"]),
                    min_size=1, max_size=6),
       sizes=st.tuples(st.integers(1, 5), st.integers(1, 5)))
def test_random_diagrams_match_jnp(key, ops, sizes):
    """A random chain of generators over [n, m] (reductions over m end the chain) against jnp written directly."""
    n, m = nc.axes("n m")
    wire, parts, ref = nc.Array(n, m), [], lambda v: v
    for op in ops:
        if op in UNARY:
            parts.append(nc.elementwise(op, wire))
            ref = (lambda f, r: lambda v: f(r(v)))(UNARY[op], ref)
        elif op == "scale":
            parts.append(nc.scale(wire, 0.5))
            ref = (lambda r: lambda v: 0.5 * r(v))(ref)
        elif op == "softmax":
            parts.append(nc.softmax(wire, m))
            ref = (lambda r: lambda v: jax.nn.softmax(r(v), axis=-1))(ref)
        else:
            parts.append(nc.reduce_sum(wire, m) if op == "sum" else nc.reduce_max(wire, m))
            red = jnp.sum if op == "sum" else jnp.max
            ref = (lambda r, f: lambda v: f(r(v), axis=-1))(ref, red)
            break
    d = nc.id(nc.Array(n, m)).then(*parts)
    v = np.random.default_rng(np.asarray(jax.random.key_data(key))).standard_normal(sizes, np.float32)
    # one jitted program per example: eager evaluation (and jax.random) would compile op by op, per shape
    got, want = jax.jit(lambda v: (nc.to_jax(d)(v), ref(v)))(v)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_thousands_of_boxes_no_recursion_limit():
    (n,) = nc.axes("n")
    a = nc.Array(n)
    d = nc.Diagram.then(*[nc.elementwise("add", a, const=1.0) for _ in range(3000)])
    assert float(nc.to_jax(d)(jnp.zeros(2))[0]) == 3000.0
