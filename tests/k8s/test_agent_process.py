"""``gpud-k8s`` as the process a DaemonSet runs: it publishes the node's slice, registers with the kubelet,
prepares a claim, answers /healthz, and stops on SIGTERM leaving the prepared claim as it was (the
kubelet unprepares it, or the next agent serves it); its command line refuses what it cannot use."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from gpud.tools.spawn import DaemonProcess
from gpud_client import Client
from gpud_k8s.claims import DRIVER
from gpud_k8s.slices import slice_name
from tests.integration.waiting import eventually

from .fake_apiserver import ThreadedFakeApiServer
from .fake_kubelet import Claim, KubeletThread
from .test_driver import NODE, resource_claim


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def healthz(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def test_the_agent_process_serves_a_node_and_stops_cleanly(
    daemon: DaemonProcess, apiserver: ThreadedFakeApiServer, fake_kubelet: KubeletThread
) -> None:
    root = Path(tempfile.mkdtemp(prefix="agent-", dir="/tmp"))
    port = free_port()
    uid = "0b9e4c1a-0000-4000-8000-0000000000a1"
    apiserver.put(resource_claim(uid, "half", 1, cores="50", memory="2Gi"))
    argv = [
        sys.executable, "-m", "gpud_k8s.main", "--node-name", NODE, "--gpud-socket", daemon.socket,
        "--api-server", apiserver.url, "--kubelet-dir", str(fake_kubelet.paths.root), "--cdi-dir", str(root / "cdi"),
        "--claims-dir", str(root / "claims"), "--state-dir", str(root / "state"), "--shares", "on",
        "--allow-simulated", "--publish-interval", "0.2", "--healthz", f"127.0.0.1:{port}",
    ]  # fmt: skip
    agent = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        eventually(lambda: apiserver.objects("resourceslices"), "the slice", timeout=30)
        assert apiserver.get("resourceslices", None, slice_name(NODE))["spec"]["devices"][1]["name"] == "gpu-1"
        eventually(lambda: healthz(port)[0] == 200, "/healthz 200", timeout=30)

        async def prepare() -> None:
            await fake_kubelet.wait_for_dra_driver(DRIVER)
            outcome = await fake_kubelet.prepare(DRIVER, [Claim("team-a", uid, "half")])
            assert outcome.ok, outcome.error

        asyncio.run(prepare())
        with Client(daemon.socket) as admin:
            admin.drain(0)  # republished with the GPU tainted
        eventually(
            lambda: "taints" in apiserver.get("resourceslices", None, slice_name(NODE))["spec"]["devices"][0],
            "the drained GPU's taint",
            timeout=30,
        )
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:  # beside /healthz
            metrics = r.read().decode()
        assert 'gpud_k8s_claim_info{claim="half",namespace="team-a",pause="freeze",recovery="terminate",' in metrics
        assert 'gpud_k8s_prepare_seconds_count{result="ok"} 1.0' in metrics
        agent.send_signal(signal.SIGTERM)
        out, _ = agent.communicate(timeout=30)
        assert agent.returncode == 0, out
        assert "gpud_k8s_stopped" in out
        assert (root / "claims" / uid / "gpud.sock").exists(), "a prepared claim stays prepared"
        assert not (fake_kubelet.paths.registration_socket(DRIVER)).exists(), "deregistered"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        shutil.rmtree(root, ignore_errors=True)


def test_the_command_line_says_what_is_missing(daemon: DaemonProcess) -> None:
    run = subprocess.run([sys.executable, "-m", "gpud_k8s.main"], capture_output=True, text=True, timeout=60, env={})
    assert run.returncode == 2 and "no node name: pass --node-name or set NODE_NAME" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "gpud_k8s.main", "--node-name", "n", "--gpud-socket", "/nonexistent/gpud.sock"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and "/nonexistent/gpud.sock" in run.stderr
