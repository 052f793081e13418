"""Window buckets: a bounded set of static n_kv values that always covers the used cells."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax
from tests.helpers import CompileCounter, fill, small_config


@settings(max_examples=200, deadline=None)
@given(padding=st.sampled_from([1, 16, 32, 256]), factor=st.integers(1, 300), data=st.data())
def test_bucket_covers_and_is_bounded(padding, factor, data):
    size = padding * factor
    buckets = kvjax.window_buckets(size, padding)
    assert len(buckets) == math.ceil(math.log2(factor)) + 1
    assert buckets[-1] == size and list(buckets) == sorted(set(buckets))
    assert all(b % padding == 0 and b <= size for b in buckets)
    n = data.draw(st.integers(0, size))
    b = kvjax.window_bucket(n, size, padding)
    assert b in buckets and b >= n
    assert b == size or b < 2 * max(n, padding)  # never more than twice the cells needed
    min_window = data.draw(st.integers(1, size))
    mb = kvjax.window_bucket(n, size, padding, min_window=min_window)
    assert mb >= max(n, min(min_window, size)) or mb == size
    assert mb in buckets


def test_documented_counts():
    assert len(kvjax.window_buckets(32768, 32)) == 11
    assert len(kvjax.window_buckets(32768, 256)) == 8
    assert kvjax.window_buckets(2048, 256) == (256, 512, 1024, 2048)


def test_kv_window_follows_the_cache():
    cfg = small_config(n_layer=1, size=256, padding=16)
    cache = kvjax.init(cfg)
    assert kvjax.kv_window(cache) == 16  # empty: the seed's n_kv is padding
    cache = fill(cache, list(range(40)), [[0]] * 40)
    assert int(kvjax.n_kv(cache)) == 48 and kvjax.kv_window(cache) == 64
    assert kvjax.kv_window(cache, min_window=100) == 128


def test_growing_cache_compiles_once_per_bucket():
    """A decode loop that picks the window with kv_window compiles one program per bucket."""
    cfg = small_config(n_layer=1, size=256, padding=16, n_kv_heads=1, head_dim=8)
    cache = kvjax.init(cfg)
    seen = set()
    with CompileCounter() as counter:
        for start in range(0, 200, 25):
            ub = kvjax.make_ubatch(list(range(start, start + 25)), [[0]] * 25, length=32)
            cache, slot, ok = kvjax.find_slot(cache, ub)
            window = kvjax.kv_window(cache)
            seen.add(window)
            mask = kvjax.kq_mask(cache, ub, window)
            kvjax.attention(jnp.ones((32, 2, 8)), cache, 0, mask).block_until_ready()
    first_compiles = counter.count
    assert seen == {32, 64, 128, 256}
    cache = kvjax.clear(cache)
    with CompileCounter() as again:  # the same walk again: every bucket is already compiled
        for start in range(0, 200, 25):
            ub = kvjax.make_ubatch(list(range(start, start + 25)), [[0]] * 25, length=32)
            cache, slot, ok = kvjax.find_slot(cache, ub)
            mask = kvjax.kq_mask(cache, ub, kvjax.kv_window(cache))
            kvjax.attention(jnp.ones((32, 2, 8)), cache, 0, mask).block_until_ready()
    assert again.count == 0 and first_compiles > 0


def test_bad_input():
    with pytest.raises(ValueError, match="size=100 is out of range: allowed a multiple of padding=32"):
        kvjax.window_buckets(100, 32)
    with pytest.raises(ValueError, match="padding=0"):
        kvjax.window_bucket(1, 64, 0)
    with pytest.raises(ValueError, match="n_kv=65 is out of range"):
        kvjax.window_bucket(65, 64, 16)
    with pytest.raises(ValueError, match="n_kv=-1 is out of range"):
        kvjax.window_bucket(-1, 64, 16)
    with pytest.raises(ValueError, match="min_window=0 is out of range"):
        kvjax.window_bucket(1, 64, 16, min_window=0)
    with pytest.raises(ValueError, match="n_kv=2.5 is out of range"):
        kvjax.window_bucket(2.5, 64, 16)
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.kv_window(np.zeros(3))
