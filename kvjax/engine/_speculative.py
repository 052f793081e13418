"""Speculative decoding: a draft model proposes, the target checks in one batch, the rest is rolled back.

Per round and per sequence: the draft model proposes ``k`` tokens one at a time; the target model
evaluates the sequence's pending token and the ``k`` drafts in one batch (one ubatch for short
drafts), giving its distributions ``p_0 .. p_k``; the longest acceptable prefix of the drafts is
kept, one more token is drawn from the target, and every position after it is removed from both
models' memories with ``seq_rm`` (exact for every memory: a unified or iSWA cache frees the cells,
a recurrent state rolls back to a kept state, a hybrid does both).

Acceptance (the standard rule of Leviathan et al. and Chen et al., 2023): with greedy sampling a
draft is kept while it equals the target's argmax, and the extra token is the target's argmax, so
the output is exactly the target's greedy output. With sampling, draft ``d_i ~ q_i`` is kept with
probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection the extra token is drawn from
``max(0, p_i - q_i)`` renormalised, after ``k`` acceptances from ``p_k``: the tokens are
distributed as the target's own samples. ``p`` and ``q`` are the distributions the sampling
config defines (temperature, top-k, top-p applied).

Example:
    >>> import jax, kvjax
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> big, small = LlamaConfig(vocab_size=32, d_model=32, n_layer=2), LlamaConfig(vocab_size=32, d_model=16, n_layer=1)
    >>> target = kvjax.Engine(Llama(big, rngs=nnx.Rngs(0)), kvjax.init(big.cache_config(size=64, n_seq_max=2)))
    >>> draft = kvjax.Engine(Llama(small, rngs=nnx.Rngs(1)), kvjax.init(small.cache_config(size=64, n_seq_max=2)))
    >>> out = kvjax.generate(target, [[1, 2, 3]], max_new_tokens=8, key=jax.random.PRNGKey(0),
    ...                      sampling=kvjax.SamplingConfig(temperature=0), draft=draft, n_draft=3)
    >>> len(out.tokens[0]), 0 <= out.accepted <= out.drafted
    (8, True)
"""

from __future__ import annotations

import functools
from typing import Iterator, List, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from kvjax._typing import Array, Float, Int
from kvjax.engine._sampling import SamplingConfig, filter_logits, sample

__all__ = ["accept_drafts", "speculative_stream", "check_draft_engines"]


@functools.partial(jax.jit, static_argnames="config")
def accept_drafts(
    target_logits: Float[Array, "B K1 V"],
    draft_logits: Float[Array, "B K V"],
    drafts: Int[Array, "B K"],
    key: jax.Array,
    config: SamplingConfig,
) -> Tuple[Int[Array, " B"], Int[Array, " B"]]:
    """The acceptance rule for ``B`` sequences of ``K`` drafts each.

    Args:
        target_logits: the target's logits at the pending token and at each draft (``K + 1`` rows).
        draft_logits: the draft model's logits each draft was drawn from.
        drafts: the drafted tokens.
        key: PRNG key (unused when greedy).
        config: the sampling rule of both models.

    Returns:
        ``(n_accepted i32[B], next_token i32[B])``: how many drafts are kept, and the token that
        follows them (drawn from the target).
    """
    K = drafts.shape[1]
    if config.greedy:
        best = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K + 1]
        match = best[:, :K] == drafts
        n = jnp.sum(jnp.cumprod(match, axis=1), axis=1).astype(jnp.int32)
        return n, jnp.take_along_axis(best, n[:, None], axis=1)[:, 0]
    p = jax.nn.softmax(filter_logits(target_logits.reshape(-1, target_logits.shape[-1]), config), axis=-1)
    q = jax.nn.softmax(filter_logits(draft_logits.reshape(-1, draft_logits.shape[-1]), config), axis=-1)
    p = p.reshape(target_logits.shape)
    q = q.reshape(draft_logits.shape)
    k_accept, k_next = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :K], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(k_accept, drafts.shape)
    keep = u * q_d < p_d  # u < p / q, without dividing
    n = jnp.sum(jnp.cumprod(keep, axis=1), axis=1).astype(jnp.int32)
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    q_n = jnp.take_along_axis(jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1), n[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    nxt = jax.random.categorical(k_next, jnp.log(residual), axis=-1).astype(jnp.int32)
    return n, nxt


def _last_rows(counts: Sequence[int], rows_each: int) -> np.ndarray:
    """The batch rows of the last ``rows_each`` rows of each sequence's block (blocks of ``counts`` rows, in order).

    The engines compute logits for these rows only (``Engine.decode(..., outputs=rows)``).
    """
    ends = np.cumsum(counts)
    return np.concatenate([np.arange(e - rows_each, e) for e in ends])


def speculative_stream(
    target,
    draft,
    prompts: List[List[int]],
    *,
    max_new_tokens: int,
    key: jax.Array,
    sampling: SamplingConfig,
    n_draft: int,
    stop: set,
    stats: dict,
) -> Iterator[Tuple[int, int]]:
    """The speculative loop behind :func:`kvjax.generate` with ``draft=`` (arguments checked there).

    Sequence ``s`` of both engines holds prompt ``s``; every position after the kept tokens is
    removed from both memories after each round.
    """
    n_seq = len(prompts)
    ids = [[s] for s in range(n_seq)]
    toks = [t for p in prompts for t in p]
    pos = [i for p in prompts for i in range(len(p))]
    rows = [[s] for s, p in enumerate(prompts) for _ in p]
    last = np.cumsum([len(p) for p in prompts]) - 1
    logits = target.decode(toks, pos, rows, outputs=last)
    draft.decode(toks, pos, rows, outputs=[])  # the draft only needs the prompts' cells
    key, sub = jax.random.split(key)
    first = np.asarray(sample(logits, sub, sampling)).tolist()
    history = [list(p) + [t] for p, t in zip(prompts, first)]  # every token, the last one not yet fed
    fed_target = [len(p) for p in prompts]  # positions each memory holds
    fed_draft = list(fed_target)
    counts = [0] * n_seq
    active = []
    for s, t in enumerate(first):
        counts[s] += 1
        yield s, t
        if t not in stop and counts[s] < max_new_tokens:
            active.append(s)
    drafted = accepted = 0
    while active:
        # 1. the draft proposes n_draft tokens per active sequence
        pending = [history[s][fed_draft[s] :] for s in active]
        d_toks, d_pos, d_ids = [], [], []
        for s, part in zip(active, pending):
            d_toks += part
            d_pos += range(fed_draft[s], fed_draft[s] + len(part))
            d_ids += [ids[s]] * len(part)
        q_rows = [draft.decode(d_toks, d_pos, d_ids, outputs=_last_rows([len(p) for p in pending], 1))]
        proposals = []
        for j in range(n_draft):
            key, sub = jax.random.split(key)
            proposals.append(np.asarray(sample(q_rows[-1], sub, sampling)))
            if j + 1 < n_draft:
                q_rows.append(
                    draft.decode(
                        proposals[-1].tolist(), [len(history[s]) + j for s in active], [ids[s] for s in active]
                    )
                )
        for s in active:
            fed_draft[s] = len(history[s]) + n_draft - 1
        drafts = np.stack(proposals, axis=1)  # [B, k]
        q_all = jnp.stack(q_rows, axis=1)  # [B, k, V]
        # 2. the target checks the pending tokens and the drafts in one batch
        t_parts = [history[s][fed_target[s] :] + drafts[i].tolist() for i, s in enumerate(active)]
        t_toks, t_pos, t_ids = [], [], []
        for s, part in zip(active, t_parts):
            t_toks += part
            t_pos += range(fed_target[s], fed_target[s] + len(part))
            t_ids += [ids[s]] * len(part)
        checked = _last_rows([len(p) for p in t_parts], n_draft + 1)
        p_all = target.decode(t_toks, t_pos, t_ids, outputs=checked)
        p_all = p_all.reshape(len(t_parts), n_draft + 1, -1)
        for s in active:
            fed_target[s] = len(history[s]) + n_draft
        key, sub = jax.random.split(key)
        n_ok, nxt = jax.device_get(accept_drafts(p_all, q_all, jnp.asarray(drafts), sub, sampling))
        # 3. keep the accepted drafts and the target's token; roll both memories back to them
        still = []
        for i, s in enumerate(active):
            n = int(n_ok[i])
            drafted += n_draft
            accepted += n
            kept_pos = len(history[s]) + n  # positions < kept_pos stay in the memories
            for memory_engine, fed in ((target, fed_target), (draft, fed_draft)):
                if fed[s] > kept_pos:
                    memory_engine.rollback(s, kept_pos)
                    fed[s] = kept_pos
            new = drafts[i, :n].tolist() + [int(nxt[i])]
            done = False
            for t in new:
                history[s].append(t)
                counts[s] += 1
                yield s, t
                if t in stop or counts[s] >= max_new_tokens:
                    done = True
                    break
            if not done:
                still.append(s)
        active = still
    stats["drafted"] = drafted
    stats["accepted"] = accepted


def check_draft_engines(target, draft, n_draft: int) -> None:
    """Refuse a draft engine that cannot serve ``target`` with ``n_draft`` tokens a round (any caller:
    generate, the serving scheduler), before anything changes."""
    if not isinstance(draft, type(target)):  # target is the kvjax.Engine that was asked to generate
        raise ValueError(f"draft must be a kvjax.Engine (the draft model and its memory), got {type(draft).__name__}")
    if draft is target or draft.cache is target.cache:
        raise ValueError("draft must be another Engine than the target, with a memory of its own")
    if isinstance(n_draft, bool) or not isinstance(n_draft, (int, np.integer)) or not 1 <= n_draft <= 64:
        raise ValueError(f"n_draft={n_draft!r} is out of range: allowed an integer in [1, 64]")
    if draft.vocab_size is not None and target.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft has vocab_size={draft.vocab_size}: allowed the target's {target.vocab_size}")
    for name, engine, depth in (("target", target, n_draft), ("draft", draft, n_draft - 1)):
        have = engine.cache.rollback_depth
        if have is not None and have < depth:
            raise ValueError(
                f"{name} memory can roll back {have} positions: allowed n_draft={n_draft} needs "
                f"{depth} (a recurrent part needs n_states >= {depth + 1}; an iSWA pair needs "
                f"swa_full=True, since a pruned window cache cannot go back)"
            )


def check_draft(target, draft, n_draft: int, n_seq: int, longest: int, max_new_tokens: int) -> None:
    """Refuse a speculative request that cannot run, before anything changes (see generate)."""
    check_draft_engines(target, draft, n_draft)
    for name, engine in (("target", target), ("draft", draft)):
        if n_seq > engine.cache.n_seq_max:
            raise ValueError(
                f"{n_seq} sequences are out of range for the {name}: allowed n_seq_max={engine.cache.n_seq_max}"
            )
        limit = engine.cache.max_context
        need = longest + max_new_tokens + n_draft
        each = None if limit is None else engine.cache.context_per_sequence(n_seq)
        if each is not None and need > each:
            raise ValueError(
                f"max_new_tokens={max_new_tokens} is out of range for the {name}: speculative decoding "
                f"does not shift the context, and {n_seq} sequences of up to {need} positions do not "
                f"fit in size // n_seq = {each} cells each"
            )
        busy = [s for s in range(n_seq) if int(kvjax.seq_pos_max(engine.cache, s)) >= 0]
        if busy:
            raise ValueError(f"sequences {busy} already hold cells in the {name}: free them with kvjax.seq_rm")
