"""llama.cpp's ``mamba`` GGUF files load into kvjax's Mamba and give the model's own logits.

The files are written the way ``convert_hf_to_gguf.py`` writes a Hugging Face Mamba: tensor names
from the ``gguf`` package's own name map (``TensorNameMap``), ``A_log`` stored as ``-exp(A_log)``,
the depthwise conv kernel squeezed to ``[Di, K]``, the ``mamba.ssm.*`` sizes, no ``output`` tensor
when the head is tied; matrices whose rows hold whole blocks are quantized (``llama-quantize``
keeps the others, such as ``ssm_dt`` with rows of ``dt_rank`` values, in F32).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

from kvjax.nn import GGMLLinear, MambaConfig, from_gguf, gguf_config  # noqa: E402
from tests.helpers import write_gguf_tensors  # noqa: E402
from tests.test_mamba import make_model, tokens_of  # noqa: E402

Q = gguf.GGMLQuantizationType
CFG = MambaConfig(vocab_size=64, d_model=32, n_layer=2, d_state=8, d_conv=4, scan_chunk=4)
#: llama.cpp's logits for the file :func:`write_llamacpp_mamba` writes (scripts/make_mamba_gguf_fixture.py)
FIXTURE = pathlib.Path(__file__).parent / "data" / "mamba_llamacpp.json"
TOKENS = [1, 40, 300, 7, 512, 99, 12, 640, 250, 33, 401, 5, 77, 18, 600, 2]


def hf_state_dict(model) -> dict:
    """The model's weights under transformers' ``MambaForCausalLM`` names and layouts."""
    sd = {"backbone.embeddings.weight": model.embed.embedding[...], "backbone.norm_f.weight": model.norm.scale[...]}
    if model.lm_head is not None:
        sd["lm_head.weight"] = model.lm_head.kernel[...].T
    for il, block in enumerate(model.layers):
        p, m = f"backbone.layers.{il}.", block.mixer
        sd.update(
            {
                p + "norm.weight": block.norm.scale[...],
                p + "mixer.in_proj.weight": m.in_proj.kernel[...].T,
                p + "mixer.conv1d.weight": m.conv_kernel[...].T[:, None, :],
                p + "mixer.x_proj.weight": m.x_proj.kernel[...].T,
                p + "mixer.dt_proj.weight": m.dt_proj.kernel[...].T,
                p + "mixer.dt_proj.bias": m.dt_proj.bias[...],
                p + "mixer.A_log": m.A_log[...],
                p + "mixer.D": m.D[...],
                p + "mixer.out_proj.weight": m.out_proj.kernel[...].T,
            }
        )
        if m.conv_bias is not None:
            sd[p + "mixer.conv1d.bias"] = m.conv_bias[...]
    return {k: np.asarray(v, np.float32) for k, v in sd.items()}


def write_mamba_gguf(path, model, qtype=Q.F32, *, dt_b_c_rms=False, edit=None, vocab=False):
    """A GGUF file of ``model`` as ``convert_hf_to_gguf.py`` (then ``llama-quantize`` to ``qtype``) writes it."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_context_length(2**20)
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(cfg.n_layer)
    w.add_ssm_conv_kernel(cfg.d_conv)
    w.add_ssm_inner_size(cfg.d_inner)
    w.add_ssm_state_size(cfg.d_state)
    w.add_ssm_time_step_rank(cfg.dt_rank)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_ssm_dt_b_c_rms(dt_b_c_rms)
    if vocab:  # the SentencePiece fixture vocabulary, so that llama.cpp loads the file
        from tests.vocab_fixtures import add_spm_vocab

        assert add_spm_vocab(w) == cfg.vocab_size
    names = gguf.TensorNameMap(gguf.MODEL_ARCH.MAMBA, cfg.n_layer)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    tensors = {}
    for key, value in hf_state_dict(model).items():
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if key.endswith("A_log"):
            value = -np.exp(value)
        if key.endswith("conv1d.weight"):
            value = value.squeeze(1)
        tensors[name] = edit(name, value) if edit else value

    def kind_of(name, value):  # llama-quantize's rule here: matrices whose rows are whole blocks
        matrix = value.ndim == 2 and "ssm_conv1d" not in name
        return qtype if qtype != Q.F32 and matrix and value.shape[1] % block == 0 else None

    write_gguf_tensors(w, tensors, kind_of)
    return path


def write_llamacpp_mamba(path):
    """The tiny random Mamba (vocabulary of 664 SentencePiece tokens, tied head) that llama.cpp ran."""
    model = make_model(dataclasses.replace(CFG, vocab_size=664), seed=5)
    # every weight drawn by numpy, so that the bytes do not depend on XLA's flags (the suite's differ)
    rng = np.random.default_rng(5)

    def draw(path_, x):
        value = 0.3 * rng.standard_normal(x.shape)
        name = jax.tree_util.keystr(path_)
        if "A_log" in name:
            value = np.log(np.arange(1, x.shape[-1] + 1))[None] + value
        elif "'scale'" in name or ".scale" in name:
            value = 1 + value
        return jnp.asarray(value.astype(np.float32))

    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.state(model, nnx.Param)))
    return write_mamba_gguf(path, model, vocab=True)


@pytest.mark.parametrize("tie", [True, False])
def test_float_load_equals_the_model(tmp_path, tie):
    model = make_model(dataclasses.replace(CFG, tie_embeddings=tie))
    path = write_mamba_gguf(tmp_path / "m.gguf", model)
    cfg = gguf_config(path)
    assert (cfg.d_model, cfg.d_inner, cfg.d_state, cfg.d_conv, cfg.dt_rank, cfg.tie_embeddings) == (
        32,
        64,
        8,
        4,
        model.config.dt_rank,
        tie,
    )
    loaded = from_gguf(path, dtype=jnp.float32)
    tokens = tokens_of((2, 9), vocab=CFG.vocab_size)
    np.testing.assert_allclose(
        np.asarray(loaded.forward(tokens)), np.asarray(model.forward(tokens)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
def test_compact_load_equals_the_float_load(tmp_path, qtype):
    path = write_mamba_gguf(tmp_path / "m.gguf", make_model(CFG), qtype)
    compact, full = from_gguf(path), from_gguf(path, dtype=jnp.float32)
    mixer = compact.layers[0].mixer
    assert isinstance(mixer.in_proj, GGMLLinear) and mixer.in_proj.type_name == qtype.name
    assert not isinstance(mixer.dt_proj, GGMLLinear)  # rows of dt_rank = 2 values stay F32 in the file
    tokens = tokens_of((2, 9), vocab=CFG.vocab_size)
    want = np.asarray(full.forward(tokens))
    # the same weights; only the order of float sums differs (the scan amplifies it a little)
    np.testing.assert_allclose(np.asarray(compact.forward(tokens)), want, atol=1e-5 * np.abs(want).max(), rtol=1e-5)


def test_bad_mamba_files_are_refused(tmp_path):
    model = make_model(CFG)
    with pytest.raises(ValueError, match=r"mamba.ssm.dt_b_c_rms=True \(Falcon Mamba"):
        from_gguf(write_mamba_gguf(tmp_path / "falcon.gguf", model, dt_b_c_rms=True))
    positive = write_mamba_gguf(tmp_path / "a.gguf", model, edit=lambda n, v: -v if n.endswith("ssm_a") else v)
    with pytest.raises(ValueError, match=r"tensor 'blk.0.ssm_a' has entries >= 0"):
        from_gguf(positive)
    short = write_mamba_gguf(
        tmp_path / "s.gguf", model, edit=lambda n, v: v[:, :3] if n == "blk.1.ssm_conv1d.weight" else v
    )
    with pytest.raises(ValueError, match=r"tensor 'blk.1.ssm_conv1d.weight' has shape \(64, 3\): allowed \(64, 4\)"):
        from_gguf(short)


def test_logits_equal_llama_cpp_on_the_same_file(tmp_path):
    """kvjax's Mamba from the file against llama.cpp's logits for it (one batch, and token by token)."""
    data = json.loads(FIXTURE.read_text())
    path = write_llamacpp_mamba(tmp_path / "m.gguf")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == data["gguf_sha256"], "the fixture file changed"
    model = from_gguf(path, dtype=jnp.float32)
    got = np.asarray(model.forward(jnp.asarray([data["tokens"]])))[0]
    for key in ("logits_batch", "logits_stepwise"):
        want = np.asarray(data[key])
        # float32 against ggml's float32 (other sum orders, its own exp and softplus): measured 5.9e-5 of 6.8
        np.testing.assert_allclose(got, want, atol=2e-5 * np.abs(want).max(), rtol=0, err_msg=key)
