"""``nc.attention``'s forward + backward against cuDNN's (GPU), each kernel CUPTI saw with its time: D = 128,
N ∈ {2048, 8192}, causal and not, B·N = 16k, H = 16, bf16. One JSON line per shape, prefixed by ``label`` (run it on
two trees in one call to compare commits: ``results/backward_dq_chunk_NVIDIA_H200_stop56.log``).

    python papers/flash_attention/probes/backward_vs_cudnn.py [label]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import jax
import jax.numpy as jnp

import napkin_cat as nc
from lowering._timing import time_calls

if __name__ == "__main__":
    label = sys.argv[1] if len(sys.argv) > 1 else "napkin-cat"
    for n in (2048, 8192):
        for causal in (False, True):
            b = 16384 // n
            q, k, v, ct = (jax.random.normal(jax.random.key(i), (b, n, 16, 128), jnp.bfloat16) for i in range(4))
            res = {"N": n, "causal": causal}
            impls = {
                "napkin": lambda q, k, v, c=causal: nc.attention(q, k, v, is_causal=c),
                "cudnn": lambda q, k, v, c=causal: jax.nn.dot_product_attention(
                    q, k, v, is_causal=c, implementation="cudnn"
                ),
            }
            for name, f in impls.items():
                grad = jax.jit(lambda q, k, v, f=f, ct=ct: jax.vjp(f, q, k, v)[1](ct))
                t = time_calls(grad, q, k, v, reps=10, batches=5, warmup=2)
                res[name] = t.ms
                if name == "napkin":
                    res["kernels"] = [(kn[:60], s * 1e3) for kn, s in t.kernels]
            res["ratio"] = res["cudnn"] / res["napkin"]
            print(label, json.dumps(res), flush=True)
