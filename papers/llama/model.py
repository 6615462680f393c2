"""A Llama-style decoder in Flax NNX whose every attention (and, asked, every norm with the projections after it)
is napkin-cat's derived kernel, or, by one switch, ``jax.nn.dot_product_attention`` and XLA's norm then matmul (the
baseline: the same model, the same parameters).

The architecture is Llama's (Touvron et al. 2023; Llama 3's grouped-query heads): pre-norm blocks of RMSNorm,
grouped-query causal self-attention on rotary positions (RoPE, Su et al. 2021), and a SwiGLU MLP (Shazeer 2020);
a final RMSNorm and a classifier tied to the embedding or not. ``attention="napkin"`` calls ``nc.attention``
(derived, verified and lowered once per shape, differentiated by its lowered backward kernels);
``attention="reference"`` calls ``jax.nn.dot_product_attention``. ``fuse_norms=True`` fuses each block's two
RMSNorms into the projections after them: ``nc.rms_norm_linear`` once for the norm and the q, k, v projections
(their weights side by side) and once for the norm and the gate and up projections, so the normalised activations
are never written (:func:`norm_project`). It is off by default: on an H200 ``nc.rms_norm_linear`` ran 0.26× / 0.79×
XLA's norm then cuBLAS matmul (forward / forward + backward, ``papers/flash_attention/rms_norm_linear.py``), and the
model with it 0.65× the reference's tokens/s. RoPE is applied with jax.numpy to q and k
before either attention (one function, :func:`rope`).

>>> cfg = CONFIGS["tiny"]
>>> model = Llama(cfg, attention="reference", rngs=nnx.Rngs(0))
>>> tokens = jax.random.randint(jax.random.key(1), (2, 24), 0, cfg.vocab)
>>> model(tokens).shape
(2, 24, 256)
>>> napkin = Llama(cfg, attention="napkin", backend="xla", rngs=nnx.Rngs(0))     # the same parameters
>>> bool(jnp.allclose(napkin(tokens), model(tokens), atol=1e-4))
True
>>> fused = Llama(cfg, attention="napkin", backend="xla", fuse_norms=True, rngs=nnx.Rngs(0))
>>> bool(jnp.allclose(fused(tokens), model(tokens), atol=1e-4))
True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import napkin_cat as nc
from lowering import KVCache
from napkin_cat.errors import AxisError, EvaluationError

#: the attentions the model switches between: napkin-cat's entry, and jax.nn's (XLA) as the baseline
ATTENTIONS = ("napkin", "reference")

#: the losses :func:`loss_fn` computes: optax's cross-entropy on materialised logits, or napkin-cat's fused one
LOSSES = ("logits", "fused")


@dataclasses.dataclass(frozen=True)
class Config:
    """The sizes of a model. ``kv_heads`` key/value heads are shared by ``heads // kv_heads`` query heads each;
    ``rotary_dim`` (default: the head dim) leading features of each head are rotated; ``dtype`` is the compute
    dtype (parameters stay f32); ``tied`` shares the embedding with the classifier.

    >>> Config(d_model=64, layers=1, heads=3, kv_heads=1, ffn=128, seq=16)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: Config: d_model=64 does not split into heads=3; pass head_dim=
    """

    d_model: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    seq: int
    vocab: int = 256
    head_dim: int | None = None
    rotary_dim: int | None = None
    rope_base: float = 10_000.0
    norm_eps: float = 1e-5
    tied: bool = True
    dtype: str = "float32"

    def __post_init__(self):
        if self.head_dim is None and self.d_model % self.heads:
            raise AxisError(f"Config: d_model={self.d_model} does not split into heads={self.heads}; pass head_dim=")
        if self.heads % self.kv_heads:
            raise AxisError(f"Config: heads={self.heads} do not share kv_heads={self.kv_heads} evenly")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.dim):
            raise AxisError(f"Config: rotary_dim={self.rotary_dim} must be even and in (0, head dim {self.dim}]")

    @property
    def dim(self) -> int:
        """The head dim."""
        return self.d_model // self.heads if self.head_dim is None else self.head_dim

    @property
    def rotary(self) -> int:
        """The features of a head that RoPE rotates."""
        return self.dim if self.rotary_dim is None else self.rotary_dim


#: ``tiny`` for CPU tests, ``small`` for loss curves, ``1b`` (Llama 3.2 1B's body on bytes: 0.97B parameters,
#: sequence 4096) and ``1b-128k`` (the same with Llama 3's vocabulary) for the GPU benchmark
CONFIGS = {
    "tiny": Config(d_model=64, layers=2, heads=4, kv_heads=2, ffn=128, seq=32),
    "small": Config(d_model=256, layers=4, heads=4, kv_heads=2, ffn=704, seq=512, dtype="bfloat16"),
    "1b": Config(
        d_model=2048, layers=16, heads=32, kv_heads=8, ffn=8192, seq=4096, rope_base=500_000.0, dtype="bfloat16"
    ),
}
# Llama 3.2 1B's own shape: its 128,256-token vocabulary (1.24B parameters, tied), where the [tokens, vocab] logits
# are the largest buffer of a training step (8.4 GB in f32 at 16k tokens) and a fused loss pays (the bytes of the
# corpus are ids below 256 of it)
CONFIGS["1b-128k"] = dataclasses.replace(CONFIGS["1b"], vocab=128_256)


def rope(x, positions, base: float, rotary_dim: int):
    """Rotary position embedding of ``x`` ``[..., seq, heads, dim]`` at integer ``positions`` ``[..., seq]``: the
    leading ``rotary_dim`` features of each head, as ``rotary_dim / 2`` pairs ``(i, i + rotary_dim / 2)`` (the
    "rotate half" layout of GPT-NeoX and Hugging Face's Llama), turn by ``position · base^(-2i / rotary_dim)``;
    the rest pass through. Computed in f32, returned in ``x``'s dtype.

    >>> x = jax.random.normal(jax.random.key(0), (1, 5, 2, 8))
    >>> y = rope(x, jnp.arange(5)[None], 10_000.0, 8)
    >>> norm = lambda a: jnp.linalg.norm(a, axis=-1)
    >>> bool(jnp.allclose(y[:, 0], x[:, 0])), bool(jnp.allclose(norm(y), norm(x)))   # position 0 stays; norms kept
    (True, True)
    """
    half = rotary_dim // 2
    inv_freq = base ** (-jnp.arange(half, dtype=jnp.float32) * 2 / rotary_dim)
    angles = positions[..., :, None, None].astype(jnp.float32) * inv_freq  # [..., seq, 1, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2, rest = (a.astype(jnp.float32) for a in (x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]))
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1).astype(x.dtype)


def attention_fn(name: str, backend: str = "auto") -> Callable:
    """The causal attention ``name`` (one of :data:`ATTENTIONS`) on ``[batch, seq, heads, dim]`` arrays, grouped-
    query when k and v have fewer heads; ``backend`` is napkin-cat's (``"auto"``, ``"triton"``, ``"mosaic"``,
    ``"xla"``).

    >>> q, k = (jax.random.normal(jax.random.key(i), (1, 20, h, 16)) for i, h in ((0, 4), (1, 2)))
    >>> bool(jnp.allclose(attention_fn("napkin", "xla")(q, k, k), attention_fn("reference")(q, k, k), atol=1e-5))
    True
    """
    if name == "reference":  # cuDNN's fused attention on a GPU (the baseline to beat), XLA's elsewhere
        impl = "cudnn" if jax.default_backend() == "gpu" else None
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    if name == "napkin":
        return lambda q, k, v: nc.attention(q, k, v, is_causal=True, backend=backend)
    raise EvaluationError(f"attention={name!r}: choose one of {ATTENTIONS}")


def norm_project(norm: nnx.RMSNorm, linears: list[nnx.Linear], x, *, fused: bool, backend: str = "auto") -> list:
    """``[linear(norm(x)) for linear in linears]``: with ``fused``, one ``nc.rms_norm_linear`` call on the linears'
    weights side by side (the norm fused into one projection, split after), else the norm then each matmul (XLA).

    >>> cfg = CONFIGS["tiny"]
    >>> norm, linears = _norm(cfg, nnx.Rngs(0)), [_linear(64, n, cfg, nnx.Rngs(i)) for i, n in ((1, 32), (2, 16))]
    >>> x = jax.random.normal(jax.random.key(3), (2, 5, 64))
    >>> ours, theirs = (norm_project(norm, linears, x, fused=f, backend="xla") for f in (True, False))
    >>> [a.shape for a in ours], all(bool(jnp.allclose(a, b, atol=1e-5)) for a, b in zip(ours, theirs))
    ([(2, 5, 32), (2, 5, 16)], True)
    """
    if not fused:
        h = norm(x)
        return [linear(h) for linear in linears]
    dtype = linears[0].dtype
    w = jnp.concatenate([linear.kernel[...] for linear in linears], axis=1).astype(dtype)
    y = nc.rms_norm_linear(x.astype(dtype), norm.scale[...], w, eps=norm.epsilon, backend=backend)
    ends = [linear.out_features for linear in linears]
    return jnp.split(y, list(itertools.accumulate(ends))[:-1], axis=-1)


def _linear(n_in: int, n_out: int, cfg: Config, rngs: nnx.Rngs, scale: float = 1.0) -> nnx.Linear:
    # Llama's initialisation: normal(0.02), residual projections scaled down by the depth (GPT-2's 1/√(2L))
    init = nnx.initializers.normal(0.02 * scale)
    return nnx.Linear(n_in, n_out, use_bias=False, kernel_init=init, dtype=cfg.dtype, rngs=rngs)


def _norm(cfg: Config, rngs: nnx.Rngs) -> nnx.RMSNorm:
    return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=cfg.dtype, rngs=rngs)


class Attention(nnx.Module):
    """Grouped-query causal self-attention on RoPE'd queries and keys of ``norm(x)``: ``[batch, seq, d_model]`` → the
    same (the norm fused into the q, k, v projections with ``fuse_norms``)."""

    def __init__(self, cfg: Config, *, attention: str, backend: str, fuse_norms: bool = False, rngs: nnx.Rngs):
        self.cfg, self.attention, self.backend = cfg, attention, backend
        residual = (2 * cfg.layers) ** -0.5
        self.query = _linear(cfg.d_model, cfg.heads * cfg.dim, cfg, rngs)
        self.key = _linear(cfg.d_model, cfg.kv_heads * cfg.dim, cfg, rngs)
        self.value = _linear(cfg.d_model, cfg.kv_heads * cfg.dim, cfg, rngs)
        self.out = _linear(cfg.heads * cfg.dim, cfg.d_model, cfg, rngs, residual)
        self.fused = fuse_norms

    def __call__(self, x, positions, norm: nnx.RMSNorm):
        q, k, v = self._project(x, positions, norm)
        return self._out(attention_fn(self.attention, self.backend)(q, k, v))

    def step(self, x, positions, norm: nnx.RMSNorm, cache: KVCache, *, prefill: bool) -> tuple:
        """``x`` at ``positions`` with a KV cache: the prompt (``prefill``: attended causally among itself, as
        :meth:`__call__`) or the next token (attended over the cache), its keys and values appended either way.
        Napkin-cat decodes with ``nc.decode_attention``; the reference with ``jax.nn.dot_product_attention`` over
        the cache, masked by its lengths (one token at a time). Returns ``(y, cache)``."""
        q, k, v = self._project(x, positions, norm)
        cache = cache.append(k, v)
        if prefill:
            o = attention_fn(self.attention, self.backend)(q, k, v)
        elif self.attention == "napkin":
            o = cache.attend(q, backend=self.backend)
        else:
            o = jax.nn.dot_product_attention(q, cache.k, cache.v, key_value_seq_lengths=cache.lengths)
        return self._out(o), cache

    def _project(self, x, positions, norm: nnx.RMSNorm) -> tuple:
        cfg = self.cfg
        *lead, seq, _ = x.shape
        q, k, v = norm_project(norm, [self.query, self.key, self.value], x, fused=self.fused, backend=self.backend)
        q = q.reshape(*lead, seq, cfg.heads, cfg.dim)
        k, v = (a.reshape(*lead, seq, cfg.kv_heads, cfg.dim) for a in (k, v))
        q, k = (rope(a, positions, cfg.rope_base, cfg.rotary) for a in (q, k))
        return q, k, v

    def _out(self, o):
        return self.out(o.reshape(*o.shape[:-2], self.cfg.heads * self.cfg.dim))


class MLP(nnx.Module):
    """SwiGLU of ``norm(x)``: ``down(silu(gate(h)) · up(h))``, ``h = norm(x)`` (the norm fused into the gate and up
    projections where ``fused``)."""

    def __init__(self, cfg: Config, *, fused: bool = False, backend: str = "auto", rngs: nnx.Rngs):
        self.gate = _linear(cfg.d_model, cfg.ffn, cfg, rngs)
        self.up = _linear(cfg.d_model, cfg.ffn, cfg, rngs)
        self.down = _linear(cfg.ffn, cfg.d_model, cfg, rngs, (2 * cfg.layers) ** -0.5)
        self.fused, self.backend = fused, backend

    def __call__(self, x, norm: nnx.RMSNorm):
        gate, up = norm_project(norm, [self.gate, self.up], x, fused=self.fused, backend=self.backend)
        return self.down(jax.nn.silu(gate) * up)


class Block(nnx.Module):
    """A pre-norm decoder block: ``x + attention(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: Config, *, attention: str, backend: str, fuse_norms: bool = False, rngs: nnx.Rngs):
        self.attention_norm, self.mlp_norm = _norm(cfg, rngs), _norm(cfg, rngs)
        self.attention = Attention(cfg, attention=attention, backend=backend, fuse_norms=fuse_norms, rngs=rngs)
        self.mlp = MLP(cfg, fused=fuse_norms, backend=backend, rngs=rngs)

    def __call__(self, x, positions):
        x = x + self.attention(x, positions, self.attention_norm)
        return x + self.mlp(x, self.mlp_norm)

    def step(self, x, positions, cache: KVCache, *, prefill: bool) -> tuple:
        """The block with its attention's KV cache (:meth:`Attention.step`): ``(y, cache)``."""
        y, cache = self.attention.step(x, positions, self.attention_norm, cache, prefill=prefill)
        x = x + y
        return x + self.mlp(x, self.mlp_norm), cache


class Llama(nnx.Module):
    """The decoder: token ids ``[batch, seq]`` → logits ``[batch, seq, vocab]`` (:meth:`__call__`), or the final
    hidden states and the classifier's weight ``[d_model, vocab]`` apart (:meth:`hidden`, :meth:`classifier`), for a
    loss that never forms the logits. ``attention`` is one of :data:`ATTENTIONS`; ``backend`` napkin-cat's;
    ``fuse_norms`` fuses each block's norms into the projections after them (``nc.rms_norm_linear``; off by
    default, measured slower than XLA's norm and cuBLAS's matmul: see the module).

    >>> model = Llama(CONFIGS["tiny"], rngs=nnx.Rngs(0))
    >>> model.classifier().shape, model.attention
    ((64, 256), 'napkin')
    >>> Llama(CONFIGS["tiny"], attention="cudnn", rngs=nnx.Rngs(0))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: Llama: attention='cudnn': choose one of ('napkin', 'reference')
    """

    def __init__(self, cfg: Config, *, attention: str = "napkin", backend: str = "auto", fuse_norms: bool = False,
                 rngs: nnx.Rngs):  # fmt: skip
        if attention not in ATTENTIONS:
            raise EvaluationError(f"Llama: attention={attention!r}: choose one of {ATTENTIONS}")
        if fuse_norms and attention != "napkin":
            raise EvaluationError(
                "Llama: fuse_norms=True fuses the norms on napkin-cat's kernel; pass attention='napkin'"
            )
        self.cfg, self.attention = cfg, attention
        self.embed = nnx.Embed(
            cfg.vocab, cfg.d_model, dtype=cfg.dtype, embedding_init=nnx.initializers.normal(0.02), rngs=rngs
        )
        block = dict(attention=attention, backend=backend, fuse_norms=fuse_norms)
        self.blocks = nnx.List([Block(cfg, **block, rngs=rngs) for _ in range(cfg.layers)])
        self.norm = _norm(cfg, rngs)
        self.head = None if cfg.tied else _linear(cfg.d_model, cfg.vocab, cfg, rngs)

    def hidden(self, tokens):
        """The final normalised hidden states ``[batch, seq, d_model]`` of ``tokens`` ``[batch, seq]``."""
        x = self.embed(tokens)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
        for block in self.blocks:
            x = block(x, positions)
        return self.norm(x)

    def init_caches(self, batch: int, max_len: int) -> list[KVCache]:
        """An empty KV cache per block (contiguous, ``[batch, max_len, kv_heads, dim]`` in the model's dtype)."""
        cfg = self.cfg
        return [KVCache.empty(batch=batch, max_len=max_len, kv_heads=cfg.kv_heads, dim=cfg.dim, dtype=cfg.dtype)
                for _ in self.blocks]  # fmt: skip

    def prefill(self, tokens, caches: list[KVCache]) -> tuple:
        """The prompts ``[batch, n]`` (one length) into empty ``caches``: the last position's logits
        ``[batch, vocab]`` (f32) and the caches."""
        return self._step(tokens, jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape), caches, True)

    def decode(self, tokens, caches: list[KVCache]) -> tuple:
        """The next token ``[batch, 1]`` of each sequence, at position ``caches[0].lengths``: its logits
        ``[batch, vocab]`` (f32) and the caches.

        >>> cfg = CONFIGS["tiny"]
        >>> model = Llama(cfg, attention="reference", rngs=nnx.Rngs(0))
        >>> tokens = jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab)
        >>> last, caches = model.prefill(tokens[:, :5], model.init_caches(2, 8))
        >>> logits, caches = model.decode(tokens[:, 5:], caches)
        >>> bool(jnp.allclose(logits, model(tokens)[:, -1], atol=1e-4)), caches[0].lengths.tolist()
        (True, [6, 6])
        """
        if tokens.ndim != 2 or tokens.shape[1] != 1:
            raise EvaluationError(f"Llama.decode: tokens of shape {tokens.shape}: pass one token per sequence, [B, 1]")
        return self._step(tokens, caches[0].lengths[:, None], caches, False)

    def _step(self, tokens, positions, caches, prefill: bool) -> tuple:
        x, out = self.embed(tokens), []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.step(x, positions, cache, prefill=prefill)
            out.append(cache)
        return (self.norm(x[:, -1]) @ self.classifier()).astype(jnp.float32), out

    def classifier(self):
        """The classifier's weight ``[d_model, vocab]``: the embedding's transpose when tied."""
        w = self.embed.embedding[...].T if self.head is None else self.head.kernel[...]
        return w.astype(self.cfg.dtype)

    def __call__(self, tokens):
        return self.hidden(tokens) @ self.classifier()


def loss_fn(model: Llama, batch, loss: str = "logits", budget: int | None = None):
    """Mean next-token cross-entropy of ``batch`` ``[batch, seq + 1]`` (predicting ``batch[:, 1:]``), in f32.

    ``loss="logits"`` forms the logits and takes optax's ``softmax_cross_entropy_with_integer_labels``;
    ``loss="fused"`` gives the hidden states and the classifier's weight to napkin-cat's
    ``nc.linear_cross_entropy``, which never forms the ``[tokens, vocab]`` logits (``budget``: its XLA backend's
    bytes per logit block, by default the library's).

    >>> model = Llama(CONFIGS["tiny"], attention="reference", rngs=nnx.Rngs(0))
    >>> batch = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    >>> bool(jnp.abs(loss_fn(model, batch) - jnp.log(256)) < 0.1)            # near uniform at initialisation
    True
    >>> loss_fn(model, batch, loss="softmax")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: loss_fn: loss='softmax': choose one of ('logits', 'fused')
    """
    if loss not in LOSSES:
        raise EvaluationError(f"loss_fn: loss={loss!r}: choose one of {LOSSES}")
    h, labels, w = model.hidden(batch[:, :-1]), batch[:, 1:], model.classifier()
    if loss == "logits":
        logits = (h @ w).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    h = h.reshape(-1, h.shape[-1])  # the classifier [d, vocab] as the fused loss takes it: [vocab, d]
    return nc.linear_cross_entropy(h, w.T, labels.reshape(-1), reduction="mean", budget=budget).astype(jnp.float32)


def parameter_count(model: nnx.Module) -> int:
    """The number of parameters.

    >>> parameter_count(Llama(CONFIGS["tiny"], rngs=nnx.Rngs(0)))
    90432
    """
    return sum(math.prod(p.shape) for p in jax.tree.leaves(nnx.state(model, nnx.Param)))
