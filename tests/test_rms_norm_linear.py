"""``nc.rms_norm_linear`` (lowering._rms_norm_linear) against ``x * rsqrt(mean(x²) + eps) * g @ w`` written here in
jax.numpy: the output and the gradients in x, g and w, f32 and bf16, ragged sizes (tokens, outputs and the hidden
dim not multiples of the blocks), leading batch dims; the rule ``factor_row_scale`` that fuses the norm into the
product, verified on random inputs, proved symbolically and refused; bad arguments. The XLA backend runs the
hypothesis cases (it compiles fastest on CPU); one case runs Triton in interpret mode.

Tolerances: relative error max |error| / max |reference| (``NAPKIN_MEASURE=1`` prints them), measured on random
cases at the sizes below: f32 ≤ 3.7e-7 for the output and ≤ 3.4e-7 for gradients, so 2e-6 (the suite's f32
bound); bf16 (the reference computes in f32 from the same bf16 inputs) ≤ 3.5e-3 for the output and ≤ 5.3e-3 for
gradients: the kernels round the product's operand ``x ⊙ g`` and the output to bf16 (2⁻⁸ ≈ 3.9e-3 of an element
each), and the backward also ``a = x ⊙ r ⊙ g`` and ``dA = dy·Wᵀ``, so 1.5e-2.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import references as R
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.errors import EvaluationError
from rewrites import RewriteError, factor_row_scale, pseudocode, stream, tile
from rewrites.testing import assert_equivalent, prove_equivalent

TOL = {"float32": 2e-6, "bfloat16": 1.5e-2}
EPS = 1e-6


def reference(x, g, w, eps=EPS):
    """The norm, then the product, in f32."""
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * g) @ w


def inputs(seed, lead, d, m, dtype):
    kx, kg, kw = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (*lead, d), jnp.float32).astype(dtype)
    g = 1 + 0.3 * jax.random.normal(kg, (d,), jnp.float32)
    w = (jax.random.normal(kw, (d, m), jnp.float32) / jnp.sqrt(d)).astype(dtype)
    return x, g, w


def check(seed, x, g, w, **options):
    """The output and the gradients of a random projection of it, against :func:`reference`."""
    tol = TOL[jnp.dtype(x.dtype).name]
    ct = jax.random.normal(jax.random.key(seed + 1), (*x.shape[:-1], w.shape[1]))

    def ours(x, g, w):
        return nc.rms_norm_linear(x, g, w, eps=EPS, **options)

    y = jax.jit(ours)(x, g, w)
    assert y.dtype == x.dtype and y.shape == ct.shape
    R.assert_close(y, reference(x, g, w), tol, seed, "y")
    R.assert_gradients_close(ours, reference, (x, g, w), ct, tol, seed, ("dx", "dg", "dw"))


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 70),
    m=st.integers(1, 70),
    d=st.sampled_from([40]),
    batched=st.booleans(),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_against_the_reference_at_ragged_sizes(n, m, d, batched, dtype, seed):
    lead = (2, n) if batched else (n,)
    check(seed, *inputs(seed, lead, d, m, dtype), backend="xla")


def test_triton_interpreted(seed):
    # the docs' example's sizes (its kernels are made once for both): tokens and outputs ragged against the blocks
    x, g, w = inputs(seed, (2, 24), 64, 96, "bfloat16")
    check(seed, x, g, w, backend="auto")
    made = nc.rms_norm_linear.kernel_for(x, g, w)
    assert set(made.backends.values()) == {"triton"} and made.differentiation.startswith("lowered")


def test_the_rule_moves_the_row_scaling_after_the_product(seed):
    n, d, m = nc.axes("n d m")
    naive = nc.library.rms_norm_linear(n, d, m, dtype="bf16")
    fused = factor_row_scale(d)(naive)
    assert_equivalent(naive, fused, examples=2, seed=seed)
    assert_equivalent(naive, stream(d, 16)(tile(m, 16)(tile(n, 16)(fused))), examples=2, seed=seed)
    # one pass over d: Σ_d x² and the product accumulate side by side, the scaling after the loop
    loop = pseudocode(stream(d, 16)(tile(m, 16)(tile(n, 16)(fused)))).split("for d₀")[1]
    body, after = loop.split("acc_S[n,m] +=")[0], loop.split("acc_S[n,m] +=")[1]
    assert "acc_Z[n] = acc_Z[n] + Σ_d" in body and "rsqrt" in after
    with pytest.raises(RewriteError, match=r"^stream\(d, 16\): box 'multiply', axis 'd': it needs both a chunk of d"):
        stream(d, 16)(naive)  # unfactored, the norm needs the whole row first


def test_the_rule_is_proved_symbolically():
    n, d, m = nc.axes("n d m")
    naive = nc.library.rms_norm_linear(n, d, m)  # f32: no cast between the scaling and the product, so exact
    assert prove_equivalent(naive, factor_row_scale(d)(naive), sizes={"n": 1, "d": 3, "m": 2}).identities == 2


def test_the_rule_refuses_what_it_cannot_factor():
    n, d, m = nc.axes("n d m")
    with pytest.raises(RewriteError, match=r"^factor_row_scale\(d\): axis 'd': no product with an array lacking d"):
        factor_row_scale(d)(nc.library.matmul(n, d, m))


@pytest.mark.parametrize(
    "args, message",
    [
        ((jnp.ones((4, 32)), jnp.ones(32), jnp.ones((16, 8))), "x's hidden dim 32, g's 32 and w's first 16"),
        ((jnp.ones((4, 32)), jnp.ones(32), jnp.ones((32, 8), jnp.bfloat16)), "share one dtype"),
        ((jnp.ones((4, 32)), jnp.ones((1, 32)), jnp.ones((32, 8))), r"g \[d\]"),
        ((jnp.ones((4, 32)), jnp.ones(32, jnp.int32), jnp.ones((32, 8))), "g must be floating point"),
        ((jnp.ones((4, 8)), jnp.ones(8), jnp.ones((8, 8))), "below 16"),
        ((jnp.ones((0, 32)), jnp.ones(32), jnp.ones((32, 8))), "empty axis"),
        (([[1.0] * 32], jnp.ones(32), jnp.ones((32, 8))), "x must be an array"),
    ],
)
def test_bad_arguments_are_refused_before_anything_is_built(args, message):
    with pytest.raises(EvaluationError, match=message):
        nc.rms_norm_linear(*args)


def test_bad_options_are_refused():
    x, g, w = jnp.ones((4, 32)), jnp.ones(32), jnp.ones((32, 8))
    with pytest.raises(EvaluationError, match="eps must be > 0"):
        nc.rms_norm_linear(x, g, w, eps=0.0)
    with pytest.raises(EvaluationError, match="backend must be 'auto' or one of"):
        nc.rms_norm_linear(x, g, w, backend="cuda")


def test_the_docs_example_runs():
    doc = (Path(__file__).parents[1] / "docs" / "rms_norm_linear.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", doc, re.S):
        exec(compile(block, "docs/rms_norm_linear.md", "exec"), {})
