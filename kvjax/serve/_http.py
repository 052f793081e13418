"""The OpenAI-compatible HTTP server (the ``kvjax[serve]`` extra: starlette, sse-starlette, uvicorn,
prometheus-client).

Routes:

==============================  =================================================================
``POST /v1/completions``        a prompt (text or token ids); streamed with ``"stream": true``
``POST /v1/chat/completions``   ``messages`` rendered by the model's chat template
``GET /v1/models``              the one model served
``GET /health``                 ``{"status": "ok"}``
``GET /metrics``                Prometheus text: requests, tokens, queue, running, cells used
``POST /slots/{id}?action=``    llama-server's slot ``save`` / ``restore`` / ``erase`` of a parked
                                sequence to / from a file in ``slot_dir`` (body ``{"filename"}``)
==============================  =================================================================

Every handler is async and only talks to the :class:`Worker` (thread-safe queues); the model
steps on the worker's thread. A streaming client that disconnects has its request cancelled (its
cells freed at the next step). Errors are OpenAI's JSON shape with the field named in ``param``.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import re
import time
from typing import Callable, Optional, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import kvjax
from kvjax.serve import _openai as oa
from kvjax.serve._request import FINISH_REASONS, ServeEvent
from kvjax.serve._scheduler import QueueFullError
from kvjax.serve._worker import Worker

__all__ = ["make_app"]

_SLOT_FILE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(oa.error_body(message, param, code, kind), status_code=status)


def _field_of(message: str) -> Optional[str]:
    """The field a scheduler ``ValueError`` names first (``"max_tokens=0 is out of range"`` -> max_tokens)."""
    match = re.match(r"[\"']?([A-Za-z_]+)", message)
    return match.group(1) if match else None


class _Metrics:
    """The scheduler's counters as Prometheus metrics, read at each scrape."""

    def __init__(self, worker: Worker, size: int):
        self.worker, self.size = worker, size

    def collect(self):
        s = self.worker.scheduler
        stats = dict(s.stats)
        c = CounterMetricFamily("kvjax_requests", "requests submitted", labels=["state"])
        c.add_metric(["submitted"], stats.get("submitted", 0))
        c.add_metric(["rejected"], stats.get("rejected", 0))
        yield c
        f = CounterMetricFamily("kvjax_requests_finished", "requests finished, by reason", labels=["reason"])
        for reason in FINISH_REASONS:
            f.add_metric([reason], stats.get(f"finished_{reason}", 0))
        yield f
        for name, key, text in (
            ("kvjax_prompt_tokens", "prompt_tokens_evaluated", "prompt tokens evaluated"),
            ("kvjax_cached_prompt_tokens", "cached_tokens", "prompt tokens the prompt cache lent"),
            ("kvjax_generated_tokens", "generated_tokens", "tokens generated"),
            ("kvjax_steps", "steps", "model steps"),
            ("kvjax_preemptions", "preemptions", "requests preempted (cells freed, resumed later)"),
            ("kvjax_evictions", "evictions", "parked prefixes evicted to make room"),
            ("kvjax_drafted_tokens", "drafted_tokens", "tokens the draft model proposed (speculative rounds)"),
            ("kvjax_accepted_tokens", "accepted_tokens", "drafted tokens the target kept"),
        ):
            yield CounterMetricFamily(name, text, value=stats.get(key, 0))
        yield GaugeMetricFamily("kvjax_queue_requests", "requests waiting for admission", value=s.queued)
        yield GaugeMetricFamily("kvjax_running_requests", "requests admitted", value=len(s.running))
        yield GaugeMetricFamily("kvjax_cells_used", "memory cells in use", value=stats.get("cells_used", 0))
        yield GaugeMetricFamily("kvjax_cells", "memory cells in all", value=self.size)


def make_app(
    worker: Worker,
    *,
    model_name: str,
    tokenizer,
    render_chat: Callable[[list], Sequence[int]],
    stop_tokens: Sequence[int],
    chat_stop_tokens: Optional[Sequence[int]] = None,
    slot_dir: Optional[pathlib.Path] = None,
) -> Starlette:
    """The Starlette app of a running :class:`Worker` (see the module docstring).

    Args:
        worker: the started worker (its scheduler must have ``tokenizer`` and a prompt cache for slots).
        model_name: the id ``/v1/models`` lists and requests may name.
        tokenizer: the model's :class:`kvjax.nn.Tokenizer`.
        render_chat: ``messages -> token ids`` (the chat template and BOS rule).
        stop_tokens: ids that end a completion (EOS); ``chat_stop_tokens`` those that end a chat
            reply (default the same).
        slot_dir: where slot files live (None: the slot routes answer 501).
    """
    scheduler = worker.scheduler
    chat_stops = list(stop_tokens if chat_stop_tokens is None else chat_stop_tokens)
    registry = CollectorRegistry()
    registry.register(_Metrics(worker, int(scheduler.engine.cache.size)))

    def piece(token: int) -> str:
        return tokenizer.decode([token], skip_special=False)

    async def health(_):
        return JSONResponse({"status": "ok"})

    async def models(_):
        return JSONResponse(
            {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvjax"}]}
        )

    async def metrics(_):
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, chat: bool):
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            return _error(400, f"the body is not valid JSON: {err}")
        try:
            if chat:
                parsed = oa.parse_chat(body, model_name, tokenizer, render_chat, chat_stops)
            else:
                parsed = oa.parse_completion(body, model_name, tokenizer, stop_tokens)
        except oa.RequestError as err:
            return _error(err.status, str(err), err.param, err.code)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            rid = worker.submit(parsed.request, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
        except QueueFullError as err:
            return _error(503, str(err), code="queue_full")
        except ValueError as err:
            return _error(400, str(err), _field_of(str(err)))
        name, created = oa.new_id(chat), int(time.time())
        if parsed.stream:
            return EventSourceResponse(_stream(parsed, rid, name, created, queue), ping=15)
        total = ServeEvent(rid)
        try:
            while True:
                ev = await queue.get()
                if isinstance(ev, BaseException):
                    return _error(500, f"the model step failed: {ev}")
                if total.merge(ev).finished:
                    return JSONResponse(oa.response(parsed, name, created, total, piece))
        finally:
            if total.finish_reason is None:  # the client left (the handler was cancelled)
                worker.cancel(rid)

    async def _stream(parsed, rid, name, created, queue):
        finished = False
        try:
            first = True
            while True:
                ev = await queue.get()
                if isinstance(ev, BaseException):
                    yield {"data": json.dumps(oa.error_body(f"the model step failed: {ev}", kind="server_error"))}
                    finished = True
                    return
                if ev.text or ev.finished or ev.logprobs or first:
                    yield {"data": json.dumps(oa.chunk(parsed, name, created, ev, piece, first))}
                    first = False
                if ev.finished:
                    finished = True
                    if parsed.include_usage:
                        yield {"data": json.dumps(oa.usage_chunk(parsed, name, created, ev))}
                    yield {"data": "[DONE]"}
                    return
        finally:
            if not finished:  # the client disconnected mid-stream: free its sequence
                worker.cancel(rid)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def slots(request: Request):
        if slot_dir is None:
            return _error(501, "slot save/restore is off: start the server with --slot-save-path DIR")
        if scheduler.prompt_cache is None:
            return _error(501, "slot save/restore needs the prompt cache")
        action = request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            return _error(400, f"action={action!r} is out of range: allowed save, restore or erase", "action")
        try:
            slot = int(request.path_params["slot"])
        except ValueError:
            return _error(400, "the slot id must be an integer", "id_slot")
        n_seq = scheduler.engine.cache.n_seq_max
        if not 0 <= slot < n_seq:
            return _error(400, f"id_slot={slot} is out of range: allowed [0, {n_seq})", "id_slot")
        filename = None
        if action != "erase":
            try:
                body = json.loads(await request.body() or b"{}")
            except json.JSONDecodeError as err:
                return _error(400, f"the body is not valid JSON: {err}")
            filename = body.get("filename") if isinstance(body, dict) else None
            if not isinstance(filename, str) or not _SLOT_FILE.match(filename):
                return _error(
                    400,
                    f"filename={filename!r} is out of range: allowed a plain file name (letters, digits, "
                    f"'.', '_', '-'; no folders)",
                    "filename",
                )
        future = worker.call(lambda s: _slot_action(s, action, slot, slot_dir, filename))
        try:
            result = await asyncio.wrap_future(future)
        except ValueError as err:
            return _error(400, str(err), "id_slot")
        except Exception as err:  # a malformed or mismatched file
            return _error(400, f"{type(err).__name__}: {err}", "filename")
        return JSONResponse(result)

    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/slots/{slot}", slots, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _slot_action(scheduler, action: str, slot: int, slot_dir: pathlib.Path, filename: Optional[str]) -> dict:
    """Save, restore or erase sequence ``slot`` (on the worker thread, between steps)."""
    engine, cache = scheduler.engine, scheduler.prompt_cache
    if any(live.seq == slot for live in scheduler.running.values()):
        raise ValueError(f"id_slot={slot} is busy: a running request holds it; try when it has finished")
    t0 = time.perf_counter()
    if action == "save":
        if slot not in cache.parked():
            raise ValueError(f"id_slot={slot} holds no finished request: allowed one of {cache.parked()}")
        tokens = cache.tokens(slot)
        path = slot_dir / filename
        engine.save_sequence(path, slot, tokens)
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "id_slot": slot,
            "filename": filename,
            "n_saved": len(tokens),
            "n_written": path.stat().st_size,
            "timings": {"save_ms": ms},
        }
    if action == "restore":
        path = slot_dir / filename
        if not path.is_file():
            raise FileNotFoundError(f"no slot file {filename!r} in the slot folder")
        tokens = engine.load_sequence(path, slot, prompt_cache=cache)
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "id_slot": slot,
            "filename": filename,
            "n_restored": int(len(tokens)),
            "n_read": path.stat().st_size,
            "timings": {"restore_ms": ms},
        }
    n = len(cache.tokens(slot))
    engine.cache, _ = kvjax.seq_rm(engine.cache, slot)
    cache.forget(slot)
    return {"id_slot": slot, "n_erased": n}
