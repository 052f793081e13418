"""A local Hugging Face checkpoint folder to an NNX model that :class:`kvjax.Engine` drives.

:func:`from_pretrained` reads ``config.json``, picks the architecture (Llama, Qwen2, Mistral,
Gemma 2, Gemma 3 text, Mamba), maps the config (:func:`kvjax.nn._hf.llama_config_from_hf`,
:meth:`kvjax.nn.MambaConfig.from_hf`) and the weights through the same mapping the
``transformers`` loaders use (:func:`kvjax.nn._hf.load_plan`). The safetensors files are opened
memory-mapped and each tensor is read only when its variable is set, then converted to the
requested dtype, so the host holds about one copy of the model plus one tensor.

Everything that can be checked without reading tensor data is checked first (config, shard
files and their headers, missing / unexpected tensors, every shape): a bad checkpoint raises
``ValueError`` naming the file or tensor, and no model is returned.

:func:`memory_config_for` gives the memory a loaded model needs: a unified
:class:`kvjax.CacheConfig`, a :class:`kvjax.IswaConfig` when some (not all) layers have a sliding
window, a :class:`kvjax.RecurrentConfig` for Mamba.

Example:
    >>> import kvjax                                                      # doctest: +SKIP
    >>> model = kvjax.nn.from_pretrained("path/to/Qwen2.5-0.5B")          # doctest: +SKIP
    >>> cache = kvjax.init(kvjax.nn.memory_config_for(model, size=4096, n_seq_max=4))  # doctest: +SKIP
    >>> engine = kvjax.Engine(model, cache)                               # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import pathlib
import types
from typing import Dict, Iterator, Mapping, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax.nn._hf import LLAMA_TYPES, _strip, llama_config_from_hf, load_llama
from kvjax.nn._deepseek import DEEPSEEK_TYPES, Deepseek, DeepseekConfig
from kvjax.nn._deepseek_hf import load_deepseek
from kvjax.nn._llama import Llama
from kvjax.nn._mamba import Mamba, MambaConfig
from kvjax.nn._mamba_hf import params_from_hf
from kvjax.memory._iswa import IswaConfig
from kvjax.nn._hybrid import HybridLM
from kvjax.memory._config import CacheConfig
from kvjax.nn._hf import llama_plan
from kvjax.memory._config import RopeConfig
import numpy as np

__all__ = [
    "from_pretrained",
    "memory_config_for",
    "save_llama",
    "read_config",
    "SafetensorsSource",
    "ARCHITECTURES",
    "DTYPES",
]

#: ``model_type`` values :func:`from_pretrained` loads.
ARCHITECTURES = LLAMA_TYPES + DEEPSEEK_TYPES + ("mamba",)

#: Parameter dtypes :func:`from_pretrained` makes (any stored float dtype converts to them).
DTYPES = ("float32", "bfloat16", "float16")

# transformers' class defaults of fields older config.json files may leave out (newer ones write all)
_DEFAULTS = {
    "llama": dict(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        max_position_embeddings=2048,
    ),
    "mistral": dict(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        max_position_embeddings=4096 * 32,
        sliding_window=4096,
    ),
    "qwen2": dict(
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        max_position_embeddings=32768,
        use_sliding_window=False,
    ),
    "mamba": dict(
        state_size=16,
        conv_kernel=4,
        expand=2,
        time_step_rank="auto",
        layer_norm_epsilon=1e-5,
        use_bias=False,
        use_conv_bias=True,
        tie_word_embeddings=True,
        residual_in_fp32=True,
        hidden_act="silu",
    ),
}

# tensors of a multimodal Gemma 3 checkpoint that the text model does not use
_SKIP_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

# safetensors dtype names that hold floats (anything else is not a weight kvjax loads)
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def _namespace(d):
    if isinstance(d, dict):
        return types.SimpleNamespace(**{k: _namespace(v) if k == "text_config" else v for k, v in d.items()})
    return d


def read_config(path: Union[str, os.PathLike]) -> types.SimpleNamespace:
    """``config.json`` of a checkpoint folder as an attribute namespace (``text_config`` nested),
    with transformers' defaults for fields older files leave out.

    Raises:
        ValueError: ``path`` is not a folder, has no ``config.json``, or the file is not a JSON
            object with a ``model_type``.
    """
    folder = pathlib.Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"path={str(path)!r} is not a folder: allowed a Hugging Face checkpoint folder "
            f"(config.json and *.safetensors)"
        )
    file = folder / "config.json"
    if not file.is_file():
        raise ValueError(f"path={str(path)!r} has no config.json: allowed a Hugging Face checkpoint folder")
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}): allowed a transformers config.json") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("model_type"), str):
        raise ValueError(f"{file} has no 'model_type': allowed a transformers config.json")
    raw = {**_DEFAULTS.get(raw["model_type"], {}), **raw}
    if isinstance(raw.get("text_config"), dict):
        text = raw["text_config"]
        text.setdefault("model_type", "gemma3_text")
    return _namespace(raw)


class SafetensorsSource(Mapping):
    """A lazy mapping from tensor name to numpy array over a checkpoint's safetensors files.

    Opening reads only the headers (every shard is opened, so a truncated or corrupt file fails
    here, naming it). ``source[name]`` opens the file again and reads that tensor (bfloat16 comes back as ml_dtypes'
    ``bfloat16``); :attr:`shapes` and :attr:`dtypes` come from the headers.

    Args:
        folder: the checkpoint folder: ``model.safetensors.index.json`` and its shards, or one or
            more ``*.safetensors`` files.
        rename: maps a stored name to the name the mapping shows (e.g. strip ``model.``).
        skip: stored names starting with one of these are left out.
    """

    def __init__(self, folder: Union[str, os.PathLike], rename=lambda k: k, skip: Tuple[str, ...] = ()):
        from safetensors import safe_open

        folder = pathlib.Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
                raise ValueError(
                    f"{index} is not a safetensors index ({type(e).__name__}: {e}): allowed JSON with a 'weight_map'"
                ) from None
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (folder / name).is_file():
                    raise ValueError(
                        f"{index} names shard {name!r}, which is not in {folder}: allowed a folder "
                        f"with every shard of the index"
                    )
        else:
            weight_map = None
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            if not files:
                raise ValueError(
                    f"{folder} has no *.safetensors files: allowed model.safetensors (or shards with "
                    f"model.safetensors.index.json); .bin / .pt checkpoints are not read"
                )
        self._paths: Dict[str, pathlib.Path] = {}
        self._where: Dict[str, Tuple[str, str]] = {}
        self.shapes: Dict[str, Tuple[int, ...]] = {}
        self.dtypes: Dict[str, str] = {}
        for name in files:
            path = folder / name
            try:
                with safe_open(str(path), framework="numpy") as handle:  # the header only
                    stored = list(handle.keys())
                    slices = {k: handle.get_slice(k) for k in stored}
                    meta = {k: (s.get_dtype(), tuple(s.get_shape())) for k, s in slices.items()}
            except Exception as e:  # safetensors raises its own SafetensorError (truncated, bad header)
                raise ValueError(
                    f"{path} is not a readable safetensors file ({type(e).__name__}: {e}): allowed "
                    f"a complete file (re-download or re-save it)"
                ) from None
            self._paths[name] = path
            for key in stored:
                if key.startswith(skip):
                    continue
                if weight_map is not None and weight_map.get(key) != name:
                    raise ValueError(
                        f"{path} holds {key!r}, which the index puts in {weight_map.get(key)!r}: "
                        f"allowed an index that matches its shards"
                    )
                shown = rename(key)
                if shown in self._where:
                    raise ValueError(
                        f"{path} holds {key!r}, a second tensor named {shown!r} (also in "
                        f"{self._where[shown][0]}): allowed one tensor per weight"
                    )
                dtype, shape = meta[key]
                if dtype not in _FLOAT_DTYPES:
                    raise ValueError(
                        f"{path} tensor {key!r} has dtype {dtype}: allowed one of {list(_FLOAT_DTYPES)} "
                        f"(quantized safetensors are not read)"
                    )
                self._where[shown] = (name, key)
                self.shapes[shown] = shape
                self.dtypes[shown] = dtype
        if weight_map is not None:
            absent = sorted(k for k, f in weight_map.items() if not k.startswith(skip) and rename(k) not in self._where)
            if absent:
                raise ValueError(f"{index} lists {absent[:4]} but its shards lack them: allowed complete shards")

    def __getitem__(self, key: str):
        from safetensors import safe_open

        name, stored = self._where[key]
        try:
            # open per tensor: the file's mapping (and its pages in this process's resident set)
            # goes away with the tensor, so reading holds one tensor at a time, not the files
            with safe_open(str(self._paths[name]), framework="numpy") as handle:
                return handle.get_tensor(stored)
        except Exception as e:
            raise ValueError(
                f"reading {stored!r} from {name} failed ({type(e).__name__}: {e}): allowed a complete safetensors file"
            ) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    @property
    def nbytes(self) -> int:
        """Bytes of the stored tensors."""
        size = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}
        total = 0
        for key, shape in self.shapes.items():
            n = 1
            for s in shape:
                n *= s
            total += n * size[self.dtypes[key]]
        return total


def _check_dtype(dtype):
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is out of range: allowed one of {list(DTYPES)}")
    return dt


def _model_type(cfg, path) -> str:
    model_type = cfg.model_type
    if model_type not in ARCHITECTURES:
        arch = getattr(cfg, "architectures", None)
        raise ValueError(
            f"{pathlib.Path(path) / 'config.json'} has model_type={model_type!r} (architectures="
            f"{arch}): allowed one of {list(ARCHITECTURES)}"
        )
    return model_type


def _all_loaded(model, path) -> None:
    """Every leaf of the model's state is a real array (nothing left abstract from ``eval_shape``)."""
    for p, leaf in nnx.to_flat_state(nnx.state(model)):
        value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
        if not isinstance(value, jax.Array):
            raise ValueError(
                f"{path}: variable {'/'.join(map(str, p))} was not loaded from the checkpoint: allowed "
                f"a checkpoint that sets every weight"
            )


def from_pretrained(path: Union[str, os.PathLike], *, dtype=jnp.float32, **config_overrides):
    """Load a local Hugging Face checkpoint folder as an NNX model for :class:`kvjax.Engine`.

    Args:
        path: the folder: ``config.json`` and ``model.safetensors`` (or shards with
            ``model.safetensors.index.json``).
        dtype: the parameters' dtype, one of :data:`DTYPES` (stored tensors of any float type
            are converted; activations follow the parameters' dtype, attention and RoPE run in
            float32).
        **config_overrides: fields of :class:`~kvjax.nn.LlamaConfig` / :class:`~kvjax.nn.MambaConfig`
            replaced after the mapping (e.g. ``scan_chunk`` for Mamba).

    Returns:
        A :class:`~kvjax.nn.Llama` (Llama, Qwen2, Mistral, Gemma 2, Gemma 3 text, gpt-oss), a
        :class:`~kvjax.nn.Deepseek` (DeepSeek V2 / V3; experts stored one tensor each or stacked)
        or a :class:`~kvjax.nn.Mamba`, every weight read from the checkpoint.

    Raises:
        ValueError: no folder / ``config.json``, an architecture outside :data:`ARCHITECTURES`, a
            RoPE kind outside ``default``, ``linear``, ``llama3``, ``yarn`` (named), a truncated or
            corrupt safetensors file (named), missing tensors (listed), unexpected tensors, a tensor
            of the wrong shape (name, stored and expected shapes), or a bad ``dtype``. Nothing is
            returned then.
    """
    dt = _check_dtype(dtype)
    cfg = read_config(path)
    model_type = _model_type(cfg, path)
    source = f"checkpoint {path}:"
    if model_type == "mamba":
        mcfg = MambaConfig.from_hf(cfg, **{"dtype": dt, "param_dtype": dt, **config_overrides})
        weights = SafetensorsSource(path)
        model = nnx.eval_shape(lambda: Mamba(mcfg, rngs=nnx.Rngs(0)))
        try:
            params_from_hf(weights, model)
        except ValueError as e:
            raise ValueError(f"{source} {e}") from None
    elif model_type in DEEPSEEK_TYPES:
        dcfg = DeepseekConfig.from_hf(cfg, **config_overrides)
        weights = SafetensorsSource(path, rename=_strip)
        model = nnx.eval_shape(lambda: Deepseek(dcfg, rngs=nnx.Rngs(0)))
        load_deepseek(model, weights, dtype=dt, source=source, shapes=weights.shapes)
    else:
        lcfg = llama_config_from_hf(cfg, **config_overrides)
        weights = SafetensorsSource(path, rename=_strip, skip=_SKIP_PREFIXES)
        model = nnx.eval_shape(lambda: Llama(lcfg, rngs=nnx.Rngs(0)))
        load_llama(model, weights, dtype=dt, source=source, shapes=weights.shapes)
    _all_loaded(model, path)
    return model


def memory_config_for(model, size: Optional[int] = None, n_seq_max: int = 1, **overrides):
    """The memory config a loaded model runs on.

    - :class:`~kvjax.nn.Llama` without window layers, or with a window on every layer (Mistral):
      a unified :class:`kvjax.CacheConfig` of ``size`` cells (the model masks the window itself).
    - :class:`~kvjax.nn.Llama` with window layers and full layers (Gemma 2/3): a
      :class:`kvjax.IswaConfig` (the window layers keep only ``n_swa * n_seq_max + n_batch``
      cells); ``n_batch`` (default ``min(size, 512)``) and ``swa_full`` are taken from ``overrides``.
    - :class:`~kvjax.nn.Mamba`: a :class:`kvjax.RecurrentConfig` of one state cell per sequence
      (``size`` is not used; ``n_states`` from ``overrides``).
    - :class:`~kvjax.nn.HybridLM`: its :class:`kvjax.HybridConfig`.
    - :class:`~kvjax.nn.Deepseek`: its latent :class:`kvjax.CacheConfig` (``mla=True``).

    Args:
        model: the model (:func:`from_pretrained`'s, or any of those classes).
        size: K/V cells shared by all sequences (required for attention models; rounded up to a
            multiple of the cache's ``padding``).
        n_seq_max: sequence ids.
        **overrides: passed on to the cache config (``k_dtype``, ``v_dtype``, ``padding``, ...).

    Raises:
        ValueError: an unsupported model, or a missing / bad ``size`` or ``n_seq_max``.

    Example:
        >>> from flax import nnx
        >>> from kvjax.nn import Llama, LlamaConfig
        >>> model = Llama(LlamaConfig(n_layer=4, swa_layers=(0, 2), n_swa=8), rngs=nnx.Rngs(0))
        >>> type(memory_config_for(model, size=64, n_seq_max=2)).__name__
        'IswaConfig'
    """

    if not isinstance(n_seq_max, int) or isinstance(n_seq_max, bool) or n_seq_max < 1:
        raise ValueError(f"n_seq_max={n_seq_max!r} is out of range: allowed an integer >= 1")
    if isinstance(model, Mamba):
        n_states = overrides.pop("n_states", 1)
        if overrides:
            raise ValueError(f"overrides {sorted(overrides)} are out of range for a Mamba: allowed only n_states")
        return model.config.memory_config(n_seq_max, n_states=n_states)
    if not isinstance(model, (Llama, HybridLM, Deepseek)):
        raise ValueError(f"model must be a kvjax.nn.Llama, Deepseek, Mamba or HybridLM, got {type(model).__name__}")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size={size!r} is out of range: allowed an integer >= 1 (K/V cells for all sequences)")
    # the cache's size is a whole number of padding blocks: round up rather than refuse

    padding = overrides.get("padding", CacheConfig.__dataclass_fields__["padding"].default)
    if isinstance(padding, int) and padding > 0:
        size = -(-size // padding) * padding
    if isinstance(model, HybridLM):
        return model.config.memory_config(size, n_seq_max, **overrides)
    if isinstance(model, Deepseek):
        return model.config.cache_config(size=size, n_seq_max=n_seq_max, **overrides)
    cfg = model.config
    n_batch = overrides.pop("n_batch", min(size, 512))
    swa_full = overrides.pop("swa_full", False)
    base = cfg.cache_config(size=size, n_seq_max=n_seq_max, **overrides)
    if cfg.swa_layers and len(cfg.swa_layers) < cfg.n_layer:
        return IswaConfig(
            base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, swa_type=cfg.swa_type, n_batch=n_batch, swa_full=swa_full
        )
    return base


def save_llama(
    model: Llama, path: Union[str, os.PathLike], *, dtype=None, max_shard_bytes: Optional[int] = None
) -> pathlib.Path:
    """Write a :class:`~kvjax.nn.Llama` as a Hugging Face Llama / Qwen2 checkpoint folder (the inverse of
    :func:`from_pretrained`, through the same :func:`~kvjax.nn._hf.llama_plan`).

    Writes ``config.json`` (``model_type`` ``"qwen2"`` with ``attention_bias``, else ``"llama"``) and
    ``model.safetensors``, or shards of at most ``max_shard_bytes`` with
    ``model.safetensors.index.json``. Meant for tests and benchmarks: random or trained kvjax
    weights that transformers (and :func:`from_pretrained`) read back.

    Args:
        model: a plain Llama (RoPE in neox mode with default scaling, no window layers, no
            Gemma options).
        path: the folder (created).
        dtype: the stored dtype (default the parameters'), one of :data:`DTYPES`.
        max_shard_bytes: split into shards of at most this many bytes (> 0), or one file.

    Raises:
        ValueError: a model those configs cannot describe (named option), or bad arguments.
    """
    from safetensors.numpy import save_file

    if not isinstance(model, Llama):
        raise ValueError(f"model must be a kvjax.nn.Llama, got {type(model).__name__}")
    plan = llama_plan(model)  # first: it refuses what the layout cannot name (fused projections)
    cfg = model.config
    rope = cfg.rope_config
    plain = rope is not None and _is_default_rope(rope, cfg.head_size)
    for name, bad in (
        ("position", cfg.position != "rope"),
        ("rope", not plain),
        ("swa_layers", bool(cfg.swa_layers)),
        ("sandwich_norms", cfg.sandwich_norms),
        ("norm_offset", cfg.norm_offset),
        ("qk_norm", cfg.qk_norm),
        ("scale_embeddings", cfg.scale_embeddings),
        ("activation", cfg.activation != "silu"),
        ("final_logit_softcap", cfg.final_logit_softcap),
        ("attn_logit_softcap", cfg.attn_logit_softcap),
        ("query_pre_attn_scalar", cfg.query_pre_attn_scalar),
        ("attention_sinks", cfg.attention_sinks),
        ("n_experts", cfg.n_experts),
    ):
        if bad:
            raise ValueError(
                f"model.config.{name}={getattr(cfg, name)!r} is out of range: allowed the plain Llama "
                f"value (neox RoPE over the whole head with default scaling, no windows, no Gemma "
                f"or gpt-oss options)"
            )
    if max_shard_bytes is not None and (not isinstance(max_shard_bytes, int) or max_shard_bytes < 1):
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is out of range: allowed an integer > 0 or None")
    dt = None if dtype is None else _check_dtype(dtype)
    folder = pathlib.Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    model_type = "qwen2" if cfg.attention_bias else "llama"
    config = dict(
        architectures=["Qwen2ForCausalLM" if cfg.attention_bias else "LlamaForCausalLM"],
        model_type=model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ff_size,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_size,
        rms_norm_eps=cfg.norm_eps,
        hidden_act="silu",
        tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": rope.freq_base},
        attention_bias=cfg.attention_bias,
        mlp_bias=False,
        dtype=(dt or jnp.dtype(model.embed.embedding.dtype)).name,
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for var, key, fn in plan:
        value = var.get_value() if dt is None else var.get_value().astype(dt)
        arr = np.asarray(value)
        arr = fn(arr) if fn is not None else arr
        if key.endswith("o_proj.bias") and model_type == "qwen2":
            continue  # Qwen2 has no o bias (kvjax's is zero after loading)
        tensors[key if key.startswith("lm_head") else "model." + key] = np.ascontiguousarray(arr)
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
    shards, current, size = [], {}, 0
    for key, arr in tensors.items():
        if current and size + arr.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = arr
        size += arr.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return folder


def _is_default_rope(rope, head_dim) -> bool:
    """Whether ``rope`` is HF's default RoPE (neox over the whole head, no scaling)."""
    return rope == RopeConfig(n_rot=head_dim, mode="neox", freq_base=rope.freq_base)
