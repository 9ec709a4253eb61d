"""Who may do what where only a real daemon will do: clients forked under other uids and groups.

The daemon's rules of who may do what are tested in process with faked credentials
(``tests/daemon/test_authority.py``). These tests keep what the faking stands in for, the
uid (SO_PEERCRED) and the supplementary groups (SO_PEERGROUPS, even where the daemon cannot
see /proc) that the daemon learns from the kernel, and a reload by SIGHUP of a real daemon.
A client under another uid is a forked child that dropped to that uid, gid and supplementary
groups (``user``; needs root); the test and the child talk over a pair of pipes, one JSON
value a line, so each step happens in a known order and nothing waits on time.
"""

from __future__ import annotations

import grp
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpud.tools.spawn import DaemonProcess
from gpud_client import protocol as p
from gpud_client.connection import Connection
from gpud_client.errors import ProtocolError

from .waiting import eventually
from .wire import NOBODY, connect

# --- helpers ----------------------------------------------------------------------


class Line:
    """One end of the pipes between the test and a child: JSON values, one a line."""

    def __init__(self, rfd: int, wfd: int) -> None:
        self._r, self._w, self._buf = rfd, wfd, b""

    def say(self, value: Any) -> None:
        os.write(self._w, json.dumps(value).encode() + b"\n")

    def hear(self, timeout: float = 20.0) -> Any:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._r], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"nothing heard from the other side within {timeout} s"
            chunk = os.read(self._r, 65536)
            assert chunk, "the other side is gone"
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\n", 1)
        value = json.loads(raw)
        if isinstance(value, dict) and "child_failed" in value:
            raise AssertionError(f"the child failed:\n{value['child_failed']}")
        return value

    def result(self) -> Any:
        value = self.hear()
        assert isinstance(value, dict) and "result" in value, f"expected the child's result, got {value!r}"
        return value["result"]


def can_fork_users() -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to run clients under other uids")


@contextmanager
def user(
    d: DaemonProcess, act: Callable[[Line], Any], *, uid: int = NOBODY, gid: int = NOBODY, groups: tuple[int, ...] = ()
) -> Iterator[Line]:
    """Run ``act(line)`` in a forked child under ``uid``/``gid`` with exactly ``groups`` as its
    supplementary groups (as_nobody, generalised, and able to talk while it runs); its return
    value is the child's result (``Line.result``), an exception in it fails the test."""
    can_fork_users()
    os.chmod(d.workdir, 0o755)
    os.chmod(d.socket, 0o666)
    down, up = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
            signal.alarm(60)  # a child the test forgot dies on its own
            os.close(down[1])
            os.close(up[0])
            line = Line(down[0], up[1])
            try:
                os.setgroups(list(groups))
                os.setgid(gid)
                os.setuid(uid)
                line.say({"result": act(line)})
                code = 0
            except BaseException:
                line.say({"child_failed": traceback.format_exc()})
        finally:
            os._exit(code)
    os.close(down[0])
    os.close(up[1])
    try:
        yield Line(up[0], down[1])
    finally:
        if os.waitpid(pid, os.WNOHANG) == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(up[0])
        os.close(down[1])


def run_as(d: DaemonProcess, act: Callable[[Line], Any], **who: Any) -> Any:
    with user(d, act, **who) as line:
        return line.result()


def outcome(conn: Connection, msg: msgspec.Struct) -> list[str]:
    """["ok", ""] or [error code, message]: what the daemon answered."""
    try:
        conn.call(msgspec.structs.replace(msg, id=conn.next_id()))
    except ProtocolError as exc:
        return [str(exc.code), exc.message]
    return ["ok", ""]


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def users_group() -> grp.struct_group:
    """An existing group that is neither root's nor nobody's (gid 100, 'users')."""
    try:
        return grp.getgrgid(100)
    except KeyError:
        pytest.skip("no group with gid 100 on this machine")


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gpud.toml"
    path.write_text(text)
    return str(path)


# --- the kernel's credentials -------------------------------------------------------------


def test_a_client_under_another_uid_is_seen_as_that_uid(daemon: DaemonProcess) -> None:
    """What the in-process tests fake: a child forked under uid and gid 65534 is listed with
    them (SO_PEERCRED) and refused what a non-admin may not do."""

    def ask(line: Line) -> list[Any]:
        conn = connect(daemon, "nobody")
        [me] = [c for c in conn.call(p.ListClients(id=conn.next_id())).clients if c.name == "nobody"]
        return [me.pid == os.getpid(), me.uid, me.gid, outcome(conn, p.SetTq(id=0, seconds=1.0))[0]]

    assert run_as(daemon, ask) == [True, NOBODY, NOBODY, "permission_denied"]
    assert {g.tq_s for g in connect(daemon).call(p.Status(id=1)).gpus} == {30.0}


# --- admin through a supplementary group -------------------------------------------------


@pytest.fixture(params=["proc", "no-proc"])
def hidden_proc(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    """None, or an interpreter that runs the daemon where /proc is an empty tmpfs."""
    if request.param == "proc":
        return None
    can_fork_users()
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    wrapper = tmp_path / "python-without-proc"
    wrapper.write_text(
        "#!/bin/sh\n"
        "exec unshare --mount --propagation private /bin/sh -c "
        f'\'mount -t tmpfs none /proc && exec "$@"\' sh {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_member_of_the_admin_group_through_a_supplementary_group_is_admin(
    daemon_factory: Callable[..., DaemonProcess],
    tmp_path: Path,
    hidden_proc: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    users = users_group()
    cfg = config(tmp_path, f'admin_group = "{users.gr_name}"\n')
    with monkeypatch.context() as m:
        if hidden_proc is not None:
            m.setattr(sys, "executable", hidden_proc)
            m.setattr(DaemonProcess, "preload", False)  # started by that interpreter, not forked from a server
        d = daemon_factory("--simulate", "2", "--config", cfg)
    if hidden_proc is not None:  # the daemon really sees no /proc: groups can only come from SO_PEERGROUPS
        assert d.proc is not None
        mounts = Path(f"/proc/{d.proc.pid}/mountinfo").read_text().splitlines()
        assert any(m.split()[4] == "/proc" and " - tmpfs " in m for m in mounts), mounts

    def set_tq(line: Line) -> list[str]:
        return outcome(connect(d, "tq"), p.SetTq(id=0, seconds=5.0))

    refused = run_as(d, set_tq, uid=NOBODY, gid=NOBODY, groups=())
    assert refused[0] == "permission_denied" and f"peer uid {NOBODY}" in refused[1]
    assert {g.tq_s for g in connect(d).call(p.Status(id=1)).gpus} == {30.0}
    assert run_as(d, set_tq, uid=NOBODY, gid=NOBODY, groups=(users.gr_gid,)) == ["ok", ""]
    assert {g.tq_s for g in connect(d).call(p.Status(id=1)).gpus} == {5.0}


# --- reload: safe and complete ---------------------------------------------------------------


def events(d: DaemonProcess, name: str) -> list[dict[str, Any]]:
    lines = (json.loads(x) for x in d.log().splitlines() if x.startswith("{"))
    return [e for e in lines if e.get("event") == name]


def hup(d: DaemonProcess, cfg: Path, content: bytes, wait_for: str) -> dict[str, Any]:
    """Write the file, SIGHUP, and return the next ``wait_for`` log event (counted, so an
    earlier one never answers for this one)."""
    seen = len(events(d, wait_for))
    cfg.write_bytes(content)
    assert d.proc is not None
    d.proc.send_signal(signal.SIGHUP)
    eventually(lambda: len(events(d, wait_for)) > seen, f"logged {wait_for}:\n{d.log()}")
    return events(d, wait_for)[seen]


def tqs(d: DaemonProcess) -> set[float]:
    out = gpuctl(d, "status", "--json")
    assert out.returncode == 0, out.stderr
    return {g["tq_s"] for g in json.loads(out.stdout)["gpus"]}


@pytest.fixture
def from_file(tmp_path: Path) -> Iterator[tuple[DaemonProcess, Path]]:
    """A daemon whose state_dir comes from its config file: DaemonProcess.start would pass
    --state-dir, and a flag wins over the file on every reload."""
    workdir = tempfile.mkdtemp(prefix="gpud-", dir="/tmp")
    cfg = tmp_path / "gpud.toml"
    cfg.write_text(f'tq_s = 30.0\nstate_dir = "{workdir}/state"\nmonitor_interval_s = 1.0\n')
    d = DaemonProcess("--simulate", "2", "--config", str(cfg), workdir=workdir)
    cmd = [
        sys.executable,
        "-m",
        "gpud.main",
        "--socket",
        d.socket,
        "--log-format",
        "json",
        "--metrics-addr",
        "off",
        *d.args,
    ]
    with open(d.log_path, "ab") as log:
        d.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        eventually(lambda: bool(events(d, "ready")) or d.proc is None or d.proc.poll() is not None, "ready")
        assert events(d, "ready"), d.log()
        yield d, cfg
    finally:
        d.cleanup()


def test_a_bad_config_on_reload_changes_nothing(from_file: tuple[DaemonProcess, Path]) -> None:
    d, cfg = from_file
    assert tqs(d) == {30.0}
    for content, reason in [
        (b"tq_s = = 5\n", "is not valid TOML"),
        (b"\xff\xfe tq_s = 5\n", "is not UTF-8 text"),
        (b"tq_s = -1\n", "$.tq_s"),
    ]:
        failed = hup(d, cfg, content, "config_reload_failed")
        assert reason in failed["error"], failed
        assert d.proc is not None and d.proc.poll() is None  # still alive
        assert tqs(d) == {30.0}


def test_a_reload_applies_groups_tenants_and_intervals_and_defers_restart_keys(
    from_file: tuple[DaemonProcess, Path],
) -> None:
    d, cfg = from_file
    users = users_group()
    workdir = d.workdir
    base = f'tq_s = 30.0\nstate_dir = "{workdir}/state"\n'

    def set_tq(line: Line) -> list[str]:
        return outcome(connect(d, "member"), p.SetTq(id=0, seconds=5.0))

    member = dict(uid=NOBODY, gid=NOBODY, groups=(users.gr_gid,))
    assert run_as(d, set_tq, **member)[0] == "permission_denied"  # before: the default group does not exist
    out = gpuctl(d, "alloc", "--task", "fresh", "--gpus", "1", "--tenant", "new")
    assert out.returncode != 0 and "unknown tenant 'new'" in out.stderr, out.stderr

    new = base + f'monitor_interval_s = 0.5\nadmin_group = "{users.gr_name}"\n[tenants.new]\ngpus = 1\n'
    reloaded = hup(d, cfg, new.encode(), "config_reloaded")
    assert sorted(reloaded["changed"]) == ["admin_group", "monitor_interval_s", "tenants"]
    assert run_as(d, set_tq, **member) == ["ok", ""]
    assert tqs(d) == {5.0}
    out = gpuctl(d, "alloc", "--task", "fresh", "--gpus", "1", "--tenant", "new")
    assert out.returncode == 0 and "GPUD_TASK_ID=fresh" in out.stdout, out.stderr

    moved = "socket_mode = 0o600\n" + new.replace(f"{workdir}/state", f"{workdir}/elsewhere")  # before the tables
    later = hup(d, cfg, moved.encode(), "config_reload_needs_restart")
    assert sorted(later["keys"]) == ["socket_mode", "state_dir"]
    assert events(d, "config_reloaded")[-1]["changed"] == []
    assert not os.path.exists(f"{workdir}/elsewhere")  # the store stays where it is
    out = gpuctl(d, "allocs", "--json")
    assert [a["task_id"] for a in json.loads(out.stdout)["allocations"]] == ["fresh"]
