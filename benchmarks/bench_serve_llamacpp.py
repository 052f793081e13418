"""Continuous batching, kvjax against llama.cpp: the same requests, the same GGUF, 2 threads each.

The model is ``bench_llamacpp``'s (a random Llama, 4 layers, width 256, vocab 256, float32
weights in a GGUF file that both load). The trace: ``n`` requests arriving at once, prompts of 8 to
48 tokens, 16 to 64 new tokens each (replies differ in length), greedy; ``C`` requests run at once
(``C`` sequence ids, a unified float16 K/V buffer of ``128 C`` cells on both sides).

- kvjax: :class:`kvjax.serve.Scheduler` (chunked prefill under ``n_batch``, decode-only stretches on
  the device loop);
- llama.cpp: llama-server's slot loop written over ``llama-cpp-python``'s low-level API, as its
  server does it in C++ (``llama-cpp-python``'s own server runs one request at a time): each step one
  ``llama_decode`` of a decode token per running slot plus prompt chunks up to ``n_batch``, argmax on
  the host from ``llama_get_logits_ith``, ``llama_memory_seq_rm`` when a request ends, waiting
  requests take free slots in arrival order.

Reported (medians of interleaved repeats in one process, compile excluded: each side ran the trace
once before): generated tokens/s over the trace and time to first token from arrival, p50 / p99.
Needs ``llama-cpp-python`` (the ``llamacpp`` extra, built from source); says so without it.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

import kvjax
from benchmarks.bench_llamacpp import N_THREADS, _write_gguf, tiny_llama
from benchmarks.common import table
from kvjax.serve import Scheduler, ServeRequest
from kvjax.serve._scheduler import percentiles

N_BATCH = 128
CELLS_PER_REQUEST = 128


def trace(n: int, seed: int = 0):
    """``n`` requests ``(prompt ids, new tokens)``."""
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 256, int(rng.integers(8, 49))).tolist(), int(rng.integers(16, 65))) for _ in range(n)]


def serve_kvjax(model, requests, c):
    config = model.config.cache_config(
        size=CELLS_PER_REQUEST * c, n_seq_max=c, padding=32, k_dtype="float16", v_dtype="float16"
    )
    scheduler = Scheduler(kvjax.Engine(model, kvjax.init(config), n_ubatch=64), n_batch=N_BATCH, sync_every=32)
    t0 = time.perf_counter()
    ids = [scheduler.submit(ServeRequest(p, max_tokens=m)) for p, m in requests]
    first, out = {}, {i: [] for i in ids}
    while not scheduler.idle:
        for ev in scheduler.step():
            if ev.tokens and ev.request_id not in first:
                first[ev.request_id] = time.perf_counter() - t0
            out[ev.request_id] += ev.tokens
    seconds = time.perf_counter() - t0
    return [out[i] for i in ids], seconds, [first[i] for i in ids]


def serve_llamacpp(ctx, requests, c):
    """llama-server's loop: slots decode one token per step, prompts fill the rest of ``n_batch``."""
    ctx.clear()
    t0 = time.perf_counter()
    waiting = list(range(len(requests)))
    slots = {}  # slot -> [request, tokens fed (context), placed, generated]
    out, first = [[] for _ in requests], [0.0] * len(requests)
    while waiting or slots:
        free = [s for s in range(c) if s not in slots]
        while waiting and free:
            r = waiting.pop(0)
            slots[free.pop(0)] = [r, list(requests[r][0]), 0]
        toks, pos, seqs, rows = [], [], [], []
        budget = N_BATCH
        order = sorted(slots.items(), key=lambda kv: len(kv[1][1]) - kv[1][2] > 1)  # decoders first
        for s, (r, context, placed) in order:
            n = min(len(context) - placed, budget)
            if n <= 0:
                break
            toks += context[placed : placed + n]
            pos += range(placed, placed + n)
            seqs += [[s]] * n
            slots[s][2] += n
            if placed + n == len(context):
                rows.append((len(toks) - 1, s))
            budget -= n
        ctx.decode(toks, pos, seqs, outputs=[i for i, _ in rows])
        for row, s in rows:
            r, context, _ = slots[s]
            token = int(np.argmax(ctx.logits(row)))  # llama_get_logits_ith takes the batch row
            if not out[r]:
                first[r] = time.perf_counter() - t0
            out[r].append(token)
            context.append(token)
            if len(out[r]) >= requests[r][1]:
                ctx.seq_rm(s, -1, -1)
                del slots[s]
    return out, time.perf_counter() - t0, first


def run(quick: bool = False) -> str:
    try:
        from benchmarks.llamacpp_context import LlamaCppContext

        import llama_cpp  # noqa: F401
    except ImportError:
        return "## Serving: kvjax against llama.cpp\n\nSkipped: `llama-cpp-python` is not installed (`pip install 'kvjax[llamacpp]'`)."
    n, repeats = (16, 2) if quick else (64, 3)
    requests = trace(n)
    rows, agree = [], []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-llama.gguf")
        _write_gguf(path, tiny_llama())
        model = kvjax.nn.fuse_projections(kvjax.nn.from_gguf(path))
        for c in (1, 8) if quick else (1, 8, 32):
            ctx = LlamaCppContext(
                path, n_ctx=CELLS_PER_REQUEST * c, n_seq=c, kv_type="f16", n_batch=N_BATCH, n_threads=N_THREADS
            )
            cpp_out, _, _ = serve_llamacpp(ctx, requests, c)  # warm-up
            kv_out, _, _ = serve_kvjax(model, requests, c)  # compiles
            runs = {"kvjax": [], "llama.cpp": []}
            for _ in range(repeats):  # interleaved: the machine's load falls on both alike
                for name, fn, arg in (("llama.cpp", serve_llamacpp, ctx), ("kvjax", serve_kvjax, model)):
                    toks, seconds, ttft = fn(arg, requests, c)
                    runs[name].append((sum(len(t) for t in toks) / seconds, *percentiles(ttft)))
            ctx.close()
            med = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
            for name in ("llama.cpp", "kvjax"):
                tps, p50, p99 = med[name]
                ratio = f"{tps / med['llama.cpp'][0]:.2f}" if name == "kvjax" else ""
                ttft_ratio = f"{p50 / med['llama.cpp'][1]:.2f}" if name == "kvjax" else ""
                rows.append([str(c), name, f"{tps:.0f}", ratio, f"{p50 * 1e3:.0f}", f"{p99 * 1e3:.0f}", ttft_ratio])
            same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(kv_out, cpp_out)]
            agree.append(f"C={c}: median {int(np.median(same))} of the first tokens equal, at least {min(same)}")
    return "\n".join(
        [
            "## Serving: continuous batching, kvjax against llama.cpp",
            "",
            f"`bench_llamacpp`'s model (random Llama, 4 layers, width 256, vocab 256) in one GGUF file; {n} requests "
            f"arriving at once (prompts of 8 to 48 tokens, 16 to 64 new tokens each, greedy); C at once on C "
            f"sequence ids, float16 K/V in one buffer of {CELLS_PER_REQUEST} C cells, n_batch {N_BATCH}, "
            f"{N_THREADS} threads each. llama.cpp runs llama-server's slot loop over its low-level API "
            f"(`bench_serve_llamacpp.py`); kvjax runs `kvjax.serve.Scheduler`. Medians of {repeats} interleaved "
            f"repeats, compile excluded:",
            "",
            table(
                ["C", "server", "tokens/s", "kvjax / llama.cpp", "TTFT p50 ms", "TTFT p99 ms", "TTFT p50 ratio"], rows
            ),
            "",
            "Greedy tokens of the two sides per request: " + "; ".join(agree) + " (float sums in another order flip "
            "near ties of this random model, after which a request's tokens differ).",
        ]
    )
