"""A shift never deletes a recurrent state (issue 43, "data lost").

A unified cell pushed below position 0 holds one token and is freed. A recurrent cell holds the
whole sequence so far, and (where several sequences share a prompt) other sequences' state too:
``seq_add`` that would move one below 0 is refused on the recurrent and the hybrid memory with
nothing changed (cells, state rows, the hybrid's attention part): eagerly a ``ValueError`` saying
so, under ``jit`` the op skipped and ``ErrorFlag.STATE_SHIFT`` set; a shift that keeps every state at ``>= 0`` still moves it, and the
sequences continue.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax._errors import ErrorFlag
from tests.helpers import no_recompile

SEQ_ADD = jax.jit(kvjax.seq_add)


def _recurrent():
    return kvjax.init(kvjax.RecurrentConfig(size=6, n_seq_max=6, n_layer=1, k_shape=(2,), v_shape=(3,)))


def _hybrid():
    from kvjax.nn import HybridLMConfig

    cfg = HybridLMConfig(
        vocab_size=20, d_model=16, n_layer=2, recurrent_layers=(1,), n_heads=2, n_kv_heads=1, d_state=4
    )
    return kvjax.init(cfg.memory_config(size=64, n_seq_max=6, padding=16))


MEMORIES = {"recurrent": _recurrent, "hybrid": _hybrid}


def _shared_prompt(memory):
    """A 5-token prompt common to sequences 1, 4 and 5 (one shared state), with random state rows."""
    ub = kvjax.make_equal_ubatch([(list(range(5)), [1, 4, 5])], n_slots=1)
    memory, _, ok = kvjax.find_slot(memory, ub)
    assert bool(ok)
    memory = kvjax.commit(memory, [ub])
    rng = np.random.default_rng(0)
    buffers, rest = memory.split()
    buffers = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), buffers)
    return rest.join(buffers)


def _same(a, b) -> bool:
    return all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(kvjax.clear_errors(a)), jax.tree.leaves(kvjax.clear_errors(b)))
    )


@pytest.mark.parametrize("kind", sorted(MEMORIES))
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_a_shift_below_zero_is_refused_and_every_state_kept(kind, jitted):
    memory = _shared_prompt(MEMORIES[kind]())
    seq_add = SEQ_ADD if jitted else kvjax.seq_add
    for seq_id, p0, delta in ((4, 0, -5), (4, 0, -100), (-1, 0, -6), (1, 2, -7)):
        if not jitted:
            before = jax.device_get(memory)
            with pytest.raises(
                ValueError,
                match=rf"seq_add\(seq_id={seq_id}, p0={p0}, p1=-1, delta={delta}\) was "
                r"refused, the memory is unchanged: seq_add would move a recurrent",
            ):
                seq_add(memory, seq_id, p0, -1, delta)
            assert _same(memory, before)
            continue
        out = seq_add(memory, seq_id, p0, -1, delta)
        assert _same(out, memory), (seq_id, delta)
        assert ErrorFlag.STATE_SHIFT & int(out.error_bits())
        with pytest.raises(ValueError, match="would move a recurrent state below position 0"):
            kvjax.check(out)
        for s in (1, 4, 5):  # every sharer still holds positions 0..4
            assert int(kvjax.seq_pos_max(out, s)) == 4
    # a shift that keeps the state at >= 0 moves it, for the sharers too (one shared state)
    moved = seq_add(memory, 4, 0, -1, -4)
    assert kvjax.errors(moved) == []
    assert [int(kvjax.seq_pos_max(moved, s)) for s in (1, 4, 5)] == [0, 0, 0]


@pytest.mark.parametrize("kind", sorted(MEMORIES))
def test_new_deltas_compile_nothing(kind):
    memory = _shared_prompt(MEMORIES[kind]())
    SEQ_ADD(memory, 4, 0, -1, -9)
    with no_recompile():
        for delta in (-1, -5, 3, -30):
            SEQ_ADD(memory, 4, 0, -1, delta)


def test_the_hybrid_attention_part_is_not_half_shifted():
    """The refused shift leaves the attention cells where they were: on its own the unified part would
    free the shared prompt's cells (a shifted cell moves for every sequence holding it)."""
    memory = _shared_prompt(_hybrid())
    out = SEQ_ADD(memory, 4, 0, -1, -5)
    assert np.array_equal(np.asarray(out.attention.cells.pos), np.asarray(memory.attention.cells.pos))
    unified = kvjax.seq_add(memory.attention, 4, 0, -1, -5)
    assert [int(kvjax.seq_pos_max(unified, s)) for s in (1, 4, 5)] == [-1, -1, -1]
    # a shift the state survives moves both parts: the attention cells pushed below 0 are freed
    moved = kvjax.seq_add(memory, 4, 0, -1, -3)
    assert int(kvjax.used_cells(moved.attention)) == 2 and int(kvjax.seq_pos_max(moved.recurrent, 4)) == 1
