"""The OpenAI-compatible server, tested with real clients on a loopback port (bounded, stops by itself).

- the ``openai`` package: completions and chat, streamed and not, give the text each request gets
  alone through ``kvjax.generate`` (greedy), with ``usage`` and ``finish_reason``; logprobs;
- raw HTTP (httpx): malformed JSON, wrong types, ``max_tokens`` 0 or huge, a prompt longer than the
  context, an unknown model: 4xx naming the field, and the server goes on serving;
- a client that disconnects mid-stream has its request cancelled and its cells freed;
- slot save / restore / erase of a parked sequence to a file, and the reuse it gives;
- a load test: concurrent streaming clients with random disconnects: every request that stayed
  ends with a finish reason and exactly its own tokens, nothing is left in the memory; p50/p99
  latency printed.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("starlette", reason="the server's tests need the serve extra (pip install 'kvjax[serve]')")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from tokenizers import Tokenizer as Backend  # noqa: E402
from tokenizers import models, pre_tokenizers  # noqa: E402

import kvjax  # noqa: E402
from kvjax.nn import Llama, LlamaConfig, Tokenizer  # noqa: E402
from kvjax.serve import Scheduler  # noqa: E402
from kvjax.serve._http import make_app  # noqa: E402
from kvjax.serve._scheduler import percentiles  # noqa: E402
from kvjax.serve._worker import Worker  # noqa: E402

V = 24
EOS = 23
CFG = LlamaConfig(vocab_size=V, d_model=32, n_layer=2, n_heads=2, n_kv_heads=1)
NAME = "tiny"
GREEDY = kvjax.SamplingConfig(temperature=0)


def tokenizer():
    backend = Backend(models.WordLevel({f"w{i}": i for i in range(V)}, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return Tokenizer(backend, eos_ids=(EOS,))


TOK = tokenizer()
MODEL = Llama(CFG, rngs=nnx.Rngs(3))
nnx.update(MODEL, jax.tree.map(lambda x: x * 1.5, nnx.state(MODEL, nnx.Param)))


def render(messages):
    return TOK.encode(" ".join(m["content"] for m in messages) + " w22")


def alone(ids, max_tokens):
    """The text greedy ``kvjax.generate`` gives ``ids`` on a fresh memory (stop at EOS)."""
    engine = kvjax.Engine(MODEL, kvjax.init(CFG.cache_config(size=256, n_seq_max=1, padding=16)), n_ubatch=16)
    out = kvjax.generate(
        engine, [ids], max_new_tokens=max_tokens, key=jax.random.PRNGKey(0), sampling=GREEDY, stop_tokens=[EOS]
    )
    return out.tokens[0]


def text_of(tokens):
    return TOK.decode([t for t in tokens if t != EOS])


class Server:
    """A server on 127.0.0.1 in a thread, stopped at the end of the module (or after 600 s)."""

    def __init__(self, slot_dir):
        memory = kvjax.init(CFG.cache_config(size=512, n_seq_max=8, padding=16))
        engine = kvjax.Engine(MODEL, memory, n_ubatch=16)
        self.scheduler = Scheduler(engine, n_batch=32, prompt_cache=kvjax.PromptCache(8, 512), tokenizer=TOK)
        self.worker = Worker(self.scheduler).start()
        app = make_app(
            self.worker, model_name=NAME, tokenizer=TOK, render_chat=render, stop_tokens=[EOS], slot_dir=slot_dir
        )
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        threading.Timer(600, self.stop).start()  # bounded in time, whatever the tests do

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        self.worker.stop()

    def erase_parked(self):
        """Drop every parked prefix (on the worker thread); return the cells still used after."""

        def erase(s):
            for seq in s.prompt_cache.parked():
                s.engine.cache, _ = kvjax.seq_rm(s.engine.cache, seq)
                s.prompt_cache.forget(seq)
            return int(kvjax.used_cells(s.engine.cache)), len(s.running)

        return self.worker.call(erase).result(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("slots"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


PROMPT = "w1 w2 w3 w4 w5"


def test_openai_completions_equal_generate_streamed_and_not(client):
    want = alone(TOK.encode(PROMPT), 6)
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    assert got.choices[0].text == text_of(want)
    assert got.choices[0].finish_reason == ("stop" if want[-1] == EOS else "length")
    assert got.usage.prompt_tokens == 5 and got.usage.completion_tokens == len(want)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text_of(want)
    assert chunks[-1].choices[0].finish_reason == got.choices[0].finish_reason
    # token ids as the prompt, and logprobs
    got = client.completions.create(model=NAME, prompt=TOK.encode(PROMPT), max_tokens=3, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)


def test_openai_chat_equals_generate_streamed_and_not(client):
    messages = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w7 w6 w5"}]
    want = alone(render(messages), 5)
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=5, temperature=0)
    assert got.choices[0].message.content == text_of(want)
    assert got.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text_of(want)
    assert chunks[-1].usage.completion_tokens == len(want)
    got = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=2, temperature=0, logprobs=True, top_logprobs=3
    )
    content = got.choices[0].logprobs.content
    assert len(content) == 2 and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-6


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b'["a list"]', 400, None),
        (json.dumps({"prompt": PROMPT, "max_tokens": "5"}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "max_tokens": 10**12}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": PROMPT, "temperature": 3}).encode(), 400, "temperature"),
        (json.dumps({"prompt": 5}).encode(), 400, "prompt"),
        (json.dumps({"prompt": [1, 2, 99]}).encode(), 400, "prompt"),
        (json.dumps({"prompt": " ".join(["w1"] * 600)}).encode(), 400, "prompt"),
        (json.dumps({"prompt": PROMPT, "model": "gpt-9"}).encode(), 404, "model"),
        (json.dumps({"prompt": PROMPT, "stop": [""]}).encode(), 400, "stop"),
        (json.dumps({"prompt": PROMPT, "n": 2}).encode(), 400, "n"),
        (json.dumps({"prompt": PROMPT, "stream": "yes"}).encode(), 400, "stream"),
    ],
)
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_goes_on(server, body, status, param):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"]
    ok = httpx.post(
        server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0}, timeout=30
    )
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == text_of(alone(TOK.encode(PROMPT), 2))


def test_chat_bad_messages_and_a_huge_budget_that_ends_cleanly(server):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user"}]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content"
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": "hi"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    # a budget far beyond the context: the request ends with "length" (or EOS) at the context's end
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 10**6, "temperature": 0}, timeout=120
    )
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert r.json()["usage"]["total_tokens"] <= 512 + 1


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/v1/models").json()["data"][0]["id"] == NAME
    text = httpx.get(server.url + "/metrics").text
    for name in ("kvjax_requests_total", "kvjax_generated_tokens_total", "kvjax_queue_requests", "kvjax_cells_used"):
        assert name in text


def test_a_client_that_disconnects_mid_stream_has_its_sequence_freed(server):
    before = server.scheduler.stats["finished_cancelled"]
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"prompt": "w3 w3", "max_tokens": 400, "temperature": 0.9, "stream": True, "seed": 1},
        timeout=30,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break  # the first chunk: leave
    deadline = time.monotonic() + 30
    while server.scheduler.stats["finished_cancelled"] == before:
        assert time.monotonic() < deadline, "the disconnected request was never cancelled"
        time.sleep(0.05)
    assert server.erase_parked() == (0, 0)


def test_slot_save_restore_and_erase(server, client):
    long_prompt = "w4 w5 w6 w7 w8 w9 w10 w11 w12 w13"
    client.completions.create(model=NAME, prompt=long_prompt, max_tokens=2, temperature=0)
    slot = server.worker.call(lambda s: s.prompt_cache.lru()[-1]).result(30)
    saved = httpx.post(f"{server.url}/slots/{slot}?action=save", json={"filename": "s.bin"}).json()
    assert saved["n_saved"] >= 10 and saved["n_written"] > 0
    assert httpx.post(f"{server.url}/slots/{slot}?action=erase").json()["id_slot"] == slot
    assert server.erase_parked() == (0, 0)
    restored = httpx.post(f"{server.url}/slots/{slot}?action=restore", json={"filename": "s.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]
    again = client.completions.create(model=NAME, prompt=long_prompt + " w1", max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 10  # the restored prefix was reused
    bad = httpx.post(f"{server.url}/slots/{slot}?action=save", json={"filename": "../x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "filename"
    bad = httpx.post(f"{server.url}/slots/99?action=save", json={"filename": "x"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "id_slot"
    bad = httpx.post(f"{server.url}/slots/{slot}?action=restore", json={"filename": "missing.bin"})
    assert bad.status_code == 400


def load(server, n_requests: int, concurrency: int, cancel_rate: float, seed: int = 0):
    """``n_requests`` streamed completions from ``concurrency`` clients; some leave after their first chunk."""
    prompts = [" ".join(f"w{(i * 7 + j) % 20 + 1}" for j in range(3 + i % 9)) for i in range(8)]
    want = {p: text_of(alone(TOK.encode(p), 8)) for p in prompts}
    rng = random.Random(seed)
    plan = [(rng.choice(prompts), rng.random() < cancel_rate) for _ in range(n_requests)]
    results, latencies = [], []

    async def one(http, prompt, leave):
        t0 = time.perf_counter()
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
        text, finish = "", None
        async with http.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[5:])["choices"][0]
                text += choice["text"]
                finish = choice["finish_reason"] or finish
                if leave:
                    return
        latencies.append(time.perf_counter() - t0)
        results.append((prompt, text, finish))

    async def main():
        limits = httpx.Limits(max_connections=concurrency)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            gate = asyncio.Semaphore(concurrency)

            async def gated(p, leave):
                async with gate:
                    await one(http, p, leave)

            await asyncio.wait_for(asyncio.gather(*(gated(p, leave) for p, leave in plan)), timeout=300)

    asyncio.run(main())
    return plan, results, want, latencies


def test_load_many_streaming_clients_with_disconnects(server):
    plan, results, want, latencies = load(server, n_requests=64, concurrency=32, cancel_rate=0.2)
    stayed = sum(1 for _, leave in plan if not leave)
    assert len(results) == stayed  # nothing lost: every request that stayed got its finish reason
    for prompt, text, finish in results:
        assert finish in ("length", "stop") and text == want[prompt]  # no cross-talk
    deadline = time.monotonic() + 30
    while server.scheduler.running or server.scheduler.queued:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert server.erase_parked() == (0, 0)  # nothing but parked prefixes was left in the memory
    p50, p99 = percentiles(latencies)
    print(f"load: {len(plan)} requests, 32 clients, p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms")


@pytest.mark.slow
def test_load_a_few_hundred_requests(server):
    plan, results, want, latencies = load(server, n_requests=320, concurrency=32, cancel_rate=0.15, seed=1)
    assert len(results) == sum(1 for _, leave in plan if not leave)
    assert all(text == want[prompt] for prompt, text, _ in results)
    assert server.erase_parked() == (0, 0)
    p50, p99 = percentiles(latencies)
    print(f"load: {len(plan)} requests, p50 {p50 * 1e3:.0f} ms, p99 {p99 * 1e3:.0f} ms")
    assert np.isfinite(p99)


from tests.test_generate_cli import folder  # noqa: E402,F401  (the tiny checkpoint folder fixture)


def test_the_command_line_server_serves_a_checkpoint_and_stops_by_itself(folder):  # noqa: F811
    with socket.socket() as s:  # a free loopback port
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "kvjax", "--no-compile-cache", "serve", "--model", str(folder), "--port", str(port)]
    cmd += ["--ctx", "256", "--parallel", "2", "--max-requests", "2", "--time-limit", "300"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.5)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        got = client.completions.create(model=name, prompt="hello", max_tokens=4, temperature=0)
        assert got.choices[0].finish_reason in ("length", "stop") and got.usage.prompt_tokens > 0
        # the folder has no chat template: refused by name, and the server goes on
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
        client.completions.create(model=name, prompt="hello there", max_tokens=3, temperature=0)
        assert proc.wait(60) == 0  # --max-requests 2: it stopped by itself
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_the_command_line_server_refuses_a_missing_model(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "kvjax", "serve", "--model", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "does not exist" in out.stderr
