"""A pure-Python model of the seed's recurrent-state cache (``llama_kv_cache_recurrent``).

The behaviour reference for kvjax's recurrent memory (Mamba, RWKV: one fixed-size state per
sequence instead of one K/V row per token). Cells, in the seed's terms:

- a cell holds one state; ``pos`` is the position of the last token folded into it (-1 when the
  cell is empty), ``seqs`` the sequences whose current state it is (several after ``seq_cp``,
  which shares a state instead of copying it);
- ``src`` is the cell whose row the state must be read from before the next ubatch runs on it
  (``-1``: the state is new and starts from zeros); it is how the seed moves and copies states
  without touching them in the sequence operations;
- ``tail[seq]`` is the cell holding sequence ``seq``'s state (-1: none). The seed stores it in
  ``cells[seq].tail``; here it is a list of ``n_seq_max`` entries.

Operations, as the seed runs them (plain loops over the cells, in cell order):

- ``seq_rm`` refuses (returns False, changes nothing) a removal that would cut a sequence's state
  in the middle: a range starting inside ``(0, pos]`` or ending inside ``(0, pos]`` of the
  sequence's tail cell; with ``seq < 0`` anything but an empty range or the whole range
  ``[0, inf)``; and a seq id ``>= n_seq_max``. Otherwise it frees what the range covers (the
  whole state or nothing) and moves ``head`` back to the first freed cell when that is earlier;
- ``seq_cp(src, dst)`` drops ``dst``'s state and shares ``src``'s tail cell with ``dst`` (the
  position range is ignored: a state cannot be split);
- ``seq_keep(seq)`` frees every cell without ``seq`` and forgets every other tail;
- ``seq_add`` / ``seq_div`` change the position of the sequence's tail cell only, when it lies
  in the range (a shared cell moves for every sequence sharing it, as in the seed);
- ``find_slot(ubatch)`` takes an equal-split ubatch: ``n_seqs`` sequence slots of
  ``n_seq_tokens`` tokens each, a slot being ``(positions, seq_ids)`` whose first id is its
  primary sequence. It (1) drops the current state of every secondary id (they join the
  primary's state), (2) gives every primary sequence a cell of its own: its tail when no other
  sequence shares it, else the next empty cell (in cyclic order from ``head``), which takes over
  the shared tail's ``pos`` and ``src`` (copy-on-write: the state will be copied from there), or
  an empty cell with ``src = -1`` for a new sequence; (3) swaps cells so that slot ``s`` sits in
  cell ``min + s``, ``min`` being the lowest of those cells; (4) sets each slot's cell to the
  slot's last position and seq ids; then ``head = min`` and ``n = max - min + 1`` (``max`` the
  highest cell before the swaps, so the range also covers the cells swapped out of the way);
- the model step reads ``s_copy(i)`` (the row holding cell ``head + i``'s state: its ``src``,
  or the cell itself when ``src`` is out of range) and ``s_mask(i)`` (0 when the state is new and
  must be zeroed) for ``i`` in ``[0, n)``; the seed computes both while setting the graph's
  inputs and then points ``src`` of those cells at themselves so a copy happens once.
  :meth:`RecurrentRef.set_inputs` returns both lists and makes that change. (The seed's two
  input callbacks each make it; the values returned here are those of the mask read first, as
  the seed's original input code did: read copy-first, a new sequence's mask would be 1.)

kvjax's deliberate differences from the seed, encoded here:

- **tails are swapped by value** (newer llama.cpp). When the seed swaps two cells to make the
  ubatch's range contiguous, it re-points only the tails of the sequences the two cells hold. A
  new sequence's reserved cell holds no sequence yet, so after it is swapped away its tail still
  names the old index, where a third sequence's cell now sits; that cell is then swapped again and
  overwritten, and the third sequence's state is lost (and the new sequence starts from another
  sequence's state). kvjax swaps every tail equal to either index, so the reserved cell is
  followed. ``tests/test_recurrent_reference.py`` shows the case;
- **an empty cell always has ``src = -1``** (its history is forgotten too): the seed also points
  the ``src`` of an *empty* cell inside ``[head, head + n)`` at itself, and a new sequence later
  given that cell reads it as an existing state (mask 1) and starts from a stale row instead of
  zeros;
- ``-1`` means every sequence in ``seq_add``, ``seq_div``, ``seq_pos_min`` / ``seq_pos_max``
  (each used cell in the range once) and ``seq_keep`` (keeps everything); the seed ignores
  ``-1`` there (``seq_keep(-1)`` empties the cache);
- ``seq_rm(-1, [0, inf))`` also forgets every tail (the seed leaves tails naming freed cells,
  and its next ``find_slot`` for such a sequence trips an assertion);
- ``seq_add`` that would push a state's position below 0 is refused, nothing changed: a state
  holds the whole sequence, so it is never dropped (the unified cache frees such cells: each holds
  one token; the seed keeps a used cell at a negative position that no ``seq_rm`` can ever remove);
- a ``find_slot`` that fails (a seq id out of range, no empty cell for a sequence that needs
  one) changes nothing, ``head`` included; the seed asserts on a missing empty cell and may
  already have changed cells when it meets a bad seq id. Reserved cells are never handed out
  twice (with too few cells the seed's search can return the same reserved, still empty, cell).

The kvjax extension: keeping the last ``k`` states of each sequence (``n_states = k``; newer
llama.cpp's ``n_rs_seq`` extra snapshots are ``k - 1``), so that a speculative decode can be
rolled back. With ``k = 1`` every rule below reduces to the seed's. The spec:

- **Rows.** Every cell owns ``k`` state rows, ``(cell, j)`` for ``j`` in ``[0, k)``, flat index
  ``cell * k + j`` (llama.cpp's ``mem_size * (1 + n_rs_seq)`` rows). The snapshots of a state
  live in the rows of the cell holding it: they are shared, copied, moved and freed with it, so
  no other cell is ever reserved for them.
- **Cell metadata.** Two more fields: ``roll``, the row (inside ``src``'s rows) where the
  current state is, and ``hist``, how many states are kept, counted from ``roll``: row
  ``roll + j`` of ``src`` is the state after position ``pos - j`` for ``j < hist``. An empty
  cell has ``roll = 0, hist = 0``; a used cell has ``1 <= hist <= k - roll``.
- **Rollback.** ``seq_rm(seq, p0, p1)`` with ``0 < p0 <= pos < p1`` (``pos`` the tail's) is no
  longer refused when ``j = pos - p0 + 1 < hist`` and no other sequence shares the tail cell: the
  state after position ``p0 - 1`` (it covers exactly the positions ``< p0``) becomes current:
  ``pos = p0 - 1``, ``roll += j``, ``hist -= j``. No row is touched: the next ubatch reads the
  state from row ``roll``. A shared tail refuses (its rows are the other sequences' history too;
  roll back before ``seq_cp``, or after the copy-on-write of a decode). ``p0 = 0`` still frees
  the whole state, and every other cut is refused as in the seed.
- **Placement** copies ``roll`` and ``hist`` with ``pos`` and ``src`` (copy-on-write, swaps);
  a slot's cell gets ``hist = min(k, hist + n_seq_tokens)`` when its last position is its old
  ``pos + n_seq_tokens`` (else ``min(k, n_seq_tokens)``: older states no longer sit at
  ``pos - j``); ``seq_div`` by ``d > 1`` keeps only the current state (``hist = 1``);
  ``seq_add`` moves the kept states with it.
- **Inputs.** ``s_roll(i)`` is cell ``head + i``'s ``roll`` for a slot (``i < n_seqs``; 0 where
  ``s_copy`` falls back to the cell itself) and 0 for the other cells of the range: their rows
  move whole and they keep their ``roll``, so that a placement moves the rows of at most
  ``2 n_seqs - 1`` cells (applying every rolled-back cell's ``roll`` would move any number).
  :meth:`RecurrentRef.set_inputs` resets ``src`` to the cell itself, and a slot's ``roll`` to 0.
- **Rows a ubatch writes** (:func:`move_rows` is this rule as code): for ``i`` in ``[0, n)`` and
  cell ``d = head + i``, first read (all reads before any write) ``old[i][j] =
  row(s_copy(i), s_roll(i) + j)`` for ``j < k - s_roll(i)``. A slot ``i < n_seqs`` runs its
  ``n_seq_tokens`` tokens from ``old[i][0]`` (zeros when ``s_mask(i) = 0``), producing the
  states after each token; row ``j`` of ``d`` becomes the state after the token ``j`` from
  the end for ``j < n_seq_tokens``, then ``old[i][j - n_seq_tokens]``. A cell ``i >= n_seqs``
  (swapped out of the way) gets ``row(d, j) = old[i][j]``. Rows at or past ``hist`` are
  garbage and never read.

The seed's state blob for this cache is described by :func:`state_layout`.

Example:
    >>> ref = RecurrentRef(size=4, n_seq_max=4)
    >>> ref.find_slot([([0, 1], [0]), ([0, 1], [1])])
    True
    >>> ref.set_inputs(), ref.tail[:2], (ref.head, ref.n)
    (([0, 1], [0, 0], [0.0, 0.0]), [0, 1], (0, 2))
    >>> ref.seq_cp(0, 2, -1, -1)
    >>> ref.find_slot([([2], [2])])            # copy-on-write: seq 2 leaves the shared cell 0
    True
    >>> ref.tail[:3], ref.set_inputs()        # cell 2 starts from a copy of cell 0's state
    ([0, 1, 2], ([0], [0], [1.0]))
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

#: The seed's ``std::numeric_limits<llama_pos>::max()``, the meaning of ``p1 < 0``.
POS_MAX = 2**31 - 1

#: One sequence slot of an equal-split ubatch: its positions and its seq ids (primary first).
Slot = Tuple[Sequence[int], Sequence[int]]

#: The graph inputs of one ubatch: ``(s_copy, s_roll, s_mask)`` for ``i`` in ``[0, n)``.
Inputs = Tuple[List[int], List[int], List[float]]


@dataclasses.dataclass
class RCell:
    """One state cell: ``pos`` (-1 when empty), its sequences, pending ``src`` / ``roll``, ``hist``."""

    pos: int = -1
    seqs: Set[int] = dataclasses.field(default_factory=set)
    src: int = -1
    roll: int = 0
    hist: int = 0

    def is_empty(self) -> bool:
        return not self.seqs

    def free(self) -> None:
        self.pos, self.seqs, self.src, self.roll, self.hist = -1, set(), -1, 0, 0


def _bounds(p0: int, p1: int) -> Tuple[int, int]:
    return (0 if p0 < 0 else p0), (POS_MAX if p1 < 0 else p1)


class RecurrentRef:
    """The seed's recurrent-state cells, with kvjax's differences and the ``k``-state extension.

    Args:
        size: number of cells (the seed uses ``max(1, n_seq_max)``).
        n_seq_max: number of sequence ids.
        n_states: states kept per sequence (``k``; 1 is the seed).
    """

    def __init__(self, size: int, n_seq_max: int, n_states: int = 1):
        assert size >= 1 and n_seq_max >= 1 and n_states >= 1
        self.size = size
        self.n_seq_max = n_seq_max
        self.k = n_states
        self.cells: List[RCell] = [RCell() for _ in range(size)]
        self.tail: List[int] = [-1] * n_seq_max
        self.head = 0
        self.n = 0
        self.used = 0
        #: ``(seq, last_pos, old_pos)`` of every non-consecutive position the seed warns about
        self.warnings: List[Tuple[int, int, int]] = []
        #: rows per cell of the last placement, for :meth:`set_inputs` (n_seqs, n_seq_tokens)
        self._last: Tuple[int, int] = (0, 0)

    # -- helpers --------------------------------------------------------------------------

    def _free(self, i: int) -> None:
        """Free cell ``i`` (used or not), forgetting the tails that name it."""
        if not self.cells[i].is_empty():
            self.used -= 1
        for s in self.cells[i].seqs:
            if self.tail[s] == i:
                self.tail[s] = -1
        self.cells[i].free()

    def _drop(self, seq_id: int) -> None:
        """Take ``seq_id`` out of its tail cell (freed when left empty); its tail becomes -1."""
        t = self.tail[seq_id]
        if t < 0:
            return
        cell = self.cells[t]
        cell.seqs.discard(seq_id)
        self.tail[seq_id] = -1
        if cell.is_empty():
            self.used -= 1
            cell.free()

    # -- sequence operations --------------------------------------------------------------

    def clear(self) -> None:
        for cell in self.cells:
            cell.free()
        self.tail = [-1] * self.n_seq_max
        self.head = 0
        self.used = 0

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        """Remove positions ``[p0, p1)``; False (nothing changes) where the seed refuses."""
        p0, p1 = _bounds(p0, p1)
        if seq_id >= self.n_seq_max:
            return False
        if seq_id >= 0:
            t = self.tail[seq_id]
            if t >= 0:
                cell = self.cells[t]
                pos = cell.pos
                if (0 < p0 <= pos) or (0 < p1 <= pos):
                    # a cut inside the state: only a rollback into the kept states is allowed
                    j = pos - p0 + 1
                    if 0 < p0 <= pos < p1 and j < cell.hist and len(cell.seqs) == 1:
                        cell.pos = p0 - 1
                        cell.roll += j
                        cell.hist -= j
                        return True
                    return False
        elif p0 != p1 and (p0 != 0 or p1 != POS_MAX):
            return False  # a negative seq id removes everything or nothing
        first_freed = None
        for i, cell in enumerate(self.cells):
            if not p0 <= cell.pos < p1:
                continue
            if seq_id < 0:
                removed = set(cell.seqs)
            elif seq_id in cell.seqs:
                removed = {seq_id}
            else:
                continue
            for s in removed:
                cell.seqs.discard(s)
                if self.tail[s] == i:
                    self.tail[s] = -1  # kvjax: also for seq_id < 0 (the seed keeps stale tails)
            if cell.is_empty():
                self.used -= 1
                cell.free()
                if first_freed is None:
                    first_freed = i
        if first_freed is not None and first_freed < self.head:
            self.head = first_freed
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Share ``src``'s state with ``dst`` (whose own state is dropped); the range is ignored."""
        if src == dst:
            return
        assert 0 <= src < self.n_seq_max and 0 <= dst < self.n_seq_max, "kvjax: real seq ids"
        self._drop(dst)
        t = self.tail[src]
        if t >= 0:
            self.cells[t].seqs.add(dst)
            self.tail[dst] = t

    def seq_keep(self, seq_id: int) -> None:
        if seq_id < 0:
            return  # kvjax: -1 keeps everything (the seed would empty the cache)
        first_other = None
        for s in range(self.n_seq_max):
            if s != seq_id:
                self.tail[s] = -1
        for i, cell in enumerate(self.cells):
            if seq_id in cell.seqs:
                cell.seqs = {seq_id}
                continue
            if not cell.is_empty():
                self.used -= 1
            cell.free()
            if first_other is None:
                first_other = i
        if first_other is not None and first_other < self.head:
            self.head = first_other

    def _shifted_cells(self, seq_id: int, p0: int, p1: int) -> List[int]:
        """The cells a position change of ``seq_id`` in ``[p0, p1)`` moves (tail only; -1: all)."""
        if seq_id < 0:
            return [i for i, c in enumerate(self.cells) if not c.is_empty() and p0 <= c.pos < p1]
        t = self.tail[seq_id] if seq_id < self.n_seq_max else -1
        if t >= 0 and seq_id in self.cells[t].seqs and p0 <= self.cells[t].pos < p1:
            return [t]
        return []

    def shift_keeps_states(self, seq_id: int, p0: int, p1: int, delta: int) -> bool:
        """Whether a ``seq_add`` moves no state below position 0 (kvjax refuses one that does)."""
        if delta == 0:
            return True
        p0, p1 = _bounds(p0, p1)
        return p0 == p1 or all(self.cells[i].pos + delta >= 0 for i in self._shifted_cells(seq_id, p0, p1))

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        if delta == 0:
            return
        p0, p1 = _bounds(p0, p1)
        if p0 == p1:
            return
        # kvjax: a state holds the whole sequence; a shift that would move one below position 0
        # is refused, nothing changed (the seed keeps the cell at a negative position)
        if not self.shift_keeps_states(seq_id, p0, p1, delta):
            return
        for i in self._shifted_cells(seq_id, p0, p1):
            self.cells[i].pos += delta

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        assert d >= 1, "the reference models valid divisors only"
        if d == 1:
            return
        p0, p1 = _bounds(p0, p1)
        if p0 == p1:
            return
        for i in self._shifted_cells(seq_id, p0, p1):
            cell = self.cells[i]
            cell.pos //= d
            cell.hist = min(cell.hist, 1)  # kept states are no longer at pos - j

    # -- queries --------------------------------------------------------------------------

    def _holds(self, cell: RCell, seq_id: int) -> bool:
        return (not cell.is_empty()) if seq_id < 0 else seq_id in cell.seqs

    def seq_pos_min(self, seq_id: int) -> int:
        found = [c.pos for c in self.cells if self._holds(c, seq_id)]
        return min(found) if found else -1

    def seq_pos_max(self, seq_id: int) -> int:
        found = [c.pos for c in self.cells if self._holds(c, seq_id)]
        return max(found) if found else -1

    def pos_max(self) -> int:
        return max([-1] + [c.pos for c in self.cells])

    def n_tokens(self) -> int:
        return sum(len(c.seqs) for c in self.cells)

    def used_cells(self) -> int:
        return self.used

    def cell_max(self) -> int:
        for i in range(self.size, 0, -1):
            if self.cells[i - 1].pos >= 0 and not self.cells[i - 1].is_empty():
                return i
        return 0

    def can_shift(self) -> bool:
        return False

    def state_of(self, seq_id: int, back: int = 0) -> Optional[Tuple[int, int]]:
        """The row ``(cell, j)`` holding ``seq_id``'s state after position ``pos - back``, if kept.

        Valid between a placement's :meth:`set_inputs` and the next placement, and whenever no
        copy is pending (``src`` is the cell itself).
        """
        t = self.tail[seq_id]
        if t < 0 or back >= self.cells[t].hist:
            return None
        cell = self.cells[t]
        src = cell.src if 0 <= cell.src < self.size else t
        return src, cell.roll + back

    # -- placement ------------------------------------------------------------------------

    def _next_empty(self, start: int, reserved: Set[int]) -> Optional[int]:
        for k in range(self.size):
            i = (start + k) % self.size
            if self.cells[i].is_empty() and i not in reserved:
                return i
        return None

    def find_slot(self, ubatch: Sequence[Slot]) -> bool:
        """Place an equal-split ubatch; False (and nothing changes) when it cannot be placed."""
        work = copy.deepcopy(self)
        if not work._find_slot(ubatch):
            return False
        self.__dict__.update(work.__dict__)
        return True

    def _find_slot(self, ubatch: Sequence[Slot]) -> bool:
        n_seqs = len(ubatch)
        assert n_seqs >= 1, "a ubatch has at least one sequence slot"
        n_seq_tokens = len(ubatch[0][0])
        assert n_seq_tokens >= 1 and all(len(p) == n_seq_tokens for p, _ in ubatch), "equal split"
        if any(not 0 <= s < self.n_seq_max for _, ids in ubatch for s in ids):
            return False
        if self.head > self.used + 2 * n_seqs * n_seq_tokens:
            self.head = 0
        # secondary ids join the primary's state: drop their own
        for _, ids in ubatch:
            for s in ids[1:]:
                self._drop(s)
        # every primary sequence gets a cell of its own
        reserved: Set[int] = set()
        nxt = self._next_empty(self.head, reserved)
        lo, hi = self.size - 1, 0
        for _, ids in ubatch:
            seq = ids[0]
            t = self.tail[seq]
            if t < 0 or len(self.cells[t].seqs) != 1:
                if nxt is None:
                    return False
                cell = self.cells[nxt]
                if t >= 0:  # copy-on-write of a shared state
                    orig = self.cells[t]
                    cell.pos, cell.src, cell.roll, cell.hist = orig.pos, orig.src, orig.roll, orig.hist
                    orig.seqs.discard(seq)
                    cell.seqs.add(seq)
                self.tail[seq] = nxt
                reserved.add(nxt)
                nxt = self._next_empty(nxt + 1, reserved)
            lo, hi = min(lo, self.tail[seq]), max(hi, self.tail[seq])
        # gather: slot s goes to cell lo + s
        for s, (_, ids) in enumerate(ubatch):
            dst, src = lo + s, self.tail[ids[0]]
            if dst == src:
                continue
            a, b = self.cells[dst], self.cells[src]
            for f in ("pos", "seqs", "src", "roll", "hist"):
                va, vb = getattr(a, f), getattr(b, f)
                setattr(a, f, vb)
                setattr(b, f, va)
            for q in range(self.n_seq_max):  # kvjax: tails swapped by value
                if self.tail[q] == src:
                    self.tail[q] = dst
                elif self.tail[q] == dst:
                    self.tail[q] = src
        # the slots' cells take their new positions and sequences
        for s, (positions, ids) in enumerate(ubatch):
            cell = self.cells[lo + s]
            last = int(positions[-1])
            consecutive = cell.pos >= 0 and last == cell.pos + n_seq_tokens
            if cell.pos >= 0 and not consecutive:
                self.warnings.append((ids[0], last, cell.pos))
            cell.hist = min(self.k, (cell.hist if consecutive else 0) + n_seq_tokens)
            cell.pos = last
            cell.seqs = set(int(q) for q in ids)
            for q in ids:
                self.tail[q] = lo + s
        self.head = lo
        self.n = hi - lo + 1
        self.used = sum(not c.is_empty() for c in self.cells)
        self._last = (n_seqs, n_seq_tokens)
        return self.n >= n_seqs

    # -- graph inputs ---------------------------------------------------------------------

    def s_copy(self, i: int) -> int:
        """Where the state of cell ``head + i`` is read from (the cell itself when no copy)."""
        cell_id = self.head + i
        src = self.cells[cell_id].src
        return src if 0 <= src < self.size else cell_id

    def s_roll(self, i: int) -> int:
        """A slot's row of :meth:`s_copy`'s cell holding its current state (kvjax extension)."""
        cell = self.cells[self.head + i]
        return cell.roll if 0 <= cell.src < self.size and i < self._last[0] else 0

    def s_mask(self, i: int) -> float:
        """0.0 when the state of cell ``head + i`` is new and must start from zeros."""
        return 1.0 if self.cells[self.head + i].src >= 0 else 0.0

    def set_inputs(self) -> Inputs:
        """The ubatch's ``(s_copy, s_roll, s_mask)``, then every used cell of the range reads itself."""
        out = (
            [self.s_copy(i) for i in range(self.n)],
            [self.s_roll(i) for i in range(self.n)],
            [self.s_mask(i) for i in range(self.n)],
        )
        for i in range(self.n):
            cell = self.cells[self.head + i]
            if not cell.is_empty():  # kvjax: an empty cell keeps src = -1
                cell.src = self.head + i
                if i < self._last[0]:
                    cell.roll = 0
        return out

    # -- self-check -----------------------------------------------------------------------

    def check_invariants(self, pending: bool = False) -> None:
        """The facts every state must satisfy; ``pending``: between find_slot and set_inputs."""
        for i, cell in enumerate(self.cells):
            if cell.is_empty():
                if not pending:
                    assert (cell.pos, cell.src, cell.roll, cell.hist) == (-1, -1, 0, 0), (i, cell)
            else:
                assert cell.pos >= 0, (i, cell)
                assert 1 <= cell.hist <= self.k and (pending or cell.roll + cell.hist <= self.k), (i, cell)
                assert pending or cell.src == i, (i, cell)
        for s in range(self.n_seq_max):
            holders = [i for i, c in enumerate(self.cells) if s in c.seqs]
            assert holders == ([self.tail[s]] if self.tail[s] >= 0 else []), (s, holders, self.tail)
        assert self.used == sum(not c.is_empty() for c in self.cells), self.used
        assert 0 <= self.head < self.size, self.head


def move_rows(
    rows: Dict[Tuple[int, int], object],
    ref: RecurrentRef,
    inputs: Inputs,
    ubatch: Sequence[Slot],
    step: Callable[[object, int], object],
    zero: object,
) -> Dict[Tuple[int, int], object]:
    """The state rows after a ubatch, per the spec in the module docstring (pure Python).

    Args:
        rows: ``{(cell, j): state}`` before the ubatch (missing rows are garbage).
        ref: the reference right after ``find_slot`` (its ``head``, ``n``, ``k``).
        inputs: what :meth:`RecurrentRef.set_inputs` returned for this placement.
        ubatch: the placed ubatch.
        step: ``step(state, pos)``, the state after folding in the token at ``pos``.
        zero: the initial state of a new sequence.

    Returns:
        The new rows (a new dict; ``rows`` is not changed).
    """
    copies, rolls, masks = inputs
    k = ref.k
    old = []
    for i in range(ref.n):  # every read happens before any write
        old.append([rows.get((copies[i], rolls[i] + j)) for j in range(k - rolls[i])])
    new = dict(rows)
    for i in range(ref.n):
        d = ref.head + i
        for j in range(k):
            new.pop((d, j), None)
        if i < len(ubatch):
            positions = ubatch[i][0]
            x = old[i][0] if masks[i] else zero
            states = []
            for p in positions:
                x = step(x, int(p))
                states.append(x)
            carried = old[i] if masks[i] else []
            for j in range(k):
                if j < len(states):
                    new[(d, j)] = states[len(states) - 1 - j]
                elif j - len(states) < len(carried) and carried[j - len(states)] is not None:
                    new[(d, j)] = carried[j - len(states)]
        elif masks[i]:
            for j, value in enumerate(old[i]):
                if value is not None:
                    new[(d, j)] = value
    return new


def state_layout() -> str:
    """The seed's state blob of the recurrent cache, field by field (little-endian, packed).

    Returns the spec as text (also readable as this function's source), for kvjax's state
    reader and writer.
    """
    return _STATE_LAYOUT


_STATE_LAYOUT = """\
llama_kv_cache_recurrent::state_write(seq_id), one blob (seq_id = -1: the whole cache):

  u32 cell_count      cells written: with seq_id = -1 every used cell, else the cells holding
                      seq_id (0 or 1: its tail cell), in cell order, grouped in runs of
                      consecutive cells ("ranges"); the ranges only shape the data reads below
  meta, per cell in cell order:
    i32 pos           the cell's pos (the last position folded into the state)
    u32 n_seq_id      seq_id = -1: the number of sequences of the cell; else 0
    i32 seq_id x n    seq_id = -1 only: the cell's sequence ids, ascending
  data:
    u32 v_trans       always 0 (recurrent states are never transposed)
    u32 n_layer
    per layer il:     i32 k type (ggml type id), u64 k row size in bytes
                      = row_size(type, n_embd_k_gqa(il) + n_embd_k_s()) (the conv / token-shift
                      state; the attention part n_embd_k_gqa is 0 for a recurrent-only model),
                      then cell_count rows: each range's rows, back to back, in cell order
    per layer il:     i32 v type, u64 v row size = row_size(type, n_embd_v_gqa(il) +
                      n_embd_v_s()) (the SSM / WKV state), then cell_count rows likewise

Not written: src and tail (nor kvjax's roll / hist). On read they are rebuilt:
  every restored cell gets src = its own index (the state is already in its row);
  seq_id = -1 (whole): checks cell_count <= size, clears the cache, writes cell i of the blob
    into cell i (head = 0, used = cell_count); each seq id must be >= 0 and appear once
    (tail[seq] = i; a second cell for the same seq fails); every read check is done field by
    field (n_layer, type ids, row sizes, v_trans == 0) and a failure clears the cache and throws;
  seq_id >= 0: every n_seq_id must be 0; seq_rm(seq, -1, -1), then find_slot of one slot of
    cell_count tokens (the blob's positions) for seq: its cell gets the last pos; the data go to
    rows [head, head + cell_count). A failure removes the sequence and throws. (cell_count = 0
    makes the seed's find_slot read position index -1: an empty per-sequence blob is not
    readable; cell_count > 1 cannot come from state_write.)

With the kvjax extension (k > 1) the blob keeps this format: a cell's current state (row roll
of its src) is written, and a restored cell has roll = 0, hist = 1 (its older states are not
saved).
"""
