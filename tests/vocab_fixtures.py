"""Tiny GGUF vocabularies, built the same way every time, and the texts they are checked on.

``scripts/make_vocab_fixtures.py`` runs each vocabulary here through llama.cpp (llama-cpp-python)
once and commits what llama.cpp answers under ``tests/data/vocab/``; ``tests/test_gguf_vocab.py``
writes the same files again and checks that kvjax answers the same. Both import this module, so
the files they see are byte for byte the same: nothing here is random, trained by a library whose
version may change, or ordered by a hash.

The vocabularies are learned here, in plain Python, from :data:`CORPUS`:

* ``spm``: a SentencePiece-style vocabulary (``tokenizer.ggml.model = 'llama'``) of single
  characters, the 256 ``<0xXX>`` byte tokens, and pieces merged from the most frequent pairs of
  U+2581-escaped words, scored so that some scores tie (llama.cpp breaks ties leftmost first); plus
  control, user-defined, unknown and unused tokens. ``spm-noprefix`` is the same without
  ``add_space_prefix`` and with ``add_eos``.
* ``bpe-<pre>``: a byte-level BPE (``'gpt2'``) with ``tokenizer.ggml.pre = <pre>``, the GPT-2 byte
  alphabet, the learned merges, a whole-word token no merge reaches (``ignore_merges`` kinds take
  it whole), and special tokens of each type.
"""

from __future__ import annotations

import collections
import re

#: The ``tokenizer.ggml.pre`` kinds the BPE fixtures cover.
BPE_PRES = (
    "default",
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "deepseek-llm",
    "deepseek-coder",
    "falcon",
    "starcoder",
    "refact",
    "command-r",
    "smollm",
    "gpt-4o",
    "mpt",
    "stablelm2",
    "chatglm-bpe",
    "tekken",
    "poro-chat",
    "viking",
)

CORPUS = """The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
kvjax caches keys and values for every sequence, like llama.cpp's KV cache does.
def forward(self, x):
    return self.linear(x) + 1
for i in range(10):
    print(i, i * i)
Numbers: 12345, 2026-12-06, 3.14159, 1000000 and 42.
She said: "It's fine, we'll see; they're here, I'm sure you've heard." Don't worry!
Café, naïve, über, crème brûlée, señor, Ærø, straße.
日本語のテキストと中文的句子。 Привет, мир! Γειά σου κόσμε.
   indented line with spaces	and a tab
Return a new list of items, sorted by key; the items are kept in order of insertion.
"""

#: Texts every fixture is checked on: prose, code, whitespace runs, digits, CJK, emoji, accents,
#: special-token strings, and pieces the vocabularies have never seen.
TEXTS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n",
    " \n ",
    "\t\t x",
    "a",
    "A",
    " a",
    "a ",
    "  a  b   c    ",
    "Hello world",
    "Hello, world!",
    " Hello world",
    "Hello  world",
    "hello\nworld",
    "hello\n\nworld\n",
    "The quick brown fox jumps over the lazy dog.",
    "the lazy dog jumps",
    "THE QUICK BROWN FOX",
    "kvjax caches keys and values",
    " kvjax",
    "kvjax",
    "llama.cpp's KV cache",
    "It's fine, we'll see.",
    "they're here; I'm sure you've heard",
    "Don't worry!",
    "I 'm here ' and ' there",
    "x ' ' y",
    "a ' ' ' b",
    " ' ",
    "it 's we 're you 've I 'll 'd",
    "what ? yes . no , ok !",
    "def forward(self, x):\n    return self.linear(x) + 1\n",
    "for i in range(10):\n\tprint(i)",
    "if (a && b) { return c->d[0]; }",
    "x = {'k': [1, 2, 3]}  # comment",
    "<div class=\"x\">hi</div>",
    "0",
    "7",
    "42",
    "123",
    "1234",
    "12345",
    "123456789",
    "3.14159",
    "2026-12-06",
    "1,000,000",
    "x1y22z333",
    "Numbers: 12345 and 42.",
    "١٢٣ ٤٥٦",
    "①②③",
    "Café",
    "naïve café",
    "über straße",
    "crème brûlée",
    "señor Ærø",
    "e\u0301",
    "Ångström",
    "日本語",
    "日本語のテキスト",
    "中文的句子。",
    "한국어 텍스트",
    "Привет, мир!",
    "Γειά σου κόσμε",
    "مرحبا بالعالم",
    "שלום",
    "हिन्दी",
    "ภาษาไทย",
    "🙂",
    "🙂🙂",
    "emoji 🙂 here",
    "👨‍👩‍👧 family",
    "🇫🇷 flag",
    "€100 and £5 and ¥3",
    "≤ ≥ ≠ ∑ ∫ √",
    "→ ← ↑ ↓",
    "\u00a0non-breaking\u00a0space",
    "zero\u200bwidth",
    "tab\tseparated\tvalues",
    "line\r\nbreak",
    "trailing spaces   ",
    "   leading spaces",
    "\n\n\nthree newlines",
    "mixed \t\n whitespace",
    "<s>",
    "</s>",
    "<unk>",
    "<s>hello</s>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>",
    "<end_of_turn>",
    "<mask>",
    "a<mask>b",
    "<unused0>",
    "<|im_end|>",
    "x<|im_end|>y",
    "<|begin_of_text|>hello",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<tool>call</tool>",
    "<tool><tool>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<bos>hi<eos>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>",
    "<<mask>>",
    "<start_of_turn",
    "end_of_turn>",
    "<|im_start|>system\nYou are kind.<|im_end|>",
    "[multimodal]",
    "<pad><eos><bos>",
    "<0x41>",
    "<0xFF>",
    "\u2581",
    "\u2581\u2581x",
    "▁hello",
    "Ġhello",
    "ü",
    "ÿ",
    "\x00",
    "\x7f",
    "a\x01b",
    "\ufeffbom",
    "�",
    "mañana",
    "ﬁ ligature",
    "Ⅻ",
    "ｆｕｌｌ",
    "The dog sleeps; the fox runs away.",
    "Return a new list of items, sorted by key.",
    "kv cache for every sequence",
    "values, keys, caches",
    "sequence sequences sequenced",
    "aaaaaaaaaaaaaaaa",
    "abababababab",
    "the the the the",
    "..........",
    "!!!???",
    "----====",
    "https://example.com/path?q=1&r=2",
    "user@example.com",
    "C:\\Users\\name",
    "snake_case_name",
    "camelCaseName",
    "PascalCaseName",
    "SCREAMING_CASE",
    "kebab-case-name",
    "a.b.c.d",
    "#hashtag @mention",
    "$100.00",
    "50%",
    "x^2 + y^2 = z^2",
    "f(x) = 3x + 2",
    "[1, 2, 3]",
    "(a, b)",
    "{\"key\": \"value\"}",
    "'single' \"double\" `back`",
    "It’s curly ‘quotes’ “here”",
    "em—dash and en–dash",
    "ellipsis…",
    "　ideographic space",
    "fox\u3000dog",
    "x" * 40,
    " " * 17 + "deep",
    "\n" * 5,
    "\t" * 6,
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12",
    "2+2=4",
    "1e-5",
    "0xFF",
    "v1.2.3",
    "3rd 2nd 1st",
    "The Quick Brown Fox: a story.\n\nChapter 1\n\nOnce upon a time, there was a fox.",
]


def _generated(n: int = 130):
    """``n`` texts mixed from word, space and special-token fragments by a fixed linear congruential
    generator (not ``random``: its sequence is not promised across Python versions)."""
    words = [w for line in CORPUS.split("\n") for w in line.split(" ") if w]
    extra = [
        "  ",
        "   ",
        "\t",
        "\n",
        "\n\n",
        " \n",
        "<start_of_turn>",
        "<end_of_turn>",
        "<mask>",
        "<|im_end|>",
        "<|eot_id|>",
        "<tool>",
        "<s>",
        "</s>",
        "🙂",
        "日本",
        "é",
        "123",
        "4567",
        "'s",
        "'ll",
        " ,",
        " .",
        " ?",
        "?!",
    ]
    state = 12345
    out = []
    for _ in range(n):
        parts = []
        state = (state * 1103515245 + 12345) % 2**31
        for _ in range(2 + state % 9):
            state = (state * 1103515245 + 12345) % 2**31
            pool = extra if state % 4 == 0 else words
            state = (state * 1103515245 + 12345) % 2**31
            parts.append(pool[state % len(pool)])
            state = (state * 1103515245 + 12345) % 2**31
            parts.append(" " if state % 3 else "")
        out.append("".join(parts))
    return out


TEXTS += _generated()

#: GPT-2's byte -> printable character table (byte-level BPE writes every byte as one of these).
BYTE_CHARS = {}
_n = 0
for _b in range(256):
    if 33 <= _b <= 126 or 161 <= _b <= 172 or 174 <= _b <= 255:
        BYTE_CHARS[_b] = chr(_b)
    else:
        BYTE_CHARS[_b] = chr(256 + _n)
        _n += 1
del _b, _n


def _learn(words, n_merges):
    """The ``n_merges`` most frequent adjacent pairs, merged greedily (ties: smallest pair first).

    ``words`` is a list of symbol tuples; returns the merges in order as ``(left, right)``."""
    counts = collections.Counter(words)
    vocab = {w: c for w, c in counts.items()}
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in vocab.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))[0]
        merges.append(best)
        new = {}
        for w, c in vocab.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] = new.get(tuple(out), 0) + c
        vocab = new
    return merges


def spm_vocab(n_merges: int = 300):
    """``(tokens, scores, types)`` of the SentencePiece fixture vocabulary."""
    head = [
        ("<unk>", 0.0, 2),
        ("<s>", 0.0, 3),
        ("</s>", 0.0, 3),
        ("<start_of_turn>", 0.0, 3),
        ("<end_of_turn>", 0.0, 3),
        ("<mask>", 0.0, 4),
        ("<unused0>", 0.0, 3),
        ("<|im_end|>", 0.0, 1),
        ("<unused_t5>", 0.0, 5),
        ("\n\n", 0.0, 4),
    ]
    tokens = [t for t, _, _ in head]
    scores = [s for _, s, _ in head]
    types = [ty for _, _, ty in head]
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        scores.append(0.0)
        types.append(6)
    text = CORPUS.replace(" ", "\u2581")
    chars = sorted(set(text) - {"\n"})
    for i, c in enumerate(chars):
        tokens.append(c)
        scores.append(-1000.0 - i)
        types.append(1)
    words = [tuple("\u2581" + w) for line in CORPUS.split("\n") for w in line.split(" ") if w]
    seen = set(tokens)
    for rank, (a, b) in enumerate(_learn(words, n_merges)):
        if a + b in seen:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        scores.append(-float(rank // 3))  # every third score ties: llama.cpp merges the leftmost first
        types.append(1)
    return tokens, scores, types


def bpe_vocab(n_merges: int = 300):
    """``(tokens, merges, types)`` of the byte-level BPE fixture vocabulary."""
    tokens = [BYTE_CHARS[b] for b in range(256)]
    pieces = re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+", CORPUS)
    words = [tuple(BYTE_CHARS[b] for b in p.encode()) for p in pieces]
    seen = set(tokens)
    merges = []
    for a, b in _learn(words, n_merges):
        merges.append(f"{a} {b}")
        if a + b not in seen:
            seen.add(a + b)
            tokens.append(a + b)
    types = [1] * len(tokens)
    # a whole word that no merge builds: 'ignore_merges' kinds (llama3) take it as one token
    for extra, ty in (
        ("\u0120kvjax", 1),
        ("<|begin_of_text|>", 3),
        ("<|end_of_text|>", 3),
        ("<|eot_id|>", 3),
        ("<|im_end|>", 1),
        ("<tool>", 4),
        ("<|start_header_id|>", 3),
        ("<|end_header_id|>", 3),
    ):
        tokens.append(extra)
        types.append(ty)
    return tokens, merges, types


def _writer(path):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads the architecture's hyperparameters even for a vocabulary-only load
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    return w


def _close(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def add_spm_vocab(w, *, add_eos: bool = False):
    """Add the SentencePiece fixture vocabulary's keys to the ``gguf.GGUFWriter`` ``w``."""
    tokens, scores, types = spm_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(add_eos)
    return len(tokens)


def write_spm(path, *, add_space_prefix: bool = True, add_eos: bool = False):
    """Write the SentencePiece fixture vocabulary to ``path`` (a GGUF file without tensors)."""
    w = _writer(path)
    add_spm_vocab(w, add_eos=add_eos)
    if not add_space_prefix:  # absent means True, as llama.cpp reads it
        w.add_add_space_prefix(False)
    w.add_chat_template(
        "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    )
    _close(w)
    return path


def write_bpe(path, pre: str):
    """Write the byte-level BPE fixture vocabulary with ``tokenizer.ggml.pre = pre`` to ``path``."""
    tokens, merges, types = bpe_vocab()
    w = _writer(path)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types(types)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|end_of_text|>"))
    w.add_add_bos_token(True)
    _close(w)
    return path


def vocab_digest(name: str) -> str:
    """A SHA-256 of the fixture vocabulary ``name``'s content (its name, which fixes the flags
    :func:`write_vocab` writes, and its tokens, scores or merges, types): the fixtures record it, so
    a test can tell that it checks the vocabulary llama.cpp saw."""
    import hashlib
    import json

    if name.startswith("spm"):
        content = [name, *spm_vocab()]
    else:
        content = [name, *bpe_vocab()]
    return hashlib.sha256(json.dumps(content, ensure_ascii=False).encode("utf-8")).hexdigest()


def vocab_names():
    """Every fixture vocabulary's name: ``spm``, ``spm-noprefix``, ``bpe-<pre>``."""
    return ["spm", "spm-noprefix"] + [f"bpe-{p}" for p in BPE_PRES]


def write_vocab(name: str, path):
    """Write the fixture vocabulary ``name`` (one of :func:`vocab_names`) to ``path``."""
    if name == "spm":
        return write_spm(path)
    if name == "spm-noprefix":
        return write_spm(path, add_space_prefix=False, add_eos=True)
    if name.startswith("bpe-") and name[4:] in BPE_PRES:
        return write_bpe(path, name[4:])
    raise ValueError(f"name={name!r} is out of range: allowed {vocab_names()}")
