"""The vocabulary of a llama.cpp GGUF file as a tokenizer backend (:func:`gguf_tokenizer`)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

from kvjax.nn._gguf_file import _field, _open

__all__ = ["gguf_tokenizer", "GGUFVocab"]


class GGUFVocab(NamedTuple):
    """What :func:`gguf_tokenizer` returns.

    Attributes:
        tokenizer: the ``tokenizers.Tokenizer``.
        bos_id: ``tokenizer.ggml.bos_token_id`` (``None`` when absent).
        eos_ids: the end ids: ``eos_token_id`` and, when present and different, ``eot_token_id``
            (Llama 3 instruct models end turns with the latter).
        add_bos: ``tokenizer.ggml.add_bos_token`` (False when absent).
    """

    tokenizer: Any
    bos_id: Optional[int]
    eos_ids: Tuple[int, ...]
    add_bos: bool


def gguf_tokenizer(path) -> GGUFVocab:
    """The vocabulary of a GGUF file as a ``tokenizers.Tokenizer``, with its bos / eos ids.

    Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``, what Llama 3 and Qwen2 use) is built;
    the pre-tokenizer split follows ``tokenizer.ggml.pre`` for ``llama-bpe`` / ``llama3`` and
    ``qwen2`` and is GPT-2's otherwise.

    Args:
        path: a GGUF file with ``tokenizer.ggml.tokens`` and ``tokenizer.ggml.merges``.

    Returns:
        A :class:`GGUFVocab` ``(tokenizer, bos_id, eos_ids, add_bos)``.

    Raises:
        ValueError: not a GGUF file, no vocabulary, or a tokenizer model other than ``gpt2``.
        ImportError: the ``tokenizers`` package is not installed.
    """
    reader = _open(path)
    model = _field(reader, "tokenizer.ggml.model")
    if model is None:
        raise ValueError("GGUF metadata lacks 'tokenizer.ggml.model': allowed a file with a vocabulary")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={model!r} is out of range: allowed 'gpt2' (byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens", required=True)
    merges = _field(reader, "tokenizer.ggml.merges", required=True)
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    ends = [_field(reader, "tokenizer.ggml.eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in ends if e is not None))
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
    return GGUFVocab(_bpe(tokens, merges, types, pre), None if bos is None else int(bos), eos_ids, add_bos)


# The pre-tokenizer splits of the byte-level BPE vocabularies llama.cpp names in tokenizer.ggml.pre
# (the regexes are those of the models' own tokenizer.json files).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}


def _bpe(tokens, merges, types, pre):
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError as e:
        raise ImportError("gguf_tokenizer needs the 'tokenizers' package: pip install tokenizers") from e
    vocab = {tok: i for i, tok in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = _SPLITS.get(pre)
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # control (3) and user-defined (4) tokens match as whole strings, never split into bytes
    special = [AddedToken(t, special=ty == 3, normalized=False) for t, ty in zip(tokens, types) if ty in (3, 4)]
    if special:
        tok.add_tokens(special)
    return tok
