"""The argument checks the fused entries (``rms_norm_linear``, ``linear_cross_entropy``) share: each raises
:class:`~napkin_cat.errors.EvaluationError` before anything is built, its message opening with the entry's name
and naming the argument, what it is and what it should be.

>>> import jax.numpy as jnp
>>> require_arrays("entry", x=jnp.ones(2), w=[1.0])
Traceback (most recent call last):
napkin_cat.errors.EvaluationError: entry: w must be an array, got list
"""

from __future__ import annotations

import jax.numpy as jnp

from lowering._api import BACKENDS
from napkin_cat.errors import EvaluationError


def require_arrays(entry: str, **arrays) -> None:
    """Each of ``arrays`` has a shape and a dtype.

    >>> require_arrays("entry", x=jnp.ones(2))
    """
    for name, a in arrays.items():
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise EvaluationError(f"{entry}: {name} must be an array, got {type(a).__name__}")


def require_one_dtype(entry: str, dtypes: dict, **pair) -> None:
    """The two arrays of ``pair`` share one dtype, a key of ``dtypes`` (``jnp.dtype`` names).

    >>> require_one_dtype("entry", {"float32": None}, x=jnp.ones(2), w=jnp.ones(2, jnp.bfloat16))
    Traceback (most recent call last):
    napkin_cat.errors.EvaluationError: entry: x and w must share one dtype among float32, got float32 and bfloat16
    """
    (a_name, a), (b_name, b) = pair.items()
    names = (jnp.dtype(a.dtype).name, jnp.dtype(b.dtype).name)
    if len(set(names)) != 1 or not set(names) <= dtypes.keys():
        raise EvaluationError(
            f"{entry}: {a_name} and {b_name} must share one dtype among {', '.join(dtypes)}, got {names[0]} and "
            f"{names[1]}"
        )


def require_nonempty(entry: str, **arrays) -> None:
    """No axis of ``arrays`` is empty.

    >>> require_nonempty("entry", x=jnp.ones((0, 4)), w=jnp.ones((4, 2)))
    Traceback (most recent call last):
    napkin_cat.errors.EvaluationError: entry: no kernel for an empty axis (x (0, 4), w (4, 2))
    """
    if any(0 in a.shape for a in arrays.values()):
        shapes = ", ".join(f"{name} {tuple(a.shape)}" for name, a in arrays.items())
        raise EvaluationError(f"{entry}: no kernel for an empty axis ({shapes})")


def require_backend(entry: str, backend: str) -> None:
    """``backend`` is ``"auto"`` or a registered backend.

    >>> require_backend("entry", "cuda")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    napkin_cat.errors.EvaluationError: entry: backend must be 'auto' or one of (...), got 'cuda'
    """
    if backend not in ("auto", *BACKENDS):
        raise EvaluationError(f"{entry}: backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
