"""linen integration: the twin model through the kvjax cache equals its uncached pass, and NNX."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.nn import UbatchInputs, LinenCachedAttention, LlamaConfig, LlamaLinen, make_step, params_from_nnx
from tests.test_nn_nnx import (
    ATOL,
    BASE,
    check_against_uncached,
    eager_runner,
    make_model,
    model_config,
    new_cache,
    nnx_forward,
    run_scenario,
    shift_case,
    step_runner,
)


def linen_params(cfg: LlamaConfig, seed: int):
    """Linen variables with the weights of the NNX model of the same seed (no linen init compile)."""
    return params_from_nnx(make_model(cfg, seed))


@functools.lru_cache(maxsize=None)
def linen_step(cfg: LlamaConfig):
    return make_step(LlamaLinen(cfg))


@functools.lru_cache(maxsize=None)
def linen_forward(cfg: LlamaConfig):
    model = LlamaLinen(cfg)
    return jax.jit(lambda params, toks: model.apply(params, toks, method=LlamaLinen.forward))


@pytest.mark.parametrize("variant", ["rope", "alibi-swa"])
def test_cached_equals_uncached_jitted(variant):
    """RoPE without a window, and ALiBi with a chunked window on layer 0 (the NNX tests run all
    four combinations; the layer code under both frameworks is the same core)."""
    cfg = model_config(variant)
    params = linen_params(cfg, seed=6)
    rec, cache = run_scenario(step_runner(linen_step(cfg), params), new_cache(cfg), cfg.vocab_size, seed=7)
    assert kvjax.errors(cache) == []
    check_against_uncached(rec, functools.partial(linen_forward(cfg), params))


def test_cached_equals_uncached_eager():
    cfg = model_config("rope-swa")
    params = linen_params(cfg, seed=8)
    model = LlamaLinen(cfg)

    def call(tokens, cache, inputs):
        return model.apply(params, tokens, cache, inputs)

    rec, _ = run_scenario(eager_runner(call), new_cache(cfg), cfg.vocab_size, seed=9, decode_rounds=1)
    check_against_uncached(rec, functools.partial(linen_forward(cfg), params))


def test_linen_equals_nnx():
    """Same weights (params_from_nnx), same logits, cached and uncached."""
    cfg = model_config("alibi-swa", tie_embeddings=True)
    nnx_model = make_model(cfg, seed=10)
    params = params_from_nnx(nnx_model)
    toks = jnp.asarray(np.random.default_rng(0).integers(cfg.vocab_size, size=(2, 12)), jnp.int32)
    np.testing.assert_allclose(linen_forward(cfg)(params, toks), nnx_forward(nnx_model)(toks), atol=1e-5)
    assert "lm_head" not in params["params"]  # tied: the embedding is the output projection


def test_shifted_equals_recomputed_rope():
    """seq_rm + seq_add + K-shift through the linen model (one layer, see the NNX test)."""
    cfg = LlamaConfig(**{**BASE, "n_layer": 1})
    params = linen_params(cfg, seed=4)
    forward = functools.partial(linen_forward(cfg), params)
    got, ref = shift_case(cfg, params, linen_step(cfg), forward, use_update=True)
    np.testing.assert_allclose(got, ref, atol=ATOL, rtol=1e-5)


def test_bad_input():
    with pytest.raises(ValueError, match="n_heads"):
        LinenCachedAttention(d_model=32, n_heads=3, n_kv_heads=2, head_dim=8, layer=0).init(
            jax.random.PRNGKey(0), jnp.ones((1, 2, 32)), jnp.zeros((1, 2), jnp.int32), method="uncached"
        )
    with pytest.raises(ValueError, match="config"):
        LlamaLinen("not a config").init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32), method="forward")
    with pytest.raises(ValueError, match="kvjax.nn.Llama"):
        params_from_nnx(LlamaLinen(LlamaConfig()))
    cfg = LlamaConfig(**BASE)
    params = linen_params(cfg, seed=0)
    ub = kvjax.make_ubatch([0], [[0]])
    wrong = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=2, n_kv_heads=4, head_dim=8))
    with pytest.raises(ValueError, match="n_kv_heads"):
        LlamaLinen(cfg).apply(
            params, jnp.array([1]), wrong, UbatchInputs(ubatch=ub, placement=jnp.array([0]), windows=(32,))
        )
