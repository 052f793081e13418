"""kvjax against the pure-Python seed model, cell by cell, after every step of random op sequences.

Each scenario is a cache configuration and a list of valid operations (every sequence op with
random ids, ``-1`` where it is allowed, negative and empty ranges, shifts below zero, divisors
1..4, ubatches of 0..8 tokens that may belong to several sequences and may not fit, both
placement policies). The scenario runs in lock step through

- the reference model (``tests/reference/unified.py``),
- the eager public API (``kvjax.seq_rm(cache, ...)`` with Python ints), and
- the same public ops wrapped in ``jax.jit`` (every argument traced),

and after every step the two caches must equal the reference exactly: every cell's position,
sequence set and pending delta, the head, the used count, the error word (no bits: every op is
valid), the result of ``find_slot`` (slots and ok) and every query. Every scenario also runs
inside a compile counter after a per-configuration warm-up: new argument values never compile.

Invalid arguments are tested in ``tests/test_cells_errors.py``.
"""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvjax
from tests.helpers import CompileCounter, assert_cells_match
from kvjax.testing._unified_reference import UnifiedRef

#: Static shape of every ubatch: 8 rows, at most 3 sequence ids per token (one compilation).
LENGTH, WIDTH = 8, 3

#: Cache configurations (size, padding, n_seq_max); the last has a 2-word sequence bitmask.
CONFIGS = [(16, 8, 3), (32, 16, 4), (64, 16, 5), (48, 16, 40)]


def seq_pool(n_seq_max):
    """The sequence ids a scenario uses: all of them, or both sides of the 32-bit word edge."""
    return list(range(n_seq_max)) if n_seq_max <= 5 else [0, 1, 5, 31, 32, 33, 39]


def make_config(index):
    size, padding, n_seq_max = CONFIGS[index]
    return kvjax.CacheConfig(size=size, n_seq_max=n_seq_max, n_layer=1, n_kv_heads=1, head_dim=4, padding=padding)


EAGER = types.SimpleNamespace(
    clear=kvjax.clear,
    seq_rm=kvjax.seq_rm,
    seq_cp=kvjax.seq_cp,
    seq_keep=kvjax.seq_keep,
    seq_add=kvjax.seq_add,
    seq_div=kvjax.seq_div,
    find_slot=kvjax.find_slot,
    seq_pos_min=kvjax.seq_pos_min,
    seq_pos_max=kvjax.seq_pos_max,
    pos_max=kvjax.pos_max,
    n_tokens=kvjax.n_tokens,
    used_cells=kvjax.used_cells,
    cell_max=kvjax.cell_max,
    n_kv=kvjax.n_kv,
    has_shift=kvjax.has_shift,
)
JITTED = types.SimpleNamespace(
    **{
        name: (jax.jit(fn, static_argnames="contiguous") if name == "find_slot" else jax.jit(fn))
        for name, fn in vars(EAGER).items()
    }
)


# -- scenarios ----------------------------------------------------------------------------------

# find_slot first (shrinking moves towards the first kind) and most often: it fills the cache
KINDS = ["find_slot"] * 5 + ["seq_rm"] * 2 + ["seq_add"] * 2 + ["seq_div"] * 2 + ["seq_cp", "seq_keep", "clear"]
POS = st.integers(-3, 40)


@st.composite
def operation(draw, n_seq_max):
    pool = seq_pool(n_seq_max)
    seq, seq_or_all = st.sampled_from(pool), st.sampled_from([-1] + pool)
    kind = draw(st.sampled_from(KINDS))
    if kind == "clear":
        return ("clear",)
    if kind == "find_slot":
        token = st.tuples(st.integers(0, 40), st.lists(seq, min_size=1, max_size=WIDTH, unique=True))
        return ("find_slot", draw(st.lists(token, max_size=LENGTH)), draw(st.booleans()))
    if kind == "seq_keep":
        return ("seq_keep", draw(seq_or_all))
    if kind == "seq_cp":
        return ("seq_cp", draw(seq), draw(seq), draw(POS), draw(POS))
    args = (draw(seq_or_all), draw(POS), draw(POS))
    if kind == "seq_rm":
        return ("seq_rm",) + args
    if kind == "seq_add":
        return ("seq_add",) + args + (draw(st.integers(-12, 12)),)
    return ("seq_div",) + args + (draw(st.integers(1, 4)),)


@st.composite
def scenario(draw, max_ops=60):
    index = draw(st.sampled_from(range(len(CONFIGS))))
    ops = draw(st.lists(operation(CONFIGS[index][2]), min_size=10, max_size=max_ops))
    return index, ops


def run_of(seq, start, n, step=1):
    """``n`` tokens of one sequence at positions start, start + step, ..."""
    return [(start + i * step, [seq]) for i in range(n)]


# Hand-made scenarios that reach the tricky paths every run (test_examples_reach_* checks it).
RESET = (
    2,
    [("find_slot", [(p, [p % 2]) for p in range(s, s + 8)], True) for s in range(0, 40, 8)]
    + [
        ("seq_rm", 1, -1, -1),
        ("find_slot", run_of(0, 40, 8), True),
        ("find_slot", run_of(1, 48, 1), True),
        ("find_slot", run_of(2, 49, 2), False),
    ],
)
WRAP = (
    0,
    [
        ("find_slot", run_of(1, 0, 3), True),
        ("find_slot", [(10, [0]), (11, [0]), (12, [0]), (0, [2]), (13, [0])], True),
        ("seq_rm", 1, -1, -1),
        ("seq_add", 2, 0, -1, -1),
        ("find_slot", run_of(1, 20, 2), True),
        ("find_slot", run_of(2, 30, 8), True),
        ("find_slot", run_of(2, 30, 3), False),
        ("seq_add", -1, 3, 25, -15),
        ("find_slot", run_of(0, 1, 8), False),
    ],
)
FULL = (
    1,
    [("find_slot", [(p, [p % 4, (p + 1) % 4]) for p in range(s, s + 8)], s % 16 == 0) for s in range(0, 40, 8)]
    + [
        ("seq_keep", 2),
        ("seq_div", -1, 2, -1, 3),
        ("find_slot", run_of(3, 0, 8), True),
        ("seq_cp", 3, 1, 0, 5),
        ("seq_add", 1, -1, 3, -2),
        ("find_slot", run_of(0, 9, 7), False),
    ],
)
TWO_WORDS = (
    3,
    [
        ("find_slot", [(0, [31, 32]), (1, [33]), (2, [39, 0, 1]), (3, [32])], True),
        ("seq_cp", 32, 5, -1, -1),
        ("seq_rm", 31, 0, 1),
        ("seq_add", 32, 0, 4, -1),
        ("seq_keep", 5),
        ("find_slot", run_of(39, 7, 8), False),
        ("seq_rm", -1, 7, 9),
    ],
)
EXAMPLES = [RESET, WRAP, FULL, TWO_WORDS]


# -- running and comparing ----------------------------------------------------------------------


def ubatch_of(tokens):
    """The tokens as a ubatch of the fixed bucket ``[LENGTH]`` with ``WIDTH`` id columns."""
    ub = kvjax.make_ubatch([p for p, _ in tokens], [s for _, s in tokens], length=LENGTH)
    ids = np.full((LENGTH, WIDTH), -1, np.int32)
    narrow = np.asarray(ub.seq_ids)
    ids[:, : narrow.shape[1]] = narrow
    return ub.replace(seq_ids=ids)


def apply_ref(ref, op):
    kind, *args = op
    if kind == "find_slot":
        tokens, contiguous = args
        slots, ok = ref.find_slot(tokens, contiguous)
        return slots + [-1] * (LENGTH - len(slots)), ok
    getattr(ref, kind)(*args)
    return None


def apply_kvjax(api, cache, op, ubatch):
    kind, *args = op
    if kind == "find_slot":
        cache, slot, ok = api.find_slot(cache, ubatch, contiguous=args[1])
        return cache, (np.asarray(slot).tolist(), bool(ok))
    if kind == "seq_rm":
        cache, ok = api.seq_rm(cache, *args)
        assert bool(ok), "the unified cache never refuses a seq_rm"
        return cache, None
    return getattr(api, kind)(cache, *args), None


def assert_same(ref, cache, api, pool):
    """Every cell, the head, the used count, the error word and every query equal the model's."""
    assert_cells_match(cache, ref)
    assert kvjax.errors(cache) == [], "error bits"
    got = {
        name: int(getattr(api, name)(cache))
        for name in ("used_cells", "pos_max", "n_tokens", "cell_max", "n_kv", "has_shift")
    }
    want = dict(
        used_cells=ref.used,
        pos_max=ref.pos_max(),
        n_tokens=ref.n_tokens(),
        cell_max=ref.cell_max(),
        n_kv=ref.n_kv(),
        has_shift=int(any(c.delta for c in ref.cells)),
    )
    for s in [-1] + pool:
        got[f"seq_pos_min({s})"] = int(api.seq_pos_min(cache, s))
        got[f"seq_pos_max({s})"] = int(api.seq_pos_max(cache, s))
        want[f"seq_pos_min({s})"], want[f"seq_pos_max({s})"] = ref.seq_pos_min(s), ref.seq_pos_max(s)
    assert got == want, "queries"


def run_scenario(index, ops):
    """Run ``ops`` through the model, the eager API and the jitted API; compare after each step."""
    config = make_config(index)
    pool = seq_pool(config.n_seq_max)
    ref = UnifiedRef(config.size, config.n_seq_max, config.padding)
    caches = {"eager": kvjax.init(config), "jitted": kvjax.init(config)}
    apis = {"eager": EAGER, "jitted": JITTED}
    for step, op in enumerate(ops):
        expected = apply_ref(ref, op)
        ref.check_invariants()
        ubatch = ubatch_of(op[1]) if op[0] == "find_slot" else None
        for name, api in apis.items():
            caches[name], result = apply_kvjax(api, caches[name], op, ubatch)
            try:
                assert result == expected, f"find_slot result {result} != {expected}"
                assert_same(ref, caches[name], api, pool)
            except AssertionError as err:  # say where, only when it fails (a cell map is slow)
                raise AssertionError(
                    f"{name} API after step {step} {op}: {err}\n{kvjax.cell_map(caches[name])}"
                ) from None
    return ref


_WARM = set()


def warm_up(index):
    """Compile everything a scenario of this configuration uses (once per configuration)."""
    if index in _WARM:
        return
    pool = seq_pool(CONFIGS[index][2])
    a, b = pool[0], pool[-1]
    run_scenario(
        index,
        [
            ("find_slot", [(0, [a]), (1, [a, b])], True),
            ("find_slot", [(2, [b])], False),
            ("seq_cp", a, b, 0, 1),
            ("seq_rm", a, 0, 1),
            ("seq_keep", b),
            ("seq_add", -1, 0, -1, 1),
            ("seq_div", b, 0, -1, 2),
            ("clear",),
        ],
    )
    _WARM.add(index)


def check_scenario(case):
    index, ops = case
    warm_up(index)
    with CompileCounter() as counter:
        run_scenario(index, ops)
    assert counter.count == 0, f"{counter.count} compilations for new argument values"


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _with_examples(test):
    for case in EXAMPLES:
        test = example(case)(test)
    return test


@_with_examples
@settings(max_examples=100, **_SETTINGS)
@given(scenario())
def test_random_operation_sequences_match_the_seed_model(case):
    check_scenario(case)


@pytest.mark.slow
@settings(max_examples=2000, **_SETTINGS)
@given(scenario(max_ops=120))
def test_random_operation_sequences_match_the_seed_model_long(case):
    check_scenario(case)


def test_examples_reach_the_tricky_paths():
    """The hand-made examples hit the reset heuristic, the wrap, refusals and a full cache."""
    seen = dict(resets=0, wraps=0, refused=0, full=0, freed_by_shift=0, two_words=0)
    for index, ops in EXAMPLES:
        config = make_config(index)
        ref = UnifiedRef(config.size, config.n_seq_max, config.padding)
        for op in ops:
            used = ref.used
            result = apply_ref(ref, op)
            if op[0] == "find_slot" and not result[1]:
                seen["refused"] += 1
            if op[0] == "seq_add" and ref.used < used:
                seen["freed_by_shift"] += 1
            seen["full"] += ref.used == ref.size
            seen["two_words"] += any(s >= 32 for c in ref.cells for s in c.seqs)
        seen["resets"] += ref.resets
        seen["wraps"] += ref.wraps
    assert all(v > 0 for v in seen.values()), seen
