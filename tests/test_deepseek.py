"""DeepSeek V2/V3 (kvjax.nn.Deepseek): latent attention on the latent cache, DeepSeek's mixture of experts.

- without torch: cached decode (absorbed attention over ``[c | k_pe]`` rows) equals the uncached
  pass with every head decompressed, a shared prefix (``seq_cp``), streams and a K-shift
  included; q8_0 latent rows stay close; the jitted step does not recompile for new tokens; both
  DeepSeek routings equal a plain numpy transcription of transformers' routers; bad options raise
  naming the field, and a cache of another layout is refused by name;
- against ``transformers`` (skipped without torch): :func:`kvjax.nn.deepseek_from_hf` of tiny random
  ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (eager attention, float32; q low-rank or
  not, greedy or group-limited routing, YaRN with ``mscale_all_dim``, neox or interleaved RoPE)
  gives their logits uncached and through the cache, and from a saved folder
  (:func:`kvjax.nn.from_pretrained`); turning a mapped option off moves them away.
"""

from __future__ import annotations

import dataclasses
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
from kvjax.nn import Deepseek, DeepseekConfig, MLAttention, Routing, UbatchInputs, deepseek_from_hf, make_step
from kvjax.nn._moe import route
from tests.helpers import no_recompile, numpy_weights, write_gguf_tensors

ATOL_HF = 1e-4  # against torch: other matmul orders
ATOL_CACHE = 5e-5  # absorbed (cached) against decompressed (uncached), same weights

DEEPSEEK = dict(
    vocab_size=48,
    d_model=32,
    n_layer=3,
    n_heads=4,
    q_lora_rank=16,
    kv_lora_rank=32,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    d_ff=40,
    rope=kvjax.RopeConfig(n_rot=8, freq_base=10000.0, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=16),
    softmax_scale=0.3,
    n_dense_layers=1,
    n_experts=8,
    n_experts_used=2,
    moe_d_ff=12,
    n_shared_experts=2,
    routing=Routing(score="sigmoid", n_group=4, topk_group=2, choice_bias=True, normalize=True, scale=2.5),
)


@functools.lru_cache(maxsize=None)
def _model(**changes) -> Deepseek:
    """A V3-like model whose every weight (the router's choice bias too) is random, not its init."""
    model = Deepseek(DeepseekConfig(**{**DEEPSEEK, **changes}), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    noisy = [x + 0.3 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(tree, noisy))


def _uncached(model):
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda st, t: nnx.merge(graphdef, st).forward(t))
    return lambda tokens: np.asarray(run(state, jnp.asarray(tokens)))


# streams of latent rows are proven by the memory contract (the mla-streams row) and tests/test_mla.py
@pytest.mark.parametrize("streams", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["unified", "streams"])
def test_cached_decode_equals_uncached_with_a_shared_prefix(streams):
    """Two sequences share a copied 7-token prompt, then decode 8 tokens each through the latent rows."""
    model = _model()
    uncached = _uncached(model)
    cfg = model.config.cache_config(size=64, n_seq_max=2, padding=16)
    memory = kvjax.init(kvjax.StreamsConfig(cfg) if streams else cfg)
    engine = Engine(model, memory, n_ubatch=8)
    prompt = [1, 2, 3, 4, 5, 9, 11]
    out = np.asarray(engine.decode(prompt, list(range(7)), [[0]] * 7))
    np.testing.assert_allclose(out, uncached(prompt), atol=ATOL_CACHE)
    engine.cache = kvjax.seq_cp(engine.cache, 0, 1, -1, -1)  # whole: streams copy the stream's rows
    seqs = {0: list(prompt), 1: list(prompt)}
    nxt = [int(np.argmax(out[6])), (int(np.argmax(out[6])) + 1) % 48]
    for step in range(8):
        pos = [len(seqs[0]), len(seqs[1])]
        for s in range(2):
            seqs[s].append(nxt[s])
        out = np.asarray(engine.decode(nxt, pos, [[0], [1]]))
        if step % 3 == 2:
            for s in range(2):
                np.testing.assert_allclose(
                    out[s], uncached(seqs[s])[-1], atol=ATOL_CACHE, err_msg=f"step {step} seq {s}"
                )
        nxt = [int(np.argmax(r)) for r in out]
    assert seqs[0] != seqs[1]
    assert kvjax.errors(engine.cache) == []


def test_k_shift_equals_the_unshifted_pass():
    """A sequence moved by +9 positions (YaRN) gives the unshifted uncached pass's next logits: the
    shift turns only the rows' RoPE key, and the scores depend on position differences only."""
    model = _model()
    tokens = [5, 3, 8, 1, 9, 2, 7, 4, 6, 10, 12]
    engine = Engine(model, kvjax.init(model.config.cache_config(size=64, n_seq_max=1, padding=16)), n_ubatch=16)
    engine.decode(tokens, list(range(len(tokens))), [[0]] * len(tokens))
    engine.cache = kvjax.seq_add(engine.cache, 0, 0, -1, 9)
    got = np.asarray(engine.decode([11], [len(tokens) + 9], [[0]]))[0]
    np.testing.assert_allclose(got, _uncached(model)(tokens + [11])[-1], atol=ATOL_CACHE)


def test_q8_0_latent_rows_stay_close_to_the_float_pass():
    # q8_0 rows need whole 32-value blocks for the latent and for the RoPE key (llama.cpp's 512 + 64);
    # dense MLPs: a rounding error that flips a token's expert moves its logits by far more than 3%
    model = _model(qk_rope_head_dim=32, rope=kvjax.RopeConfig(n_rot=32), n_experts=0, n_experts_used=0)
    tokens = [4, 8, 15, 16, 23, 42, 7, 1]
    engine = Engine(model, kvjax.init(model.config.cache_config(size=32, n_seq_max=1, k_dtype="q8_0")), n_ubatch=8)
    got = np.asarray(engine.decode(tokens, list(range(8)), [[0]] * 8))
    want = _uncached(model)(tokens)
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_jitted_step_does_not_recompile_for_new_tokens_and_positions():
    model = _model()
    step, state = make_step(model), nnx.state(model)
    cache = kvjax.init(model.config.cache_config(size=64, n_seq_max=2, padding=16))
    ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [0]], length=4)
    _, cache, ok = step(state, cache, ub, jnp.array([1, 2, 3, 0]), n_kv=32)
    assert bool(ok)
    with no_recompile():
        ub = kvjax.make_ubatch([3, 0, 1], [[0], [1], [1]], length=4)
        _, cache, ok = step(state, cache, ub, jnp.array([7, 9, 11, 0]), n_kv=32)
    assert bool(ok) and int(kvjax.used_cells(cache)) == 6


def test_attention_layer_jitted_equals_eager():
    attn = MLAttention(
        16, 2, kv_lora_rank=32, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6, layer=0,
        rope=kvjax.RopeConfig(n_rot=4), q_lora_rank=8, rngs=nnx.Rngs(3),
    )  # fmt: skip
    cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=36, head_dim_v=32, mla=True)
    ub = kvjax.make_ubatch([0, 1, 2, 3], [[0]] * 4)
    cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16))
    inputs = UbatchInputs(ubatch=ub, placement=slot, windows=(32,))
    graphdef, state = nnx.split(attn)
    jitted = jax.jit(lambda st, x, c, i: nnx.merge(graphdef, st)(x, c, i))
    (y_jit, c_jit), (y, c) = jitted(state, x, cache, inputs), attn(x, cache, inputs)
    np.testing.assert_allclose(np.asarray(y_jit), np.asarray(y), atol=1e-6)
    np.testing.assert_allclose(np.asarray(c_jit.k), np.asarray(c.k), atol=1e-6)
    np.testing.assert_allclose(np.asarray(y), np.asarray(attn.uncached(x[None], jnp.arange(4)[None]))[0], atol=1e-5)


def test_a_cache_of_another_layout_is_refused_by_name():
    model = _model()
    plain = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=3, n_kv_heads=1, head_dim=40))
    ub = kvjax.make_ubatch([0], [[0]])
    plain, slot, _ = kvjax.find_slot(plain, ub)
    with pytest.raises(ValueError, match=r"cache layer 0 has mla=False.*allowed the latent rows mla=True"):
        model(jnp.array([1]), plain, UbatchInputs(ubatch=ub, placement=slot, windows=(32,)))
    narrow = kvjax.init(model.config.cache_config(size=32, n_seq_max=1, head_dim=48))
    narrow, slot, _ = kvjax.find_slot(narrow, ub)
    with pytest.raises(ValueError, match=r"head_dim=48"):
        model(jnp.array([1]), narrow, UbatchInputs(ubatch=ub, placement=slot, windows=(32,)))


def test_a_deepseek_v2_lite_config_json_maps_without_torch(tmp_path):
    """The hub's DeepSeek-V2-Lite config.json (sizes as published; older keys: ``rope_scaling`` with
    ``type``, ``scoring_func``) maps onto the config and its latent cache of 576 numbers a layer."""
    from kvjax.nn._pretrained import read_config

    (tmp_path / "config.json").write_text(
        json.dumps(
            dict(
                model_type="deepseek_v2",
                architectures=["DeepseekV2ForCausalLM"],
                vocab_size=102400,
                hidden_size=2048,
                intermediate_size=10944,
                moe_intermediate_size=1408,
                num_hidden_layers=27,
                num_attention_heads=16,
                num_key_value_heads=16,
                q_lora_rank=None,
                kv_lora_rank=512,
                qk_nope_head_dim=128,
                qk_rope_head_dim=64,
                v_head_dim=128,
                n_routed_experts=64,
                num_experts_per_tok=6,
                n_shared_experts=2,
                first_k_dense_replace=1,
                moe_layer_freq=1,
                topk_method="greedy",
                n_group=1,
                topk_group=1,
                scoring_func="softmax",
                norm_topk_prob=False,
                routed_scaling_factor=1.0,
                rms_norm_eps=1e-6,
                rope_theta=10000,
                max_position_embeddings=163840,
                rope_scaling=dict(
                    type="yarn",
                    factor=40,
                    original_max_position_embeddings=4096,
                    beta_fast=32,
                    beta_slow=1,
                    mscale=0.707,
                    mscale_all_dim=0.707,
                ),
                tie_word_embeddings=False,
                hidden_act="silu",
            )
        )
    )
    cfg = DeepseekConfig.from_hf(read_config(tmp_path))
    assert (cfg.n_layer, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.row_width) == (27, 16, None, 512, 576)
    assert (cfg.n_dense_layers, cfg.n_experts, cfg.n_experts_used, cfg.n_shared_experts, cfg.expert_size) == (
        1,
        64,
        6,
        2,
        1408,
    )
    assert cfg.routing == Routing(score="softmax")
    rope = cfg.rope_config
    assert (rope.mode, rope.freq_scale, rope.n_ctx_orig, rope.n_rot) == (kvjax.RopeMode.NORMAL, 1 / 40, 4096, 64)
    # mscale == mscale_all_dim: the rotated part keeps its length; the scores take mscale ** 2
    assert rope.attn_factor * (1 + 0.1 * np.log(40)) == pytest.approx(1.0)
    assert cfg.scale == pytest.approx((0.1 * 0.707 * np.log(40) + 1) ** 2 / np.sqrt(192))
    cache = cfg.cache_config(size=4096, n_seq_max=1, k_dtype="float16")
    assert (kvjax.size_k_bytes(cache), kvjax.size_v_bytes(cache)) == (4096 * 27 * 576 * 2, 0)  # 31 KB a cell


# -- routing ------------------------------------------------------------------------------------


def _hf_route(logits, k, routing, bias):
    """transformers' DeepSeek routers in numpy (V2: ``DeepseekV2TopkRouter``, V3: ``DeepseekV3TopkRouter``)."""
    t, x = logits.shape
    g = routing.n_group
    if routing.score == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
        choice = scores.copy()
        if g > 1:
            group = choice.reshape(t, g, -1).max(-1)
            keep = np.zeros((t, g), bool)
            np.put_along_axis(keep, np.argsort(-group, -1)[:, : routing.topk_group], True, -1)
            choice = np.where(np.repeat(keep, x // g, -1), choice, 0.0)
    else:
        scores = 1 / (1 + np.exp(-logits))
        choice = scores + bias
        group = np.sort(choice.reshape(t, g, -1), -1)[..., -2:].sum(-1)
        keep = np.zeros((t, g), bool)
        np.put_along_axis(keep, np.argsort(-group, -1)[:, : routing.topk_group], True, -1)
        choice = np.where(np.repeat(keep, x // g, -1), choice, -np.inf)
    experts = np.argsort(-choice, -1)[:, :k]
    w = np.take_along_axis(scores, experts, -1)
    if routing.normalize:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return experts, w * routing.scale


@pytest.mark.parametrize(
    "routing",
    [
        Routing(score="softmax", scale=1.5),
        Routing(score="softmax", n_group=4, topk_group=2),
        Routing(score="sigmoid", n_group=4, topk_group=2, choice_bias=True, normalize=True, scale=2.5),
        Routing(score="sigmoid", choice_bias=True),
    ],
    ids=["v2-greedy", "v2-groups", "v3", "v3-one-group"],
)
def test_routing_equals_transformers_routers(routing):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 8)).astype(np.float32) * 2
    bias = rng.normal(size=8).astype(np.float32) * 0.5
    experts, weights = jax.jit(lambda lg, b: route(lg, 3, routing, b if routing.choice_bias else None))(logits, bias)
    want_e, want_w = _hf_route(logits, 3, routing, bias if routing.choice_bias else 0.0)
    order = np.argsort(np.asarray(experts), -1)  # the same experts, in any order
    want_order = np.argsort(want_e, -1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, -1), np.take_along_axis(want_e, want_order, -1)
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1), np.take_along_axis(want_w, want_order, -1), rtol=1e-5
    )
    if routing.n_group > 1:  # every token's experts lie in at most topk_group groups
        groups = np.asarray(experts) // (8 // routing.n_group)
        assert max(len(set(row)) for row in groups.tolist()) <= routing.topk_group


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(score="top2"), r"routing.score='top2' is out of range"),
        (dict(n_group=0), r"routing.n_group=0 is out of range"),
        (
            dict(score="sigmoid", n_group=2, topk_group=3),
            r"routing.topk_group=3 is out of range: allowed at most n_group=2",
        ),
        (dict(n_group=2), r"routing.n_group=2 is out of range: allowed 1 with score='topk_softmax'"),
        (dict(scale=0.0), r"routing.scale=0.0 is out of range"),
        (dict(normalize="yes"), r"routing.normalize"),
    ],
)
def test_bad_routing_raises(change, message):
    with pytest.raises(ValueError, match=message):
        Routing(**change)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(qk_rope_head_dim=7, rope=None), r"qk_rope_head_dim=7 is out of range: allowed an even number"),
        (dict(rope=kvjax.RopeConfig(n_rot=4)), r"rope.n_rot=4 is out of range: allowed qk_rope_head_dim=8"),
        (dict(n_experts=1), r"n_experts=1 is out of range"),
        (dict(n_experts_used=9), r"n_experts_used=9 is out of range: allowed 1 to n_experts=8"),
        (
            dict(routing=Routing(score="sigmoid", n_group=3)),
            r"routing.n_group=3 is out of range: allowed a divisor of n_experts=8",
        ),
        (dict(routing=Routing()), r"routing.score='topk_softmax' is out of range: allowed 'softmax' or 'sigmoid'"),
        (dict(n_experts=0), r"n_experts_used=2 is out of range: allowed 0 with n_experts=0"),
        (dict(softmax_scale=-1.0), r"softmax_scale=-1.0 is out of range"),
        (dict(kv_lora_rank=0), r"kv_lora_rank=0 is out of range"),
    ],
)
def test_bad_options_raise(change, message):
    with pytest.raises(ValueError, match=message):
        DeepseekConfig(**{**DEEPSEEK, **change})


# -- against transformers -----------------------------------------------------------------------

HF_CASES = {
    "v2-lite": ("v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)),
    "v2-groups": ("v2", dict(q_lora_rank=16, topk_method="group_limited_greedy", n_group=4, topk_group=1)),
    "v3": ("v3", dict(q_lora_rank=16, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)),
    "v3-yarn-neox": (
        "v3",
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            rope_interleave=False,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=64,
                mscale=1.0,
                mscale_all_dim=0.707,
                beta_fast=32,
                beta_slow=1,
            ),
        ),
    ),
}


@functools.lru_cache(maxsize=None)
def _hf_model(case: str):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kind, changes = HF_CASES[case]
    config_cls = transformers.DeepseekV2Config if kind == "v2" else transformers.DeepseekV3Config
    model_cls = transformers.DeepseekV2ForCausalLM if kind == "v2" else transformers.DeepseekV3ForCausalLM
    args = dict(
        vocab_size=48,
        hidden_size=32,
        intermediate_size=40,
        moe_intermediate_size=12,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**args, **changes})).eval()
    with torch.no_grad():  # routers and biases start at 0 or small: move every weight (norms around 1)
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.1 if "norm" in name else 0.3) + (1.0 if "norm" in name else 0.0))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(torch.randn_like(b) * 0.3)
    return model


def _hf_logits(case, ids):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        return _hf_model(case)(torch.as_tensor(ids)).logits.numpy()


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_equal_transformers_uncached_and_cached(case):
    ids = np.random.default_rng(3).integers(0, 48, (2, 13))
    ref = _hf_logits(case, ids)
    model = deepseek_from_hf(_hf_model(case))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), ref, atol=ATOL_HF)
    engine = Engine(model, kvjax.init(model.config.cache_config(size=64, n_seq_max=2, padding=16)), n_ubatch=8)
    toks = [int(t) for t in ids[0]] + [int(t) for t in ids[1]]
    out = np.asarray(engine.decode(toks, list(range(13)) * 2, [[0]] * 13 + [[1]] * 13))
    np.testing.assert_allclose(out, ref.reshape(26, -1), atol=ATOL_HF)


def test_shared_prefix_rollback_and_context_shift_equal_transformers():
    """Two sequences share a copied prompt, then diverge; one drops its last token and takes another
    (exact: the cache then holds the shorter sequence); the other moves by +9 positions (a K-shift of
    the RoPE keys: the scores depend on position differences only). Every row equals transformers on
    the tokens the sequence holds."""
    model = deepseek_from_hf(_hf_model("v3"))
    engine = Engine(model, kvjax.init(model.config.cache_config(size=64, n_seq_max=2, padding=16)), n_ubatch=8)
    prompt = [5, 3, 8, 1, 9, 2, 7, 4, 6]
    engine.decode(prompt, list(range(9)), [[0]] * 9)
    engine.cache = kvjax.seq_cp(engine.cache, 0, 1, -1, -1)
    tails = ([11, 12, 13], [20, 21])
    for s, tail in enumerate(tails):
        out = np.asarray(engine.decode(tail, list(range(9, 9 + len(tail))), [[s]] * len(tail)))
        np.testing.assert_allclose(out, _hf_logits("v3", [prompt + tail])[0, 9:], atol=ATOL_HF)
    engine.cache, removed = kvjax.seq_rm(engine.cache, 1, 10, -1)  # sequence 1 takes back its 21
    assert bool(removed)
    got = np.asarray(engine.decode([33], [10], [[1]]))[0]
    np.testing.assert_allclose(got, _hf_logits("v3", [prompt + [20, 33]])[0, -1], atol=ATOL_HF)
    engine.cache = kvjax.seq_add(engine.cache, 0, 0, -1, 9)  # sequence 0's cells move by +9
    got = np.asarray(engine.decode([30], [12 + 9], [[0]]))[0]
    np.testing.assert_allclose(got, _hf_logits("v3", [prompt + list(tails[0]) + [30]])[0, -1], atol=ATOL_HF)


def test_mapped_config():
    v3 = deepseek_from_hf(_hf_model("v3")).config
    assert (v3.q_lora_rank, v3.n_dense_layers, v3.n_experts, v3.n_experts_used, v3.n_shared_experts) == (16, 1, 8, 2, 1)
    assert v3.routing == Routing(score="sigmoid", n_group=4, topk_group=2, choice_bias=True, normalize=True, scale=2.5)
    assert v3.rope_config.mode == kvjax.RopeMode.NORMAL
    yarn = deepseek_from_hf(_hf_model("v3-yarn-neox")).config
    assert yarn.rope_config.mode == kvjax.RopeMode.NEOX and yarn.rope_config.freq_scale == 0.25
    # transformers' yarn_apply_mscale: the score scale times mscale(factor, mscale_all_dim) ** 2
    assert yarn.scale == pytest.approx(16**-0.5 * (0.1 * 0.707 * np.log(4.0) + 1) ** 2)
    v2 = deepseek_from_hf(_hf_model("v2-lite")).config
    assert v2.q_lora_rank is None and v2.routing == Routing(score="softmax", scale=1.5)


def test_each_option_matters():
    """Turning one mapped option off moves the logits away from transformers' (each is applied)."""
    ids = np.random.default_rng(4).integers(0, 48, (1, 12))
    for case, change in (
        ("v3", dict(routing=Routing(score="sigmoid", n_group=4, topk_group=2, choice_bias=True, scale=2.5))),
        ("v3", dict(n_shared_experts=0)),
        ("v2-groups", dict(routing=Routing(score="softmax"))),
        ("v2-lite", dict(routing=Routing(score="softmax"))),
        ("v3-yarn-neox", dict(softmax_scale=16**-0.5)),
    ):
        base = deepseek_from_hf(_hf_model(case)).config
        if "n_shared_experts" in change:  # a model without them reads none of their weights
            model = Deepseek(dataclasses.replace(base, **change), rngs=nnx.Rngs(0))
            sd = {k: v for k, v in _hf_model(case).state_dict().items() if "shared_experts" not in k}
            other = deepseek_from_hf(sd, model=model)
        else:
            other = deepseek_from_hf(_hf_model(case), **change)
        assert np.abs(np.asarray(other.forward(jnp.asarray(ids))) - _hf_logits(case, ids)).max() > 1e-3, (case, change)


def test_from_pretrained_folder_equals_transformers(tmp_path):
    from kvjax.nn import from_pretrained, memory_config_for

    _hf_model("v3").save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert isinstance(model, Deepseek) and model.config == deepseek_from_hf(_hf_model("v3")).config
    ids = np.random.default_rng(5).integers(0, 48, (1, 10))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), _hf_logits("v3", ids), atol=ATOL_HF)
    assert memory_config_for(model, size=64).mla
    bf16 = from_pretrained(tmp_path, dtype="bfloat16")
    assert bf16.layers[1].mlp.experts.gate.dtype == jnp.bfloat16
    assert bf16.layers[1].mlp.experts.score_bias.dtype == jnp.float32  # the router's choice bias stays float32


def test_per_expert_tensors_load_like_the_stacks():
    """Checkpoint files hold one tensor per expert; the loader stacks them (and refuses a gap by name)."""
    sd = {k: v for k, v in _hf_model("v3").state_dict().items()}
    per_expert = {}
    for key, value in sd.items():
        if key.endswith("mlp.experts.gate_up_proj"):
            prefix, f = key[: -len("gate_up_proj")], value.shape[1] // 2
            for e in range(value.shape[0]):
                per_expert[f"{prefix}{e}.gate_proj.weight"] = value[e, :f]
                per_expert[f"{prefix}{e}.up_proj.weight"] = value[e, f:]
        elif key.endswith("mlp.experts.down_proj"):
            for e in range(value.shape[0]):
                per_expert[f"{key[: -len('down_proj')]}{e}.down_proj.weight"] = value[e]
        else:
            per_expert[key] = value
    cfg = deepseek_from_hf(_hf_model("v3")).config
    model = deepseek_from_hf(per_expert, model=Deepseek(cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(6).integers(0, 48, (1, 9))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), _hf_logits("v3", ids), atol=ATOL_HF)
    del per_expert["model.layers.1.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"experts 0..X-1, each with gate_proj, up_proj and down_proj"):
        deepseek_from_hf(per_expert, model=Deepseek(cfg, rngs=nnx.Rngs(0)))


# -- GGUF (llama.cpp's deepseek2) ---------------------------------------------------------------


def _hf_state_of(model: Deepseek) -> dict:
    """``model``'s weights under transformers' names (experts stacked), numpy: the inverse of the loader's plan."""
    from kvjax.nn._deepseek_hf import deepseek_plan

    sd = {}
    for var, key, fn in deepseek_plan(model):
        w = np.asarray(var.get_value(), np.float32)
        name = getattr(fn, "__name__", "")
        if name == "_T":
            sd[key] = w.T
        elif name in ("_gate_rows", "_up_rows"):  # [X, E, F] -> the gate or up rows of [X, 2F, E]
            sd.setdefault(key, {})[name] = np.swapaxes(w, 1, 2)
        elif name == "_swap":
            sd[key] = np.swapaxes(w, 1, 2)
        else:
            sd[key] = w
    for key, value in sd.items():
        if isinstance(value, dict):
            sd[key] = np.concatenate([value["_gate_rows"], value["_up_rows"]], axis=1)
    return sd


def write_deepseek_gguf(
    path, sd, cfg: DeepseekConfig, *, weight_type="F32", yarn=None, vocab=False, split_kv_b=True, extra_kv=None
):
    """Weights ``sd`` (transformers' names, experts stacked) of a model with config ``cfg`` as llama.cpp's
    converter writes a ``deepseek2`` file: metadata, the latent row's sizes, ``kv_b_proj`` split into
    ``attn_k_b`` / ``attn_v_b`` (or one older ``attn_kv_b`` without ``split_kv_b``), the experts
    merged. Matrices whose rows are whole 32-value blocks go in ``weight_type``; ``yarn`` is
    ``(factor, original context, mscale_all_dim)``; with ``vocab`` the SentencePiece fixture
    vocabulary, so that llama.cpp loads the file; ``extra_kv`` maps more ``GGUFWriter`` methods to
    their arguments (another vocabulary)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), "deepseek2")
    if vocab:
        from tests.vocab_fixtures import add_spm_vocab

        assert add_spm_vocab(w) == cfg.vocab_size
    for method, args in (extra_kv or {}).items():
        getattr(w, method)(*(args if isinstance(args, tuple) else (args,)))
    h, c, n, r, v = cfg.n_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    w.add_context_length(256)
    w.add_vocab_size(cfg.vocab_size)
    w.add_embedding_length(cfg.d_model)
    w.add_block_count(cfg.n_layer)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(h)
    w.add_head_count_kv(1)
    w.add_key_length(c + r)
    w.add_value_length(c)
    w.add_key_length_mla(n + r)
    w.add_value_length_mla(v)
    w.add_kv_lora_rank(c)
    if cfg.q_lora_rank is not None:
        w.add_q_lora_rank(cfg.q_lora_rank)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_rope_dimension_count(r)
    w.add_rope_freq_base(cfg.rope_config.freq_base)
    if yarn is not None:
        factor, n_orig, mscale_all_dim = yarn
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(factor)
        w.add_rope_scaling_orig_ctx_len(n_orig)
        w.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)
    w.add_leading_dense_block_count(cfg.n_dense_layers if cfg.n_experts else cfg.n_layer)
    w.add_expert_feed_forward_length(cfg.expert_size)
    w.add_expert_shared_count(cfg.n_shared_experts)
    if cfg.n_experts:
        ro = cfg.routing
        w.add_expert_count(cfg.n_experts)
        w.add_expert_used_count(cfg.n_experts_used)
        w.add_expert_weights_scale(ro.scale)
        if ro.normalize:
            w.add_expert_weights_norm(True)
        w.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if ro.score == "sigmoid" else gguf.ExpertGatingFuncType.SOFTMAX
        )
        w.add_expert_group_count(ro.n_group)
        w.add_expert_group_used_count(ro.topk_group)
    tensors = {"token_embd.weight": sd["embed_tokens.weight"], "output_norm.weight": sd["norm.weight"]}
    if "lm_head.weight" in sd:
        tensors["output.weight"] = sd["lm_head.weight"]
    names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.q_a_proj.weight": "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight": "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        "mlp.experts.down_proj": "ffn_down_exps.weight",
    }
    for proj in ("gate", "up", "down"):
        names[f"mlp.{proj}_proj.weight"] = f"ffn_{proj}.weight"
        names[f"mlp.shared_experts.{proj}_proj.weight"] = f"ffn_{proj}_shexp.weight"
    for il in range(cfg.n_layer):
        p, b = f"layers.{il}.", f"blk.{il}."
        for key, name in names.items():
            if p + key in sd:
                tensors[b + name] = sd[p + key]
        if p + "mlp.experts.gate_up_proj" in sd:
            gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [X, 2F, E]: gate rows, then up rows
            f = gate_up.shape[1] // 2
            tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"] = gate_up[:, :f], gate_up[:, f:]
        kv_b = np.asarray(sd[p + "self_attn.kv_b_proj.weight"])  # [H (N + V), C]
        if split_kv_b:
            per_head = kv_b.reshape(h, n + v, c)
            tensors[b + "attn_k_b.weight"] = np.swapaxes(per_head[:, :n], 1, 2)  # [H, C, N]
            tensors[b + "attn_v_b.weight"] = per_head[:, n:]  # [H, V, C]
        else:
            tensors[b + "attn_kv_b.weight"] = kv_b

    def kind_of(name, value):  # matrices in weight_type where their rows are whole blocks
        if weight_type == "F32" or value.ndim < 2 or "norm" in name:
            return None
        kind = gguf.GGMLQuantizationType[weight_type]
        return kind if value.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] == 0 else None

    write_gguf_tensors(w, {k: np.asarray(v) for k, v in tensors.items()}, kind_of)
    return path


def _gguf_model(**changes):
    """``_model`` with llama.cpp's conventions (its config is what a deepseek2 file can say: the
    norms' epsilon a float32)."""
    eps = float(np.float32(1e-6))
    return _model(softmax_scale=None, rope=kvjax.RopeConfig(n_rot=8), norm_eps=eps, latent_norm_eps=eps, **changes)


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["k_b-v_b", "kv_b"])
def test_a_gguf_file_loads_the_same_model(tmp_path, split_kv_b):
    """A model written as a deepseek2 GGUF comes back with its config and its logits (float load),
    and compact (Q8_0 matrices kept as blocks) close to them."""
    from kvjax.nn import GGMLExperts, GGMLLinear, from_gguf, gguf_config

    model = _gguf_model()
    path = write_deepseek_gguf(tmp_path / "d.gguf", _hf_state_of(model), model.config, split_kv_b=split_kv_b)
    assert gguf_config(path) == model.config
    ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]])
    want = _uncached(model)(ids)
    np.testing.assert_allclose(np.asarray(from_gguf(path, dtype=jnp.float32).forward(ids)), want, atol=1e-5)
    bias = from_gguf(path, dtype=jnp.bfloat16).layers[1].mlp.experts.score_bias  # float32, not rounded to bfloat16
    assert bias.dtype == jnp.float32 and bool(jnp.all(bias[...] == model.layers[1].mlp.experts.score_bias[...]))
    q8 = write_deepseek_gguf(tmp_path / "q8.gguf", _hf_state_of(model), model.config, weight_type="Q8_0")
    compact = from_gguf(q8)
    assert isinstance(compact.layers[1].mlp.experts.gate, GGMLExperts)
    assert isinstance(compact.layers[0].attn.kv_a_proj_with_mqa, GGMLLinear)
    assert compact.layers[1].mlp.experts.score_bias.dtype == jnp.float32
    got = np.asarray(compact.forward(ids))
    assert np.abs(got - want).max() <= 0.1 * np.abs(want).max()  # Q8_0 rounding, routing flips included
    cache = kvjax.init(compact.config.cache_config(size=32, n_seq_max=1))
    out = np.asarray(Engine(compact, cache, n_ubatch=16).decode(ids[0].tolist(), list(range(10)), [[0]] * 10))
    np.testing.assert_allclose(out, got[0], atol=ATOL_CACHE * 10)


def test_gguf_yarn_keeps_the_rope_length_and_scales_the_scores(tmp_path):
    from kvjax.nn import gguf_config

    model = _gguf_model()
    path = write_deepseek_gguf(tmp_path / "y.gguf", _hf_state_of(model), model.config, yarn=(4.0, 64, 0.707))
    cfg = gguf_config(path)
    mscale = 0.1 * 0.707 * np.log(4.0) + 1
    assert cfg.scale == pytest.approx(mscale**2 / np.sqrt(16))
    rope = cfg.rope_config
    assert rope.freq_scale == 0.25 and rope.n_ctx_orig == 64
    assert rope.attn_factor * (1 + 0.1 * np.log(4.0)) == pytest.approx(1.0)  # ggml's magnitude cancelled


def test_bad_gguf_files_are_refused_by_name(tmp_path):
    from kvjax.nn import from_gguf

    model = _gguf_model()
    sd = _hf_state_of(model)
    path = write_deepseek_gguf(tmp_path / "d.gguf", sd, model.config)
    sd_bad = {k: v for k, v in sd.items() if k != "layers.2.self_attn.kv_b_proj.weight"}
    sd_bad["layers.2.self_attn.kv_b_proj.weight"] = np.zeros((4 * 19, 32), np.float32)  # one head row short
    bad = write_deepseek_gguf(tmp_path / "bad.gguf", sd_bad, model.config, split_kv_b=False)
    with pytest.raises(ValueError, match=r"tensor 'blk.2.attn_kv_b.weight' has shape \(76, 32\): allowed \(80, 32\)"):
        from_gguf(bad)
    assert from_gguf(path).config == model.config


@pytest.mark.parametrize("case", ["v2-lite", "v3"])
def test_a_gguf_twin_gives_the_transformers_logits(tmp_path, case):
    from kvjax.nn import from_gguf

    hf = _hf_model(case)
    cfg = deepseek_from_hf(hf).config
    sd = {k[len("model.") :] if k.startswith("model.") else k: v.numpy() for k, v in hf.state_dict().items()}
    path = write_deepseek_gguf(tmp_path / "t.gguf", sd, cfg)
    model = from_gguf(path, dtype=jnp.float32)
    ids = np.random.default_rng(7).integers(0, 48, (1, 11))
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(ids))), _hf_logits(case, ids), atol=ATOL_HF)


# -- against llama.cpp itself -------------------------------------------------------------------

#: llama.cpp's logits for the file :func:`write_llamacpp_deepseek` writes (scripts/make_deepseek_gguf_fixture.py)
FIXTURE = pathlib.Path(__file__).parent / "data" / "deepseek_llamacpp.json"
FIXTURE_TOKENS = [1, 40, 300, 7, 512, 99, 12, 640, 250, 33, 401, 5, 77, 18, 600, 2]
#: the fixture's YaRN: (factor, original context, mscale_all_dim), as DeepSeek V2 sets them
FIXTURE_YARN = (4.0, 8, 0.707)


def random_deepseek(cfg: DeepseekConfig, seed: int) -> Deepseek:
    """A model of ``cfg`` whose every weight numpy drew (``0.3 N(0, 1)``, norms around 1), so that
    the bytes of a file written from it do not depend on XLA's flags (the suite's differ)."""
    return numpy_weights(Deepseek(cfg, rngs=nnx.Rngs(0)), seed)


def write_llamacpp_deepseek(path):
    """The tiny random DeepSeek V3-style model (vocabulary of 664 SentencePiece tokens, YaRN) that llama.cpp ran."""
    factor, n_orig, mscale_all_dim = FIXTURE_YARN
    builtin = 1 + 0.1 * np.log(factor)
    rope = kvjax.RopeConfig(
        n_rot=8, freq_scale=1 / factor, ext_factor=1.0, attn_factor=float(1 / builtin), n_ctx_orig=n_orig
    )
    eps = float(np.float32(1e-6))
    scale = float((0.1 * mscale_all_dim * np.log(factor) + 1) ** 2 / np.sqrt(16))
    cfg = DeepseekConfig(
        **{**DEEPSEEK, "vocab_size": 664, "rope": rope, "softmax_scale": scale, "norm_eps": eps, "latent_norm_eps": eps}
    )
    model = random_deepseek(cfg, 8)
    return write_deepseek_gguf(path, _hf_state_of(model), cfg, yarn=FIXTURE_YARN, vocab=True)


def test_logits_equal_llama_cpp_on_the_same_file(tmp_path):
    """kvjax's deepseek2 from the file against llama.cpp's logits for it (one batch, and token by token
    through its latent cache: absorbed MLA, YaRN's mscale, V3 routing with groups, the choice bias
    and shared experts, as llama.cpp runs them)."""
    from kvjax.nn import from_gguf

    data = json.loads(FIXTURE.read_text())
    path = write_llamacpp_deepseek(tmp_path / "d.gguf")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data["gguf_sha256"], "the fixture file changed"
    model = from_gguf(path, dtype=jnp.float32)
    got = np.asarray(model.forward(jnp.asarray([data["tokens"]])))[0]
    engine = Engine(model, kvjax.init(model.config.cache_config(size=64, n_seq_max=1, padding=16)), n_ubatch=8)
    cached = np.concatenate([np.asarray(engine.decode([t], [i], [[0]])) for i, t in enumerate(data["tokens"])])
    for key in ("logits_batch", "logits_stepwise"):
        want = np.asarray(data[key])
        for what, ours in (("uncached", got), ("cached", cached)):
            np.testing.assert_allclose(ours, want, atol=2e-5 * np.abs(want).max(), rtol=0, err_msg=f"{key} {what}")
