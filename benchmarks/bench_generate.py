"""End-to-end generation: tokens/s for 1, 4 and 16 parallel sequences; time to first token with
and without prefix sharing for 8 sequences sharing a 256-token prompt; the engine's decode speed
(host loop and device loop, in one run) against the same model's pure jitted loop at batch 1 and 8.

The model is the demo's character model shape (4 layers, width 128, 4 query heads over 2 kv
heads; random weights: speed does not depend on them). Every configuration runs once to compile
(compile time reported separately) and is then timed on a fresh cache; medians over repeats.
"""

from __future__ import annotations

import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import fmt_time, table
from kvjax._compiles import CompileCounter
from kvjax import Engine, generate
from kvjax.memory._ubatch import Ubatch
from kvjax.nn import Llama, LlamaConfig
from kvjax.nn._inputs import UbatchInputs

GREEDY = kvjax.SamplingConfig(temperature=0)


def _engine(model, size, n_seq):
    return Engine(model, kvjax.init(model.config.cache_config(size=size, n_seq_max=n_seq, padding=32)))


def _timed(model, size, n_seq, prompts, repeats, **kwargs):
    with CompileCounter() as compiles:
        t0 = time.perf_counter()
        generate(_engine(model, size, n_seq), prompts, key=jax.random.PRNGKey(0), sampling=GREEDY, **kwargs)
        first = time.perf_counter() - t0
    runs = [
        generate(_engine(model, size, n_seq), prompts, key=jax.random.PRNGKey(r + 1), sampling=GREEDY, **kwargs)
        for r in range(repeats)
    ]
    return first, compiles.count, runs


def _pure_loop(graphdef):
    """The same model's decode as one jitted ``fori_loop`` of greedy steps at one static window:
    placement, the model and argmax on the device, nothing else (no budgets, stops, key, checks)."""

    def loop(state, cache, tok, pos, n, *, n_kv):
        def body(i, carry):
            cache, tok = carry
            ub = Ubatch(
                pos=jnp.broadcast_to(pos + i, tok.shape).astype(jnp.int32),
                seq_ids=jnp.arange(tok.shape[0], dtype=jnp.int32)[:, None],
                valid=jnp.ones(tok.shape, bool),
            )
            cache, slot, _ = kvjax.find_slot(cache, ub)
            logits, cache = nnx.merge(graphdef, state)(
                tok, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(n_kv,))
            )
            return cache, jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (cache, tok))

    return jax.jit(loop, static_argnames="n_kv", donate_argnames="cache")


def _against_pure_loop(quick: bool) -> str:
    """Decode tokens/s of ``generate`` (host loop, device loop) and of the pure jitted loop, medians."""
    cfg = LlamaConfig(vocab_size=256, d_model=256, n_layer=4, n_heads=8, n_kv_heads=8)  # the llama.cpp bench's
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    loop = _pure_loop(graphdef)
    n_new, prompt_len, repeats, size = (32, 16, 3, 512) if quick else (128, 16, 5, 2048)
    rng = np.random.default_rng(1)
    rows = []
    for batch in (1, 8):
        prompts = [rng.integers(1, 256, size=prompt_len).tolist() for _ in range(batch)]
        # the pure loop: prompts prefilled by the engine, then n_new - 1 greedy steps at the window
        # bucket of the last cell (one program; a little more attention work than the engine's buckets)
        n_kv = kvjax.window_bucket(min(size, batch * (prompt_len + n_new)), size, 32)

        def pure():
            engine = _engine(model, size, batch)
            rows_ = engine.decode(
                sum(prompts, []),
                [p for _ in prompts for p in range(prompt_len)],
                [[s] for s in range(batch) for _ in range(prompt_len)],
                outputs="last",
            )
            tok = jnp.argmax(rows_, -1).astype(jnp.int32)
            jax.block_until_ready(tok)
            t0 = time.perf_counter()
            jax.block_until_ready(loop(state, engine.cache, tok, jnp.int32(prompt_len), n_new - 1, n_kv=n_kv))
            return time.perf_counter() - t0

        def gen(r, device_loop):
            return generate(
                _engine(model, size, batch),
                prompts,
                max_new_tokens=n_new,
                key=jax.random.PRNGKey(r),
                sampling=GREEDY,
                share_prefix=False,
                device_loop=device_loop,
                sync_every=n_new,
            )

        compile_s = []
        for first in (pure, lambda: gen(0, False), lambda: gen(0, True)):
            with CompileCounter() as c:
                first()
            compile_s.append(c.seconds)
        # interleaved repeat by repeat, so a slow spell of this shared machine hits all three alike
        pure_s, host, device = [], [], []
        for r in range(repeats):
            pure_s.append(pure())
            host.append(gen(r + 1, False).steady_tokens_per_second)
            device.append(gen(r + 1, True).steady_tokens_per_second)
        pure_tps = statistics.median(batch * (n_new - 1) / t for t in pure_s)
        row = [batch, f"{pure_tps:.0f}", f"{compile_s[0]:.1f} s"]
        for tps, seconds in ((statistics.median(host), compile_s[1]), (statistics.median(device), compile_s[2])):
            row += [f"{tps:.0f}", f"{tps / pure_tps:.2f}", f"{seconds:.1f} s"]
        rows.append(row)
    return "\n\n".join(
        [
            f"### The engine against the pure jitted loop ({cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} "
            f"heads, vocab {cfg.vocab_size}, float32; greedy, {prompt_len}-token prompts, {n_new} new tokens each)",
            f"Decode tokens/s after the first token, medians of {repeats}, the three runs interleaved repeat by "
            "repeat; compile time (tracing, lowering, compiling) of the first run reported apart. The pure loop "
            "is one jitted `fori_loop` of placement + model + argmax at one window; the engine's host loop "
            "dispatches a step per token, its device loop (`device_loop=True`, the default, `sync_every` = "
            f"{n_new}) a `while_loop` per window bucket. Target (issue 18): engine / pure >= 0.9.",
            table(
                [
                    "batch",
                    "pure loop tokens/s",
                    "pure compile",
                    "host loop tokens/s",
                    "host / pure",
                    "host compile",
                    "device loop tokens/s",
                    "device / pure",
                    "device compile",
                ],
                rows,
            ),
        ]
    )


def run(quick: bool = False) -> str:
    cfg = LlamaConfig(vocab_size=97, d_model=128, n_layer=4, n_heads=4, n_kv_heads=2)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    n_new = 16 if quick else 64
    repeats = 1 if quick else 3
    rows = []
    for n_seq in (1, 4) if quick else (1, 4, 16):
        prompts = [rng.integers(1, 97, size=16).tolist() for _ in range(n_seq)]
        first, n_comp, runs = _timed(
            model, 2048, max(n_seq, 1), prompts, repeats, max_new_tokens=n_new, share_prefix=False
        )
        tps = statistics.median(r.tokens_per_second for r in runs)
        ttft = statistics.median(r.time_to_first_token for r in runs)
        rows.append(
            [n_seq, n_new, f"{tps:.0f}", f"{tps / n_seq:.0f}", fmt_time(ttft), f"{first:.1f} s ({n_comp} programs)"]
        )
    gen = table(
        [
            "sequences",
            "new tokens each",
            "tokens/s (all sequences)",
            "tokens/s per sequence",
            "time to first token",
            "first run incl. compile",
        ],
        rows,
    )

    n_seq, prompt_len, suffix = 8, (64 if quick else 256), 8
    shared = rng.integers(1, 97, size=prompt_len).tolist()
    prompts = [shared + rng.integers(1, 97, size=suffix).tolist() for _ in range(n_seq)]
    ttft_rows = []
    results = {}
    for share in (False, True):
        first, n_comp, runs = _timed(model, 4096, n_seq, prompts, repeats, max_new_tokens=2, share_prefix=share)
        ttft = statistics.median(r.time_to_first_token for r in runs)
        results[share] = ttft
        ttft_rows.append(
            [
                "with" if share else "without",
                runs[0].prompt_tokens,
                fmt_time(ttft),
                f"{first:.1f} s ({n_comp} programs)",
            ]
        )
    ttft_rows.append(["ratio without / with", "", f"{results[False] / results[True]:.2f}x", ""])
    ttft = table(
        ["prefix sharing", "prompt tokens evaluated", "time to first token", "first run incl. compile"], ttft_rows
    )
    picture = _plot([(r[0], float(r[2])) for r in rows], results)
    return "\n\n".join(
        [
            "## Generation (decode driver, end to end)",
            f"Model: {cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} heads over {cfg.n_kv_heads} kv heads, "
            f"vocab {cfg.vocab_size}, float32; greedy sampling; one jitted step per ubatch donating the cache, "
            "window bucket per ubatch from the dry run. tokens/s counts tokens after the first.",
            gen,
            f"### Time to first token: {n_seq} sequences sharing a {prompt_len}-token prompt (+{suffix} own tokens each)",
            ttft,
            _against_pure_loop(quick),
        ]
        + ([picture] if picture else [])
    )


def _plot(throughput, ttft) -> str:
    """Bar charts of tokens/s per sequence count and of time to first token; a Markdown image link."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return ""
    out = pathlib.Path(__file__).resolve().parent / "plots" / "generation.png"
    out.parent.mkdir(exist_ok=True)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    a.bar([str(n) for n, _ in throughput], [t for _, t in throughput], color="#4878a8")
    a.set_xlabel("parallel sequences")
    a.set_ylabel("generated tokens / s")
    a.set_title("generation throughput")
    b.bar(["without", "with"], [ttft[False] * 1e3, ttft[True] * 1e3], color=["#b0b0b0", "#4878a8"])
    b.set_ylabel("ms")
    b.set_title("time to first token, prefix sharing")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return "![generation throughput and time to first token](benchmarks/plots/generation.png)"
