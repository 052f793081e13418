"""A DeepSeek V2/V3-style reference model in Flax NNX: latent attention cached on kvjax's latent cache.

Pre-norm blocks of :class:`kvjax.nn.MLAttention` (the cache holds one ``[latent | RoPE key]`` row
per token, ``CacheConfig(mla=True)``) and an MLP: the dense SwiGLU MLP in the first
``n_dense_layers`` blocks, then DeepSeek's mixture of experts (:class:`DeepseekMoE`: routed experts
under a :class:`kvjax.nn.Routing`, plus shared experts every token runs). Sizes and options come
from :class:`DeepseekConfig`; :meth:`DeepseekConfig.from_hf` maps transformers' ``deepseek_v2`` and
``deepseek_v3`` configs, :func:`kvjax.nn.deepseek_from_hf` loads their weights and
:func:`kvjax.nn.from_gguf` llama.cpp's ``deepseek2`` files.

The same weights run two ways, as :class:`kvjax.nn.Llama` does: cached (absorbed attention over
the latent rows, placed by ``kvjax.find_slot``; :func:`kvjax.nn.make_step` jits it) and uncached
(``forward``: every head decompressed, plain causal attention), the reference.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Deepseek, DeepseekConfig, make_step
    >>> cfg = DeepseekConfig(vocab_size=64, d_model=32, n_layer=2, n_heads=2, n_experts=4, n_experts_used=2)
    >>> model = Deepseek(cfg, rngs=nnx.Rngs(0))
    >>> cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2))
    >>> cache.config.mla, cache.config.head_dim                  # [latent 32 | RoPE key 8]
    (True, (40, 40))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]])
    >>> logits, cache, ok = make_step(model)(nnx.state(model), cache, ub, jnp.array([5, 6, 7, 0]), n_kv=32)
    >>> bool(jnp.allclose(logits[:3], model.forward(jnp.array([[5, 6, 7]]))[0], atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, Optional

from flax import nnx

from kvjax._typing import Array, Float
from kvjax._validate import check_count, check_flag, check_real, require
from kvjax.memory._config import CacheConfig, RopeConfig, RopeMode, SwaType
from kvjax.memory._protocol import Memory
from kvjax.nn._hf_rope import rope_from_hf
from kvjax.nn._inputs import MaskKind
from kvjax.nn._llama import MLP, DecoderPasses, block_cached, block_uncached, check_every_layer_cached
from kvjax.nn._mla import MLAttention
from kvjax.nn._moe import MoE, Routing

__all__ = ["DeepseekConfig", "Deepseek", "DeepseekBlock", "DeepseekMoE", "DEEPSEEK_TYPES", "yarn_mscale"]

#: transformers ``model_type`` values :meth:`DeepseekConfig.from_hf` maps.
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude ``0.1 * mscale * ln(factor) + 1`` (1 for ``factor <= 1``), as DeepSeek defines it.

    Example:
        >>> round(yarn_mscale(40.0, 0.707), 4), yarn_mscale(1.0, 0.707)
        (1.2608, 1.0)
    """
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """Sizes and options of the DeepSeek reference model (frozen, hashable, validated on construction).

    Attributes:
        vocab_size: number of token ids.
        d_model: E, the residual width.
        n_layer: number of decoder blocks.
        n_heads: H, attention heads.
        q_lora_rank: the low-rank query's width (V2, V3), or ``None`` for one ``q_proj`` (V2-Lite).
        kv_lora_rank: C, the latent width (512 in V2/V3).
        qk_nope_head_dim: the per-head query/key width without RoPE (128).
        qk_rope_head_dim: R, the RoPE width shared by the heads' keys (64).
        v_head_dim: the per-head value width (128).
        d_ff: the dense MLP's hidden width.
        norm_eps: epsilon of the block norms.
        latent_norm_eps: epsilon of the latent norms (transformers fixes 1e-6).
        rope: RoPE of the R-wide part (default: normal layout, base 10000, ``n_rot = R``);
            ``n_rot`` must equal ``qk_rope_head_dim``.
        softmax_scale: the attention's score scale (default ``(qk_nope + qk_rope) ** -0.5``;
            DeepSeek's YaRN multiplies it by ``yarn_mscale(factor, mscale_all_dim) ** 2``).
        attention_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj``.
        n_dense_layers: the first blocks with the dense MLP (``first_k_dense_replace``); every
            block is dense without experts.
        n_experts: X routed experts of the other blocks (0: every block dense; otherwise >= 2).
        n_experts_used: k, routed experts per token.
        moe_d_ff: each expert's hidden width (default ``d_ff``).
        n_shared_experts: experts every token runs (one dense MLP of ``n_shared * moe_d_ff``).
        routing: how the router picks and weighs the experts (:class:`kvjax.nn.Routing`; V2:
            ``score="softmax"``, V3: ``"sigmoid"`` with ``choice_bias``, groups and ``normalize``).
        tie_embeddings: share the token embedding with the output projection.

    Example:
        >>> cfg = DeepseekConfig(d_model=32, n_heads=2, kv_lora_rank=16, qk_rope_head_dim=4)
        >>> cfg.row_width, cfg.scale == (8 + 4) ** -0.5
        (20, True)
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layer: int = 2
    n_heads: int = 2
    q_lora_rank: Optional[int] = None
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 8
    qk_rope_head_dim: int = 8
    v_head_dim: int = 8
    d_ff: int = 64
    norm_eps: float = 1e-6
    latent_norm_eps: float = 1e-6
    rope: Optional[RopeConfig] = None
    softmax_scale: Optional[float] = None
    attention_bias: bool = False
    n_dense_layers: int = 1
    n_experts: int = 0
    n_experts_used: int = 0
    moe_d_ff: Optional[int] = None
    n_shared_experts: int = 1
    routing: Routing = Routing(score="softmax")
    tie_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "n_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            object.__setattr__(self, name, check_count(name, getattr(self, name), 1))
        object.__setattr__(self, "qk_rope_head_dim", check_count("qk_rope_head_dim", self.qk_rope_head_dim, 2))
        require(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", self.qk_rope_head_dim, "an even number")
        object.__setattr__(self, "d_ff", check_count("d_ff", self.d_ff, 1))
        if self.q_lora_rank is not None:
            object.__setattr__(self, "q_lora_rank", check_count("q_lora_rank", self.q_lora_rank, 1))
        for name in ("norm_eps", "latent_norm_eps"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), above=0))
        if self.rope is not None:
            require(isinstance(self.rope, RopeConfig), "rope", self.rope, "a kvjax.RopeConfig or None")
            require(
                self.rope.n_rot == self.qk_rope_head_dim,
                "rope.n_rot",
                self.rope.n_rot,
                f"qk_rope_head_dim={self.qk_rope_head_dim} (RoPE turns the shared key's part only)",
            )
        object.__setattr__(
            self, "softmax_scale", check_real("softmax_scale", self.softmax_scale, above=0, optional=True)
        )
        for name in ("attention_bias", "tie_embeddings"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        object.__setattr__(self, "n_dense_layers", check_count("n_dense_layers", self.n_dense_layers, 0))
        object.__setattr__(self, "n_experts", check_count("n_experts", self.n_experts, 0))
        object.__setattr__(self, "n_experts_used", check_count("n_experts_used", self.n_experts_used, 0))
        object.__setattr__(self, "n_shared_experts", check_count("n_shared_experts", self.n_shared_experts, 0))
        if self.moe_d_ff is not None:
            object.__setattr__(self, "moe_d_ff", check_count("moe_d_ff", self.moe_d_ff, 1))
        require(isinstance(self.routing, Routing), "routing", self.routing, "a kvjax.nn.Routing")
        if self.n_experts:
            require(self.n_experts >= 2, "n_experts", self.n_experts, "0 (every block dense) or >= 2")
            require(
                1 <= self.n_experts_used <= self.n_experts,
                "n_experts_used",
                self.n_experts_used,
                f"1 to n_experts={self.n_experts}",
            )
            require(self.routing.score != "topk_softmax", "routing.score", self.routing.score, "'softmax' or 'sigmoid'")
            self.routing.check_experts(self.n_experts, self.n_experts_used)
        else:
            require(self.n_experts_used == 0, "n_experts_used", self.n_experts_used, "0 with n_experts=0")

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "DeepseekConfig":
        """The config of a transformers ``DeepseekV2Config`` / ``DeepseekV3Config`` (or a ``config.json`` namespace).

        Maps the MLA sizes, the RoPE of the ``qk_rope_head_dim`` part (:func:`kvjax.nn.rope_from_hf`
        kinds; normal layout for V2's complex rotation and V3's ``rope_interleave``, neox
        otherwise), the softmax scale with YaRN's ``mscale_all_dim``, and the MLP: dense below
        ``first_k_dense_replace``, then ``n_routed_experts`` with V2's softmax routing (groups for
        ``topk_method="group_limited_greedy"``) or V3's sigmoid routing (``e_score_correction_bias``,
        ``n_group`` / ``topk_group``, ``norm_topk_prob``), ``routed_scaling_factor`` and
        ``n_shared_experts``. ``overrides`` replace fields afterwards.

        Raises:
            ValueError: another ``model_type``, an activation other than SiLU, an MLP bias, an
                unknown V2 ``topk_method``, a RoPE kind outside ``kvjax.nn._hf_rope.ROPE_KINDS``.
        """
        get = lambda name, default=None: default if getattr(hf_config, name, None) is None else getattr(hf_config, name)  # noqa: E731
        model_type = get("model_type")
        require(model_type in DEEPSEEK_TYPES, "hf_config.model_type", model_type, f"one of {list(DEEPSEEK_TYPES)}")
        require(get("hidden_act", "silu") in ("silu", "swish"), "hf_config.hidden_act", get("hidden_act"), "'silu'")
        require(not get("mlp_bias", False), "hf_config.mlp_bias", get("mlp_bias"), "False")
        rope_dim, nope = int(hf_config.qk_rope_head_dim), int(hf_config.qk_nope_head_dim)
        params = dict(get("rope_parameters") or get("rope_scaling") or {})
        params.setdefault("rope_theta", get("rope_theta", 10000.0))
        rope = rope_from_hf(params, rope_dim, get("max_position_embeddings"))
        interleaved = model_type == "deepseek_v2" or bool(get("rope_interleave", True))
        rope = dataclasses.replace(rope, mode=RopeMode.NORMAL if interleaved else RopeMode.NEOX)
        scale = (nope + rope_dim) ** -0.5
        if params.get("rope_type", params.get("type", "default")) != "default" and params.get("mscale_all_dim"):
            scale *= yarn_mscale(float(params["factor"]), float(params["mscale_all_dim"])) ** 2
        n_experts = int(get("n_routed_experts", 0) or 0)
        routing = Routing(score="softmax")
        if n_experts and model_type == "deepseek_v2":
            method = get("topk_method", "greedy")
            require(
                method in ("greedy", "group_limited_greedy"),
                "hf_config.topk_method",
                method,
                "'greedy' or 'group_limited_greedy'",
            )
            groups = method == "group_limited_greedy"
            routing = Routing(
                score="softmax",
                n_group=int(get("n_group", 1)) if groups else 1,
                topk_group=int(get("topk_group", 1)) if groups else 1,
                scale=float(get("routed_scaling_factor", 1.0)),
            )
        elif n_experts:
            routing = Routing(
                score="sigmoid",
                n_group=int(get("n_group", 1)),
                topk_group=int(get("topk_group", 1)),
                choice_bias=True,
                normalize=bool(get("norm_topk_prob", False)),
                scale=float(get("routed_scaling_factor", 1.0)),
            )
        args = dict(
            vocab_size=int(hf_config.vocab_size),
            d_model=int(hf_config.hidden_size),
            n_layer=int(hf_config.num_hidden_layers),
            n_heads=int(hf_config.num_attention_heads),
            q_lora_rank=None if get("q_lora_rank") is None else int(hf_config.q_lora_rank),
            kv_lora_rank=int(hf_config.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(hf_config.v_head_dim),
            d_ff=int(hf_config.intermediate_size),
            norm_eps=float(get("rms_norm_eps", 1e-6)),
            rope=rope,
            softmax_scale=scale,
            attention_bias=bool(get("attention_bias", False)),
            n_dense_layers=int(get("first_k_dense_replace", 0)) if n_experts else 0,
            n_experts=n_experts,
            n_experts_used=int(get("num_experts_per_tok", 0) or 0) if n_experts else 0,
            moe_d_ff=int(get("moe_intermediate_size", hf_config.intermediate_size)),
            n_shared_experts=int(get("n_shared_experts", 0) or 0),
            routing=routing,
            tie_embeddings=bool(get("tie_word_embeddings", False)),
        )
        args.update(overrides)
        return cls(**args)

    # -- derived ---------------------------------------------------------------------------

    #: read by the passes shared with the Llama model: DeepSeek scales no embeddings and caps no logits
    scale_embeddings = False
    final_logit_softcap = None

    @property
    def rope_config(self) -> RopeConfig:
        """The RoPE of the ``qk_rope_head_dim`` part (default normal layout, base 10000)."""
        return self.rope if self.rope is not None else RopeConfig(n_rot=self.qk_rope_head_dim)

    @property
    def scale(self) -> float:
        """The softmax scale of every layer."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5

    @property
    def row_width(self) -> int:
        """A cache row: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def expert_size(self) -> int:
        """Each routed (and shared) expert's hidden width."""
        return self.d_ff if self.moe_d_ff is None else self.moe_d_ff

    def moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` runs the mixture of experts (not the dense MLP)."""
        return bool(self.n_experts) and layer >= self.n_dense_layers

    def cache_config(self, size: int, n_seq_max: int, **overrides) -> CacheConfig:
        """The latent :class:`~kvjax.CacheConfig` this model needs: one ``[c | k_pe]`` row a token a layer.

        ``mla=True``, one kv head, ``head_dim = kv_lora_rank + qk_rope_head_dim``,
        ``head_dim_v = kv_lora_rank`` and the RoPE of the key's part for K-shift; ``overrides``
        (``k_dtype``, ``padding``, ...) pass through.

        Example:
            >>> DeepseekConfig().cache_config(size=64, n_seq_max=2).head_dim_v
            (32, 32)
        """
        args = dict(
            size=size,
            n_seq_max=n_seq_max,
            n_layer=self.n_layer,
            n_kv_heads=1,
            head_dim=self.row_width,
            head_dim_v=self.kv_lora_rank,
            mla=True,
            rope=self.rope_config,
        )
        args.update(overrides)
        return CacheConfig(**args)

    def check_cache(self, memory: Memory) -> None:
        """Raise ``ValueError`` unless ``memory`` stores every layer as this model's latent rows."""
        check_every_layer_cached(memory, self.n_layer, "a latent cache (DeepseekConfig.cache_config)")
        for il in range(self.n_layer):
            cfg = memory.part(memory.layer_part(il)).config
            got = (cfg.mla, cfg.n_kv_heads[il], cfg.head_dim[il], cfg.head_dim_v[il])
            if got != (True, 1, self.row_width, self.kv_lora_rank):
                raise ValueError(
                    f"cache layer {il} has mla={got[0]}, n_kv_heads={got[1]}, head_dim={got[2]}, "
                    f"head_dim_v={got[3]}: allowed the latent rows mla=True, n_kv_heads=1, head_dim="
                    f"{self.row_width}, head_dim_v={self.kv_lora_rank} (DeepseekConfig.cache_config)"
                )

    def mask_kinds(self, memory: Optional[Memory] = None) -> Dict[int, MaskKind]:
        """The :class:`kvjax.nn.MaskKind` of every layer (all full causal attention)."""
        return {
            il: MaskKind(0 if memory is None else memory.layer_part(il), False, SwaType.NONE, 0)
            for il in range(self.n_layer)
        }


class DeepseekMoE(nnx.Module):
    """DeepSeek's MLP of a block past ``n_dense_layers``: routed experts plus shared experts.

    ``experts(x) + shared(x)``: ``experts`` is a :class:`kvjax.nn.MoE` (SwiGLU experts, the config's
    routing), ``shared`` one dense SwiGLU MLP of ``n_shared_experts * moe_d_ff`` (the shared
    experts side by side; ``None`` without any).
    """

    def __init__(self, config: DeepseekConfig, *, rngs: nnx.Rngs):
        f = config.expert_size
        self.experts = MoE(
            config.d_model,
            f,
            n_experts=config.n_experts,
            n_experts_used=config.n_experts_used,
            routing=config.routing,
            rngs=rngs,
        )
        self.shared = MLP(config.d_model, f * config.n_shared_experts, rngs=rngs) if config.n_shared_experts else None

    def __call__(self, x: Float[Array, "... E"]) -> Float[Array, "... E"]:
        y = self.experts(x)
        return y if self.shared is None else y + self.shared(x)


class DeepseekBlock(nnx.Module):
    """Pre-norm block: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))`` (dense or :class:`DeepseekMoE`)."""

    def __init__(self, config: DeepseekConfig, layer: int, *, rngs: nnx.Rngs):
        self.attn_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.attn = MLAttention(
            config.d_model,
            config.n_heads,
            kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim,
            qk_rope_head_dim=config.qk_rope_head_dim,
            v_head_dim=config.v_head_dim,
            layer=layer,
            rope=config.rope_config,
            q_lora_rank=config.q_lora_rank,
            scale=config.scale,
            use_bias=config.attention_bias,
            norm_eps=config.latent_norm_eps,
            rngs=rngs,
        )
        self.post_attn_norm = self.post_mlp_norm = None  # no sandwich norms (the shared block passes read them)
        self.mlp_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.mlp = (
            DeepseekMoE(config, rngs=rngs) if config.moe_layer(layer) else MLP(config.d_model, config.d_ff, rngs=rngs)
        )

    def __call__(self, x, memory, inputs):
        return block_cached(self, x, memory, inputs)

    def uncached(self, x, pos):
        """``x [B, T, E]``, ``pos i32[B, T]``: the block without a cache."""
        return block_uncached(self, x, pos)


class Deepseek(DecoderPasses, nnx.Module):
    """The DeepSeek reference model (see the module docstring); its passes are :class:`kvjax.nn.Llama`'s
    (``model(tokens, memory, inputs)`` through a latent memory, ``model.forward(tokens)`` uncached).

    Args:
        config: sizes and options.
        rngs: NNX random streams for the initial weights.
    """

    def __init__(self, config: DeepseekConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, DeepseekConfig):
            raise ValueError(f"config must be a kvjax.nn.DeepseekConfig, got {type(config).__name__}")
        self._build(
            config, DeepseekBlock, lambda: nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs), rngs
        )
