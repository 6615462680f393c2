"""The normalised Hadamard transform of one axis: ``x ↦ x·H/√n``, ``H`` Sylvester's ``n × n`` matrix of ±1
(``H[i, j] = (−1)^popcount(i & j)``, ``n`` a power of two).

``H/√n`` is symmetric and orthogonal, so it is its own inverse, and a contraction over the axis does not see it:
``(x·H/√n)·(y·H/√n)ᵀ = x·yᵀ``. FlashAttention-3 (Shah et al. 2024, §3.3, "incoherent processing") rotates q and k
so before rounding them to FP8: the rotation spreads an outlier feature over the whole head dim, and with it the
rounding error it carries into the scores (:func:`rewrites.incoherent` puts the boxes there, verified).

>>> import jax.numpy as jnp
>>> from napkin_cat import axes, Array, to_jax
>>> n, d = axes("n d", d=4)
>>> h = hadamard(Array(n, d), d)
>>> to_jax(h)(jnp.array([[2.0, 0.0, 0.0, 0.0]])).tolist()  # one spike spread evenly over the axis
[[1.0, 1.0, 1.0, 1.0]]
>>> to_jax(h >> h)(jnp.array([[1.0, 2.0, 3.0, 4.0]])).tolist()  # its own inverse
[[1.0, 2.0, 3.0, 4.0]]
"""

from __future__ import annotations

import sympy

from napkin_cat.axes import Axis
from napkin_cat.diagram import Array, Ty
from napkin_cat.errors import AxisError, EvaluationError
from napkin_cat.generators._base import Generator, along


class Hadamard(Generator):
    """``x ↦ x·H/√n`` along axis ``dim`` (see the module). Its backward is itself: ``H/√n`` is symmetric and
    orthogonal.

    >>> from napkin_cat import axes
    >>> q, d = axes("q d", d=8)
    >>> box = hadamard(Array(q, d), d)
    >>> box.mixes, box.flops(), box.tensor_flops()
    (('d',), 128*q, 128*q)
    """

    family, symbol = "mask", "U"  # U: the rotated array (H is the matrix)

    @property
    def mixes(self):
        return (self.params["dim"],)

    @property
    def powers_of_two(self):
        return (self.params["dim"],)

    def evaluate(self, ins, ctx):
        xp, X = ctx.xp, self.dom.inside[0]
        (v,) = ins
        at = X.names.index(self.params["dim"])
        shape = tuple(xp.shape(v))
        n = _power_of_two(int(shape[at]), self.name)
        i, j = xp.iota((n, n), 0), xp.iota((n, n), 1)
        sign = xp.full((n, n), 1)
        for bit in range(n.bit_length() - 1):  # (−1)^popcount(i & j): a factor −1 per bit set in both
            sign = sign * xp.where(((i // 2**bit) % 2) * ((j // 2**bit) % 2) == 1, -1, 1)
        H = sign * xp.number(1 / sympy.sqrt(n))  # exact in the proofs, f32 elsewhere
        return [xp.cast(along(xp, xp.f32(v), at, H), self.out.dtype)]

    def flops(self):
        return self.tensor_flops()  # as the product with the constant matrix it is computed as

    def tensor_flops(self):
        return 2 * self.out.size * self.out.axis(self.params["dim"]).size

    def lines(self, prog, ins, outs):
        dim = self.params["dim"]
        return [(f"{prog.ix(outs[0])} = {prog.ix(ins[0])}·H/√|{dim}| along {dim}   # Hadamard", outs, ins, False, True)]

    def backward(self, t, ins, outs, cts):
        C = t.ty(cts[0])
        return [t(Hadamard(self.name, Ty(C), Ty(C), data=self.data), cts[0])]


def _power_of_two(n: int, where: str) -> int:
    if n < 1 or n & (n - 1):
        raise EvaluationError(
            f"{where}: the axis has {n} entries; a Hadamard matrix (Sylvester's) needs a power of two: pad the axis "
            "with zeros to the next one (the contraction over it does not change)"
        )
    return n


def hadamard(a: Array, dim: Axis | str) -> Hadamard:
    """The normalised Hadamard transform of ``a`` along ``dim`` (a power of two where its size is a number); the
    output has ``a``'s type.

    >>> from napkin_cat import axes, Array
    >>> n, d = axes("n d", d=6)
    >>> hadamard(Array(n, d), "d")
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: hadamard d: the axis has 6 entries; a Hadamard matrix (Sylvester's) needs \
a power of two: pad the axis with zeros to the next one (the contraction over it does not change)
    """
    dim = getattr(dim, "name", dim)
    if dim not in a.names:
        raise AxisError(f"hadamard: axis {dim!r} is not an axis of {a.describe()}")
    name = f"hadamard {dim}"
    size = sympy.sympify(a.axis(dim).size)
    if size.is_number:
        _power_of_two(int(size), name)
    return Hadamard(name, Ty(a), Ty(a), data=(("dim", dim),))
