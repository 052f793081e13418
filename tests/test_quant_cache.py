"""Caches with block-quantized K/V: storage layout, write, view, attention, K-shift, defrag, sizes."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import kvjax
from kvjax.storage import _quant as Q

QTYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


def _cfg(k="q8_0", v="q4_0", d=64, size=64, **kw):
    return kvjax.CacheConfig(
        size=size,
        n_seq_max=2,
        n_layer=2,
        n_kv_heads=2,
        head_dim=d,
        k_dtype=k,
        v_dtype=v,
        rope=kvjax.RopeConfig(n_rot=d),
        **kw,
    )


def _fill(cfg, n, seed=0):
    rng = np.random.default_rng(seed)
    cache = kvjax.init(cfg)
    ub = kvjax.make_ubatch(list(range(n)), [[0]] * n)
    cache, slot, _ = kvjax.find_slot(cache, ub)
    rows = {}
    t = slot.shape[0]  # the ubatch may be padded (slot -1 past the n tokens)
    assert (np.asarray(slot)[n:] == -1).all()
    for il in range(cfg.n_layer):
        k = rng.standard_normal((t, 2, cfg.head_dim[il])).astype(np.float32)
        v = rng.standard_normal((t, 2, cfg.head_dim_v[il])).astype(np.float32)
        cache = kvjax.write(cache, il, slot, jnp.asarray(k), jnp.asarray(v))
        rows[il] = (k[:n], v[:n])
    return cache, ub, np.asarray(slot)[:n], rows


@pytest.mark.parametrize("name", QTYPES)
def test_storage_is_ggml_blocks_per_cell(name):
    cfg = _cfg(name, name)
    cache, _, slot, rows = _fill(cfg, 5)
    qt = Q.QUANT_TYPES[name]
    assert cache.k[0].dtype == jnp.uint8 and cache.k[0].shape == (2, 2, 64, 64 // 32 * qt.type_size)
    k, v = rows[1]
    slot = np.asarray(slot)
    # the stored bytes of each written cell are exactly the quantized row; other cells stay zero
    np.testing.assert_array_equal(np.asarray(cache.k[0][1, :, slot]), np.asarray(Q.quantize(jnp.asarray(k), name)))
    np.testing.assert_array_equal(np.asarray(cache.v[0][1, :, slot]), np.asarray(Q.quantize(jnp.asarray(v), name)))
    others = np.setdiff1d(np.arange(64), slot)
    assert not np.asarray(cache.k[0])[:, :, others].any()
    vk, vv = kvjax.view(cache, 1, 64)
    assert vk.dtype == jnp.float32 and vk.shape == (2, 64, 64)
    np.testing.assert_array_equal(
        np.asarray(vk[:, slot]).transpose(1, 0, 2), np.asarray(Q.dequantize(Q.quantize(jnp.asarray(k), name), name))
    )


def test_sizes_are_real_bytes():
    cfg = _cfg("q8_0", "q4_0")
    assert kvjax.size_k_bytes(cfg) == 2 * 2 * 64 * 2 * 34
    assert kvjax.size_v_bytes(cfg) == 2 * 2 * 64 * 2 * 18
    cache = kvjax.init(cfg)
    assert kvjax.size_k_bytes(cfg) == sum(x.nbytes for x in cache.k)
    assert kvjax.size_v_bytes(cfg) == sum(x.nbytes for x in cache.v)


def test_head_dim_not_multiple_of_block_is_refused():
    with pytest.raises(ValueError, match="head_dim=48"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=48, k_dtype="q8_0")
    with pytest.raises(ValueError, match="head_dim_v=16"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=64, head_dim_v=16, v_dtype="q4_0")
    kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=48, v_dtype="float16")
    with pytest.raises(ValueError, match="q3_k"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=64, k_dtype="q3_k")


@pytest.mark.parametrize("kt,vt", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q5_1", "float16")])
def test_attention_equals_attention_over_dequantized_values(kt, vt):
    """Quantized attention = float attention over the dequantized K/V (dequantized chunk by chunk);
    and within a bound of attention over the unquantized K/V."""
    n = 40
    cfg_q = _cfg(kt, vt, size=128, padding=32)
    cache_q, ub, slot, rows = _fill(cfg_q, n)
    cfg_f = _cfg("float32", "float32", size=128, padding=32)
    cache_f, _, _, _ = _fill(cfg_f, n)
    cache_d = kvjax.init(cfg_f)
    cache_d, _, _ = kvjax.find_slot(cache_d, ub)
    for il in range(2):
        k, v = rows[il]
        kd = Q.from_storage(Q.to_storage(jnp.asarray(k), kt), kt) if kt in QTYPES else jnp.asarray(k, kt)
        vd = Q.from_storage(Q.to_storage(jnp.asarray(v), vt), vt) if vt in QTYPES else jnp.asarray(v, vt)
        cache_d = kvjax.write(cache_d, il, jnp.asarray(slot), kd.astype(jnp.float32), vd.astype(jnp.float32))
    q = jnp.asarray(np.random.default_rng(9).standard_normal((ub.length, 4, 64)).astype(np.float32))
    for n_kv in (64, 128):
        mask = kvjax.kq_mask(cache_q, ub, n_kv)
        for il in range(2):
            out_q = kvjax.attention(q, cache_q, il, mask)
            out_d = kvjax.attention(q, cache_d, il, mask)
            out_f = kvjax.attention(q, cache_f, il, mask)
            np.testing.assert_allclose(np.asarray(out_q), np.asarray(out_d), atol=2e-6, rtol=1e-5)
            # measured max |out_q - out_f| (unit normal K/V/q, D=64): 0.02, 0.35, 0.19, 0.18
            bound = {("q8_0", "q8_0"): 0.03, ("q4_0", "q4_0"): 0.5, ("q8_0", "q4_0"): 0.3, ("q5_1", "float16"): 0.3}[
                kt, vt
            ]
            assert float(jnp.max(jnp.abs(out_q[:n] - out_f[:n]))) < bound


def test_attention_chunks_over_quantized_window():
    """A window larger than one chunk (several online-softmax steps) reads the blocks per chunk."""
    from kvjax.attn import _attention as A

    cfg = kvjax.CacheConfig(
        size=2048, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=32, k_dtype="q8_0", v_dtype="q8_0", padding=256
    )
    n = 1500
    ub = kvjax.make_ubatch(list(range(n)), [[0]] * n)
    cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((n, 1, 32)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((n, 1, 32)).astype(np.float32))
    slot = np.asarray(slot)
    t = slot.shape[0]
    k = jnp.pad(k, ((0, t - n), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, t - n), (0, 0), (0, 0)))
    cache = kvjax.write(cache, 0, slot, k, v)
    k, v = k[:n], v[:n]
    ub1 = kvjax.make_ubatch([n - 1], [[0]])
    mask = kvjax.kq_mask(cache, ub1, 2048)
    assert A.chunk_size(2048, 1, 1, 256) < 2048
    q = jnp.asarray(rng.standard_normal((ub1.length, 1, 32)).astype(np.float32))
    out = kvjax.attention(q, cache, 0, mask)
    kd, vd = kvjax.view(cache, 0, 2048)
    s = (kd[0, :n] @ q[0, 0]) / np.sqrt(32)
    ref = jax.nn.softmax(s) @ vd[0, :n]
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(ref), atol=1e-5)
    # the jitted program never materialises a float32 copy of the whole window
    hlo = A._attention.lower(
        q,
        cache,
        mask,
        None,
        np.float32(1 / np.sqrt(32)),
        layer=0,
        n_kv=2048,
        chunk=A.chunk_size(2048, 1, 1, 256),
        return_lse=False,
    ).as_text()
    assert "f32[1,2048,32]" not in hlo and "f32[2048,32]" not in hlo and "f32[1,1,2048,32]" not in hlo


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_k_shift_is_dequantize_rotate_quantize_per_cell(name):
    cfg = _cfg(name, "q8_0")
    cache, ub, slot, rows = _fill(cfg, 10)
    before = [np.asarray(x) for x in cache.k]
    cache2 = kvjax.seq_add(cache, 0, 4, 10, 3)  # cells 4..9 shift by +3, cells 0..3 untouched
    shifted = kvjax.update(cache2)
    after = np.asarray(shifted.k[0])
    slot = np.asarray(slot)
    for il in range(2):
        x = Q.dequantize(jnp.asarray(before[0][il][:, slot]), name)  # [H, n, D]
        delta = np.where(np.arange(10) >= 4, 3, 0)
        rot = kvjax.rope(x.transpose(1, 0, 2), jnp.asarray(delta), cfg.rope[0])  # [n, H, D]
        expect = np.asarray(Q.quantize(rot, name)).transpose(1, 0, 2)
        got = after[il][:, slot]
        np.testing.assert_array_equal(got[:, 4:], expect[:, 4:])
        np.testing.assert_array_equal(got[:, :4], before[0][il][:, slot[:4]])  # not requantized
    assert int(jnp.max(jnp.abs(shifted.cells.delta))) == 0
    # accuracy cost: shifted quantized K vs the exact rotation of the original float K
    k, _ = rows[0]
    via = Q.dequantize(jnp.asarray(after[0][:, slot]).transpose(1, 0, 2), name)
    exact = kvjax.rope(jnp.asarray(k), jnp.asarray(np.where(np.arange(10) >= 4, 3, 0)), cfg.rope[0])
    err = float(jnp.max(jnp.abs(via[4:] - exact[4:])))
    assert err < {"q8_0": 0.05, "q4_0": 0.8}[name]


@pytest.mark.parametrize("move", ["defrag", "compact"])
def test_defrag_and_compact_move_blocks(move):
    cfg = _cfg("q4_0", "q8_0", size=64)
    cache, ub, slot, rows = _fill(cfg, 20)
    before_k, before_v = np.asarray(cache.k[0]), np.asarray(cache.v[0])
    cache, _ = kvjax.seq_rm(cache, 0, 2, 12)  # hole at cells 2..11
    cache = getattr(kvjax, move)(cache)
    pos = np.asarray(cache.cells.pos)
    for c in range(64):
        p = pos[c]
        if p >= 0:  # the cell holding position p holds the bytes written for position p
            np.testing.assert_array_equal(np.asarray(cache.k[0])[:, :, c], before_k[:, :, p])
            np.testing.assert_array_equal(np.asarray(cache.v[0])[:, :, c], before_v[:, :, p])
    assert (pos[:10] >= 0).all() and (pos[10:] < 0).all()  # compacted


def test_write_jit_only_written_rows():
    cfg = _cfg("q8_0", "q8_0")
    cache, ub, slot, rows = _fill(cfg, 3)
    k0 = np.asarray(cache.k[0])
    new = jnp.full((1, 2, 64), 2.0)
    cache2 = jax.jit(kvjax.write, static_argnums=1)(cache, 0, jnp.array([7]), new, new)
    k1 = np.asarray(cache2.k[0])
    changed = np.nonzero((k1 != k0).any(axis=(0, 1, 3)))[0]
    assert changed.tolist() == [7]


def test_update_under_jit_shifts_quantized_k_like_eager():
    cfg = _cfg("q4_0", "q8_0")
    cache, _, slot, _ = _fill(cfg, 10)
    cache = kvjax.seq_add(cache, 0, 2, 10, -2)
    eager = kvjax.update(cache)
    traced = jax.jit(kvjax.update)(cache)
    for a, b in zip(eager.k + eager.v, traced.k + traced.v):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(eager.k[0]), np.asarray(cache.k[0]))


def test_engine_context_shift_with_q8_0():
    """Generation past n_ctx (context shift: seq_rm + seq_add + K-shift of quantized K) runs."""
    from flax import nnx
    from kvjax import Engine, generate
    from kvjax.nn import Llama, LlamaConfig

    mcfg = LlamaConfig(vocab_size=64, d_model=64, n_layer=1, n_heads=2, n_kv_heads=1)  # head size 32
    cache = kvjax.init(mcfg.cache_config(size=64, n_seq_max=1, padding=32, k_dtype="q8_0", v_dtype="q8_0"))
    out = generate(
        Engine(Llama(mcfg, rngs=nnx.Rngs(0)), cache),
        [[1, 2, 3, 4]],
        max_new_tokens=80,
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=0),
        n_ctx=40,
    )
    assert out.context_shifts >= 1 and len(out.tokens[0]) == 80


def test_float16_storage_widens_exactly():
    """Every float16 bit pattern: the integer-op widening equals numpy's conversion bit for bit (-0.0 included)."""
    bits = np.arange(65536, dtype=np.uint16).view(np.float16)
    want = bits.astype(np.float32)
    nan = np.isnan(want)
    for widen in (Q.float16_to_float32, jax.jit(Q.float16_to_float32), lambda x: Q.from_storage(x, "float16")):
        got = np.asarray(widen(jnp.asarray(bits)))
        assert got.dtype == np.float32 and np.array_equal(np.isnan(got), nan) and nan.sum() == 2046
        np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


@pytest.mark.parametrize("jitted", [False, True])
def test_float16_cache_attends_like_float32_holding_the_same_values(jitted):
    """Attention over float16 K/V gives the bits of float32 K/V holding the same values (subnormals, zeros)."""
    rng = np.random.default_rng(5)
    n = 64
    k = rng.standard_normal((n, 2, 64)).astype(np.float16)
    v = rng.standard_normal((n, 2, 64)).astype(np.float16)
    k[:, :, :8] = np.float16(3e-6)  # float16 subnormals
    v[::3, :, 8:16] = np.float16(-0.0)
    q = jnp.asarray(rng.standard_normal((n, 4, 64)), jnp.float32)
    ub = kvjax.make_ubatch(list(range(n)), [[0]] * n)
    outs = []
    for dtype in ("float16", "float32"):
        cache = kvjax.init(
            kvjax.CacheConfig(size=128, n_seq_max=1, n_layer=1, n_kv_heads=2, head_dim=64, k_dtype=dtype, v_dtype=dtype)
        )
        cache, slot, _ = kvjax.find_slot(cache, ub)
        cache = kvjax.write(cache, 0, slot, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
        attend = jax.jit(kvjax.attention, static_argnums=2) if jitted else kvjax.attention
        outs.append(np.asarray(attend(q, cache, 0, kvjax.kq_mask(cache, ub, 128))))
    np.testing.assert_array_equal(outs[0], outs[1])
