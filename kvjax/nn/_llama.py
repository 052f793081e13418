"""A tiny decoder-only Llama-style reference model in Flax NNX, cached through kvjax.

RMSNorm, SwiGLU MLP, grouped-query attention, RoPE (or ALiBi), optional sliding windows on some
layers, tied or untied embeddings; sizes from :class:`LlamaConfig`. Options turn it into Gemma 2
or Gemma 3 (text): ``(1 + w)`` norms, sandwich norms, scaled embeddings, GELU-tanh MLP,
``query_pre_attn_scalar``, attention- and final-logit soft-capping, a RoPE base of its own for the
window layers, per-head q/k norms (:meth:`LlamaConfig.from_hf` maps a ``transformers`` config,
:func:`kvjax.nn.llama_from_hf` loads its weights). The same weights run two ways:

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
import math
from typing import Dict, Optional, Tuple, Union

import jax.numpy as jnp
from flax import nnx

from kvjax._typing import Array, Float, Int
from kvjax._validate import check_count, check_flag, check_real
from kvjax.memory._config import CacheConfig, RopeConfig, SwaType
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory
from kvjax.nn._fused_layout import split_gate_up
from kvjax.nn._inputs import MaskKind, UbatchInputs, check_token_rows, check_tokens, select_outputs
from kvjax.nn._nnx_attention import CachedAttention, check_inputs
from kvjax.nn._hf_rope import rope_from_hf
from kvjax.nn._moe import GATED, MoE, gated_product
from kvjax.nn._norm import OffsetRMSNorm

__all__ = ["LlamaConfig", "Llama", "Block", "MLP", "ACTIVATIONS"]

#: The gated MLP's products by name, ``(gate, up, alpha, limit) -> hidden``: ``"silu"`` (SwiGLU,
#: Llama), ``"gelu_tanh"`` (GeGLU with the tanh approximation, Gemma's ``gelu_pytorch_tanh``) and
#: ``"swiglu_oai"`` (gpt-oss's clamped SwiGLU, the one that reads ``alpha`` and ``limit``).
ACTIVATIONS = GATED


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

    Gemma options (the defaults keep the Llama model exactly):

    Attributes:
        norm_offset: every RMSNorm scales by ``(1 + w)`` with ``w`` stored as in HF Gemma
            (initialised to 0), computed in float32 (:class:`kvjax.nn.OffsetRMSNorm`).
        sandwich_norms: Gemma 2/3's extra norms on the outputs of attention and MLP before each
            residual add: ``x + post_attn_norm(attn(attn_norm(x)))``, then
            ``x + post_mlp_norm(mlp(mlp_norm(x)))``.
        scale_embeddings: multiply the embeddings by ``sqrt(d_model)`` (in their dtype, as HF);
            the tied output projection uses the unscaled table.
        activation: the gated MLP's activation, ``"silu"`` or ``"gelu_tanh"``
            (:data:`ACTIVATIONS`).
        query_pre_attn_scalar: softmax scale ``query_pre_attn_scalar ** -0.5`` instead of
            ``head_dim ** -0.5`` (> 0, or ``None``).
        attn_logit_softcap: attention-logit soft-capping, ``c * tanh(s / c)`` of the scaled scores
            before the mask (Gemma 2; > 0, or ``None``).
        final_logit_softcap: the same on the output logits (Gemma 2; > 0, or ``None``).
        swa_rope: RoPE parameters of the window layers when they differ from ``rope`` (Gemma 3:
            local layers base 10000, global layers 1e6); needs ``position="rope"``. The cache
            then gets one RoPE per layer for its K-shift.
        qk_norm: RMSNorm of each head of Q and K over ``head_dim`` before RoPE (Gemma 3), with
            the ``(1 + w)`` scale when ``norm_offset``.
        attention_bias: biases on the q/k/v/o projections (Qwen2's q/k/v biases load with a zero
            o bias; HF Llama's ``attention_bias``).

    gpt-oss options (learned sinks, a mixture of experts):

    Attributes:
        attention_sinks: a learned sink logit per query head in every layer's softmax
            (``attn.sinks``, ``[n_heads]``; :func:`kvjax.attention`'s ``sinks``).
        n_experts: X experts in every block's MLP (:class:`kvjax.nn.MoE`, top-k routing); 0 (the
            default) for the dense gated MLP; otherwise >= 2.
        n_experts_used: k, experts per token (1 <= k <= X with experts; 0 without).
        expert_bias: biases on the router and every expert projection (gpt-oss); experts only.
        swiglu_alpha, swiglu_limit: the constants of ``activation="swiglu_oai"`` (> 0; gpt-oss's
            1.702 and 7.0).

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
    norm_offset: bool = False
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    activation: str = "silu"
    query_pre_attn_scalar: Optional[float] = None
    attn_logit_softcap: Optional[float] = None
    final_logit_softcap: Optional[float] = None
    swa_rope: Optional[RopeConfig] = None
    qk_norm: bool = False
    attention_bias: bool = False
    attention_sinks: bool = False
    n_experts: int = 0
    n_experts_used: int = 0
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "n_heads", "n_kv_heads"):
            object.__setattr__(self, name, check_count(name, getattr(self, name), 1))
        if self.head_dim is not None:
            object.__setattr__(self, "head_dim", check_count("head_dim", self.head_dim, 1))
        elif self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is out of range: allowed a multiple of n_heads="
                f"{self.n_heads} (or give head_dim)"
            )
        if self.d_ff is not None:
            object.__setattr__(self, "d_ff", check_count("d_ff", self.d_ff, 1))
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is out of range: allowed a multiple of n_kv_heads={self.n_kv_heads} (GQA)"
            )
        if self.position not in ("rope", "alibi"):
            raise ValueError(f"position={self.position!r} is out of range: allowed 'rope' or 'alibi'")
        if self.rope is not None and self.rope.n_rot > self.head_size:
            raise ValueError(f"rope.n_rot={self.rope.n_rot} is out of range: allowed <= head_dim={self.head_size}")
        object.__setattr__(self, "alibi_max_bias", check_real("alibi_max_bias", self.alibi_max_bias, above=0))
        object.__setattr__(self, "norm_eps", check_real("norm_eps", self.norm_eps, above=0))
        layers = tuple(sorted(set(int(il) for il in self.swa_layers)))
        for il in layers:
            if not 0 <= il < self.n_layer:
                raise ValueError(f"swa_layers contains {il}: allowed layer ids in [0, {self.n_layer})")
        object.__setattr__(self, "swa_layers", layers)
        object.__setattr__(self, "swa_type", SwaType(self.swa_type))
        if layers:
            if self.swa_type == SwaType.NONE:
                raise ValueError(
                    "swa_type='none' is out of range with swa_layers: allowed 'standard', 'chunked' or 'symmetric'"
                )
            object.__setattr__(self, "n_swa", check_count("n_swa", self.n_swa, 1))
        flags = ("norm_offset", "sandwich_norms", "scale_embeddings", "qk_norm", "attention_bias", "attention_sinks")
        for name in flags + ("expert_bias",):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        object.__setattr__(self, "n_experts", check_count("n_experts", self.n_experts, 0))
        object.__setattr__(self, "n_experts_used", check_count("n_experts_used", self.n_experts_used, 0))
        if self.n_experts:
            if self.n_experts < 2:
                raise ValueError(f"n_experts={self.n_experts} is out of range: allowed 0 (a dense MLP) or >= 2")
            if not 1 <= self.n_experts_used <= self.n_experts:
                raise ValueError(
                    f"n_experts_used={self.n_experts_used} is out of range: allowed 1 to n_experts={self.n_experts}"
                )
        elif self.n_experts_used or self.expert_bias:
            name = "n_experts_used" if self.n_experts_used else "expert_bias"
            raise ValueError(
                f"{name}={getattr(self, name)!r} is out of range with n_experts=0: allowed "
                f"{'0' if name == 'n_experts_used' else 'False'} (or set n_experts)"
            )
        for name in ("swiglu_alpha", "swiglu_limit"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), above=0))
        if not isinstance(self.activation, str) or self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is out of range: allowed one of {sorted(ACTIVATIONS)}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), above=0, optional=True))
        if self.swa_rope is not None:
            if not isinstance(self.swa_rope, RopeConfig):
                raise ValueError(f"swa_rope={self.swa_rope!r} is out of range: allowed a kvjax.RopeConfig or None")
            if self.position != "rope":
                raise ValueError(
                    f"swa_rope={self.swa_rope!r} is out of range with position={self.position!r}: "
                    f"allowed only with position='rope' (or swa_rope=None)"
                )
            if self.swa_rope.n_rot > self.head_size:
                raise ValueError(
                    f"swa_rope.n_rot={self.swa_rope.n_rot} is out of range: allowed <= head_dim={self.head_size}"
                )

    @staticmethod
    def window_pattern(n_layer: int, every: int) -> Tuple[int, ...]:
        """The window layers of HF's Gemma pattern: layer ``i`` is global when ``(i + 1) % every == 0``.

        Gemma 2 is ``every=2`` (even layers slide), Gemma 3 ``every=6`` (5 local, then 1 global).

        Example:
            >>> LlamaConfig.window_pattern(4, 2), LlamaConfig.window_pattern(8, 6)
            ((0, 2), (0, 1, 2, 3, 4, 6, 7))
        """
        n_layer, every = check_count("n_layer", n_layer, 1), check_count("every", every, 1)
        return tuple(i for i in range(n_layer) if (i + 1) % every)

    @staticmethod
    def window_layers(layer_types, n_layer: int) -> Tuple[int, ...]:
        """The window layers of a transformers ``layer_types`` list (``"sliding_attention"`` entries).

        Example:
            >>> LlamaConfig.window_layers(["sliding_attention", "full_attention"] * 2, 4)
            (0, 2)
        """
        bad = sorted(set(layer_types) - {"sliding_attention", "full_attention"})
        if bad or len(layer_types) != n_layer:
            raise ValueError(
                f"hf_config.layer_types={list(layer_types)!r} is out of range: allowed {n_layer} "
                f"entries of 'sliding_attention' / 'full_attention'"
            )
        return tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "LlamaConfig":
        """The config of a ``transformers`` ``Gemma2Config`` or ``Gemma3TextConfig`` (or ``Gemma3Config``).

        Maps sizes, ``rms_norm_eps``, ``layer_types`` (or the older ``sliding_window_pattern``) to
        ``swa_layers``, ``sliding_window`` to ``n_swa``, ``query_pre_attn_scalar``, the soft-caps,
        ``hidden_activation``, tied embeddings and the RoPE of each layer kind (``rope_parameters``
        or ``rope_theta`` / ``rope_local_base_freq``; ``"default"`` and ``"linear"`` RoPE, neox
        layout as HF's ``rotate_half``). Gemma 3's attention does not apply
        ``attn_logit_softcapping`` in ``transformers``, so neither does its config here.
        ``overrides`` replace fields afterwards.

        Raises:
            ValueError: another model type, an activation other than GELU-tanh, a RoPE type other
                than default or linear, bidirectional attention, or a bad mapped value.

        Example:
            >>> from transformers import Gemma2Config           # doctest: +SKIP
            >>> LlamaConfig.from_hf(Gemma2Config(num_hidden_layers=4)).swa_layers  # doctest: +SKIP
            (0, 2)
        """
        model_type = getattr(hf_config, "model_type", None)
        if model_type == "gemma3" and getattr(hf_config, "text_config", None) is not None:
            hf_config, model_type = hf_config.text_config, hf_config.text_config.model_type
        if model_type not in ("gemma2", "gemma3_text"):
            raise ValueError(
                f"hf_config.model_type={model_type!r} is out of range: allowed 'gemma2', 'gemma3_text' or 'gemma3'"
            )
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(
                "hf_config.use_bidirectional_attention=True is out of range: allowed False "
                "(the reference model is causal)"
            )
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hf_config.hidden_activation={act!r} is out of range: allowed 'gelu_pytorch_tanh'")
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("hf_config.attention_bias=True is out of range: allowed False")
        n_layer = int(hf_config.num_hidden_layers)
        types = getattr(hf_config, "layer_types", None)
        if types is None:
            every = getattr(hf_config, "sliding_window_pattern", None) or (2 if model_type == "gemma2" else 6)
            swa_layers = cls.window_pattern(n_layer, int(every))
        else:
            swa_layers = cls.window_layers(types, n_layer)
        head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)
        params = getattr(hf_config, "rope_parameters", None) or {}
        if model_type == "gemma3_text":
            full = rope_from_hf(
                params.get("full_attention") or {"rope_theta": getattr(hf_config, "rope_theta", 1e6)},
                head_dim,
                allowed=_GEMMA_ROPE,
            )
            local = rope_from_hf(
                params.get("sliding_attention") or {"rope_theta": getattr(hf_config, "rope_local_base_freq", 1e4)},
                head_dim,
                allowed=_GEMMA_ROPE,
            )
            attn_cap = None  # transformers' Gemma 3 attention ignores attn_logit_softcapping
        else:
            full = rope_from_hf(
                params if "rope_theta" in params else {"rope_theta": getattr(hf_config, "rope_theta", 1e4)},
                head_dim,
                allowed=_GEMMA_ROPE,
            )
            local = full
            attn_cap = getattr(hf_config, "attn_logit_softcapping", None)
        args = dict(
            vocab_size=int(hf_config.vocab_size),
            d_model=int(hf_config.hidden_size),
            n_layer=n_layer,
            n_heads=int(hf_config.num_attention_heads),
            n_kv_heads=int(hf_config.num_key_value_heads),
            head_dim=head_dim,
            d_ff=int(hf_config.intermediate_size),
            norm_eps=float(hf_config.rms_norm_eps),
            rope=full,
            swa_layers=swa_layers,
            swa_type=SwaType.STANDARD,
            n_swa=int(hf_config.sliding_window) if swa_layers else 0,
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            norm_offset=True,
            sandwich_norms=True,
            scale_embeddings=True,
            activation="gelu_tanh",
            query_pre_attn_scalar=float(hf_config.query_pre_attn_scalar),
            attn_logit_softcap=attn_cap,
            final_logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            swa_rope=local if local != full else None,
            qk_norm=model_type == "gemma3_text",
        )
        args.update(overrides)
        return cls(**args)

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

    def layer_rope(self, layer: int) -> Optional[RopeConfig]:
        """The RoPE parameters of a layer: ``swa_rope`` for a window layer when set, else :attr:`rope_config`."""
        if self.swa_rope is not None and layer in self.swa_layers:
            return self.swa_rope
        return self.rope_config

    @property
    def attn_scale(self) -> Optional[float]:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5``, or ``None`` (``head_dim ** -0.5``)."""
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    def layer_window(self, layer: int) -> Tuple[SwaType, int]:
        """``(swa_type, n_swa)`` of a layer (``("none", 0)`` for full attention)."""
        if layer in self.swa_layers:
            return self.swa_type, self.n_swa
        return SwaType.NONE, 0

    def cache_config(self, size: int, n_seq_max: int, **overrides) -> CacheConfig:
        """A kvjax :class:`~kvjax.CacheConfig` that fits this model.

        Layer count, kv heads, head size and the RoPE parameters for K-shift come from the model
        (one per layer with ``swa_rope``); ``overrides`` (``padding``, ``k_dtype``, ``v_dtype``, ...) pass through.

        Example:
            >>> LlamaConfig().cache_config(size=64, n_seq_max=2).n_kv_heads
            (2, 2)
        """
        rope = self.rope_config
        if self.swa_rope is not None:
            rope = tuple(self.layer_rope(il) for il in range(self.n_layer))
        args = dict(
            size=size,
            n_seq_max=n_seq_max,
            n_layer=self.n_layer,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_size,
            rope=rope,
        )
        args.update(overrides)
        return CacheConfig(**args)

    def check_cache(self, memory: Memory) -> None:
        """Raise ``ValueError`` unless ``memory`` stores every layer with this model's shapes."""
        check_every_layer_cached(
            memory, self.n_layer, "a memory that stores the model's attention layers (kvjax.KVCache, ...)"
        )
        for il in range(self.n_layer):
            cfg = memory.part(memory.layer_part(il)).config
            if (cfg.n_kv_heads[il], cfg.head_dim[il], cfg.head_dim_v[il]) != (self.n_kv_heads,) + (self.head_size,) * 2:
                raise ValueError(
                    f"cache layer {il} has n_kv_heads={cfg.n_kv_heads[il]}, head_dim="
                    f"{cfg.head_dim[il]}, head_dim_v={cfg.head_dim_v[il]}: allowed n_kv_heads="
                    f"{self.n_kv_heads}, head_dim=head_dim_v={self.head_size}"
                )

    def mask_kinds(self, memory: Optional[Memory] = None) -> Dict[int, MaskKind]:
        """The :class:`kvjax.nn.MaskKind` of every layer (layers of one kind share a mask).

        The part of each layer comes from ``memory`` (its static routing), 0 without one.
        """
        alibi = self.position == "alibi"
        return {
            il: MaskKind(0 if memory is None else memory.layer_part(il), alibi, *self.layer_window(il))
            for il in range(self.n_layer)
        }


def check_every_layer_cached(memory: Memory, n_layer: int, what: str) -> None:
    """Raise ``ValueError`` unless ``memory`` has attention parts that cache all ``n_layer`` layers
    (``what``: the memory the model needs, for the message)."""
    require_memory(memory)
    if memory.n_parts == 0:
        raise ValueError(f"memory is a {type(memory).__name__} without attention parts: allowed {what}")
    cached = tuple(sorted(il for p in range(memory.n_parts) for il in memory.part(p).config.cached_layers))
    n_cache = memory.part(0).config.n_layer
    if n_cache != n_layer or cached != tuple(range(n_layer)):
        raise ValueError(
            f"cache caches layers {list(cached)} of n_layer={n_cache}: allowed all {n_layer} layers of the model"
        )


#: the RoPE kinds of Gemma 2 / 3 checkpoints
_GEMMA_ROPE = ("default", "linear")


class MLP(nnx.Module):
    """Gated MLP: ``down(act(gate(x)) * up(x))``, no biases (SwiGLU with ``"silu"``, GeGLU-tanh with
    ``"gelu_tanh"``, gpt-oss's clamped product with ``"swiglu_oai"``: :func:`kvjax.nn._moe.gated_product`)."""

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        rngs: nnx.Rngs,
    ):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r} is out of range: allowed one of {sorted(ACTIVATIONS)}")
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = float(swiglu_alpha), float(swiglu_limit)
        self.gate = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d_model, d_ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(d_ff, d_model, use_bias=False, rngs=rngs)
        self.gate_up = nnx.data(None)  # set by kvjax.nn.fuse_projections (then gate and up are None)

    def __call__(self, x):
        if self.gate_up is not None:
            gate, up = split_gate_up(self.gate_up(x))
        else:
            gate, up = self.gate(x), self.up(x)
        return self.down(gated_product(self.activation, gate, up, self.swiglu_alpha, self.swiglu_limit))


def make_mlp(config: LlamaConfig, rngs: nnx.Rngs):
    """A block's MLP: :class:`MoE` when ``config.n_experts``, else the dense :class:`MLP`."""
    glu = dict(activation=config.activation, swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
    if config.n_experts:
        return MoE(
            config.d_model,
            config.ff_size,
            n_experts=config.n_experts,
            n_experts_used=config.n_experts_used,
            use_bias=config.expert_bias,
            rngs=rngs,
            **glu,
        )
    return MLP(config.d_model, config.ff_size, rngs=rngs, **glu)


def _post(norm, h):
    """``norm(h)``, or ``h`` where the block has no such norm (no sandwich norms)."""
    return h if norm is None else norm(h)


def block_cached(block, x, memory, inputs):
    """Pre-norm residual block through the memory (shared by the NNX and linen blocks)."""
    h, memory = block.attn(block.attn_norm(x), memory, inputs)
    x = x + _post(block.post_attn_norm, h)
    return x + _post(block.post_mlp_norm, block.mlp(block.mlp_norm(x))), memory


def block_uncached(block, x, pos):
    """The same block without a cache."""
    x = x + _post(block.post_attn_norm, block.attn.uncached(block.attn_norm(x), pos))
    return x + _post(block.post_mlp_norm, block.mlp(block.mlp_norm(x)))


def _nnx_norm(config: LlamaConfig, dim: int, rngs: nnx.Rngs):
    if config.norm_offset:
        return OffsetRMSNorm(dim, epsilon=config.norm_eps, rngs=rngs)
    return nnx.RMSNorm(dim, epsilon=config.norm_eps, rngs=rngs)


def attention_options(config: LlamaConfig, layer: int) -> dict:
    """The keyword options of layer ``layer``'s attention (shared by the NNX and linen blocks)."""
    swa_type, n_swa = config.layer_window(layer)
    return dict(
        rope=config.layer_rope(layer),
        alibi_max_bias=config.alibi_max_bias if config.position == "alibi" else None,
        swa_type=swa_type,
        n_swa=n_swa,
        scale=config.attn_scale,
        softcap=config.attn_logit_softcap,
        qk_norm=config.qk_norm,
        norm_offset=config.norm_offset,
        norm_eps=config.norm_eps,
        use_bias=config.attention_bias,
        sinks=config.attention_sinks,
    )


class Block(nnx.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    With ``config.sandwich_norms`` (Gemma 2/3) the attention and MLP outputs are normalised again
    (``post_attn_norm``, ``post_mlp_norm``) before each residual add.
    """

    def __init__(self, config: LlamaConfig, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = _nnx_norm(config, config.d_model, rngs)
        self.attn = CachedAttention(
            config.d_model,
            config.n_heads,
            config.n_kv_heads,
            config.head_size,
            layer=layer,
            rngs=rngs,
            **attention_options(config, layer),
        )
        self.post_attn_norm = _nnx_norm(config, config.d_model, rngs) if config.sandwich_norms else None
        self.mlp_norm = _nnx_norm(config, config.d_model, rngs)
        self.mlp = make_mlp(config, rngs)
        self.post_mlp_norm = _nnx_norm(config, config.d_model, rngs) if config.sandwich_norms else None

    def __call__(self, x, memory, inputs):
        return block_cached(self, x, memory, inputs)

    def uncached(self, x, pos):
        """``x [B, T, E]``, ``pos i32[B, T]``: the block without a cache."""
        return block_uncached(self, x, pos)


def embed_tokens(model, tokens):
    """The token embeddings, times ``sqrt(d_model)`` in their own dtype with ``scale_embeddings``."""
    x = model.embed(tokens)
    if model.config.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(model.config.d_model), x.dtype)
    return x


def output_logits(model, x):
    """Final norm, output projection (tied or not) and the final-logit soft-cap (shared by NNX and linen)."""
    x = model.norm(x)
    logits = model.embed.attend(x) if model.lm_head is None else model.lm_head(x)
    cap = model.config.final_logit_softcap
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits


def model_cached(model, tokens, memory, inputs):
    """The cached pass of a Llama (shared by the NNX model and its linen twin)."""
    cfg = model.config
    cfg.check_cache(memory)
    check_inputs(inputs)
    check_tokens(tokens, inputs.ubatch, cfg.vocab_size)
    # one mask per kind of layer (the cells do not change between layers, only K/V do)
    inputs = inputs.with_masks(memory, cfg.mask_kinds(memory).values())
    x = embed_tokens(model, tokens)
    for block in model.layers:
        x, memory = block(x, memory, inputs)
    # the head only on the rows asked for: a prefill never builds a [T, V] array
    return model._logits(select_outputs(x, inputs)), memory


def model_uncached(model, tokens, positions=None):
    """The uncached pass of a Llama (shared by the NNX model and its linen twin)."""
    tokens = jnp.asarray(tokens)
    squeeze = tokens.ndim == 1
    if squeeze:
        tokens = tokens[None]
    check_token_rows(tokens, model.config.vocab_size)
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    positions = jnp.asarray(positions, jnp.int32).reshape(tokens.shape)
    x = embed_tokens(model, tokens)
    for block in model.layers:
        x = block.uncached(x, positions)
    out = model._logits(x)
    return out[0] if squeeze else out


class DecoderPasses:
    """The cached and uncached passes of a decoder-only model of kvjax.nn (:class:`Llama`,
    :class:`kvjax.nn.Deepseek`): the model sets ``config``, ``embed``, ``layers`` (blocks with a
    cached ``__call__`` and an ``uncached`` pass), ``norm`` and ``lm_head`` (None when tied).
    """

    def _build(self, config, make_block, make_norm, rngs: nnx.Rngs) -> None:
        """Set the embedding, the blocks ``make_block(config, layer, rngs=)``, the final norm
        ``make_norm()`` and the output projection (None when ``config.tie_embeddings``)."""
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = nnx.List([make_block(config, il, rngs=rngs) for il in range(config.n_layer)])
        self.norm = make_norm()
        self.lm_head = (
            None if config.tie_embeddings else nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs)
        )

    def _logits(self, x):
        return output_logits(self, x)

    def __call__(
        self, tokens: Int[Array, " T"], memory: Memory, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T V"], Memory]:
        """Run a placed ubatch through the memory.

        Args:
            tokens: ``i32[T]`` token id of each ubatch row (anything in range for padding rows).
            memory: the memory with the ubatch already placed (``kvjax.find_slot``).
            inputs: the ubatch, its placement and the static window of each attention part
                (:class:`kvjax.nn.UbatchInputs`; the model adds the masks).

        Returns:
            ``(logits f32[T, V], memory)``: the logits of every row (padding rows carry no meaning),
            or ``f32[R, V]`` of the rows ``inputs.outputs`` when it is set, and the memory with
            every layer's K/V written (for every row).
        """
        return model_cached(self, tokens, memory, inputs)

    def forward(
        self, tokens: Int[Array, "B T"], positions: Optional[Int[Array, "B T"]] = None
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


class Llama(DecoderPasses, nnx.Module):
    """The reference decoder-only model (see the module docstring).

    Args:
        config: sizes and options.
        rngs: NNX random streams for the initial weights.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, LlamaConfig):
            raise ValueError(f"config must be a kvjax.nn.LlamaConfig, got {type(config).__name__}")
        self._build(config, Block, lambda: _nnx_norm(config, config.d_model, rngs), rngs)
