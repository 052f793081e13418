"""Opening a GGUF file and reading its metadata: the checks every GGUF reader in kvjax.nn shares.

:func:`_open` maps the file with the ``gguf`` package's reader and refuses a file that is not GGUF
or whose tensor data is cut short, before anything else reads it; :func:`_field` reads one metadata
key (optionally required, with an error that says which writer always sets it).
"""

from __future__ import annotations

import os
from typing import Any

from kvjax._ggml_blocks import WEIGHT_TYPES


def _gguf():
    try:
        import gguf
    except ImportError as e:  # an optional dependency: say which package brings it
        raise ImportError("reading GGUF files needs the 'gguf' package: pip install gguf") from e
    return gguf


def _open(path) -> Any:
    """A ``GGUFReader`` over ``path``, or ``ValueError`` naming the file and what is wrong."""
    gguf = _gguf()
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    if not os.path.isfile(path):
        raise ValueError(f"path={os.fspath(path)!r} is not a file: allowed the path of a GGUF file")
    try:
        reader = gguf.GGUFReader(path, "r")
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, MemoryError) as e:
        if "GGMLQuantizationType" in str(e):  # a type id this gguf package (and so kvjax) does not know
            raise ValueError(f"{os.fspath(path)!r} has a tensor of an unknown ggml type id ({e}): allowed the "
                             f"types of ggml's enum ggml_type, of which kvjax loads "
                             f"{', '.join(WEIGHT_TYPES)}") from None
        raise ValueError(f"{os.fspath(path)!r} is not a readable GGUF file (bad magic or version, or cut short: "
                         f"{type(e).__name__}: {e})") from None
    size = os.path.getsize(path)
    for t in reader.tensors:
        # the reader maps tensor data lazily: a file cut inside the data section shows up here only
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ValueError(f"{os.fspath(path)!r} is truncated: tensor {t.name!r} needs bytes "
                             f"[{t.data_offset}, {t.data_offset + t.n_bytes}) of a {size}-byte file")
    return reader


def _field(reader, key: str, default=None, *, required: bool = False):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise ValueError(f"GGUF metadata lacks {key!r}: allowed a file written by convert_hf_to_gguf.py "
                             f"(it always writes this key)")
        return default
    return field.contents()
