"""Ubatches: the tokens placed and attended together, and the host-side batch splitters.

A :class:`Ubatch` carries, per token, its position and the sequence ids it belongs to, padded to
a static length bucket ``T`` with a validity mask, so one compiled program serves every ubatch of
that bucket. A token may belong to several sequences (a shared prompt); its first id is the one
the attention mask uses, as in the seed.

The splitters work on the host, on the per-token sequence-id lists of a whole batch, and return
the token indices of each ubatch so the caller can gather tokens, embeddings or outputs alike:

- :func:`split_simple`: consecutive chunks of at most ``n_ubatch`` tokens, in batch order.
- :func:`split_equal`: every ubatch holds the same number of tokens from each of its sequence
  sets (what recurrent memories need); a token set shared by several sequences goes alone.
- :func:`split_seq`: one sequence set per ubatch.

Example:
    >>> ub = make_ubatch([0, 1, 2], [[0], [0], [0, 1]])
    >>> ub.pos.tolist(), ub.valid.tolist(), ub.seq_ids.shape
    ([0, 1, 2, 0], [True, True, True, False], (4, 2))
    >>> [idx.tolist() for idx in split_simple([[0], [1], [0], [1], [0]], 2)]
    [[0, 1], [2, 3], [4]]
"""

from __future__ import annotations

import itertools
from typing import List, Optional, Sequence, Tuple

import jax.numpy as jnp
import numpy as np
from flax import struct

from kvjax._typing import Array, Bool, Int, UInt32
from kvjax._validate import INT32_MAX, check_count, check_int_values
from kvjax.memory._seqbits import ids_mask


@struct.dataclass
class Ubatch:
    """Tokens of one micro-batch, padded to a static length.

    Attributes:
        pos: ``i32[T]`` position of each token (0 for padding).
        seq_ids: ``i32[T, M]`` sequence ids of each token, -1 padded; column 0 is the token's
            first sequence (the one its attention mask follows).
        valid: ``bool[T]`` which rows are real tokens.
        n_seq_tokens: static; for an equal-split ubatch (what recurrent memories take, see
            :func:`make_equal_ubatch`) the tokens of each sequence slot, else 0.
    """

    pos: Int[Array, " T"]
    seq_ids: Int[Array, "T M"]
    valid: Bool[Array, " T"]
    #: tokens per sequence slot of an equal-split ubatch (:func:`make_equal_ubatch`), 0 otherwise.
    #: Static: rows ``[s * n_seq_tokens, (s + 1) * n_seq_tokens)`` are slot ``s``.
    n_seq_tokens: int = struct.field(pytree_node=False, default=0)

    @property
    def length(self) -> int:
        """T, the static length bucket."""
        return self.pos.shape[0]

    @property
    def seq0(self) -> Int[Array, " T"]:
        """``i32[T]`` the first sequence id of each token (-1 for padding)."""
        return jnp.where(self.valid, self.seq_ids[:, 0], -1)

    def n_tokens(self) -> Int[Array, ""]:
        """Number of valid tokens."""
        return jnp.sum(self.valid, dtype=jnp.int32)

    def seq_mask(self, n_words: int) -> UInt32[Array, "T W"]:
        """Per-token sequence bitmask with ``W = n_words`` words (padding rows are zero)."""
        return jnp.where(self.valid[:, None], ids_mask(self.seq_ids, n_words), jnp.uint32(0))


#: The longest static ubatch length: the most cells a memory may have (``CacheConfig.size <= 2**30``).
MAX_LENGTH = 2**30


def bucket_length(n: int, minimum: int = 1) -> int:
    """The default static length bucket for ``n`` tokens: the next power of two.

    Example:
        >>> [bucket_length(n) for n in (1, 3, 8, 9, 512)]
        [1, 4, 8, 16, 512]
    """
    n = max(check_count("n", n, 0, MAX_LENGTH), check_count("minimum", minimum, 0, MAX_LENGTH), 1)
    return 1 << (n - 1).bit_length()


def _int_array(name: str, values) -> np.ndarray:
    """Integers as int64; floats and other kinds are refused rather than truncated."""
    arr = np.asarray(values)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} has dtype {arr.dtype}: allowed integers")
    check_int_values(name, arr, -(2**63), 2**63 - 1)  # a uint64 above that would wrap negative
    return arr.astype(np.int64)


def make_ubatch(
    pos: Sequence[int],
    seq_ids: Sequence[Sequence[int]],
    *,
    length: Optional[int] = None,
    n_seq_max: Optional[int] = None,
) -> Ubatch:
    """Build a :class:`Ubatch` from host lists or numpy arrays.

    Args:
        pos: position of each of the n tokens, each in ``[0, 2**31 - 1)``.
        seq_ids: for each token a non-empty list of sequence ids (``>= 0``); the first is the
            token's primary sequence.
        length: static bucket T >= n (default: :func:`bucket_length` of n).
        n_seq_max: when given (an int >= 1), every id must be below it; ids are int32 whatever it is.

    Returns:
        The ubatch (numpy leaves, moved to the device by the jitted call that takes it), with
        rows n..T-1 marked invalid.

    Raises:
        ValueError: on mismatched lengths, empty or negative sequence lists, ids that are bools or
            past int32, positions out of range, or ``length < n``.
    """
    pos = _int_array("pos", pos)
    if pos.ndim != 1:
        raise ValueError(f"pos has shape {pos.shape}: allowed one position per token, a [n] sequence")
    n = pos.shape[0]
    if not hasattr(seq_ids, "__len__"):
        seq_ids = list(seq_ids)  # a generator: read once, checked twice
    # ids are int32: whatever n_seq_max says, none reaches 2**31
    hi = INT32_MAX + 1 if n_seq_max is None else min(check_count("n_seq_max", n_seq_max, 1), INT32_MAX + 1)
    flagged = _first_bool(seq_ids)
    if flagged is not None:  # numpy would take a bool among ints as 0 or 1
        raise ValueError(f"seq_ids[{flagged[0]}] contains {flagged[1]!r}: allowed integer sequence ids, not bools")
    pos_ok = not n or (pos.min() >= 0 and pos.max() < INT32_MAX)
    ids = _rectangular_ids(seq_ids, n, hi) if pos_ok else None
    if ids is not None:  # the common case, checked in one pass (the loop below costs ~30 us a token)
        return _pack(pos, ids, length)
    # anything else token by token, so the error names the token
    seq_lists = [list(_int_array(f"seq_ids[{i}]", s).reshape(-1)) for i, s in enumerate(seq_ids)]
    if len(seq_lists) != n:
        raise ValueError(f"seq_ids has {len(seq_lists)} entries: allowed exactly one per token (len(pos)={n})")
    if not pos_ok:
        # 2**31 - 1 itself is the seed's "to infinity" (p1 < 0): a token there could never be removed
        raise ValueError(f"pos={pos.min() if pos.min() < 0 else pos.max()} is out of range: allowed [0, {INT32_MAX})")
    for i, s in enumerate(seq_lists):
        if not s:
            raise ValueError(f"seq_ids[{i}] is empty: every token needs at least one sequence id")
        bad = [x for x in s if not 0 <= x < hi]
        if bad:
            raise ValueError(f"seq_ids[{i}] contains {bad[0]}: allowed [0, {hi})")
    width = max([len(set(s)) for s in seq_lists] + [1])
    ids = np.full((n, width), -1, np.int32)
    for i, s in enumerate(seq_lists):
        uniq = list(dict.fromkeys(int(x) for x in s))  # keep the first id first, drop repeats
        ids[i, : len(uniq)] = uniq
    return _pack(pos, ids, length)


_BOOLS = (bool, np.bool_)


def _first_bool(seq_ids) -> Optional[Tuple[int, object]]:
    """``(token, value)`` of the first bool among the ids of host lists (an array has one dtype,
    checked where it is converted)."""
    if hasattr(seq_ids, "dtype"):
        return None
    try:  # the common case, a list of id lists: one pass over their types in C
        if not set(map(type, itertools.chain.from_iterable(seq_ids))).intersection(_BOOLS):
            return None
    except TypeError:  # some token is a bare id: look token by token
        pass
    for i, row in enumerate(seq_ids):
        if row.__class__ in _BOOLS or getattr(row, "dtype", None) == np.bool_:
            return i, row
        if row.__class__ in (list, tuple):
            for x in row:
                if x.__class__ in _BOOLS:
                    return i, x
    return None


def _rectangular_ids(seq_ids, n: int, hi: int) -> Optional[np.ndarray]:
    """``seq_ids`` as ``i32[n, W]`` when every token has the same number of distinct ids, all
    integers in ``[0, hi)``; None otherwise (the per-token path then drops repeats, or names what
    is wrong)."""
    try:
        arr = np.asarray(seq_ids)
    except (ValueError, TypeError):  # ragged lists, junk
        return None
    if arr.ndim == 1:
        arr = arr.reshape(-1, 1)  # one bare id per token
    if arr.ndim != 2 or n == 0 or arr.shape[0] != n or arr.shape[1] == 0 or not np.issubdtype(arr.dtype, np.integer):
        return None
    if arr.min() < 0 or arr.max() >= hi:
        return None
    ordered = np.sort(arr, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():  # a token names a sequence twice: rare
        return None
    return arr.astype(np.int32)


def _pack(pos: np.ndarray, ids: np.ndarray, length: Optional[int]) -> Ubatch:
    """Pad checked positions ``[n]`` and ids ``[n, W]`` to the static length."""
    n = pos.shape[0]
    length = bucket_length(n) if length is None else check_count("length", length, 1, MAX_LENGTH)
    if length < max(n, 1):
        raise ValueError(f"length={length} is out of range: allowed >= the token count {max(n, 1)}")
    seq = np.full((length, ids.shape[1]), -1, np.int32)
    seq[:n] = ids
    pos_arr = np.zeros(length, np.int32)
    pos_arr[:n] = pos
    valid = np.arange(length) < n
    # numpy leaves: jit transfers them with the call, cheaper than three separate device puts
    return Ubatch(pos=pos_arr, seq_ids=seq, valid=valid)


def make_equal_ubatch(
    slots: Sequence[Tuple[Sequence[int], Sequence[int]]],
    *,
    n_slots: Optional[int] = None,
    n_seq_max: Optional[int] = None,
) -> Ubatch:
    """An equal-split ubatch (the seed's ``split_equal`` ubatch): n sequence slots of the same length.

    Slot ``s`` is ``(positions, seq_ids)``: its tokens' positions (the same count in every slot)
    and the sequence ids they belong to, the primary first (a shared prompt's token set continues
    as its first id). Rows are slot major: slot ``s`` holds rows ``[s * t, (s + 1) * t)`` with
    ``t = n_seq_tokens``, so a model reshapes the ubatch's tokens to ``[n_slots, t]``.

    Args:
        slots: the sequence slots.
        n_slots: static slot count (default: :func:`bucket_length` of ``len(slots)``); slots past
            ``len(slots)`` are padding.
        n_seq_max: when given (an int >= 1), every id must be below it; ids are int32 whatever it is.

    Returns:
        The ubatch, ``length = n_slots * t`` and ``n_seq_tokens = t``.

    Example:
        >>> ub = make_equal_ubatch([([4, 5], [0]), ([0, 1], [1, 2])], n_slots=2)
        >>> ub.pos.tolist(), ub.seq_ids[:, 0].tolist(), ub.n_seq_tokens
        ([4, 5, 0, 1], [0, 0, 1, 1], 2)
    """
    if not isinstance(slots, (list, tuple)) or not slots:
        raise ValueError(f"slots must be a non-empty list of (positions, seq_ids) pairs, got {slots!r:.80}")
    for i, slot in enumerate(slots):
        if not isinstance(slot, (list, tuple)) or len(slot) != 2:
            raise ValueError(f"slots[{i}] must be a (positions, seq_ids) pair, got {slot!r:.80}")
    counts = [len(np.asarray(p).reshape(-1)) for p, _ in slots]
    if counts[0] < 1 or any(c != counts[0] for c in counts):
        raise ValueError(f"slots have {counts} tokens: allowed the same positive count in every slot (an equal split)")
    ids = [
        tuple(dict.fromkeys(int(x) for x in _int_array(f"slots[{i}] seq_ids", s).reshape(-1)))
        for i, (_, s) in enumerate(slots)
    ]
    for i, s in enumerate(ids):
        if not s:
            raise ValueError(f"slots[{i}] has no seq ids: every slot needs at least one")
    seen = [x for s in ids for x in s]
    if len(seen) != len(set(seen)):
        dup = next(x for x in seen if seen.count(x) > 1)
        raise ValueError(f"seq id {dup} is in two slots: allowed each sequence in one slot of a ubatch")
    t = counts[0]
    n_slots = bucket_length(len(slots)) if n_slots is None else check_count("n_slots", n_slots, 1, MAX_LENGTH)
    if n_slots < len(slots):
        raise ValueError(f"n_slots={n_slots} is out of range: allowed >= the slot count {len(slots)}")
    pos = [int(x) for p, _ in slots for x in _int_array("positions", p).reshape(-1)]
    ub = make_ubatch(pos, [list(s) for s in ids for _ in range(t)], length=n_slots * t, n_seq_max=n_seq_max)
    return ub.replace(n_seq_tokens=t)


def equal_slots(ubatch: Ubatch) -> Tuple[int, int]:
    """``(n_slots, n_seq_tokens)`` of an equal-split ubatch, or ``ValueError`` for another one."""
    t = ubatch.n_seq_tokens
    if not t:
        raise ValueError(
            "ubatch is not an equal split: a recurrent memory takes ubatches made by "
            "kvjax.make_equal_ubatch (n sequences of the same number of tokens)"
        )
    return ubatch.length // t, t


# -- host-side splitting ------------------------------------------------------------------------


def _check_split(seq_ids, n_ubatch):
    if isinstance(n_ubatch, bool) or not isinstance(n_ubatch, (int, np.integer)) or n_ubatch < 1:
        raise ValueError(f"n_ubatch={n_ubatch} is out of range: allowed >= 1")
    return [tuple(sorted(set(int(x) for x in s))) for s in seq_ids]


def _groups(seq_sets) -> List[List[int]]:
    """Token indices grouped by identical sequence set, in order of first appearance."""
    order = {}
    for i, key in enumerate(seq_sets):
        order.setdefault(key, []).append(i)
    return list(order.values())


def split_simple(seq_ids: Sequence[Sequence[int]], n_ubatch: int) -> List[np.ndarray]:
    """Consecutive chunks of at most ``n_ubatch`` tokens, in batch order (the seed's default).

    Returns:
        A list of ``int`` index arrays into the batch.
    """
    _check_split(seq_ids, n_ubatch)
    n = len(seq_ids)
    return [np.arange(i, min(i + n_ubatch, n)) for i in range(0, n, n_ubatch)]


def split_seq(seq_ids: Sequence[Sequence[int]], n_ubatch: int) -> List[np.ndarray]:
    """One sequence set per ubatch, at most ``n_ubatch`` tokens each, batch order within a set.

    Example:
        >>> [idx.tolist() for idx in split_seq([[0], [1], [0], [1], [0]], 2)]
        [[0, 2], [4], [1, 3]]
    """
    groups = _groups(_check_split(seq_ids, n_ubatch))
    return [np.asarray(g[i : i + n_ubatch]) for g in groups for i in range(0, len(g), n_ubatch)]


def split_equal(seq_ids: Sequence[Sequence[int]], n_ubatch: int) -> List[np.ndarray]:
    """Ubatches with the same number of tokens from each of their sequence sets.

    Sequence sets are taken shortest first (so the equal length is as large as possible); a set
    shared by several sequences goes in a ubatch of its own, because its tokens must be stored
    before the sequences that continue from it. Within a set, batch order is kept; within a
    ubatch, the rows of each set are contiguous (``n_seqs`` blocks of ``n_seq_tokens`` rows).

    Example:
        >>> [idx.tolist() for idx in split_equal([[0], [1], [0], [1], [1]], 8)]
        [[0, 2, 1, 3], [4]]
    """
    sets = _check_split(seq_ids, n_ubatch)
    pending = [(sets[g[0]], list(g)) for g in _groups(sets)]
    out = []
    while pending:
        # shared sets first (they must precede their continuations), then shortest first
        pending.sort(key=lambda item: (-len(item[0]), len(item[1])))
        key, first = pending[0]
        length = min(len(first), n_ubatch)
        chosen = [0]
        if len(key) == 1:
            for j in range(1, len(pending)):
                if len(pending[j][0]) > 1 or (len(chosen) + 1) * length > n_ubatch:
                    break
                chosen.append(j)
        rows = []
        for j in chosen:
            rows.extend(pending[j][1][:length])
            pending[j] = (pending[j][0], pending[j][1][length:])
        pending = [p for p in pending if p[1]]
        out.append(np.asarray(rows))
    return out
