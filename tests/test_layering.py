"""The architecture, checked: the driver, the step and the layers use only the memory protocol.

Above the protocol (``kvjax/engine/``, ``kvjax/nn/``) a module may import the public ``kvjax``
names, the protocol (``kvjax.memory._protocol``), the ubatch and config types, and the shared
helpers; never the cells, the placement, the unified cache's internals, storage or the defrag and
update machinery. A new memory is then a new module, never an edit of the driver.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

import kvjax

ROOT = pathlib.Path(kvjax.__file__).parent
ABOVE_THE_PROTOCOL = sorted(p for d in ("engine", "nn") for p in (ROOT / d).glob("*.py"))
BELOW_THE_PROTOCOL = ("kvjax.memory._cells", "kvjax.memory._slots", "kvjax.memory._unified",
                      "kvjax.memory._defrag", "kvjax.memory._update", "kvjax.memory._api", "kvjax.storage",
                      "kvjax.io", "kvjax.attn._")


def imports_of(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


@pytest.mark.parametrize("path", ABOVE_THE_PROTOCOL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_driver_step_and_layers_import_nothing_below_the_protocol(path):
    bad = sorted({name for name in imports_of(path) if name.startswith(BELOW_THE_PROTOCOL)})
    assert not bad, f"{path.name} imports {bad}: go through kvjax.Memory or the public kvjax names"


def test_the_check_sees_imports():
    """The import scanner finds both import forms (so the test above can fail)."""
    source = ROOT / "memory" / "_api.py"
    found = set(imports_of(source))
    assert "kvjax.memory._cells" in found and "kvjax.memory._unified.KVCache" in found


def test_no_public_name_shadows_a_module():
    """``kvjax.<name>`` is never both a module and something else (a traceback names what resolves)."""
    import importlib

    for name in kvjax.__all__:
        try:
            module = importlib.import_module(f"kvjax.{name}")
        except ModuleNotFoundError:
            continue
        assert getattr(kvjax, name) is module, f"kvjax.{name} is a public name and a module"


def test_errors_print_the_names_users_import():
    for cls in (kvjax.StateError, kvjax.CacheFullError, kvjax.ErrorFlag, kvjax.NotDefinedError):
        assert cls.__module__ == "kvjax" and getattr(kvjax, cls.__name__) is cls
