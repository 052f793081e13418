"""A request's text as its tokens come, cut before a stop string, streaming-safe.

Text that could still become a stop string is held back (``"Obs"`` while ``"Observation:"`` is a
stop string), so a streamed reply never shows the start of a stop string it then takes back, as
llama-server and OpenAI do. Incomplete UTF-8 is the tokenizer's :class:`StreamDecoder`'s job.

Example:
    >>> from tokenizers import Tokenizer as Backend, models
    >>> from kvjax.nn import Tokenizer
    >>> tok = Tokenizer(Backend(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a")))
    >>> text = StopText(tok, ["b c"])
    >>> [text.push(t) for t in (0, 1, 2)]          # "b" is held: it may start "b c"
    [('a', False), (' ', False), ('', True)]
"""

from __future__ import annotations

from typing import Sequence, Tuple

__all__ = ["StopText"]


class StopText:
    """The text of one request's generated tokens, and whether a stop string ended it.

    Args:
        tokenizer: a :class:`kvjax.nn.Tokenizer`.
        stops: the stop strings (may be empty: then text passes straight through).
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.stream = tokenizer.stream()
        self.stops = tuple(stops)
        self.held = ""

    def push(self, token: int) -> Tuple[str, bool]:
        """Add a token; return ``(text to hand out now, whether a stop string matched)``.

        After a match, the text handed out ends just before the stop string; nothing more comes.
        """
        self.held += self.stream.push(token)
        if not self.stops:
            out, self.held = self.held, ""
            return out, False
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            out, self.held = self.held[:cut], ""
            return out, True
        keep = self._partial()
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out, False

    def flush(self) -> str:
        """What is left at the end (held text and any incomplete character): the request is over."""
        out, self.held = self.held + self.stream.flush(), ""
        return out

    def _partial(self) -> int:
        """Length of the longest end of the held text that is the start of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.held)), best, -1):
                if self.held.endswith(stop[:n]):
                    best = n
                    break
        return best
