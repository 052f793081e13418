"""State blobs, session files and checkpoints of block-quantized caches."""

import struct

import numpy as np
import pytest

import jax.numpy as jnp

import kvjax
from kvjax.storage import _quant as Q

QTYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]
IDS = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7}


def _cache(k, v, n=6, seqs=((0,),) * 6, seed=0, size=64):
    cfg = kvjax.CacheConfig(
        size=size, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=64, head_dim_v=32, k_dtype=k, v_dtype=v
    )
    ub = kvjax.make_ubatch(list(range(n)), [list(s) for s in seqs])
    cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    rng = np.random.default_rng(seed)
    t = slot.shape[0]
    for il in range(2):
        cache = kvjax.write(
            cache,
            il,
            slot,
            jnp.asarray(rng.standard_normal((t, 2, 64)), jnp.float32),
            jnp.asarray(rng.standard_normal((t, 2, 32)), jnp.float32),
        )
    return cfg, cache, np.asarray(slot)[:n]


@pytest.mark.parametrize("name", QTYPES)
def test_blob_layout_is_the_seeds(name):
    cfg, cache, slot = _cache(name, name, n=3, seqs=((0,), (0,), (0,)))
    blob = kvjax.state_write(cache)
    off = 4 + 3 * (4 + 4 + 4)  # cell_count, 3 cells with one seq id each
    v_trans, n_layer = struct.unpack_from("<II", blob, off)
    assert (v_trans, n_layer) == (0, 2)
    off += 8
    qt = Q.QUANT_TYPES[name]
    for il in range(2):
        k_type, k_row = struct.unpack_from("<iQ", blob, off)
        assert k_type == IDS[name] and k_row == 2 * 64 // 32 * qt.type_size  # ggml_row_size(type, H*D)
        off += 12
        rows = np.frombuffer(blob, np.uint8, 3 * k_row, off).reshape(3, 2, -1)
        np.testing.assert_array_equal(rows, np.asarray(cache.k[0][il][:, slot]).transpose(1, 0, 2))
        off += 3 * k_row
    for il in range(2):
        v_type, v_row = struct.unpack_from("<iQ", blob, off)
        assert v_type == IDS[name] and v_row == 2 * 32 // 32 * qt.type_size
        off += 12 + 3 * v_row
    assert off == len(blob)


@pytest.mark.parametrize(
    "kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_1", "q5_0"), ("q5_1", "float16"), ("float32", "q8_0")]
)
def test_round_trip_whole_and_per_sequence(kt, vt):
    cfg, cache, _ = _cache(kt, vt, seqs=((0,), (0, 1), (1,), (0,), (1,), (0, 1)))
    blob = kvjax.state_write(cache)
    back = kvjax.state_read(kvjax.init(cfg), blob)
    assert kvjax.state_write(back) == blob
    for g in range(len(cache.k)):
        np.testing.assert_array_equal(np.asarray(back.k[g]), np.asarray(cache.k[g]))
        np.testing.assert_array_equal(np.asarray(back.v[g]), np.asarray(cache.v[g]))
    seq = kvjax.state_write(cache, 1)
    into = kvjax.state_read(kvjax.init(cfg), seq, 1)
    assert kvjax.state_write(into, 1) == seq


@pytest.mark.parametrize(
    "have,blob_type", [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("float16", "q8_0"), ("q8_0", "float32")]
)
def test_mismatched_type_is_refused_memory_unchanged(have, blob_type):
    _, src, _ = _cache(blob_type, blob_type)
    blob = kvjax.state_write(src)
    cfg, dst, _ = _cache(have, have, seed=3, n=2, seqs=((0,), (0,)))
    before = kvjax.state_write(dst)
    with pytest.raises(kvjax.StateError, match="K type"):
        kvjax.state_read(dst, blob)
    assert kvjax.state_write(dst) == before  # the cache passed in is intact and usable


def test_quantized_v_trans_is_refused_in_config():
    with pytest.raises(ValueError, match="v_trans"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=32, v_dtype="q8_0", v_trans=True)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_session_file_round_trip(tmp_path, name):
    cfg, cache, _ = _cache(name, name)
    path = str(tmp_path / "s.bin")
    tokens = list(range(6))
    kvjax.save(path, cache, tokens=tokens)
    back, toks = kvjax.load(path, kvjax.init(cfg))
    assert list(toks) == tokens
    assert kvjax.state_write(back) == kvjax.state_write(cache)
    other = kvjax.init(cfg.replace(k_dtype="q4_1" if name == "q8_0" else "q8_0"))
    with pytest.raises(kvjax.StateError, match="fingerprint"):
        kvjax.load(path, other)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_checkpoint_round_trip(tmp_path, name):
    pytest.importorskip("orbax.checkpoint")
    cfg, cache, _ = _cache(name, name)
    kvjax.checkpoint_save(str(tmp_path / "ck"), cache)
    back = kvjax.checkpoint_restore(str(tmp_path / "ck"), cfg)
    with pytest.raises(kvjax.StateError, match="k_dtype"):
        kvjax.checkpoint_restore(str(tmp_path / "ck"), cfg.replace(k_dtype="q5_0"))
    for g in range(len(cache.k)):
        assert back.k[g].dtype == jnp.uint8
        np.testing.assert_array_equal(np.asarray(back.k[g]), np.asarray(cache.k[g]))
        np.testing.assert_array_equal(np.asarray(back.v[g]), np.asarray(cache.v[g]))
    np.testing.assert_array_equal(np.asarray(back.cells.pos), np.asarray(cache.cells.pos))


def test_iswa_memory_with_quantized_parts_round_trips():
    base = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=32, k_dtype="q8_0", v_dtype="q4_0")
    cfg = kvjax.IswaConfig(base, swa_layers=(1,), n_swa=16, n_batch=8)
    mem = kvjax.init(cfg)
    assert all(mem.part(p).k[0].dtype == jnp.uint8 for p in range(mem.n_parts))
    blob = kvjax.state_write(mem)
    back = kvjax.state_read(kvjax.init(cfg), blob)
    assert kvjax.state_write(back) == blob
