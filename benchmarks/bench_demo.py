"""The demo's first and second run: what a new user waits for, with and without the compile cache.

``python -m kvjax demo`` is run as a user runs it, each time in a fresh Python process, and timed
from process start to exit. Per repeat, in a new empty cache folder (``KVJAX_CACHE_DIR``):

- **first run**: the folder is empty, so every program is compiled and written to it;
- **second run**: the same command again, its programs read back from JAX's persistent
  compilation cache;
- **cache off**: ``python -m kvjax --no-compile-cache demo``, the control (it compiles everything,
  like the first run, and writes nothing).

The demo's own report is read from its output: its time inside ``main`` (``demo finished in``), and
for its main ``generate`` (three prompts sharing a prefix, the line it prints after the second cell
map) the seconds spent tracing, lowering and compiling (or fetching from the cache) and the steady
tokens/s. The demo's other calls (a one-token ``generate`` without sharing before it, the K-shift
and defrag after it) compile too; they are in the process and demo times, not in that column. A bare
``python -c "import kvjax"`` is timed in the same way as the floor every run pays (interpreter, jax
and kvjax imports). The four runs are interleaved repeat by repeat; the table gives medians.
"""

from __future__ import annotations

import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List

from benchmarks.common import table

#: What the demo prints (``kvjax/app/_demo.py``); a run whose output lacks one of them is an error.
_FINISHED = re.compile(r"demo finished in ([0-9.]+) s")
_MAIN_GENERATE = re.compile(
    r"([0-9.]+) tokens/s over \d+ sequences \(compile time apart: ([0-9.]+) s for (\d+) programs"
)


def _env(cache_dir: pathlib.Path) -> Dict[str, str]:
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, KVJAX_CACHE_DIR=str(cache_dir), KVJAX_COMPILE_CACHE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return env


def _timed(argv: List[str], env: Dict[str, str], *, demo: bool = True) -> Dict[str, float]:
    """Wall seconds of ``python argv`` in a fresh process, and (``demo``) the numbers the demo printed."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable] + argv, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"`python {' '.join(argv)}` failed:\n{done.stderr[-3000:]}")
    result = {"wall": wall}
    if demo:
        finished, main_call = _FINISHED.search(done.stdout), _MAIN_GENERATE.search(done.stdout)
        if finished is None or main_call is None:
            raise RuntimeError(
                f"the demo's report changed; bench_demo reads {_FINISHED.pattern!r} and "
                f"{_MAIN_GENERATE.pattern!r}:\n{done.stdout[-3000:]}"
            )
        result.update(
            inside=float(finished.group(1)),
            tokens_per_second=float(main_call.group(1)),
            compile=float(main_call.group(2)),
            programs=float(main_call.group(3)),
        )
    return result


def run(quick: bool = False) -> str:
    repeats = 1 if quick else 3
    demo = ["-m", "kvjax", "demo"] + (["--quick"] if quick else [])
    runs: Dict[str, List[Dict[str, float]]] = {
        "first run (empty cache)": [],
        "second run (cached)": [],
        "cache off (--no-compile-cache)": [],
        "import kvjax only": [],
    }
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="kvjax-bench-demo-") as tmp:
            env = _env(pathlib.Path(tmp) / "xla")
            runs["first run (empty cache)"].append(_timed(demo, env))
            runs["second run (cached)"].append(_timed(demo, env))
            runs["cache off (--no-compile-cache)"].append(
                _timed(demo[:2] + ["--no-compile-cache"] + demo[2:], env)
            )  # the flag wins over the env
            runs["import kvjax only"].append(_timed(["-c", "import kvjax"], env, demo=False))

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    rows = []
    for name, samples in runs.items():
        if "inside" in samples[0]:
            rows.append(
                [
                    name,
                    f"{med(name, 'wall'):.1f} s",
                    f"{med(name, 'inside'):.1f} s",
                    f"{med(name, 'compile'):.1f} s ({med(name, 'programs'):.0f} programs)",
                    f"{med(name, 'tokens_per_second'):.0f}",
                ]
            )
        else:
            rows.append([name, f"{med(name, 'wall'):.1f} s", "", "", ""])
    first, second = med("first run (empty cache)", "wall"), med("second run (cached)", "wall")
    command = "python -m kvjax demo" + (" --quick" if quick else "")
    return "\n".join(
        [
            "## The demo's first and second run (persistent compilation cache)",
            "",
            f"`{command}` in a fresh process, timed from start to exit; each repeat in a new empty cache folder "
            f"(`KVJAX_CACHE_DIR`): the first run compiles every program and keeps it, the second reads them back, "
            f"and `--no-compile-cache` is the control. \"Inside the demo\" is the demo's own `demo finished in`; "
            f"\"main generate: compile\" is what its shared-prefix `generate` (three prompts) spent tracing, lowering "
            f"and compiling (or fetching from the cache: tracing and lowering still run), reported apart from its "
            f"steady tokens/s; the demo's other calls compile too (in the first two columns). "
            f"Medians of {repeats}, the runs interleaved.",
            "",
            table(["run", "process wall time", "inside the demo", "main generate: compile", "steady tokens/s"], rows),
            "",
            f"First / second run: **{first / second:.1f}x** ({first:.1f} s against {second:.1f} s); of the second "
            f"run, {med('import kvjax only', 'wall'):.1f} s is starting Python and importing jax and kvjax.",
            "",
        ]
    )
