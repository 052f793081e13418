"""State I/O benchmarks: the seed's byte format (state_write / state_read) and session files.

A full cache (32768 cells, 16 layers, 8 kv heads, head size 64, float32: 2 GiB of K/V; with
``quick`` 4096 cells and 4 layers) holds 8 sequences of equal length, the first 256 cells shared
by two sequences, so that whole-cache blobs take the general (per-cell) metadata path. Each
operation is timed warm (median) as bytes of the blob per second, against a plain jitted copy of
the same number of bytes measured in the same run; the first call (compilation included) is
listed separately. The one-sequence rows move one of the 8 sequences.
"""

from __future__ import annotations

import gc
import os
import tempfile
import time

import jax
import numpy as np

import kvjax
from benchmarks.common import copy_bandwidth, fmt_rate, fmt_time, median_time, table
from kvjax.io import _state_layout


def _cache(size: int, n_layer: int):
    cfg = kvjax.CacheConfig(size=size, n_seq_max=8, n_layer=n_layer, n_kv_heads=8, head_dim=64, padding=256)
    cache = kvjax.init(cfg)
    per_seq = size // 8
    for s in range(8):
        ub = kvjax.make_ubatch(range(per_seq), [[s]] * per_seq)
        cache, _, ok = kvjax.find_slot(cache, ub)
        assert bool(ok)
    cache = kvjax.seq_cp(cache, 0, 1, 0, 256)  # shared cells: records of varying length
    key = jax.random.PRNGKey(0)
    k = tuple(jax.random.uniform(jax.random.fold_in(key, g), x.shape, x.dtype) for g, x in enumerate(cache.k))
    v = tuple(jax.random.uniform(jax.random.fold_in(key, 99 + g), x.shape, x.dtype) for g, x in enumerate(cache.v))
    return jax.block_until_ready(cache.replace(k=k, v=v)), per_seq


def _first(fn):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.perf_counter() - t0


def run(quick: bool) -> str:
    size, n_layer = (4096, 4) if quick else (32768, 16)
    repeats = 5 if quick else 3
    cache, per_seq = _cache(size, n_layer)
    rows = []

    def row(name, cells, n_bytes, fn, copy_bps, first_s):
        t = median_time(fn, repeats=repeats, warmup=0)
        gc.collect()
        rate = n_bytes / t
        rows.append(
            [
                name,
                cells,
                f"{n_bytes / 2**20:.0f} MiB",
                fmt_time(t),
                fmt_rate(rate),
                fmt_rate(copy_bps),
                f"{rate / copy_bps:.2f}",
                fmt_time(first_s),
            ]
        )

    # -- whole cache --------------------------------------------------------------------------
    blob, t_first = _first(lambda: kvjax.state_write(cache))
    n_whole = len(blob)
    copy_whole = copy_bandwidth(n_whole, repeats=repeats)
    gc.collect()
    row("state_write (whole cache)", size, n_whole, lambda: kvjax.state_write(cache), copy_whole, t_first)
    t0 = time.perf_counter()
    _state_layout._parse(cache.config, memoryview(blob), -1, size, "")
    t_parse_first = time.perf_counter() - t0
    row(
        "parse + validate only (host, whole)",
        size,
        n_whole,
        lambda: _state_layout._parse(cache.config, memoryview(blob), -1, size, ""),
        copy_whole,
        t_parse_first,
    )
    fresh = kvjax.init(cache.config)
    restored, t_first = _first(lambda: kvjax.state_read(fresh, blob))
    assert kvjax.state_write(restored) == blob
    del restored
    gc.collect()
    row("state_read (whole cache)", size, n_whole, lambda: kvjax.state_read(fresh, blob), copy_whole, t_first)
    holder = [kvjax.init(cache.config)]

    def donated():
        holder[0] = kvjax.state_read(holder[0], blob, donate=True)
        return holder[0]

    _, t_first = _first(donated)
    row("state_read (whole cache, donate=True)", size, n_whole, donated, copy_whole, t_first)
    holder = fresh = blob = None  # free the whole-cache buffers before the next section
    gc.collect()

    # -- one sequence -------------------------------------------------------------------------
    seq_blob, t_first = _first(lambda: kvjax.state_write(cache, 3))
    n_seq = len(seq_blob)
    copy_seq = copy_bandwidth(n_seq, repeats=repeats)
    row("state_write (one sequence)", per_seq, n_seq, lambda: kvjax.state_write(cache, 3), copy_seq, t_first)
    _, t_first = _first(lambda: kvjax.state_read(cache, seq_blob, 7))
    row(
        "state_read (one sequence into another id)",
        per_seq,
        n_seq,
        lambda: kvjax.state_read(cache, seq_blob, 7),
        copy_seq,
        t_first,
    )
    holder = [cache]

    def seq_donated():
        holder[0] = kvjax.state_read(holder[0], seq_blob, 7, donate=True)
        return holder[0]

    _, t_first = _first(seq_donated)
    row("state_read (one sequence, donate=True)", per_seq, n_seq, seq_donated, copy_seq, t_first)
    cache = holder[0]
    holder = None
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "seq.kvjax")
        tokens = np.arange(per_seq)
        _, t_first = _first(lambda: kvjax.save(path, cache, 3, tokens))
        row(
            "save (one sequence, file, fsync)",
            per_seq,
            os.path.getsize(path),
            lambda: kvjax.save(path, cache, 3, tokens),
            copy_seq,
            t_first,
        )
        _, t_first = _first(lambda: kvjax.load(path, cache, 7)[0])
        row(
            "load (one sequence, file)",
            per_seq,
            os.path.getsize(path),
            lambda: kvjax.load(path, cache, 7)[0],
            copy_seq,
            t_first,
        )

    cfg = cache.config
    kv_bytes = kvjax.total_size(cfg)
    return "\n".join(
        [
            "## State I/O (the seed's byte format)",
            "",
            f"Cache: {size} cells, {n_layer} layers, 8 kv heads x head size 64, float32 "
            f"({kv_bytes / 2**30:.2f} GiB of K/V), 8 sequences of {per_seq} cells, 256 cells shared. "
            "Rate = blob bytes per second (warm median); copy = a plain jitted copy of the same number "
            "of bytes in this run; ratio = rate / copy. \"first call\" includes compilation. A one-sequence "
            "read without donation copies the whole K/V once (the old value stays valid); with "
            "donate=True it scatters into the old buffers.",
            "",
            table(["operation", "cells", "bytes", "median", "rate", "copy", "ratio", "first call"], rows),
        ]
    )


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
