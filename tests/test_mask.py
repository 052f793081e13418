"""KQ masks and T5 buckets against brute-force references written from the seed's loops."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.memory._cells import Cells
from tests.helpers import CompileCounter, fill, no_recompile, small_config

SWA_KINDS = ["none", "standard", "chunked", "symmetric"]


# -- references (host loops, as the seed's set_input_kq_mask / is_masked_swa) ----------------------


def ref_masked_swa(p0, p1, kind, n_swa):
    if p0 < 0:
        return True
    if kind == "standard":
        return p1 - p0 >= n_swa
    if kind == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if kind == "symmetric":
        return abs(p1 - p0) > n_swa // 2
    return False


def ref_mask(cell_pos, cell_seqs, tokens, n_rows, n_kv, causal, alibi, kind, n_swa):
    """cell_seqs: list of sets; tokens: list of (pos, seq0) for the valid rows."""
    out = np.full((n_rows, n_kv), -np.inf, np.float32)
    for j, (p1, seq) in enumerate(tokens):
        for i in range(n_kv):
            p0 = cell_pos[i]
            masked = seq not in cell_seqs[i]
            masked = masked or (causal and p0 > p1)
            masked = masked or ref_masked_swa(p0, p1, kind, n_swa)
            if not masked:
                out[j, i] = -abs(p0 - p1) if alibi else 0.0
    return out


def ref_t5_bucket(rel, n_buckets, bidirectional, max_distance=128):
    """T5's relative_position_bucket (Raffel et al. 2020; the Mesh TensorFlow / HF definition)."""
    ret = 0
    n = n_buckets
    if bidirectional:
        n //= 2
        ret += n if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = -min(rel, 0)
    max_exact = n // 2
    if rel < max_exact:
        return ret + rel
    large = max_exact + int(math.log(rel / max_exact) / math.log(max_distance / max_exact) * (n - max_exact))
    return ret + min(large, n - 1)


# -- random cell states ---------------------------------------------------------------------------


def cells_from(cell_pos, cell_seqs, n_seq_max):
    """A Cells value holding exactly these positions and sequence sets (empty set: empty cell)."""
    size = len(cell_pos)
    n_words = -(-n_seq_max // 32)
    words = np.zeros((size, n_words), np.uint32)
    for i, seqs in enumerate(cell_seqs):
        for s in seqs:
            words[i, s // 32] |= np.uint32(1 << (s % 32))
    pos = np.where([bool(s) for s in cell_seqs], cell_pos, -1).astype(np.int32)
    return Cells(
        pos=jnp.asarray(pos),
        seq=jnp.asarray(words),
        delta=jnp.zeros(size, jnp.int32),
        head=jnp.int32(0),
        error=jnp.uint32(0),
        defrag=jnp.bool_(False),
        n_seq_max=n_seq_max,
    )


@st.composite
def scenes(draw):
    """A cache with shared cells, holes and several sequences, plus a ubatch with padding rows."""
    n_seq_max = draw(st.sampled_from([3, 40]))  # 40: two bitmask words
    cfg = small_config(n_seq_max=n_seq_max, n_layer=1)
    seq_ids = st.integers(0, n_seq_max - 1)
    size = cfg.size
    cell_seqs = draw(
        st.lists(
            st.one_of(st.just(frozenset()), st.frozensets(seq_ids, min_size=1, max_size=3)),
            min_size=size,
            max_size=size,
        )
    )
    cell_pos = draw(st.lists(st.integers(0, 40), min_size=size, max_size=size))
    n_tok = draw(st.integers(1, 8))
    tok_pos = draw(st.lists(st.integers(0, 45), min_size=n_tok, max_size=n_tok))
    tok_seq = draw(st.lists(st.lists(seq_ids, min_size=1, max_size=3, unique=True), min_size=n_tok, max_size=n_tok))
    ub = kvjax.make_ubatch(tok_pos, tok_seq, length=8)
    cache = kvjax.init(cfg).replace(cells=cells_from(cell_pos, cell_seqs, n_seq_max))
    pos = [p if s else -1 for p, s in zip(cell_pos, cell_seqs)]
    tokens = [(p, s[0]) for p, s in zip(tok_pos, tok_seq)]
    return cache, ub, pos, cell_seqs, tokens


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scene=scenes(),
    causal=st.booleans(),
    alibi=st.booleans(),
    kind=st.sampled_from(SWA_KINDS),
    n_swa=st.sampled_from([2, 5]),
    n_kv=st.sampled_from([32, 64]),
)
def test_mask_matches_seed_loops(scene, causal, alibi, kind, n_swa, n_kv):
    cache, ub, pos, cell_seqs, tokens = scene
    expected = ref_mask(pos, cell_seqs, tokens, 8, n_kv, causal, alibi, kind, n_swa)
    got = kvjax.kq_mask(cache, ub, n_kv, causal=causal, alibi=alibi, swa_type=kind, n_swa=n_swa)
    assert got.shape == (8, n_kv) and got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), expected)
    visible = kvjax.kq_mask_bool(cache, ub, n_kv, causal=causal, swa_type=kind, n_swa=n_swa)
    np.testing.assert_array_equal(np.asarray(visible), expected > -np.inf)


def test_mask_picture_and_config_window():
    """The docstring picture, and the sliding window taken from the config by default."""
    cfg = small_config(n_layer=1, swa_type="standard", n_swa=2)
    cache = fill(kvjax.init(cfg), [0, 1], [[0], [0]])
    ub = kvjax.make_ubatch([2, 3, 4], [[0]] * 3, length=4)
    cache = fill(cache, [2, 3, 4], [[0]] * 3)
    none = kvjax.kq_mask_bool(cache, ub, 16, swa_type="none")
    assert np.asarray(none)[:3, :8].astype(int).tolist() == [
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
    ]
    assert not np.asarray(none)[3].any()  # the padded row
    bidir = kvjax.kq_mask_bool(cache, ub, 16, causal=False, swa_type="none")
    assert np.asarray(bidir)[:3, :6].astype(int).tolist() == [[1, 1, 1, 1, 1, 0]] * 3
    windowed = kvjax.kq_mask_bool(cache, ub, 16)  # the config's standard window of 2
    assert np.asarray(windowed)[:3, :6].astype(int).tolist() == [
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
    ]


def test_shared_cells_follow_the_first_sequence():
    cfg = small_config(n_layer=1)
    cache = fill(kvjax.init(cfg), [0, 1, 2], [[0], [0], [0]])
    cache = kvjax.seq_cp(cache, 0, 2, 0, 2)  # sequence 2 shares cells 0 and 1
    cache = fill(cache, [2], [[2]])
    ub = kvjax.make_ubatch([3, 3], [[2, 0], [0, 2]])  # same token sets, different first sequence
    vis = np.asarray(kvjax.kq_mask_bool(cache, ub, 16))
    assert vis[0, :4].tolist() == [True, True, False, True]
    assert vis[1, :4].tolist() == [True, True, True, False]


def test_masks_jitted_and_no_recompile():
    cfg = small_config(n_layer=1, n_seq_max=40)
    rng = np.random.default_rng(0)

    def scene():
        seqs = [frozenset(rng.choice(40, rng.integers(0, 3), replace=False).tolist()) for _ in range(cfg.size)]
        cells = cells_from(rng.integers(0, 50, cfg.size).tolist(), seqs, 40)
        ub = kvjax.make_ubatch(rng.integers(0, 50, 5).tolist(), [[int(s)] for s in rng.integers(0, 40, 5)], length=8)
        return kvjax.init(cfg).replace(cells=cells), ub

    jitted = jax.jit(
        lambda c, u: (kvjax.kq_mask(c, u, 32, alibi=True), kvjax.kq_mask_bool(c, u, 32), kvjax.pos_bucket(c, u, 32, 16))
    )
    cache, ub = scene()
    eager = (
        kvjax.kq_mask(cache, ub, 32, alibi=True),
        kvjax.kq_mask_bool(cache, ub, 32),
        kvjax.pos_bucket(cache, ub, 32, 16),
    )
    for a, b in zip(eager, jitted(cache, ub)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for _ in range(3):
        cache, ub = scene()
        with no_recompile():
            kvjax.kq_mask(cache, ub, 32, alibi=True).block_until_ready()
            kvjax.kq_mask_bool(cache, ub, 32).block_until_ready()
            kvjax.pos_bucket(cache, ub, 32, 16).block_until_ready()
            jax.block_until_ready(jitted(cache, ub))


def test_new_window_compiles_once():
    cache = fill(kvjax.init(small_config(n_layer=1)), [0], [[0]])
    ub = kvjax.make_ubatch([1], [[0]])
    with CompileCounter() as first:
        kvjax.kq_mask(cache, ub, 48).block_until_ready()
    assert first.count >= 1  # a new static window is a new program ...
    with no_recompile():  # ... compiled once
        kvjax.kq_mask(fill(cache, [1], [[0]]), ub, 48).block_until_ready()


@pytest.mark.parametrize("n_buckets", [8, 16, 32, 64])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_relative_buckets_match_t5(n_buckets, bidirectional):
    from kvjax.attn._mask import _relative_bucket

    rel = np.arange(-400, 401, dtype=np.int32)
    got = np.asarray(_relative_bucket(jnp.asarray(rel), n_buckets, bidirectional, 128))
    expected = [ref_t5_bucket(int(r), n_buckets, bidirectional) for r in rel]
    assert got.tolist() == expected


def test_pos_bucket_over_cells():
    cfg = small_config(n_layer=1)
    cache = fill(kvjax.init(cfg), list(range(0, 200, 10)), [[0]] * 20)
    ub = kvjax.make_ubatch([150, 7], [[0], [0]])
    got = np.asarray(kvjax.pos_bucket(cache, ub, 32, 32))
    cell_pos = np.asarray(cache.cells.pos)[:32]
    for j, p1 in enumerate([150, 7]):
        assert got[j].tolist() == [ref_t5_bucket(int(p0) - p1, 32, False) for p0 in cell_pos]
    bi = np.asarray(kvjax.pos_bucket(cache, ub, 32, 32, bidirectional=True))
    assert bi[1].tolist() == [ref_t5_bucket(int(p0) - 7, 32, True) for p0 in cell_pos]


def test_bad_input():
    cache = fill(kvjax.init(small_config(n_layer=1)), [0], [[0]])
    ub = kvjax.make_ubatch([1], [[0]])
    for fn in (kvjax.kq_mask, kvjax.kq_mask_bool):
        with pytest.raises(ValueError, match="n_kv=24 is out of range"):
            fn(cache, ub, 24)  # not a multiple of padding=16
        with pytest.raises(ValueError, match="n_kv=80 is out of range"):
            fn(cache, ub, 80)  # more than size=64
        with pytest.raises(ValueError, match="swa_type='sliding'"):
            fn(cache, ub, 16, swa_type="sliding")
        with pytest.raises(ValueError, match="n_swa=0 is out of range"):
            fn(cache, ub, 16, swa_type="chunked")  # the config's n_swa is 0
        with pytest.raises(ValueError, match="ubatch must be a kvjax.Ubatch"):
            fn(cache, [1], 16)
        with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
            fn(cache.cells, ub, 16)
    with pytest.raises(ValueError, match="alibi=True has no boolean form"):
        kvjax.kq_mask_bool(cache, ub, 16, alibi=True)
    with pytest.raises(ValueError, match="n_buckets=2 is out of range"):
        kvjax.pos_bucket(cache, ub, 16, 2, bidirectional=True)
    with pytest.raises(ValueError, match="max_distance=4 is out of range"):
        kvjax.pos_bucket(cache, ub, 16, 16, max_distance=4)
    with pytest.raises(ValueError, match="n_kv must be a static Python int"):
        jax.jit(lambda n: kvjax.kq_mask(cache, ub, n))(16)
