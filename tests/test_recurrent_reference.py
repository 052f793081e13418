"""Hand-worked checks of the pure-Python model of the seed's recurrent-state cache.

Every expected value was worked out by hand from ``llama_kv_cache_recurrent`` in
``shared/seed/llama-kv-cache.cpp`` plus kvjax's deliberate differences and the ``k``-state
extension (the module docstring of ``kvjax.testing._recurrent_reference`` is the spec). State
rows are simulated with ``move_rows``: a state is the tuple of positions folded into it, so a
row's content says exactly which tokens it has seen.
"""

from __future__ import annotations

import copy

import pytest

from kvjax.testing import RecurrentRef
from kvjax.testing._recurrent_reference import POS_MAX, move_rows, state_layout


def fold(state, pos):
    return state + (pos,)


def make(size, cells, n_seq_max=4, k=1, head=0):
    """A reference in a given state: ``cells`` is a list of ``(pos, seqs)`` or None (empty)."""
    ref = RecurrentRef(size, n_seq_max, k)
    for i, spec in enumerate(cells):
        if spec is not None:
            c = ref.cells[i]
            c.pos, c.seqs, c.src, c.roll, c.hist = spec[0], set(spec[1]), i, 0, 1
            for s in spec[1]:
                ref.tail[s] = i
            ref.used += 1
    ref.head = head
    ref.check_invariants()
    return ref


def rows_of(ref):
    """Rows consistent with ``make``: each used cell holds the state of positions 0..pos."""
    return {(i, 0): tuple(range(c.pos + 1)) for i, c in enumerate(ref.cells) if not c.is_empty()}


def run(ref, rows, ubatch):
    """find_slot, the inputs, and the rows the ubatch leaves; checks the kept states."""
    assert ref.find_slot(ubatch)
    ref.check_invariants(pending=True)
    inputs = ref.set_inputs()
    rows = move_rows(rows, ref, inputs, ubatch, fold, ())
    ref.check_invariants()
    check_rows(ref, rows)
    return rows, inputs


def check_rows(ref, rows):
    """Every kept state of a sequence is the state after ``pos - j``: the newer one minus a token."""
    for s in range(ref.n_seq_max):
        t = ref.tail[s]
        if t < 0:
            continue
        for j in range(ref.cells[t].hist):
            value = rows[ref.state_of(s, j)]
            assert value[-1] == ref.cells[t].pos - j, (s, j, value)
            if j:
                assert value == rows[ref.state_of(s, j - 1)][:-1], (s, j, value)


def snapshot(ref):
    return copy.deepcopy(ref.__dict__)


def cells(ref):
    return [(c.pos, sorted(c.seqs)) for c in ref.cells]


# -- seq_rm: refusals ---------------------------------------------------------------------------


def test_seq_rm_refuses_cuts_inside_a_state():
    ref = make(4, [(2, [0]), None, None, None])  # seq 0: one state, positions 0..2
    before = snapshot(ref)
    for p0, p1 in [(1, -1), (2, 3), (0, 2), (1, 2), (5, 1), (2, -1)]:
        assert ref.seq_rm(0, p0, p1) is False, (p0, p1)  # p0 in (0, 2] or p1 in (0, 2]
        assert snapshot(ref) == before
    assert ref.seq_rm(4, -1, -1) is False  # seq id >= n_seq_max
    # negative seq id: everything or nothing
    for p0, p1 in [(0, 5), (1, -1), (-1, 3)]:
        assert ref.seq_rm(-1, p0, p1) is False, (p0, p1)
    assert snapshot(ref) == before


def test_seq_rm_accepts_ranges_missing_or_covering_the_state():
    ref = make(4, [(2, [0]), (1, [1]), None, None], head=3)
    before = snapshot(ref)
    assert ref.seq_rm(0, 3, -1) and snapshot(ref) == before  # after the state
    assert ref.seq_rm(0, 0, 0) and snapshot(ref) == before  # empty range
    assert ref.seq_rm(2, 1, -1) and snapshot(ref) == before  # seq 2 has no state
    assert ref.seq_rm(-1, 3, 3) and snapshot(ref) == before  # empty range, all sequences
    assert ref.seq_rm(0, 0, 3)  # exactly the whole state
    assert cells(ref)[:2] == [(-1, []), (1, [1])]
    assert ref.tail[:2] == [-1, 1] and ref.used == 1 and ref.head == 0  # freed 0 < head 3
    assert ref.seq_rm(-1, -1, -1)  # everything, tails too
    assert ref.tail == [-1] * 4 and ref.used == 0
    ref.check_invariants()


def test_seq_rm_of_a_shared_state_keeps_it_for_the_others():
    ref = make(4, [(4, [0, 1]), None, None, None], head=2)
    assert not ref.seq_rm(1, 2, -1)  # a cut, shared or not
    assert ref.seq_rm(1, -1, -1)
    assert cells(ref)[0] == (4, [0]) and ref.tail[:2] == [0, -1]
    assert ref.used == 1 and ref.head == 2  # nothing freed
    ref.check_invariants()


# -- seq_cp, then divergent decodes: copy-on-write ---------------------------------------------


def test_seq_cp_then_divergent_decode_copies_on_write():
    ref = RecurrentRef(4, 4)
    rows, inputs = run(ref, {}, [([0, 1, 2], [0])])
    assert inputs == ([0], [0], [0.0])  # new: zeroed, read from itself
    ref.seq_cp(0, 1, -1, -1)
    ref.seq_cp(0, 2, 5, 9)  # the range is ignored
    assert cells(ref)[0] == (2, [0, 1, 2]) and ref.tail[:3] == [0, 0, 0]
    assert (ref.n_tokens(), ref.used_cells()) == (3, 1)
    # three sequences decode position 3 from the shared state. From head 0 the next empty
    # cell is 1: seq 0 (shared) gets cell 1 (pos 2, src 0), seq 1 (still shared) cell 2,
    # seq 2 is then alone in cell 0 and keeps it. min 0, max 2. Gather: slot 0 -> cell 0 swaps
    # cells 0 and 1 (seq 0 to 0, seq 2 to 1); slot 1 -> cell 1 swaps 1 and 2 (seq 1 to 1,
    # seq 2 to 2). All three read the shared row 0
    rows, inputs = run(ref, rows, [([3], [0]), ([3], [1]), ([3], [2])])
    assert inputs == ([0, 0, 0], [0, 0, 0], [1.0, 1.0, 1.0])
    assert cells(ref)[:3] == [(3, [0]), (3, [1]), (3, [2])] and ref.tail[:3] == [0, 1, 2]
    assert (ref.head, ref.n, ref.used_cells()) == (0, 3, 3)
    assert [rows[(i, 0)] for i in range(3)] == [(0, 1, 2, 3)] * 3
    # seq 0 and seq 2 go on: slot 1 -> cell 1 swaps cells 1 and 2, so seq 1's state is moved
    # out of the way to cell 2, still inside [head, head + n)
    rows, inputs = run(ref, rows, [([4], [0]), ([4], [2])])
    assert inputs == ([0, 2, 1], [0, 0, 0], [1.0, 1.0, 1.0])
    assert cells(ref)[:3] == [(4, [0]), (4, [2]), (3, [1])] and ref.tail[:3] == [0, 2, 1]
    assert rows[ref.state_of(1)] == (0, 1, 2, 3)


def test_seq_cp_drops_the_destination_state():
    ref = make(4, [(3, [0]), (7, [1]), (5, [2]), None])
    ref.seq_cp(0, 1, -1, -1)  # seq 1's cell 1 is freed
    assert cells(ref)[:3] == [(3, [0, 1]), (-1, []), (5, [2])] and ref.used == 2
    ref.seq_cp(3, 2, -1, -1)  # seq 3 has no state: 2 loses its
    assert ref.tail == [0, 0, -1, -1] and ref.used == 1
    ref.seq_cp(1, 0, -1, -1)  # already shared: unchanged
    assert cells(ref)[0] == (3, [0, 1])
    ref.seq_cp(0, 0, -1, -1)
    ref.check_invariants()


# -- find_slot: the swap that loses a sequence in the seed -------------------------------------


def test_tails_are_swapped_by_value():
    # seq 2 (Z) at cell 1, seq 0 (A) at cell 2; cells 0 and 3 empty
    ref = make(4, [None, (4, [2]), (7, [0]), None])
    rows = rows_of(ref)
    # A decodes 8, new seq 1 (B) starts at 0. A owns cell 2; B reserves the next empty cell, 0.
    # min 0, max 2. Slot 0 -> cell 0: cells 0 and 2 swap (A to 0, B's empty reserved cell to 2).
    # The seed re-points only the tails of the sequences in the two cells: A's; B's reserved
    # cell holds no sequence, so B's tail stays 0. Slot 1 -> cell 1 then swaps cell 1 (Z) with
    # "B's" cell 0, which is A's: A goes to 1 and Z to 0, and the final pass writes A into cell 0
    # (over Z, whose tail still says 0: Z is lost) and B into cell 1 (with A's src: B would
    # start from A's state, A from Z's). Swapping tails by value, B's tail follows its cell to 2,
    # slot 1 swaps cells 1 and 2, and Z moves to cell 2:
    rows, inputs = run(ref, rows, [([8], [0]), ([0], [1])])
    assert cells(ref)[:3] == [(8, [0]), (0, [1]), (4, [2])] and ref.tail[:3] == [0, 1, 2]
    assert (ref.head, ref.n) == (0, 3)
    # A reads its old row 2, B starts from zeros, Z's row moves from 1 to 2
    assert inputs == ([2, 1, 1], [0, 0, 0], [1.0, 0.0, 1.0])
    assert rows[(0, 0)] == tuple(range(9)) and rows[(1, 0)] == (0,) and rows[(2, 0)] == tuple(range(5))


# -- find_slot: inputs of a few ubatches ---------------------------------------------------------


def test_secondary_seq_ids_join_the_primary_state():
    ref = make(4, [(4, [0]), (2, [1]), None, None], head=1)
    rows = rows_of(ref)
    rows, inputs = run(ref, rows, [([5], [0, 1])])  # seq 1's own state is dropped
    assert cells(ref)[:2] == [(5, [0, 1]), (-1, [])] and ref.tail[:2] == [0, 0]
    assert inputs == ([0], [0], [1.0]) and (ref.head, ref.n, ref.used) == (0, 1, 1)
    assert ref.warnings == []
    # a jump from 5 to 9: the seed warns; seq 0 copies the shared state into cell 1
    rows, inputs = run(ref, rows, [([9], [0])])
    assert ref.warnings == [(0, 9, 5)]
    assert cells(ref)[:2] == [(5, [1]), (9, [0])] and inputs == ([0], [0], [1.0])
    assert (ref.head, ref.n) == (1, 1)


def test_head_reset_and_cyclic_empty_search():
    # head 7 > used 1 + 2 * 1: the search restarts at 0 and takes cell 1
    ref = make(8, [(0, [0])] + [None] * 7, head=7)
    assert ref.find_slot([([0], [1])]) and ref.tail[1] == 1 and ref.head == 1
    # head 3 == used 1 + 2: no reset, cell 3 is taken
    ref = make(8, [(0, [0])] + [None] * 7, head=3)
    assert ref.find_slot([([0], [1])]) and ref.tail[1] == 3 and ref.head == 3
    # from head 6 with 6, 7 used the search wraps to 0: cells 0 and 1 for two new sequences
    ref = make(8, [None] * 6 + [(0, [0]), (0, [1])], head=6)
    assert ref.find_slot([([0], [2]), ([0], [3])])
    assert ref.tail == [6, 7, 0, 1] and (ref.head, ref.n) == (0, 2)


def test_empty_cell_swapped_into_the_range_keeps_no_source():
    ref = make(4, [(3, [0]), None, (5, [1]), None], n_seq_max=3)
    rows = rows_of(ref)
    # slot 1 -> cell 1 swaps the empty cell 1 with seq 1's cell 2: n = 3 covers the empty cell
    rows, inputs = run(ref, rows, [([4], [0]), ([6], [1])])
    assert inputs == ([0, 2, 2], [0, 0, 0], [1.0, 1.0, 0.0])
    assert ref.cells[2].src == -1  # the seed points it at itself (src = 2) ...
    # ... and a new sequence given cell 2 would read the stale row 2 (mask 1) instead of zeros
    rows, inputs = run(ref, rows, [([0], [2])])
    assert ref.tail[2] == 2 and inputs == ([2], [0], [0.0]) and rows[(2, 0)] == (0,)


def test_failed_find_slot_changes_nothing():
    ref = make(2, [(3, [0]), (1, [1])], n_seq_max=3, head=1)
    before = snapshot(ref)
    assert not ref.find_slot([([4], [0]), ([0], [2])])  # seq 2 needs a cell: none is empty
    assert snapshot(ref) == before
    assert not ref.find_slot([([4], [0, 3])])  # seq id 3 >= n_seq_max
    assert snapshot(ref) == before
    # a shared state needs a cell for the copy too
    shared = make(1, [(3, [0, 1])], n_seq_max=2)
    before = snapshot(shared)
    assert not shared.find_slot([([4], [0])]) and snapshot(shared) == before
    assert shared.find_slot([([4], [0, 1])])  # both advance together: no copy


# -- sequence operations on positions -----------------------------------------------------------


def test_seq_add_div_keep_and_queries():
    ref = make(4, [(5, [0]), (3, [1, 2]), (7, [3]), None], head=3)
    ref.seq_add(1, 0, 4, 10)  # the shared cell moves for seq 2 as well
    assert cells(ref)[1] == (13, [1, 2]) and ref.seq_pos_max(2) == 13
    ref.seq_add(0, 6, -1, 3)  # 5 is not in [6, inf)
    ref.seq_add(0, 4, 4, 3)  # empty range
    ref.seq_add(0, 0, -1, 0)  # delta 0
    assert ref.cells[0].pos == 5
    ref.seq_add(-1, 0, 10, 2)  # kvjax -1: cells at 5 and 7, not 13
    assert [c.pos for c in ref.cells] == [7, 13, 9, -1]
    ref.seq_div(3, 0, -1, 2)  # 9 -> 4
    ref.seq_div(0, 8, -1, 2)  # 7 not in range
    assert [c.pos for c in ref.cells] == [7, 13, 4, -1]
    assert [ref.seq_pos_min(s) for s in (-1, 0, 1, 3)] == [4, 7, 13, 4]
    assert [ref.seq_pos_max(s) for s in (-1, 0, 1, 3)] == [13, 7, 13, 4]
    assert (ref.pos_max(), ref.n_tokens(), ref.cell_max(), ref.can_shift()) == (13, 4, 3, False)
    before = snapshot(ref)
    ref.seq_add(0, -1, -1, -8)  # 7 - 8 < 0: kvjax refuses, the state is kept
    ref.seq_add(-1, -1, -1, -5)  # one of the states (4) would go below 0: nothing moves
    assert snapshot(ref) == before
    ref.seq_rm(0, -1, -1)  # what the old test freed by the shift, removed for real
    assert cells(ref)[0] == (-1, []) and ref.tail[0] == -1 and ref.head == 0 and ref.used == 2
    ref.head = 3
    ref.seq_keep(-1)  # kvjax: keeps everything
    assert ref.used == 2 and ref.head == 3
    ref.seq_keep(1)  # seq 2 loses its share of cell 1, seq 3 its cell
    assert cells(ref)[:3] == [(-1, []), (13, [1]), (-1, [])] and ref.tail == [-1, 1, -1, -1]
    assert ref.used == 1 and ref.head == 0  # first cell without seq 1
    ref.check_invariants()
    ref.clear()
    assert ref.used == 0 and ref.tail == [-1] * 4


# -- the k-state extension -----------------------------------------------------------------------


def test_rollback_into_the_kept_states():
    ref = RecurrentRef(2, 2, n_states=3)
    rows, _ = run(ref, {}, [([0, 1, 2, 3, 4], [0])])
    # states after 4, 3, 2 are kept in rows 0, 1, 2 of cell 0
    assert (ref.cells[0].pos, ref.cells[0].hist) == (4, 3)
    assert [rows[(0, j)] for j in range(3)] == [(0, 1, 2, 3, 4), (0, 1, 2, 3), (0, 1, 2)]
    assert not ref.seq_rm(0, 2, -1)  # needs the state after 1: j = 3 is not kept
    assert not ref.seq_rm(0, 4, 4)  # p1 = 4 <= pos: not a rollback, refused
    assert ref.seq_rm(0, 4, -1)  # j = 1: the state after 3 covers positions < 4
    assert (ref.cells[0].pos, ref.cells[0].roll, ref.cells[0].hist) == (3, 1, 2)
    assert rows[ref.state_of(0)] == (0, 1, 2, 3)
    assert ref.seq_rm(0, 3, 10)  # a finite end past pos is a rollback too
    assert (ref.cells[0].pos, ref.cells[0].roll, ref.cells[0].hist) == (2, 2, 1)
    assert not ref.seq_rm(0, 2, -1)  # nothing older is kept
    assert ref.seq_pos_max(0) == 2
    # decoding 3 reads row 2, writes the new state to row 0 and carries the old one to row 1
    rows, inputs = run(ref, rows, [([3], [0])])
    assert inputs == ([0], [2], [1.0])
    assert (ref.cells[0].hist, rows[(0, 0)], rows[(0, 1)]) == (2, (0, 1, 2, 3), (0, 1, 2))
    assert (0, 2) not in rows  # past hist: never read


def test_rollback_of_a_shared_state_refused_until_copy_on_write():
    ref = RecurrentRef(2, 2, n_states=3)
    rows, _ = run(ref, {}, [([0, 1, 2, 3], [0])])
    ref.seq_cp(0, 1, -1, -1)
    before = snapshot(ref)
    assert not ref.seq_rm(1, 3, -1) and not ref.seq_rm(0, 3, -1)
    assert snapshot(ref) == before
    # seq 1 decodes: copy-on-write into cell 1 takes the history along (hist 3 -> min(3, 4))
    rows, inputs = run(ref, rows, [([4], [1])])
    assert inputs == ([0], [0], [1.0]) and ref.tail == [0, 1]
    assert [rows[ref.state_of(1, j)] for j in range(3)] == [(0, 1, 2, 3, 4), (0, 1, 2, 3), (0, 1, 2)]
    assert ref.seq_rm(1, 3, -1)  # j = 2 < 3
    assert rows[ref.state_of(1)] == (0, 1, 2) and rows[ref.state_of(0)] == (0, 1, 2, 3)
    # a rolled-back state shared by seq_cp is read from its row by both copies
    ref.seq_cp(1, 0, -1, -1)
    rows, inputs = run(ref, rows, [([3], [0]), ([3], [1])])
    assert inputs[0] == [1, 1] and inputs[1] == [2, 2]


def test_one_state_is_the_seed():
    ref = RecurrentRef(2, 2, n_states=1)
    rows, _ = run(ref, {}, [([0, 1, 2], [0])])
    assert ref.cells[0].hist == 1 and not ref.seq_rm(0, 2, -1) and not ref.seq_rm(0, 1, -1)


def test_div_keeps_only_the_current_state_and_jumps_restart_history():
    ref = RecurrentRef(2, 2, n_states=3)
    rows, _ = run(ref, {}, [([0, 1, 2, 3], [0])])
    ref.seq_add(0, -1, -1, 4)  # kept states move along: 7, 6, 5
    assert ref.seq_rm(0, 7, -1) and ref.cells[0].pos == 6
    ref.seq_div(0, -1, -1, 2)  # 6 -> 3: older states are not at 2, 1
    assert ref.cells[0].hist == 1 and not ref.seq_rm(0, 3, -1)
    ref2 = RecurrentRef(2, 2, n_states=3)
    rows, _ = run(ref2, {}, [([0, 1], [0])])
    assert ref2.find_slot([([5, 6], [0])])  # not 2, 3: the seed warns, history restarts
    assert ref2.warnings == [(0, 6, 1)] and ref2.cells[0].hist == 2


@pytest.mark.parametrize("k", [1, 2, 4])
def test_invariants_and_rows_over_a_mixed_run(k):
    ref = RecurrentRef(6, 4, n_states=k)
    rows = {}
    nxt = [0, 0, 0, 0]
    for step in range(24):
        a, b = step % 4, (step * 3 + 1) % 4
        n_tok = 1 + step % 3
        ubatch = [(list(range(nxt[a], nxt[a] + n_tok)), [a])]
        if b != a:
            ubatch.append((list(range(nxt[b], nxt[b] + n_tok)), [b]))
        rows, _ = run(ref, rows, ubatch)
        for _, ids in ubatch:
            nxt[ids[0]] += n_tok
        if step % 5 == 4:
            ref.seq_cp(a, (a + 2) % 4, -1, -1)
            nxt[(a + 2) % 4] = nxt[a]
        if step % 3 == 2:
            p0 = nxt[b] - 1 - step % 2
            t = ref.tail[b]
            if t < 0 or p0 <= 0 or p0 > ref.cells[t].pos:
                expect = True  # nothing, or the whole state, is removed
            else:  # a rollback: kept and not shared
                cell = ref.cells[t]
                expect = k > 1 and cell.pos - p0 + 1 < cell.hist and len(cell.seqs) == 1
            assert ref.seq_rm(b, p0, -1) == expect
            if expect:
                nxt[b] = max(0, min(nxt[b], p0))
        ref.check_invariants()
        check_rows(ref, rows)
    assert ref.seq_rm(-1, -1, -1) and ref.used == 0 and ref.tail == [-1] * 4


def test_state_layout_names_every_field():
    text = state_layout()
    for field in (
        "u32 cell_count",
        "i32 pos",
        "u32 n_seq_id",
        "u32 v_trans",
        "u32 n_layer",
        "u64 k row size",
        "src = its own index",
        "roll = 0, hist = 1",
    ):
        assert field in text, field


def test_pos_max_constant():
    assert POS_MAX == 2**31 - 1
