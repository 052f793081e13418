"""The demo model: committed weights load and predict the corpus; the random fallback says so."""

import pathlib

import jax.numpy as jnp
import numpy as np
import optax

from kvjax.app import _charlm as charlm


def test_committed_weights_load_and_model_the_text():
    model, tok, trained = charlm.load()
    assert trained, "kvjax/app/data/charlm.npz should be committed; retrain with `python -m kvjax train`"
    text = charlm.read_corpus()
    windows = jnp.asarray(np.stack([tok.encode(text[s : s + 97]) for s in range(5_000, 200_000, 24_000)]))
    logits = model.forward(windows[:, :-1])  # windows of the training length (96 characters)
    loss = float(optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean())
    assert loss < 1.4, loss  # a random model is at ~log(97) = 4.6


def test_missing_weights_fall_back_to_random(tmp_path, capsys):
    model, tok, trained = charlm.load(tmp_path / "missing.npz")
    assert not trained and "random weights" in capsys.readouterr().out
    assert model.config.vocab_size == tok.vocab_size


def test_save_load_round_trip(tmp_path):
    model, tok, _ = charlm.load(verbose=False)
    path = pathlib.Path(tmp_path) / "w.npz"
    charlm.save(model, tok, path)
    again, tok2, trained = charlm.load(path)
    assert trained and tok2.chars == tok.chars
    x = jnp.asarray(tok.encode("def f(x):"))
    np.testing.assert_allclose(np.asarray(model.forward(x)), np.asarray(again.forward(x)), atol=1e-5)


def test_tokenizer_round_trip_and_unknown_chars():
    tok = charlm.CharTokenizer("ab")
    assert tok.decode(tok.encode("abba")) == "abba"
    assert tok.encode("z").tolist() == [0] and tok.decode([0]) == "?"
