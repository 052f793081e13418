"""Assemble the demo's training text from the Python standard library's own docstrings.

The docstrings are part of CPython's source, distributed under the PSF License Agreement, which
permits redistribution; the assembled text is written to ``kvjax/app/data/corpus.txt`` with a header
that says where it comes from. Run: ``python scripts/build_corpus.py``.
"""

import importlib
import inspect
import pathlib
import re
import sys

MODULES = [
    "json",
    "collections",
    "itertools",
    "functools",
    "textwrap",
    "string",
    "random",
    "heapq",
    "bisect",
    "pathlib",
    "datetime",
    "fractions",
    "statistics",
    "shutil",
    "tempfile",
    "csv",
    "argparse",
    "logging",
    "contextlib",
    "dataclasses",
    "enum",
    "typing",
    "abc",
    "copy",
    "pprint",
    "difflib",
    "base64",
    "hashlib",
    "zipfile",
    "tarfile",
    "queue",
    "threading",
    "subprocess",
    "os",
    "re",
    "math",
    "operator",
    "io",
    "codecs",
    "unittest",
    "doctest",
    "calendar",
    "decimal",
    "fnmatch",
    "glob",
    "gzip",
    "html",
    "http.client",
    "inspect",
]


def _clean(text: str) -> str:
    text = inspect.cleandoc(text)
    text = "".join(ch for ch in text if ch == "\n" or 32 <= ord(ch) < 127)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def build(limit: int = 600_000) -> str:
    parts = []
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if mod.__doc__:
            parts.append(_clean(mod.__doc__))
        for attr in sorted(getattr(mod, "__all__", dir(mod))):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            doc = getattr(obj, "__doc__", None)
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and doc and len(doc) > 80:
                parts.append(f"{name}.{attr}: " + _clean(doc))
    seen, unique = set(), []
    for p in parts:
        if p not in seen:
            seen.add(p)
            unique.append(p)
    return "\n\n".join(unique)[:limit]


if __name__ == "__main__":
    header = (
        f"# Assembled from the docstrings of the Python {sys.version.split()[0]} standard library "
        "(PSF License Agreement) by scripts/build_corpus.py.\n\n"
    )
    out = pathlib.Path(__file__).resolve().parent.parent / "kvjax" / "data" / "corpus.txt"
    out.write_text(header + build() + "\n")
    print(f"wrote {out} ({out.stat().st_size} bytes)")
