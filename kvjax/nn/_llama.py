"""A tiny decoder-only Llama-style reference model in Flax NNX, cached through kvjax.

RMSNorm, SwiGLU MLP, grouped-query attention, RoPE (or ALiBi), optional sliding windows on some
layers, tied or untied embeddings; sizes from :class:`LlamaConfig`. The same weights run two ways:

- **cached** (``model(tokens, cache, ubatch, slot, n_kv=...)``): a ubatch of tokens of any mix of
  sequences goes through the kvjax cache (placed first with ``kvjax.find_slot``; the jitted
  :mod:`kvjax.nn._step` does both);
- **uncached** (``model.forward(tokens, positions)``): plain causal attention of each sequence over
  its own tokens, no cache at all; the reference the cached path must equal.

The linen twin is :mod:`kvjax.nn._llama_linen` (same config, same parameter names).

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig, make_step
    >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]])
    >>> step = make_step(model)                    # jitted: find_slot, then model(...)
    >>> logits, cache, ok = step(nnx.state(model), cache, ub, jnp.array([5, 6, 7, 0]), n_kv=32)
    >>> full = model.forward(jnp.array([[5, 6, 7]]))  # uncached
    >>> bool(jnp.allclose(logits[:3], full[0], atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax._typing import Array, Float, Int
from kvjax.memory._config import CacheConfig, RopeConfig, SwaType
from kvjax.memory._protocol import Memory, require_memory
from kvjax.memory._ubatch import Ubatch
from kvjax.nn._inputs import MaskKind, UbatchInputs
from kvjax.nn._nnx_attention import CachedAttention, check_inputs

__all__ = ["LlamaConfig", "Llama", "Block", "MLP"]


def _pos_int(name, value, minimum=1):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is out of range: allowed an integer >= {minimum}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of the reference model (frozen, hashable, validated on construction).

    Attributes:
        vocab_size: number of token ids.
        d_model: E, the residual width.
        n_layer: number of decoder blocks.
        n_heads: Hq, query heads per layer.
        n_kv_heads: H, kv heads per layer (Hq a multiple of H; H < Hq is GQA).
        head_dim: D (default ``d_model // n_heads``).
        d_ff: hidden width of the SwiGLU MLP (default ``8 * d_model / 3`` rounded up to 8).
        norm_eps: RMSNorm epsilon.
        position: ``"rope"`` or ``"alibi"`` (ALiBi instead of RoPE).
        rope: RoPE parameters (default normal mode over the whole head); ignored with ALiBi.
        alibi_max_bias: ALiBi's maximum bias (slopes as in ggml).
        swa_layers: layer ids that use a sliding window (the others attend to everything).
        swa_type: the sliding-window kind of those layers.
        n_swa: their window size (> 0 when ``swa_layers`` is not empty).
        tie_embeddings: share the token embedding with the output projection.

    Example:
        >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layer=2, n_heads=4, n_kv_heads=2)
        >>> cfg.head_size, cfg.ff_size, cfg.rope_config.n_rot
        (8, 88, 8)
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layer: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: Optional[int] = None
    d_ff: Optional[int] = None
    norm_eps: float = 1e-5
    position: str = "rope"
    rope: Optional[RopeConfig] = None
    alibi_max_bias: float = 8.0
    swa_layers: Tuple[int, ...] = ()
    swa_type: Union[SwaType, str] = SwaType.STANDARD
    n_swa: int = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "n_heads", "n_kv_heads"):
            _pos_int(name, getattr(self, name))
        if self.head_dim is not None:
            _pos_int("head_dim", self.head_dim)
        elif self.d_model % self.n_heads:
            raise ValueError(f"d_model={self.d_model} is out of range: allowed a multiple of n_heads="
                             f"{self.n_heads} (or give head_dim)")
        if self.d_ff is not None:
            _pos_int("d_ff", self.d_ff)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is out of range: allowed a multiple of "
                             f"n_kv_heads={self.n_kv_heads} (GQA)")
        if self.position not in ("rope", "alibi"):
            raise ValueError(f"position={self.position!r} is out of range: allowed 'rope' or 'alibi'")
        if self.rope is not None and self.rope.n_rot > self.head_size:
            raise ValueError(f"rope.n_rot={self.rope.n_rot} is out of range: allowed <= head_dim={self.head_size}")
        if not self.alibi_max_bias > 0:
            raise ValueError(f"alibi_max_bias={self.alibi_max_bias!r} is out of range: allowed > 0")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps={self.norm_eps!r} is out of range: allowed > 0")
        layers = tuple(sorted(set(int(il) for il in self.swa_layers)))
        for il in layers:
            if not 0 <= il < self.n_layer:
                raise ValueError(f"swa_layers contains {il}: allowed layer ids in [0, {self.n_layer})")
        object.__setattr__(self, "swa_layers", layers)
        object.__setattr__(self, "swa_type", SwaType(self.swa_type))
        if layers:
            if self.swa_type == SwaType.NONE:
                raise ValueError("swa_type='none' is out of range with swa_layers: allowed 'standard', "
                                 "'chunked' or 'symmetric'")
            _pos_int("n_swa", self.n_swa)

    # -- derived ---------------------------------------------------------------------------

    @property
    def head_size(self) -> int:
        """D."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def ff_size(self) -> int:
        """The SwiGLU hidden width."""
        if self.d_ff is not None:
            return self.d_ff
        return -(-(8 * self.d_model // 3) // 8) * 8

    @property
    def rope_config(self) -> Optional[RopeConfig]:
        """The RoPE parameters of every layer (``None`` with ALiBi)."""
        if self.position == "alibi":
            return None
        return self.rope if self.rope is not None else RopeConfig(n_rot=self.head_size)

    def layer_window(self, layer: int) -> Tuple[SwaType, int]:
        """``(swa_type, n_swa)`` of a layer (``("none", 0)`` for full attention)."""
        if layer in self.swa_layers:
            return self.swa_type, self.n_swa
        return SwaType.NONE, 0

    def cache_config(self, size: int, n_seq_max: int, **overrides) -> CacheConfig:
        """A kvjax :class:`~kvjax.CacheConfig` that fits this model.

        Layer count, kv heads, head size and the RoPE parameters for K-shift come from the model;
        ``overrides`` (``padding``, ``k_dtype``, ``v_dtype``, ...) pass through.

        Example:
            >>> LlamaConfig().cache_config(size=64, n_seq_max=2).n_kv_heads
            (2, 2)
        """
        args = dict(size=size, n_seq_max=n_seq_max, n_layer=self.n_layer, n_kv_heads=self.n_kv_heads,
                    head_dim=self.head_size, rope=self.rope_config)
        args.update(overrides)
        return CacheConfig(**args)

    def check_cache(self, memory: Memory) -> None:
        """Raise ``ValueError`` unless ``memory`` stores every layer with this model's shapes."""
        require_memory(memory)
        if memory.n_parts == 0:
            raise ValueError(f"memory is a {type(memory).__name__} without attention parts: allowed a memory "
                             f"that stores the model's attention layers (kvjax.KVCache, ...)")
        want = tuple(range(self.n_layer))
        cached = tuple(sorted(il for p in range(memory.n_parts) for il in memory.part(p).config.cached_layers))
        n_layer = memory.part(0).config.n_layer
        if n_layer != self.n_layer or cached != want:
            raise ValueError(f"cache caches layers {list(cached)} of n_layer={n_layer}: "
                             f"allowed all {self.n_layer} layers of the model")
        for il in want:
            cfg = memory.part(memory.layer_part(il)).config
            if (cfg.n_kv_heads[il], cfg.head_dim[il], cfg.head_dim_v[il]) != (self.n_kv_heads,) + (self.head_size,) * 2:
                raise ValueError(f"cache layer {il} has n_kv_heads={cfg.n_kv_heads[il]}, head_dim="
                                 f"{cfg.head_dim[il]}, head_dim_v={cfg.head_dim_v[il]}: allowed n_kv_heads="
                                 f"{self.n_kv_heads}, head_dim=head_dim_v={self.head_size}")

    def mask_kinds(self, memory: Optional[Memory] = None) -> Dict[int, MaskKind]:
        """The :class:`kvjax.nn.MaskKind` of every layer (layers of one kind share a mask).

        The part of each layer comes from ``memory`` (its static routing), 0 without one.
        """
        alibi = self.position == "alibi"
        return {il: MaskKind(0 if memory is None else memory.layer_part(il), alibi, *self.layer_window(il))
                for il in range(self.n_layer)}


def check_tokens(tokens, ubatch: Ubatch, vocab_size: int) -> None:
    """Validate the token ids of a ubatch: ``i32[T]`` with T the ubatch length, ids in range."""
    if not isinstance(ubatch, Ubatch):
        raise ValueError(f"ubatch must be a kvjax.Ubatch, got {type(ubatch).__name__}")
    shape = tuple(jnp.shape(tokens))
    if shape != (ubatch.length,) or not jnp.issubdtype(jnp.result_type(tokens), jnp.integer):
        raise ValueError(f"tokens has shape {shape} and dtype {jnp.result_type(tokens)}: allowed an integer "
                         f"[T] array with T = ubatch.length = {ubatch.length}")
    if not isinstance(tokens, jax.core.Tracer):
        ids = np.asarray(tokens)[np.asarray(ubatch.valid)]
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"tokens contains {bad}: allowed ids in [0, {vocab_size})")


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


def block_cached(block, x, memory, inputs):
    """Pre-norm residual block through the memory (shared by the NNX and linen blocks)."""
    h, memory = block.attn(block.attn_norm(x), memory, inputs)
    x = x + h
    return x + block.mlp(block.mlp_norm(x)), memory


def block_uncached(block, x, pos):
    """The same block without a cache."""
    x = x + block.attn.uncached(block.attn_norm(x), pos)
    return x + block.mlp(block.mlp_norm(x))


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, layer: int, *, rngs: nnx.Rngs):
        swa_type, n_swa = config.layer_window(layer)
        self.attn_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.attn = CachedAttention(
            config.d_model, config.n_heads, config.n_kv_heads, config.head_size, layer=layer,
            rope=config.rope_config,
            alibi_max_bias=config.alibi_max_bias if config.position == "alibi" else None,
            swa_type=swa_type, n_swa=n_swa, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.mlp = MLP(config.d_model, config.ff_size, rngs=rngs)

    def __call__(self, x, memory, inputs):
        return block_cached(self, x, memory, inputs)

    def uncached(self, x, pos):
        """``x [B, T, E]``, ``pos i32[B, T]``: the block without a cache."""
        return block_uncached(self, x, pos)


def model_cached(model, tokens, memory, inputs):
    """The cached pass of a Llama (shared by the NNX model and its linen twin)."""
    cfg = model.config
    cfg.check_cache(memory)
    check_inputs(inputs)
    check_tokens(tokens, inputs.ubatch, cfg.vocab_size)
    # one mask per kind of layer (the cells do not change between layers, only K/V do)
    inputs = inputs.with_masks(memory, cfg.mask_kinds(memory).values())
    x = model.embed(tokens)
    for block in model.layers:
        x, memory = block(x, memory, inputs)
    return model._logits(x), memory


def model_uncached(model, tokens, positions=None):
    """The uncached pass of a Llama (shared by the NNX model and its linen twin)."""
    tokens = jnp.asarray(tokens)
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens has shape {tokens.shape}: allowed [B, T] or [T]")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions, jnp.int32).reshape(tokens.shape)
    x = model.embed(tokens)
    for block in model.layers:
        x = block.uncached(x, positions)
    out = model._logits(x)
    return out[0] if squeeze else out


class Llama(nnx.Module):
    """The reference decoder-only model (see the module docstring).

    Args:
        config: sizes and options.
        rngs: NNX random streams for the initial weights.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a kvjax.nn.LlamaConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = nnx.List([Block(config, il, rngs=rngs) for il in range(config.n_layer)])
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.lm_head = None if config.tie_embeddings else nnx.Linear(
            config.d_model, config.vocab_size, use_bias=False, rngs=rngs)

    def _logits(self, x):
        x = self.norm(x)
        return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)

    def __call__(self, tokens: Int[Array, "T"], memory: Memory, inputs: UbatchInputs
                 ) -> Tuple[Float[Array, "T V"], Memory]:
        """Run a placed ubatch through the memory.

        Args:
            tokens: ``i32[T]`` token id of each ubatch row (anything in range for padding rows).
            memory: the memory with the ubatch already placed (``kvjax.find_slot``).
            inputs: the ubatch, its placement and the static window of each attention part
                (:class:`kvjax.nn.UbatchInputs`; the model adds the masks).

        Returns:
            ``(logits f32[T, V], memory)``: the logits of every row (padding rows carry no meaning)
            and the memory with every layer's K/V written.
        """
        return model_cached(self, tokens, memory, inputs)

    def forward(self, tokens: Int[Array, "B T"], positions: Optional[Int[Array, "B T"]] = None
                ) -> Float[Array, "B T V"]:
        """The uncached pass: each row of ``tokens`` is one sequence, attending only to itself.

        Args:
            tokens: ``i32[B, T]`` (or ``[T]`` for one sequence).
            positions: ``i32[B, T]`` positions of the tokens (default ``0..T-1`` per row).

        Returns:
            ``f32[B, T, V]`` logits (``[T, V]`` for a 1-d input). Trailing padding of a row does
            not change the logits of the tokens before it (attention is causal by position).
        """
        return model_uncached(self, tokens, positions)
