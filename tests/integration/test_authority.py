"""Who may do what, end to end: a real daemon, clients forked under other uids and groups.

Tests run as root (here and in CI) and root is an admin, so every refusal is asked
from a forked child that dropped to another uid, gid and supplementary groups
(``user``); the test and the child talk over a pair of pipes, one JSON value a line,
so each step happens in a known order and nothing waits on time.
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
from .wire import NOBODY, attach, connect, expect

GIB = 2**30
OTHER_UID = 65533  # no name needed: a uid is a number


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


def codes(results: dict[str, list[str]]) -> dict[str, str]:
    return {k: v[0] for k, v in results.items()}


def gpuctl(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, *args], capture_output=True, text=True, timeout=30
    )


def my_session(conn: Connection, name: str) -> p.SessionInfo:
    reply = conn.call(p.ListClients(id=conn.next_id()))
    session: p.SessionInfo = [c for c in reply.clients if c.name == name][0].sessions[0]
    return session


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



# --- 1. an admin's limit is a ceiling -----------------------------------------------


def test_an_admins_limit_is_a_ceiling_the_client_cannot_lift(daemon: DaemonProcess) -> None:
    def capped(line: Line) -> dict[str, Any]:
        conn = connect(daemon, "capped")
        attach(conn)
        line.say("attached")
        assert line.hear() == "go"
        tries = {
            "core 60": outcome(conn, p.SetLimits(id=0, core_limit=60)),
            "core 20": outcome(conn, p.SetLimits(id=0, core_limit=20)),
            "core 30": outcome(conn, p.SetLimits(id=0, core_limit=30)),
            "core 31": outcome(conn, p.SetLimits(id=0, core_limit=31)),
            "mem lifted": outcome(conn, p.SetLimits(id=0, mem_limit=0)),
            "mem 5GiB": outcome(conn, p.SetLimits(id=0, mem_limit=5 * GIB)),
            "mem 1GiB": outcome(conn, p.SetLimits(id=0, mem_limit=GIB)),
        }
        s = my_session(conn, "capped")
        return {"tries": tries, "after": [s.core_limit, s.core_ceiling, s.mem_limit_bytes, s.mem_ceiling_bytes]}

    with user(daemon, capped) as line:
        assert line.hear() == "attached"
        out = gpuctl(daemon, "limit", "capped", "--core", "30", "--mem", "4GiB")
        assert out.returncode == 0, out.stderr
        line.say("go")
        got = line.result()
    assert codes(got["tries"]) == {
        "core 60": "permission_denied", "core 20": "ok", "core 30": "ok", "core 31": "permission_denied",
        "mem lifted": "permission_denied", "mem 5GiB": "permission_denied", "mem 1GiB": "ok",
    }
    assert "ceiling of 30 %" in got["tries"]["core 60"][1]
    assert got["after"] == [30, 30, GIB, 4 * GIB]


# --- 2. a fractional allocation's limits, named or not ----------------------------------


def test_a_fractional_allocation_limits_sessions_that_do_not_name_it(daemon: DaemonProcess) -> None:
    def by_uid(line: Line) -> dict[str, Any]:
        conn = connect(daemon, "frac")
        a = conn.call(p.Allocate(id=conn.next_id(), task_id="frac-task", gpus=0.25, prefer=[1]))
        on_it = conn.call(p.Attach(id=conn.next_id(), gpu=a.gpus[0]))  # no task_id, no labels
        elsewhere = conn.call(p.Attach(id=conn.next_id(), gpu=0))
        return {
            "gpus": a.gpus,
            "on_it": [on_it.core_limit, on_it.mem_limit],
            "elsewhere": [elsewhere.core_limit, elsewhere.mem_limit],
            "raise": outcome(conn, p.SetLimits(id=0, session=on_it.session, core_limit=50)),
            "lift": outcome(conn, p.SetLimits(id=0, session=on_it.session, mem_limit=0)),
            "lower": outcome(conn, p.SetLimits(id=0, session=on_it.session, core_limit=10)),
        }

    got = run_as(daemon, by_uid)
    assert got["gpus"] == [1]
    assert got["on_it"] == [25, 16 * GIB // 4]
    assert got["elsewhere"] == [100, None]
    assert codes({k: got[k] for k in ("raise", "lift", "lower")}) == {
        "raise": "permission_denied", "lift": "permission_denied", "lower": "ok",
    }

    # An allocation root made for this test process: its children belong to it, whoever they
    # run as, and that wins over their own uid's smaller allocation on the same GPU.
    root = connect(daemon, "root")
    owned = root.call(p.Allocate(id=root.next_id(), task_id="by-pid", gpus=0.5, prefer=[0], owner_pid=os.getpid()))
    assert owned.gpus == [0]

    def child_of_owner(line: Line) -> list[Any]:
        conn = connect(daemon, "child")
        conn.call(p.Allocate(id=conn.next_id(), task_id="nobody-small", gpus=0.1, prefer=[0]))
        s = conn.call(p.Attach(id=conn.next_id(), gpu=0))
        return [s.core_limit, s.mem_limit]

    assert run_as(daemon, child_of_owner) == [50, 16 * GIB // 2]


# --- 3. priority caps -------------------------------------------------------------------


def test_priorities_above_the_callers_maximum_are_refused(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    users = users_group()
    cfg = config(tmp_path, f'priority_max = 40\n[priority_max_uids]\n"{NOBODY}" = 60\n'
                           f'[priority_max_groups]\n"{users.gr_name}" = 70\n')
    d = daemon_factory("--simulate", "2", "--config", cfg)

    def tries(name: str, over: int, at: int) -> Callable[[Line], dict[str, list[str]]]:
        def act(line: Line) -> dict[str, list[str]]:
            conn = connect(d, name)
            return {
                "over": outcome(conn, p.Attach(id=0, gpu=0, priority=over)),
                "at": outcome(conn, p.Attach(id=0, gpu=0, priority=at)),
                "production": outcome(conn, p.Allocate(id=0, task_id=f"{name}-1", gpus=0.1,
                                                       priority_class=p.PriorityClass.PRODUCTION)),
                "best-effort": outcome(conn, p.Allocate(id=0, task_id=f"{name}-2", gpus=0.1,
                                                        priority_class=p.PriorityClass.BEST_EFFORT)),
            }
        return act

    expected = {"over": "permission_denied", "at": "ok", "production": "permission_denied", "best-effort": "ok"}
    cases = [  # (who, its maximum): the uid's setting wins over its groups, then the highest group, then the default
        (dict(uid=NOBODY, gid=NOBODY, groups=(users.gr_gid,)), 60),
        (dict(uid=OTHER_UID, gid=OTHER_UID, groups=(users.gr_gid,)), 70),
        (dict(uid=OTHER_UID, gid=OTHER_UID, groups=()), 40),
    ]
    for i, (who, maximum) in enumerate(cases):
        got = run_as(d, tries(f"u{i}", maximum + 1, maximum), **who)
        assert codes(got) == expected, (who, got)
        assert f"priority {maximum + 1} is above your maximum {maximum}" in got["over"][1]
        assert f"priority 100 is above your maximum {maximum}" in got["production"][1]

    root = connect(d, "root")
    assert root.call(p.Attach(id=root.next_id(), gpu=0, priority=100)).session
    assert root.call(p.Allocate(id=root.next_id(), task_id="root-prod", gpus=0.1,
                                priority_class=p.PriorityClass.PRODUCTION)).priority == 100


def test_a_lease_asking_above_its_policy_gets_the_policys_priority(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "2", "--config", config(tmp_path, f'[priority_max_uids]\n"{NOBODY}" = 60\n'))
    holder, eager = connect(d, "holder"), connect(d, "eager")
    held = holder.call(p.Acquire(id=holder.next_id(), gpu=1, task_type="OTHER"))
    assert held.acquired
    eager.send(p.Acquire(id=eager.next_id(), gpu=1, task_type="OTHER", priority=99, max_wait_ms=20_000))

    def modest(line: Line) -> str:
        conn = connect(d, "modest")
        with pytest.raises(ProtocolError, match="lease priority 61 is above your maximum 60"):  # its own cap first
            conn.call(p.Acquire(id=conn.next_id(), gpu=1, task_type="OTHER", priority=61, max_wait_ms=20_000))
        line.say("asking")
        r = conn.call(p.Acquire(id=conn.next_id(), gpu=1, task_type="OTHER", priority=55, max_wait_ms=20_000),
                      timeout=25)
        return str(r.status)

    def waiting() -> dict[str, int]:
        leases = holder.call(p.ListLeases(id=holder.next_id())).leases
        return {le.name: le.priority for le in leases if le.state == "waiting"}

    with user(d, modest) as line:
        assert line.hear() == "asking"
        eventually(lambda: len(waiting()) == 2, "two leases waiting")
        assert waiting() == {"eager": 50, "modest": 50}  # OTHER's policy: 99 and 55 are cut to 50
        holder.call(p.Release(id=holder.next_id(), lease_id=held.lease_id))
        first = expect(eager, p.LeaseResult)
        assert first.acquired  # equal priorities: first come, first served
        eager.call(p.Release(id=eager.next_id(), lease_id=first.lease_id))
        assert line.result() == "ACQUIRED"


def test_naming_a_task_type_gives_no_more_priority_than_the_caller_may_declare(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    """ASR's default policy has priority 90, above a non-admin's maximum of 50: a stranger's ASR
    lease waits at 50; a uid a reserved policy names gets its 90; anyone else is refused it."""
    users = users_group()
    cfg = config(tmp_path, '[policies.TTS]\npriority = 70\nbusy_policy = "WAIT"\nmax_wait_ms = 20000\n'
                           f'gids = [{users.gr_gid}]\n')
    d = daemon_factory("--simulate", "2", "--config", cfg)
    holder = connect(d, "holder")
    held = holder.call(p.Acquire(id=holder.next_id(), gpu=1, task_type="OTHER"))
    assert held.acquired

    def asks(task_type: str) -> Callable[[Line], list[str]]:
        def act(line: Line) -> list[str]:
            conn = connect(d, f"asks-{task_type}")
            conn.send(p.Acquire(id=conn.next_id(), gpu=1, task_type=task_type, max_wait_ms=20_000))
            line.say("asked")
            reply = conn.recv(25)
            if isinstance(reply, p.Error):
                return [str(reply.code), reply.message]
            return [str(reply.status), ""]
        return act

    def waiting() -> dict[str, int]:
        leases = holder.call(p.ListLeases(id=holder.next_id())).leases
        return {le.name: le.priority for le in leases if le.state == "waiting"}

    with user(d, asks("TTS"), uid=OTHER_UID, gid=OTHER_UID, groups=()) as outsider:
        assert outsider.hear() == "asked"
        refused = outsider.result()
    assert refused[0] == "permission_denied"
    assert f"task type TTS is reserved for uids [] and gids [{users.gr_gid}]" in refused[1]
    with user(d, asks("ASR"), uid=OTHER_UID, gid=OTHER_UID) as stranger, \
            user(d, asks("TTS"), uid=OTHER_UID, gid=OTHER_UID, groups=(users.gr_gid,)) as member:
        assert stranger.hear() == "asked" and member.hear() == "asked"
        eventually(lambda: len(waiting()) == 2, "two leases waiting", why=lambda: str(waiting()))
        assert waiting() == {"asks-ASR": 50, "asks-TTS": 70}
        holder.call(p.Release(id=holder.next_id(), lease_id=held.lease_id))
        assert member.result() == ["ACQUIRED", ""]  # 70 before 50, though it came later
        assert stranger.result() == ["ACQUIRED", ""]


# --- 4. another uid's task id -------------------------------------------------------------


def test_another_uids_task_is_neither_shown_nor_freed(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path
) -> None:
    cfg = config(tmp_path, f"[tenants.open]\ngpus = 1\n[tenants.listed]\ngpus = 1\nuids = [{NOBODY}]\n")
    d = daemon_factory("--simulate", "2", "--config", cfg)
    root = connect(d, "root")
    for task, tenant in [("t1", None), ("o1", "open"), ("l1", "listed")]:
        root.call(p.Allocate(id=root.next_id(), task_id=task, gpus=0.25, tenant=tenant))

    def stranger(line: Line) -> dict[str, Any]:
        conn = connect(d, "stranger")
        try:
            stolen: Any = conn.call(p.Allocate(id=conn.next_id(), task_id="t1", gpus=0.25))
        except ProtocolError as exc:
            stolen = [str(exc.code), exc.message]
        return {
            "allocate t1": stolen if isinstance(stolen, list) else msgspec.to_builtins(stolen),
            "free t1": outcome(conn, p.Free(id=0, task_id="t1")),
            "free o1": outcome(conn, p.Free(id=0, task_id="o1")),
            "free l1": outcome(conn, p.Free(id=0, task_id="l1")),
            "own open": outcome(conn, p.Allocate(id=0, task_id="n1", gpus=0.25, tenant="open")),
            "free own": outcome(conn, p.Free(id=0, task_id="n1")),
        }

    got = run_as(d, stranger)
    stolen = got["allocate t1"]
    assert isinstance(stolen, list) and stolen[0] == "permission_denied", stolen  # not the devices of t1
    assert "belongs to uid 0" in stolen[1]
    assert codes({k: v for k, v in got.items() if k != "allocate t1"}) == {
        "free t1": "permission_denied",
        "free o1": "permission_denied",  # a tenant without uids/gids lets anyone allocate, not free others' tasks
        "free l1": "ok",  # a listed member may
        "own open": "ok",
        "free own": "ok",
    }
    listing = root.call(p.ListAllocations(id=root.next_id()))
    assert sorted(a.task_id for a in listing.allocations) == ["o1", "t1"]


# --- 5. admin through a supplementary group -------------------------------------------------


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
        f"'mount -t tmpfs none /proc && exec \"$@\"' sh {sys.executable} \"$@\"\n"
    )
    wrapper.chmod(0o755)
    return str(wrapper)


def test_a_member_of_the_admin_group_through_a_supplementary_group_is_admin(
    daemon_factory: Callable[..., DaemonProcess], tmp_path: Path, hidden_proc: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    users = users_group()
    cfg = config(tmp_path, f'admin_group = "{users.gr_name}"\n')
    with monkeypatch.context() as m:
        if hidden_proc is not None:
            m.setattr(sys, "executable", hidden_proc)
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


# --- 6. control characters in names -----------------------------------------------------------


def send(conn: Connection, obj: dict[str, Any]) -> Any:
    conn.send_raw(p.frame(msgspec.msgpack.encode(obj)))
    return conn.recv(5)


def test_names_with_control_characters_are_refused_at_decode(daemon: DaemonProcess) -> None:
    conn = Connection(daemon.socket)
    hello: dict[str, Any] = {"type": "HELLO", "id": 1, "version": p.PROTOCOL_VERSION}
    bad_hellos: list[tuple[dict[str, Any], str]] = [
        ({"name": "evil\x1b[2J"}, "$.name"),
        ({"labels": {"team": "a\nb"}}, "$.labels"),
        ({"labels": {"te\x07am": "a"}}, "$.labels"),
    ]
    for bad, where in bad_hellos:
        err = send(conn, {**hello, **bad})
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.INVALID, err
        assert where in err.message, err.message
    assert isinstance(send(conn, {**hello, "name": "fine"}), p.Welcome)  # the connection goes on
    acquire = {"type": "ACQUIRE", "id": 2, "gpu": 0, "task_type": "OTHER"}
    err = send(conn, {**acquire, "trace": {"job_id": "j\r1"}})
    assert isinstance(err, p.Error) and err.code == p.ErrorCode.INVALID and "$.trace" in err.message, err
    clients = conn.call(p.ListClients(id=3)).clients
    assert [c.name for c in clients] == ["fine"]
    assert conn.call(p.ListLeases(id=4)).leases == []


# --- 7. reload: safe and complete ---------------------------------------------------------------


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
    cmd = [sys.executable, "-m", "gpud.main", "--socket", d.socket, "--log-format", "json", "--metrics-addr", "off",
           *d.args]
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
    from_file: tuple[DaemonProcess, Path]
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
