"""Sampling rules: greedy, temperature, top-k, top-p; determinism by key; bad configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kvjax.engine._sampling import SamplingConfig, filter_logits, sample

LOGITS = jnp.log(jnp.array([[0.05, 0.5, 0.3, 0.15], [0.7, 0.1, 0.1, 0.1]]))


def test_greedy_is_argmax():
    assert sample(LOGITS, jax.random.PRNGKey(0), SamplingConfig(temperature=0)).tolist() == [1, 0]


def test_top_k_and_top_p_filter():
    kept = np.isfinite(np.asarray(filter_logits(LOGITS, SamplingConfig(top_k=2))))
    assert kept[0].tolist() == [False, True, True, False]
    assert kept[1].sum() == 2 and kept[1][0]  # row 1 ties at 0.1: any one of them may stay
    kept = np.isfinite(np.asarray(filter_logits(LOGITS, SamplingConfig(top_p=0.75))))
    # row 0: 0.5 then 0.3 reaches 0.8 >= 0.75 -> two tokens; row 1: 0.7 < 0.75 -> one more
    assert kept[0].tolist() == [False, True, True, False]
    assert kept[1].sum() == 2 and kept[1][0]


def test_sampling_frequencies_follow_filtered_distribution():
    cfg = SamplingConfig(top_k=2)
    keys = jax.random.split(jax.random.PRNGKey(1), 4000)
    draws = np.asarray(jax.vmap(lambda k: sample(LOGITS[:1], k, cfg)[0])(keys))
    freq = np.bincount(draws, minlength=4) / len(draws)
    np.testing.assert_allclose(freq, [0, 0.5 / 0.8, 0.3 / 0.8, 0], atol=0.03)


def test_same_key_same_tokens_and_temperature_sharpens():
    key = jax.random.PRNGKey(3)
    assert sample(LOGITS, key).tolist() == sample(LOGITS, key).tolist()
    cold = filter_logits(LOGITS, SamplingConfig(temperature=0.1))
    assert float(jax.nn.softmax(cold)[0, 1]) > 0.95


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), r"temperature=-1 is out of range: allowed 0 \(greedy\) or >= 1e-06"),
        (dict(top_k=-2), r"top_k=-2 is out of range"),
        (dict(top_p=0), r"top_p=0 is out of range: allowed \(0, 1\]"),
    ],
)
def test_bad_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(top_k=True), dict(temperature="a"), dict(top_p=None)])
def test_bad_config_types(kwargs):
    with pytest.raises(ValueError):
        SamplingConfig(**kwargs)


def test_numpy_and_jax_scalars_are_numbers():
    """A value read from an array is a valid setting; the config equals (and hashes as) the Python one."""
    cfg = SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(5), top_p=jnp.float32(0.5))
    assert cfg == SamplingConfig(temperature=0.5, top_k=5, top_p=0.5)
    assert hash(cfg) == hash(SamplingConfig(temperature=0.5, top_k=5, top_p=0.5))
    assert type(cfg.top_k) is int and type(cfg.temperature) is float
    for bad, match in (
        (dict(top_k=2.5), "top_k=2.5 is out of range"),
        (dict(top_k="5"), "top_k='5'"),
        (dict(top_k=np.bool_(True)), "top_k=.*True"),
        (dict(temperature="hot"), "temperature='hot'"),
        (dict(temperature=np.float32("nan")), "temperature=.*nan"),
        (dict(top_p=True), "top_p=True"),
    ):
        with pytest.raises(ValueError, match=match):
            SamplingConfig(**bad)
