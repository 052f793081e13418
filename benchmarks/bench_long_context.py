"""Long contexts: kvjax against llama.cpp at 1K-32K cells, prompt processing and decode with the cache.

The model of ``bench_llamacpp.py`` (a random Llama of 4 layers, width 256, 8 heads of 32, vocab 256,
float32 weights), written as one GGUF file and loaded by both. For every context ``N``:

- **prompt**: a random ``N``-token prompt evaluated into an empty memory (llama.cpp: ``llama_decode``
  of 512-token batches; kvjax: ``kvjax.generate``'s prefill, ubatches of 512), tokens per second;
- **decode**: then 32 greedy tokens one at a time against those ``N`` cells (llama.cpp: one
  ``llama_decode`` a token, argmax on the host, as a server loop does; kvjax: ``kvjax.generate``'s
  device loop, its steady rate), tokens per second.

K/V in float16 and q8_0 on both sides; llama.cpp with flash attention on and off (q8_0 V needs it
on: a refused context is reported as such); 2 threads each. Batch 1, and batch 4 (4 sequences of
``N`` each, one unified buffer or a stream per sequence) at the shorter contexts. kvjax runs each
configuration twice and reports the second run (the first compiles; compile time is given apart).
One measurement per configuration, in one process: the prompts take tens of seconds at 16K-32K, so
there are no repeats; a shared machine's noise is a few ten percent.

Needs the ``llamacpp`` extra; says so and returns without it. Never part of the test suite.
"""

from __future__ import annotations

import os
import tempfile
import time

import jax
import numpy as np
from tqdm import tqdm

import kvjax
from benchmarks.bench_llamacpp import GREEDY, N_THREADS, _write_gguf, tiny_llama
from benchmarks.common import table
from benchmarks.llamacpp_context import LlamaCppContext
from kvjax import Engine, generate

N_NEW = 32
N_BATCH = 512


def _plan(quick: bool):
    """``[(batch, unified, context)]``: batch 1 at every context, batch 4 at the shorter ones."""
    contexts = (1024, 4096) if quick else (1024, 4096, 16384, 32768)
    plan = [(1, True, n) for n in contexts]
    for n in (1024,) if quick else (1024, 4096):
        plan += [(4, True, n), (4, False, n)]
    return plan


def _llamacpp(path, prompts, kv: str, flash: bool, unified: bool):
    """``(prompt tokens/s, decode tokens/s)`` of llama.cpp, or None where it refuses the context."""
    n, b = len(prompts[0]), len(prompts)
    try:
        ctx = LlamaCppContext(
            path,
            n_ctx=b * (n + N_NEW + 64),
            n_seq=b,
            kv_type=kv,
            flash_attn=flash,
            kv_unified=unified,
            n_batch=N_BATCH,
            n_threads=N_THREADS,
        )
    except RuntimeError:
        return None
    try:
        t0 = time.perf_counter()
        ctx.evaluate_prompts(prompts)
        prompt = b * n / (time.perf_counter() - t0)
        nxt = [1] * b
        t0 = time.perf_counter()
        for i in range(N_NEW):
            ctx.decode(nxt, [n + i] * b, [[s] for s in range(b)], outputs=range(b))
            nxt = [int(np.argmax(ctx.logits(s))) for s in range(b)]
        return prompt, b * N_NEW / (time.perf_counter() - t0)
    finally:
        ctx.close()


def _kvjax(model, prompts, kv: str, unified: bool):
    """``(prompt tokens/s, decode tokens/s, compile s)`` of kvjax's second run (the first compiles)."""
    n, b = len(prompts[0]), len(prompts)
    per_seq = n + 2 * 64  # the prompt, the new tokens and room to spare, whole padding blocks
    config = model.config.cache_config(
        size=b * per_seq if unified else per_seq, n_seq_max=b, padding=64, k_dtype=kv, v_dtype=kv
    )
    if not unified:
        config = kvjax.StreamsConfig(config, n_stream=b)
    runs = []
    for r in range(2):
        engine = Engine(model, kvjax.init(config), n_ubatch=N_BATCH)
        runs.append(
            generate(
                engine,
                prompts,
                max_new_tokens=N_NEW + 1,
                key=jax.random.PRNGKey(r),
                sampling=GREEDY,
                share_prefix=False,
                sync_every=N_NEW,
            )
        )
    out = runs[1]
    return b * n / out.time_to_first_token, out.steady_tokens_per_second, runs[0].compile_seconds


def _fmt(x):
    return "refused" if x is None else f"{x:.0f}"


def run(quick: bool = False) -> str:
    head = "## Long contexts: kvjax against llama.cpp (prompt and decode tokens/s with the cache)"
    try:
        import gguf  # noqa: F401
        import llama_cpp
    except ImportError as e:
        return f"{head}\n\nSkipped: {e.name} is not installed (`pip install 'kvjax[llamacpp,gguf]'`)."
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-llama.gguf")
        _write_gguf(path, tiny_llama())
        model = kvjax.nn.fuse_projections(kvjax.nn.from_gguf(path))
        plan = [(b, u, n, kv) for b, u, n in _plan(quick) for kv in ("float16", "q8_0")]
        for batch, unified, n, kv in tqdm(plan, desc="long contexts", unit="config"):
            prompts = [rng.integers(1, 256, size=n).tolist() for _ in range(batch)]
            on = _llamacpp(path, prompts, kv, True, unified)
            off = _llamacpp(path, prompts, kv, False, unified)
            k_prompt, k_decode, k_compile = _kvjax(model, prompts, kv, unified)
            best = [max((x[i] for x in (on, off) if x is not None), default=None) for i in (0, 1)]
            rows.append(
                [
                    str(batch),
                    "unified" if unified else "a stream each",
                    kv,
                    f"{n // 1024}K",
                    f"{_fmt(on and on[0])} / {_fmt(off and off[0])}",
                    f"{k_prompt:.0f}",
                    "-" if best[0] is None else f"{k_prompt / best[0]:.2f}",
                    f"{_fmt(on and on[1])} / {_fmt(off and off[1])}",
                    f"{k_decode:.0f}",
                    "-" if best[1] is None else f"{k_decode / best[1]:.2f}",
                    f"{k_compile:.1f} s",
                ]
            )
    cfg = model.config
    return "\n\n".join(
        [
            head,
            f"Model: {cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} heads of {cfg.head_size}, vocab "
            f"{cfg.vocab_size}, float32 weights, one GGUF file for both; llama.cpp: `llama-cpp-python` "
            f"{llama_cpp.__version__}, {N_THREADS} threads, batches of {N_BATCH}; kvjax: `kvjax.generate` "
            f"(ubatches of {N_BATCH}, then the device loop), second run of each configuration. Prompt: a "
            f"random prompt of the context's length per sequence into an empty memory; decode: {N_NEW} greedy "
            f"tokens after it. Ratios are kvjax against the faster of llama.cpp's two flash-attention settings "
            f"(what a user would pick). `bench_long_context.py`:",
            table(
                [
                    "batch",
                    "layout",
                    "K/V",
                    "context",
                    "llama.cpp prompt tok/s (FA on / off)",
                    "kvjax prompt tok/s",
                    "prompt ratio",
                    "llama.cpp decode tok/s (FA on / off)",
                    "kvjax decode tok/s",
                    "decode ratio",
                    "kvjax compile",
                ],
                rows,
            ),
        ]
    )


if __name__ == "__main__":
    print(run(quick=True))
