"""Record llama.cpp's logits for the tiny random Mamba GGUF of tests/test_gguf_mamba.py.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_mamba_gguf_fixture.py

It writes the file with :func:`tests.test_gguf_mamba.write_llamacpp_mamba` (the test writes the
same bytes again and checks the digest recorded here), evaluates :data:`TOKENS` in one
``llama.cpp`` batch with the logits of every position, then the same tokens one by one (the
recurrent state carried between calls), and stores both in ``tests/data/mamba_llamacpp.json``.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from scripts.llamacpp_fixture import record
    from tests.test_gguf_mamba import FIXTURE, TOKENS, write_llamacpp_mamba

    return record(write_llamacpp_mamba, TOKENS, FIXTURE, "mamba.gguf")


if __name__ == "__main__":
    sys.exit(main())
