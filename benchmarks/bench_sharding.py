"""A sanity run of the sharded decode step on 8 virtual CPU devices (not a speed claim).

Virtual CPU devices (``--xla_force_host_platform_device_count=8``) share this machine's cores, so a
mesh cannot be faster than one device here: the numbers only show that the sharded step runs, what
its collectives cost on shared cores, and that nothing falls off a cliff (an accidental all-gather
of K/V would). The flag must be set before JAX starts, so the measurements run in a child process.

Per mesh: the reference model's jitted step (``kvjax.nn.make_step``) decoding one token for each
of 8 sequences after a 64-token prompt each, weights placed by ``kvjax.shard.shard_params`` and the
memory created by ``kvjax.init(config, mesh=mesh)``; median of rounds of steps, compile excluded.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import table

MESHES = ((None, "unified"), ((1, 8), "unified"), ((2, 4), "unified"), ((8, 1), "unified"),
          (None, "streams"), ((1, 8), "streams"), ((2, 4), "streams"))


def _measure(mesh_shape, kind: str, steps: int, repeats: int) -> float:
    import kvjax
    from flax import nnx
    from kvjax import shard
    from kvjax.nn import Llama, LlamaConfig, make_step

    n_seq, context = 8, 64
    cfg = LlamaConfig(vocab_size=64, d_model=128, n_layer=4, n_heads=8, n_kv_heads=8)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    step, state = make_step(model), nnx.state(model)
    base = cfg.cache_config(size=256 if kind == "streams" else 256 * n_seq, n_seq_max=n_seq, padding=64)
    config = kvjax.StreamsConfig(base) if kind == "streams" else base
    mesh = None if mesh_shape is None else shard.make_mesh(*mesh_shape)
    if mesh is not None:
        state = shard.shard_params(state, mesh)
    memory = kvjax.init(config, mesh=mesh)
    window = 256 if kind == "streams" else 64 * n_seq * 2

    def ubatch(positions):
        slots = [([p], [s]) for s, p in enumerate(positions)]
        if kind == "streams":
            return kvjax.make_equal_ubatch(slots)
        return kvjax.make_ubatch(list(positions), [[s] for s in range(n_seq)])

    for p in range(context):  # the prompt, a token per sequence per step (same program as decode)
        _, memory, ok = step(state, memory, ubatch([p] * n_seq), np.full(n_seq, p % 64, np.int32), n_kv=window)
    assert bool(ok)
    times = []
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        for i in range(steps):
            p = context + r * steps + i
            logits, memory, ok = step(state, memory, ubatch([p] * n_seq), np.ones(n_seq, np.int32), n_kv=window)
        logits.block_until_ready()
        if r:
            times.append((time.perf_counter() - t0) / steps)
    return n_seq / statistics.median(times)


def _child(quick: bool) -> None:
    steps, repeats = (4, 2) if quick else (16, 3)
    out = {f"{shape}-{kind}": _measure(shape, kind, steps, repeats) for shape, kind in MESHES}
    print("RESULT " + json.dumps(out))


def run(quick: bool) -> str:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                                     f"--xla_force_host_platform_device_count=8".strip())
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_sharding", "--child"] + (["--quick"] if quick else []),
                          env=env, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the sharding benchmark's child process failed:\n{proc.stderr[-3000:]}")
    rates = json.loads(lines[-1][len("RESULT "):])
    rows = []
    for shape, kind in MESHES:
        rate = rates[f"{shape}-{kind}"]
        one = rates[f"None-{kind}"]
        rows.append([kind, "1 device" if shape is None else f"{shape[0]}x{shape[1]}", f"{rate:.0f}",
                     f"{rate / one:.2f}"])
    return "\n".join([
        "## Sharding: a sanity run on 8 virtual CPU devices",
        "",
        "The reference model's jitted step (4 layers, width 128, 8 heads, 8 kv heads, float32) decoding one "
        "token for each of 8 sequences after 64 tokens each, on `data x model` meshes of virtual CPU devices "
        "that share this machine's cores: a check that the sharded step runs without a cliff, not a speed "
        "claim (one device is expected to win here). Median of rounds of steps, compile excluded:",
        "",
        table(["memory", "mesh", "tokens/s", "vs 1 device"], rows),
    ])


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child("--quick" in sys.argv)
    else:
        print(run("--quick" in sys.argv))
