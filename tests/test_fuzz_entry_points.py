"""Every public entry point, called with values a careless or hostile caller might pass.

Each call either succeeds or raises one of kvjax's errors (``ValueError`` and its subclasses
``StateError``, ``CacheFullError``'s sibling ``NotDefinedError``) whose message names an argument;
never a ``TypeError``, ``AttributeError``, ``IndexError`` or a JAX internal. The memory passed in
is never changed (every leaf compared).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvjax
from tests.helpers import fill

CFG = kvjax.CacheConfig(
    size=32, n_seq_max=3, n_layer=2, n_kv_heads=1, head_dim=4, padding=16, rope=kvjax.RopeConfig(n_rot=4)
)
ISWA = kvjax.IswaConfig(CFG.replace(size=64), swa_layers=(1,), n_swa=4, n_batch=16)
RECURRENT = kvjax.RecurrentConfig(size=3, n_seq_max=3, n_layer=2, k_shape=(3, 4), v_shape=(4, 2), n_states=2)

WEIRD = [
    None,
    "3",
    "False",
    1.5,
    float("nan"),
    float("inf"),
    True,
    False,
    -1,
    0,
    1,
    2,
    7,
    -(2**31),
    2**31,
    2**63,
    np.uint64(2**64 - 1),
    np.int64(-(2**40)),
    np.float32(1.0),
    np.array([1, 2]),
    jnp.array([[1]]),
    [],
    [[0]],
    {},
    object(),
    b"\x00\x01",
    jnp.ones((1, 1, 4)),
    jnp.int32(1),
]

# name -> call(memory, *args); how many extra arguments each takes (drawn from WEIRD)
ENTRY_POINTS = {
    "clear": (kvjax.clear, 0),
    "seq_rm": (kvjax.seq_rm, 3),
    "seq_cp": (kvjax.seq_cp, 4),
    "seq_keep": (kvjax.seq_keep, 1),
    "seq_add": (kvjax.seq_add, 4),
    "seq_div": (kvjax.seq_div, 4),
    "seq_pos_min": (kvjax.seq_pos_min, 1),
    "seq_pos_max": (kvjax.seq_pos_max, 1),
    "pos_max": (kvjax.pos_max, 0),
    "n_tokens": (kvjax.n_tokens, 0),
    "used_cells": (kvjax.used_cells, 0),
    "cell_max": (kvjax.cell_max, 0),
    "n_kv": (kvjax.n_kv, 0),
    "has_shift": (kvjax.has_shift, 0),
    "find_slot": (kvjax.find_slot, 1),
    "prepare": (kvjax.prepare, 1),
    "commit": (kvjax.commit, 1),
    "write": (kvjax.write, 4),
    "view": (kvjax.view, 2),
    "kq_mask": (kvjax.kq_mask, 2),
    "kq_mask_bool": (kvjax.kq_mask_bool, 2),
    "pos_bucket": (kvjax.pos_bucket, 3),
    "k_shift": (kvjax.k_shift, 0),
    "update": (kvjax.update, 0),
    "attention": (kvjax.attention, 3),
    "kv_window": (kvjax.kv_window, 0),
    "fragmentation": (kvjax.fragmentation, 0),
    "defrag_sched": (kvjax.defrag_sched, 1),
    "defrag": (kvjax.defrag, 1),
    "compact": (kvjax.compact, 0),
    "compact_seq": (kvjax.compact_seq, 1),
    "state_write": (kvjax.state_write, 1),
    "state_read": (kvjax.state_read, 2),
    "cell_table": (kvjax.cell_table, 0),
    "cell_map": (kvjax.cell_map, 1),
    "errors": (kvjax.errors, 0),
    "check": (kvjax.check, 0),
    "clear_errors": (kvjax.clear_errors, 0),
    "can_shift": (kvjax.can_shift, 0),
}

KVJAX_ERRORS = (ValueError,)  # StateError and NotDefinedError are ValueErrors

_UB = kvjax.make_ubatch([5], [[0]])
#: good extra arguments of each entry point (the others take none)
VALID = {
    "seq_rm": [0, 0, -1],
    "seq_cp": [0, 1, 0, -1],
    "seq_keep": [0],
    "seq_add": [0, 0, -1, 1],
    "seq_div": [0, 0, -1, 2],
    "seq_pos_min": [0],
    "seq_pos_max": [0],
    "find_slot": [_UB],
    "prepare": [[_UB]],
    "commit": [[_UB]],
    "write": [0, jnp.array([3]), jnp.ones((1, 1, 4)), jnp.ones((1, 1, 4))],
    "view": [0, 16],
    "kq_mask": [_UB, 16],
    "kq_mask_bool": [_UB, 16],
    "pos_bucket": [_UB, 16, 8],
    "attention": [jnp.ones((1, 2, 4)), 0, jnp.zeros((1, 16))],
    "defrag_sched": [0.1],
    "defrag": [None],
    "compact_seq": [0],
    "state_write": [-1],
    "state_read": [b"", -1],
    "cell_map": [64],
}


def _memories():
    unified = fill(kvjax.init(CFG), [0, 1, 2, 0, 1], [[0], [0], [0], [1], [1, 2]])
    iswa, _, _ = kvjax.find_slot(kvjax.init(ISWA), kvjax.make_ubatch(range(6), [[0]] * 6))
    recurrent, _, _ = kvjax.find_slot(kvjax.init(RECURRENT), kvjax.make_equal_ubatch([([0, 1], [0]), ([0, 1], [1, 2])]))
    return {"unified": unified, "iswa": iswa, "recurrent": recurrent}


MEMORIES = _memories()


def _snapshot(memory):
    return [np.asarray(x).copy() for x in jax.tree.leaves(memory)]


def _argument_names(fn):
    return [p for p in inspect.signature(fn).parameters]


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("kind", sorted(MEMORIES))
def test_each_argument_alone(name, kind):
    """Every argument in turn takes every weird value while the others stay good."""
    fn, n_args = ENTRY_POINTS[name]
    memory = MEMORIES[kind]
    before = _snapshot(memory)
    for i in range(n_args):
        for weird in WEIRD:
            args = list(VALID.get(name, []))
            args[i] = weird
            try:
                fn(memory, *args)
            except KVJAX_ERRORS:
                pass
    after = _snapshot(memory)
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(ENTRY_POINTS)), kind=st.sampled_from(sorted(MEMORIES)), data=st.data())
def test_weird_arguments_get_a_kvjax_error_and_change_nothing(name, kind, data):
    fn, n_args = ENTRY_POINTS[name]
    memory = MEMORIES[kind]
    args = [data.draw(st.sampled_from(WEIRD), label=f"arg{i}") for i in range(n_args)]
    before = _snapshot(memory)
    try:
        fn(memory, *args)
    except KVJAX_ERRORS as exc:
        message = str(exc)
        names = _argument_names(fn) + [
            "ubatch",
            "mask",
            "slot",
            "layer",
            "data",
            "seq_id",
            "cell_count",
            "blob",
            "not defined",
            "cache",
            "memory",
            "rows",
            "n_kv",
            "q",
            "k",
            "v",
            "tokens",
        ]
        assert any(n in message for n in names), f"{name}: {message!r} names no argument"
    # anything else (TypeError, AttributeError, IndexError, a JAX error) fails the test here
    after = _snapshot(memory)
    assert len(before) == len(after) and all(np.array_equal(a, b, equal_nan=True) for a, b in zip(before, after))


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_not_a_memory(name):
    fn, n_args = ENTRY_POINTS[name]
    for junk in (None, CFG, {"k": 1}, MEMORIES["unified"].cells):
        with pytest.raises(ValueError, match=r"must be a kvjax"):
            fn(junk, *VALID.get(name, []))


EDGE_INTS = [-(2**31), -2, -1, 0, 1, 2, 3, 31, 32, 2**31 - 2, 2**31 - 1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(["seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min", "seq_pos_max"]),
    kind=st.sampled_from(sorted(MEMORIES)),
    data=st.data(),
)
def test_traced_edge_integers_are_noops_with_an_error_bit_or_correct(name, kind, data):
    """Under jit every argument is traced: a bad value makes the op a no-op that sets an error bit, never
    a change elsewhere; a good value gives what the eager call gives."""
    fn, n_args = ENTRY_POINTS[name]
    memory = MEMORIES[kind]
    args = [np.int32(data.draw(st.sampled_from(EDGE_INTS), label=f"arg{i}")) for i in range(n_args)]
    traced = _JITTED[name](memory, *args)
    try:
        eager = fn(memory, *args)
    except ValueError:  # refused eagerly: under jit a no-op plus an error bit
        if name.startswith("seq_pos"):
            assert int(traced) == -1
            return
        out = traced[0] if name == "seq_rm" else traced
        assert kvjax.errors(out), f"{name}{tuple(args)}: no error bit"
        same = lambda a, b: all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
        assert same(kvjax.clear_errors(out), kvjax.clear_errors(memory)), f"{name}{tuple(args)} changed the memory"
        return
    for x, y in zip(jax.tree.leaves(eager), jax.tree.leaves(traced)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


_JITTED = {
    name: jax.jit(ENTRY_POINTS[name][0])
    for name in ("seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "seq_pos_min", "seq_pos_max")
}
