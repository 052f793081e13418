"""seq_add never wraps a position around int32: the op is skipped and flagged."""

import jax
import numpy as np

import kvjax
from tests.helpers import fill, small_config


def test_seq_add_overflow_is_skipped_and_flagged():
    cache = fill(kvjax.init(small_config()), [5, 2**31 - 10], [[0], [0]])
    for op in (kvjax.seq_add, jax.jit(kvjax.seq_add)):
        out = op(cache, 0, 0, -1, 2**31 - 7)
        np.testing.assert_array_equal(kvjax.cell_table(out).pos, kvjax.cell_table(cache).pos)
        assert kvjax.errors(out) == ["seq_add would push a position past int32 (an op was skipped)"]
    ok = kvjax.seq_add(cache, 0, 0, 6, 2**31 - 7)  # only position 5 moves: it fits
    assert kvjax.cell_table(ok).pos[:2].tolist() == [2**31 - 2, 2**31 - 10] and kvjax.errors(ok) == []


def test_every_failed_check_is_reported():
    cache = fill(kvjax.init(small_config()), [5], [[0]])
    out = jax.jit(kvjax.seq_div)(cache, 9, 0, -1, 0)  # bad seq id and bad divisor at once
    assert len(kvjax.errors(out)) == 2
    np.testing.assert_array_equal(kvjax.cell_table(out).pos, kvjax.cell_table(cache).pos)
