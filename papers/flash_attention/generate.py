"""A model that generates: a small Flax NNX decoder whose prompt runs through ``nc.attention`` and whose tokens
are decoded one at a time through ``nc.decode_attention`` over a KV cache (contiguous or paged), greedily, in one
``jax.jit`` (a ``lax.scan`` over the steps, the caches its carry).

The same model built with ``attention_fn=jax.nn.dot_product_attention`` and run on the whole sequence at every
step (no cache) is the reference: its greedy tokens are the same.

>>> from flax import nnx
>>> model = TinyLM(vocab=32, features=32, heads=4, kv_heads=2, layers=2, max_len=16, rngs=nnx.Rngs(0))
>>> prompt = jax.random.randint(jax.random.key(1), (2, 5), 0, 32)
>>> tokens = generate(model, prompt, steps=3, page_size=4)
>>> tokens.shape
(2, 3)

    python papers/flash_attention/generate.py [--smoke] [--page-size 4]
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a file: find the package

from lowering import KVCache  # noqa: E402
from lowering._attention import attention  # noqa: E402
from lowering.modules import SelfAttention  # noqa: E402


class Block(nnx.Module):
    """Pre-norm: ``x + attention(norm(x))``, then ``x + mlp(norm(x))`` (GELU, 4× wide)."""

    def __init__(self, features: int, heads: int, kv_heads: int, *, attention_fn, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(features, rngs=rngs), nnx.LayerNorm(features, rngs=rngs)
        self.attention = SelfAttention(features, heads, kv_heads=kv_heads, causal=True, attention_fn=attention_fn,
                                       rngs=rngs)  # fmt: skip
        self.up = nnx.Linear(features, 4 * features, rngs=rngs)
        self.down = nnx.Linear(4 * features, features, rngs=rngs)

    def mlp(self, x):
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    def __call__(self, x):
        return self.mlp(x + self.attention(self.norm1(x)))

    def step(self, x, cache: KVCache, prefill: bool):
        y, cache = (self.attention.prefill if prefill else self.attention.decode)(self.norm1(x), cache)
        return self.mlp(x + y), cache


class TinyLM(nnx.Module):
    """Token and learned position embeddings, ``layers`` blocks, a final norm and an unembedding.

    ``model(tokens)`` is the whole causal forward ``[B, N] → [B, N, vocab]``; :meth:`prefill` and :meth:`decode`
    are the same forward split at a KV cache (one :class:`~lowering.KVCache` per block)."""

    def __init__(self, vocab, features, heads, kv_heads, layers, max_len, *, attention_fn=attention, rngs: nnx.Rngs):
        self.embed, self.position = nnx.Embed(vocab, features, rngs=rngs), nnx.Embed(max_len, features, rngs=rngs)
        self.blocks = nnx.List([Block(features, heads, kv_heads, attention_fn=attention_fn, rngs=rngs)
                                for _ in range(layers)])  # fmt: skip
        self.norm, self.head = nnx.LayerNorm(features, rngs=rngs), nnx.Linear(features, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def init_caches(self, batch: int, max_len: int, page_size: int | None = None) -> list[KVCache]:
        """An empty cache per block, paged with ``page_size``."""
        return [b.attention.init_cache(batch, max_len, page_size=page_size) for b in self.blocks]

    def prefill(self, tokens, caches):
        """The prompts ``[B, N]`` (one length) into empty caches: logits ``[B, N, vocab]`` and the caches."""
        return self._run(tokens, jnp.arange(tokens.shape[1])[None], caches, prefill=True)

    def decode(self, tokens, caches):
        """The next tokens ``[B, Nq]`` at positions ``caches[0].lengths …``: logits and the caches."""
        positions = caches[0].lengths[:, None] + jnp.arange(tokens.shape[1])[None]
        return self._run(tokens, positions, caches, prefill=False)

    def _run(self, tokens, positions, caches, prefill: bool):
        x, out = self.embed(tokens) + self.position(positions), []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, cache = block.step(x, cache, prefill)
            out.append(cache)
        return self.head(self.norm(x)), out


def generate(model: TinyLM, prompt, steps: int, *, page_size: int | None = None):
    """Greedy decoding: ``steps`` tokens ``[B, steps]`` after the prompts ``[B, N]``, in one ``jax.jit``: the
    prefill, then a ``lax.scan`` of decode steps whose carry is the last token and the caches."""
    graph, state = nnx.split(model)
    return _generate(graph, state, prompt, steps, page_size)


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _generate(graph, state, prompt, steps: int, page_size: int | None):
    model = nnx.merge(graph, state)
    logits, caches = model.prefill(prompt, model.init_caches(prompt.shape[0], prompt.shape[1] + steps, page_size))

    def step(carry, _):
        token, caches = carry
        logits, caches = model.decode(token[:, None], caches)
        return (jnp.argmax(logits[:, -1], axis=-1), caches), token

    _, tokens = lax.scan(step, (jnp.argmax(logits[:, -1], axis=-1), caches), None, length=steps)
    return tokens.T


def greedy_reference(model: TinyLM, prompt, steps: int):
    """Greedy decoding with no cache: the whole sequence through ``model`` at every step (its own attention)."""
    forward, tokens = nnx.jit(lambda m, t: m(t)), prompt
    for _ in range(steps):
        tokens = jnp.concatenate([tokens, jnp.argmax(forward(model, tokens)[:, -1], axis=-1)[:, None]], axis=1)
    return tokens[:, prompt.shape[1] :]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU runs them in interpret mode)")
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    o = p.parse_args(argv)
    sizes = dict(vocab=64, features=32, heads=4, kv_heads=2, layers=2) if o.smoke else \
        dict(vocab=4096, features=512, heads=8, kv_heads=2, layers=4)  # fmt: skip
    steps, prompt_len = o.steps or (4 if o.smoke else 64), 8 if o.smoke else 128
    kw = dict(sizes, max_len=prompt_len + steps)
    model = TinyLM(**kw, rngs=nnx.Rngs(0))
    same = TinyLM(**kw, attention_fn=jax.nn.dot_product_attention, rngs=nnx.Rngs(0))
    prompt = jax.random.randint(jax.random.key(1), (2, prompt_len), 0, sizes["vocab"])
    got, want = generate(model, prompt, steps, page_size=o.page_size), greedy_reference(same, prompt, steps)
    print(f"napkin-cat (prefill nc.attention, decode nc.decode_attention, page_size {o.page_size}):", got.tolist())
    print("jax.nn.dot_product_attention, no cache:", want.tolist(), "equal:", bool(jnp.all(got == want)))


if __name__ == "__main__":
    main()
