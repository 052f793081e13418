"""The decode loop on the device: many tokens per dispatch, the host out of the token loop.

:func:`generate_stream <kvjax.generate_stream>`'s host loop pays, per token, for building the
ubatch, the dry run (one device read), dispatching the step, sampling and reading the tokens back.
:func:`run_segment` runs the same steps inside one ``jax.lax.while_loop`` per dispatch; its body
is, per token and for ``B`` live sequences in ``T = bucket_length(B)`` ubatch rows:

1. placement: ``memory.find_slot`` of one token per live sequence (the ubatch the host loop
   builds: the same rows, positions, sequence ids, padding and ``n_seq_tokens``);
2. the window check: the window bucket of every attention part that this placement needs
   (``Memory.windows_for``'s rule, computed on the device) must be the dispatch's static window;
3. the model step (the engine's own compiled step function, with the placement given), then
   ``memory.commit`` and ``defrag_sched`` as ``Engine.decode`` does after a batch;
4. sampling: ``key, sub = split(key)`` and :func:`kvjax.sample` on the ``[T, V]`` logits, then
   the stop tokens and each sequence's budget.

The loop leaves the device (``reason``) only when the host must act:

==========  ========================================================================================
``CHUNK``   ``sync_every`` tokens per sequence were sampled: the host reads them (a stream is due).
``STOPPED`` a sequence emitted a stop token or reached its budget (the live rows change).
``SHIFT``   a sequence's next position reached ``n_ctx``: the host does the context shift.
``WINDOW``  the next placement needs another window bucket (a new static shape): nothing placed.
``FULL``    the next placement was refused (no room): nothing placed; the host raises.
``PENDING`` the memory has pending work (a scheduled defrag): the host applies ``update``.
``REFUSED`` the step refused its ubatch (a sampled id outside the vocabulary): nothing kept.
==========  ========================================================================================

**Exactly the host loop's tokens.** Every step runs the program shape the host loop would (the
same ubatch bucket ``T`` and windows: the loop exits rather than run a step under another window
bucket, and exits when a sequence stops, so the host compacts the rows as it does), the same key
splits in the same order, and sampling on ``[T, V]`` gives rows ``0..B-1`` what sampling on the
host's ``[B, V]`` gives: greedy is per row, and with the threefry key (JAX's default, with
``jax_threefry_partitionable``, the default since JAX 0.5) the random bits of row ``r`` depend on
the row index only, not on the number of rows. :func:`device_sampling_exact` says when that holds;
otherwise ``generate`` samples on the host.

**Running ahead.** :func:`run_segment` dispatches the next chunk before it reads the current one
(the next dispatch starts from the device values, so nothing waits on the host); a dispatch whose
predecessor stopped for another reason than ``CHUNK`` runs no iteration and returns its input.

Shapes: ``T`` ubatch rows (a power of two, ``B <= T`` of them live), ``K`` = ``sync_every``
rounded up to a power of two (the token buffer), ``V`` vocabulary, ``S`` stop-token bucket.
"""

from __future__ import annotations

import functools
from typing import Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

import kvjax
from kvjax._errors import CacheFullError
from kvjax._validate import check_count
from kvjax.engine._sampling import SamplingConfig, sample
from kvjax.memory._sink_window import SinkWindow, evict_rows
from kvjax.memory._ubatch import Ubatch, bucket_length

# why a dispatch returned (see the module docstring); RUN only while the loop runs
RUN, CHUNK, STOPPED, SHIFT, WINDOW, FULL, PENDING, REFUSED = range(8)
REASONS = ("run", "chunk", "stopped", "shift", "window", "full", "pending", "refused")

#: most tokens per sequence between two host reads (``sync_every``).
MAX_SYNC_EVERY = 4096
#: "no context limit" for the traced ``n_ctx`` (positions are int32).
NO_LIMIT = 2**31 - 1


@struct.dataclass
class Carry:
    """What one iteration hands to the next (and a dispatch to the next dispatch).

    Attributes:
        tokens: ``i32[T]`` the token each row feeds next (the last one sampled).
        pos: ``i32[T]`` the position it is fed at.
        counts: ``i32[T]`` tokens sampled so far per row.
        key: the PRNG key (split once per step, as the host loop does).
        reason: ``i32[]`` why the last dispatch returned (``RUN`` while running).
    """

    tokens: jax.Array
    pos: jax.Array
    counts: jax.Array
    key: jax.Array
    reason: jax.Array


@struct.dataclass
class Rows:
    """The per-dispatch constants of the live rows (traced: new values never recompile).

    Attributes:
        seq_ids: ``i32[T, 1]`` each row's sequence id (-1 for padding rows).
        valid: ``bool[T]`` live rows (the first ``B``).
        budgets: ``i32[T]`` most tokens each row may sample in all (``max_new_tokens``).
        stops: ``i32[S]`` stop tokens, -1 padded.
        n_ctx: ``i32[]`` the context limit (``NO_LIMIT`` for none).
        limit: ``i32[]`` steps per dispatch, at most ``K`` (``sync_every``).
        n_sink, n_recent: ``i32[]`` the sink + window rule (:class:`kvjax.SinkWindow`; unused without one).
    """

    seq_ids: jax.Array
    valid: jax.Array
    budgets: jax.Array
    stops: jax.Array
    n_ctx: jax.Array
    limit: jax.Array
    n_sink: jax.Array
    n_recent: jax.Array


def device_sampling_exact(key, sampling: SamplingConfig) -> bool:
    """Whether sampling ``[T, V]`` rows on the device draws what the host's ``[B, V]`` draws.

    Greedy always; otherwise only for threefry keys with ``jax_threefry_partitionable`` (the bits
    of an element then depend on its index alone, so the first ``B`` rows do not depend on ``T``).
    """
    if sampling.greedy:
        return True
    if not jax.config.jax_threefry_partitionable:
        return False
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return "threefry" in str(jax.random.key_impl(key))
    return "threefry" in str(jax.config.jax_default_prng_impl)


def _window_ok(memory, extent, placement, windows) -> jax.Array:
    """Whether ``placement`` needs exactly the static ``windows`` (``Memory.windows_for``'s rule)."""
    ok = jnp.bool_(True)
    for p in range(memory.n_parts):
        cfg = memory.part(p).config
        slots = memory.part_slots(placement, p)
        top = jnp.maximum(extent[p], jnp.max(slots) + 1)
        top = jnp.clip(top, 1, cfg.size)
        buckets = kvjax.window_buckets(cfg.size, cfg.padding)
        i = buckets.index(windows[p])
        below = buckets[i - 1] if i else 0
        ok = ok & (top > below) & (top <= windows[p])
    return ok


def _loop(
    jitted_step,
    equal,
    contiguous,
    thold,
    sampling,
    window_form,
    state,
    rest,
    buffers,
    carry: Carry,
    rows: Rows,
    *,
    windows,
    k,
):
    t = rows.valid.shape[0]
    memory = rest.join(buffers)
    start = (carry.reason == RUN) | (carry.reason == CHUNK)
    out = jnp.zeros((k, t), jnp.int32)
    init = (memory, carry.replace(reason=jnp.where(start, RUN, carry.reason)), out, jnp.int32(0))

    def cond(c):
        return c[1].reason == RUN

    def body(c):
        memory, cur, out, n_done = c
        if window_form is not None:
            # sink + window: the oldest token after the sinks leaves before each row's token is placed
            # (compacted: the rest moves back and K is re-rotated here). Kept even when the step
            # below does not run: the carry's positions say where the next token goes, and the
            # host reads them back when the segment ends
            memory, pos = evict_rows(
                memory,
                rows.seq_ids[:, 0],
                cur.pos,
                rows.valid,
                rows.n_sink,
                rows.n_recent,
                compact=window_form == "compact",
            )
            if window_form == "compact":
                memory = memory.update()
            cur = cur.replace(pos=pos)
        ub = Ubatch(pos=cur.pos, seq_ids=rows.seq_ids, valid=rows.valid, n_seq_tokens=1 if equal else 0)
        placed, placement, ok = memory.find_slot(ub, contiguous=contiguous)
        fits = ok & _window_ok(memory, memory.extent(), placement, windows)
        # The step always runs: a placement that does not fit is voided (it writes nothing) and
        # the metadata from before it is kept. Branching around the step with lax.cond instead
        # made XLA copy the whole K/V buffers inside the branch (4 copies of every K/V group
        # per token, measured in the compiled HLO); a wasted step once per dispatch is cheaper.
        placement = placed.mask_placement(placement, fits)
        buf, placed_rest = placed.split()
        logits, new, stepped = jitted_step(state, placed_rest, buf, ub, cur.tokens, placement, None, windows=windows)
        good = fits & stepped
        done = new.commit((ub,))
        if thold is not None:
            done = kvjax.defrag_sched(done, thold)
        # a refused or misfit step keeps the metadata from before this token (its writes were
        # voided or landed in free cells, which no token sees). Only the metadata is selected,
        # never the K/V or state buffers (a select of those would copy the whole cache per token)
        buf, _ = new.split()
        _, committed = done.split()
        _, before = memory.split()
        new = jax.tree.map(lambda a, b: jnp.where(good, a, b), committed, before).join(buf)
        key, sub = jax.random.split(cur.key)
        picked = jnp.where(rows.valid, sample(logits, sub, sampling), 0)
        counts = cur.counts + rows.valid
        pos = cur.pos + rows.valid
        stopped = rows.valid & (jnp.isin(picked, rows.stops) | (counts >= rows.budgets))
        reason = jnp.select(
            [
                ~fits,
                ~stepped,
                jnp.any(stopped),
                jnp.any(rows.valid & (pos >= rows.n_ctx)),
                new.pending(),
                n_done + 1 >= rows.limit,
            ],
            [jnp.where(ok, WINDOW, FULL), REFUSED, STOPPED, SHIFT, PENDING, CHUNK],
            RUN,
        ).astype(jnp.int32)
        # a step that did not run keeps the carry too, so the host sees the state from before it
        # (a cond on these small values only: the key may be a typed PRNG key, which where refuses)
        new_c = (
            Carry(tokens=picked, pos=pos, counts=counts, key=key, reason=reason),
            out.at[n_done].set(picked),
            n_done + 1,
        )
        old_c = (cur.replace(reason=reason), out, n_done)
        return (new,) + jax.lax.cond(good, lambda: new_c, lambda: old_c)

    memory, carry, out, n_done = jax.lax.while_loop(cond, body, init)
    buffers, rest = memory.split()
    return rest, buffers, carry, out, n_done


@functools.lru_cache(maxsize=64)
def _jit_loop(jitted_step, equal, contiguous, thold, sampling, window_form):
    # one jitted loop per compiled step function (shared by engines of one model structure, as
    # the step is), placement kind, policy and window form: new prompts, keys, budgets, stops
    # and window sizes are traced
    return jax.jit(
        functools.partial(_loop, jitted_step, equal, contiguous, thold, sampling, window_form),
        static_argnames=("windows", "k"),
        donate_argnames=("buffers",),
    )


def check_sync_every(sync_every) -> int:
    """``sync_every`` as an int in ``[1, MAX_SYNC_EVERY]``, or ``ValueError`` naming it."""
    return check_count("sync_every", sync_every, 1, MAX_SYNC_EVERY)


def stop_bucket(stop_tokens: Sequence[int]) -> np.ndarray:
    """Stop tokens as ``i32[S]``, ``S`` a power of two (-1 padded), so their number rarely recompiles."""
    out = np.full(bucket_length(len(stop_tokens)), -1, np.int32)
    out[: len(stop_tokens)] = list(stop_tokens)
    return out


def run_segment(
    engine,
    active: List[int],
    sid: List[int],
    feed: List[int],
    next_pos: List[int],
    counts: List[int],
    budgets: List[int],
    stops: np.ndarray,
    n_ctx: Optional[int],
    key,
    sampling: SamplingConfig,
    sync_every: int,
    info: dict,
    window: Optional[SinkWindow] = None,
    run_ahead: bool = True,
) -> Iterator[Tuple[int, np.ndarray]]:
    """Feed ``feed`` and keep generating on the device until the host must act.

    Args:
        engine: the :class:`kvjax.Engine`; ``engine.cache`` is replaced as dispatches return (and is
            always a live memory, so a caller that stops iterating keeps a valid cache).
        active: the ``B`` live sequence indices (``generate``'s ``s``), in row order.
        sid: the memory's sequence id of each index.
        feed: ``B`` tokens to feed first (each live sequence's last sampled token).
        next_pos: per index, the position ``feed`` goes to (updated in place, per step).
        counts: per index, tokens sampled so far (updated in place, per step).
        budgets: per index, most tokens to sample (``max_new_tokens``).
        stops: :func:`stop_bucket` of the stop tokens.
        n_ctx: the context limit or None.
        key: the PRNG key after the host's last split.
        sampling: the sampling rule.
        sync_every: most steps per dispatch.
        info: filled with ``key`` (the key after the last step), ``reason`` (the last dispatch's)
            and ``dispatches`` (added to).
        window: a :class:`kvjax.SinkWindow` applied before every step (on the device).
        run_ahead: dispatch the next chunk before reading this one (see the module docstring);
            False for a caller whose budgets end the segment within one chunk (a scheduler's
            stretch), where the dispatch ahead would only return its input.

    Yields:
        ``(step, picked)`` per completed step: ``picked`` the ``i32[B]`` sampled tokens in row order.
        ``counts`` is already advanced when it is yielded; ``next_pos`` holds the positions at
        the end of the step's dispatch (its steps taken and, with a window, its evictions made).

    Raises:
        kvjax.CacheFullError: the first placement does not fit (nothing placed), as ``decode``.
    """
    b = len(active)
    t = bucket_length(b)
    memory = engine.cache
    pos = [next_pos[s] for s in active]
    ids = [[sid[s]] for s in active]
    _, ubatches = engine._ubatches(pos, ids)
    assert len(ubatches) == 1 and ubatches[0].length == t, "one ubatch per step (checked by the caller)"
    # the dry run of the first step, as Engine.decode does: pending work, room, the exact windows
    pending, ok, placements, extent = jax.device_get(engine._plan(ubatches))
    if bool(pending):
        engine.cache = memory = memory.update(donate=True)
        pending, ok, placements, extent = jax.device_get(engine._plan(ubatches))
    if not bool(ok):
        size = memory.size
        free = size - int(memory.used_cells())
        raise CacheFullError(
            f"batch of {b} tokens does not fit ({free} free cells of {size}); nothing was "
            f"placed: free cells with seq_rm or shift the context"
        )
    windows = memory.windows_for(placements, extent)[0]
    k = bucket_length(sync_every)

    def pad(values, fill):
        out = np.full(t, fill, np.int32)
        out[:b] = values
        return out

    rows = Rows(
        seq_ids=pad([sid[s] for s in active], -1)[:, None],
        valid=np.arange(t) < b,
        budgets=pad([budgets[s] for s in active], 0),
        stops=stops,
        n_ctx=np.int32(NO_LIMIT if n_ctx is None else n_ctx),
        limit=np.int32(sync_every),
        n_sink=np.int32(window.n_sink if window else 0),
        n_recent=np.int32(window.n_recent if window else 1),
    )
    carry = Carry(
        tokens=pad(feed, 0), pos=pad(pos, 0), counts=pad([counts[s] for s in active], 0), key=key, reason=np.int32(RUN)
    )
    form = None if window is None else "compact" if window.compact else "masked"
    loop = _jit_loop(
        engine.step._jitted, memory.ubatch_split == "equal", engine.contiguous, engine.defrag_thold, sampling, form
    )

    def dispatch(carry):
        buffers, rest = engine.cache.split()
        rest, buffers, carry, out, n_done = loop(engine.state, rest, buffers, carry, rows, windows=windows, k=k)
        engine.cache = rest.join(buffers)  # the previous buffers were donated: this is the live memory
        info["dispatches"] = info.get("dispatches", 0) + 1
        return carry, out, n_done

    current = dispatch(carry)
    step = 0
    while True:
        # run ahead: the next chunk is queued before this one is read (a no-op unless this one
        # returned CHUNK), so the device works while the host hands tokens out
        ahead = dispatch(current[0]) if run_ahead else None
        out, n_done, reason, pos = jax.device_get((current[1], current[2], current[0].reason, current[0].pos))
        # the carry's positions: one per step taken and, with a window, the evictions made (also
        # one before a step that did not run, see _loop)
        for j, s in enumerate(active):
            next_pos[s] = int(pos[j])
        for i in range(int(n_done)):
            for s in active:
                counts[s] += 1
            engine.n_decoded += b
            yield step, out[i, :b]
            step += 1
        if int(reason) != CHUNK:
            info["reason"] = REASONS[int(reason)]
            info["key"] = (ahead if run_ahead else current)[0].key
            return
        current = ahead if run_ahead else dispatch(current[0])
