"""The maths of a Mamba mixer's state: the recurrent memory's state gather and the selective scan.

:func:`select_states` gathers each slot's conv and SSM states from the recurrent memory's rows
(``s_copy``, zeroed by ``s_mask``), as llama.cpp's graph does before a recurrent layer runs;
:func:`selective_scan` runs ``h_t = exp(dt A) h_{t-1} + dt B x_t``, ``y_t = C h_t`` over a ubatch,
sequentially or chunked (an associative scan per block: :data:`SCANS`), and
:func:`selective_scan_keep` also returns the states after each of the last ``keep`` tokens (the
states a rollback returns to). Functions of arrays only; :mod:`kvjax.nn._mamba` is the model.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int


# -- the state gather of the recurrent memory ------------------------------------------------


def select_states(states_all, s_copy: Int[Array, " n"], s_mask):
    """Gather per-cell states by ``s_copy`` and zero them by ``s_mask`` (the seed's ``build_copy_mask_state``).

    For the ubatch's window of n cells starting at ``head``, llama.cpp's recurrent memory gives
    ``s_copy[i]``, the cell whose state cell ``head + i`` starts from (a ``seq_cp`` makes several
    cells read one source), and ``s_mask[i]``, 0 for a cell whose sequence starts over (cleared by
    ``seq_rm`` or new). The first S rows of the result are the states the ubatch's S sequences
    start from (pass them to :meth:`Mamba.step`); the memory writes rows ``S..n`` back unchanged,
    as the seed does.

    Unlike the seed's ``ggml_mul`` by the mask, zeroing is a select, so a NaN in a cleared cell
    does not survive into the new sequence (a FIXME in llama.cpp's graph code).

    Args:
        states_all: an array or pytree of arrays ``[L, C, ...]`` (layer axis, then cell axis), e.g.
            ``(conv_all [L, C, K-1, Di], ssm_all [L, C, Di, N])``.
        s_copy: ``i32[n]`` source cell of each row, in ``[0, C)`` (traced values out of range
            are clipped).
        s_mask: ``[n]`` bool or float: zero (False) clears the row.

    Returns:
        The same pytree with leaves ``[L, n, ...]``.

    Raises:
        ValueError: ``s_copy`` / ``s_mask`` not 1-d of equal length, ``s_copy`` not integer or a
            concrete id out of range, or leaves that disagree on the cell count.

    Example:
        >>> import jax.numpy as jnp
        >>> conv_all = jnp.arange(6.).reshape(1, 3, 2)        # L=1, C=3 cells of 2 floats
        >>> select_states(conv_all, jnp.array([2, 2, 0]), jnp.array([1., 1., 0.]))[0].tolist()
        [[4.0, 5.0], [4.0, 5.0], [0.0, 0.0]]
    """
    leaves = jax.tree_util.tree_leaves(states_all)
    if not leaves:
        raise ValueError("states_all has no arrays: allowed an array or pytree of arrays [L, C, ...]")
    shapes = [tuple(jnp.shape(x)) for x in leaves]
    if any(len(s) < 2 for s in shapes) or len({s[1] for s in shapes}) != 1:
        raise ValueError(f"states_all has leaves of shapes {shapes}: allowed arrays [L, C, ...] with one C")
    n_cells = shapes[0][1]
    if jnp.ndim(s_copy) != 1 or not jnp.issubdtype(jnp.result_type(s_copy), jnp.integer):
        raise ValueError(
            f"s_copy has shape {tuple(jnp.shape(s_copy))} and dtype {jnp.result_type(s_copy)}: "
            "allowed an integer [n] array"
        )
    if tuple(jnp.shape(s_mask)) != tuple(jnp.shape(s_copy)):
        raise ValueError(
            f"s_mask has shape {tuple(jnp.shape(s_mask))}: allowed the shape of s_copy {tuple(jnp.shape(s_copy))}"
        )
    if not isinstance(s_copy, jax.core.Tracer):
        ids = np.asarray(s_copy)
        if ids.size and (ids.min() < 0 or ids.max() >= n_cells):
            bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
            raise ValueError(f"s_copy contains {bad}: allowed cell ids in [0, {n_cells})")
    s_copy = jnp.asarray(s_copy, jnp.int32)
    keep = jnp.asarray(s_mask) != 0

    def pick(x):
        rows = jnp.take(x, s_copy, axis=1, mode="clip")
        return jnp.where(keep.reshape((1, -1) + (1,) * (rows.ndim - 2)), rows, jnp.zeros((), rows.dtype))

    return jax.tree_util.tree_map(pick, states_all)


# -- the selective scan ----------------------------------------------------------------------

#: the ways :func:`selective_scan` runs a ubatch of several tokens (``MambaConfig.scan``).
SCANS = ("auto", "sequential", "chunked")


def pick_scan(scan: str) -> str:
    """``scan`` with ``"auto"`` resolved by the default backend: ``"sequential"`` on CPU, else ``"chunked"``.

    Example:
        >>> pick_scan("chunked"), pick_scan("auto") in ("sequential", "chunked")
        ('chunked', True)
    """
    if scan != "auto":
        return scan
    return "sequential" if jax.default_backend() == "cpu" else "chunked"


def _recurrence(h, u_t, dt_t, b_t, c_t, A):
    """One token of the SSM: ``h [S, Di, N]``, ``u_t, dt_t [S, Di]``, ``b_t, c_t [S, N]`` ->
    ``(h', y [S, Di])`` with ``h' = exp(dt A) h + dt u B`` and ``y = h' C``."""
    h = jnp.exp(dt_t[..., None] * A) * h + (dt_t * u_t)[..., None] * b_t[:, None, :]
    return h, jnp.einsum("sdn,sn->sd", h, c_t)


def _sequential_scan(h0, u, dt, Bm, Cm, A):
    """One recurrence step per token (``lax.scan``): ``(y [S, T, Di], h_T [S, Di, N])``. On CPU the
    state stays in cache and no ``[S, T, Di, N]`` array is built (the chunked scan builds several
    ``[S, chunk, Di, N]`` ones per level of its tree)."""
    h, y = jax.lax.scan(lambda h, xs: _recurrence(h, *xs, A), h0, tuple(jnp.moveaxis(x, 1, 0) for x in (u, dt, Bm, Cm)))
    return jnp.moveaxis(y, 0, 1), h


def _combine(left, right):
    # (a1, b1) then (a2, b2): h -> a2 * (a1 * h + b1) + b2
    a1, b1 = left
    a2, b2 = right
    return a1 * a2, a2 * b1 + b2


def _scan_block(h0, u, dt, Bm, Cm, A):
    """One block of the scan: ``h0 [S, Di, N]``, ``u, dt [S, Q, Di]``, ``Bm, Cm [S, Q, N]``.

    Returns ``(y [S, Q, Di], h_last [S, Di, N])``.
    """
    dA = jnp.exp(dt[..., None] * A)  # [S, Q, Di, N]
    dBu = (dt * u)[..., None] * Bm[:, :, None, :]  # [S, Q, Di, N]
    # the initial state enters as part of the first element: h_0 = dA_0 h0 + dBu_0
    dBu = dBu.at[:, 0].add(dA[:, 0] * h0)
    _, h = jax.lax.associative_scan(_combine, (dA, dBu), axis=1)
    return jnp.einsum("sqdn,sqn->sqd", h, Cm), h[:, -1]


def selective_scan(h0, u, dt, Bm, Cm, A, *, chunk: int, scan: str = "auto"):
    """The SSM over T tokens from state ``h0``: ``(y [S, T, Di], h_T [S, Di, N])`` (float32).

    T = 1 (decode) is the single recurrence step. Longer inputs run as ``scan`` says
    (:func:`pick_scan`): ``"sequential"``, a ``lax.scan`` of that step; ``"chunked"``,
    ``jax.lax.associative_scan`` (depth log T) within chunks of ``chunk`` tokens and a sequential
    ``lax.scan`` over chunks that carries the state: a whole-sequence associative scan would hold
    several ``[S, T, Di, N]`` float32 buffers at once (for Mamba-130m, Di=1536 and N=16, that is
    200 MB per sequence and buffer at T=2048), the chunked one several ``[S, chunk, Di, N]``.
    """
    S, T, _ = u.shape
    if T == 1:
        h, y = _recurrence(h0, u[:, 0], dt[:, 0], Bm[:, 0], Cm[:, 0], A)
        return y[:, None], h
    if pick_scan(scan) == "sequential":
        return _sequential_scan(h0, u, dt, Bm, Cm, A)
    if T <= chunk:
        return _scan_block(h0, u, dt, Bm, Cm, A)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T

    def blocks(x):
        # padding with dt = 0 gives dA = 1 and dBu = 0: the state passes through unchanged
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape((S, n_chunks, chunk) + x.shape[2:]), 1, 0)

    def body(h, xs):
        y, h = _scan_block(h, *xs, A)
        return h, y

    h, ys = jax.lax.scan(body, h0, tuple(blocks(x) for x in (u, dt, Bm, Cm)))
    y = jnp.moveaxis(ys, 0, 1).reshape(S, n_chunks * chunk, -1)[:, :T]
    return y, h


def selective_scan_keep(h0, u, dt, Bm, Cm, A, *, chunk: int, keep: int, scan: str = "auto"):
    """:func:`selective_scan` that also returns the states after each of the last ``keep`` tokens.

    Returns ``(y [S, T, Di], hs [S, keep, Di, N])``, oldest first. The first ``T - keep`` tokens
    run the scan; the last ``keep`` run one recurrence step each (``keep`` is small: the rollback
    depth of the recurrent memory), so no ``[S, T, Di, N]`` buffer is kept.
    """
    T = u.shape[1]
    if keep == 1:
        y, h = selective_scan(h0, u, dt, Bm, Cm, A, chunk=chunk, scan=scan)
        return y, h[:, None]
    head = T - keep
    ys = []
    h = h0
    if head:
        y0, h = selective_scan(h0, u[:, :head], dt[:, :head], Bm[:, :head], Cm[:, :head], A, chunk=chunk, scan=scan)
        ys.append(y0)

    def one(h, xs):
        h, y = _recurrence(h, *xs, A)
        return h, (y, h)

    tail = tuple(jnp.moveaxis(x[:, head:], 1, 0) for x in (u, dt, Bm, Cm))
    _, (y1, hs) = jax.lax.scan(one, h, tail)
    ys.append(jnp.moveaxis(y1, 0, 1))
    return jnp.concatenate(ys, axis=1), jnp.moveaxis(hs, 0, 1)
