"""Command line: ``python -m kvjax demo | train | bench``.

Compiled programs are kept in JAX's persistent compilation cache (``~/.cache/kvjax/xla``, or
``$KVJAX_CACHE_DIR``), so a second run starts in seconds; ``--no-compile-cache`` (or
``KVJAX_COMPILE_CACHE=0``) turns it off.

- ``demo``: the main job (see :mod:`kvjax.app._demo`).
- ``train [--steps N]``: train the demo's character model (writes ``kvjax/data/charlm.npz``).
- ``generate --model PATH --prompt TEXT [--n-parallel N] [--max-new-tokens N] [--temperature T]
  [--cache-type T] [--ctx N] [--padding N] [--kv-unified]``: text from a checkpoint folder (or
  .gguf), streamed, with the speed (see :mod:`kvjax.app._generate`).
- ``serve --model PATH [--host H] [--port P] [--ctx N] [--parallel N] [--slot-save-path DIR]``: an
  OpenAI-compatible server with continuous batching (see :mod:`kvjax.app._serve`; ``kvjax[serve]``).
- ``bench [--quick] [--only NAME ...] [--out BENCHMARKS.md]``: run ``benchmarks/bench_*.py``
  from a source checkout and write the results.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from kvjax.app import _bench as bench_runner
from kvjax.app import _charlm as charlm
from kvjax.app import _demo as demo_mod
from kvjax.app import _generate as generate_mod
from kvjax.app import _serve as serve_mod
import jax


def compile_cache_dir() -> pathlib.Path:
    """Where the persistent compilation cache lives: ``$KVJAX_CACHE_DIR``, else the user cache folder."""
    if os.environ.get("KVJAX_CACHE_DIR"):
        return pathlib.Path(os.environ["KVJAX_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "kvjax" / "xla"


def enable_compile_cache(folder: pathlib.Path) -> None:
    """Keep every compiled program in ``folder`` (JAX's persistent compilation cache)."""
    folder.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="do not keep compiled programs between runs (default: kept in ~/.cache/kvjax/xla or $KVJAX_CACHE_DIR)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through the cache operations (the main job)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (used by the test suite)")
    demo.add_argument(
        "--cache-type",
        default="float32",
        choices=["float32", "float16", "bfloat16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0"],
        help="K/V storage type of the cache (default float32; q8_0 etc. are ggml's blocks)",
    )
    train = sub.add_parser("train", help="train the demo's character-level model on the bundled corpus")
    train.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    train.add_argument("--seed", type=int, default=0)
    generate_mod.add_parser(sub)
    serve_mod.add_parser(sub)
    bench = sub.add_parser("bench", help="run the benchmarks and write BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke run)")
    bench.add_argument("--only", nargs="*", default=None, help="benchmark module names (e.g. core)")
    bench.add_argument("--out", default=None, help="output file (default: BENCHMARKS.md in the checkout)")
    args = parser.parse_args(argv)
    if not args.no_compile_cache and os.environ.get("KVJAX_COMPILE_CACHE", "1") != "0" and args.command != "bench":
        enable_compile_cache(compile_cache_dir())  # benchmarks measure compile time: never from a cache

    if args.command == "demo":
        return demo_mod.main(quick=args.quick, cache_type=args.cache_type)
    if args.command == "train":
        result = charlm.train(steps=args.steps, seed=args.seed)
        print(
            f"trained {args.steps} steps in {result.seconds:.0f} s, final loss "
            f"{sum(result.losses[-50:]) / len(result.losses[-50:]):.3f}; weights in {charlm.WEIGHTS}"
        )
        return 0
    if args.command == "generate":
        return generate_mod.main(args)
    if args.command == "serve":
        return serve_mod.main(args)
    return bench_runner.main(quick=args.quick, only=args.only, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
