"""Reading a GGUF file: its metadata and its tensor index, checked, in one pass over the mapped bytes.

:func:`_open` returns a :class:`GGUFFile` (``fields``: every metadata key and its value, arrays as
lists; ``tensors``: name, dims, ggml type and the tensor's bytes as a read-only memory map) and
refuses, with a ``ValueError`` naming the file and the problem, anything that is not a version 2 or
3 GGUF, is cut short (in the header or the tensor data), names a ggml type id this build does not
know, or has a tensor whose row does not hold whole blocks of its type. Nothing is read from the
tensor data until a caller asks. :func:`_field` reads one metadata key (optionally required, with an
error that says which writer always sets it).

Why not ``gguf.GGUFReader``: it maps every element of every metadata array as a numpy view of its
own, which for a 262,144-token vocabulary (Gemma 3) is over half a million views and about ten
seconds before the first tensor is touched; this reader parses the same bytes (the format of
``gguf-py``'s writer and ``ggml/src/gguf.cpp``) in a fraction of a second. The ``gguf`` package
is still what dequantizes tensors at load and what the tests write files with.
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any, Dict, List, NamedTuple, Tuple

import numpy as np

from kvjax._ggml_blocks import REFUSED_TYPES, WEIGHT_TYPES

__all__ = ["GGUFFile", "GGUFTensor"]

#: metadata value types (``enum gguf_type``) of fixed size -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
#: array element types read in one numpy call
_ARRAYS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
#: every ggml type id -> (name, values per block, bytes per block), the non-weight types included
_TYPE_IDS: Dict[int, Tuple[str, int, int]] = {
    **{t.ggml_id: (name, t.block, t.type_size) for name, t in WEIGHT_TYPES.items()},
    9: ("Q8_1", 32, 40),
    15: ("Q8_K", 256, 292),
    41: ("Q1_0", 128, 18),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
}
assert {name for name, _, _ in _TYPE_IDS.values()} == set(WEIGHT_TYPES) | set(REFUSED_TYPES)
#: how a tensor's bytes are viewed: the float types as their values, every block type as bytes
_VIEW = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file.

    Attributes:
        name: its name (``"blk.0.attn_q.weight"``).
        shape: its dims as GGUF stores them, ``ne0`` (the row) first.
        tensor_type: the ggml type id (:data:`kvjax._ggml_blocks.WEIGHT_TYPES`).
        type_name: that type's name (``"Q4_K"``).
        data_offset: where its bytes start in the file.
        n_bytes: how many bytes it has.
        data: its bytes, read-only and memory-mapped, in numpy order: ``float32 / float16
            [..., ne0]`` for F32 / F16 (as ``gguf.GGUFReader`` gives them), ``uint8 [..., row bytes]``
            for every block type and BF16.
    """

    name: str
    shape: Tuple[int, ...]
    tensor_type: int
    type_name: str
    data_offset: int
    n_bytes: int
    data: np.ndarray


class GGUFFile(NamedTuple):
    """A parsed GGUF file: ``fields`` (key -> value) and ``tensors`` (in file order)."""

    path: str
    version: int
    fields: Dict[str, Any]
    tensors: List[GGUFTensor]


class _Cursor:
    """Little-endian reads from the mapped bytes, refusing any that run past the end."""

    def __init__(self, data):
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        value = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def text(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.data):
            raise struct.error(f"a string of {n} bytes runs past the end of the file")
        raw = bytes(self.data[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.text()
        if vtype == _ARRAY:
            etype, count = self.take("<I"), self.take("<Q")
            if etype == _STRING:
                return [self.text() for _ in range(count)]
            if etype in _ARRAYS:
                dtype = np.dtype(_ARRAYS[etype])
                end = self.pos + count * dtype.itemsize
                if end > len(self.data):
                    raise struct.error(f"an array of {count} values runs past the end of the file")
                out = np.frombuffer(self.data, dtype, count, self.pos).tolist()
                self.pos = end
                return out
            return [self.value(etype) for _ in range(count)]
        raise ValueError(f"metadata value type {vtype} is not a GGUF type (0..12)")


def _gguf():
    """The ``gguf`` package (its numpy dequantizers), or an ``ImportError`` that says how to get it."""
    try:
        import gguf
    except ImportError as e:  # an optional dependency: say which package brings it
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf


def _tensor_info(cur: _Cursor, name: str, where: str):
    n_dims = cur.take("<I")
    if not 1 <= n_dims <= 4:
        raise ValueError(f"{where} has tensor {name!r} of {n_dims} dims: allowed 1..4 (ggml's GGML_MAX_DIMS)")
    dims = tuple(cur.take("<Q") for _ in range(n_dims))
    type_id, offset = cur.take("<I"), cur.take("<Q")
    if type_id not in _TYPE_IDS:
        raise ValueError(
            f"{where} has tensor {name!r} of an unknown ggml type id {type_id}: allowed the types of "
            f"ggml's enum ggml_type, of which kvjax loads {', '.join(WEIGHT_TYPES)}"
        )
    return dims, type_id, offset


def _open(path, *, tensors: bool = True) -> GGUFFile:
    """The :class:`GGUFFile` at ``path`` (``tensors=False``: the metadata only), or a ``ValueError``."""
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if not os.path.isfile(path):
        raise ValueError(f"path={os.fspath(path)!r} is not a file: allowed the path of a GGUF file")
    where = repr(os.fspath(path))
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            data = b""
    cur = _Cursor(data)
    try:
        if bytes(data[:4]) != b"GGUF":
            raise ValueError("bad magic")
        cur.pos = 4
        version = cur.take("<I")
        if version not in (2, 3):
            raise ValueError(f"version {version}: allowed 2 or 3")
        n_tensors, n_fields = cur.take("<Q"), cur.take("<Q")
        fields = {}
        for _ in range(n_fields):
            key = cur.text()
            fields[key] = cur.value(cur.take("<I"))
        infos = []
        if tensors:
            for _ in range(n_tensors):
                name = cur.text()
                infos.append((name,) + _tensor_info(cur, name, where))
        header_end = cur.pos
    except (struct.error, UnicodeDecodeError, OverflowError, MemoryError) as e:
        raise ValueError(
            f"{where} is not a readable GGUF file (cut short or corrupt: {type(e).__name__}: {e})"
        ) from None
    except ValueError as e:
        if str(e).startswith(where):
            raise
        raise ValueError(f"{where} is not a readable GGUF file ({e})") from None
    alignment = fields.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"{where} has general.alignment={alignment!r}: allowed a power of two")
    start = -(-header_end // alignment) * alignment
    out = []
    for name, dims, type_id, offset in infos:
        type_name, block, type_size = _TYPE_IDS[type_id]
        if dims[0] % block:
            raise ValueError(
                f"{where} has tensor {name!r} with rows of {dims[0]} values: allowed a multiple of "
                f"{type_name}'s block of {block} values"
            )
        row = dims[0] // block * type_size
        rows = int(np.prod(dims[1:], dtype=np.int64))
        begin, n_bytes = start + offset, row * rows
        if begin + n_bytes > len(data):
            raise ValueError(
                f"{where} is truncated: tensor {name!r} needs bytes [{begin}, {begin + n_bytes}) "
                f"of a {len(data)}-byte file"
            )
        view = np.frombuffer(data, np.uint8, n_bytes, begin)
        numpy_shape = tuple(reversed(dims[1:]))
        if type_name in _VIEW:
            view = view.view(_VIEW[type_name]).reshape(numpy_shape + (dims[0],))
        else:
            view = view.reshape(numpy_shape + (row,))
        out.append(GGUFTensor(name, dims, type_id, type_name, begin, n_bytes, view))
    return GGUFFile(os.fspath(path), version, fields, out)


def _field(reader, key: str, default=None, *, required: bool = False):
    """Metadata ``key`` of a :class:`GGUFFile` (or its ``fields``), ``default`` when absent."""
    fields = reader.fields if isinstance(reader, GGUFFile) else reader
    if key not in fields:
        if required:
            raise ValueError(
                f"GGUF metadata lacks {key!r}: allowed a file written by convert_hf_to_gguf.py "
                f"(it always writes this key)"
            )
        return default
    return fields[key]


def head_plan(model) -> list:
    """The embedding, final norm and (untied) output projection under llama.cpp's names, as
    ``(variable, tensor name, transpose, slot)`` (:func:`kvjax.nn._gguf._load`'s plan entries):
    every architecture names them alike."""
    plan = [
        (model.embed.embedding, "token_embd.weight", False, (model, "embed")),
        (model.norm.scale, "output_norm.weight", False, None),
    ]
    if model.lm_head is not None:
        plan.append((model.lm_head.kernel, "output.weight", True, (model, "lm_head")))
    return plan
