"""Loading Hugging Face DeepSeek V2 / V3 weights into :class:`kvjax.nn.Deepseek`.

:func:`deepseek_plan` lists ``(variable, HF key, transform)`` for a model under transformers'
names, and :func:`kvjax.nn._hf.load_plan` checks a source against it and copies the tensors one at
a time, as for the Llama family. The experts come in two layouts, both read:

- transformers 5 in memory: one stack a layer, ``mlp.experts.gate_up_proj`` ``[X, 2F, E]``
  (gate rows, then up rows) and ``mlp.experts.down_proj`` ``[X, E, F]``;
- checkpoint files (the hub's, and what ``save_pretrained`` writes): one tensor per expert,
  ``mlp.experts.{e}.gate_proj.weight`` and so on. :class:`ExpertStacks` shows them as the stacks,
  read lazily, so the plan has one key per variable either way.

Example:
    >>> import transformers                                                         # doctest: +SKIP
    >>> hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(...))  # doctest: +SKIP
    >>> model = deepseek_from_hf(hf)                                                 # doctest: +SKIP
"""

from __future__ import annotations

import re
from typing import Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from kvjax.nn._deepseek import Deepseek, DeepseekConfig
from kvjax.nn._hf import Plan, _T, _strip, _to_numpy, head_plan, hf_source, load_plan

__all__ = ["deepseek_from_hf", "deepseek_plan", "load_deepseek", "ExpertStacks"]

_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class ExpertStacks(Mapping):
    """A view of HF-named ``weights`` with per-expert tensors shown as transformers 5's stacks.

    ``layers.{i}.mlp.experts.{e}.gate_proj.weight`` / ``up_proj`` ``[F, E]`` and ``down_proj``
    ``[E, F]`` of every expert become ``layers.{i}.mlp.experts.gate_up_proj`` ``[X, 2F, E]`` and
    ``layers.{i}.mlp.experts.down_proj`` ``[X, E, F]``, stacked when read; other keys pass through.
    :attr:`shapes` gives the shown shapes when ``shapes`` of the stored tensors are known.

    Raises:
        ValueError: a layer whose experts are not numbered ``0 .. X-1`` with all three projections.
    """

    def __init__(self, weights: Mapping, shapes: Optional[Mapping] = None):
        self._weights = weights
        groups: Dict[str, Dict[int, Dict[str, str]]] = {}
        self._plain: List[str] = []
        for key in weights:
            m = _PER_EXPERT.match(key)
            if m is None:
                self._plain.append(key)
            else:
                groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = key
        self._stacks: Dict[str, Tuple[str, List[Dict[str, str]]]] = {}
        for prefix, experts in groups.items():
            ids = sorted(experts)
            if ids != list(range(len(ids))) or any(len(p) != 3 for p in experts.values()):
                raise ValueError(
                    f"weights hold experts {ids[:8]} of {prefix} with projections "
                    f"{sorted({n for p in experts.values() for n in p})}: allowed experts 0..X-1, each with "
                    f"gate_proj, up_proj and down_proj"
                )
            rows = [experts[e] for e in ids]
            self._stacks[prefix + ".gate_up_proj"] = ("gate_up", rows)
            self._stacks[prefix + ".down_proj"] = ("down", rows)
        self.shapes: Optional[Dict[str, tuple]] = None
        if shapes is not None:
            self.shapes = {k: tuple(shapes[k]) for k in self._plain}
            for key, (kind, rows) in self._stacks.items():
                gate, down = tuple(shapes[rows[0]["gate_proj"]]), tuple(shapes[rows[0]["down_proj"]])
                self.shapes[key] = (len(rows), 2 * gate[0], gate[1]) if kind == "gate_up" else (len(rows),) + down

    def __getitem__(self, key: str):
        if key not in self._stacks:
            return self._weights[key]
        kind, rows = self._stacks[key]
        if kind == "down":
            return np.stack([_to_numpy(self._weights[r["down_proj"]]) for r in rows])
        return np.stack(
            [
                np.concatenate([_to_numpy(self._weights[r["gate_proj"]]), _to_numpy(self._weights[r["up_proj"]])])
                for r in rows
            ]
        )

    def __iter__(self) -> Iterator[str]:
        yield from self._plain
        yield from self._stacks

    def __len__(self) -> int:
        return len(self._plain) + len(self._stacks)


def _gate_rows(w):
    return np.swapaxes(w[:, : w.shape[1] // 2, :], 1, 2)  # [X, 2F, E] gate rows -> [X, E, F]


def _up_rows(w):
    return np.swapaxes(w[:, w.shape[1] // 2 :, :], 1, 2)


def _swap(w):
    return np.swapaxes(w, 1, 2)  # [X, E, F] -> [X, F, E]


def _mlp_plan(mlp, p: str) -> Plan:
    return [
        (mlp.gate.kernel, p + "gate_proj.weight", _T),
        (mlp.up.kernel, p + "up_proj.weight", _T),
        (mlp.down.kernel, p + "down_proj.weight", _T),
    ]


def deepseek_plan(model: Deepseek) -> Plan:
    """``(variable, HF key, transform)`` of every weight of ``model`` (HF keys without ``model.``)."""
    cfg = model.config
    plan = head_plan(model)
    for il, block in enumerate(model.layers):
        p, a = f"layers.{il}.", block.attn
        s = p + "self_attn."
        plan += [
            (block.attn_norm.scale, p + "input_layernorm.weight", None),
            (block.mlp_norm.scale, p + "post_attention_layernorm.weight", None),
            (a.kv_a_proj_with_mqa.kernel, s + "kv_a_proj_with_mqa.weight", _T),
            (a.kv_a_layernorm.scale, s + "kv_a_layernorm.weight", None),
            (a.kv_b_proj.kernel, s + "kv_b_proj.weight", _T),
            (a.o_proj.kernel, s + "o_proj.weight", _T),
        ]
        if a.q_proj is not None:
            plan.append((a.q_proj.kernel, s + "q_proj.weight", _T))
        else:
            plan += [
                (a.q_a_proj.kernel, s + "q_a_proj.weight", _T),
                (a.q_a_layernorm.scale, s + "q_a_layernorm.weight", None),
                (a.q_b_proj.kernel, s + "q_b_proj.weight", _T),
            ]
        if cfg.attention_bias:
            biased = ("kv_a_proj_with_mqa", "o_proj") + (("q_a_proj",) if a.q_proj is None else ())
            plan += [(getattr(a, name).bias, s + name + ".bias", None) for name in biased]
        if not cfg.moe_layer(il):
            plan += _mlp_plan(block.mlp, p + "mlp.")
            continue
        moe, e = block.mlp.experts, p + "mlp.experts."
        plan += [
            (moe.router.kernel, p + "mlp.gate.weight", _T),
            (moe.gate, e + "gate_up_proj", _gate_rows),
            (moe.up, e + "gate_up_proj", _up_rows),
            (moe.down, e + "down_proj", _swap),
        ]
        if moe.score_bias is not None:
            plan.append((moe.score_bias, p + "mlp.gate.e_score_correction_bias", None))
        if block.mlp.shared is not None:
            plan += _mlp_plan(block.mlp.shared, p + "mlp.shared_experts.")
    return plan


def load_deepseek(
    model: Deepseek, weights: Mapping, *, dtype=None, source: str = "state dict", shapes: Optional[Mapping] = None
) -> None:
    """Set ``model``'s variables from HF-named ``weights`` (keys without ``model.``; experts stacked or one
    tensor each): :func:`deepseek_plan` then :func:`kvjax.nn._hf.load_plan` (the router's choice
    bias, a :class:`kvjax.nn._moe.Float32Param`, stays float32 whatever ``dtype``)."""
    cfg = model.config
    stacked = ExpertStacks(weights, shapes)
    what = (
        f"n_layer={cfg.n_layer}, q_lora_rank={cfg.q_lora_rank}, n_experts={cfg.n_experts}, n_dense_layers="
        f"{cfg.n_dense_layers}, n_shared_experts={cfg.n_shared_experts}, attention_bias={cfg.attention_bias}, "
        f"tie_embeddings={cfg.tie_embeddings}"
    )
    ignore = ("lm_head.weight",) if cfg.tie_embeddings else ()
    load_plan(deepseek_plan(model), stacked, what, dtype=dtype, source=source, shapes=stacked.shapes, ignore=ignore)


def deepseek_from_hf(hf_model_or_state_dict, model: Optional[Deepseek] = None, **config_overrides) -> Deepseek:
    """Load the weights of a transformers ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` into a :class:`Deepseek`.

    Args:
        hf_model_or_state_dict: the transformers model (or its ``*Model`` body), or a
            ``state_dict()`` (keys with or without ``model.``; experts stacked or one tensor each).
        model: the model to load into (updated in place and returned); without it the model is
            built from ``DeepseekConfig.from_hf(hf_model.config, **config_overrides)``.

    Returns:
        The model holding the HF weights.

    Raises:
        ValueError: a state dict without ``model``, a missing or unexpected key, or a weight whose
            shape does not fit the model's config.
    """
    sd, model = hf_source(hf_model_or_state_dict, model, Deepseek, DeepseekConfig, "DeepSeek V2/V3", **config_overrides)
    load_deepseek(model, {_strip(k): v for k, v in sd.items()})
    return model
