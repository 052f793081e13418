"""Chat templates: real models' templates rendered as transformers renders them, the built-ins
against hand-written prompts, and the errors (bad messages, ``raise_exception``, bad Jinja, the
sandbox).

The fixtures in ``tests/data/chat_templates`` are the official templates' texts (from the models'
``tokenizer_config.json``): Gemma 3, Llama 3 and 3.1, Qwen2.5, Mistral 7B Instruct, ChatML. The
comparison with ``transformers`` runs when it is installed (CI does not install it); the
hand-written prompts always run.
"""

from __future__ import annotations

import copy
import pathlib
from datetime import datetime

import pytest

from kvjax.nn._chat_template import BUILTIN_TEMPLATES, chat_template_by_name, render_chat_template

pytest.importorskip("jinja2")

DATA = pathlib.Path(__file__).parent / "data" / "chat_templates"
FIXTURES = sorted(p.stem for p in DATA.glob("*.jinja"))
#: the special tokens each model's tokenizer has (what apply_chat_template passes the template)
SPECIAL = {
    "gemma3": ("<bos>", "<eos>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "llama3.1": ("<|begin_of_text|>", "<|eot_id|>"),
    "qwen2.5": ("", "<|im_end|>"),
    "mistral": ("<s>", "</s>"),
    "chatml": ("<s>", "<|im_end|>"),
}
#: the fixture each built-in is a verbatim copy of
BUILTIN_FIXTURE = {"chatml": "chatml", "gemma": "gemma3", "llama3": "llama3", "mistral": "mistral"}

SYSTEM = {"role": "system", "content": "You are terse."}
HISTORY = [
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
]
CONVERSATIONS = {
    "one user turn": HISTORY[:1],
    "system and one turn": [SYSTEM] + HISTORY[:1],
    "system and history": [SYSTEM] + HISTORY,
    # whitespace the templates trim (Gemma, Llama 3) or keep (ChatML, Qwen, Mistral), and text
    # that Jinja's own tojson would escape
    "untrimmed text": [{"role": "user", "content": "  <b>Tom & Jerry's</b> café \n"}],
}


def fixture(name: str) -> str:
    return (DATA / f"{name}.jinja").read_text(encoding="utf-8")


def test_fixtures_are_all_there():
    assert FIXTURES == ["chatml", "gemma3", "llama3", "llama3.1", "mistral", "qwen2.5"]


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtins_are_the_official_texts(name):
    """Each built-in is the official template verbatim (the fixture), so a model rendered with a
    built-in gets the prompt its own template would give."""
    assert chat_template_by_name(name) == fixture(BUILTIN_FIXTURE[name])


# ---------------------------------------------------------------------------------------------
# transformers' apply_chat_template(..., tokenize=False), when transformers is installed


@pytest.fixture(scope="module")
def hf_tokenizer():
    transformers = pytest.importorskip("transformers", reason="the comparison needs transformers (not in CI)")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, models

    def make(bos: str, eos: str):
        vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(t for t in (bos, eos) if t)}}
        kwargs = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v}
        return transformers.PreTrainedTokenizerFast(
            tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>", **kwargs
        )

    return make


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("label", list(CONVERSATIONS))
@pytest.mark.parametrize("name", FIXTURES)
def test_equals_transformers_apply_chat_template(hf_tokenizer, name, label, add_generation_prompt):
    bos, eos = SPECIAL[name]
    hf = hf_tokenizer(bos, eos)
    hf.chat_template = fixture(name)
    messages = CONVERSATIONS[label]
    want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = render_chat_template(
        fixture(name), messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
    )
    assert got == want


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5"])
def test_extra_variables_and_tools_equal_transformers(hf_tokenizer, name):
    """Keywords reach the template as transformers' do: Llama 3.1's ``date_string``, and tool
    schemas through ``tojson`` (indent=4 for Llama 3.1)."""
    bos, eos = SPECIAL[name]
    hf = hf_tokenizer(bos, eos)
    hf.chat_template = fixture(name)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Adds <a> & <b>",
                "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
            },
        }
    ]
    messages = [SYSTEM] + HISTORY
    want = hf.apply_chat_template(
        messages, tools=tools, date_string="06 Dec 2026", tokenize=False, add_generation_prompt=True
    )
    got = render_chat_template(
        fixture(name), messages, tools=tools, date_string="06 Dec 2026", bos_token=bos, eos_token=eos
    )
    assert got == want and '"description": "Adds <a> & <b>"' in got


def test_filters_and_globals_equal_transformers(hf_tokenizer):
    template = (
        "{{ messages | tojson }}|{{ messages[0] | tojson(indent=2, sort_keys=true) }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}|"
        "{% generation %}{{ messages[0].content }}{% endgeneration %}|{{ tools }}|{{ documents }}|"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
        "{{ dict(a=1) | tojson }}"
    )
    messages = [{"role": "user", "content": "<é> & 'q'"}, {"role": "assistant", "content": "x"}]
    hf = hf_tokenizer("<s>", "</s>")
    hf.chat_template = template
    assert render_chat_template(template, messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_message_data_equals_transformers(hf_tokenizer):
    """Extra message keys as transformers passes them: None dropped, str subclasses plain, the
    reasoning under each of its names."""
    import enum

    class Role(str, enum.Enum):
        USER = "user"

    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}|{{ m.thinking }}|{{ m.reasoning_content }}|"
        "{{ 'name' in m }}|{{ m.tags | tojson }};{% endfor %}"
    )
    messages = [
        {"role": Role.USER, "content": "a", "reasoning": "r1", "name": None, "tags": ("x", 1)},
        {"role": "assistant", "content": "b", "thinking": "r2", "tags": {"k": [1.5, True]}},
    ]
    hf = hf_tokenizer("<s>", "</s>")
    hf.chat_template = template
    want = hf.apply_chat_template(copy.deepcopy(messages), tokenize=False)
    assert (
        render_chat_template(template, messages)
        == want
        == ('user:a|r1|r1|False|["x", 1];assistant:b|r2|r2|False|{"k": [1.5, true]};')
    )


# ---------------------------------------------------------------------------------------------
# the built-ins against prompts written out by hand (run everywhere)

CONV = [SYSTEM] + HISTORY
HAND = {
    ("chatml", True): "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n",
    ("chatml", False): "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    # Gemma: the system message opens the first user turn, the assistant is "model"
    ("gemma", True): "<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello."
    "<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    ("gemma", False): "<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello."
    "<end_of_turn>\n<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n",
    ("llama3", True): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ("llama3", False): "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2+2?<|eot_id|>",
    # Mistral: the system message folds into the first [INST]; [/INST] already asks for the answer
    ("mistral", True): "<s> [INST] You are terse.\n\nHi! [/INST] Hello.</s> [INST] What is 2+2? [/INST]",
    ("mistral", False): "<s> [INST] You are terse.\n\nHi! [/INST] Hello.</s> [INST] What is 2+2? [/INST]",
}
TOKENS = {
    "chatml": ("<s>", "<|im_end|>"),
    "gemma": ("<bos>", "<eos>"),
    "llama3": ("<|begin_of_text|>", "<|eot_id|>"),
    "mistral": ("<s>", "</s>"),
}


@pytest.mark.parametrize("name, add_generation_prompt", sorted(HAND))
def test_builtins_give_the_hand_written_prompts(name, add_generation_prompt):
    bos, eos = TOKENS[name]
    got = render_chat_template(
        chat_template_by_name(name), CONV, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos
    )
    assert got == HAND[name, add_generation_prompt]


@pytest.mark.parametrize(
    "name, want",
    [
        ("chatml", "<|im_start|>user\n  padded  <|im_end|>\n<|im_start|>assistant\n"),
        ("gemma", "<bos><start_of_turn>user\npadded<end_of_turn>\n<start_of_turn>model\n"),
        (
            "llama3",
            "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        ),
        ("mistral", "<s> [INST]   padded   [/INST]"),
    ],
)
def test_one_turn_without_system(name, want):
    """No system message; Gemma and Llama 3 trim the content, the others keep it as it is."""
    bos, eos = TOKENS[name]
    assert (
        render_chat_template(
            chat_template_by_name(name), [{"role": "user", "content": "  padded  "}], bos_token=bos, eos_token=eos
        )
        == want
    )


def test_the_fixture_templates_by_hand():
    """Qwen2.5 adds its default system message; Llama 3.1 writes its dated system header."""
    qwen = render_chat_template(fixture("qwen2.5"), HISTORY[:1])
    assert qwen == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
        "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    llama = render_chat_template(fixture("llama3.1"), [SYSTEM] + HISTORY[:1], bos_token="<|begin_of_text|>")
    assert llama == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_environment_filters_and_globals():
    """transformers' tojson (no HTML escaping, its keywords), loopcontrols, {% generation %},
    strftime_now, and the variables every template sees."""
    messages = [{"role": "user", "content": "<é> & 'q'"}, {"role": "assistant", "content": "x"}]
    assert render_chat_template("{{ messages[0] | tojson }}", messages) == '{"role": "user", "content": "<é> & \'q\'"}'
    assert render_chat_template("{{ {'b': 1, 'a': [1]} | tojson(indent=1, sort_keys=true) }}", messages) == (
        '{\n "a": [\n  1\n ],\n "b": 1\n}'
    )
    loop = "{% for m in messages %}{% if m.role == 'assistant' %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render_chat_template(loop, messages) == "user"
    skip = "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"
    assert render_chat_template(skip, messages) == "x"
    assert render_chat_template("{% generation %}[{{ messages[1].content }}]{% endgeneration %}", messages) == "[x]"
    before = datetime.now().strftime("%Y-%m-%d")
    today = render_chat_template("{{ strftime_now('%Y-%m-%d') }}", messages)
    assert today in (before, datetime.now().strftime("%Y-%m-%d"))
    assert (
        render_chat_template(
            "{{ tools }} {{ documents }} {{ add_generation_prompt }} {{ bos_token }}|",
            messages,
            add_generation_prompt=False,
        )
        == "None None False |"
    )
    assert render_chat_template("{{ enable_thinking }}", messages, enable_thinking=False) == "False"
    # trim_blocks and lstrip_blocks: a block tag's own line leaves nothing behind
    assert render_chat_template("  {% if true %}\nA\n  {% endif %}\nB", messages) == "A\nB"


def test_messages_are_passed_as_data_and_left_unchanged():
    messages = [{"role": "user", "content": "hi", "name": "ann", "tool_calls": None}]
    kept = copy.deepcopy(messages)
    out = render_chat_template("{{ messages[0].name }} {{ 'tool_calls' in messages[0] }}", messages)
    assert out == "ann False" and messages == kept  # a None key is dropped, as transformers does


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hi", r"messages must be a list of \{'role': str, 'content': str\} dicts, got str"),
        ({"role": "user", "content": "hi"}, r"messages must be a list .* got dict"),
        (None, r"messages must be a list .* got NoneType"),
        ([], r"messages is empty: allowed a list of at least one"),
        (["hi"], r"messages\[0\] is a str: allowed a \{'role': str, 'content': str\} dict"),
        ([{"content": "hi"}], r"messages\[0\]\['role'\] is None: allowed a string \(such as 'system', 'user'"),
        ([{"role": "user"}], r"messages\[0\]\['content'\] is None: allowed a string"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": 3}],
            r"messages\[1\]\['content'\] is 3: allowed a string",
        ),
        ([{"role": "", "content": "hi"}], r"messages\[0\]\['role'\] is '': allowed a non-empty string"),
        (
            [{"role": "user", "content": "hi", "meta": object()}],
            r"messages\[0\]\['meta'\] holds a object: allowed JSON data",
        ),
    ],
)
def test_bad_messages(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat_template(chat_template_by_name("chatml"), messages)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(template=""), r"template must be a non-empty Jinja text"),
        (dict(template=None), r"template must be a non-empty Jinja text"),
        (dict(add_generation_prompt=1), r"add_generation_prompt=1 is out of range: allowed True or False"),
        (dict(bos_token=None), r"bos_token=None is out of range: allowed the token's text"),
        (dict(eos_token=2), r"eos_token=2 is out of range: allowed the token's text"),
        (dict(tools=[print]), r"tools holds a builtin_function_or_method: allowed JSON data"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(template=chat_template_by_name("chatml"), messages=HISTORY[:1])
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        render_chat_template(args.pop("template"), args.pop("messages"), **args)


def test_a_template_that_raises_keeps_its_message():
    """Gemma's template refuses a conversation whose roles do not alternate."""
    with pytest.raises(
        ValueError,
        match=r"the model's chat template refused these messages: Conversation roles "
        r"must alternate user/assistant/user/assistant/\.\.\.",
    ):
        render_chat_template(chat_template_by_name("gemma"), [{"role": "assistant", "content": "hi"}])
    with pytest.raises(ValueError, match=r"refused these messages: Only user and assistant roles are supported"):
        render_chat_template(
            chat_template_by_name("mistral"), [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]
        )


@pytest.mark.parametrize(
    "template, match",
    [
        ("{% for m in messages %}{{ m.content }}", r"not valid Jinja \(line 1: Unexpected end of template"),
        ("ok\n{{ messages[0].content + }}", r"not valid Jinja \(line 2: "),
        ("{% generation %}unclosed", r"not valid Jinja"),
        ("{% unknown_tag %}", r"not valid Jinja \(line 1: Encountered unknown tag 'unknown_tag'"),
    ],
)
def test_jinja_syntax_errors(template, match):
    with pytest.raises(ValueError, match=r"the model's chat template is " + match):
        render_chat_template(template, HISTORY[:1])


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages[0].content + 1 }}",  # str + int
        "{{ messages[5].content.upper() }}",  # an undefined message
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # the sandbox: no way to Python internals
        "{% set _ = messages.append({}) %}",  # immutable: the caller's data cannot change
        "{% set ns = namespace(_hidden=1) %}",  # transformers' namespace: no underscore names
    ],
)
def test_template_failures_and_the_sandbox(template):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"the model's chat template failed on these messages \("):
        render_chat_template(template, messages)
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("name", ["", "ChatML", "llama2", None, "gemma3"])
def test_unknown_builtin_names(name):
    with pytest.raises(
        ValueError,
        match=r"is not a built-in chat template: allowed one of \['chatml', 'gemma', "
        r"'llama3', 'mistral'\]",
    ):
        chat_template_by_name(name)
