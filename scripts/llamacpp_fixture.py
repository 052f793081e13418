"""Record llama.cpp's logits for a tiny GGUF a test writes: the shared half of the fixture scripts.

Run in the benchmark environment only (``llama-cpp-python`` installed), never in CI.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import tempfile

import numpy as np


def record(write, tokens, fixture: pathlib.Path, name: str, **context) -> int:
    """Write the file with ``write(path)``, evaluate ``tokens`` in one llama.cpp batch (the logits of
    every position), then one by one (llama.cpp's own state carried between calls), and store both,
    with the file's digest, in ``fixture``. ``context``: more ``llama_cpp.Llama`` arguments."""
    import llama_cpp

    with tempfile.TemporaryDirectory() as folder:
        path = write(pathlib.Path(folder) / name)
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=64, n_batch=64, n_threads=2, logits_all=True, verbose=False, **context
        )
        llm.reset()
        llm.eval(tokens)
        batch = np.asarray(llm.scores[: len(tokens)], np.float64)
        llm.reset()
        for t in tokens:
            llm.eval([t])
        stepwise = np.asarray(llm.scores[: len(tokens)], np.float64)
    fixture.write_text(
        json.dumps(
            {
                "llama_cpp_python": llama_cpp.__version__,
                "gguf_sha256": digest,
                "tokens": list(tokens),
                "logits_batch": np.round(batch, 6).tolist(),
                "logits_stepwise": np.round(stepwise, 6).tolist(),
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {fixture} (batch against one-by-one: max difference {np.abs(batch - stepwise).max():.2e})")
    return 0
