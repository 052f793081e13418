"""Looking at a cache from the host: the cell table as numpy, and a compact text map.

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4), [[0], [0], [0, 1], [1]]))
    >>> cache, _ = kvjax.seq_rm(cache, 0, 1, 2)
    >>> print(kvjax.cell_map(cache))
    cells 3/32 used, head 0, n_kv 32, cell_max 4
    0.+1............................
    >>> kvjax.cell_table(cache).seqs[:4].astype(int).tolist()
    [[1, 0], [0, 0], [1, 1], [0, 1]]
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import numpy as np

from kvjax.memory._seqbits import unpack
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._recurrent import RecurrentCache

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class CellTable(NamedTuple):
    """Host copy of the cells.

    Attributes:
        pos: ``int32 [C]`` positions, -1 for empty cells.
        seqs: ``bool [C, S]`` sequence membership.
        delta: ``int32 [C]`` pending shifts (zeros for a recurrent memory).
        head: where the next contiguous search starts.
        src: recurrent memory only: ``int32 [C]`` the cell each state is read from (the cell
            itself when used, -1 when empty: copies are carried by placements, never pending).
        tail: recurrent memory only: ``int32 [S]`` the cell holding each sequence's state, -1: none.
        roll: recurrent memory only: ``int32 [C]`` the row of the cell holding its current state.
        hist: recurrent memory only: ``int32 [C]`` states kept (rollback depth + 1).
    """

    pos: np.ndarray
    seqs: np.ndarray
    delta: np.ndarray
    head: int
    src: Optional[np.ndarray] = None
    tail: Optional[np.ndarray] = None
    roll: Optional[np.ndarray] = None
    hist: Optional[np.ndarray] = None


def cell_table(cache: KVCache) -> CellTable:
    """The cells as numpy arrays (one device-to-host transfer).

    Works on a unified cache (an attention part: ``memory.part(i)``, or ``memory.base`` /
    ``memory.swa`` of the iSWA pair) and on a recurrent memory (then with ``src``, ``tail``,
    ``roll`` and ``hist``).
    """
    if isinstance(cache, RecurrentCache):
        cells = jax.device_get(cache.cells)
        seqs = unpack(np.asarray(cells.seq), cells.n_seq_max)
        used = seqs.any(axis=1)
        return CellTable(
            np.asarray(cells.pos),
            seqs,
            np.zeros_like(cells.pos),
            int(cells.head),
            src=np.where(used, np.arange(len(used)), -1).astype(np.int32),
            tail=np.asarray(cells.tail),
            roll=np.asarray(cells.roll),
            hist=np.asarray(cells.hist),
        )
    require_cache(cache, "cell_table")
    cells = cache.cells
    seqs = unpack(np.asarray(cells.seq), cells.n_seq_max)
    return CellTable(np.asarray(cells.pos), seqs, np.asarray(cells.delta), int(cells.head))


def _cell_char(members: np.ndarray) -> str:
    ids = np.flatnonzero(members)
    if ids.size == 0:
        return "."
    if ids.size > 1:
        return "+"
    return _DIGITS[ids[0]] if ids[0] < len(_DIGITS) else "#"


def cell_map(cache: KVCache, width: int = 64) -> str:
    """A text picture of occupancy, one character per cell, ``width`` cells per line.

    ``.`` is an empty cell, a digit or letter the single sequence holding the cell (0-9, a-z,
    A-Z; ``#`` beyond), ``+`` a cell shared by several sequences. The first line gives the
    counts.
    """
    if isinstance(width, bool) or not isinstance(width, (int, np.integer)) or width < 1:
        raise ValueError(f"width={width!r} is out of range: allowed an integer >= 1")
    table = cell_table(cache)
    used = int(table.seqs.any(axis=1).sum())
    size = table.pos.shape[0]
    nz = np.flatnonzero(table.seqs.any(axis=1))
    cmax = int(nz[-1]) + 1 if nz.size else 0
    chars = "".join(_cell_char(row) for row in table.seqs)
    lines = [chars[i : i + width] for i in range(0, size, width)]
    if table.tail is not None:  # a recurrent memory: no attention window
        header = f"cells {used}/{size} used, head {table.head}, tails {table.tail.tolist()}"
        return "\n".join([header] + lines)
    pad = cache.config.padding
    n_kv = min(size, max(pad, -(-cmax // pad) * pad))
    header = f"cells {used}/{size} used, head {table.head}, n_kv {n_kv}, cell_max {cmax}"
    return "\n".join([header] + lines)
