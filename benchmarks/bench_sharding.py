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

MESHES = (
    (None, "unified"),
    ((1, 8), "unified"),
    ((2, 4), "unified"),
    ((8, 1), "unified"),
    (None, "streams"),
    ((1, 8), "streams"),
    ((2, 4), "streams"),
    ((8, 1), "streams"),
)
#: the K-shift on a mesh: now (every head of a layer per loop step) against the per-head loop it ran before
SHIFT_MESHES = (
    (None, "unified"),
    ((1, 8), "unified"),
    ((2, 4), "unified"),
    (None, "streams"),
    ((8, 1), "streams"),
    ((2, 4), "streams"),
)


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


def _kv_collectives(hlo: str) -> int:
    """All-gathers, all-reduces, all-to-alls and collective permutes with an operand of at least 4096
    elements (the K/V-sized ones here: the scalars a program shares are far smaller)."""
    import re

    count = 0
    for shapes in re.findall(
        r"= (\([^)]*\)|\w+\[[0-9,]*\]\S*) (?:all-gather|all-reduce|all-to-all|"
        r"collective-permute|reduce-scatter)(?:-start)?\(",
        hlo,
    ):
        count += sum(
            int(np.prod([int(d) for d in dims.split(",") if d])) >= 4096
            for dims in re.findall(r"\w+\[([0-9,]*)\]", shapes)
        )
    return count


def _shift(mesh_shape, kind: str, per_head, repeats: int):
    """Median seconds of the K-shift of every cell of a 4-layer K (``per_head=True``: the loop
    before issue 44 on a mesh), and its K/V-sized collectives."""
    import jax

    import kvjax
    from kvjax import shard
    from kvjax.attn._rope import _shift_group

    base = kvjax.CacheConfig(
        size=1024, n_seq_max=8, n_layer=4, n_kv_heads=8, head_dim=64, padding=64, rope=kvjax.RopeConfig(n_rot=64)
    )
    config = kvjax.StreamsConfig(base.replace(size=256)) if kind == "streams" else base
    mesh = None if mesh_shape is None else shard.make_mesh(*mesh_shape)
    memory = kvjax.init(config, mesh=mesh)
    k = memory.split()[0][0][0]
    cells = base.size if kind == "unified" else 256
    delta = jax.numpy.full((cells,), 3, jax.numpy.int32)
    ropes = (base.rope[0],) * base.n_layer
    one = lambda k, d: _shift_group(k, d, ropes, base, per_head)
    fn = jax.jit(jax.vmap(one, in_axes=(0, None)) if kind == "streams" else one, donate_argnums=0)
    compiled = fn.lower(k, delta).compile()
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        k = compiled(k, delta)
        k.block_until_ready()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), _kv_collectives(compiled.as_text())


def _child(quick: bool) -> None:
    steps, repeats = (4, 2) if quick else (16, 3)
    out = {f"{shape}-{kind}": _measure(shape, kind, steps, repeats) for shape, kind in MESHES}
    for shape, kind in SHIFT_MESHES:
        for label, per_head in (("now", None), ("before", True)):
            if shape is None and label == "before":
                continue
            out[f"shift-{shape}-{kind}-{label}"] = _shift(shape, kind, per_head, 3 if quick else 7)
    print("RESULT " + json.dumps(out))


def run(quick: bool) -> str:
    env = dict(
        os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    )
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_sharding", "--child"] + (["--quick"] if quick else []),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"the sharding benchmark's child process failed:\n{proc.stderr[-3000:]}")
    rates = json.loads(lines[-1][len("RESULT ") :])
    rows = []
    for shape, kind in MESHES:
        rate = rates[f"{shape}-{kind}"]
        one = rates[f"None-{kind}"]
        rows.append(
            [kind, "1 device" if shape is None else f"{shape[0]}x{shape[1]}", f"{rate:.0f}", f"{rate / one:.2f}"]
        )
    shift_rows = []
    for shape, kind in SHIFT_MESHES:
        now, now_coll = rates[f"shift-{shape}-{kind}-now"]
        one = rates[f"shift-None-{kind}-now"][0]
        if shape is None:
            shift_rows.append([kind, "1 device", f"{now * 1e3:.2f}", "", str(now_coll), "", "1.00"])
            continue
        before, before_coll = rates[f"shift-{shape}-{kind}-before"]
        shift_rows.append(
            [
                kind,
                f"{shape[0]}x{shape[1]}",
                f"{now * 1e3:.2f}",
                f"{before * 1e3:.2f}",
                str(now_coll),
                str(before_coll),
                f"{now / one:.2f}",
            ]
        )
    return "\n".join(
        [
            "## Sharding: a sanity run on 8 virtual CPU devices",
            "",
            "The reference model's jitted step (4 layers, width 128, 8 heads, 8 kv heads, float32) decoding one "
            "token for each of 8 sequences after 64 tokens each, on `data x model` meshes of virtual CPU devices "
            "that share this machine's cores: a check that the sharded step runs without a cliff, not a speed "
            "claim (one device is expected to win here). Median of rounds of steps, compile excluded:",
            "",
            table(["memory", "mesh", "tokens/s", "vs 1 device"], rows),
            "",
            "The K-shift of every cell (4 layers, 8 kv heads of 64, float32; unified 1024 cells, streams 8 x 256), "
            "now (each loop step rotates every head of a layer where K lives on a mesh) against the per-head loop "
            "it ran before on a mesh (one `(layer, head)` slice per step: slicing a head out of a split head axis "
            "made XLA gather or all-reduce all of K). Median ms, compile excluded, with the K/V-sized collectives "
            "in each compiled program:",
            "",
            table(
                ["memory", "mesh", "now ms", "before ms", "K/V collectives now", "before", "now vs 1 device"],
                shift_rows,
            ),
        ]
    )


if __name__ == "__main__":
    if "--child" in sys.argv:
        _child("--quick" in sys.argv)
    else:
        print(run("--quick" in sys.argv))
