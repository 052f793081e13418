"""gpt-oss as options of the reference model: learned sinks, a top-k mixture of experts, YaRN untruncated.

- without torch: cached decode through the iSWA pair and a unified cache equals the uncached pass
  far past the window, a shared prefix (``seq_cp``) and a K-shift included; the linen twin equals
  NNX; the MoE equals every expert weighted by its routing, and new routings do not recompile; bad
  option values raise naming the argument;
- against ``transformers`` (skipped without torch): ``llama_from_hf`` of a tiny random
  ``GptOssForCausalLM`` (eager attention, float32) gives its logits uncached, through the cache and
  from a saved folder (:func:`kvjax.nn.from_pretrained`); turning any mapped option off moves them away.
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine
from kvjax.nn import Llama, LlamaConfig, LlamaLinen, MoE, llama_from_hf, make_step, params_from_nnx, window_for
from tests.helpers import no_recompile, numpy_weights, write_gguf_tensors

ATOL_HF = 1e-4  # against torch: other matmul orders
ATOL_CACHE = 5e-5  # cached against uncached, same weights

GPT_OSS = dict(
    vocab_size=48,
    d_model=32,
    n_layer=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=32,  # a multiple of MXFP4's 32-value blocks (the down experts' rows)
    rope=kvjax.RopeConfig(
        n_rot=8,
        mode="neox",
        freq_base=150000.0,
        freq_scale=1 / 8,
        ext_factor=1.0,
        n_ctx_orig=32,
        yarn_truncate=False,
    ),
    swa_layers=(0, 2),
    n_swa=4,
    attention_bias=True,
    attention_sinks=True,
    n_experts=4,
    n_experts_used=2,
    expert_bias=True,
    activation="swiglu_oai",
)


@functools.lru_cache(maxsize=None)
def _model() -> Llama:
    """A gpt-oss-like model whose every weight (sinks and biases too) is random, not its init."""
    model = Llama(LlamaConfig(**GPT_OSS), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


@functools.lru_cache(maxsize=None)
def _uncached():
    graphdef, state = nnx.split(_model())
    run = jax.jit(lambda st, t: nnx.merge(graphdef, st).forward(t))
    return lambda tokens: np.asarray(run(state, jnp.asarray(tokens)))


def test_cached_decode_equals_uncached_on_the_iswa_pair_and_a_unified_cache():
    """Two sequences sharing a copied prefix decode 12 tokens each (3x the window) through both memories."""
    cfg = _model().config
    base = cfg.cache_config(size=64, n_seq_max=2, padding=16)
    iswa = kvjax.init(kvjax.IswaConfig(base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, n_batch=16))
    assert iswa.swa.config.size < iswa.base.config.size
    engines = {"iswa": Engine(_model(), iswa, n_ubatch=8), "unified": Engine(_model(), kvjax.init(base), n_ubatch=8)}
    prompt = [1, 2, 3, 4, 5, 9, 11]
    out = {k: np.asarray(e.decode(prompt, list(range(7)), [[0]] * 7)) for k, e in engines.items()}
    np.testing.assert_allclose(out["iswa"], _uncached()(prompt), atol=ATOL_CACHE)
    for e in engines.values():  # sequence 1 shares the prompt's cells
        e.cache = kvjax.seq_cp(e.cache, 0, 1, 0, 7)
    seqs = {0: list(prompt), 1: list(prompt)}
    nxt = [int(np.argmax(out["iswa"][6])), (int(np.argmax(out["iswa"][6])) + 1) % cfg.vocab_size]
    for step in range(12):
        pos = [len(seqs[0]), len(seqs[1])]
        for s in range(2):
            seqs[s].append(nxt[s])
        out = {k: np.asarray(e.decode(nxt, pos, [[0], [1]])) for k, e in engines.items()}
        np.testing.assert_allclose(out["iswa"], out["unified"], atol=2e-5, err_msg=f"step {step}")
        if step % 4 == 3:
            for s in range(2):
                np.testing.assert_allclose(
                    out["iswa"][s], _uncached()(seqs[s])[-1], atol=ATOL_CACHE, err_msg=f"step {step} seq {s}"
                )
        nxt = [int(np.argmax(r)) for r in out["iswa"]]
    assert seqs[0] != seqs[1]
    assert int(kvjax.used_cells(engines["iswa"].cache.swa)) <= 2 * (cfg.n_swa + 8)
    assert kvjax.errors(engines["iswa"].cache) == []


def test_k_shift_equals_the_unshifted_pass():
    """A sequence moved by +9 positions (YaRN, untruncated ramp) gives the next token's logits of the
    unshifted uncached pass: attention (window rule included) depends on position differences only."""
    cfg = _model().config
    tokens = [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 12]
    engine = Engine(_model(), kvjax.init(cfg.cache_config(size=64, n_seq_max=1, padding=16)), n_ubatch=16)
    engine.decode(tokens, list(range(len(tokens))), [[0]] * len(tokens))
    engine.cache = kvjax.seq_add(engine.cache, 0, 0, -1, 9)
    got = np.asarray(engine.decode([11], [len(tokens) + 9], [[0]]))[0]
    np.testing.assert_allclose(got, _uncached()(tokens + [11])[-1], atol=ATOL_CACHE)


def test_linen_step_equals_nnx():
    model = _model()
    cfg = model.config
    linen, params = LlamaLinen(cfg), params_from_nnx(model)
    tokens = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5]])
    np.testing.assert_allclose(
        np.asarray(linen.apply(params, tokens, method=LlamaLinen.forward))[0], _uncached()(tokens[0]), atol=1e-6
    )
    step = make_step(linen)
    cache = kvjax.init(cfg.cache_config(size=32, n_seq_max=1, padding=16))
    ub = kvjax.make_ubatch(list(range(9)), [[0]] * 9, length=16)
    logits, cache, ok = step(params, cache, ub, jnp.pad(tokens[0], (0, 7)), n_kv=window_for(cache, 16))
    assert bool(ok)
    np.testing.assert_allclose(np.asarray(logits)[:9], _uncached()(tokens[0]), atol=ATOL_CACHE)


@pytest.mark.parametrize("group_rows", [64, 2])
def test_moe_equals_its_experts_weighted_and_does_not_recompile(monkeypatch, group_rows):
    from kvjax.nn import _moe

    monkeypatch.setattr(_moe, "GROUP_ROWS", group_rows)  # 2: several products in each expert's group
    moe = MoE(16, 8, n_experts=5, n_experts_used=3, use_bias=True, activation="swiglu_oai", rngs=nnx.Rngs(2))
    graphdef, state = nnx.split(moe)
    state = jax.tree.map(lambda x: x + 0.5 * jax.random.normal(jax.random.PRNGKey(3), x.shape), state)
    moe = nnx.merge(graphdef, state)
    run = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x))
    for seed in range(4):
        x = jax.random.normal(jax.random.PRNGKey(10 + seed), (7, 16)) * 3
        weights = moe.weights(x)  # [T, X]: 3 experts a token, their weights summing to 1
        np.testing.assert_array_equal(np.asarray((weights > 0).sum(-1)), 3)
        np.testing.assert_allclose(np.asarray(weights.sum(-1)), 1.0, rtol=1e-6)
        dense = sum(weights[:, e, None] * moe.expert(x, e) for e in range(5))
        if seed:  # another routing, same shapes: the compiled program is reused
            with no_recompile():
                got = run(state, x)
        else:
            got = run(state, x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(dense), atol=2e-5)
        np.testing.assert_allclose(np.asarray(moe(x)), np.asarray(dense), atol=2e-5)  # eager too
    # the clamp bites: inputs this large move gate and up past the limit
    big = jax.random.normal(jax.random.PRNGKey(20), (4, 16)) * 50
    gate = big @ state["gate"][...][0] + state["gate_bias"][...][0]
    assert float(jnp.max(gate)) > moe.swiglu_limit


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(n_experts=1), r"n_experts=1 is out of range: allowed 0 \(a dense MLP\) or >= 2"),
        (dict(n_experts_used=5), r"n_experts_used=5 is out of range: allowed 1 to n_experts=4"),
        (dict(n_experts_used=0), r"n_experts_used=0 is out of range: allowed 1 to n_experts=4"),
        (dict(n_experts=0), r"n_experts_used=2 is out of range with n_experts=0: allowed 0"),
        (dict(n_experts=0, n_experts_used=0), r"expert_bias=True is out of range with n_experts=0: allowed False"),
        (dict(attention_sinks="yes"), r"attention_sinks='yes' is out of range: allowed True or False"),
        (dict(activation="relu"), r"activation='relu' is out of range: allowed one of"),
        (dict(swiglu_limit=0.0), r"swiglu_limit=0.0 is out of range"),
        (dict(n_experts=-2), r"n_experts=-2 is out of range"),
    ],
)
def test_bad_options_raise(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**GPT_OSS, **change})


def test_bad_moe_arguments_raise():
    for kwargs, message in (
        (dict(n_experts=1), r"n_experts=1 is out of range"),
        (dict(n_experts_used=9), r"n_experts_used=9 is out of range: allowed at most n_experts=4"),
        (dict(activation="tanh"), r"activation='tanh' is out of range: allowed one of"),
    ):
        with pytest.raises(ValueError, match=message):
            MoE(8, 8, **{"n_experts": 4, "n_experts_used": 2, **kwargs}, rngs=nnx.Rngs(0))


# -- against transformers ---------------------------------------------------------------------------


def _hf_config():
    transformers = pytest.importorskip("transformers")
    return transformers.GptOssConfig(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=32,  # a multiple of MXFP4's 32-value blocks (the down experts' rows)
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 8.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
        attn_implementation="eager",
    )


@functools.lru_cache(maxsize=None)
def _hf_model():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(_hf_config()).eval()
    with torch.no_grad():  # sinks, biases and router start at 0 or small: move every weight
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return model


def _hf_logits(ids):
    torch = pytest.importorskip("torch")

    with torch.no_grad():
        return _hf_model()(torch.as_tensor(ids)).logits.numpy()


def test_logits_equal_transformers_uncached_and_cached():
    ids = np.random.default_rng(3).integers(0, 48, (2, 15))  # 15 tokens, window 4
    ref = _hf_logits(ids)
    model = llama_from_hf(_hf_model())
    cfg = model.config
    assert (cfg.swa_layers, cfg.n_swa, cfg.n_experts, cfg.n_experts_used) == ((0, 2), 4, 4, 2)
    assert cfg.attention_sinks and cfg.expert_bias and not cfg.rope.yarn_truncate
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), ref, atol=ATOL_HF)
    linen = LlamaLinen(cfg).apply(params_from_nnx(model), jnp.asarray(ids), method=LlamaLinen.forward)
    np.testing.assert_allclose(np.asarray(linen), ref, atol=ATOL_HF)
    base = cfg.cache_config(size=64, n_seq_max=2, padding=16)
    iswa = kvjax.init(kvjax.IswaConfig(base, swa_layers=cfg.swa_layers, n_swa=cfg.n_swa, n_batch=16))
    engine = Engine(model, iswa, n_ubatch=8)
    toks = [int(t) for t in ids[0]] + [int(t) for t in ids[1]]
    out = np.asarray(engine.decode(toks, list(range(15)) * 2, [[0]] * 15 + [[1]] * 15))
    np.testing.assert_allclose(out, ref.reshape(30, -1), atol=ATOL_HF)


def test_each_option_matters():
    """Turning any one mapped option off moves the logits away from transformers' (each is applied)."""
    ids = np.random.default_rng(4).integers(0, 48, (1, 12))
    ref = _hf_logits(ids)
    model = llama_from_hf(_hf_model())
    # (yarn_truncate moves these 12 positions by < 1e-6: tests/test_pretrained.py compares the
    # untruncated frequencies with transformers' own)
    for change in (
        dict(swa_layers=(), n_swa=0),
        dict(activation="silu"),
        dict(n_experts_used=1),
    ):
        other = llama_from_hf(_hf_model(), **change)
        assert np.abs(np.asarray(other.forward(jnp.asarray(ids))) - ref).max() > 1e-3, change
    for block in model.layers:  # no sinks: -inf logits take no weight
        block.attn.sinks.set_value(jnp.full(block.attn.sinks.shape, -jnp.inf))
    assert np.abs(np.asarray(model.forward(jnp.asarray(ids))) - ref).max() > 1e-3


def test_from_pretrained_folder_equals_transformers(tmp_path):
    from kvjax.nn import from_pretrained

    _hf_model().save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config == llama_from_hf(_hf_model()).config
    ids = np.random.default_rng(5).integers(0, 48, (1, 10))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), _hf_logits(ids), atol=ATOL_HF)


def test_packed_mxfp4_experts_are_refused_by_name():
    model = llama_from_hf(_hf_model())
    sd = {k: v for k, v in _hf_model().state_dict().items()}
    w = sd.pop("model.layers.0.mlp.experts.gate_up_proj")
    sd["model.layers.0.mlp.experts.gate_up_proj_blocks"] = w
    sd["model.layers.0.mlp.experts.gate_up_proj_scales"] = w
    with pytest.raises(ValueError, match=r"stores its experts packed as MXFP4 .*Mxfp4Config\(dequantize=True\)"):
        llama_from_hf(sd, model=model)


# -- a GGUF twin, as llama.cpp's converter writes gpt-oss ---------------------------------------------


def _hf_state(hf) -> dict:
    """A transformers model's weights as numpy, keys without ``model.``."""
    return {k.removeprefix("model."): v.detach().float().numpy() for k, v in hf.state_dict().items()}


def _hf_state_of(model: Llama) -> dict:
    """A kvjax gpt-oss model's weights under transformers' names (gate and up interleaved again)."""
    from kvjax.nn import _hf

    sd = {}
    for var, key, fn in _hf.llama_plan(model):
        value = np.asarray(var[...])
        if fn is _hf._T:
            value = value.T
        if fn in (_hf._evens, _hf._odds):  # gate and up columns interleave in one tensor
            both = sd.setdefault(key, np.zeros(value.shape[:-1] + (2 * value.shape[-1],), np.float32))
            both[..., 0 if fn is _hf._evens else 1 :: 2] = value
            continue
        sd[key] = value
    return sd


#: llama.cpp's logits for the file :func:`write_llamacpp_gpt_oss` writes (scripts/make_gpt_oss_gguf_fixture.py)
FIXTURE = pathlib.Path(__file__).parent / "data" / "gpt_oss_llamacpp.json"
FIXTURE_TOKENS = [1, 40, 300, 7, 512, 99, 12, 640, 250, 33, 401, 5, 77, 18, 600, 2]


def write_llamacpp_gpt_oss(path):
    """The tiny random gpt-oss (vocabulary of 664 SentencePiece tokens) that llama.cpp ran."""
    model = Llama(LlamaConfig(**{**GPT_OSS, "vocab_size": 664}), rngs=nnx.Rngs(0))
    numpy_weights(model, 6)
    return _write_gguf(path, _hf_state_of(model), model.config, "F32", vocab=True)


def _write_gguf(path, sd, cfg: LlamaConfig, expert_type, *, vocab=False):
    """Weights ``sd`` (transformers' gpt-oss names) of a model with config ``cfg`` under llama.cpp's
    gpt-oss names and metadata, as its converter writes them, the expert tensors in ``expert_type``; with ``vocab`` the SentencePiece
    fixture vocabulary, so that llama.cpp loads the file."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    if vocab:
        from tests.vocab_fixtures import add_spm_vocab

        assert add_spm_vocab(w) == sd["embed_tokens.weight"].shape[0]
    w.add_context_length(256)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.ff_size)
    w.add_expert_feed_forward_length(cfg.ff_size)
    w.add_head_count(cfg.n_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.head_size)
    w.add_value_length(cfg.head_size)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_freq_base(cfg.rope_config.freq_base)
    w.add_expert_count(cfg.n_experts)
    w.add_expert_used_count(cfg.n_experts_used)
    w.add_sliding_window(cfg.n_swa)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(1 / cfg.rope_config.freq_scale)
    w.add_rope_scaling_orig_ctx_len(cfg.rope_config.n_ctx_orig)
    tensors = {
        "token_embd.weight": sd["embed_tokens.weight"],
        "output_norm.weight": sd["norm.weight"],
        "output.weight": sd["lm_head.weight"],
    }
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight",
        "self_attn.sinks": "attn_sinks.weight",
        "mlp.router.weight": "ffn_gate_inp.weight",
        "mlp.router.bias": "ffn_gate_inp.bias",
        "mlp.experts.down_proj_bias": "ffn_down_exps.bias",
    }
    for proj, short in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output")):
        names[f"self_attn.{proj}_proj.weight"] = f"attn_{short}.weight"
        names[f"self_attn.{proj}_proj.bias"] = f"attn_{short}.bias"
    for il in range(cfg.n_layer):
        p, b = f"layers.{il}.", f"blk.{il}."
        for key, name in names.items():
            tensors[b + name] = sd[p + key]
        gate_up = np.swapaxes(sd[p + "mlp.experts.gate_up_proj"], -1, -2)  # [X, 2F, E]: each expert [out, in]
        tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"] = gate_up[:, ::2], gate_up[:, 1::2]
        tensors[b + "ffn_down_exps.weight"] = np.swapaxes(sd[p + "mlp.experts.down_proj"], -1, -2)
        bias = sd[p + "mlp.experts.gate_up_proj_bias"]
        tensors[b + "ffn_gate_exps.bias"], tensors[b + "ffn_up_exps.bias"] = bias[..., ::2], bias[..., 1::2]
    experts = None if expert_type == "F32" else gguf.GGMLQuantizationType[expert_type]
    write_gguf_tensors(w, tensors, lambda name, value: experts if name.endswith("_exps.weight") else None)
    return path


def _through_mxfp4(model: Llama) -> Llama:
    """``model`` with each expert matrix's ``[out, in]`` rows through MXFP4 and back, as a file holds them."""
    gguf = pytest.importorskip("gguf")
    mx = gguf.GGMLQuantizationType.MXFP4
    for block in model.layers:
        for var in (block.mlp.gate, block.mlp.up, block.mlp.down):
            rows = np.ascontiguousarray(np.swapaxes(np.asarray(var[...]), -1, -2))
            back = gguf.quants.dequantize(gguf.quants.quantize(rows, mx), mx)
            var.set_value(jnp.asarray(np.swapaxes(back, -1, -2)))
    return model


@pytest.mark.parametrize(
    "group_rows",
    # several blocks an expert: the float MoE test runs that loop by default, these experts share it
    [64, pytest.param(3, marks=pytest.mark.slow)],
    ids=["one block an expert", "several blocks an expert"],
)
def test_mxfp4_experts_stay_compact_and_equal_their_round_trip(tmp_path, monkeypatch, group_rows):
    """A file's MXFP4 experts stay resident as its blocks (kvjax.nn.GGMLExperts); the model equals the
    float load and the source weights through MXFP4, uncached and decoding through the iSWA pair, with
    each expert's group in one product or in several (a partial last block included)."""
    from kvjax.nn import GGMLExperts, from_gguf
    from kvjax.nn import _moe

    monkeypatch.setattr(_moe, "GROUP_ROWS", group_rows)
    path = _write_gguf(tmp_path / "m.gguf", _hf_state_of(_model()), _model().config, "MXFP4")
    compact, floats = from_gguf(path), from_gguf(path, dtype=jnp.float32)
    assert isinstance(compact.layers[0].mlp.gate, GGMLExperts) and compact.layers[0].mlp.gate.type_name == "MXFP4"
    assert not isinstance(floats.layers[0].mlp.gate, GGMLExperts)
    experts = lambda m: sum(  # noqa: E731
        x.size * x.dtype.itemsize
        for b in m.layers
        for v in (b.mlp.gate, b.mlp.up, b.mlp.down)
        for x in [v.blocks[...] if isinstance(v, GGMLExperts) else v[...]]
    )
    assert experts(compact) * 7 < experts(floats)  # 4.25 bits a weight against 32
    # the file's config is the model's, but for YaRN's range, rounded out as ggml (llama.cpp) does, and
    # the epsilon, which GGUF stores as a float32
    got = floats.config
    assert got == LlamaConfig(**{**GPT_OSS, "rope": got.rope, "norm_eps": got.norm_eps}) and got.rope.yarn_truncate
    want_model = Llama(floats.config, rngs=nnx.Rngs(0))
    nnx.update(want_model, nnx.state(_model()))
    want_model = _through_mxfp4(want_model)
    tokens = [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 12, 3, 3, 7]
    want = np.asarray(want_model.forward(jnp.asarray(tokens)))
    np.testing.assert_allclose(np.asarray(floats.forward(jnp.asarray(tokens))), want, atol=2e-5)
    np.testing.assert_allclose(np.asarray(compact.forward(jnp.asarray(tokens))), want, atol=2e-5)
    cfg = compact.config
    iswa = kvjax.init(
        kvjax.IswaConfig(cfg.cache_config(size=64, n_seq_max=1, padding=16), swa_layers=cfg.swa_layers, n_swa=cfg.n_swa)
    )
    engine = Engine(compact, iswa, n_ubatch=8)
    out = np.asarray(engine.decode(tokens[:10], list(range(10)), [[0]] * 10))
    for i, t in enumerate(tokens[10:]):
        out = np.asarray(engine.decode([t], [10 + i], [[0]]))
    np.testing.assert_allclose(out[0], want[-1], atol=5e-5)


def test_a_gguf_twin_gives_the_transformers_logits(tmp_path):
    from kvjax.nn import from_gguf

    model = from_gguf(
        _write_gguf(tmp_path / "g.gguf", _hf_state(_hf_model()), llama_from_hf(_hf_model()).config, "F32")
    )
    cfg = model.config
    assert (cfg.swa_layers, cfg.n_swa, cfg.n_experts, cfg.n_experts_used) == ((0, 2), 4, 4, 2)
    assert cfg.attention_sinks and cfg.rope.yarn_truncate  # ggml rounds YaRN's range out, as llama.cpp runs it
    ids = np.random.default_rng(6).integers(0, 48, (1, 14))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), _hf_logits(ids), atol=ATOL_HF)
    assert model.gguf_architecture == "gpt-oss"


def test_mxfp4_experts_of_a_transformers_model(tmp_path):
    """The transformers weights through a GGUF with MXFP4 experts: the transformers logits moved only
    by the experts' round trip (the compact load's)."""
    from kvjax.nn import from_gguf

    path = _write_gguf(tmp_path / "m.gguf", _hf_state(_hf_model()), llama_from_hf(_hf_model()).config, "MXFP4")
    ids = np.random.default_rng(7).integers(0, 48, (1, 14))
    want = np.asarray(_through_mxfp4(llama_from_hf(_hf_model())).forward(jnp.asarray(ids)))
    np.testing.assert_allclose(np.asarray(from_gguf(path).forward(jnp.asarray(ids))), want, atol=2e-5)
    assert np.abs(want - _hf_logits(ids)).max() > 1e-3  # MXFP4 is lossy: the test sees the round trip


def test_logits_equal_llama_cpp_on_the_same_file(tmp_path):
    """kvjax's gpt-oss from the file against llama.cpp's logits for it (one batch, and token by token
    through its cache: sinks, the window layers, the experts and YaRN as llama.cpp runs them)."""
    from kvjax.nn import from_gguf

    data = json.loads(FIXTURE.read_text())
    path = write_llamacpp_gpt_oss(tmp_path / "g.gguf")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data["gguf_sha256"], "the fixture file changed"
    model = from_gguf(path, dtype=jnp.float32)
    got = np.asarray(model.forward(jnp.asarray([data["tokens"]])))[0]
    cfg = model.config
    iswa = kvjax.init(
        kvjax.IswaConfig(cfg.cache_config(size=64, n_seq_max=1, padding=16), swa_layers=cfg.swa_layers, n_swa=cfg.n_swa)
    )
    engine = Engine(model, iswa, n_ubatch=8)
    cached = np.concatenate([np.asarray(engine.decode([t], [i], [[0]])) for i, t in enumerate(data["tokens"])])
    for key in ("logits_batch", "logits_stepwise"):
        want = np.asarray(data[key])
        for what, ours in (("uncached", got), ("cached", cached)):
            np.testing.assert_allclose(ours, want, atol=2e-5 * np.abs(want).max(), rtol=0, err_msg=f"{key} {what}")
