"""Placement of an equal-split ubatch in the recurrent memory (the seed's recurrent ``find_slot``).

One jitted function of the cells and the ubatch. The seed's steps, each on device:

1. the secondary ids of every slot drop their own state (they join the primary's);
2. every slot's primary sequence gets a cell of its own, slot by slot: its tail when nobody
   shares it, else the next empty cell in cyclic order from ``head`` (a copy-on-write of a shared
   state takes over its position and history, and will be read from it; a new sequence's cell
   starts from zeros);
3. cells are swapped so that slot ``s`` sits in cell ``lo + s`` (``lo`` the lowest of those cells),
   the tails following **by value** (every tail naming either cell), where the seed re-points
   only the tails of the two cells' sequences and can lose a third sequence's state;
4. the slots' cells take their last positions and sequence sets, ``head = lo``;
5. the graph inputs: for each cell ``head + i`` of the range, the cell (``s_copy``) and row
   (``s_roll``, a slot's ``roll``; 0 for the other cells, whose rows move whole and which keep
   their ``roll``) its state is read from, and ``s_mask`` (0: a new state); after them every used
   cell of the range reads itself, and the slots' cells have ``roll`` 0.

A refused ubatch (a bad shape or id, no empty cell for a sequence that needs one) changes nothing,
``head`` included, and gives a placement that copies and writes nothing. The loops over slots are
``lax.fori_loop`` over the static slot count; each step is O(C) work on the metadata.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvjax._errors import ErrorFlag
from kvjax.memory import _seqbits
from kvjax.memory._recurrent_cells import RecurrentCells, RecurrentPlacement, popcount
from kvjax.memory._ubatch import Ubatch, equal_slots

__all__ = ["find_slot_recurrent"]


def _next_empty(seq, reserved, start):
    """The first empty, unreserved cell at or after ``start`` in cyclic order, -1 when none."""
    size = seq.shape[0]
    free = ~jnp.any(seq != 0, axis=-1) & ~reserved
    order = (jnp.arange(size) - start) % size
    best = jnp.argmin(jnp.where(free, order, size)).astype(jnp.int32)
    return jnp.where(jnp.any(free), best, -1)


def _swap(x, a, b, do):
    """``x`` with entries ``a`` and ``b`` (first axis) exchanged when ``do``."""
    xa, xb = x[a], x[b]
    swapped = x.at[a].set(xb).at[b].set(xa)
    return jnp.where(do, swapped, x)


@functools.partial(jax.jit, static_argnums=2)
def find_slot_recurrent(cells: RecurrentCells, ubatch: Ubatch, n_states: int):
    """Place an equal-split ubatch: ``(cells, placement, ok)``; refused: ``cells`` unchanged."""
    size, n_seq, words = cells.size, cells.n_seq_max, cells.n_words
    n_slots, t = equal_slots(ubatch)
    valid = ubatch.valid.reshape(n_slots, t)
    ids_rows = ubatch.seq_ids.reshape(n_slots, t, -1)
    ids = ids_rows[:, 0]  # [n_slots, M]
    last_pos = ubatch.pos.reshape(n_slots, t)[:, -1]
    slot_on = valid[:, 0]
    n_seqs = jnp.sum(slot_on, dtype=jnp.int32)
    s_idx = jnp.arange(n_slots)

    # -- the ubatch must be a well-formed equal split (a traced one is checked here) ----------------
    primary = ids[:, 0]
    id_ok = (ids >= -1) & (ids < n_seq)
    slot_bits = _seqbits.ids_mask(jnp.where(id_ok, ids, -1), words)  # [n_slots, W]
    slot_bits = jnp.where(slot_on[:, None], slot_bits, jnp.uint32(0))
    union = jnp.bitwise_or.reduce(slot_bits, axis=0)
    well_formed = (
        jnp.all(valid == slot_on[:, None])
        & jnp.all(slot_on == (s_idx < n_seqs))
        & (n_seqs >= 1)
        & jnp.all(~slot_on[:, None, None] | (ids_rows == ids[:, None]))
        & jnp.all(~slot_on[:, None] | id_ok)
        & jnp.all(~slot_on | ((primary >= 0) & (primary < n_seq)))
        & (popcount(union) == jnp.sum(popcount(slot_bits)))  # no id in two slots
        & jnp.all(~valid | (ubatch.pos.reshape(n_slots, t) >= 0))
    )

    used0 = jnp.any(cells.seq != 0, axis=-1)
    head = jnp.where(cells.head > jnp.sum(used0) + 2 * n_seqs * t, 0, cells.head)

    # -- 1. secondary ids drop their own state ---------------------------------------------------------
    primary_bits = _seqbits.seq_bits(jnp.where(slot_on, primary, -1), words)
    secondary = union & ~jnp.bitwise_or.reduce(primary_bits, axis=0)  # [W]
    seq = cells.seq & ~secondary[None]
    emptied = used0 & ~jnp.any(seq != 0, axis=-1)
    pos = jnp.where(emptied, -1, cells.pos)
    roll = jnp.where(emptied, 0, cells.roll)
    hist = jnp.where(emptied, 0, cells.hist)
    is_secondary = jnp.any(_seqbits.seq_bits(jnp.arange(n_seq), words) & secondary[None], axis=-1)
    tail = jnp.where(is_secondary, -1, cells.tail)
    src = jnp.where(jnp.any(seq != 0, axis=-1), jnp.arange(size), -1)  # a used cell's state is itself

    # -- 2. every primary sequence gets a cell of its own -----------------------------------------------
    def own_cell(s, carry):
        seq, pos, src, roll, hist, tail, reserved, nxt, lo, hi, failed = carry
        on = slot_on[s]
        q = jnp.clip(primary[s], 0, n_seq - 1)
        t_cell = tail[q]
        tc = jnp.clip(t_cell, 0, size - 1)
        need = on & ((t_cell < 0) | (popcount(seq[tc]) != 1))
        failed = failed | (need & (nxt < 0))
        take = need & (nxt >= 0)
        cow = take & (t_cell >= 0)
        nc = jnp.clip(nxt, 0, size - 1)
        bit = _seqbits.seq_bits(q, words)
        moved = lambda x: jnp.where(cow, x.at[nc].set(x[tc]), x)  # noqa: E731
        pos, src, roll, hist = moved(pos), moved(src), moved(roll), moved(hist)
        seq = jnp.where(cow, seq.at[tc].set(seq[tc] & ~bit).at[nc].set(seq[nc] | bit), seq)
        tail = jnp.where(take, tail.at[q].set(nxt), tail)
        reserved = jnp.where(take, reserved.at[nc].set(True), reserved)
        nxt = jnp.where(take, _next_empty(seq, reserved, nxt + 1), nxt)
        mine = tail[q]
        lo = jnp.where(on, jnp.minimum(lo, mine), lo)
        hi = jnp.where(on, jnp.maximum(hi, mine), hi)
        return seq, pos, src, roll, hist, tail, reserved, nxt, lo, hi, failed

    reserved = jnp.zeros(size, bool)
    carry = (
        seq,
        pos,
        src,
        roll,
        hist,
        tail,
        reserved,
        _next_empty(seq, reserved, head),
        jnp.int32(size - 1),
        jnp.int32(0),
        ~well_formed,
    )
    seq, pos, src, roll, hist, tail, _, _, lo, hi, failed = jax.lax.fori_loop(0, n_slots, own_cell, carry)

    # -- 3. gather: slot s goes to cell lo + s ------------------------------------------------------
    def gather(s, carry):
        seq, pos, src, roll, hist, tail = carry
        dst = jnp.clip(lo + s, 0, size - 1)
        here = tail[jnp.clip(primary[s], 0, n_seq - 1)]
        hc = jnp.clip(here, 0, size - 1)
        do = slot_on[s] & (dst != hc)
        seq, pos, src, roll, hist = (_swap(x, dst, hc, do) for x in (seq, pos, src, roll, hist))
        swapped = jnp.where(tail == hc, dst, jnp.where(tail == dst, hc, tail))
        return seq, pos, src, roll, hist, jnp.where(do, swapped, tail)

    seq, pos, src, roll, hist, tail = jax.lax.fori_loop(0, n_slots, gather, (seq, pos, src, roll, hist, tail))

    # -- 4. the slots' cells take their positions and sequences ----------------------------------------
    cell = jnp.where(slot_on, lo + s_idx, size)  # size: dropped by the scatters
    cc = jnp.clip(cell, 0, size - 1)
    consecutive = (pos[cc] >= 0) & (last_pos == pos[cc] + t)
    new_hist = jnp.minimum(n_states, jnp.where(consecutive, hist[cc], 0) + t)
    hist = hist.at[cell].set(new_hist, mode="drop")
    pos = pos.at[cell].set(last_pos, mode="drop")
    seq = seq.at[cell].set(slot_bits, mode="drop")
    owner = jnp.where(slot_on[:, None] & (ids >= 0) & (ids < n_seq), ids, n_seq)  # [n_slots, M]
    tail = tail.at[owner.reshape(-1)].set(jnp.repeat(cell, ids.shape[1]), mode="drop")
    n = hi - lo + 1

    # -- 5. the inputs of the step, then every used cell of the range reads itself -----------------------
    i = jnp.arange(size)
    inside = i < n
    d = jnp.clip(lo + i, 0, size - 1)
    src_i = src[d]
    has_src = (src_i >= 0) & (src_i < size)
    s_copy = jnp.where(inside, jnp.where(has_src, src_i, lo + i), -1)
    s_roll = jnp.where(inside & has_src & (i < n_seqs), roll[d], 0)  # the other cells move whole
    s_mask = inside & (src_i >= 0)
    roll = jnp.where((i >= lo) & (i < lo + n_seqs), 0, roll)  # the slots' cells (all used)

    ok = ~failed
    placed = cells.replace(pos=pos, seq=seq, roll=roll, hist=hist, tail=tail, head=lo)
    out = jax.tree.map(lambda a, b: jnp.where(ok, b, a), cells, placed)
    out = out.replace(error=out.error | jnp.where(well_formed, jnp.uint32(0), jnp.uint32(ErrorFlag.UBATCH)))
    zero = jnp.int32(0)
    placement = RecurrentPlacement(
        head=jnp.where(ok, lo, zero),
        n=jnp.where(ok, n, zero),
        n_seqs=jnp.where(ok, n_seqs, zero),
        s_copy=jnp.where(ok, s_copy, -1).astype(jnp.int32),
        s_roll=jnp.where(ok, s_roll, 0).astype(jnp.int32),
        s_mask=ok & s_mask,
    )
    return out, placement, ok
