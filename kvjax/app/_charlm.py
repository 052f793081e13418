"""The demo's tiny character-level language model: tokenizer, training with optax, weights I/O.

The model is the reference Llama of :mod:`kvjax.nn._llama`, trained on ``kvjax/app/data/corpus.txt``
(docstrings of the Python standard library, PSF licence). ``python -m kvjax train`` reproduces
the committed weights ``kvjax/app/data/charlm.npz`` (a few minutes on a laptop CPU); when that file is
missing, :func:`load` returns a model with random weights and says so.

Example:
    >>> tok = CharTokenizer("abc")
    >>> tok.encode("cab").tolist(), tok.decode([3, 1, 2])
    ([3, 1, 2], 'cab')
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from typing import Optional, Tuple

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from kvjax.nn._llama import Llama, LlamaConfig
from kvjax.nn._pretrained import _all_loaded

DATA = pathlib.Path(__file__).resolve().parent / "data"
CORPUS = DATA / "corpus.txt"
WEIGHTS = DATA / "charlm.npz"


class CharTokenizer:
    """Characters to ids; id 0 stands for any character outside the vocabulary."""

    def __init__(self, chars: str):
        self.chars = "".join(sorted(set(chars)))
        self._index = {c: i + 1 for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([self._index.get(c, 0) for c in text], np.int32)

    def decode(self, ids) -> str:
        return "".join(self.chars[i - 1] if 0 < i <= len(self.chars) else "?" for i in np.asarray(ids).tolist())


def model_config(vocab_size: int) -> LlamaConfig:
    """The demo model's sizes: 4 layers, width 128, 4 query heads over 2 kv heads."""
    return LlamaConfig(vocab_size=vocab_size, d_model=128, n_layer=4, n_heads=4, n_kv_heads=2)


def read_corpus() -> str:
    text = CORPUS.read_text()
    return text.split("\n\n", 1)[1] if text.startswith("#") else text  # drop the provenance line


@dataclasses.dataclass
class TrainResult:
    model: Llama
    tokenizer: CharTokenizer
    losses: list
    seconds: float


def train(
    steps: int = 1500,
    *,
    seq_len: int = 96,
    batch: int = 16,
    lr: float = 3e-3,
    seed: int = 0,
    out: Optional[pathlib.Path] = WEIGHTS,
    progress: bool = True,
    config: Optional[LlamaConfig] = None,
) -> TrainResult:
    """Train the demo model on the bundled corpus and save its weights.

    Args:
        steps: optimizer steps.
        seq_len: characters per training window.
        batch: windows per step.
        lr: peak learning rate (warm-up then cosine decay, AdamW).
        seed: initial weights and window sampling.
        out: where to save the weights (``None``: do not save).
        progress: show a progress bar.
        config: the model's sizes (default :func:`model_config`; its ``vocab_size`` must be the
            corpus tokenizer's), e.g. a smaller draft model for speculative decoding.
    """
    text = read_corpus()
    tok = CharTokenizer(text)
    data = tok.encode(text)
    config = model_config(tok.vocab_size) if config is None else config
    if config.vocab_size != tok.vocab_size:
        raise ValueError(
            f"config.vocab_size={config.vocab_size} is out of range: allowed the corpus vocabulary {tok.vocab_size}"
        )
    model = Llama(config, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, min(100, steps // 10 + 1), steps, lr / 10)
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule)), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, windows):
        def loss_fn(model):
            logits = model.forward(windows[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, 1:]).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    rng = np.random.default_rng(seed)
    losses = []
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="training the demo model", unit="step", disable=not progress)
    for i in bar:
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
        windows = jnp.asarray(np.stack([data[s : s + seq_len + 1] for s in starts]))
        losses.append(float(step(model, optimizer, windows)))
        if i % 20 == 0:
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.3f}")
    seconds = time.perf_counter() - t0
    if out is not None:
        save(model, tok, out, meta={"steps": steps, "final_loss": float(np.mean(losses[-50:]))})
    return TrainResult(model, tok, losses, seconds)


def save(model: Llama, tok: CharTokenizer, path: pathlib.Path, meta: Optional[dict] = None) -> None:
    """Weights as float16 numpy arrays (small enough to commit), plus the vocabulary."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    arrays = {"/".join(map(str, k)): np.asarray(v.get_value(), np.float16) for k, v in flat}
    arrays["__vocab__"] = np.frombuffer(tok.chars.encode(), np.uint8)
    for key, value in (meta or {}).items():
        arrays[f"__meta__{key}"] = np.asarray(value)
    path = pathlib.Path(path)
    tmp = path.with_suffix(".tmp.npz")
    np.savez_compressed(tmp, **arrays)
    tmp.replace(path)


def load(path: pathlib.Path = WEIGHTS, *, verbose: bool = True) -> Tuple[Llama, CharTokenizer, bool]:
    """The demo model: trained weights when ``path`` exists, random weights (with a message) otherwise.

    Returns:
        ``(model, tokenizer, trained)``.
    """
    path = pathlib.Path(path)
    if not path.exists():
        tok = CharTokenizer(read_corpus())
        if verbose:
            print(
                f"note: {path} not found, using random weights (text will be gibberish); "
                f"run `python -m kvjax train` to train the demo model"
            )
        return Llama(model_config(tok.vocab_size), rngs=nnx.Rngs(0)), tok, False
    with np.load(path) as f:
        arrays = dict(f)
    tok = CharTokenizer(arrays.pop("__vocab__").tobytes().decode())
    # shapes only: a random init would compile and run its initializers just to be overwritten
    model = nnx.eval_shape(lambda: Llama(model_config(tok.vocab_size), rngs=nnx.Rngs(0)))
    # the flat state's variables are the model's own: setting them updates the model in place
    for key, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        name = "/".join(map(str, key))
        if name not in arrays or arrays[name].shape != var.get_value().shape:
            raise ValueError(
                f"weights file {path} does not match the model at {name}: retrain with `python -m kvjax train`"
            )
        var.set_value(jnp.asarray(arrays[name], jnp.float32))
    _all_loaded(model, path)
    return model, tok, True
