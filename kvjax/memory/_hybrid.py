"""The hybrid memory: an attention memory for the attention layers, recurrent states for the others.

Newer llama.cpp's ``llama_memory_hybrid``. Hybrid models (Jamba, Granite 4, Falcon-H1, Bamba,
Nemotron-H, Qwen3-Next) interleave attention layers, which need K/V per token, with recurrent
layers (Mamba, linear attention), which need one state per sequence. The pair keeps:

- ``attention`` (a :class:`kvjax.KVCache` or :class:`kvjax.IswaCache`) caching the attention layers
  only (its config's ``layer_filter``), reached by those layers through the usual routing
  (``memory.layer_part(layer)``, ``memory.part(i)``);
- ``recurrent`` (a :class:`kvjax.RecurrentCache`) holding the states of the recurrent layers, in
  their order (``config.recurrent_index(layer)``).

Rules (newer llama.cpp's, all or nothing as kvjax's composites are): every sequence operation
applies to both; if either refuses a ``seq_rm`` (the recurrent part cannot cut a state) nothing
changes in either; a ubatch is placed only when both take it; ``seq_pos_min`` is the larger of the
two minima and ``seq_pos_max`` the smaller of the two maxima (what both parts hold);
``used_cells``/``n_tokens``/``pos_max`` are the attention part's; ``can_shift`` only when both can
(never, with a recurrent part); the state is the attention part's blob, then the recurrent part's.
Ubatches are equal splits (``kvjax.make_equal_ubatch``), as the recurrent part needs.

Example:
    >>> import kvjax
    >>> attn = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=4, n_kv_heads=1, head_dim=8, layer_filter=(1, 3))
    >>> rec = kvjax.RecurrentConfig(size=2, n_seq_max=2, n_layer=2, k_shape=(8, 3), v_shape=(8, 4), n_states=2)
    >>> memory = kvjax.init(kvjax.HybridConfig(attn, rec, recurrent_layers=(0, 2)))
    >>> memory.layer_part(3), memory.config.recurrent_index(2)
    (0, 1)
    >>> memory, placement, ok = kvjax.find_slot(memory, kvjax.make_equal_ubatch([([0, 1, 2], [0])]))
    >>> int(kvjax.used_cells(memory.attention)), int(kvjax.used_cells(memory.recurrent)), int(kvjax.seq_pos_max(memory, 0))
    (3, 1, 2)
    >>> memory, ok = kvjax.seq_rm(memory, 0, 1, -1)       # the recurrent part refuses: nothing changes
    >>> bool(ok), int(kvjax.used_cells(memory.attention))
    (False, 3)
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Tuple, Union

from flax import struct

from kvjax.memory._config import CacheConfig
from kvjax.memory._composite import Composite
from kvjax.memory._iswa import IswaConfig, init_iswa
from kvjax.memory._protocol import Memory, not_defined
from kvjax.memory._recurrent import RecurrentCache, RecurrentConfig, init_recurrent, share_state_prefix
from kvjax.memory._unified import init_unified

__all__ = ["HybridConfig", "HybridCache", "init_hybrid"]


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """The hybrid memory's description (frozen, hashable, validated on construction).

    Attributes:
        attention: the attention memory's config (a :class:`kvjax.CacheConfig` or
            :class:`kvjax.IswaConfig`) over the model's ``n_layer`` layers, caching exactly the
            attention layers (``layer_filter``).
        recurrent: the recurrent memory's config, one state layer per recurrent layer.
        recurrent_layers: the model layers that are recurrent, ascending; every other layer is an
            attention layer.
    """

    attention: Union[CacheConfig, IswaConfig]
    recurrent: RecurrentConfig
    recurrent_layers: Tuple[int, ...]

    def __post_init__(self):
        if not isinstance(self.attention, (CacheConfig, IswaConfig)):
            raise ValueError(
                f"attention must be a kvjax.CacheConfig or kvjax.IswaConfig, got {type(self.attention).__name__}"
            )
        if not isinstance(self.recurrent, RecurrentConfig):
            raise ValueError(f"recurrent must be a kvjax.RecurrentConfig, got {type(self.recurrent).__name__}")
        base = self.attention.base if isinstance(self.attention, IswaConfig) else self.attention
        try:
            layers = tuple(int(il) for il in self.recurrent_layers)
        except (TypeError, ValueError):
            raise ValueError(
                f"recurrent_layers={self.recurrent_layers!r} is out of range: allowed a tuple of layer ids"
            ) from None
        object.__setattr__(self, "recurrent_layers", layers)
        n_layer = base.n_layer
        if list(layers) != sorted(set(layers)) or any(not 0 <= il < n_layer for il in layers) or not layers:
            raise ValueError(
                f"recurrent_layers={layers!r} is out of range: allowed distinct ascending layer ids "
                f"in [0, {n_layer}), at least one"
            )
        attn_layers = tuple(il for il in range(n_layer) if il not in layers)
        if tuple(base.cached_layers) != attn_layers:
            raise ValueError(
                f"attention caches layers {list(base.cached_layers)}: allowed exactly the attention "
                f"layers {list(attn_layers)} (set its layer_filter)"
            )
        if self.recurrent.n_layer != len(layers):
            raise ValueError(
                f"recurrent has n_layer={self.recurrent.n_layer}: allowed one state layer per "
                f"recurrent layer ({len(layers)})"
            )
        if self.recurrent.n_seq_max != base.n_seq_max:
            raise ValueError(
                f"recurrent has n_seq_max={self.recurrent.n_seq_max}: allowed the attention "
                f"part's n_seq_max={base.n_seq_max}"
            )

    @property
    def n_seq_max(self) -> int:
        return self.recurrent.n_seq_max

    @property
    def n_layer(self) -> int:
        return (self.attention.base if isinstance(self.attention, IswaConfig) else self.attention).n_layer

    def recurrent_index(self, layer: int) -> int:
        """The recurrent part's layer index of model layer ``layer`` (a recurrent layer)."""
        if layer not in self.recurrent_layers:
            raise ValueError(
                f"layer={layer!r} is out of range: allowed a recurrent layer {list(self.recurrent_layers)}"
            )
        return self.recurrent_layers.index(layer)


@struct.dataclass
class HybridCache(Composite):
    """An immutable hybrid memory (see the module docstring).

    A :class:`~kvjax.memory._composite.Composite` of an attention memory and a recurrent one: every
    verb and query is routed by its rules; the hybrid's own are the layer routing (a recurrent
    layer has no attention part) and how a prefix is lent (a state cannot be shared and rolled
    back at once).

    Attributes:
        attention: the attention memory.
        recurrent: the recurrent memory.
        config: the static :class:`HybridConfig`.
    """

    attention: Memory
    recurrent: RecurrentCache
    config: HybridConfig = struct.field(pytree_node=False)

    MEMBERS: ClassVar[Tuple[str, ...]] = ("attention", "recurrent")
    MAIN: ClassVar[str] = "attention"
    POSITIONS: ClassVar[Tuple[str, ...]] = ("attention", "recurrent")  # what both parts hold

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    def share_prefix(self, src: int, dst: int, n: int):
        return share_state_prefix(self, src, dst, n, attention_ok=n > 0 and self.attention.prefix_visible(src, n))

    @property
    def max_slots(self) -> int:
        """Most sequences one ubatch can hold: one state cell each."""
        return self.recurrent.size

    def layer_part(self, layer: int) -> int:
        if layer in self.config.recurrent_layers:
            raise not_defined(
                self, f"layer_part({layer})", "it is a recurrent layer (its states are in memory.recurrent)"
            )
        return self.attention.layer_part(layer)


def init_hybrid(config: HybridConfig) -> HybridCache:
    """A new, empty hybrid memory."""
    make_attention = init_iswa if isinstance(config.attention, IswaConfig) else init_unified
    attention = make_attention(config.attention)
    return HybridCache(attention=attention, recurrent=init_recurrent(config.recurrent), config=config)
