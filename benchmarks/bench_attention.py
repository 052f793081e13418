"""Attention-path benchmarks: KQ masks, K-shift, update, decode attention, step cost vs occupancy.

Yardsticks measured in the same run: ``copy`` is ``benchmarks.common.copy_bandwidth`` (a jitted
copy into a fresh buffer, which includes the allocator's page faults), ``copy in place`` is
``benchmarks.common.inplace_copy_bandwidth`` (a donated update of the same bytes, no fresh buffer),
and ``read`` a jitted sum over the same bytes (what an attention kernel that only reads K/V can
reach at best).

- Masks: ``kvjax.kq_mask`` (the public call) against the mask's bytes written at copy speed and
  against a numpy implementation of the seed's host loop (one vectorized pass over the cells per
  token; a pure-Python double loop at the smallest size).
- K-shift: ``k_shift`` of a 16-layer cache (8 kv heads, head size 64, float32), jitted with K
  donated, as K bytes per second against copying K; the single fused broadcast formulation that
  was replaced is timed as well. ``update`` with nothing pending costs a dispatch.
- Decode attention (T = 1 and 8 tokens, 32 query heads over 8 kv heads, head size 64): K+V bytes
  read per second; the formulations that were tried are timed side by side.
- Step cost: one decode step (``find_slot``, mask, 4 layers of ``write`` + ``attention``, jitted,
  cache donated) on a 32768-cell cache at 10% and 100% occupancy, with the window from
  ``kv_window``, against attending over every cell at 10%.
- Sequences side by side: B sequences decoding in one unified cache (their cells interleaved),
  4 layers of attention with the owned chunks against the dense loop.
"""

from __future__ import annotations

import math
import time

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
    interleaved_medians,
    median_time,
    table,
)
from kvjax.attn._attention import chunk_size
from kvjax.memory._cells import Cells

# -- yardsticks ---------------------------------------------------------------------------------

_sum = jax.jit(lambda x: jnp.sum(x))


def read_bandwidth(n_bytes: int, repeats: int = 7) -> float:
    """Bytes per second of a jitted sum over ``n_bytes`` of float32 (reads only)."""
    x = jnp.ones((max(1, n_bytes // 4),), jnp.float32)
    return n_bytes / median_time(lambda: _sum(x), repeats=repeats)


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


# -- masks --------------------------------------------------------------------------------------


def _random_cells(size: int, n_seq: int, used_frac: float, rng) -> Cells:
    used = rng.random(size) < used_frac
    seq = np.zeros((size, 1), np.uint32)
    seq[used, 0] = rng.integers(1, 2**n_seq, used.sum()).astype(np.uint32)
    pos = np.where(used, rng.integers(0, size, size), -1).astype(np.int32)
    return Cells(
        pos=jnp.asarray(pos),
        seq=jnp.asarray(seq),
        delta=jnp.zeros(size, jnp.int32),
        head=jnp.int32(0),
        error=jnp.uint32(0),
        defrag=jnp.bool_(False),
        n_seq_max=n_seq,
    )


def numpy_mask(cell_pos, cell_seq_words, tok_pos, tok_seq, n_kv):
    """The seed's set_input_kq_mask loop, vectorized over the cells of each token (causal, no SWA)."""
    out = np.empty((len(tok_pos), n_kv), np.float32)
    p0 = cell_pos[:n_kv]
    words = cell_seq_words[:n_kv, 0]
    for j, (p1, s) in enumerate(zip(tok_pos, tok_seq)):
        member = (words >> np.uint32(s)) & np.uint32(1)
        visible = (member != 0) & (p0 <= p1) & (p0 >= 0)
        out[j] = np.where(visible, 0.0, -np.inf)
    return out


def python_mask(cell_pos, cell_seqs, tok_pos, tok_seq, n_kv):
    """The seed's loop literally: tokens x cells in Python."""
    out = [[0.0] * n_kv for _ in tok_pos]
    for j, (p1, s) in enumerate(zip(tok_pos, tok_seq)):
        for i in range(n_kv):
            p0 = cell_pos[i]
            masked = s not in cell_seqs[i] or p0 > p1 or p0 < 0
            out[j][i] = -math.inf if masked else 0.0
    return out


def _bench_masks(quick: bool, rng) -> str:
    size = 4096 if quick else 32768
    windows = (1024, 4096) if quick else (4096, 32768)
    lengths = (1, 64) if quick else (1, 512)
    cfg = kvjax.CacheConfig(size=size, n_seq_max=4, n_layer=1, n_kv_heads=1, head_dim=8, padding=256)
    cache = kvjax.init(cfg).replace(cells=_random_cells(size, 4, 0.9, rng))
    cell_pos = np.asarray(cache.cells.pos)
    words = np.asarray(cache.cells.seq)
    rows = []
    compile_s = None
    for t in lengths:
        tok_pos = rng.integers(0, size, t).tolist()
        tok_seq = rng.integers(0, 4, t).tolist()
        ub = kvjax.make_ubatch(tok_pos, [[s] for s in tok_seq], length=t)
        for n in windows:
            if compile_s is None:
                from kvjax.attn._mask import _mask_additive

                compile_s = compile_time(
                    _mask_additive,
                    cache.cells,
                    ub,
                    n_kv=n,
                    causal=True,
                    alibi=False,
                    swa_type=kvjax.SwaType.NONE,
                    n_swa=0,
                )
            got = kvjax.kq_mask(cache, ub, n)
            ref = numpy_mask(cell_pos, words, tok_pos, tok_seq, n)
            assert np.array_equal(np.asarray(got), ref), "kq_mask disagrees with the numpy loop"
            t_kv = median_time(lambda: kvjax.kq_mask(cache, ub, n), repeats=7, number=20 if t == 1 else 1)
            t_np = median_time(lambda: numpy_mask(cell_pos, words, tok_pos, tok_seq, n), repeats=3)
            n_bytes = t * n * 4
            bw = copy_bandwidth(n_bytes)
            at_copy = n_bytes / bw
            rows.append(
                [
                    t,
                    n,
                    f"{n_bytes / 1e6:.2f} MB",
                    fmt_time(t_kv),
                    fmt_time(at_copy),
                    _pct(at_copy / t_kv),
                    fmt_time(t_np),
                    f"{t_np / t_kv:.1f}x",
                ]
            )
    seqs = [{s for s in range(4) if (int(w) >> s) & 1} for w in words[:, 0]]
    t_py = median_time(lambda: python_mask(cell_pos.tolist(), seqs, [5], [0], windows[0]), repeats=3, warmup=0)
    ub1 = kvjax.make_ubatch([5], [[0]], length=1)
    t_kv1 = median_time(lambda: kvjax.kq_mask(cache, ub1, windows[0]), repeats=7, number=20)
    return "\n".join(
        [
            "### KQ mask construction",
            "",
            f"Cache of {size} cells (90% used, 4 sequences), causal mask, public eager `kvjax.kq_mask` "
            "(host checks + one jitted call; at T = 1 that fixed cost dominates).",
            "",
            table(
                [
                    "T",
                    "n_kv",
                    "mask bytes",
                    "kvjax",
                    "bytes at copy speed",
                    "of copy speed",
                    "numpy loop (seed)",
                    "kvjax speedup",
                ],
                rows,
            ),
            "",
            f"Pure-Python double loop of the seed (T = 1, n_kv = {windows[0]}): {fmt_time(t_py)}, "
            f"kvjax {fmt_time(t_kv1)} ({t_py / t_kv1:.0f}x). Compiling one mask program: {fmt_time(compile_s)}.",
        ]
    )


# -- K-shift and update -------------------------------------------------------------------------


def _shift_cache(size: int, n_layer: int, rng):
    cfg = kvjax.CacheConfig(
        size=size, n_seq_max=1, n_layer=n_layer, n_kv_heads=8, head_dim=64, padding=256, rope=kvjax.RopeConfig(n_rot=64)
    )
    cache = kvjax.init(cfg)
    k = jax.random.normal(jax.random.PRNGKey(0), cache.k[0].shape, jnp.float32)
    cells = cache.cells.replace(
        pos=jnp.arange(size, dtype=jnp.int32),
        seq=jnp.ones((size, 1), jnp.uint32),
        delta=jnp.asarray(rng.integers(-8, 8, size), jnp.int32),
    )
    return cache.replace(k=(k,), cells=cells)


def _fused_broadcast_shift(k, delta, rope_cfg):
    """The replaced formulation: one elementwise op over [L, H, C, D], tables broadcast over (L, H)."""
    from kvjax.attn._rope import _cos_sin, _rotate, pair_frequencies

    cos, sin = _cos_sin(delta, pair_frequencies(rope_cfg), 1.0)
    return _rotate(k, cos, sin, rope_cfg.n_rot, rope_cfg.mode)


def _bench_kshift(quick: bool, rng) -> str:
    size = 1024 if quick else 8192
    n_layer = 4 if quick else 16
    cache = _shift_cache(size, n_layer, rng)
    cells = cache.cells
    k_bytes = kvjax.size_k_bytes(cache)
    shift_k = jax.jit(lambda k, cells: kvjax.k_shift(cache.replace(k=(k,), cells=cells)).k[0], donate_argnums=0)
    fused = jax.jit(lambda k, delta: _fused_broadcast_shift(k, delta, cache.config.rope[0]), donate_argnums=0)
    state = {"a": cache.k[0] + 0, "b": cache.k[0] + 0}

    def run_shift():
        state["a"] = shift_k(state["a"], cells)
        return state["a"]

    def run_fused():
        state["b"] = fused(state["b"], cells.delta)
        return state["b"]

    compile_s = compile_time(shift_k, state["a"], cells)
    t_shift = median_time(run_shift, repeats=7)
    t_fused = median_time(run_fused, repeats=3)
    t_eager = median_time(lambda: kvjax.k_shift(cache), repeats=3)
    inplace = inplace_copy_bandwidth(k_bytes)
    fresh = copy_bandwidth(k_bytes)
    rows = [
        [
            "`k_shift`, jitted, K donated (loop over layer x head slices)",
            fmt_time(t_shift),
            fmt_rate(k_bytes / t_shift),
            _pct(k_bytes / t_shift / inplace),
            _pct(k_bytes / t_shift / fresh),
        ],
        [
            "one fused op over [L, H, C, D], tables broadcast (replaced)",
            fmt_time(t_fused),
            fmt_rate(k_bytes / t_fused),
            _pct(k_bytes / t_fused / inplace),
            _pct(k_bytes / t_fused / fresh),
        ],
        [
            "`kvjax.k_shift(cache)` eager (fresh K buffer)",
            fmt_time(t_eager),
            fmt_rate(k_bytes / t_eager),
            _pct(k_bytes / t_eager / inplace),
            _pct(k_bytes / t_eager / fresh),
        ],
        ["copy in place (yardstick)", fmt_time(k_bytes / inplace), fmt_rate(inplace), "100%", _pct(inplace / fresh)],
        [
            "copy into a fresh buffer (`copy_bandwidth`)",
            fmt_time(k_bytes / fresh),
            fmt_rate(fresh),
            _pct(fresh / inplace),
            "100%",
        ],
    ]
    # update with nothing pending: eager (host reads two flags) and jitted with the cache donated
    clean = cache.replace(cells=cells.replace(delta=jnp.zeros_like(cells.delta)))
    t_upd_eager = median_time(lambda: kvjax.update(clean), repeats=7, number=20)
    upd = jax.jit(kvjax.update, donate_argnums=0)
    st = {"c": jax.tree.map(jnp.copy, clean)}

    def run_upd():
        st["c"] = upd(st["c"])
        return st["c"].cells.pos

    t_upd_jit = median_time(run_upd, repeats=7, number=20)
    floor = dispatch_floor()
    return "\n".join(
        [
            "### K-shift",
            "",
            f"{n_layer} layers x 8 kv heads x {size} cells x head size 64, float32: K = {k_bytes / 1e6:.0f} MB, "
            f"every cell with a delta in [-8, 8). Compiling `k_shift`: {fmt_time(compile_s)}.",
            "",
            table(["formulation", "time", "K bytes/s", "of copy in place", "of fresh copy"], rows),
            "",
            f"`update` with nothing pending: eager {fmt_time(t_upd_eager)} (reads the two flags, runs nothing), "
            f"jitted with the cache donated {fmt_time(t_upd_jit)} (the `lax.cond` branch not taken); "
            f"dispatch floor {fmt_time(floor)}.",
        ]
    )


# -- attention formulations ---------------------------------------------------------------------


def _formulations(n_heads: int, group: int, d: int, n_kv: int):
    """The formulations tried for decode attention (q [T, Hq, D], mask [T, N]).

    Each takes the stacked storage ``k_all, v_all [1, H, C, D]`` and slices its window itself, as
    a user of ``kvjax.view`` would inside a jitted step.
    """
    scale = 1.0 / math.sqrt(d)

    def windowed(fn):
        return lambda q, k_all, v_all, mask: fn(q, k_all[0, :, :n_kv], v_all[0, :, :n_kv], mask)

    def repeat_kv(q, k, v, mask):  # the most obvious: one K/V copy per query head, plain einsums
        kk, vv = jnp.repeat(k, group, axis=0), jnp.repeat(v, group, axis=0)
        s = jnp.einsum("tjd,jnd->jtn", q, kk) * scale + mask
        return jnp.einsum("jtn,jnd->tjd", jax.nn.softmax(s, axis=-1), vv)

    def grouped_einsum(q, k, v, mask):  # query heads grouped per kv head, still one einsum each
        t = q.shape[0]
        s = jnp.einsum("thgd,hnd->hgtn", q.reshape(t, n_heads, group, d), k) * scale + mask
        return jnp.einsum("hgtn,hnd->thgd", jax.nn.softmax(s, axis=-1), v).reshape(t, n_heads * group, d)

    def grouped_rows(q, k, v, mask):  # [G*T, D] rows per kv head, batched dots, whole window at once
        t = q.shape[0]
        qr = q.reshape(t, n_heads, group, d).transpose(1, 2, 0, 3).reshape(n_heads, group * t, d) * scale
        dims = (((2,), (2,)), ((0,), (0,)))
        s = jax.lax.dot_general(qr, k, dims).reshape(n_heads, group, t, -1) + mask
        p = jax.nn.softmax(s, axis=-1).reshape(n_heads, group * t, -1)
        o = jax.lax.dot_general(p, v, (((2,), (1,)), ((0,), (0,))))
        return o.reshape(n_heads, group, t, d).transpose(2, 0, 1, 3).reshape(t, n_heads * group, d)

    return {
        "repeat K/V per query head, einsum": windowed(repeat_kv),
        "grouped heads, einsum": windowed(grouped_einsum),
        "grouped rows, batched dots, one pass over the window": windowed(grouped_rows),
    }


def _attention_cache(size: int, n_layer: int, used: int, rng):
    cfg = kvjax.CacheConfig(size=size, n_seq_max=1, n_layer=n_layer, n_kv_heads=8, head_dim=64, padding=256)
    cache = kvjax.init(cfg)
    shape = cache.k[0].shape
    k = jax.random.normal(jax.random.PRNGKey(1), shape, jnp.float32)
    v = jax.random.normal(jax.random.PRNGKey(2), shape, jnp.float32)
    idx = np.arange(size)
    cells = cache.cells.replace(
        pos=jnp.asarray(np.where(idx < used, idx, -1), jnp.int32),
        seq=jnp.asarray((idx < used).astype(np.uint32)[:, None]),
    )
    return cache.replace(k=(k,), v=(v,), cells=cells)


def _bench_attention(quick: bool, rng) -> str:
    size = 4096 if quick else 32768
    windows = (1024, 4096) if quick else (4096, 32768)
    cache = _attention_cache(size, 1, size, rng)
    hq, h, d = 32, 8, 64
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    rows, frows = [], []
    for n in windows:
        kv_bytes = 2 * h * n * d * 4
        read = read_bandwidth(kv_bytes)
        fresh = copy_bandwidth(kv_bytes)
        for t in (1, 8):
            q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
            ub = kvjax.make_ubatch([size - 1] * t, [[0]] * t, length=t)
            mask = kvjax.kq_mask(cache, ub, n)
            t_kv = median_time(lambda: kvjax.attention(q, cache, 0, mask), repeats=7)

            def timed(**kw):
                t0 = time.perf_counter()
                kvjax.attention(q, cache, 0, mask, **kw).block_until_ready()
                return time.perf_counter() - t0

            # learned sinks (gpt-oss): one more elementwise pass over the [T, Hq, D] result; the two
            # interleaved, so that a slow spell of the machine falls on both
            pair = interleaved_medians({"plain": timed, "sinks": lambda: timed(sinks=sinks)}, repeats=9)
            t_sinks = pair["sinks"] / pair["plain"] * t_kv
            rows.append(
                [
                    t,
                    n,
                    f"{kv_bytes / 1e6:.0f} MB",
                    fmt_time(t_kv),
                    fmt_rate(kv_bytes / t_kv),
                    _pct(kv_bytes / t_kv / read),
                    _pct(kv_bytes / t_kv / fresh),
                    f"{t_sinks / t_kv:.2f}x",
                ]
            )
            if n == windows[-1]:
                k, v = cache.k[0], cache.v[0]
                ref = kvjax.attention(q, cache, 0, mask)
                for name, fn in _formulations(h, hq // h, d, n).items():
                    jf = jax.jit(fn)
                    err = float(jnp.max(jnp.abs(jf(q, k, v, mask) - ref)))
                    assert err < 1e-4, f"{name} disagrees with kvjax.attention ({err})"
                    tf = median_time(lambda: jf(q, k, v, mask), repeats=3)
                    frows.append([t, name, fmt_time(tf), fmt_rate(kv_bytes / tf), _pct(kv_bytes / tf / read)])
                chunk = chunk_size(n, h, (hq // h) * t, cache.config.padding)
                how = "one pass" if chunk == n else f"online softmax over chunks of {chunk} cells read from storage"
                frows.append(
                    [
                        t,
                        f"**kvjax: grouped rows, batched dots, {how}**",
                        fmt_time(t_kv),
                        fmt_rate(kv_bytes / t_kv),
                        _pct(kv_bytes / t_kv / read),
                    ]
                )
    # chunked (kvjax) against one pass over the sliced window, in a 4-layer group (the window of
    # one layer is a slice of the stacked storage)
    import importlib

    module = importlib.import_module("kvjax.attn._attention")
    stacked = _attention_cache(size, 4, size, rng)
    crows = []
    for n in windows:
        if n <= module.MAX_CHUNK:
            continue  # one chunk is the whole window: the same program
        for t in (1, 8):
            q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.float32)
            ub = kvjax.make_ubatch([size - 1] * t, [[0]] * t, length=t)
            mask = kvjax.kq_mask(stacked, ub, n)
            times = []
            for max_chunk in (module.MAX_CHUNK, n):
                saved = (module.MAX_CHUNK, module.SCORE_BLOCK_BYTES)
                module.MAX_CHUNK, module.SCORE_BLOCK_BYTES = max_chunk, max(saved[1], 4 * h * hq // h * t * n)
                try:
                    times.append(median_time(lambda: kvjax.attention(q, stacked, 3, mask), repeats=3))
                finally:
                    module.MAX_CHUNK, module.SCORE_BLOCK_BYTES = saved
            crows.append([t, n, fmt_time(times[0]), fmt_time(times[1]), f"{times[1] / times[0]:.1f}x"])
    return "\n".join(
        [
            "### Decode attention",
            "",
            "32 query heads over 8 kv heads, head size 64, float32, every cell visible; public eager "
            "`kvjax.attention`; \"read\" = a jitted sum over the same K+V bytes, measured in this run.",
            "",
            table(
                ["T", "n_kv", "K+V bytes", "kvjax", "K+V bytes/s", "of read", "of fresh copy", "with sinks / without"],
                rows,
            ),
            "",
            f"Formulations tried (n_kv = {windows[-1]}, same inputs):",
            "",
            table(["T", "formulation", "time", "K+V bytes/s", "of read"], frows),
            "",
            f"Chunks read straight from the stacked storage against one pass over the sliced window, layer 3 "
            f"of a 4-layer group of {size} cells:",
            "",
            table(["T", "n_kv", f"chunks of {module.MAX_CHUNK} (kvjax)", "one pass", "one pass / chunks"], crows),
        ]
    )


# -- step cost vs occupancy ---------------------------------------------------------------------


def _bench_step(quick: bool, rng) -> str:
    size = 4096 if quick else 32768
    n_layer = 4
    hq, h, d = 32, 8, 64

    def make_step(window):
        def step(cache, q, kv, ub):
            cache, slot, ok = kvjax.find_slot(cache, ub)
            mask = kvjax.kq_mask(cache, ub, window)
            outs, x = [], kv
            for il in range(n_layer):
                cache = kvjax.write(cache, il, slot, x, x)
                out = kvjax.attention(q, cache, il, mask)
                outs.append(out)
                # the next layer's K/V depend on this layer's output, as in a model; without such a
                # dependency XLA copies the whole stacked K/V between a layer's read and the next write
                x = kv + 1e-3 * out[:, :h, :]
            return cache, jnp.stack(outs)

        return jax.jit(step, donate_argnums=0)

    rows = []
    q = jnp.asarray(rng.standard_normal((1, hq, d)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((1, h, d)), jnp.float32)
    results = {}
    for label, frac, full_window in (("10%", 0.1, False), ("10%, window = size", 0.1, True), ("100%", 1.0, False)):
        used = int(size * frac) - 1
        cache = _attention_cache(size, n_layer, used, rng)
        # the new token goes after the used cells (the step frees it again below, so every repeat sees
        # the same occupancy)
        ub = kvjax.make_ubatch([used], [[0]], length=1)
        placed, _, _ = kvjax.find_slot(cache, ub)
        window = size if full_window else kvjax.kv_window(placed)
        step = make_step(window)
        state = {"c": cache}

        def run():
            c, out = step(state["c"], q, kv, ub)
            state["c"], _ = kvjax.seq_rm(c, 0, used, -1)  # back to the same occupancy
            return out

        t = median_time(run, repeats=7)
        kv_bytes = 2 * n_layer * h * window * d * 4
        results[label] = t
        rows.append([label, used + 1, window, fmt_time(t), f"{kv_bytes / 1e6:.0f} MB", fmt_rate(kv_bytes / t)])
    return "\n".join(
        [
            "### Step cost follows the used cells",
            "",
            f"One decode step on a {size}-cell cache, 4 layers x 8 kv heads x head size 64 (float32): find_slot, "
            "mask, and per layer write + attention, jitted with the cache donated; the window comes from "
            "`kvjax.kv_window` (a bucket of the seed's n_kv), or is the whole cache for comparison.",
            "",
            table(["occupancy", "used cells", "window", "step", "K+V read", "K+V bytes/s"], rows),
            "",
            f"At 10% occupancy the bucketed window makes the step {results['10%, window = size'] / results['10%']:.1f}x "
            f"cheaper than attending over the whole cache; at 100% it costs "
            f"{results['100%'] / results['10%']:.1f}x the 10% step.",
        ]
    )


def _side_by_side_cache(n_seq: int, per_seq: int, hq: int, h: int, d: int, rng):
    """A unified cache where ``n_seq`` sequences decoded ``per_seq`` tokens side by side, and their next ubatch."""
    n_layer = 4
    size = 1 << (n_seq * (per_seq + 1) - 1).bit_length()
    cache = kvjax.init(
        kvjax.CacheConfig(size=size, n_seq_max=n_seq, n_layer=n_layer, n_kv_heads=h, head_dim=d, padding=32)
    )
    for p in range(per_seq + 1):  # one token per sequence per step: each sequence's cells interleave
        ub = kvjax.make_ubatch([p] * n_seq, [[s] for s in range(n_seq)])
        cache, _, ok = kvjax.find_slot(cache, ub)
        assert bool(ok)
    for il in range(n_layer):
        kv = jnp.asarray(rng.standard_normal((size, h, d)), jnp.float32)
        cache = kvjax.write(cache, il, jnp.arange(size), kv, kv)
    q = jnp.asarray(rng.standard_normal((n_seq, hq, d)), jnp.float32)
    return cache, ub, q


def _bench_side_by_side(quick: bool, rng) -> str:
    """Decode attention of B sequences side by side in one cache: owned chunks against the dense loop."""
    from kvjax.attn import _attention as attn

    hq, h, d = 32, 8, 64
    plan = ((16, 64), (32, 64)) if quick else ((8, 144), (16, 144), (32, 80), (32, 144), (64, 80))
    rows = []
    for n_seq, per_seq in plan:
        cache, ub, q = _side_by_side_cache(n_seq, per_seq, hq, h, d, rng)
        window = kvjax.kv_window(cache)
        mask = kvjax.kq_mask(cache, ub, window)
        compiled = {}
        threshold = attn.OWNED_MIN_TOKENS
        try:
            for name, min_tokens in (("owned", 1), ("dense", n_seq + 1)):
                attn.OWNED_MIN_TOKENS = min_tokens
                jax.clear_caches()
                fn = jax.jit(lambda q, cache, mask: [kvjax.attention(q, cache, il, mask) for il in range(4)])
                compiled[name] = fn.lower(q, cache, mask).compile()
        finally:
            attn.OWNED_MIN_TOKENS = threshold
            jax.clear_caches()
        owned, dense = (jnp.stack(compiled[n](q, cache, mask)) for n in ("owned", "dense"))
        err = float(jnp.max(jnp.abs(owned - dense)))
        assert err < 1e-4, err
        t = interleaved_medians(
            {n: (lambda f=f: median_time(lambda: f(q, cache, mask), repeats=1, warmup=0)) for n, f in compiled.items()},
            repeats=3 if quick else 9,
        )
        used = n_seq * (per_seq + 1)
        picked = "owned" if n_seq >= threshold else "dense"
        rows.append(
            [n_seq, used, window, fmt_time(t["dense"]), fmt_time(t["owned"]), f"{t['dense'] / t['owned']:.2f}x", picked]
        )
    return "\n".join(
        [
            "### Sequences decoding side by side in one cache",
            "",
            "B sequences, each with one token in the ubatch, whose cells interleave in one unified cache "
            "(one token per sequence per step, as `kvjax.generate` places them): each row sees 1/B of the "
            "window. 4 layers of `kvjax.attention` (32 query heads over 8 kv heads, head size 64, float32) "
            "in one jitted program; 'dense' runs every chunk as contractions of all rows with all cells, "
            "'owned' runs a chunk whose every column one row sees as a product of each cell with its own "
            "row only (`_owned_step`); interleaved, medians; the two agree to float rounding (checked). "
            f"`OWNED_MIN_TOKENS` = {threshold}: the path picked by default.",
            "",
            table(["B", "used cells", "window", "dense", "owned", "dense / owned", "picked"], rows),
        ]
    )


def run(quick: bool) -> str:
    """The Markdown section (see the module docstring for what is measured)."""
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    parts = [
        "## Attention path: masks, K-shift, attention",
        "",
        "Yardsticks from the same run: \"fresh copy\" = `copy_bandwidth` (jitted copy into a new buffer, "
        "allocator page faults included), \"copy in place\" = `inplace_copy_bandwidth` (donated), \"read\" = jitted sum.",
        "",
        _bench_masks(quick, rng),
        "",
        _bench_kshift(quick, rng),
        "",
        _bench_attention(quick, rng),
        "",
        _bench_step(quick, rng),
        "",
        _bench_side_by_side(quick, rng),
    ]
    parts.append(f"\n_(sizes: {'quick' if quick else 'full'}; {time.perf_counter() - t0:.0f} s)_")
    return "\n".join(parts)


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
