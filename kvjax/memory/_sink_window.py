"""Sink + window eviction (StreamingLLM): a sequence keeps its first and its latest tokens, forever.

StreamingLLM (Xiao et al., 2023) generates without end in bounded memory by keeping the first
``n_sink`` tokens (the "attention sinks" every head leans on) and the latest ``n_recent``. llama.cpp
comes close with its context shift, which drops half of the context at once; kvjax's cells and
K-shift make the rule exact, one cell at a time: before each token is placed, the oldest token
after the sinks leaves. Two forms, chosen by :attr:`SinkWindow.compact`:

- **compacted** (the default, StreamingLLM's own): the evicted cell is removed and every later
  token of the sequence moves one position back (``seq_rm`` + ``seq_add``; the next
  :func:`kvjax.update` re-rotates their K by RoPE, exactly). A sequence then always sits at
  positions ``0 .. n_sink + n_recent - 1``: the model never sees a position it was not trained on.
  Needs a memory that can shift (:func:`kvjax.can_shift`).
- **masked** (``compact=False``, the form of llama.cpp's sink + window proposal): the evicted
  cell is only removed; positions keep growing, the K rows are never rotated again.

The rule for one sequence whose next token would go to position ``p`` and ``n_new`` tokens coming::

    compact:  e = clip(p + n_new - (n_sink + n_recent), 0, p - n_sink)
              seq_rm(s, n_sink, n_sink + e);  seq_add(s, n_sink + e, -1, -e);  p -> p - e
    masked:   seq_rm(s, n_sink, p + n_new - n_recent)        # positions kept: p unchanged

so that after the tokens are placed the sequence holds ``min(n_sink, .)`` sinks and its latest
``n_recent`` tokens: at most ``n_sink + n_recent`` cells. Everything is traced: new ids,
positions and sizes never recompile, and the device decode loop runs it inside its loop
(``kvjax/engine/_device_loop.py``).

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2,
    ...                         rope=kvjax.RopeConfig(n_rot=2))
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch(list(range(6)), [[0]] * 6))
    >>> window = kvjax.SinkWindow(n_sink=2, n_recent=4)     # holds 6: the next token evicts position 2
    >>> cache, next_pos = kvjax.sink_window_evict(cache, 0, 6, window)
    >>> int(next_pos), sorted(kvjax.cell_table(cache).pos[kvjax.cell_table(cache).pos >= 0].tolist())
    (5, [0, 1, 2, 3, 4])
    >>> kvjax.has_shift(cache).item()                         # positions 3..5 moved back: K to re-rotate
    True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Tuple

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Int
from kvjax._validate import as_int32, check_count, check_flag, require
from kvjax.memory._init import require_memory
from kvjax.memory._hybrid import HybridCache
from kvjax.memory._recurrent import RecurrentCache

__all__ = ["SinkWindow", "sink_window_evict", "evict_rows"]


@dataclasses.dataclass(frozen=True)
class SinkWindow:
    """Keep each sequence's first ``n_sink`` and latest ``n_recent`` tokens (see the module docstring).

    Attributes:
        n_sink: first positions kept for good, ``>= 0`` (StreamingLLM uses 4).
        n_recent: latest tokens kept, ``>= 1``.
        compact: move the kept tokens back to positions ``0 .. n_sink + n_recent - 1`` (K re-rotated),
            or keep their positions (masking only).
    """

    n_sink: int
    n_recent: int
    compact: bool = True

    def __post_init__(self):
        object.__setattr__(self, "n_sink", check_count("n_sink", self.n_sink, 0, 2**30))
        object.__setattr__(self, "n_recent", check_count("n_recent", self.n_recent, 1, 2**30))
        object.__setattr__(self, "compact", check_flag("compact", self.compact))

    @property
    def n_cells(self) -> int:
        """Most cells a sequence holds: ``n_sink + n_recent``."""
        return self.n_sink + self.n_recent

    def evicted(self, next_pos: int, n_new: int = 1) -> int:
        """(Host side) the positions the compacted form moves a sequence back by before placing
        ``n_new`` tokens at ``next_pos`` (0 for the masked form, whose positions never move)."""
        if not self.compact:
            return 0
        return max(0, min(next_pos + n_new - self.n_cells, next_pos - self.n_sink))


def check_window_memory(memory, window: SinkWindow) -> None:
    """``ValueError`` unless ``memory`` can run ``window``: it has cells per token, and shifts for
    the compacted form."""

    name = type(memory).__name__
    require(
        not isinstance(memory, (RecurrentCache, HybridCache)),
        "memory",
        name,
        "a memory with a cell per token (unified, streams, iSWA): a recurrent state holds its whole "
        "sequence in a fixed size already, nothing to evict",
    )
    require(
        not window.compact or memory.can_shift,
        "window",
        window,
        f"compact=False (masking only) on this {name}: it cannot shift positions (kvjax.can_shift is False)",
    )


def _evict_one(memory, seq_id, next_pos, n_new, n_sink, n_recent, *, compact: bool):
    if compact:
        e = jnp.clip(next_pos + n_new - (n_sink + n_recent), 0, jnp.maximum(next_pos - n_sink, 0))
        memory, _ = memory.seq_rm(seq_id, n_sink, n_sink + e)
        memory = memory.seq_add(seq_id, n_sink + e, jnp.int32(-1), -e)  # delta 0: nothing moves
        return memory, next_pos - e
    start = next_pos + n_new - n_recent
    memory, _ = memory.seq_rm(seq_id, n_sink, jnp.maximum(start, n_sink))  # empty while start <= n_sink
    return memory, next_pos


def evict_rows(
    memory, seq_ids: Int[Array, " T"], next_pos: Int[Array, " T"], valid, n_sink, n_recent, *, compact: bool
):
    """:func:`sink_window_evict` for each row of a decode ubatch (one token per live row), traced.

    Args:
        memory: the memory (traced inside the device loop).
        seq_ids: ``i32[T]`` each row's sequence (any value on a padding row).
        next_pos: ``i32[T]`` the position each row's token would take.
        valid: ``bool[T]`` live rows (padding rows evict nothing).
        n_sink, n_recent: ``i32[]`` the window (traced).
        compact: the form (static).

    Returns:
        ``(memory, i32[T] positions)``: the positions the rows' tokens take now.
    """
    out = []
    for r in range(seq_ids.shape[0]):  # T is a small static bucket; rows are distinct sequences
        seq = jnp.where(valid[r], seq_ids[r], 0)
        memory, p = _evict_one(memory, seq, next_pos[r], valid[r].astype(jnp.int32), n_sink, n_recent, compact=compact)
        out.append(jnp.where(valid[r], p, next_pos[r]))
    return memory, jnp.stack(out).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("compact",))
def _evict(memory, seq_id, next_pos, n_new, n_sink, n_recent, *, compact):
    return _evict_one(memory, seq_id, next_pos, n_new, n_sink, n_recent, compact=compact)


def sink_window_evict(
    memory, seq_id: int, next_pos: int, window: SinkWindow, n_new: int = 1
) -> Tuple[object, Int[Array, ""]]:
    """Make room for ``n_new`` tokens of ``seq_id`` at ``next_pos`` under the sink + window rule.

    Args:
        memory: any memory with cells (unified, streams, iSWA; a recurrent state is bounded already).
        seq_id: the sequence, in ``[0, n_seq_max)``.
        next_pos: the position its next token would take (``seq_pos_max + 1``), ``>= 0``.
        window: the :class:`SinkWindow`.
        n_new: tokens about to be placed, in ``[1, n_recent]``.

    Returns:
        ``(memory, i32[] next position)``: with the compacted form the tokens go there
        (``next_pos`` minus what was evicted) and the memory has a K-shift pending (applied by
        :func:`kvjax.update`, which :meth:`kvjax.Engine.decode` calls).

    Raises:
        ValueError: an argument out of range (nothing changed).
    """
    memory = require_memory(memory)
    if not isinstance(window, SinkWindow):
        raise ValueError(f"window must be a kvjax.SinkWindow, got {type(window).__name__}")
    n_seq = memory.n_seq_max
    seq_id = check_count("seq_id", seq_id, 0, n_seq - 1)
    next_pos = check_count("next_pos", next_pos, 0, 2**31 - 2)
    n_new = check_count("n_new", n_new, 1, window.n_recent)
    check_window_memory(memory, window)
    return _evict(
        memory,
        as_int32(seq_id),
        as_int32(next_pos),
        as_int32(n_new),
        as_int32(window.n_sink),
        as_int32(window.n_recent),
        compact=window.compact,
    )
