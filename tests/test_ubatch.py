"""Ubatch construction and the host-side splitters; prepare (the dry run)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import kvjax
from tests.helpers import CompileCounter, fill, small_config


def test_make_ubatch_layout():
    ub = kvjax.make_ubatch([4, 5, 6], [[1], [2, 0, 2], [3]], length=8)
    assert ub.length == 8 and int(ub.n_tokens()) == 3
    assert ub.seq_ids.shape == (8, 2)  # repeats dropped: [2, 0]
    assert np.asarray(ub.seq_ids)[1].tolist() == [2, 0]
    assert np.asarray(ub.seq0).tolist() == [1, 2, 3, -1, -1, -1, -1, -1]
    mask = np.asarray(ub.seq_mask(2))
    assert mask[1].tolist() == [0b101, 0] and not mask[3:].any()
    assert np.asarray(kvjax.make_ubatch([0], [[33]]).seq_mask(2))[0].tolist() == [0, 2]
    bare = kvjax.make_ubatch([0, 1], [3, np.int64(4)])  # one bare id per token
    gen = kvjax.make_ubatch([0, 1], ([s] for s in (3, 4)))  # a generator is read once
    assert gen.seq_ids.tolist() == [[3], [4]]
    assert bare.seq_ids.tolist() == kvjax.make_ubatch([0, 1], [[3], [4]]).seq_ids.tolist() == [[3], [4]]


@pytest.mark.parametrize(
    "args, match",
    [
        (([0, 1], [[0]]), r"seq_ids has 1 entries: allowed exactly one per token \(len\(pos\)=2\)"),
        (([0], [[]]), r"seq_ids\[0\] is empty"),
        (([0], [[-1]]), r"seq_ids\[0\] contains -1: allowed \[0, "),
        (([-3], [[0]]), r"pos=-3 is out of range: allowed \[0, 2147483647\)"),
        (([2**31], [[0]]), r"pos=2147483648 is out of range"),
    ],
)
def test_make_ubatch_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        kvjax.make_ubatch(*args)


def test_make_ubatch_length_and_n_seq_max():
    with pytest.raises(ValueError, match=r"length=2 is out of range: allowed >= the token count 3"):
        kvjax.make_ubatch([0, 1, 2], [[0]] * 3, length=2)
    with pytest.raises(ValueError, match=r"seq_ids\[0\] contains 4: allowed \[0, 4\)"):
        kvjax.make_ubatch([0], [[4]], n_seq_max=4)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=4), min_size=1, max_size=20),
    st.booleans(),
    st.sampled_from(["lists", "numpy", "numpy uint8"]),
)
def test_make_ubatch_equals_a_per_token_construction(seq_ids, rectangular, form):
    """Whatever path builds it (one vectorized pass for rectangular ids, token by token otherwise),
    the ubatch is the per-token definition: each token's ids in order with repeats dropped, -1 padded."""
    if rectangular:
        width = max(len(s) for s in seq_ids)
        seq_ids = [(s * width)[:width] for s in seq_ids]  # every token the same count (with repeats)
        if form != "lists":
            seq_ids = np.asarray(seq_ids, np.uint8 if form == "numpy uint8" else np.int64)
    pos = list(range(10, 10 + len(seq_ids)))
    uniq = [list(dict.fromkeys(int(x) for x in s)) for s in seq_ids]
    width = max(len(u) for u in uniq)
    want = np.full((len(uniq), width), -1)
    for i, u in enumerate(uniq):
        want[i, : len(u)] = u
    ub = kvjax.make_ubatch(pos, seq_ids, length=32)
    assert ub.seq_ids.dtype == np.int32 and ub.seq_ids.shape == (32, width)
    np.testing.assert_array_equal(ub.seq_ids[: len(uniq)], want)
    assert (ub.seq_ids[len(uniq) :] == -1).all() and ub.valid.tolist() == [i < len(uniq) for i in range(32)]
    assert ub.pos[: len(pos)].tolist() == pos


def _check_partition(parts, n):
    flat = np.concatenate(parts) if parts else np.array([], int)
    assert sorted(flat.tolist()) == list(range(n))


batches = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 9))
def test_split_simple(seq_ids, n_ubatch):
    parts = kvjax.split_simple(seq_ids, n_ubatch)
    _check_partition(parts, len(seq_ids))
    assert all(len(p) <= n_ubatch for p in parts)
    assert np.concatenate(parts).tolist() == list(range(len(seq_ids)))  # batch order kept


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 9))
def test_split_seq(seq_ids, n_ubatch):
    parts = kvjax.split_seq(seq_ids, n_ubatch)
    _check_partition(parts, len(seq_ids))
    for p in parts:
        assert len(p) <= n_ubatch
        assert len({tuple(sorted(set(seq_ids[i]))) for i in p}) == 1  # one sequence set
        assert list(p) == sorted(p)


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 9))
def test_split_equal(seq_ids, n_ubatch):
    parts = kvjax.split_equal(seq_ids, n_ubatch)
    _check_partition(parts, len(seq_ids))
    seen_sets = []
    for p in parts:
        assert len(p) <= n_ubatch
        keys = [tuple(sorted(set(seq_ids[i]))) for i in p]
        counts = {k: keys.count(k) for k in keys}
        assert len(set(counts.values())) == 1, "equal token count per sequence set"
        if any(len(k) > 1 for k in counts):
            assert len(counts) == 1, "a shared set goes alone"
        # rows of one set are contiguous and in batch order
        for k in counts:
            rows = [i for i, kk in zip(p, keys) if kk == k]
            assert rows == sorted(rows)
        seen_sets.append(counts)
    # per sequence set, the ubatches take its tokens in batch order
    order = {}
    for p in parts:
        for i in p:
            order.setdefault(tuple(sorted(set(seq_ids[i]))), []).append(i)
    assert all(v == sorted(v) for v in order.values())


def test_split_bad_n_ubatch():
    with pytest.raises(ValueError, match=r"n_ubatch=0 is out of range: allowed >= 1"):
        kvjax.split_simple([[0]], 0)


@pytest.mark.parametrize("jit", [False, True])
def test_prepare_reports_and_keeps_nothing(jit):
    cache = fill(kvjax.init(small_config(size=32, padding=16)), range(20), [[0]] * 20)
    fits = [
        kvjax.make_ubatch(range(20, 24), [[0]] * 4, length=8),
        kvjax.make_ubatch(range(24, 30), [[0]] * 6, length=8),
    ]
    too_many = fits + [kvjax.make_ubatch(range(30, 33), [[0]] * 3, length=8)]
    prepare = jax.jit(kvjax.prepare, static_argnames="contiguous") if jit else kvjax.prepare
    ok, slots = prepare(cache, fits)
    assert bool(ok) and np.asarray(slots[0])[:4].tolist() == [20, 21, 22, 23]
    assert np.asarray(slots[1])[:6].tolist() == list(range(24, 30))
    ok, _ = prepare(cache, too_many)
    assert not bool(ok)
    assert int(kvjax.used_cells(cache)) == 20  # the input value is untouched
    # placing for real finds the same slots
    c2, s2, _ = kvjax.find_slot(cache, fits[0])
    assert np.asarray(s2).tolist() == np.asarray(slots[0]).tolist()
    with CompileCounter() as counter:
        prepare(c2, fits)
    assert counter.count == 0


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: kvjax.make_ubatch([0.7, 1.9], [[0], [0]]), r"pos has dtype float64: allowed integers"),
        (lambda: kvjax.make_ubatch([0], [[0.5]]), r"seq_ids\[0\] has dtype float64: allowed integers"),
        # a bool is no sequence id, even where numpy would take it as 0 or 1 among ints
        (lambda: kvjax.make_ubatch([0, 1], [[0], [True]]), r"seq_ids\[1\] contains True: allowed integer sequence ids"),
        (lambda: kvjax.make_ubatch([0, 1], [0, True]), r"seq_ids\[1\] contains True: allowed integer sequence ids"),
        (lambda: kvjax.make_ubatch([0], [[2, False]]), r"seq_ids\[0\] contains False: allowed integer sequence ids"),
        (lambda: kvjax.make_ubatch([0], [[np.True_]]), r"seq_ids\[0\] contains np.True_"),
        (lambda: kvjax.make_ubatch([0], [[True]]), r"seq_ids\[0\] contains True"),
        (
            lambda: kvjax.make_ubatch([0, 1], np.array([[True], [False]])),
            r"seq_ids\[0\] has dtype bool: allowed integers",
        ),
        # ids past int32 are refused, never wrapped, whatever n_seq_max says
        (
            lambda: kvjax.make_ubatch([0], [[2**35]], n_seq_max=2**40),
            r"seq_ids\[0\] contains 34359738368: allowed \[0, "
            r"2147483648\)",
        ),
        (
            lambda: kvjax.make_ubatch([0], [[3]], n_seq_max=float("nan")),
            r"n_seq_max=nan is out of range: allowed an integer",
        ),
        (lambda: kvjax.make_ubatch([0], [[3]], n_seq_max=0), r"n_seq_max=0 is out of range: allowed an integer >= 1"),
        (lambda: kvjax.split_simple([[0]], 2.5), r"n_ubatch=2.5 is out of range"),
        (
            lambda: kvjax.find_slot(kvjax.init(small_config()), kvjax.make_ubatch([0], [[0]]), contiguous="no"),
            r"contiguous='no' is out of range: allowed True or False",
        ),
        (
            lambda: kvjax.find_slot(
                kvjax.init(small_config()),
                kvjax.Ubatch(pos=np.zeros(2, np.float32), seq_ids=np.zeros((2, 1), np.int32), valid=np.ones(2, bool)),
            ),
            r"ubatch.pos has dtype float32",
        ),
        (
            lambda: kvjax.find_slot(
                kvjax.init(small_config()),
                kvjax.Ubatch(pos=np.zeros(2, np.int32), seq_ids=np.zeros((3, 1), np.int32), valid=np.ones(2, bool)),
            ),
            r"allowed \[T\], \[T, M\], \[T\]",
        ),
    ],
)
def test_no_silent_truncation(call, match):
    with pytest.raises(ValueError, match=match):
        call()
