"""KQ masks and T5 relative position buckets between the cells and the tokens of a ubatch.

The seed builds the mask on the host, cell by cell, in ``set_input_kq_mask``. Here it is one
fused elementwise program over ``[T, N]`` (tokens x the first ``N = n_kv`` cells), built on the
device from the cells' ``(pos, seq)`` and the ubatch's ``(pos, seq0)``, so one compilation serves
every cell state, ubatch and position.

A cell ``i`` is visible to token ``j`` when all of these hold (``p0`` the cell's position, ``p1``
the token's)::

    the cell holds the token's first sequence ubatch.seq0[j]   (an empty cell holds none)
    not (causal and p0 > p1)                                   (no future cells)
    not is_masked_swa(p0, p1)                                  (p0 < 0, or outside the window)

with the sliding-window kinds of :class:`kvjax.SwaType`:

    ========== =====================================
    none       never masked
    standard   masked when ``p1 - p0 >= n_swa``
    chunked    masked when ``p0 < (p1 // n_swa) * n_swa``
    symmetric  masked when ``|p1 - p0| > n_swa // 2``
    ========== =====================================

The additive mask is 0 for visible entries (``-|p0 - p1|`` with ALiBi) and ``-inf`` otherwise;
padded ubatch rows are ``-inf`` everywhere. A picture, 2 cells of sequence 0 already cached and a
3-token ubatch of sequence 0 placed after them (``x`` visible, ``-`` masked)::

    causal        non-causal
    xxx-----      xxxxx---
    xxxx----      xxxxx---
    xxxxx---      xxxxx---

Differences from the seed: the mask has exactly ``T`` rows (the ubatch's static length bucket,
whose invalid rows are the padded ones) instead of ``GGML_PAD(n_tokens, GGML_KQ_MASK_PAD)`` rows,
because the JAX attention consumes ``[T, N]`` directly; and the symmetric window of newer llama.cpp
is supported. Everything else follows the seed's loops exactly.

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [1]])
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> kvjax.kq_mask_bool(cache, ub, 32)[:3, :4].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0]]
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Bool, Int
from kvjax.memory._seqbits import holds
from kvjax.memory._cells import Cells
from kvjax.memory._config import SwaType
from kvjax.memory._ubatch import Ubatch

#: T5's default ``max_distance`` (the seed hard-codes 128 as well).
T5_MAX_DISTANCE = 128

# The formulas below take the cells and the ubatch as arrays; the public functions of a cache
# (kvjax.kq_mask, kq_mask_bool, pos_bucket) validate it and call them (kvjax.memory._part_ops).


# -- building blocks ----------------------------------------------------------------------------


def is_masked_swa(p0: Int[Array, "..."], p1: Int[Array, "..."], swa_type: SwaType, n_swa: int) -> Bool[Array, "..."]:
    """The seed's ``is_masked_swa`` (plus the symmetric kind), elementwise on broadcast arrays.

    ``p0`` is the cell's position (``< 0`` for an empty cell: always masked), ``p1`` the token's.

    Example:
        >>> import jax.numpy as jnp
        >>> p0 = jnp.arange(6)
        >>> is_masked_swa(p0, 5, SwaType.STANDARD, 3).astype(int).tolist()
        [1, 1, 1, 0, 0, 0]
        >>> is_masked_swa(p0, 5, SwaType.CHUNKED, 4).astype(int).tolist()
        [1, 1, 1, 1, 0, 0]
    """
    swa_type = SwaType(swa_type)
    masked = p0 < 0
    if swa_type == SwaType.STANDARD:
        masked = masked | (p1 - p0 >= n_swa)
    elif swa_type == SwaType.CHUNKED:
        masked = masked | (p0 < (p1 // n_swa) * n_swa)
    elif swa_type == SwaType.SYMMETRIC:
        half = n_swa // 2
        masked = masked | (jnp.abs(p1 - p0) > half)
    return masked


def _member(cells: Cells, n_kv: int, seq0: Int[Array, " T"]) -> Bool[Array, "T N"]:
    """Whether each of the first ``n_kv`` cells holds each token's sequence (False for id < 0)."""
    return holds(cells.seq[:n_kv].T, seq0)  # padding (-1) and ids >= 32 W: held by no cell


def _visible(
    cells: Cells, ubatch: Ubatch, n_kv: int, causal: bool, swa_type: SwaType, n_swa: int
) -> Bool[Array, "T N"]:
    p0 = cells.pos[:n_kv][None, :]
    p1 = jnp.asarray(ubatch.pos, jnp.int32)[:, None]
    seq0 = jnp.asarray(ubatch.seq0, jnp.int32)
    visible = _member(cells, n_kv, seq0) & ~is_masked_swa(p0, p1, swa_type, n_swa)
    if causal:
        visible = visible & (p0 <= p1)
    return visible


@functools.partial(jax.jit, static_argnames=("n_kv", "causal", "swa_type", "n_swa"))
def _mask_bool(cells, ubatch, n_kv, causal, swa_type, n_swa):
    return _visible(cells, ubatch, n_kv, causal, swa_type, n_swa)


@functools.partial(jax.jit, static_argnames=("n_kv", "causal", "alibi", "swa_type", "n_swa"))
def _mask_additive(cells, ubatch, n_kv, causal, alibi, swa_type, n_swa):
    visible = _visible(cells, ubatch, n_kv, causal, swa_type, n_swa)
    if alibi:
        dist = jnp.abs(cells.pos[:n_kv][None, :] - jnp.asarray(ubatch.pos, jnp.int32)[:, None])
        value = (-dist).astype(jnp.float32)  # negate the integer, as the seed: +0.0 at distance 0
    else:
        value = jnp.float32(0)
    return jnp.where(visible, value, -jnp.inf).astype(jnp.float32)


def _relative_bucket(
    rel: Int[Array, "..."], n_buckets: int, bidirectional: bool, max_distance: int
) -> Int[Array, "..."]:
    """T5's bucket of ``rel = memory_position - query_position``.

    Half of the (per-direction) buckets hold exact distances ``0 .. max_exact - 1``; the rest are
    logarithmically spaced up to ``max_distance``, beyond which everything shares the last bucket.
    Bidirectional: the buckets are split in two halves, the upper half for ``rel > 0``.
    """
    bucket = jnp.zeros_like(rel)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + jnp.where(rel > 0, n_buckets, 0)
        dist = jnp.abs(rel)
    else:
        dist = -jnp.minimum(rel, 0)
    max_exact = n_buckets // 2
    safe = jnp.maximum(dist, 1).astype(jnp.float32)
    log_ratio = jnp.log(safe / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + jnp.floor(log_ratio * (n_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, n_buckets - 1)
    return (bucket + jnp.where(dist < max_exact, dist, large)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("n_kv", "n_buckets", "bidirectional", "max_distance"))
def _pos_bucket(cells, ubatch, n_kv, n_buckets, bidirectional, max_distance):
    rel = cells.pos[:n_kv][None, :] - jnp.asarray(ubatch.pos, jnp.int32)[:, None]
    # an empty cell (-1) against a token at 2**31 - 1 (a hand-built ubatch: make_ubatch refuses it)
    # gives -2**31, whose distance does not fit int32: any distance that far shares the last bucket
    rel = jnp.maximum(rel, -jnp.iinfo(jnp.int32).max)
    return _relative_bucket(rel, n_buckets, bidirectional, max_distance)
