"""Defragmentation and compaction of a large cache: moved bytes per second against a plain copy.

A 32768-cell cache of 16 layers (8 kv heads, head size 64, float32: 1 GiB of K and 1 GiB of V)
is fragmented to 10%, 50% and 90% by the seed's measure (used cells scattered uniformly over the
window, the last cell used, so ``n_kv`` is the whole cache). For each level:

- planning time alone (jitted, metadata only) of the defrag and compaction plans;
- ``kvjax.defrag`` and ``kvjax.compact`` (and ``compact_seq`` of one of 4 sequences) as one
  donated jitted program each, timed as bytes of the moved rows per second against
  ``copy_bandwidth`` of the same bytes, measured in the same run;
- the same defrag plan applied as a full permutation gather of every buffer (what one would
  write without the moved-cells list), to show what copying only the moved rows saves;
- ``apply_pending`` with and without the pending flag (the ``lax.cond`` must cost nothing when no
  defrag is pending).

Every timed call donates its cache, so the buffers are updated in place and memory stays at one
cache plus the moved rows; between samples only the cell metadata is reset (outside the timing),
so each sample moves the same rows. ``quick=True`` uses a 4096-cell, 2-layer cache.
"""

from __future__ import annotations

import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax.memory._cells import empty_cells
from benchmarks.common import (
    block,
    compile_time,
    copy_bandwidth,
    dispatch_floor,
    fmt_rate,
    inplace_copy_bandwidth,
    fmt_time,
    median_time,
    table,
)

_defrag_mod = sys.modules["kvjax.memory._defrag"]  # the module (``kvjax.defrag`` is the function)
_moves = sys.modules["kvjax.memory._defrag_moves"]  # its plans and row moves

LEVELS = (0.1, 0.5, 0.9)
N_SEQ = 4


def _config(quick: bool) -> kvjax.CacheConfig:
    if quick:
        return kvjax.CacheConfig(size=4096, n_seq_max=N_SEQ, n_layer=2, n_kv_heads=2, head_dim=32)
    return kvjax.CacheConfig(size=32768, n_seq_max=N_SEQ, n_layer=16, n_kv_heads=8, head_dim=64)


def _fragmented_cells(cfg: kvjax.CacheConfig, frag: float, rng) -> kvjax.Cells:
    """Cells with ``used = (1 - frag) * size - padding`` scattered uniformly, the last cell used."""
    size = cfg.size
    n_used = int(round((1.0 - frag) * size)) - cfg.padding
    chosen = np.sort(np.concatenate([rng.choice(size - 1, n_used - 1, replace=False), [size - 1]]))
    pos = np.full(size, -1, np.int32)
    seq = np.zeros((size, cfg.n_words), np.uint32)
    pos[chosen] = np.arange(n_used, dtype=np.int32) // N_SEQ
    seq[chosen, 0] = np.uint32(1) << (np.arange(n_used) % N_SEQ).astype(np.uint32)
    return empty_cells(size, cfg.n_seq_max).replace(pos=jnp.asarray(pos), seq=jnp.asarray(seq))


def _row_bytes(cfg: kvjax.CacheConfig) -> int:
    """Bytes of K and V of one cell over every cached layer."""
    return kvjax.total_size(cfg) // cfg.size


@functools.partial(jax.jit, donate_argnums=0)
def _full_permutation(cache):
    """The defrag plan applied by gathering every cell of every buffer (the naive alternative)."""
    plan = _moves.make_plan(cache.cells, np.int32(np.iinfo(np.int32).max), kind="defrag")
    cells = cache.cells
    new_cells = cells.replace(
        pos=cells.pos[plan.src],
        seq=cells.seq[plan.src],
        delta=cells.delta[plan.src],
        head=plan.head,
        defrag=jnp.bool_(False),
    )
    take = lambda b: b.at[:, :, plan.src, :].get(mode="promise_in_bounds")  # noqa: E731
    return cache.replace(cells=new_cells, k=tuple(map(take, cache.k)), v=tuple(map(take, cache.v)))


_defrag = jax.jit(kvjax.defrag, donate_argnums=0)
_compact = jax.jit(kvjax.compact, donate_argnums=0)
_compact_seq = jax.jit(kvjax.compact_seq, donate_argnums=0)
run_pending = jax.jit(_defrag_mod.apply_pending, donate_argnums=0)


def _time_donated(fn, holder, cells, repeats):
    """Median seconds of ``fn(cache)`` with fresh copies of ``cells`` on the held buffers.

    ``holder`` is a one-element list holding the current cache; each call donates it and the
    result takes its place, so K/V are never copied outside the timed call."""
    samples = []
    for i in range(repeats + 1):
        cache = holder[0].replace(cells=jax.tree.map(jnp.copy, cells))
        block(cache)
        t0 = time.perf_counter()
        holder[0] = block(fn(cache))
        if i:  # the first call warms up
            samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


_OPS = (
    ("defrag", _defrag, ()),
    ("compact", _compact, ()),
    ("compact_seq(0)", _compact_seq, (np.int32(0),)),
    ("full permutation", _full_permutation, ()),
)


def run(quick: bool) -> str:
    cfg = _config(quick)
    repeats = 3 if quick else 5
    rng = np.random.default_rng(0)
    row = _row_bytes(cfg)
    levels = [_fragmented_cells(cfg, frag, rng) for frag in LEVELS]

    # 1. Metadata only: the K/V of `meta` are shapes, nothing of the cache's size is allocated.
    plan_rows, moved = [], {}
    for frag, cells in zip(LEVELS, levels):
        meta = kvjax.abstract(cfg).replace(cells=cells)
        plans = {
            "defrag": kvjax.defrag_plan(meta),
            "compact": _defrag_mod.compact_plan(meta),
            "compact_seq(0)": _defrag_mod.compact_seq_plan(meta, 0),
        }
        moved[frag] = {name: int(p.n_cells) for name, p in plans.items()}
        moved[frag]["full permutation"] = cfg.size  # every row read and written
        t_plan = median_time(lambda: kvjax.defrag_plan(meta), repeats=repeats)
        t_cplan = median_time(lambda: _defrag_mod.compact_plan(meta), repeats=repeats)
        plan_rows.append(
            [
                f"{frag:.0%} ({float(kvjax.fragmentation(meta)):.3f})",
                int(kvjax.used_cells(meta)),
                moved[frag]["defrag"],
                int(plans["defrag"].n_moves),
                fmt_time(t_plan),
                moved[frag]["compact"],
                fmt_time(t_cplan),
            ]
        )
    meta = kvjax.abstract(cfg).replace(cells=levels[0])
    compiles = [(name, compile_time(fn, meta, *args)) for name, fn, args in _OPS]
    compiles.append(("defrag plan", compile_time(jax.jit(kvjax.defrag_plan), meta)))

    # 2. Baselines, before the cache exists (peak memory: two buffers of the largest byte count).
    sizes = sorted({n * row for per_op in moved.values() for n in per_op.values() if n})
    copy = {b: copy_bandwidth(b, repeats=repeats) for b in sizes}
    inplace = {b: inplace_copy_bandwidth(b, repeats=repeats) for b in sizes}

    # 3. The cache, donated from call to call.
    holder = [kvjax.init(cfg)]
    move_rows = []
    for frag, cells in zip(LEVELS, levels):
        t_defrag = None
        for name, fn, args in _OPS:
            t = _time_donated(lambda c: fn(c, *args), holder, cells, repeats)
            n_bytes = moved[frag][name] * row
            t_defrag = t if name == "defrag" else t_defrag
            rate = n_bytes / t
            move_rows.append(
                [
                    f"{frag:.0%}",
                    name,
                    moved[frag][name],
                    f"{n_bytes / 2**20:.0f} MiB",
                    fmt_time(t),
                    fmt_rate(rate),
                    fmt_rate(inplace[n_bytes]),
                    f"{rate / inplace[n_bytes]:.2f}",
                    fmt_rate(copy[n_bytes]),
                    f"{rate / copy[n_bytes]:.2f}",
                    f"{t / t_defrag:.1f}x" if name == "full permutation" else "",
                ]
            )
    # apply_pending: the lax.cond must not copy the cache when no defrag is pending.
    half = levels[LEVELS.index(0.5)]
    t_idle = _time_donated(run_pending, holder, half, repeats)
    t_busy = _time_donated(run_pending, holder, half.replace(defrag=jnp.bool_(True)), repeats)
    t_floor = dispatch_floor(repeats=repeats)
    del holder
    pending_rows = [
        ["not pending", fmt_time(t_idle), f"{t_idle / t_floor:.0f}x"],
        ["pending (50% fragmentation)", fmt_time(t_busy), f"{t_busy / t_floor:.0f}x"],
    ]

    size_txt = (
        f"{cfg.size} cells, {cfg.n_layer} layers, {cfg.n_kv_heads[0]} kv heads, head size "
        f"{cfg.head_dim[0]}, float32: K+V {kvjax.total_size(cfg) / 2**30:.2f} GiB, "
        f"{row} bytes per cell"
    )
    return "\n\n".join(
        [
            "## Defragmentation and compaction (kvjax.defrag)",
            f"Cache: {size_txt}. Used cells scattered uniformly, the last cell used; fragmentation by the "
            "seed's measure (in parentheses as measured). Every timed call is one jitted program with "
            f"the cache donated (in place); moved rows are copied in chunks of {_defrag_mod.CHUNK} cells. "
            "Rates are bytes of the moved rows per second, against two copies of the same bytes measured "
            "in the same run: \"in place\" a donated `x + 1` (the yardstick of an in-place op) and "
            "\"copy\" `common.copy_bandwidth` (into a fresh buffer, page faults included). \"full perm.\" "
            "applies the defrag plan by gathering every row of every buffer (the alternative to a list of "
            "moved rows), timed relative to the defrag.",
            "Planning alone (metadata only, jitted):",
            table(
                [
                    "fragmentation",
                    "used",
                    "defrag cells",
                    "defrag moves",
                    "defrag plan",
                    "compact cells",
                    "compact plan",
                ],
                plan_rows,
            ),
            "Moving K/V:",
            table(
                [
                    "fragmentation",
                    "op",
                    "rows moved",
                    "bytes",
                    "time",
                    "moved bytes/s",
                    "in place",
                    "vs in place",
                    "copy",
                    "vs copy",
                    "full perm. / defrag",
                ],
                move_rows,
            ),
            "`apply_pending` (donated, jitted; what `kvjax.update` runs after the K-shift), against the "
            "dispatch floor of an empty jitted call:",
            table(["defrag flag", "time", "vs floor"], pending_rows),
            "Compile time (separate from the run times above):",
            table(["program", "compile"], [[n, fmt_time(t)] for n, t in compiles]),
        ]
    )


if __name__ == "__main__":
    print(run(quick="--quick" in sys.argv))
