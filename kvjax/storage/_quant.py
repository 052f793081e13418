"""ggml block quantization of K/V rows in JAX: q8_0, q4_0, q4_1, q5_0, q5_1.

Every type packs 32 consecutive values of a row (a block) into a fixed number of bytes, byte for
byte as ggml lays them out (``ggml-common.h``, ``quantize_row_*_ref`` in ``ggml-quants.c``):

========  =====  ==========================================================================
type      bytes  layout of one block
========  =====  ==========================================================================
q8_0      34     f16 d, 32 x int8 q                         x = d * q
q4_0      18     f16 d, 16 bytes: low nibble = element j, high nibble = element j + 16,
                 x = d * (q - 8)
q4_1      20     f16 d, f16 m, 16 bytes of nibbles as q4_0,  x = d * q + m
q5_0      22     f16 d, u32 qh (bit j = 5th bit of element j), 16 bytes of low nibbles,
                 x = d * (q - 16)
q5_1      24     f16 d, f16 m, u32 qh, 16 bytes of low nibbles,  x = d * q + m
========  =====  ==========================================================================

The scales are computed in float32 as ggml does (``d = max / -8`` with ``max`` the element of
largest magnitude for q4_0, ``amax / 127`` for q8_0, ...), values are rounded with ggml's rules
(``roundf`` for q8_0, ``(int)(x * id + 8.5f)`` truncation for the 4/5-bit types) and only the
stored scale is rounded to f16, so the bytes equal ggml's reference quantizer (and the ``gguf``
package's numpy port, which the tests compare against bit for bit).

Functions work on any leading shape: ``quantize(x [..., D], name) -> u8[..., D // 32 * bytes]``
and ``dequantize(b, name) -> f32[..., D]``. They are pure ``jnp`` (jit-able, vectorised).

Example:
    >>> import jax.numpy as jnp
    >>> b = quantize(jnp.arange(32, dtype=jnp.float32), "q8_0")
    >>> b.shape, b.dtype, float(jnp.max(jnp.abs(dequantize(b, "q8_0") - jnp.arange(32))))  # doctest: +ELLIPSIS
    ((34,), dtype('uint8'), ...)
"""

from __future__ import annotations

from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np

from kvjax._ggml_blocks import WEIGHT_TYPES, BlockType

#: elements per block (QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = 32 in ggml)
BLOCK = 32


#: one block type: its ggml type id, elements per block and bytes per block (the weight types' record)
QuantType = BlockType

#: ggml types kvjax stores K/V in, by name (the ids are ``enum ggml_type``): the weight types' own entries
QUANT_TYPES: Dict[str, QuantType] = {
    name: WEIGHT_TYPES[name.upper()] for name in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0")
}
assert all(t.block == BLOCK for t in QUANT_TYPES.values())


def is_quantized(name: str) -> bool:
    """Whether a storage dtype name is a block-quantized ggml type."""
    return name in QUANT_TYPES


def row_bytes(name: str, n: int) -> int:
    """Bytes of a row of ``n`` values stored as ``name`` (ggml's ``ggml_row_size``)."""
    if name in QUANT_TYPES:
        qt = QUANT_TYPES[name]
        return n // qt.block * qt.type_size
    return n * np.dtype(name).itemsize


def stored_width(name: str, n: int) -> int:
    """Last-axis length of a row of ``n`` values in storage (bytes for quantized types)."""
    return row_bytes(name, n) if name in QUANT_TYPES else n


def storage_dtype(name: str):
    """The array dtype of a storage leaf: uint8 for a block type, else the float dtype."""
    return jnp.dtype(jnp.uint8) if name in QUANT_TYPES else jnp.dtype(name)


# -- helpers -----------------------------------------------------------------------------------


def _f16_bytes(x):
    """f32[...] -> u8[..., 2]: rounded to f16 (nearest even, as ggml's FP32_TO_FP16), little endian."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float16), jnp.uint16)
    return jnp.stack([(bits & 0xFF).astype(jnp.uint8), (bits >> 8).astype(jnp.uint8)], axis=-1)


def _f16_from(b):
    """u8[..., 2] (little endian) -> f32[...]."""
    bits = b[..., 0].astype(jnp.uint16) | (b[..., 1].astype(jnp.uint16) << 8)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _inverse(d):
    """ggml's ``id = d ? 1.0f/d : 0.0f`` in float32."""
    safe = jnp.where(d == 0, jnp.float32(1), d)
    return jnp.where(d == 0, jnp.float32(0), jnp.float32(1) / safe)


def _roundf(x):
    """C ``roundf`` (half away from zero), exact in float32: no ``x + 0.5`` rounding error."""
    a = jnp.abs(x)
    fl = jnp.floor(a)
    return jnp.sign(x) * (fl + jnp.floor(2 * (a - fl)))


def _product(x, y):
    """``x * y`` rounded to float32 before any following add (no fused multiply-add)."""
    return jax.lax.reduce_precision(x * y, exponent_bits=8, mantissa_bits=23)


def _nibbles(q):
    """u8[..., 32] values < 16 -> u8[..., 16]: byte j = q[j] | q[j + 16] << 4."""
    return q[..., :16] | (q[..., 16:] << 4)


def _unnibble(qs):
    """u8[..., 16] -> u8[..., 32] (inverse of :func:`_nibbles`)."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(q):
    """u8[..., 32] 5-bit values -> u8[..., 4]: bit i of byte j is bit 4 of element 8j + i."""
    h = ((q >> 4) & 1).reshape(q.shape[:-1] + (4, 8))
    return jnp.sum(h.astype(jnp.uint32) << jnp.arange(8, dtype=jnp.uint32), axis=-1).astype(jnp.uint8)


def _unhigh(qh):
    """u8[..., 4] -> u8[..., 32] the 5th bit of each element."""
    bits = (qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    return bits.reshape(qh.shape[:-1] + (32,))


def _trunc_u8(x, top):
    """``(uint8_t) MIN(top, (int8_t)(x))`` for x >= 0 as ggml does: truncation toward zero."""
    return jnp.clip(jnp.trunc(x), 0, top).astype(jnp.uint8)


def _absmax_signed(x):
    """The element of largest magnitude (first one on ties), with its sign, per block."""
    i = jnp.argmax(jnp.abs(x), axis=-1)
    return jnp.take_along_axis(x, i[..., None], axis=-1)


# -- per-type block codecs ([..., 32] f32 <-> [..., type_size] u8) -----------------------------


def _q8_0(x):
    amax = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    d = amax / jnp.float32(127)
    q = _roundf(_product(x, _inverse(d)))
    qs = jax.lax.bitcast_convert_type(q.astype(jnp.int8), jnp.uint8)
    return jnp.concatenate([_f16_bytes(d[..., 0]), qs], axis=-1)


def _dq8_0(b):
    d = _f16_from(b[..., :2])
    q = jax.lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
    return q * d[..., None]


def _q4_0(x):
    d = _absmax_signed(x) / jnp.float32(-8)
    q = _trunc_u8(_product(x, _inverse(d)) + jnp.float32(8.5), 15)
    return jnp.concatenate([_f16_bytes(d[..., 0]), _nibbles(q)], axis=-1)


def _dq4_0(b):
    d = _f16_from(b[..., :2])
    q = _unnibble(b[..., 2:]).astype(jnp.float32) - 8
    return q * d[..., None]


def _q4_1(x):
    mx = jnp.max(x, axis=-1, keepdims=True)
    mn = jnp.min(x, axis=-1, keepdims=True)
    d = (mx - mn) / jnp.float32(15)
    q = _trunc_u8(_product(x - mn, _inverse(d)) + jnp.float32(0.5), 15)
    return jnp.concatenate([_f16_bytes(d[..., 0]), _f16_bytes(mn[..., 0]), _nibbles(q)], axis=-1)


def _dq4_1(b):
    d, m = _f16_from(b[..., :2]), _f16_from(b[..., 2:4])
    q = _unnibble(b[..., 4:]).astype(jnp.float32)
    return _product(q, d[..., None]) + m[..., None]


def _q5_0(x):
    d = _absmax_signed(x) / jnp.float32(-16)
    q = _trunc_u8(_product(x, _inverse(d)) + jnp.float32(16.5), 31)
    return jnp.concatenate([_f16_bytes(d[..., 0]), _high_bits(q), _nibbles(q & 0x0F)], axis=-1)


def _dq5_0(b):
    d = _f16_from(b[..., :2])
    q = (_unnibble(b[..., 6:]) | (_unhigh(b[..., 2:6]) << 4)).astype(jnp.float32) - 16
    return q * d[..., None]


def _q5_1(x):
    mx = jnp.max(x, axis=-1, keepdims=True)
    mn = jnp.min(x, axis=-1, keepdims=True)
    d = (mx - mn) / jnp.float32(31)
    q = _trunc_u8(_product(x - mn, _inverse(d)) + jnp.float32(0.5), 31)
    return jnp.concatenate([_f16_bytes(d[..., 0]), _f16_bytes(mn[..., 0]), _high_bits(q), _nibbles(q & 0x0F)], axis=-1)


def _dq5_1(b):
    d, m = _f16_from(b[..., :2]), _f16_from(b[..., 2:4])
    q = (_unnibble(b[..., 8:]) | (_unhigh(b[..., 4:8]) << 4)).astype(jnp.float32)
    return _product(q, d[..., None]) + m[..., None]


_CODECS = {
    "q8_0": (_q8_0, _dq8_0),
    "q4_0": (_q4_0, _dq4_0),
    "q4_1": (_q4_1, _dq4_1),
    "q5_0": (_q5_0, _dq5_0),
    "q5_1": (_q5_1, _dq5_1),
}


def _check(name):
    if name not in QUANT_TYPES:
        raise ValueError(f"{name!r} is not a block-quantized type: allowed {list(QUANT_TYPES)}")


def quantize(x, name: str):
    """Quantize rows ``x [..., D]`` (``D`` a multiple of 32) to ggml blocks ``u8[..., D // 32 * bytes]``.

    Raises:
        ValueError: an unknown type, or ``D`` not a multiple of 32.
    """
    _check(name)
    qt = QUANT_TYPES[name]
    n = x.shape[-1]
    if n % qt.block:
        raise ValueError(f"row size {n} is not a multiple of the {name} block size {qt.block}")
    x = jnp.asarray(x).astype(jnp.float32)
    blocks = x.reshape(x.shape[:-1] + (n // qt.block, qt.block))
    out = _CODECS[name][0](blocks)
    return out.reshape(x.shape[:-1] + (n // qt.block * qt.type_size,))


def dequantize(b, name: str, dtype=jnp.float32):
    """ggml blocks ``u8[..., nb * bytes]`` -> rows ``[..., nb * 32]`` (float32 unless ``dtype``)."""
    _check(name)
    qt = QUANT_TYPES[name]
    nbytes = b.shape[-1]
    if nbytes % qt.type_size:
        raise ValueError(f"row of {nbytes} bytes is not a whole number of {name} blocks ({qt.type_size} bytes)")
    b = jnp.asarray(b)
    blocks = b.reshape(b.shape[:-1] + (nbytes // qt.type_size, qt.type_size))
    out = _CODECS[name][1](blocks)
    return out.reshape(b.shape[:-1] + (nbytes // qt.type_size * qt.block,)).astype(dtype)


def to_storage(x, name: str):
    """Rows ``[..., D]`` in storage form: quantized blocks for a block type, else cast to ``name``."""
    return quantize(x, name) if name in QUANT_TYPES else x.astype(jnp.dtype(name))


def from_storage(x, name: str, dtype=jnp.float32):
    """Storage rows back to values ``[..., D]`` in ``dtype`` (dequantized for a block type)."""
    if name in QUANT_TYPES:
        return dequantize(x, name, dtype)
    if x.dtype == jnp.float16 and jnp.dtype(dtype) == jnp.float32 and jax.default_backend() == "cpu":
        return float16_to_float32(x)
    return x.astype(dtype)


def float16_to_float32(x: jax.Array) -> jax.Array:
    """``x.astype(float32)`` for float16 ``x``, exactly (zeros, subnormals, inf and NaN included), in integer ops.

    XLA:CPU's own conversion took about twice the time of a plain copy of the same block (an
    ``[8, 1024, 32]`` chunk: 83-109 µs against 39-47 µs; attention converts every chunk it reads),
    while these shifts and selects run as fast as the copy. A normal number moves its exponent from
    bias 15 to bias 127 (add 112 << 23 to the shifted bits); a subnormal (or zero) is its 10-bit
    mantissa times 2**-24, computed as a float32 product, which is exact and normal (a
    float32-denormal intermediate would be flushed to zero by the CPU); inf and NaN keep an
    all-ones exponent.

    Example:
        >>> x = jnp.array([1.0, -2.5, 6e-8, -0.0, 65504.0, -jnp.inf, jnp.nan], jnp.float16)
        >>> float16_to_float32(x).tolist()
        [1.0, -2.5, 5.960464477539063e-08, -0.0, 65504.0, -inf, nan]
    """
    u = jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    exponent, mantissa = u & 0x7C00, u & 0x03FF
    normal = ((u & 0x7FFF) << 13) + (112 << 23)
    special = jnp.uint32(0x7F800000) | (mantissa << 13)
    small = jax.lax.bitcast_convert_type(mantissa.astype(jnp.float32) * jnp.float32(2.0**-24), jnp.uint32)
    bits = jnp.where(exponent == 0, small, jnp.where(exponent == 0x7C00, special, normal))
    return jax.lax.bitcast_convert_type(bits | ((u & 0x8000) << 16), jnp.float32)
