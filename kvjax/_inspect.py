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

from typing import NamedTuple

import numpy as np

from kvjax.memory._seqbits import unpack
from kvjax.memory._unified import KVCache, require_cache

_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class CellTable(NamedTuple):
    """Host copy of the cells.

    Attributes:
        pos: ``int32 [C]`` positions, -1 for empty cells.
        seqs: ``bool [C, S]`` sequence membership.
        delta: ``int32 [C]`` pending shifts.
        head: where the next contiguous search starts.
    """

    pos: np.ndarray
    seqs: np.ndarray
    delta: np.ndarray
    head: int


def cell_table(cache: KVCache) -> CellTable:
    """The cells as numpy arrays (one device-to-host transfer)."""
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
    pad = cache.config.padding
    n_kv = min(size, max(pad, -(-cmax // pad) * pad))
    chars = "".join(_cell_char(row) for row in table.seqs)
    lines = [chars[i:i + width] for i in range(0, size, width)]
    header = f"cells {used}/{size} used, head {table.head}, n_kv {n_kv}, cell_max {cmax}"
    return "\n".join([header] + lines)
