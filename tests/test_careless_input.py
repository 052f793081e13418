"""Careless input is refused, never coerced, and a refused request changes nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import Engine, generate
from kvjax.nn import Llama, LlamaConfig

CFG = LlamaConfig(vocab_size=16, d_model=16, n_layer=1, n_heads=2, n_kv_heads=1)


@pytest.fixture(scope="module")
def model():
    return Llama(CFG, rngs=nnx.Rngs(0))


GOOD = dict(max_new_tokens=3, key=jax.random.PRNGKey(0), sampling=kvjax.SamplingConfig(temperature=0))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(key=0), r"key must be a jax PRNG key"),
        (dict(key=jnp.zeros(3, jnp.uint32)), r"key must be a jax PRNG key"),
        (dict(sampling={"temperature": 0}), r"sampling must be a kvjax.SamplingConfig"),
        (dict(max_new_tokens=3.9), r"max_new_tokens=3.9 is out of range: allowed an integer in \[1, 1073741824\]"),
        (
            dict(max_new_tokens=10**12),
            r"max_new_tokens=1000000000000 is out of range: allowed an integer in \[1, 1073741824\]",
        ),
        (dict(max_new_tokens=True), r"max_new_tokens=True is out of range"),
        (dict(n_parallel=0), r"n_parallel=0 is out of range: allowed an integer >= 1"),
        (dict(n_parallel=1.5), r"n_parallel=1.5 is out of range: allowed an integer >= 1"),
        (dict(stop_tokens=5), r"stop_tokens=5 is out of range: allowed a sequence of token ids"),
        (dict(stop_tokens="</s>"), r"stop_tokens='</s>' is out of range"),
        (dict(n_keep=-1), r"n_keep=-1 is out of range"),
        (dict(share_prefix="no"), r"share_prefix='no' is out of range: allowed True or False"),
        (dict(stop_tokens=[99]), r"stop_tokens\[0\] contains 99: allowed ids in \[0, 16\)"),
        (dict(prompts=[[1, 2], [3, 99]]), r"prompts\[1\] contains 99: allowed ids in \[0, 16\)"),
        (dict(prompts=[[1.0, 2.0]]), r"prompts\[0\] has shape \(2,\) and dtype float64"),
        (dict(prompts=[[1, 2], []]), r"prompts\[1\] is empty"),
        (dict(prompts="hello"), r"prompts must be a list of token-id lists"),
    ],
)
def test_a_refused_request_leaves_nothing_behind(model, change, match):
    engine = Engine(model, kvjax.init(CFG.cache_config(size=64, n_seq_max=2, padding=16)))
    args = dict(GOOD, prompts=[[1, 2, 3], [1, 2, 4]])
    args.update(change)
    prompts = args.pop("prompts")
    with pytest.raises(ValueError, match=match):
        generate(engine, prompts, **args)
    assert int(kvjax.used_cells(engine.cache)) == 0  # nothing was placed
    out = generate(engine, [[1, 2, 3], [1, 2, 4]], **GOOD)  # and the next call is not refused as busy
    assert [len(t) for t in out.tokens] == [3, 3]


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(temperature=float("inf")), r"temperature=inf is out of range: allowed a finite number"),
        (dict(temperature=1e-30), r"temperature=1e-30 is out of range: allowed 0 \(greedy\) or >= 1e-06"),
        (dict(top_p=float("nan")), r"top_p=nan is out of range: allowed a finite number"),
    ],
)
def test_sampling_parameters_that_make_no_sense(config, match):
    with pytest.raises(ValueError, match=match):
        kvjax.SamplingConfig(**config)


def test_no_truncation_or_bool_as_int():
    cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=4))
    rows = jnp.ones((1, 1, 4))
    with pytest.raises(ValueError, match=r"layer=1.7 is out of range: allowed an integer scalar"):
        kvjax.write(cache, 1.7, jnp.array([0]), rows, rows)
    with pytest.raises(ValueError, match=r"seq_id=True is out of range: allowed an integer scalar"):
        kvjax.seq_rm(cache, True)
    with pytest.raises(ValueError, match=r"length=4.7 is out of range"):
        kvjax.make_ubatch([0, 1], [[0], [0]], length=4.7)
    with pytest.raises(ValueError, match=r"pos has shape \(1, 2\)"):
        kvjax.make_ubatch([[0, 1]], [[0], [0]])
    with pytest.raises(ValueError, match=r"pos has dtype bool"):
        kvjax.make_ubatch([True, False], [[0], [0]])
    with pytest.raises(ValueError, match=r"donate='False' is out of range: allowed True or False"):
        kvjax.defrag(cache, donate="False")
    with pytest.raises(ValueError, match=r"n_ubatch=2.5 is out of range"):
        Engine(Llama(CFG, rngs=nnx.Rngs(0)), kvjax.init(CFG.cache_config(size=64, n_seq_max=1)), n_ubatch=2.5)


def test_absurd_configs_are_refused_at_once():
    with pytest.raises(ValueError, match=r"n_layer=1000000000 is out of range: allowed an integer in \[1, 4096\]"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=10**9, n_kv_heads=1, head_dim=4)
    with pytest.raises(ValueError, match=r"head_dim=.* is out of range"):
        kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=10**9)


def test_load_checks_the_header_before_reading_the_file(tmp_path):
    cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
    with pytest.raises(kvjax.StateError, match=r"magic: expected b'KVJAXSES'"):
        kvjax.load("/dev/zero", cache)  # endless: one small read, then refused
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.write(b"NOTKVJAX" + b"\0" * 64)
        f.truncate(2**40)  # a sparse 1 TiB file: never read whole
    with pytest.raises(kvjax.StateError, match="not a kvjax session file"):
        kvjax.load(big, cache)


def test_eager_bad_slot_raises_and_donated_memory_is_named():
    cache = kvjax.init(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4))
    rows = jnp.ones((1, 1, 4))
    with pytest.raises(ValueError, match=r"slot contains 32: allowed cells in \[-1, 32\)"):
        kvjax.write(cache, 0, jnp.array([32]), rows, rows)
    model = Llama(CFG, rngs=nnx.Rngs(0))
    memory = kvjax.init(CFG.cache_config(size=32, n_seq_max=1, padding=16))
    step = kvjax.nn.make_step(model)
    _, new, _ = step(nnx.state(model), memory, kvjax.make_ubatch([0], [[0]]), np.zeros(1, np.int32), n_kv=16)
    with pytest.raises(ValueError, match=r"memory was donated: .* use the memory that call returned"):
        kvjax.seq_rm(memory, 0)
    with pytest.raises(ValueError, match=r"cache was donated"):
        kvjax.view(memory, 0, 16)
    assert int(kvjax.used_cells(new)) == 1


@pytest.mark.parametrize(
    "args, match",
    [
        (([1], "0", [[0]]), r"pos has shape \(\) and dtype <U1: allowed a 1-d list of integer positions"),
        (([1], ["0"], [[0]]), r"pos has shape \(1,\) and dtype <U1"),
        (([1], [0.5], [[0]]), r"pos has shape \(1,\) and dtype float64"),
        (([1], [0], 0), r"seq_ids=0 is out of range: allowed one list of sequence ids per token"),
    ],
)
def test_decode_names_a_malformed_argument(model, args, match):
    engine = Engine(model, kvjax.init(CFG.cache_config(size=64, n_seq_max=2, padding=16)))
    with pytest.raises(ValueError, match=match):
        engine.decode(*args)
    assert int(kvjax.used_cells(engine.cache)) == 0


def test_sample_names_a_config_that_is_not_one():
    with pytest.raises(ValueError, match="config must be a kvjax.SamplingConfig, got dict"):
        kvjax.sample(jnp.zeros((1, 16)), jax.random.PRNGKey(0), {"temperature": 0})


def _configs(kind, size):
    base = kvjax.CacheConfig(size=size, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=4, padding=16)
    return {
        "unified": base,
        "iswa": kvjax.IswaConfig(base, swa_layers=(0,), n_swa=4, n_batch=8),
        "streams": kvjax.StreamsConfig(base),
        "recurrent": kvjax.RecurrentConfig(size=size // 16, n_seq_max=2, n_layer=2, k_shape=(2,), v_shape=(3,)),
    }[kind]


@pytest.mark.parametrize("kind", ["unified", "iswa", "streams", "recurrent"])
def test_a_memory_whose_config_disagrees_with_its_arrays_is_refused(kind):
    """Arrays of a 64-cell memory under a 32-cell config (``replace(config=...)`` by hand)."""
    forged = kvjax.init(_configs(kind, 64)).replace(config=_configs(kind, 32))
    ops = (lambda m: kvjax.seq_rm(m, 0, 0, -1), kvjax.used_cells, lambda m: jax.jit(kvjax.seq_pos_max)(m, 0))
    for op in ops:
        with pytest.raises(ValueError, match=r"memory\S* has shape .* where its config gives"):
            op(forged)
    assert int(kvjax.used_cells(kvjax.init(_configs(kind, 32)))) == 0  # a real memory passes


_BASE = dict(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=4)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: kvjax.CacheConfig(**_BASE, v_trans="no"), r"v_trans='no' is out of range: allowed True or False"),
        (
            lambda: kvjax.CacheConfig(**dict(_BASE, n_kv_heads=None)),
            r"n_kv_heads=None is out of range: allowed an integer",
        ),
        (lambda: kvjax.CacheConfig(**dict(_BASE, head_dim="4")), r"head_dim='4' is out of range"),
        (lambda: kvjax.CacheConfig(**_BASE, swa_type="standard", n_swa=2**40), r"n_swa=1099511627776 is out of range"),
        (lambda: kvjax.RopeConfig(n_rot=4, freq_factors="ab"), r"freq_factors='ab' is out of range: allowed None or a"),
        (lambda: kvjax.RopeConfig(n_rot=4, freq_factors=["a", 1]), r"freq_factors=\['a', 1\] is out of range"),
        (lambda: LlamaConfig(norm_eps="x"), r"norm_eps='x' is out of range: allowed a finite number"),
        (lambda: LlamaConfig(alibi_max_bias=None), r"alibi_max_bias=None is out of range"),
    ],
)
def test_configs_name_a_value_of_the_wrong_kind(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_flags_of_the_attention_path_refuse_strings():
    cache = kvjax.init(kvjax.CacheConfig(**_BASE))
    ub = kvjax.make_ubatch([0], [[0]])
    cache, _, _ = kvjax.find_slot(cache, ub)
    for call, match in (
        (lambda: kvjax.kq_mask(cache, ub, 32, causal="no"), "causal='no' is out of range: allowed True or False"),
        (lambda: kvjax.kq_mask(cache, ub, 32, alibi=1), "alibi=1 is out of range: allowed True or False"),
        (
            lambda: kvjax.kq_mask_bool(cache, ub, 32, causal="False"),
            "causal='False' is out of range: allowed True or False",
        ),
        (lambda: kvjax.pos_bucket(cache, ub, 32, 32, bidirectional="yes"), "bidirectional='yes'"),
    ):
        with pytest.raises(ValueError, match=match):
            call()


def test_a_strided_buffer_is_read_as_its_bytes():
    """A non-contiguous numpy view of a blob (``a[::2]``) is a valid bytes-like object: read, not a BufferError."""
    cache = kvjax.init(kvjax.CacheConfig(**_BASE))
    cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch([0, 1], [[0], [0, 1]]))
    blob = kvjax.state_write(cache)
    strided = np.repeat(np.frombuffer(blob, np.uint8), 2)[::2]
    assert not strided.flags.c_contiguous
    assert kvjax.state_write(kvjax.state_read(kvjax.init(cache.config), strided)) == blob


def test_every_models_uncached_pass_names_an_id_outside_the_vocabulary():
    """Before, Llama.forward (and the hybrid's) gave NaN logits for an id >= vocab_size, silently."""
    from kvjax.nn import HybridLM, HybridLMConfig, Mamba, MambaConfig

    models = [
        Llama(CFG, rngs=nnx.Rngs(0)),
        Mamba(MambaConfig(vocab_size=16, d_model=16, n_layer=1, d_state=4), rngs=nnx.Rngs(0)),
        HybridLM(
            HybridLMConfig(
                vocab_size=16, d_model=16, n_layer=2, recurrent_layers=(1,), n_heads=2, n_kv_heads=1, d_state=4
            ),
            rngs=nnx.Rngs(0),
        ),
    ]
    for model in models:
        for bad in ([1, 16], [[-1, 2]]):
            with pytest.raises(ValueError, match=r"tokens contains (16|-1): allowed ids in \[0, 16\)"):
                model.forward(jnp.asarray(bad))
        with pytest.raises(ValueError, match="tokens has shape"):
            model.forward(jnp.asarray([[0.5, 1.0]]))
        assert np.isfinite(np.asarray(model.forward(jnp.asarray([1, 15])))).all()


def test_a_hand_built_ubatch_of_the_wrong_containers_or_dtypes_is_named():
    cache = kvjax.init(kvjax.CacheConfig(**_BASE))
    ub = kvjax.make_ubatch([0, 1], [[0], [0]])
    for bad, match in (
        (kvjax.Ubatch(pos=[0, 1], seq_ids=[[0], [0]], valid=[True, True]), "ubatch.pos is a list"),
        (ub.replace(valid=jnp.asarray([1, 1])), "ubatch.valid has dtype int32: allowed bool"),
        (ub.replace(seq_ids=np.asarray([[0.0], [0.0]])), "ubatch.seq_ids has dtype float(32|64)"),
    ):
        for find_slot in (kvjax.find_slot, jax.jit(kvjax.find_slot)):
            with pytest.raises(ValueError, match=match):
                find_slot(cache, bad)
