"""Planted bugs: a pytest plugin that, with ``NAPKIN_MUTATION=<name>``, breaks the library on purpose.

``python -m pytest -p tests.mutations ...`` loads it; each mutation wraps a real function or method of
the library (so it survives refactors as long as the public names stay) and reproduces a bug that a
FlashAttention implementation could plausibly have. tests/test_mutations.py asserts that the tests fail
under each. A target that cannot be found raises :class:`MissingTarget`, which fails the run loudly: a
mutation that plants nothing must never count as caught.

>>> sorted(MUTATIONS)  # doctest: +NORMALIZE_WHITESPACE
['causal_off_by_one', 'gqa_group', 'masks_before_score_mod', 'mosaic_overwrites_accumulator', 'no_delta',
 'no_padding_mask', 'no_rescale', 'scale_ignored', 'score_mod_grad_at_output', 'temperature']
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys


class MissingTarget(RuntimeError):
    """The function or method a mutation wraps is not where the mutation looks for it."""


def find(name: str, *modules: str):
    """The object ``name`` from the first of ``modules`` that has it."""
    for module in modules:
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            continue
        if found is not None:
            return found
    raise MissingTarget(f"mutation target {name!r} not found in {', '.join(modules)}")


def method(cls, name: str):
    if name not in vars(cls):
        raise MissingTarget(f"mutation target {cls.__name__}.{name} is not defined on the class")
    return vars(cls)[name]


def rebind(old, new):
    """Replace ``old`` by ``new`` wherever a loaded module binds it by name (definitions and imports)."""
    hits = 0
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is old:
                setattr(module, attr, new)
                hits += 1
    if not hits:
        raise MissingTarget(f"no module binds {old!r}")


GENERATORS = ("napkin_cat.generators", "napkin_cat.accumulators")


def temperature():
    """Softmax temperature off by 0.1%: the scores enter every softmax (plain, fused and online) × 1.001,
    in the reference semantics and the kernels alike: only an independent reference can see it."""

    def scaled(fn):
        @functools.wraps(fn)
        def wrapper(self, *args):
            *head, ins, ctx = args
            return fn(self, *head, [ins[0] * 1.001, *ins[1:]], ctx)

        return wrapper

    for cls, names in [
        (find("Softmax", *GENERATORS), ("evaluate",)),
        (find("SoftmaxContract", *GENERATORS), ("evaluate",)),
        (find("OnlineSoftmax", *GENERATORS), ("partial", "step")),
    ]:
        for name in names:
            setattr(cls, name, scaled(method(cls, name)))


def no_rescale():
    """The online softmax forgets to rescale ``l`` and ``o`` by ``exp(m − m_new)`` when the running max grows."""
    cls = find("OnlineSoftmax", *GENERATORS)
    step = method(cls, "step")

    @functools.wraps(step)
    def wrapper(self, state, ins, ctx):
        m, total, o = state
        m_new, _, _ = step(self, state, ins, ctx)
        _, chunk_sum, chunk_out = step(self, (m_new, total * 0, o * 0), ins, ctx)  # this chunk alone, at m_new
        return m_new, total + chunk_sum, o + chunk_out

    cls.step = wrapper


def causal_off_by_one():
    """The causal mask lets each query see one key too many (``x ≤ q + 1``), everywhere."""
    cls = find("Causal", *GENERATORS)
    method(cls, "__call__")

    def leaky(self, **idx):
        return idx[self.x] <= idx[self.q] + 1

    cls.__call__ = leaky


def gqa_group():
    """Grouped-query attention reads key/value head ``h mod H_kv`` instead of ``h // G``: the kernel's block
    index for a wire lacking some grid (head) axes is taken from the flat head index, undivided by the group."""
    lowered = find("TritonLowered", "lowering.triton", "lowering")
    index_map = method(lowered, "_index_map")

    @functools.wraps(index_map)
    def wrapper(self, wire, padded, *rest):
        real = index_map(self, wire, padded, *rest)
        batch = self.plan.batch
        missing = [a for a in batch if not wire.has(a)]
        if not missing:
            return real
        group, nb = 1, len(self.plan.tiles)
        for a in missing:
            group *= padded[a]
        return lambda *ids: real(*ids[:nb], ids[nb] * group, *ids[nb + 1 :])

    lowered._index_map = wrapper


def scale_ignored():
    """``attention(scale=…)`` ignores the given scale and uses 1/√d."""
    scale = find("_scale", "napkin_cat.library")
    params = list(inspect.signature(scale).parameters)
    if params[:2] != ["d", "scale"]:
        raise MissingTarget(f"napkin_cat.library._scale takes {params}, not (d, scale)")

    @functools.wraps(scale)
    def wrapper(d, scale_=None):
        return scale(d, None)

    rebind(scale, wrapper)


def no_delta():
    """The backward drops Δ = rowsum(dO ⊙ O) from dS = P ⊙ (dP − Δ). The backward kernels read the saved
    output ``O`` only to form Δ (P is recomputed from the scores and the log-sum-exp), so Δ is dropped by
    handing them Δ = 0 (``attention_vjp``) or a zero ``O`` residual (``differentiable``)."""
    module = importlib.import_module("lowering._backward")
    if hasattr(module, "attention_vjp"):  # attention_vjp(forward, kernels, parts): kernels() = (fwd+L, dQ, dK·dV)
        vjp = module.attention_vjp

        def zero_delta(kernel):
            def run(*arrays):
                if len(arrays) != 6:
                    raise MissingTarget(f"a backward kernel took {len(arrays)} arrays, not (Q, K, V, dO, L, Δ)")
                return kernel(*arrays[:5], arrays[5] * 0)

            return run

        @functools.wraps(vjp)
        def wrapper(forward, kernels, p):
            def mutated():
                fwd, dq, dkv = kernels()
                return fwd, zero_delta(dq), zero_delta(dkv)

            return vjp(forward, mutated, p)

        rebind(vjp, wrapper)
        return
    # differentiable(primal, kernels, b, d): piece kernels read [*inputs, *cotangents, *residuals] at
    # piece.inputs; the residuals are (L, O) per softmax·contract, in turn.
    differentiable = find("differentiable", "lowering._backward")
    if list(inspect.signature(differentiable).parameters) != ["primal", "kernels", "b", "d"]:
        raise MissingTarget("lowering._backward.differentiable's signature changed: no known place for Δ")

    @functools.wraps(differentiable)
    def mutated_differentiable(primal, kernels, b, d):
        first_residual = len(d.dom) + len(d.cod)
        outputs = {first_residual + i for i in range(1, len(b.residuals), 2)}

        def zero_outputs(piece, kernel):
            def run(*arrays):
                return kernel(*(a * 0 if i in outputs else a for i, a in zip(piece.inputs, arrays, strict=True)))

            return run

        def mutated():
            fwd, *pieces = kernels()
            return (fwd, *(zero_outputs(p, k) for p, k in zip(b.pieces, pieces, strict=True)))

        return differentiable(primal, mutated, b, d)

    rebind(differentiable, mutated_differentiable)


def no_padding_mask():
    """Ragged sizes: the padding of the last chunk is not masked to the accumulator's neutral value."""
    mask_padding = find("mask_padding", "lowering._blocks")
    rebind(mask_padding, lambda v, *args, **kwargs: v)


def mosaic_overwrites_accumulator():
    """Mosaic GPU's ``o = δ·o + P·V`` (one wgmma on ``δ·o``) overwrites the accumulator instead of adding to it, so
    only the last chunk's ``P·V`` survives. The code is the Mosaic kernel body's alone (``Product.into``): Triton's
    kernels and the reference semantics are untouched, so only a Mosaic kernel (interpret mode on CPU) can see it."""
    product = find("Product", "lowering.mosaic._arrays")
    into = method(product, "into")

    @functools.wraps(into)
    def overwrite(self, acc):
        return into(self, None)

    product.into = overwrite


def score_mod_grad_at_output():
    """The backward differentiates a score modifier at its output instead of its input: ``fn'(fn(s))`` for
    ``fn'(s)``. Soft-capping's ``1 − tanh²(s/cap)`` goes wrong; additive modifiers (ALiBi, biases), whose derivative
    is 1, and every forward (which never calls the derivative) are untouched: only the backward kernels change."""
    cls = find("ScoreDerivative", "napkin_cat.generators", "napkin_cat.generators._index")
    call = method(cls, "__call__")

    @functools.wraps(call)
    def at_output(self, s, **indices):
        return call(self, self.fn(s, **indices), **indices)

    cls.__call__ = at_output


def masks_before_score_mod():
    """The masking order reversed: every mask sets its scores to −∞ before the score modifier runs, so a
    modifier that sends −∞ somewhere finite (a soft-cap, exp) gives masked keys weight."""
    cls = find("_Attention", "napkin_cat.library")
    scores = method(cls, "scores")

    def masked_first(self, *, score_mod=None, **kw):
        out = scores(self, **kw)
        if score_mod is None:
            return out
        from napkin_cat.diagram import id as identity
        from napkin_cat.generators import score_mod as modifier

        return out >> (modifier(self.S, score_mod) @ identity(self.V))

    cls.scores = masked_first


MUTATIONS = {
    f.__name__: f
    for f in (
        temperature,
        no_rescale,
        causal_off_by_one,
        gqa_group,
        scale_ignored,
        no_delta,
        no_padding_mask,
        mosaic_overwrites_accumulator,
        score_mod_grad_at_output,
        masks_before_score_mod,
    )
}


def pytest_configure(config):
    name = os.environ.get("NAPKIN_MUTATION")
    if not name:
        return
    if name not in MUTATIONS:
        raise MissingTarget(f"unknown mutation {name!r}; known: {', '.join(MUTATIONS)}")
    MUTATIONS[name]()
