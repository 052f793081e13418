"""kvjax.io._state: the seed's byte format, round trips, hand-built blobs and corrupt blobs."""

from __future__ import annotations

import functools
import struct
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax._errors import StateError
from tests.helpers import CompileCounter, fill, no_recompile

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Two layouts: one layer group and plain V; two layer groups (a filtered layer, other head
# counts and sizes) with V transposed.
PLAIN = dict(size=64, n_seq_max=5, n_layer=2, n_kv_heads=2, head_dim=4, padding=16)
MIXED = dict(
    size=64,
    n_seq_max=5,
    n_layer=3,
    n_kv_heads=(2, 3, 1),
    head_dim=(4, 4, 8),
    head_dim_v=(4, 4, 2),
    layer_filter=[0, 2],
    padding=16,
    v_trans=True,
)
CONFIGS = {"plain": kvjax.CacheConfig(**PLAIN), "mixed": kvjax.CacheConfig(**MIXED)}


# -- builders shared with the session and checkpoint tests ---------------------------------------


def with_random_kv(cache, seed):
    """The cache with random float32 K/V in every cell."""
    rng = np.random.default_rng(seed)
    k = tuple(jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32)) for x in cache.k)
    v = tuple(jnp.asarray(rng.standard_normal(x.shape, dtype=np.float32)) for x in cache.v)
    return cache.replace(k=k, v=v)


def apply_ops(cache, steps):
    """Apply (op, ...) steps with kvjax ops; placements that do not fit are skipped."""
    for step in steps:
        if step[0] == "add":
            _, seqs, n, start, contiguous = step
            ub = kvjax.make_ubatch(range(start, start + n), [seqs] * n, length=16)
            cache, _, _ = kvjax.find_slot(cache, ub, contiguous=contiguous)
        elif step[0] == "rm":
            cache, _ = kvjax.seq_rm(cache, *step[1:])
        else:
            cache = kvjax.seq_cp(cache, *step[1:])
    return cache


def op_steps(n_seq_max):
    seq = st.integers(0, n_seq_max - 1)
    add = st.tuples(
        st.just("add"),
        st.lists(seq, min_size=1, max_size=3, unique=True),
        st.integers(1, 12),
        st.integers(0, 40),
        st.booleans(),
    )
    rm = st.tuples(st.just("rm"), st.integers(-1, n_seq_max - 1), st.integers(-1, 30), st.integers(-1, 50))
    cp = st.tuples(st.just("cp"), seq, seq, st.integers(-1, 30), st.integers(-1, 50))
    return st.lists(st.one_of(add, add, rm, cp), max_size=8)


def random_cache(cfg, steps, seed):
    return with_random_kv(apply_ops(kvjax.init(cfg), steps), seed)


def records(cache):
    """(pos, sequence set, K bytes, V bytes) of every non-empty cell, in cell order."""
    cfg = cache.config
    table = kvjax.cell_table(cache)
    ks = [np.asarray(x) for x in cache.k]
    vs = [np.asarray(x) for x in cache.v]
    locs = [cfg.locate(il) for il in cfg.cached_layers]
    out = []
    for c in np.flatnonzero(table.seqs.any(axis=1)):
        kb = b"".join(ks[g][i, :, c].tobytes() for g, i in locs)
        vb = b"".join(vs[g][i, :, c].tobytes() for g, i in locs)
        out.append((int(table.pos[c]), frozenset(np.flatnonzero(table.seqs[c]).tolist()), kb, vb))
    return out


def snapshot(cache):
    return [np.array(x) for x in jax.tree.leaves(cache)]


def assert_unchanged(cache, snap):
    leaves = jax.tree.leaves(cache)
    assert not any(x.is_deleted() for x in leaves)
    for a, b in zip(leaves, snap):
        np.testing.assert_array_equal(np.asarray(a), b)


def assert_valid(cache):
    """Cell invariants: empty iff no sequence, and then pos -1 and delta 0; ids < n_seq_max."""
    table = kvjax.cell_table(cache)
    used = table.seqs.any(axis=1)
    assert (table.pos[~used] == -1).all() and (table.delta[~used] == 0).all()
    assert (table.pos[used] >= 0).all()
    words = np.asarray(cache.cells.seq)
    spare = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, cache.config.n_seq_max :]
    assert not spare.any()


def largest_free_run(cache):
    free = ~kvjax.cell_table(cache).seqs.any(axis=1)
    best = run = 0
    for f in free:
        run = run + 1 if f else 0
        best = max(best, run)
    return best


# -- round trips ----------------------------------------------------------------------------------


@SETTINGS
@given(name=st.sampled_from(sorted(CONFIGS)), steps=op_steps(5), dest_steps=op_steps(5), seed=st.integers(0, 2**16))
def test_whole_round_trip(name, steps, dest_steps, seed):
    cfg = CONFIGS[name]
    cache = random_cache(cfg, steps, seed)
    blob = kvjax.state_write(cache)
    dest = random_cache(cfg, dest_steps, seed + 1)  # a whole read replaces whatever was there
    restored = kvjax.state_read(dest, blob)
    src = records(cache)
    assert records(restored) == src  # same cells, same order, bit-exact K/V
    table = kvjax.cell_table(restored)
    assert np.flatnonzero(table.seqs.any(axis=1)).tolist() == list(range(len(src)))  # from cell 0
    assert table.head == 0 and not table.delta.any()
    assert_valid(restored)
    assert kvjax.state_write(restored) == blob


@SETTINGS
@given(
    name=st.sampled_from(sorted(CONFIGS)),
    steps=op_steps(5),
    dest_steps=op_steps(5),
    src=st.integers(0, 4),
    dst=st.integers(0, 4),
    where=st.sampled_from(["fresh", "same", "other"]),
    contiguous=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_sequence_round_trip(name, steps, dest_steps, src, dst, where, contiguous, seed):
    cfg = CONFIGS[name]
    cache = random_cache(cfg, steps, seed)
    blob = kvjax.state_write(cache, src)
    dest = {"fresh": kvjax.init(cfg), "same": cache, "other": random_cache(cfg, dest_steps, seed + 1)}[where]
    base, _ = kvjax.seq_rm(dest, dst, -1, -1)
    moved = [(p, k, v) for p, seqs, k, v in records(cache) if src in seqs]
    try:
        restored = kvjax.state_read(dest, blob, dst, contiguous=contiguous)
    except StateError:
        free = int(cfg.size - kvjax.used_cells(base))
        assert (largest_free_run(base) if contiguous else free) < len(moved)
        return
    expected = Counter(records(base)) + Counter((p, frozenset({dst}), k, v) for p, k, v in moved)
    assert Counter(records(restored)) == expected
    assert_valid(restored)
    if contiguous:  # one window, in blob order: the seed's layout comes back byte for byte
        assert kvjax.state_write(restored, dst) == blob


def test_scattered_read_fits_where_contiguous_does_not():
    cfg = kvjax.CacheConfig(**PLAIN)
    src = with_random_kv(fill(kvjax.init(cfg), range(10), [[0]] * 10), 1)
    blob = kvjax.state_write(src, 0)
    dest = fill(kvjax.init(cfg), range(64), [[1] if i % 4 == 0 or i >= 48 else [2] for i in range(64)])
    dest, _ = kvjax.seq_rm(dest, 2)  # 36 free cells in holes of 3
    snap = snapshot(dest)
    with pytest.raises(StateError, match="contiguous=False"):
        kvjax.state_read(dest, blob, 3)
    assert_unchanged(dest, snap)
    restored = kvjax.state_read(dest, blob, 3, contiguous=False)
    got = sorted(r[0] for r in records(restored) if r[1] == frozenset({3}))
    assert got == list(range(10))


def test_sequence_read_replaces_the_destination_sequence():
    cfg = kvjax.CacheConfig(**PLAIN)
    cache = with_random_kv(fill(kvjax.init(cfg), range(6), [[0]] * 3 + [[0, 1]] * 3), 2)
    blob = kvjax.state_write(cache, 1)  # the 3 shared cells
    restored = kvjax.state_read(cache, blob, 0)
    table = kvjax.cell_table(restored)
    assert sorted(table.pos[table.seqs[:, 0]].tolist()) == [3, 4, 5]  # old cells of 0 are gone
    assert sorted(table.pos[table.seqs[:, 1]].tolist()) == [3, 4, 5]


def test_full_cache_and_exact_bucket():
    """Every cell used (the no-gather path) and a cell count equal to its bucket (no padding)."""
    for cfg in CONFIGS.values():
        cache = with_random_kv(fill(kvjax.init(cfg), range(64), [[i % 5] for i in range(64)]), 3)
        blob = kvjax.state_write(cache)
        assert records(kvjax.state_read(kvjax.init(cfg), blob)) == records(cache)
        seq_blob = kvjax.state_write(kvjax.seq_keep(cache, 0), -1)
        assert kvjax.state_write(kvjax.state_read(cache, seq_blob), -1) == seq_blob
        half = with_random_kv(fill(kvjax.init(cfg), range(32), [[0]] * 32), 4)
        one = kvjax.state_write(half, 0)
        back = kvjax.state_read(kvjax.init(cfg), one, 4)
        assert [r[2:] for r in records(back)] == [r[2:] for r in records(half)]


def test_many_sequence_words():
    """n_seq_max = 40: two mask words, ids above 31 in the blob."""
    cfg = kvjax.CacheConfig(size=32, n_seq_max=40, n_layer=1, n_kv_heads=1, head_dim=4)
    cache = with_random_kv(fill(kvjax.init(cfg), range(4), [[0], [33, 1], [39], [31, 32, 0]]), 5)
    blob = kvjax.state_write(cache)
    assert records(kvjax.state_read(kvjax.init(cfg), blob)) == records(cache)
    seq_blob = kvjax.state_write(cache, 32)
    restored = kvjax.state_read(kvjax.init(cfg), seq_blob, 38)
    assert [(r[0], r[1]) for r in records(restored)] == [(3, frozenset({38}))]


def test_donated_read_matches():
    cfg = kvjax.CacheConfig(**PLAIN)
    cache = with_random_kv(fill(kvjax.init(cfg), range(9), [[0], [1], [2]] * 3), 6)
    blob, seq_blob = kvjax.state_write(cache), kvjax.state_write(cache, 1)
    expected = records(kvjax.state_read(kvjax.init(cfg), blob))
    assert records(kvjax.state_read(kvjax.init(cfg), blob, donate=True)) == expected
    expected = records(kvjax.state_read(cache, seq_blob, 4))
    dest = with_random_kv(fill(kvjax.init(cfg), range(9), [[0], [1], [2]] * 3), 6)
    assert records(kvjax.state_read(dest, seq_blob, 4, donate=True)) == expected
    assert all(x.is_deleted() for x in dest.k)  # the old value's K/V were reused


# -- a blob built from the layout description -----------------------------------------------------


def pack_values(values, dtype):
    """Little-endian bytes of float values (chosen exactly representable) in a ggml type."""
    if dtype == "float32":
        return struct.pack(f"<{len(values)}f", *values)
    if dtype == "float16":
        return struct.pack(f"<{len(values)}e", *values)
    # bfloat16: the upper half of the float32 bits
    return b"".join(struct.pack("<H", struct.unpack("<I", struct.pack("<f", x))[0] >> 16) for x in values)


TYPE_ID = {"float32": 0, "float16": 1, "bfloat16": 30}
ITEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def seed_blob(cells, layers, v_trans, single, k_dtype="float32", v_dtype="float32"):
    """The seed's state_write output, from its description (not from kvjax).

    Args:
        cells: (pos, ascending seq ids) of each written cell, in cell order.
        layers: per cached layer (K rows, V rows): lists of per-cell value lists, H*D (H*Dv)
            values each, heads outer.
    Returns:
        (blob, offsets of every field boundary).
    """
    pieces = [struct.pack("<I", len(cells))]
    for pos, ids in cells:
        if single:
            pieces.append(struct.pack("<iI", pos, 0))
        else:
            pieces.append(struct.pack("<iI", pos, len(ids)))
            pieces.extend(struct.pack("<i", s) for s in ids)
    pieces.append(struct.pack("<I", int(v_trans)))
    pieces.append(struct.pack("<I", len(layers)))
    for k_rows, _ in layers:
        pieces.append(struct.pack("<i", TYPE_ID[k_dtype]))
        pieces.append(struct.pack("<Q", len(k_rows[0]) * ITEM[k_dtype]))
        pieces.extend(pack_values(row, k_dtype) for row in k_rows)
    for _, v_rows in layers:
        pieces.append(struct.pack("<i", TYPE_ID[v_dtype]))
        n_embd = len(v_rows[0])
        if not v_trans:
            pieces.append(struct.pack("<Q", n_embd * ITEM[v_dtype]))
            pieces.extend(pack_values(row, v_dtype) for row in v_rows)
        else:
            pieces.append(struct.pack("<I", ITEM[v_dtype]))
            pieces.append(struct.pack("<I", n_embd))
            for j in range(n_embd):
                pieces.append(pack_values([row[j] for row in v_rows], v_dtype))
    offsets = np.cumsum([0] + [len(p) for p in pieces]).tolist()
    return b"".join(pieces), offsets


def hand_built(v_trans, k_dtype="float32", v_dtype="float32"):
    """A cache filled through kvjax.write with known values, and the seed's blobs for it.

    Layers 0 and 2 are cached (2 heads x 4 dims, then 1 head x 8 dims, V of size 3 per head);
    cells 0..5 hold positions 10..15 for sequences {0}, {0, 2}, {1}, {0}, {2, 1, 0}, {1}; cell 3
    is then removed, so the written cells form two ranges.
    """
    cfg = kvjax.CacheConfig(
        size=32,
        n_seq_max=3,
        n_layer=3,
        n_kv_heads=(2, 5, 1),
        head_dim=(4, 2, 8),
        head_dim_v=3,
        layer_filter=[0, 2],
        padding=16,
        v_trans=v_trans,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
    )
    seqs = [[0], [0, 2], [1], [0], [2, 1, 0], [1]]
    ub = kvjax.make_ubatch([10 + i for i in range(6)], seqs)
    cache, slot, ok = kvjax.find_slot(kvjax.init(cfg), ub)
    assert bool(ok) and slot[:6].tolist() == list(range(6))
    shapes = {0: (2, 4), 2: (1, 8)}
    k_vals, v_vals = {}, {}
    for layer, (h, d) in shapes.items():
        # small multiples of 1/8: exact in every dtype used here
        k_vals[layer] = (np.arange(6 * h * d).reshape(6, h, d) % 61 - 30) / 8.0 + layer
        v_vals[layer] = (np.arange(6 * h * 3).reshape(6, h, 3) % 53 - 20) / 4.0 - layer
        cache = kvjax.write(
            cache, layer, slot[:6], jnp.asarray(k_vals[layer], jnp.float32), jnp.asarray(v_vals[layer], jnp.float32)
        )
    cache, _ = kvjax.seq_rm(cache, 0, 13, 14)  # empties cell 3 (position 13)
    kept = [0, 1, 2, 4, 5]
    whole = seed_blob(
        [(10 + c, sorted(seqs[c])) for c in kept],
        [
            ([k_vals[ly][c].reshape(-1).tolist() for c in kept], [v_vals[ly][c].reshape(-1).tolist() for c in kept])
            for ly in (0, 2)
        ],
        v_trans,
        single=False,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
    )
    of1 = [c for c in kept if 1 in seqs[c]]
    single = seed_blob(
        [(10 + c, []) for c in of1],
        [
            ([k_vals[ly][c].reshape(-1).tolist() for c in of1], [v_vals[ly][c].reshape(-1).tolist() for c in of1])
            for ly in (0, 2)
        ],
        v_trans,
        single=True,
        k_dtype=k_dtype,
        v_dtype=v_dtype,
    )
    return cfg, cache, whole, single, (seqs, kept, of1, k_vals, v_vals)


@functools.lru_cache(maxsize=None)
def built(v_trans):
    """hand_built(v_trans), made once per test session."""
    return hand_built(v_trans)


@pytest.mark.parametrize("v_trans", [False, True], ids=["v_plain", "v_trans"])
def test_hand_built_blob(v_trans):
    cfg, cache, (whole, _), (single, _), (seqs, kept, of1, k_vals, v_vals) = hand_built(v_trans)
    assert kvjax.state_write(cache) == whole
    assert kvjax.state_write(cache, 1) == single
    # read the hand-built blob into a fresh cache and look at every cell and row
    restored = kvjax.state_read(kvjax.init(cfg), whole)
    table = kvjax.cell_table(restored)
    assert table.pos[:5].tolist() == [10 + c for c in kept] and (table.pos[5:] == -1).all()
    assert [sorted(np.flatnonzero(row).tolist()) for row in table.seqs[:5]] == [sorted(seqs[c]) for c in kept]
    for layer in (0, 2):
        k, v = kvjax.view(restored, layer, 32)
        np.testing.assert_array_equal(np.asarray(k)[:, :5].transpose(1, 0, 2), k_vals[layer][kept])
        np.testing.assert_array_equal(np.asarray(v)[:, :5].transpose(1, 0, 2), v_vals[layer][kept])
    moved = kvjax.state_read(kvjax.init(cfg), single, 2)
    table = kvjax.cell_table(moved)
    assert table.pos[:3].tolist() == [10 + c for c in of1] and table.seqs[:3, 2].all()
    assert not table.seqs[:, :2].any()
    k, _ = kvjax.view(moved, 2, 32)
    np.testing.assert_array_equal(np.asarray(k)[:, :3].transpose(1, 0, 2), k_vals[2][of1])


def test_hand_built_half_precision_type_ids():
    cfg, cache, (whole, _), (single, _), (_, kept, _, k_vals, v_vals) = hand_built(
        True, k_dtype="float16", v_dtype="bfloat16"
    )
    assert kvjax.state_write(cache) == whole
    assert kvjax.state_write(cache, 1) == single
    restored = kvjax.state_read(kvjax.init(cfg), whole)
    k, v = kvjax.view(restored, 0, 32)
    assert k.dtype == jnp.float16 and v.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(v, np.float32)[:, :5].transpose(1, 0, 2), v_vals[0][kept])


# -- corrupt and mismatched blobs -----------------------------------------------------------------


def expect_refused(cache, blob, seq_id=-1, match=None, **kw):
    snap = snapshot(cache)
    with pytest.raises(StateError, match=match):
        kvjax.state_read(cache, blob, seq_id, **kw)
    assert_unchanged(cache, snap)


@pytest.mark.parametrize("v_trans", [False, True], ids=["v_plain", "v_trans"])
def test_truncation_everywhere(v_trans):
    cfg, cache, (whole, whole_cuts), (single, single_cuts), _ = hand_built(v_trans)
    for blob, cuts, seq in ((whole, whole_cuts, -1), (single, single_cuts, 0)):
        for cut in cuts[:-1]:  # every field boundary ...
            expect_refused(cache, blob[:cut], seq, match="truncated")
        for cut in range(0, len(blob), 7):  # ... and inside fields
            expect_refused(cache, blob[:cut], seq)
        expect_refused(cache, blob + b"\0", seq, match="trailing")


def _patch(blob, offset, fmt, value):
    out = bytearray(blob)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_mismatched_fields_are_named():
    cfg, cache, (whole, cuts), (single, scuts), _ = hand_built(False)
    # field offsets of the whole blob: count, 5 cell records (2 + ids words), v_trans, n_layer, ...
    n_pieces_meta = 1 + sum(1 + len(ids) for ids in ([0], [0, 2], [1], [2, 1, 0], [1]))
    i_vtrans = n_pieces_meta
    o_vtrans, o_nlayer, o_ktype, o_krow = (cuts[i_vtrans], cuts[i_vtrans + 1], cuts[i_vtrans + 2], cuts[i_vtrans + 3])
    cases = [
        (_patch(whole, 0, "<I", 33), "cell_count: expected at most 32"),
        (_patch(whole, 0, "<I", 2**32 - 1), "cell_count"),
        (_patch(whole, o_vtrans, "<I", 1), "v_trans: expected 0"),
        (_patch(whole, o_vtrans, "<I", 2), "v_trans: expected 0"),
        (_patch(whole, o_nlayer, "<I", 3), r"n_layer: expected 2 \(cached layers \[0, 2\]\), found 3"),
        (_patch(whole, o_ktype, "<i", 1), r"layer 0 K type: expected 0 \(F32\), found 1 \(F16\)"),
        (_patch(whole, o_ktype, "<i", 8), "found 8 .Q8_0.: quantized K/V state is not supported"),
        (_patch(whole, o_ktype, "<i", -5), "layer 0 K type"),
        (_patch(whole, o_krow, "<Q", 16), r"layer 0 K row size: expected 32 bytes \(2 heads x head size 4"),
        (_patch(whole, o_krow, "<Q", 2**63), "layer 0 K row size"),
        (_patch(whole, 4, "<i", -3), r"cell 0 pos: expected in \[0, 2147483647\).*found -3"),
        (_patch(whole, 8, "<I", 0), "cell 0 n_seq_id: expected 1 to n_seq_max=3"),
        (_patch(whole, 8, "<I", 4), "cell 0 n_seq_id"),
        (_patch(whole, 12, "<i", 3), r"cell 0 seq id: expected \[0, n_seq_max=3\), found 3"),
        (_patch(whole, 12, "<i", -1), "cell 0 seq id"),
        (_patch(whole, 4 + 12 + 12, "<i", 0), "cell 1 seq ids: expected 2 distinct ids"),
    ]
    for blob, match in cases:
        expect_refused(cache, blob, match=match)
    # V fields: find them after the K section of both layers
    k_end = cuts.index(o_krow) + 1 + 5  # 5 rows after layer 0's header
    o_ktype2 = cuts[k_end]
    expect_refused(cache, _patch(whole, o_ktype2, "<i", 30), match="layer 2 K type: expected 0 .F32., found 30 .BF16.")
    o_vtype = cuts[k_end + 2 + 5]
    expect_refused(cache, _patch(whole, o_vtype, "<i", 2), match="layer 0 V type.*quantized")
    expect_refused(cache, _patch(whole, o_vtype + 4, "<Q", 20), match="layer 0 V row size: expected 24 bytes.*found 20")
    # kinds of blob swapped
    expect_refused(cache, whole, 1, match="cell 0 n_seq_id: expected 0")
    expect_refused(cache, single, -1, match="n_seq_id: expected 1 to n_seq_max=3.*seq_id >= 0")
    expect_refused(cache, _patch(single, 4, "<i", -1), 0, match="cell 0 pos")
    # more cells than the destination can take once its sequence is removed
    tiny = fill(kvjax.init(cfg), range(30), [[0]] * 30)
    expect_refused(tiny, single, 1, match=r"cell_count: expected at most 2 \(the free cells")
    # transposed-V fields
    cfg_t, cache_t, (whole_t, cuts_t), _, _ = hand_built(True)
    o_vtype_t = cuts_t[cuts_t.index(o_ktype2) + 2 + 5]
    expect_refused(cache_t, _patch(whole_t, o_vtype_t + 4, "<I", 2), match="layer 0 V element size: expected 4")
    expect_refused(cache_t, _patch(whole_t, o_vtype_t + 8, "<I", 5), match="layer 0 V n_embd_v_gqa: expected 6")
    expect_refused(cache, whole_t, match="v_trans: expected 0")


def test_other_config_is_refused():
    _, _, (whole, _), _, _ = hand_built(False)
    base = dict(
        size=32,
        n_seq_max=3,
        n_layer=3,
        n_kv_heads=(2, 5, 1),
        head_dim=(4, 2, 8),
        head_dim_v=3,
        layer_filter=[0, 2],
        padding=16,
    )
    others = {
        "K type": dict(k_dtype="float16"),
        "V type": dict(v_dtype="bfloat16"),
        "n_layer": dict(layer_filter=[0, 1, 2]),
        "K row size": dict(head_dim=(8, 2, 8)),
        "V row size": dict(head_dim_v=2),
        "cell_count": dict(size=4, padding=4),
        "n_seq_max=2": dict(n_seq_max=2),
    }
    for field, change in others.items():
        cache = kvjax.init(kvjax.CacheConfig(**{**base, **change}))
        expect_refused(cache, whole, match=field)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=200), seq=st.sampled_from([-1, 0]))
def test_random_bytes(data, seq):
    expect_refused(built(False)[1], data, seq)


@settings(max_examples=80, deadline=None)
@given(
    which=st.sampled_from(["whole", "single"]),
    v_trans=st.booleans(),
    donate=st.booleans(),
    edits=st.lists(
        st.tuples(st.sampled_from(["set", "insert", "delete", "cut"]), st.integers(0, 2**16), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
)
def test_fuzz_mutated_blobs(which, v_trans, donate, edits):
    cfg, cache, (whole, _), (single, _), _ = built(v_trans)
    blob = bytearray(whole if which == "whole" else single)
    for kind, at, byte in edits:
        at = at % (len(blob) + 1)
        if kind == "set" and at < len(blob):
            blob[at] = byte
        elif kind == "insert":
            blob[at:at] = bytes([byte])
        elif kind == "delete":
            del blob[at : at + 1 + byte % 9]
        elif kind == "cut":
            del blob[at:]
    dest = kvjax.state_read(kvjax.init(cfg), whole)  # a fresh value each time (donation below)
    snap = snapshot(dest)
    seq = -1 if which == "whole" else 1
    try:
        restored = kvjax.state_read(dest, bytes(blob), seq, donate=donate)
    except StateError:
        assert_unchanged(dest, snap)
        return
    assert_valid(restored)  # a mutation of K/V payload bytes is a valid blob


# -- host-side contract ---------------------------------------------------------------------------


def test_no_recompile_within_a_bucket():
    cfg = kvjax.CacheConfig(**{**MIXED, "size": 128})  # used by no other test: nothing warm
    a = with_random_kv(fill(kvjax.init(cfg), range(5), [[0], [0, 1], [0], [0, 2], [0]]), 7)
    b = with_random_kv(fill(kvjax.init(cfg), range(7), [[1]] * 4 + [[3, 1]] * 3), 8)
    for cache, seq in ((a, 0), (a, -1)):  # warm up the 8-row bucket
        kvjax.state_read(kvjax.init(cfg), kvjax.state_write(cache, seq), seq)
    kvjax.state_read(a, kvjax.state_write(a, 0), 2, contiguous=True)
    kvjax.state_read(a, kvjax.state_write(a, 0), 2, contiguous=False)
    fresh = kvjax.init(cfg)
    with no_recompile():
        whole = kvjax.state_write(b)
        kvjax.state_read(fresh, whole)
        one = kvjax.state_write(b, 1)
        kvjax.state_read(a, one, 4)
        kvjax.state_read(a, one, 3, contiguous=False)
    other = kvjax.init(cfg.replace(size=256))
    with CompileCounter() as counter:  # another row count compiles (so the counter can see it)
        kvjax.state_read(other, whole)
    assert counter.count > 0


def test_pending_shift_is_refused():
    cfg = kvjax.CacheConfig(**PLAIN)
    cache = fill(kvjax.init(cfg), range(4), [[0], [0], [1], [1]])
    shifted = kvjax.seq_add(cache, 0, 0, -1, 3)
    with pytest.raises(ValueError, match="pending K-shift"):
        kvjax.state_write(shifted)
    with pytest.raises(ValueError, match="pending K-shift"):
        kvjax.state_write(shifted, 0)
    assert kvjax.state_write(shifted, 1) == kvjax.state_write(cache, 1)


def test_bad_arguments():
    cfg = kvjax.CacheConfig(**PLAIN)
    cache = kvjax.init(cfg)
    blob = kvjax.state_write(cache)
    for bad in (5, -2):
        with pytest.raises(ValueError, match="seq_id"):
            kvjax.state_write(cache, bad)
        with pytest.raises(ValueError, match="seq_id"):
            kvjax.state_read(cache, blob, bad)
    with pytest.raises(StateError, match="bytes-like"):
        kvjax.state_read(cache, "not bytes")
    with pytest.raises(ValueError, match="KVCache"):
        kvjax.state_write(cfg)
    with pytest.raises(ValueError, match="outside jax.jit"):
        jax.jit(kvjax.state_write)(cache)
    with pytest.raises(ValueError, match="outside jax.jit"):
        jax.jit(lambda c: kvjax.state_read(c, blob))(cache)
    # other bytes-like inputs are accepted
    assert records(kvjax.state_read(cache, bytearray(blob))) == []
    assert records(kvjax.state_read(cache, np.frombuffer(blob, np.uint8))) == []
    assert kvjax.state_write(kvjax.state_read(cache, memoryview(blob))) == blob
