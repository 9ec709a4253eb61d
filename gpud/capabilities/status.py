"""Snapshots of the daemon for STATUS and CLIENTS answers (gpuctl, the demo, gpuctl top)."""

from __future__ import annotations

from collections.abc import Callable

from gpud import __version__
from gpud.kit.links import Links
from gpud.kit.state import ClientLink, GpuSlot, Handler
from gpud_client import protocol as p


class Status:
    """STATUS and LIST_CLIENTS; every account is brought up to now first."""

    def __init__(
        self,
        slots: list[GpuSlot],
        links: Links,
        started_at: int,
        settle: Callable[[int], None],
        allocated: Callable[[int], bool] = lambda gpu: False,
    ) -> None:
        self.slots = slots
        self.allocated = allocated  # whether any allocation is on a GPU (a drain is done when none is)
        self.links = links
        self.started_at = started_at
        self.settle = settle

    def handlers(self) -> dict[type, Handler]:
        return {p.Status: self.status, p.ListClients: self.clients}

    def status(self, conn: ClientLink, msg: p.Status, now: int) -> p.StatusReply:
        self.settle(now)
        return status_reply(self.slots, self.links, self.started_at, msg.id, now, self.allocated)

    def clients(self, conn: ClientLink, msg: p.ListClients, now: int) -> p.ClientsReply:
        self.settle(now)
        return clients_reply(self.slots, self.links, msg.id, now)


def _ms(us: int) -> float:
    return round(us / 1000, 3)


def status_reply(
    slots: list[GpuSlot],
    links: Links,
    started_at: int,
    rid: int,
    now: int,
    allocated: Callable[[int], bool] = lambda gpu: False,
) -> p.StatusReply:
    gpus = []
    owners = links.owners
    clients_on: dict[int, int] = {}  # gpu -> clients with a session or lease on it: one pass over the clients
    for c in links.connections.values():
        for gpu in set(c.sessions.values()):
            clients_on[gpu] = clients_on.get(gpu, 0) + 1
    for slot in slots:
        view = slot.scheduler.view(now)

        def who(sid: int) -> tuple[int, str, int]:
            c = owners.get(sid)
            return (c.client_id, c.name, c.pid) if c else (0, "", 0)

        holders = [
            p.HolderInfo(
                session=h.session,
                client_id=who(h.session)[0],
                name=who(h.session)[1],
                pid=who(h.session)[2],
                grant=h.grant,
                held_ms=_ms(h.held_us),
                drop_pending=h.drop_pending,
                core_limit=slot.scheduler.session(h.session, now).core_limit,
            )
            for h in view.holders
        ]
        queue = [
            p.WaiterInfo(
                session=w.session,
                client_id=who(w.session)[0],
                name=who(w.session)[1],
                pid=who(w.session)[2],
                priority=w.priority,
                waited_ms=_ms(w.waited_us),
                throttled=w.throttled,
            )
            for w in view.queue
        ]
        gpus.append(
            p.GpuStatus(
                index=slot.gpu.index,
                uuid=slot.gpu.uuid,
                name=slot.gpu.name,
                memory_total_bytes=slot.gpu.memory_total_bytes,
                memory_used_bytes=slot.memory_used_bytes,
                simulated=slot.gpu.simulated,
                mode=view.mode,
                scheduler_on=view.enabled,
                tq_s=view.tq_us / 1e6,
                window_s=view.window_us / 1e6,
                memory_capacity_bytes=view.memory_capacity_bytes,
                memory_in_use_bytes=view.memory_in_use_bytes,
                healthy=slot.healthy,
                draining=slot.draining,
                drained=slot.draining and not allocated(slot.gpu.index) and not view.holders,
                pci_bus_id=slot.gpu.pci_bus_id,
                holders=holders,
                queue=queue,
                clients=clients_on.get(slot.gpu.index, 0),
                grants=view.grants,
                drops=view.drops,
                revocations=view.revocations,
            )
        )
    return p.StatusReply(id=rid, version=__version__, uptime_s=round((now - started_at) / 1e6, 3), gpus=gpus)


def clients_reply(slots: list[GpuSlot], links: Links, rid: int, now: int) -> p.ClientsReply:
    out = []
    for conn in links.connections.values():
        if not conn.greeted:
            continue
        sessions = []
        for sid, gpu in conn.sessions.items():
            sched = slots[gpu].scheduler
            v = sched.session(sid, now)
            sessions.append(
                p.SessionInfo(
                    session=sid,
                    gpu=gpu,
                    state=v.state,
                    priority=v.priority,
                    grants=v.grants,
                    hold_ms=_ms(v.hold_us),
                    wait_ms=_ms(v.wait_us),
                    drops=v.drops,
                    revocations=v.revocations,
                    core_limit=v.core_limit,
                    budget_ms=None if v.budget_us is None else _ms(v.budget_us),
                    window_used_ms=_ms(v.used_us),
                    window_share_percent=round(100 * v.used_us / sched.accounts.cfg.window_us, 3),
                    recent_share_percent=round(v.recent_share_percent, 3),
                    throttled=v.throttled,
                    throttles=v.throttles,
                    mem_estimate_bytes=v.mem_estimate,
                    mem_used_bytes=v.mem_used,
                    mem_limit_bytes=v.mem_limit,
                    mem_violations=v.mem_violations,
                    core_ceiling=v.core_ceiling,
                    mem_ceiling_bytes=v.mem_ceiling,
                    parkable=v.parkable,
                    parked=v.parked,
                    parks=v.parks,
                )
            )
        out.append(
            p.ClientInfo(
                client_id=conn.client_id,
                name=conn.name,
                pid=conn.pid,
                uid=conn.uid,
                gid=conn.gid,
                labels=conn.labels,
                connected_s=round((now - conn.connected_at) / 1e6, 3),
                sessions=sessions,
            )
        )
    return p.ClientsReply(id=rid, clients=out)
