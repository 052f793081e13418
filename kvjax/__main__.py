"""Command line: ``python -m kvjax demo | train | bench``.

- ``demo``: the main job (see :mod:`kvjax.app._demo`).
- ``train [--steps N]``: train the demo's character model (writes ``kvjax/data/charlm.npz``).
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
    train = sub.add_parser("train", help="train the demo's character-level model on the bundled corpus")
    train.add_argument("--steps", type=int, default=1500, help="optimizer steps (default 1500)")
    train.add_argument("--seed", type=int, default=0)
    bench = sub.add_parser("bench", help="run the benchmarks and write BENCHMARKS.md")
    bench.add_argument("--quick", action="store_true", help="small sizes, few repeats (a smoke run)")
    bench.add_argument("--only", nargs="*", default=None, help="benchmark module names (e.g. core)")
    bench.add_argument("--out", default=None, help="output file (default: BENCHMARKS.md in the checkout)")
    args = parser.parse_args(argv)

    if args.command == "demo":
        from kvjax.app import _demo as demo_mod

        return demo_mod.main(quick=args.quick)
    if args.command == "train":
        from kvjax.app import _charlm as charlm

        result = charlm.train(steps=args.steps, seed=args.seed)
        print(f"trained {args.steps} steps in {result.seconds:.0f} s, final loss "
              f"{sum(result.losses[-50:]) / len(result.losses[-50:]):.3f}; weights in {charlm.WEIGHTS}")
        return 0
    from kvjax.app import _bench as bench_runner

    return bench_runner.main(quick=args.quick, only=args.only, out=args.out)


if __name__ == "__main__":
    sys.exit(main())
