"""Hand-worked checks of the pure-Python seed model, so it is trusted on its own.

Every expected value below was worked out by hand from the seed's loops in
``shared/seed/llama-kv-cache.cpp`` (``llama_kv_cache_unified``), plus kvjax's documented
deliberate differences (freed cells get delta 0, ``-1`` means every sequence, a failed
``find_slot`` changes nothing). Cell pictures: one character per cell, ``.`` empty, a digit the
single sequence holding it, ``+`` a shared cell.
"""

from __future__ import annotations

import pytest

from kvjax.testing._unified_reference import POS_MAX, UnifiedRef


def make(size, cells, head=0, padding=4, n_seq_max=4):
    """A reference in a given state: ``cells`` is a list of ``(pos, seqs)`` or None (empty)."""
    ref = UnifiedRef(size, n_seq_max, padding)
    for i, spec in enumerate(cells):
        if spec is not None:
            ref.cells[i].pos, ref.cells[i].seqs = spec[0], set(spec[1])
            ref.used += 1
    ref.head = head
    ref.check_invariants()
    return ref


def picture(ref):
    out = []
    for c in ref.cells:
        out.append("." if not c.seqs else (str(next(iter(c.seqs))) if len(c.seqs) == 1 else "+"))
    return "".join(out)


def positions(ref):
    return [c.pos for c in ref.cells]


def deltas(ref):
    return [c.delta for c in ref.cells]


def tokens(pos, seq):
    return [(p, [seq]) for p in pos]


# -- seq_rm -------------------------------------------------------------------------------------


def test_seq_rm_frees_and_moves_head_back_only_when_earlier():
    ref = make(8, [(0, [0]), (1, [0]), (2, [0, 1]), (3, [1]), (4, [0]), None, None, None], head=3)
    ref.seq_rm(0, 1, 5)  # cell 1, 4 freed; cell 2 keeps seq 1
    assert picture(ref) == "0.11...."
    assert ref.head == 1 and ref.used == 3
    ref.seq_rm(1, 3, -1)  # frees cell 3, which is after head: head stays
    assert picture(ref) == "0.1....."
    assert ref.head == 1 and ref.used == 2
    ref.seq_rm(3, -1, -1)  # sequence 3 is nowhere: nothing changes
    assert picture(ref) == "0.1....." and ref.head == 1
    ref.check_invariants()


def test_seq_rm_all_sequences_and_empty_ranges():
    ref = make(8, [(5, [0, 2]), (6, [1]), (7, [2]), None, None, None, None, None], head=6)
    ref.seq_rm(-1, 6, 6)  # empty range
    ref.seq_rm(-1, 7, 6)  # p0 > p1: empty too
    assert picture(ref) == "+12....." and ref.head == 6
    ref.seq_rm(-1, 6, -1)  # every sequence at positions >= 6
    assert picture(ref) == "+......." and positions(ref)[:3] == [5, -1, -1]
    assert ref.head == 1 and ref.used == 1
    ref.seq_rm(-1, -5, 0)  # [0, 0) after normalization: nothing
    assert ref.used == 1


def test_seq_rm_resets_delta_of_freed_cells():
    ref = make(4, [(3, [0]), (4, [1]), None, None], head=0)
    ref.seq_add(-1, 0, -1, 2)  # both shifted by 2, delta 2
    assert positions(ref)[:2] == [5, 6] and deltas(ref)[:2] == [2, 2]
    ref.seq_rm(0, -1, -1)
    assert deltas(ref) == [0, 2, 0, 0]  # the seed would keep delta 2 in the freed cell 0


# -- seq_cp -------------------------------------------------------------------------------------


def test_seq_cp_shares_cells_and_resets_head():
    ref = make(8, [(0, [0]), (1, [0]), (2, [0]), (0, [1]), None, None, None, None], head=4)
    ref.seq_cp(0, 0, 0, 2)  # onto itself: nothing, head kept
    assert ref.head == 4
    ref.seq_cp(0, 2, 1, 3)
    assert [sorted(c.seqs) for c in ref.cells[:4]] == [[0], [0, 2], [0, 2], [1]]
    assert ref.head == 0 and ref.used == 4 and ref.n_tokens() == 6
    ref.head = 4
    ref.seq_cp(1, 3, 5, 5)  # empty range: no cell changes, but the head still resets
    assert ref.head == 0 and ref.n_tokens() == 6


# -- seq_keep -----------------------------------------------------------------------------------


def test_seq_keep_head_goes_to_first_cell_without_the_sequence():
    ref = make(8, [(0, [0, 1]), (1, [1]), (2, [0]), None, (3, [0, 2]), None, None, None], head=6)
    ref.seq_keep(0)
    assert [sorted(c.seqs) for c in ref.cells[:5]] == [[0], [], [0], [], [0]]
    assert ref.head == 1 and ref.used == 3
    # cells already empty count too: the first one not holding seq 0 is now cell 1 again
    ref.head = 0
    ref.seq_keep(0)
    assert ref.head == 0  # 1 is not before 0: head stays


def test_seq_keep_empty_cell_before_head_moves_head():
    ref = make(8, [(0, [0]), None, (1, [0]), None, None, None, None, None], head=5)
    ref.seq_keep(0)  # nothing freed, but cell 1 is the first "other" cell
    assert picture(ref) == "0.0....." and ref.head == 1


def test_seq_keep_all_is_a_noop():
    ref = make(4, [(0, [0, 1]), (1, [2]), None, None], head=3)
    ref.seq_keep(-1)
    assert picture(ref) == "+2.." and ref.head == 3 and ref.used == 2


# -- seq_add ------------------------------------------------------------------------------------


def test_seq_add_frees_cells_pushed_below_zero():
    ref = make(8, [(0, [0]), (1, [0]), (2, [0, 1]), (3, [0]), (1, [1]), None, None, None], head=5)
    ref.seq_add(0, 0, 3, -2)  # cells 0, 1 (pos 0, 1) fall below 0; cell 2 -> 0
    assert positions(ref) == [-1, -1, 0, 3, 1, -1, -1, -1]
    assert deltas(ref) == [0, 0, -2, 0, 0, 0, 0, 0]  # freed cells carry no delta
    assert sorted(ref.cells[2].seqs) == [0, 1]  # seq 1 moves with the shared cell
    assert ref.head == 0 and ref.used == 3  # first freed cell is 0
    ref.head = 6
    ref.seq_add(1, 1, 2, -5)  # only cell 4 (seq 1 at pos 1) is in range: freed
    assert ref.head == 4 and positions(ref)[4] == -1 and ref.used == 2


def test_seq_add_head_without_freeing_and_noops():
    ref = make(8, [(0, [0]), (1, [0]), (5, [1]), None, None, None, None, None], head=3)
    ref.seq_add(0, 0, 2, 0)  # delta 0: no-op, head kept
    assert ref.head == 3
    ref.seq_add(0, -4, 0, 7)  # normalized range [0, 0): no-op, head kept
    assert ref.head == 3
    ref.seq_add(0, 5, 2, 7)  # p0 > p1: no cell moves, but the head resets to 0
    assert positions(ref)[:3] == [0, 1, 5] and ref.head == 0
    ref.head = 3
    ref.seq_add(-1, 1, -1, 10)  # every sequence at positions >= 1
    assert positions(ref)[:3] == [0, 11, 15] and deltas(ref)[:3] == [0, 10, 10]
    assert ref.head == 0
    ref.seq_add(1, 0, -1, -3)  # accumulates: 15 -> 12, delta 10 -> 7
    assert positions(ref)[2] == 12 and deltas(ref)[2] == 7


# -- seq_div ------------------------------------------------------------------------------------


def test_seq_div_records_the_change_and_keeps_head():
    ref = make(8, [(0, [0]), (5, [0]), (7, [0, 1]), (9, [1]), None, None, None, None], head=2)
    ref.seq_div(0, 1, 8, 3)  # 5 -> 1 (delta -4), 7 -> 2 (delta -5); 0 is out of range
    assert positions(ref)[:4] == [0, 1, 2, 9] and deltas(ref)[:4] == [0, -4, -5, 0]
    assert ref.head == 2
    ref.seq_div(-1, 0, -1, 1)  # d == 1: no-op
    assert positions(ref)[:4] == [0, 1, 2, 9]
    ref.seq_div(-1, 2, -1, 4)  # 2 -> 0 (delta -5 - 2), 9 -> 2 (delta -7)
    assert positions(ref)[:4] == [0, 1, 0, 2] and deltas(ref)[:4] == [0, -4, -7, -7]
    assert ref.used == 4 and ref.head == 2


# -- queries ------------------------------------------------------------------------------------


def test_queries():
    ref = make(16, [None, (4, [0]), (9, [0, 2]), None, (2, [1])] + [None] * 11, padding=4)
    assert [ref.seq_pos_min(s) for s in (-1, 0, 1, 2, 3)] == [2, 4, 2, 9, -1]
    assert [ref.seq_pos_max(s) for s in (-1, 0, 1, 2, 3)] == [9, 9, 2, 9, -1]
    assert ref.pos_max() == 9 and ref.n_tokens() == 4 and ref.used_cells() == 3
    assert ref.cell_max() == 5 and ref.n_kv() == 8
    empty = UnifiedRef(16, 2, 8)
    assert (empty.cell_max(), empty.n_kv(), empty.pos_max(), empty.seq_pos_min(-1)) == (0, 8, -1, -1)
    full = make(12, [(i, [0]) for i in range(12)], padding=8)
    assert full.n_kv() == 12  # pad(12, 8) = 16, capped at the size


# -- find_slot, contiguous ----------------------------------------------------------------------


def test_contiguous_fills_from_head_and_jumps_past_occupied_cells():
    ref = make(8, [(0, [0]), None, (1, [0]), None, None, (2, [0]), None, None], head=0)
    # windows of 2 from 0: cell 0 busy -> 1; [1,2] blocked at 2 -> 3; [3,4] free
    slots, ok = ref.find_slot(tokens([3, 4], 1))
    assert ok and slots == [3, 4] and ref.head == 3 and ref.used == 5
    assert picture(ref) == "0.0110.." and positions(ref)[3:5] == [3, 4]


def test_contiguous_wraps_around_the_end():
    # built with ops: the head is left at cell 6 by seq_add freeing it
    ref = UnifiedRef(8, 3, 4)
    ref.find_slot(tokens([0, 1, 2], 1))
    ref.find_slot([(10, [0]), (11, [0]), (12, [0]), (0, [2]), (13, [0])])
    assert ref.head == 3  # [0..4] blocked at 0, 1, 2 in turn; [3..7] is free
    ref.seq_rm(1, -1, -1)  # frees 0..2: head moves back to 0
    assert picture(ref) == "...00020" and ref.head == 0
    ref.seq_add(2, 0, -1, -1)  # cell 6 falls below 0: freed, head goes there
    assert picture(ref) == "...000.0" and ref.head == 6 and ref.used == 4
    # n = 2 from 6: [6, 7] blocked at 7 -> head 8; 8 + 2 > 8 wraps to 0; [0, 1] is free
    wraps = ref.wraps
    slots, ok = ref.find_slot(tokens([20, 21], 1))
    assert ok and slots == [0, 1] and ref.head == 0 and ref.wraps == wraps + 1
    assert picture(ref) == "11.000.0"


def test_contiguous_prefers_windows_after_head_and_fails_on_fragmentation():
    ref = make(8, [None, None, (0, [0]), None, None, (1, [0]), None, None], head=3)
    slots, ok = ref.find_slot(tokens([5, 6], 1))
    assert ok and slots == [3, 4] and ref.head == 3
    slots, ok = ref.find_slot(tokens([7, 8], 1))
    assert ok and slots == [6, 7] and ref.head == 6
    # two free cells are left (0 and 1): a window of 3 does not exist
    before = [(c.pos, set(c.seqs)) for c in ref.cells]
    slots, ok = ref.find_slot(tokens([9, 10, 11], 2))
    assert not ok and slots == []
    assert ref.head == 6 and [(c.pos, c.seqs) for c in ref.cells] == before  # nothing changed
    slots, ok = ref.find_slot(tokens([9, 10], 2))  # from 6: wraps to 0
    assert ok and slots == [0, 1] and ref.head == 0


def test_contiguous_reset_heuristic():
    # built with ops: alternate two sequences, drop one, then a wide ubatch lands far right
    ref = UnifiedRef(64, 2, 16)
    for start in range(0, 40, 8):
        ref.find_slot([(p, [p % 2]) for p in range(start, start + 8)])
    assert ref.head == 32 and ref.used == 40
    ref.seq_rm(1, -1, -1)  # frees every odd cell: head moves back to 1
    assert ref.head == 1 and ref.used == 20
    # windows from 1 are blocked at every even cell, until [39, 46] (39 was freed)
    slots, ok = ref.find_slot(tokens(range(40, 48), 0))
    assert ok and slots == list(range(39, 47)) and ref.head == 39 and ref.used == 28
    # head 39 > used 28 + 2 * 1: the search restarts at 0 and takes the hole at 1
    resets = ref.resets
    slots, ok = ref.find_slot(tokens([48], 1))
    assert ok and slots == [1] and ref.head == 1 and ref.resets == resets + 1
    # the boundary: the reset needs head > used + 2n, strictly
    ref2 = make(16, [(0, [0])] + [None] * 15, head=6)
    slots, ok = ref2.find_slot(tokens([1, 2], 0))  # 6 > 1 + 4: reset, takes [1, 2]
    assert slots == [1, 2] and ref2.head == 1
    ref3 = make(16, [(0, [0])] + [None] * 15, head=5)
    slots, ok = ref3.find_slot(tokens([1, 2], 0))  # 5 == 1 + 4: no reset, takes [5, 6]
    assert slots == [5, 6] and ref3.head == 5


def test_contiguous_edge_cases():
    ref = make(8, [(0, [0])] + [None] * 7, head=0)
    assert ref.find_slot(tokens(range(9), 0)) == ([], False)  # more tokens than cells
    assert ref.head == 0 and ref.used == 1
    slots, ok = ref.find_slot(tokens(range(7), 0))  # exactly the free tail
    assert ok and slots == list(range(1, 8)) and ref.head == 1
    assert ref.find_slot(tokens([9], 0)) == ([], False)  # full
    assert ref.find_slot([]) == ([], True) and ref.head == 1  # nothing to place
    empty = make(8, [None] * 8, head=5)
    assert empty.find_slot([]) == ([], True) and empty.head == 0  # 5 > 0 + 0 resets


def test_placement_inserts_every_sequence_of_a_token():
    ref = UnifiedRef(8, 4, 4)
    slots, ok = ref.find_slot([(0, [2, 0, 3]), (1, [1])])
    assert ok and [sorted(ref.cells[i].seqs) for i in slots] == [[0, 2, 3], [1]]
    assert ref.n_tokens() == 4 and ref.used == 2


# -- find_slot, scattered -----------------------------------------------------------------------


def test_scattered_takes_free_cells_in_cyclic_order():
    ref = make(8, [None, (0, [0]), None, (1, [0]), None, (2, [0]), None, (3, [0])], head=3)
    slots, ok = ref.find_slot(tokens([4, 5, 6], 1), contiguous=False)
    assert ok and slots == [4, 6, 0] and ref.head == 1  # wraps; head one past cell 0
    slots, ok = ref.find_slot(tokens([7], 1), contiguous=False)
    assert ok and slots == [2] and ref.head == 3
    assert ref.find_slot(tokens([8], 1), contiguous=False) == ([], False)
    assert ref.head == 3
    ref.seq_rm(0, 3, 4)  # frees cell 7 (pos 3): after head, head stays 3
    slots, ok = ref.find_slot(tokens([8], 1), contiguous=False)
    assert ok and slots == [7] and ref.head == 0  # one past the last cell wraps to 0


def test_scattered_fits_what_contiguous_refuses_and_resets_the_same_way():
    cells = [None if i % 2 else (i, [0]) for i in range(16)]
    ref = make(16, cells, head=0)
    assert ref.find_slot(tokens([20, 21], 1)) == ([], False)
    slots, ok = ref.find_slot(tokens([20, 21], 1), contiguous=False)
    assert ok and slots == [1, 3] and ref.head == 4
    ref2 = make(16, [(0, [0])] + [None] * 15, head=9)
    slots, ok = ref2.find_slot(tokens([1, 2], 0), contiguous=False)  # 9 > 1 + 4: from 0
    assert slots == [1, 2] and ref2.head == 3


def test_p1_negative_means_the_int32_maximum():
    ref = make(4, [(POS_MAX - 1, [0]), None, None, None])
    ref.seq_rm(0, 5, -1)
    assert ref.used == 0


@pytest.mark.parametrize("contiguous", [True, False])
def test_invariants_hold_after_a_mixed_run(contiguous):
    ref = UnifiedRef(16, 3, 8)
    for step in range(12):
        ref.find_slot([(step * 2 + i, [step % 3, (step + 1) % 3]) for i in range(3)], contiguous)
        if step % 3 == 2:
            ref.seq_rm(step % 3, 0, step * 2)
            ref.seq_add(-1, 4, -1, -3)
            ref.seq_div(1, 0, -1, 2)
        ref.check_invariants()
