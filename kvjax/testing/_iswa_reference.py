"""A pure-Python model of the seed's iSWA cache pair (``llama_kv_cache_unified_iswa``).

The behaviour reference for kvjax's interleaved sliding-window memory: two :class:`UnifiedRef`
caches, ``base`` for the full-attention layers and ``swa`` (the window cache) for the
sliding-window layers, driven exactly as the seed drives them:

- sizes: ``base`` has ``size`` cells; ``swa`` has
  ``min(size, pad(n_swa * n_seq_max + n_batch, padding))`` cells, or ``size`` with ``swa_full``
  (the window cache must hold every sequence's window plus one whole batch, because pruning
  happens only once the batch is done);
- every sequence operation is applied to both caches, base first;
- ``seq_pos_min`` / ``seq_pos_max`` are read from the window cache (its cells are a subset of the
  base's), ``n_tokens``, ``used_cells`` and ``pos_max`` from the base;
- a ubatch is placed into both caches; ``can_shift`` holds only when both have the same size;
- :meth:`IswaRef.commit` is the seed's end of a batch: the per-sequence ``pmin`` / ``pmax`` of
  the batch's tokens (the seed gathers them from the whole batch before splitting it, so over
  all its ubatches, for every sequence id of every token) and, unless ``swa_full``, one
  ``prune_swa(seq, pmin, pmax)`` of the window cache per sequence, in ascending sequence id.

What pruning removes. ``prune_swa(seq, pmin, pmax)`` walks the window cache's cells in order and
takes ``seq`` out of every cell whose position ``p0`` the window hides from position ``pmax``
(a cell left without sequences is freed). Per kind, for a cell of ``seq`` at ``p0``:

========== ====================================== ===========================================
kind       pruned when                            kept
========== ====================================== ===========================================
standard   ``pmax - p0 >= n_swa``                 the last ``n_swa`` positions up to ``pmax``
chunked    ``p0 < (pmax // n_swa) * n_swa``       the chunk holding ``pmax`` (and anything later)
symmetric  ``pmax - n_swa // 2 > p0``             ``n_swa // 2`` positions before ``pmax`` and
                                                  everything after it
========== ====================================== ===========================================

The seed's pruning is conservative (it keeps more than the next token can see), in four ways
the tests below pin down: it measures from ``pmax``, not from the next position ``pmax + 1``
(standard keeps the cell at ``pmax - n_swa + 1`` that ``pmax + 1`` no longer sees; chunked keeps
the whole chunk of ``pmax`` even when ``pmax`` ends it); it uses the batch's ``pmax``, not the
sequence's largest cached position; it prunes only the sequences that had tokens in the batch;
and a shared cell only loses the pruned sequence, so it stays while another sequence holds it.

The seed has no symmetric kind (kvjax takes it from newer llama.cpp's masks, where a cell is
hidden when ``|p1 - p0| > n_swa // 2``). Applied literally to ``pmax`` it would also drop cells
more than ``n_swa // 2`` *after* ``pmax``, which a later token can still see; so pruning keeps only
the past side of the predicate: a cell is pruned when ``p0 <= pmax`` and the window hides it
from ``pmax``. For standard and chunked that extra condition changes nothing (a cell after
``pmax`` is never hidden from it), so one rule covers all three kinds.

The seed also warns ("partial SWA cache") when fewer cells than ``min(n_swa, pmin)`` are
visible from ``pmin``; it counts visible cells of *every* sequence, counting each cell before
this sequence's pruning touches it. :attr:`IswaRef.partial` records those warnings as
``(seq, pmin, n_attended)``, so a test can see when the window cache was too small.

kvjax's deliberate differences are those of :class:`UnifiedRef` (freed cells get ``delta = 0``,
``-1`` means every sequence, a failed search changes nothing), plus: a ubatch is placed only when
*both* caches take it, and a refusal changes neither (the seed places it in the base even when
the window cache refuses, and relies on ``restore`` to take it back).

Example:
    >>> ref = IswaRef(size=16, n_seq_max=1, padding=4, n_swa=2, swa_type="standard", n_batch=4)
    >>> ref.size_swa
    8
    >>> ubatches = [[(p, [0]) for p in range(4)]]
    >>> ref.decode(ubatches)
    True
    >>> [c.pos for c in ref.swa.cells[:4]], ref.seq_pos_min(0), ref.used_cells()
    ([-1, -1, 2, 3], 2, 4)
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence, Tuple

from kvjax.testing._unified_reference import Token, UnifiedRef

#: The window kinds an iSWA pair may use (``"none"`` has no window to prune).
SWA_KINDS = ("standard", "chunked", "symmetric")


def _pad(x: int, n: int) -> int:
    return -(-x // n) * n


def masked_swa(swa_type: str, n_swa: int, p0: int, p1: int) -> bool:
    """Whether a token at ``p1`` cannot see a cell at ``p0`` (an empty cell, ``p0 < 0``, never).

    The seed's ``is_masked_swa`` for standard and chunked, newer llama.cpp's for symmetric.
    """
    if p0 < 0:
        return True
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == "symmetric":
        return abs(p1 - p0) > n_swa // 2
    assert swa_type == "none", swa_type
    return False


def pruned(swa_type: str, n_swa: int, p0: int, pmax: int) -> bool:
    """Whether pruning after a batch reaching ``pmax`` drops a cell at ``p0 >= 0``.

    The past side of :func:`masked_swa` (see the module docstring for why).
    """
    return p0 <= pmax and masked_swa(swa_type, n_swa, p0, pmax)


def batch_ranges(ubatches: Sequence[Sequence[Token]]) -> Dict[int, Tuple[int, int]]:
    """The seed's pending ``{seq: (pmin, pmax)}`` over every token of every ubatch of a batch."""
    out: Dict[int, Tuple[int, int]] = {}
    for ubatch in ubatches:
        for pos, seq_ids in ubatch:
            for s in seq_ids:
                lo, hi = out.get(int(s), (pos, pos))
                out[int(s)] = (min(lo, pos), max(hi, pos))
    return out


class IswaRef:
    """The seed's iSWA pair of unified caches, with kvjax's deliberate differences.

    Args:
        size: cells of the base cache.
        n_seq_max: number of sequence ids.
        padding: the caches' padding (window granularity and window cache size rounding).
        n_swa: sliding-window size (> 0).
        swa_type: ``"standard"``, ``"chunked"`` or ``"symmetric"``.
        n_batch: the largest batch (in tokens) that is decoded before one commit.
        swa_full: give the window cache the base's size and never prune it.
    """

    def __init__(
        self, size: int, n_seq_max: int, padding: int, n_swa: int, swa_type: str, n_batch: int, swa_full: bool = False
    ):
        assert swa_type in SWA_KINDS and n_swa > 0, (swa_type, n_swa)
        self.n_swa = n_swa
        self.swa_type = swa_type
        self.do_prune = not swa_full
        self.size_base = size
        self.size_swa = size if swa_full else min(size, _pad(n_swa * n_seq_max + n_batch, padding))
        self.base = UnifiedRef(self.size_base, n_seq_max, padding)
        self.swa = UnifiedRef(self.size_swa, n_seq_max, padding)
        #: ``(seq, pmin, n_attended)`` of every "partial SWA cache" warning the seed would log
        self.partial: List[Tuple[int, int, int]] = []

    # -- sequence operations: both caches -------------------------------------------------

    def clear(self) -> None:
        self.base.clear()
        self.swa.clear()

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        self.base.seq_rm(seq_id, p0, p1)
        self.swa.seq_rm(seq_id, p0, p1)
        return True  # a unified cache never refuses a removal

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        self.base.seq_cp(src, dst, p0, p1)
        self.swa.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.base.seq_keep(seq_id)
        self.swa.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.base.seq_add(seq_id, p0, p1, delta)
        self.swa.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.base.seq_div(seq_id, p0, p1, d)
        self.swa.seq_div(seq_id, p0, p1, d)

    # -- queries --------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        return self.swa.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)

    def pos_max(self) -> int:
        return self.base.pos_max()

    def n_tokens(self) -> int:
        return self.base.n_tokens()

    def used_cells(self) -> int:
        return self.base.used_cells()

    def can_shift(self) -> bool:
        return self.size_base == self.size_swa

    # -- placement and the end of a batch -------------------------------------------------

    def find_slot(self, tokens: Sequence[Token], contiguous: bool = True) -> Tuple[List[int], List[int], bool]:
        """Place a ubatch in both caches: ``(base cells, window cells, ok)``; all or nothing."""
        base, swa = copy.deepcopy(self.base), copy.deepcopy(self.swa)
        base_slots, ok_base = base.find_slot(tokens, contiguous)
        swa_slots, ok_swa = swa.find_slot(tokens, contiguous)
        if not (ok_base and ok_swa):
            return [], [], False
        self.base, self.swa = base, swa
        return base_slots, swa_slots, True

    def _prune(self, seq_id: int, pmin: int, pmax: int) -> None:
        """The seed's ``prune_swa`` of the window cache for one sequence."""
        n_attended = 0
        for cell in self.swa.cells:
            p0 = cell.pos
            if 0 <= p0 <= pmin and not masked_swa(self.swa_type, self.n_swa, p0, pmin):
                n_attended += 1  # counted for any sequence, before this prune touches the cell
            if p0 < 0 or seq_id not in cell.seqs:
                continue
            if pruned(self.swa_type, self.n_swa, p0, pmax):
                cell.seqs.discard(seq_id)
                if cell.is_empty():
                    cell.free()
                    self.swa.used -= 1
        if n_attended < min(self.n_swa, pmin):
            self.partial.append((seq_id, pmin, n_attended))

    def commit(self, ubatches: Sequence[Sequence[Token]]) -> None:
        """End a batch made of ``ubatches`` (all placed): prune the window cache per sequence."""
        if not self.do_prune:
            return
        for seq_id, (pmin, pmax) in sorted(batch_ranges(ubatches).items()):
            self._prune(seq_id, pmin, pmax)

    def decode(self, ubatches: Sequence[Sequence[Token]], contiguous: bool = True) -> bool:
        """Place every ubatch then commit; when one does not fit, nothing changes at all."""
        base, swa = copy.deepcopy(self.base), copy.deepcopy(self.swa)
        for tokens in ubatches:
            if not self.find_slot(tokens, contiguous)[2]:
                self.base, self.swa = base, swa  # the seed's restore
                return False
        self.commit(ubatches)
        return True

    def check_invariants(self) -> None:
        """Both caches' invariants (the window cache may hold fewer cells than the base)."""
        self.base.check_invariants()
        self.swa.check_invariants()
