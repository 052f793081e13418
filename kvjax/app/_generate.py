"""``python -m kvjax generate``: text from a real checkpoint, streamed, with the speed reported.

Loads a Hugging Face folder (:func:`kvjax.nn.from_pretrained`) or a ``.gguf`` file
(:func:`kvjax.nn.from_gguf`), tokenizes the prompt with the checkpoint's tokenizer, runs
:func:`kvjax.generate` on the memory the model needs (:func:`kvjax.nn.memory_config_for`; with
``--n-parallel`` above 1 a stream per sequence, :class:`kvjax.StreamsConfig`, as llama.cpp does
unless ``--kv-unified``; attention windows from ``--padding`` cells) and prints sequence 0's
text as its tokens come (the other ``--n-parallel`` sequences at the end).
Generation stops at the model's EOS tokens or ``--max-new-tokens``; a sequence that reaches
``--ctx`` positions shifts its context (llama.cpp's rule).

The report (on stderr) keeps compile time apart: a short warm-up generation on a memory of its
own compiles the prompt's programs and the first decode step, then the timed run gives prompt
tokens/s (its time to first token) and generated tokens/s (the decode phase, new window buckets'
compilation left out: :class:`kvjax.GenerationResult`). With the persistent compilation cache a
second run compiles almost nothing.
"""

from __future__ import annotations

import pathlib
import sys
import time
from dataclasses import dataclass
from typing import List, TextIO

# jax and kvjax are imported inside the functions: ``python -m kvjax`` builds this parser for every
# subcommand and should not pay for them there

CACHE_TYPES = ("float32", "float16", "bfloat16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
DTYPES = ("float32", "bfloat16", "float16")
#: the smallest attention window in cells (windows double from it; llama.cpp pads its window to 256
#: cells with flash attention): every window bucket is one more program to compile, and for a real
#: model a compile takes seconds to minutes while attending over up to 255 more cells costs a small
#: part of a step
DEFAULT_PADDING = 256


@dataclass
class Report:
    """What one ``generate`` run measured (also returned for tests and benchmarks)."""

    texts: List[str]
    tokens: List[List[int]]
    prompt_tokens: int
    load_seconds: float
    compile_seconds: float
    prompt_tokens_per_second: float
    tokens_per_second: float


def load(path, dtype: str = "float32"):
    """``(model, tokenizer)`` of a checkpoint folder or a ``.gguf`` file.

    Raises:
        ValueError: the path does not exist or is neither; the loaders' own errors otherwise.
    """
    from kvjax.nn._tokenizer import Tokenizer

    p = pathlib.Path(path)
    if not p.exists():
        raise ValueError(f"--model {str(path)!r} does not exist: allowed a Hugging Face checkpoint folder or a "
                         f".gguf file")
    if p.suffix == ".gguf":
        from kvjax.nn._gguf import from_gguf

        return from_gguf(str(p), dtype=dtype), Tokenizer.from_gguf(p)
    if not p.is_dir():
        raise ValueError(f"--model {str(path)!r} is a file: allowed a Hugging Face checkpoint folder or a .gguf file")
    from kvjax.nn._pretrained import from_pretrained

    return from_pretrained(p, dtype=dtype), Tokenizer.from_pretrained(p)


def _check(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"{name} {value!r} is out of range: allowed {allowed}")


def run(model_path, prompt: str, *, n_parallel: int = 1, max_new_tokens: int = 64, temperature: float = 0.0,
        cache_type: str = "float32", ctx: int = 512, seed: int = 0, dtype: str = "float32", n_ubatch: int = 64,
        padding: int = DEFAULT_PADDING, kv_unified: bool = False, out: TextIO = sys.stdout,
        err: TextIO = sys.stderr) -> Report:
    """Load, generate with streaming to ``out``, report to ``err``; the measured :class:`Report`.

    Raises:
        ValueError: a bad argument (named with its allowed values) or a bad checkpoint.
    """
    _check("--n-parallel", n_parallel, isinstance(n_parallel, int) and 1 <= n_parallel <= 64, "an integer in [1, 64]")
    _check("--max-new-tokens", max_new_tokens, isinstance(max_new_tokens, int) and max_new_tokens >= 1,
           "an integer >= 1")
    _check("--temperature", temperature, isinstance(temperature, (int, float)) and temperature >= 0,
           "a number >= 0 (0 is greedy)")
    _check("--cache-type", cache_type, cache_type in CACHE_TYPES, f"one of {list(CACHE_TYPES)}")
    _check("--dtype", dtype, dtype in DTYPES, f"one of {list(DTYPES)}")
    _check("--ctx", ctx, isinstance(ctx, int) and ctx >= 2, "an integer >= 2")
    _check("--ubatch", n_ubatch, isinstance(n_ubatch, int) and n_ubatch >= 1, "an integer >= 1")
    _check("--kv-unified", kv_unified, isinstance(kv_unified, bool), "True or False")
    _check("--padding", padding, isinstance(padding, int) and not isinstance(padding, bool) and padding >= 1,
           "an integer >= 1")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"--prompt {prompt!r} is out of range: allowed a non-empty text")

    import jax
    from flax import nnx

    import kvjax
    from kvjax.engine._engine import Engine, generate
    from kvjax.nn._pretrained import memory_config_for

    t0 = time.perf_counter()
    model, tok = load(model_path, dtype)
    # one matmul for Q/K/V and one for gate/up per block (the same logits; docs/speed.md)
    kvjax.nn.fuse_projections(model)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))   # the weights are on the device: load time
    load_seconds = time.perf_counter() - t0
    ids = tok.encode(prompt)
    if not ids:
        raise ValueError(f"--prompt {prompt!r} gives no tokens: allowed a text the tokenizer encodes")
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise ValueError(f"the tokenizer gives id {max(ids)} for the prompt but the model has vocab_size={vocab}: "
                         f"allowed a tokenizer that matches the model")
    if len(ids) >= ctx:
        raise ValueError(f"--ctx {ctx} is out of range for a prompt of {len(ids)} tokens: allowed > {len(ids)}")

    from kvjax.nn._mamba import Mamba

    overrides = {}
    if isinstance(model, Mamba):
        if cache_type != "float32":
            raise ValueError(f"--cache-type {cache_type!r} is out of range for a Mamba (its states are float32): "
                             f"allowed 'float32'")
    else:
        overrides = dict(k_dtype=cache_type, v_dtype=cache_type, padding=padding)
    mem_cfg = memory_config_for(model, size=ctx * n_parallel, n_seq_max=n_parallel, **overrides)
    if n_parallel > 1 and not kv_unified and isinstance(mem_cfg, kvjax.CacheConfig):
        # llama.cpp's default for several sequences: a stream of ctx cells per sequence, so each
        # sequence attends over its own cells only (the prompt is evaluated once and its stream copied)
        mem_cfg = kvjax.StreamsConfig(memory_config_for(model, size=ctx, n_seq_max=n_parallel, **overrides))
    stop = [i for i in tok.eos_ids if i < vocab]
    options = dict(n_parallel=n_parallel, stop_tokens=stop, n_ctx=ctx, n_keep=min(len(ids), ctx // 4),
                   sampling=kvjax.SamplingConfig(temperature=float(temperature)))
    # warm-up on a memory of its own: the prompt's programs and the first decode step compile here,
    # so the timed run below measures evaluation (new window buckets later are counted apart)
    warm = generate(Engine(model, kvjax.init(mem_cfg), n_ubatch=n_ubatch), [ids], max_new_tokens=min(2, max_new_tokens),
                    key=jax.random.PRNGKey(seed), **options)
    engine = Engine(model, kvjax.init(mem_cfg), n_ubatch=n_ubatch)
    streamer = tok.stream()

    def on_token(seq, token):
        if seq == 0:
            out.write(streamer.push(token))
            out.flush()

    out.write(prompt)
    out.flush()
    result = generate(engine, [ids], max_new_tokens=max_new_tokens, key=jax.random.PRNGKey(seed), on_token=on_token,
                      **options)
    out.write(streamer.flush() + "\n")
    texts = [tok.decode(t) for t in result.tokens]
    for i in range(1, len(texts)):
        out.write(f"\n[{i}] {prompt}{texts[i]}\n")
    out.flush()

    compile_seconds = warm.compile_seconds + result.compile_seconds
    prompt_tps = result.prompt_tokens / max(result.time_to_first_token, 1e-9)
    n_gen = sum(len(t) for t in result.tokens)
    report = Report(texts, result.tokens, result.prompt_tokens, load_seconds, compile_seconds, prompt_tps,
                    result.steady_tokens_per_second)
    cfg = model.config
    n_shift = result.context_shifts
    shifts = f"; {n_shift} context shift{'s' if n_shift != 1 else ''}" if n_shift else ""
    windows = f", windows from {padding} cells" if "padding" in overrides else ""
    err.write(f"model: {type(model).__name__} {cfg.n_layer} layers, width {cfg.d_model}, vocab {vocab}, "
              f"{dtype}; memory: {type(mem_cfg).__name__} ({cache_type} K/V, {ctx} positions x {n_parallel} "
              f"sequences{windows})\n")
    err.write(f"load {load_seconds:.2f} s; compile {compile_seconds:.2f} s ({warm.compiles + result.compiles} "
              f"programs, in a warm-up run and apart from the speeds)\n")
    n_seq = len(result.tokens)
    err.write(f"prompt: {result.prompt_tokens} tokens, {prompt_tps:.1f} tokens/s; generated: {n_gen} tokens over "
              f"{n_seq} sequence{'s' if n_seq != 1 else ''}, {result.steady_tokens_per_second:.1f} tokens/s{shifts}\n")
    err.flush()
    return report


def main(argv_args) -> int:
    """The subcommand's entry (``argv_args``: the parsed ``argparse`` namespace)."""
    a = argv_args
    try:
        run(a.model, a.prompt, n_parallel=a.n_parallel, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
            cache_type=a.cache_type, ctx=a.ctx, seed=a.seed, dtype=a.dtype, n_ubatch=a.ubatch, padding=a.padding,
            kv_unified=a.kv_unified)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    """Add the ``generate`` subcommand to an ``argparse`` subparsers object."""
    g = sub.add_parser("generate", help="generate text from a checkpoint folder (or .gguf), streamed, with the speed")
    g.add_argument("--model", required=True, help="a Hugging Face checkpoint folder (config.json, *.safetensors, "
                                                  "tokenizer.json) or a .gguf file")
    g.add_argument("--prompt", required=True, help="the prompt text")
    g.add_argument("--n-parallel", type=int, default=1, help="continuations sampled in parallel (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per sequence (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 is greedy (default 0)")
    g.add_argument("--cache-type", default="float32", choices=CACHE_TYPES, help="K/V storage type (default float32)")
    g.add_argument("--dtype", default="float32", choices=DTYPES, help="weights' dtype (default float32)")
    g.add_argument("--ctx", type=int, default=512, help="positions per sequence before a context shift (default 512)")
    g.add_argument("--ubatch", type=int, default=64, help="most tokens per ubatch (default 64)")
    g.add_argument("--padding", type=int, default=DEFAULT_PADDING,
                   help=f"the smallest attention window in cells, windows double from it: larger, fewer programs "
                        f"to compile (default {DEFAULT_PADDING}, llama.cpp's)")
    g.add_argument("--kv-unified", action="store_true",
                   help="with --n-parallel > 1, one K/V buffer shared by every sequence (default: one stream "
                        "of --ctx cells per sequence, llama.cpp's default; models with window layers always "
                        "share one)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
