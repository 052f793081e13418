"""The latent (MLA) cache at decode: attention over one latent row per cell against decompressed K/V.

One layer of DeepSeek V2-Lite's attention shape (16 query heads; qk_nope 128 + qk_rope 64, v_head
128; kv_lora_rank 512), one decode token (T = 1), ``n_kv`` cells all visible, float32 (XLA:CPU's
fast dtype) and q8_0 for the latent. Compared in the same run:

- **latent**: ``kvjax.attention`` of the absorbed query ``[16, 576]`` over the latent cache
  ``CacheConfig(mla=True)``: one ``[576]`` K row per cell, V its first 512 columns (read once);
- **decompressed**: the same attention as a stack that caches every head's K ``[16, 192]`` and
  V ``[16, 128]`` per cell would run it (``kvjax.attention`` over a plain cache).

Only the attention over the cache is timed (the absorbed form's two per-token projections,
``W_uk^T q`` and ``W_uv o``, do not grow with the context). Bytes are the cache rows read; the
bandwidth column compares them with a plain copy of the same bytes in the same run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.common import copy_bandwidth, fmt_rate, fmt_time, median_time, table

HEADS, NOPE, ROPE, V_HEAD, RANK = 16, 128, 64, 128, 512


def _filled(config, rng):
    """A cache with every cell of sequence 0 written with random rows."""
    cache = kvjax.init(config)
    n = config.size
    ub = kvjax.make_ubatch(list(range(n)), [[0]] * n, length=n)
    cache, slot, ok = kvjax.find_slot(cache, ub)
    assert bool(ok)
    grp = config.groups[0]
    rows = lambda d: jnp.asarray(rng.standard_normal((n, grp.n_kv_heads, d)), jnp.float32)  # noqa: E731
    v = None if config.mla else rows(grp.head_dim_v)
    return kvjax.write(cache, 0, slot, rows(grp.head_dim), v)


def run(quick: bool) -> str:
    sizes = (1024, 4096) if quick else (4096, 16384)
    repeats = 3 if quick else 7
    rng = np.random.default_rng(0)
    rows = []
    for n_kv in sizes:
        shape = dict(size=n_kv, n_seq_max=1, n_layer=1, padding=256)
        cases = {
            "latent float32": kvjax.CacheConfig(
                n_kv_heads=1,
                head_dim=RANK + ROPE,
                head_dim_v=RANK,
                mla=True,
                rope=kvjax.RopeConfig(n_rot=ROPE),
                **shape,
            ),
            "latent q8_0": kvjax.CacheConfig(
                n_kv_heads=1,
                head_dim=RANK + ROPE,
                head_dim_v=RANK,
                mla=True,
                k_dtype="q8_0",
                rope=kvjax.RopeConfig(n_rot=ROPE),
                **shape,
            ),
            "decompressed float32": kvjax.CacheConfig(
                n_kv_heads=HEADS, head_dim=NOPE + ROPE, head_dim_v=V_HEAD, **shape
            ),
        }
        times, nbytes = {}, {}
        for name, cfg in cases.items():
            cache = _filled(cfg, rng)
            q = jnp.asarray(rng.standard_normal((1, HEADS, cfg.head_dim[0])), jnp.float32)
            mask = jnp.ones((1, n_kv), bool)
            attend = jax.jit(lambda q, cache: kvjax.attention(q, cache, 0, mask, scale=1.0 / np.sqrt(NOPE + ROPE)))
            times[name] = median_time(lambda: attend(q, cache), repeats=repeats, number=3)
            nbytes[name] = kvjax.total_size(cfg)
        base = times["decompressed float32"]
        for name, t in times.items():
            rate = nbytes[name] / t
            copy = copy_bandwidth(nbytes[name], repeats=repeats)  # as many bytes: the same cache level
            rows.append(
                [
                    name,
                    f"{n_kv}",
                    f"{nbytes[name] / 2**20:.1f} MiB",
                    fmt_time(t),
                    fmt_rate(rate),
                    f"{rate / copy:.0%}",
                    f"{base / t:.1f}x",
                ]
            )
    return "\n".join(
        [
            "## The latent (MLA) cache at decode",
            "",
            f"One layer, DeepSeek V2-Lite's attention shape ({HEADS} heads; K {NOPE}+{ROPE}, V {V_HEAD}; latent "
            f"{RANK} + RoPE key {ROPE}), one decode token over every cell, jitted, median of {repeats} x 3 calls, "
            "compile excluded; bytes are the cache rows read, against a plain copy of as many bytes:",
            "",
            table(["cache", "cells", "bytes read", "time", "bytes/s", "of copy", "vs decompressed"], rows),
        ]
    )
