"""Sink + window eviction (StreamingLLM): bounded cells per sequence, exact positions and K.

- after every step the cells equal a plain-Python model of the eviction rule (compacted and
  masked forms, unified and streams memories);
- the logits through the windowed cache equal recomputing from scratch over the kept tokens at
  their compacted positions (one layer: K/V depend on the token and its position only);
- the device loop gives the host loop's tokens; 10,000+ tokens run in a few hundred cells;
- the op runs jitted and eagerly alike, new argument values never recompile, bad input is
  refused by name with the memory unchanged.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import Llama, LlamaConfig, MambaConfig
from tests.helpers import no_recompile

V = 24
GREEDY = kvjax.SamplingConfig(temperature=0)
ONE_LAYER = LlamaConfig(vocab_size=V, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
TWO_LAYERS = LlamaConfig(vocab_size=V, d_model=16, n_layer=2, n_heads=2, n_kv_heads=1)
SWA = LlamaConfig(vocab_size=V, d_model=16, n_layer=2, n_heads=2, n_kv_heads=1, swa_layers=(0,), n_swa=6)
MODELS = {}


def model(cfg):
    if cfg not in MODELS:
        m = Llama(cfg, rngs=nnx.Rngs(0))
        nnx.update(m, jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param)))  # peaked logits
        MODELS[cfg] = m
    return MODELS[cfg]


def make_engine(kind, cfg=TWO_LAYERS, n_seq=2, per_seq=16):
    if kind == "iswa":  # layer 0 windowed (6 positions), layer 1 full: the rule runs on both parts
        memory = kvjax.init(
            kvjax.IswaConfig(
                SWA.cache_config(size=per_seq * n_seq, n_seq_max=n_seq, padding=16),
                swa_layers=(0,),
                n_swa=6,
                n_batch=16,
            )
        )
        return kvjax.Engine(model(SWA), memory, contiguous=False)
    if kind == "streams":
        return kvjax.Engine(
            model(cfg), kvjax.init(kvjax.StreamsConfig(cfg.cache_config(size=per_seq, n_seq_max=n_seq, padding=16)))
        )
    return kvjax.Engine(
        model(cfg), kvjax.init(cfg.cache_config(size=per_seq * n_seq, n_seq_max=n_seq, padding=16)), contiguous=False
    )


def positions_of(memory, seq):
    if isinstance(memory, kvjax.IswaCache):
        # the window part holds a subset of the full part's cells (its own window prunes more)
        assert set(positions_of(memory.swa, seq)) <= set(positions_of(memory.base, seq))
        return positions_of(memory.base, seq)
    part = memory.stream(memory.stream_of(seq)) if isinstance(memory, kvjax.StreamCache) else memory
    table = kvjax.cell_table(part)
    return sorted(table.pos[table.seqs[:, seq]].tolist())


def expected_positions(n_fed, window):
    """The rule in plain Python: the positions a sequence holds after ``n_fed`` tokens were placed."""
    kept = list(range(n_fed))
    if len(kept) <= window.n_cells:
        return kept
    if window.compact:  # positions move back: always 0 .. n_cells - 1
        return list(range(window.n_cells))
    return kept[: window.n_sink] + kept[n_fed - window.n_recent :]


@pytest.mark.parametrize("kind", ["unified", "streams", "iswa"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "masked"])
def test_cells_follow_the_rule_after_every_step(kind, compact):
    eng = make_engine(kind)
    window = kvjax.SinkWindow(n_sink=3, n_recent=9, compact=compact)
    prompts = [[1, 2, 3, 4, 5], [6, 7]]
    fed = [len(p) for p in prompts]
    for i, _ in kvjax.generate_stream(
        eng,
        prompts,
        max_new_tokens=30,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        window=window,
        device_loop=False,
        share_prefix=False,
    ):
        # the memory holds what was fed before this token was sampled
        assert positions_of(eng.cache, i) == expected_positions(fed[i], window), (i, fed[i])
        fed[i] += 1
    assert int(kvjax.used_cells(eng.cache)) <= 2 * window.n_cells
    assert kvjax.errors(eng.cache) == []


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "masked"])
def test_logits_equal_recomputing_over_the_kept_tokens(compact):
    """One layer: the windowed cache's logits equal the uncached model over the kept tokens at
    their (compacted) positions; K re-rotated by the K-shift equals K computed there."""
    m = model(ONE_LAYER)
    eng = kvjax.Engine(m, kvjax.init(ONE_LAYER.cache_config(size=32, n_seq_max=1, padding=16)))
    window = kvjax.SinkWindow(n_sink=2, n_recent=6, compact=compact)
    tokens = [int(t) for t in jax.random.randint(jax.random.PRNGKey(3), (20,), 0, V)]
    held, held_pos = tokens[:4], list(range(4))
    eng.decode(held, held_pos, [[0]] * 4, outputs=[])
    next_pos = 4
    for t in tokens[4:]:
        eng.cache, new_pos = kvjax.sink_window_evict(eng.cache, 0, next_pos, window)
        new_pos = int(new_pos)
        assert new_pos == next_pos - window.evicted(next_pos)
        if len(held) == window.n_cells:  # the oldest token after the sinks left
            del held[window.n_sink], held_pos[window.n_sink]
        if compact:
            held_pos = list(range(len(held)))
        held.append(t)
        held_pos.append(new_pos)
        logits = eng.decode([t], [new_pos], [[0]])
        want = m.forward(jnp.asarray([held]), jnp.asarray([held_pos]))[0, -1]
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(want), rtol=2e-4, atol=2e-4)
        next_pos = new_pos + 1
        assert positions_of(eng.cache, 0) == held_pos


@pytest.mark.parametrize("kind", ["unified", "streams"])
@pytest.mark.parametrize("compact", [True, False], ids=["compact", "masked"])
def test_device_loop_gives_the_host_loop_tokens(kind, compact):
    window = kvjax.SinkWindow(n_sink=4, n_recent=12, compact=compact)
    out = {}
    for device_loop in (True, False):
        eng = make_engine(kind)
        res = kvjax.generate(
            eng,
            [[1, 2, 3, 4, 5], [6, 7, 8]],
            max_new_tokens=40,
            key=jax.random.PRNGKey(1),
            sampling=GREEDY,
            window=window,
            device_loop=device_loop,
            sync_every=8,
        )
        out[device_loop] = res.tokens
        assert [positions_of(eng.cache, s) for s in range(2)] == [
            expected_positions(44, window),
            expected_positions(42, window),
        ]
        assert device_loop == (res.dispatches > 0)
    assert out[True] == out[False]


def test_ten_thousand_tokens_in_a_few_hundred_cells():
    eng = kvjax.Engine(model(ONE_LAYER), kvjax.init(ONE_LAYER.cache_config(size=256, n_seq_max=1, padding=32)))
    window = kvjax.SinkWindow(n_sink=4, n_recent=252)
    shapes = [x.shape for x in jax.tree.leaves(eng.cache)]
    res = kvjax.generate(
        eng,
        [[1, 2, 3]],
        max_new_tokens=10_240,
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=1.0),
        window=window,
        sync_every=1024,
    )
    assert len(res.tokens[0]) == 10_240 and res.context_shifts == 0
    assert kvjax.errors(eng.cache) == [] and int(kvjax.used_cells(eng.cache)) == 256
    assert positions_of(eng.cache, 0) == list(range(256))
    assert [x.shape for x in jax.tree.leaves(eng.cache)] == shapes  # nothing grew


def test_jit_equals_eager_and_new_values_never_recompile():
    cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4, rope=kvjax.RopeConfig(n_rot=4))
    cache, _, _ = kvjax.find_slot(
        kvjax.init(cfg), kvjax.make_ubatch(list(range(10)) + list(range(8)), [[0]] * 10 + [[1]] * 8)
    )
    cache = kvjax.write(cache, 0, jnp.arange(18), jnp.ones((18, 1, 4)), jnp.ones((18, 1, 4)))
    from kvjax.memory._sink_window import _evict_one

    for compact in (True, False):
        window = kvjax.SinkWindow(2, 6, compact=compact)
        eager, p = kvjax.sink_window_evict(cache, 0, 10, window, n_new=3)
        jitted, q = jax.jit(
            lambda c, s, n: _evict_one(c, s, n, jnp.int32(3), jnp.int32(2), jnp.int32(6), compact=compact)
        )(cache, jnp.int32(0), jnp.int32(10))
        chex_equal = jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), eager, jitted)
        assert all(jax.tree.leaves(chex_equal)) and int(p) == int(q)
        with no_recompile():
            for seq, pos, n_new, sink, recent in ((1, 8, 1, 0, 5), (0, 10, 2, 4, 4), (1, 3, 1, 1, 1)):
                kvjax.sink_window_evict(cache, seq, pos, kvjax.SinkWindow(sink, recent, compact=compact), n_new)
    # the updated K equals K rotated to its new position from the start (the shift is exact)
    shifted = kvjax.update(kvjax.sink_window_evict(cache, 0, 10, kvjax.SinkWindow(2, 6), n_new=1)[0])
    assert positions_of(shifted, 0) == list(range(7))


def test_bad_input_is_refused_by_name_with_the_memory_unchanged():
    for kwargs, name in (
        (dict(n_sink=-1, n_recent=4), "n_sink"),
        (dict(n_sink=2, n_recent=0), "n_recent"),
        (dict(n_sink=2, n_recent=4, compact="yes"), "compact"),
        (dict(n_sink=2.0, n_recent=4), "n_sink"),
    ):
        with pytest.raises(ValueError, match=name):
            kvjax.SinkWindow(**kwargs)
    eng = make_engine("unified")
    eng.decode([1, 2, 3], [0, 1, 2], [[0]] * 3, outputs=[])
    before = jax.device_get(eng.cache)
    window = kvjax.SinkWindow(2, 4)
    for args, name in (
        ((2, 3, window), "seq_id"),
        ((-1, 3, window), "seq_id"),
        ((0, -1, window), "next_pos"),
        ((0, 3, window, 5), "n_new"),
        ((0, 3, (2, 4)), "window must be a kvjax.SinkWindow"),
    ):
        with pytest.raises(ValueError, match=name):
            kvjax.sink_window_evict(eng.cache, *args)
    key = jax.random.PRNGKey(0)
    for options, message in (
        (dict(window=window, n_ctx=8), "window= is out of range with n_ctx"),
        (dict(window=(2, 4)), "window must be a kvjax.SinkWindow"),
        (
            dict(window=kvjax.SinkWindow(2, 40)),
            r"allowed n_sink \+ n_recent <= 32 \(the cells per sequence with 1 sequence\)",
        ),
    ):
        with pytest.raises(ValueError, match=message):
            kvjax.generate(eng, [[5, 6]], max_new_tokens=4, key=key, **options)
    with pytest.raises(ValueError, match="a prompt of 7 tokens is out of range"):
        kvjax.generate(make_engine("unified"), [[5] * 7], max_new_tokens=4, key=key, window=window)
    contiguous = kvjax.Engine(model(TWO_LAYERS), kvjax.init(TWO_LAYERS.cache_config(size=32, n_seq_max=2, padding=16)))
    with pytest.raises(ValueError, match="contiguous=False"):
        kvjax.generate(contiguous, [[5], [6]], max_new_tokens=4, key=key, window=window)
    with pytest.raises(ValueError, match="n_parallel=2 is out of range with window=SinkWindow"):
        kvjax.generate(make_engine("unified"), [[5, 6, 7]], max_new_tokens=4, key=key, window=window, n_parallel=2)
    chex.assert_trees_all_equal(before, jax.device_get(eng.cache))
    mamba = kvjax.init(MambaConfig(vocab_size=V, d_model=16, n_layer=1, d_state=4).memory_config(2))
    with pytest.raises(ValueError, match="memory='RecurrentCache' is out of range"):
        kvjax.sink_window_evict(mamba, 0, 3, window)
    no_rope = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
    assert kvjax.can_shift(no_rope)  # position-free K shifts exactly: the compacted form is allowed
    kvjax.sink_window_evict(no_rope, 0, 3, window)
