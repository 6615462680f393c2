"""FP8 attention forward against cuDNN's, beside both bf16 kernels, in one process (the FP8/parity issue's
deliverable 1: napkin-cat's FP8 forward ≥ 1.0× cuDNN FP8, its error no larger).

D = 128 (``--d``), B·N = 16k tokens, H = 16, N ∈ {2048, 8192}, causal and not. Implementations, each timed on inputs
already in its own layout:

* ``napkin fp8``: ``nc.attention(q8, k8, v8, fp8_scales=...)`` as a user calls it (``backend="auto"``; it transposes
  V to keys innermost in XLA, timed with it);
* ``napkin fp8 kernel``: the same kernel called on V already laid out ``[B, H, D, N]`` (its own layout; its wrapper
  still interleaves V's keys, one pass over V, which the entry's transpose absorbs: ``docs/mosaic.md``);
* ``napkin fp8 g<tile> s<chunk>[ <n> stages]``: the Mosaic kernel at other blocks and ring depths (``--blocks``),
  V ``[B, H, D, N]``;
* ``napkin fp8 triton``: ``backend="triton"`` (``tl.dot`` on e4m3);
* ``napkin fp8·bf16 mixed``: FAN's mixed algorithm (its table's row 16), ``nc.attention(q8, k8, v16, fp8_scales=...)``:
  Q·Kᵀ in FP8, P·V in bf16 with P kept in registers, V bf16 as the caller lays it out;
* ``napkin row 16``: the same dtypes at FAN's row-16 blocks, by relabellings (:func:`row_16`: tiles of 384 queries
  split over three consumer warpgroups, 64-key chunks). It fits the registers at D = 64 only; at D = 128 its row
  is the refusal. Its row also carries FAN's model's figure (``kv_chunk_timing`` at the GPU's rates, the softmax
  hidden: 1.32 PF/s on an H100 at D = 128);
* ``cudnn fp8``: ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(..., use_fp8=True)``, [B, N, H, D],
  e4m3 out (divided by ``scale_o`` for its error);
* ``napkin bf16`` (``nc.attention``) and ``cudnn bf16`` (``jax.nn.dot_product_attention(implementation="cudnn")``)
  on the dequantised inputs in bf16.

Every implementation gets the same e4m3 inputs (a normal draw, descales 1) and the same scales (``--scale-s``, the
probabilities' scale). Errors, max |out − ref| / max |ref| on batch 0, two heads: ``err`` against f32 attention of
the dequantised inputs, ``err_p8`` against the same with the probabilities rounded to e4m3 at their row max times
``scale_s`` (napkin-cat's rounding). TFLOP/s: 4·B·H·N²·D, halved when causal. napkin-cat's rows carry the cost
functor's prediction for their kernel (``lowering.predicted_time``: tensor-core, CUDA-core and SFU time in series,
in waves) and the measured / predicted ratio. Writes ``fp8_<GPU>.json`` and ``.png``
under ``--out`` (after every configuration) and prints each row with its ratios.

    python papers/flash_attention/fp8.py [--out DIR] [--n 2048,8192] [--causal 0,1] [--blocks 128x256,128x128x3]
                                         [--d 128]
    python papers/flash_attention/fp8.py --smoke   # CPU, tiny sizes, interpret mode, cuDNN skipped
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find papers/ and the package

import napkin_cat as nc  # noqa: E402
from lowering import MosaicConfig, lower, predicted_time  # noqa: E402
from lowering._attention import KEYS, QUERIES, Signature  # noqa: E402
from lowering._fp8 import scale_probabilities  # noqa: E402
from napkin_cat.hardware import Hardware, for_device  # noqa: E402
from napkin_cat.optimize import kv_chunk_timing  # noqa: E402
from papers.flash_attention.benchmark import device_info, device_stem  # noqa: E402
from papers.flash_attention.timing import run_rows, save_figure, time_calls, timed  # noqa: E402
from rewrites import derive, split, stream, tile  # noqa: E402

HERE = Path(__file__).resolve().parent
E4M3 = jnp.float8_e4m3fn
#: cuDNN's forward FP8 parameters beside the four napkin-cat reads (its dict has the backward's too)
CUDNN_KEYS = (
    "amax_dQ", "amax_dK", "amax_dV", "amax_dP", "descale_q", "descale_k", "descale_v", "descale_s", "scale_s",
    "scale_o", "descale_o", "descale_dO", "descale_dP", "scale_dQ", "scale_dK", "scale_dV", "scale_dP",
)


#: row 16's three consumers and a producer share the SM's 65,536 registers: (3 · 160 + 24) · 128 threads
ROW_16 = MosaicConfig(consumer_registers=160, producer_registers=24)


def row_16(d: int, causal: bool = False, scale=None):
    """FAN's row 16 by relabellings: Q·Kᵀ in FP8, P·V in bf16 (the dtype of each contraction), tiles of 384 queries
    split over three consumer warpgroups (``split``), 64-key chunks; lowered on Mosaic with :data:`ROW_16`.

    >>> [str(s.rule) for s in row_16(64).steps[1:]]
    ['tile(q, 384)', 'split(q, 3)', 'stream(x, 64)']
    """
    b, h, q, x, dim = nc.axes("b h q x d", d=d)
    att = nc.library.dot_product_attention(
        q, x, dim, batch=(b, h), seq_at=1, causal=causal, dtype=nc.fp8_e4m3, out_dtype=nc.bf16, value_dtype=nc.bf16,
        scale=scale,
    )
    return derive(att, tile(q, 384), split(q, 3), stream(x, 64), verify=False)


def row_16_model(hw: Hardware, d: int) -> float:
    """FAN's row-16 FLOP/s on ``hw`` (:func:`~napkin_cat.optimize.kv_chunk_timing`: Q·Kᵀ in e4m3 and P·V in bf16
    at 384 queries, 64-key chunks, the softmax hidden).

    >>> round(row_16_model(for_device("NVIDIA H100 80GB HBM3"), 128) / 1e15, 2)
    1.32
    """
    return kv_chunk_timing(hw, g_q=384, s_x=64, d=d, qk=nc.fp8_e4m3, pv=nc.bf16).flops


def reference(q, k, v, causal: bool, scale_s: float | None = None):
    """f32 attention of [B, N, H, D] arrays with jnp alone; with ``scale_s`` the probabilities ``exp(s − max)``
    times ``scale_s`` rounded to e4m3 before P·V, their sum not."""
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        n = q.shape[1]
        s = jnp.where(jnp.arange(n)[:, None] >= jnp.arange(n)[None, :], s, -jnp.inf)
    p = jnp.exp(s - s.max(-1, keepdims=True))
    total = p.sum(-1, keepdims=True)
    if scale_s is not None:
        p, total = (p * scale_s).astype(E4M3).astype(jnp.float32), total * scale_s
    return jnp.einsum("bhqk,bkhd->bqhd", p / total, v)


def rel(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)) / jnp.max(jnp.abs(b)))


def cudnn_fp8(causal: bool, scale_s: float):
    """cuDNN's FP8 forward through jax's fused attention: e4m3 [B, N, H, D] in, e4m3 out (``scale_o`` 1)."""
    from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention

    one = lambda x: jnp.full((1, 1, 1, 1), x, jnp.float32)  # noqa: E731
    params = {k: one(1.0) for k in CUDNN_KEYS} | {"scale_s": one(scale_s), "descale_s": one(1 / scale_s)}
    mask = MaskType.CAUSAL if causal else MaskType.NO_MASK

    def f(q, k, v):
        out, _, _ = dot_product_attention(
            q, k, v, fp8_params=params, scale=q.shape[-1] ** -0.5, mask_type=mask, qkv_layout="BTNH", use_fp8=True
        )
        return out

    return f


def scales(scale_s: float) -> dict:
    """The all-FP8 rows' scales (unit descales, ``scale_s`` on P before it is rounded to e4m3)."""
    return dict(descale_q=1.0, descale_k=1.0, descale_v=1.0, scale_s=scale_s)


#: the mixed algorithm's scales: P is never rounded to e4m3, so it has no ``scale_s``
MIXED_SCALES = dict(descale_q=1.0, descale_k=1.0)


def inputs(key, b: int, n: int, h: int, d: int) -> tuple:
    """q, k, v drawn in e4m3 [B, N, H, D], V transposed [B, H, D, N] (FP8 wgmma's layout) and the three in bf16:
    every implementation's inputs in its own layout, made before any is timed."""
    q8, k8, v8 = ((jax.random.normal(kk, (b, n, h, d))).astype(E4M3) for kk in jax.random.split(key, 3))
    return q8, k8, v8, jnp.transpose(v8, (0, 2, 3, 1)), tuple(a.astype(jnp.bfloat16) for a in (q8, k8, v8))


def implementations(causal: bool, gpu: bool, scale_s: float, blocks: list, interpret: bool) -> dict:
    """Each implementation as ``(layout, f)``: ``"bnhd"`` takes e4m3 [B, N, H, D]; ``"vt"`` the same with V
    [B, H, D, N]; ``"bf16"`` the dequantised inputs in bf16."""
    fp8 = dict(fp8_scales=scales(scale_s), is_causal=causal, interpret=interpret or None)
    impls = {"napkin fp8": ("bnhd", lambda q, k, v: nc.attention(q, k, v, **fp8))}
    impls["napkin fp8 kernel"] = ("vt", lambda q, k, v: nc.attention.kernel_for(q, k, v, **fp8))  # built per shape
    for g, s, *stages in blocks:
        impls[f"napkin fp8 g{g} s{s}" + "".join(f" {n} stages" for n in stages)] = ("vt", (g, s, *stages))
    impls["napkin fp8 triton"] = ("bnhd", lambda q, k, v: nc.attention(q, k, v, backend="triton", **fp8))
    mixed = dict(fp8, fp8_scales=MIXED_SCALES)
    impls["napkin fp8·bf16 mixed"] = ("mixed", lambda q, k, v: nc.attention(q, k, v, **mixed))
    impls["napkin row 16"] = ("mixed", "row 16")
    if gpu:
        impls["cudnn fp8"] = ("bnhd", cudnn_fp8(causal, scale_s))
    impls["napkin bf16"] = ("bf16", lambda q, k, v: nc.attention(q, k, v, is_causal=causal, interpret=fp8["interpret"]))
    if gpu:
        impls["cudnn bf16"] = (
            "bf16",
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        )
    return impls


def blocked(sig: Signature, g: int, s: int, *stages: int, interpret: bool):
    """The FP8 kernel of ``sig`` at tile ``g`` and chunk ``s`` (and ring ``stages``) on Mosaic, called on (q, k,
    V [B, H, D, N])."""
    steps = (tile(QUERIES, g), stream(KEYS, s), scale_probabilities(KEYS, sig.fp8.scale_s))
    config = {"config": MosaicConfig(stages=stages[0])} if stages else {}
    return lower(derive(sig.diagram(), *steps, verify=False), "mosaic", interpret=interpret, **config)


def measure(name, layout, f, arrays, causal, flops, sig, interpret) -> dict:
    q8, k8, v8, vt8, bf = arrays
    if layout == "vt" and isinstance(f, tuple):
        f = blocked(sig, *f, interpret=interpret)
    elif f == "row 16":
        d = q8.shape[-1]
        f = lower(row_16(d, causal, scale=d**-0.5), "mosaic", interpret=interpret, config=ROW_16)
    elif name == "napkin fp8 kernel":
        f = f(q8, k8, v8).kernel  # the lowered kernel: q, k, V keys innermost
    args = {"bnhd": (q8, k8, v8), "vt": (q8, k8, vt8), "bf16": bf, "mixed": (q8, k8, bf[2])}[layout]
    fwd = jax.jit(f)
    out = fwd(*args)
    one = lambda a: a[:1, :, :2]  # noqa: E731
    deq = [one(a).astype(jnp.float32) for a in (q8, k8, v8)]
    got = one(out).astype(jnp.float32)
    row = {"err": rel(got, reference(*deq, causal))}
    if layout not in ("bf16", "mixed"):
        row["err_p8"] = rel(got, reference(*deq, causal, sig.fp8.scale_s))
    t = time_calls(fwd, *args, reps=10, batches=5, warmup=2)
    row["fwd"] = {"ms": t.ms, "tflops": flops / t.seconds / 1e12, "method": t.method}
    return row


def run(n: int, causal: bool, sizes: tuple, o, gpu: bool, hw: Hardware | None) -> list[dict]:
    """One row per implementation at ``n`` keys; napkin-cat's rows with the cost functor's prediction on ``hw``
    (:func:`lowering.predicted_time`), row 16's with FAN's model's too (:func:`row_16_model`)."""
    b, h, d = sizes[0] // n if sizes[0] >= n else 1, sizes[1], sizes[2]
    model = hw and row_16_model(hw, d)
    arrays = q8, k8, v8, vt8, bf = inputs(jax.random.key(n * 2 + causal), b, n, h, d)
    sig = Signature.of(q8, k8, v8, fp8_scales=scales(o.scale_s), is_causal=causal, interpret=o.smoke or None)
    flops = 4 * b * h * n * n * d / (2 if causal else 1)
    entries = {  # the entry's rows: the arguments its kernel is made for
        "napkin fp8": ((q8, k8, v8), dict(fp8_scales=scales(o.scale_s))),
        "napkin fp8·bf16 mixed": ((q8, k8, bf[2]), dict(fp8_scales=MIXED_SCALES)),
        "napkin bf16": (bf, {}),
    }

    def work(name, impl, row):
        row |= timed(measure, name, *impl, arrays, causal, flops, sig, o.smoke)
        scheduled = row_16(d, causal).diagram if name == "napkin row 16" else None
        if name in entries:
            args, kw = entries[name]
            made = nc.attention.kernel_for(*args, **kw, is_causal=causal, interpret=sig.interpret)
            inner, scheduled = made.kernel, made.kernel.diagram
            row["kernel"] = {"backends": dict(inner.backends or {}), "refused": dict(inner.refused or {})}
            row["kernel"]["blocks"] = [made.signature.tile, made.signature.stream]
        if scheduled is not None and hw is not None:  # the cost functor's time (Cost.time_serial, in waves)
            t = predicted_time(scheduled, hw, {"b": b, "h": h, QUERIES: n, KEYS: n, "q": n, "x": n})
            row["predicted_tflops"] = flops / t / 1e12
            row["measured_over_predicted"] = row["fwd"]["tflops"] / row["predicted_tflops"]
        if name == "napkin row 16" and model:
            row["model_tflops"] = model / 1e12
            row["measured_over_model"] = row["fwd"]["tflops"] / row["model_tflops"]

    def show(row):
        shown = f"fwd {row['fwd']['tflops']:7.1f} TFLOP/s  err {row['err']:.1e}"
        shown += f"  err_p8 {row['err_p8']:.1e}" if "err_p8" in row else ""
        if "predicted_tflops" in row:
            shown += f"  predicted {row['predicted_tflops']:.0f} ({row['measured_over_predicted']:.2f}×)"
        if "model_tflops" in row:
            shown += f"  FAN's model {row['model_tflops']:.0f} ({row['measured_over_model']:.2f}×)"
        return shown

    impls = implementations(causal, gpu, o.scale_s, o.blocks, o.smoke)
    return run_rows(impls, {"N": n, "B": b, "causal": causal}, work, show, f"N={n:5d} causal={int(causal)}", 22)


def ratios(rows: list[dict]) -> None:
    """Each napkin FP8 row's ratio to cuDNN FP8 and to napkin bf16; napkin bf16's to cuDNN bf16; cuDNN FP8's to its
    bf16."""
    ok = {(r["N"], r["causal"], r["impl"]): r["fwd"]["tflops"] for r in rows if "fwd" in r}
    for r in rows:
        at = (r["N"], r["causal"])
        bases = {"cudnn fp8": "cudnn fp8", "napkin bf16": "napkin bf16"} if "fp8" in r["impl"] else {}
        bases |= {"cudnn bf16": "cudnn bf16"} if r["impl"] in ("napkin bf16", "cudnn fp8") else {}
        for label, base in bases.items():
            if "fwd" in r and (*at, base) in ok and base != r["impl"]:
                r.setdefault("vs", {})[label] = r["fwd"]["tflops"] / ok[(*at, base)]


def plot(res: dict, path: Path) -> None:
    """Forward TFLOP/s per configuration, one bar per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(dict.fromkeys((r["N"], r["causal"]) for r in res["rows"]))
    impls = list(dict.fromkeys(r["impl"] for r in res["rows"]))
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / max(len(impls), 1)
    for j, impl in enumerate(impls):
        got = {(r["N"], r["causal"]): r["fwd"]["tflops"] for r in res["rows"] if r["impl"] == impl and "fwd" in r}
        xs = [i + j * width for i, c in enumerate(configs) if c in got]
        ax.bar(xs, [got[c] for c in configs if c in got], width, label=impl)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))])
    ax.set_xticklabels([f"N={n}{' causal' if c else ''}" for n, c in configs])
    ax.set_ylabel("forward TFLOP/s")
    ax.legend(fontsize=7, ncol=2)
    z = res["sizes"]
    title = f"{res['device']['kind']}: FP8 (e4m3) and bf16 attention forward, B·N={z['BN']} H={z['H']} D={z['D']}"
    ax.set_title(title, fontsize=9)
    save_figure(fig, path)


def profile(o) -> dict:
    """``o.profile``'s forward compiled and run twice (the second is the one to profile: ``ncu --launch-skip``)."""
    n, d = int(o.n.split(",")[0]), o.d
    b, h = max(16384 // n, 1), 16
    arrays = inputs(jax.random.key(n), b, n, h, d)
    sig = Signature.of(*arrays[:3], fp8_scales=scales(o.scale_s))
    layout, f = implementations(False, True, o.scale_s, o.blocks, False)[o.profile]
    row = measure(o.profile, layout, f, arrays, False, 4 * b * h * n * n * d, sig, False)
    print(f"{o.profile} N={n} D={d}: {row['fwd']['tflops']:.1f} TFLOP/s, err {row['err']:.1e}", flush=True)
    return row


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--n", default="2048,8192")
    p.add_argument("--causal", default="0,1")
    p.add_argument("--blocks", default="128x256,256x64", help="Mosaic FP8 (tile x chunk[x stages]) beside the entry's")
    p.add_argument("--scale-s", type=float, default=256.0, help="the probabilities' scale (cuDNN's scale_s)")
    p.add_argument("--d", type=int, default=128, help="head dim (row 16 fits the registers at 64)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, interpret mode, cuDNN skipped")
    p.add_argument("--profile", metavar="IMPL", help="run IMPL's forward twice at the first --n, not causal (for ncu)")
    o = p.parse_args(argv)
    o.blocks = [tuple(int(x) for x in b.split("x")) for b in o.blocks.split(",") if b]
    gpu = jax.default_backend() == "gpu"
    if o.profile:
        return profile(o)
    if o.smoke:
        o.n, o.blocks = "384", [(128, 64)]
    sizes = (384, 2, 64) if o.smoke else (16384, 16, o.d)  # B·N, H, D
    dev = device_info()
    res = {"device": dev, "sizes": dict(zip(("BN", "H", "D"), sizes, strict=True)), "scale_s": o.scale_s, "rows": []}
    print(f"{dev['kind']}: FP8 e4m3 and bf16 forward, B·N={sizes[0]} H={sizes[1]} D={sizes[2]}", flush=True)
    d_tag = "" if sizes[2] == 128 or o.smoke else f"_d{sizes[2]}"
    stem = f"fp8_{device_stem(dev['kind'])}{d_tag}{'_smoke' if o.smoke else ''}"
    o.out.mkdir(parents=True, exist_ok=True)
    for n in (int(x) for x in o.n.split(",")):
        for causal in (bool(int(c)) for c in o.causal.split(",")):
            res["rows"] += run(n, causal, sizes, o, gpu, for_device(dev["kind"]))
            ratios(res["rows"])
            (o.out / f"{stem}.json").write_text(json.dumps(res, indent=1))
    for r in res["rows"]:
        if "vs" in r:
            shown = "  ".join(f"{v:.2f}× {b}" for b, v in r["vs"].items())
            print(f"N={r['N']:5d} causal={int(r['causal'])} {r['impl']:22s} {shown}")
    plot(res, o.out / f"{stem}.png")
    return res


if __name__ == "__main__":
    main()
