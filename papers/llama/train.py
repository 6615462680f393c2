"""Train the decoder of :mod:`papers.llama.model` on the bytes of ``papers/flash_attention/corpus.txt``.

Byte-level tokens (vocabulary 256: no tokenizer, no download); random windows of the corpus, read cyclically so
that any sequence length fits; optax's AdamW (no weight decay on the norms' gains) under linear warmup and
cosine decay, after clipping the gradients' global norm; checkpoints with orbax. ``python -m papers.llama.train
--config small --attention napkin --steps 300`` prints step, loss and tokens/s as it goes.

>>> state, losses = train(CONFIGS["tiny"], Run(steps=3, batch=2, warmup=1), attention="reference", log=None)
>>> len(losses), int(state["step"])
(3, 3)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from papers.llama.model import ATTENTIONS, CONFIGS, LOSSES, Config, Llama, loss_fn, parameter_count

CORPUS = (Path(__file__).resolve().parents[1] / "flash_attention" / "corpus.txt").read_text()


def encode(text: str) -> jnp.ndarray:
    """UTF-8 bytes → token ids (int32, 0–255).

    >>> decode(encode("Alice — «oui»"))
    'Alice — «oui»'
    """
    return jnp.asarray(np.frombuffer(text.encode(), np.uint8).astype(np.int32))


def decode(tokens) -> str:
    """Token ids → text (an incomplete UTF-8 sequence, as a model may sample, becomes U+FFFD)."""
    return bytes(np.asarray(tokens, np.uint8)).decode(errors="replace")


def batches(key, data, batch: int, seq: int):
    """``batch`` random windows of ``seq + 1`` tokens of ``data``, read cyclically (a window may wrap round).

    >>> batches(jax.random.key(0), jnp.arange(5), 3, 7).shape
    (3, 8)
    """
    starts = jax.random.randint(key, (batch, 1), 0, data.shape[0])
    return data[(starts + jnp.arange(seq + 1)) % data.shape[0]]


@dataclasses.dataclass(frozen=True)
class Run:
    """A training run's hyperparameters: AdamW (β₂ = 0.95, Llama's) at peak ``lr`` after ``warmup`` linear steps,
    cosine-decayed to ``lr · final`` at ``steps``; gradients clipped to global norm ``clip``."""

    steps: int = 300
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 30
    final: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0


def optimizer(run: Run) -> optax.GradientTransformation:
    """Clipping, then AdamW under warmup + cosine; weight decay on the matrices only (not the norms' gains).

    >>> [round(float(schedule_of(Run(steps=100, lr=1.0, warmup=10))(i)), 3) for i in (0, 10, 100)]
    [0.0, 1.0, 0.1]
    """
    decay = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(
        optax.clip_by_global_norm(run.clip),
        optax.adamw(schedule_of(run), b1=0.9, b2=0.95, weight_decay=run.weight_decay, mask=decay),
    )


def schedule_of(run: Run) -> optax.Schedule:
    """The learning rate by step: linear warmup to ``run.lr``, cosine decay to ``run.lr · run.final``."""
    decay_steps = max(run.steps, run.warmup + 1)
    return optax.warmup_cosine_decay_schedule(0.0, run.lr, run.warmup, decay_steps, run.lr * run.final)


def init_state(model: Llama, tx: optax.GradientTransformation) -> dict:
    """The training state, a pytree: parameters, optimiser state, step."""
    params = nnx.state(model, nnx.Param)
    return {"params": params, "opt": tx.init(params), "step": jnp.zeros((), jnp.int32)}


@functools.lru_cache(maxsize=8)
def make_step(graphdef, run: Run, loss: str = "logits", budget: int | None = None) -> Callable:
    """One jitted training step ``(state, data, key, batch_size, seq) → (state, loss)`` under :func:`optimizer`
    ``(run)``, on a batch drawn from ``data`` by ``key``; the old state's buffers are donated to the new one. Cached:
    a run resumed from a checkpoint takes the step compiled before."""
    tx = optimizer(run)

    def step(state, data, key, batch: int, seq: int):
        tokens = batches(key, data, batch, seq)
        value, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p), tokens, loss, budget))(
            state["params"]
        )
        updates, opt = tx.update(grads, state["opt"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt": opt, "step": state["step"] + 1}, value

    return jax.jit(step, static_argnums=(3, 4), donate_argnums=0)


def train(
    cfg: Config,
    run: Run,
    *,
    attention: str = "napkin",
    backend: str = "auto",
    loss: str = "logits",
    fuse_norms: bool = False,
    log: Callable | None = print,
    log_every: int = 10,
    state: dict | None = None,
    until: int | None = None,
) -> tuple[dict, list[float]]:
    """Train from ``run.seed``'s initialisation (or ``state``, a saved one, from its step) on ``run.seed``'s
    batches of the corpus's first 90%, to step ``until`` (default: ``run.steps``); the state and the loss at each
    step taken. ``log`` gets a line per ``log_every`` steps: step, loss, tokens/s since the last line (the first
    includes compilation)."""
    model = Llama(cfg, attention=attention, backend=backend, fuse_norms=fuse_norms, rngs=nnx.Rngs(run.seed))
    graphdef = nnx.graphdef(model)
    state = init_state(model, optimizer(run)) if state is None else state
    step = make_step(graphdef, run, loss)
    data = encode(CORPUS)[: int(0.9 * len(CORPUS))]
    keys = jax.random.split(jax.random.key(run.seed + 1), run.steps)
    losses, start = [], int(state["step"])
    since, logged = time.perf_counter(), start
    for i in range(start, run.steps if until is None else until):
        state, value = step(state, data, keys[i], run.batch, cfg.seq)
        losses.append(value)  # a device scalar: read when logged, so that steps are dispatched ahead
        if log is not None and ((i + 1) % log_every == 0 or i + 1 == run.steps):
            value, now = float(value), time.perf_counter()
            rate = run.batch * cfg.seq * (i + 1 - logged) / (now - since)
            log(f"step {i + 1:5d}  loss {value:.4f}  tokens/s {rate:,.0f}")
            since, logged = now, i + 1
    return state, [float(v) for v in losses]


def model_of(cfg: Config, state: dict, *, attention: str = "napkin", backend: str = "auto") -> Llama:
    """The model with ``state``'s parameters (abstract initialisation: no random parameters drawn).

    >>> cfg = CONFIGS["tiny"]
    >>> model = Llama(cfg, attention="reference", rngs=nnx.Rngs(3))
    >>> state = init_state(model, optimizer(Run()))
    >>> again = model_of(cfg, state, attention="reference")
    >>> bool(jnp.all(again.embed.embedding[...] == model.embed.embedding[...]))
    True
    """
    abstract = nnx.eval_shape(lambda: Llama(cfg, attention=attention, backend=backend, rngs=nnx.Rngs(0)))
    return nnx.merge(nnx.graphdef(abstract), state["params"])


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            "papers/llama checkpoints are written with orbax: pip install 'napkin-cat[llama]' (orbax-checkpoint)"
        ) from e
    return ocp


def save(path: Path, cfg: Config, state: dict) -> None:
    """Write ``state`` with orbax to ``path/state`` and ``cfg`` to ``path/config.json`` (replacing any there).

    >>> import tempfile
    >>> cfg = CONFIGS["tiny"]
    >>> state = init_state(Llama(cfg, rngs=nnx.Rngs(0)), optimizer(Run()))
    >>> with tempfile.TemporaryDirectory() as d:
    ...     save(Path(d), cfg, state)
    ...     back, again = restore(Path(d))
    >>> back == cfg, jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), state, again))
    (True, True)
    """
    ocp = _orbax()
    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path / "state", state, force=True)


def restore(path: Path, run: Run = Run()) -> tuple[Config, dict]:
    """The config and training state :func:`save` wrote to ``path`` (the optimiser's state laid out as ``run``'s)."""
    ocp = _orbax()
    path = Path(path).absolute()
    cfg = Config(**json.loads((path / "config.json").read_text()))
    like = jax.eval_shape(lambda: init_state(Llama(cfg, rngs=nnx.Rngs(0)), optimizer(run)))
    with ocp.StandardCheckpointer() as checkpointer:
        return cfg, checkpointer.restore(path / "state", like)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=tuple(CONFIGS), default="small")
    p.add_argument("--attention", choices=ATTENTIONS, default="napkin")
    p.add_argument("--backend", default="auto", help="napkin-cat's backend: auto, triton, mosaic or xla")
    p.add_argument("--loss", choices=LOSSES, default="logits")
    for field in dataclasses.fields(Run):
        p.add_argument("--" + field.name, type=type(field.default), default=field.default)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--checkpoint", type=Path, help="save the final state here (orbax); resume from it if present")
    return p.parse_args(argv)


def main(argv=None) -> list[float]:
    """Train from the command line; the losses."""
    opts = parse_args(argv)
    cfg, run = CONFIGS[opts.config], Run(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(Run)})
    state = None
    if opts.checkpoint is not None and (opts.checkpoint / "state").exists():
        cfg, state = restore(opts.checkpoint, run)
        print(f"resumed from {opts.checkpoint} at step {int(state['step'])}")
    params = parameter_count(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    print(f"{opts.config}: {params:,} parameters, attention={opts.attention}, loss={opts.loss}, {jax.devices()[0]}")
    kw = dict(attention=opts.attention, backend=opts.backend, loss=opts.loss, log_every=opts.log_every, state=state)
    state, losses = train(cfg, run, **kw)
    if opts.checkpoint is not None:
        save(opts.checkpoint, cfg, state)
        print(f"saved to {opts.checkpoint}")
    return losses


if __name__ == "__main__":
    main()
