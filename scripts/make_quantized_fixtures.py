"""Quantize the tiny float model of tests/test_gguf_weights.py with llama.cpp's own quantizer.

Run once in the benchmark environment (``pip install -e ".[test,llamacpp]"``), never in CI:

    python scripts/make_quantized_fixtures.py

The ``gguf`` package quantizes only the simple types; the K and IQ types are written by
``llama-quantize`` alone. This writes the model of :func:`tests.test_gguf_weights.fixture_model` as
a float32 GGUF, quantizes it with ``llama_model_quantize`` (``pure``: every matrix in the one type)
to each type of :data:`tests.test_gguf_weights.LLAMA_CPP_TYPES`, and keeps the results under
``tests/data/quantized/`` (a few hundred KB each), so that the tests hold kvjax's dequantizers to
blocks with the scales llama.cpp chooses. IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS and IQ2_S need an
importance matrix (IQ3_XXS too, in this llama.cpp), which llama-cpp-python cannot pass: those stay proven on
random blocks only.
"""

from __future__ import annotations

import ctypes
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    import llama_cpp as lc

    from tests.test_gguf_weights import LLAMA_CPP_TYPES, QUANTIZED, fixture_model, write_fixture_f32

    QUANTIZED.mkdir(parents=True, exist_ok=True)
    lc.llama_backend_init()
    with tempfile.TemporaryDirectory() as folder:
        source = write_fixture_f32(pathlib.Path(folder) / "f32.gguf", fixture_model())
        for name, ftype in LLAMA_CPP_TYPES.items():
            params = lc.llama_model_quantize_default_params()
            params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{ftype}")
            params.pure = True
            params.nthread = 2
            out = QUANTIZED / f"tiny-{name}.gguf"
            rc = lc.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {ftype} failed ({rc})")
            print(f"{out.relative_to(ROOT)}: {out.stat().st_size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
