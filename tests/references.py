"""Independent references: the library's computations written from their formulas with jax.numpy / jax.nn.

Nothing here calls napkin_cat, so a kernel compared with these shares none of its code (``nc.to_jax`` and
the lowering both run the generators' ``evaluate``, and would share a bug there). Arrays are laid out as
the library's diagrams lay them out; everything is computed in f32 from the inputs upcast.

>>> import jax, jax.numpy as jnp
>>> Q, K, V = jax.random.normal(jax.random.key(1), (3, 4, 8))
>>> nn = jax.nn.dot_product_attention(Q[:, None], K[:, None], V[:, None])[:, 0]  # jax.nn: [x, heads, d]
>>> float(jnp.max(jnp.abs(attention(Q, K, V) - nn))) < 1e-6
True
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np


def _f32(*arrays):
    return [jnp.asarray(a).astype(jnp.float32) for a in arrays]


def attention(Q, K, V, *, scale=None, causal=False, mask=None, bias=None, groups=1):
    """``softmax(scale·Q·Kᵀ + bias, masked) · V`` over the last two axes (``[..., q, d]``, ``[..., x, d]``).

    ``causal``: query ``i`` sees key ``j`` when ``j ≤ i`` (top-left aligned, as ``jax.nn``).
    ``mask(i, j)`` and ``bias(i, j)`` take broadcast query and key indices. ``groups``: grouped-query
    attention with heads on axis −3: query head ``h`` reads key/value head ``h // groups``.
    A row whose every key is masked gives 0 (the library's convention; ``jax.nn`` gives NaN).

    >>> Q = jnp.ones((2, 1, 4)); K = V = jnp.arange(8.0).reshape(1, 2, 4)
    >>> attention(Q, K, V, causal=True, groups=2)[:, 0, 0].tolist()
    [0.0, 0.0]
    """
    Q, K, V = _f32(Q, K, V)
    if groups > 1:
        K, V = (jnp.repeat(a, groups, axis=-3) for a in (K, V))
    scale = Q.shape[-1] ** -0.5 if scale is None else scale
    s = jnp.einsum("...id,...jd->...ij", Q, K, precision="highest") * scale
    i = jnp.arange(Q.shape[-2])[:, None]
    j = jnp.arange(K.shape[-2])[None, :]
    if bias is not None:
        s = s + bias(i, j)
    keep = jnp.ones(s.shape[-2:], bool)
    if causal:
        keep = keep & (j <= i)
    if mask is not None:
        keep = keep & mask(i, j)
    p = jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1)
    p = jnp.where(keep.any(-1, keepdims=True), p, 0.0)  # an empty row: 0, not NaN
    return jnp.einsum("...ij,...jd->...id", p, V, precision="highest")


def matmul(A, B):
    """``A·B`` in f32.

    >>> matmul(jnp.eye(2), jnp.ones((2, 3))).shape
    (2, 3)
    """
    A, B = _f32(A, B)
    return jnp.matmul(A, B, precision="highest")


def softmax(S):
    """Softmax over the last axis.

    >>> softmax(jnp.zeros((1, 4))).tolist()
    [[0.25, 0.25, 0.25, 0.25]]
    """
    return jax.nn.softmax(_f32(S)[0], axis=-1)


def layer_norm(X, gamma, beta, eps=1e-5):
    """``(X − mean)/√(var + ε)·γ + β`` over the last axis.

    >>> Y = layer_norm(jnp.array([[1.0, 3.0]]), jnp.ones(2), jnp.zeros(2))
    >>> bool(jnp.allclose(Y, jnp.array([[-1.0, 1.0]]), atol=1e-5))
    True
    """
    X, gamma, beta = _f32(X, gamma, beta)
    mean = X.mean(-1, keepdims=True)
    var = ((X - mean) ** 2).mean(-1, keepdims=True)
    return (X - mean) / jnp.sqrt(var + eps) * gamma + beta


def rms_norm(X, gamma, eps=1e-6):
    """``X/√(mean(X²) + ε)·γ`` over the last axis.

    >>> bool(jnp.allclose(rms_norm(jnp.array([[3.0, 4.0]]), jnp.ones(2), eps=0.0), jnp.array([[0.6, 0.8]]) * 2**0.5))
    True
    """
    X, gamma = _f32(X, gamma)
    return X / jnp.sqrt((X**2).mean(-1, keepdims=True) + eps) * gamma


def cross_entropy(X, Y):
    """``logsumexp(X) − Σ X·Y`` per row (``Y`` one-hot labels).

    >>> abs(float(cross_entropy(jnp.zeros((1, 4)), jnp.eye(4)[:1])[0]) - float(np.log(4))) < 1e-6
    True
    """
    X, Y = _f32(X, Y)
    return jax.nn.logsumexp(X, axis=-1) - jnp.sum(X * Y, axis=-1)


def layer_norm_statistics(X, eps=1e-5):
    """The mean and ``1/√(var + ε)`` of each row.

    >>> [v.tolist() for v in layer_norm_statistics(jnp.array([[1.0, 3.0]]), eps=0.0)]
    [[2.0], [1.0]]
    """
    (X,) = _f32(X)
    return X.mean(-1), 1 / jnp.sqrt(X.var(-1) + eps)


def rel_err(got, want) -> float:
    """``max |got − want| / max |want|``, in float64 (the error relative to the output's scale).

    >>> abs(rel_err(np.array([1.0, 2.001]), np.array([1.0, 2.0])) - 5e-4) < 1e-12
    True
    """
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        raise AssertionError(f"shapes differ: {got.shape} vs {want.shape}")
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), np.finfo(np.float32).tiny))


def assert_close(got, want, tol: float, seed: int, what: str) -> None:
    """Assert :func:`rel_err` ``≤ tol``, naming ``what`` and the seed that reruns the case; ``NAPKIN_MEASURE=1``
    prints the error (how the tests' tolerances are measured).

    >>> assert_close(np.array([1.0, 2.001]), np.array([1.0, 2.0]), 1e-3, 7, "y")
    >>> assert_close(np.array([1.0, 2.1]), np.array([1.0, 2.0]), 1e-3, 7, "y")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    AssertionError: y: relative error 5.00e-02 > 1e-03 (NAPKIN_SEED=7)...
    """
    err = rel_err(got, want)
    if os.environ.get("NAPKIN_MEASURE"):
        print(f"{what}: {err:.2e}")
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e} (NAPKIN_SEED={seed})"


def assert_gradients_close(ours, theirs, args, ct, tol: float, seed: int, names) -> None:
    """The gradients in every argument of ``sum(f(*args) · ct)`` (``f``'s output in f32) for ``ours`` and
    ``theirs``: each in its argument's dtype, within ``tol`` of the other (:func:`assert_close`), named ``names``.

    >>> x = jnp.array([0.5, 1.0])
    >>> assert_gradients_close(jnp.sin, lambda x: jnp.sin(x), (x,), jnp.ones(2), 1e-6, 0, ["dx"])
    """
    projected = [lambda *a, f=f: jnp.sum(f(*a).astype(jnp.float32) * ct) for f in (ours, theirs)]
    got, want = (jax.jit(jax.grad(f, argnums=tuple(range(len(args)))))(*args) for f in projected)
    for name, a, b, like in zip(names, got, want, args, strict=True):
        assert a.dtype == like.dtype, f"{name} is {a.dtype}, not the input's {like.dtype}"
        assert_close(a, b, tol, seed, name)
