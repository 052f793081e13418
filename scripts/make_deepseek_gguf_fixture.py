"""Record llama.cpp's logits for the tiny random deepseek2 GGUF of tests/test_deepseek.py.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_deepseek_gguf_fixture.py

It writes the file with :func:`tests.test_deepseek.write_llamacpp_deepseek` (the test writes the
same bytes again and checks the digest recorded here), evaluates the tokens in one ``llama.cpp``
batch with the logits of every position, then the same tokens one by one through llama.cpp's
latent cache (float32 K), and stores both in ``tests/data/deepseek_llamacpp.json``.
"""

from __future__ import annotations

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import llama_cpp

    from scripts.llamacpp_fixture import record
    from tests.test_deepseek import FIXTURE, FIXTURE_TOKENS, write_llamacpp_deepseek

    # K in float32 (llama.cpp's default cache is float16, ~1e-2 of these logits)
    f32 = llama_cpp.GGML_TYPE_F32
    return record(write_llamacpp_deepseek, FIXTURE_TOKENS, FIXTURE, "deepseek2.gguf", type_k=f32, type_v=f32)


if __name__ == "__main__":
    sys.exit(main())
