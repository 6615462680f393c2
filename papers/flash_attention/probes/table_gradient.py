"""the learnable table's gradient through the gather, alone (GPU)."""
import sys

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

from papers.flash_attention.timing import time_calls

n = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
i = jnp.arange(n)
t = jax.random.normal(jax.random.key(0), (2 * n - 1,))
W = jax.random.normal(jax.random.key(1), (n, n))
W4 = jax.random.normal(jax.random.key(2), (2, 16, n, n))
gather = lambda t: t[i[:, None] - i[None, :] + n - 1]
scatter = jax.jit(jax.grad(lambda t, W: jnp.sum(gather(t) * W)))
sum_bh = jax.jit(lambda W4: W4.sum((0, 1)))

def skew(W):  # diagonal sums d = i - j + n - 1 by shearing: row i shifted right by n - 1 - i... then column sums
    P = jnp.pad(W[:, ::-1], ((0, 0), (0, n)))  # [n, 2n]: row i holds W[i, n-1-j] at j
    S = P.reshape(-1)[: n * (2 * n - 1)].reshape(n, 2 * n - 1)  # row i shifted left by i
    return S.sum(0)

skewed = jax.jit(skew)
ref = scatter(t, W)
print("skew matches:", float(jnp.max(jnp.abs(skewed(W) - ref)) / jnp.max(jnp.abs(ref))))
CASES = (("scatter-add (autodiff of the gather)", scatter, (t, W)), ("sum over b, h of [2,16,n,n]", sum_bh, (W4,)),
         ("diagonal sums by shearing", skewed, (W,)))
for name, f, a in CASES:
    print(f"{name:40s} {time_calls(f, *a, reps=5, batches=5, warmup=1).ms:.3f} ms", flush=True)
