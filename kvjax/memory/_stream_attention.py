"""Attention over per-sequence streams: each ubatch slot reads its own stream's cells only.

A :class:`kvjax.StreamCache` stores K/V as ``[S, L, H, C, D]`` (a leading stream axis). A ubatch
for it is an equal split (:func:`kvjax.make_equal_ubatch`): ``n_slots`` slots of ``t`` rows, each
slot's tokens of one stream (a ubatch that is not an equal split is taken a row at a time). Per
slot:

- the mask is the unified cache's mask over that slot's stream (``[t, N]``, the window ``N`` the
  step compiled for, the largest stream's bucket);
- attention runs the unified online-softmax loop (:func:`kvjax.attn._attention._attend`) over
  that stream's chunks, with a **dynamic** trip count: only the chunks holding cells (up to the
  longest slot's stream's ``cell_max``) run, so the cost follows the sequences' lengths, not the
  window bucket;
- the slots run together: each step of one loop gathers every slot's chunk of its own stream and
  contracts them together (one set of ops per layer, not one per slot and layer: on XLA:CPU the
  per-op cost of a loop per slot was most of a batch-32 decode step), in groups of slots when all
  of them would overflow a step's memory budgets (:func:`slot_group`). A slot's rows past its own
  stream's cells are masked, so they read bytes that change nothing. Slots run one after another
  instead (``lax.map``), each over its own chunks only, when that reads far fewer cells (one long
  stream beside short ones: :func:`one_loop_pays`), and always on a device mesh, where most slots'
  streams live on other devices and cost nothing that way.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> from kvjax.memory import _stream_attention as _streams
    >>> base = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> memory = kvjax.init(kvjax.StreamsConfig(base))
    >>> ub = kvjax.make_equal_ubatch([([0], [0]), ([0], [1])])
    >>> memory, placement, ok = kvjax.find_slot(memory, ub)
    >>> k = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]]); v = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]]])
    >>> cache = _streams.write(memory.cache, 0, placement, k, v)
    >>> masks = _streams.masks(memory.replace(cache=cache), ub, placement, 32)
    >>> out = _streams.attention(jnp.zeros((2, 1, 2)), memory.replace(cache=cache), 0, masks, placement, ub)
    >>> out[:, 0].tolist()                       # each sequence sees only its own token
    [[1.0, 2.0], [3.0, 4.0]]
"""

from __future__ import annotations

import math
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from kvjax._typing import Array, Bool, Float, Int
from kvjax._validate import check_flag
from kvjax.attn._attention import _attend, apply_sinks, blocks_fit, check_sinks, chunk_size
from kvjax.attn._mask import _mask_additive
from kvjax.attn._rope import rope as _rope
from kvjax._mesh import DATA
from kvjax.memory import _cells
from kvjax.memory._config import SwaType
from kvjax.memory._streams import mesh_split
from kvjax.memory._unified import KVCache
from kvjax.storage import _quant

__all__ = ["slots_of", "masks", "write", "attention", "mesh_split"]

_NEG_INF = -jnp.inf


def slots_of(ubatch) -> Tuple[int, int]:
    """``(n_slots, t)``: an equal split's slots, or one slot per row for any other ubatch."""
    t = ubatch.n_seq_tokens or 1
    return ubatch.length // t, t


def _slot_streams(placement, ubatch) -> Int[Array, " n_slots"]:
    """The stream of each slot (its first row's; -1 for a padding or unplaced slot)."""
    n_slots, t = slots_of(ubatch)
    return placement.stream.reshape(n_slots, t)[:, 0]


def masks(
    memory, ubatch, placement, n_kv: int, *, alibi: bool = False, swa_type: SwaType = SwaType.NONE, n_swa: int = 0
) -> Float[Array, "n_slots t N"]:
    """Each slot's additive mask over its stream's first ``n_kv`` cells (kvjax.kq_mask's rules).

    Args:
        memory: the :class:`kvjax.StreamCache` with the ubatch placed.
        ubatch: the ubatch; ``placement``: where it went (:class:`kvjax.StreamPlacement`).
        n_kv: the static window N (the step's bucket; at most ``size``).
        alibi, swa_type, n_swa: as :func:`kvjax.kq_mask`.

    Returns:
        ``f32[n_slots, t, N]``; a padding slot is fully masked.
    """
    n_slots, t = slots_of(ubatch)
    streams = jnp.clip(_slot_streams(placement, ubatch), 0, memory.n_stream - 1)
    cells = jax.tree.map(lambda x: x[streams], memory.cache.cells)  # [n_slots, C, ...]
    rows = jax.tree.map(
        lambda x: jnp.asarray(x).reshape((n_slots, t) + jnp.shape(x)[1:]), ubatch.replace(n_seq_tokens=0)
    )
    rows = rows.replace(valid=rows.valid & (_slot_streams(placement, ubatch) >= 0)[:, None])
    alibi = check_flag("alibi", alibi)
    return jax.vmap(lambda c, u: _mask_additive(c, u, n_kv, True, alibi, SwaType(swa_type), int(n_swa)))(cells, rows)


def write(cache: KVCache, layer: int, placement, k: Float[Array, "T H D"], v: Float[Array, "T H Dv"]) -> KVCache:
    """Write a ubatch's K/V rows into their streams' cells (``cache``: the stacked unified cache).

    Rows whose stream or cell is -1 (padding, or a refused placement) are dropped.
    """
    cfg = cache.config
    g, index = cfg.locate(int(layer))
    return _with_group(
        cache, g, *_write_rows(cache.k[g], cache.v[g], index, placement.stream, placement.cell, k, v, cfg)
    )


def _with_group(cache: KVCache, g: int, k_all, v_all) -> KVCache:
    """``cache`` with layer group ``g``'s K and V buffers replaced."""
    return cache.replace(k=cache.k[:g] + (k_all,) + cache.k[g + 1 :], v=cache.v[:g] + (v_all,) + cache.v[g + 1 :])


def attention(
    q: Float[Array, "T Hq D"],
    memory,
    layer: int,
    slot_masks: Float[Array, "n_slots t N"],
    placement,
    ubatch,
    *,
    scale: Optional[float] = None,
    slopes=None,
    softcap=None,
    sinks=None,
) -> Float[Array, "T Hq Dv"]:
    """Grouped-query attention of each slot over its own stream (K/V of this ubatch written).

    Args:
        q: ``[T, Hq, D]`` queries (RoPE applied).
        memory: the :class:`kvjax.StreamCache` holding the written K/V.
        layer: static model layer id.
        slot_masks: :func:`masks`' ``[n_slots, t, N]``.
        placement, ubatch: the placed ubatch.
        scale: softmax scale (default ``1 / sqrt(D)``).
        slopes: ``f32[Hq]`` ALiBi slopes (the masks then carry ALiBi distances), or None.
        softcap: attention-logit soft-capping, or None.
        sinks: ``f32[Hq]`` learned attention sinks, or None (as :func:`kvjax.attention`).

    Returns:
        ``[T, Hq, Dv]`` in ``q.dtype``; rows of padding slots are 0.
    """
    cache = memory.cache
    g, index = cache.config.locate(int(layer))
    sinks = check_sinks(sinks, q.shape[1])
    split = mesh_split(cache.k[g])
    if split is not None:  # each device over the streams it holds (a gather here fetched every stream)
        out, _ = _attend_on_mesh(
            q, None, None, memory, layer, placement, ubatch, slot_masks, split, scale, slopes, softcap, sinks
        )
        return out
    streams = _slot_streams(placement, ubatch)
    live = _slot_extents(cache, streams)
    out = _slots_attention(
        q,
        cache.k[g],
        cache.v[g],
        index,
        slot_masks,
        streams,
        live,
        slots_of(ubatch),
        cache.config,
        scale,
        slopes,
        softcap,
        sinks=sinks,
        v_cols=latent_cols(cache.config, g),
    )
    return out.astype(q.dtype)


def latent_cols(cfg, g: int) -> Optional[int]:
    """V's width in a latent (MLA) cache's group ``g`` (V is K's first columns), else None."""
    return cfg.groups[g].head_dim_v if cfg.mla else None


def _slot_extents(cache: KVCache, streams: Int[Array, " n_slots"]) -> Int[Array, " n_slots"]:
    """Cells each slot's attention must read: its stream's ``cell_max`` (0 for a padding slot)."""
    n_stream = cache.cells.pos.shape[0]
    return jnp.where(streams >= 0, jax.vmap(_cells.cell_max)(cache.cells)[jnp.clip(streams, 0, n_stream - 1)], 0)


#: A loop over a group of slots runs while it reads at most this many times the cells that a loop
#: per slot would (:func:`one_loop_pays`).
ONE_LOOP_READ_FACTOR = 1.5


def one_loop_pays(live: Int[Array, " n_slots"], group: int, c_one: int, c_own: int) -> Bool[Array, ""]:
    """Whether loops over groups of slots read at most :data:`ONE_LOOP_READ_FACTOR` times the cells of a loop per slot.

    A loop over ``group`` consecutive slots runs chunks of ``c_one`` cells up to the group's longest
    extent for each of them; a loop per slot runs chunks of ``c_own`` up to its own ``live``. Fewer
    ops pay for some extra reading; a long stream beside short ones does not.

    Example:
        >>> bool(one_loop_pays(jnp.array([100, 90, 120, 0]), 4, 64, 256))       # 512 cells against 768
        True
        >>> bool(one_loop_pays(jnp.array([8000, 16, 16, 16]), 4, 256, 1024))    # 32768 against 11264
        False
        >>> bool(one_loop_pays(jnp.array([8000, 7000, 16, 16]), 2, 256, 1024))  # in pairs: 16896 against 17408
        True
        >>> bool(one_loop_pays(jnp.array([8000, 16, 7000, 16]), 2, 256, 1024))  # 30720 against 17408
        False
    """
    longest = jnp.max(live.reshape(-1, group), axis=1)
    read_one = group * jnp.sum((longest + c_one - 1) // c_one * c_one)
    read_own = jnp.sum((live + c_own - 1) // c_own * c_own)
    return read_one.astype(jnp.float32) <= ONE_LOOP_READ_FACTOR * read_own.astype(jnp.float32)


def slot_group(n_slots: int, fits) -> int:
    """Slots per loop: the largest divisor of ``n_slots`` whose blocks ``fits(group)`` (1 when none).

    Example:
        >>> slot_group(32, lambda g: g <= 8), slot_group(12, lambda g: g <= 5), slot_group(7, lambda g: g < 7)
        (8, 4, 1)
    """
    return max(g for g in range(1, n_slots + 1) if n_slots % g == 0 and (g == 1 or fits(g)))


def _slots_attention(
    q,
    k_all,
    v_all,
    index: int,
    slot_masks,
    streams,
    live,
    slots: Tuple[int, int],
    cfg,
    scale,
    slopes,
    softcap,
    *,
    batched: bool = True,
    sinks=None,
    v_cols=None,
) -> Float[Array, "T Hq Dv"]:
    """Each slot over stream ``streams[j]`` of ``k_all [S, L, H, C, D]``, reading ``live[j]`` cells.

    A slot with ``live = 0`` (padding, or on a mesh a stream another device holds) gives zeros.
    ``batched``: the slots run in groups (:func:`slot_group`: as many as keep a step's score block
    and gathered K/V blocks within :data:`kvjax.attn._attention.SCORE_BLOCK_BYTES` and
    :data:`~kvjax.attn._attention.GATHER_BLOCK_BYTES`; all of them when decoding a small model), a
    group in one online-softmax loop (:func:`kvjax.attn._attention._attend` over a slot axis),
    chunk by chunk up to the group's largest ``live``: one gather and one contraction per chunk for
    the group, where one loop per slot costs its own few ops per slot and layer (at batch 32 on
    XLA:CPU those per-op costs were most of a decode step, see docs/speed.md). Such a loop reads the
    group's longest extent for every slot in it, so when the window spans several chunks it runs only
    while that is at most 1.5x the cells the slots' own loops would read (:func:`one_loop_pays`, a
    ``cond``; one long stream beside short ones read 4x the cells and ran 3-4x slower). Otherwise,
    and always when not ``batched``, slot by slot (``lax.map``), each over its own chunks, so a
    ``live = 0`` slot costs nothing: the mesh path's choice, where most slots belong to other
    devices. ``sinks`` (None or ``f32[Hq]``) join each row's softmax denominator
    (:func:`kvjax.attn._attention.apply_sinks`; a ``live = 0`` slot still gives zeros). Returns
    float32 ``[T, Hq, Dv]``. ``v_cols``: a latent cache's V width (V is K's first columns).
    """
    n_stream, n_layer, n_heads = k_all.shape[:3]
    # slot j reads (stream_j, index) of the [S, L, H, C, D] storage, sliced chunk by chunk straight
    # out of it (no per-stream copy of the window). Not a [S * L, ...] reshape: after a one-row
    # write (a dynamic-update-slice) XLA fused the write into the reshape as well, computed it twice
    # and copied every stream's K/V twice per layer to keep both (200 ms a token at 4 x 4096 cells)
    n_slots, t = slots
    n_kv = slot_masks.shape[-1]
    t_all, hq, d = q.shape
    grp = hq // n_heads
    width = n_heads * max(d, v_cols or v_all.shape[-1]) * 4  # float32 bytes a cell adds to a slot's gathered block
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    index_of = jnp.stack([jnp.clip(streams, 0, n_stream - 1), jnp.full_like(streams, index)], axis=-1).astype(jnp.int32)
    live = live.astype(jnp.int32)
    qs = q.astype(jnp.float32).reshape(n_slots, t, n_heads, grp, d).transpose(0, 2, 3, 1, 4)
    qs = qs.reshape(n_slots, n_heads, grp * t, d) * jnp.float32(scale)
    cap = None if softcap is None else jnp.float32(softcap)
    # rows are (kv head, group, token) per slot: each row's sink is its query head's
    sink_rows = None if sinks is None else jnp.repeat(sinks.reshape(n_heads, grp), t, axis=-1)

    def mask_and_bias(mask):
        """A slot's (or every slot's) ``[.., t, N]`` mask as an additive mask and an ALiBi bias."""
        if slopes is None:
            return mask, None
        # the mask holds -distance where visible: per-head slopes scale it, as ggml does
        visible = jnp.isfinite(mask)
        bias = jnp.asarray(slopes, jnp.float32)[:, None, None] * jnp.expand_dims(jnp.where(visible, mask, 0.0), -3)
        return jnp.where(visible, 0.0, _NEG_INF), bias

    def cell_bytes(group):  # a slot's own loop keeps the per-slot budget of the unified path
        return group * width if group > 1 else 0

    def chunk_of(group):
        return chunk_size(n_kv, n_heads, group * grp * t, cfg.padding, cell_bytes(group))

    def fits(group):  # the budgets hold (chunk_size falls back to `padding` cells when they cannot)
        return blocks_fit(chunk_of(group), n_heads, group * grp * t, cell_bytes(group))

    def attend(qr, mask, idx, n_live, group):
        add, bias = mask_and_bias(mask)
        out, lse = _attend(
            qr,
            k_all,
            v_all,
            idx,
            n_kv,
            add,
            bias,
            chunk_of(group),
            grp,
            cap,
            cfg.k_dtype,
            cfg.v_dtype,
            n_live=n_live,
            v_cols=v_cols,
        )
        return apply_sinks(out, lse, sink_rows)[0]  # [.., H, G * t, Dv]

    def slot_by_slot():
        return jax.lax.map(lambda a: attend(*a, 1), (qs, slot_masks, index_of, live))

    group = slot_group(n_slots, fits) if batched else 1

    def in_groups():  # a slot with nothing to read sees nothing, whatever its mask says
        seen = jnp.where((live > 0)[:, None, None], slot_masks, _NEG_INF)
        if group == n_slots:
            return attend(qs, seen, index_of, jnp.max(live), group)

        def split(x):
            return x.reshape((n_slots // group, group) + x.shape[1:])

        out = jax.lax.map(
            lambda a: attend(a[0], a[1], a[2], jnp.max(a[3]), group),
            (split(qs), split(seen), split(index_of), split(live)),
        )
        return out.reshape((n_slots,) + out.shape[2:])

    if group == 1:
        out = slot_by_slot()
    elif n_kv <= chunk_of(1):  # a slot's own loop reads the whole window anyway: a group's never reads more
        out = in_groups()
    else:  # a group's loop reads its longest stream's chunks for every slot: not when lengths are far apart
        out = jax.lax.cond(one_loop_pays(live, group, chunk_of(group), chunk_of(1)), in_groups, slot_by_slot)
    dv = out.shape[-1]
    return out.reshape(n_slots, n_heads, grp, t, dv).transpose(0, 3, 1, 2, 4).reshape(t_all, hq, dv)


def _write_rows(k_all, v_all, index: int, stream, cell, k, v, cfg):
    """Rows into ``[S, L, H, C, D]`` buffers at ``(stream, index, :, cell)``; -1 rows are dropped."""
    live = (stream >= 0) & (cell >= 0)
    target = jnp.where(live, cell, k_all.shape[3])  # out of bounds: dropped by the scatter
    stream = jnp.where(live, stream, 0)
    # indexed by ([T], scalar, :, [T]): the T axis comes first, rows go in as [T, H, D]
    new_k = k_all.at[stream, index, :, target].set(_quant.to_storage(k, cfg.k_dtype), mode="drop")
    if cfg.mla:  # a latent cache's V is K's first columns: nothing more to write
        return new_k, v_all
    new_v = v_all.at[stream, index, :, target].set(_quant.to_storage(v, cfg.v_dtype), mode="drop")
    return new_k, new_v


# -- on a device mesh --------------------------------------------------------------------------------


def _attend_on_mesh(
    q, k, v, memory, layer: int, placement, ubatch, slot_masks, split, scale, slopes, softcap, sinks=None
):
    """Write (unless ``k`` is None) and attend per device, each over the streams it holds (no K/V
    leaves its device).

    Under ``jax.shard_map`` over the ``"data"`` axis: a device writes the rows of its own streams
    (the others' fall out of bounds and are dropped) and runs every slot's attention loop with the
    slot's extent where the slot's stream is its own and 0 elsewhere (such a slot runs no chunk and
    gives zeros), so one ``psum`` of the ``[T, Hq, Dv]`` outputs over ``"data"`` assembles them.
    Heads stay split over ``"model"`` as the projections left them.
    """
    mesh, heads = split
    cache = memory.cache
    cfg = cache.config
    g, index = cfg.locate(int(layer))
    streams = _slot_streams(placement, ubatch)
    live = _slot_extents(cache, streams)
    slots = slots_of(ubatch)
    buf = P(DATA, None, heads, None, None)
    rows = P(None, heads, None)
    writes = k is not None
    if not writes:  # attention only: nothing is written (the placement's rows all fall out of bounds)
        k, v = q[:, :0], q[:, :0]
    elif v is None:  # a latent cache writes K only (a zero-width stand-in keeps the operands' specs)
        v = k[..., :0]
    operands = [cache.k[g], cache.v[g], q, k, v, placement.stream, placement.cell, streams, live, slot_masks]
    specs = [buf, buf, rows, rows, rows, P(), P(), P(), P(), P()]
    per_head = [x for x in (slopes, sinks) if x is not None]
    for x in per_head:  # ALiBi slopes and sinks per query head: split like the heads
        operands.append(jnp.asarray(x, jnp.float32))
        specs.append(P(heads))

    def local(k_all, v_all, q, k, v, stream, cell, streams, live, slot_masks, *per_head):
        extra = iter(per_head)
        local_slopes = next(extra) if slopes is not None else None
        local_sinks = next(extra) if sinks is not None else None
        n_local = k_all.shape[0]
        first = jax.lax.axis_index(DATA) * n_local
        if writes:
            mine = (stream >= first) & (stream < first + n_local)
            k_all, v_all = _write_rows(k_all, v_all, index, jnp.where(mine, stream - first, -1), cell, k, v, cfg)
        here = (streams >= first) & (streams < first + n_local)
        out = _slots_attention(
            q,
            k_all,
            v_all,
            index,
            slot_masks,
            jnp.where(here, streams - first, -1),
            jnp.where(here, live, 0),
            slots,
            cfg,
            scale,
            local_slopes,
            softcap,
            batched=False,
            sinks=local_sinks,
            v_cols=latent_cols(cfg, g),
        )
        out = jax.lax.psum(out, DATA)
        return (k_all, v_all, out) if writes else out

    if not writes:  # the buffers are not outputs: eagerly they would come back as fresh copies
        out = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=rows, check_vma=False)(*operands)
        return out.astype(q.dtype), memory
    k_all, v_all, out = jax.shard_map(
        local, mesh=mesh, in_specs=tuple(specs), out_specs=(buf, buf, rows), check_vma=False
    )(*operands)
    return out.astype(q.dtype), memory.replace(cache=_with_group(cache, g, k_all, v_all))


def attend(
    q,
    k,
    v,
    memory,
    layer: int,
    inputs,
    *,
    rope=None,
    alibi: Optional[np.ndarray] = None,
    swa_type=SwaType.NONE,
    n_swa: int = 0,
    scale=None,
    softcap=None,
    mask=None,
    sinks=None,
):
    """One layer's cached attention on a stream memory (what :func:`kvjax.nn.attend_cached` runs).

    RoPE at the ubatch positions, K/V written into each token's stream, then :func:`attention`
    with ``mask`` (the slots' masks the model computed once for this kind of layer) or masks built
    here; ``sinks`` as :func:`kvjax.attention`'s. Returns ``(out [T, Hq, Dv], memory)``.

    When the streams are split over a mesh's ``"data"`` axis (:func:`mesh_split`), the write and
    the attention run per device over the streams it holds (:func:`_attend_on_mesh`): the K/V never
    leave their devices, only the ``[T, Hq, Dv]`` outputs are summed across ``"data"``.
    """
    ubatch, placement = inputs.ubatch, inputs.placement
    sinks = check_sinks(sinks, q.shape[1])
    if rope is not None:
        q = _rope(q, ubatch.pos, rope)
        k = _rope(k, ubatch.pos, rope)
    if mask is None:  # the masks read the cell metadata only, which the K/V write does not change
        mask = masks(
            memory, ubatch, placement, inputs.windows[0], alibi=alibi is not None, swa_type=swa_type, n_swa=n_swa
        )
    split = mesh_split(memory.cache.k[memory.cache.config.locate(int(layer))[0]])
    if split is not None:
        return _attend_on_mesh(q, k, v, memory, layer, placement, ubatch, mask, split, scale, alibi, softcap, sinks)
    memory = memory.replace(cache=write(memory.cache, layer, placement, k, v))
    out = attention(q, memory, layer, mask, placement, ubatch, scale=scale, slopes=alibi, softcap=softcap, sinks=sinks)
    return out, memory
