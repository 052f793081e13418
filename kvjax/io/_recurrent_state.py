"""The seed's state format for the recurrent memory (``llama_kv_cache_recurrent::state_write``).

The blob has the unified cache's shape (``kvjax.testing`` ``state_layout()`` spells it out):
the cell count, per cell its position and (whole blobs) its sequence ids, ``v_trans = 0``, the
layer count, then per layer the first states (type id, row bytes, one row per cell) and per layer
the second states likewise. A row is one cell's current state, its stored shape flattened in C
order; a model that stores its states in the seed's element order (``kvjax.nn.Mamba`` does) is
byte compatible with llama.cpp.

Not written, as in the seed: the copy sources (none are pending outside a step) and, kvjax's
extension, the older states kept for rollback: a restored cell keeps its current state only.

Where kvjax differs from the seed:

- a failed read raises :class:`kvjax.StateError` naming the field and leaves the memory as it was
  (the seed clears the cache or removes the sequence);
- a single-sequence blob with no cell (what ``state_write`` gives for a sequence without a state)
  reads as "the sequence is empty" (the seed's reader cannot read it);
- a whole blob may name a sequence in one cell only (the seed's check), and every cell must name
  at least one sequence.

Example:
    >>> import kvjax
    >>> cfg = kvjax.RecurrentConfig(size=2, n_seq_max=2, n_layer=1, k_shape=(2,), v_shape=(3,))
    >>> memory, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_equal_ubatch([([0, 1], [0, 1])]))
    >>> blob = kvjax.state_write(memory)
    >>> len(blob)            # 4 + cell (4 + 4 + 2 * 4) + 8 + k (4 + 8 + 8) + v (4 + 8 + 12) = 72
    72
    >>> kvjax.state_write(kvjax.state_read(kvjax.init(cfg), blob)) == blob
    True
"""

from __future__ import annotations

import struct
from typing import List

import jax.numpy as jnp
import numpy as np

from kvjax._errors import StateError
from kvjax.io._blob import (
    Cursor,
    as_view,
    check_equal,
    check_type,
    encode_meta,
    host_array,
    parse_meta_seq,
    parse_meta_whole,
)
from kvjax.memory._protocol import register_state_format
from kvjax.memory import _seqbits
from kvjax.memory._config import GGML_TYPE_IDS
from kvjax.memory._recurrent import RecurrentCache, RecurrentConfig
from kvjax.memory._ubatch import make_equal_ubatch
from kvjax._validate import check_flag, check_state_seq

__all__ = ["write_recurrent", "read_recurrent", "recurrent_blob_size"]


def _layers(config: RecurrentConfig):
    """Per model layer: (group, index in group)."""
    return [config.locate(il) for il in range(config.n_layer)]


def _row_bytes(shape, dtype: str) -> int:
    return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def check_seq(seq_id, config: RecurrentConfig) -> int:
    return check_state_seq(seq_id, config.n_seq_max)


def write_recurrent(memory: RecurrentCache, seq_id: int = -1) -> bytes:
    """The recurrent memory's :func:`kvjax.state_write`: every used cell, or ``seq_id``'s tail cell."""
    cfg = memory.config
    seq_id = check_seq(seq_id, cfg)
    pos = host_array(memory.cells.pos)
    masks = host_array(memory.cells.seq)
    roll = host_array(memory.cells.roll)
    if seq_id < 0:
        cells = np.flatnonzero(masks.any(axis=1))
    else:
        cells = np.flatnonzero(_seqbits.host_holds(masks, seq_id))
    pieces = [
        struct.pack("<I", len(cells)),
        encode_meta(pos[cells], masks[cells] if seq_id < 0 else None, cfg.n_seq_max),
        struct.pack("<II", 0, cfg.n_layer),
    ]
    rows = cells * cfg.n_states + roll[cells]
    for buffers, shapes, dtype in ((memory.k, cfg.k_shape, cfg.k_dtype), (memory.v, cfg.v_shape, cfg.v_dtype)):
        host = [host_array(b[:, rows]) for b in buffers] if len(cells) else None
        for il, (g, i) in enumerate(_layers(cfg)):
            pieces.append(struct.pack("<iQ", GGML_TYPE_IDS[dtype], _row_bytes(shapes[il], dtype)))
            if host is not None:
                pieces.append(np.ascontiguousarray(host[g][i]).tobytes())
    return b"".join(pieces)


def _parse_rows(cur: Cursor, cfg: RecurrentConfig, n: int, which: str) -> List[np.ndarray]:
    shapes, dtype = (cfg.k_shape, cfg.k_dtype) if which == "k" else (cfg.v_shape, cfg.v_dtype)
    out = []
    for il in range(cfg.n_layer):
        check_type(f"layer {il} {which} type", GGML_TYPE_IDS[dtype], cur.scalar("<i", f"layer {il} {which} type"))
        check_equal(
            f"layer {il} {which} row size",
            _row_bytes(shapes[il], dtype),
            cur.scalar("<Q", f"layer {il} {which} row size"),
            f" bytes ({dtype} {list(shapes[il])})",
        )
        raw = cur.array(np.dtype(jnp.dtype(dtype)), n * int(np.prod(shapes[il])), f"layer {il} {which} rows")
        out.append(raw.reshape((n,) + shapes[il]))
    return out


def read_recurrent(
    memory: RecurrentCache, data, seq_id: int = -1, *, contiguous: bool = True, donate: bool = False
) -> RecurrentCache:
    """The recurrent memory's :func:`kvjax.state_read` (see the module docstring for the rules).

    With ``seq_id = -1`` the memory is emptied and blob cell ``i`` goes to cell ``i``; with
    ``seq_id >= 0`` the sequence's state is replaced by the blob's single cell, placed as a
    one-token ubatch would be. Restored cells keep one state (``hist = 1``). ``contiguous`` and
    ``donate`` are accepted for symmetry with the other memories and change nothing (a sequence's
    state is one cell; states are small).

    Raises:
        kvjax.StateError: the blob does not fit this memory (the field, expected and found value
            are named); the memory passed in is unchanged.
    """
    cfg = memory.config
    seq_id = check_seq(seq_id, cfg)
    check_flag("contiguous", contiguous)
    check_flag("donate", donate)
    pos, masks, k_rows, v_rows, _ = _parse(cfg, as_view(data), seq_id, trailing=False)
    if seq_id < 0:
        return _read_whole(memory, pos, masks, k_rows, v_rows)
    return _read_seq(memory, seq_id, pos, k_rows, v_rows)


def _parse(cfg: RecurrentConfig, view, seq_id: int, trailing: bool):
    """Every field of a blob checked: ``(pos, masks or None, k_rows, v_rows, bytes read)``."""
    cur = Cursor(view)
    n = cur.scalar("<I", "cell_count")
    masks = None
    if seq_id < 0:
        if n > cfg.size:
            raise StateError(f"cell_count: expected at most size={cfg.size}, found {n}")
        pos, masks = parse_meta_whole(cur, n, cfg.n_seq_max, _seqbits.n_words(cfg.n_seq_max))
        members = _seqbits.unpack(masks, cfg.n_seq_max) if n else np.zeros((0, cfg.n_seq_max), bool)
        twice = np.flatnonzero(members.sum(axis=0) > 1)
        if twice.size:
            raise StateError(
                f"seq id {int(twice[0])}: expected in one cell (a sequence has one state), found in "
                f"{int(members[:, twice[0]].sum())} cells"
            )
    else:
        if n > 1:
            raise StateError(f"cell_count: expected 0 or 1 (a sequence has one state), found {n}")
        pos = parse_meta_seq(cur, n)
    check_equal("v_trans", 0, cur.scalar("<I", "v_trans"), " (recurrent states are never transposed)")
    check_equal("n_layer", cfg.n_layer, cur.scalar("<I", "n_layer"))
    k_rows = _parse_rows(cur, cfg, n, "k")
    v_rows = _parse_rows(cur, cfg, n, "v")
    if not trailing:
        cur.finish()
    return pos, masks, k_rows, v_rows, cur.off


def recurrent_blob_size(memory: RecurrentCache, data, seq_id: int = -1) -> int:
    """Bytes of the recurrent memory's blob at the start of ``data`` (checked as a read checks it)."""
    return _parse(memory.config, as_view(data), check_seq(seq_id, memory.config), trailing=True)[-1]


def _stack(rows: List[np.ndarray], cfg: RecurrentConfig, g: int) -> jnp.ndarray:
    """The rows of group ``g``'s layers, ``[Lg, n, *shape]``."""
    layers = cfg.groups[g].layers
    return jnp.asarray(np.stack([rows[il] for il in layers]))


def _read_whole(memory: RecurrentCache, pos, masks, k_rows, v_rows) -> RecurrentCache:
    cfg = memory.config
    n = len(pos)
    fresh = memory.clear()
    cells = fresh.cells
    members = _seqbits.unpack(masks, cfg.n_seq_max) if n else np.zeros((0, cfg.n_seq_max), bool)
    tail = np.full(cfg.n_seq_max, -1, np.int32)
    for i in range(n):
        tail[members[i]] = i
    cells = cells.replace(
        pos=cells.pos.at[:n].set(jnp.asarray(pos, jnp.int32)),
        seq=cells.seq.at[:n].set(jnp.asarray(masks, jnp.uint32)),
        hist=cells.hist.at[:n].set(1),
        tail=jnp.asarray(tail),
    )
    rows = jnp.arange(n) * cfg.n_states
    ks, vs = [], []
    for g in range(len(cfg.groups)):
        k = jnp.zeros_like(memory.k[g])
        v = jnp.zeros_like(memory.v[g])
        if n:
            k = k.at[:, rows].set(_stack(k_rows, cfg, g).astype(k.dtype))
            v = v.at[:, rows].set(_stack(v_rows, cfg, g).astype(v.dtype))
        ks.append(k)
        vs.append(v)
    return memory.replace(cells=cells, k=tuple(ks), v=tuple(vs))


def _read_seq(memory: RecurrentCache, seq_id: int, pos, k_rows, v_rows) -> RecurrentCache:
    cfg = memory.config
    emptied, _ = memory.seq_rm(np.int32(seq_id), np.int32(-1), np.int32(-1))  # the whole range: never refused
    if not len(pos):
        return emptied
    ub = make_equal_ubatch([([int(pos[0])], [seq_id])], n_slots=1)
    placed, placement, ok = emptied.find_slot(ub)
    if not bool(ok):
        raise StateError(
            f"cell_count: expected a free cell for sequence {seq_id}, found none of size={cfg.size} "
            f"free (remove a sequence first)"
        )
    placed = placed.copy_rows(placement, n_slots=1)
    for g in range(len(cfg.groups)):
        k_new = _stack(k_rows, cfg, g)[:, :, None]  # [Lg, 1 slot, 1 state, *shape]
        v_new = _stack(v_rows, cfg, g)[:, :, None]
        placed = placed.write_states(placement, k_new, v_new, group=g)
    return placed


register_state_format(RecurrentCache, write=write_recurrent, read=read_recurrent, size=recurrent_blob_size)
