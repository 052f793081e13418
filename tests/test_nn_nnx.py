"""NNX integration: cached equals uncached, shifted equals recomputed, layer and guard checks.

The scenario helpers here (:func:`run_scenario`, :func:`check_against_uncached`) are shared
with the linen tests: they drive any model (through a :class:`kvjax.nn.Step` or eagerly) over
several sequences in one cache and compare every token's logits with the uncached pass of its
sequence alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import (
    UbatchInputs,
    CachedAttention,
    KVCacheVar,
    Llama,
    LlamaConfig,
    attend_uncached,
    alibi_slopes,
    make_step,
    swa_visible,
    window_for,
)

ATOL = 3e-5  # float32 logits of a 2-layer width-32 model: kvjax's and the reference's sums differ in order

BASE = dict(vocab_size=64, d_model=32, n_layer=2, n_heads=4, n_kv_heads=2)

VARIANTS = {
    "rope": dict(),
    "rope-swa": dict(swa_layers=(1,), swa_type="standard", n_swa=4),
    "alibi": dict(position="alibi"),
    "alibi-swa": dict(position="alibi", swa_layers=(0,), swa_type="chunked", n_swa=4),
}


def model_config(variant: str, **extra) -> LlamaConfig:
    return LlamaConfig(**{**BASE, **VARIANTS[variant], **extra})


def make_model(cfg: LlamaConfig, seed: int = 0) -> Llama:
    """A model with random normal weights set from numpy (no XLA compilation for the init)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree.flatten(abstract)
    leaves = [
        jnp.asarray(np.asarray(rng.normal(size=a.shape) * 0.3 + (1.0 if len(a.shape) == 1 else 0.0), a.dtype))
        for a in leaves
    ]  # 1-d leaves are RMSNorm scales: around 1
    return nnx.merge(graphdef, jax.tree.unflatten(tree, leaves))


@functools.lru_cache(maxsize=None)
def step_for(cfg: LlamaConfig):
    """One Step per model config, shared by every model of that config (state is an argument)."""
    return make_step(make_model(cfg))


@functools.lru_cache(maxsize=None)
def forward_for(cfg: LlamaConfig):
    """The jitted uncached forward of a config: ``fn(state, tokens [B, T]) -> logits``."""
    graphdef = nnx.graphdef(make_model(cfg))
    return jax.jit(lambda state, toks: nnx.merge(graphdef, state).forward(toks))


def nnx_forward(model):
    return functools.partial(forward_for(model.config), nnx.state(model))


# -- the shared scenario -------------------------------------------------------------------------


class Recorder:
    """Token ids of each sequence by position, and the logits the cached path gave each row."""

    def __init__(self, n_seq):
        self.tokens = [dict() for _ in range(n_seq)]
        self.rows = []  # (seq ids, pos, logits row)

    def add(self, seqs, pos, tok):
        for s in seqs:
            self.tokens[s][pos] = tok

    def sequence(self, s):
        return [self.tokens[s][p] for p in range(len(self.tokens[s]))]


def scenario_batches(rng, vocab, decode_rounds=3):
    """The ubatches of the scenario, as lists of (seq ids, pos, token), and host ops between them.

    - seq 0: a 9-token prompt, split over two ubatches;
    - seq 1: shares seq 0's first 4 positions via ``seq_cp``, then 3 own prompt tokens;
    - seq 2 and 3: share their first 2 tokens inside a ubatch (seq ids [2, 3]); seq 2 then has
      4 more prompt tokens, seq 3 two;
    - then ``decode_rounds`` decode rounds with one token for every sequence.
    """
    tok = lambda: int(rng.integers(vocab))  # noqa: E731
    ub1 = (
        [((0,), p, tok()) for p in range(5)]
        + [((2, 3), p, tok()) for p in range(2)]
        + [((2,), p, tok()) for p in range(2, 4)]
    )
    seq0_rest = [((0,), p, tok()) for p in range(5, 9)]
    ub2 = (
        seq0_rest
        + [((1,), p, tok()) for p in range(4, 7)]
        + [((2,), p, tok()) for p in range(4, 6)]
        + [((3,), p, tok()) for p in range(2, 4)]
    )
    plan = [("ubatch", ub1), ("seq_cp", (0, 1, 0, 4)), ("ubatch", ub2)]
    next_pos = {0: 9, 1: 7, 2: 6, 3: 4}
    for _ in range(decode_rounds):
        plan.append(("ubatch", [((s,), next_pos[s] + 0, tok()) for s in range(4)]))
        next_pos = {s: p + 1 for s, p in next_pos.items()}
    return plan


def run_scenario(run_ubatch, cache, vocab, seed=0, decode_rounds=3):
    """Drive the scenario; ``run_ubatch(cache, ubatch, tokens) -> (logits, cache)``.

    Every ubatch has the same static shape (T=16, M=2), and the cache (64 cells, padding 32)
    never needs more than the 32-cell window: one compiled step serves the whole scenario.
    """
    rng = np.random.default_rng(seed)
    rec = Recorder(4)
    for kind, item in scenario_batches(rng, vocab, decode_rounds):
        if kind == "seq_cp":
            cache = kvjax.seq_cp(cache, *item)
            src, dst, p0, p1 = item
            for p in range(p0, p1):
                rec.add((dst,), p, rec.tokens[src][p])
            continue
        ub = kvjax.make_ubatch([p for _, p, _ in item], [list(s) for s, _, _ in item], length=16)
        if ub.seq_ids.shape[1] < 2:  # one ubatch bucket (T=16, M=2) for the whole scenario
            ub = ub.replace(seq_ids=np.pad(ub.seq_ids, ((0, 0), (0, 1)), constant_values=-1))
        tokens = np.zeros(ub.length, np.int32)
        tokens[: len(item)] = [t for _, _, t in item]
        logits, cache = run_ubatch(cache, ub, jnp.asarray(tokens))
        logits = np.asarray(logits)
        for row, (seqs, pos, t) in enumerate(item):
            rec.add(seqs, pos, t)
            rec.rows.append((seqs, pos, logits[row]))
    return rec, cache


def check_against_uncached(rec, forward, atol=ATOL):
    """Every recorded row equals the uncached logits of each of its sequences at its position."""
    seqs = [rec.sequence(s) for s in range(len(rec.tokens))]
    longest = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), longest), np.int32)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = s  # trailing padding: causal, so it changes nothing before it
    ref = np.asarray(forward(jnp.asarray(toks)))
    worst = 0.0
    for seq_ids, pos, row in rec.rows:
        for s in seq_ids:
            np.testing.assert_allclose(row, ref[s, pos], atol=atol, rtol=1e-5, err_msg=f"sequence {s}, position {pos}")
            worst = max(worst, float(np.abs(row - ref[s, pos]).max()))
    return worst


def step_runner(step, state):
    """``run_ubatch`` through a jitted Step (placement inside, window from window_for)."""

    def run(cache, ub, tokens):
        n_kv = window_for(cache, int(ub.valid.sum()))
        logits, cache, ok = step(state, cache, ub, tokens, n_kv=n_kv)
        assert bool(ok)
        return logits, cache

    return run


def eager_runner(model):
    """``run_ubatch`` calling the model eagerly (find_slot, then the model, no jit)."""

    def run(cache, ub, tokens):
        cache, slot, ok = kvjax.find_slot(cache, ub)
        assert bool(ok)
        n_kv = int(kvjax.window_bucket(int(kvjax.n_kv(cache)), cache.config.size, cache.config.padding))
        return model(tokens, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(n_kv,)))

    return run


def new_cache(cfg: LlamaConfig, size=64):
    return kvjax.init(cfg.cache_config(size=size, n_seq_max=4, padding=32))


# -- cached equals uncached -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_equals_uncached_jitted(variant):
    cfg = model_config(variant, tie_embeddings=variant.startswith("alibi"))
    model = make_model(cfg, seed=1)
    rec, cache = run_scenario(step_runner(step_for(cfg), nnx.state(model)), new_cache(cfg), cfg.vocab_size)
    assert kvjax.errors(cache) == []
    assert int(kvjax.used_cells(cache)) == 9 + 11 + 3 * 4  # seq_cp shares cells, adds none
    check_against_uncached(rec, nnx_forward(model))


def test_cached_equals_uncached_eager():
    cfg = model_config("rope-swa")
    model = make_model(cfg, seed=2)
    rec, _ = run_scenario(eager_runner(model), new_cache(cfg), cfg.vocab_size, seed=3, decode_rounds=1)
    check_against_uncached(rec, nnx_forward(model))


def test_scenario_can_fail():
    """The comparison notices a wrong mask: the same weights without the sliding window differ."""
    cfg = model_config("rope-swa")
    model = make_model(cfg, seed=1)
    rec, _ = run_scenario(step_runner(step_for(cfg), nnx.state(model)), new_cache(cfg), cfg.vocab_size)
    wrong = make_model(model_config("rope"), seed=1)
    with pytest.raises(AssertionError):
        check_against_uncached(rec, nnx_forward(wrong))


# -- shifted equals recomputed ----------------------------------------------------------------------


def shift_case(cfg: LlamaConfig, state, step, forward, use_update: bool):
    """Prefill 20 tokens, ``seq_rm`` positions [6, 12), ``seq_add`` the rest by -6, maybe K-shift,
    decode one token; returns its logits and the uncached logits of the kept tokens + it."""
    rng = np.random.default_rng(5)
    prompt = rng.integers(cfg.vocab_size, size=20).astype(np.int32)
    cache = new_cache(cfg)
    ub = kvjax.make_ubatch(range(20), [[0]] * 20, length=32)
    _, cache, ok = step(state, cache, ub, jnp.asarray(np.pad(prompt, (0, 12))), n_kv=window_for(cache, 20))
    assert bool(ok)
    cache, _ = kvjax.seq_rm(cache, 0, 6, 12)
    cache = kvjax.seq_add(cache, 0, 12, -1, -6)
    assert bool(kvjax.has_shift(cache))
    if use_update:
        cache = kvjax.update(cache)
        assert not bool(kvjax.has_shift(cache))
    new_tok = int(rng.integers(cfg.vocab_size))
    ub = kvjax.make_ubatch([14], [[0]], length=32)  # the prefill's bucket: no new program
    logits, cache, ok = step(
        state, cache, ub, jnp.asarray(np.pad([new_tok], (0, 31)).astype(np.int32)), n_kv=window_for(cache, 1)
    )
    assert bool(ok)
    kept = np.concatenate([prompt[:6], prompt[12:], [new_tok]]).astype(np.int32)
    ref = forward(jnp.asarray(kept)[None])[0, -1]
    return np.asarray(logits[0]), np.asarray(ref)


def _nnx_shift(position, use_update):
    cfg = LlamaConfig(**{**BASE, "n_layer": 1, "position": position})
    model = make_model(cfg, seed=4)
    return shift_case(cfg, nnx.state(model), step_for(cfg), nnx_forward(model), use_update)


def test_shifted_equals_recomputed_rope():
    """seq_rm of a middle range, seq_add of the rest, K-shift: equals the kept tokens recomputed.

    One layer, because in a deeper model the K/V of the shifted tokens in layers >= 1 carry what
    they attended to before the removal (llama.cpp's context shift is approximate for that reason);
    with one layer the cached K/V depend on token and position only, so equality is exact.
    """
    got, ref = _nnx_shift("rope", use_update=True)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=1e-5)
    stale, _ = _nnx_shift("rope", use_update=False)  # without the K-shift the rotation is wrong
    assert np.abs(stale - ref).max() > 1e-3


def test_shifted_equals_recomputed_alibi():
    """With ALiBi positions live only in the mask: the shifted cells attend as recomputed, and
    ``update`` (nothing to rotate without RoPE) only clears the pending deltas."""
    for use_update in (False, True):
        got, ref = _nnx_shift("alibi", use_update=use_update)
        np.testing.assert_allclose(got, ref, atol=ATOL, rtol=1e-5)


# -- the layer alone --------------------------------------------------------------------------------


def test_layer_matches_uncached():
    """One layer (GQA, sliding window, only layer 1 cached) jitted; two sequences in one ubatch."""
    rope = kvjax.RopeConfig(n_rot=8)
    attn = CachedAttention(32, 4, 2, 8, layer=1, rope=rope, swa_type="standard", n_swa=3, rngs=nnx.Rngs(0))
    cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=8, padding=16, layer_filter=[1])
    x = jnp.asarray(np.random.default_rng(1).normal(size=(8, 32)), jnp.float32)
    ub = kvjax.make_ubatch(list(range(4)) * 2, [[0]] * 4 + [[1]] * 4)

    @nnx.jit
    def both(a, x, cache):
        cache, slot, ok = kvjax.find_slot(cache, ub)
        y, cache = a(x, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(16,)))
        ref = a.uncached(x.reshape(2, 4, 32), jnp.tile(jnp.arange(4), (2, 1))).reshape(8, 32)
        return y, ref, cache

    y, ref, cache = both(attn, x, kvjax.init(cfg))
    np.testing.assert_allclose(y, ref, atol=1e-5)
    assert int(kvjax.used_cells(cache)) == 8 and kvjax.errors(cache) == []


def test_layer_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        CachedAttention(32, 3, 2, 8, layer=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_swa"):
        CachedAttention(32, 4, 2, 8, layer=0, swa_type="standard", n_swa=0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="n_rot"):
        CachedAttention(32, 4, 2, 8, layer=0, rope=kvjax.RopeConfig(n_rot=16), rngs=nnx.Rngs(0))
    attn = CachedAttention(32, 4, 2, 8, layer=0, rngs=nnx.Rngs(0))
    ub = kvjax.make_ubatch([0], [[0]])
    wrong = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=8))
    with pytest.raises(ValueError, match="n_kv_heads"):
        attn(jnp.ones((1, 32)), wrong, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)))
    other_layer = kvjax.init(
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=2, n_kv_heads=2, head_dim=8, layer_filter=[1])
    )
    with pytest.raises(ValueError, match="layer=0"):
        attn(jnp.ones((1, 32)), other_layer, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)))
    right = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=2, head_dim=8))
    with pytest.raises(ValueError, match="x has shape"):
        attn(jnp.ones((2, 32)), right, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)))


def test_model_bad_input():
    for bad in (
        dict(n_heads=3),
        dict(n_kv_heads=3),
        dict(position="nope"),
        dict(swa_layers=(5,)),
        dict(swa_layers=(0,), n_swa=0),
        dict(d_model=30),
        dict(vocab_size=0),
    ):
        with pytest.raises(ValueError):
            LlamaConfig(**{**BASE, **bad})
    cfg = LlamaConfig(**BASE)
    model = make_model(cfg)
    ub = kvjax.make_ubatch([0], [[0]])
    with pytest.raises(ValueError, match="layers"):
        model(
            jnp.array([1]),
            kvjax.init(cfg.cache_config(32, 1, layer_filter=[0])),
            UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)),
        )
    cache = kvjax.init(cfg.cache_config(32, 1))
    with pytest.raises(ValueError, match="tokens contains 64"):
        model(jnp.array([64]), cache, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)))
    with pytest.raises(ValueError, match="tokens has shape"):
        model(jnp.array([1, 2]), cache, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,)))


def test_reference_pieces():
    """The uncached reference's own pieces against direct formulas."""
    slopes = alibi_slopes(6, 8.0)  # not a power of two: the interleaved second series
    m0, m1 = 2 ** (-8 / 4), 2 ** (-4 / 4)
    np.testing.assert_allclose(slopes, [m0, m0**2, m0**3, m0**4, m1, m1**3], rtol=1e-6)
    p = jnp.arange(10)
    assert swa_visible(p, jnp.int32(9), "chunked", 4).tolist() == [False] * 8 + [True] * 2
    assert swa_visible(p, jnp.int32(5), "symmetric", 4).tolist() == [False] * 3 + [True] * 5 + [False] * 2
    # GQA (4 query heads over 2 kv heads) with ALiBi against a direct numpy softmax
    rng = np.random.default_rng(0)
    q = rng.normal(size=(1, 5, 4, 8)).astype(np.float32)
    k, v = rng.normal(size=(2, 1, 5, 2, 8)).astype(np.float32)
    slopes = alibi_slopes(4)
    out = np.asarray(jax.jit(lambda q, k, v: attend_uncached(q, k, v, jnp.arange(5)[None], alibi=slopes))(q, k, v))
    kr, vr = np.repeat(k[0], 2, axis=1), np.repeat(v[0], 2, axis=1)  # query head j -> kv head j // 2
    dist = np.abs(np.arange(5)[:, None] - np.arange(5)[None])
    scores = np.einsum("thd,shd->hts", q[0], kr) / np.sqrt(8) - slopes[:, None, None] * dist
    scores = np.where(np.tril(np.ones((5, 5), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    manual = np.einsum("hts,shd->thd", p / p.sum(-1, keepdims=True), vr)
    np.testing.assert_allclose(out[0], manual, atol=1e-5)


# -- the cache held as NNX state --------------------------------------------------------------------


class _Holder(nnx.Module):
    """A model that keeps its kvjax cache as NNX state, as nnx.MultiHeadAttention keeps its own."""

    def __init__(self, model: Llama, cache):
        self.model = model
        self.kv = KVCacheVar(cache)

    def __call__(self, tokens, ubatch, *, n_kv):
        cache, slot, ok = kvjax.find_slot(self.kv.get_value(), ubatch)
        logits, cache = self.model(tokens, cache, UbatchInputs(ubatch=ubatch, placement=slot, windows=(n_kv,)))
        self.kv.replace_cache(cache)
        return logits, ok


def test_cache_held_in_nnx_state():
    cfg = LlamaConfig(**{**BASE, "n_layer": 1})
    model = make_model(cfg)
    holder = _Holder(model, kvjax.init(cfg.cache_config(32, 1)))
    call = nnx.jit(lambda h, t, u: h(t, u, n_kv=32))
    toks = np.array([3, 1, 4, 1], np.int32)
    for i, t in enumerate(toks):
        logits, ok = call(holder, jnp.array([t]), kvjax.make_ubatch([i], [[0]]))
        assert bool(ok)
    assert int(kvjax.used_cells(holder.kv.get_value())) == 4
    np.testing.assert_allclose(logits[0], nnx_forward(model)(jnp.asarray(toks)[None])[0, -1], atol=ATOL)
    with pytest.raises(ValueError, match="config"):
        holder.kv.replace_cache(kvjax.init(cfg.cache_config(64, 1)))
    bad = holder.kv.get_value()
    bad = bad.replace(k=tuple(k.astype(jnp.float16) for k in bad.k))
    with pytest.raises(ValueError, match="shapes or dtypes|float16 where its config gives .* float32"):
        holder.kv.replace_cache(bad)
    with pytest.raises(ValueError, match="KVCache"):
        holder.kv.replace_cache(np.zeros(3))


def test_docs_flax_examples_run(capsys):
    """The code blocks of docs/flax.md run, in order, in one namespace, and print what they say."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "flax.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 3
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, "docs/flax.md", "exec"), namespace)
        if i == 1:  # the prefix-sharing block K-shifted what it moved
            assert not bool(kvjax.has_shift(namespace["cache"]))
            assert int(kvjax.seq_pos_max(namespace["cache"], 0)) == 11 - 4
    printed = capsys.readouterr().out.split()
    assert printed == ["23", "(4,", "64)"]
