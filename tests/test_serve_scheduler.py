"""The serving scheduler: continuous batching gives every request exactly what it gets alone.

- greedy: requests of different lengths, arriving over time, sharing prefixes, some cancelled,
  some hitting their budget or a stop token, each get exactly the tokens ``kvjax.generate`` gives
  them alone on a fresh memory, for the unified, streams, iSWA, recurrent and hybrid memories;
  with the prompt cache too; the memory holds no cells of finished requests at the end;
- sampled: each request's tokens depend on its own seed only (alone or among others, either order);
- a memory too small for everyone: requests wait or are preempted, and still get their tokens;
- context: ``"length"`` finishes at ``n_ctx``, ``"shift"`` equals ``generate``'s context shift;
- stop strings and logprobs; bad requests refused with the field named, nothing queued.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models

import kvjax
from kvjax.nn import Tokenizer
from kvjax.serve import QueueFullError, Scheduler, ServeRequest
from tests.tiny_models import V, memory, model

GREEDY = kvjax.SamplingConfig(temperature=0)
KINDS = ("unified", "streams", "iswa", "recurrent", "hybrid")


def engine(kind, **kw):
    return kvjax.Engine(model(kind), memory(kind, **kw), n_ubatch=16)


def alone(kind, request: ServeRequest):
    """What ``kvjax.generate`` gives the request on a fresh memory (the oracle)."""
    out = kvjax.generate(
        engine(kind),  # the scheduler's memory shape: the programs compiled for one serve both
        [list(request.prompt)],
        max_new_tokens=request.max_tokens,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        stop_tokens=request.stop_tokens,
    )
    return out.tokens[0]


# prompts with shared prefixes and different lengths; budgets, one stop token
REQUESTS = [
    ServeRequest([1, 2, 3, 4, 5], max_tokens=6),
    ServeRequest([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], max_tokens=4),
    ServeRequest([7, 8], max_tokens=9),
    ServeRequest([1, 2, 3, 9], max_tokens=5, stop_tokens=(3, 11)),
    ServeRequest([5, 5, 5, 5, 5, 5, 5], max_tokens=3),
    ServeRequest([12, 1, 12, 1], max_tokens=7),
]


def serve(scheduler, requests, arrivals, cancel=None):
    """Submit request ``i`` before step ``arrivals[i]``; cancel ``cancel[i]`` at that step. Returns results."""
    results, ids, cancel = {}, {}, cancel or {}
    step = 0
    while len(ids) < len(requests) or not scheduler.idle:
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = scheduler.submit(requests[i])
        for i, at in cancel.items():
            if at == step:
                scheduler.cancel(ids[i])
        for ev in scheduler.step():
            r = results.setdefault(ev.request_id, {"tokens": [], "finish": None})
            r["tokens"] += ev.tokens
            if ev.finished:
                r["finish"] = ev.finish_reason
        step += 1
        assert step < 500
    return {i: results.get(ids[i], {"tokens": [], "finish": None}) for i in ids}


def check_trace(kind, requests, arrivals, cancel):
    eng = engine(kind)
    scheduler = Scheduler(eng, n_batch=12)  # prompts are chunked and mixed with decode tokens
    got = serve(scheduler, requests, arrivals=arrivals, cancel=cancel)
    for i, req in enumerate(requests):
        want = alone(kind, req)
        if i in cancel:  # cancelled after a few steps: a prefix of what it gets alone
            assert got[i]["finish"] == "cancelled"
            assert got[i]["tokens"] == want[: len(got[i]["tokens"])]
            continue
        assert got[i]["tokens"] == want, (kind, i)
        stopped = bool(want) and want[-1] in req.stop_tokens
        assert got[i]["finish"] == ("stop" if stopped else "length")
    assert int(kvjax.used_cells(eng.cache)) == 0 and scheduler.idle
    assert scheduler.stats["finished_cancelled"] == len(cancel)


# the recurrent and hybrid memories split ubatches equally per sequence: every mix of chunk
# lengths is a program of its own, so the default suite runs them on a shorter trace
FULL, SHORT = (REQUESTS, [0, 0, 1, 3, 4, 9], {4: 6}), (REQUESTS[2:5], [0, 1, 2], {2: 3})


@pytest.mark.parametrize(
    "kind, trace",
    [(k, FULL) for k in ("unified", "iswa")]
    + [(k, SHORT) for k in ("streams", "recurrent", "hybrid")]
    + [pytest.param(k, FULL, marks=pytest.mark.slow) for k in ("streams", "recurrent", "hybrid")],
)
def test_continuous_batching_equals_each_request_alone(kind, trace):
    check_trace(kind, *trace)


@pytest.mark.parametrize("device_loop", [False, True])
def test_device_stretches_give_the_host_steps_tokens(device_loop):
    eng = engine("unified")
    scheduler = Scheduler(eng, device_loop=device_loop, sync_every=4)
    got = serve(scheduler, REQUESTS[:3], arrivals=[0, 0, 0])
    for i, req in enumerate(REQUESTS[:3]):
        assert got[i]["tokens"] == alone("unified", req)
    assert (scheduler.stats["device_stretches"] > 0) == device_loop


@pytest.mark.parametrize("kind", ["unified", "iswa", "recurrent", pytest.param("hybrid", marks=pytest.mark.slow)])
def test_prompt_cache_reuses_parked_prefixes_with_the_same_tokens(kind):
    eng = engine(kind)
    scheduler = Scheduler(eng, prompt_cache=kvjax.PromptCache(4, 64))
    chat = [
        ServeRequest([1, 2, 3, 4, 5], max_tokens=3),
        ServeRequest([1, 2, 3, 4, 5, 6, 7], max_tokens=3),
        ServeRequest([9, 9, 8], max_tokens=2),
        ServeRequest([1, 2, 3, 4, 5, 6, 7, 8, 10, 11], max_tokens=4),
        ServeRequest([9, 9, 8, 7, 6], max_tokens=3),
    ]
    got = serve(scheduler, chat, arrivals=[0, 6, 6, 14, 14])
    for i, req in enumerate(chat):
        assert got[i]["tokens"] == alone(kind, req), (kind, i)
    if kind in ("unified", "iswa"):  # token-granular reuse (states only where kept, for the others)
        assert scheduler.stats["cached_tokens"] > 0


def test_a_host_tier_takes_finished_requests_and_gives_their_prefixes_back():
    eng = engine("unified")
    cache = kvjax.PromptCache(4, 64, host_bytes=1 << 22, idle_to_host=True)
    scheduler = Scheduler(eng, prompt_cache=cache)
    chat = [ServeRequest([1, 2, 3, 4, 5, 6], max_tokens=3), ServeRequest([1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=3)]
    got = serve(scheduler, chat, arrivals=[0, 8])
    for i, req in enumerate(chat):
        assert got[i]["tokens"] == alone("unified", req)
    assert int(kvjax.used_cells(eng.cache)) == 0 and cache.parked() == []  # all on the host
    assert cache.restores == 1 and scheduler.stats["cached_tokens"] >= 6


def test_parked_prefixes_give_way_when_running_requests_need_their_cells():
    eng = engine("unified", size=48)
    cache = kvjax.PromptCache(4, 64)
    scheduler = Scheduler(eng, prompt_cache=cache)
    reqs = [ServeRequest([1 + i, 2, 3, 4, 5, 6, 7, 8], max_tokens=4) for i in range(2)]
    reqs += [ServeRequest([9 + i, 8, 7], max_tokens=18) for i in range(2)]
    got = serve(scheduler, reqs, arrivals=[0, 0, 8, 8])
    for i, req in enumerate(reqs):
        assert got[i]["tokens"] == alone("unified", req)
    assert cache.evictions > 0  # 2 x 11 parked + 2 x 20 running do not fit in 48 cells


def test_thousands_of_queued_requests_are_refused_past_the_limit_and_cancelled_cleanly():
    scheduler = Scheduler(engine("unified"), max_queue=3000)
    ids = [scheduler.submit(ServeRequest([1 + i % 7, 2], max_tokens=4)) for i in range(3000)]
    with pytest.raises(QueueFullError):
        scheduler.submit(ServeRequest([1], max_tokens=1))
    events = scheduler.step()  # admits the first four and runs them a step
    assert scheduler.queued == 2996 and len(scheduler.running) == 4 and len(events) == 4
    for rid in ids:
        scheduler.cancel(rid)
    finished = [ev for ev in scheduler.step() if ev.finished]
    assert len(finished) == 3000 and {ev.finish_reason for ev in finished} == {"cancelled"}
    assert scheduler.idle and int(kvjax.used_cells(scheduler.engine.cache)) == 0


def test_a_small_memory_makes_requests_wait_or_give_way_and_everyone_still_gets_their_tokens():
    eng = engine("unified", size=48, n_seq=4)
    scheduler = Scheduler(eng, n_batch=16)
    reqs = [ServeRequest([1 + i, 2, 3, 4, 5, 6, 7, 8], max_tokens=14) for i in range(4)]
    got = serve(scheduler, reqs, arrivals=[0, 0, 0, 0])
    for i, req in enumerate(reqs):
        assert got[i]["tokens"] == alone("unified", req)
    # 4 x 22 cells do not fit in 48: someone waited or was preempted
    assert scheduler.stats["preemptions"] > 0 or scheduler.stats["peak_running"] < 4
    assert int(kvjax.used_cells(eng.cache)) == 0


def test_seeds_alone_decide_sampled_tokens():
    hot = kvjax.SamplingConfig(temperature=1.0, top_k=8)
    reqs = [ServeRequest([1, 2, 3], max_tokens=8, sampling=hot, seed=s) for s in (11, 12, 11)]

    def run(order):
        scheduler = Scheduler(engine("unified"))
        ids = [scheduler.submit(reqs[i]) for i in order]
        out = scheduler.run_until_idle()
        return {i: out[rid].tokens for i, rid in zip(order, ids)}

    together, reversed_, single = run([0, 1, 2]), run([2, 1, 0]), run([0])
    assert together == reversed_
    assert together[0] == together[2] == single[0]  # the same seed: the same tokens, whatever else runs
    assert together[0] != together[1]


def test_context_length_finishes_and_shift_equals_generate():
    eng = engine("unified")
    scheduler = Scheduler(eng, n_ctx=12)
    rid = scheduler.submit(ServeRequest([1, 2, 3, 4, 5], max_tokens=50))
    out = scheduler.run_until_idle()[rid]
    assert out.finish_reason == "length" and len(out.tokens) == 12 - 5 + 1  # the 13th position never placed

    scheduler = Scheduler(engine("unified"), n_ctx=12, context="shift", n_keep=2, device_loop=False)
    rid = scheduler.submit(ServeRequest([1, 2, 3, 4, 5], max_tokens=20))
    got = scheduler.run_until_idle()[rid].tokens
    want = kvjax.generate(
        engine("unified", n_seq=1),
        [[1, 2, 3, 4, 5]],
        max_new_tokens=20,
        key=jax.random.PRNGKey(0),
        sampling=GREEDY,
        n_ctx=12,
        n_keep=2,
    )
    assert got == want.tokens[0] and scheduler.stats["context_shifts"] == want.context_shifts > 0


def tiny_tokenizer():
    vocab = {chr(ord("a") + i): i for i in range(V)}
    return Tokenizer(Backend(models.WordLevel(vocab, unk_token="a")))


def test_stop_strings_cut_the_text_and_logprobs_match_the_logits():
    tok = tiny_tokenizer()
    eng = engine("unified")
    want = alone("unified", ServeRequest([1, 2, 3], max_tokens=8))
    text = tok.decode(want)
    stop = text.split(" ")[3]  # the fourth token's text
    scheduler = Scheduler(eng, tokenizer=tok)
    rid = scheduler.submit(ServeRequest([1, 2, 3], max_tokens=8, stop=[stop], logprobs=3))
    out = scheduler.run_until_idle()[rid]
    assert out.finish_reason == "stop"
    assert out.tokens == want[: len(out.tokens)] and len(out.tokens) <= 4
    assert stop not in out.text and text.startswith(out.text)
    # the first token's logprob is the log-softmax of the prompt's last logits
    fresh = engine("unified", n_seq=1)
    logits = np.asarray(fresh.decode([1, 2, 3], [0, 1, 2], [[0]] * 3))[-1]
    logp = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    first = out.logprobs[0]
    assert first.token == want[0] and abs(first.logprob - logp[want[0]]) < 1e-4
    assert [t for t, _ in first.top] == list(np.argsort(-logp)[:3])


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(prompt=[]), "prompt"),
        (dict(prompt=[1, V]), "prompt"),
        (dict(prompt=[1.5]), "prompt"),
        (dict(prompt=list(range(1, 20)) * 6), "prompt"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.0), "max_tokens"),
        (dict(seed=-1), "seed"),
        (dict(stop_tokens="x"), "stop_tokens"),
        (dict(stop=["a"]), "stop"),  # no tokenizer on this scheduler
        (dict(logprobs=21), "logprobs"),
        (dict(sampling="greedy"), "sampling"),
    ],
)
def test_bad_requests_are_refused_naming_the_field_and_nothing_is_queued(bad, field):
    scheduler = Scheduler(engine("unified"))
    fields = dict(prompt=[1, 2], max_tokens=2)
    fields.update(bad)
    with pytest.raises(ValueError, match=field):
        scheduler.submit(ServeRequest(**fields))
    assert scheduler.idle and scheduler.stats["submitted"] == 0


def test_queue_limit_and_bad_scheduler_arguments():
    scheduler = Scheduler(engine("unified"), max_queue=2)
    scheduler.submit(ServeRequest([1], max_tokens=1))
    scheduler.submit(ServeRequest([1], max_tokens=1))
    with pytest.raises(QueueFullError, match="max_queue=2"):
        scheduler.submit(ServeRequest([1], max_tokens=1))
    assert len(scheduler.run_until_idle()) == 2
    with pytest.raises(ValueError, match="context"):
        Scheduler(engine("recurrent"), context="shift")
    with pytest.raises(ValueError, match="n_batch"):
        Scheduler(engine("unified"), n_batch=0)
    eng = engine("unified")
    eng.decode([1], [0], [[2]])
    with pytest.raises(ValueError, match=r"sequences \[2\]"):
        Scheduler(eng)
