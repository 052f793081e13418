"""Per-request sampling and logprobs for the rows of one step, a few programs for all of them.

Every request of a step owns one logits row. Its token must depend on its own seed, its own
sampling rule and its row only (never on the other requests of the step), so each row draws
with ``fold_in(PRNGKey(seed), k)`` for its ``k``-th token. Rows are gathered into power-of-two
buckets so that the number of requests in a step compiles a handful of programs, not one per count.

Shapes: ``R`` rows of the step's logits, ``B`` a bucket of rows (a power of two), ``V`` vocabulary.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax._typing import Array, Float, Int
from kvjax.engine._sampling import SamplingConfig, filter_logits
from kvjax.memory._ubatch import bucket_length
from kvjax.serve._request import MAX_LOGPROBS, TokenLogprob

__all__ = ["sample_rows", "pick_tokens", "row_logprobs"]


@functools.partial(jax.jit, static_argnames="config")
def sample_rows(
    logits: Float[Array, "B V"], seeds: Int[Array, " B"], counts: Int[Array, " B"], config: SamplingConfig
) -> Int[Array, " B"]:
    """One token per row, row ``b`` drawn with ``fold_in(PRNGKey(seeds[b]), counts[b])``.

    Example:
        >>> import numpy as np
        >>> logits = np.log(np.array([[0.5, 0.5], [0.5, 0.5]], np.float32))
        >>> a = sample_rows(logits, np.uint32([7, 7]), np.int32([0, 0]), SamplingConfig(temperature=1.0))
        >>> bool(a[0] == a[1])                       # same seed and count: the same draw
        True
    """
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counts)
    filtered = filter_logits(logits, config)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, filtered).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="config")
def _sample_at(logits: Float[Array, "R V"], index: Int[Array, " B"], seeds, counts, config: SamplingConfig):
    """:func:`sample_rows` of the rows ``index`` of ``logits``: the gather inside the program (an
    eager gather of a device array costs about 0.6 ms of host time a step on CPU)."""
    return sample_rows(logits[index], seeds, counts, config)


@jax.jit
def _logprobs(logits: Float[Array, "R V"], index: Int[Array, " B"], tokens: Int[Array, " B"]):
    logits = logits[index]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, min(MAX_LOGPROBS, logits.shape[-1]))
    return chosen, top_lp, top_ids


def _bucket(rows: Sequence[int]) -> np.ndarray:
    """``rows`` padded to a power-of-two length by repeating the last one."""
    out = np.full(bucket_length(len(rows)), rows[-1], np.int32)
    out[: len(rows)] = rows
    return out


def pick_tokens(logits: Float[Array, "R V"], rules: Sequence[Tuple[SamplingConfig, int, int]]) -> List[int]:
    """The token of every row: ``rules[r] = (sampling, seed, count)`` for row ``r``.

    Rows sharing a sampling rule are drawn in one call (greedy rows: one argmax of them all).
    """
    groups: Dict[SamplingConfig, List[int]] = {}
    for r, (config, _, _) in enumerate(rules):
        groups.setdefault(SamplingConfig(temperature=0.0) if config.greedy else config, []).append(r)
    picked = np.zeros(len(rules), np.int64)
    for config, rows in groups.items():
        index = _bucket(rows)
        seeds = np.array([rules[r][1] for r in index], np.uint32)
        counts = np.array([rules[r][2] for r in index], np.int32)
        got = np.asarray(_sample_at(logits, index, seeds, counts, config))
        picked[rows] = got[: len(rows)]
    return picked.tolist()


def row_logprobs(logits: Float[Array, "R V"], rows: Sequence[int], tokens: Sequence[int], n_top: Sequence[int]):
    """:class:`TokenLogprob` of ``tokens[i]`` under row ``rows[i]``, with its ``n_top[i]`` best alternatives."""
    index = _bucket(rows)
    toks = np.zeros(len(index), np.int32)
    toks[: len(tokens)] = tokens
    toks[len(tokens) :] = tokens[-1]
    chosen, top_lp, top_ids = jax.device_get(_logprobs(logits, index, toks))
    return [
        TokenLogprob(
            int(tokens[i]),
            float(chosen[i]),
            tuple((int(top_ids[i, j]), float(top_lp[i, j])) for j in range(min(n_top[i], top_ids.shape[1]))),
        )
        for i in range(len(rows))
    ]
