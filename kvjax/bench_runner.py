"""Runs the benchmark modules of a source checkout and writes ``BENCHMARKS.md``.

Each ``benchmarks/bench_<name>.py`` defines ``run(quick: bool) -> str`` (a Markdown section).
The header of the output records the date, the machine, the versions, the allocator and the
command, so that numbers from different runs are never compared as if they were one run.
"""

from __future__ import annotations

import datetime
import importlib
import os
import pathlib
import platform
import sys
import time

from tqdm import tqdm


def checkout_root() -> pathlib.Path:
    """The source checkout holding ``benchmarks/`` (kvjax must be installed editable)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    if not (root / "benchmarks").is_dir():
        raise SystemExit("benchmarks/ not found next to the kvjax package: run `python -m kvjax bench` "
                         "from a source checkout installed with `pip install -e .`")
    return root


def machine_header(command: str) -> str:
    """Date, machine, versions, allocator and command, as Markdown."""
    import jax
    import jaxlib
    import numpy

    import flax

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
    return "\n".join([
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
    ])


def main(quick: bool = False, only=None, out=None) -> int:
    root = checkout_root()
    sys.path.insert(0, str(root))
    names = sorted(p.stem[len("bench_"):] for p in (root / "benchmarks").glob("bench_*.py"))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f"unknown benchmark(s) {unknown}: allowed {names}")
        names = [n for n in names if n in only]
    command = "python -m kvjax bench" + (" --quick" if quick else "") + (f" --only {' '.join(only)}" if only else "")
    sections = [machine_header(command)]
    for name in tqdm(names, desc="benchmarks", unit="module"):
        t0 = time.perf_counter()
        module = importlib.import_module(f"benchmarks.bench_{name}")
        sections.append(module.run(quick=quick).rstrip() + f"\n\n_(module took {time.perf_counter() - t0:.0f} s)_\n")
    text = "\n".join(sections)
    path = pathlib.Path(out) if out else root / "BENCHMARKS.md"
    path.write_text(text)
    print(text)
    print(f"\nwritten to {path}")
    return 0
