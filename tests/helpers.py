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


def buffer_writes(step, state, memory, ubatch, tokens, windows=(), of=None) -> dict:
    """How a model step, compiled as users compile it, produces the memory's whole buffers.

    ``of``: the memory, or a part of it (a hybrid's ``recurrent``), whose buffers the
    dynamic-update-slice list looks at; copies are looked for in every buffer.

    Returns ``{"copy": [...], "dynamic-update-slice": [...]}``: the optimized HLO's ``copy``
    instructions of a whole K/V or state buffer (a whole-buffer copy on every call, what an
    in-place test asserts is absent), and its fusions rooted in a dynamic-update-slice of one
    (XLA:CPU computes everything fused into them slowly, see docs/speed.md section 9).
    """
    import re

    from flax import nnx

    buffers, rest = memory.split()
    hlo = (
        step._jitted.lower(
            nnx.state(state) if isinstance(state, nnx.Module) else state,
            rest,
            buffers,
            ubatch,
            tokens,
            None,
            None,
            windows=windows,
        )
        .compile(compiler_options=USER_HLO)
        .as_text()
    )

    def shapes(part):
        return {",".join(str(n) for n in x.shape) for x in jax.tree.leaves(part.split()[0])}

    every, written = shapes(memory), shapes(of or memory)
    found = {"copy": [], "dynamic-update-slice": []}
    for line in hlo.splitlines():
        op = re.match(r"\s*(?:ROOT\s+)?%(\S+) = \w+\[([0-9,]+)\]\S* (copy|fusion)\(", line)
        if op and op.group(3) == "copy" and op.group(2) in every:
            found["copy"].append(line.strip()[:120])
        elif op and "dynamic-update-slice" in op.group(1) and op.group(2) in written:
            found["dynamic-update-slice"].append(line.strip()[:120])
    return found


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


def write_gguf_tensors(w, tensors, kind_of=lambda name, value: None):
    """Add ``tensors`` (name -> float array, numpy order) to the GGUF writer ``w`` and write its file.

    Each tensor goes in the ggml type ``kind_of(name, value)`` gives (a ``gguf.GGMLQuantizationType``,
    quantized with the ``gguf`` package's own quantizers; ``None``: float32). The tests' GGUF
    writers (one per architecture) share this last step.
    """
    import gguf

    for name, value in tensors.items():
        value = np.ascontiguousarray(value, np.float32)
        kind = kind_of(name, value)
        if kind is None:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, gguf.quants.quantize(value, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def numpy_weights(model, seed: int):
    """``model`` with every parameter redrawn by numpy (``0.3 N(0, 1)``, norms around 1), in place.

    The tests' llama.cpp fixtures are files written from such models: numpy's draws do not depend
    on XLA's flags (the suite's differ), so the files come out byte for byte on every machine.
    """
    from flax import nnx

    rng = np.random.default_rng(seed)

    def draw(path, x):
        value = 0.3 * rng.standard_normal(x.shape)
        if "norm" in jax.tree_util.keystr(path):
            value = 1 + value
        return jax.numpy.asarray(value.astype(np.float32))

    nnx.update(model, jax.tree_util.tree_map_with_path(draw, nnx.state(model, nnx.Param)))
    return model
