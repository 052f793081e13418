"""Command line: ``python -m kvjax demo | bench | inspect``.

- ``demo``: the main job (see :mod:`kvjax.demo`).
- ``bench [--quick] [--only NAME ...] [--out BENCHMARKS.md]``: run ``benchmarks/bench_*.py``
  from a source checkout and write the results.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through the cache operations (the main job)")
    demo.add_argument("--quick", action="store_true", help="a shorter run (used by the test suite)")
    bench = sub.add_parser("bench", help="run the benchmarks and write BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke run)")
    bench.add_argument("--only", nargs="*", default=None, help="benchmark module names (e.g. core)")
    bench.add_argument("--out", default=None, help="output file (default: BENCHMARKS.md in the checkout)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from kvjax import demo as demo_mod

        return demo_mod.main(quick=args.quick)
    from kvjax import bench_runner

    return bench_runner.main(quick=args.quick, only=args.only, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
