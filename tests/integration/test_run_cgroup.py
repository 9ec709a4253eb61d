"""A paused program cannot run: ``gpuctl run`` under a real daemon, real programs, real signals.

The probe is a helper process of the program's own uid, outside the run's tree (the test starts it),
that sends SIGCONT to the paused program and to a setsid'd, double-forked descendant of it
(``tests/programs/forker.py``) over and over. Whether they ran is read from the kernel: their CPU time
(utime + stime in /proc/PID/stat) must not grow while they are paused.

- with gpud's cgroup (``--pause auto`` where the daemon can write cgroup v2, as here: it runs as root),
  the program is frozen (cgroup.events ``frozen 1``): nothing runs, whatever the helper sends; it stays
  frozen across a daemon crash and restart until its run is granted again; when its run dies, the
  whole cgroup is killed (the setsid'd descendant included) and removed; a cgroup an earlier daemon
  left that no run claims is killed when the crash grace ends;
- with ``--pause signal`` the escape is caught: stopped again, counted, reported to gpud (gpuctl
  clients --json, ``gpud_run_escapes_total``), and the program is ended at ``--max-escapes``;
- a run cannot hand gpud a pid that is not its own descendant.

Every wait is on state, with a deadline; the helper's rounds are counted, and the CPU time compared
once it has sent enough.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpud.host.cgroups import MOUNTINFO, RunCgroups, Unavailable, cgroup2_mount, daemon_key, directory
from gpud.host.procs import start_time
from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p
from gpud_client.errors import ProtocolError
from gpud_client.proctl.tree import read_stat

from .test_run import BURNER, Run, gone, stopped
from .waiting import eventually

FORKER = str(Path(__file__).resolve().parents[1] / "programs" / "forker.py")
Daemons = Callable[..., DaemonProcess]
SIGCONTER = """\
import os, signal, sys, time
out, once, pids = sys.argv[1], sys.argv[2] == "once", [int(x) for x in sys.argv[3:]]
rounds = 0
while True:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    rounds += 1
    with open(out, "w") as f:
        f.write(str(rounds))
    if once:
        signal.pause()
    time.sleep(0.01)
"""


def _cgroups_usable() -> str | None:
    try:
        RunCgroups.probe("auto", "00000000")
    except (Unavailable, OSError) as exc:
        return str(exc)
    return None


NO_CGROUPS = _cgroups_usable()
needs_cgroups = pytest.mark.skipif(NO_CGROUPS is not None, reason=f"cgroup v2 is not writable here: {NO_CGROUPS}")


def cpu_ticks(pid: int) -> int:
    st = read_stat(pid)
    assert st is not None, f"process {pid} is gone"
    return st.cpu_ticks


def started(r: Run) -> tuple[int, int]:
    """The program's pid and its setsid'd descendant's."""
    found = eventually(lambda: [x.split() for x in r.lines() if x.startswith("orphan ")], f"{r.name} forked")
    return r.program_pid(), int(found[0][1])


def runs(d: DaemonProcess) -> dict[int, p.RunProgramInfo]:
    with Client(d.socket, name="test") as c:
        reply: p.RunsReply = c.call(p.ListRuns(id=0))
    return {r.pid: r for r in reply.runs}


def gpuctl_runs(d: DaemonProcess) -> dict[int, dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, "clients", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return {r["pid"]: r for r in json.loads(out.stdout)["runs"]}


def cgroup_dir(cgroup: str) -> Path:
    mount = cgroup2_mount(Path(MOUNTINFO).read_text())
    assert mount is not None
    found = directory(mount, cgroup)
    assert found is not None
    return Path(found)


def frozen_file(cgroup: str) -> bool:
    return "frozen 1" in (cgroup_dir(cgroup) / "cgroup.events").read_text()


def metric(d: DaemonProcess, name: str, **labels: str) -> float | None:
    lines = [json.loads(x) for x in d.log().splitlines() if x.startswith("{")]
    (listening,) = [e for e in lines if e.get("event") == "metrics_listening"]
    with urllib.request.urlopen(f"http://127.0.0.1:{listening['port']}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


@contextmanager
def sigconts(tmp_path: Path, *pids: int, once: bool = False) -> Iterator[Callable[[], int]]:
    """A helper of the same uid, outside the run's tree, sending SIGCONT to ``pids`` (every 10 ms, or
    once); yields how many rounds it has sent."""
    out = tmp_path / f"sigconts-{pids[0]}"
    helper = subprocess.Popen([sys.executable, "-c", SIGCONTER, str(out), "once" if once else "loop", *map(str, pids)])

    def rounds() -> int:
        try:
            return int(out.read_text() or 0)
        except FileNotFoundError:
            return 0

    try:
        yield rounds
    finally:
        helper.kill()
        helper.wait()


@pytest.fixture
def started_runs(tmp_path: Path) -> Iterator[Callable[..., Run]]:
    made: list[tuple[DaemonProcess, Run]] = []

    def start(d: DaemonProcess, name: str, *run_args: str, program: str = FORKER) -> Run:
        r = Run(d.socket, tmp_path, name, list(run_args), [sys.executable, program, str(tmp_path / f"{name}.txt")])
        made.append((d, r))
        return r

    yield start
    for d, r in made:
        end_run(d, r)


def end_run(d: DaemonProcess, r: Run) -> None:
    """Kill a run that is still there and, while its daemon is up, let gpud remove its cgroup: a
    stopping gpud leaves a cgroup that still holds processes, and this host's hierarchy is shared."""
    if r.proc.stderr is None or r.proc.stderr.closed:
        return  # ended and read already
    alive = d.proc is not None and d.proc.poll() is None
    cgroups = [cgroup_dir(x.cgroup) for x in runs(d).values() if x.cgroup] if alive and r.proc.poll() is None else []
    if r.proc.poll() is None:
        r.proc.kill()
    r.proc.communicate()
    eventually(lambda: not any(c.exists() for c in cgroups), "gpud removed the ended run's cgroup")


def holder(d: DaemonProcess) -> Client:
    return Client(d.socket, name="holder")


# --- gpud's cgroup ------------------------------------------------------------------------------------


@needs_cgroups
def test_sigcont_from_outside_wakes_neither_a_frozen_program_nor_its_setsid_descendant(
    daemon_factory: Daemons, started_runs: Callable[..., Run], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    r = started_runs(d, "frozen", "--pause", "auto")
    program, orphan = started(r)
    shown = eventually(lambda: runs(d).get(program), "gpud holds the program")
    assert shown.backend == "cgroup" and shown.cgroup.startswith("/"), shown
    eventually(lambda: cpu_ticks(program) > 0 and cpu_ticks(orphan) > 0, "both burn CPU")
    with holder(d) as c:
        s = c.session(0, idle_release=None, priority=10)
        with s.slice():  # a higher priority: the run is paused, its cgroup frozen by gpud
            eventually(lambda: runs(d)[program].state == "frozen", "the kernel says frozen")
            assert frozen_file(shown.cgroup) and runs(d)[program].processes == 2
            before = cpu_ticks(program), cpu_ticks(orphan)
            with sigconts(tmp_path, program, orphan) as rounds:
                eventually(lambda: rounds() >= 30, "30 rounds of SIGCONT to both")
                after = cpu_ticks(program), cpu_ticks(orphan)
            assert after == before, f"CPU ticks went from {before} to {after} while frozen"
            assert gpuctl_runs(d)[program]["state"] == "frozen"
            table = subprocess.run(
                [sys.executable, "-m", "gpud.tools.gpuctl", "--socket", d.socket, "clients"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            (row,) = [line.split() for line in table.split("RUNS")[1].splitlines() if str(program) in line]
            assert row[2:6] == ["cgroup", "frozen", "0", "paused"], table  # the kernel's word, then the run's
    eventually(lambda: cpu_ticks(orphan) > after[1] and cpu_ticks(program) > after[0], "thawed at its next turn")
    assert runs(d)[program].state == "running" and not frozen_file(shown.cgroup)


@needs_cgroups
def test_the_run_dying_kills_its_cgroup_whole_setsid_and_double_forked_descendants_included(
    daemon_factory: Daemons, started_runs: Callable[..., Run], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--metrics-addr", "127.0.0.1:0")
    r = started_runs(d, "dies", "--pause", "auto")
    program, orphan = started(r)
    where = cgroup_dir(eventually(lambda: runs(d).get(program), "held").cgroup)
    keeper = read_stat(program)
    assert keeper is not None and where.is_dir()
    # The run and its keeper both killed: no keeper is left to end the tree, the program dies of its
    # PDEATHSIG, and its setsid'd descendant (re-parented past them) would run on but for the cgroup.
    os.kill(r.proc.pid, signal.SIGKILL)
    os.kill(keeper.ppid, signal.SIGKILL)
    eventually(lambda: gone(program) and gone(orphan), "the program and its descendant killed", 15)
    eventually(lambda: not where.exists(), "the cgroup removed once empty")
    assert metric(d, "gpud_run_cgroup_kills_total", reason="run_gone") == 1
    assert '"run_cgroup_killed"' in d.log() and '"reason":"run_gone"' in d.log()


@needs_cgroups
def test_a_frozen_program_stays_frozen_across_a_daemon_crash_until_its_run_is_granted_again(
    daemon_factory: Daemons, started_runs: Callable[..., Run], tmp_path: Path
) -> None:
    args = ("--simulate", "1", "--mode", "serial", "--tq", "30")
    d = daemon_factory(*args)
    r = started_runs(d, "survives", "--pause", "auto")
    program, orphan = started(r)
    cgroup = eventually(lambda: runs(d).get(program), "held").cgroup
    with holder(d) as c:
        c.session(0, idle_release=None, priority=10).acquire()  # held until gpud goes
        eventually(lambda: frozen_file(cgroup), "frozen")
        assert d.proc is not None
        d.proc.kill()  # a crash: nothing of gpud's runs any more
        d.proc.wait()
    again = DaemonProcess(*args, workdir=d.workdir)
    try:
        before = cpu_ticks(program), cpu_ticks(orphan)
        with sigconts(tmp_path, program, orphan) as rounds:
            eventually(lambda: rounds() >= 20, "SIGCONT while gpud is away")
            assert (cpu_ticks(program), cpu_ticks(orphan)) == before and frozen_file(cgroup)
        again.start()
        claimed = eventually(lambda: (x := runs(again).get(program)) and x.client_id, "its run claims it again")
        with Client(again.socket, name="test") as c:
            reply: p.ClientsReply = c.call(p.ListClients(id=0))
        assert claimed == next(x.client_id for x in reply.clients if x.name == "survives")  # the run, no other
        assert frozen_file(cgroup) or runs(again)[program].state == "running"  # frozen until it is granted
        eventually(lambda: runs(again)[program].state == "running", "granted again: thawed", 20)
        eventually(lambda: cpu_ticks(program) > before[0], "it runs again")
        assert '"run_claimed"' in again.log()
    finally:
        end_run(again, r)
        again.stop()


@needs_cgroups
def test_a_cgroup_left_over_that_no_run_claims_is_killed_when_the_crash_grace_ends(tmp_path: Path) -> None:
    d = DaemonProcess("--simulate", "1", "--config", str(tmp_path / "gpud.toml"))
    (tmp_path / "gpud.toml").write_text("crash_grace_s = 0.5\n")
    base = RunCgroups.probe("auto", daemon_key(os.path.join(d.workdir, "state")))
    sleeper = subprocess.Popen([sys.executable, "-c", "import signal; signal.pause()"])
    start = start_time(sleeper.pid)
    assert start is not None
    left = base.create(sleeper.pid, start)
    left.move(sleeper.pid)
    try:
        d.start()
        eventually(lambda: sleeper.poll() is not None, "the unclaimed leftover killed", 15)
        assert sleeper.returncode == -signal.SIGKILL
        eventually(lambda: not os.path.exists(left.path), "and removed")
        assert '"run_cgroup_left_over"' in d.log() and '"reason":"unclaimed"' in d.log()
    finally:
        sleeper.kill()
        sleeper.wait()
        left.remove()
        d.cleanup()


# --- the signal backend's watch -------------------------------------------------------------------------


def test_an_escape_from_a_signal_pause_is_caught_stopped_again_and_reported(
    daemon_factory: Daemons, started_runs: Callable[..., Run], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30", "--metrics-addr", "127.0.0.1:0")
    trace = tmp_path / "trace.jsonl"
    r = started_runs(d, "escapes", "--pause", "signal", "--max-escapes", "0", "--trace", str(trace), program=BURNER)
    pid = r.program_pid()
    assert eventually(lambda: runs(d).get(pid), "gpud knows the program").backend == "signal"
    with holder(d) as c:
        s = c.session(0, idle_release=None, priority=10)
        with s.slice():
            eventually(lambda: stopped(pid) and runs(d)[pid].state == "stopped", "stopped, as the kernel says")
            with sigconts(tmp_path, pid, once=True) as rounds:
                eventually(lambda: rounds() == 1, "one SIGCONT from outside")
                eventually(lambda: gpuctl_runs(d)[pid]["escapes"] == 1, "the escape reported to gpud")
                eventually(lambda: stopped(pid), "stopped again")
            assert runs(d)[pid].state == "stopped" and metric(d, "gpud_run_escapes_total") == 1
            events = [json.loads(x) for x in trace.read_text().splitlines()]
            assert any(e.get("event") == "escape" and e["pid"] == pid for e in events), events
            assert any(e.get("action") == "reportescape" and e["escapes"] == 1 for e in events), events
            assert r.proc.poll() is None  # --max-escapes 0: it goes on, paused


def test_a_program_that_keeps_escaping_is_ended_at_max_escapes(
    daemon_factory: Daemons, started_runs: Callable[..., Run], tmp_path: Path
) -> None:
    d = daemon_factory("--simulate", "1", "--mode", "serial", "--tq", "30")
    r = started_runs(d, "escaper", "--pause", "signal", "--max-escapes", "3", program=BURNER)
    pid = r.program_pid()
    with holder(d) as c:
        s = c.session(0, idle_release=None, priority=10)
        with s.slice():
            eventually(lambda: stopped(pid), "paused")
            with sigconts(tmp_path, pid):
                assert r.wait() == 1
    assert "--max-escapes 3 ends it" in r.err, r.err
    eventually(lambda: gone(pid), "the program ended")


# --- what a run may hand gpud -----------------------------------------------------------------------------


def test_a_run_cannot_hand_gpud_a_pid_that_is_not_its_own_descendant(daemon_factory: Daemons) -> None:
    d = daemon_factory("--simulate", "1")
    with Client(d.socket, name="not-a-run") as c:
        for pid, why in [
            (os.getppid(), "is not a descendant of the run"),  # of this uid, but this process's parent
            (1, "is init"),
            (d.proc.pid if d.proc else 1, "is gpud itself"),
        ]:
            with pytest.raises(ProtocolError, match=why) as refused:
                c.call(p.Contain(id=0, pid=pid))
            assert refused.value.code == p.ErrorCode.PERMISSION_DENIED
        with pytest.raises(ProtocolError, match="CONTAIN it first") as refused:
            c.call(p.Freeze(id=0))
        assert refused.value.code == p.ErrorCode.INVALID
        assert runs(d) == {}  # nothing was held
