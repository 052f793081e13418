"""Loading Hugging Face Llama-family weights (Llama, Qwen2, Mistral, Gemma 2/3, gpt-oss) into :class:`kvjax.nn.Llama`.

One mapping serves every source: :func:`llama_plan` lists ``(variable, HF key, transform)`` for a
model, :func:`load_plan` checks a source against it (missing keys, unexpected keys, shapes) and
copies the tensors one at a time. The source is any mapping from HF key to tensor: a torch
``state_dict()`` (:func:`llama_from_hf`) or the lazy safetensors reader of
:func:`kvjax.nn.from_pretrained`, which reads each tensor only when the plan asks for it.

:func:`llama_config_from_hf` maps a ``transformers`` config (or a namespace read from
``config.json``) onto :class:`~kvjax.nn.LlamaConfig`: Llama, Qwen2, Mistral and gpt-oss here (with
the RoPE scaling kinds default, linear, llama3 and yarn, :func:`rope_from_hf`), Gemma 2/3 through
:meth:`LlamaConfig.from_hf`. Norm weights are copied as stored (Gemma's ``(1 + w)`` is the model's
``norm_offset``), linear weights transposed (torch ``[out, in]`` to flax ``[in, out]``).

Example:
    >>> import transformers                                                   # doctest: +SKIP
    >>> hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(...))    # doctest: +SKIP
    >>> model = llama_from_hf(hf)                                              # doctest: +SKIP
"""

from __future__ import annotations

from typing import Callable, List, Mapping, Optional, Tuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.memory._config import SwaType
from kvjax.nn._fuse import is_fused
from kvjax.nn._hf_rope import ROPE_KINDS, rope_from_hf
from kvjax.nn._llama import Llama, LlamaConfig
from kvjax.nn._moe import load_dtype

__all__ = [
    "llama_from_hf",
    "llama_config_from_hf",
    "rope_from_hf",
    "llama_plan",
    "load_plan",
    "ROPE_KINDS",
    "LLAMA_TYPES",
]


#: ``model_type`` values :func:`llama_config_from_hf` maps (Gemma's go through ``LlamaConfig.from_hf``).
LLAMA_TYPES = ("llama", "qwen2", "mistral", "gemma2", "gemma3_text", "gemma3", "gpt_oss")

Plan = List[Tuple[nnx.Variable, str, Optional[Callable]]]


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (bfloat16 has no numpy dtype: go through float32)
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def _strip(key: str) -> str:
    for prefix in ("model.language_model.", "language_model.model.", "language_model.", "model."):
        if key.startswith(prefix):
            return key[len(prefix) :]
    return key


def hf_source(
    hf_model_or_state_dict, model, model_cls, config_cls, family: str, *, make_config=None, **config_overrides
):
    """``(state_dict, model)`` of a loader's first argument: a transformers model (the model to load
    into is made from its config unless given) or a bare state dict (then ``model`` is required).

    Shared by the Hugging Face loaders of kvjax.nn (``llama_from_hf``, ``Mamba``'s ``params_from_hf``).
    ``make_config(hf_config, **overrides)`` replaces ``config_cls.from_hf`` when given.
    """
    if hasattr(hf_model_or_state_dict, "state_dict") and hasattr(hf_model_or_state_dict, "config"):
        sd = hf_model_or_state_dict.state_dict()
        if model is None:
            make = make_config or config_cls.from_hf
            cfg = make(hf_model_or_state_dict.config, **config_overrides)
            model = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    elif isinstance(hf_model_or_state_dict, Mapping):
        sd = hf_model_or_state_dict
        if model is None:
            raise ValueError(
                f"model is None with a state dict: allowed a {model_cls.__name__} to load into (a state "
                f"dict carries no config)"
            )
    else:
        raise ValueError(
            f"hf_model_or_state_dict must be a transformers {family} model or a state dict, got "
            f"{type(hf_model_or_state_dict).__name__}"
        )
    if not isinstance(model, model_cls):
        raise ValueError(f"model must be a kvjax.nn.{model_cls.__name__}, got {type(model).__name__}")
    return sd, model


# -- config --------------------------------------------------------------------------------------


def _get(hf_config, name, default=None):
    value = getattr(hf_config, name, None)
    return default if value is None else value


def _rope_params(hf_config) -> dict:
    """The one RoPE dict of a non-Gemma config: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (older ``config.json`` files)."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        params = dict(params)
        if "full_attention" in params or "sliding_attention" in params:
            raise ValueError(
                "hf_config.rope_parameters has one entry per layer kind: allowed one RoPE for every "
                "layer (Llama, Qwen2, Mistral)"
            )
        params.setdefault("rope_theta", _get(hf_config, "rope_theta", 10000.0))
        return params
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params["rope_theta"] = _get(hf_config, "rope_theta", 10000.0)
    return params


def llama_config_from_hf(hf_config, **overrides) -> LlamaConfig:
    """The :class:`LlamaConfig` of a ``transformers`` Llama / Qwen2 / Mistral / Gemma 2 / Gemma 3 config.

    ``hf_config`` may be a ``transformers`` config or any object with its attributes (e.g. a
    namespace made from ``config.json``). Gemma goes through :meth:`LlamaConfig.from_hf`; Llama,
    Qwen2 and Mistral map sizes, ``rms_norm_eps``, tied embeddings, the RoPE
    (:func:`rope_from_hf`), q/k/v(/o) biases (Qwen2 always, Llama's ``attention_bias``) and the
    sliding window (Mistral's ``sliding_window`` on every layer, Qwen2's ``layer_types``).
    ``overrides`` replace fields afterwards.

    Raises:
        ValueError: another ``model_type`` (allowed :data:`LLAMA_TYPES`), an activation other than
            SiLU, an MLP bias, a RoPE kind outside :data:`ROPE_KINDS`, or a bad mapped value.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type in ("gemma2", "gemma3_text", "gemma3"):
        return LlamaConfig.from_hf(hf_config, **overrides)
    if model_type == "gpt_oss":
        return _gpt_oss_config(hf_config, **overrides)
    if model_type not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"hf_config.model_type={model_type!r} is out of range: allowed one of {list(LLAMA_TYPES)}")
    act = _get(hf_config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hf_config.hidden_act={act!r} is out of range: allowed 'silu' (the SwiGLU MLP)")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("hf_config.mlp_bias=True is out of range: allowed False")
    n_layer = int(hf_config.num_hidden_layers)
    n_heads = int(hf_config.num_attention_heads)
    head_dim = int(_get(hf_config, "head_dim", int(hf_config.hidden_size) // n_heads))
    window = _get(hf_config, "sliding_window", None)
    swa_layers: Tuple[int, ...] = ()
    if model_type == "mistral" and window:
        swa_layers = tuple(range(n_layer))
    elif model_type == "qwen2" and window and _get(hf_config, "use_sliding_window", False):
        types = _get(hf_config, "layer_types", None)
        if types is None:  # transformers' default: layers from max_window_layers on slide
            first = int(_get(hf_config, "max_window_layers", n_layer))
            swa_layers = tuple(range(first, n_layer))
        else:
            swa_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    args = _common_args(hf_config, head_dim, swa_layers, window, eps=1e-6)
    args["attention_bias"] = model_type == "qwen2" or bool(_get(hf_config, "attention_bias", False))
    args.update(overrides)
    return LlamaConfig(**args)


def _common_args(hf_config, head_dim: int, swa_layers: Tuple[int, ...], window, *, eps: float) -> dict:
    """The :class:`LlamaConfig` fields every non-Gemma config maps alike: sizes, norm epsilon (``eps``
    when the config has none), the one RoPE, the window layers (``window`` cells) and tied embeddings."""
    n_heads = int(hf_config.num_attention_heads)
    return dict(
        vocab_size=int(hf_config.vocab_size),
        d_model=int(hf_config.hidden_size),
        n_layer=int(hf_config.num_hidden_layers),
        n_heads=n_heads,
        n_kv_heads=int(_get(hf_config, "num_key_value_heads", n_heads)),
        head_dim=head_dim,
        d_ff=int(hf_config.intermediate_size),
        norm_eps=float(_get(hf_config, "rms_norm_eps", eps)),
        rope=rope_from_hf(_rope_params(hf_config), head_dim, _get(hf_config, "max_position_embeddings", None)),
        swa_layers=swa_layers,
        swa_type=SwaType.STANDARD,
        n_swa=int(window) if swa_layers else 0,
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
    )


def _gpt_oss_config(hf_config, **overrides) -> LlamaConfig:
    """gpt-oss: q/k/v/o biases, a learned sink per query head, alternating window and full layers
    (``layer_types``), YaRN (``truncate: false``), a top-k mixture of experts with biases and the
    clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``), untied embeddings."""
    n_layer = int(hf_config.num_hidden_layers)
    n_heads = int(hf_config.num_attention_heads)
    head_dim = int(_get(hf_config, "head_dim", int(hf_config.hidden_size) // n_heads))
    types = _get(hf_config, "layer_types", None)
    if types is None:  # transformers' default: even layers slide
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    swa_layers = LlamaConfig.window_layers(types, n_layer)
    args = _common_args(hf_config, head_dim, swa_layers, _get(hf_config, "sliding_window", 0), eps=1e-5)
    args.update(
        attention_bias=bool(_get(hf_config, "attention_bias", True)),
        attention_sinks=True,
        n_experts=int(hf_config.num_local_experts),
        n_experts_used=int(hf_config.num_experts_per_tok),
        expert_bias=True,
        activation="swiglu_oai",
        swiglu_alpha=float(_get(hf_config, "swiglu_alpha", 1.702)),
        swiglu_limit=float(_get(hf_config, "swiglu_limit", 7.0)),
    )
    args.update(overrides)
    return LlamaConfig(**args)


# -- weights -------------------------------------------------------------------------------------


def _T(w):
    return w.T  # torch Linear [out, in] -> flax [in, out]


def _evens(w):
    return w[..., 0::2]  # gpt-oss interleaves gate and up columns: gate, up, gate, up, ...


def _odds(w):
    return w[..., 1::2]


def _experts_plan(mlp, p: str) -> Plan:
    """A :class:`kvjax.nn.MoE`'s weights under transformers' gpt-oss names (``[X, in, out]``, no
    transpose; ``gate_up_proj`` holds gate and up interleaved by column)."""
    e = p + "mlp.experts."
    plan: Plan = [
        (mlp.router.kernel, p + "mlp.router.weight", _T),
        (mlp.gate, e + "gate_up_proj", _evens),
        (mlp.up, e + "gate_up_proj", _odds),
        (mlp.down, e + "down_proj", None),
    ]
    if mlp.router.bias is not None:
        plan += [
            (mlp.router.bias, p + "mlp.router.bias", None),
            (mlp.gate_bias, e + "gate_up_proj_bias", _evens),
            (mlp.up_bias, e + "gate_up_proj_bias", _odds),
            (mlp.down_bias, e + "down_proj_bias", None),
        ]
    return plan


def head_plan(model) -> Plan:
    """The embedding, final norm and (untied) output projection under transformers' names: every
    decoder-only model of kvjax.nn names them alike."""
    plan: Plan = [(model.embed.embedding, "embed_tokens.weight", None), (model.norm.scale, "norm.weight", None)]
    if model.lm_head is not None:
        plan.append((model.lm_head.kernel, "lm_head.weight", _T))
    return plan


def llama_plan(model: Llama, *, o_bias: bool = True) -> Plan:
    """``(variable, HF key, transform)`` of every weight of ``model`` (HF keys without ``model.``).

    The Llama layout (``input_layernorm``, ``post_attention_layernorm`` before the MLP), or
    Gemma's sandwich norms with ``config.sandwich_norms``; gpt-oss's router, experts and sinks
    with ``n_experts`` and ``attention_sinks``. With ``attention_bias`` the q/k/v
    biases are listed, and the o bias when ``o_bias`` (Qwen2 has none: the caller zeroes it).
    """
    if is_fused(model):  # the checkpoint layout names q/k/v and gate/up apart
        raise ValueError(
            "model has fused projections (kvjax.nn.fuse_projections): load or save the checkpoint "
            "with an unfused model, then fuse"
        )
    cfg = model.config
    plan = head_plan(model)
    for il, block in enumerate(model.layers):
        p, a = f"layers.{il}.", block.attn
        plan.append((block.attn_norm.scale, p + "input_layernorm.weight", None))
        if cfg.sandwich_norms:
            plan += [
                (block.post_attn_norm.scale, p + "post_attention_layernorm.weight", None),
                (block.mlp_norm.scale, p + "pre_feedforward_layernorm.weight", None),
                (block.post_mlp_norm.scale, p + "post_feedforward_layernorm.weight", None),
            ]
        else:
            plan.append((block.mlp_norm.scale, p + "post_attention_layernorm.weight", None))
        plan += [
            (a.q_proj.kernel, p + "self_attn.q_proj.weight", _T),
            (a.k_proj.kernel, p + "self_attn.k_proj.weight", _T),
            (a.v_proj.kernel, p + "self_attn.v_proj.weight", _T),
            (a.o_proj.kernel, p + "self_attn.o_proj.weight", _T),
        ]
        if cfg.n_experts:
            plan += _experts_plan(block.mlp, p)
        else:
            plan += [
                (block.mlp.gate.kernel, p + "mlp.gate_proj.weight", _T),
                (block.mlp.up.kernel, p + "mlp.up_proj.weight", _T),
                (block.mlp.down.kernel, p + "mlp.down_proj.weight", _T),
            ]
        if cfg.attention_sinks:
            plan.append((a.sinks, p + "self_attn.sinks", None))
        if cfg.attention_bias:
            plan += [
                (a.q_proj.bias, p + "self_attn.q_proj.bias", None),
                (a.k_proj.bias, p + "self_attn.k_proj.bias", None),
                (a.v_proj.bias, p + "self_attn.v_proj.bias", None),
            ]
            if o_bias:
                plan.append((a.o_proj.bias, p + "self_attn.o_proj.bias", None))
        if cfg.qk_norm:
            plan += [
                (a.q_norm.scale, p + "self_attn.q_norm.weight", None),
                (a.k_norm.scale, p + "self_attn.k_norm.weight", None),
            ]
    return plan


def load_plan(
    plan: Plan,
    weights: Mapping,
    what: str,
    *,
    dtype=None,
    source: str = "state dict",
    shapes: Optional[Mapping] = None,
    ignore: Tuple[str, ...] = (),
) -> None:
    """Check ``weights`` against ``plan``, then set every variable (tensors read one at a time).

    Args:
        plan: ``(variable, key, transform)`` entries (:func:`llama_plan`).
        weights: key to tensor (torch, numpy, or a lazy mapping that reads on ``[]``).
        what: the config summary the error messages name.
        dtype: the parameters' dtype (default: each variable's own; a
            :class:`kvjax.nn._moe.Float32Param` keeps float32).
        source: what ``weights`` is, for the messages (``"state dict"``, ``"checkpoint /path"``).
        shapes: key to the stored shape when known without reading (safetensors headers): every
            shape is then checked before any tensor is read.
        ignore: keys that may be present without a variable (e.g. rotary caches).

    Raises:
        ValueError: a missing key (the first ones are listed), an unexpected key, or a tensor whose
            shape does not fit; raised before any variable is set when ``shapes`` is given.
    """
    missing = [key for _, key, _ in plan if key not in weights]
    if missing:
        raise ValueError(
            f"{source} lacks {missing[:4]}{' ...' if len(missing) > 4 else ''} ({len(missing)} "
            f"tensors): allowed the weights of a config with {what}"
        )
    planned = {key for _, key, _ in plan}
    unexpected = sorted(k for k in set(weights) - planned if k not in ignore)
    if unexpected:
        raise ValueError(
            f"{source} has unexpected keys {unexpected[:4]}: allowed only the weights of a config with {what}"
        )

    def check(key, shape, var, fn):
        got = tuple(fn(np.empty(shape, np.bool_)).shape) if fn is not None else tuple(shape)
        if got != tuple(var.shape):
            want = tuple(fn(np.empty(var.shape, np.bool_)).shape) if fn is not None else tuple(var.shape)
            raise ValueError(f"{source} {key} has shape {tuple(shape)}: allowed {want} for this config ({what})")

    if shapes is not None:
        for var, key, fn in plan:
            check(key, shapes[key], var, fn)
    for var, key, fn in plan:
        raw = _to_numpy(weights[key])
        check(key, raw.shape, var, fn)
        w = fn(raw) if fn is not None else raw
        var.set_value(jnp.asarray(w, load_dtype(var, dtype)))


def llama_from_hf(hf_model_or_state_dict, model: Optional[Llama] = None, **config_overrides) -> Llama:
    """Load the weights of a Hugging Face Llama / Qwen2 / Mistral / Gemma 2 / Gemma 3 text / gpt-oss model into a :class:`Llama`.

    Args:
        hf_model_or_state_dict: a ``transformers`` ``*ForCausalLM`` of those families (or their
            ``*Model`` bodies), or a ``state_dict()`` (torch tensors or arrays; keys with or
            without ``model.``).
        model: the model to load into (updated in place and returned). Without it the model is
            built from ``llama_config_from_hf(hf_model.config, **config_overrides)`` (needs a
            model, not a bare state dict), its random initialisation skipped.

    Returns:
        The model holding the HF weights in its parameter dtype. With tied embeddings an
        ``lm_head.weight`` in the state dict is ignored (HF ties it to the embedding).

    Raises:
        ValueError: a state dict without ``model``, a missing or unexpected key, or a weight whose
            shape does not fit the model's config.
    """
    sd, model = hf_source(
        hf_model_or_state_dict,
        model,
        Llama,
        LlamaConfig,
        "Llama-family",
        make_config=llama_config_from_hf,
        **config_overrides,
    )
    load_llama(model, {_strip(k): v for k, v in sd.items()})
    return model


def load_llama(
    model: Llama, weights: Mapping, *, dtype=None, source: str = "state dict", shapes: Optional[Mapping] = None
) -> None:
    """Set ``model``'s variables from HF-named ``weights`` (keys without ``model.``): :func:`llama_plan`
    then :func:`load_plan`; a missing o bias of a biased model (Qwen2) becomes zeros."""
    cfg = model.config
    o_bias = cfg.attention_bias and "layers.0.self_attn.o_proj.bias" in weights
    plan = llama_plan(model, o_bias=o_bias)
    what = (
        f"n_layer={cfg.n_layer}, sandwich_norms={cfg.sandwich_norms}, qk_norm={cfg.qk_norm}, "
        f"attention_bias={cfg.attention_bias}, tie_embeddings={cfg.tie_embeddings}, n_experts={cfg.n_experts}, "
        f"attention_sinks={cfg.attention_sinks}"
    )
    packed = sorted(k for k in weights if k.endswith(("_blocks", "_scales")) and ".mlp.experts." in k)
    if packed:
        raise ValueError(
            f"{source} stores its experts packed as MXFP4 ({packed[0]}, ...): allowed float expert "
            f"weights; load the model with transformers' Mxfp4Config(dequantize=True) and save it, "
            f"then load that folder"
        )
    ignore = ("lm_head.weight",) if cfg.tie_embeddings else ()
    ignore += tuple(f"layers.{il}.self_attn.rotary_emb.inv_freq" for il in range(cfg.n_layer))
    load_plan(plan, weights, what, dtype=dtype, source=source, shapes=shapes, ignore=ignore)
    if cfg.attention_bias and not o_bias:
        for block in model.layers:
            b = block.attn.o_proj.bias
            b.set_value(jnp.zeros(b.shape, b.dtype if dtype is None else dtype))
