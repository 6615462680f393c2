"""The one timing helper, :mod:`lowering._timing` (moved into the package so that ``lowering.median_time`` and the
tile search use it too), under the name every script under ``papers/`` imports.

>>> import jax.numpy as jnp
>>> time_calls(jnp.sin, jnp.ones(4), reps=2, batches=2, method="wall").method
'wall'
"""

from lowering._timing import METHODS as METHODS
from lowering._timing import Timing as Timing
from lowering._timing import once as once
from lowering._timing import time_calls as time_calls
