"""Counting XLA compilations (and the seconds spent tracing, lowering and compiling), so that speed
is reported without compile time mixed in and tests can show that new argument values never recompile.

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
#: every stage of turning a traced call into a program: tracing, lowering, the backend compile
_STAGES = (_EVENT, "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_COMPILES = [0]
_SECONDS = [0.0]


def _listener(name, duration, **kwargs):
    if name == _EVENT:
        _COMPILES[0] += 1
    if name in _STAGES:
        _SECONDS[0] += duration


monitoring.register_event_duration_secs_listener(_listener)


def total_compiles() -> int:
    """XLA backend compilations in this process since kvjax was imported."""
    return _COMPILES[0]


def total_compile_seconds() -> float:
    """Seconds spent tracing, lowering and compiling in this process since kvjax was imported."""
    return _SECONDS[0]


class CompileCounter:
    """Counts XLA backend compilations inside a ``with`` block (``.count``) and the seconds spent
    tracing, lowering and compiling (``.seconds``; a program found in the persistent compilation
    cache is traced and lowered but not compiled)."""

    def __init__(self):
        self.count = 0
        self.seconds = 0.0
        self._start = (0, 0.0)

    def __enter__(self):
        self._start = (_COMPILES[0], _SECONDS[0])
        return self

    def __exit__(self, *exc):
        self.count = _COMPILES[0] - self._start[0]
        self.seconds = _SECONDS[0] - self._start[1]
        return False
