"""``python -m kvjax generate --chat``: the prompt as the user's turn of a chat template (built-in,
a Jinja file, or the model file's own), ``--system``, BOS written once, the reply alone printed,
and the errors.

The tiny checkpoint is the one ``tests/test_generate_cli.py`` builds (kvjax weights and a trained
character BPE) with the chat templates' special tokens added to its vocabulary.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from flax import nnx

import kvjax
from kvjax.app import _generate
from kvjax.nn import Llama, LlamaConfig, Tokenizer
from kvjax.nn._chat_template import chat_template_by_name
from kvjax.nn._pretrained import save_llama

pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from tests.test_generate_cli import _greedy  # noqa: E402
from tests.test_tokenizer import make_tokenizer, write_tokenizer_folder  # noqa: E402

SPECIAL = [
    "<|im_start|>",
    "<|im_end|>",
    "<start_of_turn>",
    "<end_of_turn>",
    "[INST]",
    "[/INST]",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-chat")
    backend = make_tokenizer(100, byte_level=False)  # ids 0, 1, 2: <s>, </s>, <unk>
    backend.add_special_tokens(SPECIAL)
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
        path,
        backend,
        generation={"bos_token_id": 0, "eos_token_id": 1},
        tokenizer_config={"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"},
    )
    return path


def _run(folder, prompt, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    kwargs.setdefault("max_new_tokens", 4)
    kwargs.setdefault("ctx", 96)
    report = _generate.run(folder, prompt, chat=True, out=out, err=err, **kwargs)
    return report, out.getvalue()


def _want(folder, ids, n=4):
    """The greedy reply of the uncached model to ``ids``, up to and with EOS."""
    tokens = _greedy(kvjax.nn.from_pretrained(folder), ids, n, pad=96)
    return tokens[: tokens.index(1) + 1] if 1 in tokens else tokens


def test_a_template_that_writes_bos_gets_it_once(folder):
    """Mistral's template starts with ``<s>`` and the tokenizer adds BOS: llama.cpp's rule cuts the
    text, so the prompt starts with the BOS id once; the model continues the rendered prompt and
    only its reply is printed."""
    report, text = _run(folder, "the lazy dog", system="be brief", chat_template="mistral")
    assert report.prompt_text == "<s> [INST] be brief\n\nthe lazy dog [/INST]"
    tok = Tokenizer.from_pretrained(folder)
    ids = report.prompt_ids
    assert ids == [0] + _generate.encode_chat_text(tok, " [INST] be brief\n\nthe lazy dog [/INST]", add_bos=False)
    assert ids.count(0) == 1 and report.prompt_tokens == len(ids)
    assert _generate.encode_chat_text(tok, report.prompt_text)[:2] == [0, 0]  # BOS added to the whole text
    want = _want(folder, ids)
    assert report.tokens == [want]
    assert text.rstrip("\n") == tok.decode(want) and "lazy dog" not in text


def test_a_template_without_bos_gets_the_tokenizers(folder):
    """ChatML writes no BOS: the tokenizer's goes first, as for any prompt; ``--system`` is the first
    turn; each of ``--n-parallel`` sequences prints its reply alone."""
    report, text = _run(
        folder, "quick brown", system="be brief", chat_template="chatml", n_parallel=2, temperature=1.0, seed=1
    )
    assert report.prompt_text == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nquick brown<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = Tokenizer.from_pretrained(folder)
    assert report.prompt_ids == _generate.encode_chat_text(tok, report.prompt_text) and report.prompt_ids[0] == 0
    assert report.prompt_ids[1] == tok.backend.token_to_id("<|im_start|>")  # a special token is one id
    assert "\n[1] " in text and "quick brown" not in text


def test_a_jinja_file_is_the_same_as_the_builtin(folder, tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text(chat_template_by_name("gemma"), encoding="utf-8")
    by_file, _ = _run(folder, "the lazy dog", chat_template=str(path))
    by_name, _ = _run(folder, "the lazy dog", chat_template="gemma")
    assert (
        by_file.prompt_text
        == by_name.prompt_text
        == ("<s><start_of_turn>user\nthe lazy dog<end_of_turn>\n<start_of_turn>model\n")
    )
    assert by_file.prompt_ids == by_name.prompt_ids and by_file.prompt_ids.count(0) == 1
    assert by_file.tokens == by_name.tokens == [_want(folder, by_name.prompt_ids)]


def test_builtin_templates_stop_at_their_end_of_turn(folder):
    """With a built-in template, its end-of-turn token ends generation too (it is often missing
    from the EOS ids of a file that has no template); a file or the model's own adds nothing."""
    from kvjax.nn._chat_template import BUILTIN_TEMPLATES

    assert set(_generate.TURN_ENDS) == set(BUILTIN_TEMPLATES)
    tok = Tokenizer.from_pretrained(folder)
    im_end, eot = tok.backend.token_to_id("<|im_end|>"), tok.backend.token_to_id("<end_of_turn>")
    assert _generate.chat_stop_ids(tok, "chatml") == [1, im_end]
    assert _generate.chat_stop_ids(tok, "gemma") == [1, eot]
    assert _generate.chat_stop_ids(tok, "mistral") == _generate.chat_stop_ids(tok, None) == [1]
    assert _generate.chat_stop_ids(tok, "some/file.jinja") == [1]
    report, _ = _run(
        folder, "the lazy dog", chat_template="chatml", max_new_tokens=24, n_parallel=4, temperature=2.0, seed=3
    )
    # (with this seed one of the four sequences samples <|im_end|> early, today: 7 tokens of 24)
    for tokens in report.tokens:  # a sequence that reaches the end of its turn stops there
        assert im_end not in tokens[:-1] and 1 not in tokens[:-1]


@pytest.fixture
def own_template(monkeypatch):
    """The model file's own template on the tokenizer (``Tokenizer.chat_template``), and its
    ``add_bos`` when given, set on the tokenizer the loader returns."""
    real_load = _generate.load

    def use(template, add_bos=None):
        def load(path, dtype="float32"):
            model, tok = real_load(path, dtype)
            tok.chat_template = template
            if add_bos is not None:
                tok.add_bos = add_bos
            return model, tok

        monkeypatch.setattr(_generate, "load", load)

    return use


def test_the_model_files_own_template(folder, own_template):
    """Without ``--chat-template`` the tokenizer's template renders; ``--chat-template`` overrides it."""
    own_template(chat_template_by_name("llama3"))
    report, _ = _run(folder, "fox", system="sys")
    assert report.prompt_text == (
        "<s><|start_header_id|>system<|end_header_id|>\n\nsys<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nfox<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert report.prompt_ids.count(0) == 1 and report.prompt_ids[0] == 0
    override, _ = _run(folder, "fox", chat_template="chatml")
    assert override.prompt_text.startswith("<|im_start|>user\nfox")


def test_the_template_in_tokenizer_config(folder, tmp_path):
    """A folder whose tokenizer_config.json has a chat_template: ``--chat`` alone renders it, the
    same text as the tokenizer's own ``apply_chat_template``."""
    import json
    import shutil

    other = tmp_path / "with-template"
    shutil.copytree(folder, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template_by_name("gemma")
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(other)
    assert tok.chat_template == config["chat_template"]
    report, _ = _run(other, "fox", system="sys")
    assert report.prompt_text == "<s><start_of_turn>user\nsys\n\nfox<end_of_turn>\n<start_of_turn>model\n"
    assert report.prompt_text == tok.apply_chat_template(report.conversation[:2])
    assert report.prompt_ids[0] == 0 and report.prompt_ids.count(0) == 1


def test_a_tokenizer_that_adds_no_bos_reads_the_templates(folder, own_template):
    """A tokenizer that adds no BOS keeps the template's text, which the tokenizer reads as the BOS
    id (transformers' way: the rendered text is tokenized without adding special tokens)."""
    own_template(chat_template_by_name("gemma"), add_bos=False)
    report, _ = _run(folder, "fox")
    assert report.prompt_text.startswith("<s><start_of_turn>user\nfox")
    assert report.prompt_ids[0] == 0 and report.prompt_ids.count(0) == 1


def test_several_named_templates_pick_default(folder, tmp_path):
    """tokenizer_config.json's list of named templates: the one named "default" (transformers' choice without tools)."""
    import json
    import shutil

    other = tmp_path / "named"
    shutil.copytree(folder, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "{{ raise_exception('not this one') }}"},
        {"name": "default", "template": chat_template_by_name("chatml")},
    ]
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    report, _ = _run(other, "fox")
    assert report.prompt_text == "<|im_start|>user\nfox<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(chat=False, system="sys"), r"--system is out of range without --chat: allowed together with --chat"),
        (dict(chat=False, chat_template="chatml"), r"--chat-template is out of range without --chat"),
        (dict(chat=1), r"--chat 1 is out of range: allowed True or False"),
        (dict(system=3), r"--system 3 is out of range: allowed a text"),
        (
            dict(chat_template="llama2"),
            r"--chat-template 'llama2' is neither a built-in template nor a file: allowed "
            r"one of \['chatml', 'gemma', 'llama3', 'mistral'\] or the path of a Jinja file",
        ),
        (dict(chat_template=""), r"--chat-template '' is out of range"),
        (
            dict(),
            r"--chat needs a chat template and the model file has none: allowed --chat-template with one of "
            r"\['chatml', 'gemma', 'llama3', 'mistral'\]",
        ),
    ],
)
def test_bad_chat_arguments(folder, kwargs, match):
    args = dict(chat=True)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _generate.run(folder, "fox", out=io.StringIO(), err=io.StringIO(), **args)


@pytest.mark.parametrize(
    "text, match",
    [
        (
            "{{ raise_exception('this model does not chat') }}",
            r"the model's chat template refused these messages: this model does not chat",
        ),
        ("{% for m in messages %}{{ m.content }}", r"the model's chat template is not valid Jinja \(line 1"),
        ("", r"is an empty file: allowed a Jinja chat template"),
    ],
)
def test_bad_template_files(folder, tmp_path, text, match):
    path = tmp_path / "t.jinja"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match=match):
        _run(folder, "fox", chat_template=str(path))


def test_a_template_that_refuses_the_system_message(folder, own_template):
    """The template's own error reaches the user with its message: Gemma 2's template has no
    system role and says so."""
    own_template(
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    with pytest.raises(
        ValueError,
        match=r"the model's chat template refused these messages: System role not "
        r"supported",
    ):
        _run(folder, "fox", system="sys")
    report, _ = _run(folder, "fox")
    assert report.prompt_text == "<s>fox" and report.prompt_ids == [0] + Tokenizer.from_pretrained(folder).encode(
        "fox", add_bos=False
    )


def test_interactive_turns_from_the_input(folder):
    """``--interactive``: each input line is the next user turn, answered from the whole
    conversation rendered again; every reply is the uncached greedy reply to that prompt."""
    out = io.StringIO()
    report = _generate.run(
        folder,
        "the lazy dog",
        chat=True,
        chat_template="chatml",
        system="be brief",
        interactive=True,
        inp=io.StringIO("quick brown\nover the fox\n"),
        max_new_tokens=4,
        ctx=160,
        out=out,
        err=io.StringIO(),
    )
    conv = report.conversation
    assert [m["role"] for m in conv] == ["system"] + ["user", "assistant"] * 3
    assert [m["content"] for m in conv if m["role"] == "user"] == ["the lazy dog", "quick brown", "over the fox"]
    assert report.replies == [m["content"] for m in conv if m["role"] == "assistant"]
    tok = Tokenizer.from_pretrained(folder)
    model = kvjax.nn.from_pretrained(folder)
    for turn in range(3):
        _, ids = _generate.chat_prompt(tok, conv[: 2 + 2 * turn], chat_template_by_name("chatml"))
        want = _greedy(model, ids, 4, pad=160)
        want = want[: want.index(1) + 1] if 1 in want else want
        assert report.replies[turn] == tok.decode(want)
    assert out.getvalue().count("> ") == 3  # asked three times: the third got the end of the input
    assert report.prompt_text.endswith("the lazy dog<|im_end|>\n<|im_start|>assistant\n")  # the first turn's


def test_cache_ram_turns_reuse_the_conversation_from_host_memory(folder):
    """``--cache-ram``: the turns share one memory and a prompt cache whose host tier holds the
    conversation between turns (its cells freed), so a later turn evaluates only what the
    conversation added; the replies are exactly those of fresh memories with every turn recomputed."""
    lines = "quick brown\nover the fox\n"
    args = dict(chat=True, chat_template="chatml", system="be brief", interactive=True, max_new_tokens=4, ctx=160)
    plain = _generate.run(folder, "the lazy dog", inp=io.StringIO(lines), out=io.StringIO(), err=io.StringIO(), **args)
    err = io.StringIO()
    cached = _generate.run(
        folder, "the lazy dog", inp=io.StringIO(lines), out=io.StringIO(), err=err, cache_ram=1, **args
    )
    assert cached.replies == plain.replies and len(cached.replies) == 3
    tok = Tokenizer.from_pretrained(folder)
    for turn in (1, 2):
        _, ids = _generate.chat_prompt(tok, plain.conversation[: 2 + 2 * turn], chat_template_by_name("chatml"))
        assert plain.turn_prompt_tokens[turn] == len(ids)  # recomputed from the first token
        assert cached.turn_prompt_tokens[turn] < len(ids) // 2  # the conversation so far came back from host
    assert "prompt cache: 3 turns" in err.getvalue() and "3 moves out, 2 back" in err.getvalue()


@pytest.mark.parametrize(
    "lines, max_turns, n_replies",
    [
        ("one\ntwo\nthree\n", 2, 2),  # --max-turns counts the --prompt turn
        ("one\n\nignored\n", 16, 2),  # an empty line ends the chat
        ("", 16, 1),  # no input: the first reply only
    ],
)
def test_interactive_ends(folder, lines, max_turns, n_replies):
    report, _ = _run(
        folder,
        "fox",
        chat_template="chatml",
        interactive=True,
        inp=io.StringIO(lines),
        max_turns=max_turns,
        max_new_tokens=2,
    )
    assert len(report.replies) == n_replies and len(report.conversation) == 2 * n_replies


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(chat=False, chat_template=None, interactive=True), r"--interactive is out of range without --chat"),
        (dict(interactive=True, n_parallel=2), r"--n-parallel 2 is out of range with --interactive: allowed 1"),
        (dict(interactive=True, max_turns=0), r"--max-turns 0 is out of range: allowed an integer >= 1"),
        (dict(interactive="yes"), r"--interactive 'yes' is out of range: allowed True or False"),
        (
            dict(interactive=True, ctx=40, inp=io.StringIO("the quick brown fox jumps over the lazy dog again\n")),
            r"--ctx 40 is out of range for the conversation of \d+ tokens at turn 2: allowed > \d+",
        ),
        (dict(cache_ram=-1), r"--cache-ram -1 is out of range: allowed an integer number of MiB >= 0"),
        (dict(cache_ram=1, n_parallel=2), r"--n-parallel 2 is out of range with --cache-ram: allowed 1"),
        (
            dict(cache_ram=1, ctx=30, max_new_tokens=12),
            r"--max-new-tokens 12 is out of range with --cache-ram and a prompt of \d+ tokens: allowed <= \d+",
        ),
    ],
)
def test_bad_interactive_arguments(folder, kwargs, match):
    args = dict(chat=True, chat_template="chatml", max_new_tokens=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        _generate.run(folder, "fox", out=io.StringIO(), err=io.StringIO(), **args)


def test_the_real_gemma_vocabulary(real_gemma_gguf):
    """The real Gemma 3 270M GGUF (base model: no template in the file) with the built-in Gemma
    template: BOS once, the turn markers as their single control tokens (<start_of_turn> 105,
    <end_of_turn> 106; "user" 2364, "model" 4368, "\\n" 107, as Gemma 3's instruct prompts), and
    generation stops at <end_of_turn>. Skips without the real-model extra."""
    tok = Tokenizer.from_gguf(real_gemma_gguf)
    with pytest.raises(ValueError, match="--chat needs a chat template and the model file has none"):
        _generate.resolve_chat_template(tok)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]
    text, ids = _generate.chat_prompt(tok, messages, _generate.resolve_chat_template(tok, "gemma"))
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nWhy is the sky blue?<end_of_turn>\n<start_of_turn>model\n"
    body = tok.encode("Be brief.\n\nWhy is the sky blue?", add_bos=False)
    assert ids == [2, 105, 2364, 107] + body + [106, 107, 105, 4368, 107]
    assert 106 in _generate.chat_stop_ids(tok, "gemma")


def test_command_line(folder, tmp_path):
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
        "3",
        "--ctx",
        "96",
        "--chat",
        "--system",
        "be brief",
        "--chat-template",
        "chatml",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "the lazy dog" not in done.stdout and "tokens/s" in done.stderr
    bad = subprocess.run(cmd[:-1] + ["nope"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "error: --chat-template 'nope' is neither a built-in template" in bad.stderr
    talk = subprocess.run(
        cmd + ["--interactive", "--max-turns", "3"],
        input="quick brown\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert talk.returncode == 0, talk.stderr
    assert talk.stdout.count("> ") == 2  # the second turn read, then the end of the input
    no_chat = [c for c in cmd if c != "--chat"]
    bad = subprocess.run(no_chat, capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "error: --system is out of range without --chat" in bad.stderr
