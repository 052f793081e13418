"""The recurrent memory's cells and their sequence operations, as pure functions of the cells.

A cell holds one state: ``pos`` (the last position folded into it), the sequences whose current
state it is, and ``tail[seq]`` names each sequence's cell (see :mod:`kvjax.memory._recurrent` for
the whole memory). The ``rc_*`` functions are the seed's sequence operations on those cells; the
slot search is :mod:`kvjax.memory._recurrent_slots`, the state rows :mod:`kvjax.memory._recurrent_rows`.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from flax import struct

from kvjax._errors import ErrorFlag
from kvjax._typing import Array, Bool, Int, UInt32
from kvjax.memory import _seqbits
from kvjax._validate import POS_END


_I32_MAX = 2**31 - 1


# -- cells ----------------------------------------------------------------------------------------


@struct.dataclass
class RecurrentCells:
    """Metadata of the state cells (see the module docstring).

    Attributes:
        pos: ``i32[C]`` last position folded into each cell's state, -1 when empty.
        seq: ``u32[C, W]`` bitmask of the sequences whose state the cell is.
        roll: ``i32[C]`` the row (of the cell's ``k``) holding the current state; moved by a rollback.
        hist: ``i32[C]`` states kept, counted from ``roll`` (0 when empty).
        tail: ``i32[S]`` the cell of each sequence, -1 when it has none.
        head: ``i32[]`` where the search for an empty cell starts.
        error: ``u32[]`` sticky :class:`kvjax.ErrorFlag` bits set by traced calls.
        n_seq_max: static S.
    """

    pos: Int[Array, " C"]
    seq: UInt32[Array, "C W"]
    roll: Int[Array, " C"]
    hist: Int[Array, " C"]
    tail: Int[Array, " S"]
    head: Int[Array, ""]
    error: UInt32[Array, ""]
    n_seq_max: int = struct.field(pytree_node=False)

    @property
    def size(self) -> int:
        return self.pos.shape[0]

    @property
    def n_words(self) -> int:
        return self.seq.shape[1]


def empty_recurrent_cells(size: int, n_seq_max: int) -> RecurrentCells:
    """Every cell empty, no tails, ``head`` 0."""
    return RecurrentCells(
        pos=jnp.full((size,), -1, jnp.int32),
        seq=jnp.zeros((size, _seqbits.n_words(n_seq_max)), jnp.uint32),
        roll=jnp.zeros((size,), jnp.int32),
        hist=jnp.zeros((size,), jnp.int32),
        tail=jnp.full((n_seq_max,), -1, jnp.int32),
        head=jnp.zeros((), jnp.int32),
        error=jnp.zeros((), jnp.uint32),
        n_seq_max=n_seq_max,
    )


@jax.jit
def cleared(cells: RecurrentCells) -> RecurrentCells:
    """Every cell empty, the error bits kept: one program (seven eager array fills were 0.5-0.8 ms)."""
    return empty_recurrent_cells(cells.size, cells.n_seq_max).replace(error=cells.error)


@struct.dataclass
class RecurrentPlacement:
    """Where an equal-split ubatch went, and what the step must copy first (the seed's graph inputs).

    Slot ``s`` of the ubatch (its ``s``-th sequence) sits in cell ``head + s``. For ``i < n``,
    cell ``head + i`` reads its state from row ``s_copy[i] * k + s_roll[i]`` (the seed's
    ``s_copy``, the row within it kvjax's rollback extension) and starts from zeros where
    ``s_mask[i]`` is false; entries ``i >= n`` are ``-1, 0, False``.

    Attributes:
        head: ``i32[]`` cell of slot 0.
        n: ``i32[]`` cells ``[head, head + n)`` the placement covers (0 when refused); only the rows
            that ``s_copy``/``s_roll`` move are rewritten.
        n_seqs: ``i32[]`` sequences (slots) in the ubatch (0 when refused).
        s_copy: ``i32[C]``.
        s_roll: ``i32[C]``.
        s_mask: ``bool[C]``.
    """

    head: Int[Array, ""]
    n: Int[Array, ""]
    n_seqs: Int[Array, ""]
    s_copy: Int[Array, " C"]
    s_roll: Int[Array, " C"]
    s_mask: Bool[Array, " C"]

    def nothing(self, keep: Bool[Array, ""]) -> "RecurrentPlacement":
        """This placement where ``keep``, else one that copies and writes nothing."""
        return self.replace(n=jnp.where(keep, self.n, 0), n_seqs=jnp.where(keep, self.n_seqs, 0))


def popcount(words: UInt32[Array, "... W"]) -> Int[Array, "..."]:
    return jnp.sum(jax.lax.population_count(words), axis=-1).astype(jnp.int32)


def used_mask(cells: RecurrentCells) -> Bool[Array, " C"]:
    return jnp.any(cells.seq != 0, axis=-1)


def _holds(cells: RecurrentCells, seq_id) -> Bool[Array, " C"]:
    """Cells holding ``seq_id``; every used cell for -1; none for another id out of range."""
    member = jnp.any((cells.seq & _seqbits.seq_bits(seq_id, cells.n_words)) != 0, axis=-1)
    return jnp.where(seq_id == -1, used_mask(cells), member)


def _bounds(p0, p1):
    return jnp.where(p0 < 0, 0, p0), jnp.where(p1 < 0, _I32_MAX, p1)


def _free(cells: RecurrentCells, freed: Bool[Array, " C"]) -> RecurrentCells:
    """Empty the cells in ``freed`` and forget every tail naming one of them."""
    tail_freed = (cells.tail >= 0) & jnp.take(freed, jnp.clip(cells.tail, 0, cells.size - 1))
    return cells.replace(
        pos=jnp.where(freed, -1, cells.pos),
        seq=jnp.where(freed[:, None], jnp.uint32(0), cells.seq),
        roll=jnp.where(freed, 0, cells.roll),
        hist=jnp.where(freed, 0, cells.hist),
        tail=jnp.where(tail_freed, -1, cells.tail),
    )


def _head_back(cells: RecurrentCells, old_head, mask: Bool[Array, " C"]) -> RecurrentCells:
    """``head`` moves back to the first cell of ``mask`` when that is before it."""
    first = jnp.argmax(mask).astype(jnp.int32)
    return cells.replace(head=jnp.where(jnp.any(mask) & (first < old_head), first, old_head))


def _guard(old: RecurrentCells, new: RecurrentCells, *checks) -> RecurrentCells:
    """``new`` when every ``(valid, flag)`` holds, else ``old`` with the failed flags raised."""
    ok, error = jnp.bool_(True), old.error
    for valid, flag in checks:
        ok = ok & valid
        error = error | jnp.where(valid, jnp.uint32(0), jnp.uint32(flag))
    kept = jax.tree.map(lambda a, b: jnp.where(ok, b, a), old, new)
    return kept.replace(error=jnp.where(ok, kept.error, error))


def _seq_ok(cells, seq_id, allow_all: bool):
    return (seq_id >= (-1 if allow_all else 0)) & (seq_id < cells.n_seq_max)


def _tail_of(cells: RecurrentCells, seq_id):
    """``(tail cell clipped to a valid index, whether seq_id has one)``."""
    t = jnp.take(cells.tail, jnp.clip(seq_id, 0, cells.n_seq_max - 1))
    has = (seq_id >= 0) & (seq_id < cells.n_seq_max) & (t >= 0)
    return jnp.clip(t, 0, cells.size - 1), has


# -- sequence operations (pure functions of the cells) ------------------------------------------


@jax.jit
def rc_seq_rm(cells: RecurrentCells, seq_id, p0, p1):
    """The seed's ``seq_rm`` with kvjax's rollback: ``(cells, ok)``; a refusal changes nothing."""
    p0, p1 = _bounds(p0, p1)
    t, has_t = _tail_of(cells, seq_id)
    tpos = cells.pos[t]
    cut = has_t & (((0 < p0) & (p0 <= tpos)) | ((0 < p1) & (p1 <= tpos)))
    j = tpos - p0 + 1
    rollback = cut & (0 < p0) & (p0 <= tpos) & (tpos < p1) & (j < cells.hist[t]) & (popcount(cells.seq[t]) == 1)
    everything_or_nothing = (p0 == p1) | ((p0 == 0) & (p1 == _I32_MAX))
    valid = _seq_ok(cells, seq_id, True)
    refused = (cut & ~rollback) | ((seq_id < 0) & ~everything_or_nothing) | ~valid
    rolled = cells.replace(pos=cells.pos.at[t].set(p0 - 1), roll=cells.roll.at[t].add(j), hist=cells.hist.at[t].add(-j))
    target = (cells.pos >= p0) & (cells.pos < p1) & _holds(cells, seq_id)
    dropped = jnp.where(seq_id < 0, cells.seq, _seqbits.seq_bits(seq_id, cells.n_words))
    seq = jnp.where(target[:, None], cells.seq & ~dropped, cells.seq)
    freed = target & ~jnp.any(seq != 0, axis=-1)
    # a sequence taken out of a cell forgets its tail there (every sequence with seq_id < 0)
    tail_hit = (cells.tail >= 0) & jnp.take(target, jnp.clip(cells.tail, 0, cells.size - 1))
    tail_hit = tail_hit & ((seq_id < 0) | (jnp.arange(cells.n_seq_max) == seq_id))
    removed = cells.replace(seq=seq, tail=jnp.where(tail_hit, -1, cells.tail))
    removed = _head_back(_free(removed, freed), cells.head, freed)
    new = jax.tree.map(lambda a, b: jnp.where(rollback, a, b), rolled, removed)
    out = jax.tree.map(lambda a, b: jnp.where(refused, a, b), cells, new)
    out = out.replace(error=out.error | jnp.where(valid, jnp.uint32(0), jnp.uint32(ErrorFlag.SEQ_ID)))
    return out, ~refused


@jax.jit
def rc_seq_cp(cells: RecurrentCells, src, dst) -> RecurrentCells:
    """``dst`` drops its state and shares ``src``'s tail cell (no bytes move; the range is ignored)."""
    td, has_d = _tail_of(cells, dst)
    dbit = _seqbits.seq_bits(dst, cells.n_words)
    seq = jnp.where(has_d, cells.seq.at[td].set(cells.seq[td] & ~dbit), cells.seq)
    dropped = cells.replace(seq=seq, tail=jnp.where(has_d, cells.tail.at[jnp.clip(dst, 0)].set(-1), cells.tail))
    emptied = has_d & ~jnp.any(seq[td] != 0)
    dropped = _free(dropped, jnp.zeros(cells.size, bool).at[td].set(emptied))
    ts, has_s = _tail_of(dropped, src)
    shared = dropped.replace(
        seq=dropped.seq.at[ts].set(dropped.seq[ts] | dbit), tail=dropped.tail.at[jnp.clip(dst, 0)].set(ts)
    )
    new = jax.tree.map(lambda a, b: jnp.where(has_s, b, a), dropped, shared)
    new = jax.tree.map(lambda a, b: jnp.where(src == dst, a, b), cells, new)
    return _guard(cells, new, (_seq_ok(cells, src, False) & _seq_ok(cells, dst, False), ErrorFlag.SEQ_ID))


@jax.jit
def rc_seq_keep(cells: RecurrentCells, seq_id) -> RecurrentCells:
    """Only ``seq_id`` stays (-1 keeps everything); ``head`` moves back to the first other cell."""
    keep = _holds(cells, seq_id)
    others = jnp.arange(cells.n_seq_max) != seq_id
    new = cells.replace(tail=jnp.where(others, -1, cells.tail))
    new = _free(new, ~keep)
    new = new.replace(seq=jnp.where(keep[:, None], _seqbits.seq_bits(seq_id, cells.n_words), new.seq))
    new = _head_back(new, cells.head, ~keep)
    new = jax.tree.map(lambda a, b: jnp.where(seq_id < 0, a, b), cells, new)
    return _guard(cells, new, (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID))


def _shifted(cells: RecurrentCells, seq_id, p0, p1) -> Bool[Array, " C"]:
    """The cells a position change of ``seq_id`` moves: its tail cell (every used cell for -1)."""
    in_range = (cells.pos >= p0) & (cells.pos < p1)
    t, has_t = _tail_of(cells, seq_id)
    tail_cell = (jnp.arange(cells.size) == t) & has_t & _holds(cells, seq_id)
    return in_range & jnp.where(seq_id < 0, used_mask(cells), tail_cell)


@jax.jit
def rc_seq_add(cells: RecurrentCells, seq_id, p0, p1, delta) -> RecurrentCells:
    """Move the state's position by ``delta``; a shift that would move a state below position 0 is
    refused (the cells unchanged, ``ErrorFlag.STATE_SHIFT`` set): see :func:`rc_shift_keeps_states`."""
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1)
    overflow = jnp.any(target & (delta > 0) & (cells.pos >= POS_END - delta))
    moved = cells.replace(pos=jnp.where(target, cells.pos + delta, cells.pos))
    new = jax.tree.map(lambda a, b: jnp.where((delta == 0) | (p0 == p1), a, b), cells, moved)
    return _guard(
        cells,
        new,
        (~overflow, ErrorFlag.OVERFLOW),
        (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID),
        (rc_shift_keeps_states(cells, seq_id, p0, p1, delta), ErrorFlag.STATE_SHIFT),
    )


@jax.jit
def rc_shift_keeps_states(cells: RecurrentCells, seq_id, p0, p1, delta):
    """Whether ``seq_add(seq_id, p0, p1, delta)`` leaves every state it moves at a position >= 0.

    A unified cache frees a cell pushed below 0: it held one token. A recurrent cell holds the
    whole sequence so far, and a shift must never delete it (the seed keeps it, at a negative
    position that ``seq_rm`` then cannot reach); kvjax refuses such a shift instead, with nothing changed.
    """
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1) & (delta != 0) & (p0 != p1)
    return ~jnp.any(target & (cells.pos + jnp.minimum(delta, 0) < 0))


@jax.jit
def rc_seq_div(cells: RecurrentCells, seq_id, p0, p1, d) -> RecurrentCells:
    """Divide the state's position by ``d``; only the current state stays valid (``hist`` 1)."""
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1) & (d > 1)
    safe_d = jnp.where(d > 0, d, 1)
    new = cells.replace(
        pos=jnp.where(target, cells.pos // safe_d, cells.pos),
        hist=jnp.where(target, jnp.minimum(cells.hist, 1), cells.hist),
    )
    return _guard(cells, new, (d > 0, ErrorFlag.DIVISOR), (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID))


@jax.jit
def rc_seq_pos(cells: RecurrentCells, seq_id):
    """``(seq_pos_min, seq_pos_max)`` of ``seq_id`` (-1: any), -1 when absent."""
    hit = _holds(cells, seq_id)
    lo = jnp.min(jnp.where(hit, cells.pos, _I32_MAX))
    hi = jnp.max(jnp.where(hit, cells.pos, -1))
    return jnp.where(jnp.any(hit), lo, -1), hi


@jax.jit
def rc_seq_shared(cells: RecurrentCells, seq_id, p0, p1):
    p0, p1 = _bounds(p0, p1)
    hit = _holds(cells, seq_id) & (cells.pos >= p0) & (cells.pos < p1)
    return jnp.any(hit & (popcount(cells.seq) > 1))
