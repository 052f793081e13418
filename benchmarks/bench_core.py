"""Core benchmarks: sequence operations and slot placement, and find_slot + write of a ubatch.

Each operation is timed as the public eager call (host validation + one jitted dispatch) on a
half-full cache, against the dispatch floor of an empty jitted function and against the
pure-Python reference model (``tests/reference/unified.py``) doing the same operation.
``find_slot`` + ``write`` of a 512-token ubatch into 16 layers is timed as one donated jitted step,
as bytes written per second against a plain copy of the same bytes.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.common import (
    compile_time,
    copy_bandwidth,
    dispatch_floor,
    fmt_rate,
    fmt_time,
    inplace_copy_bandwidth,
    median_time,
    table,
)
from kvjax.testing._unified_reference import UnifiedRef


def _populated(size: int, n_seq_max: int, rng):
    """A cache and its reference, half full, with 4 sequences sharing a prefix and holes."""
    cfg = kvjax.CacheConfig(size=size, n_seq_max=n_seq_max, n_layer=1, n_kv_heads=1, head_dim=8)
    cache = kvjax.init(cfg)
    ref = UnifiedRef(size=size, n_seq_max=n_seq_max, padding=cfg.padding)
    n_seq = min(4, n_seq_max)
    chunk = size // (2 * n_seq)
    for s in range(n_seq):
        pos = list(range(chunk))
        ids = [[s] for _ in pos]
        cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(pos, ids))
        ref.find_slot(list(zip(pos, ids)))
    cache = kvjax.seq_cp(cache, 0, n_seq_max - 1, 0, chunk // 2)
    ref.seq_cp(0, n_seq_max - 1, 0, chunk // 2)
    # a few holes
    cache, _ = kvjax.seq_rm(cache, 1, chunk // 4, chunk // 2)
    ref.seq_rm(1, chunk // 4, chunk // 2)
    return cache, ref


def _ops(size):
    """(name, kvjax call, reference call) triples; references run on a fresh copy each time."""
    q = size // 16
    return [
        ("seq_rm", lambda c: kvjax.seq_rm(c, 2, q, 2 * q), lambda r: r.seq_rm(2, q, 2 * q)),
        ("seq_cp", lambda c: kvjax.seq_cp(c, 0, 2, 0, q), lambda r: r.seq_cp(0, 2, 0, q)),
        ("seq_keep", lambda c: kvjax.seq_keep(c, 0), lambda r: r.seq_keep(0)),
        ("seq_add", lambda c: kvjax.seq_add(c, 3, q, -1, -7), lambda r: r.seq_add(3, q, -1, -7)),
        ("seq_div", lambda c: kvjax.seq_div(c, 3, 0, -1, 2), lambda r: r.seq_div(3, 0, -1, 2)),
        ("seq_pos_min", lambda c: kvjax.seq_pos_min(c, 1), lambda r: r.seq_pos_min(1)),
        ("seq_pos_max", lambda c: kvjax.seq_pos_max(c, 1), lambda r: r.seq_pos_max(1)),
        ("pos_max", lambda c: kvjax.pos_max(c), lambda r: r.pos_max()),
        ("n_tokens", lambda c: kvjax.n_tokens(c), lambda r: r.n_tokens()),
        ("used_cells (reference: a counter)", lambda c: kvjax.used_cells(c), lambda r: r.used_cells()),
        ("cell_max", lambda c: kvjax.cell_max(c), lambda r: r.cell_max()),
        ("n_kv", lambda c: kvjax.n_kv(c), lambda r: r.n_kv()),
        ("has_shift", lambda c: kvjax.has_shift(c), lambda r: any(cell.delta for cell in r.cells)),
        ("clear", lambda c: kvjax.clear(c), lambda r: r.clear()),
    ]


def _find_slot_rows(cache, ref, n_tokens):
    ub = kvjax.make_ubatch(range(10**6, 10**6 + n_tokens), [[1]] * n_tokens)
    toks = [(10**6 + i, [1]) for i in range(n_tokens)]
    return [
        (f"find_slot T={n_tokens} (contiguous)", lambda c: kvjax.find_slot(c, ub)[2], lambda r: r.find_slot(toks)),
        (
            f"find_slot T={n_tokens} (scattered)",
            lambda c: kvjax.find_slot(c, ub, contiguous=False)[2],
            lambda r: r.find_slot(toks, contiguous=False),
        ),
    ]


def _time_reference(ref, fn, repeats):
    import time

    samples = []
    for _ in range(repeats):
        r = copy.deepcopy(ref)
        t0 = time.perf_counter()
        fn(r)
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


def _ops_section(quick: bool) -> str:
    floor = dispatch_floor()
    rng = np.random.default_rng(0)
    sizes = [4096] if quick else [4096, 32768]
    seqs = [4] if quick else [4, 256]
    rows = []
    for size in sizes:
        for n_seq_max in seqs:
            cache, ref = _populated(size, n_seq_max, rng)
            for name, op, ref_op in _ops(size) + _find_slot_rows(cache, ref, 1) + _find_slot_rows(cache, ref, 512):
                t = median_time(lambda: op(cache), repeats=5 if quick else 9, number=5 if quick else 20)
                t_ref = _time_reference(ref, ref_op, repeats=3 if quick else 5)
                rows.append(
                    [name, size, n_seq_max, fmt_time(t), f"{t / floor:.1f}x", fmt_time(t_ref), f"{t_ref / t:.2g}x"]
                )
    return "\n".join(
        [
            "### Sequence operations and placement (eager public call, half-full cache)",
            "",
            f"Dispatch floor (empty jitted function of one array): {fmt_time(floor)} per call.",
            "",
            table(["op", "cells", "n_seq_max", "kvjax", "vs floor", "Python reference", "kvjax speed-up"], rows),
        ]
    )


def _copy_fields(fields):
    """A jitted copy of the named cell arrays into fresh buffers (what an op must write at least)."""
    return jax.jit(lambda c: [getattr(c, f) + jnp.zeros((), getattr(c, f).dtype) for f in fields])


def _jitted_section(quick: bool) -> str:
    """The jitted metadata ops (no host validation) against the floor and a copy of what they write.

    An op on an undonated value must write a fresh buffer for every array it changes (pos, seq,
    delta: 12 + 4 W bytes a cell), so a plain jitted copy of those arrays is its lower bound here.
    """
    from kvjax.memory import _cells
    from kvjax.memory._slots import find_slot_cells

    floor = dispatch_floor()
    size = 4096 if quick else 32768
    i32 = np.int32
    q = size // 16
    rows = []
    for n_seq_max in (4, 256):
        cache, _ = _populated(size, n_seq_max, None)
        cells = cache.cells
        ub1 = kvjax.make_ubatch([10**6], [[1]])
        ub8 = kvjax.make_ubatch(range(10**6, 10**6 + 8), [[1]] * 8)
        ub512 = kvjax.make_ubatch(range(10**6, 10**6 + 512), [[1]] * 512)
        all3 = ("pos", "seq", "delta")
        ops = [
            ("seq_rm", all3, lambda: _cells.seq_rm(cells, i32(2), i32(q), i32(2 * q))),
            ("seq_cp", ("seq",), lambda: _cells.seq_cp(cells, i32(0), i32(2), i32(0), i32(q))),
            ("seq_add", all3, lambda: _cells.seq_add(cells, i32(3), i32(q), i32(-1), i32(-7))),
            ("find_slot T=1", ("pos", "seq"), lambda: find_slot_cells(cells, ub1)),
            ("find_slot T=8", ("pos", "seq"), lambda: find_slot_cells(cells, ub8)),
            ("find_slot T=512", ("pos", "seq"), lambda: find_slot_cells(cells, ub512)),
            ("find_slot T=1 (scattered)", ("pos", "seq"), lambda: find_slot_cells(cells, ub1, contiguous=False)),
            ("find_slot T=512 (scattered)", ("pos", "seq"), lambda: find_slot_cells(cells, ub512, contiguous=False)),
        ]
        copies = {}
        for name, fields, op in ops:
            if fields not in copies:
                cp = _copy_fields(fields)
                copies[fields] = median_time(lambda: cp(cells), repeats=9 if not quick else 5, number=20)
            t = median_time(op, repeats=9 if not quick else 5, number=20)
            t_copy = copies[fields]
            rows.append(
                [
                    name,
                    size,
                    n_seq_max,
                    fmt_time(t),
                    f"{t / floor:.1f}x",
                    "+".join(fields),
                    fmt_time(t_copy),
                    f"{t_copy / floor:.1f}x",
                    f"{t / t_copy:.2f}",
                ]
            )
    return "\n".join(
        [
            "### Jitted metadata ops (cell level, no host validation), half-full cache",
            "",
            f"Dispatch floor (empty jitted function of one array): {fmt_time(floor)} per call. \"copy\" is a "
            "jitted copy of the arrays the op writes into fresh buffers (its lower bound without donation).",
            "",
            table(
                ["op", "cells", "n_seq_max", "jitted", "vs floor", "writes", "copy", "copy vs floor", "op / copy"], rows
            ),
        ]
    )


def _write_section(quick: bool) -> str:
    size, n_layer, heads, dim, n_tok = (4096, 4, 8, 64, 512) if quick else (32768, 16, 8, 64, 512)
    cfg = kvjax.CacheConfig(size=size, n_seq_max=4, n_layer=n_layer, n_kv_heads=heads, head_dim=dim)
    cache = kvjax.init(cfg)

    def step(cache, ub, k, v):
        cache, slot, ok = kvjax.find_slot(cache, ub)
        for layer in range(n_layer):
            cache = kvjax.write(cache, layer, slot, k[layer], v[layer])
        return cache, ok

    jstep = jax.jit(step, donate_argnums=0)
    key = jax.random.PRNGKey(0)
    k = jax.random.normal(key, (n_layer, n_tok, heads, dim), jnp.float32)
    v = jax.random.normal(jax.random.fold_in(key, 1), (n_layer, n_tok, heads, dim), jnp.float32)
    ub0 = kvjax.make_ubatch(range(n_tok), [[0]] * n_tok)
    t_compile = compile_time(jstep, cache, ub0, k, v)
    state = {"cache": cache, "p": 0}

    def once():
        c = kvjax.clear(state["cache"])  # keep room: each call places the ubatch at cell 0
        c, ok = jstep(c, ub0, k, v)
        state["cache"] = c
        return ok

    t = median_time(once, repeats=5 if quick else 9)
    t_clear = median_time(lambda: kvjax.clear(state["cache"]).cells.pos, repeats=5)
    n_bytes = 2 * n_layer * n_tok * heads * dim * 4
    bw = copy_bandwidth(n_bytes)
    bw_in = inplace_copy_bandwidth(n_bytes)
    rate = n_bytes / max(t - t_clear, 1e-9)
    return "\n".join(
        [
            f"### find_slot + write of a {n_tok}-token ubatch into {n_layer} layers",
            "",
            f"Cache: {size} cells, {n_layer} layers, {heads} kv heads, head size {dim}, float32 "
            f"({kvjax.total_size(cfg) / 2**30:.2f} GiB of K/V), one jitted step donating the cache.",
            "",
            table(
                [
                    "step time",
                    "bytes written",
                    "rate",
                    "copy (fresh buffer)",
                    "rate / copy",
                    "copy in place (donated)",
                    "rate / in-place copy",
                    "compile",
                ],
                [
                    [
                        fmt_time(t - t_clear),
                        f"{n_bytes / 2**20:.0f} MiB",
                        fmt_rate(rate),
                        fmt_rate(bw),
                        f"{rate / bw:.2f}",
                        fmt_rate(bw_in),
                        f"{rate / bw_in:.2f}",
                        fmt_time(t_compile),
                    ]
                ],
            ),
        ]
    )


def run(quick: bool = False) -> str:
    return "\n\n".join(
        [
            "## Core: sequence operations, placement, K/V writes",
            _ops_section(quick),
            _jitted_section(quick),
            _write_section(quick),
        ]
    )
