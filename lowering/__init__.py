"""Lowering: scheduled diagrams become JAX Pallas kernels.

>>> import jax, jax.numpy as jnp
>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> attn = nc.library.attention(q, x, d)
>>> kernel = lower(derive(attn, tile(q, 16), stream(x, 16)))
>>> Q, K, V = (jax.random.normal(jax.random.key(i), (40, 32)) for i in range(3))
>>> bool(jnp.allclose(kernel(Q, K, V), nc.to_jax(attn)(Q, K, V), atol=1e-4))
True
"""

from lowering._api import Kernel, OpenKernel, lower
from lowering._attention import AttentionKernel, attention
from lowering._cross_entropy import linear_cross_entropy
from lowering._decode import decode_attention, mla_decode_attention
from lowering._decode_cost import DecodeCost, decode_cost
from lowering._fp8 import fp8_quantize
from lowering._kv_cache import KVCache
from lowering._plan import NotLowerable, Plan, plan
from lowering._ring import DeviceKernel, lower_devices
from lowering._rms_norm_linear import rms_norm_linear
from lowering._search import median_time
from lowering._tiles import Choice, choose_tiles, predicted_time
from lowering.mosaic import MosaicConfig, MosaicLowered
from lowering.triton import Config, Lowered, TritonConfig, TritonLowered
from lowering.xla import XlaConfig, XlaLowered

__all__ = [
    "DeviceKernel", "lower_devices",  # past one GPU (lowering._ring)
    "AttentionKernel", "Choice", "Config", "Kernel", "Lowered", "MosaicConfig", "MosaicLowered", "NotLowerable",
    "OpenKernel", "Plan", "attention", "choose_tiles", "lower", "median_time", "plan", "predicted_time",
    "TritonConfig", "TritonLowered",  # the Triton backend (lowering.triton; Config and Lowered are these)
    "XlaConfig", "XlaLowered",  # the XLA backend (lowering.xla)
    "DecodeCost", "KVCache", "decode_attention", "decode_cost",  # decoding (lowering._decode, _paged, _kv_cache)
    "mla_decode_attention",  # MLA decoding (lowering._decode)
    "linear_cross_entropy",  # a classifier head's loss without its logits (lowering._cross_entropy)
    "rms_norm_linear",  # an RMS norm fused into the projection after it (lowering._rms_norm_linear)
    "fp8_quantize",  # q, k, v to e4m3 with their scales, optionally rotated first (lowering._fp8)
]
