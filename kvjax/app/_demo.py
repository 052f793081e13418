"""``python -m kvjax demo``: the main job. A small model generates for several sequences at once.

A character-level model (trained on the bundled standard-library docstrings, or random weights
when ``kvjax/app/data/charlm.npz`` is missing) continues three prompts that share a prefix. The demo
prints the cell map (``.`` empty, a digit the sequence holding the cell, ``+`` a cell shared by
several sequences) before and after prefix sharing, around a context shift and around a defrag,
with the numbers: cells used, tokens per second, time to first token, compilations.
"""

from __future__ import annotations

import time

import jax

import kvjax
from kvjax._compiles import CompileCounter
from kvjax.app import _charlm as charlm
from kvjax import Engine, generate

PREFIX = "Return a new "
PROMPTS = [PREFIX + "list of", PREFIX + "string with", PREFIX + "dictionary"]


def _show(title: str, cache) -> None:
    print(f"\n== {title}")
    print(kvjax.cell_map(cache, width=64))


def _print_texts(tok, prompts, tokens):
    for i, (p, t) in enumerate(zip(prompts, tokens)):
        text = (p + tok.decode(t)).replace("\n", "\\n")
        print(f"  [{i}] {text}")


def main(quick: bool = False, cache_type: str = "float32") -> int:
    t_start = time.perf_counter()
    model, tok, trained = charlm.load()
    # windows in steps of 256 cells (llama.cpp's padding with flash attention): each window bucket is
    # a program to compile, and for this small model compiling a 32-cell bucket takes far longer than
    # attending over the extra cells ever would (first run 25 s with padding 32, 16.5 s with 256)
    cfg = model.config.cache_config(
        size=256 if quick else 512, n_seq_max=4, padding=256, k_dtype=cache_type, v_dtype=cache_type
    )
    n_new = 24 if quick else 96
    key = jax.random.PRNGKey(0)
    sampling = kvjax.SamplingConfig(temperature=0.7, top_k=20, top_p=0.95)
    print(
        f"model: {'trained' if trained else 'random'} character model, {model.config.n_layer} layers, "
        f"width {model.config.d_model}; cache: {cfg.size} cells x {len(cfg.cached_layers)} layers "
        f"({kvjax.total_size(cfg) / 2**20:.2f} MiB of {cache_type} K/V), {cfg.n_seq_max} sequences"
    )
    prompts = [tok.encode(p).tolist() for p in PROMPTS]

    # 1. the same prompts without and with prefix sharing
    plain = Engine(model, kvjax.init(cfg))
    generate(plain, prompts, max_new_tokens=1, key=key, sampling=sampling, share_prefix=False)
    _show("three prompts, each evaluated in full (no sharing)", plain.cache)
    engine = Engine(model, kvjax.init(cfg))
    out = generate(engine, prompts, max_new_tokens=n_new, key=key, sampling=sampling)
    _show(f"with the prefix {PREFIX!r} evaluated once and shared (seq_cp), then {n_new} tokens each", engine.cache)
    print(
        f"prompt tokens evaluated: {out.prompt_tokens} instead of {sum(map(len, prompts))}; "
        f"time to first token {out.time_to_first_token * 1e3:.0f} ms; "
        f"{out.steady_tokens_per_second:.0f} tokens/s over {len(prompts)} sequences (compile time apart: "
        f"{out.compile_seconds:.1f} s for {out.compiles} programs, each window bucket once; a second run "
        f"takes them from the persistent compilation cache)"
    )
    _print_texts(tok, PROMPTS, out.tokens)

    # 2. a context shift of sequence 0: keep 4 tokens, discard 16, shift the rest back
    n_keep, n_discard = 4, 16
    before = int(kvjax.seq_pos_max(engine.cache, 0)) + 1
    next_pos = engine.context_shift(0, n_keep, n_discard)
    _show(
        f"context shift of sequence 0: positions {n_keep}..{n_keep + n_discard - 1} dropped, "
        f"{before - n_keep - n_discard} cells shifted by -{n_discard} (K-shift pending: "
        f"{bool(kvjax.has_shift(engine.cache))})",
        engine.cache,
    )
    last = out.tokens[0][-1]
    cont = []
    t0 = time.perf_counter()
    with CompileCounter() as compiles:
        for _ in range(8 if quick else 32):
            logits = engine.decode([last], [next_pos], [[0]])  # applies the K-shift first
            key, sub = jax.random.split(key)
            last = int(kvjax.sample(logits, sub, sampling)[0])
            cont.append(last)
            next_pos += 1
    dt = time.perf_counter() - t0 - compiles.seconds
    print(
        f"sequence 0 continues after the shift ({len(cont) / dt:.0f} tokens/s; compiling the K-shift and "
        f"the new windows took {compiles.seconds:.1f} s apart): {tok.decode(cont)!r}"
    )

    # 3. drop sequence 1, then defragment
    engine.cache, _ = kvjax.seq_rm(engine.cache, 1)
    _show("sequence 1 dropped (seq_rm): holes", engine.cache)
    t0 = time.perf_counter()
    engine.cache = jax.block_until_ready(kvjax.defrag(engine.cache))
    _show(
        f"after defrag ({(time.perf_counter() - t0) * 1e3:.0f} ms, one gather over every layer): "
        f"n_kv {int(kvjax.n_kv(engine.cache))}",
        engine.cache,
    )

    used = int(kvjax.used_cells(engine.cache))
    print(f"\ncells used {used}/{cfg.size}; tokens decoded by the engine: {engine.n_decoded}")
    print(f"demo finished in {time.perf_counter() - t_start:.1f} s")
    cache_dir = jax.config.jax_compilation_cache_dir
    print(
        f"compiled programs kept in {cache_dir} (python -m kvjax --no-compile-cache demo to turn off)"
        if cache_dir
        else "persistent compilation cache off"
    )
    return 0
