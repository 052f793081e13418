"""A Hugging Face Mamba's weights in an NNX :class:`kvjax.nn.Mamba` (``MambaForCausalLM`` names)."""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvjax.nn._hf import hf_source

from kvjax.nn._mamba import Mamba, MambaConfig


# -- Hugging Face weights --------------------------------------------------------------------


def _to_numpy(x):
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu()
        x = x.float() if x.is_floating_point() else x
        return x.numpy()
    return np.asarray(x)


def params_from_hf(hf_model_or_state_dict, model: Optional[Mamba] = None, **config_overrides) -> Mamba:
    """Load the weights of a Hugging Face Mamba into an NNX :class:`Mamba`.

    Args:
        hf_model_or_state_dict: a ``transformers`` ``MambaForCausalLM`` / ``MambaModel``, or its
            ``state_dict()`` (torch tensors or arrays; keys with or without ``backbone.``).
        model: the model to load into (updated in place and returned). Without it the model is
            built from ``MambaConfig.from_hf(hf_model.config, **config_overrides)`` (needs a
            model, not a bare state dict), its random initialisation skipped.

    Returns:
        The model holding the HF weights, in its ``param_dtype``. With tied embeddings an
        ``lm_head.weight`` in the state dict is ignored (HF ties it to the embedding).

    Raises:
        ValueError: a state dict without ``model``, a missing or unexpected key, or a weight
            whose shape does not fit the model's config.
    """
    sd, model = hf_source(hf_model_or_state_dict, model, Mamba, MambaConfig, "Mamba", **config_overrides)
    cfg = model.config

    weights = {}
    for key, value in sd.items():
        key = key[len("backbone.") :] if key.startswith("backbone.") else key
        key = "embeddings.weight" if key == "embedding.weight" else key  # old checkpoints (HF's load_hook)
        weights[key] = value
    if cfg.tie_embeddings:
        weights.pop("lm_head.weight", None)

    # (variable, HF key, transform of the HF array)
    T = lambda w: w.T
    plan = [(model.embed.embedding, "embeddings.weight", None), (model.norm.scale, "norm_f.weight", None)]
    if model.lm_head is not None:
        plan.append((model.lm_head.kernel, "lm_head.weight", T))
    for il, block in enumerate(model.layers):
        p, m = f"layers.{il}.", block.mixer
        plan += [
            (block.norm.scale, p + "norm.weight", None),
            (m.in_proj.kernel, p + "mixer.in_proj.weight", T),
            (m.conv_kernel, p + "mixer.conv1d.weight", lambda w: w[:, 0, :].T if w.ndim == 3 else w),
            (m.x_proj.kernel, p + "mixer.x_proj.weight", T),
            (m.dt_proj.kernel, p + "mixer.dt_proj.weight", T),
            (m.dt_proj.bias, p + "mixer.dt_proj.bias", None),
            (m.A_log, p + "mixer.A_log", None),
            (m.D, p + "mixer.D", None),
            (m.out_proj.kernel, p + "mixer.out_proj.weight", T),
        ]
        if cfg.use_bias:
            plan += [
                (m.in_proj.bias, p + "mixer.in_proj.bias", None),
                (m.out_proj.bias, p + "mixer.out_proj.bias", None),
            ]
        if cfg.use_conv_bias:
            plan.append((m.conv_bias, p + "mixer.conv1d.bias", None))

    missing = [key for _, key, _ in plan if key not in weights]
    if missing:
        raise ValueError(
            f"state dict lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}: allowed the "
            f"weights of a config with n_layer={cfg.n_layer}, use_bias={cfg.use_bias}, "
            f"use_conv_bias={cfg.use_conv_bias}, tie_embeddings={cfg.tie_embeddings}"
        )
    unexpected = sorted(set(weights) - {key for _, key, _ in plan})
    if unexpected:
        raise ValueError(
            f"state dict has unexpected keys {unexpected[:4]}: allowed only the weights of a "
            f"config with n_layer={cfg.n_layer}, use_bias={cfg.use_bias}, "
            f"use_conv_bias={cfg.use_conv_bias}, tie_embeddings={cfg.tie_embeddings}"
        )
    for var, key, fn in plan:
        w = _to_numpy(weights[key])
        w = fn(w) if fn is not None else w
        if tuple(w.shape) != tuple(var.shape):
            raise ValueError(
                f"state dict {key} has shape {tuple(_to_numpy(weights[key]).shape)}: allowed the "
                f"shape that gives {tuple(var.shape)} for this config"
            )
        var.set_value(jnp.asarray(w, var.dtype))
    return model
