"""Relabellings as verified functors: tile, stream, recolour; derivations and their verification.

>>> import napkin_cat as nc
>>> from rewrites import derive, tile, stream
>>> q, x, d = nc.axes("q x d")
>>> flash = derive(nc.library.attention(q, x, d), tile(q, 128), stream(x, 64))
>>> print(flash.diagram.cod)
q/128×d
"""

from rewrites.derive import Derivation, Step, derive
from rewrites.level import level
from rewrites.rule import RewriteError, Rule
from rewrites.schedule import execute, partitions
from rewrites.stream import fuse_softmax_contract, stream, streamability
from rewrites.tile import tile

__all__ = [
    "Derivation", "RewriteError", "Rule", "Step", "derive", "execute", "fuse_softmax_contract", "level",
    "partitions", "stream", "streamability", "tile",
]
