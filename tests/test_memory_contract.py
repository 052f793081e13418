"""The memory contract, run on every row of the table of memories under test.

Every memory kvjax offers must pass the same contract (optax's ``_OPTIMIZERS_UNDER_TEST`` idea):

- it is a :class:`kvjax.Memory` and every public free function accepts it;
- jitted equals eager for every sequence operation, placement and query;
- new argument values never recompile;
- an old value (a snapshot) stays valid and unchanged after operations on newer values, and the
  metadata ``rest`` of ``split()`` stays valid after a donated step;
- ``state_write`` / ``state_read`` round trip, whole and per sequence;
- random programs of operations run in lock step with the memory's pure-Python reference model,
  compared cell by cell after every operation;
- a concrete bad argument raises ``ValueError`` naming it, and the memory is unchanged.

A new memory is one more :class:`MemoryUnderTest` row in :data:`MEMORIES_UNDER_TEST`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, List

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.testing import HybridRef, IswaRef, RecurrentRef, StreamsRef, UnifiedRef
from tests.helpers import CompileCounter, assert_cells_match, no_recompile


@dataclasses.dataclass(frozen=True)
class MemoryUnderTest:
    """One row of the table: how to make the memory, its reference model, and how to compare them.

    Attributes:
        name: the row's test id.
        make: a new, empty memory.
        reference: a new reference model of the same memory (pure Python).
        compare: asserts that a memory and a reference hold the same cells (every field).
        random_kv: fills the memory's buffers with random values (so round trips compare real bytes).
    """

    name: str
    make: Callable[[], kvjax.Memory]
    reference: Callable[[], object]
    compare: Callable[[kvjax.Memory, object], None]
    random_kv: Callable[[kvjax.Memory, int], kvjax.Memory]
    equal_split: bool = False
    #: turns a random program into one this memory accepts (streams: no token or partial copy across streams)
    adapt: Callable[[list], list] = lambda ops: ops


# -- the unified cache ---------------------------------------------------------------------------

UNIFIED = kvjax.CacheConfig(
    size=48, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=8, padding=16, rope=kvjax.RopeConfig(n_rot=8)
)


def _compare_unified(cache, ref):
    assert_cells_match(cache, ref)
    assert int(kvjax.used_cells(cache)) == ref.used


def _random_unified(cache, seed):
    rng = np.random.default_rng(seed)
    k = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in cache.k)
    v = tuple(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in cache.v)
    return cache.replace(k=k, v=v)


# -- the iSWA pair: a 4-layer model, layers 0 and 2 with a window ------------------------------------

ISWA_BASE = kvjax.CacheConfig(
    size=64, n_seq_max=4, n_layer=4, n_kv_heads=2, head_dim=8, padding=16, rope=kvjax.RopeConfig(n_rot=8)
)


def _iswa(swa_type="standard", swa_full=False, n_swa=3):
    cfg = kvjax.IswaConfig(ISWA_BASE, swa_layers=(0, 2), n_swa=n_swa, swa_type=swa_type, swa_full=swa_full, n_batch=8)
    ref = lambda: IswaRef(
        size=ISWA_BASE.size,
        n_seq_max=ISWA_BASE.n_seq_max,
        padding=ISWA_BASE.padding,
        n_swa=n_swa,
        swa_type=swa_type,
        n_batch=8,
        swa_full=swa_full,
    )
    return lambda: kvjax.init(cfg), ref


def _compare_iswa(memory, ref):
    _compare_unified(memory.base, ref.base)
    _compare_unified(memory.swa, ref.swa)


def _random_iswa(memory, seed):
    return memory.replace(base=_random_unified(memory.base, seed), swa=_random_unified(memory.swa, seed + 1))


# -- the recurrent-state memory (2 kept states: rollback is part of the contract) ------------------

RECURRENT = kvjax.RecurrentConfig(size=4, n_seq_max=4, n_layer=2, k_shape=(3, 2), v_shape=(2, 4), n_states=2)


def _compare_recurrent(memory, ref):
    table = kvjax.cell_table(memory)
    for i, cell in enumerate(ref.cells):
        got = (int(table.pos[i]), set(np.flatnonzero(table.seqs[i]).tolist()), int(table.roll[i]), int(table.hist[i]))
        assert got == (cell.pos, cell.seqs, cell.roll, cell.hist), (i, got, cell)
    assert table.tail.tolist() == ref.tail and table.head == ref.head
    assert int(kvjax.used_cells(memory)) == ref.used


# -- the hybrid memory: layers 0 and 2 attention (a unified cache), layer 1 recurrent -------------------

HYBRID = kvjax.HybridConfig(
    kvjax.CacheConfig(size=48, n_seq_max=4, n_layer=3, n_kv_heads=2, head_dim=8, padding=16, layer_filter=(0, 2)),
    kvjax.RecurrentConfig(size=4, n_seq_max=4, n_layer=1, k_shape=(3, 2), v_shape=(2, 4), n_states=2),
    recurrent_layers=(1,),
)


def _compare_hybrid(memory, ref):
    _compare_unified(memory.attention, ref.attention)
    _compare_recurrent(memory.recurrent, ref.recurrent)


def _random_hybrid(memory, seed):
    return memory.replace(
        attention=_random_unified(memory.attention, seed), recurrent=_random_unified(memory.recurrent, seed + 1)
    )


# -- per-sequence streams: one stream per sequence -------------------------------------------------

STREAMS = kvjax.StreamsConfig(UNIFIED.replace(size=24, padding=8))


# -- the latent (MLA) cache: one K row [latent 32 | RoPE key 8] per cell, V a view of its latent ------

MLA = kvjax.CacheConfig(
    size=48,
    n_seq_max=4,
    n_layer=2,
    n_kv_heads=1,
    head_dim=40,
    head_dim_v=32,
    padding=16,
    mla=True,
    rope=kvjax.RopeConfig(n_rot=8),
)
MLA_Q8 = MLA.replace(head_dim=64, k_dtype="q8_0", rope=kvjax.RopeConfig(n_rot=32))
MLA_STREAMS = kvjax.StreamsConfig(MLA.replace(size=24, padding=8))


def _unified_row(name, config):
    return MemoryUnderTest(
        name,
        lambda: kvjax.init(config),
        lambda: UnifiedRef(config.size, config.n_seq_max, config.padding),
        _compare_unified,
        _random_unified,
    )


def _streams_row(name, config):
    return MemoryUnderTest(
        name,
        lambda: kvjax.init(config),
        lambda: StreamsRef(config.size, config.n_seq_max, config.base.padding),
        _compare_streams,
        lambda m, seed: m.replace(cache=_random_unified(m.cache, seed)),
        equal_split=True,
        adapt=lambda ops: _streams_program(ops, config),
    )


def _compare_streams(memory, ref):
    for s, st in enumerate(ref.streams):
        _compare_unified(memory.stream(s), st)
    assert int(kvjax.used_cells(memory)) == ref.used


def _streams_program(ops, config: kvjax.StreamsConfig = STREAMS):
    """Tokens of one stream only, and whole-sequence copies between streams (llama.cpp's rules)."""
    stream = lambda s: config.stream_table[s]
    out = []
    for op in ops:
        if op[0] == "place":
            op = ("place", [(p, [s for s in ids if stream(s) == stream(ids[0])]) for p, ids in op[1]])
        elif op[0] == "seq_cp" and stream(op[1]) != stream(op[2]):
            op = ("seq_cp", op[1], op[2], -1, -1)
        out.append(op)
    return out


MEMORIES_UNDER_TEST: List[MemoryUnderTest] = [
    _unified_row("unified", UNIFIED),
    _unified_row("mla", MLA),
    _unified_row("mla-q8_0", MLA_Q8),
    MemoryUnderTest("iswa-standard", *_iswa("standard"), _compare_iswa, _random_iswa),
    MemoryUnderTest("iswa-chunked", *_iswa("chunked", n_swa=4), _compare_iswa, _random_iswa),
    MemoryUnderTest("iswa-symmetric", *_iswa("symmetric", n_swa=4), _compare_iswa, _random_iswa),
    MemoryUnderTest("iswa-full", *_iswa("standard", swa_full=True), _compare_iswa, _random_iswa),
    MemoryUnderTest(
        "recurrent",
        lambda: kvjax.init(RECURRENT),
        lambda: RecurrentRef(RECURRENT.size, RECURRENT.n_seq_max, RECURRENT.n_states),
        _compare_recurrent,
        _random_unified,
        equal_split=True,
    ),
    MemoryUnderTest(
        "hybrid",
        lambda: kvjax.init(HYBRID),
        lambda: HybridRef(48, 4, 16, state_cells=4, n_states=2),
        _compare_hybrid,
        _random_hybrid,
        equal_split=True,
    ),
    _streams_row("streams", STREAMS),
    _streams_row("mla-streams", MLA_STREAMS),
]
ROWS = [pytest.param(m, id=m.name) for m in MEMORIES_UNDER_TEST]


# -- programs of operations ----------------------------------------------------------------------


def random_program(seed: int, n_seq_max: int, n_ops: int = 24):
    """Operations as tuples ``(name, *args)``; placements are runs of tokens of one or two sequences,
    and one ``clear`` two thirds of the way in."""
    rng = np.random.default_rng(seed)
    next_pos = [0] * n_seq_max
    ops = []
    for _ in range(n_ops):
        kind = rng.choice(["place"] * 4 + ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div"])
        s = int(rng.integers(n_seq_max))
        if kind == "place":
            n = int(rng.integers(1, 6))
            shared = [s] + ([int((s + 1) % n_seq_max)] if rng.random() < 0.2 else [])
            ops.append(("place", [(next_pos[s] + i, shared) for i in range(n)]))
            next_pos[s] += n
        elif kind == "seq_rm":
            ops.append(("seq_rm", s if rng.random() < 0.8 else -1, int(rng.integers(-1, 8)), int(rng.integers(-1, 12))))
        elif kind == "seq_cp":
            ops.append(("seq_cp", s, int(rng.integers(n_seq_max)), -1, int(rng.integers(-1, 10))))
        elif kind == "seq_keep":
            ops.append(("seq_keep", s if rng.random() < 0.3 else -1))
        elif kind == "seq_add":
            ops.append(("seq_add", s, int(rng.integers(0, 6)), -1, int(rng.integers(-3, 4))))
        else:
            ops.append(("seq_div", s, int(rng.integers(0, 6)), -1, int(rng.integers(1, 3))))
    # one clear two thirds of the way in, so that the memory is emptied and filled again
    return ops[: 2 * n_ops // 3] + [("clear",)] + ops[2 * n_ops // 3 :]


def _recurrent_slots(tokens):
    """A placement's tokens (one sequence set) as the one slot of an equal-split ubatch."""
    return [([p for p, _ in tokens], list(tokens[0][1]))]


def apply_op(memory, op, jitted: bool):
    """Run one operation through the public free functions; returns ``(memory, ok or None)``."""
    name, *args = op
    if name == "place":
        if memory.ubatch_split == "equal":
            ub = kvjax.make_equal_ubatch(_recurrent_slots(args[0]), n_slots=1)
        else:
            ub = kvjax.make_ubatch([p for p, _ in args[0]], [s for _, s in args[0]], length=8)
        fn = _JIT["find_slot"] if jitted else kvjax.find_slot
        memory, _, ok = fn(memory, ub)
        if bool(ok):  # the batch (this one ubatch) succeeded: the seed's commit
            memory = (_JIT["commit"] if jitted else kvjax.commit)(memory, [ub])
        return memory, bool(ok)
    fn = _JIT[name] if jitted else getattr(kvjax, name)
    if name == "seq_rm":
        memory, ok = fn(memory, *args)
        return memory, bool(ok)
    return fn(memory, *args), None


def apply_ref(ref, op):
    name, *args = op
    if name == "place" and isinstance(ref, (RecurrentRef, HybridRef)):
        ok = ref.find_slot(_recurrent_slots(args[0]))
        if ok and isinstance(ref, RecurrentRef):
            ref.set_inputs()
        return ok
    if name == "place":
        ok = ref.find_slot(args[0], True)[-1]
        if ok and hasattr(ref, "commit"):
            ref.commit([args[0]])
        return ok
    if name == "seq_rm":
        return bool(ref.seq_rm(*args) is not False)
    getattr(ref, name)(*args)
    return None


def apply_in_lock_step(row, ref, eager, jitted, op):
    """``op`` on the reference, eagerly and under jit; every cell equal to the reference's after it.
    Returns the new ``(eager, jitted)`` memories."""
    want = apply_ref(ref, op)
    eager, got_eager = apply_op(eager, op, jitted=False)
    jitted, got_jit = apply_op(jitted, op, jitted=True)
    assert got_eager == got_jit == want, op
    row.compare(eager, ref)
    assert leaves_equal(eager, jitted), f"jit differs from eager after {op}"
    return eager, jitted


_JIT = {
    name: jax.jit(getattr(kvjax, name))
    for name in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear", "find_slot", "commit")
}


def leaves_equal(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))


# -- the contract --------------------------------------------------------------------------------


@pytest.mark.parametrize("row", ROWS)
def test_is_a_memory(row):
    memory = row.make()
    assert isinstance(memory, kvjax.Memory)
    assert memory.n_parts >= 0 and memory.n_seq_max >= 1 and memory.size >= 1
    assert isinstance(memory.can_shift, bool)
    assert memory.nbytes() > 0
    assert kvjax.errors(memory) == []


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lock_step_with_the_reference_eager_and_jitted(row, seed):
    """Every cell equals the reference model's after every operation, eagerly and under jit."""
    ops = row.adapt(random_program(seed, row.make().n_seq_max))
    eager, jitted, ref = row.make(), row.make(), row.reference()
    for op in ops:
        eager, jitted = apply_in_lock_step(row, ref, eager, jitted, op)
        for s in range(-1, eager.n_seq_max):
            assert int(kvjax.seq_pos_min(eager, s)) == ref.seq_pos_min(s)
            assert int(kvjax.seq_pos_max(eager, s)) == ref.seq_pos_max(s)


@pytest.mark.parametrize("row", ROWS)
def test_new_argument_values_do_not_recompile(row):
    memory = row.make()
    for op in row.adapt(random_program(5, memory.n_seq_max, 12)):  # warm up every jitted op once
        memory, _ = apply_op(memory, op, jitted=True)
    with no_recompile():
        for op in row.adapt(random_program(6, memory.n_seq_max, 12)):
            memory, _ = apply_op(memory, op, jitted=True)


@pytest.mark.parametrize("row", ROWS)
def test_snapshots_stay_valid(row):
    memory = row.make()
    for op in row.adapt(random_program(7, memory.n_seq_max, 10)):
        memory, _ = apply_op(memory, op, jitted=False)
    snapshot = jax.tree.map(lambda x: np.asarray(x).copy(), memory)
    later = memory
    for op in row.adapt(random_program(8, memory.n_seq_max, 10)):
        later, _ = apply_op(later, op, jitted=False)
    assert leaves_equal(memory, snapshot), "an operation changed the value it was given"
    # the metadata of split() is the part a donated step keeps: it must survive the step
    buffers, rest = memory.split()
    assert leaves_equal(rest.join(buffers), memory)
    assert not jax.tree.leaves(buffers) or all(isinstance(x, jax.Array) for x in jax.tree.leaves(buffers))


@pytest.mark.parametrize("row", ROWS)
def test_state_round_trip(row):
    memory = row.make()
    for op in row.adapt(random_program(9, memory.n_seq_max, 16)):
        memory, _ = apply_op(memory, op, jitted=False)
    memory = row.random_kv(kvjax.update(memory), 1)
    whole = kvjax.state_read(row.make(), kvjax.state_write(memory))
    assert kvjax.state_write(whole) == kvjax.state_write(memory)
    for s in range(memory.n_seq_max):
        blob = kvjax.state_write(memory, s)
        restored = kvjax.state_read(row.make(), blob, s)
        assert kvjax.state_write(restored, s) == blob
        assert int(kvjax.seq_pos_max(restored, s)) == int(kvjax.seq_pos_max(memory, s))


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: kvjax.seq_rm(m, 99), r"seq_id=99 is out of range"),
        (lambda m: kvjax.seq_cp(m, 0, -1), r"seq_id_dst=-1 is out of range"),
        (lambda m: kvjax.seq_keep(m, 1.5), r"seq_id=1.5 is out of range: allowed an integer scalar"),
        (lambda m: kvjax.seq_add(m, 0, 0, -1, 2**40), r"delta=1099511627776 is out of range"),
        (lambda m: kvjax.seq_div(m, 0, 0, -1, 0), r"d=0 is out of range"),
        (lambda m: kvjax.seq_pos_max(m, "0"), r"seq_id='0' is out of range: allowed an integer scalar"),
        (
            lambda m: kvjax.find_slot(m, kvjax.make_ubatch([0], [[0]]), contiguous="yes"),
            r"contiguous='yes' is out of range: allowed True or False",
        ),
        (lambda m: kvjax.update(m, donate="False"), r"donate='False' is out of range: allowed True or False"),
        (lambda m: kvjax.state_read(m, b"\x00"), r"cell_count|stream|expected"),
    ],
)
def test_bad_input_raises_and_changes_nothing(row, call, match):
    memory = row.make()
    for op in row.adapt(random_program(3, memory.n_seq_max, 8)):
        memory, _ = apply_op(memory, op, jitted=False)
    before = jax.tree.map(lambda x: np.asarray(x).copy(), memory)
    with pytest.raises(ValueError, match=match):
        call(memory)
    assert leaves_equal(memory, before)


def test_the_table_counts_compiles_honestly():
    """The compile counter the contract relies on does see a compilation."""
    with CompileCounter() as counter:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7))
    assert counter.count >= 1
