"""Model step benchmark: the kvjax reference model against Flax's built-in decode cache.

Both models have the same dimensions (4 layers, width 256, 8 heads of 32, 8 kv heads, SwiGLU
MLP of 688, vocabulary 512, float32) and the same weights layout; the Flax peer is built from
``nnx.MultiHeadAttention`` with ``decode=True`` (its cache is ``[B, 1024, H, D]`` per layer and
every step attends over all 1024 slots). The kvjax model (:class:`kvjax.nn.Llama`) uses one
unified cache of ``B * 1024`` cells and attends over the window ``n_kv`` of the used cells only.
The kvjax model also applies RoPE (Flax's attention has no hook for it), so it does a little
more work per token.

Measured, all in one run:

- **decode**: greedy generation of 256 tokens after a 32-token prompt per sequence, at batch 1
  and batch 8 (8 sequences in one kvjax cache). Both sides run their decode loop the same way,
  in two ways: a jitted step per token called from Python (the logits read back and the greedy
  token picked on the host, as a streaming loop does; kvjax also reads its window bound,
  :func:`kvjax.nn.window_for`), and one jitted ``lax.fori_loop`` over the tokens with the greedy
  choice on the device (kvjax: one loop per window bucket, planned on the host).
- **prefill** of a 512-token prompt: kvjax runs it as one ubatch; Flax's decode cache takes one
  token per call, so its prefill is a loop of 512 single-token steps. A plain uncached causal
  forward of the 512 tokens (``decode=False``, fills no cache) is listed as the compute floor.
- **the batch-8 cost of one unified cache**: every token attends over every sequence's cells
  (masked), so at batch 8 the window is 8x what one sequence needs. The table lists the window
  read per step and the same decode with one kvjax cache per sequence (``jax.vmap`` of the
  batch-1 step over 8 caches, the "one stream per sequence" remedy of newer llama.cpp).

Compile time is excluded from the rates (every program is warmed up on the same shapes first)
and listed on its own for one decode step of each side.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import compile_time, fmt_time, table
from kvjax.memory._cells import cell_max
from kvjax.nn import Llama, LlamaConfig, UbatchInputs, make_step, window_for
from kvjax.memory._ubatch import Ubatch


@dataclasses.dataclass(frozen=True)
class Dims:
    """Model and run sizes (the full run uses the issue's; quick mode a 1-layer, smaller run)."""

    n_layer: int = 4
    width: int = 256
    n_head: int = 8
    vocab: int = 512
    d_ff: int = 688
    length: int = 1024  # cache positions per sequence
    prompt: int = 32
    n_gen: int = 256
    prefill: int = 512
    repeats: int = 3


FULL = Dims()
QUICK = Dims(n_layer=1, width=64, n_head=4, vocab=128, d_ff=176, length=128, prompt=8, n_gen=24, prefill=64, repeats=1)


# -- the Flax peer --------------------------------------------------------------------------------


class _FlaxBlock(nnx.Module):
    def __init__(self, d: Dims, rngs):
        self.attn_norm = nnx.RMSNorm(d.width, epsilon=1e-5, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=d.n_head, in_features=d.width, qkv_features=d.width, use_bias=False, decode=False, rngs=rngs
        )
        self.mlp_norm = nnx.RMSNorm(d.width, epsilon=1e-5, rngs=rngs)
        self.gate = nnx.Linear(d.width, d.d_ff, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d.width, d.d_ff, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(d.d_ff, d.width, use_bias=False, rngs=rngs)

    def __call__(self, x, decode, mask=None):
        x = x + self.attn(self.attn_norm(x), mask=mask, decode=decode)
        h = self.mlp_norm(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class FlaxPeer(nnx.Module):
    """The same decoder with ``nnx.MultiHeadAttention`` and Flax's own decode cache."""

    def __init__(self, d: Dims, rngs):
        self.width = d.width
        self.embed = nnx.Embed(d.vocab, d.width, rngs=rngs)
        self.layers = nnx.List([_FlaxBlock(d, rngs) for _ in range(d.n_layer)])
        self.norm = nnx.RMSNorm(d.width, epsilon=1e-5, rngs=rngs)
        self.lm_head = nnx.Linear(d.width, d.vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens, decode=True):
        x = self.embed(tokens)
        mask = None if decode else nnx.make_causal_mask(tokens)
        for block in self.layers:
            x = block(x, decode, mask)
        return self.lm_head(self.norm(x))

    def init_cache(self, batch, length):
        for block in self.layers:
            block.attn.init_cache((batch, length, self.width), dtype=jnp.float32)


def _flax_fns(peer: FlaxPeer):
    """(params, cache, step, loop, forward) of the peer with its decode cache initialized."""
    graphdef, params, cache = nnx.split(peer, nnx.Param, nnx.Cache)

    def logits_of(params, cache, tok):
        model = nnx.merge(graphdef, params, cache)
        return model(tok[:, None])[:, 0], nnx.state(model, nnx.Cache)

    step = jax.jit(logits_of, donate_argnums=1)

    @functools.partial(jax.jit, static_argnames="n", donate_argnums=1)
    def loop(params, cache, tok, n):
        def body(i, carry):
            cache, tok, out = carry
            logits, cache = logits_of(params, cache, tok)
            tok = jnp.argmax(logits, -1).astype(jnp.int32)
            return cache, tok, out.at[i].set(tok)

        out = jnp.zeros((n, tok.shape[0]), jnp.int32)
        cache, tok, out = jax.lax.fori_loop(0, n, body, (cache, tok, out))
        return cache, tok, out

    @jax.jit
    def forward(params, tokens):
        return nnx.merge(graphdef, params, cache)(tokens, decode=False)

    return params, cache, step, loop, forward


# -- kvjax side -------------------------------------------------------------------------------------


def _kv_config(d: Dims) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=d.vocab, d_model=d.width, n_layer=d.n_layer, n_heads=d.n_head, n_kv_heads=d.n_head, d_ff=d.d_ff
    )


def _decode_ubatch(pos, batch):
    """A device-built ubatch of one token per sequence 0..B-1, all at position ``pos``."""
    return Ubatch(
        pos=jnp.broadcast_to(pos, (batch,)).astype(jnp.int32),
        seq_ids=jnp.arange(batch, dtype=jnp.int32)[:, None],
        valid=jnp.ones((batch,), bool),
    )


def _kv_loop_fn(graphdef):
    """A jitted loop of greedy decode steps ``[start, stop)`` at one static window.

    The sequences decode together: in one unified cache (the ubatch holds one token of each)
    or, with ``per_seq=True``, one single-sequence cache each (``jax.vmap`` of the 1-token step).
    """

    def one(state, cache, tok, pos, n_kv):
        ub = _decode_ubatch(pos, tok.shape[0])
        cache, slot, _ = kvjax.find_slot(cache, ub)
        logits, cache = nnx.merge(graphdef, state)(tok, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(n_kv,)))
        return jnp.argmax(logits, -1).astype(jnp.int32), cache

    def loop(state, cache, tok, pos, start, stop, out, *, n_kv, per_seq):
        step = one
        if per_seq:  # tok [S, 1], cache leaves [S, ...]
            step = jax.vmap(lambda st, c, t, p, n: one(st, c, t, p, n), in_axes=(None, 0, 0, None, None))

        def body(i, carry):
            cache, tok, out = carry
            tok, cache = step(state, cache, tok, pos + i, n_kv)
            return cache, tok, out.at[i].set(tok.reshape(-1))

        cache, tok, out = jax.lax.fori_loop(start, stop, body, (cache, tok, out))
        return cache, tok, out

    return jax.jit(loop, static_argnames=("n_kv", "per_seq"), donate_argnames=("cache", "out"))


def _prefilled(step, state, cfg: LlamaConfig, d: Dims, n_seq: int, size: int):
    """A kvjax cache with ``n_seq`` sequences of ``d.prompt`` tokens (one ubatch per sequence)."""
    cache = kvjax.init(cfg.cache_config(size=size, n_seq_max=n_seq))
    rng = np.random.default_rng(0)
    for s in range(n_seq):
        toks = rng.integers(d.vocab, size=d.prompt).astype(np.int32)
        ub = kvjax.make_ubatch(range(d.prompt), [[s]] * d.prompt)
        _, cache, ok = step(state, cache, ub, np.pad(toks, (0, ub.length - d.prompt)), n_kv=window_for(cache, d.prompt))
        assert bool(ok)
    return cache


def _kv_decode_python(step, state, cache, tok, d: Dims):
    """A jitted step per token; logits to the host, greedy token chosen there (a streaming loop)."""
    batch = tok.shape[0]
    seq = [[s] for s in range(batch)]
    out = []
    for i in range(d.n_gen):
        ub = kvjax.make_ubatch([d.prompt + i] * batch, seq)
        logits, cache, ok = step(state, cache, ub, tok, n_kv=window_for(cache, batch))
        tok = np.argmax(np.asarray(logits), -1).astype(np.int32)
        out.append(tok)
    return np.stack(out)


def _flax_decode_python(step, params, cache, tok, d: Dims):
    out = []
    for _ in range(d.n_gen):
        logits, cache = step(params, cache, tok)
        tok = np.argmax(np.asarray(logits), -1).astype(np.int32)
        out.append(tok)
    return np.stack(out)


def _segments(start_cell: int, per_step: int, n_gen: int, size: int, padding: int):
    """Host plan of a jitted decode: ``(first, stop, window)`` runs of steps sharing one window.

    Decode appends ``per_step`` cells per step after ``start_cell`` (a fresh cache filled in order,
    as in this benchmark); a run ends where its window bucket would no longer cover the cells.
    """
    plan, i = [], 0
    while i < n_gen:
        n_kv = kvjax.window_bucket(min(size, start_cell + (i + 1) * per_step), size, padding)
        stop = min(n_gen, max(i + 1, (n_kv - start_cell) // per_step))
        plan.append((i, stop, n_kv))
        i = stop
    return plan


def _kv_decode_loop(loop, state, cache, tok, d: Dims, per_seq: bool = False):
    """One jitted loop per window bucket (the buckets planned on the host, see ``_segments``)."""
    n_seq = tok.shape[0]
    cfg = cache.config
    start = int(jax.device_get(cell_max(cache.cells if not per_seq else jax.tree.map(lambda x: x[0], cache.cells))))
    per_step = 1 if per_seq else n_seq
    out = jnp.zeros((d.n_gen, n_seq), jnp.int32)
    tok = jnp.asarray(tok)[:, None] if per_seq else jnp.asarray(tok)
    for first, stop, n_kv in _segments(start, per_step, d.n_gen, cfg.size, cfg.padding):
        cache, tok, out = loop(state, cache, tok, jnp.int32(d.prompt), first, stop, out, n_kv=n_kv, per_seq=per_seq)
    return out


def _timed(setup, run, repeats):
    """Median seconds of ``run(*setup())``; setup is not timed and the first call warms up."""
    samples = []
    for r in range(repeats + 1):
        args = setup()
        jax.block_until_ready(args)
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        if r:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def run(quick: bool) -> str:
    d = QUICK if quick else FULL
    cfg = _kv_config(d)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    kv_step = make_step(model)
    kv_loop = _kv_loop_fn(graphdef)
    peer = FlaxPeer(d, nnx.Rngs(0))

    # compile time of one B=1 decode step of each side, first thing (nothing compiled before)
    one_cfg = cfg.cache_config(size=d.length, n_seq_max=1)
    cache1 = kvjax.init(one_cfg)
    buffers1, rest1 = cache1.split()
    c_kv = compile_time(
        kv_step._jitted,
        state,
        rest1,
        buffers1,
        kvjax.make_ubatch([0], [[0]]),
        np.zeros(1, np.int32),
        None,
        None,  # outputs: every row (the step's default)
        windows=(one_cfg.padding,),
    )
    peer.init_cache(1, d.length)
    params, fcache, f_step, _, _ = _flax_fns(peer)
    c_fx = compile_time(f_step, params, fcache, np.zeros(1, np.int32))

    rows, window_rows = [], []
    for batch in (1, 8):
        base = _prefilled(kv_step, state, cfg, d, batch, batch * d.length)
        tok0 = np.arange(batch, dtype=np.int32) % d.vocab
        peer.init_cache(batch, d.length)
        params, fcache, f_step, f_loop, _ = _flax_fns(peer)
        prompt_toks = np.random.default_rng(0).integers(d.vocab, size=(d.prompt, batch)).astype(np.int32)
        for t in range(d.prompt):  # Flax's cache takes the prompt one token per call (not timed)
            _, fcache = f_step(params, fcache, prompt_toks[t])
        t = {
            "kv_py": _timed(
                lambda: (_copy(base), tok0), lambda c, x: _kv_decode_python(kv_step, state, c, x, d), d.repeats
            ),
            "fx_py": _timed(
                lambda: (_copy(fcache), tok0), lambda c, x: _flax_decode_python(f_step, params, c, x, d), d.repeats
            ),
            "kv_loop": _timed(
                lambda: (_copy(base), tok0), lambda c, x: _kv_decode_loop(kv_loop, state, c, x, d), d.repeats
            ),
            "fx_loop": _timed(
                lambda: (_copy(fcache), jnp.asarray(tok0)), lambda c, x: f_loop(params, c, x, d.n_gen), d.repeats
            ),
        }
        tokens = batch * d.n_gen
        for mode, kv, fx in (
            ("jitted step per token, Python loop", "kv_py", "fx_py"),
            ("one jitted loop over the tokens", "kv_loop", "fx_loop"),
        ):
            rows.append(
                [
                    f"decode B={batch}",
                    mode,
                    f"{tokens / t[kv]:.0f}",
                    f"{tokens / t[fx]:.0f}",
                    f"**{t[fx] / t[kv]:.2f}**",
                ]
            )
        plan = _segments(batch * d.prompt, batch, d.n_gen, batch * d.length, base.config.padding)
        mean_window = sum((b - a) * w for a, b, w in plan) / d.n_gen
        window_rows.append(
            [
                f"B={batch} unified",
                f"{batch * (d.prompt + d.n_gen / 2):.0f}",
                f"{mean_window:.0f}",
                f"{d.length}",
                f"{tokens / t['kv_loop']:.0f}",
                "",
            ]
        )
        if batch > 1:
            # the remedy: one single-sequence cache per sequence (newer llama.cpp: one stream each)
            one_cfg = cfg.cache_config(size=d.length, n_seq_max=1)
            single = _prefilled(kv_step, state, cfg, d, 1, d.length)
            stacked = jax.tree.map(lambda x: jnp.stack([x] * batch), single)
            t_ps = _timed(
                lambda: (_copy(stacked), tok0),
                lambda c, x: _kv_decode_loop(kv_loop, state, c, x, d, per_seq=True),
                d.repeats,
            )
            plan = _segments(d.prompt, 1, d.n_gen, d.length, one_cfg.padding)
            mean_ps = sum((b - a) * w for a, b, w in plan) / d.n_gen
            window_rows.append(
                [
                    f"B={batch}, one cache per sequence (vmap)",
                    f"{d.prompt + d.n_gen / 2:.0f}",
                    f"{mean_ps:.0f}",
                    f"{d.length}",
                    f"{tokens / t_ps:.0f}",
                    f"{t['kv_loop'] / t_ps:.2f}x the unified cache",
                ]
            )

    # prefill of one prompt
    ptoks = np.random.default_rng(1).integers(d.vocab, size=d.prefill).astype(np.int32)
    ub = kvjax.make_ubatch(range(d.prefill), [[0]] * d.prefill)
    n_kv = window_for(kvjax.init(one_cfg), d.prefill)
    t_kv = _timed(lambda: (kvjax.init(one_cfg),), lambda c: kv_step(state, c, ub, ptoks, n_kv=n_kv)[0], d.repeats)
    peer.init_cache(1, d.length)
    params, fcache, f_step, f_loop, f_forward = _flax_fns(peer)
    # Flax's decode cache takes one token per call: its prefill is a loop of single-token steps
    # (feeding the prompt's tokens instead of the sampled ones is the same work)
    t_fx = _timed(
        lambda: (_copy(fcache), jnp.asarray(ptoks[:1])), lambda c, x: f_loop(params, c, x, d.prefill), d.repeats
    )
    t_fwd = _timed(lambda: (jnp.asarray(ptoks[None]),), lambda x: f_forward(params, x), d.repeats)
    rows.append(
        [
            f"prefill {d.prefill} tokens",
            "kvjax: one ubatch; Flax: its decode cache, token by token",
            f"{d.prefill / t_kv:.0f}",
            f"{d.prefill / t_fx:.0f}",
            f"**{t_fx / t_kv:.2f}**",
        ]
    )
    rows.append(
        [
            f"prefill {d.prefill} tokens",
            "kvjax: one ubatch; Flax: uncached causal forward (fills no cache)",
            f"{d.prefill / t_kv:.0f}",
            f"{d.prefill / t_fwd:.0f}",
            f"{t_fwd / t_kv:.2f}",
        ]
    )

    return "\n".join(
        [
            "## Model step: kvjax reference model vs Flax's decode cache",
            "",
            f"{d.n_layer} layers, width {d.width}, {d.n_head} heads ({d.n_head} kv heads), vocabulary {d.vocab}, "
            f"float32. Flax: `nnx.MultiHeadAttention` decode cache of {d.length} positions per sequence "
            f"(`[B, {d.length}, H, D]`, every step attends over all of it). kvjax: `kvjax.nn.Llama` (with RoPE, "
            f"which the Flax peer lacks) over one unified cache of B x {d.length} cells, attending over the "
            f"window of used cells. Decode: {d.n_gen} greedy tokens per sequence after a {d.prompt}-token "
            f"prompt. Tokens per second, all sequences together; ratio = kvjax / Flax (> 1: kvjax faster). "
            f"Median of {d.repeats} after a warm-up; compile time excluded.",
            "",
            table(["case", "loop (the same on both sides)", "kvjax tok/s", "Flax tok/s", "ratio"], rows),
            "",
            "The cost of one unified cache at batch 8: each token attends over every sequence's cells "
            "(masked), so the window is B times what one sequence needs. With one cache per sequence "
            "(here `jax.vmap` of the one-sequence step over 8 caches; newer llama.cpp keeps one stream "
            "per sequence) each token reads only its own cells:",
            "",
            table(
                [
                    "layout",
                    "mean cells a token needs",
                    "mean window read (cells)",
                    "Flax reads (cells)",
                    "kvjax tok/s (jitted loop)",
                    "vs unified",
                ],
                window_rows,
            ),
            "",
            f"Compile time of one B=1 decode step: kvjax {fmt_time(c_kv)} (per window bucket), Flax {fmt_time(c_fx)}.",
            "",
        ]
    )
