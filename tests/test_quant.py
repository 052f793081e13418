"""Block quantizers equal ggml's reference (the gguf package's numpy port) bit for bit."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T  # noqa: E402
from gguf import quants  # noqa: E402

from kvjax.storage import _quant as Q  # noqa: E402

TYPES = {"q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0, "q5_1": T.Q5_1}


def _edge_rows(rng):
    rows = [
        np.zeros(64, np.float32),
        np.full(64, 1e30, np.float32),  # scale overflows f16
        np.full(64, -3.0e4, np.float32),
        np.r_[np.full(32, 1e-6), np.full(32, -7e-8)].astype(np.float32),  # f16 subnormal scales
        np.tile(np.array([1.0, -1.0], np.float32), 32),  # ties in |max|: first wins
        np.tile(np.array([-1.0, 1.0], np.float32), 32),
        (np.arange(64, dtype=np.float32) - 32) / 2,  # halves: rounding ties
        np.linspace(-8, 8, 64).astype(np.float32),
        np.r_[np.full(31, 5.0), [-5.0], np.full(32, 0.5)].astype(np.float32),
        np.r_[np.zeros(31), [1e-30], rng.standard_normal(32)].astype(np.float32),  # tiny block
        np.full(64, 7.0, np.float32),  # constant rows (max == min)
    ]
    # exact ties of x * id: values that are multiples of d / 2
    for name_d in (127.0, 8.0, 16.0):
        r = np.arange(-32, 32, dtype=np.float32) * (name_d / 64)
        r[0] = -name_d
        rows.append(r.astype(np.float32))
    return np.stack(rows)


def _rows(seed):
    rng = np.random.default_rng(seed)
    random = (rng.standard_normal((40, 64)) * rng.choice([1e-3, 1.0, 30.0, 3e3], size=(40, 1))).astype(np.float32)
    return np.concatenate([random, _edge_rows(rng)])


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("seed", [0, 1])
def test_quantize_matches_gguf_bit_for_bit(name, seed):
    x = _rows(seed)
    ref = quants.quantize(x, TYPES[name])
    got = np.asarray(jax.jit(Q.quantize, static_argnums=1)(jnp.asarray(x), name))
    assert got.dtype == np.uint8 and got.shape == ref.shape
    bad = np.nonzero((got != ref).any(axis=-1))[0]
    assert bad.size == 0, f"rows {bad.tolist()} differ"


@pytest.mark.parametrize("name", sorted(TYPES))
def test_dequantize_matches_gguf_bit_for_bit(name):
    x = _rows(2)
    blocks = quants.quantize(x, TYPES[name])
    # also arbitrary bytes (every nibble / int8 / high-bit pattern), scales kept finite
    rng = np.random.default_rng(3)
    junk = rng.integers(0, 256, size=(16, blocks.shape[1]), dtype=np.uint8)
    qt = Q.QUANT_TYPES[name]
    for blk in range(blocks.shape[1] // qt.type_size):
        o = blk * qt.type_size
        n_scales = 2 if name in ("q4_1", "q5_1") else 1
        for s in range(n_scales):
            junk[:, o + 2 * s : o + 2 * s + 2] = np.float16(rng.standard_normal(16)).view(np.uint8).reshape(16, 2)
    blocks = np.concatenate([blocks, junk])
    ref = quants.dequantize(blocks, TYPES[name])
    got = np.asarray(jax.jit(Q.dequantize, static_argnums=1)(jnp.asarray(blocks), name))
    np.testing.assert_array_equal(got.view(np.uint32)[np.isfinite(ref)], ref.view(np.uint32)[np.isfinite(ref)])
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))


def test_layout_q8_0_and_q4_0_by_hand():
    x = np.arange(32, dtype=np.float32) - 16  # amax 16 at element 0 (value -16)
    b8 = np.asarray(Q.quantize(jnp.asarray(x), "q8_0"))
    assert b8[:2].view(np.float16)[0] == np.float16(np.float32(16) / 127)
    assert b8[2:].view(np.int8)[0] == -127 and b8[2:].view(np.int8)[16] == 0
    b4 = np.asarray(Q.quantize(jnp.asarray(x), "q4_0"))
    assert b4.shape == (18,) and b4[:2].view(np.float16)[0] == np.float16(2.0)  # d = -16 / -8
    # element 0: -16 / 2 + 8.5 -> 0 in the low nibble of byte 0; element 16: 0 / 2 + 8.5 -> 8 high
    assert b4[2] & 0x0F == 0 and b4[2] >> 4 == 8


@pytest.mark.parametrize("name", sorted(TYPES))
def test_error_bound(name):
    """|x - dq(q(x))| <= d / 2 per block (d + rounding of the f16 scale for the asymmetric types)."""
    x = np.random.default_rng(5).standard_normal((64, 128)).astype(np.float32)
    y = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), name), name))
    blocks = x.reshape(64, 4, 32)
    span = {
        "q8_0": 2 * np.abs(blocks).max(-1) / 127 / 2,
        "q4_0": np.abs(blocks).max(-1) / 8,
        "q5_0": np.abs(blocks).max(-1) / 16,
        "q4_1": np.ptp(blocks, -1) / 15,
        "q5_1": np.ptp(blocks, -1) / 31,
    }[name]
    err = np.abs(y - x).reshape(64, 4, 32).max(-1)
    assert np.all(err <= span * 1.01 + 1e-3 * np.abs(blocks).max(-1))


def test_bad_row_size():
    with pytest.raises(ValueError, match="multiple of the q8_0 block size"):
        Q.quantize(jnp.zeros((2, 48)), "q8_0")
    with pytest.raises(ValueError, match="not a block-quantized type"):
        Q.quantize(jnp.zeros((2, 32)), "q3_k")


@pytest.mark.parametrize("name", sorted(TYPES))
def test_subnormal_block_decodes_to_zero(name):
    """A block whose largest value is subnormal: ggml computes 1/d = inf and casts NaN to an int
    (undefined behaviour in C); XLA flushes the subnormal to 0, so kvjax stores a zero block."""
    x = np.r_[np.zeros(31), [1e-40], np.ones(32)].astype(np.float32)
    y = np.asarray(Q.dequantize(Q.quantize(jnp.asarray(x), name), name))
    assert np.all(y[:32] == 0) and np.allclose(y[32:], 1, atol=0.07)
