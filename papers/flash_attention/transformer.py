"""A small decoder-only transformer in plain JAX whose attention is pluggable (NCD §transformer).

Character-level language model on ``corpus.txt`` (Shakespeare's sonnets and the opening of *Alice's
Adventures in Wonderland*, both public domain): token + position embeddings, pre-norm blocks of causal
multi-head attention and a GELU MLP, RMS norms, tied unembedding; optax's Adam. The attention is any
``f(q, k, v)`` on [B, N, H, D] arrays (``jax.nn.dot_product_attention``'s layout) computing causal
``softmax(QKᵀ/√D)·V``: ``reference`` is ``jax.nn.dot_product_attention``, ``napkin`` napkin-cat's drop-in
entry ``nc.attention`` (derived, verified and lowered once, differentiated by its lowered backward
kernels), ``mha`` jax's Pallas Triton kernel. Training both on the same data from the same
initialisation, the loss curves should agree to within the attention's rounding.

>>> cfg = ModelConfig(vocab=len(VOCAB), d_model=32, heads=2, layers=1, seq=16)
>>> params = init(jax.random.key(0), cfg)
>>> tokens = encode(CORPUS[:33])[None]
>>> logits = jax.jit(forward, static_argnums=(2, 3))(params, tokens[:, :16], cfg, attention("reference"))
>>> logits.shape == (1, 16, len(VOCAB))
True
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from papers.flash_attention import attentions as at
from papers.flash_attention import report
from papers.flash_attention.timing import once

HERE = Path(__file__).resolve().parent
CORPUS = (HERE / "corpus.txt").read_text()
VOCAB = sorted(set(CORPUS))


def encode(text: str) -> jnp.ndarray:
    """Characters → token ids.

    >>> decode(encode("Alice"))
    'Alice'
    """
    index = {c: i for i, c in enumerate(VOCAB)}
    return jnp.array([index[c] for c in text], jnp.int32)


def decode(tokens) -> str:
    return "".join(VOCAB[int(t)] for t in tokens)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes of the model; ``d_model`` is split evenly over ``heads``."""

    vocab: int
    d_model: int = 256
    heads: int = 4
    layers: int = 4
    seq: int = 256

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


# --- the model --------------------------------------------------------------------------------


def init(key, cfg: ModelConfig) -> dict:
    """Parameters as a pytree of f32 arrays (scaled normal initialisation)."""
    keys = iter(jax.random.split(key, 2 + 4 * cfg.layers))
    d = cfg.d_model

    def dense(n_in, n_out):
        return jax.random.normal(next(keys), (n_in, n_out)) * n_in**-0.5

    def block():
        return {
            "norm1": jnp.ones(d),
            "qkv": dense(d, 3 * d),
            "out": dense(d, d) / (2 * cfg.layers) ** 0.5,
            "norm2": jnp.ones(d),
            "up": dense(d, 4 * d),
            "down": dense(4 * d, d) / (2 * cfg.layers) ** 0.5,
        }

    return {
        "embed": jax.random.normal(next(keys), (cfg.vocab, d)) * 0.02,
        "pos": jax.random.normal(next(keys), (cfg.seq, d)) * 0.02,
        "blocks": [block() for _ in range(cfg.layers)],
        "norm": jnp.ones(d),
    }


def rms_norm(x, gain):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * gain


def _heads(x, cfg: ModelConfig):
    """[B, N, H·D] → [B, N, H, D]."""
    b, n, _ = x.shape
    return x.reshape(b, n, cfg.heads, cfg.head_dim)


def attend(p: dict, x, cfg: ModelConfig, attention: Callable):
    """Multi-head causal self-attention; ``attention`` sees [B, N, H, D] arrays."""
    q, k, v = (_heads(a, cfg) for a in jnp.split(x @ p["qkv"], 3, axis=-1))
    o = attention(q, k, v).astype(x.dtype)
    return o.reshape(x.shape) @ p["out"]


def forward(params: dict, tokens, cfg: ModelConfig, attention: Callable):
    """Logits [B, N, vocab] for tokens [B, N]."""
    x = params["embed"][tokens] + params["pos"][: tokens.shape[1]]
    for p in params["blocks"]:
        x = x + attend(p, rms_norm(x, p["norm1"]), cfg, attention)
        x = x + jax.nn.gelu(rms_norm(x, p["norm2"]) @ p["up"]) @ p["down"]
    return rms_norm(x, params["norm"]) @ params["embed"].T


def loss_fn(params: dict, batch, cfg: ModelConfig, attention: Callable):
    """Mean next-character cross-entropy over a batch [B, N + 1]."""
    logits = forward(params, batch[:, :-1], cfg, attention)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, batch[:, 1:, None], axis=-1))


# --- attention choices and training -----------------------------------------------------------


def _napkin(spec: at.Spec) -> Callable:
    from lowering import attention as entry  # the drop-in entry, nc.attention

    return functools.partial(entry, is_causal=True, interpret=spec.interpret)


def _mha(spec: at.Spec) -> Callable:
    impl = at.pallas_mha(spec)
    if impl.unavailable:
        raise RuntimeError(impl.unavailable)
    return impl.fn  # on [B, N, H, D], as the model's arrays


#: the attentions the model can train with: each builds a causal ``f(q, k, v)`` on [B, N, H, D] or raises
ATTENTIONS: dict[str, Callable[[at.Spec], Callable]] = {
    "reference": lambda spec: functools.partial(jax.nn.dot_product_attention, is_causal=True),
    "napkin": _napkin,
    "mha": _mha,
}


def attention(name: str, dtype=jnp.float32, head_dim: int = 64) -> Callable:
    """The causal attention ``name`` on [B, N, H, D], computing in ``dtype``; raises if unavailable.

    >>> q = jnp.ones((1, 8, 2, 16))
    >>> attention("reference", head_dim=16)(q, q, q).shape
    (1, 8, 2, 16)
    """
    spec = at.Spec(dtype, causal=True, head_dim=head_dim, interpret=not at.on_gpu())
    try:
        impl = ATTENTIONS[name](spec)
    except Exception as e:  # noqa: BLE001 - said with the attention's name, whatever the reason
        raise RuntimeError(f"attention {name!r} unavailable: {type(e).__name__}: {e}") from e

    def run(q, k, v):
        return impl(*(a.astype(dtype) for a in (q, k, v)))

    return run


def batches(key, data, batch: int, seq: int):
    """Random windows of ``seq + 1`` characters, [batch, seq + 1]."""
    starts = jax.random.randint(key, (batch,), 0, data.shape[0] - seq - 1)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (seq + 1,)))(starts)


def train(
    cfg: ModelConfig, attn: Callable, *, steps: int, batch: int, lr: float, seed: int = 0, log: Callable = print
) -> dict:
    """Train from a seed-fixed initialisation on seed-fixed batches; losses per step and held-out."""
    data = encode(CORPUS)
    split = int(0.9 * data.shape[0])
    train_data, held_out = data[:split], data[split:]
    params = init(jax.random.key(seed), cfg)
    adam = optax.adam(lr)
    state = adam.init(params)

    @jax.jit
    def step(params, state, key):
        loss, grads = jax.value_and_grad(loss_fn)(params, batches(key, train_data, batch, cfg.seq), cfg, attn)
        updates, state = adam.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    evaluate = jax.jit(functools.partial(loss_fn, cfg=cfg, attention=attn))
    eval_batch = batches(jax.random.key(seed + 1), held_out, batch, cfg.seq)
    losses, held = [], []

    def train(params, state):
        for i, key in enumerate(jax.random.split(jax.random.key(seed + 2), steps)):
            params, state, loss = step(params, state, key)
            losses.append(float(loss))
            if i % max(1, steps // 10) == 0 or i == steps - 1:
                held.append((i, float(evaluate(params, eval_batch))))
                log(f"step {i:4d}  loss {losses[-1]:.3f}  held-out {held[-1][1]:.3f}")

    _, seconds, _ = once(train, params, state)
    return {"status": "ok", "losses": losses, "held_out": held, "seconds": seconds}


def forward_check(cfg: ModelConfig, attn: Callable, reference: Callable, *, batch: int, seed: int = 0) -> dict:
    """The initial model's loss under ``jax.jit`` with ``attn``, and its largest logit difference from
    the same model with ``reference`` attention: the forward pass runs even where training cannot.

    >>> cfg = ModelConfig(vocab=len(VOCAB), d_model=32, heads=2, layers=1, seq=16)
    >>> ref = attention("reference")
    >>> forward_check(cfg, ref, ref, batch=2)["max_abs_logit_diff"]
    0.0
    """
    params = init(jax.random.key(seed), cfg)
    tokens = batches(jax.random.key(seed + 1), encode(CORPUS), batch, cfg.seq)
    run = jax.jit(forward, static_argnums=(2, 3))
    logits, expected = run(params, tokens[:, :-1], cfg, attn), run(params, tokens[:, :-1], cfg, reference)
    loss = jax.jit(loss_fn, static_argnums=(2, 3))(params, tokens, cfg, attn)
    return {"loss": float(loss), "max_abs_logit_diff": float(jnp.max(jnp.abs(logits - expected)))}


def _error(e: BaseException) -> dict:
    error = report.describe_error(e)
    print(f"   {error}", file=sys.stderr, flush=True)
    return {"status": "error", "error": error}


def compare(runs: dict) -> dict:
    """Largest per-step loss difference between the first run and each other one that finished."""
    ok = {k: r["losses"] for k, r in runs.items() if r["status"] == "ok"}
    if len(ok) < 2:
        return {}
    (first, base), *rest = ok.items()
    return {f"{name} - {first}": float(np.max(np.abs(np.subtract(ls, base)))) for name, ls in rest}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in res["runs"].items():
        if r["status"] == "ok":
            ax.plot(r["losses"], label=f"{name} (train)", alpha=0.8)
            ax.plot(*zip(*r["held_out"], strict=True), "o--", label=f"{name} (held out)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=f"char transformer on {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the command line -------------------------------------------------------------------------

FULL = dict(steps=300, batch=32, seq=256, d_model=256, heads=4, layers=4, lr=2e-3)
QUICK = dict(steps=20, batch=4, seq=32, d_model=32, heads=2, layers=1, lr=1e-2)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--attention",
        choices=("both", "reference", "napkin", "mha"),
        default="both",
        help="both = reference and napkin, on the same data and initialisation",
    )
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (CPU smoke test)")
    for name, value in FULL.items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=None)
    p.add_argument(
        "--dtype",
        choices=("f32", "bf16", "fp16"),
        default=None,
        help="attention inputs (default bf16 on GPU, f32 on CPU)",
    )
    p.add_argument("--out-dir", type=Path, default=HERE / "results")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--write-readme", action="store_true")
    p.add_argument("--readme", type=Path, default=HERE / "README.md")
    opts = p.parse_args(argv)
    for name, value in (QUICK if opts.quick else FULL).items():
        if getattr(opts, name) is None:
            setattr(opts, name, value)
    opts.dtype = opts.dtype or ("bf16" if at.on_gpu() else "f32")
    return opts


def main(argv=None) -> dict:
    """Train with each chosen attention, write ``results/transformer.json`` and ``.png``."""
    opts = parse_args(argv)
    cfg = ModelConfig(len(VOCAB), opts.d_model, opts.heads, opts.layers, opts.seq)
    dtype = {"f32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[opts.dtype]
    names = ("reference", "napkin") if opts.attention == "both" else (opts.attention,)
    reference = attention("reference", dtype, cfg.head_dim)
    runs = {}
    for name in names:
        print(f"== attention = {name}", flush=True)
        try:
            attn = attention(name, dtype, cfg.head_dim)
        except Exception as e:  # noqa: BLE001 - an unavailable attention is a result to record
            runs[name] = _error(e)
            continue
        runs[name] = {"forward": forward_check(cfg, attn, reference, batch=opts.batch)}
        try:
            runs[name].update(train(cfg, attn, steps=opts.steps, batch=opts.batch, lr=opts.lr))
        except Exception as e:  # noqa: BLE001 - e.g. no backward pass yet: recorded, forward still shown
            runs[name].update(_error(e))
    res = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "argv": sys.argv[1:] if argv is None else list(argv),
        "config": {**dataclasses.asdict(cfg), **{k: getattr(opts, k) for k in FULL}, "dtype": opts.dtype},
        "runs": runs,
        "diff": compare(runs),
    }
    stem = "transformer" + ("_quick" if opts.quick else "")
    report.save_json(res, opts.out_dir / f"{stem}.json")
    if not opts.no_plot:
        plot(res, opts.out_dir / f"{stem}.png")
    print(report.transformer_summary(res), flush=True)
    if opts.write_readme:
        report.write_readme(opts.readme, opts.out_dir)
    return res


if __name__ == "__main__":
    main()
