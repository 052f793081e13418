"""The recurrent-state memory: one fixed-size state per sequence (the seed's third memory).

State-space and linear-attention layers (Mamba, RWKV, the recurrent layers of hybrids) keep one
state per sequence instead of one K/V row per token. The seed's ``llama_kv_cache_recurrent``
manages those states with the sequence operations of the KV cache; :class:`RecurrentCache` is that
memory as a pytree, every operation a pure function, in modules of one job each: its description
(:mod:`kvjax.memory._recurrent_config`), its cells and their sequence operations
(:mod:`kvjax.memory._recurrent_cells`), its slot search (:mod:`kvjax.memory._recurrent_slots`) and
its state rows (:mod:`kvjax.memory._recurrent_rows`); this module is the memory itself. The rules
are those of :mod:`kvjax.testing` ``RecurrentRef``, its pure-Python model, which the property tests
compare with cell by cell.

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

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._typing import Array, Int
from kvjax._axes import CELLS, SEQ_WORDS, SEQS, scalar_axes, state_axes
from kvjax.memory._protocol import Memory, not_defined

from kvjax.memory._recurrent_cells import (
    RecurrentCells,
    RecurrentPlacement,
    cleared,
    popcount,
    used_mask,
    empty_recurrent_cells,
    rc_seq_add,
    rc_seq_cp,
    rc_seq_div,
    rc_seq_keep,
    rc_seq_pos,
    rc_seq_rm,
    rc_seq_shared,
    rc_shift_keeps_states,
)
from kvjax.memory._recurrent_config import MAX_STATE_FLOATS, RecurrentConfig, RecurrentGroup  # noqa: F401 (re-exported)
from kvjax.memory._recurrent_rows import row_sources, set_rows, started_rows, take_rows, moving_rows_bound
from kvjax.memory._recurrent_slots import find_slot_recurrent
from jax.sharding import PartitionSpec as P

__all__ = [
    "RecurrentConfig",
    "RecurrentGroup",
    "RecurrentCells",
    "RecurrentPlacement",
    "RecurrentCache",
    "init_recurrent",
    "moving_rows_bound",
]


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
        return self._with(cleared(self.cells))

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
        return jnp.sum(used_mask(self.cells), dtype=jnp.int32)

    def n_tokens(self):
        return jnp.sum(popcount(self.cells.seq))

    def pos_max(self):
        return jnp.max(self.cells.pos)

    # -- placement ---------------------------------------------------------------------------------

    def find_slot(self, ubatch, *, contiguous: bool = True):
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
        raise not_defined(self, "layer_part", "it has no attention layers (its layers read states: kvjax.nn.Mamba)")

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

    def _move_rows(self, placement: RecurrentPlacement, bound: int, slots_rewritten: bool = False, n_slots: int = 0):
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
        src = row_sources(placement, self.config)
        moving = src != jnp.arange(rows)
        if slots_rewritten:
            cell = jnp.arange(rows) // kk
            moving = moving & ~((cell >= placement.head) & (cell < placement.head + placement.n_seqs))
        bound = 0 if rows == 1 else bound  # a lone row never moves
        dest = jnp.nonzero(moving, size=bound, fill_value=rows)[0]  # rows: dropped below
        reads = jnp.concatenate([jnp.take(src, dest, mode="clip"), jnp.take(src, self._slot_rows(placement, n_slots))])
        if reads.shape[0] == 0:
            return self, ()

        def move(x):
            got = take_rows(x, reads)
            slots = started_rows(got[:, bound:], placement, self.size)
            return (set_rows(x, dest, got[:, :bound]) if bound else x), slots

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
        return tuple(started_rows(take_rows(x, rows), placement, self.size) for x in (self.k[group], self.v[group]))

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
        if n_tokens < self.config.n_states:  # the write keeps older rows of the slots' cells
            moved = self.copy_rows(placement, n_slots)
            return moved, tuple(moved.slot_states(placement, n_slots, g) for g in range(len(self.config.groups)))
        bound = moving_rows_bound(self.config, n_slots, slots_rewritten=True)
        return self._move_rows(placement, bound, slots_rewritten=True, n_slots=n_slots)

    def write_states(
        self, placement: RecurrentPlacement, k_new, v_new, group: int = 0, *, after=None
    ) -> "RecurrentCache":
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
        base = (placement.head + slot) * kk  # [n_slots]
        active = slot < placement.n_seqs

        def store(x, new):
            new = jnp.flip(new, axis=2).astype(x.dtype)  # newest first: row 0
            if q < kk:
                old_rows = jnp.clip(base[:, None] + jnp.arange(kk - q)[None], 0, x.shape[1] - 1)
                old = take_rows(x, old_rows.reshape(-1)).reshape((x.shape[0], n_slots, kk - q) + x.shape[2:])
                new = jnp.concatenate([new, old], axis=2)
            write = (
                active
                if after is None or not jnp.size(after)
                else active & ~(jnp.ravel(after)[0].astype(jnp.float32) > jnp.inf)
            )
            rows = jnp.where(write[:, None], base[:, None] + jnp.arange(kk)[None], x.shape[1]).reshape(-1)
            flat = new.reshape((x.shape[0], n_slots * kk) + x.shape[2:])
            return set_rows(x, rows, flat)

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
        c = self.cells
        cells = c.replace(
            pos=P(CELLS),
            seq=P(CELLS, SEQ_WORDS),
            roll=P(CELLS),
            hist=P(CELLS),
            tail=P(SEQS),
            head=scalar_axes(),
            error=scalar_axes(),
        )
        return self.replace(
            cells=cells,
            k=tuple(state_axes(x.ndim - 2) for x in self.k),
            v=tuple(state_axes(x.ndim - 2) for x in self.v),
        )

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


def init_recurrent(config: RecurrentConfig) -> RecurrentCache:
    """A new, empty recurrent memory with zeroed state buffers."""
    return _init(config)


@functools.partial(jax.jit, static_argnums=0)
def _init(config: RecurrentConfig) -> RecurrentCache:
    k, v = [], []
    for grp in config.groups:
        k.append(jnp.zeros((len(grp.layers), config.rows) + grp.k_shape, config.k_dtype))
        v.append(jnp.zeros((len(grp.layers), config.rows) + grp.v_shape, config.v_dtype))
    return RecurrentCache(
        cells=empty_recurrent_cells(config.size, config.n_seq_max), k=tuple(k), v=tuple(v), config=config
    )
