"""FP8 attention's error with and without incoherent processing, FlashAttention-3's experiment (Shah et al. 2024,
§4.3): q, k, v drawn from N(0, 1) plus N(0, 100)·Bernoulli(0.001), 0.1% outliers as large activations have. Each
variant (:data:`VARIANTS`) runs through ``nc.attention`` on the inputs ``nc.fp8_quantize`` rounds: one scale per
tensor, or per token and head for q and k (inputs of the kernel); rotated or not (``incoherent=True``: q and k first
rotated by the Hadamard boxes of :func:`rewrites.incoherent`); beside bf16 on the same draws, and the last variant
with P·V in bf16 (FAN's mixed algorithm: P and V never rounded to e4m3). The error is the RMSE
of the output against an f32 ``jax.numpy`` reference on the unrounded inputs (written here); the ratios are the
per-tensor FP8 RMSE over the rotated ones. FlashAttention-3 reports its FP8 error several times smaller with block
quantisation and incoherent processing together. On a GPU, cuDNN's FP8 attention runs on the same per-tensor
rounded inputs and scales (``cudnn fp8``, ``cudnn fp8 incoherent``; its output is e4m3, so it also carries the
output's rounding). Writes JSON and a bar chart named after the device::

    python papers/flash_attention/incoherent.py [results/incoherent_<device>.json]   # CPU: interpreted, N = 256
"""

import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import napkin_cat as nc  # noqa: E402

#: (name, incoherent, per): FP8 inputs rounded per tensor or per token (q and k), rotated or not
VARIANTS = (
    ("fp8", False, "tensor"),
    ("fp8 incoherent", True, "tensor"),
    ("fp8 per token", False, "token"),
    ("fp8 per token incoherent", True, "token"),
)


def outliers(key, shape):
    """N(0, 1) plus N(0, 100)·Bernoulli(0.001): FlashAttention-3's draw (§4.3)."""
    a, b, c = jax.random.split(key, 3)
    spikes = jax.random.bernoulli(c, 0.001, shape)
    return jax.random.normal(a, shape) + 10.0 * jax.random.normal(b, shape) * spikes


def reference(q, k, v, causal):
    """Softmax attention in f32 from [B, N, H, D] inputs."""
    s = jnp.einsum("bqhd,bxhd->bhqx", q, k, precision="highest") / np.sqrt(q.shape[-1])
    if causal:
        n = q.shape[1]
        s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
    return jnp.einsum("bhqx,bxhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


def cudnn_fp8(q8, k8, v8, scales: dict, causal: bool):
    """cuDNN's FP8 forward through jax's fused attention on the same e4m3 inputs and descales, output e4m3."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    from papers.flash_attention.fp8 import CUDNN_KEYS

    one = lambda x: jnp.full((1, 1, 1, 1), x, jnp.float32)  # noqa: E731
    params = {k: one(scales.get(k, 1.0)) for k in CUDNN_KEYS} | {"descale_s": one(1 / scales["scale_s"])}
    out, _, _ = dot_product_attention(q8, k8, v8, fp8_params=params, scale=q8.shape[-1] ** -0.5, qkv_layout="BTNH",
                                      mask_type=MaskType.CAUSAL if causal else MaskType.NO_MASK, use_fp8=True)
    return out


def rmse(got, want) -> float:
    return float(jnp.sqrt(jnp.mean((got.astype(jnp.float32) - want) ** 2)))


def run(out: str, seeds: int = 4) -> dict:
    if seeds < 1:
        raise ValueError(f"incoherent.run: seeds={seeds}; draw at least one set of inputs")
    cpu = jax.devices()[0].platform == "cpu"
    B, N, H, D = (1, 256, 2, 128) if cpu else (2, 4096, 16, 128)
    rows = []
    for seed in range(seeds):
        for causal in (False, True):
            q, k, v = (outliers(jax.random.key(3 * seed + i), (B, N, H, D)) for i in range(3))
            want = reference(q, k, v, causal)
            row = {"seed": seed, "causal": causal, "bf16": rmse(
                nc.attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), is_causal=causal), want)}
            for name, turn, per in VARIANTS:
                q8, k8, v8, scales = nc.fp8_quantize(q, k, v, incoherent=turn, per=per)
                row[name] = rmse(nc.attention(q8, k8, v8, fp8_scales=scales, is_causal=causal), want)
                if name == VARIANTS[-1][0]:  # FAN's mixed algorithm: P·V in bf16, so P and V are never e4m3
                    qk = {n: scales[n] for n in ("descale_q", "descale_k")}
                    mixed = nc.attention(q8, k8, v.astype(jnp.bfloat16), fp8_scales=qk, is_causal=causal)
                    row[f"{name}, P·V bf16"] = rmse(mixed, want)
                if not cpu and per == "tensor":  # cuDNN's scales are per tensor
                    row[f"cudnn {name}"] = rmse(cudnn_fp8(q8, k8, v8, scales, causal), want)
            row["fp8 / fp8 incoherent"] = row["fp8"] / row["fp8 incoherent"]
            row["fp8 / fp8 per token incoherent"] = row["fp8"] / row["fp8 per token incoherent"]
            rows.append(row)
            print(" ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
            result = write(out, [B, N, H, D], rows)  # after every draw: a run cut short keeps what it measured
    print(f"fp8 RMSE / fp8 incoherent RMSE: {result['ratio']}; / per token incoherent: "
          f"{result['ratio per token incoherent']} -> {out}")
    return result


def write(out: str, shape: list, rows: list) -> dict:
    """The rows so far, with the spread of the two ratios, as JSON at ``out`` and a bar chart beside it."""
    spread = lambda xs: {"min": min(xs), "median": float(np.median(xs)), "max": max(xs)}  # noqa: E731
    result = {"device": jax.devices()[0].device_kind, "shape": shape, "rows": rows,
              "ratio": spread([r["fp8 / fp8 incoherent"] for r in rows]),
              "ratio per token incoherent": spread([r["fp8 / fp8 per token incoherent"] for r in rows])}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=1))
    plot(result, Path(out).with_suffix(".png"))
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = ("bf16", *(v[0] for v in VARIANTS), f"{VARIANTS[-1][0]}, P·V bf16", "cudnn fp8", "cudnn fp8 incoherent")
    names = [n for n in every if n in result["rows"][0]]
    fig, ax = plt.subplots(figsize=(1.4 * len(names) + 1, 3.2))
    for i, causal in enumerate((False, True)):
        rows = [r for r in result["rows"] if r["causal"] == causal]
        if not rows:  # a run cut short before its causal draws
            continue
        means = [np.mean([r[n] for r in rows]) for n in names]
        ax.bar(np.arange(len(names)) + 0.38 * i, means, width=0.36, label="causal" if causal else "non-causal")
    ax.set_xticks(np.arange(len(names)) + 0.19, [textwrap.fill(n, 14) for n in names], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("RMSE vs f32 reference")
    B, N, H, D = result["shape"]
    ax.set_title(f"0.1% outliers, B={B} N={N} H={H} D={D}\n{result['device']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    run(sys.argv[1] if len(sys.argv) > 1 else "papers/flash_attention/results/incoherent_cpu.json")
