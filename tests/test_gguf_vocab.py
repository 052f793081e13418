"""GGUF vocabularies tokenize and detokenize exactly as llama.cpp does.

The fixtures under ``tests/data/vocab/`` are llama.cpp's own answers (recorded by
``scripts/make_vocab_fixtures.py`` through llama-cpp-python) for the tiny vocabularies of
``tests/vocab_fixtures.py`` (SentencePiece with and without a space prefix, byte-level BPE under
many ``tokenizer.ggml.pre`` kinds) and for the real Gemma 3 270M file: ids with special-token
parsing off and on, with and without the BOS/EOS llama.cpp adds, detokenization skipping and
rendering special tokens, the end-of-generation ids. The tests write the same tiny files again
(the vocabulary's digest is checked against the one recorded) and compare every text. Also:
round trips, streaming decoding with characters split over byte tokens, chat templates, and bad
vocabularies refused before anything is built.
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("tokenizers")

from kvjax.nn import Tokenizer  # noqa: E402
from kvjax.nn._gguf_vocab import BPE_PRE_KINDS, gguf_tokenizer  # noqa: E402
from tests.vocab_fixtures import TEXTS, vocab_digest, vocab_names, write_vocab  # noqa: E402

DATA = pathlib.Path(__file__).parent / "data" / "vocab"
MODES = (("ids", False, False), ("ids_special", False, True), ("ids_add", None, False), ("ids_add_special", None, True))


def _fixture(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("vocab")


def _tokenizer(name: str, folder: pathlib.Path) -> Tokenizer:
    path = folder / f"{name}.gguf"
    if not path.exists():
        write_vocab(name, path)
    return Tokenizer.from_gguf(path)


def _mismatches(tok: Tokenizer, data: dict):
    """Each case where kvjax and llama.cpp differ: (text, what, llama.cpp's, kvjax's)."""
    bad = []
    bos, eos = [data["bos"]] * data["add_bos"], [data["eos"]] * data["add_eos"]
    for case in data["cases"]:
        text = case["text"]
        # what the files leave out: ids_special when it is ids, ids_add* when BOS + ids + EOS
        special_ids = case.get("ids_special", case["ids"])
        case = {
            "ids_special": special_ids,
            "ids_add": bos + case["ids"] + eos,
            "ids_add_special": bos + special_ids + eos,
            **case,
        }
        for key, add, special in MODES:
            # add None: what llama.cpp's add_special adds (BOS / EOS as the vocabulary says)
            ids = tok.encode(text, add_bos=add, add_eos=add, special=special)
            if ids != case[key]:
                bad.append((text, key, case[key], ids))
            for mode, skip in (("skip", True), ("render", False)):
                want = case.get(f"{key}:{mode}", text)
                got = tok.decode(case[key], skip_special=skip)
                if got != want:
                    bad.append((text, f"{key}:{mode}", want, got))
    return bad


@pytest.mark.parametrize("name", vocab_names())
def test_equals_llama_cpp_on_the_fixture_vocabularies(name, vocab_dir):
    data = _fixture(name)
    assert data["vocab_sha256"] == vocab_digest(name), "the fixture vocabulary changed: rerun the script"
    assert [c["text"] for c in data["cases"]] == TEXTS, "the fixture texts changed: rerun the script"
    tok = _tokenizer(name, vocab_dir)
    assert tok.vocab_size == data["n_vocab"]
    assert (tok.bos_id, tok.add_bos, tok.add_eos) == (data["bos"], data["add_bos"], data["add_eos"])
    assert list(tok.backend.eog_ids) == data["eog"] and sorted(tok.eos_ids) == data["eog"]
    assert tok.eos_ids[0] == data["eos"]
    assert _mismatches(tok, data) == []


def test_equals_llama_cpp_on_the_real_gemma_file(real_gemma_gguf):
    data = _fixture("real-gemma3-270m")
    tok = Tokenizer.from_gguf(real_gemma_gguf)
    assert tok.vocab_size == data["n_vocab"] == 262144
    assert (tok.bos_id, tok.add_bos, tok.add_eos) == (data["bos"], data["add_bos"], data["add_eos"])
    assert list(tok.backend.eog_ids) == data["eog"]
    assert tok.token_text(tok.eos_ids[0]) == "<eos>" and "<end_of_turn>" in {tok.token_text(i) for i in tok.eos_ids}
    assert _mismatches(tok, data) == []
    stream = tok.stream()
    ids = tok.encode("emoji 🙂 日本語 naïve", special=True)
    assert "".join(stream.push(i) for i in ids) + stream.flush() == tok.decode(ids)


def test_the_fixture_vocabularies_are_written_the_same_every_time(tmp_path):
    for name in ("spm", "bpe-llama-bpe"):
        a, b = write_vocab(name, tmp_path / "a.gguf").read_bytes(), write_vocab(name, tmp_path / "b.gguf").read_bytes()
        assert a == b


def test_every_pre_kind_builds(tmp_path):
    from tests.vocab_fixtures import write_bpe

    for pre in sorted(BPE_PRE_KINDS):
        tok = Tokenizer.from_gguf(write_bpe(tmp_path / f"{pre}.gguf", pre))
        text = "Hello world 12345 naïve 日本 🙂\n  x"
        assert tok.decode(tok.encode(text)) == text, pre


def test_round_trip(vocab_dir):
    # no space prefix and no clean-up of spaces: every text comes back exactly
    for name in ("spm-noprefix", "bpe-qwen2", "bpe-gpt-4o"):
        tok = _tokenizer(name, vocab_dir)
        for text in TEXTS:
            if name.startswith("spm") and "\u2581" in text:
                continue  # SentencePiece writes spaces as U+2581: a literal one comes back as a space
            ids = tok.encode(text)
            assert tok.decode(ids) == text, (name, text)
            assert (
                tok.decode(ids, skip_special=False)
                .replace(tok.token_text(tok.bos_id), "", 1)
                .removesuffix(tok.token_text(tok.eos_ids[0]) if tok.add_eos else "")
                == text
            )


def test_special_tokens_parsed_only_when_asked(vocab_dir):
    spm = _tokenizer("spm", vocab_dir)
    turn = spm.backend.token_to_id("<start_of_turn>")
    text = "<start_of_turn>user\nhi<end_of_turn>"
    parsed = spm.encode(text, add_bos=False, special=True)
    assert parsed[0] == turn and parsed[-1] == spm.backend.token_to_id("<end_of_turn>")
    literal = spm.encode(text, add_bos=False)
    assert turn not in literal and len(literal) > len(parsed)
    # control tokens vanish when skipped, come out as their text when rendered; literal text stays text
    # the space prefix put after a special token stays (llama.cpp drops only the text's first one)
    assert spm.decode(parsed) == " user\nhi"
    assert spm.decode(parsed, skip_special=False) == "<start_of_turn> user\nhi<end_of_turn>"
    assert spm.decode(literal) == text
    # after a BOS the first space stays too, as llama.cpp decodes
    assert spm.decode(spm.encode("hi")) == " hi" and spm.decode(spm.encode("hi", add_bos=False)) == "hi"
    # a user-defined token is cut out of the text either way
    mask = spm.backend.token_to_id("<mask>")
    assert mask in spm.encode("a<mask>b") and mask in spm.encode("a<mask>b", special=True)
    # the space prefix goes in front of the text and of each text after a special token
    assert spm.decode(spm.encode("<start_of_turn>hi", special=True), skip_special=False) == "<s><start_of_turn> hi"
    bpe = _tokenizer("bpe-llama-bpe", vocab_dir)
    eot = bpe.backend.token_to_id("<|eot_id|>")
    assert bpe.encode("hi<|eot_id|>", add_bos=False, special=True)[-1] == eot
    assert eot not in bpe.encode("hi<|eot_id|>", add_bos=False)
    assert bpe.encode("hi", add_bos=None)[0] == bpe.bos_id and bpe.encode("hi", add_bos=False)[0] != bpe.bos_id


def test_end_of_generation_ids(vocab_dir):
    spm = _tokenizer("spm", vocab_dir)
    texts = [spm.token_text(i) for i in spm.eos_ids]
    # EOS first; <end_of_turn> by its text; <|im_end|> is typed normal but llama.cpp treats it as control
    assert texts == ["</s>", "<end_of_turn>", "<|im_end|>"]
    assert spm.decode(spm.encode("x<|im_end|>", add_bos=False, special=True)) == "x"
    bpe = _tokenizer("bpe-llama-bpe", vocab_dir)
    assert {bpe.token_text(i) for i in bpe.eos_ids} == {"<|end_of_text|>", "<|eot_id|>", "<|im_end|>"}


def test_stream_decoding_with_byte_fallback(vocab_dir):
    texts = [
        "emoji 🙂 here",
        "日本語のテキスト",
        "naïve café 👨‍👩‍👧",
        "hello\n\nworld",
        "Hello, world!",
        "what ? yes . no , ok ! it 's",
        "<start_of_turn>user\nhi<end_of_turn>",
    ]
    for name in ("spm", "spm-noprefix", "bpe-llama-bpe", "bpe-default", "bpe-qwen2"):
        tok = _tokenizer(name, vocab_dir)
        for text in texts:
            ids = tok.encode(text, special=True)
            stream = tok.stream()
            pieces = [stream.push(i) for i in ids] + [stream.flush()]
            # vocabularies that tidy spaces before punctuation stream without the tidying
            assert "".join(pieces) == tok.backend.decode(ids, clean_spaces=False), (name, text)
            if not tok.backend.clean_spaces:
                assert "".join(pieces) == tok.decode(ids), (name, text)
            assert not any("\ufffd" in p for p in pieces), (name, text, pieces)
    # the tiny SentencePiece vocabulary has no emoji: four byte tokens, one character when complete
    tok = _tokenizer("spm-noprefix", vocab_dir)
    ids = tok.encode("🙂", add_bos=False, add_eos=False)
    assert [tok.token_text(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x99>", "<0x82>"]
    stream = tok.stream()
    assert [stream.push(i) for i in ids] == ["", "", "", "🙂"]
    assert tok.decode(ids[:2]) == "\ufffd"


def test_chat_template(vocab_dir, tmp_path):
    spm = _tokenizer("spm", vocab_dir)
    assert spm.chat_template.startswith("{% for m in messages %}")
    prompt = spm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<start_of_turn>user\nhi<end_of_turn>\n"
    assert spm.encode(prompt, special=True)[:2] == [spm.bos_id, spm.backend.token_to_id("<start_of_turn>")]
    bpe = _tokenizer("bpe-gpt-2", vocab_dir)
    assert bpe.chat_template is None
    with pytest.raises(ValueError, match="no chat template: pass one .*--chat-template"):
        bpe.apply_chat_template([{"role": "user", "content": "hi"}])


# -- bad vocabularies ---------------------------------------------------------------------------


def _write(
    path,
    *,
    model="llama",
    tokens=("<unk>", "<s>", "</s>", "a", "b", "ab"),
    scores=None,
    types=None,
    merges=None,
    pre=None,
    extra=None,
):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    if tokens is not None:
        w.add_token_list(list(tokens))
    if scores is not None:
        w.add_token_scores(list(scores))
    if types is not None:
        w.add_token_types(list(types))
    if merges is not None:
        w.add_token_merges(list(merges))
    for key, value in (extra or {}).items():
        getattr(w, key)(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_bad_vocabularies_are_refused(tmp_path):
    ok = _write(tmp_path / "ok.gguf", scores=[0.0, 0.0, 0.0, -1.0, -1.0, -0.5], types=[2, 3, 3, 1, 1, 1])
    tok = Tokenizer.from_gguf(ok)
    # no byte tokens: the space prefix's U+2581, not in the vocabulary, is one unknown token
    assert tok.encode("ab", add_bos=False) == [0, 5] and tok.decode([1, 0, 5]) == "ab"
    cases = [
        (dict(tokens=None), "lacks 'tokenizer.ggml.tokens'"),
        (
            dict(scores=[0.0, 0.0, 0.0, math.nan, 0.0, 0.0]),
            r"tokenizer.ggml.scores\[3\]=nan is out of range: allowed finite",
        ),
        (dict(scores=[0.0, 0.0, 0.0, 0.0, math.inf, 0.0]), r"tokenizer.ggml.scores\[4\]=inf is out of range"),
        (dict(scores=[0.0, 0.0, 0.0]), "tokenizer.ggml.scores has 3 entries: allowed at least one per token"),
        (dict(types=[2, 3, 3, 1, 7, 1]), r"tokenizer.ggml.token_type\[4\]=7 is out of range: allowed 0..6"),
        (dict(types=[2, 3, 3, 1, -1, 1]), r"tokenizer.ggml.token_type\[4\]=-1 is out of range"),
        (dict(tokens=["<unk>", "a", "a"]), r"has 'a' twice \(ids 1 and 2\)"),
        (dict(model="t5"), "tokenizer.ggml.model='t5' is out of range: allowed 'llama' .* or 'gpt2'"),
        (
            dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a b"], pre="no-such-pre"),
            "tokenizer.ggml.pre='no-such-pre' is out of range: allowed .*'llama-bpe'",
        ),
        (
            dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a c"]),
            r"tokenizer.ggml.merges\[0\]='a c' is out of range",
        ),
        (dict(model="gpt2", tokens=["a", "b"], merges=["a b"]), r"tokenizer.ggml.merges\[0\]='a b' is out of range"),
        (dict(model="gpt2", tokens=["a", "b", "ab"], merges=["ab"]), r"tokenizer.ggml.merges\[0\]='ab'"),
        (dict(model="gpt2", tokens=["a", "b", "ab"]), "lacks 'tokenizer.ggml.merges'"),
        (
            dict(model="gpt2", tokens=["a", "b", "ab"], merges=["a b"], extra={"add_add_bos_token": True}),
            "add_bos_token is true but the file has no BOS id",
        ),
    ]
    for i, (kwargs, match) in enumerate(cases):
        path = _write(tmp_path / f"bad{i}.gguf", **kwargs)
        with pytest.raises(ValueError, match=match):
            gguf_tokenizer(path)


def test_files_that_are_not_gguf_are_refused(tmp_path, vocab_dir):
    (tmp_path / "text.gguf").write_text("hello")
    (tmp_path / "empty.gguf").write_bytes(b"")
    whole = write_vocab("spm", tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:5000])
    for name in ("text.gguf", "empty.gguf", "cut.gguf"):
        with pytest.raises(ValueError, match="is not a readable GGUF file"):
            gguf_tokenizer(tmp_path / name)
    with pytest.raises(ValueError, match="is not a file"):
        gguf_tokenizer(tmp_path / "nowhere.gguf")
    with pytest.raises(ValueError, match="path must be a file path"):
        gguf_tokenizer(42)


def test_decode_refuses_ids_outside_the_vocabulary(vocab_dir):
    tok = _tokenizer("spm", vocab_dir)
    with pytest.raises(ValueError, match=r"ids contains 100000: allowed token ids in \[0, 664\)"):
        tok.decode([1, 100000])
