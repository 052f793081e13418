"""A pure-Python model of the seed's unified KV cache cells (``llama_kv_cache_unified``).

This is the behaviour reference the property tests compare kvjax against, cell by cell. It is
deliberately naive: a list of :class:`Cell` objects (a position, a set of sequence ids, a pending
shift), a ``head`` and a ``used`` counter kept up to date by every operation the way the seed
keeps its own, so that ``used`` is an independent check of kvjax's derived count. Every operation
is a plain loop over the cells, in cell order, as the seed runs it; the contiguous slot search is
the seed's cursor walk (jump past an occupied cell, wrap when the window would run off the end,
give up after ``size`` cells were tested), not a vectorized search, so it is an independent check
of kvjax's prefix-sum search.

Conventions from the seed: ranges are ``[p0, p1)`` with ``p0 < 0`` meaning 0 and ``p1 < 0``
meaning +infinity (the int32 maximum); an empty cell has ``pos == -1`` and no sequence.

kvjax's documented deliberate differences from the seed are encoded here (see
``docs/architecture.md`` section 2), because they are what kvjax is specified to do:

- every cell that becomes empty gets ``delta = 0`` (the seed keeps the stale shift);
- ``seq_id = -1`` means "every sequence" in ``seq_rm``, ``seq_add``, ``seq_div``,
  ``seq_pos_min`` and ``seq_pos_max``, and ``seq_keep(-1)`` keeps everything (a no-op: head is
  not moved either); the seed gives ``-1`` a meaning only in ``seq_rm``;
- a ``find_slot`` that fails changes nothing, ``head`` included (the seed leaves the head where
  its reset heuristic and its search moved it);
- a placed token gets every one of its sequence ids.

Invalid arguments (a seq id out of range, ``d <= 0``) are not modelled: the caller keeps them
valid. The one rejection that is modelled is the seed's: a ubatch with more tokens than cells
fails.

Example:
    >>> ref = UnifiedRef(size=8, n_seq_max=2, padding=4)
    >>> ref.find_slot([(0, [0]), (1, [0]), (2, [0, 1])])
    ([0, 1, 2], True)
    >>> ref.seq_rm(0, 1, -1)
    >>> [(c.pos, sorted(c.seqs)) for c in ref.cells[:3]], ref.head, ref.used
    ([(0, [0]), (-1, []), (2, [1])], 0, 2)
"""

from __future__ import annotations

import dataclasses
from typing import List, Sequence, Set, Tuple

#: The seed's ``std::numeric_limits<llama_pos>::max()``, the meaning of ``p1 < 0``.
POS_MAX = 2**31 - 1

#: One token of a ubatch: its position and its sequence ids (the first is its primary one).
Token = Tuple[int, Sequence[int]]


@dataclasses.dataclass
class Cell:
    """One cell: ``pos`` (-1 when empty), the sequences sharing it, the pending shift."""

    pos: int = -1
    seqs: Set[int] = dataclasses.field(default_factory=set)
    delta: int = 0

    def is_empty(self) -> bool:
        return not self.seqs

    def holds(self, seq_id: int) -> bool:
        """Whether the cell belongs to ``seq_id``; for ``seq_id < 0``: to any sequence."""
        return bool(self.seqs) if seq_id < 0 else seq_id in self.seqs

    def free(self) -> None:
        """Make the cell empty; its pending shift goes too (kvjax's deliberate difference)."""
        self.pos = -1
        self.seqs = set()
        self.delta = 0


def _bounds(p0: int, p1: int) -> Tuple[int, int]:
    return (0 if p0 < 0 else p0), (POS_MAX if p1 < 0 else p1)


class UnifiedRef:
    """The seed's unified cache cells, with kvjax's deliberate differences.

    Args:
        size: number of cells.
        n_seq_max: number of sequence ids (only used by :meth:`check_invariants`).
        padding: granularity of the attention window :meth:`n_kv`.
    """

    def __init__(self, size: int, n_seq_max: int, padding: int):
        self.size = size
        self.n_seq_max = n_seq_max
        self.padding = padding
        self.cells: List[Cell] = [Cell() for _ in range(size)]
        self.head = 0
        self.used = 0
        #: how many times find_slot's "restart from cell 0" heuristic fired (for test coverage)
        self.resets = 0
        #: how many times the contiguous search wrapped around the end (for test coverage)
        self.wraps = 0

    # -- sequence operations --------------------------------------------------------------

    def clear(self) -> None:
        for cell in self.cells:
            cell.free()
        self.head = 0
        self.used = 0

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> None:
        p0, p1 = _bounds(p0, p1)
        first_freed = None
        for i, cell in enumerate(self.cells):
            if not p0 <= cell.pos < p1:
                continue
            if seq_id < 0:
                cell.seqs.clear()
            elif seq_id in cell.seqs:
                cell.seqs.discard(seq_id)
            else:
                continue
            if cell.is_empty():
                cell.free()
                self.used -= 1
                if first_freed is None:
                    first_freed = i
        # the search restarts at a freed cell only when that is earlier than the current head
        if first_freed is not None and first_freed < self.head:
            self.head = first_freed

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if src == dst:
            return
        p0, p1 = _bounds(p0, p1)
        self.head = 0  # the seed restarts the search for every real copy, even an empty one
        for cell in self.cells:
            if cell.holds(src) and p0 <= cell.pos < p1:
                cell.seqs.add(dst)

    def seq_keep(self, seq_id: int) -> None:
        if seq_id < 0:
            return  # kvjax: -1 keeps every sequence (the seed would empty the whole cache)
        first_other = None
        for i, cell in enumerate(self.cells):
            if cell.holds(seq_id):
                cell.seqs = {seq_id}
                continue
            # an already empty cell counts as "not holding seq_id" for the new head too
            if cell.pos >= 0:
                self.used -= 1
            cell.free()
            if first_other is None:
                first_other = i
        if first_other is not None and first_other < self.head:
            self.head = first_other

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        if delta == 0:
            return
        p0, p1 = _bounds(p0, p1)
        if p0 == p1:
            return  # p0 > p1 is not caught here: it goes on and resets head like any shift
        first_freed = None
        for i, cell in enumerate(self.cells):
            if not (cell.holds(seq_id) and p0 <= cell.pos < p1):
                continue
            cell.pos += delta
            cell.delta += delta
            if cell.pos < 0:
                self.used -= 1
                cell.free()
                if first_freed is None:
                    first_freed = i
        # unlike seq_rm, the head always moves: to the first freed cell, else to 0
        self.head = 0 if first_freed is None else first_freed

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        assert d >= 1, "the reference models valid divisors only"
        if d == 1:
            return
        p0, p1 = _bounds(p0, p1)
        for cell in self.cells:
            if cell.holds(seq_id) and p0 <= cell.pos < p1:
                old = cell.pos
                cell.pos = old // d  # old >= p0 >= 0: floor equals C's truncation
                cell.delta += cell.pos - old

    # -- queries --------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        found = [c.pos for c in self.cells if c.holds(seq_id)]
        return min(found) if found else -1

    def seq_pos_max(self, seq_id: int) -> int:
        found = [c.pos for c in self.cells if c.holds(seq_id)]
        return max(found) if found else -1

    def pos_max(self) -> int:
        return max([-1] + [c.pos for c in self.cells])

    def n_tokens(self) -> int:
        return sum(len(c.seqs) for c in self.cells)

    def used_cells(self) -> int:
        return self.used

    def cell_max(self) -> int:
        for i in range(self.size, 0, -1):
            cell = self.cells[i - 1]
            if cell.pos >= 0 and not cell.is_empty():
                return i
        return 0

    def n_kv(self) -> int:
        pad = self.padding
        padded = -(-self.cell_max() // pad) * pad
        return min(self.size, max(pad, padded))

    # -- placement ------------------------------------------------------------------------

    def _reset_head(self, n: int) -> int:
        """Where the search starts: cell 0 when enough cells before head are unused."""
        if self.head > self.used + 2 * n:
            self.resets += 1
            return 0
        return self.head

    def _contiguous(self, head: int, n: int):
        """The seed's cursor walk for a window of ``n`` free cells; (start or None)."""
        tested = 0
        while True:
            if head + n > self.size:
                # the window would run off the end: count the skipped tail, restart at 0
                tested += self.size - head
                head = 0
                self.wraps += 1
                continue
            blocked = next((i for i in range(n) if self.cells[head + i].pos >= 0), None)
            if blocked is None:
                return head
            # no window can start at or before the occupied cell: jump past it
            head += blocked + 1
            tested += blocked + 1
            if tested >= self.size:
                return None

    def _scattered(self, head: int, n: int):
        """The first ``n`` free cells in cyclic order from ``head``; None when fewer are free."""
        picked = []
        for k in range(self.size):
            i = (head + k) % self.size
            if len(picked) < n and self.cells[i].pos < 0:
                picked.append(i)
        return picked if len(picked) == n else None

    def find_slot(self, tokens: Sequence[Token], contiguous: bool = True) -> Tuple[List[int], bool]:
        """Place the tokens; returns ``(cell of each token, ok)``; nothing changes when not ok."""
        n = len(tokens)
        if n > self.size:
            return [], False
        head = self._reset_head(n)
        if contiguous:
            start = self._contiguous(head, n)
            slots = None if start is None else list(range(start, start + n))
            new_head = start
        else:
            slots = self._scattered(head, n)
            new_head = head if not slots else (slots[-1] + 1) % self.size
        if slots is None:
            return [], False  # kvjax: a failed search leaves head (and everything) as it was
        for i, (pos, seq_ids) in zip(slots, tokens):
            cell = self.cells[i]
            cell.pos = int(pos)
            cell.seqs.update(int(s) for s in seq_ids)
        self.used += n
        self.head = new_head
        return slots, True

    # -- self-check -----------------------------------------------------------------------

    def check_invariants(self) -> None:
        """The facts every state must satisfy (raises AssertionError otherwise)."""
        for i, cell in enumerate(self.cells):
            if cell.is_empty():
                assert cell.pos == -1 and cell.delta == 0, (i, cell)
            else:
                assert cell.pos >= 0, (i, cell)
                assert all(0 <= s < self.n_seq_max for s in cell.seqs), (i, cell)
        assert self.used == sum(not c.is_empty() for c in self.cells), self.used
        assert 0 <= self.head < self.size, self.head
