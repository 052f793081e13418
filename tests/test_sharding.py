"""Every memory on a device mesh: the same results as on one device, and nothing resharded.

The suite runs with 8 virtual CPU devices (``tests/conftest.py`` sets
``--xla_force_host_platform_device_count=8`` before JAX starts), so these tests place memories on
8x1, 1x8, 2x4 and 4x2 ``data x model`` meshes in the test process itself. For every memory kind
and every mesh:

- a random program of sequence operations and placements, then ``update`` (K-shift, pending
  stream copies), ``defrag`` and a state round trip, gives the same leaves as the same program on
  one device, and every output leaf keeps the sharding its input had (``.sharding``, checked after
  every operation);
- writing K/V and attention over the written window equal the unsharded results;
- the reference model's jitted step on sharded weights and a sharded memory gives the unsharded
  logits, keeps the memory's shardings, and its compiled program moves no K/V between devices (no
  all-gather in the HLO; the only collectives are the all-reduces of tensor parallelism).

The sizes are chosen so every default rule divides: 8 kv heads (up to 8 devices on ``"model"``),
8 sequences and so 8 streams (up to 8 devices on ``"data"``). The default suite runs the 2x4
mesh (both axes split); ``-m slow`` runs all four.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kvjax
from kvjax import shard
from kvjax.nn import LlamaConfig, make_step
from tests.test_memory_contract import _streams_program, apply_op, leaves_equal, random_program
from tests.helpers import USER_HLO, no_recompile
from tests.test_gpt_oss import GPT_OSS
from tests.test_nn_nnx import make_model

MESH_SHAPES = {"8x1": (8, 1), "1x8": (1, 8), "2x4": (2, 4), "4x2": (4, 2)}


def meshes(*default: str):
    """The four meshes as parameters; all but ``default`` run with ``-m slow`` (compiles cost seconds)."""
    return [
        pytest.param(shape, id=name, marks=() if name in default else pytest.mark.slow)
        for name, shape in MESH_SHAPES.items()
    ]


#: 2x4 splits both axes (kv heads over 4 devices, streams over 2): the default suite's mesh
MESHES = meshes("2x4")


def _unified(**changes) -> kvjax.CacheConfig:
    """8 kv heads and 8 sequences: every default rule divides on every mesh of the table."""
    fields = dict(size=32, n_seq_max=8, n_layer=2, n_kv_heads=8, head_dim=8, padding=8, rope=kvjax.RopeConfig(n_rot=8))
    return kvjax.CacheConfig(**{**fields, **changes})


UNIFIED = _unified()
QUANTIZED = _unified(n_layer=1, head_dim=32, k_dtype="q8_0", v_dtype="q4_0", rope=kvjax.RopeConfig(n_rot=32))
ISWA = kvjax.IswaConfig(_unified(n_layer=3), swa_layers=(0, 2), n_swa=3, n_batch=8)
RECURRENT = kvjax.RecurrentConfig(size=8, n_seq_max=8, n_layer=2, k_shape=(3, 2), v_shape=(2, 4), n_states=2)
HYBRID = kvjax.HybridConfig(
    _unified(n_layer=3, layer_filter=(0, 2)),
    kvjax.RecurrentConfig(size=8, n_seq_max=8, n_layer=1, k_shape=(3, 2), v_shape=(2, 4), n_states=2),
    recurrent_layers=(1,),
)
STREAMS = kvjax.StreamsConfig(_unified(size=16))
# a latent (MLA) cache: one kv head (MQA), so K is whole on the "model" axis and split by nothing else
MLA = _unified(n_kv_heads=1, head_dim=40, head_dim_v=32, mla=True)
MLA_STREAMS = kvjax.StreamsConfig(_unified(size=16, n_kv_heads=1, head_dim=40, head_dim_v=32, mla=True))

CONFIGS = [
    pytest.param(c, id=name)
    for name, c in (
        ("unified", UNIFIED),
        ("quantized", QUANTIZED),
        ("iswa", ISWA),
        ("recurrent", RECURRENT),
        ("hybrid", HYBRID),
        ("streams", STREAMS),
        ("mla", MLA),
        ("mla-streams", MLA_STREAMS),
    )
]


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.fail(
            f"these tests need 8 devices, found {jax.device_count()}: tests/conftest.py sets "
            f"XLA_FLAGS=--xla_force_host_platform_device_count=8 before JAX starts; a process that "
            f"started JAX earlier (or set a smaller count) cannot run them"
        )


def _random_kv(memory, seed):
    """Every K/V buffer of every part filled with random bytes of its dtype (so copies compare data)."""
    rng = np.random.default_rng(seed)

    def fill(x):
        if x.dtype == jnp.uint8:  # block-quantized storage: any bytes are a valid comparison
            return jnp.asarray(rng.integers(0, 256, size=x.shape), x.dtype)
        return jnp.asarray(rng.normal(size=x.shape), x.dtype)

    buffers, rest = memory.split()
    return rest.join(jax.tree.map(fill, buffers))


def _stream_safe(config, ops):
    """A program a stream memory accepts (the contract's rules); others take any program."""
    return _streams_program(ops, config) if isinstance(config, kvjax.StreamsConfig) else ops


def _assert_kept(after, layout, what):
    """``after`` has ``layout``'s structure and every leaf the same sharding (equivalent specs)."""
    assert shard.same_shardings(after, layout), f"{what} changed the shardings"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_operations_equal_unsharded_and_keep_shardings(config, mesh_shape):
    """Sequence operations, placement, update, defrag and the state format, on a mesh and on one device."""
    mesh = shard.make_mesh(*mesh_shape)
    sharded = kvjax.init(config, mesh=mesh)
    layout = sharded
    plain = _random_kv(kvjax.init(config), 0)
    sharded = shard.reshard_like(plain, layout)
    _assert_kept(sharded, layout, "reshard_like")
    for op in _stream_safe(config, random_program(11, config.n_seq_max, n_ops=14)):
        plain, ok_plain = apply_op(plain, op, jitted=False)
        sharded, ok_sharded = apply_op(sharded, op, jitted=False)
        assert ok_plain == ok_sharded, op
        assert leaves_equal(plain, sharded), f"the sharded memory differs after {op}"
        _assert_kept(sharded, layout, op[0])
    for name, fn in (
        ("update", kvjax.update),
        ("defrag", kvjax.defrag) if isinstance(plain, kvjax.KVCache) else ("update again", kvjax.update),
    ):
        plain, sharded = fn(plain), fn(sharded)
        assert leaves_equal(plain, sharded), name
        _assert_kept(sharded, layout, name)
    blob = kvjax.state_write(sharded)
    assert blob == kvjax.state_write(plain)
    restored = kvjax.state_read(kvjax.init(config, mesh=mesh), blob)
    assert leaves_equal(restored, kvjax.state_read(kvjax.init(config), blob))
    _assert_kept(restored, layout, "state_read")
    one = kvjax.state_read(kvjax.init(config, mesh=mesh), kvjax.state_write(sharded, 3), 3)
    assert kvjax.state_write(one, 3) == kvjax.state_write(plain, 3)
    _assert_kept(one, layout, "state_read of one sequence")


def _with_sequences(memory, seed):
    """Sequences 1 (5 tokens), 2 (3) and 4 (2) placed, then random K/V: a one-sequence read has rows to move."""
    for s, n in ((1, 5), (2, 3), (4, 2)):
        memory, ok = apply_op(memory, ("place", [(p, [s]) for p in range(n)]), jitted=False)
        assert ok
    return _random_kv(memory, seed)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_one_sequence_restores_on_a_mesh(config, mesh_shape):
    """A server resuming a parked conversation: ``state_read`` of one sequence into a sharded memory
    (a fresh one, and a busy one holding other sequences) equals the unsharded read, keeps the
    layout ``init(config, mesh=)`` chose, and a jitted op compiled before runs on it without a new
    compile. The rows were put on one device, which a program over the mesh refused ("incompatible
    devices")."""
    mesh = shard.make_mesh(*mesh_shape)
    layout = kvjax.init(config, mesh=mesh)
    plain = _with_sequences(kvjax.init(config), 1)
    sharded = shard.reshard_like(plain, layout)
    blob = kvjax.state_write(sharded, 1)
    assert blob == kvjax.state_write(plain, 1) and len(blob) > 100
    probe = jax.jit(kvjax.seq_pos_max)
    probe(layout, 1)
    for into_plain, into_sharded, seq_id in (
        (kvjax.init(config), kvjax.init(config, mesh=mesh), 1),
        (plain, sharded, 2),
        (plain, sharded, 1),
    ):
        want = kvjax.state_read(into_plain, blob, seq_id)
        got = kvjax.state_read(into_sharded, blob, seq_id)
        assert leaves_equal(got, want), seq_id
        _assert_kept(got, layout, f"state_read of sequence {seq_id}")
        with no_recompile():
            assert int(probe(got, seq_id)) == 4
    assert leaves_equal(sharded, shard.reshard_like(plain, layout)), "the memory read into was changed"


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_a_llama_cpp_sequence_file_restores_on_a_mesh(mesh_shape):
    """The same through llama.cpp's sequence file (``'ggsq'``): what ``Engine.load_sequence`` reads."""
    mesh = shard.make_mesh(*mesh_shape)
    for config in (UNIFIED, STREAMS, ISWA):
        plain = _with_sequences(kvjax.init(config), 2)
        sharded = shard.reshard_like(plain, kvjax.init(config, mesh=mesh))
        data = kvjax.seq_file_write(sharded, 1, [7, 8, 9, 10, 11])
        got, tokens = kvjax.seq_file_read(kvjax.init(config, mesh=mesh), data, 3)
        want, _ = kvjax.seq_file_read(kvjax.init(config), data, 3)
        assert list(tokens) == [7, 8, 9, 10, 11]
        assert leaves_equal(got, want)
        _assert_kept(got, kvjax.init(config, mesh=mesh), "seq_file_read")


@pytest.mark.parametrize(
    "config",
    [pytest.param(UNIFIED, id="unified"), pytest.param(QUANTIZED, id="quantized"), pytest.param(MLA, id="mla")],
)
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_write_and_attention_equal_unsharded(config, mesh_shape):
    mesh = shard.make_mesh(*mesh_shape)
    layout = kvjax.init(config, mesh=mesh)
    rng = np.random.default_rng(1)
    ub = kvjax.make_ubatch([0, 1, 2, 0, 1, 2, 3, 4], [[0], [0], [0], [5], [5], [5], [0], [0]])
    h, d = config.n_kv_heads[0], config.head_dim[0]
    k, v = (jnp.asarray(rng.normal(size=(8, h, d)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.normal(size=(8, 16, d)), jnp.float32)  # 16 query heads: split over "model"
    results = []
    for memory in (kvjax.init(config), layout):
        memory, slot, ok = kvjax.find_slot(memory, ub)
        assert bool(ok)
        memory = kvjax.write(memory, 0, slot, k, None if config.mla else v)
        mask = kvjax.kq_mask(memory, ub, 16)
        results.append((memory, kvjax.attention(q, memory, 0, mask)))
    (plain, want), (sharded, got) = results
    assert leaves_equal(plain, sharded)
    _assert_kept(sharded, layout, "write")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# -- the reference model's step --------------------------------------------------------------------

MODEL = LlamaConfig(vocab_size=64, d_model=64, n_layer=2, n_heads=16, n_kv_heads=8)
ALIBI_MODEL = LlamaConfig(vocab_size=64, d_model=64, n_layer=2, n_heads=16, n_kv_heads=8, position="alibi")
# gpt-oss (tests/test_gpt_oss.py's options: sinks, experts, windows, YaRN) with heads to split
GPT_OSS_MODEL = LlamaConfig(
    **{**GPT_OSS, "vocab_size": 64, "d_model": 64, "n_layer": 2, "swa_layers": (0,), "n_heads": 16, "n_kv_heads": 8}
)
_COLLECTIVE = re.compile(r"= (\S+) (all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)\(")


def _memory_config(streams: bool, model=MODEL):
    config = model.cache_config(size=64, n_seq_max=8, padding=16)
    return kvjax.StreamsConfig(config) if streams else config


def _prefill(streams: bool):
    """Two sequences of four tokens (sequences 0 and 5), as an equal split for streams."""
    if streams:
        return kvjax.make_equal_ubatch([([0, 1, 2, 3], [0]), ([0, 1, 2, 3], [5])])
    return kvjax.make_ubatch([0, 1, 2, 3] * 2, [[0]] * 4 + [[5]] * 4)


def _decode(streams: bool):
    if streams:
        return kvjax.make_equal_ubatch([([4], [0]), ([4], [5])])
    return kvjax.make_ubatch([4, 4], [[0], [5]])


@pytest.mark.parametrize(
    "streams, mesh_shape, variant",
    [
        *[pytest.param(False, m.values[0], "plain", id=f"unified-{m.id}", marks=m.marks) for m in meshes("2x4", "1x8")],
        *[pytest.param(True, m.values[0], "plain", id=f"streams-{m.id}", marks=m.marks) for m in meshes("2x4", "1x8")],
        # fused projections (kvjax.nn.fuse_projections) split by whole heads and MLP columns too
        *[
            pytest.param(False, m.values[0], "fused", id=f"unified-fused-{m.id}", marks=m.marks)
            for m in meshes("2x4", "1x8")
        ],
        # ALiBi: the streams mesh path splits the per-head slopes like the query heads
        *[
            pytest.param(True, m.values[0], "alibi", id=f"streams-alibi-{m.id}", marks=m.marks)
            for m in meshes("2x4", "1x8")
        ],
        # gpt-oss: sinks split like the query heads, every expert by MLP columns; the streams case
        # behind slow (test_stream_attention_on_a_mesh_equals_one_device runs sinks on that path)
        *[
            pytest.param(False, m.values[0], "gpt-oss", id=f"unified-gpt-oss-{m.id}", marks=m.marks)
            for m in meshes("2x4")
        ],
        *[
            pytest.param(True, m.values[0], "gpt-oss", id=f"streams-gpt-oss-{m.id}", marks=[*m.marks, pytest.mark.slow])
            for m in meshes("2x4")
        ],
    ],
)
def test_sharded_model_step_equals_unsharded(streams, mesh_shape, variant):
    config = {"alibi": ALIBI_MODEL, "gpt-oss": GPT_OSS_MODEL}.get(variant, MODEL)
    model = make_model(config)
    if variant == "gpt-oss":  # sinks and biases start at 0: make them matter
        leaves, tree = jax.tree.flatten(nnx.state(model, nnx.Param))
        keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
        nnx.update(
            model, jax.tree.unflatten(tree, [x + 0.2 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])
        )
    step = plain_step = make_step(model)
    plain_state = nnx.state(model)
    mesh = shard.make_mesh(*mesh_shape)
    if variant == "fused":  # the unfused model's logits are the reference
        fused = kvjax.nn.fuse_projections(make_model(config))
        state, step = shard.shard_params(nnx.state(fused), mesh, n_kv_heads=config.n_kv_heads), make_step(fused)
    else:
        state = shard.shard_params(plain_state, mesh, n_kv_heads=config.n_kv_heads)
    tokens = np.arange(8, dtype=np.int32) * 7 % MODEL.vocab_size
    plain = kvjax.init(_memory_config(streams, config))
    sharded = kvjax.init(_memory_config(streams, config), mesh=mesh)
    layout = shard.shardings_of(sharded)
    for ub, toks in ((_prefill(streams), tokens), (_decode(streams), tokens[:2])):
        want, plain, ok_plain = plain_step(plain_state, plain, ub, toks, n_kv=16)
        got, sharded, ok = step(state, sharded, ub, toks, n_kv=16)
        assert bool(ok) and bool(ok_plain)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        assert jax.tree.all(jax.tree.map(lambda x, s: x.sharding.is_equivalent_to(s, x.ndim), sharded, layout))
        np.testing.assert_allclose(
            np.asarray(sharded.split()[0][0][0]), np.asarray(plain.split()[0][0][0]), rtol=1e-5, atol=1e-5
        )
    # the compiled decode step: K/V stay where they are (tensor parallelism's all-reduces only)
    buffers, rest = sharded.split()
    ub = _decode(streams)
    hlo = (
        step._jitted.lower(state, rest, buffers, ub, tokens[:2], None, None, windows=(16,))
        .compile(compiler_options=USER_HLO)
        .as_text()
    )
    gathers = [shape for shape, kind in _COLLECTIVE.findall(hlo) if kind != "all-reduce"]
    assert gathers == [], f"the compiled step moves data between devices: {gathers}"


def test_shard_params_refuses_a_mesh_that_splits_a_head_group():
    """4 devices on "model" divide the K/V columns of 2 kv heads of size 8 (16) but not the heads:
    refused for a module (its config) and for a bare state given ``n_kv_heads``; nothing placed."""
    config = LlamaConfig(vocab_size=64, d_model=32, n_layer=1, n_heads=4, n_kv_heads=2)
    model = make_model(config)
    mesh = shard.make_mesh(2, 4)
    before = jax.tree.leaves(nnx.state(model))  # the arrays (the Variables are updated in place)
    with pytest.raises(
        ValueError,
        match=r"n_kv_heads=2 is out of range for mesh=.*allowed a mesh whose model "
        r"size is one of \[1, 2\]",
    ):
        shard.shard_params(model, mesh)
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model)), before, strict=True))
    with pytest.raises(ValueError, match=r"n_kv_heads=2 is out of range"):
        shard.shard_params(nnx.state(model), mesh, n_kv_heads=2)
    with pytest.raises(ValueError, match=r"n_kv_heads=3 does not match the model's config.n_kv_heads=2"):
        shard.shard_params(model, mesh, n_kv_heads=3)
    for bad in (0, -2, 2.0, True, "2"):
        for target in (nnx.state(model), model):  # a module's keyword is checked before its config
            with pytest.raises(ValueError, match=r"n_kv_heads=.* is out of range: allowed an integer >= 1"):
                shard.shard_params(target, mesh, n_kv_heads=bad)
    # a mesh that divides the heads places the bare state
    placed = shard.shard_params(nnx.state(model), shard.make_mesh(4, 2), n_kv_heads=2)
    assert placed["layers"][0]["attn"]["k_proj"]["kernel"].get_value().sharding.spec == jax.sharding.PartitionSpec(
        None, "model"
    )


# -- what the compiled attention and K-shift communicate ---------------------------------------------

_ANY_COLLECTIVE = re.compile(
    r"= (\([^)]*\)|\w+\[[0-9,]*\]\S*) (all-gather|all-reduce|all-to-all|collective-permute|"
    r"reduce-scatter)(?:-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([0-9,]*)\]")


def kv_collectives(hlo: str, memory) -> list:
    """The collectives of a compiled program that move K/V-sized data: an operand with at least as
    many elements as the smallest per-device shard of any K/V buffer of ``memory`` (a sharded
    softmax's few scalars and the ``[T, Hq, Dv]`` outputs are far below it). Tuple-shaped
    collectives (XLA combines several) are read element by element."""
    smallest = min(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(memory.split()[0]))
    found = []
    for shapes, kind in _ANY_COLLECTIVE.findall(hlo):
        for dtype, dims in _ARRAY.findall(shapes):
            if int(np.prod([int(d) for d in dims.split(",") if d])) >= smallest:
                found.append(f"{kind} {dtype}[{dims}]")
    return found


_LONG = dict(size=384, n_seq_max=8, n_layer=2, padding=32)
COLLECTIVE_CASES = {
    "unified": kvjax.CacheConfig(**_LONG, n_kv_heads=8, head_dim=8, rope=kvjax.RopeConfig(n_rot=8)),
    "unified-q8_0": kvjax.CacheConfig(
        **_LONG, n_kv_heads=8, head_dim=32, k_dtype="q8_0", v_dtype="q8_0", rope=kvjax.RopeConfig(n_rot=32)
    ),
    "streams": kvjax.StreamsConfig(
        kvjax.CacheConfig(**_LONG, n_kv_heads=16, head_dim=4, rope=kvjax.RopeConfig(n_rot=4))
    ),
    "streams-q4_0": kvjax.StreamsConfig(
        kvjax.CacheConfig(
            **_LONG, n_kv_heads=8, head_dim=32, k_dtype="q4_0", v_dtype="q4_0", rope=kvjax.RopeConfig(n_rot=32)
        )
    ),
}


def _attention_programs(memory, rng, sinks=False):
    """``(what, fn, args)`` for the attention of a 16-token prompt chunk of one sequence and of a
    decode step of every sequence (the shapes that once all-gathered a streams memory's K/V); with
    ``sinks``, a learned sink per query head (split over ``"model"`` like the heads)."""
    streams = isinstance(memory, kvjax.StreamCache)
    heads, dim = memory.part(0).config.n_kv_heads[0], memory.part(0).config.head_dim[0]
    cases = []
    for what, slots in (("chunk", [(list(range(100, 116)), [3])]), ("decode", [([200], [s]) for s in range(8)])):
        ub = (
            kvjax.make_equal_ubatch(slots)
            if streams
            else kvjax.make_ubatch(
                [p for ps, _ in slots for p in ps], [ids for ps, ids in slots for _ in ps], length=16
            )
        )
        placed, placement, ok = kvjax.find_slot(memory, ub)
        assert bool(ok)
        q = jnp.asarray(rng.normal(size=(ub.length, 2 * heads, dim)), jnp.float32)
        sink = jnp.linspace(-1.0, 2.0, 2 * heads) if sinks else None
        if streams:
            mask = kvjax.stream_masks(placed, ub, placement, 384)
            fn = lambda q, m, mask, p, ub=ub: kvjax.stream_attention(q, m, 0, mask, p, ub, sinks=sink)
            cases.append((what, fn, (q, placed, mask, placement)))
        else:
            mask = kvjax.kq_mask(placed, ub, 384)
            cases.append((what, lambda q, m, mask: kvjax.attention(q, m, 0, mask, sinks=sink), (q, placed, mask)))
    return cases


def _k_shift_program(memory):
    """The program ``kvjax.update`` runs for a pending K-shift (a streams memory runs its copies
    between streams, which move a stream's K/V to another device by nature, as a separate program
    only when one is pending)."""
    if isinstance(memory, kvjax.StreamCache):
        from kvjax.memory._streams import _apply_shifts

        return _apply_shifts
    return kvjax.update


@pytest.mark.parametrize("case", sorted(COLLECTIVE_CASES))
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_attention_and_k_shift_move_no_kv_between_devices(case, mesh_shape):
    """Each device attends to and rotates only the cells, streams and heads it holds: the compiled
    attention (a prompt chunk and a decode step) and the compiled K-shift have no collective of
    K/V size, on every mesh, for float and block-quantized storage. Before, the K-shift sliced one
    head at a time out of the head axis (an all-gather or all-reduce of K on every split mesh) and
    a streams memory's attention gathered every stream to every device."""
    config = COLLECTIVE_CASES[case]
    memory = kvjax.init(config, mesh=shard.make_mesh(*mesh_shape))
    ub = (
        kvjax.make_equal_ubatch([(list(range(8)), [s]) for s in range(8)])
        if isinstance(memory, kvjax.StreamCache)
        else kvjax.make_ubatch(list(range(8)) * 2, [[0]] * 8 + [[5]] * 8)
    )
    memory = kvjax.commit(kvjax.find_slot(memory, ub)[0], [ub])
    rng = np.random.default_rng(0)
    for what, fn, args in _attention_programs(memory, rng):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
        assert kv_collectives(hlo, memory) == [], f"{case} {what} attention moves K/V: {kv_collectives(hlo, memory)}"
    shifted = kvjax.seq_add(memory, 5, 2, -1, 3)
    hlo = jax.jit(_k_shift_program(shifted)).lower(shifted).compile().as_text()
    assert kv_collectives(hlo, shifted) == [], f"{case} K-shift moves K/V: {kv_collectives(hlo, shifted)}"


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_stream_attention_on_a_mesh_equals_one_device(mesh_shape):
    """The public ``stream_attention`` on a streams memory split over devices gives the one-device
    result (the per-device path it now takes sums each slot's output from the device holding its stream)."""
    config = COLLECTIVE_CASES["streams"]
    plain = _random_kv(kvjax.init(config), 4)
    ub = kvjax.make_equal_ubatch([(list(range(12)), [s]) for s in range(8)])
    plain = kvjax.commit(kvjax.find_slot(plain, ub)[0], [ub])
    sharded = shard.reshard_like(plain, kvjax.init(config, mesh=shard.make_mesh(*mesh_shape)))
    for sinks in (False, True):  # learned sinks: each device's slots, heads split as the queries'
        one_device = _attention_programs(plain, np.random.default_rng(3), sinks)
        on_mesh = _attention_programs(sharded, np.random.default_rng(3), sinks)  # the same queries
        for (what, fn, args), (_, fn_mesh, args_mesh) in zip(one_device, on_mesh):
            np.testing.assert_allclose(
                np.asarray(fn_mesh(*args_mesh)), np.asarray(fn(*args)), rtol=1e-5, atol=1e-5, err_msg=f"{what} {sinks}"
            )


@pytest.mark.parametrize("case", ["unified", "unified-q8_0", "streams"])
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_k_shift_on_a_mesh_equals_one_device(case, mesh_shape):
    """The per-layer K-shift a mesh runs (every head of a layer at once) rotates as the per-head one."""
    config = COLLECTIVE_CASES[case]
    plain = _random_kv(kvjax.init(config), 5)
    streams = isinstance(plain, kvjax.StreamCache)
    ub = (
        kvjax.make_equal_ubatch([(list(range(8)), [s]) for s in range(8)])
        if streams
        else kvjax.make_ubatch(list(range(8)) * 2, [[0]] * 8 + [[5]] * 8)
    )
    plain = kvjax.commit(kvjax.find_slot(plain, ub)[0], [ub])
    sharded = shard.reshard_like(plain, kvjax.init(config, mesh=shard.make_mesh(*mesh_shape)))
    want = kvjax.update(kvjax.seq_add(plain, 5, 2, -1, 3))
    got = kvjax.update(kvjax.seq_add(sharded, 5, 2, -1, 3))
    _assert_kept(got, sharded, "update")
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(
            np.asarray(a).astype(np.float32), np.asarray(b).astype(np.float32), rtol=1e-5, atol=1e-5
        )


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_a_copy_between_streams_moves_only_the_copied_streams(mesh_shape):
    """Whole-sequence copies to other streams (``seq_cp`` across streams, applied by ``update``) give
    the one-device bytes exactly, keep the layout, and their program sends one stream's block per
    copied source (an all-reduce under a ``cond``) instead of all-gathering every stream to every
    device. Bfloat16 K (with -0.0 in it) and q8_0 V: the blocks travel as unsigned bits."""
    from kvjax.memory._streams import _apply_copies

    base = kvjax.CacheConfig(
        size=32, n_seq_max=8, n_layer=2, n_kv_heads=8, head_dim=32, padding=8, k_dtype="bfloat16", v_dtype="q8_0"
    )
    config = kvjax.StreamsConfig(base)
    plain = kvjax.init(config)
    for s in range(8):
        ub = kvjax.make_equal_ubatch([(list(range(5)), [s])])
        plain = kvjax.commit(kvjax.find_slot(plain, ub)[0], [ub])
    plain = _random_kv(plain, 6)
    buffers, rest = plain.split()
    k = buffers[0][0]
    plain = rest.join(((k.at[:, :, :, :2].set(-0.0),) + buffers[0][1:], buffers[1]))  # a float sum loses -0.0
    for src, dst in ((0, 5), (3, 2), (6, 7), (1, 0)):  # across devices and within one
        plain = kvjax.seq_cp(kvjax.seq_rm(plain, dst, 0, -1)[0], src, dst, -1, -1)
    layout = kvjax.init(config, mesh=shard.make_mesh(*mesh_shape))
    sharded = shard.reshard_like(plain, layout)
    got, want = kvjax.update(sharded), kvjax.update(plain)
    assert leaves_equal(got, want)
    assert all(
        np.asarray(a).tobytes() == np.asarray(b).tobytes()
        for a, b in zip(jax.tree.leaves(got.split()[0]), jax.tree.leaves(want.split()[0]))
    )
    _assert_kept(got, layout, "update with copies")
    hlo = jax.jit(_apply_copies).lower(sharded).compile().as_text()
    stream_block = max(int(np.prod(x.sharding.shard_shape(x.shape)[1:])) for x in jax.tree.leaves(sharded.split()[0]))
    found = [(kind, shapes) for shapes, kind in _ANY_COLLECTIVE.findall(hlo)]  # and copy_from's few ids
    for kind, shapes in found:
        for _, dims in _ARRAY.findall(shapes):
            assert int(np.prod([int(d) for d in dims.split(",") if d])) <= stream_block, (kind, shapes)


def test_a_memory_on_another_single_device_restores_there():
    """A cache placed whole on a device other than the default one reads a sequence (and a whole
    blob) back onto that device: the rows were adopted on device 0, which one program with the
    cache refused ("incompatible devices"), and a whole read moved the K/V to device 0."""
    device = jax.devices()[3]
    plain = _with_sequences(kvjax.init(UNIFIED), 7)
    placed = jax.device_put(plain, device)
    for seq_id in (1, -1):
        blob = kvjax.state_write(plain, seq_id)
        got = kvjax.state_read(jax.device_put(kvjax.init(UNIFIED), device), blob, seq_id)
        assert {d for x in jax.tree.leaves(got) for d in x.devices()} == {device}
        assert leaves_equal(got, kvjax.state_read(kvjax.init(UNIFIED), blob, seq_id))
    assert leaves_equal(placed, plain)
