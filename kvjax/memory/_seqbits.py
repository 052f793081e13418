"""Sequence bitmasks: the one place that knows how a set of sequence ids is stored.

A cell's sequences are ``W = ceil(n_seq_max / 32)`` little-endian ``uint32`` words; sequence ``s``
is bit ``s % 32`` of word ``s // 32``. Device functions (jnp, traceable) build and test masks;
host functions (numpy) unpack them for inspection and the state format.

Example:
    >>> import numpy as np
    >>> words = seq_bits(jnp.array([0, 33]), 2)            # one mask per id
    >>> words.tolist()
    [[1, 0], [0, 2]]
    >>> unpack(np.asarray(words), 35)[1].nonzero()[0].tolist()
    [33]
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from kvjax._typing import Array, Bool, Int, UInt32

BITS = 32


def n_words(n_seq_max: int) -> int:
    """W, the words per mask for ``n_seq_max`` sequence ids."""
    return -(-int(n_seq_max) // BITS)


def seq_bits(seq_id: Int[Array, "..."], n_words: int) -> UInt32[Array, "... W"]:
    """Masks with only ``seq_id``'s bit set (all zero for an id < 0 or >= 32 W).

    Example:
        >>> seq_bits(jnp.int32(33), 2).tolist()
        [0, 2]
    """
    seq_id = jnp.asarray(seq_id, jnp.int32)
    word = jnp.arange(n_words, dtype=jnp.int32)
    bit = jnp.left_shift(jnp.uint32(1), (seq_id % BITS).astype(jnp.uint32))[..., None]
    hit = (seq_id[..., None] // BITS == word) & (seq_id[..., None] >= 0)
    return jnp.where(hit, bit, jnp.uint32(0))


def ids_mask(ids: Int[Array, "T M"], n_words: int) -> UInt32[Array, "T W"]:
    """The union of each row's ids (-1 entries add nothing).

    Example:
        >>> ids_mask(jnp.array([[0, 2], [1, -1]]), 1).tolist()
        [[5], [2]]
    """
    return jnp.bitwise_or.reduce(seq_bits(ids, n_words), axis=-2)


def holds(words: UInt32[Array, "W N"], seq_id: Int[Array, " T"]) -> Bool[Array, "T N"]:
    """Whether each of ``N`` masks (stored word-major, ``[W, N]``) holds each row's ``seq_id``.

    An id < 0 or >= 32 W is held by no mask. Reads one word per row (a gather), not all W.

    Example:
        >>> holds(jnp.array([[1, 2, 3]], jnp.uint32), jnp.array([0, 1, -1])).tolist()
        [[True, False, True], [False, True, True], [False, False, False]]
    """
    w = words.shape[0]
    word = jnp.where(seq_id >= 0, seq_id // BITS, w)  # -1 reads no word at all
    row = jnp.take(words, word, axis=0, mode="fill", fill_value=0)  # [T, N]
    bit = (seq_id % BITS).astype(jnp.uint32)[:, None]
    return ((row >> bit) & jnp.uint32(1)) != 0


# -- host (numpy) --------------------------------------------------------------------------------


def unpack(words: np.ndarray, n_seq_max: int) -> np.ndarray:
    """``bool[C, S]`` membership from ``u32[C, W]`` masks (host)."""
    words = np.ascontiguousarray(words, "<u4")
    bits = np.unpackbits(words.view(np.uint8).reshape(words.shape[0], -1), axis=1, bitorder="little")
    return bits[:, :n_seq_max].astype(bool)


def host_holds(words: np.ndarray, seq_id: int) -> np.ndarray:
    """``bool[C]``: masks holding ``seq_id`` (any sequence when -1) (host)."""
    if seq_id < 0:
        return words.any(axis=1)
    return ((words[:, seq_id // BITS] >> np.uint32(seq_id % BITS)) & 1).astype(bool)


def host_without(words: np.ndarray, seq_id: int) -> np.ndarray:
    """A copy of ``words`` with ``seq_id`` removed from every mask (host)."""
    out = words.copy()
    out[:, seq_id // BITS] &= ~np.uint32(1 << (seq_id % BITS))
    return out


def host_pack(cell: np.ndarray, ids: np.ndarray, n: int, n_words: int) -> np.ndarray:
    """``u32[n, W]`` masks with bit ``ids[i]`` set in row ``cell[i]`` (host)."""
    masks = np.zeros((n, n_words), np.uint32)
    np.bitwise_or.at(masks, (cell, ids // BITS), np.left_shift(np.uint32(1), (ids % BITS).astype(np.uint32)))
    return masks
