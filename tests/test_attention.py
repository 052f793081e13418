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
    args = dict(
        size=64,
        n_seq_max=4,
        n_layer=4,
        n_kv_heads=(2, 1, 2, 2),
        head_dim=(16, 8, 16, 16),
        head_dim_v=(8, 8, 8, 8),
        padding=16,
        layer_filter=[0, 1, 2],
    )
    args.update(kw)
    return kvjax.CacheConfig(**args)


def _scene(dtype="float32", seed=0):
    """Three sequences: 1 shares a prefix of 0 (seq_cp), holes, a ubatch of 0 and 2 placed last."""
    cfg = _config(k_dtype=dtype, v_dtype=dtype)
    cache = fill(kvjax.init(cfg), list(range(20)), [[0]] * 20)
    cache = kvjax.seq_cp(cache, 0, 1, 0, 8)
    cache = fill(cache, list(range(8, 14)), [[1]] * 6)
    cache, _ = kvjax.seq_rm(cache, 0, 10, 13)  # holes
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
@pytest.mark.parametrize(
    "mask_kind", range(len(MASKS)), ids=lambda i: "-".join(f"{k}={v}" for k, v in MASKS[i].items())
)
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


@pytest.mark.parametrize("max_chunk,n_kv", [(16, 64), pytest.param(32, 48, marks=pytest.mark.slow)])
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
    qr = q.reshape(8, 2, 2, 16).transpose(1, 2, 0, 3).reshape(2, 16, 16) * 0.25  # rows (g, t) per kv head

    def attend(qr, cache, mask, skip):
        return module._attend(
            qr, cache.k[0], cache.v[0], jnp.int32(0), n_kv, mask, None, max_chunk, 2, skip_masked=skip
        )

    cases = [(20, 37), (0, 5), (n_kv - 3, n_kv), (33, 34), (0, n_kv), (10, 10)]  # [lo, hi) some row sees
    for lo, hi in cases:
        outside = np.r_[0:lo, hi : cache.config.size]
        poisoned = kvjax.write(
            cache,
            0,
            jnp.asarray(outside),
            jnp.full((len(outside), 2, 16), jnp.nan),
            jnp.full((len(outside), 2, 8), jnp.nan),
        )
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
        batched = jax.vmap(attend, in_axes=(0, None, 0, None))(
            jnp.stack([qr, qr[::-1]]), poisoned, jnp.stack([mask, mask[::-1]]), True
        )
        for a, b, c in zip(full, skipped, batched):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            np.testing.assert_array_equal(np.asarray(c[0]), np.asarray(b))
        # gradients: with NaN bytes only in the chunks outside [first, stop), the full loop reads them
        # (a NaN gradient), the skipping loop does not
        read = np.zeros(cache.config.size, bool)
        for i in range(first, stop):
            start = min(i * max_chunk, n_kv - max_chunk)
            read[start : start + max_chunk] = True
        if not read[:n_kv].all():
            unread = np.flatnonzero(~read)
            unread_nan = kvjax.write(
                cache,
                0,
                jnp.asarray(unread),
                jnp.full((len(unread), 2, 16), jnp.nan),
                jnp.full((len(unread), 2, 8), jnp.nan),
            )
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
    np.testing.assert_allclose(
        np.asarray(kvjax.attention(q, cache, 2, visible)),
        np.asarray(kvjax.attention(q, cache, 2, additive)),
        rtol=1e-6,
        atol=1e-6,
    )
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
    with pytest.raises(
        ValueError, match="q has 3 query heads: allowed a positive multiple of the layer's n_kv_heads=2"
    ):
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


def _side_by_side(n_seq=8, prompt=3, steps=5, shared=0, **config):
    """``n_seq`` sequences decoding side by side in one unified cache, the ubatch of their next tokens.

    Each sequence's prompt is placed on its own, then ``steps`` ubatches of one token per sequence
    interleave their cells; with ``shared`` the first ``shared`` cells of sequence 0 are also
    sequence 1's (``seq_cp``): columns two rows see. ``config`` overrides :func:`_config`'s arguments.
    """
    cfg = _config(**{"size": 128, "n_seq_max": n_seq, "layer_filter": [0, 1, 2], **config})
    cache = kvjax.init(cfg)
    for s in range(n_seq):
        cache = fill(cache, list(range(prompt)), [[s]] * prompt)
    if shared:
        cache, _ = kvjax.seq_rm(cache, 1, -1, -1)
        cache = kvjax.seq_cp(cache, 0, 1, 0, shared)
    for p in range(prompt, prompt + steps):
        cache = fill(cache, [p] * n_seq, [[s] for s in range(n_seq)])
    ub = kvjax.make_ubatch([prompt + steps] * n_seq, [[s] for s in range(n_seq)])
    cache, slot, ok = kvjax.find_slot(cache, ub)
    assert bool(ok)
    rng = np.random.default_rng(11)
    for il in cfg.cached_layers:
        h, d, dv = cfg.n_kv_heads[il], cfg.head_dim[il], cfg.head_dim_v[il]
        cache = kvjax.write(
            cache,
            il,
            jnp.arange(cfg.size),
            jnp.asarray(rng.standard_normal((cfg.size, h, d)), jnp.float32),
            jnp.asarray(rng.standard_normal((cfg.size, h, dv)), jnp.float32),
        )
    return cache, ub


def _retrace(monkeypatch, module, name, value):
    """Set a module attribute that ``_attention`` reads while tracing, and drop its compiled programs."""
    monkeypatch.setattr(module, name, value)
    module._attention.clear_cache()


@pytest.fixture(autouse=True)
def _no_programs_traced_with_patched_constants():
    """After each test, no ``_attention`` program traced under a test's patched constants is reused."""
    yield
    importlib.import_module("kvjax.attn._attention")._attention.clear_cache()


@pytest.mark.parametrize("shared", [0, 6])
@pytest.mark.parametrize("max_chunk,n_kv", [(16, 128), (1024, 128), (32, 80)])
def test_owned_chunks_match_the_dense_step(monkeypatch, shared, max_chunk, n_kv):
    """A batch decoding side by side: each column is one row's, and the owned step gives the dense answer.

    Against the naive loop and the dense loop, with GQA, a bias per query head and token, softcap,
    lse, chunks that are owned, shared (a ``seq_cp`` prefix two rows see) or skipped, and a last
    chunk clamped onto the one before (80 cells in chunks of 32: cells 48-63 seen by two steps); that the
    owned step runs shows by swapping it for one that adds 1000 to the output; gradients agree.
    """
    module = importlib.import_module("kvjax.attn._attention")
    _retrace(monkeypatch, module, "MAX_CHUNK", max_chunk)
    _retrace(monkeypatch, module, "OWNED_MIN_TOKENS", 8)  # the 8 rows of this scene
    cache, ub = _side_by_side(shared=shared)
    rng = np.random.default_rng(12)
    q = jnp.asarray(rng.standard_normal((8, 4, 16)), jnp.float32)
    mask = kvjax.kq_mask(cache, ub, n_kv)
    viewers = np.sum(np.asarray(mask) > -np.inf, axis=0)
    assert viewers.max() == (2 if shared else 1) and (viewers == 1).sum() >= 40
    bias = jnp.asarray(rng.standard_normal((4, 8, n_kv)), jnp.float32)
    cases = (dict(), dict(bias=bias), dict(bias=bias[:, :1]), dict(softcap=0.7), dict(scale=0.5))
    owned = [kvjax.attention(q, cache, 0, mask, return_lse=True, **kw) for kw in cases]
    _retrace(monkeypatch, module, "OWNED_MIN_TOKENS", 9)  # the dense loop only
    dense = [kvjax.attention(q, cache, 0, mask, return_lse=True, **kw) for kw in cases]
    for kw, (out, lse), (dense_out, dense_lse) in zip(cases, owned, dense):
        if "softcap" not in kw:
            ref_out, ref_lse = naive_attention(
                q, cache, 0, mask, kw.get("scale", 0.25), bias=None if "bias" not in kw else np.asarray(kw["bias"])
            )
            np.testing.assert_allclose(np.asarray(out), ref_out, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out), np.asarray(dense_out), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(dense_lse), rtol=1e-5, atol=1e-5)
    loss = lambda q: jnp.sum(kvjax.attention(q, cache, 0, mask, bias=bias) ** 2)
    dense_grad = jax.grad(loss)(q)
    _retrace(monkeypatch, module, "OWNED_MIN_TOKENS", 8)
    # vmapped (each chunk's switch becomes a select over its branches): each query set's own answer
    batched = jax.vmap(lambda q: kvjax.attention(q, cache, 0, mask))(jnp.stack([q, -q]))
    np.testing.assert_allclose(np.asarray(batched[0]), np.asarray(owned[0][0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(batched[1]), np.asarray(kvjax.attention(-q, cache, 0, mask)), rtol=1e-5, atol=1e-5
    )
    # the owned step is what ran: a marked one changes the rows it served, the dense ones not
    real = module._owned_step
    _retrace(
        monkeypatch, module, "_owned_step", lambda *a: (lambda m, l, o: (m, l, o + 1000.0 * l[..., None]))(*real(*a))
    )
    marked = np.asarray(kvjax.attention(q, cache, 0, mask))
    _retrace(monkeypatch, module, "_owned_step", real)
    moved = np.any(np.abs(marked - np.asarray(owned[0][0])) > 100, axis=(1, 2))
    # the rows that see a column of a chunk where no column has two viewers (the shared prefix's
    # chunk runs dense; in one chunk for the whole window with a shared prefix, nothing is owned; the
    # clamped last step owns only the columns no earlier step covered)
    chunk = min(max_chunk, n_kv)
    sees = np.asarray(mask) > -np.inf
    expected = np.zeros(8, bool)
    for start in range(0, n_kv, chunk):
        if viewers[start : start + chunk].max() == 1:
            expected |= sees[:, start : start + chunk].any(axis=1)
    assert expected.any() == (not (shared and chunk == n_kv))
    np.testing.assert_array_equal(moved, expected)
    # gradients through the owned chunks equal the dense loop's
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(q)), np.asarray(dense_grad), rtol=1e-4, atol=1e-5)


def test_owned_chunks_non_finite_bytes(monkeypatch):
    """As in the dense step: masked bytes never matter, a visible NaN K or V makes its row NaN."""
    _retrace(monkeypatch, importlib.import_module("kvjax.attn._attention"), "OWNED_MIN_TOKENS", 8)
    cache, ub = _side_by_side()
    q = jnp.asarray(np.random.default_rng(13).standard_normal((8, 4, 16)), jnp.float32)
    mask = kvjax.kq_mask(cache, ub, 128)
    owner = np.argmax(np.asarray(mask) > -np.inf, axis=0)
    visible = np.flatnonzero(np.any(np.asarray(mask) > -np.inf, axis=0))
    hidden = np.setdiff1d(np.arange(128), visible)
    base = np.asarray(kvjax.attention(q, cache, 0, mask))
    for value in (np.nan, np.inf):
        poisoned = kvjax.write(
            cache, 0, jnp.asarray(hidden), jnp.full((len(hidden), 2, 16), value), jnp.full((len(hidden), 2, 8), value)
        )
        np.testing.assert_array_equal(np.asarray(kvjax.attention(q, poisoned, 0, mask)), base)
    cell = visible[len(visible) // 2]
    k = np.asarray(cache.k[0][0, :, cell]).copy()
    v = np.asarray(cache.v[0][0, :, cell]).copy()
    v[0, 3] = np.nan
    bad_v = kvjax.write(cache, 0, jnp.asarray([cell]), jnp.asarray(k)[None], jnp.asarray(v)[None])
    out = np.asarray(kvjax.attention(q, bad_v, 0, mask))
    row = owner[cell]
    assert np.isnan(out[row, :2]).all() and np.isfinite(np.delete(out, row, axis=0)).all()
    k[1, 0] = np.nan
    bad_k = kvjax.write(
        cache, 0, jnp.asarray([cell]), jnp.asarray(k)[None], jnp.asarray(np.asarray(cache.v[0][0, :, cell]))[None]
    )
    out = np.asarray(kvjax.attention(q, bad_k, 0, mask))
    assert np.isnan(out[row, 2:]).all() and np.isfinite(out[row, :2]).all()
    assert np.isfinite(np.delete(out, row, axis=0)).all()


@pytest.mark.parametrize("dtype", ["float16", "q8_0"])
def test_owned_chunks_read_stored_dtypes(monkeypatch, dtype):
    """float16 and ggml-block K/V are widened chunk by chunk as in the dense step: the same answer."""
    module = importlib.import_module("kvjax.attn._attention")
    cache, ub = _side_by_side(head_dim=(32, 32, 32, 32), head_dim_v=(32, 32, 32, 32), k_dtype=dtype, v_dtype=dtype)
    q = jnp.asarray(np.random.default_rng(14).standard_normal((8, 4, 32)), jnp.float32)
    mask = kvjax.kq_mask(cache, ub, 128)
    _retrace(monkeypatch, module, "OWNED_MIN_TOKENS", 8)
    owned = kvjax.attention(q, cache, 2, mask, return_lse=True)
    _retrace(monkeypatch, module, "OWNED_MIN_TOKENS", 9)
    dense = kvjax.attention(q, cache, 2, mask, return_lse=True)
    for a, b in zip(owned, dense):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(owned[0])).all() and np.abs(np.asarray(owned[0])).max() > 0.1
