"""The recurrent memory's state rows: which rows a placement moves, and their gathers and scatters.

Each cell has ``n_states`` rows in every state buffer (``[Lg, R, ...]``, ``R = size * n_states``);
a placement moves states by swapping the rows of a few cells (:func:`moving_rows_bound`), and a
step reads and writes the rows of its slots. These helpers index the buffers as flat rows where
the indices fit int32.
"""

from __future__ import annotations


import jax.numpy as jnp

from kvjax._typing import Array, Int
from kvjax.memory._recurrent_cells import RecurrentPlacement
from kvjax.memory._recurrent_config import RecurrentConfig


def moving_rows_bound(config: RecurrentConfig, n_slots: int, *, slots_rewritten: bool = False) -> int:
    """The most state rows that one placement of ``n_slots`` slots moves (:meth:`RecurrentCache.copy_rows`).

    ``2 * n_slots - 1`` cells of ``n_states`` rows each (at most every row). Before a placement every
    used cell reads itself and an empty one nothing
    (:func:`kvjax.memory._recurrent_slots.find_slot_recurrent`). The placement then changes only
    the slots' cells ``head + s`` and the cells their states sat in before the swaps (a
    sequence's own cell, or its copy-on-write cell): states move only by swaps between those, each
    slot making at most one. The lowest of the latter cells is ``head`` itself, so at most
    ``2 * n_seqs - 1`` cells, and only a slot's cell applies a ``roll``. The other cells of the
    range keep their rows and their ``roll``, without which no slot count would bound the rows.
    With ``slots_rewritten`` (the step rewrites the slots' cells whole: :meth:`RecurrentCache.read_states`)
    only the other cells are copied: at most ``n_slots - 1``, as ``n_seqs`` of those ``2 n_seqs - 1``
    cells are the slots'. The property tests check both counts after every placement.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.RecurrentConfig(size=64, n_seq_max=64, n_layer=1, k_shape=(2,), v_shape=(2,))
        >>> moving_rows_bound(cfg, 1), moving_rows_bound(cfg, 32), moving_rows_bound(cfg, 1, slots_rewritten=True)
        (1, 63, 0)
    """
    cells = int(n_slots) - 1 if slots_rewritten else 2 * int(n_slots) - 1
    return min(config.rows, cells * config.n_states)


#: flat row indices (and the past-the-end fill) are int32: buffers of more rows keep the 2-d indexing
_INT32_END = 2**31 - 1


def _flat_rows(x, rows: Int[Array, " n"]) -> Int[Array, " Lg*n"]:
    """Rows ``rows`` of every layer of ``x [Lg, R, ...]`` as indices into ``x`` viewed as ``[Lg * R, ...]``
    (layer major); rows outside ``[0, R)`` map past the end (a scatter drops them)."""
    lg, r = x.shape[:2]
    idx = jnp.arange(lg, dtype=rows.dtype)[:, None] * r + rows[None, :]
    return jnp.where(((rows >= 0) & (rows < r))[None, :], idx, lg * r).reshape(-1)


def take_rows(x, rows: Int[Array, " n"]):
    """``x[:, rows]`` of a state buffer ``x [Lg, R, ...]`` (rows in range).

    A gather of the ``Lg * n`` rows of ``x`` viewed as ``[Lg * R, ...]``: its result comes out in
    ``[Lg, n, ...]`` order, where a gather along axis 1 comes out index first, and every reader
    then transposed it element by element (a one-sequence Mamba step 1.3x slower). A single
    entry is read as two: a one-entry gather compiles to a dynamic-slice that XLA fuses into each
    of its readers, and then, unable to order those reads before the in-place write of the new
    states, it copies every state buffer on each step. A one-row buffer is read as itself.
    """
    lg, r = x.shape[:2]
    if r == 1:  # the buffer is the row (rows are 0)
        return jnp.broadcast_to(x, (lg, rows.shape[0]) + x.shape[2:])
    if lg * rows.shape[0] == 1:
        return take_rows(x, jnp.concatenate([rows, rows]))[:, :1]
    if lg * r >= _INT32_END:  # flat indices would not fit int32
        return jnp.take(x, rows, axis=1, mode="clip")
    flat = x.reshape((lg * r,) + x.shape[2:])
    got = jnp.take(flat, _flat_rows(x, jnp.clip(rows, 0, r - 1)), axis=0, mode="clip")
    return got.reshape((lg, rows.shape[0]) + x.shape[2:])


def started_rows(got, placement: RecurrentPlacement, size: int):
    """The slots' rows ``got [Lg, n_slots, ...]`` with zeros for a new sequence (``s_mask`` false) and
    for the slots past ``n_seqs``: a select, so a NaN in a reused row cannot leak into a new state."""
    slot = jnp.arange(got.shape[1])
    # a reduction, so XLA computes the flags once: as a gather and a compare it fused their scalar
    # chain (the placement's) into every element of every layer's read, 3-4x those fusions' time
    keep = jnp.any(
        (jnp.arange(size)[None] == slot[:, None]) & placement.s_mask[None] & (slot < placement.n_seqs)[:, None], axis=1
    )
    return jnp.where(keep.reshape((1, -1) + (1,) * (got.ndim - 2)), got, jnp.zeros((), got.dtype))


def set_rows(x, rows: Int[Array, " n"], values):
    """``x`` with ``x[:, rows] = values`` (``values [Lg, n, ...]``), rows outside ``[0, R)`` dropped.

    A scatter of ``Lg * n`` rows into ``x`` viewed as ``[Lg * R, ...]`` (the updates in their own
    order, as :func:`take_rows` reads). A single entry is written twice (the same values): a
    one-entry write compiles to a select around a dynamic-update-slice, a fusion into which
    XLA:CPU pulls the whole state update and runs it slowly (1.3 ms of a 3.7 ms Mamba step), or,
    in ``copy_rows``, answers with copies of the buffers; a scatter keeps both apart. (A dropped
    second entry of zeros measured as slow.) A one-row buffer (a one-cell memory) is replaced
    whole by a select: as a gather and scatter over its one row XLA copied it four times a step.
    """
    lg, r = x.shape[:2]
    n = rows.shape[0]
    if r == 1:  # the buffer is the row: a select, in place, no scatter
        hit = rows == 0
        if n == 1:
            chosen = values
        else:  # the entry for row 0 (one at most: a one-cell memory has one slot)
            chosen = jnp.sum(
                jnp.where(hit.reshape((1, n) + (1,) * (values.ndim - 2)), values, 0), axis=1, keepdims=True
            )
        return jnp.where(jnp.any(hit), chosen.astype(x.dtype), x)
    if lg * n == 1:
        rows, values, n = jnp.concatenate([rows, rows]), jnp.concatenate([values, values], axis=1), 2
    if lg * r >= _INT32_END:  # flat indices would not fit int32
        return x.at[:, rows].set(values, mode="drop")
    flat = x.reshape((lg * r,) + x.shape[2:])
    out = flat.at[_flat_rows(x, rows)].set(values.reshape((lg * n,) + x.shape[2:]), mode="drop")
    return out.reshape(x.shape)


def row_sources(placement: RecurrentPlacement, config: RecurrentConfig) -> Int[Array, " R"]:
    """For every state row, the row it is copied from (itself when nothing moves)."""
    kk, size = config.n_states, config.size
    row = jnp.arange(config.rows)
    cell, j = row // kk, row % kk
    i = cell - placement.head
    inside = (i >= 0) & (i < placement.n)
    ic = jnp.clip(i, 0, size - 1)
    copy, roll, mask = placement.s_copy[ic], placement.s_roll[ic], placement.s_mask[ic]
    moves = inside & mask & (j < kk - roll)
    return jnp.where(moves, copy * kk + roll + j, row).astype(jnp.int32)
