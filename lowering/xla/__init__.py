"""The XLA backend: scheduled diagrams as plain, jitted JAX (tiles vmapped, the stream a ``lax.fori_loop``),
compiled by XLA on CPU, GPU or TPU without Pallas; ``lower(..., backend="xla")``.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> from lowering import lower
>>> q, x, d = nc.axes("q x d")
>>> kernel = lower(derive(nc.library.attention(q, x, d), tile(q, 16), stream(x, 16), verify=False), backend="xla")
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (24, 8)) for i in range(3))
>>> kernel.backend, kernel.differentiation
('xla', 'lowered')
>>> ref = jax.nn.dot_product_attention(Q[None, :, None], K[None, :, None], V[None, :, None])[0, :, 0]
>>> bool(jnp.allclose(kernel(Q, K, V), ref, atol=1e-5))
True
"""

from lowering.xla._backend import XLA as XLA
from lowering.xla._kernel import XlaConfig as XlaConfig
from lowering.xla._kernel import XlaLowered as XlaLowered

__all__ = ["XLA", "XlaConfig", "XlaLowered"]
