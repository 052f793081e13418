"""Runs the benchmark modules of a source checkout and writes ``BENCHMARKS.md``.

Each ``benchmarks/bench_<name>.py`` defines ``run(quick: bool) -> str`` (a Markdown section).
The header of the output records the date, the machine, the versions, the allocator and the
command, so that numbers from different runs are never compared as if they were one run; each
section carries the time it was run. ``--only NAME ...`` reruns some modules and keeps the other
sections of the file as they were.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
import pathlib
import platform
import re
import sys
import time

from tqdm import tqdm
import jax
import jaxlib
import numpy
import flax


def checkout_root() -> pathlib.Path:
    """The source checkout holding ``benchmarks/`` (kvjax must be installed editable)."""
    root = pathlib.Path(__file__).resolve().parents[2]  # kvjax/app/_bench.py -> the checkout
    if not (root / "benchmarks").is_dir():
        raise SystemExit(
            "benchmarks/ not found next to the kvjax package: run `python -m kvjax bench` "
            "from a source checkout installed with `pip install -e .`"
        )
    return root


def machine_header(command: str) -> str:
    """Date, machine, versions, allocator and command, as Markdown."""

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        if names:
            cpu = names[0]
    except OSError:
        pass
    preload = os.environ.get("LD_PRELOAD", "")
    allocator = "tcmalloc (LD_PRELOAD)" if "tcmalloc" in preload else "glibc malloc"
    devices = ", ".join(sorted({f"{d.platform}:{d.device_kind}" for d in jax.devices()}))
    return "\n".join(
        [
            "# kvjax benchmarks",
            "",
            f"- date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
            f"- machine: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
            f"- devices: {devices}",
            f"- versions: python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}, "
            f"flax {flax.__version__}, numpy {numpy.__version__}",
            f"- allocator: {allocator}",
            f"- command: `{command}`",
            "",
            "All times are medians over repeats; ratios compare numbers measured in the same run. "
            "\"copy\" is a plain jitted copy of the same number of bytes (the memory-bandwidth yardstick); "
            "\"floor\" is the dispatch cost of an empty jitted call. Compile times are listed separately.",
            "",
        ]
    )


_TCMALLOC = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


def _reexec_with_tcmalloc() -> None:
    """Restart under tcmalloc when it is installed (Debian: libtcmalloc-minimal4).

    glibc's allocator page-faults on every large fresh output buffer, which made fresh-output ops
    (and the fresh-copy baseline) 2-8x slower here; results say which allocator they ran with.
    Set ``KVJAX_BENCH_ALLOCATOR=system`` to keep glibc's.
    """
    if "tcmalloc" in os.environ.get("LD_PRELOAD", "") or os.environ.get("KVJAX_BENCH_ALLOCATOR") == "system":
        return
    lib = next((p for p in _TCMALLOC if os.path.exists(p)), None)
    if lib is None:
        print("note: tcmalloc not found (apt-get install libtcmalloc-minimal4); benchmarking with glibc malloc")
        return
    env = dict(os.environ, LD_PRELOAD=(lib + " " + os.environ.get("LD_PRELOAD", "")).strip())
    os.execvpe(sys.executable, [sys.executable, "-m", "kvjax"] + sys.argv[1:], env)


_SECTION = re.compile(r"<!-- bench:(\w+) -->\n(.*?)\n<!-- /bench:\1 -->", re.S)


def _read_sections(path: pathlib.Path):
    """(name, body) of every module section of an existing results file (``--only`` keeps the others)."""
    return _SECTION.findall(path.read_text())


def main(quick: bool = False, only=None, out=None) -> int:
    _reexec_with_tcmalloc()
    root = checkout_root()
    sys.path.insert(0, str(root))
    names = sorted(p.stem[len("bench_") :] for p in (root / "benchmarks").glob("bench_*.py"))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"unknown benchmark(s) {unknown}: allowed {names}")
        names = [n for n in names if n in only]
    command = "python -m kvjax bench" + (" --quick" if quick else "") + (f" --only {' '.join(only)}" if only else "")
    path = pathlib.Path(out) if out else root / "BENCHMARKS.md"
    sections = dict(_read_sections(path)) if only and path.exists() else {}
    for name in tqdm(names, desc="benchmarks", unit="module"):
        t0 = time.perf_counter()
        module = importlib.import_module(f"benchmarks.bench_{name}")
        body = module.run(quick=quick).rstrip()
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        sections[name] = (
            f"{body}\n\n_(module took {time.perf_counter() - t0:.0f} s; run {stamp}{', quick sizes' if quick else ''})_"
        )
        # one process runs every module: without this the compiled programs of the modules before
        # pile up (the quick run ran out of memory compiling in its 13th module)
        del module
        jax.clear_caches()
        gc.collect()
    text = (
        machine_header(command)
        + "\n"
        + "\n".join(f"<!-- bench:{name} -->\n{sections[name]}\n<!-- /bench:{name} -->\n" for name in sorted(sections))
    )
    path.write_text(text)
    print(text)
    print(f"\nwritten to {path}")
    return 0
