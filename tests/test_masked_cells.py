"""A cell a token cannot see has no effect at all on that token, whatever its bytes (issue: hostile input).

NaN and inf are planted in the K and V rows of every cell a token cannot see (other sequences'
cells, freed cells, cells outside the sliding window, cells past the ubatch's own position, the
cells beyond the used ones inside the window): attention must equal attention over the same cache
with those cells zeroed, exactly, eagerly and under jit; a row that does see a non-finite V stays
NaN (nothing is hidden).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.helpers import fill

CFG = kvjax.CacheConfig(size=64, n_seq_max=3, n_layer=1, n_kv_heads=2, head_dim=8, padding=16)


def _random_kv(cache, seed):
    rng = np.random.default_rng(seed)
    return cache.replace(
        k=(jnp.asarray(rng.normal(size=cache.k[0].shape), jnp.float32),),
        v=(jnp.asarray(rng.normal(size=cache.v[0].shape), jnp.float32),),
    )


def _plant(cache, cells, value_k, value_v):
    k, v = np.asarray(cache.k[0]).copy(), np.asarray(cache.v[0]).copy()
    k[:, :, cells], v[:, :, cells] = value_k, value_v
    return cache.replace(k=(jnp.asarray(k),), v=(jnp.asarray(v),))


def _scenario():
    """Sequences 0, 1, 2 interleaved; sequence 1 partly removed (freed cells); a ubatch of sequence 0."""
    cache = fill(kvjax.init(CFG), list(range(12)), [[s % 3] for s in range(12)])
    cache = fill(cache, list(range(12, 30)), [[0]] * 18)
    cache, _ = kvjax.seq_rm(cache, 1, 0, 2)  # frees some cells of sequence 1
    ub = kvjax.make_ubatch([30, 31, 32], [[0], [0], [2]], length=4)
    cache, slot, ok = kvjax.find_slot(cache, ub)
    assert bool(ok)
    return _random_kv(cache, 0), ub


@pytest.mark.parametrize("bad_k, bad_v", [(np.nan, np.nan), (np.inf, -np.inf), (0.0, np.nan), (np.nan, 0.0)])
@pytest.mark.parametrize("window", [dict(), dict(swa_type="standard", n_swa=5), dict(swa_type="chunked", n_swa=8)])
@pytest.mark.parametrize("jit", [False, True])
def test_masked_cells_have_no_effect(bad_k, bad_v, window, jit):
    cache, ub = _scenario()
    n_kv = 64
    mask = kvjax.kq_mask(cache, ub, n_kv, **window)
    visible_to_any = np.isfinite(np.asarray(mask)[np.asarray(ub.valid)]).any(axis=0)
    hidden = np.nonzero(~visible_to_any)[0]
    assert hidden.size > 20  # other sequences', freed, out-of-window and unused cells
    q = jnp.asarray(np.random.default_rng(1).normal(size=(4, 4, 8)), jnp.float32)
    run = jax.jit(kvjax.attention, static_argnames="layer") if jit else kvjax.attention
    zeroed = run(q, _plant(cache, hidden, 0.0, 0.0), layer=0, mask=mask)
    planted = run(q, _plant(cache, hidden, bad_k, bad_v), layer=0, mask=mask)
    valid = np.asarray(ub.valid)
    np.testing.assert_array_equal(np.asarray(planted)[valid], np.asarray(zeroed)[valid])
    assert np.isfinite(np.asarray(planted)[valid]).all()


def test_cells_hidden_from_one_sequence_only():
    """A cell another sequence of the same ubatch sees: NaN there reaches that sequence only."""
    cache, ub = _scenario()
    mask = kvjax.kq_mask(cache, ub, 64)
    seen = np.isfinite(np.asarray(mask))
    only_seq2 = np.nonzero(seen[2] & ~seen[0])[0]  # sequence 2's own cells
    assert only_seq2.size
    q = jnp.asarray(np.random.default_rng(2).normal(size=(4, 4, 8)), jnp.float32)
    clean = np.asarray(kvjax.attention(q, cache, 0, mask))
    out = np.asarray(kvjax.attention(q, _plant(cache, only_seq2, np.nan, np.nan), 0, mask))
    np.testing.assert_array_equal(out[:2], clean[:2])  # sequence 0's rows: untouched
    assert np.isnan(out[2]).all()  # sequence 2 sees the NaN: not hidden
    out_v = np.asarray(kvjax.attention(q, _plant(cache, only_seq2[:1], 0.0, np.inf), 0, mask))
    np.testing.assert_array_equal(out_v[:2], clean[:2])
    assert np.isnan(out_v[2]).all()


def test_model_logits_ignore_other_sequences_garbage():
    """Through the reference model: poisoning sequence 1's cells in every layer leaves sequence 0's logits."""
    from flax import nnx
    from kvjax.nn import Llama, LlamaConfig, make_step, window_for

    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=2, n_heads=2, n_kv_heads=1)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    step, state = make_step(model), nnx.state(model)
    cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2, padding=16))
    ub = kvjax.make_ubatch(list(range(6)) * 2, [[0]] * 6 + [[1]] * 6, length=12)
    _, cache, _ = step(state, cache, ub, jnp.arange(12) % 32, n_kv=window_for(cache, 12))
    cells1 = np.nonzero(kvjax.cell_table(cache).seqs[:, 1])[0]
    poisoned = cache.replace(
        k=tuple(x.at[:, :, cells1].set(jnp.nan) for x in cache.k),
        v=tuple(x.at[:, :, cells1].set(jnp.inf) for x in cache.v),
    )
    dec = kvjax.make_ubatch([6], [[0]])
    a, _, _ = step(state, jax.tree.map(jnp.copy, cache), dec, jnp.array([3]), n_kv=16)
    b, _, _ = step(state, poisoned, dec, jnp.array([3]), n_kv=16)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
