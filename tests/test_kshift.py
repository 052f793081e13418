"""K-shift and update: after seq_add / seq_div, the shifted K equals K computed at the new positions.

Tolerances (max abs error against K computed directly, for K values ~ N(0, 1), positions < 64):
float32 5e-5 (float32 angles and two rotations), float16 4e-3 (two float16 roundings of values up
to ~4, whose half-ulp is ~2e-3, plus the rotation).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.helpers import fill, no_recompile

TOL = {"float32": 5e-5, "float16": 4e-3}

# one RoPE for all layers; per-layer frequencies (one table per layer); different modes / n_rot
ROPES = {
    "shared": kvjax.RopeConfig(n_rot=8, mode="neox"),  # partial on the 16-dim layers
    "per_layer_freqs": (
        kvjax.RopeConfig(n_rot=16, freq_base=10000.0),
        kvjax.RopeConfig(n_rot=16, freq_base=1e6, freq_scale=0.5),
        kvjax.RopeConfig(n_rot=8, mode="neox"),
    ),
    "per_layer_modes": (
        kvjax.RopeConfig(n_rot=16),
        kvjax.RopeConfig(n_rot=10, mode="neox", ext_factor=1.0, freq_scale=0.25, n_ctx_orig=128),
        kvjax.RopeConfig(n_rot=6),
    ),
}


def _config(rope, dtype="float32"):
    # layers 0, 1: one group of 2 kv heads, head size 16; layer 2: its own group (1 head, size 8)
    return kvjax.CacheConfig(
        size=64,
        n_seq_max=4,
        n_layer=3,
        n_kv_heads=(2, 2, 1),
        head_dim=(16, 16, 8),
        padding=16,
        k_dtype=dtype,
        v_dtype=dtype,
        rope=rope,
    )


def _scene(rope, dtype="float32", seed=0):
    """Two sequences (one sharing a prefix with the other), holes, K = RoPE(raw, pos) per layer."""
    cfg = _config(rope, dtype)
    cache = kvjax.init(cfg)
    cache = fill(cache, list(range(24)), [[0]] * 24)
    cache = kvjax.seq_cp(cache, 0, 1, 0, 6)
    cache = fill(cache, list(range(6, 16)), [[1]] * 10)
    cache, _ = kvjax.seq_rm(cache, 0, 18, 21)  # a hole
    rng = np.random.default_rng(seed)
    raw = {
        il: rng.standard_normal((cfg.size, cfg.n_kv_heads[il], cfg.head_dim[il])).astype(np.float32)
        for il in range(cfg.n_layer)
    }
    slot = jnp.arange(cfg.size, dtype=jnp.int32)
    pos = jnp.maximum(cache.cells.pos, 0)
    for il in range(cfg.n_layer):
        k = kvjax.rope(jnp.asarray(raw[il]), pos, cfg.rope[il])
        cache = kvjax.write(cache, il, slot, k, jnp.asarray(raw[il]))
    return cache, raw


def _moved(cache):
    cache = kvjax.seq_add(cache, 0, 4, 12, 7)  # shared cells move for both sequences
    cache = kvjax.seq_add(cache, 1, 0, -1, -3)  # some cells of sequence 1 fall below 0: freed
    return kvjax.seq_div(cache, 0, 12, -1, 2)  # self-extend on the tail of sequence 0


def _assert_k_at_positions(before, after, raw, dtype):
    cfg = after.config
    pos = np.asarray(after.cells.pos)
    used = pos >= 0
    assert not np.asarray(after.cells.delta).any()
    for il in range(cfg.n_layer):
        k_after, v_after = kvjax.view(after, il, cfg.size)
        k_before, v_before = kvjax.view(before, il, cfg.size)
        direct = kvjax.rope(jnp.asarray(raw[il]).astype(dtype), jnp.asarray(np.maximum(pos, 0)), cfg.rope[il])
        got = np.asarray(k_after, np.float32).transpose(1, 0, 2)  # [C, H, D]
        np.testing.assert_allclose(got[used], np.asarray(direct, np.float32)[used], rtol=0, atol=TOL[dtype])
        # empty cells carry no delta: their rows are left exactly as they were; V never moves
        np.testing.assert_array_equal(np.asarray(k_after)[:, ~used], np.asarray(k_before)[:, ~used])
        np.testing.assert_array_equal(np.asarray(v_after), np.asarray(v_before))


@pytest.mark.parametrize(
    "which,dtype",
    [
        ("shared", "float32"),
        ("shared", "float16"),
        ("per_layer_freqs", "float32"),
        ("per_layer_modes", "float32"),
        ("per_layer_modes", "float16"),
    ],
)
def test_update_equals_k_at_new_positions(which, dtype):
    cache, raw = _scene(ROPES[which], dtype)
    moved = _moved(cache)
    assert bool(kvjax.has_shift(moved))
    after = kvjax.update(moved)
    _assert_k_at_positions(moved, after, raw, dtype)
    if dtype == "float32":  # the traced path (lax.cond) once per kind of RoPE layout
        jitted = jax.jit(kvjax.update)(moved)
        for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(jitted)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_donated_shift_matches_and_consumes_k():
    cache, raw = _scene(ROPES["per_layer_freqs"])
    moved = _moved(cache)
    expected = kvjax.update(moved)
    consumed = jax.tree.map(jnp.copy, moved)  # its own buffers, so `moved` stays valid
    got = kvjax.update(consumed, donate=True)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(k.is_deleted() for k in consumed.k) and not any(v.is_deleted() for v in consumed.v)
    again = kvjax.k_shift(jax.tree.map(jnp.copy, moved), donate=True)
    np.testing.assert_array_equal(np.asarray(again.k[0]), np.asarray(expected.k[0]))


def test_far_positions_float32():
    """Positions in the thousands: float32 angles lose ~pos * 6e-8 rad, so the tolerance grows."""
    cfg = _config(kvjax.RopeConfig(n_rot=8))
    cache = fill(kvjax.init(cfg), list(range(4000, 4020)), [[0]] * 20)
    rng = np.random.default_rng(1)
    raw = {il: rng.standard_normal((64, cfg.n_kv_heads[il], cfg.head_dim[il])).astype(np.float32) for il in range(3)}
    pos = jnp.maximum(cache.cells.pos, 0)
    for il in range(3):
        cache = kvjax.write(
            cache, il, jnp.arange(64), kvjax.rope(jnp.asarray(raw[il]), pos, cfg.rope[il]), jnp.asarray(raw[il])
        )
    after = kvjax.update(kvjax.seq_add(cache, 0, 0, -1, -3990))
    new_pos = np.asarray(after.cells.pos)
    used = new_pos >= 0
    for il in range(3):
        direct = kvjax.rope(jnp.asarray(raw[il]), jnp.asarray(np.maximum(new_pos, 0)), cfg.rope[il])
        got = np.asarray(kvjax.view(after, il, 64)[0]).transpose(1, 0, 2)
        np.testing.assert_allclose(got[used], np.asarray(direct)[used], rtol=0, atol=2e-3)


def test_k_shift_then_more_ops_accumulate():
    cache, raw = _scene(ROPES["shared"])
    once = kvjax.update(_moved(cache))
    twice = kvjax.update(kvjax.seq_add(once, 1, 0, -1, 5))
    _assert_k_at_positions(once, twice, raw, "float32")


def test_update_with_nothing_pending_is_free():
    cache, _ = _scene(ROPES["shared"])
    out = kvjax.update(cache)
    assert all(a is b for a, b in zip(out.k, cache.k))  # eager: nothing ran, the buffers are shared
    jitted = jax.jit(kvjax.update)(cache)
    for a, b in zip(jitted.k, cache.k):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_recompile_for_new_deltas():
    cache, _ = _scene(ROPES["per_layer_freqs"])
    jitted = jax.jit(kvjax.update)
    kvjax.update(kvjax.seq_add(cache, 0, 0, -1, 1))
    jitted(kvjax.seq_add(cache, 0, 0, -1, 1))
    for delta in (2, -1, 13):
        moved = kvjax.seq_div(kvjax.seq_add(cache, 0, 0, -1, delta), 1, 0, -1, 2)
        with no_recompile():
            jax.block_until_ready(kvjax.update(moved))
            jax.block_until_ready(jitted(moved))
            jax.block_until_ready(kvjax.k_shift(moved))


def test_without_rope_config():
    cfg = _config(None)
    cache = fill(kvjax.init(cfg), [0, 1, 2], [[0]] * 3)
    assert kvjax.can_shift(cache) and not cfg.can_shift  # positions may move; K cannot be rotated
    moved = kvjax.seq_add(cache, 0, 0, -1, 2)
    with pytest.raises(ValueError, match="set CacheConfig.rope"):
        kvjax.k_shift(moved)
    # without RoPE (ALiBi, position-free K) update only clears the deltas, as the seed does for
    # rope_type NONE: K is untouched, the new positions live in the cells
    for done in (kvjax.update(moved), jax.jit(kvjax.update)(moved)):
        assert not bool(kvjax.has_shift(done))
        np.testing.assert_array_equal(np.asarray(done.k[0]), np.asarray(moved.k[0]))
        assert kvjax.cell_table(done).pos[:3].tolist() == [2, 3, 4]
    assert kvjax.update(cache) is cache  # nothing pending
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.update(moved.cells)
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.can_shift(None)


def test_update_then_pending_defrag():
    cache, raw = _scene(ROPES["shared"])
    moved = _moved(cache)
    shifted = kvjax.update(moved)
    pending = moved.replace(cells=moved.cells.replace(defrag=jnp.bool_(True)))

    def rows(c):
        """(pos, seq bits, K row of layer 0) of every used cell, sorted: defrag may reorder cells."""
        pos, seq = np.asarray(c.cells.pos), np.asarray(c.cells.seq)
        k = np.asarray(kvjax.view(c, 0, c.config.size)[0]).transpose(1, 0, 2)
        return sorted((int(pos[i]), tuple(seq[i].tolist()), k[i].round(5).tobytes()) for i in np.nonzero(pos >= 0)[0])

    donated = kvjax.update(jax.tree.map(jnp.copy, pending), donate=True)
    for out in (kvjax.update(pending), jax.jit(kvjax.update)(pending), donated):
        assert not bool(out.cells.defrag) and not bool(kvjax.has_shift(out))
        assert rows(out) == rows(shifted)
        n_used = int(kvjax.used_cells(out))
        assert (np.asarray(out.cells.pos)[:n_used] >= 0).all()  # holes closed
