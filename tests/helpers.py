"""Shared test utilities: a compile counter and small cache factories."""

from __future__ import annotations

import contextlib

import kvjax
from kvjax._compiles import CompileCounter  # noqa: F401  (re-exported for the tests)


@contextlib.contextmanager
def no_recompile():
    """Assert that the block compiles nothing (run the code once before, to warm up)."""
    with CompileCounter() as counter:
        yield counter
    assert counter.count == 0, f"expected no compilation, got {counter.count}"


def small_config(**overrides) -> kvjax.CacheConfig:
    """A tiny cache config for tests (64 cells, 4 sequences, 2 layers, 2 kv heads, head size 8)."""
    args = dict(size=64, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=8, padding=16)
    args.update(overrides)
    return kvjax.CacheConfig(**args)


def fill(cache, pos, seq_ids, contiguous=True):
    """Place tokens with ``find_slot`` and return the cache (asserting success)."""
    cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch(pos, seq_ids), contiguous=contiguous)
    assert bool(ok)
    return cache
