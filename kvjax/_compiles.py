"""Counting XLA compilations, to show that new argument values never recompile.

Example:
    >>> import jax
    >>> f = jax.jit(lambda x: x + 1)
    >>> with CompileCounter() as first:
    ...     _ = f(1.0)
    >>> with CompileCounter() as again:
    ...     _ = f(2.0)
    >>> first.count, again.count
    (1, 0)
"""

from __future__ import annotations

from jax import monitoring

_EVENT = "/jax/core/compile/backend_compile_duration"
_COMPILES = [0]


def _listener(name, duration, **kwargs):
    if name == _EVENT:
        _COMPILES[0] += 1


monitoring.register_event_duration_secs_listener(_listener)


def total_compiles() -> int:
    """XLA backend compilations in this process since kvjax was imported."""
    return _COMPILES[0]


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (``.count``)."""

    def __init__(self):
        self.count = 0
        self._start = 0

    def __enter__(self):
        self._start = _COMPILES[0]
        return self

    def __exit__(self, *exc):
        self.count = _COMPILES[0] - self._start
        return False
