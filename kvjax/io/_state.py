"""The seed's state format: ``state_write`` / ``state_read`` of one sequence or of the whole cache.

A blob is what ``llama_kv_cache_unified::state_write`` writes, field for field, little-endian,
without padding. ``n`` is the cell count; cells are taken in cell-index order; layers are the
cached layers in model-layer order::

    u32  cell_count n
    n x  { i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id }   # ids ascending; n_seq_id = 0 in a
                                                           # single-sequence blob
    u32  v_trans (0 or 1)
    u32  n_layer (number of cached layers)
    per layer:   i32 K ggml type, u64 K row size, n x K row        # row: H*D values, heads outer
    v_trans = 0, per layer:  i32 V type, u64 V row size, n x V row # row: H*Dv values
    v_trans = 1, per layer:  i32 V type, u32 V element size, u32 H*Dv,
                             H*Dv x { n x element }                 # V transposed: [H*Dv, n]

ggml type ids: F32 = 0, F16 = 1, BF16 = 30, and the block types Q4_0 = 2, Q4_1 = 3, Q5_0 = 6,
Q5_1 = 7, Q8_0 = 8 (``kvjax.memory._config.GGML_TYPE_IDS``). A block-quantized row is
``ggml_row_size(type, H*D)`` bytes: the cell's ``H*D/32`` blocks, heads outer, exactly the bytes kvjax
stores per cell (``[H, C, D/32*bytes]`` uint8), so they travel untouched. A blob whose type id is
not the cache's is refused (the memory unchanged); IQ4_NL (20) is not a kvjax storage type. kvjax stores one
layer's K as ``[H, C, D]``; the seed's row for cell ``c`` is ``k[:, c, :]`` flattened, so writing
is a gather of the cells and a transpose to ``[n, H, D]``, done on device.

Reading parses the whole blob on the host with numpy views (no copy of the K/V bytes), checks
every field against the cache, and only then builds the new cache with one host copy per layer
into a padded, aligned buffer, a zero-copy hand-over to XLA (dlpack, on the CPU backend) and one
jitted transpose/scatter per call. The device parts are compiled once per cell-count bucket
(the next power of two, at least ``MIN_ROWS``, at most the cache size), never per blob.

Where kvjax deliberately differs from the seed (and why):

- **A failed read leaves the cache as it was.** The seed clears the cache (whole read) or removes
  the destination sequence (per-sequence read) and throws. kvjax raises :class:`StateError`
  naming the field, the expected and the found value, before anything is built; the cache value
  passed in is still valid (it is immutable) and nothing was donated.
- **Stricter validation.** Sequence ids must lie in ``[0, n_seq_max)`` (the seed checks only
  ``< 0``), a cell may not name the same id twice, positions must be ``>= 0``, ``v_trans`` must be
  0 or 1, and in a whole-cache blob every cell must name at least one sequence (the seed would
  restore a cell with a position but no sequence, which kvjax cannot represent).
- **Scattered per-sequence reads.** ``contiguous=False`` places the cells into any free cells
  (the seed needs one contiguous window; ``contiguous=True``, the default, does what it does).
- **A whole read zeroes the K/V of the cells it leaves empty** (the seed leaves stale bytes;
  both are masked). It also never reads the old K/V, so ``donate=True`` can reuse their memory.
- **No pending K-shift is written.** The format has no field for a cell's pending shift: the
  seed would write shifted positions beside unrotated K rows. ``state_write`` refuses cells with
  a pending shift; apply it first (``kvjax.update``).

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1], [[0], [0, 1]]))
    >>> blob = kvjax.state_write(cache)
    >>> len(blob), blob[:4].hex()         # 4 + 2 cells (12 + 16 bytes) + 8 + K (12 + 16) + V (12 + 16)
    (96, '02000000')
    >>> restored = kvjax.state_read(kvjax.init(cfg), blob)
    >>> kvjax.state_write(restored) == blob
    True
"""

from __future__ import annotations

import functools
import struct

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.memory import _api as ops
from kvjax.storage import _quant
from kvjax.memory import _seqbits as seqbits
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import register_state_format
from kvjax.memory._unified import KVCache
from kvjax.memory._config import CacheConfig
from kvjax._errors import StateError
from kvjax.io._state_layout import (  # noqa: F401 (layer_layouts, layout_fingerprint: kvjax.io._state names)
    _UINT,
    LayerLayout,
    _elem_dtype,
    _Parsed,
    _parse,
    blob_size,
    check_host_cache,
    check_seq,
    layer_layouts,
    layout_fingerprint,
)
from kvjax.io._blob import (
    QUANTIZED_TYPE_IDS,
    as_view,
    encode_meta,
    host_array,
)
from kvjax.memory._ubatch import Ubatch, bucket_length
from kvjax._jit import JitTwins
from kvjax._validate import check_flag, is_traced
from kvjax._mesh import shardings_of

# K/V bytes travel as unsigned ints of the element size: bit-exact (no float conversion can
# touch a NaN payload) and exportable through dlpack, which knows no bfloat16.
_ALIGN = 64  # XLA's CPU client adopts host buffers without a copy when they are this aligned


# -- device parts -------------------------------------------------------------------------------


def _uint_of(dtype) -> np.dtype:
    return _UINT[_elem_dtype(dtype).itemsize]


@functools.partial(jax.jit, static_argnames=("full", "v_trans"))
def _gather(k, v, idx, *, full: bool, v_trans: bool):
    """Rows of the cells ``idx i32[T]`` as the state format lays them out, as unsigned ints.

    Returns per layer group ``K [L, T, H, D]`` and ``V [L, T, H, Dv]`` (``[L, H*Dv, T]`` when
    ``v_trans``). ``full``: ``idx`` is every cell in order, so no gather is needed.
    """

    def take(x):
        x = x if full else x.at[:, :, idx].get(mode="promise_in_bounds")  # [L, H, T, D]
        return jax.lax.bitcast_convert_type(x, jnp.dtype(_uint_of(x.dtype)))

    ks = tuple(take(x).transpose(0, 2, 1, 3) for x in k)
    if v_trans:
        vs = tuple(take(x).transpose(0, 1, 3, 2).reshape(x.shape[0], -1, idx.shape[0]) for x in v)
    else:
        vs = tuple(take(x).transpose(0, 2, 1, 3) for x in v)
    return ks, vs


def _to_storage(rows, like, trans: bool):
    """Host-layout rows (uint) as ``[L, H, T, D]`` in the storage dtype of ``like [L, H, C, D]``."""
    x = jax.lax.bitcast_convert_type(rows, like.dtype)
    if trans:  # [L, H*Dv, T] -> [L, H, Dv, T] -> [L, H, T, Dv]
        n_layers, heads, _, dim = like.shape
        return x.reshape(n_layers, heads, dim, -1).transpose(0, 1, 3, 2)
    return x.transpose(0, 2, 1, 3)


def _assemble_impl(k_old, v_old, k_rows, v_rows, *, v_trans: bool):
    """K/V of a whole read: the rows in cells ``[0, T)``, zeros after (those cells are empty)."""

    def one(old, rows, trans):
        new = _to_storage(rows, old, trans)
        if new.shape[2] == old.shape[2]:
            return new
        return jnp.zeros_like(old).at[:, :, : new.shape[2]].set(new)

    return (
        tuple(one(o, r, False) for o, r in zip(k_old, k_rows)),
        tuple(one(o, r, v_trans) for o, r in zip(v_old, v_rows)),
    )


def _place_impl(k_old, v_old, slot, k_rows, v_rows, *, v_trans: bool):
    """K/V with the rows scattered into the cells ``slot i32[T]`` (-1: padding, dropped)."""

    def one(old, rows, trans):
        target = jnp.where(slot >= 0, slot, old.shape[2])
        return old.at[:, :, target].set(_to_storage(rows, old, trans), mode="drop")

    return (
        tuple(one(o, r, False) for o, r in zip(k_old, k_rows)),
        tuple(one(o, r, v_trans) for o, r in zip(v_old, v_rows)),
    )


_assemble = JitTwins(_assemble_impl, static_argnames="v_trans", donate_argnums=(0, 1))
_place = JitTwins(_place_impl, static_argnames="v_trans", donate_argnums=(0, 1))


#: Smallest row bucket: blobs of up to this many cells share one compilation (padding a few
#: hundred rows costs microseconds; a compilation costs a few hundred milliseconds).
MIN_ROWS = 256


def _bucket(n: int, size: int) -> int:
    """Static row count for ``n`` cells: the next power of two, at least MIN_ROWS, at most the cache size."""
    return min(bucket_length(n, MIN_ROWS), size)


def _aligned_empty(shape, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + _ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _ALIGN
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def _to_device(x: np.ndarray) -> jax.Array:
    """A host buffer as a jax array; adopted without a copy on the CPU backend."""
    if jax.default_backend() == "cpu":
        try:
            return jax.dlpack.from_dlpack(x)
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass  # fall back to a copy
    return jnp.asarray(x)


def _rows_on(buffer: np.ndarray, like: jax.Array, trans: bool) -> jax.Array:
    """A host row buffer on the devices of the cache array ``like`` (``[L, H, C, D]``), split as it is.

    On one device the buffer is adopted without a copy (``_to_device``). On a mesh the rows go
    straight to the devices that hold their heads: a buffer committed to one device cannot meet a
    sharded cache in one program ("incompatible devices"), and a replicated one would be sliced on
    every device. Rows are ``[L, T, H, D]``, or ``[L, H*Dv, T]`` for a transposed V.
    """
    sharding = like.sharding
    if len(sharding.device_set) == 1:
        # adopted in place on the default device; a cache placed on another one gets its rows there
        (device,) = sharding.device_set
        return _to_device(buffer) if device == jax.devices()[0] else jax.device_put(buffer, device)
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return jnp.asarray(buffer)  # uncommitted: the program that reads it places it
    spec = tuple(sharding.spec) + (None,) * (4 - len(sharding.spec))
    layers, heads, _, dims = spec
    rows_spec = (layers, heads, None) if trans else (layers, None, heads, dims)
    return jax.device_put(buffer, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*rows_spec)))


def _host_rows(config: CacheConfig, parsed: _Parsed, rows: int, cache: KVCache):
    """Parsed K/V rows copied into padded, aligned buffers per layer group, on the cache's devices."""
    n = parsed.n
    k_bufs, v_bufs = [], []
    for grp in config.groups:
        n_l = len(grp.layers)
        k_bufs.append(
            _aligned_empty(
                (n_l, rows, grp.n_kv_heads, _quant.stored_width(config.k_dtype, grp.head_dim)), _uint_of(config.k_dtype)
            )
        )
        if config.mla:  # a latent cache: K rows only (its V leaves hold nothing)
            continue
        v_shape = (
            (n_l, grp.n_kv_heads * grp.head_dim_v, rows)
            if v_rows_transposed(config)
            else (n_l, rows, grp.n_kv_heads, _quant.stored_width(config.v_dtype, grp.head_dim_v))
        )
        v_bufs.append(_aligned_empty(v_shape, _uint_of(config.v_dtype)))
    for lay, k, v in zip(layer_layouts(config), parsed.k, parsed.v):
        kb = k_bufs[lay.group][lay.index]
        kb[:n] = k
        kb[n:] = 0
        if config.mla:
            continue
        vb = v_bufs[lay.group][lay.index]
        if v_rows_transposed(config):
            vb[:, :n] = v
            vb[:, n:] = 0
        else:
            vb[:n] = v
            vb[n:] = 0
    return (
        tuple(_rows_on(b, like, False) for b, like in zip(k_bufs, cache.k)),
        tuple(_rows_on(b, like, v_rows_transposed(config)) for b, like in zip(v_bufs, cache.v)),
    )


def v_rows_transposed(config: CacheConfig) -> bool:
    """Whether a blob's V rows are transposed: ``v_trans``, unless the cache is latent (it has no V rows)."""
    return config.v_trans and not config.mla


# -- host side ----------------------------------------------------------------------------------


def _members(masks: np.ndarray, seq_id: int) -> np.ndarray:
    """``bool[C]`` cells holding ``seq_id`` (any sequence when -1)."""
    return seqbits.host_holds(masks, seq_id)


def _host_cells(cache: KVCache):
    cells = cache.cells
    return host_array(cells.pos), host_array(cells.seq), host_array(cells.delta)


def write_unified(cache: KVCache, seq_id: int = -1) -> bytes:
    """The unified cache's :func:`state_write`: serialize the whole cache (``seq_id = -1``) or one sequence in the seed's state format.

    A single-sequence blob holds the cells of ``seq_id`` (in cell order) with ``n_seq_id = 0``:
    it is read back into any destination sequence. A whole-cache blob holds every non-empty cell
    with its sequence ids.

    Args:
        cache: the cache (concrete, on the host side of ``jit``).
        seq_id: in ``[-1, n_seq_max)``; -1 writes every non-empty cell.

    Returns:
        The blob (see the module docstring for its layout).

    Raises:
        ValueError: a bad argument, or a written cell has a pending K-shift.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
        >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([5, 6], [[1], [0]]))
        >>> blob = kvjax.state_write(cache, seq_id=1)
        >>> import struct; struct.unpack_from("<IiI", blob)   # one cell: pos 5, n_seq_id 0
        (1, 5, 0)
    """
    cfg = check_host_cache(cache, "state_write")
    seq_id = check_seq(seq_id, cfg)
    pos, masks, delta = _host_cells(cache)
    idx = np.flatnonzero(_members(masks, seq_id)).astype(np.int32)
    n = idx.size
    shifted = np.flatnonzero(delta[idx] != 0)
    if shifted.size:
        raise ValueError(
            f"cell {int(idx[shifted[0]])} has a pending K-shift (delta "
            f"{int(delta[idx[shifted[0]]])}): the state format cannot carry it; apply "
            f"it first (kvjax.update)"
        )
    layouts = layer_layouts(cfg)
    pieces = [
        struct.pack("<I", n),
        encode_meta(pos[idx], None if seq_id >= 0 else masks[idx], cfg.n_seq_max),
        struct.pack("<II", int(cfg.v_trans), len(layouts)),
    ]
    k_host = v_host = None
    rows = _bucket(n, cfg.size)
    if n:
        padded = np.zeros(rows, np.int32)
        padded[:n] = idx
        ks, vs = _gather(
            cache.k, _v_leaves(cache), jnp.asarray(padded), full=n == cfg.size, v_trans=v_rows_transposed(cfg)
        )
        k_host = [host_array(x) for x in ks]  # views of the device buffers on the CPU backend
        v_host = [host_array(x) for x in vs]
    for lay in layouts:
        pieces.append(struct.pack("<iQ", lay.k_type, lay.k_row))
        if n:
            pieces.append(memoryview(k_host[lay.group][lay.index, :n]))
    for lay in layouts if not cfg.mla else ():  # a latent cache has no V section (llama.cpp's MLA state)
        if not cfg.v_trans:
            pieces.append(struct.pack("<iQ", lay.v_type, lay.v_row))
            if n:
                pieces.append(memoryview(v_host[lay.group][lay.index, :n]))
        else:
            pieces.append(struct.pack("<iII", lay.v_type, lay.v_size, lay.n_embd_v))
            if n == rows:
                pieces.append(memoryview(v_host[lay.group][lay.index]))
            elif n:  # one piece per V component: each is contiguous, the padded block is not
                pieces.extend(memoryview(r) for r in v_host[lay.group][lay.index, :, :n])
    return b"".join(pieces)


def read_unified(cache: KVCache, data, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False) -> KVCache:
    """The unified cache's :func:`state_read`: restore a blob written by :func:`state_write` (or by the seed) into a cache.

    With ``seq_id = -1`` the blob must be a whole-cache blob: the cache is emptied and cell ``i``
    of the blob goes to cell ``i`` (from cell 0, as the seed does), ``head`` is 0. With
    ``seq_id >= 0`` the blob must be a single-sequence blob: the cells of ``seq_id`` are removed,
    then the blob's cells are placed for ``seq_id`` by :func:`kvjax.find_slot` (contiguous as the
    seed, or scattered over free cells) and their K/V rows written there. Pending shifts of the
    restored cells are zero; error bits of the cache are kept.

    Every field is checked before anything is built. On any mismatch :class:`StateError` names
    the field, the expected and the found value, and ``cache`` is left as it was (the seed would
    have cleared it or removed the sequence).

    Args:
        cache: the destination cache (concrete).
        data: the blob, any bytes-like object.
        seq_id: in ``[-1, n_seq_max)``: -1 for a whole-cache blob, else the destination sequence.
        contiguous: for a single-sequence blob, place its cells in one window (True, the seed) or
            in any free cells (False).
        donate: reuse the K/V buffers of ``cache`` for the result (faster, less memory; the old
            value's K/V must not be used afterwards). Nothing is donated when the read fails.

    Returns:
        The restored cache.

    Raises:
        StateError: the blob is corrupt or does not match the cache.
        ValueError: a bad argument.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
        >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1, 2], [[0]] * 3))
        >>> cache = kvjax.state_read(cache, kvjax.state_write(cache, 0), seq_id=1)   # copy 0 -> 1
        >>> int(kvjax.seq_pos_max(cache, 1)), int(kvjax.used_cells(cache))
        (2, 6)
        >>> kvjax.state_read(cache, b"\\x01\\x00")
        Traceback (most recent call last):
        ...
        kvjax.StateError: cell_count: expected 4 bytes at offset 0, found 2 (truncated blob)
    """
    cfg = check_host_cache(cache, "state_read")
    seq_id = check_seq(seq_id, cfg)
    contiguous, donate = check_flag("contiguous", contiguous), check_flag("donate", donate)
    buf = as_view(data)
    _, masks, _ = _host_cells(cache)
    if seq_id < 0:
        capacity, why = cfg.size, "the cache size"
    else:
        kept = seqbits.host_without(masks, seq_id)
        capacity = int((~kept.any(axis=1)).sum())
        why = f"the free cells once sequence {seq_id} is removed"
    parsed = _parse(cfg, buf, seq_id, capacity, why)
    if seq_id < 0:
        return _read_whole(cache, parsed, donate)
    return _read_seq(cache, parsed, seq_id, bool(contiguous), donate, kept)


def _read_whole(cache: KVCache, parsed: _Parsed, donate: bool) -> KVCache:
    cfg, n = cache.config, parsed.n
    pos = np.full(cfg.size, -1, np.int32)
    pos[:n] = parsed.pos
    seq = np.zeros((cfg.size, cfg.n_words), np.uint32)
    seq[:n] = parsed.seq
    cells = cache.cells.replace(
        pos=jnp.asarray(pos),
        seq=jnp.asarray(seq),
        delta=jnp.asarray(np.zeros(cfg.size, np.int32)),
        head=jnp.asarray(np.int32(0)),
        defrag=jnp.asarray(np.bool_(False)),
    )
    if n == 0:
        return cache.replace(cells=cells)
    k_rows, v_rows = _host_rows(cfg, parsed, _bucket(n, cfg.size), cache)
    k, v = _assemble(cache.k, _v_leaves(cache), k_rows, v_rows, v_trans=v_rows_transposed(cfg), donate=bool(donate))
    return cache.replace(cells=cells, k=k, v=v or cache.v)


def _v_leaves(cache: KVCache):
    """The V buffers a state read or write moves: none in a latent cache (its V leaves hold nothing)."""
    return () if cache.config.mla else cache.v


def _largest_free_run(free: np.ndarray) -> int:
    edges = np.diff(np.concatenate([[0], free.astype(np.int8), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return int((ends - starts).max()) if starts.size else 0


def _read_seq(
    cache: KVCache, parsed: _Parsed, seq_id: int, contiguous: bool, donate: bool, kept: np.ndarray
) -> KVCache:
    cfg, n = cache.config, parsed.n
    cleared, _ = ops.seq_rm(cache, seq_id, -1, -1)
    if n == 0:
        return cleared
    rows = _bucket(n, cfg.size)
    pos = np.zeros(rows, np.int32)
    pos[:n] = parsed.pos
    ids = np.full((rows, 1), -1, np.int32)
    ids[:n] = seq_id
    ub = Ubatch(pos=jnp.asarray(pos), seq_ids=jnp.asarray(ids), valid=jnp.asarray(np.arange(rows) < n))
    placed, slot, ok = ops.find_slot(cleared, ub, contiguous=contiguous)
    if not bool(ok):
        run = _largest_free_run(~kept.any(axis=1))
        raise StateError(
            f"cell_count: expected at most {run} (the largest contiguous run of free "
            f"cells once sequence {seq_id} is removed), found {n}; pass "
            f"contiguous=False to place the cells in any free cells"
        )
    k_rows, v_rows = _host_rows(cfg, parsed, rows, cache)
    k, v = _place(cache.k, _v_leaves(cache), slot, k_rows, v_rows, v_trans=v_rows_transposed(cfg), donate=bool(donate))
    return placed.replace(k=k, v=v or cache.v)


__all__ = ["state_write", "state_read", "layer_layouts", "layout_fingerprint", "LayerLayout", "QUANTIZED_TYPE_IDS"]


def state_write(memory, seq_id: int = -1) -> bytes:
    """The seed's state blob of a memory: the whole memory (``seq_id = -1``) or one sequence.

    Each memory writes its parts in the seed's order (the unified cache: :func:`write_unified`).

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> len(kvjax.state_write(cache))                  # an empty cache: cell count 0, layer layouts
        36
    """
    return require_memory(memory).state_write(seq_id)


def state_read(memory, data, seq_id: int = -1, **options):
    """A memory restored from a :func:`state_write` blob (the one passed in is never changed).

    Options are the memory's (the unified cache: ``contiguous``, ``donate``; see
    :func:`read_unified`). A blob that does not fit raises :class:`kvjax.StateError` naming the field.
    """
    memory = require_memory(memory)
    # the blob is decoded on the host: put the result where the memory it replaces lives (read the
    # placement first, a donated memory's buffers are gone after the read): a mesh, or one device
    # other than the default one (new host arrays land on the default device)
    default = {jax.devices()[0]}
    placed = any(
        isinstance(x, jax.Array) and not is_traced(x) and x.devices() != default for x in jax.tree.leaves(memory)
    )
    layout = shardings_of(memory) if placed else None
    restored = memory.state_read(data, seq_id, **options)
    return restored if layout is None else jax.device_put(restored, layout)


register_state_format(KVCache, write=write_unified, read=read_unified, size=blob_size)
