"""A session moves between llama.cpp and kvjax, on files llama.cpp wrote (no llama.cpp needed).

``tests/data/sessions/`` holds two tiny GGUF models (a Llama; a Gemma 3 with sliding-window
layers: the iSWA memory), the session and sequence files llama.cpp saved after evaluating prompts
with them (F16 and Q8_0 K/V, V transposed and not, several sequences sharing a prefix, one stream
per sequence), and the greedy tokens llama.cpp chose after loading each file into a fresh context
(``scripts/make_session_fixtures.py`` wrote them). Here kvjax

- loads each file into the memory a user would make for the model, continues generation and
  chooses llama.cpp's greedy tokens (teacher-forced: at every step llama.cpp's token is kvjax's
  best, or within :data:`NEAR_TIE` of it where one of the two programs saw a near tie);
- writes the memory it read back out, byte for byte the file llama.cpp wrote;
- evaluates the same prompts itself and writes a file whose cells equal llama.cpp's and whose K/V
  are llama.cpp's within float noise (so llama.cpp can continue from kvjax's file: shown against
  llama.cpp itself in ``test_kvjax_files_continue_in_llama_cpp``, which runs only where
  llama-cpp-python is installed);
- refuses a file of another model or of another memory layout before anything changes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import struct

import numpy as np
import pytest

import kvjax
from kvjax._errors import StateError

DATA = pathlib.Path(__file__).parent / "data" / "sessions"
FIXTURES = json.loads((DATA / "cases.json").read_text())
CASES = sorted(FIXTURES["cases"])
SEQ_CASES = sorted(name for name in CASES if "seq" in FIXTURES["cases"][name])
#: llama.cpp's best two tokens closer than this are a near tie: rounding decides them (llama.cpp
#: multiplies F16 weights with activations rounded to F16, kvjax in float32). With Q8_0 K/V
#: llama.cpp's flash attention also rounds each query to Q8_0 blocks for its dot products.
NEAR_TIE = {"f16": 0.05, "q8_0": 0.2}


@functools.lru_cache(maxsize=None)
def model_of(name: str):
    from kvjax.nn import from_gguf

    return from_gguf(DATA / f"tiny-{name}.gguf")


def memory_config(case: dict):
    """The memory a user makes for the llama.cpp context the case ran on."""
    from kvjax.nn import memory_config_for

    opts = case["options"]
    kv = {"f16": "float16", "q8_0": "q8_0"}[opts["kv_type"]]
    model = model_of(case["model"])
    overrides = dict(k_dtype=kv, v_dtype=kv, v_trans=not opts["flash_attn"], padding=256)
    if not opts["kv_unified"]:  # llama.cpp's n_ctx is shared out: n_ctx / n_seq cells per stream
        per_stream = memory_config_for(
            model,
            size=opts["n_ctx"] // opts["n_seq"],
            n_seq_max=opts["n_seq"],
            **dict(overrides, padding=opts["n_ctx"] // opts["n_seq"]),
        )
        return kvjax.StreamsConfig(per_stream)
    return memory_config_for(model, size=opts["n_ctx"], n_seq_max=opts["n_seq"], **overrides)


def engine_for(case: dict) -> kvjax.Engine:
    return kvjax.Engine(model_of(case["model"]), kvjax.init(memory_config(case)), n_ubatch=64)


def continue_forced(engine: kvjax.Engine, histories, seq_ids, want, gaps, near_tie: float) -> int:
    """Continue every sequence on llama.cpp's tokens ``want``; return the steps where kvjax chose them too.

    The last token of each history is evaluated again (a session file holds no logits), then one
    token per sequence per step. At every step llama.cpp's token must be kvjax's best or within
    ``near_tie`` of it (float rounding in another order decides a near tie), and where llama.cpp's
    own margin was wider than ``near_tie`` kvjax must choose it.
    """
    for h, s in zip(histories, seq_ids):
        engine.rollback(s, len(h) - 1)
    logits = engine.decode([h[-1] for h in histories], [len(h) - 1 for h in histories], [[s] for s in seq_ids])
    same = 0
    for step in range(len(want[0])):
        rows = np.asarray(logits, np.float64)
        for i in range(len(seq_ids)):
            best, theirs = int(np.argmax(rows[i])), want[i][step]
            short = rows[i, best] - rows[i, theirs]
            where = f"sequence {seq_ids[i]}, step {step}: kvjax chose {best}, llama.cpp {theirs}"
            assert short <= near_tie, (
                f"{where}: {short:.3f} below kvjax's best (llama.cpp's margin {gaps[i][step]:.3f})"
            )
            assert best == theirs or gaps[i][step] < 2 * near_tie, f"{where} (llama.cpp's margin {gaps[i][step]:.3f})"
            same += best == theirs
        logits = engine.decode([w[step] for w in want], [len(h) + step for h in histories], [[s] for s in seq_ids])
    return same


@pytest.mark.parametrize("name", CASES)
def test_a_llama_cpp_session_continues_in_kvjax(name):
    case = FIXTURES["cases"][name]
    engine = engine_for(case)
    tokens = engine.load_session(DATA / f"{name}.session")
    assert tokens.tolist() == case["prompts"][0]
    for s, prompt in enumerate(case["prompts"]):
        assert int(kvjax.seq_pos_max(engine.cache, s)) == len(prompt) - 1
    got = case["session"]
    checked = continue_forced(
        engine,
        case["prompts"],
        list(range(len(case["prompts"]))),
        got["tokens"],
        got["gaps"],
        NEAR_TIE[case["kv_type"]],
    )
    assert checked >= 0.75 * FIXTURES["n_new"] * len(case["prompts"])


def _rotated(case: dict) -> bool:
    """Whether llama.cpp stored this case's K/V in its rotated basis (quantized, heads of 64k values)."""
    from kvjax.io._attn_rot import rotation_sizes

    cfg = memory_config(case)
    parts = (
        [cfg.base, cfg.swa_config]
        if isinstance(cfg, kvjax.IswaConfig)
        else [cfg.base]
        if isinstance(cfg, kvjax.StreamsConfig)
        else [cfg]
    )
    return any(any(rotation_sizes(c)) for c in parts)


@pytest.mark.parametrize("name", CASES)
def test_kvjax_writes_back_the_bytes_llama_cpp_wrote(name, tmp_path):
    case = FIXTURES["cases"][name]
    files = [(f"{name}.session", None)] + ([(f"{name}.seq", case["seq"]["src"])] if "seq" in case else [])
    # rotated quantized K/V pass through kvjax's unrotated storage with one re-quantization each
    # way (checked below); taken as they are (attn_rot=False) every byte comes back
    for attn_rot in (False, True) if _rotated(case) else (True,):
        engine = engine_for(case)
        tokens = engine.load_session(DATA / f"{name}.session", attn_rot=attn_rot)
        for file, seq in files:
            again = tmp_path / file
            if seq is None:
                engine.save_session(again, tokens, attn_rot=attn_rot)
            else:
                engine.save_sequence(again, seq, case["prompts"][seq], attn_rot=attn_rot)
            if not attn_rot or not _rotated(case):
                assert again.read_bytes() == (DATA / file).read_bytes()
                continue
            mine, theirs = again.read_bytes(), (DATA / file).read_bytes()
            assert len(mine) == len(theirs)
            read = lambda data: kvjax.session_read(kvjax.init(memory_config(case)), data, attn_rot=False).cache  # noqa: E731
            if seq is None:
                for a, b in zip(_cells_and_kv(read(mine)), _cells_and_kv(read(theirs))):
                    assert set(a) == set(b)
                    for key in a:
                        for x, y in zip(a[key], b[key]):  # within two Q8_0 steps of llama.cpp's values
                            np.testing.assert_allclose(x, y, rtol=0, atol=2.5 * np.abs(y).max() / 127)


@pytest.mark.parametrize("name", SEQ_CASES)
def test_a_llama_cpp_sequence_file_joins_a_busy_kvjax_memory(name):
    """llama_state_seq_save_file's file read into another sequence id beside a sequence kvjax evaluated."""
    case = FIXTURES["cases"][name]
    seq = case["seq"]
    engine = engine_for(case)
    other = seq["other"]
    engine.decode(other, list(range(len(other))), [[0]] * len(other))
    before = kvjax.state_write(engine.cache, 0)
    held = engine.load_sequence(DATA / f"{name}.seq", seq["dest"])
    assert held.tolist() == case["prompts"][seq["src"]]
    assert kvjax.state_write(engine.cache, 0) == before  # the other sequence is untouched
    checked = continue_forced(
        engine, [held.tolist()], [seq["dest"]], [seq["tokens"]], [seq["gaps"]], NEAR_TIE[case["kv_type"]]
    )
    assert checked >= 0.75 * FIXTURES["n_new"]


def _evaluate(engine: kvjax.Engine, case: dict) -> None:
    """The prompts as llama.cpp evaluated them: a shared prefix once in sequence 0, copied, then the rest."""
    from benchmarks.bench_sessions import evaluate_prompts

    evaluate_prompts(engine, case["prompts"], case.get("shared", 0))


def _cells_and_kv(memory):
    """Per unified part: ``{(pos, seq id): (K [L, H, D], V [L, H, Dv])}`` of each cell's every sequence."""
    parts = (
        [memory.base, memory.swa]
        if isinstance(memory, kvjax.IswaCache)
        else [memory.stream(s) for s in range(memory.config.n_stream)]
        if isinstance(memory, kvjax.StreamCache)
        else [memory]
    )
    out = []
    for part in parts:
        table = kvjax.cell_table(part)
        layers = [kvjax.view(part, il, part.size) for il in part.config.cached_layers]
        k = np.stack([np.asarray(x, np.float32) for x, _ in layers])  # [L, H, C, D]
        v = np.stack([np.asarray(y, np.float32) for _, y in layers])
        out.append(
            {
                (int(table.pos[c]), int(s)): (k[:, :, c], v[:, :, c])
                for c in np.flatnonzero(table.pos >= 0)
                for s in np.flatnonzero(table.seqs[c])
            }
        )
    return out


@pytest.mark.parametrize("name", CASES)
def test_kvjax_writes_the_file_llama_cpp_wrote_for_the_same_prompts(name, tmp_path):
    case = FIXTURES["cases"][name]
    engine = engine_for(case)
    _evaluate(engine, case)
    engine.save_session(tmp_path / "kvjax.session", case["prompts"][0])
    mine = (tmp_path / "kvjax.session").read_bytes()
    theirs = (DATA / f"{name}.session").read_bytes()
    head = 12 + 4 * len(case["prompts"][0]) + 4 + len(case["model"])
    assert mine[:head] == theirs[:head]  # magic, version 10, tokens, architecture
    read = lambda data: kvjax.session_read(kvjax.init(memory_config(case)), data).cache
    for p, (a, b) in enumerate(zip(_cells_and_kv(read(mine)), _cells_and_kv(read(theirs)))):
        if p == 1 and case["model"] == "gemma3":
            # llama.cpp's window cache keeps masked cells until they are overwritten; kvjax frees
            # them (for each sequence): kvjax holds what a next token sees, and llama.cpp holds it too
            assert set(a) <= set(b) and len(a) >= 8 * len(case["prompts"])
        else:
            assert set(a) == set(b)
        quantized = case["options"]["kv_type"] == "q8_0"
        for key in a:
            for x, y in zip(a[key], b[key]):  # [L, H, D] of one cell
                for il in range(len(x)):
                    scale = np.abs(y[il]).max()
                    # the first cached layer's K/V depend on the embedding alone: they agree to the
                    # F16 rounding of llama.cpp's activations (plus one Q8_0 step when quantized);
                    # deeper layers carry the differences of the attention before them
                    tol = (0.01 + (2 / 127 if quantized else 0)) * scale if il == 0 else 0.05 * scale
                    np.testing.assert_allclose(x[il], y[il], rtol=0, atol=tol, err_msg=f"part {p} {key} layer {il}")


def test_a_file_of_another_model_is_refused_and_nothing_changes(tmp_path):
    llama = FIXTURES["cases"]["llama-f16-vtrans"]
    gemma = FIXTURES["cases"]["gemma3-f16-vtrans"]
    engine = engine_for(llama)
    _evaluate(engine, llama)
    before = kvjax.state_write(engine.cache)
    # the Gemma's file names another architecture
    with pytest.raises(StateError, match="session file arch: expected 'llama'.*found 'gemma3'"):
        engine.load_session(DATA / "gemma3-f16-vtrans.session")
    # ... and, named as ours, holds a section per cache of the pair: layer counts that differ
    data = (DATA / "gemma3-f16-vtrans.session").read_bytes()
    head = 12 + 4 * len(gemma["prompts"][0])
    forged = data[:head] + struct.pack("<I", 5) + b"llama" + data[head + 4 + 6 :]
    with pytest.raises(StateError, match="n_layer"):
        engine.load_session(forged)
    # Q8_0 K/V into an F16 memory: the type is named, with the dtype to make the memory with
    with pytest.raises(StateError, match="K type: expected 1 \\(F16\\), found 8 \\(Q8_0\\).*k_dtype='q8_0'"):
        engine.load_session(DATA / "llama-q8_0.session")
    # a memory too small for the file's cells
    small = kvjax.Engine(engine.model, kvjax.init(dataclasses.replace(memory_config(llama), size=16, padding=16)))
    with pytest.raises(StateError, match="cell"):
        small.load_session(DATA / "llama-f16-vtrans.session")
    # the sequence file of another memory kind's model into this one: refused by its rows
    with pytest.raises(StateError):
        engine.load_sequence(DATA / "gemma3-shared.seq", 0)
    assert kvjax.state_write(engine.cache) == before
    # a truncated file
    with pytest.raises(StateError, match="truncated"):
        engine.load_session((DATA / "llama-f16-vtrans.session").read_bytes()[:-7])
    assert kvjax.state_write(engine.cache) == before


def test_a_loaded_session_parked_in_a_prompt_cache_continues_with_generate():
    """The user's way: load, park, and generate with the same prompt: only the last token is evaluated."""
    import jax

    case = FIXTURES["cases"]["llama-f16-rows"]
    engine = engine_for(case)
    pc = kvjax.PromptCache(n_seq_max=1, max_tokens=256)
    tokens = engine.load_session(DATA / "llama-f16-rows.session", prompt_cache=pc)
    out = kvjax.generate(
        engine,
        [tokens.tolist()],
        max_new_tokens=16,
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=0),
        prompt_cache=pc,
    )
    assert out.prompt_tokens == 1
    want, gaps = case["session"]["tokens"][0], case["session"]["gaps"][0]
    first_tie = next((i for i, g in enumerate(gaps) if g < NEAR_TIE["f16"]), len(gaps))
    n = min(16, first_tie + 1)
    assert out.tokens[0][:n] == want[:n]


# -- kvjax -> llama.cpp, against llama.cpp itself (only where llama-cpp-python is installed) ---------


def _shift(engine: kvjax.Engine, history, n_keep: int, n_discard: int):
    engine.context_shift(0, n_keep, n_discard)
    return history[:n_keep] + history[n_keep + n_discard :]


@pytest.mark.parametrize(
    "name, shift", [(n, False) for n in CASES] + [("llama-f16-vtrans", True), ("gemma3-f16-vtrans", True)]
)
def test_kvjax_files_continue_in_llama_cpp(name, shift, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is the oracle here; CI runs without it")
    from benchmarks.llamacpp_context import LlamaCppContext

    case = FIXTURES["cases"][name]
    engine = engine_for(case)
    _evaluate(engine, case)
    histories = [list(p) for p in case["prompts"]]
    if shift:  # a context shift: its K-shift is applied before the file is written
        histories[0] = _shift(engine, histories[0], 4, 6)
    engine.save_session(tmp_path / "kvjax.session", histories[0])
    if "seq" in case:
        engine.save_sequence(tmp_path / "kvjax.seq", case["seq"]["src"], histories[case["seq"]["src"]])
    seqs = list(range(len(histories)))
    ctx = LlamaCppContext(str(DATA / f"tiny-{case['model']}.gguf"), **case["options"])
    try:
        assert ctx.load_session(tmp_path / "kvjax.session") == histories[0]
        theirs, gaps = ctx.continue_greedy(histories, seqs, 32)
    finally:
        ctx.close()
    reader = engine_for(case)
    reader.load_session(tmp_path / "kvjax.session")
    checked = continue_forced(reader, histories, seqs, theirs, gaps, NEAR_TIE[case["kv_type"]])
    assert checked >= 0.75 * 32 * len(seqs)
    if "seq" in case:
        busy = LlamaCppContext(str(DATA / f"tiny-{case['model']}.gguf"), **case["options"])
        try:
            other = case["seq"]["other"]
            busy.decode(other, list(range(len(other))), [[0]] * len(other))
            dest = case["seq"]["dest"]
            held = busy.load_sequence(tmp_path / "kvjax.seq", dest)
            theirs, gaps = busy.continue_greedy([held], [dest], 32)
        finally:
            busy.close()
        reader = engine_for(case)
        reader.load_sequence(tmp_path / "kvjax.seq", dest)
        assert continue_forced(reader, [held], [dest], theirs, gaps, NEAR_TIE[case["kv_type"]]) >= 0.75 * 32


def test_the_docs_worked_example_runs(capsys, monkeypatch):
    """docs/sessions.md's blocks run in order; llama.cpp's blocks only where it is installed (else
    the committed file llama.cpp wrote stands in for the one its block would write)."""
    import importlib.util
    import re

    monkeypatch.chdir(DATA.parent.parent.parent)
    doc = (DATA.parent.parent.parent / "docs" / "sessions.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 4
    have_llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    namespace = (
        {}
        if have_llama_cpp
        else {"MODEL": "tests/data/sessions/tiny-llama.gguf", "FILE": str(DATA / "llama-f16-vtrans.session")}
    )
    for block in blocks:
        if block.startswith("# needs llama-cpp-python") and not have_llama_cpp:
            continue
        if not have_llama_cpp:  # the example writes next to the file it read: keep the fixtures clean
            block = block.replace('BACK = FILE + ".back"', 'BACK = str(pathlib.Path(tempfile.mkdtemp()) / "back")')
            namespace.update(pathlib=pathlib, tempfile=__import__("tempfile"))
        exec(compile(block, "docs/sessions.md", "exec"), namespace)
    assert capsys.readouterr().out.split() == ["1", "8"]


def test_bad_arguments_are_named_and_nothing_changes(tmp_path):
    from flax import nnx

    from kvjax.nn import Llama, LlamaConfig

    case = FIXTURES["cases"]["llama-f16-vtrans"]
    engine = engine_for(case)
    _evaluate(engine, case)
    before = kvjax.state_write(engine.cache)
    out = tmp_path / "out"
    bad = [
        (lambda: engine.save_session(out, [[1, 2]]), ValueError, "tokens has shape"),
        (
            lambda: engine.save_session(out, [1], version=8),
            ValueError,
            r"version=8 is out of range for a session file: allowed one of \[9, 10\]",
        ),
        (lambda: engine.save_session(out, [1], v_trans="no"), ValueError, "v_trans='no' is out of range: allowed None"),
        (lambda: engine.save_session(out, [1], attn_rot=None), ValueError, "attn_rot=None is out of range"),
        (lambda: engine.save_session(out, [1], arch=""), ValueError, "arch='' is out of range"),
        (lambda: engine.save_sequence(out, 5, [1]), ValueError, r"seq_id=5 is out of range: allowed -1 .* or \[0, 1\)"),
        (lambda: engine.save_sequence(out, -1, [1]), ValueError, "seq_id=-1 is out of range for a sequence file"),
        (lambda: engine.save_sequence(out, 0, [1], version=4), ValueError, "version=4 is out of range for a sequence"),
        (lambda: engine.load_sequence(DATA / "llama-shared.seq", 7), ValueError, "seq_id=7 is out of range"),
        (lambda: engine.load_session(12), ValueError, "data must be bytes or a file path, got int"),
        (
            lambda: engine.load_session(DATA / "llama-f16-vtrans.session", arch="gemma3"),
            StateError,
            "expected 'gemma3'",
        ),
        (lambda: engine.load_session(DATA / "llama-shared.seq"), StateError, "session file magic: expected 0x6767736e"),
        (lambda: engine.load_sequence(DATA / "llama-shared.session", 0), StateError, "sequence file magic"),
    ]
    for call, kind, match in bad:
        with pytest.raises(kind, match=match):
            call()
        assert kvjax.state_write(engine.cache) == before and not out.exists()
    # a model that did not come from a GGUF file has no architecture name to write
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)
    plain = kvjax.Engine(Llama(cfg, rngs=nnx.Rngs(0)), kvjax.init(cfg.cache_config(size=32, n_seq_max=1)))
    with pytest.raises(ValueError, match="arch=None is out of range for a model that was not loaded from a GGUF"):
        plain.save_session(out, [1])
    plain.save_session(out, [], arch="llama")
    assert kvjax.session_read(plain.cache, out, arch="llama").tokens.size == 0


def test_loading_another_file_recompiles_nothing(tmp_path):
    """The memory keeps its own config whatever the file's V layout, so the engine's compiled
    steps serve every loaded session; the reader compiles once per cell-count bucket."""
    rows = FIXTURES["cases"]["llama-f16-rows"]
    engine = engine_for(rows)
    prompt = rows["prompts"][0]

    def load_and_step(name):
        engine.load_session(DATA / f"{name}.session")
        engine.rollback(0, len(prompt) - 1)
        return np.asarray(engine.decode(prompt[-1:], [len(prompt) - 1], [[0]]))

    first = load_and_step("llama-f16-vtrans")  # compiles the step, and the reader of each layout
    load_and_step("llama-f16-rows")
    shorter, _ = kvjax.seq_rm(engine.cache, 0, 17, -1)  # 17 and 20 cells: one power-of-two bucket
    kvjax.session_save_file(tmp_path / "short.session", shorter, prompt[:17], arch="llama")
    with kvjax.CompileCounter() as compiles:
        again = load_and_step("llama-f16-rows")
        load_and_step("llama-f16-vtrans")
        engine.load_session(tmp_path / "short.session")  # another file, fewer cells
    assert compiles.count == 0
    # one file written in the other V layout holds the same K/V: the same logits
    engine.load_session(DATA / "llama-f16-vtrans.session")
    engine.save_session(tmp_path / "as_rows.session", prompt, v_trans=False)
    assert (tmp_path / "as_rows.session").read_bytes() != (DATA / "llama-f16-vtrans.session").read_bytes()
    engine.load_session(tmp_path / "as_rows.session")
    engine.rollback(0, len(prompt) - 1)
    np.testing.assert_array_equal(np.asarray(engine.decode(prompt[-1:], [len(prompt) - 1], [[0]])), first)
    assert not np.array_equal(again, first)  # llama.cpp's two contexts computed slightly other K/V
