"""Sample from the decoder of :mod:`papers.llama.model`, greedy or at a temperature, under ``jax.jit``.

Prefill-only attention: each new token reruns the model over the whole buffer (prompt, the tokens sampled so
far, and the zeros still to fill, which causal attention keeps from reaching earlier positions), so every step
calls the same kernel at the same length, without a key/value cache. ``python -m papers.llama.sample
--checkpoint DIR --prompt "Alice"`` samples from a model that ``python -m papers.llama.train --checkpoint DIR``
saved.

>>> from papers.llama.model import CONFIGS
>>> model = Llama(CONFIGS["tiny"], attention="reference", rngs=nnx.Rngs(0))
>>> prompt = encode("Alice")[None]
>>> out = generate(model, prompt, 6)
>>> out.shape, bool(jnp.all(out[:, :5] == prompt)), bool(jnp.all(out == generate(model, prompt, 6)))
((1, 11), True, True)
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from napkin_cat.errors import EvaluationError
from papers.llama.model import ATTENTIONS, Llama
from papers.llama.train import decode, encode, model_of, restore


def generate(model: Llama, prompt, steps: int, *, temperature: float = 0.0, key=None):
    """``prompt`` ``[batch, n]`` (token ids) followed by ``steps`` sampled tokens, ``[batch, n + steps]``: the most
    likely token at each step where ``temperature`` is 0, else one drawn from ``softmax(logits / temperature)``
    with ``key``.

    >>> from papers.llama.model import CONFIGS
    >>> generate(Llama(CONFIGS["tiny"], rngs=nnx.Rngs(0)), encode("Alice")[None], 4, temperature=0.8)
    Traceback (most recent call last):
    ...
    napkin_cat.errors.EvaluationError: generate: temperature=0.8 samples at random: pass key= (a jax.random key)
    """
    if temperature < 0:
        raise EvaluationError(f"generate: temperature={temperature} must be ≥ 0 (0 is greedy)")
    if temperature > 0 and key is None:
        raise EvaluationError(f"generate: temperature={temperature} samples at random: pass key= (a jax.random key)")
    if prompt.ndim != 2 or prompt.shape[1] == 0:
        raise EvaluationError(f"generate: prompt of shape {prompt.shape}: pass token ids [batch, n] with n ≥ 1")
    graphdef, params = nnx.split(model)
    key = jax.random.key(0) if key is None else key
    return _generate(graphdef, params, prompt, key, steps, float(temperature))


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, params, prompt, key, steps: int, temperature: float):
    model = nnx.merge(graphdef, params)
    batch, n = prompt.shape
    buffer = jnp.concatenate([prompt, jnp.zeros((batch, steps), prompt.dtype)], axis=1)
    w = model.classifier()

    def one(t, carry):
        buffer, key = carry
        h = jax.lax.dynamic_index_in_dim(model.hidden(buffer), t - 1, axis=1, keepdims=False)
        logits = (h @ w).astype(jnp.float32)
        key, draw = jax.random.split(key)
        if temperature == 0:
            token = jnp.argmax(logits, axis=-1)
        else:
            token = jax.random.categorical(draw, logits / temperature, axis=-1)
        return jax.lax.dynamic_update_index_in_dim(buffer, token.astype(buffer.dtype), t, axis=1), key

    return jax.lax.fori_loop(n, n + steps, one, (buffer, key))[0]


def main(argv=None) -> str:
    """Sample from a checkpoint from the command line; the text."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True, help="a folder python -m papers.llama.train saved")
    p.add_argument("--prompt", default="Alice")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention", choices=ATTENTIONS, default="napkin")
    p.add_argument("--backend", default="auto")
    opts = p.parse_args(argv)
    cfg, state = restore(opts.checkpoint)
    model = model_of(cfg, state, attention=opts.attention, backend=opts.backend)
    tokens = generate(
        model, encode(opts.prompt)[None], opts.steps, temperature=opts.temperature, key=jax.random.key(opts.seed)
    )
    text = decode(tokens[0])
    print(text)
    return text


if __name__ == "__main__":
    main()
