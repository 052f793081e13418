"""Attention of a ubatch's queries over the cache (grouped-query, masked, float32 softmax).

``attention(q, cache, layer, mask)`` reads ``view(cache, layer, N)`` with ``N = mask.shape[-1]``
(the static window, see :mod:`kvjax.attn._windows`) and returns ``softmax(q k^T * scale + mask + bias) v``
per query head. Query head ``j`` uses kv head ``j // G`` with ``G = Hq / H`` (grouped-query
attention, as ggml and llama.cpp lay heads out). Softmax and both contractions accumulate in
float32 whatever the storage dtype; a row whose entries are all masked gives 0 and an lse of
``-inf`` (not NaN). Learned attention sinks (gpt-oss: one logit per query head that joins every
row's softmax denominator and weighs no value) are applied to any path's result with
:func:`apply_sinks`, from its lse: ``out * sigmoid(lse - sink)``.

Formulation (chosen by measurement on XLA's CPU backend, see ``docs/architecture.md`` and
``benchmarks/bench_attention.py``): the queries of one kv head are stacked into one matrix
``[G * T, D]`` so K and V are read once per kv head, not once per query head; the scores are
one batched contraction per kv head over the stored ``[H, N, D]`` layout (no transpose of K or V,
no copy of K/V per query head); float32 accumulation; and the window is processed in chunks of
:data:`MAX_CHUNK` cells with an online softmax, each chunk sliced straight out of the stacked
``[L, H, C, D]`` storage, so neither the layer's window nor a ``[Hq, T, N]`` score matrix is ever
copied out. The values read are exactly those of ``kvjax.view(cache, layer, N)``. Only the chunks
between the first and the last column the mask shows to some row do any work (:func:`chunk_range`),
so a window bucket larger than the cells in use, or a sliding window's masked start, costs no dot.
For a ubatch of many sequences decoding side by side (at least :data:`OWNED_MIN_TOKENS` tokens and
at most ``n_seq_max``), a chunk whose every column is seen by at most one token runs
:func:`_owned_step`: each cell meets only its own token's queries, so the cost follows the chunk's
bytes instead of ``T`` times them.

Example:
    >>> import jax.numpy as jnp, kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> ub = kvjax.make_ubatch([0, 1], [[0], [0]])
    >>> cache, slot, _ = kvjax.find_slot(kvjax.init(cfg), ub)
    >>> k = jnp.array([[[1.0, 0.0]], [[0.0, 1.0]]]); v = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]]])
    >>> cache = kvjax.write(cache, 0, slot, k, v)
    >>> q = jnp.zeros((2, 2, 2))                    # [T, Hq=2, D]: equal scores
    >>> kvjax.attention(q, cache, 0, kvjax.kq_mask(cache, ub, 32))[:, 0].tolist()
    [[1.0, 2.0], [2.0, 3.0]]
"""

from __future__ import annotations

import functools
import os
from typing import Optional, Tuple

import jax
import jax.numpy as jnp

from kvjax._typing import Array, Float
from kvjax.storage import _quant
from kvjax.attn import _pallas

_NEG_INF = -jnp.inf

#: Budget for one chunk's float32 score block ``[H, G*T, chunk]``: it stays in the CPU's L2/L3
#: between the two contractions. Only large ubatches (prefill) hit it before :data:`MAX_CHUNK`.
SCORE_BLOCK_BYTES = 2 << 20

#: Cells per online-softmax step. Measured on the CPU here (32 query heads over 8 kv heads, head
#: size 64): 512-1024 best; reading each chunk straight out of the stacked storage beat a single
#: pass over the window by 1.1-1.6x (tcmalloc) to 6-10x (glibc malloc) whenever that pass needs
#: the window sliced out first (every window of a multi-layer group, every window smaller than the
#: cache); it lost by ~1.2x only where the window is the whole storage of a single-layer group
#: (see docs/architecture.md).
MAX_CHUNK = 1024


#: Fewest tokens in a ubatch for which :func:`_attend` checks each chunk for columns seen by at
#: most one token (:func:`_owned_step`); ``kvjax.attention`` also needs ``T <= n_seq_max`` (with
#: more tokens than sequences some sequence has two rows, and its cells two viewers). Measured on
#: this CPU (4 layers of decode attention, 32 query heads over 8 kv heads, sequences side by side
#: in one cache, docs/speed.md section 12): 8 tokens 0.67x the dense loop's speed, 16 tokens 1.13x,
#: 32 tokens 1.5-1.7x, 64 tokens 3x. Outside these bounds the owned branch is not compiled at all.
OWNED_MIN_TOKENS = 16


#: Budget for one step's gathered K (or V) block ``[B, H, chunk, D]`` as float32 when the loop runs
#: over several slots at once (streams): ``B`` slots multiply it, so it bounds the chunk too.
GATHER_BLOCK_BYTES = 8 << 20


def chunk_size(n_kv: int, n_heads: int, n_rows: int, padding: int, cell_bytes: int = 0) -> int:
    """Cells per online-softmax step for a window of ``n_kv`` cells and ``n_rows = G * T`` rows.

    A power of two times ``padding``, at most :data:`MAX_CHUNK`, with the score block under
    :data:`SCORE_BLOCK_BYTES` and, when ``cell_bytes`` (float32 bytes one cell adds to a gathered
    K or V block, all slots together) is given, that block under :data:`GATHER_BLOCK_BYTES`
    (``padding`` itself when even that is larger); the whole window when it is smaller than that.
    ``n_rows`` counts the rows of every slot a step contracts at once.

    Example:
        >>> chunk_size(32768, 8, 4, 256), chunk_size(32768, 8, 2048, 256), chunk_size(512, 8, 4, 256)
        (1024, 256, 512)
        >>> chunk_size(32768, 8, 64, 32, cell_bytes=64 * 8 * 128 * 4)     # 64 slots, head size 128
        32
    """
    chunk = padding
    while chunk * 2 <= MAX_CHUNK and blocks_fit(chunk * 2, n_heads, n_rows, cell_bytes):
        chunk *= 2
    return min(chunk, n_kv)


def blocks_fit(chunk: int, n_heads: int, n_rows: int, cell_bytes: int = 0) -> bool:
    """Whether a step of ``chunk`` cells keeps its blocks within budget (see :func:`chunk_size`).

    The score block ``[H, n_rows, chunk]`` float32 under :data:`SCORE_BLOCK_BYTES`, and the
    gathered K or V block (``cell_bytes`` a cell) under :data:`GATHER_BLOCK_BYTES`.

    Example:
        >>> blocks_fit(1024, 8, 64), blocks_fit(1024, 8, 128), blocks_fit(256, 8, 1, cell_bytes=64 << 10)
        (True, False, False)
    """
    return 4 * n_heads * n_rows * chunk <= SCORE_BLOCK_BYTES and cell_bytes * chunk <= GATHER_BLOCK_BYTES


def _clean_pv(p, vc, pv_dims):
    """``p @ vc`` with V rows that are not finite zeroed, and NaN for the rows ``p`` that weigh one."""
    finite = jnp.all(jnp.isfinite(vc), axis=-1)  # [..., H, chunk]
    clean = jnp.where(finite[..., None], vc, 0.0)
    pv = jax.lax.dot_general(p, clean, pv_dims, preferred_element_type=jnp.float32)
    sees = jnp.any((p > 0) & ~finite[..., None, :], axis=-1)  # [..., H, R]
    return jnp.where(sees[..., None], jnp.nan, pv)


def chunk_range(add: Float[Array, "... T N"], chunk: int) -> Tuple[Array, Array]:
    """``(first, stop)``: the online-softmax steps ``first <= i < stop`` that hold a column some row sees.

    A column is seen when its additive mask entry is above ``-inf`` for some row. Step ``i`` is
    responsible for columns ``[i * chunk, (i + 1) * chunk)`` (the last one clamped onto the window,
    see ``_attend``); the others hold only columns every row masks. ``(N // chunk, 0)`` when no
    column is seen.

    Example:
        >>> add = jnp.full((1, 48), -jnp.inf).at[0, 40].set(0.0)      # 48 cells in steps of 32
        >>> [int(x) for x in chunk_range(add, 32)], [int(x) for x in chunk_range(add.at[0, 3].set(0.0), 16)]
        ([1, 2], [0, 3])
        >>> [int(x) for x in chunk_range(jnp.full((2, 48), -jnp.inf), 16)]
        [3, 0]
    """
    n = add.shape[-1]
    seen = jnp.any(add > _NEG_INF, axis=tuple(range(add.ndim - 1)))
    cols = jnp.arange(n, dtype=jnp.int32)
    lo, hi = jnp.min(jnp.where(seen, cols, n)), jnp.max(jnp.where(seen, cols + 1, 0))
    return lo // chunk, (hi + chunk - 1) // chunk


def _sum_minor(x: Float[Array, "... D"]) -> Float[Array, "..."]:
    """``x.sum(-1)`` as halving adds of static slices: elementwise ops XLA fuses into one pass.

    Measured on this CPU for the owned step's per-cell products ``[H, G, chunk, D]``: a ``reduce``
    over a short minor axis went to a YNN fusion at ~10x the time of reading its operands, and a
    ``dot_general`` batched over cells ran as a loop of tiny products; the halving adds run at
    about the speed of reading ``x``.

    Example:
        >>> _sum_minor(jnp.arange(12.0).reshape(2, 6)).tolist()
        [15.0, 51.0]
    """
    while x.shape[-1] > 1 and x.shape[-1] % 2 == 0:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    total = x[..., 0]
    for j in range(1, x.shape[-1]):
        total = total + x[..., j]
    return total


def _owned_step(qr, kc, vc, ac, bc, owner, group, softcap, carry):
    """One online-softmax step over a chunk whose every column is seen by at most one token.

    The dense step multiplies every row with every cell of the chunk; in a batch of sequences
    decoding side by side in one unified cache (one token per sequence, each sequence's cells
    interleaved with the others') each row sees only its own cells, ``1 / T`` of them, so the
    dense contractions are ``T`` times the work that counts. Here each cell meets only the query
    rows of the token that sees it (``owner``): its scores are one product per (kv head, group,
    cell), the row maxima and sums are segment reductions by owner, and the output is a
    scatter-add of ``p * v`` by owner, so the cost follows the chunk's bytes, not ``T`` times them.
    Masked cells (``owner == T``) score ``-inf`` whatever their bytes; non-finite V rows behave as
    in the dense step (a row that weighs one is NaN, the others never read it).

    Args:
        qr: ``[H, G * T, D]`` scaled queries, rows ordered ``(g, t)``.
        kc, vc: ``[H, chunk, D]``, ``[H, chunk, Dv]`` the chunk's K and V (float32).
        ac: ``[T, chunk]`` additive mask of the chunk; ``bc`` None or its bias
            ``[1 | H * G, 1 | T, 1 | chunk]``.
        owner: ``i32[chunk]`` the token that sees each column, ``T`` for a column none sees.
        group: ``G``; ``softcap`` None or an f32 scalar.
        carry: ``(m, l, o)`` of the online softmax, ``[H, G * T]``, ``[H, G * T]``, ``[H, G * T, Dv]``.
    """
    m0, l0, o0 = carry
    n_heads, n_rows, d = qr.shape
    n_tok = n_rows // group
    dv = vc.shape[-1]
    seen = owner < n_tok
    own = jnp.minimum(owner, n_tok - 1)
    cols = jnp.arange(ac.shape[-1])
    # each cell's score against its owner's G query rows: [H, G, chunk]
    q_own = qr.reshape(n_heads, group, n_tok, d)[:, :, own, :]
    s = _sum_minor(q_own * kc[:, None])
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    s = s + ac[own, cols]
    if bc is not None:
        bc = jnp.broadcast_to(bc, bc.shape[:-1] + ac.shape[-1:])
        heads = (n_heads, group) if bc.shape[0] > 1 else (1, 1)
        b = bc.reshape(heads + bc.shape[1:])  # [1 | H, 1 | G, 1 | T, chunk]
        s = s + (b[:, :, 0] if b.shape[2] == 1 else b[:, :, own, cols])
    s = jnp.where(seen, s, _NEG_INF)
    by_owner = functools.partial(jnp.zeros, (n_heads, group, n_tok), jnp.float32)
    m_old = m0.reshape(n_heads, group, n_tok)
    m1 = jnp.full((n_heads, group, n_tok), _NEG_INF, jnp.float32).at[:, :, own].max(s)
    m1 = jnp.maximum(m_old, m1)
    m1_safe = jnp.where(m1 == _NEG_INF, 0.0, m1)  # all masked so far: no NaN
    p = jnp.exp(s - m1_safe[:, :, own])  # [H, G, chunk], 0 where unseen
    alpha = jnp.exp(m_old - m1_safe)
    l1 = l0.reshape(n_heads, group, n_tok) * alpha + by_owner().at[:, :, own].add(p)

    def pv_of(v):
        # a zero weight leaves the row alone whatever the V bytes (0 * inf would be NaN); a NaN
        # weight (a NaN score) stays NaN
        pv = jnp.where((p == 0)[..., None], 0.0, p[..., None] * v[:, None])
        return jnp.zeros((n_heads, group, n_tok, dv), jnp.float32).at[:, :, own, :].add(pv)

    pv = pv_of(vc)

    def cleaned():
        finite = jnp.all(jnp.isfinite(vc), axis=-1)  # [H, chunk]
        sees = by_owner().at[:, :, own].max(((p > 0) & ~finite[:, None]).astype(jnp.float32)) > 0
        return jnp.where(sees[..., None], jnp.nan, pv_of(jnp.where(finite[..., None], vc, 0.0)))

    pv = jax.lax.cond(jnp.all(jnp.isfinite(pv)), lambda: pv, cleaned)
    o1 = o0.reshape(n_heads, group, n_tok, dv) * alpha[..., None] + pv
    return m1.reshape(n_heads, n_rows), l1.reshape(n_heads, n_rows), o1.reshape(n_heads, n_rows, dv)


def _attend(
    qr,
    k_all,
    v_all,
    index,
    n_kv,
    add,
    bias,
    chunk,
    group,
    softcap=None,
    k_type="float32",
    v_type="float32",
    n_live=None,
    skip_masked=False,
    owned=False,
    v_cols=None,
):
    """Online-softmax attention over the first ``n_kv`` cells of layer ``index`` of a group.

    ``qr [H, R, D]`` with ``R = G * T`` rows ordered ``(g, t)``; ``add [T, N]`` the additive mask;
    ``bias`` None or ``[1 | H * G, 1 | T, 1 | N]``. ``k_all [L, H, C, D]`` and
    ``v_all [L, H, C, Dv]`` are the stacked storage itself (or a stream memory's ``[S, L, H, C, *]``
    with ``index`` an ``i32[2]`` pair ``(stream, layer)``: no reshape of the buffers a step has just
    written, which XLA answered with copies of all of them): every step slices its
    ``[H, chunk, *]`` block straight out of it (no copy of the layer's window first), and the
    score block of one chunk (``[H, R, chunk]`` float32) is the largest temporary; mask and bias
    are broadcast per chunk, never expanded to ``[H, R, N]``. When ``chunk`` does not divide
    ``n_kv`` the last start is clamped and the columns an earlier step already covered are masked
    out. ``softcap`` (None or an f32 scalar) caps the scaled scores, ``softcap * tanh(s / softcap)``,
    before mask and bias are added. ``n_live`` (None or a traced int32): only the chunks holding
    the first ``n_live`` cells run (a stream's own extent; the cells past it are empty anyway).
    ``skip_masked``: when the window spans several chunks, only the chunks between the first and
    the last column the mask shows to some row do any work (:func:`chunk_range`), so the cost
    follows the cells in use, not the window bucket (up to twice the cells the seed reads). Exact:
    a chunk every row masks changes nothing in the online softmax. Skipped chunks cost a ``cond``
    each; the trip count stays static, so the loop can be differentiated and vmapped.
    ``owned`` (unbatched calls only, with ``skip_masked``, without ``n_live``): each chunk is
    classified by how many tokens see its columns: none (skipped, also inside the visible span),
    at most one each (:func:`_owned_step`), or two somewhere (the dense step). Under ``vmap`` the
    per-chunk ``switch`` is a select that runs all three, slower than the dense loop alone.
    ``v_cols`` (a latent (MLA) cache): V is the first ``v_cols`` columns of each K block, read
    once for both products; ``v_all`` is then not read.

    Batched over slots: with ``qr [B, H, R, D]``, ``index i32[B]`` (slot ``b`` reads layer
    ``index[b]``), ``add [B, T, N]`` and ``bias`` None or ``[B, 1 | H * G, 1 | T, 1 | N]``, every
    step gathers the ``[B, H, chunk, *]`` blocks of all slots and runs one contraction for them
    (the per-slot results are those of ``B`` separate calls); the results gain the leading ``B``.
    """
    lead = qr.shape[:-3]  # () or (B,): slots side by side
    if owned and (lead or not skip_masked or n_live is not None):
        raise ValueError("owned chunks need an unbatched call that skips masked chunks, without n_live")
    nb = len(lead)
    n_heads, n_rows, _ = qr.shape[-3:]
    n_tok = n_rows // group
    if v_cols is not None:
        dv = v_cols
    elif _quant.is_quantized(v_type):
        dv = v_all.shape[-1] // _quant.QUANT_TYPES[v_type].type_size * _quant.QUANT_TYPES[v_type].block
    else:
        dv = v_all.shape[-1]
    n_steps = -(-n_kv // chunk)
    batch = tuple(range(nb + 1))
    qk_dims = (((nb + 2,), (nb + 2,)), (batch, batch))  # [.., H, R, D] x [.., H, C, D] -> [.., H, R, C]
    pv_dims = (((nb + 2,), (nb + 1,)), (batch, batch))  # [.., H, R, C] x [.., H, C, Dv] -> [.., H, R, Dv]

    def cells_of(x, start):
        """The step's columns of a [..., N] (or [..., 1]) operand."""
        return x if x.shape[-1] == 1 else jax.lax.dynamic_slice_in_dim(x, start, chunk, axis=x.ndim - 1)

    def block(x, start, name):
        """The step's ``[.., H, chunk, *]`` block of the storage ``x [L, H, C, *]`` (or of a stream
        memory's ``[S, L, H, C, *]``, ``index`` then holding ``(stream, layer)`` pairs), as values."""
        n_lead = x.ndim - 3
        size = (1,) * n_lead + x.shape[-3:-2] + (chunk,) + x.shape[-1:]

        def one(i):
            lead = (i,) if n_lead == 1 else tuple(i[j] for j in range(n_lead))
            return jax.lax.dynamic_slice(x, lead + (0, start, 0), size).reshape(size[n_lead:])

        xc = jax.vmap(one)(index) if nb else one(index)
        return _quant.from_storage(xc, name)  # this chunk only, as float32

    def blocks(start):
        """The step's K and V blocks (a latent cache's V: the K block's first ``v_cols`` columns)."""
        kc = block(k_all, start, k_type)
        return (kc, kc[..., :v_cols]) if v_cols is not None else (kc, block(v_all, start, v_type))

    def by_row(x):
        """``[.., T, chunk]`` (or a bias ``[.., 1 | H * G, 1 | T, chunk]``) against ``[.., H, G, T, chunk]``."""
        heads = (1, 1) if x.ndim == nb + 2 or x.shape[nb] == 1 else (n_heads, group)
        return x.reshape(lead + heads + x.shape[-2:])

    def step(i, carry):
        m0, l0, o0 = carry
        start = jnp.minimum(i * chunk, n_kv - chunk)
        kc, vc = blocks(start)
        ac = cells_of(add, start)  # [.., T, chunk]
        if n_kv % chunk:
            fresh = start + jnp.arange(chunk) >= i * chunk  # columns not seen by an earlier step
            ac = jnp.where(fresh, ac, _NEG_INF)
        s = jax.lax.dot_general(qr, kc, qk_dims, preferred_element_type=jnp.float32)
        if softcap is not None:  # Gemma 2's logit soft-capping, on the scaled scores before the mask
            s = softcap * jnp.tanh(s / softcap)
        visible = by_row(ac > _NEG_INF)  # [.., 1, 1, T, chunk]
        s = s.reshape(lead + (n_heads, group, n_tok, chunk)) + by_row(ac)
        if bias is not None:
            s = s + by_row(cells_of(bias, start))
        # a masked cell has no effect whatever its bytes: its score is -inf even when its K is NaN
        # or inf (adding -inf to a NaN score would leave NaN)
        s = jnp.where(visible, s, _NEG_INF).reshape(lead + (n_heads, n_rows, chunk))
        m1 = jnp.maximum(m0, jnp.max(s, axis=-1))
        m1_safe = jnp.where(m1 == _NEG_INF, 0.0, m1)  # all masked so far: no NaN
        p = jnp.exp(s - m1_safe[..., None])
        alpha = jnp.exp(m0 - m1_safe)
        pv = jax.lax.dot_general(p, vc, pv_dims, preferred_element_type=jnp.float32)
        # ... and a zero weight times a NaN or inf V is still NaN: only when the product is not
        # finite (rare: some V row of the chunk is NaN or inf) is it redone with those rows zeroed;
        # a row that does see one of them becomes NaN, as it would have without the cleaning
        pv = jax.lax.cond(jnp.all(jnp.isfinite(pv)), lambda: pv, lambda: _clean_pv(p, vc, pv_dims))
        return m1, l0 * alpha + jnp.sum(p, axis=-1), o0 * alpha[..., None] + pv

    init = (
        jnp.full(lead + (n_heads, n_rows), _NEG_INF, jnp.float32),
        jnp.zeros(lead + (n_heads, n_rows), jnp.float32),
        jnp.zeros(lead + (n_heads, n_rows, dv), jnp.float32),
    )
    if n_live is not None:
        # a dynamic trip count: a stream's cost follows its own cells even when the shared window is
        # many chunks longer (a cond per chunk would run them all); reverse-mode autodiff does not
        # go through it, and nothing differentiates a stream cache's attention
        m, l, o = jax.lax.fori_loop(0, (jnp.minimum(n_live, n_kv) + chunk - 1) // chunk, step, init)
    else:
        body = step
        if owned:
            viewers = jnp.sum(add > _NEG_INF, axis=0, dtype=jnp.int32)  # [N] rows that see a cell
            t_ids = jnp.arange(n_tok, dtype=jnp.int32)[:, None]

            def owned_step(i, carry):
                start = jnp.minimum(i * chunk, n_kv - chunk)
                ac = cells_of(add, start)
                if n_kv % chunk:
                    ac = jnp.where(start + jnp.arange(chunk) >= i * chunk, ac, _NEG_INF)
                owner = jnp.min(jnp.where(ac > _NEG_INF, t_ids, n_tok), axis=0)  # [chunk], n_tok: unseen
                bc = None if bias is None else cells_of(bias, start)
                return _owned_step(qr, *blocks(start), ac, bc, owner, group, softcap, carry)

            # per chunk, by the most tokens that see one of its columns: 0 skip, 1 owned, 2+ dense;
            # a fixed trip count, as below
            def body(i, carry):
                start = jnp.minimum(i * chunk, n_kv - chunk)
                seen_by = jax.lax.dynamic_slice_in_dim(viewers, start, chunk)
                if n_kv % chunk:  # the clamped last chunk: only the columns no earlier step covered
                    seen_by = jnp.where(start + jnp.arange(chunk) >= i * chunk, seen_by, 0)
                kind = jnp.minimum(jnp.max(seen_by), 2)
                return jax.lax.switch(kind, (lambda i, carry: carry, owned_step, step), i, carry)
        elif skip_masked and n_steps > 1:  # only the chunks between the first and last visible column
            first, stop = chunk_range(add, chunk)

            # a fixed trip count with a cond per chunk, not dynamic loop bounds: reverse-mode
            # autodiff needs static bounds, and under vmap the cond becomes a select (the same bits
            # as unbatched); a skipped chunk costs the cond, several times less than its dots
            def body(i, carry):
                return jax.lax.cond((i >= first) & (i < stop), step, lambda i, carry: carry, i, carry)

        m, l, o = body(0, init) if n_steps == 1 else jax.lax.fori_loop(0, n_steps, body, init)
    seen = l != 0  # a fully masked row has l == 0; a NaN score (visible NaN K) keeps its NaN
    out = jnp.where(seen[..., None], o / jnp.where(seen, l, 1.0)[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), _NEG_INF)
    return out, lse


def check_sinks(sinks, n_heads: int) -> Optional[Float[Array, " Hq"]]:
    """``sinks`` as float32 ``[Hq]`` (one logit per query head), or None; raise ``ValueError`` otherwise.

    Example:
        >>> check_sinks(jnp.zeros(3, jnp.bfloat16), 3).dtype, check_sinks(None, 3)
        (dtype('float32'), None)
        >>> check_sinks(jnp.zeros(2), 4)
        Traceback (most recent call last):
        ...
        ValueError: sinks has shape (2,) and dtype float32: allowed a floating [Hq=4] array (one logit per query head) or None
    """
    if sinks is None:
        return None
    shape, dtype = getattr(sinks, "shape", None), getattr(sinks, "dtype", None)
    if shape is None or tuple(shape) != (n_heads,) or not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(
            f"sinks has shape {None if shape is None else tuple(shape)} and dtype {dtype}: allowed a floating "
            f"[Hq={n_heads}] array (one logit per query head) or None"
        )
    return jnp.asarray(sinks, jnp.float32)


def apply_sinks(
    out: Float[Array, "... R Dv"], lse: Float[Array, "... R"], sinks: Optional[Float[Array, "... R"]]
) -> Tuple[Float[Array, "... R Dv"], Float[Array, "... R"]]:
    """Rows of an attention result with a sink logit per row joined to their softmax denominators.

    A sink ``s`` adds ``exp(s)`` to the denominator of its row and weighs no value (gpt-oss's
    learned sinks, llama.cpp's ``soft_max_ext`` sinks): the attention ``o / l`` over the cells
    becomes ``o / (l + exp(s - m))``, which is ``out * sigmoid(lse - s)`` with ``lse = m + log l``,
    and the row's lse becomes ``logaddexp(lse, s)``. Exact for any path that returns its lse (XLA
    chunks, owned chunks, stream slots, Pallas), so the kernels themselves stay as they are. A fully
    masked row (``out = 0``, ``lse = -inf``) keeps ``out = 0`` and gets ``lse = s``; ``s = -inf`` is
    no sink; a NaN row stays NaN.

    Args:
        out: float32 ``[..., R, Dv]`` attention of each row over the cells alone.
        lse: float32 ``[..., R]`` its log-sum-exp.
        sinks: float32 broadcastable to ``[..., R]``, or None (``out``, ``lse`` unchanged).

    Example:
        >>> out, lse = apply_sinks(jnp.ones((2, 1)), jnp.array([0.0, -jnp.inf]), jnp.array([0.0, 1.0]))
        >>> out[:, 0].tolist(), lse.tolist()          # half the weight goes to the sink; masked stays 0
        ([0.5, 0.0], [0.6931471824645996, 1.0])
    """
    if sinks is None:
        return out, lse
    sinks = jnp.broadcast_to(jnp.asarray(sinks, jnp.float32), lse.shape)
    # where both are -inf (a masked row, no sink) the difference is NaN: the row keeps its 0
    keep = jnp.where(lse == _NEG_INF, 0.0, jax.nn.sigmoid(lse - sinks))
    return out * keep[..., None], jnp.logaddexp(lse, sinks)


@functools.partial(jax.jit, static_argnames=("layer", "n_kv", "chunk", "return_lse", "implementation"))
def _attention(
    q, cache, mask, bias, scale, layer, n_kv, chunk, return_lse, softcap=None, implementation="xla", sinks=None
):
    g_id, index = cache.config.locate(layer)
    k_all, v_all = cache.k[g_id], cache.v[g_id]  # [L, H, C, D], [L, H, C, Dv]
    n_heads = k_all.shape[1]
    t, hq, d = q.shape
    g = hq // n_heads
    cfg = cache.config
    v_cols = cfg.groups[g_id].head_dim_v if cfg.mla else None  # a latent cache's V: K's first columns
    if implementation == "pallas":
        return _attention_pallas(q, k_all, v_all, mask, scale, index, n_kv, return_lse, softcap, sinks, v_cols)
    # query head j = h * G + g' belongs to kv head h; its rows are ordered (g', t) so that one
    # [G * T, D] matrix per kv head meets that head's K and V once
    qr = q.astype(jnp.float32).reshape(t, n_heads, g, d).transpose(1, 2, 0, 3).reshape(n_heads, g * t, d)
    qr = qr * scale
    if mask.dtype == jnp.bool_:
        add = jnp.where(mask, 0.0, _NEG_INF).astype(jnp.float32)
    else:
        add = mask.astype(jnp.float32)
    b = None
    if bias is not None:  # as [1 | Hq, 1 | T, 1 | N], broadcast chunk by chunk
        b = bias.astype(jnp.float32).reshape((1,) * (3 - bias.ndim) + tuple(bias.shape))
    # rows of distinct sequences may each see only their own cells (a batch decoding side by side)
    owned = OWNED_MIN_TOKENS <= t <= cache.config.n_seq_max
    out, lse = _attend(
        qr,
        k_all,
        v_all,
        jnp.int32(index),
        n_kv,
        add,
        b,
        chunk,
        g,
        softcap,
        cache.config.k_dtype,
        cache.config.v_dtype,
        skip_masked=True,
        owned=owned,
        v_cols=v_cols,
    )
    dv = out.shape[-1]
    out = out.reshape(n_heads, g, t, dv).transpose(2, 0, 1, 3).reshape(t, hq, dv)
    out, lse = apply_sinks(out, lse.reshape(n_heads, g, t).transpose(2, 0, 1).reshape(t, hq), sinks)
    return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)


#: The attention implementations: ``"xla"`` (the chunked XLA formulation above, the default on
#: CPU) and ``"pallas"`` (:mod:`kvjax.attn._pallas`, compiled on GPU, interpreted elsewhere).
IMPLEMENTATIONS = ("xla", "pallas")

#: Environment knob that forces an implementation for every call that does not name one
#: (``KVJAX_ATTENTION=pallas`` runs the kernel in the interpreter on CPU; ``=xla`` turns the GPU
#: kernel off).
ENV_IMPLEMENTATION = "KVJAX_ATTENTION"

_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def _attention_pallas(q, k_all, v_all, mask, scale, index, n_kv, return_lse, softcap, sinks=None, v_cols=None):
    """The Pallas path: rows ``(t, g)`` per kv head (a block of rows is a block of tokens).

    A latent cache (``v_cols``) gives the kernel K as V with a block of its first ``v_cols``
    columns, so V is read from K's buffer, never copied out of it.
    """
    n_heads = k_all.shape[1]
    t, hq, d = q.shape
    g = hq // n_heads
    qr = q.astype(jnp.float32).reshape(t, n_heads, g, d).transpose(1, 0, 2, 3).reshape(n_heads, t * g, d)
    add = jnp.where(mask, 0.0, _NEG_INF) if mask.dtype == jnp.bool_ else mask
    # a backend without a Pallas compiler for this kernel (CPU) runs it in the interpreter
    interpret = jax.default_backend() not in _GPU_BACKENDS
    out, lse = _pallas.attend(
        qr * scale,
        k_all,
        k_all if v_cols is not None else v_all,
        add.astype(jnp.float32),
        index=index,
        n_kv=n_kv,
        interpret=interpret,
        softcap=softcap,
        v_cols=v_cols,
    )
    dv = out.shape[-1]
    out = out.reshape(n_heads, t, g, dv).transpose(1, 0, 2, 3).reshape(t, hq, dv)
    out, lse = apply_sinks(out, lse.reshape(n_heads, t, g).transpose(1, 0, 2).reshape(t, hq), sinks)
    return (out.astype(q.dtype), lse) if return_lse else out.astype(q.dtype)


def pick_implementation(implementation: Optional[str], cache, layer: int, bias) -> str:
    """The implementation a call runs: the one named, else :data:`ENV_IMPLEMENTATION`, else by backend.

    By backend: ``"pallas"`` on a GPU when the layer's K/V are float (not quantized) and there is
    no ``bias``; ``"xla"`` otherwise (on CPU the XLA formulation is the measured fastest, see
    ``docs/speed.md``).

    Raises:
        ValueError: an unknown name, or ``"pallas"`` named for a call it does not support.

    Example:
        >>> import kvjax
        >>> cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
        >>> pick_implementation(None, cache, 0, None), pick_implementation("pallas", cache, 0, None)
        ('xla', 'pallas')
    """
    named = implementation if implementation is not None else os.environ.get(ENV_IMPLEMENTATION) or None
    if named is not None and named not in IMPLEMENTATIONS:
        source = "implementation" if implementation is not None else ENV_IMPLEMENTATION
        raise ValueError(
            f"{source}={named!r} is not an attention implementation: allowed "
            f"{', '.join(map(repr, IMPLEMENTATIONS))} (or None: by backend)"
        )
    cfg = cache.config
    quantized = _quant.is_quantized(cfg.k_dtype) or _quant.is_quantized(cfg.v_dtype)
    reason = "quantized K/V" if quantized else "a bias" if bias is not None else None
    if named is None:
        return "pallas" if reason is None and jax.default_backend() in _GPU_BACKENDS else "xla"
    if named == "pallas" and reason is not None:
        raise ValueError(
            f"implementation='pallas' does not support {reason}: allowed implementation='xla' (or None, which picks it)"
        )
    return named
