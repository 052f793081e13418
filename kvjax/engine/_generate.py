"""The generation loop users write around the decode driver: :func:`generate` and :func:`generate_stream`.

Several prompts at once, a shared prompt prefix evaluated once and shared with ``seq_cp``,
parallel sampling of n continuations of one prompt, greedy/temperature/top-k/top-p sampling with
an explicit key, stop tokens and length limits, streaming, a context shift when a sequence reaches
its context limit, a prompt cache, a sink + window memory, speculative decoding. A request runs in
three steps, each a function here: the whole request is checked before anything is placed
(:func:`_check_request`: a failed call changes nothing), the prompts are evaluated
(:func:`_prefill`), and the decode loop runs, on the device where it can (:func:`_decode`).

Example:
    >>> import jax, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    >>> engine = kvjax.Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=64, n_seq_max=2)))
    >>> out = generate(engine, [[1, 2, 3], [4, 5]], max_new_tokens=4, key=jax.random.PRNGKey(0),
    ...                sampling=kvjax.SamplingConfig(temperature=0))
    >>> [len(t) for t in out.tokens], int(kvjax.used_cells(engine.cache))
    ([4, 4], 11)
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, List, Optional, Sequence, Set, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax._compiles import CompileCounter, total_compile_seconds
from kvjax._validate import check_count, check_flag
from kvjax.engine._device_loop import check_sync_every, device_sampling_exact, run_segment, stop_bucket
from kvjax import Engine
from kvjax.engine._prompt_cache import PromptCache
from kvjax.engine._sampling import SamplingConfig, sample
from kvjax.engine._speculative import check_draft, speculative_stream
from kvjax.memory._sink_window import SinkWindow, check_window_memory, sink_window_evict
from kvjax.memory._streams import StreamCache

__all__ = ["GenerationResult", "generate", "generate_stream", "MAX_NEW_TOKENS"]

#: The most tokens one generate call may ask for per sequence: its counters and positions are int32,
#: and a context shift keeps positions below the end of their range however long it runs.
MAX_NEW_TOKENS = 2**30


@dataclasses.dataclass
class GenerationResult:
    """What :func:`generate` returns.

    Attributes:
        tokens: the generated tokens of each sequence (prompt excluded).
        prompt_tokens: tokens evaluated for the prompts (a shared prefix counts once).
        time_to_first_token: seconds from the start to the first sampled token.
        seconds: total seconds.
        context_shifts: how many context shifts happened.
        compiles: XLA compilations during the call.
        compile_seconds: seconds of it spent tracing, lowering and compiling programs.
        drafted: speculative decoding: tokens the draft model proposed.
        accepted: speculative decoding: drafted tokens the target kept.
        decode_compile_seconds: the part of ``compile_seconds`` after the first token (new window
            buckets), which :attr:`steady_tokens_per_second` leaves out.
        dispatches: device-loop dispatches (0 when the host loop ran every step).
    """

    tokens: List[List[int]]
    prompt_tokens: int
    time_to_first_token: float
    seconds: float
    context_shifts: int
    compiles: int
    compile_seconds: float = 0.0
    decode_compile_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    dispatches: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Speculative decoding: the share of drafted tokens the target kept (0 without a draft)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second over the decode phase (after the first token)."""
        n = sum(len(t) for t in self.tokens) - len(self.tokens)
        return n / max(self.seconds - self.time_to_first_token, 1e-9)

    @property
    def steady_tokens_per_second(self) -> float:
        """Generated tokens per second over the decode phase, compile time left out."""
        n = sum(len(t) for t in self.tokens) - len(self.tokens)
        return n / max(self.seconds - self.time_to_first_token - self.decode_compile_seconds, 1e-9)


def _common_prefix(prompts: Sequence[Sequence[int]]) -> int:
    n = min(len(p) for p in prompts)
    for i in range(n):
        if any(p[i] != prompts[0][i] for p in prompts):
            return i
    return n


def check_prompts(prompts, vocab_size: Optional[int], name: str = "prompts", allow_empty: bool = False):
    """Token lists of real integers in ``[0, vocab_size)`` (floats and bools refused, not truncated)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"{name} must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(
                f"{name}[{i}] has shape {arr.shape} and dtype {arr.dtype}: allowed a list of integer token ids"
            )
        if not arr.size and not allow_empty:
            raise ValueError(f"{name}[{i}] is empty: allowed non-empty token lists")
        if arr.size and vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
            bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
            raise ValueError(f"{name}[{i}] contains {bad}: allowed ids in [0, {vocab_size})")
        out.append([int(t) for t in arr])
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty: allowed at least one prompt")
    return out


def _check_key(key) -> None:
    """A PRNG key: ``jax.random.PRNGKey(seed)`` (``u32[2]``) or ``jax.random.key(seed)``."""
    ok = isinstance(key, jax.Array) and (
        jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
        and key.shape == ()
        or key.dtype == jnp.uint32
        and key.shape == (2,)
    )
    if not ok:
        raise ValueError(
            f"key must be a jax PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got "
            f"{type(key).__name__} {getattr(key, 'dtype', '')}{list(getattr(key, 'shape', ()))}"
        )


def generate_stream(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens,
    key: jax.Array,
    sampling: SamplingConfig = SamplingConfig(),
    n_parallel: int = 1,
    share_prefix: bool = True,
    stop_tokens: Sequence[int] = (),
    n_ctx: Optional[int] = None,
    n_keep: int = 0,
    draft: Optional["Engine"] = None,
    n_draft: int = 4,
    prompt_cache: Optional[PromptCache] = None,
    device_loop: bool = True,
    sync_every: int = 32,
    window: Optional[SinkWindow] = None,
    stats: Optional[dict] = None,
) -> Iterator[Tuple[int, int]]:
    """Generate for several sequences at once, yielding ``(sequence index, token)`` as tokens come.

    Args:
        engine: the engine; its cache must hold no cells of sequences ``0..n-1`` (checked).
        prompts: one token list per sequence; or one prompt with ``n_parallel > 1``.
        max_new_tokens: most tokens generated per sequence: an int for all, or a list with one
            int per sequence (not with ``draft``).
        key: PRNG key for sampling.
        sampling: the sampling rule (greedy with ``temperature=0``).
        n_parallel: continuations of a single prompt sampled in parallel (sequence ``i`` for
            continuation ``i``; the prompt is evaluated once and shared with ``seq_cp``).
        share_prefix: with several prompts, evaluate their longest common prefix once (in
            sequence 0) and share it with ``seq_cp``.
        stop_tokens: a sequence ends after emitting one of these.
        n_ctx: per-sequence context limit (default and maximum ``cache.context_per_sequence(n_seq)``:
            ``size // n_seq`` for one shared cache, a stream's cells with per-sequence streams; so no sequence
            can run out of cells); when a sequence's next position reaches it, a context shift
            keeps ``n_keep`` tokens and discards half of the rest (llama.cpp's rule).
        n_keep: tokens kept at the start on a context shift.
        draft: speculative decoding: an :class:`Engine` of a (smaller) draft model with the same
            vocabulary and a memory of its own; it proposes ``n_draft`` tokens per sequence and
            round, the target checks them in one batch and the rejected ones are rolled back from
            both memories (``kvjax.engine._speculative``). The tokens are the target's: exactly its
            greedy output with ``temperature=0``, distributed as its samples otherwise. Not with
            ``n_parallel``, ``share_prefix`` sharing or context shifts.
        n_draft: tokens proposed per round, in ``[1, 64]`` (a recurrent memory needs ``n_states``
            above it to roll back).
        prompt_cache: a :class:`kvjax.PromptCache` of this engine's memory: each prompt gets a free
            sequence id (not 0..n-1), reuses the longest parked prefix, and stays parked when
            generation ends (its id is ``stats["seq_ids"]``); least recently used parked sequences
            are evicted when the request would not fit (to its host tier, if it has one, from
            where a better match comes back; with ``idle_to_host`` every parked sequence moves
            there when the request ends). Not with ``n_parallel``, a draft or context shifts
            (``n_ctx``, ``n_keep``).
        device_loop: run the decode loop on the device (``kvjax/engine/_device_loop.py``): many
            tokens per dispatch, the host reading them every ``sync_every`` tokens or when it must
            act (a sequence stops, a context shift, a new window bucket, pending work), with the
            same tokens as the host loop for the same key. The host loop runs instead (False, or
            where the device loop cannot: a ``draft``, more live sequences than
            ``engine.n_ubatch``, a key whose device draws would differ, see
            ``device_sampling_exact``).
        sync_every: with the device loop, most tokens per sequence between two host reads, in
            ``[1, 4096]``: tokens are yielded in chunks of up to this many per sequence (rounded up
            to a power of two, it sets a buffer's static shape).
        window: a :class:`kvjax.SinkWindow`: instead of context shifts, each sequence keeps its
            first ``n_sink`` and latest ``n_recent`` tokens, the oldest after the sinks leaving as
            each token is placed (StreamingLLM; ``kvjax/memory/_sink_window.py``), so generation
            runs without end in ``n_sink + n_recent`` cells per sequence. Not with ``n_ctx``,
            ``n_keep``, a ``prompt_cache`` or a ``draft``; prompts of at most ``n_sink + n_recent``
            tokens; with the compacted form only the first ``n_sink`` prompt tokens are shared
            between sequences (a shift would move shared cells for all of them).
        stats: when given, filled with ``prompt_tokens``, ``ttft``, ``context_shifts``,
            ``dispatches`` (device-loop dispatches) (and ``drafted``, ``accepted`` with a draft).

    Yields:
        ``(i, token)`` for sequence ``i``.
    """
    stats = {} if stats is None else stats
    req = _check_request(
        engine,
        prompts,
        max_new_tokens=max_new_tokens,
        key=key,
        sampling=sampling,
        n_parallel=n_parallel,
        share_prefix=share_prefix,
        stop_tokens=stop_tokens,
        n_ctx=n_ctx,
        n_keep=n_keep,
        draft=draft,
        n_draft=n_draft,
        prompt_cache=prompt_cache,
        device_loop=device_loop,
        sync_every=sync_every,
        window=window,
    )
    if req.draft is not None:
        yield from _speculative(engine, req, key, stats)
        return
    if req.prompt_cache is not None:  # free sequence ids, the longest parked prefixes lent to them
        sid, held = req.prompt_cache.attach(engine, req.prompts, req.max_new_tokens)
    else:
        sid, held = list(range(req.n_seq)), [0] * req.n_seq
    t0 = time.perf_counter()
    rows = _prefill(engine, req, sid, held, stats)
    yield from _decode(engine, req, sid, rows, key, t0, stats)


def generate(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    key: jax.Array,
    sampling: SamplingConfig = SamplingConfig(),
    on_token: Optional[Callable[[int, int], None]] = None,
    **options,
) -> GenerationResult:
    """Run :func:`generate_stream` to the end and collect the tokens (see it for the options).

    Args:
        engine: the engine.
        prompts: one token list per sequence (or one prompt with ``n_parallel``).
        max_new_tokens: most tokens generated per sequence.
        key: PRNG key.
        sampling: the sampling rule.
        on_token: called with ``(sequence index, token)`` as each token comes (streaming).
        **options: ``n_parallel``, ``share_prefix``, ``stop_tokens``, ``n_ctx``, ``n_keep``, ``draft``,
            ``n_draft``, ``prompt_cache``, ``device_loop``, ``sync_every``, ``window``.
    """
    stats: dict = {}
    n_parallel = check_count("n_parallel", options.get("n_parallel", 1), 1)
    n_seq = n_parallel if n_parallel > 1 else len(prompts)
    out: List[List[int]] = [[] for _ in range(n_seq)]
    t0 = time.perf_counter()
    with CompileCounter() as compiles:
        for s, tok in generate_stream(
            engine, prompts, max_new_tokens=max_new_tokens, key=key, sampling=sampling, stats=stats, **options
        ):
            out[s].append(tok)
            if on_token is not None:
                on_token(s, tok)
    return GenerationResult(
        out,
        stats.get("prompt_tokens", 0),
        stats.get("ttft", 0.0),
        time.perf_counter() - t0,
        stats.get("context_shifts", 0),
        compiles.count,
        compiles.seconds,
        total_compile_seconds() - stats.get("compile_at_ttft", total_compile_seconds()),
        stats.get("drafted", 0),
        stats.get("accepted", 0),
        stats.get("dispatches", 0),
    )


# -- one request, in three steps ------------------------------------------------------------------


@dataclasses.dataclass
class _Request:
    """A generate request whose every argument was checked (see :func:`generate_stream`)."""

    prompts: List[List[int]]
    n_parallel: int
    n_seq: int
    budgets: List[int]
    max_new_tokens: int
    stop: Set[int]
    sampling: SamplingConfig
    share_prefix: bool
    n_ctx: Optional[int]
    n_keep: int
    device_loop: bool
    sync_every: int
    window: Optional[SinkWindow]
    prompt_cache: Optional[PromptCache]
    draft: Optional[Engine] = None
    n_draft: int = 4

    @property
    def longest(self) -> int:
        return max(len(p) for p in self.prompts)

    @property
    def per_sequence(self) -> List[List[int]]:
        """Each sequence's prompt (the one prompt repeated with ``n_parallel``)."""
        return self.prompts * self.n_seq if self.n_parallel > 1 else self.prompts


def _check_request(
    engine: Engine,
    prompts,
    *,
    max_new_tokens,
    key,
    sampling,
    n_parallel,
    share_prefix,
    stop_tokens,
    n_ctx,
    n_keep,
    draft,
    n_draft,
    prompt_cache,
    device_loop,
    sync_every,
    window,
) -> _Request:
    """Every argument of a request checked before anything is placed (``ValueError`` naming it)."""
    # the whole request is checked before anything is placed: a failed call changes nothing
    prompts = check_prompts(prompts, engine.vocab_size)
    n_parallel = check_count("n_parallel", n_parallel, 1)
    if isinstance(max_new_tokens, (list, tuple, np.ndarray)):
        budgets = [check_count(f"max_new_tokens[{i}]", b, 1, MAX_NEW_TOKENS) for i, b in enumerate(max_new_tokens)]
    else:
        budgets = None
        max_new_tokens = check_count("max_new_tokens", max_new_tokens, 1, MAX_NEW_TOKENS)
    device_loop = check_flag("device_loop", device_loop)
    sync_every = check_sync_every(sync_every)
    n_keep = check_count("n_keep", n_keep, 0)
    check_flag("share_prefix", share_prefix)
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a kvjax.SamplingConfig, got {type(sampling).__name__}")
    _check_key(key)
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, (Sequence, np.ndarray, set, frozenset)):
        raise ValueError(
            f"stop_tokens={stop_tokens!r} is out of range: allowed a sequence of token ids "
            f"(e.g. [eos_id], or () for none)"
        )
    stop_tokens = check_prompts([list(stop_tokens)], engine.vocab_size, name="stop_tokens", allow_empty=True)[0]

    def request(**extra) -> _Request:
        # the checked values as they stand where it is called (n_ctx and share_prefix settle late)
        return _Request(
            prompts,
            n_parallel,
            n_seq,
            budgets,
            max_new_tokens,
            set(stop_tokens),
            sampling,
            share_prefix,
            n_ctx,
            n_keep,
            device_loop,
            sync_every,
            window,
            prompt_cache,
            **extra,
        )

    if n_parallel > 1:
        if len(prompts) != 1:
            raise ValueError(f"n_parallel={n_parallel} needs exactly one prompt, got {len(prompts)}")
    n_seq = n_parallel if n_parallel > 1 else len(prompts)
    if budgets is not None:
        if len(budgets) != n_seq:
            raise ValueError(
                f"max_new_tokens has {len(budgets)} entries: allowed an int, or one int per sequence ({n_seq})"
            )
        if draft is not None:
            raise ValueError("max_new_tokens as a list is out of range with draft=: allowed one int for every sequence")
        max_new_tokens = max(budgets)  # the bound every check below needs
    else:
        budgets = [max_new_tokens] * n_seq
    if window is not None:
        if not isinstance(window, SinkWindow):
            raise ValueError(f"window must be a kvjax.SinkWindow, got {type(window).__name__}")
        if n_ctx is not None or n_keep or prompt_cache is not None or draft is not None:
            raise ValueError(
                "window= is out of range with n_ctx, n_keep, prompt_cache or draft: a sink + window "
                "memory evicts a token per token instead of shifting the context"
            )
        check_window_memory(engine.cache, window)
    if draft is not None:
        if n_parallel > 1 or n_ctx is not None or n_keep:
            raise ValueError(
                "draft= is out of range with n_parallel > 1, n_ctx or n_keep: speculative decoding "
                "evaluates each prompt in its own sequence and never shifts the context"
            )
        longest = max(len(p) for p in prompts)
        check_draft(engine, draft, n_draft, n_seq, longest, max_new_tokens)
        check_prompts(prompts, draft.vocab_size)
        return request(draft=draft, n_draft=int(n_draft))
    if n_seq > engine.cache.n_seq_max:
        raise ValueError(f"{n_seq} sequences are out of range: allowed at most n_seq_max={engine.cache.n_seq_max}")
    limit = engine.cache.max_context
    longest = max(len(p) for p in prompts)
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache):
            raise ValueError(f"prompt_cache must be a kvjax.PromptCache, got {type(prompt_cache).__name__}")
        if n_parallel > 1 or n_ctx is not None or n_keep:
            raise ValueError(
                "prompt_cache= is out of range with n_parallel > 1, n_ctx or n_keep: a cached request "
                "never shifts its context (the cache evicts instead)"
            )
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} is out of range: a prompt of {longest} tokens and "
                f"its continuation must fit in size={limit} cells (nothing is shifted with a prompt cache)"
            )
        limit, share_prefix = None, False  # the cache lends its own prefixes (attached after the checks)
    if window is not None:
        _check_window_fits(engine, window, n_seq, n_parallel, prompts, limit)
    else:
        n_ctx = _context_limit(engine, n_ctx, n_keep, n_seq, longest, limit)
    if n_ctx is not None and max_new_tokens + longest > n_ctx and not engine.cache.can_shift:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} is out of range for this {type(engine.cache).__name__}: "
            f"a prompt of {longest} tokens would reach n_ctx={n_ctx} and need a context shift, which "
            f"this memory cannot do (kvjax.can_shift is False); allowed max_new_tokens <= "
            f"{n_ctx - longest}, or a memory with more cells"
        )
    busy = [s for s in range(n_seq) if int(kvjax.seq_pos_max(engine.cache, s)) >= 0] if prompt_cache is None else []
    if busy:
        raise ValueError(
            f"sequences {busy} already hold cells: generate uses sequences 0..{n_seq - 1}; "
            f"free them with kvjax.seq_rm(cache, s) (or use a fresh cache)"
        )
    return request()


def _check_window_fits(engine: Engine, window: SinkWindow, n_seq: int, n_parallel: int, prompts, limit) -> None:
    """A sink + window memory of ``n_seq`` sequences fits the engine's memory and the prompts."""
    longest = max(len(p) for p in prompts)
    top = engine.cache.context_per_sequence(n_seq) if limit is not None else 2**31 - 1
    if window.n_cells > top:
        raise ValueError(
            f"window={window} is out of range: allowed n_sink + n_recent <= {top} (the cells per "
            f"sequence with {n_seq} sequence{'s' if n_seq != 1 else ''})"
        )
    if longest > window.n_cells:
        raise ValueError(
            f"a prompt of {longest} tokens is out of range: allowed at most n_sink + n_recent = "
            f"{window.n_cells} tokens with window="
        )
    memory = engine.cache
    one_per_stream = isinstance(memory, StreamCache) and memory.config.n_stream == memory.n_seq_max
    if n_seq > 1 and engine.contiguous and not one_per_stream:
        raise ValueError(
            f"window= with {n_seq} sequences in one pool of cells is out of range with "
            f"Engine(contiguous=True): evictions leave single free cells between the sequences, "
            f"where a contiguous ubatch of {n_seq} tokens does not fit; allowed an "
            f"Engine(..., contiguous=False), or per-sequence streams (kvjax.StreamsConfig)"
        )
    if window.compact and n_parallel > 1 and len(prompts[0]) > window.n_sink:
        raise ValueError(
            f"n_parallel={n_parallel} is out of range with window=SinkWindow(compact=True) and a "
            f"prompt of {len(prompts[0])} tokens: the shared prompt would move for every "
            f"continuation; allowed a prompt of at most n_sink={window.n_sink} tokens, or "
            f"compact=False"
        )


def _context_limit(engine: Engine, n_ctx, n_keep: int, n_seq: int, longest: int, limit) -> Optional[int]:
    """The per-sequence context limit a shift keeps each sequence under (None: nothing to shift)."""
    if limit is None and n_ctx is None:  # a recurrent state or a prompt cache: nothing to shift
        return None
    top = engine.cache.context_per_sequence(n_seq) if limit is not None else (2**31 - 1) // n_seq
    n_ctx = top if n_ctx is None else check_count("n_ctx", n_ctx, 1)
    if not n_keep + 2 <= n_ctx <= top:
        raise ValueError(
            f"n_ctx={n_ctx} is out of range: allowed [n_keep + 2 = {n_keep + 2}, cells per sequence = "
            f"{top}] (every sequence must be able to reach its limit)"
        )
    if longest >= n_ctx:
        raise ValueError(f"a prompt of {longest} tokens is out of range: allowed < n_ctx = {n_ctx}")
    return n_ctx


def _speculative(engine: Engine, req: _Request, key, stats: dict) -> Iterator[Tuple[int, int]]:
    """A request with a draft model (``kvjax/engine/_speculative.py``)."""
    t0 = time.perf_counter()
    first = True
    for item in speculative_stream(
        engine,
        req.draft,
        req.prompts,
        max_new_tokens=req.max_new_tokens,
        key=key,
        sampling=req.sampling,
        n_draft=req.n_draft,
        stop=req.stop,
        stats=stats,
    ):
        if first:
            stats["ttft"] = time.perf_counter() - t0
            stats["compile_at_ttft"] = total_compile_seconds()
            first = False
        yield item
    stats["prompt_tokens"] = sum(len(p) for p in req.prompts)


def _prefill(engine: Engine, req: _Request, sid: List[int], held: List[int], stats: dict):
    """Evaluate the prompts: a shared part once (then ``seq_cp``), each sequence's own part after it.

    Returns:
        The logits rows to sample each sequence's first token from (``[n_seq, V]``).
    """
    prompts, n_parallel, n_seq, n_ctx, n_keep = req.prompts, req.n_parallel, req.n_seq, req.n_ctx, req.n_keep
    window, max_new_tokens, longest = req.window, req.max_new_tokens, req.longest
    if n_parallel > 1:
        shared, own = prompts[0], [[] for _ in range(n_seq)]  # the whole prompt, shared
    elif req.share_prefix and n_seq > 1:
        n_common = min(_common_prefix(prompts), min(len(p) for p in prompts) - 1)
        if window is not None and window.compact:  # shared cells must never be shifted
            n_common = min(n_common, window.n_sink)
        shared, own = prompts[0][:n_common], [p[n_common:] for p in prompts]
    else:
        shared, own = [], prompts
    prompt_tokens = 0
    first_discard = n_keep + (n_ctx - n_keep) // 2 if n_ctx is not None else len(shared)
    if n_ctx is not None and len(shared) > first_discard and max_new_tokens + longest > n_ctx:
        raise ValueError(
            f"the shared prompt ({len(shared)} tokens) would be moved by a context shift, which "
            f"would shift it for every sequence: allowed at most n_keep + (n_ctx - n_keep) // 2 = "
            f"{first_discard} shared tokens; raise n_keep or n_ctx, or pass share_prefix=False"
        )
    if shared:
        # only n_parallel reads the shared prompt's logits (its last row); the rest needs its cells only
        shared_logits = engine.decode(
            shared,
            list(range(len(shared))),
            [[sid[0]]] * len(shared),
            outputs=[len(shared) - 1] if n_parallel > 1 else [],
        )
        for s in range(1, n_seq):
            engine.cache = kvjax.seq_cp(engine.cache, sid[0], sid[s], -1, -1)
        prompt_tokens += len(shared)
    toks, pos, ids, last_row = [], [], [], {}
    for s, part in enumerate(own):
        part = part[held[s] :]  # a prompt cache already holds the first held[s] tokens
        for j, t in enumerate(part):
            toks.append(t)
            pos.append(len(shared) + held[s] + j)
            ids.append([sid[s]])
        if part:
            last_row[s] = len(toks) - 1
    if n_parallel > 1:
        rows = jnp.repeat(shared_logits[-1:], n_seq, axis=0)  # n draws from the same distribution
    else:
        # the head on the last prompt row of each sequence only: a prefill never builds [n, V]
        rows = engine.decode(toks, pos, ids, outputs=[last_row[s] for s in range(n_seq)])
        prompt_tokens += len(toks)
    stats["prompt_tokens"] = prompt_tokens
    stats["seq_ids"] = sid
    return rows


def _decode(
    engine: Engine, req: _Request, sid: List[int], rows, key, t0: float, stats: dict
) -> Iterator[Tuple[int, int]]:
    """The decode loop from the prompts' logits ``rows``: on the device where it gives the host loop's
    tokens, else one step per dispatch; context shifts, window evictions and stops on the host."""
    n_seq, n_ctx, n_keep, window, stop = req.n_seq, req.n_ctx, req.n_keep, req.window, req.stop
    budgets, sampling, sync_every, prompt_cache = req.budgets, req.sampling, req.sync_every, req.prompt_cache
    next_pos = [len(p) for p in req.per_sequence]
    counts = [0] * n_seq
    fed = [list(p) for p in req.per_sequence]  # the tokens each sequence holds
    shifts = 0
    # the device loop, where it gives the host loop's tokens (see kvjax/engine/_device_loop.py). A
    # prompt cache parks ``fed``, the tokens handed out and fed; a generator closed early may have
    # left the device a step or a chunk ahead, so a parked sequence then holds cells past its
    # tokens: only a prefix is ever lent (share_prefix up to the match), and a sequence whose
    # cells do not end at its tokens is never continued in place (PromptCache._attach checks)
    on_device = req.device_loop and device_sampling_exact(key, sampling)
    stops = stop_bucket(sorted(stop)) if on_device else None
    info: dict = {}
    stats["dispatches"] = 0
    try:
        key, sub = jax.random.split(key)
        picked = np.asarray(sample(rows, sub, sampling))
        stats["ttft"] = time.perf_counter() - t0
        stats["compile_at_ttft"] = total_compile_seconds()
        active, still = list(range(n_seq)), []
        for s, tok in zip(active, picked.tolist()):
            counts[s] += 1
            yield s, tok
            if tok not in stop and counts[s] < budgets[s]:
                still.append((s, tok))
        while still:
            for s, _ in still:
                if n_ctx is not None and next_pos[s] >= n_ctx:
                    n_discard = (next_pos[s] - n_keep) // 2
                    next_pos[s] = engine.context_shift(sid[s], n_keep, n_discard)
                    shifts += 1
                if window is not None and next_pos[s] >= window.n_cells:
                    # full: the oldest token after the sinks leaves (the device loop does it for
                    # the tokens after this one)
                    engine.cache, _ = sink_window_evict(engine.cache, sid[s], next_pos[s], window)
                    next_pos[s] -= window.evicted(next_pos[s])
            active, feed = [s for s, _ in still], [t for _, t in still]
            steps = 0
            if on_device and len(active) <= engine.n_ubatch:
                # many steps per dispatch; it returns when a sequence stops, a shift is due, the
                # window bucket changes or pending work must be applied (the next round does it)
                for _, picked in run_segment(
                    engine,
                    active,
                    sid,
                    feed,
                    next_pos,
                    counts,
                    budgets,
                    stops,
                    n_ctx,
                    key,
                    sampling,
                    sync_every,
                    info,
                    window,
                ):
                    for s, t in zip(active, feed):
                        fed[s].append(t)
                    feed = picked.tolist()
                    still = []
                    for s, tok in zip(active, feed):
                        yield s, tok
                        if tok not in stop and counts[s] < budgets[s]:
                            still.append((s, tok))
                    steps += 1
                key = info["key"]
                stats["dispatches"] = info["dispatches"]
            if not steps:
                # the host loop: one step per dispatch (also what a device segment that could not
                # run a step falls back to, so its error is decode's)
                logits = engine.decode(feed, [next_pos[s] for s in active], [[sid[s]] for s in active])
                for s, tok in still:
                    next_pos[s] += 1
                    fed[s].append(tok)
                key, sub = jax.random.split(key)
                picked = np.asarray(sample(logits, sub, sampling))
                still = []
                for s, tok in zip(active, picked.tolist()):
                    counts[s] += 1
                    yield s, tok
                    if tok not in stop and counts[s] < budgets[s]:
                        still.append((s, tok))
    finally:
        if prompt_cache is not None:  # the sequences stay in the memory, parked for later requests
            for s in range(n_seq):
                prompt_cache.park(sid[s], fed[s])
            if prompt_cache.idle_to_host:  # ... or in host memory (and any brought back), cells freed at once
                prompt_cache.to_host(engine)
    stats["context_shifts"] = shifts
