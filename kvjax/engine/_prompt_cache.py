"""A prompt cache that lives on the device: finished sequences stay parked, new prompts reuse them.

Serving systems win most of their time to first token by reusing what earlier requests computed.
kvjax's cells make reuse token-granular and free: ``seq_cp`` shares cells by setting a bit. What
this module adds is remembering finished sequences and finding the longest match for a new prompt:

- **parked sequences**: a finished request's sequence stays in the memory; its tokens are kept in a
  small device pytree (:class:`PromptStore`, ``i32[S, L]`` tokens, lengths, a last-use clock);
- **matching on the device**: one jitted call computes the common prefix of a new prompt with
  every parked sequence at once (no loop over cached prompts, no copy of the token store to the
  host: two integers come back);
- **reuse**: the best match is lent to the new sequence with the memory's ``share_prefix`` (the
  unified cache shares the cells; the iSWA pair only while its window cache still holds what the
  first new token can see; a recurrent or hybrid memory only at a position a state was kept for,
  consuming the parked sequence when that needs a rollback), so only the rest of the prompt is
  evaluated;
- **eviction**: when the request would not fit (a dry run of every token it may place) or there
  are not enough free sequence ids, parked sequences are removed in least-recently-used order;
  the evictions are tried on a copy of the memory (memories are values), so a request that cannot
  fit even then raises :class:`kvjax.CacheFullError` with nothing changed.

Example:
    >>> import jax, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    >>> engine = kvjax.Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=128, n_seq_max=4)))
    >>> cache = PromptCache(n_seq_max=4, max_tokens=64)
    >>> greedy = kvjax.SamplingConfig(temperature=0)
    >>> a = kvjax.generate(engine, [[1, 2, 3, 4, 5]], max_new_tokens=3, key=jax.random.PRNGKey(0), sampling=greedy,
    ...                    prompt_cache=cache)
    >>> b = kvjax.generate(engine, [[1, 2, 3, 4, 5, 6]], max_new_tokens=3, key=jax.random.PRNGKey(0),
    ...                    sampling=greedy, prompt_cache=cache)
    >>> a.prompt_tokens, b.prompt_tokens, cache.parked()          # the second prompt evaluated 1 token
    (5, 1, [0, 1])
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._errors import CacheFullError, StateError
from kvjax._typing import Array, Int
from kvjax._validate import check_count, check_flag
from kvjax.engine._host_tier import HostTier

__all__ = ["PromptCache", "PromptStore", "match_prefix"]


@struct.dataclass
class PromptStore:
    """The tokens of the parked sequences, on the device.

    Attributes:
        tokens: ``i32[S, L]`` the tokens each parked sequence holds (positions ``0..length-1``).
        length: ``i32[S]`` tokens held, 0 for a sequence that is not parked.
        last_used: ``i32[S]`` the clock value of the last park or reuse (least recently used first).
    """

    tokens: Int[Array, "S L"]
    length: Int[Array, " S"]
    last_used: Int[Array, " S"]


@jax.jit
def match_prefix(store: PromptStore, prompt: Int[Array, " L"], n: Int[Array, ""]):
    """The parked sequence sharing the longest prefix with ``prompt[:n]``, and that length.

    Ties go to the most recently used sequence. Returns ``(seq i32[], length i32[])``; the length
    is 0 when nothing matches.
    """
    width = store.tokens.shape[1]
    col = jnp.arange(width)
    same = (store.tokens == prompt[None]) & (col[None] < store.length[:, None]) & (col[None] < n)
    # the first column that differs (a min-reduction; a cumulative product over L is several times slower)
    common = jnp.min(jnp.where(same, width, col[None]), axis=1)
    best_common = jnp.max(common)
    recent = jnp.where(common == best_common, store.last_used, -1)
    return jnp.argmax(recent).astype(jnp.int32), best_common.astype(jnp.int32)


@jax.jit
def _set(store: PromptStore, seq, row, length, clock) -> PromptStore:
    return PromptStore(
        tokens=store.tokens.at[seq].set(row),
        length=store.length.at[seq].set(length),
        last_used=store.last_used.at[seq].set(clock),
    )


class PromptCache:
    """Parked sequences of one memory and their tokens (see the module docstring).

    Args:
        n_seq_max: sequence ids of the memory it serves.
        max_tokens: most tokens remembered per parked sequence (longer ones keep their first
            ``max_tokens``; a match is never longer than what is remembered).
        host_bytes: the host tier's budget (0: none). With it, a parked sequence that must leave
            the device (to free cells or a sequence id) moves to host memory instead of being
            dropped, and comes back into free cells when a prompt matches it better than anything
            on the device (:mod:`kvjax.engine._host_tier`); the least recently used host entries
            leave when the budget is reached. llama.cpp's ``--cache-ram``.
        idle_to_host: move every parked sequence to the host tier as soon as its request ends,
            so parked prefixes hold no device cells and widen no window (llama.cpp's
            ``--cache-idle-slots``); needs ``host_bytes``.
    """

    def __init__(self, n_seq_max: int, max_tokens: int, *, host_bytes: int = 0, idle_to_host: bool = False):
        n_seq_max = check_count("n_seq_max", n_seq_max, 1)
        max_tokens = check_count("max_tokens", max_tokens, 1)
        host_bytes = check_count("host_bytes", host_bytes, 0)
        self.idle_to_host = check_flag("idle_to_host", idle_to_host)
        if idle_to_host and not host_bytes:
            raise ValueError(
                "idle_to_host=True is out of range with host_bytes=0: allowed with a host tier "
                "(host_bytes > 0), where the idle sequences go"
            )
        if n_seq_max * max_tokens > 2**28:
            raise ValueError(f"max_tokens={max_tokens} is out of range: allowed n_seq_max * max_tokens <= 2**28")
        self.n_seq_max, self.max_tokens = n_seq_max, max_tokens
        self._reserved: set = set()  # ids in use by the caller during one attach
        self.store = PromptStore(
            tokens=jnp.zeros((n_seq_max, max_tokens), jnp.int32),
            length=jnp.zeros((n_seq_max,), jnp.int32),
            last_used=jnp.zeros((n_seq_max,), jnp.int32),
        )
        self.clock = 0
        self._lengths = np.zeros(n_seq_max, np.int64)  # host mirror of store.length (tiny)
        self._used = np.zeros(n_seq_max, np.int64)
        self._tokens: List[List[int]] = [[] for _ in range(n_seq_max)]  # host mirror of store.tokens rows
        #: the host tier (None without ``host_bytes``)
        self.host: Optional[HostTier] = HostTier(host_bytes) if host_bytes else None
        #: tokens lent to new sequences, and parked sequences evicted from the device (dropped, or
        #: moved to the host tier), since construction
        self.reused_tokens = 0
        self.evictions = 0
        #: sequences moved to the host tier and brought back from it, since construction
        self.offloads = 0
        self.restores = 0

    # -- bookkeeping ------------------------------------------------------------------------------

    def parked(self) -> List[int]:
        """The parked sequence ids, ascending."""
        return [int(s) for s in np.flatnonzero(self._lengths)]

    def tokens(self, seq_id: int) -> List[int]:
        """The tokens parked as ``seq_id`` (empty when it is not parked)."""
        return list(self._tokens[int(seq_id)])

    def lru(self) -> List[int]:
        """The parked sequence ids, least recently used first."""
        parked = self.parked()
        return sorted(parked, key=lambda s: self._used[s])

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def park(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Remember that sequence ``seq_id`` of the memory holds ``tokens`` at positions ``0..n-1``."""
        tokens = list(tokens)[: self.max_tokens]
        row = np.zeros(self.max_tokens, np.int32)
        row[: len(tokens)] = tokens
        clock = self._tick()
        self.store = _set(self.store, np.int32(seq_id), row, np.int32(len(tokens)), np.int32(clock))
        self._lengths[seq_id] = len(tokens)
        self._used[seq_id] = clock
        self._tokens[seq_id] = [int(t) for t in tokens]

    def forget(self, seq_id: int) -> None:
        """``seq_id`` is no longer parked (its cells are the caller's business)."""
        self.store = _set(self.store, np.int32(seq_id), np.zeros(self.max_tokens, np.int32), np.int32(0), np.int32(0))
        self._lengths[seq_id] = 0
        self._used[seq_id] = 0
        self._tokens[seq_id] = []

    def _touch(self, seq_id: int) -> None:
        clock = self._tick()
        self.store = self.store.replace(last_used=self.store.last_used.at[seq_id].set(clock))
        self._used[seq_id] = clock

    def match(self, prompt: Sequence[int]) -> Tuple[int, int]:
        """``(seq, length)``: the parked sequence with the longest common prefix with ``prompt``."""
        if not self.parked():
            return -1, 0
        row = np.zeros(self.max_tokens, np.int32)
        n = min(len(prompt), self.max_tokens)
        row[:n] = list(prompt)[:n]
        seq, length = jax.device_get(match_prefix(self.store, row, np.int32(n)))
        return (int(seq), int(length)) if int(length) > 0 else (-1, 0)

    # -- what generate does with it -----------------------------------------------------------------

    def attach(
        self, engine, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, reserved: Sequence[int] = ()
    ) -> Tuple[List[int], List[int]]:
        """Give each prompt a sequence id and lend it the longest usable parked prefix.

        ``reserved``: sequence ids that are in use although they may hold no cells yet (a
        scheduler's admitted requests); they are never given out.

        Returns:
            ``(seq_ids, held)``: the memory's sequence id of each prompt and how many of its first
            tokens the memory already holds for it (evaluate only the rest).

        Raises:
            kvjax.CacheFullError: the request does not fit even with every parked sequence evicted;
                nothing changed (memory and cache).
        """
        memory = engine.cache
        if memory.n_seq_max != self.n_seq_max:
            raise ValueError(f"prompt_cache has n_seq_max={self.n_seq_max}: allowed the memory's {memory.n_seq_max}")
        saved = (
            self.store,
            self.clock,
            self._lengths.copy(),
            self._used.copy(),
            list(self._tokens),
            self.evictions,
            self.offloads,
            self.restores,
            self.host.snapshot() if self.host else None,
        )
        self._reserved = {int(s) for s in reserved}
        try:
            memory = self._from_host(memory, prompts)
            return self._attach(engine, memory, prompts, max_new_tokens)
        except Exception:
            (
                self.store,
                self.clock,
                self._lengths,
                self._used,
                self._tokens,
                self.evictions,
                self.offloads,
                self.restores,
                host,
            ) = saved
            if host is not None:
                self.host.restore(host)
            raise
        finally:
            self._reserved = set()

    def _attach(self, engine, memory, prompts, max_new_tokens):
        n = len(prompts)
        matches = []
        for prompt in prompts:
            src, length = self.match(prompt)
            matches.append((src, min(length, len(prompt) - 1)))  # the last prompt token is evaluated
        # a prompt that extends everything a parked sequence holds continues that sequence in place
        seq_ids = [None] * n
        for i, (src, m) in enumerate(matches):
            if src < 0 or m == 0 or src in seq_ids or self._lengths[src] != int(memory.seq_pos_max(np.int32(src))) + 1:
                continue
            if m == self._lengths[src] - 1 == len(prompts[i]) - 1:
                # the prompt is exactly what the sequence holds (a session loaded from a file): its
                # last token is evaluated again for the logits, so that position is removed first
                cut, ok = memory.seq_rm(np.int32(src), np.int32(m), np.int32(-1))
                if not bool(ok):  # a recurrent state that cannot step back: lend the prefix instead
                    continue
                memory = cut
            elif m != self._lengths[src]:
                continue
            seq_ids[i] = src
        protected = {src for src, m in matches if src >= 0 and m > 0}
        free = self._free_ids(memory)
        evictable = [s for s in self.lru() if s not in protected]
        # not enough sequence ids: the least recently used parked sequences make room
        while len(free) < seq_ids.count(None) and evictable:
            memory = self._evict(memory, evictable.pop(0))
            free.append(self._last_evicted)
        if len(free) < seq_ids.count(None):
            raise ValueError(
                f"{n} prompts are out of range: allowed at most {len(free) + n - seq_ids.count(None)} "
                f"(free sequence ids of n_seq_max={self.n_seq_max}, every unmatched parked one evicted)"
            )
        free = iter(sorted(free))
        held = []
        for i, (src, m) in enumerate(matches):
            if seq_ids[i] is not None:  # continues its own parked sequence
                self.forget(src)
                held.append(m)
                continue
            dst = seq_ids[i] = next(free)
            shared = 0
            if src >= 0 and m > 0:
                memory, shared, consumed = memory.share_prefix(src, dst, m)
                if consumed:
                    self.forget(src)
                elif shared:
                    self._touch(src)
            held.append(shared)
        # a dry run of every token the request may place; evict least recently used until it fits
        while not engine.fits(memory, [(s, h, len(p) + max_new_tokens) for s, h, p in zip(seq_ids, held, prompts)]):
            candidates = [s for s in self.lru() if s not in seq_ids]
            if not candidates:
                raise CacheFullError(
                    f"a request of {n} prompts and {max_new_tokens} new tokens each does not fit "
                    f"even with every parked sequence evicted; nothing changed"
                )
            memory = self._evict(memory, candidates[0])
        engine.cache = memory
        self.reused_tokens += sum(held)
        return seq_ids, held

    def _evict(self, memory, victim: int):
        """``victim`` leaves the device: to the host tier when there is one, else it is dropped."""
        if self.host is not None:
            if bool(memory.pending()):  # a blob holds no pending shift: apply it first
                memory = memory.update()
            if self.host.put(self._tokens[victim], memory.state_write(victim)):
                self.offloads += 1
        memory, _ = memory.seq_rm(np.int32(victim), np.int32(-1), np.int32(-1))
        self.forget(victim)
        self.evictions += 1
        self._last_evicted = victim
        return memory

    def evict_lru(self, engine) -> int:
        """Evict the least recently used parked sequence from ``engine``'s memory (to the host tier
        when there is one); returns its id.

        Raises:
            ValueError: nothing is parked.
        """
        if not self.parked():
            raise ValueError("evict_lru needs a parked sequence: nothing is parked")
        engine.cache = self._evict(engine.cache, self.lru()[0])
        return self._last_evicted

    # -- the host tier ------------------------------------------------------------------------------

    def to_host(self, engine, seq_ids: Optional[Sequence[int]] = None) -> List[int]:
        """Move parked sequences (default: all) from the device to the host tier; their cells are freed.

        Returns:
            The sequence ids that left the device (a sequence larger than the whole budget is
            dropped instead, counted in ``host.evictions``).
        """
        if self.host is None:
            raise ValueError("to_host needs a host tier: allowed on a PromptCache(..., host_bytes > 0)")
        parked = self.parked()
        moved = parked if seq_ids is None else [int(s) for s in seq_ids]
        for s in moved:
            if s not in parked:
                raise ValueError(f"seq_id={s} is out of range: allowed a parked sequence, one of {parked}")
        memory = engine.cache
        for s in moved:
            memory = self._evict(memory, s)
        engine.cache = memory
        return moved

    def _free_ids(self, memory) -> List[int]:
        taken = set(self.parked()) | self._reserved
        return [s for s in range(self.n_seq_max) if s not in taken and int(memory.seq_pos_max(np.int32(s))) < 0]

    def _from_host(self, memory, prompts):
        """Bring back, into free cells, each host entry that matches a prompt better than the device does.

        A sequence id or cells are made by moving the least recently used parked sequences that no
        prompt of this request matches to the host; an entry that still does not fit stays there
        (the prompt is then evaluated, from the device's best match).
        """
        if self.host is None or not len(self.host):
            return memory
        wanted = {}
        for prompt in prompts:
            key, length = self.host.match(prompt)
            if key >= 0 and length > self.match(prompt)[1]:
                wanted[key] = max(wanted.get(key, 0), length)
        protected = {self.match(p)[0] for p in prompts} - {-1}
        options = {"contiguous": False} if "contiguous" in inspect.signature(memory.state_read).parameters else {}
        for key in wanted:
            entry = self.host.take(key)
            while True:
                free = self._free_ids(memory)
                if free:
                    try:
                        memory = memory.state_read(entry.blob, free[0], **options)
                        self.park(free[0], entry.tokens.tolist())
                        protected.add(free[0])
                        self.restores += 1
                        break
                    except (StateError, CacheFullError):
                        pass  # not enough free cells: make room below, or give up
                victims = [s for s in self.lru() if s not in protected]
                if not victims:
                    self.host.put(entry.tokens, entry.blob)  # it stays on the host
                    break
                memory = self._evict(memory, victims[0])
        return memory
