"""Seeded random simulations of the scheduler: invariants after every step.

Each seed drives a scheduler through thousands of random calls on fake time
(requests, releases, detaches, limits, memory reports, modes, scheduler on/off,
TQ changes, timer expiries, clients that ignore DROP_LOCK) and checks what must
always hold.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from gpud.core.errors import Refused
from gpud.core.quota import QuotaConfig
from gpud.core.scheduler import (
    Drop,
    Effect,
    GpuScheduler,
    Grant,
    HoldOverdue,
    LeaseDenied,
    MemOverLimit,
    Revoke,
    SchedulerConfig,
)
from gpud_client.protocol import DropReason, Mode

from .statecheck import state_of

MS = 1000
GIB = 2**30


class Model:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        cfg = SchedulerConfig(
            tq_us=50 * MS,
            drop_timeout_us=20 * MS,
            memory_total_bytes=16 * GIB,
            quota=QuotaConfig(window_us=100 * MS, carryover_percent=0, sample_interval_us=10 * MS),
            lease_force_release=seed % 2 == 1,
        )
        self.s = GpuScheduler(cfg)
        self.now = 0
        self.next_id = 1
        self.attached: set[int] = set()
        self.granted: dict[int, int] = {}  # session -> current grant
        self.pending_drop: set[int] = set()  # grants with a DROP_LOCK not yet answered
        self.tq_dropped: set[int] = set()
        self.grant_order: list[int] = []
        self.stubborn: set[int] = set()
        self.leases: set[int] = set()
        self.settled = False
        # A snapshot of the scheduler taken after a refused call, kept while nothing has changed it
        # since, to serve as the next call's state before (snapshots are most of this test's time).
        self.unchanged: object | None = None

    def step(self) -> None:
        self.settled = False
        self.now += self.rng.choice([0, 1, 10, 1000, 5 * MS, 30 * MS])
        r = self.rng.random()
        if (r < 0.08 and len(self.attached) < 10) or len(self.attached) < 2:
            self.attach()
        elif r < 0.40:
            self.call(lambda: self.s.request(self.pick(), self.now))
        elif r < 0.62:
            sid = self.pick()
            if sid not in self.stubborn or self.rng.random() < 0.1:
                self.call(lambda: self.s.release(sid, self.now))
        elif r < 0.63:
            self.detach()
        elif r < 0.66:
            self.acquire_lease()
        elif r < 0.70:
            self.call(lambda: self.s.set_limits(self.pick(), self.now, core_limit=self.rng.choice([10, 30, 100, 0])))
        elif r < 0.75:
            self.call(lambda: self.s.report_memory(self.pick(), self.rng.choice([0, 2, 6, 12]) * GIB, self.now))
        elif r < 0.77:
            self.call(lambda: self.s.set_mode(self.rng.choice(list(Mode)), self.now))
        elif r < 0.79:
            self.call(lambda: self.s.set_enabled(self.rng.random() < 0.8, self.now))
        elif r < 0.80:
            self.call(lambda: self.s.set_tq(self.rng.choice([1, 10, 50]) * MS, self.now))
        else:
            deadline = self.s.next_deadline()
            if deadline is not None and self.rng.random() < 0.8:
                self.now = max(self.now, deadline)
            self.call(lambda: self.s.advance(self.now))
        self.check()

    def attach(self) -> None:
        sid = self.next_id
        self.next_id += 1
        mem = self.rng.choice([None, 1 * GIB, 4 * GIB, 8 * GIB])
        self.call(
            lambda: self.s.attach(
                sid,
                self.now,
                priority=self.rng.choice([0, 0, 0, 10]),
                core_limit=self.rng.choice([100, 100, 20, 50]),
                mem_estimate=mem,
            )
        )
        self.attached.add(sid)
        if self.rng.random() < 0.2:
            self.stubborn.add(sid)

    def acquire_lease(self) -> None:
        sid = self.next_id
        self.next_id += 1
        self.attached.add(sid)
        self.leases.add(sid)
        self.call(
            lambda: self.s.acquire_lease(
                sid,
                self.now,
                priority=self.rng.choice([20, 50, 90]),
                max_wait_us=self.rng.choice([0, 5 * MS, 50 * MS]),
                hold_max_us=self.rng.choice([10 * MS, 100 * MS]),
                queue_limit=self.rng.choice([0, 2, 8]),
                mem_estimate=self.rng.choice([None, GIB]),
            )
        )

    def detach(self) -> None:
        sid = self.pick()
        self.unchanged = None
        effects = self.s.detach(sid, self.now)
        self.attached.discard(sid)
        self.forget(sid)
        self.apply(effects)

    def pick(self) -> int:
        return self.rng.choice(sorted(self.attached))

    def forget(self, sid: int) -> None:
        grant = self.granted.pop(sid, None)
        self.pending_drop.discard(grant or 0)
        if sid in self.leases and sid not in self.s.holders() and sid not in self.s.queue():
            self.attached.discard(sid)  # a lease that is neither held nor waiting is gone

    def call(self, fn: Callable[[], list[Effect]]) -> None:
        before = state_of(self.s) if self.unchanged is None else self.unchanged
        self.unchanged = None
        try:
            effects = fn()
        except Refused:
            after = state_of(self.s)
            # (Between two calls the test only reads the scheduler: a read that changed it fails here too.)
            assert after == before, "a refused call changed the state"
            self.unchanged = after
            return
        self.apply(effects)

    def apply(self, effects: list[Effect]) -> None:
        self.settled = True
        for e in effects:
            if isinstance(e, Grant):
                assert e.grant not in self.granted.values()
                if self.s.enabled:
                    v = self.s.session(e.session, self.now)
                    assert v.budget_us is None or v.used_us < v.budget_us, "granted while over budget"
                self.granted[e.session] = e.grant
                self.grant_order.append(e.grant)
            elif isinstance(e, Drop):
                assert e.session not in self.leases, "a lease was dropped"
                assert self.granted.get(e.session) == e.grant, "drop aimed at a grant that is not current"
                assert e.grant not in self.pending_drop, "a second drop before the first was answered"
                self.pending_drop.add(e.grant)
                if e.reason == DropReason.TQ:
                    assert e.grant not in self.tq_dropped, "two TQ drops for one grant"
                    self.tq_dropped.add(e.grant)
            elif isinstance(e, Revoke):
                assert self.granted.get(e.session) == e.grant
                self.forget(e.session)
            elif isinstance(e, MemOverLimit):
                assert e.used_bytes > e.limit_bytes
            elif isinstance(e, LeaseDenied):
                assert e.session in self.leases and e.session not in self.granted
                self.attached.discard(e.session)
            elif isinstance(e, HoldOverdue):
                assert e.session in self.leases
        for sid in list(self.granted):
            if sid not in self.s.holders():
                self.forget(sid)
        if not self.s.enabled:  # switching off cancels pending drops, TQ drops included
            self.pending_drop.clear()
            self.tq_dropped.clear()

    def check(self) -> None:
        s, now = self.s, self.now
        holders, queue = s.holders(), s.queue()
        assert set(holders).isdisjoint(queue)
        assert set(holders) | set(queue) <= self.attached
        assert set(holders) == set(self.granted)
        view = s.view(now)
        if not s.enabled:
            assert not queue, "the queue is not empty while the scheduler is off"
        elif not holders and self.settled:
            assert all(w.throttled for w in view.queue), "the GPU is idle but a runnable session waits"
        prios = [w.priority for w in view.queue]
        assert prios == sorted(prios, reverse=True), "queue out of priority order"
        if self.settled:  # every successful call carries out what is due
            deadline = s.next_deadline()
            assert deadline is None or deadline > now, "a deadline is due but was not acted on"
            if s.enabled:
                for h in view.holders:
                    v = s.session(h.session, now)
                    if v.budget_us is not None and v.used_us >= v.budget_us:
                        assert h.drop_pending is not None, "over budget and still running undisturbed"
        # weighted billing never bills more GPU time than the window has had
        window_start = s.accounts.window_start
        billed = sum(s.session(sid, now).used_us for sid in self.attached)
        assert billed <= now - window_start + len(self.attached)
        assert self.grant_order == sorted(self.grant_order)


@pytest.mark.parametrize("seed", range(16))
def test_invariants_hold_under_random_calls(seed: int) -> None:
    m = Model(seed)
    for _ in range(1200):
        m.step()


def test_responsive_clients_are_all_served() -> None:
    """Clients that always answer DROP_LOCK: every waiter is granted in order."""
    s = GpuScheduler(SchedulerConfig(tq_us=10 * MS, drop_timeout_us=5 * MS, mode=Mode.SERIAL))
    for sid in range(1, 6):
        s.attach(sid, 0)
        s.request(sid, sid)
    now, served = 0, [1]
    while len(served) < 5:
        deadline = s.next_deadline()
        assert deadline is not None
        now = deadline
        for e in s.advance(now):
            assert isinstance(e, Drop)
            for g in s.release(e.session, now + 1):
                assert isinstance(g, Grant)
                served.append(g.session)
    assert served == [1, 2, 3, 4, 5]
