"""One process of the two-process ``jax.distributed`` check (run by ``tests/test_multihost.py``).

Not a test module: ``python tests/multihost_worker.py PROCESS_ID N_PROCESSES PORT OUT.json``. Each
process starts JAX with 4 virtual CPU devices, joins the others through ``jax.distributed``
(gloo collectives on CPU), and then runs the same kvjax program as every other process on a mesh
of all 8 devices, the way a multi-host job does. It writes what it saw to ``OUT.json``:

- the memory's K/V live on all 8 devices, this process holding only its 4 devices' shards, and
  those shards equal the same slices of an unsharded run on this process's own device 0;
- the cell metadata (replicated) reads on every host and equals the unsharded run's;
- the reference model's sharded step gives the unsharded logits;
- one sequence read back from a state blob into the global memory (a parked conversation resumed)
  equals the unsharded read, keeps the memory's layout and writes back the same blob.
"""

from __future__ import annotations

import json
import os
import sys


def _shards_equal(sharded, plain) -> bool:
    """Every shard this process holds equals the same slice of the unsharded array."""
    import numpy as np

    whole = np.asarray(plain)
    # within float rounding: the sharded projections may sum in another order
    return all(
        np.allclose(np.asarray(s.data), whole[s.index], rtol=1e-5, atol=1e-5) for s in sharded.addressable_shards
    )


def main(process_id: int, n_processes: int, port: int, out: str) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}", num_processes=n_processes, process_id=process_id
    )
    import numpy as np
    from flax import nnx

    import kvjax
    from kvjax import shard
    from kvjax.nn import Llama, LlamaConfig, make_step

    local = jax.local_devices()[0]
    report = {
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
    }
    cfg = LlamaConfig(vocab_size=64, d_model=64, n_layer=2, n_heads=16, n_kv_heads=8)
    model = Llama(cfg, rngs=nnx.Rngs(0))  # same seed in every process: the same weights
    step = make_step(model)
    plain_state = nnx.state(model)  # uncommitted, on this process's first device: placeable anywhere
    tokens = np.arange(8, dtype=np.int32) * 5 % cfg.vocab_size
    ubatch = kvjax.make_ubatch([0, 1, 2, 3] * 2, [[0]] * 4 + [[5]] * 4)
    for name, shape in (("1x8", (1, 8)), ("2x4", (2, 4))):  # heads across the two processes, then within
        mesh = shard.make_mesh(*shape)
        state = shard.shard_params(plain_state, mesh, n_kv_heads=cfg.n_kv_heads)
        config = cfg.cache_config(size=64, n_seq_max=8, padding=16)
        memory = kvjax.init(config, mesh=mesh)
        with jax.default_device(local):
            plain = kvjax.init(config)
        want, plain, ok_plain = step(plain_state, plain, ubatch, tokens, n_kv=16)
        got, memory, ok = step(state, memory, ubatch, tokens, n_kv=16)
        memory = kvjax.seq_cp(memory, 0, 2)
        plain = kvjax.seq_cp(plain, 0, 2)
        memory, plain = (
            kvjax.update(kvjax.seq_add(memory, 5, 0, -1, 3)),
            kvjax.update(kvjax.seq_add(plain, 5, 0, -1, 3)),
        )
        # a parked conversation resumed: sequence 5 read back from its blob into the global memory
        # (the rows go to the devices that hold their heads, in both processes)
        blob = kvjax.state_write(plain, 5)
        restored = kvjax.state_read(kvjax.seq_rm(memory, 5, 0, -1)[0], blob, 5)
        plain_restored = kvjax.state_read(kvjax.seq_rm(plain, 5, 0, -1)[0], blob, 5)
        try:
            written = kvjax.state_write(restored, 5) == blob
        except Exception as e:  # noqa: BLE001 - reported, the test says what failed
            written = f"{type(e).__name__}: {e}"[:300]
        k = memory.k[0]
        report[name + "-restore"] = {
            "shards_equal": _shards_equal(restored.k[0], plain_restored.k[0])
            and _shards_equal(restored.v[0], plain_restored.v[0]),
            "cells_equal": all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(restored.cells), jax.tree.leaves(plain_restored.cells))
            ),
            "same_shardings": shard.same_shardings(restored, kvjax.init(config, mesh=mesh)),
            "seq_pos_max": int(kvjax.seq_pos_max(restored, 5)),
            "written_back": written,
        }
        report[name] = {
            "ok": bool(ok) and bool(ok_plain),
            "logits_max_diff": float(np.max(np.abs(np.asarray(got) - np.asarray(want)))),
            "k_devices": len(k.sharding.device_set),
            "k_local_shards": len(k.addressable_shards),
            "k_fully_addressable": bool(k.is_fully_addressable),
            "k_local_heads": sorted({h for s in k.addressable_shards for h in range(k.shape[1])[s.index[1]]}),
            "k_shards_equal": _shards_equal(k, plain.k[0]) and _shards_equal(memory.v[0], plain.v[0]),
            "cells_equal": all(
                np.array_equal(np.asarray(a), np.asarray(b))
                for a, b in zip(jax.tree.leaves(memory.cells), jax.tree.leaves(plain.cells))
            ),
            "used": int(kvjax.used_cells(memory)),
            "same_shardings": shard.same_shardings(memory, kvjax.init(config, mesh=mesh)),
        }
    with open(out, "w") as f:
        json.dump(report, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
