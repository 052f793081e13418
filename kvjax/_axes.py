"""Logical axis names: what each dimension of a memory's leaves (and of a model's weights) means.

A memory says, per leaf, which logical axis every dimension is (:meth:`kvjax.Memory.logical_axes`);
the rules of :mod:`kvjax._mesh` say which mesh axis, if any, each logical axis is split
over. Memories never name mesh axes, so one set of rules places every memory, and a new memory
only names its dimensions.

The leaf type is ``jax.sharding.PartitionSpec`` holding logical names, flax's convention for
logical partitioning (``flax.linen.logical_to_mesh_sharding`` reads the same trees). It is a pytree
leaf, so ``jax.tree.map`` pairs a memory's arrays with their axes one to one.

Example:
    >>> from kvjax.shard import kv_axes
    >>> kv_axes()
    P('layers', 'kv_heads', 'cells', 'head_dim')
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

# -- memories --------------------------------------------------------------------------------------
#: the stacked layers of a layer group (``L`` of ``[L, H, C, D]``)
LAYERS = "layers"
#: kv heads (``H``): tensor parallel, each model shard holds its heads' K/V
KV_HEADS = "kv_heads"
#: cells (``C``) of K/V and of the cell metadata; rows of a recurrent state buffer
CELLS = "cells"
#: the last dimension of a K/V row: the head size, or the bytes of its ggml blocks when quantized
HEAD_DIM = "head_dim"
#: the 32-bit words of a cell's sequence bitmask (``W``)
SEQ_WORDS = "seq_words"
#: one entry per sequence id (``S``: a recurrent memory's ``tail``)
SEQS = "seqs"
#: one entry per stream (per-sequence streams: each stream its own cells and K/V)
STREAMS = "streams"
#: the rows of a recurrent state buffer (``R = size * n_states``, cell major)
STATE_ROWS = "state_rows"
#: a dimension inside one recurrent state (Mamba's convolution window or SSM state)
STATE = "state"

# -- model weights -----------------------------------------------------------------------------------
#: query / kv heads of the attention projections (flattened with the head size: ``Hq * D``)
HEADS = "heads"
#: the MLP's hidden width
FF = "ff"
#: the residual width ``E``
EMBED = "embed"
#: the vocabulary
VOCAB = "vocab"

#: every logical axis name kvjax knows, memories first
LOGICAL_AXES = (LAYERS, KV_HEADS, CELLS, HEAD_DIM, SEQ_WORDS, SEQS, STREAMS, STATE_ROWS, STATE, HEADS, FF, EMBED, VOCAB)


def kv_axes(latent: bool = False) -> PartitionSpec:
    """Axes of a unified cache's stacked K or V buffer ``[L, H, C, D]`` (quantized: D = block bytes).

    ``latent``: a latent (MLA) cache's, whose one row per cell every query head reads (its one kv
    head is not a head axis to split: each device of a ``"model"`` axis holds the whole latent,
    as tensor-parallel MLA serving does).
    """
    return PartitionSpec(LAYERS, None if latent else KV_HEADS, CELLS, HEAD_DIM)


def scalar_axes() -> PartitionSpec:
    """Axes of a 0-d leaf (``head``, ``error``, flags): nothing to split."""
    return PartitionSpec()


def state_axes(state_ndim: int) -> PartitionSpec:
    """Axes of a recurrent state buffer ``[Lg, R, *shape]`` with ``state_ndim = len(shape)``."""
    return PartitionSpec(LAYERS, STATE_ROWS, *((STATE,) * state_ndim))
