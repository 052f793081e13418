"""The vocabulary of a llama.cpp GGUF file as a tokenizer backend (:func:`gguf_tokenizer`).

:class:`GGUFBackend` tokenizes and detokenizes the way llama.cpp does for the two vocabulary kinds
its text models ship:

* SentencePiece (``tokenizer.ggml.model = 'llama'``: Llama 2, Gemma, Mistral v1): spaces escaped to
  U+2581, a space put in front of the text and of the text after each special token when
  ``tokenizer.ggml.add_space_prefix`` says so (true when the key is absent), then the score-ordered
  pair merging of :func:`kvjax.nn._spm.spm_merge` with ``<0xXX>`` byte fallback.
* Byte-level BPE (``'gpt2'``: Llama 3, Qwen2, GPT-2 and their kin): the text split by the regular
  expressions of its ``tokenizer.ggml.pre`` kind (:data:`BPE_PRE_KINDS`), each piece byte-encoded
  and merged by rank with the ``tokenizers`` library's BPE.

Before either, the text is cut at special-token strings: user-defined tokens (token type 4) always,
control and unknown tokens (types 3 and 2) only with ``special=True`` (otherwise they are plain
text). Longer tokens are cut out first, over the whole text, as llama.cpp does. Detokenizing maps
each id to its piece (U+2581 back to a space, a byte token back to its byte, byte-level characters
back to bytes, control tokens to nothing unless rendered), drops one leading space where a space
prefix was added, and for most BPE kinds tidies the spaces before punctuation
(``clean_up_tokenization_spaces``).

The end-of-generation ids are llama.cpp's: the EOS, EOT and EOM ids of the metadata plus every token
whose text marks the end of a turn (``<end_of_turn>``, ``<|eot_id|>``, ``<|im_end|>``, ...) and the
fill-in-the-middle pad / repo / file-separator tokens; tokens recognised that way count as control
tokens even where the file calls them normal.

Example:
    >>> import gguf, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "v.gguf")
    >>> w = gguf.GGUFWriter(path, "llama")
    >>> w.add_tokenizer_model("llama")
    >>> w.add_token_list(["<unk>", "<s>", "</s>", "\\u2581", "h", "i", "\\u2581h", "\\u2581hi"])
    >>> w.add_token_scores([0.0, 0.0, 0.0, -5.0, -5.0, -5.0, -1.0, -0.5])
    >>> w.add_token_types([2, 3, 3, 1, 1, 1, 1, 1])
    >>> for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
    ...     step()
    >>> vocab = gguf_tokenizer(path)
    >>> vocab.bos_id, vocab.eos_ids, vocab.add_bos
    (1, (2,), True)
    >>> ids = vocab.tokenizer.encode("hi</s>").ids
    >>> ids, vocab.tokenizer.decode(ids), vocab.tokenizer.decode(ids, skip_special_tokens=False)
    ([7, 2], 'hi', 'hi</s>')
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from kvjax.nn._gguf_file import _field, _open
from kvjax.nn._spm import spm_merge

__all__ = ["gguf_tokenizer", "GGUFVocab", "GGUFBackend", "BPE_PRE_KINDS"]


class GGUFVocab(NamedTuple):
    """What :func:`gguf_tokenizer` returns.

    Attributes:
        tokenizer: the :class:`GGUFBackend` (``encode`` / ``decode`` / ``get_vocab_size`` like a
            ``tokenizers.Tokenizer``).
        bos_id: the BOS id (``tokenizer.ggml.bos_token_id``; SentencePiece files without the key
            use 1, as llama.cpp does), or ``None``.
        eos_ids: the ids that end generation: EOS first, then EOT (Llama 3 instruct ends turns
            with it), then the rest of llama.cpp's end-of-generation set in id order.
        add_bos: whether prompts start with BOS (``tokenizer.ggml.add_bos_token``, else the
            vocabulary kind's llama.cpp default).
    """

    tokenizer: Any
    bos_id: Optional[int]
    eos_ids: Tuple[int, ...]
    add_bos: bool


# token attributes (a token may gain some: a control-looking normal token becomes control)
_UNDEFINED, _NORMAL, _UNKNOWN, _CONTROL, _USER, _UNUSED, _BYTE = 0, 1, 2, 4, 8, 16, 32
#: GGUF ``tokenizer.ggml.token_type`` value -> attribute (0 is "undefined": never rendered)
_TYPE_ATTR = {0: _UNDEFINED, 1: _NORMAL, 2: _UNKNOWN, 3: _CONTROL, 4: _USER, 5: _UNUSED, 6: _BYTE}

# Token texts llama.cpp recognises. A model's end of turn:
_EOT_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<end_of_utterance>",
)
# ...and everything that ends generation (a superset of the above)
_EOG_TEXTS = frozenset(
    _EOT_TEXTS
    + (
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "</s>",
        "<|eom_id|>",
        "[EOS]",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "[e~[",
    )
)
# fill-in-the-middle tokens: all control, the last three also end generation
_FIM_TEXTS = {
    "pre": (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<\uff5cfim\u2581begin\uff5c>",
        "<PRE>",
        "\u2581<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<\uff5cfim\u2581hole\uff5c>",
        "<SUF>",
        "\u2581<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<\uff5cfim\u2581end\uff5c>",
        "<MID>",
        "\u2581<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# gpt-oss's channel markers are always rendered (user-defined) whatever their type says
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# -- the BPE pre-tokenizer splits of tokenizer.ggml.pre -------------------------------------------
# Each kind is a sequence of regular expressions: the first splits the text into matches and the
# runs between them, the next splits each of those again, and so on. The expressions are the
# models' own (their tokenizer.json), contractions spelled out case by case as llama.cpp does.
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_LOWER}*"
    rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_LOWER}*|\p{{N}}"
    rf"| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff"
_FINNISH = r" ?[^(\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_SPLIT_REGEXES = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "deepseek-llm": (
        r"[\r\n]",
        rf"\s?[{_DEEPSEEK_LETTERS}]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        f"[{_CJK}]+",
        r"\p{N}+",
    ),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_CJK}]+", r"\p{N}"),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt4o": (_GPT4O,),
    "tekken": (_TEKKEN,),
    "bloom": (_FINNISH,),
    "viking": (_FINNISH, r"\p{N}"),
}

#: ``tokenizer.ggml.pre`` -> (split, ``ignore_merges``, ``clean_up_tokenization_spaces``, default
#: ``add_bos``). ``ignore_merges`` kinds take a pre-tokenized piece that is itself a token whole.
BPE_PRE_KINDS: Dict[str, Tuple[str, bool, bool, bool]] = {
    "default": ("default", False, True, False),
    **{
        k: ("llama3", True, True, True)
        for k in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2")
    },
    **{k: ("llama3", False, True, False) for k in ("dbrx", "smaug-bpe", "chatglm-bpe", "glm4")},
    **{
        k: ("gpt2", False, True, False)
        for k in (
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "gigachat",
            "jina-es",
            "jina-de",
            "jina-v2-es",
            "jina-v2-de",
            "mellum",
        )
    },
    **{k: ("qwen2", False, False, False) for k in ("qwen2", "deepseek-r1-qwen", "kormo")},
    **{k: ("qwen2", False, True, False) for k in ("stablelm2", "megrez")},
    "deepseek-llm": ("deepseek-llm", False, False, False),
    "deepseek-coder": ("deepseek-coder", False, False, False),
    "falcon": ("falcon", False, True, False),
    **{k: ("starcoder", False, True, False) for k in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b")},
    **{k: ("starcoder", False, False, False) for k in ("command-r", "smollm")},
    **{k: ("gpt4o", False, False, False) for k in ("gpt-4o", "llama4")},
    "tekken": ("tekken", True, False, True),
    "poro-chat": ("bloom", False, False, False),
    **{k: ("bloom", False, True, False) for k in ("bloom", "gpt3-finnish")},
    "viking": ("viking", False, False, False),
}

#: ``tokenizer.ggml.pre`` -> its expression, for the kinds split by a single one
_SPLITS = {pre: _SPLIT_REGEXES[v[0]][0] for pre, v in BPE_PRE_KINDS.items() if len(_SPLIT_REGEXES[v[0]]) == 1}

#: the GPT-2 byte-level alphabet: byte -> character, and back
_BYTE_CHAR = {}
_CHAR_BYTE = {}


def _byte_tables():
    if not _BYTE_CHAR:
        extra = 0
        for b in range(256):
            if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:
                c = chr(b)
            else:
                c = chr(256 + extra)
                extra += 1
            _BYTE_CHAR[b] = c
            _CHAR_BYTE[c] = b
    return _BYTE_CHAR, _CHAR_BYTE


class _Encoding(NamedTuple):
    ids: List[int]


class GGUFBackend:
    """A GGUF vocabulary that encodes and decodes as llama.cpp does (see the module docs).

    Built by :func:`gguf_tokenizer`; it answers the calls :class:`kvjax.nn.Tokenizer` makes of a
    ``tokenizers.Tokenizer`` (``encode(...).ids``, ``decode``, ``get_vocab_size``,
    ``token_to_id``, ``id_to_token``), with ``special`` choosing whether control tokens in the text
    are parsed.

    Attributes:
        kind: ``"spm"`` or ``"bpe"``.
        pre: the BPE ``tokenizer.ggml.pre`` kind (``None`` for SentencePiece).
        bos_id, eos_id, unk_id: the special ids (``None`` when absent).
        eog_ids: llama.cpp's end-of-generation ids, sorted.
        add_bos, add_eos: whether llama.cpp adds BOS / EOS to a prompt.
        add_space_prefix: whether a space goes in front of the text (and is dropped when decoding).
        clean_spaces: whether decoding removes spaces before ``?!.,`` and some contractions.
        chat_template: ``tokenizer.chat_template``, or ``None``.
    """

    #: :meth:`encode` takes ``special`` (``kvjax.nn.Tokenizer`` passes its own flag through)
    parses_special = True

    def __init__(
        self,
        *,
        kind: str,
        tokens: List[str],
        attrs: List[int],
        scores: Optional[Sequence[float]] = None,
        merges: Optional[List[str]] = None,
        pre: Optional[str] = None,
        bos_id=None,
        eos_id=None,
        unk_id=None,
        eog_ids=(),
        add_bos=False,
        add_eos=False,
        add_space_prefix=False,
        chat_template: Optional[str] = None,
    ):
        self.kind = kind
        self.pre = pre
        self.tokens = tokens
        self.attrs = attrs
        self.bos_id, self.eos_id, self.unk_id = bos_id, eos_id, unk_id
        self.eog_ids = tuple(sorted(eog_ids))
        self.add_bos, self.add_eos, self.add_space_prefix = add_bos, add_eos, add_space_prefix
        self.chat_template = chat_template
        self._ids = {t: i for i, t in enumerate(tokens)}
        # special strings cut out of the text, longest (in UTF-8 bytes) first; ties by id
        special = [i for i, a in enumerate(attrs) if a & (_CONTROL | _USER | _UNKNOWN)]
        special.sort(key=lambda i: (-len(tokens[i].encode("utf-8", "surrogatepass")), i))
        # user-defined tokens are cut out even without ``special``, unless llama.cpp made them control
        self._special = [(tokens[i], i, attrs[i] & (_USER | _CONTROL | _UNKNOWN) == _USER) for i in special]
        self._pieces: Dict[int, bytes] = {}
        if kind == "spm":
            self.clean_spaces = False
            self._scores = [0.0] * len(tokens) if scores is None else scores
            bytes_ = []
            for b in range(256):
                tid = self._ids.get(f"<0x{b:02X}>")
                if tid is None and b < 0x80:
                    tid = self._ids.get(chr(b))
                bytes_.append(tid)
            self._byte_ids = bytes_
        else:
            split, ignore_merges, self.clean_spaces, _ = BPE_PRE_KINDS[pre]
            self._bpe = _bpe_model(tokens, merges, _SPLIT_REGEXES[split], ignore_merges)

    # -- the tokenizers.Tokenizer calls Tokenizer makes ---------------------------------------------
    def get_vocab_size(self) -> int:
        """The number of tokens."""
        return len(self.tokens)

    def token_to_id(self, text: str) -> Optional[int]:
        """The id of the token whose text is ``text``, or ``None``."""
        return self._ids.get(text)

    def id_to_token(self, i: int) -> Optional[str]:
        """The text of token ``i`` as the vocabulary stores it, or ``None`` out of range."""
        return self.tokens[i] if 0 <= i < len(self.tokens) else None

    def encode(self, text: str, add_special_tokens: bool = False, special: bool = True) -> _Encoding:
        """The ids of ``text`` (``.ids``), as llama.cpp's ``llama_tokenize``.

        Args:
            text: the text.
            add_special_tokens: put BOS in front / EOS at the end where :attr:`add_bos` /
                :attr:`add_eos` say so (llama.cpp's ``add_special``).
            special: parse control and unknown tokens' strings as those tokens (``parse_special``);
                user-defined tokens are parsed either way.
        """
        out: List[int] = []
        if add_special_tokens and self.add_bos:
            out.append(self.bos_id)
        prev_special = True  # a space prefix goes in front of the text and after each special token
        for part in self._partition(text, special):
            if isinstance(part, int):
                out.append(part)
                prev_special = True
                continue
            if self.kind == "spm":
                if self.add_space_prefix and prev_special:
                    part = " " + part
                out += spm_merge(part.replace(" ", "\u2581"), self._ids, self._scores, self._byte_ids, self.unk_id)
            else:
                out += self._bpe.encode(part, add_special_tokens=False).ids
            prev_special = False
        if add_special_tokens and self.add_eos:
            out.append(self.eos_id)
        return _Encoding(out)

    def _partition(self, text: str, special: bool) -> List[Union[str, int]]:
        parts: List[Union[str, int]] = [text] if text else []
        for piece, tid, user in self._special:
            if not (user or special) or piece not in text:
                continue
            cut: List[Union[str, int]] = []
            for part in parts:
                if isinstance(part, int) or piece not in part:
                    cut.append(part)
                    continue
                for k, rest in enumerate(part.split(piece)):
                    if k:
                        cut.append(tid)
                    if rest:
                        cut.append(rest)
            parts = cut
        return parts

    def piece(self, i: int, special: bool = True) -> bytes:
        """The bytes token ``i`` stands for (llama.cpp's ``token_to_piece``); control and unknown
        tokens give ``b""`` unless ``special``, unused and undefined tokens always do."""
        attr = self.attrs[i]
        if attr & (_CONTROL | _UNKNOWN) and not special:
            return b""
        got = self._pieces.get(i)
        if got is None:
            text = self.tokens[i]
            if attr & (_CONTROL | _UNKNOWN | _USER):
                got = text.encode("utf-8", "surrogatepass")
            elif attr & _NORMAL:
                if self.kind == "spm":
                    got = text.replace("\u2581", " ").encode("utf-8", "surrogatepass")
                else:
                    got = _byte_decode(text)
            elif attr & _BYTE:
                got = bytes([int(text[3:5], 16)])
            else:
                got = b""
            self._pieces[i] = got
        return got

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True, clean_spaces: Optional[bool] = None) -> str:
        """The text of ``ids``, as llama.cpp's ``llama_detokenize``.

        ``skip_special_tokens`` drops a leading BOS and a trailing EOS (where the vocabulary adds
        them) and renders control tokens as nothing; ``False`` renders every token's text. Bytes
        that do not form a whole UTF-8 character come out as ``\\ufffd``. ``clean_spaces``
        (default :attr:`clean_spaces`) tidies spaces before punctuation; ``False`` gives the pieces
        as they are (what llama.cpp prints while streaming).

        Raises:
            ValueError: an id outside the vocabulary.
        """
        ids = list(ids)
        n = len(self.tokens)
        for i in ids:
            if not 0 <= i < n:
                raise ValueError(f"ids contains {i}: allowed token ids in [0, {n})")
        strip = self.add_space_prefix
        if skip_special_tokens and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
            strip = False  # llama.cpp keeps the space after a BOS
        if skip_special_tokens and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        chunks = []
        for k, i in enumerate(ids):
            p = self.piece(i, special=not skip_special_tokens)
            if k == 0 and strip and p[:1] == b" ":
                p = p[1:]
            chunks.append(p)
        data = b"".join(chunks)
        if self.clean_spaces if clean_spaces is None else clean_spaces:
            data = _clean_spaces(data)
        return data.decode("utf-8", errors="replace")


def _byte_decode(text: str) -> bytes:
    """A byte-level BPE token's bytes; a character outside the byte alphabet is marked, not lost."""
    _, char_byte = _byte_tables()
    out = bytearray()
    for c in text:
        b = char_byte.get(c)
        if b is not None:
            out.append(b)
        else:
            raw = c.encode("utf-8", "surrogatepass")
            out += b"[UNK_BYTE_0x" + raw.hex().encode() + text.encode("utf-8", "surrogatepass") + b"]"
    return bytes(out)


def _clean_spaces(data: bytes) -> bytes:
    """``clean_up_tokenization_spaces`` as llama.cpp applies it: no space before ``?!.,``, none
    around a lone ``'``, none before ``'s``, ``'m``, ``'re``, ``'ve``."""
    out = bytearray(data[:1])
    for x in data[1:]:
        if out and out[-1] == 0x20 and x in b"?!.,":
            out.pop()
        out.append(x)
    text, out = bytes(out), bytearray(bytes(out)[:1])
    i, gone = 1, -1
    while i < len(text):
        x = text[i]
        # the space after a lone quote goes too, and no longer counts as the next quote's space
        if x == 0x27 and i + 1 < len(text) and text[i - 1] == 0x20 and i - 1 != gone and text[i + 1] == 0x20:
            out.pop()
            out.append(x)
            gone = i + 1
            i += 2
            continue
        out.append(x)
        i += 1
    text, out = bytes(out), bytearray(bytes(out)[:1])
    for i in range(1, len(text)):
        x = text[i]
        if text[i - 1] == 0x20 and x == 0x27 and i + 1 < len(text):
            x1 = text[i + 1]
            if x1 in b"sm" or (i + 2 < len(text) and text[i + 1 : i + 3] in (b"re", b"ve")):
                out.pop()
        out.append(x)
    return bytes(out)


def _bpe_model(tokens, merges, split, ignore_merges):
    try:
        from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    except ImportError as e:
        raise ImportError(
            "byte-level BPE GGUF vocabularies need the 'tokenizers' package: pip install tokenizers"
        ) from e
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False, ignore_merges=ignore_merges)
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in split]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tok


def gguf_tokenizer(path) -> GGUFVocab:
    """The vocabulary of a GGUF file as a :class:`GGUFBackend`, with its BOS / end ids.

    SentencePiece (``tokenizer.ggml.model == "llama"``) and byte-level BPE (``"gpt2"``, with any
    ``tokenizer.ggml.pre`` of :data:`BPE_PRE_KINDS`) are built. Everything is checked before
    anything is built.

    Args:
        path: a GGUF file with ``tokenizer.ggml.tokens`` (and ``tokenizer.ggml.merges`` for BPE).

    Returns:
        A :class:`GGUFVocab` ``(tokenizer, bos_id, eos_ids, add_bos)``.

    Raises:
        ValueError: not a GGUF file, no vocabulary, another tokenizer model or pre-tokenizer kind,
            duplicate tokens, token types outside [0, 6], scores that are not finite, merges that
            name tokens the vocabulary lacks, or ``add_bos`` / ``add_eos`` without the id.
        ImportError: a BPE vocabulary and no ``tokenizers`` package.

    Example:
        >>> gguf_tokenizer("model.gguf").tokenizer.encode("Hello").ids   # doctest: +SKIP
        [9259]
    """
    reader = _open(path, tensors=False)
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.model': allowed a file with a vocabulary")
    if model not in ("llama", "gpt2"):
        raise ValueError(
            f"tokenizer.ggml.model={model!r} is out of range: allowed 'llama' (SentencePiece) or "
            f"'gpt2' (byte-level BPE)"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens", required=True)
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError("tokenizer.ggml.tokens must be a non-empty list of strings")
    n = len(tokens)
    # llama.cpp names empty tokens so that they stay distinct
    tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
    if len(set(tokens)) != n:
        seen = {}
        for i, t in enumerate(tokens):
            if t in seen:
                raise ValueError(
                    f"tokenizer.ggml.tokens has {t!r} twice (ids {seen[t]} and {i}): allowed distinct tokens"
                )
            seen[t] = i
    types = _field(reader, "tokenizer.ggml.token_type")
    if types is not None:
        if len(types) < n:
            raise ValueError(
                f"tokenizer.ggml.token_type has {len(types)} entries: allowed at least one per token ({n})"
            )
        types = list(types[:n])
        for i, t in enumerate(types):
            if t not in _TYPE_ATTR:
                raise ValueError(
                    f"tokenizer.ggml.token_type[{i}]={t!r} is out of range: allowed 0..6 (undefined, "
                    f"normal, unknown, control, user-defined, unused, byte)"
                )
    scores = _field(reader, "tokenizer.ggml.scores")
    if scores is not None:
        if len(scores) < n:
            raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries: allowed at least one per token ({n})")
        scores = [float(s) for s in scores[:n]]
        if not all(math.isfinite(s) for s in scores):
            bad = next(i for i, s in enumerate(scores) if not math.isfinite(s))
            raise ValueError(f"tokenizer.ggml.scores[{bad}]={scores[bad]!r} is out of range: allowed finite scores")
    pre = merges = None
    if model == "gpt2":
        pre = _field(reader, "tokenizer.ggml.pre", "default") or "default"
        if pre not in BPE_PRE_KINDS:
            raise ValueError(f"tokenizer.ggml.pre={pre!r} is out of range: allowed {sorted(BPE_PRE_KINDS)}")
        merges = _field(reader, "tokenizer.ggml.merges", required=True)
        index = set(tokens)
        for i, m in enumerate(merges):
            parts = m.split(" ", 1) if isinstance(m, str) else []
            if (
                len(parts) != 2
                or not all(parts)
                or parts[0] + parts[1] not in index
                or parts[0] not in index
                or parts[1] not in index
            ):
                raise ValueError(
                    f"tokenizer.ggml.merges[{i}]={m!r} is out of range: allowed 'left right' of two "
                    f"tokens whose concatenation is a token"
                )

    attrs = [_TYPE_ATTR[t] for t in types] if types is not None else [_NORMAL] * n
    ids = {t: i for i, t in enumerate(tokens)}

    def key_id(key, default):
        value = _field(reader, key)
        if value is not None and 0 <= int(value) < n:
            return int(value)
        return default if default is not None and default < n else None

    spm = model == "llama"
    bos = key_id("tokenizer.ggml.bos_token_id", 1 if spm else None)
    eos = key_id("tokenizer.ggml.eos_token_id", 2 if spm else None)
    unk = key_id("tokenizer.ggml.unknown_token_id", 0 if spm else None)
    eot = key_id("tokenizer.ggml.eot_token_id", None)
    eom = key_id("tokenizer.ggml.eom_token_id", None)
    fim = {name: key_id(f"tokenizer.ggml.fim_{name}_token_id", None) for name in _FIM_TEXTS}

    def by_text(texts):
        # a special token found by its text is a control token, whatever the file says
        hits = [ids[t] for t in texts if t in ids]
        for i in hits:
            attrs[i] |= _CONTROL
        return hits

    def find(given, texts):
        # an id the metadata lacks is looked up by text (where several texts match, llama.cpp's pick
        # depends on its hash map's order; the lowest id here), and that one token becomes control
        if given is not None:
            return given
        hits = sorted(ids[t] for t in texts if t in ids)
        if hits:
            attrs[hits[0]] |= _CONTROL
        return hits[0] if hits else None

    eot = find(eot, _EOT_TEXTS)
    eom = find(eom, ("<|eom_id|>",))
    fim = {name: find(fim[name], texts) for name, texts in _FIM_TEXTS.items()}
    eog = {fim[name] for name in ("pad", "rep", "sep") if fim[name] is not None}
    eog.update(by_text(sorted(_EOG_TEXTS)))
    for t in _ALWAYS_RENDERED:
        if t in ids:
            attrs[ids[t]] = _USER
    eog.update(i for i in (eos, eot, eom) if i is not None)
    texts = {tokens[i]: i for i in eog}
    if "<|end|>" in texts and (
        ("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
        or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)
    ):
        eog.discard(texts["<|end|>"])  # gpt-oss / solar-open: <|end|> ends a message, not the turn
        attrs[texts["<|end|>"]] = _USER
    if "<|tool_response>" in texts and "</s>" in texts:
        eog.discard(texts["</s>"])
        attrs[texts["</s>"]] = _NORMAL

    split_add_bos = BPE_PRE_KINDS[pre][3] if pre is not None else True
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", split_add_bos))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise ValueError(
            "tokenizer.ggml.add_bos_token is true but the file has no BOS id: allowed a "
            "tokenizer.ggml.bos_token_id in the vocabulary"
        )
    if add_eos and eos is None:
        raise ValueError(
            "tokenizer.ggml.add_eos_token is true but the file has no EOS id: allowed a "
            "tokenizer.ggml.eos_token_id in the vocabulary"
        )
    add_space_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", spm))
    template = _field(reader, "tokenizer.chat_template")
    backend = GGUFBackend(
        kind="spm" if spm else "bpe",
        tokens=tokens,
        attrs=attrs,
        scores=scores,
        merges=merges,
        pre=pre,
        bos_id=bos,
        eos_id=eos,
        unk_id=unk,
        eog_ids=eog,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        chat_template=template if isinstance(template, str) else None,
    )
    ends = [i for i in (eos, eot) if i is not None] + sorted(eog)
    return GGUFVocab(backend, bos, tuple(dict.fromkeys(ends)), add_bos)
