"""llama.cpp's ``mamba`` GGUF files as an NNX :class:`kvjax.nn.Mamba` (called by :func:`kvjax.nn.from_gguf`).

``convert_hf_to_gguf.py`` writes a Mamba (1) checkpoint with these tensors per layer (numpy order,
HF name in brackets): ``attn_norm [E]`` (``norm``), ``ssm_in [2 Di, E]`` (``in_proj``),
``ssm_conv1d [Di, K]`` (``conv1d.weight`` squeezed) and ``ssm_conv1d.bias``, ``ssm_x [R + 2N, Di]``
(``x_proj``), ``ssm_dt [Di, R]`` and ``ssm_dt.bias`` (``dt_proj``), ``ssm_a [Di, N]`` holding
``-exp(A_log)`` already, ``ssm_d [Di]`` (``D``), ``ssm_out [E, Di]`` (``out_proj``); and
``token_embd``, ``output_norm``, ``output`` (absent when tied). The sizes are ``mamba.*`` metadata:
``embedding_length``, ``block_count``, ``ssm.conv_kernel``, ``ssm.inner_size``, ``ssm.state_size``,
``ssm.time_step_rank``, ``attention.layer_norm_rms_eps``.

kvjax keeps ``A_log`` (``A = -exp(A_log)`` in the step, as transformers), so ``ssm_a`` loads as
``log(-ssm_a)``: one rounding, within an ulp of ``A``. Falcon Mamba (``ssm.dt_b_c_rms``: norms on
``dt``, ``B``, ``C`` that kvjax's Mamba has not) and Mamba 2 (``mamba2``) are refused by name.
Matrices stay in their file type by default, as for the attention models (:mod:`kvjax.nn._gguf`).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax.nn._gguf_file import _field, head_plan
from kvjax.nn._mamba import Mamba, MambaConfig

__all__ = ["mamba_config", "mamba_plan"]


def mamba_config(reader, tensors: Dict[str, Any], dtype=None) -> MambaConfig:
    """The :class:`MambaConfig` a ``mamba`` GGUF file describes (``ValueError`` naming a bad key)."""
    if _field(reader, "mamba.ssm.dt_b_c_rms", False):
        raise ValueError(
            "mamba.ssm.dt_b_c_rms=True (Falcon Mamba's norms on dt, B and C) is out of range: allowed "
            "False, the Mamba of state-spaces / transformers' MambaForCausalLM"
        )
    keys = {
        "d_model": "mamba.embedding_length",
        "n_layer": "mamba.block_count",
        "d_conv": "mamba.ssm.conv_kernel",
        "d_inner": "mamba.ssm.inner_size",
        "d_state": "mamba.ssm.state_size",
        "dt_rank": "mamba.ssm.time_step_rank",
    }
    sizes = {}
    for name, key in keys.items():
        value = _field(reader, key, required=True)
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"GGUF metadata {key}={value!r} is out of range: allowed a positive integer")
        sizes[name] = int(value)
    if sizes["d_inner"] % sizes["d_model"]:
        raise ValueError(
            f"mamba.ssm.inner_size={sizes['d_inner']} is out of range: allowed a multiple of "
            f"mamba.embedding_length={sizes['d_model']} (d_inner = expand * d_model)"
        )
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file lacks tensors ['token_embd.weight']: allowed the tensors of a mamba model")
    eps = float(_field(reader, "mamba.attention.layer_norm_rms_eps", 1e-5))
    vocab = int(tensors["token_embd.weight"].shape[-1])  # GGUF dims are reversed: [E, V]
    dt = dtype or jnp.float32
    return MambaConfig(
        vocab_size=vocab,
        d_model=sizes["d_model"],
        n_layer=sizes["n_layer"],
        d_state=sizes["d_state"],
        d_conv=sizes["d_conv"],
        expand=sizes["d_inner"] // sizes["d_model"],
        dt_rank=sizes["dt_rank"],
        norm_eps=eps,
        use_bias=False,
        use_conv_bias="blk.0.ssm_conv1d.bias" in tensors,
        tie_embeddings="output.weight" not in tensors,
        dtype=dt,
        param_dtype=dt,
    )


def _neg_exp_inverse(a: np.ndarray, name: str = "ssm_a") -> np.ndarray:
    """``A_log`` from the file's ``A = -exp(A_log)`` (tensor ``name``)."""
    if not (a < 0).all():
        raise ValueError(
            f"tensor {name!r} has entries >= 0: allowed A = -exp(A_log) < 0 as convert_hf_to_gguf.py writes it"
        )
    return np.log(-a.astype(np.float64)).astype(np.float32)


def mamba_plan(model: Mamba) -> List[Tuple[Any, str, bool, Optional[Tuple[Any, str]]]]:
    """``(variable, tensor name, transpose, slot)`` for every weight (as :func:`kvjax.nn._gguf._plan`).

    ``slot`` names the ``nnx.Linear`` / ``nnx.Embed`` a matrix belongs to (compact loads put a
    :class:`kvjax.nn.GGMLLinear` there). ``ssm_a`` is converted by :func:`_neg_exp_inverse`.
    """
    plan = head_plan(model)
    for il, block in enumerate(model.layers):
        p, m = f"blk.{il}.", block.mixer
        plan += [
            (block.norm.scale, p + "attn_norm.weight", False, None),
            (m.in_proj.kernel, p + "ssm_in.weight", True, (m, "in_proj")),
            (m.conv_kernel, p + "ssm_conv1d.weight", True, None),
            (m.x_proj.kernel, p + "ssm_x.weight", True, (m, "x_proj")),
            (m.dt_proj.kernel, p + "ssm_dt.weight", True, (m, "dt_proj")),
            (m.dt_proj.bias, p + "ssm_dt.bias", False, None),
            (m.A_log, p + "ssm_a", False, None),
            (m.D, p + "ssm_d", False, None),
            (m.out_proj.kernel, p + "ssm_out.weight", True, (m, "out_proj")),
        ]
        if m.conv_bias is not None:
            plan.append((m.conv_bias, p + "ssm_conv1d.bias", False, None))
    return plan
