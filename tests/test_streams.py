"""Per-sequence streams (``kvjax.StreamsConfig``): lock step with ``StreamsRef``, cross-stream copies
of K/V, refusals, the state layout, and decoding equal to one unified cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings, strategies as st

import kvjax
from kvjax.attn import _attention
from kvjax.memory import _stream_attention as _streams
from kvjax import Engine, generate
from kvjax.nn import Llama, LlamaConfig
from kvjax.storage import _quant
from kvjax.testing import StreamsRef
from tests.helpers import assert_cells_match, buffer_writes, no_recompile

BASE = kvjax.CacheConfig(
    size=16, n_seq_max=4, n_layer=1, n_kv_heads=1, head_dim=4, padding=8, rope=kvjax.RopeConfig(n_rot=4)
)


def _compare(memory, ref):
    for s, st_ref in enumerate(ref.streams):
        assert_cells_match(memory.stream(s), st_ref)
    assert int(kvjax.used_cells(memory)) == ref.used
    ref.check_invariants()


def _ubatch(tokens):
    """Tokens grouped by sequence set into one equal-split ubatch when the groups have equal length."""
    groups = {}
    for p, ids in tokens:
        groups.setdefault(tuple(ids), []).append(p)
    lengths = {len(v) for v in groups.values()}
    if len(lengths) == 1:
        return kvjax.make_equal_ubatch([(v, list(k)) for k, v in groups.items()], n_slots=4)
    return kvjax.make_ubatch([p for p, _ in tokens], [ids for _, ids in tokens], length=16)


_JIT = {
    name: jax.jit(getattr(kvjax, name))
    for name in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "find_slot", "update")
}


def _op(n_seq):
    seq = st.integers(0, n_seq - 1)
    pos = st.integers(-1, 12)
    return st.one_of(
        st.tuples(st.just("place"), st.lists(st.tuples(seq, st.integers(1, 4)), min_size=1, max_size=3)),
        st.tuples(st.just("seq_rm"), st.integers(-1, n_seq - 1), pos, pos),
        st.tuples(st.just("seq_cp"), seq, seq, pos, pos),
        st.tuples(st.just("seq_keep"), st.integers(-1, n_seq - 1)),
        st.tuples(st.just("seq_add"), seq, pos, pos, st.integers(-3, 3)),
        st.tuples(st.just("seq_div"), seq, pos, pos, st.integers(1, 3)),
        st.tuples(st.just("update")),
    )


@settings(max_examples=25, deadline=None)
@given(n_stream=st.sampled_from([4, 2]), ops=st.lists(_op(4), min_size=1, max_size=14), jitted=st.booleans())
def test_lock_step_with_the_reference(n_stream, ops, jitted):
    """Every cell of every stream equals StreamsRef's after every operation (grouped streams too)."""
    cfg = kvjax.StreamsConfig(BASE, n_stream=n_stream)
    memory, ref = kvjax.init(cfg), StreamsRef(BASE.size, 4, BASE.padding, n_stream)
    call = (lambda name: _JIT[name]) if jitted else (lambda name: getattr(kvjax, name))
    next_pos = [0] * 4
    for op in ops:
        name, *args = op
        if name == "place":
            tokens = []
            for s, n in dict(args[0]).items():
                tokens += [(next_pos[s] + i, [s]) for i in range(n)]
            ub = _ubatch(tokens)
            memory, placement, ok = call("find_slot")(memory, ub)
            order = np.asarray(ub.seq_ids[:, 0])
            cells, want = ref.find_slot([(int(p), [int(s)]) for p, s, v in zip(ub.pos, order, ub.valid) if v])
            assert bool(ok) == want
            if want:
                got = np.asarray(placement.cell)[np.asarray(ub.valid)]
                assert got.tolist() == cells
                for s, n in dict(args[0]).items():
                    next_pos[s] += n
        elif (
            name == "seq_cp"
            and ref.stream_of(args[0]) != ref.stream_of(args[1])
            and (
                args[2] > 0
                or args[3] >= 0
                or any(c.seqs - {args[1]} for c in ref.streams[ref.stream_of(args[1])].cells)
            )
        ):
            before = jax.tree.map(np.asarray, memory)
            if jitted:  # traced arguments: a no-op flagged on device
                memory = call("seq_cp")(memory, *args)
                assert "seq_id out of range (an op was skipped)" in kvjax.errors(memory)
                memory = kvjax.clear_errors(memory)
                assert jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, np.asarray(b)), before, memory))
            else:
                with pytest.raises(ValueError, match="crosses streams"):  # partial, or into a shared stream
                    kvjax.seq_cp(memory, *args)
            continue
        elif name == "update":
            memory = call("update")(memory)
            ref.update()
        elif name == "seq_rm":
            memory, _ = call("seq_rm")(memory, *args)
            ref.seq_rm(*args)
        else:
            memory = call(name)(memory, *args)
            getattr(ref, name)(*args)
        _compare(memory, ref)
        assert kvjax.errors(memory) == []
        for s in range(-1, 4):
            assert int(kvjax.seq_pos_min(memory, s)) == ref.seq_pos_min(s)
            assert int(kvjax.seq_pos_max(memory, s)) == ref.seq_pos_max(s)
        assert bool(memory.pending()) == (bool(ref.copies) or any(c.delta for r in ref.streams for c in r.cells))


def _random_kv(memory, seed):
    rng = np.random.default_rng(seed)
    k = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in memory.cache.k)
    v = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in memory.cache.v)
    return memory.replace(cache=memory.cache.replace(k=k, v=v))


def test_cross_stream_copies_move_the_whole_buffers_in_llama_cpp_order():
    """cp 0->1, then 1->2, then 3->0: after update stream 1 and 2 hold 0's old K/V, 0 holds 3's."""
    memory = kvjax.init(kvjax.StreamsConfig(BASE.replace(rope=None)))
    memory, _, ok = kvjax.find_slot(memory, kvjax.make_equal_ubatch([([0, 1], [0]), ([0, 1], [3])]))
    memory = _random_kv(memory, 0)
    old = [np.asarray(memory.cache.k[0][s]) for s in range(4)]
    for src, dst in [(0, 1), (1, 2), (3, 0)]:
        memory = kvjax.seq_cp(memory, src, dst)
    assert memory.copy_from.tolist() == [3, 0, 0, -1]
    for donate in (False, True):
        fresh = jax.tree.map(jnp.copy, memory)
        done = kvjax.update(fresh, donate=donate)
        got = [np.asarray(done.cache.k[0][s]) for s in range(4)]
        np.testing.assert_array_equal(got[0], old[3])
        np.testing.assert_array_equal(got[1], old[0])
        np.testing.assert_array_equal(got[2], old[0])
        np.testing.assert_array_equal(got[3], old[3])
        assert not bool(done.pending())
    # cells: stream 0 now holds sequence 0 only as a copy of 3's cells
    assert int(kvjax.seq_pos_max(done, 0)) == 1 and int(kvjax.seq_pos_max(done, 2)) == 1


def test_a_token_of_two_streams_is_refused_and_changes_nothing():
    memory = kvjax.init(kvjax.StreamsConfig(BASE))
    before = jax.tree.map(np.asarray, memory)
    with pytest.raises(ValueError, match=r"ubatch token 0 belongs to sequences \[0, 1\] of streams \[0, 1\]"):
        kvjax.find_slot(memory, kvjax.make_ubatch([0], [[0, 1]]))
    for fn in (jax.jit(kvjax.find_slot),):
        got, placement, ok = fn(memory, kvjax.make_ubatch([0], [[0, 1]]))
        assert not bool(ok) and (np.asarray(placement.cell) == -1).all()
        assert jax.tree.all(
            jax.tree.map(
                lambda a, b: np.array_equal(a, np.asarray(b)),
                before.cache,
                got.cache.replace(cells=got.cache.cells.replace(error=memory.cache.cells.error)),
            )
        )
        assert kvjax.errors(got)  # the refusal is flagged
    # within one stream (grouped streams) a shared token is fine
    grouped = kvjax.init(kvjax.StreamsConfig(BASE, n_stream=2))
    _, _, ok = kvjax.find_slot(grouped, kvjax.make_ubatch([0], [[0, 1]]))
    assert bool(ok)


def test_eager_operations_are_one_program_each_and_leave_the_k_v_buffers_alone():
    """Called eagerly, a stream operation compiles once (one program over the metadata, not a
    dispatch per primitive) and hands back the very K/V arrays it was given (a jitted function's
    returned arrays are fresh copies: K/V must not pass through it)."""
    from tests.helpers import CompileCounter

    memory = kvjax.init(kvjax.StreamsConfig(BASE))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]]))
    memory = kvjax.update(kvjax.seq_cp(memory, 0, 1))
    calls = {
        "seq_rm": lambda m, i: kvjax.seq_rm(m, 1, i, -1)[0],
        "seq_cp": lambda m, i: kvjax.seq_cp(m, 0, 2 + i % 2),
        "seq_add": lambda m, i: kvjax.seq_add(m, 0, i, -1, 2),
        "seq_div": lambda m, i: kvjax.seq_div(m, 0, i, -1, 2),
        "seq_keep": lambda m, i: kvjax.seq_keep(m, i),
        "find_slot": lambda m, i: kvjax.find_slot(m, kvjax.make_ubatch([8 + i], [[3]]))[0],
        "seq_pos_max": lambda m, i: kvjax.seq_pos_max(m, i),
        "used_cells": lambda m, i: kvjax.used_cells(m),
    }
    for name, call in calls.items():
        with CompileCounter() as first:
            out = call(memory, 0)
        assert first.count <= 2, (name, first.count)  # the op's program (and the copy check's)
        with no_recompile():
            out = call(memory, 1)  # new values: nothing compiles
        if isinstance(out, kvjax.StreamCache):
            assert all(a is b for a, b in zip(out.cache.k + out.cache.v, memory.cache.k + memory.cache.v)), name


def test_config_bad_input():
    with pytest.raises(ValueError, match=r"n_stream=0 is out of range: allowed an integer in \[1, n_seq_max=4\]"):
        kvjax.StreamsConfig(BASE, n_stream=0)
    with pytest.raises(ValueError, match=r"n_stream=5 is out of range"):
        kvjax.StreamsConfig(BASE, n_stream=5)
    with pytest.raises(ValueError, match="base must be a kvjax.CacheConfig"):
        kvjax.StreamsConfig("big")


def test_state_layout_is_llama_cpps_and_reads_a_unified_sequence():
    memory = kvjax.init(kvjax.StreamsConfig(BASE))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([([0, 1, 2], [1]), ([0, 1, 2], [2])]))
    memory = _random_kv(memory, 1)
    blob = kvjax.state_write(memory)
    n_stream, count0, count1 = np.frombuffer(blob[:12], "<u4")
    assert (n_stream, count0, count1) == (4, 0, 3)  # stream 0 empty, stream 1 three cells
    with pytest.raises(kvjax.StateError, match="n_stream: expected 2"):
        kvjax.state_read(kvjax.init(kvjax.StreamsConfig(BASE, n_stream=2)), blob)
    # a sequence saved from a unified cache goes into its stream
    unified = kvjax.init(BASE)
    unified, _, _ = kvjax.find_slot(unified, kvjax.make_ubatch([0, 1], [[3], [3]]))
    unified = unified.replace(k=tuple(jnp.ones_like(x) for x in unified.k))
    from kvjax.io._llama_state import stream_state_write

    restored = kvjax.state_read(memory, stream_state_write(unified, 3), 3)
    assert int(kvjax.seq_pos_max(restored, 3)) == 1
    np.testing.assert_array_equal(np.asarray(restored.cache.k[0][3][:, :, :2]), 1.0)
    assert int(kvjax.seq_pos_max(restored, 1)) == 2  # the other streams are untouched


# -- the attention path ------------------------------------------------------------------------


@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_model_step_updates_the_stream_buffers_in_place(n_seq):
    """The compiled model step over a stream memory holds no copy of the K/V buffers.

    With the buffers reshaped to ``[S * L, ...]`` for attention, XLA fused a one-row write into
    that reshape too and copied every stream's K/V twice per layer to keep both results: a decode
    step of one sequence took 200 ms at 4 x 4096 cells instead of 4 ms. The step still gives the
    logits of the same model over a unified cache."""
    from flax import nnx as _nnx
    from kvjax.nn import make_step

    model = Llama(LlamaConfig(vocab_size=48, d_model=32, n_layer=2, n_heads=4, n_kv_heads=2), rngs=_nnx.Rngs(0))
    base = model.config.cache_config(size=256, n_seq_max=4, padding=32)
    memory = kvjax.init(kvjax.StreamsConfig(base))
    ubatch = kvjax.make_ubatch([0] * n_seq, [[s] for s in range(n_seq)])
    tokens = jnp.arange(1, n_seq + 1, dtype=jnp.int32)
    step = make_step(model)
    copies = buffer_writes(step, model, memory, ubatch, tokens, windows=(32,))["copy"]
    assert not copies, copies[:3]
    logits, _, ok = step(_nnx.state(model), memory, ubatch, tokens, n_kv=32)
    want, _, _ = make_step(model)(
        _nnx.state(model),
        kvjax.init(model.config.cache_config(size=256, n_seq_max=4, padding=32)),
        ubatch,
        tokens,
        n_kv=32,
    )
    assert bool(ok)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(want), atol=1e-5)


def test_stream_attention_equals_unified_attention_per_stream_jitted_and_eager():
    """Each slot's output equals kvjax.attention over that stream alone (as a plain unified cache)."""
    base = kvjax.CacheConfig(size=32, n_seq_max=4, n_layer=1, n_kv_heads=2, head_dim=8, padding=8)
    memory = kvjax.init(kvjax.StreamsConfig(base))
    rng = np.random.default_rng(0)
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([(list(range(9)), [0]), (list(range(9)), [2])]))
    memory = _random_kv(memory, 2)
    ub = kvjax.make_equal_ubatch([([9, 10], [0]), ([9, 10], [2]), ([0, 1], [3])], n_slots=4)
    memory, placement, ok = kvjax.find_slot(memory, ub)
    q = jnp.asarray(rng.normal(size=(8, 4, 8)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(8, 2, 8)), jnp.float32)

    def run(memory, q, kv):
        cache = _streams.write(memory.cache, 0, placement, kv, kv * 2)
        memory = memory.replace(cache=cache)
        return _streams.attention(q, memory, 0, _streams.masks(memory, ub, placement, 32), placement, ub), memory

    eager, written = run(memory, q, kv)
    jitted, _ = jax.jit(run)(memory, q, kv)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), rtol=1e-6, atol=1e-6)
    for slot, stream in enumerate([0, 2, 3]):
        rows = slice(2 * slot, 2 * slot + 2)
        sub = kvjax.make_ubatch(np.asarray(ub.pos[rows]), [[stream]] * 2)
        one = written.stream(stream)
        want = kvjax.attention(q[rows], one, 0, kvjax.kq_mask(one, sub, 32))
        np.testing.assert_allclose(np.asarray(eager[rows]), np.asarray(want), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(eager[6:]), 0.0)  # the padding slot


@pytest.mark.parametrize(
    "kv_dtype,alibi,softcap,pairs",
    [
        ("float32", False, None, False),
        ("float16", True, None, False),
        ("float32", False, 5.0, False),
        ("q8_0", False, None, False),
        ("float32", False, None, True),
    ],
)
def test_slots_in_one_loop_equal_slot_by_slot(monkeypatch, kv_dtype, alibi, softcap, pairs):
    """All slots in one loop up to the longest stream give each slot what its own loop gives.

    ``pairs``: a gathered-block budget that holds two slots' chunks, so two loops of two slots run.

    The streams are 37, 3 and 0 cells long in chunks of 8 (the per-slot loops run 5, 1 and 0 steps,
    the batched one 5 for all), a padding slot follows, the layer is the second of two, two query
    heads share a kv head, and two rows a slot. Bytes the short streams never wrote sit in the
    chunks only the batched loop reads: NaN in K and V past stream 2's last cell (the per-slot loop
    never reads them) must change nothing, and a NaN V row stream 0 does see makes its rows NaN
    both ways.
    """
    monkeypatch.setattr(_attention, "MAX_CHUNK", 8)
    if pairs:  # a chunk of 8 cells, 2 kv heads of 32 floats: 4096 bytes hold two slots' K block
        monkeypatch.setattr(_attention, "GATHER_BLOCK_BYTES", 4096)
    base = kvjax.CacheConfig(
        size=64, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=32, padding=8, k_dtype=kv_dtype, v_dtype=kv_dtype
    )
    memory = kvjax.init(kvjax.StreamsConfig(base))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([(list(range(37)), [0])]))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([(list(range(3)), [2])]))
    rng = np.random.default_rng(1)
    k_old, v_old = (
        _quant.to_storage(jnp.asarray(rng.normal(size=(4, 2, 2, 64, 32)), jnp.float32), kv_dtype) for _ in range(2)
    )
    memory = memory.replace(cache=memory.cache.replace(k=(k_old,), v=(v_old,)))
    ub = kvjax.make_equal_ubatch([([37, 38], [0]), ([3, 4], [2]), ([0, 1], [3])], n_slots=4)
    memory, placement, ok = kvjax.find_slot(memory, ub)
    assert bool(ok)
    k_new, v_new = (jnp.asarray(rng.normal(size=(8, 2, 32)), jnp.float32) for _ in range(2))
    cache = _streams.write(memory.cache, 1, placement, k_new, v_new)
    if kv_dtype != "q8_0":
        k, v = cache.k[0], cache.v[0]  # [S, L, H, C, D]
        k, v = k.at[2, 1, :, 5:].set(jnp.nan), v.at[2, 1, :, 5:].set(jnp.nan)  # unwritten by stream 2
        cache = cache.replace(k=(k,), v=(v,))
    memory = memory.replace(cache=cache)
    q = jnp.asarray(rng.normal(size=(8, 4, 32)), jnp.float32)
    masks = _streams.masks(memory, ub, placement, 64, alibi=alibi)
    streams = _streams._slot_streams(placement, ub)
    live = _streams._slot_extents(memory.cache, streams)
    assert np.asarray(live).tolist() == [39, 5, 2, 0]
    slopes = np.asarray([0.5, 0.25, 0.125, 0.0625], np.float32) if alibi else None

    def run(memory, q, batched, live=live):  # batched: one loop whatever the extents
        c = memory.cache
        with monkeypatch.context() as patch:
            patch.setattr(_streams, "ONE_LOOP_READ_FACTOR", 1e9 if batched else 0.0)
            return _streams._slots_attention(
                q, c.k[0], c.v[0], 1, masks, streams, live, (4, 2), c.config, None, slopes, softcap, batched=batched
            )

    one_loop, by_slot = run(memory, q, True), run(memory, q, False)
    assert np.isfinite(np.asarray(by_slot)).all()
    np.testing.assert_allclose(np.asarray(one_loop), np.asarray(by_slot), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(
        np.asarray(jax.jit(run, static_argnums=2)(memory, q, True)), np.asarray(by_slot), rtol=2e-6, atol=2e-6
    )
    np.testing.assert_array_equal(np.asarray(one_loop[6:]), 0.0)  # the padding slot
    # a slot with nothing to read (on a mesh: its stream is another device's) gives zeros, whatever its mask
    for batched in (True, False):
        np.testing.assert_array_equal(np.asarray(run(memory, q, batched, live.at[1].set(0))[2:4]), 0.0)
    if kv_dtype != "q8_0":  # a NaN V row stream 0 sees: its rows are NaN both ways, the others are not
        memory = memory.replace(cache=memory.cache.replace(v=(memory.cache.v[0].at[0, 1, 0, 9].set(jnp.nan),)))
        one_loop, by_slot = np.asarray(run(memory, q, True)), np.asarray(run(memory, q, False))
        np.testing.assert_array_equal(np.isnan(one_loop), np.isnan(by_slot))
        assert np.isnan(one_loop[:2, :2]).all() and np.isfinite(one_loop[2:]).all()
        np.testing.assert_allclose(one_loop, by_slot, rtol=2e-6, atol=2e-6)


# -- decoding: streams equal one unified cache ------------------------------------------------------

CFG = LlamaConfig(vocab_size=48, d_model=32, n_layer=2, n_heads=4, n_kv_heads=2)
GREEDY = kvjax.SamplingConfig(temperature=0)
PROMPTS = [[5, 6, 7, 8, 9, 10, 1, 2], [5, 6, 7, 8, 9, 10, 3], [5, 6, 7, 8, 9, 10, 11, 12, 13, 4]]


@functools.lru_cache(maxsize=None)
def _model():
    return Llama(CFG, rngs=nnx.Rngs(3))


def _engine(streams, n_stream=None):
    base = CFG.cache_config(size=64 if streams else 256, n_seq_max=4, padding=32)
    return Engine(_model(), kvjax.init(kvjax.StreamsConfig(base, n_stream=n_stream) if streams else base))


def test_decode_logits_equal_a_unified_cache():
    """A batch of sequences of different lengths, then a decode step: logits equal (float tolerance)."""
    got = {}
    for name, engine in [("unified", _engine(False)), ("streams", _engine(True)), ("grouped", _engine(True, 2))]:
        # grouped: 0 and 1 share stream 0, 2 and 3 stream 1 (copied into before 3 arrives)
        first = engine.decode([1, 2, 3, 4, 5], [0, 1, 2, 0, 1], [[0], [0], [0], [1], [1]])
        engine.cache = kvjax.seq_cp(engine.cache, 0, 2)  # a whole-sequence copy (across streams)
        second = engine.decode([8, 9, 6, 7, 10, 11], [3, 2, 0, 1, 2, 3], [[0], [1], [3], [3], [3], [2]])
        got[name] = np.asarray(first), np.asarray(second)
    for name in ("streams", "grouped"):
        for a, b in zip(got["unified"], got[name]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_generation_equals_a_unified_cache_and_new_values_do_not_recompile():
    """Greedy generation with a shared prompt prefix (copied across streams) gives the same tokens."""
    want = generate(_engine(False), PROMPTS, max_new_tokens=20, key=jax.random.PRNGKey(0), sampling=GREEDY).tokens
    engine = _engine(True)
    out = generate(engine, PROMPTS, max_new_tokens=20, key=jax.random.PRNGKey(0), sampling=GREEDY)
    assert out.tokens == want and out.prompt_tokens == 13
    # the same shapes with other tokens and positions: nothing new to compile
    for s in range(3):
        engine.cache, _ = kvjax.seq_rm(engine.cache, s, -1, -1)
    engine.decode([3, 4, 5], [0, 0, 0], [[0], [1], [2]], outputs="last")
    with no_recompile():
        engine.decode([6, 7, 8], [1, 1, 1], [[0], [1], [2]], outputs="last")
        engine.decode([9, 1, 2], [2, 2, 2], [[0], [1], [2]], outputs="last")
