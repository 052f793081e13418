"""The latent (MLA) cache: K rows ``[latent | RoPE key]``, V a view of the latent, and the absorbed attention.

DeepSeek's multi-head latent attention caches one compressed latent ``c`` (``kv_lora_rank``) and
one shared RoPE key per token; every head's K and V are ``W_uk[h] c`` and ``W_uv[h] c``. The
absorbed form attends with ``[W_uk[h]^T q_nope | q_pe]`` over the cached rows ``[c | k_pe]`` and
projects the latent output with ``W_uv[h]``. These tests prove that form, through the cache's
public API, equal to the decompressed attention of every head (``attend_uncached``, which knows
nothing of latents), and the cache's own rules: no V storage, a K-shift of the RoPE key only, a
state blob without a V section (llama.cpp's layout for a cache without V).
"""

from __future__ import annotations

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.memory import _stream_attention as _streams
from kvjax.nn import attend_uncached
from tests.helpers import no_recompile

LATENT, ROPE_DIM, NOPE, V_DIM, N_HEADS = 32, 16, 24, 20, 4
ROPE = kvjax.RopeConfig(n_rot=ROPE_DIM)


def _config(**changes):
    base = dict(
        size=64,
        n_seq_max=2,
        n_layer=2,
        n_kv_heads=1,
        head_dim=LATENT + ROPE_DIM,
        head_dim_v=LATENT,
        padding=32,
        mla=True,
        rope=ROPE,
    )
    return kvjax.CacheConfig(**{**base, **changes})


class _Model:
    """Random MLA projections of one layer, and the latents / RoPE keys / queries of a few tokens."""

    def __init__(self, n_tok: int, seed: int = 0, latent: int = LATENT, rope_dim: int = ROPE_DIM):
        rng = np.random.default_rng(seed)
        f = lambda *s: jnp.asarray(rng.normal(size=s) / np.sqrt(s[-1]), jnp.float32)  # noqa: E731
        self.rope, self.latent = kvjax.RopeConfig(n_rot=rope_dim), latent
        self.w_uk, self.w_uv = f(N_HEADS, NOPE, latent), f(N_HEADS, V_DIM, latent)
        self.c, self.k_pe = f(n_tok, latent), f(n_tok, rope_dim)
        self.q_nope, self.q_pe = f(n_tok, N_HEADS, NOPE), f(n_tok, N_HEADS, rope_dim)
        self.scale = 1.0 / np.sqrt(NOPE + rope_dim)  # DeepSeek's: the decompressed head size

    def config(self, **changes):
        """The latent cache of these dimensions."""
        dims = dict(head_dim=self.latent + self.rope.n_rot, head_dim_v=self.latent, rope=self.rope)
        return _config(**{**dims, **changes})

    def rows(self, pos):
        """Cached K rows ``[T, 1, latent + rope]``: the latent, then the RoPE key at ``pos``."""
        k_pe = kvjax.rope(self.k_pe[:, None], pos, self.rope)
        return jnp.concatenate([self.c[:, None], k_pe], axis=-1)

    def absorbed_q(self, pos):
        """Queries in the latent space ``[T, H, latent + rope]``."""
        q_lat = jnp.einsum("thn,hnr->thr", self.q_nope, self.w_uk)
        return jnp.concatenate([q_lat, kvjax.rope(self.q_pe, pos, self.rope)], axis=-1)

    def project_out(self, latent_out):
        """Latent outputs ``[T, H, latent]`` through ``W_uv``: ``[T, H, v]``."""
        return jnp.einsum("thr,hvr->thv", latent_out, self.w_uv)

    def decompressed(self, pos):
        """The naive attention: every head's K and V decompressed, RoPE in the last columns."""
        k_nope = jnp.einsum("hnr,tr->thn", self.w_uk, self.c)
        k_pe = kvjax.rope(self.k_pe[:, None], pos, self.rope)
        k_pe = jnp.broadcast_to(k_pe, k_nope.shape[:2] + k_pe.shape[-1:])
        q = jnp.concatenate([self.q_nope, kvjax.rope(self.q_pe, pos, self.rope)], axis=-1)
        k = jnp.concatenate([k_nope, k_pe], axis=-1)
        v = jnp.einsum("hvr,tr->thv", self.w_uv, self.c)
        # jax.nn.dot_product_attention takes V as wide as K: zero columns, cut off again (exact)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, k.shape[-1] - V_DIM)))
        return attend_uncached(q[None], k[None], v[None], pos[None], scale=self.scale)[0, ..., :V_DIM]


def _placed(cache, n_tok):
    ub = kvjax.make_ubatch(list(range(n_tok)), [[0]] * n_tok, length=n_tok)
    cache, slot, ok = kvjax.find_slot(cache, ub)
    assert bool(ok)
    return cache, ub, slot


# -- the configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(head_dim_v=LATENT + ROPE_DIM), r"head_dim_v=48 is out of range: allowed < head_dim=48"),
        (
            dict(rope=kvjax.RopeConfig(n_rot=24)),
            r"rope.n_rot=24 is out of range: allowed <= head_dim - head_dim_v = 16",
        ),
        (dict(k_dtype="float16", v_dtype="bfloat16"), r"v_dtype='bfloat16' is out of range: allowed k_dtype='float16'"),
        (dict(mla="yes"), r"mla='yes' is out of range"),
        (
            dict(rope=(ROPE, kvjax.RopeConfig(n_rot=8))),
            r"rope.n_rot=\[8, 16\] is out of range: allowed one n_rot for every cached layer",
        ),
        (
            dict(head_dim=64 + 16, head_dim_v=64, k_dtype="q8_0"),
            r"head_dim=80 is out of range: allowed a multiple of 32",
        ),
        (
            dict(head_dim=96, head_dim_v=64, k_dtype="q8_0"),
            r"rope.n_rot=16 is out of range: allowed a value leaving head_dim - n_rot a multiple of 32",
        ),
    ],
)
def test_config_refuses_what_a_latent_cache_cannot_hold(changes, match):
    with pytest.raises(ValueError, match=match):
        _config(**changes)


def test_config_reads_v_from_k():
    assert _config(k_dtype="float16").v_dtype == "float16"  # the default follows K: V is K's columns
    cfg = _config(head_dim=96, head_dim_v=64, k_dtype="q8_0", rope=kvjax.RopeConfig(n_rot=32), v_trans=True)
    assert cfg.v_dtype == "q8_0" and cfg.rope_start(0) == 64  # v_trans only flags the (V-less) blob


def test_no_v_storage_and_k_bytes_only():
    cfg = _config()
    cache = kvjax.init(cfg)
    assert cache.v[0].shape == (2, 1, 64, 0)
    assert kvjax.size_v_bytes(cfg) == 0
    assert kvjax.total_size(cfg) == kvjax.size_k_bytes(cfg) == 2 * 64 * (LATENT + ROPE_DIM) * 4
    # the decompressed cache of the same layer: every head's K (nope + rope) and V
    plain = kvjax.CacheConfig(
        size=64, n_seq_max=2, n_layer=2, n_kv_heads=N_HEADS, head_dim=NOPE + ROPE_DIM, head_dim_v=V_DIM, padding=32
    )
    assert kvjax.total_size(plain) / kvjax.total_size(cfg) == pytest.approx(N_HEADS * (NOPE + ROPE_DIM + V_DIM) / 48)


def test_write_takes_k_only_and_bad_v_changes_nothing():
    cache, ub, slot = _placed(kvjax.init(_config()), 3)
    m = _Model(3)
    before = jax.tree.map(np.asarray, cache)
    with pytest.raises(ValueError, match=r"v must be None for a latent cache \(mla=True\)"):
        kvjax.write(cache, 0, slot, m.rows(ub.pos), m.rows(ub.pos)[..., :LATENT])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(cache)))
    cache = kvjax.write(cache, 0, slot, m.rows(ub.pos))
    k, v = kvjax.view(cache, 0, 32)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(k[..., :LATENT]))
    with pytest.raises(ValueError, match=r"v is None: allowed a floating"):
        plain = kvjax.init(_config(mla=False))
        kvjax.write(plain, 0, slot, m.rows(ub.pos))


# -- the absorbed attention ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "k_dtype, implementation, dims, tol",
    [
        ("float32", "xla", (LATENT, ROPE_DIM), 1e-5),
        ("float32", "pallas", (LATENT, ROPE_DIM), 1e-5),
        ("float16", "xla", (LATENT, ROPE_DIM), 3e-3),
        ("q8_0", "xla", (64, 32), 3e-2),  # a block type: whole blocks for the latent and the RoPE key
    ],
)
def test_absorbed_attention_equals_decompressed_attention(k_dtype, implementation, dims, tol):
    """Cached, absorbed (one latent row per token) equals every head decompressed, uncached."""
    n = 11
    m = _Model(n, latent=dims[0], rope_dim=dims[1])
    cache, ub, slot = _placed(kvjax.init(m.config(k_dtype=k_dtype)), n)
    cache = kvjax.write(cache, 1, slot, m.rows(ub.pos))
    mask = kvjax.kq_mask(cache, ub, 32)

    def run(cache, q):
        return kvjax.attention(q, cache, 1, mask, scale=m.scale, implementation=implementation)

    q = m.absorbed_q(ub.pos)
    eager = m.project_out(run(cache, q))
    want = m.decompressed(ub.pos)
    assert float(jnp.abs(eager - want).max()) <= tol * float(jnp.abs(want).max())
    jitted = jax.jit(run)
    np.testing.assert_allclose(np.asarray(m.project_out(jitted(cache, q))), np.asarray(eager), rtol=1e-5, atol=1e-6)
    other = m.absorbed_q(ub.pos + 3)
    with no_recompile():
        jitted(cache, other).block_until_ready()


def test_stream_attention_of_a_latent_memory_equals_the_unified_cache():
    """Per-sequence streams of latent rows attend as one latent cache per stream (K written, V its view)."""
    n = 6
    m = _Model(2 * n, seed=1)
    memory = kvjax.init(kvjax.StreamsConfig(_config(size=32)))
    ub = kvjax.make_equal_ubatch([(list(range(n)), [0]), (list(range(n)), [1])], n_slots=2)
    memory, placement, ok = kvjax.find_slot(memory, ub)
    assert bool(ok)
    rows = m.rows(ub.pos)
    q = m.absorbed_q(ub.pos)

    def run(memory, rows, q):
        cache = _streams.write(memory.cache, 0, placement, rows, None)
        memory = memory.replace(cache=cache)
        out = _streams.attention(q, memory, 0, _streams.masks(memory, ub, placement, 32), placement, ub, scale=m.scale)
        return out, memory

    eager, written = run(memory, rows, q)
    jitted, _ = jax.jit(run)(memory, rows, q)
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-6, atol=1e-6)
    for s in range(2):
        sl = slice(n * s, n * (s + 1))
        one = kvjax.init(_config(size=32))
        one, slot, _ = kvjax.find_slot(one, kvjax.make_ubatch(list(range(n)), [[0]] * n, length=n))
        one = kvjax.write(one, 0, slot, rows[sl])
        sub = kvjax.make_ubatch(list(range(n)), [[0]] * n, length=n)
        want = kvjax.attention(q[sl], one, 0, kvjax.kq_mask(one, sub, 32), scale=m.scale)
        np.testing.assert_allclose(np.asarray(eager[sl]), np.asarray(want), rtol=1e-5, atol=1e-6)


# -- the K-shift ---------------------------------------------------------------------------------------


def test_k_shift_rotates_the_rope_key_only_and_equals_the_key_at_its_new_position():
    n, delta = 7, 5
    m = _Model(n)
    cache, ub, slot = _placed(kvjax.init(_config()), n)
    cache = kvjax.write(cache, 0, slot, m.rows(ub.pos))
    before, _ = kvjax.view(cache, 0, 32)
    cache = kvjax.update(kvjax.seq_add(cache, 0, 0, -1, delta))
    after, _ = kvjax.view(cache, 0, 32)
    np.testing.assert_array_equal(np.asarray(after[0, :n, :LATENT]), np.asarray(before[0, :n, :LATENT]))
    np.testing.assert_allclose(np.asarray(after[0, :n]), np.asarray(m.rows(ub.pos + delta)[:, 0]), rtol=1e-5, atol=1e-5)


def test_k_shift_of_block_rows_leaves_the_latent_blocks_bit_for_bit():
    """In q8_0 the latent's blocks are not requantized: only the RoPE key's blocks are rewritten."""
    cfg = _Model(1, latent=64, rope_dim=32).config(k_dtype="q8_0")
    rng = np.random.default_rng(3)
    cache, ub, slot = _placed(kvjax.init(cfg), 9)
    cache = kvjax.write(cache, 1, slot, jnp.asarray(rng.normal(size=(9, 1, 96)), jnp.float32))
    latent_bytes = 2 * 34  # two q8_0 blocks of 34 bytes
    before = np.asarray(cache.k[0][1, 0, :9])
    shifted = kvjax.update(kvjax.seq_add(cache, 0, 0, -1, 3))
    after = np.asarray(shifted.k[0][1, 0, :9])
    np.testing.assert_array_equal(after[:, :latent_bytes], before[:, :latent_bytes])
    assert not np.array_equal(after[:, latent_bytes:], before[:, latent_bytes:])


# -- the state blob ------------------------------------------------------------------------------------


def test_state_has_k_sections_only_and_round_trips():
    """llama.cpp writes no V section for a cache without V storage: the blob is the cells and the K rows."""
    n = 5
    m = _Model(n)
    cfg = _config()
    cache, ub, slot = _placed(kvjax.init(cfg), n)
    for layer in (0, 1):
        cache = kvjax.write(cache, layer, slot, m.rows(ub.pos) * (layer + 1))
    blob = kvjax.state_write(cache, 0)
    k_row = (LATENT + ROPE_DIM) * 4
    assert len(blob) == 4 + n * 8 + 8 + 2 * (12 + n * k_row)
    assert struct.unpack_from("<iQ", blob, 4 + n * 8 + 8) == (0, k_row)
    restored = kvjax.state_read(kvjax.init(cfg), blob, 1)
    np.testing.assert_array_equal(np.asarray(kvjax.view(restored, 1, 32)[0]), np.asarray(kvjax.view(cache, 1, 32)[0]))
    whole = kvjax.state_write(cache)
    assert kvjax.state_write(kvjax.state_read(kvjax.init(cfg), whole)) == whole
    with pytest.raises(kvjax.StateError):  # a blob with a V section is another layout
        kvjax.state_read(kvjax.init(cfg), kvjax.state_write(kvjax.init(_config(mla=False, head_dim_v=LATENT))))


# -- defrag ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("k_dtype", ["float32", "q8_0"])
def test_defrag_moves_the_latent_rows_with_their_cells(k_dtype):
    """After a defrag every sequence's cached rows (latent and RoPE key, hence V) read as before."""
    m = _Model(12, latent=64, rope_dim=32)
    cfg = m.config(k_dtype=k_dtype)
    cache = kvjax.init(cfg)
    ub = kvjax.make_ubatch(list(range(6)) * 2, [[0]] * 6 + [[1]] * 6, length=12)
    cache, slot, _ = kvjax.find_slot(cache, ub)
    cache = kvjax.write(cache, 0, slot, m.rows(ub.pos))
    cache, _ = kvjax.seq_rm(cache, 0, 0, 4)  # a hole before sequence 1's cells
    q = m.absorbed_q(jnp.full((12,), 6))[:1]  # one query of sequence 1 at position 6
    mask_of = lambda c: kvjax.kq_mask(c, kvjax.make_ubatch([6], [[1]]), 32)  # noqa: E731
    before = kvjax.attention(q, cache, 0, mask_of(cache), scale=m.scale)
    moved = kvjax.defrag(cache)
    pos = kvjax.cell_table(moved).pos
    assert (pos[:8] >= 0).all() and (pos[8:] == -1).all()  # the rows moved into the hole: no gap left
    after = kvjax.attention(q, moved, 0, mask_of(moved), scale=m.scale)
    np.testing.assert_allclose(np.asarray(after), np.asarray(before), rtol=1e-6, atol=1e-6)
    k, v = kvjax.view(moved, 0, 32)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(k[..., :64]))
