"""The backends behind one seam (``lowering._registry``): their order, what ``backend="auto"`` records of each it
passes over, a backend refusing a plan by name, and XLA as the recorded last resort."""

import re

import jax
import jax.numpy as jnp
import pytest

import napkin_cat as nc
from lowering import Config, NotLowerable, lower, plan
from lowering._registry import BACKENDS, REGISTRY, offer
from lowering.xla import XLA
from napkin_cat.diagram import Array, Ty
from napkin_cat.generators import Generator
from rewrites import derive, stream, tile
from tests.references import rel_err

CPU = "device 'cpu' (cpu) is not an sm_90 (Hopper) GPU"


class Product(Generator):
    """∏ along the last axis: a reduction with no neutral padding value declared, so Triton cannot pad it."""

    def evaluate(self, ins, ctx):
        return [jnp.prod(ins[0], axis=-1)]


def product(n, d):
    return Product(f"prod {d.name}", Ty(Array(n, d)), Ty(Array(n)))


def test_the_registry_is_ordered_as_auto_walks_it():
    assert [b.name for b in REGISTRY] == list(BACKENDS) == ["mosaic", "triton", "xla"]
    assert [b.config.__name__ for b in REGISTRY] == ["MosaicConfig", "TritonConfig", "XlaConfig"]


def test_an_unknown_backend_lists_the_registered_ones():
    q, x, d = nc.axes("q x d")
    flash = derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False)
    with pytest.raises(NotLowerable, match=re.escape("backend 'nope': choose 'auto' (Mosaic on sm_90")) as e:
        lower(flash, backend="nope")
    assert str(e.value).endswith("'mosaic', 'triton' or 'xla'")


def test_auto_records_why_it_passed_each_backend_over():
    q, x, d = nc.axes("q x d")
    kernel = lower(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False))
    assert kernel.backend == "triton" and kernel.refused["forward"] == CPU
    assert set(kernel.backends.values()) == {"triton"} and set(kernel.refused.values()) == {CPU}


def test_a_backend_refuses_a_plan_by_name_and_auto_falls_back_to_xla_saying_so(key):
    """A product along a whole axis of 24 (no power of two, no neutral value): Triton refuses it (by name, when
    asked for), ``"auto"`` takes XLA and records why, and the result is the product."""
    n, d = nc.Axis("n"), nc.Axis("d", 24)
    prod = derive(product(n, d), tile(n, 16), verify=False)
    why = "axis 'd' of size 24 is not a power of two ≥ 16, and a box combining elements along it has no neutral value"
    with pytest.raises(NotLowerable, match=re.escape(f"Triton, forward: {why}")):
        lower(prod, backend="triton")
    kernel = lower(prod)
    assert kernel.backend == "xla" and kernel.differentiation == "none"
    assert list(kernel.refused) == ["forward"]
    assert kernel.refused["forward"].startswith(
        f"{CPU}; Triton refused: {why} (sum, max, min, softmax, contraction), so it cannot be padded (pad_neutral: "
    )
    v = 1 + 0.1 * jax.random.normal(key, (40, 24))
    assert rel_err(kernel(v), jnp.prod(v, axis=-1)) <= 1e-6  # f32: the same product, in the same order


def test_a_backend_s_sizing_refusal_is_raised_not_passed_on():
    """Triton admits attention at d = 512 but its blocks do not fit shared memory: the schedule's error, raised
    with its fix, never a fall back to XLA."""
    q, x = nc.axes("q x")
    flash = derive(nc.library.attention(q, x, nc.Axis("d", 512)), tile(q, 128), stream(x, 64), verify=False)
    with pytest.raises(NotLowerable, match="choose smaller tiles or stream sizes"):
        lower(flash)


def test_offer_passes_a_config_only_to_its_backend():
    q, x, d = nc.axes("q x d")
    p = plan(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False).diagram)
    kernel, why = offer(XLA, p, interpret=None, config=Config(), hardware=None, backward=False)
    assert why is None and kernel.config == XLA.heuristic(p)
