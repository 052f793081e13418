"""Bad input to the public cell ops (``kvjax/ops.py``): host errors and traced error bits.

Concrete arguments are checked on the host: a ``ValueError`` names the argument and its allowed
range, and the cache passed in is unchanged. The same bad values passed traced inside ``jit``
cannot raise: the op leaves every cell as it was and sets the matching bit of the error word
(``kvjax.errors``), and the bad value runs the same compiled program as a good one.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import kvjax
from kvjax._errors import ERROR_MESSAGES, ErrorFlag
from kvjax.memory._ubatch import Ubatch
from tests.helpers import fill, no_recompile

S = 4  # n_seq_max of the test cache
CONFIG = kvjax.CacheConfig(size=16, n_seq_max=S, n_layer=1, n_kv_heads=1, head_dim=4, padding=8)


@pytest.fixture(scope="module")
def cache():
    """A few cells of several sequences, one shared, one with a pending shift."""
    c = fill(kvjax.init(CONFIG), [0, 1, 2, 3, 4], [[0], [0, 1], [1], [2], [3]])
    c = kvjax.seq_add(c, 3, 0, -1, 2)
    return kvjax.seq_rm(c, 0, 0, 1)[0]  # head moves back to cell 0


def snapshot(cache):
    cells = cache.cells
    return tuple(
        np.asarray(x).copy() for x in (cells.pos, cells.seq, cells.delta, cells.head, cells.error, cells.defrag)
    )


def assert_unchanged(before, cache):
    for name, a, b in zip(("pos", "seq", "delta", "head", "error", "defrag"), before, snapshot(cache)):
        np.testing.assert_array_equal(a, b, err_msg=name)


def ubatch(pos, seq_ids, length=8):
    """A ubatch built by hand (bypassing make_ubatch's own checks)."""
    n = len(pos)
    ids = np.full((length, max(len(s) for s in seq_ids)), -1, np.int32)
    for i, s in enumerate(seq_ids):
        ids[i, : len(s)] = s
    p = np.zeros(length, np.int32)
    p[:n] = pos
    return Ubatch(pos=p, seq_ids=ids, valid=np.arange(length) < n)


# Every op taking a sequence id: (name, call with the id in that place, allowed range).
SEQ_ARGS = [
    ("seq_rm", "seq_id", lambda c, s: kvjax.seq_rm(c, s, 0, -1)[0], -1),
    ("seq_cp", "seq_id_src", lambda c, s: kvjax.seq_cp(c, s, 1, 0, -1), 0),
    ("seq_cp", "seq_id_dst", lambda c, s: kvjax.seq_cp(c, 1, s, 0, -1), 0),
    ("seq_keep", "seq_id", lambda c, s: kvjax.seq_keep(c, s), -1),
    ("seq_add", "seq_id", lambda c, s: kvjax.seq_add(c, s, 0, -1, 3), -1),
    ("seq_div", "seq_id", lambda c, s: kvjax.seq_div(c, s, 0, -1, 2), -1),
    ("seq_pos_min", "seq_id", lambda c, s: kvjax.seq_pos_min(c, s), -1),
    ("seq_pos_max", "seq_id", lambda c, s: kvjax.seq_pos_max(c, s), -1),
]
SEQ_CASES = [
    pytest.param(call, arg, lo, bad, id=f"{op}-{arg}={bad}")
    for op, arg, call, lo in SEQ_ARGS
    for bad in (lo - 1, S, 1000)
]
RETURNS_CACHE = [p for p in SEQ_CASES if not p.id.startswith("seq_pos")]


# -- concrete arguments: ValueError, cache unchanged --------------------------------------------


@pytest.mark.parametrize("call, arg, lo, bad", SEQ_CASES)
def test_seq_id_out_of_range_raises(cache, call, arg, lo, bad):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"{arg}={bad} is out of range: allowed \[{lo}, {S}\)"):
        call(cache, bad)
    assert_unchanged(before, cache)


@pytest.mark.parametrize("d", [0, -1, -(2**31)])
def test_seq_div_divisor_must_be_positive(cache, d):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=rf"d={d} is out of range: allowed d >= 1"):
        kvjax.seq_div(cache, 0, 0, -1, d)
    assert_unchanged(before, cache)


def test_ubatch_longer_than_the_cache(cache):
    before = snapshot(cache)
    long = kvjax.make_ubatch(range(17), [[0]] * 17)
    for place in (
        lambda: kvjax.find_slot(cache, long),
        lambda: kvjax.find_slot(cache, long, contiguous=False),
        lambda: kvjax.prepare(cache, [long]),
    ):
        with pytest.raises(ValueError, match=r"ubatch has 17 tokens: allowed at most size=16"):
            place()
    assert_unchanged(before, cache)


@pytest.mark.parametrize(
    "pos, seq_ids, match",
    [
        ([0, 1], [[0], [S]], rf"ubatch seq id {S} is out of range: allowed \[0, {S}\)"),
        ([0, 1], [[0], [1, -2]], rf"ubatch seq id -2 is out of range: allowed \[0, {S}\)"),
        ([0, 1], [[-1, 1], [0]], rf"ubatch seq id -1 is out of range: allowed \[0, {S}\)"),
        ([0, -3], [[0], [1]], r"ubatch position -3 is out of range: allowed >= 0"),
    ],
)
def test_bad_ubatch_tokens_raise(cache, pos, seq_ids, match):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        kvjax.find_slot(cache, ubatch(pos, seq_ids))
    with pytest.raises(ValueError, match=match):
        kvjax.prepare(cache, [kvjax.make_ubatch([5], [[0]]), ubatch(pos, seq_ids)])
    assert_unchanged(before, cache)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: kvjax.seq_rm(c, 1.5, 0, -1), r"seq_id=1.5 is out of range: allowed an integer scalar"),
        (lambda c: kvjax.seq_rm(c, 0, 0.5, -1), r"p0=0.5 is out of range: allowed an integer scalar"),
        (lambda c: kvjax.seq_rm(c, 0, 0, "3"), r"p1='3' is out of range: allowed an integer scalar"),
        (lambda c: kvjax.seq_cp(c, 0, None, 0, -1), r"seq_id_dst=None is out of range: allowed an integer scalar"),
        (
            lambda c: kvjax.seq_keep(c, np.array([0, 1])),
            r"seq_id=array\(\[0, 1\]\) is out of range: allowed an integer scalar",
        ),
        (lambda c: kvjax.seq_add(c, 0, 0, -1, 0.5), r"delta=0.5 is out of range: allowed an integer scalar"),
        (
            lambda c: kvjax.seq_add(c, 0, 0, 2**31, 1),
            r"p1=2147483648 is out of range: allowed \[-2147483648, 2147483647\]",
        ),
        (lambda c: kvjax.seq_add(c, 0, 0, -1, -(2**31) - 1), r"delta=-2147483649 is out of range"),
        (lambda c: kvjax.seq_div(c, 0, 0, -1, 2.0), r"d=2.0 is out of range: allowed an integer scalar"),
        (lambda c: kvjax.seq_pos_max(c, np.float32(1)), r"seq_id=.*1.* is out of range: allowed an integer scalar"),
        (lambda c: kvjax.find_slot(c, [(0, [0])]), r"ubatch must be a kvjax.Ubatch"),
        (lambda c: kvjax.prepare(c, [None]), r"ubatch must be a kvjax.Ubatch"),
    ],
)
def test_non_integer_arguments_raise(cache, call, match):
    before = snapshot(cache)
    with pytest.raises(ValueError, match=match):
        call(cache)
    assert_unchanged(before, cache)


PUBLIC_OPS = [
    lambda c: kvjax.clear(c),
    lambda c: kvjax.seq_rm(c, 0),
    lambda c: kvjax.seq_cp(c, 0, 1),
    lambda c: kvjax.seq_keep(c, 0),
    lambda c: kvjax.seq_add(c, 0, 0, -1, 1),
    lambda c: kvjax.seq_div(c, 0, 0, -1, 2),
    lambda c: kvjax.seq_pos_min(c, 0),
    lambda c: kvjax.seq_pos_max(c, 0),
    kvjax.pos_max,
    kvjax.used_cells,
    kvjax.n_tokens,
    kvjax.cell_max,
    kvjax.n_kv,
    kvjax.has_shift,
    lambda c: kvjax.find_slot(c, kvjax.make_ubatch([0], [[0]])),
    lambda c: kvjax.prepare(c, [kvjax.make_ubatch([0], [[0]])]),
    kvjax.errors,
    kvjax.check,
    kvjax.clear_errors,
]


@pytest.mark.parametrize("op", PUBLIC_OPS)
def test_every_op_rejects_a_non_cache(cache, op):
    with pytest.raises(ValueError, match=r"(cache|memory) must be a kvjax.*KVCache.*, got (Cells|dict)"):
        op(cache.cells)
    with pytest.raises(ValueError, match=r"(cache|memory) must be a kvjax.*KVCache.*, got dict"):
        op({"cells": cache.cells})


# -- traced arguments: no change, an error bit, no new compilation ------------------------------


@pytest.mark.parametrize("call, arg, lo, bad", RETURNS_CACHE)
def test_traced_bad_seq_id_sets_the_seq_id_bit(cache, call, arg, lo, bad):
    run = jax.jit(call)
    good = run(cache, lo + 1)  # warm-up with a valid id: a real change, no bit
    assert kvjax.errors(good) == []
    before = snapshot(cache)
    with no_recompile():
        out = run(cache, bad)
    assert int(out.cells.error) == ErrorFlag.SEQ_ID
    assert kvjax.errors(out) == [ERROR_MESSAGES[ErrorFlag.SEQ_ID]]
    before_cells, after_cells = before[:4] + before[5:], snapshot(out)[:4] + snapshot(out)[5:]
    for a, b in zip(before_cells, after_cells):
        np.testing.assert_array_equal(a, b)
    assert_unchanged(before, cache)


@pytest.mark.parametrize("op", ["seq_pos_min", "seq_pos_max"])
@pytest.mark.parametrize("bad", [-2, S, 1000])
def test_traced_query_with_a_bad_seq_id_answers_absent(cache, op, bad):
    run = jax.jit(getattr(kvjax, op))
    assert int(run(cache, -1)) >= 0  # warm-up: "every sequence" finds cells
    with no_recompile():
        assert int(run(cache, bad)) == -1  # as the seed answers for an id no cell holds


@pytest.mark.parametrize("d", [0, -1, -7])
def test_traced_bad_divisor_sets_the_divisor_bit(cache, d):
    run = jax.jit(kvjax.seq_div)
    assert kvjax.errors(run(cache, 1, 0, -1, 2)) == []
    before = snapshot(cache)
    with no_recompile():
        out = run(cache, 1, 0, -1, d)
    assert kvjax.errors(out) == [ERROR_MESSAGES[ErrorFlag.DIVISOR]]
    np.testing.assert_array_equal(before[0], np.asarray(out.cells.pos))
    np.testing.assert_array_equal(before[2], np.asarray(out.cells.delta))
    assert int(out.cells.head) == int(before[3])


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize(
    "pos, seq_ids",
    [
        ([5, 6], [[0], [S]]),
        ([5, 6], [[0], [1, 1000]]),
        ([5, 6], [[-1, 1], [0]]),
        ([5, -1], [[0], [1]]),
    ],
)
def test_traced_bad_ubatch_is_refused_with_the_ubatch_bit(cache, contiguous, pos, seq_ids):
    run = jax.jit(kvjax.find_slot, static_argnames="contiguous")
    width = np.asarray(ubatch(pos, seq_ids).seq_ids).shape[1]
    warm = ubatch([5, 6], [[0] + [-1] * (width - 1), [1] + [-1] * (width - 1)])
    placed, _, ok = run(cache, warm, contiguous=contiguous)
    assert bool(ok) and kvjax.errors(placed) == []
    before = snapshot(cache)
    with no_recompile():
        out, slot, ok = run(cache, ubatch(pos, seq_ids), contiguous=contiguous)
    assert not bool(ok) and np.asarray(slot).tolist() == [-1] * 8
    assert kvjax.errors(out) == [ERROR_MESSAGES[ErrorFlag.UBATCH]]
    for a, b in zip(before[:4], snapshot(out)[:4]):
        np.testing.assert_array_equal(a, b)
    prep = jax.jit(kvjax.prepare, static_argnames="contiguous")
    assert not bool(prep(cache, [ubatch(pos, seq_ids)], contiguous=contiguous)[0])


def test_traced_ubatch_longer_than_the_cache_is_refused(cache):
    """Not an invalid argument in the seed (its find_slot returns false): ok is False, no bit."""
    run = jax.jit(kvjax.find_slot, static_argnames="contiguous")
    long = kvjax.make_ubatch(range(17), [[0]] * 17, length=32)
    before = snapshot(cache)
    for contiguous in (True, False):
        out, slot, ok = run(cache, long, contiguous=contiguous)
        assert not bool(ok) and (np.asarray(slot) == -1).all()
        assert_unchanged(before, out)


@pytest.mark.parametrize(
    "call",
    [
        lambda c, x: kvjax.seq_rm(c, x, 0, -1),
        lambda c, x: kvjax.seq_add(c, 0, 0, -1, x),
        lambda c, x: kvjax.seq_div(c, 0, 0, -1, x),
        lambda c, x: kvjax.seq_pos_min(c, x),
    ],
)
def test_traced_non_integer_is_refused_at_trace_time(cache, call):
    """Shape and dtype are static: a traced float would otherwise be truncated silently."""
    with pytest.raises(ValueError, match=r"is out of range: allowed an integer scalar, got a traced float32\[\]"):
        jax.jit(call)(cache, 1.5)
    with pytest.raises(ValueError, match=r"is out of range: allowed an integer scalar, got a traced int32\[2\]"):
        jax.jit(call)(cache, np.array([1, 2], np.int32))


def test_error_bits_are_sticky_until_cleared(cache):
    bad = jax.jit(kvjax.seq_keep)(cache, S)
    bad = jax.jit(kvjax.seq_div)(bad, 0, 0, -1, 0)
    assert int(bad.cells.error) == ErrorFlag.SEQ_ID | ErrorFlag.DIVISOR
    later, _ = kvjax.seq_rm(bad, 2, -1, -1)  # a valid op keeps the bits
    assert int(later.cells.error) == int(bad.cells.error)
    with pytest.raises(ValueError, match="error flags set: seq_id out of range"):
        kvjax.check(later)
    assert kvjax.errors(kvjax.clear_errors(later)) == []
    assert kvjax.check(kvjax.clear_errors(later)) is not None
