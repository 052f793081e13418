"""Errors raised by kvjax, and the sticky error flags that jitted code reports through.

On the host every public op validates its concrete arguments first and raises a ``ValueError``
naming the argument and the allowed range; the cache is immutable, so it is unchanged.
Inside ``jit`` arguments are traced and cannot be checked before running. There an invalid
argument turns the op into a no-op on the cells (or drops the offending write) and sets a bit in
``cells.error``, which stays set until :func:`kvjax.clear_errors`. Read it with
:func:`kvjax.errors` or raise with :func:`kvjax.check`.

Example:
    >>> import jax, kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> bad, ok = jax.jit(kvjax.seq_rm)(cache, 7, 0, -1)   # seq id 7 >= n_seq_max=2: traced, so flagged
    >>> kvjax.errors(bad)
    ['seq_id out of range (an op was skipped)']
"""

from __future__ import annotations

import enum


class CacheFullError(RuntimeError):
    """A batch cannot be placed in the cache; the cache is left as it was before the batch."""


class StateError(ValueError):
    """A state blob does not match the cache (or is corrupt); the cache is left unchanged."""


class ErrorFlag(enum.IntFlag):
    """Bits of ``cells.error`` set by traced calls that received invalid arguments."""

    SEQ_ID = 1
    DIVISOR = 2
    SLOT = 4
    UBATCH = 8
    LAYER = 16
    MAX_MOVES = 32
    OVERFLOW = 64
    STATE_SHIFT = 128
    TOKEN = 256
    WINDOW = 512


ERROR_MESSAGES = {
    ErrorFlag.SEQ_ID: "seq_id out of range (an op was skipped)",
    ErrorFlag.DIVISOR: "seq_div divisor d <= 0 (an op was skipped)",
    ErrorFlag.SLOT: "slot index outside [-1, size) (a write dropped those rows; a model step was skipped)",
    ErrorFlag.UBATCH: "ubatch token with a negative position or a seq id outside [0, n_seq_max) "
    "(find_slot refused the ubatch)",
    ErrorFlag.LAYER: "layer id not cached (the write was dropped)",
    ErrorFlag.MAX_MOVES: "defrag max_moves < 0 (nothing was moved)",
    ErrorFlag.OVERFLOW: "seq_add would push a position to 2**31 - 1 or past it, outside [0, 2**31 - 1) "
    "(an op was skipped)",
    ErrorFlag.STATE_SHIFT: "seq_add would move a recurrent state below position 0; a state holds its whole "
    "sequence, so it is never dropped (the op was skipped)",
    ErrorFlag.TOKEN: "a model step's token id outside [0, vocab_size) (the step was skipped, ok false)",
    ErrorFlag.WINDOW: "a model step's placed cells lie outside the windows it was given (the step was skipped, "
    "ok false; pick windows with kvjax.nn.window_for / windows_for)",
}


# The name a traceback prints is the one users can import: kvjax.StateError, not kvjax._errors.StateError.
for _cls in (CacheFullError, StateError, ErrorFlag):
    _cls.__module__ = "kvjax"


def decode_error_bits(bits: int) -> list[str]:
    """Human-readable messages for the bits set in an error word."""
    return [msg for flag, msg in ERROR_MESSAGES.items() if int(bits) & int(flag)]
