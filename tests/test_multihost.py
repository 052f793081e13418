"""The multi-host story on one machine: two processes joined by ``jax.distributed``.

A multi-host job is several processes running the same program over one mesh of all their
devices. Two processes on this machine, each with 4 virtual CPU devices and gloo collectives, are
the closest the suite can get: ``tests/multihost_worker.py`` runs in each, on 1x8 (heads split
across the processes) and 2x4 meshes, and this test reads what each saw. See docs/sharding.md,
"Several hosts".
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_hold_their_shards_and_agree_with_one_device(tmp_path):
    port, n = _free_port(), 2
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(WORKER.parent.parent), env.get("PYTHONPATH", "")])
    outs = [tmp_path / f"process{i}.json" for i in range(n)]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(i), str(n), str(port), str(outs[i])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(n)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a jax.distributed worker did not finish in 240 s")
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{logs[i][-3000:]}"
    reports = [json.loads(o.read_text()) for o in outs]
    heads_seen = []
    for i, r in enumerate(reports):
        assert (r["process_count"], r["device_count"], r["local_device_count"]) == (2, 8, 4)
        for mesh in ("1x8", "2x4"):
            m = r[mesh]
            assert m["ok"] and m["logits_max_diff"] < 1e-4, (i, mesh, m)
            assert m["k_devices"] == 8 and m["k_local_shards"] == 4 and not m["k_fully_addressable"], (i, mesh, m)
            assert m["k_shards_equal"] and m["cells_equal"] and m["same_shardings"], (i, mesh, json.dumps(m))
            assert m["used"] == 8, (i, mesh, m)  # 8 placed tokens; seq_cp shares cells, it takes none
            restore = r[mesh + "-restore"]
            assert restore["shards_equal"] and restore["cells_equal"] and restore["same_shardings"], (i, mesh, restore)
            assert restore["seq_pos_max"] == 6 and restore["written_back"] is True, (i, mesh, restore)
        heads_seen.append(r["1x8"]["k_local_heads"])
        # 2x4: the model axis lies within each process, so each holds every head (its data row)
        assert r["2x4"]["k_local_heads"] == list(range(8))
    # 1x8: the heads are split across the processes, each holds its half only
    assert sorted(heads_seen) == [[0, 1, 2, 3], [4, 5, 6, 7]]
