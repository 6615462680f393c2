"""What a derivation compiles, and that compiling less checks the same: the padding probe is one program per box
and finds what evaluating the box op by op finds; a derivation checked with its kernel compiles a few programs, not
one per operation; a failing step is still reported before its kernel's failure."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from napkin_cat.diagram import Diagram
from napkin_cat.generators import Context
from napkin_cat.semantics import bind, run
from rewrites import RewriteError, Rule, derive, fuse_softmax, neutral_padding, stream, tile
from rewrites._lowering_rules import CANDIDATES, _declared, _plain, _probe, _unlabelled
from rewrites._verify import relative_error, tolerance

n, c = nc.axes("n c")
S, V, OUT = nc.Array(n, c), nc.Array(c), nc.Array(n)


class Compiles:
    """Counts XLA compilations while active (a persistent cache's hits are not compilations)."""

    def __init__(self):
        self.count, self.active = 0, False
        jax.monitoring.register_event_duration_secs_listener(self._heard)

    def _heard(self, event, duration, **kw):
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc):
        self.active = False


COMPILES = Compiles()


def eager_first_neutral(box, axis: str, candidates) -> tuple | None:
    """The probe as it was: the box evaluated op by op (eager jax.numpy), once per padding tried."""
    plain = _unlabelled(box)
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal([2] * len(w.axes), np.float32), w.dtype.jnp) for w in box.dom.inside]
    ctx = Context(sizes=bind(plain.dom, xs))
    want = run(plain, xs, ctx)
    for pads in candidates:
        padded = []
        for v, w, pad in zip(xs, box.dom.inside, pads, strict=True):
            if w.has(axis):
                i = w.names.index(axis)
                v = jnp.concatenate([v, jnp.full([1 if k == i else 2 for k in range(v.ndim)], pad, v.dtype)], axis=i)
            padded.append(v)
        got = run(plain, padded, ctx)
        ok = True
        for wv, g, wire in zip(want, got, box.cod.inside, strict=True):
            g = np.asarray(g, np.float64)
            if wire.has(axis):
                g = np.take(g, [0, 1], axis=wire.names.index(axis))
            ok = ok and relative_error(g, wv) <= tolerance(box)
        if ok:
            return pads
    return None


def candidates(box, axis: str) -> tuple:
    declared = _declared(box, axis)
    per_input = [tuple(dict.fromkeys(((declared[k],) if declared else ()) + CANDIDATES)) for k in range(len(box.dom))]
    return tuple(dict.fromkeys(([declared] if declared else []) + list(itertools.product(*per_input))))


def boxes():
    b, h, q, x, d = nc.axes("b h q x d")
    contracts = [
        nc.normalised_contract(S, V, c, OUT, a1=a1, a2=a2, b=jnp.sqrt)
        for a1, a2 in ((jnp.exp, jnp.exp), (jnp.negative, jnp.abs), (jnp.negative, jnp.exp), (jnp.tanh, jnp.square))
    ]
    diagrams = [
        (nc.library.rms_norm(n, c), "c"),
        *((k, "c") for k in contracts),
        (nc.library.attention(q, x, d, causal=True), "x"),
        (nc.library.attention(q, x, d, dtype=nc.bf16), "x"),
        (nc.library.dot_product_attention(q, x, d, batch=(b, h), causal=True, dropout=_dropout(b, h)), "x"),
    ]
    diagrams += [(fuse_softmax("x")(dg), "x") for dg, axis in diagrams[-3:]]  # the kernels' softmax·contract
    return [(box, axis) for dg, axis in diagrams for _, box, _ in dg.inside if axis in getattr(box, "mixes", ())]


def _dropout(b, h):
    from napkin_cat.generators import Drop

    return Drop(0.1, "q", "x", "b", ("h",), 1), (b,)


@pytest.mark.parametrize("box, axis", boxes(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_the_padding_probe_finds_what_evaluating_op_by_op_finds(box, axis):
    plain = _plain(box)
    tried = candidates(plain, axis)
    assert _probe(plain, axis, tried) == eager_first_neutral(plain, axis, tried)


def test_the_padding_probe_compiles_one_program_per_box_whatever_the_paddings_tried():
    signed = nc.normalised_contract(S, V, c, OUT, a1=lambda s: -s, a2=jnp.abs, b=jnp.sqrt)  # a fresh box: uncached
    with COMPILES:
        pads = neutral_padding(signed, "c")
    assert pads == {0: (0.0, 0.0)}  # its own (-inf, 0) is not neutral: a second padding was tried
    assert COMPILES.count == 1


def test_a_derivation_checked_with_its_kernel_compiles_a_few_programs():
    h, q, x, d = nc.axes("h q x d", d=16)
    attn = nc.library.multi_head_attention(h, q, x, d, causal=True, dtype=nc.bf16)
    with COMPILES:
        flash = derive(attn, tile(q, 16), stream(x, 16), verify="kernel", seed=3)
    assert flash.kernel.passed
    # the reference, two steps, the kernel, a padding probe per box and a few scalars (14 in a fresh process); 66
    # when the probes evaluated op by op
    assert COMPILES.count <= 20, COMPILES.count


class sum_to_max(Rule):  # noqa: N801 - a wrong rule, as a user might write one
    def __repr__(self):
        return "sum_to_max"

    def apply(self, diagram: Diagram) -> Diagram:
        return nc.reduce_max(nc.Array(nc.Axis("n")), "n")


def test_a_failing_step_is_reported_before_the_kernel_while_the_kernel_is_lowered_beside_it():
    with pytest.raises(RewriteError, match=r"^sum_to_max: the rewritten diagram differs from the original: FAILED"):
        derive(nc.reduce_sum(nc.Array(nc.Axis("n")), "n"), sum_to_max(), seed=11, sizes={"n": 5}, verify="kernel")


def test_the_kernel_check_still_catches_a_wrong_kernel(monkeypatch):
    import lowering

    def off(scheduled):
        f = nc.to_jax(scheduled)
        return lambda *arrays: f(*arrays) * (1 + 1e-3)

    monkeypatch.setattr(lowering, "lower", off)
    q, x, d = nc.axes("q x d")
    with pytest.raises(RewriteError, match=r"^derive\(verify='kernel'\): the lowered kernel differs"):
        derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), seed=2, verify="kernel")


def test_each_steps_check_compiles_once_also_where_sizes_resize_a_concrete_axis():
    q, x, d = nc.axes("q x d", d=64)
    attn = nc.library.attention(q, x, d, causal=True)
    for seed in (5, 6):  # the second at other sizes: what a derivation compiles, once the process is warm
        with COMPILES:
            derive(attn, tile(q, 16), stream(x, 16), sizes={"d": 8}, seed=seed, verify="kernel")
    # the reference, two steps, the kernel, and the inputs' two shapes put on the device (8 were each step's program
    # compiled twice: ahead, and again for a copy of its diagram resized)
    assert COMPILES.count <= 6, COMPILES.count
