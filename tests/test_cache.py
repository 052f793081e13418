"""init / abstract / sizes, write and view (jitted and not), in-place updates under donation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from tests.helpers import CompileCounter, fill, small_config


def test_init_and_abstract_agree():
    cfg = small_config(n_kv_heads=(2, 4), head_dim=(8, 4))
    cache = kvjax.init(cfg)
    ab = kvjax.abstract(cfg)
    assert jax.tree.structure(cache) == jax.tree.structure(ab)
    for real, shape in zip(jax.tree.leaves(cache), jax.tree.leaves(ab)):
        assert real.shape == shape.shape and real.dtype == shape.dtype
    assert [k.shape for k in cache.k] == [(1, 2, 64, 8), (1, 4, 64, 4)]
    assert int(kvjax.used_cells(cache)) == 0 and int(kvjax.n_kv(cache)) == 16


def test_sizes_match_the_seed_formula():
    cfg = kvjax.CacheConfig(
        size=128,
        n_seq_max=2,
        n_layer=3,
        n_kv_heads=(2, 4, 2),
        head_dim=8,
        head_dim_v=(8, 8, 4),
        k_dtype="float16",
        layer_filter=[0, 1],
    )
    # seed: sum over cached layers of ggml_nbytes(k) = n_embd_k_gqa * kv_size * type size
    assert kvjax.size_k_bytes(cfg) == (2 * 8 + 4 * 8) * 128 * 2
    assert kvjax.size_v_bytes(cfg) == (2 * 8 + 4 * 8) * 128 * 4
    assert kvjax.total_size(cfg) == kvjax.size_k_bytes(cfg) + kvjax.size_v_bytes(cfg)
    cache = kvjax.init(cfg)
    assert kvjax.size_k_bytes(cache) == sum(k.nbytes for k in cache.k)
    assert kvjax.size_v_bytes(cache) == sum(v.nbytes for v in cache.v)


def _rows(rng, t, h, d):
    return jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32)


@pytest.mark.parametrize("jit", [False, True])
def test_write_then_view(jit):
    cfg = small_config()
    cache = kvjax.init(cfg)
    rng = np.random.default_rng(0)
    k, v = _rows(rng, 4, 2, 8), _rows(rng, 4, 2, 8)
    slot = jnp.array([5, 9, -1, 63], jnp.int32)
    write = jax.jit(kvjax.write, static_argnums=1) if jit else kvjax.write
    out = write(cache, 1, slot, k, v)
    kv, vv = kvjax.view(out, 1, 64)
    np.testing.assert_array_equal(kv[:, [5, 9, 63]], np.transpose(np.asarray(k)[[0, 1, 3]], (1, 0, 2)))
    np.testing.assert_array_equal(vv[:, [5, 9, 63]], np.transpose(np.asarray(v)[[0, 1, 3]], (1, 0, 2)))
    # nothing else changed: the padding row and the other layer are untouched
    touched = np.zeros(64, bool)
    touched[[5, 9, 63]] = True
    assert not np.asarray(kv)[:, ~touched].any()
    assert not np.asarray(kvjax.view(out, 0, 64)[0]).any()
    assert kvjax.errors(out) == []


def test_write_with_traced_layer_in_scan():
    cfg = small_config()
    cache = kvjax.init(cfg)
    slot = jnp.array([0, 1], jnp.int32)

    def body(c, layer):
        rows = jnp.full((2, 2, 8), layer.astype(jnp.float32) + 1)
        return kvjax.write(c, layer, slot, rows, rows), None

    out, _ = jax.lax.scan(body, cache, jnp.arange(2, dtype=jnp.int32))
    assert float(kvjax.view(out, 0, 16)[0][0, 0, 0]) == 1.0
    assert float(kvjax.view(out, 1, 16)[1][1, 1, 3]) == 2.0


def test_write_out_of_range_slot_is_dropped_and_flagged():
    cfg = small_config()
    cache = kvjax.init(cfg)
    ones = jnp.ones((2, 2, 8))
    out = jax.jit(kvjax.write, static_argnums=1)(cache, 0, jnp.array([64, -5], jnp.int32), ones, ones)
    assert not np.asarray(out.k[0]).any() and not np.asarray(out.v[0]).any()
    assert kvjax.errors(out) == ["slot index outside [-1, size) (a write dropped those rows; a model step was skipped)"]
    with pytest.raises(ValueError, match="error flags"):
        kvjax.check(out)
    assert kvjax.errors(kvjax.clear_errors(out)) == []


def test_write_traced_uncached_layer_is_dropped():
    cfg = small_config(layer_filter=[1])
    cache = kvjax.init(cfg)
    ones = jnp.ones((1, 2, 8))
    out = jax.jit(lambda c, l: kvjax.write(c, l, jnp.array([0]), ones, ones))(cache, jnp.int32(0))
    assert not np.asarray(out.k[0]).any()
    assert "layer id not cached" in kvjax.errors(out)[0]


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(k=jnp.ones((2, 3, 8))), r"k has shape \(2, 3, 8\): allowed \(2, 2, 8\)"),
        (dict(v=jnp.ones((2, 2, 4))), r"v has shape \(2, 2, 4\): allowed \(2, 2, 8\)"),
        (dict(k=jnp.ones((2, 2, 8), jnp.int32)), r"k has dtype int32: allowed a floating dtype"),
        (dict(slot=jnp.array([0.0, 1.0])), r"slot has shape \(2,\) and dtype float32"),
        (dict(layer=2), r"layer=2 is not a cached layer: allowed \[0, 1\]"),
    ],
)
def test_write_bad_input(bad, match):
    cache = kvjax.init(small_config())
    args = dict(layer=0, slot=jnp.array([0, 1]), k=jnp.ones((2, 2, 8)), v=jnp.ones((2, 2, 8)))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kvjax.write(cache, args["layer"], args["slot"], args["k"], args["v"])


def test_write_and_view_need_a_cache():
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.view(None, 0, 16)
    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.write({}, 0, jnp.array([0]), jnp.ones((1, 2, 8)), jnp.ones((1, 2, 8)))


@pytest.mark.parametrize("n_kv, match", [(8, "multiple of padding=16"), (80, "at most size=64"), (0, "n_kv=0")])
def test_view_bad_window(n_kv, match):
    with pytest.raises(ValueError, match=match):
        kvjax.view(kvjax.init(small_config()), 0, n_kv)


def test_write_casts_to_storage_dtype():
    cache = kvjax.init(small_config(k_dtype="float16"))
    out = kvjax.write(cache, 0, jnp.array([0]), jnp.full((1, 2, 8), 1.5), jnp.full((1, 2, 8), 2.5))
    assert out.k[0].dtype == jnp.float16 and float(out.k[0][0, 0, 0, 0]) == 1.5


def test_write_compiles_once_for_every_slot_and_value():
    cache = kvjax.init(small_config())
    step = jax.jit(kvjax.write, static_argnums=1)
    inputs = [(jnp.asarray(np.arange(s, s + 4), jnp.int32), jnp.full((4, 2, 8), float(s))) for s in (0, 4, 17, 60)]
    cache = step(cache, 0, *inputs[0], inputs[0][1])
    cache = kvjax.write(cache, 0, *inputs[0], inputs[0][1])
    with CompileCounter() as counter:
        for slot, rows in inputs[1:]:
            cache = step(cache, 0, slot, rows, rows)
            cache = kvjax.write(cache, 0, slot, rows, rows)
    assert counter.count == 0
    assert float(cache.k[0][0, 1, 62, 0]) == 60.0


def test_donated_step_updates_buffers_in_place():
    """With the cache donated, XLA reuses the input K/V buffers: the pointers do not change."""
    cfg = kvjax.CacheConfig(size=4096, n_seq_max=1, n_layer=4, n_kv_heads=4, head_dim=64)
    cache = kvjax.init(cfg)
    ub = kvjax.make_ubatch([0], [[0]])

    def step(cache, ub, k, v):
        cache, slot, ok = kvjax.find_slot(cache, ub)
        for layer in range(cfg.n_layer):
            cache = kvjax.write(cache, layer, slot, k, v)
        return cache

    rows = jnp.ones((1, 4, 64))
    kept = jax.jit(step)(cache, ub, rows, rows)  # without donation: a new buffer every call
    assert kept.k[0].unsafe_buffer_pointer() != cache.k[0].unsafe_buffer_pointer()
    jstep = jax.jit(step, donate_argnums=0)
    cache = jstep(cache, ub, rows, rows)  # warm-up (the first output is a fresh buffer)
    k_ptr, v_ptr = cache.k[0].unsafe_buffer_pointer(), cache.v[0].unsafe_buffer_pointer()
    for p in range(1, 4):
        cache = jstep(cache, kvjax.make_ubatch([p], [[0]]), rows * p, rows)
        assert cache.k[0].unsafe_buffer_pointer() == k_ptr
        assert cache.v[0].unsafe_buffer_pointer() == v_ptr
    assert int(kvjax.used_cells(cache)) == 4
    assert float(cache.k[0][0, 0, 3, 0]) == 3.0


def test_sequence_ops_share_kv_buffers():
    cache = fill(kvjax.init(small_config()), range(4), [[0]] * 4)
    out, _ = kvjax.seq_rm(kvjax.seq_cp(cache, 0, 1), 0, 2, -1)
    assert out.k[0] is cache.k[0] and out.v[0] is cache.v[0]
