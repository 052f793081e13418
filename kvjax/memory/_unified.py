"""The cache pytree: cells plus stacked K/V storage per layer group; init, write, view, sizes.

Layout (see the shape legend in ``kvjax._typing``): each layer group ``g`` of
``config.groups`` stores ``k[g]: [L, H, C, D]`` and ``v[g]: [L, H, C, Dv]``. Heads come before
cells because XLA's CPU backend reads ``[H, C, D]`` several times faster in decode attention
than ``[C, H, D]`` (it transposes the latter per layer); writes cost the same either way.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    >>> cache = kvjax.init(cfg)
    >>> cache.k[0].shape, kvjax.size_k_bytes(cfg), kvjax.total_size(cfg)
    ((2, 2, 256, 16), 65536, 131072)
    >>> kvjax.abstract(cfg).k[0]
    ShapeDtypeStruct(shape=(2, 2, 256, 16), dtype=float32)
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._typing import Array, Float, Int
from kvjax.memory import _cells
from kvjax.storage import _quant
from kvjax.memory._cells import Cells, empty_cells
from kvjax.memory._config import CacheConfig
from kvjax.memory._protocol import Memory, not_defined, require_live
from kvjax._errors import ErrorFlag
from kvjax._validate import INT32_MAX, INT32_MIN, check_int_values, check_window, concrete_int, is_traced
from kvjax.memory._slots import find_slot_cells
from kvjax.memory._slots import prepare_cells
from kvjax.memory._update import apply_update
from kvjax._axes import kv_axes


@struct.dataclass
class KVCache(Memory):
    """An immutable KV cache value: the unified cache, kvjax's first memory.

    It is one attention part (itself) serving every cached layer. The protocol methods
    (:class:`kvjax.memory._protocol.Memory`) trust their arguments; call the validating free
    functions (``kvjax.seq_rm(cache, ...)``) instead unless you are writing a memory.

    Attributes:
        cells: the cell metadata (:class:`kvjax.Cells`).
        k: one ``[L, H, C, D]`` array per layer group.
        v: one ``[L, H, C, Dv]`` array per layer group.
        config: the static :class:`CacheConfig`.
    """

    cells: Cells
    k: Tuple[Float[Array, "L H C D"], ...]
    v: Tuple[Float[Array, "L H C Dv"], ...]
    config: CacheConfig = struct.field(pytree_node=False)

    # -- identity and sequences (the cells; K/V are shared with the old value) ----------------

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    @property
    def size(self) -> int:
        return self.config.size

    def _with_cells(self, cells: Cells) -> "KVCache":
        return self.replace(cells=cells)

    def clear(self) -> "KVCache":
        return self._with_cells(_cells.clear(self.cells))

    def seq_rm(self, seq_id, p0, p1):
        # the unified cache never refuses a removal (llama.cpp's returns true)
        return self._with_cells(_cells.seq_rm(self.cells, seq_id, p0, p1)), np.bool_(True)

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1) -> "KVCache":
        return self._with_cells(_cells.seq_cp(self.cells, seq_id_src, seq_id_dst, p0, p1))

    def seq_keep(self, seq_id) -> "KVCache":
        return self._with_cells(_cells.seq_keep(self.cells, seq_id))

    def seq_add(self, seq_id, p0, p1, delta) -> "KVCache":
        return self._with_cells(_cells.seq_add(self.cells, seq_id, p0, p1, delta))

    def seq_div(self, seq_id, p0, p1, d) -> "KVCache":
        return self._with_cells(_cells.seq_div(self.cells, seq_id, p0, p1, d))

    def seq_pos_min(self, seq_id):
        return _cells.seq_pos_min(self.cells, seq_id)

    def seq_pos_max(self, seq_id):
        return _cells.seq_pos_max(self.cells, seq_id)

    def seq_shared(self, seq_id, p0, p1):
        return _cells.seq_shared(self.cells, seq_id, p0, p1)

    def used_cells(self):
        return _cells.used_cells(self.cells)

    def n_tokens(self):
        return _cells.n_tokens(self.cells)

    def pos_max(self):
        return _cells.pos_max(self.cells)

    # -- placement ------------------------------------------------------------------------------

    def find_slot(self, ubatch, *, contiguous: bool = True):
        cells, slot, ok = find_slot_cells(self.cells, ubatch, contiguous=contiguous)
        return self._with_cells(cells), slot, ok

    def prepare(self, ubatches, *, contiguous: bool = True):
        return prepare_cells(self.cells, tuple(ubatches), contiguous=contiguous)

    # -- the one attention part ---------------------------------------------------------------------

    @property
    def n_parts(self) -> int:
        return 1

    def layer_part(self, layer: int) -> int:
        return 0

    def part(self, index: int) -> "KVCache":
        return self

    def with_part(self, index: int, cache: "KVCache") -> "KVCache":
        return cache

    def part_slots(self, placement, index: int):
        return placement

    def extent(self):
        return _cells.cell_max(self.cells)[None]

    def extent_after(self, n_tokens):
        # placement starts at or after head and every cell from cell_max on is free, so it never
        # passes max(cell_max, head) + n_tokens; n_tokens is capped at size first (the extent never
        # passes it, and head + 2**31 - 1 would wrap int32 to a small window)
        top = _cells.cell_max(self.cells)
        n_tokens = jnp.minimum(n_tokens, self.size)
        return jnp.where(n_tokens == 0, top, jnp.maximum(top, self.cells.head) + n_tokens)[None]

    # -- pending work -------------------------------------------------------------------------------

    def pending(self):
        return _cells.has_shift(self.cells) | self.cells.defrag

    def update(self, *, donate: bool = False) -> "KVCache":
        return apply_update(self, donate=donate)

    @property
    def can_shift(self) -> bool:
        # the seed's unified cache can always shift: with RoPE parameters update rotates K, without
        # them (ALiBi, position-free K) it moves the positions only, which is exact for such K
        return True

    # -- placement on a device mesh ---------------------------------------------------------------------

    def logical_axes(self) -> "KVCache":
        # K and V are [L, H, C, D] (quantized: D = the row's block bytes): only H is split by the
        # default rules; the cells are read whole by every sequence operation and placement. A latent
        # cache's one kv head serves every query head: it stays whole (replicated over "model")
        latent = self.config.mla
        return self.replace(
            cells=self.cells.logical_axes(),
            k=tuple(kv_axes(latent) for _ in self.k),
            v=tuple(kv_axes(latent) for _ in self.v),
        )

    # -- donation, errors, sizes, state ---------------------------------------------------------------

    def split(self):
        return (self.k, self.v), self.replace(k=(), v=())

    def join(self, buffers) -> "KVCache":
        k, v = buffers
        return self.replace(k=tuple(k), v=tuple(v))

    def error_bits(self):
        return self.cells.error

    def clear_errors(self) -> "KVCache":
        # derived from the old word, so it stays where it was (a fresh zero lands on the default device)
        return self._with_cells(self.cells.replace(error=self.cells.error & jnp.uint32(0)))

    def flag_errors(self, bits) -> "KVCache":
        return self._with_cells(self.cells.replace(error=self.cells.error | jnp.asarray(bits, jnp.uint32)))

    def nbytes(self) -> int:
        return total_size(self.config)


def _storage_dtype(name: str):
    return _quant.storage_dtype(name)


def init_unified(config: CacheConfig) -> KVCache:
    """A new, empty unified cache with zeroed K/V (zeros, not garbage: no NaN reaches a masked softmax)."""
    return _init(config)


@functools.partial(jax.jit, static_argnums=0)
def _init(config: CacheConfig) -> KVCache:
    k, v = [], []
    for grp in config.groups:
        n = len(grp.layers)
        # a block type stores each cell's row as its ggml blocks: [L, H, C, D // 32 * bytes] uint8
        # (zero bytes decode to zeros: f16 scale 0)
        k.append(
            jnp.zeros(
                (n, grp.n_kv_heads, config.size, _quant.stored_width(config.k_dtype, grp.head_dim)),
                _storage_dtype(config.k_dtype),
            )
        )
        # a latent (MLA) cache has no V storage: its V leaf is zero-width, so every operation
        # that moves K and V together (defrag, state, streams, sharding) moves nothing for it
        v_width = 0 if config.mla else _quant.stored_width(config.v_dtype, grp.head_dim_v)
        v.append(jnp.zeros((n, grp.n_kv_heads, config.size, v_width), _storage_dtype(config.v_dtype)))
    return KVCache(cells=empty_cells(config.size, config.n_seq_max), k=tuple(k), v=tuple(v), config=config)


# -- sizes -------------------------------------------------------------------------------------


def _config_of(x: Union[KVCache, CacheConfig]) -> CacheConfig:
    return x.config if isinstance(x, KVCache) else x


def size_k_bytes(x: Union[KVCache, CacheConfig]) -> int:
    """Bytes of K storage over all cached layers (the seed's ``size_k_bytes``; real block bytes)."""
    cfg = _config_of(x)
    return sum(
        cfg.size * cfg.n_kv_heads[il] * _quant.row_bytes(cfg.k_dtype, cfg.head_dim[il]) for il in cfg.cached_layers
    )


def size_v_bytes(x: Union[KVCache, CacheConfig]) -> int:
    """Bytes of V storage over all cached layers (the seed's ``size_v_bytes``; real block bytes).

    0 for a latent (MLA) cache: its V is a view of K.
    """
    cfg = _config_of(x)
    if cfg.mla:
        return 0
    return sum(
        cfg.size * cfg.n_kv_heads[il] * _quant.row_bytes(cfg.v_dtype, cfg.head_dim_v[il]) for il in cfg.cached_layers
    )


def size_cells_bytes(x: Union[KVCache, CacheConfig]) -> int:
    """Bytes of cell metadata (pos, seq bitmask, delta, head, error)."""
    cfg = _config_of(x)
    return cfg.size * (4 + 4 * cfg.n_words + 4) + 8


def total_size(x: Union[KVCache, CacheConfig]) -> int:
    """Bytes of K and V storage together (the seed's ``total_size``; cells not included)."""
    return size_k_bytes(x) + size_v_bytes(x)


# -- K/V rows ----------------------------------------------------------------------------------


def require_cache(cache, operation: str = "this operation") -> None:
    """Raise unless ``cache`` is a :class:`KVCache` (every unified-cache entry point calls it).

    Another memory gets :class:`kvjax.NotDefinedError` naming ``operation`` (reach its attention
    parts with ``memory.part(i)``); anything else a ``ValueError``.
    """
    if isinstance(cache, KVCache):
        require_live(cache, "cache")
        return
    if isinstance(cache, Memory):
        raise not_defined(
            cache,
            operation,
            "it is defined for a unified cache (kvjax.KVCache); reach an attention part with memory.part(i)",
        )
    raise ValueError(f"cache must be a kvjax.KVCache, got {type(cache).__name__}")


def _layer_index(config: CacheConfig, layer):
    """(group, index in group, valid) for a static or traced model layer id."""
    if not is_traced(layer):
        g, i = config.locate(concrete_int("layer", layer))
        return g, jnp.int32(i), jnp.bool_(True)
    if len(config.groups) != 1:
        raise ValueError(
            "a traced layer id needs all cached layers in one layer group (same kv "
            "heads and head sizes); pass a static int layer instead"
        )
    table = jnp.asarray(config.groups[0].layers, jnp.int32)
    hit = table == layer
    return 0, jnp.argmax(hit).astype(jnp.int32), jnp.any(hit)


def _check_rows(name, rows, grp_heads, grp_dim, n_tokens):
    expected = (n_tokens, grp_heads, grp_dim)
    if not hasattr(rows, "shape") or not hasattr(rows, "dtype"):
        raise ValueError(f"{name} must be a floating [T, H_kv, D] array, got {type(rows).__name__}")
    if tuple(rows.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(rows.shape)}: allowed {expected} ([T, H_kv, D] with T = len(slot))")
    if not jnp.issubdtype(rows.dtype, jnp.floating):
        raise ValueError(
            f"{name} has dtype {rows.dtype}: allowed a floating dtype (it is cast to the cache's storage dtype)"
        )


def write(
    cache: KVCache,
    layer,
    slot: Int[Array, " T"],
    k: Float[Array, "T H D"],
    v: Optional[Float[Array, "T H Dv"]] = None,
) -> KVCache:
    """Write a ubatch's K and V rows into the cells chosen by ``find_slot``.

    Rows whose slot is -1 (padding) are skipped; a slot outside ``[-1, size)`` is dropped and
    flagged in ``cells.error`` (never clipped into another cell). Under ``jit`` with the cache
    donated, XLA updates the buffers in place (see ``docs/architecture.md``).

    Args:
        cache: the cache.
        layer: model layer id: a static int, or a traced int32 when all cached layers form one
            layer group (e.g. inside ``lax.scan`` over layers).
        slot: ``i32[T]`` cell of each row.
        k: ``[T, H, D]`` K rows (any floating dtype; cast to ``config.k_dtype``).
        v: ``[T, H, Dv]`` V rows; None for a latent (MLA) cache, whose V is K's first ``Dv``
            columns (a V given there is refused: it could only be ignored).

    Returns:
        The cache with the rows written.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache = kvjax.write(cache, 0, jnp.array([3, -1]), jnp.ones((2, 1, 2)), jnp.ones((2, 1, 2)))
        >>> kvjax.view(cache, 0, 32)[0][0, 2:5, 0].tolist()
        [0.0, 1.0, 0.0]
    """
    require_cache(cache, "write")
    cfg = cache.config
    g, index, layer_ok = _layer_index(cfg, layer)
    grp = cfg.groups[g]
    if not is_traced(slot) and not isinstance(slot, jax.Array):
        host = np.asarray(slot)
        if host.size and not np.issubdtype(host.dtype, np.integer):
            raise ValueError(f"slot has dtype {host.dtype}: allowed an integer [T] array")
    check_int_values("slot", slot, INT32_MIN, INT32_MAX)
    if not is_traced(slot):  # a concrete bad slot raises; a traced one is dropped and flagged on device
        host = np.asarray(slot)
        if host.size and np.issubdtype(host.dtype, np.integer) and (host.min() < -1 or host.max() >= cfg.size):
            bad = int(host.min()) if host.min() < -1 else int(host.max())
            raise ValueError(f"slot contains {bad}: allowed cells in [-1, {cfg.size}) (-1: skip the row)")
    slot = jnp.asarray(slot)
    if slot.ndim != 1 or not jnp.issubdtype(slot.dtype, jnp.integer):
        raise ValueError(f"slot has shape {slot.shape} and dtype {slot.dtype}: allowed an integer [T] array")
    _check_rows("k", k, grp.n_kv_heads, grp.head_dim, slot.shape[0])
    check_v_rows(cfg, v, grp, slot.shape[0])
    return _write(cache, g, index, layer_ok, slot, k, v)


def check_v_rows(cfg: CacheConfig, v, grp, n_tokens: int) -> None:
    """``v`` fits the group: ``[T, H, Dv]`` rows, or None in a latent (MLA) cache (V is a view of K)."""
    if cfg.mla:
        if v is not None:
            raise ValueError(
                "v must be None for a latent cache (mla=True): V is a view of K's first "
                f"head_dim_v={grp.head_dim_v} columns, so write the latent there"
            )
        return
    if v is None:
        raise ValueError(f"v is None: allowed a floating [T, H_kv={grp.n_kv_heads}, Dv={grp.head_dim_v}] array")
    _check_rows("v", v, grp.n_kv_heads, grp.head_dim_v, n_tokens)


def latent_v(k_stored: Array, config: CacheConfig, head_dim_v: int) -> Array:
    """V of a latent (MLA) cache: the first ``head_dim_v`` columns of stored K rows (``[..., D*]``).

    For a block type these are K's first ``head_dim_v // 32`` blocks, whole (the config keeps
    ``head_dim_v`` a multiple of the block), so the slice is V in V's own storage format.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=3, head_dim_v=2, mla=True)
        >>> latent_v(jnp.arange(6.0).reshape(2, 3), cfg, 2).tolist()
        [[0.0, 1.0], [3.0, 4.0]]
    """
    return k_stored[..., : _quant.stored_width(config.k_dtype, head_dim_v)]


@functools.partial(jax.jit, static_argnums=1)
def _write(cache: KVCache, g: int, index, layer_ok, slot, k, v) -> KVCache:
    size = cache.config.size
    slot = slot.astype(jnp.int32)
    in_bounds = (slot >= 0) & (slot < size) & layer_ok
    bad = jnp.any((slot < -1) | (slot >= size))
    target = jnp.where(in_bounds, slot, size)  # out of bounds: dropped by the scatter
    # [L, H, C, D] indexed by (scalar, :, [T]) puts the T axis first: rows go in as [T, H, D].
    # only the written rows are converted (quantized to ggml blocks for a block type)
    cfg = cache.config
    new_k = cache.k[g].at[index, :, target].set(_quant.to_storage(k, cfg.k_dtype), mode="drop")
    new_v = (
        cache.v[g] if v is None else cache.v[g].at[index, :, target].set(_quant.to_storage(v, cfg.v_dtype), mode="drop")
    )
    error = cache.cells.error | jnp.where(bad, jnp.uint32(ErrorFlag.SLOT), jnp.uint32(0))
    error = error | jnp.where(layer_ok, jnp.uint32(0), jnp.uint32(ErrorFlag.LAYER))
    ks = cache.k[:g] + (new_k,) + cache.k[g + 1 :]
    vs = cache.v[:g] + (new_v,) + cache.v[g + 1 :]
    return cache.replace(k=ks, v=vs, cells=cache.cells.replace(error=error))


def view(cache: KVCache, layer, n_kv: int) -> Tuple[Float[Array, "H N D"], Float[Array, "H N Dv"]]:
    """K and V of the first ``n_kv`` cells of one layer, for attention.

    Args:
        cache: the cache.
        layer: model layer id (static int, or traced within a single layer group; a traced id
            that is not a cached layer cannot raise and reads the group's first layer).
        n_kv: static window N, a positive multiple of ``padding`` and at most ``size``.

    Returns:
        ``(k [H, N, D], v [H, N, Dv])`` in the storage dtypes (in a latent cache ``v`` is K's
        first ``Dv`` columns); a block-quantized type is returned
        dequantized to float32 (attention itself never makes this copy: it dequantizes chunk by
        chunk).
    """
    require_cache(cache, "view")
    cfg = cache.config
    n_kv = check_window(n_kv, cfg.padding, cfg.size)
    g, index, _ = _layer_index(cfg, layer)
    k = jax.lax.dynamic_index_in_dim(cache.k[g], index, axis=0, keepdims=False)[:, :n_kv]
    if cfg.mla:
        v = latent_v(k, cfg, cfg.groups[g].head_dim_v)
    else:
        v = jax.lax.dynamic_index_in_dim(cache.v[g], index, axis=0, keepdims=False)[:, :n_kv]
    if _quant.is_quantized(cfg.k_dtype):
        k = _quant.dequantize(k, cfg.k_dtype)
    if _quant.is_quantized(cfg.v_dtype):
        v = _quant.dequantize(v, cfg.v_dtype)
    return k, v
