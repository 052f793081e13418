"""kvjax against llama.cpp itself: the same tiny Llama, the same GGUF weights, decode tokens/s.

A random Llama (4 layers, width 256, 8 heads, vocab 256, float32) is written as a GGUF file (the
layout ``convert_hf_to_gguf.py`` writes, as ``tests/test_gguf.py`` does), loaded into kvjax with
``kvjax.nn.from_gguf`` and into llama.cpp through ``llama-cpp-python``'s low-level API (2 threads).
Both sides store K/V alike: float16 (llama.cpp's default) and float32, in one unified buffer, and
for several sequences also one stream per sequence (llama.cpp's default, ``kv_unified=false``,
against ``kvjax.StreamsConfig``). Both decode greedily: the tokens are compared (the first rows must agree;
float32 sums in another order can flip a near tie later on), then decode speed is measured at
batch 1, 8 and 32 (B sequences, one token each per ``llama_decode`` call: a ``llama_batch`` with
one sequence id per row; greedy picked on the host from ``llama_get_logits_ith``, which is what a
llama.cpp server loop does). kvjax runs ``kvjax.generate`` (the device loop).

Needs the optional ``llamacpp`` extra (``pip install llama-cpp-python``, built from source); the
benchmark says so and returns without it. Never part of the test suite.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

import kvjax
from benchmarks.common import table
from benchmarks.llamacpp_context import LlamaCppContext
from kvjax import Engine, generate
from kvjax.nn import Llama, LlamaConfig

GREEDY = kvjax.SamplingConfig(temperature=0)
N_THREADS = 2
#: ggml's type ids of the K/V storage dtypes compared (llama.cpp's default is float16)
#: (K/V dtype, unified) per compared layout, for batches above 1 (batch 1 runs the unified ones)
LAYOUTS = (("float16", True), ("float32", True), ("float16", False), ("float32", False))
#: Fresh processes the comparison runs in, one after another. On this shared machine a process keeps
#: its own speed for its whole life: the same program ran 3100-4300 tokens/s from one process to the
#: next, steady within each, so repeats inside one process do not average that out.
N_PROCESSES = 3


def tiny_llama() -> Llama:
    """The compared model: 4 layers, width 256, 8 heads, vocab 256, float32, random weights."""
    cfg = LlamaConfig(
        vocab_size=256,
        d_model=256,
        n_layer=4,
        n_heads=8,
        n_kv_heads=8,
        norm_eps=1e-5,
        rope=kvjax.RopeConfig(n_rot=32, mode="neox", freq_base=10000.0),
    )
    model = Llama(cfg, rngs=nnx.Rngs(0))
    # larger weights than the initialiser's, so that the greedy tokens are not one repeated token
    nnx.update(model, jax.tree.map(lambda x: x * 2.0, nnx.state(model, nnx.Param)))
    return model


def _byte_tokens():
    """GPT-2's byte-to-unicode table: 256 single-byte tokens (llama.cpp's BPE vocab needs "\\n")."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table_ = dict(zip(bs, cs))
    return [chr(table_[b]) for b in range(256)]


def _write_gguf(path, model: Llama) -> None:
    """The model's weights as a llama GGUF file (HF layout, q/k rows permuted as the converter does)."""
    import gguf

    cfg = model.config
    head_dim = cfg.d_model // cfg.n_heads

    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(model.layers[0].mlp.up.kernel[...].shape[1])
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope.freq_base)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(_byte_tokens())
    w.add_token_types([1] * 256)
    toks = _byte_tokens()
    w.add_token_merges([f"{toks[1]} {toks[2]}"])  # llama.cpp's BPE vocab needs a merges list (a harmless one)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", f32(model.embed.embedding[...]))
    w.add_tensor("output_norm.weight", f32(model.norm.scale[...]))
    w.add_tensor("output.weight", f32(model.lm_head.kernel[...].T))
    for il, b in enumerate(model.layers):
        a, p = b.attn, f"blk.{il}."
        w.add_tensor(p + "attn_norm.weight", f32(b.attn_norm.scale[...]))
        w.add_tensor(p + "ffn_norm.weight", f32(b.mlp_norm.scale[...]))
        w.add_tensor(p + "attn_q.weight", permute(f32(a.q_proj.kernel[...].T), cfg.n_heads))
        w.add_tensor(p + "attn_k.weight", permute(f32(a.k_proj.kernel[...].T), cfg.n_kv_heads))
        w.add_tensor(p + "attn_v.weight", f32(a.v_proj.kernel[...].T))
        w.add_tensor(p + "attn_output.weight", f32(a.o_proj.kernel[...].T))
        w.add_tensor(p + "ffn_gate.weight", f32(b.mlp.gate.kernel[...].T))
        w.add_tensor(p + "ffn_up.weight", f32(b.mlp.up.kernel[...].T))
        w.add_tensor(p + "ffn_down.weight", f32(b.mlp.down.kernel[...].T))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _LlamaCpp(LlamaCppContext):
    """A llama.cpp context over the GGUF file, driven with ``llama_batch`` (the low-level API)."""

    def __init__(self, path: str, n_seq: int, n_ctx: int, kv_dtype: str = "float16", unified: bool = True):
        # unified True: one K/V buffer for every sequence (kvjax's unified cache); False: one
        # stream per sequence (llama.cpp's default for several sequences; kvjax's StreamCache)
        super().__init__(
            path,
            n_ctx=n_ctx,
            n_seq=n_seq,
            kv_type=kv_dtype,
            kv_unified=unified,
            n_batch=max(512, n_seq * 64),
            n_threads=N_THREADS,
        )

    def decode(self, tokens, pos, seqs) -> np.ndarray:
        """One ``llama_decode`` of rows ``(token, pos, seq)``; the greedy token of every row."""
        super().decode(tokens, pos, [[s] for s in seqs], outputs=range(len(tokens)))
        return np.array([int(np.argmax(self.logits(i))) for i in range(len(tokens))], np.int32)

    def generate(self, prompts, n_new):
        """Greedy: the prompts in one batch, then ``n_new - 1`` steps of one token per sequence.

        Returns ``(tokens [B][n_new], decode seconds)``."""
        self.clear()
        toks, pos, seqs, last = [], [], [], []
        for s, p in enumerate(prompts):
            toks += p
            pos += range(len(p))
            seqs += [s] * len(p)
            last.append(len(toks) - 1)
        nxt = self.decode(toks, pos, seqs)[last]
        out = [[int(t)] for t in nxt]
        t0 = time.perf_counter()
        for i in range(n_new - 1):
            nxt = self.decode(nxt.tolist(), [len(p) + i for p in prompts], list(range(len(prompts))))
            for s, t in enumerate(nxt):
                out[s].append(int(t))
        return out, time.perf_counter() - t0


def _plan(quick: bool):
    """``(new tokens, prompt length, repeats in a process)``."""
    return (32, 16, 2) if quick else (128, 16, 5)


def _measure(quick: bool) -> list:
    """One process's comparison: a dict per (batch, K/V dtype, layout), the two sides interleaved."""
    source = tiny_llama()
    n_new, prompt_len, repeats = _plan(quick)
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "tiny-llama.gguf")
        _write_gguf(path, source)
        model = kvjax.nn.fuse_projections(kvjax.nn.from_gguf(path))  # what `python -m kvjax generate` runs
        for batch in (1, 8, 32):
            prompts = [rng.integers(1, 256, size=prompt_len).tolist() for _ in range(batch)]
            size = 1 << (batch * (prompt_len + n_new) - 1).bit_length()
            for kv_dtype, unified in LAYOUTS:
                if batch == 1 and not unified:
                    continue  # one sequence: a stream is the unified cache
                config = model.config.cache_config(
                    size=size if unified else size // batch,
                    n_seq_max=batch,
                    padding=32,
                    k_dtype=kv_dtype,
                    v_dtype=kv_dtype,
                )
                if not unified:
                    config = kvjax.StreamsConfig(config, n_stream=batch)

                def gen(r):
                    engine = Engine(model, kvjax.init(config), n_ubatch=max(64, batch))
                    return generate(
                        engine,
                        prompts,
                        max_new_tokens=n_new,
                        key=jax.random.PRNGKey(r),
                        sampling=GREEDY,
                        share_prefix=False,
                        sync_every=n_new,
                    )

                cpp = _LlamaCpp(path, batch, size, kv_dtype, unified)
                cpp_out, _ = cpp.generate(prompts, n_new)  # warm-up
                first = gen(0)  # compiles
                # interleaved, so that the load of this shared machine falls on both alike
                cpp_runs, kv_runs = [], []
                for r in range(repeats):
                    cpp_runs.append(batch * (n_new - 1) / cpp.generate(prompts, n_new)[1])
                    kv_runs.append(gen(r + 1).steady_tokens_per_second)
                cpp.close()
                same = [
                    next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), n_new)
                    for x, y in zip(first.tokens, cpp_out)
                ]
                rows.append(
                    dict(
                        batch=batch,
                        kv_dtype=kv_dtype,
                        unified=unified,
                        cpp=statistics.median(cpp_runs),
                        kvjax=statistics.median(kv_runs),
                        compile=first.compile_seconds,
                        same_min=min(same),
                        same_median=int(np.median(same)),
                    )
                )
    return rows


def _in_fresh_processes(quick: bool, n: int) -> list:
    """:func:`_measure` in ``n`` fresh Python processes, one after another: their rows."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    runs = []
    for _ in tqdm(range(n), desc="llama.cpp comparison", unit="process"):
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.bench_llamacpp", "--rows"] + (["--quick"] * quick),
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise RuntimeError(f"the comparison process failed:\n{done.stderr[-4000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return runs


def run(quick: bool = False) -> str:
    head = "## kvjax against llama.cpp (same GGUF weights, decode tokens/s)"
    try:
        import llama_cpp  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        return f"{head}\n\nSkipped: {e.name} is not installed (`pip install 'kvjax[llamacpp,gguf]'`)."
    cfg = tiny_llama().config
    n_new, prompt_len, repeats = _plan(quick)
    n_proc = 1 if quick else N_PROCESSES
    runs = _in_fresh_processes(quick, n_proc)
    rows, agree = [], []
    for i, first in enumerate(runs[0]):
        mine = [run_[i] for run_ in runs]
        ratios = [r["kvjax"] / r["cpp"] for r in mine]
        layout = "unified" if first["unified"] else "a stream per sequence"
        rows.append(
            [
                first["batch"],
                first["kv_dtype"],
                layout,
                f"{statistics.median(r['cpp'] for r in mine):.0f}",
                f"{statistics.median(r['kvjax'] for r in mine):.0f}",
                f"{statistics.median(ratios):.2f}",
                " / ".join(f"{x:.2f}" for x in ratios),
                f"{first['compile']:.1f} s",
            ]
        )
        agree.append(
            f"batch {first['batch']} ({first['kv_dtype']}, {layout}): equal for the first "
            f"{first['same_min']} (median {first['same_median']})"
        )
    return "\n\n".join(
        [
            head,
            f"Model: {cfg.n_layer} layers, width {cfg.d_model}, {cfg.n_heads} heads, vocab {cfg.vocab_size}, float32 "
            f"weights, written as GGUF and loaded by both. {prompt_len}-token prompts, {n_new} greedy tokens per "
            f"sequence; llama.cpp: `llama-cpp-python` {llama_cpp.__version__}, {N_THREADS} threads, one `llama_decode` "
            "of a B-row `llama_batch` per step, argmax on the host; kvjax: `kvjax.generate` (device loop, "
            f"`sync_every={n_new}`) of the model with fused projections (`kvjax.nn.fuse_projections`), steady "
            f"tokens/s (compile time apart). In {n_proc} fresh processes one after another (on this shared machine "
            "a process runs at its own speed for its whole life, up to a third apart from the next one, so "
            f"repeats inside one process do not average that out); in each, medians of {repeats} with the two sides "
            "interleaved; the table gives the medians over the processes and each process's ratio. Both sides "
            "store K/V in the same dtype (llama.cpp's default is float16: `type_k`/`type_v`) and the same layout: "
            "unified is one K/V buffer for every sequence (`kv_unified=true` / `kvjax.CacheConfig`), a stream per "
            "sequence is llama.cpp's default for several sequences (`kv_unified=false`) / `kvjax.StreamsConfig`.",
            table(
                [
                    "batch",
                    "K/V dtype",
                    "K/V layout",
                    "llama.cpp tokens/s",
                    "kvjax tokens/s",
                    "kvjax / llama.cpp",
                    "per process",
                    "kvjax compile (first run)",
                ],
                rows,
            ),
            "Greedy tokens of kvjax and llama.cpp per sequence (of "
            + str(n_new)
            + ", first process): "
            + "; ".join(agree)
            + ". Float sums in another order flip near ties of this random model, after which the sequences differ.",
        ]
    )


if __name__ == "__main__":
    if "--rows" in sys.argv:  # one process's measurement, for run(): its rows as one JSON line
        print(json.dumps(_measure(quick="--quick" in sys.argv)))
    else:
        print(run(quick=bool(int(os.environ.get("QUICK", "0")))))
