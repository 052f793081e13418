"""The main job runs and exits 0 (quick mode), as a user would start it."""

import subprocess
import sys


def test_demo_quick_runs():
    out = subprocess.run([sys.executable, "-m", "kvjax", "demo", "--quick"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "cells" in out.stdout and "demo finished" in out.stdout
