"""Per-sequence streams against one unified cache: decode tokens/s at batch 8 and 32.

In one unified cache every decoded token attends over the cells of all sequences (masked), so at
batch B a token reads about B times the cells it needs; with one stream per sequence it reads its
own sequence's cells only (``kvjax.StreamsConfig``). Both memories hold the same cells in all
(``B * context``), run the same model and the same tokens through ``kvjax.Engine``, in one run;
median of rounds of decode steps (one token per sequence each), the two memories' rounds
interleaved (on a shared machine a slow spell then hits both), compile time excluded.
"""

from __future__ import annotations


import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import greedy_decode_rounds, interleaved_medians, table
from kvjax import Engine
from kvjax.nn import Llama, LlamaConfig


def _prefill(engine, n_seq: int, context: int) -> None:
    """A ``context``-token prompt for each of ``n_seq`` sequences, 128 tokens a ubatch."""
    for start in range(0, context, 128):
        n = min(128, context - start)
        toks, pos, ids = [], [], []
        for s in range(n_seq):
            toks += list((np.arange(start, start + n) + s) % 50)
            pos += list(range(start, start + n))
            ids += [[s]] * n
        engine.decode(toks, pos, ids, outputs=[])


def run(quick: bool) -> str:
    contexts = (32, 128) if quick else (128, 1024)
    batches = (8,) if quick else (8, 32)
    steps, repeats = (4, 2) if quick else (8, 5)
    cfg = LlamaConfig(vocab_size=64, d_model=128, n_layer=4, n_heads=4, n_kv_heads=2)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rows = []
    for n_seq in batches:
        for context in contexts:
            per_seq = context + (repeats + 1) * steps + 64
            per_seq = -(-per_seq // 64) * 64
            unified = cfg.cache_config(size=n_seq * per_seq, n_seq_max=n_seq, padding=64)
            streams = kvjax.StreamsConfig(cfg.cache_config(size=per_seq, n_seq_max=n_seq, padding=64))
            rounds = {}
            for name, config in (("unified", unified), ("streams", streams)):
                engine = Engine(model, kvjax.init(config), n_ubatch=512)
                _prefill(engine, n_seq, context)
                rounds[name] = greedy_decode_rounds(engine, n_seq, context, steps)
            rates = {name: n_seq / t for name, t in interleaved_medians(rounds, repeats).items()}
            rows.append(
                [
                    f"{n_seq}",
                    f"{context}",
                    f"{n_seq * per_seq}",
                    f"{rates['unified']:.0f}",
                    f"{rates['streams']:.0f}",
                    f"{rates['streams'] / rates['unified']:.2f}",
                ]
            )
    return "\n".join(
        [
            "## Streams: per-sequence streams against one unified cache",
            "",
            f"Decode through kvjax.Engine, a 4-layer width-128 Llama (4 heads, 2 kv heads, float32), B sequences "
            f"after a prompt of `context` tokens each; both memories hold B x (context + margin) cells; median of "
            f"{repeats} rounds of {steps} steps, the two memories' rounds interleaved, compile excluded:",
            "",
            table(["B", "context", "cells in all", "unified tok/s", "streams tok/s", "streams / unified"], rows),
        ]
    )
