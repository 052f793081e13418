"""Attention over the cache against attention over rows gathered by a naive loop."""

from __future__ import annotations

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.helpers import fill, no_recompile

MASKS = [
    dict(causal=True),
    dict(causal=False),
    dict(causal=True, alibi=True),
    dict(causal=True, swa_type="standard", n_swa=4),
    dict(causal=True, swa_type="chunked", n_swa=8),
    dict(causal=False, swa_type="symmetric", n_swa=6),
]


def _config(**kw):
    # layer 0, 2: 2 kv heads of size 16 (V size 8); layer 1: 1 kv head of size 8; layer 3 not cached
    args = dict(size=64, n_seq_max=4, n_layer=4, n_kv_heads=(2, 1, 2, 2), head_dim=(16, 8, 16, 16),
                head_dim_v=(8, 8, 8, 8), padding=16, layer_filter=[0, 1, 2])
    args.update(kw)
    return kvjax.CacheConfig(**args)


def _scene(dtype="float32", seed=0):
    """Three sequences: 1 shares a prefix of 0 (seq_cp), holes, a ubatch of 0 and 2 placed last."""
    cfg = _config(k_dtype=dtype, v_dtype=dtype)
    cache = fill(kvjax.init(cfg), list(range(20)), [[0]] * 20)
    cache = kvjax.seq_cp(cache, 0, 1, 0, 8)
    cache = fill(cache, list(range(8, 14)), [[1]] * 6)
    cache, _ = kvjax.seq_rm(cache, 0, 10, 13)   # holes
    cache = fill(cache, list(range(5)), [[2]] * 5)
    ub = kvjax.make_ubatch([20, 21, 14, 5, 6], [[0], [0], [1], [2, 1], [2]], length=8)
    cache, slot, ok = kvjax.find_slot(cache, ub)
    assert bool(ok)
    rng = np.random.default_rng(seed)
    for il in cfg.cached_layers:
        h, d, dv = cfg.n_kv_heads[il], cfg.head_dim[il], cfg.head_dim_v[il]
        k = jnp.asarray(rng.standard_normal((cfg.size, h, d)), jnp.float32)
        v = jnp.asarray(rng.standard_normal((cfg.size, h, dv)), jnp.float32)
        cache = kvjax.write(cache, il, jnp.arange(cfg.size), k, v)
    return cache, ub


def naive_attention(q, cache, layer, mask, scale, bias=None):
    """Loop over tokens and query heads; gather the visible cells' rows one by one."""
    cfg = cache.config
    q = np.asarray(q, np.float64)
    mask = np.asarray(mask)
    mask = np.where(mask, 0.0, -np.inf) if mask.dtype == bool else mask.astype(np.float64)
    n_kv = mask.shape[1]
    g, i = cfg.locate(layer)
    k_all = np.asarray(cache.k[g][i], np.float64)  # [H, C, D]
    v_all = np.asarray(cache.v[g][i], np.float64)
    t_len, hq, _ = q.shape
    group = hq // k_all.shape[0]
    out = np.zeros((t_len, hq, v_all.shape[-1]))
    lse = np.full((t_len, hq), -np.inf)
    for t in range(t_len):
        for j in range(hq):
            scores, rows = [], []
            for c in range(n_kv):
                extra = 0.0 if bias is None else float(np.broadcast_to(bias, (hq, t_len, n_kv))[j, t, c])
                if mask[t, c] == -np.inf:
                    continue
                scores.append(q[t, j] @ k_all[j // group, c] * scale + mask[t, c] + extra)
                rows.append(v_all[j // group, c])
            if scores:
                s = np.asarray(scores)
                m = s.max()
                w = np.exp(s - m)
                out[t, j] = (w[:, None] * np.asarray(rows)).sum(0) / w.sum()
                lse[t, j] = m + math.log(w.sum())
    return out, lse


@pytest.mark.parametrize("layer,hq", [(0, 2), (0, 8), (1, 3), (2, 4)])
@pytest.mark.parametrize("mask_kind", range(len(MASKS)), ids=lambda i: "-".join(f"{k}={v}" for k, v in MASKS[i].items()))
def test_attention_matches_naive_gather(layer, hq, mask_kind):
    cache, ub = _scene()
    cfg = cache.config
    d = cfg.head_dim[layer]
    n_kv = 48 if mask_kind % 2 else 64  # two windows
    mask = kvjax.kq_mask(cache, ub, n_kv, **MASKS[mask_kind])
    q = jnp.asarray(np.random.default_rng(layer + hq).standard_normal((8, hq, d)), jnp.float32)
    out, lse = kvjax.attention(q, cache, layer, mask, return_lse=True)
    ref_out, ref_lse = naive_attention(q, cache, layer, mask, 1 / math.sqrt(d))
    assert out.shape == (8, hq, cfg.head_dim_v[layer]) and lse.shape == (8, hq)
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    # the padded rows (5..7) see nothing: zeros and -inf, never NaN
    assert not np.asarray(out)[5:].any() and np.isneginf(np.asarray(lse)[5:]).all()


@pytest.mark.parametrize("max_chunk,n_kv", [(16, 64), (32, 48), (32, 64)])
def test_chunked_loop_matches(monkeypatch, max_chunk, n_kv):
    """Several online-softmax steps, also when the chunk does not divide the window (48 / 32)."""
    module = importlib.import_module("kvjax.attn._attention")
    monkeypatch.setattr(module, "MAX_CHUNK", max_chunk)
    monkeypatch.setattr(module, "SCORE_BLOCK_BYTES", 4 * 2 * 32 * max_chunk)  # [H=2, R=32, chunk] floats
    assert module.chunk_size(n_kv, 2, 32, 16) == max_chunk
    cache, ub = _scene()
    q = jnp.asarray(np.random.default_rng(5).standard_normal((8, 4, 16)), jnp.float32)
    for kind in (dict(causal=True), dict(causal=False, swa_type="symmetric", n_swa=6)):
        mask = kvjax.kq_mask(cache, ub, n_kv, **kind)
        bias = jnp.asarray(np.random.default_rng(6).standard_normal((4, 1, n_kv)), jnp.float32)
        out, lse = kvjax.attention(q, cache, 0, mask, bias=bias, return_lse=True)
        ref_out, ref_lse = naive_attention(q, cache, 0, mask, 0.25, bias=np.asarray(bias))
        np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    # a row whose only visible cell is in the last (clamped) chunk, and a row that sees nothing
    mask = jnp.full((8, n_kv), -jnp.inf).at[0, n_kv - 1].set(0.0)
    out = kvjax.attention(q, cache, 0, mask)
    np.testing.assert_allclose(np.asarray(out)[0, 0], np.asarray(cache.v[0][0, 0, n_kv - 1]), rtol=1e-6)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out)[1:].any()


@pytest.mark.parametrize("max_chunk,n_kv", [(16, 64), (32, 48)])
def test_chunks_no_row_sees_are_skipped_exactly(monkeypatch, max_chunk, n_kv):
    """Only the chunks between the first and last visible column run; the result is bit-identical.

    The cells outside that span hold NaN; spans start and end inside chunks, and with 48 cells in
    chunks of 32 the last chunk is clamped onto the one before. That the NaN chunks are not read
    shows in the gradient: a masked NaN K that is read gives a NaN gradient (0 * NaN), a skipped
    one does not. Jitted, vmapped and differentiated like the full loop.
    """
    module = importlib.import_module("kvjax.attn._attention")
    monkeypatch.setattr(module, "MAX_CHUNK", max_chunk)
    monkeypatch.setattr(module, "SCORE_BLOCK_BYTES", 4 * 2 * 32 * max_chunk)
    assert module.chunk_size(n_kv, 2, 32, 16) == max_chunk
    cache, ub = _scene()
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    qr = q.reshape(8, 2, 2, 16).transpose(1, 2, 0, 3).reshape(2, 16, 16) * 0.25   # rows (g, t) per kv head

    def attend(qr, cache, mask, skip):
        return module._attend(qr, cache.k[0], cache.v[0], jnp.int32(0), n_kv, mask, None, max_chunk, 2,
                              skip_masked=skip)

    cases = [(20, 37), (0, 5), (n_kv - 3, n_kv), (33, 34), (0, n_kv), (10, 10)]   # [lo, hi) some row sees
    for lo, hi in cases:
        outside = np.r_[0:lo, hi:cache.config.size]
        poisoned = kvjax.write(cache, 0, jnp.asarray(outside), jnp.full((len(outside), 2, 16), jnp.nan),
                               jnp.full((len(outside), 2, 8), jnp.nan))
        visible = rng.random((8, n_kv)) < 0.5
        visible[:, :lo] = visible[:, hi:] = False
        if hi > lo:
            visible[rng.integers(8), lo] = visible[rng.integers(8), hi - 1] = True
        mask = jnp.where(jnp.asarray(visible), 0.0, -jnp.inf)
        first, stop = (lo // max_chunk, -(-hi // max_chunk)) if hi > lo else (n_kv // max_chunk, 0)
        assert [int(x) for x in module.chunk_range(mask, max_chunk)] == [first, stop]
        out, lse = kvjax.attention(q, poisoned, 0, mask, return_lse=True)
        ref_out, ref_lse = naive_attention(q, poisoned, 0, mask, 0.25)
        np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
        # the loop over every chunk gives the same bits (masked cells are neutral either way), and so
        # does each of a vmapped batch
        full, skipped = (jax.jit(attend, static_argnums=3)(qr, poisoned, mask, s) for s in (False, True))
        batched = jax.vmap(attend, in_axes=(0, None, 0, None))(jnp.stack([qr, qr[::-1]]), poisoned,
                                                               jnp.stack([mask, mask[::-1]]), True)
        for a, b, c in zip(full, skipped, batched):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(c[0]), np.asarray(b))
        # gradients: with NaN bytes only in the chunks outside [first, stop), the full loop reads them
        # (a NaN gradient), the skipping loop does not
        read = np.zeros(cache.config.size, bool)
        for i in range(first, stop):
            start = min(i * max_chunk, n_kv - max_chunk)
            read[start:start + max_chunk] = True
        if not read[:n_kv].all():
            unread = np.flatnonzero(~read)
            unread_nan = kvjax.write(cache, 0, jnp.asarray(unread), jnp.full((len(unread), 2, 16), jnp.nan),
                                     jnp.full((len(unread), 2, 8), jnp.nan))
            grads = [jax.grad(lambda qr, s=s: jnp.sum(attend(qr, unread_nan, mask, s)[0]))(qr) for s in (False, True)]
            assert np.isnan(np.asarray(grads[0])).any() and np.isfinite(np.asarray(grads[1])).all()
        clean = [jax.grad(lambda qr, s=s: jnp.sum(attend(qr, cache, mask, s)[0] ** 2))(qr) for s in (False, True)]
        np.testing.assert_allclose(np.asarray(clean[1]), np.asarray(clean[0]), rtol=1e-6, atol=1e-6)
    # the public function differentiates through the skipping loop (dynamic loop bounds could not)
    middle = jnp.full((8, n_kv), -jnp.inf).at[:, 20:37].set(0.0)
    grad = jax.grad(lambda q: jnp.sum(kvjax.attention(q, cache, 0, middle) ** 2))(q)
    assert grad.shape == q.shape and np.isfinite(np.asarray(grad)).all() and np.asarray(grad).any()


def test_boolean_mask_scale_and_bias():
    cache, ub = _scene()
    q = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4, 16)), jnp.float32)
    visible = kvjax.kq_mask_bool(cache, ub, 64)
    additive = kvjax.kq_mask(cache, ub, 64)
    np.testing.assert_allclose(np.asarray(kvjax.attention(q, cache, 2, visible)),
                               np.asarray(kvjax.attention(q, cache, 2, additive)), rtol=1e-6, atol=1e-6)
    # ALiBi-like bias per query head, and an explicit scale
    slopes = jnp.asarray([0.5, 0.25, 0.125, 0.0625])[:, None, None]
    dist = kvjax.kq_mask(cache, ub, 64, alibi=True)
    bias = slopes * jnp.where(jnp.isfinite(dist), dist, 0.0)[None]
    out, lse = kvjax.attention(q, cache, 2, visible, scale=0.3, bias=bias, return_lse=True)
    ref_out, ref_lse = naive_attention(q, cache, 2, visible, 0.3, bias=np.asarray(bias))
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    # biases of lower rank broadcast the same way: [T, N] for all heads, [Hq, 1, 1] per head
    for small in (jnp.where(jnp.isfinite(dist), dist, 0.0) * 0.1, slopes):
        got = kvjax.attention(q, cache, 2, visible, bias=small)
        ref, _ = naive_attention(q, cache, 2, visible, 0.25, bias=np.asarray(small))
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)


def test_float16_storage():
    cache, ub = _scene(dtype="float16")
    mask = kvjax.kq_mask(cache, ub, 64)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((8, 4, 16)), jnp.float32)
    out = kvjax.attention(q, cache, 0, mask)
    ref_out, _ = naive_attention(q, cache, 0, mask, 0.25)  # the reference reads the same f16 values
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-4, atol=1e-4)


def test_fully_masked_rows_are_zero():
    cache, _ = _scene()
    mask = jnp.full((2, 16), -jnp.inf).at[0, 3].set(0.0)
    out, lse = kvjax.attention(jnp.ones((2, 2, 16)), cache, 0, mask, return_lse=True)
    assert np.isfinite(np.asarray(out)).all() and not np.asarray(out)[1].any()
    np.testing.assert_allclose(np.asarray(out)[0, 0], np.asarray(cache.v[0][0, 0, 3]), rtol=1e-6)
    assert np.isneginf(np.asarray(lse)[1]).all()


def test_jitted_and_no_recompile():
    cache, ub = _scene()
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    mask = kvjax.kq_mask(cache, ub, 64)
    step = jax.jit(lambda q, c, m: kvjax.attention(q, c, 0, m, return_lse=True))
    for a, b in zip(step(q, cache, mask), kvjax.attention(q, cache, 0, mask, return_lse=True)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    kvjax.attention(q, cache, 0, mask, scale=0.5).block_until_ready()
    for seed in range(3):
        new_q = jnp.asarray(np.random.default_rng(seed).standard_normal((8, 4, 16)), jnp.float32)
        new_cache, _ = kvjax.seq_rm(cache, seed % 3, seed, seed + 4)
        new_mask = kvjax.kq_mask(new_cache, ub, 64, causal=True)
        with no_recompile():
            jax.block_until_ready(step(new_q, new_cache, new_mask))
            kvjax.attention(new_q, new_cache, 0, new_mask).block_until_ready()
            kvjax.attention(new_q, new_cache, 0, new_mask, scale=0.1 * (seed + 1)).block_until_ready()


def test_bad_input():
    cache, ub = _scene()
    mask = kvjax.kq_mask(cache, ub, 64)
    q = jnp.zeros((8, 4, 16))
    with pytest.raises(ValueError, match="q has 3 query heads: allowed a positive multiple of the layer's n_kv_heads=2"):
        kvjax.attention(jnp.zeros((8, 3, 16)), cache, 0, mask)
    with pytest.raises(ValueError, match="head size 8: allowed the layer's head_dim=16"):
        kvjax.attention(jnp.zeros((8, 4, 8)), cache, 0, mask)
    with pytest.raises(ValueError, match="n_kv=40 is out of range"):
        kvjax.attention(q, cache, 0, mask[:, :40])
    with pytest.raises(ValueError, match="n_kv=80 is out of range"):
        kvjax.attention(q, cache, 0, jnp.zeros((8, 80)))
    with pytest.raises(ValueError, match=r"mask has shape \(4, 64\)"):
        kvjax.attention(q, cache, 0, mask[:4])
    with pytest.raises(ValueError, match="mask has dtype int32"):
        kvjax.attention(q, cache, 0, jnp.zeros((8, 64), jnp.int32))
    with pytest.raises(ValueError, match="layer=3 is not a cached layer"):
        kvjax.attention(q, cache, 3, mask)
    with pytest.raises(ValueError, match="bias has shape"):
        kvjax.attention(q, cache, 0, mask, bias=jnp.zeros((3, 8, 64)))
    with pytest.raises(ValueError, match="allowed a floating"):
        kvjax.attention(jnp.zeros((8, 4, 16), jnp.int32), cache, 0, mask)
    with pytest.raises(ValueError, match="scale="):
        kvjax.attention(q, cache, 0, mask, scale=float("nan"))
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.attention(q, cache.cells, 0, mask)
