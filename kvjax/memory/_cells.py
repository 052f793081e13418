"""Cell metadata and the sequence operations on it, as pure jitted functions.

A cell holds at most one token: its position ``pos`` (-1 when empty) and the set of sequences
that share it, as a bitmask of ``W`` 32-bit words. A cell is empty iff its bitmask is zero, and
then ``pos == -1`` and ``delta == 0``. ``used`` is derived, never stored.

Every function here takes and returns :class:`Cells`; the K/V buffers are never touched, so a
sequence operation costs O(C * W) work on ~12 bytes per cell whatever the model size.

Semantics follow the seed (``llama_kv_cache_unified``): ``p0 < 0`` means 0, ``p1 < 0`` means
+infinity, ranges are ``[p0, p1)``, and each op moves ``head`` as the seed does. Deliberate
differences (see ``docs/architecture.md``):

- a freed cell also has its pending ``delta`` reset to 0 (the seed leaves it, so a token placed
  into that cell later would be rotated by a stale shift);
- ``seq_id = -1`` means "every sequence" for every op where that has a meaning (the seed gives
  it one only in ``seq_rm``): ``seq_add``/``seq_div`` shift every non-empty cell in range,
  ``seq_keep(-1)`` keeps everything, ``seq_pos_min/max(-1)`` range over all cells;
- an invalid traced argument makes the op a no-op and sets a bit in ``error``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from kvjax._typing import Array, Bool, Int, UInt32
from kvjax._errors import ErrorFlag
from kvjax._validate import POS_END
from kvjax.memory._seqbits import BITS, n_words, seq_bits
from kvjax._axes import CELLS, SEQ_WORDS, scalar_axes
from jax.sharding import PartitionSpec as P

_I32_MAX = jnp.iinfo(jnp.int32).max


@struct.dataclass
class Cells:
    """Metadata of every cell; shared by all layers.

    Attributes:
        pos: ``i32[C]`` position of the token in each cell, -1 when empty.
        seq: ``u32[C, W]`` bitmask of the sequence ids sharing each cell.
        delta: ``i32[C]`` shift accumulated by ``seq_add``/``seq_div`` since the last K-shift.
        head: ``i32[]`` where the next contiguous slot search starts.
        error: ``u32[]`` sticky :class:`kvjax._errors.ErrorFlag` bits set by traced calls.
        defrag: ``bool[]`` a defragmentation is pending (set by ``kvjax.defrag_sched``, applied
            by ``kvjax.update`` after the K-shift, as in the seed).
        n_seq_max: static number of sequence ids S.
    """

    pos: Int[Array, " C"]
    seq: UInt32[Array, "C W"]
    delta: Int[Array, " C"]
    head: Int[Array, ""]
    error: UInt32[Array, ""]
    defrag: Bool[Array, ""]
    n_seq_max: int = struct.field(pytree_node=False)

    @property
    def size(self) -> int:
        """C, the number of cells."""
        return self.pos.shape[0]

    @property
    def n_words(self) -> int:
        """W, words per sequence bitmask."""
        return self.seq.shape[1]

    def logical_axes(self) -> "Cells":
        """The logical axes of every field (``PartitionSpec`` leaves; see :meth:`kvjax.Memory.logical_axes`)."""
        return self.replace(
            pos=P(CELLS),
            seq=P(CELLS, SEQ_WORDS),
            delta=P(CELLS),
            head=scalar_axes(),
            error=scalar_axes(),
            defrag=scalar_axes(),
        )


def empty_cells(size: int, n_seq_max: int) -> Cells:
    """All cells empty, ``head`` at 0, no error.

    Example:
        >>> c = empty_cells(64, 40)
        >>> c.pos.shape, c.seq.shape, int(c.head)
        ((64,), (64, 2), 0)
    """
    words = n_words(n_seq_max)
    return Cells(
        pos=jnp.full((size,), -1, jnp.int32),
        seq=jnp.zeros((size, words), jnp.uint32),
        delta=jnp.zeros((size,), jnp.int32),
        head=jnp.zeros((), jnp.int32),
        error=jnp.zeros((), jnp.uint32),
        defrag=jnp.zeros((), jnp.bool_),
        n_seq_max=n_seq_max,
    )


# -- building blocks ----------------------------------------------------------------------------


def prefix_sum(x: Int[Array, " C"]) -> Int[Array, " C"]:
    """Inclusive prefix sum as int32 (``jnp.cumsum``'s result, computed faster).

    ``jnp.cumsum`` lowers to a ``reduce_window`` as wide as the array, which XLA's CPU backend
    ran at ~230 us for 32768 cells; a log-depth ``associative_scan`` took ~60 us.

    Example:
        >>> prefix_sum(jnp.array([1, 0, 1, 1])).tolist()
        [1, 1, 2, 3]
    """
    return jax.lax.associative_scan(jnp.add, x.astype(jnp.int32))


def is_used(cells: Cells) -> Bool[Array, " C"]:
    """Cells that hold at least one sequence."""
    return jnp.any(cells.seq != 0, axis=-1)


def has_seq(cells: Cells, seq_id: Int[Array, ""]) -> Bool[Array, " C"]:
    """Cells that hold ``seq_id``; for ``seq_id == -1`` every non-empty cell.

    Any other id outside ``[0, n_seq_max)`` is held by no cell (as in the seed), so a traced
    query with a bad id answers "absent" instead of silently meaning "every sequence".
    """
    member = jnp.any((cells.seq & seq_bits(seq_id, cells.n_words)) != 0, axis=-1)
    return jnp.where(seq_id == -1, is_used(cells), member)


def _bounds(p0, p1):
    """The seed's range conventions: p0 < 0 means 0, p1 < 0 means +infinity."""
    p0 = jnp.where(p0 < 0, 0, p0)
    p1 = jnp.where(p1 < 0, _I32_MAX, p1)
    return p0, p1


def _in_range(cells: Cells, p0, p1) -> Bool[Array, " C"]:
    return (cells.pos >= p0) & (cells.pos < p1)


def _first(mask: Bool[Array, " C"]):
    """(any, index of the first True) of a mask."""
    return jnp.any(mask), jnp.argmax(mask).astype(jnp.int32)


def _free(cells: Cells, freed: Bool[Array, " C"]) -> Cells:
    """Empty the cells in ``freed`` (position -1, no sequence, no pending shift)."""
    return cells.replace(
        pos=jnp.where(freed, -1, cells.pos),
        seq=jnp.where(freed[:, None], jnp.uint32(0), cells.seq),
        delta=jnp.where(freed, 0, cells.delta),
    )


def guard(old: Cells, new: Cells, *checks) -> Cells:
    """``new`` when every ``(valid, flag)`` check holds, else ``old`` with each failed flag raised."""
    ok = jnp.bool_(True)
    error = old.error
    for valid, flag in checks:
        ok = ok & valid
        error = error | jnp.where(valid, jnp.uint32(0), jnp.uint32(flag))
    kept = jax.tree.map(lambda a, b: jnp.where(ok, b, a), old, new)
    return kept.replace(error=jnp.where(ok, kept.error, error))


def _valid_seq(cells: Cells, seq_id, allow_all: bool):
    lo = -1 if allow_all else 0
    return (seq_id >= lo) & (seq_id < cells.n_seq_max)


# -- sequence operations ------------------------------------------------------------------------
#
# Each op is a thin Python function over a jitted core that returns only the fields the op can
# change; the others are the caller's own arrays, reused. jax copies every output of a jitted call
# into a fresh buffer even when it is an unchanged input (no forwarding at dispatch), and at 32768
# cells those copies cost more than the op itself (see docs/speed.md). Inside an outer jit the
# wrapper is traced like any function, so the program is the same. The cores fold the validity
# checks into the per-cell masks (an invalid call changes no cell) instead of a select of every
# field between the old and the new value, which was one more pass over every array.


def _cell_index(cells: Cells) -> Int[Array, " C"]:
    return jnp.arange(cells.size, dtype=jnp.int32)


def _first_index(mask: Bool[Array, " C"]) -> Int[Array, ""]:
    """Index of the first True of ``mask``, ``C`` when none (a min, cheaper than ``argmax``).

    ``jnp.argmax`` lowers to a two-operand reduce that XLA's CPU backend runs as a scalar loop
    (~40 us at 32768 cells); a min over indices is one plain reduction (~15 us).
    """
    return jnp.min(jnp.where(mask, jnp.arange(mask.shape[0], dtype=jnp.int32), mask.shape[0]))


def _member(cells: Cells, seq_id) -> Bool[Array, " C"]:
    """:func:`has_seq` reading one word per cell, and the positions for ``seq_id == -1``.

    A cell is non-empty iff its position is >= 0 (placement refuses negative positions and a
    shift below 0 frees the cell), so "every sequence" needs no pass over the ``W`` words.
    """
    w = cells.n_words
    if w == 1:
        word = cells.seq[:, 0]
    else:
        word = jax.lax.dynamic_index_in_dim(cells.seq, jnp.clip(seq_id // BITS, 0, w - 1), axis=1, keepdims=False)
    valid = (seq_id >= 0) & (seq_id < w * BITS)
    bit = jnp.where(valid, jnp.left_shift(jnp.uint32(1), (seq_id % BITS).astype(jnp.uint32)), jnp.uint32(0))
    return jnp.where(seq_id == -1, cells.pos >= 0, (word & bit) != 0)


def _flag(error, valid, flag) -> UInt32[Array, ""]:
    return error | jnp.where(valid, jnp.uint32(0), jnp.uint32(flag))


@jax.jit
def clear(cells: Cells) -> Cells:
    """Empty every cell and reset ``head`` (error bits are kept)."""
    fresh = empty_cells(cells.size, cells.n_seq_max)
    return fresh.replace(error=cells.error)


@jax.jit
def _seq_rm(cells: Cells, seq_id, p0, p1):
    p0, p1 = _bounds(p0, p1)
    ok = _valid_seq(cells, seq_id, True)
    target = ok & _in_range(cells, p0, p1) & _member(cells, seq_id)
    dropped = jnp.where(seq_id < 0, jnp.uint32(0xFFFFFFFF), seq_bits(seq_id, cells.n_words))
    left = cells.seq & ~dropped
    freed = target & ~jnp.any(left != 0, axis=-1)
    seq = jnp.where(target[:, None], left, cells.seq)
    pos = jnp.where(freed, -1, cells.pos)
    delta = jnp.where(freed, 0, cells.delta)
    first = _first_index(freed)  # C when none was freed
    head = jnp.where(first < cells.head, first, cells.head)
    return pos, seq, delta, head, _flag(cells.error, ok, ErrorFlag.SEQ_ID)


def seq_rm(cells: Cells, seq_id, p0, p1) -> Cells:
    """Remove ``seq_id`` (every sequence when < 0) from the cells with ``p0 <= pos < p1``.

    ``head`` moves back to the first freed cell when that is before it.

    Args:
        cells: the cells.
        seq_id: ``i32[]``, in ``[-1, n_seq_max)``; another id changes nothing and sets
            ``ErrorFlag.SEQ_ID``.
        p0: ``i32[]`` first position (< 0 means 0).
        p1: ``i32[]`` end position, exclusive (< 0 means infinity).
    """
    pos, seq, delta, head, error = _seq_rm(cells, seq_id, p0, p1)
    return cells.replace(pos=pos, seq=seq, delta=delta, head=head, error=error)


@jax.jit
def _seq_cp(cells: Cells, src, dst, p0, p1):
    p0, p1 = _bounds(p0, p1)
    ok = _valid_seq(cells, src, False) & _valid_seq(cells, dst, False)
    copy = ok & (src != dst)
    target = copy & _in_range(cells, p0, p1) & _member(cells, src)
    seq = jnp.where(target[:, None], cells.seq | seq_bits(dst, cells.n_words), cells.seq)
    head = jnp.where(copy, 0, cells.head).astype(jnp.int32)
    return seq, head, _flag(cells.error, ok, ErrorFlag.SEQ_ID)


def seq_cp(cells: Cells, src, dst, p0, p1) -> Cells:
    """Add ``dst`` to every cell of ``src`` with ``p0 <= pos < p1`` (the K/V rows are shared).

    A copy onto itself does nothing; any other copy resets ``head`` to 0, as the seed does.
    Positions and shifts are unchanged: the result shares those arrays with ``cells``.

    Args:
        cells: the cells.
        src: ``i32[]`` source sequence, in ``[0, n_seq_max)``.
        dst: ``i32[]`` destination sequence, in ``[0, n_seq_max)``; a bad ``src`` or ``dst``
            changes nothing and sets ``ErrorFlag.SEQ_ID``.
        p0: ``i32[]`` first position (< 0 means 0).
        p1: ``i32[]`` end position, exclusive (< 0 means infinity).
    """
    seq, head, error = _seq_cp(cells, src, dst, p0, p1)
    return cells.replace(seq=seq, head=head, error=error)


@jax.jit
def seq_keep(cells: Cells, seq_id) -> Cells:
    """Drop every sequence but ``seq_id`` (``-1`` keeps everything).

    ``head`` moves back to the first cell that does not hold ``seq_id``, when before it.
    """
    keep = has_seq(cells, seq_id)
    new = _free(cells, ~keep & is_used(cells))
    new = new.replace(seq=jnp.where(keep[:, None], seq_bits(seq_id, cells.n_words), new.seq))
    any_other, first = _first(~keep)
    new = new.replace(head=jnp.where(any_other & (first < cells.head), first, cells.head))
    new = jax.tree.map(lambda a, b: jnp.where(seq_id < 0, a, b), cells, new)
    return guard(cells, new, (_valid_seq(cells, seq_id, True), ErrorFlag.SEQ_ID))


@jax.jit
def _seq_add(cells: Cells, seq_id, p0, p1, delta):
    p0, p1 = _bounds(p0, p1)
    ok = _valid_seq(cells, seq_id, True)
    target = ok & (delta != 0) & (p0 != p1) & _in_range(cells, p0, p1) & _member(cells, seq_id)
    # Positions are >= 0, so only a positive delta can leave the range [0, POS_END) at its top, and
    # only a negative one frees cells: one reduction answers both (-1: a cell would leave; else the
    # first freed cell, C when none), where two were one more pass and reduction tree each.
    wraps = target & (cells.pos >= POS_END - delta)
    freed = target & (cells.pos + delta < 0)
    idx = jnp.arange(cells.size, dtype=jnp.int32)
    found = jnp.min(jnp.where(delta > 0, jnp.where(wraps, -1, cells.size), jnp.where(freed, idx, cells.size)))
    overflow = found < 0
    first = found
    moved = target & ~overflow
    gone = freed & ~overflow
    pos = jnp.where(gone, -1, jnp.where(moved, cells.pos + delta, cells.pos))
    new_delta = jnp.where(gone, 0, jnp.where(moved, cells.delta + delta, cells.delta))
    seq = jnp.where(gone[:, None], jnp.uint32(0), cells.seq)
    # the seed's head: the first freed cell, else 0 (only when the shift happened)
    shifted = ok & (delta != 0) & (p0 != p1) & ~overflow
    head = jnp.where(shifted, jnp.where(first < cells.size, first, 0), cells.head).astype(jnp.int32)
    error = _flag(_flag(cells.error, ~overflow, ErrorFlag.OVERFLOW), ok, ErrorFlag.SEQ_ID)
    return pos, seq, new_delta, head, error


def seq_add(cells: Cells, seq_id, p0, p1, delta) -> Cells:
    """Add ``delta`` to the positions of ``seq_id`` in ``[p0, p1)`` and record it for K-shift.

    Cells pushed below position 0 are freed. ``head`` goes to the first freed cell, or to 0 when
    none was freed. ``delta == 0`` or an empty normalized range ``p0 == p1`` does nothing. A
    shift that would push a position to ``POS_END = 2**31 - 1`` or past it (where no ``seq_rm`` could
    reach it) is skipped and flagged (``ErrorFlag.OVERFLOW``).

    Args:
        cells: the cells.
        seq_id: ``i32[]``, in ``[-1, n_seq_max)`` (-1: every sequence); another id changes
            nothing and sets ``ErrorFlag.SEQ_ID``.
        p0: ``i32[]`` first position (< 0 means 0).
        p1: ``i32[]`` end position, exclusive (< 0 means infinity).
        delta: ``i32[]`` the shift.
    """
    pos, seq, new_delta, head, error = _seq_add(cells, seq_id, p0, p1, delta)
    return cells.replace(pos=pos, seq=seq, delta=new_delta, head=head, error=error)


@jax.jit
def seq_div(cells: Cells, seq_id, p0, p1, d) -> Cells:
    """Integer-divide the positions of ``seq_id`` in ``[p0, p1)`` by ``d`` (self-extend).

    The change of each position is recorded in ``delta``. ``head`` does not move.
    """
    p0, p1 = _bounds(p0, p1)
    target = _in_range(cells, p0, p1) & has_seq(cells, seq_id) & (d != 1)
    safe_d = jnp.where(d > 0, d, 1)
    pos = jnp.where(target, cells.pos // safe_d, cells.pos)
    new = cells.replace(pos=pos, delta=cells.delta + (pos - cells.pos))
    return guard(cells, new, (d > 0, ErrorFlag.DIVISOR), (_valid_seq(cells, seq_id, True), ErrorFlag.SEQ_ID))


# -- queries ------------------------------------------------------------------------------------


@jax.jit
def seq_pos_min(cells: Cells, seq_id) -> Int[Array, ""]:
    """Smallest position held by ``seq_id`` (any sequence when -1); -1 when absent."""
    member = has_seq(cells, seq_id)
    lo = jnp.min(jnp.where(member, cells.pos, _I32_MAX))
    return jnp.where(jnp.any(member), lo, -1).astype(jnp.int32)


@jax.jit
def seq_pos_max(cells: Cells, seq_id) -> Int[Array, ""]:
    """Largest position held by ``seq_id`` (any sequence when -1); -1 when absent."""
    return jnp.max(jnp.where(has_seq(cells, seq_id), cells.pos, -1)).astype(jnp.int32)


@jax.jit
def pos_max(cells: Cells) -> Int[Array, ""]:
    """Largest position in the cache, -1 when empty."""
    return jnp.max(cells.pos).astype(jnp.int32)


@jax.jit
def used_cells(cells: Cells) -> Int[Array, ""]:
    """Number of non-empty cells."""
    return jnp.sum(is_used(cells), dtype=jnp.int32)


@jax.jit
def n_tokens(cells: Cells) -> Int[Array, ""]:
    """Sum over cells of the number of sequences sharing the cell."""
    return jnp.sum(jax.lax.population_count(cells.seq), dtype=jnp.int32)


@jax.jit
def cell_max(cells: Cells) -> Int[Array, ""]:
    """One past the last non-empty cell (0 when the cache is empty)."""
    idx = jnp.arange(cells.size, dtype=jnp.int32)
    return jnp.max(jnp.where(is_used(cells), idx + 1, 0))


@functools.partial(jax.jit, static_argnames="padding")
def n_kv(cells: Cells, padding: int) -> Int[Array, ""]:
    """The seed's attention window ``min(size, max(padding, pad(cell_max, padding)))``."""
    padded = -(-cell_max(cells) // padding) * padding
    return jnp.minimum(cells.size, jnp.maximum(padding, padded)).astype(jnp.int32)


@jax.jit
def has_shift(cells: Cells) -> Bool[Array, ""]:
    """Whether some cell has a pending K-shift."""
    return jnp.any(cells.delta != 0)


@jax.jit
def seq_shared(cells: Cells, seq_id, p0, p1) -> Bool[Array, ""]:
    """Whether a cell of ``seq_id`` with ``p0 <= pos < p1`` also holds another sequence."""
    p0, p1 = _bounds(p0, p1)
    mine = has_seq(cells, seq_id) & _in_range(cells, p0, p1)
    shared = jnp.sum(jax.lax.population_count(cells.seq), axis=-1) > 1
    return jnp.any(mine & shared)
