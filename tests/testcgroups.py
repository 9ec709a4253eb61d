"""Real cgroup v2 folders for tests: made under a folder of the test's own below the cgroup2 mount,
with real processes moved into them, and everything killed and removed afterwards.

``CgroupTree.make("kubepods.slice/pod1/ctr")`` makes the folders (their path in the hierarchy is
``tree.hierarchy + "/kubepods.slice/pod1/ctr"``); ``spawn`` starts a process and moves it in before it
does anything but wait (it reads one byte from a pipe first), so it never runs outside its cgroup;
``cpu_usec`` reads the kernel's CPU time of everything in a cgroup (``cpu.stat``, which cgroup v2
keeps with or without the cpu controller).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

from gpud.host.cgroups import MOUNTINFO, cgroup2_mount, directory, events
from tests.integration.waiting import eventually

BURN = "import sys; sys.stdin.buffer.read(1)\nwhile True:\n    pass\n"


def usable() -> str | None:
    """Why real cgroups cannot be made here (None: they can)."""
    try:
        with open(MOUNTINFO) as f:
            mount = cgroup2_mount(f.read())
    except OSError as exc:
        return str(exc)
    if mount is None:
        return "no cgroup v2 hierarchy is mounted"
    top = directory(mount, mount[1])
    if top is None or not os.access(os.path.join(top, "cgroup.procs"), os.W_OK):
        return f"the cgroup2 mount {mount[0]} is not writable here (not root?)"
    if not os.path.exists(os.path.join(top, "cgroup.freeze")) and not _has_freezer_below(top):
        return "this kernel's cgroup v2 has no freezer (Linux 5.2)"
    return None


def _has_freezer_below(top: str) -> bool:
    probe = os.path.join(top, f"gpud-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
        return os.path.exists(os.path.join(probe, "cgroup.freeze"))
    except OSError:
        return False
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass


class CgroupTree:
    def __init__(self, name: str = "") -> None:
        with open(MOUNTINFO) as f:
            mount = cgroup2_mount(f.read())
        assert mount is not None
        self.mount = mount
        leaf = name or f"gpud-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.hierarchy = mount[1].rstrip("/") + "/" + leaf  # its path in the hierarchy
        top = directory(mount, self.hierarchy)
        assert top is not None
        self.root = Path(top)  # in the file system
        self.root.mkdir()
        self.procs: list[subprocess.Popen[bytes]] = []

    def path(self, rel: str) -> Path:
        return self.root / rel

    def name(self, rel: str) -> str:
        """``rel``'s path in the cgroup2 hierarchy."""
        return f"{self.hierarchy}/{rel}"

    def make(self, rel: str) -> Path:
        here = self.root / rel
        here.mkdir(parents=True, exist_ok=True)
        return here

    def spawn(self, rel: str, code: str = BURN, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """A process running ``code`` in cgroup ``rel`` (made if missing), moved there before it starts;
        ``env``: its whole environment (default: this process's)."""
        here = self.make(rel)
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env)
        self.procs.append(proc)
        (here / "cgroup.procs").write_text(str(proc.pid))
        assert proc.stdin is not None
        proc.stdin.write(b"g")
        proc.stdin.flush()
        return proc

    def cpu_usec(self, rel: str) -> int:
        for line in (self.root / rel / "cpu.stat").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "usage_usec":
                return int(value)
        raise AssertionError(f"{rel}/cpu.stat has no usage_usec")

    def frozen(self, rel: str) -> bool:
        return events((self.root / rel / "cgroup.events").read_text()).get("frozen") == 1

    def wants_frozen(self, rel: str) -> bool:
        return (self.root / rel / "cgroup.freeze").read_text().strip() == "1"

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        for here in sorted((p for p in self.root.rglob("*") if p.is_dir()), key=lambda x: -len(x.parts)):
            _empty(here)
        _empty(self.root)
        for proc in self.procs:
            proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def _empty(here: Path) -> None:
    """Thaw, kill what is left, and remove the cgroup folder (waiting for the kernel to empty it)."""
    try:
        (here / "cgroup.freeze").write_text("0")
        if (here / "cgroup.kill").exists():
            (here / "cgroup.kill").write_text("1")
    except OSError:
        pass
    eventually(lambda: _removed(here), f"{here} emptied by the kernel and removed")


def _removed(here: Path) -> bool:
    """rmdir once the kernel has emptied it (its killed processes exit): True once it is gone."""
    try:
        here.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True
