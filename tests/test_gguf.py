"""from_gguf: a GGUF twin of a model's weights gives that model's logits; bad files give clear errors.

The GGUF files are written here with the ``gguf`` package's writer, the way llama.cpp's
``convert_hf_to_gguf.py`` lays them out: Hugging Face ``[out, in]`` matrices, ``attn_q`` /
``attn_k`` rows of each head permuted from the halves layout into RoPE pairs for the ``llama``
architecture (not for ``qwen2``), Llama 3's RoPE scaling as a ``rope_freqs`` tensor, 1-d tensors
kept in F32 and matrices in the type under test.
"""

from __future__ import annotations

import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

import kvjax  # noqa: E402
from kvjax.nn import Llama, LlamaConfig  # noqa: E402
from kvjax.nn._gguf import from_gguf, gguf_config  # noqa: E402
from kvjax.nn._gguf_vocab import gguf_tokenizer  # noqa: E402

Q = gguf.GGMLQuantizationType
TOKENS = [3, 17, 1, 90, 42, 5, 30, 2, 8, 64, 11, 4]
# The quantized types change the weights themselves: besides the exact check (the model with the
# weights ggml dequantizes), their logits stay within these fractions of the logits' standard
# deviation from the float model's (measured on the models below: F16 0.005 / 1.05, Q8_0 0.089 / 1.05
# for the kvjax model, Q8_0 0.0055 / 0.166 for transformers'; Q4_0, 1.27 / 1.05 on these random
# 64-wide weights, is held to the exact check only)
REL_TOL = {Q.F16: 0.02, Q.Q8_0: 0.15}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k permutation: each head's rows from halves to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_freqs(theta: float, head_dim: int, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """Llama 3's per-pair frequency divisors, as convert_hf_to_gguf.py writes them (rope_freqs)."""
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(
    path,
    arch: str,
    sd: dict,
    *,
    n_layer: int,
    n_heads: int,
    n_kv_heads: int,
    eps: float,
    theta: float,
    qtype=Q.F32,
    rope_freqs=None,
    rope_scaling=None,
    drop=(),
    extra=None,
    shapes=None,
    types=None,
    extra_kv=None,
    head_dim=None,
):
    """Write a GGUF file from an HF-named state dict of numpy arrays (torch layout, [out, in])."""
    w = gguf.GGUFWriter(str(path), arch)
    d_model = sd["model.embed_tokens.weight"].shape[1]
    head_dim = head_dim or sd["model.layers.0.self_attn.q_proj.weight"].shape[0] // n_heads
    w.add_context_length(256)
    w.add_embedding_length(d_model)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(sd["model.layers.0.mlp.up_proj.weight"].shape[0])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_layer_norm_rms_eps(eps)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    for key, value in (extra_kv or {}).items():
        getattr(w, key)(*value) if isinstance(value, tuple) else getattr(w, key)(value)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "post_attention_layernorm.weight": "ffn_norm.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
        "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.bias": "attn_v.bias",
    }
    gemma = arch.startswith("gemma")
    if gemma:  # convert_hf_to_gguf.py's Gemma names; every norm stored as 1 + w
        per_layer.update(
            {
                "post_attention_layernorm.weight": "post_attention_norm.weight",
                "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
                "self_attn.q_norm.weight": "attn_q_norm.weight",
                "self_attn.k_norm.weight": "attn_k_norm.weight",
            }
        )
    tensors = {}
    for key, value in sd.items():
        value = np.asarray(value, np.float32)
        if key in names:
            name = names[key]
        else:
            _, _, il, rest = key.split(".", 3)
            if rest not in per_layer:
                continue
            name = f"blk.{il}.{per_layer[rest]}"
            if arch in ("llama", "mistral") and rest.startswith(("self_attn.q_proj", "self_attn.k_proj")):
                value = _permute(value, n_heads if "q_proj" in rest else n_kv_heads)
        if gemma and name.endswith("norm.weight"):
            value = value + np.float32(1.0)
        tensors[name] = value
    if gemma and "lm_head.weight" in sd and np.array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"]):
        tensors.pop("output.weight", None)  # tied: llama.cpp's Gemma files have no output tensor
    if rope_freqs is not None:
        tensors["rope_freqs.weight"] = rope_freqs
    tensors.update(extra or {})
    for name, value in tensors.items():
        if name in drop:
            continue
        if shapes and name in shapes:
            value = value[tuple(slice(0, n) for n in shapes[name])]
        kind = (types or {}).get(name, qtype)
        if value.ndim == 1 or kind == Q.F32:
            w.add_tensor(name, value.astype(np.float32))
        elif kind == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _round_trip(sd: dict, qtype) -> dict:
    """The weights as the file holds them (matrices through the type's quantizer), for the reference."""
    if qtype == Q.F32:
        return sd
    out = {}
    for k, v in sd.items():
        v = np.asarray(v, np.float32)
        if v.ndim == 2:
            v = (
                gguf.quants.dequantize(gguf.quants.quantize(v, qtype), qtype)
                if qtype != Q.F16
                else v.astype(np.float16).astype(np.float32)
            )
        out[k] = v
    return out


# -- without torch: a kvjax model's own weights ------------------------------------------------


def _kvjax_sd(model: Llama) -> dict:
    """A kvjax Llama's weights under HF names in torch layout (what an HF checkpoint would hold)."""
    sd = {"model.embed_tokens.weight": model.embed.embedding[...], "model.norm.weight": model.norm.scale[...]}
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.kernel[...].T
    for il, b in enumerate(model.layers):
        p, a = f"model.layers.{il}.", b.attn
        sd.update(
            {
                p + "input_layernorm.weight": b.attn_norm.scale[...],
                p + "post_attention_layernorm.weight": b.mlp_norm.scale[...],
                p + "self_attn.q_proj.weight": a.q_proj.kernel[...].T,
                p + "self_attn.k_proj.weight": a.k_proj.kernel[...].T,
                p + "self_attn.v_proj.weight": a.v_proj.kernel[...].T,
                p + "self_attn.o_proj.weight": a.o_proj.kernel[...].T,
                p + "mlp.gate_proj.weight": b.mlp.gate.kernel[...].T,
                p + "mlp.up_proj.weight": b.mlp.up.kernel[...].T,
                p + "mlp.down_proj.weight": b.mlp.down.kernel[...].T,
            }
        )
        if model.config.attention_bias:
            sd.update(
                {
                    p + "self_attn.q_proj.bias": a.q_proj.bias[...],
                    p + "self_attn.k_proj.bias": a.k_proj.bias[...],
                    p + "self_attn.v_proj.bias": a.v_proj.bias[...],
                }
            )
    return {k: np.asarray(v) for k, v in sd.items()}


def _kvjax_model(arch: str, tie: bool = False, scale: float = 2.0) -> Llama:
    """A random kvjax Llama in HF's convention (neox RoPE over the whole head), weights scaled up."""
    cfg = LlamaConfig(
        vocab_size=96,
        d_model=64,
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        norm_eps=1e-5,
        rope=kvjax.RopeConfig(n_rot=16, mode="neox", freq_base=10000.0),
        tie_embeddings=tie,
        attention_bias=arch == "qwen2",
    )
    model = Llama(cfg, rngs=nnx.Rngs(7))
    # larger weights than the initialiser's (and nonzero biases), so that attention and RoPE matter
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    nnx.update(
        model,
        jax.tree.map(lambda x: x * scale + 0.05 * jax.random.normal(next(keys), x.shape), nnx.state(model, nnx.Param)),
    )
    if cfg.attention_bias:
        for b in model.layers:  # a GGUF qwen2 has no output-projection bias
            b.attn.o_proj.bias.set_value(jnp.zeros_like(b.attn.o_proj.bias[...]))
    return model


@pytest.mark.parametrize(
    "arch, tie",
    [
        ("llama", False),
        ("qwen2", True),
        ("llama", True),  # Llama 3.2: tied
        pytest.param("mistral", False, marks=pytest.mark.slow),
    ],
)
def test_a_gguf_of_a_kvjax_models_weights_gives_its_logits(tmp_path, arch, tie):
    model = _kvjax_model(arch, tie)
    path = write_gguf(
        tmp_path / "m.gguf", arch, _kvjax_sd(model), n_layer=2, n_heads=4, n_kv_heads=2, eps=1e-5, theta=10000.0
    )
    loaded = from_gguf(path)
    assert loaded.config.rope.mode.value == ("neox" if arch == "qwen2" else "normal")
    assert loaded.config.tie_embeddings == tie and loaded.config.attention_bias == (arch == "qwen2")
    want = np.asarray(model.forward(jnp.asarray([TOKENS])))
    got = np.asarray(loaded.forward(jnp.asarray([TOKENS])))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # and through the cache: a prefill and a decode step give the uncached logits
    eng = kvjax.Engine(loaded, kvjax.init(loaded.config.cache_config(size=64, n_seq_max=1)), n_ubatch=8)
    out = np.asarray(eng.decode(TOKENS[:-1], range(len(TOKENS) - 1), [[0]] * (len(TOKENS) - 1), outputs="last"))
    np.testing.assert_allclose(out[0], want[0, -2], atol=1e-4, rtol=0)
    np.testing.assert_allclose(
        np.asarray(eng.decode(TOKENS[-1:], [len(TOKENS) - 1], [[0]]))[0], want[0, -1], atol=1e-4, rtol=0
    )


@pytest.mark.parametrize("qtype", [pytest.param(Q.F16, marks=pytest.mark.slow), Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_quantized_tensors_give_the_dequantized_weights_logits(tmp_path, qtype):
    model = _kvjax_model("llama")
    sd = _kvjax_sd(model)
    path = write_gguf(
        tmp_path / "m.gguf", "llama", sd, n_layer=2, n_heads=4, n_kv_heads=2, eps=1e-5, theta=1e4, qtype=qtype
    )
    loaded = from_gguf(path)
    got = np.asarray(loaded.forward(jnp.asarray([TOKENS])))
    # exact reference: the model with the weights the file holds (ggml's dequantization)
    ref = _kvjax_model("llama")
    deq = _round_trip(sd, qtype)
    ref.embed.embedding.set_value(jnp.asarray(deq["model.embed_tokens.weight"]))
    ref.lm_head.kernel.set_value(jnp.asarray(deq["lm_head.weight"].T))
    for il, b in enumerate(ref.layers):
        p = f"model.layers.{il}."
        for mod, key in (
            (b.attn.q_proj, "self_attn.q_proj"),
            (b.attn.k_proj, "self_attn.k_proj"),
            (b.attn.v_proj, "self_attn.v_proj"),
            (b.attn.o_proj, "self_attn.o_proj"),
            (b.mlp.gate, "mlp.gate_proj"),
            (b.mlp.up, "mlp.up_proj"),
            (b.mlp.down, "mlp.down_proj"),
        ):
            mod.kernel.set_value(jnp.asarray(deq[p + key + ".weight"].T))
    np.testing.assert_allclose(got, np.asarray(ref.forward(jnp.asarray([TOKENS]))), atol=1e-4, rtol=0)
    # and within the stated tolerance of the unquantized model (a milder one: the x2 weights above
    # amplify any weight error through the layers; this bounds the types' own error)
    if qtype not in REL_TOL:
        return
    mild = _kvjax_model("llama", scale=1.0)
    path = write_gguf(
        tmp_path / "mild.gguf",
        "llama",
        _kvjax_sd(mild),
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=1e4,
        qtype=qtype,
    )
    got = np.asarray(from_gguf(path).forward(jnp.asarray([TOKENS])))
    full = np.asarray(mild.forward(jnp.asarray([TOKENS])))
    diff = np.abs(got - full).max()
    print(f"{qtype.name}: max logit diff {diff:.4g}, logits std {full.std():.4g}")
    if qtype in REL_TOL:
        assert diff < REL_TOL[qtype] * full.std(), f"{qtype.name}: max logit diff {diff}, std {full.std()}"


# -- with torch: transformers models -------------------------------------------------------------


def _hf(kind: str, scale: float = 4.0):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    )
    if kind == "qwen2":
        hf = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
        )
    elif kind == "qwen2-yarn":
        hf = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config(
                **common,
                rope_theta=10000.0,
                tie_word_embeddings=True,
                rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            )
        )
    else:
        extra = {}
        if kind == "llama3":
            extra["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        hf = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=False, **extra)
        )
    with torch.no_grad():  # larger weights than the initialiser's, so attention and RoPE matter
        for p in hf.parameters():
            p.mul_(scale)
    hf.eval()
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    return hf, sd, torch


def _hf_logits(hf, torch, tokens):
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float().numpy()


@pytest.mark.parametrize(
    "kind, qtype",
    [
        ("llama", Q.F32),
        ("llama3", Q.F32),
        ("qwen2", Q.F32),
        ("qwen2-yarn", Q.F32),
        pytest.param("llama", Q.F16, marks=pytest.mark.slow),
        ("llama", Q.Q8_0),
    ],
    ids=lambda x: getattr(x, "name", x),
)
def test_a_gguf_twin_of_a_transformers_model_gives_its_logits(tmp_path, kind, qtype):
    hf, sd, torch = _hf(kind, 4.0 if qtype in (Q.F32, Q.F16) else 1.0)
    arch = "qwen2" if kind.startswith("qwen2") else "llama"
    freqs = _rope_freqs(10000.0, 16, 8.0, 1.0, 4.0, 64) if kind == "llama3" else None
    yarn = (
        dict(rope_scaling=("yarn", 4.0), extra_kv={"add_rope_scaling_orig_ctx_len": 64})
        if kind.endswith("yarn")
        else {}
    )
    path = write_gguf(
        tmp_path / "m.gguf",
        arch,
        sd,
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=10000.0,
        qtype=qtype,
        rope_freqs=freqs,
        **yarn,
    )
    got = np.asarray(from_gguf(path).forward(jnp.asarray(TOKENS)))
    if qtype in (Q.F32, Q.F16):
        # the HF model with the weights the file holds
        with torch.no_grad():
            for k, v in _round_trip(sd, qtype).items():
                hf.state_dict()[k].copy_(torch.from_numpy(np.ascontiguousarray(v)))
        want = _hf_logits(hf, torch, TOKENS)
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    else:
        want = _hf_logits(hf, torch, TOKENS)
        diff = np.abs(got - want).max()
        print(f"{qtype.name}: max logit diff {diff:.4g} vs transformers, logits std {want.std():.4g}")
        assert diff < REL_TOL[qtype] * want.std(), f"{qtype.name}: max logit diff {diff} vs transformers"


# -- bad files --------------------------------------------------------------------------------


def _good(tmp_path, **kw):
    model = _kvjax_model("llama")
    return write_gguf(
        tmp_path / "m.gguf",
        kw.pop("arch", "llama"),
        _kvjax_sd(model),
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=1e4,
        **kw,
    )


def test_missing_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"lacks tensors \['blk.1.ffn_up.weight'\]"):
        from_gguf(_good(tmp_path, drop=("blk.1.ffn_up.weight",)))


def test_wrong_shape(tmp_path):
    with pytest.raises(ValueError, match=r"tensor 'blk.0.attn_k.weight' has shape \(16, 64\): allowed \(32, 64\)"):
        from_gguf(_good(tmp_path, shapes={"blk.0.attn_k.weight": (16, 64)}))


def test_unexpected_tensor(tmp_path):
    with pytest.raises(ValueError, match=r"unexpected tensors \['blk.0.attn_q_norm.weight'\]"):
        from_gguf(_good(tmp_path, extra={"blk.0.attn_q_norm.weight": np.ones(16, np.float32)}))


def test_unsupported_architecture(tmp_path):
    with pytest.raises(ValueError, match=r"general.architecture='phi3' is out of range: allowed one of "):
        from_gguf(_good(tmp_path, arch="phi3"))


def test_unsupported_rope_kind(tmp_path):
    with pytest.raises(ValueError, match=r"rope.scaling.type='longrope' is out of range: allowed 'none', 'linear' "):
        from_gguf(_good(tmp_path, rope_scaling=("longrope", 4.0)))
    with pytest.raises(ValueError, match=r"rope.scaling.yarn_log_multiplier=0.1"):
        from_gguf(_good(tmp_path, rope_scaling=("yarn", 4.0), extra_kv={"add_rope_scaling_yarn_log_mul": 0.1}))


def _patch_type(path, name: str, type_id: int):
    """Rewrite the ggml type id in tensor ``name``'s header entry (name, n_dims, dims, type)."""
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = data.index(key) + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    "type_id, message",
    [
        # Q8_1 rows take fewer bytes than the F32 rows written, so only the type is wrong
        (
            int(Q.Q8_1),
            r"tensor 'blk.0.ffn_down.weight' has type Q8_1: ggml type 'Q8_1' is not supported \(an "
            r"intermediate type .*\): allowed one of",
        ),
        (99, r"has tensor 'blk.0.ffn_down.weight' of an unknown ggml type id 99: allowed .*Q4_K"),
        # rows of 64 values cannot hold Q2_K's 256-value blocks
        (
            int(Q.Q2_K),
            r"tensor 'blk.0.ffn_down.weight' with rows of \d+ values: allowed a multiple of Q2_K's block of "
            r"256 values",
        ),
    ],
)
def test_tensor_types_refused(tmp_path, type_id, message):
    path = _patch_type(_good(tmp_path, types={"blk.0.ffn_down.weight": Q.F32}), "blk.0.ffn_down.weight", type_id)
    with pytest.raises(ValueError, match=message):
        from_gguf(path)


def test_the_reader_sees_what_the_gguf_package_sees(tmp_path):
    """kvjax's one-pass reader against gguf.GGUFReader on the same file: every key, every tensor's bytes."""
    from kvjax.nn._gguf_file import _open

    path = _good(tmp_path, types={"blk.0.ffn_down.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.F16})
    ours, theirs = _open(path), gguf.GGUFReader(path, "r")
    assert {k: v for k, v in ours.fields.items()} == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")
    }
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.shape, a.tensor_type, a.data_offset, a.n_bytes) == (
            tuple(int(d) for d in b.shape),
            int(b.tensor_type),
            b.data_offset,
            b.n_bytes,
        )
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        np.testing.assert_array_equal(a.data, b.data)


def test_linear_rope_scaling_is_read(tmp_path):
    cfg = gguf_config(_good(tmp_path, rope_scaling=("linear", 4.0)))
    assert cfg.rope.freq_scale == 0.25 and cfg.rope.mode.value == "normal"


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(tmp_path, keep):
    path = _good(tmp_path)
    data = open(path, "rb").read()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="truncated|not a readable GGUF file"):
        from_gguf(cut)


def test_not_a_gguf_file_and_bad_path(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        from_gguf(junk)
    with pytest.raises(ValueError, match="is not a file"):
        from_gguf(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="path must be a file path"):
        from_gguf(42)


# -- the vocabulary ---------------------------------------------------------------------------


def _trained_bpe(pre: str):
    """A small byte-level BPE trained here, with the pre-tokenizer of ``tokenizer.ggml.pre`` = ``pre``."""
    tokenizers = pytest.importorskip("tokenizers")
    from kvjax.nn._gguf_vocab import _SPLITS

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    if pre in _SPLITS:
        tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
            [
                tokenizers.pre_tokenizers.Split(tokenizers.Regex(_SPLITS[pre]), behavior="isolated"),
                tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|begin|>", "<|end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    text = [
        "The quick brown fox jumps over the lazy dog. 12345 café!\n" * 3,
        "kvjax caches keys and values, like llama.cpp's KV cache does; über naïve 2026.",
    ] * 20
    tok.train_from_iterator(text, trainer)
    return tok


# 'default' is not here: llama.cpp's 'default' pre-tokenizer is not the GPT-2 split that a default
# HF ByteLevel vocabulary uses (test_gguf_vocab.py holds it to llama.cpp's own ids instead)
@pytest.mark.parametrize("pre", ["llama-bpe", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_gguf_tokenizer_encodes_like_the_vocabulary_it_came_from(tmp_path, pre):
    tok = _trained_bpe(pre)
    data = tok.to_str()
    import json

    model = json.loads(data)["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    types = [3 if t in ("<|begin|>", "<|end|>") else 1 for t in tokens]
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<|begin|>"))
    w.add_eos_token_id(tokens.index("<|end|>"))
    w.add_eot_token_id(tokens.index("<|end|>"))  # the same id twice: listed once
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    got, bos, eos_ids, add_bos = gguf_tokenizer(tmp_path / "v.gguf")
    eos = eos_ids[0]
    assert (bos, eos_ids, add_bos) == (tokens.index("<|begin|>"), (tokens.index("<|end|>"),), True)
    for text in ["The quick brown fox", "café über 12345678!\n\n  x", "<|begin|>kvjax caches<|end|>", "zebra ∑ 🦊"]:
        want = tok.encode(text).ids
        ids = got.encode(text).ids
        if "<|begin|>" not in text:  # the trained tokenizer never saw the special tokens as added tokens
            assert ids == want, text
        else:
            assert ids[0] == bos and ids[-1] == eos
        assert got.decode(ids, skip_special_tokens=False) == text


def test_gguf_tokenizer_refuses_other_models(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "llama")
    w.add_tokenizer_model("bert")  # WordPiece: no architecture kvjax loads uses it
    w.add_token_list(["<unk>", "a"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="tokenizer.ggml.model='bert' is out of range: allowed 'llama' .*'gpt2'"):
        gguf_tokenizer(tmp_path / "v.gguf")
    with pytest.raises(ValueError, match="lacks 'tokenizer.ggml.model'"):
        gguf_tokenizer(_good(tmp_path))


def test_a_gguf_model_continues_from_a_llama_cpp_session_file(tmp_path):
    """Prefill, save a session file in llama.cpp's layout, restore it into a fresh cache: the next
    step's logits are the uninterrupted run's (the K rows are stored in the GGUF's RoPE order)."""
    from kvjax.io._llama_state import session_read, session_write

    model = from_gguf(_good(tmp_path))
    cfg = model.config.cache_config(size=64, n_seq_max=1)
    eng = kvjax.Engine(model, kvjax.init(cfg), n_ubatch=8)
    prompt = TOKENS[:-1]
    last = np.asarray(eng.decode(prompt, range(len(prompt)), [[0]] * len(prompt), outputs="last"))
    data = session_write(eng.cache, prompt, arch="llama", logits=last, output_rows=[len(prompt) - 1], version=9)
    want = np.asarray(eng.decode(TOKENS[-1:], [len(prompt)], [[0]]))
    sess = session_read(kvjax.init(cfg), data)
    assert sess.tokens.tolist() == prompt and np.array_equal(sess.logits, last)
    again = kvjax.Engine(model, sess.cache, n_ubatch=8)
    np.testing.assert_array_equal(np.asarray(again.decode(TOKENS[-1:], [len(prompt)], [[0]])), want)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_a_gemma_gguf_twin_gives_the_transformers_logits(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        query_pre_attn_scalar=16,
        sliding_window=4,
        max_position_embeddings=256,
        attn_implementation="eager",
    )
    if kind == "gemma2":
        hf = transformers.Gemma2ForCausalLM(
            transformers.Gemma2Config(**common, attn_logit_softcapping=20.0, final_logit_softcapping=15.0)
        )
        kv = {"add_sliding_window": 4, "add_attn_logit_softcapping": 20.0, "add_final_logit_softcapping": 15.0}
        theta = 10000.0
    else:
        hf = transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(
                **common,
                layer_types=["sliding_attention", "full_attention"],
                rope_theta=1e6,
                rope_local_base_freq=10000.0,
            )
        )
        kv = {"add_sliding_window": 4, "add_sliding_window_pattern": ([True, False],)}
        theta = 1e6
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))  # nonzero norms, larger weights: the options matter
    hf.eval()
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    path = write_gguf(
        tmp_path / "g.gguf",
        kind,
        sd,
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-6,
        theta=theta,
        extra_kv=kv,
        head_dim=16,
    )
    model = from_gguf(path)
    assert model.config.sandwich_norms and model.config.swa_layers == (0,) and model.config.n_swa == 4
    got = np.asarray(model.forward(jnp.asarray(TOKENS)))
    np.testing.assert_allclose(got, _hf_logits(hf, torch, TOKENS), atol=1e-4, rtol=0)


def test_dtype_option(tmp_path):
    # the milder model (initialiser weights): the x2 one amplifies bfloat16 rounding through its layers
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        _kvjax_sd(_kvjax_model("llama", scale=1.0)),
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=1e4,
    )
    full = from_gguf(path)
    half = from_gguf(path, dtype="bfloat16")
    assert half.layers[0].attn.q_proj.kernel[...].dtype == jnp.bfloat16
    a = np.asarray(full.forward(jnp.asarray(TOKENS)))
    b = np.asarray(half.forward(jnp.asarray(TOKENS)), np.float32)
    assert np.abs(a - b).max() < 0.1 * a.std()  # bfloat16 weights: close, not equal
    with pytest.raises(ValueError, match=r"dtype='int8' is out of range: allowed one of \['float32'"):
        from_gguf(path, dtype="int8")
