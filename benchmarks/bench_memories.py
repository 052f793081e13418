"""Memories: what the iSWA pair saves against one full-size cache, and its decode speed; latent bytes.

- Bytes of K/V for a Gemma-2-like layer pattern (every other layer has a 4096-token window;
  Gemma 2 2B's 26 layers, 4 kv heads of size 256, float16) at 8K and 32K cells, computed from the
  configs (``kvjax.abstract``: nothing is allocated).
- Decode tokens/s of a small model with window layers at a long context, through ``kvjax.Engine``
  on the iSWA pair and on one full-size unified cache, same run, same tokens. The window layers'
  attention reads the window cache's window bucket, which stays small as the context grows.
- Bytes per cell of a latent (MLA) cache against the decompressed K/V cache of the same model
  (DeepSeek V2-Lite's and V3's attention shapes), from the configs.
"""

from __future__ import annotations


import jax
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import greedy_decode_rounds, interleaved_medians, table
from kvjax import Engine
from kvjax.nn import Llama, LlamaConfig


def _bytes_rows():
    rows = []
    for size in (8192, 32768):
        base = kvjax.CacheConfig(
            size=size,
            n_seq_max=1,
            n_layer=26,
            n_kv_heads=4,
            head_dim=256,
            k_dtype="float16",
            v_dtype="float16",
            padding=256,
        )
        iswa = kvjax.IswaConfig(base, swa_layers=tuple(range(0, 26, 2)), n_swa=4096, n_batch=2048)
        full = kvjax.total_size(base)
        pair = kvjax.total_size(iswa.base_config) + kvjax.total_size(iswa.swa_config)
        assert pair == sum(
            x.size * x.dtype.itemsize for x in jax.tree.leaves(kvjax.abstract(iswa)) if x.dtype == np.float16
        )
        rows.append(
            [f"{size}", f"{full / 2**20:.0f} MiB", f"{pair / 2**20:.0f} MiB", f"{iswa.size_swa}", f"{pair / full:.2f}"]
        )
    return rows


#: (name, layers, heads, qk_nope, qk_rope, v_head, kv_lora_rank) of DeepSeek models' attention
MLA_MODELS = (("DeepSeek-V2-Lite", 27, 16, 128, 64, 128, 512), ("DeepSeek-V3", 61, 128, 128, 64, 128, 512))


def _latent_rows():
    """Bytes per cell (all layers) of the latent cache and of the decompressed K/V, float16 and q8_0."""
    rows = []
    for name, layers, heads, nope, rope, v_head, rank in MLA_MODELS:
        for dtype in ("float16", "q8_0"):
            shape = dict(size=256, n_seq_max=1, n_layer=layers, k_dtype=dtype, v_dtype=dtype)
            latent = kvjax.CacheConfig(
                n_kv_heads=1,
                head_dim=rank + rope,
                head_dim_v=rank,
                mla=True,
                rope=kvjax.RopeConfig(n_rot=rope),
                **shape,
            )
            plain = kvjax.CacheConfig(n_kv_heads=heads, head_dim=nope + rope, head_dim_v=v_head, **shape)
            per_cell = [kvjax.total_size(c) // c.size for c in (latent, plain)]
            rows.append([name, dtype, f"{per_cell[0]:,}", f"{per_cell[1]:,}", f"{per_cell[1] / per_cell[0]:.1f}x"])
    return rows


def _prefill(engine, context):
    """A ``context``-token prompt for sequence 0."""
    # the prompt in batches of 128 tokens: the window cache holds n_swa + n_batch cells, and a
    # contiguous placement needs a free run of the batch's length beside what the window keeps
    for start in range(0, context, 128):
        n = min(128, context - start)
        engine.decode(list(np.arange(start, start + n) % 50), list(range(start, start + n)), [[0]] * n)


def run(quick: bool) -> str:
    context, steps, repeats = (512, 8, 2) if quick else (3072, 32, 3)
    size = 1024 if quick else 4096
    cfg = LlamaConfig(vocab_size=64, d_model=128, n_layer=4, n_heads=4, n_kv_heads=2, swa_layers=(0, 2), n_swa=128)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    base = cfg.cache_config(size=size, n_seq_max=1, padding=128)
    rounds = {}
    for name, memory in (
        ("iSWA pair", kvjax.init(kvjax.IswaConfig(base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, n_batch=512))),
        ("one full-size cache", kvjax.init(base)),
    ):
        engine = Engine(model, memory, n_ubatch=512)
        _prefill(engine, context)
        rounds[name] = greedy_decode_rounds(engine, 1, context, steps)
    rates = {name: 1.0 / t for name, t in interleaved_medians(rounds, repeats).items()}
    decode_rows = [
        [name, f"{size}", f"{context}", f"{rate:.0f}", f"{rate / rates['one full-size cache']:.2f}"]
        for name, rate in rates.items()
    ]
    return "\n".join(
        [
            "## Memories: the iSWA pair against one full-size cache",
            "",
            "K/V bytes, Gemma-2-2B-like pattern (26 layers, every other one with a 4096-token window, 4 kv heads "
            "of size 256, float16, n_batch 2048), from the configs:",
            "",
            table(["cells", "one full-size cache", "iSWA pair", "window cache cells", "ratio"], _bytes_rows()),
            "",
            f"Decode, batch 1, a 4-layer width-128 model with window layers 0 and 2 (n_swa {cfg.n_swa}), through "
            f"kvjax.Engine after a {context}-token prompt; median of {repeats} rounds of {steps} tokens, the two "
            f"memories' rounds interleaved, compile excluded:",
            "",
            table(["memory", "cells", "context", "tokens/s", "vs full-size"], decode_rows),
            "",
            "Bytes per cell (every layer) of the latent (MLA) cache, one row [latent 512 | RoPE key 64] with V a "
            "view of its latent, against the decompressed K/V of the same attention (every head's K of "
            "qk_nope + qk_rope and V of v_head), from the configs:",
            "",
            table(["model", "dtype", "latent cache", "decompressed K/V", "ratio"], _latent_rows()),
        ]
    )
