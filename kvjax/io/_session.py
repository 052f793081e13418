"""Session files: a state blob with a header and the prompt tokens, written atomically.

llama.cpp saves a conversation as a session file: a magic, a version, the tokens evaluated so
far and the state. kvjax's file carries the same things around a :func:`kvjax.state_write` blob,
plus the config's layout fingerprint so that a file is never read into a cache of another shape::

    offset  size  field
    0       8     magic b"KVJAXSES"
    8       4     u32 format version (FORMAT_VERSION)
    12      4     i32 seq_id the blob was written for (-1: the whole cache)
    16      32    layout fingerprint of the config (kvjax.io._state.layout_fingerprint)
    48      8     u64 number of tokens t
    56      4t    i32 tokens
    56+4t   8     u64 blob length b
    64+4t   b     the state blob (the seed's layout)

Everything is little-endian. :func:`save` writes to a temporary file in the destination folder,
flushes and fsyncs it, then renames it over the destination (and fsyncs the folder), so a crash
mid-write leaves either the old file or the new one under the final name, never half of one.
:func:`load` checks the magic, the version, the fingerprint, the kind of blob and every length
before the blob itself is validated by :func:`kvjax.state_read`; any mismatch is a
:class:`kvjax.StateError` and the cache is left unchanged.

The file is created with mode 0600 (owner only, as :func:`tempfile.mkstemp` makes it): it holds
a conversation's tokens and K/V.

Example:
    >>> import os, tempfile, kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1], [[0], [0]]))
    >>> path = os.path.join(tempfile.mkdtemp(), "chat.kvjax")
    >>> kvjax.save(path, cache, seq_id=0, tokens=[15, 27])
    >>> restored, tokens = kvjax.load(path, kvjax.init(cfg), seq_id=1)
    >>> tokens.tolist(), int(kvjax.seq_pos_max(restored, 1))
    ([15, 27], 1)
"""

from __future__ import annotations

import os
import struct
import tempfile
from typing import Optional, Sequence, Tuple

import numpy as np

from kvjax.memory._unified import KVCache
from kvjax._errors import StateError
from kvjax.io._state import check_host_cache, check_seq, layout_fingerprint, state_read, state_write
from kvjax._validate import INT32_MAX, INT32_MIN

MAGIC = b"KVJAXSES"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sIi32sQ")  # magic, version, seq_id, fingerprint, n_tokens
_LEN = struct.Struct("<Q")


def _tokens_array(tokens) -> np.ndarray:
    if tokens is None:
        return np.zeros(0, "<i4")
    arr = np.asarray(tokens)
    if arr.size == 0:
        return np.zeros(0, "<i4")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D sequence of integers, got shape {arr.shape} and dtype {arr.dtype}")
    if int(arr.min()) < INT32_MIN or int(arr.max()) > INT32_MAX:
        raise ValueError(
            f"tokens contain {int(arr.min()) if int(arr.min()) < INT32_MIN else int(arr.max())}: "
            f"allowed int32 values [{INT32_MIN}, {INT32_MAX}]"
        )
    return arr.astype("<i4")


def _fsync_dir(folder: str) -> None:
    """Make the rename durable; some platforms and file systems cannot open a folder."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def save(path, cache: KVCache, seq_id: int = -1, tokens: Optional[Sequence[int]] = None) -> None:
    """Write the cache (or one sequence of it) and its tokens to ``path``, atomically.

    Args:
        path: destination file (replaced if it exists).
        cache: the cache.
        seq_id: in ``[-1, n_seq_max)``: -1 saves the whole cache, else that sequence.
        tokens: the tokens behind the saved state (int32 values), or None.

    Raises:
        ValueError: a bad argument (see :func:`kvjax.state_write`).
        OSError: the file cannot be written (nothing is left under ``path`` then).
    """
    cfg = check_host_cache(cache, "save")
    seq_id = check_seq(seq_id, cfg)
    toks = _tokens_array(tokens)
    blob = state_write(cache, seq_id)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, seq_id, layout_fingerprint(cfg), toks.size)
    write_atomic(path, (head, toks.tobytes(), _LEN.pack(len(blob)), blob))


def write_atomic(path, pieces: Sequence[bytes]) -> None:
    """Write ``pieces`` one after the other to ``path`` so that a crash leaves the old file or the new one.

    A temporary file (mode 0600) in the destination folder is written, flushed and fsynced, then
    renamed over ``path``, and the folder is fsynced.

    Raises:
        OSError: the file cannot be written (nothing is left under ``path`` then).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for piece in pieces:
                f.write(piece)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(folder)


def load(
    path, cache: KVCache, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False
) -> Tuple[KVCache, np.ndarray]:
    """Read a file written by :func:`save` into ``cache``.

    Args:
        path: the file.
        cache: the destination cache (its config must have the file's layout fingerprint).
        seq_id: -1 for a whole-cache file; else the destination sequence of a one-sequence file
            (any id: a conversation saved from sequence 0 may be restored into sequence 3).
        contiguous: placement of a one-sequence file's cells (see :func:`kvjax.state_read`).
        donate: reuse the K/V buffers of ``cache`` (see :func:`kvjax.state_read`).

    Returns:
        ``(cache, tokens)``: the restored cache and the tokens as ``int32 [t]``.

    Raises:
        StateError: a corrupt file or one that does not match the cache; the cache is unchanged.
        OSError: the file cannot be read.
    """
    cfg = check_host_cache(cache, "load")
    seq_id = check_seq(seq_id, cfg)
    with open(os.fspath(path), "rb") as f:
        # the header is read and checked before anything else: a huge or endless file that is not a
        # session file costs one small read, never the memory to hold it
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise StateError(f"header: expected {_HEAD.size} bytes, found {len(head)} (truncated file)")
        magic, version, saved_seq, fingerprint, n_tokens = _HEAD.unpack(head)
        if magic != MAGIC:
            raise StateError(f"magic: expected {MAGIC!r}, found {bytes(magic)!r} (not a kvjax session file)")
        if version != FORMAT_VERSION:
            raise StateError(f"format version: expected {FORMAT_VERSION}, found {version}")
        if fingerprint != layout_fingerprint(cfg):
            raise StateError(
                f"config fingerprint: expected {layout_fingerprint(cfg).hex()[:16]}..., found "
                f"{fingerprint.hex()[:16]}... (the file was saved from a cache with other "
                f"layers, heads, head sizes, dtypes or v_trans)"
            )
        if (saved_seq < 0) != (seq_id < 0):
            raise StateError(
                f"seq_id: the file holds {'the whole cache' if saved_seq < 0 else 'one sequence'} "
                f"(saved with seq_id={saved_seq}): expected seq_id "
                f"{'-1' if saved_seq < 0 else '>= 0'}, found {seq_id}"
            )
        left = os.fstat(f.fileno()).st_size - _HEAD.size
        if n_tokens * 4 + _LEN.size > left:
            raise StateError(
                f"tokens: expected {n_tokens} tokens ({n_tokens * 4} bytes) and a blob length, "
                f"found {max(left, 0)} bytes (truncated file)"
            )
        tokens = np.frombuffer(f.read(4 * n_tokens), "<i4").astype(np.int32)
        (n_blob,) = _LEN.unpack(f.read(_LEN.size))
        left -= 4 * n_tokens + _LEN.size
        if n_blob != left:
            raise StateError(
                f"blob length: expected {n_blob} bytes, found {left} "
                f"({'truncated file' if n_blob > left else 'trailing bytes'})"
            )
        view = memoryview(f.read(n_blob))
    off = 0
    restored = state_read(cache, view[off:], seq_id, contiguous=contiguous, donate=donate)
    return restored, tokens


__all__ = ["save", "load", "MAGIC", "FORMAT_VERSION"]
