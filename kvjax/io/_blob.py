"""The byte-level pieces every kvjax state format shares (an internal API of :mod:`kvjax.io`).

One cursor over a blob's bytes (:class:`Cursor`: a short read or trailing bytes raise
:class:`kvjax.StateError` naming the field), the seed's cell records (positions and sequence ids,
written and parsed), the ggml type checks of K/V rows, and :func:`host_array` (an array's bytes on
this host, gathered from other processes when it is split over them). The unified cache's format
(:mod:`kvjax.io._state`), the recurrent one and llama.cpp's session files use these, and nothing
of each other's.
"""

from __future__ import annotations

import struct
from typing import Optional, Tuple

import jax
import numpy as np

from kvjax._errors import StateError
from kvjax._validate import POS_END
from kvjax.memory import _seqbits as seqbits
from kvjax.memory._config import GGML_TYPE_IDS
from jax.experimental import multihost_utils

__all__ = [
    "QUANTIZED_TYPE_IDS",
    "Cursor",
    "as_view",
    "check_type",
    "check_equal",
    "check_positions",
    "parse_meta_seq",
    "parse_meta_whole",
    "encode_meta",
    "host_array",
]


#: ggml type ids of the block types llama.cpp accepts for K/V (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
#: IQ4_NL): a blob of one is read by a cache of that storage type (IQ4_NL is not a kvjax storage
#: type), and named in the message when the cache's type differs.
QUANTIZED_TYPE_IDS = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 20: "IQ4_NL"}

_GGML_NAMES = {0: "F32", 1: "F16", 30: "BF16", **QUANTIZED_TYPE_IDS}


class Cursor:
    """Reads fields off a byte view; a short read raises :class:`StateError` naming the field."""

    def __init__(self, data):
        self.buf = as_view(data)
        self.off = 0

    @property
    def left(self) -> int:
        return len(self.buf) - self.off

    def take(self, nbytes: int, field: str) -> memoryview:
        if nbytes < 0 or nbytes > self.left:
            raise StateError(
                f"{field}: expected {nbytes} bytes at offset {self.off}, found {self.left} (truncated blob)"
            )
        view = self.buf[self.off : self.off + nbytes]
        self.off += nbytes
        return view

    def scalar(self, fmt: str, field: str) -> int:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), field))[0]

    def u32(self, field: str) -> int:
        return self.scalar("<I", field)

    def i32(self, field: str) -> int:
        return self.scalar("<i", field)

    def u64(self, field: str) -> int:
        return self.scalar("<Q", field)

    def array(self, dtype: np.dtype, count: int, field: str) -> np.ndarray:
        return np.frombuffer(self.take(count * dtype.itemsize, field), dtype)

    def words(self) -> Tuple[np.ndarray, memoryview]:
        """Every whole i32 word left, as numpy and as a memoryview (neither advances)."""
        n = self.left // 4
        view = self.buf[self.off : self.off + 4 * n]
        return np.frombuffer(view, "<i4"), view.cast("i")

    def finish(self, what: str = "blob") -> None:
        if self.left:
            raise StateError(
                f"{what} length: expected {self.off} bytes, found {len(self.buf)} ({self.left} trailing bytes)"
            )


def _type_name(type_id: int) -> str:
    return _GGML_NAMES.get(type_id, "unknown ggml type")


def check_type(field: str, expected: int, found: int) -> None:
    if found == expected:
        return
    msg = f"{field}: expected {expected} ({_type_name(expected)}), found {found} ({_type_name(found)})"
    names = {i: n for n, i in GGML_TYPE_IDS.items()}
    if found in QUANTIZED_TYPE_IDS:
        fix = (
            f"make the cache with that {field.split()[-2].lower()}_dtype={names[found]!r}"
            if found in names
            else "kvjax has no storage of that type"
        )
        msg += f": quantized K/V state is not supported by a cache of another storage type ({fix})"
    elif expected in QUANTIZED_TYPE_IDS:
        msg += ": the cache stores block-quantized K/V and the blob does not (make the cache with its float dtype)"
    raise StateError(msg)


def check_equal(field: str, expected: int, found: int, why: str = "") -> None:
    if found != expected:
        raise StateError(f"{field}: expected {expected}{why}, found {found}")


def parse_meta_seq(cur: Cursor, n: int) -> np.ndarray:
    """Cells of a single-sequence blob: ``n`` records of (pos, n_seq_id = 0)."""
    words, _ = cur.words()
    have = min(2 * n, words.size)
    counts = words[1:have:2]
    named = np.flatnonzero(counts)
    if named.size:  # the records before it are all two words, so its index is exact
        i = int(named[0])
        raise StateError(
            f"cell {i} n_seq_id: expected 0 (a single-sequence blob names no "
            f"sequence), found {int(counts[i]) & 0xFFFFFFFF}; a whole-cache blob is "
            f"read with seq_id=-1"
        )
    words = cur.array(np.dtype("<i4"), 2 * n, f"cell metadata of {n} cells")
    pos = words[0::2]
    check_positions(pos)
    return pos


def check_positions(pos: np.ndarray) -> None:
    bad = np.flatnonzero((pos < 0) | (pos >= POS_END))
    if bad.size:
        i = int(bad[0])
        raise StateError(
            f"cell {i} pos: expected in [0, {POS_END}) (2**31 - 1 is the seed's 'to infinity'), found {int(pos[i])}"
        )


def _record_offsets(cur: Cursor, n: int, n_seq_max: int) -> np.ndarray:
    """Word offset of each cell record of a whole-cache blob (records have variable length)."""
    words, ints = cur.words()
    if words.size >= 2:
        k0 = int(words[1])
        r = 2 + k0
        # fast path: every cell has the same number of sequences (the common case)
        if 1 <= k0 <= n_seq_max and n * r <= words.size and np.all(words[1 : n * r : r] == k0):
            return np.arange(n, dtype=np.int64) * r
    # general case: one cheap step per cell over the metadata words (about 16 ms at 32768 cells
    # on the 2-core CPU this was written on); K/V bytes are never looped over
    offsets = [0] * n
    off, m = 0, words.size
    for i in range(n):
        if off + 2 > m:
            raise StateError(
                f"cell {i} pos and n_seq_id: expected 8 bytes at offset "
                f"{cur.off + 4 * off}, found {cur.left - 4 * off} (truncated blob)"
            )
        k = ints[off + 1]
        if not 1 <= k <= n_seq_max:
            raise StateError(
                f"cell {i} n_seq_id: expected 1 to n_seq_max={n_seq_max} (every cell of "
                f"a whole-cache blob names its sequences), found {k & 0xFFFFFFFF}"
                + ("; a single-sequence blob is read with seq_id >= 0" if k == 0 else "")
            )
        offsets[i] = off
        off += 2 + k
    if off > m:
        raise StateError(
            f"cell {n - 1} seq ids: expected {4 * (off - offsets[-1] - 2)} bytes, found "
            f"{cur.left - 4 * (offsets[-1] + 2)} (truncated blob)"
        )
    return np.asarray(offsets, np.int64)


def parse_meta_whole(cur: Cursor, n: int, n_seq_max: int, n_words: int):
    """Cells of a whole-cache blob: positions ``i32[n]`` and sequence bitmasks ``u32[n, W]``."""
    if n == 0:
        return np.zeros(0, np.int32), np.zeros((0, n_words), np.uint32)
    offsets = _record_offsets(cur, n, n_seq_max)
    words, _ = cur.words()
    pos = words[offsets]
    counts = words[offsets + 1].astype(np.int64)
    check_positions(pos)
    total = int(counts.sum())
    cell = np.repeat(np.arange(n), counts)
    first = np.cumsum(counts) - counts
    ids = words[np.repeat(offsets + 2 - first, counts) + np.arange(total)]
    bad = np.flatnonzero((ids < 0) | (ids >= n_seq_max))
    if bad.size:
        j = int(bad[0])
        raise StateError(f"cell {int(cell[j])} seq id: expected [0, n_seq_max={n_seq_max}), found {int(ids[j])}")
    masks = seqbits.host_pack(cell, ids, n, n_words)
    distinct = np.unpackbits(masks.view(np.uint8), axis=1).sum(axis=1)  # popcount, numpy 1.x too
    dup = np.flatnonzero(distinct != counts)
    if dup.size:
        i = int(dup[0])
        raise StateError(
            f"cell {i} seq ids: expected {int(counts[i])} distinct ids, found {sorted(ids[cell == i].tolist())}"
        )
    cur.take(4 * int(offsets[-1] + 2 + counts[-1]), "cell metadata")
    return pos, masks


def encode_meta(pos: np.ndarray, masks: Optional[np.ndarray], n_seq_max: int) -> bytes:
    """Cell records for ``pos i32[n]`` and ``masks u32[n, W]`` (None: single-sequence records)."""
    n = pos.shape[0]
    if masks is None:
        out = np.zeros((n, 2), "<i4")
        out[:, 0] = pos
        return out.tobytes()
    if n == 0:
        return b""
    bits = seqbits.unpack(masks, n_seq_max)
    cell, ids = np.nonzero(bits)  # row-major: ids ascending within a cell, as std::set iterates
    counts = bits.sum(axis=1, dtype=np.int64)
    length = 2 + counts
    start = np.cumsum(length) - length
    out = np.empty(int(length.sum()), "<i4")
    out[start] = pos
    out[start + 1] = counts
    first = np.cumsum(counts) - counts
    out[start[cell] + 2 + np.arange(ids.size) - first[cell]] = ids
    return out.tobytes()


def host_array(x) -> np.ndarray:
    """``x`` as a numpy array, gathered from every process when it spans other processes' devices.

    In a multi-process job a memory's K/V are split over every host's devices, and no process can
    read the others' shards directly: every process gathers the whole array (a collective: all of
    them call this in the same order, as they run every kvjax program), so every host writes the
    same blob. On one process it is ``np.asarray`` (a view of the device buffer on the CPU backend).
    """
    if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def as_view(data) -> memoryview:
    try:
        view = memoryview(data)
    except TypeError:
        raise StateError(f"data: expected a bytes-like object, found {type(data).__name__}") from None
    if not view.c_contiguous:
        # a strided numpy view of a buffer (a[::2]): its bytes in order, once (a cast needs contiguity)
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
