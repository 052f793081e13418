"""``python -m kvjax generate``: a tiny checkpoint folder (kvjax weights written with ``save_llama``
and a trained character tokenizer, no torch), streamed text, the speed report, stops, bad arguments.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.app import _generate
from kvjax.nn import Llama, LlamaConfig, Tokenizer
from kvjax.nn._pretrained import save_llama

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from tests.test_tokenizer import make_tokenizer, write_tokenizer_folder  # noqa: E402


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    backend = make_tokenizer(100, byte_level=False)
    model = Llama(
        LlamaConfig(
            vocab_size=backend.get_vocab_size(),
            d_model=32,
            n_layer=2,
            n_heads=4,
            n_kv_heads=2,
            rope=kvjax.RopeConfig(n_rot=8, mode="neox"),
        ),
        rngs=nnx.Rngs(0),
    )
    save_llama(model, path)
    write_tokenizer_folder(
        path, backend, generation={"bos_token_id": 0, "eos_token_id": 1}, tokenizer_config={"add_bos_token": True}
    )
    return path


def _greedy(model, ids, n, pad=32):
    """Greedy continuation by full uncached passes (one jitted program: padded to ``pad`` tokens;
    trailing padding does not change the logits before it)."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).forward(tokens))
    out = []
    for _ in range(n):
        seq = ids + out
        logits = np.asarray(forward(state, jnp.asarray(seq + [0] * (pad - len(seq)))))
        out.append(int(np.argmax(logits[len(seq) - 1])))
    return out


@pytest.mark.parametrize("padding", [None, 32])
def test_run_streams_the_greedy_continuation(folder, padding):
    """The default windows (from 256 cells) and windows from 32 cells give the uncached greedy tokens."""
    out, err = io.StringIO(), io.StringIO()
    extra = {} if padding is None else dict(padding=padding)
    report = _generate.run(folder, "the lazy dog", max_new_tokens=6, ctx=64, out=out, err=err, **extra)
    model = kvjax.nn.from_pretrained(folder)
    tok = Tokenizer.from_pretrained(folder)
    ids = tok.encode("the lazy dog")
    want = _greedy(model, ids, 6)
    want = want[: want.index(1) + 1] if 1 in want else want  # stops after EOS
    assert report.tokens == [want] and report.prompt_tokens == len(ids)
    text = out.getvalue()
    assert text.startswith("the lazy dog") and text.rstrip("\n") == "the lazy dog" + tok.decode(want)
    log = err.getvalue()
    assert "load " in log and "compile " in log and "prompt: " in log and "generated: " in log
    assert f"windows from {padding or _generate.DEFAULT_PADDING} cells" in log
    assert report.prompt_tokens_per_second > 0 and report.tokens_per_second > 0 and report.load_seconds > 0


def test_run_parallel_sequences_and_quantized_cache(folder):
    out, err = io.StringIO(), io.StringIO()
    report = _generate.run(
        folder,
        "quick brown",
        n_parallel=3,
        max_new_tokens=5,
        temperature=1.0,
        seed=3,
        cache_type="float16",
        ctx=32,
        out=out,
        err=err,
    )
    assert len(report.tokens) == 3 and len(report.texts) == 3
    text = out.getvalue()
    assert "[1] quick brown" in text and "[2] quick brown" in text
    assert "3 sequences" in err.getvalue()


@pytest.mark.parametrize("kv_unified", [False, True])
def test_parallel_greedy_continuations_on_streams_and_one_buffer(folder, kv_unified):
    """``--n-parallel`` uses a stream per sequence by default (llama.cpp's), one shared buffer with
    ``--kv-unified``; greedy, every sequence is the uncached continuation, a context shift included."""
    err = io.StringIO()
    report = _generate.run(
        folder,
        "the lazy dog",
        n_parallel=3,
        max_new_tokens=12,
        ctx=16,
        kv_unified=kv_unified,
        out=io.StringIO(),
        err=err,
    )
    assert ("memory: CacheConfig" if kv_unified else "memory: StreamsConfig") in err.getvalue()
    assert "context shift" in err.getvalue()
    assert report.tokens[0] == report.tokens[1] == report.tokens[2]
    ids = Tokenizer.from_pretrained(folder).encode("the lazy dog")
    n_free = 16 - len(ids)  # tokens before the first shift: those equal the uncached greedy ones
    want = _greedy(kvjax.nn.from_pretrained(folder), ids, n_free)
    got = report.tokens[0][:n_free]
    assert got == want[: len(got)]


def test_sink_window_generates_past_its_cells(folder):
    """``--sink-window 2,14``: greedy runs 28 tokens in 16 cells (to its EOS), the tokens of
    ``kvjax.generate`` with the same
    :class:`kvjax.SinkWindow` (whose steps are proven against recomputing over the kept tokens in
    tests/test_sink_window.py), on a memory of 16 cells whatever ``--ctx`` says."""
    err = io.StringIO()
    report = _generate.run(
        folder,
        "the lazy dog",
        max_new_tokens=60,
        temperature=0.0,
        seed=1,
        ctx=8,
        sink_window=(2, 14),
        padding=16,
        out=io.StringIO(),
        err=err,
    )
    model = kvjax.nn.from_pretrained(folder)
    kvjax.nn.fuse_projections(model)
    ids = Tokenizer.from_pretrained(folder).encode("the lazy dog")
    memory = kvjax.init(kvjax.nn._pretrained.memory_config_for(model, size=16, n_seq_max=1, padding=16))
    want = kvjax.generate(
        kvjax.Engine(model, memory, n_ubatch=64),
        [ids],
        max_new_tokens=60,
        key=jax.random.PRNGKey(1),
        stop_tokens=[1],
        window=kvjax.SinkWindow(2, 14),
        sampling=kvjax.SamplingConfig(temperature=0.0),
    )
    assert report.tokens == want.tokens and len(report.tokens[0]) + len(ids) > 2 * 16
    assert "16 positions x 1 sequences" in err.getvalue()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_parallel=0), r"--n-parallel 0 is out of range: allowed an integer in \[1, 64\]"),
        (dict(max_new_tokens=0), r"--max-new-tokens 0 is out of range: allowed an integer >= 1"),
        (dict(temperature=-1.0), r"--temperature -1.0 is out of range: allowed a number >= 0"),
        (dict(cache_type="int4"), r"--cache-type 'int4' is out of range: allowed one of \['float32'"),
        (dict(dtype="float64"), r"--dtype 'float64' is out of range"),
        (dict(ctx=1), r"--ctx 1 is out of range: allowed an integer >= 2"),
        (dict(ctx=3), r"--ctx 3 is out of range for a prompt of \d+ tokens"),
        (dict(padding=0), r"--padding 0 is out of range: allowed an integer >= 1"),
        (dict(padding=True), r"--padding True is out of range: allowed an integer >= 1"),
        (dict(kv_unified=1), r"--kv-unified 1 is out of range: allowed True or False"),
        (dict(prompt=""), r"--prompt '' is out of range: allowed a non-empty text"),
        (
            dict(sink_window=(2, 0)),
            r"--sink-window \(2, 0\) is out of range: allowed N_SINK,N_RECENT with N_RECENT >= 1",
        ),
        (
            dict(sink_window=(1, 2)),
            r"--sink-window 1,2 is out of range for a prompt of \d+ tokens: allowed N_SINK \+ "
            r"N_RECENT >= \d+",
        ),
        (dict(sink_window=(2, 8), cache_ram=4), r"--sink-window is out of range with --cache-ram"),
    ],
)
def test_run_bad_arguments(folder, kwargs, match):
    args = dict(prompt="the lazy dog jumps over")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _generate.run(folder, args.pop("prompt"), out=io.StringIO(), err=io.StringIO(), **args)


def test_bad_model_paths(tmp_path):
    with pytest.raises(ValueError, match=r"--model '.*nowhere' does not exist"):
        _generate.load(tmp_path / "nowhere")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match=r"is a file: allowed a Hugging Face checkpoint folder or a .gguf file"):
        _generate.load(tmp_path / "weights.bin")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="GGUF"):
        _generate.load(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"--dtype 'file' keeps a .gguf file's block types: allowed for a .gguf"):
        _generate.load(tmp_path, "file")


@pytest.mark.parametrize("qtype, dtype", [("F32", "float32"), ("Q8_0", "file")])
def test_a_gguf_file_generates_like_its_weights(tmp_path, qtype, dtype):
    """A GGUF file holding a kvjax model's weights and a byte-level BPE vocabulary: the command's
    greedy continuation is the model's own (llama.cpp's RoPE convention inside the file), with the
    weights converted at load or kept in the file's blocks (``--dtype file``)."""
    gguf = pytest.importorskip("gguf")
    from tests.test_gguf import _kvjax_model, _kvjax_sd, _trained_bpe, write_gguf

    tok = _trained_bpe("llama-bpe")
    vocab = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    model = _kvjax_model("llama")
    sd = _kvjax_sd(model)
    n = len(vocab)  # the model's vocabulary grows to the tokenizer's (new rows random, the old ones kept)
    extra = np.random.default_rng(0).normal(size=(n - sd["model.embed_tokens.weight"].shape[0], 64)).astype(np.float32)
    sd["model.embed_tokens.weight"] = np.concatenate([sd["model.embed_tokens.weight"], extra])
    sd["lm_head.weight"] = np.concatenate([sd["lm_head.weight"], extra])
    path = write_gguf(
        tmp_path / "m.gguf",
        "llama",
        sd,
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=10000.0,
        extra_kv={
            "add_tokenizer_model": "gpt2",
            "add_tokenizer_pre": "llama-bpe",
            "add_token_list": vocab,
            "add_token_merges": merges,
            "add_token_types": [3 if t in ("<|begin|>", "<|end|>") else 1 for t in vocab],
            "add_bos_token_id": vocab.index("<|begin|>"),
            "add_eos_token_id": vocab.index("<|end|>"),
            "add_add_bos_token": True,
        },
        qtype=gguf.GGMLQuantizationType[qtype],
    )
    out, err = io.StringIO(), io.StringIO()
    report = _generate.run(path, "The quick brown", max_new_tokens=5, ctx=64, out=out, err=err, dtype=dtype)
    assert ("weights in the file's Q8_0;" in err.getvalue()) == (dtype == "file")
    loaded = kvjax.nn.from_gguf(path, dtype=None if dtype == "file" else jnp.float32)
    ids = Tokenizer.from_gguf(path).encode("The quick brown")
    assert ids[0] == vocab.index("<|begin|>") and report.prompt_tokens == len(ids)
    want = _greedy(loaded, ids, 5)
    want = want[: want.index(vocab.index("<|end|>")) + 1] if vocab.index("<|end|>") in want else want
    assert report.tokens == [want]
    assert out.getvalue().startswith("The quick brown")


def test_command_line(folder):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p))
    cmd = [
        sys.executable,
        "-m",
        "kvjax",
        "--no-compile-cache",
        "generate",
        "--model",
        str(folder),
        "--prompt",
        "the lazy dog",
        "--max-new-tokens",
        "4",
        "--ctx",
        "32",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("the lazy dog")
    assert "tokens/s" in done.stderr and "compile " in done.stderr
    bad = subprocess.run(cmd[:-2] + ["--ctx", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "error: --ctx 2 is out of range" in bad.stderr
    bad = subprocess.run(cmd + ["--sink-window", "4"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "--sink-window: '4' is out of range: allowed N_SINK,N_RECENT" in bad.stderr
