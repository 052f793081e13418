"""llama.cpp's attention rotation of quantized K/V (kvjax.io._attn_rot), converted at the file boundary.

The rule and the matrix are checked here; that llama.cpp itself stores its Q8_0 K/V this way is
shown on its own files in tests/test_session_handover.py (the ``llama64-q8_0`` case: heads of 64).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.io._attn_rot import hadamard, rotate_section, rotation_sizes
from kvjax.io._llama_state import memory_state_read, memory_state_write, stream_state_write


@pytest.mark.parametrize("n", [1, 2, 64, 256])
def test_the_matrix_is_sylvesters_orthonormal_involution(n):
    h = hadamard(n).astype(np.float64)
    np.testing.assert_allclose(h @ h, np.eye(n), atol=1e-6)
    np.testing.assert_array_equal(h, h.T)
    i, j = np.indices((n, n))
    signs = np.vectorize(lambda a: (-1) ** bin(a).count("1"))(i & j)
    np.testing.assert_allclose(h, signs / np.sqrt(n), rtol=1e-6)
    with pytest.raises(ValueError, match="n=3 is out of range: allowed a power of two"):
        hadamard(3)


def _config(k_dtype="q8_0", v_dtype="q8_0", head_dim=256, **kw):
    return kvjax.CacheConfig(
        size=32, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=head_dim, k_dtype=k_dtype, v_dtype=v_dtype, **kw
    )


@pytest.mark.parametrize(
    "k_dtype, v_dtype, head_dim, want",
    [
        ("q8_0", "q8_0", 256, (256, 64)),  # K: the largest power of two dividing the head; V: 64
        ("q8_0", "q8_0", 192, (64, 64)),
        ("q4_0", "float16", 128, (128, 0)),  # only a quantized side is rotated
        ("float16", "q8_0", 128, (0, 64)),
        ("q8_0", "q8_0", 32, (0, 0)),  # heads of 32 values: not a multiple of 64
        ("float16", "float16", 256, (0, 0)),
    ],
)
def test_which_caches_llama_cpp_rotates(k_dtype, v_dtype, head_dim, want):
    assert rotation_sizes(_config(k_dtype, v_dtype, head_dim)) == want


def test_heads_of_several_sizes_are_not_rotated():
    cfg = kvjax.CacheConfig(
        size=32, n_seq_max=1, n_layer=2, n_kv_heads=1, head_dim=(64, 128), k_dtype="q8_0", v_dtype="q8_0"
    )
    assert rotation_sizes(cfg) == (0, 0)


def _filled(cfg, seed=0):
    rng = np.random.default_rng(seed)
    cache = kvjax.init(cfg)
    cache, _, ok = kvjax.find_slot(cache, kvjax.make_ubatch(list(range(10)), [[0]] * 5 + [[0, 1]] * 5))
    assert bool(ok)
    slot = jnp.arange(10, dtype=jnp.int32)
    for il in range(cfg.n_layer):
        k = jnp.asarray(rng.standard_normal((10, 2, cfg.head_dim[il])) * 3, jnp.float32)
        v = jnp.asarray(rng.standard_normal((10, 2, cfg.head_dim_v[il])), jnp.float32)
        cache = kvjax.write(cache, il, slot, k, v)
    return cache


@pytest.mark.parametrize("k_dtype", ["q8_0", "q4_0"])
def test_a_rotated_section_reads_back_within_a_quantization_step(k_dtype):
    cfg = _config(k_dtype, k_dtype)
    cache = _filled(cfg)
    rotated = memory_state_write(cache)
    plain = memory_state_write(cache, attn_rot=False)
    assert len(rotated) == len(plain) and rotated != plain
    assert rotate_section(plain, cfg) == rotated  # the writer rotates exactly this way
    back = memory_state_read(kvjax.init(cfg), rotated)
    step = {"q8_0": 1 / 127, "q4_0": 1 / 7}[k_dtype]
    for il in range(cfg.n_layer):
        for a, b in zip(kvjax.view(back, il, 32), kvjax.view(cache, il, 32)):
            a, b = np.asarray(a)[:, :10], np.asarray(b)[:, :10]
            # rotating spreads a row's values: two re-quantizations, each within a step of the block's scale
            assert np.abs(a - b).max() <= 2.5 * step * np.abs(b).max()
    # taken as they are, the rotated blocks are other values
    raw = memory_state_read(kvjax.init(cfg), rotated, attn_rot=False)
    assert np.abs(np.asarray(kvjax.view(raw, 0, 32)[0]) - np.asarray(kvjax.view(cache, 0, 32)[0])).max() > 0.1


def test_float_and_unrotated_caches_are_untouched():
    for cfg in (_config("float16", "float16"), _config("q8_0", "q8_0", head_dim=32)):
        cache = _filled(cfg)
        assert memory_state_write(cache) == memory_state_write(cache, attn_rot=False) == stream_state_write(cache)


def test_bad_attn_rot_is_named():
    cache = _filled(_config())
    with pytest.raises(ValueError, match="attn_rot='yes' is out of range: allowed True"):
        memory_state_write(cache, attn_rot="yes")
    with pytest.raises(ValueError, match="attn_rot=1 is out of range"):
        kvjax.session_read(kvjax.init(cache.config), kvjax.session_write(cache, [1], arch="llama"), attn_rot=1)
