"""The README's first command: the demo runs, shows who holds the GPU and ends with its summary."""

from __future__ import annotations

import subprocess
import sys


def test_the_demo_runs_and_summarises() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.demo", "--seconds", "8"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for needle in ("holder of GPU 0", "trainer", "batch-infer", "notebook", "stubborn", "share", "total"):
        assert needle in out.stdout, needle
