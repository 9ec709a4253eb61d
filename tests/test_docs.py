"""What the daemon writes for operators is documented: every log event it emits and every metric it
exports is named in the README, so an operator can look up what a line or a series means."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SOURCES = sorted((ROOT / "gpud").rglob("*.py"))
LOG_EVENT = re.compile(r"""(?:log\.(?:debug|info|warning|error|exception|critical)|faults\.often)\(\s*"([a-z_]+)\"""")
METRIC = re.compile(r'"(gpud_[a-z_]+)"')


def found(pattern: re.Pattern[str]) -> set[str]:
    return {m for path in SOURCES for m in pattern.findall(path.read_text())}


def test_every_log_event_is_documented() -> None:
    events = found(LOG_EVENT)
    assert len(events) > 30  # the pattern still finds them
    assert sorted(e for e in events if f"`{e}`" not in README) == []


def test_every_metric_is_documented() -> None:
    metrics = found(METRIC)
    assert len(metrics) > 20
    assert sorted(m for m in metrics if m not in README) == []


def test_the_client_library_example_is_quoted_whole_and_runs(daemon: object) -> None:
    """The README's training loop is examples/training_session.py, which runs against a daemon."""
    import os
    import subprocess
    import sys

    path = ROOT / "examples" / "training_session.py"
    body = path.read_text().split('"""\n\n', 1)[1]
    assert f"```python\n{body}```" in README
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "GPUD_SOCKET": daemon.socket})  # type: ignore[attr-defined]
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("trained 100 batches")
