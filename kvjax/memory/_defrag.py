"""Defragmentation and compaction: a move plan made on device, applied as one gather/scatter.

Holes (empty cells below the last used one) widen the attention window ``n_kv``: attention reads
every cell of the window, so a cache with half its window empty reads twice the bytes it needs.
Defragmentation moves used cells into the holes so the window shrinks again.

Three plans, one mover:

- :func:`defrag` is the seed's ``defrag_prepare`` exactly. With ``n_used`` used cells, every hole
  below ``n_used`` is filled, hole by hole in cell order, with the last not-yet-moved used cells
  of the cache (the ones at or above ``n_used``), kept in their order inside a hole. A move is a
  contiguous run of source cells into one hole, counted as the seed counts them, and
  ``max_moves`` stops the plan after that many moves, possibly in the middle of a hole. When
  anything moved, ``head`` becomes ``n_used``. Cell order is not kept (the tail fills the holes).
- :func:`compact` moves every used cell to the front with the cells' order kept, so
  ``n_kv`` is as small as it can be and the cache reads as if it had been filled in order.
- :func:`compact_seq` moves the cells of one sequence to the front (order kept), then the other
  used cells (order kept), then the empty ones: the sequence's cells become the prefix
  ``[0, n)``, which suits saving that sequence or a step where it is the only one attending.

For the two compactions ``head`` becomes ``used`` (the first free cell) when anything moved, as
the seed's defrag does, and stays where it was otherwise. Every plan also clears the pending flag
``cells.defrag`` (the seed clears ``do_defrag`` after an update whether or not cells moved).

How it runs. Planning is data-dependent but needs no host loop: holes, their ranks and the
ranks of the source cells are prefix sums over the cells, and the seed's move count is a cumulative
count of run starts (O(C) work on the 12-byte-per-cell metadata, one compilation for every cache
content). The plan is a permutation ``src`` of the cells (new cell ``i`` holds what old cell
``src[i]`` held) plus the set of destinations whose K/V rows must change. The metadata is permuted
whole (it is tiny); K and V of every layer group are touched only at the moved cells, chunk by
chunk in a ``lax.while_loop`` whose trip count is the number of moved cells, so a defrag that moves
few cells costs few row copies (a full permutation gather reads and writes the whole cache; see
``benchmarks/bench_defrag.py`` for both). With ``donate=True``, or under
``jax.jit(..., donate_argnums=0)``, the buffers are updated in place; without donation XLA first
copies the cache, like any functional update.

Defrag and compaction never move a row onto a cell that a later chunk still has to read (defrag
fills holes below ``n_used`` from cells at or above it; compaction only moves rows down, in
increasing order), so they scatter straight into the buffers. ``compact_seq`` can swap cells, so it
stages the moved rows of one layer at a time before writing them (extra memory: one layer).

What it costs (``benchmarks/bench_defrag.py``, 2-core CPU, a 32768-cell, 16-layer, 2 GiB cache,
used cells scattered uniformly, two runs on a shared, loaded machine): planning takes 1-5 ms
whatever the content; a defrag at 50% fragmentation copies about 8200 rows (0.5 GiB) in 0.3-0.65 s,
at 8-14% of an in-place copy's bandwidth (XLA's CPU gather and scatter move 256-byte rows at about
1 GB/s); the same plan applied as a full permutation gather took 9-23 times longer. A compaction
moves every used cell past the first hole, so with scattered holes nearly all of them (0.8-2 s for
1-1.8 GiB). When no defrag is pending, :func:`apply_pending` costs about 0.1 ms and copies nothing.

When defrag pays for itself. A defrag reads and writes every moved row once (``moved *
row_bytes`` each way); every later attention step saves reading the cells the window shrank by,
and contiguous placement needs free windows that holes break up. With scattered placement
(``find_slot(..., contiguous=False)``) holes never refuse a batch, so defrag is only about the
window: it pays when the window would otherwise stay wider by several padded blocks for many more
steps than the defrag costs in attention reads (the seed's rule: ``fragmentation > thold``, and
only for windows of at least 2048 cells). For a few remaining steps, or when the holes are about to
be refilled by the next batch, leave them.

Snapshots. Keeping an old cache value is a free snapshot only while nothing moves K/V bytes. With
the cache donated, a defrag rewrites the K/V buffers in place: the old arrays are deleted (JAX
refuses to read them), so any snapshot that shares them is gone. Without donation the old value
stays consistent on its own, but a snapshot of the cells is only valid together with the K/V
buffers it was taken with: restoring cells from before a defrag onto buffers after it (the
"keep the old cells" rollback) would point cells at other tokens' rows. Take snapshots after the
update that runs a defrag, or keep the whole old cache, buffers included.

``kvjax.defrag`` is the function once the package is imported (it hides this module's name);
``from kvjax.memory._defrag import ...`` still reaches the module, and ``kvjax.memory._defrag.apply_pending`` and
``kvjax.memory._defrag.plan`` are attributes of the function.

Deliberate differences from the seed (also in ``docs/architecture.md``):

- ``max_moves=None`` means no cap. The seed caps moves by its graph-node budget (each move is a
  copy node per layer in its graph); a single gather has no such budget, so the cap is only a
  way for the caller to bound the work of one call.
- ``max_moves=0`` moves nothing (the seed's counter never equals 0 after its first move, so a cap
  of 0 would never stop it; kvjax treats 0 as "no moves").

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2))
    >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(6), [[0], [1]] * 3))
    >>> cache, _ = kvjax.seq_rm(cache, 1, -1, -1)            # holes at cells 1, 3, 5
    >>> print(kvjax.cell_map(kvjax.compact(cache), width=8).splitlines()[1])
    000.....
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._typing import Array, Bool, Float, Int, IntLike
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._cells import Cells, has_seq, is_used, n_kv as _cells_n_kv, prefix_sum
from kvjax._errors import ErrorFlag
from kvjax._jit import JitTwins, donating
from kvjax._validate import as_int32, check_real, check_seq_id, concrete_int, is_traced

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


def _max_moves_arg(max_moves) -> Int[Array, ""]:
    """``max_moves`` as int32 (None: no cap); a concrete negative value raises."""
    if max_moves is None:
        return np.int32(_I32_MAX)
    value = concrete_int("max_moves", max_moves)
    if value is not None and value < 0:
        raise ValueError(f"max_moves={value} is out of range: allowed max_moves >= 0, or None for no cap")
    return as_int32(max_moves)


# -- fragmentation ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="padding")
def _fragmentation(cells: Cells, padding: int) -> Float[Array, ""]:
    n = _cells_n_kv(cells, padding).astype(jnp.float32)
    used = jnp.sum(is_used(cells), dtype=jnp.int32)
    frag = jnp.maximum(0.0, 1.0 - (used + padding).astype(jnp.float32) / n)
    return jnp.where(n >= MIN_WINDOW, frag, 0.0).astype(jnp.float32)


def fragmentation(cache: KVCache) -> Float[Array, ""]:
    """The seed's fragmentation measure of the attention window.

    With ``n = kvjax.n_kv(cache)``: ``max(0, 1 - (used + padding) / n)`` when ``n >= 2048``,
    else 0 (small windows are never worth defragmenting). The padding counts as used, because
    the window can never be narrower than one padded block past the last token.

    Returns:
        ``f32[]`` in ``[0, 1)``.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=4096, n_seq_max=1, n_layer=1, n_kv_heads=1,
        ...                                      head_dim=2, padding=256))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4096), [[0]] * 4096))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 0, 3072)        # 1024 tokens left at the end
        >>> float(kvjax.fragmentation(cache))
        0.6875
    """
    require_cache(cache, "fragmentation")
    return _fragmentation(cache.cells, cache.config.padding)


@functools.partial(jax.jit, static_argnames="padding")
def _defrag_sched(cells: Cells, thold, padding: int) -> Cells:
    return cells.replace(defrag=cells.defrag | (_fragmentation(cells, padding) > thold))


def defrag_sched(cache: KVCache, thold) -> KVCache:
    """Queue a defrag for the next :func:`kvjax.update` when ``fragmentation(cache) > thold``.

    Sets ``cells.defrag`` (an already pending defrag stays pending), as the seed's
    ``defrag_sched`` sets ``do_defrag``; nothing moves until the update. As in the seed, a
    negative threshold always schedules one (fragmentation is never below 0).

    Args:
        cache: the cache.
        thold: fragmentation threshold, a finite float (traced values allowed).

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=4096, n_seq_max=1, n_layer=1, n_kv_heads=1,
        ...                                      head_dim=2, padding=256))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4096), [[0]] * 4096))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 0, 3072)
        >>> [bool(kvjax.defrag_sched(cache, t).cells.defrag) for t in (0.9, 0.5)]
        [False, True]
    """
    require_cache(cache, "defrag_sched")
    if not is_traced(thold):
        check_real("thold", thold)
    thold = jnp.asarray(thold, jnp.float32)
    return cache.replace(cells=_defrag_sched(cache.cells, thold, cache.config.padding))


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
    run_lo = jax.lax.cummax(jnp.where(first, rank, -1))                       # rank of the hole's first cell
    run_hi = jax.lax.cummin(jnp.where(last, rank, _I32_MAX), reverse=True)    # ... and of its last cell
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
    onehot = key[:, None] == jnp.arange(n_keys, dtype=jnp.int32)               # [C, 3]
    counts = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    offset = jnp.cumsum(counts) - counts                                       # first new cell per key
    rank = jnp.cumsum(onehot, axis=0, dtype=jnp.int32) - 1                     # rank within its key
    dest = offset[key] + jnp.take_along_axis(rank, key[:, None], axis=1)[:, 0]
    src = jnp.zeros(size, jnp.int32).at[dest].set(idx, unique_indices=True)
    used = is_used(cells)
    moved = (src != idx) & used.at[src].get(mode="promise_in_bounds")
    n_used = jnp.sum(used, dtype=jnp.int32)
    head = jnp.where(jnp.any(moved), n_used, cells.head)
    return DefragPlan(src=src, moved=moved, n_moves=jnp.sum(_run_starts(moved, src), dtype=jnp.int32),
                      head=head)


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
def _plan(cells: Cells, arg, kind: str) -> DefragPlan:
    valid, _ = _valid_arg(kind, cells, arg)
    plan = _PLANNERS[kind](cells, jnp.where(valid, arg, 0))
    idx = jnp.arange(cells.size, dtype=jnp.int32)
    # An invalid traced argument plans nothing (applied, it only raises an error bit).
    return DefragPlan(src=jnp.where(valid, plan.src, idx), moved=plan.moved & valid,
                      n_moves=jnp.where(valid, plan.n_moves, 0), head=jnp.where(valid, plan.head, cells.head))


def defrag_plan(cache: KVCache, max_moves: Optional[IntLike] = None) -> DefragPlan:
    """The move plan of :func:`defrag`, computed on the cell metadata only (nothing is moved).

    Args:
        cache: the cache.
        max_moves: cap on the moves as the seed counts them (>= 0), None for no cap.

    Returns:
        The :class:`DefragPlan`.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(6), [[0]] * 6))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 1, 3)          # holes at cells 1 and 2
        >>> plan = kvjax.defrag_plan(cache)
        >>> plan.src[:6].tolist(), int(plan.n_moves), int(plan.head)
        ([0, 4, 5, 3, 1, 2], 1, 4)
    """
    require_cache(cache, "defrag_plan")
    return _plan(cache.cells, _max_moves_arg(max_moves), kind="defrag")


def compact_plan(cache: KVCache) -> DefragPlan:
    """The move plan of :func:`compact` (metadata only, nothing is moved).

    Example:
        >>> import kvjax
        >>> from kvjax.memory._defrag import compact_plan
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(6), [[0]] * 6))
        >>> plan = compact_plan(kvjax.seq_rm(cache, 0, 1, 3)[0])
        >>> plan.src[:6].tolist(), int(plan.n_cells), int(plan.n_moves)
        ([0, 3, 4, 5, 1, 2], 3, 1)
    """
    require_cache(cache, "compact_plan")
    return _plan(cache.cells, np.int32(0), kind="compact")


def compact_seq_plan(cache: KVCache, seq_id: IntLike) -> DefragPlan:
    """The move plan of :func:`compact_seq` (metadata only, nothing is moved).

    Example:
        >>> import kvjax
        >>> from kvjax.memory._defrag import compact_seq_plan
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4), [[0], [1], [0], [1]]))
        >>> compact_seq_plan(cache, 1).src[:4].tolist()
        [1, 3, 0, 2]
    """
    require_cache(cache, "compact_seq_plan")
    check_seq_id("seq_id", seq_id, cache.config.n_seq_max, allow_all=False)
    return _plan(cache.cells, as_int32(seq_id), kind="compact_seq")


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
                rows = buf.at[layer, :, s, :].get(mode="promise_in_bounds")       # [chunk, H, D]
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


def _apply(cache: KVCache, plan: DefragPlan, valid, flag: ErrorFlag, staged: bool) -> KVCache:
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


def _run_impl(cache: KVCache, arg, kind: str) -> KVCache:
    """Plan and apply in one program."""
    plan = _plan(cache.cells, arg, kind=kind)
    valid, flag = _valid_arg(kind, cache.cells, arg)
    return _apply(cache, plan, valid, flag, staged=(kind == "compact_seq"))


_run = JitTwins(_run_impl, static_argnames="kind", donate_argnums=0)


def _donating(cache: KVCache, donate: bool) -> bool:
    """Donate only a concrete cache: inside an outer ``jit`` donation is that jit's business."""
    return donating(donate, cache.cells.pos)


def defrag(cache: KVCache, max_moves: Optional[IntLike] = None, *, donate: bool = False) -> KVCache:
    """Fill the holes below ``used`` with cells from the end of the cache (the seed's defrag).

    The plan is the seed's ``defrag_prepare`` exactly (see the module docstring); it is applied to
    the cells and to K and V of every layer group in one jitted program that copies only the moved
    rows. ``head`` becomes ``used`` when anything moved; the pending flag is cleared.

    Args:
        cache: the cache.
        max_moves: cap on the moves (a move is a run of adjacent cells into one hole), >= 0;
            None (default) for no cap. The seed's cap comes from its graph-node budget, which a
            single gather does not have.
        donate: move the rows in place in ``cache``'s buffers, which then become invalid (as
            under ``jax.jit(kvjax.defrag, donate_argnums=0)``); otherwise XLA first copies the
            whole cache into new buffers.

    Returns:
        The defragmented cache.

    Raises:
        ValueError: a concrete ``max_moves < 0``. A traced negative value moves nothing and sets
            the ``MAX_MOVES`` error bit.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(6), [[0]] * 6))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 1, 3)
        >>> kvjax.cell_table(kvjax.defrag(cache)).pos[:6].tolist()
        [0, 4, 5, 3, -1, -1]
    """
    require_cache(cache, "defrag")
    run = functools.partial(_run, donate=_donating(cache, donate))
    return run(cache, _max_moves_arg(max_moves), kind="defrag")


def compact(cache: KVCache, *, donate: bool = False) -> KVCache:
    """Move every used cell to the front, keeping their order (``n_kv`` becomes minimal).

    ``head`` becomes ``used`` when anything moved (unchanged otherwise); the pending flag is
    cleared. Only rows that change cell are copied (all of them past the first hole).
    ``donate=True`` moves them in place (see :func:`defrag`).

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(6), [[0]] * 6))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 1, 3)
        >>> out = kvjax.compact(cache)
        >>> kvjax.cell_table(out).pos[:6].tolist(), int(out.cells.head)
        ([0, 3, 4, 5, -1, -1], 4)
    """
    require_cache(cache, "compact")
    run = functools.partial(_run, donate=_donating(cache, donate))
    return run(cache, np.int32(0), kind="compact")


def compact_seq(cache: KVCache, seq_id: IntLike, *, donate: bool = False) -> KVCache:
    """Move the cells of ``seq_id`` to the front (order kept), then the other used cells (order
    kept), then the empty ones.

    Afterwards the sequence occupies cells ``[0, n)`` (``n`` its cell count), so a step where it is
    the only one attending can use the window ``n``, and saving it reads one contiguous block.
    ``head`` becomes ``used`` when anything moved; the pending flag is cleared. Cells may swap
    places, so the moved rows are staged one layer at a time (extra memory: one layer).

    Args:
        cache: the cache.
        seq_id: the sequence, in ``[0, n_seq_max)``.
        donate: move the rows in place (see :func:`defrag`).

    Raises:
        ValueError: a concrete ``seq_id`` out of range. A traced one moves nothing and sets the
            ``SEQ_ID`` error bit.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4), [[0], [1], [0], [1]]))
        >>> print(kvjax.cell_map(kvjax.compact_seq(cache, 1), width=8).splitlines()[1])
        1100....
    """
    require_cache(cache, "compact_seq")
    check_seq_id("seq_id", seq_id, cache.config.n_seq_max, allow_all=False)
    run = functools.partial(_run, donate=_donating(cache, donate))
    return run(cache, as_int32(seq_id), kind="compact_seq")


def _apply_pending_impl(cache: KVCache) -> KVCache:
    return jax.lax.cond(cache.cells.defrag,
                        lambda c: _run(c, jnp.int32(_I32_MAX), kind="defrag"),
                        lambda c: c, cache)


_apply_pending = JitTwins(_apply_pending_impl, donate_argnums=0)


def apply_pending(cache: KVCache, *, donate: bool = False) -> KVCache:
    """Run :func:`defrag` (no cap) when ``cells.defrag`` is set, and clear the flag.

    Otherwise the cache comes back unchanged; a ``lax.cond`` keeps that branch cheap (no planning,
    no row touched) and the function jittable. :func:`kvjax.update` calls it after the K-shift.
    ``donate=True`` reuses ``cache``'s buffers (they become invalid, pending or not).

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(4), [[0]] * 4))
        >>> cache, _ = kvjax.seq_rm(cache, 0, 0, 2)
        >>> kvjax.cell_table(apply_pending(cache)).pos[:4].tolist()       # not pending: unchanged
        [-1, -1, 2, 3]
        >>> pending = cache.replace(cells=cache.cells.replace(defrag=jnp.bool_(True)))
        >>> out = apply_pending(pending)
        >>> kvjax.cell_table(out).pos[:4].tolist(), bool(out.cells.defrag)
        ([2, 3, -1, -1], False)
    """
    require_cache(cache, "apply_pending")
    return _apply_pending(cache, donate=_donating(cache, donate))


# ``kvjax.defrag`` is this function once the package imports it, which hides the module of the
# same name from attribute access; keep the module's helpers reachable through it as well.
defrag.apply_pending = apply_pending
defrag.plan = defrag_plan
