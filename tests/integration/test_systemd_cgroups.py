"""The drop-in a node adds to let gpud hold ``gpuctl run`` programs in cgroups (systemd/gpud-cgroups.conf):
systemd reads it beside the shipped unit without a complaint, the unit stays rated "OK" by
``systemd-analyze security``, and docs/running.md shows it as it is."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DROP_IN = ROOT / "systemd" / "gpud-cgroups.conf"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")


def staged(tmp_path: Path) -> Path:
    """gpud.service (its ExecStart= made an executable of this machine) and gpud.socket, with the
    drop-in in gpud.service.d/ beside them, as /etc/systemd/system would hold them."""
    unit = (ROOT / "systemd" / "gpud.service").read_text()
    (tmp_path / "gpud.service").write_text(re.sub(r"(?m)^ExecStart=.*$", "ExecStart=/bin/true", unit))
    shutil.copy(ROOT / "systemd" / "gpud.socket", tmp_path / "gpud.socket")
    (tmp_path / "gpud.service.d").mkdir()
    shutil.copy(DROP_IN, tmp_path / "gpud.service.d" / "cgroups.conf")
    return tmp_path / "gpud.service"


@needs_analyze
def test_systemd_reads_the_drop_in_beside_the_shipped_unit_without_a_complaint(tmp_path: Path) -> None:
    unit = staged(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "verify", str(unit), str(tmp_path / "gpud.socket")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    problems = [line for line in (out.stdout + out.stderr).splitlines() if "cgroups.conf" in line]
    assert problems == [], out.stdout + out.stderr


@needs_analyze
def test_with_the_drop_in_the_unit_is_still_rated_ok(tmp_path: Path) -> None:
    unit = staged(tmp_path)
    out = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)], capture_output=True, text=True, timeout=60
    )
    level = re.search(r"Overall exposure level for gpud.service: ([0-9.]+) (\w+)", out.stdout + out.stderr)
    if level is None:
        pytest.skip(f"this systemd-analyze cannot rate a unit offline: {out.stderr.strip()[:200]}")
    assert float(level[1]) < 3.0 and level[2] == "OK", out.stdout


def test_the_docs_show_every_setting_of_the_drop_in() -> None:
    running = (ROOT / "docs" / "running.md").read_text()
    settings = [line for line in DROP_IN.read_text().splitlines() if re.match(r"^[A-Za-z]+=", line)]
    assert len(settings) >= 8
    assert [s for s in settings if s not in running] == []
