"""Text in and out of a checkpoint's tokenizer: :class:`Tokenizer` over the ``tokenizers`` library.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (any backend with its ``encode`` /
``decode`` / ``get_vocab_size`` / ``token_to_id``) plus the special ids the model needs: the BOS id,
whether prompts start with it, and the EOS ids that end generation. :meth:`Tokenizer.from_pretrained`
builds one from a Hugging Face folder (``tokenizer.json`` and the ids in ``config.json``,
``generation_config.json``, ``tokenizer_config.json``); other constructors (a GGUF vocabulary)
build the backend their own way and call ``Tokenizer(backend, bos_id=..., eos_ids=..., add_bos=...)``;
:meth:`Tokenizer.from_gguf` builds a llama.cpp-exact backend (:class:`kvjax.nn._gguf_vocab.GGUFBackend`).

A tokenizer may carry its model's chat template (:attr:`Tokenizer.chat_template`, from the GGUF
metadata or the folder's ``tokenizer_config.json`` / ``chat_template.jinja``);
:meth:`Tokenizer.apply_chat_template` renders a conversation with it.

:meth:`Tokenizer.stream` decodes a growing token sequence for a terminal: each call returns only
the new complete characters (a multi-byte character split over tokens comes out whole, never as
a broken ``\\ufffd``).

Example:
    >>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
    >>> backend = Backend(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "there": 3, "<unk>": 4}, unk_token="<unk>"))
    >>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
    >>> tok = Tokenizer(backend, bos_id=0, eos_ids=(1,), add_bos=True)
    >>> tok.encode("hi there")
    [0, 2, 3]
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Iterable, List, Optional, Sequence, Tuple, Union
from kvjax._validate import check_flag
from kvjax.nn._gguf_vocab import gguf_tokenizer
from kvjax.nn._chat_template import render_chat_template

__all__ = ["Tokenizer", "StreamDecoder"]


def _ids(value) -> Tuple[int, ...]:
    """An id or a list of ids from a config value (``None`` gives none)."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value if v is not None)
    return (int(value),)


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): allowed the file transformers writes") from None
    return data if isinstance(data, dict) else {}


def _token_text(value) -> Optional[str]:
    """``tokenizer_config.json``'s ``bos_token`` / ``eos_token``: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A tokenizer backend plus the model's special ids.

    Args:
        backend: a ``tokenizers.Tokenizer`` (or an object with the same ``encode(text,
            add_special_tokens=...)`` returning ``.ids``, ``decode(ids, skip_special_tokens=...)``,
            ``get_vocab_size()``).
        bos_id: the beginning-of-sequence id, or ``None``.
        eos_ids: ids that end generation (a model may have several: Llama 3's ``<|eot_id|>``).
        add_bos: whether :meth:`encode` prepends ``bos_id`` by default.
        add_eos: whether :meth:`encode` appends the first of ``eos_ids`` by default (a few
            vocabularies ask for it: ``tokenizer.ggml.add_eos_token``).
        chat_template: the model's chat template (Jinja text), or ``None``.

    Raises:
        ValueError: a backend without ``encode``/``decode``, ``add_bos=True`` without a
            ``bos_id``, ``add_eos=True`` without ``eos_ids``, a ``chat_template`` that is not a
            string, or ids that are not integers in the vocabulary.
    """

    def __init__(
        self,
        backend,
        *,
        bos_id: Optional[int] = None,
        eos_ids: Iterable[int] = (),
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: Optional[str] = None,
    ):
        if not all(hasattr(backend, name) for name in ("encode", "decode", "get_vocab_size")):
            raise ValueError(
                f"backend must be a tokenizers.Tokenizer (encode, decode, get_vocab_size), got {type(backend).__name__}"
            )
        self.backend = backend
        n = int(backend.get_vocab_size())
        for name, ids in (("bos_id", _ids(bos_id)), ("eos_ids", tuple(eos_ids))):
            for i in ids:
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                    raise ValueError(f"{name} contains {i!r}: allowed integer ids in [0, {n})")
        add_bos = check_flag("add_bos", add_bos)
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True is out of range without a bos_id: allowed False, or give bos_id")
        add_eos = check_flag("add_eos", add_eos)
        self.bos_id = bos_id
        self.eos_ids: Tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        if add_eos and not self.eos_ids:
            raise ValueError("add_eos=True is out of range without eos_ids: allowed False, or give eos_ids")
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"chat_template must be a str or None, got {type(chat_template).__name__}")
        self.add_bos = add_bos
        self.add_eos = add_eos
        #: the model's chat template (Jinja text), or ``None`` (:meth:`apply_chat_template` needs one)
        self.chat_template: Optional[str] = chat_template or None
        # tokenizer_config.json's bos_token / eos_token texts, which templates write (else the ids' texts)
        self._bos_text: Optional[str] = None
        self._eos_text: Optional[str] = None

    @classmethod
    def from_gguf(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """The vocabulary of a llama.cpp GGUF file, tokenizing exactly as llama.cpp does.

        SentencePiece (``tokenizer.ggml.model = 'llama'``: Gemma, Llama 2) and byte-level BPE
        (``'gpt2'``: Llama 3, Qwen2, ...). The BOS id, the end-of-generation ids (EOS, EOT and
        llama.cpp's whole end-of-generation set), ``add_bos`` / ``add_eos`` and the chat template
        come from the file's ``tokenizer.*`` metadata (see :func:`kvjax.nn.gguf_tokenizer`).

        Raises:
            ValueError: not a GGUF file, no vocabulary, or a vocabulary kvjax does not build.

        Example:
            >>> tok = Tokenizer.from_gguf("gemma-3-270m-q4_k_m.gguf")          # doctest: +SKIP
            >>> tok.encode("<start_of_turn>user", special=True)               # doctest: +SKIP
            [2, 105, 2364]
        """
        vocab = gguf_tokenizer(path)
        backend = vocab.tokenizer
        return cls(
            backend,
            bos_id=vocab.bos_id,
            eos_ids=vocab.eos_ids,
            add_bos=vocab.add_bos,
            add_eos=bool(backend.add_eos),
            chat_template=backend.chat_template,
        )

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """The tokenizer of a Hugging Face checkpoint folder.

        ``tokenizer.json`` is the backend; a folder with only a sentencepiece ``tokenizer.model``
        is read with the ``sentencepiece`` package (an optional dependency). The BOS id comes from
        ``generation_config.json``, ``config.json`` or ``tokenizer_config.json``'s ``bos_token``
        (in that order); the EOS ids are the union of those files' ``eos_token_id`` (an id or a
        list) and ``eos_token``. Prompts start with BOS when ``tokenizer_config.json`` says
        ``add_bos_token``, else when the backend's own post-processor adds it (sentencepiece:
        when there is a BOS). The chat template is ``chat_template.jinja`` when the folder has
        one, else ``tokenizer_config.json``'s ``chat_template``.

        Raises:
            ValueError: no folder, neither ``tokenizer.json`` nor ``tokenizer.model``, or a file
                that does not parse.
            ImportError: only a ``tokenizer.model`` and no ``sentencepiece`` package.
        """
        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise ValueError(f"path={str(path)!r} is not a folder: allowed a Hugging Face checkpoint folder")
        file = folder / "tokenizer.json"
        if file.is_file():
            try:
                from tokenizers import Tokenizer as Backend
            except ImportError:
                raise ValueError(
                    "reading tokenizer.json needs the tokenizers package: pip install 'kvjax[hf]'"
                ) from None
            try:
                backend = Backend.from_file(str(file))
            except Exception as e:  # tokenizers raises a bare Exception on a bad file
                raise ValueError(
                    f"{file} is not a tokenizers file ({e}): allowed the tokenizer.json transformers writes"
                ) from None
        elif (folder / "tokenizer.model").is_file():
            backend = _SentencePieceBackend(folder / "tokenizer.model")
        else:
            raise ValueError(
                f"path={str(path)!r} has no tokenizer.json: allowed a folder with the tokenizers "
                f"library's tokenizer.json, or a sentencepiece tokenizer.model"
            )
        gen, cfg, tcfg = (
            _read_json(folder / name) for name in ("generation_config.json", "config.json", "tokenizer_config.json")
        )
        if isinstance(cfg.get("text_config"), dict):  # multimodal Gemma 3: ids may sit in the text config
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if v is not None}}

        def by_text(key):
            text = _token_text(tcfg.get(key))
            return backend.token_to_id(text) if text is not None else None

        sp = isinstance(backend, _SentencePieceBackend)
        bos = None
        for source in (
            gen.get("bos_token_id"),
            cfg.get("bos_token_id"),
            by_text("bos_token"),
            backend.bos_id if sp else None,
        ):
            if _ids(source):
                bos = _ids(source)[0]
                break
        eos: List[int] = []
        for source in (
            gen.get("eos_token_id"),
            cfg.get("eos_token_id"),
            by_text("eos_token"),
            backend.eos_id if sp else None,
        ):
            eos += [i for i in _ids(source) if i not in eos]
        n = backend.get_vocab_size()
        eos = [i for i in eos if 0 <= i < n]
        if bos is not None and not 0 <= bos < n:
            bos = None
        if isinstance(tcfg.get("add_bos_token"), bool):
            add_bos = tcfg["add_bos_token"] and bos is not None
        elif sp:
            add_bos = bos is not None  # sentencepiece models (Llama 2, Gemma) start with BOS
        else:
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        tok = cls(backend, bos_id=bos, eos_ids=eos, add_bos=add_bos, chat_template=_folder_template(folder, tcfg))
        tok._bos_text = _token_text(tcfg.get("bos_token"))
        tok._eos_text = _token_text(tcfg.get("eos_token"))
        return tok

    @property
    def vocab_size(self) -> int:
        """Ids the backend knows (a model's embedding may be larger: padding rows)."""
        return int(self.backend.get_vocab_size())

    def encode(
        self, text: str, add_bos: Optional[bool] = None, special: bool = False, *, add_eos: Optional[bool] = None
    ) -> List[int]:
        """Token ids of ``text``; ``add_bos`` (default :attr:`add_bos`) puts the BOS id first.

        Args:
            text: the text.
            add_bos: put the BOS id first (``None``: :attr:`add_bos`).
            special: parse special-token texts (``<start_of_turn>``, ``<|eot_id|>``) in ``text`` as
                those tokens, as a chat template's output needs; ``False`` (the default) tokenizes
                them as the plain text a user typed. Tokens the vocabulary calls user-defined are
                matched either way (as llama.cpp and ``tokenizers`` do).
            add_eos: put the first EOS id last (``None``: :attr:`add_eos`).

        The backend's own special-token post-processing is not applied (BOS is added here, once).

        Raises:
            ValueError: ``text`` not a string, or ``add_bos=True`` without a BOS id.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        add_bos = self.add_bos if check_flag("add_bos", add_bos, optional=True) is None else bool(add_bos)
        add_eos = self.add_eos if check_flag("add_eos", add_eos, optional=True) is None else bool(add_eos)
        special = check_flag("special", special)
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True is out of range: this tokenizer has no BOS id")
        if add_eos and not self.eos_ids:
            raise ValueError("add_eos=True is out of range: this tokenizer has no EOS id")
        backend = self.backend
        if getattr(backend, "parses_special", False):  # GGUF / sentencepiece backends take the flag
            ids = list(backend.encode(text, add_special_tokens=False, special=special).ids)
        elif hasattr(backend, "encode_special_tokens"):  # tokenizers: special tokens as text, or not
            before = backend.encode_special_tokens
            backend.encode_special_tokens = not special
            try:
                ids = list(backend.encode(text, add_special_tokens=False).ids)
            finally:
                backend.encode_special_tokens = before
        else:
            ids = list(backend.encode(text, add_special_tokens=False).ids)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_ids[0]] if add_eos else [])

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """The text of ``ids`` (special tokens such as BOS/EOS left out unless ``skip_special=False``).

        Raises:
            ValueError: ``ids`` not a sequence of integers.
        """
        ids = _check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def stream(self) -> "StreamDecoder":
        """A :class:`StreamDecoder` for one growing sequence."""
        return StreamDecoder(self)

    def token_text(self, i: Optional[int]) -> str:
        """The text of token ``i`` as the vocabulary stores it (``""`` for ``None``)."""
        if i is None:
            return ""
        text = self.backend.id_to_token(i) if hasattr(self.backend, "id_to_token") else None
        return text if isinstance(text, str) else ""

    def special_texts(self) -> Tuple[str, str]:
        """``(bos_text, eos_text)`` as chat templates write them (``"<bos>"``, ``"<eos>"``).

        ``tokenizer_config.json``'s ``bos_token`` / ``eos_token`` where a folder gave them, else
        the texts of the BOS id and the first EOS id (``""`` where there is none).
        """
        return (
            self._bos_text or self.token_text(self.bos_id),
            self._eos_text or self.token_text(self.eos_ids[0] if self.eos_ids else None),
        )

    def apply_chat_template(
        self, messages, add_generation_prompt: bool = True, *, chat_template: Optional[str] = None, **extra
    ) -> str:
        """A conversation as the prompt text of :attr:`chat_template` (tokenize it with ``special=True``).

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: end with the opening of the assistant's turn.
            chat_template: a template to use instead of the tokenizer's own.
            **extra: more template variables (``tools``, ``enable_thinking``, ...).

        Raises:
            ValueError: no chat template (pass one: ``--chat-template``, or
                ``kvjax.nn._chat_template.chat_template_by_name``), or a template that fails on
                ``messages``.

        Example:
            >>> from tokenizers import Tokenizer as Backend, models
            >>> tok = Tokenizer(Backend(models.WordLevel({"<s>": 0, "hi": 1}, unk_token="<s>")), bos_id=0,
            ...                 chat_template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
            ...                               "{{ m['content'] }}{% endfor %}")
            >>> tok.apply_chat_template([{"role": "user", "content": "hi"}])
            '<s>[user] hi'
        """
        template = self.chat_template if chat_template is None else chat_template
        if template is None:
            raise ValueError(
                "this tokenizer has no chat template: pass one (--chat-template NAME or FILE, or "
                "kvjax.nn._chat_template.chat_template_by_name(...)) or use a model file that has one"
            )

        bos, eos = self.special_texts()
        return render_chat_template(
            template, messages, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **extra
        )


def _folder_template(folder: pathlib.Path, tcfg: dict) -> Optional[str]:
    """A folder's chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s (a text,
    or a list of named templates: the one named ``default``, else the first)."""
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text(encoding="utf-8") or None
    value = tcfg.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default", next(iter(named.values()), None))
    return value if isinstance(value, str) and value else None


class _Ids:
    def __init__(self, ids):
        self.ids = ids


class _SentencePieceBackend:
    """A sentencepiece ``tokenizer.model`` behind the ``tokenizers`` calls :class:`Tokenizer` makes.

    sentencepiece never matches control tokens in text, so ``special`` cannot parse them; decoding
    with ``skip_special_tokens=False`` writes control tokens' pieces between the decoded runs.
    """

    parses_special = True

    def __init__(self, file: pathlib.Path):
        try:
            import sentencepiece
        except ImportError as e:
            raise ImportError(
                f"{file} is a sentencepiece model: reading it needs the 'sentencepiece' package "
                f"(pip install sentencepiece), or convert it to tokenizer.json"
            ) from e
        try:
            self.sp = sentencepiece.SentencePieceProcessor(model_file=str(file))
        except Exception as e:  # sentencepiece raises RuntimeError / OSError on a bad file
            raise ValueError(
                f"{file} is not a sentencepiece model ({e}): allowed the tokenizer.model sentencepiece writes"
            ) from None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None

    def get_vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def token_to_id(self, text: str) -> Optional[int]:
        i = self.sp.piece_to_id(text)
        return i if self.sp.id_to_piece(i) == text else None

    def id_to_token(self, i: int) -> Optional[str]:
        return self.sp.id_to_piece(i) if 0 <= i < self.get_vocab_size() else None

    def encode(self, text: str, add_special_tokens: bool = False, special: bool = False) -> _Ids:
        ids = list(self.sp.encode(text))
        if add_special_tokens and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return _Ids(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, run = [], []
        for i in ids:
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                if run:
                    out.append(self.sp.decode(run))
                    run = []
                if not skip_special_tokens:
                    out.append(self.sp.id_to_piece(i))
            else:
                run.append(i)
        if run:
            out.append(self.sp.decode(run))
        return "".join(out)


def _check_ids(ids) -> List[int]:
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"ids must be a sequence of integer token ids, got {type(ids).__name__}")
    out = []
    for i in ids:
        if isinstance(i, bool) or not hasattr(i, "__index__"):
            raise ValueError(f"ids contains {i!r}: allowed integer token ids")
        out.append(int(i))
    return out


class StreamDecoder:
    """Incremental decoding of one sequence: :meth:`push` a token, get the new complete text.

    It decodes a short window of recent tokens twice (with and without the new ones) and returns
    the difference only when the text does not end in an incomplete character (``\\ufffd``), so
    multi-byte UTF-8 split over byte tokens comes out whole, and detokenizers that treat the first
    token of a text differently (a leading space) see the same context as the full decode. (A GGUF
    vocabulary whose full decode removes spaces before punctuation, ``clean_up_tokenization_spaces``,
    streams its pieces without that clean-up: text once printed is never taken back.)
    :meth:`flush` returns what is left at the end.

    Example:
        >>> from tokenizers import Tokenizer as Backend, models
        >>> tok = Tokenizer(Backend(models.WordLevel({"a": 0, "b": 1}, unk_token="a")))
        >>> s = tok.stream()
        >>> [s.push(0), s.push(1)], s.flush()
        (['a', ' b'], '')
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: List[int] = []
        self._prefix = 0  # decode from here (context for the first new token)
        self._read = 0  # tokens up to here are already printed

    def _decode(self, ids):
        backend = self.tokenizer.backend
        if getattr(backend, "clean_spaces", False):
            # a clean-up of spaces before punctuation can remove text already printed: stream the
            # pieces as they are, as llama.cpp prints them while generating
            return backend.decode(ids, skip_special_tokens=True, clean_spaces=False)
        return backend.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (may be ``""``)."""
        self.ids += _check_ids([token])
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """The text of the tokens not returned yet (an incomplete character comes out as ``\\ufffd``)."""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return after[len(before) :] if len(after) > len(before) else ""
