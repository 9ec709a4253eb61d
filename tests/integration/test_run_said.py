"""What a run says when gpud goes away is what happened: its own lines (``gpud-run: …``, never the
library's bare warnings), and a program paused at once is not said to have run unarbitrated.

Real daemon, real runs and programs (``tests/programs/burner.py``); every wait is on state."""

from __future__ import annotations

import signal
from collections.abc import Callable

from gpud.tools.spawn import DaemonProcess

from .test_run import Run, stopped
from .test_run import runs as runs  # noqa: F401 (the fixture)
from .waiting import eventually


def test_a_daemon_killed_under_a_run_is_told_as_it_happened(
    daemon_factory: Callable[..., DaemonProcess],
    runs: Callable[..., Run],  # noqa: F811
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial")
    r = runs(d, "said", "--gpus", "0.5")
    pid = r.program_pid()
    eventually(lambda: r.count() > 0, "the program works")
    d.stop(signal.SIGKILL)
    eventually(lambda: stopped(pid), "the program is paused while gpud is away")
    r.proc.send_signal(signal.SIGTERM)
    r.wait()
    lines = r.err.splitlines()
    assert lines and all(line.startswith("gpud-run: ") for line in lines), r.err
    assert "unarbitrated" not in r.err
    assert any("lost connection to gpud" in line for line in lines), r.err
    assert any(line.startswith("gpud-run: the program was paused at once: ") for line in lines), r.err
