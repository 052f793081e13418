"""The public cache operations: validate on the host, then run the jitted cell functions.

Each op takes a :class:`~kvjax.memory._unified.KVCache` and returns a new one; only the cells change, so
the K/V buffers are shared between the old and the new value (no copy). Arguments may be Python
ints, numpy or jax scalars, or traced values inside ``jit``; one compilation serves every value.
Concrete arguments are checked here and a bad one raises ``ValueError`` naming it and its allowed
range; traced ones are guarded on device (see :mod:`kvjax.errors`).

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch(range(5), [[0]] * 5))
    >>> cache = kvjax.seq_cp(cache, 0, 1, 0, 3)      # sequence 1 shares the first 3 cells
    >>> cache = kvjax.seq_rm(cache, 0, 3, -1)        # sequence 0 drops positions >= 3
    >>> int(kvjax.used_cells(cache)), int(kvjax.n_tokens(cache)), int(kvjax.seq_pos_max(cache, 1))
    (3, 6, 2)
"""

from __future__ import annotations

from typing import Sequence, Tuple

import jax.numpy as jnp
import numpy as np

from kvjax.memory import _cells
from kvjax.memory import _slots
from kvjax._typing import Array, Bool, Int, IntLike
from kvjax.memory._unified import KVCache, require_cache
from kvjax._errors import decode_error_bits
from kvjax.memory._ubatch import Ubatch
from kvjax._validate import as_int32, check_position, check_seq_id, concrete_int, is_traced


def _check_cache(cache):
    require_cache(cache)
    return cache.config.n_seq_max


def _check_flag(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} must be a bool (True or False)")


def _range_args(p0, p1):
    check_position("p0", p0)
    check_position("p1", p1)
    return as_int32(p0), as_int32(p1)


# -- sequence operations ------------------------------------------------------------------------


def clear(cache: KVCache) -> KVCache:
    """Empty every cell and reset ``head`` to 0.

    K/V bytes are left as they are (empty cells are masked, so stale rows are never read);
    this makes ``clear`` O(C) instead of a write of the whole cache.
    """
    _check_cache(cache)
    return cache.replace(cells=_cells.clear(cache.cells))


def seq_rm(cache: KVCache, seq_id: IntLike, p0: IntLike = -1, p1: IntLike = -1) -> KVCache:
    """Remove sequence ``seq_id`` from the cells with ``p0 <= pos < p1``.

    Args:
        cache: the cache.
        seq_id: in ``[-1, n_seq_max)``; -1 removes every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
    """
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    return cache.replace(cells=_cells.seq_rm(cache.cells, as_int32(seq_id), p0, p1))


def seq_cp(cache: KVCache, seq_id_src: IntLike, seq_id_dst: IntLike, p0: IntLike = -1,
           p1: IntLike = -1) -> KVCache:
    """Make ``seq_id_dst`` share the cells of ``seq_id_src`` with ``p0 <= pos < p1``.

    Args:
        cache: the cache.
        seq_id_src: source sequence, in ``[0, n_seq_max)``.
        seq_id_dst: destination sequence, in ``[0, n_seq_max)``.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
    """
    n_seq_max = _check_cache(cache)
    check_seq_id("seq_id_src", seq_id_src, n_seq_max, allow_all=False)
    check_seq_id("seq_id_dst", seq_id_dst, n_seq_max, allow_all=False)
    p0, p1 = _range_args(p0, p1)
    return cache.replace(cells=_cells.seq_cp(cache.cells, as_int32(seq_id_src), as_int32(seq_id_dst), p0, p1))


def seq_keep(cache: KVCache, seq_id: IntLike) -> KVCache:
    """Remove every sequence except ``seq_id`` (in ``[-1, n_seq_max)``; -1 keeps them all)."""
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    return cache.replace(cells=_cells.seq_keep(cache.cells, as_int32(seq_id)))


def seq_add(cache: KVCache, seq_id: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> KVCache:
    """Shift the positions of ``seq_id`` in ``[p0, p1)`` by ``delta``; pending until :func:`kvjax.update`.

    Cells whose position falls below 0 are freed.

    Args:
        cache: the cache.
        seq_id: in ``[-1, n_seq_max)``; -1 shifts every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
        delta: any int32 shift.
    """
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    concrete_int("delta", delta)
    return cache.replace(cells=_cells.seq_add(cache.cells, as_int32(seq_id), p0, p1, as_int32(delta)))


def seq_div(cache: KVCache, seq_id: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> KVCache:
    """Integer-divide the positions of ``seq_id`` in ``[p0, p1)`` by ``d`` (self-extend).

    Args:
        cache: the cache.
        seq_id: in ``[-1, n_seq_max)``; -1 divides every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
        d: the divisor, >= 1.
    """
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    value = concrete_int("d", d)
    if value is not None and value <= 0:
        raise ValueError(f"d={value} is out of range: allowed d >= 1")
    return cache.replace(cells=_cells.seq_div(cache.cells, as_int32(seq_id), p0, p1, as_int32(d)))


# -- queries ------------------------------------------------------------------------------------


def seq_pos_min(cache: KVCache, seq_id: IntLike) -> Int[Array, ""]:
    """Smallest position of ``seq_id`` (in ``[-1, n_seq_max)``, -1: any), -1 when absent."""
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    return _cells.seq_pos_min(cache.cells, as_int32(seq_id))


def seq_pos_max(cache: KVCache, seq_id: IntLike) -> Int[Array, ""]:
    """Largest position of ``seq_id`` (in ``[-1, n_seq_max)``, -1: any), -1 when absent."""
    check_seq_id("seq_id", seq_id, _check_cache(cache), allow_all=True)
    return _cells.seq_pos_max(cache.cells, as_int32(seq_id))


def _cache_query(cell_fn, doc: str):
    """A public query over the cells: check the cache, run the jitted cell function."""

    def query(cache: KVCache):
        _check_cache(cache)
        return cell_fn(cache.cells)

    query.__name__ = query.__qualname__ = cell_fn.__name__
    query.__doc__ = doc
    return query


pos_max = _cache_query(_cells.pos_max, "Largest position in the cache (``i32[]``), -1 when empty.")
used_cells = _cache_query(_cells.used_cells, "Number of non-empty cells (``i32[]``).")
n_tokens = _cache_query(_cells.n_tokens, "Sum of the sequence-set sizes over all cells (``i32[]``; a shared "
                                         "cell counts once per sequence).")
cell_max = _cache_query(_cells.cell_max, "One past the last non-empty cell (``i32[]``).")
has_shift = _cache_query(_cells.has_shift, "Whether a K-shift is pending (``bool[]``: some cell has a "
                                           "non-zero ``delta``).")


def n_kv(cache: KVCache) -> Int[Array, ""]:
    """The attention window ``min(size, max(padding, pad(cell_max, padding)))``."""
    _check_cache(cache)
    return _cells.n_kv(cache.cells, cache.config.padding)


# -- placement ----------------------------------------------------------------------------------


def _check_ubatch(cache: KVCache, ubatch: Ubatch):
    if not isinstance(ubatch, Ubatch):
        raise ValueError(f"ubatch must be a kvjax.Ubatch (see kvjax.make_ubatch), got {type(ubatch).__name__}")
    t = np.shape(ubatch.pos)
    if len(t) != 1 or np.shape(ubatch.valid) != t or len(np.shape(ubatch.seq_ids)) != 2 or \
            np.shape(ubatch.seq_ids)[0] != t[0]:
        raise ValueError(f"ubatch has pos {np.shape(ubatch.pos)}, seq_ids {np.shape(ubatch.seq_ids)}, valid "
                         f"{np.shape(ubatch.valid)}: allowed [T], [T, M], [T] (build it with kvjax.make_ubatch)")
    for name in ("pos", "seq_ids"):
        if not jnp.issubdtype(jnp.result_type(getattr(ubatch, name)), jnp.integer):
            raise ValueError(f"ubatch.{name} has dtype {jnp.result_type(getattr(ubatch, name))}: allowed integers")
    if any(is_traced(x) for x in (ubatch.pos, ubatch.seq_ids, ubatch.valid)):
        return
    valid = np.asarray(ubatch.valid)
    n = int(valid.sum())
    size = cache.config.size
    if n > size:
        raise ValueError(f"ubatch has {n} tokens: allowed at most size={size} (it can never fit)")
    ids = np.asarray(ubatch.seq_ids)[valid]
    bad = ids[(ids < -1) | (ids >= cache.config.n_seq_max)]
    if bad.size or (ids.size and (ids[:, 0] < 0).any()):
        value = int(bad[0]) if bad.size else -1
        raise ValueError(f"ubatch seq id {value} is out of range: allowed [0, {cache.config.n_seq_max})")
    pos = np.asarray(ubatch.pos)[valid]
    if (pos < 0).any():
        raise ValueError(f"ubatch position {int(pos.min())} is out of range: allowed >= 0")


def find_slot(cache: KVCache, ubatch: Ubatch, *, contiguous: bool = True
              ) -> Tuple[KVCache, Int[Array, "T"], Bool[Array, ""]]:
    """Place a ubatch: the seed's contiguous search, or scattered over free cells.

    Args:
        cache: the cache.
        ubatch: the tokens (see :func:`kvjax.make_ubatch`).
        contiguous: True for the seed's contiguous window, False to use any free cells.

    Returns:
        ``(cache, slot i32[T], ok)``. When ``ok`` is false the cache is returned unchanged (head
        included) and every slot is -1.

    Raises:
        ValueError: (concrete ubatches) more tokens than cells, seq ids outside
            ``[0, n_seq_max)``, negative positions. Traced ubatches get ``ok = False`` instead.
    """
    _check_cache(cache)
    _check_ubatch(cache, ubatch)
    _check_flag("contiguous", contiguous)
    cells, slot, ok = _slots.find_slot_cells(cache.cells, ubatch, contiguous=bool(contiguous))
    return cache.replace(cells=cells), slot, ok


def prepare(cache: KVCache, ubatches: Sequence[Ubatch], *, contiguous: bool = True
            ) -> Tuple[Bool[Array, ""], Tuple[Int[Array, "T"], ...]]:
    """Dry-run the placement of all ubatches of a batch, in order; keep nothing.

    Returns:
        ``(ok, slots)``: whether every ubatch fits, and where each would go. The cache passed in
        is not changed (it cannot be): on success place the ubatches for real with
        :func:`find_slot`, which finds the same slots.
    """
    _check_cache(cache)
    _check_flag("contiguous", contiguous)
    for ub in ubatches:
        _check_ubatch(cache, ub)
    return _slots.prepare_cells(cache.cells, tuple(ubatches), contiguous=bool(contiguous))


# -- error flags --------------------------------------------------------------------------------


def errors(cache: KVCache) -> list:
    """Messages for the error bits that traced calls have set on this cache (empty: none)."""
    _check_cache(cache)
    return decode_error_bits(int(cache.cells.error))


def check(cache: KVCache) -> KVCache:
    """Raise ``ValueError`` when a traced call has flagged an error; otherwise return the cache."""
    found = errors(cache)
    if found:
        raise ValueError("kvjax cache has error flags set: " + "; ".join(found))
    return cache


def clear_errors(cache: KVCache) -> KVCache:
    """The cache with its error bits cleared."""
    _check_cache(cache)
    return cache.replace(cells=cache.cells.replace(error=jnp.zeros((), jnp.uint32)))
