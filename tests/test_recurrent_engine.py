"""A Mamba model through the recurrent memory: the jitted step, the engine and generate.

Numerical proof that the memory carries states exactly: decoding token by token through the
memory equals the uncached forward pass; sequences decoded together equal each alone; a fork
(``seq_cp``, then copy-on-write on the first decode) continues exactly as the original; a rollback
equals never having decoded the dropped tokens; a state blob restored into a fresh memory
continues the same; and the engine's logits equal Hugging Face's ``MambaForCausalLM``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import make_step
from kvjax.nn._mamba import Mamba, MambaConfig
from kvjax.nn._mamba_hf import params_from_hf
from tests.helpers import buffer_writes, no_recompile

CFG = MambaConfig(vocab_size=40, d_model=16, n_layer=2, d_state=4, d_conv=4, scan_chunk=4)
ATOL = 2e-5
GREEDY = kvjax.SamplingConfig(temperature=0)


@pytest.fixture(scope="module")
def model():
    m = Mamba(CFG, rngs=nnx.Rngs(3))
    # larger weights than the initialiser's, so that states matter to the logits
    state = jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param))
    nnx.update(m, state)
    return m


def full(model, tokens):
    return np.asarray(
        jax.jit(lambda s, t: nnx.merge(nnx.graphdef(model), s).forward(t))(nnx.state(model), jnp.asarray([tokens]))[0]
    )


def engine(model, n_seq=4, size=None, n_states=1, n_ubatch=16):
    return kvjax.Engine(model, kvjax.init(CFG.memory_config(n_seq, size=size, n_states=n_states)), n_ubatch=n_ubatch)


@pytest.mark.parametrize("n_seq", [4, 1], ids=["four-cells", "one-cell"])
def test_token_by_token_equals_the_full_forward(model, n_seq):
    """Cached equals uncached, in a memory of several cells and in a one-cell memory (whose buffer
    is the row: read as itself, replaced by a select)."""
    tokens = [3, 7, 1, 9, 12, 5, 30, 2, 8, 11]
    eng = engine(model, n_seq=n_seq)
    got = [np.asarray(eng.decode(tokens[:5], range(5), [[0]] * 5))]  # a prefill (4 + 1)
    for p in range(5, len(tokens)):
        got.append(np.asarray(eng.decode([tokens[p]], [p], [[0]])))
    np.testing.assert_allclose(np.concatenate(got), full(model, tokens), atol=ATOL)


def test_sequences_together_equal_each_alone(model):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], [4, 4, 4, 4, 4]]
    eng = engine(model)
    toks, pos, ids = [], [], []
    for s, p in enumerate(prompts):
        toks += p
        pos += range(len(p))
        ids += [[s]] * len(p)
    logits = np.asarray(eng.decode(toks, pos, ids))
    off = 0
    for p in prompts:
        np.testing.assert_allclose(logits[off : off + len(p)], full(model, p), atol=ATOL)
        off += len(p)
    nxt = np.asarray(eng.decode([5, 6, 7], [len(p) for p in prompts], [[0], [1], [2]]))
    for s, p in enumerate(prompts):
        np.testing.assert_allclose(nxt[s], full(model, p + [5 + s])[-1], atol=ATOL)


def test_a_fork_continues_as_the_original(model):
    prompt = [5, 6, 7, 8, 9, 10]
    eng = engine(model)
    eng.decode(prompt, range(6), [[0]] * 6)
    eng.cache = kvjax.seq_cp(eng.cache, 0, 1)
    assert int(kvjax.used_cells(eng.cache)) == 1  # shared, no bytes copied
    out = np.asarray(eng.decode([11, 12], [6, 6], [[0], [1]]))  # copy-on-write here
    assert int(kvjax.used_cells(eng.cache)) == 2
    np.testing.assert_allclose(out[0], full(model, prompt + [11])[-1], atol=ATOL)
    np.testing.assert_allclose(out[1], full(model, prompt + [12])[-1], atol=ATOL)
    table = kvjax.cell_table(eng.cache)
    assert sorted(table.tail[:2].tolist()) == [0, 1] and table.src[:2].tolist() == [0, 1]


def test_rollback_equals_never_decoding(model):
    prompt = [2, 4, 6, 8, 10, 12]
    eng = engine(model, n_states=4)
    eng.decode(prompt, range(6), [[0]] * 6)
    eng.decode([1], [6], [[0]])
    eng.decode([2], [7], [[0]])
    eng.rollback(0, 6)  # drop positions 6 and 7
    assert int(kvjax.seq_pos_max(eng.cache, 0)) == 5
    out = np.asarray(eng.decode([3], [6], [[0]]))
    np.testing.assert_allclose(out[0], full(model, prompt + [3])[-1], atol=ATOL)
    with pytest.raises(ValueError, match="refused to remove positions >= 1"):
        eng.rollback(0, 1)  # deeper than the kept states
    assert int(kvjax.seq_pos_max(eng.cache, 0)) == 6


def test_generate_equals_uncached_greedy_with_a_shared_prefix(model):
    prompts = [[1, 2, 3, 4], [1, 2, 3, 9, 9]]
    out = kvjax.generate(engine(model), prompts, max_new_tokens=6, key=jax.random.PRNGKey(0), sampling=GREEDY)
    for p, got in zip(prompts, out.tokens):
        seq = list(p)
        for _ in range(6):
            seq.append(int(np.argmax(full(model, seq)[-1])))
        assert got == seq[len(p) :]


def test_parallel_sampling_and_stop_tokens(model):
    eng = engine(model)
    out = kvjax.generate(
        eng,
        [[3, 1, 4, 1, 5]],
        n_parallel=3,
        max_new_tokens=5,
        key=jax.random.PRNGKey(1),
        sampling=kvjax.SamplingConfig(temperature=1.0),
    )
    assert [len(t) for t in out.tokens] == [5, 5, 5]
    first = out.tokens[0][0]
    out = kvjax.generate(
        engine(model),
        [[3, 1, 4, 1, 5]],
        max_new_tokens=5,
        key=jax.random.PRNGKey(1),
        sampling=GREEDY,
        stop_tokens=[int(np.argmax(full(model, [3, 1, 4, 1, 5])[-1]))],
    )
    assert len(out.tokens[0]) == 1
    del first


def test_cache_full_changes_nothing(model):
    eng = engine(model, n_seq=4, size=2)
    eng.decode([1, 2], [0, 0], [[0], [1]])
    before = jax.device_get(eng.cache)
    with pytest.raises(kvjax.CacheFullError):
        eng.decode([3], [0], [[2]])  # a third state: no cell
    after = jax.device_get(eng.cache)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    out = np.asarray(eng.decode([3, 4], [1, 1], [[0], [1]]))  # the next fitting batch works
    np.testing.assert_allclose(out[0], full(model, [1, 3])[-1], atol=ATOL)


def test_what_cannot_be_done_is_refused_up_front(model):
    eng = engine(model)
    eng.decode([1, 2, 3, 4], range(4), [[0]] * 4)
    with pytest.raises(ValueError, match="context shift is not possible"):
        eng.context_shift(0, 1, 2)
    memory, ok = kvjax.seq_rm(eng.cache, 0, 1, 3)  # the middle of a state
    assert not bool(ok)
    with pytest.raises(ValueError, match="cannot do"):
        kvjax.generate(engine(model), [[1, 2]], max_new_tokens=20, n_ctx=8, key=jax.random.PRNGKey(0))


def test_state_blob_continues_the_same(model):
    prompt = [7, 7, 3, 2, 1]
    eng = engine(model)
    eng.decode(prompt + [4, 5], list(range(5)) + [0, 1], [[0]] * 5 + [[1]] * 2)
    blob = kvjax.state_write(eng.cache, 0)
    fresh = engine(model)
    fresh.decode([9], [0], [[2]])
    fresh.cache = kvjax.state_read(fresh.cache, blob, 0)
    out = np.asarray(fresh.decode([6], [5], [[0]]))
    np.testing.assert_allclose(out[0], full(model, prompt + [6])[-1], atol=ATOL)
    whole = kvjax.state_read(kvjax.init(CFG.memory_config(4)), kvjax.state_write(eng.cache))
    assert kvjax.state_write(whole) == kvjax.state_write(eng.cache)
    corrupt = bytearray(blob)
    corrupt[-1:] = b""
    before = kvjax.state_write(fresh.cache)
    with pytest.raises(kvjax.StateError, match="truncated|expected"):
        kvjax.state_read(fresh.cache, bytes(corrupt), 0)
    assert kvjax.state_write(fresh.cache) == before


def test_the_step_compiles_once_per_shape(model):
    step, state = make_step(model), nnx.state(model)
    memory = kvjax.init(CFG.memory_config(4))
    ub = kvjax.make_equal_ubatch([([0], [0]), ([0], [1])])
    logits, memory, ok = step(state, memory, ub, np.array([1, 2]), windows=())
    assert bool(ok)
    with no_recompile():
        for p in range(1, 4):
            ub = kvjax.make_equal_ubatch([([p], [0]), ([p], [1])])
            logits, memory, ok = step(state, memory, ub, np.array([p, 2 * p]), windows=())
            assert bool(ok)
    # a token outside the vocabulary fails the step and changes nothing a sequence reads
    before = jax.device_get(memory)
    ub = kvjax.make_equal_ubatch([([4], [0]), ([4], [1])])
    with pytest.raises(ValueError, match=r"tokens contains 99"):  # host ids: named before anything runs
        step(state, memory, ub, np.array([1, 99]), windows=())
    _, after, ok = step(state, memory, ub, jnp.array([1, 99]), windows=())  # device ids: an error bit
    assert not bool(ok) and int(after.error_bits()) == kvjax.ErrorFlag.TOKEN
    after = after.clear_errors()
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after))))


@pytest.mark.parametrize("kind, n_states", [("mamba", 1), ("mamba", 2), ("hybrid", 1)])
@pytest.mark.parametrize("n_seq", [1, 2])
def test_a_step_updates_the_state_buffers_in_place(model, kind, n_states, n_seq):
    """The compiled model step holds no copy of a state buffer, and no dynamic-update-slice fusion
    writing one.

    The placement's row copies were a ``cond`` between the buffers and a gather of every row,
    joined with a copy of every state buffer; with one sequence its state was read by a
    dynamic-slice fused into each reader, which XLA could not order before the in-place write, and
    it copied every buffer again: 8 whole-buffer copies per one-sequence step, 6 per two-sequence
    step. Now only the moving rows are gathered, and one row is read by a two-row gather.
    """
    from kvjax.nn import HybridLM, HybridLMConfig

    if kind == "hybrid":
        cfg = HybridLMConfig(
            vocab_size=40, d_model=16, n_layer=4, recurrent_layers=(0, 2), n_heads=2, n_kv_heads=1, d_state=4
        )
        model = HybridLM(cfg, rngs=nnx.Rngs(2))
        memory = kvjax.init(cfg.memory_config(size=64, n_seq_max=4, n_states=n_states, padding=16))
        windows = (16,)
    else:
        memory = kvjax.init(CFG.memory_config(4, n_states=n_states))
        windows = ()
    ubatch = kvjax.make_equal_ubatch([([0], [s]) for s in range(n_seq)], n_slots=n_seq)
    writes = buffer_writes(
        make_step(model),
        model,
        memory,
        ubatch,
        jnp.arange(1, n_seq + 1, dtype=jnp.int32),
        windows=windows,
        of=memory.recurrent if kind == "hybrid" else memory,
    )
    assert not writes["copy"], writes["copy"][:3]
    # one sequence's new states were written by a dynamic-update-slice fusion that XLA:CPU filled with
    # the whole state update, run slowly: a third of the step
    assert not writes["dynamic-update-slice"], writes["dynamic-update-slice"][:3]


def test_a_one_cell_step_copies_each_state_buffer_at_most_once(model):
    """A one-cell memory (``memory_config(1)``, one sequence): its buffer is the row. Read and
    written through a gather and a scatter of that row, the step copied every state buffer twice;
    read as the buffer and replaced by a select ordered after the step's output (``after``), once
    (XLA still writes the select's result through a copy)."""
    memory = kvjax.init(CFG.memory_config(1))
    ubatch = kvjax.make_equal_ubatch([([0], [0])], n_slots=1)
    writes = buffer_writes(make_step(model), model, memory, ubatch, jnp.ones((1,), jnp.int32))
    assert len(writes["copy"]) <= len(jax.tree.leaves(memory.split()[0])), writes["copy"]
    assert not writes["dynamic-update-slice"], writes["dynamic-update-slice"][:3]


def test_engine_logits_equal_hugging_face():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hc = transformers.MambaConfig(
        vocab_size=48, hidden_size=16, state_size=4, num_hidden_layers=2, conv_kernel=4, expand=2
    )
    hf = transformers.MambaForCausalLM(hc).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 48, (2, 9))
    with torch.no_grad():
        want = hf(ids).logits.numpy()
    ours = params_from_hf(hf)
    eng = kvjax.Engine(ours, kvjax.init(ours.config.memory_config(2)), n_ubatch=8)
    rows = ids.numpy()
    got = np.asarray(eng.decode(list(rows[0, :6]) + list(rows[1, :6]), list(range(6)) * 2, [[0]] * 6 + [[1]] * 6))
    np.testing.assert_allclose(got[:6], want[0, :6], atol=1e-4)
    np.testing.assert_allclose(got[6:], want[1, :6], atol=1e-4)
    for p in range(6, 9):
        got = np.asarray(eng.decode([int(rows[0, p]), int(rows[1, p])], [p, p], [[0], [1]]))
        np.testing.assert_allclose(got, want[:, p], atol=1e-4)
