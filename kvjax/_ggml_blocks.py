"""Every ggml weight block type a GGUF file stores, dequantized in JAX (jit-able, on device).

A GGUF tensor of a block type is, row by row, a run of fixed-size blocks: ``block`` values packed
into ``type_size`` bytes (``ggml-common.h``). :func:`dequantize` turns such bytes into floats inside
a jitted program, so a model can keep its weights in the file's bytes and expand one matrix at a
time (:mod:`kvjax.nn._ggml_linear`). The results are bit-exact with ``gguf.quants.dequantize`` (the
``gguf`` package's numpy port of ggml's reference dequantizers), which the tests check for every
type on random blocks; each function below follows the same float32 operations in the same order,
so that no rounding differs. One deliberate exception: XLA flushes float32 subnormals to zero, so
where gguf's numpy gives a value below float32's normal range (only MXFP4 blocks with an e8m0 scale
exponent of 0 or 1, scales of 2^-128 and 2^-127, which no trained weight has) kvjax gives a zero of
the same sign.

Types (``WEIGHT_TYPES``, keyed by the ``GGMLQuantizationType`` names):

=============================  ============================================================
family                         types
=============================  ============================================================
floats                         F32, F16, BF16
32-value blocks, one scale     Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4 (e8m0 scale)
256-value super-blocks         Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS, TQ1_0, TQ2_0
lattice codebooks (256)        IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
64-value blocks, 4 fp8 scales  NVFP4
=============================  ============================================================

Refused by name (:func:`check_type`): Q8_1 and Q8_K (ggml's intermediate types for the dot
products of activations; no file stores weights in them and ``gguf`` has no dequantizer), Q1_0
(no dequantizer in ``gguf`` to prove against), and the integer / float64 types (not weights).

The codebook types (IQ1/IQ2/IQ3) take their lattice grids from the ``gguf`` package (it builds
them from ggml's tables); reading any GGUF file needs that package anyway.

Example:
    >>> import numpy as np, gguf
    >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
    >>> raw = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    >>> raw.shape, row_bytes("Q8_0", 32)
    ((2, 34), 34)
    >>> bool((np.asarray(dequantize(raw, "Q8_0")) == gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0)).all())
    True
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BlockType", "WEIGHT_TYPES", "REFUSED_TYPES", "check_type", "row_bytes", "dequantize"]

#: values per super-block of the K, IQ and TQ types (ggml's QK_K)
QK_K = 256


class BlockType(NamedTuple):
    """One ggml type: its ``enum ggml_type`` id, values per block, bytes per block."""

    ggml_id: int
    block: int
    type_size: int


#: types kvjax dequantizes, by ``GGMLQuantizationType`` name
WEIGHT_TYPES: Dict[str, BlockType] = {
    "F32": BlockType(0, 1, 4),
    "F16": BlockType(1, 1, 2),
    "Q4_0": BlockType(2, 32, 18),
    "Q4_1": BlockType(3, 32, 20),
    "Q5_0": BlockType(6, 32, 22),
    "Q5_1": BlockType(7, 32, 24),
    "Q8_0": BlockType(8, 32, 34),
    "Q2_K": BlockType(10, QK_K, 84),
    "Q3_K": BlockType(11, QK_K, 110),
    "Q4_K": BlockType(12, QK_K, 144),
    "Q5_K": BlockType(13, QK_K, 176),
    "Q6_K": BlockType(14, QK_K, 210),
    "IQ2_XXS": BlockType(16, QK_K, 66),
    "IQ2_XS": BlockType(17, QK_K, 74),
    "IQ3_XXS": BlockType(18, QK_K, 98),
    "IQ1_S": BlockType(19, QK_K, 50),
    "IQ4_NL": BlockType(20, 32, 18),
    "IQ3_S": BlockType(21, QK_K, 110),
    "IQ2_S": BlockType(22, QK_K, 82),
    "IQ4_XS": BlockType(23, QK_K, 136),
    "IQ1_M": BlockType(29, QK_K, 56),
    "BF16": BlockType(30, 1, 2),
    "TQ1_0": BlockType(34, QK_K, 54),
    "TQ2_0": BlockType(35, QK_K, 66),
    "MXFP4": BlockType(39, 32, 17),
    "NVFP4": BlockType(40, 64, 36),
}

#: types a GGUF may name that kvjax refuses, with the reason the error gives
REFUSED_TYPES: Dict[str, str] = {
    "Q8_1": "an intermediate type of ggml's dot products (activations), never stored as weights",
    "Q8_K": "an intermediate type of ggml's dot products (activations), never stored as weights",
    "Q1_0": "the gguf package has no dequantizer for it to prove kvjax's against",
    "I8": "an integer tensor, not a weight matrix",
    "I16": "an integer tensor, not a weight matrix",
    "I32": "an integer tensor, not a weight matrix",
    "I64": "an integer tensor, not a weight matrix",
    "F64": "a float64 tensor: convert the file's weights to F32/F16/BF16",
}


def check_type(name: str) -> BlockType:
    """The :class:`BlockType` of ``name``, or a ``ValueError`` naming the type and why it is refused."""
    if name in WEIGHT_TYPES:
        return WEIGHT_TYPES[name]
    why = REFUSED_TYPES.get(name, "not a ggml type kvjax knows")
    raise ValueError(f"ggml type {name!r} is not supported ({why}): allowed one of {sorted(WEIGHT_TYPES)}")


def row_bytes(name: str, n: int) -> int:
    """Bytes of a row of ``n`` values of type ``name`` (``n`` a multiple of the type's block)."""
    t = check_type(name)
    if n <= 0 or n % t.block:
        raise ValueError(
            f"a row of {n} values cannot be stored as {name}: allowed a positive multiple "
            f"of its block of {t.block} values"
        )
    return n // t.block * t.type_size


# --- bit helpers: every function below works on u8[N, type_size], one block per row ---------------


def _u16(b: jax.Array) -> jax.Array:
    """``u8[N, 2k]`` read as ``k`` little-endian uint16 per row."""
    b = b.astype(jnp.uint16).reshape(b.shape[0], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: jax.Array) -> jax.Array:
    """``u8[N, 4k]`` read as ``k`` little-endian uint32 per row."""
    b = b.astype(jnp.uint32).reshape(b.shape[0], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _f16(b: jax.Array) -> jax.Array:
    """``u8[N, 2k]`` read as ``k`` float16 per row, widened to float32 (exact)."""
    return jax.lax.bitcast_convert_type(_u16(b), jnp.float16).astype(jnp.float32)


def _bits(x: jax.Array, group: int, shifts: Sequence[int], mask: int) -> jax.Array:
    """Unpack bit fields: each run of ``group`` values gives ``len(shifts)`` runs, ``(x >> s) & mask``.

    ``x [N, G * group] -> [N, G * len(shifts) * group]``: run ``g`` becomes the fields at shift
    ``shifts[0]`` of its ``group`` values, then those at ``shifts[1]``, ... (ggml's packings).
    """
    s = jnp.asarray(tuple(shifts), x.dtype).reshape(1, 1, -1, 1)
    return ((x.reshape(x.shape[0], -1, 1, group) >> s) & jnp.asarray(mask, x.dtype)).reshape(x.shape[0], -1)


def _i8(x: jax.Array) -> jax.Array:
    """Unsigned bytes reinterpreted as int8 (two's complement), as ggml's ``int8_t`` casts."""
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint8), jnp.int8)


def _lookup(table: Sequence[float], idx: jax.Array) -> jax.Array:
    """``table[idx]`` with a small constant table."""
    return jnp.asarray(np.asarray(table, np.float32))[idx.astype(jnp.int32)]


def _signs(bits: jax.Array) -> jax.Array:
    """``+1`` where a sign bit is 0, ``-1`` where it is 1."""
    return jnp.where(bits == 0, jnp.float32(1), jnp.float32(-1))


# --- floats -------------------------------------------------------------------------------------


def _f32(b):
    return jax.lax.bitcast_convert_type(_u32(b), jnp.float32)


def _bf16(b):
    return jax.lax.bitcast_convert_type(_u16(b).astype(jnp.uint32) << 16, jnp.float32)


# --- 32-value blocks -----------------------------------------------------------------------------


def _q4_0(b):
    q = _bits(b[:, 2:], 16, (0, 4), 0x0F)
    return _f16(b[:, :2]) * (_i8(q) - jnp.int8(8)).astype(jnp.float32)


def _q4_1(b):
    q = _bits(b[:, 4:], 16, (0, 4), 0x0F).astype(jnp.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _fifth_bits(qh: jax.Array) -> jax.Array:
    """``u32[N, 1]`` -> ``u8[N, 32]``: bit ``j`` of the word, value ``j``'s 5th bit."""
    return ((qh >> jnp.arange(32, dtype=jnp.uint32)[None]) & jnp.uint32(1)).astype(jnp.uint8)


def _q5_0(b):
    q = _bits(b[:, 6:], 16, (0, 4), 0x0F) | (_fifth_bits(_u32(b[:, 2:6])) << 4)
    return _f16(b[:, :2]) * (_i8(q) - jnp.int8(16)).astype(jnp.float32)


def _q5_1(b):
    q = _bits(b[:, 8:], 16, (0, 4), 0x0F) | (_fifth_bits(_u32(b[:, 4:8])) << 4)
    return _f16(b[:, :2]) * q.astype(jnp.float32) + _f16(b[:, 2:4])


def _q8_0(b):
    return _i8(b[:, 2:]).astype(jnp.float32) * _f16(b[:, :2])


#: IQ4_NL / IQ4_XS's 16 non-linear levels (ggml's ``kvalues_iq4nl``)
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
#: MXFP4 / NVFP4's e2m1 values, doubled (ggml's ``kvalues_mxfp4``)
FP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _iq4_nl(b):
    return _f16(b[:, :2]) * _lookup(IQ4_LEVELS, _bits(b[:, 2:], 16, (0, 4), 0x0F))


def _mxfp4(b):
    # e8m0 exponent halved (the levels are doubled): 2^(e-128), subnormal below e = 2
    e = b[:, :1].astype(jnp.uint32)
    q = _lookup(FP4_LEVELS, _bits(b[:, 1:], 16, (0, 4), 0x0F))
    d = jax.lax.bitcast_convert_type(jnp.maximum(e, 2) - 1 << 23, jnp.float32)
    # e < 2 makes d a float32 subnormal, which XLA flushes to zero before the product: scale in two
    # exact steps there instead (results still below float32's normal range flush to a signed zero)
    up = jax.lax.bitcast_convert_type(e + 63 << 23, jnp.float32)  # 2^(e - 64)
    return jnp.where(e < 2, q * up * jnp.float32(2.0**-64), d * q)


def _nvfp4(b):
    # four sub-blocks of 16 values, each with an unsigned e4m3 scale (bias 7), halved
    x = b[:, :4]
    exp = (x >> 3).astype(jnp.int32) & 0xF
    man = (x & 0x7).astype(jnp.float32)
    raw = jnp.where(exp == 0, man * jnp.float32(2.0**-9), jnp.ldexp(1 + man / 8, exp - 7))
    d = jnp.where((x == 0) | (x == 0x7F), jnp.float32(0), raw * jnp.float32(0.5))
    q = _bits(b[:, 4:], 8, (0, 4), 0x0F).reshape(-1, 4, 16)
    return (d[..., None] * _lookup(FP4_LEVELS, q)).reshape(-1, 64)


# --- 256-value super-blocks ----------------------------------------------------------------------


def _q2_k(b):
    scales = b[:, :16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    dl = (d * (scales & 0xF).astype(jnp.float32))[..., None]
    ml = (dmin * (scales >> 4).astype(jnp.float32))[..., None]
    q = _bits(b[:, 16:80], 32, (0, 2, 4, 6), 3).reshape(-1, 16, 16).astype(jnp.float32)
    return (dl * q - ml).reshape(-1, QK_K)


def _q3_k(b):
    d = _f16(b[:, 108:110])
    low = _bits(b[:, 96:104], 8, (0, 4), 0x0F)
    high = _bits(b[:, 104:108], 4, (0, 2, 4, 6), 0x03)
    scales = (_i8(low | (high << 4)) - jnp.int8(32)).astype(jnp.float32)
    dl = (d * scales)[..., None]
    ql = _bits(b[:, 32:96], 32, (0, 2, 4, 6), 3).reshape(-1, 16, 16)
    # a set hmask bit means "no offset": the 3rd bit subtracts 4 where it is clear
    qh = _bits(b[:, :32], 32, range(8), 1).reshape(-1, 16, 16) ^ jnp.uint8(1)
    q = (_i8(ql) - _i8(qh << 2)).astype(jnp.float32)
    return (dl * q).reshape(-1, QK_K)


def _k_scales(s: jax.Array):
    """Q4_K / Q5_K's 12 bytes of 6-bit scales and mins -> (``u8[N, 8]`` scales, ``u8[N, 8]`` mins)."""
    s = s.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_scaled(b, q):
    """``d * sc * q - dmin * m`` over Q4_K / Q5_K's 8 sub-blocks of 32, ``q [N, 8, 32]``."""
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b[:, :2]) * sc.astype(jnp.float32))[..., None]
    dm = (_f16(b[:, 2:4]) * mn.astype(jnp.float32))[..., None]
    return (d * q.astype(jnp.float32) - dm).reshape(-1, QK_K)


def _q4_k(b):
    return _k_scaled(b, _bits(b[:, 16:144], 32, (0, 4), 0x0F).reshape(-1, 8, 32))


def _q5_k(b):
    ql = _bits(b[:, 48:176], 32, (0, 4), 0x0F).reshape(-1, 8, 32)
    qh = _bits(b[:, 16:48], 32, range(8), 1).reshape(-1, 8, 32)
    return _k_scaled(b, ql | (qh << 4))


def _q6_k(b):
    scales = _i8(b[:, 192:208]).astype(jnp.float32)
    d = (_f16(b[:, 208:210]) * scales)[..., None]
    ql = _bits(b[:, :128], 64, (0, 4), 0x0F).reshape(-1, 8, 32)
    qh = _bits(b[:, 128:192], 32, (0, 2, 4, 6), 3).reshape(-1, 8, 32)
    q = (_i8(ql | (qh << 4)) - jnp.int8(32)).reshape(-1, 16, 16).astype(jnp.float32)
    return (d * q).reshape(-1, QK_K)


def _iq4_xs(b):
    d = _f16(b[:, :2])
    high = (_u16(b[:, 2:4]) >> jnp.arange(0, 16, 2, dtype=jnp.uint16)[None]).astype(jnp.uint8) & 0x03
    low = _bits(b[:, 4:8], 1, (0, 4), 0x0F)
    scales = (_i8(low | (high << 4)) - jnp.int8(32)).astype(jnp.float32)
    dl = (d * scales)[..., None]
    q = _bits(b[:, 8:], 16, (0, 4), 0x0F).reshape(-1, 8, 32)
    return (dl * _lookup(IQ4_LEVELS, q)).reshape(-1, QK_K)


def _ternary(q: jax.Array) -> jax.Array:
    """TQ1_0's base-3 digits: a byte holding ``k`` trits, scaled to the top, gives each in 0..2."""
    return (((q.astype(jnp.uint16) * 3) >> 8).astype(jnp.int8) - jnp.int8(1)).astype(jnp.float32)


def _tq1_0(b):
    # uint8 products wrap mod 256, which is how the trits are shifted to the top of the byte
    def digits(x, group, k):
        p = jnp.asarray([3**i for i in range(k)], jnp.uint8).reshape(1, 1, k, 1)
        return (x.reshape(x.shape[0], -1, 1, group) * p).reshape(x.shape[0], -1)

    q = jnp.concatenate([digits(b[:, :32], 32, 5), digits(b[:, 32:48], 16, 5), digits(b[:, 48:52], 4, 4)], axis=-1)
    return _f16(b[:, 52:54]) * _ternary(q)


def _tq2_0(b):
    q = _bits(b[:, :64], 32, (0, 2, 4, 6), 3)
    return _f16(b[:, 64:66]) * (_i8(q) - jnp.int8(1)).astype(jnp.float32)


# --- lattice codebooks ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _grid(name: str) -> np.ndarray:
    """The codebook of an IQ type, ``f32[entries, width]`` (from the ``gguf`` package)."""
    try:
        import gguf.quants as gq
    except ImportError as e:  # pragma: no cover - reading a GGUF file already needs gguf
        raise ImportError(
            f"dequantizing {name} needs its lattice grid from the gguf package: pip install 'kvjax[gguf]'"
        ) from e
    cls = getattr(gq, name)
    cls.init_grid()
    return np.asarray(cls.grid, np.float32).reshape(cls.grid_shape)


def _grid_rows(name: str, idx: jax.Array) -> jax.Array:
    """Rows ``idx`` of the codebook: ``idx [N, k] -> f32[N, k, width]``."""
    return jnp.asarray(_grid(name))[idx.astype(jnp.int32)]


#: ggml's ``ksigns_iq2xs``: 7 stored sign bits, the 8th makes the count of minus signs even
_KSIGNS = np.array([k | ((bin(k).count("1") & 1) << 7) for k in range(128)], np.uint8)


def _even_signs(idx: jax.Array) -> jax.Array:
    """7-bit sign indices ``[..., k]`` -> ``[..., k, 8]`` of +-1."""
    s = jnp.asarray(_KSIGNS)[idx.astype(jnp.int32)]
    return _signs((s[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1)


def _iq2_xxs(b):
    d = _f16(b[:, :2])
    words = _u32(b[:, 2:66]).reshape(-1, 8, 2)
    aux = words[..., 1]
    db = (d * (jnp.float32(0.5) + (aux >> 28).astype(jnp.float32)) * jnp.float32(0.25))[..., None, None]
    signs = _even_signs((aux[..., None] >> jnp.asarray([0, 7, 14, 21], jnp.uint32)) & 0x7F)  # [N, 8, 4, 8]
    idx = b[:, 2:66].reshape(-1, 8, 8)[..., :4]  # the 4 bytes of each first word: grid indices
    grid = _grid_rows("IQ2_XXS", idx.reshape(-1, 32)).reshape(-1, 8, 4, 8)
    return (db * grid * signs).reshape(-1, QK_K)


def _half_scales(s: jax.Array) -> jax.Array:
    """Bytes of two 4-bit scales each (low nibble first) -> ``u8[N, 2 * bytes]``."""
    return _bits(s, 1, (0, 4), 0x0F)


def _iq2_xs(b):
    d = _f16(b[:, :2])
    qs = _u16(b[:, 2:66])  # [N, 32]: 9-bit grid index, 7-bit sign index
    db = d * (jnp.float32(0.5) + _half_scales(b[:, 66:74]).astype(jnp.float32)) * jnp.float32(0.25)
    signs = _even_signs(qs >> 9).reshape(-1, 16, 2, 8)
    grid = _grid_rows("IQ2_XS", qs & 511).reshape(-1, 16, 2, 8)
    return (db[..., None, None] * grid * signs).reshape(-1, QK_K)


def _iq2_s(b):
    d = _f16(b[:, :2])
    db = d * (jnp.float32(0.5) + _half_scales(b[:, 74:82]).astype(jnp.float32)) * jnp.float32(0.25)
    signs = _signs(_bits(b[:, 34:66], 1, range(8), 1)).reshape(-1, 16, 2, 8)
    qh = _bits(b[:, 66:74], 1, (0, 2, 4, 6), 3).astype(jnp.uint16)
    idx = b[:, 2:34].astype(jnp.uint16) | (qh << 8)
    grid = _grid_rows("IQ2_S", idx).reshape(-1, 16, 2, 8)
    return (db[..., None, None] * grid * signs).reshape(-1, QK_K)


def _iq3_xxs(b):
    d = _f16(b[:, :2])
    aux = _u32(b[:, 66:98])  # [N, 8]: 4-bit scale, 4 x 7-bit sign indices
    db = (d * (jnp.float32(0.5) + (aux >> 28).astype(jnp.float32)) * jnp.float32(0.5))[..., None, None]
    signs = _even_signs((aux[..., None] >> jnp.asarray([0, 7, 14, 21], jnp.uint32)) & 0x7F)
    grid = _grid_rows("IQ3_XXS", b[:, 2:66]).reshape(-1, 8, 4, 8)
    return (db * grid * signs).reshape(-1, QK_K)


def _iq3_s(b):
    d = _f16(b[:, :2])
    db = (d * (1 + 2 * _half_scales(b[:, 106:110])).astype(jnp.float32))[..., None, None]
    signs = _signs(_bits(b[:, 74:106], 1, range(8), 1)).reshape(-1, 8, 4, 8)
    qh = _bits(b[:, 66:74], 1, range(8), 1).astype(jnp.uint16)
    idx = b[:, 2:66].astype(jnp.uint16) | (qh << 8)
    grid = _grid_rows("IQ3_S", idx).reshape(-1, 8, 4, 8)
    return (db * grid * signs).reshape(-1, QK_K)


#: IQ1_S / IQ1_M's offset of every lattice point (ggml's IQ1S_DELTA / IQ1M_DELTA)
IQ1_DELTA = 0.125


def _iq1_s(b):
    d = _f16(b[:, :2])
    qh = _u16(b[:, 34:50])  # [N, 8]: 4 x 3 high index bits, a 3-bit scale, the delta's sign
    dl = (d * (2 * ((qh >> 12) & 7) + 1).astype(jnp.float32))[..., None, None]
    delta = jnp.where((qh & 0x8000) == 0, jnp.float32(IQ1_DELTA), jnp.float32(-IQ1_DELTA))[..., None, None]
    high = _bits(qh, 1, (0, 3, 6, 9), 7)
    idx = b[:, 2:34].astype(jnp.uint16) | (high << 8)
    grid = _grid_rows("IQ1_S", idx).reshape(-1, 8, 4, 8)
    return (dl * (grid + delta)).reshape(-1, QK_K)


def _iq1_m(b):
    scales = _u16(b[:, 48:56])  # [N, 4]: the f16 super-scale is spread over their top nibbles
    top = (scales & 0xF000) >> jnp.asarray([12, 8, 4, 0], jnp.uint16)[None]
    d = jax.lax.bitcast_convert_type(top[:, 0] | top[:, 1] | top[:, 2] | top[:, 3], jnp.float16)
    d = d.astype(jnp.float32)[:, None]
    sub = _bits(scales, 1, (0, 3, 6, 9), 7)  # [N, 16] 3-bit scales
    dl = (d * (2 * sub + 1).astype(jnp.float32)).reshape(-1, 8, 2, 1, 1)
    qh = _bits(b[:, 32:48], 1, (0, 4), 0x0F)  # [N, 32]: 3 high index bits, the delta's sign
    idx = b[:, :32].astype(jnp.uint16) | ((qh & 7).astype(jnp.uint16) << 8)
    delta = jnp.where((qh & 0x08) == 0, jnp.float32(IQ1_DELTA), jnp.float32(-IQ1_DELTA)).reshape(-1, 8, 2, 2, 1)
    grid = _grid_rows("IQ1_M", idx).reshape(-1, 8, 2, 2, 8)
    return (dl * (grid + delta)).reshape(-1, QK_K)


_DEQUANTIZERS: Dict[str, Callable[[jax.Array], jax.Array]] = {
    "F32": _f32,
    "F16": _f16,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q2_K": _q2_k,
    "Q3_K": _q3_k,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
    "IQ4_NL": _iq4_nl,
    "IQ4_XS": _iq4_xs,
    "MXFP4": _mxfp4,
    "NVFP4": _nvfp4,
    "TQ1_0": _tq1_0,
    "TQ2_0": _tq2_0,
    "IQ2_XXS": _iq2_xxs,
    "IQ2_XS": _iq2_xs,
    "IQ2_S": _iq2_s,
    "IQ3_XXS": _iq3_xxs,
    "IQ3_S": _iq3_s,
    "IQ1_S": _iq1_s,
    "IQ1_M": _iq1_m,
}
assert set(_DEQUANTIZERS) == set(WEIGHT_TYPES)


def dequantize(raw, name: str, dtype=jnp.float32) -> jax.Array:
    """Values of rows of ggml blocks.

    Args:
        raw: ``u8[..., row_bytes]`` (any array whose last axis holds whole blocks; other dtypes are
            viewed as their bytes, e.g. a GGUF reader's ``float16[..., n]`` for an F16 tensor).
        name: the ggml type name (a key of :data:`WEIGHT_TYPES`).
        dtype: the result's dtype (the values are computed in float32, then cast).

    Returns:
        ``dtype[..., n]`` with ``n = row_bytes / type_size * block``.

    Raises:
        ValueError: an unsupported ``name``, or a last axis that is not whole blocks.
    """
    t = check_type(name)
    if isinstance(raw, np.ndarray) and raw.dtype != np.uint8:
        raw = np.ascontiguousarray(raw).view(np.uint8)
    raw = jnp.asarray(raw)
    if raw.dtype != jnp.uint8:
        if raw.ndim == 0:
            raise ValueError("raw must have at least one axis of bytes")
        raw = jax.lax.bitcast_convert_type(raw, jnp.uint8).reshape(*raw.shape[:-1], -1)
    if raw.ndim == 0 or raw.shape[-1] % t.type_size:
        raise ValueError(
            f"raw's last axis has {raw.shape[-1] if raw.ndim else 0} bytes: allowed a multiple of "
            f"{name}'s block of {t.type_size} bytes"
        )
    lead, n_blocks = raw.shape[:-1], raw.shape[-1] // t.type_size
    values = _DEQUANTIZERS[name](raw.reshape(-1, t.type_size))
    return values.reshape(*lead, n_blocks * t.block).astype(dtype)
