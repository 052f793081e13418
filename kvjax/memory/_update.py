"""``update``: apply what sequence operations left pending, K-shift first, then defrag (the seed's ``update``).

Both steps are paid only when needed:

- outside ``jit`` the two pending flags (some ``delta != 0``; ``cells.defrag``) are read in one
  small device-to-host transfer, and only the pending steps run;
- inside ``jit`` (the cache is traced) the K-shift sits in a ``lax.cond`` on "some delta is
  non-zero", and defrag is ``kvjax.memory._defrag_moves.run_pending``, itself a ``lax.cond`` on the flag.
  With the cache donated (``jax.jit(kvjax.update, donate_argnums=0)``) the branch not taken costs
  a few microseconds and no copy.

A cache without RoPE parameters (``config.rope is None``: ALiBi or position-free K) has nothing to
rotate: a pending shift only clears the deltas, as the seed does for ``rope_type == NONE``. The
new positions still take effect in masks (causality, windows, ALiBi distances).

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2,
    ...                         rope=kvjax.RopeConfig(n_rot=2))
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1], [[0], [0]]))
    >>> cache = kvjax.seq_add(cache, 0, 0, -1, 3)
    >>> bool(kvjax.has_shift(cache)), bool(kvjax.has_shift(kvjax.update(cache)))
    (True, False)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax.memory._cells import has_shift as _has_shift
from kvjax.memory._defrag_moves import run_pending, donating_cache
from kvjax.attn._rope import _k_shift, _shift
from kvjax._jit import donating
from kvjax._validate import is_traced


@jax.jit
def _pending(cells):
    return jnp.stack([_has_shift(cells), cells.defrag])


def _clear_deltas(cache):
    """Without RoPE, K does not depend on position: a shift is only the cells' new positions."""
    return cache.replace(cells=cache.cells.replace(delta=jnp.zeros_like(cache.cells.delta)))


def apply_update(cache, *, donate: bool = False):
    """The unified cache's update: apply a pending K-shift (RoPE by ``delta``), then a pending defrag.

    Args:
        cache: the cache (concrete, or traced inside ``jit``).
        donate: (concrete cache) shift and defrag in place (see :func:`kvjax.k_shift` and
            ``kvjax.memory._defrag.apply_pending``); the input cache's buffers become invalid when a step
            ran. Inside ``jit``, donate the cache to the jitted function instead.

    Returns:
        The cache with no pending shift (every ``delta`` 0) and no pending defrag.

    """
    if is_traced(cache.cells.delta) or is_traced(cache.cells.defrag):
        if cache.config.can_shift:
            cache = jax.lax.cond(_has_shift(cache.cells), _k_shift, lambda c: c, cache)
        else:
            cache = _clear_deltas(cache)
        return run_pending(cache)
    shift, defrag = (bool(x) for x in jax.device_get(_pending(cache.cells)))
    if shift:
        cache = _rotate(cache, donate) if cache.config.can_shift else _clear_deltas(cache)
    if defrag:
        cache = run_pending(cache, donate=donating_cache(cache, bool(donate)))
    return cache


def _rotate(cache, donate: bool):
    """The pending K-shift of a concrete cache, in place when ``donate`` (as :func:`kvjax.k_shift`)."""
    ks, cells = _shift(cache.k, cache.cells, cache.config, donate=donating(bool(donate), cache.cells.pos))
    return cache.replace(k=ks, cells=cells)
