"""Serving: continuous batching on the pure cache, and an OpenAI-compatible HTTP server.

- :class:`Scheduler`: requests join and leave between steps; every step mixes decode tokens and
  prompt chunks of many requests under a token budget (``kvjax/serve/_scheduler.py``).
- :class:`ServeRequest` / :class:`ServeEvent`: what a client asks for and what each step gives back.
- ``python -m kvjax serve --model PATH``: the HTTP server (``kvjax/serve/_http.py``; needs the
  ``kvjax[serve]`` extra: starlette, uvicorn, sse-starlette, prometheus-client).

See docs/serving.md.
"""

from kvjax.serve._plot import plot_steps
from kvjax.serve._request import FINISH_REASONS, ServeEvent, ServeRequest, TokenLogprob
from kvjax.serve._scheduler import CONTEXT_POLICIES, QueueFullError, Scheduler

__all__ = [
    "Scheduler",
    "ServeRequest",
    "ServeEvent",
    "TokenLogprob",
    "QueueFullError",
    "FINISH_REASONS",
    "CONTEXT_POLICIES",
    "plot_steps",
]
