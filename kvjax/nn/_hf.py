"""Loading Hugging Face Gemma 2 / Gemma 3 (text) weights into the reference model :class:`kvjax.nn.Llama`.

:func:`llama_from_hf` maps a ``transformers`` ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` (or
its state dict) onto an NNX :class:`~kvjax.nn.Llama` configured by
:meth:`~kvjax.nn.LlamaConfig.from_hf`; :func:`kvjax.nn.params_from_nnx` then gives the linen
twin's variables. Norm weights are copied as stored (``(1 + w)`` is the model's
``norm_offset``), linear weights transposed (torch ``[out, in]`` to flax ``[in, out]``).

Example:
    >>> import transformers                                                   # doctest: +SKIP
    >>> hf = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(...))    # doctest: +SKIP
    >>> model = llama_from_hf(hf)                                              # doctest: +SKIP
"""

from __future__ import annotations

from typing import Mapping, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.nn._llama import Llama, LlamaConfig

__all__ = ["llama_from_hf"]


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
            return key[len(prefix):]
    return key


def hf_source(hf_model_or_state_dict, model, model_cls, config_cls, family: str, **config_overrides):
    """``(state_dict, model)`` of a loader's first argument: a transformers model (the model to load
    into is made from its config unless given) or a bare state dict (then ``model`` is required).

    Shared by the Hugging Face loaders of kvjax.nn (``llama_from_hf``, ``Mamba``'s ``params_from_hf``).
    """
    if hasattr(hf_model_or_state_dict, "state_dict") and hasattr(hf_model_or_state_dict, "config"):
        sd = hf_model_or_state_dict.state_dict()
        if model is None:
            cfg = config_cls.from_hf(hf_model_or_state_dict.config, **config_overrides)
            model = nnx.eval_shape(lambda: model_cls(cfg, rngs=nnx.Rngs(0)))
    elif isinstance(hf_model_or_state_dict, Mapping):
        sd = hf_model_or_state_dict
        if model is None:
            raise ValueError(f"model is None with a state dict: allowed a {model_cls.__name__} to load into (a state "
                             f"dict carries no config)")
    else:
        raise ValueError(f"hf_model_or_state_dict must be a transformers {family} model or a state dict, got "
                         f"{type(hf_model_or_state_dict).__name__}")
    if not isinstance(model, model_cls):
        raise ValueError(f"model must be a kvjax.nn.{model_cls.__name__}, got {type(model).__name__}")
    return sd, model


def llama_from_hf(hf_model_or_state_dict, model: Optional[Llama] = None, **config_overrides) -> Llama:
    """Load the weights of a Hugging Face Gemma 2 / Gemma 3 text model into an NNX :class:`Llama`.

    Args:
        hf_model_or_state_dict: a ``transformers`` ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM``
            (or their ``*Model`` bodies), or a ``state_dict()`` (torch tensors or arrays; keys with
            or without ``model.``).
        model: the model to load into (updated in place and returned). Without it the model is
            built from ``LlamaConfig.from_hf(hf_model.config, **config_overrides)`` (needs a model,
            not a bare state dict), its random initialisation skipped.

    Returns:
        The model holding the HF weights in its parameter dtype. With tied embeddings an
        ``lm_head.weight`` in the state dict is ignored (HF ties it to the embedding).

    Raises:
        ValueError: a state dict without ``model``, a model that is not a sandwich-norm Llama, a
            missing or unexpected key, or a weight whose shape does not fit the model's config.
    """
    sd, model = hf_source(hf_model_or_state_dict, model, Llama, LlamaConfig, "Gemma", **config_overrides)
    cfg = model.config
    if not cfg.sandwich_norms:
        raise ValueError("model.config.sandwich_norms=False is out of range: allowed True (the Gemma layout "
                         "this loader maps)")

    weights = {_strip(k): v for k, v in sd.items()}
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)

    T = lambda w: w.T  # noqa: E731  torch Linear [out, in] -> flax [in, out]
    plan = [(model.embed.embedding, "embed_tokens.weight", None), (model.norm.scale, "norm.weight", None)]
    if model.lm_head is not None:
        plan.append((model.lm_head.kernel, "lm_head.weight", T))
    for il, block in enumerate(model.layers):
        p, a = f"layers.{il}.", block.attn
        plan += [(block.attn_norm.scale, p + "input_layernorm.weight", None),
                 (block.post_attn_norm.scale, p + "post_attention_layernorm.weight", None),
                 (block.mlp_norm.scale, p + "pre_feedforward_layernorm.weight", None),
                 (block.post_mlp_norm.scale, p + "post_feedforward_layernorm.weight", None),
                 (a.q_proj.kernel, p + "self_attn.q_proj.weight", T),
                 (a.k_proj.kernel, p + "self_attn.k_proj.weight", T),
                 (a.v_proj.kernel, p + "self_attn.v_proj.weight", T),
                 (a.o_proj.kernel, p + "self_attn.o_proj.weight", T),
                 (block.mlp.gate.kernel, p + "mlp.gate_proj.weight", T),
                 (block.mlp.up.kernel, p + "mlp.up_proj.weight", T),
                 (block.mlp.down.kernel, p + "mlp.down_proj.weight", T)]
        if cfg.qk_norm:
            plan += [(a.q_norm.scale, p + "self_attn.q_norm.weight", None),
                     (a.k_norm.scale, p + "self_attn.k_norm.weight", None)]

    what = (f"n_layer={cfg.n_layer}, qk_norm={cfg.qk_norm}, tie_embeddings={cfg.tie_embeddings}")
    missing = [key for _, key, _ in plan if key not in weights]
    if missing:
        raise ValueError(f"state dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}: allowed the "
                         f"weights of a config with {what}")
    unexpected = sorted(set(weights) - {key for _, key, _ in plan})
    if unexpected:
        raise ValueError(f"state dict has unexpected keys {unexpected[:4]}: allowed only the weights of a "
                         f"config with {what}")
    for var, key, fn in plan:
        w = _to_numpy(weights[key])
        w = fn(w) if fn is not None else w
        if tuple(w.shape) != tuple(var.shape):
            raise ValueError(f"state dict {key} has shape {tuple(_to_numpy(weights[key]).shape)}: allowed the "
                             f"shape that gives {tuple(var.shape)} for this config")
        var.set_value(jnp.asarray(w, var.dtype))
    return model
