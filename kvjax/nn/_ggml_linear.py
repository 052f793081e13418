"""Projections and embeddings whose weights stay in a ggml block format (a GGUF file's own bytes).

:class:`GGMLLinear` and :class:`GGMLEmbed` stand in for ``nnx.Linear`` and ``nnx.Embed`` in a
model loaded by :func:`kvjax.nn.from_gguf` with ``dtype=None``: the weight is the tensor's bytes as
the file stores them, one row of blocks per output feature (``u8[N, row_bytes]``, a
:class:`GGMLBlocks` variable), and every call dequantizes it inside the jitted step
(:func:`kvjax._ggml_blocks.dequantize`, bit-exact with ``gguf.quants.dequantize``) right before its
product. Resident weight memory is then the file's size (a Q4_K_M 7B model in about 4 GB rather
than 28 GB of float32), and the results equal a float32 model loaded from the same file up to the
order of float sums.

**How the product is formed.** ``y = x @ dequantize(W).T``: the whole matrix is dequantized and
contracted at once, except for matrices of more than :data:`CHUNK_ELEMENTS` weights (a large
vocabulary's output head), which run as a ``lax.map`` over chunks of :data:`CHUNK_ROWS` rows, so the
float copy in flight stays small (a 262144 x 640 head at once is a 671 MB float32 temporary per
step). The measurements behind the choice are in ``docs/speed.md``.

**What differs from ``nnx.Linear``.** There is no ``kernel``: code that reads or rewrites kernels
(:func:`kvjax.nn.fuse_projections` when the three projections' types differ, the linen twin,
:func:`kvjax.shard.shard_params`' column split) leaves these layers as they are or refuses them
with an error that says to load with a float ``dtype``.

Example:
    >>> import numpy as np, jax.numpy as jnp
    >>> w = np.arange(64, dtype=np.float32).reshape(2, 32) / 8
    >>> lin = GGMLLinear(w.astype(np.float16).view(np.uint8), "F16", 32)
    >>> x = jnp.ones((1, 32), jnp.float32)
    >>> np.asarray(lin(x)).tolist() == (x @ w.T).tolist()
    True
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax._ggml_blocks import check_type, dequantize, row_bytes

__all__ = [
    "GGMLBlocks",
    "GGMLLinear",
    "GGMLEmbed",
    "GGMLExperts",
    "ggml_matmul",
    "CHUNK_ROWS",
    "CHUNK_ELEMENTS",
]

#: matrices of more weights than this are dequantized and contracted in chunks of rows
CHUNK_ELEMENTS = 1 << 24
#: rows per chunk of a chunked product (a 4096 x 640 float32 chunk is 10 MB)
CHUNK_ROWS = 4096


class GGMLBlocks(nnx.Variable):
    """A weight kept as the bytes of a ggml block type: ``u8[N, row_bytes]``, one row per output."""


def _raw(name: str, raw, n_in: int) -> np.ndarray:
    """``raw`` checked and viewed as ``u8[N, row_bytes(type, n_in)]``."""
    check_type(name)
    if isinstance(raw, jax.Array):
        raw = np.asarray(raw)
    if not isinstance(raw, np.ndarray) or raw.ndim != 2:
        raise ValueError(
            f"raw must be a 2-d array, one row of blocks per output, got "
            f"{type(raw).__name__} of shape {getattr(raw, 'shape', None)}"
        )
    raw = np.ascontiguousarray(raw).view(np.uint8)
    want = row_bytes(name, n_in)
    if raw.shape[1] != want:
        raise ValueError(f"raw has rows of {raw.shape[1]} bytes: allowed {want} (n_in={n_in} values of type {name})")
    return raw


def _times_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [M, K] . w [N, K] -> [M, N]``, contracting both on their last axis.

    Written as a ``dot_general`` on ``w``'s rows rather than ``x @ w.T``: XLA:CPU fused the
    transpose of a freshly dequantized ``w`` into the product and ran 2-7x slower (a Q4_K
    2048 x 1280 matrix: 18 ms against 4.5 ms).
    """
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())))


def ggml_matmul(x: jax.Array, raw: jax.Array, name: str, n_in: int) -> jax.Array:
    """``x @ W.T`` for ``W`` stored as ggml blocks.

    Args:
        x: ``f[..., n_in]`` activations.
        raw: ``u8[N, row_bytes]``, row ``o`` the blocks of output ``o``'s ``n_in`` weights.
        name: the ggml type name (``"Q4_K"``, ``"Q8_0"``, ``"F16"``, ...).
        n_in: the number of weights in a row.

    Returns:
        ``f32[..., N]`` (float32 whatever ``x``'s dtype: the dequantized weights are float32).
    """
    n_out = raw.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in).astype(jnp.float32)
    if n_out * n_in <= CHUNK_ELEMENTS or n_out % CHUNK_ROWS:
        y = _times_rows(x2, dequantize(raw, name))
    else:
        chunks = raw.reshape(n_out // CHUNK_ROWS, CHUNK_ROWS, raw.shape[1])
        y = jax.lax.map(lambda rows: _times_rows(x2, dequantize(rows, name)), chunks)  # [n_chunks, M, CHUNK_ROWS]
        y = jnp.moveaxis(y, 0, 1).reshape(x2.shape[0], n_out)
    return y.reshape(lead + (n_out,))


class GGMLLinear(nnx.Module):
    """``y = x @ W.T + b`` with ``W [N, n_in]`` kept as ggml blocks (see the module docstring).

    Args:
        raw: ``u8[N, row_bytes]`` (or any 2-d array whose bytes are those rows, such as a GGUF
            reader's ``float16[N, n_in]`` for an F16 tensor).
        name: the tensor's ggml type name.
        n_in: input features (values per row).
        bias: optional ``f[N]`` bias, kept as float32.
    """

    def __init__(self, raw, name: str, n_in: int, *, bias: Optional[np.ndarray] = None):
        raw = _raw(name, raw, n_in)
        self.type_name = name
        self.in_features = int(n_in)
        self.out_features = int(raw.shape[0])
        self.blocks = GGMLBlocks(jnp.asarray(raw))
        if bias is not None and np.shape(bias) != (self.out_features,):
            raise ValueError(f"bias has shape {np.shape(bias)}: allowed ({self.out_features},)")
        self.bias = None if bias is None else nnx.Param(jnp.asarray(bias, jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = ggml_matmul(x, self.blocks[...], self.type_name, self.in_features)
        return y if self.bias is None else y + self.bias[...]


class GGMLEmbed(nnx.Module):
    """A token embedding ``[V, D]`` kept as ggml blocks; ``attend`` is the tied output head.

    Args:
        raw: ``u8[V, row_bytes]``, row ``i`` the blocks of token ``i``'s embedding.
        name: the tensor's ggml type name.
        features: ``D``, values per row.
    """

    def __init__(self, raw, name: str, features: int):
        raw = _raw(name, raw, features)
        self.type_name = name
        self.features = int(features)
        self.num_embeddings = int(raw.shape[0])
        self.blocks = GGMLBlocks(jnp.asarray(raw))

    def __call__(self, ids: jax.Array) -> jax.Array:
        """``f32[..., D]``: only the looked-up rows are dequantized."""
        rows = jnp.take(self.blocks[...], jnp.asarray(ids), axis=0, mode="clip")
        return dequantize(rows, self.type_name)

    def attend(self, x: jax.Array) -> jax.Array:
        """``f32[..., V]``: ``x @ E.T`` (the logits of a model with tied embeddings)."""
        return ggml_matmul(x, self.blocks[...], self.type_name, self.features)


class GGMLExperts(nnx.Module):
    """A mixture's stacked expert matrices ``[X, out, in]`` kept as ggml blocks (gpt-oss's ``ffn_*_exps``).

    Stands in for a :class:`kvjax.nn.MoE`'s ``gate`` / ``up`` / ``down`` parameter (a float
    ``[X, in, out]``) in a compact :func:`kvjax.nn.from_gguf` load, so the experts stay resident as
    the file's bytes (MXFP4 in real gpt-oss files: 4.25 bits a weight). The mixture's loop over the
    experts (:func:`kvjax.nn._moe.grouped_products`) takes each expert some row is routed to from
    :meth:`matrix`, dequantized right before its products: a decode step reads only the ``k``
    experts a token uses, and no more than one expert is ever float at a time. The products equal
    the float load's up to the order of float sums.

    Args:
        raw: ``u8[X, out, row_bytes]``, expert ``x``'s row ``o`` the blocks of its output ``o``.
        name: the tensor's ggml type name.
        n_in: values per row.

    Example:
        >>> w = np.arange(2 * 3 * 32, dtype=np.float32).reshape(2, 3, 32) / 64    # [X, out, in]
        >>> experts = GGMLExperts(w.astype(np.float16).view(np.uint8), "F16", 32)
        >>> experts.shape, bool(jnp.array_equal(experts.matrix(jnp.int32(1)), w[1].T))
        ((2, 32, 3), True)
    """

    def __init__(self, raw, name: str, n_in: int):
        check_type(name)
        raw = np.asarray(raw)
        if raw.ndim != 3:
            raise ValueError(f"raw must be a 3-d array [X, out, row bytes], got shape {raw.shape}")
        n_experts, n_out = raw.shape[:2]
        flat = _raw(name, raw.reshape(n_experts * n_out, -1), n_in)
        self.type_name = name
        self.in_features, self.out_features, self.n_experts = int(n_in), int(n_out), int(n_experts)
        self.blocks = GGMLBlocks(jnp.asarray(flat.reshape(n_experts, n_out, -1)))

    @property
    def shape(self):
        """``(X, in, out)``: the shape of the float parameter this stands in for."""
        return (self.n_experts, self.in_features, self.out_features)

    def matrix(self, e) -> jax.Array:
        """``f32[in, out]``: expert ``e``'s matrix (``e`` may be traced), only its blocks dequantized."""
        return dequantize(jax.lax.dynamic_index_in_dim(self.blocks[...], e, keepdims=False), self.type_name).T


def resident_bytes(model) -> int:
    """Bytes of every array in ``model``'s state (what a loaded model holds in memory)."""
    return int(
        sum(
            np.dtype(leaf.dtype).itemsize * int(np.prod(leaf.shape))
            for leaf in jax.tree.leaves(nnx.state(model))
            if hasattr(leaf, "shape")
        )
    )
