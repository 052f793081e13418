"""The mechanics of defrag and compaction: plans over the cells, and the K/V rows they move.

A plan (:class:`DefragPlan`) says where every cell goes; applying it permutes the cell metadata
and copies only the moved K/V rows of every layer group, chunk by chunk, in one jitted program.
The planners are the seed's ``defrag_prepare`` (holes below ``used`` filled from the end) and
kvjax's compactions (see :mod:`kvjax.memory._defrag`, the public functions, for the rules and the
deliberate differences from the seed).

This module stands below the unified cache: the cache's ``update`` runs a pending defrag through
:data:`run_pending`. It takes a cache by its fields (``cells``, ``k``, ``v``, ``replace``) and
trusts it; :mod:`kvjax.memory._defrag` validates the caches users pass.
"""

from __future__ import annotations

import functools
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._typing import Array, Bool, Float, Int
from kvjax.memory._cells import Cells, has_seq, is_used, n_kv as _cells_n_kv, prefix_sum
from kvjax._errors import ErrorFlag
from kvjax._jit import JitTwins, donating
from kvjax._validate import as_int32, concrete_int

#: Fragmentation is not measured for windows below this many cells (the seed's rule).
MIN_WINDOW = 2048

#: Moved cells per gather/scatter step of the K/V mover. Larger chunks mean fewer loop steps but
#: more wasted rows in the last, partly filled, chunk. On the 2-core CPU here (32768 cells, 16
#: layers, 8192 moved rows) CPU time was flat within noise from 128 to 2048 and worse at 64 and
#: 4096; 256 was at the bottom of that range.
CHUNK = 256

_I32_MAX = jnp.iinfo(jnp.int32).max


@struct.dataclass
class DefragPlan:
    """Where every cell goes, and which K/V rows must be rewritten.

    Attributes:
        src: ``i32[C]`` a permutation: new cell ``i`` holds what old cell ``src[i]`` held
            (``src[i] == i`` for cells that stay; empty cells fill in where cells left).
        moved: ``bool[C]`` new cells whose K/V rows are copied from ``src`` (used cells only).
        n_moves: ``i32[]`` moves as the seed counts them: maximal runs of moved cells whose
            destinations and sources are both consecutive.
        head: ``i32[]`` the cache's ``head`` after the plan is applied.
    """

    src: Int[Array, " C"]
    moved: Bool[Array, " C"]
    n_moves: Int[Array, ""]
    head: Int[Array, ""]

    @property
    def n_cells(self) -> Int[Array, ""]:
        """Number of cells whose K/V rows are copied."""
        return jnp.sum(self.moved, dtype=jnp.int32)


# -- argument checks ----------------------------------------------------------------------------


def max_moves_arg(max_moves) -> Int[Array, ""]:
    """``max_moves`` as int32 (None: no cap); a concrete negative value raises."""
    if max_moves is None:
        return np.int32(_I32_MAX)
    value = concrete_int("max_moves", max_moves)
    if value is not None and value < 0:
        raise ValueError(f"max_moves={value} is out of range: allowed max_moves >= 0, or None for no cap")
    return as_int32(max_moves)


# -- fragmentation ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="padding")
def cells_fragmentation(cells: Cells, padding: int) -> Float[Array, ""]:
    n = _cells_n_kv(cells, padding).astype(jnp.float32)
    used = jnp.sum(is_used(cells), dtype=jnp.int32)
    frag = jnp.maximum(0.0, 1.0 - (used + padding).astype(jnp.float32) / n)
    return jnp.where(n >= MIN_WINDOW, frag, 0.0).astype(jnp.float32)


@functools.partial(jax.jit, static_argnames="padding")
def schedule_defrag(cells: Cells, thold, padding: int) -> Cells:
    return cells.replace(defrag=cells.defrag | (cells_fragmentation(cells, padding) > thold))


# -- plans (metadata only) ----------------------------------------------------------------------


def _shift_down(x, fill):
    """``x[i - 1]`` at ``i`` (``fill`` at 0)."""
    return jnp.concatenate([jnp.full((1,), fill, x.dtype), x[:-1]])


def _shift_up(x, fill):
    """``x[i + 1]`` at ``i`` (``fill`` at the end)."""
    return jnp.concatenate([x[1:], jnp.full((1,), fill, x.dtype)])


def _run_starts(moved, src):
    """Moved cells that begin a move: the previous cell was not moved or its source is not adjacent."""
    contiguous = _shift_down(moved, False) & (src == _shift_down(src, -2) + 1)
    return moved & ~contiguous


def _seed_plan(cells: Cells, max_moves) -> DefragPlan:
    """The seed's ``defrag_prepare`` as prefix sums (see the module docstring)."""
    size = cells.size
    idx = jnp.arange(size, dtype=jnp.int32)
    used = is_used(cells)
    n_used = jnp.sum(used, dtype=jnp.int32)
    # Holes are the empty cells below n_used; the seed fills them in cell order, so rank them.
    hole = ~used & (idx < n_used)
    rank = prefix_sum(hole) - 1
    first = hole & ~_shift_down(hole, False)
    last = hole & ~_shift_up(hole, False)
    run_lo = jax.lax.cummax(jnp.where(first, rank, -1))  # rank of the hole's first cell
    run_hi = jax.lax.cummin(jnp.where(last, rank, _I32_MAX), reverse=True)  # ... and of its last cell
    # Sources: exactly the used cells at or above n_used (there are as many as holes). The seed
    # takes them from the end of the cache: a source's order is the number of used cells after it.
    # A hole takes the next run of them in that order and lays them out in increasing cell order,
    # so the hole cell of rank r receives the source of order run_lo + run_hi - r.
    after = n_used - prefix_sum(used)
    is_src = used & (idx >= n_used)
    by_order = jnp.zeros(size, jnp.int32).at[jnp.where(is_src, after, size)].set(idx, mode="drop")
    take = jnp.where(hole, run_lo + run_hi - rank, 0)
    from_cell = by_order.at[take].get(mode="promise_in_bounds")
    # The seed counts a move per run of adjacent sources within one hole and stops once the cap
    # is reached: a cell moves iff its run's number (in planning order) is within the cap.
    starts = _run_starts(hole, jnp.where(hole, from_cell, -2))
    move_no = prefix_sum(starts)
    moved = hole & (move_no <= max_moves)
    # Metadata permutation: the moved cell's content goes to the hole, the empty hole to the source.
    src = idx.at[jnp.where(moved, idx, size)].set(from_cell, mode="drop")
    src = src.at[jnp.where(moved, from_cell, size)].set(idx, mode="drop")
    n_moves = jnp.sum(starts & moved, dtype=jnp.int32)
    head = jnp.where(jnp.any(moved), n_used, cells.head)
    return DefragPlan(src=src, moved=moved, n_moves=n_moves, head=head)


def _partition_plan(cells: Cells, key: Int[Array, " C"]) -> DefragPlan:
    """Stable partition of the cells by ``key`` (0 first, then 1, ...; empty cells must sort last)."""
    size = cells.size
    idx = jnp.arange(size, dtype=jnp.int32)
    n_keys = 3
    onehot = key[:, None] == jnp.arange(n_keys, dtype=jnp.int32)  # [C, 3]
    counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    offset = jnp.cumsum(counts) - counts  # first new cell per key
    rank = jnp.cumsum(onehot, axis=0, dtype=jnp.int32) - 1  # rank within its key
    dest = offset[key] + jnp.take_along_axis(rank, key[:, None], axis=1)[:, 0]
    src = jnp.zeros(size, jnp.int32).at[dest].set(idx, unique_indices=True)
    used = is_used(cells)
    moved = (src != idx) & used.at[src].get(mode="promise_in_bounds")
    n_used = jnp.sum(used, dtype=jnp.int32)
    head = jnp.where(jnp.any(moved), n_used, cells.head)
    return DefragPlan(src=src, moved=moved, n_moves=jnp.sum(_run_starts(moved, src), dtype=jnp.int32), head=head)


def _compact_plan(cells: Cells) -> DefragPlan:
    return _partition_plan(cells, jnp.where(is_used(cells), 0, 2).astype(jnp.int32))


def _compact_seq_plan(cells: Cells, seq_id) -> DefragPlan:
    key = jnp.where(has_seq(cells, seq_id), 0, jnp.where(is_used(cells), 1, 2))
    return _partition_plan(cells, key.astype(jnp.int32))


_PLANNERS = {
    "defrag": lambda cells, arg: _seed_plan(cells, arg),
    "compact": lambda cells, arg: _compact_plan(cells),
    "compact_seq": lambda cells, arg: _compact_seq_plan(cells, arg),
}


def _valid_arg(kind: str, cells: Cells, arg) -> Tuple[Bool[Array, ""], ErrorFlag]:
    """Whether the traced argument of a plan is valid, and the error bit raised when not."""
    if kind == "defrag":
        return arg >= 0, ErrorFlag.MAX_MOVES
    if kind == "compact_seq":
        return (arg >= 0) & (arg < cells.n_seq_max), ErrorFlag.SEQ_ID
    return jnp.bool_(True), ErrorFlag(0)


@functools.partial(jax.jit, static_argnames="kind")
def make_plan(cells: Cells, arg, kind: str) -> DefragPlan:
    valid, _ = _valid_arg(kind, cells, arg)
    plan = _PLANNERS[kind](cells, jnp.where(valid, arg, 0))
    idx = jnp.arange(cells.size, dtype=jnp.int32)
    # An invalid traced argument plans nothing (applied, it only raises an error bit).
    return DefragPlan(
        src=jnp.where(valid, plan.src, idx),
        moved=plan.moved & valid,
        n_moves=jnp.where(valid, plan.n_moves, 0),
        head=jnp.where(valid, plan.head, cells.head),
    )


# -- applying a plan ----------------------------------------------------------------------------


def _chunk(size: int) -> int:
    return min(size, CHUNK)


def _moved_list(plan: DefragPlan, size: int, chunk: int):
    """Destinations and sources of the moved rows, in increasing destination order, padded to a
    whole number of chunks with destination ``size`` (dropped by the scatter) and source 0."""
    length = -(-size // chunk) * chunk
    (dst,) = jnp.nonzero(plan.moved, size=length, fill_value=size)
    dst = dst.astype(jnp.int32)
    src = plan.src.at[dst].get(mode="fill", fill_value=0)
    n_chunks = -(-plan.n_cells // chunk)
    return dst, src, n_chunks


def _move_direct(bufs, plan: DefragPlan, size: int):
    """Copy the moved rows of every buffer chunk by chunk, straight into the buffers.

    Correct when no destination is the source of a later chunk (defrag, compaction)."""
    chunk = _chunk(size)
    dst, src, n_chunks = _moved_list(plan, size, chunk)

    def step(i, bufs):
        d = jax.lax.dynamic_slice_in_dim(dst, i * chunk, chunk)
        s = jax.lax.dynamic_slice_in_dim(src, i * chunk, chunk)
        # Gather every row of the chunk before any is written (sources and destinations of one
        # chunk may overlap in a compaction).
        rows = [b.at[:, :, s, :].get(mode="promise_in_bounds") for b in bufs]
        return tuple(b.at[:, :, d, :].set(r, mode="drop") for b, r in zip(bufs, rows))

    return jax.lax.fori_loop(0, n_chunks, step, tuple(bufs))


def _move_staged(bufs, plan: DefragPlan, size: int):
    """Copy the moved rows for any permutation: per layer, stage every moved row, then write."""
    chunk = _chunk(size)
    dst, src, n_chunks = _moved_list(plan, size, chunk)

    def move_buffer(buf):
        n_layers, n_heads, _, dim = buf.shape

        def layer_step(layer, buf):
            def gather(i, stage):
                s = jax.lax.dynamic_slice_in_dim(src, i * chunk, chunk)
                rows = buf.at[layer, :, s, :].get(mode="promise_in_bounds")  # [chunk, H, D]
                return jax.lax.dynamic_update_slice_in_dim(stage, rows, i * chunk, axis=0)

            stage = jnp.zeros((dst.shape[0], n_heads, dim), buf.dtype)
            stage = jax.lax.fori_loop(0, n_chunks, gather, stage)

            def scatter(i, buf):
                d = jax.lax.dynamic_slice_in_dim(dst, i * chunk, chunk)
                rows = jax.lax.dynamic_slice_in_dim(stage, i * chunk, chunk, axis=0)
                return buf.at[layer, :, d, :].set(rows, mode="drop")

            return jax.lax.fori_loop(0, n_chunks, scatter, buf)

        return jax.lax.fori_loop(0, n_layers, layer_step, buf)

    return tuple(move_buffer(b) for b in bufs)


def _apply(cache, plan: DefragPlan, valid, flag: ErrorFlag, staged: bool):
    cells = cache.cells
    size = cells.size
    new_cells = cells.replace(
        pos=cells.pos.at[plan.src].get(mode="promise_in_bounds"),
        seq=cells.seq.at[plan.src].get(mode="promise_in_bounds"),
        delta=cells.delta.at[plan.src].get(mode="promise_in_bounds"),
        head=plan.head,
        defrag=jnp.where(valid, False, cells.defrag),
        error=cells.error | jnp.where(valid, jnp.uint32(0), jnp.uint32(flag)),
    )
    n_groups = len(cache.k)
    move = _move_staged if staged else _move_direct
    bufs = move(cache.k + cache.v, plan, size)
    return cache.replace(cells=new_cells, k=tuple(bufs[:n_groups]), v=tuple(bufs[n_groups:]))


def _run_impl(cache, arg, kind: str):
    """Plan and apply in one program."""
    plan = make_plan(cache.cells, arg, kind=kind)
    valid, flag = _valid_arg(kind, cache.cells, arg)
    return _apply(cache, plan, valid, flag, staged=(kind == "compact_seq"))


run_plan = JitTwins(_run_impl, static_argnames="kind", donate_argnums=0)


def donating_cache(cache, donate: bool) -> bool:
    """Donate only a concrete cache: inside an outer ``jit`` donation is that jit's business."""
    return donating(donate, cache.cells.pos)


def _apply_pending_impl(cache):
    return jax.lax.cond(
        cache.cells.defrag, lambda c: run_plan(c, jnp.int32(_I32_MAX), kind="defrag"), lambda c: c, cache
    )


run_pending = JitTwins(_apply_pending_impl, donate_argnums=0)
