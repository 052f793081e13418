"""The jitted model step: place a ubatch, run the model through the cache, donate the K/V buffers.

One :class:`Step` holds one ``jax.jit`` program per ``(ubatch bucket, window bucket)``: the
ubatch bucket is the ubatch's static shape (length T and sequence-id width M), the window bucket
the static ``n_kv``. Everything else (tokens, positions, sequence ids, the cells, the weights) is
traced, so new values never recompile.

**Who places the ubatch.** The step does: it calls ``kvjax.find_slot`` inside the compiled
program (one dispatch per ubatch instead of two) and returns ``ok``. When ``ok`` is false the
returned cache equals the one passed in (the placement refused, every write was dropped): raise
``kvjax.CacheFullError`` and go on with the returned value. A caller that placed the ubatch
already (to look at the slots first) passes ``slot=`` and the step skips placement. (The seed
places each ubatch on the host before it builds the graph; here placement is part of the
compiled program, which is why the window is chosen before it, below.)

**Which window.** ``n_kv`` must cover every cell the ubatch may land in, so it is chosen on the
host before the call:

- with a dry run of the whole batch (``ok, slots = kvjax.prepare(cache, ubatches)``, what the
  decode driver does), :func:`windows_for` gives the exact window of each ubatch from the slots;
- without one, :func:`window_for` gives a safe bound from the cache's ``cell_max`` and ``head``
  (one small device read): placement never goes past ``max(cell_max, head) + n_tokens``.

Both round up with ``kvjax.window_bucket`` so the number of programs stays small.

**Donation.** The K/V buffers of the cache passed in are donated (updated in place): use the
returned cache, never the old one, after a step. The cells are not donated, so a reference to
``cache.cells`` kept before the step is a valid snapshot to restore on failure (the seed's
``restore``), as ``docs/architecture.md`` describes.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig, make_step, window_for
    >>> cfg = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
    >>> model = Llama(cfg, rngs=nnx.Rngs(0))
    >>> step, state = make_step(model), nnx.state(model)
    >>> cache = kvjax.init(cfg.cache_config(size=64, n_seq_max=2))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [1], [1]])
    >>> logits, cache, ok = step(state, cache, ub, jnp.array([3, 4, 5, 0]), n_kv=window_for(cache, 3))
    >>> logits.shape, bool(ok), int(kvjax.used_cells(cache))
    ((4, 64), True, 3)
"""

from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax._typing import Array, Bool, Float, Int
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._cells import cell_max
from kvjax.memory._ubatch import Ubatch
from kvjax._validate import check_window

__all__ = ["Step", "make_step", "window_for", "windows_for"]

#: ``apply(state, tokens, cache, ubatch, slot, n_kv) -> (logits, cache)``: the model call a Step runs.
ApplyFn = Callable[[Any, Array, KVCache, Ubatch, Array, int], Tuple[Array, KVCache]]


def _run(apply, contiguous, state, cells, kv, ubatch, tokens, slot, *, n_kv, config):
    cache = KVCache(cells=cells, k=kv[0], v=kv[1], config=config)
    if slot is None:
        cache, slot, ok = kvjax.find_slot(cache, ubatch, contiguous=contiguous)
    else:
        ok = jnp.bool_(True)
    logits, cache = apply(state, tokens, cache, ubatch, slot, n_kv)
    return logits, cache, ok


# One jitted function per (apply, contiguous), so that Steps of models with the same structure
# (equal NNX graphdefs, equal linen modules) share their compiled programs.
_jit_run = functools.lru_cache(maxsize=64)(
    lambda apply, contiguous: jax.jit(functools.partial(_run, apply, contiguous),
                                      static_argnames=("n_kv", "config"), donate_argnames=("kv",)))


class Step:
    """A jitted model step over a kvjax cache (see the module docstring).

    Args:
        apply: ``apply(state, tokens, cache, ubatch, slot, n_kv) -> (logits, cache)`` for a placed
            ubatch (``make_step`` builds it for NNX and linen models). Steps with equal (hashable)
            ``apply`` share their compiled programs.
        contiguous: placement policy passed to ``kvjax.find_slot``.
    """

    def __init__(self, apply: ApplyFn, *, contiguous: bool = True):
        if not callable(apply):
            raise ValueError(f"apply must be callable, got {type(apply).__name__}")
        self.contiguous = bool(contiguous)
        self._jitted = _jit_run(apply, self.contiguous)

    def __call__(self, state, cache: KVCache, ubatch: Ubatch, tokens: Int[Array, "T"], *, n_kv: int,
                 slot: Optional[Int[Array, "T"]] = None
                 ) -> Tuple[Float[Array, "T V"], KVCache, Bool[Array, ""]]:
        """Place ``ubatch`` (unless ``slot`` is given), run the model, return the new cache.

        Args:
            state: the model state (``nnx.state(model)`` for NNX, the variables for linen).
            cache: the cache; its K/V buffers are donated (use the returned cache afterwards).
            ubatch: the tokens' positions and sequences (``kvjax.make_ubatch``).
            tokens: ``i32[T]`` token ids of the ubatch rows.
            n_kv: static window N (:func:`window_for` / :func:`windows_for`).
            slot: ``i32[T]`` cells of an ubatch the caller already placed with ``find_slot``.

        Returns:
            ``(logits f32[T, V], cache, ok)``; when ``ok`` is false nothing was placed or written.

        Raises:
            ValueError: a cache that is not a ``KVCache``, ``n_kv`` outside the allowed windows,
                or tokens / slot whose shape does not match the ubatch.
        """
        require_cache(cache)
        if not isinstance(ubatch, Ubatch):
            raise ValueError(f"ubatch must be a kvjax.Ubatch (see kvjax.make_ubatch), got {type(ubatch).__name__}")
        cfg = cache.config
        n_kv = check_window(n_kv, cfg.padding, cfg.size)
        t = ubatch.length
        tokens = _int_rows("tokens", tokens, t)
        if slot is not None:
            slot = _int_rows("slot", slot, t)
        return self._jitted(state, cache.cells, (cache.k, cache.v), ubatch, tokens, slot, n_kv=n_kv, config=cfg)


def _int_rows(name, x, t):
    """``x`` as an integer ``[t]`` array (numpy or jax, as given), or ``ValueError``.

    Reads only ``shape`` and ``dtype`` (cheap on the per-token path; no device sync).
    """
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    if tuple(x.shape) != (t,) or not np.issubdtype(x.dtype, np.integer):
        raise ValueError(f"{name} has shape {tuple(x.shape)} and dtype {x.dtype}: allowed an integer [T] "
                         f"array with T = ubatch.length = {t}")
    return x


@functools.lru_cache(maxsize=64)
def _nnx_apply(graphdef):
    def apply(state, tokens, cache, ubatch, slot, n_kv):
        return nnx.merge(graphdef, state)(tokens, cache, ubatch, slot, n_kv=n_kv)
    return apply


@functools.lru_cache(maxsize=64)
def _linen_apply(module):
    def apply(variables, tokens, cache, ubatch, slot, n_kv):
        return module.apply(variables, tokens, cache, ubatch, slot, n_kv=n_kv)
    return apply


def make_step(model, *, contiguous: bool = True) -> Step:
    """A :class:`Step` for an NNX model, a linen module, or an ``apply`` function.

    Steps made for models of the same structure (the same NNX graph, equal linen modules) share
    their compiled programs, whatever the weights.

    Args:
        model: an ``nnx.Module`` called as ``model(tokens, cache, ubatch, slot, n_kv=...)`` (pass
            ``nnx.state(model)`` as the step's state); a linen ``nn.Module`` with the same
            ``__call__`` (pass its variables); or an ``apply`` function (see :class:`Step`).
        contiguous: placement policy of ``kvjax.find_slot``.

    Example:
        >>> from flax import nnx
        >>> from kvjax.nn import Llama, LlamaConfig, LlamaLinen, make_step
        >>> cfg = LlamaConfig(n_layer=1)
        >>> a, b = Llama(cfg, rngs=nnx.Rngs(0)), Llama(cfg, rngs=nnx.Rngs(1))
        >>> make_step(a)._jitted is make_step(b)._jitted       # one set of programs for both
        True
        >>> type(make_step(LlamaLinen(cfg))).__name__
        'Step'
    """
    if isinstance(model, nnx.Module):
        apply = _nnx_apply(nnx.graphdef(model))
    elif isinstance(model, nn.Module):
        apply = _linen_apply(model)
    elif callable(model):
        apply = model
    else:
        raise ValueError(f"model must be an nnx.Module, a linen Module or a callable, got {type(model).__name__}")
    return Step(apply, contiguous=contiguous)


@jax.jit
def _needed(cells, n):
    """Cells a window must cover after placing ``n`` more tokens (``n = 0``: as they are)."""
    top = cell_max(cells)
    return jnp.where(n == 0, top, jnp.maximum(top, cells.head) + n)


def _bucket(cache: KVCache, cells_needed: int) -> int:
    cfg = cache.config
    return int(kvjax.window_bucket(int(min(cfg.size, max(cells_needed, 1))), cfg.size, cfg.padding))


def window_for(cache: KVCache, n_tokens: int) -> int:
    """A static window that covers every cell after ``n_tokens`` more tokens are placed.

    With ``n_tokens = 0`` it is the bucket of the cells as they are (``kvjax.n_kv``). Otherwise
    placement (contiguous or scattered) starts at or after ``head`` and never passes
    ``max(cell_max, head) + n_tokens``, because every cell from ``cell_max`` on is free. Reads one
    scalar from the device.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> window_for(cache, 40)
        64
    """
    require_cache(cache)
    n = int(n_tokens)
    if n < 0:
        raise ValueError(f"n_tokens={n} is out of range: allowed >= 0")
    # one small program and one scalar transfer: this runs once per decode step
    return _bucket(cache, int(_needed(cache.cells, np.int32(n))))


def windows_for(cache: KVCache, slots: Sequence[Int[Array, "T"]], *, cell_max_now: Optional[int] = None
                ) -> List[int]:
    """The exact window of each ubatch of a batch, from the slots of ``kvjax.prepare``.

    After ubatch ``i`` is placed the last used cell is the larger of the cache's ``cell_max`` and
    the largest slot of ubatches ``0..i`` (cells are only added during a batch). A caller that
    read ``cell_max`` already (with the slots, in one transfer) passes it as ``cell_max_now``.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=256, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> ubs = [kvjax.make_ubatch(range(0, 40), [[0]] * 40), kvjax.make_ubatch(range(40, 80), [[0]] * 40)]
        >>> ok, slots = kvjax.prepare(cache, ubs)
        >>> windows_for(cache, slots)
        [64, 128]
    """
    require_cache(cache)
    top = int(jax.device_get(cell_max(cache.cells))) if cell_max_now is None else int(cell_max_now)
    out = []
    for slot in jax.device_get(tuple(slots)):
        slot = np.asarray(slot)
        if slot.size:
            top = max(top, int(slot.max()) + 1)
        out.append(_bucket(cache, top))
    return out
