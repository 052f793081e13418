"""A pure-Python model of the hybrid memory: the unified reference and the recurrent one side by side.

Newer llama.cpp's ``llama_memory_hybrid`` with kvjax's all-or-nothing rule: every operation runs on
both parts; a ``seq_rm`` or a placement that either part refuses changes neither (the parts are
restored from a copy). ``seq_pos_min`` is the larger of the parts' minima, ``seq_pos_max`` the
smaller of their maxima; the counts are the attention part's.

Example:
    >>> ref = HybridRef(size=16, n_seq_max=2, padding=16, state_cells=2)
    >>> ref.find_slot([([0, 1, 2], [0])])
    True
    >>> ref.seq_rm(0, 1, -1), ref.attention.used_cells(), ref.seq_pos_max(0)
    (False, 3, 2)
"""

from __future__ import annotations

import copy
from typing import Sequence

from kvjax.testing._recurrent_reference import RecurrentRef, Slot
from kvjax.testing._unified_reference import UnifiedRef


class HybridRef:
    """The two references of a hybrid memory (an attention part and a recurrent part).

    Args:
        size: cells of the attention part.
        n_seq_max: sequence ids.
        padding: the attention part's padding.
        state_cells: cells of the recurrent part.
        n_states: states kept per sequence in the recurrent part.
    """

    def __init__(self, size: int, n_seq_max: int, padding: int, state_cells: int, n_states: int = 1):
        self.attention = UnifiedRef(size, n_seq_max, padding)
        self.recurrent = RecurrentRef(state_cells, n_seq_max, n_states)

    def _all_or_nothing(self, run) -> bool:
        saved = copy.deepcopy((self.attention, self.recurrent))
        if run():
            return True
        self.attention, self.recurrent = saved
        return False

    def find_slot(self, slots: Sequence[Slot]) -> bool:
        """Place an equal-split ubatch in both parts (rows slot major), then the step's inputs."""
        tokens = [(int(p), list(ids)) for positions, ids in slots for p in positions]

        def run():
            if not self.recurrent.find_slot(slots):
                return False
            if not self.attention.find_slot(tokens, True)[-1]:
                return False
            self.recurrent.set_inputs()
            return True

        return self._all_or_nothing(run)

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        return self._all_or_nothing(
            lambda: self.recurrent.seq_rm(seq_id, p0, p1) and self.attention.seq_rm(seq_id, p0, p1) is None
        )

    def seq_cp(self, *args) -> None:
        self.attention.seq_cp(*args)
        self.recurrent.seq_cp(*args)

    def seq_keep(self, seq_id: int) -> None:
        self.attention.seq_keep(seq_id)
        self.recurrent.seq_keep(seq_id)

    def seq_add(self, *args) -> None:
        if not self.recurrent.shift_keeps_states(*args):  # all or nothing, as kvjax's hybrid
            return
        self.attention.seq_add(*args)
        self.recurrent.seq_add(*args)

    def seq_div(self, *args) -> None:
        self.attention.seq_div(*args)
        self.recurrent.seq_div(*args)

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.attention.seq_pos_min(seq_id), self.recurrent.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.attention.seq_pos_max(seq_id), self.recurrent.seq_pos_max(seq_id))

    def used_cells(self) -> int:
        return self.attention.used_cells()

    @property
    def used(self) -> int:
        return self.attention.used

    def clear(self) -> None:
        self.attention.clear()
        self.recurrent.clear()
