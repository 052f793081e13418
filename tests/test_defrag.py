"""Defragmentation and compaction against the pure-Python model of the seed, attention invariance,
compile counts, donation, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.memory._defrag import CHUNK, apply_pending
from kvjax._errors import ErrorFlag
from tests.helpers import CompileCounter, fill, no_recompile, small_config
from kvjax.testing import _defrag_reference as ref

# Two layer groups with different shapes (every group's K and V must move), and a config with two
# bitmask words (sequence ids >= 32).
CFG_GROUPS = small_config(n_kv_heads=(2, 4), head_dim=(8, 4))
CFG_WIDE = small_config(size=128, n_seq_max=40, n_layer=1, padding=32)
# More cells than one chunk of the K/V mover (kvjax.memory._defrag.CHUNK): several loop steps, a partial last chunk.
CFG_LONG = small_config(size=1024, n_kv_heads=1, head_dim=4, padding=64)
CONFIGS = pytest.mark.parametrize("cfg", [CFG_GROUPS, CFG_LONG], ids=["groups", "long"])
ALL_CONFIGS = pytest.mark.parametrize("cfg", [CFG_GROUPS, CFG_WIDE, CFG_LONG], ids=["groups", "wide", "long"])

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- building caches from plain cell lists ------------------------------------------------------


def cells_of(cache):
    """The cache's cells as the reference's list of (pos, set of seq ids)."""
    t = kvjax.cell_table(cache)
    return [(int(p), set(np.flatnonzero(row).tolist())) for p, row in zip(t.pos, t.seqs)]


def make_cache(cfg, cells, head, seed):
    """A cache holding ``cells`` (with random pending deltas) and random K/V in every cell."""
    rng = np.random.default_rng(seed)
    words = np.zeros((cfg.size, cfg.n_words), np.uint32)
    for i, (_, seqs) in enumerate(cells):
        for s in seqs:
            words[i, s // 32] |= np.uint32(1 << (s % 32))
    pos = np.array([p for p, _ in cells], np.int32)
    delta = np.where(pos >= 0, rng.integers(-3, 4, cfg.size), 0).astype(np.int32)
    cache = kvjax.init(cfg)
    c = cache.cells.replace(
        pos=jnp.asarray(pos), seq=jnp.asarray(words), delta=jnp.asarray(delta), head=jnp.int32(head)
    )
    k = tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.k)
    v = tuple(jnp.asarray(rng.standard_normal(b.shape), b.dtype) for b in cache.v)
    return cache.replace(cells=c, k=k, v=v)


@st.composite
def fragmented(draw, cfg):
    """Cells as alternating runs of used and empty cells: long holes, contiguous tails, scattered
    singles, from nearly empty to nearly full (run lengths geometric with a drawn mean)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    density = draw(st.sampled_from([0.1, 0.3, 0.5, 0.7, 0.9]))
    mean_run = draw(st.sampled_from([1.0, 2.0, 4.0, 12.0]))
    extent = draw(st.sampled_from([0.5, 1.0]))  # part of the cache ever written
    occupied, state = [], bool(rng.random() < density)
    while len(occupied) < cfg.size * extent:
        mean = mean_run * (density if state else 1 - density) * 2
        occupied += [state] * int(rng.geometric(1 / max(mean, 1.0)))
        state = not state
    occupied = (occupied + [False] * cfg.size)[: cfg.size]
    cells = []
    for u in occupied:
        if u:
            n = int(rng.integers(1, 4))
            seqs = set(rng.choice(cfg.n_seq_max, n, replace=False).tolist())
            cells.append((int(rng.integers(0, 500)), seqs))
        else:
            cells.append((-1, set()))
    return cells, int(rng.integers(0, cfg.size))


def expected_buffers(cache, dest):
    """K/V after the moves ``dest`` (old -> new): moved rows copied, every other row untouched."""
    out = []
    for b in cache.k + cache.v:
        b = np.asarray(b)
        new = b.copy()
        for s, d in dest.items():
            new[:, :, d] = b[:, :, s]
        out.append(new)
    return out


def check_result(before, after, expected: ref.Moved):
    """Cells, head, deltas and every K/V row of ``after`` equal the reference's moves of ``before``."""
    assert cells_of(after) == expected.cells
    assert int(after.cells.head) == expected.head
    assert not bool(after.cells.defrag)
    old_delta, new_delta = np.asarray(before.cells.delta), np.asarray(after.cells.delta)
    for old, (_, seqs) in enumerate(cells_of(before)):
        if seqs:
            assert new_delta[expected.dest.get(old, old)] == old_delta[old]
    assert not new_delta[np.asarray(after.cells.pos) < 0].any()
    for got, want in zip(after.k + after.v, expected_buffers(before, expected.dest)):
        np.testing.assert_array_equal(np.asarray(got), want)


def check_plan(plan, expected: ref.Moved):
    src = np.asarray(plan.src)
    assert sorted(src.tolist()) == list(range(src.shape[0]))  # a permutation
    assert set(np.flatnonzero(np.asarray(plan.moved)).tolist()) == set(expected.dest.values())
    for s, d in expected.dest.items():
        assert src[d] == s
    assert int(plan.n_moves) == expected.n_moves
    assert int(plan.n_cells) == len(expected.dest)
    assert int(plan.head) == expected.head


_defrag_jit = jax.jit(kvjax.defrag)
_compact_jit = jax.jit(kvjax.compact)
_compact_seq_jit = jax.jit(kvjax.compact_seq)


# -- the seed's plan ----------------------------------------------------------------------------


@CONFIGS
@SETTINGS
@given(data=st.data())
def test_defrag_equals_the_seed_model(cfg, data):
    cells, head = data.draw(fragmented(cfg))
    max_moves = data.draw(st.one_of(st.none(), st.integers(0, 12), st.integers(0, cfg.size // 4)))
    cache = make_cache(cfg, cells, head, seed=len(cells) + head)
    expected = ref.defrag_prepare(cells, head, max_moves)
    check_plan(kvjax.defrag_plan(cache, max_moves), expected)
    check_result(cache, kvjax.defrag(cache, max_moves), expected)
    # jitted with a traced cap (None, under jit, is covered by the attention test)
    cap = jnp.int32(np.iinfo(np.int32).max if max_moves is None else max_moves)
    check_result(cache, _defrag_jit(cache, cap), expected)


def test_a_cap_stops_in_the_middle_of_a_hole():
    # One hole of 4 cells (2..5) below n_used = 8; its sources (cells 9, 11, 12, 14) form 3 runs.
    occ = "11....11.1.11.1"
    cells = [(i, {0}) if c == "1" else (-1, set()) for i, c in enumerate(occ)]
    cells += [(-1, set())] * (64 - len(cells))
    full = ref.defrag_prepare(cells, 0)
    capped = ref.defrag_prepare(cells, 0, max_moves=2)
    assert (full.n_moves, capped.n_moves) == (3, 2)
    assert len(capped.dest) == 3 and capped.cells[5] == (-1, set())  # the hole is filled 3 of 4
    cache = make_cache(CFG_GROUPS, cells, 0, 1)
    check_result(cache, kvjax.defrag(cache, 2), capped)
    check_result(cache, kvjax.defrag(cache), full)


def test_many_chunks_of_moved_rows():
    # 300 holes before 700 used cells: 300 rows move, over two chunks of the mover (one partial).
    cells = [(-1, set())] * 300 + [(i, {i % 4}) for i in range(700)] + [(-1, set())] * 24
    cache = make_cache(CFG_LONG, cells, 0, 2)
    expected = ref.defrag_prepare(cells, 0)
    assert len(expected.dest) == 300 > CHUNK
    check_result(cache, kvjax.defrag(cache), expected)
    check_result(cache, kvjax.compact(cache), ref.compact(cells, 0))
    check_result(cache, kvjax.compact_seq(cache, 1), ref.compact_seq(cells, 0, 1))


def test_nothing_to_move_keeps_head_and_buffers():
    cache, _ = kvjax.seq_rm(fill(kvjax.init(CFG_GROUPS), range(10), [[0]] * 10), 0, 8, -1)
    cache = cache.replace(cells=cache.cells.replace(head=jnp.int32(30)))
    out = kvjax.defrag(cache)
    assert int(out.cells.head) == int(cache.cells.head) and int(kvjax.defrag_plan(cache).n_cells) == 0
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(out)):
        np.testing.assert_array_equal(a, b)


# -- compactions --------------------------------------------------------------------------------


@CONFIGS
@SETTINGS
@given(data=st.data())
def test_compact_equals_the_model(cfg, data):
    cells, head = data.draw(fragmented(cfg))
    cache = make_cache(cfg, cells, head, seed=head)
    expected = ref.compact(cells, head)
    for out in (kvjax.compact(cache), _compact_jit(cache)):
        check_result(cache, out, expected)
        assert int(kvjax.cell_max(out)) == ref.used(cells)  # the window is as small as it can be


@ALL_CONFIGS
@SETTINGS
@given(data=st.data())
def test_compact_seq_equals_the_model(cfg, data):
    cells, head = data.draw(fragmented(cfg))
    seq_id = data.draw(st.integers(0, cfg.n_seq_max - 1))
    cache = make_cache(cfg, cells, head, seed=seq_id)
    expected = ref.compact_seq(cells, head, seq_id)
    for out in (kvjax.compact_seq(cache, seq_id), _compact_seq_jit(cache, jnp.int32(seq_id))):
        check_result(cache, out, expected)
        members = [seq_id in s for _, s in cells_of(out)]
        n = sum(members)
        assert all(members[:n]) and not any(members[n:])  # the sequence is the prefix [0, n)


# -- attention is unchanged ---------------------------------------------------------------------


def naive_attention(cache, seq_id, queries):
    """Per layer, softmax(q . k / sqrt(D)) @ v over the cells of ``seq_id`` in position order.

    Sorting by position makes the summation order independent of where the cells sit, so a
    correct defrag gives bit-identical outputs."""
    t = kvjax.cell_table(cache)
    cells = np.flatnonzero(t.seqs[:, seq_id])
    cells = cells[np.argsort(t.pos[cells], kind="stable")]
    outs = [t.pos[cells]]
    if cells.size == 0:
        return outs
    for layer, q in zip(cache.config.cached_layers, queries):
        k, v = (np.asarray(x)[:, cells] for x in kvjax.view(cache, layer, cache.config.size))
        scores = np.einsum("hnd,hd->hn", k, q) / np.float32(np.sqrt(k.shape[-1]))
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w = w / w.sum(axis=-1, keepdims=True)
        outs.append(np.einsum("hn,hnd->hd", w, v))
    return outs


@st.composite
def scenario(draw):
    """Ops that leave several sequences, shared cells (seq_cp) and holes (seq_rm)."""
    ops = []
    for _ in range(draw(st.integers(3, 12))):
        kind = draw(st.sampled_from(["add", "add", "cp", "rm"]))
        if kind == "add":
            ops.append(("add", draw(st.integers(0, 3)), draw(st.integers(1, 12)), draw(st.booleans())))
        elif kind == "cp":
            ops.append(("cp", draw(st.integers(0, 3)), draw(st.integers(0, 3)), draw(st.integers(0, 20))))
        else:
            p0 = draw(st.integers(-1, 30))
            ops.append(("rm", draw(st.integers(-1, 3)), p0, draw(st.integers(-1, 30))))
    return ops, draw(st.one_of(st.none(), st.integers(1, 4))), draw(st.integers(0, 3))


def build(cfg, ops, seed):
    cache = kvjax.init(cfg)
    next_pos = [0] * cfg.n_seq_max
    for op in ops:
        if op[0] == "add":
            _, s, n, contiguous = op
            ub = kvjax.make_ubatch(range(next_pos[s], next_pos[s] + n), [[s]] * n)
            placed, _, ok = kvjax.find_slot(cache, ub, contiguous=contiguous)
            if bool(ok):
                cache, next_pos[s] = placed, next_pos[s] + n
        elif op[0] == "cp" and op[1] != op[2]:
            _, src, dst, p1 = op  # replace dst by a prefix of src: positions stay unique per sequence
            cache = kvjax.seq_cp(kvjax.seq_rm(cache, dst, -1, -1)[0], src, dst, 0, p1)
            next_pos[dst] = max(next_pos[src], 0)
        elif op[0] == "rm":
            cache, _ = kvjax.seq_rm(cache, op[1], op[2], op[3])
    rng = np.random.default_rng(seed)
    k = tuple(jnp.asarray(rng.standard_normal(b.shape), jnp.float32) for b in cache.k)
    v = tuple(jnp.asarray(rng.standard_normal(b.shape), jnp.float32) for b in cache.v)
    return cache.replace(k=k, v=v)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=scenario())
def test_every_sequence_attends_the_same_after_defrag_and_compaction(case):
    ops, max_moves, seq_id = case
    cfg = CFG_GROUPS
    cache = build(cfg, ops, seed=len(ops))
    rng = np.random.default_rng(7)
    queries = [rng.standard_normal((g.n_kv_heads, g.head_dim)).astype(np.float32) for g in cfg.groups for _ in g.layers]
    before = [naive_attention(cache, s, queries) for s in range(cfg.n_seq_max)]
    outs = [
        kvjax.defrag(cache, max_moves),
        _defrag_jit(cache),
        kvjax.compact(cache),
        _compact_seq_jit(cache, jnp.int32(seq_id)),
        kvjax.compact_seq(cache, seq_id),
    ]
    for out in outs:
        assert kvjax.errors(out) == []
        for s in range(cfg.n_seq_max):
            for a, b in zip(before[s], naive_attention(out, s, queries)):
                np.testing.assert_array_equal(a, b)
    assert int(kvjax.n_kv(outs[2])) <= int(kvjax.n_kv(cache))


# -- fragmentation, scheduling, pending defrag --------------------------------------------------


CFG_BIG = kvjax.CacheConfig(size=4096, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2, padding=256)


@settings(max_examples=20, deadline=None)
@given(used_mask=st.lists(st.booleans(), min_size=1, max_size=64), scale=st.sampled_from([1, 7, 64]))
def test_fragmentation_is_the_seeds_measure(used_mask, scale):
    occ = np.zeros(CFG_BIG.size, bool)
    spread = np.repeat(np.asarray(used_mask), scale)[: CFG_BIG.size]
    occ[: spread.size] = spread
    cells = [(i, {0}) if u else (-1, set()) for i, u in enumerate(occ)]
    cache = make_cache(CFG_BIG, cells, 0, 0)
    got = float(kvjax.fragmentation(cache))
    assert got == pytest.approx(ref.fragmentation(cells, CFG_BIG.padding), abs=1e-6)
    assert float(jax.jit(kvjax.fragmentation)(cache)) == got


def test_defrag_sched_sets_the_flag_above_the_threshold_only():
    cells = [(i, {0}) if not 1024 <= i < 3072 else (-1, set()) for i in range(4096)]
    cache = make_cache(CFG_BIG, cells, 0, 0)  # half the window empty
    frag = float(kvjax.fragmentation(cache))
    assert frag == pytest.approx(1 - (2048 + 256) / 4096)
    assert bool(kvjax.defrag_sched(cache, frag - 0.01).cells.defrag)
    assert not bool(kvjax.defrag_sched(cache, frag).cells.defrag)
    sched = jax.jit(kvjax.defrag_sched)
    assert bool(sched(cache, jnp.float32(0.1)).cells.defrag)
    assert not bool(sched(cache, jnp.float32(0.9)).cells.defrag)
    # a pending defrag stays pending; a small window is never fragmented
    pending = kvjax.defrag_sched(cache, 0.1)
    assert bool(kvjax.defrag_sched(pending, 0.99).cells.defrag)
    small, _ = kvjax.seq_rm(fill(kvjax.init(CFG_GROUPS), range(40), [[0]] * 40), 0, 0, 30)
    assert float(kvjax.fragmentation(small)) == 0.0 and not bool(kvjax.defrag_sched(small, 0.0).cells.defrag)
    assert bool(kvjax.defrag_sched(small, -1.0).cells.defrag)  # as in the seed: 0 > -1


@pytest.mark.parametrize("jit", [False, True])
def test_apply_pending_runs_defrag_only_when_flagged(jit):
    cells, head = [(i, {i % 3}) if i % 4 else (-1, set()) for i in range(40)] + [(-1, set())] * 24, 5
    cache = make_cache(CFG_GROUPS, cells, head, 3)
    run = jax.jit(apply_pending) if jit else apply_pending
    same = run(cache)
    for a, b in zip(jax.tree.leaves(cache), jax.tree.leaves(same)):
        np.testing.assert_array_equal(a, b)
    pending = cache.replace(cells=cache.cells.replace(defrag=jnp.bool_(True)))
    check_result(cache, run(pending), ref.defrag_prepare(cells, head))
    assert kvjax.memory._defrag.apply_pending is apply_pending


# -- one compilation, donation ------------------------------------------------------------------


def test_one_compilation_serves_every_cache_content():
    rng = np.random.default_rng(0)
    layouts = [[(int(p), {int(p) % 4}) if rng.random() < 0.5 else (-1, set()) for p in range(64)] for _ in range(3)]
    caches = [make_cache(CFG_GROUPS, cells, 3 * i, seed=i) for i, cells in enumerate(layouts)]
    pending = caches[0].replace(cells=caches[0].cells.replace(defrag=jnp.bool_(True)))

    def run_all(c, n, s):
        return [
            kvjax.defrag(c),
            kvjax.defrag(c, n),
            kvjax.defrag_plan(c, n),
            kvjax.compact(c),
            kvjax.compact_seq(c, s),
            kvjax.fragmentation(c),
            kvjax.defrag_sched(c, 0.5),
            apply_pending(c),
            apply_pending(pending),
            _defrag_jit(c, jnp.int32(n)),
            _compact_seq_jit(c, jnp.int32(s)),
        ]

    jax.block_until_ready(run_all(caches[0], 1, 0))
    with no_recompile():
        jax.block_until_ready(run_all(caches[1], 0, 3))
        jax.block_until_ready(run_all(caches[2], 5, 2))


def test_donated_defrag_moves_in_place_and_retires_the_old_buffers():
    cells, head = [(i, {0}) if i % 3 else (-1, set()) for i in range(48)] + [(-1, set())] * 16, 0
    cache = make_cache(CFG_GROUPS, cells, head, 5)
    expected = ref.defrag_prepare(cells, head)
    twin = make_cache(CFG_GROUPS, cells, head, 5)  # the same content (a host view would pin the buffers)
    donated = jax.jit(kvjax.defrag, donate_argnums=0)
    with CompileCounter() as counter:
        out = donated(cache)
    assert counter.count == 1
    check_result(twin, out, expected)
    # The K/V snapshot held in `cache` is gone: defrag rewrote those buffers.
    assert all(b.is_deleted() for b in cache.k + cache.v)


# -- bad input ----------------------------------------------------------------------------------


def test_bad_arguments_raise_clear_errors():
    cache = make_cache(CFG_GROUPS, [(-1, set())] * 64, 0, 0)
    with pytest.raises(ValueError, match=r"max_moves=-1 is out of range: allowed max_moves >= 0"):
        kvjax.defrag(cache, -1)
    with pytest.raises(ValueError, match="max_moves"):
        kvjax.defrag_plan(cache, 2.5)
    with pytest.raises(ValueError, match=r"seq_id=4 is out of range: allowed \[0, 4\)"):
        kvjax.compact_seq(cache, 4)
    with pytest.raises(ValueError, match=r"seq_id=-1 is out of range"):
        kvjax.compact_seq(cache, -1)
    with pytest.raises(ValueError, match="thold"):
        kvjax.defrag_sched(cache, float("nan"))
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.compact(cache.cells)


def test_traced_bad_arguments_move_nothing_and_flag():
    cells = [(i, {0}) if i % 2 else (-1, set()) for i in range(30)] + [(-1, set())] * 34
    cache = make_cache(CFG_GROUPS, cells, 0, 0)
    cache = cache.replace(cells=cache.cells.replace(defrag=jnp.bool_(True)))
    for out, flag in (
        (_defrag_jit(cache, jnp.int32(-3)), "max_moves"),
        (_compact_seq_jit(cache, jnp.int32(9)), "seq_id"),
    ):
        assert any(flag in m for m in kvjax.errors(out))
        assert bool(out.cells.defrag)  # still pending: nothing was done
        for name in ("pos", "seq", "delta", "head"):
            np.testing.assert_array_equal(getattr(out.cells, name), getattr(cache.cells, name))
        for a, b in zip(out.k + out.v, cache.k + cache.v):
            np.testing.assert_array_equal(a, b)
    assert int(_defrag_jit(cache, jnp.int32(-3)).cells.error) == int(ErrorFlag.MAX_MOVES)


@pytest.mark.parametrize("jit", [False, True])
def test_update_applies_a_pending_defrag_after_the_k_shift(jit):
    cfg = CFG_GROUPS.replace(rope=kvjax.RopeConfig(n_rot=4))
    cells = [(i, {i % 2}) if i % 3 else (-1, set()) for i in range(45)] + [(-1, set())] * 19
    cache = make_cache(cfg, cells, 0, 4)  # random deltas: a K-shift is pending
    assert bool(kvjax.has_shift(cache))
    update = jax.jit(kvjax.update) if jit else kvjax.update
    pending = cache.replace(cells=cache.cells.replace(defrag=jnp.bool_(True)))
    out = update(pending)
    want = kvjax.defrag(kvjax.k_shift(cache))
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert not bool(out.cells.defrag) and not bool(kvjax.has_shift(out))
    assert cells_of(out)[: ref.used(cells)] == ref.defrag_prepare(cells, 0).cells[: ref.used(cells)]
    # without the flag, update shifts but moves nothing
    assert cells_of(update(cache)) == cells_of(cache)


@pytest.mark.parametrize("op", ["defrag", "compact", "compact_seq", "apply_pending"])
def test_donate_true_reuses_the_buffers(op):
    cells = [(i, {i % 3}) if i % 4 else (-1, set()) for i in range(50)] + [(-1, set())] * 14
    run = {
        "defrag": lambda c, **kw: kvjax.defrag(c, 3, **kw),
        "compact": kvjax.compact,
        "compact_seq": lambda c, **kw: kvjax.compact_seq(c, 2, **kw),
        "apply_pending": apply_pending,
    }[op]
    pending = lambda c: c.replace(cells=c.cells.replace(defrag=jnp.bool_(True)))  # noqa: E731
    want = run(pending(make_cache(CFG_GROUPS, cells, 0, 6)))
    cache = pending(make_cache(CFG_GROUPS, cells, 0, 6))
    out = run(cache, donate=True)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
        np.testing.assert_array_equal(a, b)
    assert all(b.is_deleted() for b in cache.k + cache.v)
