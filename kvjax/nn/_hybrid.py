"""A hybrid language model: attention blocks and Mamba blocks by a layer pattern (Jamba-like).

Every layer is a pre-norm residual mixer followed by a pre-norm SwiGLU MLP; the mixer is causal
self-attention (the reference Llama block, RoPE, GQA) on the attention layers and a Mamba mixer
(HF's ``MambaMixer`` maths, :mod:`kvjax.nn._mamba`) on the recurrent layers. Through a
:class:`kvjax.HybridCache` the attention layers read and write the attention part like any kvjax
layer, and the recurrent layers continue each sequence's state from the recurrent part.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> cfg = HybridLMConfig(vocab_size=32, d_model=16, n_layer=3, recurrent_layers=(0, 2), n_heads=2, n_kv_heads=1)
    >>> model = HybridLM(cfg, rngs=nnx.Rngs(0))
    >>> engine = kvjax.Engine(model, kvjax.init(cfg.memory_config(size=64, n_seq_max=2)))
    >>> logits = engine.decode([1, 2, 3, 4], [0, 1, 2, 3], [[0]] * 4)
    >>> bool(jnp.allclose(logits, model.forward(jnp.array([[1, 2, 3, 4]]))[0], atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax.memory._hybrid import HybridCache, HybridConfig
from kvjax.memory._ubatch import equal_slots
from kvjax.nn._inputs import MaskKind, UbatchInputs, check_token_rows, select_outputs
from kvjax.nn._nnx_attention import check_inputs
from kvjax.nn._inputs import check_tokens
from kvjax.nn._llama import MLP, Block, LlamaConfig
from kvjax.nn._mamba import MambaBlock, MambaConfig

__all__ = ["HybridLMConfig", "HybridLM"]


@dataclasses.dataclass(frozen=True)
class HybridLMConfig:
    """Sizes of the hybrid model (frozen, validated by the two configs it derives).

    Attributes:
        vocab_size: token ids.
        d_model: the residual width.
        n_layer: layers.
        recurrent_layers: the Mamba layers (the others are attention layers).
        n_heads: query heads of the attention layers.
        n_kv_heads: kv heads of the attention layers.
        d_state: N, the Mamba state size per channel.
        d_conv: K, the Mamba convolution width.
        expand: Di = expand * d_model.
        d_ff: the MLP width (default as the Llama reference).
        norm_eps: RMSNorm epsilon.
        scan: how the Mamba layers run a prefill's selective scan (``MambaConfig.scan``:
            ``"auto"``, ``"sequential"`` or ``"chunked"``).
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layer: int = 4
    recurrent_layers: Tuple[int, ...] = (0, 2)
    n_heads: int = 4
    n_kv_heads: int = 2
    d_state: int = 8
    d_conv: int = 4
    expand: int = 2
    d_ff: Optional[int] = None
    norm_eps: float = 1e-5
    scan: str = "auto"

    def __post_init__(self):
        layers = tuple(int(il) for il in self.recurrent_layers)
        if list(layers) != sorted(set(layers)) or any(not 0 <= il < self.n_layer for il in layers):
            raise ValueError(
                f"recurrent_layers={self.recurrent_layers!r} is out of range: allowed distinct ascending "
                f"layer ids in [0, n_layer={self.n_layer})"
            )
        object.__setattr__(self, "recurrent_layers", layers)
        self.llama, self.mamba  # noqa: B018 - validates both derived configs now

    @property
    def attention_layers(self) -> Tuple[int, ...]:
        return tuple(il for il in range(self.n_layer) if il not in self.recurrent_layers)

    @property
    def llama(self) -> LlamaConfig:
        """The attention layers' description (layer ids are the model's)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=self.n_layer,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_ff=self.d_ff,
            norm_eps=self.norm_eps,
        )

    @property
    def mamba(self) -> MambaConfig:
        """The recurrent layers' description (``n_layer`` = the number of recurrent layers)."""
        return MambaConfig(
            vocab_size=self.vocab_size,
            d_model=self.d_model,
            n_layer=max(1, len(self.recurrent_layers)),
            d_state=self.d_state,
            d_conv=self.d_conv,
            expand=self.expand,
            norm_eps=self.norm_eps,
            scan=self.scan,
        )

    def memory_config(self, size: int, n_seq_max: int, *, n_states: int = 1, **cache_overrides) -> HybridConfig:
        """The :class:`kvjax.HybridConfig` this model runs on: ``size`` cells of K/V for the attention
        layers, one state cell per sequence for the recurrent ones (``n_states`` kept each)."""
        attention = self.llama.cache_config(
            size=size, n_seq_max=n_seq_max, layer_filter=self.attention_layers, **cache_overrides
        )
        recurrent = self.mamba.memory_config(n_seq_max, n_states=n_states)
        return HybridConfig(attention, recurrent, recurrent_layers=self.recurrent_layers)


class RecurrentBlock(nnx.Module):
    """``x + mamba(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: HybridLMConfig, *, rngs: nnx.Rngs):
        self.mamba = MambaBlock(config.mamba, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.mlp = MLP(config.d_model, config.llama.ff_size, rngs=rngs)

    def __call__(self, x, conv_state, ssm_state, keep=None):
        """``x [S, T, E]`` -> ``(x, conv, ssm)`` (states as :class:`kvjax.nn.MambaBlock`)."""
        x, conv_state, ssm_state = self.mamba(x, conv_state, ssm_state, keep)
        return x + self.mlp(self.mlp_norm(x)), conv_state, ssm_state


class HybridLM(nnx.Module):
    """The hybrid model (see the module docstring).

    Args:
        config: sizes and the layer pattern.
        rngs: NNX random streams.
    """

    def __init__(self, config: HybridLMConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, HybridLMConfig):
            raise ValueError(f"config must be a HybridLMConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nnx.Embed(config.vocab_size, config.d_model, rngs=rngs)
        self.layers = nnx.List(
            [
                RecurrentBlock(config, rngs=rngs)
                if il in config.recurrent_layers
                else Block(config.llama, il, rngs=rngs)
                for il in range(config.n_layer)
            ]
        )
        self.norm = nnx.RMSNorm(config.d_model, epsilon=config.norm_eps, rngs=rngs)
        self.lm_head = nnx.Linear(config.d_model, config.vocab_size, use_bias=False, rngs=rngs)

    def _logits(self, x):
        return self.lm_head(self.norm(x)).astype(jnp.float32)

    def __call__(
        self, tokens: Int[Array, " T"], memory: HybridCache, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T V"], HybridCache]:
        """One equal-split ubatch through a :class:`kvjax.HybridCache` (the model call of ``make_step``).

        Returns:
            ``(logits f32[T, V], memory)`` with the attention layers' K/V and the recurrent
            layers' states written; ``f32[R, V]`` of the rows ``inputs.outputs`` when it is set.
        """
        cfg = self.config
        if not isinstance(memory, HybridCache) or memory.config.recurrent_layers != cfg.recurrent_layers:
            raise ValueError(
                f"memory must be a kvjax.HybridCache with recurrent layers {list(cfg.recurrent_layers)} "
                f"(make it with kvjax.init(config.memory_config(...))), got {type(memory).__name__}"
            )
        check_inputs(inputs)
        check_tokens(tokens, inputs.ubatch, cfg.vocab_size)
        n_slots, t = equal_slots(inputs.ubatch)
        kinds = [MaskKind(memory.layer_part(il)) for il in cfg.attention_layers]
        inputs = inputs.with_masks(memory, kinds)
        placement = inputs.placement[1]
        states, ((conv_all, ssm_all),) = memory.recurrent.read_states(placement, n_slots, t)  # [Lr, S, Di, K-1], ...
        keep = min(states.config.n_states, t)
        convs, ssms = [], []
        x = self.embed(tokens)
        for il, layer in enumerate(self.layers):
            if il in cfg.recurrent_layers:
                r = cfg.recurrent_layers.index(il)
                y, conv, ssm = layer(
                    x.reshape(n_slots, t, -1),
                    jnp.swapaxes(conv_all[r], -1, -2).astype(jnp.float32),
                    ssm_all[r].astype(jnp.float32),
                    keep,
                )
                x = y.reshape(x.shape).astype(x.dtype)
                convs.append(jnp.swapaxes(conv, -1, -2))
                ssms.append(ssm)
            else:
                x, memory = layer(x, memory, inputs)
        states = states.write_states(placement, jnp.stack(convs), jnp.stack(ssms), after=x)
        return self._logits(select_outputs(x, inputs)), memory.replace(recurrent=states)

    def forward(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T V"]:
        """The uncached pass: every row of ``tokens`` is one sequence from position 0 and the zero state."""
        tokens = jnp.asarray(tokens)
        squeeze = tokens.ndim == 1
        tokens = tokens[None] if squeeze else tokens
        check_token_rows(tokens, self.config.vocab_size)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        conv0, ssm0 = self.config.mamba.zero_states(tokens.shape[0])
        x = self.embed(tokens)
        for il, layer in enumerate(self.layers):
            if il in self.config.recurrent_layers:
                x, _, _ = layer(x, conv0[0], ssm0[0])
            else:
                x = layer.uncached(x, positions)
        out = self._logits(x)
        return out[0] if squeeze else out
