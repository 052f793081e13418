"""Shared benchmark tools: median timing, the plain-copy and dispatch baselines, tables.

Every benchmark module in this folder is named ``bench_*.py`` and defines
``run(quick: bool) -> str``, returning a Markdown section (a ``## `` heading, a sentence on what
is measured and tables). ``python -m kvjax bench`` runs them all and writes ``BENCHMARKS.md``.

Rules (the machines are shared and noisy): report medians over repeats, and ratios against a
baseline measured in the same run: bytes moved per second against :func:`copy_bandwidth` of the
same bytes, time per call against :func:`dispatch_floor`. Compile time is timed separately by
:func:`compile_time`, never mixed into run time.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def block(x):
    """Wait for every array in a pytree."""
    return jax.block_until_ready(x)


def median_time(fn: Callable[[], object], *, repeats: int = 7, number: int = 1, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn()`` (results blocked), ``number`` calls per sample."""
    for _ in range(warmup):
        block(fn())
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            out = fn()
        block(out)
        samples.append((time.perf_counter() - t0) / number)
    return statistics.median(samples)


def interleaved_medians(rounds: "dict[str, Callable[[], float]]", repeats: int) -> "dict[str, float]":
    """Median of what each named round returns (its seconds), the rounds run in turns, repeat by repeat.

    One warm-up turn first (it compiles); then ``repeats`` turns of every round, so that a slow spell
    of a shared machine falls on all of them alike instead of on whichever ran during it.

    Example:
        >>> interleaved_medians({"a": lambda: 1.0, "b": lambda: 2.0}, repeats=3)
        {'a': 1.0, 'b': 2.0}
    """
    samples = {name: [] for name in rounds}
    for r in range(repeats + 1):
        for name, round_ in rounds.items():
            seconds = round_()
            if r:  # the first turn compiles
                samples[name].append(seconds)
    return {name: statistics.median(s) for name, s in samples.items()}


def greedy_decode_rounds(engine, n_seq: int, first: int, steps: int) -> Callable[[], float]:
    """A round of ``steps`` greedy decode steps per call (sequences ``0..n_seq-1`` together, from
    position ``first`` on, each round continuing the last): the round's seconds a step.

    For :func:`interleaved_medians`: the engine must already hold each sequence's prompt.
    """
    state = {"pos": first, "tok": [1] * n_seq}

    def one_round() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            logits = engine.decode(state["tok"], [state["pos"]] * n_seq, [[s] for s in range(n_seq)])
            state["tok"] = [int(t) for t in np.argmax(np.asarray(logits), axis=-1)]
            state["pos"] += 1
        return (time.perf_counter() - t0) / steps

    return one_round


def compile_time(jitted, *args, **kwargs) -> float:
    """Seconds to lower and compile ``jitted`` for these arguments (nothing is run)."""
    t0 = time.perf_counter()
    jitted.lower(*args, **kwargs).compile()
    return time.perf_counter() - t0


_copy = jax.jit(lambda x: x + jnp.zeros((), x.dtype))


def copy_bandwidth(n_bytes: int, *, repeats: int = 7) -> float:
    """Bytes per second of a plain jitted copy of ``n_bytes`` of float32 (read + write counted once).

    The result is the throughput of producing a fresh buffer of that size, the memory-bandwidth
    yardstick every "bytes per second" number is compared with.
    """
    n = max(1, n_bytes // 4)
    x = jnp.ones((n,), jnp.float32)
    t = median_time(lambda: _copy(x), repeats=repeats)
    return n * 4 / t


_add_one = jax.jit(lambda x: x + 1.0, donate_argnums=0)


def inplace_copy_bandwidth(n_bytes: int, *, repeats: int = 7) -> float:
    """Bytes per second of a donated jitted ``x + 1`` over ``n_bytes`` of float32, in place.

    The yardstick of an in-place op (a donated write, defrag, K-shift): the same read and write
    of every byte as :func:`copy_bandwidth`, without a fresh output buffer, whose page faults
    dominate that baseline under glibc malloc (see the allocator line of ``BENCHMARKS.md``).
    """
    holder = [jnp.ones((max(1, n_bytes // 4),), jnp.float32)]

    def step():
        holder[0] = _add_one(holder[0])
        return holder[0]

    t = median_time(step, repeats=repeats)
    return holder[0].size * 4 / t


_empty = jax.jit(lambda x: x)


def dispatch_floor(*, repeats: int = 7, number: int = 200) -> float:
    """Seconds per call of an empty jitted function of one small array: the dispatch floor."""
    x = jnp.zeros((), jnp.int32)
    return median_time(lambda: _empty(x), repeats=repeats, number=number)


def fmt_time(seconds: float) -> str:
    """Seconds as a short human string (ns/µs/ms/s)."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if seconds >= scale or unit == "ns":
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds:.3g} s"


def fmt_rate(bytes_per_s: float) -> str:
    """Bytes per second as GB/s."""
    return f"{bytes_per_s / 1e9:.2f} GB/s"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def random_key(seed: int = 0):
    """A PRNG key."""
    return jax.random.PRNGKey(seed)


def numpy_rng(seed: int = 0) -> np.random.Generator:
    """A numpy generator."""
    return np.random.default_rng(seed)
