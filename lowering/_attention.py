"""``attention``: the drop-in entry, in ``jax.nn.dot_product_attention``'s layout.

For users who want the kernel without writing the diagram: ``attention(q, k, v, ...)`` takes
``[batch, seq, heads, dim]`` arrays (or ``[seq, heads, dim]``), builds the diagram with
:mod:`napkin_cat.library` (grouped-query attention when ``k``/``v`` have fewer heads than ``q``),
derives its schedule by the rule of :func:`schedule`, verifies the derivation once (every step, and the
lowered kernel, on a random trial), lowers it with :func:`lowering.lower` and caches the result per
:class:`Signature`. A second call with the same signature derives, verifies and lowers nothing, under
``jax.jit``, ``jax.vmap`` and ``jax.grad`` alike. ``attention.kernel_for(q, k, v, ...)`` returns the
cached :class:`AttentionKernel`, which states how it was made: backend, differentiation, derivation.

**Index functions** use FlexAttention's index names: ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)`` (a mask keeps a score where it is true). As everywhere in napkin-cat, a
function names only the indices it reads: ``lambda s, q_idx, kv_idx: s - abs(q_idx - kv_idx)`` reads no
head. ``h`` is the query head, as in ``jax.nn`` (under grouped-query attention the entry computes it
from the key/value head and the position in its group). The callables are part of the signature by
identity: define them once, not in a loop, or every call derives anew.

**Not supported yet**, refused with :class:`~lowering._plan.NotLowerable` rather than ignored: ``bias``,
``mask`` (arrays) and ``segment_ids`` (the library's attention takes no array inputs beyond Q, K, V), and a
value head dim different from the query/key head dim.

>>> import jax, jax.numpy as jnp
>>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 20, 4, 16)) for i in range(3))
>>> out = attention(q, k, v, is_causal=True)
>>> ref = jax.nn.dot_product_attention(q, k, v, is_causal=True)
>>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
((2, 20, 4, 16), True)
>>> made = attention.kernel_for(q, k, v, is_causal=True)
>>> made.backend, made.differentiation, (made.signature.tile, made.signature.stream)
('triton', 'lowered', (32, 32))
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax.numpy as jnp

from lowering._api import BACKENDS, Kernel, lower
from lowering._plan import NotLowerable, next_pow2
from napkin_cat import library
from napkin_cat.axes import axes
from napkin_cat.dtypes import bf16, f16, f32
from napkin_cat.errors import EvaluationError
from napkin_cat.generators import fname
from napkin_cat.generators._index import index_names
from napkin_cat.hardware import Hardware
from rewrites import Derivation, derive, stream, tile

#: the dtypes the entry takes, by ``jnp.dtype`` name (q, k and v share one, as ``jax.nn`` requires)
DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}


def schedule(q_len: int, kv_len: int, dim: int) -> tuple[int, int]:
    """The rule choosing ``(tile, stream)``: queries per tile and keys per streamed chunk.

    FlashAttention-2's blocks (Dao 2023, §3.3), as benchmarked in ``papers/flash_attention``: 128 queries
    per tile (64 when the head dim exceeds 128, so the tile fits shared memory) and 64 keys per chunk,
    never more than the sequence needs: short sequences take the next power of two, at least 16 (the
    smallest block every 16-bit dot accepts).

    >>> schedule(8192, 8192, 128), schedule(8192, 8192, 256), schedule(20, 40, 64), schedule(3, 3, 8)
    ((128, 64), (64, 64), (32, 64), (16, 16))
    """
    return min(128 if dim <= 128 else 64, max(16, next_pow2(q_len))), min(64, max(16, next_pow2(kv_len)))


@dataclass(frozen=True)
class HeadOfGroup:
    """An index function reading the query head ``h``, on grouped-query scores whose axes are the
    key/value head ``h_kv`` and the position ``g`` in its group: ``h = h_kv · group + g`` (``jax.nn``'s
    order: query heads ``h_kv·group … h_kv·group + group − 1`` share key/value head ``h_kv``).

    >>> alibi = HeadOfGroup(lambda s, h, q_idx: s + h * q_idx, group=4)
    >>> list(inspect.signature(alibi).parameters), alibi(1.0, h_kv=1, g=2, q_idx=3)
    (['s', 'h_kv', 'g', 'q_idx'], 19.0)
    """

    fn: Callable
    group: int

    def __call__(self, *value, h_kv, g, **indices):
        return self.fn(*value, h=h_kv * self.group + g, **indices)

    @property
    def __signature__(self):
        params = list(inspect.signature(self.fn).parameters.values())
        head = next(i for i, p in enumerate(params) if p.name == "h")
        kw = inspect.Parameter.KEYWORD_ONLY
        new = [inspect.Parameter("h_kv", kw), inspect.Parameter("g", kw)]
        rest = [p.replace(kind=kw) for p in params[head + 1 :]]
        return inspect.Signature([*params[:head], *new, *rest])

    @property
    def __name__(self):
        return fname(self.fn)


@dataclass(frozen=True)
class Signature:
    """What a kernel depends on, and so the cache's key: the dtype, the heads per key/value head
    (``group``; 1 is multi-head attention), the schedule :func:`schedule` picks from the shapes, the
    flags, the index functions (by identity) and how to lower. Shapes with the same schedule share a
    kernel: the diagram's sizes stay symbolic, bound at each call.

    >>> x = jnp.zeros((1, 20, 4, 16))
    >>> s = Signature.of(x, x[:, :, :2], x[:, :, :2], is_causal=True)
    >>> s.group, s.tile, s.stream, s.causal, s.dtype
    (2, 32, 32, True, 'float32')
    """

    dtype: str
    group: int
    tile: int
    stream: int
    scale: float | None = None
    causal: bool = False
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    backend: str = "auto"
    backward: str = "lowered"
    interpret: bool | None = None
    hardware: Hardware | str | None = None

    @classmethod
    def of(
        cls,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        segment_ids=None,
        backend: str = "auto",
        backward: str = "lowered",
        interpret: bool | None = None,
        hardware: Hardware | str | None = None,
    ) -> Signature:
        """The signature of a call (the arguments of :data:`attention`), checked before anything is built."""
        for name, given in (("bias", bias), ("mask", mask), ("segment_ids", segment_ids)):
            if given is not None:
                raise NotLowerable(
                    f"attention: {name}= is not supported yet: the library's attention takes no array inputs "
                    "beyond Q, K, V; express a mask by index with mask_mod= or a bias with score_mod="
                )
        if backend != "auto" and backend not in BACKENDS:
            raise NotLowerable(f"attention: backend {backend!r}: choose 'auto', {', '.join(map(repr, BACKENDS))}")
        group, dim = _check(query, key, value)
        t, s = schedule(query.shape[-3], key.shape[-3], dim)
        return cls(
            jnp.dtype(query.dtype).name,
            group,
            t,
            s,
            None if scale is None else float(scale),
            bool(is_causal),
            score_mod,
            mask_mod,
            backend,
            backward,
            interpret,
            hardware,
        )

    def derivation(self) -> Derivation:
        """The diagram, derived by the schedule and verified (each step and the lowered kernel, on a trial)."""
        b, q, x, d = axes("b q_idx kv_idx d")
        if self.group == 1:
            heads = axes("h")
            kw = dict(batch=(b, *heads))
        else:
            heads = axes("h_kv g")
            kw = dict(batch=(b, *heads), kv_batch=(b, heads[0]))
        mods = {"score_mod": self._indexed(self.score_mod, True), "mask": self._indexed(self.mask_mod, False)}
        diagram = library.attention(
            q,
            x,
            d,
            scale=self.scale,
            causal=self.causal,
            dtype=DTYPES[self.dtype],
            **{k: f for k, f in mods.items() if f is not None},
            **kw,
        )
        return derive(diagram, tile(q, self.tile), stream(x, self.stream), verify="kernel")

    def _indexed(self, fn: Callable | None, score: bool) -> Callable | None:
        if fn is None or self.group == 1:
            return fn
        names = index_names(fn, score=score)
        if names is not None and "h" not in names:
            return fn
        if names is None:
            raise NotLowerable(
                f"attention: {fname(fn)} takes **kwargs; under grouped-query attention name the indices it reads "
                "(b, h, q_idx, kv_idx), so the query head h can be computed from the key/value head"
            )
        return HeadOfGroup(fn, self.group)


def _check(query, key, value) -> tuple[int, int]:
    """Refuse arrays the entry cannot take, naming the condition; the group size and head dim otherwise."""
    shapes = f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
    if not query.ndim == key.ndim == value.ndim or query.ndim not in (3, 4):
        raise EvaluationError(f"attention: q, k, v must all be [batch, seq, heads, dim] or [seq, heads, dim]; {shapes}")
    if key.shape != value.shape[:-1] + key.shape[-1:]:
        raise EvaluationError(f"attention: k and v must agree on batch, keys and heads; {shapes}")
    if value.shape[-1] != key.shape[-1]:
        raise NotLowerable(f"attention: a value head dim ≠ the query/key head dim is not supported yet; {shapes}")
    if query.shape[-1] != key.shape[-1] or query.shape[:-3] != key.shape[:-3]:
        raise EvaluationError(f"attention: q and k must agree on batch and head dim; {shapes}")
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if heads % kv_heads:
        raise EvaluationError(f"attention: q's {heads} heads are not a multiple of k's and v's {kv_heads}; {shapes}")
    dtypes = {jnp.dtype(a.dtype).name for a in (query, key, value)}
    if len(dtypes) != 1 or not dtypes <= DTYPES.keys():
        raise EvaluationError(f"attention: q, k, v must share one dtype of {', '.join(DTYPES)}; got {sorted(dtypes)}")
    return heads // kv_heads, query.shape[-1]


@dataclass(frozen=True)
class AttentionKernel:
    """A cached kernel of the entry: its :class:`Signature`, the verified :class:`~rewrites.Derivation`
    and the lowered :class:`~lowering.Kernel`. Called on ``[batch, seq, heads, dim]`` arrays of its signature,
    it returns the attention in the same layout.

    >>> x = jnp.ones((1, 20, 2, 16))
    >>> made = attention.kernel_for(x, x, x)
    >>> made.backend, made.differentiation, made.why_not, made(x, x, x).shape
    ('triton', 'lowered', None, (1, 20, 2, 16))
    """

    signature: Signature
    derivation: Derivation
    kernel: Kernel

    @property
    def backend(self) -> str:
        return self.kernel.backend

    @property
    def differentiation(self) -> str:
        return self.kernel.differentiation

    @property
    def why_not(self) -> str | None:
        return self.kernel.why_not

    def __call__(self, query, key, value):
        group, _ = _check(query, key, value)
        if group != self.signature.group or jnp.dtype(query.dtype).name != self.signature.dtype:
            raise EvaluationError(
                f"attention kernel for {self.signature.dtype} with {self.signature.group} query heads per key/value "
                f"head, called on {jnp.dtype(query.dtype).name} with {group}"
            )
        if query.ndim == 3:
            return self(query[None], key[None], value[None])[0]
        kv_heads = key.shape[2]
        # the diagram's wires are heads-major: [b, h, seq, d], or [b, h_kv, g, seq, d] for the queries
        qs = query.reshape(*query.shape[:2], kv_heads, group, query.shape[3])
        qs = jnp.moveaxis(qs, 1, 3) if group > 1 else jnp.moveaxis(qs[:, :, :, 0], 1, 2)
        out = self.kernel(qs, jnp.moveaxis(key, 1, 2), jnp.moveaxis(value, 1, 2))
        out = jnp.moveaxis(out, 3, 1) if group > 1 else jnp.moveaxis(out, 2, 1)
        return out.reshape(query.shape)


class Attention:
    """The entry's callable: ``jax.nn.dot_product_attention``'s arguments, a kernel cache, a derivation count.

    ``derivations`` counts the signatures derived (each derivation is verified and lowered once).

    >>> import jax
    >>> q = jax.random.normal(jax.random.key(0), (1, 24, 4, 16))
    >>> kv = jax.random.normal(jax.random.key(1), (2, 1, 24, 2, 16))
    >>> before = attention.derivations
    >>> out = jax.jit(attention)(q, *kv)
    >>> again = attention(q + 1, *kv)
    >>> attention.derivations - before, out.shape
    (1, (1, 24, 4, 16))
    >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, *kv), atol=1e-5))
    True
    >>> attention(q, *kv, bias=jnp.zeros((24, 24)))
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: attention: bias= is not supported yet: the library's attention takes no array \
inputs beyond Q, K, V; express a mask by index with mask_mod= or a bias with score_mod=
    """

    def __init__(self):
        self._kernels: dict[Signature, AttentionKernel] = {}
        self.derivations = 0

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        scale: float | None = None,
        is_causal: bool = False,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        segment_ids=None,
        backend: str = "auto",
        backward: str = "lowered",
        interpret: bool | None = None,
        hardware: Hardware | str | None = None,
    ):
        """``softmax(score_mod(scale · q kᵀ) masked) v`` on ``[batch, seq, heads, dim]`` arrays, by a cached kernel.

        The arguments are ``jax.nn.dot_product_attention``'s (``bias``, ``mask`` and ``segment_ids`` refused
        until supported), plus FlexAttention's ``score_mod``/``mask_mod`` and :func:`lowering.lower`'s
        ``backend``, ``backward``, ``interpret`` and ``hardware``. Rows whose every key is masked give 0.
        """
        return self.kernel_for(
            query,
            key,
            value,
            bias,
            mask,
            scale=scale,
            is_causal=is_causal,
            score_mod=score_mod,
            mask_mod=mask_mod,
            segment_ids=segment_ids,
            backend=backend,
            backward=backward,
            interpret=interpret,
            hardware=hardware,
        )(query, key, value)

    def kernel_for(self, query, key, value, bias=None, mask=None, **options) -> AttentionKernel:
        """The cached :class:`AttentionKernel` for these arrays (only shapes and dtypes are read) and options;
        derived, verified and lowered on first use, outside any ``jit``/``vmap``/``grad`` trace."""
        signature = Signature.of(query, key, value, bias, mask, **options)
        if signature not in self._kernels:
            # in a thread of its own, where no caller's jit/vmap/grad trace is active (JAX's trace state is
            # per thread): the verification must run on concrete arrays, and the kernel's tracing must not
            # be evaluated eagerly (as under jax.ensure_compile_time_eval)
            with ThreadPoolExecutor(1) as worker:
                derivation = worker.submit(signature.derivation).result()
            kernel = lower(
                derivation,
                signature.backend,
                interpret=signature.interpret,
                backward=signature.backward,
                hardware=signature.hardware,
            )
            self.derivations += 1
            self._kernels[signature] = AttentionKernel(signature, derivation, kernel)
        return self._kernels[signature]

    def __repr__(self):
        return f"<napkin_cat attention entry: {len(self._kernels)} kernels cached, {self.derivations} derivations>"

    def cache_clear(self) -> None:
        """Forget every kernel (the derivation count stays)."""
        self._kernels.clear()


#: the drop-in entry (``nc.attention``, ``lowering._attention``)
attention = Attention()
