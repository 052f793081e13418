"""Speculative decoding: tokens/s against plain decoding, the acceptance rate, and what a rollback costs.

- Unified memory: the demo's character model (4 layers, width 128, trained on the bundled corpus)
  as the target; drafts: a 1-layer width-64 character model trained here for a few hundred steps
  on the same corpus (a few times smaller), and the target itself (every draft accepted: the
  ceiling of the method). Greedy, 3 prompts, same run.
- Hybrid memory: a Jamba-like model with random weights and itself as the draft (acceptance 1),
  against plain decoding of the same model.
- A rollback (``seq_rm`` of the last 3 positions) against one decode step, per memory.

Compile time is excluded: every configuration runs once before it is timed.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np
from flax import nnx

import kvjax
from benchmarks.common import table
from kvjax.app import _charlm
from kvjax.nn import HybridLM, HybridLMConfig, Llama, LlamaConfig

GREEDY = kvjax.SamplingConfig(temperature=0)


def _train_draft(tok, steps: int) -> Llama:
    """A small character model trained on the demo corpus (the draft)."""
    config = LlamaConfig(vocab_size=tok.vocab_size, d_model=64, n_layer=1, n_heads=2, n_kv_heads=1)
    return _charlm.train(steps, seq_len=64, seed=7, out=None, progress=False, config=config).model


def _run(make_target, make_draft, prompts, n_new, repeats, n_draft=4):
    """(tokens/s, acceptance) of speculative (make_draft not None) or plain decoding, median of repeats."""
    rates, acc = [], []
    for r in range(repeats + 1):
        target = make_target()
        draft = make_draft() if make_draft is not None else None
        options = dict(draft=draft, n_draft=n_draft) if draft is not None else {}
        t0 = time.perf_counter()
        out = kvjax.generate(
            target, prompts, max_new_tokens=n_new, key=jax.random.PRNGKey(0), sampling=GREEDY, **options
        )
        seconds = time.perf_counter() - t0 - out.compile_seconds
        if r:
            rates.append(sum(len(t) for t in out.tokens) / seconds)
            acc.append(out.acceptance_rate)
    return statistics.median(rates), statistics.median(acc)


def _rollback_cost(make_engine, repeats):
    decode_t, rollback_t = [], []
    for r in range(repeats + 1):
        engine = make_engine()
        engine.decode(list(range(1, 17)), list(range(16)), [[0]] * 16)
        t0 = time.perf_counter()
        np.asarray(engine.decode([1, 2, 3, 4], [16, 17, 18, 19], [[0]] * 4)[0, 0])
        t1 = time.perf_counter()
        engine.rollback(0, 17)
        jax.block_until_ready(engine.cache)
        t2 = time.perf_counter()
        if r:
            decode_t.append(t1 - t0)
            rollback_t.append(t2 - t1)
    return statistics.median(decode_t), statistics.median(rollback_t)


def run(quick: bool) -> str:
    n_new, repeats, train_steps = (12, 1, 100) if quick else (48, 3, 400)
    target_model, tok, trained = _charlm.load(verbose=False)
    cfg = target_model.config
    draft_model = _train_draft(tok, train_steps)
    prompts = [tok.encode(p).tolist() for p in ("The file is ", "Return the ", "If the value ")]

    def unified(model):
        return lambda: kvjax.Engine(
            model, kvjax.init(model.config.cache_config(size=512, n_seq_max=4, padding=64)), n_ubatch=64
        )

    rows = []
    plain, _ = _run(unified(target_model), None, prompts, n_new, repeats)
    rows.append(["unified", "plain decoding", f"{plain:.0f}", "-", "1.00"])
    for name, draft in (("1-layer width-64 char model", draft_model), ("the target itself", target_model)):
        rate, acc = _run(unified(target_model), unified(draft), prompts, n_new, repeats)
        rows.append(["unified", f"draft: {name}", f"{rate:.0f}", f"{acc:.2f}", f"{rate / plain:.2f}"])

    hcfg = HybridLMConfig(
        vocab_size=cfg.vocab_size, d_model=128, n_layer=4, recurrent_layers=(0, 2), n_heads=4, n_kv_heads=2, d_state=16
    )
    hybrid_model = HybridLM(hcfg, rngs=nnx.Rngs(0))

    def hybrid():
        return kvjax.Engine(
            hybrid_model, kvjax.init(hcfg.memory_config(size=512, n_seq_max=4, n_states=6, padding=64)), n_ubatch=64
        )

    h_plain, _ = _run(hybrid, None, prompts, n_new, repeats)
    h_rate, h_acc = _run(hybrid, hybrid, prompts, n_new, repeats)
    rows.append(["hybrid", "plain decoding", f"{h_plain:.0f}", "-", "1.00"])
    rows.append(["hybrid", "draft: the target itself", f"{h_rate:.0f}", f"{h_acc:.2f}", f"{h_rate / h_plain:.2f}"])

    cost_rows = []
    for name, make in (("unified", unified(target_model)), ("hybrid", hybrid)):
        step, rollback = _rollback_cost(make, repeats + 2)
        cost_rows.append([name, f"{step * 1e3:.2f} ms", f"{rollback * 1e3:.2f} ms", f"{rollback / step:.2f}"])

    return "\n".join(
        [
            "## Speculative decoding",
            "",
            f"Target: the demo's character model ({'trained' if trained else 'RANDOM weights: charlm.npz missing'}; "
            f"{cfg.n_layer} layers, width {cfg.d_model}); 3 prompts, {n_new} new tokens each, greedy, n_draft 4; "
            f"tokens/s over the whole call with compile time subtracted, median of {repeats}. The small draft was trained "
            f"here for {train_steps} steps. On this CPU the engine's per-call overhead is a large part of a tiny model's "
            f"step, so a draft step costs almost as much as a target step: the speed-up needs a target much costlier "
            f"than its draft.",
            "",
            table(["memory", "decoding", "tokens/s", "acceptance", "vs plain"], rows),
            "",
            "A rollback (`seq_rm` of the last 3 positions of a sequence, what a rejected draft costs) against one "
            "decode step of 4 tokens:",
            "",
            table(["memory", "decode step", "rollback", "ratio"], cost_rows),
        ]
    )
