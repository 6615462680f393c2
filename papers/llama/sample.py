"""Sample from the decoder of :mod:`papers.llama.model`, greedy or at a temperature, under ``jax.jit``.

With a key/value cache (the default): the prompt runs once through the model (``Llama.prefill``: napkin-cat's
``nc.attention``), then each new token once (``Llama.decode``: ``nc.decode_attention`` over the cache, split
across the SMs), in one ``lax.scan``. With ``cache=False``, prefill-only attention: each new token reruns the
model over the whole buffer (prompt, the tokens sampled so far, and the zeros still to fill, which causal
attention keeps from reaching earlier positions), so every step calls the same kernel at the same length.
``python -m papers.llama.sample --checkpoint DIR --prompt "Alice"`` samples from a model that ``python -m
papers.llama.train --checkpoint DIR`` saved.

>>> from papers.llama.model import CONFIGS
>>> model = Llama(CONFIGS["tiny"], attention="reference", rngs=nnx.Rngs(0))
>>> prompt = encode("Alice")[None]
>>> out = generate(model, prompt, 6)
>>> out.shape, bool(jnp.all(out[:, :5] == prompt)), bool(jnp.all(out == generate(model, prompt, 6, cache=False)))
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


def generate(model: Llama, prompt, steps: int, *, temperature: float = 0.0, key=None, cache: bool = True):
    """``prompt`` ``[batch, n]`` (token ids) followed by ``steps`` sampled tokens, ``[batch, n + steps]``: the most
    likely token at each step where ``temperature`` is 0, else one drawn from ``softmax(logits / temperature)``
    with ``key`` (the same draws with and without ``cache``: see the module).

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
    if steps < 1:
        return prompt
    return (_cached if cache else _generate)(graphdef, params, prompt, key, steps, float(temperature))


def _pick(logits, key, temperature: float):
    """The next token of each row: the argmax at temperature 0, else a draw from ``key`` (one per step)."""
    key, draw = jax.random.split(key)
    if temperature == 0:
        return jnp.argmax(logits, axis=-1), key
    return jax.random.categorical(draw, logits / temperature, axis=-1), key


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _cached(graphdef, params, prompt, key, steps: int, temperature: float):
    model = nnx.merge(graphdef, params)
    logits, caches = model.prefill(prompt, model.init_caches(prompt.shape[0], prompt.shape[1] + steps))
    first, key = _pick(logits, key, temperature)

    def one(carry, _):  # the token picked last goes through the model; the next is picked from its logits
        token, caches, key = carry
        logits, caches = model.decode(token[:, None].astype(prompt.dtype), caches)
        nxt, key = _pick(logits, key, temperature)
        return (nxt, caches, key), token

    (last, _, _), tokens = jax.lax.scan(one, (first, caches, key), None, length=steps - 1)
    return jnp.concatenate([prompt, tokens.T.astype(prompt.dtype), last[:, None].astype(prompt.dtype)], axis=1)


@functools.partial(jax.jit, static_argnums=(0, 4, 5))
def _generate(graphdef, params, prompt, key, steps: int, temperature: float):
    model = nnx.merge(graphdef, params)
    batch, n = prompt.shape
    buffer = jnp.concatenate([prompt, jnp.zeros((batch, steps), prompt.dtype)], axis=1)
    w = model.classifier()

    def one(t, carry):
        buffer, key = carry
        h = jax.lax.dynamic_index_in_dim(model.hidden(buffer), t - 1, axis=1, keepdims=False)
        token, key = _pick((h @ w).astype(jnp.float32), key, temperature)
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
    p.add_argument("--no-cache", action="store_true", help="rerun the whole buffer per token (no KV cache)")
    opts = p.parse_args(argv)
    cfg, state = restore(opts.checkpoint)
    model = model_of(cfg, state, attention=opts.attention, backend=opts.backend)
    tokens = generate(
        model, encode(opts.prompt)[None], opts.steps, temperature=opts.temperature, key=jax.random.key(opts.seed),
        cache=not opts.no_cache,
    )
    text = decode(tokens[0])
    print(text)
    return text


if __name__ == "__main__":
    main()
