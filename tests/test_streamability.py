"""``stream`` accepts exactly what the Fusion Theorem licenses, and refuses the rest by name.

A softmax over the streamed axis must reach its contraction through maps FAN's softmax-contraction
lemma covers (swaps, constant scales); anything else would normalise per chunk, so it is refused
before any evaluation. Every accepted stream is checked against ``jax.numpy`` directly (never the
generators' own semantics); the tolerance 1e-5 is relative to the largest output entry, against a
measured f32 error of at most 6e-7 at these sizes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.architectures import Circuit
from napkin_cat.diagram import id as identity
from rewrites import RewriteError, stream, tile
from rewrites._schedule import execute
from rewrites.testing import softmax_paths

RTOL = 1e-5
q, x, d = nc.axes("q x d")
S, V = nc.Array(q, x), nc.Array(x, d)
PV = nc.contract("q x, x d -> q d", q, x, d)


def close(got, want, seed):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    error = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert error <= RTOL, f"relative error {error:.1e} > tolerance {RTOL:.0e} (seed {seed})"


def inputs(seed, *shapes, dtype=jnp.float32):
    """Normals drawn by numpy from ``seed`` (jax.random would compile for every shape)."""
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, np.float32)).astype(dtype) for s in shapes]


@settings(max_examples=12, deadline=None)
@given(softmax_paths(), st.integers(1, 4), st.booleans(), st.integers(0, 2**31 - 1))
def test_every_accepted_stream_is_correct_and_every_refused_one_names_its_box(path, s, tiled, seed):
    rule = stream("c", s)
    try:
        streamed = rule(tile("r", 2)(path.diagram) if tiled else path.diagram)
    except RewriteError as err:
        assert not path.licensed, f"refused a path the lemma licenses: {path.between}"
        assert err.box == "softmax c" and err.axis == "c"
        assert str(err).startswith(f"{rule!r}: box 'softmax c', axis 'c': softmax over c is not followed by a")
        assert str(err).endswith("so its normaliser would be computed per chunk")
        return
    assert path.licensed, f"accepted a path the lemma does not license: {path.between}"
    assert not any(b.name == "softmax c" for b in streamed.boxes)
    scores, values = inputs(seed, (5, 2 * s + 1), (2 * s + 1, 3))
    scores = scores.astype(path.diagram.dom.inside[0].dtype.jnp)
    # one jitted program per example: eager evaluation would compile op by op, per shape
    got, want = jax.jit(lambda s_, v_: (execute(streamed)(s_, v_), path.reference(s_, v_)))(scores, values)
    close(got, want, seed)


def test_a_scale_between_softmax_and_contraction_moves_past_the_contraction():
    scaled = (nc.softmax(S, x) >> nc.scale(S, 2)) @ identity(V) >> PV
    flash = stream(x, 3)(scaled)
    assert [b.name for b in flash.boxes] == ["softmax·contract x", "multiply 2"]
    s, v = inputs(1, (5, 7), (7, 3))
    close(execute(flash)(s, v), 2 * jax.nn.softmax(s, axis=1) @ v, 1)


def test_a_scaled_contraction_after_a_softmax_is_fused_with_its_scale():
    flash = stream(x, 3)(nc.softmax(S, x) @ identity(V) >> nc.contract("q x, x d -> q d", q, x, d, scale=0.25))
    s, v = inputs(2, (5, 7), (7, 3))
    close(execute(flash)(s, v), 0.25 * jax.nn.softmax(s, axis=1) @ v, 2)


def test_the_swap_a_circuit_inserts_is_transparent():
    c = Circuit(V=V, S=S)
    c.let("p", nc.softmax(S, x), "S")
    c.let("o", PV, "p", "V")
    flash = stream(x, 3)(c.diagram("o"))
    v, s = inputs(3, (7, 3), (5, 7))
    close(execute(flash)(v, s), jax.nn.softmax(s, axis=1) @ v, 3)


def test_the_softmax_as_second_operand_is_fused():
    flash = stream(x, 3)((identity(V) @ nc.softmax(S, x)) >> nc.contract("x d, q x -> q d", q, x, d))
    v, s = inputs(4, (7, 3), (5, 7))
    close(execute(flash)(v, s), jax.nn.softmax(s, axis=1) @ v, 4)


REFUSED = [
    ((nc.softmax(S, x) >> nc.tanh(S)) @ identity(V) >> PV, "its output reaches 'tanh'"),
    ((nc.softmax(S, x) >> nc.copy(S) >> nc.add(S, S)) @ identity(V) >> PV, "its output is copied"),
    (nc.softmax(S, x), "its output leaves the diagram as output wire 0"),
    (
        nc.softmax(S, x) @ identity(nc.Array(q, d)) >> nc.contract("q x, q d -> q d", q, x, d),
        "its output reaches 'q x, q d → q d'",
    ),
]


@pytest.mark.parametrize("diagram, reached", REFUSED, ids=[r for _, r in REFUSED])
def test_an_unlicensed_softmax_is_refused_naming_it(diagram, reached):
    message = (
        f"stream(x, 3): box 'softmax x', axis 'x': softmax over x is not followed by a contraction over x ({reached}; "
        "only swaps and constant scales may come between), so its normaliser would be computed per chunk"
    )
    with pytest.raises(RewriteError, match=f"^{re.escape(message)}$"):
        stream(x, 3)(diagram)


def test_a_normalised_contraction_streams():
    def relu_sq(z):
        return jax.nn.relu(z) ** 2

    nc_box = nc.normalised_contract(S, V, x, nc.Array(q, d), a1=relu_sq, a2=relu_sq, b=jnp.sqrt)
    flash = stream(x, 3)(nc_box)
    s, v = inputs(5, (5, 7), (7, 3))
    a = relu_sq(s)
    close(execute(flash)(s, v), (a / jnp.sqrt(a.sum(axis=1, keepdims=True))) @ v, 5)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_scaled_base2_online_softmax_is_the_softmax_of_the_scaled_scores(seed):
    """The online softmax a kernel runs once the score scale has moved into it (``in_base2(scale=c·log₂e)``,
    ``lowering._plan.base2``): its running max is of unscaled scores and each score takes ``exp₂(s·k − m·k)``.
    Chunks folded by ``step``, halves merged by ``combine``, and the whole box, each against ``jax.nn`` on the
    scaled scores, with a masked tail and a fully masked row (output 0, log-sum-exp +inf). Measured over 20
    seeds in f32: ≤ 3.3e-7 on the output, ≤ 1.2e-7 on the log-sum-exp; tolerance 1e-6."""
    c, tol = 0.3, 1e-6
    q6, x40, d8 = nc.axes("q x d", q=6, x=40, d=8)
    plain = nc.generators.softmax_contract(nc.Array(q6, x40), nc.Array(x40, d8), "x", nc.Array(q6, d8))
    box = plain.with_residual().in_base2(scale=c * np.log2(np.e))
    acc, ctx = box.accumulator("x"), nc.generators.Context()
    s, v = inputs(seed, (6, 40), (40, 8))
    s = (8 * s).at[1, 5:].set(-jnp.inf).at[4].set(-jnp.inf)
    want = jnp.nan_to_num(jax.nn.softmax(c * s, axis=-1)) @ v
    lse = jax.nn.logsumexp(c * s, axis=-1)
    halves = acc.combine(acc.partial([s[:, :16], v[:16]], ctx), acc.partial([s[:, 16:], v[16:]], ctx), ctx)
    state = acc.partial([s[:, :8], v[:8]], ctx)
    for at in range(8, 40, 8):
        state = acc.step(state, [s[:, at : at + 8], v[at : at + 8]], ctx)
    for out, got_lse in (acc.finalize(halves, ctx), acc.finalize(state, ctx), box.evaluate([s, v], ctx)):
        assert float(jnp.max(jnp.abs(out - want)) / jnp.max(jnp.abs(want))) <= tol, f"output (seed {seed})"
        seen = jnp.isfinite(lse)
        assert bool((got_lse[~seen] == jnp.inf).all()), f"a fully masked row's log-sum-exp (seed {seed})"
        err = float(jnp.max(jnp.abs(got_lse - lse)[seen]) / jnp.max(jnp.abs(lse[seen])))
        assert err <= tol, f"log-sum-exp (seed {seed})"
