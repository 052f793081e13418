"""The column layout of fused projections, and how a layer splits a fused output back.

:func:`kvjax.nn.fuse_projections` (:mod:`kvjax.nn._fuse`) joins each attention layer's Q/K/V
projections into one ``qkv_proj`` and each gated MLP's gate/up into one ``gate_up``; the layers
read a fused output with :func:`split_qkv` and :func:`split_gate_up`. The grouping keeps whole heads
and MLP columns together, so tensor parallelism still splits them:

- ``qkv``: for each kv head ``h``, its ``G`` query heads, then its key head, then its value head,
  ``D`` columns each (:func:`group_qkv` builds it, :func:`split_qkv` reads it);
- ``gate_up``: column ``2 f`` is gate column ``f``, ``2 f + 1`` up column ``f``.

Example:
    >>> import jax.numpy as jnp
    >>> q, k, v = jnp.arange(8.0).reshape(1, 8), jnp.full((1, 4), 10.0), jnp.full((1, 4), 20.0)
    >>> q2, k2, v2 = split_qkv(group_qkv(q, k, v, n_kv_heads=2), n_heads=4, n_kv_heads=2, head_dim=2)
    >>> bool((q2.reshape(1, 8) == q).all()), k2.shape, v2.shape
    (True, (1, 2, 2), (1, 2, 2))
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["group_qkv", "split_qkv", "split_gate_up"]


def group_qkv(q, k, v, n_kv_heads: int):
    """``[..., Hq*D]``, ``[..., H*D]``, ``[..., H*D]`` columns regrouped as ``[..., H*(G+2)*D]``."""
    lead = q.shape[:-1]
    d = k.shape[-1] // n_kv_heads
    g = q.shape[-1] // (n_kv_heads * d)
    q = q.reshape(lead + (n_kv_heads, g, d))
    k = k.reshape(lead + (n_kv_heads, 1, d))
    v = v.reshape(lead + (n_kv_heads, 1, d))
    return jnp.concatenate([q, k, v], axis=-2).reshape(lead + (n_kv_heads * (g + 2) * d,))


def split_qkv(y, n_heads: int, n_kv_heads: int, head_dim: int):
    """Q ``[..., Hq, D]``, K and V ``[..., H, D]`` out of a fused ``qkv_proj`` output ``y``."""
    lead = y.shape[:-1]
    g = n_heads // n_kv_heads
    y = y.reshape(lead + (n_kv_heads, g + 2, head_dim))
    q = y[..., :g, :].reshape(lead + (n_heads, head_dim))
    return q, y[..., g, :], y[..., g + 1, :]


def split_gate_up(y):
    """``(gate, up)``, each ``[..., F]``, out of a fused ``gate_up`` output ``y [..., 2F]``."""
    y = y.reshape(y.shape[:-1] + (y.shape[-1] // 2, 2))
    return y[..., 0], y[..., 1]
