"""A Pallas attention kernel over the cache's window: the accelerator path of ``kvjax.attention``.

One program per (kv head, block of query rows) reads that head's window ``[N, D]`` of K and V
straight from the stacked ``[L, H, C, D]`` storage, chunk by chunk, with an online softmax in
float32; the mask is read chunk by chunk too, and the ``[Hq, T, N]`` scores are never written
out. Rows are ordered ``(t, g)`` inside a kv head (query head ``h * G + g``), so a block of rows
is a block of tokens times the ``G`` query heads sharing the kv head, and the mask block
``[bt, chunk]`` is broadcast over ``G``.

Semantics are those of the XLA path (:func:`kvjax.attn._attention._attend`): fully masked rows
give 0 and an lse of ``-inf``; a masked cell has no effect whatever its bytes; a visible
non-finite V row makes the rows that weigh it NaN. Results agree with the XLA path up to float
rounding (the chunking of the online softmax differs). It runs compiled on GPU (Triton) and in
Pallas' interpreter anywhere else, which is how the tests prove it equal on CPU; float storage
only (no quantized K/V), no ``bias``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from kvjax._typing import Array, Float

_NEG_INF = -jnp.inf

#: Query rows (tokens times query heads per kv head) per program; a decode ubatch fits in one.
ROW_BLOCK = 128

#: Cells per step of the in-kernel loop (the largest power of two dividing the window, at most this).
KV_BLOCK = 512


def kv_block(n_kv: int) -> int:
    """Cells per in-kernel step: the largest power of two dividing ``n_kv``, at most :data:`KV_BLOCK`.

    Example:
        >>> kv_block(32768), kv_block(768), kv_block(96)
        (512, 256, 32)
    """
    block = 1
    while block * 2 <= KV_BLOCK and n_kv % (block * 2) == 0:
        block *= 2
    return block


def _kernel(*refs, group, block, n_kv, has_softcap):
    """One kv head, one block of rows: ``q [br, D]``, ``k [N, D]``, ``v [N, Dv]``, ``mask [bt, N]``
    (and the softcap as a ``[1, 1]`` input: a kernel may not capture a traced value)."""
    if has_softcap:
        q_ref, k_ref, v_ref, m_ref, cap_ref, o_ref, lse_ref = refs
        softcap = cap_ref[0, 0]
    else:
        q_ref, k_ref, v_ref, m_ref, o_ref, lse_ref = refs
        softcap = None
    q = q_ref[...].astype(jnp.float32)
    n_rows = q.shape[0]
    n_tok = n_rows // group
    dv = v_ref.shape[-1]

    def step(i, carry):
        m0, l0, o0 = carry
        start = pl.multiple_of(i * block, block)
        kc = k_ref[pl.ds(start, block), :].astype(jnp.float32)
        vc = v_ref[pl.ds(start, block), :].astype(jnp.float32)
        ac = m_ref[:, pl.ds(start, block)]  # [bt, block]
        s = jax.lax.dot_general(q, kc, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        visible = jnp.broadcast_to((ac > _NEG_INF)[:, None, :], (n_tok, group, block))
        s = s.reshape(n_tok, group, block) + ac[:, None, :]
        # a masked cell has no effect even when its K is NaN or inf
        s = jnp.where(visible, s, _NEG_INF).reshape(n_rows, block)
        m1 = jnp.maximum(m0, jnp.max(s, axis=-1))
        m1_safe = jnp.where(m1 == _NEG_INF, 0.0, m1)
        p = jnp.exp(s - m1_safe[:, None])
        alpha = jnp.exp(m0 - m1_safe)
        # a zero weight times a NaN V is NaN: such rows are zeroed for the product, and a row that
        # does weigh one becomes NaN, as in the XLA path
        finite = jnp.all(jnp.isfinite(vc), axis=-1)  # [block]
        clean = jnp.where(finite[:, None], vc, 0.0)
        pv = jax.lax.dot_general(p, clean, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        sees = jnp.any((p > 0) & ~finite[None, :], axis=-1)
        pv = jnp.where(sees[:, None], jnp.nan, pv)
        return m1, l0 * alpha + jnp.sum(p, axis=-1), o0 * alpha[:, None] + pv

    init = (
        jnp.full((n_rows,), _NEG_INF, jnp.float32),
        jnp.zeros((n_rows,), jnp.float32),
        jnp.zeros((n_rows, dv), jnp.float32),
    )
    m, l, o = jax.lax.fori_loop(0, n_kv // block, step, init)
    seen = l != 0
    o_ref[...] = jnp.where(seen[:, None], o / jnp.where(seen, l, 1.0)[:, None], 0.0)
    lse_ref[...] = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _NEG_INF)


@functools.partial(jax.jit, static_argnames=("index", "n_kv", "interpret", "v_cols"))
def attend(
    qr: Float[Array, "H R D"],
    k_all: Float[Array, "L H C D"],
    v_all: Float[Array, "L H C Dv"],
    add: Float[Array, "T N"],
    *,
    index: int,
    n_kv: int,
    interpret: bool,
    softcap=None,
    v_cols=None,
):
    """Online-softmax attention of ``qr`` over the first ``n_kv`` cells of layer ``index`` of a group.

    Args:
        qr: ``[H, T * G, D]`` scaled float32 queries, rows ordered ``(t, g)`` per kv head.
        k_all: ``[L, H, C, D]`` the group's stacked K storage (float).
        v_all: ``[L, H, C, Dv]`` the group's stacked V storage (float).
        add: ``f32[T, N]`` additive mask (``-inf``: not visible), ``N == n_kv``.
        index: static layer index inside the group.
        n_kv: static window.
        interpret: run in Pallas' interpreter (any backend) instead of compiling the kernel.
        softcap: None or an f32 scalar (Gemma 2's logit soft-capping).
        v_cols: None, or (a latent cache, ``v_all`` being K itself) V's width: the kernel's V
            block is the first ``v_cols`` columns of K's rows, read in place.

    Returns:
        ``(out f32[H, T * G, Dv], lse f32[H, T * G])``, rows as in ``qr``.
    """
    n_heads, n_rows, d = qr.shape
    n_tok = add.shape[0]
    group = n_rows // n_tok
    dv = v_all.shape[-1] if v_cols is None else v_cols
    # tokens per program: all of them for a decode ubatch, else blocks of ~ROW_BLOCK rows (T padded
    # with fully masked rows, cut off again below)
    bt = n_tok if n_rows <= ROW_BLOCK else max(1, ROW_BLOCK // group)
    t_pad = -(-n_tok // bt) * bt
    if t_pad != n_tok:
        qr = jnp.pad(qr.reshape(n_heads, n_tok, group, d), ((0, 0), (0, t_pad - n_tok), (0, 0), (0, 0)))
        qr = qr.reshape(n_heads, t_pad * group, d)
        add = jnp.pad(add, ((0, t_pad - n_tok), (0, 0)), constant_values=_NEG_INF)
    br = bt * group
    block = kv_block(n_kv)
    kernel = functools.partial(_kernel, group=group, block=block, n_kv=n_kv, has_softcap=softcap is not None)
    operands = [qr, k_all, v_all, add]
    in_specs = [
        pl.BlockSpec((None, br, d), lambda h, r: (h, r, 0)),
        pl.BlockSpec((None, None, n_kv, d), lambda h, r: (index, h, 0, 0)),
        pl.BlockSpec((None, None, n_kv, dv), lambda h, r: (index, h, 0, 0)),
        pl.BlockSpec((bt, n_kv), lambda h, r: (r, 0)),
    ]
    if softcap is not None:
        operands.append(jnp.reshape(softcap, (1, 1)).astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1, 1), lambda h, r: (0, 0)))
    out, lse = pl.pallas_call(
        kernel,
        grid=(n_heads, t_pad // bt),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, br, dv), lambda h, r: (h, r, 0)),
            pl.BlockSpec((None, br), lambda h, r: (h, r)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((n_heads, t_pad * group, dv), jnp.float32),
            jax.ShapeDtypeStruct((n_heads, t_pad * group), jnp.float32),
        ],
        interpret=interpret,
    )(*operands)
    return out[:, : n_tok * group], lse[:, : n_tok * group]
