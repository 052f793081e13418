"""Today's llama.cpp state layout: the stream-count memory blob, session files and sequence files.

The seed's memory blob (:mod:`kvjax.io._state`) is ``cell_count, cells, data``. llama.cpp after
its per-sequence streams (``llama_kv_cache`` with ``n_stream``, 2025) writes, little-endian::

    u32 n_stream                         # 1 with a unified cache (kv_unified), else n_seq_max
    per stream:
        u32 cell_count n                 # 0: nothing else for this stream
        n x { i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id }
        data                             # v_trans, n_layer, K rows, V rows: the seed's, unchanged

with one difference in the cells of a **single-sequence** blob: each names its sequence
(``n_seq_id = 1`` and the id) where the seed wrote ``n_seq_id = 0``. Around the memory blob:

- a **session file** (``llama_state_save_file``; magic ``'ggsn'`` = ``0x6767736e``, version 9)::

      u32 magic, u32 version, u32 n_tokens, n_tokens x i32 token,
      u32 len, len bytes arch name,              # "llama", "qwen2", ...
      i32 n_outputs, n_outputs x i32 batch row,  # the rows whose logits follow (output ids)
      u64 n_logits, n_logits x f32,               # n_outputs x n_vocab
      u64 n_embd, n_embd x f32,                   # embeddings (0 unless asked for)
      memory blob (whole cache)

- a **sequence file** (``llama_state_seq_save_file``; magic ``'ggsq'`` = ``0x67677371``,
  version 2)::

      u32 magic, u32 version, u32 n_tokens, n_tokens x i32 token, memory blob (one sequence)

Versions: session version 9 and sequence version 2 are read and written; anything else is refused
naming the version found (sequence version 3 adds per-cell records after the sequence ids, for
multi-position RoPE; not read here). The memory blob is converted to the seed's and read by
:func:`kvjax.state_read`, so every K/V check of that reader applies, and a failed read leaves the
cache as it was.

A kvjax cache is one stream. Reading a blob of ``n_stream > 1`` (llama.cpp without
``kv_unified``): a single-sequence blob has at most one stream with cells and is read from it; a
whole-cache blob's streams hold disjoint sequences and are merged into the one cache (cell order:
stream 0's cells, then stream 1's, ...). Where kvjax differs from llama.cpp: a blob without any
cell empties the cache (whole) or removes the sequence (one sequence), where llama.cpp leaves
them as they were.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1], [[0], [0, 1]]))
    >>> blob = stream_state_write(cache, seq_id=1)
    >>> import struct; struct.unpack_from("<IIiIi", blob)     # 1 stream, 1 cell: pos 1, 1 id: 1
    (1, 1, 1, 1, 1)
    >>> again = stream_state_read(kvjax.init(cfg), blob, seq_id=1)
    >>> stream_state_write(again, seq_id=1) == blob
    True
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import List, Sequence, Tuple

import numpy as np

from kvjax._errors import StateError
from kvjax.io._state import state_read, state_write
from kvjax.memory._unified import KVCache

__all__ = ["stream_state_write", "stream_state_read", "session_write", "session_read", "seq_file_write",
           "seq_file_read", "LlamaSession", "SESSION_MAGIC", "SESSION_VERSION", "SEQ_MAGIC", "SEQ_VERSION"]

SESSION_MAGIC = 0x6767736E   # 'ggsn'
SESSION_VERSION = 9
SEQ_MAGIC = 0x67677371       # 'ggsq'
SEQ_VERSION = 2


class _Reader:
    """Fields off a byte view; a short read raises :class:`StateError` naming the field."""

    def __init__(self, data):
        self.buf = memoryview(data).cast("B")
        self.off = 0

    def take(self, n: int, field: str) -> memoryview:
        if n < 0 or n > len(self.buf) - self.off:
            raise StateError(f"{field}: expected {n} bytes at offset {self.off}, found "
                             f"{len(self.buf) - self.off} (truncated blob)")
        out = self.buf[self.off:self.off + n]
        self.off += n
        return out

    def u32(self, field: str) -> int:
        return struct.unpack("<I", self.take(4, field))[0]

    def i32(self, field: str) -> int:
        return struct.unpack("<i", self.take(4, field))[0]

    def u64(self, field: str) -> int:
        return struct.unpack("<Q", self.take(8, field))[0]

    def finish(self, what: str) -> None:
        if self.off != len(self.buf):
            raise StateError(f"{what} length: expected {self.off} bytes, found {len(self.buf)} "
                             f"({len(self.buf) - self.off} trailing bytes)")


def _require_cache(cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise ValueError(f"cache must be a kvjax.KVCache (one unified cache: llama.cpp's llama_kv_cache), got "
                         f"{type(cache).__name__}")
    return cache


def _seq_arg(seq_id, cache: KVCache) -> int:
    if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) \
            or not -1 <= seq_id < cache.config.n_seq_max:
        raise ValueError(f"seq_id={seq_id!r} is out of range: allowed -1 (whole cache) or [0, "
                         f"{cache.config.n_seq_max})")
    return int(seq_id)


# -- the memory blob ----------------------------------------------------------------------------


def _split_seed(blob: bytes, seq_id: int) -> Tuple[int, np.ndarray, bytes, bytes]:
    """A seed blob of ours as ``(n, pos, meta bytes, data bytes)`` (its cells are well formed)."""
    n = struct.unpack_from("<I", blob)[0]
    if seq_id >= 0:  # every record is (pos, 0)
        meta = blob[4:4 + 8 * n]
        pos = np.frombuffer(meta, "<i4")[0::2].copy()
    else:            # (pos, k, k ids): walk the records
        off = 4
        pos = np.empty(n, np.int32)
        for i in range(n):
            pos[i], k = struct.unpack_from("<iI", blob, off)
            off += 8 + 4 * k
        meta = blob[4:off]
    return n, pos, meta, blob[4 + len(meta):]


def stream_state_write(cache, seq_id: int = -1) -> bytes:
    """The memory blob of today's llama.cpp (one stream) for the whole cache or one sequence.

    Args:
        cache: a :class:`kvjax.KVCache` without pending shifts (as :func:`kvjax.state_write`).
        seq_id: -1 for the whole cache, else the sequence in ``[0, n_seq_max)``.

    Returns:
        ``u32 n_stream = 1``, ``u32 cell_count``, then (when there are cells) the cells and the
        K/V data; a single-sequence blob's cells name the sequence (see the module docstring).

    Raises:
        ValueError: not a unified cache, or ``seq_id`` out of range.
        kvjax.StateError: what :func:`kvjax.state_write` refuses (a pending shift).
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    n, pos, meta, data = _split_seed(state_write(cache, seq_id), seq_id)
    if n == 0:  # an empty stream is its count alone
        return struct.pack("<II", 1, 0)
    if seq_id >= 0:
        rec = np.empty((n, 3), "<i4")
        rec[:, 0], rec[:, 1], rec[:, 2] = pos, 1, seq_id
        meta = rec.tobytes()
    return struct.pack("<II", 1, n) + meta + data


class _Stream:
    """One stream of a parsed memory blob: its cells (seed-format meta) and its data section."""

    def __init__(self, n: int, pos: np.ndarray, ids: List[np.ndarray], data: memoryview):
        self.n, self.pos, self.ids, self.data = n, pos, ids, data


def _walk_data(r: _Reader, n: int, s: int) -> memoryview:
    """Skip one stream's data section (checking only what its length needs); return its bytes."""
    start = r.off
    v_trans = r.u32(f"stream {s} v_trans")
    n_layer = r.u32(f"stream {s} n_layer")
    for il in range(n_layer):
        r.i32(f"stream {s} layer {il} K type")
        row = r.u64(f"stream {s} layer {il} K row size")
        r.take(row * n, f"stream {s} layer {il} K rows")
    for il in range(n_layer):
        r.i32(f"stream {s} layer {il} V type")
        if v_trans == 1:
            el = r.u32(f"stream {s} layer {il} V element size")
            width = r.u32(f"stream {s} layer {il} V width")
            r.take(el * width * n, f"stream {s} layer {il} V elements")
        else:
            row = r.u64(f"stream {s} layer {il} V row size")
            r.take(row * n, f"stream {s} layer {il} V rows")
    return r.buf[start:r.off]


def _parse_streams(r: _Reader, single: bool, keep_empty: bool = False) -> List[_Stream]:
    """The streams of a memory blob that hold cells (every stream, None for an empty one, with
    ``keep_empty``)."""
    n_stream = r.u32("n_stream")
    if not 1 <= n_stream <= 4096:
        raise StateError(f"n_stream: expected a stream count in [1, 4096], found {n_stream}")
    streams = []
    for s in range(n_stream):
        n = r.u32(f"stream {s} cell_count")
        if n == 0:
            if keep_empty:
                streams.append(None)
            continue
        pos = np.empty(n, np.int32)
        ids = []
        for i in range(n):
            pos[i] = r.i32(f"stream {s} cell {i} pos")
            k = r.u32(f"stream {s} cell {i} n_seq_id")
            if single and k != 1:
                raise StateError(f"stream {s} cell {i} n_seq_id: expected 1 in a single-sequence blob "
                                 f"(today's llama.cpp names the sequence), found {k}")
            if k > 4096:
                raise StateError(f"stream {s} cell {i} n_seq_id: expected at most 4096, found {k}")
            ids.append(np.frombuffer(r.take(4 * k, f"stream {s} cell {i} seq ids"), "<i4"))
        streams.append(_Stream(n, pos, ids, _walk_data(r, n, s)))
    return streams


def _merge_data(streams: List[_Stream]) -> bytes:
    """One data section holding the rows of every stream, in stream order."""
    if len(streams) == 1:
        return bytes(streams[0].data)
    parts, heads = [], None
    layers = []
    for s, st in enumerate(streams):
        r = _Reader(st.data)
        v_trans, n_layer = r.u32("v_trans"), r.u32("n_layer")
        if heads is None:
            heads = (v_trans, n_layer)
        elif heads != (v_trans, n_layer):
            raise StateError(f"stream {s} v_trans, n_layer: expected {heads} as in stream 0, found "
                             f"{(v_trans, n_layer)}")
        ks = []
        for il in range(n_layer):
            t, row = r.i32("K type"), r.u64("K row size")
            ks.append((t, row, bytes(r.take(row * st.n, "K rows"))))
        vs = []
        for il in range(n_layer):
            t = r.i32("V type")
            if v_trans == 1:
                el, width = r.u32("V element size"), r.u32("V width")
                vs.append((t, el, width, np.frombuffer(r.take(el * width * st.n, "V"), np.uint8)
                           .reshape(width, st.n * el)))
            else:
                row = r.u64("V row size")
                vs.append((t, row, bytes(r.take(row * st.n, "V rows"))))
        layers.append((ks, vs))
    v_trans, n_layer = heads
    parts.append(struct.pack("<II", v_trans, n_layer))
    for il in range(n_layer):
        heads_k = {(ks[il][0], ks[il][1]) for ks, _ in layers}
        if len(heads_k) != 1:
            raise StateError(f"layer {il} K type / row size: expected one for every stream, found {sorted(heads_k)}")
        t, row = heads_k.pop()
        parts.append(struct.pack("<iQ", t, row) + b"".join(ks[il][2] for ks, _ in layers))
    for il in range(n_layer):
        if v_trans == 1:
            heads_v = {vs[il][:3] for _, vs in layers}
            if len(heads_v) != 1:
                raise StateError(f"layer {il} V header: expected one for every stream, found {sorted(heads_v)}")
            t, el, width = heads_v.pop()
            # transposed V is [width, n] per stream: the merged rows put each stream's cells side by side
            merged = np.concatenate([vs[il][3] for _, vs in layers], axis=1)
            parts.append(struct.pack("<iII", t, el, width) + merged.tobytes())
        else:
            heads_v = {vs[il][:2] for _, vs in layers}
            if len(heads_v) != 1:
                raise StateError(f"layer {il} V type / row size: expected one for every stream, found {sorted(heads_v)}")
            t, row = heads_v.pop()
            parts.append(struct.pack("<iQ", t, row) + b"".join(vs[il][2] for _, vs in layers))
    return b"".join(parts)


def _to_seed(streams: List[_Stream], seq_id: int, cache: KVCache) -> bytes:
    """The seed blob holding the cells of ``streams`` (for :func:`kvjax.state_read`)."""
    if not streams:
        # no cell at all: the seed's empty blob of this cache's layout
        from kvjax.memory._api import clear
        return state_write(clear(cache), -1)
    if seq_id >= 0:
        if len(streams) > 1:
            raise StateError(f"single-sequence blob: expected cells in one stream, found {len(streams)} streams "
                             f"with cells")
        st = streams[0]
        rec = np.zeros((st.n, 2), "<i4")
        rec[:, 0] = st.pos
        return struct.pack("<I", st.n) + rec.tobytes() + bytes(st.data)
    n = sum(st.n for st in streams)
    meta = []
    for st in streams:
        for p, ids in zip(st.pos, st.ids):
            meta.append(struct.pack("<iI", int(p), len(ids)) + ids.tobytes())
    return struct.pack("<I", n) + b"".join(meta) + _merge_data(streams)


def _read_memory(r: _Reader, cache: KVCache, seq_id: int, options) -> KVCache:
    streams = _parse_streams(r, single=seq_id >= 0)
    return state_read(cache, _to_seed(streams, seq_id, cache), seq_id, **options)


def stream_state_read(cache, data, seq_id: int = -1, **options) -> KVCache:
    """A cache restored from a memory blob of today's llama.cpp (the cache passed in is unchanged).

    Args:
        cache: a :class:`kvjax.KVCache` of the model the blob was written for.
        data: the blob (bytes-like), e.g. ``llama_state_seq_get_data``'s for one sequence.
        seq_id: -1 for a whole-cache blob, else the destination sequence of a one-sequence blob.
        **options: :func:`kvjax.state_read`'s (``contiguous``, ``donate``).

    Returns:
        The restored cache.

    Raises:
        ValueError: not a unified cache, or ``seq_id`` out of range.
        kvjax.StateError: a malformed, truncated or over-long blob, or one that does not fit the
            cache (every check of :func:`kvjax.state_read`); nothing changed.
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    r = _Reader(data)
    out = _read_memory(r, cache, seq_id, options)
    r.finish("blob")
    return out


# -- session and sequence files -------------------------------------------------------------------


@dataclasses.dataclass
class LlamaSession:
    """What a llama.cpp session file holds besides the memory.

    Attributes:
        cache: the restored cache.
        tokens: the prompt tokens the file names (``i32[n]``).
        arch: the model architecture name llama.cpp wrote (``"llama"``, ``"qwen2"``, ...).
        output_rows: ``i32[R]`` the batch rows of the last decode whose logits follow.
        logits: ``f32[R, V]`` (``[0, 0]`` when the file holds none).
        embeddings: ``f32[...]`` flat, as written (usually empty).
    """

    cache: KVCache
    tokens: np.ndarray
    arch: str
    output_rows: np.ndarray
    logits: np.ndarray
    embeddings: np.ndarray


def _tokens_arg(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"tokens has shape {arr.shape} and dtype {arr.dtype}: allowed a 1-d list of integer token ids")
    if arr.size and (arr.min() < -2**31 or arr.max() >= 2**31):
        raise ValueError("tokens contains ids outside int32: allowed llama_token values")
    return arr.astype("<i4")


def _header(r: _Reader, magic: int, version: int, what: str) -> np.ndarray:
    found_magic = r.u32(f"{what} magic")
    if found_magic != magic:
        raise StateError(f"{what} magic: expected {magic:#010x} ({struct.pack('>I', magic).decode()!r}), found "
                         f"{found_magic:#010x}")
    found_version = r.u32(f"{what} version")
    if found_version != version:
        raise StateError(f"{what} version: expected {version} (the layout this reader knows), found {found_version}")
    n = r.u32("n_token_count")
    return np.frombuffer(r.take(4 * n, "tokens"), "<i4").copy()


def _bytes_of(data_or_path) -> bytes:
    if isinstance(data_or_path, (str, os.PathLike)):
        with open(data_or_path, "rb") as f:
            return f.read()
    if isinstance(data_or_path, (bytes, bytearray, memoryview)):
        return data_or_path
    raise ValueError(f"data must be bytes or a file path, got {type(data_or_path).__name__}")


def session_write(cache, tokens: Sequence[int], *, arch: str, logits=None, output_rows=None) -> bytes:
    """A llama.cpp session file (``'ggsn'`` version 9) of the whole cache.

    Args:
        cache: the :class:`kvjax.KVCache`.
        tokens: the prompt tokens to record.
        arch: the model architecture name llama.cpp checks on load (``"llama"``, ``"qwen2"``, ...).
        logits: optional ``f32[R, V]`` logits of the last decode's output rows.
        output_rows: their batch rows (default ``0..R-1``).

    Returns:
        The file's bytes.
    """
    cache = _require_cache(cache)
    toks = _tokens_arg(tokens)
    if not isinstance(arch, str) or not arch:
        raise ValueError(f"arch={arch!r} is out of range: allowed a non-empty architecture name such as 'llama'")
    lg = np.zeros((0, 0), "<f4") if logits is None else np.asarray(logits, "<f4")
    if lg.ndim != 2:
        raise ValueError(f"logits has shape {lg.shape}: allowed [R, V]")
    rows = np.arange(lg.shape[0], dtype="<i4") if output_rows is None else np.asarray(output_rows, "<i4")
    if rows.shape != (lg.shape[0],):
        raise ValueError(f"output_rows has shape {rows.shape}: allowed ({lg.shape[0]},), one per logits row")
    name = arch.encode()
    head = struct.pack("<III", SESSION_MAGIC, SESSION_VERSION, len(toks)) + toks.tobytes()
    ctx = (struct.pack("<I", len(name)) + name + struct.pack("<i", len(rows)) + rows.tobytes()
           + struct.pack("<Q", lg.size) + lg.tobytes() + struct.pack("<Q", 0))
    return head + ctx + stream_state_write(cache)


def session_read(cache, data, **options) -> LlamaSession:
    """Read a llama.cpp session file (``'ggsn'`` version 9) into ``cache``'s layout.

    Args:
        cache: a :class:`kvjax.KVCache` of the model (unchanged; the result holds the new one).
        data: the file's bytes or its path.
        **options: :func:`kvjax.state_read`'s.

    Returns:
        A :class:`LlamaSession`.

    Raises:
        kvjax.StateError: another magic or version, a truncated or over-long file, or a memory
            blob that does not fit the cache.
    """
    cache = _require_cache(cache)
    r = _Reader(_bytes_of(data))
    tokens = _header(r, SESSION_MAGIC, SESSION_VERSION, "session file")
    n_name = r.u32("arch name length")
    if n_name > 256:
        raise StateError(f"arch name length: expected at most 256, found {n_name}")
    arch = bytes(r.take(n_name, "arch name")).decode("utf-8", "replace")
    n_out = r.i32("n_outputs")
    if n_out < 0:
        raise StateError(f"n_outputs: expected >= 0, found {n_out}")
    rows = np.frombuffer(r.take(4 * n_out, "output ids"), "<i4").copy()
    n_logits = r.u64("logits size")
    logits = np.frombuffer(r.take(4 * n_logits, "logits"), "<f4").copy()
    if n_out and n_logits % n_out:
        raise StateError(f"logits size: expected a multiple of n_outputs={n_out}, found {n_logits}")
    logits = logits.reshape(n_out, -1) if n_out else logits.reshape(0, 0)
    n_embd = r.u64("embeddings size")
    embd = np.frombuffer(r.take(4 * n_embd, "embeddings"), "<f4").copy()
    restored = _read_memory(r, cache, -1, options)
    r.finish("session file")
    return LlamaSession(restored, tokens, arch, rows, logits, embd)


def seq_file_write(cache, seq_id: int, tokens: Sequence[int]) -> bytes:
    """A llama.cpp sequence file (``'ggsq'`` version 2) of one sequence.

    Returns:
        The file's bytes (``llama_state_seq_load_file`` reads them).
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    if seq_id < 0:
        raise ValueError("seq_id=-1 is out of range for a sequence file: allowed [0, n_seq_max)")
    toks = _tokens_arg(tokens)
    return struct.pack("<III", SEQ_MAGIC, SEQ_VERSION, len(toks)) + toks.tobytes() + stream_state_write(cache, seq_id)


def seq_file_read(cache, data, seq_id: int, **options) -> Tuple[KVCache, np.ndarray]:
    """Read a llama.cpp sequence file (``'ggsq'`` version 2) into sequence ``seq_id``.

    Returns:
        ``(cache, tokens)``: the restored cache (the one passed in is unchanged) and the file's tokens.

    Raises:
        ValueError: ``seq_id`` out of range.
        kvjax.StateError: another magic or version, a truncated or over-long file, or cells that
            do not fit.
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    if seq_id < 0:
        raise ValueError("seq_id=-1 is out of range for a sequence file: allowed [0, n_seq_max)")
    r = _Reader(_bytes_of(data))
    tokens = _header(r, SEQ_MAGIC, SEQ_VERSION, "sequence file")
    out = _read_memory(r, cache, seq_id, options)
    r.finish("sequence file")
    return out, tokens
