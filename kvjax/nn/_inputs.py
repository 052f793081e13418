"""The per-ubatch inputs every cached layer receives: one pytree instead of loose arguments.

A step builds one :class:`UbatchInputs` per ubatch: the ubatch (positions, sequences), where the
memory placed it (a placement pytree of the memory's kind), the static window of each attention
part, and one mask per :class:`MaskKind` the model's layers use, computed once per ubatch and
shared by every layer of that kind (the cells do not change between layers, only K/V do).

Example:
    >>> import kvjax
    >>> from kvjax.nn import MaskKind, UbatchInputs
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
    >>> ub = kvjax.make_ubatch([0, 1], [[0], [0]])
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> inputs = UbatchInputs(ubatch=ub, placement=slot, windows=(32,))
    >>> inputs = inputs.with_masks(cache, [MaskKind(part=0)])
    >>> inputs.mask(MaskKind(part=0))[:, :3].tolist()
    [[0.0, -inf, -inf], [0.0, 0.0, -inf]]
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import kvjax
from kvjax._typing import Array, Float
from kvjax.memory._config import SwaType
from kvjax.memory._protocol import Memory
from kvjax.memory._ubatch import Ubatch

__all__ = ["MaskKind", "UbatchInputs", "layer_mask", "select_outputs"]


class MaskKind(NamedTuple):
    """What a layer's mask depends on: its attention part and its kind of attention.

    Attributes:
        part: the attention part the layer reads (``memory.layer_part(layer)``).
        alibi: ALiBi distances in the mask (``-|p_cell - p_tok|`` where visible).
        swa_type: the layer's sliding-window kind.
        n_swa: the window size (0 without a window).
    """

    part: int = 0
    alibi: bool = False
    swa_type: SwaType = SwaType.NONE
    n_swa: int = 0


def layer_mask(
    cache,
    ubatch: Ubatch,
    n_kv: int,
    *,
    alibi: bool = False,
    swa_type: Union[SwaType, str] = SwaType.NONE,
    n_swa: int = 0,
) -> Float[Array, "T N"]:
    """The additive kvjax mask of one kind of layer (``kvjax.kq_mask`` with this layer's window).

    Example:
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> ub = kvjax.make_ubatch([0, 1], [[0], [0]])
        >>> cache, slot, ok = kvjax.find_slot(cache, ub)
        >>> layer_mask(cache, ub, 32)[:, :3].tolist()
        [[0.0, -inf, -inf], [0.0, 0.0, -inf]]
    """
    kind = SwaType(swa_type)
    return kvjax.kq_mask(
        cache, ubatch, n_kv, causal=True, alibi=alibi, swa_type=kind, n_swa=int(n_swa) if kind != SwaType.NONE else 0
    )


@struct.dataclass
class UbatchInputs:
    """Everything a cached layer needs about the current ubatch (a pytree; see the module docstring).

    Attributes:
        ubatch: the tokens' positions and sequences.
        placement: where the memory placed them (unified cache: ``slot i32[T]``).
        masks: one ``[T, N_part]`` mask per entry of ``mask_kinds`` (filled by :meth:`with_masks`).
        windows: static window ``N`` of each attention part.
        mask_kinds: static, the kind of each mask in ``masks``.
        outputs: ``i32[R]`` the ubatch rows that need logits (llama.cpp's output ids), or ``None``
            for every row. The model runs every row through its layers (each writes K/V or a
            state) but the final norm and output projection only on these rows, so a prefill
            does not build a ``[T, V]`` array. Traced: new row values never recompile, only a
            new ``R`` does (the step's caller pads ``R`` to a bucket).
    """

    ubatch: Ubatch
    placement: Any
    masks: Tuple[Float[Array, "T N"], ...] = ()
    outputs: Any = None
    windows: Tuple[int, ...] = struct.field(pytree_node=False, default=())
    mask_kinds: Tuple[MaskKind, ...] = struct.field(pytree_node=False, default=())

    def with_masks(self, memory: Memory, kinds: Iterable[MaskKind]) -> "UbatchInputs":
        """These inputs with one mask per distinct kind (the ubatch must be placed in ``memory``)."""
        kinds = tuple(dict.fromkeys(MaskKind(*k) for k in kinds))
        if memory.streamed:  # one [t, N] mask per slot, over the slot's own stream
            masks = tuple(
                kvjax.stream_masks(
                    memory,
                    self.ubatch,
                    self.placement,
                    self.windows[k.part],
                    alibi=k.alibi,
                    swa_type=k.swa_type,
                    n_swa=k.n_swa,
                )
                for k in kinds
            )
            return self.replace(masks=masks, mask_kinds=kinds)
        masks = tuple(
            layer_mask(
                memory.part(k.part),
                self.ubatch,
                self.windows[k.part],
                alibi=k.alibi,
                swa_type=k.swa_type,
                n_swa=k.n_swa,
            )
            for k in kinds
        )
        return self.replace(masks=masks, mask_kinds=kinds)

    def mask(self, kind: MaskKind) -> Float[Array, "T N"]:
        """The mask of one kind (``ValueError`` when :meth:`with_masks` did not compute it)."""
        kind = MaskKind(*kind)
        if kind not in self.mask_kinds:
            raise ValueError(
                f"kind={kind} has no mask in these inputs: allowed {list(self.mask_kinds)} "
                f"(compute it with inputs.with_masks(memory, kinds))"
            )
        return self.masks[self.mask_kinds.index(kind)]


def select_outputs(x: Float[Array, "T E"], inputs: UbatchInputs) -> Float[Array, "R E"]:
    """The rows of the final hidden states that need logits: ``x[inputs.outputs]``, or ``x`` (all rows).

    Models call it before their output head, so the head's cost and its ``[R, V]`` result scale
    with the rows asked for, not with the ubatch length.
    """
    if inputs.outputs is None:
        return x
    return jnp.take(x, inputs.outputs, axis=0, mode="clip")


def check_token_ids(ids, vocab_size: int) -> None:
    """Raise ``ValueError`` when a concrete id is outside ``[0, vocab_size)`` (traced ids pass).

    An embedding lookup outside the table gives NaN rows silently under XLA's gather; every model
    entry point checks eagerly with this.
    """
    if isinstance(ids, jax.core.Tracer):
        return
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ValueError(f"tokens contains {bad}: allowed ids in [0, {vocab_size})")


def check_token_rows(tokens, vocab_size: int) -> None:
    """Validate the tokens of an uncached pass: an integer ``[B, T]`` array (B, T >= 1), ids in range."""
    shape = tuple(jnp.shape(tokens))
    if len(shape) != 2 or min(shape) < 1 or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(
            f"tokens has shape {shape} and dtype {jnp.result_type(tokens)}: allowed an integer "
            "[B, T] array (or [T] for one sequence) with B, T >= 1"
        )
    check_token_ids(tokens, vocab_size)


def check_tokens(tokens, ubatch: Ubatch, vocab_size: int) -> None:
    """Validate the token ids of a ubatch: ``i32[T]`` with T the ubatch length, ids in range."""
    if not isinstance(ubatch, Ubatch):
        raise ValueError(f"ubatch must be a kvjax.Ubatch, got {type(ubatch).__name__}")
    shape = tuple(jnp.shape(tokens))
    if shape != (ubatch.length,) or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(
            f"tokens has shape {shape} and dtype {jnp.result_type(tokens)}: allowed an integer "
            f"[T] array with T = ubatch.length = {ubatch.length}"
        )
    if not isinstance(tokens, jax.core.Tracer):
        check_token_ids(np.asarray(tokens)[np.asarray(ubatch.valid)], vocab_size)
