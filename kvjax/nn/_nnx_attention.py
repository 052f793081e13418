"""Cached attention for Flax NNX, and the framework-neutral attention core it shares with linen.

The core is two pure functions:

- :func:`attend_cached`: RoPE at the ubatch positions, write K/V into the kvjax cache at the
  placed slot, attend over the first ``n_kv`` cells with the kvjax mask. Everything that touches
  the cache is a kvjax call (``kvjax.rope``, ``kvjax.write``, ``kvjax.kq_mask``,
  ``kvjax.attention``); nothing here knows how cells are laid out.
- :func:`attend_uncached`: plain attention of one sequence over its own tokens (causal, sliding
  window and ALiBi from the positions), built on ``jax.nn.dot_product_attention`` and on nothing
  in kvjax but RoPE: it is the reference the cached path is tested against.

:class:`CachedAttention` is the NNX layer over them (Q/K/V/O projections, GQA, optional per-layer
sliding window, RoPE or ALiBi); the linen twin lives in :mod:`kvjax.nn._linen_attention`.
:class:`KVCacheVar` lets an NNX model hold its cache as state (like ``nnx.MultiHeadAttention``'s
decode cache) and refuses a value whose shapes, dtypes or config differ from the one it holds.

Shape letters: see :mod:`kvjax._typing` (T tokens, Hq query heads, H kv heads, D head size,
N window); E is the model width.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import CachedAttention, UbatchInputs
    >>> attn = CachedAttention(32, n_heads=4, n_kv_heads=2, head_dim=8, layer=0,
    ...                        rope=kvjax.RopeConfig(n_rot=8), rngs=nnx.Rngs(0))
    >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=2, head_dim=8))
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0]] * 3)
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> y, cache = attn(jnp.ones((4, 32)), cache, UbatchInputs(ubatch=ub, placement=slot, windows=(32,)))
    >>> y.shape, int(kvjax.used_cells(cache))
    ((4, 32), 3)
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from kvjax._typing import Array, Bool, Float, Int
from kvjax._validate import check_flag, check_real, require
from kvjax.memory._init import require_memory
from kvjax.memory._protocol import Memory
from kvjax.nn._inputs import MaskKind, UbatchInputs, layer_mask
from kvjax.nn._fused_layout import split_qkv
from kvjax.nn._norm import OffsetRMSNorm
from kvjax.memory._config import RopeConfig, SwaType

__all__ = ["CachedAttention", "KVCacheVar", "alibi_slopes", "attend_cached", "attend_uncached", "swa_visible"]


# -- framework-neutral core ---------------------------------------------------------------------


def alibi_slopes(n_heads: int, max_bias: float = 8.0) -> np.ndarray:
    """Per-head ALiBi slopes, as ggml computes them for ``soft_max_ext`` with ``max_bias``.

    Heads up to the largest power of two ``n`` <= ``n_heads`` get ``m0 ** (h + 1)`` with
    ``m0 = 2 ** (-max_bias / n)``; the rest interleave with ``m1 = 2 ** (-max_bias / 2 / n)``.

    Args:
        n_heads: Hq, the number of query heads (>= 1).
        max_bias: ALiBi's maximum bias (> 0; 8 in the ALiBi paper).

    Returns:
        ``f32[Hq]`` slopes (host array).

    Example:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    if not isinstance(n_heads, (int, np.integer)) or n_heads < 1:
        raise ValueError(f"n_heads={n_heads!r} is out of range: allowed an integer >= 1")
    if not max_bias > 0:
        raise ValueError(f"max_bias={max_bias!r} is out of range: allowed > 0")
    n_log2 = 1 << int(math.floor(math.log2(n_heads)))
    m0 = 2.0 ** (-max_bias / n_log2)
    m1 = 2.0 ** (-(max_bias / 2.0) / n_log2)
    h = np.arange(n_heads)
    slopes = np.where(h < n_log2, m0 ** (h + 1), m1 ** (2 * (h - n_log2) + 1))
    return slopes.astype(np.float32)


def swa_visible(
    p_cell: Int[Array, "..."], p_tok: Int[Array, "..."], swa_type: Union[SwaType, str], n_swa: int
) -> Bool[Array, "..."]:
    """Whether a key at ``p_cell`` lies inside the sliding window of a query at ``p_tok``.

    Written from the definitions in :class:`kvjax.SwaType` (not from ``kvjax.kq_mask``), for the
    uncached reference.

    Example:
        >>> swa_visible(jnp.arange(6), jnp.int32(5), "standard", 3).tolist()
        [False, False, False, True, True, True]
    """
    kind = SwaType(swa_type)
    if kind == SwaType.NONE:
        return jnp.ones(jnp.broadcast_shapes(jnp.shape(p_cell), jnp.shape(p_tok)), bool)
    if kind == SwaType.STANDARD:
        return p_tok - p_cell < n_swa
    if kind == SwaType.CHUNKED:
        return p_cell >= (p_tok // n_swa) * n_swa
    return jnp.abs(p_tok - p_cell) <= n_swa // 2


def _alibi_bias(mask: Float[Array, "T N"], slopes) -> Float[Array, "Hq T N"]:
    """Per-head ALiBi bias from an ALiBi mask (``-|p_cell - p_tok|`` where visible)."""
    visible = jnp.isfinite(mask)
    dist = jnp.where(visible, mask, 0.0)
    slopes = jnp.asarray(slopes, jnp.float32)
    return slopes[:, None, None] * dist[None]


def attend_cached(
    q: Float[Array, "T Hq D"],
    k: Float[Array, "T H D"],
    v: Float[Array, "T H Dv"],
    memory: Memory,
    layer: int,
    inputs: UbatchInputs,
    *,
    rope: Optional[RopeConfig] = None,
    alibi: Optional[np.ndarray] = None,
    swa_type: Union[SwaType, str] = SwaType.NONE,
    n_swa: int = 0,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Float[Array, " Hq"]] = None,
) -> Tuple[Float[Array, "T Hq Dv"], Memory]:
    """One layer's attention through a memory (any kind with attention parts).

    The layer reaches its attention part by its id (``memory.layer_part(layer)``, static), writes
    its K/V rows where the part placed the ubatch, and attends over the part's window with the
    mask of its :class:`MaskKind` (from ``inputs`` when the model computed it once for every layer
    of that kind, else built here). The ubatch must already be placed, so each token sees the
    earlier tokens of its sequence, itself, and the tokens of this ubatch before it.

    Args:
        q: projected queries (before RoPE).
        k: projected keys of the ubatch tokens (before RoPE).
        v: projected values.
        memory: the memory with the ubatch placed.
        layer: the model layer id (static int).
        inputs: the per-ubatch inputs (ubatch, placement, windows, masks).
        rope: RoPE parameters, or ``None`` for no rotation (ALiBi or NoPE layers).
        alibi: ``f32[Hq]`` ALiBi slopes (:func:`alibi_slopes`), or ``None``.
        swa_type: this layer's sliding-window kind.
        n_swa: this layer's window size.
        scale: softmax scale (default ``1 / sqrt(D)``).
        softcap: attention-logit soft-capping (``softcap * tanh(s / softcap)`` of the scaled
            scores before the mask; ``None`` for none), as ``kvjax.attention``.
        sinks: ``[Hq]`` learned attention sinks (gpt-oss), or ``None``, as ``kvjax.attention``.

    Returns:
        ``(out [T, Hq, Dv], memory)``: rows of fully masked (padding) tokens are 0.
    """
    part = memory.layer_part(layer)
    cache = memory.part(part)
    slot = memory.part_slots(inputs.placement, part)
    kind = MaskKind(part, alibi is not None, SwaType(swa_type), int(n_swa) if SwaType(swa_type) != SwaType.NONE else 0)
    if memory.streamed:  # per-sequence streams: each slot attends over its own stream only
        return kvjax.stream_attend(
            q,
            k,
            v,
            memory,
            layer,
            inputs,
            rope=rope,
            alibi=alibi,
            swa_type=kind.swa_type,
            n_swa=kind.n_swa,
            scale=scale,
            softcap=softcap,
            mask=inputs.mask(kind) if kind in inputs.mask_kinds else None,
            sinks=sinks,
        )
    if rope is not None:
        q = kvjax.rope(q, inputs.ubatch.pos, rope)
        k = kvjax.rope(k, inputs.ubatch.pos, rope)
    cache = kvjax.write(cache, layer, slot, k, v)
    if kind in inputs.mask_kinds:
        mask = inputs.mask(kind)
    else:
        mask = layer_mask(
            cache, inputs.ubatch, inputs.windows[part], alibi=kind.alibi, swa_type=kind.swa_type, n_swa=kind.n_swa
        )
    bias = None
    if alibi is not None:
        # ggml scales the ALiBi mask by each head's slope; an additive mask would add slope 1, so
        # the visibility goes in as a boolean mask and the scaled distances as the bias
        bias = _alibi_bias(mask, alibi)
        mask = jnp.isfinite(mask)
    out = kvjax.attention(q, cache, layer, mask, scale=scale, bias=bias, softcap=softcap, sinks=sinks)
    return out, memory.with_part(part, cache)


def attend_uncached(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B T H D"],
    v: Float[Array, "B T H Dv"],
    pos: Int[Array, "B T"],
    *,
    rope: Optional[RopeConfig] = None,
    alibi: Optional[np.ndarray] = None,
    swa_type: Union[SwaType, str] = SwaType.NONE,
    n_swa: int = 0,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Float[Array, " Hq"]] = None,
) -> Float[Array, "B T Hq Dv"]:
    """Attention of each sequence (row b) over its own tokens, without any cache: the reference.

    Token ``i`` sees token ``j`` of its row when ``pos[j] <= pos[i]`` and ``pos[j]`` is inside
    ``pos[i]``'s sliding window; ALiBi adds ``-slope_h * |pos[i] - pos[j]|``. Built on
    ``jax.nn.dot_product_attention`` (GQA included), independent of ``kvjax.attention``; with
    ``softcap`` or ``sinks``, or a V head size other than K's (MLA), which that function does not
    offer, on a plain einsum softmax: the
    scaled scores ``s`` become ``softcap * tanh(s / softcap)`` before the mask, as in Gemma 2, and
    each query head's sink logit is a column of its own in the softmax, dropped afterwards, as
    transformers' gpt-oss writes it.

    Example:
        >>> q, k = jnp.ones((2, 3, 4, 8)), jnp.ones((2, 3, 2, 8))      # [B, T, Hq, D], [B, T, H, D]
        >>> v = jnp.arange(3.0)[None, :, None, None] * jnp.ones((2, 3, 2, 8))
        >>> out = jax.jit(attend_uncached)(q, k, v, jnp.tile(jnp.arange(3), (2, 1)))
        >>> out.shape, out[0, :, 0, 0].tolist()                        # equal scores: running means
        ((2, 3, 4, 8), [0.0, 0.5, 1.0])
    """
    if rope is not None:
        b, t = pos.shape
        flat = pos.reshape(b * t)
        q = kvjax.rope(q.reshape((b * t,) + q.shape[2:]), flat, rope).reshape(q.shape)
        k = kvjax.rope(k.reshape((b * t,) + k.shape[2:]), flat, rope).reshape(k.shape)
    p_tok, p_key = pos[:, :, None], pos[:, None, :]
    visible = (p_key <= p_tok) & swa_visible(p_key, p_tok, swa_type, n_swa)  # [B, T, T]
    bias = None
    if alibi is not None:
        slopes = jnp.asarray(alibi, jnp.float32)
        bias = -slopes[None, :, None, None] * jnp.abs(p_tok - p_key).astype(jnp.float32)[:, None]
    if softcap is not None or sinks is not None or v.shape[-1] != k.shape[-1]:
        f32 = [x.astype(jnp.float32) for x in (q, k, v)]
        out = _einsum_attention(*f32, bias, visible[:, None], scale, softcap, sinks)
        return out.astype(v.dtype)
    out = jax.nn.dot_product_attention(
        q.astype(jnp.float32),
        k.astype(jnp.float32),
        v.astype(jnp.float32),
        bias=bias,
        mask=visible[:, None],
        scale=scale,
    )
    return out.astype(v.dtype)


def _einsum_attention(
    q: Float[Array, "B T Hq D"],
    k: Float[Array, "B S H D"],
    v: Float[Array, "B S H Dv"],
    bias: Optional[Float[Array, "B Hq T S"]],
    visible: Bool[Array, "B 1 T S"],
    scale: Optional[float],
    softcap: Optional[float],
    sinks: Optional[Float[Array, " Hq"]] = None,
) -> Float[Array, "B T Hq Dv"]:
    """``softmax([cap(q k^T * scale) + bias, sink], masked)`` without the sink column, times ``v``.

    ``cap(s) = softcap * tanh(s / softcap)`` (none when ``softcap`` is None); the sink column is
    query head ``j``'s ``sinks[j]`` (none when ``sinks`` is None). Query head ``j`` reads kv head
    ``j // G`` (``G = Hq / H``); a row that sees nothing gives 0.
    """
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = jnp.einsum("bthd,bshd->bhts", q, k) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    if bias is not None:
        s = s + bias
    s = jnp.where(visible, s, -jnp.inf)
    seen = jnp.any(visible, axis=-1, keepdims=True)
    s = jnp.where(seen, s, 0.0)
    if sinks is None:
        return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1) * seen, v)
    sink = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32)[None, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1] * seen
    return jnp.einsum("bhts,bshd->bthd", p, v)


def cached_attention_call(layer, x, memory, inputs, **options):
    """The cached call of an attention layer (shared by the NNX and linen layers).

    ``options`` are :func:`attend_cached`'s (``rope``, ``alibi``, ``swa_type``, ``n_swa``,
    ``scale``, ``softcap``, ``sinks``).
    """
    check_layer_cache(memory, layer.layer, layer.n_kv_heads, layer.head_dim)
    check_inputs(inputs)
    t = inputs.ubatch.length
    if x.ndim != 2 or x.shape[0] != t:
        raise ValueError(f"x has shape {tuple(x.shape)}: allowed [T, E] with T = ubatch.length = {t}")
    q, k, v = project_qkv(layer, x)
    out, memory = attend_cached(q, k, v, memory, layer.layer, inputs, **options)
    return layer.o_proj(out.reshape(t, -1)), memory


def check_inputs(inputs) -> None:
    """Validate the per-ubatch inputs of a cached layer."""
    if not isinstance(inputs, UbatchInputs):
        raise ValueError(
            f"inputs must be a kvjax.nn.UbatchInputs (ubatch, placement, windows), got {type(inputs).__name__}"
        )


# -- the NNX layer ------------------------------------------------------------------------------


def check_heads(n_heads: int, n_kv_heads: int, head_dim: int) -> None:
    """Validate attention head counts (GQA needs ``n_heads`` a multiple of ``n_kv_heads``)."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name}={value!r} is out of range: allowed an integer >= 1")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is out of range: allowed a multiple of n_kv_heads={n_kv_heads} (GQA)")


def check_attention_options(scale, softcap, qk_norm, norm_eps) -> None:
    """Validate the Gemma-style options of an attention layer (shared by the NNX and linen layers)."""
    for name, value in (("scale", scale), ("softcap", softcap), ("norm_eps", norm_eps)):
        # static options of a layer (a linen module's fields are hashed): host numbers only
        require(not isinstance(value, jax.Array), name, value, "a Python or numpy number (a static layer option)")
        check_real(name, value, above=0, optional=name != "norm_eps")
    check_flag("qk_norm", qk_norm)


def check_layer_cache(memory: Memory, layer: int, n_kv_heads: int, head_dim: int) -> None:
    """Validate that ``memory`` stores ``layer`` (in the part the layer reads) with its kv heads and head size."""
    require_memory(memory)
    if memory.n_parts == 0:
        raise ValueError(
            f"memory is a {type(memory).__name__} without attention parts: allowed a memory "
            f"that stores attention layers (kvjax.KVCache, ...)"
        )
    cfg = memory.part(memory.layer_part(layer)).config
    if layer not in cfg.cached_layers:
        raise ValueError(
            f"layer={layer} is not cached by this cache: allowed {list(cfg.cached_layers)} (CacheConfig.layer_filter)"
        )
    if (cfg.n_kv_heads[layer], cfg.head_dim[layer]) != (n_kv_heads, head_dim):
        raise ValueError(
            f"cache stores layer {layer} with n_kv_heads={cfg.n_kv_heads[layer]}, "
            f"head_dim={cfg.head_dim[layer]}: allowed the layer's n_kv_heads={n_kv_heads}, "
            f"head_dim={head_dim}"
        )


def project_qkv(layer, x):
    """Q ``[..., Hq, D]``, K and V ``[..., H, D]`` of ``x [..., E]`` through ``layer``'s projections.

    Shared by the NNX and linen layers, which both name them ``q_proj``, ``k_proj``, ``v_proj``
    (and, with ``qk_norm``, normalise each head of Q and K with ``q_norm`` / ``k_norm``). An NNX
    layer fused by :func:`kvjax.nn.fuse_projections` runs one ``qkv_proj`` instead.
    """
    lead = x.shape[:-1]
    if getattr(layer, "qkv_proj", None) is not None:
        q, k, v = split_qkv(layer.qkv_proj(x), layer.n_heads, layer.n_kv_heads, layer.head_dim)
    else:
        q = layer.q_proj(x).reshape(lead + (layer.n_heads, layer.head_dim))
        k = layer.k_proj(x).reshape(lead + (layer.n_kv_heads, layer.head_dim))
        v = layer.v_proj(x).reshape(lead + (layer.n_kv_heads, layer.head_dim))
    if layer.qk_norm:  # Gemma 3 / Qwen 3: RMSNorm of each head's q and k over D, before RoPE
        q, k = layer.q_norm(q), layer.k_norm(k)
    return q, k, v


class CachedAttention(nnx.Module):
    """Multi-head attention with grouped-query heads that reads and writes a kvjax cache.

    Args:
        d_model: E, the input and output width.
        n_heads: Hq, query heads.
        n_kv_heads: H, key/value heads (Hq a multiple of H).
        head_dim: D (for K, V and Q).
        layer: the model layer id this module caches under.
        rope: RoPE parameters, or ``None`` (then no rotation: use ALiBi or no positions).
        alibi_max_bias: when set, ALiBi with this maximum bias is applied (usually instead of RoPE).
        swa_type: sliding-window kind of this layer (``"none"`` for full attention).
        n_swa: the window size (> 0 with a window).
        use_bias: biases in the projections.
        param_dtype: parameter dtype.
        scale: softmax scale of the scores (default ``1 / sqrt(head_dim)``; Gemma's
            ``query_pre_attn_scalar ** -0.5``); a finite number > 0.
        softcap: attention-logit soft-capping (Gemma 2), a finite number > 0, or ``None``.
        qk_norm: RMSNorm each head of Q and K over ``head_dim`` before RoPE (Gemma 3), with
            weights ``q_norm.scale`` and ``k_norm.scale`` of shape ``[D]``.
        norm_offset: those norms scale by ``(1 + w)`` (Gemma) instead of ``w``.
        norm_eps: their epsilon (> 0).
        sinks: a learned sink logit per query head (gpt-oss), the parameter ``sinks [n_heads]``
            (initialised to 0), in the softmax of every row (``kvjax.attention``'s ``sinks``).
        rngs: NNX random streams.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        layer: int,
        rope: Optional[RopeConfig] = None,
        alibi_max_bias: Optional[float] = None,
        swa_type: Union[SwaType, str] = SwaType.NONE,
        n_swa: int = 0,
        use_bias: bool = False,
        param_dtype=jnp.float32,
        scale: Optional[float] = None,
        softcap: Optional[float] = None,
        qk_norm: bool = False,
        norm_offset: bool = False,
        norm_eps: float = 1e-6,
        sinks: bool = False,
        rngs: nnx.Rngs,
    ):
        check_heads(n_heads, n_kv_heads, head_dim)
        check_attention_options(scale, softcap, qk_norm, norm_eps)
        check_flag("norm_offset", norm_offset)
        self.swa_type = SwaType(swa_type)
        if self.swa_type != SwaType.NONE and not (isinstance(n_swa, (int, np.integer)) and n_swa > 0):
            raise ValueError(
                f"n_swa={n_swa!r} is out of range: allowed an integer > 0 with swa_type={self.swa_type.value!r}"
            )
        if rope is not None and rope.n_rot > head_dim:
            raise ValueError(f"rope.n_rot={rope.n_rot} is out of range: allowed <= head_dim={head_dim}")
        self.n_heads, self.n_kv_heads, self.head_dim = int(n_heads), int(n_kv_heads), int(head_dim)
        self.layer, self.rope, self.n_swa = int(layer), rope, int(n_swa)
        self.alibi = None if alibi_max_bias is None else tuple(alibi_slopes(n_heads, alibi_max_bias).tolist())
        lin = dict(use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = nnx.Linear(d_model, n_heads * head_dim, **lin)
        self.k_proj = nnx.Linear(d_model, n_kv_heads * head_dim, **lin)
        self.v_proj = nnx.Linear(d_model, n_kv_heads * head_dim, **lin)
        self.o_proj = nnx.Linear(n_heads * head_dim, d_model, **lin)
        self.qkv_proj = nnx.data(None)  # set by kvjax.nn.fuse_projections (then q/k/v_proj are None)
        self.scale = None if scale is None else float(scale)
        self.softcap = None if softcap is None else float(softcap)
        self.qk_norm = bool(qk_norm)
        norm = OffsetRMSNorm if norm_offset else nnx.RMSNorm
        make = lambda: norm(head_dim, epsilon=norm_eps, param_dtype=param_dtype, rngs=rngs)  # noqa: E731
        self.q_norm = make() if self.qk_norm else None
        self.k_norm = make() if self.qk_norm else None
        self.sinks = nnx.Param(jnp.zeros((n_heads,), param_dtype)) if check_flag("sinks", sinks) else None

    def _sinks(self):
        return None if self.sinks is None else self.sinks[...]

    def _qkv(self, x):
        return project_qkv(self, x)

    def __call__(
        self, x: Float[Array, "T E"], memory: Memory, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T E"], Memory]:
        """Attend the ubatch tokens through the memory.

        Args:
            x: ``[T, E]`` the ubatch's hidden states, one row per ubatch row.
            memory: the memory with the ubatch already placed (``kvjax.find_slot``).
            inputs: the per-ubatch inputs (:class:`UbatchInputs`: ubatch, placement, windows and,
                when the model shares them between layers, the masks).

        Returns:
            ``(y [T, E], memory)`` with this layer's K/V rows written.
        """
        return cached_attention_call(
            self,
            x,
            memory,
            inputs,
            rope=self.rope,
            alibi=self.alibi,
            swa_type=self.swa_type,
            n_swa=self.n_swa,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self._sinks(),
        )

    def uncached(self, x: Float[Array, "B T E"], pos: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """Attention of each sequence (row) over its own tokens, no cache (``attend_uncached``)."""
        q, k, v = self._qkv(x)
        out = attend_uncached(
            q,
            k,
            v,
            pos,
            rope=self.rope,
            alibi=self.alibi,
            swa_type=self.swa_type,
            n_swa=self.n_swa,
            scale=self.scale,
            softcap=self.softcap,
            sinks=self._sinks(),
        )
        return self.o_proj(out.reshape(x.shape[:-1] + (-1,)))


# -- holding the cache as NNX state -------------------------------------------------------------


def _signature(cache: Memory):
    leaves, tree = jax.tree.flatten(cache)
    return tree, tuple((tuple(jnp.shape(x)), jnp.result_type(x)) for x in leaves)


class KVCacheVar(nnx.Cache):
    """An ``nnx.Cache`` variable holding a kvjax memory (e.g. a :class:`~kvjax.KVCache`).

    Replace the held cache with :meth:`replace_cache`, which refuses a value of another config,
    pytree structure, shape or dtype (a silent change would recompile every jitted user and could
    hand the model a cache of the wrong layer shapes).

    Example:
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2)
        >>> var = KVCacheVar(kvjax.init(cfg))
        >>> var.replace_cache(kvjax.clear(var.get_value()))
        >>> var.replace_cache(kvjax.init(cfg.replace(size=64)))
        Traceback (most recent call last):
        ...
        ValueError: cache has config ...
    """

    def replace_cache(self, cache: Memory) -> None:
        """Hold ``cache`` instead of the current value (same config, shapes and dtypes only)."""
        old = self.get_value()
        require_memory(cache, "cache")
        if cache.config != old.config:
            raise ValueError(f"cache has config {cache.config}: allowed only the held config {old.config}")
        if _signature(cache) != _signature(old):
            raise ValueError(f"cache has other shapes or dtypes than the held cache: allowed only {_signature(old)[1]}")
        self.set_value(cache)
