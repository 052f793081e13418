"""Chat templates: a conversation as the prompt text a chat model was trained on.

:func:`render_chat_template` renders a model's Jinja chat template (GGUF
``tokenizer.chat_template``, ``tokenizer_config.json``'s ``chat_template``) exactly as
``transformers``' ``apply_chat_template(..., tokenize=False)`` does: the same sandboxed Jinja
environment (``trim_blocks``, ``lstrip_blocks``, ``loopcontrols``, ``{% generation %}`` blocks), the
same ``tojson`` filter, the ``raise_exception`` and ``strftime_now`` globals and the same variables
(``messages``, ``add_generation_prompt``, ``tools``, ``documents``, the special-token texts and any
extra keywords). :func:`chat_template_by_name` gives built-in templates for files that carry none
(llama.cpp keeps built-ins for the same reason): :data:`BUILTIN_TEMPLATES`.

The rendered text is tokenized as it is, special-token texts included, without adding special
tokens: a template that writes ``bos_token`` itself already starts with BOS (see
``docs/chat_templates.md`` for how ``python -m kvjax generate --chat`` avoids a second one).

Example:
    >>> text = render_chat_template(chat_template_by_name("chatml"), [
    ...     {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}])
    >>> print(text)
    <|im_start|>system
    Be brief.<|im_end|>
    <|im_start|>user
    Hi!<|im_end|>
    <|im_start|>assistant
    <BLANKLINE>
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Dict, List, Mapping, Sequence
from kvjax._validate import check_flag

__all__ = ["render_chat_template", "chat_template_by_name", "BUILTIN_TEMPLATES"]

# Built-in templates, each the official Jinja text of its model family (verbatim, so a model
# rendered with a built-in gets the same prompt as with its own template). Sources: the
# ``chat_template`` of each model's ``tokenizer_config.json`` on the Hugging Face Hub, read from
# public copies of those files.
BUILTIN_TEMPLATES: Dict[str, str] = {
    # ChatML, as teknium/OpenHermes-2.5-Mistral-7B ships it (and transformers' chat-templating
    # docs show it): no system default, no BOS. Qwen2/2.5 and many fine-tunes use this turn format.
    "chatml": (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
        "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% endif %}"
    ),
    # google/gemma-3-{1b,4b,12b,27b}-it: a system message becomes a prefix of the first user turn
    # (Gemma has no system role), the assistant's role is "model", contents are trimmed.
    "gemma": (
        "{{ bos_token }}\n"
        "{%- if messages[0]['role'] == 'system' -%}\n"
        "    {%- if messages[0]['content'] is string -%}\n"
        "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
        "    {%- else -%}\n"
        "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
        "    {%- endif -%}\n"
        "    {%- set loop_messages = messages[1:] -%}\n"
        "{%- else -%}\n"
        "    {%- set first_user_prefix = \"\" -%}\n"
        "    {%- set loop_messages = messages -%}\n"
        "{%- endif -%}\n"
        "{%- for message in loop_messages -%}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
        "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
        "    {%- endif -%}\n"
        "    {%- if (message['role'] == 'assistant') -%}\n"
        "        {%- set role = \"model\" -%}\n"
        "    {%- else -%}\n"
        "        {%- set role = message['role'] -%}\n"
        "    {%- endif -%}\n"
        "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
        "    {%- if message['content'] is string -%}\n"
        "        {{ message['content'] | trim }}\n"
        "    {%- elif message['content'] is iterable -%}\n"
        "        {%- for item in message['content'] -%}\n"
        "            {%- if item['type'] == 'image' -%}\n"
        "                {{ '<start_of_image>' }}\n"
        "            {%- elif item['type'] == 'text' -%}\n"
        "                {{ item['text'] | trim }}\n"
        "            {%- endif -%}\n"
        "        {%- endfor -%}\n"
        "    {%- else -%}\n"
        "        {{ raise_exception(\"Invalid content type\") }}\n"
        "    {%- endif -%}\n"
        "    {{ '<end_of_turn>\n' }}\n"
        "{%- endfor -%}\n"
        "{%- if add_generation_prompt -%}\n"
        "    {{'<start_of_turn>model\n'}}\n"
        "{%- endif -%}\n"
    ),
    # meta-llama/Meta-Llama-3-8B-Instruct (and -70B-Instruct): header-delimited turns, BOS first,
    # contents trimmed. Llama 3.1+ templates add a dated system header and tool use on this format.
    "llama3": (
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
        "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
        "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
        "{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    # mistralai/Mistral-7B-Instruct-v0.1 / -v0.2 (their updated template): [INST] turns, a system
    # message folded into the first one, each answer closed by EOS, no generation prompt needed.
    "mistral": (
        "{%- if messages[0]['role'] == 'system' %}\n"
        "    {%- set system_message = messages[0]['content'] %}\n"
        "    {%- set loop_messages = messages[1:] %}\n"
        "{%- else %}\n"
        "    {%- set loop_messages = messages %}\n"
        "{%- endif %}\n"
        "\n"
        "{{- bos_token }}\n"
        "{%- for message in loop_messages %}\n"
        "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\n"
        "        {{- raise_exception('After the optional system message, conversation roles must alternate "
        "user/assistant/user/assistant/...') }}\n"
        "    {%- endif %}\n"
        "    {%- if message['role'] == 'user' %}\n"
        "        {%- if loop.first and system_message is defined %}\n"
        "            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}\n"
        "        {%- else %}\n"
        "            {{- ' [INST] ' + message['content'] + ' [/INST]' }}\n"
        "        {%- endif %}\n"
        "    {%- elif message['role'] == 'assistant' %}\n"
        "        {{- ' ' + message['content'] + eos_token}}\n"
        "    {%- else %}\n"
        "        {{- raise_exception('Only user and assistant roles are supported, with the exception of an "
        "initial optional system message!') }}\n"
        "    {%- endif %}\n"
        "{%- endfor %}\n"
    ),
}


def chat_template_by_name(name: str) -> str:
    """The Jinja text of a built-in chat template (:data:`BUILTIN_TEMPLATES`).

    Args:
        name: ``"chatml"``, ``"gemma"``, ``"llama3"`` or ``"mistral"``.

    Raises:
        ValueError: an unknown name (the message lists the allowed ones).
    """
    if not isinstance(name, str) or name not in BUILTIN_TEMPLATES:
        raise ValueError(f"name {name!r} is not a built-in chat template: allowed one of {sorted(BUILTIN_TEMPLATES)}")
    return BUILTIN_TEMPLATES[name]


class _TemplateRaised(Exception):
    """What the template's ``raise_exception(message)`` throws: told apart from a broken template."""


def _jinja():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ValueError("rendering a chat template needs the jinja2 package: pip install 'jinja2>=3.1.6'") from None
    # chat templates come with model files, so they are untrusted code: jinja2 before 3.1.6 has
    # known sandbox escapes (transformers refuses it for the same reason)
    version = tuple(int(p) if p.isdigit() else 0 for p in jinja2.__version__.split(".")[:3])
    if version < (3, 1, 6):
        raise ValueError(
            f"jinja2 {jinja2.__version__} has known sandbox escapes: allowed jinja2 >= 3.1.6 (pip install -U jinja2)"
        )
    return jinja2


@lru_cache(maxsize=32)
def _compile(template: str):
    """The template compiled in transformers' environment (cached: a chat renders every turn)."""
    jinja2 = _jinja()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # transformers' ``{% generation %}...{% endgeneration %}`` marks the assistant's text for
        # its training masks and renders the body unchanged; without the tag such templates would
        # not even parse
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise _TemplateRaised(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: Jinja's own escapes HTML characters (<, >, &, ') and sorts keys
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        # transformers' ``dict``: building dicts only, no attribute access to the dict type
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # transformers' ``namespace``: no underscore attributes (a way into CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                TemplateNamespace._check_name(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            TemplateNamespace._check_name(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check_name(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot set the underscore attribute {key!r} on a namespace"
                )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(
            f"the model's chat template is not valid Jinja (line {e.lineno}: {e.message}): allowed a "
            f"template transformers' apply_chat_template renders"
        ) from None


def _plain(value, where: str):
    """``value`` rebuilt from JSON types (all a template may see: the sandbox knows nothing of other
    objects' methods), as transformers rebuilds it; a ValueError naming ``where`` for anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # subclasses (str enums, IntEnum, numpy's float64) come back as the base type, without their methods
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, where) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v, where) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v, where) for v in value)
    raise ValueError(
        f"{where} holds a {type(value).__name__}: allowed JSON data (str, int, float, bool, None, "
        f"lists and dicts of them)"
    )


#: the names a message's reasoning comes under; templates read the first (transformers >= 5 fills it
#: from the others, and ``thinking`` for templates that read that)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _check_messages(messages) -> List[Dict[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(
            f"messages must be a list of {{'role': str, 'content': str}} dicts, got {type(messages).__name__}"
        )
    if not messages:
        raise ValueError("messages is empty: allowed a list of at least one {'role': str, 'content': str} dict")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] is a {type(m).__name__}: allowed a {{'role': str, 'content': str}} dict")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(
                    f"messages[{i}][{key!r}] is {m.get(key)!r}: allowed a string"
                    + (" (such as 'system', 'user', 'assistant')" if key == "role" else "")
                )
        if not m["role"]:
            raise ValueError(
                f"messages[{i}]['role'] is '': allowed a non-empty string (such as 'system', 'user', 'assistant')"
            )
        # other keys (a message's name, tool calls) go to the template as they are; keys set to
        # None are dropped, as transformers drops them (templates test for a missing key)
        message = {
            _plain(k, f"messages[{i}]"): _plain(v, f"messages[{i}][{k!r}]") for k, v in m.items() if v is not None
        }
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(
    template: str, messages, *, add_generation_prompt: bool = True, bos_token: str = "", eos_token: str = "", **extra
) -> str:
    """The prompt text of a conversation, rendered as ``transformers``' ``apply_chat_template``.

    Args:
        template: the Jinja text (a model file's chat template, or :func:`chat_template_by_name`).
        messages: the conversation, a list of ``{"role": str, "content": str}`` dicts (extra keys
            are passed to the template).
        add_generation_prompt: end with the opening of the assistant's turn (what generation
            continues from).
        bos_token, eos_token: the tokenizer's BOS / EOS token texts (``<s>``, ``<bos>``, ...), as
            templates write them.
        **extra: more template variables (``tools``, ``date_string``, ``enable_thinking``, ...),
            as ``apply_chat_template``'s keywords; they override the defaults above.

    Returns:
        The text, special tokens written as their texts (tokenize it without adding special tokens).

    Raises:
        ValueError: bad ``messages`` or arguments; a template that is not valid Jinja, that calls
            ``raise_exception`` (its message is kept) or that fails on these messages.
    """
    if not isinstance(template, str) or not template:
        raise ValueError(f"template must be a non-empty Jinja text, got {template!r:.60}")
    check_flag("add_generation_prompt", add_generation_prompt)
    for name, value in (("bos_token", bos_token), ("eos_token", eos_token)):
        if not isinstance(value, str):
            raise ValueError(f"{name}={value!r} is out of range: allowed the token's text (a string, '' for none)")
    chat = _check_messages(messages)
    compiled = _compile(template)
    # the variables transformers passes: tools and documents are always there (None by default),
    # then the special tokens, then the caller's keywords over both
    variables = dict(tools=None, documents=None, bos_token=bos_token, eos_token=eos_token)
    variables.update({k: _plain(v, k) for k, v in extra.items()})
    variables.update(messages=chat, add_generation_prompt=add_generation_prompt)
    try:
        return compiled.render(**variables)
    except _TemplateRaised as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None
    except Exception as e:  # anything the template's own code hits (an undefined name, str + None, ...)
        raise ValueError(f"the model's chat template failed on these messages ({type(e).__name__}: {e})") from None
