"""The attention implementations behind ``kvjax.attention``: the Pallas kernel (interpreted on CPU)
equals the XLA path, selection by keyword, environment and backend, and bad input."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.attn import _attention, _pallas
from tests.helpers import fill
from tests.test_attention import MASKS, _scene, naive_attention


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    "layer,hq,mask_kind",
    [(0, 8, 0), (1, 3, 3), (2, 4, 5), (0, 2, 2)],
    ids=["gqa-causal", "mqa-swa", "symmetric", "alibi-mask"],
)
def test_pallas_equals_xla_and_naive(layer, hq, mask_kind):
    """Several layers and groups, windows of 48 and 64 cells, padded rows, float and bool masks."""
    cache, ub = _scene()
    d = cache.config.head_dim[layer]
    n_kv = 48 if mask_kind % 2 else 64
    mask = kvjax.kq_mask(cache, ub, n_kv, **MASKS[mask_kind])
    q = jnp.asarray(np.random.default_rng(hq).standard_normal((8, hq, d)), jnp.float32)
    out, lse = kvjax.attention(q, cache, layer, mask, return_lse=True, implementation="pallas")
    xla_out, xla_lse = kvjax.attention(q, cache, layer, mask, return_lse=True, implementation="xla")
    ref_out, ref_lse = naive_attention(q, cache, layer, mask, 1 / math.sqrt(d))
    _close(out, xla_out)
    _close(out, ref_out)
    np.testing.assert_array_equal(np.isneginf(np.asarray(lse)), np.isneginf(np.asarray(xla_lse)))
    finite = np.isfinite(ref_lse)
    _close(np.asarray(lse)[finite], ref_lse[finite])
    assert not np.asarray(out)[5:].any()  # padded rows see nothing: zeros, not NaN
    bool_out = kvjax.attention(q, cache, layer, mask > -jnp.inf, implementation="pallas") if mask_kind != 2 else out
    if mask_kind != 2:  # a visibility mask gives the same as the additive one without ALiBi
        _close(bool_out, out)


def test_pallas_jitted_equals_eager_and_options():
    """Inside jit, with a scale, softcap and bfloat16 queries; several kernel steps and row blocks."""
    cache, ub = _scene()
    mask = kvjax.kq_mask(cache, ub, 64)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((8, 4, 16)), jnp.bfloat16)

    def run(q, cache, mask, implementation):
        return kvjax.attention(
            q, cache, 0, mask, scale=0.3, softcap=2.0, return_lse=True, implementation=implementation
        )

    eager = run(q, cache, mask, "pallas")
    jitted = jax.jit(run, static_argnums=3)(q, cache, mask, "pallas")
    xla = run(q, cache, mask, "xla")
    assert eager[0].dtype == jnp.bfloat16
    for a, b in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    np.testing.assert_allclose(np.asarray(eager[0], np.float32), np.asarray(xla[0], np.float32), atol=1e-2)
    np.testing.assert_allclose(np.asarray(eager[1]), np.asarray(xla[1]), rtol=1e-5, atol=1e-5)


def test_pallas_several_steps_and_row_blocks(monkeypatch):
    """A window of 4 kernel steps and 3 row blocks (the last padded), against the XLA path."""
    monkeypatch.setattr(_pallas, "KV_BLOCK", 16)
    monkeypatch.setattr(_pallas, "ROW_BLOCK", 8)
    assert _pallas.kv_block(64) == 16
    cache, ub = _scene()
    mask = kvjax.kq_mask(cache, ub, 64)[:5]  # 5 tokens x G=2 rows, blocks of 4 tokens
    q = jnp.asarray(np.random.default_rng(2).standard_normal((5, 4, 16)), jnp.float32)
    out, lse = kvjax.attention(q, cache, 0, mask, return_lse=True, implementation="pallas")
    ref_out, ref_lse = kvjax.attention(q, cache, 0, mask, return_lse=True, implementation="xla")
    _close(out, ref_out)
    _close(lse, ref_lse)


def test_pallas_ignores_non_finite_bytes_in_masked_cells():
    """NaN/inf K and V in cells a row does not see change nothing; a visible NaN V gives NaN."""
    cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4, padding=16)
    cache = fill(kvjax.init(cfg), [0, 1, 0], [[0], [0], [1]])
    k = jnp.ones((3, 1, 4)).at[2].set(jnp.nan)
    v = jnp.ones((3, 1, 4)).at[2].set(jnp.inf)
    cache = kvjax.write(cache, 0, jnp.arange(3), k, v)
    ub = kvjax.make_ubatch([2], [[0]])
    cache, slot, _ = kvjax.find_slot(cache, ub)
    cache = kvjax.write(cache, 0, slot, jnp.ones((1, 1, 4)), jnp.full((1, 1, 4), 3.0))
    mask = kvjax.kq_mask(cache, ub, 16)
    q = jnp.ones((1, 2, 4))
    out = kvjax.attention(q, cache, 0, mask, implementation="pallas")
    _close(out, kvjax.attention(q, cache, 0, mask, implementation="xla"))
    assert np.isfinite(np.asarray(out)).all()
    seen = kvjax.attention(q, cache, 0, jnp.zeros_like(mask), implementation="pallas")  # every cell visible
    assert np.isnan(np.asarray(seen)).all()


def test_selection_by_keyword_environment_and_backend(monkeypatch):
    cache, ub = _scene()
    monkeypatch.delenv(_attention.ENV_IMPLEMENTATION, raising=False)
    pick = _attention.pick_implementation
    assert pick(None, cache, 0, None) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    assert pick(None, cache, 0, jnp.zeros((1, 1, 64))) == "xla"  # a bias: the XLA path
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert pick(None, cache, 0, None) == "pallas"
    monkeypatch.undo()
    monkeypatch.setenv(_attention.ENV_IMPLEMENTATION, "pallas")
    assert pick(None, cache, 0, None) == "pallas"
    assert pick("xla", cache, 0, None) == "xla"  # the keyword wins over the environment
    mask = kvjax.kq_mask(cache, ub, 64)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((8, 2, 16)), jnp.float32)
    _close(kvjax.attention(q, cache, 0, mask), kvjax.attention(q, cache, 0, mask, implementation="xla"))


def test_bad_implementation_raises(monkeypatch):
    cache, ub = _scene()
    mask = kvjax.kq_mask(cache, ub, 64)
    q = jnp.zeros((8, 2, 16))
    with pytest.raises(ValueError, match="implementation='cuda' is not an attention implementation"):
        kvjax.attention(q, cache, 0, mask, implementation="cuda")
    with pytest.raises(ValueError, match="does not support a bias"):
        kvjax.attention(q, cache, 0, mask, bias=jnp.zeros((2, 1, 64)), implementation="pallas")
    monkeypatch.setenv(_attention.ENV_IMPLEMENTATION, "fast")
    with pytest.raises(ValueError, match="KVJAX_ATTENTION='fast'"):
        kvjax.attention(q, cache, 0, mask)
    monkeypatch.delenv(_attention.ENV_IMPLEMENTATION)
    cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=32, padding=16, k_dtype="q8_0")
    qcache = fill(kvjax.init(cfg), [0], [[0]])
    with pytest.raises(ValueError, match="does not support quantized K/V"):
        kvjax.attention(jnp.zeros((1, 1, 32)), qcache, 0, jnp.zeros((1, 16)), implementation="pallas")
