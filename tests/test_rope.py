"""RoPE against a direct numpy transcription of ggml's rope_ext math (float64), and its algebra."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.helpers import no_recompile


def ref_rope(
    x,
    pos,
    n_rot,
    mode="normal",
    freq_base=10000.0,
    freq_scale=1.0,
    ext_factor=0.0,
    attn_factor=1.0,
    beta_fast=32.0,
    beta_slow=1.0,
    n_ctx_orig=0,
    freq_factors=None,
):
    """ggml's rope_f32 written out: per pair, theta = pos * theta_scale^i (/ factor), YaRN blend.

    x: float64 [T, H, D]; pos: int [T].
    """
    x = np.asarray(x, np.float64)
    out = x.copy()
    theta_scale = freq_base ** (-2.0 / n_rot)
    if ext_factor != 0:

        def corr_dim(beta):
            return n_rot * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(freq_base))

        lo = max(0.0, math.floor(corr_dim(beta_fast)))
        hi = min(n_rot - 1.0, math.ceil(corr_dim(beta_slow)))
    for t, p in enumerate(pos):
        theta = float(p)
        for i in range(n_rot // 2):
            ff = freq_factors[i] if freq_factors is not None else 1.0
            extrap = theta / ff
            interp = freq_scale * extrap
            angle, mscale = interp, attn_factor
            if ext_factor != 0:
                y = (i - lo) / max(0.001, hi - lo)
                mix = (1 - min(1.0, max(0.0, y))) * ext_factor
                angle = interp * (1 - mix) + extrap * mix
                mscale *= 1 + 0.1 * math.log(1 / freq_scale)
            c, s = math.cos(angle) * mscale, math.sin(angle) * mscale
            a_idx, b_idx = (2 * i, 2 * i + 1) if mode == "normal" else (i, i + n_rot // 2)
            a, b = x[t, :, a_idx], x[t, :, b_idx]
            out[t, :, a_idx] = a * c - b * s
            out[t, :, b_idx] = a * s + b * c
            theta *= theta_scale
    return out


CASES = [
    dict(n_rot=16, mode="normal"),
    dict(n_rot=16, mode="neox"),
    dict(n_rot=10, mode="normal", freq_base=500000.0),  # partial rotation (D = 16)
    dict(n_rot=8, mode="neox", freq_scale=0.25),  # partial, linear scaling
    dict(
        n_rot=16,
        mode="neox",
        freq_scale=0.125,
        ext_factor=1.0,
        attn_factor=1.0,
        n_ctx_orig=512,
        beta_fast=32.0,
        beta_slow=1.0,
    ),  # YaRN
    dict(
        n_rot=12,
        mode="normal",
        freq_scale=0.5,
        ext_factor=0.5,
        attn_factor=0.9,
        n_ctx_orig=256,
        beta_fast=16.0,
        beta_slow=2.0,
    ),  # YaRN, partial, mixed ramp
    dict(n_rot=16, mode="normal", freq_factors=tuple(1.0 + 0.5 * i for i in range(8))),
]


def _x(shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60])
def test_rope_matches_ggml_formula(case):
    x = _x((6, 3, 16))
    pos = np.array([0, 1, 7, 100, 1000, 4097], np.int32)
    cfg = kvjax.RopeConfig(**case)
    got = np.asarray(kvjax.rope(jnp.asarray(x), jnp.asarray(pos), cfg))
    expected = ref_rope(x, pos, **case)
    # float32 angles: error ~ pos * 6e-8 rad, so ~3e-4 at pos 4097 (ggml's float32 has the same)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-3)
    np.testing.assert_allclose(got[:4], expected[:4], rtol=0, atol=2e-5)
    # the dims past n_rot pass through bit for bit
    np.testing.assert_array_equal(got[..., case["n_rot"] :], x[..., case["n_rot"] :])


def _unit_magnitude(case):
    """The case with attn_factor chosen so the YaRN magnitude is exactly 1 (a pure rotation)."""
    case = dict(case)
    if case.get("ext_factor", 0.0) != 0:
        case["attn_factor"] = 1.0 / (1.0 + 0.1 * math.log(1.0 / case["freq_scale"]))
    else:
        case["attn_factor"] = 1.0
    return case


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60])
def test_rotation_by_a_then_b_is_a_plus_b(case):
    cfg = kvjax.RopeConfig(**_unit_magnitude(case))
    x = jnp.asarray(_x((5, 2, 16), seed=1))
    a = jnp.array([0, 3, -20, 511, 64], jnp.int32)
    b = jnp.array([5, -3, 40, 1, -64], jnp.int32)
    twice = kvjax.rope(kvjax.rope(x, a, cfg), b, cfg)
    np.testing.assert_allclose(np.asarray(twice), np.asarray(kvjax.rope(x, a + b, cfg)), rtol=0, atol=2e-5)
    # and rotating back by -a restores x
    back = kvjax.rope(kvjax.rope(x, a, cfg), -a, cfg)
    np.testing.assert_allclose(np.asarray(back), np.asarray(x), rtol=0, atol=2e-5)


def test_leading_axes_and_broadcast_positions():
    cfg = kvjax.RopeConfig(n_rot=8, mode="neox")
    x = jnp.asarray(_x((2, 4, 3, 8), seed=2))  # [B, T, H, D]
    per_row = jnp.array([[0, 1, 2, 3], [10, 11, 12, 13]], jnp.int32)
    got = kvjax.rope(x, per_row, cfg)
    for bi in range(2):
        np.testing.assert_allclose(
            np.asarray(got[bi]), np.asarray(kvjax.rope(x[bi], per_row[bi], cfg)), rtol=0, atol=1e-6
        )
    shared = kvjax.rope(x, per_row[0], cfg)  # pos [T] broadcast over B
    np.testing.assert_allclose(np.asarray(shared[1]), np.asarray(kvjax.rope(x[1], per_row[0], cfg)), atol=1e-6)


def test_dtype_kept_and_float16_close():
    cfg = kvjax.RopeConfig(n_rot=16)
    x = _x((4, 2, 16), seed=3)
    pos = np.array([0, 5, 50, 500], np.int32)
    got = kvjax.rope(jnp.asarray(x, jnp.float16), jnp.asarray(pos), cfg)
    assert got.dtype == jnp.float16
    np.testing.assert_allclose(
        np.asarray(got, np.float64), ref_rope(x.astype(np.float16), pos, 16), rtol=2e-3, atol=2e-3
    )


def test_rope_jitted_and_no_recompile():
    cfg = kvjax.RopeConfig(n_rot=16, mode="neox", freq_scale=0.5)
    x = jnp.asarray(_x((4, 2, 16), seed=4))
    jitted = jax.jit(kvjax.rope, static_argnums=2)
    pos = jnp.array([1, 2, 3, 4], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jitted(x, pos, cfg)), np.asarray(kvjax.rope(x, pos, cfg)))
    for shift in (7, 900, -3):
        new_pos, new_x = pos + shift, x + 1.0  # (the eager adds compile once, outside the check)
        with no_recompile():
            kvjax.rope(x, new_pos, cfg).block_until_ready()
            jitted(new_x, new_pos, cfg).block_until_ready()


def test_bad_input():
    with pytest.raises(ValueError, match="n_rot=7 is out of range"):
        kvjax.RopeConfig(n_rot=7)
    with pytest.raises(ValueError, match="n_rot=0 is out of range"):
        kvjax.RopeConfig(n_rot=0)
    with pytest.raises(ValueError, match="mode='glm'"):
        kvjax.RopeConfig(n_rot=8, mode="glm")
    with pytest.raises(ValueError, match="n_ctx_orig=0 is out of range"):
        kvjax.RopeConfig(n_rot=8, ext_factor=1.0)
    with pytest.raises(ValueError, match="freq_factors"):
        kvjax.RopeConfig(n_rot=8, freq_factors=(1.0, 2.0))
    with pytest.raises(ValueError, match="freq_factors"):
        kvjax.RopeConfig(n_rot=4, freq_factors=(1.0, 0.0))
    with pytest.raises(ValueError, match="freq_base"):
        kvjax.RopeConfig(n_rot=4, freq_base=-1.0)
    with pytest.raises(ValueError, match=r"rope.n_rot=32 is out of range"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=16, rope=kvjax.RopeConfig(n_rot=32))
    x = jnp.zeros((2, 1, 8))
    with pytest.raises(ValueError, match="n_rot=16 is out of range: allowed an even number <= the head size D=8"):
        kvjax.rope(x, jnp.array([0, 1]), kvjax.RopeConfig(n_rot=16))
    cfg = kvjax.RopeConfig(n_rot=8)
    with pytest.raises(ValueError, match="pos must be an integer array"):
        kvjax.rope(x, jnp.array([0.0, 1.0]), cfg)
    with pytest.raises(ValueError, match=r"pos has shape \(3,\)"):
        kvjax.rope(x, jnp.array([0, 1, 2]), cfg)
    with pytest.raises(ValueError, match="x has shape"):
        kvjax.rope(jnp.zeros((2, 8)), jnp.array([0, 1]), cfg)
    with pytest.raises(ValueError, match="x has dtype int32"):
        kvjax.rope(jnp.zeros((2, 1, 8), jnp.int32), jnp.array([0, 1]), cfg)
    with pytest.raises(ValueError, match="rope_config must be a kvjax.RopeConfig"):
        kvjax.rope(x, jnp.array([0, 1]), {"n_rot": 8})
