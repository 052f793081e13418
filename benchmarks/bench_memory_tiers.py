"""Memory beyond the device: the prompt cache's host tier, idle sequences moved out, streaming.

- **Multi-turn trace with more users than the device parks**: 8 users interleaved round-robin over
  a memory of 4 sequence ids (3 parked beside the running request), each request repeating the
  user's conversation so far plus a new turn. Without a host tier the least recently used parked
  sequence is dropped, which in round-robin is always the next user's: nothing is reused. With it
  the dropped sequence moves to host memory and comes back. Median time to first token and prompt
  tokens evaluated; same run, compile excluded (the trace runs once before).
- **Decode with idle sequences on the device or moved out**: 8 finished requests of 512 tokens
  each parked in a unified memory, then a new request decodes 128 tokens. Parked on the device
  their cells sit below the new sequence's, so every step's attention window spans them; moved to
  host (``idle_to_host``, llama.cpp's ``--cache-idle-slots``) the window is the request's own.
- **Streaming**: 10,000 tokens in 256 cells with ``SinkWindow(4, 252)`` (evict one, re-rotate
  the rest, every step, in the device loop), tokens/s per 1,000-token chunk; against the context
  shift a llama.cpp user would run (``n_ctx=256, n_keep=4``: half the context dropped at once)
  and against no eviction at all (a memory of a cell per token, whose window grows with the text).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.bench_prompt_cache import multi_turn
from benchmarks.common import median_time, table
from kvjax.app import _charlm

GREEDY = kvjax.SamplingConfig(temperature=0)


# the multi-turn trace's prompt caches: (label, on, host_bytes, idle_to_host)
TRACE_VARIANTS = [
    ("no prompt cache", False, 0, False),
    ("PromptCache, device only", True, 0, False),
    ("PromptCache + host tier", True, 256 * 2**20, False),
    ("PromptCache + host tier, idle_to_host", True, 256 * 2**20, True),
]


def _trace(model, tok, users, turns, on, host_bytes, idle_to_host):
    """One pass of the multi-turn trace: (median TTFT, prompt tokens evaluated, moves out, back)."""
    n_seq = 4
    engine = kvjax.Engine(
        model, kvjax.init(model.config.cache_config(size=2048, n_seq_max=n_seq, padding=64)), n_ubatch=64
    )
    cache = kvjax.PromptCache(n_seq, 2048, host_bytes=host_bytes, idle_to_host=idle_to_host) if on else None
    ttft, evaluated, _ = multi_turn(engine, tok, users, turns, cache)
    moved = (cache.offloads, cache.restores) if cache is not None else (0, 0)
    return statistics.median(ttft), evaluated, *moved


def _idle_decode(model, tok, n_idle, idle_len, n_new, idle_to_host):
    """Steady decode tokens/s of one request after ``n_idle`` finished requests were parked."""
    engine = kvjax.Engine(
        model,
        kvjax.init(model.config.cache_config(size=(n_idle + 1) * 1024, n_seq_max=n_idle + 1, padding=64)),
        n_ubatch=64,
    )
    cache = kvjax.PromptCache(n_idle + 1, 1024, host_bytes=1 << 30, idle_to_host=idle_to_host)
    text = _charlm.read_corpus()
    for i in range(n_idle):
        prompt = tok.encode(text[i * idle_len : (i + 1) * idle_len]).tolist()
        kvjax.generate(
            engine, [prompt], max_new_tokens=4, key=jax.random.PRNGKey(i), sampling=GREEDY, prompt_cache=cache
        )
    prompt = tok.encode("Q: " + text[-200:]).tolist()
    out = kvjax.generate(
        engine, [prompt], max_new_tokens=n_new, key=jax.random.PRNGKey(99), sampling=GREEDY, prompt_cache=cache
    )
    return out.steady_tokens_per_second


def _move_cost(model, tok, n_tokens, repeats):
    """Median seconds of one sequence's move to host (``state_write``) and back (``state_read``),
    and of a plain device-to-host copy of the same bytes and a host memcpy of them."""
    engine = kvjax.Engine(
        model, kvjax.init(model.config.cache_config(size=2 * n_tokens, n_seq_max=2, padding=64)), n_ubatch=64
    )
    tokens = tok.encode(_charlm.read_corpus()[:n_tokens]).tolist()
    engine.decode(tokens, list(range(len(tokens))), [[0]] * len(tokens), outputs="last")
    memory = engine.cache
    blob = memory.state_write(0)
    flat = jnp.zeros(len(blob) // 4, jnp.float32)
    host = np.frombuffer(blob, np.uint8)

    # the plain device-to-host copy: a fresh device buffer of the same bytes fetched to numpy
    return (
        len(blob),
        median_time(lambda: memory.state_write(0), repeats=repeats),
        median_time(lambda: memory.state_read(blob, 1).cells.pos, repeats=repeats),
        median_time(lambda: np.asarray(flat + 0), repeats=repeats),
        median_time(host.copy, repeats=repeats),
    )


def _chunk_rates(model, memory_config, n_tokens, chunk, **options):
    """Tokens/s of each ``chunk`` tokens of one sequence generating ``n_tokens`` on a fresh memory."""
    engine = kvjax.Engine(model, kvjax.init(memory_config), n_ubatch=64)
    stamps = []
    kvjax.generate(
        engine,
        [[1, 2, 3, 4]],
        max_new_tokens=n_tokens,
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=1.0),
        on_token=lambda seq, token: stamps.append(time.perf_counter()),
        **options,
    )
    assert len(stamps) == n_tokens, len(stamps)
    # the first chunk starts at the first token (the prompt and the first step's compile apart)
    edges = [stamps[0]] + [stamps[i - 1] for i in range(chunk, n_tokens + 1, chunk)]
    return [(chunk - (1 if i == 0 else 0)) / (b - a) for i, (a, b) in enumerate(zip(edges, edges[1:]))]


def run(quick: bool) -> str:
    users, turns = (8, 2) if quick else (8, 4)
    n_stream, chunk = (2000, 500) if quick else (10000, 1000)
    model, tok, trained = _charlm.load(verbose=False)
    rows = []
    for label, *variant in TRACE_VARIANTS:
        _trace(model, tok, users, 1, *variant)  # compile everything once
        ttft, evaluated, moved_out, back = _trace(model, tok, users, turns, *variant)
        rows.append([label, f"{ttft * 1e3:.1f} ms", f"{evaluated}", f"{moved_out}", f"{back}"])

    idle_rows = []
    n_idle, idle_len, n_new = (4, 256, 64) if quick else (8, 512, 128)
    speeds = {}
    for idle_to_host in (False, True):
        _idle_decode(model, tok, n_idle, idle_len, n_new, idle_to_host)  # compile
        speeds[idle_to_host] = statistics.median(
            _idle_decode(model, tok, n_idle, idle_len, n_new, idle_to_host) for _ in range(3)
        )
    for idle_to_host in (False, True):
        idle_rows.append(
            [
                "moved to host (idle_to_host)" if idle_to_host else "parked on the device",
                f"{speeds[idle_to_host]:.0f}",
                f"{speeds[idle_to_host] / speeds[False]:.2f}",
            ]
        )

    n_move = 512
    nbytes, write_s, read_s, d2h_s, memcpy_s = _move_cost(model, tok, n_move, 5 if quick else 20)
    move_rows = [
        [
            "to host (`state_write` of the sequence)",
            f"{write_s * 1e3:.2f} ms",
            f"{nbytes / write_s / 1e9:.2f} GB/s",
            f"{d2h_s / write_s:.2f}",
        ],
        [
            "back into free cells (`state_read`)",
            f"{read_s * 1e3:.2f} ms",
            f"{nbytes / read_s / 1e9:.2f} GB/s",
            f"{d2h_s / read_s:.2f}",
        ],
        [
            "plain device-to-host copy of the same bytes",
            f"{d2h_s * 1e3:.2f} ms",
            f"{nbytes / d2h_s / 1e9:.2f} GB/s",
            "1.00",
        ],
        [
            "host memcpy of the same bytes",
            f"{memcpy_s * 1e3:.2f} ms",
            f"{nbytes / memcpy_s / 1e9:.2f} GB/s",
            f"{d2h_s / memcpy_s:.2f}",
        ],
    ]

    cfg = model.config
    n_cells = 256
    n_all = -(-(n_stream + 4) // 64) * 64  # no eviction: every token's cell (a multiple of the padding)
    window = kvjax.SinkWindow(4, n_cells - 4)
    runs = {
        f"SinkWindow(4, {n_cells - 4}), {n_cells} cells": (
            cfg.cache_config(size=n_cells, n_seq_max=1, padding=64),
            dict(window=window),
        ),
        f"context shift n_ctx={n_cells}, n_keep=4": (
            cfg.cache_config(size=n_cells, n_seq_max=1, padding=64),
            dict(n_ctx=n_cells, n_keep=4),
        ),
        f"no eviction, {n_all:,} cells": (cfg.cache_config(size=n_all, n_seq_max=1, padding=64), {}),
    }
    stream_rows = []
    for name, (memory, options) in runs.items():
        # compile: every window bucket the run will reach (the memory without eviction widens its
        # window as it fills, one program per bucket)
        _chunk_rates(model, memory, n_stream, chunk, **options)
        rates = _chunk_rates(model, memory, n_stream, chunk, **options)
        stream_rows.append([name] + [f"{r:.0f}" for r in rates] + [f"{rates[-1] / rates[0]:.2f}"])
    chunks = [f"{i * chunk / 1000:g}k-{(i + 1) * chunk / 1000:g}k" for i in range(n_stream // chunk)]
    return "\n".join(
        [
            "## Memory tiers: host tier, idle sequences moved out, streaming",
            "",
            f"The demo's character model ({'trained' if trained else 'random weights'}). **Multi-turn trace**: {users} "
            f"users round-robin, {turns} turns each, 16 greedy characters per turn, a unified memory of 2,048 cells and "
            f"4 sequence ids (3 parked beside the running request); every request repeats its user's conversation so "
            f"far. Median time to first token over all requests (compile excluded: the trace ran once before), prompt "
            f"tokens evaluated in total, sequences moved to the host tier and back:",
            "",
            table(["", "time to first token", "prompt tokens evaluated", "moved out", "back"], rows),
            "",
            f"**Decode beside idle sequences**: {n_idle} finished requests of {idle_len} characters parked, then one "
            f"request decodes {n_new} greedy tokens (steady tokens/s, median of 3; the parked cells widen every step's "
            f"attention window unless they leave the device):",
            "",
            table(["idle sequences", "decode tokens/s", "ratio"], idle_rows),
            "",
            f"**One move**: a sequence of {n_move} tokens ({nbytes / 2**20:.2f} MiB of float32 K/V in the state layout) "
            f"to host and back, median of {5 if quick else 20}, against a plain copy of the same bytes (speed relative "
            f"to the device-to-host copy):",
            "",
            table(["", "time", "bytes/s", "vs plain copy"], move_rows),
            "",
            f"**Streaming**: one sequence sampling {n_stream:,} tokens (temperature 1), tokens/s per {chunk:,}-token "
            f"chunk (device loop, first token's compile apart), and the last chunk's rate over the first's:",
            "",
            table(["memory"] + chunks + ["last / first"], stream_rows),
        ]
    )
