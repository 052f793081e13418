"""The recurrent-state memory against the reference model of the seed's recurrent cache.

Property tests drive random equal-split ubatches and sequence operations through
:class:`kvjax.RecurrentCache` and :class:`kvjax.testing.RecurrentRef` and compare, after every
operation, every cell (``pos``, sequences, ``roll``, ``hist``), every tail, ``head``, each
placement's ``s_copy``/``s_roll``/``s_mask`` and every refusal. State rows are simulated with a
fold that says which tokens a state has seen (``x -> (7 x + pos + 1) mod 65521``, exact in float32),
run through the memory's own row operations (``read_states``, which must give what ``copy_rows``
then ``slot_states`` give, and ``write_states``) and through the reference's ``move_rows``: every
kept state of every sequence must agree.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvjax
from kvjax.memory._recurrent_rows import row_sources, set_rows, take_rows, moving_rows_bound
from kvjax.memory._seqbits import unpack
from kvjax.testing import RecurrentRef
from kvjax.testing._recurrent_reference import move_rows
from tests.helpers import no_recompile

MOD = 65521.0


def fold(x, pos):
    return (x * 7 + pos + 1) % MOD


def config(size=4, n_seq_max=4, n_states=1):
    return kvjax.RecurrentConfig(
        size=size, n_seq_max=n_seq_max, n_layer=2, k_shape=(1,), v_shape=(2,), n_states=n_states
    )


def compare(memory, ref, placement=None, inputs=None):
    """Every cell, tail and ``head`` equal; the placement's inputs equal the reference's."""
    c = jax.device_get(memory.cells)
    seqs = unpack(np.asarray(c.seq), ref.n_seq_max)
    for i, cell in enumerate(ref.cells):
        got = (int(c.pos[i]), set(np.flatnonzero(seqs[i]).tolist()), int(c.roll[i]), int(c.hist[i]))
        assert got == (cell.pos, cell.seqs, cell.roll, cell.hist), (i, got, cell)
    assert np.asarray(c.tail).tolist() == ref.tail
    assert int(c.head) == ref.head
    assert int(kvjax.used_cells(memory)) == ref.used_cells()
    assert int(kvjax.n_tokens(memory)) == ref.n_tokens()
    assert int(kvjax.pos_max(memory)) == ref.pos_max()
    if placement is not None:
        n = ref.n
        assert (int(placement.head), int(placement.n)) == (ref.head, n)
        assert np.asarray(placement.s_copy)[:n].tolist() == inputs[0]
        assert np.asarray(placement.s_roll)[:n].tolist() == inputs[1]
        assert np.asarray(placement.s_mask)[:n].astype(float).tolist() == inputs[2]
        assert not np.asarray(placement.s_mask)[n:].any()


@functools.partial(jax.jit, static_argnames="read_first")
def simulated_step(memory, placement, ubatch, read_first=True):
    """Run the fold through the memory's row operations, as a model step does.

    ``read_first``: through ``read_states`` (what the models call: the slots' states read from
    their source rows, then only the other rows moved), else ``copy_rows`` then ``slot_states``."""
    n_slots, t = kvjax.memory._ubatch.equal_slots(ubatch)
    if read_first:
        memory, ((k0, v0),) = memory.read_states(placement, n_slots, t)
    else:
        memory = memory.copy_rows(placement, n_slots)
        k0, v0 = memory.slot_states(placement, n_slots)  # [L, S, 1], [L, S, 2]
    pos = jnp.asarray(ubatch.pos).reshape(n_slots, t)
    q = min(memory.config.n_states, t)

    def run(x0):
        states = []
        x = x0
        for j in range(t):
            x = fold(x, pos[None, :, j].reshape((1, -1) + (1,) * (x.ndim - 2)))
            states.append(x)
        return jnp.stack(states[t - q :], axis=2)  # [L, S, q, ...]

    # the models pass their output as ``after`` (an ordering for XLA): it must change nothing
    return memory.write_states(placement, run(k0), run(v0), after=k0 if read_first else None)


def check_states(memory, ref, rows):
    """Every kept state of every sequence equals the reference's row (the fold of its tokens)."""
    k = np.asarray(memory.k[0])
    v = np.asarray(memory.v[0])
    kk = memory.config.n_states
    for s in range(ref.n_seq_max):
        t = ref.tail[s]
        if t < 0:
            continue
        for back in range(ref.cells[t].hist):
            cell, j = ref.state_of(s, back)
            want = rows[(cell, j)]
            assert k[:, cell * kk + j, 0].tolist() == [want] * k.shape[0], (s, back)
            assert v[:, cell * kk + j].reshape(-1).tolist() == [want] * (2 * v.shape[0]), (s, back)


def place(memory, ref, rows, slots, jitted=False, pad=0):
    """One ubatch through both; returns the new memory and rows (the reference's own step too).

    ``pad`` empty slots follow the real ones (a padded ubatch, as the engine makes)."""
    ub = kvjax.make_equal_ubatch(slots, n_slots=len(slots) + pad)
    fn = _FIND_SLOT if jitted else kvjax.find_slot
    new, placement, ok = fn(memory, ub)
    want = ref.find_slot([(list(p), list(s)) for p, s in slots])
    assert bool(ok) == want, slots
    if not want:
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new.cells, memory.cells))
        return memory, rows
    moving = np.asarray(row_sources(placement, new.config)) != np.arange(new.config.rows)
    kk = new.config.n_states
    assert np.sum(moving) <= moving_rows_bound(new.config, len(slots) + pad), (slots, np.flatnonzero(moving))
    assert len(set(np.flatnonzero(moving) // kk)) <= 2 * len(slots) - 1, slots  # the bound's argument
    others = set(np.flatnonzero(moving) // kk) - set(range(int(placement.head), int(placement.head) + len(slots)))
    assert len(others) <= len(slots) - 1, (slots, others)  # the slots_rewritten bound's argument
    inputs = ref.set_inputs()
    compare(new, ref, placement, inputs)
    rows = move_rows(rows, ref, inputs, [(list(p), list(s)) for p, s in slots], fold, 0.0)
    both = [simulated_step(new, placement, ub, read_first=r) for r in (True, False)]
    for a, b in zip(jax.tree.leaves(both[0]), jax.tree.leaves(both[1])):
        np.testing.assert_array_equal(a, b)  # read_states == copy_rows + slot_states
    new = both[0]
    check_states(new, ref, rows)
    return new, rows


_FIND_SLOT = jax.jit(kvjax.find_slot)
_OPS = {name: jax.jit(getattr(kvjax, name)) for name in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div")}


@st.composite
def programs(draw, n_seq_max, size):
    """Operations: equal-split placements (continuing or restarting sequences) and sequence ops."""
    ops = []
    for _ in range(draw(st.integers(4, 14))):
        kind = draw(st.sampled_from(["place"] * 5 + ["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear"]))
        if kind == "place":
            primaries = draw(st.lists(st.integers(0, n_seq_max - 1), min_size=1, max_size=min(3, size), unique=True))
            rest = [s for s in range(n_seq_max) if s not in primaries]
            slots = []
            for p in primaries:
                extra = [s for s in rest if draw(st.integers(0, 7)) == 0]
                rest = [s for s in rest if s not in extra]
                slots.append((p, extra))
            ops.append(("place", slots, draw(st.integers(1, 3)), draw(st.integers(0, 9)) == 0))
        elif kind == "seq_rm":
            ops.append(
                ("seq_rm", draw(st.integers(-1, n_seq_max - 1)), draw(st.integers(-1, 9)), draw(st.integers(-1, 12)))
            )
        elif kind == "seq_cp":
            ops.append(("seq_cp", draw(st.integers(0, n_seq_max - 1)), draw(st.integers(0, n_seq_max - 1)), -1, -1))
        elif kind == "seq_keep":
            ops.append(("seq_keep", draw(st.integers(-1, n_seq_max - 1))))
        elif kind == "seq_add":
            ops.append(
                (
                    "seq_add",
                    draw(st.integers(-1, n_seq_max - 1)),
                    draw(st.integers(-1, 6)),
                    -1,
                    draw(st.integers(-4, 4)),
                )
            )
        elif kind == "seq_div":
            ops.append(
                ("seq_div", draw(st.integers(-1, n_seq_max - 1)), draw(st.integers(-1, 6)), -1, draw(st.integers(1, 3)))
            )
        else:
            ops.append(("clear",))
    return ops


def run_program(ops, size, n_seq_max, n_states, jitted, pad=0):
    memory, ref, rows = kvjax.init(config(size, n_seq_max, n_states)), RecurrentRef(size, n_seq_max, n_states), {}
    for op in ops:
        name = op[0]
        if name == "place":
            _, spec, t, restart = op
            slots = []
            for primary, extra in spec:
                start = ref.seq_pos_max(primary) + 1 if not restart else 0
                slots.append((list(range(start, start + t)), [primary] + extra))
            memory, rows = place(memory, ref, rows, slots, jitted, pad)
        elif name == "clear":
            memory = kvjax.clear(memory)
            ref.clear()
        elif name == "seq_rm":
            memory, ok = (_OPS[name] if jitted else kvjax.seq_rm)(memory, *op[1:])
            assert bool(ok) == ref.seq_rm(*op[1:]), op
        elif name == "seq_add" and not ref.shift_keeps_states(*op[1:]):
            # refused (a state would go below 0): eagerly an error, under jit a flagged no-op
            if jitted:
                out = _OPS[name](memory, *op[1:])
                assert int(out.error_bits()) == kvjax.ErrorFlag.STATE_SHIFT, op
                memory = kvjax.clear_errors(out)
            else:
                with pytest.raises(ValueError, match="was refused"):
                    kvjax.seq_add(memory, *op[1:])
        else:
            memory = (_OPS[name] if jitted else getattr(kvjax, name))(memory, *op[1:])
            getattr(ref, name)(*op[1:])
        compare(memory, ref)
        ref.check_invariants()
        for s in range(-1, n_seq_max):
            assert int(kvjax.seq_pos_min(memory, s)) == ref.seq_pos_min(s)
            assert int(kvjax.seq_pos_max(memory, s)) == ref.seq_pos_max(s)
        check_states(memory, ref, rows)
    return memory


# 6 programs by default; the long run below draws 400 with -m slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), size=st.sampled_from([1, 2, 3, 5]), n_states=st.sampled_from([1, 3]))
def test_lock_step_with_the_reference(data, size, n_states):
    """Every cell, tail, input row and kept state equals the reference's after every operation."""
    ops = data.draw(programs(4, size))
    run_program(ops, size, 4, n_states, jitted=False)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_jitted_equals_eager(data):
    ops = data.draw(programs(3, 3))
    eager = run_program(ops, 3, 3, 2, jitted=False)
    jitted = run_program(ops, 3, 3, 2, jitted=True)
    for a, b in zip(jax.tree.leaves(eager), jax.tree.leaves(jitted)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_new_argument_values_do_not_recompile():
    memory = kvjax.init(config(4, 4, 2))
    ref = RecurrentRef(4, 4, 2)
    memory, _ = place(memory, ref, {}, [([0, 1], [0]), ([0, 1], [1])], jitted=True)
    memory = _OPS["seq_cp"](memory, 0, 2, -1, -1)
    memory, _ = _OPS["seq_rm"](memory, 3, -1, -1)
    memory = _OPS["seq_add"](memory, 0, 0, -1, 1)
    with no_recompile():
        memory, _, _ = _FIND_SLOT(memory, kvjax.make_equal_ubatch([([5, 6], [2]), ([2, 3], [1])], n_slots=2))
        memory = _OPS["seq_cp"](memory, 1, 3, -1, -1)
        memory, ok = _OPS["seq_rm"](memory, 2, 3, -1)
        memory = _OPS["seq_add"](memory, 1, 0, -1, 3)


def test_the_seeds_lost_tail_case_swaps_tails_by_value():
    """The seed re-points only the swapped cells' own tails; a new sequence's reserved cell then
    names a cell that a third sequence's state moves into, which is overwritten. kvjax follows it."""
    memory, ref, rows = kvjax.init(config(4, 4)), RecurrentRef(4, 4), {}
    memory, rows = place(memory, ref, rows, [([0], [2])])  # seq 2 in cell 0
    memory, rows = place(memory, ref, rows, [([0], [1])])  # seq 1 in cell 1
    memory, ok = kvjax.seq_rm(memory, 2)
    assert ref.seq_rm(2, -1, -1) and bool(ok)
    # seq 3 is new (reserves an empty cell), seq 1 continues: the gather swaps the reserved cell
    memory, rows = place(memory, ref, rows, [([0], [3]), ([1], [1])])
    assert sorted(t for t in ref.tail if t >= 0) == sorted(set(t for t in ref.tail if t >= 0))
    assert int(kvjax.seq_pos_max(memory, 1)) == 1 and int(kvjax.seq_pos_max(memory, 3)) == 0


def test_rollback_restores_the_kept_state():
    memory, ref, rows = kvjax.init(config(2, 2, n_states=4)), RecurrentRef(2, 2, 4), {}
    memory, rows = place(memory, ref, rows, [(list(range(5)), [0])])
    after_2 = rows[ref.state_of(0, 2)]
    memory, ok = kvjax.seq_rm(memory, 0, 3, -1)  # drop positions 3 and 4
    assert bool(ok) and ref.seq_rm(0, 3, -1)
    compare(memory, ref)
    assert int(kvjax.seq_pos_max(memory, 0)) == 2
    memory, rows = place(memory, ref, rows, [([3], [0])])  # continue from the state after 2
    assert rows[ref.state_of(0, 0)] == fold(after_2, 3)
    memory, ok = kvjax.seq_rm(memory, 0, 1, -1)  # deeper than what is kept: refused
    assert not bool(ok) and not ref.seq_rm(0, 1, -1)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), n_states=st.sampled_from([1, 3]), pad=st.integers(0, 2))
def test_a_placement_moves_a_bounded_number_of_rows(data, n_states, pad):
    """In a memory with more cells than the bound, every placement (padded ubatches too) moves at
    most ``moving_rows_bound`` rows (``place`` checks it) and still agrees with the reference."""
    run_program(data.draw(programs(6, 12)), 12, 6, n_states, jitted=False, pad=pad)


@pytest.mark.parametrize(
    "layers, rows, size",
    [
        (1, [2], 4),
        (1, [0, 3], 4),
        (3, [2], 4),
        (3, [1, 4, 0], 4),
        (2, [4], 4),
        (2, [0], 1),
        (2, [1, 0], 1),
        (1, [1], 1),
        (2, [0, 1], 1),
    ],
)
def test_row_gather_and_scatter_are_per_layer_and_drop_out_of_range_rows(layers, rows, size):
    """``take_rows`` / ``set_rows`` index the buffer as ``[Lg * R, ...]``: row ``R`` (dropped)
    must not land in the next layer's row 0, nor a write in another layer; a one-row buffer
    (``size`` 1) is read and replaced whole."""
    x = jnp.arange(layers * size * 2, dtype=jnp.float32).reshape(layers, size, 2)
    idx = jnp.asarray(rows, jnp.int32)
    valid = [r for r in rows if r < size]
    np.testing.assert_array_equal(take_rows(x, jnp.asarray(valid, jnp.int32)), np.asarray(x)[:, valid])
    values = -1.0 - jnp.arange(layers * len(rows) * 2, dtype=jnp.float32).reshape(layers, len(rows), 2)
    want = np.asarray(x).copy()
    for i, r in enumerate(rows):
        if r < size:
            want[:, r] = np.asarray(values)[:, i]
    np.testing.assert_array_equal(set_rows(x, idx, values), want)
    np.testing.assert_array_equal(jax.jit(set_rows)(x, idx, values), want)


def test_row_gather_and_scatter_trace_for_buffers_past_int32_rows():
    """A buffer of 2**31 rows or more (all layers together) is indexed per layer, not flat: flat
    int32 indices would overflow (shapes only: such a buffer does not fit in memory here)."""
    x = jax.ShapeDtypeStruct((129, 2**24, 1), jnp.float32)
    rows = jax.ShapeDtypeStruct((3,), jnp.int32)
    assert jax.eval_shape(take_rows, x, rows).shape == (129, 3, 1)
    assert jax.eval_shape(set_rows, x, rows, jax.ShapeDtypeStruct((129, 3, 1), jnp.float32)).shape == x.shape


def test_a_rolled_back_cell_outside_the_ubatch_keeps_its_roll():
    """A cell in the placement's range that no slot uses moves whole and keeps its ``roll``;
    applying it there (the rule before) made the rows a placement moves unbounded."""
    memory, ref, rows = kvjax.init(config(4, 4, n_states=2)), RecurrentRef(4, 4, 2), {}
    memory, rows = place(memory, ref, rows, [([0, 1], [s]) for s in range(4)])  # seq s in cell s
    memory, ok = kvjax.seq_rm(memory, 2, 1, -1)
    assert bool(ok) and ref.seq_rm(2, 1, -1) and int(memory.cells.roll[2]) == 1
    before = np.asarray(memory.k[0])[:, 4:6]
    memory, rows = place(memory, ref, rows, [([2], [0]), ([2], [3])])  # cells 0..3, seq 3 to cell 1
    assert int(memory.cells.roll[2]) == 1 and ref.cells[2].roll == 1
    np.testing.assert_array_equal(np.asarray(memory.k[0])[:, 4:6], before)  # cell 2's rows untouched
    memory, rows = place(memory, ref, rows, [([1], [2])])  # seq 2 continues after 0
    assert rows[ref.state_of(2, 0)] == fold(fold(0.0, 0), 1)  # the state after 0, then 1
    assert float(np.asarray(memory.k[0])[0, ref.tail[2] * 2, 0]) == fold(fold(0.0, 0), 1)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(size=0), r"size=0 is out of range"),
        (dict(n_seq_max=0), r"n_seq_max=0 is out of range"),
        (dict(n_layer=10**9), r"n_layer=1000000000 is out of range"),
        (dict(k_shape=(0, 3)), r"k_shape=\(0, 3\) is out of range"),
        (dict(v_shape=((2,), (3,))), r"v_shape has 2 shapes: allowed one shape, or one per layer \(n_layer=3\)"),
        (dict(k_dtype="q8_0"), r"k_dtype='q8_0' is out of range"),
        (dict(n_states=0), r"n_states=0 is out of range"),
        (dict(k_shape=(2**20, 2**20)), r"k_shape=.* is out of range"),
    ],
)
def test_bad_config_names_the_argument(kwargs, match):
    base = dict(size=2, n_seq_max=2, n_layer=3, k_shape=(2,), v_shape=(3,))
    with pytest.raises(ValueError, match=match):
        kvjax.RecurrentConfig(**{**base, **kwargs})


@pytest.mark.parametrize(
    "make_ubatch, match",
    [
        (lambda: kvjax.make_ubatch([0, 1], [[0], [0]]), r"not an equal split"),
        (
            lambda: kvjax.make_equal_ubatch([([0], [0]), ([0], [1]), ([0], [2]), ([0], [3]), ([0], [4])], n_slots=8),
            r"5 sequences: allowed at most size=4",
        ),
        (lambda: kvjax.make_equal_ubatch([([0], [9])]), r"seq id 9 is out of range"),
    ],
)
def test_bad_ubatch_raises_and_changes_nothing(make_ubatch, match):
    memory = kvjax.init(config(4, 8))
    memory, _, _ = kvjax.find_slot(memory, kvjax.make_equal_ubatch([([0, 1], [0])]))
    before = jax.device_get(memory)
    with pytest.raises(ValueError, match=match):
        kvjax.find_slot(memory, make_ubatch())
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(memory))))


@pytest.mark.parametrize(
    "slots, match",
    [
        ([([0, 1], [0]), ([0], [1])], r"same positive count"),
        ([([0], [0]), ([0], [0, 1])], r"seq id 0 is in two slots"),
        ([], r"non-empty list"),
        ([([0], [])], r"no seq ids"),
    ],
)
def test_make_equal_ubatch_refuses(slots, match):
    with pytest.raises(ValueError, match=match):
        kvjax.make_equal_ubatch(slots)


def test_traced_bad_ubatch_is_refused_with_an_error_bit():
    memory = kvjax.init(config(4, 4))
    ub = kvjax.make_equal_ubatch([([0], [0]), ([0], [1])])
    bad = ub.replace(seq_ids=np.where(ub.seq_ids == 1, 0, ub.seq_ids))  # one id in two slots
    new, placement, ok = _FIND_SLOT(memory, bad)
    assert not bool(ok) and int(placement.n_seqs) == 0
    assert kvjax.errors(new) and int(kvjax.used_cells(new)) == 0


def test_what_a_recurrent_memory_cannot_do():
    memory = kvjax.init(config())
    assert not kvjax.can_shift(memory) and memory.n_parts == 0 and memory.max_context is None
    with pytest.raises(kvjax.NotDefinedError, match="has no attention"):
        memory.layer_part(0)
    with pytest.raises(kvjax.NotDefinedError, match="view is not defined for RecurrentCache"):
        kvjax.view(memory, 0, 32)


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), size=st.sampled_from([1, 2, 3, 4, 6]), n_states=st.sampled_from([1, 2, 4]))
def test_lock_step_with_the_reference_long(data, size, n_states):
    """The long run of the lock-step property (``-m slow``)."""
    run_program(data.draw(programs(5, size)), size, 5, n_states, jitted=False)


@pytest.mark.parametrize(
    "weird",
    [
        None,
        "3",
        1.5,
        float("nan"),
        True,
        -1,
        0,
        2**63,
        [],
        [[0]],
        {},
        object(),
        b"\x00",
        [([0.5], [0])],
        [([0], [1.5])],
        [([-1], [0])],
        [([0], [-2])],
        [([0], [0], [1])],
        [("a", [0])],
        np.array([1, 2]),
    ],
)
def test_make_equal_ubatch_gets_weird_values_and_raises_a_value_error(weird):
    with pytest.raises(ValueError):
        kvjax.make_equal_ubatch(weird)
    if weird is not None:  # None is the default slot count
        with pytest.raises(ValueError):
            kvjax.make_equal_ubatch([([0], [0])], n_slots=weird)


def test_the_model_refuses_a_memory_it_cannot_use():
    from flax import nnx
    from kvjax.nn import Mamba, MambaConfig, make_step

    cfg = MambaConfig(vocab_size=16, d_model=8, n_layer=1, d_state=2)
    step, model = make_step(Mamba(cfg, rngs=nnx.Rngs(0))), Mamba(cfg, rngs=nnx.Rngs(0))
    ub = kvjax.make_equal_ubatch([([0], [0])], n_slots=1)
    other = kvjax.init(MambaConfig(vocab_size=16, d_model=8, n_layer=2, d_state=2).memory_config(1))
    with pytest.raises(ValueError, match="allowed this model's 1 layers"):
        step(nnx.state(model), other, ub, np.array([1]), windows=())
    unified = kvjax.init(kvjax.CacheConfig(size=16, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=4, padding=16))
    with pytest.raises(ValueError, match="must be a kvjax.RecurrentCache"):
        step(nnx.state(model), unified, kvjax.make_ubatch([0], [[0]]), np.array([1]), windows=(16,))
