"""Carrying out ``gpud_k8s.turns`` for every prepared claim: finding its containers, handing their
cgroups to gpud, its lock, its pushes, its suspension and its eviction (docs/kubernetes.md).

One ``Keeper`` per prepared claim, in the agent's event loop, started by the driver once the claim is
prepared (and again for each prepared claim when the agent starts) and stopped before it is unprepared.
A claim that neither takes turns nor is suspended when taken back needs nothing of its containers: its
keeper only waits for a preemption, to evict its pods at the grace's end. The others get a connection
of their own to gpud (so that gpud's record of what it freezes is the claim's), and:

- ``Keepers.watch`` looks for every kept claim's containers each ``find_s``: the kubelet's pod resources
  ``List`` names the pods whose containers hold the claim (where that API cannot be reached, the pods
  of this node that name the claim, all their containers), the
  pods on this node (listed from the API server every ``POD_REFRESH_S``) give their uids, whether they
  are being deleted and their containers' ids, and ``gpud_k8s.containers`` finds the cgroups;
- the containers are paused and resumed exactly as ``gpuctl run`` pauses its program: gpud freezes
  their cgroups (``FREEZE``/``THAW`` on the claim's connection), after the CUDA driver's checkpoint lock
  where the claim's ``pause`` is ``cuda`` (``gpud_client.proctl``'s ``CgroupBackend`` over the
  containers' processes), the same backend, in a thread: the driver's calls block;
- the lock is the session of the claim's task on its GPU (whose share is its ceiling: gpud bills it
  as any session of the task); DROP_LOCK, a lost lock and PARK come as its hooks;
- PREEMPT, PREEMPT_WITHDRAWN, ALLOC_REVOKED and ALLOC_CHANGED reach the claim's keeper from the agent's
  connection, which holds the claim's allocation (``Keepers.push``); and a claim whose allocation is no
  longer in gpud at all (taken back while a client in its pod held it, so the pushes went there) is
  told so by ``Keepers.check``, every few seconds, as a revocation;
- an eviction is asked of the API server for each pod the claim is reserved for (``gpud_k8s.evictions``:
  again while a disruption budget refuses it), until the pod is gone or the claim is unprepared.

A gpud that restarts forgets the cgroups it was handed (the kernel keeps them as they were: frozen stay
frozen); the keeper hands them again when a FREEZE or THAW is refused for that.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog

from gpud_client import protocol as p
from gpud_client.aio import AsyncClient, AsyncSession
from gpud_client.errors import DaemonUnavailable, GpudError, ProtocolError
from gpud_client.proctl.base import Backend, ControlError
from gpud_client.proctl.cgroup import CgroupBackend, FreezerAway
from gpud_client.proctl.signals import SignalBackend
from gpud_k8s import kubelet_api as k
from gpud_k8s.claims import task_uid
from gpud_k8s.containers import Hierarchy, claim_containers, container_ids, find_cgroups
from gpud_k8s.evictions import evict_pods
from gpud_k8s.metrics import AgentMetrics
from gpud_k8s.pausing import CgroupProcesses, GpudFreezer
from gpud_k8s.prepared import Prepared
from gpud_k8s.turns import (
    Action,
    Adopt,
    AnswerPark,
    ClaimTurns,
    Evict,
    Park,
    Pause,
    Release,
    Request,
    Resume,
    TurnConfig,
    Yield,
)

log = structlog.get_logger(__name__)
FIND_S = 0.2  # how often the kept claims' containers are looked for
POD_REFRESH_S = 5.0  # the node's pods listed again this often ...
POD_SOONEST_S = 1.0  # ... or after this long when the kubelet names a pod the last list did not have
TICK_S = 1.0
CHECK_S = 5.0  # how often the claims' allocations are looked for in gpud


class Kube(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]: ...

    async def list_node_pods(self, node: str) -> list[dict[str, Any]]: ...

    async def evict(self, namespace: str, name: str, uid: str | None = None) -> str: ...


Event = Callable[[float], list[Action]]


@dataclass(frozen=True, slots=True)
class Seen:
    cgroups: tuple[str, ...]  # the containers' cgroups, as gpud's ADOPT names them
    folders: tuple[Path, ...]  # the same in the file system
    terminating: bool  # a pod that holds the claim is being deleted


@dataclass
class Keeper:
    rec: Prepared
    keepers: Keepers
    turns: ClaimTurns = field(init=False)
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    client: AsyncClient | None = None
    session: AsyncSession | None = None
    backend: Backend | None = None
    tree: CgroupProcesses = field(default_factory=CgroupProcesses)
    terminating: bool = False
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    evicting: asyncio.Task[None] | None = None

    def __post_init__(self) -> None:
        rec = self.rec
        config = TurnConfig(time_slice=rec.time_slice, recovery=p.Recovery(rec.recovery), can_park=rec.pause == "cuda")
        self.turns = ClaimTurns(config)

    @property
    def name(self) -> str:
        return f"{self.rec.namespace}/{self.rec.name}"

    @property
    def watches(self) -> bool:
        """Its containers matter: it takes turns, or it is suspended when taken back."""
        return self.rec.time_slice or self.rec.recovery == p.Recovery.SUSPEND

    def post(self, event: Event) -> None:
        self.events.put_nowait(event)

    # --- the loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        clock = self.keepers.clock
        while True:
            now = clock()
            try:
                event = await asyncio.wait_for(self.events.get(), max(0.0, self.turns.next_tick(now, TICK_S) - now))
            except TimeoutError:
                event = self.turns.tick
            try:
                await self.carry_out(event(clock()))
            except (GpudError, OSError) as exc:  # this event's actions stop here; the next event goes on
                log.warning("claim_keeping_failed", claim=self.name, error=str(exc))
            self._show()

    def _show(self) -> None:
        m, labels = self.keepers.metrics, (self.rec.namespace, self.rec.name)
        m.containers.labels(*labels).set(len(self.turns.cgroups))
        m.paused.labels(*labels).set(1 if self.turns.cgroups and self.turns.program in ("paused", "parked") else 0)
        m.suspended.labels(*labels).set(1 if self.turns.mode in ("suspending", "suspended") else 0)

    async def carry_out(self, actions: list[Action]) -> None:
        while actions:
            action, actions = actions[0], actions[1:]
            more = await self._do(action)
            actions = [*more, *actions]

    async def _do(self, action: Action) -> list[Action]:
        match action:
            case Adopt(cgroups=cgroups):
                await self._adopt(cgroups)
            case Pause():
                await self._backend_call("pause")
            case Resume():
                await self._backend_call("resume")
            case Request():
                await self._request()
            case Release():
                if self.session is not None:
                    with contextlib.suppress(GpudError):
                        await self.session.release()
            case Park():
                try:
                    moved = await self._backend_call("park")
                except ControlError as exc:
                    return self.turns.park_done(False, str(exc))
                return self.turns.park_done(True, f"{moved} bytes to host memory")
            case AnswerPark(ok=ok, message=message):
                if self.session is not None:
                    await self.session.parked(ok, message[:512])
            case Yield():
                await self._yield()
            case Evict(why=why):
                if self.evicting is None:
                    self.evicting = self._spawn(self._evict(why))
        return []

    # --- gpud ---------------------------------------------------------------------------------

    async def connect(self) -> AsyncClient:
        if self.client is None:
            labels = {"task_id": self.rec.task_id, "k8s.claim": self.name}
            name = f"k8s/{self.name}"[:128]  # gpud's session series name the claim by it (their client label)
            self.client = await AsyncClient.connect(self.keepers.gpud_socket, name=name, labels=labels)
            inner = self.keepers.cuda() if self.rec.pause == "cuda" else None
            self.backend = CgroupBackend(
                GpudFreezer(self, asyncio.get_running_loop()), inner=inner, fallback=SignalBackend()
            )
        return self.client

    async def _adopt(self, cgroups: tuple[str, ...]) -> None:
        client = await self.connect()
        await client.call(p.Adopt(id=0, task_id=self.rec.task_id, cgroups=list(cgroups)))
        log.info("claim_containers", claim=self.name, cgroups=len(cgroups))

    async def freeze(self, frozen: bool) -> bool:
        """FREEZE or THAW on the claim's connection: handed again when gpud forgot the cgroups (a
        restart); True when the kernel says frozen (FREEZE) or thawed (THAW)."""
        client = await self.connect()
        msg: p.Freeze | p.Thaw = p.Freeze(id=0) if frozen else p.Thaw(id=0)
        timeout = 60.0
        for again in (False, True):
            try:
                state: p.ProgramState = await client.call(msg, timeout=timeout)
                return state.frozen == frozen
            except DaemonUnavailable as exc:
                raise FreezerAway(str(exc)) from None
            except ProtocolError as exc:
                if again or exc.code != p.ErrorCode.INVALID:
                    what = type(msg).__name__.lower()
                    raise ControlError(f"gpud refused to {what} the claim's containers: {exc}") from exc
                await self._adopt(self.turns.cgroups)
        raise AssertionError("unreachable")

    async def _backend_call(self, what: str) -> int:
        """Pause, resume or park the containers, in a thread (the CUDA driver's calls block)."""
        if self.backend is None or not self.turns.cgroups:
            return 0
        self.tree.folders = self.keepers.folders.get(self.rec.uid, ())
        backend, tree = self.backend, self.tree
        try:
            if what == "pause":
                await asyncio.to_thread(backend.pause, tree)
            elif what == "resume":
                await asyncio.to_thread(backend.resume, tree)
            else:
                return await asyncio.to_thread(backend.park, tree)
        except ControlError as exc:
            if what == "park":
                raise
            log.error(f"claim_{what}_failed", claim=self.name, error=str(exc))
        return 0

    async def _request(self) -> None:
        client = await self.connect()
        if self.session is None:
            gpu = self.rec.gpus[0] if self.rec.gpus else 0
            self.session = await client.session(
                gpu,
                idle_release=None,  # a container is treated as always having work
                memory_probe=lambda: 0,
                framework_hooks=False,
                task_id=self.rec.task_id,
                on_drop=lambda reason: self.post(self.turns.dropped),
                on_lost=lambda error: self.post(self.turns.dropped),
                on_park=lambda: self.post(lambda now: self.turns.park_asked()),
            )
        session = self.session

        async def acquire() -> None:
            try:
                await session.acquire()
            except GpudError as exc:
                log.warning("claim_turn_refused", claim=self.name, error=str(exc))
                return
            self.keepers.metrics.turns.labels(self.rec.namespace, self.rec.name).inc()
            self.post(self.turns.granted)

        self._spawn(acquire())

    async def _yield(self) -> None:
        client = await self.connect()
        try:
            await client.yield_allocation(self.rec.task_id)
            log.info("claim_suspended", claim=self.name)
        except ProtocolError as exc:
            log.warning("claim_yield_refused", claim=self.name, error=str(exc))

    # --- Kubernetes ----------------------------------------------------------------------------

    async def _evict(self, why: str) -> None:
        pods = await self.keepers.claim_pods(self.rec)
        counted = self.keepers.metrics.evictions.labels
        await evict_pods(
            self.keepers.kube, self.rec.namespace, pods, f"claim {self.name}", why, lambda x: counted(x).inc()
        )

    # --- the node's word -------------------------------------------------------------------------

    def seen(self, seen: Seen) -> None:
        self.post(lambda now: self.turns.found(seen.cgroups, now))
        if seen.terminating and not self.terminating:
            self.terminating = True
            self.post(self.turns.terminating)

    def push(self, msg: p.Preempt | p.PreemptWithdrawn | p.AllocRevoked | p.AllocChanged) -> None:
        match msg:
            case p.Preempt(recovery=recovery, grace_s=grace_s):
                self.post(lambda now: self.turns.preempted(recovery, grace_s, now))
            case p.PreemptWithdrawn():
                self.post(self.turns.withdrawn)
            case p.AllocRevoked(gone=gone):
                self.post(lambda now: self.turns.revoked(gone, now))
            case p.AllocChanged(change="resumed"):
                self.post(self.turns.resumed)

    # --- the end --------------------------------------------------------------------------------

    def _spawn(self, coro: Awaitable[None]) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def close(self) -> None:
        """The claim is being unprepared: its containers handed back thawed, its connection closed."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.client is not None:
            with contextlib.suppress(GpudError):
                if self.backend is not None and self.turns.program in ("paused", "parked"):
                    self.tree.folders = self.keepers.folders.get(self.rec.uid, ())
                    await self._backend_call("resume")
                await self.client.call(p.Adopt(id=0, task_id=self.rec.task_id, cgroups=[]))
            if self.backend is not None:
                self.backend.close()
            await self.client.close()


class Keepers:
    """Every prepared claim's keeper, the watch over their containers and the check of their allocations."""

    def __init__(
        self,
        *,
        node: str,
        gpud: AsyncClient,
        gpud_socket: str | None,
        kube: Kube,
        cgroup_root: Path,
        hierarchy: Hierarchy,
        pod_resources: Path | None,
        cuda: Callable[[], Backend | None] = lambda: None,
        metrics: AgentMetrics | None = None,
        find_s: float = FIND_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node = node
        self.gpud = gpud
        self.gpud_socket = gpud_socket
        self.kube = kube
        self.root = cgroup_root
        self.hierarchy = hierarchy
        self.pod_resources = pod_resources
        self.cuda = cuda
        self.metrics = metrics or AgentMetrics()
        self.find_s = find_s
        self.clock = clock
        self.keepers: dict[str, Keeper] = {}
        self.runs: dict[str, asyncio.Task[None]] = {}
        self.folders: dict[str, tuple[Path, ...]] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> the pod, as last listed
        # Pods gone from the API server that the kubelet still names: their containers may still run (a
        # cgroup is the kernel's word on that), so they are still looked in, as they were last listed.
        self.vanished: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods_at = -1e9
        self._channel: grpc.aio.Channel | None = None
        self._said: set[str] = set()

    def start(self, rec: Prepared) -> None:
        if rec.uid in self.keepers:
            return
        keeper = Keeper(rec, self)
        self.keepers[rec.uid] = keeper
        self.runs[rec.uid] = asyncio.ensure_future(keeper.run())
        self.metrics.claim(
            rec.namespace, rec.name, uid=rec.uid, task_id=rec.task_id, time_slice=rec.time_slice,
            recovery=rec.recovery, pause=rec.pause,
        )  # fmt: skip
        log.info("claim_kept", claim=keeper.name, time_slice=rec.time_slice, recovery=rec.recovery, pause=rec.pause)

    async def stop(self, uid: str) -> None:
        keeper = self.keepers.pop(uid, None)
        run = self.runs.pop(uid, None)
        if run is not None:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        if keeper is not None:
            await keeper.close()
            self.metrics.forget(keeper.rec.namespace, keeper.rec.name)
        self.folders.pop(uid, None)

    async def close(self) -> None:
        """The agent stops: every keeper's loop ends; containers stay as the kernel has them (a frozen one
        stays frozen until the agent, started again, gives it its turn)."""
        for uid in list(self.runs):
            run = self.runs.pop(uid)
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        for keeper in self.keepers.values():
            for task in list(keeper.tasks):
                task.cancel()
            if keeper.backend is not None:  # (its CUDA driver helper ends; what it locked stays frozen)
                keeper.backend.close()
            if keeper.client is not None:
                await keeper.client.close()
        self.keepers.clear()
        if self._channel is not None:
            await self._channel.close()

    # --- gpud's pushes, and what gpud no longer has -------------------------------------------------

    def push(self, msg: p.Preempt | p.PreemptWithdrawn | p.AllocRevoked | p.AllocChanged) -> None:
        """A push on the agent's connection, for the keeper of the claim whose task it names."""
        task = msg.allocation.task_id if isinstance(msg, p.AllocChanged) else msg.task_id
        uid = task_uid(task)
        keeper = self.keepers.get(uid) if uid is not None else None
        if keeper is not None:
            keeper.push(msg)

    async def check(self) -> None:
        """A kept claim whose allocation gpud no longer has, held or suspended, is told it is gone."""
        if not self.keepers:
            return
        listing = await self.gpud.allocations()
        known = {a.task_id for a in listing.allocations} | set(listing.waiting)
        for keeper in list(self.keepers.values()):
            if keeper.rec.task_id not in known and keeper.turns.mode not in ("gone", "ending"):
                keeper.push(
                    p.AllocRevoked(
                        task_id=keeper.rec.task_id, reason=p.PreemptReason.LOST, state=p.AllocState.RUNNING, gone=True
                    )
                )

    # --- the containers -------------------------------------------------------------------------------

    async def watch(self) -> None:
        """Look for the kept claims' containers, every ``find_s``, for ever."""
        while True:
            try:
                await self.look()
            except Exception as exc:  # the kubelet or the API server away: looked at again next round
                log.warning("claim_containers_not_found", error=str(exc))
            await asyncio.sleep(self.find_s)

    async def look(self) -> None:
        watched = [x for x in self.keepers.values() if x.watches]
        if not watched:
            return
        listing = await self._pod_resources()
        now = self.clock()
        holders = {
            x.rec.uid: (
                [(h.namespace, h.pod, h.container) for h in claim_containers(listing, x.rec.namespace, x.rec.name)]
                if listing is not None
                else None
            )
            for x in watched
        }
        wanted = {(ns, pod) for hs in holders.values() for ns, pod, _ in hs or []}
        if listing is not None:  # the kubelet no longer names it: its containers are gone
            self.vanished = {key: pod for key, pod in self.vanished.items() if key in wanted}
        stale = now - self.pods_at
        if stale >= POD_REFRESH_S or (not wanted <= set(self.pods) | set(self.vanished) and stale >= POD_SOONEST_S):
            await self._list_pods(now)
        for keeper in watched:
            keeper.seen(self._seen(keeper, holders[keeper.rec.uid]))

    def _seen(self, keeper: Keeper, holders: list[tuple[str, str, str]] | None) -> Seen:
        rec = keeper.rec
        by_pod: dict[tuple[str, str], list[str]] = {}
        if holders is None:  # no pod resources API: the pods the claim is reserved for, all their containers
            for (ns, name), pod in self.pods.items():
                if ns == rec.namespace and _reserved(pod, rec):
                    by_pod[(ns, name)] = [c.get("name", "") for c in (pod.get("spec") or {}).get("containers") or []]
        else:
            for ns, name, container in holders:
                by_pod.setdefault((ns, name), []).append(container)
        folders: list[Path] = []
        terminating = False
        for key, names in by_pod.items():
            found = self.pods.get(key) or (self.vanished.get(key) if holders is not None else None)
            if found is None:
                continue
            meta = found.get("metadata") or {}
            terminating = terminating or bool(meta.get("deletionTimestamp"))
            ids = container_ids(found, names).values()
            folders += find_cgroups(self.root, str(meta.get("uid")), ids, rec.task_id)
        folders = sorted(set(folders))
        self.folders[rec.uid] = tuple(folders)
        return Seen(tuple(self.hierarchy.path_of(f) for f in folders), tuple(folders), terminating)

    async def _pod_resources(self) -> list[Any] | None:
        """The kubelet's pod resources (None: its API cannot be reached; said once)."""
        if self.pod_resources is None:
            return None
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(k.unix_target(self.pod_resources))
        stub = k.podresources.rpc.PodResourcesListerStub(self._channel)
        try:
            reply = await stub.List(k.podresources.pb.ListPodResourcesRequest(), timeout=5.0)
        except grpc.aio.AioRpcError as exc:
            if "pod_resources" not in self._said:
                self._said.add("pod_resources")
                log.warning("pod_resources_unavailable", socket=str(self.pod_resources), error=exc.details())
            return None
        self._said.discard("pod_resources")
        return list(reply.pod_resources)

    async def _list_pods(self, now: float) -> None:
        pods = await self.kube.list_node_pods(self.node)
        listed = {
            ((x.get("metadata") or {}).get("namespace", ""), (x.get("metadata") or {}).get("name", "")): x for x in pods
        }
        self.vanished |= {key: pod for key, pod in self.pods.items() if key not in listed}
        self.pods, self.pods_at = listed, now

    async def claim_pods(self, rec: Prepared) -> list[tuple[str, str | None]]:
        """The pods that hold the claim, by name and uid: its ``reservedFor``, as the API server has it now
        (else the pods on this node the kubelet says hold it)."""
        try:
            claim = await self.kube.get_claim(rec.namespace, rec.name)
        except LookupError:
            claim = {}
        refs = [
            (str(r.get("name")), r.get("uid"))
            for r in (claim.get("status") or {}).get("reservedFor") or []
            if r.get("resource") == "pods" and not r.get("apiGroup")
        ]
        if refs:
            return refs
        listing = await self._pod_resources()
        names = {h.pod for h in claim_containers(listing or [], rec.namespace, rec.name)}
        return [(name, None) for name in sorted(names)]


def _reserved(pod: dict[str, Any], rec: Prepared) -> bool:
    """The pod names the claim: in its spec (``resourceClaimName``), or as the claim made for it from a
    template (``status.resourceClaimStatuses``)."""
    named = [c.get("resourceClaimName") for c in (pod.get("spec") or {}).get("resourceClaims") or []]
    named += [c.get("resourceClaimName") for c in (pod.get("status") or {}).get("resourceClaimStatuses") or []]
    return rec.name in named
