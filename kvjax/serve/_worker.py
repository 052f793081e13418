"""The model thread: steps the scheduler and hands each request's events to whoever waits for them.

The HTTP side never touches the engine: it submits, cancels and queues tasks (all thread-safe
on the :class:`Scheduler`), and receives :class:`ServeEvent` s through a callback per request,
which the HTTP layer points at its asyncio loop (``loop.call_soon_threadsafe``). So a slow
client or a burst of requests never blocks a step, and a step never blocks the event loop.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Optional

import kvjax
from kvjax.serve._request import ServeEvent, ServeRequest
from kvjax.serve._scheduler import Scheduler

__all__ = ["Worker"]

log = logging.getLogger("kvjax.serve")
#: seconds between two reads of the memory's used cells for ``/metrics`` (and after the last step)
GAUGE_EVERY = 0.5


class Worker:
    """A thread that steps ``scheduler`` while there is work, and sleeps when there is none.

    Args:
        scheduler: the scheduler (the worker is the only thread that steps it).
        idle_wait: seconds an idle worker sleeps before it looks again (a submit wakes it at once).
    """

    def __init__(self, scheduler: Scheduler, idle_wait: float = 0.05):
        self.scheduler = scheduler
        self.idle_wait = float(idle_wait)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listeners: Dict[int, Callable[[object], None]] = {}
        self._thread: Optional[threading.Thread] = None
        #: the last step's error (the worker keeps serving; the requests of that step get it)
        self.last_error: Optional[BaseException] = None

    def start(self) -> "Worker":
        self._thread = threading.Thread(target=self._run, name="kvjax-serve-worker", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: ServeRequest, listener: Callable[[object], None]) -> int:
        """Queue ``request``; ``listener(event)`` is called from the worker thread for each of its events
        (and with an exception if a step fails). Raises the scheduler's ``ValueError`` / ``QueueFullError``."""
        with self._lock:
            rid = self.scheduler.submit(request)
            self._listeners[rid] = listener
        self._wake.set()
        return rid

    def cancel(self, rid: int) -> None:
        """End a request (a client left): its cells are freed at the next step."""
        self.scheduler.cancel(rid)
        self._wake.set()

    def call(self, fn):
        """Run ``fn(scheduler)`` on the worker thread between steps; returns a future."""
        future = self.scheduler.call_in_step(fn)
        self._wake.set()
        return future

    def _run(self) -> None:
        scheduler = self.scheduler
        next_gauge = 0.0
        while not self._stop.is_set():
            if scheduler.idle:
                self._wake.wait(self.idle_wait)
                self._wake.clear()
                continue
            try:
                events = scheduler.step()
                if time.monotonic() >= next_gauge or scheduler.idle:  # a device read: not every step
                    scheduler.stats["cells_used"] = int(kvjax.used_cells(scheduler.engine.cache))
                    next_gauge = time.monotonic() + GAUGE_EVERY
            except Exception as err:  # a failed step fails its requests, not the server
                log.exception("a scheduler step failed")
                self.last_error = err
                self._fail_all(err)
                continue
            for ev in events:
                self._deliver(ev)

    def _deliver(self, ev: ServeEvent) -> None:
        with self._lock:
            listener = self._listeners.get(ev.request_id)
            if ev.finished:
                self._listeners.pop(ev.request_id, None)
        if listener is not None:
            listener(ev)

    def _fail_all(self, err: BaseException) -> None:
        """After a failed step: every running and waiting request ends with the error."""
        with self._lock:
            listeners, self._listeners = self._listeners, {}
        for rid, listener in listeners.items():
            self.scheduler.cancel(rid)
            listener(err)
        try:  # free what the cancelled requests held
            self.scheduler.step()
        except Exception:
            log.exception("freeing the failed requests failed too")
