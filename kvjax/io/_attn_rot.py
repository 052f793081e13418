"""llama.cpp's attention rotation: quantized K/V stored in a Walsh-Hadamard basis, converted at the file boundary.

Today's llama.cpp (``llama_kv_cache``'s ``attn_rot_k`` / ``attn_rot_v``) multiplies K (and the
query) by an orthonormal Walsh-Hadamard matrix before K goes into a **block-quantized** cache,
and V likewise (the attention output is rotated back): spreading outliers over a block makes the
Q8_0 / Q4_0 scales fit better, and ``q . k`` is unchanged. It does so when

- K: the K type is block-quantized and every cached layer's K head size is the same multiple of
  64; the matrix has ``n`` rows, the largest power of two from 64 up that divides the head size;
- V: the V type is block-quantized and the V head size is a multiple of 64; ``n = 64``;

each run of ``n`` consecutive values of a head is replaced by ``H_n`` times it (``H_n[i, j] =
(-1)^popcount(i & j) / sqrt(n)``: Sylvester's construction, symmetric, its own inverse). Its
state files hold those rotated blocks, and nothing in them says so (``LLAMA_ATTN_ROT_DISABLE=1``
turns the rotation off there).

kvjax stores K/V unrotated (its attention, K-shift, defrag and views work on plain rows), so the
llama.cpp file functions convert at the boundary: each quantized K/V row of a section is
dequantized, rotated and quantized again (with ggml's reference quantizer). A rotation is exact;
the re-quantization is not: a quantized cache passing through a file this way changes by about
one quantization step per value (float K/V are never touched, and neither are quantized ones
where llama.cpp does not rotate, e.g. heads of 32 values).

Example:
    >>> import numpy as np
    >>> h = hadamard(4)
    >>> bool(np.allclose(h @ h, np.eye(4))), h[1].tolist()
    (True, [0.5, -0.5, 0.5, -0.5])
"""

from __future__ import annotations

import functools
import struct
from typing import Optional, Tuple

import numpy as np

from kvjax.io._blob import Cursor
from kvjax.io._stream_section import parse_streams
from kvjax.memory._config import CacheConfig
from kvjax.storage import _quant

__all__ = ["hadamard", "rotation_sizes", "rotate_streams", "rotate_section"]

_QUANT_BY_ID = {qt.ggml_id: name for name, qt in _quant.QUANT_TYPES.items()}


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> np.ndarray:
    """The orthonormal Walsh-Hadamard matrix ``f32[n, n]`` (``n`` a power of two) llama.cpp builds."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"n={n} is out of range: allowed a power of two")
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _uniform(values) -> Optional[int]:
    values = set(int(v) for v in values)
    return values.pop() if len(values) == 1 else None


def rotation_sizes(config: CacheConfig) -> Tuple[int, int]:
    """``(n_k, n_v)``: the rotation sizes llama.cpp uses for this cache's K and V (0: not rotated)."""
    cached = config.cached_layers
    n_k = n_v = 0
    if config.mla:
        # a latent (MLA) cache's rows are stored as computed: llama.cpp sets attn_rot_k for them
        # but its buffers hold the latents unrotated (V is a view of those rows), as the session
        # files it wrote show (tests/data/sessions/deepseek-q8_0.*, llama-cpp-python 0.3.36)
        return 0, 0
    head_k = _uniform(config.head_dim[il] for il in cached)
    if _quant.is_quantized(config.k_dtype) and head_k and head_k % 64 == 0:
        n_k = 64
        while head_k % (2 * n_k) == 0:
            n_k *= 2
    head_v = _uniform(config.head_dim_v[il] for il in cached)
    if _quant.is_quantized(config.v_dtype) and head_v and head_v % 64 == 0:
        n_v = 64
    return n_k, n_v


def _rotatable(type_id: int, row: int, n_rot: int) -> bool:
    """A block-quantized row whose values split into runs of ``n_rot`` (else the reader refuses it)."""
    if not n_rot or type_id not in _QUANT_BY_ID:
        return False
    qt = _quant.QUANT_TYPES[_QUANT_BY_ID[type_id]]
    return row % qt.type_size == 0 and (row // qt.type_size * qt.block) % n_rot == 0


def _rotate_rows(rows: memoryview, n_cells: int, name: str, n_rot: int) -> bytes:
    """Quantized rows ``u8[n_cells, row]`` with every run of ``n_rot`` values rotated."""
    raw = np.frombuffer(rows, np.uint8).reshape(n_cells, -1)
    values = np.asarray(_quant.dequantize(raw, name), np.float32)
    turned = (values.reshape(n_cells, -1, n_rot) @ hadamard(n_rot)).reshape(values.shape)
    return np.asarray(_quant.quantize(turned, name), np.uint8).tobytes()


def _rotate_data(data: memoryview, n_cells: int, n_k: int, n_v: int, has_v: bool = True) -> bytes:
    """One stream's data section (``v_trans, n_layer``, K rows, V rows unless a latent cache's:
    ``has_v=False``) with its quantized rows rotated."""
    out = bytearray(data)
    v_trans, n_layer = struct.unpack_from("<II", data)
    off = 8
    for il in range(n_layer):
        k_type, k_row = struct.unpack_from("<iQ", data, off)
        off += 12
        if _rotatable(k_type, k_row, n_k):
            out[off : off + k_row * n_cells] = _rotate_rows(
                data[off : off + k_row * n_cells], n_cells, _QUANT_BY_ID[k_type], n_k
            )
        off += k_row * n_cells
    for il in range(n_layer if has_v else 0):
        v_type = struct.unpack_from("<i", data, off)[0]
        if v_trans:  # a transposed V is never block-quantized (ggml's blocks run along a row)
            el, width = struct.unpack_from("<II", data, off + 4)
            off += 12 + el * width * n_cells
            continue
        v_row = struct.unpack_from("<Q", data, off + 4)[0]
        off += 12
        if _rotatable(v_type, v_row, n_v):
            out[off : off + v_row * n_cells] = _rotate_rows(
                data[off : off + v_row * n_cells], n_cells, _QUANT_BY_ID[v_type], n_v
            )
        off += v_row * n_cells
    return bytes(out)


def rotate_streams(streams, config: CacheConfig) -> None:
    """Apply (or undo: the matrices are involutions) llama.cpp's rotation to the quantized K/V rows
    of parsed streams (``kvjax.io._stream_section.Stream``), in place.

    Rows of another type or size than ``config``'s rotation expects are left as they are, for the
    reader to refuse.
    """
    n_k, n_v = rotation_sizes(config)
    if n_k or n_v:
        for st in streams:
            st.data = memoryview(_rotate_data(st.data, st.n, n_k, n_v, not config.mla))


def rotate_section(blob, config: CacheConfig) -> bytes:
    """A unified cache's memory section (``n_stream``, then each stream) with :func:`rotate_streams` applied."""
    if not any(rotation_sizes(config)):
        return bytes(blob)
    r = Cursor(blob)
    streams = parse_streams(r, single=False, has_v=not config.mla)
    out = bytearray(r.buf[: r.off])
    starts = [st.offset for st in streams]
    rotate_streams(streams, config)
    for start, st in zip(starts, streams):
        out[start : start + len(st.data)] = st.data
    return bytes(out)
