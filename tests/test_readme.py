"""The README's Python example runs as written."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs(capsys):
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.startswith("cells 3/256 used")


def test_every_readme_example_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    for code in blocks[1:]:
        exec(compile(code, str(README), "exec"), {})


def test_the_docs_examples_run():
    """The interactive examples of the docs pages (``>>>`` lines) run as written."""
    import doctest

    for page in ("errors.md",):
        failed, _ = doctest.testfile(
            str(README.parent / "docs" / page),
            module_relative=False,
            optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
        )
        assert failed == 0, page
