"""The prompt cache: parked sequences, matching on the device, reuse per memory kind, LRU eviction.

- every generation through the prompt cache produces exactly the tokens of the same generation on
  a fresh memory (greedy, and sampling with the same key), over chat-like request sequences with
  shared and diverging prefixes and evictions, for the unified, iSWA, recurrent and hybrid memories;
- matching and eviction order equal a plain-Python model of the rules (hypothesis);
- the per-memory reuse rules: the iSWA pair lends nothing its window cache has pruned, a recurrent
  state is reused only where a state was kept;
- a request that cannot fit even with every parked sequence evicted raises CacheFullError with
  nothing changed.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from tests.tiny_models import memory, model

GREEDY = kvjax.SamplingConfig(temperature=0)


def engine(kind, **kw):
    return kvjax.Engine(model(kind), memory(kind, **kw), n_ubatch=32)


# a chat: each request repeats the conversation so far and adds a turn; a second user interleaves
CHAT = [
    [1, 2, 3, 4, 5],
    [7, 8, 9],
    [1, 2, 3, 4, 5, 11, 12],
    [7, 8, 9, 13],
    [1, 2, 3, 4, 5, 11, 12, 14, 15, 16, 17],
    [1, 2, 9, 9],
    [7, 8, 9, 13, 18, 3],
]


SAMPLED = kvjax.SamplingConfig(temperature=0.8)
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind, sampling, n_requests",
    [
        # the unified cache over the whole chat and recurrent over its first 5 requests by default
        # (the scheduler's tests run it on the iSWA pair; every kind continues a parked sequence below)
        ("unified", GREEDY, 7),
        ("recurrent", GREEDY, 5),
        # the other combinations with -m slow
        pytest.param("iswa", SAMPLED, 7, marks=SLOW),
        pytest.param("hybrid", SAMPLED, 7, marks=SLOW),
        pytest.param("unified", SAMPLED, 7, marks=SLOW),
        pytest.param("iswa", GREEDY, 7, marks=SLOW),
        pytest.param("recurrent", SAMPLED, 7, marks=SLOW),
        pytest.param("hybrid", GREEDY, 7, marks=SLOW),
    ],
    ids=lambda x: getattr(x, "greedy", None) is not None and ("greedy" if x.greedy else "sampled") or str(x),
)
def test_cached_generation_equals_fresh_generation(kind, sampling, n_requests):
    eng = engine(kind)
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64)
    reused = 0
    history = {}
    for i, prompt in enumerate(CHAT[:n_requests]):
        # a chat turn continues the previous answer when the prompt extends an earlier request
        key = jax.random.PRNGKey(i)
        got = kvjax.generate(eng, [prompt], max_new_tokens=3, key=key, sampling=sampling, prompt_cache=cache)
        want = kvjax.generate(engine(kind), [prompt], max_new_tokens=3, key=key, sampling=sampling)
        assert got.tokens == want.tokens, (i, prompt)
        reused += len(prompt) - got.prompt_tokens
        history[i] = got.tokens[0]
    assert reused > 0  # something was reused
    assert len(cache.parked()) <= 4


@pytest.mark.parametrize("kind", ["unified", "recurrent", pytest.param("hybrid", marks=SLOW)])
def test_a_generator_closed_while_the_device_runs_ahead_parks_a_true_prefix(kind):
    """The device loop runs chunks ahead of the tokens handed out; closing the generator early
    parks the tokens handed out and fed while the memory may hold more cells (or a later state).
    A later request that extends what was handed out gets exactly a fresh memory's tokens."""
    eng = engine(kind)
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64)
    prompt = [1, 2, 3, 4, 5]
    stream = kvjax.generate_stream(
        eng, [prompt], max_new_tokens=30, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache, sync_every=16
    )
    handed = [next(stream)[1] for _ in range(4)]
    stream.close()
    (parked,) = cache.parked()
    held = int(kvjax.seq_pos_max(eng.cache, parked)) + 1
    assert cache.match(prompt + handed)[1] == len(prompt) + 3  # fed: the prompt and 3 of the 4 tokens handed out
    if kind == "unified":
        assert held > len(prompt) + 3  # the device had run ahead
    follow = prompt + handed + [6, 7]
    got = kvjax.generate(
        eng, [follow], max_new_tokens=6, key=jax.random.PRNGKey(1), sampling=GREEDY, prompt_cache=cache
    )
    want = kvjax.generate(engine(kind), [follow], max_new_tokens=6, key=jax.random.PRNGKey(1), sampling=GREEDY)
    assert got.tokens == want.tokens


def test_reuse_and_eviction_on_a_small_memory():
    """More conversations than sequence ids and cells: the least recently used are evicted."""
    eng = engine("unified", size=48, n_seq=3)
    cache = kvjax.PromptCache(n_seq_max=3, max_tokens=48)
    prompts = [
        [1, 2, 3, 4, 5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14],
        [1, 2, 3, 4, 15, 16],
        [17, 18, 19, 1, 2, 3],
        [9, 10, 11, 12, 13, 14, 2],
        [1, 2, 3, 4, 5, 6, 7, 8, 3],
    ]
    for i, prompt in enumerate(prompts):
        got = kvjax.generate(
            eng, [prompt], max_new_tokens=4, key=jax.random.PRNGKey(i), sampling=GREEDY, prompt_cache=cache
        )
        want = kvjax.generate(
            engine("unified", size=48, n_seq=3), [prompt], max_new_tokens=4, key=jax.random.PRNGKey(i), sampling=GREEDY
        )
        assert got.tokens == want.tokens
        assert int(kvjax.used_cells(eng.cache)) <= 48
    assert cache.evictions > 0 and cache.reused_tokens > 0


def test_a_request_that_can_never_fit_changes_nothing():
    eng = engine("unified", size=32, n_seq=2)
    cache = kvjax.PromptCache(n_seq_max=2, max_tokens=32)
    kvjax.generate(
        eng, [[1, 2, 3, 4]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache
    )
    before = jax.device_get(eng.cache)
    parked = cache.parked()
    with pytest.raises(ValueError, match="must fit in size=32"):
        kvjax.generate(eng, [[5] * 30], max_new_tokens=8, key=jax.random.PRNGKey(0), prompt_cache=cache)
    with pytest.raises(kvjax.CacheFullError, match="nothing changed"):
        kvjax.generate(eng, [[5] * 20, [6] * 20], max_new_tokens=8, key=jax.random.PRNGKey(0), prompt_cache=cache)
    assert cache.parked() == parked
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(eng.cache)))
    )


def test_iswa_lends_only_what_its_window_still_holds():
    eng = engine("iswa")
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64)
    long = list(range(1, 19))  # 18 tokens: the window cache prunes the start
    kvjax.generate(eng, [long], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache)
    src = cache.parked()[0]
    assert not eng.cache.prefix_visible(src, 10)  # position 10 would need pruned cells
    assert eng.cache.prefix_visible(src, 19)  # the newest positions are all still there
    out = kvjax.generate(
        eng, [long[:10] + [3, 3]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache
    )
    assert out.prompt_tokens == 12  # nothing lent
    want = kvjax.generate(
        engine("iswa"), [long[:10] + [3, 3]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY
    )
    assert out.tokens == want.tokens


def test_recurrent_reuse_only_at_kept_states():
    eng = engine("recurrent")
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64)
    kvjax.generate(
        eng, [[1, 2, 3, 4, 5, 6]], max_new_tokens=3, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache
    )  # holds 8 positions, 4 states kept
    held = int(kvjax.seq_pos_max(eng.cache, cache.parked()[0])) + 1
    assert held == 8
    # a prompt diverging after 3 tokens: a state after position 2 was not kept: evaluated whole
    out = kvjax.generate(
        eng, [[1, 2, 3, 9, 9]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache
    )
    assert out.prompt_tokens == 5
    # diverging after 6 tokens: the state after position 5 is kept: reused, the parked sequence consumed
    parked_before = len(cache.parked())
    out = kvjax.generate(
        eng,
        [[1, 2, 3, 4, 5, 6, 9, 9]],
        max_new_tokens=2,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        prompt_cache=cache,
    )
    assert out.prompt_tokens == 2
    assert len(cache.parked()) == parked_before  # one consumed, the new one parked
    want = kvjax.generate(
        engine("recurrent"), [[1, 2, 3, 4, 5, 6, 9, 9]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY
    )
    assert out.tokens == want.tokens


# -- matching and eviction against a plain-Python model -----------------------------------------------


class CacheModel:
    """The rules in plain Python: longest common prefix (ties: most recent), least recently used first."""

    def __init__(self, max_tokens):
        self.max_tokens, self.tokens, self.used, self.clock = max_tokens, {}, {}, 0

    def park(self, seq, tokens):
        self.clock += 1
        self.tokens[seq], self.used[seq] = list(tokens)[: self.max_tokens], self.clock

    def forget(self, seq):
        self.tokens.pop(seq, None)
        self.used.pop(seq, None)

    def match(self, prompt):
        best = (-1, 0, -1)
        for seq, toks in self.tokens.items():
            n = 0
            while n < min(len(toks), len(prompt), self.max_tokens) and toks[n] == prompt[n]:
                n += 1
            if n and (n, self.used[seq]) > (best[1], best[2]):
                best = (seq, n, self.used[seq])
        return best[0], best[1]

    def lru(self):
        return sorted(self.tokens, key=lambda s: self.used[s])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["park", "forget", "match"]),
            st.integers(0, 5),
            st.lists(st.integers(0, 3), min_size=1, max_size=12),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_match_and_lru_equal_the_plain_model(ops):
    cache, ref = kvjax.PromptCache(n_seq_max=6, max_tokens=10), CacheModel(10)
    for op, seq, tokens in ops:
        if op == "park":
            cache.park(seq, tokens)
            ref.park(seq, tokens)
        elif op == "forget":
            cache.forget(seq)
            ref.forget(seq)
        else:
            assert cache.match(tokens) == ref.match(tokens), (tokens, ref.tokens)
        assert cache.lru() == ref.lru()
        assert cache.parked() == sorted(ref.tokens)


def test_bad_arguments():
    with pytest.raises(ValueError, match="max_tokens=0 is out of range"):
        kvjax.PromptCache(n_seq_max=2, max_tokens=0)
    eng = engine("unified")
    with pytest.raises(ValueError, match="prompt_cache must be a kvjax.PromptCache"):
        kvjax.generate(eng, [[1]], max_new_tokens=1, key=jax.random.PRNGKey(0), prompt_cache={})
    with pytest.raises(ValueError, match="n_parallel"):
        kvjax.generate(
            eng,
            [[1, 2]],
            max_new_tokens=1,
            key=jax.random.PRNGKey(0),
            n_parallel=2,
            prompt_cache=kvjax.PromptCache(n_seq_max=4, max_tokens=8),
        )
    with pytest.raises(ValueError, match="prompt_cache has n_seq_max=3"):
        kvjax.generate(
            eng,
            [[1, 2]],
            max_new_tokens=1,
            key=jax.random.PRNGKey(0),
            prompt_cache=kvjax.PromptCache(n_seq_max=3, max_tokens=8),
        )


@pytest.mark.parametrize("kind", ["unified", "iswa", "recurrent", "hybrid"])
def test_a_parked_sequence_holding_exactly_the_prompt_continues_in_place(kind):
    """A session loaded from a file holds the whole prompt: its last token is evaluated again (the
    file has no logits) in the same sequence, and the tokens equal a fresh generation's."""
    prompt = [3, 7, 1, 12, 5, 9]
    key = jax.random.PRNGKey(0)
    fresh = kvjax.generate(
        kvjax.Engine(model(kind), memory(kind)), [prompt], max_new_tokens=6, key=key, sampling=GREEDY
    )
    engine = kvjax.Engine(model(kind), memory(kind))
    engine.decode(prompt, list(range(len(prompt))), [[2]] * len(prompt), outputs=[])
    pc = kvjax.PromptCache(n_seq_max=4, max_tokens=32)
    pc.park(2, prompt)
    out = kvjax.generate(engine, [prompt], max_new_tokens=6, key=key, sampling=GREEDY, prompt_cache=pc)
    assert out.tokens == fresh.tokens
    assert out.prompt_tokens == 1 and pc.parked() == [2]  # continued in sequence 2, parked again
