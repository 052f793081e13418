"""A pure-Python model of the seed's defragmentation (``defrag_sched`` / ``defrag_prepare``) and of
kvjax's two compactions, on plain lists of cells.

A cell is a tuple ``(pos, seqs)``: its position (-1 when empty) and the set of sequence ids sharing
it; the cell is empty iff ``seqs`` is empty. Every function returns a :class:`Moved`: the new list
of cells, ``dest`` (old index -> new index, for every non-empty cell that changed place), the
number of moves and the new ``head``.

:func:`defrag_prepare` walks the cells the way the seed does, with no vectorization, so that it is
an independent check of kvjax's prefix-sum plan: find a hole below ``n_used``, measure it, search
from the end of the cache for as many used cells not yet moved, move them into the hole in
increasing cell order, counting one move per run of adjacent source cells, and stop when the cap is
reached (at a gap between runs or after a hole). ``head`` becomes ``n_used`` as soon as a cell
moves.

kvjax's documented differences from the seed are encoded here, because they are what kvjax is
specified to do: ``max_moves=None`` means no cap, and ``max_moves=0`` moves nothing.

Example:
    >>> cells = [(0, {0}), (-1, set()), (-1, set()), (3, {0}), (4, {0}), (5, {0})]
    >>> out = defrag_prepare(cells, head=0)
    >>> [c[0] for c in out.cells], out.dest, out.n_moves, out.head
    ([0, 4, 5, 3, -1, -1], {4: 1, 5: 2}, 1, 4)
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

#: One cell: its position and the set of sequences sharing it.
Cell = Tuple[int, Set[int]]

EMPTY: Cell = (-1, set())


class Moved(NamedTuple):
    """The result of a plan applied to a list of cells."""

    cells: List[Cell]
    dest: Dict[int, int]
    n_moves: int
    head: int


def _copy(cells: Sequence[Cell]) -> List[Cell]:
    return [(int(p), set(s)) for p, s in cells]


def used(cells: Sequence[Cell]) -> int:
    """Number of non-empty cells."""
    return sum(1 for _, s in cells if s)


def cell_max(cells: Sequence[Cell]) -> int:
    """One past the last non-empty cell (0 when all are empty)."""
    last = [i for i, (_, s) in enumerate(cells) if s]
    return last[-1] + 1 if last else 0


def n_kv(cells: Sequence[Cell], padding: int) -> int:
    """The seed's window ``min(size, max(padding, pad(cell_max, padding)))``."""
    padded = -(-cell_max(cells) // padding) * padding
    return min(len(cells), max(padding, padded))


def fragmentation(cells: Sequence[Cell], padding: int) -> float:
    """The seed's measure: ``max(0, 1 - (used + padding) / n)`` when ``n >= 2048``, else 0."""
    n = n_kv(cells, padding)
    return max(0.0, 1.0 - (used(cells) + padding) / n) if n >= 2048 else 0.0


def count_runs(dest: Dict[int, int]) -> int:
    """Moves counted as runs: consecutive destinations fed by consecutive sources."""
    pairs = sorted((d, s) for s, d in dest.items())
    runs = 0
    for k, (d, s) in enumerate(pairs):
        if k == 0 or d != pairs[k - 1][0] + 1 or s != pairs[k - 1][1] + 1:
            runs += 1
    return runs


def defrag_prepare(cells: Sequence[Cell], head: int, max_moves: Optional[int] = None) -> Moved:
    """The seed's ``defrag_prepare``: fill the holes below ``n_used`` from the end of the cache."""
    cells = _copy(cells)
    n_used = used(cells)
    top = cell_max(cells)
    cap = float("inf") if max_moves is None else max_moves
    dest: Dict[int, int] = {}
    n_moves = 0
    if cap == 0:
        return Moved(cells, dest, 0, head)
    i0 = 0
    while i0 < n_used:
        if cells[i0][1]:
            i0 += 1
            continue
        hole = 1
        while i0 + hole < n_used and not cells[i0 + hole][1]:
            hole += 1
        # Walk down from the last cell, collecting used cells that have not moved yet (a moved
        # cell is empty now, so emptiness says both).
        sources = []
        i = top - 1
        while len(sources) < hole and i > i0:
            if cells[i][1]:
                sources.append(i)
            i -= 1
        assert len(sources) == hole, "fewer movable cells than holes: the used count is wrong"
        sources.reverse()
        stop = False
        prev = None
        for k, s in enumerate(sources):
            starts_run = prev is None or s != prev + 1
            if starts_run and prev is not None and n_moves == cap:
                stop = True
                break
            if starts_run:
                n_moves += 1
            cells[i0 + k] = cells[s]
            cells[s] = (-1, set())
            dest[s] = i0 + k
            head = n_used
            prev = s
        if stop or n_moves == cap:
            break
        i0 += hole
    return Moved(cells, dest, n_moves, head)


def _partition(cells: Sequence[Cell], head: int, key) -> Moved:
    cells = _copy(cells)
    order = sorted(range(len(cells)), key=lambda i: (key(cells[i]), i))
    new = [cells[i] if cells[i][1] else (-1, set()) for i in order]
    dest = {old: new_i for new_i, old in enumerate(order) if cells[old][1] and old != new_i}
    return Moved(new, dest, count_runs(dest), used(cells) if dest else head)


def compact(cells: Sequence[Cell], head: int) -> Moved:
    """Every used cell to the front, order kept; ``head`` = used when anything moved."""
    return _partition(cells, head, lambda c: 0 if c[1] else 2)


def compact_seq(cells: Sequence[Cell], head: int, seq_id: int) -> Moved:
    """The cells of ``seq_id`` first, then the other used cells, then the empty ones (each in order)."""
    return _partition(cells, head, lambda c: 0 if seq_id in c[1] else (1 if c[1] else 2))
