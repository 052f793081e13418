"""Loading llama.cpp GGUF files into the reference model :class:`kvjax.nn.Llama`.

:func:`from_gguf` reads a GGUF file with the ``gguf`` package's memory-mapped reader (nothing is
read until it is needed), checks the whole file first (architecture, RoPE kind, every tensor's
name, type, shape and extent inside the file), and only then dequantizes the tensors into a model
built without a random initialisation. A bad file raises ``ValueError`` and no model comes back:
nothing is half-loaded.

**Architectures.** ``llama`` (Llama 1/2/3, and Mistral, which ``convert_hf_to_gguf.py`` writes as
``llama``), ``mistral``, ``qwen2`` (q/k/v biases), ``gemma2`` and ``gemma3`` (text): sandwich norms,
scaled embeddings, GELU-tanh, soft-capping (Gemma 2), per-head q/k norms and a RoPE base of their
own for the window layers (Gemma 3), the window layers from ``attention.sliding_window_pattern``
or llama.cpp's default pattern (every 2nd / 6th layer global). Gemma's GGUF norms hold ``1 + w``
already, so they load as plain RMSNorm scales, as llama.cpp uses them.

**RoPE convention.** llama.cpp rotates ``llama``-arch models in ggml's *normal* mode (adjacent
pairs), and ``convert_hf_to_gguf.py`` permutes the rows of each head of ``attn_q`` / ``attn_k``
from Hugging Face's halves layout into pairs to match. The weights are taken as stored and the
model runs RoPE mode ``"normal"``: ``q . k`` is the same sum in another order, so the logits equal
the Hugging Face model's, and the K rows written to the cache are in llama.cpp's order (a state
saved by llama.cpp for that model is read as it is). ``qwen2`` and the Gemmas are not permuted
and run ``"neox"``, as llama.cpp does. Llama 3's RoPE scaling arrives as the ``rope_freqs`` tensor (one
divisor per rotated pair: :attr:`kvjax.RopeConfig.freq_factors`); ``linear`` scaling as
``rope.scaling.factor``; ``yarn`` as llama.cpp runs it (extrapolation mix 1, ``beta_fast`` /
``beta_slow`` from the file or 32 / 1, ``original_context_length``, magnitude ``1 + 0.1 ln
factor``). Other scaling kinds (LongRoPE, YaRN with a log multiplier) are refused.

**Tensor types.** Every ggml weight type real files use (:data:`GGUF_TENSOR_TYPES`: F32, F16,
BF16, Q4_0 .. Q8_0, the K types, the IQ and TQ types, MXFP4, NVFP4; the few others are refused by
name, with the reason). By default (``dtype=None``) every matrix stays in its file type, resident as
the file's bytes, and the jitted step dequantizes it right before each product
(:class:`kvjax.nn.GGMLLinear`, kvjax's JAX dequantizers, bit-exact with ggml's): resident weights
are about the file's size. With ``dtype=jnp.float32`` / ``bfloat16`` / ``float16`` the tensors are
dequantized once at load with the ``gguf`` package's numpy dequantizers: faster steps on CPU
(``docs/speed.md``), 2-8x the memory. Norms, biases and F32 matrices are always float.

**Architectures, further.** ``qwen3`` (per-head q/k norms, no biases); tied embeddings wherever a
file has no ``output.weight`` (Llama 3.2, Gemma); ``head_count_kv`` given per layer is accepted when
every layer has the same count; ``mamba`` loads into :class:`kvjax.nn.Mamba`
(:mod:`kvjax.nn._gguf_mamba`); ``gpt-oss`` (biases, learned sinks, every even layer a window
layer, a mixture of experts whose expert tensors, MXFP4 in real files, stay compact too:
:class:`kvjax.nn.GGMLExperts`).
Any other ``general.architecture`` is refused by name.

Example:
    >>> model = from_gguf("tinyllama-q8_0.gguf")                        # doctest: +SKIP
    >>> cache = kvjax.init(model.config.cache_config(size=4096, n_seq_max=1))  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import jax.numpy as jnp
import numpy as np
from flax import nnx

from kvjax.memory._config import RopeConfig
from kvjax._ggml_blocks import WEIGHT_TYPES, check_type
from kvjax.nn._gguf_file import _field, _gguf, _open, head_plan
from kvjax.nn._ggml_linear import GGMLEmbed, GGMLExperts, GGMLLinear
from kvjax.nn._gguf_mamba import _neg_exp_inverse, mamba_config, mamba_plan
from kvjax.nn._gguf_deepseek import deepseek_config, deepseek_plan, set_up_projections, up_projection_tensors
from kvjax.nn._deepseek import Deepseek
from kvjax.nn._llama import Llama, LlamaConfig
from kvjax.nn._mamba import Mamba
from kvjax.nn._moe import load_dtype

# the parameter dtypes a loader makes, checked as from_pretrained checks them (every tensor type
# dequantizes to float32 first)
from kvjax.nn._pretrained import DTYPES, _check_dtype  # noqa: F401 (DTYPES: named in from_gguf's docs)

__all__ = ["from_gguf", "gguf_config", "GGUF_ARCHITECTURES", "GGUF_TENSOR_TYPES"]

#: The ``general.architecture`` values :func:`from_gguf` loads, and their llama.cpp RoPE mode (None: no attention).
GGUF_ARCHITECTURES = {
    "llama": "normal",
    "mistral": "normal",
    "qwen2": "neox",
    "qwen3": "neox",
    "gemma2": "neox",
    "gemma3": "neox",
    "gpt-oss": "neox",
    "deepseek2": "normal",
    "mamba": None,
}

#: The tensor types :func:`from_gguf` loads (ggml type names): every type kvjax dequantizes in JAX.
GGUF_TENSOR_TYPES = tuple(WEIGHT_TYPES)


def check_tensor_type(name: str, kind: str) -> None:
    """``ValueError`` naming the tensor, its type and why, unless kvjax loads that type."""
    try:
        check_type(kind)
    except ValueError as e:
        raise ValueError(f"tensor {name!r} has type {kind}: {e}") from None


def gguf_config(path):
    """The :class:`LlamaConfig` (a :class:`MambaConfig` for ``mamba``) of a GGUF file's metadata (no tensor data is read).

    Args:
        path: a GGUF file of an architecture in :data:`GGUF_ARCHITECTURES`.

    Returns:
        The config (RoPE mode as llama.cpp runs the architecture; Llama 3 ``rope_freqs`` as
        ``rope.freq_factors``; tied embeddings when the file has no ``output.weight``).

    Raises:
        ValueError: not a GGUF file, truncated, another architecture, a RoPE scaling kind other
            than none / linear / yarn, or missing or inconsistent sizes.
    """
    reader = _open(path)
    if _field(reader, "general.architecture") == "mamba":
        return mamba_config(reader, _tensors(reader))
    if _field(reader, "general.architecture") == "deepseek2":
        return deepseek_config(reader, _tensors(reader))
    return _config(reader, _tensors(reader))


def _tensors(reader) -> Dict[str, Any]:
    return {t.name: t for t in reader.tensors}


def _config(reader, tensors) -> LlamaConfig:
    arch = _field(reader, "general.architecture", required=True)
    if arch not in GGUF_ARCHITECTURES or arch in ("mamba", "deepseek2"):  # theirs are mamba_config's, deepseek_config's
        raise ValueError(f"general.architecture={arch!r} is out of range: allowed one of {sorted(GGUF_ARCHITECTURES)}")
    n_layer = int(_field(reader, f"{arch}.block_count", required=True))
    d_model = int(_field(reader, f"{arch}.embedding_length", required=True))
    # gpt-oss: every block's MLP is the experts', whose width is the expert length
    d_ff = _field(reader, f"{arch}.expert_feed_forward_length") if arch == "gpt-oss" else None
    d_ff = int(d_ff if d_ff is not None else _field(reader, f"{arch}.feed_forward_length", required=True))
    n_heads = int(_field(reader, f"{arch}.attention.head_count", required=True))
    n_kv_heads = _field(reader, f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv_heads, list):  # llama.cpp allows one count per layer; the reference model has one for all
        if len(set(n_kv_heads)) != 1 or len(n_kv_heads) != n_layer:
            raise ValueError(
                f"{arch}.attention.head_count_kv={n_kv_heads} is out of range: allowed one count, or "
                f"{n_layer} equal counts (kvjax.nn.Llama has the same kv heads in every layer)"
            )
        n_kv_heads = n_kv_heads[0]
    n_kv_heads = int(n_kv_heads)
    head_dim = int(_field(reader, f"{arch}.attention.key_length", d_model // max(n_heads, 1)))
    head_dim_v = int(_field(reader, f"{arch}.attention.value_length", head_dim))
    if head_dim_v != head_dim:
        raise ValueError(f"{arch}.attention.value_length={head_dim_v} is out of range: allowed key_length={head_dim}")
    eps = float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", required=True))
    n_rot = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    base = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    scale, yarn = 1.0, {}
    if kind in ("linear", "yarn"):
        factor = float(_field(reader, f"{arch}.rope.scaling.factor", required=True))
        if not factor > 0:
            raise ValueError(f"{arch}.rope.scaling.factor={factor} is out of range: allowed > 0")
        scale = 1.0 / factor
    elif kind != "none":
        raise ValueError(
            f"{arch}.rope.scaling.type={kind!r} is out of range: allowed 'none', 'linear' or 'yarn' "
            f"(Llama 3 scaling comes as the rope_freqs tensor)"
        )
    if kind == "yarn":
        # llama.cpp's YaRN: full extrapolation mix, the ramp between beta_fast and beta_slow rotations
        # of the original context, magnitude 1 + 0.1 ln(factor) (kvjax.rope applies it from freq_scale)
        for key, neutral in (("yarn_log_multiplier", 0.0), ("yarn_attn_factor", 1.0), ("yarn_ext_factor", 1.0)):
            value = _field(reader, f"{arch}.rope.scaling.{key}")
            if value is not None and float(value) != neutral:
                raise ValueError(
                    f"{arch}.rope.scaling.{key}={value} is out of range: allowed {neutral} (the YaRN "
                    f"variant this loader reproduces)"
                )
        yarn = dict(
            ext_factor=1.0,
            beta_fast=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=float(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            n_ctx_orig=int(
                _field(reader, f"{arch}.rope.scaling.original_context_length", 0)
                or _field(reader, f"{arch}.context_length", required=True)
            ),
        )
    freq_factors = None
    if "rope_freqs.weight" in tensors:
        t = tensors["rope_freqs.weight"]
        if tuple(int(d) for d in t.shape) != (n_rot // 2,):
            raise ValueError(
                f"tensor 'rope_freqs.weight' has shape {_shape(t)}: allowed ({n_rot // 2},) "
                f"(one factor per rotated pair)"
            )
        freq_factors = tuple(float(x) for x in _dequantize(t).reshape(-1))
    if "token_embd.weight" not in tensors:
        raise ValueError("GGUF file lacks tensor 'token_embd.weight': allowed a complete model file")
    vocab = int(_field(reader, f"{arch}.vocab_size", int(tensors["token_embd.weight"].shape[-1])))
    rope = RopeConfig(
        n_rot=n_rot, mode=GGUF_ARCHITECTURES[arch], freq_base=base, freq_scale=scale, freq_factors=freq_factors, **yarn
    )
    args = dict(
        vocab_size=vocab,
        d_model=d_model,
        n_layer=n_layer,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        d_ff=d_ff,
        norm_eps=eps,
        rope=rope,
        tie_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
    )
    if arch in ("gemma2", "gemma3"):
        args.update(_gemma_options(reader, arch, n_layer, d_model, n_heads, head_dim, n_rot, scale))
    if arch == "qwen3":  # Qwen3: per-head RMSNorm of q and k before RoPE, no projection biases
        args["qk_norm"] = True
    if arch == "gpt-oss":
        args.update(_gpt_oss_options(reader, arch, n_layer))
    try:
        return LlamaConfig(**args)
    except ValueError as e:
        raise ValueError(f"GGUF metadata gives a config that is out of range: {e}") from None


def _gemma_options(reader, arch, n_layer, d_model, n_heads, head_dim, n_rot, scale) -> dict:
    """The Gemma 2 / 3 options of the reference model, as llama.cpp runs those architectures.

    The norms are plain RMSNorms here (``norm_offset`` off): ``convert_hf_to_gguf.py`` stores Gemma's
    ``1 + w`` and llama.cpp multiplies by the stored weight. The softmax scale is llama.cpp's: the
    head size, except for the 27B models (46 layers for Gemma 2, 62 for Gemma 3), which use
    ``d_model / n_heads``.
    """
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise ValueError(
                f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries: allowed {n_layer}, one per layer"
            )
        swa_layers = tuple(i for i, on in enumerate(pattern) if on)
    else:
        every = int(pattern) if pattern else (2 if arch == "gemma2" else 6)
        swa_layers = LlamaConfig.window_pattern(n_layer, every)
    n_swa = int(_field(reader, f"{arch}.attention.sliding_window", 0))
    big = n_layer == (46 if arch == "gemma2" else 62)
    out = dict(
        swa_layers=swa_layers if n_swa else (),
        n_swa=n_swa,
        sandwich_norms=True,
        scale_embeddings=True,
        activation="gelu_tanh",
        query_pre_attn_scalar=float(d_model // n_heads if big else head_dim),
    )
    if arch == "gemma2":
        out["attn_logit_softcap"] = _field(reader, f"{arch}.attn_logit_softcapping")
        out["final_logit_softcap"] = _field(reader, f"{arch}.final_logit_softcapping")
    else:
        # local layers rotate with their own base (10000 unless the file says) and no scaling
        base_swa = float(_field(reader, f"{arch}.rope.freq_base_swa", 10000.0))
        out["swa_rope"] = RopeConfig(n_rot=n_rot, mode="neox", freq_base=base_swa)
        out["qk_norm"] = True
    return out


def _gpt_oss_options(reader, arch, n_layer) -> dict:
    """gpt-oss as llama.cpp runs it: every even layer a window layer (its swa pattern 2), biases on
    every projection, learned sinks, a mixture of ``expert_count`` experts of which
    ``expert_used_count`` run (softmax over the chosen logits), the clamped SwiGLU with llama.cpp's
    constants 1.702 and 7.0."""
    n_swa = int(_field(reader, f"{arch}.attention.sliding_window", 0))
    return dict(
        swa_layers=tuple(range(0, n_layer, 2)) if n_swa else (),
        n_swa=n_swa,
        attention_bias=True,
        attention_sinks=True,
        n_experts=int(_field(reader, f"{arch}.expert_count", required=True)),
        n_experts_used=int(_field(reader, f"{arch}.expert_used_count", required=True)),
        expert_bias=True,
        activation="swiglu_oai",
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
    )


def _shape(t) -> Tuple[int, ...]:
    """A tensor's shape in numpy order (GGUF stores ``ne0`` first: reversed)."""
    return tuple(int(d) for d in reversed(list(t.shape)))


def _dequantize(t) -> np.ndarray:
    """A tensor as float32 in numpy order (``[out, in]`` for a matrix)."""
    gguf = _gguf()
    kind = gguf.GGMLQuantizationType(int(t.tensor_type))
    if kind == gguf.GGMLQuantizationType.F32:
        out = np.asarray(t.data, np.float32)
    elif kind == gguf.GGMLQuantizationType.F16:
        out = np.asarray(t.data).astype(np.float32)
    else:
        out = gguf.quants.dequantize(np.asarray(t.data), kind).astype(np.float32)
    return out.reshape(_shape(t))


def _plan(model: Llama) -> List[Tuple[Any, str, bool, Optional[Tuple[Any, str]]]]:
    """``(variable, tensor name, transpose, slot)`` for every weight of the model.

    ``slot`` is ``(parent, attribute)`` of the ``nnx.Linear`` / ``nnx.Embed`` a matrix belongs to
    (a compact load puts a :class:`GGMLLinear` / :class:`GGMLEmbed` there instead), ``None`` for
    vectors (norms, biases), which always load as floats.
    """
    cfg = model.config
    plan = head_plan(model)
    for il, block in enumerate(model.layers):
        p, a, m = f"blk.{il}.", block.attn, block.mlp
        if cfg.sandwich_norms:  # Gemma: norms after attention and MLP too
            plan += [
                (block.post_attn_norm.scale, p + "post_attention_norm.weight", False, None),
                (block.post_mlp_norm.scale, p + "post_ffw_norm.weight", False, None),
            ]
        if cfg.qk_norm:
            plan += [
                (a.q_norm.scale, p + "attn_q_norm.weight", False, None),
                (a.k_norm.scale, p + "attn_k_norm.weight", False, None),
            ]
        plan += [
            (block.attn_norm.scale, p + "attn_norm.weight", False, None),
            (a.q_proj.kernel, p + "attn_q.weight", True, (a, "q_proj")),
            (a.k_proj.kernel, p + "attn_k.weight", True, (a, "k_proj")),
            (a.v_proj.kernel, p + "attn_v.weight", True, (a, "v_proj")),
            (a.o_proj.kernel, p + "attn_output.weight", True, (a, "o_proj")),
        ]
        if cfg.n_experts:  # gpt-oss: the norm before the MLP is llama.cpp's post_attention_norm
            plan.append((block.mlp_norm.scale, p + "post_attention_norm.weight", False, None))
            plan += _experts_plan(m, p)
        else:
            plan += [
                (block.mlp_norm.scale, p + "ffn_norm.weight", False, None),
                (m.gate.kernel, p + "ffn_gate.weight", True, (m, "gate")),
                (m.up.kernel, p + "ffn_up.weight", True, (m, "up")),
                (m.down.kernel, p + "ffn_down.weight", True, (m, "down")),
            ]
        if cfg.attention_bias:
            plan += [
                (a.q_proj.bias, p + "attn_q.bias", False, None),
                (a.k_proj.bias, p + "attn_k.bias", False, None),
                (a.v_proj.bias, p + "attn_v.bias", False, None),
            ]
        if cfg.attention_sinks:  # gpt-oss also has the output projection's bias
            plan += [
                (a.o_proj.bias, p + "attn_output.bias", False, None),
                (a.sinks, p + "attn_sinks.weight", False, None),
            ]
    return plan


def _experts_plan(m, p: str):
    """A :class:`kvjax.nn.MoE`'s tensors as llama.cpp's converter writes gpt-oss: the router
    ``ffn_gate_inp`` ``[X, E]`` and the experts ``ffn_{gate,up}_exps`` ``[X, F, E]``, ``ffn_down_exps``
    ``[X, E, F]`` (each expert's matrix ``[out, in]``, so transposed per expert), with their biases.
    A compact load keeps the expert tensors as ggml blocks (:class:`kvjax.nn.GGMLExperts`); the
    router and the biases load as float."""
    return [
        (m.router.kernel, p + "ffn_gate_inp.weight", True, None),
        (m.router.bias, p + "ffn_gate_inp.bias", False, None),
        (m.gate, p + "ffn_gate_exps.weight", True, (m, "gate")),
        (m.up, p + "ffn_up_exps.weight", True, (m, "up")),
        (m.down, p + "ffn_down_exps.weight", True, (m, "down")),
        (m.gate_bias, p + "ffn_gate_exps.bias", False, None),
        (m.up_bias, p + "ffn_up_exps.bias", False, None),
        (m.down_bias, p + "ffn_down_exps.bias", False, None),
    ]


def _compact(t) -> bool:
    """Whether a compact load keeps tensor ``t`` in its file type (every matrix, or stack of expert
    matrices, not stored as F32)."""
    return len(t.shape) in (2, 3) and t.type_name != "F32"


def _load(model, plan, tensors, dt, what: str, *, ignore=(), convert=None) -> None:
    """Check every tensor of ``plan`` (presence, type, shape), then fill ``model`` with them.

    ``plan`` is ``(variable, tensor name, transpose, slot)`` (see :func:`_plan`); ``convert`` maps
    a tensor name's last part (``"ssm_a"``) to a function applied to its float values.
    Everything is checked before the first tensor is read, and the model is new: a failure
    leaves nothing behind that anyone holds.
    """
    convert = convert or {}
    missing = [name for _, name, _, _ in plan if name not in tensors]
    if missing:
        raise ValueError(
            f"GGUF file lacks tensors {missing[:4]}{' ...' if len(missing) > 4 else ''}: allowed the tensors of {what}"
        )
    unexpected = sorted(set(tensors) - {name for _, name, _, _ in plan} - set(ignore))
    if unexpected:
        raise ValueError(f"GGUF file has unexpected tensors {unexpected[:4]}: allowed only the tensors of {what}")
    for var, name, transpose, _ in plan:
        t = tensors[name]
        check_tensor_type(name, t.type_name)
        shape = _shape(t)
        # transposed: the last two axes swap (a matrix's [in, out], or each expert's of [X, in, out])
        want = tuple(var.shape[:-2]) + (var.shape[-1], var.shape[-2]) if transpose else tuple(var.shape)
        if shape != want:
            raise ValueError(f"tensor {name!r} has shape {shape}: allowed {want} for {what}")
    # matrices kept in their file type (dtype None): their biases go inside their GGMLLinear
    compact = {name for _, name, _, slot in plan if dt is None and slot is not None and _compact(tensors[name])}

    def weight_of(bias_name):
        return bias_name[: -len("bias")] + "weight"

    biases = {  # a mixture's experts keep their biases apart (as MoE parameters)
        name: _dequantize(tensors[name])
        for _, name, _, _ in plan
        if name.endswith(".bias") and weight_of(name) in compact and len(tensors[weight_of(name)].shape) == 2
    }
    for var, name, transpose, slot in plan:  # one tensor at a time: host copy, device copy, freed
        t = tensors[name]
        if name in compact:
            parent, attr = slot
            *rows, n_in = _shape(t)  # [out, in], or a mixture's experts [X, out, in]
            raw = np.asarray(t.data).view(np.uint8).reshape(*rows, -1)
            if len(rows) == 2:
                setattr(parent, attr, GGMLExperts(raw, t.type_name, n_in))
            elif attr == "embed":
                setattr(parent, attr, GGMLEmbed(raw, t.type_name, n_in))
            else:
                bias = biases.get(name[: -len("weight")] + "bias")
                setattr(parent, attr, GGMLLinear(raw, t.type_name, n_in, bias=bias))
            continue
        if name in biases:
            continue  # went into its GGMLLinear
        w = _dequantize(t)
        fn = convert.get(name.split(".")[-1])
        w = fn(w, name) if fn is not None else w
        var.set_value(jnp.asarray(np.swapaxes(w, -1, -2) if transpose else w, load_dtype(var, dt or jnp.float32)))


def from_gguf(path, *, dtype=None):
    """Load a llama.cpp GGUF file into an NNX :class:`Llama` (see the module docstring).

    Args:
        path: a GGUF file (``general.architecture`` in :data:`GGUF_ARCHITECTURES`, tensors of the
            types in :data:`GGUF_TENSOR_TYPES`).
        dtype: ``None`` (the default) keeps every matrix in the file's own type, resident as the
            file's bytes and dequantized inside each product (:class:`kvjax.nn.GGMLLinear`; about
            the file's size in memory); or one of :data:`DTYPES` to dequantize every tensor to
            that float dtype at load (fastest on CPU, 2-8x the file's size).

    Returns:
        The model (a :class:`kvjax.nn.Deepseek` for ``deepseek2``, a :class:`kvjax.nn.Mamba` for
        ``mamba``); ``model.config`` is :func:`gguf_config`'s, ``model.gguf_architecture`` the
        file's ``general.architecture`` (what llama.cpp's session files name). Norms and biases are float32 (or
        ``dtype``). Use it as any :class:`Llama` (``kvjax.Engine(model, kvjax.init(...))``);
        the linen twin (:func:`kvjax.nn.params_from_nnx`) needs a float ``dtype``.

    Raises:
        ValueError: not a GGUF file, a truncated file, an unsupported architecture, RoPE kind or
            tensor type, a missing or unexpected tensor, or a tensor whose shape does not fit the
            metadata, or a ``dtype`` outside :data:`DTYPES`. Everything is checked before any
            tensor is read.
        ImportError: the ``gguf`` package is not installed.
    """
    dt = None if dtype is None else _check_dtype(dtype)
    reader = _open(path)
    tensors = _tensors(reader)
    if _field(reader, "general.architecture") == "mamba":
        cfg = mamba_config(reader, tensors, dt)
        model = nnx.eval_shape(lambda: Mamba(cfg, rngs=nnx.Rngs(0)))
        what = f"a mamba model with n_layer={cfg.n_layer}, tie_embeddings={cfg.tie_embeddings}"
        _load(model, mamba_plan(model), tensors, dt, what, convert={"ssm_a": _neg_exp_inverse})
        model.gguf_architecture = "mamba"
        return model
    if _field(reader, "general.architecture") == "deepseek2":
        cfg = deepseek_config(reader, tensors)
        model = nnx.eval_shape(lambda: Deepseek(cfg, rngs=nnx.Rngs(0)))
        what = f"a deepseek2 model with n_layer={cfg.n_layer}, n_experts={cfg.n_experts}, q_lora_rank={cfg.q_lora_rank}"
        used, ignored = up_projection_tensors(model, tensors, _shape)  # checked before anything is read
        for name in used:
            check_tensor_type(name, tensors[name].type_name)
        _load(model, deepseek_plan(model), tensors, dt, what, ignore=tuple(used + ignored))
        set_up_projections(model, tensors, _dequantize, dt)
        model.gguf_architecture = "deepseek2"
        return model
    cfg = _config(reader, tensors)
    arch = _field(reader, "general.architecture")
    model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # shapes only: no random init to throw away
    what = f"a {arch} model with n_layer={cfg.n_layer}, tie_embeddings={cfg.tie_embeddings}"
    # rope_freqs is read into the config, not a weight
    _load(model, _plan(model), tensors, dt, what, ignore=("rope_freqs.weight",))
    if cfg.attention_bias and not cfg.attention_sinks:  # qwen2 has no output-projection bias: zero
        for block in model.layers:
            o = block.attn.o_proj
            if isinstance(o, nnx.Linear):
                o.bias.set_value(jnp.zeros(o.bias.shape, dt or jnp.float32))
            else:
                o.bias = nnx.Param(jnp.zeros((o.out_features,), jnp.float32))
    # the name llama.cpp writes into (and checks in) its session files: Engine.save_session uses it
    model.gguf_architecture = arch
    return model
