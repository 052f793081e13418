"""The main job runs and exits 0 (quick mode), as a user would start it."""

import subprocess
import sys


def test_demo_quick_runs():
    out = subprocess.run([sys.executable, "-m", "kvjax", "demo", "--quick"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout
    for step in ("no sharing", "evaluated once and shared", "context shift of sequence 0", "after defrag"):
        assert step in text, step
    assert "random weights" not in text  # the committed model is used
    shared = text.split("evaluated once and shared")[1].splitlines()[2]
    assert shared.startswith("+" * len("Return a new "))  # the prefix cells are shared
    assert "Return a new list of" in text and "tokens/s" in text
