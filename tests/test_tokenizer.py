"""``kvjax.nn.Tokenizer``: a checkpoint's tokenizer.json and special ids, streaming-safe decoding.

Tiny tokenizers are trained here with the ``tokenizers`` library (a byte-level BPE whose
multi-byte characters split over several tokens, a Metaspace character BPE that fits a 100-token
model): round trips, BOS/EOS ids from the folder's JSON files, incremental decoding equal to the
full decode with no broken character ever printed, bad inputs; special-token texts parsed only with
``special=True``, chat templates from the folder, and a folder with only a sentencepiece
``tokenizer.model``. (GGUF vocabularies: ``tests/test_gguf_vocab.py``.)
"""

from __future__ import annotations

import json
import pathlib

import pytest

from kvjax.nn import Tokenizer

tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "héllo wörld, naïve café",
    "日本語のテキスト 🙂 emoji",
    "Return a new list of items",
    "kv cache for every sequence",
] * 4


def make_tokenizer(vocab_size: int = 300, byte_level: bool = True, post_bos: bool = False):
    """A trained BPE: byte-level (any text, multi-byte characters over several tokens) or
    character-level with Metaspace (small vocabularies). Ids 0, 1, 2 are ``<s>``, ``</s>``, ``<unk>``."""
    from tokenizers import Tokenizer as Backend, decoders, models, pre_tokenizers, processors, trainers

    special = ["<s>", "</s>", "<unk>"]
    if byte_level:
        backend = Backend(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
    else:
        backend = Backend(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace()
        backend.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, limit_alphabet=60)
    backend.train_from_iterator(CORPUS, trainer)
    if post_bos:
        backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return backend


def write_tokenizer_folder(folder: pathlib.Path, backend, *, config=None, generation=None, tokenizer_config=None):
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    for name, data in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer_config.json", tokenizer_config),
    ):
        if data is not None:
            (folder / name).write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def byte_bpe():
    return make_tokenizer()


def test_round_trip_and_special_ids(tmp_path, byte_bpe):
    folder = write_tokenizer_folder(
        tmp_path,
        byte_bpe,
        config={"bos_token_id": 0, "eos_token_id": 1},
        generation={"bos_token_id": 0, "eos_token_id": [1, 2]},
        tokenizer_config={"add_bos_token": True},
    )
    tok = Tokenizer.from_pretrained(folder)
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (0, (1, 2), True)
    for text in CORPUS[:3] + ["", "   spaces  ", "unseen ÿ ø Ω"]:
        ids = tok.encode(text)
        assert ids[0] == 0 and tok.decode(ids) == text
        assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode([0] + tok.encode("fox", add_bos=False) + [1], skip_special=False) == "<s>fox</s>"


def test_ids_from_each_file(tmp_path, byte_bpe):
    # only tokenizer_config.json's token strings
    tok = Tokenizer.from_pretrained(
        write_tokenizer_folder(
            tmp_path / "a", byte_bpe, tokenizer_config={"bos_token": {"content": "<s>"}, "eos_token": "</s>"}
        )
    )
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (0, (1,), False)  # no post-processor adds BOS
    # config.json only; the backend's post-processor adds BOS, so prompts start with it
    tok = Tokenizer.from_pretrained(
        write_tokenizer_folder(
            tmp_path / "b", make_tokenizer(post_bos=True), config={"bos_token_id": 0, "eos_token_id": 1}
        )
    )
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (0, (1,), True)
    assert tok.encode("dog")[:1] == [0] and tok.encode("dog").count(0) == 1  # BOS once
    # nothing: no special ids
    tok = Tokenizer.from_pretrained(write_tokenizer_folder(tmp_path / "c", byte_bpe))
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (None, (), False)
    # out-of-vocabulary ids in the configs are dropped, not trusted
    tok = Tokenizer.from_pretrained(
        write_tokenizer_folder(tmp_path / "d", byte_bpe, config={"bos_token_id": 10**6, "eos_token_id": [1, 10**6]})
    )
    assert (tok.bos_id, tok.eos_ids) == (None, (1,))


def test_stream_equals_full_decode_without_broken_characters(byte_bpe):
    tok = Tokenizer(byte_bpe, bos_id=0, eos_ids=(1,))
    for text in CORPUS[:3] + ["🙂🙂 日本 naïve"]:
        ids = tok.encode(text)
        stream = tok.stream()
        pieces = [stream.push(t) for t in ids]
        pieces.append(stream.flush())
        assert "".join(pieces) == text
        assert not any("\ufffd" in p for p in pieces)
    # a 4-byte emoji spread over several tokens comes out in one piece, when complete
    ids = tok.encode("🙂", add_bos=False)
    assert len(ids) > 1
    stream = tok.stream()
    assert [stream.push(t) for t in ids] == [""] * (len(ids) - 1) + ["🙂"]


def test_stream_flush_of_an_incomplete_character(byte_bpe):
    tok = Tokenizer(byte_bpe)
    ids = tok.encode("🙂", add_bos=False)
    stream = tok.stream()
    assert stream.push(ids[0]) == ""
    assert stream.flush() == "\ufffd"  # what is left at the end comes out, marked
    assert stream.flush() == ""


def test_metaspace_stream_keeps_spaces():
    tok = Tokenizer(make_tokenizer(100, byte_level=False))
    assert tok.vocab_size <= 100
    text = "the lazy dog jumps"
    stream = tok.stream()
    assert "".join(stream.push(t) for t in tok.encode(text)) + stream.flush() == tok.decode(tok.encode(text))


def test_bad_inputs(tmp_path, byte_bpe):
    with pytest.raises(ValueError, match=r"backend must be a tokenizers.Tokenizer .*got str"):
        Tokenizer("vocab.txt")
    with pytest.raises(ValueError, match=r"bos_id contains 100000: allowed integer ids in \[0, \d+\)"):
        Tokenizer(byte_bpe, bos_id=100000)
    with pytest.raises(ValueError, match=r"eos_ids contains -1"):
        Tokenizer(byte_bpe, eos_ids=(-1,))
    with pytest.raises(ValueError, match=r"add_bos=True is out of range without a bos_id"):
        Tokenizer(byte_bpe, add_bos=True)
    with pytest.raises(ValueError, match=r"add_bos='yes' is out of range: allowed True or False"):
        Tokenizer(byte_bpe, add_bos="yes")
    tok = Tokenizer(byte_bpe)
    with pytest.raises(ValueError, match=r"text must be a str, got bytes"):
        tok.encode(b"abc")
    with pytest.raises(ValueError, match=r"add_bos=True is out of range: this tokenizer has no BOS id"):
        tok.encode("abc", add_bos=True)
    with pytest.raises(ValueError, match=r"ids contains 'a': allowed integer token ids"):
        tok.decode(["a"])
    with pytest.raises(ValueError, match=r"ids must be a sequence of integer token ids, got str"):
        tok.decode("abc")
    with pytest.raises(ValueError, match=r"ids contains 1.5"):
        tok.stream().push(1.5)
    with pytest.raises(ValueError, match=r"path='.*nowhere' is not a folder"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"has no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"tokenizer.json is not a tokenizers file"):
        Tokenizer.from_pretrained(tmp_path)
    write_tokenizer_folder(tmp_path, byte_bpe)
    (tmp_path / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match=r"generation_config.json is not valid JSON"):
        Tokenizer.from_pretrained(tmp_path)


def test_equals_transformers_fast_tokenizer(tmp_path, byte_bpe):
    """The ids are those transformers' fast tokenizer gives for the same folder (without specials)."""
    transformers = pytest.importorskip("transformers")
    folder = write_tokenizer_folder(tmp_path, byte_bpe, tokenizer_config={"bos_token": "<s>", "eos_token": "</s>"})
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(folder)
    for text in CORPUS[:3]:
        assert tok.encode(text, add_bos=False) == theirs.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text)) == theirs.decode(theirs.encode(text, add_special_tokens=False))


# -- special tokens, chat templates, sentencepiece folders -------------------------------------


def test_special_tokens_parsed_only_when_asked(byte_bpe):
    tok = Tokenizer(byte_bpe, bos_id=0, eos_ids=(1,))
    parsed = tok.encode("fox</s>", special=True)
    assert parsed[-1] == 1 and 1 not in tok.encode("fox</s>")  # the default: plain text
    assert tok.decode(tok.encode("fox</s>")) == "fox</s>"
    assert byte_bpe.encode_special_tokens is False  # the backend's own setting is kept
    assert (
        tok.encode("fox", add_eos=True)[-1] == 1
        and Tokenizer(byte_bpe, eos_ids=(1,), add_eos=True).encode("fox")[-1] == 1
    )
    with pytest.raises(ValueError, match=r"add_eos=True is out of range without eos_ids"):
        Tokenizer(byte_bpe, add_eos=True)
    with pytest.raises(ValueError, match=r"special='yes' is out of range: allowed True or False"):
        tok.encode("fox", special="yes")


def test_chat_template_from_the_folder(tmp_path, byte_bpe):
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    folder = write_tokenizer_folder(
        tmp_path / "a",
        byte_bpe,
        config={"bos_token_id": 0, "eos_token_id": 1},
        tokenizer_config={"chat_template": template, "bos_token": "<s>"},
    )
    tok = Tokenizer.from_pretrained(folder)
    assert tok.chat_template == template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>user: hi</s>"
    # a list of named templates: the default one; a chat_template.jinja file wins over both
    folder = write_tokenizer_folder(
        tmp_path / "b",
        byte_bpe,
        tokenizer_config={
            "chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
        },
    )
    assert Tokenizer.from_pretrained(folder).chat_template == "plain"
    (folder / "chat_template.jinja").write_text("from the file")
    assert Tokenizer.from_pretrained(folder).chat_template == "from the file"
    tok = Tokenizer.from_pretrained(write_tokenizer_folder(tmp_path / "c", byte_bpe))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match=r"no chat template: pass one \(--chat-template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"chat_template must be a str or None, got int"):
        Tokenizer(byte_bpe, chat_template=3)


def test_a_sentencepiece_folder(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    # without the package: an ImportError naming it
    import sys

    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match=r"needs the 'sentencepiece' package"):
        Tokenizer.from_pretrained(tmp_path)
    monkeypatch.undo()
    spm = pytest.importorskip("sentencepiece")
    with pytest.raises(ValueError, match=r"tokenizer.model is not a sentencepiece model"):
        Tokenizer.from_pretrained(tmp_path)
    import io

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=340,
        hard_vocab_limit=False,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=["<mask>"],
        minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    tok = Tokenizer.from_pretrained(tmp_path)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    assert (tok.bos_id, tok.eos_ids, tok.add_bos) == (sp.bos_id(), (sp.eos_id(),), True)
    for text in CORPUS[:3] + ["unseen ÿ ø Ω 🦊", "a<mask>b"]:
        assert tok.encode(text) == [sp.bos_id()] + sp.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode([sp.bos_id()] + sp.encode("fox"), skip_special=False) == "<s>fox"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"
    stream = tok.stream()
    ids = tok.encode("🦊 naïve")
    assert "".join(stream.push(i) for i in ids) + stream.flush() == "🦊 naïve"
