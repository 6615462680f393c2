"""The array namespace of a Triton kernel body (:class:`Blocks`): contractions as 2-D ``jnp.dot``, exponentials as
``exp2``, ``tanh`` on the special-function unit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from lowering._plan import LOG2E
from napkin_cat.diagram import Diagram
from napkin_cat.generators import Jax, plain

TWO_PI = 6.283185307179586


def block_einsum(spec: str, *xs, operands=None):
    """A contraction of blocks: one ``jnp.dot`` (f32 accumulation) for a 2-D matrix product, else a
    broadcast product summed over the contracted axes (matrix-vector and other small cases).

    ``operands`` (a 16-bit dtype, or None) is the dtype the tensor cores multiply in: two f32 blocks a
    kernel computed (a cotangent rescaled by a row weight, as attention sinks make it) are rounded to it,
    as FlashAttention-2 rounds ``P`` and ``dS``, rather than multiplied as f32 at a fraction of the rate.

    >>> a = jnp.full((16, 16), 1 + 2**-12, jnp.float32)
    >>> [float(block_einsum("ik,kj->ij", a, a, operands=t)[0, 0]) for t in (None, jnp.bfloat16)]
    [16.0078125, 16.0]

    Axes of size 1 in every operand and the output (a chunk of a batch axis streamed one at a time) are
    dropped for the product, so it is still one 2-D ``jnp.dot``:

    >>> block_einsum("bik,bkj->bij", a[None], a[None]).shape
    (1, 16, 16)
    """
    ins, out = spec.split("->")
    terms = ins.split(",")
    unit = [c for c in out if all(c in t and v.shape[t.index(c)] == 1 for t, v in zip(terms, xs, strict=True))]
    if unit and len(terms) == 2:  # a chunk of 1 (a streamed batch axis): the 2-D product, the unit axes put back
        xs = [jnp.squeeze(v, [t.index(c) for c in unit]) for t, v in zip(terms, xs, strict=True)]
        inner = (
            ",".join("".join(c for c in t if c not in unit) for t in terms)
            + "->"
            + "".join(c for c in out if c not in unit)
        )
        return jnp.expand_dims(block_einsum(inner, *xs, operands=operands), [out.index(c) for c in unit])
    shared = set(terms[0]) & set(terms[1]) - set(out) if len(terms) == 2 else set()
    if len(terms) == 2 and all(len(t) == 2 for t in terms) and len(out) == 2 and len(shared) == 1:
        (k,) = shared
        # the operand holding the output's rows goes left, so only operands are transposed (free for the
        # tensor cores), never the f32 product (a layout change through shared memory in Triton)
        first = 0 if out[0] in terms[0] else 1
        (lt, x), (rt, y) = (terms[first], xs[first]), (terms[1 - first], xs[1 - first])
        x = x if lt == out[0] + k else x.T
        y = y if rt == k + out[1] else y.T
        if operands is not None and x.dtype == y.dtype == jnp.float32:
            x, y = x.astype(operands), y.astype(operands)
        if x.dtype != y.dtype:  # Triton's dot needs one operand type: the narrower one (FA2 casts P to V's dtype)
            narrow = min(x.dtype, y.dtype, key=lambda t: jnp.dtype(t).itemsize)
            x, y = x.astype(narrow), y.astype(narrow)
        return jnp.dot(x, y, preferred_element_type=jnp.float32)
    letters = "".join(dict.fromkeys(out + "".join(terms)))
    acc = None
    for t, v in zip(terms, xs, strict=True):
        v = jnp.transpose(v.astype(jnp.float32), [t.index(c) for c in letters if c in t])
        v = jnp.expand_dims(v, [i for i, c in enumerate(letters) if c not in t])
        acc = v if acc is None else acc * v
    summed = [i for i, c in enumerate(letters) if c not in out]
    return jnp.sum(acc, axis=tuple(summed)) if summed else acc


class Blocks(Jax):
    """The array namespace of a kernel body: 2-D ``jnp.dot`` for contractions in ``operands`` (the
    kernel's 16-bit input dtype, or None: as given), ``exp2`` for exponentials, and ``tanh`` for tanh,
    named or inside a user's callable (a soft-cap ``score_mod``): by default ``jnp.tanh`` (libdevice's,
    about twenty instructions), in a compiled kernel with 16-bit operands the GPU's one-instruction
    ``tanh.approx.f32`` (:func:`native_tanh`), as ``exp2`` is already its ``ex2.approx``.

    >>> Blocks(jnp.bfloat16).operands
    <class 'jax.numpy.bfloat16'>
    >>> float(Blocks(tanh=lambda v: v).lift(lambda s: 30 * jnp.tanh(s / 30))(jnp.float32(3.0)))  # tanh swapped
    3.0
    """

    def __init__(self, operands=None, tanh=None, trig=None):
        self.operands = operands
        if tanh is not None:
            self.tanh = tanh
        if trig is not None:  # RoPE's angles
            self.cos, self.sin = trig("cos"), trig("sin")

    def lift(self, fn):
        """A user's callable with each ``tanh`` it computes done by this namespace's (:func:`swap_tanh`)."""
        return fn if self.tanh is jnp.tanh else swap_tanh(fn, self.tanh)

    def index_map(self, fn, v, indices: dict):
        """``fn(v, **indices)``, lifted as :meth:`lift` lifts a callable."""
        names = list(indices)
        return self.lift(lambda v, *ix: fn(v, **dict(zip(names, ix, strict=True))))(v, *indices.values())

    def einsum(self, spec: str, *xs):
        """:func:`block_einsum` in this kernel's operand dtype."""
        return block_einsum(spec, *xs, operands=self.operands)

    @staticmethod
    def exp(v):
        """``exp(v) = 2^(v·log₂e)``: the GPU's native ``exp2``."""
        return jnp.exp2(v * LOG2E)

    @staticmethod
    def join(vs, axis: int):
        """The pieces ``vs`` put back together along ``axis``. Triton joins two blocks only along a new last axis
        of size 2 (``tt.join``); the pieces pair up so, and the new axis moves in front of ``axis`` to merge.

        >>> a, b = jnp.arange(6.0).reshape(2, 3), -jnp.arange(6.0).reshape(2, 3)
        >>> bool((Blocks.join([a, b], 1) == jnp.concatenate([a, b], 1)).all())
        True
        """
        while len(vs) > 1:
            vs = [_join_pair(a, b, axis % a.ndim) for a, b in zip(vs[::2], vs[1::2], strict=True)]
        return vs[0]


def _join_pair(a, b, axis: int):
    n = a.ndim
    stacked = jax.lax.concatenate([jnp.expand_dims(a, n), jnp.expand_dims(b, n)], n)
    moved = jnp.transpose(stacked, [*range(axis), n, *range(axis, n)])
    return moved.reshape(a.shape[:axis] + (2 * a.shape[axis],) + a.shape[axis + 1 :])


def native_tanh(v):
    """tanh on the GPU's special-function unit, ``tanh.approx.f32`` (one instruction; relative error at
    most 2^−10.99, below a bf16 score's rounding), where libdevice's ``tanh`` takes about twenty. FlashAttention-3
    soft-caps with the same instruction. Compiled kernels only: it is PTX, which interpret mode cannot run."""
    return pltriton.approx_tanh(v.astype(jnp.float32)).astype(v.dtype)


def native_trig(name: str):
    """``cos`` or ``sin`` (``name``) on the GPU's special-function unit, ``cos.approx.f32`` / ``sin.approx.f32``, after
    reducing the angle to [−π, π], where their absolute error is at most 2^−20.9; libdevice's take a few dozen
    instructions with their own reduction. RoPE's angles (position × frequency, rounded to f32 before either)
    carry more error than the reduction adds. Compiled kernels only: it is PTX."""

    def approx(v):
        x = v.astype(jnp.float32)
        x = x - TWO_PI * jnp.floor(x * (1.0 / TWO_PI) + 0.5)
        [out] = pltriton.elementwise_inline_asm(
            f"{name}.approx.f32 $0, $1;",
            args=[x],
            constraints="=f,f",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        )
        return out.astype(v.dtype)

    return approx


def swap_tanh(fn, tanh):
    """``fn`` with every ``tanh`` primitive it computes (inside ``jit`` calls too) replaced by ``tanh``: traced
    to a jaxpr at each call, then evaluated equation by equation (:func:`napkin_cat.generators.plain`).

    >>> f = swap_tanh(lambda s: 2 * jnp.tanh(s), jnp.sin)
    >>> bool(jnp.allclose(f(jnp.float32(0.5)), 2 * jnp.sin(0.5)))
    True
    """
    return plain(fn, {"tanh": tanh})


def operand_dtype(d: Diagram):
    """The 16-bit float dtype of a kernel's inputs, which its products multiply in; None where it has none.

    >>> import napkin_cat as nc
    >>> operand_dtype(nc.library.attention(*nc.axes("q x d"), dtype="bf16"))
    <class 'jax.numpy.bfloat16'>
    """
    narrow = {w.dtype.name for w in d.dom.inside} & {"bf16", "f16"}
    return {"bf16": jnp.bfloat16, "f16": jnp.float16}[min(narrow)] if narrow else None
