"""The state of a composite memory: its members' blobs, one after the other.

The iSWA pair writes the base cache's blob, then the window cache's; the hybrid the attention
memory's, then the recurrent one's (newer llama.cpp's ``llama_memory_hybrid`` order). Reading cuts
the bytes at each member's :meth:`~kvjax.Memory.blob_size` (the last member takes the rest, and
checks that nothing trails) and reads every member before any is kept, so a bad member leaves the
memory as it was; nothing is donated, since the first member's buffers would be given up before
the later ones are known to be good.

Example:
    >>> import kvjax
    >>> base = kvjax.CacheConfig(size=64, n_seq_max=1, n_layer=2, n_kv_heads=1, head_dim=4)
    >>> memory = kvjax.init(kvjax.IswaConfig(base, swa_layers=(0,), n_swa=4, n_batch=8))
    >>> blob = kvjax.state_write(memory)
    >>> blob == kvjax.state_write(memory.base) + kvjax.state_write(memory.swa)
    True
"""

from __future__ import annotations

from kvjax.io._blob import as_view
from kvjax.memory._composite import Composite
from kvjax.memory._protocol import register_state_format

__all__ = ["write_composite", "read_composite", "composite_blob_size"]


def write_composite(memory: Composite, seq_id: int = -1) -> bytes:
    """Every member's blob of ``seq_id`` (-1: the whole memory), in member order."""
    return b"".join(member.state_write(seq_id) for member in memory.members)


def composite_blob_size(memory: Composite, data, seq_id: int = -1) -> int:
    """Bytes of the composite's blob at the start of ``data`` (the sum of its members')."""
    view, end = as_view(data), 0
    for member in memory.members:
        end += member.blob_size(view[end:], seq_id)
    return end


def read_composite(
    memory: Composite, data, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False
) -> Composite:
    """A composite restored from :func:`write_composite`'s blob (``memory`` itself unchanged)."""
    del donate  # every member is read before any is kept: nothing may be given up early
    view, start = as_view(data), 0
    read = []
    *first, last = memory.members
    for member in first:
        end = start + member.blob_size(view[start:], seq_id)
        read.append(member.state_read(view[start:end], seq_id, contiguous=contiguous))
        start = end
    read.append(last.state_read(view[start:], seq_id, contiguous=contiguous))
    return memory.with_members(read)


register_state_format(Composite, write=write_composite, read=read_composite, size=composite_blob_size)
