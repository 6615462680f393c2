"""The reverse-mode functor: ``to_jax(reverse(d))(*xs, *cts)`` equals ``jax.vjp(to_jax(d), *xs)[1](cts)``.

Property tests over random diagrams (the strategies of ``rewrites.testing`` and a dataflow strategy here
that reaches every generator with a derivative, with copies, swaps and discards) and over the library's
diagrams, on fresh random inputs, with dtype-dependent tolerances.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sympy
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat import generators as g
from napkin_cat._reverse import NoDerivative, derivative, reverse
from napkin_cat.architectures import Circuit
from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from rewrites import testing
from rewrites._verify import tolerance

FEW = settings(max_examples=5, deadline=None)


def _sizes(d, data) -> dict:
    symbols = {s for w in (*d.dom.inside, *d.cod.inside) for a in w.axes for s in a.size.free_symbols}
    return {s: data.draw(st.integers(1, 5), label=str(s)) for s in sorted(symbols, key=str)}


def _random(wires, sizes: dict, seed: int) -> list:
    """Normals in each wire's dtype (drawn with numpy: eager JAX would compile per shape)."""
    rng = np.random.default_rng(seed)
    shape = lambda w: tuple(int(a.size.subs(sizes)) for a in w.axes)  # noqa: E731
    return [jnp.asarray(rng.standard_normal(shape(w), np.float32), w.dtype.jnp) for w in wires]


def assert_reverse(d, sizes: dict, seed: int, *, assume_finite: bool = False):
    """The backward diagram's semantics equals JAX's vjp of the forward's, within ``d``'s tolerance.
    ``assume_finite``: skip the example (hypothesis ``assume``) where the forward or JAX's vjp is not finite."""
    xs, cts = _random(d.dom.inside, sizes, seed), _random(d.cod.inside, sizes, seed + 1)
    forward, back = nc.to_jax(d), reverse(d)
    assert back.dom == d.dom @ d.cod and back.cod == d.dom
    backward = nc.to_jax(back)

    def all_three(xs, cts):  # one program: a compilation per drawn size, not one per op (eager) or three
        out, pullback = jax.vjp(forward, *xs)
        return backward(*xs, *cts), pullback(cts[0] if len(cts) == 1 else tuple(cts)), out

    got, want, out = jax.jit(all_three)(xs, cts)
    if not all(bool(np.isfinite(np.asarray(v, np.float32)).all()) for v in want):
        # XLA's CPU backend at conftest's --xla_backend_optimization_level=0 can compile JAX's own vjp to NaN where
        # the same vjp run op by op is finite (grouped-query attention at d=1, g=2, hk=5, q=1, x=2, seed 0), or to
        # inf: a max's derivative divides by the count of entries attaining it, and the compiled program recomputes
        # ``x·a + b`` in two fusions, one with a fused multiply-add, so none attains it (hypothesis found
        # ``(x·a + b) → max c`` at r = c = 2, seed 0; the derived backward, compiled alike, gave the same inf). Both
        # are then taken eagerly, so the check stays on the derived backward
        out, pullback = jax.vjp(forward, *xs)
        want = pullback(cts[0] if len(cts) == 1 else tuple(cts))
        got = backward(*xs, *cts)
    if assume_finite:
        assume(all(bool(np.isfinite(np.asarray(v, np.float32)).all()) for v in (*jax.tree.leaves(out), *want)))
    got = got if isinstance(got, tuple) else (got,)
    tol = tolerance(d)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"input {i}: {a.dtype}{a.shape} ≠ {b.dtype}{b.shape}"
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert not np.isnan(a).any(), f"input {i}: NaN in the backward diagram's cotangent"
        err = float(np.max(np.abs(a - b), initial=0.0))
        scale = 1.0 + float(np.max(np.abs(b), initial=0.0))
        assert err <= tol * scale, f"input {i} ({d.dom.inside[i]}): error {err:.2e} > {tol:.0e}·{scale:.2f}"


# --- the library -----------------------------------------------------------------------------------


def alibi(s, q, x):
    return s - 0.5 * jnp.abs(q - x)


def soft_cap(s):
    return 4.0 * jnp.tanh(s / 4.0)


def strictly_before(q, x):  # the first query sees no key: a fully masked row
    return x < q


b, h, hk, gq, q, x, d, n, i, f, o = nc.axes("b h hk g q x d n i f o")
LIBRARY = {
    "attention": lambda: nc.library.attention(q, x, d),
    "attention causal": lambda: nc.library.attention(q, x, d, causal=True),
    "attention alibi causal": lambda: nc.library.attention(q, x, d, causal=True, score_mod=alibi),
    "attention soft cap": lambda: nc.library.attention(q, x, d, score_mod=soft_cap, scale=sympy.Rational(1, 2)),
    "attention empty rows": lambda: nc.library.attention(q, x, d, mask=strictly_before),
    "attention bf16": lambda: nc.library.attention(q, x, d, causal=True, dtype="bf16"),
    "multi-head attention": lambda: nc.library.multi_head_attention(h, q, x, d, batch=(b,), causal=True),
    "grouped-query attention": lambda: nc.library.grouped_query_attention(hk, gq, q, x, d, score_mod=alibi),
    "multi-query attention": lambda: nc.library.multi_query_attention(h, q, x, d),
    "softmax": lambda: nc.library.softmax(n, x),
    "matmul": lambda: nc.library.matmul(n, i, o),
    "layer norm": lambda: nc.library.layer_norm(n, d),
    "layer norm bf16": lambda: nc.library.layer_norm(n, d, dtype="bf16"),
    "rms norm": lambda: nc.library.rms_norm(n, d),
    "mlp gelu": lambda: nc.library.mlp(n, i, f, o),
    "mlp relu": lambda: nc.library.mlp(n, i, f, o, activation="relu"),
    "mlp silu bf16": lambda: nc.library.mlp(n, i, f, o, activation="silu", dtype="bf16"),
    "self-attention": lambda: nc.architectures.self_attention(n, d, h, i, causal=True),
}


@pytest.mark.parametrize("name", LIBRARY)
@settings(max_examples=3, deadline=None)  # 18 diagrams: a compilation per drawn size each
@given(data=st.data(), seed=st.integers(0, 2**30))
def test_library(name, data, seed):
    d = LIBRARY[name]()
    assert_reverse(d, _sizes(d, data), seed)


def test_grouped_query_attention_where_xla_compiles_the_reference_to_nan():
    # the sizes and seed hypothesis 6.170 drew: the compiled reference is NaN under conftest's XLA flags
    d = LIBRARY["grouped-query attention"]()
    named = {str(s): s for w in d.dom.inside for a in w.axes for s in a.size.free_symbols}
    assert_reverse(d, {named[k]: v for k, v in dict(d=1, g=2, hk=5, q=1, x=2).items()}, 0)


@settings(max_examples=1, deadline=None)
@given(seed=st.integers(0, 2**30))
def test_transformer_block(seed):
    block = nc.architectures.transformer_block(n, d, h, i, f, causal=True)
    assert_reverse(block, {n.size: 3, d.size: 4, h.size: 2, i.size: 2, f.size: 5}, seed)


# --- random diagrams -------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(d=testing.diagrams(max_boxes=5), data=st.data(), seed=st.integers(0, 2**30))
def test_random_diagrams(d, data, seed):
    assert_reverse(d, _sizes(d, data), seed)


def test_a_max_of_a_multiply_add_whose_compiled_vjp_is_inf():
    """Hypothesis' find: ``(x·a + b) → max c`` at r = c = 2, seed 0, whose derivative compiled on XLA's CPU backend
    (conftest's optimisation level 0) is inf, JAX's own vjp's too; op by op both are finite and agree."""
    r, c = nc.axes("r c")
    X, side = Array(r, c), Array(c)
    d = (testing.identity(X) @ testing.identity(side)) >> nc.elementwise("multiply", X, side)
    d = (d @ testing.identity(side)) >> nc.elementwise("add", X, side) >> nc.reduce_max(X, c)
    assert_reverse(d, {r.size: 2, c.size: 2}, 0)


def softplus(s):
    return jax.nn.softplus(s)


def identity(z):
    return z


def gate(s, r, c):
    return jnp.where(c <= r, 2.0 * s, s)


NORMALISERS = ((jnp.exp, jnp.exp, identity), (softplus, softplus, jnp.sqrt))
def cube(v):  # a user's elementwise callable: its derivative comes from JAX
    return v * v * v


UNARY = ("exp", "tanh", "sigmoid", "gelu", "silu", "relu", "neg", "square", cube)
POSITIVE = ("log", "sqrt", "rsqrt", "reciprocal")


@st.composite
def dataflows(draw, max_steps: int = 6):
    """Random dataflow programs on named wires over axes ``r``, ``c`` (even) and ``k``, compiled by
    :class:`Circuit` (which copies wires read twice, swaps arguments together, discards unread ones)."""
    r, c, k = Axis("r", draw(st.integers(1, 4))), Axis("c", 2 * draw(st.integers(1, 3))), Axis("k", 3)
    dt = draw(st.sampled_from([nc.f32, nc.f32, nc.bf16]))
    circ = Circuit(X=Array(r, c, dtype=dt), Y=Array(r, c), w=Array(c), V=Array(c, k))
    circ.let("A", nc.cast(Array(r, c, dtype=dt), nc.f32), "X")
    names = ["A", "Y", "w", "V"]

    def pick(pred=lambda a: True):
        return draw(st.sampled_from([m for m in names if pred(circ.types[m])]))

    def let(box, *ins):
        out = f"z{len(names)}"
        circ.let(out, box, *ins)
        names.append(out)
        return out

    for _ in range(draw(st.integers(1, max_steps))):
        kind = draw(st.sampled_from(["unary", "positive", "binary", "const", "reduce", "softmax", "mask",
                                     "score_mod", "contract", "softmax_contract", "normalised", "structure"]))
        rc = lambda a: a.names == ("r", "c")  # noqa: E731
        if kind == "unary":
            m = pick()
            let(nc.elementwise(draw(st.sampled_from(UNARY)), circ.types[m]), m)
        elif kind == "positive":
            m = pick()
            a = circ.types[m]
            one = let(nc.elementwise("add", a, const=1), let(nc.square(a), m))
            let(nc.elementwise(draw(st.sampled_from(POSITIVE)), a), one)
        elif kind == "binary":
            m = pick(rc)
            other = pick(lambda a: set(a.names) <= {"r", "c"})
            fn = draw(st.sampled_from(["add", "subtract", "multiply", "divide", "maximum"]))
            if fn == "divide":
                other = let(nc.elementwise("add", circ.types[other], const=3), let(nc.square(circ.types[other]), other))
            ins = draw(st.permutations([m, other])) if circ.types[other].names == ("r", "c") else [m, other]
            let(nc.elementwise(fn, *(circ.types[v] for v in ins), out=circ.types[m]), *ins)
        elif kind == "const":
            m = pick()
            fn, const = draw(st.sampled_from([("multiply", -2), ("add", 0.5), ("subtract", 1), ("divide", 4)]))
            let(nc.elementwise(fn, circ.types[m], const=const), m)
        elif kind == "reduce":
            m = pick(rc)
            op = draw(st.sampled_from([nc.reduce_sum, nc.reduce_max, nc.reduce_min]))
            let(op(circ.types[m], draw(st.sampled_from(["r", "c"]))), m)
        elif kind in ("softmax", "mask"):
            m = pick(rc)
            if kind == "mask":
                m = let(nc.causal_mask(circ.types[m], r, c), m)
            let(nc.softmax(circ.types[m], c), m)
        elif kind == "score_mod":
            m = pick(rc)
            let(nc.score_mod(circ.types[m], draw(st.sampled_from([alibi_rc, gate, soft_cap]))), m)
        elif kind == "contract":
            m, other = pick(rc), pick(lambda a: "c" in a.names)
            spec = draw(st.sampled_from(["r c, {o} -> r", "r c, {o} -> {o}", "r c, {o} -> r {rest}"]))
            oth = " ".join(circ.types[other].names)
            rest = " ".join(a for a in circ.types[other].names if a not in ("r", "c")) or "c"
            let(nc.contract(spec.format(o=oth, rest=rest), r, c, k, scale=draw(st.sampled_from([None, 3]))),
                m, other)
        elif kind in ("softmax_contract", "normalised"):
            m = pick(rc)
            if draw(st.booleans()):
                m = let(nc.causal_mask(circ.types[m], r, c), m)
            S, out = circ.types[m], Array(r, k)
            if kind == "normalised":
                a1, a2, b_ = draw(st.sampled_from(NORMALISERS))
                let(nc.normalised_contract(S, circ.types["V"], c, out, a1=a1, a2=a2, b=b_), m, "V")
            else:
                box = nc.softmax_contract(S, circ.types["V"], c, out)
                if draw(st.booleans()):  # the base-2 form of the lowering
                    box = g.SoftmaxContract(box.name, box.dom, box.cod, data=(*box.data, ("base", 2)))
                let(box, m, "V")
        else:
            m = pick(rc)
            a = circ.types[m]
            c1, c2 = Axis("c1", c.size // 2), Axis("c2", 2)
            op = draw(st.sampled_from(["move", "split", "rename", "cast"]))
            if op == "move":
                let(nc.move(a, nc.SMEM) >> nc.move(a.with_(level=nc.SMEM), nc.HBM), m)
            elif op == "split":
                s = nc.split(a, c, c1, c2)
                let(s >> nc.merge(s.out, c1, c2, into=c), m)
            elif op == "rename":
                mm = Axis("m", c.size)
                let(nc.rename(a, c, mm) >> nc.rename(a.with_(axes=(r, mm)), mm, c), m)
            else:
                let(nc.cast(a, nc.bf16) >> nc.cast(a.with_(dtype=nc.bf16), nc.f32), m)
    outs = draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
    return circ.diagram(*outs)


def alibi_rc(s, r, c):
    return s - 0.5 * jnp.abs(r - c)


@settings(max_examples=30, deadline=None)
@given(d=dataflows(), seed=st.integers(0, 2**30))
def test_random_dataflows(d, seed):
    # A random mask can send −∞ into arithmetic (−∞·0, −∞ − −∞): the function itself is then undefined
    # there, and JAX's own vjp is NaN too. Such examples say nothing about the backward functor.
    assert_reverse(d, {}, seed, assume_finite=True)


@pytest.mark.parametrize("base", [None, 2])
@FEW
@given(data=st.data(), seed=st.integers(0, 2**30))
def test_softmax_contract_with_log_sum_exp(base, data, seed):
    """The fused box with FlashAttention's residual output (base e or 2), after a mask emptying a row."""
    S, V, Out = Array(q, x), Array(x, d), Array(q, d)
    box = nc.softmax_contract(S, V, x, Out)
    box = g.SoftmaxContract(box.name, box.dom, Ty(Out, Array(q)), data=(*box.data, *((("base", 2),) if base else ())))
    diagram = (nc.mask(S, strictly_before) @ nc.id(V)) >> box
    assert_reverse(diagram, _sizes(diagram, data), seed)


# --- single generators and structure ---------------------------------------------------------------


r, c, k = nc.axes("r c k")


@pytest.mark.parametrize(
    "d",
    [
        nc.id(Array(r, c)) @ nc.id(Array(k)),
        nc.swap(Array(r, c), Array(k)),
        nc.copy(Array(r, c, dtype=nc.bf16), 3),
        nc.discard(Array(r, c)) @ nc.id(Array(k)),
        nc.reduce_max(Array(r, c), c),
        nc.contract("r c -> c r", r, c),
        nc.contract("r c, k -> r", r, c, k),  # c and k are summed: their cotangents broadcast back
        nc.contract("r, c -> r c", r, c),
    ],
    ids=str,
)
def test_structure(d):
    assert_reverse(d, {r.size: 3, c.size: 4, k.size: 2}, seed=0)


def test_max_ties_share_the_cotangent():
    """``max`` sends its cotangent to the positions attaining it, split equally among ties (as JAX)."""
    d = nc.relu(Array(r, c)) >> nc.reduce_max(Array(r, c), c)
    X = jnp.array([[-1.0, -2.0, -3.0], [1.0, 3.0, 3.0]])
    dX = nc.to_jax(reverse(d))(X, jnp.array([1.0, 2.0]))
    assert dX.tolist() == [[0.0, 0.0, 0.0], [0.0, 1.0, 1.0]]


def test_score_mod_and_mask_differentiate_through_their_index_functions():
    S = Array(r, c)
    names = [box.name for box in reverse(nc.score_mod(S, alibi_rc) >> nc.causal_mask(S, r, c)).boxes]
    assert "score_mod alibi_rc'" in names and "kept causal(r ≥ c)" in names


def test_backward_jits():
    attn = nc.library.attention(q, x, Axis("d", 4), causal=True)
    xs = _random(attn.dom.inside, {q.size: 3, x.size: 5}, seed=1)
    got = jax.jit(nc.to_jax(reverse(attn)))(*xs, jnp.ones((3, 4)))
    want = jax.grad(lambda *a: jnp.sum(nc.to_jax(attn)(*a)), argnums=(0, 1, 2))(*xs)
    assert all(bool(jnp.allclose(u, v, atol=1e-5)) for u, v in zip(got, want, strict=True))


# --- errors and user rules -------------------------------------------------------------------------


def test_no_derivative_names_the_box():
    box = nc.concat(Array(Axis("one", 1), d), Array(n, d), "one", n, into=Axis("t", n.size + 1))
    with pytest.raises(NoDerivative) as err:
        reverse(box)
    assert str(err.value) == (
        "reverse: no derivative rule for Concat box 'concat t' (one×d ⊗ n×d → t×d); "
        "register one with napkin_cat.derivative"
    )


class SumOfSquares(g.Generator):
    """A user's generator: ``Σ_axis v²``."""

    def evaluate(self, ins, ctx):
        (v,) = ins
        return [jnp.sum(jnp.square(v), axis=self.dom.inside[0].names.index(self.params["axis"]))]


def test_user_rule():
    A = Array(r, c)
    box = SumOfSquares("sum of squares c", Ty(A), Ty(Array(r)), data=(("axis", "c"),))
    with pytest.raises(NoDerivative):
        reverse(box)

    @derivative(SumOfSquares)
    def _(t, box, ins, outs, cts):  # d/dv Σ v² = 2v
        (v,), (ct,) = ins, cts
        return [t.ew("multiply", t.ew("multiply", v, ct, out=t.ty(v)), const=2)]

    try:
        assert_reverse(box, {r.size: 3, c.size: 4}, seed=2)
    finally:
        del SumOfSquares.backward
