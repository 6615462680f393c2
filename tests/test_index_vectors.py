"""Index functions see their indices as vectors (``Context.indices``: the queries' ``[tq, 1]``, the keys' ``[1, tk]``),
so what a mask or a score modifier computes from one index (``q // W``, ``q % W``) runs once per index, and the block
is formed at the first operation that mixes the two: in jax.numpy and Triton by numpy broadcasting, in Mosaic GPU
(whose register arrays have no unit axes) by :func:`napkin_cat.generators.on_vectors`, on the row and column
vectors of wgmma's layout.

Checked against code written here: every integer division and remainder in the kernels' bodies (Triton and Mosaic,
interpret mode) is on a vector; a mask or score modifier reading one index (or none) is spread over the block; the
vector evaluation equals the same function on whole index grids over random sizes and offsets (jax.numpy), including
where it falls back to whole grids, and what the function's result does not depend on is never emitted; and
Mosaic's kernels (forward, dQ, dK·dV, fused) for the dilated window, the 2-D neighbourhood and ALiBi, and the forward
of a mask reading a captured array, lower for CUDA on the CPU.

Tolerances: Triton f32 interpret, max |error| / max |reference|, as tests/test_block_holes.py (1e-6, measured there
≤ 1.9e-7 for the same kernels); Mosaic bf16 relative Frobenius error, tests/test_block_holes_mosaic.py's 5e-3.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.extend.core import ClosedJaxpr, Jaxpr

import lowering.mosaic._arrays as arrays
import napkin_cat as nc
from lowering import MosaicLowered, lower
from lowering.mosaic._arrays import _indexed
from napkin_cat.generators import JAX, Context, Later, ScoreDerivative, Unvectorised, Vector, on_vectors
from rewrites import derive, stream, tile

TRITON, MOSAIC = 1e-6, 5e-3
WIDTH = 64  # the image's row, in tokens


def image(q, x):  # a 2-D neighbourhood: |Δrow| ≤ 1 and |Δcol| ≤ 1 on rows of WIDTH tokens
    return (abs(q // WIDTH - x // WIDTH) <= 1) & (abs(q % WIDTH - x % WIDTH) <= 1)


def dilated(q, x):  # a causal window of 2·64 keys, every other one
    return (x <= q) & (q - x < 128) & ((q - x) % 2 == 0)


def dense(mask, n: int):
    return np.asarray(mask(np.arange(n)[:, None], np.arange(n)[None, :]), bool)


def reference(keep, Q, K, V, bias=0.0):
    """f32 attention [B, H, N, D] under the dense mask ``keep`` [N, N] plus ``bias``, written with jnp."""
    Q, K, V = (a.astype(jnp.float32) for a in (Q, K, V))
    s = jnp.einsum("bhqd,bhkd->bhqk", Q, K) / np.sqrt(Q.shape[-1]) + bias
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(jnp.where(keep, s, -jnp.inf), axis=-1), V)


KERNELS = ("pallas_call", "mpmd_map")


def bodies(fn, *args):
    """Every equation of the kernels' bodies ``fn(*args)`` launches (inside the ``pallas_call`` s, or Mosaic's
    per-warpgroup ``mpmd_map`` s, at any depth)."""

    def walk(jaxpr, inside):
        for e in jaxpr.eqns:
            if inside:
                yield e
            for p in e.params.values():
                for sub in p if isinstance(p, tuple | list) else [p]:
                    if isinstance(sub, ClosedJaxpr | Jaxpr):
                        yield from walk(getattr(sub, "jaxpr", sub), inside or e.primitive.name in KERNELS)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr, False))


def vector(shape) -> bool:
    return sum(n > 1 for n in shape) <= 1


def scheduled(mask, g, s, d, dtype):
    b, h, q, x, dd = nc.axes("b h q x d", d=d)
    attn = nc.library.multi_head_attention(h, q, x, dd, batch=(b,), dtype=dtype, mask=mask)
    return derive(attn, tile(q, g), stream(x, s), verify=False)


@pytest.mark.parametrize(
    ("backend", "g", "s", "dtype", "tol"),
    [("triton", 16, 16, jnp.float32, TRITON), ("mosaic", 128, 64, jnp.bfloat16, MOSAIC)],
)
def test_one_index_division_and_remainder_run_on_vectors(key, backend, g, s, dtype, tol):
    """The 2-D neighbourhood's ``q // W`` and ``q % W`` (with jnp's sign fix-ups) run on the queries' and the keys'
    vectors in the forward kernel, only the comparisons of the two on the block; its output is right."""
    n, d = (128, 16) if backend == "triton" else (256, 64)
    kernel = lower(scheduled(image, g, s, d, jnp.dtype(dtype).name), backend=backend, interpret=True).forward
    Q, K, V = (jax.random.normal(k, (1, 2, n, d), dtype) for k in jax.random.split(key, 3))
    eqns = bodies(kernel, Q, K, V)
    arithmetic = [
        a.shape
        for e in eqns
        if e.primitive.name in ("div", "rem") and jnp.issubdtype((a := e.outvars[0].aval).dtype, jnp.integer)
    ]
    assert arithmetic and all(map(vector, arithmetic)), arithmetic
    assert any(not vector(e.outvars[0].aval.shape) for e in eqns if e.primitive.name == "abs")  # the block's
    want = reference(dense(image, n), Q, K, V)
    got = kernel(Q, K, V).astype(jnp.float32)
    if backend == "triton":
        assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) <= tol
    else:
        assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= tol


@pytest.mark.parametrize("backend", ["triton", "mosaic"])
def test_a_mask_and_a_score_modifier_of_one_index_fill_the_block(key, backend):
    """A mask reading only the keys returns a ``[1, tk]`` vector and a score modifier reading only the query (not
    the score: each row's scores become one constant) a ``[tq, 1]`` one: both are spread over the block. Each row
    then averages the values of the keys it keeps: the output and dV against jnp, dQ and dK zero."""
    n, d, g, s, dtype = (64, 16, 16, 16, jnp.float32) if backend == "triton" else (256, 64, 128, 64, jnp.bfloat16)
    b, h, q, x, dd = nc.axes("b h q x d", d=d)

    def every_third_key(x):
        return x % 3 != 2

    def row_constant(s, q):
        return 0.25 * (q % 5)

    name = jnp.dtype(dtype).name
    attn = nc.library.attention(q, x, dd, batch=(b, h), dtype=name, mask=every_third_key, score_mod=row_constant)
    kernel = lower(derive(attn, tile(q, g), stream(x, s), verify=False), backend=backend, interpret=True)
    heads = 2 if backend == "triton" else 1  # interpreted Mosaic: one head (batch axes on the grid either way)
    Q, K, V, dO = (jax.random.normal(k, (1, heads, n, d), dtype) for k in jax.random.split(key, 4))
    kept = jnp.asarray(np.arange(n) % 3 != 2, jnp.float32)

    def average(V):  # written here: each row, the mean of the kept keys' values
        return jnp.einsum("k,bhkd->bhd", kept / kept.sum(), V)[:, :, None, :] * jnp.ones((n, 1))

    out, pull = jax.vjp(kernel, Q, K, V)
    want, want_pull = jax.vjp(average, V.astype(jnp.float32))
    dQ, dK, dV = (a.astype(jnp.float32) for a in pull(dO))
    (want_dV,) = want_pull(dO.astype(jnp.float32))
    tol = (TRITON, 3 * TRITON) if backend == "triton" else (MOSAIC, 6e-3)  # tests/test_block_holes*.py's GRAD
    for (got, ref), t in zip(((out.astype(jnp.float32), want), (dV, want_dV)), tol, strict=True):
        assert float(jnp.linalg.norm(got - ref) / jnp.linalg.norm(ref)) <= t
    assert float(jnp.max(jnp.abs(dQ))) == 0.0 and float(jnp.max(jnp.abs(dK))) == 0.0


def on_grids(fn, names, shape, offsets, grid):
    """``fn`` on whole index grids of ``shape`` (the former ``Context.indices``), written here."""
    idx = {a: np.indices(shape)[i] + offsets[i] for i, a in enumerate(names)}
    return np.broadcast_to(np.asarray(fn(**idx, **grid), bool), shape)


FUNCTIONS = {
    "image": lambda q, x, h: image(q, x),
    "dilated": lambda q, x, h: dilated(q, x),
    "where": lambda q, x, h: jnp.where(q % 4 == 0, x <= q, (q - x) ** 2 < 50),
    "rows": lambda q, x, h: (q // 3) % 2 == 0,
    "head": lambda q, x, h: (x + h) % 3 == q % 3,
    "constant": lambda q, x, h: True,
    "fallback": lambda q, x, h: jnp.cumsum(x % 2, axis=1) >= (q % 5),  # a scan: whole grids
}


@settings(max_examples=12, deadline=None)
@given(
    name=st.sampled_from(sorted(FUNCTIONS)),
    tq=st.integers(2, 9),
    tk=st.integers(2, 9),
    oq=st.integers(0, 300),
    ok=st.integers(0, 300),
    h=st.integers(0, 5),
)
def test_vectors_agree_with_whole_grids(name, tq, tk, oq, ok, h):
    """:func:`on_vectors` (through Mosaic's ``_indexed``, with jax.numpy's ``broadcast_in_dim``) and jax.numpy on
    ``Context.indices``' vectors both equal the function on whole grids, whatever the block and its offsets."""
    fn = FUNCTIONS[name]
    ctx = Context(offsets={"q": oq, "x": ok})
    wire = nc.Array(*nc.axes("q x"))
    vectors = ctx.indices(wire, (tq, tk))
    assert vectors["q"].shape == (tq, 1) and vectors["x"].shape == (1, tk)
    want = on_grids(fn, ("q", "x"), (tq, tk), (oq, ok), {"h": h})
    got = np.asarray(JAX.index_mask(fn, {**vectors, "h": jnp.int32(h)}, (tq, tk)))
    assert (got == want).all()
    held = {a: Vector(v.reshape(-1), (i,), v.shape) for i, (a, v) in enumerate(vectors.items())}
    got = _indexed(fn, None, {**held, "h": jnp.int32(h)}, jax.lax.broadcast_in_dim, (tq, tk))
    assert (np.asarray(got) == want).all()


def test_what_vectors_do_not_keep_is_named():
    """A scan over the block is no operation on vectors: :func:`on_vectors` says which, before computing anything."""
    q, x = Vector(jnp.arange(4), (0,), (4, 1)), Vector(jnp.arange(3), (1,), (1, 3))
    with pytest.raises(Unvectorised, match="cumsum"):
        on_vectors(FUNCTIONS["fallback"], [q, x, jnp.int32(0)], jax.lax.broadcast_in_dim)


def unmade(axis: int, shape: tuple) -> Vector:
    """An index vector whose making fails: a function that reads it fails."""

    def fail():
        raise AssertionError(f"index {axis} made")

    return Vector(Later(fail, jnp.int32), (axis,), shape)


def test_an_index_the_result_does_not_read_is_never_made(key):
    """ALiBi's score derivative names q and x but its value, 1, reads neither: on vectors, neither index is made (an
    iota nothing reads has no layout Mosaic GPU can find). Falling back to whole grids (a scan of the queries), the
    keys' index it does not read is not made either. Both against values written here."""
    tq, tk = 4, 5
    s = jax.random.normal(key, (tq, tk))
    block = Vector(s, (0, 1), (tq, tk))
    derivative = ScoreDerivative(nc.library.ALiBi("h", "q", "x", 4))
    idx = {"h": jnp.int32(1), "q": unmade(0, (tq, 1)), "x": unmade(1, (1, tk))}
    got = _indexed(derivative, block, idx, jax.lax.broadcast_in_dim, (tq, tk))
    assert (np.asarray(got) == 1.0).all()
    rows = {"q": Vector(jnp.arange(tq) + 3, (0,), (tq, 1)), "x": unmade(1, (1, tk))}
    got = _indexed(lambda s, q, x: s + jnp.cumsum(q, axis=0), block, rows, jax.lax.broadcast_in_dim, (tq, tk))
    want = s + np.cumsum(np.arange(tq) + 3)[:, None]
    assert np.allclose(np.asarray(got), want, rtol=0, atol=1e-6)


def alibi_scheduled():
    """ALiBi (its score modifier reads the head, a grid index, and both block indices), causal, as Mosaic tiles it."""
    b, q, x, d = nc.axes("b q x d", d=64)
    made = nc.library.alibi_attention(nc.Axis("h", 4), q, x, d, causal=True, batch=(b,), dtype="bf16")
    return derive(made, tile(q, 128), stream(x, 128), verify=False)


SCHEDULES = {
    "dilated": lambda: scheduled(dilated, 128, 128, 64, "bf16"),
    "image": lambda: scheduled(image, 128, 128, 64, "bf16"),
    "alibi": alibi_scheduled,
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_mosaic_kernels_lower_for_cuda_with_index_vectors(monkeypatch, name):
    """Every Mosaic kernel of the dilated window, the 2-D neighbourhood and ALiBi lowers for CUDA on the CPU: the
    forward (with its residual), dQ, dK·dV and the fused dK·dV·dQ (``backward="fused"``), each index function run on
    vectors of the rows and columns of wgmma's layout (no fallback to whole grids). ALiBi's score derivative reads
    none of the indices its signature names: an index vector emitted all the same had no layout Mosaic GPU's
    inference could find (the dQ kernel failed to lower)."""
    calls, run = [], arrays.on_vectors

    def counted(*a):
        calls.append("fell back")
        out = run(*a)
        calls[-1] = "on vectors"
        return out

    monkeypatch.setattr(arrays, "on_vectors", counted)
    for backward, kernels in (("lowered", 5), ("fused", 4)):  # compiled, each kernel is lowered for CUDA when built
        roles = lower(SCHEDULES[name](), backend="mosaic", interpret=False, backward=backward).backends
        assert len(roles) == kernels and set(roles.values()) == {"mosaic"}, roles  # forward, Δ, dQ and dK·dV, or fused
    assert calls and set(calls) == {"on vectors"}


def test_mosaic_forward_lowers_for_cuda_with_a_captured_array():
    """A mask reading a captured array (documents through ``document_id``, causal) still lowers to Mosaic GPU."""
    n = 256
    document_id = (jnp.arange(n) // 100).astype(jnp.int32)

    def doc(b, h, q_idx, kv_idx):
        return (document_id[q_idx] == document_id[kv_idx]) & (q_idx >= kv_idx)

    q, k, v = (jax.random.normal(jax.random.key(i), (1, n, 1, 64), jnp.bfloat16) for i in range(3))
    made = nc.attention.kernel_for(q, k, v, mask_mod=doc, backend="mosaic", interpret=True)
    assert MosaicLowered(made.kernel.forward.plan, interpret=False).lowering_error() is None
