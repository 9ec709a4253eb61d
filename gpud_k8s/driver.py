"""Preparing and unpreparing claims on this node: the DRA driver's work, apart from gRPC.

Prepare (the kubelet's NodePrepareResources, for each claim):

1. the ResourceClaim is read from the API server (the request names only its namespace, name and
   uid; a claim whose uid differs was deleted and made again: refused);
2. ``claims.plan`` reads what the scheduler allocated and the claim's configuration;
3. a record ``preparing`` is written (``prepared.PreparedClaims``), before anything is made;
4. gpud allocates exactly the scheduled GPUs (strategy ``only``) to ``k8s-<uid>``, in the tenant of
   the namespace's name where gpud has one (its quota counts the claim), with the share and memory
   as ceilings and the config's class and recovery;
5. gpud listens on the claim's own socket, ``<claims dir>/<uid>/gpud.sock``;
6. the claim's CDI spec is written (atomically): the socket's directory, ``GPUD_SOCKET``,
   ``GPUD_TASK_ID``; the GPU from NVIDIA's CDI devices where the node has them;
7. the record becomes ``prepared``, and the kubelet is answered with the devices and CDI ids.

Everything is idempotent: a claim prepared already is answered from its record (its socket opened
again, should gpud have restarted). Unprepare undoes the same steps in reverse from the record alone
(the claim may be gone from the API server); an unknown claim unprepares as success. At start,
``recover`` undoes what a crash left ``preparing`` (the kubelet prepares it again) and reopens the
sockets of what is prepared. A claim gpud cannot serve is refused with a message naming what and
why, which the kubelet shows in the pod's events.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import msgspec
import structlog
from prometheus_client import Histogram

from gpud_client import protocol as p
from gpud_client.errors import ProtocolError
from gpud_k8s.cdi import SOCKET_NAME, claim_spec, device_id, spec_file_name
from gpud_k8s.claims import DRIVER, ClaimError, ClaimPlan, device_name, plan
from gpud_k8s.metrics import AgentMetrics
from gpud_k8s.prepared import Prepared, PreparedClaims

log = structlog.get_logger(__name__)


class Kube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def set_claim_condition(
        self, claim: dict[str, Any], devices: list[tuple[str, str, str]], condition: dict[str, Any]
    ) -> None: ...


class Keepers(Protocol):
    """What looks after a prepared claim's containers on the node (``gpud_k8s.keeping``)."""

    def start(self, rec: Prepared) -> None: ...

    async def stop(self, uid: str) -> None: ...


class Gpud(Protocol):
    async def call(self, msg: Any, timeout: float | None = None) -> Any: ...


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    share_id: str  # "" for a device not shared by capacity
    cdi_ids: tuple[str, ...]


class PrepareFailed(Exception):
    """A claim this node cannot prepare; the message is what the kubelet shows."""


def nvidia_cdi_ids(cdi_dirs: tuple[Path, ...]) -> Callable[[str], str | None]:
    """A look-up of NVIDIA's own CDI device for a GPU uuid (``nvidia.com/gpu=<uuid>``), where the
    node has NVIDIA's CDI specs (nvidia-ctk cdi generate), read when asked."""

    def lookup(uuid: str) -> str | None:
        for d in cdi_dirs:
            for path in sorted(d.glob("*.json")) if d.is_dir() else []:
                try:
                    spec = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                if spec.get("kind") != "nvidia.com/gpu":
                    continue
                if any(dev.get("name") == uuid for dev in spec.get("devices") or []):
                    return f"nvidia.com/gpu={uuid}"
        return None

    return lookup


class Driver:
    def __init__(
        self,
        node: str,
        gpud: Gpud,
        kube: Kube,
        prepared: PreparedClaims,
        *,
        cdi_dir: Path,
        claims_dir: Path,
        uuids: Callable[[int], str | None] = lambda gpu: None,
        nvidia: Callable[[str], str | None] = lambda uuid: None,
        driver: str = DRIVER,
        keepers: Keepers | None = None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.node = node
        self.gpud = gpud
        self.kube = kube
        self.prepared = prepared
        self.cdi_dir = cdi_dir
        self.claims_dir = claims_dir
        self.uuids = uuids  # a GPU's uuid (from gpud's STATUS), for NVIDIA's CDI device name
        self.nvidia = nvidia
        self.driver = driver
        self.keepers = keepers
        self.metrics = metrics or AgentMetrics()
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    @contextlib.contextmanager
    def _timed(self, histogram: Histogram) -> Iterator[None]:
        """One kubelet call for one claim, observed by its result."""
        t0 = time.perf_counter()
        result = "failed"
        try:
            yield
            result = "ok"
        finally:
            histogram.labels(result).observe(time.perf_counter() - t0)

    # --- prepare ---------------------------------------------------------------

    async def prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        with self._timed(self.metrics.prepare):
            return await self._prepare(namespace, uid, name)

    async def _prepare(self, namespace: str, uid: str, name: str) -> list[PreparedDevice]:
        async with self._lock(uid):
            rec = self.prepared.get(uid)
            if rec is not None and rec.state == "prepared":
                await self._open_socket(rec)  # (gpud may have restarted since)
                return _devices(rec)
            try:
                claim = await self.kube.get_claim(namespace, name)
            except LookupError as exc:
                raise PrepareFailed(f"ResourceClaim {namespace}/{name}: {exc}") from None
            if (claim.get("metadata") or {}).get("uid") != uid:
                raise PrepareFailed(
                    f"ResourceClaim {namespace}/{name} has uid {(claim.get('metadata') or {}).get('uid')}, "
                    f"not {uid}: it was deleted and made again"
                )
            try:
                made = plan(claim, self.node, self.driver)
                devices = await self._make(made)
            except (ClaimError, PrepareFailed) as exc:
                await self._say(
                    claim, False, "ClaimConfigInvalid" if isinstance(exc, ClaimError) else "PrepareFailed", str(exc)
                )
                raise PrepareFailed(str(exc)) from None
            if _said_not_ready(claim, self.driver):  # a failure said before is over
                await self._say(claim, True, "Prepared", "gpud enforces the claim's share on this node")
            return devices

    async def _say(self, claim: dict[str, Any], ready: bool, reason: str, message: str) -> None:
        """The claim's own status says whether gpud could prepare it (a ``Ready`` condition on this
        driver's devices of this node), beside the kubelet's event; a failure to say so is logged only."""
        results = ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results") or []
        devices = [
            (str(r.get("pool")), str(r.get("device")), str(r.get("shareID") or ""))
            for r in results
            if r.get("driver") == self.driver and r.get("pool") == self.node
        ]
        if not devices:
            return
        condition: dict[str, object] = {
            "type": "Ready",
            "status": "True" if ready else "False",
            "reason": reason,
            "message": message[:32768],
            "lastTransitionTime": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
        generation = (claim.get("metadata") or {}).get("generation")
        if isinstance(generation, int):
            condition["observedGeneration"] = generation
        try:
            await self.kube.set_claim_condition(claim, devices, condition)
        except Exception as exc:  # the kubelet's event still says it
            meta = claim.get("metadata") or {}
            log.warning("claim_status_not_written", claim=f"{meta.get('namespace')}/{meta.get('name')}", error=str(exc))

    async def _make(self, made: ClaimPlan) -> list[PreparedDevice]:
        uid = made.uid
        socket_dir = self.claims_dir / uid
        rec = Prepared(
            uid=uid,
            namespace=made.namespace,
            name=made.name,
            task_id=made.task_id,
            state="preparing",
            socket_dir=str(socket_dir),
            cdi_file=str(self.cdi_dir / spec_file_name(uid)),
            gpus=made.gpus,
            time_slice=made.config.time_slice,
            pause=made.config.pause,
            recovery=str(made.config.recovery),
        )
        self.prepared.put(rec)
        try:
            alloc, asked = await self._allocate(made)
            socket_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.chmod(socket_dir, 0o755)  # (not the umask's): every uid in the containers may connect
            await self._open_socket(rec)
            nvidia = [i for g in alloc.gpus if (u := self.uuids(g)) is not None and (i := self.nvidia(u)) is not None]
            _write_json(Path(rec.cdi_file), claim_spec(uid, str(socket_dir)))
        except BaseException:
            await self._undo(rec)
            raise
        ids = (device_id(uid), *nvidia)
        devices = [(d.request, self.node, device_name(d.gpu), d.share_id or "") for d in made.devices]
        done = msgspec.structs.replace(
            rec, state="prepared", devices=devices, cdi_ids=list(ids), allocate=msgspec.to_builtins(asked)
        )
        self.prepared.put(done)
        if self.keepers is not None:
            self.keepers.start(done)
        log.info("claim_prepared", claim=f"{made.namespace}/{made.name}", uid=uid, gpus=made.gpus, share=made.share)
        return _devices(done)

    async def _tenant(self, namespace: str) -> str | None:
        """The namespace, where gpud has a tenant of that name (its quota counts the claim); else none."""
        page: p.AllocationsReply = await self.gpud.call(p.ListAllocations(id=0, limit=1))
        return namespace if namespace in page.tenants else None

    async def _allocate(self, made: ClaimPlan) -> tuple[p.Allocated, p.Allocate]:
        msg = p.Allocate(
            id=0,
            task_id=made.task_id,
            gpus=made.share,
            prefer=list(made.gpus),
            strategy=p.Strategy.ONLY,
            tenant=await self._tenant(made.namespace),
            priority_class=made.config.priority_class,
            on_preempt=made.config.recovery,
            memory_bytes=made.memory,
            notify=True,  # the agent holds it until a process of the claim does
        )
        try:
            alloc: p.Allocated = await self.gpud.call(msg)
        except ProtocolError as exc:
            raise PrepareFailed(f"ResourceClaim {made.namespace}/{made.name}: gpud refused it: {exc}") from None
        if sorted(alloc.gpus) != sorted(made.gpus):  # the same task id, allocated before with other terms
            raise PrepareFailed(
                f"ResourceClaim {made.namespace}/{made.name}: gpud holds task {made.task_id} on GPUs {alloc.gpus}, "
                f"the scheduler placed the claim on {made.gpus}"
            )
        return alloc, msg

    async def _open_socket(self, rec: Prepared) -> None:
        path = str(Path(rec.socket_dir) / SOCKET_NAME)
        try:
            await self.gpud.call(p.OpenTaskSocket(id=0, task_id=rec.task_id, path=path))
        except ProtocolError as exc:
            raise PrepareFailed(
                f"ResourceClaim {rec.namespace}/{rec.name}: gpud opened no socket for it: {exc}"
            ) from None

    # --- unprepare -------------------------------------------------------------

    async def unprepare(self, namespace: str, uid: str, name: str) -> None:
        """Undo what prepare made; a claim this node never prepared (or unprepared already): nothing."""
        with self._timed(self.metrics.unprepare):
            await self._unprepare(uid)

    async def _unprepare(self, uid: str) -> None:
        async with self._lock(uid):
            rec = self.prepared.get(uid)
            if rec is None:
                return
            if self.keepers is not None:  # its containers handed back (thawed) before the allocation goes
                await self.keepers.stop(uid)
            await self._undo(rec)
            log.info("claim_unprepared", claim=f"{rec.namespace}/{rec.name}", uid=uid)
        self._locks.pop(uid, None)

    async def _undo(self, rec: Prepared) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(rec.cdi_file)
        await self._quietly(p.CloseTaskSocket(id=0, task_id=rec.task_id))
        await self._quietly(p.Free(id=0, task_id=rec.task_id))
        shutil.rmtree(rec.socket_dir, ignore_errors=True)
        self.prepared.remove(rec.uid)

    async def _quietly(self, msg: Any) -> None:
        """A step of undoing that finds nothing to undo (UNKNOWN_TASK) is done."""
        try:
            await self.gpud.call(msg)
        except ProtocolError as exc:
            if exc.code != p.ErrorCode.UNKNOWN_TASK:
                raise

    # --- at start --------------------------------------------------------------

    async def recover(self) -> None:
        """At start, before the kubelet can call: what a crash left ``preparing`` is undone (the kubelet
        prepares it again); what is prepared gets its socket back (a restart of gpud closed it)."""
        for rec in list(self.prepared):
            if rec.state != "prepared":
                log.warning("claim_prepare_undone", uid=rec.uid, claim=f"{rec.namespace}/{rec.name}")
                await self._undo(rec)
        for rec in list(self.prepared):
            await self._hold(rec)
            if self.keepers is not None:
                self.keepers.start(rec)
        await self.reassert()

    async def _hold(self, rec: Prepared) -> None:
        """An agent started again holds each prepared claim's allocation again (told of its preemption), on
        the terms it was made with; one gone meanwhile is left to the claim's keeper (it evicts the pods)."""
        if not rec.allocate:
            return
        try:
            msg = msgspec.convert({**rec.allocate, "existing": True, "wait_ms": 0}, p.Allocate)
            await self.gpud.call(msg)
        except (ProtocolError, msgspec.ValidationError) as exc:
            log.warning("claim_allocation_not_held", uid=rec.uid, claim=f"{rec.namespace}/{rec.name}", error=str(exc))

    async def reassert(self) -> None:
        """Each prepared claim's socket, asked for again (idempotent in gpud: a restart of gpud closed them)."""
        for listed in list(self.prepared):
            async with self._lock(listed.uid):
                rec = self.prepared.get(listed.uid)  # as it is now: unprepared meanwhile, or still preparing
                if rec is not None and rec.state == "prepared":
                    await self._open_socket(rec)

    def claims(self) -> list[Prepared]:
        return list(self.prepared)


def _devices(rec: Prepared) -> list[PreparedDevice]:
    return [PreparedDevice(r, pool, d, share, tuple(rec.cdi_ids)) for r, pool, d, share in rec.devices]


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _said_not_ready(claim: dict[str, Any], driver: str) -> bool:
    for entry in (claim.get("status") or {}).get("devices") or []:
        if entry.get("driver") == driver and any(
            c.get("type") == "Ready" and c.get("status") == "False" for c in entry.get("conditions") or []
        ):
            return True
    return False
