"""FP8 attention's scales, in one home: what ``nc.attention(..., fp8_scales=...)`` takes (:class:`Fp8Scales`,
cuDNN's convention in JAX: ``descale_q``, ``descale_k``, ``descale_v``, ``scale_s``, ``scale_o``), and where each
enters the diagram, as labels the kernels read:

* ``descale_q · descale_k`` joins the score scale of ``Q·Kᵀ`` (``S = (q·dq)(k·dk)ᵀ·scale``);
* ``scale_s`` is the probabilities' scale, a label of the softmax·contract box (the rule
  :class:`scale_probabilities`: ``P = σ·exp(s − m)`` rounded to e4m3 before it meets V, its row sum scaled alike,
  so the output is divided by ``σ`` where it is normalised);
* ``descale_v`` is the scale of the P·V contraction (its output times ``dv``);
* ``scale_o`` multiplies the output only where it is FP8 (``out_dtype``); the default output is bf16, unscaled.

Both products run in FP8 with f32 accumulation: Q·Kᵀ on e4m3 Q and K, P·V on the e4m3 probabilities and V.
The scales are static (Python numbers, or concrete arrays read once): they are part of the kernel, and new values
make a new kernel. Forward only: differentiating FP8 inputs is refused (:data:`NO_BACKWARD`).

>>> s = Fp8Scales(descale_q=0.5, descale_k=2.0, descale_v=0.25, scale_s=256.0)
>>> s.score(0.125), s.descale_v, s.scale_s
(0.125, 0.25, 256.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import jax
import jax.numpy as jnp
import numpy as np

from napkin_cat.diagram import Diagram
from napkin_cat.dtypes import FP8, bf16, fp8_e4m3
from napkin_cat.errors import EvaluationError
from napkin_cat.generators import FLEX_INDICES, SoftmaxContract, fname, index_names, positional
from rewrites import Rule

#: why an FP8 kernel has no backward (``kernel.why_not``); ``jax.grad`` through it raises ``NotLowerable``
NO_BACKWARD = (
    "FP8 attention is forward only: its backward (FP8 training, with dO and dP scales) is not built; "
    "differentiate a bf16 call instead"
)


#: the entries of cuDNN's ``fp8_params`` that only its backward or its amax outputs read; accepted, not read
CUDNN_BACKWARD = (
    "amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_o", "descale_dO", "descale_dP", "scale_dQ", "scale_dK",
    "scale_dV", "scale_dP",
)


@dataclass(frozen=True)
class Fp8Scales:
    """Per-tensor FP8 scale factors, named as ``jax._src.cudnn.fused_attention_stablehlo``'s ``fp8_params``:
    ``descale_q``, ``descale_k``, ``descale_v`` (each input times its descale is the real value), ``scale_s`` (the
    probabilities are multiplied by it before they are rounded to e4m3; cuDNN's default 1) and ``scale_o`` (an FP8
    output is multiplied by it; unused for a 16-bit output).

    >>> Fp8Scales.of({"descale_q": 1.0, "descale_k": 1.0, "descale_v": 1.0, "scale_s": 1.0})
    Fp8Scales(descale_q=1.0, descale_k=1.0, descale_v=1.0, scale_s=1.0, scale_o=1.0)

    cuDNN's whole ``fp8_params`` dict is taken too: its backward's entries (:data:`CUDNN_BACKWARD`) are not read
    (forward only), and its ``descale_s`` must be ``1/scale_s``.

    >>> Fp8Scales.of({"descale_q": 1.0})
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: fp8_scales lacks descale_k, descale_v, scale_s; give a dict of \
descale_q, descale_k, descale_v, scale_s (and scale_o for an FP8 output), numbers or one-element arrays, as cuDNN's \
fp8_params
    """

    descale_q: float
    descale_k: float
    descale_v: float
    scale_s: float
    scale_o: float = 1.0

    @classmethod
    def of(cls, given) -> Fp8Scales:
        """The scales from a dict (or an :class:`Fp8Scales`), each a positive finite number or a concrete
        one-element array; a traced scale, a missing or unknown one, refused naming it."""
        if isinstance(given, Fp8Scales):
            return given
        names = [f.name for f in fields(cls)]
        fix = (
            f"give a dict of {', '.join(names[:4])} (and scale_o for an FP8 output), numbers or one-element arrays, "
            "as cuDNN's fp8_params"
        )
        if not isinstance(given, dict):
            raise EvaluationError(f"attention: FP8 inputs need fp8_scales; got {type(given).__name__}; {fix}")
        if missing := [n for n in names[:4] if n not in given]:
            raise EvaluationError(f"attention: fp8_scales lacks {', '.join(missing)}; {fix}")
        if unknown := sorted(set(given) - set(names) - set(CUDNN_BACKWARD) - {"descale_s"}):
            raise EvaluationError(f"attention: fp8_scales has unknown {', '.join(unknown)}; {fix}")
        made = cls(**{n: _number(n, given[n]) for n in names if n in given})
        if "descale_s" in given and not math.isclose(_number("descale_s", given["descale_s"]) * made.scale_s, 1.0):
            raise EvaluationError(
                f"attention: fp8_scales' descale_s must be 1/scale_s = {1 / made.scale_s:g} (the output is divided by "
                "scale_s); drop descale_s or make it agree"
            )
        return made

    def score(self, scale: float) -> float:
        """The score contraction's scale: ``scale · descale_q · descale_k``."""
        return scale * self.descale_q * self.descale_k


def _number(name: str, v) -> float:
    """A scale as a Python float: positive and finite, concrete (the kernel holds it)."""
    if isinstance(v, jax.core.Tracer):
        raise EvaluationError(
            f"attention: fp8_scales[{name!r}] is traced (under jit or grad); FP8 scales are part of the kernel: pass "
            "them as Python numbers or concrete arrays (close over them, or mark them static)"
        )
    a = np.asarray(v)  # numpy: under a jit trace jnp would make a Python number a tracer
    if a.size != 1:
        raise EvaluationError(f"attention: fp8_scales[{name!r}] has shape {a.shape}; a per-tensor scale is one number")
    x = float(a.reshape(()))
    if not (math.isfinite(x) and x > 0):
        raise EvaluationError(f"attention: fp8_scales[{name!r}] = {x}; a scale must be positive and finite")
    return x


def check_fp8(query, key, value, fp8_scales, out_dtype) -> tuple[Fp8Scales | None, str | None]:
    """The scales and the output dtype of a call: (None, None) where no array is FP8; an FP8 call with every input
    e4m3, its scales, and its output dtype (default bf16; e4m3 too, multiplied by ``scale_o``). With q and k in e4m3
    and v in bf16 or f16, FAN's mixed algorithm: Q·Kᵀ in FP8, P·V in v's 16 bits (the probabilities never rounded to
    e4m3, so ``scale_s`` must be 1 and may be left out, as may ``descale_v``); its output defaults to v's dtype.
    Refused, naming the arguments: other mixes of FP8 and 16-bit inputs, scales without FP8 inputs or FP8 without
    scales.

    >>> x, y = jnp.zeros((1, 4, 1, 16), jnp.float8_e4m3fn), jnp.zeros((1, 4, 1, 16), jnp.bfloat16)
    >>> check_fp8(x, x, x, dict(descale_q=1, descale_k=1, descale_v=1, scale_s=1), None)[1]
    'bfloat16'
    >>> check_fp8(x, x, y, dict(descale_q=0.5, descale_k=2), None)
    (Fp8Scales(descale_q=0.5, descale_k=2.0, descale_v=1.0, scale_s=1.0, scale_o=1.0), 'bfloat16')
    >>> check_fp8(x, y, y, dict(descale_q=1, descale_k=1, descale_v=1, scale_s=1), None)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: FP8 attention takes q, k and v all in float8_e4m3fn, or q and k in \
float8_e4m3fn with v in bfloat16 or float16 (FAN's mixed algorithm); got q float8_e4m3fn, k bfloat16, v bfloat16 \
(quantise the inputs with their scales, or pass none in FP8)
    """
    names = [jnp.dtype(a.dtype).name for a in (query, key, value)]
    if not any(n in {t.jax_name for t in FP8} for n in names):
        for what, given in (("fp8_scales", fp8_scales), ("out_dtype", out_dtype)):
            if given is not None:
                raise EvaluationError(
                    f"attention: {what} given for q, k, v in {', '.join(sorted(set(names)))}; it applies to "
                    f"float8_e4m3fn inputs only: drop {what}, or quantise q, k and v to e4m3"
                )
        return None, None
    want = fp8_e4m3.jax_name
    mixed = names[:2] == [want] * 2 and names[2] in (bf16.jax_name, "float16")
    if names != [want] * 3 and not mixed:
        got = ", ".join(f"{a} {n}" for a, n in zip("qkv", names, strict=True))
        raise EvaluationError(
            f"attention: FP8 attention takes q, k and v all in {want}, or q and k in {want} with v in bfloat16 or "
            f"float16 (FAN's mixed algorithm); got {got} (quantise the inputs with their scales, or pass none in FP8)"
        )
    if fp8_scales is None:
        needed = "descale_q=..., descale_k=..." if mixed else "descale_q=..., descale_k=..., descale_v=..., scale_s=..."
        which = "q, k are float8_e4m3fn (v 16-bit: FAN's mixed algorithm)" if mixed else "q, k, v are float8_e4m3fn"
        raise EvaluationError(
            f"attention: {which} but fp8_scales is missing; pass fp8_scales=dict({needed}) (1.0 each for unscaled "
            "inputs)"
        )
    out = (names[2] if mixed else bf16.jax_name) if out_dtype is None else jnp.dtype(out_dtype).name
    if out not in (bf16.jax_name, "float16", "float32", *(() if mixed else (want,))):
        raise EvaluationError(
            f"attention: FP8 attention's out_dtype is bfloat16, float16, float32{'' if mixed else ' or ' + want}; "
            f"got {out}"
        )
    if not mixed:
        return Fp8Scales.of(fp8_scales), out
    given = dict(fp8_scales) if isinstance(fp8_scales, dict) else {f.name: getattr(fp8_scales, f.name) for f in
                                                                   fields(Fp8Scales)}
    scales = Fp8Scales.of({"descale_v": 1.0, "scale_s": 1.0} | given)
    if scales.scale_s != 1.0:
        raise EvaluationError(
            f"attention: scale_s = {scales.scale_s:g} scales probabilities rounded to e4m3; with v in {names[2]} "
            "(FAN's mixed algorithm) they stay 16-bit: drop scale_s"
        )
    return scales, out


def no_fp8_dot(d: Diagram, interpret: bool) -> str | None:
    """Why a compiled Triton kernel of ``d`` cannot multiply its FP8 inputs here (Triton's ``tl.dot`` takes e4m3 on
    sm_89 and newer: Ada, Hopper, Blackwell), else None; interpret mode multiplies anything.

    >>> import napkin_cat as nc
    >>> no_fp8_dot(nc.library.attention(*nc.axes("q x d"), dtype="fp8_e4m3"), interpret=True) is None
    True
    """
    if interpret or not any(w.dtype in FP8 for w in d.dom.inside):
        return None
    capability = getattr(jax.devices()[0], "compute_capability", None)
    major, minor = (int(c) for c in (capability or "0.0").split(".")[:2])
    if (major, minor) >= (8, 9):
        return None
    return (
        f"Triton: FP8 inputs need tl.dot on e4m3, which runs on sm_89 and newer (Ada, Hopper); this GPU is "
        f"{jax.devices()[0].device_kind!r} (sm_{capability}): pass q, k, v in bf16 (dequantised: a·descale)"
    )


@dataclass(frozen=True)
class scale_probabilities(Rule):  # noqa: N801 - rules are named as verbs, like functions
    """Label each softmax·contract over ``axis`` with the probability scale ``sigma`` (FP8's ``scale_s``).

    rewrite: softmax·contract_x  →  softmax·contract_x(P scaled by σ)

    Exact in real arithmetic (``σ·P·V / (σ·ΣP) = P·V / ΣP``); what changes is the rounding of ``σ·P`` to the
    values' dtype, which the kernels then do (``SoftmaxContract.with_probability_scale``). Side conditions: ``sigma``
    is positive and some softmax·contract reduces ``axis`` (``stream(axis, s)`` fuses it first).

    >>> import napkin_cat as nc
    >>> from rewrites import derive, tile, stream
    >>> q, x, d = nc.axes("q x d")
    >>> attn = nc.library.attention(q, x, d, dtype="fp8_e4m3")
    >>> flash = derive(attn, tile(q, 32), stream(x, 32), scale_probabilities("x", 16.0), verify=False).diagram
    >>> [b.params.get("probs") for b in flash.boxes if isinstance(b, SoftmaxContract)]
    [16.0]
    """

    axis: str
    sigma: float

    def apply(self, d: Diagram) -> Diagram:
        if not self.sigma > 0:
            raise self.fail(f"the probability scale must be positive, got {self.sigma}", axis=self.axis)
        hit = [b for b in d.boxes if isinstance(b, SoftmaxContract) and b.params["axis"] == self.axis]
        if not hit:
            raise self.fail("no softmax·contract reduces the axis; stream it first", axis=self.axis)
        scaled = lambda box: box.with_probability_scale(self.sigma) if box in hit else box  # noqa: E731
        return d.with_layers([(left, scaled(box), right) for left, box, right in d.inside])

    def __repr__(self):
        return f"scale_probabilities({self.axis}, {self.sigma:g})"


#: the largest finite float8_e4m3fn
E4M3_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)


def fp8_quantize(query, key, value, *, incoherent: bool = False, per: str = "tensor", scale_s: float = 1.0) -> tuple:
    """``q, k, v`` (``[B, N, H, D]``, any float dtype) rounded to e4m3 with their scales, and the ``fp8_scales``
    dict ``nc.attention`` takes for them: each array times ``E4M3_MAX / amax`` (its largest magnitude lands on
    e4m3's largest, 448), its descale the inverse. ``per="tensor"``: one amax per array, a number the kernel holds.
    ``per="token"``: q and k one amax per token and head (descales ``[B, N, H]``, inputs of the kernel read at each
    call, so a jitted step may pass new ones without a new kernel; on an sm_90 GPU the kernel is Mosaic's, elsewhere
    Triton's: docs/mosaic.md), v still per tensor (its descale scales the output). A per-tensor amax is read back as a
    number: call this outside ``jax.jit``.

    ``incoherent=True`` first rotates q and k along the head dim by the normalised Hadamard transform, the boxes
    :func:`rewrites.incoherent` puts before ``Q·Kᵀ`` (which leave every score unchanged, proved over symbols):
    FlashAttention-3's incoherent processing (Shah et al. 2024, §3.3). An outlier feature is spread over the head
    dim before rounding: the scores' rounding error keeps its size, but no longer lands whole on the few large
    scores an outlier enters, which the softmax weighs most (``papers/flash_attention/incoherent.py`` measures the
    output's error). v is not rotated (it would rotate the output). The head dim must be a power of two.

    >>> import jax, jax.numpy as jnp
    >>> import napkin_cat as nc
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 128, 2, 64)) for i in range(3))
    >>> q8, k8, v8, scales = nc.fp8_quantize(q, k, v, incoherent=True)
    >>> q8.dtype, sorted(scales)
    (dtype(float8_e4m3fn), ['descale_k', 'descale_q', 'descale_v', 'scale_s'])
    >>> out = nc.attention(q8, k8, v8, fp8_scales=scales)
    >>> want = jax.nn.dot_product_attention(q, k, v)
    >>> bool(jnp.max(jnp.abs(out.astype(jnp.float32) - want)) < 0.1)
    True
    """
    from napkin_cat.generators import hadamard, heads
    from napkin_cat.semantics import to_jax

    if per not in ("tensor", "token"):
        raise EvaluationError(f"fp8_quantize: per={per!r}; expected 'tensor' (one scale per array) or 'token'")
    arrays = {"q": query, "k": key, "v": value}
    for name, a in arrays.items():
        if jnp.ndim(a) != 4 or not jnp.issubdtype(a.dtype, jnp.floating):
            raise EvaluationError(
                f"fp8_quantize: {name} has shape {jnp.shape(a)} and dtype {jnp.dtype(a.dtype).name}; expected a "
                "float array [B, N, H, D]"
            )
    if incoherent:
        for name in "qk":
            wire, (*_, d) = heads(arrays[name])
            turn = hadamard(wire, d)  # refuses a head dim no power of two, naming it
            arrays[name] = to_jax(turn)(arrays[name])
    out, scales = [], {}
    for name, a in arrays.items():
        x = a.astype(jnp.float32)
        if per == "token" and name != "v":
            amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
            scale = jnp.where(amax > 0, E4M3_MAX / amax, 1.0)
            scales[f"descale_{name}"] = 1 / scale[..., 0]
        else:
            amax = float(jnp.max(jnp.abs(x)))
            scale = E4M3_MAX / amax if amax > 0 else 1.0
            scales[f"descale_{name}"] = 1 / scale
        out.append((x * scale).astype(jnp.float8_e4m3fn))
    return (*out, {**scales, "scale_s": float(scale_s)})


def token_scales(fp8_scales, score_mod, query, key) -> tuple:
    """``fp8_scales`` whose ``descale_q`` / ``descale_k`` are arrays, one per token and head (``[..., Nq, H]`` and
    ``[..., Nk, H_kv]``, as :func:`fp8_quantize` with ``per="token"`` makes), as the kernel takes them: each score
    times its query's and its key's descale, a score modifier over captured arrays (inputs of the kernel, read at
    each call, so new scales, traced ones included, reuse the kernel), composed before ``score_mod``; the kernel's
    own descales 1. Per-tensor scales (numbers) pass through unchanged.

    >>> import jax.numpy as jnp
    >>> q = jnp.zeros((1, 4, 2, 16), jnp.float8_e4m3fn)
    >>> scales, mod = token_scales(dict(descale_q=jnp.full((1, 4, 2), 0.5), descale_k=2.0, descale_v=1.0,
    ...                                 scale_s=1.0), None, q, q)
    >>> scales["descale_q"], scales["descale_k"], float(mod(3.0, 0, 1, 2, 3))
    (1.0, 2.0, 1.5)
    """
    if not isinstance(fp8_scales, dict):
        return fp8_scales, score_mod
    rows = {"descale_q": query.shape[:-1], "descale_k": key.shape[:-1]}
    given = {n: fp8_scales[n] for n in rows if n in fp8_scales and np.size(fp8_scales[n]) > 1}
    if not given:
        return fp8_scales, score_mod
    for n, a in given.items():
        if tuple(jnp.shape(a)) != tuple(rows[n]):
            x = "q" if n == "descale_q" else "k"
            raise EvaluationError(
                f"attention: fp8_scales[{n!r}] has shape {tuple(jnp.shape(a))}; a per-token descale of {x} has its "
                f"shape without the head dim, {tuple(rows[n])} (or pass one number per tensor)"
            )
    flat = {n: jnp.reshape(a, (-1, *rows[n][-2:])).astype(jnp.float32) for n, a in given.items()}
    dq, dk = flat.get("descale_q"), flat.get("descale_k")
    group = query.shape[-2] // key.shape[-2]
    user = None if score_mod is None else positional(score_mod, FLEX_INDICES, score=True)
    names = None if user is None else index_names(user, score=True)

    def scaled(score, b, h, q_idx, kv_idx):
        s = score if dq is None else score * dq[b, q_idx, h]
        s = s if dk is None else s * dk[b, kv_idx, h // group]
        if user is None:
            return s
        indices = {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx}
        return user(s, **(indices if names is None else {k: indices[k] for k in names}))

    scaled.__name__ = "per-token descales" + ("" if user is None else f" then {fname(user)}")
    return {**fp8_scales, **dict.fromkeys(given, 1.0)}, scaled
