"""RMSNorm with Gemma's ``(1 + w)`` scale, in NNX and linen (the reference models' norm option).

Gemma 2 and 3 store their RMSNorm weight ``w`` as an offset from one: the output is
``x / sqrt(mean(x^2) + eps) * (1 + w)``, computed in float32 and cast back to the input dtype
(``(x * w).to(dtype)``, not ``x.to(dtype) * w`` as Llama does). Storing ``w`` exactly as
Hugging Face does lets HF checkpoints load unchanged; a freshly initialised norm has ``w = 0``,
the identity scale. Plain RMSNorm layers stay ``nnx.RMSNorm`` / ``linen.RMSNorm``.

Shape letters: ``...`` any leading dims, F the normalised (last) dim.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> norm = OffsetRMSNorm(4, epsilon=0.0, rngs=nnx.Rngs(0))
    >>> norm(jnp.array([[2.0, -2.0, 2.0, -2.0]])).tolist()
    [[1.0, -1.0, 1.0, -1.0]]
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax._typing import Array, Float

__all__ = ["OffsetRMSNorm", "LinenOffsetRMSNorm", "offset_rms_norm"]


def _check_eps(epsilon) -> float:
    if (
        isinstance(epsilon, bool)
        or not isinstance(epsilon, (int, float, np.integer, np.floating))
        or not (math.isfinite(epsilon) and epsilon >= 0)
    ):
        raise ValueError(f"epsilon={epsilon!r} is out of range: allowed a finite number >= 0")
    return float(epsilon)


def offset_rms_norm(x: Float[Array, "... F"], weight: Float[Array, " F"], epsilon: float) -> Float[Array, "... F"]:
    """``x / sqrt(mean(x^2) + epsilon) * (1 + weight)`` over the last dim, in float32, cast back.

    Args:
        x: ``[..., F]`` activations.
        weight: ``[F]`` the stored offset ``w`` (0 means scale 1).
        epsilon: added to the mean square.

    Returns:
        ``[..., F]`` in ``x.dtype``.

    Example:
        >>> offset_rms_norm(jnp.array([3.0, 4.0]), jnp.array([0.0, 1.0]), 0.0).round(4).tolist()
        [0.8485, 2.2627]
    """
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + epsilon)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


class OffsetRMSNorm(nnx.Module):
    """NNX RMSNorm with the ``(1 + w)`` scale (see the module docstring).

    Args:
        num_features: F, the normalised dim.
        epsilon: added to the mean square (>= 0).
        param_dtype: dtype of the weight ``scale`` (initialised to zeros).
        rngs: NNX random streams (unused: the weight starts at 0; kept for the ``nnx.RMSNorm`` call shape).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, param_dtype=jnp.float32, rngs: nnx.Rngs):
        if isinstance(num_features, bool) or not isinstance(num_features, (int, np.integer)) or num_features < 1:
            raise ValueError(f"num_features={num_features!r} is out of range: allowed an integer >= 1")
        self.epsilon = _check_eps(epsilon)
        self.scale = nnx.Param(jnp.zeros((int(num_features),), param_dtype))

    def __call__(self, x: Float[Array, "... F"]) -> Float[Array, "... F"]:
        """Normalise the last dim of ``x``; returns ``[..., F]`` in ``x.dtype``."""
        return offset_rms_norm(x, self.scale[...], self.epsilon)


class LinenOffsetRMSNorm(nn.Module):
    """The linen twin of :class:`OffsetRMSNorm` (parameter ``scale`` of shape ``[F]``, zeros).

    Attributes:
        epsilon: added to the mean square (>= 0).
        param_dtype: dtype of the weight.
    """

    epsilon: float = 1e-6
    param_dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x: Float[Array, "... F"]) -> Float[Array, "... F"]:
        """Normalise the last dim of ``x``; returns ``[..., F]`` in ``x.dtype``."""
        eps = _check_eps(self.epsilon)
        scale = self.param("scale", nn.initializers.zeros_init(), (x.shape[-1],), self.param_dtype)
        return offset_rms_norm(x, scale, eps)
