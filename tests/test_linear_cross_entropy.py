"""``nc.linear_cross_entropy`` (lowering._cross_entropy) against optax on ``h @ w.T`` written here, and z-loss,
label smoothing, soft-capping and ignored tokens written by hand in jax.numpy: the loss and its gradients in h
and w, f32 and bf16, ragged sizes (the vocabulary not a multiple of the chunk), and no ``[n, v]`` buffer in the
compiled forward or backward. The XLA backend runs most cases (it compiles fastest on CPU), at its default
blocks (at these sizes one chunk each way, within the budget) and at its smallest (a budget of one byte); one
case runs Triton in interpret mode.

Tolerances: relative error max |error| / max |reference| (``NAPKIN_MEASURE=1`` prints them), measured on one
run's random cases at the sizes below: f32 ≤ 2.3e-7 for the loss and ≤ 2.7e-7 for gradients, so 2e-6 (the
suite's f32 bound); bf16 (the reference computes in f32 from the same bf16 inputs) ≤ 1.4e-7 for the loss, so
2e-6, and ≤ 3.0e-4 for gradients, which both sides round to bf16: one rounding that differs at the largest
element is 2⁻⁸ ≈ 3.9e-3 of it, so 8e-3 (two such).
"""

import os

import jax
import jax.numpy as jnp
import optax
import pytest
import references as R
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import napkin_cat as nc
from napkin_cat.errors import EvaluationError

TOL = {"float32": (2e-6, 2e-6), "bfloat16": (2e-6, 8e-3)}  # (loss, gradients)
IGNORE = -100


def reference(h, w, labels, *, z_loss=0.0, label_smoothing=0.0, softcap=None, ignore_index=IGNORE):
    """The per-token loss from the whole ``[n, v]`` logits, in f32: optax's cross-entropy plus the options."""
    x = h.astype(jnp.float32) @ w.astype(jnp.float32).T
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    ignored = labels == ignore_index
    safe = jnp.where(ignored, 0, labels)
    if label_smoothing:
        targets = optax.smooth_labels(jax.nn.one_hot(safe, w.shape[0]), label_smoothing)
        loss = optax.softmax_cross_entropy(x, targets)
    else:
        loss = optax.softmax_cross_entropy_with_integer_labels(x, safe)
    loss = loss + z_loss * jax.nn.logsumexp(x, axis=-1) ** 2
    return jnp.where(ignored, 0.0, loss)


def inputs(seed, n, d, v, dtype, ignored=0):
    kh, kw, ky = jax.random.split(jax.random.key(seed), 3)
    h = jax.random.normal(kh, (n, d), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (v, d), jnp.float32).astype(dtype) / jnp.sqrt(d).astype(dtype)
    labels = jax.random.randint(ky, (n,), 0, v).at[:ignored].set(IGNORE)
    return h, w, labels


def check(seed, h, w, labels, *, backend="xla", blocks=None, budget=None, **options):
    """The per-token loss and the gradients of a random projection of it, against :func:`reference`."""
    loss_tol, grad_tol = TOL[jnp.dtype(h.dtype).name]
    ct = jax.random.normal(jax.random.key(seed + 1), labels.shape)
    chunks = dict(blocks=blocks, budget=budget)

    def ours(h, w):
        return nc.linear_cross_entropy(h, w, labels, reduction="none", backend=backend, **chunks, **options)

    def theirs(h, w):
        return reference(h, w, labels, **options)

    R.assert_close(jax.jit(ours)(h, w), jax.jit(theirs)(h, w), loss_tol, seed, "loss")
    R.assert_gradients_close(ours, theirs, (h, w), ct, grad_tol, seed, ("dh", "dw"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plain_loss_and_gradients(seed, dtype):
    check(seed, *inputs(seed, 40, 32, 100, jnp.dtype(dtype)))


def test_every_option(seed):
    """z-loss, label smoothing, soft-capped logits and ignored tokens at once."""
    h, w, labels = inputs(seed, 37, 16, 90, jnp.float32, ignored=5)
    check(seed, h, w, labels, z_loss=1e-3, label_smoothing=0.1, softcap=2.0, ignore_index=IGNORE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_xla_chunks_forced_small(seed, dtype):
    """A budget of one byte: the XLA backend's smallest chunks (16 classes in the forward and the backward's
    one pass), several of them, the last ragged; every option at once."""
    h, w, labels = inputs(seed, 37, 16, 90, jnp.dtype(dtype), ignored=5)
    options = dict(z_loss=1e-3, label_smoothing=0.1, softcap=2.0)
    made = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla", budget=1, **options)
    assert made.signature.xla == (64, 16)
    check(seed, h, w, labels, budget=1, **options)


def test_xla_chunks_follow_the_budget():
    """The rule (lowering._cross_entropy.xla_blocks) reaches every kernel: at n = 512, v = 4096 and a budget of
    1 MiB, classes stream in chunks of 2^20 / (4·512) = 512 (the forward, with and without residuals, and the
    backward's one pass; no Σ_v kernel: an ignored label's derivative reads no loss), and no kernel streams
    tokens; the kernel states them and why. Given blocks are kept as given, in the backward too."""
    h, w, labels = jnp.ones((512, 16)), jnp.ones((4096, 16)), jnp.zeros(512, jnp.int32)
    made = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla", budget=1 << 20)
    source = made.kernel.source
    assert source.count("chunks of v (size 512,") == 3 and "chunks of n" not in source, source
    assert "classes in chunks of 512 (the forward, and the backward's one pass for dh and dw)" in made.blocks
    assert "budget of 1,048,576 B" in made.blocks
    given = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla", blocks=(32, 128))
    assert given.kernel.source.count("chunks of v (size 128,") == 3 and "chunks of n" not in given.kernel.source
    assert given.blocks.endswith("given (blocks=)")


@pytest.mark.parametrize("options", [{}, {"z_loss": 1e-3, "label_smoothing": 0.1, "softcap": 2.0}])
def test_xla_backward_is_one_pass_per_chunk(options):
    """On the XLA backend the backward is one kernel (lowering._backward.one_pass_groups): it streams the
    vocabulary, tiles nothing, accumulates dh and writes dw's slice per chunk, so each chunk's logits are
    recomputed once (four matmuls in all with the forward's, not five). On Triton dh and dw keep a kernel each."""
    h, w, labels = jnp.ones((64, 16)), jnp.ones((300, 16)), jnp.zeros(64, jnp.int32)
    made = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla", blocks=(16, 64), **options)
    backward = [k for k in made.kernel.backends if k.startswith("backward kernel")]
    assert backward == ["backward kernel d(input 0), d(input 1) (stream(v, 64))"], made.kernel.backends
    source = made.kernel.source.split("\n\n")[-1]
    assert "vmap over: nothing" in source and "v~64×d:f32@HBM), a slice written per chunk" in source, source
    triton = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="triton", interpret=True, **options)
    assert [k.split(" (")[0] for k in triton.kernel.backends if k.startswith("backward kernel")] == [
        "backward kernel d(input 0)",
        "backward kernel d(input 1)",
    ]


def test_triton_interpret(seed):
    check(seed, *inputs(seed, 37, 16, 70, jnp.float32, ignored=3), backend="triton")


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 70), d=st.sampled_from([16, 32]), v=st.integers(2, 300), seed=st.integers(0, 2**31 - 1))
def test_ragged_sizes(n, d, v, seed):
    """Sizes no block divides (the vocabulary padded in its last chunk, the tokens in their last tile); blocks
    given, so that the examples share their kernels."""
    check(seed, *inputs(seed, n, d, v, jnp.float32, ignored=n // 5), blocks=(16, 64))


def test_reductions_and_leading_shape(seed):
    h, w, labels = inputs(seed, 24, 16, 50, jnp.float32, ignored=4)
    h3, labels3 = h.reshape(2, 12, 16), labels.reshape(2, 12)
    per = reference(h, w, labels)
    kept = jnp.sum(labels != IGNORE)
    none = nc.linear_cross_entropy(h3, w, labels3, reduction="none", backend="xla")
    assert none.shape == (2, 12)
    R.assert_close(none.reshape(-1), per, TOL["float32"][0], seed, "none")
    total = nc.linear_cross_entropy(h3, w, labels3, reduction="sum", backend="xla")
    R.assert_close(total, per.sum(), 2e-6, seed, "sum")
    R.assert_close(nc.linear_cross_entropy(h3, w, labels3, backend="xla"), per.sum() / kept, 2e-6, seed, "mean")


def test_no_logits_buffer_forward_or_backward():
    """XLA's memory analysis of the compiled forward and forward+backward: temporaries far below the ``[n, v]``
    f32 logits, which the unfused reference holds (the check measures what it claims). The XLA backend vmaps its
    tiles, so its forward holds ``[n, chunk]`` blocks and its backward ``[chunk, v]`` ones (dW streams tokens)."""
    n, d, v = 1024, 16, 8192
    h, w, labels = inputs(0, n, d, v, jnp.float32)
    logits = n * v * 4

    def temp(f, *args):
        return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes

    def ours(h, w):
        return nc.linear_cross_entropy(h, w, labels, backend="xla", blocks=(64, 256))

    def theirs(h, w):
        return reference(h, w, labels).mean()

    grad = lambda f: jax.grad(f, argnums=(0, 1))  # noqa: E731
    assert temp(theirs, h, w) >= logits and temp(grad(theirs), h, w) >= logits
    forward, backward = temp(ours, h, w), temp(grad(ours), h, w)
    if os.environ.get("NAPKIN_MEASURE"):
        print(f"temporaries: forward {forward:,} B, forward+backward {backward:,} B, logits {logits:,} B")
    assert forward < logits / 8, f"forward temporaries {forward:,} B vs [n, v] logits {logits:,} B"
    assert backward < logits / 4, f"forward+backward temporaries {backward:,} B vs [n, v] logits {logits:,} B"
    # the default blocks, within a budget of 1/16 of the logits: measured 2.03× and 2.04× the budget (an f32
    # logit block and its cotangent at once), so 3×
    budget = logits // 16

    def budgeted(h, w):
        return nc.linear_cross_entropy(h, w, labels, backend="xla", budget=budget)

    for what, f in (("forward", budgeted), ("forward+backward", grad(budgeted))):
        used = temp(f, h, w)
        assert used <= 3 * budget, f"{what} temporaries {used:,} B over 3× the budget {budget:,} B"


def test_kernel_states_how_it_was_made():
    h, w, labels = inputs(0, 16, 16, 40, jnp.float32)
    made = nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla")
    assert (made.kernel.backend, made.kernel.differentiation, made.passed_over) == ("xla", "lowered", None)
    assert made is nc.linear_cross_entropy.kernel_for(h, w, labels, backend="xla")  # cached


def test_auto_takes_xla_where_triton_blocks_cannot_fit():
    """At d = 4096 in bf16 even 16 × 16 blocks overflow an H100's shared memory: "auto" lowers with XLA and says
    why; asking for Triton raises."""
    h, w, labels = jnp.ones((16, 4096), jnp.bfloat16), jnp.ones((32, 4096), jnp.bfloat16), jnp.zeros(16, jnp.int32)
    made = nc.linear_cross_entropy.kernel_for(h, w, labels, interpret=True)
    assert made.kernel.backend == "xla" and "shared memory" in made.passed_over
    with pytest.raises(nc.NapkinError, match="shared memory"):
        nc.linear_cross_entropy.kernel_for(h, w, labels, backend="triton", interpret=True)


@pytest.mark.parametrize(
    "args, options, message",
    [
        (((4, 16), (8, 8), (4,)), {}, "hidden dim 16 differs from w's 8"),
        (((4, 16), (8, 16), (5,)), {}, r"labels \(5,\) must have h's leading shape \(4,\)"),
        (((16,), (8, 16), ()), {}, r"h must be \[..., n, d\]"),
        (((4, 16), (8, 16), (4,)), {"reduction": "avg"}, "reduction must be one of"),
        (((4, 16), (8, 16), (4,)), {"label_smoothing": 1.0}, r"label_smoothing must lie in \[0, 1\)"),
        (((4, 16), (8, 16), (4,)), {"z_loss": -1.0}, "z_loss must be ≥ 0"),
        (((4, 16), (8, 16), (4,)), {"softcap": 0.0}, "softcap must be > 0"),
        (((4, 16), (8, 16), (4,)), {"backend": "cuda"}, "backend must be 'auto' or one of"),
        (((0, 16), (8, 16), (0,)), {}, "empty axis"),
        (((4, 16), (8, 16), (4,)), {"budget": 0}, "budget must be a positive int"),
        (((4, 16), (8, 16), (4,)), {"budget": 64, "blocks": (16, 16)}, "pass blocks= or budget=, not both"),
    ],
)
def test_bad_input_is_refused(args, options, message):
    h, w, labels = jnp.ones(args[0]), jnp.ones(args[1]), jnp.zeros(args[2], jnp.int32)
    with pytest.raises(EvaluationError, match=message):
        nc.linear_cross_entropy(h, w, labels, **options)


def test_bad_dtypes_are_refused():
    h, w = jnp.ones((4, 16)), jnp.ones((8, 16))
    with pytest.raises(EvaluationError, match="labels must be integers"):
        nc.linear_cross_entropy(h, w, jnp.zeros(4))
    with pytest.raises(EvaluationError, match="share one dtype"):
        nc.linear_cross_entropy(h, w.astype(jnp.bfloat16), jnp.zeros(4, jnp.int32))
    with pytest.raises(EvaluationError, match="share one dtype"):
        nc.linear_cross_entropy(h.astype(jnp.int32), w.astype(jnp.int32), jnp.zeros(4, jnp.int32))
