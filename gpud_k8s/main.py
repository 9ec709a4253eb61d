"""``gpud-k8s``: gpud's Kubernetes node agent, beside gpud on each GPU node (docs/kubernetes.md).

    gpud-k8s --node-name "$NODE_NAME" [--gpud-socket /run/gpud/gpud.sock] [--healthz :8081]

It connects to gpud as an admin client, publishes the node's ResourceSlice, registers gpud's DRA
kubelet plugin and serves it, until SIGTERM or SIGINT. In a pod it reaches the API server with its
service account; elsewhere with ``--kubeconfig`` (or ``--api-server URL``, plain HTTP, for tests).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpud_client.aio import AsyncClient
from gpud_client.errors import GpudError
from gpud_client.proctl.base import Backend
from gpud_k8s import kube as kube_api
from gpud_k8s import kubelet_api as k
from gpud_k8s.claims import DRIVER
from gpud_k8s.containers import Hierarchy
from gpud_k8s.deviceplugin import SeatPlugin
from gpud_k8s.driver import Driver, nvidia_cdi_ids
from gpud_k8s.keeping import CHECK_S, FIND_S, Keepers
from gpud_k8s.metrics import AgentMetrics
from gpud_k8s.plugin import KubeletPlugin
from gpud_k8s.prepared import PreparedClaims
from gpud_k8s.publisher import Publisher

log = structlog.get_logger("gpud_k8s")
SHARES_FROM = (1, 36)  # consumable capacity (DRAConsumableCapacity) is on by default from Kubernetes 1.36
REASSERT_S = 10.0  # how often each prepared claim's socket is asked for again (gpud may have restarted)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="gpud-k8s", description=__doc__.split("\n\n")[0])
    ap.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    ap.add_argument("--gpud-socket", default=os.environ.get("GPUD_SOCKET", "/run/gpud/gpud.sock"))
    ap.add_argument("--kubelet-dir", default=str(k.KUBELET_ROOT), help="the kubelet's root directory")
    ap.add_argument("--cdi-dir", default="/var/run/cdi", help="where the claims' CDI specs are written")
    ap.add_argument("--claims-dir", default="/run/gpud/claims", help="each claim's socket directory, below this")
    ap.add_argument("--state-dir", default="/var/lib/gpud-k8s", help="the prepared claims' records")
    ap.add_argument("--kubeconfig", help="reach the API server with this kubeconfig (default: in-cluster)")
    ap.add_argument("--api-server", help=argparse.SUPPRESS)  # a plain http:// URL (tests)
    ap.add_argument(
        "--shares",
        choices=("auto", "on", "off"),
        default="auto",
        help="publish GPUs shared by capacity (cores, memory): auto from Kubernetes 1.36",
    )
    ap.add_argument("--allow-simulated", action="store_true", help="publish gpud's simulated GPUs (tests, demos)")
    ap.add_argument("--publish-interval", type=float, default=5.0, help="seconds between reads of gpud's GPUs")
    ap.add_argument("--healthz", default=":8081", help="HOST:PORT of /healthz and /metrics ('' for none)")
    ap.add_argument(
        "--cgroup-root",
        help="where the node's pod cgroups are looked for (default: the cgroup2 mount: kubepods below it)",
    )
    ap.add_argument(
        "--find-interval", type=float, default=FIND_S, help="seconds between looks for the claims' containers"
    )
    ap.add_argument(
        "--seats",
        type=int,
        default=0,
        metavar="N",
        help="clusters without DRA: serve gpud.io/gpu-seat, N equal seats per GPU, as a device plugin (no DRA driver)",
    )
    return ap


async def serve_healthz(
    address: str, healthy: dict[str, Callable[[], bool]], metrics: AgentMetrics | None = None
) -> asyncio.Server | None:
    """``GET /healthz``: 200 while gpud answers and the kubelet registered the plugin, else 503;
    ``GET /metrics``: the agent's series (``gpud_k8s.metrics``), in Prometheus' text format."""
    if not address:
        return None
    host, _, port = address.rpartition(":")

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
            async with asyncio.timeout(5):
                line = await reader.readline()
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                    pass
            path = line.split()[1:2]
            kind = b"text/plain"
            if metrics is not None and path == [b"/metrics"]:
                status, body, kind = b"200 OK", generate_latest(metrics.registry), CONTENT_TYPE_LATEST.encode()
            elif path != [b"/healthz"]:
                status, body = b"404 Not Found", b"only /healthz and /metrics\n"
            elif failing := [name for name, check in healthy.items() if not check()]:
                status, body = b"503 Service Unavailable", ("not ready: " + ", ".join(failing) + "\n").encode()
            else:
                status, body = b"200 OK", b"ok\n"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + kind
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body
            )
            await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, host or None, int(port))


async def serve_until_stopped(*loops: Coroutine[Any, Any, None]) -> None:
    """Run ``loops`` until SIGTERM or SIGINT; then cancel them and wait for their end."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.create_task(c) for c in loops]
    try:
        await stop.wait()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run(args: argparse.Namespace) -> int:
    if not args.node_name:
        print("gpud-k8s: no node name: pass --node-name or set NODE_NAME", file=sys.stderr)
        return 2
    node: str = args.node_name
    try:
        gpud = await AsyncClient.connect(args.gpud_socket, name="gpud-k8s", labels={"node": node})
    except GpudError as exc:
        print(f"gpud-k8s: {exc}", file=sys.stderr)
        return 1
    if args.seats:
        return await run_seats(args, gpud)
    api = await kube_api.connect(args.kubeconfig, args.api_server)
    kube = kube_api.Kube(api)
    shared = {"on": True, "off": False}.get(args.shares)
    if shared is None:
        shared = await kube.server_version() >= SHARES_FROM
    status = await gpud.status()
    uuids = {g.index: g.uuid for g in status.gpus}
    try:
        hierarchy = Hierarchy.here()
    except OSError as exc:
        print(f"gpud-k8s: {exc}", file=sys.stderr)
        return 1
    paths = k.KubeletPaths(Path(args.kubelet_dir))
    metrics = AgentMetrics()
    keepers = Keepers(
        node=node,
        gpud=gpud,
        gpud_socket=args.gpud_socket,
        kube=kube,
        cgroup_root=Path(args.cgroup_root) if args.cgroup_root else hierarchy.point,
        hierarchy=hierarchy,
        pod_resources=paths.pod_resources_socket,
        cuda=cuda_backend,
        metrics=metrics,
        find_s=args.find_interval,
    )
    await gpud.add_allocation_listener(keepers.push)
    driver = Driver(
        node,
        gpud,
        kube,
        PreparedClaims(Path(args.state_dir) / "claims"),
        cdi_dir=Path(args.cdi_dir),
        claims_dir=Path(args.claims_dir),
        uuids=uuids.get,
        nvidia=nvidia_cdi_ids((Path("/etc/cdi"), Path("/var/run/cdi"))),
        keepers=keepers,
        metrics=metrics,
    )
    await driver.recover()
    publisher = Publisher(
        kube,
        gpud,
        node,
        shared=shared,
        node_uid=await kube.node_uid(node),
        allow_simulated=args.allow_simulated,
        interval_s=args.publish_interval,
    )
    await publisher.start()
    plugin = KubeletPlugin(driver, paths)
    await plugin.start()
    gpud_ok = [True]  # the last reassertion reached gpud
    healthz = await serve_healthz(
        args.healthz, {"gpud": lambda: gpud_ok[0], "kubelet": plugin.registration.registered.is_set}, metrics
    )
    log.info("gpud_k8s_started", node=node, driver=DRIVER, shared=shared, prepared=len(driver.claims()))

    async def keep() -> None:
        while True:
            await asyncio.sleep(REASSERT_S)
            try:
                await driver.reassert()
                gpud_ok[0] = True
            except Exception as exc:
                gpud_ok[0] = False
                log.warning("claims_reassert_failed", error=str(exc))

    async def check() -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await keepers.check()
            except Exception as exc:
                log.warning("claims_check_failed", error=str(exc))

    try:
        await serve_until_stopped(publisher.run(), keep(), keepers.watch(), check())
    finally:
        await plugin.stop()
        await keepers.close()
        if healthz is not None:
            healthz.close()
        await kube.close()
        await gpud.close()
        log.info("gpud_k8s_stopped", node=node)
    return 0


def cuda_backend() -> Backend | None:
    """The CUDA driver's checkpoint lock, for claims whose ``pause`` is ``cuda``, where this node's driver
    has it; else None (the cgroup freezer alone), said in the log."""
    from gpud_client.proctl.cuda import CudaBackend, CudaDriver

    driver = CudaDriver()
    why_not = driver.probe()
    if why_not is None:
        return CudaBackend(driver=driver)
    driver.close()
    log.warning("cuda_pause_unavailable", why=why_not, instead="the cgroup freezer alone")
    return None


async def run_seats(args: argparse.Namespace, gpud: AsyncClient) -> int:
    """The device-plugin fallback alone: seats made in gpud, registered with the kubelet, kept registered;
    a seat taken back has its pod evicted (where the API server can be reached)."""
    kube: kube_api.Kube | None = None
    try:
        kube = kube_api.Kube(await kube_api.connect(args.kubeconfig, args.api_server))
    except Exception as exc:  # (outside a pod, no kubeconfig): seats all the same, no evictions
        log.warning("api_server_unavailable", error=str(exc), instead="seats taken back are not evicted")
    plugin = SeatPlugin(
        gpud,
        k.KubeletPaths(Path(args.kubelet_dir)),
        Path(args.claims_dir),
        args.seats,
        nvidia=nvidia_cdi_ids((Path("/etc/cdi"), Path("/var/run/cdi"))),
        interval_s=args.publish_interval,
        kube=kube,
    )
    await gpud.add_allocation_listener(plugin.push)
    await plugin.make_seats()
    await plugin.start()
    try:
        await serve_until_stopped(plugin.watch_gpus(), plugin.keep_registered())
    finally:
        await plugin.close()
        if kube is not None:
            await kube.close()
        await gpud.close()
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    sys.exit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
