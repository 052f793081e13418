"""``python -m kvjax demo``: a walk through the cache operations, printing the cell map.

Three sequences share a prompt, diverge, one is dropped, one is shifted (context shift) and the
placement policies are compared on a fragmented cache. Every step prints the cell map
(``.`` empty, a digit the sequence holding the cell, ``+`` a cell shared by several sequences).
"""

from __future__ import annotations

import time

import kvjax


def _show(title: str, cache) -> None:
    print(f"\n== {title}")
    print(kvjax.cell_map(cache, width=64))


def walk_through(quick: bool = False) -> kvjax.KVCache:
    """Run the cell-operation walk-through and return the final cache."""
    cfg = kvjax.CacheConfig(size=128, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16, padding=32)
    cache = kvjax.init(cfg)
    print(f"cache: {cfg.size} cells, {cfg.n_seq_max} sequences, {len(cfg.cached_layers)} layers, "
          f"{kvjax.total_size(cfg) / 1024:.0f} KiB of K/V")

    prompt = 24
    cache, _, ok = kvjax.find_slot(cache, kvjax.make_ubatch(range(prompt), [[0]] * prompt))
    _show(f"prompt of {prompt} tokens in sequence 0", cache)

    for dst in (1, 2):
        cache = kvjax.seq_cp(cache, 0, dst)
    _show("prefix shared with sequences 1 and 2 (seq_cp: no K/V copied)", cache)

    steps = 4 if quick else 12
    for t in range(steps):
        pos = prompt + t
        ub = kvjax.make_ubatch([pos] * 3, [[0], [1], [2]])
        cache, _, ok = kvjax.find_slot(cache, ub)
    _show(f"{steps} decode steps, one token per sequence per step", cache)

    cache = kvjax.seq_rm(cache, 1)
    _show("sequence 1 dropped (seq_rm): its own cells are free, the shared prefix stays", cache)

    n_keep, n_discard = 4, 8
    p_end = int(kvjax.seq_pos_max(cache, 2)) + 1
    cache = kvjax.seq_rm(cache, 2, n_keep, n_keep + n_discard)
    cache = kvjax.seq_add(cache, 2, n_keep + n_discard, p_end, -n_discard)
    _show(f"context shift of sequence 2: keep {n_keep}, discard {n_discard}, shift the rest by -{n_discard} "
          f"(pending K-shift: {bool(kvjax.has_shift(cache))})", cache)
    print(f"sequence 2 now spans positions {int(kvjax.seq_pos_min(cache, 2))}..{int(kvjax.seq_pos_max(cache, 2))}")

    n_big = int(cfg.size - kvjax.used_cells(cache))  # exactly the free cells, but not in one run
    big = kvjax.make_ubatch(range(n_big), [[3]] * n_big)
    _, _, ok_cont = kvjax.find_slot(cache, big)
    scattered, slot, ok_scat = kvjax.find_slot(cache, big, contiguous=False)
    print(f"\n{n_big} tokens for sequence 3: contiguous placement ok={bool(ok_cont)}, scattered ok={bool(ok_scat)}")
    _show("after scattered placement of sequence 3", scattered)
    return scattered


def main(quick: bool = False) -> int:
    t0 = time.perf_counter()
    walk_through(quick=quick)
    print(f"\ndemo finished in {time.perf_counter() - t0:.1f} s")
    return 0
