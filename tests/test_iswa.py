"""The iSWA memory: its config, batches of several ubatches against the reference, a model with window
layers decoding through it (equal to one full-size unified cache and to the uncached pass), the driver.

The contract shared by every memory (jit, recompiles, snapshots, state, bad input) runs in
``tests/test_memory_contract.py``; here is what is particular to the pair.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax import Engine, generate
from kvjax.nn import Llama, LlamaConfig
from kvjax.testing import IswaRef

BASE = kvjax.CacheConfig(size=64, n_seq_max=3, n_layer=4, n_kv_heads=2, head_dim=8, padding=16)


# -- config --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(swa_layers=(0, 7)), r"swa_layers=7 is out of range: allowed cached layer ids \[0, 1, 2, 3\]"),
        (dict(swa_layers=()), r"at least one window layer"),
        (dict(swa_layers=(0, 1, 2, 3)), r"at least one full layer"),
        (dict(swa_layers="ab"), r"swa_layers='ab' is out of range"),
        (dict(n_swa=0), r"n_swa=0 is out of range: allowed an integer >= 1"),
        (dict(n_swa=2.5), r"n_swa=2.5 is out of range"),
        (dict(swa_type="none"), r"swa_type='none' is out of range"),
        (dict(swa_type="sliding"), r"swa_type='sliding' is out of range"),
        (dict(n_batch=0), r"n_batch=0 is out of range"),
        (dict(swa_full="yes"), r"swa_full='yes' is out of range: allowed True or False"),
        (dict(base=BASE.replace(swa_type="standard", n_swa=4)), r"base.swa_type='standard' is out of range"),
        (dict(base="not a config"), r"base must be a kvjax.CacheConfig"),
    ],
)
def test_bad_config_is_refused_naming_the_argument(changes, match):
    args = dict(base=BASE, swa_layers=(0, 2), n_swa=4)
    args.update(changes)
    with pytest.raises(ValueError, match=match):
        kvjax.IswaConfig(**args)


def test_sizes_follow_the_seed():
    cfg = kvjax.IswaConfig(BASE, swa_layers=(1, 3), n_swa=5, n_batch=10)
    assert cfg.size_swa == 32  # pad(5 * 3 + 10, 16)
    assert kvjax.IswaConfig(BASE, swa_layers=(1,), n_swa=50, n_batch=10).size_swa == 64  # capped by size
    memory = kvjax.init(cfg)
    assert (memory.base.config.size, memory.swa.config.size) == (64, 32)
    assert memory.base.config.cached_layers == (0, 2) and memory.swa.config.cached_layers == (1, 3)
    assert [memory.layer_part(il) for il in range(4)] == [0, 1, 0, 1]
    assert not kvjax.can_shift(memory)
    assert kvjax.can_shift(kvjax.init(kvjax.IswaConfig(BASE, swa_layers=(1,), n_swa=5, swa_full=True)))
    assert memory.nbytes() == kvjax.total_size(cfg.base_config) + kvjax.total_size(cfg.swa_config)
    abstract = kvjax.abstract(cfg)
    assert abstract.swa.k[0].shape == (2, 2, 32, 8)


def test_optional_capabilities_name_the_memory():
    memory = kvjax.init(kvjax.IswaConfig(BASE, swa_layers=(1,), n_swa=4))
    with pytest.raises(kvjax.NotDefinedError, match="defrag is not defined for IswaCache"):
        kvjax.defrag(memory)
    with pytest.raises(kvjax.NotDefinedError, match="cell_table is not defined for IswaCache"):
        kvjax.cell_table(memory)
    assert kvjax.cell_table(memory.swa).pos.shape == (64,)  # each part is a unified cache


# -- whole batches (several ubatches, then commit) against the reference ------------------------------


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    swa_type=st.sampled_from(["standard", "chunked", "symmetric"]),
    n_swa=st.integers(1, 6),
    swa_full=st.booleans(),
)
def test_batches_match_the_reference(data, swa_type, n_swa, swa_full):
    """Random batches of 1-3 ubatches over 3 sequences, with seq ops between: every cell of both caches."""
    cfg = kvjax.IswaConfig(BASE, swa_layers=(1, 3), n_swa=n_swa, swa_type=swa_type, swa_full=swa_full, n_batch=8)
    memory = kvjax.init(cfg)
    ref = IswaRef(size=64, n_seq_max=3, padding=16, n_swa=n_swa, swa_type=swa_type, n_batch=8, swa_full=swa_full)
    next_pos = [0, 0, 0]
    for _ in range(data.draw(st.integers(3, 8))):
        if data.draw(st.booleans()):
            ubatches = []
            for _ in range(data.draw(st.integers(1, 3))):
                tokens = []
                for _ in range(data.draw(st.integers(1, 4))):
                    s = data.draw(st.integers(0, 2))
                    ids = [s] + ([(s + 1) % 3] if data.draw(st.integers(0, 4)) == 0 else [])
                    tokens.append((next_pos[s], ids))
                    next_pos[s] += 1
                ubatches.append(tokens)
            ubs = [kvjax.make_ubatch([p for p, _ in t], [i for _, i in t], length=4) for t in ubatches]
            ok, _ = kvjax.prepare(memory, ubs)
            want = ref.decode(ubatches)
            assert bool(ok) == want
            if want:
                for ub in ubs:
                    memory, _, placed = kvjax.find_slot(memory, ub)
                    assert bool(placed)
                memory = kvjax.commit(memory, ubs)
        else:
            s, p0 = data.draw(st.integers(-1, 2)), data.draw(st.integers(-1, 10))
            memory, ok = kvjax.seq_rm(memory, s, p0, -1)
            assert bool(ok) == ref.seq_rm(s, p0, -1)
        for mine, theirs in ((memory.base, ref.base), (memory.swa, ref.swa)):
            table = kvjax.cell_table(mine)
            assert table.pos.tolist() == [c.pos for c in theirs.cells]
            assert [set(np.nonzero(r)[0]) for r in table.seqs] == [c.seqs for c in theirs.cells]
            assert table.head == theirs.head
        for s in range(3):
            assert int(kvjax.seq_pos_min(memory, s)) == ref.seq_pos_min(s)
            assert int(kvjax.seq_pos_max(memory, s)) == ref.seq_pos_max(s)


def test_commit_is_jittable_and_does_not_recompile():
    cfg = kvjax.IswaConfig(BASE, swa_layers=(1,), n_swa=3)
    commit = jax.jit(kvjax.commit)
    memory = kvjax.init(cfg)
    ub = kvjax.make_ubatch(range(6), [[0]] * 6, length=8)
    memory, _, _ = kvjax.find_slot(memory, ub)
    eager, jitted = kvjax.commit(memory, [ub]), commit(memory, [ub])
    assert kvjax.cell_table(eager.swa).pos.tolist() == kvjax.cell_table(jitted.swa).pos.tolist()
    assert int(kvjax.used_cells(eager.swa)) == 3
    from tests.helpers import no_recompile

    ub2 = kvjax.make_ubatch(range(6, 10), [[1]] * 4, length=8)
    with no_recompile():
        commit(memory, [ub2])


# -- a model with window layers through the pair -----------------------------------------------------

MODEL = LlamaConfig(vocab_size=48, d_model=32, n_layer=4, n_heads=4, n_kv_heads=2, swa_layers=(0, 2), n_swa=6)


@functools.lru_cache(maxsize=None)
def _model():
    return Llama(MODEL, rngs=nnx.Rngs(11))


@functools.lru_cache(maxsize=None)
def _uncached():
    graphdef, state = nnx.split(_model())
    run = jax.jit(lambda st, t: nnx.merge(graphdef, st).forward(t))
    return lambda tokens: np.asarray(run(state, jnp.asarray(tokens)))


def _iswa_memory(size=128, n_seq_max=3, **options):
    base = MODEL.cache_config(size=size, n_seq_max=n_seq_max, padding=16)
    return kvjax.init(kvjax.IswaConfig(base, swa_layers=MODEL.swa_layers, n_swa=MODEL.n_swa, n_batch=16, **options))


def test_decode_equals_unified_and_uncached():
    """Three sequences with a shared prefix, decoded far past the window (6): every step's logits equal
    the same model on one full-size unified cache and the uncached pass, and the window cache stays small."""
    prompts = [[1, 2, 3, 4, 5, 9], [1, 2, 3, 4, 7], [1, 2, 3, 4, 5, 6, 8]]
    memories = {"iswa": _iswa_memory(), "unified": kvjax.init(MODEL.cache_config(size=128, n_seq_max=3, padding=16))}
    engines = {k: Engine(_model(), m, n_ubatch=8) for k, m in memories.items()}
    seqs = {s: list(p) for s, p in enumerate(prompts)}
    logits = {}
    for name, engine in engines.items():
        shared = prompts[0][:4]
        engine.decode(shared, list(range(4)), [[0]] * 4)
        for s in (1, 2):
            engine.cache = kvjax.seq_cp(engine.cache, 0, s)
        toks, pos, ids = [], [], []
        for s, p in enumerate(prompts):
            toks += p[4:]
            pos += list(range(4, len(p)))
            ids += [[s]] * (len(p) - 4)
        logits[name] = [np.asarray(engine.decode(toks, pos, ids))]
    # greedy decode on the iSWA engine, the same tokens fed to the unified one
    rows = logits["iswa"][0]
    ends = np.cumsum([len(p) - 4 for p in prompts]) - 1
    nxt = [int(np.argmax(rows[e])) for e in ends]
    np.testing.assert_allclose(logits["iswa"][0], logits["unified"][0], atol=2e-5)
    for step in range(30):  # 5x the window
        pos = [len(seqs[s]) for s in range(3)]
        for s in range(3):
            seqs[s].append(nxt[s])
        out = {name: np.asarray(engine.decode(nxt, pos, [[0], [1], [2]])) for name, engine in engines.items()}
        np.testing.assert_allclose(out["iswa"], out["unified"], atol=2e-5, err_msg=f"step {step}")
        if step % 10 == 9:
            for s in range(3):
                np.testing.assert_allclose(out["iswa"][s], _uncached()(seqs[s])[-1], atol=5e-5)
        nxt = [int(np.argmax(r)) for r in out["iswa"]]
    swa = engines["iswa"].cache.swa
    # after pruning every sequence keeps at most its window (shared prefix cells included) in the window cache
    assert int(kvjax.used_cells(swa)) <= 3 * MODEL.n_swa
    assert int(kvjax.used_cells(engines["iswa"].cache)) == int(kvjax.used_cells(engines["unified"].cache))
    assert kvjax.errors(engines["iswa"].cache) == []


def test_generate_parallel_and_shared_prefix_equal_unified():
    prompts = [[3, 1, 4, 1, 5], [3, 1, 4, 2]]
    out = {}
    for name, memory in (
        ("iswa", _iswa_memory()),
        ("unified", kvjax.init(MODEL.cache_config(size=128, n_seq_max=3, padding=16))),
    ):
        engine = Engine(_model(), memory, n_ubatch=8)
        a = generate(
            engine, prompts, max_new_tokens=20, key=jax.random.PRNGKey(0), sampling=kvjax.SamplingConfig(temperature=0)
        )
        for s in range(2):
            engine.cache, _ = kvjax.seq_rm(engine.cache, s)
        b = generate(
            engine,
            [[7, 7, 2]],
            max_new_tokens=12,
            key=jax.random.PRNGKey(1),
            n_parallel=3,
            sampling=kvjax.SamplingConfig(temperature=0.8),
        )
        out[name] = (a.tokens, b.tokens)
    assert out["iswa"] == out["unified"]


def test_driver_full_and_context_shift_change_nothing():
    engine = Engine(_model(), _iswa_memory(size=64, n_seq_max=1), n_ubatch=8)
    assert engine.cache.swa.config.size == 32 and not kvjax.can_shift(engine.cache)
    engine.decode(list(range(16)), list(range(16)), [[0]] * 16)
    engine.decode(list(range(16)), list(range(16, 32)), [[0]] * 16)
    before = jax.tree.map(lambda x: np.asarray(x).copy(), engine.cache)
    with pytest.raises(kvjax.CacheFullError, match="does not fit"):
        engine.decode(list(range(40)), list(range(32, 72)), [[0]] * 40)
    with pytest.raises(ValueError, match="context shift is not possible on this IswaCache"):
        engine.context_shift(0, 2, 4)
    after = jax.tree.leaves(engine.cache)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), after))
    fresh = Engine(_model(), _iswa_memory(size=64, n_seq_max=1))
    with pytest.raises(ValueError, match="max_new_tokens=80 is out of range for this IswaCache"):
        generate(
            fresh,
            [[1, 2, 3]],
            max_new_tokens=80,
            key=jax.random.PRNGKey(0),
            sampling=kvjax.SamplingConfig(temperature=0),
        )
    assert int(kvjax.used_cells(fresh.cache)) == 0  # refused before anything was placed


def test_state_round_trip_with_pruned_window():
    engine = Engine(_model(), _iswa_memory(), n_ubatch=8)
    engine.decode(list(range(1, 21)), list(range(20)), [[0]] * 20)
    blob = kvjax.state_write(engine.cache)
    restored = kvjax.state_read(_iswa_memory(), blob)
    assert kvjax.state_write(restored) == blob
    one = kvjax.state_read(_iswa_memory(), kvjax.state_write(engine.cache, 0), 2)
    assert int(kvjax.seq_pos_min(one, 2)) == int(kvjax.seq_pos_min(engine.cache, 0))
    bad = bytearray(blob)
    bad[-8:] = b"\xff" * 8  # corrupt the window part's tail
    target = _iswa_memory()
    before = kvjax.state_write(target)
    with pytest.raises(kvjax.StateError):
        kvjax.state_read(target, bytes(bad) + b"\x00")
    assert kvjax.state_write(target) == before
