"""Crashes the lowering turns into typed refusals or fixes, each with its regression test:

- an index function reading an array it is not given, at any depth (through a combinator, a wrapper, a closure
  of a closure, a global, ``functools.partial``, defaults, a bound method, a callable object), is refused by
  :class:`NotLowerable` naming the box, the function, each array and the fixes (a diagram's and
  ``nc.attention``'s), before Pallas fails with "captures constants"; numbers it captures still lower;
- kernels run under ``jax_enable_x64`` (the batch grid's index maps were int32 divided by int64);
- every :class:`MosaicConfig` interprets on CPU (only the default took the interpretable path).

Tolerances: f32 relative error max |error| / max |reference|, ≤ 4e-7 forward and ≤ 1.2e-6 for gradients measured
at these sizes, so 2e-6 and 6e-6 (those of tests/test_variants.py); Mosaic, bf16 operands and output: ≤ 2.2e-3,
so 5e-3 (tests/test_mosaic.py).
"""

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import references as R

import napkin_cat as nc
from lowering import MosaicConfig, NotLowerable, lower
from napkin_cat import library as L
from rewrites import derive, stream, tile

FWD, GRAD, BF16 = 2e-6, 6e-6, 5e-3
q, x, d = nc.axes("q x d", d=16)
SEG = jnp.array([0, 0, 1, 1])  # a module global an index function reads


def lowered(mask=None, score_mod=None):
    kw = {k: f for k, f in (("mask", mask), ("score_mod", score_mod)) if f is not None}
    return lower(derive(L.attention(q, x, d, **kw), tile(q, 16), stream(x, 16), verify=False))


def same_doc(ids):
    return lambda q, x: ids[q] == ids[x]


def reads_global(q, x):
    return SEG[q] == SEG[x]


def with_default(q, x, ids=SEG):
    return ids[q] == ids[x]


def with_kwdefault(q, x, *, ids=SEG):
    return ids[q] == ids[x]


class Docs:
    """Segment ids held by an object: its bound method, and the object itself, are masks."""

    def __init__(self, ids):
        self.ids, self.me = ids, self  # a cycle the walk must end

    def same(self, q, x):
        return self.ids[q] == self.ids[x]

    def __call__(self, q, x):
        return self.me.same(q, x)


def renamed(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kw):
        return fn(*args, **kw)

    wrapper.__name__ = name
    return wrapper


def either(*masks):
    return lambda q, x: functools.reduce(operator.or_, [m(q, x) for m in masks])


def closure_of_closure():
    ids = (SEG + 1, SEG)
    helper = lambda q, x: ids[1][q] == ids[1][x]  # noqa: E731
    return lambda q, x: helper(q, x)


MASKS = {
    "or-combinator": (either(lambda q, x: x <= q, same_doc(SEG)), r"ids \(4,\) in same_doc.<lambda>"),
    "renaming wrapper": (renamed(same_doc(SEG), "documents"), r"ids \(4,\) in same_doc.<lambda>"),
    "closure of a closure": (closure_of_closure(), r"ids\[0\] \(4,\) in closure_of_closure.<lambda>, ids\[1\]"),
    "global": (lambda q, x: reads_global(q, x), r"SEG \(4,\) in reads_global"),
    "partial": (functools.partial(lambda ids, q, x: ids[q] == ids[x], SEG), r"argument 0 \(4,\) in partial"),
    "default": (lambda q, x: with_default(q, x), r"default ids \(4,\) in with_default"),
    "keyword default": (lambda q, x: with_kwdefault(q, x), r"default ids \(4,\) in with_kwdefault"),
    "bound method": (Docs(SEG).same, r"self.ids \(4,\) in Docs.same"),
    "callable object": (Docs(SEG), r"self.ids \(4,\) in Docs.__call__"),
    "numpy array": (same_doc(np.asarray(SEG)), r"ids \(4,\)"),
}


@pytest.mark.parametrize("form", list(MASKS))
def test_an_array_captured_at_any_depth_is_refused(form):
    mask, where = MASKS[form]
    with pytest.raises(NotLowerable, match=r"box 'mask .*': .* closes over arrays \(.*" + where) as e:
        lowered(mask=mask)
    assert "make them inputs" in str(e.value) and "segment_ids=" in str(e.value)


def test_a_score_mod_capturing_a_0d_jax_array_is_told_to_capture_a_number():
    c = jnp.float32(0.5)
    with pytest.raises(NotLowerable, match=r"score_mod <lambda>.*\(c \(\)\).*as a Python number \(float\(c\)\)"):
        lowered(score_mod=lambda s, q, x: s - c * abs(q - x))


def test_numbers_captured_at_any_depth_lower(key, seed):
    """Python numbers, numpy scalars and 0-d numpy arrays become literals of the kernel: no refusal, right values."""
    slope, offset, width, half = 0.25, np.float32(0.5), np.asarray(3.0, np.float32), 2
    ramp = functools.partial(lambda k, s, q, x: s - k * slope * abs(q - x) + offset * (x < width), half)
    Q, K, V = (jax.random.normal(k, (40, 16)) for k in jax.random.split(key, 3))
    i, j = jnp.arange(40)[:, None], jnp.arange(40)[None, :]
    s = Q @ K.T / 4.0 - 2 * 0.25 * jnp.abs(i - j) + 0.5 * (j < 3.0)
    err = R.rel_err(lowered(score_mod=ramp)(Q, K, V), jax.nn.softmax(s, axis=-1) @ V)
    assert err <= FWD, f"seed {seed}: {err:.2e}"


def causal_attention(Q, K, V):
    """Causal attention over ``[..., seq, dim]`` arrays, written here: einsum, mask, softmax, einsum."""
    n = Q.shape[-2]
    s = jnp.einsum("...qd,...kd->...qk", Q, K) / Q.shape[-1] ** 0.5
    s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    return jnp.einsum("...qk,...kd->...qd", jax.nn.softmax(s, axis=-1), V)


def test_a_kernel_with_batch_axes_runs_under_x64(key, seed):
    """Under ``jax_enable_x64`` a kernel whose grid has batch axes (index maps dividing the grid's id) runs on f32
    inputs, forward and lowered backward."""
    b, h = nc.axes("b h")
    kernel = lower(derive(L.attention(q, x, d, causal=True, batch=(b, h)), tile(q, 16), stream(x, 16), verify=False))
    Q, K, V, dO = (jax.random.normal(k, (2, 2, 16, 16)) for k in jax.random.split(key, 4))
    with jax.enable_x64(True):
        out, pullback = jax.vjp(kernel, Q, K, V)
        grads = pullback(dO)
    want, pull = jax.vjp(causal_attention, Q, K, V)
    assert out.dtype == jnp.float32 and R.rel_err(out, want) <= FWD, f"seed {seed}"
    for name, g, w in zip(("dQ", "dK", "dV"), grads, pull(dO), strict=True):
        assert g.dtype == jnp.float32 and R.rel_err(g, w) <= GRAD, f"seed {seed}: {name}"


def test_the_entry_runs_under_x64(key, seed):
    """``nc.attention`` under ``jax_enable_x64`` with segment ids (whose block bounds the kernel reads at its batch
    grid position), against ``jax.nn.dot_product_attention``."""
    Q, K, V = jax.random.normal(key, (3, 2, 20, 1, 16))
    seg = jnp.sort(jax.random.randint(jax.random.fold_in(key, 1), (2, 20), 0, 3), axis=-1)
    with jax.enable_x64(True):
        out = nc.attention(Q, K, V, segment_ids=seg, is_causal=True)
    same = seg[:, None, :, None] == seg[:, None, None, :]
    want = jax.nn.dot_product_attention(Q, K, V, mask=same, is_causal=True)  # the diagonal keeps every row
    assert out.dtype == jnp.float32 and R.rel_err(out, want) <= FWD, f"seed {seed}"


def test_a_mosaic_config_not_the_default_interprets_on_cpu(key, seed):
    """``MosaicConfig(consumers=1)`` takes Mosaic's interpretable path in interpret mode as the default does, here
    under ``jax_enable_x64`` too: set globally, since Mosaic's interpreter lowers the kernel in a callback thread,
    which ``jax.enable_x64``'s thread-local setting does not reach."""
    b, q64, x64, d64 = nc.axes("b q x d", d=64)
    attn = L.attention(q64, x64, d64, causal=True, batch=(b,), dtype="bf16")
    kernel = lower(
        derive(attn, tile(q64, 64), stream(x64, 64), verify=False),
        backend="mosaic",
        config=MosaicConfig(consumers=1),
        backward="reference",
    )
    assert kernel.backend == "mosaic" and kernel.forward.config.interpretable
    Q, K, V = (jax.random.normal(k, (2, 128, 64), jnp.bfloat16) for k in jax.random.split(key, 3))
    jax.config.update("jax_enable_x64", True)
    try:
        out = kernel(Q, K, V)
    finally:
        jax.config.update("jax_enable_x64", False)
    want = causal_attention(*(a.astype(jnp.float32) for a in (Q, K, V)))
    assert out.dtype == jnp.bfloat16 and R.rel_err(out.astype(jnp.float32), want) <= BF16, f"seed {seed}"
