"""What a client asks the scheduler for, checked once at the door, and what it gets back.

A :class:`ServeRequest` is a plain value (prompt tokens, sampling, stops, budget, seed): the
HTTP layer builds one from a JSON body, a library user builds one by hand. :func:`check_request`
refuses a malformed one with a ``ValueError`` that names the field and the allowed range, before
the scheduler sees it, so a bad request never reaches the memory.

A :class:`ServeEvent` is what one scheduler step hands back for one request: the tokens it
produced in that step (with their text, and logprobs when asked for) and, on its last event, why
it finished (``finish_reason``: ``"stop"``, ``"length"`` or ``"cancelled"``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

from kvjax._validate import check_count
from kvjax.engine._generate import MAX_NEW_TOKENS, check_prompts
from kvjax.engine._sampling import SamplingConfig

__all__ = ["ServeRequest", "ServeEvent", "TokenLogprob", "FINISH_REASONS", "MAX_LOGPROBS", "check_request"]

#: why a request ended: a stop token or string, its budget or context, or its client left
FINISH_REASONS = ("stop", "length", "cancelled")
#: most alternatives reported per token (OpenAI's limit for ``top_logprobs``)
MAX_LOGPROBS = 20
#: most stop strings per request (OpenAI allows 4; a few more cost nothing)
MAX_STOP_STRINGS = 16
#: seeds are folded into a threefry key: any uint32
SEED_RANGE = (0, 2**32 - 1)


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    """One generation request.

    Attributes:
        prompt: the prompt's token ids (at least one).
        max_tokens: most tokens to generate, ``[1, 2**30]``.
        sampling: the sampling rule (``SamplingConfig(temperature=0)`` for greedy).
        seed: this request's random seed: its ``k``-th token is drawn with
            ``fold_in(PRNGKey(seed), k)``, so what it samples depends on its own seed and logits
            only, never on which other requests share its steps.
        stop_tokens: ids that end the request (the model's EOS ids, say); the stop token itself is
            the last token of the result, as :func:`kvjax.generate` gives it.
        stop: strings that end the request when the generated text contains one (needs a
            scheduler with a tokenizer); the text returned stops before it.
        logprobs: report each token's log-probability and this many most likely alternatives
            (``None``: none; ``0``: the chosen token's only; at most :data:`MAX_LOGPROBS`).
    """

    prompt: Sequence[int]
    max_tokens: int = 16
    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    seed: int = 0
    stop_tokens: Sequence[int] = ()
    stop: Sequence[str] = ()
    logprobs: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model (its raw logits' softmax) and the top alternatives."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


@dataclasses.dataclass
class ServeEvent:
    """What one step produced for one request.

    Attributes:
        request_id: the id :meth:`Scheduler.submit <kvjax.serve.Scheduler.submit>` returned.
        tokens: the new token ids of this step (usually one; a device-loop stretch gives several).
        text: their text, when the scheduler has a tokenizer (held back while it could be the
            start of a stop string; cut before a stop string that matched).
        logprobs: one :class:`TokenLogprob` per token when the request asked for them.
        finish_reason: set on the request's last event: ``"stop"``, ``"length"`` or
            ``"cancelled"``.
        prompt_tokens: the prompt's length (set on the last event; for ``usage``).
        completion_tokens: tokens generated in all (set on the last event).
        cached_tokens: prompt tokens the prompt cache lent (not evaluated again).
    """

    request_id: int
    tokens: List[int] = dataclasses.field(default_factory=list)
    text: str = ""
    logprobs: List[TokenLogprob] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: "ServeEvent") -> "ServeEvent":
        """Add a later event of the same request to this one (its tokens, text, logprobs, finish)."""
        self.tokens += later.tokens
        self.text += later.text
        self.logprobs += later.logprobs
        if later.finished:
            self.finish_reason, self.prompt_tokens = later.finish_reason, later.prompt_tokens
            self.completion_tokens, self.cached_tokens = later.completion_tokens, later.cached_tokens
        return self


def check_request(
    request: ServeRequest, vocab_size: Optional[int], n_ctx: Optional[int], has_tokenizer: bool
) -> ServeRequest:
    """The request with every field checked and normalized (lists, Python ints), or ``ValueError``.

    Args:
        request: the request.
        vocab_size: the model's vocabulary (token ids are checked against it), or None.
        n_ctx: most positions a request may hold (its prompt must be shorter), or None.
        has_tokenizer: whether stop strings can be matched.
    """
    if not isinstance(request, ServeRequest):
        raise ValueError(f"request must be a kvjax.serve.ServeRequest, got {type(request).__name__}")
    prompt = check_prompts([request.prompt], vocab_size, name="prompt")[0]
    if n_ctx is not None and len(prompt) >= n_ctx:
        raise ValueError(
            f"prompt has {len(prompt)} tokens: allowed fewer than the context of n_ctx={n_ctx} positions "
            f"(shorten it, or serve with a larger memory)"
        )
    max_tokens = check_count("max_tokens", request.max_tokens, 1, MAX_NEW_TOKENS)
    if not isinstance(request.sampling, SamplingConfig):
        raise ValueError(f"sampling must be a kvjax.SamplingConfig, got {type(request.sampling).__name__}")
    seed = check_count("seed", request.seed, *SEED_RANGE)
    stops = request.stop_tokens
    if isinstance(stops, (str, bytes)) or not hasattr(stops, "__iter__"):
        raise ValueError(f"stop_tokens={stops!r} is out of range: allowed a list of token ids")
    stop_tokens = check_prompts([list(stops)], vocab_size, name="stop_tokens", allow_empty=True)[0]
    strings = [request.stop] if isinstance(request.stop, str) else request.stop
    if not hasattr(strings, "__iter__") or not all(isinstance(s, str) and s for s in strings):
        raise ValueError(f"stop={request.stop!r} is out of range: allowed non-empty strings")
    strings = list(strings)
    if len(strings) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(strings)} strings: allowed at most {MAX_STOP_STRINGS}")
    if strings and not has_tokenizer:
        raise ValueError("stop strings are out of range on a scheduler without a tokenizer: pass tokenizer=")
    logprobs = None if request.logprobs is None else check_count("logprobs", request.logprobs, 0, MAX_LOGPROBS)
    return dataclasses.replace(
        request,
        prompt=prompt,
        max_tokens=max_tokens,
        seed=seed,
        stop_tokens=tuple(stop_tokens),
        stop=tuple(strings),
        logprobs=logprobs,
    )
