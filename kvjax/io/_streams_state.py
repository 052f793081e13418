"""The state blob of per-sequence streams: today's llama.cpp layout with ``n_stream`` sections.

Layout (little-endian, :mod:`kvjax.io._llama_state`)::

    u32 n_stream
    per stream: u32 cell_count, cells, K/V data     # one unified cache's section each

A one-sequence blob has cells only in the stream of its sequence. Reading checks every stream
before any is kept, so a bad blob leaves the memory unchanged. A one-sequence blob of another
stream count (a unified cache's, ``n_stream = 1``, kvjax's or llama.cpp's) is accepted: its cells
go to the stream of the destination sequence. A whole-memory blob must have this memory's count.
"""

from __future__ import annotations

import struct
from typing import List, Optional

import jax
import jax.numpy as jnp

from kvjax._errors import StateError
from kvjax._validate import check_state_seq
from kvjax.io._blob import Cursor
from kvjax.io._state import state_read
from kvjax.io._stream_section import parse_streams, Stream, stream_blob, to_seed
from kvjax.memory._protocol import register_state_format
from kvjax.memory._streams import StreamCache

__all__ = ["write_streams", "read_streams"]


def _seq_arg(memory, seq_id) -> int:
    return check_state_seq(seq_id, memory.n_seq_max)


def write_streams(memory, seq_id: int = -1) -> bytes:
    """``u32 n_stream`` and each stream's section (of ``seq_id``'s cells only, or of every cell).

    Raises:
        kvjax.StateError: a stream copy or K-shift is pending (apply :func:`kvjax.update` first).
    """
    seq_id = _seq_arg(memory, seq_id)
    if bool(jnp.any(memory.copy_from >= 0)):
        raise StateError("memory has a pending stream copy: apply kvjax.update(memory) before writing its state")
    sections = [stream_blob(memory.stream(s), seq_id)[4:] for s in range(memory.n_stream)]
    return struct.pack("<I", memory.n_stream) + b"".join(sections)


def _parse(memory, data, seq_id: int) -> List[Optional[Stream]]:
    """Each stream's parsed section (None: no cells), checked against this memory's stream count."""
    r = Cursor(data)
    streams = parse_streams(r, single=seq_id >= 0, keep_empty=True, has_v=not memory.config.base.mla)
    r.finish("blob")
    if seq_id >= 0:
        held = [st for st in streams if st is not None]
        if len(held) > 1:
            raise StateError(
                f"single-sequence blob: expected cells in one stream, found {len(held)} streams with cells"
            )
        out: List[Optional[Stream]] = [None] * memory.n_stream
        if held:
            out[memory.stream_of(seq_id)] = held[0]
        return out
    if len(streams) != memory.n_stream:
        raise StateError(f"n_stream: expected {memory.n_stream} (this memory's streams), found {len(streams)}")
    return streams


def read_streams(memory, data, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False):
    """A memory restored from :func:`write_streams`'s blob (``memory`` itself is unchanged).

    Whole blob: every stream is replaced by its section (an empty section empties the stream).
    One sequence: the sequence is read into its stream (as :func:`kvjax.state_read` reads one
    sequence into a unified cache); the other streams are untouched.
    """
    seq_id = _seq_arg(memory, seq_id)
    del donate  # every stream is read before any is kept: nothing may be given up early
    sections = _parse(memory, data, seq_id)
    if seq_id >= 0:
        s = memory.stream_of(seq_id)
        one = memory.stream(s)
        read = state_read(
            one, to_seed([sections[s]] if sections[s] else [], seq_id, one), seq_id, contiguous=contiguous
        )
        cache = jax.tree.map(lambda all_, x: all_.at[s].set(x), memory.cache, read)
        return memory.replace(cache=cache)
    reads = []
    for s, section in enumerate(sections):
        one = memory.stream(s)
        reads.append(state_read(one, to_seed([section] if section else [], -1, one), -1, contiguous=contiguous))
    cache = jax.tree.map(lambda *xs: jnp.stack(xs), *reads)
    return memory.replace(cache=cache, copy_from=jnp.full_like(memory.copy_from, -1))


# a stream memory is never a member of another memory, so its blob is never cut out of a longer one
register_state_format(StreamCache, write=write_streams, read=read_streams, size=None)
