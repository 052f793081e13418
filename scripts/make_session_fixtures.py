"""Record llama.cpp's session and sequence files for two tiny models, for tests/test_session_handover.py.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_session_fixtures.py

It writes ``tests/data/sessions/``:

- ``tiny-llama.gguf`` (2 layers, width 64, 4 query / 2 K/V heads of 32), ``tiny-llama64.gguf``
  (the same with heads of 64: llama.cpp rotates quantized K/V of such heads),
  ``tiny-gemma3.gguf`` (3 layers: two with an 8-token sliding window, one full; tied embeddings)
  and ``tiny-deepseek.gguf`` (a deepseek2: multi-head latent attention over 64-wide latent rows,
  a dense block then a mixture of experts; K only in the state): random weights,
  a 256-token byte vocabulary, F16 matrices, so that llama.cpp loads them (a few hundred KB);
- for each case of :data:`CASES`, the file llama.cpp saved after evaluating the prompts
  (``llama_state_save_file``: ``<case>.session``; and for the ``seq`` cases the one-sequence file
  ``llama_state_seq_save_file`` wrote, ``<case>.seq``);
- ``cases.json``: each case's llama.cpp options, the tokens every sequence holds, and the greedy
  tokens llama.cpp chose after loading the file into a fresh context (its last token evaluated
  again: a session file holds no logits), with the logit gap between the best and the second-best
  token at every step (so that a test can tell a near tie from a divergence). A ``seq`` case loads
  the sequence file into sequence ``dest`` of a context that first evaluated another prompt in
  sequence 0, as a user moving one conversation into a busy server would.
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DATA = ROOT / "tests" / "data" / "sessions"
N_NEW = 64
N_CTX = 256

_rng = np.random.default_rng(2026)
PROMPT = [int(t) for t in _rng.integers(0, 256, 20)]
PREFIX = [int(t) for t in _rng.integers(0, 256, 12)]
SUFFIXES = [[int(t) for t in _rng.integers(0, 256, n)] for n in (5, 9, 3)]
OTHER = [int(t) for t in _rng.integers(0, 256, 7)]

#: name -> llama.cpp context options and what is evaluated. ``shared``: the prompts' common
#: prefix is evaluated once in sequence 0 and copied to the others (``seq_cp``: shared cells).
CASES = {
    "llama-f16-vtrans": dict(model="llama", kv_type="f16", flash_attn=False, prompts=[PROMPT]),
    "llama-f16-rows": dict(model="llama", kv_type="f16", flash_attn=True, prompts=[PROMPT]),
    "llama-q8_0": dict(model="llama", kv_type="q8_0", flash_attn=True, prompts=[PROMPT]),
    # heads of 64: llama.cpp's quantized K/V in its rotated basis
    "llama64-q8_0": dict(
        model="llama64",
        kv_type="q8_0",
        flash_attn=True,
        n_seq=2,
        shared=len(PREFIX),
        prompts=[PREFIX + s for s in SUFFIXES[:2]],
        seq=dict(src=1, dest=1),
    ),
    "llama-shared": dict(
        model="llama",
        kv_type="f16",
        flash_attn=False,
        n_seq=3,
        shared=len(PREFIX),
        prompts=[PREFIX + s for s in SUFFIXES],
        seq=dict(src=1, dest=2),
    ),
    "llama-streams": dict(
        model="llama",
        kv_type="f16",
        flash_attn=False,
        n_seq=2,
        kv_unified=False,
        prompts=[PROMPT, PREFIX + SUFFIXES[0]],
    ),
    "gemma3-f16-vtrans": dict(model="gemma3", kv_type="f16", flash_attn=False, prompts=[PROMPT]),
    "gemma3-q8_0": dict(model="gemma3", kv_type="q8_0", flash_attn=True, prompts=[PROMPT]),
    "gemma3-shared": dict(
        model="gemma3",
        kv_type="f16",
        flash_attn=True,
        n_seq=3,
        shared=len(PREFIX),
        prompts=[PREFIX + s for s in SUFFIXES],
        seq=dict(src=1, dest=2),
    ),
    # the latent (MLA) cache: one K row of [latent 32 | RoPE key 32] a token, V its first 32 columns
    "deepseek-f16": dict(model="deepseek", kv_type="f16", flash_attn=True, prompts=[PROMPT]),
    "deepseek-q8_0": dict(
        model="deepseek",
        kv_type="q8_0",
        flash_attn=True,
        n_seq=2,
        shared=len(PREFIX),
        prompts=[PREFIX + s for s in SUFFIXES[:2]],
        seq=dict(src=1, dest=1),
    ),
}


def _byte_vocab_kv() -> dict:
    """GGUF writer calls for a 256-token byte-level BPE vocabulary (llama.cpp needs one to load)."""
    from benchmarks.bench_llamacpp import _byte_tokens

    toks = _byte_tokens()
    return {
        "add_tokenizer_model": "gpt2",
        "add_tokenizer_pre": "default",
        "add_token_list": (toks,),
        "add_token_types": ([1] * 256,),
        "add_token_merges": ([f"{toks[1]} {toks[2]}"],),
        "add_bos_token_id": 0,
        "add_eos_token_id": 0,
        "add_add_bos_token": False,
    }


def _random_sd(n_layer: int, gemma: bool, rng, hd: int = 32) -> dict:
    """HF-named random weights (torch layout) of a width-64 model with 4 query / 2 K/V heads of ``hd``.

    The Gemma has unit-norm embedding rows, wide norms and larger matrices: with the initialiser's
    scale its scaled embedding dominates the residual and the greedy tokens are one repeated token.
    """
    d, ff, vocab = 64, 128, 256
    w_std, norm_std = (1.0, 0.6) if gemma else (0.25, 0.3)
    shapes = {
        "self_attn.q_proj.weight": (4 * hd, d),
        "self_attn.k_proj.weight": (2 * hd, d),
        "self_attn.v_proj.weight": (2 * hd, d),
        "self_attn.o_proj.weight": (d, 4 * hd),
        "mlp.gate_proj.weight": (ff, d),
        "mlp.up_proj.weight": (ff, d),
        "mlp.down_proj.weight": (d, ff),
    }
    norms = {"input_layernorm.weight": d, "post_attention_layernorm.weight": d}
    if gemma:
        norms.update(
            {
                "pre_feedforward_layernorm.weight": d,
                "post_feedforward_layernorm.weight": d,
                "self_attn.q_norm.weight": hd,
                "self_attn.k_norm.weight": hd,
            }
        )
    embed = rng.standard_normal((vocab, d)).astype(np.float32)
    if gemma:
        embed /= np.linalg.norm(embed, axis=1, keepdims=True)
    # gemma's norms are 1 + w (write_gguf adds the 1); llama's are w
    offset = 0.0 if gemma else 1.0
    sd = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": (norm_std * rng.standard_normal(d) + offset).astype(np.float32),
    }
    if not gemma:
        sd["lm_head.weight"] = (0.25 * rng.standard_normal((vocab, d))).astype(np.float32)
    for il in range(n_layer):
        for name, shape in shapes.items():
            sd[f"model.layers.{il}.{name}"] = (w_std * rng.standard_normal(shape)).astype(np.float32)
        for name, n in norms.items():
            sd[f"model.layers.{il}.{name}"] = (norm_std * rng.standard_normal(n) + offset).astype(np.float32)
    return sd


def write_models(folder: pathlib.Path) -> dict:
    """The two tiny GGUF files; ``{model name: path}``."""
    import gguf

    from tests.test_gguf import write_gguf

    rng = np.random.default_rng(7)
    llama = write_gguf(
        folder / "tiny-llama.gguf",
        "llama",
        _random_sd(2, False, rng),
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=10000.0,
        qtype=gguf.GGMLQuantizationType.F16,
        extra_kv=_byte_vocab_kv(),
        head_dim=32,
    )
    gemma_kv = dict(
        _byte_vocab_kv(),
        add_sliding_window=8,
        add_sliding_window_pattern=([True, True, False],),
        add_rope_freq_base_swa=10000.0,
    )
    gemma = write_gguf(
        folder / "tiny-gemma3.gguf",
        "gemma3",
        _random_sd(3, True, rng),
        n_layer=3,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-6,
        theta=1e6,
        qtype=gguf.GGMLQuantizationType.F16,
        extra_kv=gemma_kv,
        head_dim=32,
    )
    # heads of 64 values: llama.cpp stores its quantized K/V Walsh-Hadamard-rotated (kvjax.io._attn_rot)
    llama64 = write_gguf(
        folder / "tiny-llama64.gguf",
        "llama",
        _random_sd(2, False, rng, hd=64),
        n_layer=2,
        n_heads=4,
        n_kv_heads=2,
        eps=1e-5,
        theta=10000.0,
        qtype=gguf.GGMLQuantizationType.F16,
        extra_kv=_byte_vocab_kv(),
        head_dim=64,
    )
    from tests.test_deepseek import DeepseekConfig, Routing, _hf_state_of, random_deepseek, write_deepseek_gguf

    eps = float(np.float32(1e-6))
    ds_cfg = DeepseekConfig(
        vocab_size=256,
        d_model=64,
        n_layer=2,
        n_heads=4,
        q_lora_rank=32,  # llama.cpp reads a deepseek2 without q_lora_rank only at V2-Lite's 27 layers
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=32,
        v_head_dim=16,
        d_ff=128,
        norm_eps=eps,
        latent_norm_eps=eps,
        n_dense_layers=1,
        n_experts=4,
        n_experts_used=2,
        moe_d_ff=32,
        n_shared_experts=1,
        routing=Routing(score="softmax", scale=1.0),
    )
    deepseek = write_deepseek_gguf(
        folder / "tiny-deepseek.gguf",
        _hf_state_of(random_deepseek(ds_cfg, 11)),
        ds_cfg,
        weight_type="F16",
        extra_kv=_byte_vocab_kv(),
    )
    return {"llama": llama, "gemma3": gemma, "llama64": llama64, "deepseek": deepseek}


def context_options(case: dict) -> dict:
    return dict(
        n_ctx=N_CTX,
        n_seq=case.get("n_seq", 1),
        kv_type=case["kv_type"],
        flash_attn=case["flash_attn"],
        kv_unified=case.get("kv_unified", True),
    )


def main(argv=None) -> int:
    import argparse

    from benchmarks.llamacpp_context import LlamaCppContext

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", nargs="*", default=None, help="record only the cases whose names start so (keep the others' records)"
    )
    args = parser.parse_args(argv)
    DATA.mkdir(parents=True, exist_ok=True)
    models = write_models(DATA)
    record = {"llama_cpp_python": __import__("llama_cpp").__version__, "n_new": N_NEW, "cases": {}}
    if args.only is not None and (DATA / "cases.json").is_file():
        record["cases"] = json.loads((DATA / "cases.json").read_text())["cases"]
    for name, case in CASES.items():
        if args.only is not None and not name.startswith(tuple(args.only)):
            continue
        path = str(models[case["model"]])
        opts = context_options(case)
        ctx = LlamaCppContext(path, **opts)
        ctx.evaluate_prompts(case["prompts"], case.get("shared", 0))
        ctx.save_session(DATA / f"{name}.session", case["prompts"][0])
        if "seq" in case:
            src = case["seq"]["src"]
            ctx.save_sequence(DATA / f"{name}.seq", src, case["prompts"][src])
        ctx.close()
        again = LlamaCppContext(path, **opts)
        loaded = again.load_session(DATA / f"{name}.session")
        assert loaded == case["prompts"][0]
        seqs = list(range(len(case["prompts"])))
        tokens, gaps = again.continue_greedy(case["prompts"], seqs, N_NEW)
        again.close()
        entry = dict(case, options=opts, session=dict(tokens=tokens, gaps=gaps))
        if "seq" in case:
            busy = LlamaCppContext(path, **opts)
            busy.decode(OTHER, list(range(len(OTHER))), [[0]] * len(OTHER))
            dest = case["seq"]["dest"]
            held = busy.load_sequence(DATA / f"{name}.seq", dest)
            assert held == case["prompts"][case["seq"]["src"]]
            tokens, gaps = busy.continue_greedy([held], [dest], N_NEW)
            busy.close()
            entry["seq"] = dict(case["seq"], other=OTHER, tokens=tokens[0], gaps=gaps[0])
        record["cases"][name] = entry
        size = (DATA / f"{name}.session").stat().st_size
        print(f"{name}: session {size / 1024:.1f} KiB; first tokens {[t[:6] for t in entry['session']['tokens']]}")
    (DATA / "cases.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
