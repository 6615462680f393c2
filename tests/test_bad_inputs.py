"""Bad inputs get a typed NapkinError naming what is wrong, before anything is allocated; and the
decided behaviour on non-finite inputs (``lowering._api``'s docstring) holds.

Rewrite arguments (``tile``/``stream``) and ``derive``'s size guards are tested with the rewrites.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import napkin_cat as nc
from lowering import Config, NotLowerable, lower
from napkin_cat.hardware import H100
from rewrites import derive, stream, tile


def rand(key, *shapes):
    return [
        jax.random.normal(k, s, jnp.float32) for k, s in zip(jax.random.split(key, len(shapes)), shapes, strict=True)
    ]


def flash(attn, q, x, g=16, s=16):
    return lower(derive(attn, tile(q, g), stream(x, s), verify=False))


# --- sizes -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [2.5, -3.0, 64.0, -3, 0, True, "x y"])
def test_axis_size_must_be_a_positive_integer(size):
    with pytest.raises(nc.AxisError, match=re.escape("axis 'b': size must be a positive integer")):
        nc.Axis("b", size)


def test_axis_sizes_that_are_integers_of_any_kind_are_accepted():
    assert nc.Axis("b", np.int64(16)).size == 16
    assert nc.axes("n d", d=64)[1].size == 64


@pytest.mark.parametrize("bad", [-5, 0, 2.5])
def test_cost_number_refuses_non_positive_sizes(bad):
    m = nc.cost(nc.library.matmul(*nc.axes("a b c"), dtype=nc.bf16), H100)
    with pytest.raises(nc.CostError, match=re.escape(f"time: size a = {bad!r} must be a positive integer")):
        m.number("time", a=bad, b=64, c=64)


def test_empty_arrays_are_refused_naming_the_axis(key):
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    Q, K, V = rand(key, (8, 16), (8, 16), (8, 16))
    empty = jnp.zeros((0, 16))
    message = r"input 1 \(x(~16)?×d:f32@HBM\): axis 'x' is empty \(size 0\); axis sizes must be positive"
    with pytest.raises(nc.EvaluationError, match=message):
        nc.to_jax(attn)(Q, empty, V[:0])
    with pytest.raises(nc.EvaluationError, match=message):
        flash(attn, q, x)(Q, empty, V[:0])


# --- the lowering's configuration and guards -------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(num_stages=-1), "num_stages must be an integer ≥ 1, got -1"),
        (dict(num_stages=0), "num_stages must be an integer ≥ 1, got 0"),
        (dict(num_stages=2.0), "num_stages must be an integer ≥ 1, got 2.0"),
        (dict(num_warps=3), "num_warps must be one of 1, 2, 4, 8, 16, 32, got 3"),
        (dict(num_warps=True), "num_warps must be one of 1, 2, 4, 8, 16, 32, got True"),
    ],
)
def test_invalid_config_is_refused_when_made(kw, message):
    with pytest.raises(NotLowerable, match=re.escape(f"Config: {message}")):
        Config(**kw)


def test_shared_memory_guard_runs_before_padding():
    """tile(q, 2**30) at q = 40 would pad Q to 2**30 rows (64 GiB); the guard refuses first, in bytes."""
    q, x, d = nc.axes("q x d")
    kernel = flash(nc.library.attention(q, x, d), q, x, g=2**30)
    # Q: one 2**30 × 16 f32 block; K, V: 3 stages (the default for big tiles) of 16 × 16 f32 chunks
    footprint = 2**30 * 16 * 4 + 2 * 3 * 16 * 16 * 4
    message = f"the kernel would hold {footprint:,} B of shared memory (resident blocks plus 3 stages of each chunk), "
    message += f"over the {H100.smem_per_block:,} B a block may use on H100"
    Q = jnp.ones((40, 16))
    with pytest.raises(NotLowerable, match=re.escape(message)):
        kernel(Q, Q, Q)


def test_hardware_by_name_or_refused():
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d)
    assert nc.cost(attn, "H100").subs(q=64, x=64, d=64).flops == nc.cost(attn, H100).subs(q=64, x=64, d=64).flops
    assert nc.cost(attn, "h200").hardware.name == "H200"
    with pytest.raises(nc.CostError, match=re.escape("unknown hardware 'B200'; known: A100, A100-40GB, H100, H200")):
        nc.cost(attn, "B200")
    with pytest.raises(nc.CostError, match="hardware must be a Hardware or one of the names A100, .*, got object"):
        nc.cost(attn, object())


def test_kernel_called_with_the_wrong_number_of_arrays(key):
    q, x, d = nc.axes("q x d")
    kernel = flash(nc.library.attention(q, x, d), q, x)
    Q, K = rand(key, (8, 16), (8, 16))
    message = re.escape("kernel q/16×d ⊗ x~16×d ⊗ x~16×d → q/16×d: expected 3 arrays, got 2")
    with pytest.raises(nc.EvaluationError, match=message):
        kernel(Q, K)
    with pytest.raises(nc.EvaluationError, match=message):  # before custom_vjp sees the call
        jax.grad(lambda Q: kernel(Q, K).sum())(Q)


def test_draw_to_an_unwritable_path():
    q, x, d = nc.axes("q x d")
    target = "/proc/napkin_cat_drawing.png"  # /proc takes no new files, even from root
    with pytest.raises(nc.NapkinError, match=re.escape(f"draw: cannot write {target!r}: ")) as info:
        nc.draw(nc.library.attention(q, x, d), target)
    assert info.type is nc.NapkinError and not isinstance(info.value.__cause__, nc.NapkinError)


# --- non-finite inputs: the decided behaviour ---------------------------------------------------------------


def test_fully_masked_rows_give_zero_where_jax_nn_gives_nan(key):
    n, xx = nc.axes("n xx", xx=16)
    sm = nc.library.softmax(n, xx)
    (S,) = rand(key, (32, 16))
    S = S.at[3].set(-jnp.inf)
    kernel = lower(derive(sm, tile(n, 16), verify=False))
    for out in (kernel(S), nc.to_jax(sm)(S)):
        assert bool(jnp.all(out[3] == 0))
        assert bool(jnp.allclose(jnp.delete(out, 3, 0), jax.nn.softmax(jnp.delete(S, 3, 0), -1), rtol=1e-6))
    assert bool(jnp.all(jnp.isnan(jax.nn.softmax(S, -1)[3])))


def test_nan_in_a_key_reaches_only_the_rows_that_see_it(key):
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d, causal=True)
    kernel = flash(attn, q, x)
    Q, K, V = rand(key, (48, 16), (48, 16), (48, 16))
    j = 37
    bad = K.at[j, 3].set(jnp.nan)
    clean = nc.to_jax(attn)(Q, K, V)
    for out in (kernel(Q, bad, V), nc.to_jax(attn)(Q, bad, V)):
        assert bool(jnp.all(jnp.isnan(out[j:]).any(axis=1)))  # rows j.. see key j
        np.testing.assert_allclose(out[:j], clean[:j], rtol=2e-6, atol=1e-6)  # rows before never see it


def test_nan_in_a_hidden_value_reaches_the_tiles_that_visit_its_chunk(key):
    """Reference and jax.nn: every row NaN (0 · NaN). Kernel: rows of the query tiles that visit the chunk of
    key j (tile g = 16, chunk s = 16: the tiles whose last query ≥ the chunk's start), finite elsewhere."""
    q, x, d = nc.axes("q x d")
    attn = nc.library.attention(q, x, d, causal=True)
    kernel = flash(attn, q, x)
    Q, K, V = rand(key, (64, 16), (64, 16), (64, 16))
    j = 37  # chunk [32, 48): visited by query tiles [32, 48) and [48, 64)
    bad = V.at[j, 3].set(jnp.nan)
    assert bool(jnp.all(jnp.isnan(nc.to_jax(attn)(Q, K, bad)).any(axis=1)))
    rows = jnp.isnan(kernel(Q, K, bad)).any(axis=1)
    assert bool(jnp.all(rows[32:])) and not bool(jnp.any(rows[:32]))
    np.testing.assert_allclose(kernel(Q, K, bad)[:32], nc.to_jax(attn)(Q, K, V)[:32], rtol=2e-6, atol=1e-6)
