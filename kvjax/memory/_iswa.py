"""The iSWA memory: a full-size cache for the full-attention layers and a small one for the window layers.

The seed's ``llama_kv_cache_unified_iswa``. Models that interleave sliding-window and
full-attention layers (Gemma 2 and 3, Cohere, Llama 4's chunked layers) need every past token
only in their full layers; their window layers see at most ``n_swa`` positions back. So the pair
keeps two unified caches (:class:`kvjax.KVCache`), each an attention part of the memory:

- ``base`` (part 0): the full layers, ``size`` cells, no window;
- ``swa`` (part 1): the window layers, ``min(size, pad(n_swa * n_seq_max + n_batch, padding))``
  cells (or ``size`` with ``swa_full``), masked with the window, and pruned after every batch.

Every sequence operation applies to both; a ubatch is placed only when both caches take it
(otherwise neither changes); after a successful batch :meth:`IswaCache.commit` makes the window
cache forget, per sequence, the cells that no later token of that sequence can attend to (the
seed's pending ``pmax`` per sequence and ``prune_swa``). ``seq_pos_min/max`` come from the window
cache (the base cache holds a superset), ``used_cells``/``n_tokens``/``pos_max`` from the base.
Positions can only be shifted when the two caches have the same size (``swa_full``): a pruned
window cache has lost the tokens a shift would bring back into view.

Example:
    >>> import kvjax
    >>> base = kvjax.CacheConfig(size=256, n_seq_max=2, n_layer=4, n_kv_heads=1, head_dim=8)
    >>> cfg = kvjax.IswaConfig(base, swa_layers=(0, 2), n_swa=8, n_batch=16)
    >>> memory = kvjax.init(cfg)
    >>> memory.base.config.size, memory.swa.config.size, memory.layer_part(2)
    (256, 32, 1)
    >>> ub = kvjax.make_ubatch(range(20), [[0]] * 20)
    >>> memory, placement, ok = kvjax.find_slot(memory, ub)
    >>> memory = kvjax.commit(memory, [ub])            # positions 0..11 can no longer be seen
    >>> int(kvjax.used_cells(memory.base)), int(kvjax.used_cells(memory.swa)), int(kvjax.seq_pos_min(memory, 0))
    (20, 8, 12)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._validate import check_count, check_flag, require
from kvjax.attn._mask import is_masked_swa
from kvjax.memory import _seqbits
from kvjax.memory._cells import Cells, is_used
from kvjax.memory._config import CacheConfig, SwaType
from kvjax.memory._composite import Composite
from kvjax.memory._unified import KVCache, init_unified

__all__ = ["IswaConfig", "IswaCache", "init_iswa"]


@dataclasses.dataclass(frozen=True)
class IswaConfig:
    """The iSWA pair's description (frozen, hashable, validated on construction).

    Attributes:
        base: the cache description of the whole model (size = cells of the full-size cache, every
            cached layer, heads, dtypes, padding, RoPE). Its own window must be ``"none"``.
        swa_layers: the cached layers that use the sliding window (the others are full layers).
        n_swa: the window size (> 0).
        swa_type: the window kind (``"standard"``, ``"chunked"`` or ``"symmetric"``).
        swa_full: give the window cache the full size and never prune it (then positions can be
            shifted, as in the seed).
        n_batch: the most tokens of one batch (the seed's ``n_batch``; it sizes the window cache so
            a whole batch fits beside every sequence's window).

    Derived: ``base_config`` and ``swa_config`` (the two unified caches), ``size_swa``.

    Example:
        >>> base = CacheConfig(size=1024, n_seq_max=4, n_layer=6, n_kv_heads=2, head_dim=16)
        >>> cfg = IswaConfig(base, swa_layers=(0, 1, 3, 4), n_swa=64, n_batch=128)
        >>> cfg.size_swa, cfg.base_config.cached_layers, cfg.swa_config.cached_layers
        (384, (2, 5), (0, 1, 3, 4))
    """

    base: CacheConfig
    swa_layers: Tuple[int, ...]
    n_swa: int
    swa_type: Union[SwaType, str] = SwaType.STANDARD
    swa_full: bool = False
    n_batch: int = 512

    def __post_init__(self):
        if not isinstance(self.base, CacheConfig):
            raise ValueError(f"base must be a kvjax.CacheConfig, got {type(self.base).__name__}")
        require(
            self.base.swa_type == SwaType.NONE,
            "base.swa_type",
            self.base.swa_type.value,
            "'none' (the window of the window layers is IswaConfig's swa_type / n_swa)",
        )
        try:
            layers = tuple(sorted(set(int(il) for il in self.swa_layers)))
        except (TypeError, ValueError):
            raise ValueError(
                f"swa_layers={self.swa_layers!r} is out of range: allowed a sequence of cached layer ids"
            ) from None
        cached = self.base.cached_layers
        for il in layers:
            require(il in cached, "swa_layers", il, f"cached layer ids {list(cached)}")
        require(
            len(layers) >= 1,
            "swa_layers",
            self.swa_layers,
            "at least one window layer (else use a kvjax.CacheConfig alone)",
        )
        require(
            len(layers) < len(cached),
            "swa_layers",
            self.swa_layers,
            "at least one full layer left (a model "
            "whose every layer has a window: use one kvjax.CacheConfig with swa_type and n_swa)",
        )
        object.__setattr__(self, "swa_layers", layers)
        try:
            object.__setattr__(self, "swa_type", SwaType(self.swa_type))
        except ValueError:
            raise ValueError(
                f"swa_type={self.swa_type!r} is out of range: allowed 'standard', 'chunked' or 'symmetric'"
            ) from None
        require(self.swa_type != SwaType.NONE, "swa_type", "none", "'standard', 'chunked' or 'symmetric'")
        object.__setattr__(self, "n_swa", check_count("n_swa", self.n_swa, 1))
        object.__setattr__(self, "n_batch", check_count("n_batch", self.n_batch, 1))
        object.__setattr__(self, "swa_full", check_flag("swa_full", self.swa_full))

    @property
    def n_seq_max(self) -> int:
        return self.base.n_seq_max

    def first_visible(self, n: int) -> int:
        """The oldest position a token at position ``n`` sees in a window layer (may be negative).

        Example:
            >>> base = CacheConfig(size=64, n_seq_max=1, n_layer=2, n_kv_heads=1, head_dim=2)
            >>> IswaConfig(base, swa_layers=(0,), n_swa=8).first_visible(20)
            13
        """
        return {
            "standard": n - self.n_swa + 1,
            "chunked": (n // self.n_swa) * self.n_swa,
            "symmetric": n - self.n_swa // 2,
        }[self.swa_type.value]

    @property
    def size_swa(self) -> int:
        """Cells of the window cache (the seed's rule)."""
        if self.swa_full:
            return self.base.size
        pad = self.base.padding
        return min(self.base.size, -(-(self.n_swa * self.base.n_seq_max + self.n_batch) // pad) * pad)

    @property
    def base_config(self) -> CacheConfig:
        """The full-size cache: the full layers, no window."""
        full = tuple(il for il in self.base.cached_layers if il not in self.swa_layers)
        return self.base.replace(layer_filter=full)

    @property
    def swa_config(self) -> CacheConfig:
        """The window cache: the window layers, ``size_swa`` cells, masked with the window."""
        return self.base.replace(
            size=self.size_swa, layer_filter=self.swa_layers, swa_type=self.swa_type, n_swa=self.n_swa
        )


@struct.dataclass
class IswaCache(Composite):
    """The iSWA pair (see the module docstring): ``base`` (part 0) and ``swa`` (part 1).

    A :class:`~kvjax.memory._composite.Composite` of two unified caches: every verb and query is
    routed by its rules; the pair's own are the layer routing, the window cache's pruning on
    ``commit``, and what a pruned window cache can no longer do (shift, lend a prefix, roll back).

    Attributes:
        base: the full-size unified cache of the full layers.
        swa: the window cache of the window layers.
        config: the static :class:`IswaConfig`.
    """

    base: KVCache
    swa: KVCache
    config: IswaConfig = struct.field(pytree_node=False)

    MEMBERS: ClassVar[Tuple[str, ...]] = ("base", "swa")
    MAIN: ClassVar[str] = "base"
    POSITIONS: ClassVar[Tuple[str, ...]] = ("swa",)  # the base holds a superset of the window cache

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    def layer_part(self, layer: int) -> int:
        return 1 if layer in self.config.swa_layers else 0

    def commit(self, ubatches: Sequence) -> "IswaCache":
        """After a successful batch, prune the window cache (not with ``swa_full``)."""
        if self.config.swa_full or not ubatches:
            return self
        return self.replace(
            swa=self.swa.replace(
                cells=_prune(self.swa.cells, tuple(ubatches), swa_type=self.config.swa_type, n_swa=self.config.n_swa)
            )
        )

    @property
    def can_shift(self) -> bool:
        # the seed's rule: a pruned window cache has lost what a shift would bring into view
        return self.config.base.size == self.config.size_swa

    def prefix_visible(self, seq_id: int, n: int) -> bool:
        # the window cache must still hold the oldest position a token at n can see (pruned ones are gone)
        if not self.base.prefix_visible(seq_id, n):
            return False
        held = int(self.swa.seq_pos_min(np.int32(seq_id)))
        return held >= 0 and held <= max(0, self.config.first_visible(n))

    @property
    def rollback_depth(self):
        # a pruned window cache has forgotten the cells a token at an earlier position would see
        # again: only swa_full (no pruning) removes the last positions exactly, as llama.cpp's
        # speculative decoding with SWA models needs --swa-full
        return None if self.config.swa_full else 0


@functools.partial(jax.jit, static_argnames=("swa_type", "n_swa"))
def _prune(cells: Cells, ubatches, *, swa_type: SwaType, n_swa: int) -> Cells:
    """The seed's ``prune_swa`` for every sequence of a batch, in one program.

    ``pmax[s]`` is the largest position of sequence ``s`` in the batch (every seq id of every
    token counts); a cell of ``s`` whose position is outside the window of ``pmax[s]`` cannot be
    attended by any later token of ``s``, so ``s`` leaves it; a cell left without sequences is
    freed (kvjax also clears its pending shift). ``head`` does not move (as in the seed).
    """
    n_seq = cells.n_seq_max
    pmax = jnp.full((n_seq,), -1, jnp.int32)
    for ub in ubatches:
        ids = ub.seq_ids
        take = ub.valid[:, None] & (ids >= 0)
        pos = jnp.broadcast_to(ub.pos[:, None], ids.shape).astype(jnp.int32)
        pmax = pmax.at[jnp.where(take, ids, n_seq)].max(jnp.where(take, pos, -1), mode="drop")
    seqs = jnp.arange(n_seq, dtype=jnp.int32)
    member = _seqbits.holds(cells.seq.T, seqs)  # [S, C]
    masked = is_masked_swa(cells.pos[None, :], pmax[:, None], swa_type, n_swa)  # [S, C]
    # only the past side of the window: a cell after pmax (symmetric windows) is still visible later
    past = cells.pos[None, :] <= pmax[:, None]
    leave = member & masked & past & (pmax >= 0)[:, None]
    n_words = cells.n_words
    leave = jnp.pad(leave, ((0, n_words * _seqbits.BITS - n_seq), (0, 0)))
    bit = jnp.left_shift(jnp.uint32(1), jnp.arange(_seqbits.BITS, dtype=jnp.uint32))
    drop = jnp.sum(
        jnp.where(leave.reshape(n_words, _seqbits.BITS, -1), bit[None, :, None], jnp.uint32(0)),
        axis=1,
        dtype=jnp.uint32,
    ).T  # [C, W], distinct bits
    seq = cells.seq & ~drop
    freed = is_used(cells) & ~jnp.any(seq != 0, axis=-1)
    return cells.replace(seq=seq, pos=jnp.where(freed, -1, cells.pos), delta=jnp.where(freed, 0, cells.delta))


def init_iswa(config: IswaConfig) -> IswaCache:
    """A new, empty iSWA pair."""
    return IswaCache(base=init_unified(config.base_config), swa=init_unified(config.swa_config), config=config)
