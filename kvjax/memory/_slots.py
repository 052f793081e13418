"""Slot placement: where the tokens of a ubatch go, as pure jitted functions on the cells.

Two policies:

- **contiguous** (default, the seed's ``find_slot`` exactly): when ``head > used + 2 * n`` the
  search restarts at cell 0; then the first window of ``n`` free cells is taken, scanning start
  positions from ``head`` up to ``size - n`` and then wrapping to ``[0, head)``. ``head`` ends at
  the window's first cell. It fails when no window is free or ``n > size``.
- **scattered** (``contiguous=False``, in the spirit of newer llama.cpp's non-contiguous slots):
  the first ``n`` free cells in cyclic order from ``head`` (after the same reset rule), so
  fragmentation never refuses a batch that fits; ``head`` ends one past the last cell used.

The seed scans cell by cell in a host loop; here the search is a prefix sum of occupied cells
(window occupancy in O(1) per start) and an argmin over the cyclic order, O(C) on device.

Restore and commit: a cache value never changes, so keep the value from before the ubatch (or
before the batch) and return to it on failure; that is the seed's ``restore``. Committing is
dropping that reference. ``find_slot`` itself never changes the cells when ``ok`` is false, and
:func:`prepare` places all ubatches of a batch to see whether they fit and keeps nothing.

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch([0, 1, 2], [[0], [0], [1]]))
    >>> slot.tolist(), bool(ok)
    ([0, 1, 2, -1], True)
"""

from __future__ import annotations

import functools
from typing import Sequence, Tuple

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Bool, Int
from kvjax.memory._cells import Cells, prefix_sum
from kvjax._errors import ErrorFlag
from kvjax.memory._ubatch import Ubatch


#: Static ubatch lengths up to this test a window of ``n`` free cells by ``length`` shifted ANDs
#: (one fused pass over the cells); longer ones use a prefix sum of occupied cells (a log-depth
#: scan, ~10 passes). Decode ubatches (1 to a few tokens per sequence) take the first way.
WINDOW_UNROLL = 16


def _reset_head(cells: Cells, n) -> Int[Array, ""]:
    """The seed's heuristic: restart from cell 0 when enough cells before head are unused."""
    # a cell is used iff its position is >= 0: one read of pos instead of the W sequence words
    used = jnp.sum(cells.pos >= 0, dtype=jnp.int32)
    return jnp.where(cells.head > used + 2 * n, 0, cells.head)


def _window_free(cells: Cells, n, length: int) -> Bool[Array, " C"]:
    """``bool[C]``: whether the ``n`` cells from each start are free and inside the cache."""
    size = cells.size
    free = cells.pos < 0
    if length <= WINDOW_UNROLL:
        padded = jnp.concatenate([free, jnp.zeros(length, jnp.bool_)])  # past the end: not free
        fits = jnp.ones(size, jnp.bool_)
        for k in range(length):
            fits = fits & ((k >= n) | padded[k : k + size])
        return fits
    occupied = (~free).astype(jnp.int32)
    prefix = jnp.concatenate([jnp.zeros(1, jnp.int32), prefix_sum(occupied)])
    starts = jnp.arange(size, dtype=jnp.int32)
    ends = starts + n
    window = prefix[jnp.minimum(ends, size)] - prefix[starts]
    return (ends <= size) & (window == 0)


def _contiguous_start(cells: Cells, head, n, length: int):
    """First start of ``n`` free cells in cyclic start order from ``head``; (found, start)."""
    size = cells.size
    starts = jnp.arange(size, dtype=jnp.int32)
    # the cyclic distances are distinct, so the smallest one names a single start
    order = jnp.min(jnp.where(_window_free(cells, n, length), (starts - head) % size, size))
    return order < size, ((order + head) % size).astype(jnp.int32)


def _scattered_cells(cells: Cells, head, length: int):
    """Indices of the first ``length`` free cells in cyclic order from ``head`` (size-padded)."""
    size = cells.size
    idx = jnp.arange(size, dtype=jnp.int32)
    free = cells.pos < 0
    # one prefix sum: a free cell's rank counts the free cells from head, wrapping around
    count = prefix_sum(free)
    n_free = count[-1]
    n_before = jnp.where(head > 0, count[jnp.maximum(head - 1, 0)], 0)
    rank = jnp.where(idx >= head, count - 1 - n_before, n_free - n_before + count - 1)
    rank = jnp.where(free & (rank < length), rank, length)
    picked = jnp.full((length,), size, jnp.int32).at[rank].set(idx, mode="drop")
    return n_free, picked


def _token_ok(cells: Cells, ubatch: Ubatch) -> Bool[Array, ""]:
    """Every valid token has a position >= 0 and only ids in [0, n_seq_max) (and at least one)."""
    ids = ubatch.seq_ids
    ids_ok = jnp.all((ids == -1) | ((ids >= 0) & (ids < cells.n_seq_max)), axis=1) & (ids[:, 0] >= 0)
    return jnp.all(~ubatch.valid | (ids_ok & (ubatch.pos >= 0)))


@functools.partial(jax.jit, static_argnames="contiguous")
def _find_slot(cells: Cells, ubatch: Ubatch, contiguous: bool):
    """The fields placement changes: ``(pos, seq, head, error, slot, ok)``."""
    size = cells.size
    length = ubatch.length
    n = ubatch.n_tokens()
    head = _reset_head(cells, n)
    rank = prefix_sum(ubatch.valid) - 1
    tokens_ok = _token_ok(cells, ubatch)
    if contiguous:
        found, start = _contiguous_start(cells, head, n, length)
        slot = start + rank
        new_head = start
    else:
        n_free, picked = _scattered_cells(cells, head, length)
        found = n <= n_free
        slot = picked[jnp.clip(rank, 0, length - 1)]
        last = picked[jnp.clip(n - 1, 0, length - 1)]
        new_head = jnp.where(n > 0, (last + 1) % size, head)
    ok = found & (n <= size) & tokens_ok
    slot = jnp.where(ubatch.valid & ok, slot, -1).astype(jnp.int32)
    # a refused ubatch scatters nothing (every row falls outside and is dropped), so the cells
    # stay as they were without a select of every array between the old and the new value
    target = jnp.where(slot >= 0, slot, size)
    pos = cells.pos.at[target].set(ubatch.pos.astype(jnp.int32), mode="drop")
    seq = cells.seq.at[target].set(ubatch.seq_mask(cells.n_words), mode="drop")
    head = jnp.where(ok, new_head, cells.head).astype(jnp.int32)
    error = jnp.where(tokens_ok, cells.error, cells.error | jnp.uint32(ErrorFlag.UBATCH))
    return pos, seq, head, error, slot, ok


def find_slot_cells(
    cells: Cells, ubatch: Ubatch, contiguous: bool = True
) -> Tuple[Cells, Int[Array, " T"], Bool[Array, ""]]:
    """Place a ubatch into the cells.

    Args:
        cells: the cells before placement.
        ubatch: the tokens (only ``valid`` rows are placed, in row order).
        contiguous: the seed's contiguous search (True) or scattered placement (False).

    Returns:
        ``(cells, slot i32[T], ok)``: the cells with the tokens placed (unchanged when not ok),
        the cell of every token (-1 for padding rows, and for all rows when not ok), and whether
        the ubatch was placed. The shifts (``delta``, zero in a free cell) are ``cells``' own
        array: only the fields placement changes come out of the jitted core (see ``_cells``).
    """
    pos, seq, head, error, slot, ok = _find_slot(cells, ubatch, contiguous=bool(contiguous))
    return cells.replace(pos=pos, seq=seq, head=head, error=error), slot, ok


@functools.partial(jax.jit, static_argnames="contiguous")
def prepare_cells(cells: Cells, ubatches: Sequence[Ubatch], contiguous: bool = True):
    """Dry run: place every ubatch in turn on a scratch copy; report whether all fit.

    Returns:
        ``(ok, slots)``: one flag for the whole batch and the slot array of each ubatch (as they
        would be placed). The cells themselves are not returned: nothing is kept.
    """
    ok = jnp.bool_(True)
    slots = []
    for ub in ubatches:
        cells, slot, ub_ok = find_slot_cells(cells, ub, contiguous=contiguous)
        ok = ok & ub_ok
        slots.append(slot)
    return ok, tuple(slots)
