"""Token sampling: greedy, temperature, top-k and top-p, with an explicit PRNG key.

Shapes: ``B`` rows (sequences being sampled), ``V`` vocabulary.

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.1, 0.6, 0.3]]))
    >>> sample(logits, jax.random.PRNGKey(0), SamplingConfig(temperature=0.0)).tolist()
    [1]
    >>> sample(logits, jax.random.PRNGKey(0), SamplingConfig(top_k=1)).tolist()
    [1]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Float, Int
from kvjax._validate import check_count, check_real


#: The smallest positive temperature: below it logits / temperature can overflow float32.
MIN_TEMPERATURE = 1e-6


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        temperature: 0 for greedy (argmax); otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0: all).
        top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        # numpy / JAX scalars are numbers too (a value read from an array): kept as Python numbers,
        # so that equal configs hash alike as the static argument of a compiled sampler
        given = dataclasses.asdict(self)
        for name in ("temperature", "top_p"):
            object.__setattr__(self, name, check_real(name, given[name]))
        object.__setattr__(self, "top_k", check_count("top_k", given["top_k"], 0))
        if not (self.temperature == 0 or self.temperature >= MIN_TEMPERATURE):
            # logits divided by a tiny temperature overflow to inf, and inf - inf is NaN
            raise ValueError(
                f"temperature={given['temperature']} is out of range: allowed 0 (greedy) or >= {MIN_TEMPERATURE}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={given['top_p']} is out of range: allowed (0, 1] (1 = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filter_logits(logits: Float[Array, "B V"], config: SamplingConfig) -> Float[Array, "B V"]:
    """Logits with the tokens outside top-k / top-p set to -inf (temperature applied).

    The most likely token always survives, so a row never becomes all -inf.
    """
    logits = logits.astype(jnp.float32) / config.temperature
    if config.top_k == 0 and config.top_p >= 1:
        return logits
    order = jnp.argsort(-logits, axis=-1)
    ranked = jnp.take_along_axis(logits, order, axis=-1)
    keep = jnp.ones_like(ranked, dtype=bool)
    if config.top_k:
        keep &= jnp.arange(ranked.shape[-1]) < config.top_k
    if config.top_p < 1:
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        keep &= before < config.top_p
    keep = keep.at[..., 0].set(True)
    kept_ranked = jnp.where(keep, ranked, -jnp.inf)
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(kept_ranked, inverse, axis=-1)


@jax.jit
def _greedy(logits):
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def sample(logits: Float[Array, "B V"], key: jax.Array, config: SamplingConfig = SamplingConfig()) -> Int[Array, " B"]:
    """Draw one token per row.

    Args:
        logits: ``[B, V]`` unnormalized log-probabilities.
        key: PRNG key (split it between calls; the same key gives the same tokens).
        config: the sampling rule (static).

    Returns:
        ``i32[B]`` token ids.

    Raises:
        ValueError: ``config`` is not a :class:`SamplingConfig`.
    """
    if not isinstance(config, SamplingConfig):
        raise ValueError(
            f"config must be a kvjax.SamplingConfig, got {type(config).__name__}: make one with "
            f"kvjax.SamplingConfig(temperature=..., top_k=..., top_p=...)"
        )
    if config.greedy:
        return _greedy(logits)
    return _sample(logits, key, config)


@functools.partial(jax.jit, static_argnames="config")
def _sample(logits, key, config):
    return jax.random.categorical(key, filter_logits(logits, config), axis=-1).astype(jnp.int32)
