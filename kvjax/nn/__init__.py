"""Flax integration: cached attention layers (NNX and linen), a reference model, the jitted step.

- :class:`CachedAttention` (NNX) and :class:`LinenCachedAttention` (linen): grouped-query
  attention that writes K/V into a kvjax cache and attends over the window, thin over
  :func:`attend_cached` (the cache logic is kvjax's own).
- :class:`Llama` (NNX) and :class:`LlamaLinen` (linen): a tiny Llama-style decoder, cached or
  uncached, configured by :class:`LlamaConfig`; its options make it Gemma 2 / Gemma 3 (text)
  (:meth:`LlamaConfig.from_hf`, :func:`llama_from_hf` loads the ``transformers`` weights;
  :class:`OffsetRMSNorm` / :class:`LinenOffsetRMSNorm` are Gemma's ``(1 + w)`` RMSNorm).
- :class:`Deepseek` (NNX): DeepSeek V2/V3's multi-head latent attention (:class:`MLAttention`, absorbed
  over the latent cache ``CacheConfig(mla=True)``) with the dense MLP and DeepSeek's mixture of
  experts (:class:`DeepseekMoE`, :class:`Routing`), configured by :class:`DeepseekConfig`
  (:meth:`DeepseekConfig.from_hf`; :func:`deepseek_from_hf` loads the ``transformers`` weights).
- :class:`Mamba` (NNX): a selective state-space model numerically equal to transformers'
  ``MambaForCausalLM``, with an explicit per-sequence state (the recurrent memory's rows).
- :class:`HybridLM` (NNX): attention blocks and Mamba blocks by a layer pattern (Jamba-like) over a
  :class:`kvjax.HybridCache`.
- :func:`from_pretrained`: a local Hugging Face checkpoint folder (Llama, Qwen2, Mistral, Gemma 2/3,
  Mamba) to one of these models; :func:`memory_config_for` the memory it needs; :class:`Tokenizer`
  its ``tokenizer.json`` (see ``docs/checkpoints.md``); :func:`from_gguf` a llama.cpp GGUF file
  (:func:`gguf_tokenizer` its vocabulary; :class:`GGMLLinear` / :class:`GGMLEmbed` keep its
  weights in the file's block types).
- :func:`make_step`: one jitted program per (ubatch bucket, window bucket) that places a ubatch,
  runs the model and donates the memory's buffers; :func:`window_for` / :func:`windows_for` pick
  the windows.
- :class:`UbatchInputs`: the one per-ubatch input pytree every cached layer receives (ubatch,
  placement, windows, one mask per :class:`MaskKind`); layers return ``(y, memory)``.

The layers and the step are written against the memory protocol (:class:`kvjax.Memory`) only: a
layer reaches the attention part it reads and writes by its layer id.

See ``docs/flax.md`` for plugging kvjax into your own Flax model.

Example:
    >>> from kvjax.nn import LlamaConfig
    >>> LlamaConfig(n_layer=1).cache_config(size=32, n_seq_max=1).n_layer
    1
"""

from kvjax.nn._linen_attention import LinenCachedAttention
from kvjax.nn._inputs import MaskKind, UbatchInputs, layer_mask
from kvjax.nn._hf import llama_from_hf
from kvjax.nn._llama import ACTIVATIONS, Block, Llama, LlamaConfig, MLP
from kvjax.nn._moe import MoE, Routing
from kvjax.nn._mla import MLAttention
from kvjax.nn._deepseek import Deepseek, DeepseekBlock, DeepseekConfig, DeepseekMoE
from kvjax.nn._deepseek_hf import deepseek_from_hf
from kvjax.nn._llama_linen import LlamaLinen, params_from_nnx
from kvjax.nn._mamba import Mamba, MambaConfig, make_mamba_step
from kvjax.nn._mamba_hf import params_from_hf
from kvjax.nn._selective_scan import select_states
from kvjax.nn._hybrid import HybridLM, HybridLMConfig
from kvjax.nn._norm import LinenOffsetRMSNorm, OffsetRMSNorm, offset_rms_norm
from kvjax.nn._nnx_attention import (
    CachedAttention,
    KVCacheVar,
    alibi_slopes,
    attend_cached,
    attend_uncached,
    swa_visible,
)
from kvjax.nn._step import Step, make_step, window_for, windows_for
from kvjax.nn._hf import llama_config_from_hf
from kvjax.nn._hf_rope import rope_from_hf
from kvjax.nn._pretrained import from_pretrained, memory_config_for
from kvjax.nn._tokenizer import Tokenizer
from kvjax.nn._gguf import from_gguf, gguf_config
from kvjax.nn._ggml_linear import GGMLEmbed, GGMLExperts, GGMLLinear
from kvjax.nn._gguf_vocab import GGUFVocab, gguf_tokenizer
from kvjax.nn._fuse import fuse_projections, is_fused

__all__ = [
    "CachedAttention",
    "LinenCachedAttention",
    "KVCacheVar",
    "attend_cached",
    "attend_uncached",
    "layer_mask",
    "alibi_slopes",
    "swa_visible",
    "LlamaConfig",
    "Llama",
    "LlamaLinen",
    "Block",
    "MLP",
    "MoE",
    "Routing",
    "MLAttention",
    "Deepseek",
    "DeepseekBlock",
    "DeepseekConfig",
    "DeepseekMoE",
    "deepseek_from_hf",
    "params_from_nnx",
    "ACTIVATIONS",
    "llama_from_hf",
    "OffsetRMSNorm",
    "LinenOffsetRMSNorm",
    "offset_rms_norm",
    "HybridLM",
    "HybridLMConfig",
    "Step",
    "make_step",
    "window_for",
    "windows_for",
    "UbatchInputs",
    "MaskKind",
    "Mamba",
    "MambaConfig",
    "make_mamba_step",
    "params_from_hf",
    "select_states",
    "from_pretrained",
    "memory_config_for",
    "llama_config_from_hf",
    "rope_from_hf",
    "Tokenizer",
    "from_gguf",
    "gguf_config",
    "gguf_tokenizer",
    "GGUFVocab",
    "GGMLLinear",
    "GGMLExperts",
    "GGMLEmbed",
    "fuse_projections",
    "is_fused",
]
