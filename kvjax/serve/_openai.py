"""OpenAI's completions and chat completions, as JSON in and JSON out (no HTTP here).

:func:`parse_completion` / :func:`parse_chat` turn a request body into a :class:`ServeRequest`,
refusing a bad field with :class:`RequestError` (HTTP status, message, the field's name as
``param``), in OpenAI's error shape. The ``*_chunk`` / ``*_response`` functions build the JSON
of a streamed chunk or of a whole response from :class:`ServeEvent` s.

Fields understood: ``model``, ``prompt`` (a string or a list of token ids) / ``messages``,
``max_tokens`` (``max_completion_tokens`` for chat), ``temperature`` ([0, 2]), ``top_p``,
``top_k`` (an extension, as llama-server has), ``seed``, ``stop`` (a string or up to 16),
``stream``, ``stream_options.include_usage``, ``logprobs`` (completions: an int in [0, 5]; chat: a
bool with ``top_logprobs`` in [0, 20]), ``n`` (1 only), ``echo`` (false only). Unknown fields are
ignored, as OpenAI's own server ignores the ones it does not know about.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Dict, List, Optional, Sequence

from kvjax.engine._generate import MAX_NEW_TOKENS
from kvjax.engine._sampling import SamplingConfig
from kvjax.serve._request import MAX_LOGPROBS, MAX_STOP_STRINGS, SEED_RANGE, ServeEvent, ServeRequest, TokenLogprob

__all__ = ["RequestError", "Parsed", "parse_completion", "parse_chat", "error_body"]

#: OpenAI's bounds
MAX_TEMPERATURE = 2.0
MAX_COMPLETION_LOGPROBS = 5


class RequestError(ValueError):
    """A request the server refuses: ``status`` (HTTP), the message, and the field (``param``)."""

    def __init__(self, message: str, param: Optional[str] = None, status: int = 400, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def error_body(
    message: str, param: Optional[str] = None, code: Optional[str] = None, kind: str = "invalid_request_error"
):
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class Parsed:
    """A checked request body: what to submit and how to answer."""

    request: ServeRequest
    stream: bool
    include_usage: bool
    chat: bool
    model: str


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not lo <= value <= hi:
        kind = "an integer" if integer else "a number"
        raise RequestError(f"'{name}' is {value!r}: allowed {kind} in [{lo}, {hi}]", name)
    return value


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' is {value!r}: allowed true or false", name)
    return value


def _common(body, model_name: str, chat: bool):
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    model = body.get("model", model_name)
    if not isinstance(model, str):
        raise RequestError(f"'model' is {model!r}: allowed a string", "model")
    if model not in (model_name, ""):
        raise RequestError(
            f"the model '{model}' does not exist: this server serves '{model_name}' (GET /v1/models)",
            "model",
            status=404,
            code="model_not_found",
        )
    _number(body, "n", 1, 1, 1, integer=True)  # one choice per request
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _number(body, name, 16 if not chat else MAX_NEW_TOKENS, 1, MAX_NEW_TOKENS, integer=True)
    temperature = _number(body, "temperature", 1.0, 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise RequestError("'top_p' is 0: allowed (0, 1]", "top_p")
    top_k = _number(body, "top_k", 0, 0, 2**31 - 1, integer=True)
    seed = body.get("seed")
    seed = int(time.time_ns() % (2**32)) if seed is None else _number(body, "seed", 0, *SEED_RANGE, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP_STRINGS:
        raise RequestError(
            f"'stop' is {stop!r}: allowed a non-empty string or a list of up to {MAX_STOP_STRINGS}", "stop"
        )
    stream = _flag(body, "stream", False)
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    include_usage = _flag(options, "include_usage", False)
    sampling = SamplingConfig(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    return model_name, max_tokens, sampling, seed, stop, stream, include_usage


def parse_completion(body, model_name: str, tokenizer, stop_tokens: Sequence[int]) -> Parsed:
    """``/v1/completions``: a prompt string (tokenized with BOS as the model wants) or token ids."""
    model, max_tokens, sampling, seed, stop, stream, include_usage = _common(body, model_name, chat=False)
    if _flag(body, "echo", False):
        raise RequestError("'echo' is true: allowed false (the prompt is not returned)", "echo")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise RequestError("'prompt' is empty: allowed a non-empty string or token ids", "prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise RequestError(
            "'prompt' must be a non-empty string or a list of token ids (one prompt per request)", "prompt"
        )
    logprobs = body.get("logprobs")
    if logprobs is not None:
        logprobs = _number(body, "logprobs", 0, 0, MAX_COMPLETION_LOGPROBS, integer=True)
    request = ServeRequest(ids, max_tokens, sampling, seed, tuple(stop_tokens), tuple(stop), logprobs)
    return Parsed(request, stream, include_usage, False, model)


def parse_chat(body, model_name: str, tokenizer, render, stop_tokens: Sequence[int]) -> Parsed:
    """``/v1/chat/completions``: ``messages`` rendered by ``render(messages) -> ids`` (the chat template)."""
    model, max_tokens, sampling, seed, stop, stream, include_usage = _common(body, model_name, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RequestError(f"'messages[{i}]' must be an object with a string 'role'", f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # OpenAI's content parts: the text ones only
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
            ):
                raise RequestError(f"'messages[{i}].content' parts must be text parts", f"messages[{i}].content")
            messages[i] = dict(m, content="".join(p["text"] for p in content))
        elif not isinstance(content, str):
            raise RequestError(f"'messages[{i}].content' must be a string", f"messages[{i}].content")
    try:
        ids = render(messages)
    except ValueError as err:
        raise RequestError(f"the chat template refused the messages: {err}", "messages") from None
    logprobs = None
    if _flag(body, "logprobs", False):
        logprobs = _number(body, "top_logprobs", 0, 0, MAX_LOGPROBS, integer=True)
    request = ServeRequest(ids, max_tokens, sampling, seed, tuple(stop_tokens), tuple(stop), logprobs)
    return Parsed(request, stream, include_usage, True, model)


# -- responses --------------------------------------------------------------------------------------


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(ev: ServeEvent) -> Dict[str, object]:
    return {
        "prompt_tokens": ev.prompt_tokens,
        "completion_tokens": ev.completion_tokens,
        "total_tokens": ev.prompt_tokens + ev.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": ev.cached_tokens},
    }


def _finish(reason: Optional[str]) -> Optional[str]:
    return None if reason is None else ("stop" if reason == "cancelled" else reason)


def completion_logprobs(logprobs: List[TokenLogprob], piece) -> Optional[dict]:
    """The legacy completions ``logprobs`` object (``piece(id) -> str``)."""
    if not logprobs:
        return None
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for lp in logprobs:
        text = piece(lp.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp.logprob)
        out["top_logprobs"].append({piece(t): v for t, v in lp.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def chat_logprobs(logprobs: List[TokenLogprob], piece) -> Optional[dict]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if not logprobs:
        return None

    def entry(token, value):
        text = piece(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [dict(entry(lp.token, lp.logprob), top_logprobs=[entry(t, v) for t, v in lp.top]) for lp in logprobs]
    }


def _choice(parsed: Parsed, ev: ServeEvent, piece, text_field: dict) -> dict:
    """One choice: its text (``text_field``: ``delta``, ``message`` or ``text``), logprobs and finish."""
    logprobs = chat_logprobs if parsed.chat else completion_logprobs
    return {
        "index": 0,
        **text_field,
        "logprobs": logprobs(ev.logprobs, piece),
        "finish_reason": _finish(ev.finish_reason),
    }


def chunk(parsed: Parsed, rid: str, created: int, ev: ServeEvent, piece, first: bool) -> dict:
    """One streamed chunk for ``ev`` (its text delta, and the finish reason on the last)."""
    if parsed.chat:
        delta = {"role": "assistant", "content": ev.text} if first else ({"content": ev.text} if ev.text else {})
        choice, kind = _choice(parsed, ev, piece, {"delta": delta}), "chat.completion.chunk"
    else:
        choice, kind = _choice(parsed, ev, piece, {"text": ev.text}), "text_completion"
    out = {"id": rid, "object": kind, "created": created, "model": parsed.model, "choices": [choice]}
    if parsed.include_usage:
        out["usage"] = None
    return out


def usage_chunk(parsed: Parsed, rid: str, created: int, ev: ServeEvent) -> dict:
    kind = "chat.completion.chunk" if parsed.chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": parsed.model, "choices": [], "usage": usage(ev)}


def response(parsed: Parsed, rid: str, created: int, ev: ServeEvent, piece) -> dict:
    """The whole (not streamed) response; ``ev`` holds every token, the text and the finish."""
    if parsed.chat:
        message = {"message": {"role": "assistant", "content": ev.text}}
        choice, kind = _choice(parsed, ev, piece, message), "chat.completion"
    else:
        choice, kind = _choice(parsed, ev, piece, {"text": ev.text}), "text_completion"
    return {
        "id": rid,
        "object": kind,
        "created": created,
        "model": parsed.model,
        "choices": [choice],
        "usage": usage(ev),
    }
