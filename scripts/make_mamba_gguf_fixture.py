"""Record llama.cpp's logits for the tiny random Mamba GGUF of tests/test_gguf_mamba.py.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_mamba_gguf_fixture.py

It writes the file with :func:`tests.test_gguf_mamba.write_llamacpp_mamba` (the test writes the
same bytes again and checks the digest recorded here), evaluates :data:`TOKENS` in one
``llama.cpp`` batch with the logits of every position, then the same tokens one by one (the
recurrent state carried between calls), and stores both in ``tests/data/mamba_llamacpp.json``.
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

    from tests.test_gguf_mamba import FIXTURE, TOKENS, write_llamacpp_mamba

    with tempfile.TemporaryDirectory() as folder:
        path = write_llamacpp_mamba(pathlib.Path(folder) / "mamba.gguf")
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False)
        llm.reset()
        llm.eval(TOKENS)
        batch = np.asarray(llm.scores[: len(TOKENS)], np.float64)
        llm.reset()
        for t in TOKENS:
            llm.eval([t])
        stepwise = np.asarray(llm.scores[: len(TOKENS)], np.float64)
    FIXTURE.write_text(
        json.dumps(
            {
                "llama_cpp_python": llama_cpp.__version__,
                "gguf_sha256": digest,
                "tokens": TOKENS,
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
