"""The decode driver (the seed's ``llama_decode`` over kvjax) and the generation loop around it.

:class:`Engine` owns a model, its state and a cache. ``engine.decode(tokens, pos, seq_ids)``
runs one batch the way llama.cpp does:

1. apply what is pending (``kvjax.update``: K-shift, then defrag);
2. split the batch into ubatches of at most ``n_ubatch`` tokens (``kvjax.split_simple``), each
   padded to a power-of-two length bucket;
3. dry-run the placement of all of them (``kvjax.prepare``); if they do not all fit, raise
   :class:`kvjax.CacheFullError` with the cache exactly as it was (nothing has run yet);
4. run the jitted model step per ubatch (placement + model, donating the K/V buffers), with the
   window bucket of each ubatch computed on the host from the dry run's slots;
5. schedule a defrag when fragmentation passes ``defrag_thold`` (applied by the next update).

Restore/commit: because the dry run proves every ubatch fits before anything is written, a batch
either fails before placing anything (only the pending update of step 1 has been applied, as in
the seed) or succeeds whole; there is no partial state to restore.

:func:`generate` is the loop users write around it: several prompts at once, a shared prompt
prefix evaluated once and shared with ``seq_cp``, parallel sampling of n continuations of one
prompt, greedy/temperature/top-k/top-p sampling with an explicit key, stop tokens and length
limits, streaming, context shift when a sequence reaches its context limit, and optional defrag.
Speculative drafts are rolled back with :meth:`Engine.rollback` (``seq_rm``).

Example:
    >>> import jax, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    >>> engine = Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=64, n_seq_max=2)))
    >>> out = generate(engine, [[1, 2, 3], [4, 5]], max_new_tokens=4, key=jax.random.PRNGKey(0),
    ...                sampling=kvjax.SamplingConfig(temperature=0))
    >>> [len(t) for t in out.tokens], int(kvjax.used_cells(engine.cache))
    ([4, 4], 11)
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax._compiles import CompileCounter, total_compile_seconds
from kvjax._errors import CacheFullError
from kvjax._validate import check_count, check_flag
from kvjax.engine._device_loop import (check_sync_every, device_sampling_exact, run_segment,
                                       stop_bucket)
from kvjax.engine._sampling import SamplingConfig, sample
from kvjax.engine._speculative import check_draft, speculative_stream
from kvjax.engine._prompt_cache import PromptCache
from kvjax.memory._sink_window import SinkWindow, check_window_memory, sink_window_evict
from kvjax.memory._streams import StreamCache
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory
from kvjax.memory._ubatch import bucket_length, make_equal_ubatch, make_ubatch, split_equal, split_simple
from kvjax.nn._step import make_step, output_bucket

#: The most tokens one generate call may ask for per sequence: its counters and positions are int32,
#: and a context shift keeps positions below the end of their range however long it runs.
MAX_NEW_TOKENS = 2**30


def _equal_ubatches(pos: np.ndarray, seq_ids, n_ubatch: int, n_seq_max: int):
    """A batch as equal-split ubatches (``kvjax.split_equal``), each slot length a power of two.

    ``split_equal`` gives ubatches of ``n_seqs`` blocks of ``t`` rows; each is cut into pieces
    whose length is a power of two (13 = 8 + 4 + 1), so a prompt of any length compiles at most
    log2(n_ubatch) programs. Returns the batch rows of each ubatch in its row order, and the ubatches.
    """
    parts, ubatches = [], []
    for part in split_equal(seq_ids, n_ubatch):
        blocks = []
        for i in part:
            key = tuple(sorted(set(int(x) for x in seq_ids[i])))
            if not blocks or blocks[-1][0] != key:
                blocks.append((key, []))
            blocks[-1][1].append(int(i))
        t, off = len(blocks[0][1]), 0
        while off < t:
            c = 1 << ((t - off).bit_length() - 1)          # the largest power of two that is left
            rows = [b[off:off + c] for _, b in blocks]
            slots = [(pos[r], [int(x) for x in seq_ids[r[0]]]) for r in rows]
            ubatches.append(make_equal_ubatch(slots, n_seq_max=n_seq_max))
            parts.append(np.concatenate([np.asarray(r) for r in rows]))
            off += c
    return parts, tuple(ubatches)


@functools.partial(jax.jit, static_argnames="contiguous")
def _plan(rest: Memory, ubatches, contiguous):
    """Pending work, the dry run of every ubatch and the extent, for one device-to-host read.

    ``rest`` is the memory without its buffers (``memory.split()``): the plan reads metadata only.
    """
    ok, placements = rest.prepare(ubatches, contiguous=contiguous)
    return rest.pending(), ok, placements, rest.extent()


def _output_rows(outputs, seq_ids) -> Optional[np.ndarray]:
    """The batch rows ``Engine.decode``'s ``outputs`` names (``None`` for every row), or ``ValueError``."""
    n = len(seq_ids)
    if isinstance(outputs, str):
        if outputs == "all":
            return None
        if outputs == "last":
            last = {}
            for i, ids in enumerate(seq_ids):
                for s in ids:
                    last[int(s)] = i
            return np.unique(np.fromiter(last.values(), np.int64, len(last)))
    elif outputs is not None and not isinstance(outputs, (bytes, dict, set)):
        rows = np.asarray(outputs)
        if rows.ndim == 1 and (rows.size == 0 or np.issubdtype(rows.dtype, np.integer)):
            rows = rows.astype(np.int64)
            if rows.size and (rows.min() < 0 or rows.max() >= n):
                bad = int(rows.min()) if rows.min() < 0 else int(rows.max())
                raise ValueError(f"outputs contains row {bad}: allowed batch rows in [0, {n})")
            return rows
    raise ValueError(f"outputs={outputs!r} is out of range: allowed 'all', 'last' or a list of batch row indices "
                     f"in [0, {n})")


class Engine:
    """A model, its state and a kvjax cache, driven batch by batch.

    Args:
        model: an NNX model called as ``model(tokens, memory, inputs)`` (e.g.
            :class:`kvjax.nn.Llama`), or a linen module with ``state`` given.
        cache: the memory (``kvjax.init(...)``, any kind); the engine owns it from now on (its
            buffers are donated to each step: use ``engine.cache``, never the value passed in).
        state: the model state; default ``nnx.state(model)``.
        n_ubatch: most tokens per ubatch (the seed's ``n_ubatch``).
        contiguous: the seed's contiguous placement (True) or scattered (False).
        defrag_thold: schedule a defrag after a batch when ``kvjax.fragmentation`` exceeds it
            (None: never, as the seed's default).
    """

    def __init__(self, model, cache: Memory, *, state=None, n_ubatch: int = 64, contiguous: bool = True,
                 defrag_thold: Optional[float] = None):
        require_memory(cache, "cache")
        check_count("n_ubatch", n_ubatch, 1)
        if defrag_thold is not None and not 0 <= defrag_thold < 1:
            raise ValueError(f"defrag_thold={defrag_thold} is out of range: allowed [0, 1) or None")
        self.model = model
        self.state = nnx.state(model) if state is None else state
        self.cache = cache
        self.n_ubatch = int(n_ubatch)
        self.contiguous = check_flag("contiguous", contiguous)
        self.defrag_thold = defrag_thold
        self.step = make_step(model, contiguous=self.contiguous)  # shared by equal models
        self.n_decoded = 0

    @property
    def config(self):
        return self.cache.config

    @property
    def vocab_size(self) -> Optional[int]:
        """The model's vocabulary size when its config says it (token ids are checked against it)."""
        return getattr(getattr(self.model, "config", None), "vocab_size", None)

    def _plan(self, ubatches):
        _, rest = self.cache.split()
        return _plan(rest, ubatches, contiguous=self.contiguous)

    def decode(self, tokens: Sequence[int], pos: Sequence[int], seq_ids: Sequence[Sequence[int]], *,
               outputs="all") -> jax.Array:
        """Evaluate a batch of tokens; return the logits of the rows asked for (default every token).

        Args:
            tokens: n token ids.
            pos: n positions.
            seq_ids: n non-empty lists of sequence ids.
            outputs: which batch rows need logits (llama.cpp's ``batch.logits``): ``"all"`` (every
                row, in batch order), ``"last"`` (the last row of each sequence in the batch, in
                batch order: what sampling the next token needs), or a list of batch row
                indices in ``[0, n)`` (any order, repeats allowed; empty for none). Every row
                is evaluated and cached either way; only the output head skips the others, so a
                prefill's cost and memory do not scale with ``n x V``.

        Returns:
            ``f32[n, V]`` logits (on the device) with ``"all"``; ``f32[R, V]`` of the R rows
            asked for otherwise (row ``r`` for batch row ``outputs[r]``).

        Raises:
            kvjax.CacheFullError: the batch does not fit; nothing of it was placed or written (a
                pending K-shift or defrag has been applied first, as in the seed).
            ValueError: malformed tokens (non-integer, outside the vocabulary), positions,
                sequence ids or outputs; nothing was evaluated.
        """
        tokens = np.asarray(tokens)
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"tokens has dtype {tokens.dtype}: allowed integer token ids")
        tokens = tokens.astype(np.int64).reshape(-1)
        pos = np.asarray(pos)
        if pos.ndim != 1 or (pos.size and not np.issubdtype(pos.dtype, np.integer)):
            raise ValueError(f"pos has shape {pos.shape} and dtype {pos.dtype}: allowed a 1-d list of integer "
                             f"positions, one per token")
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
            raise ValueError(f"seq_ids={seq_ids!r} is out of range: allowed one list of sequence ids per token")
        if not (len(tokens) == len(pos) == len(seq_ids)) or len(tokens) == 0:
            raise ValueError(f"tokens, pos and seq_ids have lengths {len(tokens)}, {len(pos)}, {len(seq_ids)}: "
                             f"allowed one equal, positive length")
        vocab = getattr(getattr(self.model, "config", None), "vocab_size", None)
        if vocab is not None and (tokens.min() < 0 or tokens.max() >= vocab):
            bad = int(tokens.min()) if tokens.min() < 0 else int(tokens.max())
            raise ValueError(f"tokens contains {bad}: allowed ids in [0, {vocab})")
        tokens = tokens.astype(np.int32)
        pos = np.asarray(pos)
        wanted = _output_rows(outputs, seq_ids)
        # a recurrent memory takes equal splits: the same number of tokens of each sequence per ubatch
        equal = self.cache.ubatch_split == "equal"
        parts, ubatches = self._ubatches(pos, seq_ids)
        # one transfer: pending work, whether the batch fits, where it goes, the current extent
        pending, ok, placements, extent = jax.device_get(self._plan(ubatches))
        if bool(pending):  # the seed's order: apply the pending work (K-shift, defrag), then place
            self.cache = self.cache.update(donate=True)
            pending, ok, placements, extent = jax.device_get(self._plan(ubatches))
        if not bool(ok):
            size = self.cache.size
            free = size - int(self.cache.used_cells())
            raise CacheFullError(f"batch of {len(tokens)} tokens does not fit ({free} free cells of "
                                 f"{size}{', contiguous placement' if self.contiguous else ''}); "
                                 f"nothing was placed (pending work was applied first, as "
                                 f"llama_decode does): free cells with seq_rm or shift the context")
        windows = self.cache.windows_for(placements, extent)
        if wanted is not None:
            return self._decode_rows(tokens, parts, ubatches, windows, wanted)
        outputs = []
        for idx, ub, ub_windows in zip(parts, ubatches, windows):
            toks = np.zeros(ub.length, np.int32)
            toks[: len(idx)] = tokens[idx]
            logits, self.cache, _ = self.step(self.state, self.cache, ub, toks, windows=ub_windows)
            outputs.append(logits[: len(idx)])
        self._finish(ubatches, len(tokens))
        logits = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs)
        if equal:  # ubatch rows are slot major: back to batch order
            logits = logits[np.argsort(np.concatenate(parts), kind="stable")]
        return logits

    def _finish(self, ubatches, n_tokens):
        self.cache = self.cache.commit(ubatches)  # the seed's commit (the iSWA memory prunes here)
        if self.defrag_thold is not None:
            self.cache = kvjax.defrag_sched(self.cache, self.defrag_thold)
        self.n_decoded += n_tokens

    def _decode_rows(self, tokens, parts, ubatches, windows, wanted):
        """Run the placed batch with the output head on the ``wanted`` batch rows only."""
        got, outputs = [], []
        for idx, ub, ub_windows in zip(parts, ubatches, windows):
            toks = np.zeros(ub.length, np.int32)
            toks[: len(idx)] = tokens[idx]
            local = np.flatnonzero(np.isin(idx, wanted))           # ubatch rows whose batch row is wanted
            if len(local) == len(idx):
                # every valid row: the all-rows program (the one a decode step of n tokens uses anyway)
                logits, self.cache, _ = self.step(self.state, self.cache, ub, toks, windows=ub_windows)
            else:
                rows = np.zeros(output_bucket(len(local)), np.int32)
                rows[: len(local)] = local
                rows[len(local):] = local[-1] if len(local) else 0   # bucket padding: a repeated row
                logits, self.cache, _ = self.step(self.state, self.cache, ub, toks, windows=ub_windows,
                                                  outputs=rows)
            outputs.append(logits[: len(local)])
            got.append(np.asarray(idx)[local])
        self._finish(ubatches, len(tokens))
        got = np.concatenate(got)
        logits = outputs[0] if len(outputs) == 1 else jnp.concatenate(outputs)
        where = np.empty(len(tokens), np.int64)
        where[got] = np.arange(len(got))
        order = where[wanted]
        if not np.array_equal(order, np.arange(len(got))):
            logits = logits[order]
        return logits

    def _ubatches(self, pos, seq_ids, memory=None):
        memory = self.cache if memory is None else memory
        if memory.ubatch_split == "equal":
            return _equal_ubatches(np.asarray(pos), seq_ids, self.n_ubatch, memory.n_seq_max)
        parts = split_simple(seq_ids, self.n_ubatch)
        pos = np.asarray(pos)
        return parts, tuple(make_ubatch(pos[idx], [seq_ids[i] for i in idx], length=bucket_length(len(idx)),
                                        n_seq_max=memory.n_seq_max) for idx in parts)

    def fits(self, memory, spans) -> bool:
        """A dry run: would positions ``[start, end)`` of each ``(seq_id, start, end)`` be placed in
        ``memory``, as one batch? (Nothing changes; used to decide evictions.)"""
        pos, ids = [], []
        for seq, start, end in spans:
            pos += range(start, end)
            ids += [[seq]] * (end - start)
        if not pos:
            return True
        _, ubatches = self._ubatches(pos, ids, memory)
        _, rest = memory.split()
        return bool(_plan(rest, ubatches, contiguous=self.contiguous)[1])

    # -- sequence management ----------------------------------------------------------------

    def rollback(self, seq_id: int, pos: int) -> None:
        """Forget the tokens of ``seq_id`` at positions ``>= pos`` (e.g. a rejected speculative draft).

        Raises:
            ValueError: the memory refused the removal (e.g. a recurrent state that cannot be cut
                there); nothing changed.
        """
        memory, ok = kvjax.seq_rm(self.cache, seq_id, pos, -1)
        if not bool(ok):
            raise ValueError(f"pos={pos} is out of range for a rollback of sequence {seq_id}: the "
                             f"{type(self.cache).__name__} refused to remove positions >= {pos}; nothing changed")
        self.cache = memory

    def context_shift(self, seq_id: int, n_keep: int, n_discard: int) -> int:
        """Drop ``n_discard`` tokens after the first ``n_keep`` of ``seq_id`` and shift the rest back.

        The K-shift itself is applied by the next :meth:`decode` (``kvjax.update``).

        Returns:
            The sequence's next position (its old one minus ``n_discard``).

        Raises:
            ValueError: bad ``n_keep`` / ``n_discard``, or the shifted range holds cells shared
                with other sequences (shifting them would move those sequences too).
        """
        if not self.cache.can_shift:
            raise ValueError(f"context shift is not possible on this {type(self.cache).__name__} (it cannot shift "
                             f"positions; kvjax.can_shift is False): nothing changed; give it more cells or a "
                             f"larger n_ctx")
        n_past = int(kvjax.seq_pos_max(self.cache, seq_id)) + 1
        if not (n_keep >= 0 and n_discard >= 1 and n_keep + n_discard <= n_past):
            raise ValueError(f"n_keep={n_keep}, n_discard={n_discard} are out of range: allowed n_keep >= 0, "
                             f"n_discard >= 1, n_keep + n_discard <= {n_past} (the sequence's length)")
        if bool(self.cache.seq_shared(np.int32(seq_id), np.int32(n_keep + n_discard), np.int32(n_past))):
            raise ValueError(f"context shift of sequence {seq_id} would move cells it shares with other "
                             f"sequences (seq_add moves a cell for all of them): allowed when every shared "
                             f"position is below n_keep + n_discard = {n_keep + n_discard}; raise n_keep")
        memory, ok = kvjax.seq_rm(self.cache, seq_id, n_keep, n_keep + n_discard)
        if not bool(ok):
            raise ValueError(f"context shift of sequence {seq_id} is not possible on a "
                             f"{type(self.cache).__name__}: it refused to remove positions [{n_keep}, "
                             f"{n_keep + n_discard}); nothing changed")
        self.cache = memory
        self.cache = kvjax.seq_add(self.cache, seq_id, n_keep + n_discard, n_past, -n_discard)
        return n_past - n_discard

    # -- llama.cpp session and sequence files ---------------------------------------------------

    def _arch(self, arch: Optional[str]) -> str:
        found = getattr(self.model, "gguf_architecture", None)
        if arch is None and found is None:
            raise ValueError("arch=None is out of range for a model that was not loaded from a GGUF file: allowed "
                             "the llama.cpp architecture name the file must carry (e.g. 'llama', 'gemma3')")
        return found if arch is None else arch

    def _settled(self):
        """The memory with pending work (a K-shift, a stream copy) applied: what a state file can hold."""
        if bool(self.cache.pending()):
            self.cache = self.cache.update(donate=True)
        return self.cache

    def save_session(self, path, tokens: Sequence[int], *, arch: Optional[str] = None,
                     version: Optional[int] = None, v_trans: Optional[bool] = None, attn_rot: bool = True) -> None:
        """Write the whole memory as a llama.cpp session file (``llama_state_load_file`` reads it), atomically.

        A pending K-shift (after :meth:`context_shift`) is applied first: the file holds the
        rotated K, as llama.cpp's does after its own shift.

        Args:
            path: the file (replaced if it exists).
            tokens: the tokens the memory holds (llama.cpp keeps them as the session's prompt).
            arch: the architecture name llama.cpp checks; default the GGUF's (``from_gguf``'s model).
            version: the session version of the llama.cpp that reads it (default 10, today's; or 9).
            v_trans: V layout of the file: True for a llama.cpp context without flash attention,
                False with it (default the memory's ``config.v_trans``).
            attn_rot: block-quantized K/V in the rotated basis today's llama.cpp stores them in
                (``kvjax.io._attn_rot``); False for a llama.cpp run with ``LLAMA_ATTN_ROT_DISABLE=1``.

        Raises:
            ValueError: a bad argument, or a memory llama.cpp does not save as K/V cells.
            OSError: the file cannot be written (nothing is left under ``path``).
        """
        options = {} if version is None else {"version": version}
        kvjax.session_save_file(path, self._settled(), tokens, arch=self._arch(arch), v_trans=v_trans,
                                attn_rot=attn_rot, **options)

    def load_session(self, path, *, arch: Optional[str] = None, prompt_cache: Optional[PromptCache] = None,
                     seq_id: int = 0, attn_rot: bool = True) -> np.ndarray:
        """Replace the memory with a llama.cpp session file's (``llama_state_save_file``'s) and return its tokens.

        The memory keeps its config (the file must fit it: same layers, heads, K/V types, no more
        cells; either V layout is read). Nothing changes when the file is refused.

        Args:
            path: the file (or its bytes).
            arch: the architecture the file must name; default the GGUF's, when the model has one.
            prompt_cache: park the session's tokens as sequence ``seq_id`` in this
                :class:`kvjax.PromptCache`, so that :func:`generate` with a prompt that starts with
                them evaluates only the rest (or the last token again: a version 10 file holds no logits).
            seq_id: the sequence the tokens belong to, for ``prompt_cache``.
            attn_rot: quantized K/V are in llama.cpp's rotated basis (as :meth:`save_session`).

        Returns:
            ``i32[n]`` the session's tokens.

        Raises:
            kvjax.StateError: another architecture, a malformed file, or one that does not fit the memory.
        """
        if arch is None:
            arch = getattr(self.model, "gguf_architecture", None)
        session = kvjax.session_read(self.cache, path, arch=arch, attn_rot=attn_rot)
        self.cache = session.cache
        if prompt_cache is not None:
            prompt_cache.park(seq_id, session.tokens.tolist())
        return session.tokens

    def save_sequence(self, path, seq_id: int, tokens: Sequence[int], *, version: Optional[int] = None,
                      v_trans: Optional[bool] = None, attn_rot: bool = True) -> None:
        """Write one sequence as a llama.cpp sequence file (``llama_state_seq_load_file`` reads it), atomically.

        Args:
            path: the file.
            seq_id: the sequence.
            tokens: its tokens.
            version: the sequence-file version of the llama.cpp that reads it (default 3, today's; or 2).
            v_trans: V layout (as :meth:`save_session`).
            attn_rot: as :meth:`save_session`.
        """
        options = {} if version is None else {"version": version}
        kvjax.seq_save_file(path, self._settled(), seq_id, tokens, v_trans=v_trans, attn_rot=attn_rot, **options)

    def load_sequence(self, path, seq_id: int, *, prompt_cache: Optional[PromptCache] = None,
                      attn_rot: bool = True) -> np.ndarray:
        """Read a llama.cpp sequence file into sequence ``seq_id`` (its cells replaced, the others kept).

        ``attn_rot``: as :meth:`load_session`.

        Returns:
            ``i32[n]`` the file's tokens (parked in ``prompt_cache`` as ``seq_id`` when given).

        Raises:
            ValueError: ``seq_id`` out of range.
            kvjax.StateError: a malformed file, or cells that do not fit; nothing changed.
        """
        self.cache, tokens = kvjax.seq_file_read(self.cache, path, seq_id, attn_rot=attn_rot)
        if prompt_cache is not None:
            prompt_cache.park(seq_id, tokens.tolist())
        return tokens


# -- generation ---------------------------------------------------------------------------------


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


def _check_prompts(prompts, vocab_size: Optional[int], name: str = "prompts", allow_empty: bool = False):
    """Token lists of real integers in ``[0, vocab_size)`` (floats and bools refused, not truncated)."""
    if isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise ValueError(f"{name} must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"{name}[{i}] has shape {arr.shape} and dtype {arr.dtype}: allowed a list of integer "
                             f"token ids")
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
    ok = isinstance(key, jax.Array) and (jnp.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ()
                                         or key.dtype == jnp.uint32 and key.shape == (2,))
    if not ok:
        raise ValueError(f"key must be a jax PRNG key (jax.random.PRNGKey(seed) or jax.random.key(seed)), got "
                         f"{type(key).__name__} {getattr(key, 'dtype', '')}{list(getattr(key, 'shape', ()))}")


def generate_stream(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens,
                    key: jax.Array, sampling: SamplingConfig = SamplingConfig(), n_parallel: int = 1,
                    share_prefix: bool = True, stop_tokens: Sequence[int] = (), n_ctx: Optional[int] = None,
                    n_keep: int = 0, draft: Optional["Engine"] = None, n_draft: int = 4,
                    prompt_cache: Optional[PromptCache] = None, device_loop: bool = True, sync_every: int = 32,
                    window: Optional[SinkWindow] = None, stats: Optional[dict] = None) -> Iterator[Tuple[int, int]]:
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
    # the whole request is checked before anything is placed: a failed call changes nothing
    prompts = _check_prompts(prompts, engine.vocab_size)
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
        raise ValueError(f"stop_tokens={stop_tokens!r} is out of range: allowed a sequence of token ids "
                         f"(e.g. [eos_id], or () for none)")
    stop_tokens = _check_prompts([list(stop_tokens)], engine.vocab_size, name="stop_tokens", allow_empty=True)[0]
    if n_parallel > 1:
        if len(prompts) != 1:
            raise ValueError(f"n_parallel={n_parallel} needs exactly one prompt, got {len(prompts)}")
    n_seq = n_parallel if n_parallel > 1 else len(prompts)
    if budgets is not None:
        if len(budgets) != n_seq:
            raise ValueError(f"max_new_tokens has {len(budgets)} entries: allowed an int, or one int per sequence "
                             f"({n_seq})")
        if draft is not None:
            raise ValueError("max_new_tokens as a list is out of range with draft=: allowed one int for every "
                             "sequence")
        max_new_tokens = max(budgets)      # the bound every check below needs
    else:
        budgets = [max_new_tokens] * n_seq
    stats = {} if stats is None else stats
    if window is not None:
        if not isinstance(window, SinkWindow):
            raise ValueError(f"window must be a kvjax.SinkWindow, got {type(window).__name__}")
        if n_ctx is not None or n_keep or prompt_cache is not None or draft is not None:
            raise ValueError("window= is out of range with n_ctx, n_keep, prompt_cache or draft: a sink + window "
                             "memory evicts a token per token instead of shifting the context")
        check_window_memory(engine.cache, window)
    if draft is not None:
        if n_parallel > 1 or n_ctx is not None or n_keep:
            raise ValueError("draft= is out of range with n_parallel > 1, n_ctx or n_keep: speculative decoding "
                             "evaluates each prompt in its own sequence and never shifts the context")
        longest = max(len(p) for p in prompts)
        check_draft(engine, draft, n_draft, n_seq, longest, max_new_tokens)
        _check_prompts(prompts, draft.vocab_size)
        t0 = time.perf_counter()
        first = True
        for item in speculative_stream(engine, draft, prompts, max_new_tokens=max_new_tokens, key=key,
                                       sampling=sampling, n_draft=int(n_draft), stop=set(stop_tokens), stats=stats):
            if first:
                stats["ttft"] = time.perf_counter() - t0
                stats["compile_at_ttft"] = total_compile_seconds()
                first = False
            yield item
        stats["prompt_tokens"] = sum(len(p) for p in prompts)
        return
    if n_seq > engine.cache.n_seq_max:
        raise ValueError(f"{n_seq} sequences are out of range: allowed at most n_seq_max={engine.cache.n_seq_max}")
    limit = engine.cache.max_context
    longest = max(len(p) for p in prompts)
    sid, held = list(range(n_seq)), [0] * n_seq
    if prompt_cache is not None:
        if not isinstance(prompt_cache, PromptCache):
            raise ValueError(f"prompt_cache must be a kvjax.PromptCache, got {type(prompt_cache).__name__}")
        if n_parallel > 1 or n_ctx is not None or n_keep:
            raise ValueError("prompt_cache= is out of range with n_parallel > 1, n_ctx or n_keep: a cached request "
                             "never shifts its context (the cache evicts instead)")
        if limit is not None and longest + max_new_tokens > limit:
            raise ValueError(f"max_new_tokens={max_new_tokens} is out of range: a prompt of {longest} tokens and "
                             f"its continuation must fit in size={limit} cells (nothing is shifted with a prompt cache)")
        sid, held = prompt_cache.attach(engine, prompts, max_new_tokens)
        limit, share_prefix = None, False
    if window is not None:
        top = engine.cache.context_per_sequence(n_seq) if limit is not None else 2**31 - 1
        if window.n_cells > top:
            raise ValueError(f"window={window} is out of range: allowed n_sink + n_recent <= {top} (the cells per "
                             f"sequence with {n_seq} sequence{'s' if n_seq != 1 else ''})")
        if longest > window.n_cells:
            raise ValueError(f"a prompt of {longest} tokens is out of range: allowed at most n_sink + n_recent = "
                             f"{window.n_cells} tokens with window=")
        memory = engine.cache
        one_per_stream = isinstance(memory, StreamCache) and memory.config.n_stream == memory.n_seq_max
        if n_seq > 1 and engine.contiguous and not one_per_stream:
            raise ValueError(f"window= with {n_seq} sequences in one pool of cells is out of range with "
                             f"Engine(contiguous=True): evictions leave single free cells between the sequences, "
                             f"where a contiguous ubatch of {n_seq} tokens does not fit; allowed an "
                             f"Engine(..., contiguous=False), or per-sequence streams (kvjax.StreamsConfig)")
        if window.compact and n_parallel > 1 and len(prompts[0]) > window.n_sink:
            raise ValueError(f"n_parallel={n_parallel} is out of range with window=SinkWindow(compact=True) and a "
                             f"prompt of {len(prompts[0])} tokens: the shared prompt would move for every "
                             f"continuation; allowed a prompt of at most n_sink={window.n_sink} tokens, or "
                             f"compact=False")
    elif limit is None and n_ctx is None:  # a recurrent state or a prompt cache: nothing to shift
        n_ctx = None
    else:
        top = engine.cache.context_per_sequence(n_seq) if limit is not None else (2**31 - 1) // n_seq
        n_ctx = top if n_ctx is None else check_count("n_ctx", n_ctx, 1)
        if not n_keep + 2 <= n_ctx <= top:
            raise ValueError(f"n_ctx={n_ctx} is out of range: allowed [n_keep + 2 = {n_keep + 2}, cells per sequence = "
                             f"{top}] (every sequence must be able to reach its limit)")
        if longest >= n_ctx:
            raise ValueError(f"a prompt of {longest} tokens is out of range: allowed < n_ctx = {n_ctx}")
    if n_ctx is not None and max_new_tokens + longest > n_ctx and not engine.cache.can_shift:
        raise ValueError(f"max_new_tokens={max_new_tokens} is out of range for this {type(engine.cache).__name__}: "
                         f"a prompt of {longest} tokens would reach n_ctx={n_ctx} and need a context shift, which "
                         f"this memory cannot do (kvjax.can_shift is False); allowed max_new_tokens <= "
                         f"{n_ctx - longest}, or a memory with more cells")
    busy = [s for s in range(n_seq) if int(kvjax.seq_pos_max(engine.cache, s)) >= 0] if prompt_cache is None else []
    if busy:
        raise ValueError(f"sequences {busy} already hold cells: generate uses sequences 0..{n_seq - 1}; "
                         f"free them with kvjax.seq_rm(cache, s) (or use a fresh cache)")
    stop = set(int(t) for t in stop_tokens)
    t0 = time.perf_counter()

    # -- prompts: shared part once, then each sequence's own part ---------------------------
    if n_parallel > 1:
        shared, own = prompts[0], [[] for _ in range(n_seq)]  # the whole prompt, shared
    elif share_prefix and n_seq > 1:
        n_common = min(_common_prefix(prompts), min(len(p) for p in prompts) - 1)
        if window is not None and window.compact:   # shared cells must never be shifted
            n_common = min(n_common, window.n_sink)
        shared, own = prompts[0][:n_common], [p[n_common:] for p in prompts]
    else:
        shared, own = [], prompts
    prompt_tokens = 0
    first_discard = n_keep + (n_ctx - n_keep) // 2 if n_ctx is not None else len(shared)
    if n_ctx is not None and len(shared) > first_discard and max_new_tokens + longest > n_ctx:
        raise ValueError(f"the shared prompt ({len(shared)} tokens) would be moved by a context shift, which "
                         f"would shift it for every sequence: allowed at most n_keep + (n_ctx - n_keep) // 2 = "
                         f"{first_discard} shared tokens; raise n_keep or n_ctx, or pass share_prefix=False")
    if shared:
        # only n_parallel reads the shared prompt's logits (its last row); the rest needs its cells only
        shared_logits = engine.decode(shared, list(range(len(shared))), [[sid[0]]] * len(shared),
                                      outputs=[len(shared) - 1] if n_parallel > 1 else [])
        for s in range(1, n_seq):
            engine.cache = kvjax.seq_cp(engine.cache, sid[0], sid[s], -1, -1)
        prompt_tokens += len(shared)
    toks, pos, ids, last_row = [], [], [], {}
    for s, part in enumerate(own):
        part = part[held[s]:]                     # a prompt cache already holds the first held[s] tokens
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
    next_pos = [len(p) for p in (prompts * n_seq if n_parallel > 1 else prompts)]
    stats["prompt_tokens"] = prompt_tokens
    stats["seq_ids"] = sid

    # -- decode loop ------------------------------------------------------------------------
    counts = [0] * n_seq
    fed = [list(p) for p in (prompts * n_seq if n_parallel > 1 else prompts)]   # the tokens each sequence holds
    shifts = 0
    # the device loop, where it gives the host loop's tokens (see kvjax/engine/_device_loop.py). A
    # prompt cache parks ``fed``, the tokens handed out and fed; a generator closed early may have
    # left the device a step or a chunk ahead, so a parked sequence then holds cells past its
    # tokens: only a prefix is ever lent (share_prefix up to the match), and a sequence whose
    # cells do not end at its tokens is never continued in place (PromptCache._attach checks)
    on_device = device_loop and device_sampling_exact(key, sampling)
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
                for _, picked in run_segment(engine, active, sid, feed, next_pos, counts, budgets, stops, n_ctx,
                                             key, sampling, sync_every, info, window):
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
            if prompt_cache.idle_to_host:   # ... or in host memory (and any brought back), cells freed at once
                prompt_cache.to_host(engine)
    stats["context_shifts"] = shifts


def generate(engine: Engine, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, key: jax.Array,
             sampling: SamplingConfig = SamplingConfig(), on_token: Optional[Callable[[int, int], None]] = None,
             **options) -> GenerationResult:
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
        for s, tok in generate_stream(engine, prompts, max_new_tokens=max_new_tokens, key=key, sampling=sampling,
                                      stats=stats, **options):
            out[s].append(tok)
            if on_token is not None:
                on_token(s, tok)
    return GenerationResult(out, stats.get("prompt_tokens", 0), stats.get("ttft", 0.0), time.perf_counter() - t0,
                            stats.get("context_shifts", 0), compiles.count, compiles.seconds,
                            total_compile_seconds() - stats.get("compile_at_ttft", total_compile_seconds()),
                            stats.get("drafted", 0), stats.get("accepted", 0), stats.get("dispatches", 0))
