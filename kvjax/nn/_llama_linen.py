"""The linen twin of the reference model :class:`kvjax.nn.Llama`.

Same :class:`~kvjax.nn.LlamaConfig`, same computation, same parameter names (linen calls the
blocks ``layers_0``, ``layers_1``, ... where NNX has ``layers/0``, ``layers/1``);
:func:`params_from_nnx` converts an NNX model's weights so both can be checked against each other.
The kvjax cache is passed in and returned like any other value.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> from kvjax.nn import LlamaConfig, LlamaLinen, make_step
    >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
    >>> model = LlamaLinen(cfg)
    >>> params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32), method=model.forward)
    >>> cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]])
    >>> logits, cache, ok = make_step(model)(params, cache, ub, jnp.array([5, 6, 7, 0]), n_kv=32)
    >>> full = model.apply(params, jnp.array([[5, 6, 7]]), method=model.forward)  # uncached
    >>> bool(jnp.allclose(logits[:3], full[0], atol=1e-5))
    True
"""

from __future__ import annotations

from typing import Optional, Tuple

import flax.linen as nn
import jax
from flax import nnx

from kvjax._typing import Array, Float, Int
from kvjax.memory._protocol import Memory
from kvjax.nn._inputs import UbatchInputs
from kvjax.nn._linen_attention import LinenCachedAttention
from kvjax.nn._llama import (
    Llama,
    LlamaConfig,
    attention_options,
    block_cached,
    block_uncached,
    model_cached,
    model_uncached,
    output_logits,
)
from kvjax.nn._moe import EXPERT_PARAMS, gated_product, moe_forward
from kvjax.nn._norm import LinenOffsetRMSNorm
from kvjax.nn._ggml_linear import GGMLBlocks

__all__ = ["LlamaLinen", "params_from_nnx"]


class _MLP(nn.Module):
    d_ff: int
    d_model: int
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def setup(self):
        self.gate = nn.Dense(self.d_ff, use_bias=False)
        self.up = nn.Dense(self.d_ff, use_bias=False)
        self.down = nn.Dense(self.d_model, use_bias=False)

    def __call__(self, x):
        hidden = gated_product(self.activation, self.gate(x), self.up(x), self.swiglu_alpha, self.swiglu_limit)
        return self.down(hidden)


class _MoE(nn.Module):
    """The linen twin of :class:`kvjax.nn.MoE` (same parameter names and shapes)."""

    config: LlamaConfig

    def setup(self):
        cfg = self.config
        x, e, f = cfg.n_experts, cfg.d_model, cfg.ff_size
        init = nn.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)
        zeros = nn.initializers.zeros
        self.router = nn.Dense(x, use_bias=cfg.expert_bias)
        self.gate, self.up = self.param("gate", init, (x, e, f)), self.param("up", init, (x, e, f))
        self.down = self.param("down", init, (x, f, e))
        bias = cfg.expert_bias
        self.gate_bias = self.param("gate_bias", zeros, (x, f)) if bias else None
        self.up_bias = self.param("up_bias", zeros, (x, f)) if bias else None
        self.down_bias = self.param("down_bias", zeros, (x, e)) if bias else None

    def __call__(self, x):
        cfg = self.config
        params = {n: getattr(self, n) for n in EXPERT_PARAMS}
        return moe_forward(
            x, self.router, params, cfg.n_experts_used, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit
        )


def _linen_norm(cfg: LlamaConfig):
    return LinenOffsetRMSNorm(epsilon=cfg.norm_eps) if cfg.norm_offset else nn.RMSNorm(epsilon=cfg.norm_eps)


class _Block(nn.Module):
    config: LlamaConfig
    layer: int

    def setup(self):
        cfg = self.config
        self.attn_norm = _linen_norm(cfg)
        self.attn = LinenCachedAttention(
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads,
            head_dim=cfg.head_size,
            layer=self.layer,
            **attention_options(cfg, self.layer),
        )
        self.post_attn_norm = _linen_norm(cfg) if cfg.sandwich_norms else None
        self.mlp_norm = _linen_norm(cfg)
        self.mlp = (
            _MoE(cfg)
            if cfg.n_experts
            else _MLP(cfg.ff_size, cfg.d_model, cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        )
        self.post_mlp_norm = _linen_norm(cfg) if cfg.sandwich_norms else None

    def __call__(self, x, memory, inputs):
        return block_cached(self, x, memory, inputs)

    def uncached(self, x, pos):
        return block_uncached(self, x, pos)


class LlamaLinen(nn.Module):
    """The reference model as a linen module (see :class:`kvjax.nn.Llama` for the semantics).

    Attributes:
        config: sizes and options.
    """

    config: LlamaConfig

    def setup(self):
        cfg = self.config
        if not isinstance(cfg, LlamaConfig):
            raise ValueError(f"config must be a kvjax.nn.LlamaConfig, got {type(cfg).__name__}")
        self.embed = nn.Embed(cfg.vocab_size, cfg.d_model)
        self.layers = [_Block(cfg, il) for il in range(cfg.n_layer)]
        self.norm = _linen_norm(cfg)
        self.lm_head = None if cfg.tie_embeddings else nn.Dense(cfg.vocab_size, use_bias=False)

    def _logits(self, x):
        return output_logits(self, x)

    def __call__(
        self, tokens: Int[Array, " T"], memory: Memory, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T V"], Memory]:
        """Run a placed ubatch through the memory; returns ``(logits f32[T, V], memory)``.

        With ``inputs.outputs`` set the logits are ``f32[R, V]``, those of the rows asked for.

        Arguments as :meth:`kvjax.nn.Llama.__call__`.
        """
        return model_cached(self, tokens, memory, inputs)

    def forward(
        self, tokens: Int[Array, "B T"], positions: Optional[Int[Array, "B T"]] = None
    ) -> Float[Array, "B T V"]:
        """The uncached pass, each row one sequence (see :meth:`kvjax.nn.Llama.forward`)."""
        return model_uncached(self, tokens, positions)


def params_from_nnx(model: Llama) -> dict:
    """The linen variables ``{"params": ...}`` holding the weights of an NNX :class:`~kvjax.nn.Llama`.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> from kvjax.nn import Llama, LlamaConfig, LlamaLinen
        >>> cfg = LlamaConfig(n_layer=1)
        >>> nnx_model = Llama(cfg, rngs=nnx.Rngs(0))
        >>> toks = jnp.array([[1, 2, 3]])
        >>> out = LlamaLinen(cfg).apply(params_from_nnx(nnx_model), toks, method=LlamaLinen.forward)
        >>> bool(jnp.allclose(out, nnx_model.forward(toks), atol=1e-5))
        True
    """
    if not isinstance(model, Llama):
        raise ValueError(f"model must be a kvjax.nn.Llama, got {type(model).__name__}")

    compact = nnx.state(model, GGMLBlocks)
    if jax.tree.leaves(compact):  # the linen twin has float kernels only: it would drop these weights
        names = [".".join(str(k) for k in path[:-1]) for path, _ in nnx.to_flat_state(compact)]
        more = " ..." if len(names) > 3 else ""
        raise ValueError(
            f"model has weights kept as ggml blocks ({', '.join(names[:3])}{more}): allowed a model "
            f"with float weights; load it with from_gguf(path, dtype=jnp.float32)"
        )
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    layers = pure.pop("layers")
    for il, block in layers.items():
        pure[f"layers_{il}"] = block
    return {"params": pure}
