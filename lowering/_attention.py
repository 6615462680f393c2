"""``attention``: the drop-in entry, in ``jax.nn.dot_product_attention``'s layout.

For users who want the kernel without writing the diagram: ``attention(q, k, v, ...)`` takes
``[batch, seq, heads, dim]`` arrays (or ``[seq, heads, dim]``), builds the diagram with
:mod:`napkin_cat.library` (grouped-query attention when ``k``/``v`` have fewer heads than ``q``),
derives its schedule by the rule of :func:`schedule`, verifies the derivation once (every step, and the
lowered kernel, on a random trial), lowers it with :func:`lowering.lower` and caches the result per
:class:`Signature`. A second call with an equal signature derives, verifies and lowers nothing, under
``jax.jit``, ``jax.vmap`` and ``jax.grad`` alike. The cache keeps the :data:`CACHE_SIZE` kernels used last
(least recently used first out; ``Attention(maxsize=...)`` or ``attention.maxsize = n`` sets another
bound, ``attention.cache_clear()`` empties it, ``attention.cache_info()`` counts hits and misses).
``attention.kernel_for(q, k, v, ...)`` returns the cached :class:`AttentionKernel`, which states how it was
made: backend, differentiation, derivation.

**The scores**, by the one rule of :mod:`napkin_cat.library`: ``s = score_mod(scale · q kᵀ + bias)``, and then
every mask (``is_causal``, ``mask_mod``, ``mask``, ``segment_ids``) sends the scores it hides to −∞: a
``score_mod`` never sees a masked score, so one sending −∞ to a finite number (a soft-cap, ``exp``) gives a
masked key no weight, and the kernels skip the blocks a mask hides whole.

**Index functions** use FlexAttention's index names: ``score_mod(score, b, h, q_idx, kv_idx)`` and
``mask_mod(b, h, q_idx, kv_idx)`` (a mask keeps a score where it is true). As everywhere in napkin-cat, a
function names only the indices it reads: ``lambda s, q_idx, kv_idx: s - abs(q_idx - kv_idx)`` reads no
head. ``h`` is the query head, as in ``jax.nn`` (under grouped-query attention the entry computes it
from the key/value head and the position in its group). The callables are part of the signature as
Python compares them: a function by identity (define it once, not in a loop, or every call derives
anew), a frozen dataclass such as :class:`~napkin_cat.library.SoftCap` by its fields. A function reading
arrays it is not given (document ids, offsets, a learnable table: :func:`converted`) has each scalar it reads
of them made an input of the kernel, computed at each call (differentiable; new values reuse the kernel), and
is compared by what the kernel computes of it.

**Arrays** (:func:`napkin_cat.library.dot_product_attention` makes them inputs of the diagram, read by the
kernel): ``bias`` (added to the scaled scores; f32, bf16 or f16) and ``mask`` (bool, true keeps a score,
as in ``jax.nn``) broadcast like ``jax.nn``'s, ``[B or 1, H or 1, Nq, Nk]`` (fewer leading axes are read as
1; a size-1 axis is not read per batch or head, and the bias's gradient is summed over it). ``bias`` is
differentiable (a learnable bias). ``segment_ids`` (integers, ``[B, Nq]`` for self-attention or a pair
``(q_ids [B, Nq], kv_ids [B, Nk])``) mask document boundaries: query ``i`` sees key ``j`` only when their
ids agree; the kernel reads the ids at call time, so they may change between calls, and skips the blocks
where no query and key share an id (``docs/lowering.md``, *Block sparsity*). A row whose every key
is masked gives 0, where ``jax.nn`` gives the mean of ``V`` over the keys (it masks with a large finite
negative number); see :mod:`lowering._api`. An empty axis makes no kernel: no queries give an empty
output, no keys an output of zeros (as ``jax.nn``: every row is empty), and their gradients are zeros.
Bad shapes and dtypes raise
:class:`~napkin_cat.errors.EvaluationError` naming the argument and the expected shape, before anything
is built.

**Head dims**: ``v`` may have a head dim of its own (as in MLA: q and k 192, v 128); the output has ``v``'s.
The diagram then has two dim axes, ``d`` for q and k and ``dv`` for v and the output, and the default
``scale`` is ``1/√d`` (q's head dim, as in ``jax.nn``).

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

import dataclasses
import functools
import inspect
import math
import operator
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from lowering._api import BACKENDS, Kernel, OpenKernel, check_layout, lower
from lowering._fp8 import Fp8Scales, check_fp8, scale_probabilities, token_scales
from lowering._plan import NotLowerable, next_pow2
from lowering._plan import _captured as captured
from lowering._target import interpreted, target_hardware
from lowering._tiles import Chunks, fit_blocks
from lowering.mosaic import MOSAIC_BLOCKS, WGMMA_M, admits, unavailable, wgmma_takes
from lowering.triton import TRITON_BLOCKS
from napkin_cat import library
from napkin_cat.axes import axes
from napkin_cat.block_masks import BlockMask
from napkin_cat.diagram import Array, Diagram
from napkin_cat.dtypes import bf16, f16, f32, fp8_e4m3
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators import FLEX_INDICES, Captured, Drop, Rope, check_rate, fname, index_names, positional
from napkin_cat.hardware import Hardware, lookup
from rewrites import Derivation, derive, stream, tile

#: the diagram's query and key axes, which the schedule tiles and streams
QUERIES, KEYS = "q_idx", "kv_idx"

#: how many kernels the entry keeps by default (``Attention(maxsize=...)``, ``attention.maxsize``): enough
#: for every layer variant of a model at a few sequence lengths, bounded for code that makes index functions
#: (closures) per call
CACHE_SIZE = 128


class CacheInfo(NamedTuple):
    """The entry's cache statistics (:meth:`Attention.cache_info`), as ``functools.lru_cache``'s."""

    hits: int
    misses: int
    maxsize: int
    currsize: int


#: the dtypes the entry takes, by ``jnp.dtype`` name (q, k and v share one, as ``jax.nn`` requires)
DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}
#: and with ``fp8_scales`` (:mod:`lowering._fp8`): FP8 inputs, and an FP8 output
FP8_DTYPES = DTYPES | {fp8_e4m3.jax_name: fp8_e4m3}


def schedule(
    q_len: int, kv_len: int, dim: int, value_dim: int | None = None, *, mosaic: bool = False
) -> tuple[int, int]:
    """The rule choosing ``(tile, stream)``: queries per tile and keys per streamed chunk.

    FlashAttention-2's blocks (Dao 2023, §3.3), as benchmarked in ``papers/flash_attention``: 128 queries
    per tile and 64 keys per chunk, never more than the sequence needs: short sequences take the next
    power of two, at least 16 (the smallest block every 16-bit dot accepts). A tile holds a query row of
    ``dim`` and an output row of ``value_dim`` (default: ``dim``) per query, so it halves to 64 queries when
    the two exceed 2 × 128 (so it fits shared memory; for equal dims: a head dim above 128). At exactly
    2 × 128 the chunk is 128 keys: measured on an H100 (bf16, N = 8192,
    ``papers/flash_attention/results/schedule_NVIDIA_H100_80GB_HBM3.json``) the forward runs 14% faster
    (462 against 406 TFLOP/s) and forward + backward 4% (the backward keeps 64-key chunks); at head dim 64
    128-key chunks are 4% slower. Where the kernels run on Mosaic (``mosaic``: an sm_90 GPU under auto, no bias or
    mask array) a head dim with blocks of Mosaic's own (``lowering.mosaic.MOSAIC_BLOCKS``) takes them, for
    sequences of at least one such tile: at D = 64, 256 × 128.

    >>> schedule(8192, 8192, 128), schedule(8192, 8192, 256), schedule(20, 40, 64), schedule(3, 3, 8)
    ((128, 128), (64, 64), (32, 64), (16, 16))
    >>> schedule(8192, 8192, 64), schedule(8192, 8192, 192, 128), schedule(8192, 8192, 160, 96)  # MLA's 192/128
    ((128, 64), (64, 64), (128, 128))
    >>> [schedule(n, m, 64, mosaic=True) for n, m in ((8192, 8192), (8192, 100), (100, 8192))]
    [(256, 128), (256, 128), (128, 64)]
    """
    own = MOSAIC_BLOCKS.entry(dim, value_dim) if mosaic else None
    if own is not None and q_len >= own[0]:
        return TRITON_BLOCKS.fit(own[0], q_len), TRITON_BLOCKS.fit(own[1], kv_len)
    return TRITON_BLOCKS.entry(q_len, kv_len, dim, value_dim)


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
    flags, the index functions (by identity), the window (``jax.nn``'s ``local_window_size`` as ``(left,
    right)``), how to lower, which arrays come beside q, k, v: the axes (``"b"``, ``"h"``, ``"q"``, ``"k"``) a
    bias or a mask is read over (the others it broadcasts over; None: not given), the bias's dtype, whether
    segment ids are (sequence lengths come as segment ids); and the head dims (``head_dims``: q's and k's,
    v's; ``value_dim`` where they differ, and the diagram has an axis of its own for v's), which the diagram
    holds as sizes, so that the registers and shared memory a kernel needs are known when it is lowered
    (``backend="auto"`` takes Mosaic only where they are).
    Shapes with the same schedule and head dims share a kernel: the other sizes stay symbolic, bound at each
    call; so do values (segment ids, masks, biases are read when called).

    >>> x = jnp.zeros((1, 20, 4, 16))
    >>> s = Signature.of(x, x[:, :, :2], x[:, :, :2], is_causal=True)
    >>> s.group, s.tile, s.stream, s.causal, s.dtype
    (2, 32, 32, True, 'float32')
    >>> s = Signature.of(x, x, x, jnp.zeros((1, 4, 20, 20)), jnp.ones((1, 1, 1, 20), bool), local_window_size=3)
    >>> s.bias, s.mask, s.segments, s.window
    (('h', 'q', 'k'), ('k',), False, (3, 3))
    >>> s = Signature.of(jnp.zeros((1, 20, 4, 192)), jnp.zeros((1, 20, 4, 192)), jnp.zeros((1, 20, 4, 128)))
    >>> s.value_dim, s.tile
    (True, 32)
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
    bias: tuple[str, ...] | None = None
    bias_dtype: str = "float32"
    mask: tuple[str, ...] | None = None
    segments: bool = False
    head_dims: tuple[int, int] | None = None
    window: tuple[int, int] | None = None
    rope: Rope | None = None
    rope_positions: bool = False
    fp8: Fp8Scales | None = None
    out_dtype: str | None = None
    dropout: float = 0.0
    broadcast_dropout: bool = False
    #: v's dtype where it differs from q's and k's: FP8 q and k with 16-bit v, FAN's mixed algorithm (Q·Kᵀ in FP8,
    #: P·V in 16 bits; :func:`lowering._fp8.check_fp8`)
    value_dtype: str | None = None

    @property
    def mixed(self) -> bool:
        """Whether Q·Kᵀ runs in FP8 and P·V in 16 bits (q, k e4m3; v 16-bit)."""
        return self.value_dtype is not None

    @property
    def value_dim(self) -> bool:
        """Whether v's head dim differs from q's and k's: the diagram then has an axis of its own for it."""
        return self.head_dims is not None and self.head_dims[0] != self.head_dims[1]

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
        local_window_size: int | tuple[int, int] | None = None,
        backend: str = "auto",
        backward: str = "lowered",
        interpret: bool | None = None,
        hardware: Hardware | str | None = None,
        rope: Rope | None = None,
        fp8_scales=None,
        out_dtype=None,
        dropout_rate: float = 0.0,
        broadcast_dropout: bool = False,
    ) -> Signature:
        """The signature of a call (the arguments of :data:`attention`, ``[batch, seq, heads, dim]`` arrays and
        the rest as :func:`batched` gives them), checked before anything is built."""
        fp8, out_dtype = check_fp8(query, key, value, fp8_scales, out_dtype)
        rate = check_rate(dropout_rate)
        # FAN's mixed algorithm: e4m3 q and k, a 16-bit v (its dtype checked by check_fp8)
        value_dtype = jnp.dtype(value.dtype).name if fp8 is not None and value.dtype != query.dtype else None
        group, dim, value_dim, biased, masked = _checked(
            query, key, value, bias, mask, segment_ids, backend, fp8, mixed=value_dtype is not None
        )
        window = _window(local_window_size)
        backend = _roped(rope, dim, backend)
        if empty(query, key, value):
            raise EvaluationError(
                f"attention: no kernel for an empty axis (q {tuple(query.shape)}, k {tuple(key.shape)}, "
                f"v {tuple(value.shape)}); call attention(q, k, v, ...), which returns the empty or zero output"
            )
        converted_fns = isinstance(score_mod, Captured) or isinstance(mask_mod, Captured)
        arrays = bias is not None or mask is not None or converted_fns
        mosaic = backend != "triton" and unavailable(interpret) is None and not arrays
        # f32 inputs (a head dim padded to Mosaic's wide blocks among them) run on Triton, whose rule fits their blocks
        mosaic = mosaic and wgmma_takes(query.dtype)
        # auto takes Mosaic's own blocks only at head dims it was measured faster at; asked for, at any
        mosaic = mosaic and (backend == "mosaic" or MOSAIC_BLOCKS.measured(dim, value_dim))
        t, s = schedule(query.shape[-3], key.shape[-3], dim, value_dim, mosaic=mosaic)
        fns = score_mod, mask_mod, segment_ids, window, rope, fp8
        plain = all(f is None for f in fns) and rate == 0  # the measured configuration: no variant
        if backward == "lowered" and mosaic and plain and MOSAIC_BLOCKS.fuses_dq(dim, value_dim):
            backward = "fused"  # measured faster there; kernel.backends names the fused dK·dV·dQ kernel
        made = cls(
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
            biased,
            "float32" if bias is None else jnp.dtype(bias.dtype).name,
            masked,
            segment_ids is not None,
            (dim, value_dim),
            window,
            None if rope is None else rope.static(),
            rope is not None and rope.positions is not None,
            fp8,
            out_dtype,
            rate,
            bool(broadcast_dropout) and rate > 0,
            value_dtype,
        )
        return _fitted(made, mosaic and MOSAIC_BLOCKS.entry(dim, value_dim) is not None)

    def derivation(self) -> Derivation:
        """The diagram, derived by the schedule and verified (each step and the lowered kernel, on a trial); FP8's
        probabilities then scaled by ``scale_s`` (:class:`lowering._fp8.scale_probabilities`)."""
        steps = [tile(QUERIES, self.tile), stream(KEYS, self.stream)]
        if self.fp8 is not None and not self.mixed:  # mixed: P stays 16-bit, never rounded to e4m3
            steps.append(scale_probabilities(KEYS, self.fp8.scale_s))
        return derive(self.diagram(), *steps, verify="kernel")

    def fp8_labels(self) -> dict:
        """The diagram's FP8 labels (:mod:`lowering._fp8`, ``nc.library.dot_product_attention``'s keywords): the
        score scale with q's and k's descales, the output's dtype, V laid out keys innermost, the P·V contraction's
        scale (``descale_v``, times ``scale_o`` for an FP8 output); none without FP8."""
        if self.fp8 is None:
            return {}
        f, dim = self.fp8, (self.head_dims or (None,))[0]
        scale = self.scale if self.scale is not None else dim**-0.5
        value = f.descale_v * (f.scale_o if self.out_dtype == fp8_e4m3.jax_name else 1.0)
        labels = dict(scale=f.score(scale), out_dtype=FP8_DTYPES[self.out_dtype], value_scale=value)
        if self.mixed:  # V in 16 bits, laid out as the caller gives it
            return labels | dict(value_dtype=DTYPES[self.value_dtype])
        return labels | dict(values_keys_last=True)

    def diagram(self) -> Diagram:
        """The variant's diagram (``nc.library.dot_product_attention``), its sizes symbolic."""
        sizes = {} if self.head_dims is None else dict(zip(("d", "dv"), self.head_dims, strict=True))
        b, q, x, d, dv = axes(f"b {QUERIES} {KEYS} d dv", **sizes)
        if self.group == 1:
            heads = axes("h")
            kw = dict(batch=(b, *heads))
        else:
            heads = axes("h_kv g")
            kw = dict(batch=(b, *heads), kv_batch=(b, heads[0]))
        kw["seq_at"] = 1  # the caller's [b, seq, heads, d], read in place: no transpose before or after the kernel
        axis = {"b": (b,), "h": heads}  # a bias's or a mask's axes among the batch's (heads: query heads)
        captured = tuple(
            (f, _wires(f, axis | {QUERIES: (q,), KEYS: (x,)}))
            for f in (self.score_mod, self.mask_mod)
            if isinstance(f, Captured)
        )
        mods = {
            k: None if isinstance(f, Captured) else self._indexed(f, k == "score_mod")
            for k, f in (("score_mod", self.score_mod), ("mask", self.mask_mod))
        }
        bias, mask = (
            [None, ""] if a is None else [tuple(x for n in a if n in axis for x in axis[n]), _seq(a)]
            for a in (self.bias, self.mask)
        )
        labels = self.fp8_labels()
        return library.dot_product_attention(
            q,
            x,
            d,
            scale=labels.pop("scale", self.scale),
            causal=self.causal,
            dtype=FP8_DTYPES[self.dtype],
            bias_batch=bias[0],
            bias_seq=bias[1],
            bias_dtype=DTYPES[self.bias_dtype],
            mask_batch=mask[0],
            mask_seq=mask[1],
            segment_batch=(b,) if self.segments else None,
            window=self.window,
            value_dim=dv if self.value_dim else None,
            rope=self.rope,
            rope_batch=(b,) if self.rope_positions else None,
            captured=captured,
            dropout=self._dropout(b, heads) if self.dropout > 0 else None,
            **{k: f for k, f in mods.items() if f is not None},
            **labels,
            **kw,
        )

    def _dropout(self, b, heads: tuple) -> tuple:
        """The diagram's dropout: the keep mask hashed over (batch, query head, query, key), or over (query, key)
        alone under ``broadcast_dropout`` (one mask for every batch row and head, as Flax broadcasts it), and its
        seed's axes (one seed per batch row: the same value, :func:`dropout_seed`)."""
        names = () if self.broadcast_dropout else tuple(a.name for a in heads)
        drop = Drop(self.dropout, QUERIES, KEYS, None if self.broadcast_dropout else "b", names, self.group)
        return drop, (b,)

    def _indexed(self, fn: Callable | None, score: bool) -> Callable | None:
        if fn is not None:  # FlexAttention's convention: four indices after the score, read by position
            fn = positional(fn, ("b", "h", QUERIES, KEYS), score=score)
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


@functools.lru_cache(maxsize=256)
def _fitted(sig: Signature, mosaic: bool = False) -> Signature:
    """``sig`` with the rule's blocks halved (the chunk first) until the variant's kernel fits the target's shared
    memory (:func:`lowering._tiles.fit_blocks`): a bias or mask array is streamed beside K and V and takes its
    share. Blocks of Mosaic's own (``mosaic``) are fitted by Mosaic's checks (:func:`lowering.mosaic.admits`, two
    stages) and, under auto, Triton's too, never below wgmma's 64. Cached: the entry asks on every call.

    >>> x = jnp.zeros((1, 256, 2, 128), jnp.bfloat16)
    >>> plain = Signature.of(x, x, x, hardware="H100")
    >>> biased = Signature.of(x, x, x, jnp.zeros((1, 2, 256, 256), jnp.float32), hardware="H100")
    >>> (plain.tile, plain.stream), (biased.tile, biased.stream)
    ((128, 128), (128, 64))
    """
    hw = lookup(sig.hardware) if sig.hardware is not None else target_hardware(interpreted(sig.interpret))
    standin = MOSAIC_BLOCKS.stands_in(set(sig.head_dims or ()), sig.backend == "auto")
    own = Chunks(sig.stream, WGMMA_M, admits, triton=standin) if mosaic else None
    (t, s), _ = fit_blocks(sig.diagram(), [QUERIES], [KEYS], sig.tile, sig.stream, hw, None, own=own)
    return dataclasses.replace(sig, tile=int(t.g), stream=int(s.s))


def _seq(axes: tuple[str, ...]) -> str:
    """The sequence axes a bias or a mask is read over, as the library names them (``"q"``, ``"x"``)."""
    return ("q" if "q" in axes else "") + ("x" if "k" in axes else "")


def _wires(fn: Captured, axis: dict) -> tuple:
    """The inputs of a converted index function in the diagram: its reads, then the indices it still reads,
    each over its axes (``axis`` maps an index name to the diagram's axes; a read of no index is a per-batch
    value)."""
    named = [(a or ("b",), _read_dtype(t)) for a, t in fn.reads] + [((n,), "i32") for n in fn.indices]
    return tuple(Array(*(x for n in names for x in axis[n]), dtype=t) for names, t in named)


def _read_dtype(name: str) -> str:
    """A read's dtype in the diagram: booleans as bool, integers as i32, floats as f32 (the kernel casts back)."""
    if name == "bool":
        return "bool"
    return "i32" if jnp.issubdtype(jnp.dtype(name), jnp.integer) else "f32"


def converted(fn: Callable | None, score: bool) -> Callable | None:
    """``fn`` as the kernel takes it: a :class:`~napkin_cat.generators.Captured` where it reads arrays it is not
    given (at any depth: :func:`lowering._plan.captured`), which the entry passes as inputs, read at each call;
    else ``fn`` itself.

    >>> ids = jnp.array([0, 0, 1])
    >>> converted(lambda b, h, q_idx, kv_idx: ids[q_idx] == ids[kv_idx], score=False).reads
    ((('q_idx',), 'int32'), (('kv_idx',), 'int32'))
    >>> f = lambda s, q_idx: s + q_idx
    >>> converted(f, score=True) is f
    True
    """
    if fn is None or isinstance(fn, Captured) or not (arrays := captured(fn)):
        return fn
    flex = positional(fn, FLEX_INDICES, score=score)
    names = index_names(flex, score=score)
    names = FLEX_INDICES if names is None else tuple(n for n in FLEX_INDICES if n in names)
    try:
        return Captured.of(flex, names, score=score)
    except (AxisError, jax.errors.TracerArrayConversionError) as e:
        shown = ", ".join(
            f"{what} {tuple(jnp.shape(v))}" + (f" in {where}" if where else "") for (what, where), v in arrays.items()
        )
        why = str(e).splitlines()[0]
        fix = "read each array at the indices, one scalar per score (table[h], ids[q_idx], rel[q_idx - kv_idx])"
        fix += "; a numpy array cannot be indexed by traced indices: capture jnp.asarray(it)"
        why = f"attention: {fname(fn)} reads arrays ({shown}) that cannot become inputs: {why}; {fix}"
        raise NotLowerable(why) from e


def _captured_inputs(fns, query, key, group: int) -> list:
    """The inputs of the converted functions ``fns`` for this call (the arrays they read, read now), as the
    diagram takes them: an axis of query heads split into (key/value head, position in its group)."""
    sizes = {"b": query.shape[0], "h": query.shape[2], QUERIES: query.shape[1], KEYS: key.shape[1]}
    out = []
    for f in fns:
        axes = [a or ("b",) for a, _ in f.reads] + [(n,) for n in f.indices]
        for names, a in zip(axes, f.inputs(sizes), strict=True):
            a = jnp.broadcast_to(a, (sizes["b"],)) if a.ndim == 0 else a
            a = a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a
            a = a.astype(jnp.int32) if jnp.issubdtype(a.dtype, jnp.integer) else a
            if "h" in names and group > 1:
                at = names.index("h")
                a = a.reshape(*a.shape[:at], a.shape[at] // group, group, *a.shape[at + 1 :])
            out.append(a)
    return out


def dropout_seed(key, rate: float, batch: int):
    """The kernel's dropout seed from a JAX PRNG key: 32 random bits, one int32 per batch row (all equal: the batch
    index is hashed with it), or None where ``rate`` is 0 (no dropout, whatever the key). A positive rate without a
    key, or a key that is none, is refused by name.

    >>> dropout_seed(jax.random.key(0), 0.1, 2).shape, dropout_seed(None, 0.0, 2)
    ((2,), None)
    >>> dropout_seed(None, 0.1, 2)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: dropout_rate=0.1 needs dropout_key, a JAX PRNG key \
(jax.random.key(seed)), whose bits seed the keep mask; pass one, or dropout_rate=0 to turn dropout off
    """
    if rate == 0:
        return None
    fix = "a JAX PRNG key (jax.random.key(seed)), whose bits seed the keep mask"
    if key is None:
        raise EvaluationError(f"attention: dropout_rate={rate:g} needs dropout_key, {fix}; pass one, or dropout_rate=0 "
                              "to turn dropout off")
    typed = hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    raw = hasattr(key, "dtype") and key.dtype == jnp.uint32 and key.shape == (2,)
    if not (typed and key.shape == ()) and not raw:
        what = f"{getattr(key, 'dtype', type(key).__name__)} {tuple(getattr(key, 'shape', ()))}"
        raise EvaluationError(f"attention: dropout_key must be {fix} (one key, not a batch of them), got {what}")
    bits = jax.lax.bitcast_convert_type(jax.random.bits(key, (), jnp.uint32), jnp.int32)
    return jnp.broadcast_to(bits, (batch,))


def _window(size) -> tuple[int, int] | None:
    """``jax.nn``'s ``local_window_size`` as ``(left, right)``: an int is a symmetric window. Static: the window is
    part of the kernel (an affine mask, whose blocks are skipped).

    >>> _window(3), _window((4, 0)), _window(None)
    ((3, 3), (4, 0), None)
    """
    if size is None:
        return None
    pair = (size, size) if not isinstance(size, (tuple, list)) else tuple(size)
    try:
        if len(pair) != 2 or any(isinstance(n, bool) for n in pair):
            raise TypeError
        return (operator.index(pair[0]), operator.index(pair[1]))
    except TypeError:
        raise EvaluationError(
            f"attention: local_window_size must be an int or a (left, right) pair of Python ints, as jax.nn takes "
            f"(static: the window is part of the kernel); got {size!r}"
        ) from None


def _before_kernel(rope, dim: int) -> bool:
    """Whether ``rope`` rotates q and k once, by XLA, before the kernel (``Rope(fused=False)``, the default), after
    the checks a kernel rotating them would make (:func:`_roped`).

    >>> _before_kernel(Rope(), 64), _before_kernel(Rope(fused=True), 64), _before_kernel(None, 64)
    (True, False, False)
    """
    if isinstance(rope, Rope) and not rope.fused:
        _roped(rope, dim, "auto")
        return True
    return False


def _roped(rope: Rope | None, dim: int, backend: str) -> str:
    """The backend of a call with ``rope`` (a :class:`~napkin_cat.generators.Rope`), checked against q's and k's head
    dim ``dim``: under ``"auto"``, Triton. Mosaic is refused: its ``wgmma`` reads K from shared memory, and a
    rotated K block lives in registers.

    >>> _roped(Rope(), 64, "auto"), _roped(None, 64, "auto")
    ('triton', 'auto')
    >>> _roped(Rope(rotary_dim=96), 64, "auto")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: rope's rotary_dim = 96 must be at most q's and k's head dim 64 \
(its pairs are rotated, the rest passed through); pass rotary_dim=None to rotate it whole
    """
    if rope is None:
        return backend
    if not isinstance(rope, Rope):
        raise EvaluationError(f"attention: rope must be a napkin_cat.Rope (Rope(base=10000.0, ...)), got {rope!r}")
    if rope.rotary_dim is not None and rope.rotary_dim > dim:
        raise EvaluationError(
            f"attention: rope's rotary_dim = {rope.rotary_dim} must be at most q's and k's head dim {dim} (its pairs "
            "are rotated, the rest passed through); pass rotary_dim=None to rotate it whole"
        )
    if backend == "mosaic":
        raise NotLowerable(
            "attention: rope with backend='mosaic': Mosaic's wgmma reads K from shared memory, and the rotated K "
            "block lives in registers; use backend='triton' (the default 'auto' does) or 'xla'"
        )
    return "triton" if backend == "auto" else backend


def rope_positions(rope: Rope | None, query, key) -> tuple | None:
    """The positions a :class:`~napkin_cat.generators.Rope` reads, as the kernel takes them: a pair ``(q [B, Nq],
    kv [B, Nk])`` of int32, the leading batch axes of ``[..., seq, heads, dim]`` arrays flattened into one (one
    for ``[seq, heads, dim]`` arrays); None where it reads the sequence index. One array serves both sides
    (self-attention).

    >>> x = jnp.zeros((2, 3, 5, 1, 8))
    >>> [p.shape for p in rope_positions(Rope(positions=jnp.zeros((2, 3, 5), int)), x, x)]
    [(6, 5), (6, 5)]
    >>> rope_positions(Rope(positions=jnp.zeros((2, 4), int)), x[0], x[0])
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: rope's positions for the query side are int32 (2, 4); expected \
integers of shape [3, 5] (the arrays' batch axes and sequence), or a pair (q_positions, kv_positions)
    """
    if rope is None or rope.positions is None:
        return None
    pair = rope.positions if isinstance(rope.positions, tuple | list) else (rope.positions, rope.positions)
    lead = tuple(query.shape[:-3])
    out = []
    for side, a, n in (("query", pair[0], query.shape[-3]), ("key/value", pair[1], key.shape[-3])):
        a = jnp.asarray(a)
        if tuple(a.shape) != (*lead, n) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise EvaluationError(
                f"attention: rope's positions for the {side} side are {jnp.dtype(a.dtype).name} {tuple(a.shape)}; "
                f"expected integers of shape {[*lead, n]} (the arrays' batch axes and sequence), or a pair "
                "(q_positions, kv_positions)"
            )
        out.append(a.astype(jnp.int32).reshape(math.prod(lead), n))
    return tuple(out)


def _rotated(rope: Rope, x, positions):
    """``x [..., N, H, D]`` rotated by ``rope`` (:meth:`~napkin_cat.generators.Rope.rotate`), its leading batch axes
    flattened into one as ``positions`` are (:func:`rope_positions`), or none added where it has none."""
    flat = x.reshape((-1, *x.shape[-3:]))
    return rope.rotate(flat, positions).reshape(x.shape)


def _checked(query, key, value, bias, mask, segment_ids, backend: str, fp8=None, mixed: bool = False) -> tuple:
    """Every argument of a call (as :func:`batched` gives them) checked, before anything is built: the group
    size, q's and k's head dim, v's, and the batch axes the bias and the mask are read over (``fp8``: the call's
    :class:`~lowering._fp8.Fp8Scales`, where q, k and v are e4m3; ``mixed``: v is 16-bit beside e4m3 q and k)."""
    if backend != "auto" and backend not in BACKENDS:
        raise NotLowerable(f"attention: backend {backend!r}: choose 'auto', {', '.join(map(repr, BACKENDS))}")
    group, dim, value_dim = _check(query, key, value, FP8_DTYPES if fp8 is not None else DTYPES, mixed)
    shape = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
    biased = None if bias is None else _broadcast("bias", bias, shape, DTYPES)
    masked = None if mask is None else _broadcast("mask", mask, shape, ("bool",))
    if segment_ids is not None:
        _check_segments(segment_ids, query.shape[0], query.shape[1], key.shape[1])
    return group, dim, value_dim, biased, masked


def empty(query, key, value) -> bool:
    """Whether a call (``[batch, seq, heads, dim]`` arrays) has an empty axis, and so no kernel: no batch, heads,
    queries or keys, or a value head dim of 0. Its output is then empty, or zeros where only the keys are none.

    >>> x = jnp.zeros((2, 5, 4, 16))
    >>> empty(x, x, x), empty(x, x[:, :0], x[:, :0]), empty(x[:, :0], x, x)
    (False, True, True)
    """
    return 0 in (*query.shape[:-1], *key.shape[:-1], *value.shape[-1:])


def _check(query, key, value, dtypes=DTYPES, mixed: bool = False) -> tuple[int, int, int]:
    """Refuse arrays the entry cannot take, naming the condition; the group size, q's and k's head dim and
    v's otherwise (``mixed``: v's dtype is not q's and k's, FAN's mixed algorithm, checked by ``check_fp8``)."""
    shapes = f"q {tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)}"
    if not query.ndim == key.ndim == value.ndim or query.ndim not in (3, 4):
        raise EvaluationError(f"attention: q, k, v must all be [batch, seq, heads, dim] or [seq, heads, dim]; {shapes}")
    if key.shape[:-1] != value.shape[:-1]:
        raise EvaluationError(f"attention: k and v must agree on batch, keys and heads; {shapes}")
    if query.shape[-1] != key.shape[-1] or query.shape[:-3] != key.shape[:-3]:
        raise EvaluationError(f"attention: q and k must agree on batch and head dim; {shapes}")
    heads, kv_heads = query.shape[-2], key.shape[-2]
    if heads % kv_heads if kv_heads else heads:
        raise EvaluationError(f"attention: q's {heads} heads are not a multiple of k's and v's {kv_heads}; {shapes}")
    if query.shape[-1] == 0:
        raise EvaluationError(f"attention: q's and k's head dim is 0 (the scores and 1/√d are undefined); {shapes}")
    names = {jnp.dtype(a.dtype).name for a in ((query, key) if mixed else (query, key, value))}
    if len(names) != 1 or not names <= dtypes.keys():
        fp8 = "" if fp8_e4m3.jax_name in dtypes else f" ({fp8_e4m3.jax_name} with fp8_scales)"
        raise EvaluationError(
            f"attention: q, k, v must share one dtype of {', '.join(dtypes)}{fp8}; got {sorted(names)}"
        )
    return heads // max(kv_heads, 1), query.shape[-1], value.shape[-1]


#: a bias's or a mask's axes, as :attr:`Signature.bias` names them
BROADCAST = ("b", "h", "q", "k")


def _broadcast(name: str, array, shape: tuple[int, int, int, int], dtypes) -> tuple[str, ...]:
    """Check a bias or mask (4-D, as :func:`batched` makes it) against ``(batch, heads, Nq, Nk)``, numpy's
    broadcasting (each axis its size or 1); the axes it is read over: among ``"b"``, ``"h"``, ``"q"``, ``"k"``
    those whose size is not 1 (a size-1 axis is broadcast, never materialised)."""
    got, dtype = tuple(array.shape), jnp.dtype(array.dtype).name
    if len(got) != 4 or any(n not in (1, m) for n, m in zip(got, shape, strict=True)):
        raise EvaluationError(
            f"attention: {name} has shape {got}, which does not broadcast to [B, H, Nq, Nk] = {list(shape)}; "
            "give each axis its size or 1 (fewer axes are read as leading 1s, as numpy broadcasts)"
        )
    if dtype not in dtypes:
        raise EvaluationError(f"attention: {name} has dtype {dtype}; expected one of {', '.join(dtypes)}")
    return tuple(a for a, n in zip(BROADCAST, got, strict=True) if n != 1)


def _check_segments(ids, batch: int, q_len: int, kv_len: int) -> None:
    """Check segment ids (a pair, as :func:`batched` makes it): integers, ``[B, Nq]`` and ``[B, Nk]``."""
    for side, a, n in (("query", ids[0], q_len), ("key/value", ids[1], kv_len)):
        if tuple(a.shape) != (batch, n) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise EvaluationError(
                f"attention: segment_ids for the {side} side are {jnp.dtype(a.dtype).name} {tuple(a.shape)}; "
                f"expected integers of shape [B, N{'q' if side == 'query' else 'k'}] = {[batch, n]}"
            )


def batched(query, key, value, bias=None, mask=None, segment_ids=None):
    """The entry's arguments with one batch axis: ``[seq, heads, dim]`` arrays get one, ``[..., seq, heads,
    dim]`` arrays have their leading batch axes flattened into one; a bias or mask gets leading axes of size 1
    up to the arrays' rank (as numpy broadcasts) and its leading batch axes flattened likewise (kept of size 1
    where it broadcasts over them all; materialised over them only where it broadcasts over some and not
    others); segment ids become a ``(q_ids, kv_ids)`` pair (one array serves both sides, for self-attention),
    each ``[batch, seq]``.

    >>> x = jnp.zeros((5, 2, 16))
    >>> q, k, v, bias, mask, ids = batched(x, x, x, jnp.zeros((5, 5)), None, jnp.zeros(5, int))
    >>> q.shape, bias.shape, mask, ids[1].shape
    ((1, 5, 2, 16), (1, 1, 5, 5), None, (1, 5))
    >>> x = jnp.zeros((3, 4, 5, 2, 16))
    >>> q, k, v, bias, mask, ids = batched(x, x, x, jnp.zeros((4, 1, 1, 5)), jnp.ones((5, 5), bool))
    >>> q.shape, bias.shape, mask.shape
    ((12, 5, 2, 16), (12, 1, 1, 5), (1, 1, 5, 5))
    """
    if query.ndim == 3 and key.ndim == value.ndim == 3:
        query, key, value = query[None], key[None], value[None]
        if segment_ids is not None:
            segment_ids = tuple(a[None] for a in segment_ids) if isinstance(segment_ids, tuple) else segment_ids[None]
    lead = tuple(query.shape[:-3])
    if query.ndim > 4 and key.ndim == value.ndim == query.ndim:
        if key.shape[:-3] != lead or value.shape[:-3] != lead:
            raise EvaluationError(
                f"attention: q, k, v must share their leading batch axes; q {tuple(query.shape)}, "
                f"k {tuple(key.shape)}, v {tuple(value.shape)}"
            )
        query, key, value = (a.reshape(math.prod(lead), *a.shape[-3:]) for a in (query, key, value))
        if segment_ids is not None:
            flat = lambda a: a.reshape(math.prod(lead), a.shape[-1]) if a.ndim == len(lead) + 1 else a
            segment_ids = tuple(map(flat, segment_ids)) if isinstance(segment_ids, tuple) else flat(segment_ids)
    bias, mask = (None if a is None else _flat_batch(n, a, lead) for n, a in (("bias", bias), ("mask", mask)))
    if segment_ids is not None and not isinstance(segment_ids, tuple):
        segment_ids = (segment_ids, segment_ids)
    return query, key, value, bias, mask, segment_ids


def _flat_batch(name: str, array, lead: tuple[int, ...]):
    """A bias or mask broadcasting to ``[*lead, H, Nq, Nk]`` as a 4-D array ``[B or 1, H or 1, Nq or 1, Nk or 1]``,
    its leading axes flattened into one (:func:`batched`); a rank beyond the arrays' is refused."""
    n = max(len(lead), 1)
    if array.ndim > n + 3:
        raise EvaluationError(
            f"attention: {name} has {array.ndim} axes {tuple(array.shape)}; expected at most {n + 3}, broadcasting to "
            f"[*batch, H, Nq, Nk] with batch {lead or (1,)}"
        )
    a = jnp.reshape(array, (1,) * (n + 3 - array.ndim) + tuple(array.shape))
    if len(lead) <= 1:
        return a
    head, rest = tuple(a.shape[:n]), tuple(a.shape[n:])
    if all(m == 1 for m in head):
        return a.reshape(1, *rest)
    if head != lead:
        if any(m not in (1, k) for m, k in zip(head, lead, strict=True)):
            raise EvaluationError(
                f"attention: {name} has shape {tuple(array.shape)}, whose batch axes {head} do not broadcast to "
                f"the arrays' {lead}; give each its size or 1"
            )
        a = jnp.broadcast_to(a, lead + rest)  # over some leading batch axes only: those are materialised
    return a.reshape(math.prod(lead), *rest)


#: the ids marking a query past its sequence's length, and a key past it, where the caller gives segment ids
#: too (they must then lie strictly between int32's extremes); without segment ids, -1 and 1 (a block of
#: padded queries and a block of padded keys never share a range of ids: both are skipped)
PAD_IDS = (-(2**31), 2**31 - 1)


def length_ids(query, key, segment_ids=None, query_seq_lengths=None, key_value_seq_lengths=None):
    """``jax.nn``'s sequence lengths as segment ids (``[..., Nq]`` and ``[..., Nk]``, for arrays
    ``[..., seq, heads, dim]``): query ``i`` of sequence ``b`` past ``query_seq_lengths[b]`` sees no key (its
    output is 0, as ``jax.nn``'s), key ``j`` past ``key_value_seq_lengths[b]`` is seen by no query; combined
    with the caller's ``segment_ids``. The ids are read when the kernel is called, so new lengths reuse it, and
    the kernel skips the blocks past a length (:class:`~napkin_cat.library.SameSegment`).

    >>> x = jnp.zeros((2, 4, 1, 8))
    >>> q_ids, kv_ids = length_ids(x, x, None, jnp.array([4, 2]), jnp.array([3, 1]))
    >>> q_ids.tolist(), kv_ids.tolist()
    ([[0, 0, 0, 0], [0, 0, -1, -1]], [[0, 0, 0, 1], [0, 1, 1, 1]])
    """
    if query_seq_lengths is None and key_value_seq_lengths is None:
        return segment_ids
    lead = tuple(query.shape[:-3])
    pair = segment_ids if segment_ids is None or isinstance(segment_ids, tuple) else (segment_ids, segment_ids)
    pads = (-1, 1) if pair is None else PAD_IDS
    out = []
    sides = (("query_seq_lengths", query_seq_lengths, query), ("key_value_seq_lengths", key_value_seq_lengths, key))
    for i, (name, lengths, a) in enumerate(sides):
        n = a.shape[-3]
        ids = jnp.zeros((*lead, n), jnp.int32) if pair is None else jnp.asarray(pair[i])
        if tuple(ids.shape) != (*lead, n) or not jnp.issubdtype(ids.dtype, jnp.integer):
            raise EvaluationError(
                f"attention: segment_ids for the {('query', 'key/value')[i]} side are {jnp.dtype(ids.dtype).name} "
                f"{tuple(ids.shape)}; expected integers of shape {[*lead, n]}"
            )
        ids = ids.astype(jnp.int32)
        if lengths is not None:
            ids = jnp.where(jnp.arange(n) < _lengths(name, lengths, lead)[..., None], ids, pads[i])
        out.append(ids)
    return tuple(out)


def _lengths(name: str, lengths, lead: tuple[int, ...]):
    """Sequence lengths checked: integers, one per sequence (``lead``: the batch axes; a ``[seq, heads, dim]``
    call has one sequence, its length given as ``[1]``, as ``jax.nn`` takes it, or as a scalar)."""
    a = jnp.asarray(lengths)
    want = lead or (1,)
    if not jnp.issubdtype(a.dtype, jnp.integer) or tuple(a.shape) not in (want, lead):
        raise EvaluationError(
            f"attention: {name} is {jnp.dtype(a.dtype).name} {tuple(a.shape)}; expected integers of shape "
            f"{list(want)}, one length per sequence (as jax.nn's)"
        )
    return a.reshape(lead)


def _implementation(implementation, backend: str) -> str:
    """``jax.nn``'s ``implementation`` as a backend: None keeps ``backend`` (napkin-cat's derived kernel),
    ``"xla"`` is the plain-JAX backend (``backend="xla"``), ``"cudnn"`` is refused (napkin-cat is not cuDNN).

    >>> _implementation(None, "triton"), _implementation("xla", "auto")
    ('triton', 'xla')
    """
    if implementation is None:
        return backend
    if implementation == "cudnn":
        raise NotLowerable(
            "attention: implementation='cudnn' asks for NVIDIA's cuDNN kernel, which napkin-cat is not; call "
            "jax.nn.dot_product_attention(..., implementation='cudnn') for it, or pass implementation=None "
            "(napkin-cat's derived kernel) or 'xla' (the same derivation on the plain-JAX backend)"
        )
    if implementation != "xla":
        raise NotLowerable(f"attention: implementation={implementation!r}: choose None, 'xla' or 'cudnn', as jax.nn")
    if backend not in ("auto", "xla"):
        raise NotLowerable(
            f"attention: implementation='xla' is backend='xla', but backend={backend!r} was given; pass one of them"
        )
    return "xla"


def padded_heads(query, key, value, scale, rope):
    """q, k and v with each head dim that is not a power of two zero-padded to the next (at least 16), and the
    scale that keeps ``1/√d`` of the unpadded ``d``: zeros add nothing to a score, and v's padded columns, sliced
    off the output, give nothing to the other gradients. The kernels then hold blocks of the head dims they would
    pad to anyway, read in bounds: compiled, the Triton dK·dV kernel at a padded head dim of 80 or 96 (bf16,
    causal) returned dK wrong by 13–28% while dQ and dV were right. Not with ``rope`` (it rotates pairs across
    the unpadded head dim).

    >>> x = jnp.ones((1, 4, 2, 96))
    >>> q, k, v, scale = padded_heads(x, x, x[..., :80], None, None)
    >>> q.shape[-1], v.shape[-1], round(scale * 96**0.5, 6)
    (128, 128, 1.0)
    """
    width = lambda a: max(next_pow2(a.shape[-1]), 16)  # noqa: E731
    arrays = (query, key, value)
    fine = any(jnp.ndim(a) < 1 or jnp.size(a) == 0 for a in arrays) or all(a.shape[-1] == width(a) for a in arrays)
    if rope is not None or fine or query.shape[-1] != key.shape[-1]:  # the checks refuse q and k that differ
        return query, key, value, scale
    pad = lambda a: jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, width(a) - a.shape[-1])])  # noqa: E731
    return pad(query), pad(key), pad(value), query.shape[-1] ** -0.5 if scale is None else scale


def _scaled(query, scale, fp8: bool = False):
    """A traced ``scale`` (a ``jax.grad`` or ``jax.jit`` argument) multiplies the queries before the kernel, whose
    scale then stays a static 1; a Python number (or a concrete array) is the kernel's own static scale.
    Gradients reach a traced scale through that product. FP8 queries (``fp8``) are not rescaled: refused."""
    if not isinstance(scale, jax.core.Tracer):
        return query, scale
    if fp8:
        raise EvaluationError(
            "attention: a traced scale with FP8 inputs would requantise q; pass scale as a Python number (or fold "
            "it into fp8_scales' descale_q)"
        )
    return (query.astype(jnp.float32) * scale).astype(query.dtype), 1.0


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
        """The backend that emitted the kernel (``"triton"`` or ``"mosaic"``)."""
        return self.kernel.backend

    @property
    def differentiation(self) -> str:
        """How gradients are computed: ``"lowered"`` (derived backward kernels) or another mode the
        kernel states (see :class:`~lowering.Kernel`)."""
        return self.kernel.differentiation

    @property
    def why_not(self) -> str | None:
        """Why the kernel has no lowered backward, or None when it has one."""
        return self.kernel.why_not

    def sparsity(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        segment_ids=None,
        *,
        positions: tuple | None = None,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
    ):
        """The blocks the forward kernel skips, runs unmasked and runs masked on these arrays, and how they were
        found (:class:`lowering._sparsity.Sparsity`): symbolically (affine masks), from segment ids, or at call time
        from a mask's block map (over captured arrays: pass the functions, ``score_mod``/``mask_mod``, whose
        arrays' values this call reads); a mask whose blocks no rule finds is named in its note.

        >>> x = jnp.ones((1, 64, 2, 16))
        >>> attention.kernel_for(x, x, x, is_causal=True).sparsity(x, x, x).found
        ('symbolic',)
        >>> doc = jnp.repeat(jnp.arange(4), 16)
        >>> same = lambda b, h, q_idx, kv_idx: doc[q_idx] == doc[kv_idx]
        >>> attention.kernel_for(x, x, x, mask_mod=same).sparsity(x, x, x, mask_mod=same).found
        ('call time (captured arrays)',)
        """
        batch = batched(query, key, value, bias, mask, segment_ids)
        fns = [f for f in (converted(score_mod, True), converted(mask_mod, False)) if isinstance(f, Captured)]
        wanted = [f for f in (self.signature.score_mod, self.signature.mask_mod) if isinstance(f, Captured)]
        if [f.abstract() for f in fns] != wanted:
            raise EvaluationError(
                f"attention kernel for captured functions {[fname(f) for f in wanted]}: sparsity was given "
                f"{[fname(f) for f in fns]}; pass the score_mod= and mask_mod= the kernel was made for, whose "
                "arrays' values it reads"
            )
        captured = _captured_inputs(fns, batch[0], batch[1], self.signature.group)
        seed = jnp.zeros(batch[0].shape[:1], jnp.int32)  # the dropout's seed (where it has one) hides no block
        return self.kernel.forward.sparsity(*self._arrays(*batch, positions, captured, seed))

    def _arrays(self, query, key, value, bias, mask, segment_ids, positions, captured, seed=None) -> tuple:
        """The kernel's inputs, in the diagram's order, from arrays as :func:`batched` gives them: the queries
        ``[b, seq, h_kv, g, d]`` under grouped-query attention (a reshape of the caller's ``[b, seq, h, d]``), k,
        v, the bias, the converted functions' inputs, the mask, the segment ids, the dropout's seed, RoPE's
        positions."""
        kv_heads, group = key.shape[2], self.signature.group
        qs = query.reshape(*query.shape[:2], kv_heads, group, query.shape[3]) if group > 1 else query
        pairs = ((bias, self.signature.bias), (mask, self.signature.mask))
        extra = [_operand(a, axes, kv_heads, group) for a, axes in pairs if a is not None]
        extra[int(bias is not None) : int(bias is not None)] = list(captured)
        if segment_ids is not None:
            extra += [a.astype(jnp.int32) for a in segment_ids]
        if self.signature.fp8 is not None and not self.signature.mixed:  # V keys innermost, [b, h_kv, dv, kv]:
            # FP8 wgmma reads it K-major
            value = jnp.transpose(value, (0, 2, 3, 1))
        if self.signature.dropout > 0:
            if seed is None:
                raise EvaluationError(
                    f"attention kernel with dropout {self.signature.dropout:g}: called without its seed; pass "
                    "seed=dropout_seed(key, rate, batch)"
                )
            extra.append(seed)
        return (qs, key, value, *extra, *(positions or ()))

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        segment_ids=None,
        *,
        positions: tuple | None = None,
        return_residual: bool = False,
        captured=(),
        seed=None,
    ):
        shape = (*query.shape[:-1], value.shape[-1])
        query, key, value, bias, mask, segment_ids = batched(query, key, value, bias, mask, segment_ids)
        sig = self.signature
        if sig.rope_positions != (positions is not None):
            raise EvaluationError(
                f"attention kernel for rope positions {'given' if sig.rope_positions else 'absent'}, called with "
                f"them {'given' if positions is not None else 'absent'} (rope_positions() makes them)"
            )
        fp8 = dict(fp8_scales=sig.fp8, out_dtype=sig.out_dtype) if sig.fp8 is not None else {}
        got = Signature.of(query, key, value, bias, mask, segment_ids=segment_ids, **fp8)
        mine = (sig.dtype, sig.group, sig.head_dims, sig.bias, sig.bias_dtype, sig.mask, sig.segments)
        theirs = (got.dtype, got.group, got.head_dims, got.bias, got.bias_dtype, got.mask, got.segments)
        if mine != theirs:
            fields = "(dtype, group, head dims, bias axes, bias dtype, mask axes, segment ids)"
            raise EvaluationError(f"attention kernel for {fields} = {mine}, called with {theirs}")
        arrays = self._arrays(query, key, value, bias, mask, segment_ids, positions, captured, seed)
        if not return_residual:
            return self.kernel(*arrays).reshape(shape)
        out, lse = _with_residual(self.kernel, arrays)
        # L is [b, heads..., q] (query heads, split as (h_kv, g) under grouped-query attention): jax.nn's [b, q, h]
        lse = jnp.moveaxis(lse.reshape(query.shape[0], query.shape[2], query.shape[1]), 1, 2)
        # a row with every key masked: jax.nn's log-sum-exp of its large finite negative logits, not −∞
        lse = jnp.where(lse == -jnp.inf, -0.7 * jnp.finfo(jnp.float32).max, lse)
        return out.reshape(shape), lse.astype(key.dtype).reshape(shape[:-1])


def _with_residual(kernel, arrays) -> tuple:
    """The kernel's output and its log-sum-exp ``L`` (natural log, of the scaled, biased, masked scores: the
    residual its lowered backward reads, FlashAttention-2 §3.1.1), from the one forward with residuals; ``L``
    carries no gradient (as ``jax.nn``'s), and differentiating the output runs the kernel's lowered backward
    (recomputing the forward once more). Refused where the kernel has no lowered backward, so no such forward."""
    made = kernel.at(**check_layout(kernel.diagram, arrays)) if isinstance(kernel, OpenKernel) else kernel
    if made.differentiation != "lowered":
        why = made.why_not or f"backward={made.differentiation!r}"
        raise NotLowerable(
            f"attention: return_residual reads the log-sum-exp of the lowered forward with residuals, which this "
            f"kernel (differentiation={made.differentiation!r}) has none of ({why}); call with backward='lowered'"
        )
    forward = made.kernels[0]

    @jax.custom_vjp
    def f(*xs):
        outs = forward(*xs)
        return outs[0], jax.lax.stop_gradient(outs[1])

    def f_fwd(*xs):
        return f(*xs), xs

    def f_bwd(xs, cts):
        return jax.vjp(kernel, *xs)[1](cts[0])

    f.defvjp(f_fwd, f_bwd)
    return f(*arrays)


def _operand(array, axes: tuple[str, ...], kv_heads: int, group: int):
    """A 4-D bias or mask as the diagram's input: without its broadcast (size-1) axes, and heads split
    into ``(h_kv, g)`` under grouped-query attention."""
    a = array[tuple(slice(None) if n in axes else 0 for n in BROADCAST)]
    if "h" in axes and group > 1:
        at = int("b" in axes)
        a = a.reshape(*a.shape[:at], kv_heads, group, *a.shape[at + 1 :])
    return a


class Attention:
    """The entry's callable: ``jax.nn.dot_product_attention``'s arguments, a kernel cache, a derivation count.

    ``derivations`` counts the signatures derived (each derivation is verified and lowered once). The cache
    holds at most ``maxsize`` kernels (default :data:`CACHE_SIZE`), the least recently used evicted first: a
    kernel holds its derivation and its compiled programs, and a signature holds its index functions.

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

    A learnable bias gets its gradient from the lowered backward, summed over the axes it broadcasts:

    >>> bias = jax.random.normal(jax.random.key(2), (1, 4, 24, 24))
    >>> mask = jnp.tril(jnp.ones((24, 24), bool))
    >>> loss = lambda f: lambda bias: f(q, *kv, bias=bias, mask=mask).sum()
    >>> dbias, want = jax.grad(loss(attention))(bias), jax.grad(loss(jax.nn.dot_product_attention))(bias)
    >>> dbias.shape, bool(jnp.allclose(dbias, want, atol=1e-5))
    ((1, 4, 24, 24), True)
    >>> attention(q, *kv, bias=jnp.zeros((24, 12)))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: attention: bias has shape (1, 1, 24, 12), which does not broadcast to \
[B, H, Nq, Nk] = [1, 4, 24, 24]; give each axis its size or 1 (fewer axes are read as leading 1s, as numpy broadcasts)
    """

    def __init__(self, maxsize: int | None = None):
        self._kernels: OrderedDict[Signature, AttentionKernel] = OrderedDict()
        self.maxsize = CACHE_SIZE if maxsize is None else maxsize
        self.derivations = self._hits = 0

    @property
    def maxsize(self) -> int:
        """The most kernels the cache holds; setting it evicts the least recently used beyond it.

        >>> small = Attention(maxsize=4)
        >>> small.maxsize = 0
        Traceback (most recent call last):
        ...
        napkin_cat.errors.EvaluationError: attention: the kernel cache's maxsize must be an integer ≥ 1, got 0
        """
        return self._maxsize

    @maxsize.setter
    def maxsize(self, n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise EvaluationError(f"attention: the kernel cache's maxsize must be an integer ≥ 1, got {n!r}")
        self._maxsize = n
        while len(self._kernels) > n:
            self._kernels.popitem(last=False)

    def __call__(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        scale=None,
        is_causal: bool = False,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        local_window_size: int | tuple[int, int] | None = None,
        implementation: str | None = None,
        return_residual: bool = False,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        segment_ids=None,
        block_mask: BlockMask | None = None,
        backend: str = "auto",
        backward: str = "lowered",
        interpret: bool | None = None,
        hardware: Hardware | str | None = None,
        rope: Rope | None = None,
        fp8_scales=None,
        out_dtype=None,
        dropout_rate: float = 0.0,
        dropout_key=None,
        broadcast_dropout: bool = False,
        split_keys: bool | None = None,
    ):
        """``softmax(score_mod(scale · q kᵀ + bias) masked) v`` on ``[..., seq, heads, dim]`` arrays, by a cached
        kernel; every mask applies after ``score_mod`` (the module's docstring).

        The arguments are ``jax.nn.dot_product_attention``'s, in its order: ``bias`` and ``mask`` of any shape
        that numpy-broadcasts to ``[B, H, Nq, Nk]``, never materialised (a size-1 axis is not read: a
        ``[B, 1, 1, Nk]`` key-padding mask stays ``[B, Nk]`` in the kernel's inputs); ``scale`` (a traced one
        multiplies q before the kernel, whose scale stays static); ``is_causal``; ``query_seq_lengths`` and
        ``key_value_seq_lengths`` (per-sequence integers, read at call time as segment ids: :func:`length_ids`);
        ``local_window_size`` (an int or ``(left, right)``, an affine mask whose outside blocks are skipped);
        ``implementation`` (None: napkin-cat's kernel on ``backend``; ``"xla"``: ``backend="xla"``; ``"cudnn"``:
        refused, napkin-cat is not cuDNN); ``return_residual`` (returns ``(out, lse)``, the log-sum-exp
        ``[..., Nq, H]`` of the scaled, biased, masked scores in the inputs' dtype, as ``jax.nn``: the lowered
        forward's residual, without gradient; past a query length jax.nn's value, −0.7 · f32's max; a row
        whose every key a mask hides has no meaningful one, where jax.nn gives that value too). Several
        leading batch axes are flattened into one and restored. Then ``segment_ids`` (document masking),
        FlexAttention's ``score_mod``/``mask_mod`` (or a ``block_mask``, :func:`napkin_cat.block_mask`: a mask
        function with its blocks computed ahead, for ``[B, H, Nq, Nk]`` of this call),
        :func:`lowering.lower`'s ``backend``, ``backward``, ``interpret`` and ``hardware``, and ``rope`` (a
        :class:`~napkin_cat.generators.Rope`: q and k rotated before the kernel, or with ``Rope(fused=True)`` inside
        the kernels as their blocks load, forward and backward; its ``positions``, ``[..., N]`` integers or a
        ``(q, kv)`` pair, are read at each call). Rows
        whose every key is masked give 0 (jax.nn gives the mean of ``V``, except past ``query_seq_lengths``, where
        it gives 0 too); an empty axis gives an empty output, or zeros where there are no keys. See the module's
        docstring.

        **Decode steps**: a call of one query token per sequence against at least 512 keys (``[..., 1, H, D]``
        against ``[..., Nk, H_kv, D]``, with at most ``scale``, ``key_value_seq_lengths`` and ``interpret``: what
        ``jax.nn`` users write to decode) runs :func:`lowering.decode_attention`'s split-KV kernel and merge, where
        the attention kernels would run one program per (batch, head) over the whole cache (:meth:`splits_keys`
        says which a call takes). Its gradient is the attention kernels'. ``split_keys=False`` keeps the attention
        kernels; ``split_keys=True`` refuses a call that is not a decode step.

        **FP8** (forward only; :mod:`lowering._fp8`): q, k and v in ``jnp.float8_e4m3fn`` with ``fp8_scales``, a
        dict of cuDNN's per-tensor factors ``descale_q``, ``descale_k``, ``descale_v``, ``scale_s`` (and
        ``scale_o``; or cuDNN's whole ``fp8_params``), Python numbers or concrete one-element arrays. Scores
        ``(q·dq)(k·dk)ᵀ·scale`` in f32, the probabilities times ``scale_s`` rounded to e4m3 for an FP8 P·V, the
        output times ``dv`` and divided by ``scale_s``: bf16 by default (``out_dtype``: bf16, f16, f32, or e4m3,
        then times ``scale_o``). Unlike cuDNN's, no amax is returned. Differentiating an FP8 call raises
        :class:`~lowering.NotLowerable`. q and k in e4m3 with v in bf16 or f16 is FAN's mixed algorithm: Q·Kᵀ in FP8,
        P·V in v's 16 bits (only ``descale_q`` and ``descale_k`` needed; docs/mosaic.md). ``descale_q`` and
        ``descale_k`` may also be arrays, one per token and head (``[..., Nq, H]``, ``[..., Nk, H_kv]``: as
        :func:`lowering.fp8_quantize` makes with ``per="token"``), read at each call, even traced
        (:func:`lowering._fp8.token_scales`: a score modifier over them; Mosaic's kernel on sm_90, at 0.80× the
        per-tensor kernel's rate on an H200, docs/mosaic.md).

        >>> q8, k8, v8 = (jax.random.normal(jax.random.key(i), (1, 32, 2, 16)).astype(jnp.float8_e4m3fn)
        ...               for i in range(3))
        >>> attention(q8, k8, v8, is_causal=True)  # with fp8_scales=dict(...): tests/test_fp8.py
        Traceback (most recent call last):
        ...
        napkin_cat.errors.EvaluationError: attention: q, k, v are float8_e4m3fn but fp8_scales is missing; pass \
fp8_scales=dict(descale_q=..., descale_k=..., descale_v=..., scale_s=...) (1.0 each for unscaled inputs)

        **Dropout** (``dropout_rate`` ``p`` in ``[0, 1)``, ``dropout_key`` a JAX PRNG key; Flax's
        ``broadcast_dropout`` shares one mask across batch rows and heads): ``O = (softmax(S) ⊙ M / (1 − p)) · V``, the
        keep mask ``M`` hashed inside the kernels from the key's bits and each weight's (batch, query head, query,
        key) indices (:mod:`napkin_cat.generators._dropout`), regenerated by the backward, never stored; ``p = 0`` is
        the kernel without dropout. The rate is part of the kernel; a new key reuses it.

        >>> import jax
        >>> q, k, v = (jax.random.normal(jax.random.key(i), (2, 3, 20, 4, 16)) for i in range(3))
        >>> keep = jax.random.bernoulli(jax.random.key(3), 0.8, (3, 1, 1, 20))  # key padding, per batch row
        >>> lengths = jnp.array([[20, 17, 12], [14, 20, 16]])
        >>> out, lse = attention(q, k, v, mask=keep, key_value_seq_lengths=lengths, return_residual=True)
        >>> nn = lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, mask=keep, key_value_seq_lengths=n,
        ...                                                      return_residual=True)
        >>> ref, ref_lse = jax.vmap(nn)(q, k, v, lengths)
        >>> out.shape, lse.shape, bool(jnp.allclose(out, ref, atol=1e-5)), bool(jnp.allclose(lse, ref_lse, atol=1e-5))
        ((2, 3, 20, 4, 16), (2, 3, 20, 4), True, True)

        Sharding rule (:mod:`lowering._spmd`): the batch and head axes may be sharded (data and tensor
        parallelism), and the query axis where no mask or score modifier reads its index (not under
        ``is_causal``); the kernel then runs per shard, forward and backward, and the output keeps the query's
        sharding, under Explicit or Auto mesh axes and inside ``jax.shard_map``. A sharded key axis or head dim
        is refused with :class:`~lowering.NotLowerable` (reshard, or ring attention: docs/multi_device.md).
        ``return_residual`` calls the forward with residuals unsharded.
        """
        options = {k: v for k, v in locals().items() if k not in ("self", "query", "key", "value")}  # first: args only
        decode = self.splits_keys(query, key, value, **{**options, "split_keys": None})
        if split_keys and not decode:
            raise EvaluationError(
                "attention: split_keys=True asks for a decode step (nc.decode_attention's split-KV), and this call is "
                "not one: it takes one query token per sequence, keys of at least "
                f"{SPLIT_KEYS}, a static scale, one device and none of the other options (q {tuple(query.shape)}, "
                f"k {tuple(key.shape)}); pass split_keys=None to let the entry choose"
            )
        if decode and split_keys is not False:
            return _split_kv(self, query, key, value, key_value_seq_lengths, scale, interpret)
        backend = _implementation(implementation, backend)
        rate = check_rate(dropout_rate)
        value_dim = value.shape[-1]
        if _before_kernel(rope, query.shape[-1]):
            sides = rope_positions(rope, query, key) or (None, None)
            query, key = (_rotated(rope, x, at) for x, at in zip((query, key), sides, strict=True))
            rope = None
        query, key, value, scale = padded_heads(query, key, value, scale, rope)
        query, scale = _scaled(query, scale, fp8_scales is not None)
        fp8_scales, score_mod = token_scales(fp8_scales, score_mod, query, key)
        segment_ids = length_ids(query, key, segment_ids, query_seq_lengths, key_value_seq_lengths)
        positions = rope_positions(rope, query, key)
        args = batched(query, key, value, bias, mask, segment_ids)
        if empty(*args[:3]):
            _checked(*args, backend)
            _window(local_window_size)
            fp8, out_dtype = check_fp8(query, key, value, fp8_scales, out_dtype)
            # no keys: each row's sum is empty
            out = jnp.zeros((*query.shape[:-1], value_dim), query.dtype if fp8 is None else out_dtype)
            return (out, jnp.full(query.shape[:-1], -jnp.inf, key.dtype)) if return_residual else out
        seed = dropout_seed(dropout_key, rate, args[0].shape[0])
        score_mod, mask_mod = converted(score_mod, True), converted(mask_mod, False)
        made = self._kernel(
            *args,
            scale=scale,
            is_causal=is_causal,
            local_window_size=local_window_size,
            score_mod=score_mod.abstract() if isinstance(score_mod, Captured) else score_mod,
            mask_mod=mask_mod.abstract() if isinstance(mask_mod, Captured) else mask_mod,
            block_mask=block_mask,
            backend=backend,
            backward=backward,
            interpret=interpret,
            hardware=hardware,
            rope=rope,
            fp8_scales=fp8_scales,
            out_dtype=out_dtype,
            dropout_rate=rate,
            broadcast_dropout=broadcast_dropout,
        )
        fns = [f for f in (score_mod, mask_mod) if isinstance(f, Captured)]
        inputs = _captured_inputs(fns, args[0], args[1], made.signature.group)
        out = made(
            query,
            key,
            value,
            bias,
            mask,
            segment_ids,
            positions=positions,
            return_residual=return_residual,
            captured=inputs,
            seed=seed,
        )
        out = (out[0][..., :value_dim], out[1]) if return_residual else out[..., :value_dim]
        if not return_residual or query_seq_lengths is None:
            return out
        # a row past its query length sees no key: jax.nn's log-sum-exp of its large finite negative logits
        lengths = _lengths("query_seq_lengths", query_seq_lengths, query.shape[:-3])
        rows = jnp.arange(query.shape[-3]) < lengths[..., None]
        return out[0], jnp.where(rows[..., None], out[1], jnp.asarray(-0.7 * jnp.finfo(jnp.float32).max, key.dtype))

    def splits_keys(self, query, key, value, **options) -> bool:
        """Whether :meth:`__call__` runs this call (its arrays' shapes and dtypes, its options) as a decode step:
        :func:`lowering.decode_attention`'s split-KV kernel and merge, where one query token per sequence meets a
        long cache (:func:`splits_keys`) and nothing but ``scale``, ``key_value_seq_lengths`` and ``interpret`` is
        asked of it. Its gradient is the attention kernels' (they recompute the forward).

        >>> import jax.numpy as jnp
        >>> q, kv = jnp.zeros((2, 1, 8, 64), jnp.bfloat16), jnp.zeros((2, 4096, 2, 64), jnp.bfloat16)
        >>> attention.splits_keys(q, kv, kv, key_value_seq_lengths=jnp.array([4096, 100]))
        True
        >>> attention.splits_keys(q, kv, kv, is_causal=True), attention.splits_keys(kv, kv, kv)
        (False, False)
        """
        if options.get("split_keys") is False:
            return False
        unset = lambda k, v: v is None or v is False or (k == "dropout_rate" and v == 0)  # noqa: E731
        asked = {k for k, v in options.items() if not unset(k, v)}
        asked -= {"scale", "key_value_seq_lengths", "interpret", "split_keys"}
        asked -= {k for k, v in options.items() if (k, v) in (("backend", "auto"), ("backward", "lowered"))}
        return not asked and splits_keys(query, key, value, options.get("scale"))

    def kernel_for(
        self,
        query,
        key,
        value,
        bias=None,
        mask=None,
        *,
        segment_ids=None,
        scale=None,
        query_seq_lengths=None,
        key_value_seq_lengths=None,
        implementation: str | None = None,
        **options,
    ) -> AttentionKernel:
        """The cached :class:`AttentionKernel` for these arrays (only shapes and dtypes are read) and options (as
        :meth:`__call__` takes them); derived, verified and lowered on first use, outside any
        ``jit``/``vmap``/``grad`` trace. Every array is checked (shapes, dtypes) before anything is built."""
        backend = _implementation(implementation, options.pop("backend", "auto"))
        options.pop("split_keys", None)  # the attention kernel is asked for: a decode step's has its own entry
        if _before_kernel(options.get("rope"), query.shape[-1]):  # q and k come to it rotated
            options["rope"] = None
        query, scale = _scaled(query, scale, options.get("fp8_scales") is not None)
        options["fp8_scales"], options["score_mod"] = token_scales(
            options.get("fp8_scales"), options.get("score_mod"), query, key
        )
        segment_ids = length_ids(query, key, segment_ids, query_seq_lengths, key_value_seq_lengths)
        args = batched(query, key, value, bias, mask, segment_ids)
        for k in ("score_mod", "mask_mod"):
            f = converted(options.get(k), k == "score_mod")
            options[k] = f.abstract() if isinstance(f, Captured) else f
        return self._kernel(*args, scale=scale, backend=backend, **options)

    def _kernel(self, query, key, value, bias, mask, segment_ids, **options) -> AttentionKernel:
        """:meth:`kernel_for` of arrays as :func:`batched` gives them, options as :class:`Signature` takes them
        (a ``block_mask`` given as the ``mask_mod`` it carries, its shape checked against the call's)."""
        if (bm := options.pop("block_mask", None)) is not None:
            if options.get("mask_mod") is not None:
                raise EvaluationError("attention: pass mask_mod or block_mask (which carries its mask_mod), not both")
            bm.check(query.shape[0], query.shape[2], query.shape[1], key.shape[1])
            options["mask_mod"] = bm
        signature = Signature.of(query, key, value, bias, mask, segment_ids=segment_ids, **options)
        if signature in self._kernels:
            self._hits += 1
            self._kernels.move_to_end(signature)
        else:
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
            if len(self._kernels) > self.maxsize:
                self._kernels.popitem(last=False)
        return self._kernels[signature]

    def __repr__(self):
        return f"<napkin_cat attention entry: {len(self._kernels)} kernels cached, {self.derivations} derivations>"

    def cache_info(self) -> CacheInfo:
        """The cache's hits, misses (derivations), maximum and current size, as ``functools.lru_cache`` reports.

        >>> Attention(maxsize=8).cache_info()
        CacheInfo(hits=0, misses=0, maxsize=8, currsize=0)
        """
        return CacheInfo(self._hits, self.derivations, self.maxsize, len(self._kernels))

    def cache_clear(self) -> None:
        """Forget every kernel (the derivation count stays)."""
        self._kernels.clear()


#: the fewest keys a call of one query token needs for the entry to run it as a decode step (split-KV): below, one
#: program per (batch, head) already streams few enough chunks
SPLIT_KEYS = 512


def splits_keys(query, key, value, scale=None) -> bool:
    """Whether a call of these arrays is a decode step the entry runs by split-KV: ``[B, 1, H, D]`` queries (one
    token per sequence, no causal tail to align; jax.nn's leading batch axes flattened into ``B``) against
    ``[B, Nk ≥ 512, H_kv, D]`` keys and values of the same
    16- or 32-bit dtype, query heads a multiple of the KV heads, a static ``scale``, and every array on one device
    (a sharded call keeps the attention kernels and their sharding rule). The options are
    :meth:`Attention.splits_keys`'s to check.

    >>> import jax.numpy as jnp
    >>> q, kv = jnp.zeros((2, 1, 8, 64)), jnp.zeros((2, 4096, 2, 64))
    >>> splits_keys(q, kv, kv), splits_keys(q, kv[:, :256], kv[:, :256]), splits_keys(q, kv, kv, jnp.float32(0.1))
    (True, False, False)
    """
    if not query.ndim == key.ndim == value.ndim >= 4 or query.shape[-3] != 1 or key.shape[-3] < SPLIT_KEYS:
        return False
    if key.shape[:-3] != query.shape[:-3] or value.shape[:-3] != query.shape[:-3]:  # jax.nn's batch axes, flattened
        return False
    if not (scale is None or isinstance(scale, int | float)) or isinstance(scale, bool):
        return False
    dtypes = {jnp.dtype(x.dtype) for x in (query, key, value)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.float32):
        return False
    (h, d), (nk, hk, dk) = query.shape[-2:], key.shape[-3:]
    if value.shape[-3:-1] != (nk, hk) or d != dk or h % hk:
        return False
    return all(_on_one_device(x) for x in (query, key, value))


def _on_one_device(x) -> bool:
    """An array (or a tracer) no mesh shards: a concrete array on one device, or a traced one of no mesh axes."""
    if len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1:
        return False
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh is None or mesh.empty


def _split_kv(entry, query, key, value, lengths, scale, interpret):
    """One query token per sequence against a long cache (:func:`splits_keys`) by
    :func:`lowering.decode_attention`; differentiated by the attention kernels' forward and backward (``entry``
    called with the same arguments), which a custom VJP attaches: a decode step is seldom differentiated, and
    the gradient is the same function's."""
    from lowering._decode import decode_attention

    lead, nk = query.shape[:-3], key.shape[-3]
    query, key, value = (x.reshape(math.prod(lead), *x.shape[-3:]) for x in (query, key, value))  # jax.nn's batch axes
    b = query.shape[0]
    lengths = jnp.full((b,), nk, jnp.int32) if lengths is None else jnp.asarray(lengths).astype(jnp.int32).reshape(b)
    dense = functools.partial(entry, scale=scale, interpret=interpret, split_keys=False)

    @jax.custom_vjp
    def step(q, k, v, n):
        return decode_attention(q, k, v, n, scale=scale, interpret=interpret)

    def forward(q, k, v, n):
        return step(q, k, v, n), (q, k, v, n)

    def backward(res, ct):
        q, k, v, n = res
        _, vjp = jax.vjp(lambda q, k, v: dense(q, k, v, key_value_seq_lengths=n), q, k, v)
        return (*vjp(ct), None)

    step.defvjp(forward, backward)
    out = step(query, key, value, lengths)
    return out.reshape(*lead, *out.shape[1:])


#: the drop-in entry (``nc.attention``, ``lowering._attention``)
attention = Attention()
