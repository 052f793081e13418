"""Suite-wide fixtures.

Every compiled XLA:CPU program keeps its own memory mappings until it is freed, and a single
pytest process compiles thousands of programs: without freeing them the process passes Linux's
``vm.max_map_count`` (65,530 by default) late in the suite and LLVM dies with a segmentation fault
inside a compile. Dropping JAX's compilation caches after each test module frees the programs
that module compiled; the next module compiles its own (the no-recompile tests count within one
test, so they are unaffected).
"""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
