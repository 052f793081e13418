"""The architecture, checked: every module stands on a floor, and imports only from its floor or below.

The floors (docs/architecture.md draws them) are data here: a module's floor is the first pattern
of :data:`FLOORS` that matches its name. Every import counts, at module level or inside a
function, so a new back arrow or a circle fails this file, naming the modules. Above the memory
protocol the driver, the step and the layers also keep to the protocol (the second rule).
"""

from __future__ import annotations

import ast
import importlib
import pathlib
from typing import Dict, Iterable, List, Set, Tuple

import pytest

import kvjax

ROOT = pathlib.Path(kvjax.__file__).parent

#: (floor, name, module patterns): a pattern ending in "." matches a package's modules
FLOORS: Tuple[Tuple[int, str, Tuple[str, ...]], ...] = (
    (
        0,
        "base: errors, typing, validation, jit twins, compile counts, axis and mesh names, ggml block codecs",
        (
            "kvjax._errors",
            "kvjax._typing",
            "kvjax._validate",
            "kvjax._jit",
            "kvjax._compiles",
            "kvjax._axes",
            "kvjax._mesh",
            "kvjax._ggml_blocks",
        ),
    ),
    (
        1,
        "maths over plain arrays: K/V storage codecs, RoPE, attention kernels, window buckets, sequence "
        "bit sets, configs, ubatches, sampling",
        (
            "kvjax.storage",
            "kvjax.storage.",
            "kvjax.attn",
            "kvjax.attn._rope",
            "kvjax.attn._attention",
            "kvjax.attn._pallas",
            "kvjax.attn._windows",
            "kvjax.memory._seqbits",
            "kvjax.memory._config",
            "kvjax.memory._ubatch",
            "kvjax.engine._sampling",
        ),
    ),
    (
        2,
        "cells: cell metadata, slot search, masks over cells, defrag moves, pending work, recurrent cells",
        (
            "kvjax.memory._cells",
            "kvjax.memory._slots",
            "kvjax.attn._mask",
            "kvjax.memory._defrag_moves",
            "kvjax.memory._update",
            "kvjax.memory._recurrent_config",
            "kvjax.memory._recurrent_cells",
            "kvjax.memory._recurrent_slots",
            "kvjax.memory._recurrent_rows",
        ),
    ),
    (
        3,
        "memories: the protocol and every memory kind",
        (
            "kvjax.memory._protocol",
            "kvjax.memory._unified",
            "kvjax.memory._composite",
            "kvjax.memory._iswa",
            "kvjax.memory._recurrent",
            "kvjax.memory._hybrid",
            "kvjax.memory._streams",
        ),
    ),
    (
        4,
        "the memories' public functions: init and layout on a mesh, free functions, defrag, a part's "
        "masks and K-shift, stream attention, the streaming window",
        (
            "kvjax.memory._init",
            "kvjax.memory._api",
            "kvjax.memory._defrag",
            "kvjax.memory._part_ops",
            "kvjax.memory._stream_attention",
            "kvjax.memory._sink_window",
            "kvjax.memory",
        ),
    ),
    (
        5,
        "services over the protocol: state formats, sessions, checkpoints, sharding, inspection, pictures",
        ("kvjax.io", "kvjax.io.", "kvjax.shard", "kvjax.shard.", "kvjax._inspect", "kvjax.plot"),
    ),
    (6, "the public face: import kvjax", ("kvjax",)),
    (
        7,
        "models and the decode driver (and the reference models of the tests)",
        ("kvjax.nn", "kvjax.nn.", "kvjax.engine", "kvjax.engine.", "kvjax.testing", "kvjax.testing."),
    ),
    (8, "serving: the scheduler and the HTTP server", ("kvjax.serve", "kvjax.serve.")),
    (9, "programs: python -m kvjax", ("kvjax.app", "kvjax.app.", "kvjax.__main__")),
)


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: Dict[str, pathlib.Path] = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def floor_of(module: str) -> int:
    # the most specific pattern wins ("kvjax.memory._api" before the package "kvjax.memory")
    best = None
    for floor, _, patterns in FLOORS:
        for pattern in patterns:
            hit = module.startswith(pattern) if pattern.endswith(".") else module == pattern
            if hit and (best is None or len(pattern) > best[1]):
                best = (floor, len(pattern))
    if best is None:
        raise KeyError(
            f"{module} stands on no floor: add it to FLOORS in tests/test_layering.py and to the "
            f"table in docs/architecture.md"
        )
    return best[0]


def resolve(name: str, modules: Iterable[str]) -> str:
    """The kvjax module an imported name lives in (``kvjax.memory._api.seq_rm`` -> ``kvjax.memory._api``)."""
    known = set(modules)
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name


def imports_of(path: pathlib.Path) -> Iterable[str]:
    """Every name a file imports (module level and inside functions), absolute and relative."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(modules: Dict[str, pathlib.Path]) -> Dict[str, Set[str]]:
    """module -> the kvjax modules it imports (itself and its own package excluded)."""
    graph = {}
    for module, path in modules.items():
        targets = {resolve(n, modules) for n in imports_of(path) if n == "kvjax" or n.startswith("kvjax.")}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def back_arrows(graph: Dict[str, Set[str]], floor=floor_of) -> List[str]:
    """Every import of a module on a higher floor than the importer's."""
    return sorted(
        f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
        for a, targets in graph.items()
        for b in targets
        if floor(b) > floor(a)
    )


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


GRAPH = import_graph(MODULES)


def test_every_module_stands_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_module_imports_from_a_floor_above_its_own():
    bad = back_arrows(GRAPH)
    assert not bad, "back arrows (see docs/architecture.md for the floors):\n" + "\n".join(bad)


def test_no_import_circles():
    found = circles(GRAPH)
    assert not found, f"import circles: {found}"


def test_the_checks_fail_on_a_back_arrow_and_a_circle():
    """The checkers themselves find what they must (so the tests above can fail)."""
    floors = {"low": 0, "high": 1}
    assert back_arrows({"low": {"high"}, "high": set()}, floor=floors.get) == ["low (floor 0) imports high (floor 1)"]
    assert back_arrows({"high": {"low"}, "low": set()}, floor=floors.get) == []
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_scanner_sees_every_import_form():
    source = MODULES["kvjax.memory._api"]
    found = set(imports_of(source))
    assert "kvjax.memory._cells" in found and "kvjax.memory._unified.KVCache" in found
    assert GRAPH["kvjax.memory._api"] >= {"kvjax.memory._cells", "kvjax.memory._unified"}
    # relative imports resolve too
    assert "kvjax.io._state" in GRAPH["kvjax.io"]


def test_the_lazy_names_of_the_public_face_come_from_the_top_floor():
    """``kvjax.Engine`` and friends load on first use (import kvjax stays without the model stack):
    the one arrow the scanner cannot see, so it is checked here."""
    for name, module in kvjax._LAZY.items():
        assert floor_of(module) > floor_of("kvjax"), f"kvjax.{name} comes from {module}, below the public face"
        assert getattr(importlib.import_module(module), name) is getattr(kvjax, name)


def test_function_local_imports_are_only_for_optional_dependencies():
    optional = {"gguf", "tokenizers", "safetensors", "sentencepiece", "jinja2", "matplotlib", "orbax", "importlib"}
    bad = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    name = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
                    if (name or "").split(".")[0] not in optional:
                        bad.append(f"{module}:{node.lineno} imports {name}")
    assert not bad, "imports inside functions (move them to the top of the module):\n" + "\n".join(sorted(set(bad)))


# -- above the protocol --------------------------------------------------------------------------

ABOVE_THE_PROTOCOL = sorted(p for d in ("engine", "nn") for p in (ROOT / d).glob("*.py"))
BELOW_THE_PROTOCOL = (
    "kvjax.memory._cells",
    "kvjax.memory._slots",
    "kvjax.memory._unified",
    "kvjax.memory._defrag",
    "kvjax.memory._update",
    "kvjax.memory._api",
    "kvjax.memory._part_ops",
    "kvjax.storage",
    "kvjax.io",
    "kvjax.attn._",
)


@pytest.mark.parametrize("path", ABOVE_THE_PROTOCOL, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_driver_step_and_layers_import_nothing_below_the_protocol(path):
    bad = sorted({name for name in imports_of(path) if name.startswith(BELOW_THE_PROTOCOL)})
    assert not bad, f"{path.name} imports {bad}: go through kvjax.Memory or the public kvjax names"


def test_no_public_name_shadows_a_module():
    """``kvjax.<name>`` is never both a module and something else (a traceback names what resolves)."""
    for name in kvjax.__all__:
        try:
            module = importlib.import_module(f"kvjax.{name}")
        except ModuleNotFoundError:
            continue
        assert getattr(kvjax, name) is module, f"kvjax.{name} is a public name and a module"


def test_errors_print_the_names_users_import():
    for cls in (kvjax.StateError, kvjax.CacheFullError, kvjax.ErrorFlag, kvjax.NotDefinedError):
        assert cls.__module__ == "kvjax" and getattr(kvjax, cls.__name__) is cls
