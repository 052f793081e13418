"""Today's llama.cpp state layout: the stream-count memory blob, session files and sequence files.

The seed's memory blob (:mod:`kvjax.io._state`) is ``cell_count, cells, data``. llama.cpp after
its per-sequence streams (``llama_kv_cache`` with ``n_stream``, 2025) writes, little-endian::

    u32 n_stream                         # 1 with a unified cache (kv_unified), else n_seq_max
    per stream:
        u32 cell_count n                 # 0: nothing else for this stream
        n x { i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id }
        data                             # v_trans, n_layer, K rows, V rows: the seed's, unchanged

with one difference in the cells of a **single-sequence** blob: each names its sequence
(``n_seq_id = 1`` and the id) where the seed wrote ``n_seq_id = 0``.

**The memory section** (``llama_memory_i::state_write``) is that blob for a unified cache, the
base cache's blob then the window cache's for the iSWA pair (``llama_kv_cache_iswa``: Gemma 2/3),
and the streams of a :class:`kvjax.StreamCache`. llama.cpp's iSWA window cache keeps masked cells
until they are overwritten (kvjax frees them at commit): a whole-memory file of llama.cpp's may hold
more window cells than kvjax's of the same tokens; both read either. llama.cpp's one-sequence
section of the window cache leaves out the cells the sequence's last token can no longer see
(kvjax's window cache has freed them already).

**V layout.** ``v_trans = 1`` (V transposed) is what llama.cpp writes and reads without flash
attention, ``0`` with it; llama.cpp refuses a file of the other layout. kvjax stores K/V the same
way either way, so it reads both and writes either (``v_trans=`` of the writers; default the
memory's ``config.v_trans``).

Around the memory section:

- a **session file** (``llama_state_save_file``; magic ``'ggsn'`` = ``0x6767736e``)::

      u32 magic, u32 version, u32 n_tokens, n_tokens x i32 token,
      u32 len, len bytes arch name,              # "llama", "gemma3", ...
      version 9 only:
          i32 n_outputs, n_outputs x i32 batch row,  # the rows whose logits follow (output ids)
          u64 n_logits, n_logits x f32,               # n_outputs x n_vocab
          u64 n_embd, n_embd x f32,                   # embeddings (0 unless asked for)
      memory section (whole memory)

  Version 10 (today's llama.cpp) no longer saves the output buffers: a program continuing from it
  evaluates the last token again (``seq_rm`` of its position, then decode it), as llama.cpp's own
  tools do; kvjax's :class:`kvjax.PromptCache` does the same with a session parked in it.

- a **sequence file** (``llama_state_seq_save_file``; magic ``'ggsq'`` = ``0x67677371``)::

      u32 magic, u32 version, u32 n_tokens, n_tokens x i32 token, memory section (one sequence)

  Version 3 adds a per-cell record (2-D position, token) after each cell's sequence count only
  for models with M-RoPE or per-layer token embeddings, none of which kvjax runs: for every other
  model its bytes are version 2's but for the version field.

Versions read and written: sessions 9 and 10 (default 10), sequence files 2 and 3 (default 3);
llama.cpp reads only its own version, so write the one of the llama.cpp that will read the file
(``llama.h``'s ``LLAMA_SESSION_VERSION`` / ``LLAMA_STATE_SEQ_VERSION``). The memory section is
converted to the seed's blob and read by :func:`kvjax.state_read`, so every K/V check of that
reader applies (layer count, head sizes as row sizes, K/V types), and a failed read leaves the
memory as it was. What llama.cpp writes besides the memory is kept: the tokens, the architecture
name (checked when ``arch=`` is given), and version 9's output rows, logits and embeddings.

A kvjax unified cache is one stream. Reading a blob of ``n_stream > 1`` (llama.cpp without
``kv_unified``) into it: a single-sequence blob has at most one stream with cells and is read from
it; a whole-cache blob's streams hold disjoint sequences and are merged into the one cache (cell
order: stream 0's cells, then stream 1's, ...). Where kvjax differs from llama.cpp: a blob without
any cell empties the cache (whole) or removes the sequence (one sequence), where llama.cpp leaves
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
from kvjax._validate import require, check_state_seq
from kvjax.io._attn_rot import rotate_section, rotate_streams
from kvjax.io._blob import Cursor
from kvjax.io._session import write_atomic
from kvjax.io._stream_section import parse_streams, Stream, stream_blob, to_seed
from kvjax.io._streams_state import read_streams, write_streams
from kvjax.io._state import state_read
from kvjax.memory._iswa import IswaCache
from kvjax.memory._streams import StreamCache
from kvjax.memory._unified import KVCache

__all__ = [
    "stream_state_write",
    "stream_state_read",
    "memory_state_write",
    "memory_state_read",
    "session_write",
    "session_read",
    "seq_file_write",
    "seq_file_read",
    "session_save_file",
    "seq_save_file",
    "LlamaSession",
    "SESSION_MAGIC",
    "SESSION_VERSION",
    "SESSION_VERSIONS",
    "SEQ_MAGIC",
    "SEQ_VERSION",
    "SEQ_VERSIONS",
]

SESSION_MAGIC = 0x6767736E  # 'ggsn'
SESSION_VERSION = 10  # what is written by default: today's llama.cpp
SESSION_VERSIONS = (9, 10)  # what is read and can be written
SEQ_MAGIC = 0x67677371  # 'ggsq'
SEQ_VERSION = 3
SEQ_VERSIONS = (2, 3)


def _require_cache(cache) -> KVCache:
    if not isinstance(cache, KVCache):
        raise ValueError(
            f"cache must be a kvjax.KVCache (one unified cache: llama.cpp's llama_kv_cache), got {type(cache).__name__}"
        )
    return cache


def _seq_arg(seq_id, memory) -> int:
    return check_state_seq(seq_id, memory.n_seq_max)


# -- the memory blob ----------------------------------------------------------------------------


def _attn_rot_arg(attn_rot) -> bool:
    require(
        isinstance(attn_rot, (bool, np.bool_)),
        "attn_rot",
        attn_rot,
        "True (llama.cpp's rotated quantized K/V: its default) or False (bytes as they are: LLAMA_ATTN_ROT_DISABLE=1)",
    )
    return bool(attn_rot)


def stream_state_write(cache, seq_id: int = -1, *, attn_rot: bool = True) -> bytes:
    """The memory blob of today's llama.cpp (one stream) for the whole cache or one sequence.

    Args:
        cache: a :class:`kvjax.KVCache` without pending shifts (as :func:`kvjax.state_write`).
        seq_id: -1 for the whole cache, else the sequence in ``[0, n_seq_max)``.
        attn_rot: write block-quantized K/V in llama.cpp's rotated basis where it rotates
            (:mod:`kvjax.io._attn_rot`); False: kvjax's bytes as they are.

    Returns:
        ``u32 n_stream = 1``, ``u32 cell_count``, then (when there are cells) the cells and the
        K/V data; a single-sequence blob's cells name the sequence (see the module docstring).

    Raises:
        ValueError: not a unified cache, or ``seq_id`` out of range.
        kvjax.StateError: what :func:`kvjax.state_write` refuses (a pending shift).
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    blob = stream_blob(cache, seq_id)
    return rotate_section(blob, cache.config) if _attn_rot_arg(attn_rot) else blob


def stream_state_read(cache, data, seq_id: int = -1, **options) -> KVCache:
    """A cache restored from a memory blob of today's llama.cpp (the cache passed in is unchanged).

    Args:
        cache: a :class:`kvjax.KVCache` of the model the blob was written for.
        data: the blob (bytes-like), e.g. ``llama_state_seq_get_data``'s for one sequence.
        seq_id: -1 for a whole-cache blob, else the destination sequence of a one-sequence blob.
        **options: :func:`kvjax.state_read`'s (``contiguous``, ``donate``), and ``attn_rot``
            (default True: block-quantized K/V in llama.cpp's rotated basis are rotated back; see
            :mod:`kvjax.io._attn_rot`).

    Returns:
        The restored cache.

    Raises:
        ValueError: not a unified cache, or ``seq_id`` out of range.
        kvjax.StateError: a malformed, truncated or over-long blob, or one that does not fit the
            cache (every check of :func:`kvjax.state_read`); nothing changed.
    """
    cache = _require_cache(cache)
    seq_id = _seq_arg(seq_id, cache)
    attn_rot = _attn_rot_arg(options.pop("attn_rot", True))
    r = Cursor(data)
    out = _read_unified_part(cache, r, seq_id, "", attn_rot)(options)
    r.finish("blob")
    return out


# -- the memories llama.cpp writes as K/V cells ---------------------------------------------------


def _require_kv_memory(memory):
    """The memory, if llama.cpp writes its state as K/V cells (a unified cache, the iSWA pair, streams)."""
    if not isinstance(memory, (KVCache, IswaCache, StreamCache)):
        raise ValueError(
            f"memory must be a kvjax.KVCache, IswaCache or StreamCache (the memories llama.cpp saves "
            f"as K/V cells: llama_kv_cache, llama_kv_cache_iswa), got {type(memory).__name__}"
        )
    return memory


def _unified_parts(memory) -> List[KVCache]:
    """The unified caches of a memory in llama.cpp's write order (the iSWA pair: base, then window)."""
    return [memory.base, memory.swa] if isinstance(memory, IswaCache) else [memory]


def _with_v_trans(memory, v_trans, like=None):
    """``memory`` whose state format stores V transposed (``v_trans``) or as rows.

    kvjax stores K/V the same way either way: the flag only chooses the layout of the state bytes,
    so a file of either layout is read, and either layout written, by changing the flag alone.
    ``like``: put back the configs of that memory (after a read with another flag).
    """
    if v_trans is None and like is None:
        return memory

    def one(cache: KVCache, old: KVCache = None) -> KVCache:
        cfg = old.config if old is not None else cache.config
        if old is None and cfg.v_trans != v_trans:
            cfg = dataclasses.replace(cfg, v_trans=bool(v_trans))
        return cache if cfg is cache.config else cache.replace(config=cfg)

    if isinstance(memory, IswaCache):
        return memory.replace(
            base=one(memory.base, None if like is None else like.base),
            swa=one(memory.swa, None if like is None else like.swa),
        )
    if isinstance(memory, StreamCache):
        inner = one(memory.cache, None if like is None else like.cache)
        return memory.replace(
            cache=inner,
            config=like.config if like is not None else dataclasses.replace(memory.config, base=inner.config),
        )
    return one(memory, like)


def _v_trans_arg(v_trans):
    require(
        v_trans is None or isinstance(v_trans, (bool, np.bool_)),
        "v_trans",
        v_trans,
        "None (the memory's "
        "config.v_trans), True (V transposed: llama.cpp without flash attention) or False (V rows: with flash "
        "attention)",
    )
    return None if v_trans is None else bool(v_trans)


def memory_state_write(memory, seq_id: int = -1, *, v_trans=None, attn_rot: bool = True) -> bytes:
    """The memory section of today's llama.cpp state (``llama_memory_i::state_write``).

    Args:
        memory: a :class:`kvjax.KVCache` (one stream), :class:`kvjax.IswaCache` (the base cache's
            section, then the window cache's, as ``llama_kv_cache_iswa`` writes them) or
            :class:`kvjax.StreamCache` (its streams), without pending work.
        seq_id: -1 for the whole memory, else one sequence.
        v_trans: the V layout of the bytes: None (the memory's ``config.v_trans``), True
            (transposed: what llama.cpp reads without flash attention) or False (rows: with it).
        attn_rot: block-quantized K/V in llama.cpp's rotated basis where it rotates them (its
            default; :mod:`kvjax.io._attn_rot`), or False for kvjax's bytes as they are (a llama.cpp
            run with ``LLAMA_ATTN_ROT_DISABLE=1``).

    Returns:
        The bytes (``llama_state_get_data`` writes the architecture name before them).

    Raises:
        ValueError: another kind of memory, ``seq_id`` out of range, or ``v_trans=True`` with a
            block-quantized V.
        kvjax.StateError: a pending K-shift or stream copy (apply :func:`kvjax.update` first).
    """
    memory = _with_v_trans(_require_kv_memory(memory), _v_trans_arg(v_trans))
    attn_rot = _attn_rot_arg(attn_rot)
    if isinstance(memory, StreamCache):
        blob = write_streams(memory, seq_id)
        return rotate_section(blob, memory.config.base) if attn_rot else blob
    parts = _unified_parts(memory)
    if len(parts) == 2 and seq_id >= 0:
        # llama.cpp leaves out of one sequence's window section the cells its last token no longer
        # sees (a whole-memory section keeps them): the same bytes as llama.cpp, read back or not
        last = int(parts[1].seq_pos_max(np.int32(seq_id)))
        if last >= 0:
            parts[1], _ = parts[1].seq_rm(
                np.int32(seq_id), np.int32(0), np.int32(max(0, memory.config.first_visible(last)))
            )
    return b"".join(stream_state_write(part, seq_id, attn_rot=attn_rot) for part in parts)


def _blob_v_trans(streams: List[Stream]):
    """The ``v_trans`` flag of the first stream with cells (None: no cells)."""
    return struct.unpack_from("<I", streams[0].data)[0] if streams else None


def _read_unified_part(part: KVCache, r: Cursor, seq_id: int, label: str, attn_rot: bool):
    """Parse one unified cache's section; return a function that restores it (nothing is read yet)."""
    try:
        streams = parse_streams(r, single=seq_id >= 0, has_v=not part.config.mla)
    except StateError as e:
        raise StateError(f"{label}{e}") from None
    if attn_rot:
        rotate_streams(streams, part.config)
    flag = _blob_v_trans(streams)
    if flag is not None and flag not in (0, 1):
        raise StateError(f"{label}v_trans: expected 0 or 1, found {flag}")
    try:
        as_file = _with_v_trans(part, None if flag is None else bool(flag))
    except ValueError as e:
        raise StateError(f"{label}v_trans: found {flag}, which this memory cannot take ({e})") from None

    def restore(options):
        try:
            out = state_read(as_file, to_seed(streams, seq_id, as_file), seq_id, **options)
        except StateError as e:
            raise StateError(f"{label}{e}") from None
        return _with_v_trans(out, None, like=part)

    return restore


def _read_memory_section(memory, r: Cursor, seq_id: int, options):
    """Read a memory section off ``r`` (every part is parsed and checked before any is kept)."""
    options = dict(options)
    attn_rot = _attn_rot_arg(options.pop("attn_rot", True))
    if isinstance(memory, StreamCache):
        rest = bytes(r.take(len(r.buf) - r.off, "memory"))
        if attn_rot:
            rest = rotate_section(rest, memory.config.base)
        streams = parse_streams(Cursor(rest), single=seq_id >= 0, has_v=not memory.config.base.mla)
        flag = _blob_v_trans(streams)
        out = read_streams(
            _with_v_trans(memory, None if flag is None else bool(flag)),
            rest,
            seq_id,
            **{k: v for k, v in options.items() if k == "contiguous"},
        )
        return _with_v_trans(out, None, like=memory)
    if isinstance(memory, IswaCache):
        base = _read_unified_part(memory.base, r, seq_id, "base cache (full layers): ", attn_rot)
        swa = _read_unified_part(memory.swa, r, seq_id, "window cache (sliding-window layers): ", attn_rot)
        # nothing may be donated: the base is read before the window part is known to fit
        options = {k: v for k, v in options.items() if k != "donate"}
        return memory.replace(base=base(options), swa=swa(options))
    return _read_unified_part(memory, r, seq_id, "", attn_rot)(options)


def memory_state_read(memory, data, seq_id: int = -1, **options):
    """A memory restored from :func:`memory_state_write`'s bytes (or llama.cpp's); ``memory`` is unchanged.

    A section of either V layout is read (see :func:`memory_state_write`); a one-sequence section
    goes into sequence ``seq_id``, whatever sequence it was written for.

    Raises:
        ValueError: another kind of memory, or ``seq_id`` out of range.
        kvjax.StateError: a malformed section, or one of another model (layer count, head sizes,
            K/V types, more cells than the memory has); nothing changed.
    """
    memory = _require_kv_memory(memory)
    _seq_arg(seq_id, memory)
    r = Cursor(data)
    out = _read_memory_section(memory, r, int(seq_id), options)
    r.finish("memory section")
    return out


# -- session and sequence files -------------------------------------------------------------------


@dataclasses.dataclass
class LlamaSession:
    """What a llama.cpp session file holds besides the memory.

    Attributes:
        cache: the restored memory (of the kind passed to :func:`session_read`).
        tokens: the prompt tokens the file names (``i32[n]``).
        arch: the model architecture name llama.cpp wrote (``"llama"``, ``"gemma3"``, ...).
        output_rows: ``i32[R]`` the batch rows of the last decode whose logits follow (version 9).
        logits: ``f32[R, V]`` (``[0, 0]`` when the file holds none: always with version 10).
        embeddings: ``f32[...]`` flat, as written (usually empty).
        version: the file's session version (9 or 10).
    """

    cache: object
    tokens: np.ndarray
    arch: str
    output_rows: np.ndarray
    logits: np.ndarray
    embeddings: np.ndarray
    version: int = SESSION_VERSION


def _tokens_arg(tokens) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"tokens has shape {arr.shape} and dtype {arr.dtype}: allowed a 1-d list of integer token ids")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("tokens contains ids outside int32: allowed llama_token values")
    return arr.astype("<i4")


def _version_arg(version, allowed: Tuple[int, ...], what: str) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or int(version) not in allowed:
        raise ValueError(
            f"version={version!r} is out of range for a {what}: allowed one of {list(allowed)} (the "
            f"version the llama.cpp that reads it knows: llama.h's LLAMA_"
            f"{'SESSION' if what == 'session file' else 'STATE_SEQ'}_VERSION)"
        )
    return int(version)


def _header(r: Cursor, magic: int, versions: Tuple[int, ...], what: str) -> Tuple[int, np.ndarray]:
    found_magic = r.u32(f"{what} magic")
    if found_magic != magic:
        raise StateError(
            f"{what} magic: expected {magic:#010x} ({struct.pack('>I', magic).decode()!r}), found {found_magic:#010x}"
        )
    version = r.u32(f"{what} version")
    if version not in versions:
        raise StateError(
            f"{what} version: expected one of {list(versions)} (the layouts this reader knows), found {version}"
        )
    n = r.u32("n_token_count")
    return version, np.frombuffer(r.take(4 * n, "tokens"), "<i4").copy()


def _bytes_of(data_or_path) -> bytes:
    if isinstance(data_or_path, (str, os.PathLike)):
        with open(data_or_path, "rb") as f:
            return f.read()
    if isinstance(data_or_path, (bytes, bytearray, memoryview)):
        return data_or_path
    raise ValueError(f"data must be bytes or a file path, got {type(data_or_path).__name__}")


def session_write(
    cache,
    tokens: Sequence[int],
    *,
    arch: str,
    version: int = SESSION_VERSION,
    v_trans=None,
    attn_rot: bool = True,
    logits=None,
    output_rows=None,
) -> bytes:
    """A llama.cpp session file (``'ggsn'``, what ``llama_state_save_file`` writes) of the whole memory.

    Args:
        cache: the memory (:class:`kvjax.KVCache`, :class:`kvjax.IswaCache` or
            :class:`kvjax.StreamCache`) without pending work.
        tokens: the prompt tokens to record (what the memory holds).
        arch: the model architecture name llama.cpp checks on load (``"llama"``, ``"gemma3"``, ...:
            the GGUF's ``general.architecture``).
        version: 10 (today's llama.cpp) or 9 (before it, with output buffers).
        v_trans: V layout (see :func:`memory_state_write`): the llama.cpp context that loads the
            file must use the same (True without flash attention, False with it).
        attn_rot: quantized K/V in llama.cpp's rotated basis (see :func:`memory_state_write`).
        logits: version 9 only: optional ``f32[R, V]`` logits of the last decode's output rows.
        output_rows: their batch rows (default ``0..R-1``).

    Returns:
        The file's bytes.

    Raises:
        ValueError: a bad argument (nothing is written).
        kvjax.StateError: pending work in the memory (apply :func:`kvjax.update` first).
    """
    cache = _require_kv_memory(cache)
    toks = _tokens_arg(tokens)
    version = _version_arg(version, SESSION_VERSIONS, "session file")
    if not isinstance(arch, str) or not arch or len(arch.encode()) > 256:
        raise ValueError(f"arch={arch!r} is out of range: allowed a non-empty architecture name such as 'llama'")
    if version >= 10 and (logits is not None or output_rows is not None):
        raise ValueError(
            "logits / output_rows are out of range for session version 10 (it has no output buffers): "
            "allowed None, or version=9"
        )
    lg = np.zeros((0, 0), "<f4") if logits is None else np.asarray(logits, "<f4")
    if lg.ndim != 2:
        raise ValueError(f"logits has shape {lg.shape}: allowed [R, V]")
    rows = np.arange(lg.shape[0], dtype="<i4") if output_rows is None else np.asarray(output_rows, "<i4")
    if rows.shape != (lg.shape[0],):
        raise ValueError(f"output_rows has shape {rows.shape}: allowed ({lg.shape[0]},), one per logits row")
    name = arch.encode()
    head = struct.pack("<III", SESSION_MAGIC, version, len(toks)) + toks.tobytes() + struct.pack("<I", len(name)) + name
    if version == 9:
        head += (
            struct.pack("<i", len(rows))
            + rows.tobytes()
            + struct.pack("<Q", lg.size)
            + lg.tobytes()
            + struct.pack("<Q", 0)
        )
    return head + memory_state_write(cache, -1, v_trans=v_trans, attn_rot=attn_rot)


def session_read(cache, data, *, arch=None, **options) -> LlamaSession:
    """Read a llama.cpp session file (``'ggsn'`` version 9 or 10) into ``cache``'s layout.

    Args:
        cache: a memory of the model (unchanged; the result holds the new one): a
            :class:`kvjax.KVCache`, :class:`kvjax.IswaCache` (Gemma 2/3) or :class:`kvjax.StreamCache`.
        data: the file's bytes or its path.
        arch: when given, the architecture the file must name (llama.cpp refuses another).
        **options: :func:`kvjax.state_read`'s, and ``attn_rot`` (default True: quantized K/V
            written in llama.cpp's rotated basis are rotated back; :mod:`kvjax.io._attn_rot`).

    Returns:
        A :class:`LlamaSession`.

    Raises:
        kvjax.StateError: another magic, version or architecture, a truncated or over-long file, or
            a memory section that does not fit the memory (layers, heads, K/V types, cells); the
            memory passed in is unchanged.
    """
    cache = _require_kv_memory(cache)
    r = Cursor(_bytes_of(data))
    version, tokens = _header(r, SESSION_MAGIC, SESSION_VERSIONS, "session file")
    n_name = r.u32("arch name length")
    if n_name > 256:
        raise StateError(f"arch name length: expected at most 256, found {n_name}")
    found = bytes(r.take(n_name, "arch name")).decode("utf-8", "replace")
    if arch is not None and found != arch:
        raise StateError(
            f"session file arch: expected {arch!r} (this model's), found {found!r}: the session of "
            f"another model (llama.cpp refuses it too)"
        )
    rows, logits, embd = np.zeros(0, "<i4"), np.zeros((0, 0), "<f4"), np.zeros(0, "<f4")
    if version == 9:
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
    restored = _read_memory_section(cache, r, -1, options)
    r.finish("session file")
    return LlamaSession(restored, tokens, found, rows, logits, embd, version)


def seq_file_write(
    cache, seq_id: int, tokens: Sequence[int], *, version: int = SEQ_VERSION, v_trans=None, attn_rot: bool = True
) -> bytes:
    """A llama.cpp sequence file (``'ggsq'``, what ``llama_state_seq_save_file`` writes) of one sequence.

    Args:
        cache: the memory (as :func:`session_write`).
        seq_id: the sequence, in ``[0, n_seq_max)``.
        tokens: its tokens.
        version: 3 (today's llama.cpp) or 2; the cells are the same for every model kvjax runs
            (version 3 adds per-cell records only for M-RoPE and per-layer-embedding models).
        v_trans: V layout (see :func:`memory_state_write`).
        attn_rot: quantized K/V in llama.cpp's rotated basis (see :func:`memory_state_write`).

    Returns:
        The file's bytes (``llama_state_seq_load_file`` reads them into any sequence id).
    """
    cache = _require_kv_memory(cache)
    seq_id = _seq_arg(seq_id, cache)
    if seq_id < 0:
        raise ValueError("seq_id=-1 is out of range for a sequence file: allowed [0, n_seq_max)")
    toks = _tokens_arg(tokens)
    version = _version_arg(version, SEQ_VERSIONS, "sequence file")
    return (
        struct.pack("<III", SEQ_MAGIC, version, len(toks))
        + toks.tobytes()
        + memory_state_write(cache, seq_id, v_trans=v_trans, attn_rot=attn_rot)
    )


def seq_file_read(cache, data, seq_id: int, **options) -> Tuple[object, np.ndarray]:
    """Read a llama.cpp sequence file (``'ggsq'`` version 2 or 3) into sequence ``seq_id``.

    The sequence's cells are replaced (as ``llama_state_seq_load_file`` does); the other sequences
    of the memory are untouched.

    Returns:
        ``(cache, tokens)``: the restored memory (the one passed in is unchanged) and the file's tokens.

    Raises:
        ValueError: ``seq_id`` out of range.
        kvjax.StateError: another magic or version, a truncated or over-long file, or cells that
            do not fit (nothing changed).
    """
    cache = _require_kv_memory(cache)
    seq_id = _seq_arg(seq_id, cache)
    if seq_id < 0:
        raise ValueError("seq_id=-1 is out of range for a sequence file: allowed [0, n_seq_max)")
    r = Cursor(_bytes_of(data))
    _, tokens = _header(r, SEQ_MAGIC, SEQ_VERSIONS, "sequence file")
    out = _read_memory_section(cache, r, seq_id, options)
    r.finish("sequence file")
    return out, tokens


def session_save_file(path, cache, tokens: Sequence[int], **options) -> None:
    """Write :func:`session_write`'s bytes to ``path`` atomically (llama.cpp's ``llama_state_save_file``).

    Args:
        path: the file (replaced if it exists; a crash leaves the old file or the new one).
        cache: the memory.
        tokens: its tokens.
        **options: :func:`session_write`'s (``arch`` is required).
    """
    write_atomic(path, (session_write(cache, tokens, **options),))


def seq_save_file(path, cache, seq_id: int, tokens: Sequence[int], **options) -> None:
    """Write :func:`seq_file_write`'s bytes to ``path`` atomically (``llama_state_seq_save_file``)."""
    write_atomic(path, (seq_file_write(cache, seq_id, tokens, **options),))
