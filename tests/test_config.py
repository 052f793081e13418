"""CacheConfig and RopeConfig: defaults, derived layout, validation messages."""

import pytest

import kvjax
from kvjax.memory._config import MAX_SEQ


def test_issue_example_defaults():
    cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    assert (cfg.padding, cfg.k_dtype, cfg.v_dtype) == (32, "float32", "float32")
    assert cfg.n_kv_heads == (2, 2) and cfg.head_dim_v == (16, 16)
    assert cfg.cached_layers == (0, 1) and len(cfg.groups) == 1
    assert hash(cfg) == hash(kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16))


def test_layer_groups_and_filter():
    cfg = kvjax.CacheConfig(
        size=64,
        n_seq_max=1,
        n_layer=4,
        n_kv_heads=(2, 4, 2, 4),
        head_dim=8,
        layer_filter=lambda il: il != 3,
        padding=32,
    )
    assert cfg.cached_layers == (0, 1, 2)
    assert [g.layers for g in cfg.groups] == [(0, 2), (1,)]
    assert cfg.locate(2) == (0, 1) and cfg.locate(1) == (1, 0)
    with pytest.raises(ValueError, match=r"layer=3 is not a cached layer"):
        cfg.locate(3)
    assert kvjax.CacheConfig(
        size=32, n_seq_max=1, n_layer=3, n_kv_heads=1, head_dim=4, layer_filter=[2, 0]
    ).cached_layers == (0, 2)


def test_dtypes_normalized():
    import jax.numpy as jnp

    cfg = kvjax.CacheConfig(
        size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4, k_dtype=jnp.float16, v_dtype="bfloat16"
    )
    assert (cfg.k_dtype, cfg.v_dtype) == ("float16", "bfloat16")


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("size", 100, r"size=100 is out of range: allowed a positive multiple of padding=32"),
        ("size", 0, r"size=0"),
        ("padding", 0, r"padding=0 is out of range"),
        ("n_seq_max", 0, rf"n_seq_max=0 is out of range: allowed \[1, {MAX_SEQ}\]"),
        ("n_seq_max", MAX_SEQ + 1, r"n_seq_max"),
        ("n_layer", 0, r"n_layer=0"),
        ("n_kv_heads", (1, 2, 3), r"n_kv_heads='3 values' is out of range: allowed one value per layer"),
        ("head_dim", 0, r"head_dim=0"),
        ("k_dtype", "int8", r"k_dtype='int8' is not a supported storage dtype"),
        ("layer_filter", [5], r"layer_filter=5 is out of range: allowed layer ids in \[0, 2\)"),
        ("layer_filter", [0.5], r"layer_filter=0.5 is out of range: allowed integer layer ids"),
        ("swa_type", "sideways", r"swa_type='sideways' is not a sliding-window kind"),
        ("n_swa", -1, r"n_swa=-1"),
    ],
)
def test_config_rules(field, value, match):
    args = dict(size=64, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=8)
    args[field] = value
    with pytest.raises(ValueError, match=match):
        kvjax.CacheConfig(**args)


def test_swa_needs_window():
    with pytest.raises(ValueError, match=r"n_swa=0 is out of range: allowed > 0 when swa_type='standard'"):
        kvjax.CacheConfig(size=64, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=8, swa_type="standard")


def test_n_seq_max_256_supported():
    cfg = kvjax.CacheConfig(size=32, n_seq_max=256, n_layer=1, n_kv_heads=1, head_dim=4)
    assert cfg.n_words == 8


def test_rope_config_rules():
    with pytest.raises(ValueError, match=r"n_rot=3"):
        kvjax.RopeConfig(n_rot=3)
    with pytest.raises(ValueError, match=r"rope.n_rot=32 is out of range: allowed an even number <= head_dim=16"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=16, rope=kvjax.RopeConfig(n_rot=32))
    cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=2, n_kv_heads=1, head_dim=16, rope=kvjax.RopeConfig(n_rot=16))
    assert cfg.can_shift and len(cfg.rope) == 2
