"""Fused projections (``kvjax.nn.fuse_projections``): the same model, fewer matmuls.

Fusing concatenates each attention layer's Q/K/V weights into one ``qkv_proj`` and each MLP's
gate/up into one ``gate_up``. The products are the same, so a fused model must give the unfused
model's logits (uncached and through every memory kind the reference models drive), the same
greedy tokens, and the same results whether the step is jitted or not; bad input is refused and
leaves the model as it was. Sharded fused weights are covered in ``tests/test_sharding.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax.nn import HybridLM, HybridLMConfig, LlamaConfig, fuse_projections, is_fused, make_step
from tests.test_nn_nnx import make_model

CONFIGS = {
    "gqa": LlamaConfig(vocab_size=64, d_model=64, n_layer=2, n_heads=8, n_kv_heads=2),
    "mha": LlamaConfig(vocab_size=64, d_model=64, n_layer=2, n_heads=4, n_kv_heads=4),
    # Qwen2-style biases on q/k/v, Gemma 3-style per-head norms of q and k
    "bias-qknorm": LlamaConfig(
        vocab_size=64, d_model=64, n_layer=2, n_heads=4, n_kv_heads=2, attention_bias=True, qk_norm=True, head_dim=32
    ),
}


def _pair(cfg):
    """An unfused model and a fused copy of it (the same random weights)."""
    return make_model(cfg), fuse_projections(make_model(cfg))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_forward_equals_unfused(name):
    plain, fused = _pair(CONFIGS[name])
    assert is_fused(fused) and not is_fused(plain)
    a = fused.layers[0].attn
    assert a.q_proj is None and a.k_proj is None and a.v_proj is None
    assert fused.layers[0].mlp.gate is None and fused.layers[0].mlp.up is None
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, size=(2, 7)), jnp.int32)
    np.testing.assert_allclose(
        np.asarray(fused.forward(tokens)), np.asarray(plain.forward(tokens)), rtol=1e-5, atol=1e-5
    )


def test_fused_layout_groups_heads_per_kv_head():
    """qkv columns: per kv head, its G query heads, then its key head, then its value head."""
    cfg = CONFIGS["gqa"]
    plain, fused = _pair(cfg)
    d, h, g = cfg.head_size, cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads
    w = np.asarray(fused.layers[1].attn.qkv_proj.kernel[...]).reshape(-1, h, g + 2, d)
    a = plain.layers[1].attn
    np.testing.assert_array_equal(w[:, :, :g].reshape(-1, h * g * d), np.asarray(a.q_proj.kernel[...]))
    np.testing.assert_array_equal(w[:, :, g].reshape(-1, h * d), np.asarray(a.k_proj.kernel[...]))
    np.testing.assert_array_equal(w[:, :, g + 1].reshape(-1, h * d), np.asarray(a.v_proj.kernel[...]))
    gu = np.asarray(fused.layers[1].mlp.gate_up.kernel[...])
    np.testing.assert_array_equal(gu[:, 0::2], np.asarray(plain.layers[1].mlp.gate.kernel[...]))
    np.testing.assert_array_equal(gu[:, 1::2], np.asarray(plain.layers[1].mlp.up.kernel[...]))


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_fused_step_equals_unfused_through_the_cache(jit):
    """Prefill then decode through a unified cache: fused logits equal unfused, jitted or not."""
    cfg = CONFIGS["gqa"]
    plain, fused = _pair(cfg)
    ubs = [kvjax.make_ubatch([0, 1, 2, 0, 1], [[0]] * 3 + [[1]] * 2), kvjax.make_ubatch([3, 2], [[0], [1]])]
    toks = [np.array([5, 9, 11, 3, 7], np.int32), np.array([1, 2], np.int32)]
    out = {}
    for name, model in (("plain", plain), ("fused", fused)):
        memory = kvjax.init(cfg.cache_config(size=32, n_seq_max=2, padding=8))
        if jit:
            step, state = make_step(model), nnx.state(model)
            run = lambda mem, ub, t: step(state, mem, ub, t, n_kv=8)[:2]  # noqa: E731
        else:

            def run(mem, ub, t):
                mem, placement, ok = kvjax.find_slot(mem, ub)
                assert bool(ok)
                inputs = kvjax.nn.UbatchInputs(ubatch=ub, placement=placement, windows=(8,))
                return model(jnp.asarray(t), mem, inputs)

        rows = []
        for ub, t in zip(ubs, toks):
            logits, memory = run(memory, ub, np.pad(t, (0, ub.length - len(t))))  # ubatches pad to a bucket
            rows.append(np.asarray(logits)[: len(t)])
        out[name] = rows
    for a, b in zip(out["fused"], out["plain"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_fused_generate_gives_the_same_tokens():
    cfg = CONFIGS["gqa"]
    plain, fused = _pair(cfg)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    got = {}
    for name, model in (("plain", plain), ("fused", fused)):
        engine = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=64, n_seq_max=2, padding=8)))
        got[name] = kvjax.generate(
            engine, prompts, max_new_tokens=8, key=jax.random.PRNGKey(0), sampling=kvjax.SamplingConfig(temperature=0)
        ).tokens
    assert got["fused"] == got["plain"]


def test_fused_hybrid_model_equals_unfused():
    """HybridLM's attention layers and MLPs fuse; its Mamba layers are left alone."""
    cfg = HybridLMConfig()
    plain = HybridLM(cfg, rngs=nnx.Rngs(0))
    fused = fuse_projections(HybridLM(cfg, rngs=nnx.Rngs(0)))
    assert is_fused(fused)
    tokens = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
    np.testing.assert_allclose(
        np.asarray(fused.forward(tokens)), np.asarray(plain.forward(tokens)), rtol=1e-5, atol=1e-5
    )


def test_fusing_twice_changes_nothing_and_bad_input_is_refused():
    cfg = CONFIGS["gqa"]
    fused = fuse_projections(make_model(cfg))
    before = jax.tree.map(np.asarray, nnx.state(fused))
    assert fuse_projections(fused) is fused
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, nnx.state(fused)), before)
    with pytest.raises(ValueError, match="model must be an NNX module"):
        fuse_projections(kvjax.nn.LlamaLinen(cfg))
    with pytest.raises(ValueError, match="model must be an NNX module"):
        fuse_projections("llama")


def test_fused_keeps_the_parameter_dtype():
    """A bfloat16 model (``from_pretrained(..., dtype="bfloat16")``) stays bfloat16 when fused."""
    cfg = CONFIGS["gqa"]

    def bf16_model():
        model = make_model(cfg)
        nnx.update(model, jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model, nnx.Param)))
        return model

    plain, fused = bf16_model(), fuse_projections(bf16_model())
    assert fused.layers[0].attn.qkv_proj.kernel[...].dtype == jnp.bfloat16
    assert fused.layers[0].mlp.gate_up.kernel[...].dtype == jnp.bfloat16
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    a, b = np.asarray(fused.forward(tokens), np.float32), np.asarray(plain.forward(tokens), np.float32)
    np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2)


def test_saving_a_fused_model_is_refused_with_what_to_do(tmp_path):
    """Checkpoints name q/k/v and gate/up apart: a fused model cannot be saved or loaded into."""
    from kvjax.nn._pretrained import save_llama

    cfg = LlamaConfig(
        vocab_size=64,
        d_model=64,
        n_layer=1,
        n_heads=4,
        n_kv_heads=2,
        rope=kvjax.RopeConfig(n_rot=16, mode="neox", freq_base=10000.0),
    )  # a savable config
    save_llama(make_model(cfg), tmp_path / "plain")  # the same model unfused saves
    tmp_path = tmp_path / "fused"
    tmp_path.mkdir()
    fused = fuse_projections(make_model(cfg))
    with pytest.raises(ValueError, match="fused projections .* unfused model, then fuse"):
        save_llama(fused, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written
