"""``python -m kvjax generate``: text from a real checkpoint, streamed, with the speed reported.

Loads a Hugging Face folder (:func:`kvjax.nn.from_pretrained`) or a ``.gguf`` file
(:func:`kvjax.nn.from_gguf`), tokenizes the prompt with the checkpoint's tokenizer, runs
:func:`kvjax.generate` on the memory the model needs (:func:`kvjax.nn.memory_config_for`; with
``--n-parallel`` above 1 a stream per sequence, :class:`kvjax.StreamsConfig`, as llama.cpp does
unless ``--kv-unified``; attention windows from ``--padding`` cells) and prints sequence 0's
text as its tokens come (the other ``--n-parallel`` sequences at the end).
With ``--chat`` the prompt is the user's turn of a conversation (``--system`` a system message
before it), rendered by the model's chat template (``--chat-template`` a built-in name or a Jinja
file for a model that has none; ``docs/chat_templates.md``) and only the reply is printed;
``--interactive`` goes on with each line of standard input as the next user turn.
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
from dataclasses import dataclass, field
from typing import List, Optional, TextIO, Tuple
from kvjax.nn._tokenizer import Tokenizer
from kvjax.nn._gguf import from_gguf
from kvjax.nn._pretrained import from_pretrained
from kvjax.nn._ggml_linear import GGMLEmbed, GGMLLinear
from kvjax.nn._chat_template import BUILTIN_TEMPLATES
import kvjax
from kvjax import Engine, generate
from kvjax.nn._pretrained import memory_config_for
from kvjax.nn._mamba import Mamba
import jax
from flax import nnx
import argparse

# jax and kvjax are imported inside the functions: ``python -m kvjax`` builds this parser for every
# subcommand and should not pay for them there

CACHE_TYPES = ("float32", "float16", "bfloat16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
DTYPES = ("float32", "bfloat16", "float16")
#: the --dtype values: a float dtype, or "file" for a GGUF's own block types (kept compact)
WEIGHT_DTYPES = DTYPES + ("file",)
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
    #: the text the model was given (with ``--chat``: the rendered conversation) and its token ids
    prompt_text: str = ""
    prompt_ids: List[int] = field(default_factory=list)
    #: with ``--chat``: the conversation at the end (system, user and assistant messages) and each
    #: turn's reply (one turn, or several with ``--interactive``; the speeds above are the first's)
    conversation: List[dict] = field(default_factory=list)
    replies: List[str] = field(default_factory=list)
    #: prompt tokens evaluated at each turn (with ``--cache-ram`` a turn evaluates only what the
    #: prompt cache does not hold of its conversation)
    turn_prompt_tokens: List[int] = field(default_factory=list)


def load(path, dtype: str = "float32"):
    """``(model, tokenizer)`` of a checkpoint folder or a ``.gguf`` file.

    Raises:
        ValueError: the path does not exist or is neither; the loaders' own errors otherwise.
    """
    p = pathlib.Path(path)
    if dtype == "file" and p.suffix != ".gguf":
        raise ValueError(
            f"--dtype 'file' keeps a .gguf file's block types: allowed for a .gguf --model, not "
            f"{str(path)!r} (a folder loads as one of {list(DTYPES)})"
        )
    if not p.exists():
        raise ValueError(
            f"--model {str(path)!r} does not exist: allowed a Hugging Face checkpoint folder or a .gguf file"
        )
    if p.suffix == ".gguf":
        return from_gguf(str(p), dtype=None if dtype == "file" else dtype), Tokenizer.from_gguf(p)
    if not p.is_dir():
        raise ValueError(f"--model {str(path)!r} is a file: allowed a Hugging Face checkpoint folder or a .gguf file")

    return from_pretrained(p, dtype=dtype), Tokenizer.from_pretrained(p)


def _weights_label(model, dtype: str) -> str:
    """``dtype``, or for ``"file"`` the block types the model keeps (``"weights in Q4_K, Q6_K, Q8_0"``)."""
    if dtype != "file":
        return dtype

    kinds = sorted({m.type_name for _, m in nnx.iter_modules(model) if isinstance(m, (GGMLLinear, GGMLEmbed))})
    return f"weights in the file's {', '.join(kinds)}" if kinds else "float32 weights (the file's own)"


def _check(name, value, ok, allowed):
    if not ok:
        raise ValueError(f"{name} {value!r} is out of range: allowed {allowed}")


def resolve_chat_template(tok, chat_template: Optional[str] = None) -> str:
    """The Jinja text ``--chat`` renders: ``chat_template`` (a built-in name or a Jinja file), else the
    tokenizer's own (``tok.chat_template``, read from the model file).

    A built-in name wins over a file of the same name (llama.cpp's ``--chat-template`` takes names
    too).

    Raises:
        ValueError: an unknown name and no such file, an unreadable file, or no template at all.
    """
    names = sorted(BUILTIN_TEMPLATES)
    if chat_template is not None:
        if not isinstance(chat_template, str) or not chat_template:
            raise ValueError(
                f"--chat-template {chat_template!r} is out of range: allowed one of {names} or the path of a Jinja file"
            )
        if chat_template in BUILTIN_TEMPLATES:
            return BUILTIN_TEMPLATES[chat_template]
        path = pathlib.Path(chat_template)
        if not path.is_file():
            raise ValueError(
                f"--chat-template {chat_template!r} is neither a built-in template nor a file: allowed "
                f"one of {names} or the path of a Jinja file"
            )
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(
                f"--chat-template {chat_template!r} cannot be read ({e}): allowed a UTF-8 Jinja file"
            ) from None
        if not text.strip():
            raise ValueError(f"--chat-template {chat_template!r} is an empty file: allowed a Jinja chat template")
        return text
    own = tok.chat_template  # a folder's named templates are already resolved to one (its "default")
    if not own or not own.strip():
        raise ValueError(
            f"--chat needs a chat template and the model file has none: allowed --chat-template with "
            f"one of {names} or the path of a Jinja file"
        )
    return own


#: the token that ends the assistant's turn in each built-in template: with ``--chat-template NAME``
#: generation stops there too (a file without a template often lists no end-of-turn id among its
#: EOS ids; llama.cpp likewise stops at the template's end of turn)
TURN_ENDS = {"chatml": "<|im_end|>", "gemma": "<end_of_turn>", "llama3": "<|eot_id|>", "mistral": None}


def chat_stop_ids(tok, chat_template: Optional[str]) -> List[int]:
    """The EOS ids plus, for a built-in ``chat_template``, its end-of-turn token's id when the
    vocabulary has it as one token."""
    ids = list(tok.eos_ids)
    text = TURN_ENDS.get(chat_template) if isinstance(chat_template, str) else None
    if text is not None:
        i = tok.backend.token_to_id(text)
        if i is not None and i not in ids:
            ids.append(i)
    return ids


def encode_chat_text(tok, text: str, add_bos: Optional[bool] = None) -> List[int]:
    """The ids of rendered chat text, its special-token texts (``<start_of_turn>``) read as those
    tokens, as llama.cpp (``parse_special``) and transformers tokenize a chat prompt."""
    return tok.encode(text, add_bos=add_bos, special=True)


def chat_prompt(tok, messages, template: str):
    """``(text, ids)`` of a conversation rendered with ``template``, ready to generate the reply.

    The text is rendered with the generation prompt and tokenized with its special-token texts
    (:func:`encode_chat_text`). BOS is not doubled, by llama.cpp's rule: when the tokenizer adds
    BOS and the text starts with the BOS text (the template wrote it), that text is cut and the
    tokenizer's BOS id put first, once; a template without BOS gets the tokenizer's, as any prompt.

    Raises:
        ValueError: bad messages, or the template's own error (see :func:`kvjax.nn._chat_template.render_chat_template`).
    """
    text = tok.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
    bos = tok.special_texts()[0]
    if tok.add_bos and bos and text.startswith(bos):
        return text, encode_chat_text(tok, text[len(bos) :], add_bos=True)
    return text, encode_chat_text(tok, text)


def run(
    model_path,
    prompt: str,
    *,
    n_parallel: int = 1,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    cache_type: str = "float32",
    ctx: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    n_ubatch: int = 64,
    padding: int = DEFAULT_PADDING,
    kv_unified: bool = False,
    chat: bool = False,
    system: Optional[str] = None,
    chat_template: Optional[str] = None,
    interactive: bool = False,
    max_turns: int = 16,
    cache_ram: int = 0,
    sink_window: Optional[Tuple[int, int]] = None,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    inp: TextIO = sys.stdin,
) -> Report:
    """Load, generate with streaming to ``out``, report to ``err``; the measured :class:`Report`.

    With ``chat`` the prompt is the user's turn (after a ``system`` message when given), rendered
    by the chat template (``chat_template``: a built-in name or a Jinja file, else the model
    file's own) with the assistant's turn opened; ``out`` then gets the reply only. With
    ``interactive`` each further line of ``inp`` is the user's next turn (after a ``> `` prompt on
    ``out``), answered with the whole conversation as the prompt, until the end of ``inp``, an
    empty line or ``max_turns`` user turns in all.

    With ``cache_ram`` (MiB, llama.cpp's ``--cache-ram``) the turns share one memory and a
    :class:`kvjax.PromptCache` with a host tier of that many MiB: when a turn ends its sequence
    moves to host memory (its cells freed, llama.cpp's ``--cache-idle-slots``), and the next turn
    brings it back and evaluates only the tokens the conversation added. Nothing is shifted then,
    so a turn's prompt and ``max_new_tokens`` must fit in ``ctx`` positions.

    With ``sink_window = (n_sink, n_recent)`` each sequence keeps its first ``n_sink`` and latest
    ``n_recent`` tokens (:class:`kvjax.SinkWindow`, StreamingLLM: the oldest other token leaves as
    each one is placed, the rest re-rotated to compacted positions), in ``n_sink + n_recent``
    cells per sequence instead of ``ctx``: generation runs as long as ``max_new_tokens`` asks.

    Raises:
        ValueError: a bad argument (named with its allowed values) or a bad checkpoint.
    """
    _check("--n-parallel", n_parallel, isinstance(n_parallel, int) and 1 <= n_parallel <= 64, "an integer in [1, 64]")
    _check(
        "--max-new-tokens", max_new_tokens, isinstance(max_new_tokens, int) and max_new_tokens >= 1, "an integer >= 1"
    )
    _check(
        "--temperature",
        temperature,
        isinstance(temperature, (int, float)) and temperature >= 0,
        "a number >= 0 (0 is greedy)",
    )
    _check("--cache-type", cache_type, cache_type in CACHE_TYPES, f"one of {list(CACHE_TYPES)}")
    _check("--dtype", dtype, dtype in WEIGHT_DTYPES, f"one of {list(WEIGHT_DTYPES)}")
    _check("--ctx", ctx, isinstance(ctx, int) and ctx >= 2, "an integer >= 2")
    _check("--ubatch", n_ubatch, isinstance(n_ubatch, int) and n_ubatch >= 1, "an integer >= 1")
    _check("--kv-unified", kv_unified, isinstance(kv_unified, bool), "True or False")
    _check(
        "--padding",
        padding,
        isinstance(padding, int) and not isinstance(padding, bool) and padding >= 1,
        "an integer >= 1",
    )
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"--prompt {prompt!r} is out of range: allowed a non-empty text")
    _check("--chat", chat, isinstance(chat, bool), "True or False")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"--system {system!r} is out of range: allowed a text")
    for flag, value in (("--system", system), ("--chat-template", chat_template)):
        if value is not None and not chat:
            raise ValueError(f"{flag} is out of range without --chat: allowed together with --chat")
    _check("--interactive", interactive, isinstance(interactive, bool), "True or False")
    if interactive and not chat:
        raise ValueError("--interactive is out of range without --chat: allowed together with --chat")
    if interactive and n_parallel != 1:
        raise ValueError(f"--n-parallel {n_parallel} is out of range with --interactive: allowed 1")
    _check(
        "--max-turns",
        max_turns,
        isinstance(max_turns, int) and not isinstance(max_turns, bool) and max_turns >= 1,
        "an integer >= 1",
    )
    _check(
        "--cache-ram",
        cache_ram,
        isinstance(cache_ram, int) and not isinstance(cache_ram, bool) and 0 <= cache_ram <= 2**40,
        "an integer number of MiB >= 0 (0: no prompt cache)",
    )
    if cache_ram and n_parallel != 1:
        raise ValueError(
            f"--n-parallel {n_parallel} is out of range with --cache-ram: allowed 1 (a cached request is one sequence)"
        )
    if sink_window is not None:
        ok = (
            isinstance(sink_window, tuple)
            and len(sink_window) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in sink_window)
            and sink_window[0] >= 0
            and sink_window[1] >= 1
        )
        _check("--sink-window", sink_window, ok, "N_SINK,N_RECENT with N_RECENT >= 1 and N_SINK >= 0")
        if cache_ram:
            raise ValueError(
                "--sink-window is out of range with --cache-ram: allowed one of them (a window "
                "evicts what a prompt cache would reuse)"
            )
    # a bad --chat-template fails before the model loads (the model's own is read with its tokenizer)
    template = resolve_chat_template(None, chat_template) if chat_template is not None else None

    t0 = time.perf_counter()
    model, tok = load(model_path, dtype)
    # one matmul for Q/K/V and one for gate/up per block (the same logits; docs/speed.md)
    kvjax.nn.fuse_projections(model)
    jax.block_until_ready(jax.tree.leaves(nnx.state(model)))  # the weights are on the device: load time
    load_seconds = time.perf_counter() - t0
    messages = []
    if chat:
        template = template if template is not None else resolve_chat_template(tok)
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": prompt}
        ]
        text, ids = chat_prompt(tok, messages, template)
    else:
        text, ids = prompt, tok.encode(prompt)
    shown = "" if chat else prompt  # what the output starts with: a chat prints the reply only
    if not ids:
        raise ValueError(f"--prompt {prompt!r} gives no tokens: allowed a text the tokenizer encodes")
    vocab = model.config.vocab_size
    if max(ids) >= vocab:
        raise ValueError(
            f"the tokenizer gives id {max(ids)} for the prompt but the model has vocab_size={vocab}: "
            f"allowed a tokenizer that matches the model"
        )
    window = kvjax.SinkWindow(*sink_window) if sink_window is not None else None
    if window is not None:
        ctx = window.n_cells  # the cells per sequence: the window replaces the context

    def check_prompt(n_prompt, turn=1):
        """A turn's prompt of ``n_prompt`` tokens fits the memory (and, with --cache-ram, its reply)."""
        what = f"the conversation of {n_prompt} tokens at turn {turn}" if turn > 1 else f"a prompt of {n_prompt} tokens"
        if window is not None and n_prompt > ctx:
            raise ValueError(
                f"--sink-window {window.n_sink},{window.n_recent} is out of range for {what}: allowed "
                f"N_SINK + N_RECENT >= {n_prompt}"
            )
        if window is None and n_prompt >= ctx:
            raise ValueError(f"--ctx {ctx} is out of range for {what}: allowed > {n_prompt}")
        # with a prompt cache nothing is shifted: the prompt and its whole reply take cells
        if cache_ram and n_prompt + max_new_tokens > ctx:
            raise ValueError(
                f"--max-new-tokens {max_new_tokens} is out of range with --cache-ram and {what}: "
                f"allowed <= {ctx - n_prompt} (nothing is shifted with a prompt cache: raise --ctx, "
                f"or leave --cache-ram out for context shifts)"
            )

    check_prompt(len(ids))

    overrides = {}
    if isinstance(model, Mamba):
        if cache_type != "float32":
            raise ValueError(
                f"--cache-type {cache_type!r} is out of range for a Mamba (its states are float32): allowed 'float32'"
            )
    else:
        overrides = dict(k_dtype=cache_type, v_dtype=cache_type, padding=padding)
    if window is not None and isinstance(model, Mamba):
        raise ValueError(
            "--sink-window is out of range for a Mamba: its state is not made of cells to evict; "
            "allowed with attention models"
        )
    # with a prompt cache a second sequence id takes a turn whose prompt differs from the parked
    # conversation (their cells shared as far as they agree)
    mem_cfg = memory_config_for(
        model, size=ctx * n_parallel, n_seq_max=n_parallel + (1 if cache_ram else 0), **overrides
    )
    if n_parallel > 1 and not kv_unified and isinstance(mem_cfg, kvjax.CacheConfig):
        # llama.cpp's default for several sequences: a stream of ctx cells per sequence, so each
        # sequence attends over its own cells only (the prompt is evaluated once and its stream copied)
        mem_cfg = kvjax.StreamsConfig(memory_config_for(model, size=ctx, n_seq_max=n_parallel, **overrides))
    stop = [i for i in (chat_stop_ids(tok, chat_template) if chat else tok.eos_ids) if i < vocab]
    options = dict(
        n_parallel=n_parallel, stop_tokens=stop, sampling=kvjax.SamplingConfig(temperature=float(temperature))
    )

    def context(n_prompt, cache):
        # what replaces running out of context: the prompt cache's parked turns (nothing shifted),
        # the sink window's evictions, or else a context shift (n_ctx, n_keep)
        if cache is not None:
            return dict(prompt_cache=cache)
        if window is not None:
            return dict(window=window)
        return dict(n_ctx=ctx, n_keep=min(n_prompt, ctx // 4))

    def new_prompt_cache():
        if not cache_ram:
            return None
        return kvjax.PromptCache(mem_cfg.n_seq_max, ctx, host_bytes=cache_ram * 2**20, idle_to_host=True)

    # warm-up on a memory of its own: the prompt's programs and the first decode step compile here,
    # so the timed run below measures evaluation (new window buckets later are counted apart)
    warm = generate(
        Engine(model, kvjax.init(mem_cfg), n_ubatch=n_ubatch),
        [ids],
        max_new_tokens=min(2, max_new_tokens),
        key=jax.random.PRNGKey(seed),
        **context(len(ids), new_prompt_cache()),
        **options,
    )
    engine = Engine(model, kvjax.init(mem_cfg), n_ubatch=n_ubatch)
    cache = new_prompt_cache()
    streamer = [tok.stream()]  # one per turn

    def on_token(seq, token):
        if seq == 0:
            out.write(streamer[0].push(token))
            out.flush()

    out.write(shown)
    out.flush()
    result = generate(
        engine,
        [ids],
        max_new_tokens=max_new_tokens,
        key=jax.random.PRNGKey(seed),
        on_token=on_token,
        **context(len(ids), cache),
        **options,
    )
    turn_prompt_tokens = [result.prompt_tokens]
    out.write(streamer[0].flush() + "\n")
    texts = [tok.decode(t) for t in result.tokens]
    for i in range(1, len(texts)):
        out.write(f"\n[{i}] {shown}{texts[i]}\n")
    out.flush()
    replies = [texts[0]] if chat else []
    if chat:
        messages.append({"role": "assistant", "content": texts[0]})
    for turn in range(2, max_turns + 1) if interactive else ():
        # the next user turn; the whole conversation is the prompt, of a fresh memory (the programs
        # compiled above are cached across engines and reused; a longer conversation may add a
        # larger window bucket's), or with --cache-ram of the one memory, where the prompt cache
        # brings the conversation so far back from the host
        out.write("> ")
        out.flush()
        line = inp.readline()
        if not line.strip():  # the end of the input, or an empty line: the chat is over
            if not line:  # the input ended after the prompt (no newline was typed)
                out.write("\n")
                out.flush()
            break
        messages.append({"role": "user", "content": line.rstrip("\r\n")})
        _, turn_ids = chat_prompt(tok, messages, template)
        check_prompt(len(turn_ids), turn)
        streamer[0] = tok.stream()
        turn_engine = engine if cache_ram else Engine(model, kvjax.init(mem_cfg), n_ubatch=n_ubatch)
        answer = generate(
            turn_engine,
            [turn_ids],
            max_new_tokens=max_new_tokens,
            key=jax.random.fold_in(jax.random.PRNGKey(seed), turn),
            on_token=on_token,
            **context(len(turn_ids), cache),
            **options,
        )
        turn_prompt_tokens.append(answer.prompt_tokens)
        out.write(streamer[0].flush() + "\n")
        out.flush()
        replies.append(tok.decode(answer.tokens[0]))
        messages.append({"role": "assistant", "content": replies[-1]})

    compile_seconds = warm.compile_seconds + result.compile_seconds
    prompt_tps = result.prompt_tokens / max(result.time_to_first_token, 1e-9)
    n_gen = sum(len(t) for t in result.tokens)
    report = Report(
        texts,
        result.tokens,
        result.prompt_tokens,
        load_seconds,
        compile_seconds,
        prompt_tps,
        result.steady_tokens_per_second,
        prompt_text=text,
        prompt_ids=list(ids),
        conversation=messages,
        replies=replies,
        turn_prompt_tokens=turn_prompt_tokens,
    )
    cfg = model.config
    n_shift = result.context_shifts
    shifts = f"; {n_shift} context shift{'s' if n_shift != 1 else ''}" if n_shift else ""
    windows = f", windows from {padding} cells" if "padding" in overrides else ""
    err.write(
        f"model: {type(model).__name__} {cfg.n_layer} layers, width {cfg.d_model}, vocab {vocab}, "
        f"{_weights_label(model, dtype)}; memory: {type(mem_cfg).__name__} ({cache_type} K/V, {ctx} positions x {n_parallel} "
        f"sequences{windows})\n"
    )
    err.write(
        f"load {load_seconds:.2f} s; compile {compile_seconds:.2f} s ({warm.compiles + result.compiles} "
        f"programs, in a warm-up run and apart from the speeds)\n"
    )
    n_seq = len(result.tokens)
    err.write(
        f"prompt: {result.prompt_tokens} tokens, {prompt_tps:.1f} tokens/s; generated: {n_gen} tokens over "
        f"{n_seq} sequence{'s' if n_seq != 1 else ''}, {result.steady_tokens_per_second:.1f} tokens/s{shifts}\n"
    )
    if cache is not None:
        held = sum(len(cache.host.entry(k).tokens) for k in cache.host.keys())
        n_turns = len(turn_prompt_tokens)
        err.write(
            f"prompt cache: {n_turns} turn{'s' if n_turns != 1 else ''}, {sum(turn_prompt_tokens)} prompt "
            f"tokens evaluated; host tier {cache.host.nbytes / 2**20:.2f} "
            f"of {cache_ram} MiB ({held} tokens), {cache.offloads} moves out, {cache.restores} back\n"
        )
    err.flush()
    return report


def _sink_window_arg(text: str) -> Tuple[int, int]:
    """``--sink-window``'s ``N_SINK,N_RECENT`` as two integers (the ranges are checked by :func:`run`)."""
    try:
        n_sink, n_recent = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is out of range: allowed N_SINK,N_RECENT, two integers (for example 4,252)"
        ) from None
    return n_sink, n_recent


def main(argv_args) -> int:
    """The subcommand's entry (``argv_args``: the parsed ``argparse`` namespace)."""
    a = argv_args
    try:
        run(
            a.model,
            a.prompt,
            n_parallel=a.n_parallel,
            max_new_tokens=a.max_new_tokens,
            temperature=a.temperature,
            cache_type=a.cache_type,
            ctx=a.ctx,
            seed=a.seed,
            dtype=a.dtype,
            n_ubatch=a.ubatch,
            padding=a.padding,
            kv_unified=a.kv_unified,
            chat=a.chat,
            system=a.system,
            chat_template=a.chat_template,
            interactive=a.interactive,
            max_turns=a.max_turns,
            cache_ram=a.cache_ram,
            sink_window=a.sink_window,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parser(sub) -> None:
    """Add the ``generate`` subcommand to an ``argparse`` subparsers object."""
    g = sub.add_parser("generate", help="generate text from a checkpoint folder (or .gguf), streamed, with the speed")
    g.add_argument(
        "--model",
        required=True,
        help="a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json) or a .gguf file",
    )
    g.add_argument("--prompt", required=True, help="the prompt text (with --chat: the user's message)")
    g.add_argument(
        "--chat",
        action="store_true",
        help="chat: the prompt is the user's turn, rendered with the model's chat template and the "
        "assistant's turn opened; only the reply is printed",
    )
    g.add_argument("--system", default=None, help="with --chat, a system message before the user's turn")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="NAME_OR_FILE",
        help="with --chat, the template to use instead of the model file's (needed when it has none): "
        "a built-in (chatml, gemma, llama3, mistral) or the path of a Jinja file",
    )
    g.add_argument(
        "--interactive",
        action="store_true",
        help="with --chat, go on chatting: each line of standard input is the next user turn (an empty "
        "line or the end of the input ends the chat)",
    )
    g.add_argument(
        "--max-turns",
        type=int,
        default=16,
        help="with --interactive, the most user turns in all, the --prompt one included (default 16)",
    )
    g.add_argument("--n-parallel", type=int, default=1, help="continuations sampled in parallel (default 1)")
    g.add_argument("--max-new-tokens", type=int, default=64, help="most tokens generated per sequence (default 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 is greedy (default 0)")
    g.add_argument("--cache-type", default="float32", choices=CACHE_TYPES, help="K/V storage type (default float32)")
    g.add_argument(
        "--dtype",
        default="float32",
        choices=WEIGHT_DTYPES,
        help="weights' dtype (default float32, the fastest on CPU); 'file' keeps a .gguf file's own "
        "block types resident (Q4_K, Q8_0, ...: about the file's size in memory)",
    )
    g.add_argument("--ctx", type=int, default=512, help="positions per sequence before a context shift (default 512)")
    g.add_argument("--ubatch", type=int, default=64, help="most tokens per ubatch (default 64)")
    g.add_argument(
        "--padding",
        type=int,
        default=DEFAULT_PADDING,
        help=f"the smallest attention window in cells, windows double from it: larger, fewer programs "
        f"to compile (default {DEFAULT_PADDING}, llama.cpp's)",
    )
    g.add_argument(
        "--kv-unified",
        action="store_true",
        help="with --n-parallel > 1, one K/V buffer shared by every sequence (default: one stream "
        "of --ctx cells per sequence, llama.cpp's default; models with window layers always "
        "share one)",
    )
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    g.add_argument(
        "--cache-ram",
        type=int,
        default=0,
        metavar="MIB",
        help="a prompt cache with a host-memory tier of MIB MiB (llama.cpp's --cache-ram): each turn's "
        "sequence moves to host memory when it ends and the next --interactive turn evaluates only "
        "what the conversation added; nothing is shifted, so prompt + --max-new-tokens must fit "
        "--ctx (default 0: no prompt cache)",
    )
    g.add_argument(
        "--sink-window",
        type=_sink_window_arg,
        default=None,
        metavar="N_SINK,N_RECENT",
        help="keep each sequence's first N_SINK and latest N_RECENT tokens (StreamingLLM; the rest "
        "re-rotated to compacted positions), in N_SINK + N_RECENT cells instead of --ctx: "
        "generation runs as long as --max-new-tokens asks",
    )
