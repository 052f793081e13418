"""seq_add never wraps a position around int32: the op is skipped and flagged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.nn import window_for
from tests.helpers import fill, small_config


def test_seq_add_overflow_is_skipped_and_flagged():
    cache = fill(kvjax.init(small_config()), [5, 2**31 - 10], [[0], [0]])
    out = jax.jit(kvjax.seq_add)(cache, 0, 0, -1, 2**31 - 7)
    np.testing.assert_array_equal(kvjax.cell_table(out).pos, kvjax.cell_table(cache).pos)
    assert kvjax.errors(out) == [
        "seq_add would push a position to 2**31 - 1 or past it, outside [0, 2**31 - 1) (an op was skipped)"
    ]
    with pytest.raises(
        ValueError,
        match=r"seq_add\(seq_id=0, p0=0, p1=-1, delta=2147483641\) was refused, the "
        r"memory is unchanged: seq_add would push a position to 2\*\*31 - 1",
    ):
        kvjax.seq_add(cache, 0, 0, -1, 2**31 - 7)
    ok = kvjax.seq_add(cache, 0, 0, 6, 2**31 - 7)  # only position 5 moves: it fits
    assert kvjax.cell_table(ok).pos[:2].tolist() == [2**31 - 2, 2**31 - 10] and kvjax.errors(ok) == []


def test_no_position_reaches_the_end_of_the_range():
    """2**31 - 1 is "to infinity" in the sequence operations: a cell there could never be removed."""
    recurrent = kvjax.init(kvjax.RecurrentConfig(size=2, n_seq_max=2, n_layer=1, k_shape=(1,), v_shape=(1,)))
    ub = kvjax.make_equal_ubatch([([4], [0])], n_slots=1)
    recurrent = kvjax.commit(kvjax.find_slot(recurrent, ub)[0], [ub])
    unified = fill(kvjax.init(small_config()), [4], [[0]])
    for memory in (unified, recurrent):
        for op in (kvjax.seq_add, jax.jit(kvjax.seq_add)):
            if op is kvjax.seq_add:  # exactly onto 2**31 - 1: refused
                with pytest.raises(ValueError, match="was refused"):
                    op(memory, 0, 0, -1, 2**31 - 1 - 4)
            else:
                out = op(memory, 0, 0, -1, 2**31 - 1 - 4)
                assert int(kvjax.seq_pos_max(out, 0)) == 4 and len(kvjax.errors(out)) == 1
            last = op(memory, 0, 0, -1, 2**31 - 2 - 4)  # the last position of the range
            assert int(kvjax.seq_pos_max(last, 0)) == 2**31 - 2 and kvjax.errors(last) == []
            gone, ok = kvjax.seq_rm(last, 0, 0, -1)  # ... and seq_rm still reaches it
            assert bool(ok) and int(kvjax.seq_pos_max(gone, 0)) == -1
    # a state blob naming the end of the range is refused, nothing read
    blob = bytearray(kvjax.state_write(unified))
    blob[4:8] = (2**31 - 1).to_bytes(4, "little")  # the first cell's pos
    with pytest.raises(kvjax.StateError, match=r"cell 0 pos: expected in \[0, 2147483647\)"):
        kvjax.state_read(kvjax.init(small_config()), bytes(blob))


def test_every_failed_check_is_reported():
    cache = fill(kvjax.init(small_config()), [5], [[0]])
    out = jax.jit(kvjax.seq_div)(cache, 9, 0, -1, 0)  # bad seq id and bad divisor at once
    assert len(kvjax.errors(out)) == 2
    np.testing.assert_array_equal(kvjax.cell_table(out).pos, kvjax.cell_table(cache).pos)


def test_relative_buckets_stay_in_range_at_the_end_of_the_positions():
    """T5 buckets of a token at the top of int32 against empty cells (pos -1) and far cells."""
    cache = fill(kvjax.init(small_config()), [0, 2**31 - 3], [[0], [0]])
    ub = kvjax.make_ubatch([2**31 - 2], [[0]])
    for top in (2**31 - 2, 2**31 - 1):  # the last position; and past it, in a hand-built ubatch
        hand = ub.replace(pos=jnp.asarray(ub.pos).at[0].set(top))
        for bidirectional in (False, True):
            buckets = np.asarray(kvjax.pos_bucket(cache, hand, 16, 32, bidirectional=bidirectional))
            assert buckets.min() >= 0 and buckets.max() < 32, (top, bidirectional)
            assert buckets[0, 0] == (15 if bidirectional else 31)  # position 0: the farthest bucket


def test_window_for_never_wraps_a_huge_token_count():
    """``window_for(memory, n)`` asks for ``max(cell_max, head) + n``: with n near 2**31 that sum
    wrapped int32 to a negative extent, and a window of one padding was returned for a cache that
    needs all of it. The count is capped at the memory's size (the extent never passes it)."""

    base = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=4, padding=8)
    memories = [
        kvjax.init(base),
        kvjax.init(kvjax.StreamsConfig(base, n_stream=2)),
        kvjax.init(kvjax.IswaConfig(base, swa_layers=(1,), n_swa=4, n_batch=8)),
    ]
    for memory in memories:
        ub = kvjax.make_ubatch(range(5), [[0]] * 5)
        memory = kvjax.commit(kvjax.find_slot(memory, ub)[0], [ub])
        for n in (2**31 - 1, 2**31 - 5, 10**9):
            got = window_for(memory, n)
            assert got == (
                32 if memory.n_parts == 1 else tuple(p.config.size for p in (memory.part(0), memory.part(1)))
            )
        assert window_for(memory, np.int64(3)) == window_for(memory, 3)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda m: window_for(m, 10**12),
            r"n_tokens=1000000000000 is out of range: allowed an integer in \[0, 2147483647\]",
        ),
        (lambda m: window_for(m, 2.5), r"n_tokens=2.5 is out of range"),
        (lambda m: window_for(m, -1), r"n_tokens=-1 is out of range"),
        (lambda m: kvjax.bucket_length(2.5), r"n=2.5 is out of range: allowed an integer in \[0, 1073741824\]"),
        (lambda m: kvjax.bucket_length(10**12), r"n=1000000000000 is out of range"),
        (lambda m: kvjax.bucket_length(True), r"n=True is out of range"),
        (
            lambda m: kvjax.make_ubatch([0], [[0]], length=10**12),
            r"length=1000000000000 is out of range: allowed an integer in \[1, 1073741824\]",
        ),
    ],
)
def test_counts_that_would_overflow_are_named(call, match):
    """A count that sets an array's shape or goes to int32 is refused on the host, naming it, instead
    of an OverflowError from inside jit or a 3.6 TiB allocation."""
    with pytest.raises(ValueError, match=match):
        call(kvjax.init(small_config()))


def test_an_eager_refusal_raises_even_with_the_bit_already_set():
    """Error bits are sticky: a memory an earlier jitted call flagged still gets the eager
    ValueError for a new refused shift (the op runs with the bits cleared, the old bits come back)."""
    cache = fill(kvjax.init(small_config()), [5, 2**31 - 10], [[0], [0]])
    flagged = jax.jit(kvjax.seq_add)(cache, 0, 0, -1, 2**31 - 7)
    assert kvjax.ErrorFlag.OVERFLOW & int(flagged.error_bits())
    with pytest.raises(ValueError, match="was refused"):
        kvjax.seq_add(flagged, 0, 0, -1, 2**31 - 7)
    moved = kvjax.seq_add(flagged, 0, 0, 6, 1)  # a valid shift keeps the old bit
    assert int(moved.error_bits()) == int(flagged.error_bits())
    assert kvjax.cell_table(moved).pos[:2].tolist() == [6, 2**31 - 10]
