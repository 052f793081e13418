"""SentencePiece-style merging (llama.cpp's ``llama`` vocabularies) in plain Python: :func:`spm_merge`.

The text of one fragment, its spaces already escaped to U+2581, starts as one symbol per
character. Every pair of neighbouring symbols whose concatenation is a vocabulary piece is a
candidate; the candidate with the highest score is merged first (ties: the leftmost), its new
neighbours become candidates, and so on until no neighbouring pair forms a piece. A candidate whose
symbols changed since it was queued is stale and dropped when it comes up. The symbols left are
pieces, except single characters the vocabulary lacks: those fall back to their UTF-8 bytes'
``<0xXX>`` tokens, or, in a vocabulary without them, to one unknown id per character.

Every merge joins two symbols into a vocabulary piece, so a symbol made by merging is always a
piece; only single characters ever need the byte fallback.

Example:
    >>> pieces = {"\\u2581": 0, "a": 1, "b": 2, "ab": 3, "\\u2581ab": 4}
    >>> scores = [0.0, 0.0, 0.0, -1.0, -2.0]
    >>> spm_merge("\\u2581ab", pieces, scores, byte_ids=list(range(100, 356)))
    [4]
    >>> spm_merge("\\u2581ac", pieces, scores, byte_ids=list(range(100, 356)))  # 'c' is byte 0x63
    [0, 1, 199]
    >>> spm_merge("\\u2581ac", pieces, scores, byte_ids=[None] * 256, unk_id=7)   # no byte tokens
    [0, 1, 7]
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence

__all__ = ["spm_merge"]


def spm_merge(
    text: str,
    piece_ids: Dict[str, int],
    scores: Sequence[float],
    byte_ids: Sequence[Optional[int]],
    unk_id: Optional[int] = None,
) -> List[int]:
    """The ids of ``text`` (one fragment, spaces already U+2581) by score-ordered pair merging.

    Args:
        text: the fragment.
        piece_ids: vocabulary piece -> id (every token, whatever its type, as llama.cpp looks up).
        scores: each id's score (higher merges first).
        byte_ids: for each byte value, the id its fallback gives (a ``<0xXX>`` token, else the
            single-byte piece), ``None`` where there is neither.
        unk_id: the id of a character whose bytes lack tokens (``None``: it is dropped).

    Returns:
        The token ids, left to right.
    """
    n = len(text)
    if n == 0:
        return []
    size = [1] * n  # symbol i covers text[i : i + size[i]]; 0 once merged away
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    queue = []
    get = piece_ids.get

    def offer(left: int, right: int) -> None:
        width = size[left] + size[right]
        tid = get(text[left : left + width])
        if tid is not None:
            # heapq pops the smallest: the highest score first, then the leftmost pair
            heapq.heappush(queue, (-scores[tid], left, width, right))

    for i in range(n - 1):
        offer(i, i + 1)
    while queue:
        _, left, width, right = heapq.heappop(queue)
        # stale: one side was merged away, or the right side grew since this pair was queued
        if size[left] == 0 or size[right] == 0 or size[left] + size[right] != width:
            continue
        size[left] = width
        size[right] = 0
        after = nxt[right]
        nxt[left] = after
        if after >= 0:
            prev[after] = left
        if prev[left] >= 0:
            offer(prev[left], left)
        if after >= 0:
            offer(left, after)
    out: List[int] = []
    i = 0
    while i != -1:
        piece = text[i : i + size[i]]
        tid = get(piece)
        if tid is not None:
            out.append(tid)
        else:
            fallback = [byte_ids[b] for b in piece.encode("utf-8", "surrogatepass")]
            if None not in fallback:
                out += fallback
            elif unk_id is not None:
                out.append(unk_id)
        i = nxt[i]
    return out
