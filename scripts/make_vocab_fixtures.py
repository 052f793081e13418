"""Record what llama.cpp's tokenizer answers, as JSON fixtures for ``tests/test_gguf_vocab.py``.

For each tiny vocabulary of ``tests/vocab_fixtures.py`` (written here to a temporary GGUF file,
byte for byte the file the test writes) and, when given, a real GGUF file, this loads the file with
llama-cpp-python (``Llama(model_path, vocab_only=True)``) and writes, for every text of
``tests.vocab_fixtures.TEXTS``, llama.cpp's ids with ``parse_special`` off and on, with and without
the BOS/EOS it adds (``ids_special`` only where it differs from ``ids``, ``ids_add*`` only where
they are not simply BOS + ids + EOS), and its
detokenization of each id list (``remove_special`` / ``unparse_special`` both ways; only where it
is not the text itself), plus the BOS/EOS/EOT ids, the end-of-generation set and the
``add_bos`` / ``add_eos`` flags. CI has no llama.cpp: the test compares kvjax against these files.

Run from the repository root (needs ``pip install llama-cpp-python gguf``)::

    python scripts/make_vocab_fixtures.py                       # the tiny vocabularies
    python scripts/make_vocab_fixtures.py --real /work/models/gemma-3-270m-q4_k_m.gguf --real-name gemma3-270m
"""

from __future__ import annotations

import argparse
import ctypes
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.vocab_fixtures import TEXTS, vocab_digest, vocab_names, write_vocab  # noqa: E402

OUT = ROOT / "tests" / "data" / "vocab"


def _record(path: str, name: str, digest=None) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)

    def tokenize(text: str, add_special: bool, parse_special: bool):
        data = text.encode("utf-8")
        n = len(data) + 8
        buf = (llama_cpp.llama_token * n)()
        got = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n, add_special, parse_special)
        if got < 0:
            n = -got
            buf = (llama_cpp.llama_token * n)()
            got = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n, add_special, parse_special)
        return [int(buf[i]) for i in range(got)]

    def detokenize(ids, remove_special: bool, unparse_special: bool) -> str:
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        size = 64 + 16 * len(ids)
        while True:
            out = ctypes.create_string_buffer(size)
            got = llama_cpp.llama_detokenize(vocab, arr, len(ids), out, size, remove_special, unparse_special)
            if got >= 0:
                return out.raw[:got].decode("utf-8", errors="replace")
            size = -got + 1

    def nullable(i):
        return None if i < 0 else int(i)

    bos, eos = llama_cpp.llama_vocab_bos(vocab), llama_cpp.llama_vocab_eos(vocab)
    add_bos, add_eos = bool(llama_cpp.llama_vocab_get_add_bos(vocab)), bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    cases = []
    for text in TEXTS:
        case = {"text": text}
        for key, add, parse in (
            ("ids", False, False),
            ("ids_special", False, True),
            ("ids_add", True, False),
            ("ids_add_special", True, True),
        ):
            case[key] = tokenize(text, add, parse)
        ids_of = {"ids_special": case["ids_special"]}
        for key in ("ids_add", "ids_add_special"):
            # written only where they are not BOS + the ids + EOS (as add_bos / add_eos say)
            ids_of[key] = case[key]
            plain = case[key.replace("_add", "")]
            if case[key] == [bos] * add_bos + plain + [eos] * add_eos:
                del case[key]
        # skip_special=True (drop BOS/EOS, control tokens empty) and False (everything rendered);
        # written only where they differ from the text itself, to keep the files small
        for key in ("ids", "ids_special", "ids_add", "ids_add_special"):
            for mode, remove, unparse in (("skip", True, False), ("render", False, True)):
                out = detokenize(case.get(key, ids_of.get(key)), remove, unparse)
                if out != text:
                    case[f"{key}:{mode}"] = out
        if case["ids_special"] == case["ids"]:  # a text without special-token strings
            del case["ids_special"]
        cases.append(case)
    return {
        "vocab": name,
        "vocab_sha256": digest,
        "llama_cpp_python": llama_cpp.__version__,
        "n_vocab": int(n_vocab),
        "bos": nullable(llama_cpp.llama_vocab_bos(vocab)),
        "eos": nullable(llama_cpp.llama_vocab_eos(vocab)),
        "eot": nullable(llama_cpp.llama_vocab_eot(vocab)),
        "eog": [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)],
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "add_eos": bool(llama_cpp.llama_vocab_get_add_eos(vocab)),
        "cases": cases,
    }


def _dump(data: dict, file: pathlib.Path) -> None:
    # one case a line: small diffs when llama.cpp changes its answer for a few texts
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = [json.dumps(head, ensure_ascii=False)[:-1] + ', "cases": [']
    lines += [
        json.dumps(c, ensure_ascii=False) + ("," if i + 1 < len(data["cases"]) else "")
        for i, c in enumerate(data["cases"])
    ]
    lines.append("]}")
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", help="fixture vocabularies to record (default: all)")
    parser.add_argument("--real", help="a real GGUF file to record as well")
    parser.add_argument("--real-name", default="real", help="the fixture name of --real (file real-<name>.json)")
    parser.add_argument("--skip-tiny", action="store_true", help="record --real only")
    args = parser.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if not args.skip_tiny:
        for name in args.only or vocab_names():
            with tempfile.TemporaryDirectory() as tmp:
                path = write_vocab(name, pathlib.Path(tmp) / f"{name}.gguf")
                data = _record(str(path), name, vocab_digest(name))
            _dump(data, OUT / f"{name}.json")
            print(f"{name}: {len(data['cases'])} texts -> {OUT / (name + '.json')}")
    if args.real:
        data = _record(args.real, args.real_name)
        _dump(data, OUT / f"real-{args.real_name}.json")
        print(f"{args.real}: {len(data['cases'])} texts -> {OUT / ('real-' + args.real_name + '.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
