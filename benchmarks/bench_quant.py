"""Block-quantized K/V storage: bytes per cell per type, write and K-shift throughput, decode speed.

Bytes per cell are exact (from the config). A ``write`` of one ubatch of rows (K and V of one
layer) is timed warm (median) as bytes of float32 rows consumed per second against a plain jitted
copy of the same bytes measured in the same run; quantizing is the extra work. The K-shift
(dequantize, rotate, quantize back) is timed the same way over the whole K with every cell
pending, against an in-place copy of the stored K bytes. Decode tokens/s of the reference model
at a long-ish context for float32, float16, q8_0 and q4_0 caches (same run, same prompt).
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.common import copy_bandwidth, fmt_rate, fmt_time, inplace_copy_bandwidth, median_time, numpy_rng, table

TYPES = ("float32", "float16", "bfloat16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")


def _bytes_per_cell(n_layer=32, n_kv=8, d=128):
    rows = []
    for t in TYPES:
        cfg = kvjax.CacheConfig(
            size=256, n_seq_max=1, n_layer=n_layer, n_kv_heads=n_kv, head_dim=d, k_dtype=t, v_dtype=t
        )
        per_cell = kvjax.total_size(cfg) / cfg.size
        rows.append(
            [
                t,
                f"{per_cell / n_layer / n_kv / 2:.0f}",
                f"{per_cell / 1024:.0f} KiB",
                f"{per_cell * 8 / (n_layer * n_kv * d * 2):.2f}",
            ]
        )
    return table(
        [
            "type",
            "bytes per head row (D=128)",
            f"K+V bytes per cell ({n_layer} layers, {n_kv} kv heads)",
            "bits per value",
        ],
        rows,
    )


def _write_rows(quick: bool):
    size, t_rows, n_kv, d = (4096, 512, 8, 128) if quick else (32768, 2048, 8, 128)
    repeats = 5 if quick else 7
    rng = numpy_rng(0)
    k = jnp.asarray(rng.standard_normal((t_rows, n_kv, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((t_rows, n_kv, d)), jnp.float32)
    slot = jnp.asarray(rng.permutation(size)[:t_rows], jnp.int32)
    n_bytes = 2 * t_rows * n_kv * d * 4
    copy_bps = copy_bandwidth(n_bytes, repeats=repeats)
    write = jax.jit(kvjax.write, static_argnums=1, donate_argnums=0)
    rows = []
    for t in ("float32", "float16", "q8_0", "q4_0", "q5_1"):
        cfg = kvjax.CacheConfig(
            size=size, n_seq_max=1, n_layer=1, n_kv_heads=n_kv, head_dim=d, k_dtype=t, v_dtype=t, padding=256
        )
        holder = [kvjax.init(cfg)]

        def step():
            holder[0] = write(holder[0], 0, slot, k, v)
            return holder[0].k

        tm = median_time(step, repeats=repeats)
        rows.append(
            [t, t_rows, fmt_time(tm), fmt_rate(n_bytes / tm), fmt_rate(copy_bps), f"{n_bytes / tm / copy_bps:.2f}"]
        )
        holder = None  # free this type's cache before the next one
        gc.collect()
    return table(["type", "rows (x8 heads, D=128)", "write (K+V)", "f32 bytes/s", "copy", "ratio"], rows)


def _k_shift(quick: bool):
    size, n_layer = (4096, 2) if quick else (16384, 4)
    repeats = 3
    rows = []
    for t in ("float32", "float16", "q8_0", "q4_0"):
        cfg = kvjax.CacheConfig(
            size=size,
            n_seq_max=1,
            n_layer=n_layer,
            n_kv_heads=8,
            head_dim=128,
            k_dtype=t,
            v_dtype=t,
            padding=256,
            rope=kvjax.RopeConfig(n_rot=128),
        )
        cache = kvjax.init(cfg)
        ub = kvjax.make_ubatch(range(size), [[0]] * size)
        cache, _, _ = kvjax.find_slot(cache, ub)
        cache = kvjax.seq_add(cache, 0, 0, size, 7)  # every cell pending
        stored = kvjax.size_k_bytes(cfg)
        floats = size * n_layer * 8 * 128 * 4
        tm = median_time(lambda: kvjax.k_shift(cache), repeats=repeats)
        ref = inplace_copy_bandwidth(stored, repeats=repeats)
        rows.append(
            [
                t,
                f"{stored / 2**20:.0f} MiB",
                fmt_time(tm),
                fmt_rate(stored / tm),
                fmt_rate(floats / tm),
                fmt_rate(ref),
                f"{stored / tm / ref:.2f}",
            ]
        )
        cache = None
        gc.collect()
    return table(
        [
            "type",
            "stored K",
            "k_shift (all cells)",
            "stored bytes/s",
            "f32-equivalent bytes/s",
            "in-place copy",
            "ratio",
        ],
        rows,
    )


def _decode(quick: bool):
    from flax import nnx
    from kvjax import Engine, generate
    from kvjax.nn import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=256, d_model=256, n_layer=2, n_heads=8, n_kv_heads=4)  # head size 32
    model = Llama(cfg, rngs=nnx.Rngs(0))
    n_ctx = 1024 if quick else 4096
    prompt = list(np.random.default_rng(0).integers(0, 256, n_ctx - 64))
    n_new = 16 if quick else 32
    rows = []
    for t in ("float32", "float16", "q8_0", "q4_0"):
        cache = kvjax.init(cfg.cache_config(size=n_ctx, n_seq_max=1, padding=256, k_dtype=t, v_dtype=t))
        engine = Engine(model, cache, n_ubatch=256)
        out = generate(
            engine,
            [prompt],
            max_new_tokens=n_new,
            key=jax.random.PRNGKey(0),
            sampling=kvjax.SamplingConfig(temperature=0),
        )
        rows.append(
            [t, n_ctx - 64, f"{out.steady_tokens_per_second:.1f}", f"{kvjax.total_size(cache.config) / 2**20:.1f} MiB"]
        )
        del engine, cache
        gc.collect()
    return table(["type", "context", "decode tokens/s (steady)", "K+V storage"], rows)


def run(quick: bool) -> str:
    return "\n\n".join(
        [
            "## Block-quantized K/V (q8_0, q4_0, ...)",
            "Bytes per cell of each storage type (exact, from the config; ggml's block sizes).",
            _bytes_per_cell(),
            "Write throughput: one ubatch of K and V rows of one layer into random cells, donated, as "
            "float32 bytes consumed per second against a plain copy of those bytes (same run).",
            _write_rows(quick),
            "K-shift of every cell (dequantize, rotate, quantize for block types), not donated, against an "
            "in-place copy of the stored K bytes.",
            _k_shift(quick),
            "Decode speed of the reference Llama (2 layers, head size 32) at a long prompt.",
            _decode(quick),
        ]
    )


if __name__ == "__main__":
    print(run(quick=True))
