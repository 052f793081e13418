"""Continuous batching on the pure cache: requests join and leave between steps.

:class:`Scheduler` drives one :class:`kvjax.Engine` through its public API. Each :meth:`step
<Scheduler.step>`:

1. takes what arrived (:meth:`submit <Scheduler.submit>`, from any thread) and what was cancelled;
   a cancelled request's cells are freed at once;
2. admits waiting requests in arrival order while a sequence id is free and their prompts fit
   (a dry run of every prompt token still to place, :meth:`Engine.fits <kvjax.Engine.fits>`);
   with a :class:`kvjax.PromptCache` a request gets the longest parked prefix and evaluates the
   rest only, and least recently used parked prefixes make room;
3. builds one batch under the token budget ``n_batch``: first one token for every request that
   is decoding, then prompt chunks of the admitted ones in arrival order (chunked prefill: a
   long prompt never holds the decoders up for more than a step);
4. runs it with :meth:`Engine.decode <kvjax.Engine.decode>` (logits only for the rows that sample);
   if the memory is full, prompt chunks wait, then parked prefixes are evicted, then the newest
   running request is preempted (its cells freed, it waits at the head of the queue and resumes
   from its prompt and the tokens it already has), so running requests are never corrupted;
5. samples each row with its request's own rule and seed (``kvjax/serve/_rows.py``), checks stop
   tokens, stop strings, budgets and the context limit, and hands back one :class:`ServeEvent`
   per request that produced something.

Where every admitted request is decoding greedily and nothing could be admitted (nothing waits, or
every sequence id is running), the step runs a stretch of up to ``sync_every`` tokens on the
device loop (``kvjax/engine/_device_loop.py``) in one dispatch; a request that finishes ends it.

With a ``draft`` engine (a smaller model over a memory of its own), steps where every running
request decodes greedily are speculative rounds instead: the draft proposes ``n_draft`` tokens for
every request (catching up first on what it has not seen of each), the target checks each
request's pending token and its drafts in one batch, each request keeps its longest matching
prefix and the target's next token, and both memories drop the rest (``kvjax.Engine.rollback``).
The tokens are exactly the target's greedy tokens.

A request whose next position reaches ``n_ctx`` finishes with ``"length"``, or with
``context="shift"`` drops half of what follows its first ``n_keep`` tokens and goes on
(llama.cpp's context shift, on memories that can shift).

Example:
    >>> import kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    >>> engine = kvjax.Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=64, n_seq_max=4)))
    >>> scheduler = Scheduler(engine)
    >>> a = scheduler.submit(ServeRequest([1, 2, 3], max_tokens=4))
    >>> b = scheduler.submit(ServeRequest([4, 5], max_tokens=2))
    >>> out = scheduler.run_until_idle()
    >>> [len(out[a].tokens), len(out[b].tokens)], out[b].finish_reason, int(kvjax.used_cells(engine.cache))
    ([4, 2], 'length', 0)
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax._errors import CacheFullError
from kvjax._validate import check_count, check_flag
from kvjax.engine._device_loop import run_segment, stop_bucket
from kvjax.engine._engine import Engine
from kvjax.engine._prompt_cache import PromptCache
from kvjax.engine._sampling import SamplingConfig
from kvjax.engine._speculative import _last_rows, accept_drafts, check_draft_engines
from kvjax.serve._request import ServeEvent, ServeRequest, check_request
from kvjax.serve._rows import pick_tokens, row_logprobs
from kvjax.serve._stops import StopText

__all__ = ["Scheduler", "QueueFullError", "CONTEXT_POLICIES"]

#: what a request that reaches ``n_ctx`` does: finish (``"length"``) or shift its context
CONTEXT_POLICIES = ("length", "shift")
_GREEDY = SamplingConfig(temperature=0.0)


class QueueFullError(RuntimeError):
    """The scheduler's queue holds ``max_queue`` waiting requests: try again later (HTTP 503)."""


@dataclasses.dataclass(eq=False)  # identity: two requests are never equal
class _Live:
    """A request inside the scheduler.

    ``context`` is the request's tokens by position: what its cells hold (``context[:placed]``)
    and what is still to feed (``context[placed:]``: the rest of its prompt, or the last sampled
    token). A context shift cuts it as it cuts the cells.
    """

    rid: int
    req: ServeRequest
    order: int  # admission order (preemption takes the newest)
    context: List[int]
    generated: List[int] = dataclasses.field(default_factory=list)
    seq: Optional[int] = None
    placed: int = 0
    draft_placed: int = 0  # positions the draft engine's memory holds (speculative rounds)
    shifted: bool = False
    cached: int = 0
    text: Optional[StopText] = None
    arrived: float = 0.0
    first_token: Optional[float] = None

    @property
    def to_feed(self) -> int:
        return len(self.context) - self.placed


class Scheduler:
    """Continuous batching of :class:`ServeRequest` s on one engine (see the module docstring).

    Args:
        engine: the :class:`kvjax.Engine` (any memory kind). Its memory must hold no cells but those
            ``prompt_cache`` parked; the scheduler owns it from now on.
        n_batch: most tokens per step (llama.cpp's ``n_batch``; the engine splits a step into
            ubatches of ``engine.n_ubatch``). Default ``engine.n_ubatch``.
        prompt_cache: a :class:`kvjax.PromptCache` of the engine's memory: finished requests stay
            parked and later prompts reuse their longest prefix (with its host tier,
            ``host_bytes=``, evicted prefixes move to host memory and come back for a better
            match; with ``idle_to_host=True`` a finished request's sequence moves there at once).
        tokenizer: a :class:`kvjax.nn.Tokenizer`: events carry text, and requests may have stop strings.
        n_ctx: most positions one request holds (default: what one sequence of the memory can
            hold, ``cache.context_per_sequence(1)``; unbounded for a recurrent state).
        context: ``"length"`` (a request that reaches ``n_ctx`` finishes) or ``"shift"`` (it keeps
            ``n_keep`` tokens and half of the rest; needs a memory that can shift, and no prompt cache).
        n_keep: tokens kept at the start on a context shift.
        max_queue: most requests waiting for admission; :meth:`submit` raises
            :class:`QueueFullError` beyond it.
        device_loop: run greedy decode-only stretches on the device loop.
        sync_every: most tokens per request in one device-loop stretch, ``[1, 256]`` (new arrivals
            wait at most this many decode steps).
        draft: a draft :class:`kvjax.Engine` for speculative rounds (its own model and memory, the
            target's vocabulary, as many sequence ids, and no cells yet): greedy decode steps become
            rounds of ``n_draft`` drafted tokens checked at once. Not with a ``prompt_cache`` (the
            draft's memory would need the same parked prefixes) or ``context="shift"``.
        n_draft: tokens the draft proposes per request and round, ``[1, 64]``.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        n_batch: Optional[int] = None,
        prompt_cache: Optional[PromptCache] = None,
        tokenizer=None,
        n_ctx: Optional[int] = None,
        context: str = "length",
        n_keep: int = 0,
        max_queue: int = 4096,
        device_loop: bool = True,
        sync_every: int = 16,
        draft: Optional[Engine] = None,
        n_draft: int = 4,
    ):
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be a kvjax.Engine, got {type(engine).__name__}")
        self.engine = engine
        memory = engine.cache
        self.n_batch = engine.n_ubatch if n_batch is None else check_count("n_batch", n_batch, 1)
        if prompt_cache is not None:
            if not isinstance(prompt_cache, PromptCache):
                raise ValueError(f"prompt_cache must be a kvjax.PromptCache, got {type(prompt_cache).__name__}")
            if prompt_cache.n_seq_max != memory.n_seq_max:
                raise ValueError(
                    f"prompt_cache has n_seq_max={prompt_cache.n_seq_max}: allowed the memory's {memory.n_seq_max}"
                )
        self.prompt_cache = prompt_cache
        if context not in CONTEXT_POLICIES:
            raise ValueError(f"context={context!r} is out of range: allowed one of {list(CONTEXT_POLICIES)}")
        if context == "shift" and (not memory.can_shift or prompt_cache is not None):
            raise ValueError(
                f"context='shift' is out of range with "
                f"{'a prompt cache' if prompt_cache is not None else f'this {type(memory).__name__}'}: "
                f"allowed on a memory that can shift (kvjax.can_shift) without a prompt cache; use 'length'"
            )
        self.context, self.n_keep = context, check_count("n_keep", n_keep, 0)
        top = memory.context_per_sequence(1)
        if n_ctx is None:
            self.n_ctx = top
        else:
            self.n_ctx = check_count("n_ctx", n_ctx, self.n_keep + 2, top if top is not None else 2**31 - 1)
        self.tokenizer = tokenizer
        self.max_queue = check_count("max_queue", max_queue, 1)
        self.device_loop = check_flag("device_loop", device_loop)
        self.sync_every = check_count("sync_every", sync_every, 1, 256)
        parked = set(prompt_cache.parked()) if prompt_cache is not None else set()
        busy = [s for s in range(memory.n_seq_max) if s not in parked and int(kvjax.seq_pos_max(memory, s)) >= 0]
        if busy:
            raise ValueError(
                f"the engine's memory holds cells of sequences {busy}: allowed a memory with no cells "
                f"but parked ones (free them with kvjax.seq_rm, or use a fresh memory)"
            )
        self.draft, self.n_draft = draft, n_draft
        self._no_room_for: set = set()  # the running requests a speculative round found no room for
        if draft is not None:
            self._check_draft(draft, n_draft, prompt_cache, context)
        self._lock = threading.Lock()
        self._inbox: Deque[_Live] = collections.deque()
        self._cancels: set = set()
        self._tasks: Deque[Tuple[Callable, concurrent.futures.Future]] = collections.deque()
        self._next_id = 0
        self._order = 0
        self._greedy_key = jax.random.PRNGKey(0)  # made once: a key costs a dispatch
        self.waiting: Deque[_Live] = collections.deque()
        self.running: Dict[int, _Live] = {}  # admitted requests by id, in admission order
        #: counters since construction (``/metrics``)
        self.stats = collections.Counter()
        #: what the last step fed: ``(request id, tokens, "prompt" | "decode")`` per request (a
        #: device stretch: its decode tokens per request)
        self.last_batch: List[Tuple[int, int, str]] = []

    def _check_draft(self, draft, n_draft, prompt_cache, context) -> None:
        """Refuse a draft engine the scheduler cannot run speculative rounds with (nothing changes)."""
        check_draft_engines(self.engine, draft, n_draft)
        n_seq = self.engine.cache.n_seq_max
        if draft.cache.n_seq_max < n_seq:
            raise ValueError(
                f"draft memory has n_seq_max={draft.cache.n_seq_max}: allowed at least the target's {n_seq} "
                f"(a request has the same sequence id in both)"
            )
        if prompt_cache is not None or context == "shift":
            what = "prompt_cache" if prompt_cache is not None else "context='shift'"
            raise ValueError(
                f"draft is out of range with {what}: allowed only without it (the draft's memory would "
                f"need the same {'parked prefixes' if prompt_cache is not None else 'shifts'}); serve "
                f"with one or the other"
            )
        busy = [s for s in range(draft.cache.n_seq_max) if int(kvjax.seq_pos_max(draft.cache, s)) >= 0]
        if busy:
            raise ValueError(f"the draft's memory holds cells of sequences {busy}: allowed a memory with no cells")

    # -- the client side (any thread) ------------------------------------------------------------

    def submit(self, request: ServeRequest) -> int:
        """Queue a request; return its id. Checked here: a bad request raises ``ValueError`` naming the field.

        Raises:
            ValueError: a malformed request (nothing queued).
            QueueFullError: ``max_queue`` requests are waiting already.
        """
        request = check_request(request, self.engine.vocab_size, self.n_ctx, self.tokenizer is not None)
        with self._lock:
            if len(self._inbox) + len(self.waiting) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFullError(
                    f"{self.max_queue} requests are waiting (max_queue={self.max_queue}): try again later"
                )
            rid = self._next_id
            self._next_id += 1
            live = _Live(rid, request, -1, list(request.prompt), arrived=time.perf_counter())
            if self.tokenizer is not None:
                live.text = StopText(self.tokenizer, request.stop)
            self._inbox.append(live)
            self.stats["submitted"] += 1
        return rid

    def cancel(self, request_id: int) -> None:
        """End a request at the next step (its cells are freed then; its last event says ``"cancelled"``).

        Unknown or finished ids are ignored (a client may leave after its request ended).
        """
        with self._lock:
            self._cancels.add(int(request_id))

    def call_in_step(self, fn: Callable[["Scheduler"], object]) -> concurrent.futures.Future:
        """Run ``fn(scheduler)`` at the start of the next step, on the thread that steps.

        For work that touches the memory between steps (a slot saved to a file or restored from
        one): the memory is only ever touched by the stepping thread. Returns a future of the result
        (or of the exception ``fn`` raised).
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._tasks.append((fn, future))
        return future

    @property
    def idle(self) -> bool:
        """Nothing queued, waiting or running (and no task for the stepping thread)."""
        with self._lock:
            return not (self._inbox or self.waiting or self.running or self._tasks)

    @property
    def queued(self) -> int:
        with self._lock:
            return len(self._inbox) + len(self.waiting)

    # -- the model side (one thread) ----------------------------------------------------------------

    def step(self) -> List[ServeEvent]:
        """Run one step (see the module docstring); return the events it produced (maybe none)."""
        events: Dict[int, ServeEvent] = {}
        self.last_batch = []
        self._run_tasks()
        self._take_arrivals(events)
        self._admit()
        if not self.running:
            return list(events.values())
        self._apply_context_limits(events)
        if self._speculative_round(events) or self._device_stretch(events):
            return list(events.values())
        held_back: set = set()  # requests whose prompt chunk waits for this step (no room)
        while self.running:
            batch = self._build_batch(held_back)
            if batch is None:  # every chunk held back and nothing decodes: someone must give way
                self._preempt(max(self.running.values(), key=lambda w: w.order))
                held_back.clear()
                continue
            tokens, pos, ids, out_rows, out_lives, fed = batch
            try:
                logits = self.engine.decode(tokens, pos, ids, outputs=out_rows)
            except CacheFullError:
                self._make_room(fed, held_back, events)
                continue
            decode_rows = sum(1 for live, n in fed if live.to_feed == 1 and live.generated)
            self.last_batch = [
                (live.rid, n, "decode" if live.to_feed == 1 and live.generated else "prompt") for live, n in fed
            ]
            for live, n in fed:
                live.placed += n
            self.stats["steps"] += 1
            self.stats["prompt_tokens_evaluated"] += len(tokens) - decode_rows
            if out_lives:
                self._sample(logits, out_lives, events)
            break
        return list(events.values())

    def run_until_idle(self, max_steps: int = 1_000_000) -> Dict[int, ServeEvent]:
        """Step until nothing is queued or running; return each request's whole result as one event."""
        results: Dict[int, ServeEvent] = {}
        for _ in range(max_steps):
            if self.idle:
                return results
            for ev in self.step():
                results.setdefault(ev.request_id, ServeEvent(ev.request_id)).merge(ev)
        raise RuntimeError(f"the scheduler was still busy after max_steps={max_steps} steps")

    # -- arrivals, admission, finishing ----------------------------------------------------------

    def _run_tasks(self) -> None:
        with self._lock:
            tasks, self._tasks = list(self._tasks), collections.deque()
        for fn, future in tasks:
            try:
                future.set_result(fn(self))
            except Exception as err:  # handed to the caller, who owns the error
                future.set_exception(err)

    def _take_arrivals(self, events) -> None:
        with self._lock:
            arrivals, self._inbox = list(self._inbox), collections.deque()
            cancels, self._cancels = self._cancels, set()
        self.waiting.extend(arrivals)
        if not cancels:
            return
        for rid in cancels & set(self.running):
            self._finish(self.running[rid], "cancelled", events)
        # the waiting ones in one pass (a burst of disconnects may cancel thousands)
        gone = [w for w in self.waiting if w.rid in cancels]
        if gone:
            self.waiting = collections.deque(w for w in self.waiting if w.rid not in cancels)
            for live in gone:
                self._finish(live, "cancelled", events)

    def _free_seq_ids(self) -> List[int]:
        used = {live.seq for live in self.running.values()}
        return [s for s in range(self.engine.cache.n_seq_max) if s not in used]

    def _admit(self) -> None:
        """Admit waiting requests in arrival order while one fits (no request overtakes another)."""
        while self.waiting:
            live = self.waiting[0]
            if self.prompt_cache is not None:
                if not self._attach(live):
                    return
            else:
                free = self._free_seq_ids()
                if not free:
                    return
                live.seq, live.placed = free[0], 0
            # every prompt token still to place, of this request and of those already prefilling
            spans = [(w.seq, w.placed, len(w.context)) for w in self.running.values() if w.to_feed > 1]
            if not self.engine.fits(self.engine.cache, spans + [(live.seq, live.placed, len(live.context))]):
                if self.prompt_cache is not None:  # the attached prefix stays parked for it
                    self._release(live, finished=False)
                live.seq = None
                return
            self.waiting.popleft()
            live.order = self._order
            self._order += 1
            self.running[live.rid] = live
            self.stats["admitted"] += 1
            self.stats["peak_running"] = max(self.stats["peak_running"], len(self.running))

    def _attach(self, live: _Live) -> bool:
        """A sequence id and the longest parked prefix from the prompt cache (False: not now)."""
        if len(self.running) >= self.engine.cache.n_seq_max:  # every id runs: none to free or lend
            return False
        try:
            (seq,), (held,) = self.prompt_cache.attach(
                self.engine, [live.context], 1, reserved=[w.seq for w in self.running.values()]
            )
        except (CacheFullError, ValueError):
            return False
        live.seq, live.placed, live.cached = seq, held, held
        self.stats["cached_tokens"] += held
        return True

    def _release(self, live: _Live, finished: bool = True) -> None:
        """Free the request's cells, or park them in the prompt cache when they are a clean prefix
        (in its host tier at once, for a finished request, with ``idle_to_host``)."""
        self._release_draft(live)
        memory, seq = self.engine.cache, np.int32(live.seq)
        if self.prompt_cache is not None and not live.shifted and live.placed > 0:
            # cells past what was accepted (a device stretch that ran ahead) are cut first
            cut, ok = memory.seq_rm(seq, np.int32(live.placed), np.int32(-1))
            if bool(ok):
                self.engine.cache = cut
                self.prompt_cache.park(live.seq, live.context[: live.placed])
                if finished and self.prompt_cache.idle_to_host:  # and any brought back for it
                    self.prompt_cache.to_host(self.engine)
                return
        self.engine.cache, _ = memory.seq_rm(seq, np.int32(-1), np.int32(-1))
        if self.prompt_cache is not None:
            self.prompt_cache.forget(live.seq)

    def _finish(self, live: _Live, reason: str, events) -> None:
        ev = events.setdefault(live.rid, ServeEvent(live.rid))
        if live.text is not None and reason != "stop":
            ev.text += live.text.flush()
        ev.finish_reason = reason
        ev.prompt_tokens = len(live.req.prompt)
        ev.completion_tokens = len(live.generated)
        ev.cached_tokens = live.cached
        if live.rid in self.running:
            del self.running[live.rid]
            if live.seq is not None:
                self._release(live)
        elif live in self.waiting:
            self.waiting.remove(live)
        live.seq = None
        self.stats[f"finished_{reason}"] += 1

    # -- one step -------------------------------------------------------------------------------

    def _apply_context_limits(self, events) -> None:
        """A request whose next token would pass ``n_ctx``: shift its context (``"shift"``)."""
        if self.n_ctx is None or self.context != "shift":
            return
        for live in list(self.running.values()):
            if len(live.context) > self.n_ctx and live.to_feed == 1:
                n_discard = (live.placed - self.n_keep) // 2
                self.engine.context_shift(live.seq, self.n_keep, n_discard)
                del live.context[self.n_keep : self.n_keep + n_discard]
                live.placed -= n_discard
                live.shifted = True
                self.stats["context_shifts"] += 1

    def _build_batch(self, held_back):
        """This step's tokens: decode tokens first, then prompt chunks in admission order, under ``n_batch``."""
        decoding = [w for w in self.running.values() if w.to_feed == 1 and w.rid not in held_back]
        prefilling = [w for w in self.running.values() if w.to_feed > 1 and w.rid not in held_back]
        budget = self.n_batch
        tokens, pos, ids, out_rows, out_lives, fed = [], [], [], [], [], []
        for live in decoding + prefilling:
            n = min(live.to_feed, budget)
            if n <= 0:
                break
            start = live.placed
            tokens += live.context[start : start + n]
            pos += range(start, start + n)
            ids += [[live.seq]] * n
            fed.append((live, n))
            if n == live.to_feed:  # the chunk ends the request's context: its last row samples
                out_rows.append(len(tokens) - 1)
                out_lives.append(live)
            budget -= n
        return (tokens, pos, ids, out_rows, out_lives, fed) if tokens else None

    def _make_room(self, fed, held_back, events) -> None:
        """After a batch that did not fit, one of: hold the newest prompt chunk back for this step,
        evict the least recently used parked prefix, preempt the newest request, or (alone) finish it."""
        chunks = [live for live, n in fed if live.to_feed > 1 or not live.generated]
        if chunks:
            held_back.add(max(chunks, key=lambda w: w.order).rid)
        elif self.prompt_cache is not None and self.prompt_cache.parked():
            self.prompt_cache.evict_lru(self.engine)  # to its host tier, when it has one
            self.stats["evictions"] += 1
        elif len(self.running) > 1:
            self._preempt(max(self.running.values(), key=lambda w: w.order))
            held_back.clear()
        else:  # one request alone fills the memory: it has reached what the memory holds
            self._finish(next(iter(self.running.values())), "length", events)

    def _preempt(self, live: _Live) -> None:
        """Free a running request's cells; it waits at the head of the queue and resumes from its tokens."""
        del self.running[live.rid]
        self._release_draft(live)
        self.engine.cache, _ = self.engine.cache.seq_rm(np.int32(live.seq), np.int32(-1), np.int32(-1))
        if self.prompt_cache is not None:
            self.prompt_cache.forget(live.seq)
        live.seq, live.placed, live.order = None, 0, -1
        self.waiting.appendleft(live)
        self.stats["preemptions"] += 1

    def _sample(self, logits, lives: Sequence[_Live], events) -> None:
        rules = [(w.req.sampling, w.req.seed, len(w.generated)) for w in lives]
        picked = pick_tokens(logits, rules)
        want = [i for i, w in enumerate(lives) if w.req.logprobs is not None]
        logprobs = {}
        if want:
            got = row_logprobs(logits, want, [picked[i] for i in want], [lives[i].req.logprobs for i in want])
            logprobs = dict(zip(want, got))
        for i, (live, token) in enumerate(zip(lives, picked)):
            self._accept(live, int(token), logprobs.get(i), events)

    def _accept(self, live: _Live, token: int, logprob, events) -> bool:
        """Hand out one sampled token; finish the request if it ends here. Returns whether it goes on."""
        now = time.perf_counter()
        if live.first_token is None:
            live.first_token = now
            self.stats["ttft_seconds_total"] += now - live.arrived
        ev = events.setdefault(live.rid, ServeEvent(live.rid))
        ev.tokens.append(token)
        if logprob is not None:
            ev.logprobs.append(logprob)
        live.generated.append(token)
        live.context.append(token)
        self.stats["generated_tokens"] += 1
        matched, stopped = False, token in live.req.stop_tokens
        if live.text is not None and not stopped:  # a stop token's text is never part of the reply
            text, matched = live.text.push(token)
            ev.text += text
        if stopped:
            if live.text is not None:
                ev.text += live.text.flush()
            self._finish(live, "stop", events)
        elif matched:
            self._finish(live, "stop", events)
        elif len(live.generated) >= live.req.max_tokens:
            self._finish(live, "length", events)
        elif self.n_ctx is not None and len(live.context) > self.n_ctx and self.context == "length":
            self._finish(live, "length", events)
        else:
            return True
        return False

    # -- speculative rounds ---------------------------------------------------------------------

    def _release_draft(self, live: _Live) -> None:
        """Free the request's cells in the draft's memory (its sequence id goes to another request)."""
        if self.draft is not None and live.draft_placed:
            self.draft.cache, _ = self.draft.cache.seq_rm(np.int32(live.seq), np.int32(-1), np.int32(-1))
        live.draft_placed = 0

    def _draft_back_to(self, live: _Live, pos: int) -> None:
        """Forget the draft's positions ``>= pos`` of the request."""
        if live.draft_placed > pos:
            self.draft.rollback(live.seq, pos)
            live.draft_placed = pos

    def _speculative_round(self, events) -> bool:
        """One round of ``n_draft`` drafts per request checked by the target at once, when every
        running request decodes greedily (see the module docstring); False: a plain step runs."""
        lives = list(self.running.values())
        k = self.n_draft
        if self.draft is None or not all(
            w.to_feed == 1 and w.req.sampling.greedy and w.req.logprobs is None for w in lives
        ):
            return False
        if self._no_room_for == set(self.running):  # a round did not fit these requests: plain steps until one leaves
            return False
        if self.n_ctx is not None and any(len(w.context) + k > self.n_ctx for w in lives):
            return False  # the drafts would pass the context: plain steps take the request to its end
        ends = [len(w.context) for w in lives]  # L: the pending token sits at L - 1
        ids = [[w.seq] for w in lives]

        def give_way():  # no room in a memory: the draft forgets its drafts (positions >= L), plain steps go on
            for w, e in zip(lives, ends):
                self._draft_back_to(w, e)
            self.stats["speculative_fallbacks"] += 1
            self._no_room_for = set(self.running)
            return False

        try:
            # 1. the draft catches up on what it has not seen of each request, then proposes k tokens
            parts = [w.context[w.draft_placed :] for w in lives]
            toks = [t for part in parts for t in part]
            pos = [p for w in lives for p in range(w.draft_placed, len(w.context))]
            rows = [i for w, part in zip(ids, parts) for i in [w] * len(part)]
            logits = self.draft.decode(toks, pos, rows, outputs=_last_rows([len(p) for p in parts], 1))
            for w in lives:
                w.draft_placed = len(w.context)
            proposals = [np.asarray(jnp.argmax(logits, axis=-1))]
            for j in range(1, k):
                logits = self.draft.decode(proposals[-1].tolist(), [e + j - 1 for e in ends], ids)
                for w in lives:
                    w.draft_placed += 1
                proposals.append(np.asarray(jnp.argmax(logits, axis=-1)))
        except CacheFullError:  # the draft's memory is full: its drafts go
            return give_way()
        drafts = np.stack(proposals, axis=1).astype(np.int32)  # [B, k]
        # 2. the target checks each request's pending token and its drafts in one batch
        t_toks = [t for w, d in zip(lives, drafts) for t in [w.context[-1]] + d.tolist()]
        t_pos = [p for e in ends for p in range(e - 1, e + k)]
        t_ids = [i for i in ids for _ in range(k + 1)]
        try:
            checked = self.engine.decode(t_toks, t_pos, t_ids)
        except CacheFullError:  # nothing placed in the target: its drafts go, the host step makes room
            return give_way()
        n_ok, nxt = jax.device_get(
            accept_drafts(
                checked.reshape(len(lives), k + 1, -1),
                np.zeros((len(lives), k, 1), np.float32),  # draft logits: unused by the greedy rule (no dispatch)
                drafts,
                self._greedy_key,
                _GREEDY,
            )
        )
        # 3. each request keeps its matching drafts and the target's token; both memories drop the rest
        self.last_batch = [(w.rid, k + 1, "decode") for w in lives]
        self.stats["steps"] += 1
        self.stats["speculative_rounds"] += 1
        for w, e, d, n, t in zip(lives, ends, drafts, n_ok.tolist(), nxt.tolist()):
            self.stats["drafted_tokens"] += k
            self.stats["accepted_tokens"] += n
            kept = e + n  # positions < kept hold the request's tokens
            if n < k:
                self.engine.rollback(w.seq, kept)
            self._draft_back_to(w, kept)
            w.placed = kept
            for token in d[:n].tolist() + [t]:
                if not self._accept(w, int(token), None, events):
                    break
        return True

    # -- decode-only stretches on the device ------------------------------------------------------

    def _device_stretch(self, events) -> bool:
        """Run up to ``sync_every`` greedy decode steps in one dispatch, when nothing else needs the host."""
        lives = list(self.running.values())
        # waiting requests that could be admitted need the host now; with every sequence id
        # running they wait for a finish anyway, which ends the stretch
        nothing_to_admit = not (self.waiting or self._inbox) or len(lives) >= self.engine.cache.n_seq_max
        if not (
            self.device_loop
            and nothing_to_admit
            and len(lives) <= self.engine.n_ubatch
            and all(w.to_feed == 1 and w.req.sampling.greedy and w.req.logprobs is None for w in lives)
        ):  # greedy rows: the device loop picks what host steps pick (device_sampling_exact)
            return False
        budgets = []
        for w in lives:
            room = self.n_ctx - w.placed if self.n_ctx is not None else self.sync_every
            budgets.append(min(w.req.max_tokens - len(w.generated), room, self.sync_every))
        if min(budgets) < 2:  # a single step: the host step does it (and its error handling)
            return False
        stops = sorted({t for w in lives for t in w.req.stop_tokens})
        active = list(range(len(lives)))
        next_pos = [w.placed for w in lives]
        counts = [0] * len(lives)
        info: dict = {}
        try:
            steps = [
                picked
                for _, picked in run_segment(
                    self.engine,
                    active,
                    [w.seq for w in lives],
                    [w.context[w.placed] for w in lives],
                    next_pos,
                    counts,
                    budgets,
                    stop_bucket(stops),
                    None,
                    self._greedy_key,  # unused by greedy sampling, but the loop carries a key
                    _GREEDY,
                    self.sync_every + 1,  # the budgets end the stretch: never a chunk that runs ahead
                    info,
                    run_ahead=False,  # so a dispatch ahead would only hand its input back
                )
            ]
        except CacheFullError:
            return False  # nothing was placed: the host step makes room
        done = set()
        fed = collections.Counter()
        for picked in steps:  # accepted after the stretch: finishing a request edits the memory
            for i, (live, token) in enumerate(zip(lives, picked.tolist())):
                if i not in done:
                    live.placed += 1
                    fed[live.rid] += 1
                    if not self._accept(live, int(token), None, events):
                        done.add(i)
        n_steps = len(steps)
        self.last_batch = [(rid, n, "decode") for rid, n in fed.items()]
        self.stats["steps"] += n_steps
        self.stats["device_stretches"] += 1
        return n_steps > 0


def percentiles(values: Sequence[float], qs: Tuple[float, ...] = (50, 99)) -> Tuple[float, ...]:
    """Percentiles of ``values`` (for latency reports); NaN when there are none."""
    if not len(values):
        return tuple(float("nan") for _ in qs)
    return tuple(float(np.percentile(np.asarray(values, np.float64), q)) for q in qs)
