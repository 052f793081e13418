"""Decode speed options: fused projections and the K/V storage dtype, through ``kvjax.generate``.

The model of ``bench_llamacpp`` (4 layers, width 256, 8 heads, vocab 256, float32 weights), the
same prompts, greedy. For batch 1, 8 and 32 four engines run the same generation: the model as
loaded or with fused projections (``kvjax.nn.fuse_projections``: one Q/K/V matmul and one
gate/up matmul per block), and K/V stored as float32 or float16. The four are interleaved repeat
by repeat (this machine is shared), tokens/s is steady decode (compile time apart), and every
option's tokens are checked equal to the unfused float32 engine's for as long as float16
rounding allows (fused and unfused must agree exactly in float32).
"""

from __future__ import annotations

import os
import statistics

import jax
import numpy as np

import kvjax
from benchmarks.bench_llamacpp import GREEDY, tiny_llama
from benchmarks.common import table
from kvjax import Engine, generate
from kvjax.nn import fuse_projections

OPTIONS = (("unfused", "float32"), ("fused", "float32"), ("unfused", "float16"), ("fused", "float16"))


def run(quick: bool = False) -> str:
    n_new, prompt_len, repeats = (32, 16, 2) if quick else (128, 16, 5)
    models = {"unfused": tiny_llama(), "fused": fuse_projections(tiny_llama())}
    cfg = models["unfused"].config
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 8, 32):
        prompts = [rng.integers(1, 256, size=prompt_len).tolist() for _ in range(batch)]
        size = 1 << (batch * (prompt_len + n_new) - 1).bit_length()

        def gen(option, r):
            fused, dtype = option
            memory = kvjax.init(cfg.cache_config(size=size, n_seq_max=batch, padding=32, k_dtype=dtype, v_dtype=dtype))
            engine = Engine(models[fused], memory, n_ubatch=max(64, batch))
            return generate(
                engine,
                prompts,
                max_new_tokens=n_new,
                key=jax.random.PRNGKey(r),
                sampling=GREEDY,
                share_prefix=False,
                sync_every=n_new,
            )

        first = {o: gen(o, 0) for o in OPTIONS}
        base = first[OPTIONS[0]].tokens
        assert first[("fused", "float32")].tokens == base, "fused projections changed the greedy tokens"
        runs = {o: [] for o in OPTIONS}
        for r in range(repeats):
            for o in OPTIONS:
                runs[o].append(gen(o, r + 1).steady_tokens_per_second)
        tps = {o: statistics.median(v) for o, v in runs.items()}
        ref = tps[OPTIONS[0]]
        for o in OPTIONS:
            same = [
                next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n_new) for x, y in zip(first[o].tokens, base)
            ]
            rows.append(
                [
                    batch,
                    o[0],
                    o[1],
                    f"{tps[o]:.0f}",
                    f"{tps[o] / ref:.2f}",
                    f"{first[o].compile_seconds:.1f} s",
                    f"{min(same)} / {int(np.median(same))}",
                ]
            )
    return "\n\n".join(
        [
            "## Decode options: fused projections and the K/V dtype",
            f"The model of the llama.cpp comparison ({cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} heads, "
            f"vocab {cfg.vocab_size}, float32 weights), {prompt_len}-token prompts, {n_new} greedy tokens per sequence "
            "through `kvjax.generate` (device loop), one unified cache. The four engines run interleaved, repeat by "
            f"repeat; steady tokens/s, medians of {repeats}; the ratio is against the unfused float32 engine of the "
            "same batch. Agreement: the first token where an option's greedy tokens leave the unfused float32 "
            "engine's (minimum / median over sequences; float16 K/V rounds, so near ties may flip).",
            table(
                [
                    "batch",
                    "projections",
                    "K/V dtype",
                    "tokens/s",
                    "vs unfused float32",
                    "compile (first run)",
                    f"greedy tokens equal (of {n_new})",
                ],
                rows,
            ),
        ]
    )


if __name__ == "__main__":
    print(run(quick=bool(int(os.environ.get("QUICK", "0")))))
