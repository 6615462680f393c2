"""``rms_norm_linear``: an RMS norm fused into the projection after it (a Llama block's norm, then its qkv or
gate/up projection).

``rms_norm_linear(x, g, w)`` is ``(x * rsqrt(mean(x², -1) + eps) * g) @ w``, computed by kernels derived from the
diagram :func:`napkin_cat.library.rms_norm_linear`.

**Forward.** ``factor_row_scale(d)`` (:mod:`rewrites._factor`) moves the row scaling ``1/rms(x)[n]`` after the
contraction over ``d`` (``Σ_d (x ⊙ r ⊙ g)·W = r ⊙ Σ_d (x ⊙ g)·W``), and ``tile(n), tile(m), stream(d)`` then
derives one kernel: each program holds a ``[tile_n, tile_m]`` block of ``y``, streams ``d`` accumulating
``Σ_d x²`` and ``Σ_d (x ⊙ g)·W`` side by side, and scales by ``rsqrt(Σ_d x²/d + eps)`` at the end. The
normalised ``x`` is never written; every step of the derivation is verified.

**Backward.** The rule proves the fused diagram equal to the norm followed by the product, so its gradients are
those of that chain, each link lowered with its derived backward (:mod:`lowering._backward`):
``r = rsqrt(mean_d x² + eps)`` (``tile(n), stream(d)``), ``a = x ⊙ r ⊙ g`` (``tile(n), tile(d)``) and the
product's backward kernels (``dA = dy·Wᵀ``: ``tile(n), tile(d), stream(m)``; ``dW = aᵀ·dy``: ``tile(d), tile(m),
stream(n)``), whose forward is not run again. The backward recomputes ``r`` and ``a`` (one ``[n, d]`` write); ``dx``
adds the two links' cotangents (``r ⊙ g ⊙ dA`` and the statistic's ``−x·r³/d·Σ_d g ⊙ dA ⊙ x``), ``dg = Σ_n dA ⊙
x ⊙ r``. ``kernel_for(...)`` states each kernel's backend.

>>> import jax, jax.numpy as jnp
>>> x = jax.random.normal(jax.random.key(0), (40, 32))
>>> g = jax.random.normal(jax.random.key(1), (32,))
>>> w = jax.random.normal(jax.random.key(2), (32, 24))
>>> want = (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * g) @ w
>>> bool(jnp.allclose(rms_norm_linear(x, g, w), want, atol=1e-4))
True
>>> dx, dg, dw = jax.grad(lambda *a: rms_norm_linear(*a).sum(), argnums=(0, 1, 2))(x, g, w)
>>> dx.shape, dg.shape, dw.shape
((40, 32), (32,), (32, 24))
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from lowering._api import Kernel, lower
from lowering._arguments import require_arrays, require_backend, require_nonempty, require_one_dtype
from lowering._backward import Backward, backward_of, run_pieces
from lowering._plan import next_pow2
from lowering._target import interpreted, target_hardware
from lowering._tiles import fit_blocks
from napkin_cat import Tape, library
from napkin_cat import generators as g_
from napkin_cat.axes import Axis, axes
from napkin_cat.diagram import Array, Diagram
from napkin_cat.dtypes import bf16, f16, f32
from napkin_cat.errors import EvaluationError
from napkin_cat.hardware import lookup
from rewrites import derive, factor_row_scale, stream, tile

#: the diagram's token and output axes, which the schedule tiles, and its hidden axis, which it streams
TOKENS, OUT, DIM = "n", "m", "d"
#: the dtypes ``x`` and ``w`` may have (one for both), by ``jnp.dtype`` name
DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}
#: the blocks kernels start from (tile, chunk), halved by Triton's guards until they fit shared memory
BLOCKS = (128, 64)


@dataclass(frozen=True)
class Signature:
    """What the kernels depend on, and so the cache's key: the dtype, the hidden dim, ``eps``, the backend and
    the blocks (rows and columns per tile, hidden units per chunk).

    >>> s = Signature("bfloat16", 64, 1e-6, "triton", None, 64, 32)
    >>> [w.describe() for w in s.diagram().dom.inside]
    ['n×d:bf16@HBM', 'd:f32@HBM', 'd×m:bf16@HBM']
    """

    dtype: str
    dim: int
    eps: float
    backend: str
    interpret: bool | None
    tile: int
    stream: int
    hardware: str | None = None

    def diagram(self) -> Diagram:
        """The norm and projection's diagram (:func:`napkin_cat.library.rms_norm_linear`), ``n``, ``m`` symbolic."""
        n, m = axes(f"{TOKENS} {OUT}")
        return library.rms_norm_linear(n, Axis(DIM, self.dim), m, eps=self.eps, dtype=DTYPES[self.dtype])

    def chain(self) -> tuple[Diagram, Diagram, Diagram]:
        """The links the backward differentiates: the row statistic ``X → r``, the scaling ``X ⊗ r ⊗ γ → A`` and
        the product ``A ⊗ W → Y`` (the library's norm split at ``r``, then its matmul)."""
        n, m, d, dt = Axis(TOKENS), Axis(OUT), Axis(DIM, self.dim), DTYPES[self.dtype]
        t = Tape()
        x = t.input(Array(n, d, dtype=dt), "X")
        ss = t.contract([t.ew("square", t.cast(x, f32), out=Array(n, d))], Array(n))
        mean = t.ew("add", t.ew("multiply", ss, const=1 / d.size, out=Array(n)), const=self.eps, out=Array(n))
        statistic = t.diagram([t.ew("rsqrt", mean, out=Array(n))])
        t = Tape()
        x, r, gamma = t.input(Array(n, d, dtype=dt), "X"), t.input(Array(n), "r"), t.input(Array(d), "g")
        a = t.ew("multiply", t.ew("multiply", t.cast(x, f32), r, out=Array(n, d)), gamma, out=Array(n, d))
        scaling = t.diagram([t.cast(a, dt)])
        spec = f"{TOKENS} {DIM}, {DIM} {OUT} -> {TOKENS} {OUT}"
        product = g_.contract(spec, n, d, m, dtype=dt, out_dtype=f32) >> g_.cast(Array(n, m), dt)
        return statistic, scaling, product if dt != f32 else g_.contract(spec, n, d, m)


@dataclass(frozen=True)
class Made:
    """The kernels of one :class:`Signature`: the fused ``forward`` (a :class:`~lowering.Kernel`), and the
    backward's (:meth:`backward`, built when first differentiated).

    >>> x, w = jnp.ones((4, 16)), jnp.ones((16, 8))
    >>> made = rms_norm_linear.kernel_for(x, jnp.ones(16), w)
    >>> made.forward.backend, made.differentiation
    ('triton', 'lowered: the chain statistic → scaling → product, each link by its derived backward')
    """

    signature: Signature
    forward: Kernel
    rules: tuple

    differentiation = "lowered: the chain statistic → scaling → product, each link by its derived backward"

    @functools.cached_property
    def backward(self) -> tuple[Kernel, Kernel, Backward, tuple[Kernel, ...]]:
        """The statistic's and the scaling's kernels (differentiated by their derived backward), and the product's
        derived backward with its kernels (:func:`lowering._backward.backward_of`)."""
        sig = self.signature
        statistic, scaling, product = sig.chain()
        (t, s) = (int(self.rules[0].g), int(self.rules[-1].s))
        options = dict(backend=sig.backend, interpret=sig.interpret, hardware=sig.hardware)
        stat = lower(derive(statistic, tile(TOKENS, t), stream(DIM, s), verify=False), **options)
        scale = lower(derive(scaling, tile(TOKENS, t), tile(DIM, s), verify=False), **options)
        scheduled = derive(product, *self.rules, verify=False).diagram
        b = backward_of(scheduled, _hardware(sig))
        pieces = tuple(lower(p.scheduled, **options) for p in b.pieces)
        return stat, scale, b, pieces

    @property
    def backends(self) -> dict[str, str]:
        """The backend of each kernel by its role (the backward's built if need be)."""
        stat, scale, b, pieces = self.backward
        out = {"forward": self.forward.backend, "statistic": stat.backend, "scaling": scale.backend}
        for p, k in zip(b.pieces, pieces, strict=True):
            out[f"product d(input {', '.join(map(str, p.outputs))})"] = k.backend
        return out


def _hardware(sig: Signature):
    return target_hardware(interpreted(sig.interpret)) if sig.hardware is None else lookup(sig.hardware)


@functools.lru_cache(maxsize=64)
def _made(sig: Signature) -> Made:
    """Derive (verified) and lower the forward of ``sig``, its blocks fitted to the target's shared memory."""
    naive = sig.diagram()
    fused = factor_row_scale(DIM)(naive)
    rules = (tile(TOKENS, sig.tile), tile(OUT, sig.tile), stream(DIM, sig.stream))
    if sig.backend != "xla":
        rules, _ = fit_blocks(fused, [TOKENS, OUT], [DIM], sig.tile, sig.stream, _hardware(sig), None)
    # verified at a hidden dim of at most two chunks and a half (the stream's carry and its ragged end exercised),
    # in a thread of its own, where no caller's jit/grad trace is active (JAX's trace state is per thread): the
    # check runs on concrete arrays
    s = int(rules[-1].s)
    sizes = {DIM: min(sig.dim, 2 * s + s // 2)}
    with ThreadPoolExecutor(1) as worker:
        derivation = worker.submit(derive, naive, factor_row_scale(DIM), *rules, sizes=sizes).result()
    return Made(sig, lower(derivation, backend=sig.backend, interpret=sig.interpret, hardware=sig.hardware), rules)


def _check(x, g, w, eps, backend) -> None:
    """Refuse bad arguments before anything is built, naming the argument, what it is and what it should be."""
    require_arrays("rms_norm_linear", x=x, g=g, w=w)
    if x.ndim < 1 or g.ndim != 1 or w.ndim != 2:
        raise EvaluationError(
            f"rms_norm_linear: x must be [..., d], g [d] and w [d, m], got x {tuple(x.shape)}, g {tuple(g.shape)} "
            f"and w {tuple(w.shape)}"
        )
    if not x.shape[-1] == g.shape[0] == w.shape[0]:
        raise EvaluationError(
            f"rms_norm_linear: x's hidden dim {x.shape[-1]}, g's {g.shape[0]} and w's first {w.shape[0]} must agree "
            "(w is [d, m], as x @ w; pass w.T if yours is [m, d])"
        )
    require_one_dtype("rms_norm_linear", DTYPES, x=x, w=w)
    if not jnp.issubdtype(g.dtype, jnp.floating):
        raise EvaluationError(f"rms_norm_linear: g must be floating point, got {jnp.dtype(g.dtype).name}")
    require_nonempty("rms_norm_linear", x=x, w=w)  # g's length is x's last axis, checked above
    if x.shape[-1] < 16:
        raise EvaluationError(
            f"rms_norm_linear: the hidden dim d = {x.shape[-1]} is below 16, the smallest block the kernels tile it "
            "by; pad x, g and w with zeros along d to 16 (zeros change neither the norm's sum nor the product)"
        )
    if not eps > 0:
        raise EvaluationError(f"rms_norm_linear: eps must be > 0 (it keeps a zero row finite), got {eps}")
    require_backend("rms_norm_linear", backend)


@functools.lru_cache(maxsize=64)
def _differentiable(made: Made):
    """The forward kernel of ``made`` with a ``jax.custom_vjp`` running the chain's lowered backward (see the
    module)."""

    @jax.custom_vjp
    def f(x, g, w):
        return made.forward(x, g, w)

    def f_fwd(x, g, w):
        return made.forward(x, g, w), (x, g, w)

    def f_bwd(saved, dy):
        x, g, w = saved
        stat, scale, b, pieces = made.backward
        r, pull_r = jax.vjp(stat, x)
        a, pull_a = jax.vjp(scale, x, r, g)
        grads: list = [None, None]
        for piece, _, _, outs in run_pieces(b, pieces, [a, w, dy.astype(x.dtype)]):
            for i, out, summed in zip(piece.outputs, outs, piece.sums, strict=True):
                grads[i] = jnp.sum(out.astype(jnp.float32), axis=summed) if summed else out
        da, dw = grads
        dx_scaling, dr, dg = pull_a(da)
        (dx_statistic,) = pull_r(dr)
        dx = dx_scaling.astype(jnp.float32) + dx_statistic.astype(jnp.float32)
        return dx.astype(x.dtype), dg, dw.astype(w.dtype)

    f.defvjp(f_fwd, f_bwd)
    return f


class RmsNormLinear:
    """The entry (one instance: :data:`rms_norm_linear`); see the module.

    ``rms_norm_linear(x, g, w, *, eps=1e-6, backend="auto", interpret=None, hardware=None, blocks=None)``

    ``x`` is ``[..., d]`` (tokens, any leading shape), ``g`` ``[d]`` (the norm's scale, any float dtype; computed
    in f32), ``w`` ``[d, m]`` (the projection, as ``x @ w``); ``x`` and ``w`` share a dtype (f32, bf16, f16; the
    product is accumulated in f32). Returns ``[..., m]`` in ``x``'s dtype. Differentiable in ``x``, ``g`` and ``w``
    (``jax.grad``), jit-able. ``blocks=(tile, chunk)`` sets the rows and columns per tile and the hidden units per
    chunk (powers of two ≥ 16; by default :data:`BLOCKS`, halved to fit shared memory).

    >>> x, g = jnp.ones((2, 3, 16), jnp.bfloat16), jnp.ones(16)
    >>> y = rms_norm_linear(x, g, jnp.ones((16, 5), jnp.bfloat16))
    >>> y.shape, y.dtype, float(y[0, 0, 0])
    ((2, 3, 5), dtype(bfloat16), 16.0)
    >>> rms_norm_linear(x, g, jnp.ones((5, 16), jnp.bfloat16))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: rms_norm_linear: x's hidden dim 16, g's 16 and w's first 5 must agree \
(w is [d, m], as x @ w; pass w.T if yours is [m, d])
    """

    def signature(
        self,
        x,
        g,
        w,
        *,
        eps: float = 1e-6,
        backend: str = "auto",
        interpret: bool | None = None,
        hardware: str | None = None,
        blocks: tuple[int, int] | None = None,
    ) -> Signature:
        """The :class:`Signature` of a call, its arguments checked.

        >>> rms_norm_linear.signature(jnp.ones((4, 16)), jnp.ones(16), jnp.ones((16, 8))).tile
        16
        """
        _check(x, g, w, eps, backend)
        t, s = blocks or BLOCKS
        if blocks is None:  # never more than the sizes need; the backward tiles d by both (at most d)
            n = 1
            for size in x.shape[:-1]:
                n *= size
            below = 1 << (int(w.shape[0]).bit_length() - 1)  # the largest power of two ≤ d
            t, s = min(t, max(16, next_pow2(max(n, w.shape[1]))), below), min(s, below)
        return Signature(
            jnp.dtype(x.dtype).name,
            int(w.shape[0]),
            float(eps),
            backend,
            interpret,
            int(t),
            int(s),
            None if hardware is None else str(getattr(hardware, "name", hardware)),
        )

    def kernel_for(self, x, g, w, **options) -> Made:
        """The cached :class:`Made` a call with these arguments runs (derived and lowered on first use)."""
        return _made(self.signature(x, g, w, **options))

    def __call__(self, x, g, w, **options):
        made = _made(self.signature(x, g, w, **options))
        lead = x.shape[:-1]
        y = _differentiable(made)(x.reshape(-1, x.shape[-1]), g.astype(jnp.float32), w)
        return y.reshape(*lead, w.shape[1])

    def cache_info(self):
        """The kernel cache's statistics (``functools.lru_cache``'s): every call looks its kernels up there.

        >>> rms_norm_linear.cache_info().maxsize
        64
        """
        return _made.cache_info()

    def cache_clear(self) -> None:
        """Forget every kernel made."""
        _made.cache_clear()
        _differentiable.cache_clear()


#: the entry: ``rms_norm_linear(x, g, w, ...)`` (:class:`RmsNormLinear`)
rms_norm_linear = RmsNormLinear()
