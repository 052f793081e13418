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
from typing import Optional

import jax.numpy as jnp
import numpy as np

from kvjax._typing import Array, Float, IntLike
from kvjax._validate import as_int32, check_real, check_seq_id, is_traced
from kvjax.memory._defrag_moves import (
    CHUNK,
    MIN_WINDOW,
    DefragPlan,
    run_pending,
    schedule_defrag,
    donating_cache,
    cells_fragmentation,
    max_moves_arg,
    make_plan,
    run_plan,
)
from kvjax.memory._unified import KVCache, require_cache

__all__ = [
    "CHUNK",
    "MIN_WINDOW",
    "DefragPlan",
    "fragmentation",
    "defrag_sched",
    "defrag_plan",
    "compact_plan",
    "compact_seq_plan",
    "defrag",
    "compact",
    "compact_seq",
    "apply_pending",
]


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
    return cells_fragmentation(cache.cells, cache.config.padding)


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
    return cache.replace(cells=schedule_defrag(cache.cells, thold, cache.config.padding))


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
    return make_plan(cache.cells, max_moves_arg(max_moves), kind="defrag")


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
    return make_plan(cache.cells, np.int32(0), kind="compact")


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
    return make_plan(cache.cells, as_int32(seq_id), kind="compact_seq")


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
    run = functools.partial(run_plan, donate=donating_cache(cache, donate))
    return run(cache, max_moves_arg(max_moves), kind="defrag")


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
    run = functools.partial(run_plan, donate=donating_cache(cache, donate))
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
    run = functools.partial(run_plan, donate=donating_cache(cache, donate))
    return run(cache, as_int32(seq_id), kind="compact_seq")


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
    return run_pending(cache, donate=donating_cache(cache, donate))


# ``kvjax.defrag`` is this function once the package imports it, which hides the module of the
# same name from attribute access; keep the module's helpers reachable through it as well.
defrag.apply_pending = apply_pending
defrag.plan = defrag_plan
