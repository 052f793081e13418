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
from typing import Sequence, Tuple, Union

import jax
import jax.numpy as jnp
from flax import struct

from kvjax.memory._config import CacheConfig
from kvjax.memory._iswa import IswaConfig
from kvjax.memory._protocol import Memory, not_defined, on_metadata
from kvjax.memory._recurrent import RecurrentCache, RecurrentConfig

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
            raise ValueError(f"attention must be a kvjax.CacheConfig or kvjax.IswaConfig, got "
                             f"{type(self.attention).__name__}")
        if not isinstance(self.recurrent, RecurrentConfig):
            raise ValueError(f"recurrent must be a kvjax.RecurrentConfig, got {type(self.recurrent).__name__}")
        base = self.attention.base if isinstance(self.attention, IswaConfig) else self.attention
        try:
            layers = tuple(int(il) for il in self.recurrent_layers)
        except (TypeError, ValueError):
            raise ValueError(f"recurrent_layers={self.recurrent_layers!r} is out of range: allowed a tuple of "
                             f"layer ids") from None
        object.__setattr__(self, "recurrent_layers", layers)
        n_layer = base.n_layer
        if list(layers) != sorted(set(layers)) or any(not 0 <= il < n_layer for il in layers) or not layers:
            raise ValueError(f"recurrent_layers={layers!r} is out of range: allowed distinct ascending layer ids "
                             f"in [0, {n_layer}), at least one")
        attn_layers = tuple(il for il in range(n_layer) if il not in layers)
        if tuple(base.cached_layers) != attn_layers:
            raise ValueError(f"attention caches layers {list(base.cached_layers)}: allowed exactly the attention "
                             f"layers {list(attn_layers)} (set its layer_filter)")
        if self.recurrent.n_layer != len(layers):
            raise ValueError(f"recurrent has n_layer={self.recurrent.n_layer}: allowed one state layer per "
                             f"recurrent layer ({len(layers)})")
        if self.recurrent.n_seq_max != base.n_seq_max:
            raise ValueError(f"recurrent has n_seq_max={self.recurrent.n_seq_max}: allowed the attention "
                             f"part's n_seq_max={base.n_seq_max}")

    @property
    def n_seq_max(self) -> int:
        return self.recurrent.n_seq_max

    @property
    def n_layer(self) -> int:
        return (self.attention.base if isinstance(self.attention, IswaConfig) else self.attention).n_layer

    def recurrent_index(self, layer: int) -> int:
        """The recurrent part's layer index of model layer ``layer`` (a recurrent layer)."""
        if layer not in self.recurrent_layers:
            raise ValueError(f"layer={layer!r} is out of range: allowed a recurrent layer {list(self.recurrent_layers)}")
        return self.recurrent_layers.index(layer)


@struct.dataclass
class HybridCache(Memory):
    """An immutable hybrid memory (see the module docstring).

    Attributes:
        attention: the attention memory.
        recurrent: the recurrent memory.
        config: the static :class:`HybridConfig`.
    """

    attention: Memory
    recurrent: RecurrentCache
    config: HybridConfig = struct.field(pytree_node=False)

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    @property
    def size(self) -> int:
        return self.attention.size

    @property
    def rollback_depth(self):
        return self.recurrent.rollback_depth

    def share_prefix(self, src: int, dst: int, n: int):
        from kvjax.memory._recurrent import share_state_prefix

        return share_state_prefix(self, src, dst, n, attention_ok=n > 0 and self.attention.prefix_visible(src, n))

    @property
    def max_slots(self) -> int:
        """Most sequences one ubatch can hold: one state cell each."""
        return self.recurrent.size

    @property
    def ubatch_split(self) -> str:
        return "equal"

    @property
    def max_context(self):
        return self.attention.max_context

    def _keep_if(self, ok, attention, recurrent) -> "HybridCache":
        """The new parts' metadata where ``ok``, else the old (buffers are not selected: the
        operations that can refuse change no buffer, so the new ones are the old ones). The error
        bits are the new ones either way, as the iSWA pair's: a refused op says why."""
        new = self.replace(attention=attention, recurrent=recurrent)
        buffers, new_rest = new.split()
        _, old_rest = self.split()
        kept = jax.tree.map(lambda a, b: jnp.where(ok, b, a), old_rest, new_rest)
        return kept.join(buffers).flag_errors(new.error_bits())

    def _both(self, name, *args) -> "HybridCache":
        return self.replace(attention=getattr(self.attention, name)(*args),
                            recurrent=getattr(self.recurrent, name)(*args))

    # -- sequences -----------------------------------------------------------------------------------

    def clear(self):
        return self._both("clear")

    # all or nothing over both parts: several dispatches when composed eagerly (and small programs
    # compiled on first use: 9 for the iSWA pair, 5 for the hybrid), one program here
    @on_metadata
    def seq_rm(self, seq_id, p0, p1):
        attention, ok_a = self.attention.seq_rm(seq_id, p0, p1)
        recurrent, ok_r = self.recurrent.seq_rm(seq_id, p0, p1)
        ok = ok_a & ok_r
        kept = self._keep_if(ok, attention, recurrent)
        # a refused call may still have raised an error bit (a bad traced id): keep the bits
        return kept.replace(recurrent=kept.recurrent.replace(
            cells=kept.recurrent.cells.replace(error=recurrent.cells.error))), ok

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1):
        return self._both("seq_cp", seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id):
        return self._both("seq_keep", seq_id)

    @on_metadata
    def seq_add(self, seq_id, p0, p1, delta):
        # all or nothing: a shift the recurrent part refuses (a state would go below position 0)
        # must not move the attention part's cells either
        ok = self.recurrent.shift_keeps_states(seq_id, p0, p1, delta)
        attention = self.attention.seq_add(seq_id, p0, p1, delta)
        recurrent = self.recurrent.seq_add(seq_id, p0, p1, delta)
        kept = self._keep_if(ok, attention, recurrent)
        return kept.replace(recurrent=kept.recurrent.replace(
            cells=kept.recurrent.cells.replace(error=recurrent.cells.error)))

    def seq_div(self, seq_id, p0, p1, d):
        return self._both("seq_div", seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id):
        return jnp.maximum(self.attention.seq_pos_min(seq_id), self.recurrent.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id):
        return jnp.minimum(self.attention.seq_pos_max(seq_id), self.recurrent.seq_pos_max(seq_id))

    def seq_shared(self, seq_id, p0, p1):
        return self.attention.seq_shared(seq_id, p0, p1) | self.recurrent.seq_shared(seq_id, p0, p1)

    def used_cells(self):
        return self.attention.used_cells()

    def n_tokens(self):
        return self.attention.n_tokens()

    def pos_max(self):
        return self.attention.pos_max()

    # -- placement -------------------------------------------------------------------------------------

    def find_slot(self, ubatch, *, contiguous: bool = True):
        attention, p_attn, ok_a = self.attention.find_slot(ubatch, contiguous=contiguous)
        recurrent, p_rec, ok_r = self.recurrent.find_slot(ubatch)
        ok = ok_a & ok_r
        placement = (self.attention.mask_placement(p_attn, ok), self.recurrent.mask_placement(p_rec, ok))
        kept = self._keep_if(ok, attention, recurrent)
        return kept.replace(recurrent=kept.recurrent.replace(
            cells=kept.recurrent.cells.replace(error=recurrent.cells.error))), placement, ok

    def mask_placement(self, placement, ok):
        return (self.attention.mask_placement(placement[0], ok), self.recurrent.mask_placement(placement[1], ok))

    def commit(self, ubatches: Sequence) -> "HybridCache":
        return self.replace(attention=self.attention.commit(ubatches))

    # -- attention parts: the attention memory's --------------------------------------------------------------

    @property
    def n_parts(self) -> int:
        return self.attention.n_parts

    def layer_part(self, layer: int) -> int:
        if layer in self.config.recurrent_layers:
            raise not_defined(self, f"layer_part({layer})", "it is a recurrent layer (its states are in "
                                                            "memory.recurrent)")
        return self.attention.layer_part(layer)

    def part(self, index: int):
        return self.attention.part(index)

    def with_part(self, index: int, cache):
        return self.replace(attention=self.attention.with_part(index, cache))

    def part_slots(self, placement, index: int):
        return self.attention.part_slots(placement[0], index)

    def extent(self):
        return self.attention.extent()

    def extent_after(self, n_tokens):
        return self.attention.extent_after(n_tokens)

    def logical_axes(self) -> "HybridCache":
        return self.replace(attention=self.attention.logical_axes(), recurrent=self.recurrent.logical_axes())

    # -- pending work, donation, errors, sizes, state ----------------------------------------------------------

    def pending(self):
        return self.attention.pending()

    def update(self, *, donate: bool = False):
        return self.replace(attention=self.attention.update(donate=donate))

    @property
    def can_shift(self) -> bool:
        return self.attention.can_shift and self.recurrent.can_shift

    def split(self):
        a_buf, a_rest = self.attention.split()
        r_buf, r_rest = self.recurrent.split()
        return (a_buf, r_buf), self.replace(attention=a_rest, recurrent=r_rest)

    def join(self, buffers):
        a_buf, r_buf = buffers
        return self.replace(attention=self.attention.join(a_buf), recurrent=self.recurrent.join(r_buf))

    def error_bits(self):
        return self.attention.error_bits() | self.recurrent.error_bits()

    def clear_errors(self):
        return self._both("clear_errors")

    def flag_errors(self, bits):
        return self.replace(attention=self.attention.flag_errors(bits))  # error_bits() ors both parts

    def nbytes(self) -> int:
        return self.attention.nbytes() + self.recurrent.nbytes()

    def state_write(self, seq_id: int = -1) -> bytes:
        return self.attention.state_write(seq_id) + self.recurrent.state_write(seq_id)

    def blob_size(self, data, seq_id: int = -1) -> int:
        raise not_defined(self, "blob_size", "a hybrid memory is always the last part of a blob")

    def state_read(self, data, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False) -> "HybridCache":
        from kvjax.io._state import _as_view

        view = _as_view(data)
        cut = self.attention.blob_size(view, seq_id)
        # both parts are parsed and built before either is kept: a bad recurrent part leaves the pair
        del donate
        attention = self.attention.state_read(view[:cut], seq_id, contiguous=contiguous)
        recurrent = self.recurrent.state_read(view[cut:], seq_id)
        return self.replace(attention=attention, recurrent=recurrent)


def init_hybrid(config: HybridConfig) -> HybridCache:
    """A new, empty hybrid memory."""
    from kvjax.memory._init import init

    return HybridCache(attention=init(config.attention), recurrent=init(config.recurrent), config=config)
