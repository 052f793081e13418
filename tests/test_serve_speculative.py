"""Speculative decoding inside the serving scheduler: a draft engine proposes, the target checks.

- every request of a trace (different lengths, arrivals over time, a cancel, budgets, a stop
  token) gets exactly the greedy tokens ``kvjax.generate`` gives it alone on the target, whatever the
  draft: the target's own weights (every draft kept), another small model (most rejected), and a
  recurrent draft (its states rolled back) on a recurrent target (a unified target with it, and the
  full trace for the recurrent pairs, behind ``-m slow``); both memories end empty;
- a target memory too small for every round's drafts: rounds that do not fit give way to plain
  steps, and the tokens stay the same;
- bad drafts are refused by name before anything changes.
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import kvjax
from kvjax.nn import Llama, LlamaConfig
from kvjax.serve import Scheduler, ServeRequest
from tests.test_serve_scheduler import REQUESTS, alone, engine, serve
from tests.tiny_models import V, memory, model

ARRIVALS, CANCEL = [0, 0, 1, 3, 4, 9], {4: 6}


def draft_engine(kind: str, n_seq: int = 4) -> kvjax.Engine:
    """``"same"``: the target Llama's own weights (every draft is kept); ``"small"``: another random
    one-layer Llama (most drafts are rejected); ``"mamba"``: the recurrent model (states rolled back)."""
    if kind == "same":
        return kvjax.Engine(model("unified"), memory("unified", n_seq=n_seq), n_ubatch=16)
    if kind == "mamba":
        return kvjax.Engine(model("recurrent"), memory("recurrent", n_seq=n_seq), n_ubatch=16)
    small = LlamaConfig(vocab_size=V, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    m = Llama(small, rngs=nnx.Rngs(7))
    nnx.update(m, jax.tree.map(lambda x: x * 1.5, nnx.state(m, nnx.Param)))
    return kvjax.Engine(m, kvjax.init(small.cache_config(size=96, n_seq_max=n_seq, padding=16)), n_ubatch=16)


# a recurrent memory splits ubatches equally per sequence: every mix of chunk lengths compiles a
# program of its own, so the default suite runs those pairs on a shorter trace (the full one: slow)
FULL, SHORT = (REQUESTS, ARRIVALS, CANCEL), (REQUESTS[2:5], [0, 1, 2], {2: 3})


@pytest.mark.parametrize(
    "target, draft, trace",
    [("unified", "same", FULL), ("unified", "small", FULL), ("recurrent", "mamba", SHORT)]
    + [pytest.param("unified", "mamba", SHORT, marks=pytest.mark.slow)]
    + [pytest.param(t, "mamba", FULL, marks=pytest.mark.slow) for t in ("unified", "recurrent")],
)
def test_speculative_rounds_give_every_request_its_greedy_tokens(target, draft, trace):
    requests, arrivals, cancel = trace
    eng, drafter = engine(target), draft_engine(draft)
    scheduler = Scheduler(eng, n_batch=12, draft=drafter, n_draft=3)
    got = serve(scheduler, requests, arrivals=arrivals, cancel=cancel)
    for i, req in enumerate(requests):
        want = alone(target, req)
        if i in cancel:
            assert got[i]["finish"] == "cancelled" and got[i]["tokens"] == want[: len(got[i]["tokens"])]
            continue
        assert got[i]["tokens"] == want, (target, draft, i)
        assert got[i]["finish"] == ("stop" if want and want[-1] in req.stop_tokens else "length")
    assert scheduler.idle and int(kvjax.used_cells(eng.cache)) == 0
    assert all(int(kvjax.seq_pos_max(drafter.cache, s)) < 0 for s in range(4))  # the draft's memory is empty too
    stats = scheduler.stats
    assert stats["speculative_rounds"] > 0 and stats["drafted_tokens"] > 0 and stats["drafted_tokens"] % 3 == 0
    if (target, draft) == ("unified", "same"):  # the target's own proposals: every draft is kept
        assert stats["accepted_tokens"] == stats["drafted_tokens"]
    if draft == "small":
        assert stats["accepted_tokens"] < stats["drafted_tokens"]


def test_rounds_that_do_not_fit_give_way_to_plain_steps():
    """A target memory of 48 cells for requests that need up to 25 positions each: the verification
    batches of several requests do not always fit, and plain steps (which make room) take over."""
    eng = kvjax.Engine(model("unified"), memory("unified", size=48), n_ubatch=16)
    scheduler = Scheduler(eng, n_batch=12, draft=draft_engine("same"), n_draft=4)
    got = serve(scheduler, REQUESTS, arrivals=[0] * len(REQUESTS))
    for i, req in enumerate(REQUESTS):
        assert got[i]["tokens"] == alone("unified", req), i
    assert scheduler.stats["speculative_rounds"] > 0 and scheduler.stats["speculative_fallbacks"] > 0
    assert int(kvjax.used_cells(eng.cache)) == 0


def test_bad_drafts_are_refused_by_name():
    eng = engine("unified")
    other_vocab = LlamaConfig(vocab_size=V + 1, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    wrong = kvjax.Engine(
        Llama(other_vocab, rngs=nnx.Rngs(0)), kvjax.init(other_vocab.cache_config(size=32, n_seq_max=4))
    )
    busy = draft_engine("small")
    busy.decode([1, 2], [0, 1], [[0], [0]])
    cases = [
        (dict(draft="no"), r"draft must be a kvjax.Engine"),
        (dict(draft=eng), r"draft must be another Engine than the target"),
        (dict(draft=draft_engine("small"), n_draft=0), r"n_draft=0 is out of range: allowed an integer in \[1, 64\]"),
        (dict(draft=wrong), rf"draft has vocab_size={V + 1}: allowed the target's {V}"),
        (dict(draft=draft_engine("small", n_seq=2)), r"draft memory has n_seq_max=2: allowed at least the target's 4"),
        (
            dict(draft=draft_engine("small"), prompt_cache=kvjax.PromptCache(4, 64)),
            r"draft is out of range with prompt_cache",
        ),
        (dict(draft=draft_engine("small"), context="shift"), r"draft is out of range with context='shift'"),
        (dict(draft=busy), r"the draft's memory holds cells of sequences \[0\]"),
        (
            dict(draft=draft_engine("mamba"), n_draft=5),  # 4 states a sequence: 3 positions back
            r"draft memory can roll back 3 positions: allowed n_draft=5 needs 4",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            Scheduler(eng, **kwargs)
    assert int(kvjax.used_cells(eng.cache)) == 0
    # a good draft still serves after the refusals
    scheduler = Scheduler(eng, draft=draft_engine("small"), n_draft=2)
    rid = scheduler.submit(ServeRequest([1, 2, 3], max_tokens=4))
    assert scheduler.run_until_idle()[rid].tokens == alone("unified", ServeRequest([1, 2, 3], max_tokens=4))


from tests.test_generate_cli import folder  # noqa: E402,F401  (the tiny checkpoint folder fixture)


def test_the_server_with_a_draft_model_answers_as_without(folder):  # noqa: F811
    """``python -m kvjax serve --model-draft`` (here its ``build``): the same greedy completions as the
    server without a draft, through speculative rounds; slot files are refused with a draft."""
    pytest.importorskip("starlette", reason="the server needs the serve extra (pip install 'kvjax[serve]')")
    from starlette.testclient import TestClient

    from kvjax.app._serve import build

    texts, schedulers = [], []
    for draft in (None, folder):
        app, worker = build(folder, ctx=256, parallel=2, n_ubatch=16, draft_path=draft, n_draft=3)
        try:
            with TestClient(app) as http:
                got = []
                for prompt in ("hello there", "a b c d"):
                    body = {"model": folder.name, "prompt": prompt, "max_tokens": 8, "temperature": 0}
                    r = http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    got.append(r.json()["choices"][0]["text"])
                texts.append(got)
                schedulers.append(worker.scheduler)
                metrics = http.get("/metrics").text
        finally:
            worker.stop()
    assert texts[0] == texts[1]
    assert schedulers[1].stats["speculative_rounds"] > 0 and schedulers[1].prompt_cache is None
    assert f"kvjax_accepted_tokens_total {float(schedulers[1].stats['accepted_tokens'])}" in metrics
    with pytest.raises(ValueError, match=r"--slot-save-path is out of range with --model-draft"):
        build(folder, ctx=256, parallel=2, draft_path=folder, slot_dir=str(folder / "slots"))
