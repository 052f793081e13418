"""A pure-Python model of per-sequence streams (newer llama.cpp's ``llama_kv_cache``, ``kv_unified = false``).

One :class:`UnifiedRef` per stream, plus the rules between streams, written from llama.cpp's
description and independent of kvjax's vectorized code:

- sequence ``s`` lives in stream ``s * n_stream // n_seq_max``; an operation on a sequence runs
  on its stream only, ``seq_id = -1`` on every stream; ``seq_keep`` runs on every stream (the
  others hold no cell of the sequence and are emptied);
- a copy between streams must cover the whole sequence (and, with grouped streams, go into a stream
  holding no other sequence): the destination stream is emptied, takes
  the source's cells (position and pending shift, the destination id only) at the same indices and
  the source's head, and a whole-stream K/V copy is queued (:attr:`StreamsRef.copies`);
- placement puts each stream's tokens with that stream's search, all or nothing;
- counts (``used_cells``, ``n_tokens``) add over streams; ``pos_max`` and ``seq_pos_max`` are the
  largest, ``seq_pos_min`` the smallest held.

Example:
    >>> ref = StreamsRef(size=8, n_seq_max=2, padding=4)
    >>> ref.find_slot([(0, [0]), (1, [0]), (0, [1])])
    ([0, 1, 0], True)
    >>> ref.seq_cp(0, 1, -1, -1)
    >>> [(c.pos, sorted(c.seqs)) for c in ref.streams[1].cells[:2]], ref.copies
    ([(0, [1]), (1, [1])], [(0, 1)])
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

from kvjax.testing._unified_reference import Cell, Token, UnifiedRef


class StreamsRef:
    """Streams of unified caches with llama.cpp's cross-stream rules.

    Args:
        size: cells per stream.
        n_seq_max: number of sequence ids.
        padding: window granularity.
        n_stream: number of streams (default one per sequence).
    """

    def __init__(self, size: int, n_seq_max: int, padding: int, n_stream: int = None):
        self.n_seq_max = n_seq_max
        self.n_stream = n_seq_max if n_stream is None else n_stream
        self.streams = [UnifiedRef(size, n_seq_max, padding) for _ in range(self.n_stream)]
        #: whole-stream K/V copies queued by cross-stream seq_cp, as (source, destination), in order
        self.copies: List[Tuple[int, int]] = []

    def stream_of(self, seq_id: int) -> int:
        return seq_id * self.n_stream // self.n_seq_max

    def _targets(self, seq_id: int) -> List[UnifiedRef]:
        return self.streams if seq_id < 0 else [self.streams[self.stream_of(seq_id)]]

    # -- sequence operations --------------------------------------------------------------

    def clear(self) -> None:
        for st in self.streams:
            st.clear()
        self.copies = []

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> bool:
        for st in self._targets(seq_id):
            st.seq_rm(seq_id, p0, p1)
        return True

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        s0, s1 = self.stream_of(src), self.stream_of(dst)
        if s0 == s1:
            self.streams[s0].seq_cp(src, dst, p0, p1)
            return
        source, target = self.streams[s0], self.streams[s1]
        if p0 > 0 or p1 >= 0:
            raise ValueError("a copy across streams must cover the whole sequence")
        if any(cell.seqs - {dst} for cell in target.cells):
            raise ValueError("a copy across streams may not empty a stream holding other sequences")
        target.clear()
        for i, cell in enumerate(source.cells):
            if src in cell.seqs:
                target.cells[i] = Cell(pos=cell.pos, seqs={dst}, delta=cell.delta)
                target.used += 1
        target.head = source.head
        self.copies.append((s0, s1))

    def seq_keep(self, seq_id: int) -> None:
        for st in self.streams:
            st.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> None:
        for st in self._targets(seq_id):
            st.seq_add(seq_id, p0, p1, delta)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        for st in self._targets(seq_id):
            st.seq_div(seq_id, p0, p1, d)

    def update(self) -> None:
        """Apply the queued copies, then each stream's K-shift (the K/V bytes are not modelled).

        The copies empty their queue; the K-shift applies every cell's pending shift, so every
        ``delta`` becomes 0 (the seed's ``update``; defrag is not modelled: no operation of the
        reference schedules it).
        """
        self.copies = []
        for st in self.streams:
            for cell in st.cells:
                cell.delta = 0

    # -- queries --------------------------------------------------------------------------

    def seq_pos_min(self, seq_id: int) -> int:
        held = [p for p in (st.seq_pos_min(seq_id) for st in self.streams) if p >= 0]
        return min(held) if held else -1

    def seq_pos_max(self, seq_id: int) -> int:
        return max(st.seq_pos_max(seq_id) for st in self.streams)

    def pos_max(self) -> int:
        return max(st.pos_max() for st in self.streams)

    def n_tokens(self) -> int:
        return sum(st.n_tokens() for st in self.streams)

    def used_cells(self) -> int:
        return sum(st.used_cells() for st in self.streams)

    @property
    def used(self) -> int:
        return sum(st.used for st in self.streams)

    # -- placement ------------------------------------------------------------------------

    def find_slot(self, tokens: Sequence[Token], contiguous: bool = True) -> Tuple[List[int], bool]:
        """Place every stream's tokens in that stream; ``(cell of each token, ok)``, all or nothing."""
        by_stream = {}
        for i, (_, seq_ids) in enumerate(tokens):
            streams = {self.stream_of(s) for s in seq_ids}
            if len(streams) != 1:
                return [], False  # a token's sequences must share one stream
            by_stream.setdefault(streams.pop(), []).append(i)
        saved = [(st.head, st.used, [Cell(c.pos, set(c.seqs), c.delta) for c in st.cells]) for st in self.streams]
        cells = [-1] * len(tokens)
        for s, rows in by_stream.items():
            slots, ok = self.streams[s].find_slot([tokens[i] for i in rows], contiguous)
            if not ok:
                for st, (head, used, kept) in zip(self.streams, saved):
                    st.head, st.used, st.cells = head, used, kept
                return [], False
            for i, c in zip(rows, slots):
                cells[i] = c
        return cells, True

    def check_invariants(self) -> None:
        for s, st in enumerate(self.streams):
            st.check_invariants()
            for cell in st.cells:
                assert all(self.stream_of(q) == s for q in cell.seqs), (s, cell)
