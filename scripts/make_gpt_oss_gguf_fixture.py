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

import hashlib
import json
import pathlib
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import llama_cpp

    from tests.test_gpt_oss import FIXTURE, FIXTURE_TOKENS, write_llamacpp_gpt_oss

    with tempfile.TemporaryDirectory() as folder:
        path = write_llamacpp_gpt_oss(pathlib.Path(folder) / "gpt-oss.gguf")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        # K/V in float32 (llama.cpp's default cache is float16, ~1e-3 of these logits)
        f32 = llama_cpp.GGML_TYPE_F32
        llm = llama_cpp.Llama(
            model_path=str(path),
            n_ctx=64,
            n_batch=64,
            n_threads=2,
            logits_all=True,
            verbose=False,
            type_k=f32,
            type_v=f32,
        )
        llm.reset()
        llm.eval(FIXTURE_TOKENS)
        batch = np.asarray(llm.scores[: len(FIXTURE_TOKENS)], np.float64)
        llm.reset()
        for t in FIXTURE_TOKENS:
            llm.eval([t])
        stepwise = np.asarray(llm.scores[: len(FIXTURE_TOKENS)], np.float64)
    FIXTURE.write_text(
        json.dumps(
            {
                "llama_cpp_python": llama_cpp.__version__,
                "gguf_sha256": digest,
                "tokens": FIXTURE_TOKENS,
                "logits_batch": np.round(batch, 6).tolist(),
                "logits_stepwise": np.round(stepwise, 6).tolist(),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {FIXTURE} (batch against one-by-one: max difference {np.abs(batch - stepwise).max():.2e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
