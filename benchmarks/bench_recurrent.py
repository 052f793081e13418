"""The recurrent memory: Mamba decode through the engine, and what a fork costs.

- Decode tokens/s of a small Mamba model through ``kvjax.Engine`` on a recurrent memory at batch
  1 and 8 (one token per sequence per step, after a 64-token prompt each), and the same model's
  bare jitted step on states the caller keeps (``make_mamba_step``), the floor the memory's
  bookkeeping adds to. Same run, compile excluded (one warm-up round).
- A fork: ``seq_cp`` of a sequence and the first decode of both (a copy-on-write of the shared
  state inside the step) against a plain decode step of two sequences.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import table
from kvjax.engine._engine import Engine
from kvjax.nn._mamba import Mamba, MambaConfig, make_mamba_step


def _median_seconds(fn, repeats):
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        fn()
        if r:  # the first round compiles
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _engine_rate(model, cfg, n_seq, steps, repeats):
    engine = Engine(model, kvjax.init(cfg.memory_config(n_seq)), n_ubatch=512)
    prompt = 64
    engine.decode(list(np.arange(prompt * n_seq) % 50), list(range(prompt)) * n_seq,
                  [[s] for s in range(n_seq) for _ in range(prompt)])
    state = {"pos": prompt}

    def run():
        for _ in range(steps):
            logits = engine.decode([1] * n_seq, [state["pos"]] * n_seq, [[s] for s in range(n_seq)])
            np.asarray(logits[0, 0])
            state["pos"] += 1

    return n_seq * steps / _median_seconds(run, repeats)


def _bare_rate(model, cfg, n_seq, steps, repeats):
    step = make_mamba_step(model)
    params = nnx.state(model)
    conv, ssm = cfg.zero_states(n_seq)
    box = {"conv": conv, "ssm": ssm}
    tokens = jnp.ones((n_seq, 1), jnp.int32)

    def run():
        for _ in range(steps):
            logits, box["conv"], box["ssm"] = step(params, tokens, box["conv"], box["ssm"])
            np.asarray(logits[0, 0, 0])

    return n_seq * steps / _median_seconds(run, repeats)


def _fork_cost(model, cfg, repeats):
    def fresh():
        engine = Engine(model, kvjax.init(cfg.memory_config(4)), n_ubatch=512)
        engine.decode(list(range(1, 33)), list(range(32)), [[0]] * 32)
        engine.decode([1, 2], [0, 0], [[2], [3]])        # two more sequences, so the plain step has company
        return engine

    plain_times, fork_times = [], []
    for r in range(repeats + 1):
        engine = fresh()
        t0 = time.perf_counter()
        np.asarray(engine.decode([3, 4], [1, 1], [[2], [3]])[0, 0])            # plain: two own states
        t1 = time.perf_counter()
        engine.cache = kvjax.seq_cp(engine.cache, 0, 1)
        np.asarray(engine.decode([5, 6], [32, 32], [[0], [1]])[0, 0])          # fork: copy-on-write
        t2 = time.perf_counter()
        if r:
            plain_times.append(t1 - t0)
            fork_times.append(t2 - t1)
    return statistics.median(plain_times), statistics.median(fork_times)


def run(quick: bool) -> str:
    steps, repeats = (8, 2) if quick else (32, 5)
    cfg = MambaConfig(vocab_size=256, d_model=256, n_layer=4, d_state=16)
    model = Mamba(cfg, rngs=nnx.Rngs(0))
    rows = []
    for n_seq in (1, 8):
        engine = _engine_rate(model, cfg, n_seq, steps, repeats)
        bare = _bare_rate(model, cfg, n_seq, steps, repeats)
        rows.append([f"{n_seq}", f"{engine:.0f}", f"{bare:.0f}", f"{engine / bare:.2f}"])
    plain, fork = _fork_cost(model, cfg, repeats)
    state_kib = cfg.memory_config(1).nbytes() / 1024
    return "\n".join([
        "## Recurrent memory: Mamba decode and forks",
        "",
        f"Mamba, {cfg.n_layer} layers, d_model {cfg.d_model}, d_state {cfg.d_state} ({state_kib:.0f} KiB of state per "
        f"sequence), float32; one token per sequence per step after a 64-token prompt each; median of {repeats} "
        f"rounds of {steps} steps, compile excluded. 'bare step' is the same model's jitted step on states the "
        f"caller keeps (no memory, no placement, no host work): what the memory's bookkeeping and the engine add to.",
        "",
        table(["sequences", "engine tokens/s", "bare step tokens/s", "engine / bare"], rows),
        "",
        f"A fork (`seq_cp`, then the first decode of both sequences, which copies the shared state inside the "
        f"step) against a plain decode step of two sequences, median of {repeats}:",
        "",
        table(["plain step", "seq_cp + step with copy-on-write", "ratio"],
              [[f"{plain * 1e3:.2f} ms", f"{fork * 1e3:.2f} ms", f"{fork / plain:.2f}"]]),
    ])
