"""GGUF weights of every ggml type, kept compact: the jitted step's dequantization equals ggml's.

A tiny Llama (d_model 256, so that the 256-value super-blocks of the K and IQ types fit a row) is
written with every matrix in one type, then loaded twice: compact (``from_gguf``'s default: the
file's bytes resident, dequantized in JAX inside each product) and dequantized at load to float32
with the ``gguf`` package's numpy dequantizers (ggml's reference arithmetic). Their logits must be
the same up to the order of float sums. Types the ``gguf`` package can quantize are written from a
float model, and their logits are also held to a stated distance from that float model; the others
(the K and IQ types, which only llama.cpp quantizes) are written as random blocks with small
finite scales (see :func:`_random_blocks`), which is enough to compare two dequantizations. The
real Q4_K_M file's K types against the float weights and llama.cpp are in ``test_real_gguf.py``.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

gguf = pytest.importorskip("gguf")

import kvjax  # noqa: E402
from kvjax._compiles import CompileCounter  # noqa: E402
from kvjax._ggml_blocks import WEIGHT_TYPES  # noqa: E402
from kvjax.nn import Llama, LlamaConfig, from_gguf, fuse_projections  # noqa: E402
from kvjax.nn._ggml_linear import GGMLEmbed, GGMLLinear, resident_bytes  # noqa: E402
from tests.test_gguf import _kvjax_sd, write_gguf  # noqa: E402

Q = gguf.GGMLQuantizationType
TOKENS = [3, 17, 1, 90, 42, 5, 30, 2, 8, 64, 11, 4]
MATRIX_TYPES = [name for name in WEIGHT_TYPES if name != "F32"]


def _quantizable(name: str) -> bool:
    try:
        gguf.quants.quantize(np.zeros((1, 256), np.float32), Q[name])
        return True
    except NotImplementedError:
        return False


#: logits of the model written in a type, against the float model the file was quantized from: the
#: RMS of the difference at most this fraction of the float logits' standard deviation. Measured on
#: the model below (F16 0.0008, BF16 0.006, Q8_0 0.018, Q5_1 0.136, Q5_0 0.165, Q4_1 0.266, Q4_0
#: 0.300, MXFP4 0.402: a random model's logits are nearly flat, so weight noise is large against
#: their spread), with a third of headroom. The ternary types cannot represent a random float model.
REL_TOL = {
    "F16": 0.002,
    "BF16": 0.01,
    "Q8_0": 0.025,
    "Q5_1": 0.18,
    "Q5_0": 0.22,
    "Q4_1": 0.35,
    "Q4_0": 0.4,
    "MXFP4": 0.53,
    "TQ2_0": None,
    "TQ1_0": None,
}


#: the types only llama.cpp quantizes, fixture files by llama_model_quantize (type -> its LLAMA_FTYPE_MOSTLY_*)
LLAMA_CPP_TYPES = {
    "Q2_K": "Q2_K",
    "Q3_K": "Q3_K_S",
    "Q4_K": "Q4_K_S",
    "Q5_K": "Q5_K_S",
    "Q6_K": "Q6_K",
    "IQ3_S": "IQ3_S",
    "IQ4_NL": "IQ4_NL",
    "IQ4_XS": "IQ4_XS",
}
#: where scripts/make_quantized_fixtures.py keeps them
QUANTIZED = pathlib.Path(__file__).parent / "data" / "quantized"


def fixture_model() -> Llama:
    """The float model llama.cpp quantized (one layer of width 256: rows of whole 256-value super-blocks)."""
    cfg = LlamaConfig(
        vocab_size=96,
        d_model=256,
        n_layer=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=128,
        d_ff=256,
        norm_eps=1e-5,
        rope=kvjax.RopeConfig(n_rot=128, mode="neox", freq_base=10000.0),
    )
    return Llama(cfg, rngs=nnx.Rngs(11))


def write_fixture_f32(path, model: Llama):
    """``model`` as a float32 ``llama`` GGUF (the input of llama.cpp's quantizer)."""
    return write_gguf(
        path, "llama", _kvjax_sd(model), n_layer=1, n_heads=2, n_kv_heads=1, eps=1e-5, theta=10000.0, head_dim=128
    )


def _model(scale: float = 1.0, qk_norm: bool = False) -> Llama:
    cfg = LlamaConfig(
        vocab_size=96,
        d_model=256,
        n_layer=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=128,
        d_ff=512,
        norm_eps=1e-5,
        rope=kvjax.RopeConfig(n_rot=128, mode="neox", freq_base=10000.0),
        qk_norm=qk_norm,
    )
    model = Llama(cfg, rngs=nnx.Rngs(3))
    if scale != 1.0:
        nnx.update(model, jax.tree.map(lambda x: x * scale, nnx.state(model, nnx.Param)))
    return model


def _random_blocks(name: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random raw blocks of ``name`` whose every 16-bit field is a small finite positive float16.

    Every byte is drawn from ``[0, 0x3b]``: a little-endian float16 built from two such bytes has
    a clear sign bit and an exponent below 15 (magnitude < 1), so scales are finite and small while
    the quant fields still take many values (a byte's low nibble takes all 16).
    """
    size = gguf.GGML_QUANT_SIZES[Q[name]]
    return rng.integers(0, 0x3C, (rows, cols // size[0] * size[1]), dtype=np.uint8)


def _write(path, model: Llama, name: str, arch: str = "llama"):
    """The model's matrices in type ``name`` (quantized from its weights, or random blocks)."""
    sd = _kvjax_sd(model)
    extra = {}
    if not _quantizable(name):
        rng = np.random.default_rng(0)
        names = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight"}
        for key, value in sd.items():
            if np.ndim(value) != 2:
                continue
            gname = names.get(key) or _gguf_name(key)
            extra[gname] = _random_blocks(name, value.shape[0], value.shape[1], rng)
        return _write_raw(path, model, sd, extra, name, arch)
    return write_gguf(
        path, arch, sd, n_layer=2, n_heads=2, n_kv_heads=1, eps=1e-5, theta=10000.0, qtype=Q[name], head_dim=128
    )


def _gguf_name(key: str) -> str:
    _, _, il, rest = key.split(".", 3)
    per_layer = {
        "self_attn.q_proj.weight": "attn_q.weight",
        "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight",
        "self_attn.o_proj.weight": "attn_output.weight",
        "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight",
        "mlp.down_proj.weight": "ffn_down.weight",
    }
    return f"blk.{il}.{per_layer[rest]}"


def _write_raw(path, model, sd, raw, name, arch):
    """``write_gguf`` with the matrices replaced by the raw blocks ``raw`` (tensor name -> bytes)."""
    writer_add = gguf.GGUFWriter.add_tensor
    qtype = Q[name]

    def add_tensor(self, tname, value, *args, **kwargs):
        if tname in raw:
            return writer_add(self, tname, raw[tname], raw_dtype=qtype)
        return writer_add(self, tname, value, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        return write_gguf(path, arch, sd, n_layer=2, n_heads=2, n_kv_heads=1, eps=1e-5, theta=10000.0, head_dim=128)
    finally:
        gguf.GGUFWriter.add_tensor = writer_add


@pytest.mark.parametrize("name", MATRIX_TYPES)
def test_compact_weights_equal_the_weights_dequantized_at_load(tmp_path, name):
    path = _write(tmp_path / "m.gguf", _model(), name)
    compact, full = from_gguf(path), from_gguf(path, dtype=jnp.float32)
    assert isinstance(compact.embed, GGMLEmbed) and compact.embed.type_name == name
    assert isinstance(compact.layers[1].mlp.down, GGMLLinear) and compact.layers[1].mlp.down.type_name == name
    tokens = jnp.asarray(TOKENS)
    want = np.asarray(full.forward(tokens))
    got = np.asarray(compact.forward(tokens))
    assert np.isfinite(want).all()
    np.testing.assert_allclose(got, want, atol=1e-5 * max(1.0, np.abs(want).max()), rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in MATRIX_TYPES if _quantizable(n)])
def test_quantized_logits_stay_near_the_float_model(tmp_path, name):
    model = _model()
    got = np.asarray(from_gguf(_write(tmp_path / "m.gguf", model, name)).forward(jnp.asarray(TOKENS)))
    want = np.asarray(model.forward(jnp.asarray(TOKENS)))
    rel = float(np.sqrt(np.mean((got - want) ** 2)) / want.std())
    print(f"{name}: RMS logit difference {rel:.4f} of the logits' std")
    if REL_TOL.get(name) is not None:  # ternary types cannot represent a random float model
        assert rel < REL_TOL[name], f"{name}: {rel:.4f} of the logits' std"


def test_compact_model_through_the_cache_compiles_once(tmp_path):
    """Prefill and decode through an Engine equal the uncached logits; new tokens do not recompile."""
    model = from_gguf(_write(tmp_path / "m.gguf", _model(), "Q8_0"))
    want = np.asarray(model.forward(jnp.asarray(TOKENS)))
    eng = kvjax.Engine(model, kvjax.init(model.config.cache_config(size=64, n_seq_max=2)), n_ubatch=8)
    n = len(TOKENS) - 1
    out = np.asarray(eng.decode(TOKENS[:-1], range(n), [[0]] * n, outputs="last"))
    np.testing.assert_allclose(out[0], want[-2], atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(eng.decode(TOKENS[-1:], [n], [[0]]))[0], want[-1], atol=1e-4, rtol=1e-4)
    eng.decode([5], [0], [[1]])
    with CompileCounter() as again:
        eng.decode([7], [1], [[1]])
        eng.decode([9], [2], [[1]])
    assert again.count == 0


def test_resident_memory_is_the_files(tmp_path):
    path = _write(tmp_path / "m.gguf", _model(), "Q4_0")
    compact, full = from_gguf(path), from_gguf(path, dtype=jnp.float32)
    size = path.stat().st_size
    assert resident_bytes(compact) <= 1.2 * size < resident_bytes(full) / 4


def test_fused_projections_of_a_compact_model(tmp_path):
    """fuse_projections fuses layers whose types agree (rows regrouped as bytes) and leaves the others."""
    path = _write(tmp_path / "m.gguf", _model(), "Q4_0")
    model = from_gguf(path)
    want = np.asarray(model.forward(jnp.asarray(TOKENS)))
    fuse_projections(model)
    attn = model.layers[0].attn
    assert isinstance(attn.qkv_proj, GGMLLinear) and attn.q_proj is None
    np.testing.assert_allclose(np.asarray(model.forward(jnp.asarray(TOKENS))), want, atol=1e-5, rtol=1e-5)


def test_a_qwen3_gguf_gives_its_models_logits(tmp_path):
    model = _model(scale=1.0, qk_norm=True)
    for b in model.layers:  # norms that are not all ones, so that a missing q/k norm shows
        b.attn.q_norm.scale.set_value(b.attn.q_norm.scale[...] * 1.5)
        b.attn.k_norm.scale.set_value(b.attn.k_norm.scale[...] * 0.5)
    path = _write_qwen3(tmp_path / "q3.gguf", model)
    loaded = from_gguf(path)
    assert loaded.config.qk_norm and not loaded.config.attention_bias
    np.testing.assert_allclose(
        np.asarray(loaded.forward(jnp.asarray(TOKENS))),
        np.asarray(model.forward(jnp.asarray(TOKENS))),
        atol=1e-4,
        rtol=0,
    )


def _write_qwen3(path, model):
    sd = _kvjax_sd(model)
    extra = {}
    for il, b in enumerate(model.layers):
        extra[f"blk.{il}.attn_q_norm.weight"] = np.asarray(b.attn.q_norm.scale[...])
        extra[f"blk.{il}.attn_k_norm.weight"] = np.asarray(b.attn.k_norm.scale[...])
    return write_gguf(
        path, "qwen3", sd, n_layer=2, n_heads=2, n_kv_heads=1, eps=1e-5, theta=10000.0, head_dim=128, extra=extra
    )


def test_bad_rows_are_refused():
    with pytest.raises(ValueError, match=r"raw has rows of 10 bytes: allowed 34 \(n_in=32 values of type Q8_0\)"):
        GGMLLinear(np.zeros((4, 10), np.uint8), "Q8_0", 32)
    with pytest.raises(ValueError, match="Q9_9"):
        GGMLLinear(np.zeros((4, 34), np.uint8), "Q9_9", 32)
    with pytest.raises(ValueError, match="raw must be a 2-d array"):
        GGMLEmbed(np.zeros((34,), np.uint8), "Q8_0", 32)


def test_the_linen_twin_refuses_a_compact_model(tmp_path):
    from kvjax.nn import params_from_nnx

    model = from_gguf(_write(tmp_path / "m.gguf", _model(), "Q8_0"))
    with pytest.raises(
        ValueError, match=r"weights kept as ggml blocks \(embed, .*from_gguf\(path, dtype=jnp.float32\)"
    ):
        params_from_nnx(model)


@pytest.mark.parametrize("name", ["Q4_0", "Q6_K"])
def test_a_compact_layer_eager_and_jitted(name):
    """GGMLLinear equals ``x @ W.T + b`` with gguf's dequantized W, eagerly and jitted; new inputs do not recompile."""
    rng = np.random.default_rng(0)
    t = WEIGHT_TYPES[name]
    raw = (
        gguf.quants.quantize(rng.standard_normal((8, 256)).astype(np.float32), Q[name])
        if _quantizable(name)
        else _random_blocks(name, 8, 256, rng)
    )
    bias = rng.standard_normal(8).astype(np.float32)
    lin = GGMLLinear(raw, name, 256, bias=bias)
    assert lin.blocks[...].shape == (8, 256 // t.block * t.type_size)
    w = gguf.quants.dequantize(raw, Q[name])
    x = rng.standard_normal((3, 256)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(lin(jnp.asarray(x))), x @ w.T + bias, atol=1e-4, rtol=1e-5)
    run = nnx.jit(lambda layer, v: layer(v))
    np.testing.assert_allclose(np.asarray(run(lin, jnp.asarray(x))), x @ w.T + bias, atol=1e-4, rtol=1e-5)
    with CompileCounter() as again:
        run(lin, jnp.asarray(x + 1))
    assert again.count == 0


#: RMS logit difference against the float model, as a fraction of its logits' std, for the files
#: llama.cpp quantized: measured Q6_K 0.054, Q5_K 0.116, Q4_K 0.231, IQ4_NL 0.238, IQ4_XS 0.240,
#: Q3_K 0.442, IQ3_S 0.494, Q2_K 0.795 (the order of their bits per weight), with a third of headroom
LLAMA_CPP_TOL = {
    "Q6_K": 0.072,
    "Q5_K": 0.155,
    "Q4_K": 0.31,
    "IQ4_NL": 0.32,
    "IQ4_XS": 0.32,
    "Q3_K": 0.59,
    "IQ3_S": 0.66,
    "Q2_K": 1.06,
}


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_TYPES))
def test_files_llama_cpp_quantized_stay_near_the_float_model(name):
    """Blocks with the scales llama.cpp's own quantizer chose (scripts/make_quantized_fixtures.py)."""
    path = QUANTIZED / f"tiny-{name}.gguf"  # committed; scripts/make_quantized_fixtures.py writes them again
    compact, full = from_gguf(path), from_gguf(path, dtype=jnp.float32)
    assert {compact.layers[0].attn.q_proj.type_name, compact.layers[0].mlp.down.type_name, compact.embed.type_name} == {
        name
    }
    tokens = jnp.asarray(TOKENS)
    got, loaded = np.asarray(compact.forward(tokens)), np.asarray(full.forward(tokens))
    np.testing.assert_allclose(got, loaded, atol=1e-5 * max(1.0, np.abs(loaded).max()), rtol=1e-5)
    want = np.asarray(fixture_model().forward(tokens))
    rel = float(np.sqrt(np.mean((got - want) ** 2)) / want.std())
    assert rel < LLAMA_CPP_TOL[name], f"{name}: {rel:.4f} of the logits' std"
