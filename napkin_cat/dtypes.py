"""Element types of the arrays on wires.

A :class:`Dtype` is data: a name, a width in bits, and the JAX dtype it stands for.

>>> bf16.bytes, f32.bytes, fp8_e4m3.bytes
(2, 4, 1)
>>> bf16
bf16
>>> dtype('float16') is f16
True
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class Dtype:
    """An element type: ``name`` (short), ``bits``, ``jax_name`` (the ``jnp`` attribute).

    >>> bf16
    bf16
    >>> bf16.bits, bf16.jnp.__name__, bf16.is_low_precision
    (16, 'bfloat16', True)
    """

    name: str
    bits: int
    jax_name: str

    @property
    def bytes(self) -> int:
        """Bytes per element.

        >>> f32.bytes, bf16.bytes, fp8_e4m3.bytes
        (4, 2, 1)
        """
        return self.bits // 8

    @property
    def jnp(self):
        """The JAX dtype, e.g. ``jnp.bfloat16``."""
        return getattr(jnp, self.jax_name)

    @property
    def is_low_precision(self) -> bool:
        """True for 16-bit and 8-bit types (they accumulate in f32)."""
        return self.bits < 32

    def __repr__(self) -> str:
        return self.name


f32 = Dtype("f32", 32, "float32")
bf16 = Dtype("bf16", 16, "bfloat16")
f16 = Dtype("f16", 16, "float16")
fp8_e4m3 = Dtype("fp8_e4m3", 8, "float8_e4m3fn")
fp8_e5m2 = Dtype("fp8_e5m2", 8, "float8_e5m2")
i32 = Dtype("i32", 32, "int32")
bool_ = Dtype("bool", 8, "bool_")

DTYPES = (f32, bf16, f16, fp8_e4m3, fp8_e5m2, i32, bool_)
#: the 8-bit floating types: the tensor cores of Hopper multiply them at twice the 16-bit rate, accumulating in f32;
#: a contraction's operand dtype is the label that chooses that rate (the cost model's, FP8 attention's kernels)
FP8 = (fp8_e4m3, fp8_e5m2)


def dtype(x) -> Dtype:
    """The :class:`Dtype` for a name, a JAX/numpy dtype, or a :class:`Dtype` itself.

    >>> dtype(jnp.bfloat16)
    bf16
    >>> dtype("foo")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.NapkinError: unknown dtype 'foo'; pass one of f32, bf16, f16, fp8_e4m3, fp8_e5m2, i32, bool, \
a JAX dtype (jnp.bfloat16) or a napkin_cat Dtype (nc.bf16)
    """
    from napkin_cat.errors import NapkinError

    if isinstance(x, Dtype):
        return x
    known = ", ".join(d.name for d in DTYPES)
    fix = f"pass one of {known}, a JAX dtype (jnp.bfloat16) or a napkin_cat Dtype (nc.bf16)"
    try:
        if x is None:  # NumPy reads None as float64
            raise TypeError("None is no dtype")
        name = jnp.dtype(x).name if not isinstance(x, str) or x not in {d.name for d in DTYPES} else x
    except (TypeError, ValueError) as e:  # not a dtype at all: a typo'd name, None, an array
        raise NapkinError(f"unknown dtype {x!r}; {fix}") from e
    for d in DTYPES:
        if name in (d.name, d.jax_name):
            return d
    raise NapkinError(f"unsupported dtype {x!r}{f' ({name})' if name != x else ''}; {fix}")
