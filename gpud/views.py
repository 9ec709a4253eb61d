"""Snapshots of the daemon for STATUS and CLIENTS answers (gpuctl, the demo)."""

from __future__ import annotations


from gpud import __version__
from gpud.state import Host
from gpud_client import protocol as p


def _ms(us: int) -> float:
    return round(us / 1000, 3)


def status_reply(daemon: Host, rid: int, now: int) -> p.StatusReply:
    gpus = []
    for slot in daemon.slots:
        view = slot.scheduler.view(now)
        owners = daemon.owners

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
        clients = {c.client_id for c in daemon.connections.values() if slot.gpu.index in c.sessions.values()}
        gpus.append(
            p.GpuStatus(
                index=slot.gpu.index,
                uuid=slot.gpu.uuid,
                name=slot.gpu.name,
                memory_total_bytes=slot.gpu.memory_total_bytes,
                simulated=slot.gpu.simulated,
                mode=view.mode,
                scheduler_on=view.enabled,
                tq_s=view.tq_us / 1e6,
                window_s=view.window_us / 1e6,
                memory_capacity_bytes=view.memory_capacity_bytes,
                memory_in_use_bytes=view.memory_in_use_bytes,
                healthy=slot.healthy,
                holders=holders,
                queue=queue,
                clients=len(clients),
                grants=view.grants,
                drops=view.drops,
                revocations=view.revocations,
            )
        )
    return p.StatusReply(id=rid, version=__version__, uptime_s=round((now - daemon.started_at) / 1e6, 3), gpus=gpus)


def clients_reply(daemon: Host, rid: int, now: int) -> p.ClientsReply:
    out = []
    for conn in daemon.connections.values():
        if not conn.greeted:
            continue
        sessions = []
        for sid, gpu in conn.sessions.items():
            sched = daemon.slots[gpu].scheduler
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
