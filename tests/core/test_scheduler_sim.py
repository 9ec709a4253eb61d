"""Seeded random simulations of the lock: invariants after every step.

Each seed drives a scheduler through thousands of random calls on fake time
(requests, releases, detaches, scheduler on/off, TQ changes, timer expiries,
clients that ignore DROP_LOCK) and checks what must always hold.
"""

from __future__ import annotations

import random

import pytest

from gpud.core.scheduler import Drop, Effect, Grant, GpuScheduler, Refused, Revoke, SchedulerConfig

MS = 1000


class Model:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.s = GpuScheduler(SchedulerConfig(tq_us=50 * MS, drop_timeout_us=20 * MS))
        self.now = 0
        self.next_id = 1
        self.attached: set[int] = set()
        self.granted: dict[int, int] = {}  # session -> grant no
        self.dropped_grants: set[int] = set()
        self.grant_order: list[int] = []
        self.stubborn: set[int] = set()

    def step(self) -> None:
        self.settled = False
        r = self.rng.random()
        self.now += self.rng.choice([0, 1, 10, 1000, 5 * MS, 30 * MS])
        if (r < 0.1 and len(self.attached) < 12) or len(self.attached) < 2:
            sid = self.next_id
            self.next_id += 1
            self.apply(self.s.attach(sid, self.now, priority=self.rng.choice([0, 0, 0, 10])))
            self.attached.add(sid)
            if self.rng.random() < 0.2:
                self.stubborn.add(sid)
        elif r < 0.45:
            self.try_call(lambda: self.s.request(self.pick(), self.now))
        elif r < 0.7:
            sid = self.pick()
            if sid not in self.stubborn or self.rng.random() < 0.1:
                self.try_call(lambda: self.s.release(sid, self.now))
        elif r < 0.75:
            sid = self.pick()
            effects = self.s.detach(sid, self.now)
            self.attached.discard(sid)
            self.granted.pop(sid, None)
            self.apply(effects)
        elif r < 0.78:
            self.apply(self.s.set_enabled(self.rng.random() < 0.7, self.now))
        elif r < 0.8:
            self.apply(self.s.set_tq(self.rng.choice([1, 10, 50]) * MS, self.now))
        else:
            deadline = self.s.next_deadline()
            if deadline is not None and self.rng.random() < 0.8:
                self.now = max(self.now, deadline)
            self.apply(self.s.advance(self.now))
        self.check()

    def pick(self) -> int:
        return self.rng.choice(sorted(self.attached))

    def try_call(self, call: object) -> None:
        before = repr(self.s.__dict__)
        try:
            effects = call()  # type: ignore[operator]
        except Refused:
            assert repr(self.s.__dict__) == before, "a refused call changed the state"
            return
        self.apply(effects)

    def apply(self, effects: list[Effect]) -> None:
        self.settled = True
        grants = [e for e in effects if isinstance(e, Grant)]
        if self.s.enabled and len(grants) > 1:
            pytest.fail(f"two grants at once while the scheduler is on: {effects}")
        for e in effects:
            if isinstance(e, Grant):
                assert e.grant not in self.granted.values()
                self.granted[e.session] = e.grant
                self.grant_order.append(e.grant)
            elif isinstance(e, Drop):
                assert self.granted.get(e.session) == e.grant, "drop aimed at a grant that is not current"
                assert e.grant not in self.dropped_grants, "two drops for one grant"
                self.dropped_grants.add(e.grant)
            elif isinstance(e, Revoke):
                assert self.granted.pop(e.session) == e.grant
        for sid in list(self.granted):
            if sid in self.attached and self.s.session(sid, self.now).state != "holding":
                del self.granted[sid]

    def check(self) -> None:
        s, now = self.s, self.now
        holders, queue = s.holders(), s.queue()
        assert set(holders).isdisjoint(queue)
        assert set(holders) | set(queue) <= self.attached
        assert set(holders) == set(self.granted)
        if s.enabled and not holders:
            assert not queue, "the lock is free but someone waits"
        if not s.enabled:
            assert not queue, "the queue is not empty while the scheduler is off"
        view = s.view(now)
        keys = [(-w.priority, i) for i, w in enumerate(view.queue)]
        assert [k[0] for k in keys] == sorted(k[0] for k in keys), "queue out of priority order"
        for h in view.holders:
            if h.drop_pending is not None:
                assert h.held_us >= 0
        deadline = s.next_deadline()
        if self.settled:  # every successful call carries out what is due
            assert deadline is None or deadline > now, "a deadline is due but was not acted on"
        assert self.grant_order == sorted(self.grant_order)


@pytest.mark.parametrize("seed", range(40))
def test_invariants_hold_under_random_calls(seed: int) -> None:
    m = Model(seed)
    for _ in range(2000):
        m.step()


def test_responsive_clients_are_all_served() -> None:
    """Clients that always answer DROP_LOCK: every waiter is granted in order."""
    s = GpuScheduler(SchedulerConfig(tq_us=10 * MS, drop_timeout_us=5 * MS))
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
