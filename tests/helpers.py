"""Shared test utilities: a compile counter and small cache factories."""

from __future__ import annotations

import contextlib

import jax
import numpy as np

import kvjax
from kvjax._compiles import CompileCounter  # noqa: F401  (re-exported for the tests)


#: Compile options for tests that read a compiled program's HLO: XLA's default fusion emitters, which
#: the suite turns off to compile faster (tests/conftest.py), so these tests check the program users
#: get. The other suite flag (LLVM at -O0) changes machine code only: the HLO text is the same.
USER_HLO = {"xla_cpu_use_fusion_emitters": True}


def buffer_copies(step, state, memory, ubatch, tokens, windows=()) -> list:
    """The copy instructions of whole memory buffers in a model step compiled as users compile it.

    A step updates the memory's K/V or state buffers in place; a ``copy`` of one in the optimized
    HLO is a whole-buffer copy on every call (what an in-place test asserts is absent).
    """
    import re

    from flax import nnx

    buffers, rest = memory.split()
    hlo = step._jitted.lower(nnx.state(state) if isinstance(state, nnx.Module) else state, rest, buffers,
                             ubatch, tokens, None, None, windows=windows).compile(
                                 compiler_options=USER_HLO).as_text()
    shapes = {",".join(str(n) for n in x.shape) for x in jax.tree.leaves(buffers)}
    copies = []
    for line in hlo.splitlines():
        found = re.match(r"\s*(?:ROOT\s+)?%\S+ = \w+\[([0-9,]+)\]\S* copy\(", line)
        if found and found.group(1) in shapes:
            copies.append(line.strip()[:120])
    return copies


@contextlib.contextmanager
def no_recompile():
    """Assert that the block compiles nothing (run the code once before, to warm up)."""
    with CompileCounter() as counter:
        yield counter
    assert counter.count == 0, f"expected no compilation, got {counter.count}"


def small_config(**overrides) -> kvjax.CacheConfig:
    """A tiny cache config for tests (64 cells, 4 sequences, 2 layers, 2 kv heads, head size 8)."""
    args = dict(size=64, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=8, padding=16)
    args.update(overrides)
    return kvjax.CacheConfig(**args)


def fill(cache, pos, seq_ids, contiguous=True):
    """Place tokens with ``find_slot`` and return the cache (asserting success)."""
    cache, slot, ok = kvjax.find_slot(cache, kvjax.make_ubatch(pos, seq_ids), contiguous=contiguous)
    assert bool(ok)
    return cache


def assert_cells_match(cache, ref) -> None:
    """Every cell of a unified cache (pos, sequence set, pending shift) and its head equal a ``UnifiedRef``'s."""
    table = kvjax.cell_table(cache)
    seqs = np.zeros((ref.size, ref.n_seq_max), bool)
    for i, cell in enumerate(ref.cells):
        seqs[i, sorted(cell.seqs)] = True
    np.testing.assert_array_equal(table.pos, [c.pos for c in ref.cells], err_msg="pos")
    np.testing.assert_array_equal(table.seqs, seqs, err_msg="seqs")
    np.testing.assert_array_equal(table.delta, [c.delta for c in ref.cells], err_msg="delta")
    assert table.head == ref.head, f"head {table.head} != {ref.head}"
