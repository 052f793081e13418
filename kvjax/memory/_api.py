"""The public memory operations: validate on the host once, then call the memory (the protocol).

Each op takes any memory (:class:`kvjax.memory._protocol.Memory`) and returns a new one; sequence
operations change only metadata, so the K/V (or state) buffers are shared between the old and the
new value (no copy). Arguments may be Python
ints, numpy or jax scalars, or traced values inside ``jit``; one compilation serves every value.
Concrete arguments are checked here and a bad one raises ``ValueError`` naming it and its allowed
range; traced ones are guarded on device (see :mod:`kvjax.errors`).

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch(range(5), [[0]] * 5))
    >>> cache = kvjax.seq_cp(cache, 0, 1, 0, 3)      # sequence 1 shares the first 3 cells
    >>> cache, ok = kvjax.seq_rm(cache, 0, 3, -1)    # sequence 0 drops positions >= 3
    >>> int(kvjax.used_cells(cache)), int(kvjax.n_tokens(cache)), int(kvjax.seq_pos_max(cache, 1))
    (3, 6, 2)
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.attn._windows import window_bucket
from kvjax.memory import _cells
from kvjax._typing import Array, Bool, Int, IntLike
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory, Placement, on_metadata
from kvjax.memory._unified import KVCache, require_cache
from kvjax._errors import ErrorFlag, decode_error_bits
from kvjax.memory._ubatch import Ubatch, equal_slots
from kvjax._validate import (
    INT32_MAX,
    INT32_MIN,
    as_int32,
    check_flag,
    check_int_values,
    check_position,
    check_seq_id,
    concrete_int,
    is_traced,
)


def _check_memory(memory) -> int:
    return require_memory(memory).n_seq_max


def _range_args(p0, p1):
    check_position("p0", p0)
    check_position("p1", p1)
    return as_int32(p0), as_int32(p1)


# -- sequence operations ------------------------------------------------------------------------


def clear(memory: Memory) -> Memory:
    """Empty every cell and reset ``head`` to 0.

    K/V bytes are left as they are (empty cells are masked, so stale rows are never read);
    this makes ``clear`` O(C) instead of a write of the whole cache.
    """
    require_memory(memory)
    return memory.clear()


def seq_rm(memory: Memory, seq_id: IntLike, p0: IntLike = -1, p1: IntLike = -1) -> Tuple[Memory, Bool[Array, ""]]:
    """Remove sequence ``seq_id`` from the cells with ``p0 <= pos < p1``.

    A memory may refuse (llama.cpp's ``seq_rm`` returns false): the recurrent memory cannot cut a
    sequence's state in the middle. Then ``ok`` is false and the memory is returned unchanged; the
    unified cache never refuses.

    Args:
        memory: the memory.
        seq_id: in ``[-1, n_seq_max)``; -1 removes every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).

    Returns:
        ``(memory, ok)`` with ``ok`` a ``bool[]`` (concrete outside ``jit``, traced inside).
    """
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    return memory.seq_rm(as_int32(seq_id), p0, p1)


def seq_cp(memory: Memory, seq_id_src: IntLike, seq_id_dst: IntLike, p0: IntLike = -1, p1: IntLike = -1) -> Memory:
    """Make ``seq_id_dst`` share the cells of ``seq_id_src`` with ``p0 <= pos < p1``.

    Args:
        memory: the memory.
        seq_id_src: source sequence, in ``[0, n_seq_max)``.
        seq_id_dst: destination sequence, in ``[0, n_seq_max)``.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
    """
    n_seq_max = _check_memory(memory)
    check_seq_id("seq_id_src", seq_id_src, n_seq_max, allow_all=False)
    check_seq_id("seq_id_dst", seq_id_dst, n_seq_max, allow_all=False)
    p0, p1 = _range_args(p0, p1)
    return memory.seq_cp(as_int32(seq_id_src), as_int32(seq_id_dst), p0, p1)


def seq_keep(memory: Memory, seq_id: IntLike) -> Memory:
    """Remove every sequence except ``seq_id`` (in ``[-1, n_seq_max)``; -1 keeps them all)."""
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    return memory.seq_keep(as_int32(seq_id))


def seq_add(memory: Memory, seq_id: IntLike, p0: IntLike, p1: IntLike, delta: IntLike) -> Memory:
    """Shift the positions of ``seq_id`` in ``[p0, p1)`` by ``delta``; pending until :func:`kvjax.update`.

    Cells of a unified (and iSWA, streams) memory whose position falls below 0 are freed: each
    holds one token. A recurrent state holds its whole sequence: a shift that would move one
    below 0 is refused on a recurrent or hybrid memory. A shift that would push a position to
    ``2**31 - 1`` or past it is refused on every memory. A refused shift changes nothing: called
    eagerly it raises ``ValueError``; under ``jit`` it is skipped with ``ErrorFlag.STATE_SHIFT``
    or ``ErrorFlag.OVERFLOW`` set in the returned memory (:func:`kvjax.check` raises it).

    Raises:
        ValueError: an argument out of range, or (eagerly) a refused shift.

    Args:
        memory: the memory.
        seq_id: in ``[-1, n_seq_max)``; -1 shifts every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
        delta: any int32 shift.
    """
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    concrete_int("delta", delta)
    args = (as_int32(seq_id), p0, p1, as_int32(delta))
    if any(is_traced(x) for x in jax.tree.leaves(memory)):
        return memory.seq_add(*args)
    # eagerly a refusal raises: whether the shift is refused depends on the positions held, so
    # one scalar comes back from the device (one program computes the shift and the refusal)
    out, refused = _seq_add_checked(memory, *args)
    refused = int(refused)
    if refused:
        raise ValueError(
            f"seq_add(seq_id={seq_id}, p0={p0}, p1={p1}, delta={delta}) was refused, the memory is "
            f"unchanged: " + "; ".join(decode_error_bits(refused))
        )
    return out


@on_metadata
def _seq_add_checked(memory: Memory, seq_id, p0, p1, delta):
    """``(memory.seq_add(...), the refusal bits it set)``: the shift runs with the error bits
    cleared, so a refusal shows where an earlier jitted call left the same (sticky) bit set, and
    the old bits are or-ed back into the result."""
    out = memory.clear_errors().seq_add(seq_id, p0, p1, delta)
    refused = out.error_bits() & jnp.uint32(ErrorFlag.OVERFLOW | ErrorFlag.STATE_SHIFT)
    return out.flag_errors(memory.error_bits()), refused


def seq_div(memory: Memory, seq_id: IntLike, p0: IntLike, p1: IntLike, d: IntLike) -> Memory:
    """Integer-divide the positions of ``seq_id`` in ``[p0, p1)`` by ``d`` (self-extend).

    Args:
        memory: the memory.
        seq_id: in ``[-1, n_seq_max)``; -1 divides every sequence.
        p0: first position (< 0 means 0).
        p1: end position, exclusive (< 0 means infinity).
        d: the divisor, >= 1.
    """
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    p0, p1 = _range_args(p0, p1)
    value = concrete_int("d", d)
    if value is not None and value <= 0:
        raise ValueError(f"d={value} is out of range: allowed d >= 1")
    return memory.seq_div(as_int32(seq_id), p0, p1, as_int32(d))


# -- queries ------------------------------------------------------------------------------------


def seq_pos_min(memory: Memory, seq_id: IntLike) -> Int[Array, ""]:
    """Smallest position of ``seq_id`` (in ``[-1, n_seq_max)``, -1: any), -1 when absent."""
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    return memory.seq_pos_min(as_int32(seq_id))


def seq_pos_max(memory: Memory, seq_id: IntLike) -> Int[Array, ""]:
    """Largest position of ``seq_id`` (in ``[-1, n_seq_max)``, -1: any), -1 when absent."""
    check_seq_id("seq_id", seq_id, _check_memory(memory), allow_all=True)
    return memory.seq_pos_max(as_int32(seq_id))


def _memory_query(method: str, doc: str):
    """A public query of any memory: check it, call the protocol method."""

    def query(memory: Memory):
        require_memory(memory)
        return getattr(memory, method)()

    query.__name__ = query.__qualname__ = method
    query.__doc__ = doc
    return query


def _cache_query(cell_fn, doc: str):
    """A public query of a unified cache's cells (not defined for other memories)."""

    def query(cache: KVCache):
        require_cache(cache, cell_fn.__name__)
        return cell_fn(cache.cells)

    query.__name__ = query.__qualname__ = cell_fn.__name__
    query.__doc__ = doc
    return query


pos_max = _memory_query("pos_max", "Largest position in the memory (``i32[]``), -1 when empty.")
used_cells = _memory_query("used_cells", "Number of non-empty cells (``i32[]``).")
n_tokens = _memory_query(
    "n_tokens", "Sum of the sequence-set sizes over all cells (``i32[]``; a shared cell counts once per sequence)."
)
cell_max = _cache_query(_cells.cell_max, "One past the last non-empty cell (``i32[]``).")
has_shift = _cache_query(
    _cells.has_shift, "Whether a K-shift is pending (``bool[]``: some cell has a non-zero ``delta``)."
)


def n_kv(cache: KVCache) -> Int[Array, ""]:
    """The attention window ``min(size, max(padding, pad(cell_max, padding)))``."""
    require_cache(cache, "n_kv")
    return _cells.n_kv(cache.cells, cache.config.padding)


# -- placement ----------------------------------------------------------------------------------


def _check_ubatch(cache: Memory, ubatch: Ubatch):
    if not isinstance(ubatch, Ubatch):
        raise ValueError(f"ubatch must be a kvjax.Ubatch (see kvjax.make_ubatch), got {type(ubatch).__name__}")
    for name, kind, allowed in (
        ("pos", np.integer, "integers"),
        ("seq_ids", np.integer, "integers"),
        ("valid", np.bool_, "bool"),
    ):
        x = getattr(ubatch, name)
        if not isinstance(x, (np.ndarray, jax.Array)):  # a list would be read one way here, another in jit
            raise ValueError(
                f"ubatch.{name} is a {type(x).__name__}: allowed an array (build the ubatch with kvjax.make_ubatch)"
            )
        # an array's own dtype: jnp.result_type costs ~15 us a call, a third of this check
        if not np.issubdtype(x.dtype, kind):
            raise ValueError(f"ubatch.{name} has dtype {x.dtype}: allowed {allowed}")
    t = np.shape(ubatch.pos)
    if (
        len(t) != 1
        or np.shape(ubatch.valid) != t
        or len(np.shape(ubatch.seq_ids)) != 2
        or np.shape(ubatch.seq_ids)[0] != t[0]
    ):
        raise ValueError(
            f"ubatch has pos {np.shape(ubatch.pos)}, seq_ids {np.shape(ubatch.seq_ids)}, valid "
            f"{np.shape(ubatch.valid)}: allowed [T], [T, M], [T] (build it with kvjax.make_ubatch)"
        )
    if any(is_traced(x) for x in (ubatch.pos, ubatch.seq_ids, ubatch.valid)):
        return
    check_int_values("ubatch.pos", ubatch.pos, INT32_MIN, INT32_MAX - 1)
    check_int_values("ubatch.seq_ids", ubatch.seq_ids, INT32_MIN, INT32_MAX)
    valid = np.asarray(ubatch.valid)
    n = int(np.count_nonzero(valid))
    size = cache.size
    if cache.ubatch_split == "equal" and (ubatch.n_seq_tokens or not cache.streamed):
        _check_equal_ubatch(cache, ubatch)  # streams also take any ubatch (attended a row at a time)
    if cache.n_parts and n > size:
        raise ValueError(f"ubatch has {n} tokens: allowed at most size={size} (it can never fit)")
    ids = np.asarray(ubatch.seq_ids)[valid]
    bad = ids[(ids < -1) | (ids >= cache.n_seq_max)]
    if bad.size or (ids.size and (ids[:, 0] < 0).any()):
        value = int(bad[0]) if bad.size else -1
        raise ValueError(f"ubatch seq id {value} is out of range: allowed [0, {cache.n_seq_max})")
    if cache.streamed:
        cache.check_token_streams(ids)
    pos = np.asarray(ubatch.pos)[valid]
    if (pos < 0).any():
        raise ValueError(f"ubatch position {int(pos.min())} is out of range: allowed >= 0")


def _check_equal_ubatch(memory: Memory, ubatch: Ubatch) -> None:
    """What a memory that takes equal splits needs of a concrete ubatch (see make_equal_ubatch)."""
    n_slots, t = equal_slots(ubatch)
    if ubatch.length % t:
        raise ValueError(f"ubatch has length {ubatch.length}: allowed a multiple of n_seq_tokens={t}")
    valid = np.asarray(ubatch.valid).reshape(n_slots, t)
    on = valid[:, 0]
    if (valid != on[:, None]).any() or (np.diff(on.astype(int)) > 0).any() or not on.any():
        raise ValueError(
            "ubatch has partly valid slots: allowed whole slots, the used ones first "
            "(build it with kvjax.make_equal_ubatch)"
        )
    n_seqs = int(on.sum())
    cells = getattr(memory, "max_slots", memory.size)
    if n_seqs > cells:
        raise ValueError(f"ubatch has {n_seqs} sequences: allowed at most size={cells} (one state cell each)")
    ids = np.asarray(ubatch.seq_ids).reshape(n_slots, t, -1)[:n_seqs]
    if (ids != ids[:, :1]).any():
        raise ValueError(
            "ubatch has a slot whose tokens belong to different sequences: allowed one "
            "sequence set per slot (build it with kvjax.make_equal_ubatch)"
        )
    first = ids[:, 0]
    real = first[first >= 0]
    if len(real) != len(set(real.tolist())):
        raise ValueError("ubatch has a seq id in two slots: allowed each sequence in one slot")


def _check_ubatches(memory: Memory, ubatches) -> None:
    if not isinstance(ubatches, (list, tuple)):
        raise ValueError(
            f"ubatches must be a list of kvjax.Ubatch (the ubatches of one batch), got {type(ubatches).__name__}"
        )
    for ub in ubatches:
        _check_ubatch(memory, ub)


def find_slot(memory: Memory, ubatch: Ubatch, *, contiguous: bool = True) -> Tuple[Memory, Placement, Bool[Array, ""]]:
    """Place a ubatch: the seed's contiguous search, or scattered over free cells.

    Args:
        memory: the memory.
        ubatch: the tokens (see :func:`kvjax.make_ubatch`).
        contiguous: True for the seed's contiguous window, False to use any free cells.

    Returns:
        ``(memory, placement, ok)``; for the unified cache the placement is ``slot i32[T]``, the
        cell of each row. When ``ok`` is false the memory is returned unchanged (head included)
        and every slot is -1.

    Raises:
        ValueError: (concrete ubatches) more tokens than cells, seq ids outside
            ``[0, n_seq_max)``, negative positions. Traced ubatches get ``ok = False`` instead.
    """
    require_memory(memory)
    check_flag("contiguous", contiguous)
    _check_ubatch(memory, ubatch)
    return memory.find_slot(ubatch, contiguous=bool(contiguous))


def prepare(
    memory: Memory, ubatches: Sequence[Ubatch], *, contiguous: bool = True
) -> Tuple[Bool[Array, ""], Tuple[Placement, ...]]:
    """Dry-run the placement of all ubatches of a batch, in order; keep nothing.

    Returns:
        ``(ok, placements)``: whether every ubatch fits, and where each would go. The memory
        passed in is not changed (it cannot be): on success place the ubatches for real with
        :func:`find_slot`, which finds the same placements.
    """
    require_memory(memory)
    check_flag("contiguous", contiguous)
    _check_ubatches(memory, ubatches)
    return memory.prepare(tuple(ubatches), contiguous=bool(contiguous))


def commit(memory: Memory, ubatches: Sequence[Ubatch]) -> Memory:
    """What follows a successful batch (the seed's ``commit``): the iSWA memory prunes its window.

    A no-op for memories with nothing to commit (the unified cache). The decode driver calls it
    after every batch.
    """
    require_memory(memory)
    _check_ubatches(memory, ubatches)
    return memory.commit(tuple(ubatches))


# -- error flags --------------------------------------------------------------------------------


def errors(memory: Memory) -> list:
    """Messages for the error bits that traced calls have set on this memory (empty: none)."""
    require_memory(memory)
    return decode_error_bits(int(memory.error_bits()))


def check(memory: Memory) -> Memory:
    """Raise ``ValueError`` when a traced call has flagged an error; otherwise return the memory."""
    found = errors(memory)
    if found:
        raise ValueError("kvjax memory has error flags set: " + "; ".join(found))
    return memory


def clear_errors(memory: Memory) -> Memory:
    """The memory with its error bits cleared."""
    require_memory(memory)
    return memory.clear_errors()


def can_shift(memory: Memory) -> bool:
    """Whether positions of the memory may be shifted (the seed's ``get_can_shift``; a context shift needs it).

    The unified cache always can: with RoPE parameters (``CacheConfig.rope``) ``update`` rotates K,
    without them K is position-free (ALiBi) and only the positions move. The iSWA pair can only
    when its two caches have the same size (no pruning); a recurrent state never can.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4)
        >>> kvjax.can_shift(kvjax.init(cfg)), cfg.can_shift     # the config: can K be rotated?
        (True, False)
    """
    return bool(require_memory(memory).can_shift)


def kv_window(cache: KVCache, *, min_window: Optional[int] = None) -> int:
    """Read the cache's ``n_kv`` (one scalar device-to-host transfer) and return its bucket.

    Call it after ``find_slot`` and before the step that builds masks and attends, and pass the
    result as the static window.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch(range(70), [[0]] * 70))
        >>> int(kvjax.n_kv(cache)), kvjax.kv_window(cache)
        (96, 128)
    """
    require_cache(cache, "kv_window")
    cfg = cache.config
    return window_bucket(int(n_kv(cache)), cfg.size, cfg.padding, min_window=min_window)


def update(memory, *, donate: bool = False):
    """Apply what a memory has pending (the seed's ``update``): K-shift, defrag, copies.

    Args:
        memory: any memory (concrete, or traced inside ``jit``).
        donate: (concrete memory) apply in place; the input's buffers become invalid when work
            ran. Inside ``jit``, donate the memory to the jitted function instead.

    Returns:
        The memory with nothing pending (the unified cache: :func:`apply_update`).
    """
    require_memory(memory)
    check_flag("donate", donate)
    return memory.update(donate=bool(donate))
