"""The prompt cache: a multi-turn workload with and without it, and the matching call's cost.

- Workload: several users interleaved, each request repeating that user's conversation so far plus
  a new turn (the demo's character model, greedy, 16 new characters per turn). Time to first token
  and prompt tokens evaluated, with ``kvjax.PromptCache`` and without it (every request on a memory
  where its sequence is evaluated from scratch), same run, compile time excluded (a warm-up pass
  of the same workload first).
- Matching: one ``match_prefix`` call over 256 parked sequences of 4096 tokens (a 4 MiB token
  store) against the dispatch floor (a jitted identity on a scalar), median of many calls.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvjax
from benchmarks.common import table
from kvjax.app import _charlm
from kvjax.engine._prompt_cache import PromptStore, match_prefix

GREEDY = kvjax.SamplingConfig(temperature=0)
TURNS = [" and the ", " If the ", " Return the ", " The value ", " of the "]


def _workload(model, tok, users, turns, with_cache):
    cfg = model.config
    engine = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=2048, n_seq_max=users + 2, padding=64)), n_ubatch=64)
    cache = kvjax.PromptCache(n_seq_max=users + 2, max_tokens=2048) if with_cache else None
    ttft, evaluated, chats = multi_turn(engine, tok, users, turns, cache)
    return statistics.median(ttft), evaluated, sum(len(c) for c in chats)


def multi_turn(engine, tok, users, turns, cache):
    """Users interleaved round-robin, each request its user's conversation so far plus a new turn.

    Returns:
        ``(time to first token of each request, prompt tokens evaluated, the conversations)``;
        without a ``cache`` every request runs on a cleared memory.
    """
    chats = [f"User {u}: The file " for u in range(users)]
    ttft, evaluated = [], 0
    for t in range(turns):
        for u in range(users):
            prompt = tok.encode(chats[u]).tolist()
            if cache is None:
                engine.cache = kvjax.clear(engine.cache)
                options = {}
            else:
                options = {"prompt_cache": cache}
            out = kvjax.generate(
                engine, [prompt], max_new_tokens=16, key=jax.random.PRNGKey(0), sampling=GREEDY, **options
            )
            ttft.append(out.time_to_first_token)
            evaluated += out.prompt_tokens
            chats[u] += tok.decode(out.tokens[0]) + TURNS[(t + u) % len(TURNS)]
    return ttft, evaluated, chats


def _match_cost(repeats):
    rng = np.random.default_rng(0)
    store = PromptStore(
        tokens=jnp.asarray(rng.integers(0, 64, (256, 4096)), jnp.int32),
        length=jnp.full((256,), 4096, jnp.int32),
        last_used=jnp.arange(256, dtype=jnp.int32),
    )
    prompt = np.asarray(store.tokens[17]).copy()
    prompt[3000:] = 0
    floor = jax.jit(lambda x: x)
    jax.block_until_ready(match_prefix(store, prompt, np.int32(4096)))
    jax.block_until_ready(floor(np.int32(1)))

    def median(fn):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    seq, length = jax.device_get(match_prefix(store, prompt, np.int32(4096)))
    assert int(seq) == 17 and int(length) >= 3000
    return median(lambda: match_prefix(store, prompt, np.int32(4096))), median(lambda: floor(np.int32(1)))


def run(quick: bool) -> str:
    users, turns, repeats = (2, 2, 20) if quick else (3, 5, 200)
    model, tok, trained = _charlm.load(verbose=False)
    rows = []
    for with_cache in (False, True):
        _workload(model, tok, users, turns, with_cache)  # compile everything once
        ttft, evaluated, total = _workload(model, tok, users, turns, with_cache)
        rows.append(["with PromptCache" if with_cache else "without", f"{ttft * 1e3:.1f} ms", f"{evaluated}"])
    match_s, floor_s = _match_cost(repeats)
    return "\n".join(
        [
            "## Prompt cache: multi-turn requests",
            "",
            f"The demo's character model ({'trained' if trained else 'random weights'}), {users} users interleaved, "
            f"{turns} turns each; every request repeats the user's conversation so far plus a new turn; 16 new characters "
            f"per turn, greedy. Median time to first token over all requests (compile excluded: the workload ran once "
            f"before) and prompt tokens evaluated in total:",
            "",
            table(["", "time to first token", "prompt tokens evaluated"], rows),
            "",
            "One matching call (`match_prefix`: the longest common prefix of a prompt with every parked sequence, on the "
            f"device) over 256 parked sequences of 4096 tokens, against the dispatch floor (a jitted identity), median "
            f"of {repeats}:",
            "",
            table(
                ["match_prefix", "dispatch floor", "ratio"],
                [[f"{match_s * 1e3:.3f} ms", f"{floor_s * 1e3:.3f} ms", f"{match_s / floor_s:.1f}"]],
            ),
        ]
    )
