"""kvjax.io._session: session files around a state blob, atomic writes, corrupt files."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

import kvjax
from kvjax.io import _session as session
from kvjax._errors import StateError
from tests.helpers import fill
from tests.test_state import PLAIN, assert_unchanged, records, snapshot, with_random_kv

CFG = kvjax.CacheConfig(**PLAIN)


def sample():
    return with_random_kv(fill(kvjax.init(CFG), range(7), [[0], [1], [0, 2], [0], [1], [3], [0]]), 11)


def test_whole_and_sequence_round_trip(tmp_path):
    cache = sample()
    path = tmp_path / "all.kvjax"
    kvjax.save(path, cache, tokens=np.arange(7) * 100)
    restored, tokens = kvjax.load(path, kvjax.init(CFG))
    assert records(restored) == records(cache)
    assert tokens.dtype == np.int32 and tokens.tolist() == [0, 100, 200, 300, 400, 500, 600]
    one = tmp_path / "seq0.kvjax"
    kvjax.save(str(one), cache, seq_id=0, tokens=[5, 6, 7, 8])
    moved, tokens = kvjax.load(one, cache, seq_id=3)  # into another sequence of the same cache
    assert tokens.tolist() == [5, 6, 7, 8]
    src = sorted((p, k, v) for p, s, k, v in records(cache) if 0 in s)
    got = sorted((p, k, v) for p, s, k, v in records(moved) if s == frozenset({3}))
    assert got == src
    kvjax.save(one, cache, seq_id=1)  # replaces the file; no tokens
    _, tokens = kvjax.load(one, cache, seq_id=1)
    assert tokens.shape == (0,)


def test_file_layout(tmp_path):
    """The header is the documented one and the blob is state_write's, byte for byte."""
    cache = sample()
    path = tmp_path / "f"
    kvjax.save(path, cache, seq_id=2, tokens=[1, -2])
    data = path.read_bytes()
    magic, version, seq, fingerprint, n_tokens = struct.unpack_from("<8sIi32sQ", data)
    assert (magic, version, seq, n_tokens) == (b"KVJAXSES", 1, 2, 2)
    assert fingerprint == kvjax.io._state.layout_fingerprint(CFG)
    assert struct.unpack_from("<2i", data, 56) == (1, -2)
    (n_blob,) = struct.unpack_from("<Q", data, 64)
    assert data[72:] == kvjax.state_write(cache, 2) and n_blob == len(data) - 72
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("fail_at", ["write", "fsync", "replace"])
def test_crash_mid_write_leaves_no_half_file(tmp_path, monkeypatch, fail_at):
    cache = sample()
    path = tmp_path / "chat.kvjax"
    kvjax.save(path, cache, tokens=[1, 2, 3])
    old = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk on fire")

    if fail_at == "fsync":
        monkeypatch.setattr(session.os, "fsync", boom)
    elif fail_at == "replace":
        monkeypatch.setattr(session.os, "replace", boom)
    else:  # the process dies after half of the blob reached the temporary file
        real_fdopen = os.fdopen

        def half_fdopen(fd, mode):
            f = real_fdopen(fd, mode)

            class Half:
                calls = 0

                def __enter__(self):
                    return self

                def __exit__(self, *exc):
                    f.close()

                def write(self, data):
                    Half.calls += 1
                    if Half.calls == 4:  # header, tokens, length, then the blob
                        f.write(bytes(data)[: len(data) // 2])
                        f.flush()
                        raise OSError("killed")
                    return f.write(data)

                def flush(self):
                    f.flush()

                def fileno(self):
                    return f.fileno()

            return Half()

        monkeypatch.setattr(session.os, "fdopen", half_fdopen)
    with pytest.raises(OSError):
        kvjax.save(path, kvjax.seq_rm(cache, 0)[0], tokens=[9])
    monkeypatch.undo()
    assert path.read_bytes() == old  # the old file is intact ...
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.kvjax"]  # ... and no temp left
    restored, tokens = kvjax.load(path, kvjax.init(CFG))
    assert tokens.tolist() == [1, 2, 3] and records(restored) == records(cache)
    with pytest.raises(OSError):  # a new file: nothing at all under the final name
        monkeypatch.setattr(session.os, "replace", boom)
        kvjax.save(tmp_path / "new.kvjax", cache)
    assert not (tmp_path / "new.kvjax").exists()


def expect_refused(tmp_path, data, cache, seq_id=-1, match=None):
    path = tmp_path / "bad"
    path.write_bytes(data)
    snap = snapshot(cache)
    with pytest.raises(StateError, match=match):
        kvjax.load(path, cache, seq_id)
    assert_unchanged(cache, snap)


def test_corrupt_files(tmp_path):
    cache = sample()
    path = tmp_path / "ok"
    kvjax.save(path, cache, seq_id=-1, tokens=[4, 5, 6])
    good = path.read_bytes()
    dest = kvjax.init(CFG)
    bad = bytearray(good)
    bad[0:8] = b"GGSN\0\0\0\0"
    expect_refused(tmp_path, bytes(bad), dest, match="magic: expected b'KVJAXSES'")
    expect_refused(
        tmp_path, good[:8] + struct.pack("<I", 2) + good[12:], dest, match="format version: expected 1, found 2"
    )
    expect_refused(tmp_path, good, dest, 0, match="the file holds the whole cache")
    other = kvjax.init(CFG.replace(head_dim=8))
    expect_refused(tmp_path, good, other, match="config fingerprint")
    for cut in (0, 7, 12, 16, 47, 48, 55, 56, 60, 67, 68, 75, 76, len(good) - 1):
        expect_refused(tmp_path, good[:cut], dest, match="truncated")
    expect_refused(tmp_path, good + b"\0", dest, match="trailing")
    huge = good[:48] + struct.pack("<Q", 2**62) + good[56:]
    expect_refused(tmp_path, huge, dest, match="tokens: expected")
    # a consistent file around a corrupt blob: state_read's own check names the field
    inner = good[:76] + struct.pack("<I", 99) + good[80:]
    expect_refused(tmp_path, inner, dest, match="cell_count: expected at most 64")
    kvjax.save(path, cache, seq_id=1)
    expect_refused(tmp_path, path.read_bytes(), dest, -1, match="the file holds one sequence")


def test_bad_arguments(tmp_path):
    cache = sample()
    for tokens in ([[1, 2]], [2**31], [1.5]):
        with pytest.raises(ValueError, match="tokens"):
            kvjax.save(tmp_path / "t", cache, tokens=tokens)
    with pytest.raises(ValueError, match="seq_id"):
        kvjax.save(tmp_path / "t", cache, seq_id=5)
    with pytest.raises(FileNotFoundError):
        kvjax.load(tmp_path / "missing", cache)
    assert not list(tmp_path.iterdir())
