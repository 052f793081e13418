"""The real Gemma 3 270M Q4_K_M GGUF against what llama.cpp did with the same file.

Optional: every test here skips unless the ``real-model`` extra is installed (the
``real_gemma_gguf`` fixture in ``tests/conftest.py``); nothing is fetched at test time. llama.cpp
itself is not needed: ``scripts/make_real_model_fixtures.py`` ran it once (``llama-cpp-python``,
two threads, f16 K/V) and recorded its token ids, greedy continuations with the margin of every
step, and its perplexity over ``tests/data/real_model/text.txt`` in ``llamacpp.json``.

The file mixes Q4_K, Q6_K, Q5_0, Q8_0 and F32 tensors; it loads with its weights kept in those
block types (``from_gguf``'s default) and runs on the iSWA memory (Gemma 3: a 512-token window on
five layers of every six). One prompt is 727 tokens long, so the window slides in the prefill and
in decode.

llama.cpp multiplies quantized weights by activations it quantizes to 8 bits (``q8_0`` / ``q8_K``
dot products); kvjax dequantizes the weights exactly and multiplies in float32. The logits
therefore differ by a little (measured: 0.0-1.3 on logits of magnitude ~20), and greedy tokens may
part where llama.cpp's two best logits are within :data:`NEAR_TIE` of each other: a test allows a
divergence only there, and compares nothing after it.
"""

from __future__ import annotations

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.nn import from_gguf, memory_config_for

FIXTURES = json.loads((pathlib.Path(__file__).parent / "data" / "real_model" / "llamacpp.json").read_text())
#: a greedy divergence is accepted where llama.cpp's best two logits were closer than this
NEAR_TIE = 0.5
#: perplexity over the bundled text: within this fraction of llama.cpp's
PPL_TOL = 0.01


@pytest.fixture(scope="module")
def gemma(real_gemma_gguf):
    return from_gguf(real_gemma_gguf)


def _engine(model, size=1024):
    return kvjax.Engine(model, kvjax.init(memory_config_for(model, size=size, n_seq_max=1)), n_ubatch=256)


def _agree(got, case):
    """The number of greedy tokens equal to llama.cpp's, or a failure unless they part at a near-tie."""
    want = case["greedy"]
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            assert case["margins"][i] < NEAR_TIE, (
                f"greedy tokens part at step {i} ({a} against llama.cpp's {b}) where llama.cpp's margin was "
                f"{case['margins'][i]:.3f} (not a near-tie); kvjax {got}, llama.cpp {want}"
            )
            return i
    return len(want)


def test_the_file_loads_compact(gemma, real_gemma_gguf):
    from kvjax.nn._ggml_linear import GGMLEmbed, GGMLLinear, resident_bytes

    assert isinstance(gemma.embed, GGMLEmbed) and gemma.embed.type_name == "Q8_0"
    q, o, down = gemma.layers[0].attn.q_proj, gemma.layers[0].attn.o_proj, gemma.layers[0].mlp.down
    assert all(isinstance(m, GGMLLinear) for m in (q, o, down))
    assert (q.type_name, o.type_name, down.type_name) == ("Q5_0", "Q4_K", "Q6_K")  # as the file stores them
    size = pathlib.Path(real_gemma_gguf).stat().st_size
    resident = resident_bytes(gemma)
    print(f"resident weights {resident / 2**20:.1f} MiB, file {size / 2**20:.1f} MiB ({resident / size:.3f}x)")
    assert resident <= 1.2 * size
    cfg = gemma.config
    assert (cfg.n_layer, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_swa) == (18, 640, 4, 1, 256, 512)
    assert cfg.swa_layers == tuple(i for i in range(18) if i % 6 != 5)


@pytest.mark.parametrize("index", range(len(FIXTURES["cases"])))
def test_greedy_tokens_equal_llama_cpp(gemma, index):
    case = FIXTURES["cases"][index]
    result = kvjax.generate(
        _engine(gemma),
        [case["ids"]],
        max_new_tokens=len(case["greedy"]),
        key=jax.random.PRNGKey(0),
        sampling=kvjax.SamplingConfig(temperature=0.0),
    )
    got = [int(t) for t in result.tokens[0]]
    same = _agree(got, case)
    print(f"{len(case['ids'])} prompt tokens: {same} of {len(got)} greedy tokens equal to llama.cpp's")
    assert same >= min(8, len(got)) or case["margins"][same] < NEAR_TIE


@pytest.mark.parametrize("index", range(len(FIXTURES["cases"])))
def test_every_greedy_step_on_llama_cpps_path(gemma, index):
    """Fed llama.cpp's own greedy tokens, kvjax picks llama.cpp's next token at every step.

    The free-running test above stops at the first divergence (the 727-token prompt's first step
    is a near-tie of 0.01): this one checks all 24 steps of every prompt, past the window's slide,
    allowing another token only where llama.cpp's two best logits are within NEAR_TIE.
    """
    case = FIXTURES["cases"][index]
    ids = case["ids"] + case["greedy"][:-1]
    logits = np.asarray(_engine(gemma).decode(ids, range(len(ids)), [[0]] * len(ids)))
    picks = logits[len(case["ids"]) - 1 :].argmax(-1).tolist()
    off = [i for i, (a, b) in enumerate(zip(picks, case["greedy"])) if a != b]
    print(
        f"{len(case['ids'])} prompt tokens: {len(picks) - len(off)} of {len(picks)} steps pick llama.cpp's token; "
        f"others at margins {[round(case['margins'][i], 3) for i in off]}"
    )
    assert all(case["margins"][i] < NEAR_TIE for i in off), (off, [case["margins"][i] for i in off])


def test_perplexity_within_one_percent_of_llama_cpp(gemma):
    ids = FIXTURES["text"]["ids"]
    logits = np.asarray(_engine(gemma).decode(ids, range(len(ids)), [[0]] * len(ids)), np.float64)
    logits = logits[:-1]
    top = logits.max(-1)
    nll = np.log(np.exp(logits - top[:, None]).sum(-1)) + top - logits[np.arange(len(ids) - 1), ids[1:]]
    ppl, want = float(np.exp(nll.mean())), FIXTURES["text"]["perplexity"]
    print(f"perplexity over {len(ids)} tokens: kvjax {ppl:.4f}, llama.cpp {want:.4f} ({ppl / want - 1:+.3%})")
    assert abs(ppl / want - 1) < PPL_TOL


def test_compact_and_float_weights_agree(gemma, real_gemma_gguf):
    """The same file dequantized at load (gguf's numpy dequantizers) gives the compact model's logits."""
    ids = jnp.asarray(FIXTURES["cases"][0]["ids"])
    full = from_gguf(real_gemma_gguf, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(gemma.forward(ids)), np.asarray(full.forward(ids)), atol=2e-3, rtol=0)
