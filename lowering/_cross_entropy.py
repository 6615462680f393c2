"""``linear_cross_entropy``: the loss of a classifier head without its logits (Cut Cross-Entropy, Wijmans et al.,
ICLR 2025).

``linear_cross_entropy(h, w, labels)`` is ``optax.softmax_cross_entropy_with_integer_labels(h @ w.T, labels)``
(reduced by ``reduction``) computed by kernels derived from the diagram
:func:`napkin_cat.library.linear_cross_entropy`: ``tile(n), stream(v)`` gives a forward whose logits live one
``[tile, chunk]`` block at a time, the log-sum-exp carried by the online softmax over the vocabulary (as
attention's over keys), and the derived backward (:mod:`lowering._backward`) recomputes each block of logits
from ``h``, ``w`` and the forward's log-sum-exp: on Triton ``dh`` in a kernel tiling tokens and streaming the
vocabulary, ``dw`` in one tiling the vocabulary and streaming tokens; on the XLA backend one kernel streaming the
vocabulary (:attr:`lowering.xla.XlaConfig.one_pass`), each chunk's logits recomputed once for ``dh``
(accumulated) and ``dw``'s slice (written per chunk). No ``[n, v]`` array is written, forward or backward (on the
XLA backend, no logit block over its budget: the whole ``[n, v]`` only where it fits within it).

The labels are compared with the vocabulary's index, an i32 input ``ids = arange(V)`` of the diagram (``4·V``
bytes) that the entry passes. A label equal to ``ignore_index`` (default ``-100``, as PyTorch) gives a loss of 0
and no gradient, and is left out of the mean; any other label outside ``[0, V)`` matches no class (its loss is the
log-sum-exp). Options, each a box of the diagram: ``z_loss`` adds ``z_loss·lse²`` (PaLM), ``label_smoothing``
``ε`` takes the targets ``(1 − ε)·one_hot + ε/V`` (as ``optax.smooth_labels``), ``softcap`` soft-caps the logits
``cap·tanh(x/cap)`` (Gemma 2) before everything else.

**Backends.** ``backend="auto"`` takes Triton (``lowering.lower``'s ``"auto"``: Mosaic where measured faster)
where its blocks, which hold the hidden dim ``d`` whole, fit the target's shared memory
(:func:`lowering._tiles.fit_blocks`), else the XLA backend (tiles vmapped, the vocabulary a ``lax.fori_loop``;
at ``d = 4096`` in 16-bit even 16 × 16 blocks exceed an H100's 227 KiB). The XLA backend's tiles all run at
once (one matmul over every token of a chunk), so its blocks are sized by memory, not shared memory:
:func:`xla_blocks` takes the largest chunk of classes whose f32 logit block stays within a budget (``budget=``,
by default :data:`XLA_BUDGET`), for the forward and the backward's one pass alike
(:class:`lowering.xla.XlaConfig`'s ``chunks``): a few large matmuls rather than thousands of small ones.
``kernel_for(...)`` states the backend, the blocks and why. Kernels are cached per :class:`Signature` (the dtype,
``d``, the options, the schedule): the token and vocabulary sizes stay symbolic, bound at each call (the XLA
backend's chunks, powers of two, are chosen from them).

>>> import jax, jax.numpy as jnp, optax
>>> h = jax.random.normal(jax.random.key(0), (40, 32))
>>> w = jax.random.normal(jax.random.key(1), (100, 32))
>>> labels = jax.random.randint(jax.random.key(2), (40,), 0, 100)
>>> loss = linear_cross_entropy(h, w, labels)
>>> want = optax.softmax_cross_entropy_with_integer_labels(h @ w.T, labels).mean()
>>> bool(jnp.allclose(loss, want, rtol=1e-5))
True
>>> dh, dw = jax.grad(linear_cross_entropy, argnums=(0, 1))(h, w, labels)
>>> dh.shape, dw.shape
((40, 32), (100, 32))
"""

from __future__ import annotations

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax.numpy as jnp

from lowering._api import Kernel, lower
from lowering._arguments import require_arrays, require_backend, require_nonempty, require_one_dtype
from lowering._plan import NotLowerable, next_pow2
from lowering._target import interpreted, target_hardware
from lowering._tiles import fit_blocks
from lowering.xla import XlaConfig
from napkin_cat import library
from napkin_cat.axes import Axis, axes
from napkin_cat.diagram import Diagram
from napkin_cat.dtypes import bf16, f16, f32
from napkin_cat.errors import EvaluationError
from napkin_cat.hardware import lookup
from rewrites import derive, stream, tile

#: the diagram's token and vocabulary axes, which the schedule tiles and streams
TOKENS, VOCAB = "n", "v"
#: the dtypes ``h`` and ``w`` may have (one for both), by ``jnp.dtype`` name
DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}
REDUCTIONS = ("mean", "sum", "none")
#: the blocks Triton starts from (tokens per tile, classes per chunk), halved until they fit shared memory
BLOCKS = (64, 64)
#: the XLA backend's bound on one f32 logit block, in bytes (:func:`xla_blocks`); XLA holds about two such blocks
#: at once (the logits, their cotangent in the inputs' dtype), beside the backward's f32 ``dh`` accumulator
XLA_BUDGET = 1 << 30
#: the XLA backend's token tile: its tiles are vmapped together, so the tile only sets the tokens' padding
XLA_TILE = 128


def _floor_pow2(x: float) -> int:
    """The largest power of two ≤ ``x`` (1 below)."""
    return 1 << max(int(x).bit_length() - 1, 0)


def xla_blocks(n: int, v: int, budget: int = XLA_BUDGET) -> tuple[int, int]:
    """The XLA backend's blocks for ``n`` tokens and ``v`` classes: ``(tile, classes per chunk)``. The backend
    vmaps its tiles, so each step of a loop over chunks is one matmul over every token: the forward and the
    backward's one pass (``dh`` and ``dw``'s slice, the tokens kept whole) hold ``[n, chunk]`` f32 logits. The
    chunk is the largest power of two whose f32 block stays within ``budget`` bytes, between 16 and the
    vocabulary rounded up to a power of two (one chunk where it fits whole); the tile is :data:`XLA_TILE` (at most
    the tokens, rounded up), which sets only the padding.

    >>> xla_blocks(16384, 128256)  # Llama 3's vocabulary: 16 logit blocks of 1 GiB per pass
    (128, 16384)
    >>> xla_blocks(40, 100)  # one chunk
    (64, 128)
    >>> xla_blocks(16384, 128256, budget=1 << 20)  # a small budget: the smallest chunks
    (128, 16)
    """
    tile = min(XLA_TILE, max(16, next_pow2(n)))
    rows = -(-n // tile) * tile  # the tokens, padded to whole tiles
    return tile, min(max(16, _floor_pow2(budget / (4 * rows))), max(16, next_pow2(v)))


@dataclass(frozen=True)
class Signature:
    """What a kernel depends on, and so the cache's key: the dtype, the hidden dim, the options, the backend,
    the blocks (tokens per tile, classes per chunk) Triton starts from, and where the XLA backend may run it, its
    blocks (``xla``: :func:`xla_blocks`' tile and classes per chunk) and the ``budget`` they were
    chosen for (None where ``blocks=`` gave them).

    >>> s = Signature("bfloat16", 64, -100, 0.0, 0.0, None, "triton", None, 64, 64)
    >>> [w.describe() for w in s.diagram().dom.inside]
    ['n×d:bf16@HBM', 'v×d:bf16@HBM', 'n:i32@HBM', 'v:i32@HBM']
    """

    dtype: str
    dim: int
    ignore_index: int | None
    z_loss: float
    label_smoothing: float
    softcap: float | None
    backend: str
    interpret: bool | None
    tile: int
    stream: int
    hardware: str | None = None
    xla: tuple[int, int] | None = None
    budget: int | None = None

    def diagram(self) -> Diagram:
        """The loss's diagram (:func:`napkin_cat.library.linear_cross_entropy`), tokens and vocabulary symbolic."""
        n, v = axes(f"{TOKENS} {VOCAB}")
        return library.linear_cross_entropy(
            n,
            Axis("d", self.dim),
            v,
            dtype=DTYPES[self.dtype],
            ignore_index=self.ignore_index,
            z_loss=self.z_loss,
            label_smoothing=self.label_smoothing,
            softcap=self.softcap,
        )


@dataclass(frozen=True)
class LossKernel:
    """A cached kernel of the entry: its :class:`Signature`, the lowered :class:`~lowering.Kernel` (``kernel``,
    which states its backends and differentiation), where ``backend="auto"`` passed Triton over, why, and the
    blocks its kernels run and why (``blocks``).

    >>> h, w, y = jnp.ones((4, 16)), jnp.ones((8, 16)), jnp.zeros(4, jnp.int32)
    >>> made = linear_cross_entropy.kernel_for(h, w, y)
    >>> made.kernel.backend, made.kernel.differentiation, made.passed_over
    ('triton', 'lowered', None)
    >>> print(linear_cross_entropy.kernel_for(h, w, y, backend="xla").blocks)  # doctest: +NORMALIZE_WHITESPACE
    XLA: tokens in tiles of 16 (vmapped: one matmul over every token); classes in chunks of 16 (the forward,
    and the backward's one pass for dh and dw): the largest power of two whose f32 logit block [n, 16] fits the
    budget of 1,073,741,824 B, at most the axis (xla_blocks)
    """

    signature: Signature
    kernel: Kernel
    passed_over: str | None = None
    blocks: str = ""


@functools.lru_cache(maxsize=64)
def _made(sig: Signature) -> LossKernel:
    """Derive (verified) and lower the kernel of ``sig``: Triton's blocks fitted to the target's shared memory
    where they fit, else (``"auto"``, or asked) the XLA backend's (``sig.xla``), its backward's chunks passed
    as an :class:`~lowering.xla.XlaConfig`."""
    diagram, why, config = sig.diagram(), None, None
    backend, (t, s) = sig.backend, (sig.tile, sig.stream)
    if backend in ("auto", "triton", "mosaic"):
        hw = target_hardware(interpreted(sig.interpret)) if sig.hardware is None else lookup(sig.hardware)
        try:
            (t_rule, s_rule), _ = fit_blocks(diagram, [TOKENS], [VOCAB], t, s, hw, None)
            t, s = int(t_rule.g), int(s_rule.s)
        except NotLowerable as e:
            if backend != "auto":
                raise
            backend, why = "xla", f"Triton refused: {e}"
        if backend != "xla" and sig.xla is not None:  # Triton's kernel depends on no size: cached without them
            return _made(dataclasses.replace(sig, xla=None, budget=None))
    said = f"{backend}: {t} tokens per tile, {s} classes per chunk (fitted to shared memory)"
    if backend == "xla":
        t, s = sig.xla
        config = XlaConfig(chunks=((VOCAB, s),), one_pass=True)
        said = _xla_said(sig)
    # verified at a hidden dim of at most 64 (the rules do not touch it), in a thread of its own, where no
    # caller's jit/grad trace is active (JAX's trace state is per thread): the check runs on concrete arrays
    rules = (tile(TOKENS, t), stream(VOCAB, s))
    sizes = _verified_at(t, s, sig.dim) if backend == "xla" else {"d": min(sig.dim, 64)}
    with ThreadPoolExecutor(1) as worker:
        derivation = worker.submit(derive, diagram, *rules, sizes=sizes).result()
    kernel = lower(derivation, backend=backend, interpret=sig.interpret, config=config)
    return LossKernel(sig, kernel, why, said)


#: the most elements a wire may hold when the XLA backend's large blocks are verified
VERIFY_ELEMENTS = 1 << 20


def _verified_at(t: int, s: int, dim: int) -> dict[str, int]:
    """Sizes to verify a schedule of large blocks at (the XLA backend's): two chunks of classes, the last ragged,
    and the tokens and hidden dim halved from two tiles (the last ragged) and 64 until no wire holds more than
    :data:`VERIFY_ELEMENTS` (a single ragged tile where the chunk is wide).

    >>> _verified_at(16, 16, 4096), _verified_at(128, 131072, 4096)
    ({'n': 17, 'v': 25, 'd': 64}, {'n': 4, 'v': 196609, 'd': 4})
    """
    v, n, d = s + s // 2 + 1, t + 1, min(dim, 64)
    while v * d > VERIFY_ELEMENTS and d > 1:
        d //= 2
    while v * n > VERIFY_ELEMENTS and n > 1:
        n //= 2
    return {TOKENS: n, VOCAB: v, "d": d}


def _xla_said(sig: Signature) -> str:
    """The XLA backend's blocks of ``sig``, and why: given, or :func:`xla_blocks`' rule."""
    t, s = sig.xla
    said = (
        f"XLA: tokens in tiles of {t} (vmapped: one matmul over every token); classes in chunks of {s} "
        "(the forward, and the backward's one pass for dh and dw)"
    )
    if sig.budget is None:
        return said + ": given (blocks=)"
    return said + (
        f": the largest power of two whose f32 logit block [n, {s}] fits the budget of {sig.budget:,} B, at most "
        "the axis (xla_blocks)"
    )


def _check(h, w, labels, reduction, z_loss, label_smoothing, softcap, backend) -> None:
    """Refuse bad arguments before anything is built, naming the argument, what it is and what it should be."""
    require_arrays("linear_cross_entropy", h=h, w=w, labels=labels)
    if h.ndim < 2 or w.ndim != 2:
        raise EvaluationError(
            f"linear_cross_entropy: h must be [..., n, d] and w [v, d], got h {tuple(h.shape)} and w {tuple(w.shape)}"
        )
    if h.shape[-1] != w.shape[1]:
        raise EvaluationError(
            f"linear_cross_entropy: h's hidden dim {h.shape[-1]} differs from w's {w.shape[1]} (w is [v, d], the "
            "classifier as an embedding table; pass w.T if yours is [d, v])"
        )
    if tuple(labels.shape) != tuple(h.shape[:-1]):
        raise EvaluationError(
            f"linear_cross_entropy: labels {tuple(labels.shape)} must have h's leading shape {tuple(h.shape[:-1])} "
            "(one integer class per token)"
        )
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise EvaluationError(
            f"linear_cross_entropy: labels must be integers (class indices), got {jnp.dtype(labels.dtype).name}; "
            "for one-hot or soft targets use optax.softmax_cross_entropy"
        )
    require_one_dtype("linear_cross_entropy", DTYPES, h=h, w=w)
    require_nonempty("linear_cross_entropy", h=h, w=w)
    if reduction not in REDUCTIONS:
        raise EvaluationError(f"linear_cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing < 1.0:
        raise EvaluationError(f"linear_cross_entropy: label_smoothing must lie in [0, 1), got {label_smoothing}")
    if z_loss < 0:
        raise EvaluationError(f"linear_cross_entropy: z_loss must be ≥ 0, got {z_loss}")
    if softcap is not None and not softcap > 0:
        raise EvaluationError(f"linear_cross_entropy: softcap must be > 0 (or None), got {softcap}")
    require_backend("linear_cross_entropy", backend)


class LinearCrossEntropy:
    """The entry (one instance: :data:`linear_cross_entropy`); see the module.

    ``linear_cross_entropy(h, w, labels, *, reduction="mean", ignore_index=-100, z_loss=0.0,
    label_smoothing=0.0, softcap=None, backend="auto", interpret=None, hardware=None, blocks=None, budget=None)``

    ``h`` is ``[..., d]`` (tokens, any leading shape), ``w`` ``[v, d]`` (the classifier, or a tied embedding
    table), ``labels`` integers of ``h``'s leading shape; ``h`` and ``w`` share a dtype (f32, bf16, f16; the
    logits are accumulated in f32). Returns the mean over the tokens not ignored (NaN where every token is, as
    PyTorch), the sum, or (``"none"``) the per-token loss of ``labels``' shape, in f32. Differentiable in ``h``
    and ``w`` (``jax.grad``), jit-able. ``blocks=(tile, chunk)`` sets the tokens per tile and classes per chunk
    (powers of two ≥ 16; by default Triton's :data:`BLOCKS`, halved to fit shared memory); on the XLA backend
    also the backward's (one pass over classes in chunks of ``chunk``), else chosen by :func:`xla_blocks` within
    ``budget`` bytes per f32 logit block (:data:`XLA_BUDGET`).

    >>> h, w = jnp.ones((2, 3, 16), jnp.bfloat16), jnp.ones((50, 16), jnp.bfloat16)
    >>> labels = jnp.array([[1, 2, -100], [4, 5, 6]])
    >>> loss = linear_cross_entropy(h, w, labels, reduction="none")
    >>> loss.shape, loss.dtype, [round(float(x), 3) for x in loss[0]]
    ((2, 3), dtype('float32'), [3.912, 3.912, 0.0])
    >>> linear_cross_entropy(h, w, labels.astype(jnp.float32))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: linear_cross_entropy: labels must be integers (class indices), got float32; \
for one-hot or soft targets use optax.softmax_cross_entropy
    """

    def signature(
        self,
        h,
        w,
        labels,
        *,
        reduction: str = "mean",
        ignore_index: int | None = -100,
        z_loss: float = 0.0,
        label_smoothing: float = 0.0,
        softcap: float | None = None,
        backend: str = "auto",
        interpret: bool | None = None,
        hardware: str | None = None,
        blocks: tuple[int, int] | None = None,
        budget: int | None = None,
    ) -> Signature:
        """The :class:`Signature` of a call, its arguments checked.

        >>> linear_cross_entropy.signature(jnp.ones((4, 16)), jnp.ones((8, 16)), jnp.zeros(4, int)).stream
        16
        """
        _check(h, w, labels, reduction, z_loss, label_smoothing, softcap, backend)
        if budget is not None and (type(budget) is not int or budget < 1):
            raise EvaluationError(f"linear_cross_entropy: budget must be a positive int (bytes), got {budget!r}")
        if blocks is not None and budget is not None:
            raise EvaluationError("linear_cross_entropy: pass blocks= or budget=, not both (blocks= sets every chunk)")
        n = 1
        for size in h.shape[:-1]:
            n *= size
        t, s = blocks or BLOCKS
        if blocks is None:  # never more than the sizes need
            t, s = min(t, max(16, next_pow2(n))), min(s, max(16, next_pow2(w.shape[0])))
        xla = None
        if backend in ("triton", "mosaic"):  # no XLA kernel: the budget bounds nothing
            budget = None
        elif blocks:  # the XLA backend's blocks given: its backward's too
            xla = (int(t), int(s))
        else:
            budget = budget or XLA_BUDGET
            xla = xla_blocks(n, w.shape[0], budget)
        return Signature(
            jnp.dtype(h.dtype).name,
            int(w.shape[1]),
            None if ignore_index is None else int(ignore_index),
            float(z_loss),
            float(label_smoothing),
            None if softcap is None else float(softcap),
            backend,
            interpret,
            int(t),
            int(s),
            None if hardware is None else str(getattr(hardware, "name", hardware)),
            xla,
            budget,
        )

    def kernel_for(self, h, w, labels, **options) -> LossKernel:
        """The cached :class:`LossKernel` a call with these arguments runs (derived and lowered on first use)."""
        options.pop("reduction", None)
        return _made(self.signature(h, w, labels, **options))

    def __call__(self, h, w, labels, *, reduction: str = "mean", **options):
        made = _made(self.signature(h, w, labels, reduction=reduction, **options))
        lead = labels.shape
        flat = labels.reshape(-1).astype(jnp.int32)
        ids = jnp.arange(w.shape[0], dtype=jnp.int32)
        loss = made.kernel(h.reshape(-1, h.shape[-1]), w, flat, ids)
        if reduction == "none":
            return loss.reshape(lead)
        if reduction == "sum":
            return jnp.sum(loss)
        ignore = made.signature.ignore_index
        count = flat.size if ignore is None else jnp.sum(flat != ignore)
        return jnp.sum(loss) / count

    def cache_clear(self) -> None:
        """Forget every kernel made."""
        _made.cache_clear()


#: the entry: ``linear_cross_entropy(h, w, labels, ...)`` (:class:`LinearCrossEntropy`)
linear_cross_entropy = LinearCrossEntropy()
