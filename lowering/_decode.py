"""``decode_attention``: the newest tokens of each sequence against its KV cache, by split-KV.

A decode step (``Nq`` = 1 to 64 new query tokens per sequence, a long cache) run as a prefill launches one
program per (batch, head) and leaves most SMs idle. Here the cache is split into ``n`` parts
(:func:`rewrites.split_kv`, ``n`` from :func:`rewrites.choose_parts`: enough programs to fill the SMs, in whole
waves); the parts become a batch axis of one kernel (the cache ``[B, S, H_kv, D]`` read as ``[B, n, S/n, H_kv, D]``,
a reshape; the queries have no part axis: each part's program reads them in place, :func:`decode_diagram`), each
part's kernel outputs its ``(o, lse)`` (:func:`rewrites.with_lse`, lowered by :func:`lowering.lower`), and the
parts merge by the log-sum-exp merge (:func:`rewrites.merge_parts`), one pass over ``[B, n, Nq, H, D]`` numbers in
one kernel writing the caller's layout and dtype (:func:`lowering._merge.merge`). A step is two launches, the kernel
and the merge (for ``Nq > 1`` new tokens of grouped heads a third, the queries' rows transposed): the kernel reads
its last row tile's rows masked (no padding copy) and makes its keys' positions itself. In one part
(:attr:`Plan.split` false: a batch that fills the GPU) the merge is the normalisation the kernel has done: the kernel
has no part axis and writes the output in the caller's dtype and its log-sum-exp, and the step is that one launch
(beside it, for ``Nq > 1`` over several KV heads, the rows' transposes, :func:`pack_rows`). The per-part diagram's
schedule is derived and verified (``derive``); the split itself is the rule ``split_kv`` verified and proved in
:mod:`rewrites._split_kv`.

**Layout and masks.** ``q`` ``[B, Nq, H, D]`` are the tokens at positions ``lengths − Nq … lengths − 1`` of each
sequence (bottom-right causal alignment: query ``i`` sees keys ``< lengths − Nq + i + 1``); caches ``[B, S, H_kv,
D]`` hold ``lengths[b]`` valid keys (the rest is never seen). Grouped-query heads of one KV head are packed into
the kernel's rows (``Nq · H/H_kv`` rows per KV head, FlashInfer's trick), so the cache is read once per KV head.
``lengths`` are read when the kernel runs, as given (:class:`KeyLength`: each program compares its keys' positions
with its sequence's length less its part's first key and, for ``Nq > 1``, the causal tail: a constant per part
and row), so one kernel serves every length, under ``jax.jit`` too, and nothing runs on them before it. Chunks
past a sequence's length are skipped, not read: each program finds them from its length.

**Index functions** (FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, ``mask_mod(b, h, q_idx,
kv_idx)``, or by name) read the batch ``b``, the query head ``h`` and the key's position ``kv_idx`` in the cache
(in its sequence, for a paged cache: the page table only moves where a chunk is loaded from); the query's
position is ``lengths[b] − Nq + i``, a runtime value, so one that reads ``q_idx`` is refused.

Gradients are not defined: decoding is inference, and differentiating raises :class:`~lowering.NotLowerable`
(the kernels are lowered with no backward).

>>> import jax, jax.numpy as jnp
>>> q = jax.random.normal(jax.random.key(0), (2, 1, 8, 16))
>>> k, v = (jax.random.normal(jax.random.key(i), (2, 40, 2, 16)) for i in (1, 2))
>>> lengths = jnp.array([40, 7])
>>> out = decode_attention(q, k, v, lengths)
>>> valid = jnp.arange(40)[None, :] < lengths[:, None]
>>> ref = jax.nn.dot_product_attention(q, k, v, mask=valid[:, None, None, :])
>>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
((2, 1, 8, 16), True)
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from lowering._api import lower
from lowering._merge import merge
from lowering._paged import PageMap, check_paged, check_pages_used, paged_split
from lowering._plan import NotLowerable
from lowering._target import interpreted, no_gpu, target_hardware
from lowering.mosaic import MOSAIC_BLOCKS, unavailable
from lowering.triton import TRITON_BLOCKS, TritonConfig
from napkin_cat.axes import axes
from napkin_cat.diagram import Array, Diagram, Ty, copy, swap
from napkin_cat.diagram import id as identity
from napkin_cat.dtypes import bf16, f16, f32
from napkin_cat.errors import CostError, EvaluationError
from napkin_cat.generators import add, contract, depends_on, elementwise, fname, index_names, positional, softmax
from napkin_cat.generators import mask as index_mask
from napkin_cat.generators import score_mod as index_score_mod
from napkin_cat.hardware import Hardware, lookup
from rewrites import choose_parts, derive, merge_parts, stream, tile, with_lse

#: the most new tokens per sequence a decode step takes (speculative decoding, chunked prefill); more is a prefill
MAX_QUERIES = 64
#: FlexAttention's index names, in the order its functions take them
FLEX = ("b", "h", "q_idx", "kv_idx")
DTYPES = {"float32": f32, "bfloat16": bf16, "float16": f16}


@dataclass(frozen=True)
class Decoded:
    """A user's index function read on the kernel's indices: the kernel's batch is the sequence ``b``, the part
    ``p`` and the KV head ``h``, its rows (token, head in group) and its keys a part's; the user's ``b``, ``h``,
    ``kv_idx`` are the sequence, the query head and the key's position in the cache. ``chunk``: the keys per part;
    None where the keys are one part (the kernel has no part axis, and ``p`` is not read).

    >>> f = Decoded(lambda s, b, h, kv_idx: s + 100 * b + 10 * h + kv_idx, chunk=8, group=4, score=True)
    >>> f(0, b=1, p=1, h=1, q_idx=6, kv_idx=5)  # sequence 1, part 1; query head 1·4 + 6 % 4; key 8 + 5
    173
    >>> Decoded(f.fn, chunk=None, group=4, score=True)(0, b=1, h=1, q_idx=6, kv_idx=5)   # one part
    165
    """

    fn: Callable
    chunk: int | None
    group: int
    score: bool

    def _names(self) -> tuple[str, ...]:
        names = index_names(self.fn, score=self.score)
        return ("b", "h", "kv_idx") if names is None else names

    def __call__(self, *value, b, p=0, h, q_idx, kv_idx):
        # q_idx: only a function whose value does not depend on it takes it (``reads_query``), so any value does
        at = kv_idx if self.chunk is None else p * self.chunk + kv_idx
        mine = {"b": b, "h": h * self.group + q_idx % self.group, "kv_idx": at, "q_idx": 0}
        return self.fn(*value, **{n: mine[n] for n in self._names()})

    @property
    def __signature__(self):
        kw, first = inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_ONLY
        value = [inspect.Parameter("score", first)] if self.score else []
        names = ("b", "h", "q_idx", "kv_idx") if self.chunk is None else ("b", "p", "h", "q_idx", "kv_idx")
        return inspect.Signature([*value, *(inspect.Parameter(n, kw) for n in names)])

    @property
    def __name__(self):
        return fname(self.fn)


def reads_query(fn: Callable, score: bool) -> bool:
    """Whether the index function ``fn`` (a score modifier with ``score``, else a mask) reads ``q_idx``: its value
    depends on it (:func:`~napkin_cat.generators.depends_on`: its trace on abstract indices, by name or read by
    position as FlexAttention's ``score_mod(score, b, h, q_idx, kv_idx)``, :func:`positional`).

    >>> reads_query(positional(lambda score, b, h, m, n: score * 2, FLEX, score=True), True)
    False
    >>> reads_query(positional(lambda b, h, m, n: m >= n, FLEX, score=False), False)
    True
    """
    return "q_idx" in depends_on(fn, FLEX, score=score)


@dataclass(frozen=True)
class KeyLength:
    """The mask of a part's valid keys: score ``s`` where the key's position ``pos`` (the part's streamed index)
    is below ``n + t``, else −∞. ``n`` is the part's count of the sequence's keys (its length less the keys of the
    parts before it, per program), ``t`` a row's offset from it (``0``, or for ``Nq > 1`` new tokens the causal
    tail: token ``i`` sees ``Nq − 1 − i`` fewer keys). Called as ``(s, pos, n, t)``; it says where it reads them
    (``length_labels``), so a kernel finds the chunks it visits from ``n`` and ``t`` as it runs
    (:func:`lowering._blocks.length_bounds`), and ``lengths`` stay values: one kernel serves every length.

    >>> KEY_LENGTH(jnp.zeros(4), jnp.arange(4), jnp.int32(3), jnp.array([0, 0, -1, -1])).tolist()
    [0.0, 0.0, -inf, -inf]
    """

    name: str = "key_length"
    #: a mask of the scores: it commutes with scaling them (the exp2 fold passes through it)
    passes_base: ClassVar[bool] = True
    #: a mask, not a score modifier, among ``library.dot_product_attention``'s ``captured`` pairs
    score: ClassVar[bool] = False
    #: the positions, among its arguments ``(s, pos, n, t)``, of the key's position, the length and the offset
    length_labels: ClassVar[tuple[int, int, int]] = (1, 2, 3)
    #: the argument holding the key's position: the streamed index, which a kernel makes itself
    #: (:func:`lowering._blocks.made_positions`)
    position_label: ClassVar[int] = 1

    def __call__(self, s, pos, n, t):
        return jnp.where(pos < n + t, s, -jnp.inf)

    @property
    def __name__(self):
        return self.name


KEY_LENGTH = KeyLength()


@dataclass(frozen=True)
class KeyLimit:
    """:class:`KeyLength` with ``n + t`` added before the kernel: score ``s`` where the key's position ``pos`` is
    below its row's ``limit`` (a part's rows, one per row, in f32), else −∞. What the Mosaic backend runs: its
    layout inference finds no layout for the per-program length ``n`` or for arithmetic on the rows' int32
    offsets ``t`` beside the scores (docs/decode.md), and a comparison of the two vectors needs neither. It says
    where it reads the limits (``limit_labels``), so the kernel's wrapper finds from them the chunks each tile
    visits and runs unmasked (:class:`lowering._blocks.Limits`), and where the positions are, which the kernel
    makes itself.

    >>> KEY_LIMIT(jnp.zeros(4), jnp.arange(4), jnp.int32(2)).tolist()
    [0.0, 0.0, -inf, -inf]
    """

    name: str = "key_limit"
    passes_base: ClassVar[bool] = True
    score: ClassVar[bool] = False
    position_label: ClassVar[int] = 1
    #: where it reads the key's position and the row's limit among ``(s, pos, limit)``: a kernel finds from the
    #: limits which chunks each tile visits and which it runs unmasked (:class:`lowering._blocks.Limits`)
    limit_labels: ClassVar[tuple[int, int]] = (1, 2)

    def __call__(self, s, pos, limit):
        return jnp.where(pos < limit, s, -jnp.inf)

    @property
    def __name__(self):
        return self.name


KEY_LIMIT = KeyLimit()


def length_wires(b, q, x, p=None) -> tuple[Array, Array, Array]:
    """The inputs :class:`KeyLength` reads: the keys' positions ``[x]`` (a part's), the lengths ``[b]`` and the rows'
    offsets ``[q]``, or ``[p, q]`` with a part axis ``p`` (the part's first key taken off: the lengths are then the
    sequences' own, read as given) (i32).

    >>> print(*length_wires(*axes("b q x")), length_wires(*axes("b q x p"))[2])
    x b q p×q
    """
    t = Array(q, dtype="i32") if p is None else Array(p, q, dtype="i32")
    return Array(x, dtype="i32"), Array(b, dtype="i32"), t


@dataclass(frozen=True)
class Plan:
    """What a decode kernel depends on (its cache key): dtype, new tokens ``queries``, heads per KV head
    ``group``, head dims, the parts ``n`` and keys per part ``chunk``, the scale, the index functions, and how to
    lower. Shapes with equal plans share a kernel; the batch size stays symbolic."""

    dtype: str
    queries: int
    group: int
    dims: tuple[int, int]
    parts: int
    chunk: int
    scale: float | None = None
    score_mod: Callable | None = None
    mask_mod: Callable | None = None
    backend: str = "auto"
    interpret: bool | None = None
    #: a paged cache's keys per page and per streamed chunk (whole pages); None for a contiguous cache
    pages: tuple[int, int] | None = None
    #: MLA: the keys' trailing rotary dims, read from their own inputs (the latent keys are the values); 0 else
    rope: int = 0
    #: rows per program (the row tile); None: :func:`row_tile`'s
    tile: int | None = None
    #: MLA: the latent output dims per program (the output split across programs, each computing the scores); None:
    #: all of them in one
    values: int | None = None
    #: the GPU the kernel is lowered for (its shared-memory limit, its target); None: the machine's
    hardware: Hardware | None = None
    #: a contiguous cache's keys per streamed chunk; None: :func:`default_chunk`'s (a paged cache's are its ``pages``)
    stream: int | None = None
    #: whether the grid is :func:`crowded` (the batch's programs alone fill each SM more than twice over): its
    #: default chunk is :func:`default_chunk`'s for a crowded grid
    crowded: bool = False

    @property
    def rows(self) -> int:
        """The kernel's rows per KV head: the new tokens times the query heads sharing it."""
        return self.queries * self.group

    @property
    def split(self) -> bool:
        """Whether the keys are in parts: the kernel's batch has a part axis ``p`` and its partial ``(o, lse)`` (f32)
        are merged after it. In one part the kernel has no part axis and writes the finished output in the caller's
        dtype, and its log-sum-exp: no merge (at ``B`` = 64, ``Nq`` = 64 over 4k keys on an H200 the merge of one
        part took 33 of a 533 µs step)."""
        return self.parts > 1

    @property
    def limits(self) -> bool:
        """Whether the kernel reads each row's key limit (:class:`KeyLimit`) instead of the lengths and offsets
        (:class:`KeyLength`): on Mosaic, contiguous or paged (MLA runs on Triton or XLA)."""
        return self.backend == "mosaic" and not self.rope

    def blocks(self) -> tuple[int, int]:
        """Rows per tile (:func:`row_tile`, or the plan's ``tile``) and keys per streamed chunk: the plan's ``stream``
        where given, else :func:`default_chunk`'s, no more than a part's keys (a power of two ≥ 16, every 16-bit
        dot's K); a paged cache's chunk is its pages.

        >>> Plan("bfloat16", 64, 4, (128, 128), parts=16, chunk=2048, backend="mosaic", tile=256, stream=32).blocks()
        (256, 32)
        >>> [Plan("bfloat16", nq, 4, (128, 128), parts=8, chunk=4096).blocks() for nq in (1, 64)]
        [(16, 64), (128, 128)]
        """
        pow2 = lambda n: max(16, 1 << (n - 1).bit_length())  # noqa: E731
        rows = self.tile or row_tile(self.rows, self.dims)
        if self.pages is not None:
            return rows, self.pages[1]
        chunk = default_chunk(self.backend, rows, self.dims, self.chunk, self.rope, self.crowded, self.latent_once)
        return rows, self.stream or min(chunk, pow2(self.chunk))

    def summary(self) -> dict:
        """What a run of this plan does: its parts and keys per part, a KV head's row tiles and rows per tile, the
        keys per streamed chunk, and the backend its kernel was lowered for (built if it was not).

        >>> Plan("float32", 1, 4, (16, 16), parts=3, chunk=40).summary()
        {'parts': 3, 'keys_per_part': 40, 'row_tiles': 1, 'tile': 16, 'chunk': 64, 'backend': 'triton'}
        """
        tile, chunk = self.blocks()
        out = {"parts": self.parts, "keys_per_part": self.chunk, "row_tiles": -(-self.rows // tile), "tile": tile,
               "chunk": chunk, "backend": _kernel(self).backend}  # fmt: skip
        return out | ({"values": self.values} if self.values else {})

    @property
    def latent_once(self) -> bool:
        """MLA with its latent keys as the values, one input (:func:`mla_attention` without ``values``)."""
        return bool(self.rope) and not self.values

    def page_map(self) -> PageMap | None:
        """Where a paged cache's chunks load from: the kernel's keys and values (inputs 1, 2) read as pools
        through a table ``[B, parts, pages per part]`` whose rows follow the kernel's batch axes (sequence, part)."""
        # MLA: the latent keys (also the values: one input, or a second with ``values``) and the rotary keys
        inputs = ((1, 3) if self.latent_once else (1, 2, 4)) if self.rope else (1, 2)
        batch = ("b", "p") if self.split else ("b",)
        return None if self.pages is None else PageMap("kv_idx", self.pages[0], batch, inputs)

    def kernel(self):
        """The per-part kernel: the diagram with its (o, lse) outputs (a part's partial results in f32 where
        :attr:`split`, else the finished output in the caller's dtype), its schedule derived and verified, lowered."""
        b, p, h, q, x = axes("b p h q_idx kv_idx")
        p = p if self.split else None  # one part: no part axis
        d, dv = axes("d dv", d=self.dims[0], dv=self.dims[1])
        mods = {}
        for key, fn, score in (("score_mod", self.score_mod, True), ("mask", self.mask_mod, False)):
            if fn is not None:
                mods[key] = Decoded(fn, self.chunk if self.split else None, self.group, score)
        split = ()
        if self.rope:
            r = axes("r", r=self.rope)[0]
            values = dv if self.values else None  # the output's own latent axis, tiled
            diagram = mla_attention(b, h, q, x, d, r, self.scale, DTYPES[self.dtype], p, values=values)
            split = (tile(dv, self.values),) if self.values else ()
        else:
            e = dv if self.dims[1] != self.dims[0] else d
            diagram = decode_diagram(b, p, h, q, x, d, e, self.scale, DTYPES[self.dtype], **mods, limits=self.limits)
        rows, chunk = self.blocks()
        derivation = derive(diagram, tile(q, rows), *split, stream(x, chunk))
        # MLA's 64 rows × 512 latent dims: an f32 accumulator two warpgroups hold (FlashMLA's split), two stages;
        # a tile past Triton's 128 rows: 16 rows a warp, as its 64- and 128-row tiles have
        wide = self.rope and max(self.dims) >= 256 and self.backend in ("auto", "triton")
        tall = rows > TRITON_BLOCKS.tile and self.backend in ("auto", "triton")
        config = TritonConfig(num_warps=8, num_stages=2) if wide else None
        config = TritonConfig(num_warps=rows // 16, num_stages=2) if tall else config
        diagram = with_lse(derivation.diagram, x.name, partial=self.split)
        return lower(diagram, self.backend, self.interpret, config, hardware=self.hardware)


def decode_diagram(b, p, h, q, x, d, e, scale, dtype, score_mod=None, mask=None, limits: bool = False) -> Diagram:
    """A part's attention, the caches laid out as the caller's are (``[b, seq, h, dim]``), the rows of a KV head
    after it: ``Q[b, h, q, d] ⊗ K[b, p, x, h, d] ⊗ V[b, p, x, h, e] ⊗ pos ⊗ n ⊗ t → O[b, p, h, q, e]``: scores
    ``scale·Q·Kᵀ`` (``1/√d`` by default), then ``score_mod``, ``mask`` and the valid keys (:class:`KeyLength` on
    :func:`length_wires`), softmax, contracted with ``V``. The queries have no part axis ``p``: every part's program
    reads them where they lie, not a copy per part; ``[b, h, q, d]`` is the caller's ``[B, 1, H, D]`` for one new
    token (a reshape). A paged cache's keys and values are read through a table whose rows follow ``(b, p)``
    (:meth:`Plan.page_map`). With ``p`` None the keys are one part. With ``limits`` the valid keys are read from
    the positions and each row's limit ``[b, p, q]`` (:class:`KeyLimit`, Mosaic's form) instead of ``pos ⊗ n ⊗ t``.

    >>> b, p, h, q, x, d = axes("b p h q x d")
    >>> print(decode_diagram(b, p, h, q, x, d, d, None, f32).dom)
    b×h×q×d ⊗ b×p×x×h×d ⊗ b×p×x×h×d ⊗ x ⊗ b ⊗ p×q
    """
    kv = (b,) if p is None else (b, p)
    S, V, out_wire = Array(*kv, h, q, x), Array(*kv, x, h, e, dtype=dtype), Array(*kv, h, q, e, dtype=dtype)
    n = lambda *axs: " ".join(a.name for a in axs)  # noqa: E731
    scale = d.size**-0.5 if scale is None else scale  # a symbolic size stays symbolic
    scores = contract(f"{n(b, h, q, d)}, {n(*kv, x, h, d)} -> {n(*S.axes)}", *kv, h, q, x, d, scale=scale, dtype=dtype,
                      out_dtype=f32)  # fmt: skip
    wires = length_wires(b, q, x, p)
    rest = Ty(wires[0], Array(*kv, q, dtype=f32)) if limits else Ty(*wires)
    out = (scores @ identity(Ty(V)) @ identity(rest)) >> (identity(Ty(S)) @ swap(Ty(V), rest))  # S rest V
    later = identity(rest @ Ty(V))
    out = out if score_mod is None else out >> (index_score_mod(S, score_mod) @ later)
    out = out if mask is None else out >> (index_mask(S, mask) @ later)
    return _attend(out, S, V, rest, out_wire, x, dtype, KEY_LIMIT if limits else KEY_LENGTH)


def _attend(scored: Diagram, S: Array, V: Array, rest: Ty, out: Array, x, dtype, valid=KEY_LENGTH) -> Diagram:
    """``scored`` (giving the scores ``S``, the length wires ``rest`` and ``V``) then the valid keys (``valid``:
    :class:`KEY_LENGTH`, or :class:`KEY_LIMIT`), softmax over ``x`` and the contraction with ``V`` into ``out``: the
    tail :func:`decode_diagram` and :func:`mla_attention` share."""
    masked = scored >> (elementwise(valid, S, *rest.inside, out=S) @ identity(Ty(V)))
    spec = f"{' '.join(S.names)}, {' '.join(V.names)} -> {' '.join(out.names)}"
    axes_ = dict.fromkeys(a for w in (S, V, out) for a in w.axes)
    return masked >> (softmax(S, x) @ identity(Ty(V))) >> contract(spec, *axes_, dtype=(f32, dtype), out_dtype=dtype)


def mla_attention(b, h, q, x, c, r, scale, dtype, p=None, values=None) -> Diagram:
    """Absorbed multi-head latent attention (DeepSeek-V2/V3's MLA at inference) as one diagram, laid out as
    :func:`decode_diagram`'s: ``Q_c[c] ⊗ K_c[c] ⊗ Q_r[r] ⊗ K_r[r] ⊗ pos ⊗ n ⊗ t → O[c]``, scores
    ``scale·(Q_c·K_cᵀ + Q_r·K_rᵀ)`` (the latent and rotary parts, ``c + r`` dims; ``scale`` defaults to ``1/√(c +
    r)``), masked by the valid keys (:class:`KeyLength` on :func:`length_wires`), softmax, then contracted with the
    latent keys again, as values, over the keys: ``K_c`` is copied (one input, so a kernel streaming it loads each
    chunk once for both products). With a part axis ``p`` the keys and output have it and the queries not
    (:func:`decode_diagram`). ``values``: an axis of ``c``'s size that the values ``V`` and the output run over
    instead of ``c``, so a schedule may tile the output's latent dims (each program computing every score) while the
    scores contract over all of ``c``; ``V`` is then an input of its own after ``K_c`` (the caller passes the latent
    twice).

    >>> b, h, q, x, c, r, e = axes("b h q x c r e", c=32, r=16, e=32)
    >>> print(mla_attention(b, h, q, x, c, r, None, f32).dom)
    b×h×q×c ⊗ b×x×h×c ⊗ b×h×q×r ⊗ b×x×h×r ⊗ x ⊗ b ⊗ q
    >>> split = mla_attention(b, h, q, x, c, r, None, f32, values=e)
    >>> print(split.dom.inside[2], split.cod)
    b×x×h×e b×h×q×e
    """
    scale = 1 / math.sqrt(c.size + r.size) if scale is None else scale
    kv = (b,) if p is None else (b, p)
    v = c if values is None else values
    S, V = Array(*kv, h, q, x), Array(*kv, x, h, v, dtype=dtype)
    n = lambda *axs: " ".join(a.name for a in axs)  # noqa: E731

    def scores(e):
        return contract(f"{n(b, h, q, e)}, {n(*kv, x, h, e)} -> {n(*S.axes)}", *kv, h, q, x, e, scale=scale,
                        dtype=dtype, out_dtype=f32)  # fmt: skip

    rest = Ty(*length_wires(b, q, x, p))
    out = scores(c) @ identity(Ty(V)) @ scores(r) @ identity(rest)  # S V S_r rest
    out = out >> (identity(Ty(S)) @ swap(Ty(V), Ty(S)) @ identity(rest)) >> (add(S, S) @ identity(Ty(V) @ rest))
    out = out >> (identity(Ty(S)) @ swap(Ty(V), rest))  # S rest V
    if values is None:  # the latent keys are the values: one input (K_c), copied into V's place
        Qc, Kc, _, *others = out.dom.inside
        out = (identity(Ty(Qc)) @ copy(Ty(Kc)) @ identity(Ty(*others))) >> out
    return _attend(out, S, V, rest, Array(*kv, h, q, v, dtype=dtype), x, dtype)


def chunk_keys(dims: tuple[int, int], once: bool = False) -> int:
    """Keys per streamed chunk by default: 64, fewer for head dims over 256, so a chunk of keys and values with 64
    rows of queries fits a GPU block's shared memory in two stages; with ``once`` the keys are the values, loaded
    once (MLA's latent, :func:`mla_attention`), so 512-dim latent keys take 64 too. On an H200 MLA's step took 0.87×
    (B = 1, 32k keys) and 0.82× (B = 64, 4k) the time of 32-key chunks (``decode_bench.py``, stop 51).

    >>> chunk_keys((128, 128)), chunk_keys((512, 512)), chunk_keys((512, 512), once=True)
    (64, 32, 64)
    """
    return max(16, min(64, (32768 if once else 16384) // max(dims)))


def default_chunk(backend: str, rows: int, dims: tuple[int, int], keys: int, rope: int = 0,
                  crowded: bool = False, once: bool = False) -> int:  # fmt: skip
    """Keys per streamed chunk of a contiguous cache by default: :func:`chunk_keys`'s, except where a program holds
    128 rows or more (the compute-bound side: ``Nq`` = 64 at GQA 4), which streams the chunk the backend's attention
    forward does at its head dims for a part of ``keys`` keys: Triton's (128 keys at D = 128) and Mosaic's (128
    keys at head dims up to 128), and except on Triton where the grid is ``crowded`` (:func:`crowded`: more than two
    programs per SM with the cache in one part, 16-bit at D = 128), which streams 128 keys too, a paged cache's as
    two pages of 64 (each key's page gathered, :meth:`lowering._paged.PageMap.load`). ``once``: MLA's latent keys are
    its values (:func:`chunk_keys`).
    Measured on an H200 at ``Nq`` = 64 over 32k keys (``decode_bench.py``'s sweeps,
    ``probes/decode_mosaic_chunks.py``): Triton's kernel ran 10% (B = 1) and 13% (B = 16) faster than at 64
    keys, Mosaic's 23% (B = 1; 63.4 against 82.0 µs). At 16 rows (``Nq`` = 1), 128 keys were 7% (B = 64, 4k keys:
    248.9 against 266.3 µs) and 14% (B = 64, 32k: 1,895 against 2,214 µs) faster with 512 programs of one part
    each, and no faster or slower (B = 1 and 16 at 32k: 37.6 / 482.8 against 37.4 / 481.6 µs; B = 16 at 4k, 69.3
    against 66.3 µs) with 128 to 256 programs of split caches. Paged (pages of 64 keys) at B = 64, 4k: 255.5 µs in
    chunks of two pages against 281.4 in one (``probes/decode_stages.py``; re-timed in stop 51 with each config's
    step traced anew: 64-key chunks at 6 stages 251.3 / 256.5 µs, contiguous / paged, against 128 keys' 244.1 / 251.0).

    >>> default_chunk("triton", 16, (128, 128), 4096), default_chunk("triton", 128, (128, 128), 4096)
    (64, 128)
    >>> default_chunk("mosaic", 128, (64, 64), 4096), default_chunk("triton", 128, (64, 64), 4096)
    (128, 64)
    >>> default_chunk("mosaic", 64, (128, 128), 4096)   # one consumer of 64 rows
    64
    >>> default_chunk("triton", 16, (128, 128), 4096, crowded=True)   # B = 64: 512 programs
    128
    """
    if crowded and not rope and backend in ("auto", "triton"):
        return TRITON_BLOCKS.entry(TRITON_BLOCKS.tile, keys, *dims)[1]
    if rope or rows < TRITON_BLOCKS.wide_warps_at:
        return chunk_keys(dims, once)
    if backend == "mosaic":
        return MOSAIC_BLOCKS.faster_chunk if max(dims) <= 128 else chunk_keys(dims)
    return TRITON_BLOCKS.entry(rows, keys, *dims)[1] if backend != "xla" else chunk_keys(dims)


def crowded(programs: int, parts: int, hardware: Hardware, dtype, dims: tuple[int, int]) -> bool:
    """Whether a decode grid of ``programs`` programs, its cache in ``parts`` parts, is crowded: the batch's KV heads
    and row tiles alone more than twice the SMs (the cache not split), so several programs share each SM and each
    streams a whole cache (:func:`default_chunk` streams 128 keys there). Only where that was measured and fits:
    16-bit caches at D = 128 (three stages of 128 keys of f32 would not fit a block's shared memory).

    >>> from napkin_cat.hardware import H100
    >>> [crowded(n, parts, H100, "bfloat16", (128, 128)) for n, parts in ((64 * 8, 1), (16 * 8 * 2, 2))]
    [True, False]
    >>> crowded(64 * 8, 1, H100, "float32", (128, 128))
    False
    """
    sixteen = jnp.dtype(dtype).itemsize == 2
    return parts == 1 and programs > 2 * hardware.sms and sixteen and dims == (128, 128)


def routed(backend: str, interpret: bool | None, dtype, tile: int, dims: tuple[int, int], mods: tuple,
           split: tuple[int, int, int] | None = None) -> str:  # fmt: skip
    """The backend a contiguous decode step runs: ``backend``, except that ``"auto"`` takes Mosaic on a Hopper GPU
    where it was measured faster than Triton: a KV head's rows in tiles (``tile``, the rows per program) of 128,
    Triton's attention tile, two consumers of 64 rows (``Nq · H / H_kv`` ≥ 128: speculative decoding, chunked
    prefill; a tile of 256 does not fit Mosaic's shared memory at D = 128) at D = 128 in 16 bits, no index
    functions, and (``split``: the parts,
    keys per part and the cache's keys) parts of whole 128-key chunks that cover the cache exactly, since Mosaic
    pads a cache cut otherwise (a copy per step) where Triton reads ragged parts in place. On an H200, ``Nq`` = 64,
    B = 1, 32k keys, 32 heads over 8, the step took 0.0708 ms against Triton's 0.0842 (both in 128-key chunks;
    ``papers/flash_attention/probes/decode_mosaic_chunks.py``). Elsewhere ``"auto"`` stays Triton's (fewer rows
    leave Mosaic's wgmma tiles of 64 rows per consumer half empty).

    >>> routed("auto", None, "bfloat16", 128, (128, 128), (None, None))   # on a CPU: no Hopper GPU
    'auto'
    """
    whole = split is None or (split[1] % MOSAIC_BLOCKS.faster_chunk == 0 and split[0] * split[1] == split[2])
    tall = tile == TRITON_BLOCKS.tile
    if backend != "auto" or unavailable(interpret) is not None or not (tall and whole) or dims != (128, 128):
        return backend
    return "mosaic" if jnp.dtype(dtype).itemsize == 2 and mods == (None, None) else backend


@functools.lru_cache(maxsize=64)
def _kernel(plan: Plan):
    # in a thread of its own, off any caller's jit trace: the derivation verifies on concrete arrays
    with ThreadPoolExecutor(1) as worker:
        return worker.submit(plan.kernel).result()


def _checked(q, k_cache, v_cache, lengths) -> None:
    """Refuse arguments the entry cannot take, naming the argument, the condition and the fix."""
    shapes = f"q {tuple(q.shape)}, k_cache {tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)}"
    if not q.ndim == k_cache.ndim == v_cache.ndim == 4:
        raise EvaluationError(f"decode_attention: q, k_cache, v_cache must be [B, N, heads, dim]; {shapes}")
    (batch, nq, _, dim), keys = q.shape, k_cache.shape[1]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[0] != batch or k_cache.shape[3] != dim:
        raise EvaluationError(f"decode_attention: the caches must be [B, S, H_kv, D] for q's B and D; {shapes}")
    if not 1 <= nq <= MAX_QUERIES:
        raise EvaluationError(
            f"decode_attention: q holds {nq} new tokens per sequence; a decode step takes 1 to {MAX_QUERIES} "
            "(for more, run the prefill with nc.attention)"
        )
    if nq > keys:
        raise EvaluationError(f"decode_attention: {nq} new tokens exceed the cache's S = {keys} keys; {shapes}")
    _checked_common(q, k_cache, v_cache, lengths, keys)


def _checked_common(q, k_cache, v_cache, lengths, keys: int) -> None:
    """The checks a contiguous and a paged cache share: one dtype, grouped-query heads, lengths in [Nq, keys]."""
    (batch, nq, heads, _), kv_heads = q.shape, k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise EvaluationError(
            f"decode_attention: q's {heads} heads must be a multiple of the caches' {kv_heads} KV heads (grouped-query)"
        )
    dtypes = {jnp.dtype(a.dtype).name for a in (q, k_cache, v_cache)}
    if len(dtypes) != 1 or not dtypes <= DTYPES.keys():
        raise EvaluationError(f"decode_attention: q and the caches must share one of {', '.join(DTYPES)}; {dtypes}")
    if tuple(lengths.shape) != (batch,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise EvaluationError(
            f"decode_attention: lengths must be integers of shape [B] = [{batch}], got "
            f"{jnp.dtype(lengths.dtype).name} {tuple(lengths.shape)}"
        )
    if not isinstance(lengths, jax.core.Tracer):  # numpy: a concrete array closed over in a trace stays concrete
        bad = [int(n) for n in np.asarray(lengths) if not nq <= int(n) <= keys]
        if bad:
            raise EvaluationError(
                f"decode_attention: lengths {bad} outside [Nq, S] = [{nq}, {keys}]: each length counts the cache's "
                "valid keys, the Nq new tokens included"
            )


def row_tile(rows: int, dims: tuple[int, int]) -> int:
    """Rows per program for one KV head's ``rows = Nq · H/H_kv`` rows at head dims ``dims``: Triton's attention tile
    (FlashAttention-2's 128, 64 where a query and an output row are wider than 256: MLA's latent heads), no more than
    the rows need (a power of two ≥ 16). Each row tile of a KV head streams the whole cache
    (:func:`lowering.decode_cost` counts it), so the largest tile the backend holds reads it the fewest times.

    >>> row_tile(4, (128, 128)), row_tile(256, (128, 128)), row_tile(128, (512, 512))
    (16, 128, 64)
    """
    return TRITON_BLOCKS.entry(rows, 1, *dims)[0]


def row_tiles(rows: int, dims: tuple[int, int] = (128, 128), tile: int | None = None) -> int:
    """The row tiles of one KV head's ``rows`` (tiles of ``tile`` rows, by default :func:`row_tile`'s): programs
    the grid already has without splitting the keys (so fewer parts fill the SMs), each reading the cache.

    >>> row_tiles(4), row_tiles(256), row_tiles(256, tile=64), row_tiles(128, (512, 512))
    (1, 2, 4, 2)
    """
    return -(-rows // (tile or row_tile(rows, dims)))


def _checked_tile(tile):
    """``tile`` (rows per program) where it is None or a power of two from 16 to 256, else an error naming it."""
    if tile is not None and tile not in (16, 32, 64, 128, 256):
        raise EvaluationError(
            f"decode_attention: tile={tile!r} rows per program must be a power of two from 16 to 256 (every 16-bit "
            "dot's K ≥ 16; Triton's tiles of 256 take 16 warps); pass None for the default"
        )
    return tile


def _checked_chunk(chunk, keys: int):
    """A contiguous cache's ``chunk`` (keys per streamed chunk) where it is None or a power of two from 16 to 256 and
    at most the cache's ``keys``, else an error naming it.

    >>> _checked_chunk(128, 4096), _checked_chunk(None, 4096)
    (128, None)
    >>> _checked_chunk(96, 4096)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: decode_attention: chunk=96 keys per streamed chunk must be a power of two from \
16 to 256 (every 16-bit dot's K ≥ 16) and at most the cache's 4096 keys; pass None for the default
    """
    if chunk is not None and (chunk not in (16, 32, 64, 128, 256) or chunk > keys):
        raise EvaluationError(
            f"decode_attention: chunk={chunk!r} keys per streamed chunk must be a power of two from 16 to 256 (every "
            f"16-bit dot's K ≥ 16) and at most the cache's {keys} keys; pass None for the default"
        )
    return chunk


def _hardware(hardware: Hardware | str | None, interpret: bool | None, backend: str = "auto") -> Hardware:
    """The GPU a decode step is planned (its parts: the SMs) and lowered for: ``hardware`` where named, so a step
    lowers for that GPU on any machine (``jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))``), else the
    machine's (:func:`lowering._target.target_hardware`: the detected GPU, H100 when interpreting or where the XLA
    backend runs without one).

    >>> _hardware("A100", None).name, _hardware(None, True).name, _hardware(None, False, "xla").name  # on a CPU
    ('A100', 'H100', 'H100')
    >>> _hardware("B300", None)
    Traceback (most recent call last):
    ...
    lowering._plan.NotLowerable: decode_attention: hardware='B300': unknown hardware 'B300'; known: A100, A100-40GB, \
H100, H200 (or pass a Hardware)
    """
    if hardware is None:
        return target_hardware(interpreted(interpret) or (backend == "xla" and no_gpu() is not None))
    try:
        return lookup(hardware)
    except CostError as e:
        raise NotLowerable(f"decode_attention: hardware={hardware!r}: {e}") from e


def _parts(batch: int, programs: int, keys: int, hardware: Hardware, *, exact: bool = True) -> int:
    """The parts for ``batch · programs`` programs (KV heads times row tiles): at most ``choose_parts``'s number
    (enough to fill the SMs), the one whose grid fills its last wave of SMs best (FlashAttention-2's split rule: a
    wave begun costs a whole one, so 8 programs take 16 parts, 128 on 132 SMs, not 17, 136: two waves), ties to
    the most parts; with ``exact`` (a contiguous cache, read as parts by a reshape) only divisors of the keys
    where one is at least half of ``choose_parts``'s (else the cache would be padded: a copy).

    >>> from napkin_cat.hardware import H100
    >>> _parts(1, 8, 32768, H100), _parts(1, 8, 32768 + 64, H100, exact=False), _parts(16, 8, 32768, H100)
    (16, 16, 2)
    """
    top = choose_parts(batch * programs, keys, hardware)
    fits = [m for m in range(top, (top + 1) // 2 - 1, -1) if keys % m == 0] if exact else []
    waves = lambda m: -(-batch * programs * m // hardware.sms)  # noqa: E731
    return max(fits or range(1, top + 1), key=lambda m: (Fraction(batch * programs * m, waves(m)), m))


def _lengths(lengths, plan: Plan) -> tuple:
    """:class:`KeyLength`'s inputs: the part's key positions (a constant the Triton kernel makes itself), the
    lengths, and each row's offset: row ``i·group + g`` (token ``i``) of part ``p`` sees keys ``< lengths − Nq + i +
    1 − p·chunk`` of its part (a constant ``[parts, rows]``; ``[rows]`` in one part: no part axis), so the kernel
    reads ``lengths`` as given, contiguous or paged."""
    n, c = plan.parts, plan.chunk
    tail = np.arange(plan.rows, dtype=np.int32) // plan.group - (plan.queries - 1)
    pos, offsets = np.arange(c, dtype=np.int32), tail - c * np.arange(n, dtype=np.int32)[:, None]
    offsets = offsets if plan.split else tail
    lengths = lengths if lengths.dtype == jnp.int32 else lengths.astype(jnp.int32)
    if plan.limits:  # KeyLimit: n + t per (sequence, [part,] row), added here
        return pos, (lengths.reshape(-1, *[1] * offsets.ndim) + offsets).astype(jnp.float32)
    return pos, lengths, offsets


def _inference(kernel) -> Callable:
    """``kernel`` with no gradient: differentiating it raises :class:`NotLowerable` (decoding is inference)."""

    @jax.custom_vjp
    def f(*xs):
        return kernel(*xs)

    def backward(_, __):
        raise NotLowerable("decode_attention has no gradient (decoding is inference); train with nc.attention")

    f.defvjp(lambda *xs: (kernel(*xs), None), backward)
    return f


def _arrange(value, names: tuple[str, ...], want: str):
    """``value`` (axes ``names``) transposed into the order of ``want`` (space-separated names); as it is where it is
    in that order already."""
    order = [names.index(n) for n in want.split()]
    return value if order == sorted(order) else jnp.transpose(value, order)


def decode_attention(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    scale: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    return_residual: bool = False,
    parts: int | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    hardware: Hardware | str | None = None,
    page_table=None,
    chunk: int | None = None,
    tile: int | None = None,
):
    """Attention of the ``Nq`` newest tokens ``q`` ``[B, Nq, H, D]`` over the caches ``[B, S, H_kv, D]`` holding
    ``lengths`` ``[B]`` valid keys each, by split-KV (the module's docstring). ``hardware`` (a
    :class:`~napkin_cat.hardware.Hardware` or its name; by default the machine's GPU, H100 when interpreting) is
    the GPU the step is planned for (the parts fill its SMs) and its kernel lowered for (so with
    ``interpret=False`` it lowers for that GPU on any machine); ``parts`` overrides the number of parts, ``tile``
    the rows per program (:func:`row_tile`'s: a power of two from 16 to 256), ``chunk`` the keys per streamed chunk
    (:meth:`Plan.blocks`'s: a power of two from 16 to 256; with ``page_table``, whole pages). Returns ``[B, Nq, H,
    Dv]`` in q's dtype, and with ``return_residual`` also the log-sum-exp ``[B, Nq, H]`` (f32; −∞ where no key is seen).

    With ``page_table`` (int32 ``[B, pages_per_seq]``) the caches are page pools ``[P, page_size, H_kv, D]``:
    sequence ``b``'s key ``j`` is ``k_cache[page_table[b, j // page_size], j % page_size]``, gathered by the kernel
    as it streams (:mod:`lowering._paged`), ``chunk`` keys (whole pages) at a time. ``score_mod`` and ``mask_mod``
    read ``kv_idx`` as the key's position in its sequence (``j``), whichever page of the pool holds it.

    ``backend`` is ``"auto"`` (Triton on a GPU; Mosaic on a Hopper GPU where :func:`routed` says it was measured
    faster: ``Nq · H / H_kv`` ≥ 128 at D = 128), ``"triton"``, ``"xla"`` or ``"mosaic"``. ``"mosaic"`` takes a
    contiguous cache and a KV head's rows in tiles of wgmma's 64 rows or more, so ``Nq · H / H_kv`` ≥ 64. It reads
    the valid keys as one limit per row (:class:`KeyLimit`; the keys' positions made in the kernel), visits the
    chunks below its rows' limits, and splits the keys into parts of whole chunks, so it may run fewer parts than
    ``parts`` asks (``decode_plan(...).summary()`` says how many, and which backend runs).

    >>> import jax, jax.numpy as jnp
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, n, 4, 16)) for i, n in ((0, 2), (1, 24), (2, 24)))
    >>> out, lse = decode_attention(q, k, v, jnp.array([10]), parts=3, return_residual=True)
    >>> keep = jnp.arange(24)[None, :] < jnp.array([[9], [10]])  # query i sees keys < 10 − 2 + i + 1
    >>> ref = jax.nn.dot_product_attention(q, k, v, mask=keep[None, None])
    >>> bool(jnp.allclose(out, ref, atol=1e-5)), lse.shape
    (True, (1, 2, 4))
    >>> decode_attention(q, k, v, jnp.array([30]))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: decode_attention: lengths [30] outside [Nq, S] = [2, 24]: each length counts \
the cache's valid keys, the Nq new tokens included
    """
    plan = decode_plan(q, k_cache, v_cache, lengths, scale=scale, score_mod=score_mod, mask_mod=mask_mod, parts=parts,
                       backend=backend, interpret=interpret, hardware=hardware, page_table=page_table, chunk=chunk,
                       tile=tile)  # fmt: skip
    return _step(plan, q, k_cache, v_cache, lengths, page_table, residual=return_residual)


def decode_plan(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    scale: float | None = None,
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
    parts: int | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    hardware: Hardware | str | None = None,
    page_table=None,
    chunk: int | None = None,
    tile: int | None = None,
) -> Plan:
    """The :class:`Plan` :func:`decode_attention` runs for these arguments (the same ones), checked, its kernel
    built: what a benchmark prints beside its time (:meth:`Plan.summary`).

    >>> import jax.numpy as jnp
    >>> q, kv = jnp.zeros((1, 64, 32, 16)), jnp.zeros((1, 4096, 8, 16))
    >>> decode_plan(q, kv, kv, jnp.array([4096])).summary()   # Nq = 64 at GQA 4: 256 rows in 2 tiles of 128
    {'parts': 8, 'keys_per_part': 512, 'row_tiles': 2, 'tile': 128, 'chunk': 64, 'backend': 'triton'}
    """
    for name, fn, score in (("score_mod", score_mod, True), ("mask_mod", mask_mod, False)):
        if fn is not None and reads_query(positional(fn, FLEX, score=score), score):
            raise NotLowerable(
                f"decode_attention: {name} {fname(fn)} reads q_idx; a new token's position is lengths[b] − Nq + i, "
                "known only when the kernel runs: read only b, h and kv_idx (the key's position in the cache), by "
                "name (lambda score, kv_idx: ...) or in FlexAttention's positional form leaving q_idx unused"
            )
    fns = tuple(None if f is None else positional(f, FLEX, score=s) for f, s in ((score_mod, True), (mask_mod, False)))
    if page_table is not None:
        return _paged(q, k_cache, v_cache, lengths, page_table, scale, fns, parts, chunk, backend, interpret,
                      hardware, tile=tile)  # fmt: skip
    _checked(q, k_cache, v_cache, lengths)
    return _contiguous(q, k_cache, v_cache, scale, fns, parts, backend, interpret, hardware, tile=tile,
                       stream=_checked_chunk(chunk, k_cache.shape[1]))  # fmt: skip


def _contiguous(q, k_cache, v_cache, scale, fns, parts, backend, interpret, hardware, rope=None, tile=None,
                values=None, stream=None) -> Plan:
    """A checked contiguous call planned (``parts`` from the hardware's SMs unless given), its kernel built;
    ``rope``: MLA's rotary queries and keys; ``stream``: keys per streamed chunk (None: :func:`default_chunk`'s);
    ``backend``: as given, or where ``"auto"`` :func:`routed`'s."""
    (batch, nq, heads, dim), (_, keys, kv_heads, dv) = q.shape, v_cache.shape
    hw = _hardware(hardware, interpret, backend)
    tiles = row_tiles(nq * heads // kv_heads, (dim, dv), _checked_tile(tile))
    n = _parts(batch, kv_heads * tiles, keys, hw) if parts is None else parts
    if not isinstance(n, int) or not 1 <= n <= keys:
        raise EvaluationError(f"decode_attention: parts must be an integer in [1, S] = [1, {keys}], got {n!r}")
    r = 0 if rope is None else rope[1].shape[-1]
    per = math.ceil(keys / n)
    rows = tile or row_tile(nq * heads // kv_heads, (dim, dv))  # per program
    if rope is None:
        backend = routed(backend, interpret, q.dtype, rows, (dim, dv), fns, (n, per, keys))
    if backend == "mosaic" and keys > 2**24:
        raise NotLowerable(
            f"decode_attention: backend='mosaic' reads each row's key limit in f32, exact below 2**24 keys; the cache "
            f"holds {keys}: pass backend='triton'"
        )
    if backend == "mosaic" and rope is None:  # Mosaic streams whole chunks: parts of whole chunks (the last padded)
        c = stream or default_chunk(backend, rows, (dim, dv), per)
        per = -(-per // c) * c
        n = math.ceil(keys / per)
    crowd = backend in ("auto", "triton") and not rope and crowded(batch * kv_heads * tiles, n, hw, q.dtype, (dim, dv))
    plan = Plan(jnp.dtype(q.dtype).name, nq, heads // kv_heads, (dim, dv), n, per, scale, *fns, backend, interpret,
                rope=r, tile=tile, hardware=hw, values=values, stream=stream, crowded=crowd)  # fmt: skip
    _kernel(plan)  # built (derived, verified, lowered) here, outside any trace of the caller's
    return plan


def mla_decode_attention(
    q,
    latent_cache,
    rope_cache,
    lengths,
    *,
    scale: float | None = None,
    page_table=None,
    return_residual: bool = False,
    parts: int | None = None,
    chunk: int | None = None,
    backend: str = "auto",
    interpret: bool | None = None,
    hardware: Hardware | str | None = None,
    tile: int | None = None,
    values: int | None = None,
):
    """Absorbed multi-head latent attention (MLA, DeepSeek-V2/V3) decoding: ``q`` ``[B, Nq, H, C + R]`` (each
    head's absorbed query, its latent ``C`` dims then its rotary ``R``) over one shared KV head kept as DeepSeek's
    inference keeps it, the latent cache ``[B, S, C]`` (keys and values both) and the rotary keys ``[B, S, R]``;
    scores ``scale·q·[latent, rope]ᵀ`` over ``C + R`` dims (``scale`` defaults to ``1/√(C + R)``; DeepSeek-V3
    passes its own, ``1/√192`` times its YaRN factor), the output ``[B, Nq, H, C]`` the weights times the latent
    keys. The diagram is :func:`mla_attention`, decoded as ``decode_attention`` decodes (split-KV, the ``H``
    heads packed into the rows, ``lengths`` at call time, causal among the ``Nq`` new tokens); the latent cache
    is read once per chunk for both products. With ``page_table`` both caches are page pools ``[P, page_size,
    C]`` and ``[P, page_size, R]`` sharing the table. ``chunk`` sets the keys per streamed chunk (a power of two
    from 16 to 256; with ``page_table`` whole pages or a divisor of one; by default :func:`chunk_keys`'s), ``tile``
    the rows per program (64 by default:
    :func:`row_tile`'s for latent heads this wide), as in ``decode_attention``. ``values`` splits the output's
    ``C`` latent dims across programs, ``values`` each (a power of two ≥ 16 dividing ``C``): each program computes
    every score and holds a ``rows × values`` accumulator instead of ``rows × C`` (FlashMLA splits it across two
    warpgroups; here across programs, whose reads of the same chunks the L2 serves). None (the default): one program
    holds all; on an H200 the split took 1.4–2.8× the time, each program recomputing the scores (docs/decode.md).

    >>> import jax, jax.numpy as jnp
    >>> q = jax.random.normal(jax.random.key(0), (1, 1, 16, 48))                    # 16 heads of 32 + 16 dims
    >>> lat, rot = (jax.random.normal(jax.random.key(i), (1, 40, n)) for i, n in ((1, 32), (2, 16)))
    >>> out = mla_decode_attention(q, lat, rot, jnp.array([33]))
    >>> s = jnp.einsum("bqhd,bkd->bhqk", q, jnp.concatenate([lat, rot], -1)) / jnp.sqrt(48.0)
    >>> weights = jax.nn.softmax(jnp.where(jnp.arange(40) < 33, s, -jnp.inf), axis=-1)
    >>> ref = jnp.einsum("bhqk,bkc->bqhc", weights, lat)
    >>> out.shape, bool(jnp.allclose(out, ref, atol=1e-5))
    ((1, 1, 16, 32), True)
    """
    plan, q_c, k, rope = _mla_plan(q, latent_cache, rope_cache, lengths, scale, page_table, parts, chunk, backend,
                                   interpret, hardware, tile, values)  # fmt: skip
    return _step(plan, q_c, k, k, lengths, page_table, rope, residual=return_residual)


def _mla_plan(q, latent_cache, rope_cache, lengths, scale, page_table, parts, chunk, backend, interpret, hardware,
              tile=None, values=None):  # fmt: skip
    """``mla_decode_attention``'s arguments checked and planned: the plan, the latent queries, the latent cache as
    one KV head, and the rotary queries and keys."""
    c = latent_cache.shape[-1]
    if not (q.ndim == 4 and latent_cache.ndim == rope_cache.ndim == 3 and latent_cache.shape[:2] == rope_cache.shape[:2]
            and q.shape[3] == c + rope_cache.shape[-1]):  # fmt: skip
        raise EvaluationError(
            f"mla_decode_attention: q must be [B, Nq, H, C + R] over caches [B or P, S or page_size, C] and [..., R] "
            f"of one leading shape; q {tuple(q.shape)}, latent_cache {tuple(latent_cache.shape)}, rope_cache "
            f"{tuple(rope_cache.shape)}"
        )
    if jnp.dtype(rope_cache.dtype) != jnp.dtype(latent_cache.dtype):
        raise EvaluationError(
            f"mla_decode_attention: the caches' dtypes differ: {latent_cache.dtype}, {rope_cache.dtype}"
        )
    if values is not None and (isinstance(values, bool) or not isinstance(values, int) or values < 16
                               or values & (values - 1) or c % values):  # fmt: skip
        raise EvaluationError(
            f"mla_decode_attention: values={values!r} latent dims per program must be a power of two ≥ 16 dividing "
            f"the latent cache's C = {c}; pass None to keep them in one program"
        )
    values = None if values == c else values
    if backend == "mosaic":
        raise NotLowerable(
            "mla_decode_attention: backend='mosaic' has no MLA kernel (a consumer warpgroup would hold a 64 × 512 f32 "
            "accumulator: 256 registers a thread); pass backend='triton', 'xla' or 'auto'"
        )
    k, k_r = latent_cache[:, :, None], rope_cache[:, :, None]  # the one KV head
    q_c, rope = q[..., :c], (q[..., c:], k_r)
    if page_table is not None:
        plan = _paged(q_c, k, k, lengths, page_table, scale, (None, None), parts, chunk, backend, interpret,
                      hardware, rope, tile=tile, values=values)  # fmt: skip
    else:
        _checked(q_c, k, k, lengths)
        plan = _contiguous(q_c, k, k, scale, (None, None), parts, backend, interpret, hardware, rope,
                           tile=_checked_tile(tile), values=values, stream=_checked_chunk(chunk, k.shape[1]))
    return plan, q_c, k, rope


@functools.partial(jax.jit, static_argnums=0, static_argnames="residual")
def _step(plan: Plan, q, k_cache, v_cache, lengths, page_table=None, rope=None, *, residual: bool = False):
    """One decode step for ``plan`` (compiled once per plan and shapes; ``lengths`` and ``page_table`` are values):
    the queries' rows per KV head (:func:`pack_rows`), the caches read as parts (a contiguous cache by a reshape, a
    paged one through its table read as ``[B, parts, pages per part]``), the kernel, then the parts merged into the
    caller's layout and dtype; in one part (not :attr:`Plan.split`) the kernel's output is the step's, in the
    caller's dtype, its rows unpacked (:func:`unpack_rows`): no merge. ``rope``: MLA's rotary queries and keys
    ``(q_r, k_r)``. The output, and with ``residual`` its log-sum-exp (else not computed: an eager call would launch
    its pass too)."""
    (batch, nq, heads, _), (kv_heads, dv) = q.shape, v_cache.shape[2:]
    n, chunk, group, kernel = plan.parts, plan.chunk, plan.group, _kernel(plan)

    def parts(a, width):  # axis 1 read as n parts of width: a reshape, padded only where they overrun it (a copy)
        if n * width > a.shape[1]:
            a = jnp.pad(a, [(0, 0), (0, n * width - a.shape[1]), *[(0, 0)] * (a.ndim - 2)])
        return a.reshape(batch, n, width, *a.shape[2:]) if plan.split else a

    kv = [k_cache] if plan.latent_once else [k_cache, v_cache]  # MLA's latent: one input, copied
    ins = [pack_rows(q, kv_heads), *kv, *([] if rope is None else [pack_rows(rope[0], kv_heads), rope[1]])]
    masks = _lengths(lengths, plan)
    if page_table is None:
        ins = [a if i in (0, 1 + len(kv)) else parts(a, chunk) for i, a in enumerate(ins)]  # the queries: no parts
        o, lse = _inference(kernel)(*ins, *masks)
    else:  # part p of sequence b reads its pages table[b, p·w : (p+1)·w], through the page map
        table = parts(page_table, chunk // plan.pages[0])  # [B, parts, pages per part]
        paged = lambda *xs: kernel.forward(*xs[:-1], pages=(plan.page_map(), xs[-1]))  # noqa: E731
        o, lse = _inference(paged)(*ins, *masks, table)
    (o_names, l_names), p = (tuple(w.names) for w in kernel.diagram.cod.inside), "p " * plan.split
    o, lse = _arrange(o, o_names, f"b {p}h q_idx {o_names[-1]}"), _arrange(lse, l_names, f"b {p}h q_idx")
    if not plan.split:  # the kernel's (o, lse) are the step's; a row every key of which an index function hides
        # has lse = +∞ from the kernel, −∞ as the merge gives it (lengths ≥ Nq leave every row a key)
        if not residual:
            return unpack_rows(o, nq)
        lse = jnp.where(lse == jnp.inf, -jnp.inf, lse) if plan.score_mod or plan.mask_mod else lse
        return unpack_rows(o, nq), unpack_rows(lse, nq)
    o, lse = o.reshape(batch, n, kv_heads, nq, group, dv), lse.reshape(batch, n, kv_heads, nq, group)
    if kernel.backend == "xla":  # plain JAX: XLA's reduction, then the layout and the cast
        out, lse = (v.swapaxes(1, 2) for v in merge_parts(o.astype(jnp.float32), lse, 1))
        out = out.astype(q.dtype)
    else:  # one kernel writing the caller's layout and dtype
        out, lse = _inference(functools.partial(merge, dtype=q.dtype, interpret=interpreted(plan.interpret)))(o, lse)
    out = out.reshape(batch, nq, heads, dv)
    return (out, lse.reshape(batch, nq, heads)) if residual else out


def pack_rows(a, kv_heads: int):
    """The queries ``a`` ``[B, Nq, H, D]`` as a decode kernel's rows per KV head, ``[B, H_kv, Nq · H/H_kv, D]`` (row
    ``i · group + g``: token ``i``, head ``g`` of the KV head's group; FlashInfer's packing): a reshape where ``Nq``
    = 1 or ``H_kv`` = 1 (the caller's layout already holds each KV head's rows together), else a transpose (a
    copy: in ``[B, Nq, H, D]`` a KV head's rows are ``Nq`` blocks of ``group`` heads, strided, and a kernel's row
    tile is one block of rows).

    >>> a = jnp.arange(2 * 3 * 4).reshape(1, 2, 4, 3)   # Nq = 2 tokens, 4 heads over 2 KV heads
    >>> pack_rows(a, 2)[0, 1, :, 0].tolist()   # KV head 1: token 0's heads 2, 3, then token 1's
    [6, 9, 18, 21]
    >>> bool((unpack_rows(pack_rows(a, 2), 2) == a).all())
    True
    """
    batch, nq, heads, dim = a.shape
    if nq > 1 and kv_heads > 1:
        a = a.reshape(batch, nq, kv_heads, heads // kv_heads, dim).transpose(0, 2, 1, 3, 4)
    return a.reshape(batch, kv_heads, nq * heads // kv_heads, dim)


def unpack_rows(a, queries: int):
    """A decode kernel's rows per KV head ``a`` ``[B, H_kv, Nq · group, ...]`` (:func:`pack_rows`) in the caller's
    layout ``[B, Nq, H, ...]``: a reshape where ``Nq`` = 1 or ``H_kv`` = 1, else a transpose.

    >>> unpack_rows(jnp.zeros((2, 8, 4)), 1).shape, unpack_rows(jnp.zeros((2, 8, 4, 16)), 2).shape
    ((2, 1, 32), (2, 2, 16, 16))
    """
    batch, kv_heads, rows, *rest = a.shape
    group = rows // queries
    if queries > 1 and kv_heads > 1:
        a = jnp.swapaxes(a.reshape(batch, kv_heads, queries, group, *rest), 1, 2)
    return a.reshape(batch, queries, kv_heads * group, *rest)


def _paged(q, k_pages, v_pages, lengths, page_table, scale, mods, parts, chunk, backend, interpret, hardware, rope=None,
           tile=None, values=None):  # fmt: skip
    """``decode_attention``'s plan over page pools: checked (before anything is built), planned, the same derived
    kernel as a contiguous cache's built, its keys and values to be read through the page map."""
    check_paged(q, k_pages, v_pages, page_table, chunk, MAX_QUERIES)
    (batch, nq, heads, dim), (pool, page_size, kv_heads, dv) = q.shape, v_pages.shape
    width = page_table.shape[1]
    _checked_common(q, k_pages, v_pages, lengths, width * page_size)
    check_pages_used(page_table, lengths, pool, page_size)
    hw = _hardware(hardware, interpret, backend)
    tiles = row_tiles(nq * heads // kv_heads, (dim, dv), _checked_tile(tile))
    rows = tile or row_tile(nq * heads // kv_heads, (dim, dv))
    n_default = _parts(batch, kv_heads * tiles, width * page_size, hw, exact=False)
    covered = max(16, 1 << (width * page_size - 1).bit_length())  # a short table's keys, to a power of two
    default = min(chunk_keys((dim, dv), once=rope is not None and values is None), covered)
    # Mosaic where auto takes it for a contiguous cache (the same kernel: only where its chunks load from differs),
    # streaming its 128-key chunks: pages of 64 two TMA copies each
    mosaic = rope is None and routed(backend, interpret, q.dtype, rows, (dim, dv), mods) == "mosaic"
    if mosaic:
        default = min(default_chunk("mosaic", rows, (dim, dv), width * page_size), covered)
    elif not rope and crowded(batch * kv_heads * tiles, n_default, hw, q.dtype, (dim, dv)):  # two pages of 64
        default = min(default_chunk("triton", rows, (dim, dv), width * page_size, crowded=True), covered)
    n, per_part, keys = paged_split(width, page_size, parts=parts, chunk=default if chunk is None else chunk,
                                    n_default=n_default)  # fmt: skip
    backend = "mosaic" if mosaic else "triton" if backend == "auto" else backend
    plan = Plan(jnp.dtype(q.dtype).name, nq, heads // kv_heads, (dim, dv), n, per_part * page_size, scale, *mods,
                backend=backend, interpret=interpret, pages=(page_size, keys),
                rope=0 if rope is None else rope[1].shape[-1], tile=tile, hardware=hw, values=values)  # fmt: skip
    _kernel(plan)
    return plan
