"""Learned attention sinks (gpt-oss): ``kvjax.attention(..., sinks=)`` on every attention path.

A sink is one logit per query head that joins each of its rows' softmax denominators and weighs no
value. Every path is checked against a numpy softmax over ``[scores, sink]`` (the sink column
dropped afterwards, as transformers' gpt-oss writes it): the XLA loop in one chunk and in several,
the owned-chunk step (many sequences decoding side by side), the Pallas kernel (interpreted here),
block-quantized K/V, stream slots in one loop and slot by slot; the lse includes the sink; ``-inf``
sinks equal none; jitted equals eager and new sink values do not recompile; bad sinks raise naming
the argument, and the cache is not touched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attn import _attention
from kvjax.memory import _stream_attention as _streams
from tests.helpers import no_recompile


def _reference(q, k, v, visible, scale, sinks):
    """``softmax([q k^T * scale, sink])`` without the sink column, times V; float64, per query head.

    ``q [T, Hq, D]``, ``k [N, H, D]``, ``v [N, H, Dv]``, ``visible bool[T, N]``, ``sinks [Hq]`` (or
    None). Returns ``(out [T, Hq, Dv], lse [T, Hq])``; a row that sees nothing gives 0 (and the
    sink's logit as lse).
    """
    t, hq, _ = q.shape
    group = hq // k.shape[1]
    out = np.zeros((t, hq, v.shape[-1]))
    lse = np.zeros((t, hq))
    for j in range(hq):
        s = q[:, j].astype(np.float64) @ k[:, j // group].T.astype(np.float64) * scale
        s = np.where(visible, s, -np.inf)
        sink = np.full((t, 1), -np.inf if sinks is None else float(sinks[j]))
        both = np.concatenate([s, sink], axis=1)
        top = both.max(axis=1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        e = np.exp(both - top)
        total = e.sum(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            p = np.where(total > 0, e / total, 0.0)[:, :-1]
            lse[:, j] = (np.log(total) + top)[:, 0]
        out[:, j] = p @ v[:, j // group].astype(np.float64)
    return out, lse


def _scene(n_seq=3, tokens=5, size=64, padding=16, kv_dtype="float32", n_kv_heads=2, head_dim=8, seed=0):
    """A unified cache holding ``n_seq`` sequences of ``tokens`` tokens, interleaved, with random K/V."""
    rng = np.random.default_rng(seed)
    cfg = kvjax.CacheConfig(
        size=size,
        n_seq_max=max(n_seq, 1),
        n_layer=1,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        padding=padding,
        k_dtype=kv_dtype,
        v_dtype=kv_dtype,
    )
    pos = [p for p in range(tokens) for _ in range(n_seq)]
    seqs = [[s] for _ in range(tokens) for s in range(n_seq)]
    ub = kvjax.make_ubatch(pos, seqs)
    cache, slot, ok = kvjax.find_slot(kvjax.init(cfg), ub)
    assert bool(ok)
    k = jnp.asarray(rng.normal(size=(ub.length, n_kv_heads, head_dim)) * 2, jnp.float32)
    v = jnp.asarray(rng.normal(size=(ub.length, n_kv_heads, head_dim)), jnp.float32)
    return kvjax.write(cache, 0, slot, k, v), ub


def _cells(cache, n_kv):
    """K and V of the window as the attention reads them, ``[N, H, D]`` (dequantized)."""
    return tuple(np.asarray(x, np.float64).transpose(1, 0, 2) for x in kvjax.view(cache, 0, n_kv))


SINKS = np.array([0.5, -1.0, 2.5, -jnp.inf], np.float32)  # a sink per query head; -inf is none


# the Pallas kernel reads float K/V only (pick_implementation refuses quantized K/V)
@pytest.mark.parametrize("implementation, kv_dtype", [("xla", "float32"), ("xla", "q8_0"), ("pallas", "float32")])
def test_sinks_equal_the_softmax_with_a_sink_column(implementation, kv_dtype):
    cache, ub = _scene(kv_dtype=kv_dtype, head_dim=32)
    rng = np.random.default_rng(1)
    q = rng.normal(size=(ub.length, 4, 32)).astype(np.float32)
    mask = kvjax.kq_mask_bool(cache, ub, 64)
    out, lse = kvjax.attention(
        jnp.asarray(q), cache, 0, mask, sinks=jnp.asarray(SINKS), return_lse=True, implementation=implementation
    )
    kc, vc = _cells(cache, 64)
    ref, ref_lse = _reference(q, kc, vc, np.asarray(mask), 32**-0.5, SINKS)
    valid = np.asarray(ub.valid)
    np.testing.assert_allclose(np.asarray(out)[valid], ref[valid], atol=3e-6)
    np.testing.assert_allclose(np.asarray(lse)[valid], ref_lse[valid], atol=3e-6)
    plain = np.asarray(kvjax.attention(jnp.asarray(q), cache, 0, mask, implementation=implementation))
    assert np.abs(plain[valid][:, :3] - ref[valid][:, :3]).max() > 1e-2  # the sinks change the rows
    np.testing.assert_allclose(plain[valid][:, 3], ref[valid][:, 3], atol=3e-6)  # ... but a -inf sink does not


def test_sinks_over_several_chunks_and_in_bfloat16():
    """A 2048-cell window walked in chunks (online softmax): the sink joins once, not per chunk."""
    cache, ub = _scene(n_seq=1, tokens=1500, size=2048, padding=256, n_kv_heads=1, head_dim=4, seed=3)
    assert _attention.chunk_size(2048, 1, 4 * ub.length, 256) < 2048
    q = np.random.default_rng(4).normal(size=(ub.length, 4, 4)).astype(np.float32) * 2
    mask = kvjax.kq_mask_bool(cache, ub, 2048)
    out = np.asarray(kvjax.attention(jnp.asarray(q), cache, 0, mask, sinks=jnp.asarray(SINKS)))
    rows = np.array([0, 1, 900, 1499])
    kc, vc = _cells(cache, 2048)
    ref, _ = _reference(q[rows], kc, vc, np.asarray(mask)[rows], 0.5, SINKS)
    np.testing.assert_allclose(out[rows], ref, atol=3e-5)
    # the sinks in another float dtype are taken as float32; bfloat16 queries give a bfloat16 result
    half = kvjax.attention(jnp.asarray(q, jnp.bfloat16), cache, 0, mask, sinks=jnp.asarray(SINKS, jnp.bfloat16))
    assert half.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(half, np.float32)[rows], ref, atol=0.05)


def test_sinks_on_owned_chunks():
    """16 sequences decoding side by side: the owned-chunk step runs, and gives the sinks' result."""
    n_seq = _attention.OWNED_MIN_TOKENS
    cache, _ = _scene(n_seq=n_seq, tokens=6, size=256, padding=32, n_kv_heads=2, head_dim=8, seed=5)
    ub = kvjax.make_ubatch([6] * n_seq, [[s] for s in range(n_seq)])
    cache, slot, ok = kvjax.find_slot(cache, ub)
    rng = np.random.default_rng(6)
    k, v = (jnp.asarray(rng.normal(size=(n_seq, 2, 8)), jnp.float32) for _ in range(2))
    cache = kvjax.write(cache, 0, slot, k, v)
    q = rng.normal(size=(n_seq, 4, 8)).astype(np.float32)
    mask = kvjax.kq_mask_bool(cache, ub, 256)
    assert n_seq <= cache.config.n_seq_max  # so kvjax.attention compiles the owned branch
    out = np.asarray(kvjax.attention(jnp.asarray(q), cache, 0, mask, sinks=jnp.asarray(SINKS)))
    kc, vc = _cells(cache, 256)
    ref, _ = _reference(q, kc, vc, np.asarray(mask), 8**-0.5, SINKS)
    np.testing.assert_allclose(out, ref, atol=3e-6)


@pytest.mark.parametrize("batched", [True, False])
def test_sinks_on_stream_slots(monkeypatch, batched):
    """Each slot over its own stream, the slots in one loop or one after another; a padding slot is 0."""
    monkeypatch.setattr(_streams, "ONE_LOOP_READ_FACTOR", 1e9 if batched else 0.0)
    monkeypatch.setattr(_attention, "MAX_CHUNK", 16)  # several chunks, of different counts per stream
    base = kvjax.CacheConfig(size=64, n_seq_max=4, n_layer=1, n_kv_heads=2, head_dim=8, padding=16)
    memory = kvjax.init(kvjax.StreamsConfig(base))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([(list(range(40)), [0])]))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([(list(range(3)), [2])]))
    rng = np.random.default_rng(7)
    old = tuple(jnp.asarray(rng.normal(size=(4, 1, 2, 64, 8)), jnp.float32) for _ in range(2))
    memory = memory.replace(cache=memory.cache.replace(k=(old[0],), v=(old[1],)))
    ub = kvjax.make_equal_ubatch([([40, 41], [0]), ([3, 4], [2]), ([0, 1], [3])], n_slots=4)
    memory, placement, ok = kvjax.find_slot(memory, ub)
    assert bool(ok)
    k, v = (jnp.asarray(rng.normal(size=(8, 2, 8)), jnp.float32) for _ in range(2))
    memory = memory.replace(cache=_streams.write(memory.cache, 0, placement, k, v))
    q = rng.normal(size=(8, 4, 8)).astype(np.float32)
    masks = _streams.masks(memory, ub, placement, 64)
    out = np.asarray(_streams.attention(jnp.asarray(q), memory, 0, masks, placement, ub, sinks=jnp.asarray(SINKS)))
    streams = np.asarray(_streams._slot_streams(placement, ub))
    for slot, stream in enumerate(streams[:3]):
        kc, vc = (
            np.asarray(x[stream, 0], np.float64).transpose(1, 0, 2) for x in (memory.cache.k[0], memory.cache.v[0])
        )
        rows = slice(2 * slot, 2 * slot + 2)
        visible = np.isfinite(np.asarray(masks[slot]))
        ref, _ = _reference(q[rows], kc, vc, visible, 8**-0.5, SINKS)
        np.testing.assert_allclose(out[rows], ref, atol=3e-6)
    np.testing.assert_array_equal(out[6:], 0.0)  # the padding slot


def test_fully_masked_rows_and_lse():
    """A row that sees nothing gives 0 (all the weight is the sink's) and the sink's logit as lse."""
    cache, ub = _scene()
    mask = jnp.asarray(kvjax.kq_mask_bool(cache, ub, 64)).at[0].set(False)
    q = jnp.ones((ub.length, 4, 8))
    out, lse = kvjax.attention(q, cache, 0, mask, sinks=jnp.asarray(SINKS), return_lse=True)
    np.testing.assert_array_equal(np.asarray(out)[0], 0.0)
    np.testing.assert_array_equal(np.asarray(lse)[0], SINKS)
    none, none_lse = kvjax.attention(q, cache, 0, mask, sinks=jnp.full(4, -jnp.inf), return_lse=True)
    plain, plain_lse = kvjax.attention(q, cache, 0, mask, return_lse=True)
    np.testing.assert_array_equal(np.asarray(none), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(none_lse), np.asarray(plain_lse))


def test_sinks_jitted_equal_eager_and_new_values_do_not_recompile():
    cache, ub = _scene()
    q = jnp.asarray(np.random.default_rng(8).normal(size=(ub.length, 4, 8)), jnp.float32)
    mask = kvjax.kq_mask(cache, ub, 64)
    step = jax.jit(lambda q, c, m, s: kvjax.attention(q, c, 0, m, sinks=s, return_lse=True))
    for a, b in zip(
        step(q, cache, mask, jnp.asarray(SINKS)),
        kvjax.attention(q, cache, 0, mask, sinks=jnp.asarray(SINKS), return_lse=True),
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    kvjax.attention(q, cache, 0, mask, sinks=jnp.zeros(4)).block_until_ready()
    for seed in range(3):
        sinks = jnp.asarray(np.random.default_rng(seed).normal(size=4), jnp.float32)
        with no_recompile():
            jax.block_until_ready(step(q, cache, mask, sinks))
            kvjax.attention(q, cache, 0, mask, sinks=sinks).block_until_ready()


@pytest.mark.parametrize(
    "bad",
    [jnp.zeros(3), jnp.zeros((1, 4)), jnp.zeros(4, jnp.int32), [0.0, 0.0, 0.0, 0.0], 1.0],
    ids=["three heads", "two dims", "int32", "list", "scalar"],
)
def test_bad_sinks_raise_and_leave_the_cache(bad):
    cache, ub = _scene()
    before = jax.tree.map(np.asarray, cache)
    mask = kvjax.kq_mask(cache, ub, 64)
    with pytest.raises(ValueError, match=r"sinks has shape .*: allowed a floating \[Hq=4\] array"):
        kvjax.attention(jnp.zeros((ub.length, 4, 8)), cache, 0, mask, sinks=bad)
    base = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=1, n_kv_heads=2, head_dim=8, padding=16)
    memory = kvjax.init(kvjax.StreamsConfig(base))
    sub = kvjax.make_equal_ubatch([([0], [0]), ([0], [1])])
    memory, placement, _ = kvjax.find_slot(memory, sub)
    masks = _streams.masks(memory, sub, placement, 64)
    with pytest.raises(ValueError, match=r"sinks has shape .*: allowed a floating \[Hq=4\] array"):
        _streams.attention(jnp.zeros((2, 4, 8)), memory, 0, masks, placement, sub, sinks=bad)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache), before)
