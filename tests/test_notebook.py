"""The notebooks run top to bottom in a fresh kernel and draw their pictures."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"
PICTURES = {"01_tour.ipynb": 4, "02_memories.ipynb": 4, "03_serving.ipynb": 3}


@pytest.mark.parametrize("name", sorted(PICTURES))
def test_notebook_executes(tmp_path, name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum(o.output_type == "display_data" for o in outputs) >= PICTURES[name]  # the pictures were drawn


def test_notebooks_are_built_from_the_script():
    """The committed notebooks are what scripts/build_notebook.py writes (no hand edits that drift)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("build_notebook", NOTEBOOKS.parent / "scripts" / "build_notebook.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert set(module.NOTEBOOKS) == set(PICTURES)
    for name, cells in module.NOTEBOOKS.items():
        committed = nbformat.read(NOTEBOOKS / name, as_version=4)
        assert [c.source for c in committed.cells] == [src for _, src in cells]
