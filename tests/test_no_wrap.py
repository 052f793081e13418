"""No integer is narrowed silently: wide or unsigned host values that int32 cannot hold are refused."""

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.memory._ubatch import Ubatch
from tests.helpers import fill

CFG = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4, rope=kvjax.RopeConfig(n_rot=4))


def test_wide_slot_is_refused_not_wrapped():
    cache = kvjax.init(CFG)
    rows = jnp.ones((1, 1, 4))
    with pytest.raises(ValueError, match=r"slot contains 4294967301: allowed \[-2147483648, 2147483647\]"):
        kvjax.write(cache, 0, np.array([2**32 + 5], np.int64), rows, rows)
    with pytest.raises(ValueError, match=r"slot contains 18446744073709551615"):
        kvjax.write(cache, 0, np.array([2**64 - 1], np.uint64), rows, rows)
    out = kvjax.write(cache, 0, np.array([5], np.uint64), rows, rows)  # an unsigned slot that fits: written
    assert float(kvjax.view(out, 0, 32)[0][0, 5, 0]) == 1.0


def test_positions_that_wrap_or_cannot_be_removed_are_refused():
    with pytest.raises(ValueError, match=r"pos=4294967296 is out of range: allowed \[0, 2147483647\)"):
        kvjax.make_ubatch([2**32], [[0]])
    with pytest.raises(ValueError, match=r"pos=2147483647 is out of range"):
        kvjax.make_ubatch([2**31 - 1], [[0]])  # p1 < 0 ("to infinity") could never reach it
    cache = fill(kvjax.init(CFG), [2**31 - 2], [[0]])
    cache, ok = kvjax.seq_rm(cache, 0, 0, -1)  # the largest position is still reachable
    assert bool(ok) and int(kvjax.used_cells(cache)) == 0
    hand_made = Ubatch(pos=np.array([2**32], np.int64), seq_ids=np.array([[0]], np.int32), valid=np.array([True]))
    with pytest.raises(ValueError, match=r"ubatch.pos contains 4294967296"):
        kvjax.find_slot(kvjax.init(CFG), hand_made)


def test_rope_at_a_wide_position_is_refused():
    x = jnp.ones((1, 1, 4))
    with pytest.raises(ValueError, match=r"pos contains 1099511627776"):
        kvjax.rope(x, np.array([2**40], np.int64), CFG.rope[0])
    np.testing.assert_allclose(kvjax.rope(x, np.array([0], np.uint32), CFG.rope[0]), x)
