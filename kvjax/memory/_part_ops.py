"""The public functions of one attention part (a unified cache): attention, masks, position buckets, K-shift.

``kvjax.attention``, ``kq_mask``, ``kq_mask_bool``, ``pos_bucket`` and ``k_shift`` take a
:class:`kvjax.KVCache` (a memory's ``part(i)``), check their arguments on the host, and run the
kernels and formulas of :mod:`kvjax.attn` (``_attention``, ``_mask``, ``_rope``), which take plain
arrays, the cells and the cache's fields. The
formulas stand below the memories (the cache's own ``update`` runs the K-shift); these entry points
stand above the unified cache, since they name it.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

from kvjax._jit import donating
from kvjax._typing import Array, Bool, Float, Int
from kvjax._validate import check_count, check_flag, check_window
from kvjax.attn._attention import _attention, check_sinks, chunk_size, pick_implementation
from kvjax.attn._mask import T5_MAX_DISTANCE, _mask_additive, _mask_bool, _pos_bucket
from kvjax.attn._rope import _shift
from kvjax.memory._config import SwaType
from kvjax.memory._ubatch import Ubatch
from kvjax.memory._unified import KVCache, require_cache

__all__ = ["attention", "kq_mask", "kq_mask_bool", "pos_bucket", "k_shift"]


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
        raise ValueError(
            f"swa_type={swa_type!r} is not a sliding-window kind: allowed {[s.value for s in SwaType]}"
        ) from None
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


def kq_mask(
    cache: KVCache,
    ubatch: Ubatch,
    n_kv: int,
    *,
    causal: bool = True,
    alibi: bool = False,
    swa_type: Union[None, SwaType, str] = None,
    n_swa: Optional[int] = None,
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
    return _mask_additive(
        cache.cells,
        ubatch,
        n_kv=n_kv,
        causal=check_flag("causal", causal),
        alibi=check_flag("alibi", alibi),
        swa_type=kind,
        n_swa=window,
    )


def kq_mask_bool(
    cache: KVCache,
    ubatch: Ubatch,
    n_kv: int,
    *,
    causal: bool = True,
    alibi: bool = False,
    swa_type: Union[None, SwaType, str] = None,
    n_swa: Optional[int] = None,
) -> Bool[Array, "T N"]:
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
        raise ValueError("alibi=True has no boolean form: use kvjax.kq_mask for the additive mask with ALiBi distances")
    kind, window = _swa_args(cache, swa_type, n_swa)
    return _mask_bool(cache.cells, ubatch, n_kv=n_kv, causal=check_flag("causal", causal), swa_type=kind, n_swa=window)


def pos_bucket(
    cache: KVCache,
    ubatch: Ubatch,
    n_kv: int,
    n_buckets: int,
    *,
    bidirectional: bool = False,
    max_distance: int = T5_MAX_DISTANCE,
) -> Int[Array, "T N"]:
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
        raise ValueError(
            f"n_buckets={n_buckets} is out of range: allowed >= {lowest}"
            f"{' when bidirectional' if bidirectional else ''}"
        )
    max_exact = (n_buckets // 2 if bidirectional else n_buckets) // 2
    max_distance = _positive_int("max_distance", max_distance)
    if max_distance <= max_exact:
        raise ValueError(f"max_distance={max_distance} is out of range: allowed > {max_exact} (the exact buckets)")
    return _pos_bucket(
        cache.cells,
        ubatch,
        n_kv=n_kv,
        n_buckets=n_buckets,
        bidirectional=check_flag("bidirectional", bidirectional),
        max_distance=max_distance,
    )


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
        raise ValueError(
            "this cache cannot K-shift: CacheConfig.rope is None; set CacheConfig.rope to the "
            "model's kvjax.RopeConfig (one for all layers or one per layer)"
        )
    ks, cells = _shift(cache.k, cache.cells, cache.config, donate=donating(donate, cache.cells.pos))
    return cache.replace(k=ks, cells=cells)


# -- attention -----------------------------------------------------------------------------------


def attention(
    q: Float[Array, "T Hq D"],
    cache: KVCache,
    layer: int,
    mask: Union[Float[Array, "T N"], Bool[Array, "T N"]],
    *,
    scale: Optional[float] = None,
    bias: Optional[Float[Array, "..."]] = None,
    return_lse: bool = False,
    softcap: Optional[float] = None,
    implementation: Optional[str] = None,
    sinks: Optional[Float[Array, " Hq"]] = None,
) -> Union[Float[Array, "T Hq Dv"], Tuple[Float[Array, "T Hq Dv"], Float[Array, "T Hq"]]]:
    """Grouped-query attention of ``q`` over the first ``N = mask.shape[-1]`` cells of a layer.

    Args:
        q: ``[T, Hq, D]`` queries (RoPE already applied), ``Hq`` a multiple of the layer's kv
            heads ``H``.
        cache: the cache, with this ubatch's K/V already written.
        layer: static model layer id (a cached layer).
        mask: ``f32[T, N]`` additive mask (:func:`kvjax.kq_mask`) or ``bool[T, N]`` visibility
            (:func:`kvjax.kq_mask_bool`); ``N`` a positive multiple of ``padding``, at most ``size``.
        scale: softmax scale (default ``1 / sqrt(D)``).
        bias: optional additive bias broadcastable to ``[Hq, T, N]`` (e.g. ALiBi slopes times the
            distances, or T5 relative-position biases).
        return_lse: also return the log-sum-exp of each row's scaled, masked scores.
        softcap: optional attention-logit soft-capping (Gemma 2): the scaled scores ``s`` become
            ``softcap * tanh(s / softcap)`` before the mask and bias are added (a finite number
            > 0; ``None``, the default, leaves them as they are).
        implementation: ``"xla"``, ``"pallas"`` or None (the default: the environment variable
            ``KVJAX_ATTENTION`` when set, else by backend, see :func:`pick_implementation`). Both
            give the same results up to float rounding.
        sinks: optional learned attention sinks (gpt-oss), one logit per query head, ``f32[Hq]``
            (any floating dtype; a traced array, so new values do not recompile): head ``j``'s
            ``exp(sinks[j])`` joins the softmax denominator of each of its rows and weighs no
            value, so its rows' weights over the cells sum to less than 1 (``-inf``: no sink).
            Applied exactly from the lse on every implementation
            (:func:`kvjax.attn._attention.apply_sinks`).

    Returns:
        ``out [T, Hq, Dv]`` in ``q.dtype`` (and ``lse f32[T, Hq]`` when ``return_lse``, the sink
        included in its sum). Fully masked rows give ``out = 0`` and ``lse = -inf`` (``lse`` the
        sink's logit with ``sinks``).

    Raises:
        ValueError: bad shapes or dtypes, ``Hq`` not a multiple of ``H``, ``D`` not the layer's
            head size, a bad window, a bias that does not broadcast, a ``softcap`` that is not
            a finite number > 0, an unknown ``implementation`` or one that does not support
            the call (``"pallas"`` with quantized K/V or a ``bias``), ``sinks`` that are not a
            floating ``[Hq]`` array.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> ub = kvjax.make_ubatch([0], [[0]])
        >>> cache, slot, _ = kvjax.find_slot(cache, ub)
        >>> cache = kvjax.write(cache, 0, slot, jnp.ones((1, 1, 4)), jnp.full((1, 1, 4), 2.0))
        >>> out, lse = kvjax.attention(jnp.ones((1, 4, 4)), cache, 0, kvjax.kq_mask(cache, ub, 32), return_lse=True)
        >>> out.shape, out[0, 0].tolist(), lse.round(3)[0, 0].item()
        ((1, 4, 4), [2.0, 2.0, 2.0, 2.0], 2.0)
    """
    require_cache(cache, "attention")
    cfg = cache.config
    if isinstance(layer, bool) or not hasattr(layer, "__index__"):
        raise ValueError(f"layer={layer!r} must be a static Python int (a cached layer id)")
    layer = int(layer)
    g, _ = cfg.locate(layer)
    grp = cfg.groups[g]
    if not hasattr(q, "shape") or len(q.shape) != 3 or not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(
            f"q has shape {getattr(q, 'shape', None)} and dtype {getattr(q, 'dtype', None)}: "
            f"allowed a floating [T, Hq, D] array"
        )
    t, hq, d = q.shape
    if hq % grp.n_kv_heads or hq == 0:
        raise ValueError(
            f"q has {hq} query heads: allowed a positive multiple of the layer's "
            f"n_kv_heads={grp.n_kv_heads} (grouped-query attention)"
        )
    if d != grp.head_dim:
        raise ValueError(f"q has head size {d}: allowed the layer's head_dim={grp.head_dim}")
    if not hasattr(mask, "shape") or len(mask.shape) != 2 or mask.shape[0] != t:
        raise ValueError(f"mask has shape {getattr(mask, 'shape', None)}: allowed [T={t}, N]")
    if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.floating)):
        raise ValueError(f"mask has dtype {mask.dtype}: allowed bool (visibility) or floating (additive)")
    n_kv = check_window(int(mask.shape[1]), cfg.padding, cfg.size)
    if bias is not None:
        if not hasattr(bias, "shape") or not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError("bias must be a floating array broadcastable to [Hq, T, N]")
        try:
            shape = np.broadcast_shapes(tuple(bias.shape), (hq, t, n_kv))
        except ValueError:
            shape = None
        if shape != (hq, t, n_kv):
            raise ValueError(
                f"bias has shape {tuple(bias.shape)}: allowed a shape broadcastable to [Hq, T, N] = {(hq, t, n_kv)}"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    elif (
        isinstance(scale, bool)
        or not isinstance(scale, (int, float, np.floating, np.integer))
        or not math.isfinite(scale)
    ):
        raise ValueError(f"scale={scale!r} must be a finite real number")
    if softcap is not None:
        if (
            isinstance(softcap, bool)
            or not isinstance(softcap, (int, float, np.floating, np.integer))
            or not (math.isfinite(softcap) and softcap > 0)
        ):
            raise ValueError(f"softcap={softcap!r} is out of range: allowed a finite number > 0 (or None)")
        softcap = np.float32(softcap)
    sinks = check_sinks(sinks, hq)
    # scale (and softcap) travel as traced f32 scalars: a new value does not recompile
    chunk = chunk_size(n_kv, grp.n_kv_heads, (hq // grp.n_kv_heads) * t, cfg.padding)
    impl = pick_implementation(implementation, cache, layer, bias)
    return _attention(
        q,
        cache,
        mask,
        bias,
        np.float32(scale),
        layer=layer,
        n_kv=n_kv,
        chunk=chunk,
        return_lse=bool(return_lse),
        softcap=softcap,
        implementation=impl,
        sinks=sinks,
    )
