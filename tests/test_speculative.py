"""Speculative decoding over every memory kind: exact greedy output, exact rollback, the target's distribution.

- greedy speculative decoding produces exactly the target's greedy tokens on a unified cache, an
  iSWA pair, a recurrent memory and a hybrid one, with a smaller draft model and with the target
  itself as the draft (then every draft is accepted);
- after a rollback the memory holds what a memory that never saw the rejected tokens holds: the
  same positions per sequence, the same K/V rows, the same current states;
- with sampling, the acceptance rule's first token is distributed as the target's (a chi-square
  test over 40,000 draws).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.engine._speculative import accept_drafts
from kvjax.nn import HybridLM, HybridLMConfig, Llama, LlamaConfig, Mamba, MambaConfig

V = 24
GREEDY = kvjax.SamplingConfig(temperature=0)


def _scaled(model, factor):
    nnx.update(model, jax.tree.map(lambda x: x * factor, nnx.state(model, nnx.Param)))
    return model


def _llama(seed, d_model, n_layer, **kw):
    cfg = LlamaConfig(vocab_size=V, d_model=d_model, n_layer=n_layer, n_heads=2, n_kv_heads=1, **kw)
    return cfg, _scaled(Llama(cfg, rngs=nnx.Rngs(seed)), 2.0)


def _engines(kind, same=False):
    """(target engine, draft engine) of one memory kind."""
    if kind in ("unified", "iswa"):
        extra = dict(swa_layers=(0,), n_swa=4) if kind == "iswa" else {}
        tcfg, target = _llama(0, 32, 2, **extra)
        dcfg, draft = (tcfg, target) if same else _llama(1, 16, 2 if extra else 1, **extra)

        def memory(cfg):
            base = cfg.cache_config(size=128, n_seq_max=2, padding=16)
            if kind == "iswa":
                # swa_full: a pruned window cache cannot roll back (llama.cpp needs --swa-full too)
                return kvjax.init(
                    kvjax.IswaConfig(base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, n_batch=32, swa_full=True)
                )
            return kvjax.init(base)

        return kvjax.Engine(target, memory(tcfg), n_ubatch=32), kvjax.Engine(draft, memory(dcfg), n_ubatch=32)
    if kind == "recurrent":
        tcfg = MambaConfig(vocab_size=V, d_model=32, n_layer=2, d_state=4)
        target = _scaled(Mamba(tcfg, rngs=nnx.Rngs(0)), 1.5)
        dcfg, draft = (tcfg, target) if same else (MambaConfig(vocab_size=V, d_model=16, n_layer=1, d_state=4), None)
        draft = target if same else _scaled(Mamba(dcfg, rngs=nnx.Rngs(1)), 1.5)
        return (
            kvjax.Engine(target, kvjax.init(tcfg.memory_config(2, n_states=5)), n_ubatch=32),
            kvjax.Engine(draft, kvjax.init(dcfg.memory_config(2, n_states=4)), n_ubatch=32),
        )
    tcfg = HybridLMConfig(
        vocab_size=V, d_model=32, n_layer=3, recurrent_layers=(0, 2), n_heads=2, n_kv_heads=1, d_state=4
    )
    target = _scaled(HybridLM(tcfg, rngs=nnx.Rngs(0)), 1.5)
    dcfg = (
        tcfg
        if same
        else HybridLMConfig(
            vocab_size=V, d_model=16, n_layer=2, recurrent_layers=(0,), n_heads=2, n_kv_heads=1, d_state=4
        )
    )
    draft = target if same else _scaled(HybridLM(dcfg, rngs=nnx.Rngs(1)), 1.5)
    return (
        kvjax.Engine(
            target, kvjax.init(tcfg.memory_config(size=128, n_seq_max=2, n_states=5, padding=16)), n_ubatch=32
        ),
        kvjax.Engine(draft, kvjax.init(dcfg.memory_config(size=128, n_seq_max=2, n_states=4, padding=16)), n_ubatch=32),
    )


def _greedy_reference(engine, prompts, n, width=32):
    """Repeated uncached passes, jitted once: rows padded to ``width`` (every model here is causal)."""
    forward = jax.jit(lambda state, t: nnx.merge(nnx.graphdef(engine.model), state).forward(t))
    out = []
    for p in prompts:
        seq = list(p)
        for _ in range(n):
            row = np.zeros((1, width), np.int32)
            row[0, : len(seq)] = seq
            seq.append(int(np.argmax(np.asarray(forward(nnx.state(engine.model), row)[0, len(seq) - 1]))))
        out.append(seq[len(p) :])
    return out


PROMPTS = [[1, 2, 3, 4], [5, 6, 7]]


# the default suite runs the memories whose rollback differs most (cells freed / a kept state); the
# others (each compiling its own programs) run with -m slow
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "kind",
    [
        "unified",
        pytest.param("recurrent", marks=SLOW),
        pytest.param("iswa", marks=SLOW),
        pytest.param("hybrid", marks=SLOW),
    ],
)
def test_greedy_speculative_is_the_targets_greedy_output(kind):
    target, draft = _engines(kind)
    out = kvjax.generate(
        target, PROMPTS, max_new_tokens=10, key=jax.random.PRNGKey(0), sampling=GREEDY, draft=draft, n_draft=3
    )
    assert out.tokens == _greedy_reference(target, PROMPTS, 10)
    assert out.drafted > 0 and 0 <= out.accepted <= out.drafted


@pytest.mark.parametrize("kind", ["unified", pytest.param("recurrent", marks=SLOW), pytest.param("hybrid", marks=SLOW)])
def test_the_target_as_its_own_draft_accepts_everything(kind):
    target, draft = _engines(kind, same=True)
    out = kvjax.generate(
        target, PROMPTS, max_new_tokens=9, key=jax.random.PRNGKey(0), sampling=GREEDY, draft=draft, n_draft=4
    )
    assert out.tokens == _greedy_reference(target, PROMPTS, 9)
    assert out.acceptance_rate == 1.0


def _held(memory):
    """What a memory holds, independent of which cells: per sequence its positions and their rows."""
    out = {}
    parts = []
    if isinstance(memory, kvjax.HybridCache):
        parts, rec = [memory.attention.part(p) for p in range(memory.n_parts)], memory.recurrent
    elif isinstance(memory, kvjax.RecurrentCache):
        rec = memory
    else:
        parts, rec = [memory.part(p) for p in range(memory.n_parts)], None
    for i, part in enumerate(parts):
        table = kvjax.cell_table(part)
        for s in range(table.seqs.shape[1]):
            cells = np.flatnonzero(table.seqs[:, s])
            cells = cells[np.argsort(table.pos[cells])]
            out[("pos", i, s)] = table.pos[cells]
            out[("k", i, s)] = np.concatenate([np.asarray(k)[:, :, cells] for k in part.k])
            out[("v", i, s)] = np.concatenate([np.asarray(v)[:, :, cells] for v in part.v])
    if rec is not None:
        table = kvjax.cell_table(rec)
        for s, t in enumerate(table.tail):
            if t >= 0:
                row = t * rec.config.n_states + table.roll[t]
                out[("state", s)] = (int(table.pos[t]), np.asarray(rec.k[0][:, row]), np.asarray(rec.v[0][:, row]))
    return out


@pytest.mark.parametrize("kind", ["unified", "iswa", "recurrent", "hybrid"])
def test_a_rollback_leaves_what_never_seeing_the_rejected_tokens_leaves(kind):
    spec, _ = _engines(kind)
    plain, _ = _engines(kind)
    prompt = [3, 1, 4, 1, 5, 9]
    for e in (spec, plain):
        e.decode(prompt, range(6), [[0]] * 6)
    spec.decode([2, 6, 5, 3], [6, 7, 8, 9], [[0]] * 4)  # a checked draft: 4 positions
    spec.rollback(0, 8)  # 2 rejected
    plain.decode([2], [6], [[0]])
    plain.decode([6], [7], [[0]])
    got, want = _held(spec.cache), _held(plain.cache)
    assert got.keys() == want.keys()
    for key in want:
        if key[0] == "state":
            assert got[key][0] == want[key][0]
            np.testing.assert_allclose(got[key][1], want[key][1], atol=2e-5)
            np.testing.assert_allclose(got[key][2], want[key][2], atol=2e-5)
        elif key[0] == "pos":
            np.testing.assert_array_equal(got[key], want[key])
        else:
            np.testing.assert_allclose(got[key], want[key], atol=2e-5)


def test_sampled_first_tokens_follow_the_target_distribution():
    """Draft from q, accept by the rule: the first emitted token is distributed as p (chi-square)."""
    rng = np.random.default_rng(0)
    k, n = 3, 40000
    p_logits = jnp.asarray(rng.normal(size=(1, k + 1, 8)) * 1.5, jnp.float32)
    q_logits = jnp.asarray(rng.normal(size=(1, k, 8)) * 1.5, jnp.float32)
    config = kvjax.SamplingConfig(temperature=1.0)
    keys = jax.random.split(jax.random.PRNGKey(1), n)

    @jax.jit
    def one(key):
        kd, ka = jax.random.split(key)
        drafts = jax.random.categorical(kd, q_logits[0], axis=-1).astype(jnp.int32)[None]  # [1, k]
        n_ok, nxt = accept_drafts(p_logits, q_logits, drafts, ka, config)
        return jnp.where(n_ok[0] >= 1, drafts[0, 0], nxt[0])

    first = np.asarray(jax.vmap(one)(keys))
    counts = np.bincount(first, minlength=8)
    p = np.asarray(jax.nn.softmax(p_logits[0, 0]))
    chi2 = float(np.sum((counts - n * p) ** 2 / (n * p)))
    assert chi2 < 24.3, (chi2, counts, n * p)  # 7 degrees of freedom, p = 0.001


def test_greedy_acceptance_rule():
    p = jnp.asarray([[[0, 5, 0], [0, 0, 5], [5, 0, 0]]], jnp.float32)  # argmax 1, 2, 0
    q = jnp.zeros((1, 2, 3))
    n, nxt = accept_drafts(p, q, jnp.asarray([[1, 2]]), jax.random.PRNGKey(0), GREEDY)
    assert (int(n[0]), int(nxt[0])) == (2, 0)
    n, nxt = accept_drafts(p, q, jnp.asarray([[1, 0]]), jax.random.PRNGKey(0), GREEDY)
    assert (int(n[0]), int(nxt[0])) == (1, 2)


def test_bad_requests_are_refused_before_anything_changes():
    target, draft = _engines("recurrent")
    key = jax.random.PRNGKey(0)
    with pytest.raises(ValueError, match="draft must be a kvjax.Engine"):
        kvjax.generate(target, PROMPTS, max_new_tokens=4, key=key, draft="small")
    with pytest.raises(ValueError, match="n_draft=0 is out of range"):
        kvjax.generate(target, PROMPTS, max_new_tokens=4, key=key, draft=draft, n_draft=0)
    with pytest.raises(ValueError, match="target memory can roll back 4 positions: allowed n_draft=6"):
        kvjax.generate(target, PROMPTS, max_new_tokens=4, key=key, draft=draft, n_draft=6)
    with pytest.raises(ValueError, match="another Engine"):
        kvjax.generate(target, PROMPTS, max_new_tokens=4, key=key, draft=target)
    with pytest.raises(ValueError, match="n_parallel"):
        kvjax.generate(target, PROMPTS[:1], max_new_tokens=4, key=key, draft=draft, n_parallel=2)
    other = kvjax.Engine(
        Mamba(MambaConfig(vocab_size=V + 1, d_model=16, n_layer=1), rngs=nnx.Rngs(0)),
        kvjax.init(MambaConfig(vocab_size=V + 1, d_model=16, n_layer=1).memory_config(2, n_states=4)),
    )
    with pytest.raises(ValueError, match="draft has vocab_size=25"):
        kvjax.generate(target, PROMPTS, max_new_tokens=4, key=key, draft=other)
    for e in (target, draft):
        assert int(kvjax.used_cells(e.cache)) == 0
    cfg, model = _llama(0, 16, 2, swa_layers=(0,), n_swa=4)
    pruned = kvjax.IswaConfig(cfg.cache_config(size=64, n_seq_max=2, padding=16), swa_layers=(0,), n_swa=4, n_batch=16)
    a, b = (kvjax.Engine(model, kvjax.init(pruned)) for _ in range(2))
    with pytest.raises(ValueError, match="an iSWA pair needs swa_full=True"):
        kvjax.generate(a, PROMPTS, max_new_tokens=4, key=key, draft=b)
