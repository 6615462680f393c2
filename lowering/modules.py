"""Flax NNX modules on the drop-in entry :data:`lowering._attention` (needs the ``flax`` extra).

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> layer = SelfAttention(32, heads=4, kv_heads=2, causal=True, rngs=nnx.Rngs(0))
>>> x = jax.random.normal(jax.random.key(1), (2, 20, 32))
>>> y = layer(x)
>>> y.shape, layer.attention_fn is attention
((2, 20, 32), True)
>>> reference = SelfAttention(32, heads=4, kv_heads=2, causal=True, attention_fn=jax.nn.dot_product_attention,
...                           rngs=nnx.Rngs(0))
>>> bool(jnp.allclose(y, reference(x), atol=1e-5))
True
>>> ids = jnp.array([[0] * 8 + [1] * 12, [0] * 20])                 # two documents, then one
>>> bool(jnp.allclose(layer(x, segment_ids=ids), reference(x, segment_ids=ids), atol=1e-5))
True

Flax's own layer takes the entry through :func:`flax_attention` (its ``attention_fn`` convention):

>>> mha = nnx.MultiHeadAttention(4, 32, attention_fn=flax_attention, decode=False, rngs=nnx.Rngs(0))
>>> causal = nnx.make_causal_mask(jnp.ones((2, 20)))                   # float 1/0, [B, 1, N, N]
>>> same = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0))  # jax.nn's attention, same parameters
>>> bool(jnp.allclose(mha(x, mask=causal, deterministic=True), same(x, mask=causal, deterministic=True), atol=1e-5))
True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from lowering._attention import attention
from lowering._kv_cache import KVCache
from lowering._plan import NotLowerable
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators import check_rate


class SelfAttention(nnx.Module):
    """Multi-head self-attention, grouped-query when ``kv_heads < heads``: ``[batch, seq, features]`` →
    ``[batch, seq, features]``, projecting queries, keys and values, attending, projecting out.

    ``attention_fn`` takes ``jax.nn.dot_product_attention``'s arguments; it is the napkin-cat entry by
    default, and ``jax.nn.dot_product_attention`` itself gives the reference model with the same parameters.
    ``score_mod``/``mask_mod`` (FlexAttention's, see :mod:`lowering._attention`) reach only the entry.
    ``v_head_dim`` (default: ``head_dim``) gives the values a head dim of their own (as in MLA); the output
    projection reads ``heads × v_head_dim`` features.

    Called as ``layer(x, mask=None, bias=None, segment_ids=None)``: ``mask`` and ``bias`` broadcast as in
    ``jax.nn`` (``[B or 1, H or 1, N, N]``, fewer leading axes read as 1) and reach ``attention_fn`` as given;
    ``segment_ids`` (integers ``[B, N]``: a token sees the tokens of its own document) reach an
    ``attention_fn`` that takes them (the entry, which reads them block by block), and become the mask
    ``ids[i] == ids[j]`` (and-ed with ``mask``) for one that does not, such as ``jax.nn``'s: so both give the
    same layer, though the mask costs ``jax.nn`` an ``N × N`` array. Only the arguments given are passed.

    Generating (a causal layer): :meth:`init_cache` gives an empty :class:`~lowering.KVCache` (contiguous or
    paged), :meth:`prefill` runs the prompt through ``attention_fn`` and fills the cache, :meth:`decode` runs the
    next tokens through ``nc.decode_attention`` over it; both return ``(y, cache)``, pure, for a ``jit`` loop.

    >>> from flax import nnx
    >>> SelfAttention(30, heads=4, rngs=nnx.Rngs(0))
    Traceback (most recent call last):
    ...
    napkin_cat.errors.AxisError: SelfAttention: 30 features do not split into 4 heads; pass head_dim=
    """

    def __init__(
        self,
        features: int,
        heads: int,
        *,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        v_head_dim: int | None = None,
        causal: bool = False,
        score_mod: Callable | None = None,
        mask_mod: Callable | None = None,
        attention_fn: Callable = attention,
        use_bias: bool = False,
        dtype=None,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        kv_heads = heads if kv_heads is None else kv_heads
        if head_dim is None and features % heads:
            raise AxisError(f"SelfAttention: {features} features do not split into {heads} heads; pass head_dim=")
        if heads % kv_heads:
            raise AxisError(f"SelfAttention: {heads} query heads do not share {kv_heads} key/value heads evenly")
        self.heads, self.kv_heads = heads, kv_heads
        self.head_dim = features // heads if head_dim is None else head_dim
        self.v_head_dim = self.head_dim if v_head_dim is None else v_head_dim
        self.causal, self.attention_fn = causal, attention_fn
        # a tuple, not a dict: NNX keeps it in the graphdef, which must hash (jax.jit(..., static_argnums=0))
        self.mods = tuple((k, f) for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod)) if f is not None)

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.query = linear(features, heads * self.head_dim)
        self.key = linear(features, kv_heads * self.head_dim)
        self.value = linear(features, kv_heads * self.v_head_dim)
        self.out = linear(heads * self.v_head_dim, features)

    def __call__(self, x, *, mask=None, bias=None, segment_ids=None):
        q, k, v = self._project(x)
        given = {"mask": mask, "bias": bias}
        if segment_ids is not None and not takes_segment_ids(self.attention_fn):
            # [*lead, 1, N, N]: the same documents for every head
            same = segment_ids[..., None, :, None] == segment_ids[..., None, None, :]
            given["mask"] = same if mask is None else jnp.logical_and(mask, same)
        elif segment_ids is not None:
            given["segment_ids"] = segment_ids
        options = {name: a for name, a in given.items() if a is not None}
        o = self.attention_fn(q, k, v, is_causal=self.causal, **options, **dict(self.mods))
        return self._out(o)

    def init_cache(self, batch: int, max_len: int, *, page_size: int | None = None, dtype=jnp.float32) -> KVCache:
        """An empty :class:`~lowering.KVCache` for this layer's KV heads and head dims (paged with ``page_size``).

        >>> from flax import nnx
        >>> SelfAttention(32, heads=4, kv_heads=2, causal=True, rngs=nnx.Rngs(0)).init_cache(2, 16).k.shape
        (2, 16, 2, 8)
        """
        return KVCache.empty(batch=batch, max_len=max_len, kv_heads=self.kv_heads, dim=self.head_dim,
                             value_dim=self.v_head_dim, dtype=dtype, page_size=page_size)  # fmt: skip

    def prefill(self, x, cache: KVCache) -> tuple:
        """The prompt ``x`` ``[B, N, features]`` of every sequence into an empty ``cache``: attended causally by
        ``attention_fn`` (the napkin-cat entry by default), its keys and values written. Returns ``(y, cache)``.

        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> layer = SelfAttention(32, heads=4, kv_heads=2, causal=True, rngs=nnx.Rngs(0))
        >>> x = jax.random.normal(jax.random.key(1), (2, 6, 32))
        >>> y, cache = layer.prefill(x[:, :5], layer.init_cache(2, 16))
        >>> z, cache = layer.decode(x[:, 5:], cache)                   # the sixth token, against the cache
        >>> bool(jnp.allclose(jnp.concatenate([y, z], 1), layer(x), atol=1e-5)), cache.lengths.tolist()
        (True, [6, 6])
        """
        self._generating("prefill")
        q, k, v = self._project(x)
        o = self.attention_fn(q, k, v, is_causal=True, **dict(self.mods))
        return self._out(o), cache.append(k, v)

    def decode(self, x, cache: KVCache) -> tuple:
        """The next ``Nq`` tokens ``x`` ``[B, Nq, features]`` (1 to 64, at positions ``cache.lengths …``): their
        keys and values appended, their queries attended over the cache by ``nc.decode_attention`` (causal among
        themselves). Returns ``(y, cache)``."""
        self._generating("decode")
        q, k, v = self._project(x)
        cache = cache.append(k, v)
        return self._out(cache.attend(q)), cache

    def _generating(self, step: str) -> None:
        if not self.causal or self.mods:
            raise EvaluationError(
                f"SelfAttention.{step}: generating needs a causal layer with no score_mod/mask_mod (the cache is "
                "read by position only); build it with causal=True"
            )

    def _project(self, x) -> tuple:
        *lead, seq, _ = x.shape
        q = self.query(x).reshape(*lead, seq, self.heads, self.head_dim)
        k = self.key(x).reshape(*lead, seq, self.kv_heads, self.head_dim)
        return q, k, self.value(x).reshape(*lead, seq, self.kv_heads, self.v_head_dim)

    def _out(self, o):
        return self.out(o.reshape(*o.shape[:-2], self.heads * self.v_head_dim))


def takes_segment_ids(fn: Callable) -> bool:
    """Whether ``fn`` takes a ``segment_ids`` keyword (napkin-cat's entry does; ``jax.nn``'s does not).

    >>> import jax
    >>> takes_segment_ids(attention), takes_segment_ids(jax.nn.dot_product_attention)
    (True, False)
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a callable without a signature: pass only what jax.nn takes
        return False
    return "segment_ids" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def flax_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
    **options,
):
    """The entry with Flax's ``attention_fn`` signature (``flax.nnx.dot_product_attention``'s), for
    ``nnx.MultiHeadAttention(attention_fn=flax_attention)``; ``options`` (``score_mod``, ``segment_ids``, …)
    reach :data:`lowering._attention.attention`.

    Flax's masks are float (``nnx.make_causal_mask`` gives 1.0 where a score is kept): any mask is read as
    ``mask != 0``. ``dtype`` casts q, k and v first, as Flax computes in it; ``precision`` is the kernel's own
    (f32 accumulation). Dropout (``dropout_rate > 0`` while not ``deterministic``) runs inside the kernel, its mask
    hashed from ``dropout_rng`` (the entry's ``dropout_key``); under ``broadcast_dropout`` (Flax's default) one mask
    serves every batch row and head, as Flax broadcasts it. ``module=`` (Flax's ``sow_weights``) is refused: the
    kernel never forms the attention weights.

    >>> import jax, jax.numpy as jnp
    >>> q, k, v = (jax.random.normal(jax.random.key(i), (1, 8, 2, 16)) for i in range(3))
    >>> mask = jnp.tril(jnp.ones((8, 8)))[None, None]                   # float, as Flax's helpers make
    >>> out = flax_attention(q, k, v, mask=mask)
    >>> bool(jnp.allclose(out, jax.nn.dot_product_attention(q, k, v, is_causal=True), atol=1e-5))
    True
    >>> dropped = flax_attention(q, k, v, mask=mask, dropout_rate=0.1, dropout_rng=jax.random.key(0))
    >>> same = flax_attention(q, k, v, mask=mask, dropout_rate=0.1, deterministic=True)  # no dropout
    >>> dropped.shape, bool(jnp.allclose(same, out, atol=1e-6)), bool(jnp.allclose(dropped, out, atol=1e-3))
    ((1, 8, 2, 16), True, False)
    >>> flax_attention(q, k, v, dropout_rate=0.1)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: flax_attention: dropout_rate=0.1 while deterministic=False needs \
dropout_rng, a JAX PRNG key; pass one (nnx.MultiHeadAttention takes rngs=nnx.Rngs(dropout=...)), or \
deterministic=True
    """
    rate = check_rate(dropout_rate, "flax_attention") if not deterministic else 0.0
    if rate > 0 and dropout_rng is None:
        raise EvaluationError(
            f"flax_attention: dropout_rate={dropout_rate} while deterministic=False needs dropout_rng, a JAX PRNG key; "
            "pass one (nnx.MultiHeadAttention takes rngs=nnx.Rngs(dropout=...)), or deterministic=True"
        )
    if module is not None:
        raise NotLowerable(
            "flax_attention: module= asks to sow the attention weights, which the kernel never forms; "
            "build the layer without sow_weights, or use attention_fn=flax.nnx.dot_product_attention to inspect them"
        )
    if dtype is not None:
        query, key, value = (a.astype(dtype) for a in (query, key, value))
    if mask is not None and mask.dtype != jnp.bool_:
        mask = mask != 0
    dropout = dict(dropout_rate=rate, dropout_key=dropout_rng, broadcast_dropout=broadcast_dropout) if rate else {}
    return attention(query, key, value, bias, mask, is_causal=is_causal, **dropout, **options)
