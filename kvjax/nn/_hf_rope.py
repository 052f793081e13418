"""Hugging Face RoPE parameters as ggml's ``rope_ext``: the one mapping every checkpoint loader uses.

``rope_from_hf`` reads one transformers ``rope_parameters`` (or older ``rope_scaling``) dict; the
Llama family's loader (:mod:`kvjax.nn._hf`) and Gemma's config (``LlamaConfig.from_hf``) both call
it, the latter allowing only the kinds Gemma uses.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Tuple

import numpy as np

from kvjax.memory._config import RopeConfig

__all__ = ["ROPE_KINDS", "rope_from_hf"]

#: The RoPE scaling kinds (transformers' ``rope_type``) that map onto a :class:`kvjax.RopeConfig`.
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


def rope_from_hf(
    params: Mapping,
    head_dim: int,
    max_position_embeddings: Optional[int] = None,
    *,
    allowed: Tuple[str, ...] = ROPE_KINDS,
) -> RopeConfig:
    """The :class:`kvjax.RopeConfig` of one transformers ``rope_parameters`` (or ``rope_scaling``) dict.

    Neox layout over the whole head (HF's ``rotate_half``). The kinds map onto ggml's ``rope_ext``
    as llama.cpp's converter does:

    - ``default``: ``freq_base = rope_theta``.
    - ``linear``: ``freq_scale = 1 / factor``.
    - ``llama3``: per-pair ``freq_factors`` (HF's smoothed wavelength rule, as divisors).
    - ``yarn``: ``freq_scale = 1 / factor``, ``ext_factor = 1``, ``beta_fast`` / ``beta_slow``,
      ``n_ctx_orig = original_max_position_embeddings``, and ``attn_factor`` such that ggml's
      magnitude ``attn_factor * (1 + 0.1 ln factor)`` equals HF's ``attention_factor``;
      ``truncate`` (default True) as ``yarn_truncate``.

    Args:
        params: ``{"rope_type": ..., "rope_theta": ..., "factor": ..., ...}`` (``type`` is read
            as ``rope_type`` as in old configs).
        head_dim: D, the rotated width.
        max_position_embeddings: the config's, the default of ``original_max_position_embeddings``.
        allowed: the kinds a model accepts (Gemma's configs: ``("default", "linear")``).

    Raises:
        ValueError: a ``rope_type`` outside :data:`ROPE_KINDS` (the message names it), or a
            missing / bad scaling parameter.

    Example:
        >>> rope_from_hf({"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}, 8).freq_scale
        0.25
    """
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in allowed:
        names = " or ".join(map(repr, allowed)) if len(allowed) <= 2 else f"one of {list(allowed)}"
        raise ValueError(
            f"hf_config rope_type={kind!r} is out of range: allowed {names}"
            + (" (kvjax maps these onto ggml's rope_ext)" if len(allowed) > 2 else "")
        )
    theta = float(params.get("rope_theta", 10000.0))
    if params.get("partial_rotary_factor", 1.0) not in (1, 1.0):
        raise ValueError(
            f"hf_config partial_rotary_factor={params['partial_rotary_factor']!r} is out of range: "
            f"allowed 1.0 (RoPE over the whole head)"
        )

    def need(name):
        value = params.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(
                f"hf_config rope_parameters[{name!r}]={value!r} is out of range for rope_type="
                f"{kind!r}: allowed a number > 0"
            )
        return float(value)

    base = dict(n_rot=head_dim, mode="neox", freq_base=theta)
    if kind == "default":
        return RopeConfig(**base)
    if kind == "linear":
        return RopeConfig(**base, freq_scale=1.0 / need("factor"))
    if kind == "llama3":
        factor, low, high = need("factor"), need("low_freq_factor"), need("high_freq_factor")
        n_orig = need("original_max_position_embeddings")
        # transformers' _compute_llama3_parameters, as a divisor of each pair's frequency
        inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = n_orig / low, n_orig / high
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (n_orig / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        new = np.where(medium, smoothed, scaled)
        return RopeConfig(**base, freq_factors=tuple((inv_freq / new).tolist()))
    if kind == "yarn":
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise ValueError(
                f"hf_config rope_parameters['truncate']={truncate!r} is out of range for rope_type='yarn': "
                f"allowed True or False"
            )
        n_orig = params.get("original_max_position_embeddings") or max_position_embeddings
        if n_orig is None:
            raise ValueError(
                "hf_config rope_parameters lacks 'original_max_position_embeddings' for rope_type="
                "'yarn' (and the config has no max_position_embeddings): allowed an integer > 0"
            )
        factor = params.get("factor")
        factor = float(max_position_embeddings) / float(n_orig) if factor is None else need("factor")

        def mscale(scale, m=1.0):
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = params.get("attention_factor")
        if attention is None:
            m, m_all = params.get("mscale"), params.get("mscale_all_dim")
            attention = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
        builtin = 1.0 + 0.1 * math.log(factor)  # ggml multiplies this in whenever ext_factor != 0
        return RopeConfig(
            **base,
            freq_scale=1.0 / factor,
            ext_factor=1.0,
            attn_factor=float(attention) / builtin,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            n_ctx_orig=int(n_orig),
            yarn_truncate=truncate,
        )
    raise AssertionError(f"rope_type={kind!r} is in ROPE_KINDS but has no mapping")
