"""The host tier of the prompt cache: parked sequences kept in host memory, under a byte budget.

A parked sequence in device cells costs device memory and widens every other sequence's window
(the attention reads up to the highest used cell). llama.cpp's server keeps a prompt cache in host
RAM (``--cache-ram``) and clears idle slots from the device (``--cache-idle-slots``); this module is
kvjax's twin. An entry is one sequence as the memory's own per-sequence state blob
(:func:`kvjax.state_write` ``(memory, seq_id)``: the seed's layout for attention parts, the recurrent
state rows for recurrent parts), with the tokens it holds. Coming back is :func:`kvjax.state_read`
of that blob into free cells: bit for bit what left, so a request served from the host tier gives
exactly the tokens of one served from device cells.

The store is host bookkeeping only (no device arrays): an ordered map with the least recently used
entry first, a byte budget that counts every entry's blob and tokens, and a longest-common-prefix
match over the entries' tokens in numpy (entries are few: a budget of 8 GiB holds a few hundred
long prompts of a 7B model).

Example:
    >>> import numpy as np
    >>> tier = HostTier(budget_bytes=120)     # an entry costs its blob and its int32 tokens
    >>> tier.put([1, 2, 3], b"x" * 40), tier.put([1, 2, 4, 5], b"y" * 40), tier.nbytes
    (True, True, 108)
    >>> tier.match([1, 2, 4, 5, 6])            # (entry key, common prefix length)
    (2, 4)
    >>> tier.put([7], b"z" * 40)               # over the budget: the least recently used entry leaves
    True
    >>> tier.keys(), tier.nbytes, tier.evictions
    ([2, 3], 100, 1)
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, List, Tuple

import numpy as np

from kvjax._validate import check_count

__all__ = ["HostEntry", "HostTier"]


@dataclasses.dataclass(frozen=True)
class HostEntry:
    """One sequence in host memory.

    Attributes:
        tokens: ``i32[n]`` the tokens the sequence holds at positions ``0..n-1``.
        blob: the memory's per-sequence state blob (``kvjax.state_write(memory, seq_id)``).
    """

    tokens: np.ndarray
    blob: bytes

    @property
    def nbytes(self) -> int:
        """What the entry costs against the budget: its blob and its tokens."""
        return len(self.blob) + self.tokens.nbytes


class HostTier:
    """Sequences in host memory, least recently used first, within ``budget_bytes``.

    Args:
        budget_bytes: most bytes held by all entries together (blobs and tokens), at least 1.
    """

    def __init__(self, budget_bytes: int):
        self.budget_bytes = check_count("budget_bytes", budget_bytes, 1)
        self._entries: "collections.OrderedDict[int, HostEntry]" = collections.OrderedDict()
        self._next_key = 1
        self.nbytes = 0
        #: entries dropped to stay within the budget (or refused as larger than it), since construction
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> List[int]:
        """The entries' keys, least recently used first."""
        return list(self._entries)

    def entry(self, key: int) -> HostEntry:
        return self._entries[key]

    def put(self, tokens: Iterable[int], blob: bytes) -> bool:
        """Keep a sequence; the least recently used entries leave until it fits the budget.

        Returns:
            Whether it was kept (False, and nothing else changed, when it alone exceeds the budget).
        """
        entry = HostEntry(tokens=np.asarray(list(tokens), np.int32), blob=bytes(blob))
        if entry.nbytes > self.budget_bytes:
            self.evictions += 1
            return False
        while self.nbytes + entry.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))
            self.evictions += 1
        key = self._next_key
        self._next_key += 1
        self._entries[key] = entry
        self.nbytes += entry.nbytes
        return True

    def match(self, prompt: Iterable[int]) -> Tuple[int, int]:
        """``(key, length)``: the entry with the longest common prefix with ``prompt`` (ties: the
        most recently used); ``(-1, 0)`` when none shares a first token."""
        prompt = np.asarray(list(prompt), np.int32)
        best, best_len = -1, 0
        for key, entry in self._entries.items():  # least recently used first: a tie goes to the later
            n = min(len(prompt), len(entry.tokens))
            differ = np.flatnonzero(prompt[:n] != entry.tokens[:n])
            common = int(differ[0]) if len(differ) else n
            if common >= best_len and common > 0:
                best, best_len = key, common
        return best, best_len

    def take(self, key: int) -> HostEntry:
        """Remove and return an entry (it is going back to the device)."""
        entry = self._entries[key]
        self._drop(key)
        return entry

    def touch(self, key: int) -> None:
        """Mark an entry as the most recently used."""
        self._entries.move_to_end(key)

    def snapshot(self):
        """What :meth:`restore` needs to undo every change made after this call."""
        return collections.OrderedDict(self._entries), self._next_key, self.nbytes, self.evictions

    def restore(self, snapshot) -> None:
        entries, self._next_key, self.nbytes, self.evictions = snapshot
        self._entries = collections.OrderedDict(entries)

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
