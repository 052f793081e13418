"""Record llama.cpp's logits for the tiny random gpt-oss GGUF of tests/test_gpt_oss.py.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_gpt_oss_gguf_fixture.py

It writes the file with :func:`tests.test_gpt_oss.write_llamacpp_gpt_oss` (the test writes the same
bytes again and checks the digest recorded here), evaluates the tokens in one ``llama.cpp`` batch
with the logits of every position, then the same tokens one by one through llama.cpp's cache
(float32 K/V), and
stores both in ``tests/data/gpt_oss_llamacpp.json``.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import llama_cpp

    from scripts.llamacpp_fixture import record
    from tests.test_gpt_oss import FIXTURE, FIXTURE_TOKENS, write_llamacpp_gpt_oss

    # K/V in float32 (llama.cpp's default cache is float16, ~1e-2 of these logits)
    f32 = llama_cpp.GGML_TYPE_F32
    return record(write_llamacpp_gpt_oss, FIXTURE_TOKENS, FIXTURE, "gpt-oss.gguf", type_k=f32, type_v=f32)


if __name__ == "__main__":
    sys.exit(main())
