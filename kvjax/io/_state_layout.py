"""The unified cache's blob for a config: where every field lies, and every field checked.

:func:`layer_layouts` gives, per cached layer, the ggml type and row sizes a blob of this config
has; :func:`_parse` reads a whole blob against them with numpy views (nothing copied) and refuses
the first field that does not fit with :class:`kvjax.StateError` naming it, the expected and the
found value. :mod:`kvjax.io._state` writes and reads blobs with them; the session files take the
config's :func:`layout_fingerprint`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import List, NamedTuple, Optional, Tuple

import jax
import numpy as np

from kvjax.storage import _quant
from kvjax._validate import check_state_seq, is_traced
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._config import GGML_TYPE_IDS, CacheConfig
from kvjax._errors import StateError
from kvjax.io._blob import (
    Cursor,
    as_view,
    check_equal,
    check_type,
    parse_meta_seq,
    parse_meta_whole,
)

# K/V bytes travel as unsigned ints of the element size: bit-exact (no float conversion can
# touch a NaN payload) and exportable through dlpack, which knows no bfloat16.
_UINT = {4: np.dtype("<u4"), 2: np.dtype("<u2"), 1: np.dtype("u1")}


def _elem_dtype(name) -> np.dtype:
    """The array dtype of a storage leaf (uint8 for a block type)."""
    return np.dtype(_quant.storage_dtype(name)) if isinstance(name, str) else np.dtype(name)


def check_host_cache(cache, name: str) -> CacheConfig:
    require_cache(cache, name)
    if any(is_traced(x) for x in jax.tree.leaves(cache)):
        raise ValueError(f"{name} runs on the host (it reads or returns bytes): call it outside jax.jit")
    return cache.config


def check_seq(seq_id, config: CacheConfig) -> int:
    return check_state_seq(seq_id, config.n_seq_max)


# -- layout of a config -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerLayout:
    """What the state format says about one cached layer.

    Attributes:
        layer: model layer id.
        group: index into ``config.groups``.
        index: position of the layer in its group (the stacked axis L).
        n_kv_heads: H.
        head_dim: D.
        head_dim_v: Dv.
        k_type: ggml type id of K.
        k_size: bytes per K element (1 for a block type: its stored elements are bytes).
        v_type: ggml type id of V.
        v_size: bytes per V element.
        k_width: stored K elements per head (D, or ``D / 32 * block bytes`` for a block type).
        v_width: stored V elements per head (0 in a latent cache: it stores no V).
    """

    layer: int
    group: int
    index: int
    n_kv_heads: int
    head_dim: int
    head_dim_v: int
    k_type: int
    k_size: int
    v_type: int
    v_size: int
    k_width: int = 0
    v_width: int = 0

    @property
    def k_row(self) -> int:
        """Bytes of one cell's K row (the seed's ``ggml_row_size(type, n_embd_k_gqa)``)."""
        return self.n_kv_heads * self.k_width * self.k_size

    @property
    def n_embd_v(self) -> int:
        """The seed's ``n_embd_v_gqa``: H * Dv."""
        return self.n_kv_heads * self.head_dim_v

    @property
    def v_row(self) -> int:
        """Bytes of one cell's V row."""
        return self.n_kv_heads * self.v_width * self.v_size


def layer_layouts(config: CacheConfig) -> Tuple[LayerLayout, ...]:
    """The state layout of every cached layer, in model-layer order.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=3, n_kv_heads=2, head_dim=4,
        ...                         layer_filter=[0, 2])
        >>> [(lay.layer, lay.k_type, lay.k_row) for lay in layer_layouts(cfg)]
        [(0, 0, 32), (2, 0, 32)]
    """
    k_size = _elem_dtype(config.k_dtype).itemsize
    v_size = _elem_dtype(config.v_dtype).itemsize
    out = []
    for il in config.cached_layers:
        g, i = config.locate(il)
        out.append(
            LayerLayout(
                il,
                g,
                i,
                config.n_kv_heads[il],
                config.head_dim[il],
                config.head_dim_v[il],
                GGML_TYPE_IDS[config.k_dtype],
                k_size,
                GGML_TYPE_IDS[config.v_dtype],
                v_size,
                _quant.stored_width(config.k_dtype, config.head_dim[il]),
                0 if config.mla else _quant.stored_width(config.v_dtype, config.head_dim_v[il]),
            )
        )
    return tuple(out)


def layout_fingerprint(config: CacheConfig) -> bytes:
    """SHA-256 of every config field that changes the byte layout of a state blob.

    Those are the cached layer ids (of ``n_layer``), each layer's kv heads and head sizes, the
    K/V dtypes and ``v_trans``. The cache size and ``n_seq_max`` are not in it: a blob fits any
    cache with room for its cells and sequence ids, which ``state_read`` checks itself.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4)
        >>> len(layout_fingerprint(cfg)), layout_fingerprint(cfg) == layout_fingerprint(cfg.replace(size=64))
        (32, True)
    """
    desc = {
        "format": "llama_kv_cache_unified state",
        "n_layer": config.n_layer,
        "layers": [[lay.layer, lay.n_kv_heads, lay.head_dim, lay.head_dim_v] for lay in layer_layouts(config)],
        "k_dtype": config.k_dtype,
        "v_dtype": config.v_dtype,
        "v_trans": config.v_trans,
        **({"mla": True} if config.mla else {}),  # absent otherwise: older fingerprints stay as they were
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).digest()


# -- parsing ------------------------------------------------------------------------------------


class _Parsed(NamedTuple):
    """A validated blob: host views into its bytes (nothing copied yet)."""

    n: int
    pos: np.ndarray  # i32[n]
    seq: Optional[np.ndarray]  # u32[n, W] (whole-cache blobs), None (single sequence)
    k: List[np.ndarray]  # per cached layer: uint [n, H, D]
    v: List[np.ndarray]  # per cached layer: uint [n, H, Dv], or [H*Dv, n] (v_trans)
    size: int  # bytes of the blob


def _row_why(n_heads: int, head_dim: int, width: int, size: int) -> str:
    """How a row size is made up, for a refusal message."""
    if width == head_dim:
        return f" bytes ({n_heads} heads x head size {head_dim} x {size})"
    n_blocks = head_dim // _quant.BLOCK
    return f" bytes ({n_heads} heads x head size {head_dim} = {n_blocks} blocks of {width // n_blocks} bytes)"


def blob_size(cache: KVCache, data, seq_id: int = -1) -> int:
    """Bytes of the unified cache blob at the start of ``data`` (a composite memory's parts follow it).

    Every field is checked as :func:`read_unified` checks it (:class:`kvjax.StateError` otherwise).
    """
    cfg = check_host_cache(cache, "state_read")
    return _parse(cfg, as_view(data), check_seq(seq_id, cfg), cfg.size, "the cache size", trailing=True).size


def _parse(
    config: CacheConfig, buf: memoryview, seq_id: int, capacity: int, why: str, trailing: bool = False
) -> _Parsed:
    """Check every field of ``buf`` against ``config``; return host views of its contents.

    With ``trailing`` the blob may be followed by more bytes (another part's blob).
    """
    cur = Cursor(buf)
    n = cur.scalar("<I", "cell_count")
    if n > capacity:
        raise StateError(f"cell_count: expected at most {capacity} ({why}), found {n}")
    if seq_id < 0:
        pos, seq = parse_meta_whole(cur, n, config.n_seq_max, config.n_words)
    else:
        pos, seq = parse_meta_seq(cur, n), None
    v_trans = cur.scalar("<I", "v_trans")
    check_equal("v_trans", int(config.v_trans), v_trans, " (config.v_trans)")
    layouts = layer_layouts(config)
    n_layer = cur.scalar("<I", "n_layer")
    check_equal("n_layer", len(layouts), n_layer, f" (cached layers {list(config.cached_layers)})")
    ks, vs = [], []
    for lay in layouts:
        name = f"layer {lay.layer}"
        check_type(f"{name} K type", lay.k_type, cur.scalar("<i", f"{name} K type"))
        check_equal(
            f"{name} K row size",
            lay.k_row,
            cur.scalar("<Q", f"{name} K row size"),
            _row_why(lay.n_kv_heads, lay.head_dim, lay.k_width, lay.k_size),
        )
        rows = cur.array(_UINT[lay.k_size], n * lay.n_kv_heads * lay.k_width, f"{name} K rows")
        ks.append(rows.reshape(n, lay.n_kv_heads, lay.k_width))
    if config.mla:  # a latent cache's blob has no V section: V is K's first columns
        vs = [np.zeros((n, lay.n_kv_heads, 0), _UINT[lay.v_size]) for lay in layouts]
    for lay in layouts if not config.mla else ():
        name = f"layer {lay.layer}"
        check_type(f"{name} V type", lay.v_type, cur.scalar("<i", f"{name} V type"))
        if not config.v_trans:
            check_equal(
                f"{name} V row size",
                lay.v_row,
                cur.scalar("<Q", f"{name} V row size"),
                _row_why(lay.n_kv_heads, lay.head_dim_v, lay.v_width, lay.v_size),
            )
            rows = cur.array(_UINT[lay.v_size], n * lay.n_kv_heads * lay.v_width, f"{name} V rows")
            vs.append(rows.reshape(n, lay.n_kv_heads, lay.v_width))
        else:
            check_equal(f"{name} V element size", lay.v_size, cur.scalar("<I", f"{name} V element size"))
            check_equal(
                f"{name} V n_embd_v_gqa",
                lay.n_embd_v,
                cur.scalar("<I", f"{name} V n_embd_v_gqa"),
                f" ({lay.n_kv_heads} heads x head size {lay.head_dim_v})",
            )
            rows = cur.array(_UINT[lay.v_size], n * lay.n_embd_v, f"{name} V rows (transposed)")
            vs.append(rows.reshape(lay.n_embd_v, n))
    if not trailing:
        cur.finish()
    return _Parsed(n, pos, seq, ks, vs, cur.off)
