"""The device decode loop (``kvjax/engine/_device_loop.py``): exactly the host loop's tokens for the
same key on every memory kind, many tokens per dispatch, no recompiles for new values, bad input
refused with the memory unchanged.

The host loop (``device_loop=False``) is the reference: ``tests/test_engine.py`` and the memory
tests prove it against uncached passes.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine, generate, generate_stream
from kvjax.nn import HybridLM, HybridLMConfig, Llama, LlamaConfig
from kvjax.nn._mamba import Mamba, MambaConfig
from tests.helpers import USER_HLO, no_recompile

GREEDY = kvjax.SamplingConfig(temperature=0)
SAMPLED = kvjax.SamplingConfig(temperature=1.5, top_k=24)
LLAMA = LlamaConfig(vocab_size=48, d_model=16, n_layer=2, n_heads=2, n_kv_heads=1)
SWA = LlamaConfig(vocab_size=48, d_model=16, n_layer=2, n_heads=2, n_kv_heads=1, swa_layers=(1,), n_swa=6)
MAMBA = MambaConfig(vocab_size=40, d_model=16, n_layer=2, d_state=4, d_conv=4, scan_chunk=4)
HYBRID = HybridLMConfig(vocab_size=40, d_model=16, n_layer=2, recurrent_layers=(0,), n_heads=2, n_kv_heads=1, d_state=4)
PROMPTS = [[5, 6, 7, 8, 9, 10, 1, 2], [5, 6, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 4]]


@functools.lru_cache(maxsize=None)
def _model(kind):
    if kind in ("unified", "iswa", "streams"):
        return Llama(SWA if kind == "iswa" else LLAMA, rngs=nnx.Rngs(3))
    model = Mamba(MAMBA, rngs=nnx.Rngs(3)) if kind == "recurrent" else HybridLM(HYBRID, rngs=nnx.Rngs(2))
    # larger weights than the initialiser's, so that states matter to the tokens
    nnx.update(model, jax.tree.map(lambda x: x * 1.5, nnx.state(model, nnx.Param)))
    return model


def _engine(kind, size=128, n_seq=4, padding=16, **kwargs):
    if kind == "unified":
        config = LLAMA.cache_config(size=size, n_seq_max=n_seq, padding=padding)
    elif kind == "iswa":
        config = kvjax.IswaConfig(
            SWA.cache_config(size=size, n_seq_max=n_seq, padding=16), swa_layers=(1,), n_swa=6, n_batch=16
        )
    elif kind == "streams":  # one stream per sequence: placement and attention per stream
        config = kvjax.StreamsConfig(LLAMA.cache_config(size=size, n_seq_max=n_seq, padding=padding))
    elif kind == "recurrent":
        config = MAMBA.memory_config(n_seq)
    else:
        config = HYBRID.memory_config(size=size, n_seq_max=n_seq, padding=16)
    return Engine(_model(kind), kvjax.init(config), **kwargs)


def _both(kind, prompts, engine_args=None, **kwargs):
    """``generate`` by the host loop and by the device loop on fresh engines; both results."""
    host = generate(_engine(kind, **(engine_args or {})), prompts, device_loop=False, **kwargs)
    device = generate(_engine(kind, **(engine_args or {})), prompts, **kwargs)
    return host, device


# each memory kind compiles its own programs (host and device loops, ~30 s here): the two placement
# every memory kind the protocol offers, by default
@pytest.mark.parametrize(
    "kind", ["unified", "recurrent", "iswa", "streams", pytest.param("hybrid", marks=pytest.mark.slow)]
)
def test_device_loop_gives_the_host_loops_tokens(kind):
    """Sampled (top-k) with different prompt lengths, budgets and a stop token; windows grow from 16
    cells past 64 (iSWA: its window cache prunes and wraps), sequences stop at different steps."""
    # a recurrent memory compiles a program per power-of-two piece of an equal-split prompt: short ones
    prompts = PROMPTS if kind in ("unified", "iswa", "streams") else [[5, 6, 7, 8], [9, 3], [4]]
    host, device = _both(
        kind,
        prompts,
        max_new_tokens=[30, 9, 22],
        key=jax.random.PRNGKey(4),
        sampling=SAMPLED,
        stop_tokens=[17],
        sync_every=8,
    )
    assert device.tokens == host.tokens
    assert [len(t) for t in host.tokens] != [30, 9, 22] or 17 not in sum(host.tokens, [])
    assert host.dispatches == 0 and 0 < device.dispatches < sum(len(t) for t in host.tokens) // 2


def test_greedy_parallel_and_context_shift():
    """Greedy n_parallel continuations reach n_ctx: the loop returns for each shift, the host shifts."""
    # one window bucket (padding = size): the shifts are what this test is about
    host, device = _both(
        "unified",
        [PROMPTS[0]],
        dict(size=64, padding=64),
        max_new_tokens=40,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        n_parallel=2,
        n_ctx=24,
        n_keep=4,
    )
    assert host.context_shifts >= 3 and device.context_shifts == host.context_shifts
    assert device.tokens == host.tokens


def test_few_dispatches_and_streaming_in_chunks():
    engine = _engine("unified", size=128, padding=128)  # one window, no context shift
    chunks, stats = [], {}
    for s, tok in generate_stream(
        engine, PROMPTS[:2], max_new_tokens=40, key=jax.random.PRNGKey(1), sampling=GREEDY, sync_every=16, stats=stats
    ):
        chunks.append(s)
    assert len(chunks) == 80
    # 39 steps after the first token, 16 per dispatch: 3 dispatches, plus the run-ahead one that
    # finds nothing to do
    assert stats["dispatches"] == 4
    # the shared prefix [5, 6] once, each sequence's own prompt, then 39 fed tokens each
    assert engine.n_decoded == stats["prompt_tokens"] + 2 * 39


def test_the_compiled_loop_copies_no_kv_buffer(monkeypatch):
    """The K/V buffers go through the loop in place: no ``copy`` of a K/V-shaped array in the
    compiled loop (a lax.cond around the step once made XLA copy every K/V group per token)."""
    from kvjax.engine import _device_loop

    texts, jit_loop = [], _device_loop._jit_loop

    def spy(*args):
        loop = jit_loop(*args)

        def call(*a, **kw):
            texts.append(loop.lower(*a, **kw).compile(compiler_options=USER_HLO).as_text())
            return loop(*a, **kw)

        return call

    monkeypatch.setattr(_device_loop, "_jit_loop", spy)
    engine = _engine("unified", size=128, padding=128)
    k_shape = engine.cache.k[0].shape
    generate(engine, PROMPTS[:1], max_new_tokens=6, key=jax.random.PRNGKey(0), sampling=GREEDY, sync_every=4)
    assert texts
    shape = "f32[" + ",".join(map(str, k_shape)) + "]"
    copies = [line for text in texts for line in text.splitlines() if shape in line and " copy(" in line]
    assert not copies, copies[:2]


def test_new_prompts_keys_budgets_and_stops_do_not_recompile():
    def run(prompts, key, budgets, stops):
        return generate(
            _engine("unified"),
            prompts,
            max_new_tokens=budgets,
            key=jax.random.PRNGKey(key),
            sampling=SAMPLED,
            stop_tokens=stops,
            sync_every=8,
        )

    first = run([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], 0, [10, 24], [])
    unused = sorted(set(range(48)) - set(sum(first.tokens, [])))
    with no_recompile():
        again = run([[3, 2, 1, 4, 5, 6], [9, 8, 7, 10, 11, 13]], 0, [24, 10], [])
        assert [len(t) for t in again.tokens] == [24, 10]
    # a stop token that ends nothing: the same shapes, new values
    with no_recompile():
        same = run([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]], 0, [10, 24], unused[:1])
    assert same.tokens == first.tokens


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sync_every=0), r"sync_every=0 is out of range: allowed an integer in \[1, 4096\]"),
        (dict(sync_every=5000), r"sync_every=5000 is out of range: allowed an integer in \[1, 4096\]"),
        (dict(sync_every=2.0), r"sync_every=2.0 is out of range"),
        (dict(device_loop="yes"), r"device_loop='yes' is out of range: allowed True or False"),
        (dict(max_new_tokens=[3]), r"max_new_tokens has 1 entries: allowed an int, or one int per sequence \(2\)"),
        (
            dict(max_new_tokens=[3, 0]),
            r"max_new_tokens\[1\]=0 is out of range: allowed an integer in \[1, 1073741824\]",
        ),
    ],
)
def test_bad_arguments_name_the_argument_and_change_nothing(kwargs, match):
    engine = _engine("unified")
    engine.decode([1, 2, 3], [0, 1, 2], [[3]] * 3)
    before = kvjax.cell_table(engine.cache)
    args = dict(max_new_tokens=4, key=jax.random.PRNGKey(0), sampling=GREEDY)
    with pytest.raises(ValueError, match=match):
        generate(engine, PROMPTS[:2], **{**args, **kwargs})
    for a, b in zip(before, kvjax.cell_table(engine.cache)):
        np.testing.assert_array_equal(a, b)
