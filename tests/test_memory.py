"""The lowered backward holds no N×N buffer: XLA's memory analysis of the compiled ``jax.grad`` grows linearly in N.

Issue 12's memory claim, checked on what XLA compiles (interpret mode on CPU; the compiled kernels on a GPU). A
score matrix ``N × N`` would make the temporaries grow 16× when N grows 4×; the lowered kernels keep O(N·D) wires
(q, k, v, their cotangents, the output, the log-sum-exp, Δ) and their block padding.
"""

import jax
import jax.numpy as jnp
import pytest

import napkin_cat as nc


def temporaries(n: int, heads: int = 1, dim: int = 16, dtype=jnp.float32) -> int:
    """Bytes of temporaries XLA reserves for ``∇ Σ attention(q, k, v)`` at sequence length ``n``."""
    q, k, v = (jax.ShapeDtypeStruct((1, n, heads, dim), dtype) for _ in range(3))

    def loss(q, k, v):
        return nc.attention(q, k, v, is_causal=True).sum()

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_backward_temporaries_grow_linearly():
    small, large = temporaries(256), temporaries(1024)
    assert large <= 6 * small, (small, large)  # 4× the tokens: ~4× the bytes (16× with a score matrix)
    assert large < 1024 * 1024 * 4, large  # below one f32 score matrix


@pytest.mark.gpu
def test_compiled_backward_temporaries_grow_linearly():
    small, large = (temporaries(n, heads=16, dim=128, dtype=jnp.bfloat16) for n in (2048, 8192))
    assert large <= 6 * small, (small, large)
    assert large < 16 * 8192 * 8192 * 2, large  # below one bf16 score matrix per head
