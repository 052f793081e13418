"""Suite-wide fixtures.

Every compiled XLA:CPU program keeps its own memory mappings until it is freed, and a single
pytest process compiles thousands of programs: without freeing them the process passes Linux's
``vm.max_map_count`` (65,530 by default) late in the suite and LLVM dies with a segmentation fault
inside a compile. Dropping JAX's compilation caches after each test module frees the programs
that module compiled; the next module compiles its own (the no-recompile tests count within one
test, so they are unaffected).

The suite runs with 8 virtual CPU devices (``--xla_force_host_platform_device_count=8``, set here
before JAX starts its backend), so ``tests/test_sharding.py`` can place memories on 8x1, 1x8, 2x4
and 4x2 meshes in the test process itself. Every other test runs on the default device, device 0,
as before.
"""

import gc
import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
if _DEVICES_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICES_FLAG}=8".strip()

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()
