"""The metadata ops return only what they change: unchanged arrays are the input's own (no copy),
and the two window searches of contiguous placement agree."""

from __future__ import annotations

import jax
import numpy as np

import kvjax
from kvjax.memory import _cells, _slots
from tests.helpers import fill


def _cells_of_cache():
    cfg = kvjax.CacheConfig(size=64, n_seq_max=40, n_layer=1, n_kv_heads=1, head_dim=4, padding=16)
    cache = fill(kvjax.init(cfg), list(range(10)), [[0]] * 10)
    cache = fill(cache, list(range(6)), [[33]] * 6)
    cache, _ = kvjax.seq_rm(cache, 0, 3, 5)  # a hole
    return cache.cells


def test_unchanged_arrays_are_shared():
    cells = _cells_of_cache()
    i32 = np.int32
    cp = _cells.seq_cp(cells, i32(0), i32(35), i32(0), i32(4))
    assert cp.pos is cells.pos and cp.delta is cells.delta and cp.defrag is cells.defrag
    placed, slot, ok = _slots.find_slot_cells(cells, kvjax.make_ubatch([7], [[1]]))
    assert bool(ok) and placed.delta is cells.delta
    for new in (_cells.seq_rm(cells, i32(0), i32(0), i32(2)), _cells.seq_add(cells, i32(0), i32(0), i32(4), i32(2))):
        assert new.defrag is cells.defrag
    # inside jit the same functions trace to one program with the same results
    jitted = jax.jit(_cells.seq_cp)(cells, i32(0), i32(35), i32(0), i32(4))
    for a, b in zip(jax.tree.leaves(cp), jax.tree.leaves(jitted)):
        np.testing.assert_array_equal(a, b)


def test_window_search_by_shifts_equals_prefix_sum(monkeypatch):
    """Both ways of finding n free cells give the same placement, for several n and heads."""
    cells = _cells_of_cache()
    cases = [
        (kvjax.make_ubatch(range(100, 100 + n), [[2]] * n, length=8), np.int32(head))
        for n in (0, 1, 3, 5, 8)
        for head in (0, 3, 17, 63)
    ]  # one program per search: n, head are data
    results = {}
    for unroll in (16, 0):
        monkeypatch.setattr(_slots, "WINDOW_UNROLL", unroll)
        _slots._find_slot.clear_cache()
        results[unroll] = [_slots.find_slot_cells(cells.replace(head=head), ub) for ub, head in cases]
    _slots._find_slot.clear_cache()
    for by_shifts, by_prefix in zip(results[16], results[0]):
        for a, b in zip(jax.tree.leaves(by_shifts), jax.tree.leaves(by_prefix)):
            np.testing.assert_array_equal(a, b)
