"""The small transformer of papers/flash_attention: a few training steps on CPU at tiny sizes."""

import doctest
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `papers` is a namespace package

from papers.flash_attention import transformer as tf  # noqa: E402

CFG = tf.ModelConfig(vocab=len(tf.VOCAB), d_model=32, heads=2, layers=1, seq=32)


def test_corpus_round_trips():
    assert len(tf.CORPUS) > 4000 and tf.decode(tf.encode(tf.CORPUS)) == tf.CORPUS


def test_attention_is_causal():
    """Changing the last token must not change the logits at earlier positions."""
    params = tf.init(jax.random.key(0), CFG)
    tokens = tf.encode(tf.CORPUS[:32])[None]
    forward = jax.jit(tf.forward, static_argnums=(2, 3))
    attn = tf.attention("reference", head_dim=CFG.head_dim)
    a, b = forward(params, tokens, CFG, attn), forward(params, tokens.at[0, -1].set(0), CFG, attn)
    assert jnp.allclose(a[0, :-1], b[0, :-1], atol=1e-5) and not jnp.allclose(a[0, -1], b[0, -1])


def test_training_decreases_the_loss():
    run = tf.train(
        CFG, tf.attention("reference", head_dim=CFG.head_dim), steps=30, batch=8, lr=1e-2, log=lambda _: None
    )
    losses = run["losses"]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert run["held_out"][-1][1] < run["held_out"][0][1]


def test_training_through_the_napkin_entry_follows_the_reference():
    """Interpret mode: optax's Adam through nc.attention's lowered forward and backward kernels. The losses
    of the first 8 steps differed from jax.nn.dot_product_attention's by at most 4.8e-7 (f32, CPU)."""
    runs = [
        tf.train(CFG, tf.attention(name, head_dim=CFG.head_dim), steps=4, batch=8, lr=1e-2, log=lambda _: None)
        for name in ("napkin", "reference")
    ]
    napkin, reference = (r["losses"] for r in runs)
    assert napkin[-1] < napkin[0] - 0.3, napkin
    assert np.max(np.abs(np.subtract(napkin, reference))) <= 1e-5, (napkin, reference)


def test_main_writes_json_and_records_unavailable_attention(tmp_path, monkeypatch):
    def missing(spec):
        raise RuntimeError("not lowered yet")

    monkeypatch.setitem(tf.ATTENTIONS, "napkin", missing)
    res = tf.main(["--quick", "--steps=3", "--attention=both", f"--out-dir={tmp_path}"])
    saved = json.loads((tmp_path / "transformer_quick.json").read_text())
    assert saved["runs"]["reference"]["status"] == "ok" and len(saved["runs"]["reference"]["losses"]) == 3
    assert saved["runs"]["napkin"] == {"status": "error", "error": res["runs"]["napkin"]["error"]}
    assert "not lowered yet" in saved["runs"]["napkin"]["error"]
    assert (tmp_path / "transformer_quick.png").stat().st_size > 0


def test_doctests():
    result = doctest.testmod(tf)
    assert result.failed == 0 and result.attempted > 0
