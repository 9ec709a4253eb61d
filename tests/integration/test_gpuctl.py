"""gpuctl against a real daemon: its commands, output, errors and exit statuses.

gpuctl's ``main`` runs in this process with its own argument list, environment, standard
output and error (as a separate process would see them), so the many cases cost no
interpreter start each; one test runs the installed ``gpuctl`` script as a user does."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gpud.tools.gpuctl import main
from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_client import protocol as p

from .wire import attach, connect, request, take_lock, wait_queue


def gpuctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``gpuctl ARGS`` run by its ``main`` in this process: what it printed and its exit status."""
    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's --help
                code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["gpuctl", *args], code, out.getvalue(), err.getvalue())


def test_the_installed_script_is_gpuctl(daemon: DaemonProcess) -> None:
    script = Path(sys.executable).with_name("gpuctl")
    out = subprocess.run(
        [str(script), "--socket", daemon.socket, "status", "--json"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["gpus"]) == 2
    bad = subprocess.run([str(script), "status", "--bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


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
    assert out.returncode == 2 and "the time quantum must be 0.001..86400 seconds, got -3" in out.stderr
    out = gpuctl("tq", "soon", "--socket", daemon.socket)
    assert out.returncode == 2 and "the time quantum must be 0.001..86400 seconds, got 'soon'" in out.stderr
    out = gpuctl("sched", "maybe", "--socket", daemon.socket)
    assert out.returncode == 2 and "invalid choice" in out.stderr
    before = json.loads(gpuctl("status", "--json", "--socket", daemon.socket).stdout)
    assert [g["tq_s"] for g in before["gpus"]] == [30.0, 30.0]


def test_no_daemon_is_reported(tmp_path: object) -> None:
    out = gpuctl("status", "--socket", "/tmp/gpud-absent/gpud.sock")
    assert out.returncode == 1
    assert "cannot connect to gpud at /tmp/gpud-absent/gpud.sock" in out.stderr


ABSENT = "/tmp/gpud-absent/gpud.sock"  # nothing listens: a check that connected first would say so


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["alloc", "--task", "t", "--gpus", "-1"],
            "argument --gpus: must be a whole number of GPUs >= 1 or a fraction",
        ),
        (["alloc", "--task", "t", "--gpus", "1.5"], "argument --gpus: must be a whole number of GPUs >= 1"),
        (["alloc", "--task", "t", "--gpus", "0.00001"], "argument --gpus: gpus 1e-05 is finer than 1/10000 of a GPU"),
        (["alloc", "--task", "t", "--gpus", "2000"], "argument --gpus: must be at most 1024 GPUs"),
        (["alloc", "--task", "t", "--gpus", "inf"], "argument --gpus: must be a whole number of GPUs >= 1"),
        (["alloc", "--task", "t", "--gpus", "0"], "argument --gpus: 0 asks for no GPU: add --cpus N"),
        (["alloc", "--task", "t", "--cpus", "-1"], "argument --cpus: must be 0..100000 CPU cores, got -1"),
        (["alloc", "--task", "t", "--wait=-3"], "argument --wait: must be 0..86400 seconds, got -3"),
        (["alloc", "--task", "t", "--wait", "-3"], "argument --wait: must be 0..86400 seconds, got -3"),
        (["alloc", "--task", "t", "--wait", "86401"], "argument --wait: must be 0..86400 seconds, got 86401"),
        (["alloc", "--task", "t", "--wait", "soon"], "argument --wait: must be 0..86400 seconds, got 'soon'"),
        (["tq", "0.0001"], "argument SECONDS: the time quantum must be 0.001..86400 seconds, got 0.0001"),
        (["tq", "90000"], "argument SECONDS: the time quantum must be 0.001..86400 seconds, got 90000"),
        (["alloc", "--task", "t", "--owner-pid", "99999999"], "argument --owner-pid: must be a process id 1..4194304"),
        (["alloc", "--task", "t", "--owner-pid", "0"], "argument --owner-pid: must be a process id 1..4194304"),
        (
            ["alloc", "--task", "t", "--owner-pid", str(p.PID_MAX)],  # pids stay below pid_max, at most PID_MAX
            f"argument --owner-pid: no process {p.PID_MAX} on this machine: gpud would reclaim the allocation at once",
        ),
        (
            ["alloc", "--task", "etl 1"],
            "argument --task: a task id may not contain a space, got 'etl 1' (allowed: letters",
        ),
        (["free", "--task", "etl\x071"], "argument --task: a task id may not contain a control character (\\x07)"),
        (["alloc", "--task", "x" * 300], "argument --task: a task id must be at most 256 characters, got 300"),
        (
            ["alloc", "--task", "t", "--tenant", "a\nb"],
            "argument --tenant: a tenant name may not contain a control char",
        ),
        (
            ["alloc", "--task", "t", "--prefer", "1,,2"],
            "argument --prefer: must be a GPU index 0..1023, gpu:N or a GPU",
        ),
        (["tq", "5", "--gpu", "x y"], "argument --gpu: must be a GPU index 0..1023"),
        (["limit", "trainer"], "nothing to change: give --core PERCENT and/or --mem SIZE"),
        (
            ["limit", "trainer", "--mem", "-1GiB"],
            "argument --mem: not a size: '-1GiB' is negative, and negative sizes are not allowed",
        ),
        (
            ["limit", "trainer", "--mem=-1GiB"],
            "argument --mem: not a size: '-1GiB' is negative, and negative sizes are not allowed",
        ),
        (["limit", "trainer", "--core", "0"], "argument --core: must be 1..100 percent of GPU time, got 0"),
        (["limit", "0", "--core", "5"], "argument CLIENT: must be a client id (1 or more) or a client name"),
        (
            ["policy", "ASR", "--queue-limit", "-1"],
            "argument --queue-limit: must be 0..100000 waiting requests, got -1",
        ),
        (["policy", "--max-wait", "5"], "name the task type whose policy to change"),
        (["policy", "A S R"], "argument TASK_TYPE: a task type may not contain a space"),
        (["top", "--count", "0"], "argument --count: must be a whole number >= 1"),
    ],
)
def test_bad_input_is_usage_named_by_its_flag_before_connecting(args: list[str], needle: str) -> None:
    out = gpuctl(*args, "--socket", ABSENT)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert needle in out.stderr, out.stderr
    assert "cannot connect" not in out.stderr
    out = gpuctl(*args, "--socket", ABSENT, "--json")
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    error = json.loads(out.stderr)["error"]
    assert error["code"] == "usage" and needle in error["message"], error


def test_json_errors_for_refusals_and_an_absent_daemon(daemon: DaemonProcess) -> None:
    with Client(daemon.socket) as c:
        c.allocate("hog", gpus=2)
    out = gpuctl("alloc", "--task", "late", "--json", "--socket", daemon.socket)
    assert (out.returncode, out.stdout) == (1, ""), out.stderr
    assert json.loads(out.stderr) == {
        "error": {
            "code": "insufficient",
            "message": "1 whole GPU(s) asked, 0 entirely free now; "
            "nothing could be taken back: hog: not of a lower priority than 50",
        }
    }
    out = gpuctl("--json", "tq", "5", "--gpu", "7", "--socket", daemon.socket)
    assert out.returncode == 1 and json.loads(out.stderr)["error"]["code"] == "unknown_gpu"
    out = gpuctl("status", "--json", "--socket", ABSENT)
    assert (out.returncode, out.stdout) == (1, ""), out.stderr
    error = json.loads(out.stderr)["error"]
    assert error["code"] == "unavailable" and f"cannot connect to gpud at {ABSENT}" in error["message"]
    out = gpuctl("--json", "bogus")
    assert out.returncode == 2 and json.loads(out.stderr)["error"]["code"] == "usage"


def test_version_names_gpuctl_gpud_and_the_client() -> None:
    gpud, client = importlib.metadata.version("gpud"), importlib.metadata.version("gpud-client")
    out = gpuctl("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"gpuctl {gpud} (gpud {gpud}), gpud-client {client}, protocol {p.PROTOCOL_VERSION}\n"
    out = gpuctl("--json", "--version")
    assert out.returncode == 0 and json.loads(out.stdout) == {
        "gpuctl": gpud,
        "gpud": gpud,
        "gpud_client": client,
        "protocol": p.PROTOCOL_VERSION,
    }


def test_status_shows_the_mode_with_the_scheduler_off_and_the_reserve(daemon: DaemonProcess) -> None:
    assert gpuctl("mode", "serial", "--gpu", "1", "--socket", daemon.socket).returncode == 0
    assert gpuctl("sched", "off", "--gpu", "1", "--socket", daemon.socket).returncode == 0
    out = gpuctl("status", "--socket", daemon.socket)
    assert out.returncode == 0, out.stderr
    head, header, gpu0, gpu1 = out.stdout.splitlines()
    assert head.endswith("; usable memory is total less the 10% reserve")  # the daemon's default reserve
    assert "MEMORY USED/USABLE" in header
    assert "  auto  " in gpu0 and "  serial (sched off)  " in gpu1
    assert "0B/14.4GiB of 16GiB" in gpu0 and "0B/14.4GiB of 16GiB" in gpu1
    data = json.loads(gpuctl("status", "--json", "--socket", daemon.socket).stdout)
    assert [(g["mode"], g["scheduler_on"]) for g in data["gpus"]] == [("auto", True), ("serial", False)]


def test_no_reserve_shows_the_total(daemon_factory: Callable[..., DaemonProcess], tmp_path: Path) -> None:
    cfg = tmp_path / "gpud.toml"
    cfg.write_text("memory_reserve_percent = 0\n")
    d = daemon_factory("--simulate", "1x8GiB", "--config", str(cfg))
    out = gpuctl("status", "--socket", d.socket)
    head, _, gpu0 = out.stdout.splitlines()
    assert head.endswith("; usable memory is the total (no reserve)") and " 0B/8GiB " in gpu0


def test_tq_sched_and_mode_say_what_is_now_true(daemon: DaemonProcess) -> None:
    def said(*args: str) -> str:
        out = gpuctl(*args, "--socket", daemon.socket)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert said("sched", "off") == "the scheduler is off for every GPU: every request is granted at once\n"
    assert said("sched", "on", "--gpu", "1") == "the scheduler is on for GPU 1\n"
    assert (
        said("sched", "off", "--gpu", "gpu:0") == "the scheduler is off for GPU 0: every request is granted at once\n"
    )
    assert said("sched", "on") == "the scheduler is on for every GPU\n"
    assert said("mode", "serial", "--gpu", "1") == "GPU 1 is in serial mode\n"
    assert said("mode", "auto") == "every GPU is in auto mode\n"
    assert said("tq", "2.5", "--gpu", "1") == "the time quantum is 2.5s on GPU 1\n"
    assert said("tq", "30") == "the time quantum is 30s on every GPU\n"
    uuid = json.loads(said("status", "--json"))["gpus"][1]["uuid"]
    assert said("mode", "concurrent", "--gpu", uuid) == f"{uuid} is in concurrent mode\n"
    data = json.loads(said("status", "--json"))
    assert [(g["scheduler_on"], g["mode"], g["tq_s"]) for g in data["gpus"]] == [
        (True, "auto", 30.0),
        (True, "concurrent", 30.0),
    ]


NO_GPU = "must be a GPU index 0..1023, gpu:N or a GPU's UUID, got '-1'"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["drain", "-1"], f"gpuctl drain: error: argument GPU: {NO_GPU}"),
        (["undrain", "-1"], f"gpuctl undrain: error: argument GPU: {NO_GPU}"),
        (["drain", "gpu:-1"], "argument GPU: must be a GPU index 0..1023, gpu:N or a GPU's UUID, got 'gpu:-1'"),
        (["drain", "cuda0"], "argument GPU: must be a GPU index 0..1023, gpu:N or a GPU's UUID, got 'cuda0'"),
        (["tq", "5", "--gpu", "-1"], f"gpuctl tq: error: argument --gpu: {NO_GPU}"),
        (["tq", "5", "--gpu=-1"], f"gpuctl tq: error: argument --gpu: {NO_GPU}"),
        (["sched", "on", "--gpu", "-1"], f"gpuctl sched: error: argument --gpu: {NO_GPU}"),
        (["mode", "serial", "--gpu", "-1"], f"gpuctl mode: error: argument --gpu: {NO_GPU}"),
        (["limit", "trainer", "--core", "5", "--gpu", "-1"], f"gpuctl limit: error: argument --gpu: {NO_GPU}"),
        (["alloc", "--task", "t", "--prefer", "0,-1"], f"gpuctl alloc: error: argument --prefer: {NO_GPU}"),
    ],
)
def test_what_names_no_gpu_is_usage_before_connecting(args: list[str], needle: str) -> None:
    out = gpuctl(*args, "--socket", ABSENT)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert needle in out.stderr, out.stderr
    assert "cannot connect" not in out.stderr


def test_drain_minus_one_is_usage_not_the_daemons_unknown_gpu(daemon: DaemonProcess) -> None:
    out = gpuctl("drain", "-1", "--socket", daemon.socket)
    assert (out.returncode, out.stdout) == (2, ""), out.stderr
    assert out.stderr.splitlines() == [
        "usage: gpuctl drain [-h] [--socket SOCKET] [--json] GPU",
        f"gpuctl drain: error: argument GPU: {NO_GPU}",
    ]
    out = gpuctl("drain", "-1", "--json", "--socket", daemon.socket)
    assert out.returncode == 2 and json.loads(out.stderr)["error"] == {
        "code": "usage",
        "message": f"argument GPU: {NO_GPU}",
    }
    data = json.loads(gpuctl("status", "--json", "--socket", daemon.socket).stdout)
    assert [g["draining"] for g in data["gpus"]] == [False, False]
