"""Every attention implementation the benchmark and the small transformer call, behind one record.

Each computes ``softmax(scale·QKᵀ [+ causal mask])·V`` with ``scale = 1/√D``. An :class:`Impl` says
how to call one: the layout its arrays use (``BHND`` = [batch, heads, seq, dim], ``BNHD`` =
[batch, seq, heads, dim]), whether it lacks a scale argument (then ``prepare`` multiplies Q by the
scale), and the function itself. ``prepare`` runs outside the timed region, so a baseline is never
charged for a layout transpose it would not do in its own framework. Building an :class:`Impl`
never raises: one that cannot be imported or does not apply carries the reason in ``unavailable``.

>>> import jax, jax.numpy as jnp
>>> spec = Spec(jnp.float32, causal=True, head_dim=16)
>>> q, k, v = jax.random.normal(jax.random.key(0), (3, 1, 2, 8, 16))  # [B, H, N, D]
>>> o = naive_xla(spec).run(q, k, v)
>>> o.shape, bool(max_rel_err(o, reference(q, k, v, causal=True)) < 1e-5)
((1, 2, 8, 16), True)
>>> cudnn(spec).unavailable if jax.default_backend() == "cpu" else None
'needs a CUDA GPU (platform cpu)'
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

HIGHEST = lax.Precision.HIGHEST
LAYOUTS = ("BHND", "BNHD")


@dataclass(frozen=True)
class Spec:
    """What an implementation is asked to compute: input dtype, causal mask, head dim, interpret mode."""

    dtype: object
    causal: bool
    head_dim: int
    interpret: bool = False

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass(frozen=True)
class Impl:
    """One attention implementation: ``fn(q, k, v)`` on prepared arrays in ``layout``.

    ``prescale``: ``fn`` has no scale argument, so ``prepare`` scales Q. ``grad``: it has a backward
    pass worth timing. ``unavailable``: why it cannot run here (``fn`` is then None).
    """

    name: str
    fn: Callable | None
    layout: str = "BHND"
    scale: float = 1.0
    prescale: bool = False
    grad: bool = True
    unavailable: str | None = None

    @classmethod
    def missing(cls, name: str, why: str) -> Impl:
        """An implementation that cannot run here, and why.

        >>> Impl.missing("x", "no GPU").unavailable
        'no GPU'
        """
        return cls(name, None, unavailable=why)

    def prepare(self, q, k, v):
        """[B, H, N, D] inputs → this implementation's arguments (layout, pre-scaled Q)."""
        if self.prescale:
            q = (q * jnp.asarray(self.scale, q.dtype)).astype(q.dtype)
        return tuple(from_bhnd(a, self.layout) for a in (q, k, v))

    def to_bhnd(self, out):
        """This implementation's output → [B, H, N, D]."""
        return to_bhnd(out, self.layout)

    def grads_to_bhnd(self, grads):
        """Gradients w.r.t. the prepared arguments → gradients w.r.t. the [B, H, N, D] inputs."""
        dq, dk, dv = (to_bhnd(g, self.layout) for g in grads)
        return (dq * self.scale if self.prescale else dq), dk, dv

    def run(self, q, k, v):
        """Prepare, call, and return [B, H, N, D]: the untimed convenience path."""
        return self.to_bhnd(self.fn(*self.prepare(q, k, v)))


def from_bhnd(a, layout: str):
    """[B, H, N, D] → ``layout``.

    >>> from_bhnd(jnp.zeros((1, 2, 3, 4)), "BNHD").shape
    (1, 3, 2, 4)
    """
    return a if layout == "BHND" else jnp.swapaxes(a, 1, 2)


def to_bhnd(a, layout: str):
    """``layout`` → [B, H, N, D] (the same swap: it is an involution)."""
    return from_bhnd(a, layout)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _gpu_only(name: str) -> Impl | None:
    if on_gpu():
        return None
    return Impl.missing(name, f"needs a CUDA GPU (platform {jax.default_backend()})")


# --- the f32 reference ------------------------------------------------------------------------


def _attend_f32(q, k, v, causal: bool, q_offset: int = 0):
    """f32 attention with IEEE matmuls (not TF32) for one batch element, [H, n, D] × [H, N, D]."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("hqd,hkd->hqk", q, k, precision=HIGHEST) * q.shape[-1] ** -0.5
    if causal:
        rows = q_offset + jnp.arange(q.shape[1])[:, None]
        s = jnp.where(rows >= jnp.arange(k.shape[1])[None, :], s, -jnp.inf)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)


@functools.partial(jax.jit, static_argnames="causal")
def reference(q, k, v, *, causal: bool):
    """The f32 reference output, [B, H, N, D]; one batch element at a time to bound memory."""
    one = jax.checkpoint(lambda args: _attend_f32(*args, causal))
    return lax.map(one, (q, k, v))


@functools.partial(jax.jit, static_argnames="causal")
def reference_grads(q, k, v, *, causal: bool):
    """Gradients of ``sum(reference(q, k, v))`` w.r.t. q, k, v, in f32."""
    loss = lambda *a: reference(*a, causal=causal).sum()
    return jax.grad(loss, argnums=(0, 1, 2))(*(a.astype(jnp.float32) for a in (q, k, v)))


@functools.partial(jax.jit, static_argnames=("rows", "causal"))
def reference_rows(q, k, v, *, rows: int, causal: bool):
    """The f32 reference for the last ``rows`` queries only: checks outputs at any sequence length.

    >>> q = jnp.ones((1, 1, 8, 16))
    >>> reference_rows(q, q, q, rows=2, causal=True).shape
    (1, 1, 2, 16)
    """
    n = q.shape[2]
    one = lambda args: _attend_f32(args[0][:, n - rows :], args[1], args[2], causal, n - rows)
    return lax.map(one, (q, k, v))


@jax.jit
def max_rel_err(out, ref):
    """``max|out − ref| / max|ref|``: the error normalised by the output's scale (0 for equal arrays).

    >>> round(float(max_rel_err(jnp.array([1.0, 2.0]), jnp.array([1.0, 2.5]))), 6)
    0.2
    """
    out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref))


# --- the implementations ----------------------------------------------------------------------


def naive_xla(spec: Spec) -> Impl:
    """Naive XLA attention: einsum, f32 softmax, einsum; materialises the N×N scores in HBM."""

    def attend(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=jnp.float32) * spec.scale
        if spec.causal:
            n, m = s.shape[-2:]
            s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(m)[None, :], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
        o = jnp.einsum("bhqk,bhkd->bhqd", p, v, preferred_element_type=jnp.float32)
        return o.astype(q.dtype)

    return Impl("naive", attend, "BHND", spec.scale)


def cudnn(spec: Spec) -> Impl:
    """``jax.nn.dot_product_attention(implementation='cudnn')``: cuDNN's fused flash attention."""
    if missing := _gpu_only("cudnn"):
        return missing

    def attend(q, k, v):
        return jax.nn.dot_product_attention(
            q, k, v, scale=spec.scale, is_causal=spec.causal, implementation="cudnn"
        )

    return Impl("cudnn", attend, "BNHD", spec.scale)


def xla_dpa(spec: Spec) -> Impl:
    """``jax.nn.dot_product_attention`` with its default implementation (the transformer's reference)."""

    def attend(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=spec.scale, is_causal=spec.causal)

    return Impl("xla_dpa", attend, "BNHD", spec.scale)


def pallas_mha(spec: Spec) -> Impl:
    """jax's Pallas Triton ``mha`` (``jax.experimental.pallas.ops.gpu.attention``), default blocks."""
    try:
        with warnings.catch_warnings():  # the module warns that it is deprecated in favour of tokamax
            warnings.simplefilter("ignore", DeprecationWarning)
            from jax.experimental.pallas.ops.gpu import attention as pallas_attention
    except Exception as e:  # noqa: BLE001 - any import failure is a result to record
        return Impl.missing("mha", f"import failed: {e!r}")
    if not (spec.interpret or on_gpu()):
        return Impl.missing("mha", f"needs a CUDA GPU or interpret mode (platform {jax.default_backend()})")

    def attend(q, k, v):
        return pallas_attention.mha(
            q, k, v, None, sm_scale=spec.scale, causal=spec.causal, interpret=spec.interpret
        )

    return Impl("mha", attend, "BNHD", spec.scale)


def mosaic_fa3(spec: Spec) -> Impl:
    """jax's Mosaic GPU ``attention_mgpu.attention`` (FA3-style; Hopper; fp16 here; no scale argument).

    Blocks as in that module's own ``main``: ``block_q = 64`` and the largest ``block_kv`` whose
    two-stage K/V buffers fit SMEM (256 for D = 64, 128 for D = 128).
    """
    if missing := _gpu_only("mgpu"):
        return missing
    if jnp.dtype(spec.dtype) != jnp.float16:
        return Impl.missing("mgpu", "benchmarked in fp16 only")
    if spec.head_dim % 64:
        return Impl.missing("mgpu", f"head dim {spec.head_dim} is not a multiple of 64")
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu
    except Exception as e:  # noqa: BLE001 - e.g. absl-py missing
        return Impl.missing("mgpu", f"import failed: {e!r}")
    config = attention_mgpu.TuningConfig(
        block_q=64,
        block_kv=256 if spec.head_dim <= 64 else 128,
        max_concurrent_steps=2,
        causal=spec.causal,
    )

    def attend(q, k, v):
        return attention_mgpu.attention(q, k, v, config)

    return Impl("mgpu", attend, "BNHD", spec.scale, prescale=True, grad=False)


def napkin(spec: Spec) -> Impl:
    """The napkin-cat kernel: naive attention, derived with the drop-in entry's blocks for long sequences
    (``lowering._attention.schedule``: ``tile(q, 128)``, and ``stream(x, 128)`` at head dim 128, else 64), lowered.

    The derivation's steps are not re-verified here (the tests do that); the error column checks the
    kernel. The diagram is woven over batch and heads (``batch=(b, h)``) so the kernel takes [B, H, N, D];
    if the library's ``attention`` lacks ``batch`` (or the kernel refuses rank-4 arrays) it is vmapped.
    It gets ``scale=`` and ``dtype=`` where it takes them; without ``scale``, Q is pre-scaled.
    """
    try:
        import napkin_cat as nc
        from lowering import lower
        from rewrites import derive, stream, tile
    except Exception as e:  # noqa: BLE001 - the lowering may not exist yet
        return Impl.missing("napkin", f"napkin-cat lowering not importable: {e!r}")
    try:
        kernel, scaled = _napkin_kernel(nc, lower, derive, tile, stream, spec)
    except Exception as e:  # noqa: BLE001 - a derivation or lowering failure is a result to record
        return Impl.missing("napkin", f"derive/lower failed: {type(e).__name__}: {e}")
    return Impl("napkin", _over_batch_and_heads(kernel), "BHND", spec.scale, prescale=not scaled)


@functools.cache
def _napkin_kernel(nc, lower, derive, tile, stream, spec: Spec):
    b, h, q, x, d = nc.axes("b h q x d")
    accepts = inspect.signature(nc.library.attention).parameters
    wanted = {"causal": spec.causal, "scale": spec.scale, "batch": (b, h),
              "dtype": {"bfloat16": nc.bf16, "float16": nc.f16, "float32": nc.f32}[jnp.dtype(spec.dtype).name]}
    kwargs = {k: v for k, v in wanted.items() if k in accepts}
    # Verifying the derivation's steps takes ~20 s per diagram on CPU; the tests verify them, and the
    # benchmark checks the lowered kernel itself against the f32 reference.
    quick = {"verify": False} if "verify" in inspect.signature(derive).parameters else {}
    from lowering._attention import schedule

    g, s = schedule(1 << 16, 1 << 16, spec.head_dim)  # the entry's rule, unclamped by the sequence length
    flash = derive(nc.library.attention(q, x, d, **kwargs), tile(q, g), stream(x, s), **quick)
    return lower(flash), "scale" in kwargs


def _over_batch_and_heads(kernel: Callable) -> Callable:
    """``kernel`` on [B, H, N, D]: as is if it accepts rank-4 arrays, else vmapped twice."""

    def attend(q, k, v):
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (q, k, v)]
        try:
            jax.eval_shape(kernel, *shapes)
        except Exception:  # noqa: BLE001 - the kernel is for one head: weave it
            return jax.vmap(jax.vmap(kernel))(q, k, v)
        return kernel(q, k, v)

    return attend


BASELINES: dict[str, Callable[[Spec], Impl]] = {
    "naive": naive_xla,
    "cudnn": cudnn,
    "mha": pallas_mha,
    "mgpu": mosaic_fa3,
}
CANDIDATES: dict[str, Callable[[Spec], Impl]] = {"napkin": napkin, "cudnn": cudnn, "mha": pallas_mha}
