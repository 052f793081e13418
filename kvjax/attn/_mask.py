"""KQ masks and T5 relative position buckets between the cells and the tokens of a ubatch.

The seed builds the mask on the host, cell by cell, in ``set_input_kq_mask``. Here it is one
fused elementwise program over ``[T, N]`` (tokens x the first ``N = n_kv`` cells), built on the
device from the cells' ``(pos, seq)`` and the ubatch's ``(pos, seq0)``, so one compilation serves
every cell state, ubatch and position.

A cell ``i`` is visible to token ``j`` when all of these hold (``p0`` the cell's position, ``p1``
the token's)::

    the cell holds the token's first sequence ubatch.seq0[j]   (an empty cell holds none)
    not (causal and p0 > p1)                                   (no future cells)
    not is_masked_swa(p0, p1)                                  (p0 < 0, or outside the window)

with the sliding-window kinds of :class:`kvjax.SwaType`:

    ========== =====================================
    none       never masked
    standard   masked when ``p1 - p0 >= n_swa``
    chunked    masked when ``p0 < (p1 // n_swa) * n_swa``
    symmetric  masked when ``|p1 - p0| > n_swa // 2``
    ========== =====================================

The additive mask is 0 for visible entries (``-|p0 - p1|`` with ALiBi) and ``-inf`` otherwise;
padded ubatch rows are ``-inf`` everywhere. A picture, 2 cells of sequence 0 already cached and a
3-token ubatch of sequence 0 placed after them (``x`` visible, ``-`` masked)::

    causal        non-causal
    xxx-----      xxxxx---
    xxxx----      xxxxx---
    xxxxx---      xxxxx---

Differences from the seed: the mask has exactly ``T`` rows (the ubatch's static length bucket,
whose invalid rows are the padded ones) instead of ``GGML_PAD(n_tokens, GGML_KQ_MASK_PAD)`` rows,
because the JAX attention consumes ``[T, N]`` directly; and the symmetric window of newer llama.cpp
is supported. Everything else follows the seed's loops exactly.

Example:
    >>> import kvjax
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0], [0], [1]])
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> kvjax.kq_mask_bool(cache, ub, 32)[:3, :4].astype(int).tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0]]
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Union

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Bool, Float, Int
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._seqbits import holds
from kvjax.memory._cells import Cells
from kvjax.memory._config import SwaType
from kvjax.memory._ubatch import Ubatch
from kvjax._validate import check_count, check_flag, check_window

#: T5's default ``max_distance`` (the seed hard-codes 128 as well).
T5_MAX_DISTANCE = 128


# -- validation ---------------------------------------------------------------------------------


def _check_args(cache, ubatch, n_kv) -> int:
    require_cache(cache, "a mask")
    if not isinstance(ubatch, Ubatch):
        raise ValueError(f"ubatch must be a kvjax.Ubatch (see kvjax.make_ubatch), got {type(ubatch).__name__}")
    cfg = cache.config
    return check_window(n_kv, cfg.padding, cfg.size)


def _swa_args(cache: KVCache, swa_type, n_swa):
    """The sliding window to apply: the config's, or the per-call override (validated)."""
    cfg = cache.config
    kind = cfg.swa_type if swa_type is None else swa_type
    try:
        kind = SwaType(kind)
    except ValueError:
        raise ValueError(f"swa_type={swa_type!r} is not a sliding-window kind: allowed "
                         f"{[s.value for s in SwaType]}") from None
    if n_swa is None:
        n_swa = cfg.n_swa
    if isinstance(n_swa, bool) or not hasattr(n_swa, "__index__"):
        raise ValueError(f"n_swa={n_swa!r} must be a Python int")
    n_swa = int(n_swa)
    if kind != SwaType.NONE and n_swa <= 0:
        raise ValueError(f"n_swa={n_swa} is out of range: allowed > 0 when swa_type={kind.value!r}")
    if n_swa < 0:
        raise ValueError(f"n_swa={n_swa} is out of range: allowed >= 0")
    return kind, (n_swa if kind != SwaType.NONE else 0)


# -- building blocks ----------------------------------------------------------------------------


def is_masked_swa(p0: Int[Array, "..."], p1: Int[Array, "..."], swa_type: SwaType,
                  n_swa: int) -> Bool[Array, "..."]:
    """The seed's ``is_masked_swa`` (plus the symmetric kind), elementwise on broadcast arrays.

    ``p0`` is the cell's position (``< 0`` for an empty cell: always masked), ``p1`` the token's.

    Example:
        >>> import jax.numpy as jnp
        >>> p0 = jnp.arange(6)
        >>> is_masked_swa(p0, 5, SwaType.STANDARD, 3).astype(int).tolist()
        [1, 1, 1, 0, 0, 0]
        >>> is_masked_swa(p0, 5, SwaType.CHUNKED, 4).astype(int).tolist()
        [1, 1, 1, 1, 0, 0]
    """
    swa_type = SwaType(swa_type)
    masked = p0 < 0
    if swa_type == SwaType.STANDARD:
        masked = masked | (p1 - p0 >= n_swa)
    elif swa_type == SwaType.CHUNKED:
        masked = masked | (p0 < (p1 // n_swa) * n_swa)
    elif swa_type == SwaType.SYMMETRIC:
        half = n_swa // 2
        masked = masked | (jnp.abs(p1 - p0) > half)
    return masked


def _member(cells: Cells, n_kv: int, seq0: Int[Array, " T"]) -> Bool[Array, "T N"]:
    """Whether each of the first ``n_kv`` cells holds each token's sequence (False for id < 0)."""
    return holds(cells.seq[:n_kv].T, seq0)  # padding (-1) and ids >= 32 W: held by no cell


def _visible(cells: Cells, ubatch: Ubatch, n_kv: int, causal: bool, swa_type: SwaType,
             n_swa: int) -> Bool[Array, "T N"]:
    p0 = cells.pos[:n_kv][None, :]
    p1 = jnp.asarray(ubatch.pos, jnp.int32)[:, None]
    seq0 = jnp.asarray(ubatch.seq0, jnp.int32)
    visible = _member(cells, n_kv, seq0) & ~is_masked_swa(p0, p1, swa_type, n_swa)
    if causal:
        visible = visible & (p0 <= p1)
    return visible


@functools.partial(jax.jit, static_argnames=("n_kv", "causal", "swa_type", "n_swa"))
def _mask_bool(cells, ubatch, n_kv, causal, swa_type, n_swa):
    return _visible(cells, ubatch, n_kv, causal, swa_type, n_swa)


@functools.partial(jax.jit, static_argnames=("n_kv", "causal", "alibi", "swa_type", "n_swa"))
def _mask_additive(cells, ubatch, n_kv, causal, alibi, swa_type, n_swa):
    visible = _visible(cells, ubatch, n_kv, causal, swa_type, n_swa)
    if alibi:
        dist = jnp.abs(cells.pos[:n_kv][None, :] - jnp.asarray(ubatch.pos, jnp.int32)[:, None])
        value = (-dist).astype(jnp.float32)  # negate the integer, as the seed: +0.0 at distance 0
    else:
        value = jnp.float32(0)
    return jnp.where(visible, value, -jnp.inf).astype(jnp.float32)


# -- public -------------------------------------------------------------------------------------


def kq_mask(cache: KVCache, ubatch: Ubatch, n_kv: int, *, causal: bool = True, alibi: bool = False,
            swa_type: Union[None, SwaType, str] = None, n_swa: Optional[int] = None
            ) -> Float[Array, "T N"]:
    """The additive attention mask of a ubatch over the first ``n_kv`` cells (``set_input_kq_mask``).

    Args:
        cache: the cache, with the ubatch already placed (``find_slot``).
        ubatch: the tokens; padded rows come out fully masked.
        n_kv: static window N, a positive multiple of ``padding``, at most ``size`` (see
            :func:`kvjax.kv_window`).
        causal: mask cells in the future of the token (``p_cell > p_token``).
        alibi: visible entries carry ``-|p_cell - p_token|`` instead of 0 (the ALiBi distance,
            to be scaled per head by the model's slopes).
        swa_type: sliding-window kind; default ``cache.config.swa_type``. Models with per-layer
            windows pass it per call (one compilation per distinct window).
        n_swa: sliding-window size; default ``cache.config.n_swa``.

    Returns:
        ``f32[T, N]``: 0 (or the ALiBi distance) where visible, ``-inf`` elsewhere.

    Raises:
        ValueError: for a bad ``n_kv``, an unknown ``swa_type``, or ``n_swa <= 0`` with a window.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> ub = kvjax.make_ubatch([0, 1, 2], [[0]] * 3)
        >>> cache, _, _ = kvjax.find_slot(cache, ub)
        >>> kvjax.kq_mask(cache, ub, 32, alibi=True)[2, :4].tolist()
        [-2.0, -1.0, 0.0, -inf]
        >>> kvjax.kq_mask(cache, ub, 32, swa_type="standard", n_swa=2)[2, :4].tolist()
        [-inf, 0.0, 0.0, -inf]
    """
    n_kv = _check_args(cache, ubatch, n_kv)
    kind, window = _swa_args(cache, swa_type, n_swa)
    return _mask_additive(cache.cells, ubatch, n_kv=n_kv, causal=check_flag("causal", causal), alibi=check_flag("alibi", alibi),
                          swa_type=kind, n_swa=window)


def kq_mask_bool(cache: KVCache, ubatch: Ubatch, n_kv: int, *, causal: bool = True,
                 alibi: bool = False, swa_type: Union[None, SwaType, str] = None,
                 n_swa: Optional[int] = None) -> Bool[Array, "T N"]:
    """The visibility form of :func:`kq_mask` (``True`` = visible), for boolean-mask attention.

    Takes the same arguments as :func:`kq_mask`. ALiBi is a bias, not a visibility rule, so it
    cannot be expressed here: ``alibi=True`` raises (use :func:`kq_mask`, or pass the distances as
    ``bias`` to :func:`kvjax.attention`).

    Returns:
        ``bool[T, N]``.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> ub = kvjax.make_ubatch([0, 1], [[0]] * 2)
        >>> cache, _, _ = kvjax.find_slot(cache, ub)
        >>> kvjax.kq_mask_bool(cache, ub, 32, causal=False)[:, :3].tolist()
        [[True, True, False], [True, True, False]]
    """
    n_kv = _check_args(cache, ubatch, n_kv)
    if alibi:
        raise ValueError("alibi=True has no boolean form: use kvjax.kq_mask for the additive mask "
                         "with ALiBi distances")
    kind, window = _swa_args(cache, swa_type, n_swa)
    return _mask_bool(cache.cells, ubatch, n_kv=n_kv, causal=check_flag("causal", causal), swa_type=kind, n_swa=window)


def _relative_bucket(rel: Int[Array, "..."], n_buckets: int, bidirectional: bool,
                     max_distance: int) -> Int[Array, "..."]:
    """T5's bucket of ``rel = memory_position - query_position``.

    Half of the (per-direction) buckets hold exact distances ``0 .. max_exact - 1``; the rest are
    logarithmically spaced up to ``max_distance``, beyond which everything shares the last bucket.
    Bidirectional: the buckets are split in two halves, the upper half for ``rel > 0``.
    """
    bucket = jnp.zeros_like(rel)
    if bidirectional:
        n_buckets //= 2
        bucket = bucket + jnp.where(rel > 0, n_buckets, 0)
        dist = jnp.abs(rel)
    else:
        dist = -jnp.minimum(rel, 0)
    max_exact = n_buckets // 2
    safe = jnp.maximum(dist, 1).astype(jnp.float32)
    log_ratio = jnp.log(safe / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + jnp.floor(log_ratio * (n_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, n_buckets - 1)
    return (bucket + jnp.where(dist < max_exact, dist, large)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("n_kv", "n_buckets", "bidirectional", "max_distance"))
def _pos_bucket(cells, ubatch, n_kv, n_buckets, bidirectional, max_distance):
    rel = cells.pos[:n_kv][None, :] - jnp.asarray(ubatch.pos, jnp.int32)[:, None]
    # an empty cell (-1) against a token at 2**31 - 1 (a hand-built ubatch: make_ubatch refuses it)
    # gives -2**31, whose distance does not fit int32: any distance that far shares the last bucket
    rel = jnp.maximum(rel, -jnp.iinfo(jnp.int32).max)
    return _relative_bucket(rel, n_buckets, bidirectional, max_distance)


def pos_bucket(cache: KVCache, ubatch: Ubatch, n_kv: int, n_buckets: int, *, bidirectional: bool = False,
               max_distance: int = T5_MAX_DISTANCE) -> Int[Array, "T N"]:
    """T5 relative-position buckets between each token and the first ``n_kv`` cells.

    The seed's ``set_input_pos_bucket``: bucket of ``p_cell - p_token`` for every pair, empty
    cells included (their ``pos`` is -1; the mask hides them anyway), padded rows at position 0.

    Args:
        cache: the cache.
        ubatch: the tokens.
        n_kv: static window N (as for :func:`kq_mask`).
        n_buckets: number of buckets (``n_rel_attn_bkts``), >= 2, >= 4 when bidirectional.
        bidirectional: separate buckets for cells after the token (encoders).
        max_distance: distance from which everything shares the last bucket (T5: 128).

    Returns:
        ``i32[T, N]`` buckets in ``[0, n_buckets)``.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> ub = kvjax.make_ubatch(range(0, 320, 10), [[0]] * 32)
        >>> cache, _, _ = kvjax.find_slot(cache, ub)
        >>> kvjax.pos_bucket(cache, ub, 32, 32)[31, ::4].tolist()
        [31, 31, 31, 31, 31, 30, 27, 20]
    """
    n_kv = _check_args(cache, ubatch, n_kv)
    n_buckets = _positive_int("n_buckets", n_buckets)
    lowest = 4 if bidirectional else 2
    if n_buckets < lowest:
        raise ValueError(f"n_buckets={n_buckets} is out of range: allowed >= {lowest}"
                         f"{' when bidirectional' if bidirectional else ''}")
    max_exact = (n_buckets // 2 if bidirectional else n_buckets) // 2
    max_distance = _positive_int("max_distance", max_distance)
    if max_distance <= max_exact:
        raise ValueError(f"max_distance={max_distance} is out of range: allowed > {max_exact} "
                         f"(the exact buckets)")
    return _pos_bucket(cache.cells, ubatch, n_kv=n_kv, n_buckets=n_buckets,
                       bidirectional=check_flag("bidirectional", bidirectional), max_distance=max_distance)


def _positive_int(name, value) -> int:
    return check_count(name, value, 1)
