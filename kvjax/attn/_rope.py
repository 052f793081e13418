"""RoPE with the math of ggml's ``rope_ext``, and the K-shift that rotates cached K by ``delta``.

For the pair ``i`` (``0 <= i < n_rot / 2``) of a head, at position ``p``::

    theta_i = p * c_i,   c_i = freq_base^(-2i / n_rot) / freq_factor_i * (s (1 - m_i) + m_i)

with ``s = freq_scale`` and the YaRN mix ``m_i = ext_factor * ramp_i`` (0 without YaRN), where
``ramp_i = 1 - clip((i - lo) / max(0.001, hi - lo), 0, 1)`` between the correction dims
``lo = max(0, floor(d(beta_fast)))``, ``hi = min(n_rot - 1, ceil(d(beta_slow)))`` and
``d(b) = n_rot * ln(n_ctx_orig / (2 pi b)) / (2 ln freq_base)`` (ggml's ``rope_yarn_corr_dims``).
The rotated pair is scaled by ``mscale = attn_factor`` (times ``1 + 0.1 ln(1 / s)`` with YaRN)::

    normal mode (adjacent pairs)        neox mode (halves)
    x[2i], x[2i+1]                      x[i], x[i + n_rot/2]
    (a, b) -> mscale (a cos - b sin,  a sin + b cos)

Dims from ``n_rot`` on pass through unchanged. The per-pair constants ``c_i`` are computed once on
the host in float64 (ggml builds them by repeated float32 multiplication; the two agree to float32
rounding), so the device only evaluates ``cos``/``sin`` of ``p * c_i``.

Because ``theta`` is linear in ``p``, rotating by ``a`` and then by ``b`` is rotating by ``a + b``:
that is what the K-shift relies on. :func:`k_shift` rotates every cell's K by its pending
``delta`` in every cached layer (per layer RoPE parameters from ``cache.config.rope``) and clears
the deltas.

Deliberate difference from the seed: the K-shift applies a pure rotation (``mscale = 1``). The
seed passes ``attn_factor`` and the YaRN magnitude again on every shift, so with YaRN (or
``attn_factor != 1``) a cached K would be scaled once more per shift and no longer equal K
computed at its new position; llama.cpp itself special-cases DeepSeek-2 to cancel that factor.

Quantized K: the shift works on float values through :func:`k_to_float` and :func:`k_from_float`
(dequantize, rotate, requantize, as the seed's ``build_rope_shift`` does for quantized types).
For float storage they are casts; block-quantized storage fills them in.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> cfg = kvjax.RopeConfig(n_rot=4)
    >>> x = jnp.ones((2, 1, 4))                       # [T, H, D]
    >>> y = kvjax.rope(x, jnp.array([0, 3]), cfg)
    >>> bool(jnp.all(y[0] == x[0]))                   # position 0: identity
    True
    >>> z = kvjax.rope(kvjax.rope(x, jnp.array([1, 1]), cfg), jnp.array([2, 2]), cfg)
    >>> bool(jnp.allclose(z, kvjax.rope(x, jnp.array([3, 3]), cfg), atol=1e-6))
    True
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax._typing import Array, Float, Int
from kvjax._jit import JitTwins
from kvjax._validate import INT32_MAX, INT32_MIN, check_int_values
from kvjax.storage import _quant
from kvjax._mesh import MODEL, type_mesh
from kvjax.memory._config import CacheConfig, RopeConfig, RopeMode

# -- the per-pair constants (host, float64) ------------------------------------------------------


def yarn_corr_dims(
    n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float, beta_slow: float, truncate: bool = True
) -> Tuple[float, float]:
    """ggml's ``rope_yarn_corr_dims``: the pair range over which YaRN ramps (start, end).

    ``truncate=False`` keeps the fractional ends (transformers' ``truncate: false``, gpt-oss).

    Example:
        >>> yarn_corr_dims(128, 4096, 10000.0, 32.0, 1.0)
        (20.0, 46.0)
        >>> [round(x, 3) for x in yarn_corr_dims(128, 4096, 10000.0, 32.0, 1.0, truncate=False)]
        [20.944, 45.027]
    """

    def corr_dim(n_rot_per_ctx: float) -> float:
        return n_dims * math.log(n_ctx_orig / (n_rot_per_ctx * 2 * math.pi)) / (2 * math.log(freq_base))

    start, end = corr_dim(beta_fast), corr_dim(beta_slow)
    if truncate:
        start, end = math.floor(start), math.ceil(end)
    return float(max(0, start)), float(min(n_dims - 1, end))


def pair_frequencies(cfg: RopeConfig) -> np.ndarray:
    """``c_i``, the angle per unit of position of each rotated pair (``float64[n_rot // 2]``).

    Example:
        >>> pair_frequencies(RopeConfig(n_rot=4, freq_base=100.0)).tolist()
        [1.0, 0.1]
    """
    half = cfg.n_rot // 2
    i = np.arange(half, dtype=np.float64)
    c = cfg.freq_base ** (-2.0 * i / cfg.n_rot)
    if cfg.freq_factors is not None:
        c = c / np.asarray(cfg.freq_factors, np.float64)
    if cfg.ext_factor != 0:
        lo, hi = yarn_corr_dims(
            cfg.n_rot, cfg.n_ctx_orig, cfg.freq_base, cfg.beta_fast, cfg.beta_slow, cfg.yarn_truncate
        )
        ramp = 1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0)
        mix = ramp * cfg.ext_factor
        return c * (cfg.freq_scale * (1.0 - mix) + mix)
    return c * cfg.freq_scale


def magnitude(cfg: RopeConfig) -> float:
    """``mscale``: the factor applied to the rotated dims (``attn_factor``, YaRN-corrected).

    Example:
        >>> round(magnitude(RopeConfig(n_rot=4, freq_scale=0.25, ext_factor=1.0, n_ctx_orig=64)), 4)
        1.1386
    """
    if cfg.ext_factor != 0:
        return cfg.attn_factor * (1.0 + 0.1 * math.log(1.0 / cfg.freq_scale))
    return float(cfg.attn_factor)


# -- the rotation (device) ----------------------------------------------------------------------


def _cos_sin(pos: Int[Array, "..."], freqs: np.ndarray, scale: float):
    """``cos``/``sin`` of ``pos * c_i`` (times ``scale``), float32 ``[..., n_rot // 2]``.

    ``freqs`` may carry a leading layer axis: ``[L, n_rot // 2]`` with ``pos`` ``[C]`` gives
    ``[L, C, n_rot // 2]``.
    """
    c = jnp.asarray(freqs, jnp.float32)
    p = jnp.asarray(pos).astype(jnp.float32)
    if c.ndim == 2:
        theta = p[None, :, None] * c[:, None, :]
    else:
        theta = p[..., None] * c
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def _rotate(x: Float[Array, "... D"], cos, sin, n_rot: int, mode: RopeMode) -> Float[Array, "... D"]:
    """Rotate the first ``n_rot`` dims of ``x`` (float32) by broadcastable ``cos``/``sin``."""
    head = x[..., :n_rot]
    if mode == RopeMode.NEOX:
        a, b = head[..., : n_rot // 2], head[..., n_rot // 2 :]
        rotated = jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    else:
        pairs = head.reshape(head.shape[:-1] + (n_rot // 2, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(head.shape)
    if n_rot == x.shape[-1]:
        return rotated
    return jnp.concatenate([rotated, x[..., n_rot:]], axis=-1)


@functools.partial(jax.jit, static_argnums=2)
def _rope(x, pos, cfg: RopeConfig):
    cos, sin = _cos_sin(pos, pair_frequencies(cfg), magnitude(cfg))
    out = _rotate(x.astype(jnp.float32), cos[..., None, :], sin[..., None, :], cfg.n_rot, cfg.mode)
    return out.astype(x.dtype)


def _check_rope_args(x, pos, rope_config):
    if not isinstance(rope_config, RopeConfig):
        raise ValueError(f"rope_config must be a kvjax.RopeConfig, got {type(rope_config).__name__}")
    if not hasattr(x, "shape") or len(x.shape) < 3:
        raise ValueError(f"x has shape {getattr(x, 'shape', None)}: allowed [..., T, H, D] (at least 3 axes)")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x has dtype {x.dtype}: allowed a floating dtype")
    if rope_config.n_rot > x.shape[-1]:
        raise ValueError(
            f"rope_config.n_rot={rope_config.n_rot} is out of range: allowed an even number "
            f"<= the head size D={x.shape[-1]}"
        )
    if not hasattr(pos, "shape") or not jnp.issubdtype(pos.dtype, jnp.integer):
        raise ValueError(
            f"pos must be an integer array broadcastable to {tuple(x.shape[:-2])} (the "
            f"leading axes of x), got {getattr(pos, 'dtype', type(pos).__name__)}"
        )
    check_int_values("pos", pos, INT32_MIN, INT32_MAX)
    try:
        shape = np.broadcast_shapes(tuple(pos.shape), tuple(x.shape[:-2]))
    except ValueError:
        shape = None
    if shape != tuple(x.shape[:-2]):
        raise ValueError(
            f"pos has shape {tuple(pos.shape)}: allowed a shape broadcastable to "
            f"{tuple(x.shape[:-2])} (the leading axes [..., T] of x)"
        )


def rope(x: Float[Array, "... T H D"], pos: Int[Array, "... T"], rope_config: RopeConfig) -> Float[Array, "... T H D"]:
    """Apply RoPE to the first ``n_rot`` dims of every head (ggml ``rope_ext``).

    Args:
        x: ``[..., T, H, D]`` queries or keys, any floating dtype (computed in float32, returned
            in ``x.dtype``).
        pos: integer positions ``[T]`` (or any shape broadcastable to ``x.shape[:-2]``).
        rope_config: the RoPE parameters (mode, ``n_rot``, frequencies, YaRN).

    Returns:
        ``x`` rotated, same shape and dtype.

    Raises:
        ValueError: ``n_rot`` larger than ``D``, a non-floating ``x``, non-integer or
            non-broadcastable ``pos``.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> x = jnp.array([[[1.0, 0.0, 1.0, 0.0]]])              # [T=1, H=1, D=4]
        >>> cfg = kvjax.RopeConfig(n_rot=2, mode="neox")
        >>> kvjax.rope(x, jnp.array([1]), cfg).round(4).tolist()   # only dims 0, 1 rotate
        [[[0.5403, 0.8415, 1.0, 0.0]]]
    """
    _check_rope_args(x, pos, rope_config)
    return _rope(x, pos, rope_config)


# -- the quantization seam ---------------------------------------------------------------------


def k_to_float(stored: Array, config: CacheConfig) -> Float[Array, "... C D"]:
    """Stored K as float32 values (dequantize; a cast for float storage).

    ``stored`` is the stored form of a block with the group's leading axes, ``[l, h, C, D]``
    (the whole group, or the one-layer, one-head slice the K-shift works on).

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2, k_dtype="float16")
        >>> k_to_float(jnp.ones((1, 1, 32, 2), jnp.float16), cfg).dtype
        dtype('float32')
    """
    return _quant.from_storage(stored, config.k_dtype)


def k_from_float(k: Float[Array, "... C D"], config: CacheConfig) -> Array:
    """Float32 K in the cache's storage format (requantize; a cast for floats).

    The inverse of :func:`k_to_float` for a block of the same leading axes.

    Example:
        >>> import jax.numpy as jnp, kvjax
        >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2, k_dtype="float16")
        >>> k_from_float(jnp.ones((1, 1, 32, 2)), cfg).dtype
        dtype('float16')
    """
    return _quant.to_storage(k, config.k_dtype)


# -- K-shift ------------------------------------------------------------------------------------


def _shift_group(
    stored, delta: Int[Array, " C"], ropes: Tuple[RopeConfig, ...], config: CacheConfig, per_head: Optional[bool] = None
):
    """Rotate one stacked group ``[L, H, C, D]`` by ``delta`` with each layer's RoPE parameters.

    One ``fori_loop`` per kind of rotation (``n_rot``, mode) walks the ``(layer, head)`` slices:
    each step reads one ``[C, D]`` slice, rotates it with ``[C, n_rot/2]`` cos/sin tables of the
    same leading shape, and writes it back in place. Measured on XLA's CPU backend, one fused
    elementwise op over the whole ``[L, H, C, D]`` array with the tables broadcast over
    ``(L, H)`` ran 8-10x slower than this loop (and recomputed cos/sin per element), see
    ``docs/architecture.md``. Where the heads are split over devices a step rotates every head of
    a layer (``per_head=None`` picks; the benchmarks force the per-head loop there to show what it cost).
    """
    n_heads = stored.shape[1]
    # with the heads split over devices a step walks the layers only, every head at once: slicing
    # one head out of a split head axis makes XLA gather (or all-reduce) the whole K to every
    # device, where rotating the heads a device holds needs nothing from the others
    per_head = not _heads_split(stored) if per_head is None else per_head
    classes = {}
    for il, r in enumerate(ropes):
        classes.setdefault((r.n_rot, r.mode), []).append(il)
    out = stored
    for (n_rot, mode), layers in classes.items():
        distinct = list(dict.fromkeys(ropes[il] for il in layers))  # first-appearance order
        freqs = np.stack([pair_frequencies(r) for r in distinct])  # [U, n_rot/2]
        cos, sin = _cos_sin(delta, freqs, 1.0)  # [U, C, n_rot/2]
        table_of = jnp.asarray([distinct.index(ropes[il]) for il in layers], jnp.int32)
        layer_of = jnp.asarray(layers, jnp.int32)

        heads = 1 if per_head else n_heads

        def step(i, acc, n_rot=n_rot, mode=mode, cos=cos, sin=sin, table_of=table_of, layer_of=layer_of):
            j, h = (i // n_heads, i % n_heads) if per_head else (i, 0)
            l, u = layer_of[j], table_of[j]
            block = jax.tree.map(
                lambda a: jax.lax.dynamic_slice(a, (l, h) + (0,) * (a.ndim - 2), (1, heads) + a.shape[2:]), acc
            )
            x = k_to_float(block, config)[0]  # [heads, C, D] float32
            y = _rotate(x, cos[u], sin[u], n_rot, mode)
            new = k_from_float(y[None], config)
            if _quant.is_quantized(config.k_dtype):
                # requantizing is not the identity: only cells with a pending shift are rewritten
                new = jnp.where((delta != 0)[None, None, :, None], new, block)
            return jax.tree.map(lambda a, b: jax.lax.dynamic_update_slice(a, b, (l, h) + (0,) * (a.ndim - 2)), acc, new)

        out = jax.lax.fori_loop(0, len(layers) * (n_heads // heads), step, out)
    return out


def _heads_split(stored) -> bool:
    """Whether the head axis of ``stored [L, H, C, D]`` (traced or not) is split over devices.

    Read from the mesh in the buffer's type (a traced buffer's spec is not known): kvjax's rules put
    kv heads on a ``"model"`` axis that divides them. Where heads are whole on every device (8x1,
    streams over ``"data"``) the per-head loop stays: it needs a layer's float32 copy of one head,
    not of every head.
    """
    model = type_mesh(stored)[1].get(MODEL, 1)
    return model > 1 and stored.shape[1] % model == 0


def _shift_impl(ks, cells, config: CacheConfig):
    """(rotated K of every group, cells with the deltas cleared)."""
    delta = cells.delta
    new_k = tuple(
        _shift_columns(
            ks[g], delta, tuple(config.rope[il] for il in grp.layers), config, config.rope_start(grp.layers[0])
        )
        for g, grp in enumerate(config.groups)
    )
    return new_k, cells.replace(delta=jnp.zeros_like(delta))


def _shift_columns(stored, delta, ropes, config: CacheConfig, start: int):
    """:func:`_shift_group` on K's columns from ``start`` on (a latent cache's RoPE key, its last
    ``n_rot`` columns, the same in every layer: the config checks it); 0 is the whole row.

    Only those columns are read and written (in a block type, their own blocks): the latent is
    never requantized, and a shift costs ``n_rot / D`` of one over whole rows.
    """
    if start == 0:
        return _shift_group(stored, delta, ropes, config)
    first = _quant.stored_width(config.k_dtype, start)
    rotated = _shift_group(stored[..., first:], delta, ropes, config)
    return stored.at[..., first:].set(rotated)


_shift = JitTwins(_shift_impl, static_argnums=2, donate_argnums=0)


def _k_shift(cache):
    """The K-shift as a function of the cache (traceable; used by ``update`` inside ``lax.cond``)."""
    ks, cells = _shift_impl(cache.k, cache.cells, cache.config)
    return cache.replace(k=ks, cells=cells)
