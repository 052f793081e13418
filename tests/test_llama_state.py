"""Today's llama.cpp state layout: stream-count memory blobs, session ('ggsn' 9) and sequence ('ggsq' 2) files.

Round trips through kvjax's writer, and blobs built here by hand in llama.cpp's layout (several
streams, empty streams, one-sequence blobs naming their sequence) compared with the seed-format
blobs of the same cells. Bad blobs raise :class:`kvjax.StateError` naming the field.
"""

from __future__ import annotations

import struct

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax._errors import StateError
from kvjax.io._llama_state import (
    SEQ_MAGIC,
    SESSION_MAGIC,
    seq_file_read,
    seq_file_write,
    session_read,
    session_write,
    stream_state_read,
    stream_state_write,
)

PLAIN = dict(size=64, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=4, padding=16)
CONFIGS = {
    "plain": kvjax.CacheConfig(**PLAIN),
    "v_trans": kvjax.CacheConfig(**PLAIN, v_trans=True),
    # llama.cpp's default storage without flash attention: F16 K/V, V transposed
    "llama.cpp default": kvjax.CacheConfig(**PLAIN, k_dtype=jnp.float16, v_dtype=jnp.float16, v_trans=True),
}


def with_random_kv(cache, seed):
    """The cache with random K/V in every cell, in its storage dtype."""
    rng = np.random.default_rng(seed)
    k = tuple(jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32), x.dtype) for x in cache.k)
    v = tuple(jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32), x.dtype) for x in cache.v)
    return cache.replace(k=k, v=v)


def _filled(cfg, seed=0):
    """Sequences 0 and 1 (0..4 shared by both), and sequence 2, with random K/V."""
    cache = with_random_kv(kvjax.init(cfg), seed)
    for pos, seqs in ((range(0, 5), [0, 1]), (range(5, 9), [0]), (range(5, 12), [1]), (range(3, 7), [2])):
        cache, _, ok = kvjax.find_slot(cache, kvjax.make_ubatch(list(pos), [seqs] * len(pos)))
        assert bool(ok)
    return cache


def _seed_equal(a, b, seq_id=-1):
    assert kvjax.state_write(a, seq_id) == kvjax.state_write(b, seq_id)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_and_sequence_round_trips(name):
    cfg = CONFIGS[name]
    cache = _filled(cfg)
    blob = stream_state_write(cache)
    assert struct.unpack_from("<II", blob) == (1, int(kvjax.used_cells(cache)))
    if cfg.k_dtype == jnp.float16:  # ggml type id 1 (F16) in the first layer's K header
        n = int(kvjax.used_cells(cache))
        _, _, _, meta, _ = _split(blob, n)
        assert struct.unpack_from("<IIi", blob, 8 + meta)[2] == 1
    _seed_equal(stream_state_read(kvjax.init(cfg), blob), cache)
    for s in range(3):
        seq = stream_state_write(cache, s)
        n = struct.unpack_from("<I", seq, 4)[0]
        rec = np.frombuffer(seq[8 : 8 + 12 * n], "<i4").reshape(n, 3)
        assert (rec[:, 1] == 1).all() and (rec[:, 2] == s).all()  # each cell names its sequence
        restored = stream_state_read(kvjax.init(cfg), seq, seq_id=3)
        assert kvjax.state_write(restored, 3) == kvjax.state_write(cache, s)


def _split(blob, n):
    """(n_stream, n, offset, meta bytes, rest) of a one-stream whole blob of n cells."""
    off = 8
    for _ in range(n):
        k = struct.unpack_from("<I", blob, off + 4)[0]
        off += 8 + 4 * k
    return 1, n, 8, off - 8, blob[off:]


def test_an_empty_sequence_is_its_stream_count_and_a_zero():
    cfg = CONFIGS["plain"]
    cache = _filled(cfg)
    assert stream_state_write(cache, 3) == struct.pack("<II", 1, 0)
    # reading it removes the destination sequence (llama.cpp would leave it: see the module docstring)
    out = stream_state_read(cache, struct.pack("<II", 1, 0), seq_id=2)
    assert int(kvjax.seq_pos_max(out, 2)) == -1 and int(kvjax.seq_pos_max(out, 1)) == 11
    assert int(kvjax.used_cells(stream_state_read(cache, struct.pack("<III", 2, 0, 0)))) == 0


def _stream_of(cache, seq_id):
    """Hand-built: one stream of llama.cpp's layout holding the cells of one sequence (whole-blob meta)."""
    seed = kvjax.state_write(cache, seq_id)
    n = struct.unpack_from("<I", seed)[0]
    pos = np.frombuffer(seed[4 : 4 + 8 * n], "<i4")[0::2]
    meta = b"".join(struct.pack("<iIi", int(p), 1, seq_id) for p in pos)
    return struct.pack("<I", n) + meta + seed[4 + 8 * n :]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_hand_built_blob_of_several_streams_is_merged(name):
    """llama.cpp without kv_unified: one stream per sequence, each with its own cells and data."""
    cfg = CONFIGS[name]
    one = _filled(cfg)
    one, _ = kvjax.seq_rm(one, 1, -1, -1)  # streams hold disjoint sequences: 0 and 2 only
    blob = struct.pack("<I", 4) + _stream_of(one, 0) + struct.pack("<I", 0) + _stream_of(one, 2) + struct.pack("<I", 0)
    merged = stream_state_read(kvjax.init(cfg), blob)
    for s in (0, 2):
        _seed_equal(merged, one, s)
    assert int(kvjax.used_cells(merged)) == int(kvjax.used_cells(one))
    # a one-sequence blob of a multi-stream cache: the sequence's stream alone has cells
    seq_blob = struct.pack("<I", 3) + struct.pack("<I", 0) + _stream_of(one, 2) + struct.pack("<I", 0)
    _seed_equal(stream_state_read(kvjax.init(cfg), seq_blob, seq_id=1), _moved(one, 2, 1), 1)


def _moved(cache, src, dst):
    out = kvjax.seq_cp(cache, src, dst, -1, -1)
    return out


def test_session_file_round_trip_with_tokens_and_logits(tmp_path):
    cfg = CONFIGS["plain"]
    cache = _filled(cfg)
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)
    data = session_write(cache, [5, 6, 7], arch="llama", logits=logits, output_rows=[3, 9], version=9)
    assert struct.unpack_from("<II", data) == (SESSION_MAGIC, 9) and data[:4] == b"nsgg"
    path = tmp_path / "s.bin"
    path.write_bytes(data)
    got = session_read(kvjax.init(cfg), path)
    assert got.tokens.tolist() == [5, 6, 7] and got.arch == "llama"
    assert got.output_rows.tolist() == [3, 9] and np.array_equal(got.logits, logits)
    assert got.embeddings.size == 0
    _seed_equal(got.cache, cache)
    assert got.version == 9


def test_a_version_10_session_has_no_output_buffers():
    """Today's llama.cpp: magic, version 10, tokens, the architecture name, then the memory section."""
    cfg = CONFIGS["llama.cpp default"]
    cache = _filled(cfg)
    data = session_write(cache, [5, 6, 7], arch="gemma3")
    assert struct.unpack_from("<III", data) == (SESSION_MAGIC, 10, 3)
    assert data[24:34] == struct.pack("<I", 6) + b"gemma3"
    assert data[34:] == kvjax.io._llama_state.memory_state_write(cache)
    got = session_read(kvjax.init(cfg), data, arch="gemma3")
    assert got.version == 10 and got.logits.shape == (0, 0) and got.output_rows.size == 0
    _seed_equal(got.cache, cache)
    with pytest.raises(StateError, match="session file arch: expected 'llama'.*found 'gemma3'"):
        session_read(kvjax.init(cfg), data, arch="llama")
    with pytest.raises(ValueError, match="out of range for session version 10"):
        session_write(cache, [1], arch="llama", logits=np.zeros((1, 4)))


@pytest.mark.parametrize("written", [True, False])
def test_either_v_layout_is_read_and_written(written):
    """The flag chooses the bytes only: a file of either layout reads into a memory of either."""
    cache = _filled(CONFIGS["plain"])
    data = session_write(cache, [1, 2], arch="llama", v_trans=written)
    n, head = int(kvjax.used_cells(cache)), 12 + 4 * 2 + 4 + len("llama")
    _, _, _, meta, _ = _split(data[head:], n)
    assert struct.unpack_from("<I", data, head + 8 + meta)[0] == int(written)
    for reader in ("plain", "v_trans"):
        got = session_read(kvjax.init(CONFIGS[reader]), data)
        assert got.cache.config == CONFIGS[reader]  # the memory keeps its own config
        _seed_equal(got.cache.replace(config=CONFIGS["plain"]), cache)
    with pytest.raises(ValueError, match="v_trans=1 is out of range"):
        session_write(cache, [1], arch="llama", v_trans=1)


def test_sequence_file_round_trip():
    cfg = CONFIGS["v_trans"]
    cache = _filled(cfg)
    data = seq_file_write(cache, 1, [1, 2, 3, 4])
    assert struct.unpack_from("<II", data) == (SEQ_MAGIC, 3) and data[:4] == b"qsgg"
    out, tokens = seq_file_read(kvjax.init(cfg), data, 0)
    assert tokens.tolist() == [1, 2, 3, 4]
    assert kvjax.state_write(out, 0) == kvjax.state_write(cache, 1)
    # version 2: the same cells (kvjax's models have no per-cell records)
    old = seq_file_write(cache, 1, [1, 2, 3, 4], version=2)
    assert struct.unpack_from("<I", old, 4)[0] == 2 and old[8:] == data[8:]
    assert kvjax.state_write(seq_file_read(kvjax.init(cfg), old, 2)[0], 2) == kvjax.state_write(cache, 1)


def _corrupt_cases():
    cfg = CONFIGS["plain"]
    cache = _filled(cfg)
    seq = seq_file_write(cache, 0, [1])
    sess = session_write(cache, [1], arch="llama")
    blob = stream_state_write(cache, 0)
    two = stream_state_write(cache, 1)
    return cfg, {
        "magic": (lambda c: seq_file_read(c, b"abcd" + seq[4:], 0), "sequence file magic: expected 0x67677371"),
        "version": (
            lambda c: seq_file_read(c, seq[:4] + struct.pack("<I", 4) + seq[8:], 0),
            r"sequence file version: expected one of \[2, 3\].*found 4",
        ),
        "session version": (
            lambda c: session_read(c, sess[:4] + struct.pack("<I", 8) + sess[8:]),
            r"session file version: expected one of \[9, 10\]",
        ),
        "truncated": (lambda c: stream_state_read(c, blob[:-3], 0), "truncated blob"),
        "trailing": (lambda c: stream_state_read(c, blob + b"\0", 0), "1 trailing bytes"),
        "seed-style cell": (
            lambda c: stream_state_read(c, blob[:12] + struct.pack("<I", 0) + blob[16:], 0),
            "n_seq_id: expected 1 in a single-sequence blob",
        ),
        "two streams": (
            lambda c: stream_state_read(c, struct.pack("<I", 2) + blob[4:] + two[4:], 0),
            "expected cells in one stream, found 2",
        ),
        "no streams": (lambda c: stream_state_read(c, struct.pack("<I", 0)), "n_stream: expected"),
        "session truncated": (lambda c: session_read(c, sess[:30]), "truncated"),
    }


@pytest.mark.parametrize("case", sorted(_corrupt_cases()[1]))
def test_bad_blobs_raise_state_errors_naming_the_field(case):
    cfg, cases = _corrupt_cases()
    fn, match = cases[case]
    cache = kvjax.init(cfg)
    with pytest.raises(StateError, match=match):
        fn(cache)
    assert int(kvjax.used_cells(cache)) == 0


def test_bad_arguments():
    cfg = CONFIGS["plain"]
    cache = _filled(cfg)
    with pytest.raises(ValueError, match="seq_id=4 is out of range"):
        stream_state_write(cache, 4)
    with pytest.raises(ValueError, match="cache must be a kvjax.KVCache"):
        stream_state_write(object())
    with pytest.raises(ValueError, match="seq_id=-1 is out of range for a sequence file"):
        seq_file_write(cache, -1, [1])
    with pytest.raises(ValueError, match="arch=''"):
        session_write(cache, [1], arch="")
    with pytest.raises(ValueError, match="tokens has shape"):
        seq_file_write(cache, 0, [[1, 2]])
    with pytest.raises(ValueError, match="data must be bytes or a file path"):
        seq_file_read(cache, 12, 0)
    with pytest.raises(ValueError, match="output_rows has shape"):
        session_write(cache, [1], arch="llama", logits=np.zeros((2, 3)), output_rows=[1], version=9)
    with pytest.raises(ValueError, match=r"version=11 is out of range for a session file: allowed one of \[9, 10\]"):
        session_write(cache, [1], arch="llama", version=11)
    with pytest.raises(ValueError, match=r"version=1 is out of range for a sequence file: allowed one of \[2, 3\]"):
        seq_file_write(cache, 0, [1], version=1)
    with pytest.raises(ValueError, match="memory must be a kvjax.KVCache, IswaCache or StreamCache"):
        session_write(
            kvjax.init(kvjax.RecurrentConfig(size=1, n_seq_max=1, n_layer=1, k_shape=(2,), v_shape=(2,))),
            [1],
            arch="mamba",
        )
