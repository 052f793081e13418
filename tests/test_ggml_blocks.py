"""kvjax's JAX dequantizers of every ggml weight type against the gguf package's, bit for bit.

Blocks come two ways: float data quantized with ``gguf.quants.quantize`` (the types it can write),
and random raw bytes whose float16 / e8m0 / e4m3 scales are set to finite values (every type; the
rest of a block's bytes are all valid codes). Both run eagerly and jitted, and a second set of
values of the same shape must not compile again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax._compiles import CompileCounter
from kvjax._ggml_blocks import REFUSED_TYPES, WEIGHT_TYPES, check_type, dequantize, row_bytes

gguf = pytest.importorskip("gguf")
GQ = gguf.GGMLQuantizationType

#: byte offsets of the float16 scales inside a block (the rest of a block is codes, valid as any bytes)
F16_SCALES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ2_XXS": (0,),
    "IQ2_XS": (0,),
    "IQ2_S": (0,),
    "IQ3_XXS": (0,),
    "IQ3_S": (0,),
    "IQ1_S": (0,),
    "IQ4_XS": (0,),
    "TQ1_0": (52,),
    "TQ2_0": (64,),
}

#: the types gguf's numpy code can write from floats
QUANTIZABLE = ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")


def random_blocks(name: str, n_rows: int, blocks_per_row: int, seed: int = 0) -> np.ndarray:
    """``u8[n_rows, blocks_per_row * type_size]`` of random blocks with finite, moderate scales."""
    t = WEIGHT_TYPES[name]
    rng = np.random.default_rng(seed)
    if t.block == 1:  # plain floats: random finite values
        x = rng.standard_normal((n_rows, blocks_per_row)).astype(np.float32)
        return gguf.quants.quantize(x, GQ[name]) if name != "F32" else x.view(np.uint8)
    raw = rng.integers(0, 256, size=(n_rows, blocks_per_row, t.type_size), dtype=np.uint8)
    for at in F16_SCALES.get(name, ()):
        d = rng.uniform(-0.1, 0.1, size=(n_rows, blocks_per_row)).astype(np.float16)
        raw[..., at : at + 2] = d.view(np.uint8).reshape(n_rows, blocks_per_row, 2)
    if name == "MXFP4":  # e8m0 exponent of 2^(e-127): 2^-20 .. 2^5, normal float32 results
        raw[..., 0] = rng.integers(107, 133, size=(n_rows, blocks_per_row))
    if name == "NVFP4":  # four unsigned e4m3 scales
        raw[..., :4] = rng.integers(0, 0x7F, size=(n_rows, blocks_per_row, 4))
    if name == "IQ1_M":  # the f16 super-scale is spread over the top nibbles of the 4 scale words
        d = rng.uniform(0.01, 0.1, size=(n_rows, blocks_per_row)).astype(np.float16).view(np.uint16)
        words = raw[..., 48:56].copy().view(np.uint16)
        for k in range(4):  # word k's top nibble holds bits 4k..4k+3 of the scale
            words[..., k] = (words[..., k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        raw[..., 48:56] = words.view(np.uint8)
    return raw.reshape(n_rows, -1)


def assert_bit_equal(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == np.float32
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ, first: {got[~same][:4]} vs {want[~same][:4]}"


DEQ_JIT = jax.jit(dequantize, static_argnums=1)


@pytest.mark.parametrize("name", sorted(WEIGHT_TYPES))
def test_random_blocks_bit_exact(name):
    raw = random_blocks(name, 8, 3)
    want = gguf.quants.dequantize(raw, GQ[name])
    assert_bit_equal(dequantize(raw, name), want)
    assert_bit_equal(DEQ_JIT(raw, name), want)
    with CompileCounter() as again:  # new values of the same shape: no new program
        assert_bit_equal(
            DEQ_JIT(random_blocks(name, 8, 3, seed=1), name),
            gguf.quants.dequantize(random_blocks(name, 8, 3, seed=1), GQ[name]),
        )
    assert again.count == 0


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_quantized_data_bit_exact(name):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 512)) * np.linspace(0.01, 3, 512)).astype(np.float32)
    raw = gguf.quants.quantize(x, GQ[name])
    assert_bit_equal(DEQ_JIT(raw, name), gguf.quants.dequantize(raw, GQ[name]))


@pytest.mark.parametrize("name", ["Q4_K", "IQ2_XS", "F16"])
def test_leading_axes_and_dtype(name):
    raw = random_blocks(name, 6, 2).reshape(2, 3, -1)
    want = gguf.quants.dequantize(raw, GQ[name])
    assert_bit_equal(dequantize(raw, name), want)
    got = dequantize(raw, name, dtype=jnp.bfloat16)
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), want.astype(jnp.bfloat16).astype(np.float32))


def test_f16_given_as_floats_is_viewed_as_bytes():
    x = np.linspace(-2, 2, 64, dtype=np.float16).reshape(2, 32)
    np.testing.assert_array_equal(np.asarray(dequantize(x, "F16")), x.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(dequantize(jnp.asarray(x), "F16")), x.astype(np.float32))


def test_mxfp4_scales_below_float32_normal_flush_to_zero():
    """Deliberate difference: XLA flushes float32 subnormals, gguf's numpy keeps them.

    Only MXFP4 blocks whose e8m0 exponent is 0 or 1 (scales of 2^-128 / 2^-127, never seen in real
    weights) produce them; kvjax gives a zero of the same sign there and equals gguf elsewhere, the
    normal values of those blocks included.
    """
    raw = random_blocks("MXFP4", 4, 2)
    raw.reshape(4, 2, 17)[:, 0, 0] = 0
    raw.reshape(4, 2, 17)[:2, 1, 0] = 1
    want = gguf.quants.dequantize(raw, GQ.MXFP4)
    got = np.asarray(dequantize(raw, "MXFP4"))
    tiny = np.abs(want) < np.finfo(np.float32).tiny
    assert tiny.any()
    assert (got[tiny] == 0).all() and (np.signbit(got[tiny]) == np.signbit(want[tiny])).all()
    assert_bit_equal(got[~tiny], want[~tiny])


def test_every_gguf_type_is_dequantized_or_refused_with_a_reason():
    for t in GQ:
        if t.name in WEIGHT_TYPES:
            assert check_type(t.name).ggml_id == int(t)
            assert WEIGHT_TYPES[t.name][1:] == tuple(gguf.constants.GGML_QUANT_SIZES[t])
        else:
            assert t.name in REFUSED_TYPES, t.name
            with pytest.raises(ValueError, match=t.name):
                check_type(t.name)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"'Q9_9' is not supported .*allowed one of"):
        dequantize(np.zeros((1, 18), np.uint8), "Q9_9")
    with pytest.raises(ValueError, match=r"Q8_K.*intermediate type"):
        check_type("Q8_K")
    with pytest.raises(ValueError, match=r"last axis has 20 bytes: allowed a multiple of Q4_0's block of 18"):
        dequantize(np.zeros((2, 20), np.uint8), "Q4_0")
    with pytest.raises(
        ValueError, match=r"row of 100 values cannot be stored as Q4_K: allowed a positive multiple of .*256"
    ):
        row_bytes("Q4_K", 100)
    with pytest.raises(ValueError, match="at least one axis"):
        dequantize(jnp.float16(1), "F16")
    assert row_bytes("Q4_K", 512) == 288 and row_bytes("F32", 3) == 12
