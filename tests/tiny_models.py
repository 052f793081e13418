"""Tiny random models of every memory kind and the memories they run on (shared by the tests of the
prompt cache and of the serving scheduler).

Weights are scaled up by 1.5: sharper logits, so that greedy ties never decide a comparison.
"""

from __future__ import annotations

import jax
from flax import nnx

import kvjax
from kvjax.nn import HybridLM, HybridLMConfig, Llama, LlamaConfig, Mamba, MambaConfig

V = 20
LLAMA = LlamaConfig(vocab_size=V, d_model=32, n_layer=2, n_heads=2, n_kv_heads=1)
SWA = LlamaConfig(vocab_size=V, d_model=32, n_layer=2, n_heads=2, n_kv_heads=1, swa_layers=(0,), n_swa=6)
MAMBA = MambaConfig(vocab_size=V, d_model=32, n_layer=2, d_state=4)
HYBRID = HybridLMConfig(vocab_size=V, d_model=32, n_layer=3, recurrent_layers=(1,), n_heads=2, n_kv_heads=1, d_state=4)
_MODELS = {}


def model(kind: str):
    """The model of a memory kind: "unified", "streams" (the same Llama), "iswa", "recurrent", "hybrid"."""
    kind = "unified" if kind == "streams" else kind
    if kind not in _MODELS:
        make = {
            "unified": lambda: Llama(LLAMA, rngs=nnx.Rngs(0)),
            "iswa": lambda: Llama(SWA, rngs=nnx.Rngs(0)),
            "recurrent": lambda: Mamba(MAMBA, rngs=nnx.Rngs(0)),
            "hybrid": lambda: HybridLM(HYBRID, rngs=nnx.Rngs(0)),
        }[kind]
        m = make()
        nnx.update(m, jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param)))
        _MODELS[kind] = m
    return _MODELS[kind]


def memory(kind: str, size: int = 96, n_seq: int = 4):
    """A fresh memory of ``kind`` for :func:`model` (``size`` cells, ``n_seq`` sequences; states: 4)."""
    if kind == "unified":
        return kvjax.init(LLAMA.cache_config(size=size, n_seq_max=n_seq, padding=16))
    if kind == "streams":
        return kvjax.init(kvjax.StreamsConfig(LLAMA.cache_config(size=size, n_seq_max=n_seq, padding=16)))
    if kind == "iswa":
        return kvjax.init(
            kvjax.IswaConfig(
                SWA.cache_config(size=size, n_seq_max=n_seq, padding=16), swa_layers=(0,), n_swa=6, n_batch=16
            )
        )
    if kind == "recurrent":
        return kvjax.init(MAMBA.memory_config(n_seq, n_states=4))
    return kvjax.init(HYBRID.memory_config(size=size, n_seq_max=n_seq, n_states=4, padding=16))
