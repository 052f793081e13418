"""The prompt cache's host tier: parked sequences in host memory, a byte budget, LRU.

- a request served from a host-parked prefix gives exactly the tokens of one served from a
  device-parked prefix and of one with no prompt cache, for every memory kind (unified, streams,
  iSWA, recurrent, hybrid);
- while a sequence is on the host its device cells are free (``idle_to_host``: none are used
  between requests);
- the byte budget is never exceeded, and the store's order, matches and evictions equal a
  plain-Python model of the rules (hypothesis);
- a memory too small for its parked sequences moves them to the host and brings the best match back;
- bad arguments are refused by name, nothing changed.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.engine._host_tier import HostTier

from tests.test_prompt_cache import CHAT, GREEDY, SAMPLED, engine
from tests.tiny_models import LLAMA, memory, model


def streams_engine(n_seq=4):
    cfg = kvjax.StreamsConfig(LLAMA.cache_config(size=32, n_seq_max=n_seq, padding=16))
    return kvjax.Engine(model("unified"), kvjax.init(cfg), n_ubatch=32)


def make_engine(kind):
    return streams_engine() if kind == "streams" else engine(kind)


@pytest.mark.parametrize(
    "kind, sampling",
    [
        ("unified", GREEDY),
        ("streams", GREEDY),
        ("iswa", SAMPLED),
        # (a state blob read back continues the same: test_state_blob_continues_the_same, test_recurrent_engine.py)
        pytest.param("recurrent", GREEDY, marks=pytest.mark.slow),
        pytest.param("hybrid", SAMPLED, marks=pytest.mark.slow),
    ],
)
def test_host_parked_equals_device_parked_equals_fresh(kind, sampling):
    on_host, on_device = make_engine(kind), make_engine(kind)
    n_seq = on_host.cache.n_seq_max
    host_cache = kvjax.PromptCache(n_seq_max=n_seq, max_tokens=64, host_bytes=1 << 22, idle_to_host=True)
    device_cache = kvjax.PromptCache(n_seq_max=n_seq, max_tokens=64)
    reused = 0
    for i, prompt in enumerate(CHAT[:4]):
        key = jax.random.PRNGKey(i)
        got = kvjax.generate(on_host, [prompt], max_new_tokens=3, key=key, sampling=sampling, prompt_cache=host_cache)
        parked = kvjax.generate(
            on_device, [prompt], max_new_tokens=3, key=key, sampling=sampling, prompt_cache=device_cache
        )
        assert got.tokens == parked.tokens, (i, prompt)
        if kind == "streams":  # device-parked equals fresh for the other kinds in test_prompt_cache.py
            fresh = kvjax.generate(make_engine(kind), [prompt], max_new_tokens=3, key=key, sampling=sampling)
            assert got.tokens == fresh.tokens, (i, prompt)
        # between requests nothing of a parked sequence is on the device
        assert int(kvjax.used_cells(on_host.cache)) == 0 and host_cache.parked() == []
        assert all(int(kvjax.seq_pos_max(on_host.cache, s)) == -1 for s in range(n_seq))
        assert host_cache.host.nbytes <= host_cache.host.budget_bytes
        reused += len(prompt) - got.prompt_tokens
    assert host_cache.restores > 0 and host_cache.offloads == 4 + host_cache.restores  # back there after use
    if kind not in ("recurrent", "hybrid"):  # a state read back holds the tail state only: no rollback
        assert reused > 0


def test_a_small_memory_moves_parked_sequences_to_the_host_and_back():
    """More conversations than the device holds: the evicted go to the host, the best match returns."""
    prompts = [
        [1, 2, 3, 4, 5, 6, 7, 8],
        [9, 10, 11, 12, 13, 14],
        [1, 2, 3, 4, 15, 16],
        [17, 18, 19, 1, 2, 3],
        [9, 10, 11, 12, 13, 14, 2],
        [1, 2, 3, 4, 5, 6, 7, 8, 3],
        [17, 18, 19, 1, 2, 3, 4, 4],
    ]
    results = {}
    for host_bytes in (0, 1 << 20):
        eng = engine("unified", size=48, n_seq=3)
        cache = kvjax.PromptCache(n_seq_max=3, max_tokens=48, host_bytes=host_bytes)
        out = []
        for i, prompt in enumerate(prompts):
            got = kvjax.generate(
                eng, [prompt], max_new_tokens=4, key=jax.random.PRNGKey(i), sampling=GREEDY, prompt_cache=cache
            )
            out.append((got.tokens, got.prompt_tokens))
        results[host_bytes] = out, cache
    (without, _), (with_host, cache) = results[0], results[1 << 20]
    assert [t for t, _ in without] == [t for t, _ in with_host]
    assert cache.restores > 0 and cache.offloads > 0
    # the host tier evaluates no more prompt tokens than dropping, and fewer here
    assert sum(n for _, n in with_host) < sum(n for _, n in without)


def test_the_budget_drops_the_least_recently_used_and_is_never_exceeded():
    eng = engine("unified")
    one = len(kvjax.state_write(kvjax.find_slot(memory("unified"), kvjax.make_ubatch(list(range(7)), [[0]] * 7))[0], 0))
    # room for two 7-token sequences (blob and tokens), not three
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64, host_bytes=2 * (one + 7 * 4) + 8, idle_to_host=True)
    for i, prompt in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]):
        kvjax.generate(eng, [prompt], max_new_tokens=4, key=jax.random.PRNGKey(i), sampling=GREEDY, prompt_cache=cache)
        assert cache.host.nbytes <= cache.host.budget_bytes
    assert len(cache.host) == 2 and cache.host.evictions == 1
    assert [cache.host.entry(k).tokens[0] for k in cache.host.keys()] == [5, 9]  # the first one left
    # a sequence larger than the whole budget is dropped, the others kept
    tiny = kvjax.PromptCache(n_seq_max=4, max_tokens=64, host_bytes=16, idle_to_host=True)
    kvjax.generate(eng, [[1, 2, 3, 4]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=tiny)
    assert len(tiny.host) == 0 and tiny.host.evictions == 1 and int(kvjax.used_cells(eng.cache)) == 0


class TierModel:
    """The host tier's rules in plain Python: a list, least recently used first."""

    def __init__(self, budget):
        self.budget, self.entries, self.next, self.dropped = budget, [], 1, 0

    def size(self, tokens, blob):
        return len(blob) + 4 * len(tokens)

    def put(self, tokens, blob):
        need = self.size(tokens, blob)
        if need > self.budget:
            self.dropped += 1
            return False
        while sum(self.size(t, b) for _, t, b in self.entries) + need > self.budget:
            self.entries.pop(0)
            self.dropped += 1
        self.entries.append((self.next, list(tokens), blob))
        self.next += 1
        return True

    def match(self, prompt):
        best = (-1, 0)
        for key, tokens, _ in self.entries:
            common = 0
            while common < min(len(prompt), len(tokens)) and prompt[common] == tokens[common]:
                common += 1
            if common > 0 and common >= best[1]:
                best = (key, common)
        return best

    def take(self, key):
        self.entries = [e for e in self.entries if e[0] != key]


TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=6)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), TOKENS, st.integers(0, 40)),
        st.tuples(st.just("match"), TOKENS),
        st.tuples(st.just("take"), st.integers(0, 3)),
        st.tuples(st.just("touch"), st.integers(0, 3)),
    ),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(OPS, st.integers(1, 120))
def test_store_equals_the_plain_model(ops, budget):
    tier, ref = HostTier(budget), TierModel(budget)
    for op in ops:
        if op[0] == "put":
            assert tier.put(op[1], b"b" * op[2]) == ref.put(op[1], b"b" * op[2])
        elif op[0] == "match":
            assert tier.match(op[1]) == ref.match(op[1])
        elif ref.entries:
            key = ref.entries[op[1] % len(ref.entries)][0]
            if op[0] == "take":
                assert tier.take(key).tokens.tolist() == next(t for k, t, _ in ref.entries if k == key)
                ref.take(key)
            else:
                tier.touch(key)
                ref.entries.append(ref.entries.pop([k for k, _, _ in ref.entries].index(key)))
        assert tier.keys() == [k for k, _, _ in ref.entries]
        assert tier.nbytes == sum(ref.size(t, b) for _, t, b in ref.entries) <= budget
        assert tier.evictions == ref.dropped


def test_bad_arguments_are_refused_by_name():
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="host_bytes"):
            kvjax.PromptCache(n_seq_max=2, max_tokens=8, host_bytes=bad)
    with pytest.raises(ValueError, match="idle_to_host=True is out of range with host_bytes=0"):
        kvjax.PromptCache(n_seq_max=2, max_tokens=8, idle_to_host=True)
    with pytest.raises(ValueError, match="idle_to_host"):
        kvjax.PromptCache(n_seq_max=2, max_tokens=8, host_bytes=64, idle_to_host=1)
    with pytest.raises(ValueError, match="budget_bytes"):
        HostTier(0)
    eng = engine("unified")
    cache = kvjax.PromptCache(n_seq_max=4, max_tokens=64, host_bytes=1 << 20)
    kvjax.generate(eng, [[1, 2, 3]], max_new_tokens=2, key=jax.random.PRNGKey(0), sampling=GREEDY, prompt_cache=cache)
    before = jax.device_get(eng.cache)
    with pytest.raises(ValueError, match=r"seq_id=3 is out of range: allowed a parked sequence, one of \[0\]"):
        cache.to_host(eng, [3])
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(eng.cache)))
    )
    with pytest.raises(ValueError, match="needs a host tier"):
        kvjax.PromptCache(n_seq_max=4, max_tokens=8).to_host(eng)
    assert cache.to_host(eng) == [0] and int(kvjax.used_cells(eng.cache)) == 0 and len(cache.host) == 1
