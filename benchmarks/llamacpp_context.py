"""A llama.cpp context driven through llama-cpp-python's low-level API (benchmarks and fixture scripts only).

llama.cpp is never needed by kvjax or its test suite: this module is imported by the benchmarks
that compare with it and by the scripts that record what it does (``scripts/make_*_fixtures.py``).
It exposes the few calls those need: batches of ``(token, pos, seq ids)`` rows, the logits of
output rows, the sequence operations, and the state files (``llama_state_save_file`` /
``llama_state_load_file`` and their per-sequence twins).

Example (with llama-cpp-python installed and a GGUF file)::

    ctx = LlamaCppContext("model.gguf", n_ctx=512)
    ctx.decode([2, 818, 5279], [0, 1, 2], [[0]] * 3)
    ctx.save_session("chat.session", [2, 818, 5279])
"""

from __future__ import annotations

import ctypes
from typing import List, Optional, Sequence

import numpy as np

#: ggml type ids of the K/V types the benchmarks use
GGML_KV_TYPES = {"float32": 0, "f32": 0, "float16": 1, "f16": 1, "q8_0": 8, "q4_0": 2}

# llama.cpp keeps the log callback's address for the life of the process: the ctypes object must
# live as long (one freed with a context would be called by the next model load, and crash)
_QUIET = []


def _silence(lc) -> None:
    """llama.cpp logs every graph build to stderr; a timed loop would time that too."""
    if not _QUIET and hasattr(lc, "llama_log_callback"):
        _QUIET.append(lc.llama_log_callback(lambda level, text, data: None))
        lc.llama_log_set(_QUIET[0], ctypes.c_void_p())


class LlamaCppContext:
    """One llama.cpp model and context.

    Args:
        path: the GGUF file.
        n_ctx: cells of the context (every sequence's, with ``kv_unified``).
        n_seq: sequence ids (``n_seq_max``).
        kv_type: K and V storage (``"f16"``: llama.cpp's default, ``"f32"``, ``"q8_0"``, ...).
        flash_attn: flash attention (V stored as rows; without it V is transposed); None:
            llama.cpp's default ("auto": on where the backend has it).
        kv_unified: one K/V buffer for every sequence (kvjax's unified cache); False: one stream
            per sequence (kvjax's StreamCache).
        swa_full: a full-size window cache for sliding-window layers.
        n_batch: most tokens of one ``llama_decode`` (also its ``n_ubatch``).
        n_threads: CPU threads.
    """

    def __init__(
        self,
        path: str,
        *,
        n_ctx: int = 512,
        n_seq: int = 1,
        kv_type: str = "f16",
        flash_attn: Optional[bool] = None,
        kv_unified: bool = True,
        swa_full: bool = False,
        n_batch: int = 512,
        n_threads: int = 2,
    ):
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        _silence(lc)
        self.model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.n_threads = cparams.n_threads_batch = n_threads
        cparams.type_k = cparams.type_v = GGML_KV_TYPES[kv_type]
        if flash_attn is not None:
            cparams.flash_attn_type = 1 if flash_attn else 0  # enabled / disabled (not "auto")
        cparams.kv_unified = kv_unified
        cparams.swa_full = swa_full
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {dict(n_ctx=n_ctx, kv_type=kv_type)}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.n_batch, self.n_seq = n_batch, n_seq
        self.batch = lc.llama_batch_init(n_batch, 0, n_seq)
        self.memory = lc.llama_get_memory(self.ctx)

    # -- evaluation -------------------------------------------------------------------------------

    def decode(
        self,
        tokens: Sequence[int],
        pos: Sequence[int],
        seq_ids: Sequence[Sequence[int]],
        outputs: Optional[Sequence[int]] = None,
    ) -> None:
        """One ``llama_decode`` of the rows; ``outputs``: the rows with logits (default the last one)."""
        b = self.batch
        n = len(tokens)
        if n > self.n_batch:
            raise ValueError(f"{n} tokens are more than n_batch={self.n_batch}")
        wanted = {n - 1} if outputs is None else set(outputs)
        b.n_tokens = n
        for i in range(n):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tokens[i], pos[i], len(seq_ids[i]), i in wanted
            for j, s in enumerate(seq_ids[i]):
                b.seq_id[i][j] = s
        if self.lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def evaluate_prompts(self, prompts: Sequence[Sequence[int]], shared: int = 0) -> None:
        """Evaluate prompt ``s`` in sequence ``s``; a common prefix of ``shared`` tokens first, once,
        in sequence 0, then copied to the others (``seq_cp``: shared cells); in ``n_batch`` chunks
        (the last row of the last one has logits)."""
        prefix = [(t, p, 0) for p, t in enumerate(prompts[0][:shared])]
        rest = [(t, p, s) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt) if p >= shared]
        for rows in (prefix, rest):
            for i in range(0, len(rows), self.n_batch):
                chunk = rows[i : i + self.n_batch]
                self.decode([r[0] for r in chunk], [r[1] for r in chunk], [[r[2]] for r in chunk])
            if rows is prefix and shared:
                for s in range(1, len(prompts)):
                    self.seq_cp(0, s)

    def logits(self, row: int) -> np.ndarray:
        """``f32[V]`` logits of output row ``row`` of the last decode (-1: the last output)."""
        ptr = self.lc.llama_get_logits_ith(self.ctx, row)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    # -- sequences --------------------------------------------------------------------------------

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return bool(self.lc.llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.lc.llama_memory_seq_cp(self.memory, src, dst, p0, p1)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        self.lc.llama_memory_seq_add(self.memory, seq_id, p0, p1, delta)

    def seq_pos_max(self, seq_id: int) -> int:
        return int(self.lc.llama_memory_seq_pos_max(self.memory, seq_id))

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.memory, True)

    # -- state files ------------------------------------------------------------------------------

    def save_session(self, path, tokens: Sequence[int]) -> None:
        arr = (self.lc.llama_token * max(1, len(tokens)))(*tokens)
        if not self.lc.llama_state_save_file(self.ctx, str(path).encode(), arr, len(tokens)):
            raise RuntimeError(f"llama_state_save_file({path}) failed")

    def load_session(self, path, capacity: int = 1 << 16) -> List[int]:
        """Load a session file; its tokens (raises when llama.cpp refuses the file)."""
        arr = (self.lc.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        if not self.lc.llama_state_load_file(self.ctx, str(path).encode(), arr, capacity, ctypes.byref(n)):
            raise RuntimeError(f"llama_state_load_file({path}) refused the file")
        return list(arr[: n.value])

    def save_sequence(self, path, seq_id: int, tokens: Sequence[int]) -> None:
        arr = (self.lc.llama_token * max(1, len(tokens)))(*tokens)
        if not self.lc.llama_state_seq_save_file(self.ctx, str(path).encode(), seq_id, arr, len(tokens)):
            raise RuntimeError(f"llama_state_seq_save_file({path}) failed")

    def load_sequence(self, path, seq_id: int, capacity: int = 1 << 16) -> List[int]:
        arr = (self.lc.llama_token * capacity)()
        n = ctypes.c_size_t(0)
        if not self.lc.llama_state_seq_load_file(self.ctx, str(path).encode(), seq_id, arr, capacity, ctypes.byref(n)):
            raise RuntimeError(f"llama_state_seq_load_file({path}) refused the file")
        return list(arr[: n.value])

    # -- what a program continuing from a state does ----------------------------------------------

    def continue_greedy(self, histories: Sequence[Sequence[int]], seq_ids: Sequence[int], n_new: int):
        """Greedy continuations of sequences whose memory holds ``histories`` (positions 0..n-1).

        The last token of each is evaluated again (``seq_rm`` of its position, then decode; a
        session file holds no logits), then ``n_new`` tokens are chosen per sequence, one
        ``llama_decode`` per step for all of them.

        Returns:
            ``(tokens, margins)``: per sequence the tokens, and the gap between the best and the
            second-best logit at every step (a small one is a near tie).
        """
        for h, s in zip(histories, seq_ids):
            self.seq_rm(s, len(h) - 1, -1)
        self.decode(
            [h[-1] for h in histories],
            [len(h) - 1 for h in histories],
            [[s] for s in seq_ids],
            outputs=range(len(seq_ids)),
        )
        out = [[] for _ in seq_ids]
        gaps = [[] for _ in seq_ids]
        for step in range(n_new):
            nxt = []
            for i in range(len(seq_ids)):
                row = self.logits(i).astype(np.float64)
                top2 = np.sort(row)[-2:]
                nxt.append(int(np.argmax(row)))
                gaps[i].append(float(top2[1] - top2[0]))
            for i, t in enumerate(nxt):
                out[i].append(t)
            if step + 1 < n_new:
                self.decode(
                    nxt, [len(h) + step for h in histories], [[s] for s in seq_ids], outputs=range(len(seq_ids))
                )
        return out, gaps

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)
