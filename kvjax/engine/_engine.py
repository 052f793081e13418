"""The decode driver: the seed's ``llama_decode`` over kvjax (the generation loop is :mod:`kvjax.engine._generate`).

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

:func:`kvjax.generate` is the loop users write around it (:mod:`kvjax.engine._generate`).
Speculative drafts are rolled back with :meth:`Engine.rollback` (``seq_rm``).

Example:
    >>> import jax, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    >>> engine = Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=64, n_seq_max=2)))
    >>> logits = engine.decode([1, 2, 3], [0, 1, 2], [[0], [0], [0]])      # every row by default
    >>> logits.shape, int(kvjax.used_cells(engine.cache))
    ((3, 32), 3)
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax._errors import CacheFullError
from kvjax._validate import check_count, check_flag
from kvjax.engine._prompt_cache import PromptCache
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory
from kvjax.memory._ubatch import bucket_length, make_equal_ubatch, make_ubatch, split_equal, split_simple
from kvjax.nn._step import make_step, output_bucket


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
            c = 1 << ((t - off).bit_length() - 1)  # the largest power of two that is left
            rows = [b[off : off + c] for _, b in blocks]
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
    raise ValueError(
        f"outputs={outputs!r} is out of range: allowed 'all', 'last' or a list of batch row indices in [0, {n})"
    )


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

    def __init__(
        self,
        model,
        cache: Memory,
        *,
        state=None,
        n_ubatch: int = 64,
        contiguous: bool = True,
        defrag_thold: Optional[float] = None,
    ):
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

    def decode(
        self, tokens: Sequence[int], pos: Sequence[int], seq_ids: Sequence[Sequence[int]], *, outputs="all"
    ) -> jax.Array:
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
            raise ValueError(
                f"pos has shape {pos.shape} and dtype {pos.dtype}: allowed a 1-d list of integer "
                f"positions, one per token"
            )
        if isinstance(seq_ids, (str, bytes)) or not hasattr(seq_ids, "__len__"):
            raise ValueError(f"seq_ids={seq_ids!r} is out of range: allowed one list of sequence ids per token")
        if not (len(tokens) == len(pos) == len(seq_ids)) or len(tokens) == 0:
            raise ValueError(
                f"tokens, pos and seq_ids have lengths {len(tokens)}, {len(pos)}, {len(seq_ids)}: "
                f"allowed one equal, positive length"
            )
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
            raise CacheFullError(
                f"batch of {len(tokens)} tokens does not fit ({free} free cells of "
                f"{size}{', contiguous placement' if self.contiguous else ''}); "
                f"nothing was placed (pending work was applied first, as "
                f"llama_decode does): free cells with seq_rm or shift the context"
            )
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
            local = np.flatnonzero(np.isin(idx, wanted))  # ubatch rows whose batch row is wanted
            if len(local) == len(idx):
                # every valid row: the all-rows program (the one a decode step of n tokens uses anyway)
                logits, self.cache, _ = self.step(self.state, self.cache, ub, toks, windows=ub_windows)
            else:
                rows = np.zeros(output_bucket(len(local)), np.int32)
                rows[: len(local)] = local
                rows[len(local) :] = local[-1] if len(local) else 0  # bucket padding: a repeated row
                logits, self.cache, _ = self.step(self.state, self.cache, ub, toks, windows=ub_windows, outputs=rows)
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
        return parts, tuple(
            make_ubatch(pos[idx], [seq_ids[i] for i in idx], length=bucket_length(len(idx)), n_seq_max=memory.n_seq_max)
            for idx in parts
        )

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
            raise ValueError(
                f"pos={pos} is out of range for a rollback of sequence {seq_id}: the "
                f"{type(self.cache).__name__} refused to remove positions >= {pos}; nothing changed"
            )
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
            raise ValueError(
                f"context shift is not possible on this {type(self.cache).__name__} (it cannot shift "
                f"positions; kvjax.can_shift is False): nothing changed; give it more cells or a "
                f"larger n_ctx"
            )
        n_past = int(kvjax.seq_pos_max(self.cache, seq_id)) + 1
        if not (n_keep >= 0 and n_discard >= 1 and n_keep + n_discard <= n_past):
            raise ValueError(
                f"n_keep={n_keep}, n_discard={n_discard} are out of range: allowed n_keep >= 0, "
                f"n_discard >= 1, n_keep + n_discard <= {n_past} (the sequence's length)"
            )
        if bool(self.cache.seq_shared(np.int32(seq_id), np.int32(n_keep + n_discard), np.int32(n_past))):
            raise ValueError(
                f"context shift of sequence {seq_id} would move cells it shares with other "
                f"sequences (seq_add moves a cell for all of them): allowed when every shared "
                f"position is below n_keep + n_discard = {n_keep + n_discard}; raise n_keep"
            )
        memory, ok = kvjax.seq_rm(self.cache, seq_id, n_keep, n_keep + n_discard)
        if not bool(ok):
            raise ValueError(
                f"context shift of sequence {seq_id} is not possible on a "
                f"{type(self.cache).__name__}: it refused to remove positions [{n_keep}, "
                f"{n_keep + n_discard}); nothing changed"
            )
        self.cache = memory
        self.cache = kvjax.seq_add(self.cache, seq_id, n_keep + n_discard, n_past, -n_discard)
        return n_past - n_discard

    # -- llama.cpp session and sequence files ---------------------------------------------------

    def _arch(self, arch: Optional[str]) -> str:
        found = getattr(self.model, "gguf_architecture", None)
        if arch is None and found is None:
            raise ValueError(
                "arch=None is out of range for a model that was not loaded from a GGUF file: allowed "
                "the llama.cpp architecture name the file must carry (e.g. 'llama', 'gemma3')"
            )
        return found if arch is None else arch

    def _settled(self):
        """The memory with pending work (a K-shift, a stream copy) applied: what a state file can hold."""
        if bool(self.cache.pending()):
            self.cache = self.cache.update(donate=True)
        return self.cache

    def save_session(
        self,
        path,
        tokens: Sequence[int],
        *,
        arch: Optional[str] = None,
        version: Optional[int] = None,
        v_trans: Optional[bool] = None,
        attn_rot: bool = True,
    ) -> None:
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
        kvjax.session_save_file(
            path, self._settled(), tokens, arch=self._arch(arch), v_trans=v_trans, attn_rot=attn_rot, **options
        )

    def load_session(
        self,
        path,
        *,
        arch: Optional[str] = None,
        prompt_cache: Optional[PromptCache] = None,
        seq_id: int = 0,
        attn_rot: bool = True,
    ) -> np.ndarray:
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

    def save_sequence(
        self,
        path,
        seq_id: int,
        tokens: Sequence[int],
        *,
        version: Optional[int] = None,
        v_trans: Optional[bool] = None,
        attn_rot: bool = True,
    ) -> None:
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

    def load_sequence(
        self, path, seq_id: int, *, prompt_cache: Optional[PromptCache] = None, attn_rot: bool = True
    ) -> np.ndarray:
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
