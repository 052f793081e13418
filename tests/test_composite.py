"""The composite memories' one refusal rule, checked for every composite.

``kvjax/memory/_composite.py`` states it: a refused all-or-nothing operation (``seq_rm``,
``seq_add``, ``find_slot``) returns the memory passed in except its sticky error bits, which are
the members' new ones. Here every composite (the iSWA pair, the hybrid over a unified cache, the
hybrid over an iSWA pair) is refused in each way it can be, eagerly and under ``jit``, and every
leaf is compared: the metadata and buffers equal the old ones, and the error bits equal what the
members' own operations raised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax.memory._composite import Composite

ATTN = kvjax.CacheConfig(
    size=32,
    n_seq_max=2,
    n_layer=3,
    n_kv_heads=1,
    head_dim=4,
    padding=16,
    layer_filter=(1, 2),
    rope=kvjax.RopeConfig(n_rot=4),
)
REC = kvjax.RecurrentConfig(size=2, n_seq_max=2, n_layer=1, k_shape=(4, 3), v_shape=(4, 2), n_states=1)
ISWA_BASE = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=4, padding=16)

COMPOSITES = {
    "iswa": kvjax.IswaConfig(ISWA_BASE, swa_layers=(0,), n_swa=4, n_batch=8),
    "hybrid": kvjax.HybridConfig(ATTN, REC, recurrent_layers=(0,)),
    "hybrid-iswa": kvjax.HybridConfig(
        kvjax.IswaConfig(ATTN, swa_layers=(1,), n_swa=4, n_batch=8), REC, recurrent_layers=(0,)
    ),
}


def filled(config):
    """A memory holding sequence 0 at positions 0..5 (equal splits for the hybrids)."""
    memory = kvjax.init(config)
    ubatch = (
        kvjax.make_equal_ubatch([(list(range(6)), [0])])
        if memory.ubatch_split == "equal"
        else kvjax.make_ubatch(range(6), [[0]] * 6)
    )
    memory, _, ok = kvjax.find_slot(memory, ubatch)
    assert bool(ok)
    return kvjax.commit(memory, [ubatch])


def assert_refused(before, after, expected_bits):
    """``after`` equals ``before`` leaf for leaf, but for the error words; its bits are ``expected_bits``."""

    def no_errors(memory):
        return jax.tree_util.tree_map_with_path(
            lambda path, x: None if getattr(path[-1], "name", None) == "error" else np.asarray(x), memory
        )

    jax.tree.map(np.testing.assert_array_equal, no_errors(before), no_errors(after))
    assert int(after.error_bits()) == int(expected_bits)


def members_bits(memory, op):
    """The or of the error bits each member's own ``op`` raises."""
    bits = 0
    for member in memory.members:
        out = op(member)
        bits |= int((out[0] if isinstance(out, tuple) else out).error_bits())
    return bits


@pytest.fixture(params=sorted(COMPOSITES), ids=str)
def memory(request):
    m = filled(COMPOSITES[request.param])
    assert isinstance(m, Composite)
    return m


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_traced_bad_sequence_id_changes_nothing_but_the_members_bits(memory, jitted):
    def remove(m, seq):
        return m.seq_rm(seq, jnp.int32(0), jnp.int32(-1))

    run = jax.jit(remove) if jitted else remove
    after, ok = run(memory, jnp.int32(7))
    # a unified cache makes a bad traced id a no-op (ok, with an error bit); a state refuses it
    assert bool(ok) == all(bool(m.seq_rm(jnp.int32(7), jnp.int32(0), jnp.int32(-1))[1]) for m in memory.members)
    expected = members_bits(memory, lambda m: m.seq_rm(jnp.int32(7), jnp.int32(0), jnp.int32(-1)))
    assert expected & int(kvjax.ErrorFlag.SEQ_ID)
    assert_refused(memory, after, expected)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_ubatch_one_member_cannot_place_changes_no_member(memory, jitted):
    # a new sequence with one token more than the smallest attention part has cells: that part (the
    # window cache, or the hybrid's attention) refuses, the others could take it
    n = min(memory.part(i).config.size for i in range(memory.n_parts)) + 1
    if memory.ubatch_split == "equal":
        ubatch = kvjax.make_equal_ubatch([(list(range(n)), [1])])
    else:
        ubatch = kvjax.make_ubatch(range(n), [[1]] * n)
    accepted = [bool(m.find_slot(ubatch)[2]) for m in memory.members]
    assert not all(accepted) and any(accepted)

    def place(m, ub):
        return m.find_slot(ub)

    run = jax.jit(place) if jitted else place
    after, placement, ok = run(memory, ubatch)
    assert not bool(ok)
    assert_refused(memory, after, members_bits(memory, lambda m: m.find_slot(ubatch)[0]))
    for p in range(memory.n_parts):  # a refused ubatch writes nowhere
        assert (np.asarray(memory.part_slots(placement, p)) == -1).all()


def test_a_shift_one_member_refuses_moves_no_member():
    memory = filled(COMPOSITES["hybrid"])
    # the recurrent state would go below position 0; the attention cells could move, and do not
    args = (jnp.int32(0), jnp.int32(0), jnp.int32(-1), jnp.int32(-20))
    assert not bool(memory.shift_keeps_states(*args))
    after = jax.jit(lambda m: m.seq_add(*args))(memory)
    assert_refused(memory, after, members_bits(memory, lambda m: m.seq_add(*args)))
    # an accepted shift moves both
    ok_args = (jnp.int32(0), jnp.int32(0), jnp.int32(-1), jnp.int32(3))
    moved = memory.seq_add(*ok_args)
    assert int(moved.attention.seq_pos_max(jnp.int32(0))) == 8
    assert int(moved.recurrent.seq_pos_max(jnp.int32(0))) == 8


def test_a_partial_removal_the_recurrent_member_refuses_keeps_every_cell(memory):
    after, ok = memory.seq_rm(jnp.int32(0), jnp.int32(2), jnp.int32(-1))
    has_state = any(isinstance(m, kvjax.RecurrentCache) for m in memory.members)
    assert bool(ok) != has_state  # a window or unified cache removes a tail; a state cannot
    if has_state:
        assert_refused(
            memory, after, members_bits(memory, lambda m: m.seq_rm(jnp.int32(0), jnp.int32(2), jnp.int32(-1)))
        )


def test_every_composite_routes_its_queries_to_its_members(memory):
    members = memory.members
    assert memory.n_parts == sum(m.n_parts for m in members)
    assert memory.nbytes() == sum(m.nbytes() for m in members)
    assert int(memory.used_cells()) == int(getattr(memory, memory.MAIN).used_cells())
    want = max(int(getattr(memory, name).seq_pos_min(jnp.int32(0))) for name in memory.POSITIONS)
    assert int(memory.seq_pos_min(jnp.int32(0))) == want
    parts = [m.part(i) for m in members for i in range(m.n_parts)]
    for i, part in enumerate(parts):
        assert memory.part(i) is part
    np.testing.assert_array_equal(memory.extent(), np.concatenate([m.extent() for m in members]))
    blob = kvjax.state_write(memory)
    assert blob == b"".join(kvjax.state_write(m) for m in members)
    assert memory.blob_size(blob + b"tail") == len(blob)
