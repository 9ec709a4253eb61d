"""gpuctl as a user runs it: a real process against a real daemon."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from gpud.spawn import DaemonProcess

from .wire import attach, connect, request, take_lock, wait_queue


def gpuctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpud.cli", *args], capture_output=True, text=True, timeout=30, env=env
    )


def test_status_json_reports_every_gpu_with_holder_and_queue(daemon: DaemonProcess) -> None:
    a, b = connect(daemon, "holder"), connect(daemon, "waiter")
    sa, sb = attach(a), attach(b)
    take_lock(a, sa)
    request(b, sb)
    wait_queue(a, [sb])
    out = gpuctl("status", "--json", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert [g["index"] for g in data["gpus"]] == [0, 1]
    g0 = data["gpus"][0]
    assert g0["mode"] == "auto" and g0["tq_s"] == 30.0 and g0["scheduler_on"] is True
    assert [(h["name"], h["session"]) for h in g0["holders"]] == [("holder", sa)]
    assert [(w["name"], w["session"]) for w in g0["queue"]] == [("waiter", sb)]
    assert g0["clients"] == 2
    assert data["gpus"][1]["holders"] == [] and data["gpus"][1]["queue"] == []


def test_status_table_for_people(daemon: DaemonProcess) -> None:
    a = connect(daemon, "trainer")
    take_lock(a, attach(a))
    out = gpuctl("--socket", daemon.socket, "status")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].split()[:4] == ["GPU", "NAME", "MODE", "TQ"]
    assert "trainer[" in lines[2] and "auto" in lines[2]


def test_socket_from_the_environment(daemon: DaemonProcess) -> None:
    out = gpuctl("status", "--json", env={**os.environ, "GPUD_SOCKET": daemon.socket})
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["gpus"]) == 2


def test_clients_lists_sessions(daemon: DaemonProcess) -> None:
    a = connect(daemon, "nb")
    take_lock(a, attach(a, gpu=1))
    out = gpuctl("clients", "--json", "--socket", daemon.socket)
    data = json.loads(out.stdout)
    nb = [c for c in data["clients"] if c["name"] == "nb"][0]
    assert nb["pid"] == os.getpid()
    assert [(s["gpu"], s["state"], s["grants"]) for s in nb["sessions"]] == [(1, "holding", 1)]
    table = gpuctl("clients", "--socket", daemon.socket).stdout
    assert "nb" in table and "holding" in table


def test_tq_and_sched_change_the_daemon(daemon: DaemonProcess) -> None:
    assert gpuctl("tq", "2.5", "--gpu", "1", "--socket", daemon.socket).returncode == 0
    assert gpuctl("sched", "off", "--gpu", "gpu:0", "--socket", daemon.socket).returncode == 0
    data = json.loads(gpuctl("status", "--json", "--socket", daemon.socket).stdout)
    assert [g["tq_s"] for g in data["gpus"]] == [30.0, 2.5]
    assert [g["scheduler_on"] for g in data["gpus"]] == [False, True]
    out = gpuctl("sched", "on", "--json", "--socket", daemon.socket)
    assert json.loads(out.stdout) == {"ok": True, "scheduler_on": True, "gpu": None}


def test_errors_name_the_problem_and_exit_non_zero(daemon: DaemonProcess) -> None:
    out = gpuctl("tq", "5", "--gpu", "7", "--socket", daemon.socket)
    assert out.returncode == 1 and "unknown GPU '7'" not in out.stdout
    assert "unknown_gpu" in out.stderr and "7" in out.stderr
    out = gpuctl("tq", "-3", "--socket", daemon.socket)
    assert out.returncode == 2 and "seconds must be > 0" in out.stderr
    out = gpuctl("tq", "soon", "--socket", daemon.socket)
    assert out.returncode == 2 and "not a number of seconds: 'soon'" in out.stderr
    out = gpuctl("sched", "maybe", "--socket", daemon.socket)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    before = json.loads(gpuctl("status", "--json", "--socket", daemon.socket).stdout)
    assert [g["tq_s"] for g in before["gpus"]] == [30.0, 30.0]


def test_no_daemon_is_reported(tmp_path: object) -> None:
    out = gpuctl("status", "--socket", "/tmp/gpud-absent/gpud.sock")
    assert out.returncode == 1
    assert "cannot connect to gpud at /tmp/gpud-absent/gpud.sock" in out.stderr
