"""Training the Llama-style decoder on napkin-cat's attention against the same model on jax.nn's (XLA).

Two measurements, written to ``results/llama_<GPU>.json`` and ``.png`` (``--smoke``: ``results/llama_smoke_<device>``):

- **throughput** (``--part throughput``): training tokens/s and peak memory (``peak_bytes_in_use``) of the ``1b``
  config (sequence 4096) for each attention, at the largest batch that fits, found by trying: batches double from
  ``--start`` until one runs out of memory, then the gap is bisected. Each trial is a process of its own (its peak
  memory its own; an out-of-memory error ends only it), and the JSON is rewritten after each, so a run cut short
  keeps what it measured; ``--budget-s`` stops starting trials in time.
- **loss curves** (``--part curves``): both attentions train the ``small`` config from the same initialisation on
  the same batches for ``--steps`` steps (bf16); their losses should agree within bf16's rounding.
- **decoding** (``--part decode``): greedy generation (``papers.llama.sample.generate``) of ``--new-tokens`` after
  a ``--prompt-len`` prompt at ``--decode-batch`` sequences, the ``1b`` config at random initialisation: tokens/s of
  the new tokens through the KV cache for each model, and for the reference also by rerunning the whole buffer
  per token (``cache=False``); the time of a second call (the first compiles).

``--attention all`` adds the napkin model with each block's norms fused into its projections (``nc.rms_norm_linear``,
off in the model by default: measured slower than XLA's norm and cuBLAS's matmul).

Each part and attention can run in a call of its own (``--part``, ``--attention``); the JSON keeps what earlier
calls wrote. The processes this one starts are the only ones to touch the GPU (so none holds memory another
needs). ``python -m papers.llama.benchmark --smoke`` runs both parts at the ``tiny`` config on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
#: the models measured, by name: napkin-cat's attention (XLA's norms and cuBLAS's matmuls), the same with each
#: block's norms fused into the projections after them (``nc.rms_norm_linear``), and jax.nn's attention
MODELS = {
    "napkin": {"attention": "napkin"},
    "napkin-fused-norms": {"attention": "napkin", "fuse_norms": True},
    "reference": {"attention": "reference"},
}


def worker(opts: argparse.Namespace) -> dict:
    """One trial (``--worker throughput``: tokens/s and peak memory at one batch) or one loss curve (``--worker
    curves``), in this process; a dict that :func:`main` reads from the last line of its output."""
    import jax
    from flax import nnx

    from papers.llama import train
    from papers.llama.model import CONFIGS, Llama, parameter_count

    cfg = CONFIGS[opts.config]
    device = jax.devices()[0]
    out = {"device": device.device_kind, "attention": opts.attention, "batch": opts.batch, "config": opts.config}
    if opts.worker == "decode":
        import jax.numpy as jnp

        from papers.llama import sample

        model = Llama(cfg, **MODELS[opts.attention], backend=opts.backend, rngs=nnx.Rngs(0))
        prompt = jax.random.randint(jax.random.key(1), (opts.batch, opts.prompt_len), 0, cfg.vocab, jnp.int32)
        for cache in (True, False) if opts.attention == "reference" else (True,):
            run = lambda c=cache: sample.generate(model, prompt, opts.new_tokens, cache=c).block_until_ready()  # noqa: E731
            start = time.perf_counter()
            run()
            first = time.perf_counter() - start
            start = time.perf_counter()
            run()
            seconds = time.perf_counter() - start
            label = "cached" if cache else "rerun"
            out |= {f"{label}_first_call_s": first, f"{label}_s": seconds,
                    f"{label}_tokens_per_s": opts.batch * opts.new_tokens / seconds}  # fmt: skip
        return {**out, "status": "ok", "prompt_len": opts.prompt_len, "new_tokens": opts.new_tokens}
    if opts.worker == "curves":
        run = train.Run(steps=opts.steps, batch=opts.batch, lr=opts.lr, warmup=max(1, opts.steps // 10))
        _, losses = train.train(cfg, run, **MODELS[opts.attention], backend=opts.backend, log=None)
        return {**out, "status": "ok", "losses": losses}
    run = train.Run(steps=opts.steps + 1, batch=opts.batch)
    try:
        model = Llama(cfg, **MODELS[opts.attention], backend=opts.backend, rngs=nnx.Rngs(0))
        out["parameters"] = parameter_count(model)
        state = train.init_state(model, train.optimizer(run))
        budget = opts.loss_budget_mib and opts.loss_budget_mib << 20
        step = train.make_step(nnx.graphdef(model), run, opts.loss, budget)
        data, keys = train.encode(train.CORPUS), jax.random.split(jax.random.key(1), run.steps)
        start = time.perf_counter()
        state, loss = step(state, data, keys[0], opts.batch, cfg.seq)
        loss.block_until_ready()
        out["first_step_s"] = time.perf_counter() - start  # compilation and one step
        start = time.perf_counter()
        for key in keys[1:]:
            state, loss = step(state, data, key, opts.batch, cfg.seq)
        out["loss"], seconds = float(loss), time.perf_counter() - start
    except Exception as e:  # noqa: BLE001 - running out of memory is the answer sought; other errors are recorded
        text = f"{type(e).__name__}: {e}"
        return {**out, "status": "oom" if any(s in text for s in OUT_OF_MEMORY) else "error", "error": text[:400]}
    stats = device.memory_stats() or {}
    tokens = opts.batch * cfg.seq * opts.steps
    return {
        **out,
        "status": "ok",
        "step_s": seconds / opts.steps,
        "tokens_per_s": tokens / seconds,
        "peak_bytes": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
    }


def spawn(opts: argparse.Namespace, part: str, attention: str, batch: int) -> dict:
    """:func:`worker` in a process of its own; its dict, or why it gave none."""
    argv = [sys.executable, "-m", "papers.llama.benchmark", f"--worker={part}", f"--attention={attention}"]
    argv += [f"--batch={batch}", f"--backend={opts.backend}", f"--loss={opts.loss}", f"--lr={opts.lr}"]
    argv += [f"--loss-budget-mib={opts.loss_budget_mib}"] if opts.loss_budget_mib else []
    argv += [f"--config={opts.curves_config if part == 'curves' else opts.config}"]
    argv += [f"--steps={opts.steps if part == 'curves' else opts.timed_steps}"]
    argv += [f"--prompt-len={opts.prompt_len}", f"--new-tokens={opts.new_tokens}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")  # JAX's default 0.75 would hide a quarter of the GPU
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=opts.trial_timeout_s)
    lines = done.stdout.strip().splitlines()
    try:
        res = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        text = " | ".join(tail)
        status = "oom" if any(s in text for s in OUT_OF_MEMORY) else "error"
        res = {"attention": attention, "batch": batch, "status": status, "error": f"exit {done.returncode}: {text}"}
    res["wall_s"] = time.perf_counter() - start
    print(f"  {part} {attention} batch {batch}: " + _line(res), flush=True)
    return res


def _line(r: dict) -> str:
    if r["status"] != "ok":
        return f"{r['status']} ({r.get('error', '')[:160]})"
    if "losses" in r:
        return f"final loss {r['losses'][-1]:.4f}"
    if "cached_tokens_per_s" in r:
        rerun = f", {r['rerun_tokens_per_s']:,.0f} rerunning the buffer" if "rerun_tokens_per_s" in r else ""
        return f"{r['cached_tokens_per_s']:,.0f} new tokens/s through the KV cache{rerun}"
    peak = r.get("peak_bytes")
    rate = f"{r['tokens_per_s']:,.0f} tokens/s"
    return f"{rate}, peak {peak / 2**30:.1f} GiB" if peak else rate


def largest_batch(opts, attention: str, record: list, save) -> None:
    """Double the batch from ``opts.start`` until a trial runs out of memory, then bisect; each trial appended to
    ``record`` and saved. Stops before a trial that would overrun ``opts.budget_s``."""
    began, ok, bad = time.perf_counter(), 0, None
    batch = opts.start
    while batch is not None and batch <= opts.max_batch:
        slowest = max((r["wall_s"] for r in record), default=0.0)
        if time.perf_counter() - began + slowest > opts.budget_s:
            print(f"  {attention}: stopping, the next trial would overrun --budget-s={opts.budget_s}", flush=True)
            return
        res = spawn(opts, "throughput", attention, batch)
        record.append(res)
        save()
        if res["status"] == "ok":
            ok = batch
        elif res["status"] == "oom":
            bad = batch
        else:
            return
        batch = 2 * batch if bad is None else (ok + bad) // 2 if bad - ok > max(1, ok // 4) else None


def best(trials: list) -> dict | None:
    """The trial of the largest batch that ran.

    >>> best([{"status": "ok", "batch": 2}, {"status": "oom", "batch": 4}, {"status": "ok", "batch": 3}])["batch"]
    3
    """
    ran = [t for t in trials if t["status"] == "ok"]
    return max(ran, key=lambda t: t["batch"]) if ran else None


def compare(curves: dict) -> dict:
    """The two loss curves' largest absolute and relative difference per step.

    >>> compare({"napkin": {"status": "ok", "losses": [2.0, 1.5]},
    ...          "reference": {"status": "ok", "losses": [2.0, 1.25]}})
    {'max_abs_diff': 0.25, 'max_rel_diff': 0.2}
    """
    ok = [c["losses"] for c in curves.values() if c.get("status") == "ok"]
    if len(ok) < 2:
        return {}
    diffs = [abs(a - b) for a, b in zip(*ok, strict=True)]
    rel = [d / abs(b) for d, b in zip(diffs, ok[1], strict=True)]
    return {"max_abs_diff": max(diffs), "max_rel_diff": max(rel)}


def plot(res: dict, path: Path) -> None:
    """Tokens/s and peak memory by batch (left), the loss curves and their difference (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, trials in res.get("throughput", {}).items():
        ran = sorted((t for t in trials if t["status"] == "ok"), key=lambda t: t["batch"])
        if ran:
            left.plot([t["batch"] for t in ran], [t["tokens_per_s"] for t in ran], "o-", label=name)
            for t in ran:
                if t.get("peak_bytes"):
                    left.annotate(f"{t['peak_bytes'] / 2**30:.0f} GiB", (t["batch"], t["tokens_per_s"]), fontsize=7)
    left.set(xlabel="batch (sequences)", ylabel="training tokens/s", title=f"{res['config']} config: tokens/s, peak")
    left.legend()
    for name, c in res.get("curves", {}).items():
        if c.get("status") == "ok":
            right.plot(c["losses"], label=name, alpha=0.8)
    right.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=f"{res['curves_config']} config: loss")
    right.legend()
    fig.suptitle(f"Llama-style decoder on {res['device']}: napkin-cat's attention against jax.nn's")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny config, few steps, on CPU")
    p.add_argument("--part", choices=("both", "throughput", "curves", "decode"), default="both")
    p.add_argument("--attention", choices=("both", "all", *MODELS), default="both",
                   help="both: napkin and reference; all: napkin-fused-norms too")
    p.add_argument("--config", default="1b", help="throughput's config")
    p.add_argument("--curves-config", default="small")
    p.add_argument("--start", type=int, default=1, help="throughput's first batch")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--timed-steps", type=int, default=5, help="steps timed per trial, after a first one")
    p.add_argument("--steps", type=int, default=300, help="loss curves' steps")
    p.add_argument("--batch", type=int, default=16, help="loss curves' batch")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default=None, help="napkin-cat's backend (default auto; --smoke: xla)")
    p.add_argument("--loss", choices=("logits", "fused"), default="logits")
    p.add_argument("--loss-budget-mib", type=int, default=None, help="--loss fused: MiB per logit block (XLA backend)")
    p.add_argument("--budget-s", type=float, default=480.0, help="start no throughput trial past this")
    p.add_argument("--trial-timeout-s", type=float, default=900.0)
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--prompt-len", type=int, default=512, help="decode's prompt")
    p.add_argument("--new-tokens", type=int, default=128, help="decode's generated tokens")
    p.add_argument("--decode-batch", type=int, default=8, help="decode's sequences")
    p.add_argument("--worker", choices=("throughput", "curves", "decode"), help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.smoke:
        # the derived kernels on the plain-JAX backend: interpreted Pallas would take minutes per step here
        opts.backend = opts.backend or "xla"
        opts.config, opts.curves_config, opts.max_batch, opts.timed_steps = "tiny", "tiny", 2, 1
        opts.steps, opts.batch, opts.lr = min(opts.steps, 6), min(opts.batch, 4), 1e-2
        opts.prompt_len, opts.new_tokens, opts.decode_batch = 8, 4, 2
    opts.backend = opts.backend or "auto"
    return opts


def main(argv=None) -> dict:
    """Run the parts asked for, each trial in a process of its own; write the JSON and the plot."""
    opts = parse_args(argv)
    if opts.worker:
        print(json.dumps(worker(opts)), flush=True)
        return {}
    names = {"both": ("napkin", "reference"), "all": tuple(MODELS)}.get(opts.attention, (opts.attention,))
    res = {"config": opts.config, "curves_config": opts.curves_config, "device": None, "argv": sys.argv[1:]}
    path = None

    def save():
        nonlocal path
        found = [
            r["device"]
            for part in ("throughput", "curves", "decode")
            for rs in res.get(part, {}).values()
            for r in (rs if isinstance(rs, list) else [rs])
            if r.get("device")
        ]
        if not found:
            return
        res["device"] = found[0]
        stem = "llama_smoke_" if opts.smoke else "llama_"
        path = opts.out_dir / (stem + res["device"].replace(" ", "_") + ".json")
        earlier = json.loads(path.read_text()) if path.exists() else {}
        for part in ("throughput", "curves", "decode"):  # what earlier calls measured, unless measured again now
            res[part] = {**earlier.get(part, {}), **res.get(part, {})}
        res["best"] = {n: best(ts) for n, ts in res["throughput"].items()}
        res["curves_diff"] = compare(res["curves"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=1))

    if opts.part in ("both", "throughput"):
        res["throughput"] = {}
        for name in names:
            print(f"== throughput, {opts.config}, attention = {name}", flush=True)
            res["throughput"][name] = []
            largest_batch(opts, name, res["throughput"][name], save)
    if opts.part in ("both", "curves"):
        res["curves"] = {}
        for name in names:
            print(f"== loss curve, {opts.curves_config}, attention = {name}", flush=True)
            res["curves"][name] = spawn(opts, "curves", name, opts.batch)
            save()
    if opts.part == "decode":
        res["decode"] = {}
        for name in names:
            print(f"== decode, {opts.config}, {name}", flush=True)
            res["decode"][name] = spawn(opts, "decode", name, opts.decode_batch)
            save()
    if path is None:
        print("nothing ran: no result to write", flush=True)
        return res
    plot(res, path.with_suffix(".png"))
    print(json.dumps({"best": res["best"], "curves_diff": res["curves_diff"]}, indent=1), flush=True)
    print(f"wrote {path} and {path.with_suffix('.png')}", flush=True)
    return res


if __name__ == "__main__":
    main()
