"""Hand-worked checks of the pure-Python model of the seed's iSWA pair, so it is trusted on its own.

Every expected value was worked out by hand from ``llama_kv_cache_unified_iswa`` and
``llama_kv_cache_unified::prune_swa`` / ``is_masked_swa`` in ``shared/seed/llama-kv-cache.cpp``,
plus kvjax's documented deliberate differences (the module docstring of
``kvjax.testing._iswa_reference`` lists them). Positions pictures list ``cell.pos`` per cell,
``-1`` for an empty cell.
"""

from __future__ import annotations

import pytest

from kvjax.testing import IswaRef
from kvjax.testing._iswa_reference import batch_ranges, masked_swa, pruned


def toks(positions, seqs=(0,)):
    return [(p, list(seqs)) for p in positions]


def positions(unified, n=None):
    return [c.pos for c in unified.cells[: n or unified.size]]


def seqs(unified, n):
    return [sorted(c.seqs) for c in unified.cells[:n]]


# -- sizes -------------------------------------------------------------------------------------


def test_window_cache_size():
    # pad(4 * 2 + 16, 8) = 24 < 64
    ref = IswaRef(64, 2, 8, n_swa=4, swa_type="standard", n_batch=16)
    assert (ref.size_base, ref.size_swa, ref.can_shift()) == (64, 24, False)
    # pad(4 * 2 + 17, 8) = 32: the rounding is up
    assert IswaRef(64, 2, 8, n_swa=4, swa_type="standard", n_batch=17).size_swa == 32
    # pad(8 * 2 + 8, 4) = 24 is capped at the base size: equal sizes can shift
    capped = IswaRef(16, 2, 4, n_swa=8, swa_type="chunked", n_batch=8)
    assert (capped.size_swa, capped.can_shift()) == (16, True)
    full = IswaRef(64, 2, 8, n_swa=4, swa_type="standard", n_batch=16, swa_full=True)
    assert (full.size_swa, full.do_prune, full.can_shift()) == (64, False, True)


def test_batch_ranges_cover_every_ubatch_and_every_seq_id():
    ubatches = [[(5, [0]), (3, [0, 2])], [(9, [2]), (1, [1]), (4, [0])]]
    assert batch_ranges(ubatches) == {0: (3, 5), 1: (1, 1), 2: (3, 9)}


def test_window_predicates():
    # standard n_swa = 3: 5 sees 3, 4, 5; not 2
    assert [masked_swa("standard", 3, p, 5) for p in (2, 3, 5, -1)] == [True, False, False, True]
    # chunked n_swa = 4: 6 is in chunk [4, 8): 3 hidden, 4 and 7 visible
    assert [masked_swa("chunked", 4, p, 6) for p in (3, 4, 7)] == [True, False, False]
    # symmetric n_swa = 4 (half 2): 4 sees 2..6
    assert [masked_swa("symmetric", 4, p, 4) for p in (1, 2, 6, 7)] == [True, False, False, True]
    # pruning keeps the past side only: 7 is hidden from 4 but is after it
    assert [pruned("symmetric", 4, p, 4) for p in (1, 2, 7)] == [True, False, False]
    assert pruned("standard", 3, 2, 5) and not pruned("standard", 3, 3, 5)


# -- standard -----------------------------------------------------------------------------------


def make_standard():
    # n_swa 3, one sequence, n_batch 6: the window cache has pad(3 + 6, 4) = 12 cells
    ref = IswaRef(16, 1, 4, n_swa=3, swa_type="standard", n_batch=6)
    assert ref.size_swa == 12
    return ref


def test_standard_prunes_once_per_batch_from_pmax():
    ref = make_standard()
    # one batch of two ubatches: cells 0..2, then 3..5 (the search jumps over 0..2) in both caches
    assert ref.find_slot(toks([0, 1, 2])) == ([0, 1, 2], [0, 1, 2], True)
    assert ref.find_slot(toks([3, 4, 5])) == ([3, 4, 5], [3, 4, 5], True)
    assert positions(ref.swa, 6) == [0, 1, 2, 3, 4, 5]  # nothing pruned before the commit
    ref.commit([toks([0, 1, 2]), toks([3, 4, 5])])
    # pmax 5: 5 - p0 >= 3 prunes 0, 1, 2. Position 3 stays although the next token (6) does
    # not see it (6 - 3 = 3): the seed measures from pmax, not pmax + 1
    assert positions(ref.swa, 7) == [-1, -1, -1, 3, 4, 5, -1]
    assert positions(ref.base, 7) == [0, 1, 2, 3, 4, 5, -1]
    assert (ref.swa.used, ref.swa.head, ref.used_cells()) == (3, 3, 6)  # pruning keeps the head
    assert (ref.seq_pos_min(0), ref.seq_pos_max(0), ref.pos_max(), ref.n_tokens()) == (3, 5, 5, 6)
    # next batch, one token: base cell 6; window: 3..5 are taken, so cell 6 too
    assert ref.decode([toks([6])])
    assert positions(ref.swa, 8) == [-1, -1, -1, -1, 4, 5, 6, -1]  # pmax 6 prunes 3
    assert ref.partial == []
    ref.check_invariants()


def test_partial_window_warning_counts_every_sequence():
    ref = make_standard()
    assert ref.decode([toks([0, 1, 2]), toks([3, 4, 5])])  # window keeps 3, 4, 5
    ref.seq_rm(0, 4, -1)  # both caches drop 4, 5
    assert positions(ref.swa, 6) == [-1, -1, -1, 3, -1, -1]
    assert positions(ref.base, 6) == [0, 1, 2, 3, -1, -1]
    # redo 4, 5: window cells 4, 5 (head 3 -> blocked at 3 -> 4). Visible from pmin 4 with
    # n_swa 3 are positions 2..4: 2 was pruned, so 2 < min(3, 4) cells: the seed warns
    assert ref.decode([toks([4, 5])])
    assert ref.partial == [(0, 4, 2)]
    assert positions(ref.swa, 6) == [-1, -1, -1, 3, 4, 5]  # pmax 5 prunes nothing
    # the count is over every sequence: a cell of another sequence at position 2 silences it
    other = IswaRef(16, 2, 4, n_swa=3, swa_type="standard", n_batch=6)
    assert other.decode([toks([0, 1, 2]), toks([3, 4, 5])])
    # seq 1 starts at position 2: from 2 it sees only its own cell (seq 0's 3..5 are later),
    # 1 < min(3, 2): a warning for the new sequence itself
    assert other.decode([toks([2], seqs=[1])])
    assert other.partial == [(1, 2, 1)]
    other.seq_rm(0, 4, -1)
    assert other.decode([toks([4, 5])])  # sees seq 1's 2, 3, 4
    assert other.partial == [(1, 2, 1)]


# -- chunked ------------------------------------------------------------------------------------


def test_chunked_keeps_the_chunk_of_pmax():
    # n_swa 4, n_batch 8: pad(4 + 8, 4) = 12 window cells
    ref = IswaRef(16, 1, 4, n_swa=4, swa_type="chunked", n_batch=8)
    assert ref.decode([toks(range(7))])
    # pmax 6 is in chunk [4, 8): 0..3 pruned
    assert positions(ref.swa, 8) == [-1, -1, -1, -1, 4, 5, 6, -1]
    # pmax 7 ends the chunk: the next token (8) sees none of 4..7, yet they all stay
    # (the window search starts at head 0, which is free again)
    assert ref.decode([toks([7])])
    assert positions(ref.swa, 8) == [7, -1, -1, -1, 4, 5, 6, -1]
    # pmax 8 starts chunk [8, 12): everything before 8 goes. The window search from head 0:
    # 0 busy -> 1
    assert ref.decode([toks([8])])
    assert positions(ref.swa, 8) == [-1, 8, -1, -1, -1, -1, -1, -1]
    assert (ref.swa.used, ref.used_cells(), ref.seq_pos_min(0)) == (1, 9, 8)
    ref.check_invariants()


# -- symmetric ----------------------------------------------------------------------------------


def test_symmetric_prunes_only_the_past_side():
    # n_swa 4 (half 2), n_batch 8: 12 window cells
    ref = IswaRef(16, 1, 4, n_swa=4, swa_type="symmetric", n_batch=8)
    assert ref.decode([toks([5, 6, 7])])  # pmax 7: 7 - p0 > 2 for none of 5, 6, 7
    assert positions(ref.swa, 3) == [5, 6, 7]
    # earlier positions afterwards: cells 3..7; pmax 4 prunes 0, 1 (4 - p0 > 2). 7 is hidden
    # from 4 (|4 - 7| = 3 > 2) but is after pmax: a later token may still see it, so it stays
    assert ref.decode([toks([0, 1, 2, 3, 4])])
    assert positions(ref.swa, 8) == [5, 6, 7, -1, -1, 2, 3, 4]
    assert (ref.seq_pos_min(0), ref.seq_pos_max(0)) == (2, 7)


# -- several sequences --------------------------------------------------------------------------


def test_pruning_is_per_sequence_and_shared_cells_stay():
    # n_swa 2, two sequences, n_batch 4: pad(2 * 2 + 4, 4) = 8 window cells
    ref = IswaRef(16, 2, 4, n_swa=2, swa_type="standard", n_batch=4)
    batch = [[(0, [0, 1]), (1, [0, 1]), (2, [0]), (3, [0])]]
    assert ref.decode(batch)
    # seq 0 (pmax 3) leaves cells 0, 1 (3 - p0 >= 2); seq 1 (pmax 1) keeps them: cells stay
    assert seqs(ref.swa, 4) == [[1], [1], [0], [0]]
    assert (ref.swa.used, ref.n_tokens(), ref.base.n_tokens()) == (4, 6, 6)
    # a batch of seq 0 only: pmax 4 prunes its cell at 2; seq 1 is not pruned at all
    # (its window would drop nothing anyway here, but it is not even looked at)
    assert ref.decode([[(4, [0])]])
    assert seqs(ref.swa, 5) == [[1], [1], [], [0], [0]]
    assert (ref.seq_pos_min(0), ref.seq_pos_min(1), ref.seq_pos_min(-1)) == (3, 0, 0)
    ref.check_invariants()


def test_unbatched_sequence_keeps_its_old_cells():
    ref = IswaRef(16, 2, 4, n_swa=2, swa_type="standard", n_batch=4)
    assert ref.decode([toks([0, 1, 2], seqs=[1])])  # seq 1: pmax 2 prunes 0
    assert positions(ref.swa, 3) == [-1, 1, 2]
    ref.seq_add(1, 0, -1, 10)  # seq 1 now at 11, 12
    assert ref.decode([toks([0, 1, 2, 3])])  # seq 0 only; cells 3..6
    # seq 0: pmax 3 prunes its 0, 1; seq 1's 11, 12 are not looked at
    assert positions(ref.swa, 7) == [-1, 11, 12, -1, -1, 2, 3]
    assert ref.seq_pos_min(1) == 11


# -- placement: all or nothing ------------------------------------------------------------------


def test_ubatch_refused_by_the_window_cache_changes_neither():
    # n_swa 2, n_batch 2, padding 2: pad(2 + 2, 2) = 4 window cells
    ref = IswaRef(16, 1, 2, n_swa=2, swa_type="standard", n_batch=2)
    assert ref.size_swa == 4
    assert ref.find_slot(toks([0, 1]))[2] and ref.find_slot(toks([2, 3]))[2]
    assert ref.swa.used == 4 and ref.base.head == 2
    # the base has room, the window cache not: nothing changes, the base head included
    assert ref.find_slot(toks([4])) == ([], [], False)
    assert (ref.base.used, ref.base.head, positions(ref.base, 5)) == (4, 2, [0, 1, 2, 3, -1])
    ref.commit([toks([0, 1]), toks([2, 3])])  # pmax 3 prunes 0, 1
    # now both take it: base cell 4; window: head 2, 2..3 busy -> 4 runs off the end -> cell 0
    assert ref.find_slot(toks([4])) == ([4], [0], True)
    ref.check_invariants()


def test_decode_that_does_not_fit_restores_everything():
    ref = IswaRef(16, 1, 2, n_swa=2, swa_type="standard", n_batch=2)
    assert ref.decode([toks([0])])
    before = (positions(ref.base), positions(ref.swa), ref.base.head, ref.swa.head)
    # 5 tokens before any pruning do not fit 4 window cells: the third ubatch is refused
    assert not ref.decode([toks([1, 2]), toks([3, 4]), toks([5])])
    assert (positions(ref.base), positions(ref.swa), ref.base.head, ref.swa.head) == before
    assert (ref.used_cells(), ref.swa.used) == (1, 1)


def test_swa_full_never_prunes():
    ref = IswaRef(16, 1, 4, n_swa=2, swa_type="standard", n_batch=4, swa_full=True)
    assert ref.decode([toks(range(6))])
    assert positions(ref.swa, 6) == positions(ref.base, 6) == list(range(6))
    assert ref.seq_pos_min(0) == 0 and ref.can_shift()


# -- sequence operations reach both caches --------------------------------------------------------


def test_sequence_ops_apply_to_both_caches():
    ref = make_standard()
    assert ref.decode([toks(range(6))])  # base 0..5, window 3..5
    ref.seq_cp(0, 1 - 1, 0, -1)  # onto itself: nothing
    ref.seq_add(0, 0, -1, -2)  # base: 0, 1 fall below 0 and are freed
    assert positions(ref.base, 6) == [-1, -1, 0, 1, 2, 3]
    assert positions(ref.swa, 6) == [-1, -1, -1, 1, 2, 3]
    assert [c.delta for c in ref.swa.cells[:6]] == [0, 0, 0, -2, -2, -2]
    assert (ref.seq_pos_min(0), ref.base.seq_pos_min(0), ref.pos_max()) == (1, 0, 3)
    ref.seq_div(0, 2, -1, 2)  # 2 -> 1, 3 -> 1 in both
    assert positions(ref.base, 6) == [-1, -1, 0, 1, 1, 1]
    assert positions(ref.swa, 6) == [-1, -1, -1, 1, 1, 1]
    assert ref.seq_rm(0, 1, 2)  # the seed's iSWA always returns true
    assert ref.used_cells() == 1 and ref.swa.used == 0 and ref.seq_pos_min(0) == -1
    ref.seq_keep(0)
    ref.clear()
    assert ref.used_cells() == 0 and ref.swa.used == 0


def test_seq_cp_and_keep_reach_the_window_cache():
    ref = IswaRef(16, 2, 4, n_swa=2, swa_type="standard", n_batch=4)
    assert ref.decode([toks([0, 1, 2])])  # window keeps 1, 2
    ref.seq_cp(0, 1, -1, -1)
    assert seqs(ref.base, 3) == [[0, 1], [0, 1], [0, 1]] and seqs(ref.swa, 3) == [[], [0, 1], [0, 1]]
    assert ref.n_tokens() == 6 and ref.seq_pos_min(1) == 1
    ref.seq_keep(1)
    assert seqs(ref.swa, 3) == [[], [1], [1]] and ref.seq_pos_min(0) == -1


@pytest.mark.parametrize("swa_type", ["standard", "chunked", "symmetric"])
def test_invariants_hold_after_a_mixed_run(swa_type):
    # the base never prunes: 64 cells hold the run's 40 tokens
    ref = IswaRef(64, 3, 4, n_swa=4, swa_type=swa_type, n_batch=6)
    pos = [0, 0, 0]
    for step in range(10):
        s = step % 3
        batch = [[(pos[s] + i, [s]) for i in range(3)], [(pos[s] + 3, [s, (s + 1) % 3])]]
        pos[s] += 4
        assert ref.decode(batch)
        if step % 4 == 3:
            ref.seq_rm(s, pos[s] - 1, -1)
            pos[s] -= 1
        ref.check_invariants()
        # the window cache holds a subset of the base's tokens
        base = {(c.pos, q) for c in ref.base.cells for q in c.seqs}
        assert {(c.pos, q) for c in ref.swa.cells for q in c.seqs} <= base
        # after the commit no sequence of the batch keeps a window cell its pmax cannot see
        for q, (_, pmax) in batch_ranges(batch).items():
            assert not any(q in c.seqs and pruned(swa_type, 4, c.pos, pmax) for c in ref.swa.cells)
