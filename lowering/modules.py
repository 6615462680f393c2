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
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from lowering._attention import attention
from napkin_cat.errors import AxisError


class SelfAttention(nnx.Module):
    """Multi-head self-attention, grouped-query when ``kv_heads < heads``: ``[batch, seq, features]`` →
    ``[batch, seq, features]``, projecting queries, keys and values, attending, projecting out.

    ``attention_fn`` takes ``jax.nn.dot_product_attention``'s arguments; it is the napkin-cat entry by
    default, and ``jax.nn.dot_product_attention`` itself gives the reference model with the same parameters.
    ``score_mod``/``mask_mod`` (FlexAttention's, see :mod:`lowering._attention`) reach only the entry.

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
        self.causal, self.attention_fn = causal, attention_fn
        self.mods = {k: f for k, f in (("score_mod", score_mod), ("mask_mod", mask_mod)) if f is not None}

        def linear(n_in, n_out):
            return nnx.Linear(n_in, n_out, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        self.query = linear(features, heads * self.head_dim)
        self.key = linear(features, kv_heads * self.head_dim)
        self.value = linear(features, kv_heads * self.head_dim)
        self.out = linear(heads * self.head_dim, features)

    def __call__(self, x):
        *lead, seq, _ = x.shape

        def split(y, n):
            return y.reshape(*lead, seq, n, self.head_dim)

        q = split(self.query(x), self.heads)
        k, v = split(self.key(x), self.kv_heads), split(self.value(x), self.kv_heads)
        o = self.attention_fn(q, k, v, is_causal=self.causal, **self.mods)
        return self.out(o.reshape(*lead, seq, self.heads * self.head_dim))
