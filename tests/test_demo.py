"""The main job runs and exits 0 (quick mode), as a user would start it; compiled programs are kept."""

import os
import pathlib
import subprocess
import sys

from kvjax.__main__ import compile_cache_dir


def test_demo_quick_runs(tmp_path):
    env = dict(os.environ, KVJAX_CACHE_DIR=str(tmp_path / "xla"))
    out = subprocess.run(
        [sys.executable, "-m", "kvjax", "demo", "--quick"], capture_output=True, text=True, timeout=600, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for step in ("no sharing", "evaluated once and shared", "context shift of sequence 0", "after defrag"):
        assert step in text, step
    assert "random weights" not in text  # the committed model is used
    shared = text.split("evaluated once and shared")[1].splitlines()[2]
    assert shared.startswith("+" * len("Return a new "))  # the prefix cells are shared
    assert "Return a new list of" in text and "tokens/s" in text
    assert "compile time apart" in text  # speed is reported without compile time mixed in
    # the persistent compilation cache was used: programs were written for the next run
    assert f"compiled programs kept in {tmp_path / 'xla'}" in text
    assert any((tmp_path / "xla").iterdir())


def test_compile_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("KVJAX_CACHE_DIR", str(tmp_path / "here"))
    assert compile_cache_dir() == tmp_path / "here"
    monkeypatch.delenv("KVJAX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compile_cache_dir() == tmp_path / "kvjax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert compile_cache_dir() == pathlib.Path.home() / ".cache" / "kvjax" / "xla"
