"""Cached attention for Flax linen: the twin of :class:`kvjax.nn.CachedAttention` (NNX).

Same projections, same parameter names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` with a
``kernel`` each), same framework-neutral core (:func:`kvjax.nn.attend_cached` and
:func:`kvjax.nn.attend_uncached`), so the cache logic lives in kvjax alone. The kvjax cache is an
ordinary argument and result: no linen ``cache`` collection is involved, so ``apply`` needs no
``mutable=``.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> from kvjax.nn import LinenCachedAttention, UbatchInputs
    >>> attn = LinenCachedAttention(d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, layer=0,
    ...                             rope=kvjax.RopeConfig(n_rot=8))
    >>> x, pos = jnp.ones((3, 32)), jnp.arange(3)
    >>> params = attn.init(jax.random.PRNGKey(0), x[None], pos[None], method=attn.uncached)
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=2, head_dim=8))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0]] * 3, length=3)
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> y, cache = attn.apply(params, x, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(32,)))
    >>> bool(jnp.allclose(y, attn.apply(params, x[None], pos[None], method=attn.uncached)[0], atol=1e-5))
    True
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import flax.linen as nn
import jax.numpy as jnp

from kvjax._typing import Array, Float, Int
from kvjax._validate import check_flag
from kvjax.memory._config import RopeConfig, SwaType
from kvjax.memory._protocol import Memory
from kvjax.nn._inputs import UbatchInputs
from kvjax.nn._nnx_attention import (
    alibi_slopes,
    attend_uncached,
    cached_attention_call,
    check_attention_options,
    check_heads,
    project_qkv,
)
from kvjax.nn._norm import LinenOffsetRMSNorm

__all__ = ["LinenCachedAttention"]


class LinenCachedAttention(nn.Module):
    """Grouped-query attention through a kvjax cache, as a linen module.

    Attributes:
        d_model: E, the input and output width.
        n_heads: Hq, query heads.
        n_kv_heads: H, key/value heads (Hq a multiple of H).
        head_dim: D.
        layer: the model layer id this module caches under.
        rope: RoPE parameters, or ``None`` for no rotation.
        alibi_max_bias: when set, ALiBi with this maximum bias.
        swa_type: sliding-window kind of this layer.
        n_swa: the window size.
        use_bias: biases in the projections.
        param_dtype: parameter dtype.
        scale: softmax scale (default ``1 / sqrt(head_dim)``; Gemma's ``query_pre_attn_scalar ** -0.5``).
        softcap: attention-logit soft-capping (Gemma 2), or ``None``.
        qk_norm: RMSNorm each head of Q and K before RoPE (Gemma 3): ``q_norm`` / ``k_norm``.
        norm_offset: those norms scale by ``(1 + w)`` (Gemma) instead of ``w``.
        norm_eps: their epsilon.
        sinks: a learned sink logit per query head (gpt-oss), the parameter ``sinks [n_heads]``.
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    layer: int
    rope: Optional[RopeConfig] = None
    alibi_max_bias: Optional[float] = None
    swa_type: Union[SwaType, str] = SwaType.NONE
    n_swa: int = 0
    use_bias: bool = False
    param_dtype: Any = jnp.float32
    scale: Optional[float] = None
    softcap: Optional[float] = None
    qk_norm: bool = False
    norm_offset: bool = False
    norm_eps: float = 1e-6
    sinks: bool = False

    def setup(self):
        check_heads(self.n_heads, self.n_kv_heads, self.head_dim)
        check_attention_options(self.scale, self.softcap, self.qk_norm, self.norm_eps)
        if SwaType(self.swa_type) != SwaType.NONE and not self.n_swa > 0:
            raise ValueError(
                f"n_swa={self.n_swa!r} is out of range: allowed an integer > 0 with "
                f"swa_type={SwaType(self.swa_type).value!r}"
            )
        if self.rope is not None and self.rope.n_rot > self.head_dim:
            raise ValueError(f"rope.n_rot={self.rope.n_rot} is out of range: allowed <= head_dim={self.head_dim}")
        dense = dict(use_bias=self.use_bias, param_dtype=self.param_dtype)
        self.q_proj = nn.Dense(self.n_heads * self.head_dim, **dense)
        self.k_proj = nn.Dense(self.n_kv_heads * self.head_dim, **dense)
        self.v_proj = nn.Dense(self.n_kv_heads * self.head_dim, **dense)
        self.o_proj = nn.Dense(self.d_model, **dense)
        if self.qk_norm:
            norm = LinenOffsetRMSNorm if self.norm_offset else nn.RMSNorm
            self.q_norm = norm(epsilon=self.norm_eps, param_dtype=self.param_dtype)
            self.k_norm = norm(epsilon=self.norm_eps, param_dtype=self.param_dtype)
        if check_flag("sinks", self.sinks):  # the field names the option; the parameter is "sinks" too
            self.sink_logits = self.param("sinks", nn.initializers.zeros, (self.n_heads,), self.param_dtype)

    def _options(self):
        alibi = None if self.alibi_max_bias is None else alibi_slopes(self.n_heads, self.alibi_max_bias)
        return dict(
            rope=self.rope,
            alibi=alibi,
            swa_type=SwaType(self.swa_type),
            n_swa=int(self.n_swa),
            scale=self.scale,
            softcap=self.softcap,
            sinks=self.sink_logits if self.sinks else None,
        )

    def _qkv(self, x):
        return project_qkv(self, x)

    def __call__(
        self, x: Float[Array, "T E"], memory: Memory, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T E"], Memory]:
        """Attend the placed ubatch through the memory; returns ``(y [T, E], memory)``.

        Arguments as :meth:`kvjax.nn.CachedAttention.__call__`.
        """
        return cached_attention_call(self, x, memory, inputs, **self._options())

    def uncached(self, x: Float[Array, "B T E"], pos: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """Attention of each sequence (row) over its own tokens, no cache."""
        q, k, v = self._qkv(x)
        out = attend_uncached(q, k, v, pos, **self._options())
        return self.o_proj(out.reshape(x.shape[:-1] + (-1,)))
