"""Text in and out of a checkpoint's tokenizer: :class:`Tokenizer` over the ``tokenizers`` library.

:class:`Tokenizer` wraps a ``tokenizers.Tokenizer`` (any backend with its ``encode`` /
``decode`` / ``get_vocab_size`` / ``token_to_id``) plus the special ids the model needs: the BOS id,
whether prompts start with it, and the EOS ids that end generation. :meth:`Tokenizer.from_pretrained`
builds one from a Hugging Face folder (``tokenizer.json`` and the ids in ``config.json``,
``generation_config.json``, ``tokenizer_config.json``); other constructors (a GGUF vocabulary)
build the backend their own way and call ``Tokenizer(backend, bos_id=..., eos_ids=..., add_bos=...)``.

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

    Raises:
        ValueError: a backend without ``encode``/``decode``, ``add_bos=True`` without a
            ``bos_id``, or ids that are not integers in the vocabulary.
    """

    def __init__(self, backend, *, bos_id: Optional[int] = None, eos_ids: Iterable[int] = (), add_bos: bool = False):
        if not all(hasattr(backend, name) for name in ("encode", "decode", "get_vocab_size")):
            raise ValueError(f"backend must be a tokenizers.Tokenizer (encode, decode, get_vocab_size), got "
                             f"{type(backend).__name__}")
        self.backend = backend
        n = int(backend.get_vocab_size())
        for name, ids in (("bos_id", _ids(bos_id)), ("eos_ids", tuple(eos_ids))):
            for i in ids:
                if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n:
                    raise ValueError(f"{name} contains {i!r}: allowed integer ids in [0, {n})")
        if not isinstance(add_bos, bool):
            raise ValueError(f"add_bos={add_bos!r} is out of range: allowed a bool")
        if add_bos and bos_id is None:
            raise ValueError("add_bos=True is out of range without a bos_id: allowed False, or give bos_id")
        self.bos_id = bos_id
        self.eos_ids: Tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self.add_bos = add_bos

    @classmethod
    def from_gguf(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """The vocabulary of a llama.cpp GGUF file (byte-level BPE, as Llama 3 and Qwen2 ship it).

        The backend, the BOS/EOS ids (EOS and EOT both end generation) and ``add_bos`` come from
        the file's ``tokenizer.ggml.*`` metadata (see :func:`kvjax.nn.gguf_tokenizer`).

        Raises:
            ValueError: not a GGUF file, no vocabulary, or a vocabulary kvjax does not build.
        """
        from kvjax.nn._gguf_vocab import gguf_tokenizer

        vocab = gguf_tokenizer(path)
        return cls(vocab.tokenizer, bos_id=vocab.bos_id, eos_ids=vocab.eos_ids, add_bos=vocab.add_bos)

    @classmethod
    def from_pretrained(cls, path: Union[str, os.PathLike]) -> "Tokenizer":
        """The tokenizer of a Hugging Face checkpoint folder.

        ``tokenizer.json`` is the backend. The BOS id comes from ``generation_config.json``,
        ``config.json`` or ``tokenizer_config.json``'s ``bos_token`` (in that order); the EOS ids are
        the union of those files' ``eos_token_id`` (an id or a list) and ``eos_token``. Prompts
        start with BOS when ``tokenizer_config.json`` says ``add_bos_token``, else when the
        backend's own post-processor adds it.

        Raises:
            ValueError: no folder, no ``tokenizer.json`` (only the ``tokenizers`` format is read;
                convert a sentencepiece ``tokenizer.model`` with transformers first), or a file that
                does not parse.
        """
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError:
            raise ValueError("reading tokenizer.json needs the tokenizers package: pip install "
                             "'kvjax[hf]'") from None
        folder = pathlib.Path(path)
        if not folder.is_dir():
            raise ValueError(f"path={str(path)!r} is not a folder: allowed a Hugging Face checkpoint folder")
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"path={str(path)!r} has no tokenizer.json: allowed a folder with the tokenizers "
                             f"library's tokenizer.json (a sentencepiece tokenizer.model alone is not read)")
        try:
            backend = Backend.from_file(str(file))
        except Exception as e:   # tokenizers raises a bare Exception on a bad file
            raise ValueError(f"{file} is not a tokenizers file ({e}): allowed the tokenizer.json transformers "
                             f"writes") from None
        gen, cfg, tcfg = (_read_json(folder / name) for name in
                          ("generation_config.json", "config.json", "tokenizer_config.json"))
        if isinstance(cfg.get("text_config"), dict):   # multimodal Gemma 3: ids may sit in the text config
            cfg = {**cfg["text_config"], **{k: v for k, v in cfg.items() if v is not None}}

        def by_text(key):
            text = _token_text(tcfg.get(key))
            return backend.token_to_id(text) if text is not None else None

        bos = None
        for source in (gen.get("bos_token_id"), cfg.get("bos_token_id"), by_text("bos_token")):
            if _ids(source):
                bos = _ids(source)[0]
                break
        eos: List[int] = []
        for source in (gen.get("eos_token_id"), cfg.get("eos_token_id"), by_text("eos_token")):
            eos += [i for i in _ids(source) if i not in eos]
        n = backend.get_vocab_size()
        eos = [i for i in eos if 0 <= i < n]
        if bos is not None and not 0 <= bos < n:
            bos = None
        if isinstance(tcfg.get("add_bos_token"), bool):
            add_bos = tcfg["add_bos_token"] and bos is not None
        else:
            probe = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(probe) and probe[0] == bos
        return cls(backend, bos_id=bos, eos_ids=eos, add_bos=add_bos)

    @property
    def vocab_size(self) -> int:
        """Ids the backend knows (a model's embedding may be larger: padding rows)."""
        return int(self.backend.get_vocab_size())

    def encode(self, text: str, add_bos: Optional[bool] = None) -> List[int]:
        """Token ids of ``text``; ``add_bos`` (default :attr:`add_bos`) puts the BOS id first.

        The backend's own special-token post-processing is not applied (BOS is added here, once).

        Raises:
            ValueError: ``text`` not a string, or ``add_bos=True`` without a BOS id.
        """
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        add_bos = self.add_bos if add_bos is None else add_bos
        if not isinstance(add_bos, bool):
            raise ValueError(f"add_bos={add_bos!r} is out of range: allowed a bool or None")
        if add_bos and self.bos_id is None:
            raise ValueError("add_bos=True is out of range: this tokenizer has no BOS id")
        ids = list(self.backend.encode(text, add_special_tokens=False).ids)
        return [self.bos_id] + ids if add_bos else ids

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
    token of a text differently (a leading space) see the same context as the full decode.
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
        self._prefix = 0   # decode from here (context for the first new token)
        self._read = 0     # tokens up to here are already printed

    def _decode(self, ids):
        return self.tokenizer.backend.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one token; return the text it completes (may be ``""``)."""
        self.ids += _check_ids([token])
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return after[len(before):]
        return ""

    def flush(self) -> str:
        """The text of the tokens not returned yet (an incomplete character comes out as ``\\ufffd``)."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
