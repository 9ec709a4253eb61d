"""Admin requests on the schedulers: SET_MODE, SCHED_ON / SCHED_OFF, SET_TQ.

Each needs admin rights (``Access``) and applies to one GPU or to all of them.
"""

from __future__ import annotations

import structlog

from gpud.kit.access import Access
from gpud.kit.effects import Effects
from gpud.kit.links import Links
from gpud.kit.state import ClientLink, GpuRefs, Handler
from gpud_client import protocol as p

log = structlog.get_logger(__name__)


class Admin:
    def __init__(self, refs: GpuRefs, links: Links, effects: Effects, access: Access) -> None:
        self.refs = refs
        self.links = links
        self.effects = effects
        self.access = access

    def handlers(self) -> dict[type, Handler]:
        return {
            p.SetMode: self.set_mode,
            p.SchedOn: self.switch,
            p.SchedOff: self.switch,
            p.SetTq: self.set_tq,
        }

    def set_mode(self, conn: ClientLink, msg: p.SetMode, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        slots = self.refs.targets(msg.gpu)
        for slot in slots:
            self.effects.carry_out(slot.scheduler.set_mode(msg.mode, now), now, slot)
        log.info("mode_set", gpus=[s.gpu.index for s in slots], mode=str(msg.mode), by_pid=conn.pid)
        return p.Ok(id=msg.id)

    def switch(self, conn: ClientLink, msg: p.SchedOn | p.SchedOff, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        on = isinstance(msg, p.SchedOn)
        for slot in self.refs.targets(msg.gpu):
            self.effects.carry_out(slot.scheduler.set_enabled(on, now), now, slot)
            log.info("scheduler_switched", gpu=slot.gpu.index, on=on, by_pid=conn.pid)
            self.links.broadcast(p.SchedState(gpu=slot.gpu.index, on=on))
        return p.Ok(id=msg.id)

    def set_tq(self, conn: ClientLink, msg: p.SetTq, now: int) -> p.Ok:
        self.access.require_admin(conn, msg)
        slots = self.refs.targets(msg.gpu)
        for slot in slots:
            self.effects.carry_out(slot.scheduler.set_tq(max(1, round(msg.seconds * 1e6)), now), now, slot)
        log.info("tq_set", gpus=[s.gpu.index for s in slots], tq_s=msg.seconds, by_pid=conn.pid)
        return p.Ok(id=msg.id)
