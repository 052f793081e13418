"""The jitted step: one program per bucket pair, donation, failure, caller placement, windows."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import LlamaConfig, Step, make_step, window_for, windows_for
from tests.helpers import CompileCounter, no_recompile
from tests.test_nn_nnx import make_model

CFG = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)


def _cache(size=128, n_seq_max=4):
    return kvjax.init(CFG.cache_config(size=size, n_seq_max=n_seq_max, padding=32))


def _ubatch(n, length, seqs, start=0):
    return kvjax.make_ubatch(
        [start + i // len(seqs) for i in range(n)], [[seqs[i % len(seqs)]] for i in range(n)], length=length
    )


def _tokens(rng, length):
    # numpy, like the ubatch leaves: the jitted call transfers them (no device-put program)
    return rng.integers(CFG.vocab_size, size=length).astype(np.int32)


def test_one_program_per_bucket_pair():
    model = make_model(CFG)
    step, state = make_step(model), nnx.state(model)
    rng = np.random.default_rng(0)
    cache = _cache(size=160, n_seq_max=3)  # a config no other test compiles a step for
    window_for(cache, 1)  # compile the small helpers outside the counted blocks
    with CompileCounter() as first:
        _, cache, _ = step(state, cache, _ubatch(3, 4, [0]), _tokens(rng, 4), n_kv=32)
    assert first.count == 1
    # new tokens, positions, sequences and cache contents: no new program
    with no_recompile():
        for i in range(4):
            _, cache, ok = step(state, cache, _ubatch(4, 4, [1, 2], start=10 * i), _tokens(rng, 4), n_kv=32)
            assert bool(ok)
        other = make_model(CFG, seed=1)  # other weights, same structure
        _, cache, _ = step(nnx.state(other), cache, _ubatch(2, 4, [3]), _tokens(rng, 4), n_kv=32)
    for n_kv, length in ((64, 4), (64, 8), (32, 8)):  # each new pair: exactly one program
        with CompileCounter() as counter:
            _, cache, ok = step(
                state, cache, _ubatch(length, length, [0, 1], start=100), _tokens(rng, length), n_kv=n_kv
            )
        assert counter.count == 1, (n_kv, length, counter.count)
    with no_recompile():
        for n_kv, length in ((64, 4), (64, 8), (32, 8), (32, 4)):
            _, cache, _ = step(state, cache, _ubatch(1, length, [2], start=200), _tokens(rng, length), n_kv=n_kv)


def test_donation_and_failure():
    model = make_model(CFG)
    step, state = make_step(model), nnx.state(model)
    rng = np.random.default_rng(1)
    cache = _cache(size=32, n_seq_max=1)
    before = cache
    _, cache, ok = step(state, cache, _ubatch(30, 32, [0]), _tokens(rng, 32), n_kv=32)
    assert bool(ok) and int(kvjax.used_cells(cache)) == 30
    assert before.k[0].is_deleted() and before.v[0].is_deleted()  # K/V updated in place
    assert not before.cells.pos.is_deleted()  # the cells of the old value stay a valid snapshot
    # 4 more tokens do not fit: nothing placed, nothing written
    snap_cells = jax.tree.map(np.asarray, cache.cells)
    snap_k = np.asarray(cache.k[0])
    _, cache, ok = step(state, cache, _ubatch(4, 4, [0], start=30), _tokens(rng, 4), n_kv=32)
    assert not bool(ok)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, cache.cells), snap_cells)
    np.testing.assert_array_equal(np.asarray(cache.k[0]), snap_k)


def test_caller_placed_equals_step_placed():
    model = make_model(CFG, seed=2)
    state = nnx.state(model)
    step = make_step(model)
    rng = np.random.default_rng(2)
    ub, toks = _ubatch(6, 8, [0, 1]), _tokens(rng, 8)
    a, cache_a, _ = step(state, _cache(), ub, toks, n_kv=32)
    placed, slot, ok = kvjax.find_slot(_cache(), ub)
    b, cache_b, ok_b = step(state, placed, ub, toks, n_kv=32, slot=slot)
    assert bool(ok) and bool(ok_b)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(cache_a.cells.pos), np.asarray(cache_b.cells.pos))


def test_apply_function_step():
    """make_step also takes a plain function: here attention-free, writing zeros for every layer."""

    def apply(state, tokens, cache, inputs):
        ubatch, (n_kv,) = inputs.ubatch, inputs.windows
        rows = jnp.zeros((ubatch.length, 2, 8))
        cache = kvjax.write(cache, 0, inputs.placement, rows + state, rows)
        return jnp.zeros((ubatch.length, 3)) + kvjax.kq_mask_bool(cache, ubatch, n_kv).sum(-1, keepdims=True), cache

    step = make_step(apply)
    assert isinstance(step, Step)
    cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=2, head_dim=8))
    out, cache, ok = step(jnp.float32(2.0), cache, _ubatch(3, 4, [0]), jnp.zeros(4, jnp.int32), n_kv=32)
    assert np.asarray(out)[:, 0].tolist() == [1, 2, 3, 0]  # causal visibility counts; padded row sees nothing
    assert float(kvjax.view(cache, 0, 32)[0][0, 2, 0]) == 2.0


def test_window_for_covers_every_placement():
    """window_for(cache, n) is never smaller than what placing n tokens needs, whatever the holes."""
    rng = np.random.default_rng(3)
    for contiguous in (True, False):
        cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=1, n_kv_heads=1, head_dim=2))
        pos = [0] * 4
        for _ in range(25):
            s, n = int(rng.integers(4)), int(rng.integers(1, 40))
            if rng.random() < 0.3 and pos[s] > 4:
                cut = int(rng.integers(pos[s]))
                cache, _ = kvjax.seq_rm(cache, s, cut, -1)
                pos[s] = cut
                continue
            bound = window_for(cache, n)
            ub = kvjax.make_ubatch(range(pos[s], pos[s] + n), [[s]] * n, length=64)  # one program
            new, slot, ok = kvjax.find_slot(cache, ub, contiguous=contiguous)
            if not bool(ok):
                continue
            assert int(np.asarray(slot).max()) < bound
            assert kvjax.kv_window(new) <= bound
            assert window_for(new, 0) == kvjax.kv_window(new)
            cache, pos[s] = new, pos[s] + n


def test_windows_for_matches_placement():
    cache = kvjax.init(kvjax.CacheConfig(size=512, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2))
    cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(20), [[1]] * 20))
    ubs = [kvjax.make_ubatch(range(i * 30, i * 30 + 30), [[0]] * 30) for i in range(5)]
    ok, slots = kvjax.prepare(cache, ubs)
    assert bool(ok)
    got = windows_for(cache, slots)
    want = []
    for ub in ubs:
        cache, _, _ = kvjax.find_slot(cache, ub)
        want.append(kvjax.kv_window(cache))
    assert got == want == sorted(got) and got[-1] > got[0]


def test_bad_input():
    model = make_model(CFG)
    step, state = make_step(model), nnx.state(model)
    cache, ub, toks = _cache(), _ubatch(2, 4, [0]), jnp.zeros(4, jnp.int32)
    for n_kv in (16, 33, 256, 0):
        with pytest.raises(ValueError, match="n_kv"):
            step(state, cache, ub, toks, n_kv=n_kv)
    with pytest.raises(ValueError, match="tokens has shape"):
        step(state, cache, ub, jnp.zeros(3, jnp.int32), n_kv=32)
    with pytest.raises(ValueError, match="tokens has shape"):
        step(state, cache, ub, jnp.zeros(4, jnp.float32), n_kv=32)
    with pytest.raises(ValueError, match="slot has shape"):
        step(state, cache, ub, toks, n_kv=32, slot=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match="KVCache"):
        step(state, "cache", ub, toks, n_kv=32)
    with pytest.raises(ValueError, match="Ubatch"):
        step(state, cache, (1, 2), toks, n_kv=32)
    with pytest.raises(ValueError, match="model must be"):
        make_step(3)
    with pytest.raises(ValueError, match="n_tokens"):
        window_for(cache, -1)
    with pytest.raises(ValueError, match="KVCache"):
        windows_for("cache", [])
    assert not cache.k[0].is_deleted()  # refused calls donate nothing


def test_step_fails_on_what_it_cannot_compute():
    """A window smaller than the placed cells, or a token outside the vocabulary, under jit: ok is
    false and the cells are as before (no wrong logits with ok true, nothing left placed)."""
    from flax import nnx
    from kvjax.nn import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=16, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    step, state = make_step(model), nnx.state(model)
    cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=1, padding=16))
    ub = kvjax.make_ubatch(range(20), [[0]] * 20, length=32)
    _, cache, ok = step(state, cache, ub, np.arange(32) % 16, n_kv=32)
    assert bool(ok)
    before = np.asarray(kvjax.cell_table(cache).pos).copy()
    ub2 = kvjax.make_ubatch(range(20, 36), [[0]] * 16)  # lands in cells 20..35: beyond a window of 32
    logits, cache, ok = step(state, cache, ub2, np.zeros(16, np.int32), n_kv=32)
    assert not bool(ok)
    np.testing.assert_array_equal(kvjax.cell_table(cache).pos, before)
    assert int(cache.error_bits()) == kvjax.ErrorFlag.WINDOW  # says why, in the memory's error word
    cache = kvjax.clear_errors(cache)
    bad_tokens = jnp.asarray(np.array([3, 99, 4, 0], np.int32))  # a device array: no host read, an error bit
    one = kvjax.make_ubatch([20, 21, 22], [[0]] * 3)
    _, cache, ok = step(state, cache, one, bad_tokens, n_kv=64)
    assert not bool(ok)
    np.testing.assert_array_equal(kvjax.cell_table(cache).pos, before)
    assert int(cache.error_bits()) == kvjax.ErrorFlag.TOKEN
    cache = kvjax.clear_errors(cache)
    _, cache, ok = step(state, cache, one, jnp.asarray(np.array([3, 9, 4, 99], np.int32)), n_kv=64)
    assert bool(ok)  # the padding row's token is ignored
    assert int(kvjax.used_cells(cache)) == 23
    with pytest.raises(ValueError, match="vocab_size=0 is out of range"):
        Step(lambda *a: None, vocab_size=0)


def test_step_names_host_slots_and_tokens_eagerly_and_flags_device_ones():
    """Host values (numpy, lists) of ``tokens`` and ``slot`` are read before anything runs: a
    ValueError naming the argument, the memory untouched. Device arrays are never read back (no
    sync per token): the jitted step fails with ok false and says why in the error word, SLOT for a
    cell outside [-1, size), WINDOW for one outside the window, TOKEN for an id outside the vocabulary."""
    from flax import nnx
    from kvjax.nn import Llama, LlamaConfig

    cfg = LlamaConfig(vocab_size=16, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    step, state = make_step(model), nnx.state(model)
    cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2, padding=16))
    ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [1]], length=4)
    tokens = np.array([1, 2, 3, 0], np.int32)
    before = jax.device_get(cache)
    for call, match in (
        (
            lambda: step(state, cache, ub, np.array([1, 2, 16, 0]), n_kv=64),
            r"tokens contains 16: allowed ids in \[0, 16\)",
        ),
        (lambda: step(state, cache, ub, [1, -3, 2, 0], n_kv=64), r"tokens contains -3"),
        (
            lambda: step(state, cache, ub, tokens, n_kv=64, slot=np.array([0, 1, 64, -1])),
            r"slot contains 64: allowed cells in \[-1, size=64\)",
        ),
        (lambda: step(state, cache, ub, tokens, n_kv=64, slot=[0, -2, 1, -1]), r"slot contains -2"),
        (
            lambda: step(state, cache, ub, tokens, n_kv=16, slot=np.array([0, 1, 20, -1])),
            r"slot contains 20: allowed cells inside the window 16",
        ),
    ):
        with pytest.raises(ValueError, match=match):
            call()
        chex.assert_trees_all_equal(jax.device_get(cache), before)
    for kwargs, bit in (
        (dict(tokens=jnp.array([1, 2, 16, 0])), kvjax.ErrorFlag.TOKEN),
        (dict(slot=jnp.array([0, 1, 64, -1])), kvjax.ErrorFlag.SLOT),
        (dict(slot=jnp.array([0, -5, 1, -1])), kvjax.ErrorFlag.SLOT),
        (dict(slot=jnp.array([0, 1, 20, -1]), n_kv=16), kvjax.ErrorFlag.WINDOW),
    ):
        kwargs = {"tokens": jnp.asarray(tokens), "n_kv": 64, **kwargs}
        _, out, ok = step(state, kvjax.init(cfg.cache_config(size=64, n_seq_max=2, padding=16)), ub, **kwargs)
        assert not bool(ok)
        assert int(out.error_bits()) == bit, kvjax.errors(out)
        assert int(kvjax.used_cells(out)) == 0
    # a padding row's token is never read, on the host or on the device
    _, out, ok = step(state, cache, ub, np.array([1, 2, 3, 99]), n_kv=64)
    assert bool(ok) and int(out.error_bits()) == 0


def test_mamba_step_flags_a_token_outside_the_vocabulary():
    """The recurrent model's step reports a bad device token with the same TOKEN bit, and keeps every state."""
    from flax import nnx
    from kvjax.nn import Mamba, MambaConfig

    cfg = MambaConfig(vocab_size=32, d_model=16, n_layer=1, d_state=4)
    model = Mamba(cfg, rngs=nnx.Rngs(0))
    step, state = make_step(model), nnx.state(model)
    memory = kvjax.init(cfg.memory_config(2))
    ub = kvjax.make_equal_ubatch([([0], [0]), ([0], [1])])
    _, memory, ok = step(state, memory, ub, np.array([1, 2]), windows=())
    before = jax.device_get(memory)
    ub = kvjax.make_equal_ubatch([([1], [0]), ([1], [1])])
    with pytest.raises(ValueError, match=r"tokens contains 32: allowed ids in \[0, 32\)"):
        step(state, memory, ub, np.array([1, 32]), windows=())
    _, after, ok = step(state, memory, ub, jnp.array([1, 32]), windows=())
    assert not bool(ok)
    assert int(after.error_bits()) == kvjax.ErrorFlag.TOKEN
    chex.assert_trees_all_equal(jax.device_get(after.clear_errors()), before)
