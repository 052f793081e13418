"""llama.cpp's ``deepseek2`` GGUF files (DeepSeek V2 / V3, and their MLA kin) as :class:`kvjax.nn.Deepseek`.

Called by :func:`kvjax.nn.from_gguf`. ``convert_hf_to_gguf.py`` writes these tensors per layer
(numpy order, transformers' name in brackets): ``attn_norm`` (``input_layernorm``), ``attn_q``
(``q_proj``) or ``attn_q_a`` / ``attn_q_a_norm`` / ``attn_q_b``, ``attn_kv_a_mqa [C + R, E]``
(``kv_a_proj_with_mqa``), ``attn_kv_a_norm [C]``, the up-projection split for the absorbed form,
``attn_k_b [H, C, N]`` (each head's ``W_uk`` transposed) and ``attn_v_b [H, V, C]`` (older files:
one ``attn_kv_b [H (N + V), C]``), ``attn_output``, ``ffn_norm``; then the dense ``ffn_gate`` /
``ffn_up`` / ``ffn_down`` below ``leading_dense_block_count``, or the router ``ffn_gate_inp``,
V3's choice bias ``exp_probs_b.bias``, the experts ``ffn_{gate,up,down}_exps`` and the shared
experts ``ffn_{gate,up,down}_shexp``.

The metadata: ``attention.kv_lora_rank`` and ``q_lora_rank``; ``attention.key_length`` /
``value_length`` are the cache row's (``C + R`` and ``C``) and ``key_length_mla`` /
``value_length_mla`` the decompressed head's (older files have only the latter pair, under the
plain names); ``rope.dimension_count`` is R; the experts' ``expert_count``, ``expert_used_count``,
``expert_shared_count``, ``expert_feed_forward_length``, ``expert_weights_scale``,
``expert_weights_norm``, ``expert_gating_func`` (1 softmax, the default for V2 files without it;
2 sigmoid) and ``expert_group_count`` / ``expert_group_used_count``.

RoPE is ggml's normal mode (the converter keeps DeepSeek's interleaved pairs). With YaRN, llama.cpp
keeps the rotated part's magnitude at 1 and folds DeepSeek's ``mscale`` into the score scale
(``rope.scaling.yarn_log_multiplier`` is ``0.1 * mscale_all_dim``): the softmax scale is
``yarn_mscale(factor, mscale_all_dim) ** 2 / sqrt(N + R)``. That is transformers' numbers when
``mscale == mscale_all_dim``, as in every DeepSeek release. Matrices stay in their file type by
default; the up-projections ``kv_b_proj`` are rebuilt as one float matrix (the absorbed form
reshapes it per head; it is ``C x H (N + V)`` numbers, a few MB a layer).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax.memory._config import RopeConfig
from kvjax.nn._deepseek import Deepseek, DeepseekConfig
from kvjax.nn._gguf_file import _field, head_plan
from kvjax.nn._moe import Routing

__all__ = ["deepseek_config", "deepseek_plan", "set_up_projections", "up_projection_tensors"]

ARCH = "deepseek2"


def _count(reader, key: str, default=None, *, low: int = 1) -> Optional[int]:
    value = _field(reader, f"{ARCH}.{key}", default, required=default is None)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"GGUF metadata {ARCH}.{key}={value!r} is out of range: allowed an integer >= {low}")
    return int(value)


def deepseek_config(reader, tensors: Dict[str, Any]) -> DeepseekConfig:
    """The :class:`DeepseekConfig` a ``deepseek2`` GGUF file describes (``ValueError`` naming a bad key)."""
    n_layer = _count(reader, "block_count")
    n_heads = _count(reader, "attention.head_count")
    rank = _count(reader, "attention.kv_lora_rank")
    rope_dim = _count(reader, "rope.dimension_count", low=2)
    if _field(reader, f"{ARCH}.attention.key_length_mla") is not None:
        qk, v = _count(reader, "attention.key_length_mla"), _count(reader, "attention.value_length_mla")
        row = (_count(reader, "attention.key_length", rank + rope_dim), _count(reader, "attention.value_length", rank))
        if row != (rank + rope_dim, rank):
            raise ValueError(
                f"{ARCH}.attention.key_length / value_length = {row} is out of range: allowed the latent row "
                f"({rank + rope_dim}, {rank}) = (kv_lora_rank + rope.dimension_count, kv_lora_rank)"
            )
    else:  # files converted before llama.cpp's MLA cache: the decompressed head's sizes
        qk, v = _count(reader, "attention.key_length"), _count(reader, "attention.value_length")
    if qk <= rope_dim:
        raise ValueError(
            f"{ARCH}.attention.key_length_mla={qk} is out of range: allowed > rope.dimension_count={rope_dim} "
            f"(qk_nope_head_dim + qk_rope_head_dim)"
        )
    q_rank = _field(reader, f"{ARCH}.attention.q_lora_rank")
    q_rank = int(q_rank) if q_rank and "blk.0.attn_q_a.weight" in tensors else None
    rope, scale = _rope(reader, rope_dim, qk)
    eps = float(_field(reader, f"{ARCH}.attention.layer_norm_rms_epsilon", required=True))
    n_experts = _count(reader, "expert_count", 0, low=0)
    args = dict(
        n_layer=n_layer,
        d_model=_count(reader, "embedding_length"),
        n_heads=n_heads,
        q_lora_rank=q_rank,
        kv_lora_rank=rank,
        qk_nope_head_dim=qk - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v,
        d_ff=_count(reader, "feed_forward_length"),
        norm_eps=eps,
        latent_norm_eps=eps,  # llama.cpp normalises the latents with the blocks' epsilon
        rope=rope,
        softmax_scale=scale,
        tie_embeddings="output.weight" not in tensors,
    )
    if n_experts:
        gating = _count(reader, "expert_gating_func", 1)
        if gating not in (1, 2):
            raise ValueError(
                f"GGUF metadata {ARCH}.expert_gating_func={gating} is out of range: allowed 1 (softmax) or 2 (sigmoid)"
            )
        args.update(
            n_dense_layers=_count(reader, "leading_dense_block_count", 0, low=0),
            n_experts=n_experts,
            n_experts_used=_count(reader, "expert_used_count"),
            moe_d_ff=_count(reader, "expert_feed_forward_length"),
            n_shared_experts=_count(reader, "expert_shared_count", 0, low=0),
            routing=Routing(
                score="softmax" if gating == 1 else "sigmoid",
                n_group=_count(reader, "expert_group_count", 1),
                topk_group=_count(reader, "expert_group_used_count", 1),
                choice_bias=any(name.endswith(".exp_probs_b.bias") for name in tensors),
                normalize=bool(_field(reader, f"{ARCH}.expert_weights_norm", False)),
                scale=float(_field(reader, f"{ARCH}.expert_weights_scale", 1.0) or 1.0),
            ),
        )
    else:
        args.update(n_dense_layers=n_layer, n_shared_experts=0)
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file lacks tensors ['token_embd.weight']: allowed the tensors of a deepseek2 model")
    args["vocab_size"] = int(_field(reader, f"{ARCH}.vocab_size", int(tensors["token_embd.weight"].shape[-1])))
    try:
        return DeepseekConfig(**args)
    except ValueError as e:
        raise ValueError(f"GGUF metadata gives a config that is out of range: {e}") from None


def _rope(reader, rope_dim: int, qk: int) -> Tuple[RopeConfig, Optional[float]]:
    """``(rope, softmax scale)`` of the metadata, as llama.cpp's deepseek2 graph runs them (scale
    ``None``: the config's default ``qk ** -0.5``)."""
    base = float(_field(reader, f"{ARCH}.rope.freq_base", 10000.0))
    kind = _field(reader, f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return RopeConfig(n_rot=rope_dim, freq_base=base), None
    if kind != "yarn":
        raise ValueError(f"{ARCH}.rope.scaling.type={kind!r} is out of range: allowed 'none' or 'yarn'")
    factor = float(_field(reader, f"{ARCH}.rope.scaling.factor", required=True))
    if not factor > 1:
        raise ValueError(f"{ARCH}.rope.scaling.factor={factor} is out of range: allowed > 1 with yarn")
    log_mul = float(_field(reader, f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.0))
    builtin = 1.0 + 0.1 * math.log(factor)  # ggml's YaRN magnitude, cancelled: the rotated part keeps its length
    rope = RopeConfig(
        n_rot=rope_dim,
        freq_base=base,
        freq_scale=1.0 / factor,
        ext_factor=1.0,
        attn_factor=1.0 / builtin,
        beta_fast=float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_fast", 32.0)),
        beta_slow=float(_field(reader, f"{ARCH}.rope.scaling.yarn_beta_slow", 1.0)),
        n_ctx_orig=int(
            _field(reader, f"{ARCH}.rope.scaling.original_context_length", 0)
            or _field(reader, f"{ARCH}.context_length", required=True)
        ),
    )
    mscale = 1.0 + log_mul * math.log(factor)  # log_mul = 0.1 * mscale_all_dim
    return rope, mscale * mscale * qk**-0.5


def deepseek_plan(model: Deepseek) -> List[Tuple[Any, str, bool, Optional[Tuple[Any, str]]]]:
    """``(variable, tensor name, transpose, slot)`` of every weight but the up-projections (see
    :func:`up_projection_tensors`), as :func:`kvjax.nn._gguf._load` takes them."""
    cfg = model.config
    plan = head_plan(model)

    def linear(parent, attr, name):
        return (getattr(parent, attr).kernel, name, True, (parent, attr))

    for il, block in enumerate(model.layers):
        p, a = f"blk.{il}.", block.attn
        plan += [
            (block.attn_norm.scale, p + "attn_norm.weight", False, None),
            linear(a, "kv_a_proj_with_mqa", p + "attn_kv_a_mqa.weight"),
            (a.kv_a_layernorm.scale, p + "attn_kv_a_norm.weight", False, None),
            linear(a, "o_proj", p + "attn_output.weight"),
            (block.mlp_norm.scale, p + "ffn_norm.weight", False, None),
        ]
        if a.q_proj is not None:
            plan.append(linear(a, "q_proj", p + "attn_q.weight"))
        else:
            plan += [
                linear(a, "q_a_proj", p + "attn_q_a.weight"),
                (a.q_a_layernorm.scale, p + "attn_q_a_norm.weight", False, None),
                linear(a, "q_b_proj", p + "attn_q_b.weight"),
            ]
        if not cfg.moe_layer(il):
            m = block.mlp
            plan += [linear(m, n, p + f"ffn_{n}.weight") for n in ("gate", "up", "down")]
            continue
        moe, shared = block.mlp.experts, block.mlp.shared
        plan.append((moe.router.kernel, p + "ffn_gate_inp.weight", True, None))
        plan += [(getattr(moe, n), p + f"ffn_{n}_exps.weight", True, (moe, n)) for n in ("gate", "up", "down")]
        if moe.score_bias is not None:
            plan.append((moe.score_bias, p + "exp_probs_b.bias", False, None))
        if shared is not None:
            plan += [linear(shared, n, p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")]
    return plan


def up_projection_tensors(model: Deepseek, tensors: Dict[str, Any], shape_of) -> Tuple[List[str], List[str]]:
    """``(used, ignored)`` tensor names of every layer's up-projections, their shapes checked.

    ``attn_k_b [H, C, N]`` and ``attn_v_b [H, V, C]`` when the file has them (``attn_kv_b``, which
    some converters write beside them, is then ignored), else ``attn_kv_b [H (N + V), C]``.
    ``shape_of(tensor)`` gives a tensor's numpy-order shape.

    Raises:
        ValueError: a layer with neither form, or a tensor of the wrong shape (named).
    """
    cfg = model.config
    h, c, n, v = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    used, ignored = [], []
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        if p + "attn_k_b.weight" in tensors and p + "attn_v_b.weight" in tensors:
            want = {p + "attn_k_b.weight": (h, c, n), p + "attn_v_b.weight": (h, v, c)}
            if p + "attn_kv_b.weight" in tensors:
                ignored.append(p + "attn_kv_b.weight")
        elif p + "attn_kv_b.weight" in tensors:
            want = {p + "attn_kv_b.weight": (h * (n + v), c)}
        else:
            raise ValueError(
                f"GGUF file lacks tensors ['{p}attn_k_b.weight', '{p}attn_v_b.weight'] (or an older "
                f"'{p}attn_kv_b.weight'): allowed the up-projections of every deepseek2 layer"
            )
        for name, shape in want.items():
            if shape_of(tensors[name]) != shape:
                raise ValueError(f"tensor {name!r} has shape {shape_of(tensors[name])}: allowed {shape}")
        used += list(want)
    return used, ignored


def set_up_projections(model: Deepseek, tensors: Dict[str, Any], dequantize, dtype) -> None:
    """Set every layer's ``kv_b_proj`` kernel ``[C, H (N + V)]`` from the file's up-projections."""
    cfg = model.config
    h, c, n = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim
    for il, block in enumerate(model.layers):
        p = f"blk.{il}."
        if p + "attn_k_b.weight" in tensors and p + "attn_v_b.weight" in tensors:
            k_b = dequantize(tensors[p + "attn_k_b.weight"])  # [H, C, N]: head h's W_uk^T
            v_b = dequantize(tensors[p + "attn_v_b.weight"])  # [H, V, C]
            per_head = np.concatenate([np.transpose(k_b, (1, 0, 2)), np.transpose(v_b, (2, 0, 1))], axis=-1)
            kernel = per_head.reshape(c, -1)  # [C, H, N + V] -> kv_b_proj's [C, H (N + V)]
        else:
            kernel = dequantize(tensors[p + "attn_kv_b.weight"]).T
        assert kernel.shape == (c, h * (n + cfg.v_head_dim))
        block.attn.kv_b_proj.kernel.set_value(jnp.asarray(kernel, dtype or jnp.float32))
