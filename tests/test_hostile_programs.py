"""Random programs of valid and invalid operations, on every memory kind: no sequence ever loses a cell.

Issue 43's proof of "no operation that loses a sequence": hypothesis draws programs that mix the
contract's valid operations (placements, every sequence verb) with careless and hostile ones
(sequence ids outside the range, divisors <= 0, shifts that would move a recurrent state below 0
or a position onto ``2**31 - 1``, placements naming a sequence the memory does not have). Each
program runs eagerly and under ``jit`` beside the pure-Python reference model of its memory, and
after every operation:

- a valid operation leaves every cell equal to the reference's (so every sequence holds exactly
  the cells it should, no more, no fewer);
- a refused or invalid one raises ``ValueError`` eagerly, and under ``jit`` is skipped with an
  error bit set; either way the memory (every leaf: cells, K/V, states) is unchanged, and the
  reference is not advanced.
"""

from __future__ import annotations

import jax
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvjax
from kvjax._validate import POS_END
from kvjax.testing import HybridRef, IswaRef, RecurrentRef, StreamsRef, UnifiedRef
from tests.test_memory_contract import ROWS, apply_in_lock_step, apply_op, leaves_equal


def _cells_of(ref):
    """Every reference cell of ``ref`` with a ``pos`` and a set of ``seqs`` (all parts, all streams)."""
    if isinstance(ref, (UnifiedRef, RecurrentRef)):
        return list(ref.cells)
    if isinstance(ref, IswaRef):
        return list(ref.base.cells) + list(ref.swa.cells)
    if isinstance(ref, StreamsRef):
        return [cell for stream in ref.streams for cell in stream.cells]
    if isinstance(ref, HybridRef):
        return list(ref.attention.cells) + list(ref.recurrent.cells)
    raise TypeError(type(ref).__name__)


def _recurrent_part(ref):
    return ref if isinstance(ref, RecurrentRef) else ref.recurrent if isinstance(ref, HybridRef) else None


def _refused_shift(ref, seq_id, p0, p1, delta) -> bool:
    """Whether kvjax refuses this ``seq_add``: a position pushed to ``2**31 - 1`` or past it (every
    memory), or a recurrent state moved below 0 (the recurrent and hybrid memories)."""
    lo, hi = max(p0, 0), (2**31 if p1 < 0 else p1)  # the seed's range: p0 < 0 is 0, p1 < 0 infinity
    moved = [c for c in _cells_of(ref) if c.seqs and (seq_id < 0 or seq_id in c.seqs) and lo <= c.pos < hi]
    if delta and lo < hi and any(c.pos + delta >= POS_END for c in moved):
        return True
    recurrent = _recurrent_part(ref)
    return recurrent is not None and not recurrent.shift_keeps_states(seq_id, p0, p1, delta)


def _programs(n_seq_max: int):
    """A strategy of op lists: ``(op, why)`` with ``why`` None for a valid op, else what kvjax must refuse."""
    seq = st.integers(0, n_seq_max - 1)
    bad_seq = st.sampled_from([n_seq_max, n_seq_max + 3, -2, -(2**31)])
    small = st.integers(-1, 10)

    @st.composite
    def program(draw):
        next_pos = [0] * n_seq_max
        ops = []
        for _ in range(draw(st.integers(4, 14))):
            kind = draw(st.sampled_from(["place"] * 3 + ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "bad"]))
            s = draw(seq)
            if kind == "place":
                n = draw(st.integers(1, 5))
                shared = [s] + ([(s + 1) % n_seq_max] if draw(st.booleans()) and n_seq_max > 1 else [])
                ops.append((("place", [(next_pos[s] + i, shared) for i in range(n)]), None))
                next_pos[s] += n
            elif kind == "seq_rm":
                ops.append((("seq_rm", draw(st.sampled_from([s, -1])), draw(small), draw(small)), None))
            elif kind == "seq_cp":
                ops.append((("seq_cp", s, draw(seq), -1, draw(small)), None))
            elif kind == "seq_keep":
                ops.append((("seq_keep", draw(st.sampled_from([s, -1]))), None))
            elif kind == "seq_add":
                # small shifts (some move a state below 0: refused on recurrent memories) and huge ones
                delta = draw(st.one_of(st.integers(-6, 4), st.sampled_from([2**31 - 3, 2**31 - 1, -(2**31)])))
                ops.append((("seq_add", draw(st.sampled_from([s, -1])), draw(st.integers(0, 6)), -1, delta), "shift"))
            elif kind == "seq_div":
                ops.append((("seq_div", s, draw(st.integers(0, 6)), -1, draw(st.integers(1, 3))), None))
            else:  # an argument outside its range, refused whatever the memory holds
                op = draw(st.sampled_from(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "place"]))
                b = draw(bad_seq)
                ops.append(
                    (
                        {
                            "seq_rm": ("seq_rm", b, 0, -1),
                            "seq_cp": ("seq_cp", s, b if b >= 0 else n_seq_max, -1, -1),
                            "seq_keep": ("seq_keep", b),
                            "seq_add": ("seq_add", b, 0, -1, 1),
                            "seq_div": ("seq_div", s, 0, -1, draw(st.sampled_from([0, -1, -(2**31)]))),
                            "place": ("place", [(next_pos[s], [s, n_seq_max])]),
                        }[op],
                        "argument",
                    )
                )
        return ops

    return program()


def _unchanged(before, after) -> bool:
    return leaves_equal(kvjax.clear_errors(before), kvjax.clear_errors(after))


def _run(row, ops):
    eager, jitted, ref = row.make(), row.make(), row.reference()
    for op, why in ops:
        if why != "argument":
            op = row.adapt([op])[0]  # the streams memory's rules (tokens of one stream, whole copies across)
        if why == "shift" and not _refused_shift(ref, *op[1:]):
            why = None
        if why is None:
            eager, jitted = apply_in_lock_step(row, ref, eager, jitted, op)
            assert kvjax.errors(jitted) == [], (op, kvjax.errors(jitted))
            continue
        before = jax.device_get(eager)
        with pytest.raises(ValueError):
            apply_op(eager, op, jitted=False)
        assert leaves_equal(eager, before), f"an eager refusal changed the memory: {op}"
        flagged, _ = apply_op(jitted, op, jitted=True)
        assert int(flagged.error_bits()) != 0, f"no error bit for {op} ({why})"
        assert _unchanged(jitted, flagged), f"a refused op changed the memory under jit: {op}"
        jitted = kvjax.clear_errors(flagged)
        row.compare(jitted, ref)  # every sequence still holds every cell it held
    for s in range(-1, eager.n_seq_max):
        assert int(kvjax.seq_pos_min(eager, s)) == ref.seq_pos_min(s)
        assert int(kvjax.seq_pos_max(eager, s)) == ref.seq_pos_max(s)


@pytest.mark.parametrize("row", ROWS)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_program_loses_a_cell(row, data):
    _run(row, data.draw(_programs(row.make().n_seq_max), label="program"))


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_no_long_program_loses_a_cell(row, data):
    _run(row, data.draw(_programs(row.make().n_seq_max), label="program"))


@pytest.mark.parametrize("row", ROWS)
def test_a_refused_placement_says_why_on_every_memory(row):
    """A jitted placement naming a sequence the memory does not have is refused with the UBATCH bit
    on every memory. The iSWA pair's all-or-nothing rule kept the old metadata, error word included,
    so it said nothing (the hybrid's rule now keeps new bits the same way)."""
    memory = row.make()
    bad = [([0], [0, memory.n_seq_max])]
    ub = (
        kvjax.make_equal_ubatch(bad, n_slots=1)
        if memory.ubatch_split == "equal" and not memory.streamed
        else kvjax.make_ubatch([0], [[0, memory.n_seq_max]], length=8)
    )
    out, _, ok = jax.jit(kvjax.find_slot)(memory, ub)
    assert not bool(ok)
    assert int(out.error_bits()) == kvjax.ErrorFlag.UBATCH
    assert _unchanged(memory, out)
