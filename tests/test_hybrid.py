"""The hybrid model through the hybrid memory: cached equals uncached, and the memory's rules.

A Jamba-like model (attention layers on a unified or iSWA cache, Mamba layers on recurrent states)
decoded token by token equals its uncached forward; sequences together equal each alone; a fork
and a rollback continue exactly; a refused removal changes neither part; state blobs round trip.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import HybridLM, HybridLMConfig

CFG = HybridLMConfig(vocab_size=40, d_model=16, n_layer=4, recurrent_layers=(0, 2), n_heads=2, n_kv_heads=1, d_state=4)
ATOL = 3e-5


@pytest.fixture(scope="module")
def model():
    m = HybridLM(CFG, rngs=nnx.Rngs(2))
    nnx.update(m, jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param)))
    return m


def full(model, tokens):
    return np.asarray(
        jax.jit(lambda s, t: nnx.merge(nnx.graphdef(model), s).forward(t))(nnx.state(model), jnp.asarray([tokens]))[0]
    )


def engine(model, n_states=1, size=64, n_seq=3):
    return kvjax.Engine(
        model, kvjax.init(CFG.memory_config(size=size, n_seq_max=n_seq, n_states=n_states, padding=16)), n_ubatch=16
    )


def test_token_by_token_equals_the_full_forward(model):
    tokens = [3, 7, 1, 9, 12, 5, 30, 2, 8, 11, 4]
    eng = engine(model)
    got = [np.asarray(eng.decode(tokens[:7], range(7), [[0]] * 7))]
    for p in range(7, len(tokens)):
        got.append(np.asarray(eng.decode([tokens[p]], [p], [[0]])))
    np.testing.assert_allclose(np.concatenate(got), full(model, tokens), atol=ATOL)


def test_sequences_together_equal_each_alone_and_a_fork(model):
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    eng = engine(model)
    logits = np.asarray(eng.decode(prompts[0] + prompts[1], list(range(5)) + list(range(3)), [[0]] * 5 + [[1]] * 3))
    np.testing.assert_allclose(logits[:5], full(model, prompts[0]), atol=ATOL)
    np.testing.assert_allclose(logits[5:], full(model, prompts[1]), atol=ATOL)
    eng.cache = kvjax.seq_cp(eng.cache, 0, 2)
    out = np.asarray(eng.decode([6, 6, 10], [5, 3, 5], [[0], [1], [2]]))
    np.testing.assert_allclose(out[0], full(model, prompts[0] + [6])[-1], atol=ATOL)
    np.testing.assert_allclose(out[1], full(model, prompts[1] + [6])[-1], atol=ATOL)
    np.testing.assert_allclose(out[2], full(model, prompts[0] + [10])[-1], atol=ATOL)


def test_rollback_and_refusal(model):
    eng = engine(model, n_states=3)
    prompt = [4, 8, 15, 16, 23]
    eng.decode(prompt, range(5), [[0]] * 5)
    eng.decode([1], [5], [[0]])
    eng.decode([2], [6], [[0]])
    before = jax.device_get(eng.cache)
    memory, ok = kvjax.seq_rm(eng.cache, 0, 2, -1)  # deeper than the kept states: refused by both
    assert not bool(ok)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(memory))))
    eng.rollback(0, 5)
    assert int(kvjax.seq_pos_max(eng.cache, 0)) == 4
    assert int(kvjax.seq_pos_max(eng.cache.attention, 0)) == 4
    out = np.asarray(eng.decode([3], [5], [[0]]))
    np.testing.assert_allclose(out[0], full(model, prompt + [3])[-1], atol=ATOL)


@pytest.mark.slow  # generate on a hybrid runs by default in the prompt-cache and speculative tests
def test_generate_equals_uncached_greedy(model):
    prompts = [[1, 2, 3], [1, 2, 9, 9]]
    out = kvjax.generate(
        engine(model),
        prompts,
        max_new_tokens=5,
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=0),
    )
    for p, got in zip(prompts, out.tokens):
        seq = list(p)
        for _ in range(5):
            seq.append(int(np.argmax(full(model, seq)[-1])))
        assert got == seq[len(p) :]


def test_state_round_trip_and_corrupt_blobs(model):
    eng = engine(model)
    eng.decode([5, 6, 7, 8], range(4), [[1]] * 4)
    blob = kvjax.state_write(eng.cache, 1)
    fresh = engine(model)
    fresh.cache = kvjax.state_read(fresh.cache, blob, 1)
    out = np.asarray(fresh.decode([9], [4], [[1]]))
    np.testing.assert_allclose(out[0], full(model, [5, 6, 7, 8, 9])[-1], atol=ATOL)
    whole = kvjax.state_write(eng.cache)
    assert kvjax.state_write(kvjax.state_read(engine(model).cache, whole)) == whole
    with pytest.raises(kvjax.StateError):
        kvjax.state_read(fresh.cache, whole[:-3])


@pytest.mark.slow  # the iSWA part of a hybrid also runs in the contract table
def test_iswa_attention_part(model):
    attn = CFG.llama.cache_config(size=64, n_seq_max=2, layer_filter=CFG.attention_layers, padding=16)
    hybrid = kvjax.HybridConfig(
        kvjax.IswaConfig(attn, swa_layers=(3,), n_swa=1024, n_batch=16),
        CFG.mamba.memory_config(2),
        recurrent_layers=CFG.recurrent_layers,
    )
    eng = kvjax.Engine(model, kvjax.init(hybrid), n_ubatch=16)
    tokens = [3, 1, 4, 1, 5, 9, 2]
    got = np.asarray(eng.decode(tokens, range(7), [[0]] * 7))
    np.testing.assert_allclose(got, full(model, tokens), atol=ATOL)


def test_scan_forms_agree_and_a_bad_one_is_refused(model):
    """The hybrid's Mamba layers take ``scan`` (CPU's default: sequential); the chunked form of the
    same weights gives the same logits, prefill and decode."""
    chunked = HybridLM(dataclasses.replace(CFG, scan="chunked"), rngs=nnx.Rngs(2))
    nnx.update(chunked, nnx.state(model))
    assert chunked.config.mamba.scan == "chunked" and model.config.mamba.scan == "auto"
    tokens = [3, 7, 1, 9, 12, 5, 30, 2, 8, 11, 4]
    np.testing.assert_allclose(full(chunked, tokens), full(model, tokens), atol=ATOL)
    eng = kvjax.Engine(chunked, kvjax.init(CFG.memory_config(size=64, n_seq_max=1, padding=16)), n_ubatch=16)
    np.testing.assert_allclose(
        np.asarray(eng.decode(tokens, range(len(tokens)), [[0]] * len(tokens))), full(model, tokens), atol=ATOL
    )
    with pytest.raises(ValueError, match=r"^scan='fast' is out of range"):
        HybridLMConfig(scan="fast")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(recurrent_layers=(0, 9)), r"recurrent_layers=\(0, 9\) is out of range"),
        (dict(recurrent_layers=()), r"recurrent_layers=\(\) is out of range"),
        (dict(attention=None), r"attention must be a kvjax.CacheConfig"),
    ],
)
def test_bad_config_names_the_argument(kwargs, match):
    base = dict(
        attention=CFG.llama.cache_config(size=64, n_seq_max=2, layer_filter=CFG.attention_layers),
        recurrent=CFG.mamba.memory_config(2),
        recurrent_layers=CFG.recurrent_layers,
    )
    with pytest.raises(ValueError, match=match):
        kvjax.HybridConfig(**{**base, **kwargs})


def test_parts_that_disagree_are_refused():
    with pytest.raises(ValueError, match="allowed exactly the attention layers"):
        kvjax.HybridConfig(
            CFG.llama.cache_config(size=64, n_seq_max=2),
            CFG.mamba.memory_config(2),
            recurrent_layers=CFG.recurrent_layers,
        )
    with pytest.raises(ValueError, match="n_seq_max=3: allowed the attention part's n_seq_max=2"):
        kvjax.HybridConfig(
            CFG.llama.cache_config(size=64, n_seq_max=2, layer_filter=CFG.attention_layers),
            CFG.mamba.memory_config(3),
            recurrent_layers=CFG.recurrent_layers,
        )
