"""The recurrent-state memory: one fixed-size state per sequence (the seed's third memory).

State-space and linear-attention layers (Mamba, RWKV, the recurrent layers of hybrids) keep one
state per sequence instead of one K/V row per token. The seed's ``llama_kv_cache_recurrent``
manages those states with the sequence operations of the KV cache; :class:`RecurrentCache` is that
memory as a pytree, every operation a pure function (the cell logic is in
:mod:`kvjax.memory._recurrent_slots`, the rules in :mod:`kvjax.testing` ``RecurrentRef``, its
pure-Python model, which the property tests compare with cell by cell).

**Cells.** A cell holds one state: ``pos`` (the last position folded into it, -1 when empty), the
sequences whose current state it is (several after ``seq_cp``, which shares instead of copying),
and ``tail[seq]`` names the cell of each sequence. The seed's ``src`` (where a cell's state must be
read from before the next ubatch) only differs from the cell itself between a placement and the
step that consumes it, so kvjax keeps it in the :class:`RecurrentPlacement` (``s_copy``) rather
than in the cells: a used cell's ``src`` is itself, an empty cell's -1 (``kvjax.cell_table``
shows it that way).

**Rows.** The state buffers have ``k`` rows per cell (``n_states``; the seed keeps 1): row
``cell * k + j`` holds the state after position ``pos - j`` for ``j < hist`` of the cell, counted
from ``roll`` (see the reference's docstring for the exact rule). Keeping ``k > 1`` states lets
``seq_rm(seq, p, -1)`` roll a sequence back by up to ``k - 1`` tokens (speculative decoding); it
costs ``k`` times the state bytes and, per ubatch, the step writes ``k`` rows per sequence.

**Buffers.** Per layer group (layers whose state shapes agree) ``k[g]: [Lg, R, *k_shape]`` (the
seed's ``k_l``: Mamba's convolution window) and ``v[g]: [Lg, R, *v_shape]`` (``v_l``: the SSM
state), ``R = size * n_states``.

Example:
    >>> import kvjax
    >>> cfg = kvjax.RecurrentConfig(size=4, n_seq_max=4, n_layer=2, k_shape=(3, 8), v_shape=(8, 4))
    >>> memory = kvjax.init(cfg)
    >>> memory.k[0].shape, memory.v[0].shape, memory.nbytes()
    ((2, 4, 3, 8), (2, 4, 8, 4), 1792)
    >>> ub = kvjax.make_equal_ubatch([([0, 1, 2], [0]), ([0, 1, 2], [1])])
    >>> memory, placement, ok = kvjax.find_slot(memory, ub)
    >>> memory = kvjax.seq_cp(memory, 0, 2)                  # shares cell 0, copies nothing
    >>> [int(kvjax.seq_pos_max(memory, s)) for s in range(3)], int(kvjax.used_cells(memory))
    ([2, 2, 2], 2)
    >>> memory, ok = kvjax.seq_rm(memory, 0, 1, -1)          # cutting a state in the middle: refused
    >>> bool(ok)
    False
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._errors import ErrorFlag
from kvjax._typing import Array, Bool, Int, UInt32
from kvjax.memory import _seqbits
from kvjax.memory._config import FLOAT_DTYPES, MAX_LAYERS, MAX_SEQ
from kvjax.memory._protocol import Memory, not_defined
from kvjax._validate import POS_END, is_int, require

__all__ = ["RecurrentConfig", "RecurrentGroup", "RecurrentCells", "RecurrentPlacement", "RecurrentCache",
           "init_recurrent", "moving_rows_bound"]

_I32_MAX = 2**31 - 1

#: Largest number of floats of one state row per layer accepted (a typo must not allocate terabytes).
MAX_STATE_FLOATS = 2**26


def _shape(name: str, value) -> Tuple[int, ...]:
    if is_int(value):
        value = (int(value),)
    try:
        shape = tuple(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is out of range: allowed a shape (a tuple of positive integers)") from None
    require(len(shape) >= 1 and all(is_int(d) and d >= 1 for d in shape), name, value,
             "a shape: a non-empty tuple of positive integers")
    require(math.prod(shape) <= MAX_STATE_FLOATS, name, value, f"at most {MAX_STATE_FLOATS} values per row")
    return tuple(int(d) for d in shape)


def _per_layer_shapes(name: str, value, n_layer: int) -> Tuple[Tuple[int, ...], ...]:
    """One shape for every layer, or a tuple of one shape per layer."""
    if is_int(value) or (isinstance(value, (tuple, list)) and value and all(is_int(d) for d in value)):
        return (_shape(name, value),) * n_layer
    try:
        shapes = tuple(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is out of range: allowed a shape or one shape per layer") from None
    if len(shapes) != n_layer:
        raise ValueError(f"{name} has {len(shapes)} shapes: allowed one shape, or one per layer (n_layer={n_layer})")
    return tuple(_shape(f"{name}[{i}]", s) for i, s in enumerate(shapes))


class RecurrentGroup(struct.PyTreeNode):
    """Layers whose states have the same shapes: stored stacked, ``[Lg, R, *shape]``."""

    layers: Tuple[int, ...] = struct.field(pytree_node=False)
    k_shape: Tuple[int, ...] = struct.field(pytree_node=False)
    v_shape: Tuple[int, ...] = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent-state memory's description (frozen, hashable, validated on construction).

    Attributes:
        size: C, number of state cells (the seed uses ``max(1, n_seq_max)``: one per sequence).
        n_seq_max: S, number of sequence ids, 1 to 1024.
        n_layer: number of layers with a state.
        k_shape: shape of one cell's first state per layer (the seed's ``k_l`` row: Mamba's
            convolution window ``(d_conv - 1, d_inner)``); one shape, or one per layer.
        v_shape: shape of the second state (``v_l``: Mamba's SSM state ``(d_inner, d_state)``).
        k_dtype: storage dtype of the first state (``"float32"``, ``"float16"``, ``"bfloat16"``).
        v_dtype: storage dtype of the second state.
        n_states: k, states kept per sequence (1 is the seed): ``k - 1`` tokens can be rolled back.

    Example:
        >>> cfg = RecurrentConfig(size=2, n_seq_max=2, n_layer=3, k_shape=(3, 16), v_shape=(16, 4))
        >>> cfg.rows, [g.layers for g in cfg.groups], cfg.n_embd_k_s(0), cfg.n_embd_v_s(0)
        (2, [(0, 1, 2)], 48, 64)
    """

    size: int
    n_seq_max: int
    n_layer: int
    k_shape: Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]
    v_shape: Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]
    k_dtype: str = "float32"
    v_dtype: str = "float32"
    n_states: int = 1

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        require(is_int(self.size) and 1 <= self.size <= 2**20, "size", self.size, "an integer in [1, 2**20]")
        require(is_int(self.n_seq_max) and 1 <= self.n_seq_max <= MAX_SEQ, "n_seq_max", self.n_seq_max,
                 f"an integer in [1, {MAX_SEQ}]")
        require(is_int(self.n_layer) and 1 <= self.n_layer <= MAX_LAYERS, "n_layer", self.n_layer,
                 f"an integer in [1, {MAX_LAYERS}]")
        require(is_int(self.n_states) and 1 <= self.n_states <= 64, "n_states", self.n_states,
                 "an integer in [1, 64]")
        for name in ("size", "n_seq_max", "n_layer", "n_states"):
            set_(name, int(getattr(self, name)))
        set_("k_shape", _per_layer_shapes("k_shape", self.k_shape, self.n_layer))
        set_("v_shape", _per_layer_shapes("v_shape", self.v_shape, self.n_layer))
        for name in ("k_dtype", "v_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and _dtype_like(value):
                value = jnp.dtype(value).name
            require(isinstance(value, str) and value in FLOAT_DTYPES, name, getattr(self, name),
                     f"one of {list(FLOAT_DTYPES)}")
            set_(name, value)
        require(self.size * self.n_states <= 2**24, "n_states", self.n_states,
                 f"at most {2**24 // self.size} with size={self.size} (2**24 rows)")

    @property
    def rows(self) -> int:
        """R, state rows per layer: ``size * n_states``."""
        return self.size * self.n_states

    @property
    def groups(self) -> Tuple[RecurrentGroup, ...]:
        """Layers grouped by their two state shapes, in order of first appearance."""
        order = {}
        for il in range(self.n_layer):
            order.setdefault((self.k_shape[il], self.v_shape[il]), []).append(il)
        return tuple(RecurrentGroup(layers=tuple(ls), k_shape=ks, v_shape=vs) for (ks, vs), ls in order.items())

    def locate(self, layer: int) -> Tuple[int, int]:
        """``(group, index in group)`` of layer ``layer``."""
        require(is_int(layer) and 0 <= layer < self.n_layer, "layer", layer, f"[0, {self.n_layer})")
        for g, grp in enumerate(self.groups):
            if layer in grp.layers:
                return g, grp.layers.index(layer)
        raise AssertionError(layer)

    def n_embd_k_s(self, layer: int) -> int:
        """Values of one cell's first state in ``layer`` (the seed's ``n_embd_k_s``)."""
        return math.prod(self.k_shape[layer])

    def n_embd_v_s(self, layer: int) -> int:
        """Values of one cell's second state in ``layer`` (the seed's ``n_embd_v_s``)."""
        return math.prod(self.v_shape[layer])

    def nbytes(self) -> int:
        """Bytes of the two state buffers (metadata not included)."""
        k_item, v_item = jnp.dtype(self.k_dtype).itemsize, jnp.dtype(self.v_dtype).itemsize
        return self.rows * sum(self.n_embd_k_s(il) * k_item + self.n_embd_v_s(il) * v_item
                               for il in range(self.n_layer))


def _dtype_like(value) -> bool:
    try:
        jnp.dtype(value)
        return True
    except TypeError:
        return False


# -- cells ----------------------------------------------------------------------------------------


@struct.dataclass
class RecurrentCells:
    """Metadata of the state cells (see the module docstring).

    Attributes:
        pos: ``i32[C]`` last position folded into each cell's state, -1 when empty.
        seq: ``u32[C, W]`` bitmask of the sequences whose state the cell is.
        roll: ``i32[C]`` the row (of the cell's ``k``) holding the current state; moved by a rollback.
        hist: ``i32[C]`` states kept, counted from ``roll`` (0 when empty).
        tail: ``i32[S]`` the cell of each sequence, -1 when it has none.
        head: ``i32[]`` where the search for an empty cell starts.
        error: ``u32[]`` sticky :class:`kvjax.ErrorFlag` bits set by traced calls.
        n_seq_max: static S.
    """

    pos: Int[Array, " C"]
    seq: UInt32[Array, "C W"]
    roll: Int[Array, " C"]
    hist: Int[Array, " C"]
    tail: Int[Array, " S"]
    head: Int[Array, ""]
    error: UInt32[Array, ""]
    n_seq_max: int = struct.field(pytree_node=False)

    @property
    def size(self) -> int:
        return self.pos.shape[0]

    @property
    def n_words(self) -> int:
        return self.seq.shape[1]


def empty_recurrent_cells(size: int, n_seq_max: int) -> RecurrentCells:
    """Every cell empty, no tails, ``head`` 0."""
    return RecurrentCells(pos=jnp.full((size,), -1, jnp.int32),
                          seq=jnp.zeros((size, _seqbits.n_words(n_seq_max)), jnp.uint32),
                          roll=jnp.zeros((size,), jnp.int32), hist=jnp.zeros((size,), jnp.int32),
                          tail=jnp.full((n_seq_max,), -1, jnp.int32), head=jnp.zeros((), jnp.int32),
                          error=jnp.zeros((), jnp.uint32), n_seq_max=n_seq_max)


@jax.jit
def _cleared(cells: RecurrentCells) -> RecurrentCells:
    """Every cell empty, the error bits kept: one program (seven eager array fills were 0.5-0.8 ms)."""
    return empty_recurrent_cells(cells.size, cells.n_seq_max).replace(error=cells.error)


@struct.dataclass
class RecurrentPlacement:
    """Where an equal-split ubatch went, and what the step must copy first (the seed's graph inputs).

    Slot ``s`` of the ubatch (its ``s``-th sequence) sits in cell ``head + s``. For ``i < n``,
    cell ``head + i`` reads its state from row ``s_copy[i] * k + s_roll[i]`` (the seed's
    ``s_copy``, the row within it kvjax's rollback extension) and starts from zeros where
    ``s_mask[i]`` is false; entries ``i >= n`` are ``-1, 0, False``.

    Attributes:
        head: ``i32[]`` cell of slot 0.
        n: ``i32[]`` cells ``[head, head + n)`` the placement covers (0 when refused); only the rows
            that ``s_copy``/``s_roll`` move are rewritten.
        n_seqs: ``i32[]`` sequences (slots) in the ubatch (0 when refused).
        s_copy: ``i32[C]``.
        s_roll: ``i32[C]``.
        s_mask: ``bool[C]``.
    """

    head: Int[Array, ""]
    n: Int[Array, ""]
    n_seqs: Int[Array, ""]
    s_copy: Int[Array, " C"]
    s_roll: Int[Array, " C"]
    s_mask: Bool[Array, " C"]

    def nothing(self, keep: Bool[Array, ""]) -> "RecurrentPlacement":
        """This placement where ``keep``, else one that copies and writes nothing."""
        return self.replace(n=jnp.where(keep, self.n, 0), n_seqs=jnp.where(keep, self.n_seqs, 0))


def _popcount(words: UInt32[Array, "... W"]) -> Int[Array, "..."]:
    return jnp.sum(jax.lax.population_count(words), axis=-1).astype(jnp.int32)


def _used(cells: RecurrentCells) -> Bool[Array, " C"]:
    return jnp.any(cells.seq != 0, axis=-1)


def _holds(cells: RecurrentCells, seq_id) -> Bool[Array, " C"]:
    """Cells holding ``seq_id``; every used cell for -1; none for another id out of range."""
    member = jnp.any((cells.seq & _seqbits.seq_bits(seq_id, cells.n_words)) != 0, axis=-1)
    return jnp.where(seq_id == -1, _used(cells), member)


def _bounds(p0, p1):
    return jnp.where(p0 < 0, 0, p0), jnp.where(p1 < 0, _I32_MAX, p1)


def _free(cells: RecurrentCells, freed: Bool[Array, " C"]) -> RecurrentCells:
    """Empty the cells in ``freed`` and forget every tail naming one of them."""
    tail_freed = (cells.tail >= 0) & jnp.take(freed, jnp.clip(cells.tail, 0, cells.size - 1))
    return cells.replace(pos=jnp.where(freed, -1, cells.pos),
                         seq=jnp.where(freed[:, None], jnp.uint32(0), cells.seq),
                         roll=jnp.where(freed, 0, cells.roll), hist=jnp.where(freed, 0, cells.hist),
                         tail=jnp.where(tail_freed, -1, cells.tail))


def _head_back(cells: RecurrentCells, old_head, mask: Bool[Array, " C"]) -> RecurrentCells:
    """``head`` moves back to the first cell of ``mask`` when that is before it."""
    first = jnp.argmax(mask).astype(jnp.int32)
    return cells.replace(head=jnp.where(jnp.any(mask) & (first < old_head), first, old_head))


def _guard(old: RecurrentCells, new: RecurrentCells, *checks) -> RecurrentCells:
    """``new`` when every ``(valid, flag)`` holds, else ``old`` with the failed flags raised."""
    ok, error = jnp.bool_(True), old.error
    for valid, flag in checks:
        ok = ok & valid
        error = error | jnp.where(valid, jnp.uint32(0), jnp.uint32(flag))
    kept = jax.tree.map(lambda a, b: jnp.where(ok, b, a), old, new)
    return kept.replace(error=jnp.where(ok, kept.error, error))


def _seq_ok(cells, seq_id, allow_all: bool):
    return (seq_id >= (-1 if allow_all else 0)) & (seq_id < cells.n_seq_max)


def _tail_of(cells: RecurrentCells, seq_id):
    """``(tail cell clipped to a valid index, whether seq_id has one)``."""
    t = jnp.take(cells.tail, jnp.clip(seq_id, 0, cells.n_seq_max - 1))
    has = (seq_id >= 0) & (seq_id < cells.n_seq_max) & (t >= 0)
    return jnp.clip(t, 0, cells.size - 1), has


# -- sequence operations (pure functions of the cells) ------------------------------------------


@jax.jit
def rc_seq_rm(cells: RecurrentCells, seq_id, p0, p1):
    """The seed's ``seq_rm`` with kvjax's rollback: ``(cells, ok)``; a refusal changes nothing."""
    p0, p1 = _bounds(p0, p1)
    t, has_t = _tail_of(cells, seq_id)
    tpos = cells.pos[t]
    cut = has_t & (((0 < p0) & (p0 <= tpos)) | ((0 < p1) & (p1 <= tpos)))
    j = tpos - p0 + 1
    rollback = cut & (0 < p0) & (p0 <= tpos) & (tpos < p1) & (j < cells.hist[t]) & (_popcount(cells.seq[t]) == 1)
    everything_or_nothing = (p0 == p1) | ((p0 == 0) & (p1 == _I32_MAX))
    valid = _seq_ok(cells, seq_id, True)
    refused = (cut & ~rollback) | ((seq_id < 0) & ~everything_or_nothing) | ~valid
    rolled = cells.replace(pos=cells.pos.at[t].set(p0 - 1), roll=cells.roll.at[t].add(j),
                           hist=cells.hist.at[t].add(-j))
    target = (cells.pos >= p0) & (cells.pos < p1) & _holds(cells, seq_id)
    dropped = jnp.where(seq_id < 0, cells.seq, _seqbits.seq_bits(seq_id, cells.n_words))
    seq = jnp.where(target[:, None], cells.seq & ~dropped, cells.seq)
    freed = target & ~jnp.any(seq != 0, axis=-1)
    # a sequence taken out of a cell forgets its tail there (every sequence with seq_id < 0)
    tail_hit = (cells.tail >= 0) & jnp.take(target, jnp.clip(cells.tail, 0, cells.size - 1))
    tail_hit = tail_hit & ((seq_id < 0) | (jnp.arange(cells.n_seq_max) == seq_id))
    removed = cells.replace(seq=seq, tail=jnp.where(tail_hit, -1, cells.tail))
    removed = _head_back(_free(removed, freed), cells.head, freed)
    new = jax.tree.map(lambda a, b: jnp.where(rollback, a, b), rolled, removed)
    out = jax.tree.map(lambda a, b: jnp.where(refused, a, b), cells, new)
    out = out.replace(error=out.error | jnp.where(valid, jnp.uint32(0), jnp.uint32(ErrorFlag.SEQ_ID)))
    return out, ~refused


@jax.jit
def rc_seq_cp(cells: RecurrentCells, src, dst) -> RecurrentCells:
    """``dst`` drops its state and shares ``src``'s tail cell (no bytes move; the range is ignored)."""
    td, has_d = _tail_of(cells, dst)
    dbit = _seqbits.seq_bits(dst, cells.n_words)
    seq = jnp.where(has_d, cells.seq.at[td].set(cells.seq[td] & ~dbit), cells.seq)
    dropped = cells.replace(seq=seq, tail=jnp.where(has_d, cells.tail.at[jnp.clip(dst, 0)].set(-1), cells.tail))
    emptied = has_d & ~jnp.any(seq[td] != 0)
    dropped = _free(dropped, jnp.zeros(cells.size, bool).at[td].set(emptied))
    ts, has_s = _tail_of(dropped, src)
    shared = dropped.replace(seq=dropped.seq.at[ts].set(dropped.seq[ts] | dbit),
                             tail=dropped.tail.at[jnp.clip(dst, 0)].set(ts))
    new = jax.tree.map(lambda a, b: jnp.where(has_s, b, a), dropped, shared)
    new = jax.tree.map(lambda a, b: jnp.where(src == dst, a, b), cells, new)
    return _guard(cells, new, (_seq_ok(cells, src, False) & _seq_ok(cells, dst, False), ErrorFlag.SEQ_ID))


@jax.jit
def rc_seq_keep(cells: RecurrentCells, seq_id) -> RecurrentCells:
    """Only ``seq_id`` stays (-1 keeps everything); ``head`` moves back to the first other cell."""
    keep = _holds(cells, seq_id)
    others = jnp.arange(cells.n_seq_max) != seq_id
    new = cells.replace(tail=jnp.where(others, -1, cells.tail))
    new = _free(new, ~keep)
    new = new.replace(seq=jnp.where(keep[:, None], _seqbits.seq_bits(seq_id, cells.n_words), new.seq))
    new = _head_back(new, cells.head, ~keep)
    new = jax.tree.map(lambda a, b: jnp.where(seq_id < 0, a, b), cells, new)
    return _guard(cells, new, (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID))


def _shifted(cells: RecurrentCells, seq_id, p0, p1) -> Bool[Array, " C"]:
    """The cells a position change of ``seq_id`` moves: its tail cell (every used cell for -1)."""
    in_range = (cells.pos >= p0) & (cells.pos < p1)
    t, has_t = _tail_of(cells, seq_id)
    tail_cell = (jnp.arange(cells.size) == t) & has_t & _holds(cells, seq_id)
    return in_range & jnp.where(seq_id < 0, _used(cells), tail_cell)


@jax.jit
def rc_seq_add(cells: RecurrentCells, seq_id, p0, p1, delta) -> RecurrentCells:
    """Move the state's position by ``delta``; a shift that would move a state below position 0 is
    refused (the cells unchanged, ``ErrorFlag.STATE_SHIFT`` set): see :func:`rc_shift_keeps_states`."""
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1)
    overflow = jnp.any(target & (delta > 0) & (cells.pos >= POS_END - delta))
    moved = cells.replace(pos=jnp.where(target, cells.pos + delta, cells.pos))
    new = jax.tree.map(lambda a, b: jnp.where((delta == 0) | (p0 == p1), a, b), cells, moved)
    return _guard(cells, new, (~overflow, ErrorFlag.OVERFLOW), (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID),
                  (rc_shift_keeps_states(cells, seq_id, p0, p1, delta), ErrorFlag.STATE_SHIFT))


@jax.jit
def rc_shift_keeps_states(cells: RecurrentCells, seq_id, p0, p1, delta):
    """Whether ``seq_add(seq_id, p0, p1, delta)`` leaves every state it moves at a position >= 0.

    A unified cache frees a cell pushed below 0: it held one token. A recurrent cell holds the
    whole sequence so far, and a shift must never delete it (the seed keeps it, at a negative
    position that ``seq_rm`` then cannot reach); kvjax refuses such a shift instead, with nothing changed.
    """
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1) & (delta != 0) & (p0 != p1)
    return ~jnp.any(target & (cells.pos + jnp.minimum(delta, 0) < 0))


@jax.jit
def rc_seq_div(cells: RecurrentCells, seq_id, p0, p1, d) -> RecurrentCells:
    """Divide the state's position by ``d``; only the current state stays valid (``hist`` 1)."""
    p0, p1 = _bounds(p0, p1)
    target = _shifted(cells, seq_id, p0, p1) & (d > 1)
    safe_d = jnp.where(d > 0, d, 1)
    new = cells.replace(pos=jnp.where(target, cells.pos // safe_d, cells.pos),
                        hist=jnp.where(target, jnp.minimum(cells.hist, 1), cells.hist))
    return _guard(cells, new, (d > 0, ErrorFlag.DIVISOR), (_seq_ok(cells, seq_id, True), ErrorFlag.SEQ_ID))


@jax.jit
def rc_seq_pos(cells: RecurrentCells, seq_id):
    """``(seq_pos_min, seq_pos_max)`` of ``seq_id`` (-1: any), -1 when absent."""
    hit = _holds(cells, seq_id)
    lo = jnp.min(jnp.where(hit, cells.pos, _I32_MAX))
    hi = jnp.max(jnp.where(hit, cells.pos, -1))
    return jnp.where(jnp.any(hit), lo, -1), hi


@jax.jit
def rc_seq_shared(cells: RecurrentCells, seq_id, p0, p1):
    p0, p1 = _bounds(p0, p1)
    hit = _holds(cells, seq_id) & (cells.pos >= p0) & (cells.pos < p1)
    return jnp.any(hit & (_popcount(cells.seq) > 1))


# -- the memory -------------------------------------------------------------------------------------


@struct.dataclass
class RecurrentCache(Memory):
    """An immutable recurrent-state memory (see the module docstring).

    Attributes:
        cells: :class:`RecurrentCells`.
        k: per layer group, ``[Lg, R, *k_shape]`` first states (Mamba: convolution windows).
        v: per layer group, ``[Lg, R, *v_shape]`` second states (Mamba: SSM states).
        config: the static :class:`RecurrentConfig`.
    """

    cells: RecurrentCells
    k: Tuple[Array, ...]
    v: Tuple[Array, ...]
    config: RecurrentConfig = struct.field(pytree_node=False)

    @property
    def n_seq_max(self) -> int:
        return self.config.n_seq_max

    @property
    def size(self) -> int:
        return self.config.size

    @property
    def ubatch_split(self) -> str:
        # every ubatch holds the same number of tokens of each of its sequences (the seed's split_equal)
        return "equal"

    @property
    def max_context(self):
        return None

    @property
    def rollback_depth(self):
        return self.config.n_states - 1

    def share_prefix(self, src: int, dst: int, n: int):
        return share_state_prefix(self, src, dst, n)

    @property
    def max_slots(self) -> int:
        """Most sequences one ubatch can hold: one cell each."""
        return self.config.size

    def _with(self, cells: RecurrentCells) -> "RecurrentCache":
        return self.replace(cells=cells)

    # -- sequences ---------------------------------------------------------------------------------

    def clear(self) -> "RecurrentCache":
        return self._with(_cleared(self.cells))

    def seq_rm(self, seq_id, p0, p1):
        cells, ok = rc_seq_rm(self.cells, seq_id, p0, p1)
        return self._with(cells), ok

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1) -> "RecurrentCache":
        del p0, p1  # a state cannot be split: the whole state is shared, as in the seed
        return self._with(rc_seq_cp(self.cells, seq_id_src, seq_id_dst))

    def seq_keep(self, seq_id) -> "RecurrentCache":
        return self._with(rc_seq_keep(self.cells, seq_id))

    def seq_add(self, seq_id, p0, p1, delta) -> "RecurrentCache":
        return self._with(rc_seq_add(self.cells, seq_id, p0, p1, delta))

    def shift_keeps_states(self, seq_id, p0, p1, delta):
        """Whether :meth:`seq_add` with these arguments moves no state below position 0 (else it refuses)."""
        return rc_shift_keeps_states(self.cells, seq_id, p0, p1, delta)

    def seq_div(self, seq_id, p0, p1, d) -> "RecurrentCache":
        return self._with(rc_seq_div(self.cells, seq_id, p0, p1, d))

    def seq_pos_min(self, seq_id):
        return rc_seq_pos(self.cells, seq_id)[0]

    def seq_pos_max(self, seq_id):
        return rc_seq_pos(self.cells, seq_id)[1]

    def seq_shared(self, seq_id, p0, p1):
        return rc_seq_shared(self.cells, seq_id, p0, p1)

    def used_cells(self):
        return jnp.sum(_used(self.cells), dtype=jnp.int32)

    def n_tokens(self):
        return jnp.sum(_popcount(self.cells.seq))

    def pos_max(self):
        return jnp.max(self.cells.pos)

    # -- placement ---------------------------------------------------------------------------------

    def find_slot(self, ubatch, *, contiguous: bool = True):
        from kvjax.memory._recurrent_slots import find_slot_recurrent

        del contiguous  # a recurrent ubatch always goes to consecutive cells (the seed's gather)
        cells, placement, ok = find_slot_recurrent(self.cells, ubatch, self.config.n_states)
        return self._with(cells), placement, ok

    def mask_placement(self, placement: RecurrentPlacement, ok) -> RecurrentPlacement:
        return placement.nothing(ok)

    # -- no attention parts ----------------------------------------------------------------------------

    @property
    def n_parts(self) -> int:
        return 0

    def layer_part(self, layer: int) -> int:
        raise not_defined(self, "layer_part", "it has no attention layers (its layers read states: "
                                              "kvjax.nn.Mamba)")

    def part(self, index: int):
        raise not_defined(self, "part", "it has no attention parts")

    def with_part(self, index: int, cache):
        raise not_defined(self, "with_part", "it has no attention parts")

    def part_slots(self, placement, index: int):
        raise not_defined(self, "part_slots", "it has no attention parts")

    def extent(self):
        return jnp.zeros((0,), jnp.int32)

    def extent_after(self, n_tokens):
        return jnp.zeros((0,), jnp.int32)

    # -- pending work ---------------------------------------------------------------------------------

    def pending(self):
        # copies are carried by the placement into the step that reads them: nothing waits here
        return jnp.bool_(False)

    def update(self, *, donate: bool = False) -> "RecurrentCache":
        return self

    @property
    def can_shift(self) -> bool:
        # a state has folded its positions in: moving them cannot be undone or redone (the seed's false)
        return False

    # -- the states, for the model step --------------------------------------------------------------------

    def copy_rows(self, placement: RecurrentPlacement, n_slots: int) -> "RecurrentCache":
        """Apply the placement's copies: the rows of cells ``[head, head + n)`` from ``s_copy``/``s_roll``.

        Only the rows that move are touched (none in steady decoding): at most
        :func:`moving_rows_bound` of them, all read into a small temporary before any is written,
        so the buffers are updated in place.

        Args:
            placement: the ubatch's placement (from ``find_slot``).
            n_slots: the ubatch's slot count (static: ``equal_slots(ubatch)[0]``).
        """
        moved, _ = self._move_rows(placement, moving_rows_bound(self.config, n_slots))
        return moved

    def _move_rows(self, placement: RecurrentPlacement, bound: int, slots_rewritten: bool = False,
                   n_slots: int = 0):
        """Copy the moving rows (at most ``bound``), and read the ``n_slots`` slots' states as they
        are after the copies, in the same gather.

        With ``slots_rewritten`` the rows of the slots' cells are not copied (the step rewrites
        them whole). The slots' states are read through the row map, from the rows the slots' rows
        would be copied from, in the gather that reads the moving rows: the scatter depends on it,
        so XLA orders every read before the in-place writes (a read of its own copies the buffers).

        Returns:
            ``(memory, states)``: ``states[g] = (k, v)`` of group ``g`` as :meth:`slot_states` reads
            them; ``()`` when ``n_slots`` is 0.
        """
        kk, rows = self.config.n_states, self.config.rows
        src = _row_sources(placement, self.config)
        moving = src != jnp.arange(rows)
        if slots_rewritten:
            cell = jnp.arange(rows) // kk
            moving = moving & ~((cell >= placement.head) & (cell < placement.head + placement.n_seqs))
        bound = 0 if rows == 1 else bound                                   # a lone row never moves
        dest = jnp.nonzero(moving, size=bound, fill_value=rows)[0]          # rows: dropped below
        reads = jnp.concatenate([jnp.take(src, dest, mode="clip"), jnp.take(src, self._slot_rows(placement, n_slots))])
        if reads.shape[0] == 0:
            return self, ()

        def move(x):
            got = _take_rows(x, reads)
            slots = _started(got[:, bound:], placement, self.size)
            return (_set_rows(x, dest, got[:, :bound]) if bound else x), slots

        k, sk = zip(*map(move, self.k))
        v, sv = zip(*map(move, self.v))
        return self.replace(k=tuple(k), v=tuple(v)), (tuple(zip(sk, sv)) if n_slots else ())

    def slot_states(self, placement: RecurrentPlacement, n_slots: int, group: int = 0):
        """The states the ubatch's ``n_slots`` sequences start from, after :meth:`copy_rows`.

        Returns:
            ``(k [Lg, n_slots, *k_shape], v [Lg, n_slots, *v_shape])``, zeros for a new sequence
            (``s_mask`` false: a select, so a NaN in a reused row cannot leak into it).
        """
        rows = self._slot_rows(placement, n_slots)
        return tuple(_started(_take_rows(x, rows), placement, self.size) for x in (self.k[group], self.v[group]))

    def _slot_rows(self, placement: RecurrentPlacement, n_slots: int) -> Int[Array, " n_slots"]:
        """Row 0 of each slot's cell ``head + s`` (clipped into the buffer for padding slots)."""
        return jnp.clip((placement.head + jnp.arange(n_slots)) * self.config.n_states, 0, self.config.rows - 1)

    def read_states(self, placement: RecurrentPlacement, n_slots: int, n_tokens: int):
        """The states every group's slots start from, and the memory ready for :meth:`write_states`.

        What a model step calls first, cheaper than ``copy_rows`` then ``slot_states`` of each
        group: the states are the same, and so is the memory once the step has called
        :meth:`write_states` for **every layer group with** ``q = min(n_states, n_tokens)``
        **states per slot** (as Mamba and the hybrid do). When that write replaces every row of the
        slots' cells (``n_tokens >= n_states``: every step with the seed's one state per cell; a
        prefill of at least ``n_states`` tokens with rollback), the slots' rows are not copied but
        read from the rows they would be copied from, and only the other moving rows are copied,
        those of at most ``n_slots - 1`` cells (:func:`moving_rows_bound`): none for one sequence,
        whose decode step then reads and writes its own row and nothing else. Otherwise (a decode
        step with ``n_states > 1``, whose write keeps the older rows) it is ``copy_rows`` then
        ``slot_states``.

        Args:
            placement: the ubatch's placement (from ``find_slot``).
            n_slots: the ubatch's slot count (static).
            n_tokens: tokens per slot (static: ``equal_slots(ubatch)[1]``).

        Returns:
            ``(memory, states)``: ``states[g] = (k [Lg, n_slots, *k_shape], v [Lg, n_slots, *v_shape])``
            for each layer group ``g``.
        """
        if n_tokens < self.config.n_states:     # the write keeps older rows of the slots' cells
            moved = self.copy_rows(placement, n_slots)
            return moved, tuple(moved.slot_states(placement, n_slots, g) for g in range(len(self.config.groups)))
        bound = moving_rows_bound(self.config, n_slots, slots_rewritten=True)
        return self._move_rows(placement, bound, slots_rewritten=True, n_slots=n_slots)

    def write_states(self, placement: RecurrentPlacement, k_new, v_new, group: int = 0, *,
                     after=None) -> "RecurrentCache":
        """Store each slot's states after its tokens, keeping the older ones as rollback history.

        Args:
            placement: the ubatch's placement.
            k_new: ``[Lg, n_slots, q, *k_shape]``: the first states after each of the slot's last
                ``q`` tokens, oldest first (``q = min(n_states, n_seq_tokens)``; q = 1: the final
                state only, enough when ``n_states == 1``).
            v_new: ``[Lg, n_slots, q, *v_shape]`` likewise.
            group: the layer group.
            after: an array the write waits for, computed from every read of the old states (a
                model step passes its output). XLA fuses a read into each of its readers and
                overwrites a buffer in place only once every reader is done; readers the write
                does not depend on (the step's output path) make it copy the buffer instead, as a
                one-cell memory's step did (its read is the buffer itself). The write takes a
                test on ``after`` that is always false (``after > inf``), so it depends on every
                reader and changes nothing else. Ignored when empty.

        Row ``j`` of a slot's cell becomes the state after its ``j``-th last token for ``j < q``,
        and its old row ``j - q`` for ``j >= q``; slots past ``n_seqs`` write nothing.
        """
        kk = self.config.n_states
        n_slots, q = k_new.shape[1], k_new.shape[2]
        slot = jnp.arange(n_slots)
        base = (placement.head + slot) * kk                                  # [n_slots]
        active = slot < placement.n_seqs

        def store(x, new):
            new = jnp.flip(new, axis=2).astype(x.dtype)                    # newest first: row 0
            if q < kk:
                old_rows = jnp.clip(base[:, None] + jnp.arange(kk - q)[None], 0, x.shape[1] - 1)
                old = _take_rows(x, old_rows.reshape(-1)).reshape((x.shape[0], n_slots, kk - q) + x.shape[2:])
                new = jnp.concatenate([new, old], axis=2)
            write = active if after is None or not jnp.size(after) else \
                active & ~(jnp.ravel(after)[0].astype(jnp.float32) > jnp.inf)
            rows = jnp.where(write[:, None], base[:, None] + jnp.arange(kk)[None], x.shape[1]).reshape(-1)
            flat = new.reshape((x.shape[0], n_slots * kk) + x.shape[2:])
            return _set_rows(x, rows, flat)

        if q > kk:
            raise ValueError(f"{q} states per slot were given: allowed at most n_states={kk}")
        ks = list(self.k)
        vs = list(self.v)
        ks[group] = store(ks[group], k_new)
        vs[group] = store(vs[group], v_new)
        return self.replace(k=tuple(ks), v=tuple(vs))

    # -- placement on a device mesh ---------------------------------------------------------------------

    def logical_axes(self) -> "RecurrentCache":
        # states are [Lg, R, *shape]; a placement may move any cell's rows to another cell
        # (copy_rows), so the default rules keep them whole; cell metadata and tails likewise
        from jax.sharding import PartitionSpec as P
        from kvjax._axes import CELLS, SEQ_WORDS, SEQS, scalar_axes, state_axes

        c = self.cells
        cells = c.replace(pos=P(CELLS), seq=P(CELLS, SEQ_WORDS), roll=P(CELLS), hist=P(CELLS), tail=P(SEQS),
                          head=scalar_axes(), error=scalar_axes())
        return self.replace(cells=cells, k=tuple(state_axes(x.ndim - 2) for x in self.k),
                            v=tuple(state_axes(x.ndim - 2) for x in self.v))

    # -- donation, errors, sizes, state ------------------------------------------------------------------

    def split(self):
        return (self.k, self.v), self.replace(k=(), v=())

    def join(self, buffers) -> "RecurrentCache":
        k, v = buffers
        return self.replace(k=tuple(k), v=tuple(v))

    def error_bits(self):
        return self.cells.error

    def clear_errors(self) -> "RecurrentCache":
        return self._with(self.cells.replace(error=self.cells.error & jnp.uint32(0)))  # stays where it was

    def flag_errors(self, bits) -> "RecurrentCache":
        return self._with(self.cells.replace(error=self.cells.error | jnp.asarray(bits, jnp.uint32)))

    def nbytes(self) -> int:
        return self.config.nbytes()


def share_state_prefix(memory: Memory, src: int, dst: int, n: int, attention_ok: bool = True):
    """``share_prefix`` for a memory with recurrent states (the recurrent memory, the hybrid).

    A state covers every token up to its position, so ``dst`` can start from ``src``'s state only
    at a position a state was kept for: the whole state (``n`` = its length; shared with
    ``seq_cp``, copied on write later), or a kept older state (``n`` within the last
    ``rollback_depth`` positions): then ``src`` is consumed (its state becomes ``dst``'s and is
    rolled back to ``n``), because a shared state cannot be rolled back.
    """
    length = int(memory.seq_pos_max(np.int32(src))) + 1
    if n <= 0 or length <= 0 or n > length or not attention_ok:
        return memory, 0, False
    src_, dst_, all_ = np.int32(src), np.int32(dst), np.int32(-1)
    shared = memory.seq_cp(src_, dst_, all_, all_)
    if n == length:
        return shared, n, False
    if length - n > (memory.rollback_depth or 0):
        return memory, 0, False
    consumed, _ = shared.seq_rm(src_, all_, all_)
    rolled, ok = consumed.seq_rm(dst_, np.int32(n), all_)
    if not bool(ok):
        return memory, 0, False
    return rolled, n, True


def moving_rows_bound(config: RecurrentConfig, n_slots: int, *, slots_rewritten: bool = False) -> int:
    """The most state rows that one placement of ``n_slots`` slots moves (:meth:`RecurrentCache.copy_rows`).

    ``2 * n_slots - 1`` cells of ``n_states`` rows each (at most every row). Before a placement every
    used cell reads itself and an empty one nothing
    (:func:`kvjax.memory._recurrent_slots.find_slot_recurrent`). The placement then changes only
    the slots' cells ``head + s`` and the cells their states sat in before the swaps (a
    sequence's own cell, or its copy-on-write cell): states move only by swaps between those, each
    slot making at most one. The lowest of the latter cells is ``head`` itself, so at most
    ``2 * n_seqs - 1`` cells, and only a slot's cell applies a ``roll``. The other cells of the
    range keep their rows and their ``roll``, without which no slot count would bound the rows.
    With ``slots_rewritten`` (the step rewrites the slots' cells whole: :meth:`RecurrentCache.read_states`)
    only the other cells are copied: at most ``n_slots - 1``, as ``n_seqs`` of those ``2 n_seqs - 1``
    cells are the slots'. The property tests check both counts after every placement.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.RecurrentConfig(size=64, n_seq_max=64, n_layer=1, k_shape=(2,), v_shape=(2,))
        >>> moving_rows_bound(cfg, 1), moving_rows_bound(cfg, 32), moving_rows_bound(cfg, 1, slots_rewritten=True)
        (1, 63, 0)
    """
    cells = int(n_slots) - 1 if slots_rewritten else 2 * int(n_slots) - 1
    return min(config.rows, cells * config.n_states)


#: flat row indices (and the past-the-end fill) are int32: buffers of more rows keep the 2-d indexing
_INT32_END = 2**31 - 1


def _flat_rows(x, rows: Int[Array, " n"]) -> Int[Array, " Lg*n"]:
    """Rows ``rows`` of every layer of ``x [Lg, R, ...]`` as indices into ``x`` viewed as ``[Lg * R, ...]``
    (layer major); rows outside ``[0, R)`` map past the end (a scatter drops them)."""
    lg, r = x.shape[:2]
    idx = jnp.arange(lg, dtype=rows.dtype)[:, None] * r + rows[None, :]
    return jnp.where(((rows >= 0) & (rows < r))[None, :], idx, lg * r).reshape(-1)


def _take_rows(x, rows: Int[Array, " n"]):
    """``x[:, rows]`` of a state buffer ``x [Lg, R, ...]`` (rows in range).

    A gather of the ``Lg * n`` rows of ``x`` viewed as ``[Lg * R, ...]``: its result comes out in
    ``[Lg, n, ...]`` order, where a gather along axis 1 comes out index first, and every reader
    then transposed it element by element (a one-sequence Mamba step 1.3x slower). A single
    entry is read as two: a one-entry gather compiles to a dynamic-slice that XLA fuses into each
    of its readers, and then, unable to order those reads before the in-place write of the new
    states, it copies every state buffer on each step. A one-row buffer is read as itself.
    """
    lg, r = x.shape[:2]
    if r == 1:                                                # the buffer is the row (rows are 0)
        return jnp.broadcast_to(x, (lg, rows.shape[0]) + x.shape[2:])
    if lg * rows.shape[0] == 1:
        return _take_rows(x, jnp.concatenate([rows, rows]))[:, :1]
    if lg * r >= _INT32_END:                                  # flat indices would not fit int32
        return jnp.take(x, rows, axis=1, mode="clip")
    flat = x.reshape((lg * r,) + x.shape[2:])
    got = jnp.take(flat, _flat_rows(x, jnp.clip(rows, 0, r - 1)), axis=0, mode="clip")
    return got.reshape((lg, rows.shape[0]) + x.shape[2:])


def _started(got, placement: RecurrentPlacement, size: int):
    """The slots' rows ``got [Lg, n_slots, ...]`` with zeros for a new sequence (``s_mask`` false) and
    for the slots past ``n_seqs``: a select, so a NaN in a reused row cannot leak into a new state."""
    slot = jnp.arange(got.shape[1])
    # a reduction, so XLA computes the flags once: as a gather and a compare it fused their scalar
    # chain (the placement's) into every element of every layer's read, 3-4x those fusions' time
    keep = jnp.any((jnp.arange(size)[None] == slot[:, None]) & placement.s_mask[None]
                   & (slot < placement.n_seqs)[:, None], axis=1)
    return jnp.where(keep.reshape((1, -1) + (1,) * (got.ndim - 2)), got, jnp.zeros((), got.dtype))


def _set_rows(x, rows: Int[Array, " n"], values):
    """``x`` with ``x[:, rows] = values`` (``values [Lg, n, ...]``), rows outside ``[0, R)`` dropped.

    A scatter of ``Lg * n`` rows into ``x`` viewed as ``[Lg * R, ...]`` (the updates in their own
    order, as :func:`_take_rows` reads). A single entry is written twice (the same values): a
    one-entry write compiles to a select around a dynamic-update-slice, a fusion into which
    XLA:CPU pulls the whole state update and runs it slowly (1.3 ms of a 3.7 ms Mamba step), or,
    in ``copy_rows``, answers with copies of the buffers; a scatter keeps both apart. (A dropped
    second entry of zeros measured as slow.) A one-row buffer (a one-cell memory) is replaced
    whole by a select: as a gather and scatter over its one row XLA copied it four times a step.
    """
    lg, r = x.shape[:2]
    n = rows.shape[0]
    if r == 1:                       # the buffer is the row: a select, in place, no scatter
        hit = rows == 0
        if n == 1:
            chosen = values
        else:                        # the entry for row 0 (one at most: a one-cell memory has one slot)
            chosen = jnp.sum(jnp.where(hit.reshape((1, n) + (1,) * (values.ndim - 2)), values, 0), axis=1,
                             keepdims=True)
        return jnp.where(jnp.any(hit), chosen.astype(x.dtype), x)
    if lg * n == 1:
        rows, values, n = jnp.concatenate([rows, rows]), jnp.concatenate([values, values], axis=1), 2
    if lg * r >= _INT32_END:                                  # flat indices would not fit int32
        return x.at[:, rows].set(values, mode="drop")
    flat = x.reshape((lg * r,) + x.shape[2:])
    out = flat.at[_flat_rows(x, rows)].set(values.reshape((lg * n,) + x.shape[2:]), mode="drop")
    return out.reshape(x.shape)


def _row_sources(placement: RecurrentPlacement, config: RecurrentConfig) -> Int[Array, " R"]:
    """For every state row, the row it is copied from (itself when nothing moves)."""
    kk, size = config.n_states, config.size
    row = jnp.arange(config.rows)
    cell, j = row // kk, row % kk
    i = cell - placement.head
    inside = (i >= 0) & (i < placement.n)
    ic = jnp.clip(i, 0, size - 1)
    copy, roll, mask = placement.s_copy[ic], placement.s_roll[ic], placement.s_mask[ic]
    moves = inside & mask & (j < kk - roll)
    return jnp.where(moves, copy * kk + roll + j, row).astype(jnp.int32)


def init_recurrent(config: RecurrentConfig) -> RecurrentCache:
    """A new, empty recurrent memory with zeroed state buffers."""
    return _init(config)


@functools.partial(jax.jit, static_argnums=0)
def _init(config: RecurrentConfig) -> RecurrentCache:
    k, v = [], []
    for grp in config.groups:
        k.append(jnp.zeros((len(grp.layers), config.rows) + grp.k_shape, config.k_dtype))
        v.append(jnp.zeros((len(grp.layers), config.rows) + grp.v_shape, config.v_dtype))
    return RecurrentCache(cells=empty_recurrent_cells(config.size, config.n_seq_max), k=tuple(k), v=tuple(v),
                          config=config)
