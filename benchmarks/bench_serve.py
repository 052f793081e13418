"""Serving: the continuous-batching scheduler against what a user writes without one.

Workload: ``n`` requests arrive at once (prompts of 12 to 60 characters of the demo's text, 8 to
40 new characters each, as replies differ in length; greedy) on the demo's character model; ``C`` requests run at once
(``n_seq_max = C``). Three ways to serve it, in the same run, each after a warm-up pass of the same
workload (compile time excluded):

- **scheduler**: ``kvjax.serve.Scheduler`` (continuous batching, chunked prefill, the device loop
  for decode-only stretches);
- **static batches**: ``kvjax.generate`` on ``C`` prompts at a time, each batch waiting for its
  longest member (what a loop over ``generate`` gives);
- **one by one**: ``kvjax.generate`` per request (C = 1's only choice without a scheduler).

Reported: generated tokens per second over the whole workload, and time to first token (from
arrival, all at t=0) p50 / p99.

Speculative rounds (``Scheduler(draft=)``) on the same workload, against the scheduler without a
draft in the same run: with the model's own first layer as the draft (its embedding, block 0, final
norm and head: a quarter of the work a token; layer-skip self-speculation), and with the model
itself (every draft kept: what the rounds cost at best acceptance). The acceptance rate is the
share of drafted tokens kept. llama.cpp's own server on a GGUF of the same model is not in this
table yet (docs/serving.md, "Not yet").
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import table
from kvjax.app import _charlm
from kvjax.nn import Llama
from kvjax.serve import Scheduler, ServeRequest
from kvjax.serve._scheduler import percentiles

GREEDY = kvjax.SamplingConfig(temperature=0)


def _prompts(tok, n):
    text = "The file is opened and the value of the name is returned. If the key is missing, the default "
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        start, length = int(rng.integers(0, 30)), int(rng.integers(12, 61))
        out.append((tok.encode(text[start : start + length]).tolist(), int(rng.integers(8, 41))))
    return out


def _engine(model, c):
    return kvjax.Engine(
        model, kvjax.init(model.config.cache_config(size=128 * c, n_seq_max=c, padding=64)), n_ubatch=64
    )


def _serve(scheduler, prompts):
    """``(generated tokens, seconds, time to first token of each request)`` of the workload, all arriving at t=0."""
    t0 = time.perf_counter()
    ids = [scheduler.submit(ServeRequest(p, max_tokens=m)) for p, m in prompts]
    first, generated = {}, 0
    while not scheduler.idle:
        for ev in scheduler.step():
            generated += len(ev.tokens)
            if ev.tokens and ev.request_id not in first:
                first[ev.request_id] = time.perf_counter() - t0
    return generated, time.perf_counter() - t0, [first[i] for i in ids]


def _scheduler(model, prompts, c):
    return _serve(Scheduler(_engine(model, c), n_batch=64), prompts)


def _first_layers(model, n_layer: int):
    """A draft of the model's first ``n_layer`` blocks, its embedding, final norm and head (shared weights)."""
    cfg = dataclasses.replace(model.config, n_layer=n_layer)
    draft = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    mine = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for key, var in nnx.to_flat_state(nnx.state(draft, nnx.Param)):
        var.set_value(mine[key].get_value())
    return draft


def _speculative(model, prompts, c, draft, n_draft=4):
    scheduler = Scheduler(_engine(model, c), n_batch=64, draft=_engine(draft, c), n_draft=n_draft)
    generated, seconds, ttft = _serve(scheduler, prompts)
    stats = scheduler.stats
    return generated, seconds, ttft, stats["accepted_tokens"] / max(stats["drafted_tokens"], 1)


def _static(model, prompts, c):
    engine = _engine(model, c)
    t0 = time.perf_counter()
    generated, ttft = 0, []
    for i in range(0, len(prompts), c):
        engine.cache = kvjax.clear(engine.cache)
        batch_start = time.perf_counter() - t0
        batch = prompts[i : i + c]
        out = kvjax.generate(
            engine,
            [p for p, _ in batch],
            max_new_tokens=[m for _, m in batch],
            key=jax.random.PRNGKey(0),
            sampling=GREEDY,
            share_prefix=False,
        )
        generated += sum(len(t) for t in out.tokens)
        ttft += [batch_start + out.time_to_first_token] * len(out.tokens)
    return generated, time.perf_counter() - t0, ttft


def run(quick: bool) -> str:
    model, tok, trained = _charlm.load(verbose=False)
    n = 16 if quick else 64
    prompts = _prompts(tok, n)
    rows, spec_rows = [], []
    for c in (1, 8) if quick else (1, 8, 32):
        results = {}
        for name, fn in (("scheduler", _scheduler), ("static batches" if c > 1 else "one by one", _static)):
            fn(model, prompts, c)  # warm-up: every program of the workload compiles here
            generated, seconds, ttft = fn(model, prompts, c)
            results[name] = (generated / seconds, *percentiles(ttft))
        base = results["static batches" if c > 1 else "one by one"][0]
        for name, (tps, p50, p99) in results.items():
            rows.append([str(c), name, f"{tps:.0f}", f"{tps / base:.2f}", f"{p50 * 1e3:.0f}", f"{p99 * 1e3:.0f}"])
        plain = results["scheduler"][0]
        for name, draft in (("its first layer", _first_layers(model, 1)), ("itself", model)):
            _speculative(model, prompts, c, draft)  # warm-up
            generated, seconds, ttft, accepted = _speculative(model, prompts, c, draft)
            tps, (p50, p99) = generated / seconds, percentiles(ttft)
            spec_rows.append(
                [
                    str(c),
                    name,
                    f"{tps:.0f}",
                    f"{tps / plain:.2f}",
                    f"{accepted:.0%}",
                    f"{p50 * 1e3:.0f}",
                    f"{p99 * 1e3:.0f}",
                ]
            )
    return "\n".join(
        [
            "## Serving: continuous batching",
            "",
            f"The demo's character model ({'trained' if trained else 'random weights'}), {n} requests arriving at once "
            f"(prompts of 12 to 60 characters, 8 to 40 new characters each, greedy), C running at once; float32 K/V, "
            f"compile excluded (each way ran the workload once before). Throughput is generated tokens over the whole "
            f"workload; time to first token counts from arrival (t=0 for all). `bench_serve.py`:",
            "",
            table(["C", "how", "tokens/s", "x baseline", "TTFT p50 ms", "TTFT p99 ms"], rows),
            "",
            "Speculative rounds (`Scheduler(draft=..., n_draft=4)`) on the same workload, against the scheduler "
            "without a draft (its row above, same run):",
            "",
            table(["C", "draft", "tokens/s", "x scheduler", "drafts kept", "TTFT p50 ms", "TTFT p99 ms"], spec_rows),
        ]
    )
