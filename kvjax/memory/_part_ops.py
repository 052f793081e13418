"""The public functions of one attention part (a unified cache): its masks, position buckets and K-shift.

``kvjax.kq_mask``, ``kq_mask_bool``, ``pos_bucket`` and ``k_shift`` take a :class:`kvjax.KVCache`
(a memory's ``part(i)``), check their arguments on the host, and run the formulas of
:mod:`kvjax.attn._mask` and :mod:`kvjax.attn._rope`, which take plain arrays and the cells. The
formulas stand below the memories (the cache's own ``update`` runs the K-shift); these entry points
stand above the unified cache, since they name it.
"""

from __future__ import annotations

from typing import Optional, Union

from kvjax._jit import donating
from kvjax._typing import Array, Bool, Float, Int
from kvjax._validate import check_count, check_flag, check_window
from kvjax.attn._mask import T5_MAX_DISTANCE, _mask_additive, _mask_bool, _pos_bucket
from kvjax.attn._rope import _shift
from kvjax.memory._config import SwaType
from kvjax.memory._ubatch import Ubatch
from kvjax.memory._unified import KVCache, require_cache

__all__ = ["kq_mask", "kq_mask_bool", "pos_bucket", "k_shift"]


# -- argument checks ----------------------------------------------------------------------------

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


# -- masks and position buckets ----------------------------------------------------------------


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


# -- K-shift ------------------------------------------------------------------------------------


def k_shift(cache: KVCache, *, donate: bool = False) -> KVCache:
    """Rotate every cell's K by its pending ``delta`` in every cached layer; clear the deltas.

    The seed's ``build_graph_shift``. Cells with ``delta == 0`` (empty ones included) are rotated
    by 0, which leaves them exactly as they are. With ``donate=True`` (or under
    ``jax.jit(..., donate_argnums=0)``) K is rotated in place: the input cache's K buffers become
    invalid, and so does every older snapshot sharing them. Otherwise the result is a new K
    buffer and the input cache is untouched, which costs a fresh allocation of all of K (2-4x the
    in-place time for a 268 MB K here, depending on the allocator; see
    ``benchmarks/bench_attention.py``).
    :func:`kvjax.update` calls this only when some delta is non-zero.

    Args:
        cache: a cache whose config has ``rope`` set.
        donate: reuse the K buffers of ``cache`` for the result.

    Returns:
        The cache with K rotated and every ``delta`` 0.

    Raises:
        ValueError: when ``cache.config.rope`` is None (the cache cannot shift).

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2,
        ...                         rope=kvjax.RopeConfig(n_rot=2))
        >>> cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([5], [[0]]))
        >>> x = jnp.array([[[0.6, 0.8]]])                                   # K before RoPE
        >>> k5 = kvjax.rope(x, jnp.array([5]), cfg.rope[0])                 # cached at position 5
        >>> cache = kvjax.write(cache, 0, slot, k5, k5)
        >>> shifted = kvjax.k_shift(kvjax.seq_add(cache, 0, 0, -1, -5))   # moved to position 0
        >>> bool(jnp.allclose(shifted.k[0][0, 0, 0], x[0, 0], atol=1e-6)), int(shifted.cells.delta[0])
        (True, 0)
    """
    require_cache(cache, "k_shift")
    if cache.config.rope is None:
        raise ValueError("this cache cannot K-shift: CacheConfig.rope is None; set CacheConfig.rope to the "
                         "model's kvjax.RopeConfig (one for all layers or one per layer)")
    ks, cells = _shift(cache.k, cache.cells, cache.config, donate=donating(donate, cache.cells.pos))
    return cache.replace(k=ks, cells=cells)
