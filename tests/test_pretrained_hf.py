"""``kvjax.nn.from_pretrained`` against ``transformers`` (skipped without torch and transformers).

Tiny random ``*ForCausalLM`` of every supported architecture (Llama, one of them sharded with an
index file; Qwen2 with tied embeddings and q/k/v biases; Mistral with a sliding window; Gemma 2;
Gemma 3 text, also as a multimodal ``gemma3`` folder; Mamba), saved with ``save_pretrained``,
equal transformers' logits within 1e-4 in float32: uncached; through :class:`kvjax.Engine`
(prefill, a shared prefix by ``seq_cp``, greedy decode of two sequences in one batch); after a
context shift (seq_rm + seq_add, one-layer models). RoPE linear / llama3 / yarn on Llama;
bfloat16 loads within ``BF16_TOL`` (relative to the largest logit).
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import Engine
from kvjax.nn import Mamba, from_pretrained, memory_config_for
from tests.test_pretrained import ATOL_HF, BF16_TOL, ROPE_CASES, TOKENS, V

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("safetensors")


# -- against transformers: every architecture -------------------------------------------------------


def _hf_config(transformers, arch, n_layer=2):
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=n_layer,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    if arch in ("llama", "llama-sharded"):
        return transformers.LlamaConfig(**common)
    if arch.startswith("llama-"):  # RoPE scaling kinds on Llama
        return transformers.LlamaConfig(
            **common, max_position_embeddings=256, rope_parameters=dict(ROPE_CASES[arch[len("llama-") :]])
        )
    if arch == "qwen2":
        return transformers.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "mistral":
        return transformers.MistralConfig(**common, sliding_window=4)
    if arch == "gemma2":
        return transformers.Gemma2Config(
            **common,
            head_dim=16,
            query_pre_attn_scalar=12,
            sliding_window=4,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        )
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **common,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"][:n_layer],
        )
    if arch == "mamba":
        return transformers.MambaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, state_size=8)
    raise AssertionError(arch)


_HF = {}


def _hf(arch, tmp_path_factory, n_layer=2):
    """``(transformers model, checkpoint folder)`` of an architecture, built and saved once."""
    if (arch, n_layer) not in _HF:
        torch = pytest.importorskip("torch")
        transformers = pytest.importorskip("transformers")
        hc = _hf_config(transformers, arch, n_layer)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(hc).eval()
        with torch.no_grad():  # norms start at 0 or 1 and projections small: move every weight
            for p in model.parameters():
                p.add_(0.3 * torch.randn_like(p))
        folder = tmp_path_factory.mktemp(f"{arch}-{n_layer}")
        model.save_pretrained(
            folder, safe_serialization=True, **(dict(max_shard_size="40KB") if arch == "llama-sharded" else {})
        )
        _HF[arch, n_layer] = (model, folder)
    return _HF[arch, n_layer]


def _hf_logits(hf, tokens):
    import torch

    with torch.no_grad():
        return hf(torch.tensor([list(tokens)])).logits[0].float().numpy()


ARCHS = ["llama-sharded", "qwen2", "mistral", "gemma2", "gemma3", "mamba"]


@pytest.mark.parametrize("arch", ARCHS + ["llama-" + k for k in sorted(ROPE_CASES)])
def test_uncached_equals_transformers(arch, tmp_path_factory):
    hf, folder = _hf(arch, tmp_path_factory)
    if arch == "llama-sharded":
        assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    model = from_pretrained(folder)
    tokens = list(np.asarray(TOKENS))
    ours = np.asarray(model.forward(jnp.asarray([tokens]))[0])
    np.testing.assert_allclose(ours, _hf_logits(hf, tokens), atol=ATOL_HF)


@pytest.mark.parametrize(
    "arch",
    [
        "llama-sharded",
        "gemma3",
        "mamba",
        *(pytest.param(a, marks=pytest.mark.slow) for a in ("qwen2", "mistral", "gemma2")),
    ],
)
def test_bfloat16_load_within_tolerance(arch, tmp_path_factory):
    hf, folder = _hf(arch, tmp_path_factory)
    model = from_pretrained(folder, dtype="bfloat16")
    tokens = list(np.asarray(TOKENS))
    got = np.asarray(model.forward(jnp.asarray([tokens]))[0], np.float32)
    ref = _hf_logits(hf, tokens)
    assert np.abs(got - ref).max() <= BF16_TOL * np.abs(ref).max(), np.abs(got - ref).max()


def _through_the_engine(model, hf):
    """Prefill a shared prefix, fork it (seq_cp), continue two sequences greedily: every logit row
    equals transformers' on that sequence's tokens."""
    mem = memory_config_for(model, size=64, n_seq_max=2, **({} if isinstance(model, Mamba) else dict(n_batch=16)))
    engine = Engine(model, kvjax.init(mem), n_ubatch=16)
    prefix = [int(t) for t in TOKENS[:5]]
    seqs = [prefix + [7, 8, 9], prefix + [11, 12]]
    got = [[np.asarray(engine.decode(prefix, range(5), [[0]] * 5))], []]
    engine.cache = kvjax.seq_cp(engine.cache, 0, 1)
    rows = np.asarray(engine.decode(seqs[0][5:] + seqs[1][5:], [5, 6, 7, 5, 6], [[0]] * 3 + [[1]] * 2))
    got[0].append(rows[:3])
    got[1].append(rows[3:])
    for _ in range(3):  # greedy decode of both sequences in one batch
        nxt = [int(np.argmax(got[s][-1][-1])) for s in (0, 1)]
        for s in (0, 1):
            seqs[s].append(nxt[s])
        rows = np.asarray(engine.decode(nxt, [len(seqs[0]) - 1, len(seqs[1]) - 1], [[0], [1]]))
        got[0].append(rows[:1])
        got[1].append(rows[1:])
    np.testing.assert_allclose(np.concatenate(got[0]), _hf_logits(hf, seqs[0]), atol=ATOL_HF)
    np.testing.assert_allclose(np.concatenate(got[1]), _hf_logits(hf, seqs[1])[5:], atol=ATOL_HF)


@pytest.mark.parametrize(
    "arch",
    [
        "llama-sharded",
        *(pytest.param(a, marks=pytest.mark.slow) for a in ARCHS[1:]),
        pytest.param("llama-yarn", marks=pytest.mark.slow),
        pytest.param("llama-llama3", marks=pytest.mark.slow),
    ],
)
def test_engine_equals_transformers(arch, tmp_path_factory):
    hf, folder = _hf(arch, tmp_path_factory)
    _through_the_engine(from_pretrained(folder), hf)


@pytest.mark.parametrize(
    "arch",
    [
        "llama-yarn",
        *(
            pytest.param(a, marks=pytest.mark.slow)
            for a in ("llama", "llama-llama3", "llama-linear", "qwen2", "mistral", "gemma2", "gemma3")
        ),
    ],
)
def test_context_shift_equals_transformers(arch, tmp_path_factory):
    """seq_rm + seq_add (the K-shift) of a one-layer model equals transformers on the kept tokens.

    One layer: the cached K/V of a kept token depend only on its own embedding, so the shifted
    cache is exactly the cache of the kept tokens (with more layers a context shift keeps K/V
    computed over the discarded tokens too: llama.cpp's approximation, not comparable to a fresh pass).
    """
    hf, folder = _hf(arch, tmp_path_factory, n_layer=1)
    model = from_pretrained(folder)
    engine = Engine(model, kvjax.init(memory_config_for(model, size=64, n_seq_max=1)), n_ubatch=16)
    seq = [int(t) for t in TOKENS[:10]]
    last = np.asarray(engine.decode(seq, range(10), [[0]] * 10))[-1]
    n_keep, n_discard = 2, 4
    next_pos = engine.context_shift(0, n_keep, n_discard)
    kept = seq[:n_keep] + seq[n_keep + n_discard :] + [int(np.argmax(last))]
    assert next_pos == len(kept) - 1
    row = np.asarray(engine.decode(kept[-1:], [next_pos], [[0]]))[0]
    np.testing.assert_allclose(row, _hf_logits(hf, kept)[-1], atol=ATOL_HF)


def test_gemma3_multimodal_folder_loads_its_text_model(tmp_path_factory, tmp_path):
    """A ``gemma3`` config with a ``text_config`` and vision tensors: the text model loads, vision skipped."""
    hf, folder = _hf("gemma3", tmp_path_factory)
    from safetensors.numpy import load_file, save_file

    tensors = {
        k.replace("model.", "model.language_model.", 1): v
        for k, v in load_file(str(folder / "model.safetensors")).items()
    }
    tensors["model.vision_tower.patch.weight"] = np.zeros((2, 2), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    text = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text})
    )
    model = from_pretrained(tmp_path)
    tokens = list(np.asarray(TOKENS))
    np.testing.assert_allclose(
        np.asarray(model.forward(jnp.asarray([tokens]))[0]), _hf_logits(hf, tokens), atol=ATOL_HF
    )
