"""The recurrent memory: Mamba decode through the engine, and what a fork costs.

- Decode tokens/s of a small Mamba model through ``kvjax.Engine`` on a recurrent memory at batch
  1 and 8 (one token per sequence per step, after a 64-token prompt each), and the same model's
  bare jitted step on states the caller keeps (``make_mamba_step``), the floor the memory's
  bookkeeping adds to. Same run, compile excluded (one warm-up round).
- ``generate`` (the device loop) against the same model's pure jitted loops: one ``fori_loop``
  of placement, the model through the memory and argmax (``bench_generate``'s yardstick for the
  Llama engine), and one of the bare step on states the loop carries (no memory at all).
  Interleaved repeat by repeat, compile excluded.
- Prefill: a prompt through ``Engine.decode`` with each form of the selective scan
  (``MambaConfig.scan``: the per-token recurrence, CPU's default, and the chunked parallel scan),
  interleaved, against the bare uncached ``forward`` of the same tokens.
- A fork: ``seq_cp`` of a sequence and the first decode of both (a copy-on-write of the shared
  state inside the step) against a plain decode step of two sequences.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import table
from kvjax import Engine, generate
from kvjax.engine._sampling import SamplingConfig
from kvjax.memory._ubatch import Ubatch
from kvjax.nn._inputs import UbatchInputs
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
    engine.decode(
        list(np.arange(prompt * n_seq) % 50),
        list(range(prompt)) * n_seq,
        [[s] for s in range(n_seq) for _ in range(prompt)],
    )
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


def _memory_loop(graphdef):
    """Greedy decode as one jitted ``fori_loop``: placement, the model through the memory, argmax."""

    def loop(state, memory, tok, pos, n):
        def body(i, carry):
            memory, tok = carry
            ub = Ubatch(
                pos=jnp.broadcast_to(pos + i, tok.shape).astype(jnp.int32),
                seq_ids=jnp.arange(tok.shape[0], dtype=jnp.int32)[:, None],
                valid=jnp.ones(tok.shape, bool),
                n_seq_tokens=1,
            )
            memory, placement, _ = memory.find_slot(ub)
            logits, memory = nnx.merge(graphdef, state)(tok, memory, UbatchInputs(ubatch=ub, placement=placement))
            return memory, jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (memory, tok))

    return jax.jit(loop, static_argnames="n", donate_argnames="memory")


def _bare_loop(graphdef):
    """Greedy decode as one jitted ``fori_loop`` of the bare step on states the loop carries."""

    def loop(state, conv, ssm, tok, n):
        def body(i, carry):
            conv, ssm, tok = carry
            logits, conv, ssm = nnx.merge(graphdef, state).step(tok[:, None], conv, ssm)
            return conv, ssm, jnp.argmax(logits[:, -1], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (conv, ssm, tok))

    return jax.jit(loop, static_argnames="n", donate_argnums=(1, 2))


def _against_loops(model, cfg, quick: bool, cells: int = 8):
    """Rows ``[sequences, generate, memory loop, ratio, bare loop, ratio]`` (tokens/s, medians), in a
    memory of ``cells`` state cells (a server's slots; one cell alone takes another write path)."""
    graphdef, state = nnx.split(model)
    memory_loop, bare_loop = _memory_loop(graphdef), _bare_loop(graphdef)
    n_new, prompt_len, repeats = (16, 8, 2) if quick else (128, 16, 7)
    rng = np.random.default_rng(1)
    rows = []
    for n_seq in (1, 8):
        prompts = [rng.integers(1, cfg.vocab_size, size=prompt_len).tolist() for _ in range(n_seq)]

        def prefilled():
            engine = Engine(model, kvjax.init(cfg.memory_config(cells)))
            logits = engine.decode(
                sum(prompts, []),
                [p for _ in prompts for p in range(prompt_len)],
                [[s] for s in range(n_seq) for _ in range(prompt_len)],
                outputs="last",
            )
            return engine.cache, jnp.argmax(logits, -1).astype(jnp.int32)

        def timed(fn, *args, **kw):
            jax.block_until_ready(args)
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args, **kw))
            return n_seq * (n_new - 1) / (time.perf_counter() - t0)

        def mem():
            memory, tok = prefilled()
            return timed(memory_loop, state, memory, tok, jnp.int32(prompt_len), n=n_new - 1)

        def bare():
            conv, ssm = cfg.zero_states(n_seq)
            return timed(bare_loop, state, conv, ssm, jnp.ones((n_seq,), jnp.int32), n=n_new - 1)

        def gen(r):
            return generate(
                Engine(model, kvjax.init(cfg.memory_config(cells))),
                prompts,
                max_new_tokens=n_new,
                key=jax.random.PRNGKey(r),
                sampling=SamplingConfig(temperature=0),
                sync_every=n_new,
            ).steady_tokens_per_second

        mem(), bare(), gen(0)  # compile
        got = {"gen": [], "mem": [], "bare": []}
        for r in range(repeats):  # interleaved: a slow spell hits all three alike
            got["gen"].append(gen(r + 1))
            got["mem"].append(mem())
            got["bare"].append(bare())
        g, m, b = (statistics.median(got[k]) for k in ("gen", "mem", "bare"))
        rows.append([f"{n_seq}", f"{g:.0f}", f"{m:.0f}", f"{g / m:.2f}", f"{b:.0f}", f"{g / b:.2f}"])
    return rows, n_new, prompt_len, repeats, cells


def _prefill(model, cfg, quick: bool):
    """Rows ``[sequences x prompt, sequential, chunked, speed-up, forward]``: prefill tokens/s."""
    forms = {scan: Mamba(dataclasses.replace(cfg, scan=scan), rngs=nnx.Rngs(0)) for scan in ("sequential", "chunked")}
    graphdef, state = nnx.split(forms["sequential"])
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).forward(tokens)[:, -1])
    repeats = 2 if quick else 5
    rows = []
    for n_seq, length in ((1, 64), (8, 64), (1, 512)) if not quick else ((1, 16),):
        prompts = np.random.default_rng(2).integers(1, cfg.vocab_size, size=(n_seq, length))

        def engine(m):
            e = Engine(m, kvjax.init(m.config.memory_config(8)), n_ubatch=512)
            t0 = time.perf_counter()
            np.asarray(
                e.decode(
                    prompts.reshape(-1).tolist(),
                    list(range(length)) * n_seq,
                    [[s] for s in range(n_seq) for _ in range(length)],
                    outputs="last",
                )
            )
            return n_seq * length / (time.perf_counter() - t0)

        def bare():
            t0 = time.perf_counter()
            jax.block_until_ready(forward(state, jnp.asarray(prompts, jnp.int32)))
            return n_seq * length / (time.perf_counter() - t0)

        engine(forms["sequential"]), engine(forms["chunked"]), bare()  # compile
        got = {"sequential": [], "chunked": [], "bare": []}
        for _ in range(repeats):
            for scan, m in forms.items():
                got[scan].append(engine(m))
            got["bare"].append(bare())
        seq_, chunk_, bare_ = (statistics.median(got[k]) for k in ("sequential", "chunked", "bare"))
        rows.append([f"{n_seq} x {length}", f"{seq_:.0f}", f"{chunk_:.0f}", f"{seq_ / chunk_:.2f}", f"{bare_:.0f}"])
    return rows, repeats


def _fork_cost(model, cfg, repeats):
    def fresh():
        engine = Engine(model, kvjax.init(cfg.memory_config(4)), n_ubatch=512)
        engine.decode(list(range(1, 33)), list(range(32)), [[0]] * 32)
        engine.decode([1, 2], [0, 0], [[2], [3]])  # two more sequences, so the plain step has company
        return engine

    plain_times, fork_times = [], []
    for r in range(repeats + 1):
        engine = fresh()
        t0 = time.perf_counter()
        np.asarray(engine.decode([3, 4], [1, 1], [[2], [3]])[0, 0])  # plain: two own states
        t1 = time.perf_counter()
        engine.cache = kvjax.seq_cp(engine.cache, 0, 1)
        np.asarray(engine.decode([5, 6], [32, 32], [[0], [1]])[0, 0])  # fork: copy-on-write
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
    loop_rows, n_new, prompt_len, loop_repeats, cells = _against_loops(model, cfg, quick)
    prefill_rows, prefill_repeats = _prefill(model, cfg, quick)
    plain, fork = _fork_cost(model, cfg, repeats)
    state_kib = cfg.memory_config(1).nbytes() / 1024
    return "\n".join(
        [
            "## Recurrent memory: Mamba decode and forks",
            "",
            f"Mamba, {cfg.n_layer} layers, d_model {cfg.d_model}, d_state {cfg.d_state} ({state_kib:.0f} KiB of state per "
            f"sequence), float32; one token per sequence per step after a 64-token prompt each; median of {repeats} "
            f"rounds of {steps} steps, compile excluded. 'bare step' is the same model's jitted step on states the "
            f"caller keeps (no memory, no placement, no host work): what the memory's bookkeeping and the engine add to.",
            "",
            table(["sequences", "engine tokens/s", "bare step tokens/s", "engine / bare"], rows),
            "",
            f"`generate` (greedy, the device loop, a memory of {cells} state cells, {prompt_len}-token prompts, "
            f"{n_new} new tokens each, steady "
            f"tokens/s) against the same model's decode as one jitted `fori_loop`: 'memory loop' places each token and "
            f"runs the model through the memory (the yardstick `bench_generate` uses for the Llama engine), 'bare "
            f"loop' runs the bare step on states the loop carries; interleaved, median of {loop_repeats}:",
            "",
            table(
                [
                    "sequences",
                    "generate tokens/s",
                    "memory loop",
                    "generate / memory loop",
                    "bare loop",
                    "generate / bare loop",
                ],
                loop_rows,
            ),
            "",
            f"Prefill tokens/s: the prompts through `Engine.decode` (engine, placement and memory included, "
            f"8 state cells) with the per-token recurrence (`MambaConfig(scan='sequential')`, the default on CPU) and "
            f"with the chunked parallel scan (`scan='chunked'`, chunks of {cfg.scan_chunk}), and the bare uncached "
            f"`forward` of the same tokens (sequential scan); interleaved, median of {prefill_repeats}:",
            "",
            table(
                [
                    "sequences x prompt",
                    "engine, sequential scan",
                    "engine, chunked scan",
                    "sequential / chunked",
                    "bare forward",
                ],
                prefill_rows,
            ),
            "",
            f"A fork (`seq_cp`, then the first decode of both sequences, which copies the shared state inside the "
            f"step) against a plain decode step of two sequences, median of {repeats}:",
            "",
            table(
                ["plain step", "seq_cp + step with copy-on-write", "ratio"],
                [[f"{plain * 1e3:.2f} ms", f"{fork * 1e3:.2f} ms", f"{fork / plain:.2f}"]],
            ),
        ]
    )
