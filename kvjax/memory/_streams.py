"""Per-sequence streams: one unified cache per stream, so attention never crosses sequences.

Newer llama.cpp's ``llama_kv_cache`` with ``kv_unified = false``. In a unified cache every token
attends over the window of *all* sequences' cells (masked), so at batch B a token reads about B
times the cells it needs. With streams each sequence (or each group of sequences) gets its own
cells, ``head`` and window:

- ``base.size`` cells **per stream**; sequence ``s`` lives in stream ``s * n_stream // n_seq_max``
  (one stream per sequence by default; fewer streams group consecutive sequence ids);
- every sequence operation acts inside the stream of its sequence, with the unified cache's rules
  (``seq_id = -1``: in every stream);
- a token may belong to several sequences only within one stream; placement finds a slot in each
  stream for that stream's tokens, all or nothing;
- ``seq_cp`` between sequences of **different** streams copies the whole source sequence: the
  destination stream is emptied, receives the source's cells (positions and pending shifts, with
  the destination id) and its ``head``, and the K/V rows follow as a *pending copy* of the whole
  stream buffer, applied by :meth:`StreamCache.update` before the K-shift (llama.cpp's rule). A
  partial cross-stream copy is refused: a clear ``ValueError`` for concrete arguments, a no-op and
  ``ErrorFlag.SEQ_ID`` under ``jit``;
- the state blob is today's llama.cpp layout, ``u32 n_stream`` then each stream's cells and rows.

Layout: :attr:`StreamCache.cache` is a :class:`kvjax.KVCache` whose every leaf has a leading stream
axis: cells ``pos [S, C]``, ``seq [S, C, W]``, ``head [S]``, K ``[S, L, H, C, D]``. Sequence
operations are the unified cache's own functions ``vmap``-ed over streams (metadata only, K/V
untouched); one stream as a plain unified cache is :meth:`StreamCache.stream`. The reference model's
layers reach streams through :func:`kvjax.nn.attend_cached`, which attends per equal-split slot
over that slot's stream only (``kvjax.memory._stream_attention``), so a decode step's cost follows each
sequence's own length.

Example:
    >>> import kvjax
    >>> base = kvjax.CacheConfig(size=64, n_seq_max=4, n_layer=1, n_kv_heads=1, head_dim=8)
    >>> memory = kvjax.init(kvjax.StreamsConfig(base))
    >>> memory.n_stream, memory.cache.cells.pos.shape, memory.stream_of(3)
    (4, (4, 64), 3)
    >>> ub = kvjax.make_equal_ubatch([([0, 1], [0]), ([0, 1], [2])])
    >>> memory, placement, ok = kvjax.find_slot(memory, ub)
    >>> placement.stream.tolist(), placement.cell.tolist()     # both start at cell 0 of their stream
    ([0, 0, 2, 2], [0, 1, 0, 1])
    >>> memory = kvjax.seq_cp(memory, 0, 1)                     # across streams: a pending copy
    >>> bool(kvjax.update(memory).pending()), int(kvjax.seq_pos_max(memory, 1))
    (False, 1)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._errors import ErrorFlag
from kvjax._typing import Array, Bool, Int
from kvjax._jit import JitTwins, donating
from kvjax._validate import is_traced
from kvjax.memory import _cells
from kvjax.memory._cells import Cells
from kvjax.memory._config import CacheConfig
from kvjax.memory._protocol import Memory, on_metadata
from kvjax.memory._seqbits import seq_bits
from kvjax.memory._unified import KVCache, init_unified, total_size
from kvjax.memory._slots import find_slot_cells
from kvjax._axes import STREAMS, scalar_axes
from kvjax._mesh import DATA, MODEL, type_mesh
from kvjax.memory._update import apply_update
from jax.sharding import PartitionSpec as P
from jax.sharding import NamedSharding

__all__ = ["StreamsConfig", "StreamCache", "StreamPlacement", "init_streams"]

_POS_INF = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class StreamsConfig:
    """Per-sequence streams' description (frozen, hashable, validated on construction).

    Attributes:
        base: one stream's cache description: ``size`` is the cells **per stream** (what bounds one
            sequence's context), layers, heads, dtypes, padding, RoPE, window.
        n_stream: the number of streams, in ``[1, n_seq_max]``; default (None) one per sequence.
            Sequence ``s`` lives in stream ``s * n_stream // n_seq_max``.

    Example:
        >>> cfg = StreamsConfig(CacheConfig(size=32, n_seq_max=6, n_layer=1, n_kv_heads=1, head_dim=4), n_stream=3)
        >>> cfg.stream_table, cfg.n_seq_max
        ((0, 0, 1, 1, 2, 2), 6)
    """

    base: CacheConfig
    n_stream: int = None

    def __post_init__(self):
        if not isinstance(self.base, CacheConfig):
            raise ValueError(f"base must be a kvjax.CacheConfig, got {type(self.base).__name__}")
        n = self.base.n_seq_max if self.n_stream is None else self.n_stream
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= self.base.n_seq_max:
            raise ValueError(
                f"n_stream={self.n_stream!r} is out of range: allowed an integer in "
                f"[1, n_seq_max={self.base.n_seq_max}] (or None: one stream per sequence)"
            )
        object.__setattr__(self, "n_stream", int(n))

    @property
    def n_seq_max(self) -> int:
        return self.base.n_seq_max

    @property
    def size(self) -> int:
        """Cells per stream."""
        return self.base.size

    @property
    def stream_table(self) -> Tuple[int, ...]:
        """The stream of each sequence id (static)."""
        return tuple(s * self.n_stream // self.n_seq_max for s in range(self.n_seq_max))


@struct.dataclass
class StreamPlacement:
    """Where a ubatch went in a :class:`StreamCache`.

    Attributes:
        stream: ``i32[T]`` the stream of each token (-1 for padding rows, and for all rows when the
            placement failed).
        cell: ``i32[T]`` the token's cell within its stream (-1 likewise).
    """

    stream: Int[Array, " T"]
    cell: Int[Array, " T"]


def _select(mask, new, old):
    """Per stream: ``new`` where ``mask[s]``, else ``old`` (leaves with a leading stream axis)."""
    return jax.tree.map(lambda a, b: jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b), new, old)


def _vmap_cells(fn, cells: Cells, *args) -> Cells:
    """A unified-cache cell function applied to every stream's cells (scalar arguments shared)."""
    return jax.vmap(fn, in_axes=(0,) + (None,) * len(args))(cells, *args)


@struct.dataclass
class StreamCache(Memory):
    """A KV cache of ``n_stream`` streams (llama.cpp's non-unified ``llama_kv_cache``).

    Attributes:
        cache: a :class:`kvjax.KVCache` of ``config.base`` with a leading stream axis on every leaf.
        copy_from: ``i32[S]`` pending whole-stream K/V copies: stream ``s`` takes the buffers of
            stream ``copy_from[s]`` at the next :meth:`update` (-1: none).
        error: ``u32[]`` error bits of the memory's own rules (a refused cross-stream copy).
        config: the static :class:`StreamsConfig`.
    """

    cache: KVCache
    copy_from: Int[Array, " S"]
    error: Int[Array, ""]
    config: StreamsConfig = struct.field(pytree_node=False)

    # -- identity -----------------------------------------------------------------------------

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    @property
    def size(self) -> int:
        return self.config.size

    @property
    def n_stream(self) -> int:
        """S, the number of streams (static)."""
        return self.config.n_stream

    @property
    def streamed(self) -> bool:
        return True

    @property
    def ubatch_split(self) -> str:
        # attention runs per equal-split slot over that slot's stream (kvjax.memory._stream_attention)
        return "equal"

    def stream_of(self, seq_id):
        """The stream of ``seq_id`` (host int for a concrete id; ``i32`` on device, -1 when out of range)."""
        if not is_traced(seq_id) and not isinstance(seq_id, jax.Array):
            s = int(seq_id)
            return self.config.stream_table[s] if 0 <= s < self.n_seq_max else -1
        seq_id = jnp.asarray(seq_id, jnp.int32)
        inside = (seq_id >= 0) & (seq_id < self.n_seq_max)
        return jnp.where(inside, seq_id * self.n_stream // self.n_seq_max, -1).astype(jnp.int32)

    def context_per_sequence(self, n_seq: int):
        # each stream's cells are shared only by its own sequences among 0..n_seq-1
        table = self.config.stream_table[: max(1, int(n_seq))]
        return self.size // max(table.count(s) for s in set(table))

    def stream(self, index: int) -> KVCache:
        """Stream ``index`` as a plain unified cache (its cells and K/V; a copy of the leaves)."""
        return jax.tree.map(lambda x: x[index], self.cache)

    def _cells_in(self, seq_id, new: Cells) -> "StreamCache":
        """Keep ``new`` cells in the stream of ``seq_id`` (every stream for -1 or an invalid id)."""
        s = self.stream_of(jnp.asarray(seq_id, jnp.int32))
        mask = (jnp.arange(self.n_stream) == s) | (s < 0)
        return self.replace(cache=self.cache.replace(cells=_select(mask, new, self.cache.cells)))

    # -- sequences ------------------------------------------------------------------------------

    @on_metadata
    def clear(self) -> "StreamCache":
        cells = _vmap_cells(_cells.clear, self.cache.cells)
        return self.replace(cache=self.cache.replace(cells=cells), copy_from=jnp.full_like(self.copy_from, -1))

    @on_metadata
    def seq_rm(self, seq_id, p0, p1):
        return self._cells_in(seq_id, _vmap_cells(_cells.seq_rm, self.cache.cells, seq_id, p0, p1)), np.bool_(True)

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1) -> "StreamCache":
        concrete = not any(is_traced(x) or isinstance(x, jax.Array) for x in (seq_id_src, seq_id_dst, p0, p1))
        if concrete:  # a refused copy of concrete ids is an error here (traced ids: an error bit)
            s0, s1 = self.stream_of(seq_id_src), self.stream_of(seq_id_dst)
            if s0 >= 0 and s1 >= 0 and s0 != s1 and not (int(p0) <= 0 and int(p1) < 0):
                raise ValueError(
                    f"seq_cp({seq_id_src} -> {seq_id_dst}, p0={p0}, p1={p1}) crosses streams ({s0} -> "
                    f"{s1}): allowed only a whole-sequence copy (p0 <= 0 and p1 < 0), which copies the "
                    f"stream's K/V at the next update (llama.cpp's rule); copy within a stream, or the "
                    f"whole sequence"
                )
            # one stream per sequence: nothing else to hold (and no device read to wait for)
            grouped = self.n_stream != self.n_seq_max
            if grouped and s0 >= 0 and s1 >= 0 and s0 != s1 and bool(self._holds_others(seq_id_dst, s1)):
                raise ValueError(
                    f"seq_cp({seq_id_src} -> {seq_id_dst}) crosses streams ({s0} -> {s1}) and stream {s1} "
                    f"holds other sequences than {seq_id_dst}: allowed only into a stream the copy may "
                    f"empty (llama.cpp resets the destination stream); remove them first, or use one "
                    f"stream per sequence"
                )
        return self._seq_cp(seq_id_src, seq_id_dst, p0, p1)

    @on_metadata
    def _seq_cp(self, seq_id_src, seq_id_dst, p0, p1) -> "StreamCache":
        s0, s1 = self.stream_of(seq_id_src), self.stream_of(seq_id_dst)
        full = (jnp.asarray(p0) <= 0) & (jnp.asarray(p1) < 0)
        crowded = self._holds_others(seq_id_dst, s1)
        same = self._cells_in(seq_id_src, _vmap_cells(_cells.seq_cp, self.cache.cells, seq_id_src, seq_id_dst, p0, p1))
        s0, s1 = jnp.asarray(s0, jnp.int32), jnp.asarray(s1, jnp.int32)
        cross = self._copy_stream(seq_id_src, seq_id_dst, s0, s1)
        valid = (s0 >= 0) & (s1 >= 0)
        refused = valid & (s0 != s1) & (~full | crowded)
        out = jax.tree.map(lambda a, b: jnp.where(valid & (s0 != s1), a, b), cross, same)
        out = jax.tree.map(lambda a, b: jnp.where(refused, a, b), self, out)
        return out.replace(error=out.error | jnp.where(refused, jnp.uint32(ErrorFlag.SEQ_ID), jnp.uint32(0)))

    @on_metadata
    def _holds_others(self, seq_id, stream) -> Bool[Array, ""]:
        """Whether ``stream`` holds a cell of a sequence other than ``seq_id`` (grouped streams only)."""
        if self.n_stream == self.n_seq_max:
            return jnp.bool_(False)
        cells = jax.tree.map(lambda x: x[jnp.clip(jnp.asarray(stream), 0, self.n_stream - 1)], self.cache.cells)
        mine = seq_bits(jnp.asarray(seq_id, jnp.int32), cells.seq.shape[-1])
        return jnp.any((cells.seq & ~mine[None, :]) != 0)

    def _copy_stream(self, src, dst, s0, s1) -> "StreamCache":
        """``dst``'s stream emptied, given ``src``'s cells (as ``dst``) and head; K/V copy pending."""
        s0c, s1c = jnp.clip(s0, 0, self.n_stream - 1), jnp.clip(s1, 0, self.n_stream - 1)
        cells = self.cache.cells
        source = jax.tree.map(lambda x: x[s0c], cells)
        member = _cells.has_seq(source, jnp.asarray(src, jnp.int32))
        words = cells.seq.shape[-1]
        target = jax.tree.map(lambda x: x[s1c], cells)
        copied = target.replace(
            pos=jnp.where(member, source.pos, -1),
            seq=jnp.where(member[:, None], seq_bits(jnp.asarray(dst, jnp.int32), words)[None, :], jnp.uint32(0)),
            delta=jnp.where(member, source.delta, 0),
            head=source.head,
        )
        cells = jax.tree.map(lambda all_, one: all_.at[s1c].set(one), cells, copied)
        origin = jnp.where(self.copy_from[s0c] >= 0, self.copy_from[s0c], s0c)
        return self.replace(cache=self.cache.replace(cells=cells), copy_from=self.copy_from.at[s1c].set(origin))

    @on_metadata
    def seq_keep(self, seq_id) -> "StreamCache":
        # every stream: the other streams hold no cell of seq_id and are emptied, as in llama.cpp
        cells = _vmap_cells(_cells.seq_keep, self.cache.cells, seq_id)
        return self.replace(cache=self.cache.replace(cells=cells))

    @on_metadata
    def seq_add(self, seq_id, p0, p1, delta) -> "StreamCache":
        return self._cells_in(seq_id, _vmap_cells(_cells.seq_add, self.cache.cells, seq_id, p0, p1, delta))

    @on_metadata
    def seq_div(self, seq_id, p0, p1, d) -> "StreamCache":
        return self._cells_in(seq_id, _vmap_cells(_cells.seq_div, self.cache.cells, seq_id, p0, p1, d))

    @on_metadata
    def seq_pos_min(self, seq_id):
        lo = jax.vmap(_cells.seq_pos_min, in_axes=(0, None))(self.cache.cells, seq_id)
        held = lo >= 0
        return jnp.where(jnp.any(held), jnp.min(jnp.where(held, lo, _POS_INF)), -1).astype(jnp.int32)

    @on_metadata
    def seq_pos_max(self, seq_id):
        return jnp.max(jax.vmap(_cells.seq_pos_max, in_axes=(0, None))(self.cache.cells, seq_id))

    @on_metadata
    def seq_shared(self, seq_id, p0, p1):
        return jnp.any(jax.vmap(_cells.seq_shared, in_axes=(0, None, None, None))(self.cache.cells, seq_id, p0, p1))

    @on_metadata
    def used_cells(self):
        return jnp.sum(jax.vmap(_cells.used_cells)(self.cache.cells))

    @on_metadata
    def n_tokens(self):
        return jnp.sum(jax.vmap(_cells.n_tokens)(self.cache.cells))

    @on_metadata
    def pos_max(self):
        return jnp.max(self.cache.cells.pos)

    # -- placement --------------------------------------------------------------------------------

    def token_streams(self, ubatch) -> Tuple[Int[Array, " T"], Bool[Array, ""]]:
        """``(stream i32[T], ok)``: each valid token's stream (-1 for padding) and whether every
        token's sequence ids lie in one stream."""
        ids = jnp.asarray(ubatch.seq_ids)
        streams = self.stream_of(ids)  # [T, M], -1 for absent ids
        first = jnp.where(ubatch.valid, streams[:, 0], -1)
        same = jnp.all((ids == -1) | (streams == first[:, None]), axis=1) & (first >= 0)
        return first, jnp.all(same | ~ubatch.valid)

    def check_token_streams(self, ids: np.ndarray) -> None:
        """Raise ``ValueError`` when a token's sequence ids (host ``[n, M]``, -1 padded) span streams."""
        table = np.asarray(self.config.stream_table + (-1,))
        streams = table[np.where(ids >= 0, ids, -1)]
        bad = np.flatnonzero(((streams != streams[:, :1]) & (ids >= 0)).any(axis=1))
        if bad.size:
            row = ids[bad[0]]
            raise ValueError(
                f"ubatch token {int(bad[0])} belongs to sequences {row[row >= 0].tolist()} of streams "
                f"{sorted(set(table[row[row >= 0]].tolist()))}: allowed the sequences of one stream "
                f"per token (per-sequence streams share no cells; evaluate a shared prompt in one "
                f"sequence and copy it with kvjax.seq_cp)"
            )

    @on_metadata(static_argnames="contiguous")
    def find_slot(self, ubatch, *, contiguous: bool = True):
        stream, one_stream = self.token_streams(ubatch)
        mine = jnp.arange(self.n_stream)[:, None] == stream[None, :]  # [S, T]
        parts = jax.vmap(lambda valid: ubatch.replace(valid=valid))(mine & ubatch.valid[None, :])
        placed, slots, oks = jax.vmap(functools.partial(find_slot_cells, contiguous=contiguous))(
            self.cache.cells, parts
        )
        has_tokens = jnp.any(mine, axis=1)
        ok = jnp.all(oks | ~has_tokens) & one_stream
        # a stream without tokens of this ubatch keeps its cells (its head included)
        cells = _select(has_tokens & ok, placed, self.cache.cells)
        cells = cells.replace(error=placed.error)  # a refused token's flag stays, whatever was kept
        cell = jnp.take_along_axis(slots, jnp.clip(stream, 0, self.n_stream - 1)[None, :], axis=0)[0]
        keep = ubatch.valid & ok
        placement = StreamPlacement(
            stream=jnp.where(keep, stream, -1).astype(jnp.int32), cell=jnp.where(keep, cell, -1).astype(jnp.int32)
        )
        error = self.error | jnp.where(one_stream, jnp.uint32(0), jnp.uint32(ErrorFlag.UBATCH))
        return self.replace(cache=self.cache.replace(cells=cells), error=error), placement, ok

    # -- the one attention part (stacked over streams) ------------------------------------------------

    @property
    def n_parts(self) -> int:
        return 1

    def layer_part(self, layer: int) -> int:
        return 0

    def part(self, index: int) -> KVCache:
        """The stacked unified cache (every leaf with a leading stream axis; see :meth:`stream`)."""
        return self.cache

    def with_part(self, index: int, cache: KVCache) -> "StreamCache":
        return self.replace(cache=cache)

    def part_slots(self, placement: StreamPlacement, index: int):
        return placement.cell

    @on_metadata
    def extent(self):
        return jnp.max(jax.vmap(_cells.cell_max)(self.cache.cells))[None]

    @on_metadata
    def stream_extent(self) -> Int[Array, " S"]:
        """One past the last non-empty cell of each stream (what each stream's attention reads)."""
        return jax.vmap(_cells.cell_max)(self.cache.cells)

    @on_metadata
    def extent_after(self, n_tokens):
        cells = self.cache.cells
        top = jax.vmap(_cells.cell_max)(cells)
        n_tokens = jnp.minimum(n_tokens, self.size)  # as the unified cache's: no int32 wrap
        after = jnp.where(n_tokens == 0, top, jnp.maximum(top, cells.head) + n_tokens)
        return jnp.max(after)[None]

    # -- pending work ---------------------------------------------------------------------------------

    @on_metadata
    def pending(self):
        return jnp.any(_pending_work(self))

    def update(self, *, donate: bool = False) -> "StreamCache":
        if is_traced(self.copy_from) or is_traced(self.cache.cells.delta):
            return _apply_update(self)
        copying, shifting = (bool(x) for x in jax.device_get(_pending_work(self)))
        # two programs, each run only when it has work: on a mesh with the streams split over
        # devices a copy between streams moves K/V between devices by nature, a K-shift never does
        donate = donating(donate, self.copy_from)
        memory = _copy_streams(self, default_layout(self.cache.k[0]), donate=donate) if copying else self
        return _shift_streams(memory, donate=donate) if shifting else memory

    @property
    def can_shift(self) -> bool:
        return True

    # -- placement on a device mesh ---------------------------------------------------------------------

    def logical_axes(self) -> "StreamCache":
        # every leaf of the stacked unified cache gains the leading stream axis: the default rules put
        # streams on the data axis, so a device holds its streams' cells, heads and K/V whole (each
        # sequence operation and placement is vmapped over streams: no stream reads another's cells)

        one = self.cache.logical_axes()
        stacked = jax.tree.map(lambda spec: P(STREAMS, *spec), one, is_leaf=lambda x: isinstance(x, P))
        return self.replace(cache=stacked, copy_from=P(STREAMS), error=scalar_axes())

    # -- donation, errors, sizes, state ---------------------------------------------------------------

    def split(self):
        return (self.cache.k, self.cache.v), self.replace(cache=self.cache.replace(k=(), v=()))

    def join(self, buffers) -> "StreamCache":
        k, v = buffers
        return self.replace(cache=self.cache.replace(k=tuple(k), v=tuple(v)))

    @on_metadata
    def error_bits(self):
        # the or over streams as a max per bit: with the streams on a mesh axis this is a
        # cross-device reduction, and XLA:CPU's collectives have no bitwise-or reducer
        per_bit = (self.cache.cells.error[:, None] >> jnp.arange(32, dtype=jnp.uint32)) & 1
        streams = jnp.sum(jnp.max(per_bit, axis=0) << jnp.arange(32, dtype=jnp.uint32), dtype=jnp.uint32)
        return self.error | streams

    @on_metadata
    def clear_errors(self) -> "StreamCache":
        # derived from the old words, so they stay where they were on a mesh
        cells = self.cache.cells.replace(error=self.cache.cells.error & jnp.uint32(0))
        return self.replace(cache=self.cache.replace(cells=cells), error=self.error & jnp.uint32(0))

    def flag_errors(self, bits) -> "StreamCache":
        return self.replace(error=self.error | jnp.asarray(bits, jnp.uint32))

    def nbytes(self) -> int:
        return self.n_stream * total_size(self.config.base)

    def share_prefix(self, src: int, dst: int, n: int):
        if self.stream_of(src) == self.stream_of(dst):
            return super().share_prefix(src, dst, n)
        if n <= 0 or not self.prefix_visible(src, n):
            return self, 0, False
        # across streams only the whole sequence can be copied; the tail past n is dropped again
        memory = self.seq_cp(np.int32(src), np.int32(dst), np.int32(-1), np.int32(-1))
        memory, _ = memory.seq_rm(np.int32(dst), np.int32(n), np.int32(-1))
        return memory, n, False


@jax.jit
def _pending_work(memory: StreamCache):
    """``[copying, shifting]``: whether a stream copy, and whether a K-shift or defrag, is pending."""
    return jnp.stack([jnp.any(memory.copy_from >= 0), _shift_or_defrag(memory.cache.cells)])


def _apply_update(memory: StreamCache) -> StreamCache:
    """Pending stream copies first, then each stream's K-shift and defrag (the seed's order)."""
    return _apply_shifts(_apply_copies(memory))


def mesh_split(k_all) -> Optional[Tuple[object, Optional[str]]]:
    """``(mesh, head axis)`` when the stream buffers live on a mesh whose ``"data"`` axis splits the streams.

    The mesh comes from the buffer's type (``jax.typeof(k).sharding.mesh``: known while tracing,
    no context needed). kvjax's default rules put streams on ``"data"`` and kv heads on
    ``"model"``; the head axis is ``"model"`` when the mesh has it and it divides the heads, else
    None. ``None`` for a buffer on one device or a mesh without a ``"data"`` axis that divides
    the streams.
    """
    mesh, shape = type_mesh(k_all)
    if shape.get(DATA, 1) <= 1 or k_all.shape[0] % shape[DATA]:
        return None
    heads = MODEL if shape.get(MODEL, 1) > 1 and k_all.shape[2] % shape[MODEL] == 0 else None
    return mesh, heads


def default_layout(k_all: jax.Array) -> bool:
    """Whether a concrete stream buffer ``[S, L, H, C, D]`` is laid out as :func:`mesh_split` assumes
    (streams on ``"data"``, heads on ``"model"`` where it divides them), or lives on one device.

    Traced buffers carry no spec; eager callers check with this before taking a mesh path, whose
    ``shard_map`` would lay its outputs out by those rules whatever the input's were.
    """
    split = mesh_split(k_all)
    if split is None:
        return True
    if not isinstance(k_all.sharding, NamedSharding):
        return False
    want = P(DATA, None, split[1], None, None)
    return k_all.sharding.is_equivalent_to(NamedSharding(split[0], want), k_all.ndim)


def _apply_copies(memory: StreamCache, on_mesh: bool = True) -> StreamCache:
    """Every pending copy between streams applied (``copy_from`` all -1 after); ``on_mesh=False``
    keeps the one-device gather (a buffer laid out by other rules than the mesh path's)."""
    split = mesh_split(memory.cache.k[0]) if memory.cache.k and on_mesh else None
    if split is not None:
        return _copies_on_mesh(memory, split)
    cache = memory.cache
    source = jnp.where(memory.copy_from >= 0, memory.copy_from, jnp.arange(memory.n_stream))
    copying = jnp.any(memory.copy_from >= 0)
    # a gather along the stream axis reads the old buffers: copies enqueued in any order apply as
    # the sequence of copies llama.cpp runs (seq_cp composed the chains when they were enqueued)
    k = tuple(jax.lax.cond(copying, lambda x: x[source], lambda x: x, x) for x in cache.k)
    v = tuple(jax.lax.cond(copying, lambda x: x[source], lambda x: x, x) for x in cache.v)
    # every copy applied: all -1, derived from copy_from so it keeps its sharding on a mesh (a fresh
    # constant would come out replicated)
    return memory.replace(cache=cache.replace(k=k, v=v), copy_from=jnp.minimum(memory.copy_from, -1))


def _copies_on_mesh(memory: StreamCache, split) -> StreamCache:
    """The pending copies with the streams split over ``"data"``: only copied streams move.

    A gather along a split stream axis makes XLA all-gather every stream to every device. Here,
    under ``jax.shard_map``, a device copies between its own streams locally, and for each source
    stream that a stream on another device copies (a ``fori_loop`` over the streams, each step a
    ``cond`` every device takes alike: one compiled step however many streams) the device holding
    it contributes its block to one ``psum`` over ``"data"``: one stream's K/V is sent, and only
    when a copy needs it. The block is summed as unsigned integers of its width, so every bit
    arrives as it left (a float sum with zeros would turn -0.0 into 0.0).
    """
    mesh, heads = split
    n_stream = memory.n_stream
    buf = P(DATA, None, heads, None, None)
    cache = memory.cache

    def as_bits(x):
        if jnp.issubdtype(x.dtype, jnp.integer):
            return x
        return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{x.dtype.itemsize * 8}"))  # float16, bfloat16, ...

    def local(ks, vs, copy_from):
        # copy_from is whole on every device: every device takes the same branch
        return jax.lax.cond(jnp.any(copy_from >= 0), copy, lambda ks, vs, _: (ks, vs), ks, vs, copy_from)

    def copy(ks, vs, copy_from):
        n_local = ks[0].shape[0]
        device = jax.lax.axis_index(DATA)
        first = device * n_local
        want = copy_from[jnp.arange(n_local) + first]  # -1: no copy into it
        same = (want >= 0) & (want // n_local == device)
        # copies between this device's own streams: a local gather of the old blocks
        old = tuple(ks + vs)
        new = tuple(x[jnp.where(same, want - first, jnp.arange(n_local))] for x in old)

        def from_source(src, new):
            owner = src // n_local
            into = (want == src) & (owner != device)  # local streams that copy src
            needed = jnp.any((copy_from == src) & (jnp.arange(n_stream) // n_local != owner))

            def send(new):
                out = []
                for x_old, x_new in zip(old, new):
                    mine = jax.lax.dynamic_index_in_dim(x_old, src % n_local, keepdims=False)
                    block = jax.lax.psum(jnp.where(device == owner, as_bits(mine), 0), DATA)
                    block = jax.lax.bitcast_convert_type(block, x_old.dtype)
                    out.append(jnp.where(into.reshape((-1,) + (1,) * block.ndim), block[None], x_new))
                return tuple(out)

            return jax.lax.cond(needed, send, lambda new: new, new)

        new = jax.lax.fori_loop(0, n_stream, from_source, new)
        return new[: len(ks)], new[len(ks) :]

    k, v = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=((buf,) * len(cache.k), (buf,) * len(cache.v), P()),
        out_specs=((buf,) * len(cache.k), (buf,) * len(cache.v)),
        check_vma=False,
    )(cache.k, cache.v, memory.copy_from)
    return memory.replace(cache=cache.replace(k=k, v=v), copy_from=jnp.minimum(memory.copy_from, -1))


def _apply_shifts(memory: StreamCache) -> StreamCache:
    """Each stream's pending K-shift and defrag (every stream in place: no stream reads another's K/V)."""
    # under vmap each stream's K-shift and defrag `cond` turns into a select that runs both branches
    # over every stream's K/V: only enter it when some stream has a shift or a defrag pending (a
    # copy alone, as after sharing a prompt, needs neither)
    cache = jax.lax.cond(_shift_or_defrag(memory.cache.cells), jax.vmap(apply_update), lambda c: c, memory.cache)
    return memory.replace(cache=cache)


_copy_streams = JitTwins(_apply_copies, static_argnums=1, donate_argnums=0)
_shift_streams = JitTwins(_apply_shifts, donate_argnums=0)


def _shift_or_defrag(cells: Cells) -> Bool[Array, ""]:
    """Whether some stream has a K-shift or a defrag pending (the stacked cells of every stream)."""
    return jnp.any(cells.delta != 0) | jnp.any(cells.defrag)


def init_streams(config: StreamsConfig) -> StreamCache:
    """A new, empty memory of ``config.n_stream`` streams (zeroed K/V)."""
    return _init(config)


@functools.partial(jax.jit, static_argnums=0)
def _init(config: StreamsConfig) -> StreamCache:
    one = init_unified(config.base)
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (config.n_stream,) + x.shape), one)
    return StreamCache(
        cache=stacked,
        copy_from=jnp.full((config.n_stream,), -1, jnp.int32),
        error=jnp.zeros((), jnp.uint32),
        config=config,
    )
