"""Host-side argument checks shared by the public entry points.

Every check runs only on concrete values (Python ints, numpy values, concrete jax arrays): traced
values inside ``jit`` pass through untouched and are guarded on device instead (see
``kvjax.errors``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
#: Positions lie in ``[0, POS_END)``. ``POS_END = 2**31 - 1`` is the seed's "to infinity" (``p1 < 0``
#: in the sequence operations): a token placed or shifted there could never be removed.
POS_END = INT32_MAX


def as_int32(x):
    """An int32 scalar argument for a jitted op.

    Host values become ``np.int32``: strongly typed (the same compiled program as a traced int32)
    and cheap to pass, while ``jnp.asarray`` of a Python int costs a device transfer per argument
    (about 100 us here), more than most ops themselves. jax arrays are cast only when needed.
    """
    if isinstance(x, jax.Array):
        return x if x.dtype == jnp.int32 else x.astype(jnp.int32)
    return np.int32(x)


def is_traced(x) -> bool:
    """Whether ``x`` is an abstract value inside a jax transformation."""
    return isinstance(x, jax.core.Tracer)


def concrete_int(name: str, x):
    """``int(x)`` for a concrete integer scalar, ``None`` when ``x`` is traced.

    Raises:
        ValueError: when ``x`` is not an integer scalar or does not fit in int32. A traced ``x``
            is checked for its static shape and dtype only (a traced float would otherwise be
            truncated to an int32 silently).
    """
    if is_traced(x):
        if x.shape != () or not np.issubdtype(x.dtype, np.integer):
            raise ValueError(
                f"{name} is out of range: allowed an integer scalar, got a traced {x.dtype}{list(x.shape)}"
            )
        return None
    arr = np.asarray(x)
    # a bool is not an id or a position (seq_rm(cache, True) would mean sequence 1)
    if arr.shape != () or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name}={x!r} is out of range: allowed an integer scalar")
    value = int(arr)
    if not INT32_MIN <= value <= INT32_MAX:
        raise ValueError(f"{name}={value} is out of range: allowed [{INT32_MIN}, {INT32_MAX}] (int32)")
    return value


def check_seq_id(name: str, x, n_seq_max: int, *, allow_all: bool) -> None:
    """Check a sequence id against ``[0, n_seq_max)``, or ``[-1, n_seq_max)`` when ``allow_all``."""
    value = concrete_int(name, x)
    if value is None:
        return
    lo = -1 if allow_all else 0
    if not lo <= value < n_seq_max:
        meaning = " (-1 means every sequence)" if allow_all else ""
        raise ValueError(f"{name}={value} is out of range: allowed [{lo}, {n_seq_max}){meaning}")


def check_state_seq(seq_id, n_seq_max: int) -> int:
    """``seq_id`` of a state read or write (host I/O): -1 for the whole memory or a sequence id.

    Example:
        >>> check_state_seq(-1, 4), check_state_seq(3, 4)
        (-1, 3)
    """
    if is_traced(seq_id):
        raise ValueError("seq_id must be a concrete integer (state I/O runs on the host), got a traced value")
    value = concrete_int("seq_id", seq_id)
    if not -1 <= value < n_seq_max:
        raise ValueError(f"seq_id={value} is out of range: allowed -1 (the whole memory) or [0, {n_seq_max})")
    return value


def check_position(name: str, x) -> None:
    """Check a position bound: any int32 (negative values follow the seed's conventions)."""
    concrete_int(name, x)


def check_window(n_kv, padding: int, size: int) -> int:
    """Check a static attention window: a positive multiple of ``padding``, at most ``size``."""
    if is_traced(n_kv):
        raise ValueError(
            "n_kv must be a static Python int (it sets array shapes); pick it on the "
            "host with kvjax.n_kv(cache) or kvjax.window_bucket"
        )
    value = concrete_int("n_kv", n_kv)
    if value <= 0 or value % padding or value > size:
        raise ValueError(
            f"n_kv={value} is out of range: allowed a positive multiple of padding={padding}, at most size={size}"
        )
    return value


def is_int(value) -> bool:
    """Whether ``value`` is a Python or numpy integer (never a bool): the type of a config's sizes.

    Configs are hashable static data, so jax arrays are not sizes here (see ``check_count`` for the
    arguments of an op, which also take concrete JAX scalars).
    """
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def require(ok: bool, name: str, value, allowed: str) -> None:
    """Raise the library's one argument error unless ``ok``: ``name=value is out of range: allowed ...``.

    Example:
        >>> require(False, "size", 7, "a positive multiple of padding=4")
        Traceback (most recent call last):
        ...
        ValueError: size=7 is out of range: allowed a positive multiple of padding=4
    """
    if not ok:
        raise ValueError(f"{name}={value!r} is out of range: allowed {allowed}")


def check_flag(name: str, value, *, optional: bool = False) -> bool:
    """A host flag must be a real bool (``"False"`` is truthy, ``1`` is not a flag); ``None`` too
    when ``optional`` (returned as is).

    Example:
        >>> check_flag("causal", "no")
        Traceback (most recent call last):
        ...
        ValueError: causal='no' is out of range: allowed True or False
    """
    if optional and value is None:
        return None
    require(isinstance(value, (bool, np.bool_)), name, value, "True, False or None" if optional else "True or False")
    return bool(value)


def check_int_values(name: str, x, lo: int, hi: int) -> None:
    """Concrete host integers in ``x`` must lie in ``[lo, hi]`` before anything narrows them to int32.

    ``jnp.asarray`` of a 64-bit or unsigned host array wraps silently (a slot of ``2**32 + 5``
    would become cell 5), so wide host values are checked here first. Traced values and jax arrays
    (already int32) pass: they are guarded on device.

    Example:
        >>> check_int_values("slot", np.array([3, 2**32 + 5]), -1, 2**31 - 1)
        Traceback (most recent call last):
        ...
        ValueError: slot contains 4294967301: allowed [-1, 2147483647] (it would wrap to another value as int32)
    """
    if is_traced(x) or isinstance(x, jax.Array):
        return
    arr = np.asarray(x)
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        return
    low, high = int(arr.min()), int(arr.max())
    if low < lo or high > hi:
        bad = low if low < lo else high
        raise ValueError(f"{name} contains {bad}: allowed [{lo}, {hi}] (it would wrap to another value as int32)")


def check_count(name: str, value, minimum: int = 0, maximum: int = None) -> int:
    """A host count (a length, a number of tokens or sequences): a real integer >= ``minimum``
    (and <= ``maximum`` when given: a count that sets an array's shape or goes to int32).

    Floats are refused rather than truncated (``max_new_tokens=3.9`` is not 3), bools rather than
    taken as 0 or 1.

    Example:
        >>> check_count("n_parallel", 2, 1)
        2
        >>> check_count("n_parallel", 0, 1)
        Traceback (most recent call last):
        ...
        ValueError: n_parallel=0 is out of range: allowed an integer >= 1
    """
    number = _scalar(value, "iu")
    if maximum is None:
        require(number is not None and number >= minimum, name, value, f"an integer >= {minimum}")
    else:
        require(
            number is not None and minimum <= number <= maximum, name, value, f"an integer in [{minimum}, {maximum}]"
        )
    return int(number)


def _scalar(value, kinds: str):
    """A concrete Python, numpy or JAX scalar whose dtype kind is in ``kinds``, as a Python number
    (None otherwise: a bool, a string, an array, a traced value)."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or is_traced(value):
        return None
    if isinstance(value, (int, float)):
        return value if ("f" in kinds or isinstance(value, int)) else None
    try:
        arr = np.asarray(value)
    except Exception:  # noqa: BLE001 - anything numpy cannot read is not a number
        return None
    if arr.ndim != 0 or arr.dtype.kind not in kinds:
        return None
    return arr.item()


def check_real(name: str, value, *, above: float = None, optional: bool = False) -> float:
    """A host real number: a Python, numpy or JAX scalar (int or float, never bool), finite, and
    ``> above`` when given; ``None`` too when ``optional`` (returned as is).

    Example:
        >>> check_real("temperature", np.float32(0.5))
        0.5
        >>> check_real("temperature", "hot")
        Traceback (most recent call last):
        ...
        ValueError: temperature='hot' is out of range: allowed a finite number
    """
    if optional and value is None:
        return None
    number = _scalar(value, "iuf")
    allowed = "a finite number" + ("" if above is None else f" > {above:g}") + (" (or None)" if optional else "")
    try:
        real = None if number is None else float(number)  # a Python int past 2**1024 overflows here
    except OverflowError:
        real = None
    require(real is not None and math.isfinite(real) and (above is None or real > above), name, value, allowed)
    return real
