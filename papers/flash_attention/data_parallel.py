"""Data-parallel training of the Llama-style decoder (papers/llama/model.py), its attention on ``nc.attention``.

One training step (AdamW, :mod:`papers.llama.train`'s optimiser) on 1 GPU and on ``--devices`` GPUs: the same
per-device batch, the batch sharded over a mesh axis "data" by a ``NamedSharding`` (Auto axes: jit's SPMD
partitions the step, ``nc.attention`` runs per shard as a ``custom_partitioning`` op, and the gradients of the
replicated parameters are all-reduced). Explicit axes are not offered: flax's ``nnx.Embed`` gathers rows without
an ``out_sharding``, which Explicit sharding refuses. Reports tokens/s per setting and the scaling ratio (tokens/s
on N devices over one's).

Before timing, the sharded step is checked against one device on the same global batch (``--check-rows`` rows
per device): the loss, and the gradients (relative L2 error over all parameters), within ``TOLERANCE[dtype]``.
Writes ``results/data_parallel_<GPU>_x<N>.json`` and ``.png``.

    python papers/flash_attention/data_parallel.py [--devices N] [--config dp] [--per-device-batch 16]
    python papers/flash_attention/data_parallel.py --smoke   # CPU: tiny sizes on 4 forced host devices
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file, it still finds `papers`
if "--smoke" in sys.argv and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # before jax starts: the smoke run uses 4 host devices (CPU)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()

import argparse  # noqa: E402 - after the device flag
import dataclasses  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as Spec  # noqa: E402

from papers.llama.model import CONFIGS, Config, Llama, loss_fn, parameter_count  # noqa: E402
from papers.llama.train import CORPUS, Run, encode, init_state, optimizer  # noqa: E402

HERE = Path(__file__).parent
#: a modest Llama (about 90M parameters, head dim 64) whose step keeps an H100 busy at 16 × 2048 tokens
DP = Config(d_model=1024, layers=8, heads=16, kv_heads=4, ffn=2816, seq=2048, dtype="bfloat16")
SMOKE = Config(d_model=64, layers=1, heads=4, kv_heads=2, ffn=128, seq=32)
#: the sharded step against one device's on the same batch (loss: relative error; gradients: relative L2 error):
#: per-example work is the same on either side, the sums over the batch (the loss's mean, the gradients'
#: all-reduce) are ordered differently; in bf16 each device's partial gradient is rounded to bf16 before the
#: all-reduce, where one device rounds the whole sum once (a few bf16 ulps: 1.7e-2 measured on CPU, --smoke sizes)
TOLERANCE = {"float32": 1e-5, "bfloat16": 5e-2}


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def mesh_of(devices: int):
    return jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:devices])


def place(mesh, state: dict, tokens):
    """Copies of the state, replicated, and of the batch, split over "data", on ``mesh`` (copies: a step donates
    its state, which another setting uses next)."""
    state = jax.device_put(state, NamedSharding(mesh, Spec()), may_alias=False)
    return state, jax.device_put(tokens, NamedSharding(mesh, Spec("data")), may_alias=False)


def steps_of(graphdef, tx):
    """The jitted training step ``(state, tokens) → (state, loss)`` and ``(params, tokens) → (loss, grads)``."""

    def loss_and_grads(params, tokens):
        return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), tokens))(params)

    def step(state, tokens):
        value, grads = loss_and_grads(state["params"], tokens)
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = jax.tree.map(lambda p, u: p + u, state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, value

    return jax.jit(step, donate_argnums=0), jax.jit(loss_and_grads)


def token_batches(seed: int, count: int, rows: int, seq: int) -> list[np.ndarray]:
    """``count`` batches of ``rows`` random windows of ``seq + 1`` corpus bytes (host arrays)."""
    data = np.asarray(encode(CORPUS))
    rng = np.random.default_rng(seed)
    return [data[(rng.integers(0, len(data), (rows, 1)) + np.arange(seq + 1)) % len(data)] for _ in range(count)]


def check(grads_of, state: dict, devices: int, rows: int, seq: int, dtype: str) -> dict:
    """Loss and gradients on ``devices`` against one device, on the same global batch of ``devices · rows``."""
    (tokens,) = token_batches(1, 1, devices * rows, seq)
    got = grads_of(*place(mesh_of(devices), state["params"], tokens))
    want = grads_of(*place(mesh_of(1), state["params"], tokens))
    (loss, grads), (loss1, grads1) = jax.device_get(got), jax.device_get(want)
    flat, flat1 = (
        np.concatenate([np.ravel(g).astype(np.float64) for g in jax.tree.leaves(x)]) for x in (grads, grads1)
    )
    loss_err = abs(float(loss) - float(loss1)) / abs(float(loss1))
    grad_err = float(np.linalg.norm(flat - flat1) / np.linalg.norm(flat1))
    ok = max(loss_err, grad_err) <= TOLERANCE[dtype]
    log(
        f"check on {devices} devices, global batch {devices * rows}: loss {float(loss):.6f} vs {float(loss1):.6f} "
        f"(rel {loss_err:.1e}), gradients rel L2 {grad_err:.1e}: {'equal' if ok else 'DIFFERENT'} within "
        f"{TOLERANCE[dtype]:g}"
    )
    return {
        "devices": devices,
        "rows": devices * rows,
        "loss": float(loss),
        "loss_one_device": float(loss1),
        "loss_rel_err": loss_err,
        "grad_rel_l2": grad_err,
        "tolerance": TOLERANCE[dtype],
        "equal": ok,
    }


def throughput(step, state: dict, devices: int, args, cfg: Config) -> dict:
    """Tokens/s of ``args.steps`` training steps on ``devices`` at ``args.per_device_batch`` rows per device."""
    mesh = mesh_of(devices)
    rows = devices * args.per_device_batch
    batches = [place(mesh, {}, t)[1] for t in token_batches(2, 4, rows, cfg.seq)]
    state = place(mesh, state, batches[0])[0]
    for i in range(args.warmup):  # compiles
        state, loss = step(state, batches[i % len(batches)])
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for i in range(args.steps):
        state, loss = step(state, batches[i % len(batches)])
    loss = float(loss)
    seconds = time.perf_counter() - start
    tokens = args.steps * rows * cfg.seq
    log(
        f"{devices} device(s): {rows} × {cfg.seq} tokens a step, {1e3 * seconds / args.steps:.1f} ms a step, "
        f"{tokens / seconds:,.0f} tokens/s (loss {loss:.4f})"
    )
    return {
        "devices": devices,
        "global_batch": rows,
        "step_ms": 1e3 * seconds / args.steps,
        "tokens_per_s": tokens / seconds,
        "final_loss": loss,
    }


def run(args) -> Path:
    cfg = SMOKE if args.smoke else DP if args.config == "dp" else CONFIGS[args.config]
    cfg = dataclasses.replace(cfg, seq=args.seq or cfg.seq)
    kind, platform = jax.devices()[0].device_kind, jax.devices()[0].platform
    gpu = "cpu" if platform == "cpu" else kind.replace(" ", "_")
    n = args.devices or jax.device_count()
    if n > jax.device_count():
        raise SystemExit(f"--devices {n}: jax sees {jax.device_count()} devices")
    backend = args.backend or ("xla" if platform == "cpu" else "auto")  # CPU: no Pallas interpreter in the timing
    model = Llama(cfg, attention="napkin", backend=backend, rngs=nnx.Rngs(0))
    graphdef, tx = nnx.graphdef(model), optimizer(Run(steps=args.warmup + args.steps, warmup=1))
    state = init_state(model, tx)
    log(
        f"{kind} × {jax.device_count()}: Llama {parameter_count(model) / 1e6:.1f}M parameters, {cfg.dtype}, "
        f"seq {cfg.seq}, {args.per_device_batch} rows per device, attention nc.attention (backend {backend})"
    )
    step, grads_of = steps_of(graphdef, tx)
    checked = check(grads_of, state, n, args.check_rows, cfg.seq, cfg.dtype) if n > 1 else None
    rows = [throughput(step, state, d, args, cfg) for d in sorted({1, n})]
    ratio = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    log(f"scaling: {ratio:.2f}× one device's tokens/s on {n} ({ratio / n:.0%} of linear)")
    meta = {
        "gpu": kind,
        "platform": platform,
        "device_count": jax.device_count(),
        "devices": n,
        "config": dataclasses.asdict(cfg),
        "parameters": parameter_count(model),
        "backend": backend,
        "per_device_batch": args.per_device_batch,
        "steps": args.steps,
        "jax": jax.__version__,
    }
    result = {"meta": meta, "check": checked, "runs": rows, "scaling": ratio, "efficiency": ratio / n}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"data_parallel_{gpu}_x{n}.json"
    path.write_text(json.dumps(result, indent=1))
    plot(result, path.with_suffix(".png"))
    log(f"wrote {path} and .png")
    if checked is not None and not checked["equal"]:
        raise SystemExit("the sharded step's loss or gradients differ from one device's: see the check above")
    return path


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, meta = result["runs"], result["meta"]
    devices = [r["devices"] for r in runs]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([str(d) for d in devices], [r["tokens_per_s"] for r in runs], color="tab:blue", label="measured")
    ax.plot(
        [str(d) for d in devices], [runs[0]["tokens_per_s"] * d for d in devices], "k--", marker="o", label="linear"
    )
    ax.set_xlabel("devices (same per-device batch)")
    ax.set_ylabel("training tokens/s")
    ax.set_title(
        f"data-parallel Llama {meta['parameters'] / 1e6:.0f}M, nc.attention — {meta['device_count']} × "
        f"{meta['gpu']}: {result['scaling']:.2f}×",
        fontsize=9,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> Path:
    """Parse ``argv`` and run; returns the JSON path."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, help="default: every local device")
    p.add_argument("--config", default="dp", choices=["dp", *CONFIGS])
    p.add_argument("--seq", type=int, help="default: the config's")
    p.add_argument("--per-device-batch", type=int, default=16)
    p.add_argument("--check-rows", type=int, default=1, help="rows per device in the loss/gradient check")
    p.add_argument("--backend", help="nc.attention's backend (default: auto on GPU, xla on CPU)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes on 4 host devices (CPU)")
    args = p.parse_args(argv)
    if args.smoke:
        args.per_device_batch, args.warmup, args.steps = 2, 1, 2
    return run(args)


if __name__ == "__main__":
    main()
