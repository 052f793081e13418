"""Attention window buckets: a small fixed set of static ``n_kv`` values.

The seed's window ``n_kv = min(size, max(padding, pad(cell_max, padding)))`` changes with the
cache's occupancy, and in JAX every new static ``n_kv`` is a new compilation (about 0.3 s each on
the CPU here). kvjax rounds it up to a bucket instead::

    padding * 2^k  for k = 0, 1, 2, ...  while it is below size,  and then size itself

so attention reads at most twice the cells the seed reads (and never more than the cache), and
the number of compilations is bounded by ``ceil(log2(size / padding)) + 1`` per shape: 11 buckets
for ``size = 32768, padding = 32`` (32, 64, ..., 32768), 8 for ``padding = 256``, 4 for
``size = 2048, padding = 256``. ``min_window`` drops the smallest buckets (fewer compilations,
more cells read while the cache is nearly empty).

The host reads ``n_kv`` after placement (one scalar transfer per step) with :func:`kv_window`,
then calls the jitted step with the bucket as a static argument.

Example:
    >>> import kvjax
    >>> kvjax.window_buckets(1024, 32)
    (32, 64, 128, 256, 512, 1024)
    >>> [kvjax.window_bucket(n, 1024, 32) for n in (1, 32, 33, 300, 1024)]
    [32, 32, 64, 512, 1024]
"""

from __future__ import annotations

from typing import Optional, Tuple

from kvjax._validate import check_count


def _check_geometry(size, padding, min_window):
    size, padding = check_count("size", size, 1), check_count("padding", padding, 1)
    if size % padding:
        raise ValueError(f"size={size} is out of range: allowed a multiple of padding={padding}")
    if min_window is not None:
        if isinstance(min_window, bool) or not hasattr(min_window, "__index__") or not 0 < int(min_window) <= size:
            raise ValueError(f"min_window={min_window!r} is out of range: allowed an int in [1, size={size}]")
        min_window = int(min_window)
    return size, padding, min_window


def window_buckets(size: int, padding: int, *, min_window: Optional[int] = None) -> Tuple[int, ...]:
    """Every bucket, ascending: ``padding * 2^k`` below ``size``, then ``size``.

    Args:
        size: number of cells C (a multiple of ``padding``).
        padding: the cache's padding.
        min_window: when given, buckets below the one holding ``min_window`` are dropped.

    Example:
        >>> window_buckets(3 * 256, 32), window_buckets(4096, 256, min_window=1000)
        ((32, 64, 128, 256, 512, 768), (1024, 2048, 4096))
    """
    size, padding, min_window = _check_geometry(size, padding, min_window)
    buckets = []
    w = padding
    while w < size:
        buckets.append(w)
        w *= 2
    buckets.append(size)
    if min_window is not None:
        first = next(i for i, b in enumerate(buckets) if b >= min_window)
        buckets = buckets[first:]
    return tuple(buckets)


def window_bucket(n_kv: int, size: int, padding: int, *, min_window: Optional[int] = None) -> int:
    """The smallest bucket holding ``n_kv`` cells (host helper; ``n_kv`` is a Python int).

    Args:
        n_kv: cells attention must see, in ``[0, size]`` (usually the seed's ``n_kv``).
        size: number of cells C.
        padding: the cache's padding.
        min_window: see :func:`window_buckets`.

    Returns:
        A static window: a multiple of ``padding``, at most ``size``, ``>= n_kv``.

    Raises:
        ValueError: ``n_kv`` outside ``[0, size]`` or a bad geometry.

    Example:
        >>> window_bucket(257, 32768, 256), window_bucket(0, 32768, 256, min_window=2048)
        (512, 2048)
    """
    buckets = window_buckets(size, padding, min_window=min_window)
    if isinstance(n_kv, bool) or not hasattr(n_kv, "__index__") or not 0 <= int(n_kv) <= int(size):
        raise ValueError(f"n_kv={n_kv!r} is out of range: allowed an int in [0, size={size}]")
    n = int(n_kv)
    return next(b for b in buckets if b >= n)
