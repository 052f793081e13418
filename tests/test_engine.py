"""The decode driver and generation: equal to repeated uncached passes, context shift, defrag,
CacheFullError, speculative rollback, bounded compilations."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine, generate
from kvjax.nn import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=48, d_model=32, n_layer=2, n_heads=4, n_kv_heads=2)
# A context shift is exact only for one layer: deeper layers' K/V of the kept tokens were computed
# while the discarded tokens were still in context (llama.cpp has the same property), while the
# first layer's K/V depend on the token and its position alone, which the K-shift corrects.
CFG_1 = LlamaConfig(vocab_size=48, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
GREEDY = kvjax.SamplingConfig(temperature=0)
PAD = 160  # every uncached reference pass is padded to this many tokens: one compilation


@functools.lru_cache(maxsize=None)
def _model(cfg=CFG):
    return Llama(cfg, rngs=nnx.Rngs(3))


@functools.lru_cache(maxsize=None)
def _uncached_fn(cfg=CFG):
    graphdef, state = nnx.split(_model(cfg))

    @jax.jit
    def run(state, tokens):
        return nnx.merge(graphdef, state).forward(tokens)

    return lambda tokens: run(state, tokens)


def uncached_last_logits(tokens, cfg=CFG):
    """Logits after the last of ``tokens`` by a full uncached pass (trailing padding is harmless)."""
    padded = np.zeros(PAD, np.int32)
    padded[: len(tokens)] = tokens
    return np.asarray(_uncached_fn(cfg)(jnp.asarray(padded))[len(tokens) - 1])


def reference_greedy(prompt, n_new, n_ctx=None, n_keep=0, cfg=CFG):
    """Greedy generation by repeated uncached passes, with llama.cpp's context-shift rule."""
    ctx, out = list(prompt), []
    nxt = int(np.argmax(uncached_last_logits(ctx, cfg)))
    while True:
        out.append(nxt)
        if len(out) == n_new:
            return out
        if n_ctx is not None and len(ctx) >= n_ctx:
            n_discard = (len(ctx) - n_keep) // 2
            ctx = ctx[:n_keep] + ctx[n_keep + n_discard :]
        ctx.append(nxt)
        nxt = int(np.argmax(uncached_last_logits(ctx, cfg)))


def make_engine(size=256, n_seq_max=4, cfg=CFG, **kwargs):
    return Engine(_model(cfg), kvjax.init(cfg.cache_config(size=size, n_seq_max=n_seq_max, padding=32)), **kwargs)


PROMPTS = [[5, 6, 7, 8, 9, 10, 1, 2], [5, 6, 7, 8, 9, 10, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 4]]


def test_greedy_generation_equals_uncached_with_shared_prefix():
    engine = make_engine()
    out = generate(engine, PROMPTS, max_new_tokens=64, key=jax.random.PRNGKey(0), sampling=GREEDY)
    assert out.prompt_tokens == 6 + 2 + 1 + 4  # the 6-token prefix is evaluated once
    for prompt, got in zip(PROMPTS, out.tokens):
        assert got == reference_greedy(prompt, 64)
    table = kvjax.cell_table(engine.cache)
    assert table.seqs[:6, :3].all() and not table.seqs[:6, 3].any()  # prefix cells shared by all three


def test_context_shift_matches_uncached_over_kept_tokens():
    engine = make_engine(size=128, cfg=CFG_1)
    prompt = PROMPTS[0]
    out = generate(engine, [prompt], max_new_tokens=40, key=jax.random.PRNGKey(0), sampling=GREEDY, n_ctx=24, n_keep=4)
    assert out.context_shifts >= 2
    assert out.tokens[0] == reference_greedy(prompt, 40, n_ctx=24, n_keep=4, cfg=CFG_1)
    assert int(kvjax.seq_pos_max(engine.cache, 0)) < 24
    assert not bool(kvjax.has_shift(kvjax.update(engine.cache)))


def _greedy_loop(engine, prompts, steps, at_step=None):
    """Greedy decode loop over the engine; ``at_step(i, engine, tokens)`` may change the cache."""
    toks, pos, ids, last = [], [], [], []
    for s, p in enumerate(prompts):
        toks += p
        pos += list(range(len(p)))
        ids += [[s]] * len(p)
        last.append(len(toks) - 1)
    logits = engine.decode(toks, pos, ids)[jnp.asarray(last)]
    active = list(range(len(prompts)))
    out = [[] for _ in prompts]
    next_pos = [len(p) for p in prompts]
    for i in range(steps):
        picked = np.asarray(jnp.argmax(logits, axis=-1)).tolist()
        for s, t in zip(active, picked):
            out[s].append(t)
        if at_step is not None:
            active = at_step(i, engine, active)
        logits = engine.decode([out[s][-1] for s in active], [next_pos[s] for s in active], [[s] for s in active])
        for s in active:
            next_pos[s] += 1
    return out


def test_defrag_mid_generation_changes_no_token():
    def drop_then_defrag(i, engine, active):
        if i == 6:
            engine.cache, _ = kvjax.seq_rm(engine.cache, 1)
            return [0, 2]
        if i == 9:
            before = int(kvjax.cell_max(engine.cache))
            engine.cache = kvjax.defrag(engine.cache)
            assert int(kvjax.cell_max(engine.cache)) < before  # something really moved
        return active

    def drop_only(i, engine, active):
        if i == 6:
            engine.cache, _ = kvjax.seq_rm(engine.cache, 1)
            return [0, 2]
        return active

    with_defrag = _greedy_loop(make_engine(), PROMPTS, 20, drop_then_defrag)
    without = _greedy_loop(make_engine(), PROMPTS, 20, drop_only)
    assert with_defrag[0] == without[0] and with_defrag[2] == without[2]


def test_cache_full_raises_and_leaves_every_cell():
    engine = make_engine(size=32, n_seq_max=2)
    engine.decode(list(range(1, 31)), list(range(30)), [[0]] * 30)
    before = kvjax.cell_table(engine.cache)
    with pytest.raises(kvjax.CacheFullError, match="does not fit"):
        engine.decode([1, 2, 3, 4], [0, 1, 2, 3], [[1]] * 4)
    after = kvjax.cell_table(engine.cache)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    logits = engine.decode([1, 2], [0, 1], [[1], [1]])
    assert logits.shape == (2, CFG.vocab_size)
    np.testing.assert_allclose(np.asarray(logits[1]), uncached_last_logits([1, 2]), atol=1e-4)


def test_speculative_rollback_is_as_if_the_draft_never_ran():
    prompt = PROMPTS[2]
    plain = make_engine()
    plain.decode(prompt, list(range(len(prompt))), [[0]] * len(prompt))
    expected = np.asarray(plain.decode([17], [len(prompt)], [[0]]))

    spec = make_engine()
    spec.decode(prompt, list(range(len(prompt))), [[0]] * len(prompt))
    p = len(prompt)
    spec.decode([30, 31, 32], [p, p + 1, p + 2], [[0]] * 3)  # a draft that gets rejected
    spec.rollback(0, p)
    assert int(kvjax.seq_pos_max(spec.cache, 0)) == p - 1
    got = np.asarray(spec.decode([17], [p], [[0]]))
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_parallel_sampling_and_streaming():
    engine = make_engine()
    streamed = []
    out = generate(
        engine,
        [PROMPTS[1]],
        max_new_tokens=12,
        key=jax.random.PRNGKey(7),
        sampling=kvjax.SamplingConfig(temperature=1.5),
        n_parallel=4,
        on_token=lambda s, t: streamed.append((s, t)),
    )
    assert len(out.tokens) == 4 and all(len(t) == 12 for t in out.tokens)
    assert len({tuple(t) for t in out.tokens}) > 1  # continuations differ
    assert [t for s, t in streamed if s == 2] == out.tokens[2]
    assert out.prompt_tokens == len(PROMPTS[1])  # one prompt evaluation for all four
    greedy = generate(
        make_engine(), [PROMPTS[1]], max_new_tokens=8, key=jax.random.PRNGKey(7), sampling=GREEDY, n_parallel=3
    )
    assert greedy.tokens[0] == greedy.tokens[1] == greedy.tokens[2] == reference_greedy(PROMPTS[1], 8)


def test_stop_tokens_end_a_sequence():
    ref = reference_greedy(PROMPTS[0], 10)
    stop = ref[3]
    out = generate(
        make_engine(), [PROMPTS[0]], max_new_tokens=10, key=jax.random.PRNGKey(0), sampling=GREEDY, stop_tokens=[stop]
    )
    assert out.tokens[0] == ref[: ref.index(stop) + 1]


def test_generation_compiles_a_bounded_number_of_programs():
    engine = make_engine(size=512)
    out = generate(engine, [[1, 2, 3], [4, 5, 6]], max_new_tokens=100, key=jax.random.PRNGKey(1), sampling=GREEDY)
    assert sum(len(t) for t in out.tokens) == 200
    print(f"200 generated tokens compiled {out.compiles} programs")
    assert out.compiles <= 30  # ubatch buckets x window buckets, plus the small ops; printed above
    engine.cache = kvjax.clear(engine.cache)
    again = generate(engine, [[7, 2, 3], [4, 9, 6]], max_new_tokens=100, key=jax.random.PRNGKey(2), sampling=GREEDY)
    assert again.compiles == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_ubatch=0), r"n_ubatch=0 is out of range"),
        (dict(defrag_thold=1.5), r"defrag_thold=1.5 is out of range"),
    ],
)
def test_engine_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_engine(**kwargs)


def test_generate_bad_arguments():
    engine = make_engine(n_seq_max=2)
    with pytest.raises(ValueError, match=r"3 sequences are out of range: allowed at most n_seq_max=2"):
        generate(engine, PROMPTS, max_new_tokens=2, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"n_parallel=2 needs exactly one prompt"):
        generate(engine, PROMPTS[:2], max_new_tokens=2, key=jax.random.PRNGKey(0), n_parallel=2)
    with pytest.raises(ValueError, match="lengths"):
        engine.decode([1, 2], [0], [[0], [0]])


def test_parallel_context_shift_keeps_every_continuation_exact():
    """n_parallel sequences share the prompt; each shifts its own context without moving the others."""
    prompt = PROMPTS[0]
    out = generate(
        make_engine(size=128, cfg=CFG_1),
        [prompt],
        max_new_tokens=30,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        n_parallel=3,
        n_ctx=24,
        n_keep=4,
    )
    expected = reference_greedy(prompt, 30, n_ctx=24, n_keep=4, cfg=CFG_1)
    assert out.context_shifts >= 3
    assert out.tokens == [expected] * 3


def test_shift_of_shared_cells_is_refused():
    engine = make_engine(size=128, cfg=CFG_1)
    with pytest.raises(ValueError, match=r"the shared prompt \(20 tokens\) would be moved by a context shift"):
        generate(
            engine, [list(range(1, 21))], max_new_tokens=30, key=jax.random.PRNGKey(0), n_parallel=2, n_ctx=24, n_keep=2
        )
    engine = make_engine(size=128, cfg=CFG_1)
    engine.decode(list(range(1, 11)), list(range(10)), [[0]] * 10)
    engine.cache = kvjax.seq_cp(engine.cache, 0, 1)
    before = kvjax.cell_table(engine.cache)
    with pytest.raises(ValueError, match="would move cells it shares with other sequences"):
        engine.context_shift(0, 2, 3)
    np.testing.assert_array_equal(kvjax.cell_table(engine.cache).pos, before.pos)


def test_generate_refuses_busy_sequences_and_empty_budgets():
    engine = make_engine()
    engine.decode([1, 2], [0, 1], [[1], [1]])
    with pytest.raises(ValueError, match=r"sequences \[1\] already hold cells"):
        generate(engine, PROMPTS[:2], max_new_tokens=2, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"max_new_tokens=0 is out of range: allowed an integer in \[1, 1073741824\]"):
        generate(make_engine(), PROMPTS[:1], max_new_tokens=0, key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match=r"n_ctx=500 is out of range"):
        generate(make_engine(), PROMPTS[:1], max_new_tokens=2, key=jax.random.PRNGKey(0), n_ctx=500)


def test_decode_validates_tokens():
    engine = make_engine()
    with pytest.raises(ValueError, match=r"tokens contains 48: allowed ids in \[0, 48\)"):
        engine.decode([48], [0], [[0]])
    with pytest.raises(ValueError, match=r"tokens contains -5"):
        engine.decode([-5], [0], [[0]])
    with pytest.raises(ValueError, match=r"tokens has dtype float64"):
        engine.decode([1.5], [0], [[0]])


def test_multi_ubatch_batch_that_does_not_fit_places_nothing():
    engine = make_engine(size=32, n_seq_max=2, n_ubatch=4)
    engine.decode(list(range(1, 21)), list(range(20)), [[0]] * 20)
    before = kvjax.cell_table(engine.cache)
    with pytest.raises(kvjax.CacheFullError):  # 3 ubatches; the first two would fit
        engine.decode(list(range(1, 14)), list(range(13)), [[1]] * 13)
    for a, b in zip(before, kvjax.cell_table(engine.cache)):
        np.testing.assert_array_equal(a, b)
    logits = engine.decode(list(range(1, 13)), list(range(12)), [[1]] * 12)
    np.testing.assert_allclose(np.asarray(logits[-1]), uncached_last_logits(list(range(1, 13))), atol=1e-4)


def test_defrag_threshold_schedules_and_the_next_decode_applies_it():
    engine = make_engine(size=2048, n_seq_max=2, n_ubatch=512, defrag_thold=0.5)
    seq1 = [7, 8, 9, 10] * 25
    engine.decode([3] * 1940 + seq1, list(range(1940)) + list(range(100)), [[0]] * 1940 + [[1]] * 100)
    assert not bool(engine.cache.cells.defrag)  # full cache: no fragmentation
    engine.cache, _ = kvjax.seq_rm(engine.cache, 0)
    engine.decode([11], [100], [[1]])  # fragmentation 1 - (101 + 32) / 2048 > 0.5: scheduled
    assert bool(engine.cache.cells.defrag) and int(kvjax.cell_max(engine.cache)) > 2000
    logits = engine.decode([12], [101], [[1]])  # update applies the defrag first
    assert int(kvjax.cell_max(engine.cache)) == 102 and not bool(engine.cache.cells.defrag)
    np.testing.assert_allclose(np.asarray(logits[0]), uncached_last_logits(seq1 + [11, 12]), atol=1e-4)


def test_sixteen_sequences_side_by_side_equal_uncached(monkeypatch):
    """16 sequences decoding in one unified cache: their attention runs the owned chunks
    (``kvjax.attn._attention._owned_step``: each cell meets only its own sequence's row), and each
    sequence's greedy tokens are those of repeated uncached passes."""
    from kvjax.attn import _attention

    assert _attention.OWNED_MIN_TOKENS <= 16
    traced = []
    real = _attention._owned_step
    monkeypatch.setattr(_attention, "_owned_step", lambda *a: traced.append(1) or real(*a))
    _attention._attention.clear_cache()
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 48, size=int(rng.integers(2, 9))).tolist() for _ in range(16)]
    engine = make_engine(size=512, n_seq_max=16)
    out = generate(engine, prompts, max_new_tokens=12, key=jax.random.PRNGKey(0), sampling=GREEDY)
    assert traced  # the owned step is part of the decode program
    for prompt, got in zip(prompts, out.tokens):
        assert got == reference_greedy(prompt, 12)
    _attention._attention.clear_cache()
