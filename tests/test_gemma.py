"""Gemma 2 / Gemma 3 (text) as options of the reference model, checked against ``transformers``.

- ``kvjax.attention``'s ``softcap`` against a plain numpy formula;
- the reference model (NNX and linen) loaded with :func:`kvjax.nn.llama_from_hf` equals HF's
  ``Gemma2ForCausalLM`` and ``Gemma3ForCausalLM`` (eager attention, float32, random weights) over a
  prompt longer than the sliding window;
- cached decode of a Gemma-like model through the iSWA memory (and a unified cache, and linen's step)
  equals its uncached pass, far past the window; a context shift with Gemma 3's two RoPE bases;
- bad option values raise ``ValueError`` naming the argument and the allowed range; the defaults
  keep the Llama model as it was.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine
from kvjax.nn import (
    CachedAttention,
    Llama,
    LlamaConfig,
    LlamaLinen,
    LinenOffsetRMSNorm,
    OffsetRMSNorm,
    llama_from_hf,
    make_step,
    params_from_nnx,
    window_for,
)

ATOL_HF = 1e-4  # against torch: other matmul orders
ATOL_CACHE = 5e-5  # cached against uncached, same weights


# -- softcap in kvjax.attention ---------------------------------------------------------------------


def _numpy_attention(q, k, v, visible, scale, softcap=None):
    """``softmax(cap(q k^T * scale), masked) v`` per query head, query head j on kv head j // G."""
    t, hq, d = q.shape
    h = k.shape[1]
    out = np.zeros((t, hq, v.shape[-1]))
    for j in range(hq):
        s = q[:, j, :].astype(np.float64) @ k[:, j // (hq // h), :].T.astype(np.float64) * scale  # [T, N]
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        s = np.where(visible, s, -np.inf)
        with np.errstate(invalid="ignore"):  # padding rows see nothing: NaN there, never compared
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, j] = (p / p.sum(-1, keepdims=True)) @ v[:, j // (hq // h), :]
    return out


@pytest.mark.parametrize("softcap, scale", [(None, None), (1.5, None), (0.3, 0.9), (50.0, 2.0)])
def test_softcap_equals_numpy(softcap, scale):
    rng = np.random.default_rng(0)
    cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=2, head_dim=4, padding=16)
    ub = kvjax.make_ubatch(list(range(5)) + [0, 1], [[0]] * 5 + [[1]] * 2)
    cache, slot, ok = kvjax.find_slot(kvjax.init(cfg), ub)
    k = rng.normal(size=(ub.length, 2, 4)).astype(np.float32) * 2
    v = rng.normal(size=(ub.length, 2, 4)).astype(np.float32)
    q = rng.normal(size=(ub.length, 4, 4)).astype(np.float32) * 2
    cache = kvjax.write(cache, 0, slot, jnp.asarray(k), jnp.asarray(v))
    mask = kvjax.kq_mask_bool(cache, ub, 16)
    out = kvjax.attention(jnp.asarray(q), cache, 0, mask, scale=scale, softcap=softcap)
    # the cells: row i of the ubatch sits in cell slot[i]; read K/V back in cell order
    kc, vc = (np.asarray(x).transpose(1, 0, 2) for x in kvjax.view(cache, 0, 16))  # [N, H, D]
    ref = _numpy_attention(q, kc, vc, np.asarray(mask), 0.5 if scale is None else scale, softcap)
    valid = np.asarray(ub.valid)
    np.testing.assert_allclose(np.asarray(out)[valid], ref[valid], atol=2e-6)
    if softcap == 0.3:  # a small cap changes the result (the test sees the cap)
        plain = _numpy_attention(q, kc, vc, np.asarray(mask), scale)
        assert np.abs(plain[valid] - ref[valid]).max() > 1e-2


def test_softcap_over_several_chunks():
    """A window of 2048 cells is walked in several chunks (online softmax): the cap applies in each."""
    rng = np.random.default_rng(7)
    cfg = kvjax.CacheConfig(size=2048, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4, padding=256)
    ub = kvjax.make_ubatch(range(1100), [[0]] * 1100)
    assert kvjax.attn._attention.chunk_size(2048, 1, 2 * ub.length, 256) < 2048
    cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    k = rng.normal(size=(ub.length, 1, 4)).astype(np.float32) * 3
    v = rng.normal(size=(ub.length, 1, 4)).astype(np.float32)
    cache = kvjax.write(cache, 0, slot, jnp.asarray(k), jnp.asarray(v))
    mask = kvjax.kq_mask_bool(cache, ub, 2048)
    rows = np.array([0, 700, 1050, 1099])
    q = rng.normal(size=(ub.length, 2, 4)).astype(np.float32) * 3
    out = np.asarray(kvjax.attention(jnp.asarray(q), cache, 0, mask, softcap=1.0))
    kc, vc = (np.asarray(x).transpose(1, 0, 2) for x in kvjax.view(cache, 0, 2048))
    ref = _numpy_attention(q[rows], kc, vc, np.asarray(mask)[rows], 0.5, 1.0)
    np.testing.assert_allclose(out[rows], ref, atol=2e-5)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "2"])
def test_softcap_bad_values(bad):
    cfg = kvjax.CacheConfig(size=16, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2, padding=16)
    ub = kvjax.make_ubatch([0], [[0]])
    cache, _, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    with pytest.raises(ValueError, match=r"softcap=.* is out of range: allowed a finite number > 0"):
        kvjax.attention(jnp.ones((1, 1, 2)), cache, 0, kvjax.kq_mask(cache, ub, 16), softcap=bad)


def test_offset_rms_norm_nnx_and_linen():
    x = jnp.asarray(np.random.default_rng(1).normal(size=(3, 6)), jnp.float32)
    w = jnp.linspace(-0.5, 0.5, 6)
    ref = np.asarray(x) / np.sqrt(np.mean(np.asarray(x) ** 2, -1, keepdims=True) + 1e-6) * (1 + np.asarray(w))
    norm = OffsetRMSNorm(6, epsilon=1e-6, rngs=nnx.Rngs(0))
    norm.scale.set_value(w)
    np.testing.assert_allclose(norm(x), ref, atol=1e-5)
    out = LinenOffsetRMSNorm(epsilon=1e-6).apply({"params": {"scale": w}}, x)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    with pytest.raises(ValueError, match=r"epsilon=-1 is out of range: allowed a finite number >= 0"):
        OffsetRMSNorm(6, epsilon=-1, rngs=nnx.Rngs(0))


# -- bad options, defaults ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(query_pre_attn_scalar=0), r"query_pre_attn_scalar=0 is out of range: allowed a finite number > 0"),
        (dict(query_pre_attn_scalar=-4.0), r"query_pre_attn_scalar=-4.0 is out of range"),
        (dict(attn_logit_softcap=0.0), r"attn_logit_softcap=0.0 is out of range: allowed a finite number > 0"),
        (dict(attn_logit_softcap=float("inf")), r"attn_logit_softcap=inf is out of range"),
        (dict(final_logit_softcap=-30), r"final_logit_softcap=-30 is out of range: allowed a finite number > 0"),
        (dict(final_logit_softcap="30"), r"final_logit_softcap='30' is out of range"),
        (
            dict(activation="relu"),
            r"activation='relu' is out of range: allowed one of \['gelu_tanh', 'silu', 'swiglu_oai'\]",
        ),
        (dict(norm_offset="yes"), r"norm_offset='yes' is out of range: allowed True or False"),
        (dict(sandwich_norms=1), r"sandwich_norms=1 is out of range: allowed True or False"),
        (dict(scale_embeddings=None), r"scale_embeddings=None is out of range: allowed True or False"),
        (dict(qk_norm="no"), r"qk_norm='no' is out of range: allowed True or False"),
        (dict(swa_rope=10000.0), r"swa_rope=10000.0 is out of range: allowed a kvjax.RopeConfig or None"),
        (dict(swa_rope=kvjax.RopeConfig(n_rot=8), position="alibi"), r"swa_rope=.* allowed only with position='rope'"),
        (dict(swa_rope=kvjax.RopeConfig(n_rot=16)), r"swa_rope.n_rot=16 is out of range: allowed <= head_dim=8"),
    ],
)
def test_config_bad_options(changes, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**changes)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(scale=0.0), r"scale=0.0 is out of range: allowed a finite number > 0"),
        (dict(softcap=-1), r"softcap=-1 is out of range: allowed a finite number > 0"),
        (dict(qk_norm=1), r"qk_norm=1 is out of range: allowed True or False"),
        (dict(norm_offset="x"), r"norm_offset='x' is out of range: allowed True or False"),
        (dict(qk_norm=True, norm_eps=0.0), r"norm_eps=0.0 is out of range: allowed a finite number > 0"),
    ],
)
def test_attention_layer_bad_options(changes, match):
    with pytest.raises(ValueError, match=match):
        CachedAttention(32, 4, 2, 8, layer=0, rngs=nnx.Rngs(0), **changes)


def test_window_pattern_and_from_hf_errors():
    assert LlamaConfig.window_pattern(4, 2) == (0, 2)  # Gemma 2: even layers slide
    assert LlamaConfig.window_pattern(12, 6) == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)  # Gemma 3: 5 local, 1 global
    with pytest.raises(ValueError, match=r"every=0 is out of range: allowed an integer >= 1"):
        LlamaConfig.window_pattern(4, 0)
    transformers = pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"hf_config.model_type='llama' is out of range: allowed 'gemma2'"):
        LlamaConfig.from_hf(transformers.LlamaConfig())
    with pytest.raises(ValueError, match=r"hf_config.hidden_activation='silu' is out of range"):
        LlamaConfig.from_hf(transformers.Gemma2Config(hidden_activation="silu"))
    with pytest.raises(ValueError, match=r"rope_type='yarn' is out of range: allowed 'default' or 'linear'"):
        LlamaConfig.from_hf(
            transformers.Gemma2Config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
        )
    with pytest.raises(ValueError, match=r"model is None with a state dict"):
        llama_from_hf({})


def test_defaults_keep_llama():
    cfg = LlamaConfig()
    assert (cfg.norm_offset, cfg.sandwich_norms, cfg.scale_embeddings, cfg.qk_norm) == (False,) * 4
    assert (cfg.activation, cfg.attn_scale, cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.swa_rope) == (
        "silu",
        None,
        None,
        None,
        None,
    )
    names = {"/".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(Llama(cfg, rngs=nnx.Rngs(0))))}
    assert not any(("post_" in n) or ("q_norm" in n) or ("k_norm" in n) for n in names)
    assert isinstance(Llama(cfg, rngs=nnx.Rngs(0)).norm, nnx.RMSNorm)
    assert cfg.cache_config(size=32, n_seq_max=1).rope == (cfg.rope_config,) * cfg.n_layer


# -- against transformers ---------------------------------------------------------------------------


def _perturb(torch, hf, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():  # norms start at 0 and projections small: move every weight
            p.add_(0.3 * torch.randn_like(p))
    return hf


@functools.lru_cache(maxsize=None)
def _hf_gemma2():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hc = transformers.Gemma2Config(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=5,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 100.0},
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return _perturb(torch, transformers.Gemma2ForCausalLM(hc).eval(), 1)


@functools.lru_cache(maxsize=None)
def _hf_gemma3():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hc = transformers.Gemma3TextConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=40,
        num_hidden_layers=7,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=12,
        sliding_window=5,
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
        },
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return _perturb(torch, transformers.Gemma3ForCausalLM(hc).eval(), 2)


def _hf_logits(hf, ids):
    import torch

    with torch.no_grad():
        return hf(torch.as_tensor(ids)).logits.numpy()


@pytest.mark.parametrize("which", ["gemma2", "gemma3"])
def test_logits_equal_transformers(which):
    hf = _hf_gemma2() if which == "gemma2" else _hf_gemma3()
    ids = np.random.default_rng(3).integers(0, 48, (2, 17))  # 17 tokens, window 5
    ref = _hf_logits(hf, ids)
    model = llama_from_hf(hf)
    cfg = model.config
    assert cfg.n_swa == 5 and cfg.swa_layers == ((0, 2) if which == "gemma2" else (0, 1, 2, 3, 4, 6))
    assert (cfg.qk_norm, cfg.swa_rope is not None) == ((False, False) if which == "gemma2" else (True, True))
    out = np.asarray(model.forward(jnp.asarray(ids)))
    np.testing.assert_allclose(out, ref, atol=ATOL_HF)
    linen = LlamaLinen(cfg).apply(params_from_nnx(model), jnp.asarray(ids), method=LlamaLinen.forward)
    np.testing.assert_allclose(np.asarray(linen), ref, atol=ATOL_HF)
    # the window matters: the same weights attending to everything differ past the window
    wide = llama_from_hf(hf, swa_layers=(), n_swa=0, swa_rope=None)
    assert np.abs(np.asarray(wide.forward(jnp.asarray(ids)))[:, 6:] - ref[:, 6:]).max() > 1e-2


def test_each_option_matters():
    """Turning any one mapped option off moves the logits away from HF's (each is really applied)."""
    hf = _hf_gemma3()
    ids = np.random.default_rng(4).integers(0, 48, (1, 12))
    ref = _hf_logits(hf, ids)
    for change in (
        dict(scale_embeddings=False),
        dict(activation="silu"),
        dict(query_pre_attn_scalar=None),
        dict(final_logit_softcap=None),
        dict(swa_rope=None),
        dict(norm_offset=False),
    ):
        model = llama_from_hf(hf, **change)
        assert np.abs(np.asarray(model.forward(jnp.asarray(ids))) - ref).max() > 1e-3, change


# -- cached decode --------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _gemma_model():
    """Gemma 3 weights with every option on (attention soft-capping added): the cached path's subject."""
    return llama_from_hf(_hf_gemma3(), attn_logit_softcap=2.0)


@functools.lru_cache(maxsize=None)
def _uncached():
    graphdef, state = nnx.split(_gemma_model())
    run = jax.jit(lambda st, t: nnx.merge(graphdef, st).forward(t))
    return lambda tokens: np.asarray(run(state, jnp.asarray(tokens)))


@pytest.mark.slow  # iSWA decode == unified == uncached runs by default in test_iswa.py
def test_iswa_decode_equals_uncached_and_unified():
    cfg = _gemma_model().config
    base = cfg.cache_config(size=64, n_seq_max=2, padding=16)
    iswa = kvjax.init(kvjax.IswaConfig(base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, n_batch=16))
    assert iswa.swa.config.size < iswa.base.config.size
    engines = {
        "iswa": Engine(_gemma_model(), iswa, n_ubatch=8),
        "unified": Engine(_gemma_model(), kvjax.init(base), n_ubatch=8),
    }
    prompts = [[1, 2, 3, 4, 5, 9, 11], [1, 2, 3, 4, 7]]
    seqs = {s: list(p) for s, p in enumerate(prompts)}
    toks = prompts[0] + prompts[1]
    pos = list(range(7)) + list(range(5))
    ids = [[0]] * 7 + [[1]] * 5
    out = {k: np.asarray(e.decode(toks, pos, ids)) for k, e in engines.items()}
    np.testing.assert_allclose(out["iswa"][:7], _uncached()(prompts[0]), atol=ATOL_CACHE)
    np.testing.assert_allclose(out["iswa"][7:], _uncached()(prompts[1]), atol=ATOL_CACHE)
    nxt = [int(np.argmax(out["iswa"][6])), int(np.argmax(out["iswa"][11]))]
    for step in range(20):  # 4x the window
        pos = [len(seqs[0]), len(seqs[1])]
        for s in range(2):
            seqs[s].append(nxt[s])
        out = {k: np.asarray(e.decode(nxt, pos, [[0], [1]])) for k, e in engines.items()}
        np.testing.assert_allclose(out["iswa"], out["unified"], atol=2e-5, err_msg=f"step {step}")
        if step % 5 == 4:
            for s in range(2):
                np.testing.assert_allclose(
                    out["iswa"][s], _uncached()(seqs[s])[-1], atol=ATOL_CACHE, err_msg=f"step {step} seq {s}"
                )
        nxt = [int(np.argmax(r)) for r in out["iswa"]]
    assert int(kvjax.used_cells(engines["iswa"].cache.swa)) <= 2 * cfg.n_swa
    assert kvjax.errors(engines["iswa"].cache) == []


def test_linen_step_equals_uncached():
    model = _gemma_model()
    cfg = model.config
    linen, params = LlamaLinen(cfg), params_from_nnx(model)
    step = make_step(linen)
    cache = kvjax.init(cfg.cache_config(size=32, n_seq_max=1, padding=16))
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5]
    ub = kvjax.make_ubatch(list(range(9)), [[0]] * 9, length=16)
    logits, cache, ok = step(params, cache, ub, jnp.asarray(tokens + [0] * 7), n_kv=window_for(cache, 16))
    assert bool(ok)
    np.testing.assert_allclose(np.asarray(logits)[:9], _uncached()(tokens), atol=ATOL_CACHE)
    for i, t in enumerate([7, 8, 0, 3]):
        ub = kvjax.make_ubatch([9 + i], [[0]])
        logits, cache, ok = step(params, cache, ub, jnp.asarray([t]), n_kv=window_for(cache, 1))
        tokens.append(t)
        np.testing.assert_allclose(np.asarray(logits)[0], _uncached()(tokens)[-1], atol=ATOL_CACHE)


def test_kshift_uses_each_layers_rope_base():
    """Shifting a whole sequence by +delta rotates each cached K with its own layer's RoPE (local base for
    the window layers, the global base and scale for the others): RoPE attention depends on position
    differences only, so the next token's logits equal the unshifted uncached pass. A cache given one
    RoPE for every layer gets the window layers wrong."""
    cfg = _gemma_model().config
    ropes = cfg.cache_config(size=32, n_seq_max=1).rope
    assert ropes[0] == cfg.swa_rope and ropes[5] == cfg.rope_config != ropes[0]
    tokens = [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 12]
    ref = _uncached()(tokens + [11])[-1]
    got = {}
    for name, rope in (("per_layer", None), ("one_rope", cfg.rope_config)):
        over = {} if rope is None else {"rope": rope}
        engine = Engine(
            _gemma_model(), kvjax.init(cfg.cache_config(size=64, n_seq_max=1, padding=16, **over)), n_ubatch=16
        )
        engine.decode(tokens, list(range(len(tokens))), [[0]] * len(tokens))
        engine.cache = kvjax.seq_add(engine.cache, 0, 0, -1, 7)
        got[name] = np.asarray(engine.decode([11], [len(tokens) + 7], [[0]]))[0]
    np.testing.assert_allclose(got["per_layer"], ref, atol=ATOL_CACHE)
    assert np.abs(got["one_rope"] - ref).max() > 1e-3
