"""llama.cpp's stream section: one unified cache's cells and K/V as today's llama.cpp writes them.

Today's llama.cpp writes a memory as ``u32 n_stream`` and one section per stream; a unified cache
is one stream. A section is the seed's blob (:mod:`kvjax.io._state`) with every cell naming its
sequence ids (``n_seq_id >= 1`` even in a one-sequence section, where the seed writes 0)::

    u32 cell_count, cell_count x {i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id}, K/V data

This module parses sections into :class:`Stream` records (views into the bytes, nothing copied),
converts them to the seed's blob and back, and is shared by llama.cpp's session files
(:mod:`kvjax.io._llama_state`), the stream memory's format (:mod:`kvjax.io._streams_state`) and the
rotation of quantized rows (:mod:`kvjax.io._attn_rot`).
"""

from __future__ import annotations

import struct
from typing import List, Tuple

import numpy as np

from kvjax._errors import StateError
from kvjax.io._blob import Cursor
from kvjax.io._state import state_write
from kvjax.memory._unified import KVCache
from kvjax.memory._api import clear


def split_seed(blob: bytes, seq_id: int) -> Tuple[int, np.ndarray, bytes, bytes]:
    """A seed blob of ours as ``(n, pos, meta bytes, data bytes)`` (its cells are well formed)."""
    n = struct.unpack_from("<I", blob)[0]
    if seq_id >= 0:  # every record is (pos, 0)
        meta = blob[4 : 4 + 8 * n]
        pos = np.frombuffer(meta, "<i4")[0::2].copy()
    else:  # (pos, k, k ids): walk the records
        off = 4
        pos = np.empty(n, np.int32)
        for i in range(n):
            pos[i], k = struct.unpack_from("<iI", blob, off)
            off += 8 + 4 * k
        meta = blob[4:off]
    return n, pos, meta, blob[4 + len(meta) :]


def stream_blob(cache: KVCache, seq_id: int) -> bytes:
    """The one-stream blob of ``cache``'s bytes as kvjax stores them (no rotation)."""
    n, pos, meta, data = split_seed(state_write(cache, seq_id), seq_id)
    if n == 0:  # an empty stream is its count alone
        return struct.pack("<II", 1, 0)
    if seq_id >= 0:
        rec = np.empty((n, 3), "<i4")
        rec[:, 0], rec[:, 1], rec[:, 2] = pos, 1, seq_id
        meta = rec.tobytes()
    return struct.pack("<II", 1, n) + meta + data


class Stream:
    """One stream of a parsed memory blob: its cells, its data section and where that starts in the blob."""

    def __init__(self, n: int, pos: np.ndarray, ids: List[np.ndarray], data: memoryview, offset: int = 0):
        self.n, self.pos, self.ids, self.data, self.offset = n, pos, ids, data, offset


def walk_data(r: Cursor, n: int, s: int, has_v: bool = True) -> memoryview:
    """Skip one stream's data section (checking only what its length needs); return its bytes.

    ``has_v=False``: a latent (MLA) cache's section, K rows only (llama.cpp writes no V section
    for a cache without V storage).
    """
    start = r.off
    v_trans = r.u32(f"stream {s} v_trans")
    n_layer = r.u32(f"stream {s} n_layer")
    for il in range(n_layer):
        r.i32(f"stream {s} layer {il} K type")
        row = r.u64(f"stream {s} layer {il} K row size")
        r.take(row * n, f"stream {s} layer {il} K rows")
    for il in range(n_layer if has_v else 0):
        r.i32(f"stream {s} layer {il} V type")
        if v_trans == 1:
            el = r.u32(f"stream {s} layer {il} V element size")
            width = r.u32(f"stream {s} layer {il} V width")
            r.take(el * width * n, f"stream {s} layer {il} V elements")
        else:
            row = r.u64(f"stream {s} layer {il} V row size")
            r.take(row * n, f"stream {s} layer {il} V rows")
    return r.buf[start : r.off]


def parse_streams(r: Cursor, single: bool, keep_empty: bool = False, has_v: bool = True) -> List[Stream]:
    """The streams of a memory blob that hold cells (every stream, None for an empty one, with
    ``keep_empty``); ``has_v`` as :func:`walk_data`'s."""
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
                raise StateError(
                    f"stream {s} cell {i} n_seq_id: expected 1 in a single-sequence blob "
                    f"(today's llama.cpp names the sequence), found {k}"
                )
            if k > 4096:
                raise StateError(f"stream {s} cell {i} n_seq_id: expected at most 4096, found {k}")
            ids.append(np.frombuffer(r.take(4 * k, f"stream {s} cell {i} seq ids"), "<i4"))
        start = r.off
        streams.append(Stream(n, pos, ids, walk_data(r, n, s, has_v), start))
    return streams


def merge_data(streams: List[Stream], has_v: bool = True) -> bytes:
    """One data section holding the rows of every stream, in stream order (``has_v`` as :func:`walk_data`'s)."""
    if len(streams) == 1:
        return bytes(streams[0].data)
    parts, heads = [], None
    layers = []
    for s, st in enumerate(streams):
        r = Cursor(st.data)
        v_trans, n_layer = r.u32("v_trans"), r.u32("n_layer")
        if heads is None:
            heads = (v_trans, n_layer)
        elif heads != (v_trans, n_layer):
            raise StateError(
                f"stream {s} v_trans, n_layer: expected {heads} as in stream 0, found {(v_trans, n_layer)}"
            )
        ks = []
        for il in range(n_layer):
            t, row = r.i32("K type"), r.u64("K row size")
            ks.append((t, row, bytes(r.take(row * st.n, "K rows"))))
        vs = []
        for il in range(n_layer if has_v else 0):
            t = r.i32("V type")
            if v_trans == 1:
                el, width = r.u32("V element size"), r.u32("V width")
                vs.append(
                    (t, el, width, np.frombuffer(r.take(el * width * st.n, "V"), np.uint8).reshape(width, st.n * el))
                )
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
                raise StateError(
                    f"layer {il} V type / row size: expected one for every stream, found {sorted(heads_v)}"
                )
            t, row = heads_v.pop()
            parts.append(struct.pack("<iQ", t, row) + b"".join(vs[il][2] for _, vs in layers))
    return b"".join(parts)


def to_seed(streams: List[Stream], seq_id: int, cache: KVCache) -> bytes:
    """The seed blob holding the cells of ``streams`` (for :func:`kvjax.state_read`)."""
    if not streams:
        # no cell at all: the seed's empty blob of this cache's layout
        return state_write(clear(cache), -1)
    if seq_id >= 0:
        if len(streams) > 1:
            raise StateError(
                f"single-sequence blob: expected cells in one stream, found {len(streams)} streams with cells"
            )
        st = streams[0]
        rec = np.zeros((st.n, 2), "<i4")
        rec[:, 0] = st.pos
        return struct.pack("<I", st.n) + rec.tobytes() + bytes(st.data)
    n = sum(st.n for st in streams)
    meta = []
    for st in streams:
        for p, ids in zip(st.pos, st.ids):
            meta.append(struct.pack("<iI", int(p), len(ids)) + ids.tobytes())
    return struct.pack("<I", n) + b"".join(meta) + merge_data(streams, not cache.config.mla)
