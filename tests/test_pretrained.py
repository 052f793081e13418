"""``kvjax.nn.from_pretrained``: Hugging Face checkpoint folders to models the engine drives.

- Without torch: a kvjax Llama written as a checkpoint (``save_llama``: one file or shards with an
  index, tied or untied, Qwen2 biases, float16 storage) loads back to the same logits; bfloat16
  loads within a stated tolerance; bad checkpoints (missing / unexpected tensor, wrong shape,
  truncated or corrupt file, missing shard, unsupported architecture or RoPE kind, integer
  tensors, bad ``dtype``) raise ``ValueError`` naming what is wrong, shapes checked before any
  tensor is read; :func:`memory_config_for` picks the memory kind.
- RoPE kinds: :func:`rope_from_hf`'s frequencies and magnitude equal transformers' own
  (skipped without it). The models against transformers are in ``test_pretrained_hf.py``.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine
from kvjax.nn import Llama, LlamaConfig, Mamba, from_pretrained, memory_config_for, rope_from_hf
from kvjax.nn._hf import load_plan, llama_plan
from kvjax.nn._pretrained import SafetensorsSource, read_config, save_llama

pytest.importorskip("safetensors")

ATOL_HF = 1e-4  # float32 against torch (other matmul orders)
BF16_TOL = 0.08  # bfloat16 weights: max |logit diff| <= BF16_TOL * max |logit| (measured 0.2-4.4% on these models)
V = 100


def _kvjax_llama(seed=0, **changes):
    args = dict(
        vocab_size=V,
        d_model=64,
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        d_ff=96,
        rope=kvjax.RopeConfig(n_rot=16, mode="neox", freq_base=10000.0),
    )
    args.update(changes)
    model = Llama(LlamaConfig(**args), rngs=nnx.Rngs(seed))
    if model.config.attention_bias:  # random biases (zero o bias: Qwen2 has none)
        rng = np.random.default_rng(seed)
        for block in model.layers:
            for proj in (block.attn.q_proj, block.attn.k_proj, block.attn.v_proj):
                proj.bias.set_value(jnp.asarray(rng.normal(size=proj.bias.shape) * 0.3, jnp.float32))
            block.attn.o_proj.bias.set_value(jnp.zeros(block.attn.o_proj.bias.shape))
    return model


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, V, 13), jnp.int32)


# -- without torch: kvjax's own weights written and read back ---------------------------------------


@pytest.mark.parametrize(
    "changes, shard",
    [
        (dict(), None),
        (dict(tie_embeddings=True), 30_000),
        (dict(attention_bias=True), None),
        (dict(attention_bias=True, tie_embeddings=True), 20_000),
    ],
    ids=["untied", "tied-sharded", "qwen2", "qwen2-tied-sharded"],
)
def test_roundtrip_equals_original(tmp_path, changes, shard):
    model = _kvjax_llama(**changes)
    save_llama(model, tmp_path, max_shard_bytes=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == (shard is not None)
    loaded = from_pretrained(tmp_path)
    assert loaded.config == model.config
    np.testing.assert_array_equal(np.asarray(loaded.forward(TOKENS)), np.asarray(model.forward(TOKENS)))


def test_float16_storage_and_bfloat16_load(tmp_path):
    model = _kvjax_llama(seed=3)
    save_llama(model, tmp_path, dtype="float16")
    assert SafetensorsSource(tmp_path).dtypes["model.embed_tokens.weight"] == "F16"
    loaded = from_pretrained(tmp_path)  # float16 on disk, float32 model
    rounded = _kvjax_llama(seed=3)
    for (var, _, _), (src, _, _) in zip(llama_plan(rounded), llama_plan(model)):
        var.set_value(src.get_value().astype(jnp.float16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(loaded.forward(TOKENS)), np.asarray(rounded.forward(TOKENS)))
    bf = from_pretrained(tmp_path, dtype=jnp.bfloat16)
    assert bf.embed.embedding.dtype == jnp.bfloat16 and bf.layers[0].attn.q_proj.kernel.dtype == jnp.bfloat16
    ref, got = np.asarray(loaded.forward(TOKENS)), np.asarray(bf.forward(TOKENS), np.float32)
    assert np.abs(got - ref).max() <= BF16_TOL * np.abs(ref).max()
    assert np.abs(got - ref).max() > 0  # the test sees the narrower weights


def test_engine_on_a_loaded_checkpoint(tmp_path):
    """A loaded model runs through the engine: prefill + greedy decode equal its uncached pass."""
    save_llama(_kvjax_llama(seed=1), tmp_path)
    model = from_pretrained(tmp_path)
    engine = Engine(model, kvjax.init(memory_config_for(model, size=64, n_seq_max=1)), n_ubatch=16)
    seq = [int(t) for t in TOKENS[:6]]
    rows = [np.asarray(engine.decode(seq, range(6), [[0]] * 6))]
    for _ in range(3):
        seq.append(int(np.argmax(rows[-1][-1])))
        rows.append(np.asarray(engine.decode(seq[-1:], [len(seq) - 1], [[0]])))
    np.testing.assert_allclose(np.concatenate(rows), np.asarray(model.forward(jnp.asarray(seq))), atol=5e-5)


# -- bad checkpoints ------------------------------------------------------------------------------


@pytest.fixture
def good(tmp_path):
    save_llama(_kvjax_llama(), tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite(folder, change):
    """Rewrite model.safetensors with ``change(dict of numpy arrays)`` applied."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_tensor_is_named(good):
    _rewrite(good, lambda t: (t.pop("model.layers.1.mlp.up_proj.weight"), t.pop("model.norm.weight")))
    with pytest.raises(ValueError, match=r"lacks \['norm.weight', 'layers.1.mlp.up_proj.weight'\] \(2 tensors\)"):
        from_pretrained(good)


def test_unexpected_tensor_is_named(good):
    _rewrite(good, lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"unexpected keys \['layers.0.extra.weight'\]"):
        from_pretrained(good)


def test_wrong_shape_is_named(good):
    _rewrite(good, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((16, 64), np.float32)}))
    with pytest.raises(
        ValueError,
        match=r"layers.0.self_attn.k_proj.weight has shape \(16, 64\): allowed "
        r"\(32, 64\)",
    ):
        from_pretrained(good)


def test_shapes_are_checked_before_any_tensor_is_read():
    model = _kvjax_llama()
    plan = llama_plan(model)
    reads = []

    class Spy(dict):
        def __getitem__(self, key):
            reads.append(key)
            return super().__getitem__(key)

    weights = Spy({key: np.zeros(var.shape[::-1] if fn else var.shape, np.float32) for var, key, fn in plan})
    shapes = {key: w.shape for key, w in dict.items(weights)}
    shapes["lm_head.weight"] = (V + 1, 64)
    before = np.asarray(model.embed.embedding.get_value()).copy()
    with pytest.raises(ValueError, match=r"lm_head.weight has shape \(101, 64\): allowed \(100, 64\)"):
        load_plan(plan, weights, "test", shapes=shapes)
    assert reads == [] and np.array_equal(np.asarray(model.embed.embedding.get_value()), before)


def test_truncated_file_is_named(good):
    file = good / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        from_pretrained(good)
    file.write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(ValueError, match=r"model.safetensors is not a readable safetensors file"):
        from_pretrained(good)


def test_sharded_checkpoint_errors(tmp_path):
    save_llama(_kvjax_llama(), tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    os.rename(tmp_path / shard, tmp_path / "elsewhere.bin")
    with pytest.raises(ValueError, match=rf"names shard '{shard}', which is not in"):
        from_pretrained(tmp_path)
    os.rename(tmp_path / "elsewhere.bin", tmp_path / shard)
    index["weight_map"]["model.layers.9.ghost.weight"] = shard
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=r"lists \['model.layers.9.ghost.weight'\] but its shards lack them"):
        from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            dict(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
            r"model_type='gpt2' \(architectures=\['GPT2LMHeadModel'\]\): allowed one of \['llama', 'qwen2', 'mistral'",
        ),
        (
            dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}),
            r"rope_type='dynamic' is out of range: allowed one of \['default', 'linear', 'llama3', 'yarn'\]",
        ),
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), r"rope_type='longrope' is out of range"),
        (
            dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
            r"rope_parameters\['low_freq_factor'\]=None is out of range for rope_type='llama3'",
        ),
        (dict(hidden_act="gelu"), r"hidden_act='gelu' is out of range: allowed 'silu'"),
        (dict(mlp_bias=True), r"mlp_bias=True is out of range"),
        (dict(model_type=None), r"config.json has no 'model_type'"),
    ],
)
def test_bad_config(good, changes, match):
    _edit_config(good, **changes)
    with pytest.raises(ValueError, match=match):
        from_pretrained(good)


def test_bad_paths_and_dtype(good, tmp_path):
    with pytest.raises(ValueError, match=r"path='.*nowhere' is not a folder"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no config.json"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        from_pretrained(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(ValueError, match=r"has no \*.safetensors files"):
        from_pretrained(tmp_path / "empty")
    for bad in ("int8", jnp.float64, "fp32", None):
        with pytest.raises(
            ValueError,
            match=r"dtype=.* is out of range: allowed one of \['float32', 'bfloat16', "
            r"'float16'\]",
        ):
            from_pretrained(good, dtype=bad)


def test_integer_tensor_refused(good):
    _rewrite(good, lambda t: t.update({"model.norm.weight": np.ones(64, np.int32)}))
    with pytest.raises(ValueError, match=r"tensor 'model.norm.weight' has dtype I32: allowed one of"):
        from_pretrained(good)


def test_save_llama_refuses_what_configs_cannot_say(tmp_path):
    for changes, name in (
        (dict(swa_layers=(0,), n_swa=4), "swa_layers"),
        (dict(qk_norm=True), "qk_norm"),
        (dict(rope=kvjax.RopeConfig(n_rot=16, mode="normal")), "rope"),
        (dict(position="alibi"), "position"),
    ):
        with pytest.raises(ValueError, match=rf"model.config.{name}=.* is out of range: allowed the plain Llama"):
            save_llama(_kvjax_llama(**changes), tmp_path)
    with pytest.raises(ValueError, match=r"max_shard_bytes=0 is out of range"):
        save_llama(_kvjax_llama(), tmp_path, max_shard_bytes=0)
    with pytest.raises(ValueError, match=r"model must be a kvjax.nn.Llama"):
        save_llama("model", tmp_path)


# -- memory configs -----------------------------------------------------------------------------------


def test_memory_config_for_each_kind():
    plain = _kvjax_llama()
    cfg = memory_config_for(plain, size=64, n_seq_max=2, k_dtype="float16", v_dtype="float16")
    assert isinstance(cfg, kvjax.CacheConfig) and cfg.size == 64 and cfg.n_seq_max == 2
    assert memory_config_for(plain, size=65, n_seq_max=1, padding=16).size == 80  # whole padding blocks
    gemma_like = _kvjax_llama(swa_layers=(0,), n_swa=4)
    iswa = memory_config_for(gemma_like, size=64, n_seq_max=2, n_batch=16)
    assert isinstance(iswa, kvjax.IswaConfig) and iswa.swa_layers == (0,) and iswa.n_swa == 4 and iswa.n_batch == 16
    every = _kvjax_llama(swa_layers=(0, 1), n_swa=4)  # Mistral: every layer slides, one cache
    assert isinstance(memory_config_for(every, size=64, n_seq_max=1), kvjax.CacheConfig)
    mamba = nnx.eval_shape(lambda: Mamba(kvjax.nn.MambaConfig(vocab_size=V, d_model=16, n_layer=2), rngs=nnx.Rngs(0)))
    rec = memory_config_for(mamba, n_seq_max=3, n_states=2)
    assert type(rec).__name__ == "RecurrentConfig" and rec.n_seq_max == 3 and rec.n_states == 2
    for model in (plain, gemma_like, mamba):  # every kind initialises
        kvjax.init(memory_config_for(model, size=32, n_seq_max=1))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(size=0), r"size=0 is out of range: allowed an integer >= 1"),
        (dict(size=None), r"size=None is out of range"),
        (dict(size=32, n_seq_max=0), r"n_seq_max=0 is out of range: allowed an integer >= 1"),
        (dict(size=32, n_seq_max=True), r"n_seq_max=True is out of range"),
    ],
)
def test_memory_config_for_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        memory_config_for(_kvjax_llama(), **kwargs)
    with pytest.raises(ValueError, match=r"model must be a kvjax.nn.Llama, Deepseek, Mamba or HybridLM, got str"):
        memory_config_for("model", size=32)


def test_read_config_fills_old_defaults(good):
    _edit_config(good, rms_norm_eps=None, tie_word_embeddings=None, rope_parameters=None)
    cfg = read_config(good)
    assert (cfg.rms_norm_eps, cfg.tie_word_embeddings, cfg.rope_theta) == (1e-6, False, 10000.0)


# -- RoPE kinds against transformers' own frequency functions -----------------------------------------


ROPE_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 16,
        "beta_slow": 2,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
    },
    # gpt-oss: the correction range keeps its fractional ends
    "yarn-untruncated": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
    },
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_rope_kinds_equal_transformers_frequencies(kind):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kvjax.attn._rope import magnitude, pair_frequencies

    params = dict(ROPE_CASES[kind])
    hc = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=params
    )
    inv_freq, attention = ROPE_INIT_FUNCTIONS[params["rope_type"]](hc, torch.device("cpu"))
    rope = rope_from_hf(params, 16, 256)
    np.testing.assert_allclose(pair_frequencies(rope), inv_freq.numpy(), rtol=2e-6)
    assert magnitude(rope) == pytest.approx(attention, rel=1e-6)


def test_rope_bad_parameters():
    with pytest.raises(ValueError, match=r"rope_parameters\['factor'\]=0 is out of range for rope_type='linear'"):
        rope_from_hf({"rope_type": "linear", "factor": 0}, 16)
    with pytest.raises(ValueError, match=r"partial_rotary_factor=0.5 is out of range: allowed 1.0"):
        rope_from_hf({"rope_type": "default", "partial_rotary_factor": 0.5}, 16)
    with pytest.raises(ValueError, match=r"lacks 'original_max_position_embeddings' for rope_type='yarn'"):
        rope_from_hf({"rope_type": "yarn", "factor": 2.0}, 16)
    with pytest.raises(
        ValueError, match=r"truncate'\]='no' is out of range for rope_type='yarn': allowed True or False"
    ):
        rope_from_hf({"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, 16, 64)
    with pytest.raises(ValueError, match=r"yarn_truncate=1 is out of range: allowed True or False"):
        kvjax.RopeConfig(n_rot=4, yarn_truncate=1)


def test_attention_bias_option():
    """LlamaConfig.attention_bias: biases on the projections, the linen twin equal, bad values refused."""
    from kvjax.nn import LlamaLinen, params_from_nnx

    model = _kvjax_llama(seed=2, attention_bias=True)
    plain = _kvjax_llama(seed=2)
    assert not np.allclose(np.asarray(model.forward(TOKENS)), np.asarray(plain.forward(TOKENS)))  # biases act
    linen = LlamaLinen(model.config).apply(params_from_nnx(model), TOKENS, method=LlamaLinen.forward)
    np.testing.assert_allclose(np.asarray(linen), np.asarray(model.forward(TOKENS)), atol=1e-5)
    with pytest.raises(ValueError, match=r"attention_bias='yes' is out of range: allowed True or False"):
        LlamaConfig(attention_bias="yes")


def _save_mamba(model, folder):
    """A kvjax Mamba as a transformers ``MambaForCausalLM`` folder (the inverse of ``params_from_hf``)."""
    from safetensors.numpy import save_file

    cfg = model.config
    arr = lambda v: np.ascontiguousarray(np.asarray(v.get_value()))  # noqa: E731
    t = {"backbone.embeddings.weight": arr(model.embed.embedding), "backbone.norm_f.weight": arr(model.norm.scale)}
    for il, block in enumerate(model.layers):
        p, m = f"backbone.layers.{il}.", block.mixer
        t.update(
            {
                p + "norm.weight": arr(block.norm.scale),
                p + "mixer.in_proj.weight": arr(m.in_proj.kernel).T.copy(),
                p + "mixer.conv1d.weight": arr(m.conv_kernel).T[:, None, :].copy(),
                p + "mixer.conv1d.bias": arr(m.conv_bias),
                p + "mixer.x_proj.weight": arr(m.x_proj.kernel).T.copy(),
                p + "mixer.dt_proj.weight": arr(m.dt_proj.kernel).T.copy(),
                p + "mixer.dt_proj.bias": arr(m.dt_proj.bias),
                p + "mixer.A_log": arr(m.A_log),
                p + "mixer.D": arr(m.D),
                p + "mixer.out_proj.weight": arr(m.out_proj.kernel).T.copy(),
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(
        json.dumps(
            dict(
                model_type="mamba",
                architectures=["MambaForCausalLM"],
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.d_model,
                num_hidden_layers=cfg.n_layer,
                state_size=cfg.d_state,
                conv_kernel=cfg.d_conv,
                expand=cfg.expand,
                time_step_rank=cfg.dt_rank,
                intermediate_size=cfg.d_inner,
                layer_norm_epsilon=cfg.norm_eps,
                use_bias=False,
                use_conv_bias=True,
                tie_word_embeddings=True,
            )
        )
    )


def test_mamba_roundtrip_and_errors(tmp_path):
    model = Mamba(kvjax.nn.MambaConfig(vocab_size=V, d_model=16, n_layer=2, d_state=4), rngs=nnx.Rngs(4))
    _save_mamba(model, tmp_path / "m")
    loaded = from_pretrained(tmp_path / "m")
    tokens = TOKENS[None, :8]
    np.testing.assert_array_equal(np.asarray(loaded.forward(tokens)), np.asarray(model.forward(tokens)))
    assert isinstance(memory_config_for(loaded, n_seq_max=2), kvjax.RecurrentConfig)
    _rewrite(tmp_path / "m", lambda t: t.pop("backbone.layers.1.mixer.D"))
    with pytest.raises(ValueError, match=r"checkpoint .*: state dict lacks \['layers.1.mixer.D'\]"):
        from_pretrained(tmp_path / "m")
    _save_mamba(model, tmp_path / "m")
    _rewrite(tmp_path / "m", lambda t: t.update({"backbone.layers.0.mixer.D": np.zeros(3, np.float32)}))
    with pytest.raises(ValueError, match=r"layers.0.mixer.D has shape \(3,\)"):
        from_pretrained(tmp_path / "m")
    _edit_config(tmp_path / "m", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"hidden_act='gelu' is out of range: allowed 'silu'"):
        from_pretrained(tmp_path / "m")


def test_older_config_with_rope_scaling(good):
    """``rope_theta`` + ``rope_scaling`` (``type`` instead of ``rope_type``), as configs before transformers 5."""
    _edit_config(good, rope_parameters=None, rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    rope = from_pretrained(good).config.rope
    assert (rope.freq_base, rope.freq_scale, rope.mode.value) == (500000.0, 0.5, "neox")
    _edit_config(good, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_type='dynamic' is out of range"):
        from_pretrained(good)
